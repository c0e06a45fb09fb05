"""The benchmark's table (rich) and plot (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..tuning import describe_decision
from .common import MODE_LABELS, MODES, describe_cpu, describe_memory

MULTIATTN_COLOR = "#d1495b"
NATIVE_COLORS = ("#30638e", "#00798c", "#8d96a3")


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.{digits}f}"


def _pair(rec: dict, key: str, digits: int = 2, pct: bool = False) -> str:
    parts = []
    for mode in MODES:
        value = rec.get(mode, {}).get(key)
        if pct:
            parts.append("-" if value is None else f"{100 * value:.0f}%")
        else:
            parts.append(_fmt(value, digits))
    return " / ".join(parts)


def _count(value: float | None) -> str:
    """A count in three digits at most: ``0``, ``812``, ``8.2k``, ``93k``."""
    if value is None:
        return "-"
    if value < 1000:
        return f"{value:.0f}"
    return f"{value / 1000:.2g}k" if value < 10_000 else f"{value / 1000:.0f}k"


def print_report(report: dict, console: Any) -> None:
    from rich.table import Table

    cfg = report["config"]
    console.print(describe_cpu(report.get("machine", {})), markup=False)
    console.print(describe_memory(report.get("machine", {})), markup=False)
    if report.get("implementations"):
        title = (
            f"Multi-head self-attention, batch {cfg['batch']}, length {cfg['length']}, "
            f"width {cfg['width']}, {cfg['heads']} heads, {cfg['dtype']}, CPU: "
            f"median of {cfg['repeats']} (ms forward / fwd+bwd)"
        )
        table = Table(title=title, title_justify="left")
        table.add_column("framework")
        table.add_column("implementation")
        table.add_column("ms", justify="right")
        table.add_column("x fastest native", justify="right")
        table.add_column("GFLOP/s", justify="right")
        table.add_column("% of matmul", justify="right")
        table.add_column("peak MiB", justify="right")
        table.add_column("page faults", justify="right")
        last = None
        for rec in report["implementations"]:
            fw = rec["framework"]
            if last is not None and fw != last:
                table.add_section()
            name = rec["id"] if rec["kind"] == "native" else f"[bold]{rec['id']}[/]"
            if rec["status"] != "ok":
                reason = rec.get("reason", rec["status"])
                reason = reason if len(reason) <= 90 else reason[:87] + "..."
                table.add_row(fw, name, f"[yellow]{reason}[/]")
            else:
                table.add_row(
                    fw,
                    name,
                    _pair(rec, "median_ms"),
                    _pair(rec, "ratio"),
                    _pair(rec, "gflops", 1),
                    _pair(rec, "peak_fraction", pct=True),
                    _pair(rec, "peak_mem_mib", 1),
                    " / ".join(_count(rec.get(m, {}).get("page_faults_per_call")) for m in MODES),
                )
            last = fw
        console.print(table)
        peaks = Table(title="Per worker process", title_justify="left")
        cols = ("framework", "status", "matmul GFLOP/s", "numpy matmul", "max RSS MiB", "memory")
        for col in cols:
            peaks.add_column(col, justify="left" if col in ("framework", "status") else "right")
        for fw, info in report["frameworks"].items():
            mm = info.get("matmul", {})
            status = info["status"] if info["status"] == "ran" else info.get("reason", "")
            peaks.add_row(
                fw,
                status,
                _fmt(mm.get("gflops"), 1)
                + (f" ({mm['route']})" if len(mm.get("routes", {})) > 1 else ""),
                _fmt(mm.get("numpy_float32_gflops"), 1),
                _fmt(info.get("process_max_rss_mib"), 0),
                info.get("memory_method", ""),
            )
        console.print(peaks)
        console.print(
            "x fastest native: the median time over the fastest native layer of the same "
            "framework (below 1 = faster). % of matmul: achieved GFLOP/s over the fastest repeat "
            f"of the worker's {cfg['matmul_size']}x{cfg['matmul_size']} {cfg['dtype']} matmul "
            "(the framework's peak in this run; on torch the faster of torch.matmul and the "
            "oneDNN linear operator multiattn projects with). peak MiB: "
            "memory one call takes above what was in use before it (VmHWM: RSS growth; "
            "tf-allocator: TensorFlow's allocator statistics). page faults: minor page "
            "faults of the worker during one call (median of 3), pages the kernel handed "
            "out and zeroed for it."
        )
        _print_choices(
            console,
            {fw: info.get("kernel_choices", []) for fw, info in report["frameworks"].items()},
            {
                fw: info.get("info", {}).get("torch_projection_library")
                for fw, info in report["frameworks"].items()
            },
        )
    long = report.get("long")
    if long:
        causal = ", causal" if long["causal"] else ""
        table = Table(
            title=(
                f"multiattn.ops.scaled_dot_product_attention on Keras {long['backend']}, "
                f"(1, 8, L, 64) float32{causal}, {_long_pass(long)}, median of {long['repeats']}"
            ),
            title_justify="left",
        )
        cols = ("length", "auto ms", "GFLOP/s", "auto MiB", "blockwise ms", "blockwise MiB")
        for col in (*cols, "direct ms", "direct MiB", "score matrix MiB", "status"):
            table.add_column(col, justify="left" if col == "status" else "right")
        others = [
            {e["length"]: e for e in long.get(f"{path}_results", [])}
            for path in ("blockwise", "direct")
        ]
        for entry in long["results"]:
            ok = entry.get("status") == "ok"
            cells = []
            for other in others:
                o = other.get(entry["length"], {})
                o_ok = o.get("status") == "ok"
                cells += [
                    _fmt(o.get("median_ms")) if o_ok else "-",
                    _fmt(o.get("peak_mem_mib"), 1) if o_ok else "-",
                ]
            table.add_row(
                str(entry["length"]),
                _fmt(entry.get("median_ms")) if ok else "-",
                _fmt(entry.get("gflops"), 1) if ok else "-",
                _fmt(entry.get("peak_mem_mib"), 1) if ok else "-",
                *cells,
                _fmt(entry["score_matrix_gib"] * 1024, 1),
                "ok" if ok else f"[yellow]{entry.get('reason', entry.get('status'))}[/]",
            )
        console.print(table)
        found = [
            d
            for key in ("results", "blockwise_results", "direct_results")
            for entry in long.get(key, [])
            for d in entry.get("kernel_choices", [])
        ]
        _print_choices(console, {long["backend"]: found}, {})


def _print_choices(console: Any, choices: dict[str, list], notes: dict[str, Any]) -> None:
    """The kernel choices multiattn made in each worker (`multiattn.tuning.decisions`),
    each distinct one once."""
    lines = []
    for fw, found in choices.items():
        if notes.get(fw):
            lines.append(f"  {fw}: projection library: {notes[fw]}")
        seen = set()
        for decision in found:
            line = describe_decision(decision)
            if line not in seen:
                seen.add(line)
                lines.append(f"  {fw}: {line}")
    console.print("Kernel choices (multiattn.tuning, measured once per process and shape class):")
    console.print("\n".join(lines) if lines else "  none made", markup=False)


def write_plot(report: dict, path: Path) -> None:
    """Bar chart of ms per implementation (forward, fwd+bwd) grouped by framework; with
    long-sequence results, time and peak memory against the length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = [r for r in report.get("implementations", []) if r["status"] == "ok"]
    long = report.get("long")
    long_ok = [e for e in (long or {}).get("results", []) if e.get("status") == "ok"]
    rows = (1 if impls else 0) + (1 if long else 0)
    if rows == 0:
        rows = 1
    fig, axes = plt.subplots(rows, 2, figsize=(13, 4.5 * rows), squeeze=False)
    row = 0
    if impls:
        cfg = report["config"]
        labels, colors, positions = [], [], []
        pos, last, native_i = 0.0, None, 0
        for rec in impls:
            if last is not None and rec["framework"] != last:
                pos += 0.6  # a gap between frameworks
                native_i = 0
            labels.append(f"{rec['framework']}: {rec['id']}")
            if rec["kind"] == "multiattn":
                colors.append(MULTIATTN_COLOR)
            else:
                colors.append(NATIVE_COLORS[native_i % len(NATIVE_COLORS)])
                native_i += 1
            positions.append(pos)
            pos += 1.0
            last = rec["framework"]
        for col, mode in enumerate(MODES):
            ax = axes[row][col]
            values = [rec[mode]["median_ms"] for rec in impls]
            ax.barh(positions, values, color=colors)
            for y, v, rec in zip(positions, values, impls):
                ax.text(v, y, f" {v:.3g} ms (x{rec[mode]['ratio']:.2f})", va="center", fontsize=7)
            ax.set_yticks(positions, labels, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel("ms per call (median; lower is better)")
            ax.set_title(f"{MODE_LABELS[mode]}", fontsize=10)
            ax.margins(x=0.3)
        fig.text(
            0.5,
            1.0 - 0.02 / rows,
            f"multi-head self-attention, B={cfg['batch']} L={cfg['length']} E={cfg['width']} "
            f"H={cfg['heads']} {cfg['dtype']}, CPU; red: multiattn, blue and teal: native layers; "
            "(xN) = time / fastest native of the framework",
            ha="center",
            va="top",
            fontsize=9,
        )
        row += 1
    if long:
        ax_t, ax_m = axes[row]
        lengths = [e["length"] for e in long_ok]
        series = [
            ("blockwise", "^-", NATIVE_COLORS[1], "blockwise (forced)"),
            ("direct", "s-", NATIVE_COLORS[0], "direct (budget lifted)"),
        ]
        ax_t.plot(
            lengths, [e["median_ms"] for e in long_ok], "o-", color=MULTIATTN_COLOR, label="auto"
        )
        for route, style, color, label in series:
            ok = [e for e in long.get(f"{route}_results", []) if e.get("status") == "ok"]
            ax_t.plot(
                [e["length"] for e in ok],
                [e["median_ms"] for e in ok],
                style,
                color=color,
                label=label,
            )
            ax_m.plot(
                [e["length"] for e in ok],
                [e["peak_mem_mib"] or 0 for e in ok],
                style,
                color=color,
                label=f"peak RSS growth, {label}",
            )
        ax_t.legend(fontsize=8)
        ax_t.set_ylabel("ms per call (median)")
        ax_m.plot(
            lengths,
            [e["peak_mem_mib"] or 0 for e in long_ok],
            "o-",
            color=MULTIATTN_COLOR,
            label="peak RSS growth, auto",
        )
        every = [e["length"] for e in long["results"]]
        ax_m.plot(
            every,
            [e["score_matrix_gib"] * 1024 for e in long["results"]],
            "--",
            color="grey",
            label="full score matrix (B*H*L*L*4 bytes)",
        )
        ax_m.axhline(long["max_gib"] * 1024, color="black", lw=0.8, ls=":", label="--long-max-gib")
        ax_m.set_ylabel("MiB")
        ax_m.legend(fontsize=8)
        failed = [e for e in long["results"] if e.get("status") != "ok"]
        for ax in (ax_t, ax_m):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length L")
            for e in failed:
                ax.axvline(e["length"], color="orange", lw=0.8, ls="--")
        causal = ", causal" if long["causal"] else ""
        ax_t.set_title(
            f"scaled_dot_product_attention (1, 8, L, 64){causal}, {_long_pass(long)}, "
            f"{long['backend']}"
        )
        ax_m.set_title("peak memory (failed lengths: orange lines)")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.05 / rows) if impls else None)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _long_pass(long: dict) -> str:
    return "forward+backward" if long.get("backward") else "forward"

"""``multiattn bench``: multiattn's attention against each framework's own layer.

Every framework runs in its own worker process (`multiattn.bench.worker`), one after the
other; inside a worker the implementations are timed interleaved. The parent turns the
raw times into medians, ratios, GFLOP/s and memory, prints a table and writes JSON and a
plot. ``--long`` instead runs `multiattn.bench.long`: long-sequence attention, one
process per length; ``--decode`` runs `multiattn.bench.decode`: greedy ``generate`` of
GPT-2-, Llama- and Qwen2-shaped models beside transformers'.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..cli import positive_int
from .common import (
    MODES,
    attention_flops,
    code_origin,
    describe_code,
    describe_cpu,
    machine_info,
)
from .impls import FRAMEWORKS, NATIVE_NOTE, missing_modules

DTYPES = ("float32", "float64", "bfloat16", "float16")
#: value of each shape/timing option: (default run, --quick)
PROFILES: dict[str, tuple[Any, Any]] = {
    "batch": (8, 2),
    "length": (512, 64),
    "width": (512, 64),
    "heads": (8, 4),
    "repeats": (10, 3),
    "warmup": (2, 1),
    "min_time": (0.05, 0.01),
    "matmul_size": (2048, 1024),
    "long_lengths": ("1024,2048,4096,8192,16384", "256,512"),
}
MEMORY_NOTE = (
    "peak MiB: per implementation and pass, after the timed runs, the memory one call "
    "takes above what was in use just before it; the larger of two calls. Default (method "
    "VmHWM): garbage collection and malloc_trim, then the growth of the worker process's "
    "resident set size during the call (Linux VmHWM after resetting it through "
    "/proc/self/clear_refs). TensorFlow (method tf-allocator): its CPU allocator keeps freed "
    "memory in a pool, so the RSS does not grow once warmed up; its own statistics give the "
    "peak bytes in use during the call above the bytes in use before it. Either way it "
    "counts what the call allocates (activations, temporaries, outputs, gradients), not the "
    "parameters, inputs or compiled programs that already exist. process_max_rss_mib: "
    "ru_maxrss of the whole worker process (imports, compilation and the matmul included)."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="multiattn bench",
        description=(
            "Time multiattn's multi-head self-attention against each framework's own "
            "layer (forward, forward+backward), side by side, one process per framework."
        ),
    )
    shape = p.add_argument_group("shape (default: batch 8, length 512, width 512, 8 heads)")
    shape.add_argument("--batch", type=positive_int)
    shape.add_argument("--length", type=positive_int)
    shape.add_argument("--width", type=positive_int, help="model width E (divisible by --heads)")
    shape.add_argument("--heads", type=positive_int)
    shape.add_argument("--dtype", choices=DTYPES, default="float32")
    run = p.add_argument_group("run")
    run.add_argument(
        "--frameworks",
        default=",".join(FRAMEWORKS),
        help=f"comma-separated subset of {','.join(FRAMEWORKS)} (default: all)",
    )
    run.add_argument(
        "--repeats", type=positive_int, help="timed repeats (default 10; --quick and --long 3)"
    )
    run.add_argument(
        "--warmup", type=int, help="untimed calls after the first (compiling) one (default 2)"
    )
    run.add_argument(
        "--min-time",
        type=float,
        help="seconds one repeat lasts at least; short calls are repeated (default 0.05)",
    )
    run.add_argument("--matmul-size", type=positive_int, help="side of the peak matmul (2048)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--autotune",
        action="store_true",
        help="also time each multiattn implementation with settings(autotune=True), "
        "side by side with the defaults (layers: a second implementation per framework; "
        "--decode: a second multiattn model per case)",
    )
    run.add_argument(
        "--quick",
        action="store_true",
        help="tiny shape (batch 2, length 64, width 64, 4 heads), 1 warm-up, 3 repeats",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", type=Path, default=Path("bench.json"), help="default bench.json")
    out.add_argument(
        "--plot", default="bench.png", help="PNG path (default bench.png); '' for none"
    )
    long = p.add_argument_group("long sequences (--long)")
    long.add_argument(
        "--long",
        action="store_true",
        help="instead: multiattn.ops.scaled_dot_product_attention on (1, 8, L, 64)",
    )
    long.add_argument(
        "--long-lengths", help="comma-separated L (default 1024,...,16384; --quick 256,512)"
    )
    long.add_argument(
        "--long-backend", default="torch", choices=("torch", "jax", "tensorflow", "numpy")
    )
    long.add_argument("--long-causal", action="store_true", help="causal=True")
    long.add_argument(
        "--long-backward",
        action="store_true",
        help="time forward and backward (gradients of query, key and value)",
    )
    long.add_argument(
        "--long-max-gib",
        type=float,
        default=6.0,
        help="lengths whose full score matrix exceeds this are stopped past it (default 6)",
    )
    dec = p.add_argument_group("decoding (--decode)")
    dec.add_argument(
        "--decode",
        action="store_true",
        help="instead: greedy generate of GPT-2-, Llama- and Qwen2-shaped models against "
        "transformers, with each load's seconds and memory, the first call, and the "
        "memory-bandwidth bound (the machine's read bandwidth, measured)",
    )
    dec.add_argument("--decode-prompts", help="comma-separated prompt lengths (default 128,512)")
    dec.add_argument("--decode-batches", help="comma-separated batch sizes (default 1,8)")
    dec.add_argument("--decode-new-tokens", type=positive_int,
                     help="new tokens (default 64; --decode-size real 32)")  # fmt: skip
    dec.add_argument("--decode-size", choices=("small", "real"), default="small",
                     help="small: every model of width 256, 4 layers (default); real: each "
                     "model at its real shape (default prompts 128,512, batches 1,8)")  # fmt: skip
    dec.add_argument("--decode-models",
                     help="comma-separated models of --decode: gpt2 (GPT-2 small at real "
                     "size, float32), llama (Qwen2-0.5B's shape as a Llama model, float32), "
                     "qwen2 (Qwen2-0.5B, bfloat16), llama1b (Llama-3.2-1B, bfloat16); "
                     "default gpt2,llama, --decode-size real gpt2,qwen2,llama1b")  # fmt: skip
    dec.add_argument("--decode-with", action="append", default=[], metavar="NAME=VALUE,...",
                     help="also run each case under multiattn.config.settings(NAME=VALUE, ...), "
                     "side by side with the defaults (repeatable; values: true, false, none, "
                     "integers or words)")  # fmt: skip
    return p


def _models_arg(parser: argparse.ArgumentParser, raw: str | None, size: str) -> list[str]:
    from .decode import DEFAULT_MODELS, MODELS

    if raw is None:
        return list(DEFAULT_MODELS[size])
    models = [m.strip() for m in raw.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        parser.error(f"--decode-models: expected some of {', '.join(MODELS)}; received {raw!r}")
    return list(dict.fromkeys(models))


def _settings_arg(parser: argparse.ArgumentParser, raw: str) -> dict[str, Any]:
    """``--decode-with``'s ``NAME=VALUE,...`` as `multiattn.config.settings` arguments,
    checked by entering them here."""
    from .. import config

    words = {"true": True, "false": False, "none": None}
    scoped: dict[str, Any] = {}
    for item in (part.strip() for part in raw.split(",") if part.strip()):
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--decode-with: expected NAME=VALUE; received {item!r}")
        value = value.strip()
        scoped[name.strip()] = (
            words[value.lower()] if value.lower() in words
            else int(value) if value.isdigit() else value
        )  # fmt: skip
    try:
        with config.settings(**scoped):
            pass
    except (TypeError, ValueError) as err:
        parser.error(f"--decode-with {raw!r}: {err}")
    if not scoped:
        parser.error(f"--decode-with: no settings in {raw!r}")
    return scoped


def _int_list(parser: argparse.ArgumentParser, flag: str, raw: str) -> list[int]:
    try:
        values = [int(v) for v in raw.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{flag}: not integers: {raw!r}")
    if not values or min(values) < 1:
        parser.error(f"{flag} needs positive integers; received {raw!r}")
    return sorted(set(values))


def decode_config(args: argparse.Namespace, parser: argparse.ArgumentParser, cfg: dict) -> dict:
    """The settings of ``--decode`` (``--quick``: prompts 16 and 32, batches 1 and 2, 8
    new tokens)."""
    quick, real = args.quick, args.decode_size == "real"
    new = args.decode_new_tokens or (8 if quick else 32 if real else 64)
    if new < 2:
        parser.error("--decode-new-tokens must be at least 2 (the rate is of the steps after one)")
    from .decode import FRAMEWORKS as DECODE_FRAMEWORKS

    return {
        "prompts": _int_list(parser, "--decode-prompts",
                             args.decode_prompts or ("16,32" if quick else "128,512")),
        "batches": _int_list(parser, "--decode-batches",
                             args.decode_batches or ("1,2" if quick else "1,8")),
        "new_tokens": new,
        "repeats": args.repeats or 3,
        "frameworks": [f for f in cfg["frameworks"] if f in DECODE_FRAMEWORKS],
        "seed": cfg["seed"],
        "size": args.decode_size,
        "autotune": args.autotune,
        "with": [_settings_arg(parser, v) for v in args.decode_with],
        "models": _models_arg(parser, args.decode_models, args.decode_size),
        # per process (a framework and a model); at real size each prompt-512 batch-8
        # prefill of the 1B bfloat16 model takes minutes on 2 cores, many minutes where
        # the CPU has no bfloat16 instructions
        "timeout": 12 * 3600.0 if real else 3600.0,
        # the read bandwidth's array: well above a last-level cache (--quick: 256 MiB)
        "bandwidth_bytes": (256 if quick else 1024) << 20,
    }  # fmt: skip


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    cfg: dict[str, Any] = {}
    for key, (default, quick) in PROFILES.items():
        value = getattr(args, key)
        cfg[key] = value if value is not None else (quick if args.quick else default)
    if cfg["width"] % cfg["heads"]:
        parser.error(f"--width {cfg['width']} is not divisible by --heads {cfg['heads']}")
    if cfg["warmup"] < 0:
        parser.error("--warmup must be 0 or more")
    if cfg["min_time"] < 0:
        parser.error("--min-time must be 0 or more")
    names = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = [f for f in names if f not in FRAMEWORKS]
    if unknown or not names:
        parser.error(
            f"--frameworks: unknown {', '.join(unknown) or '(none given)'}; "
            f"known: {', '.join(FRAMEWORKS)}"
        )
    try:
        lengths = [int(v) for v in str(cfg["long_lengths"]).split(",") if v.strip()]
    except ValueError:
        parser.error(f"--long-lengths: not integers: {cfg['long_lengths']!r}")
    if not lengths or min(lengths) < 1:
        parser.error("--long-lengths needs positive integers")
    if args.long_max_gib <= 0:
        parser.error("--long-max-gib must be positive")
    if args.long_backward and args.long_backend == "numpy":
        parser.error("--long-backward: the numpy backend computes no gradients")
    cfg.update(
        head_dim=cfg["width"] // cfg["heads"],
        dtype=args.dtype,
        frameworks=names,
        seed=args.seed,
        mm_repeats=max(3, min(cfg["repeats"], 5)),
        long_lengths=sorted(set(lengths)),
        long_backend=args.long_backend,
        long_causal=args.long_causal,
        long_backward=args.long_backward,
        long_max_gib=args.long_max_gib,
        autotune=args.autotune,
        device="cpu",
    )
    return cfg


def _worker_env(framework: str) -> dict[str, str]:
    env = dict(os.environ)
    backend = FRAMEWORKS[framework][0]
    if backend is None:
        env.pop("KERAS_BACKEND", None)
    else:
        env["KERAS_BACKEND"] = backend
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_worker(framework: str, cfg: dict, on_line) -> dict:
    missing = missing_modules(framework)
    if missing:
        return {"status": "skipped", "reason": f"skipped: {', '.join(missing)} not installed"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "multiattn.bench.worker", "--framework", framework]
        cmd += ["--config", json.dumps(cfg), "--out", str(out)]
        proc = subprocess.Popen(
            cmd,
            env=_worker_env(framework),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(line)
                if line.startswith("[bench] "):
                    on_line(line[8:].strip())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        proc.wait()
        reader.join()
        if proc.returncode != 0 or not out.exists():
            tail = " | ".join(s.strip() for s in lines[-4:])
            return {"status": "crashed", "reason": f"exit code {proc.returncode}: {tail}"}
        return json.loads(out.read_text())


def assemble(cfg: dict, workers: dict[str, dict]) -> dict:
    """Medians, ratios to the fastest native layer of each framework, GFLOP/s and the
    fraction of the worker's matmul peak."""
    flops = attention_flops(cfg["batch"], cfg["length"], cfg["width"], cfg["heads"])
    impls: list[dict] = []
    frameworks: dict[str, dict] = {}
    for fw, result in workers.items():
        records = [{"framework": fw, **r} for r in result.pop("implementations", [])]
        frameworks[fw] = {**result, "natives": NATIVE_NOTE[fw], "fastest_native": {}}
        peak = result.get("matmul", {}).get("gflops")
        for mode in MODES:
            natives = [r for r in records if r["kind"] == "native" and mode in r]
            fastest = min(natives, key=lambda r: r[mode]["median_ms"], default=None)
            frameworks[fw]["fastest_native"][mode] = fastest and fastest["id"]
            for r in records:
                if mode not in r:
                    continue
                stats = r[mode]
                stats["gflops"] = flops[mode] / (stats["median_ms"] / 1e3) / 1e9
                stats["peak_fraction"] = stats["gflops"] / peak if peak else None
                stats["ratio"] = (
                    stats["median_ms"] / fastest[mode]["median_ms"] if fastest else None
                )
                # the same, repeat by repeat (neighbours in time), then the median
                pairs = zip(stats["times_ms"], fastest[mode]["times_ms"]) if fastest else ()
                paired = sorted(a / b for a, b in pairs)
                stats["ratio_paired"] = statistics.median(paired) if paired else None
        impls += records
    return {"flops": flops, "frameworks": frameworks, "implementations": impls}


def _save(report: dict, args: argparse.Namespace, console: Any) -> None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    console.print(f"wrote {args.json}")
    if args.plot:
        try:
            from .report import write_plot

            write_plot(report, Path(args.plot))
            console.print(f"wrote {args.plot}")
        except ImportError as err:
            console.print(f"[yellow]no plot: {err} (pip install 'multiattn[bench]')[/]")


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from .report import print_report

    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = resolve(args, parser)
    console = Console() if sys.stdout.isatty() else Console(width=140)
    from importlib.metadata import PackageNotFoundError, version

    try:
        own_version = version("multiattn")
    except PackageNotFoundError:
        own_version = "unknown"
    machine = machine_info()
    machine["load_average_start"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    report: dict[str, Any] = {
        "benchmark": "multiattn bench",
        "multiattn": own_version,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "code": code_origin(),
        "config": cfg,
    }
    mixed = describe_code(report["code"])
    if mixed:
        console.print(f"[yellow]{mixed}[/]", markup=True)
    if machine["load_average_start"] and machine["load_average_start"][0] > 0.5:
        console.print(
            f"[yellow]note: load average {machine['load_average_start'][0]:.2f}; other "
            "processes are using the CPU and will disturb the timings[/]"
        )
    if args.decode:
        from .decode import print_decode, run_decode, write_decode_plot

        dcfg = decode_config(args, parser, cfg)
        with console.status("decoding") as status:
            report["decode"] = run_decode(dcfg, lambda s: status.update(f"decode: {s}"))
        console.print(describe_cpu(machine))
        print_decode(report["decode"], console)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        console.print(f"wrote {args.json}")
        if args.plot:
            write_decode_plot(report["decode"], Path(args.plot))
            console.print(f"wrote {args.plot}")
        ran = [i for i in report["decode"]["frameworks"].values() if i.get("status") == "ran"]
        return 0 if len(ran) == len(report["decode"]["frameworks"]) else 1
    if args.long:
        from .long import run_long

        long_cfg = {
            "backend": cfg["long_backend"],
            "lengths": cfg["long_lengths"],
            "causal": cfg["long_causal"],
            "backward": cfg["long_backward"],
            "max_gib": cfg["long_max_gib"],
            "warmup": args.warmup if args.warmup is not None else 0,
            "repeats": cfg["repeats"] if args.repeats else 3,
        }
        with console.status("long sequences") as status:
            report["long"] = run_long(long_cfg, lambda s: status.update(f"long: {s}"))
        failed = []
    else:
        workers: dict[str, dict] = {}
        for fw in cfg["frameworks"]:
            with console.status(f"{fw}: starting") as status:
                workers[fw] = run_worker(fw, cfg, lambda s, st=status: st.update(s))
            info = workers[fw]
            console.print(
                f"{fw}: {info['status']}"
                + (f" in {info['seconds']:.0f} s" if "seconds" in info else "")
                + (f" ({info['reason']})" if info.get("reason") else "")
            )
        report.update(assemble(cfg, workers))
        report["memory"] = MEMORY_NOTE
        failed = [fw for fw, w in workers.items() if w["status"] == "crashed"]
    if hasattr(os, "getloadavg"):
        machine["load_average_end"] = list(os.getloadavg())
    print_report(report, console)
    _save(report, args, console)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""``multiattn conformance``: run every target in its own process and report.

Exit code 0 only if every case of every target that ran passed (and, with
``--require-all``, no target was skipped for a missing framework).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import fixtures
from .report import print_table, write_html, write_json
from .targets import TargetSpec, all_targets

DTYPES = ("float64", "float32", "float16", "bfloat16")


def parse_tolerances(items: list[str]) -> dict[str, dict[str, float]]:
    """``DTYPE=VALUE`` (outputs and gradients) or ``DTYPE:output=VALUE`` / ``DTYPE:grad=VALUE``."""
    out: dict[str, dict[str, float]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        dtype, _, kind = key.partition(":")
        if not sep or dtype not in DTYPES or kind not in ("", "output", "grad"):
            raise argparse.ArgumentTypeError(
                f"--tolerance expects DTYPE[:output|grad]=VALUE with DTYPE in {', '.join(DTYPES)}; received {item!r}"
            )
        try:
            tol = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--tolerance: {value!r} is not a number (in {item!r})"
            ) from None
        for k in (kind,) if kind else ("output", "grad"):
            out.setdefault(dtype, {})[k] = tol
    return out


def missing_requirement(spec: TargetSpec) -> str | None:
    for module in spec.requires:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


def run_target(spec: TargetSpec, args: argparse.Namespace, on_event) -> dict:
    """Run one target's worker, streaming its events to ``on_event``."""
    reason = missing_requirement(spec)
    if reason:
        return {"status": "skipped", "reason": reason, "cases": []}
    env = dict(os.environ)
    for key, value in spec.env.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    cmd = [
        sys.executable,
        "-m",
        "multiattn.conformance.worker",
        "--target",
        spec.factory,
        "--name",
        spec.name,
        "--cases",
        args.cases,
        "--tolerance",
        json.dumps(args.tolerance),
    ]
    if args.fixtures:
        cmd += ["--fixtures", str(args.fixtures)]
    if args.strict and spec.strict:
        cmd += ["--strict", spec.strict]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr_chunks: list[str] = []
    reader = threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read()), daemon=True)
    reader.start()
    cases, done, informative = [], False, False
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event["event"] == "start":
            informative = bool(event.get("informative"))
        if event["event"] == "case":
            cases.append(event)
        done |= event["event"] == "done"
        on_event(spec.name, event)
    proc.wait()
    reader.join()
    elapsed = time.monotonic() - start
    if proc.returncode != 0 or not done:
        tail = "".join(stderr_chunks).strip().splitlines()[-5:]
        return {
            "status": "crashed",
            "reason": f"exit code {proc.returncode}: " + " | ".join(tail),
            "cases": cases,
            "seconds": elapsed,
            "informative": informative,
        }
    return {"status": "ran", "cases": cases, "seconds": elapsed, "informative": informative}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multiattn conformance",
        description="Run the shared fixtures against every framework target and report the errors.",
    )
    parser.add_argument(
        "--targets",
        default="",
        help="comma-separated target names (default: all); --list shows them",
    )
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="MODULE:CALLABLE",
        help="also run your own implementation (see docs/conformance.md); repeatable",
    )
    parser.add_argument(
        "--cases", default="*", help="comma-separated glob(s) of case names, e.g. 'sdpa_*_f32'"
    )
    parser.add_argument(
        "--fixtures",
        type=Path,
        default=None,
        help="a fixture directory (default: the shipped fixtures)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the full report as JSON")
    parser.add_argument("--html", type=Path, default=None, help="write an HTML heatmap report")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="deterministic kernels, JAX highest matmul precision, TF32 off",
    )
    parser.add_argument(
        "--require-all", action="store_true", help="fail when a target's framework is not installed"
    )
    parser.add_argument(
        "--tolerance",
        action="append",
        default=[],
        metavar="DTYPE[:output|grad]=VALUE",
        help="override the stored tolerances (max relative error); repeatable",
    )
    parser.add_argument("--jobs", type=int, default=2, help="targets run at once (default 2)")
    parser.add_argument("--list", action="store_true", help="list the targets and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.tolerance = parse_tolerances(args.tolerance)
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1; received {args.jobs}")
    console = Console() if sys.stdout.isatty() else Console(width=120)
    available = all_targets()
    if args.list:
        for spec in available.values():
            missing = missing_requirement(spec)
            console.print(
                f"{spec.name:20} {spec.description}"
                + (f"  [yellow](skipped: {missing})[/]" if missing else "")
            )
        return 0
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    if not names and not args.target:
        names = list(available)  # default: every built-in and registered target
    unknown = [n for n in names if n not in available]
    if unknown:
        parser.error(
            f"--targets: unknown target(s) {', '.join(unknown)}; known: {', '.join(available)}"
        )
    specs = [available[n] for n in names]
    for i, factory in enumerate(args.target):
        if ":" not in factory:
            parser.error(f"--target expects MODULE:CALLABLE; received {factory!r}")
        specs.append(TargetSpec(f"user-{i + 1}:{factory}", factory, description="--target"))
    try:
        manifest = fixtures.read_manifest(args.fixtures or fixtures.DEFAULT_DIR)
    except (FileNotFoundError, ValueError) as err:
        parser.error(f"--fixtures: {err}")

    results: dict[str, dict] = {}
    start = time.monotonic()
    with Progress(
        TextColumn("{task.description:24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[note]}"),
        console=console,
        transient=False,
    ) as progress:
        tasks = {s.name: progress.add_task(s.name, total=None, note="waiting") for s in specs}
        lock = threading.Lock()

        def on_event(name: str, event: dict) -> None:
            with lock:
                task = tasks[name]
                if event["event"] == "start":
                    progress.update(task, total=event["total"], note="running")
                elif event["event"] == "case":
                    failed = progress.tasks[task].fields.get("failed", 0) + (
                        event["status"] in ("fail", "error")
                    )
                    progress.update(
                        task,
                        advance=1,
                        failed=failed,
                        note=f"[red]{failed} failed[/]" if failed else "",
                    )

        def job(spec: TargetSpec) -> tuple[str, dict]:
            res = run_target(spec, args, on_event)
            with lock:
                if res["status"] == "skipped":
                    progress.update(
                        tasks[spec.name],
                        total=1,
                        completed=1,
                        note=f"[yellow]skipped: {res['reason']}[/]",
                    )
                elif res["status"] == "crashed":
                    progress.update(tasks[spec.name], note="[red]crashed[/]")
            return spec.name, res

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for name, res in pool.map(job, specs):
                results[name] = res
    elapsed = time.monotonic() - start
    print_table(results, console)
    meta = {
        "oracle_version": manifest["oracle_version"],
        "fixtures": str(args.fixtures or fixtures.DEFAULT_DIR),
        "seconds": round(elapsed, 1),
        "strict": args.strict,
        "tolerance_overrides": args.tolerance,
    }
    if args.json:
        write_json(results, args.json, meta)
    if args.html:
        write_html(results, args.html, meta)
    failed = [
        (t, e["case"])
        for t, r in results.items()
        for e in r["cases"]
        if e["status"] in ("fail", "error")
    ]
    crashed = [t for t, r in results.items() if r["status"] == "crashed"]
    skipped = [t for t, r in results.items() if r["status"] == "skipped"]
    ran = sum(
        1
        for r in results.values()
        for e in r["cases"]
        if e["status"] in ("pass", "depart", "fail", "error")
    )
    for target, case in failed[:20]:
        console.print(f"[red]FAILED[/] {target} {case}")
    if crashed:
        console.print(f"[red]crashed targets:[/] {', '.join(crashed)}")
    code = 1 if failed or crashed or (args.require_all and skipped) else 0
    verdict = (
        "[green]conformance: every case of every target that ran passed[/]"
        if code == 0
        else "[red]conformance: FAILED[/]"
    )
    console.print(
        f"{verdict} ({ran} case runs over {len(results) - len(skipped)} targets in {elapsed:.0f}s"
        + (f"; skipped targets: {', '.join(skipped)}" if skipped else "")
        + ")"
    )
    return code


if __name__ == "__main__":
    sys.exit(main())

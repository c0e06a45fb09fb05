"""``multiattn conformance``: run every target in its own process and report.

Exit code 0 only if at least one case ran and every case of every target that ran passed
(and, with ``--require-all``, no target was skipped for a missing framework); 1 when a
case failed, a target crashed or hung (killed after ``--timeout`` seconds), fixtures were
tampered with, or nothing ran; 2 for a usage error; 130 when interrupted (Ctrl-C), 143
when terminated (SIGTERM): the workers are killed first.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import fixtures
from .report import failure_reason, print_table, write_html, write_json
from .targets import TargetSpec, all_targets

DTYPES = ("float64", "float32", "float16", "bfloat16")

#: Seconds a target's worker may run before it is killed and reported as hung. Measured on a
#: 2-core CPU machine (220 cases, one target at a time): keras-jax, which compiles every
#: case, took 317 s; every other target 2 to 18 s. Thirty minutes leaves room for two at
#: once on a busy machine and for more cases; a slower machine passes --timeout.
DEFAULT_TIMEOUT = 1800.0
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 143


class Terminated(Exception):
    """SIGTERM reached the runner: stop the workers and exit like an interrupt."""


class Workers:
    """The worker processes running now. Each starts in a process group of its own, so
    that it, and every process it started, can be killed at once (on its timeout, or when
    the run is interrupted); a terminal's Ctrl-C reaches only the runner, which does it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, tuple[str, subprocess.Popen]] = {}
        self.stopped = False

    def start(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen | None:
        """Start a worker; None once the run is stopping."""
        group = (
            {"start_new_session": True}
            if os.name == "posix"
            else {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
        )
        with self._lock:
            if self.stopped:
                return None
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                encoding="utf-8",
                errors="replace",
                **group,
            )
            self._running[proc.pid] = (name, proc)
            return proc

    def finished(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.pop(proc.pid, None)

    def stop_all(self) -> list[str]:
        """Kill every running worker and its children; the names of their targets."""
        with self._lock:
            self.stopped = True
            running = list(self._running.values())
        for _, proc in running:
            kill_tree(proc)
        for _, proc in running:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        return [name for name, _ in running]


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill a worker and every process in its group (the children it started)."""
    if os.name == "posix":
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    else:
        subprocess.run(["taskkill", "/F", "/T", "/PID", str(proc.pid)], capture_output=True)
        try:
            proc.kill()
        except OSError:
            pass


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


def _where(state: dict) -> str:
    """Where a worker was when it was killed, from the events it had sent."""
    if state["total"] is None:
        return "while starting (importing its framework, loading the fixtures)"
    if state["done"]:
        return "after its last case, while exiting"
    reported = f"{len(state['cases'])} of {state['total']} cases reported"
    if state["current"]:
        return f"in case {state['current']} ({reported})"
    return f"between cases ({reported})"


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_target(
    spec: TargetSpec,
    args: argparse.Namespace,
    on_event,
    verified: fixtures.Fixtures,
    workers: Workers,
) -> dict:
    """Run one target's worker, streaming its events to ``on_event``; kill it (and its
    children) after ``args.timeout`` seconds."""
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
        "--manifest-sha256",
        verified.digest,
    ]
    if args.fixtures:
        cmd += ["--fixtures", str(args.fixtures)]
    if args.strict and spec.strict:
        cmd += ["--strict", spec.strict]
    start = time.monotonic()
    proc = workers.start(spec.name, cmd, env)
    if proc is None:
        return {"status": "interrupted", "reason": "the run was stopped", "cases": []}
    stderr_chunks: list[str] = []
    state: dict = {"cases": [], "done": False, "informative": False, "total": None}
    state.update(current=None, tampered=None)

    def read_events() -> None:
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(event, dict) or "event" not in event:
                continue
            kind = event["event"]
            if kind == "start":
                state["informative"] = bool(event.get("informative"))
                state["total"] = event.get("total")
            elif kind == "begin":
                state["current"] = event.get("case")
            elif kind == "case":
                state["cases"].append(event)
                state["current"] = None
            elif kind == "tampered":
                state["tampered"] = event.get("reason", "")
            state["done"] |= kind == "done"
            on_event(spec.name, event)

    readers = [
        threading.Thread(target=read_events, daemon=True),
        threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read()), daemon=True),
    ]
    for reader in readers:
        reader.start()
    hung = False
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        hung = True
        kill_tree(proc)
        proc.wait()
    finally:
        workers.finished(proc)
    for reader in readers:
        reader.join(timeout=10)  # bounded: a stray grandchild may hold the pipes open
    elapsed = time.monotonic() - start
    base = {"cases": state["cases"], "seconds": elapsed, "informative": state["informative"]}
    if hung:
        reason = f"killed after {args.timeout:g}s (--timeout) {_where(state)}"
        return {"status": "hung", "reason": reason, **base}
    if workers.stopped:
        return {"status": "interrupted", "reason": "the run was stopped", **base}
    if state["tampered"] is not None:
        return {"status": "tampered", "reason": state["tampered"], **base}
    if proc.returncode != 0 or not state["done"]:
        tail = " | ".join("".join(stderr_chunks).strip().splitlines()[-5:])
        reason = f"{_exit_reason(proc.returncode)} {_where(state)}" + (f": {tail}" if tail else "")
        return {"status": "crashed", "reason": reason, **base}
    return {"status": "ran", **base}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multiattn conformance",
        description="Run the shared fixtures against every framework target and report the errors.",
        epilog="Whole models: 'multiattn conformance --families [NAMES] [--frameworks LIST] "
        "[--dtype float32|float64]' checks the shipped model-family cases (bert, vit, gpt2, "
        "llama, qwen2, mistral, t5) against transformers' stored float64 outputs; "
        "'multiattn conformance --model DIR [--frameworks LIST] [--dtype float32|float64]' "
        "checks a Hugging Face model folder of your own against transformers. --frameworks "
        "is a comma-separated subset of jax,torch,tensorflow,numpy,paddle. Each has its own "
        "--help ('multiattn conformance --families --help', 'multiattn conformance --model "
        "DIR --help').",
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
        help="run your own implementation (see docs/conformance.md); repeatable. Only the "
        "targets given run: alone, instead of the built-in ones; with --targets, beside the "
        "ones it names",
    )
    parser.add_argument(
        "--cases", default="*", help="comma-separated glob(s) of case names, e.g. 'sdpa_*_f32'"
    )
    parser.add_argument(
        "--fixtures",
        type=Path,
        default=None,
        help="a fixture directory of your own (default: the shipped fixtures); its cases "
        "named like shipped ones must be those cases",
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
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="kill a target's worker (and its children) that has not finished after this "
        f"long and report it as hung (default {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument("--list", action="store_true", help="list the targets and exit")
    parser.add_argument(
        "--list-cases",
        action="store_true",
        help="list the case variants with their description and properties, and exit",
    )
    return parser


def print_cases(console) -> None:
    """The case variants (`multiattn.conformance.spec`): name, op, dtypes, description and
    the properties each exercises, on the rich ``console``."""
    from . import spec

    for row in spec.table():
        console.print(
            f"[bold]{row['variant']}[/] ({row['op']}; {' '.join(row['dtypes'])}): "
            f"{row['description']}",
            highlight=False,
        )
        console.print(f"    {', '.join(row['properties']) or '-'}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    """Run the suite; Ctrl-C or SIGTERM kill the workers and end it with a short message."""
    workers = Workers()
    restore = _raise_on_sigterm()
    try:
        return _main(argv, workers)
    except BrokenPipeError:  # the reader of stdout is gone (`... | head`): end quietly
        stopped = workers.stop_all()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail
        return EXIT_FAILED if stopped or not _listing(argv) else 0
    except (KeyboardInterrupt, Terminated) as stop:
        stopped = workers.stop_all()
        interrupted = isinstance(stop, KeyboardInterrupt)
        print(
            f"\nconformance: {'interrupted' if interrupted else 'terminated'}"
            + (f"; stopped the running target(s) {', '.join(stopped)}" if stopped else ""),
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED if interrupted else EXIT_TERMINATED
    finally:
        restore()


def _console_class():
    """rich's Console, except that a closed stdout raises `BrokenPipeError` (rich's own
    answer is exit status 1), for `main` to end the run as it should."""
    from rich.console import Console

    class RunnerConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return RunnerConsole


def _listing(argv: list[str] | None) -> bool:
    """Whether the command only lists (``--list``, ``--list-cases``): a listing cut short
    by its reader (``| head``) did what was asked; a run cut short did not finish."""
    args = sys.argv[1:] if argv is None else argv
    return any(a in ("--list", "--list-cases") for a in args)


def _raise_on_sigterm():
    """Turn SIGTERM into `Terminated` (only the main thread can handle signals); returns
    what restores the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None, workers: Workers) -> int:
    from rich.markup import escape

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.tolerance = parse_tolerances(args.tolerance)
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1; received {args.jobs}")
    if not args.timeout > 0 or args.timeout == float("inf"):
        parser.error(f"--timeout must be a positive number of seconds; received {args.timeout:g}")
    console_class = _console_class()
    console = console_class() if sys.stdout.isatty() else console_class(width=120)
    if args.list_cases:
        print_cases(console)
        return 0
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
    if args.targets.strip() and not names:
        parser.error(f"--targets names no target; received {args.targets!r}")
    if not names and not args.target:
        names = list(available)  # default: every built-in and registered target
    unknown = [n for n in names if n not in available]
    if unknown:
        parser.error(
            f"--targets: unknown target(s) {', '.join(unknown)}; known: {', '.join(available)}"
        )
    specs = [available[n] for n in dict.fromkeys(names)]
    for i, factory in enumerate(args.target):
        if ":" not in factory:
            parser.error(f"--target expects MODULE:CALLABLE; received {factory!r}")
        specs.append(TargetSpec(f"user-{i + 1}:{factory}", factory, description="--target"))
    where = args.fixtures or fixtures.DEFAULT_DIR
    try:
        verified = fixtures.verify(args.fixtures)
    except fixtures.TamperedError as err:
        console.print(f"[red]TAMPERED[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        console.print("[red]conformance: FAILED[/] (the fixtures cannot be trusted; nothing ran)")
        return EXIT_FAILED
    except (OSError, ValueError) as err:
        parser.error(f"--fixtures {where}: {err}")
    patterns = [c.strip() for c in args.cases.split(",") if c.strip()]
    selected, tampered = verified.select(patterns)
    every = [m["name"] for m in verified.manifest["cases"]]
    if not every:
        parser.error(f"--fixtures {where}: the manifest lists no case")
    if not selected and not tampered:
        parser.error(
            f"--cases {args.cases!r} selects none of the {len(every)} cases in {where} "
            f"(names look like {every[0]}, {every[-1]})"
        )

    results: dict[str, dict] = {}
    start = time.monotonic()
    if selected:
        results = _run_targets(specs, args, verified, workers, console)
    elapsed = time.monotonic() - start
    if results:
        print_table(results, console)
    bad_fixtures = _tampered_lines(verified, patterns)
    for line in bad_fixtures:
        console.print(f"[red]TAMPERED[/] {escape(line)}", highlight=False, soft_wrap=True)
    meta = {
        "oracle_version": verified.manifest.get("oracle_version"),
        "fixtures": str(where),
        "fixtures_shipped": verified.shipped,
        "manifest_sha256": verified.digest,
        "tampered": verified.tampered,
        "seconds": round(elapsed, 1),
        "strict": args.strict,
        "timeout": args.timeout,
        "tolerance_overrides": args.tolerance,
    }
    if args.json:
        write_json(results, args.json, meta)
    if args.html:
        write_html(results, args.html, meta)
    failed = [
        (t, e) for t, r in results.items() for e in r["cases"] if e["status"] in ("fail", "error")
    ]
    by_status: dict[str, list[str]] = {}
    for t, r in results.items():
        by_status.setdefault(r["status"], []).append(t)
    skipped = by_status.get("skipped", [])
    ran = sum(
        1
        for r in results.values()
        for e in r["cases"]
        if e["status"] in ("pass", "depart", "fail", "error")
    )
    for target, event in failed[:20]:
        reason = escape(failure_reason(event))
        console.print(
            f"[red]FAILED[/] {target} {event['case']}: {reason}", highlight=False, soft_wrap=True
        )
    if len(failed) > 20:
        console.print(f"... and {len(failed) - 20} more failed case runs (--json has them all)")
    for status, label in (("crashed", "crashed"), ("hung", "hung"), ("tampered", "tampered")):
        if by_status.get(status):
            console.print(f"[red]{label} targets:[/] {', '.join(by_status[status])}")
    problems = []
    if not selected:
        problems.append(f"every selected case is tampered ({len(tampered)}); nothing ran")
    elif len(skipped) == len(results):
        problems.append("no target ran (every one was skipped)")
    elif ran == 0:
        problems.append(
            "no case ran"
            + (
                f": the targets support none of the {len(selected)} selected case(s)"
                if set(by_status) <= {"ran", "skipped"}
                else ""
            )
        )
    for problem in problems:
        console.print(f"[red]{problem}[/]")
    code = (
        EXIT_FAILED
        if failed
        or problems
        or bad_fixtures
        or any(by_status.get(s) for s in ("crashed", "hung", "tampered"))
        or (args.require_all and skipped)
        else 0
    )
    verdict = (
        "[green]conformance: every case of every target that ran passed[/]"
        if code == 0
        else "[red]conformance: FAILED[/]"
    )
    console.print(
        f"{verdict} ({ran} case runs over {len(results) - len(skipped)} targets in {elapsed:.0f}s"
        + (f"; skipped targets: {', '.join(skipped)}" if skipped else "")
        + (f"; {len(tampered)} tampered case(s) not run" if tampered else "")
        + (f"; tolerance overrides: {json.dumps(args.tolerance)}" if args.tolerance else "")
        + ("" if verified.shipped else f"; fixtures of your own: {where}")
        + ")",
        highlight=False,
        soft_wrap=True,
    )
    return code


def _tampered_lines(verified: fixtures.Fixtures, patterns: list[str]) -> list[str]:
    """One line per tampered archive or case that the selection touches."""
    lines = []
    for key, why in verified.tampered.items():
        metas = [m for m in verified.manifest["cases"] if key in (m["name"], m["file"])]
        hit = [m["name"] for m in metas if any(fnmatch.fnmatchcase(m["name"], p) for p in patterns)]
        if hit:
            lines.append(f"{why} ({len(hit)} selected case(s) not run)")
    return lines


def _run_targets(
    specs: list[TargetSpec],
    args: argparse.Namespace,
    verified: fixtures.Fixtures,
    workers: Workers,
    console: Any,
) -> dict[str, dict]:
    """Run the targets, ``args.jobs`` at a time, with a progress bar per target."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: dict[str, dict] = {}
    columns = (
        TextColumn("{task.description:24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[note]}"),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        tasks = {s.name: progress.add_task(s.name, total=None, note="waiting") for s in specs}
        lock = threading.Lock()

        def on_event(name: str, event: dict) -> None:
            with lock:
                task = tasks[name]
                if event["event"] == "start":
                    progress.update(task, total=event.get("total"), note="running")
                elif event["event"] == "case":
                    failed = progress.tasks[task].fields.get("failed", 0) + (
                        event.get("status") in ("fail", "error")
                    )
                    progress.update(
                        task,
                        advance=1,
                        failed=failed,
                        note=f"[red]{failed} failed[/]" if failed else "",
                    )

        notes = {
            "skipped": "[yellow]skipped: {reason}[/]",
            "crashed": "[red]crashed[/]",
            "hung": "[red]hung: killed after {timeout:g}s[/]",
            "tampered": "[red]tampered fixtures[/]",
        }
        queue = list(specs)

        def job() -> None:
            while True:
                with lock:
                    if not queue or workers.stopped:
                        return
                    spec = queue.pop(0)
                res = run_target(spec, args, on_event, verified, workers)
                with lock:
                    results[spec.name] = res
                    note = notes.get(res["status"])
                    if note:
                        extra = {"total": 1, "completed": 1} if res["status"] == "skipped" else {}
                        progress.update(
                            tasks[spec.name],
                            note=note.format(reason=res.get("reason", ""), timeout=args.timeout),
                            **extra,
                        )

        threads = [
            threading.Thread(target=job, daemon=True) for _ in range(min(args.jobs, len(specs)))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # joined in slices, so that Ctrl-C is seen at once
                thread.join(0.2)
    return {s.name: results[s.name] for s in specs if s.name in results}


if __name__ == "__main__":
    sys.exit(main())

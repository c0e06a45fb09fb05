"""Test harness: framework suites run in their own processes, one per worker.

``KERAS_BACKEND`` is read once when Keras is imported, so ``tests/backend/`` cannot run
under several backends in one process. This conftest (the outer session) does not
import Keras. When ``tests/backend`` is part of the run it starts one worker pytest per
backend (``MULTIATTN_TEST_BACKEND=<name>``), collects every worker's per-test results and
replays them here as items whose ids name the backend (``test_x[jax-...]``), so one
summary counts every test of every backend and a crashing backend never hides another's
results.

Besides the four Keras backends, suites that need a process of their own (the Paddle
adapter, which must import paddle before anything can load TensorFlow and runs with no
Keras backend chosen) are further workers: see ``WORKERS``.

While backend workers run, the tests of ``tests/`` itself (the framework-free ones:
oracle, conformance runner, ports, CLI) run as one more worker, ``core``, beside them
instead of after them, when the run names whole files or directories (no ``::``): on a
two-core machine the backend workers and the framework-free tests, which mostly wait on
subprocesses of one framework each, then share the machine instead of taking turns.

Environment:
    MULTIATTN_TEST_BACKENDS: comma-separated subset of the worker names
        (jax, torch, tensorflow, numpy, paddle).
    MULTIATTN_TEST_JOBS: how many workers run at once (default 2).
    MULTIATTN_TEST_WORKER_TIMEOUT: seconds a worker may run before it is stopped and
        reported as failed with the end of its output (default 2700; twice that for
        ``core``, the longest).
    MULTIATTN_TEST_SLOWEST: how many of the workers' slowest tests and test files the
        summary lists (default 25; 0 lists none).
    MULTIATTN_TEST_XLA_FAST_COMPILE: ``0`` runs the jax, tensorflow and core workers
        (and the processes they start) with XLA's default compiler options; by default
        they compile with `_xla_flags.FAST_COMPILE` (see `_xla_flags.fast_compile_flags`).

A worker whose whole directory runs (no narrower path given) may be split into several
processes that each run a share of its test files (`SHARDS`): the longest backend then
no longer holds up a two-core run alone. Every share's results carry the backend's name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _xla_flags import fast_compile_env

HERE = Path(__file__).resolve().parent
BACKEND_DIR = HERE / "backend"
PADDLE_DIR = HERE / "paddle"
ROOT = HERE.parent
WORKER_ENV = "MULTIATTN_TEST_BACKEND"
IS_WORKER = WORKER_ENV in os.environ
if IS_WORKER:
    # A worker may import TensorFlow and, through transformers, torch._dynamo's triton:
    # triton must come first (importing it after TensorFlow kills the process), before any
    # test or conftest below loads a framework. See multiattn.conformance.import_order.
    from multiattn.conformance.import_order import import_triton_first

    import_triton_first()
# worker name -> (test directory, environment: a value of None removes the variable)
WORKERS: dict[str, tuple[Path, dict[str, str | None]]] = {
    "jax": (BACKEND_DIR, {"KERAS_BACKEND": "jax", "JAX_ENABLE_X64": "1"}),
    "torch": (BACKEND_DIR, {"KERAS_BACKEND": "torch"}),
    "tensorflow": (BACKEND_DIR, {"KERAS_BACKEND": "tensorflow"}),
    "numpy": (BACKEND_DIR, {"KERAS_BACKEND": "numpy"}),
    "paddle": (PADDLE_DIR, {"KERAS_BACKEND": None}),
}
BACKENDS = tuple(WORKERS)
#: the worker that runs the tests of ``tests/`` itself beside the backend workers
CORE = "core"
#: the order workers start in: the longest first (measured on the CI machine), so that
#: the short ones fill in at the end
START_ORDER = (CORE, "jax", "tensorflow", "torch", "paddle", "numpy")
#: worker name -> processes its whole directory is split into (test files dealt by size)
SHARDS = {"jax": 2}
WORKER_TIMEOUT = float(os.environ.get("MULTIATTN_TEST_WORKER_TIMEOUT", "2700"))
WORKER_DIRS = {d for d, _ in WORKERS.values()}


@pytest.fixture
def autotuned():
    """The test's choices timed on the machine (``settings(autotune=True)``); for the
    workers' tests of timed choices. The decisions are forgotten afterwards: decisions a
    process holds apply with autotune off too, and the next test starts without them."""
    from multiattn import tuning
    from multiattn.config import settings

    with settings(autotune=True):
        yield
    tuning.reset()


def _selected_backends() -> list[str]:
    raw = os.environ.get("MULTIATTN_TEST_BACKENDS", "")
    names = [b.strip() for b in raw.split(",") if b.strip()] or list(BACKENDS)
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        raise pytest.UsageError(f"MULTIATTN_TEST_BACKENDS: unknown backend(s) {unknown}")
    return names


def _worker_paths(config: pytest.Config, directory: Path) -> list[str]:
    """Paths inside ``directory`` that this run asks for (empty: none)."""
    paths = []
    for arg in config.args:
        path = Path(arg.split("::")[0]).resolve()
        if path == directory:
            paths.append(str(directory))  # however it was spelled: `_shares` splits it
        elif directory in path.parents:
            paths.append(arg)
        elif path in directory.parents:
            paths.append(str(directory))
    return sorted(set(paths))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config):
    path = collection_path.resolve()
    for directory in WORKER_DIRS:
        inside = path == directory or directory in path.parents
        if inside and (not IS_WORKER or os.environ.get("MULTIATTN_TEST_DIR") != str(directory)):
            return True
    return None


class _RunElsewhere(pytest.File):
    """A test file of a worker directory named on the outer command line: its tests run
    in the worker (imported here they would load a framework into the outer process)."""

    def collect(self):
        return []


def pytest_pycollect_makemodule(module_path: Path, parent):
    if IS_WORKER:
        return None
    path = Path(module_path).resolve()
    if any(directory in path.parents for directory in WORKER_DIRS):
        return _RunElsewhere.from_parent(parent, path=module_path)
    return None


class ReplayFailure(Exception):
    pass


class ReplayItem(pytest.Item):
    """One test result reported by a backend worker."""

    def __init__(self, *, record: dict, **kwargs):
        super().__init__(**kwargs)
        self.record = record
        self.add_marker(pytest.mark.backend(record["backend"]))
        # Let -k match the module and directory names, as for a normally collected test.
        for part in record["nodeid"].split("::")[0].split("/"):
            self.extra_keyword_matches.add(part.removesuffix(".py"))

    def runtest(self) -> None:
        outcome = self.record["outcome"]
        if outcome == "skipped":
            pytest.skip(self.record.get("reason") or "skipped by the backend worker")
        if outcome != "passed":
            raise ReplayFailure(self.record.get("longrepr") or "failed in the backend worker")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ReplayFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, self.nodeid


def _worker(name: str) -> tuple[Path, dict[str, str | None]]:
    """A worker's test directory and environment overrides: `WORKERS`, or for `CORE`
    the tests of ``tests/`` itself with the environment as it is."""
    return (HERE, {}) if name == CORE else WORKERS[name]


def _shares(backend: str, paths: list[str]) -> list[list[str]]:
    """``paths`` as one job, or, for a worker of `SHARDS` asked for its whole directory,
    its test files dealt into that many jobs (largest first, each to the lightest)."""
    directory = _worker(backend)[0]
    count = SHARDS.get(backend, 1)
    if count < 2 or paths != [str(directory)]:
        return [paths]
    files = sorted(directory.glob("test_*.py"), key=lambda f: (-f.stat().st_size, f.name))
    bins: list[tuple[int, list[str]]] = [(0, []) for _ in range(count)]
    for f in files:
        size, names = min(bins, key=lambda b: b[0])
        bins.remove((size, names))
        bins.append((size + f.stat().st_size, [*names, str(f)]))
    return [sorted(names) for _, names in bins if names]


def _run_worker(
    backend: str, paths: list[str], extra: list[str], part: str = ""
) -> tuple[str, list[dict], str, float]:
    directory, overrides = _worker(backend)
    timeout = WORKER_TIMEOUT * (2 if backend == CORE else 1)
    env = dict(os.environ)
    env.update({WORKER_ENV: backend, "MULTIATTN_TEST_DIR": str(directory), "PYTHONHASHSEED": "0"})
    for key, value in overrides.items():  # JAX_ENABLE_X64: float64 cases need real float64
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # core's tests start processes of either XLA (conformance, examples, model checks)
    env.update(fast_compile_env() if backend == CORE else fast_compile_env(backend))
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        env["MULTIATTN_TEST_REPORT"] = str(report)
        cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", *extra]
        start = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as err:
            out = (err.stdout or b"") + (err.stderr or b"")
            proc = subprocess.CompletedProcess(
                cmd, returncode=-1, stdout=out.decode(errors="replace"),
                stderr=f"\nstopped after {timeout:g} s (MULTIATTN_TEST_WORKER_TIMEOUT)",
            )  # fmt: skip
        elapsed = time.monotonic() - start
        records = []
        if report.exists():
            for line in report.read_text().splitlines():
                rec = json.loads(line)
                rec["backend"] = backend
                records.append(rec)
    log = proc.stdout + proc.stderr
    # exit 5: nothing collected (every selected module skipped itself), not a failure
    if proc.returncode not in (0, 1, 5) or (not records and proc.returncode != 5):
        records.append(
            {
                "nodeid": f"{directory.relative_to(ROOT)}::worker[{backend}{part}]",
                "outcome": "failed",
                "backend": backend,
                "longrepr": f"backend worker exited with code {proc.returncode}\n{log[-6000:]}",
            }
        )
    return backend, records, log, elapsed


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection sees the item list
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list):
    if IS_WORKER:
        return
    wanted = {name: _worker_paths(config, WORKERS[name][0]) for name in _selected_backends()}
    wanted = {name: paths for name, paths in wanted.items() if paths}
    if not wanted:
        return
    extra = []
    for opt in ("keyword", "markexpr"):
        value = getattr(config.option, opt, "")
        if value:
            extra += ["-k" if opt == "keyword" else "-m", value]
    core = _core_files(config, items)
    if core:
        wanted[CORE] = core
        items.clear()  # their results come back from the worker
    backends = list(wanted)
    runs = []  # (backend, paths, part label), the longest first
    for b in sorted(backends, key=START_ORDER.index):
        shares = _shares(b, wanted[b])
        runs += [(b, p, f" {i + 1}/{len(shares)}" if len(shares) > 1 else "")
                 for i, p in enumerate(shares)]  # fmt: skip
    jobs = max(1, int(os.environ.get("MULTIATTN_TEST_JOBS", "2")))
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    results: dict[str, list] = {b: [] for b in backends}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_run_worker, b, p, extra, part) for b, p, part in runs]
        for fut, (_, _, part) in zip(futures, runs):
            backend, records, _log, elapsed = fut.result()
            results[backend] += records
            if reporter is not None:
                counts = {}
                for rec in records:
                    counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
                summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
                reporter.write_line(f"worker {backend}{part}: {summary} in {elapsed:.0f}s")
    config.stash[_WORKER_RECORDS] = [rec for b in backends for rec in results[b]]
    for backend in backends:
        for rec in results[backend]:
            name = rec["nodeid"].split("::", 1)[-1]
            items.append(
                ReplayItem.from_parent(session, name=name, nodeid=rec["nodeid"], record=rec)
            )


_WORKER_RECORDS = pytest.StashKey[list]()


def _slowest_shown() -> int:
    """How many of the slowest tests run by workers, and of the slowest test files, the
    outer session lists (``MULTIATTN_TEST_SLOWEST``, default 25): its own --durations
    only sees the replayed results, which take no time."""
    raw = os.environ.get("MULTIATTN_TEST_SLOWEST", "25")
    if not raw.strip().isdigit():
        raise pytest.UsageError(f"MULTIATTN_TEST_SLOWEST: a count >= 0; received {raw!r}")
    return int(raw)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if IS_WORKER:
        return
    shown = _slowest_shown()
    records = config.stash.get(_WORKER_RECORDS, [])
    timed = sorted((r for r in records if r.get("duration")), key=lambda r: -r["duration"])
    if not timed or not shown:
        return
    terminalreporter.section(f"slowest {min(shown, len(timed))} tests of the workers")
    for rec in timed[:shown]:
        terminalreporter.write_line(f"{rec['duration']:8.2f}s {rec['backend']:<10} {rec['nodeid']}")
    files: dict[tuple[str, str], float] = {}
    for rec in timed:
        key = (rec["backend"], rec["nodeid"].split("::")[0])
        files[key] = files.get(key, 0.0) + rec["duration"]
    slowest = sorted(files.items(), key=lambda item: -item[1])[:shown]
    terminalreporter.section(f"slowest {len(slowest)} test files of the workers (summed)")
    for (backend, path), seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.2f}s {backend:<10} {path}")


#: jax's persistent compilation cache for every program, however quickly it compiles
JAX_CACHE_SETTINGS = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}


def _share_jax_compilations(config: pytest.Config) -> None:
    """Every process this session starts (the jax workers, the conformance targets, the
    distributed and example runs) keeps what XLA compiles for jax in one persistent
    cache, a temporary folder removed at the end: a program one process compiled is
    loaded by the next instead of compiled again. Eager jax compiles each operation per
    shape and dtype, about 60 ms each on a slow 2-core CPU, against a millisecond or two
    to load it; the jax workers spent about 70% of their time compiling. A cache the
    caller set (``JAX_COMPILATION_CACHE_DIR``) is used as it is; a worker uses the folder
    its session passed down."""
    if IS_WORKER or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    folder = tempfile.mkdtemp(prefix="multiattn-jax-cache-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    os.environ.update({"JAX_COMPILATION_CACHE_DIR": folder, **JAX_CACHE_SETTINGS})


def _core_files(config: pytest.Config, items: list) -> list[str]:
    """The test files of the items collected here (the tests of ``tests/`` itself), to
    run in the ``core`` worker: none when the run names single tests (``::``), whose
    selection only this session's own collection keeps exactly."""
    if any("::" in arg for arg in config.args):
        return []
    return sorted({str(item.path) for item in items})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "backend(name): the Keras backend a replayed test ran on")
    if not IS_WORKER:
        _slowest_shown()  # a bad setting stops the run before any worker starts
    _share_jax_compilations(config)


# --- worker side: per-test results for the outer session ------------------------------

_RESULTS: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    if not IS_WORKER:
        return
    rec = _RESULTS.setdefault(
        report.nodeid, {"nodeid": report.nodeid, "outcome": "passed", "duration": 0.0}
    )
    rec["duration"] += report.duration  # setup, call and teardown together
    if report.failed:
        rec["outcome"] = "failed"
        text = f"{rec.get('longrepr', '')}\n[{report.when}]\n{report.longrepr}"
        rec["longrepr"] = text.strip()
    elif report.skipped and rec["outcome"] == "passed":
        rec["outcome"] = "skipped"
        longrepr = report.longrepr
        rec["reason"] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def pytest_collectreport(report):
    if IS_WORKER and report.failed:
        _RESULTS[report.nodeid + "::collect"] = {
            "nodeid": f"{report.nodeid}::collect[{os.environ[WORKER_ENV]}]",
            "outcome": "failed",
            "longrepr": str(report.longrepr),
        }


def pytest_sessionfinish(session):
    path = os.environ.get("MULTIATTN_TEST_REPORT")
    if IS_WORKER and path:
        with open(path, "w") as fh:
            for rec in _RESULTS.values():
                fh.write(json.dumps(rec) + "\n")

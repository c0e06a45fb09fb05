"""Test harness: the backend suite runs once per Keras backend, each in its own process.

``KERAS_BACKEND`` is read once when Keras is imported, so ``tests/backend/`` cannot run
under several backends in one process. This conftest (the outer session) does not
import Keras. When ``tests/backend`` is part of the run it starts one worker pytest per
backend (``MULTIATTN_TEST_BACKEND=<name>``), collects every worker's per-test results and
replays them here as items whose ids name the backend (``test_x[jax-...]``), so one
summary counts every test of every backend and a crashing backend never hides another's
results.

Environment:
    MULTIATTN_TEST_BACKENDS: comma-separated subset of jax,torch,tensorflow,numpy.
    MULTIATTN_TEST_JOBS: how many workers run at once (default 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BACKEND_DIR = HERE / "backend"
ROOT = HERE.parent
BACKENDS = ("jax", "torch", "tensorflow", "numpy")
WORKER_ENV = "MULTIATTN_TEST_BACKEND"
IS_WORKER = WORKER_ENV in os.environ


def _selected_backends() -> list[str]:
    raw = os.environ.get("MULTIATTN_TEST_BACKENDS", "")
    names = [b.strip() for b in raw.split(",") if b.strip()] or list(BACKENDS)
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        raise pytest.UsageError(f"MULTIATTN_TEST_BACKENDS: unknown backend(s) {unknown}")
    return names


def _backend_paths(config: pytest.Config) -> list[str]:
    """Paths inside tests/backend that this run asks for (empty: none)."""
    paths = []
    for arg in config.args:
        path = Path(arg.split("::")[0]).resolve()
        if path == BACKEND_DIR or BACKEND_DIR in path.parents:
            paths.append(arg)
        elif path in BACKEND_DIR.parents:
            paths.append(str(BACKEND_DIR))
    return sorted(set(paths))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config):
    path = collection_path.resolve()
    if not IS_WORKER and (path == BACKEND_DIR or BACKEND_DIR in path.parents):
        return True
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


def _run_worker(
    backend: str, paths: list[str], extra: list[str]
) -> tuple[str, list[dict], str, float]:
    env = dict(os.environ)
    env.update({"KERAS_BACKEND": backend, WORKER_ENV: backend, "PYTHONHASHSEED": "0"})
    if backend == "jax":
        env["JAX_ENABLE_X64"] = "1"  # float64 cases need real float64 arrays
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        env["MULTIATTN_TEST_REPORT"] = str(report)
        cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", *extra]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        elapsed = time.monotonic() - start
        records = []
        if report.exists():
            for line in report.read_text().splitlines():
                rec = json.loads(line)
                rec["backend"] = backend
                records.append(rec)
    log = proc.stdout + proc.stderr
    if proc.returncode not in (0, 1, 5) or not records:
        records.append(
            {
                "nodeid": f"tests/backend::worker[{backend}]",
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
    paths = _backend_paths(config)
    if not paths:
        return
    extra = []
    for opt in ("keyword", "markexpr"):
        value = getattr(config.option, opt, "")
        if value:
            extra += ["-k" if opt == "keyword" else "-m", value]
    backends = _selected_backends()
    jobs = max(1, int(os.environ.get("MULTIATTN_TEST_JOBS", "2")))
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    results = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_run_worker, b, paths, extra) for b in backends]
        for fut in futures:
            backend, records, _log, elapsed = fut.result()
            results[backend] = records
            if reporter is not None:
                counts = {}
                for rec in records:
                    counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
                summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
                reporter.write_line(f"backend {backend}: {summary} in {elapsed:.0f}s")
    for backend in backends:
        for rec in results[backend]:
            name = rec["nodeid"].split("::", 1)[-1]
            items.append(
                ReplayItem.from_parent(session, name=name, nodeid=rec["nodeid"], record=rec)
            )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "backend(name): the Keras backend a replayed test ran on")

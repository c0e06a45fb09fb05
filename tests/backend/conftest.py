"""Worker side of the harness: runs inside one process whose Keras backend is fixed.

Every test here receives the ``backend`` parameter, so its id names the backend; the
results are written for the outer session (see ``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os

import pytest
from _support import BACKEND

if os.environ.get("MULTIATTN_TEST_BACKEND", BACKEND) != BACKEND:
    raise RuntimeError(
        f"worker for {os.environ['MULTIATTN_TEST_BACKEND']!r} imported Keras with backend {BACKEND!r}"
    )


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", [BACKEND], ids=[BACKEND])


@pytest.fixture(autouse=True)
def backend():  # replaced by the parametrisation above; kept so every test gets the id
    return BACKEND


# --- result reporting to the outer session -------------------------------------------

_RESULTS: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    rec = _RESULTS.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed"})
    if report.failed:
        rec["outcome"] = "failed"
        rec["longrepr"] = (
            rec.get("longrepr", "") + f"\n[{report.when}]\n" + str(report.longrepr)
        ).strip()
    elif report.skipped and rec["outcome"] == "passed":
        rec["outcome"] = "skipped"
        longrepr = report.longrepr
        rec["reason"] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def pytest_collectreport(report):
    if report.failed:
        _RESULTS[report.nodeid + "::collect"] = {
            "nodeid": f"{report.nodeid}::collect[{BACKEND}]",
            "outcome": "failed",
            "longrepr": str(report.longrepr),
        }


def pytest_sessionfinish(session):
    path = os.environ.get("MULTIATTN_TEST_REPORT")
    if path:
        with open(path, "w") as fh:
            for rec in _RESULTS.values():
                fh.write(json.dumps(rec) + "\n")

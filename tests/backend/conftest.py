"""Worker side of the harness: runs inside one process whose Keras backend is fixed.

Every test here receives the ``backend`` parameter, so its id names the backend; the
results are written for the outer session (see ``tests/conftest.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Only a worker for this directory imports Keras: the outer session loads this file too
# when a path inside tests/backend is named on the command line.
if os.environ.get("MULTIATTN_TEST_DIR") == str(Path(__file__).resolve().parent):
    from _support import BACKEND

    if os.environ.get("MULTIATTN_TEST_BACKEND", BACKEND) != BACKEND:
        raise RuntimeError(
            f"worker for {os.environ['MULTIATTN_TEST_BACKEND']!r} imported Keras with "
            f"backend {BACKEND!r}"
        )

    def pytest_generate_tests(metafunc):
        if "backend" in metafunc.fixturenames:
            metafunc.parametrize("backend", [BACKEND], ids=[BACKEND])

    @pytest.fixture(autouse=True)
    def backend():  # replaced by the parametrisation above; kept so every test gets the id
        return BACKEND

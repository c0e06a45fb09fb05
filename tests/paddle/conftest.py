"""Paddle worker: runs with no Keras backend chosen, so the Paddle adapter picks Keras'
numpy backend; paddle is imported first (importing it after TensorFlow segfaults)."""

import os
from pathlib import Path

import pytest

# Only the Paddle worker imports paddle: the outer session loads this file too when a path
# inside tests/paddle is named on the command line.
IS_PADDLE_WORKER = os.environ.get("MULTIATTN_TEST_DIR") == str(Path(__file__).resolve().parent)

if IS_PADDLE_WORKER:
    # Recorded before anything below can choose a backend (the adapter sets KERAS_BACKEND).
    KERAS_BACKEND_AT_START = os.environ.get("KERAS_BACKEND")

    import multiattn.backends.paddle  # noqa: F401  (registers the namespace, picks numpy)
    import paddle  # noqa: F401  (first, before anything that could load TensorFlow)

    def pytest_generate_tests(metafunc):
        if "backend" in metafunc.fixturenames:
            metafunc.parametrize("backend", ["paddle"], ids=["paddle"])

    @pytest.fixture(autouse=True)
    def backend():  # replaced by the parametrisation above; kept so every test gets the id
        return "paddle"

    @pytest.fixture
    def keras_backend_at_start():
        """``KERAS_BACKEND`` as the worker process received it (None: unset)."""
        return KERAS_BACKEND_AT_START

"""Importing a framework adapter selects its Keras backend, or refuses another one.

Keras reads its backend once per process, so every case runs in a fresh interpreter. The
interpreters are started together (module fixture) to keep this module fast.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPORT = "import keras, os; print('backend', keras.backend.backend(), os.environ['KERAS_BACKEND'])"
# name -> (KERAS_BACKEND or None for unset, code)
CASES: dict[str, tuple[str | None, str]] = {
    "torch_auto": (None, f"import multiattn.backends.torch\n{REPORT}"),
    "tensorflow_auto": (None, f"import multiattn.backends.tensorflow\n{REPORT}"),
    "torch_explicit": ("torch", f"import multiattn.backends.torch\n{REPORT}"),
    "torch_env_jax": ("jax", "import multiattn.backends.torch"),
    "tensorflow_env_numpy": ("numpy", "import multiattn.backends.tensorflow"),
    "torch_keras_running_jax": ("jax", "import keras\nimport multiattn.backends.torch"),
    "tensorflow_after_torch": (
        None,
        "import multiattn.backends.torch\nimport multiattn.backends.tensorflow",
    ),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    procs = {}
    for name, (backend, code) in CASES.items():
        env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        if backend is not None:
            env["KERAS_BACKEND"] = backend
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.mark.parametrize(
    "case, backend",
    [("torch_auto", "torch"), ("tensorflow_auto", "tensorflow"), ("torch_explicit", "torch")],
)
def test_import_selects_the_backend(runs, case, backend):
    proc = runs[case]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"backend {backend} {backend}"


@pytest.mark.parametrize(
    "case, active, wanted",
    [
        ("torch_env_jax", "jax", "torch"),
        ("tensorflow_env_numpy", "numpy", "tensorflow"),
        ("torch_keras_running_jax", "jax", "torch"),
        ("tensorflow_after_torch", "torch", "tensorflow"),
    ],
)
def test_import_refuses_another_backend(runs, case, active, wanted):
    proc = runs[case]
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), proc.stderr[-3000:]
    assert f"multiattn.backends.{wanted} needs Keras' '{wanted}' backend" in last
    assert f"'{active}'" in last  # names the active backend
    assert f"Set KERAS_BACKEND={wanted}" in last  # and the fix

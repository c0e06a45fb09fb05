"""Importing multiattn pulls in no framework but Keras' chosen backend (one process each)."""

import json
import os
import subprocess
import sys

import pytest

FRAMEWORKS = ("jax", "torch", "tensorflow", "paddle")
PROBE = (
    "import json, sys\n"
    "{stmt}\n"
    "print(json.dumps(sorted(m for m in {frameworks!r} if m in sys.modules)))\n"
)


def loaded_after(stmt: str, backend: str) -> set[str]:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    code = PROBE.format(stmt=stmt, frameworks=FRAMEWORKS)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_bare_import_loads_no_framework():
    assert loaded_after("import multiattn", "torch") == set()


@pytest.mark.parametrize("backend", ["jax", "torch", "tensorflow", "numpy"])
def test_layers_import_adds_nothing_beyond_keras(backend):
    keras_alone = loaded_after("import keras", backend)
    ours = loaded_after("import multiattn.layers, multiattn.ops", backend)
    # Keras 3.15 itself imports jax whenever it is installed (its orbax checkpoint
    # callback); multiattn must add nothing on top of what Keras loads.
    assert ours == keras_alone
    assert ours - {"jax"} <= {backend}


def test_distributed_import_loads_no_framework():
    stmt = (
        "import multiattn.distributed, multiattn.distributed.layout\n"
        "import multiattn.distributed.ring\n"
        "multiattn.distributed.sharded_heads_rules()"
    )
    assert loaded_after(stmt, "torch") == set()

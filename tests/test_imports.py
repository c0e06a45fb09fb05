"""Importing multiattn pulls in no framework but Keras' chosen backend.

Keras reads its backend once per process, so each backend gets a fresh interpreter; within
one, the statements run in turn and the frameworks loaded are recorded after each (a later
statement only adds to what an earlier one loaded, so each record bounds that statement).
"""

import json
import os
import subprocess
import sys

import pytest

FRAMEWORKS = ("jax", "torch", "tensorflow", "paddle")
PROBE = (
    "import json, sys\n"
    "def loaded():\n"
    "    return sorted(m for m in {frameworks!r} if m in sys.modules)\n"
    "out = []\n"
    "for stmt in {stmts!r}:\n"
    "    exec(stmt, {{}})\n"
    "    out.append([loaded(), 'keras' in sys.modules])\n"
    "print(json.dumps(out))\n"
)


def loaded_after(stmts: list[str], backend: str) -> list[tuple[set[str], bool]]:
    """For each of ``stmts``, run in turn in one fresh interpreter: the frameworks loaded
    after it, and whether Keras is."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    code = PROBE.format(stmts=stmts, frameworks=FRAMEWORKS)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [(set(names), keras) for names, keras in json.loads(proc.stdout.splitlines()[-1])]


@pytest.fixture(scope="module")
def torch_probe() -> list[tuple[set[str], bool]]:
    """The bare import, then the distributed package, in one interpreter."""
    return loaded_after(
        [
            "import multiattn",
            "import multiattn.distributed, multiattn.distributed.layout\n"
            "import multiattn.distributed.ring\n"
            "multiattn.distributed.sharded_heads_rules()",
        ],
        "torch",
    )


def test_bare_import_loads_no_framework(torch_probe):
    assert torch_probe[0][0] == set()


def test_distributed_import_loads_no_framework(torch_probe):
    # everything loaded so far, the bare import's nothing and the distributed package's
    assert torch_probe[1][0] == set()


@pytest.mark.parametrize("backend", ["jax", "torch", "tensorflow", "numpy"])
def test_layers_import_adds_nothing_beyond_keras(backend):
    (keras_alone, _), (ours, keras_loaded) = loaded_after(
        ["import keras", "import multiattn.layers, multiattn.ops"], backend
    )
    # Keras 3.15 itself imports jax whenever it is installed (its orbax checkpoint
    # callback); multiattn must add nothing on top of what Keras loads. multiattn.layers
    # imports Keras, so what it loads alone is between the two records.
    assert keras_loaded
    assert ours == keras_alone
    assert ours - {"jax"} <= {backend}

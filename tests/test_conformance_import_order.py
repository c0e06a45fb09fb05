"""torch's triton and TensorFlow in one process (`multiattn.conformance.import_order`):
importing triton after TensorFlow kills the process, so every process that may import
both loads triton first. A fake ``triton`` package stands in for the real one: it notes
whether TensorFlow came first and, if so, aborts as the real one does."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("tensorflow is not installed", allow_module_level=True)

FAKE_TRITON = """
import os, sys
order = "tensorflow-first" if "tensorflow" in sys.modules else "triton-first"
with open(os.environ["FAKE_TRITON_NOTE"], "a") as note:
    note.write(order + "\\n")
if order == "tensorflow-first":
    os.abort()  # what the real triton's LLVM does after TensorFlow's
"""

TF_THEN_TRITON = """
class Target:
    name = "tensorflow-then-triton"

    def run(self, case):
        import tensorflow  # noqa: F401
        import triton  # noqa: F401  (as transformers' torch._dynamo would)
        return {"output": case.expected["output"]}
"""


@pytest.fixture
def fake_triton(tmp_path):
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text(FAKE_TRITON)
    (tmp_path / "tf_then_triton.py").write_text(TF_THEN_TRITON)
    note = tmp_path / "note"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FAKE_TRITON_NOTE": str(note)}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env, note


def test_the_fake_triton_aborts_after_tensorflow(fake_triton):
    env, note = fake_triton
    code = "import tensorflow, triton"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert proc.returncode != 0 and note.read_text() == "tensorflow-first\n"


def test_a_conformance_worker_loads_triton_before_its_target_loads_tensorflow(fake_triton):
    env, note = fake_triton
    cmd = [sys.executable, "-m", "multiattn.conformance", "--target", "tf_then_triton:Target",
           "--cases", "masked_softmax_plain_f32"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert note.read_text() == "triton-first\n"


def test_a_model_check_worker_loads_triton_first(fake_triton, tmp_path):
    env, note = fake_triton
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([]))
    cmd = [sys.executable, "-m", "multiattn.conformance.model_check", "--worker", "--framework",
           "tensorflow", "--jobs", str(jobs), "--dtype", "float32"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert note.read_text() == "triton-first\n"


def test_a_test_worker_loads_triton_before_any_framework(fake_triton):
    env, note = fake_triton
    env = {**env, "MULTIATTN_TEST_BACKEND": "numpy"}  # any worker: tests/conftest.py does it
    code = "import conftest, sys; import tensorflow, triton; print('alive')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "alive" in proc.stdout, proc.stderr[-3000:]
    assert note.read_text() == "triton-first\n"


def test_without_triton_nothing_is_imported(tmp_path):
    code = (
        "import sys; from multiattn.conformance.import_order import import_triton_first; "
        "assert import_triton_first() is False; assert 'triton' not in sys.modules; "
        "assert 'tensorflow' not in sys.modules"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # no fake triton here
    if importlib.util.find_spec("triton") is not None:
        pytest.skip("a real triton is installed")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr

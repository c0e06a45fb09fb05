"""multiattn layers train under torch.nn.parallel.DistributedDataParallel unchanged.

Two CPU processes (gloo on 127.0.0.1) each take half of every batch; after the training
steps their weights must equal those of one process trained on the whole batches. The
worker (``tests/distributed/torch_ddp.py``) runs in a subprocess with
``KERAS_BACKEND=torch`` and starts the two ranks itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "distributed" / "torch_ddp.py"
F32_TOL = 1e-6


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_ddp_step_equals_single_process_step_on_the_whole_batch():
    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, str(WORKER)],
        cwd=WORKER.parent.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["world"] == 2
    assert report["ranks_identical"] is True
    assert len(report["weights"]) == 16
    assert max(report["weights"].values()) <= F32_TOL, report["weights"]
    # DDP's gradient (the average of the two halves') against the whole batch's: two
    # float32 sums in different orders, each within the bound of the exact one.
    assert len(report["gradients"]) == 16
    assert max(report["gradients"].values()) <= 2 * F32_TOL, report["gradients"]
    # The steps moved the weights far beyond the tolerance, so the check can fail.
    assert report["largest_update"] > 1e3 * F32_TOL

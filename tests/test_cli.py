"""The command line: ``multiattn demo`` runs every installed backend and they agree."""

import subprocess
import sys


def test_demo_reports_agreement():
    proc = subprocess.run(
        [sys.executable, "-m", "multiattn.cli", "demo", "--backends", "numpy,torch"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all backends agree" in proc.stdout


def test_unknown_backend_is_a_usage_error():
    proc = subprocess.run(
        [sys.executable, "-m", "multiattn.cli", "demo", "--backends", "mxnet"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "mxnet" in proc.stderr

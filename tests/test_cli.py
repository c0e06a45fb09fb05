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


def test_conformance_subcommand_passes_its_exit_code_through():
    """``multiattn conformance`` is the runner: its usage errors and exit codes."""
    proc = subprocess.run(
        [sys.executable, "-m", "multiattn.cli", "conformance", "--cases", "no_such_case_*"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--cases 'no_such_case_*' selects none of the" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "multiattn.cli", "conformance", "--help"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0
    assert "--timeout SECONDS" in proc.stdout

"""Running ``multiattn port`` in a subprocess (the outer test process loads no framework),
and the checks every refused run must pass. NumPy, safetensors and h5py only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

MHA = {"num_heads": 2, "key_dim": 4, "value_dim": 4, "query_width": 8, "key_width": 5,
       "value_width": 6, "output_width": 8, "use_bias": True}  # fmt: skip
GROUPED = {"num_heads": 4, "key_dim": 2, "value_dim": 3, "query_width": 8, "key_width": 5,
           "value_width": 6, "output_width": 7, "use_bias": True,
           "num_key_value_heads": 2}  # fmt: skip
ROTARY = {**MHA, "key_width": 8, "value_width": 8, "rotary_max_length": 16,
          "rotary_base": 500.0}  # fmt: skip


def port(
    *args: str, env: dict | None = None, timeout: float = 180, preexec_fn=None
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "KERAS_BACKEND": "numpy", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "multiattn.cli", "port", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit status 1, no traceback, and one ``multiattn port: error:`` line, the last of
    stderr (frameworks may warn before it), holding each needle. Returns that line."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("multiattn port: error: ") == 1, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("multiattn port: error: "), proc.stderr
    assert message.endswith("Nothing was written."), proc.stderr
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def only(directory: Path, *names: str) -> None:
    """``directory`` holds exactly ``names`` (no output, no temporary file left behind)."""
    assert sorted(p.name for p in directory.iterdir()) == sorted(names)


def keras_h5_names(config: dict) -> list[str]:
    """Neutral names in the order of a multiattn ``MultiHeadAttention`` ``.weights.h5``
    file (``vars/0`` ...): the four kernels, then the four biases."""
    names = [f"{n}/kernel" for n in ("query", "key", "value", "output")]
    if config["use_bias"]:
        names += [f"{n}/bias" for n in ("query", "key", "value", "output")]
    return names


def write_keras_h5(path: Path, weights: dict, config: dict) -> None:
    """A multiattn ``MultiHeadAttention`` ``.weights.h5`` file written with h5py, as Keras
    lays it out (datasets ``vars/<i>``)."""
    import h5py

    with h5py.File(path, "w") as fh:
        for i, name in enumerate(keras_h5_names(config)):
            fh.create_dataset(f"vars/{i}", data=np.asarray(weights[name]))

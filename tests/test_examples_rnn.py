"""The RNN and captioning attention examples learn their tasks (quick runs, one process each
backend: both examples run in it, the second reusing the imported Keras)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPT = """
import json, sys
sys.path.insert(0, {examples!r})
import captioning_marker, rnn_reverse
out = [
    rnn_reverse.main(["--backend", {backend!r}, "--quick", "--no-progress",
                      "--figure", {rnn_png!r}]),
    captioning_marker.main(["--backend", {backend!r}, "--quick", "--no-progress",
                            "--figure", {cap_png!r}]),
]
print("RESULTS " + json.dumps(out))
"""


@pytest.mark.parametrize("backend", ["jax", "torch", "tensorflow"])
def test_quick_examples_learn(backend, tmp_path):
    pytest.importorskip("matplotlib")
    rnn_png, cap_png = tmp_path / "rnn.png", tmp_path / "cap.png"
    code = SCRIPT.format(
        examples=str(EXAMPLES),
        backend=backend,
        rnn_png=str(rnn_png),
        cap_png=str(cap_png),
    )
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    rnn, cap = json.loads(line[len("RESULTS ") :])
    assert rnn["backend"] == cap["backend"] == backend
    print(json.dumps(rnn), json.dumps(cap), sep="\n")  # the reached numbers, with -s
    # Greedy decoding of held-out sequences; the full run reaches >= 0.99.
    assert rnn["token_accuracy"] >= 0.9, rnn
    # Kind, row and column of the marker; the row and column need the attention.
    assert cap["token_accuracy"] >= 0.9, cap
    # The attention map peaks on the marker's cell (once the marker has been read, later
    # steps may rely on the GRU state, so the best step is what must point).
    assert max(cap["pointing_per_step"]) >= 0.9, cap
    for png in (rnn_png, cap_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

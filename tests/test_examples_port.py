"""The porting example: a transformers folder on jax, torch, tensorflow and Paddle, greedy
tokens identical to transformers', and a model trained on Paddle read back by transformers
(the example runs each framework in its own process)."""

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "port_model.py"


def test_port_model_example_generates_the_same_tokens_everywhere_and_comes_back():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--max-new-tokens", "12", "--timeout", "300"],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    report = json.loads(line[len("RESULT ") :])
    assert set(report["frameworks"]) == {"jax", "torch", "tensorflow", "paddle"}
    for name, row in report["frameworks"].items():
        assert row.get("tokens_equal") is True, (name, row)
        assert len(row["continuation"][0].split()) == 12
    paddle = report["frameworks"]["paddle"]
    assert paddle["training_changed_logits_by"] > 1e-3  # the step moved the model
    assert paddle["trained_on_paddle_back_in_transformers"] < 1e-5

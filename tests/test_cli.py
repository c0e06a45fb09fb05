"""The command line: ``multiattn demo`` runs every installed backend and they agree."""

import os
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


def test_tune_writes_decisions_another_process_loads(tmp_path):
    """``multiattn tune`` times a model's generate with autotune on and writes the
    decisions; `multiattn.tuning.load_decisions` takes them in another process, whose
    calls of those classes then time nothing."""
    import json

    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    out = tmp_path / "tuning.json"
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    proc = subprocess.run(
        [sys.executable, "-m", "multiattn.cli", "tune", str(tmp_path / "m"), "--batch", "2",
         "--prompt", "8", "--new-tokens", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    measured = data["decisions"]
    assert measured and all(d["how"] == "measured" for d in measured)
    assert f"{len(measured)} decisions written" in proc.stdout
    script = (
        "import sys\n"
        "from multiattn import tuning\n"
        f"print(tuning.load_decisions({str(out)!r}))\n"
        "print(sorted({d['how'] for d in tuning.decisions()}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(len(measured)), "['loaded']"]

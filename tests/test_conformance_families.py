"""Per-family conformance cases (`multiattn.conformance.families`): the shipped folders are
intact and small, and ``multiattn conformance --families`` finds every family agreeing
with the stored transformers float64 outputs on the frameworks it runs (subprocesses: the
test process imports no framework)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from multiattn.conformance import families


def test_shipped_family_cases_are_intact_small_and_complete():
    assert families.verify() == []
    size = sum(p.stat().st_size for p in families.DIRECTORY.rglob("*") if p.is_file())
    assert size < 1024 * 1024  # 26 cases of about 25 KiB
    # logits, no tokens
    heads = {"roberta", "xlm-roberta", "distilbert", "albert", "electra", "modernbert"}
    for name in families.CASES:
        inputs, outputs = families.load_expected(families.DIRECTORY / name)
        assert inputs and all(v.dtype != object for v in (*inputs.values(), *outputs.values()))
        want = {"logits", "generated_ids"} if "input_ids" in inputs else set()
        if name in ("t5", "bart"):
            want.add("encoder_last_hidden_state")
        elif name in heads:
            want = {"logits"}
        elif not want or name == "bert":
            want = {"last_hidden_state", "pooler_output"}
        assert set(outputs) == want, name
        assert (families.DIRECTORY / name / "model.safetensors").is_file()


def test_a_tampered_file_is_reported(tmp_path):
    import shutil

    copy = tmp_path / "fixtures_families"
    shutil.copytree(families.DIRECTORY, copy)
    with open(copy / "gpt2" / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\1")
    assert families.verify(copy) == ["gpt2/model.safetensors"]


#: seconds before a framework's process (every family) counts as hung: a bound, not a speed
#: test (the three frameworks together took 46 s on an idle 2-core CPU)
HUNG_AFTER = "900"


def _run(*args: str, timeout: float = 3000) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "multiattn.cli", "conformance", "--families", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_every_family_agrees_on_numpy_torch_and_paddle(tmp_path):
    report_path = tmp_path / "families.json"
    proc = _run("--frameworks", "numpy,torch,paddle", "--json", str(report_path),
                "--timeout", HUNG_AFTER)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert set(report["families"]) == set(families.CASES)
    for name, rows in report["families"].items():
        for framework, res in rows.items():
            assert res["status"] == "ran" and res["agree"], (name, framework, res)
            rel = [r["relative"] for r in res["outputs"].values() if "relative" in r]
            assert rel and max(rel) < 1e-5
    assert "every family agrees" in proc.stdout


def test_decoder_families_agree_on_jax_and_tensorflow(tmp_path):
    proc = _run("gpt2,llama", "--frameworks", "jax,tensorflow", "--timeout", HUNG_AFTER)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_bad_arguments_are_refused():
    proc = _run("gpt3")
    assert proc.returncode == 2 and "gpt3" in proc.stderr
    proc = _run("bert", "--frameworks", "mxnet")
    assert proc.returncode == 2 and "mxnet" in proc.stderr


def test_expected_outputs_are_float64_and_tokens_are_ints():
    for name in families.CASES:
        _, outputs = families.load_expected(families.DIRECTORY / name)
        for key, value in outputs.items():
            want = np.integer if key == "generated_ids" else np.float64
            assert np.issubdtype(value.dtype, want), (name, key, value.dtype)


def test_float64_rotary_families_agree_on_paddle_under_the_bound_they_name(tmp_path):
    report_path = tmp_path / "families.json"
    proc = _run("gpt2,llama", "--frameworks", "paddle", "--dtype", "float64",
                "--json", str(report_path), "--timeout", HUNG_AFTER)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    llama, gpt2 = report["families"]["llama"]["paddle"], report["families"]["gpt2"]["paddle"]
    # transformers' float32 rotary tables and norms: an error far above float64's
    assert llama["agree"] and llama["outputs"]["logits"]["relative"] > 1e-9
    assert "rotary angles" in llama["basis"] and gpt2["tolerance"] == 1e-9
    assert "bound for llama on paddle" in proc.stdout and "rotary angles" in proc.stdout

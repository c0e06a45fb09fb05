"""`multiattn port` on whole model folders (`multiattn.port.models`): a Hugging Face folder
to one neutral safetensors file and back, tensors bit for bit, refusals naming what is
wrong, nothing written on error. No framework is imported (safetensors and NumPy only)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from multiattn.conformance.families import CASES, DIRECTORY
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from multiattn.port.cli import main


def _run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("family", sorted(CASES))
def test_folder_to_neutral_file_and_back_is_bit_identical(tmp_path, capsys, family):
    src = DIRECTORY / family
    neutral = tmp_path / "model.safetensors"
    code, text = _run(capsys, "--from", "hf", src, neutral)
    assert code == 0, text
    with safe_open(str(neutral), framework="numpy") as f:
        meta = f.metadata()
        names = list(f.keys())
    assert meta["multiattn.kind"] == "model" and meta["multiattn.model_type"] == family
    assert json.loads(meta["multiattn.config"]) == json.loads((src / "config.json").read_text())
    assert any(n.startswith(("layer_0/", "encoder/layer_0/")) for n in names), names
    back = tmp_path / "back"
    code, text = _run(capsys, "--from", "safetensors", "--to", "hf", neutral, back)
    assert code == 0, text
    want, got = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    shared = {k: v for k, v in want.items() if k in got}
    assert shared and set(got) <= set(want)  # tied copies transformers writes may be dropped
    for name, value in shared.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name


def test_refusals_name_the_problem_and_write_nothing(tmp_path, capsys):
    src = DIRECTORY / "llama"
    code, text = _run(capsys, "--from", "hf", "--to", "torch", src, tmp_path / "x.pt")
    assert code == 1 and "--from safetensors --to hf" in text and not (tmp_path / "x.pt").exists()
    layer_file = tmp_path / "layer.safetensors"
    save_file({"query/kernel": np.zeros((4, 2, 2), np.float32)}, layer_file,
              metadata={"multiattn.kind": "mha"})  # fmt: skip
    code, text = _run(capsys, "--from", "safetensors", "--to", "hf", layer_file, tmp_path / "o")
    assert code == 1 and "multiattn.kind = 'model'" in text and not (tmp_path / "o").exists()
    neutral = tmp_path / "m.safetensors"
    assert _run(capsys, "--from", "hf", src, neutral)[0] == 0
    with safe_open(str(neutral), framework="numpy") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    name = next(iter(tensors))
    tensors[name] = np.zeros((3, 3), np.float32)
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, bad, metadata=meta)
    code, text = _run(capsys, "--from", "safetensors", "--to", "hf", bad, tmp_path / "o")
    assert code == 1 and not (tmp_path / "o").exists(), text
    code, text = _run(capsys, "--from", "hf", src, neutral)
    assert code == 1 and "--force" in text
    code, text = _run(capsys, "--from", "hf", tmp_path / "missing", tmp_path / "y.safetensors")
    assert code == 1 and "model folder" in text

"""The decoder-only families of issues 49 (Qwen3, Gemma, Gemma 2, Gemma 3 text) and 50
(GPT-NeoX, Phi, Phi-3, OPT, Falcon) on Paddle:
``from_pretrained(path, framework="paddle")`` builds the twin of `CausalLM`; float32
logits of a left-padded batch against transformers in float64, greedy tokens against
transformers' ``generate``, and ``save_pretrained`` read back by transformers bit for
bit (the cases of tests/_decoder_families.py)."""

from __future__ import annotations

import os

import numpy as np
import paddle
import pytest
from _paddle_support import rel_err

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _decoder_families import CONFIGS, TOL, VOCAB, check_saved, hf_greedy, hf_logits, make  # noqa: E402
from _hf_models import build, left_padded_batch  # noqa: E402

from multiattn.hf.pretrained import PretrainedCausalLM, from_pretrained  # noqa: E402


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_family_on_paddle_matches_transformers(tmp_path, case):
    hf = build(lambda: make(case), tmp_path / "m")
    model = from_pretrained(tmp_path / "m", framework="paddle", dtype="float32")
    assert isinstance(model, PretrainedCausalLM) and isinstance(model.layer, paddle.nn.Layer)
    ids, mask = left_padded_batch(VOCAB)
    out = model(input_ids=ids, attention_mask=mask)
    real = mask.astype(bool)
    assert rel_err(out["logits"].numpy()[real], hf_logits(hf, ids, mask)[real]) <= TOL, case
    got = model.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=0)
    np.testing.assert_array_equal(got, hf_greedy(hf, ids, mask))
    model.save_pretrained(tmp_path / "out")
    check_saved(hf, tmp_path / "out")

"""BART on Paddle (``from_pretrained(path, framework="paddle")``, the twin of
`multiattn.models.bart.BartForConditionalGeneration`) against transformers run in
float64: logits of a left-padded batch, greedy ``generate`` token for token, and
``save_pretrained`` read back by transformers with identical tensors (the model of
tests/_bart_models.py)."""

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

from _bart_models import VOCAB, build_bart, decoder_ids  # noqa: E402
from _hf_models import left_padded_batch  # noqa: E402

from multiattn.hf.pretrained import PretrainedCausalLM, from_pretrained  # noqa: E402

TOL = 1e-5  # float32 against transformers in float64, relative to the largest value


def test_bart_on_paddle_matches_transformers_and_saves_back(tmp_path):
    hf = build_bart(tmp_path / "m")
    model = from_pretrained(tmp_path / "m", framework="paddle")
    assert isinstance(model, PretrainedCausalLM) and isinstance(model.layer, paddle.nn.Layer)
    ids, mask = left_padded_batch(VOCAB)
    dec = decoder_ids()
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                  decoder_input_ids=torch.tensor(dec))  # fmt: skip
        tokens = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             do_sample=False, max_new_tokens=20, eos_token_id=None).numpy()  # fmt: skip
    assert rel_err(out["logits"].numpy(), want.logits.numpy()) <= TOL
    real = mask.astype(bool)
    enc = out["encoder_last_hidden_state"].numpy()[real]
    assert rel_err(enc, want.encoder_last_hidden_state.numpy()[real]) <= TOL
    np.testing.assert_array_equal(model.generate(ids, attention_mask=mask, max_new_tokens=20),
                                  tokens)  # fmt: skip
    model.save_pretrained(tmp_path / "again")
    cls = transformers.BartForConditionalGeneration
    original = cls.from_pretrained(tmp_path / "m").state_dict()
    for name, tensor in cls.from_pretrained(tmp_path / "again").state_dict().items():
        assert torch.equal(tensor, original[name]), name

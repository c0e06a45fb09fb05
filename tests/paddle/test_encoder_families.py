"""The encoder families on Paddle (``from_pretrained(path, framework="paddle")``, the
twins of `multiattn.models.bert.BertModel` and `multiattn.models.modernbert.
ModernBertModel`): BERT, RoBERTa, XLM-RoBERTa, DistilBERT, ALBERT, ELECTRA and ModernBERT,
masked-LM and base checkpoints (ELECTRA's discriminator too), against transformers run in
float64, written back bit for bit (the cases of tests/_encoder_families.py)."""

from __future__ import annotations

import os

import paddle
import pytest
from _paddle_support import to_np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _encoder_families import (  # noqa: E402
    CASES,
    batch,
    check_discriminator,
    check_saved,
    errors,
    make,
    reference,
)
from _hf_models import build  # noqa: E402

from multiattn.hf.pretrained import from_pretrained  # noqa: E402

TOL = 1e-5  # float32 against transformers in float64, relative to the largest value


@pytest.mark.parametrize("family", sorted(CASES))
def test_masked_lm_and_base_model_match_transformers(tmp_path, family):
    for masked_lm in (True, False):
        src, out = tmp_path / f"src{masked_lm}", tmp_path / f"out{masked_lm}"
        hf = build(make(family, masked_lm), src)
        model = from_pretrained(src, framework="paddle")
        assert isinstance(model.layer, paddle.nn.Layer) and not model.layer.training
        inputs = batch(hf.config)
        got = model(**inputs)
        assert all(isinstance(v, paddle.Tensor) for v in got.values())
        err = errors({k: to_np(v) for k, v in got.items()}, reference(hf, inputs),
                     inputs["attention_mask"])  # fmt: skip
        assert ("logits" in err) == masked_lm
        assert max(err.values()) <= TOL, err
        model.save_pretrained(out)
        check_saved(src, out, type(hf).__name__)


def test_electra_discriminator_matches_transformers(tmp_path):
    check_discriminator(tmp_path, to_np, TOL, framework="paddle")

"""BERT, RoBERTa, XLM-RoBERTa, DistilBERT, ALBERT, ELECTRA and ModernBERT through `from_pretrained`,
against transformers run in float64: the masked-LM checkpoint (``*ForMaskedLM``: logits and
last hidden state) and the base model (``*Model``: last hidden state, pooler) of each family
(and ELECTRA's discriminator, ``ElectraForPreTraining``: a logit per token),
tiny, with every supported option away from its default in one of the two; each written
back by `save_pretrained` bit for bit; the config options not implemented refused by name.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
from _support import to_np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _encoder_families import (  # noqa: E402
    CASES,
    NO_POOLER,
    batch,
    check_discriminator,
    check_saved,
    errors,
    make,
    reference,
)
from _hf_models import build  # noqa: E402

from multiattn.hf.families import FAMILIES  # noqa: E402
from multiattn.hf.pretrained import from_pretrained  # noqa: E402

TOL = 1e-5  # float32 against transformers in float64, relative to the largest value


@pytest.mark.parametrize("family", sorted(CASES))
def test_masked_lm_and_base_model_match_transformers(tmp_path, family):
    for masked_lm in (True, False):
        src, out = tmp_path / f"src{masked_lm}", tmp_path / f"out{masked_lm}"
        hf = build(make(family, masked_lm), src)
        model = from_pretrained(src)
        assert model.dtype == "float32" and not model.ignored_tensors
        inputs = batch(hf.config)
        got = model(**inputs)
        for value in got.values():
            assert keras.backend.standardize_dtype(value.dtype) == "float32"
        err = errors({k: to_np(v) for k, v in got.items()}, reference(hf, inputs),
                     inputs["attention_mask"])  # fmt: skip
        assert ("logits" in err) == masked_lm and ("pooler_output" in err) == (
            not masked_lm and family not in NO_POOLER)  # fmt: skip
        assert max(err.values()) <= TOL, err
        model.save_pretrained(out)
        check_saved(src, out, type(hf).__name__)


def test_electra_discriminator_matches_transformers(tmp_path):
    check_discriminator(tmp_path, to_np, TOL)


def test_albert_blocks_are_shared_not_copied(tmp_path):
    """ALBERT's 3 layers run 2 groups of 2 blocks: 4 blocks, each one set of variables,
    group 0 run by layers 0 and 1 (transformers' ``int(i / (layers / groups))``)."""
    build(make("albert", True), tmp_path / "m")
    layer = from_pretrained(tmp_path / "m").layer
    assert len(layer.blocks) == 4 and layer.schedule == [0, 1, 0, 1, 2, 3]
    names = [v.path for block in layer.blocks for v in block.weights]
    assert len(names) == len(set(names)) == 4 * 16


@pytest.mark.parametrize(
    ("family", "change", "match"),
    [
        ("roberta", {"position_embedding_type": "relative_key"}, "`position_embedding_type`"),
        ("roberta", {"pad_token_id": 64}, r"`pad_token_id`.*received 64"),
        ("roberta", {"is_decoder": True}, "`is_decoder`"),
        ("xlm-roberta", {"hidden_act": "relu"}, "`hidden_act`"),
        ("roberta", {"architectures": ["RobertaForMaskedLM"], "tie_word_embeddings": False},
         "`tie_word_embeddings`"),
        ("bert", {"architectures": ["BertForMaskedLM"], "tie_word_embeddings": False},
         "`tie_word_embeddings`"),
        ("distilbert", {"activation": "silu"}, "`activation` = 'silu'"),
        ("distilbert", {"sinusoidal_pos_embds": "yes"}, "`sinusoidal_pos_embds`"),
        ("distilbert", {"output_past": True}, "`output_past`"),
        ("albert", {"hidden_act": "silu"}, "`hidden_act` = 'silu'"),
        ("albert", {"num_hidden_groups": 4}, "`num_hidden_groups`"),
        ("albert", {"position_embedding_type": "relative_key"}, "`position_embedding_type`"),
        ("electra", {"hidden_act": "relu"}, "`hidden_act`"),
        ("electra", {"architectures": ["ElectraForMaskedLM", "ElectraForPreTraining"]},
         "one head"),
        ("electra", {"position_embedding_type": "relative_key"}, "`position_embedding_type`"),
        ("modernbert", {"hidden_activation": "quick_gelu"}, "`hidden_activation`"),
        ("modernbert", {"classifier_activation": "tanh"}, "`classifier_activation`"),
        ("modernbert", {"layer_types": ["full_attention"]}, "`layer_types`"),
        ("modernbert", {"tie_word_embeddings": False}, "`tie_word_embeddings`"),
        ("modernbert", {"rope_parameters": {"global": {"rope_theta": 10.0}}},
         "`rope_parameters`"),
        ("modernbert", {"rope_parameters": {"full_attention": {"rope_type": "dynamic",
                                                               "factor": 2.0}}},
         "`rope_scaling`/`rope_parameters`"),
        ("modernbert", {"local_attention": 0}, "`local_attention`"),
        ("modernbert", {"hidden_size": 30}, "divisible"),
    ],
)  # fmt: skip
def test_unsupported_options_are_refused_by_name(family, change, match):
    raw = _config(family)
    FAMILIES[family].check_config(raw, "t")  # the unchanged config loads
    with pytest.raises(ValueError, match=match):
        FAMILIES[family].check_config({**raw, **change}, "t")


def _config(family: str) -> dict:
    """The masked-LM case's config.json object, as transformers writes it."""
    import json
    import tempfile

    config_cls, head_cls, _, head_cfg, _ = CASES[family]
    config = getattr(transformers, config_cls)(**head_cfg)
    config.architectures = [head_cls]
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f)


def test_masked_lm_sizes_and_refusals_of_inputs(tmp_path):
    build(make("roberta", True), tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    # positions run to pad + 1 + length: 24 positions, pad 1, hold 22 tokens
    with pytest.raises(ValueError, match=r"max_positions=24 less position_padding_idx"):
        model(input_ids=np.full((1, 23), 5))
    assert to_np(model(input_ids=np.full((1, 22), 5))["logits"]).shape == (1, 22, 64)
    build(make("distilbert", True), tmp_path / "d")
    with pytest.raises(TypeError, match="token_type_ids"):
        from_pretrained(tmp_path / "d")(input_ids=np.ones((1, 3), np.int64),
                                        token_type_ids=np.zeros((1, 3), np.int64))  # fmt: skip

"""The decoder-only families added to `CausalLM` by issues 49 (Qwen3, Gemma, Gemma 2,
Gemma 3 text) and 50 (GPT-NeoX, Phi, Phi-3, OPT, Falcon) against transformers.

One test per case (`_decoder_families.CONFIGS`) loads a tiny random transformers model
once (built offline, parameters redrawn where greedy tokens are well separated, saved with
``save_pretrained``) and checks the float32 logits of a left-padded batch against
transformers run in float64 (real positions only), greedy ``generate`` (20 new tokens)
token for token against transformers' ``generate(do_sample=False)``, and
``save_pretrained`` read back by transformers bit for bit. The refusals of options the
families do not implement need only the config.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _support import rel_err, to_np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _decoder_families import (  # noqa: E402
    CONFIGS,
    TOL,
    VOCAB,
    check_saved,
    config_of,
    hf_greedy,
    hf_logits,
    make,
)
from _hf_models import build, left_padded_batch  # noqa: E402

from multiattn.hf.families import FAMILIES  # noqa: E402
from multiattn.hf.pretrained import from_pretrained  # noqa: E402


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_family_logits_tokens_and_saving_match_transformers(tmp_path, case):
    hf = build(lambda: make(case), tmp_path / "m")
    model = from_pretrained(tmp_path / "m", dtype="float32")
    ids, mask = left_padded_batch(VOCAB)
    got = to_np(model(input_ids=ids, attention_mask=mask)["logits"])
    real = mask.astype(bool)  # pad positions carry no meaning in either library
    assert rel_err(got[real], hf_logits(hf, ids, mask)[real]) <= TOL, case
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=0)
    np.testing.assert_array_equal(tokens, hf_greedy(hf, ids, mask))
    model.save_pretrained(tmp_path / "out")
    check_saved(hf, tmp_path / "out")


@pytest.mark.parametrize(
    ("case", "changes", "match"),
    [
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3", {"attention_bias": 1}, "attention_bias"),
        ("qwen3", {"made_up_option": 1}, "made_up_option"),
        ("phi", {"qk_layernorm": True}, "qk_layernorm"),
        (
            "phi",
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 1.5,
                }
            },
            "partial_rotary_factor",
        ),
        (
            "phi3",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 3,
                    "long_factor": [2.0] * 4,
                    "original_max_position_embeddings": 16,
                }
            },
            "short_factor",
        ),
        (
            "phi3",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
            "rope",
        ),
        ("phi3", {"hidden_act": "gelu"}, "hidden_act"),
        ("gpt_neox", {"hidden_act": "relu"}, "hidden_act"),
        ("gpt_neox", {"use_parallel_residual": 1}, "use_parallel_residual"),
        ("opt", {"layer_norm_elementwise_affine": False}, "layer_norm_elementwise_affine"),
        ("opt", {"activation_function": "gelu"}, "activation_function"),
        ("falcon", {"alibi": True}, "alibi"),
        ("falcon", {"num_ln_in_parallel_attn": 3}, "num_ln_in_parallel_attn"),
        ("falcon-sequential", {"num_kv_heads": 2}, "num_kv_heads"),
        ("falcon", {"num_key_value_heads": 3}, "`num_key_value_heads`"),
    ],
)
def test_unsupported_options_are_refused_by_name(case, changes, match):
    raw = {**config_of(case).to_dict(), **changes}
    with pytest.raises(ValueError, match=match):
        FAMILIES[raw["model_type"]].check_config(raw, "config.json")


def test_phi3_longrope_refuses_inputs_past_its_original_context(tmp_path):
    """Past ``original_max_position_embeddings`` transformers rotates every position with
    the long factors: refused rather than computed otherwise."""
    build(lambda: make("phi3-longrope"), tmp_path / "m")
    model = from_pretrained(tmp_path / "m", dtype="float32")
    ids, mask = left_padded_batch(VOCAB)
    with pytest.raises(ValueError, match="=32"):
        model.generate(ids, attention_mask=mask, max_new_tokens=30, pad_token_id=0)
    with pytest.raises(ValueError, match="=32"):
        model(input_ids=np.ones((1, 33), np.int64))

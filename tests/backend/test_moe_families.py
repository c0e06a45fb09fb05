"""The mixture-of-experts families (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE)
in `CausalLM` against transformers.

One test per family loads a tiny random transformers model once (4 experts, top-2; built
offline, parameters redrawn where greedy tokens are well separated, saved with
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

from _hf_models import build, left_padded_batch  # noqa: E402
from _moe_families import (  # noqa: E402
    CONFIGS,
    TOL,
    VOCAB,
    check_saved,
    config_of,
    hf_greedy,
    hf_logits,
    make,
)

from multiattn.hf.families import FAMILIES  # noqa: E402
from multiattn.hf.pretrained import from_pretrained  # noqa: E402
from multiattn.layers import MixtureOfExperts  # noqa: E402


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_moe_family_logits_tokens_and_saving_match_transformers(tmp_path, case):
    hf = build(lambda: make(case), tmp_path / "m")
    model = from_pretrained(tmp_path / "m", dtype="float32")
    kinds = [type(b.ffn).__name__ for b in model.layer.blocks]
    assert kinds == (["FeedForward", "MixtureOfExperts"] if case == "qwen2_moe"
                     else ["MixtureOfExperts"] * 2)  # fmt: skip
    ids, mask = left_padded_batch(VOCAB)
    got = to_np(model(input_ids=ids, attention_mask=mask)["logits"])
    real = mask.astype(bool)  # pad positions carry no meaning in either library
    err = rel_err(got[real], hf_logits(hf, ids, mask)[real])
    print(f"{case}: max relative error {err:.2e}")
    assert err <= TOL, case
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=0)
    np.testing.assert_array_equal(tokens, hf_greedy(hf, ids, mask))
    model.save_pretrained(tmp_path / "out")
    check_saved(hf, tmp_path / "out")


@pytest.mark.parametrize(
    ("case", "changes", "match"),
    [
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
        ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ("mixtral", {"num_local_experts": 0}, "num_local_experts"),
        ("mixtral", {"made_up_option": 1}, "made_up_option"),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen2_moe", {"mlp_only_layers": [2]}, "mlp_only_layers"),
        ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen2_moe", {"norm_topk_prob": 1}, "norm_topk_prob"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate"),
        ("qwen2_moe", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen3_moe", {"attention_bias": 1}, "attention_bias"),
        ("qwen3_moe", {"moe_intermediate_size": -1}, "moe_intermediate_size"),
    ],
)
def test_unsupported_moe_options_are_refused_by_name(case, changes, match):
    raw = {**config_of(case).to_dict(), **changes}
    with pytest.raises(ValueError, match=match):
        FAMILIES[raw["model_type"]].check_config(raw, "config.json")


def test_moe_training_options_are_inert():
    """The router's auxiliary loss and Mixtral's jitter act in training only: accepted,
    not read."""
    raw = {**config_of("mixtral").to_dict(), "output_router_logits": True,
           "router_aux_loss_coef": 0.5, "router_jitter_noise": 0.1}  # fmt: skip
    sizes = FAMILIES["mixtral"].check_config(raw, "config.json")
    assert sizes["moe"] == {"num_experts": 4, "num_experts_per_tok": 2, "expert_dff": 48,
                            "norm_topk_prob": True}  # fmt: skip
    raw = {**config_of("qwen2_moe").to_dict(), "decoder_sparse_step": 2, "mlp_only_layers": []}
    sizes = FAMILIES["qwen2_moe"].check_config(raw, "config.json")
    assert sizes["moe"]["dense_layers"] == [0] and sizes["moe"]["shared_expert_dff"] == 40
    assert MixtureOfExperts  # exported

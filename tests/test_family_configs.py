"""The config.json files of the published checkpoints of issue 50's families, as they stand
on the Hugging Face hub (the keys and values of EleutherAI/pythia-160m, microsoft/phi-2,
microsoft/Phi-3-mini-128k-instruct, tiiuae/falcon-7b, facebook/opt-350m and
answerdotai/ModernBERT-base, written before transformers 5; sizes kept), are read with the options they mean, and the
keys that would change the model are refused by name. Config-only: no framework, no
tensor."""

from __future__ import annotations

import math

import pytest

from multiattn.hf.families import FAMILIES

PYTHIA = {
    "architectures": ["GPTNeoXForCausalLM"],
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "gelu",
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "model_type": "gpt_neox",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "rotary_emb_base": 10000,
    "rotary_pct": 0.25,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.24.0",
    "use_cache": True,
    "use_parallel_residual": True,
    "vocab_size": 50304,
}
PHI2 = {
    "architectures": ["PhiForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 50256,
    "embd_pdrop": 0.0,
    "eos_token_id": 50256,
    "hidden_act": "gelu_new",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 10240,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "model_type": "phi",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "partial_rotary_factor": 0.4,
    "qk_layernorm": False,
    "resid_pdrop": 0.1,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.37.0",
    "use_cache": True,
    "vocab_size": 51200,
}
PHI3_128K = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_phi3.Phi3Config",
        "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
    },
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "long_factor": [1.08 + i / 100 for i in range(48)],
        "short_factor": [1.0 + i / 200 for i in range(48)],
        "type": "longrope",
    },
    "rope_theta": 10000.0,
    "sliding_window": 262144,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.2",
    "use_cache": True,
    "vocab_size": 32064,
}
FALCON_7B = {
    "alibi": False,
    "apply_residual_connection_post_layernorm": False,
    "architectures": ["FalconForCausalLM"],
    "attention_dropout": 0.0,
    "bias": False,
    "bos_token_id": 11,
    "eos_token_id": 11,
    "hidden_dropout": 0.0,
    "hidden_size": 4544,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "falcon",
    "multi_query": True,
    "new_decoder_architecture": False,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "parallel_attn": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.27.4",
    "use_cache": True,
    "vocab_size": 65024,
}
OPT_350M = {
    "_name_or_path": "facebook/opt-350m", "_remove_final_layer_norm": False,
    "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": False, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 4096,
    "hidden_size": 1024, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "model_type": "opt", "num_attention_heads": 16, "num_hidden_layers": 24,
    "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16",
    "transformers_version": "4.20.0.dev0", "use_cache": True, "vocab_size": 50272,
    "word_embed_proj_dim": 512,
}  # fmt: skip


MODERNBERT_BASE = {
    "architectures": ["ModernBertForMaskedLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 50281,
    "classifier_activation": "gelu",
    "classifier_bias": False,
    "classifier_dropout": 0.0,
    "classifier_pooling": "mean",
    "cls_token_id": 50281,
    "decoder_bias": True,
    "deterministic_flash_attn": False,
    "embedding_dropout": 0.0,
    "eos_token_id": 50282,
    "global_attn_every_n_layers": 3,
    "global_rope_theta": 160000.0,
    "gradient_checkpointing": False,
    "hidden_activation": "gelu",
    "hidden_size": 768,
    "initializer_cutoff_factor": 2.0,
    "initializer_range": 0.02,
    "intermediate_size": 1152,
    "layer_norm_eps": 1e-05,
    "local_attention": 128,
    "local_rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "mlp_dropout": 0.0,
    "model_type": "modernbert",
    "norm_bias": False,
    "norm_eps": 1e-05,
    "num_attention_heads": 12,
    "num_hidden_layers": 22,
    "pad_token_id": 50283,
    "position_embedding_type": "absolute",
    "sep_token_id": 50282,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "transformers_version": "4.47.0.dev0",
    "vocab_size": 50368,
}


def _sizes(raw: dict) -> dict:
    return FAMILIES[raw["model_type"]].check_config(raw, "config.json")


def test_pythia_reads_a_quarter_of_each_head_rotated_from_the_older_keys():
    s = _sizes(PYTHIA)
    assert (s["rotary_dim"], s["rope_theta"], s["parallel_residual"]) == (16, 10000.0, True)
    assert not s["tied"] and s["attention_bias"] and s["fused_qkv"]


def test_phi2_rotates_40_percent_of_each_head_on_one_shared_norm():
    s = _sizes(PHI2)
    assert s["rotary_dim"] == 32 and s["shared_norm"] and s["head_bias"]


def test_phi3_128k_reads_longrope_within_its_original_context():
    s = _sizes(PHI3_128K)
    assert s["max_positions"] == 4096 and s["sliding_window"] == 262144
    scaling = s["rope_scaling"]
    assert scaling["rope_type"] == "per_plane"
    assert scaling["factors"] == PHI3_128K["rope_scaling"]["short_factor"]
    # transformers' default gain: sqrt(1 + ln(131072 / 4096) / ln(4096))
    assert math.isclose(scaling["attention_factor"], math.sqrt(1 + math.log(32) / math.log(4096)))


def test_falcon_7b_has_one_key_value_head_and_parallel_branches_on_one_norm():
    s = _sizes(FALCON_7B)
    assert (s["num_heads"], s["num_key_value_heads"], s["head_dim"]) == (71, 1, 64)
    assert s["parallel_residual"] and s["shared_norm"] and s["intermediate_size"] == 4 * 4544
    assert not s["attention_bias"] and s["tied"]


def test_opt_350m_is_post_norm_without_a_final_norm_and_projects_its_embeddings():
    s = _sizes(OPT_350M)
    assert s["norm_first"] is False and s["final_norm"] is False
    assert s["embed_projection"] == 512 and s["position_offset"] == 2 and s["tied"]


def test_modernbert_base_alternates_one_global_layer_in_three_with_local_windows():
    s = _sizes(MODERNBERT_BASE)
    layers = s["layers"]
    assert len(layers) == 22 and layers[0] == {"attention_norm": False}
    local = {"sliding_window": 65, "rope_theta": 10000.0, "rope_scaling": None}
    assert [layer.get("sliding_window") for layer in layers] == [
        None if i % 3 == 0 else 65 for i in range(22)
    ]
    assert layers[1] == local and layers[3] == {}
    assert s["rope_theta"] == 160000.0 and s["masked_lm"] and s["decoder_bias"]
    assert not s["norm_bias"] and not s["attention_bias"] and s["gated"]


@pytest.mark.parametrize(
    ("raw", "change", "match"),
    [
        (PYTHIA, {"rotary_pct": 1.5}, "partial_rotary_factor"),
        (PHI2, {"qk_layernorm": True}, "qk_layernorm"),
        (PHI3_128K, {"rope_scaling": {**PHI3_128K["rope_scaling"], "short_factor": [1.0]}},
         "short_factor"),
        (FALCON_7B, {"apply_residual_connection_post_layernorm": True},
         "apply_residual_connection_post_layernorm"),
        (FALCON_7B, {"alibi": True}, "alibi"),
        (FALCON_7B, {"num_key_value_heads": 71}, "num_key_value_heads"),
        (OPT_350M, {"activation_function": "gelu"}, "activation_function"),
        (MODERNBERT_BASE, {"hidden_activation": "gelu_fast"}, "hidden_activation"),
        (MODERNBERT_BASE, {"global_attn_every_n_layers": 0}, "global_attn_every_n_layers"),
    ],
)  # fmt: skip
def test_options_that_change_the_model_are_refused_by_name(raw, change, match):
    with pytest.raises(ValueError, match=match):
        _sizes({**raw, **change})

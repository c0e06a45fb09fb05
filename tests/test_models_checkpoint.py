"""multiattn.models.checkpoint (imports no framework): BERT names and layouts to the
neutral port layout, config reading, errors that name the tensor or key."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _bert_oracle import EPSILON, SIZES, random_weights

from multiattn.models.checkpoint import BertConfig, bert_to_neutral, layer_weights

CONFIG = BertConfig(
    vocab_size=SIZES["vocab_size"],
    hidden_size=SIZES["hidden_size"],
    num_layers=SIZES["num_layers"],
    num_heads=SIZES["num_heads"],
    intermediate_size=SIZES["intermediate_size"],
    max_positions=SIZES["max_positions"],
    type_vocab_size=SIZES["type_vocab_size"],
    epsilon=EPSILON,
)


def hf_state(prefix: str = "") -> dict[str, np.ndarray]:
    """A BERT state dict written from the neutral weights with explicit loops (the
    ``Linear`` convention: ``out[j] = sum_i W[j, i] x[i] + b[j]``, head-major features)."""
    w = random_weights()
    e, h = SIZES["hidden_size"], SIZES["num_heads"]
    d = e // h
    s = {
        "embeddings.word_embeddings.weight": w["embeddings/word"],
        "embeddings.position_embeddings.weight": w["embeddings/position"],
        "embeddings.token_type_embeddings.weight": w["embeddings/token_type"],
        "embeddings.LayerNorm.weight": w["embeddings/norm/gamma"],
        "embeddings.LayerNorm.bias": w["embeddings/norm/beta"],
        "embeddings.position_ids": np.arange(SIZES["max_positions"])[None],
        "pooler.dense.weight": np.zeros((e, e), np.float32),
        "pooler.dense.bias": np.zeros(e, np.float32),
    }
    for n in range(SIZES["num_layers"]):
        p, src = f"layer_{n}/", f"encoder.layer.{n}."
        for part in ("query", "key", "value"):
            kernel, bias = w[f"{p}attention/{part}/kernel"], w[f"{p}attention/{part}/bias"]
            weight = np.zeros((e, e), np.float32)
            flat_bias = np.zeros(e, np.float32)
            for head in range(h):
                for j in range(d):
                    weight[head * d + j, :] = kernel[:, head, j]
                    flat_bias[head * d + j] = bias[head, j]
            s[f"{src}attention.self.{part}.weight"] = weight
            s[f"{src}attention.self.{part}.bias"] = flat_bias
        out = w[f"{p}attention/output/kernel"]
        weight = np.zeros((e, e), np.float32)
        for head in range(h):
            for j in range(d):
                weight[:, head * d + j] = out[head, j, :]
        s[f"{src}attention.output.dense.weight"] = weight
        s[f"{src}attention.output.dense.bias"] = w[f"{p}attention/output/bias"]
        s[f"{src}intermediate.dense.weight"] = w[f"{p}ffn_1/kernel"].T.copy()
        s[f"{src}intermediate.dense.bias"] = w[f"{p}ffn_1/bias"]
        s[f"{src}output.dense.weight"] = w[f"{p}ffn_2/kernel"].T.copy()
        s[f"{src}output.dense.bias"] = w[f"{p}ffn_2/bias"]
        s[f"{src}attention.output.LayerNorm.weight"] = w[f"{p}norm_1/gamma"]
        s[f"{src}attention.output.LayerNorm.bias"] = w[f"{p}norm_1/beta"]
        s[f"{src}output.LayerNorm.weight"] = w[f"{p}norm_2/gamma"]
        s[f"{src}output.LayerNorm.bias"] = w[f"{p}norm_2/beta"]
    return {prefix + k: v for k, v in s.items()}


@pytest.mark.parametrize("prefix", ["", "bert."])
def test_bert_to_neutral_is_exact(prefix):
    got = bert_to_neutral(hf_state(prefix), CONFIG)
    want = random_weights()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_layer_weights_strips_the_prefix():
    sub = layer_weights(random_weights(), 1)
    assert "attention/query/kernel" in sub and "norm_2/beta" in sub
    assert len(sub) == 16
    with pytest.raises(ValueError, match="layer 7"):
        layer_weights(random_weights(), 7)


def test_missing_or_misshapen_tensor_is_named():
    state = hf_state()
    del state["encoder.layer.1.output.dense.bias"]
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.output\.dense\.bias"):
        bert_to_neutral(state, CONFIG)
    state = hf_state()
    state["embeddings.word_embeddings.weight"] = state["embeddings.word_embeddings.weight"][:, :4]
    with pytest.raises(ValueError, match=r"word_embeddings.*\(40, 4\)"):
        bert_to_neutral(state, CONFIG)


def _config_json(tmp_path, **changes) -> str:
    raw = {
        "model_type": "bert",
        "hidden_act": "gelu",
        "hidden_size": 16,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 24,
        "max_position_embeddings": 12,
        "type_vocab_size": 2,
        "vocab_size": 40,
        "layer_norm_eps": 1e-12,
        **changes,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def test_config_from_json(tmp_path):
    assert BertConfig.from_json(_config_json(tmp_path)) == CONFIG


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"hidden_act": "gelu_new"}, "hidden_act"),
        ({"model_type": "roberta"}, "model_type"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"num_attention_heads": 5}, "divisible"),
    ],
)
def test_config_rejects_other_variants(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        BertConfig.from_json(_config_json(tmp_path, **changes))

"""float64 oracle of the BERT sentence encoder, composed from `multiattn.reference` only.

Weights use the neutral names of `multiattn.hf.bert_weights`. Imports no framework (the
backend and Paddle workers both use it).
"""

from __future__ import annotations

import numpy as np

from multiattn import reference as ref

# A small BERT: every code path of the real one, a fraction of the size.
SIZES = {
    "vocab_size": 40,
    "hidden_size": 16,
    "num_layers": 2,
    "num_heads": 4,
    "intermediate_size": 24,
    "max_positions": 12,
    "type_vocab_size": 2,
}
EPSILON = 1e-12


def random_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Neutral weights of a `SIZES` BERT, float32 values (so every framework holds them
    exactly)."""
    rng = np.random.default_rng(seed)
    s = SIZES
    e, h, f = s["hidden_size"], s["num_heads"], s["intermediate_size"]
    d = e // h

    def normal(*shape, scale=0.3, shift=0.0):
        return (shift + scale * rng.standard_normal(shape)).astype(np.float32)

    w = {
        "embeddings/word": normal(s["vocab_size"], e),
        "embeddings/position": normal(s["max_positions"], e),
        "embeddings/token_type": normal(s["type_vocab_size"], e),
        "embeddings/norm/gamma": normal(e, scale=0.1, shift=1.0),
        "embeddings/norm/beta": normal(e, scale=0.1),
    }
    for i in range(s["num_layers"]):
        p = f"layer_{i}/"
        for part in ("query", "key", "value"):
            w[f"{p}attention/{part}/kernel"] = normal(e, h, d)
            w[f"{p}attention/{part}/bias"] = normal(h, d, scale=0.1)
        w[f"{p}attention/output/kernel"] = normal(h, d, e)
        w[f"{p}attention/output/bias"] = normal(e, scale=0.1)
        w[f"{p}ffn_1/kernel"] = normal(e, f)
        w[f"{p}ffn_1/bias"] = normal(f, scale=0.1)
        w[f"{p}ffn_2/kernel"] = normal(f, e)
        w[f"{p}ffn_2/bias"] = normal(e, scale=0.1)
        for norm in ("norm_1", "norm_2"):
            w[f"{p}{norm}/gamma"] = normal(e, scale=0.1, shift=1.0)
            w[f"{p}{norm}/beta"] = normal(e, scale=0.1)
    return w


def random_batch(seed: int = 1) -> dict[str, np.ndarray]:
    """Token ids ``(4, 9)`` with right padding (lengths 9, 5, 1, 0: the last row is all
    padding), random token types, and non-zero ids in the padding (the mask decides)."""
    rng = np.random.default_rng(seed)
    lengths = np.array([9, 5, 1, 0])
    ids = rng.integers(1, SIZES["vocab_size"], size=(4, 9)).astype(np.int32)
    mask = (np.arange(9)[None, :] < lengths[:, None]).astype(np.int32)
    types = rng.integers(0, 2, size=(4, 9)).astype(np.int32)
    return {"token_ids": ids, "attention_mask": mask, "token_type_ids": types}


def sentence_embedding(
    w: dict[str, np.ndarray],
    token_ids: np.ndarray,
    attention_mask: np.ndarray,
    token_type_ids: np.ndarray,
    normalize: bool = True,
) -> np.ndarray:
    """BERT embeddings, post-LN encoder layers (exact GELU), mean pooling over the real
    tokens, L2 normalisation; float64 ``(batch, hidden)``."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    seq = token_ids.shape[1]
    x = w["embeddings/word"][token_ids] + w["embeddings/token_type"][token_type_ids]
    x = x + w["embeddings/position"][np.arange(seq)][None]
    x = ref.layer_norm(x, w["embeddings/norm/gamma"], w["embeddings/norm/beta"], EPSILON)
    keep = np.asarray(attention_mask) != 0
    for i in range(SIZES["num_layers"]):
        p = f"layer_{i}/"
        attention = {
            f"{part}_{kind}": w[f"{p}attention/{part}/{kind}"]
            for part in ("query", "key", "value", "output")
            for kind in ("kernel", "bias")
        }
        layer = {
            "attention": attention,
            "ffn_w1": w[f"{p}ffn_1/kernel"],
            "ffn_b1": w[f"{p}ffn_1/bias"],
            "ffn_w2": w[f"{p}ffn_2/kernel"],
            "ffn_b2": w[f"{p}ffn_2/bias"],
            "norm1_gamma": w[f"{p}norm_1/gamma"],
            "norm1_beta": w[f"{p}norm_1/beta"],
            "norm2_gamma": w[f"{p}norm_2/gamma"],
            "norm2_beta": w[f"{p}norm_2/beta"],
        }
        x = ref.transformer_encoder_layer(
            x,
            weights=layer,
            num_heads=SIZES["num_heads"],
            epsilon=EPSILON,
            activation="gelu",
            mask=keep[:, None, :],  # (batch, 1 query row broadcast, keys)
        )
    m = keep[:, :, None].astype(np.float64)
    pooled = (x * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    if not normalize:
        return pooled
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)

"""Shared by the decoder-block port tests (Keras workers and the Paddle worker): block
configs, random neutral weights and the float64 oracle of `multiattn.reference` on them."""

from __future__ import annotations

import numpy as np
from _port_oracle import _mha_ref, random_weights

from multiattn import reference

#: neutral ``decoder_only`` configs: GPT-2-like, Llama-like (grouped heads, rotary with
#: scaling, sliding window), explicit head_dim.
DECODER_ONLY = {
    "gpt2": dict(d_model=16, num_heads=4, dff=24, norm_first=True, activation="gelu_new"),
    "llama": dict(d_model=16, num_heads=4, dff=24, norm="rms", norm_first=True,
                  activation="silu", gated=True, num_key_value_heads=2, attention_bias=False,
                  output_bias=False, ffn_bias=False, rotary_max_length=32, rotary_base=500.0,
                  rotary_scaling={"rope_type": "linear", "factor": 2.0}, sliding_window=3),
    "head_dim": dict(d_model=12, num_heads=4, dff=20, head_dim=4, gated=True,
                     epsilon=1e-5),
}  # fmt: skip
#: neutral ``decoder`` configs (a context width other than d_model in the second)
DECODER = {
    "post": dict(d_model=16, num_heads=4, dff=24),
    "pre_grouped_rotary": dict(d_model=16, num_heads=4, dff=24, norm_first=True,
                               activation="gelu", context_width=8, num_key_value_heads=2,
                               rotary_max_length=16),
}  # fmt: skip


def weights(kind: str, config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random neutral weights (norm scales around 1)."""
    out = random_weights(kind, config, seed)
    for name in out:
        if name.endswith("/scale"):
            out[name] = (1.0 + 0.1 * out[name]).astype(np.float32)
    return out


def block_options(config: dict) -> dict:
    """A neutral config as the block's keyword arguments (``rate`` for ``dropout``)."""
    return {("rate" if k == "dropout" else k): v for k, v in config.items()
            if k != "context_width"}  # fmt: skip


def oracle(kind: str, config: dict, w: dict, x, context=None) -> np.ndarray:
    """The float64 output of the block with neutral config and weights (inference)."""
    c = config
    norms = {f"norm{i}_{n}": w[f"norm_{i}/{n}"] for i in (1, 2, 3) for n in ("gamma", "beta", "scale")
             if f"norm_{i}/{n}" in w}  # fmt: skip
    if kind == "decoder":
        ffn = {
            f"ffn_{a}{i}": w[f"ffn_{i}/{b}"]
            for i in (1, 2)
            for a, b in (("w", "kernel"), ("b", "bias"))
        }
        return reference.transformer_decoder_layer(
            x, context, weights={"self_attention": _mha_ref(w, "self_attention/"),
                                 "cross_attention": _mha_ref(w, "cross_attention/"),
                                 **ffn, **norms},
            norm_first=c.get("norm_first", False), epsilon=c.get("epsilon", 1e-6),
            activation=c.get("activation", "relu"),
            rotary_base=10000.0 if c.get("rotary_max_length") else None,
        )  # fmt: skip
    ffn = {f"{part}_{var}": w[f"ffn/{part}/{var}"] for part in ("up", "down", "gate")
           for var in ("kernel", "bias") if f"ffn/{part}/{var}" in w}  # fmt: skip
    rotary = c.get("rotary_max_length")
    return reference.transformer_decoder_only_layer(
        x, weights={"attention": _mha_ref(w, "self_attention/"), "ffn": ffn, **norms},
        norm=c.get("norm", "layer"), norm_first=c.get("norm_first", False),
        epsilon=c.get("epsilon", 1e-6), activation_name=c.get("activation", "relu"),
        gated=c.get("gated", False), rotary_base=c.get("rotary_base", 10000.0) if rotary else None,
        rotary_scaling=c.get("rotary_scaling"), sliding_window=c.get("sliding_window"),
    )  # fmt: skip

"""The neutral layout of the two decoder blocks (imports no framework).

``decoder`` (`multiattn.layers.TransformerDecoderLayer`: self-attention, cross-attention,
feed-forward network)
    ``self_attention/<mha names>`` (``D = Dv = d_model / H``, biases present, ``H_kv``
    key/value heads), ``cross_attention/<mha names>`` (the same, its key and value
    kernels ``(context_width, H_kv, D)``), ``ffn_1/kernel (E, F)``, ``ffn_1/bias (F,)``,
    ``ffn_2/kernel (F, E)``, ``ffn_2/bias (E,)``, ``norm_<i>/gamma (E,)`` and
    ``norm_<i>/beta (E,)`` for ``i`` = 1, 2, 3 (around the self-attention, the
    cross-attention and the feed-forward network).

``decoder_only`` (`multiattn.layers.TransformerDecoderOnlyLayer`, the block of GPT-2,
Llama, Qwen2 and Mistral)
    ``self_attention/<mha names>`` (``D = head_dim``, the query, key and value biases
    present when ``attention_bias``, the output bias when ``output_bias``),
    ``ffn/up/kernel (E, F)``, ``ffn/down/kernel (F, E)``, ``ffn/gate/kernel (E, F)`` when
    ``gated``, each with its bias when ``ffn_bias``; ``norm_1`` (around the attention)
    and ``norm_2`` (around the feed-forward network): ``gamma`` and ``beta`` for
    ``norm="layer"``, ``scale`` for ``norm="rms"``.

The ``<mha names>`` are those of the ``mha`` kind (``query/kernel (E, H, D)``, ...,
``output/kernel (H, D, E)``). The configs use the blocks' own argument names
(`multiattn.layers.DecoderBlockConfig`'s fields for ``decoder_only``), with ``dropout``
for the dropout rate as in every kind. Keys holding their default are dropped, so a config
names only what differs from a plain block; the default of each key is the block's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..ops.activations import ACTIVATIONS
from ..ops.rotary import check_rotary_scaling

__all__ = ["DECODER_KINDS", "DEFAULTS", "check_decoder_config", "decoder_shapes"]

DECODER_KINDS = ("decoder", "decoder_only")
_REQUIRED = ("d_model", "num_heads", "dff")

#: Each key's type and default (the block's default; `tests/test_port_layout.py` checks
#: them against the layers' signatures and `DecoderBlockConfig`).
_POSITIVE, _BOOL, _FLOAT = "positive int", "bool", "positive float"
DEFAULTS: dict[str, dict[str, tuple[str, Any]]] = {
    "decoder": {
        "dropout": ("rate", 0.1), "norm_first": (_BOOL, False), "epsilon": (_FLOAT, 1e-6),
        "activation": ("activation", "relu"), "context_width": (_POSITIVE, None),
        "num_key_value_heads": (_POSITIVE, None), "rotary_max_length": (_POSITIVE, None),
    },
    "decoder_only": {
        "dropout": ("rate", 0.1), "norm": ("norm", "layer"), "norm_first": (_BOOL, False),
        "epsilon": (_FLOAT, 1e-6), "activation": ("activation", "relu"),
        "gated": (_BOOL, False), "num_key_value_heads": (_POSITIVE, None),
        "head_dim": (_POSITIVE, None), "attention_bias": (_BOOL, True),
        "output_bias": (_BOOL, True), "ffn_bias": (_BOOL, True),
        "rotary_max_length": (_POSITIVE, None), "rotary_base": (_FLOAT, 10000.0),
        "rotary_dim": (_POSITIVE, None), "rotary_interleaved": (_BOOL, False),
        "rotary_scaling": ("scaling", None), "sliding_window": (_POSITIVE, None),
    },
}  # fmt: skip


_RULES = {
    _BOOL: "a bool",
    _POSITIVE: "a positive int",
    _FLOAT: "a positive finite number",
    "rate": "a number in [0, 1)",
}


def _value(kind: str, key: str, rule: str, value: Any) -> Any:
    """``value`` of ``key`` checked against ``rule`` (the first item of `DEFAULTS`)."""
    if rule == "scaling":
        return check_rotary_scaling(f"{kind} config", value, key)
    if rule in ("activation", "norm"):
        allowed = tuple(ACTIVATIONS) if rule == "activation" else ("layer", "rms")
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(
                f"{kind} config: `{key}` must be one of {allowed}; received {value!r}."
            )
        return value
    bad = ValueError(f"{kind} config: `{key}` must be {_RULES[rule]}; received {value!r}.")
    if rule == _BOOL:
        if not isinstance(value, (bool, np.bool_)):
            raise bad
        return bool(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise bad
    if rule == _POSITIVE:
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise bad
        return int(value)
    number = float(value)
    if not (0.0 <= number < 1.0 if rule == "rate" else number > 0 and math.isfinite(number)):
        raise bad
    return number


def check_decoder_config(kind: str, config: dict) -> dict:
    """``config`` of a ``decoder``/``decoder_only`` block checked: the required sizes
    (positive ints), no unknown key, each option of its type; keys equal to their default
    are dropped (``num_key_value_heads = num_heads`` and ``context_width = d_model`` too). Raises ValueError naming the key and quoting the value."""
    rules = DEFAULTS[kind]
    unknown = sorted(set(config) - set(_REQUIRED) - set(rules))
    if unknown:
        raise ValueError(
            f"{kind} config: unknown key(s) {unknown}; allowed {list(_REQUIRED)} and {list(rules)}."
        )
    out: dict[str, Any] = {}
    for key in _REQUIRED:
        if key not in config:
            raise ValueError(f"{kind} config: missing key {key!r}; received {config!r}.")
        out[key] = _value(kind, key, _POSITIVE, config[key])
    for key, (rule, default) in rules.items():
        value = config.get(key, default)
        if value is not None:
            value = _value(kind, key, rule, value)
        if value != default:
            out[key] = value
    h, hkv = out["num_heads"], out.get("num_key_value_heads", out["num_heads"])
    if h % hkv:
        raise ValueError(
            f"{kind} config: `num_key_value_heads` ({hkv}) must divide `num_heads` ({h})."
        )
    if out.get("num_key_value_heads") == h:
        del out["num_key_value_heads"]
    if out.get("context_width") == out["d_model"]:
        del out["context_width"]
    if "head_dim" not in out and out["d_model"] % h:
        raise ValueError(
            f"{kind} config: `d_model` ({out['d_model']}) must be divisible by `num_heads` "
            f"({h}){', or give `head_dim`' if kind == 'decoder_only' else ''}."
        )
    return out


def _attention(prefix: str, e: int, h: int, hkv: int, d: int, kv_width: int,
               bias: bool, output_bias: bool) -> dict[str, tuple[int, ...]]:  # fmt: skip
    shapes = {"query/kernel": (e, h, d), "key/kernel": (kv_width, hkv, d),
              "value/kernel": (kv_width, hkv, d), "output/kernel": (h, d, e)}  # fmt: skip
    if bias:
        shapes.update({"query/bias": (h, d), "key/bias": (hkv, d), "value/bias": (hkv, d)})
    if output_bias:
        shapes["output/bias"] = (e,)
    return {prefix + k: v for k, v in shapes.items()}


def decoder_shapes(kind: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Every neutral weight of a ``kind`` block with ``config`` (checked), with its shape."""
    c = {**{k: d for k, (_, d) in DEFAULTS[kind].items()}, **check_decoder_config(kind, config)}
    e, h, f = c["d_model"], c["num_heads"], c["dff"]
    hkv = c["num_key_value_heads"] or h
    if kind == "decoder":
        d = e // h
        out = _attention("self_attention/", e, h, hkv, d, e, True, True)
        out.update(
            _attention("cross_attention/", e, h, hkv, d, c["context_width"] or e, True, True)
        )
        out.update({"ffn_1/kernel": (e, f), "ffn_1/bias": (f,), "ffn_2/kernel": (f, e),
                    "ffn_2/bias": (e,)})  # fmt: skip
        for i in (1, 2, 3):
            out.update({f"norm_{i}/gamma": (e,), f"norm_{i}/beta": (e,)})
        return out
    d = c["head_dim"] or e // h
    out = _attention("self_attention/", e, h, hkv, d, e, c["attention_bias"], c["output_bias"])
    parts = {"up": (e, f), "down": (f, e), **({"gate": (e, f)} if c["gated"] else {})}
    for part, shape in parts.items():
        out[f"ffn/{part}/kernel"] = shape
        if c["ffn_bias"]:
            out[f"ffn/{part}/bias"] = (shape[1],)
    names = ("gamma", "beta") if c["norm"] == "layer" else ("scale",)
    for i in (1, 2):
        out.update({f"norm_{i}/{n}": (e,) for n in names})
    return out

"""flax-side handler: ``flax.nnx.MultiHeadAttention`` (imported only when flax.nnx is loaded).

Its parameters already have the neutral layout: ``query``, ``key``, ``value``
(``LinearGeneral`` kernels ``(in, H, D)``, biases ``(H, D)``; ``H_kv = num_kv_heads`` heads
for ``key`` and ``value``) and ``out`` (kernel ``(H, D, out)``, bias ``(out,)``). One
``in_kv_features`` width serves keys and values, and one ``head_dim`` queries, keys and
values. Grouped heads match the neutral grouping (flax's attention splits the query heads
into ``H_kv`` consecutive groups); there is no rotary position embedding.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .layout import refuse_settings

_PARTS = {"query": "query", "key": "key", "value": "value", "output": "out"}


def owns(target: str, module: Any) -> bool:
    return type(module) is nnx.MultiHeadAttention


def kind_of(target: str, module: Any) -> str:
    return "mha"


def settings(target: str, module: Any) -> dict:
    hkv = module.num_kv_heads
    return {} if hkv in (None, module.num_heads) else {"num_key_value_heads": int(hkv)}


def _config(m: Any) -> dict:
    if m.normalize_qk or m.decode:
        raise ValueError(
            "flax.nnx.MultiHeadAttention with normalize_qk or decode has no neutral "
            f"equivalent; received normalize_qk={m.normalize_qk}, decode={m.decode}."
        )
    return {
        "num_heads": m.num_heads,
        "key_dim": m.head_dim,
        "value_dim": m.head_dim,
        "query_width": m.in_features,
        "key_width": m.in_kv_features,
        "value_width": m.in_kv_features,
        "output_width": m.out_features,
        "use_bias": bool(m.use_bias),
        "dropout": float(m.dropout_rate),
        **settings("flax", m),
    }


def read(target: str, module: Any) -> tuple[str, dict, dict]:
    config = _config(module)
    w = {}
    for name, attr in _PARTS.items():
        layer = getattr(module, attr)
        w[f"{name}/kernel"] = np.array(layer.kernel.value)
        if config["use_bias"]:
            w[f"{name}/bias"] = np.array(layer.bias.value)
    return "mha", config, w


def config_of(target: str, module: Any, arrays: dict) -> dict:
    return {k: v for k, v in _config(module).items() if k != "dropout"}


def write(target: str, module: Any, kind: str, config: dict, w: dict) -> None:
    for name, arr in w.items():
        part, var = name.split("/")
        param = getattr(getattr(module, _PARTS[part]), var)
        param.value = jnp.asarray(np.asarray(arr, dtype=param.value.dtype))


def build(target: str, kind: str, c: dict, options: dict) -> Any:
    dtype = options.pop("dtype", None)
    rngs = options.pop("rngs", None) or nnx.Rngs(0)
    if options:
        raise ValueError(f"convert(to='flax'): unknown option(s) {sorted(options)}.")
    if kind != "mha":
        raise ValueError(f"convert(to='flax'): flax.nnx has no {kind} module.")
    what = "flax.nnx.MultiHeadAttention"
    refuse_settings("convert(to='flax')", what, kind, c, grouped=True)
    if c["value_dim"] != c["key_dim"] or c["value_width"] != c["key_width"]:
        raise ValueError(
            "convert(to='flax'): flax.nnx.MultiHeadAttention needs value_dim = key_dim and "
            f"equal key and value widths; received {c}."
        )
    kwargs = {} if dtype is None else {"dtype": dtype, "param_dtype": dtype}
    return nnx.MultiHeadAttention(
        c["num_heads"],
        c["query_width"],
        qkv_features=c["num_heads"] * c["key_dim"],
        out_features=c["output_width"],
        in_kv_features=c["key_width"],
        num_kv_heads=c.get("num_key_value_heads"),
        use_bias=c["use_bias"],
        dropout_rate=c.get("dropout", 0.0),
        decode=False,
        rngs=rngs,
        **kwargs,
    )

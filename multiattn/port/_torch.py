"""torch-side handlers: ``torch.nn.MultiheadAttention``, ``torch.nn.TransformerEncoderLayer``
and the PyTorch document adapter's ``AdditiveAttention`` (``multiattn.backends.torch``).

Imported only when torch is loaded. Names and layouts: `multiattn.port.names`.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from .layout import BEHAVIOUR_KEYS, refuse_settings
from .names import neutral_to_torch, torch_to_neutral

_ACTIVATIONS = {1: "relu", 2: "gelu"}


def _classes(target: str) -> dict[type, str]:
    if target == "torch":
        return {torch.nn.MultiheadAttention: "mha", torch.nn.TransformerEncoderLayer: "encoder"}
    doc = sys.modules.get("multiattn.backends.torch")
    return {} if doc is None else {doc.AdditiveAttention: "additive"}


def owns(target: str, module: Any) -> bool:
    return type(module) in _classes(target)


def kind_of(target: str, module: Any) -> str:
    return _classes(target)[type(module)]


def settings(target: str, module: Any) -> dict:
    """torch.nn modules have no grouped heads and no rotary position embedding."""
    return {}


def _mha_config(m: Any) -> dict:
    if m.bias_k is not None or m.add_zero_attn:
        raise ValueError(
            "torch.nn.MultiheadAttention with add_bias_kv or add_zero_attn has no neutral "
            "equivalent."
        )
    h, e = m.num_heads, m.embed_dim
    return {
        "num_heads": h,
        "key_dim": e // h,
        "value_dim": e // h,
        "query_width": e,
        "key_width": m.kdim,
        "value_width": m.vdim,
        "output_width": e,
        "use_bias": m.in_proj_bias is not None,
        "dropout": float(m.dropout),
    }


def _encoder_config(m: Any) -> dict:
    act = _ACTIVATIONS.get(getattr(m, "activation_relu_or_gelu", 0))
    if act is None:
        raise ValueError(
            "torch.nn.TransformerEncoderLayer: only the relu and gelu activations have a "
            f"neutral equivalent; received {m.activation!r}."
        )
    if m.linear1.bias is None or m.norm1.bias is None:
        raise ValueError("torch.nn.TransformerEncoderLayer with bias=False is not supported.")
    return {
        "d_model": m.self_attn.embed_dim,
        "num_heads": m.self_attn.num_heads,
        "dff": m.linear1.out_features,
        "dropout": float(m.dropout.p),
        "norm_first": bool(m.norm_first),
        "epsilon": float(m.norm1.eps),
        "activation": act,
    }


def _config(target: str, module: Any) -> dict:
    kind = kind_of(target, module)
    if kind == "additive":
        return {
            "units": module.W_q.out_features,
            "query_width": module.W_q.in_features,
            "key_width": module.W_k.in_features,
            "dropout": float(module.dropout.p),
        }
    return _mha_config(module) if kind == "mha" else _encoder_config(module)


def _state(module: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def read(target: str, module: Any) -> tuple[str, dict, dict]:
    kind, config = kind_of(target, module), _config(target, module)
    if kind == "additive":
        s = _state(module)
        w = {
            "query/kernel": np.ascontiguousarray(s["W_q.weight"].T),
            "key/kernel": np.ascontiguousarray(s["W_k.weight"].T),
            "score/kernel": s["w_v.weight"][0].copy(),
        }
        return kind, config, w
    shape_config = {k: v for k, v in config.items() if k not in BEHAVIOUR_KEYS}
    return kind, config, torch_to_neutral(kind, _state(module), shape_config)


def config_of(target: str, module: Any, arrays: dict) -> dict:
    return {k: v for k, v in _config(target, module).items() if k not in BEHAVIOUR_KEYS}


def write(target: str, module: Any, kind: str, config: dict, w: dict) -> None:
    if kind == "additive":
        flat = {
            "W_q.weight": np.ascontiguousarray(w["query/kernel"].T),
            "W_k.weight": np.ascontiguousarray(w["key/kernel"].T),
            "w_v.weight": w["score/kernel"][None, :],
        }
    else:
        flat = neutral_to_torch(kind, w, config)
    state = module.state_dict()
    tensors = {k: torch.from_numpy(np.asarray(v)).to(state[k].dtype) for k, v in flat.items()}
    module.load_state_dict(tensors, strict=True)


def build(target: str, kind: str, c: dict, options: dict) -> Any:
    dtype = options.pop("dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    batch_first = options.pop("batch_first", True)
    if options:
        raise ValueError(
            f"convert(to={target!r}): unknown option(s) {sorted(options)}; accepted: dtype"
            + (", batch_first." if target == "torch" else ".")
        )
    if target == "torch-doc":
        if kind != "additive":
            raise ValueError(
                f"convert(to='torch-doc'): the PyTorch document has weights only in "
                f"AdditiveAttention; received kind {kind!r}."
            )
        doc = sys.modules["multiattn.backends.torch"]
        module = doc.AdditiveAttention(
            c["key_width"], c["query_width"], c["units"], c.get("dropout", 0.0)
        )
        return module if dtype is None else module.to(dtype)
    if kind == "mha":
        refuse_settings("convert(to='torch')", "torch.nn.MultiheadAttention", kind, c)
        if c["key_dim"] * c["num_heads"] != c["query_width"] or c["value_dim"] != c["key_dim"]:
            raise ValueError(
                "convert(to='torch'): torch.nn.MultiheadAttention needs key_dim = value_dim = "
                f"query width / num_heads; received {c}."
            )
        if c["output_width"] != c["query_width"]:
            raise ValueError(
                "convert(to='torch'): torch.nn.MultiheadAttention's output width is the query "
                f"width; received output width {c['output_width']}."
            )
        return torch.nn.MultiheadAttention(
            c["query_width"],
            c["num_heads"],
            dropout=c.get("dropout", 0.0),
            bias=c["use_bias"],
            kdim=c["key_width"],
            vdim=c["value_width"],
            batch_first=batch_first,
            dtype=dtype,
        )
    if kind != "encoder":
        raise ValueError(f"convert(to='torch'): torch.nn has no {kind} module.")
    return torch.nn.TransformerEncoderLayer(
        c["d_model"],
        c["num_heads"],
        dim_feedforward=c["dff"],
        dropout=c.get("dropout", 0.1),
        activation=c.get("activation", "relu"),
        layer_norm_eps=c.get("epsilon", 1e-5),
        batch_first=batch_first,
        norm_first=c.get("norm_first", False),
        dtype=dtype,
    )

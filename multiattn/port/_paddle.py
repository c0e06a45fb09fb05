"""paddle-side handlers: ``paddle.nn.MultiHeadAttention``, ``paddle.nn.TransformerEncoderLayer``
and the PaddlePaddle document adapter's ``MultiHeadAttention`` (``multiattn.backends.paddle``).

Imported only when paddle is loaded. The document's heads are interleaved: feature ``f``
of ``W_q``/``W_k``/``W_v`` belongs to head ``f % H`` at depth ``f // H``, so its neutral
kernel is ``W.reshape(E, D, H).transpose(0, 2, 1)``; ``W_o`` takes the heads contiguously
(``W_o.weight.reshape(H, D, E_out)``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import paddle

from .layout import BEHAVIOUR_KEYS, refuse_settings
from .names import neutral_to_paddle, paddle_to_neutral

_BEHAVIOUR = BEHAVIOUR_KEYS
_DOC_QKV = (("query", "W_q"), ("key", "W_k"), ("value", "W_v"))


def _classes(target: str) -> dict[type, str]:
    if target == "paddle":
        return {paddle.nn.MultiHeadAttention: "mha", paddle.nn.TransformerEncoderLayer: "encoder"}
    doc = sys.modules.get("multiattn.backends.paddle")
    return {} if doc is None else {doc.MultiHeadAttention: "mha"}


def owns(target: str, module: Any) -> bool:
    return type(module) in _classes(target)


def kind_of(target: str, module: Any) -> str:
    return _classes(target)[type(module)]


def settings(target: str, module: Any) -> dict:
    """paddle.nn modules and the document's layer have no grouped heads and no RoPE."""
    return {}


def _mha_config(m: Any) -> dict:
    h, e = m.num_heads, m.embed_dim
    return {
        "num_heads": h,
        "key_dim": e // h,
        "value_dim": e // h,
        "query_width": e,
        "key_width": m.kdim,
        "value_width": m.vdim,
        "output_width": e,
        "use_bias": m.q_proj.bias is not None,
        "dropout": float(m.dropout),
    }


def _encoder_config(m: Any) -> dict:
    functions = {paddle.nn.functional.relu: "relu", paddle.nn.functional.gelu: "gelu"}
    act = functions.get(m.activation)
    if act is None:
        raise ValueError(
            "paddle.nn.TransformerEncoderLayer: only the relu and gelu activations have a "
            f"neutral equivalent; received {m.activation!r}."
        )
    if m.linear1.bias is None or m.norm1.bias is None:
        raise ValueError("paddle.nn.TransformerEncoderLayer without biases is not supported.")
    return {
        "d_model": m.self_attn.embed_dim,
        "num_heads": m.self_attn.num_heads,
        "dff": int(m.linear1.weight.shape[1]),
        "dropout": float(m.dropout1.p),
        "norm_first": bool(m.normalize_before),
        "epsilon": float(m.norm1._epsilon),
        "activation": act,
    }


def _doc_config(m: Any) -> dict:
    return {
        "num_heads": m.head_num,
        "key_dim": m.hidden_vec_size,
        "value_dim": m.hidden_vec_size,
        "query_width": m.query_vec_size,
        "key_width": m.query_vec_size,
        "value_width": m.query_vec_size,
        "output_width": m.output_vec_size,
        "use_bias": True,
    }


def _config(target: str, module: Any) -> dict:
    if target == "paddle-doc":
        return _doc_config(module)
    return _mha_config(module) if kind_of(target, module) == "mha" else _encoder_config(module)


def _state(module: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v.numpy()) for k, v in module.state_dict().items()}


def read(target: str, module: Any) -> tuple[str, dict, dict]:
    kind, config = kind_of(target, module), _config(target, module)
    s = _state(module)
    if target == "paddle-doc":
        h, d = module.head_num, module.hidden_vec_size
        w = {}
        for name, attr in _DOC_QKV:
            kernel = s[f"{attr}.weight"]
            w[f"{name}/kernel"] = np.ascontiguousarray(
                kernel.reshape(kernel.shape[0], d, h).transpose(0, 2, 1)
            )
            w[f"{name}/bias"] = np.ascontiguousarray(s[f"{attr}.bias"].reshape(d, h).T)
        w["output/kernel"] = s["W_o.weight"].reshape(h, d, -1)
        w["output/bias"] = s["W_o.bias"]
        return kind, config, w
    shape_config = {k: v for k, v in config.items() if k not in _BEHAVIOUR}
    return kind, config, paddle_to_neutral(kind, s, shape_config)


def config_of(target: str, module: Any, arrays: dict) -> dict:
    return {k: v for k, v in _config(target, module).items() if k not in _BEHAVIOUR}


def write(target: str, module: Any, kind: str, config: dict, w: dict) -> None:
    if target == "paddle-doc":
        h, d = module.head_num, module.hidden_vec_size
        flat = {}
        for name, attr in _DOC_QKV:
            kernel = w[f"{name}/kernel"]
            flat[f"{attr}.weight"] = np.ascontiguousarray(
                kernel.transpose(0, 2, 1).reshape(kernel.shape[0], d * h)
            )
            flat[f"{attr}.bias"] = np.ascontiguousarray(w[f"{name}/bias"].T.reshape(d * h))
        flat["W_o.weight"] = np.ascontiguousarray(w["output/kernel"].reshape(h * d, -1))
        flat["W_o.bias"] = w["output/bias"]
    else:
        flat = neutral_to_paddle(kind, w, config)
    params = dict(module.named_parameters())
    if sorted(params) != sorted(flat):
        raise ValueError(
            f"{type(module).__name__}: parameters {sorted(params)} do not match the converted "
            f"names {sorted(flat)}."
        )
    for name, arr in flat.items():
        param = params[name]
        param.set_value(np.asarray(arr, dtype=param.numpy().dtype))


def build(target: str, kind: str, c: dict, options: dict) -> Any:
    dtype = options.pop("dtype", None)
    query_size = options.pop("query_size", None)
    if options:
        raise ValueError(f"convert(to={target!r}): unknown option(s) {sorted(options)}.")
    if target == "paddle-doc":
        doc = sys.modules["multiattn.backends.paddle"]
        if kind != "mha":
            raise ValueError(f"convert(to='paddle-doc'): the document has no {kind} layer.")
        what = "the PaddlePaddle document's MultiHeadAttention"
        refuse_settings("convert(to='paddle-doc')", what, kind, c)
        same = c["key_width"] == c["query_width"] == c["value_width"]
        if not same or c["value_dim"] != c["key_dim"] or not c["use_bias"]:
            raise ValueError(
                "convert(to='paddle-doc'): the document's MultiHeadAttention needs one input "
                f"width, value_dim = key_dim and biases; received {c}."
            )
        if query_size is None:
            raise ValueError(
                "convert(to='paddle-doc'): pass `query_size`, the document's fixed sequence "
                "length (it is not stored with the weights)."
            )
        module = doc.MultiHeadAttention(
            query_size, c["query_width"], c["key_dim"], c["output_width"], c["num_heads"]
        )
    elif kind == "mha":
        refuse_settings("convert(to='paddle')", "paddle.nn.MultiHeadAttention", kind, c)
        if c["key_dim"] * c["num_heads"] != c["query_width"] or c["value_dim"] != c["key_dim"]:
            raise ValueError(
                "convert(to='paddle'): paddle.nn.MultiHeadAttention needs key_dim = value_dim "
                f"= query width / num_heads; received {c}."
            )
        if c["output_width"] != c["query_width"]:
            raise ValueError(
                "convert(to='paddle'): paddle.nn.MultiHeadAttention's output width is the query "
                f"width; received output width {c['output_width']}."
            )
        module = paddle.nn.MultiHeadAttention(
            c["query_width"],
            c["num_heads"],
            dropout=c.get("dropout", 0.0),
            kdim=c["key_width"],
            vdim=c["value_width"],
            bias_attr=None if c["use_bias"] else False,
        )
    elif kind == "encoder":
        module = paddle.nn.TransformerEncoderLayer(
            c["d_model"],
            c["num_heads"],
            c["dff"],
            dropout=c.get("dropout", 0.1),
            activation=c.get("activation", "relu"),
            normalize_before=c.get("norm_first", False),
            layer_norm_eps=c.get("epsilon", 1e-5),
        )
    else:
        raise ValueError(f"convert(to='paddle'): paddle.nn has no {kind} module.")
    if dtype is not None:
        module.to(dtype=dtype)
    return module

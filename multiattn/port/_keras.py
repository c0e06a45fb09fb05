"""Keras-side handlers: `multiattn.layers`, ``keras.layers.MultiHeadAttention`` and
``GroupQueryAttention``, and the TensorFlow document adapter
(``multiattn.backends.tensorflow``).

Imported only when Keras is loaded; Keras layers run on the process's Keras backend.
``to="keras"`` builds ``keras.layers.MultiHeadAttention``, or ``GroupQueryAttention`` for
weights with grouped key/value heads (it needs ``value_dim = key_dim`` and the output width
equal to the query width). No Keras layer has rotary position embedding.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import keras
import numpy as np

from ..namespaces.keras import framework_of, get_ops
from .decoders import DECODER_KINDS, DEFAULTS
from .layout import (
    BEHAVIOUR_KEYS,
    DEFAULT_ROTARY_BASE,
    SETTING_KEYS,
    check_config,
    encoder_attention_config,
    refuse_settings,
)
from .names import infer_config

_QKV = ("query", "key", "value")


# multiattn's layers: the Keras ones and their Paddle twins (same attributes and names).
_MA_TARGETS = ("multiattn", "multiattn-paddle")


def _np(variable: Any) -> np.ndarray:
    if framework_of(variable) == "paddle":
        return np.array(variable.numpy())
    return np.array(keras.ops.convert_to_numpy(variable))


def _assign(variable: Any, arr: np.ndarray) -> None:
    if framework_of(variable) == "paddle":
        variable.set_value(np.asarray(arr, dtype=get_ops(variable).dtype_name(variable)))
        return
    variable.assign(np.asarray(arr, dtype=keras.backend.standardize_dtype(variable.dtype)))


def _ma(target: str = "multiattn"):
    name = "multiattn.paddle.layers" if target == "multiattn-paddle" else "multiattn.layers"
    return importlib.import_module(name)


def _tf_doc():
    return sys.modules.get("multiattn.backends.tensorflow")


def _classes(target: str) -> dict[type, str]:
    if target in _MA_TARGETS:
        m = _ma(target)
        return {
            m.MultiHeadAttention: "mha",
            m.GroupedQueryAttention: "mha",
            m.TransformerEncoderLayer: "encoder",
            m.AdditiveAttention: "additive",
            m.TransformerDecoderLayer: "decoder",
            m.TransformerDecoderOnlyLayer: "decoder_only",
        }
    if target == "keras":
        classes = {keras.layers.MultiHeadAttention: "mha"}
        gqa = _gqa_class()
        if gqa is not None:
            classes[gqa] = "mha"
        return classes
    doc = _tf_doc()
    return {} if doc is None else {doc.MultiHeadAttention: "mha", doc.EncoderLayer: "encoder"}


def _gqa_class() -> type | None:
    """``keras.layers.GroupQueryAttention`` (Keras 3.4 and later), or None."""
    return getattr(keras.layers, "GroupQueryAttention", None)


def _is_gqa(layer: Any) -> bool:
    gqa = _gqa_class()
    return gqa is not None and type(layer) is gqa


def owns(target: str, module: Any) -> bool:
    return any(type(module) is cls for cls in _classes(target))


def kind_of(target: str, module: Any) -> str:
    return _classes(target)[type(module)]


def _require_built(module: Any) -> None:
    if not module.built:
        raise ValueError(
            f"{type(module).__name__} {module.name!r} is not built: call it once or call "
            "build() before reading its weights."
        )


# --- reading ----------------------------------------------------------------------------


def _ma_settings(layer: Any) -> dict:
    """The settings (see `multiattn.port.layout.SETTING_KEYS`) of a multiattn layer."""
    out: dict = {}
    hkv = getattr(layer, "num_key_value_heads", None)
    if hkv is not None and hkv != layer.num_heads:
        out["num_key_value_heads"] = int(hkv)
    if getattr(layer, "rotary_max_length", None) is not None:
        out["rotary_max_length"] = int(layer.rotary_max_length)
        out["rotary_base"] = float(layer.rotary_base)
    return out


def _gqa_settings(layer: Any) -> dict:
    if layer.num_key_value_heads != layer.num_query_heads:
        return {"num_key_value_heads": int(layer.num_key_value_heads)}
    return {}


def settings(target: str, module: Any) -> dict:
    """The module's settings, without building or reading it."""
    if target in _MA_TARGETS and kind_of(target, module) == "mha":
        return _ma_settings(module)
    if target in _MA_TARGETS and kind_of(target, module) in DECODER_KINDS:
        kind = kind_of(target, module)
        config = _block_config(kind, module)
        return {k: config[k] for k in SETTING_KEYS[kind] if k in config}
    if target == "keras" and _is_gqa(module):
        return _gqa_settings(module)
    return {}


def _ma_mha(layer: Any) -> tuple[dict, dict]:
    extras = {
        "use_gate": layer.use_gate,
        "sliding_window": layer.sliding_window,
        "attention_axes": layer.attention_axes,
        "output_shape": layer._output_shape if layer.output_dim is None else None,
    }
    if any(v not in (None, False) for v in extras.values()):
        given = ", ".join(f"{k}={v!r}" for k, v in extras.items() if v not in (None, False))
        raise ValueError(
            f"multiattn.layers.{type(layer).__name__} with {given} has no neutral "
            "equivalent (the neutral layout holds query, key, value and output projections "
            "of (batch, sequence, features) inputs)."
        )
    w = {f"{n}/kernel": _np(getattr(layer, f"{n}_kernel")) for n in (*_QKV, "output")}
    if layer.use_bias:
        w.update({f"{n}/bias": _np(getattr(layer, f"{n}_bias")) for n in (*_QKV, "output")})
    config = {**infer_config("neutral", "mha", w), "dropout": layer.dropout}
    return w, {**config, **_ma_settings(layer)}


def _keras_mha(layer: Any) -> tuple[dict, dict]:
    gqa = _is_gqa(layer)
    if gqa and (layer.use_gate or layer.sliding_window is not None):
        raise ValueError(
            "keras.layers.GroupQueryAttention with use_gate=True or a sliding_window has no "
            f"neutral equivalent; received use_gate={layer.use_gate}, sliding_window="
            f"{layer.sliding_window}."
        )
    dense = {n: getattr(layer, f"_{n}_dense") for n in (*_QKV, "output")}
    w = {f"{n}/kernel": _np(d.kernel) for n, d in dense.items()}
    if layer.use_bias if gqa else layer._use_bias:
        w.update({f"{n}/bias": _np(d.bias) for n, d in dense.items()})
    dropout = float(layer.dropout if gqa else layer._dropout)
    return w, {**infer_config("neutral", "mha", w), "dropout": dropout}


def _doc_mha(layer: Any) -> tuple[dict, dict]:
    h, depth, dm = layer.num_heads, layer.depth, layer.d_model
    w = {}
    for n, d in (("query", layer.wq), ("key", layer.wk), ("value", layer.wv)):
        w[f"{n}/kernel"] = _np(d.kernel).reshape(-1, h, depth)
        w[f"{n}/bias"] = _np(d.bias).reshape(h, depth)
    w["output/kernel"] = _np(layer.dense.kernel).reshape(h, depth, dm)
    w["output/bias"] = _np(layer.dense.bias)
    return w, infer_config("neutral", "mha", w)


def _norms_ffn(ffn_1: Any, ffn_2: Any, norm_1: Any, norm_2: Any) -> dict:
    return {
        "ffn_1/kernel": _np(ffn_1.kernel),
        "ffn_1/bias": _np(ffn_1.bias),
        "ffn_2/kernel": _np(ffn_2.kernel),
        "ffn_2/bias": _np(ffn_2.bias),
        "norm_1/gamma": _np(norm_1.gamma),
        "norm_1/beta": _np(norm_1.beta),
        "norm_2/gamma": _np(norm_2.gamma),
        "norm_2/beta": _np(norm_2.beta),
    }


# --- the decoder blocks (multiattn's layers only): their own variable paths ----------


def _block_config(kind: str, module: Any) -> dict:
    """The neutral config of a decoder block, from its options (`multiattn.port.decoders`);
    an option of the block that the layout does not hold, set to other than its default,
    is refused by name."""
    if kind == "decoder_only":
        fields = module.config.to_dict()
        known = {"d_model", "num_heads", "dff", "rate", *DEFAULTS[kind]}
        for name in sorted(set(fields) - known):
            default = type(module.config).__dataclass_fields__[name].default
            if fields[name] != default:
                raise ValueError(
                    f"multiattn.port: {type(module).__name__} {module.name!r} has "
                    f"{name}={fields[name]!r}, an option the neutral layout does not hold "
                    "(see multiattn.port.decoders)."
                )
        config = {k: v for k, v in fields.items() if k in known}
    else:
        config = {k: getattr(module, k) for k in ("d_model", "num_heads", "dff", "rate",
                  "norm_first", "epsilon", "activation", "num_key_value_heads",
                  "rotary_max_length")}  # fmt: skip
        if module.built:
            config["context_width"] = int(module.cross_attention.key_kernel.shape[0])
    config["dropout"] = config.pop("rate")
    return check_config(kind, config)


def _block_names(module: Any) -> dict[str, Any]:
    """Neutral name -> variable of a decoder block (``attention_output`` is the layout's
    ``output``, as in the ``mha`` kind)."""
    out = {}
    for v in module.weights:
        name = v.path.split(module.name + "/", 1)[1]
        out[name.replace("/attention_output/", "/output/")] = v
    return out


def read(target: str, module: Any) -> tuple[str, dict, dict]:
    kind = kind_of(target, module)
    _require_built(module)
    if kind in DECODER_KINDS:
        weights = {name: _np(v) for name, v in _block_names(module).items()}
        return kind, _block_config(kind, module), weights
    if kind == "additive":
        w = {
            "query/kernel": _np(module.w_q),
            "key/kernel": _np(module.w_k),
            "score/kernel": _np(module.w_v),
        }
        return kind, {**infer_config("neutral", kind, w), "dropout": module.dropout}, w
    if kind == "mha":
        readers = {"multiattn": _ma_mha, "multiattn-paddle": _ma_mha, "keras": _keras_mha}
        w, config = readers.get(target, _doc_mha)(module)
        return kind, config, w
    if target in _MA_TARGETS:
        attn, _ = _ma_mha(module.attention)
        rest = _norms_ffn(module.ffn_1, module.ffn_2, module.norm_1, module.norm_2)
        extra = {
            "dropout": module.rate,
            "norm_first": module.norm_first,
            "epsilon": module.epsilon,
            "activation": module.activation,
        }
    else:
        attn, _ = _doc_mha(module.mha)
        ffn_1, ffn_2 = module.ffn.layers
        rest = _norms_ffn(ffn_1, ffn_2, module.layernorm1, module.layernorm2)
        extra = {
            "dropout": module.rate,
            "norm_first": False,
            "epsilon": float(module.layernorm1.epsilon),
            "activation": "relu",
        }
    w = {**{f"attention/{k}": v for k, v in attn.items()}, **rest}
    return kind, {**infer_config("neutral", kind, w), **extra}, w


# --- writing ----------------------------------------------------------------------------


def _build_from(module: Any, kind: str, config: dict) -> None:
    """Build an unbuilt layer with the shapes of ``config``."""
    if kind == "mha":
        c = config
        module.build((None, None, c["query_width"]), (None, None, c["value_width"]),
                     (None, None, c["key_width"]))  # fmt: skip
    elif kind == "encoder" or kind == "decoder_only":
        module.build((None, None, config["d_model"]))
    elif kind == "decoder":
        e = config["d_model"]
        module.build((None, None, e), (None, None, config.get("context_width", e)))
    else:
        q, k = config["query_width"], config["key_width"]
        module.build((None, None, q), (None, None, k), (None, None, k))


def config_of(target: str, module: Any, arrays: dict) -> dict:
    kind = kind_of(target, module)
    if kind in DECODER_KINDS:
        if not module.built:  # the block's options fix every shape but the context's
            width = arrays.get("cross_attention/key/kernel")
            extra = {} if width is None else {"context_width": int(np.shape(width)[0])}
            _build_from(module, kind, {**_block_config(kind, module), **extra})
        return _block_config(kind, module)
    if not module.built:
        if target == "tensorflow-doc" and kind == "mha":
            c = infer_config("neutral", "mha", arrays)
            module.build((None, None, c["value_width"]), (None, None, c["key_width"]),
                         (None, None, c["query_width"]))  # fmt: skip
        else:
            _build_from(module, kind, infer_config("neutral", kind, arrays))
    _, config, _ = read(target, module)
    return {k: v for k, v in config.items() if k not in BEHAVIOUR_KEYS}


def _write_ma_mha(layer: Any, w: dict) -> None:
    for name, arr in w.items():
        _assign(getattr(layer, name.replace("/", "_")), arr)


def _write_doc_mha(layer: Any, w: dict) -> None:
    dm = layer.d_model
    for n, d in (("query", layer.wq), ("key", layer.wk), ("value", layer.wv)):
        _assign(d.kernel, w[f"{n}/kernel"].reshape(-1, dm))
        _assign(d.bias, w[f"{n}/bias"].reshape(dm))
    _assign(layer.dense.kernel, w["output/kernel"].reshape(dm, dm))
    _assign(layer.dense.bias, w["output/bias"])


def _write_norms_ffn(w: dict, ffn_1: Any, ffn_2: Any, norm_1: Any, norm_2: Any) -> None:
    for prefix, layer in (("ffn_1", ffn_1), ("ffn_2", ffn_2)):
        _assign(layer.kernel, w[f"{prefix}/kernel"])
        _assign(layer.bias, w[f"{prefix}/bias"])
    for prefix, layer in (("norm_1", norm_1), ("norm_2", norm_2)):
        _assign(layer.gamma, w[f"{prefix}/gamma"])
        _assign(layer.beta, w[f"{prefix}/beta"])


def write(target: str, module: Any, kind: str, config: dict, w: dict) -> None:
    if kind in DECODER_KINDS:
        for name, variable in _block_names(module).items():
            _assign(variable, w[name])
        return
    if kind == "additive":
        for name, var in (("query", module.w_q), ("key", module.w_k), ("score", module.w_v)):
            _assign(var, w[f"{name}/kernel"])
        return
    if kind == "mha":
        if target in _MA_TARGETS:
            _write_ma_mha(module, w)
        elif target == "keras":
            for name, arr in w.items():
                part, var = name.split("/")
                _assign(getattr(getattr(module, f"_{part}_dense"), var), arr)
        else:
            _write_doc_mha(module, w)
        return
    attn = {k.removeprefix("attention/"): v for k, v in w.items() if k.startswith("attention/")}
    if target in _MA_TARGETS:
        _write_ma_mha(module.attention, attn)
        _write_norms_ffn(w, module.ffn_1, module.ffn_2, module.norm_1, module.norm_2)
    else:
        _write_doc_mha(module.mha, attn)
        ffn_1, ffn_2 = module.ffn.layers
        _write_norms_ffn(w, ffn_1, ffn_2, module.layernorm1, module.layernorm2)


# --- building ---------------------------------------------------------------------------


def _refuse(target: str, why: str) -> None:
    raise ValueError(f"convert(to={target!r}): {why}")


def _build_keras(kind: str, c: dict, dtype: Any) -> Any:
    target = "keras"
    if kind != "mha":
        _refuse(target, f"keras.layers has no {kind} layer; use to='multiattn'.")
    what = "keras.layers.MultiHeadAttention (and GroupQueryAttention)"
    refuse_settings(f"convert(to={target!r})", what, kind, c, grouped=True)
    if "num_key_value_heads" in c:
        gqa = _gqa_class()
        if gqa is None:
            refuse_settings(f"convert(to={target!r})", "this Keras version", kind, c)
        if c["value_dim"] != c["key_dim"] or c["output_width"] != c["query_width"]:
            _refuse(
                target,
                "keras.layers.GroupQueryAttention (the Keras layer with grouped key/value "
                "heads) needs value_dim = key_dim and the output width equal to the query "
                f"width; received num_key_value_heads={c['num_key_value_heads']}, key_dim="
                f"{c['key_dim']}, value_dim={c['value_dim']}, query width {c['query_width']}, "
                f"output width {c['output_width']}.",
            )
        layer = gqa(
            head_dim=c["key_dim"],
            num_query_heads=c["num_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            dropout=c.get("dropout", 0.0),
            use_bias=c["use_bias"],
            dtype=dtype,
        )
    else:
        layer = keras.layers.MultiHeadAttention(
            c["num_heads"],
            c["key_dim"],
            value_dim=c["value_dim"],
            dropout=c.get("dropout", 0.0),
            use_bias=c["use_bias"],
            output_shape=None if c["output_width"] == c["query_width"] else c["output_width"],
            dtype=dtype,
        )
    _build_from(layer, kind, c)
    return layer


def _build_block(m: Any, kind: str, c: dict, dtype: Any) -> Any:
    """A decoder block of `multiattn.layers` (or its Paddle twin ``m``) from its config."""
    options = {k: v for k, v in c.items() if k not in ("dropout", "context_width")}
    options["rate"] = c.get("dropout", DEFAULTS[kind]["dropout"][1])
    if kind == "decoder_only":
        return m.TransformerDecoderOnlyLayer(config=options, dtype=dtype)
    return m.TransformerDecoderLayer(**options, dtype=dtype)


def build(target: str, kind: str, config: dict, options: dict) -> Any:
    dtype = options.pop("dtype", None)
    if options:
        _refuse(target, f"unknown option(s) {sorted(options)}; {target} accepts `dtype`.")
    c = config
    if target in _MA_TARGETS:
        m = _ma(target)
        if kind == "mha":
            layer = m.MultiHeadAttention(
                c["num_heads"],
                c["key_dim"],
                value_dim=c["value_dim"],
                output_dim=None if c["output_width"] == c["query_width"] else c["output_width"],
                use_bias=c["use_bias"],
                dropout=c.get("dropout", 0.0),
                num_key_value_heads=c.get("num_key_value_heads"),
                rotary_max_length=c.get("rotary_max_length"),
                rotary_base=c.get("rotary_base", DEFAULT_ROTARY_BASE),
                dtype=dtype,
            )
        elif kind in DECODER_KINDS:
            layer = _build_block(m, kind, c, dtype)
        elif kind == "encoder":
            extra = {k: c[k] for k in ("norm_first", "epsilon", "activation") if k in c}
            layer = m.TransformerEncoderLayer(
                c["d_model"], c["num_heads"], c["dff"], rate=c.get("dropout", 0.1), dtype=dtype,
                **extra,
            )  # fmt: skip
        else:
            layer = m.AdditiveAttention(c["units"], dropout=c.get("dropout", 0.0), dtype=dtype)
        _build_from(layer, kind, c)
        return layer
    if target == "keras":
        return _build_keras(kind, c, dtype)
    doc = _tf_doc()
    if kind == "additive":
        _refuse(target, "the TensorFlow document has no additive attention.")
    refuse_settings(
        f"convert(to={target!r})", "the TensorFlow document's MultiHeadAttention", kind, c
    )
    mha = c if kind == "mha" else encoder_attention_config(c)
    h, d = mha["num_heads"], mha["key_dim"]
    if mha["value_dim"] != d or mha["output_width"] != h * d or not mha["use_bias"]:
        _refuse(
            target,
            "the document's MultiHeadAttention needs value_dim = key_dim, output width = "
            f"num_heads * key_dim and biases; received {c}.",
        )
    if kind == "mha":
        layer = doc.MultiHeadAttention(h * d, h, dtype=dtype)
        layer.build((None, None, c["value_width"]), (None, None, c["key_width"]),
                    (None, None, c["query_width"]))  # fmt: skip
        return layer
    if c.get("norm_first", False) or c.get("activation", "relu") != "relu":
        _refuse(target, f"the document's EncoderLayer is post-LayerNorm with relu; received {c}.")
    if not np.isclose(c.get("epsilon", 1e-6), 1e-6, rtol=0, atol=0):
        _refuse(target, f"the document's EncoderLayer has epsilon 1e-6; received {c['epsilon']}.")
    layer = doc.EncoderLayer(c["d_model"], h, c["dff"], rate=c.get("dropout", 0.1), dtype=dtype)
    layer.build((None, None, c["d_model"]))
    return layer

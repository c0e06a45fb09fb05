"""Declarative conformance cases and their float64 expectations.

A *variant* describes one way of calling an op (inputs, weights and parameters drawn from
a fixed seed). Every variant is expanded into one case per dtype, named
``<variant>_<f64|f32|f16|bf16>`` (e.g. ``sdpa_causal_cross_f32``). For each case the
inputs and weights are rounded to the case's dtype first, then the oracle
(`multiattn.reference`, float64) computes the expected outputs and, by central
differences, the gradients of ``sum(output * cotangent)`` with respect to every floating
input and weight.

Each op is one entry of `OPERATIONS`: its float64 oracle, the core function or layer the
core targets call, and the keep mask of its attention rows (from which
`multiattn.conformance.spec` computes the properties each variant exercises, e.g.
``empty_rows``; each variant's description is in ``spec.DESCRIPTIONS``). Adding an op is
one entry there, plus its ``_forward_<op>`` method in `target_core` for a core op.

Ops and what a target must return (see ``docs/conformance.md``):

* ``masked_softmax``: ``output``.
* ``dot_scores``, ``scaled_dot_scores``, ``additive_scores``, ``general_scores``: ``output``.
* ``sdpa``: ``output`` and the attention ``weights``. ``params["block_size"]`` (the
  ``sdpa_blockwise_*`` variants) asks a target that has a blockwise path to compute the
  output with blocks of that many queries and keys; the expectations are the same. The
  grouped-query cases (``sdpa_*gqa_*``, ``sdpa_mqa``) are rank 4 with the heads on axis
  -3 and fewer key/value heads than query heads: query head ``h`` attends key/value head
  ``h // (H / H_kv)``. In the ``sdpa_*poisoned_*`` cases the keys and values that no
  query may attend hold NaN, ``inf`` or ``1e30``: the expectations are those of any other
  values there (their gradients are 0).
* ``mha``: ``output``, ``weights``; flat projection weights ``W_q (E_q, H*D)`` ...
  ``W_o (H*Dv, E_out)`` with biases, heads split by ``params["head_layout"]`` and merged
  contiguously (the PaddlePaddle document's interleaved split uses ``"interleaved"``).
* ``positional``: ``output = x + P[:T]``.
* ``encoder``: ``output`` of a Transformer encoder layer.
* ``rope``: ``output`` = the rotary position embedding of ``x`` ``(B, T, H, D)``, the
  first token at position ``params["offset"]``.
* ``mha_decode``: ``output`` of causal multi-head self-attention (grouped-query with
  ``params["num_key_value_heads"]``, RoPE with ``params["rotary_max_length"]``); the
  expectation is one causal pass over the whole sequence, the target decodes token by token
  through the key/value cache.
* ``decoder``, ``decoder_decode``: ``output`` of a Transformer decoder layer over
  ``context`` (with ``context_valid_lens``); ``decoder`` in one pass, ``decoder_decode``
  token by token through the cache with the cross-attention keys/values projected once.
* ``rms_norm``: ``output`` = RMSNorm of ``x`` over its last axis, ``x / sqrt(mean(x**2) +
  params["epsilon"]) * scale``, with the weight ``scale`` ``(d,)`` when the case has one
  (none: a gain of ones).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from multiattn import reference as ref

from . import spec

DTYPE_SUFFIX = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
ALL_DTYPES = tuple(DTYPE_SUFFIX)

# Max relative error (max |got - want| / max |want|) per dtype: outputs and gradients.
OP_TOL = {
    "float64": {"output": 1e-10, "grad": 1e-7},
    "float32": {"output": 1e-6, "grad": 1e-5},
    "float16": {"output": 2e-3, "grad": 2e-2},
    "bfloat16": {"output": 1.6e-2, "grad": 1e-1},
}
LAYER_TOL = {
    "float64": {"output": 1e-10, "grad": 1e-7},
    "float32": {"output": 5e-6, "grad": 2e-5},
    "float16": {"output": 1e-2, "grad": 5e-2},
    "bfloat16": {"output": 6e-2, "grad": 2.5e-1},
}


@dataclass(frozen=True)
class Variant:
    name: str
    family: str
    op: str
    build: Callable[[np.random.Generator], tuple[dict, dict, dict]]
    dtypes: tuple[str, ...] = ALL_DTYPES
    tolerance: dict = field(default_factory=lambda: OP_TOL)
    grads: bool = True


def _normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return rng.standard_normal(shape) * scale


# --- oracle per op ---------------------------------------------------------------------


def _mha_kernels(weights: dict, params: dict) -> dict:
    """Flat projection matrices -> the oracle's (E, H, D) kernels for the head layout."""
    h = params["num_heads"]
    hkv = params.get("num_key_value_heads") or h
    layout = params["head_layout"]

    def heads(w: np.ndarray, n: int) -> np.ndarray:
        e, width = w.shape
        d = width // n
        if layout == "contiguous":
            return w.reshape(e, n, d)
        return w.reshape(e, d, n).transpose(0, 2, 1)

    def bias(b: np.ndarray, n: int) -> np.ndarray:
        d = b.shape[0] // n
        return b.reshape(n, d) if layout == "contiguous" else b.reshape(d, n).T

    out = {
        "query_kernel": heads(weights["W_q"], h),
        "key_kernel": heads(weights["W_k"], hkv),
        "value_kernel": heads(weights["W_v"], hkv),
        "output_kernel": weights["W_o"].reshape(h, -1, weights["W_o"].shape[1]),
    }
    if "b_q" in weights:
        out.update(
            query_bias=bias(weights["b_q"], h),
            key_bias=bias(weights["b_k"], hkv),
            value_bias=bias(weights["b_v"], hkv),
            output_bias=weights["b_o"],
        )
    return out


ATTENTION_WEIGHTS = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")


def _decoder_weights(weights: dict, params: dict) -> dict:
    """Flat decoder weights (``self_W_q`` ..., ``ffn_w1`` ...) -> the oracle's dict."""
    mha = {**params, "head_layout": "contiguous"}
    out = {
        f"{role}_attention": _mha_kernels(
            {n: weights[f"{role}_{n}"] for n in ATTENTION_WEIGHTS}, mha
        )
        for role in ("self", "cross")
    }
    for name in ("ffn_w1", "ffn_b1", "ffn_w2", "ffn_b2"):
        out[name] = weights[name]
    for i in (1, 2, 3):
        out[f"norm{i}_gamma"] = weights[f"norm{i}_gamma"]
        out[f"norm{i}_beta"] = weights[f"norm{i}_beta"]
    return out


def _masks(inputs: dict) -> dict:
    return {k: inputs[k] for k in ("valid_lens", "mask") if k in inputs}


def repeat_kv_heads(query: np.ndarray, x: np.ndarray) -> np.ndarray:
    """A key or value ``x`` with fewer heads (axis -3) than ``query``, each head repeated
    for its group of query heads (query head ``h`` attends head ``h // (H / H_kv)``)."""
    if x.ndim < 3 or x.shape[-3] == query.shape[-3]:
        return x
    return np.repeat(x, query.shape[-3] // x.shape[-3], axis=-3)


def _oracle_masked_softmax(inputs: dict, weights: dict, params: dict) -> dict:
    return {"output": ref.masked_softmax(inputs["x"], **_masks(inputs))}


def _oracle_dot_scores(inputs: dict, weights: dict, params: dict) -> dict:
    return {"output": ref.dot_scores(inputs["query"], inputs["key"])}


def _oracle_scaled_dot_scores(inputs: dict, weights: dict, params: dict) -> dict:
    return {"output": ref.scaled_dot_scores(inputs["query"], inputs["key"], params.get("scale"))}


def _oracle_additive_scores(inputs: dict, weights: dict, params: dict) -> dict:
    q, k = inputs["query"], inputs["key"]
    return {"output": ref.additive_scores(q, k, weights["w_q"], weights["w_k"], weights["w_v"])}


def _oracle_general_scores(inputs: dict, weights: dict, params: dict) -> dict:
    return {"output": ref.general_scores(inputs["query"], inputs["key"], weights["w"])}


def _oracle_sdpa(inputs: dict, weights: dict, params: dict) -> dict:
    query = inputs["query"]
    # an infinite key no query may attend gives inf - inf in its scores, which the
    # oracle selects away: no warning for it
    with np.errstate(invalid="ignore"):
        out, w = ref.scaled_dot_product_attention(
            query,
            repeat_kv_heads(query, inputs["key"]),
            repeat_kv_heads(query, inputs["value"]),
            causal=params.get("causal", False),
            scale=params.get("scale"),
            **_masks(inputs),
        )
    return {"output": out, "weights": w}


def _rotary_base(params: dict) -> float | None:
    return params.get("rotary_base") if params.get("rotary_max_length") else None


def _oracle_mha(inputs: dict, weights: dict, params: dict) -> dict:
    value = inputs["query"] if params.get("self") else inputs["value"]
    key = value if params.get("self") else inputs.get("key")
    out, w = ref.multi_head_attention(
        inputs["query"],
        value,
        key,
        weights=_mha_kernels(weights, params),
        causal=params.get("causal", False),
        rotary_base=_rotary_base(params),
        **_masks(inputs),
    )
    return {"output": out, "weights": w}


def _oracle_rope(inputs: dict, weights: dict, params: dict) -> dict:
    x = inputs["x"].transpose(0, 2, 1, 3)  # (B, H, T, D)
    positions = params["offset"] + np.arange(x.shape[2])
    out = ref.rotary_embedding(x, positions, params["base"])
    return {"output": out.transpose(0, 2, 1, 3)}


def _oracle_mha_decode(inputs: dict, weights: dict, params: dict) -> dict:
    out, _ = ref.multi_head_attention(
        inputs["query"],
        inputs["query"],
        weights=_mha_kernels(weights, params),
        causal=True,
        rotary_base=_rotary_base(params),
    )
    return {"output": out}


def _oracle_decoder(inputs: dict, weights: dict, params: dict) -> dict:
    out = ref.transformer_decoder_layer(
        inputs["x"],
        inputs["context"],
        weights=_decoder_weights(weights, params),
        norm_first=params["norm_first"],
        epsilon=params["epsilon"],
        activation=params["activation"],
        context_valid_lens=inputs.get("context_valid_lens"),
        rotary_base=_rotary_base(params),
    )
    return {"output": out}


def _oracle_positional(inputs: dict, weights: dict, params: dict) -> dict:
    x = inputs["x"]
    return {"output": x + ref.sinusoidal_encoding(x.shape[1], x.shape[2], layout=params["layout"])}


ENCODER_WEIGHTS = (
    *("ffn_w1", "ffn_b1", "ffn_w2", "ffn_b2"),
    *("norm1_gamma", "norm1_beta", "norm2_gamma", "norm2_beta"),
)


def _oracle_encoder(inputs: dict, weights: dict, params: dict) -> dict:
    attention = {n: weights[n] for n in ATTENTION_WEIGHTS}
    enc = {
        "attention": _mha_kernels(attention, {**params, "head_layout": "contiguous"}),
        **{n: weights[n] for n in ENCODER_WEIGHTS},
    }
    out = ref.transformer_encoder_layer(
        inputs["x"],
        weights=enc,
        num_heads=params["num_heads"],
        norm_first=params["norm_first"],
        epsilon=params["epsilon"],
        activation=params["activation"],
        **_masks(inputs),
    )
    return {"output": out}


def _oracle_rms_norm(inputs: dict, weights: dict, params: dict) -> dict:
    return {"output": ref.rms_norm(inputs["x"], weights.get("scale"), params["epsilon"])}


def oracle(op: str, inputs: dict, weights: dict, params: dict) -> dict[str, np.ndarray]:
    """Expected outputs of ``op`` in float64 (the oracle of its `OPERATIONS` entry)."""
    if op not in OPERATIONS:
        raise ValueError(f"unknown op {op!r}")
    return OPERATIONS[op].oracle(inputs, weights, params)


# --- the source documents' conventions ----------------------------------------------------
# The d2l-style PyTorch and the PaddlePaddle documents replace masked scores by -1e6; the
# TensorFlow document adds mask * -1e9 (mask 1 = masked out). Partially masked rows agree
# with the core; a fully masked row is uniform (in float32, where -1e9 swamps every score,
# the TensorFlow document's rows are uniform as well, and the adapter keeps that in float64).


def _replaced_attention(scores: np.ndarray, values: np.ndarray, keep: np.ndarray, fill: float):
    weights = ref.replaced_softmax(scores, np.broadcast_to(keep, scores.shape), fill)
    return weights @ values, weights


def _tf_heads(x: np.ndarray, w: np.ndarray, b: np.ndarray, h: int) -> np.ndarray:
    return ref.split_heads(x @ w + b, h, layout="contiguous")


def _tf_mha(q, k, v, weights: dict, prefix: str, h: int, mask: np.ndarray):
    keep = np.asarray(mask) == 0
    qh = _tf_heads(q, weights[f"{prefix}wq_kernel"], weights[f"{prefix}wq_bias"], h)
    kh = _tf_heads(k, weights[f"{prefix}wk_kernel"], weights[f"{prefix}wk_bias"], h)
    vh = _tf_heads(v, weights[f"{prefix}wv_kernel"], weights[f"{prefix}wv_bias"], h)
    out, w = _replaced_attention(ref.scaled_dot_scores(qh, kh), vh, keep, -1e9)
    merged = ref.merge_heads(out, layout="contiguous")
    return merged @ weights[f"{prefix}dense_kernel"] + weights[f"{prefix}dense_bias"], w


def _document_oracle(op: str, inputs: dict, weights: dict, params: dict) -> dict[str, np.ndarray]:
    if op == "doc_d2l_masked_softmax":
        x = inputs["x"]
        keep = ref.valid_lens_mask(inputs["valid_lens"], x.shape)
        return {"output": ref.replaced_softmax(x, np.broadcast_to(keep, x.shape), -1e6)}
    if op in ("doc_d2l_additive", "doc_d2l_dot"):
        q, k, v = inputs["queries"], inputs["keys"], inputs["values"]
        if op == "doc_d2l_additive":
            scores = ref.additive_scores(q, k, weights["W_q"], weights["W_k"], weights["w_v"])
        else:
            scores = ref.scaled_dot_scores(q, k)
        keep = ref.valid_lens_mask(inputs["valid_lens"], scores.shape)
        out, w = _replaced_attention(scores, v, keep, -1e6)
        return {"output": out, "weights": w}
    if op in ("doc_paddle_dot", "doc_paddle_mha"):
        x = {
            n: inputs[n] @ weights[f"W_{n[0]}"] + weights[f"b_{n[0]}"]
            for n in ("queries", "keys", "values")
        }
        h = params.get("head_num", 1)
        heads = {n: ref.split_heads(t, h, layout="interleaved") for n, t in x.items()}
        scores = ref.scaled_dot_scores(
            heads["queries"], heads["keys"], 1 / math.sqrt(params["hidden_vec_size"])
        )
        lens = np.minimum(inputs["valid_lens"], scores.shape[-1]).astype(np.int64)
        keep = ref.valid_lens_mask(lens, scores.shape)
        out, _ = _replaced_attention(scores, heads["values"], keep, -1e6)
        merged = ref.merge_heads(out, layout="contiguous")
        if op == "doc_paddle_dot":
            return {"output": merged}
        return {"output": merged @ weights["W_o"] + weights["b_o"]}
    if op == "doc_tf_sdpa":
        keep = np.asarray(inputs["mask"]) == 0
        out, w = _replaced_attention(
            ref.scaled_dot_scores(inputs["q"], inputs["k"]), inputs["v"], keep, -1e9
        )
        return {"output": out, "weights": w}
    if op == "doc_tf_mha":
        out, w = _tf_mha(
            inputs["q"], inputs["k"], inputs["v"], weights, "", params["num_heads"], inputs["mask"]
        )
        return {"output": out, "weights": w}
    if op == "doc_tf_encoder":
        x = inputs["x"]
        attn, _ = _tf_mha(x, x, x, weights, "mha_", params["num_heads"], inputs["mask"])
        h = ref.layer_norm(x + attn, weights["ln1_gamma"], weights["ln1_beta"], 1e-6)
        ffn = ref.feed_forward(
            h, weights["ffn_w1"], weights["ffn_b1"], weights["ffn_w2"], weights["ffn_b2"]
        )
        return {"output": ref.layer_norm(h + ffn, weights["ln2_gamma"], weights["ln2_beta"], 1e-6)}
    raise ValueError(f"unknown document op {op!r}")


# --- the operations: oracle, core function, attention rows ------------------------------------


def _no_rows(inputs: dict, params: dict) -> None:
    return None


def _rows(q: np.ndarray, tk: int, inputs: dict, params: dict, heads: int = 1, causal=None):
    """The keep mask of queries ``q`` (batch first, queries on axis -2) over ``tk`` keys."""
    return spec.keep_mask(
        q.shape[0],
        heads,
        q.shape[-2],
        tk,
        lens=inputs.get("valid_lens"),
        mask=inputs.get("mask"),
        causal=params.get("causal", False) if causal is None else causal,
    )


def _rows_softmax(inputs: dict, params: dict) -> np.ndarray:
    x = inputs["x"]
    return _rows(x, x.shape[-1], inputs, params)


def _rows_sdpa(inputs: dict, params: dict) -> np.ndarray:
    q = inputs["query"]
    return _rows(q, inputs["key"].shape[-2], inputs, params, q.shape[1] if q.ndim == 4 else 1)


def _rows_mha(inputs: dict, params: dict) -> np.ndarray:
    q = inputs["query"]
    return _rows(q, q.shape[1] if params.get("self") else inputs["value"].shape[1], inputs, params)


def _rows_self(inputs: dict, params: dict) -> np.ndarray:
    return _rows(inputs["x"], inputs["x"].shape[1], inputs, params)


def _rows_decode(inputs: dict, params: dict) -> np.ndarray:
    q = inputs["query"]
    return _rows(q, q.shape[1], {}, params, causal=True)


def _rows_decoder(inputs: dict, params: dict) -> np.ndarray:
    """The cross-attention rows (the causal self-attention has no empty row)."""
    x, context = inputs["x"], inputs["context"]
    return _rows(x, context.shape[1], {"valid_lens": inputs["context_valid_lens"]}, params)


def _rows_d2l(inputs: dict, params: dict) -> np.ndarray:
    if "x" in inputs:
        return _rows_softmax(inputs, params)
    return _rows(inputs["queries"], inputs["keys"].shape[1], inputs, params)


def _rows_tf(inputs: dict, params: dict) -> np.ndarray:
    """The TensorFlow document's mask says 1 = masked out."""
    q = inputs.get("q", inputs.get("x"))
    keep = {"mask": np.asarray(inputs["mask"]) == 0}
    heads = q.shape[1] if q.ndim == 4 else 1
    return _rows(q, inputs.get("k", q).shape[-2], keep, params, heads)


@dataclass(frozen=True)
class Operation:
    """One operation of the suite.

    * ``oracle(inputs, weights, params) -> {"output": ..., ...}`` in float64;
    * ``core``: the `multiattn` function (``ops.*``, which the Paddle namespace runs too) or
      layer (``layers.*``) the core targets call ("" for the documents' adapters);
    * ``rows(inputs, params)``: the keep mask ``(batch, heads, queries, keys)`` of its
      attention, from which `spec` finds empty rows (None: no attention rows);
    * ``declares``: properties every case of the op has that its inputs cannot show.
    """

    oracle: Callable[[dict, dict, dict], dict[str, np.ndarray]]
    core: str = ""
    rows: Callable[[dict, dict], np.ndarray | None] = _no_rows
    declares: tuple[str, ...] = ()


def _doc(op: str, rows: Callable = _no_rows) -> Operation:
    return Operation(partial(_document_oracle, op), rows=rows, declares=("document",))


OPERATIONS: dict[str, Operation] = {
    "masked_softmax": Operation(_oracle_masked_softmax, "ops.masked_softmax", _rows_softmax),
    "dot_scores": Operation(_oracle_dot_scores, "ops.dot_scores"),
    "scaled_dot_scores": Operation(_oracle_scaled_dot_scores, "ops.scaled_dot_scores"),
    "additive_scores": Operation(_oracle_additive_scores, "ops.additive_scores"),
    "general_scores": Operation(_oracle_general_scores, "ops.general_scores"),
    "sdpa": Operation(_oracle_sdpa, "ops.scaled_dot_product_attention", _rows_sdpa),
    "mha": Operation(_oracle_mha, "layers.MultiHeadAttention", _rows_mha),
    "positional": Operation(_oracle_positional, "layers.PositionalEncoding"),
    "encoder": Operation(_oracle_encoder, "layers.TransformerEncoderLayer", _rows_self),
    "rope": Operation(_oracle_rope, "ops.rotary_embedding"),
    "mha_decode": Operation(
        _oracle_mha_decode, "layers.MultiHeadAttention", _rows_decode, ("cache", "causal")
    ),
    "decoder": Operation(
        _oracle_decoder, "layers.TransformerDecoderLayer", _rows_decoder, ("causal",)
    ),
    "decoder_decode": Operation(
        _oracle_decoder, "layers.TransformerDecoderLayer", _rows_decoder, ("cache", "causal")
    ),
    "rms_norm": Operation(_oracle_rms_norm, "ops.rms_norm"),
    "doc_d2l_masked_softmax": _doc("doc_d2l_masked_softmax", _rows_d2l),
    "doc_d2l_additive": _doc("doc_d2l_additive", _rows_d2l),
    "doc_d2l_dot": _doc("doc_d2l_dot", _rows_d2l),
    "doc_paddle_dot": _doc("doc_paddle_dot", _rows_d2l),
    "doc_paddle_mha": _doc("doc_paddle_mha", _rows_d2l),
    "doc_tf_sdpa": _doc("doc_tf_sdpa", _rows_tf),
    "doc_tf_mha": _doc("doc_tf_mha", _rows_tf),
    "doc_tf_encoder": _doc("doc_tf_encoder", _rows_tf),
}


def core_ops(kind: str = "") -> set[str]:
    """The ops with a core function (``kind="ops."``: only the `multiattn.ops` functions)."""
    return {op for op, entry in OPERATIONS.items() if entry.core and entry.core.startswith(kind)}


# --- variants ----------------------------------------------------------------------------


def _softmax(kind: str):
    def build(rng):
        x = _normal(rng, 2, 3, 6, scale=2.0)
        inputs: dict[str, Any] = {"x": x}
        if kind == "lens_1d":
            inputs["valid_lens"] = np.array([2, 6], dtype=np.int32)
        elif kind == "lens_2d":
            inputs["valid_lens"] = np.array([[1, 4, 6], [3, 2, 5]], dtype=np.int32)
        elif kind == "zero_lens":
            inputs["valid_lens"] = np.array([[0, 4, 0], [6, 0, 2]], dtype=np.int32)
        elif kind == "mask":
            inputs["mask"] = rng.random((2, 3, 6)) > 0.4
            inputs["mask"][..., 0] = True
        elif kind == "all_masked_rows":
            mask = rng.random((2, 3, 6)) > 0.4
            mask[0, 1] = False
            mask[1, 2] = False
            inputs["mask"] = mask
            inputs["valid_lens"] = np.array([6, 5], dtype=np.int32)
        return inputs, {}, {}

    return build


def _scores(kind: str):
    def build(rng):
        q = _normal(rng, 2, 3, 4)
        k = _normal(rng, 2, 5, 4 if kind in ("dot", "scaled_dot", "custom_scale") else 6)
        weights, params = {}, {}
        if kind == "custom_scale":
            params["scale"] = 0.35
        if kind == "additive":
            weights = {
                "w_q": _normal(rng, 4, 7, scale=0.5),
                "w_k": _normal(rng, 6, 7, scale=0.5),
                "w_v": _normal(rng, 7),
            }
        if kind == "general":
            weights = {"w": _normal(rng, 4, 6, scale=0.5)}
        return {"query": q, "key": k}, weights, params

    return build


def _sdpa(variant: str):
    # "blockwise_<kind>": the case <kind> with params["block_size"], which forces the core's
    # blockwise (online-softmax) path with blocks of that many queries and keys.
    blockwise = variant.startswith("blockwise_")
    kind = variant.removeprefix("blockwise_")

    def build(rng):
        tq, tk, d, dv = 4, 4, 4, 4
        if kind in ("cross", "causal_cross", "mask", "lens_2d"):
            tk = 6
        if kind == "causal_more_queries":
            tq, tk = 6, 3
        if kind == "causal_one_query":  # one query, which sees every key
            tq, tk = 1, 5
        if kind == "value_dim":
            dv = 3
        if kind == "everything":
            tq, tk, dv = 5, 7, 3
        inputs: dict[str, Any] = {
            "query": _normal(rng, 2, tq, d),
            "key": _normal(rng, 2, tk, d),
            "value": _normal(rng, 2, tk, dv),
        }
        params: dict[str, Any] = {}
        if kind.startswith("causal"):
            params["causal"] = True
        if kind == "custom_scale":
            params["scale"] = 0.8
        if kind == "lens_1d":
            inputs["valid_lens"] = np.array([3, 0], dtype=np.int32)
        if kind == "lens_2d":
            inputs["valid_lens"] = np.array([[0, 2, 6, 1], [6, 6, 0, 3]], dtype=np.int32)
        if kind == "mask":
            mask = rng.random((2, tq, tk)) > 0.5
            mask[1, 3] = False
            inputs["mask"] = mask
        if kind == "everything":  # mask, per-query lengths and causal at once, custom scale
            mask = rng.random((2, tq, tk)) > 0.3
            mask[0, 2] = False
            inputs["mask"] = mask
            inputs["valid_lens"] = np.array([[7, 3, 7, 0, 5], [2, 7, 7, 6, 7]], dtype=np.int32)
            params.update(causal=True, scale=0.7)
        if blockwise:
            small = ("causal_more_queries", "lens_2d", "causal_one_query")
            params["block_size"] = 2 if kind in small else 3
        return inputs, {}, params

    return build


POISON = {"nan": np.nan, "inf": np.inf, "huge": 1e30}


def _sdpa_poisoned(variant: str):
    """``[blockwise_]poisoned_<nan|inf|huge>``: the keys and values of batch element 0 that
    no query may attend hold `POISON`. Query 0 has length 0; key 1 is hidden by the mask,
    keys 4 and 5 by the causal rule (query ``i`` sees keys ``j <= i + 2``) for the first
    queries and by their lengths for the last. Batch element 1 is clean (a layer that lets
    the poison through still has rows to compare there)."""
    blockwise = variant.startswith("blockwise_")
    poison = POISON[variant.removeprefix("blockwise_").removeprefix("poisoned_")]

    def build(rng):
        tq, tk, d = 4, 6, 4
        query, key, value = (_normal(rng, 2, t, d) for t in (tq, tk, tk))
        mask = rng.random((2, tq, tk)) > 0.3
        mask[:, :, 0] = True
        mask[0, :, 1] = False
        lens = np.array([[0, 6, 4, 4], [6, 3, 5, 6]], dtype=np.int32)
        keep = mask & ref.valid_lens_mask(lens, mask.shape) & ref.causal_mask(tq, tk)
        hidden = ~keep.any(axis=1)  # (batch, keys): keys no query may attend
        hidden[1] = False
        assert hidden[0, [1, 4, 5]].all()
        key[hidden], value[hidden] = poison, poison
        inputs = {"query": query, "key": key, "value": value, "valid_lens": lens, "mask": mask}
        params: dict[str, Any] = {"causal": True}
        if blockwise:
            params["block_size"] = 2  # keys 4 and 5 fill a block
        return inputs, {}, params

    return build


def _sdpa_grouped(variant: str):
    """``[blockwise_]gqa_causal_lens``: 4 query heads over 2 key/value heads, causal, with
    per-query lengths; ``mqa``: one key/value head, a mask per query head, more keys than
    queries. Rank 4, heads on axis -3."""
    blockwise = variant.startswith("blockwise_")
    kind = variant.removeprefix("blockwise_")

    def build(rng):
        hkv, tq, tk, d = (2, 4, 4, 2) if kind == "gqa_causal_lens" else (1, 3, 5, 2)
        inputs: dict[str, Any] = {
            "query": _normal(rng, 2, 4, tq, d),
            "key": _normal(rng, 2, hkv, tk, d),
            "value": _normal(rng, 2, hkv, tk, d),
        }
        params: dict[str, Any] = {}
        if kind == "gqa_causal_lens":
            params["causal"] = True
            inputs["valid_lens"] = np.array([[4, 2, 4, 3], [3, 1, 4, 2]], dtype=np.int32)
        else:
            mask = rng.random((2, 4, tq, tk)) > 0.4
            mask[..., 0] = True
            inputs["mask"] = mask
        if blockwise:
            params["block_size"] = 2
        return inputs, {}, params

    return build


def _mha(kind: str):
    def build(rng):
        b, tq, tk, h, d, dv = 2, 4, 5, 2, 3, 3
        eq = ek = ev = 6
        eo = 6
        params: dict[str, Any] = {"num_heads": h, "head_layout": "contiguous"}
        if kind == "interleaved":
            params["head_layout"] = "interleaved"
        if kind == "widths":
            eq, ek, ev, eo = 5, 4, 7, 3
        if kind == "value_dim":
            dv = 4
        inputs: dict[str, Any] = {
            "query": _normal(rng, b, tq, eq),
            "value": _normal(rng, b, tk, ev),
            "key": _normal(rng, b, tk, ek),
        }
        if kind == "self_causal":  # value = key = query: one input, gradients summed over roles
            tk = tq
            inputs = {"query": inputs["query"]}
            params.update(self=True, causal=True)
            ek = ev = eq
        inputs["valid_lens"] = np.array([tk, 2], dtype=np.int32)
        if kind == "masked_rows":
            inputs["valid_lens"] = np.array([[0, 3, tk, 1], [tk, 0, 2, 0]], dtype=np.int32)
        weights = {
            "W_q": _normal(rng, eq, h * d, scale=0.4),
            "W_k": _normal(rng, ek, h * d, scale=0.4),
            "W_v": _normal(rng, ev, h * dv, scale=0.4),
            "W_o": _normal(rng, h * dv, eo, scale=0.4),
        }
        if kind != "no_bias":
            weights.update(
                b_q=_normal(rng, h * d, scale=0.1),
                b_k=_normal(rng, h * d, scale=0.1),
                b_v=_normal(rng, h * dv, scale=0.1),
                b_o=_normal(rng, eo, scale=0.1),
            )
        params.update(key_dim=d, value_dim=dv, output_dim=eo)
        return inputs, weights, params

    return build


def _positional(layout: str):
    def build(rng):
        return {"x": _normal(rng, 2, 7, 6)}, {}, {"layout": layout, "max_length": 16}

    return build


def _encoder(norm_first: bool):
    def build(rng):
        dm, h, dff = 6, 2, 10
        weights = {
            "W_q": _normal(rng, dm, dm, scale=0.4),
            "W_k": _normal(rng, dm, dm, scale=0.4),
            "W_v": _normal(rng, dm, dm, scale=0.4),
            "W_o": _normal(rng, dm, dm, scale=0.4),
            "b_q": _normal(rng, dm, scale=0.1),
            "b_k": _normal(rng, dm, scale=0.1),
            "b_v": _normal(rng, dm, scale=0.1),
            "b_o": _normal(rng, dm, scale=0.1),
            "ffn_w1": _normal(rng, dm, dff, scale=0.4),
            "ffn_b1": _normal(rng, dff, scale=0.1),
            "ffn_w2": _normal(rng, dff, dm, scale=0.4),
            "ffn_b2": _normal(rng, dm, scale=0.1),
            "norm1_gamma": 1 + _normal(rng, dm, scale=0.1),
            "norm1_beta": _normal(rng, dm, scale=0.1),
            "norm2_gamma": 1 + _normal(rng, dm, scale=0.1),
            "norm2_beta": _normal(rng, dm, scale=0.1),
        }
        params = {
            "num_heads": h,
            "d_model": dm,
            "dff": dff,
            "norm_first": norm_first,
            "epsilon": 1e-6,
            "activation": "relu",
        }
        inputs = {"x": _normal(rng, 2, 5, dm), "valid_lens": np.array([5, 3], dtype=np.int32)}
        return inputs, weights, params

    return build


def _gqa(kind: str):
    """Grouped-query (2 key/value heads for 4 query heads) and multi-query attention."""

    def build(rng):
        b, tq, tk, h, d = 2, 4, 5, 4, 2
        hkv = 1 if kind.startswith("mqa") else 2
        e = 6
        params: dict[str, Any] = {
            "num_heads": h,
            "num_key_value_heads": hkv,
            "head_layout": "contiguous",
            "key_dim": d,
            "value_dim": d,
            "output_dim": e,
        }
        inputs: dict[str, Any] = {
            "query": _normal(rng, b, tq, e),
            "value": _normal(rng, b, tk, e),
            "key": _normal(rng, b, tk, e),
            "valid_lens": np.array([tk, 2], dtype=np.int32),
        }
        if kind.endswith("self_causal_rope"):
            inputs = {"query": inputs["query"]}
            params.update(self=True, causal=True, rotary_max_length=8, rotary_base=10000.0)
        weights = {
            "W_q": _normal(rng, e, h * d, scale=0.4),
            "W_k": _normal(rng, e, hkv * d, scale=0.4),
            "W_v": _normal(rng, e, hkv * d, scale=0.4),
            "W_o": _normal(rng, h * d, e, scale=0.4),
            "b_q": _normal(rng, h * d, scale=0.1),
            "b_k": _normal(rng, hkv * d, scale=0.1),
            "b_v": _normal(rng, hkv * d, scale=0.1),
            "b_o": _normal(rng, e, scale=0.1),
        }
        return inputs, weights, params

    return build


def _rope(offset: int):
    def build(rng):
        return {"x": _normal(rng, 2, 5, 3, 6)}, {}, {"offset": offset, "base": 10000.0}

    return build


def _mha_decode(kind: str):
    """Causal self-attention, decoded token by token through the cache by the target."""

    def build(rng):
        b, t, h, d, e = 2, 5, 4, 2, 6
        hkv = {"mha": 4, "gqa": 2, "mqa": 1}[kind.split("_")[0]]
        params: dict[str, Any] = {
            "num_heads": h,
            "num_key_value_heads": hkv,
            "head_layout": "contiguous",
            "key_dim": d,
            "value_dim": d,
            "output_dim": e,
            "max_length": 7,
        }
        if kind.endswith("rope"):
            params.update(rotary_max_length=8, rotary_base=10000.0)
        weights = {
            "W_q": _normal(rng, e, h * d, scale=0.4),
            "W_k": _normal(rng, e, hkv * d, scale=0.4),
            "W_v": _normal(rng, e, hkv * d, scale=0.4),
            "W_o": _normal(rng, h * d, e, scale=0.4),
            "b_q": _normal(rng, h * d, scale=0.1),
            "b_k": _normal(rng, hkv * d, scale=0.1),
            "b_v": _normal(rng, hkv * d, scale=0.1),
            "b_o": _normal(rng, e, scale=0.1),
        }
        return {"query": _normal(rng, b, t, e)}, weights, params

    return build


def _decoder(norm_first: bool, kv_heads: int, rotary: bool):
    def build(rng):
        dm, h, dff, s_len = 8, 4, 10, 6
        weights = {}
        for role in ("self", "cross"):
            kv = dm // h * kv_heads
            for name, shape in (
                ("W_q", (dm, dm)),
                ("W_k", (dm, kv)),
                ("W_v", (dm, kv)),
                ("W_o", (dm, dm)),
            ):
                weights[f"{role}_{name}"] = _normal(rng, *shape, scale=0.4)
            for name, size in (("b_q", dm), ("b_k", kv), ("b_v", kv), ("b_o", dm)):
                weights[f"{role}_{name}"] = _normal(rng, size, scale=0.1)
        weights.update(
            ffn_w1=_normal(rng, dm, dff, scale=0.4),
            ffn_b1=_normal(rng, dff, scale=0.1),
            ffn_w2=_normal(rng, dff, dm, scale=0.4),
            ffn_b2=_normal(rng, dm, scale=0.1),
        )
        for i in (1, 2, 3):
            weights[f"norm{i}_gamma"] = 1 + _normal(rng, dm, scale=0.1)
            weights[f"norm{i}_beta"] = _normal(rng, dm, scale=0.1)
        params: dict[str, Any] = {
            "num_heads": h,
            "num_key_value_heads": kv_heads,
            "d_model": dm,
            "dff": dff,
            "norm_first": norm_first,
            "epsilon": 1e-6,
            "activation": "relu",
            "max_length": 6,
        }
        if rotary:
            params.update(rotary_max_length=8, rotary_base=10000.0)
        inputs = {
            "x": _normal(rng, 2, 4, dm),
            "context": _normal(rng, 2, s_len, dm),
            "context_valid_lens": np.array([s_len, 3], dtype=np.int32),
        }
        return inputs, weights, params

    return build


def _rms_norm(kind: str):
    """RMSNorm of rows of non-zero mean (where it differs from layer norm); ``zero_rows``
    adds rows of zeros (output 0, gradient 1/sqrt(epsilon) times the scale)."""

    def build(rng):
        x = _normal(rng, 2, 5, 8, scale=2.0) + 0.5
        weights = {} if kind == "no_scale" else {"scale": 1 + _normal(rng, 8, scale=0.3)}
        epsilon = 1e-6
        if kind == "zero_rows":
            x[0, 1] = 0.0
            x[1, 4] = 0.0
            epsilon = 1e-4  # keeps the central differences on those rows accurate
        return {"x": x}, weights, {"epsilon": epsilon}

    return build


def _d2l(kind: str):
    def build(rng):
        if kind.startswith("softmax"):
            lens = (
                np.array([2, 0]) if kind == "softmax_lens_1d" else np.array([[1, 0, 5], [5, 2, 0]])
            )
            return (
                {"x": _normal(rng, 2, 3, 5, scale=2.0), "valid_lens": lens.astype(np.int64)},
                {},
                {},
            )
        d = 4 if kind == "dot" else 6
        inputs = {
            "queries": _normal(rng, 2, 3, 4),
            "keys": _normal(rng, 2, 5, d),
            "values": _normal(rng, 2, 5, 3),
            "valid_lens": np.array(
                [2, 0] if kind == "additive" else [[1, 0, 5], [5, 2, 0]], dtype=np.int64
            ),
        }
        weights = {}
        if kind == "additive":
            weights = {
                "W_q": _normal(rng, 4, 7, scale=0.5),
                "W_k": _normal(rng, 6, 7, scale=0.5),
                "w_v": _normal(rng, 7),
            }
        return inputs, weights, {}

    return build


def _paddle_doc(kind: str):
    def build(rng):
        qs, e, hid = 4, 5, 3
        h = 2 if kind == "mha" else 1
        inputs = {n: _normal(rng, 2, qs, e) for n in ("queries", "keys", "values")}
        inputs["valid_lens"] = np.array([3.0, 0.0])  # float, as the document passes them
        weights = {}
        for n in "qkv":
            weights[f"W_{n}"] = _normal(rng, e, hid * h, scale=0.5)
            weights[f"b_{n}"] = _normal(rng, hid * h, scale=0.1)
        params = {"query_size": qs, "query_vec_size": e, "hidden_vec_size": hid}
        if kind == "mha":
            weights["W_o"] = _normal(rng, hid * h, 6, scale=0.5)
            weights["b_o"] = _normal(rng, 6, scale=0.1)
            params.update(output_vec_size=6, head_num=h)
        return inputs, weights, params

    return build


def _tf_doc(kind: str):
    def dense(rng, prefix, name, n_in, n_out):
        return {
            f"{prefix}{name}_kernel": _normal(rng, n_in, n_out, scale=0.4),
            f"{prefix}{name}_bias": _normal(rng, n_out, scale=0.1),
        }

    def build(rng):
        dm, h = 8, 2
        if kind == "sdpa":
            mask = np.zeros((2, 1, 3, 5))
            mask[0, 0, :, 3:] = 1.0  # padding
            mask[1, 0] = np.triu(np.ones((3, 5)), k=3)  # look-ahead
            mask[1, 0, 2] = 1.0  # a fully masked row: uniform in the document
            inputs = {
                "q": _normal(rng, 2, 2, 3, 4),
                "k": _normal(rng, 2, 2, 5, 4),
                "v": _normal(rng, 2, 2, 5, 3),
                "mask": mask,
            }
            return inputs, {}, {}
        weights = {}
        prefix = "mha_" if kind == "encoder" else ""
        for name in ("wq", "wk", "wv", "dense"):
            weights.update(dense(rng, prefix, name, dm, dm))
        if kind == "mha":
            mask = np.zeros((2, 1, 1, 5))
            mask[1, 0, 0, 2:] = 1.0
            inputs = {
                "q": _normal(rng, 2, 3, dm),
                "k": _normal(rng, 2, 5, dm),
                "v": _normal(rng, 2, 5, dm),
                "mask": mask,
            }
            return inputs, weights, {"d_model": dm, "num_heads": h}
        weights.update(
            {
                "ffn_w1": _normal(rng, dm, 16, scale=0.4),
                "ffn_b1": _normal(rng, 16, scale=0.1),
                "ffn_w2": _normal(rng, 16, dm, scale=0.4),
                "ffn_b2": _normal(rng, dm, scale=0.1),
            }
        )
        for i in (1, 2):
            weights[f"ln{i}_gamma"] = 1 + _normal(rng, dm, scale=0.1)
            weights[f"ln{i}_beta"] = _normal(rng, dm, scale=0.1)
        mask = np.zeros((2, 1, 1, 4))
        mask[1, 0, 0, 3:] = 1.0
        return (
            {"x": _normal(rng, 2, 4, dm), "mask": mask},
            weights,
            {"d_model": dm, "num_heads": h, "dff": 16},
        )

    return build


DOC_DTYPES = ("float64", "float32")
# masks and lengths select; they are never differentiated (the documents pass them as floats)
NOT_DIFFERENTIABLE = ("mask", "valid_lens", "context_valid_lens")

VARIANTS: list[Variant] = [
    *(
        Variant(f"masked_softmax_{k}", "masked_softmax", "masked_softmax", _softmax(k))
        for k in ("plain", "lens_1d", "lens_2d", "zero_lens", "mask", "all_masked_rows")
    ),
    Variant("scores_dot", "scores", "dot_scores", _scores("dot")),
    Variant("scores_scaled_dot", "scores", "scaled_dot_scores", _scores("scaled_dot")),
    Variant(
        "scores_scaled_dot_custom_scale", "scores", "scaled_dot_scores", _scores("custom_scale")
    ),
    Variant("scores_additive", "scores", "additive_scores", _scores("additive")),
    Variant("scores_general", "scores", "general_scores", _scores("general")),
    *(
        Variant(f"sdpa_{k}", "sdpa", "sdpa", _sdpa(k))
        for k in (
            "self",
            "cross",
            "causal_self",
            "causal_cross",
            "causal_more_queries",
            "custom_scale",
            "lens_1d",
            "lens_2d",
            "mask",
            "value_dim",
            # the blockwise path (params["block_size"] forces it)
            "blockwise_causal_cross",
            "blockwise_causal_more_queries",
            "blockwise_lens_1d",
            "blockwise_lens_2d",
            "blockwise_mask",
            "blockwise_everything",
            "causal_one_query",
            "blockwise_causal_one_query",
        )
    ),
    # masked keys and values holding NaN, inf or 1e30 (float16 cannot hold 1e30: it is inf)
    *(
        Variant(
            f"sdpa_{k}",
            "sdpa",
            "sdpa",
            _sdpa_poisoned(k),
            ALL_DTYPES if k.endswith(("nan", "inf")) else ("float64", "float32", "bfloat16"),
        )
        for k in (
            "poisoned_nan",
            "poisoned_inf",
            "poisoned_huge",
            "blockwise_poisoned_nan",
            "blockwise_poisoned_inf",
            "blockwise_poisoned_huge",
        )
    ),
    # grouped-query and multi-query attention through the public op
    *(
        Variant(f"sdpa_{k}", "sdpa", "sdpa", _sdpa_grouped(k))
        for k in ("gqa_causal_lens", "mqa", "blockwise_gqa_causal_lens")
    ),
    *(
        Variant(f"mha_{k}", "mha", "mha", _mha(k), tolerance=LAYER_TOL)
        for k in (
            "contiguous",
            "interleaved",
            "widths",
            "value_dim",
            "no_bias",
            "self_causal",
            "masked_rows",
        )
    ),
    Variant("positional_interleaved", "positional", "positional", _positional("interleaved")),
    Variant("positional_concatenated", "positional", "positional", _positional("concatenated")),
    Variant("encoder_post_ln", "encoder", "encoder", _encoder(False), tolerance=LAYER_TOL),
    Variant("encoder_pre_ln", "encoder", "encoder", _encoder(True), tolerance=LAYER_TOL),
    # grouped-query / multi-query attention, rotary position embedding
    *(
        Variant(f"mha_{k}", "mha", "mha", _gqa(k), tolerance=LAYER_TOL)
        for k in ("gqa_cross", "mqa_cross", "gqa_self_causal_rope", "mqa_self_causal_rope")
    ),
    Variant("rope_offset_0", "rope", "rope", _rope(0)),
    Variant("rope_offset_3", "rope", "rope", _rope(3)),
    # decoding through the key/value cache against one causal pass
    *(
        Variant(f"cache_{k}", "cache", "mha_decode", _mha_decode(k), tolerance=LAYER_TOL)
        for k in ("mha", "gqa", "mqa", "gqa_rope")
    ),
    *(
        Variant(
            f"decoder_{name}",
            "decoder",
            "decoder",
            _decoder(nf, kv, rot),
            DOC_DTYPES,
            LAYER_TOL,
        )
        for name, nf, kv, rot in (("post_ln", False, 4, False), ("pre_ln_gqa_rope", True, 2, True))
    ),
    *(
        Variant(
            f"cache_decoder_{name}",
            "cache",
            "decoder_decode",
            _decoder(nf, kv, rot),
            DOC_DTYPES,
            LAYER_TOL,
        )
        for name, nf, kv, rot in (
            ("post_ln", False, 4, False),
            ("pre_ln_gqa_rope", True, 2, True),
            ("post_ln_mqa", False, 1, False),
        )
    ),
    # RMS normalisation (multiattn.ops.rms_norm)
    *(
        Variant(f"rms_norm_{k}", "rms_norm", "rms_norm", _rms_norm(k))
        for k in ("scale", "no_scale", "zero_rows")
    ),
    # the source documents, through their adapters
    Variant(
        "doc_d2l_masked_softmax_lens_1d",
        "doc_d2l",
        "doc_d2l_masked_softmax",
        _d2l("softmax_lens_1d"),
        DOC_DTYPES,
    ),
    Variant(
        "doc_d2l_masked_softmax_lens_2d",
        "doc_d2l",
        "doc_d2l_masked_softmax",
        _d2l("softmax_lens_2d"),
        DOC_DTYPES,
    ),
    Variant("doc_d2l_additive", "doc_d2l", "doc_d2l_additive", _d2l("additive"), DOC_DTYPES),
    Variant("doc_d2l_dot", "doc_d2l", "doc_d2l_dot", _d2l("dot"), DOC_DTYPES),
    Variant("doc_paddle_dot", "doc_paddle", "doc_paddle_dot", _paddle_doc("dot"), DOC_DTYPES),
    Variant(
        "doc_paddle_mha_interleaved",
        "doc_paddle",
        "doc_paddle_mha",
        _paddle_doc("mha"),
        DOC_DTYPES,
        LAYER_TOL,
    ),
    Variant("doc_tf_sdpa", "doc_tf", "doc_tf_sdpa", _tf_doc("sdpa"), DOC_DTYPES),
    Variant("doc_tf_mha", "doc_tf", "doc_tf_mha", _tf_doc("mha"), DOC_DTYPES, LAYER_TOL),
    Variant(
        "doc_tf_encoder", "doc_tf", "doc_tf_encoder", _tf_doc("encoder"), DOC_DTYPES, LAYER_TOL
    ),
]


def seed_of(name: str) -> int:
    """A fixed seed per variant, independent of the variant's position in the list."""
    return int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little") % (2**31) + len(name)


def numeric_gradients(
    fn: Callable[[dict], float], arrays: dict[str, np.ndarray], eps: float = 1e-6
) -> dict[str, np.ndarray]:
    """Central differences of the float64 scalar ``fn`` with respect to each array."""
    grads = {}
    for name, arr in arrays.items():
        grad = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            saved = arr[idx]
            arr[idx] = saved + eps
            plus = fn(arrays)
            arr[idx] = saved - eps
            minus = fn(arrays)
            arr[idx] = saved
            grad[idx] = (plus - minus) / (2 * eps)
        grads[name] = grad
    return grads


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (bfloat16 through ml_dtypes), returned as float64."""
    if x.dtype.kind != "f":
        return x
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16).astype(np.float64)
    return x.astype(dtype).astype(np.float64)


def expand(variant: Variant) -> list[dict]:
    """The cases of one variant: rounded inputs, expected outputs and gradients per dtype."""
    inputs, weights, params = variant.build(np.random.default_rng(seed_of(variant.name)))
    cases = []
    for dtype in variant.dtypes:
        ins = {k: round_to(v, dtype) for k, v in inputs.items()}
        ws = {k: round_to(v, dtype) for k, v in weights.items()}
        expected = oracle(variant.op, ins, ws, params)
        cot_rng = np.random.default_rng(seed_of(variant.name) + 1)
        cotangent = cot_rng.standard_normal(expected["output"].shape)
        grads = {}
        if variant.grads:
            floats = {
                f"input/{k}": v.copy()
                for k, v in ins.items()
                if k not in NOT_DIFFERENTIABLE and v.dtype.kind == "f"
            }
            floats.update({f"weight/{k}": v.copy() for k, v in ws.items()})

            def loss(arrays: dict, ins=ins, ws=ws, cotangent=cotangent) -> float:
                i = {k: arrays.get(f"input/{k}", v) for k, v in ins.items()}
                w = {k: arrays.get(f"weight/{k}", v) for k, v in ws.items()}
                return float((oracle(variant.op, i, w, params)["output"] * cotangent).sum())

            grads = {f"grad/{k}": g for k, g in numeric_gradients(loss, floats).items()}
        cases.append(
            {
                "name": f"{variant.name}_{DTYPE_SUFFIX[dtype]}",
                "variant": variant.name,
                "family": variant.family,
                "op": variant.op,
                "dtype": dtype,
                "params": params,
                "tolerance": dict(variant.tolerance[dtype]),
                "arrays": {
                    **{f"input/{k}": v for k, v in ins.items()},
                    **{f"weight/{k}": v for k, v in ws.items()},
                    **{f"expected/{k}": v for k, v in expected.items()},
                    "cotangent": cotangent,
                    **grads,
                },
            }
        )
    return cases

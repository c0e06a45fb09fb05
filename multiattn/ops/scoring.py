"""Scoring functions: how much each query attends to each key, before the softmax.

All functions map queries ``(..., queries, d_q)`` and keys ``(..., keys, d_k)`` to scores
``(..., queries, keys)``; leading axes broadcast. Half-precision inputs are scored in
their own dtype (use `multiattn.ops.masked_softmax` to normalise in float32).
"""

from __future__ import annotations

import math
from typing import Any

from .._checks import (
    HALF_DTYPES,
    as_array,
    check_default_scale,
    check_float,
    check_rank,
    check_scale,
    fmt_shape,
    shape_of,
)
from ..namespaces.keras import get_ops

__all__ = ["additive_scores", "dot_scores", "general_scores", "scaled_dot_scores"]


def _query_key(where: str, query: Any, key: Any) -> tuple[Any, Any, Any, tuple, tuple]:
    ops = get_ops(query, key, names=("query", "key"), where=where)
    query, key = as_array(query), as_array(key)
    qdt = check_float(where, "query", query, ops)
    kdt = check_float(where, "key", key, ops)
    if qdt != kdt:
        raise TypeError(f"{where}: `query` and `key` must share a dtype; received {qdt} and {kdt}.")
    qs, ks = shape_of(query), shape_of(key)
    check_rank(where, "query", qs, 2)
    check_rank(where, "key", ks, 2)
    return ops, query, key, qs, ks


def _check_same_width(where: str, qs: tuple, ks: tuple) -> None:
    if qs[-1] is not None and ks[-1] is not None and qs[-1] != ks[-1]:
        raise ValueError(
            f"{where}: dot-product scores need `query` and `key` of the same width; received "
            f"query {fmt_shape(qs)} and key {fmt_shape(ks)}. Use general_scores or "
            "additive_scores for different widths."
        )


def dot_scores(query: Any, key: Any) -> Any:
    """Dot-product scores ``q . k``.

    Args:
        query: ``(..., queries, d)``.
        key: ``(..., keys, d)``.

    Returns:
        ``(..., queries, keys)`` in the inputs' dtype.
    """
    ops, query, key, qs, ks = _query_key("dot_scores", query, key)
    _check_same_width("dot_scores", qs, ks)
    return ops.einsum("...qd,...kd->...qk", query, key)


def scaled_dot_scores(query: Any, key: Any, scale: float | None = None) -> Any:
    """Scaled dot-product scores ``scale * q . k``, with ``scale = 1/sqrt(d)`` by default.

    Args:
        query: ``(..., queries, d)``.
        key: ``(..., keys, d)``.
        scale: positive float overriding ``1/sqrt(d)``.

    Returns:
        ``(..., queries, keys)`` in the inputs' dtype.
    """
    where = "scaled_dot_scores"
    ops, query, key, qs, ks = _query_key(where, query, key)
    _check_same_width(where, qs, ks)
    scale = check_scale(where, scale)
    check_default_scale(where, query, scale)
    if scale is None:
        if qs[-1] is None:
            raise ValueError(
                f"{where}: the query width must be static to derive the default scale; "
                f"received `query` of shape {fmt_shape(qs)}."
            )
        scale = 1.0 / math.sqrt(qs[-1])
    return ops.einsum("...qd,...kd->...qk", query * scale, key)  # scale the smaller operand


def _check_weight(where: str, name: str, w: Any, ops: Any, want: tuple, dtype: str) -> Any:
    w = as_array(w)
    ws = shape_of(w)
    if len(ws) != len(want) or any(
        a is not None and b is not None and a != b for a, b in zip(ws, want)
    ):
        raise ValueError(
            f"{where}: `{name}` must have shape {fmt_shape(want)}; received shape {fmt_shape(ws)}."
        )
    wdt = check_float(where, name, w, ops)
    if wdt != dtype:
        raise TypeError(f"{where}: `{name}` must have the inputs' dtype {dtype}; received {wdt}.")
    return w


def additive_scores(query: Any, key: Any, w_q: Any, w_k: Any, w_v: Any) -> Any:
    """Additive (Bahdanau) scores ``w_v . tanh(q W_q + k W_k)``.

    Query and key widths may differ.

    Args:
        query: ``(..., queries, d_q)``.
        key: ``(..., keys, d_k)``.
        w_q: ``(d_q, units)``.
        w_k: ``(d_k, units)``.
        w_v: ``(units,)``.

    Returns:
        ``(..., queries, keys)``. Memory grows as ``queries * keys * units``.
    """
    where = "additive_scores"
    ops, query, key, qs, ks = _query_key(where, query, key)
    dtype = ops.dtype_name(query)
    w_q = as_array(w_q)
    units = shape_of(w_q)[-1] if len(shape_of(w_q)) == 2 else None
    w_q = _check_weight(where, "w_q", w_q, ops, (qs[-1], units), dtype)
    w_k = _check_weight(where, "w_k", w_k, ops, (ks[-1], units), dtype)
    w_v = _check_weight(where, "w_v", w_v, ops, (units,), dtype)
    if dtype in HALF_DTYPES:  # the tanh features are accumulated in float32
        query, key, w_q, w_k, w_v = (ops.cast(t, "float32") for t in (query, key, w_q, w_k, w_v))
    q_features = ops.expand_dims(ops.einsum("...qd,du->...qu", query, w_q), -2)
    k_features = ops.expand_dims(ops.einsum("...kd,du->...ku", key, w_k), -3)
    scores = ops.einsum("...qku,u->...qk", ops.tanh(q_features + k_features), w_v)
    return ops.cast(scores, dtype) if dtype in HALF_DTYPES else scores


def general_scores(query: Any, key: Any, w: Any) -> Any:
    """General (Luong, bilinear) scores ``q W k``.

    Args:
        query: ``(..., queries, d_q)``.
        key: ``(..., keys, d_k)``.
        w: ``(d_q, d_k)``.

    Returns:
        ``(..., queries, keys)``.
    """
    where = "general_scores"
    ops, query, key, qs, ks = _query_key(where, query, key)
    w = _check_weight(where, "w", w, ops, (qs[-1], ks[-1]), ops.dtype_name(query))
    return ops.einsum("...qd,...kd->...qk", ops.einsum("...qe,ed->...qd", query, w), key)

"""Masks and the masked softmax.

Polarity everywhere in multiattn: ``True`` (or a non-zero integer) means *may attend*.
Masks combine with AND. A row in which nothing may be attended ("fully masked") gets
all-zero weights, in every dtype, in the forward pass and in gradients.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._checks import (
    HALF_DTYPES,
    as_array,
    broadcast_shape,
    check_float,
    check_rank,
    fmt_shape,
    shape_of,
    to_tensor,
)
from .._checks import concrete as _concrete
from .._namespace import get_ops

__all__ = ["causal_mask", "combine_masks", "masked_softmax", "valid_lens_to_mask"]

_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def causal_mask(query_len: int, key_len: int | None = None) -> Any:
    """Boolean causal mask of shape ``(query_len, key_len)``, True = may attend.

    Aligned bottom-right: query ``i`` may attend key ``j`` iff
    ``j <= i + (key_len - query_len)``. With equal lengths this is the usual lower
    triangle; with fewer queries than keys (decoding with a cache) the last query sees
    every key. With more queries than keys, the first ``query_len - key_len`` rows are
    fully masked (they give zero weights).

    Args:
        query_len: number of queries (positive int).
        key_len: number of keys; defaults to ``query_len``.
    """
    key_len = query_len if key_len is None else key_len
    for name, value in (("query_len", query_len), ("key_len", key_len)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(
                f"causal_mask: `{name}` must be a positive integer; received {value!r}."
            )
    return _causal_keep(get_ops(), query_len, key_len)


def _causal_keep(ops: Any, query_len: int, key_len: int) -> Any:
    rows = ops.expand_dims(ops.arange(query_len, dtype="int32"), 1)
    cols = ops.expand_dims(ops.arange(key_len, dtype="int32"), 0)
    return ops.less_equal(cols, rows + (key_len - query_len))


def valid_lens_to_mask(
    valid_lens: Any, scores_shape: tuple[int | None, ...], *, where: str = "valid_lens_to_mask"
) -> Any:
    """Boolean mask (True = may attend) from valid lengths.

    Args:
        valid_lens: integer (or integral float) lengths, shape ``(batch,)``: one length per
            batch row, repeated over every query; or ``(batch, queries)``: one per query.
            Keys at positions ``>= length`` are masked out. Values must lie in
            ``[0, keys]``; this is checked whenever the values are concrete (not under a
            jit trace or a TensorFlow graph), where out-of-range values act as if clipped.
        scores_shape: shape of the scores ``(batch, ..., queries, keys)``; axes between
            batch and queries (heads) broadcast.

    Returns:
        A bool tensor of shape ``(batch, 1, ..., 1, keys)`` or ``(batch, 1, ..., queries, keys)``
        that broadcasts to ``scores_shape``.
    """
    _check_scores_shape(where, scores_shape)
    return _valid_lens_keep(get_ops(valid_lens), valid_lens, scores_shape, where)


def _check_scores_shape(where: str, scores_shape: Any) -> None:
    """``scores_shape``: a tuple or list of sizes, each a non-negative int, None (unknown)
    or a scalar tensor (a size known only when a traced function runs)."""

    def bad(d: Any) -> bool:
        if isinstance(d, (bool, float, str, bytes, complex)):
            return True
        return isinstance(d, (int, np.integer)) and d < 0

    if not isinstance(scores_shape, (tuple, list)) or any(bad(d) for d in scores_shape):
        raise ValueError(
            f"{where}: `scores_shape` must be a tuple of non-negative ints (None or a scalar "
            f"tensor for a size unknown until the call runs); received {scores_shape!r}."
        )


def check_valid_lens(
    ops: Any, valid_lens: Any, scores_shape: tuple, where: str, name: str = "valid_lens"
) -> Any:
    """The checks of `valid_lens_to_mask` (shape against the scores, integer dtype, and,
    when the values are concrete, whole numbers in ``[0, keys]``); returns the lengths as
    int32, shaped as received. Errors name the argument ``name``."""
    valid_lens = as_array(valid_lens)
    vshape = shape_of(valid_lens)
    ndim = len(scores_shape)
    if len(vshape) not in (1, 2):
        raise ValueError(
            f"{where}: `{name}` must have shape (batch,) or (batch, queries); "
            f"received shape {fmt_shape(vshape)}."
        )
    min_rank = 2 if len(vshape) == 1 else 3
    if ndim < min_rank:
        raise ValueError(
            f"{where}: `{name}` of shape {fmt_shape(vshape)} needs scores of rank >= "
            f"{min_rank}; received scores of shape {fmt_shape(scores_shape)}."
        )
    expected = (scores_shape[0],) if len(vshape) == 1 else (scores_shape[0], scores_shape[-2])
    if any(v is not None and e is not None and v != e for v, e in zip(vshape, expected)):
        raise ValueError(
            f"{where}: `{name}` must have shape {fmt_shape(expected)} "
            f"(batch{'' if len(vshape) == 1 else ', queries'}) for scores of shape "
            f"{fmt_shape(scores_shape)}; received shape {fmt_shape(vshape)}."
        )
    if len(vshape) == 2 and vshape[1] is None:
        raise ValueError(f"{where}: the query axis of `{name}` must have a static size.")
    dtype = ops.dtype_name(valid_lens)
    if dtype == "bool" or (dtype not in _INT_DTYPES and "float" not in dtype):
        raise TypeError(f"{where}: `{name}` must hold integer lengths; received dtype {dtype}.")
    num_keys = scores_shape[-1]
    values = _concrete(ops, valid_lens)
    if values is not None and values.size:
        bad = values[(values < 0) | (values != np.floor(values))]
        if bad.size:
            raise ValueError(
                f"{where}: `{name}` must hold non-negative whole numbers; received {bad.ravel()[0]!r}."
            )
        if num_keys is not None and values.max() > num_keys:
            raise ValueError(
                f"{where}: `{name}` may not exceed the number of keys ({num_keys}); "
                f"received {values.max()!r}."
            )
    return ops.cast(valid_lens, "int32")


def _valid_lens_keep(ops: Any, valid_lens: Any, scores_shape: tuple, where: str) -> Any:
    lens = check_valid_lens(ops, valid_lens, scores_shape, where)
    vshape, ndim, num_keys = shape_of(lens), len(scores_shape), scores_shape[-1]
    if len(vshape) == 1:
        lens = ops.reshape(lens, (-1,) + (1,) * (ndim - 1))
    else:
        lens = ops.reshape(lens, (-1,) + (1,) * (ndim - 3) + (vshape[1], 1))
    positions = ops.arange(num_keys, dtype="int32")
    return ops.less(positions, lens)


def _mask_to_bool(ops: Any, where: str, name: str, mask: Any) -> Any:
    dtype = ops.dtype_name(mask)
    if dtype == "bool":
        return mask
    if dtype in _INT_DTYPES:
        return ops.not_equal(mask, 0)
    raise TypeError(
        f"{where}: `{name}` must be boolean (True = may attend) or integer (non-zero = may "
        f"attend); received dtype {dtype}. Additive float masks are not accepted: convert "
        "them to boolean first."
    )


def combine_masks(
    scores_shape: tuple[int | None, ...],
    *,
    mask: Any = None,
    valid_lens: Any = None,
    causal: bool = False,
    where: str = "combine_masks",
) -> Any:
    """AND of a boolean mask, valid lengths and a causal mask for scores of ``scores_shape``.

    Args:
        scores_shape: ``(batch, ..., queries, keys)``.
        mask: bool/int, True = may attend, broadcastable to ``scores_shape``.
        valid_lens: see `valid_lens_to_mask`.
        causal: add `causal_mask` (bottom-right aligned).

    Returns:
        A bool tensor broadcastable to ``scores_shape``, or ``None`` when nothing is masked.
    """
    return combine_keep(
        get_ops(mask, valid_lens),
        scores_shape,
        mask=mask,
        valid_lens=valid_lens,
        causal=causal,
        where=where,
    )


def combine_keep(
    ops: Any,
    scores_shape: tuple[int | None, ...],
    *,
    mask: Any = None,
    valid_lens: Any = None,
    causal: bool = False,
    where: str,
) -> Any:
    """`combine_masks` in the namespace ``ops`` of the tensors being attended (internal)."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{where}: `causal` must be a bool; received {causal!r}.")
    keep = None
    if mask is not None:
        mask = as_array(mask)
        broadcast_shape(where, "mask", shape_of(mask), scores_shape)
        keep = _mask_to_bool(ops, where, "mask", mask)
    if valid_lens is not None:
        lens_keep = _valid_lens_keep(ops, valid_lens, scores_shape, where)
        keep = lens_keep if keep is None else ops.logical_and(keep, lens_keep)
    if causal:
        q, k = scores_shape[-2], scores_shape[-1]
        if q is None or k is None:
            raise ValueError(
                f"{where}: `causal=True` needs static query and key lengths; received scores "
                f"of shape {fmt_shape(scores_shape)}."
            )
        tri = _causal_keep(ops, q, k)
        keep = tri if keep is None else ops.logical_and(keep, tri)
    return keep


#: What masked scores are replaced with before the backend's softmax on the attention's
#: explicit path: the lowest finite float32, exact in float32 and float64 (the dtypes the
#: softmax runs in). Its exponent underflows to 0 next to any kept score.
MASKED_SCORE = -3.4028234663852886e38


def softmax_where(ops: Any, x: Any, keep: Any, *, zero_empty_rows: bool = True) -> Any:
    """Softmax over the last axis restricted to ``keep`` (bool or None, True = may attend).

    Half precision is computed in float32 and cast back. Without a mask (``keep`` None)
    this is the backend's softmax, except for rows of a single score (computed as below:
    weight exactly 1).

    With a mask and ``zero_empty_rows`` (the default; `masked_softmax`, `score_attention`
    and the weights `scaled_dot_product_attention` returns) the softmax is computed here,
    not by the backend: masked scores are replaced by ``-inf`` (a select), then ``e = exp(x - m)``
    with ``m`` the row's largest kept score (0 when that is not finite; held constant for
    differentiation) and ``weights = e / sum(e)`` (``e / 1`` for a row whose sum is 0).
    Hence, on every backend and CPU, whatever the accuracy of its ``exp``:

    * masked weights are exactly 0 (``exp(-inf)``), whatever the masked scores hold
      (NaN, ``inf``), and get exactly zero gradient (the select);
    * a row with a single kept finite score (the others masked or ``-inf``) has weight
      exactly 1 there (``e / e``); a row with nothing kept is all zeros;
    * a kept ``-inf`` score gets weight 0; a kept NaN makes its row NaN.

    ``zero_empty_rows=False`` (the explicit attention path, whose caller zeroes the
    outputs of rows with nothing to keep) takes the backend's fused softmax, which is
    faster, on the scores with masked entries replaced by `MASKED_SCORE`: masked weights
    are still exactly 0 (their exponentials underflow; on a namespace whose softmax floors
    small exponentials, ``softmax_exact_zeros = False`` as on Paddle, by a select after it),
    but a row with nothing to keep comes out uniform, and a single kept score gets a weight
    of 1 only as exactly as the backend's softmax divides.
    """
    dtype = ops.dtype_name(x)
    if dtype in HALF_DTYPES:
        x = ops.cast(x, "float32")
    single = shape_of(x)[-1] == 1  # one score per row: computed here, weight exactly 1
    if keep is None and not single:
        weights = ops.softmax(x, axis=-1)
    elif zero_empty_rows or single:
        weights = _exact_softmax(ops, x, keep)
    else:
        weights = ops.softmax(ops.where(keep, x, MASKED_SCORE), axis=-1)
        if not ops.softmax_exact_zeros:
            weights = ops.where(keep, weights, 0.0)
    if dtype in HALF_DTYPES:
        weights = ops.cast(weights, dtype)
    return weights


def _exact_softmax(ops: Any, x: Any, keep: Any) -> Any:
    """``exp(x - m) / sum`` over the last axis with masked entries exactly 0 (see
    `softmax_where`)."""
    if keep is not None:
        x = ops.where(keep, x, float("-inf"))
    peak = ops.stop_gradient(ops.max(x, axis=-1, keepdims=True))
    # A row with nothing kept (or only -inf) has peak -inf: shift by 0, its exponentials
    # are all exp(-inf) = 0. A kept +inf or NaN score gives NaN, as it should.
    e = ops.exp(x - ops.where(ops.isfinite(peak), peak, 0.0))
    total = ops.sum(e, axis=-1, keepdims=True)
    return e / ops.where(ops.not_equal(total, 0.0), total, 1.0)


def masked_softmax(x: Any, valid_lens: Any = None, *, mask: Any = None, axis: int = -1) -> Any:
    """Softmax of ``x`` over ``axis``, restricted to the positions that may be attended.

    Args:
        x: floating scores, typically ``(batch, queries, keys)`` or
            ``(batch, heads, queries, keys)``.
        valid_lens: optional lengths, ``(batch,)`` (one per batch row, repeated over the
            queries) or ``(batch, queries)`` (one per query), as in the source documents.
            Positions ``>= length`` along ``axis`` are masked. The query axis is the axis
            just before ``axis`` once ``axis`` is moved last.
        mask: optional bool (True = may attend) or integer (non-zero = may attend) tensor
            broadcastable to ``x``. Combined with ``valid_lens`` by AND.
        axis: the axis to normalise (the key axis).

    Returns:
        Weights with the shape and dtype of ``x``. Masked positions are exactly 0, and
        have no effect on the other weights or on any gradient whatever they hold (NaN,
        ``inf``); rows with no allowed position are all zeros (never NaN, never uniform).
        With a mask the softmax is computed by multiattn (``exp(x - max) / sum``), so a
        row with one allowed finite score (the rest masked or ``-inf``) gets weight
        exactly 1 there on every backend and CPU. float16 and bfloat16 are normalised in
        float32 and cast back.

    Raises:
        TypeError: non-floating ``x``, float ``mask``, non-numeric ``valid_lens``.
        ValueError: ``axis`` out of range, ``mask`` not broadcastable, ``valid_lens`` of
            the wrong shape, negative or longer than the axis.
    """
    where = "masked_softmax"
    ops = get_ops(x, valid_lens, mask, names=("x", "valid_lens", "mask"), where=where)
    x = to_tensor(ops, as_array(x))
    check_float(where, "x", x, ops)
    shape = shape_of(x)
    check_rank(where, "x", shape, 1)
    if (
        isinstance(axis, bool)
        or not isinstance(axis, (int, np.integer))
        or not -len(shape) <= axis < len(shape)
    ):
        raise ValueError(
            f"{where}: `axis` must be an integer in [-{len(shape)}, {len(shape)}); received {axis!r}."
        )
    axis = int(axis) % len(shape)
    last = len(shape) - 1
    if axis != last:
        x = ops.moveaxis(x, axis, last)
        if mask is not None:
            mask = as_array(mask)
            broadcast_shape(where, "mask", shape_of(mask), shape)
            mask = ops.moveaxis(ops.broadcast_to(mask, shape), axis, last)
        moved = shape_of(x)
    else:
        moved = shape
    keep = combine_keep(ops, moved, mask=mask, valid_lens=valid_lens, where=where)
    weights = softmax_where(ops, x, keep)
    if axis != last:
        weights = ops.moveaxis(weights, last, axis)
    return weights

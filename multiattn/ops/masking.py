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
    describe,
    fmt_shape,
    shape_of,
    to_tensor,
)
from .._checks import concrete as _concrete
from ..namespaces.keras import get_ops

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
    return position_keep(
        ops,
        ops.arange(query_len, dtype="int32"),
        ops.arange(key_len, dtype="int32"),
        None,
        causal=True,
        offset=key_len - query_len,
    )


def position_keep(
    ops: Any, rows: Any, cols: Any, lens: Any, *, causal: bool, offset: Any = 0
) -> Any:
    """The mask (True = may attend) of the query positions ``rows`` ``(bq,)`` against the
    key positions ``cols`` ``(bk,)`` (int32, possibly traced), from lengths ``lens``
    (`lens_rank4`, already restricted to the rows, or None) and the causal rule (query
    ``i`` sees key ``j`` iff ``j <= i + offset``). None when neither applies."""
    out = None
    if lens is not None:
        out = ops.less(cols, lens)
    if causal:
        part = ops.less_equal(ops.expand_dims(cols, 0), ops.expand_dims(rows, 1) + offset)
        out = part if out is None else ops.logical_and(out, part)
    return out


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
    return _lens_keep(ops, check_valid_lens(ops, valid_lens, scores_shape, where), scores_shape)


def _lens_keep(ops: Any, lens: Any, scores_shape: tuple) -> Any:
    """The mask of checked int32 lengths (`check_valid_lens`) for scores of
    ``scores_shape``: bool broadcastable to them."""
    vshape, ndim, num_keys = shape_of(lens), len(scores_shape), scores_shape[-1]
    batch = -1 if vshape[0] is None else vshape[0]  # static where known: -1 is ambiguous
    if len(vshape) == 1:  # beside a size 0 (per-query lengths of no query)
        lens = ops.reshape(lens, (batch,) + (1,) * (ndim - 1))
    else:
        lens = ops.reshape(lens, (batch,) + (1,) * (ndim - 3) + (vshape[1], 1))
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
    """`combine_masks` in the namespace ``ops`` of the tensors being attended (internal):
    `split_masks`, then the AND of the pieces."""
    keep, lens, causal = split_masks(
        ops, scores_shape, mask=mask, valid_lens=valid_lens, causal=causal, where=where
    )
    if lens is not None:
        lens_keep = _lens_keep(ops, lens, scores_shape)
        keep = lens_keep if keep is None else ops.logical_and(keep, lens_keep)
    if causal:
        tri = _causal_keep(ops, scores_shape[-2], scores_shape[-1])
        keep = tri if keep is None else ops.logical_and(keep, tri)
    return keep


def check_causal(where: str, causal: Any) -> bool:
    """``causal`` as a Python bool; ``TypeError`` naming it unless it is a bool (Python or
    NumPy)."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{where}: `causal` must be a bool; received {causal!r}.")
    return bool(causal)


def check_mask(ops: Any, mask: Any, scores_shape: tuple, where: str, name: str = "mask") -> Any:
    """A caller's mask as bool (True = may attend): it must broadcast to ``scores_shape``
    and be boolean or integer (non-zero = may attend)."""
    mask = as_array(mask)
    broadcast_shape(where, name, shape_of(mask), scores_shape)
    return _mask_to_bool(ops, where, name, mask)


def check_bias(ops: Any, bias: Any, scores_shape: tuple, where: str, name: str = "bias") -> Any:
    """A caller's additive attention bias as a tensor of ``ops``: floating (``TypeError``
    naming ``name`` otherwise, and for None-like or string input) and broadcastable to
    ``scores_shape`` (``ValueError`` naming ``name`` and the shape received)."""
    bias = as_array(bias)
    check_float(where, name, bias, ops)
    broadcast_shape(where, name, shape_of(bias), scores_shape)
    return to_tensor(ops, bias)


def bias_block(ops: Any, bias: Any, rows: tuple | None = None, cols: tuple | None = None) -> Any:
    """The block ``rows x cols`` (``(start, stop)``, static; None: the whole axis) of a
    rank-4 ``bias`` broadcastable to ``(B, H, Tq, Tk)``; an axis of size 1 is kept whole
    (broadcast). None stays None."""
    if bias is None:
        return None
    bs = shape_of(bias)
    if rows is not None and bs[2] != 1:
        bias = bias[:, :, rows[0] : rows[1]]
    if cols is not None and bs[3] != 1:
        bias = bias[:, :, :, cols[0] : cols[1]]
    return bias


def looped_bias(ops: Any, bias: Any, start: Any, size: int, axis: int) -> Any:
    """Rows (``axis=2``) or columns (``axis=3``) ``[start, start + size)`` of a rank-4
    ``bias``, ``start`` possibly traced (inside ``fori_loop``); an axis of size 1 is kept
    whole. None stays None."""
    if bias is None or shape_of(bias)[axis] == 1:
        return bias
    if axis == 2:
        return _dynamic_rows(ops, bias, start, size)
    dims = _dims(ops, bias)
    return ops.slice(bias, (0, 0, 0, start), (*dims[:3], size))


def sum_to_shape(ops: Any, grad: Any, shape: tuple) -> Any:
    """``grad`` (rank 4) summed over the axes where ``shape`` (rank 4) has size 1 and
    ``grad`` does not: the gradient of a tensor of ``shape`` broadcast into ``grad``."""
    axes = tuple(i for i, d in enumerate(shape) if d == 1 and shape_of(grad)[i] != 1)
    return ops.sum(grad, axis=axes, keepdims=True) if axes else grad


def split_masks(
    ops: Any,
    scores_shape: tuple[int | None, ...],
    *,
    mask: Any = None,
    valid_lens: Any = None,
    causal: bool = False,
    where: str,
) -> tuple[Any, Any, bool]:
    """Validate ``mask``, ``valid_lens`` and ``causal`` for scores of ``scores_shape``
    without combining them into one ``(..., queries, keys)`` mask: the one place where
    the rules of the three pieces are checked (`combine_keep` combines what this returns).

    Returns:
        ``(keep, lens, causal)``: ``keep`` the boolean ``mask`` (broadcastable to
        ``scores_shape``) or None; ``lens`` the lengths as int32, ``(batch,)`` or
        ``(batch, queries)``, or None (`check_valid_lens`); ``causal`` a bool, True only
        with static query and key lengths.
    """
    causal = check_causal(where, causal)
    keep = None if mask is None else check_mask(ops, mask, scores_shape, where)
    lens = None
    if valid_lens is not None:
        lens = check_valid_lens(ops, valid_lens, scores_shape, where)
    if causal and (scores_shape[-2] is None or scores_shape[-1] is None):
        raise ValueError(
            f"{where}: `causal=True` needs static query and key lengths; received scores "
            f"of shape {fmt_shape(scores_shape)}."
        )
    return keep, lens, causal


# --- masks of blocks ----------------------------------------------------------------------


def lens_rank4(ops: Any, lens: Any) -> Any:
    """``(B,)`` -> ``(B, 1, 1, 1)``; ``(B, Tq)`` -> ``(B, 1, Tq, 1)``."""
    if lens is None:
        return None
    lens = ops.cast(lens, "int32")
    if len(shape_of(lens)) == 1:
        return ops.reshape(lens, (-1, 1, 1, 1))
    return ops.expand_dims(ops.expand_dims(lens, 1), 3)


def block_keep(
    ops: Any,
    keep: Any,
    lens: Any,
    causal: bool,
    sizes: tuple[Any, Any],
    rows: tuple[int, Any] | None = None,
    cols: tuple[int, Any] | None = None,
) -> Any:
    """The mask (True = may attend) of the block ``rows x cols`` of the scores, or None.

    Args:
        keep: bool broadcastable to ``(B, H, Tq, Tk)`` (rank 4) or None.
        lens: int lengths ``(B, 1, 1, 1)`` or ``(B, 1, Tq, 1)`` or None.
        causal: bottom-right aligned causal mask.
        sizes: ``(Tq, Tk)``.
        rows, cols: ``(start, stop)`` of the block; None: the whole axis.

    Returns:
        bool broadcastable to ``(B, H, rows, cols)``, or None when nothing in the block is
        masked by ``causal`` and there is no ``keep`` or ``lens``.
    """
    tq, tk = sizes
    r0, r1 = rows if rows is not None else (0, tq)
    c0, c1 = cols if cols is not None else (0, tk)
    if keep is not None:
        ks = shape_of(keep)
        if rows is not None and ks[2] != 1:
            keep = keep[:, :, r0:r1]
        if cols is not None and ks[3] != 1:
            keep = keep[:, :, :, c0:c1]
    if lens is not None and rows is not None and shape_of(lens)[2] != 1:
        lens = lens[:, :, r0:r1]
    # Query i sees key j iff j <= i + (Tk - Tq); the block needs a mask unless its last
    # key is visible to its first query.
    needs_causal = causal and not (c1 - 1 <= r0 + (tk - tq))
    part = None
    if lens is not None or needs_causal:
        rows_idx = ops.arange(r0, r1, dtype="int32") if needs_causal else None
        cols_idx = ops.arange(c0, c1, dtype="int32")
        part = position_keep(ops, rows_idx, cols_idx, lens, causal=needs_causal, offset=tk - tq)
    if keep is None or part is None:
        return keep if part is None else part
    return ops.logical_and(keep, part)


def rows_attending(ops: Any, keep: Any, lens: Any, causal: bool, sizes: tuple, cols: Any) -> Any:
    """The query rows that may attend at least one key where ``cols`` (bool ``(B, H, 1,
    Tk)``; None: any key) is True, bool broadcastable to ``(B, H, Tq, 1)``; None when
    that is every row (no mask and ``cols`` None).

    ``keep`` rank 4 or None, ``lens`` as `lens_rank4`. Without
    ``keep`` the mask is never formed: a row sees the first marked key iff that key lies
    below its length and, with ``causal``, at or before its diagonal.
    """
    tq, tk = sizes
    if keep is not None:
        full = block_keep(ops, keep, lens, causal, sizes)
        if cols is not None:
            full = ops.logical_and(full, cols)
        return ops.any(full, axis=-1, keepdims=True)
    hit, first = None, 0
    if cols is not None:
        positions = ops.arange(tk, dtype="int32")
        first = -ops.max(ops.where(cols, -positions, -tk), axis=-1, keepdims=True)
        hit = ops.less(first, tk)  # (B, H, 1, 1): some key is marked
    if lens is not None:
        part = ops.less(first, lens)
        hit = part if hit is None else ops.logical_and(hit, part)
    if causal:
        diagonal = ops.expand_dims(ops.arange(tq, dtype="int32"), 1) + (tk - tq)
        part = ops.less_equal(first, diagonal)
        hit = part if hit is None else ops.logical_and(hit, part)
    return hit


def visible_keys(r0: int, r1: int, tk: int, offset: int, causal: bool) -> tuple[int, int]:
    """``(stop, clear)`` for the query rows ``[r0, r1)``: under the causal mask (query
    ``i`` sees key ``j`` iff ``j <= i + offset``) the rows together see keys
    ``[0, stop)`` (``stop <= 0``: none), and every row sees keys ``[0, clear)``, which
    need no causal mask. Without it both are ``tk``."""
    if not causal:
        return tk, tk
    stop = min(tk, r1 + offset)
    return stop, max(0, min(stop, r0 + offset + 1))


def _dynamic_rows(ops: Any, x: Any, start: Any, size: int) -> Any:
    """Rows ``[start, start + size)`` of axis 2 of the rank-4 ``x`` (``start`` may be
    traced); ``x`` itself if that axis has size 1 (broadcast)."""
    if shape_of(x)[2] == 1:
        return x
    dims = _dims(ops, x)
    return ops.slice(x, (0, 0, start, 0), (dims[0], dims[1], size, dims[3]))


def looped_keep(
    ops: Any,
    keep: Any,
    lens: Any,
    start: Any,
    size: int,
    axis: int,
    cols: tuple[int, int] | None = None,
) -> Any:
    """The mask of a block inside a loop, whose start along ``axis`` (2: query rows, 3:
    key columns) is ``start`` (possibly traced) and whose extent there is ``size``.

    ``keep`` (rank 4) is already restricted to the block along the other axis, and so
    are ``lens`` (`lens_rank4`) with ``axis=3``. With ``axis=2`` the lengths are taken
    whole and ``cols``, the block's static key range ``(c0, c1)``, is required. No causal
    mask: loops visit only blocks that need none. Returns bool or None.
    """
    out = None
    if keep is not None:
        out = keep
        if axis == 2:
            out = _dynamic_rows(ops, keep, start, size)
        elif shape_of(keep)[3] != 1:
            dims = _dims(ops, keep)
            out = ops.slice(keep, (0, 0, 0, start), (*dims[:3], size))
    if lens is not None:
        if axis == 2:
            if cols is None:
                raise ValueError("looped_keep: lengths in a loop over rows need `cols`")
            lens = _dynamic_rows(ops, lens, start, size)
            positions = ops.arange(cols[0], cols[1], dtype="int32")
        else:
            positions = ops.arange(size, dtype="int32") + ops.cast(start, "int32")
        part = ops.less(positions, lens)
        out = part if out is None else ops.logical_and(out, part)
    return out


def _dims(ops: Any, x: Any) -> list:
    """The shape of ``x``: static sizes where known, dynamic ones elsewhere."""
    static = shape_of(x)
    if all(d is not None for d in static):
        return list(static)
    dynamic = ops.shape(x)
    return [d if d is not None else dynamic[i] for i, d in enumerate(static)]


# --- Keras' mask conventions (the drop-in layers) ----------------------------------------


def top_left_keep(ops: Any, tq: Any, tk: Any) -> Any:
    """``(1, Tq, Tk)``: query ``i`` may attend key ``j`` iff ``j <= i`` (Keras' causal
    mask, aligned top-left)."""
    rows, cols = ops.arange(tq, dtype="int32"), ops.arange(tk, dtype="int32")
    return ops.expand_dims(position_keep(ops, rows, cols, None, causal=True), 0)


def window_keep(ops: Any, tq: Any, tk: Any, window: int) -> Any:
    """``(1, Tq, Tk)``: ``|i - j| < window`` (Keras' symmetric sliding window)."""
    rows = ops.expand_dims(ops.arange(tq, dtype="int32"), 1)
    cols = ops.expand_dims(ops.arange(tk, dtype="int32"), 0)
    return ops.expand_dims(ops.less(ops.abs(rows - cols), window), 0)


def truthy_keep(ops: Any, where: str, name: str, mask: Any) -> Any:
    """A Keras attention mask as bool: bool as is, numbers non-zero = may attend (Keras
    casts with ``ops.cast(mask, "bool")``)."""
    if isinstance(mask, np.ndarray):
        if mask.dtype.kind not in "biuf":
            raise TypeError(
                f"{where}: `{name}` must be boolean or numeric (non-zero = may attend); "
                f"received {describe(mask)}."
            )
        return mask if mask.dtype == bool else mask != 0
    dtype = ops.dtype_name(mask)
    if dtype == "bool":
        return mask
    if dtype.startswith(("int", "uint", "float", "bfloat")):
        return ops.not_equal(mask, ops.cast(0, dtype))
    raise TypeError(
        f"{where}: `{name}` must be boolean or numeric (non-zero = may attend); received "
        f"dtype {dtype}."
    )


def keras_keep(ops: Any, where: str, name: str, mask: Any, scores_shape: tuple, n_axes: int) -> Any:
    """``mask`` aligned with the scores ``(batch, <other axes>, heads, <query attention
    axes>, <key attention axes>)`` as Keras aligns it: axes are inserted before the last
    ``2 * n_axes`` (the heads axis first) until the ranks agree; then it must broadcast.
    Returns a bool tensor of the scores' rank."""
    ms = shape_of(mask)
    rank = len(scores_shape)
    if len(ms) > rank:
        raise ValueError(
            f"{where}: `{name}` of shape {fmt_shape(ms)} has more axes than the attention "
            f"scores {fmt_shape(scores_shape)} (batch, heads, queries, keys)."
        )
    padded = list(ms)
    while len(padded) < rank:
        padded.insert(max(len(padded) - 2 * n_axes, 0), 1)
    if not all(p == 1 or p is None or t is None or p == t for p, t in zip(padded, scores_shape)):
        raise ValueError(
            f"{where}: `{name}` of shape {fmt_shape(ms)} does not broadcast to the attention "
            f"scores {fmt_shape(scores_shape)} (batch, heads, queries, keys; a mask without "
            "the heads axis, such as (batch, queries, keys), gets it inserted)."
        )
    keep = truthy_keep(ops, where, name, mask)
    if isinstance(keep, np.ndarray):
        return keep.reshape(padded)
    while len(shape_of(keep)) < rank:
        keep = ops.expand_dims(keep, max(len(shape_of(keep)) - 2 * n_axes, 0))
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

    Scores with no entries (a static size 0: no rows, or no keys) give weights of the
    same empty shape, without a reduction.
    """
    if 0 in shape_of(x):
        return x * 0.0
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


def softmax_lse(ops: Any, x: Any, keep: Any) -> tuple[Any, Any]:
    """``(weights, lse)``: the weights of ``softmax_where(ops, x, keep,
    zero_empty_rows=False)``, the same tensor, and the log of each row's softmax
    denominator ``lse`` (``(..., 1)``: ``weights = exp(x - lse)`` at every kept score)
    for a backward pass that recomputes the weights (`multiattn.ops.explicit_grad`).

    ``lse`` is read off the weights rather than summed again: the row's largest weight
    sits at its largest score, so ``lse = max(x) - log(max(weights))``, two reductions
    and no exponential (the largest weight is at least ``1 / Tk``, so its logarithm
    loses nothing). Masked scores count as `MASKED_SCORE`, as in the softmax. Where
    nothing reads ``lse`` (a call that is not differentiated) the compilers drop it."""
    weights = softmax_where(ops, x, keep, zero_empty_rows=False)
    if keep is not None:
        x = ops.where(keep, x, MASKED_SCORE)
    peak = ops.max(x, axis=-1, keepdims=True)
    return weights, peak - ops.log(ops.max(weights, axis=-1, keepdims=True))


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

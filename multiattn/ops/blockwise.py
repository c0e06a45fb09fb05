"""Exact attention in blocks, in memory linear in the sequence lengths (internal).

`blockwise_attention` computes ``softmax(scale * q k^T) v`` one block of queries
against one block of keys at a time, keeping per query row a running maximum, a running
sum of exponentials and a running weighted sum of values (the "online softmax" of
Milakov & Gimelshein 2018, as used by FlashAttention and by Rabe & Staats, "Self-attention
does not need O(n^2) memory"). The full ``(queries, keys)`` score matrix is never formed,
and neither are masks from valid lengths or the causal flag: each block's mask is built
from the lengths and the block's offsets; a boolean mask given by the caller is sliced.

The shift by the running maximum is only a numerical device: the result does not depend
on it, so it is held constant for differentiation (as in
`multiattn.ops.masking.softmax_where`). A row with nothing to attend gets a zero output
and zero gradients, never NaN.

`multiattn.ops.attention.attend` selects this path when the score matrix would exceed the
memory budget of `multiattn.config`, or when a block size is forced, and differentiates
it with the backward pass of `multiattn.ops.blockwise_grad` (linear memory; automatic
differentiation of these steps would keep every block's scores). Ring attention
(`multiattn.distributed`) folds its blocks with `_step` and differentiates it directly.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .._checks import as_array, broadcast_shape, fmt_shape, shape_of
from ..config import get_attention_memory_budget
from .masking import _mask_to_bool, check_valid_lens

__all__ = [
    "MAX_QUERY_BLOCKS",
    "MIN_BLOCK",
    "PREFERRED_BLOCK_BYTES",
    "SCORE_SHARE",
    "block_keep",
    "blockwise_attention",
    "check_block_size",
    "choose_blocks",
    "lens_rank4",
    "looped_keep",
    "plan_blocks",
    "split_masks",
    "visible_keys",
]

# One block's scores may take at most this share of the budget: a step holds the scores
# and about two more block-sized temporaries (and a boolean block mask) at once.
SCORE_SHARE = 4
# Preferred size of one block's scores, in bytes: large enough that the per-step
# overhead is small, small enough for the allocator to reuse the memory of one step in
# the next (glibc hands allocations of 32 MiB and more straight back to the system, so
# every step of larger blocks faults its temporaries in afresh: twice as slow on CPU).
PREFERRED_BLOCK_BYTES = 16 << 20
# Under a trace (jax.jit, tf.function) each block of queries is a copy of the loop in the
# compiled program: query blocks grow taller (and key blocks narrower, at the same size)
# to keep them at most this many.
MAX_QUERY_BLOCKS = 32
# Blocks are never smaller than this (unless the sequence is), so that a tiny budget
# cannot unroll into thousands of steps.
MIN_BLOCK = 16


# --- masks as pieces ----------------------------------------------------------------------


def split_masks(
    ops: Any,
    scores_shape: tuple[int | None, ...],
    *,
    mask: Any = None,
    valid_lens: Any = None,
    causal: bool = False,
    where: str,
) -> tuple[Any, Any, bool]:
    """Validate ``mask``, ``valid_lens`` and ``causal`` as `combine_keep` does, without
    combining them into one ``(..., queries, keys)`` mask.

    Returns:
        ``(keep, lens, causal)``: ``keep`` the boolean ``mask`` (broadcastable to
        ``scores_shape``) or None; ``lens`` the lengths as int32, ``(batch,)`` or
        ``(batch, queries)``, or None; ``causal`` a bool. The errors are those of
        `multiattn.ops.masking.combine_keep`.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{where}: `causal` must be a bool; received {causal!r}.")
    keep = None
    if mask is not None:
        mask = as_array(mask)
        broadcast_shape(where, "mask", shape_of(mask), scores_shape)
        keep = _mask_to_bool(ops, where, "mask", mask)
    lens = None
    if valid_lens is not None:
        lens = check_valid_lens(ops, valid_lens, scores_shape, where)
    if causal and (scores_shape[-2] is None or scores_shape[-1] is None):
        raise ValueError(
            f"{where}: `causal=True` needs static query and key lengths; received scores "
            f"of shape {fmt_shape(scores_shape)}."
        )
    return keep, lens, bool(causal)


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
    parts = []
    if keep is not None:
        ks = shape_of(keep)
        if rows is not None and ks[2] != 1:
            keep = keep[:, :, r0:r1]
        if cols is not None and ks[3] != 1:
            keep = keep[:, :, :, c0:c1]
        parts.append(keep)
    if lens is not None:
        if rows is not None and shape_of(lens)[2] != 1:
            lens = lens[:, :, r0:r1]
        parts.append(ops.less(ops.arange(c0, c1, dtype="int32"), lens))
    # Query i sees key j iff j <= i + (Tk - Tq); the block needs a mask unless its last
    # key is visible to its first query.
    if causal and not (c1 - 1 <= r0 + (tk - tq)):
        row_idx = ops.expand_dims(ops.arange(r0, r1, dtype="int32"), 1)
        col_idx = ops.expand_dims(ops.arange(c0, c1, dtype="int32"), 0)
        parts.append(ops.less_equal(col_idx, row_idx + (tk - tq)))
    if not parts:
        return None
    out = parts[0]
    for part in parts[1:]:
        out = ops.logical_and(out, part)
    return out


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


# --- block sizes --------------------------------------------------------------------------


def check_block_size(where: str, block_size: Any) -> tuple[int, int] | None:
    """None, a positive int, or a pair of positive ints ``(queries, keys)``."""
    if block_size is None:
        return None
    pair = block_size if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    ok = len(pair) == 2 and all(
        not isinstance(b, bool) and isinstance(b, (int, np.integer)) and b >= 1 for b in pair
    )
    if not ok:
        raise ValueError(
            f"{where}: `block_size` must be None, a positive integer or a pair of positive "
            f"integers (queries, keys); received {block_size!r}."
        )
    return int(pair[0]), int(pair[1])


def _even(size: int, block: int) -> int:
    """``block`` shrunk so that ``size`` splits into equal blocks (no small last block)."""
    block = max(1, min(block, size))
    count = -(-size // block)
    return -(-size // count)


def choose_blocks(
    batch_heads: int,
    tq: int,
    tk: int,
    itemsize: int,
    budget: int,
    max_query_blocks: int | None = None,
) -> tuple[int, int]:
    """Query and key block sizes for scores that would not fit in ``budget`` bytes.

    One block's scores (``batch_heads * bq * bk`` elements) take about
    `PREFERRED_BLOCK_BYTES`, and never more than ``budget / SCORE_SHARE``. Blocks are
    about square (so that causal masking skips about half of them), except that with
    ``max_query_blocks`` the query blocks are made taller, and the key blocks narrower,
    to stay within that many. Blocks split the sequences evenly and are not below about
    `MIN_BLOCK` unless the sequence is shorter.
    """
    batch_heads = max(1, batch_heads)
    target = min(max(1, budget // SCORE_SHARE), PREFERRED_BLOCK_BYTES)
    area = max(1, target // (itemsize * batch_heads))  # bq * bk
    side = math.isqrt(area)
    bk = min(tk, max(side, area // tq, MIN_BLOCK))
    bq = min(tq, max(area // bk, MIN_BLOCK))
    if max_query_blocks is not None and -(-tq // bq) > max_query_blocks:
        bq = -(-tq // max_query_blocks)
        bk = min(tk, max(area // bq, MIN_BLOCK))
    return _even(tq, bq), _even(tk, bk)


def plan_blocks(
    shape: tuple[int | None, int | None, int | None, int | None],
    itemsize: int,
    block_size: tuple[int, int] | None,
    *,
    traced: bool = False,
    where: str = "attention",
) -> tuple[int, int] | None:
    """The blocks to compute attention with, or None for the direct path.

    Args:
        shape: ``(B, H, Tq, Tk)``, None for unknown sizes (an unknown batch or head count
            counts as 1).
        itemsize: bytes per score element (4 for float32 compute, 8 for float64).
        block_size: forced ``(queries, keys)`` blocks, or None to decide by the budget.
        traced: the computation is being traced (``jax.jit``, ``tf.function``): the
            number of query blocks is limited to `MAX_QUERY_BLOCKS`.
    """
    b, h, tq, tk = shape
    static = tq is not None and tk is not None and tq > 0 and tk > 0
    if block_size is not None:
        if not static:
            raise ValueError(
                f"{where}: `block_size` needs static, non-zero query and key lengths; "
                f"received scores of shape {fmt_shape(shape)}."
            )
        return min(block_size[0], tq), min(block_size[1], tk)
    if not static:
        return None
    batch_heads = (b or 1) * (h or 1)
    budget = get_attention_memory_budget()
    if batch_heads * tq * tk * itemsize <= budget:
        return None
    return choose_blocks(
        batch_heads, tq, tk, itemsize, budget, MAX_QUERY_BLOCKS if traced else None
    )


# --- the online softmax -------------------------------------------------------------------


class _Running(NamedTuple):
    """The running state of one block of query rows."""

    peak: Any  # max of the kept scores so far, (B, H, bq, 1); -inf: nothing kept yet
    total: Any  # sum of exp(score - shift) over the kept keys, (B, H, bq, 1)
    acc: Any  # sum of exp(score - shift) * value, (B, H, bq, Dv)


def _shift(ops: Any, peak: Any) -> Any:
    """The shift of the exponentials: the running max, 0 where nothing is kept yet."""
    return ops.where(peak > float("-inf"), peak, 0.0)


def _step(ops: Any, state: _Running | None, scores: Any, keep: Any, value: Any) -> _Running:
    """Fold one block of ``scores`` ``(B, H, bq, bk)`` and its values into ``state``.

    The shift (the running max) only guards exp() against overflow; the result does not
    depend on it, so it is held constant for differentiation.
    """
    if keep is not None:
        scores = ops.where(keep, scores, float("-inf"))
    peak = ops.stop_gradient(ops.max(scores, axis=-1, keepdims=True))
    if state is not None:
        peak = ops.where(state.peak > peak, state.peak, peak)
    shift = _shift(ops, peak)
    probs = ops.exp(scores - shift)
    if keep is not None:
        # exp(-inf) is 0 on most backends, but not exactly on every one (Paddle's CPU
        # kernel gives a denormal): masked entries are zeroed explicitly, which also
        # gives them exactly zero gradients.
        probs = ops.where(keep, probs, 0.0)
    total = ops.sum(probs, axis=-1, keepdims=True)
    acc = ops.einsum("bhqk,bkhd->bhqd", probs, value)
    if state is not None:
        # exp(old shift - new shift) <= 1; rows with nothing kept before have zero sums
        # (and an old shift of 0 that could overflow the difference): factor 1.
        seen = state.peak > float("-inf")
        rescale = ops.exp(ops.where(seen, _shift(ops, state.peak) - shift, 0.0))
        total = total + rescale * state.total
        acc = acc + rescale * state.acc
    return _Running(peak, total, acc)


def _dims(ops: Any, x: Any) -> list:
    """The shape of ``x``: static sizes where known, dynamic ones elsewhere."""
    static = shape_of(x)
    if all(d is not None for d in static):
        return list(static)
    dynamic = ops.shape(x)
    return [d if d is not None else dynamic[i] for i, d in enumerate(static)]


def blockwise_attention(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    *,
    keep: Any = None,
    valid_lens: Any = None,
    causal: bool = False,
    scale: float,
    blocks: tuple[int, int],
    return_lse: bool = False,
) -> Any:
    """Attention on ``(batch, seq, heads, dim)`` arrays, ``blocks = (bq, bk)`` at a time.

    Query blocks are a Python loop. For each, the key blocks that need no causal mask and
    are whole go through ``ops.fori_loop`` (one loop body in a compiled program, so that
    a compiler cannot schedule every block at once: XLA on CPU does, with unrolled
    steps); the others (the causal diagonal, a last partial block) are single steps.

    Args:
        query: ``(B, Tq, H, D)``; key: ``(B, Tk, H, D)``; value: ``(B, Tk, H, Dv)``, all
            float32 or float64 (half precision is cast by the caller); ``Tq`` and ``Tk``
            static.
        keep: bool broadcastable to ``(B, H, Tq, Tk)`` (rank 4) or None.
        valid_lens: int lengths ``(B,)`` or ``(B, Tq)`` or None.
        causal: bottom-right aligned causal mask; key blocks wholly in a query block's
            future are skipped.
        scale: multiplier of the dot products.

        return_lse: also return, per query row, the log of the softmax denominator
            (``log sum_j exp(scale * q_i . k_j)`` over the kept keys; +inf for a row with
            nothing to attend), ``(B, H, Tq, 1)``: what `multiattn.ops.blockwise_grad`
            recomputes the weights from.

    Returns:
        ``(B, Tq, H, Dv)``; rows with nothing to attend are zero. With ``return_lse``,
        ``(output, lse)``.
    """
    tq, tk = shape_of(query)[1], shape_of(key)[1]
    bq, bk = min(blocks[0], tq), min(blocks[1], tk)
    offset = tk - tq  # query i sees key j iff j <= i + offset (causal)
    lens = lens_rank4(ops, valid_lens)
    kdims, vdims = _dims(ops, key), _dims(ops, value)
    outs, lses = [], []
    for r0 in range(0, tq, bq):
        r1 = min(r0 + bq, tq)
        q_blk = query[:, r0:r1] * scale
        keep_rows = keep
        if keep is not None and shape_of(keep)[2] != 1:
            keep_rows = keep[:, :, r0:r1]
        lens_rows = lens
        if lens is not None and shape_of(lens)[2] != 1:
            lens_rows = lens[:, :, r0:r1]

        def step(state, c0, c1, r0=r0, r1=r1, q_blk=q_blk):
            blk_keep = block_keep(ops, keep, lens, causal, (tq, tk), (r0, r1), (c0, c1))
            scores = ops.einsum("bqhd,bkhd->bhqk", q_blk, key[:, c0:c1])
            return _step(ops, state, scores, blk_keep, value[:, c0:c1])

        def body(j, state, q_blk=q_blk, keep_rows=keep_rows, lens_rows=lens_rows):
            c0 = j * bk
            k_blk = ops.slice(key, (0, c0, 0, 0), (kdims[0], bk, kdims[2], kdims[3]))
            v_blk = ops.slice(value, (0, c0, 0, 0), (vdims[0], bk, vdims[2], vdims[3]))
            blk_keep = looped_keep(ops, keep_rows, lens_rows, c0, bk, axis=3)
            scores = ops.einsum("bqhd,bkhd->bhqk", q_blk, k_blk)
            return _step(ops, state, scores, blk_keep, v_blk)

        # A block that sees no key takes one all-masked step, which gives zeros.
        stop, clear = visible_keys(r0, r1, tk, offset, causal)
        stop = max(1, stop)
        looped = clear // bk
        state = None
        for c0 in range(looped * bk, stop, bk):
            state = step(state, c0, min(c0 + bk, tk))
        first = 0
        if looped and state is None:
            state, first = step(None, 0, bk), 1
        if looped > first:
            state = ops.fori_loop(first, looped, body, state)
        kept = state.total > 0
        out = state.acc / ops.where(kept, state.total, 1.0)
        outs.append(ops.transpose(out, (0, 2, 1, 3)))
        if return_lse:
            # log of the softmax denominator: shift + log(sum of exp(score - shift));
            # +inf for rows with nothing to attend (their weights are all 0).
            lse = _shift(ops, state.peak) + ops.log(ops.where(kept, state.total, 1.0))
            lses.append(ops.where(kept, lse, float("inf")))
    out = outs[0] if len(outs) == 1 else ops.concatenate(outs, axis=1)
    if not return_lse:
        return out
    return out, lses[0] if len(lses) == 1 else ops.concatenate(lses, axis=2)

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

from .._checks import fmt_shape, shape_of
from ..config import get_attention_memory_budget
from .masking import (  # the mask rules live in masking; re-exported here
    _dims,
    bias_block,
    block_keep,
    lens_rank4,
    looped_bias,
    looped_keep,
    split_masks,
    visible_keys,
)

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
    budget: int | None = None,
) -> tuple[int, int] | None:
    """The blocks to compute attention with, or None for the direct path.

    Args:
        shape: ``(B, H, Tq, Tk)``, None for unknown sizes (an unknown batch or head count
            counts as 1).
        itemsize: bytes per score element (4 for float32 compute, 8 for float64).
        block_size: forced ``(queries, keys)`` blocks, or None to decide by the budget.
        traced: the computation is being traced (``jax.jit``, ``tf.function``): the
            number of query blocks is limited to `MAX_QUERY_BLOCKS`.
        budget: the memory budget in bytes; None: that of `multiattn.config`.
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
    if budget is None:
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


def add_bias(scores: Any, bias: Any) -> Any:
    """``scores + bias`` (``bias`` None: ``scores``)."""
    return scores if bias is None else scores + bias


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
    bias: Any = None,
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
        bias: float broadcastable to ``(B, H, Tq, Tk)`` (rank 4, the compute dtype) added
            to the scaled scores, sliced per block like ``keep``; or None.
        return_lse: also return, per query row, the log of the softmax denominator
            (``log sum_j exp(scale * q_i . k_j + bias_ij)`` over the kept keys; +inf for a row with
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
        bias_rows = bias_block(ops, bias, (r0, r1))

        def step(state, c0, c1, r0=r0, r1=r1, q_blk=q_blk, bias_rows=bias_rows):
            blk_keep = block_keep(ops, keep, lens, causal, (tq, tk), (r0, r1), (c0, c1))
            scores = ops.einsum("bqhd,bkhd->bhqk", q_blk, key[:, c0:c1])
            scores = add_bias(scores, bias_block(ops, bias_rows, cols=(c0, c1)))
            return _step(ops, state, scores, blk_keep, value[:, c0:c1])

        def body(j, state, q_blk=q_blk, keep_rows=keep_rows, lens_rows=lens_rows,
                 bias_rows=bias_rows):  # fmt: skip
            c0 = j * bk
            k_blk = ops.slice(key, (0, c0, 0, 0), (kdims[0], bk, kdims[2], kdims[3]))
            v_blk = ops.slice(value, (0, c0, 0, 0), (vdims[0], bk, vdims[2], vdims[3]))
            blk_keep = looped_keep(ops, keep_rows, lens_rows, c0, bk, axis=3)
            scores = ops.einsum("bqhd,bkhd->bhqk", q_blk, k_blk)
            scores = add_bias(scores, looped_bias(ops, bias_rows, c0, bk, axis=3))
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

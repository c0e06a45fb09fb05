"""The attention axes of `multiattn.layers.MultiHeadAttention` (Keras' ``attention_axes``).

Inputs are ``(B, *dims, E)`` and their projections ``(B, *dims, H, D)``. The attention
runs over the axes ``axes`` of ``dims`` (numbered as in the inputs: ``1 .. rank - 2``);
the other axes of ``dims`` are batch-like. The scores then have the shape
``(B, <other axes>, H, <query attention axes>, <key attention axes>)`` (`scores_shape`),
which for rank-3 inputs is ``(B, H, T_q, T_k)``.

`attention_over_axes` runs attention over several axes as one: the other axes join the
batch and the attention axes are flattened into one (a softmax over several axes is one
over their product), so that the core attention runs on ``(batch, positions, heads,
dim)``. Masks are bool, True = may attend, aligned with the scores (see
`multiattn.layers._mha_masks`); the output and weights keep the inputs' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .._checks import fmt_shape, shape_of
from ._mha_masks import axes_band_keep, length


def normalise_axes(where: str, attention_axes: tuple | None, rank: int) -> tuple[int, ...]:
    """The attention axes of inputs of ``rank`` (Keras' rule: negative axes count from
    the end of the input), each in ``1 .. rank - 2``; None: all of them."""
    if attention_axes is None:
        return tuple(range(1, rank - 1))
    axes = tuple(a + rank if a < 0 else a for a in attention_axes)
    if any(not 1 <= a <= rank - 2 for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(
            f"{where}: `attention_axes` {attention_axes!r} is out of range for "
            f"inputs of rank {rank}: each axis must name one of the axes 1 .. {rank - 2} "
            f"(or -{rank - 1} .. -2), once; the batch (0) and feature (-1) axes cannot be "
            "attended over."
        )
    return axes


def scores_shape(q_lead: tuple, k_lead: tuple, axes: tuple, heads: int) -> tuple:
    """The shape of the attention scores of a query and a key whose shapes before the
    feature axes are ``q_lead`` and ``k_lead`` (``(B, *dims)``): ``(B, <other axes>, H,
    <query attention axes>, <key attention axes>)``."""
    rest = [a for a in range(1, len(q_lead)) if a not in axes]
    return (
        q_lead[0],
        *(q_lead[a] for a in rest),
        heads,
        *(q_lead[a] for a in axes),
        *(k_lead[a] for a in axes),
    )


def _check_static(where: str, axes: tuple, rest: list, qs: tuple, ks: tuple) -> None:
    for a in (*rest, *axes):
        if qs[a] is None or ks[a] is None:
            raise ValueError(
                f"{where}: attention over axes {axes} needs static sizes on every axis "
                f"but the batch; received query {fmt_shape(qs)} and key {fmt_shape(ks)} "
                "(projected)."
            )
    if any(qs[a] != ks[a] for a in rest):
        raise ValueError(
            f"{where}: `query` and `key` must agree on the axes not attended over "
            f"{tuple(rest)}; received {fmt_shape(qs)} and {fmt_shape(ks)} (projected)."
        )


def attention_over_axes(
    ops: Any, where: str, axes: tuple, heads: int, q: Any, k: Any, v: Any, keep: Any,
    top_left: bool, window: int | None, run: Callable,
) -> tuple[Any, Any]:  # fmt: skip
    """Attention of projected ``q`` ``(B, *dims, H, D)``, ``k`` and ``v`` over the axes
    ``axes``: ``(output (B, *dims, H, D_v), weights (scores' shape) or None)``.

    ``keep`` (bool or None) is aligned with the scores; ``top_left`` and ``window`` add
    Keras' causal mask and sliding window over the first attention axis. ``run(q, k, v,
    keep)`` is the core attention of rank-4 inputs, returning ``(output, weights or
    None)``."""
    qs, ks = shape_of(q), shape_of(k)
    n = len(qs) - 3
    rest = [a for a in range(1, n + 1) if a not in axes]
    _check_static(where, axes, rest, qs, ks)
    scores = scores_shape(qs[:-2], ks[:-2], axes, heads)
    keep = axes_band_keep(ops, where, "use_causal_mask", keep, qs, ks, top_left, window,
                          scores, len(axes))  # fmt: skip
    perm = [0, *rest, *axes, n + 1, n + 2]
    tq = math.prod(qs[a] for a in axes)
    tk = math.prod(ks[a] for a in axes)

    def flat(x: Any, t: int) -> Any:
        s = shape_of(x)
        return ops.reshape(ops.transpose(x, perm), (-1, t, s[-2], s[-1]))

    qf, kf, vf = flat(q, tq), flat(k, tk), flat(v, tk)
    keep4 = None
    if keep is not None:
        batch = length(ops, q, 0)
        mask_heads = shape_of(keep)[len(rest) + 1]
        full = (batch, *(qs[a] for a in rest), mask_heads, *scores[len(rest) + 2 :])
        keep4 = ops.reshape(ops.broadcast_to(keep, full), (-1, mask_heads, tq, tk))
    out, weights = run(qf, kf, vf, keep4)
    lead = (-1, *(qs[a] for a in rest))
    out = ops.reshape(out, (*lead, *(qs[a] for a in axes), *shape_of(out)[-2:]))
    out = ops.transpose(out, list(np.argsort(perm)))
    if weights is not None:
        weights = ops.reshape(weights, (*lead, *scores[len(rest) + 1 :]))
    return out, weights

"""Scaled dot-product attention and attention over precomputed scores.

One internal routine, `attend`, computes attention on ``(batch, seq, heads, dim)``
arrays; the public functions and the layers all reach it, so there is a single
implementation of the math with two execution paths:

* the fused path (``keras.ops.dot_product_attention``) when neither the weights nor
  dropout are needed and the value width equals the key width;
* the explicit path (scores, `multiattn.ops.masking.softmax_where`, weighted sum)
  otherwise;
* the blockwise path (`multiattn.ops.blockwise`: blocks of queries and keys with an
  online softmax, memory linear in the lengths) when the score matrix would exceed the
  memory budget of `multiattn.config`, or when a block size is forced, and neither the
  weights nor dropout are needed.

All give the same result, fully masked rows included: such rows are all-zero weights
and a zero output.

Which path a call takes is decided once per call, without touching a tensor, by
`multiattn.ops.plan.plan_attention` from an `multiattn.ops.plan.AttentionSpec` of the
call; the paths below follow the `multiattn.ops.plan.AttentionPlan` it returns.

Grouped-query attention (fewer key/value heads than query heads, multi-query attention
with one) keeps the key/value heads grouped: the explicit path contracts the queries of
each group, ``(B, H_kv, G * Tq, D)``, with their one key/value head ``(B, H_kv, Tk, D)``,
and PyTorch's fused kernel takes the groups itself (``enable_gqa``), so the key/value
heads are never repeated in memory there. They are repeated (`repeat_kv_heads`) only for
a fused kernel that cannot take groups (on some backends it rejects a single key/value
head) and for the blockwise path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from .. import config
from .._checks import (
    HALF_DTYPES,
    as_array,
    check_call_flags,
    check_float,
    check_rank,
    check_rate,
    check_scale,
    dims_match,
    fmt_shape,
    shape_of,
    to_tensor,
)
from ..namespaces.keras import get_ops
from . import blockwise, blockwise_grad, explicit_grad, plan
from .masking import (
    block_keep,
    check_bias,
    combine_keep,
    lens_rank4,
    rows_attending,
    softmax_lse,
    softmax_where,
    split_masks,
)

__all__ = ["attend", "repeat_kv_heads", "scaled_dot_product_attention", "score_attention"]


def _apply_dropout(ops: Any, weights: Any, dropout: float, training: bool, seed: Any) -> Any:
    if dropout > 0.0 and training:
        return ops.dropout(weights, dropout, seed)
    return weights


def repeat_kv_heads(ops: Any, x: Any, groups: int) -> Any:
    """``(B, T, Hkv, D)`` -> ``(B, T, Hkv * groups, D)``: key/value head ``j`` serves query
    heads ``j * groups .. (j + 1) * groups - 1`` (internal)."""
    if groups == 1:
        return x
    static = shape_of(x)
    dyn = ops.shape(x)
    dims = [s if s is not None else dyn[i] for i, s in enumerate(static)]
    x = ops.broadcast_to(ops.expand_dims(x, 3), (dims[0], dims[1], dims[2], groups, dims[3]))
    return ops.reshape(x, (dims[0], dims[1], dims[2] * groups, dims[3]))


def _size(ops: Any, x: Any, axis: int) -> Any:
    """The size of axis ``axis`` of ``x``: an int, or a scalar tensor under a trace."""
    size = shape_of(x)[axis]
    return size if size is not None else ops.shape(x)[axis]


def attend(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    *,
    keep: Any = None,
    valid_lens: Any = None,
    causal: bool = False,
    scale: float,
    dropout: float = 0.0,
    training: bool = False,
    seed: Any = None,
    return_weights: bool = False,
    block_size: tuple[int, int] | None = None,
    bias: Any = None,
    kv_heads_first: bool = False,
    kv_finite: bool = False,
    softcap: float | None = None,
) -> Any:
    """Attention on validated ``(batch, seq, heads, dim)`` arrays (internal).

    The mask is the AND of three optional pieces, validated by the caller (see
    `multiattn.ops.masking.split_masks`); passing lengths and ``causal`` as such, rather
    than folded into ``keep``, lets the blockwise path build each block's mask without
    ever forming the ``(Tq, Tk)`` mask.

    Positions a row may not attend have no effect on it, whatever they hold: when a mask
    is given (and on the fused path, whose kernel may zero a row with a NaN query), the
    inputs are screened for NaN and infinities (`all_finite`, one sum each; on the
    explicit path, where the scores are fewer than the keys and values, the query, scores
    and output instead: `_screens_scores`) and, if there are any, the attention runs on
    the inputs with them replaced by 0 (`_replace_non_finite`) and the rows that attend
    one come out NaN (`_poison_rows`).

    Args:
        query: ``(B, Tq, H, D)``; key: ``(B, Tk, Hkv, D)``; value: ``(B, Tk, Hkv, Dv)``
            with ``Hkv`` dividing ``H`` (grouped-query attention when ``Hkv < H``: query
            head ``h`` uses key/value head ``h // (H / Hkv)``).
        keep: bool mask broadcastable to ``(B, H, Tq, Tk)`` (True = may attend) or None.
        valid_lens: int lengths ``(B,)`` or ``(B, Tq)`` (keys ``>=`` length masked) or None.
        causal: bottom-right aligned causal mask (static ``Tq``, ``Tk``).
        scale: multiplier of the dot products.
        block_size: ``(queries, keys)`` forces the blockwise path with these blocks; None
            takes the ``block_size`` of `multiattn.config.settings`, if any, else takes
            the path only when the scores ``B*H*Tq*Tk`` would exceed the memory budget.
            Either way it is not taken when the weights or dropout are needed.
        bias: float broadcastable to ``(B, H, Tq, Tk)`` (rank <= 4, validated by the
            caller), added to the scaled scores before the masked softmax, in the compute
            dtype; or None. It keeps the call off the fused path (the planner's
            ``bias``) and is differentiable on the explicit and blockwise paths.
        kv_heads_first: ``key`` and ``value`` come heads first, ``(B, Hkv, Tk, D)`` and
            ``(B, Hkv, Tk, Dv)`` (a KV cache's layout): the explicit path contracts them
            where they are; the other paths move them to ``(B, Tk, Hkv, D)`` first.
        kv_finite: the caller vouches that ``key`` and ``value`` hold no NaN or infinity
            (a checked KV cache): the explicit path then runs unscreened (it gives the
            rows of a non-finite query NaN by itself); the fused kernel's screen covers
            the query alone.
        softcap: a positive float ``c``: the scaled scores ``s`` become ``c * tanh(s / c)``
            before the bias and the mask (Gemma 2's ``attn_logit_softcapping``), in the
            compute dtype; None (default): unchanged. It keeps the call on the explicit
            path (the planner's ``softcap``).

    Returns:
        ``(B, Tq, H, Dv)``, and the weights ``(B, H, Tq, Tk)`` when ``return_weights``.
        Half-precision inputs are computed in float32; results are cast back. With no
        queries or no keys (a static length 0) both are zeros wherever they have entries.
    """
    if 0 in (shape_of(query)[1], shape_of(key)[1 + kv_heads_first]):
        specs = ("bqhd,bhkd->bhqk", "bhqk,bhke->bqhe") if kv_heads_first else _EMPTY_SPECS
        out, weights = _without_rows(ops, query, key, value, 1 if kv_heads_first else 2, specs)
        return (out, weights) if return_weights else out
    dtype = ops.dtype_name(query)
    if dtype in HALF_DTYPES:
        query, key, value = (ops.cast(t, "float32") for t in (query, key, value))
    if keep is not None:
        for _ in range(4 - len(shape_of(keep))):
            keep = ops.expand_dims(keep, 0)
    if bias is not None:
        bias = _rank4(ops, ops.cast(bias, ops.dtype_name(query)))
    wanted = (bool(return_weights), dropout > 0.0 and bool(training))
    spec = _spec(
        ops, (query, key, value), keep, valid_lens, causal, dtype, block_size, wanted,
        kv_heads_first,
    )  # fmt: skip
    spec = dataclasses.replace(spec, bias=bias is not None, softcap=softcap is not None)
    spec = _choices(ops, spec, (query, key, value), kv_heads_first)
    how = plan.plan_attention(spec)
    sizes = tuple(
        s if s is not None else ops.shape(t)[axis]
        for s, t, axis in ((spec.queries, query, 1), (spec.keys, key, 1 + kv_heads_first))
    )
    causal = spec.effective_causal
    lens4 = lens_rank4(ops, valid_lens)
    if how.path != "blockwise":
        if how.fold_masks:
            keep = block_keep(ops, keep, lens4, how.causal == "mask", sizes)
            lens4 = None
            if keep is not None:
                keep = _rank4(ops, keep)
        causal = how.causal in ("kernel", "blocks")
    drop = _Dropout(dropout, seed) if how.dropout else None

    def run(q: Any, k: Any, v: Any, scores: list | None = None) -> tuple:
        """``(out,)`` or ``(out, weights)`` of the planned path on ``q, k, v``."""
        heads_first = kv_heads_first and how.path == "explicit"
        k, v = _seq_major(ops, k, v, kv_heads_first and not heads_first)
        if how.path == "blockwise":
            return (_blockwise(ops, q, k, v, keep, valid_lens, how, scale, bias),)
        out, weights = _direct_attention(
            ops, q, k, v, keep, how, scale, drop, bias, scores, heads_first, softcap
        )
        return (out,) if weights is None else (out, weights)

    inputs = (query, key, value)
    screen = how.screen
    if kv_finite:  # the keys and values need no screen; only a fused kernel the query's
        screen = "none" if how.path == "explicit" or screen == "none" else "query"
    if screen == "none":
        results = run(*inputs)
    else:
        # NaN and infinities must not meet a masked position in a product (0 * NaN is
        # NaN), forward or backward, nor reach a fused kernel (which may zero a row with
        # a NaN query): if there are any, the attention runs on the inputs with them
        # replaced by 0, and `_poison_rows` gives NaN to the rows that attend them.
        def exact(results: tuple) -> tuple:
            return _poison_rows(ops, results, inputs, keep, lens4, causal, sizes, kv_heads_first)

        if _screens_scores(how, spec):
            scores: list = []
            fast = run(*inputs, scores)
            finite = all_finite(ops, (query, scores[0], fast[0]))
            results = ops.cond(
                finite, lambda: fast, lambda: exact(run(*_replace_non_finite(ops, inputs)))
            )
        else:
            finite = all_finite(ops, inputs if screen == "all" else (query,))
            q, k, v = ops.cond(finite, lambda: inputs, lambda: _replace_non_finite(ops, inputs))
            computed = run(q, k, v)
            results = ops.cond(finite, lambda: computed, lambda: exact(computed))
    out, weights = results if len(results) == 2 else (results[0], None)
    if dtype in HALF_DTYPES:
        out = ops.cast(out, dtype)
        weights = None if weights is None else ops.cast(weights, dtype)
    return (out, weights) if return_weights else out


def _spec(
    ops: Any,
    inputs: tuple,
    keep: Any,
    valid_lens: Any,
    causal: bool,
    dtype: str,
    block_size: tuple[int, int] | None,
    wanted: tuple[bool, bool],
    kv_heads_first: bool = False,
) -> plan.AttentionSpec:
    """The static facts of a call of `attend`: ``inputs`` (query, key, value) in the
    compute dtype, ``keep`` rank 4 or None, ``dtype`` the callers' dtype, ``wanted`` the
    weights and active dropout."""
    query, key, value = inputs
    batch, queries, heads = shape_of(query)[:3]
    keys, kv_heads = shape_of(key)[1], shape_of(key)[2]
    if kv_heads_first:
        keys, kv_heads = kv_heads, keys
    lengths = "none"
    if valid_lens is not None:
        lengths = "per_sequence" if len(shape_of(valid_lens)) == 1 else "per_query"
    return plan.AttentionSpec(
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        queries=queries,
        keys=keys,
        key_width=shape_of(key)[-1],
        value_width=shape_of(value)[-1],
        dtype=dtype,
        capabilities=plan.Capabilities.of(ops),
        memory_budget=config.get_attention_memory_budget(),
        mask=keep is not None,
        lengths=lengths,
        causal=bool(causal),
        weights=wanted[0],
        dropout=wanted[1],
        traced=bool(ops.is_symbolic(query)),
        block_size=block_size if block_size is not None else config.get_block_size(),
    )


def _seq_major(ops: Any, key: Any, value: Any, heads_first: bool) -> tuple[Any, Any]:
    """``key`` and ``value`` as ``(B, Tk, Hkv, D)``: moved there when ``heads_first``."""
    if not heads_first:
        return key, value
    return ops.transpose(key, (0, 2, 1, 3)), ops.transpose(value, (0, 2, 1, 3))


def _rank4(ops: Any, x: Any) -> Any:
    """``x`` with leading unit axes up to rank 4."""
    for _ in range(4 - len(shape_of(x))):
        x = ops.expand_dims(x, 0)
    return x


def _screens_scores(how: plan.AttentionPlan, spec: plan.AttentionSpec) -> bool:
    """Whether the screen for NaN and infinities runs after the explicit path, on its
    query, scores and output, rather than before it on the query, keys and values.

    Exact either way: with a finite query, a non-finite entry in key row ``j`` makes score
    ``j`` of every query non-finite (``0 * inf`` is NaN), before any mask or bias; with
    finite weights, a non-finite entry in value row ``j`` makes the output of every row
    that is not fully masked non-finite (a masked weight of 0 times it is NaN), and a
    fully masked row's output is 0 whatever the values hold. Taken when the scores and
    output, ``B*H*Tq*(Tk + Dv)`` entries, are fewer than the keys and values,
    ``B*Tk*Hkv*(D + Dv)``: a decoding step through a long cache sums a row of scores
    instead of the whole cache. Not with dropout (the exact branch would draw again), and
    only in eager calls, where ``cond`` runs one branch: in a traced call (``jax.jit``,
    ``tf.function``, a recording) the gradient of the discarded fast result still flows
    back through its products, and a zero cotangent times a non-finite key is NaN (the
    query's and keys' gradients came out NaN under ``jax.jit(jax.grad(...))``); the
    screen before the path replaces those entries first, which is exact there too."""
    sizes = (spec.heads, spec.kv_heads, spec.queries, spec.keys, spec.key_width, spec.value_width)
    if how.path != "explicit" or how.dropout or spec.traced or None in sizes:
        return False
    heads, kv_heads, queries, keys, width, value_width = sizes
    return heads * queries * (keys + value_width) < keys * kv_heads * (width + value_width)


def all_finite(ops: Any, tensors: tuple) -> Any:
    """A scalar bool: True when every entry of ``tensors`` is finite, and usually False
    otherwise. One sum per tensor (NaN and infinities survive a sum): much cheaper than
    testing every entry. A sum of finite entries can overflow too; the caller then takes
    its exact (slower) path needlessly, never wrongly."""
    total = None
    for t in tensors:
        part = ops.sum(t)
        total = part if total is None else total + part
    return ops.isfinite(total)


def _replace_non_finite(ops: Any, tensors: tuple) -> tuple:
    """``tensors`` with every NaN or infinite entry replaced by 0 (a select: those
    entries get zero gradient)."""
    return tuple(ops.where(ops.isfinite(t), t, 0.0) for t in tensors)


def _poison_rows(
    ops: Any,
    results: tuple,
    inputs: tuple,
    keep: Any,
    lens: Any,
    causal: bool,
    sizes: tuple,
    kv_heads_first: bool = False,
) -> tuple:
    """The results of attention computed on `_replace_non_finite` of ``inputs`` (query,
    key, value ``(B, T, H, D)``, the key/value heads possibly grouped, or with
    ``kv_heads_first`` key and value ``(B, H, T, D)``), with NaN on the
    rows that may attend a position (key or value) holding a NaN or an infinity, or whose
    own query holds one and that may attend anything. ``results`` is ``(out,)`` (``(B,
    Tq, H, Dv)``) or ``(out, weights)`` (``(B, H, Tq, Tk)``); the weights get NaN on the
    rows that attend a non-finite key or have a non-finite query (a non-finite value does
    not change them).

    Every other row is exactly what it would be with the non-finite entries absent: the
    positions it may not attend have no effect on it, nor on any gradient (the replaced
    entries and the NaN rows pass no gradient).
    """

    query, key, value = inputs
    heads = shape_of(query)[2]

    def bad_rows(t: Any, heads_first: bool) -> Any:
        """(B, T, H|H_kv, D) or heads first -> (B, H, T): the row holds a non-finite entry."""
        bad = ops.any(ops.logical_not(ops.isfinite(t)), axis=-1, keepdims=True)
        if heads_first:
            bad = ops.transpose(bad, (0, 2, 1, 3))  # the flags moved, not the keys
        bad = repeat_kv_heads(ops, bad, heads // shape_of(bad)[2])  # grouped heads: a bool each
        return ops.transpose(bad[..., 0], (0, 2, 1))

    poisoned = ops.expand_dims(bad_rows(query, False), 3)  # (B, H, Tq, 1)
    attends_any = rows_attending(ops, keep, lens, causal, sizes, None)
    if attends_any is not None:
        poisoned = ops.logical_and(poisoned, attends_any)
    for i, t in enumerate((key, value)):
        bad_keys = ops.expand_dims(bad_rows(t, kv_heads_first), 2)  # (B, H, 1, Tk)
        poisoned = ops.logical_or(
            poisoned, rows_attending(ops, keep, lens, causal, sizes, bad_keys)
        )
        if i == 0 and len(results) == 2:
            weights = ops.where(poisoned, float("nan"), results[1])
    out = ops.where(ops.transpose(poisoned, (0, 2, 1, 3)), float("nan"), results[0])
    return (out,) if len(results) == 1 else (out, weights)


def _choices(
    ops: Any, spec: plan.AttentionSpec, qkv: tuple, kv_heads_first: bool
) -> plan.AttentionSpec:
    """``spec`` with the choices that are not static facts: ``settings(fused_attention=)``
    forces the fused kernel or the explicit path; the tuner in force
    (`multiattn.config.tuner`: ``settings(autotune=...)``, or decisions this process
    holds) fills in the rest; with none, the slices of the batch take
    `multiattn.ops.plan.default_chunks` and every other choice its plan default."""
    forced = config.get_fused_attention()
    if forced is not None:
        spec = dataclasses.replace(spec, fused_faster=forced)
    tuner = config.tuner()
    if tuner is not None:
        return tuner.attention(ops, spec, *qkv, kv_heads_first)
    return plan.with_default_chunks(spec, ops.xla_device(qkv[0]))


def explicit_unmasked(
    ops: Any, query: Any, key: Any, value: Any, scale: float, kv_heads_first: bool = False
) -> Any:
    """The explicit path without a mask: the candidate `multiattn.tuning` times against
    the fused kernel and over slices of the batch."""
    return _explicit_attention(
        ops, query, key, value, None, scale, 0.0, False, None, False, None, None, kv_heads_first
    )[0]


class _Dropout(NamedTuple):
    """Active dropout on the weights: the rate and the seed."""

    rate: float
    seed: Any


def _own_backward(
    ops: Any, query: Any, key: Any, value: Any, keep: Any, scale: float, chunks: int,
    kv_heads_first: bool, backward: str,
) -> Any:  # fmt: skip
    """The explicit path without weights, dropout or bias, differentiated by its own
    backward pass (`multiattn.ops.explicit_grad`) over ``chunks`` slices of the batch:
    the weights recomputed from each row's log-sum-exp (``backward="recompute"``) or
    saved by the forward pass (``"saved"``)."""
    saves = backward == "saved"

    def forward(q: Any, k: Any, v: Any, keep: Any) -> tuple[Any, Any]:
        kept: list = []  # (weights, lse); the compilers drop the one not returned
        out = _explicit_attention(
            ops, q, k, v, keep, scale, 0.0, False, None, False, None, None, kv_heads_first, kept
        )[0]
        return out, kept[0] if saves else kept[1]

    return explicit_grad.attention(
        ops, query, key, value, keep, scale, forward, chunks, kv_heads_first, saves
    )


def own_backward_unmasked(
    ops: Any, query: Any, key: Any, value: Any, scale: float, chunks: int,
    kv_heads_first: bool, backward: str,
) -> Any:  # fmt: skip
    """`_own_backward` without a mask (a candidate of `multiattn.tuning.attention_backward`)."""
    return _own_backward(ops, query, key, value, None, scale, chunks, kv_heads_first, backward)


def _direct_attention(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    keep: Any,
    how: plan.AttentionPlan,
    scale: float,
    drop: _Dropout | None = None,
    bias: Any = None,
    scores: list | None = None,
    kv_heads_first: bool = False,
    softcap: float | None = None,
) -> tuple[Any, Any]:
    """The fused or the explicit path of ``how``: the whole ``(B, H, Tq, Tk)`` score
    matrix at once (unless the backend's fused kernel streams), or on the explicit path
    ``how.chunks`` slices of the batch in turn (`Namespace.map_batch`; not where
    ``scores`` is a list: the screen needs the whole score matrix). ``keep`` is rank 4 or
    None, with the lengths and causal mask already folded in unless ``how`` leaves the
    causal mask to the kernel. Returns the output and the weights (None unless
    ``how.weights``); the explicit path appends its scores, before bias and mask, to
    ``scores`` when it is a list."""
    if how.path == "fused":
        return _fused_attention(ops, query, key, value, keep, how, scale), None
    if how.backward != "autodiff" and scores is None:
        out = _own_backward(
            ops, query, key, value, keep, scale, how.chunks, kv_heads_first, how.backward
        )
        return out, None
    if how.chunks > 1 and scores is None:

        def piece(q: Any, k: Any, v: Any, keep: Any, bias: Any) -> Any:
            return _explicit_attention(
                ops, q, k, v, keep, scale, 0.0, False, None, False, bias, None, kv_heads_first
            )[0]

        return ops.map_batch(piece, (query, key, value, keep, bias), how.chunks), None
    rate, seed = drop if drop is not None else (0.0, None)
    return _explicit_attention(
        ops, query, key, value, keep, scale, rate, drop is not None, seed, how.weights, bias,
        scores, kv_heads_first, softcap=softcap,
    )  # fmt: skip


def _fused_attention(
    ops: Any, query: Any, key: Any, value: Any, keep: Any, how: plan.AttentionPlan, scale: float
) -> Any:
    """The backend's fused kernel (``how.path == "fused"``): key/value heads repeated
    when ``how.repeat_kv``; with a mask, rows with nothing to attend attend everywhere
    inside the kernel (finite values, finite gradients) and are zeroed afterwards."""
    if how.repeat_kv:
        groups = shape_of(query)[2] // shape_of(key)[2]
        key, value = (repeat_kv_heads(ops, t, groups) for t in (key, value))
    if keep is None:
        return ops.fused_attention(query, key, value, None, scale, is_causal=how.causal == "kernel")
    row_any = ops.any(keep, axis=-1, keepdims=True)  # (B|1, H|1, Tq, 1)
    out = ops.fused_attention(
        query, key, value, ops.logical_or(keep, ops.logical_not(row_any)), scale
    )
    return ops.where(ops.transpose(row_any, (0, 2, 1, 3)), out, 0.0)


def _blockwise(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    keep: Any,
    valid_lens: Any,
    how: plan.AttentionPlan,
    scale: float,
    bias: Any = None,
) -> Any:
    """The blockwise path of ``how`` (linear memory, its own backward pass); the key/value
    heads are repeated for their groups (``how.repeat_kv``)."""
    groups = shape_of(query)[2] // shape_of(key)[2] if how.repeat_kv else 1
    return blockwise_grad.attention(
        ops,
        query,
        repeat_kv_heads(ops, key, groups),
        repeat_kv_heads(ops, value, groups),
        keep=keep,
        valid_lens=valid_lens,
        causal=how.causal == "blocks",
        scale=scale,
        blocks=how.blocks,
        bias=bias,
    )


def _explicit_attention(
    ops, query, key, value, keep, scale, dropout, training, seed, return_weights, bias=None,
    raw_scores=None, kv_heads_first=False, kept=None, softcap=None,
):  # fmt: skip
    """Scores, masked softmax and weighted sum, in head-major layout; returns the output
    and, with ``return_weights``, the weights (else None).

    The queries are scaled before the product (``B*Tq*H*D`` multiplications instead of
    ``B*H*Tq*Tk`` on the scores), and the three inputs are moved to ``(B, H, T, D)`` so
    that both products are plain batched matrix products (no layout change inside the
    contraction, none on the score matrix). Measured on TensorFlow under ``tf.function``
    (multi-head self-attention, batch 8, length 512, width 512, 8 heads, float32) this
    is 6% to 13% faster forward and forward+backward than the scores contracted in
    ``(B, T, H, D)`` layout and scaled afterwards.

    Without ``return_weights``, rows with nothing to attend are zeroed in the output
    ``(B, Tq, H, Dv)`` rather than in the weights (a select over the outputs instead of
    one over the score matrix): the weights of the other rows are exactly those of
    `multiattn.ops.masking.softmax_where` either way.

    With grouped key/value heads (``H_kv`` dividing ``H``, ``G = H / H_kv``) the queries
    of a group are stacked, ``(B, H_kv, G * Tq, D)``, and contracted with the group's
    key/value head ``(B, H_kv, Tk, D)``: no key or value is repeated, and the scores and
    weights come out ``(B, H, Tq, Tk)`` as without groups.

    ``raw_scores``, a list, receives the scores ``(B, H, Tq, Tk)`` before bias and mask
    (for `_screens_scores`). With ``kv_heads_first``, ``key`` and ``value`` are already
    ``(B, H_kv, Tk, D)`` and are contracted where they are (a KV cache, read in place).
    ``kept``, a list (without weights or dropout), receives the weights ``(B, H, Tq, Tk)``
    (those of a row with nothing to keep uniform: its output is zeroed) and the log of
    each row's softmax denominator ``(B, H, Tq, 1)`` (`multiattn.ops.masking.softmax_lse`),
    for the backward pass of `multiattn.ops.explicit_grad`. ``softcap`` ``c`` (a float,
    or None) replaces the scaled scores ``s`` by ``c * tanh(s / c)`` before the bias and
    the mask (``raw_scores`` receives them before).
    """
    q = ops.transpose(query * scale, (0, 2, 1, 3))
    k, v = key, value
    if not kv_heads_first:
        k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in (key, value))
    heads, kv_heads = shape_of(q)[1], shape_of(k)[1]
    if heads == kv_heads:
        scores = _score_product(ops, q, k, kv_heads_first)
    else:
        b, tq, tk = (_size(ops, t, axis) for t, axis in ((q, 0), (q, 2), (k, 2)))
        q = ops.reshape(q, (b, kv_heads, (heads // kv_heads) * tq, shape_of(q)[3]))
        scores = ops.reshape(_score_product(ops, q, k, kv_heads_first), (b, heads, tq, tk))
    if raw_scores is not None:
        raw_scores.append(scores)
    if softcap is not None:
        scores = ops.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    if kept is not None:
        weights, log_total = softmax_lse(ops, scores, keep)
        kept.extend((weights, log_total))
    else:
        weights = softmax_where(ops, scores, keep, zero_empty_rows=return_weights)
    mixed = _apply_dropout(ops, weights, dropout, training, seed)
    if heads == kv_heads:
        out = ops.einsum("bhqk,bhkd->bhqd", mixed, v)
    else:
        mixed = ops.reshape(mixed, (b, kv_heads, (heads // kv_heads) * tq, tk))
        out = ops.reshape(ops.einsum("bhqk,bhkd->bhqd", mixed, v), (b, heads, tq, shape_of(v)[3]))
    out = ops.transpose(out, (0, 2, 1, 3))
    if return_weights:
        return out, weights
    if keep is not None:
        row_any = ops.any(keep, axis=-1, keepdims=True)  # (B|1, H|1, Tq, 1)
        out = ops.where(ops.transpose(row_any, (0, 2, 1, 3)), out, 0.0)
    return out, None


def _score_product(ops: Any, q: Any, k: Any, cached: bool) -> Any:
    """The scores ``(B, H, R, Tk)`` of queries ``q`` ``(B, H, R, D)`` against keys ``k``
    ``(B, H, Tk, D)``.

    For a cache's keys (``cached``) and few query rows (``R <= D / 4``: a decoding step,
    whose rows are the one query times the heads of its key/value group) the product is
    taken keys first, ``k @ q^T``, and its small ``(Tk, R)`` result transposed (for one
    row a mere reshape). XLA:CPU in TensorFlow moves the right operand of a product to
    contraction-first layout, which for ``q @ k^T`` meant a transposed copy of every key
    cache in every step: slower per token (GPT-2 shape, batch 1, prompts 128 and 512),
    while jax's per-token times were the same either way (measured: docs/benchmarks.md,
    'Measurements behind the defaults')."""
    rows, dim = shape_of(q)[2], shape_of(q)[3]
    if cached and rows is not None and dim is not None and 4 * rows <= dim:
        return ops.transpose(ops.einsum("bhkd,bhqd->bhkq", k, q), (0, 1, 3, 2))
    return ops.einsum("bhqd,bhkd->bhqk", q, k)


def _check_qkv(
    where: str, ops: Any, query: Any, key: Any, value: Any
) -> tuple[tuple, tuple, tuple]:
    dtypes = [
        check_float(where, n, t, ops) for n, t in (("query", query), ("key", key), ("value", value))
    ]
    if len(set(dtypes)) != 1:
        raise TypeError(
            f"{where}: `query`, `key` and `value` must share a dtype; received "
            f"{dtypes[0]}, {dtypes[1]} and {dtypes[2]}."
        )
    qs, ks, vs = shape_of(query), shape_of(key), shape_of(value)
    for name, s in (("query", qs), ("key", ks), ("value", vs)):
        check_rank(where, name, s, 2)
    if not len(qs) == len(ks) == len(vs):
        raise ValueError(
            f"{where}: `query`, `key` and `value` must have the same rank; received shapes "
            f"{fmt_shape(qs)}, {fmt_shape(ks)} and {fmt_shape(vs)}."
        )
    if not dims_match(qs[-1], ks[-1]):
        raise ValueError(
            f"{where}: `query` and `key` must have the same last dimension; received "
            f"query {fmt_shape(qs)} and key {fmt_shape(ks)}."
        )
    if not dims_match(ks[-2], vs[-2]):
        raise ValueError(
            f"{where}: `key` and `value` must have the same number of positions (axis -2); "
            f"received key {fmt_shape(ks)} and value {fmt_shape(vs)}."
        )
    heads_axis = len(qs) - 3  # the axis -3 of rank >= 3 inputs: heads (grouped allowed)
    for i, dims in enumerate(zip(qs[:-2], ks[:-2], vs[:-2])):
        known = {d for d in dims if d is not None}
        if len(known) <= 1:
            continue
        if i == heads_axis:
            if not dims_match(ks[i], vs[i]):
                raise ValueError(
                    f"{where}: `key` and `value` must have the same number of heads (axis "
                    f"-3); received key {fmt_shape(ks)} and value {fmt_shape(vs)}."
                )
            kv_heads = ks[i] if ks[i] is not None else vs[i]
            if qs[i] is None or kv_heads > qs[i] or qs[i] % kv_heads:
                raise ValueError(
                    f"{where}: the number of heads of `key` and `value` (axis -3) must divide "
                    f"that of `query` (grouped-query attention); received query "
                    f"{fmt_shape(qs)}, key {fmt_shape(ks)} and value {fmt_shape(vs)}."
                )
            continue
        raise ValueError(
            f"{where}: leading axis {i} differs between query {fmt_shape(qs)}, key "
            f"{fmt_shape(ks)} and value {fmt_shape(vs)}."
        )
    return qs, ks, vs


def _heads_last(ops: Any, x: Any, shape: tuple) -> Any:
    """``(..., H, T, d)`` -> ``(L, T, H, d)`` with ``L`` the product of the axes before
    the heads (1 for rank 3)."""
    if len(shape) == 3:
        x = ops.expand_dims(x, 0)
    elif len(shape) > 4:
        dyn = ops.shape(x)
        x = ops.reshape(x, (-1, *dyn[-3:]))
    return ops.transpose(x, (0, 2, 1, 3))


def _keep_to_heads(ops: Any, keep: Any, lead: tuple) -> Any:
    """Mask broadcastable to ``(*outer, H, Tq, Tk)`` (``lead = (*outer, H)``) ->
    broadcastable to ``(L, H, Tq, Tk)``."""
    for _ in range(len(lead) + 2 - len(shape_of(keep))):
        keep = ops.expand_dims(keep, 0)
    ks = shape_of(keep)
    if all(d == 1 for d in ks[:-3]):
        return ops.reshape(keep, (1, *ks[-3:]))
    full = tuple(d if d is not None else -1 for d in lead[:-1])
    keep = ops.broadcast_to(keep, (*full, *ks[-3:]))
    return ops.reshape(keep, (-1, *ks[-3:]))


def _to_flat_heads(ops: Any, x: Any, shape: tuple) -> Any:
    """``(..., T, d)`` -> ``(L, T, 1, d)`` with ``L`` the product of the leading axes."""
    if len(shape) == 2:
        return ops.expand_dims(ops.expand_dims(x, 0), 2)
    if len(shape) > 3:
        dyn = ops.shape(x)
        x = ops.reshape(x, (-1, dyn[-2], dyn[-1]))
    return ops.expand_dims(x, 2)


def _keep_to_flat(ops: Any, keep: Any, lead: tuple, q: int | None, k: int | None) -> Any:
    """Mask broadcastable to ``(*lead, Tq, Tk)`` -> broadcastable to ``(L, 1, Tq, Tk)``."""
    for _ in range(2 - len(shape_of(keep))):  # a mask of rank 0 or 1 (broadcasts over rows)
        keep = ops.expand_dims(keep, 0)
    ks = shape_of(keep)
    klead = ks[:-2]
    if all(d == 1 for d in klead):
        return ops.reshape(keep, (1, 1, ks[-2], ks[-1]))
    full = tuple(d if d is not None else -1 for d in lead)
    keep = ops.broadcast_to(keep, (*full, ks[-2], ks[-1]))
    return ops.reshape(keep, (-1, 1, ks[-2], ks[-1]))


def _lens_to_flat(ops: Any, lens: Any, dims: Any, lead: tuple, q: int | None) -> Any:
    """Lengths for scores ``(*lead, Tq, Tk)`` -> lengths ``(L,)`` or ``(L, Tq)`` of the
    flattened batch ``L`` (repeated over the axes after the first); ``dims`` are the
    sizes of the ``lead`` axes (dynamic where unknown)."""
    per_query = len(shape_of(lens)) == 2
    if not lead:  # scores (Tq, Tk): the lengths are one per query
        return ops.reshape(lens, (1, -1))
    if len(lead) == 1:
        return lens
    tail = (q,) if per_query else ()
    lens = ops.reshape(lens, (-1, *(1,) * (len(lead) - 1), *tail))
    lens = ops.broadcast_to(lens, (*dims, *tail))
    return ops.reshape(lens, (-1, *tail))


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    valid_lens: Any = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
    seed: Any = None,
    return_weights: bool = False,
    block_size: int | tuple[int, int] | None = None,
    bias: Any = None,
) -> Any:
    """Scaled dot-product attention ``softmax(scale * q k^T + bias) v`` with masking.

    Args:
        query: ``(..., queries, d)``, floating.
        key: ``(..., keys, d)``, same dtype and rank as ``query``.
        value: ``(..., keys, d_v)``; ``d_v`` may differ from ``d``. The leading axes
            ``...`` of the three inputs are equal, except that with rank >= 3 the axis -3
            is the heads axis and ``key`` and ``value`` may have fewer heads than
            ``query`` (grouped-query attention, as ``enable_gqa`` of torch's SDPA): with
            ``query`` ``(..., H, queries, d)`` and ``key``/``value`` ``(..., H_kv, keys,
            d)``, ``H_kv`` dividing ``H``, query head ``h`` attends key/value head
            ``h // (H / H_kv)``. A count that does not divide raises ``ValueError``.
        mask: bool (True = may attend) or integer (non-zero = may attend), broadcastable
            to the scores ``(..., queries, keys)`` (with grouped heads: ``(..., H,
            queries, keys)``).
        valid_lens: ``(batch,)`` or ``(batch, queries)`` lengths; keys at positions
            ``>= length`` are masked. ``batch`` is the first axis (the heads axis for
            rank-3 inputs).
        causal: mask future keys, aligned bottom-right (query ``i`` sees keys
            ``j <= i + keys - queries``), so the last query always sees every key.
        scale: multiplier of the dot products, default ``1/sqrt(d)``.
        dropout: drop probability applied to the weights when ``training`` is True.
        training: whether dropout is active: a bool (Python or NumPy; None means False).
            Anything else (``"False"``, ``2``) raises ``TypeError``.
        seed: None, an int or a ``keras.random.SeedGenerator`` for dropout (on JAX also
            a ``jax.Array`` key); anything else raises ``TypeError``.
        return_weights: also return the attention weights (a bool, as ``training``).
        block_size: force the memory-efficient blockwise path (blocks of queries and
            keys with an online softmax) with blocks of this many queries and keys: an
            int, or a pair ``(queries, keys)``. None (default): that path is taken when
            the score matrix (``batch * heads * queries * keys`` elements of the compute
            dtype) would exceed the memory budget of `multiattn.config` (1 GiB by
            default), unless a `multiattn.config.settings` block gives a block size.
            The blockwise path is never taken when ``return_weights`` is set or dropout
            is active (both need the whole weight matrix): the direct path is used then, whatever ``block_size`` or the budget say.
        bias: additive attention bias: a floating tensor broadcastable to the scores
            ``(..., queries, keys)`` (as ``mask``), added to the scaled scores before the
            masked softmax (relative position biases, ALiBi). It is cast to the compute
            dtype (float32 for half precision). It is not a mask: masked positions stay
            masked whatever it holds, and it should be finite where a row may attend (use
            ``mask`` to exclude keys). A bias keeps the call off the fused kernel (the
            explicit or blockwise path runs). It is differentiable on every path (on the
            blockwise path through its own backward pass; the gradient has the bias'
            shape). Integer or bool dtypes raise ``TypeError``, a shape that does not
            broadcast ``ValueError``, both naming ``bias``.

    Returns:
        Output ``(..., queries, d_v)`` in the inputs' dtype (the leading axes of
        ``query``), and with ``return_weights`` the weights ``(..., queries, keys)``. A
        query with no key to attend gets zero weights and a zero output row (so with no
        keys at all, length 0, the output is zeros; with no queries it is empty). float16/
        bfloat16 inputs are computed in float32 and the results cast back. Every path
        (fused, explicit, blockwise) gives the same results within rounding.

        A position a query may not attend has no effect on its output, its weights or
        any gradient, whatever the key or value holds there (NaN, ``inf``, ``1e30``;
        padding, unwritten cache slots). A query that may attend a key or value holding
        NaN or an infinity, or whose own entries hold one, is not protected: with a mask
        (or on the fused path) its output row is NaN (its weights too if the key or the
        query is not finite); without a mask it is what the arithmetic gives. A row with
        nothing to attend stays zero. See "Masked positions" in ``docs/masks.md``.
    """
    training, return_weights, seed = check_call_flags(
        "scaled_dot_product_attention",
        training=training,
        return_weights=return_weights,
        seed=seed,
        query=query,
        scale=scale,
    )
    where = "scaled_dot_product_attention"
    ops = get_ops(
        query,
        key,
        value,
        mask,
        valid_lens,
        bias,
        names=("query", "key", "value", "mask", "valid_lens", "bias"),
        where=where,
    )
    query, key, value = as_array(query), as_array(key), as_array(value)
    qs, ks, vs = _check_qkv(where, ops, query, key, value)
    scale = check_scale(where, scale)
    dropout = check_rate(where, "dropout", dropout)
    lead = tuple(
        next((d for d in dims if d is not None), None) for dims in zip(qs[:-2], ks[:-2], vs[:-2])
    )
    grouped = len(qs) >= 3 and None not in (qs[-3], ks[-3]) and qs[-3] != ks[-3]
    if grouped:
        lead = (*lead[:-1], qs[-3])
    if scale is None:
        if qs[-1] is None:
            raise ValueError(
                f"{where}: the query width must be static to derive the default scale."
            )
        scale = 1.0 / math.sqrt(qs[-1])
    blocks = blockwise.check_block_size(where, block_size)
    keep, lens, causal = split_masks(
        ops, (*lead, qs[-2], ks[-2]), mask=mask, valid_lens=valid_lens, causal=causal, where=where
    )
    if bias is not None:
        bias = check_bias(ops, bias, (*lead, qs[-2], ks[-2]), where)
        bias = _keep_to_heads(ops, bias, lead) if grouped else _keep_to_flat(ops, bias, lead, 0, 0)
    if 0 in (qs[-2], ks[-2]):
        specs = ("...qd,...kd->...qk", "...qk,...ke->...qe")
        out, weights = _without_rows(ops, query, key, value, -3 if grouped else None, specs)
        return (out, weights) if return_weights else out
    if grouped:
        # (..., H, T, d) -> (L, T, H, d): `attend` repeats each key/value head for its group.
        if keep is not None:
            keep = _keep_to_heads(ops, keep, lead)
        if lens is not None and len(lead) == 1:
            # rank 3: the lengths' batch axis is the heads axis, one mask per head
            per_query = len(shape_of(lens)) == 2
            lens = ops.reshape(lens, (1, -1, qs[-2] if per_query else 1, 1))
            by_lens = ops.less(ops.arange(ks[-2], dtype="int32"), lens)
            keep = by_lens if keep is None else ops.logical_and(keep, by_lens)
            lens = None
        elif lens is not None:
            lens = _lens_to_flat(ops, lens, ops.shape(query)[:-3], lead[:-1], qs[-2])
        q4, k4, v4 = (_heads_last(ops, t, s) for t, s in ((query, qs), (key, ks), (value, vs)))
    else:
        if keep is not None:
            keep = _keep_to_flat(ops, keep, lead, qs[-2], ks[-2])
        if lens is not None:
            lens = _lens_to_flat(ops, lens, ops.shape(query)[:-2], lead, qs[-2])
        q4, k4, v4 = (_to_flat_heads(ops, t, s) for t, s in ((query, qs), (key, ks), (value, vs)))
    result = attend(
        ops,
        q4,
        k4,
        v4,
        keep=keep,
        valid_lens=lens,
        causal=causal,
        scale=scale,
        dropout=dropout,
        training=training,
        seed=seed,
        return_weights=return_weights,
        block_size=blocks,
        bias=bias,
    )
    out, weights = result if return_weights else (result, None)
    if grouped:
        out = ops.transpose(out, (0, 2, 1, 3))  # (L, H, Tq, d_v)
    out_shape = (*ops.shape(query)[:-1], ops.shape(value)[-1])
    out = ops.reshape(out, out_shape)
    if not return_weights:
        return out
    weights = ops.reshape(weights, (*ops.shape(query)[:-1], ops.shape(key)[-2]))
    return out, weights


#: `_without_rows`' products for `attend`'s layout: queries ``(B, Tq, H, D)``, keys and
#: values ``(B, Tk, H, D)``, weights ``(B, H, Tq, Tk)``, output ``(B, Tq, H, Dv)``.
_EMPTY_SPECS = ("bqhd,bkhd->bhqk", "bhqk,bkhe->bqhe")


def _without_rows(
    ops: Any, query: Any, key: Any, value: Any, heads_axis: int | None, specs: tuple[str, str]
) -> tuple:
    """Attention with no queries or no keys (a static length 0): the output and the
    weights, zeros wherever they have entries (with no key, every query has nothing to
    attend). They are the einsum products ``specs`` (scores, then output) of the inputs:
    the scores have no entries, and the output contracts them over the keys (zeros where
    there are queries), so both stay connected to the inputs for gradients (zeros) and
    no softmax reduces over an empty axis. Grouped key
    and value heads (fewer than the queries' along ``heads_axis``) are joined up to the
    query heads first; their order is immaterial, as every entry is zero."""
    if heads_axis is not None and shape_of(key)[heads_axis] != shape_of(query)[heads_axis]:
        groups = shape_of(query)[heads_axis] // shape_of(key)[heads_axis]
        key, value = (ops.concatenate([t] * groups, axis=heads_axis) for t in (key, value))
    weights = ops.einsum(specs[0], query, key)  # no entries: Tq or Tk is 0
    return ops.einsum(specs[1], weights, value), weights


def score_attention(
    scores: Any,
    value: Any,
    *,
    mask: Any = None,
    valid_lens: Any = None,
    causal: bool = False,
    dropout: float = 0.0,
    training: bool = False,
    seed: Any = None,
    return_weights: bool = False,
) -> Any:
    """Attention from precomputed scores: ``masked_softmax(scores) @ value``.

    Use with `multiattn.ops.additive_scores` or
    `multiattn.ops.general_scores`.

    Args:
        scores: ``(..., queries, keys)``, floating.
        value: ``(..., keys, d_v)``, same dtype and rank as ``scores``.
        mask, valid_lens, causal: as in `scaled_dot_product_attention`.
        dropout, training, seed: dropout on the weights, only when ``training``.
        return_weights: also return the weights ``(..., queries, keys)``.

    Returns:
        ``(..., queries, d_v)`` (and the weights). Fully masked rows give zeros.
    """
    training, return_weights, seed = check_call_flags(
        "score_attention", training=training, return_weights=return_weights, seed=seed
    )
    where = "score_attention"
    ops = get_ops(
        scores,
        value,
        mask,
        valid_lens,
        names=("scores", "value", "mask", "valid_lens"),
        where=where,
    )
    scores, value = to_tensor(ops, as_array(scores)), to_tensor(ops, as_array(value))
    sdt = check_float(where, "scores", scores, ops)
    vdt = check_float(where, "value", value, ops)
    if sdt != vdt:
        raise TypeError(
            f"{where}: `scores` and `value` must share a dtype; received {sdt} and {vdt}."
        )
    ss, vs = shape_of(scores), shape_of(value)
    check_rank(where, "scores", ss, 2)
    if len(vs) != len(ss) or not dims_match(ss[-1], vs[-2]):
        raise ValueError(
            f"{where}: `value` must have shape (..., {ss[-1]}, d_v) with the rank of `scores` "
            f"{fmt_shape(ss)}; received {fmt_shape(vs)}."
        )
    dropout = check_rate(where, "dropout", dropout)
    keep = combine_keep(ops, ss, mask=mask, valid_lens=valid_lens, causal=causal, where=where)
    weights = softmax_where(ops, scores, keep)
    mixed = _apply_dropout(ops, weights, dropout, training, seed)
    if sdt in HALF_DTYPES:
        mixed, value = ops.cast(mixed, "float32"), ops.cast(value, "float32")
    if keep is None:
        out = ops.einsum("...qk,...kd->...qd", mixed, value)
    else:
        # A masked weight is exactly 0, but 0 * NaN is NaN: non-finite values are replaced
        # by 0 and the rows that may attend one get NaN (masked scores are selected away
        # by the softmax already).
        finite = all_finite(ops, (value,))
        clean = ops.cond(finite, lambda: value, lambda: _replace_non_finite(ops, (value,))[0])
        out = ops.einsum("...qk,...kd->...qd", mixed, clean)
        out = ops.cond(finite, lambda: out, lambda: _poison_score_rows(ops, out, value, keep))
    if sdt in HALF_DTYPES:
        out = ops.cast(out, sdt)
    return (out, weights) if return_weights else out


def _poison_score_rows(ops: Any, out: Any, value: Any, keep: Any) -> Any:
    """``out`` ``(..., Tq, Dv)`` with NaN on the rows that may attend (``keep``, bool
    broadcastable to ``(..., Tq, Tk)``) a row of ``value`` ``(..., Tk, Dv)`` holding a
    NaN or an infinity."""
    bad = ops.any(ops.logical_not(ops.isfinite(value)), axis=-1)  # (..., Tk)
    rows = ops.any(ops.logical_and(keep, ops.expand_dims(bad, -2)), axis=-1, keepdims=True)
    return ops.where(rows, float("nan"), out)

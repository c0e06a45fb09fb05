"""Gradients of the blockwise attention path in memory linear in the lengths (internal).

Differentiating `multiattn.ops.blockwise.blockwise_attention` step by step would keep
every block's scores and exponentials for the backward pass: the memory of the whole
score matrix, which the blockwise path exists to avoid. `attention` instead gives the
path a backward pass of its own (registered through the namespace's
``custom_gradient``). The forward pass keeps, per query row, only the log of the softmax
denominator (``lse``, ``(B, H, Tq, 1)``) besides the inputs and the output; the backward
pass recomputes each block's weights from it, ``P = exp(scale * q k^T - lse)``, and
accumulates, with ``dO`` the output's gradient and ``delta = rowsum(dO * O)``:

* ``dV += P^T dO``;
* ``dS = P * (dO V^T - delta)``, ``dQ += scale * dS K``, ``dK += dS^T (scale * Q)``

(the backward pass of FlashAttention, Dao et al. 2022). Two sweeps keep every carried
accumulator one block in size: one over query blocks (``dQ``), one over key blocks
(``dK``, ``dV``); each recomputes the weights of the blocks it visits. Blocks a causal
mask hides entirely are skipped, as in the forward pass. Masked entries and rows with
nothing to attend (``lse`` = +inf) get weight 0, so they receive exactly zero gradient.
"""

from __future__ import annotations

from typing import Any

from .._checks import shape_of
from . import blockwise
from .blockwise import add_bias
from .masking import (
    _dims,
    bias_block,
    block_keep,
    lens_rank4,
    looped_bias,
    looped_keep,
    sum_to_shape,
    visible_keys,
)

__all__ = ["attention"]


def attention(
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
    bias: Any = None,
) -> Any:
    """`multiattn.ops.blockwise.blockwise_attention` (same arguments and result) with the
    backward pass of this module: gradients with respect to ``query``, ``key``,
    ``value`` (in memory linear in the lengths) and ``bias`` (its shape). ``keep`` and
    ``valid_lens`` get no gradient. The gradients are those of the direct path (equal in
    exact arithmetic)."""
    tq, tk = shape_of(query)[1], shape_of(key)[1]
    bq, bk = min(blocks[0], tq), min(blocks[1], tk)
    lens = lens_rank4(ops, valid_lens)

    def forward(q: Any, k: Any, v: Any, b: Any = None) -> tuple[Any, tuple]:
        out, lse = blockwise.blockwise_attention(
            ops,
            q,
            k,
            v,
            keep=keep,
            valid_lens=valid_lens,
            causal=causal,
            scale=scale,
            blocks=(bq, bk),
            return_lse=True,
            bias=b,
        )
        return out, (q, k, v, out, lse) + (() if b is None else (b,))

    def backward(saved: tuple, d_out: Any) -> tuple:
        q, k, v, out, lse = saved[:5]
        b = saved[5] if len(saved) > 5 else None
        d_out = ops.cast(d_out, ops.dtype_name(out))
        delta = ops.sum(d_out * out, axis=-1)  # (B, Tq, H)
        delta = ops.expand_dims(ops.transpose(delta, (0, 2, 1)), 3)  # (B, H, Tq, 1)
        sweep = _Sweep(ops, q * scale, k, v, d_out, lse, delta, keep, lens, causal, (bq, bk))
        sweep.bias = b
        d_key, d_value = sweep.d_key_value()
        grads = (sweep.d_query() * scale, d_key, d_value)
        return grads if b is None else (*grads, sweep.d_bias())

    inputs = (query, key, value) if bias is None else (query, key, value, bias)
    return ops.custom_gradient(forward, backward, inputs)


def _weights(ops: Any, qs: Any, k: Any, lse: Any, keep: Any, bias: Any = None) -> Any:
    """The attention weights of one block, ``(B, H, bq, bk)``, from the scaled queries
    ``qs`` ``(B, bq, H, D)``, the keys ``k`` ``(B, bk, H, D)``, the block's ``bias`` (or
    None) and the rows' ``lse`` ``(B, H, bq, 1)``; exactly 0 outside ``keep``."""
    scores = add_bias(ops.einsum("bqhd,bkhd->bhqk", qs, k), bias)
    if keep is None:
        return ops.exp(scores - lse)
    # Masked scores are replaced before the exponential (never exp of a large positive
    # number), and the weights zeroed after it (exp(-inf) is not exactly 0 everywhere).
    return ops.where(keep, ops.exp(ops.where(keep, scores, float("-inf")) - lse), 0.0)


class _Sweep:
    """The two sweeps of the backward pass over one call's blocks."""

    def __init__(self, ops, qs, k, v, d_out, lse, delta, keep, lens, causal, blocks):
        self.ops, self.qs, self.k, self.v, self.d_out = ops, qs, k, v, d_out
        self.lse, self.delta, self.keep, self.lens, self.causal = lse, delta, keep, lens, causal
        self.tq, self.tk = shape_of(qs)[1], shape_of(k)[1]
        self.bq, self.bk = blocks
        self.offset = self.tk - self.tq  # query i sees key j iff j <= i + offset (causal)
        self.bias = None  # rank 4, broadcastable to (B, H, Tq, Tk), or None

    def _grads(self, qs, k, v, d_out, lse, delta, keep, bias=None) -> tuple[Any, Any]:
        """A block's weights ``P`` and score gradients ``dS``, both ``(B, H, bq, bk)``."""
        ops = self.ops
        probs = _weights(ops, qs, k, lse, keep, bias)
        d_probs = ops.einsum("bqhd,bkhd->bhqk", d_out, v)
        return probs, probs * (d_probs - delta)

    # --- dQ: query blocks outside, key blocks inside --------------------------------------

    def d_query(self) -> Any:
        ops, tq, tk, bq, bk = self.ops, self.tq, self.tk, self.bq, self.bk
        keep, lens = self.keep, self.lens
        kdims, vdims = _dims(ops, self.k), _dims(ops, self.v)
        parts = []
        for r0 in range(0, tq, bq):
            r1 = min(r0 + bq, tq)
            rows = (
                self.qs[:, r0:r1],
                self.d_out[:, r0:r1],
                self.lse[:, :, r0:r1],
                self.delta[:, :, r0:r1],
            )
            keep_rows = keep[:, :, r0:r1] if keep is not None and shape_of(keep)[2] != 1 else keep
            lens_rows = lens[:, :, r0:r1] if lens is not None and shape_of(lens)[2] != 1 else lens
            bias_rows = bias_block(ops, self.bias, (r0, r1))

            def step(acc, c0, c1, r0=r0, r1=r1, rows=rows, bias_rows=bias_rows):
                blk_keep = block_keep(ops, keep, lens, self.causal, (tq, tk), (r0, r1), (c0, c1))
                k_blk = self.k[:, c0:c1]
                blk_bias = bias_block(ops, bias_rows, cols=(c0, c1))
                _, d_scores = self._grads(
                    rows[0], k_blk, self.v[:, c0:c1], *rows[1:], blk_keep, blk_bias
                )
                return acc + ops.einsum("bhqk,bkhd->bqhd", d_scores, k_blk)

            def body(j, acc, rows=rows, keep_rows=keep_rows, lens_rows=lens_rows,
                     bias_rows=bias_rows):  # fmt: skip
                c0 = j * bk
                k_blk = ops.slice(self.k, (0, c0, 0, 0), (kdims[0], bk, kdims[2], kdims[3]))
                v_blk = ops.slice(self.v, (0, c0, 0, 0), (vdims[0], bk, vdims[2], vdims[3]))
                blk_keep = looped_keep(ops, keep_rows, lens_rows, c0, bk, axis=3)
                blk_bias = looped_bias(ops, bias_rows, c0, bk, axis=3)
                _, d_scores = self._grads(rows[0], k_blk, v_blk, *rows[1:], blk_keep, blk_bias)
                return acc + ops.einsum("bhqk,bkhd->bqhd", d_scores, k_blk)

            # The keys this block sees, the whole blocks below `clear` without a causal
            # mask (a block that sees none gets a zero gradient).
            stop, clear = visible_keys(r0, r1, tk, self.offset, self.causal)
            looped = clear // bk
            acc = ops.zeros_like(rows[0])
            for c0 in range(looped * bk, max(stop, 0), bk):
                acc = step(acc, c0, min(c0 + bk, tk))
            if looped:
                acc = ops.fori_loop(0, looped, body, acc)
            parts.append(acc)
        return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=1)

    # --- dK and dV: key blocks outside, query blocks inside -------------------------------

    def d_key_value(self) -> tuple[Any, Any]:
        ops, tq, tk, bq, bk = self.ops, self.tq, self.tk, self.bq, self.bk
        keep, lens = self.keep, self.lens
        qdims, odims = _dims(ops, self.qs), _dims(ops, self.d_out)
        ldims = _dims(ops, self.lse)
        d_keys, d_values = [], []
        for c0 in range(0, tk, bk):
            c1 = min(c0 + bk, tk)
            k_blk, v_blk = self.k[:, c0:c1], self.v[:, c0:c1]
            keep_cols = (
                keep[:, :, :, c0:c1] if keep is not None and shape_of(keep)[3] != 1 else keep
            )
            bias_cols = bias_block(ops, self.bias, cols=(c0, c1))

            def fold(acc, qs, d_out, lse, delta, blk_keep, blk_bias, k_blk=k_blk, v_blk=v_blk):
                probs, d_scores = self._grads(
                    qs, k_blk, v_blk, d_out, lse, delta, blk_keep, blk_bias
                )
                return (
                    acc[0] + ops.einsum("bhqk,bqhd->bkhd", d_scores, qs),
                    acc[1] + ops.einsum("bhqk,bqhd->bkhd", probs, d_out),
                )

            def step(acc, r0, r1, c0=c0, c1=c1, fold=fold, bias_cols=bias_cols):
                blk_keep = block_keep(ops, keep, lens, self.causal, (tq, tk), (r0, r1), (c0, c1))
                return fold(
                    acc,
                    self.qs[:, r0:r1],
                    self.d_out[:, r0:r1],
                    self.lse[:, :, r0:r1],
                    self.delta[:, :, r0:r1],
                    blk_keep,
                    bias_block(ops, bias_cols, (r0, r1)),
                )

            def body(i, acc, c0=c0, c1=c1, keep_cols=keep_cols, fold=fold, bias_cols=bias_cols):
                r0 = i * bq
                qs = ops.slice(self.qs, (0, r0, 0, 0), (qdims[0], bq, qdims[2], qdims[3]))
                d_out = ops.slice(self.d_out, (0, r0, 0, 0), (odims[0], bq, odims[2], odims[3]))
                lse = ops.slice(self.lse, (0, 0, r0, 0), (ldims[0], ldims[1], bq, 1))
                delta = ops.slice(self.delta, (0, 0, r0, 0), (ldims[0], ldims[1], bq, 1))
                blk_keep = looped_keep(ops, keep_cols, lens, r0, bq, axis=2, cols=(c0, c1))
                blk_bias = looped_bias(ops, bias_cols, r0, bq, axis=2)
                return fold(acc, qs, d_out, lse, delta, blk_keep, blk_bias)

            # The query blocks that see a key of this block: from `first` on (causal);
            # whole blocks from `clear` on see all of its keys (no causal mask).
            first = max(0, c0 - self.offset) // bq if self.causal else 0
            clear = max(first, -(-max(0, c1 - 1 - self.offset) // bq)) if self.causal else 0
            whole = tq // bq
            acc = (ops.zeros_like(k_blk), ops.zeros_like(v_blk))
            for r0 in range(first * bq, min(clear, whole) * bq, bq):
                acc = step(acc, r0, r0 + bq)
            if whole > clear:
                acc = ops.fori_loop(clear, whole, body, acc)
            if whole * bq < tq and whole >= first:
                acc = step(acc, whole * bq, tq)
            d_keys.append(acc[0])
            d_values.append(acc[1])
        if len(d_keys) == 1:
            return d_keys[0], d_values[0]
        return ops.concatenate(d_keys, axis=1), ops.concatenate(d_values, axis=1)

    # --- d bias: query blocks, every key at once -------------------------------------------

    def d_bias(self) -> Any:
        """The gradient of the bias: ``dS`` of each query block against all keys, summed
        over the axes the bias broadcasts along."""
        ops, tq, tk, bq = self.ops, self.tq, self.tk, self.bq
        shape = shape_of(self.bias)
        parts = []
        for r0 in range(0, tq, bq):
            r1 = min(r0 + bq, tq)
            blk_keep = block_keep(ops, self.keep, self.lens, self.causal, (tq, tk), (r0, r1))
            _, d_scores = self._grads(
                self.qs[:, r0:r1],
                self.k,
                self.v,
                self.d_out[:, r0:r1],
                self.lse[:, :, r0:r1],
                self.delta[:, :, r0:r1],
                blk_keep,
                bias_block(ops, self.bias, (r0, r1)),
            )
            parts.append(
                sum_to_shape(ops, d_scores, (*shape[:2], 1 if shape[2] == 1 else r1 - r0, shape[3]))
            )
        if shape[2] == 1:
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            return ops.cast(total, ops.dtype_name(self.bias))
        grad = parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=2)
        return ops.cast(grad, ops.dtype_name(self.bias))

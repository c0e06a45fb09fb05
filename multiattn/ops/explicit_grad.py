"""A backward pass of its own for the explicit attention path (internal).

Automatic differentiation of the explicit path (scores, softmax, weighted sum) keeps the
weights, or with jax's slices of the batch recomputes the whole forward pass of a
slice, and then runs the softmax's backward over the score matrix. `attention` instead
saves, besides the inputs and the output, only the log of each row's softmax
denominator (``lse``, ``(B, H, Tq, 1)``, from `multiattn.ops.masking.softmax_lse`), and
its backward pass recomputes the weights from it in one sweep, ``P = exp(S - lse)``
with ``S`` the scaled scores, then, with ``dO`` the output's gradient and ``delta =
rowsum(dO * O)``:

* ``dV = P^T dO``;
* ``dS = P * (dO V^T - delta)``, ``dQ = scale * dS K``, ``dK = dS^T (scale * Q)``

(the backward pass of FlashAttention, Dao et al. 2022, with the whole key range as one
block). Masked scores are replaced as in the forward pass, so their weights and
gradients are exactly 0; rows with nothing to attend, whose outputs the forward pass
zeroes, contribute nothing (their ``dO`` is zeroed first). Grouped key/value heads stay grouped: the queries of a group are
stacked against their key/value head, as in the forward pass, so ``dK`` and ``dV`` sum
over the group in the products. Where the plan slices the batch (``chunks``), each
slice is differentiated by its own backward pass (`Namespace.map_batch` over slices that
each have a custom gradient): what a slice saves stays with its slice. Joining the
saved weights into one batch and cutting them again for the backward pass made the
slices lose on TensorFlow (the attention's forward and backward pass at ``(8, 512, 8,
64)`` float32 in 8 slices under ``tf.function``: slower joined than in one piece,
where a backward pass per slice was not; measured: docs/benchmarks.md, 'Measurements
behind the defaults').

With ``keeps_weights`` the forward pass saves the weights themselves, ``(B, H, Tq,
Tk)``, and the backward pass reads them instead of recomputing them: no score product
and no exponential, for the memory that holds the weights between the passes (as
automatic differentiation holds them). They are the forward pass's own weights, from
the backend's softmax: a row with nothing to attend comes out uniform there (its output
is zeroed), and its zeroed ``dO`` keeps it out of every gradient. What it still saves over automatic
differentiation is the softmax's backward pass over the score matrix: ``delta`` is a
sum over the outputs' width instead of a product and a sum over the keys.

The layer `multiattn.layers.MultiHeadAttention` in self-attention (batch 8, length 512,
width 512, 8 heads, float32) forward and backward: on jax under ``jax.jit``,
recomputing the weights was faster than automatic differentiation in 8 slices and, by
less, in 4, the forward pass unchanged (the same softmax; ``lse`` is dropped where
nothing differentiates the call); on TensorFlow under ``tf.function`` the saved weights
were the fastest, then automatic differentiation, then recomputing (measured:
docs/benchmarks.md, 'Measurements behind the defaults'). Which pays is measured per
shape class (`multiattn.tuning.attention_backward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._checks import shape_of
from .masking import MASKED_SCORE

__all__ = ["attention"]


def attention(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    keep: Any,
    scale: float,
    forward: Callable[..., tuple[Any, Any]],
    chunks: int = 1,
    kv_heads_first: bool = False,
    keeps_weights: bool = False,
) -> Any:
    """The explicit path's output ``(B, Tq, H, Dv)`` on ``query`` ``(B, Tq, H, D)``,
    ``key`` ``(B, Tk, Hkv, D)`` and ``value`` ``(B, Tk, Hkv, Dv)`` (heads first, ``(B,
    Hkv, Tk, D)``, with ``kv_heads_first``) under ``keep`` (bool, rank 4 or None; no
    gradient), differentiated with this module's backward pass. ``forward(q, k, v,
    keep)`` is the explicit path returning ``(output, lse)``, or with ``keeps_weights``
    ``(output, weights)``: the backward pass then reads the saved weights ``(B, H, Tq,
    Tk)`` instead of recomputing them (no score product, no exponential, the memory of
    the weights held between the passes). Both passes run over ``chunks`` slices of the
    batch where it is above 1. Differentiable once."""

    def one(q: Any, k: Any, v: Any, keep: Any) -> Any:
        def run(q: Any, k: Any, v: Any, keep: Any = None) -> tuple[Any, tuple]:
            out, kept = forward(q, k, v, keep)
            return out, (q, k, v, keep, out, kept)

        def backward(saved: tuple, d_out: Any) -> tuple:
            q, k, v, keep, out, kept = saved
            d_out = ops.cast(d_out, ops.dtype_name(out))
            grads = _grads(
                ops, (q, k, v), keep, out, kept, d_out, scale, kv_heads_first, keeps_weights
            )
            return grads if keep is None else (*grads, None)

        # the mask is an input (no gradient) rather than a closure: jax's custom_vjp in a
        # compiled loop over slices may not close over the loop's values
        return ops.custom_gradient(run, backward, (q, k, v) if keep is None else (q, k, v, keep))

    if chunks == 1:
        return one(query, key, value, keep)
    return ops.map_batch(one, (query, key, value, keep), chunks, remat=False)


def _heads_first(ops: Any, x: Any) -> Any:
    return ops.transpose(x, (0, 2, 1, 3))


def _grads(ops, qkv, keep, out, kept, d_out, scale, kv_heads_first, keeps_weights) -> tuple:
    """``(dQ, dK, dV)`` of one slice, in the layouts of the inputs ``qkv``; ``kept`` is
    the slice's ``lse``, or its weights with ``keeps_weights``."""
    q, k, v = qkv
    qh = _heads_first(ops, q * scale)  # (B, H, Tq, D)
    kh, vh = (k, v) if kv_heads_first else (_heads_first(ops, k), _heads_first(ops, v))
    b, heads, tq = shape_of(qh)[:3]
    kv_heads = shape_of(kh)[1]
    b = ops.shape(qh)[0] if b is None else b
    rows = (heads // kv_heads) * tq  # the queries of a group, stacked

    def grouped(x: Any) -> Any:  # (B, H, Tq, n) -> (B, Hkv, G * Tq, n)
        return ops.reshape(x, (b, kv_heads, rows, shape_of(x)[3]))

    def per_head(x: Any) -> Any:  # (B, Hkv, G * Tq, n) -> (B, H, Tq, n)
        return ops.reshape(x, (b, heads, tq, shape_of(x)[3]))

    d_oh = _heads_first(ops, d_out)  # (B, H, Tq, Dv)
    if keep is not None:
        # rows with nothing to keep: the forward pass zeroed their outputs
        d_oh = ops.where(ops.any(keep, axis=-1, keepdims=True), d_oh, 0.0)
    weights = kept if keeps_weights else _recompute(ops, qh, kh, keep, kept, grouped, per_head)
    delta = ops.sum(d_oh * _heads_first(ops, out), axis=-1, keepdims=True)
    d_weights = per_head(ops.einsum("bhqe,bhke->bhqk", grouped(d_oh), vh))
    d_scores = grouped(weights * (d_weights - delta))
    d_value = ops.einsum("bhqk,bhqe->bhke", grouped(weights), grouped(d_oh))
    d_query = per_head(ops.einsum("bhqk,bhkd->bhqd", d_scores, kh)) * scale
    d_key = ops.einsum("bhqk,bhqd->bhkd", d_scores, grouped(qh))
    if not kv_heads_first:
        d_key, d_value = _heads_first(ops, d_key), _heads_first(ops, d_value)
    return _heads_first(ops, d_query), d_key, d_value


def _recompute(ops, qh, kh, keep, lse, grouped, per_head) -> Any:
    """The weights ``exp(S - lse)`` from the scaled queries and the keys, heads first."""
    scores = per_head(ops.einsum("bhqd,bhkd->bhqk", grouped(qh), kh))
    if keep is not None:  # as the forward pass: masked weights exactly 0
        scores = ops.where(keep, scores, MASKED_SCORE)
    return ops.exp(scores - lse)

"""Multi-head attention layer."""

from __future__ import annotations

import math
from typing import Any

import keras

from .._checks import (
    broadcast_shape,
    check_positive_int,
    check_rank,
    check_rate,
    fmt_shape,
    shape_of,
)
from .._namespace import get_ops
from ..ops.attention import attend
from ..ops.blockwise import split_masks
from ._base import check_input_width, seed_generator, static_width

__all__ = ["MultiHeadAttention"]


@keras.saving.register_keras_serializable(package="multiattn")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention (self- and cross-attention).

    Weights (the layout of ``keras.layers.MultiHeadAttention``):
    ``query_kernel (E_q, H, D)``, ``key_kernel (E_k, H, D)``, ``value_kernel (E_v, H, D_v)``,
    ``output_kernel (H, D_v, E_out)``, and with ``use_bias`` the biases ``query_bias (H, D)``,
    ``key_bias (H, D)``, ``value_bias (H, D_v)``, ``output_bias (E_out,)``. Heads are
    contiguous in this layout; the interleaved heads of the PaddlePaddle document are a
    permutation of the kernels' columns (see `multiattn.ops.split_heads`).

    Args:
        num_heads: number of heads ``H``.
        key_dim: per-head width ``D`` of queries and keys.
        value_dim: per-head width ``D_v`` of values, default ``key_dim``.
        output_dim: output width ``E_out``, default the query width ``E_q``.
        use_bias: add biases to the four projections.
        dropout: drop probability on the attention weights, training only.
        kernel_initializer, bias_initializer: Keras initializers.
        seed: int seed for dropout.

    Call arguments:
        query: ``(batch, queries, E_q)``.
        value: ``(batch, keys, E_v)``.
        key: ``(batch, keys, E_k)``, defaults to ``value``.
        mask: bool (True = may attend) or integer (non-zero = may attend), broadcastable
            to ``(batch, queries, keys)`` (the same for every head), or rank 4 broadcastable
            to ``(batch, heads, queries, keys)``.
        valid_lens: ``(batch,)`` or ``(batch, queries)`` lengths of the keys.
        causal: bottom-right aligned causal mask (the last query sees every key).
        return_weights: also return the weights ``(batch, heads, queries, keys)``.
        training: enables dropout.

    Returns:
        ``(batch, queries, E_out)`` in the layer's compute dtype (and the weights). A query
        with nothing to attend gets zero weights, so its output is ``output_bias``.
        float16/bfloat16 attention is computed in float32 internally.
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        output_dim: int | None = None,
        use_bias: bool = True,
        dropout: float = 0.0,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        seed: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = "MultiHeadAttention"
        self.num_heads = check_positive_int(where, "num_heads", num_heads)
        self.key_dim = check_positive_int(where, "key_dim", key_dim)
        self.value_dim = (
            check_positive_int(where, "value_dim", value_dim, allow_none=True) or self.key_dim
        )
        self.output_dim = check_positive_int(where, "output_dim", output_dim, allow_none=True)
        if not isinstance(use_bias, bool):
            raise TypeError(f"{where}: `use_bias` must be a bool; received {use_bias!r}.")
        self.use_bias = use_bias
        self.dropout = check_rate(where, "dropout", dropout)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.seed = seed
        self.seed_generator = seed_generator(seed)
        self.supports_masking = True

    def _kernel(self, name: str, shape: tuple) -> Any:
        return self.add_weight(name=name, shape=shape, initializer=self.kernel_initializer)

    def _bias(self, name: str, shape: tuple) -> Any:
        if not self.use_bias:
            return None
        return self.add_weight(name=name, shape=shape, initializer=self.bias_initializer)

    def build(self, query_shape, value_shape, key_shape=None):
        where = "MultiHeadAttention"
        e_q = static_width(where, "query", query_shape)
        e_v = static_width(where, "value", value_shape)
        e_k = static_width(where, "key", value_shape if key_shape is None else key_shape)
        h, d, dv = self.num_heads, self.key_dim, self.value_dim
        e_out = self.output_dim or e_q
        self.query_kernel = self._kernel("query_kernel", (e_q, h, d))
        self.key_kernel = self._kernel("key_kernel", (e_k, h, d))
        self.value_kernel = self._kernel("value_kernel", (e_v, h, dv))
        self.output_kernel = self._kernel("output_kernel", (h, dv, e_out))
        self.query_bias = self._bias("query_bias", (h, d))
        self.key_bias = self._bias("key_bias", (h, d))
        self.value_bias = self._bias("value_bias", (h, dv))
        self.output_bias = self._bias("output_bias", (e_out,))

    def _project_self(self, ops: Any, x: Any) -> tuple[Any, Any, Any]:
        """Self-attention: the three projections as one contraction over ``(E, 3H, D)``."""
        dtype, h = self.compute_dtype, self.num_heads
        kernel = ops.concatenate(
            [ops.cast(w, dtype) for w in (self.query_kernel, self.key_kernel, self.value_kernel)],
            axis=1,
        )
        qkv = ops.einsum("bte,ehd->bthd", x, kernel)
        if self.use_bias:
            biases = (self.query_bias, self.key_bias, self.value_bias)
            qkv = qkv + ops.concatenate([ops.cast(b, dtype) for b in biases], axis=0)
        return qkv[:, :, :h], qkv[:, :, h : 2 * h], qkv[:, :, 2 * h :]

    def _project(self, ops: Any, x: Any, kernel: Any, bias: Any) -> Any:
        y = ops.einsum("bte,ehd->bthd", x, ops.cast(kernel, self.compute_dtype))
        return y if bias is None else y + ops.cast(bias, self.compute_dtype)

    def _keep(
        self, where: str, ops: Any, shape4: tuple, mask: Any, valid_lens: Any, causal: bool
    ) -> Any:
        if mask is not None:
            ms = shape_of(mask)
            if len(ms) <= 3:
                b, _, q, k = shape4
                broadcast_shape(where, "mask", ms, (b, q, k))
                if len(ms) == 3:
                    mask = ops.expand_dims(mask, 1)
            else:
                check_rank(where, "mask", ms, 0, 4)
        return split_masks(
            ops, shape4, mask=mask, valid_lens=valid_lens, causal=causal, where=where
        )

    def call(
        self,
        query,
        value,
        key=None,
        *,
        mask=None,
        valid_lens=None,
        causal=False,
        return_weights=False,
        training=None,
    ):
        where = "MultiHeadAttention"
        key = value if key is None else key
        check_input_width(where, "query", query, self.query_kernel.shape[0])
        check_input_width(where, "key", key, self.key_kernel.shape[0])
        check_input_width(where, "value", value, self.value_kernel.shape[0])
        qs, ks, vs = shape_of(query), shape_of(key), shape_of(value)
        if ks[1] is not None and vs[1] is not None and ks[1] != vs[1]:
            raise ValueError(
                f"{where}: `key` and `value` must have the same length; received key "
                f"{fmt_shape(ks)} and value {fmt_shape(vs)}."
            )
        batches = {s[0] for s in (qs, ks, vs) if s[0] is not None}
        if len(batches) > 1:
            raise ValueError(
                f"{where}: `query`, `key` and `value` must share the batch size; received "
                f"{fmt_shape(qs)}, {fmt_shape(ks)} and {fmt_shape(vs)}."
            )
        ops = get_ops(query)
        keep, lens, causal = self._keep(
            where, ops, (qs[0], self.num_heads, qs[1], ks[1]), mask, valid_lens, causal
        )
        if query is value and key is value and self.key_dim == self.value_dim:
            q, k, v = self._project_self(ops, query)
        else:
            q = self._project(ops, query, self.query_kernel, self.query_bias)
            k = self._project(ops, key, self.key_kernel, self.key_bias)
            v = self._project(ops, value, self.value_kernel, self.value_bias)
        result = attend(
            ops,
            q,
            k,
            v,
            keep=keep,
            valid_lens=lens,
            causal=causal,
            scale=1.0 / math.sqrt(self.key_dim),
            dropout=self.dropout,
            training=bool(training),
            seed=self.seed_generator,
            return_weights=return_weights,
        )
        heads, weights = result if return_weights else (result, None)
        out = ops.einsum("bthv,hvo->bto", heads, ops.cast(self.output_kernel, self.compute_dtype))
        if self.output_bias is not None:
            out = out + ops.cast(self.output_bias, self.compute_dtype)
        return (out, weights) if return_weights else out

    def compute_mask(self, inputs, mask=None):
        return getattr(inputs, "_keras_mask", None)  # the query's sequence mask, if any

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "output_dim": self.output_dim,
            "use_bias": self.use_bias,
            "dropout": self.dropout,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "seed": self.seed,
        }

"""Attention layers without head projections: dot-product and additive."""

from __future__ import annotations

from typing import Any

import keras

from .._checks import check_positive_int, check_rate, check_scale
from ..ops.attention import scaled_dot_product_attention, score_attention
from ..ops.scoring import additive_scores
from ._base import check_input_width, seed_generator, static_width

__all__ = ["AdditiveAttention", "DotProductAttention"]


@keras.saving.register_keras_serializable(package="multiattn")
class DotProductAttention(keras.layers.Layer):
    """Scaled dot-product attention as a layer (no weights).

    Args:
        scale: multiplier of the dot products, default ``1/sqrt(d)``.
        dropout: drop probability on the attention weights, active in training only.
        seed: int seed for dropout.

    Call arguments:
        query: ``(batch, queries, d)``.
        value: ``(batch, keys, d_v)``.
        key: ``(batch, keys, d)``; defaults to ``value``.
        mask: bool (True = may attend), broadcastable to ``(batch, queries, keys)``.
        valid_lens: ``(batch,)`` or ``(batch, queries)``.
        causal: bottom-right aligned causal mask.
        return_weights: also return the weights ``(batch, queries, keys)``.
        training: enables dropout.

    Returns:
        ``(batch, queries, d_v)`` in the inputs' dtype (and the weights). Fully masked
        rows give zeros.
    """

    def __init__(
        self,
        scale: float | None = None,
        dropout: float = 0.0,
        seed: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.scale = check_scale("DotProductAttention", scale)
        self.dropout = check_rate("DotProductAttention", "dropout", dropout)
        self.seed = seed
        self.seed_generator = seed_generator(seed)
        self.supports_masking = True
        self.attention_weights = None

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
        return scaled_dot_product_attention(
            query,
            value if key is None else key,
            value,
            mask=mask,
            valid_lens=valid_lens,
            causal=causal,
            scale=self.scale,
            dropout=self.dropout,
            training=bool(training),
            seed=self.seed_generator,
            return_weights=return_weights,
        )

    def compute_mask(self, inputs, mask=None):
        return getattr(inputs, "_keras_mask", None)  # the query's sequence mask, if any

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "scale": self.scale,
            "dropout": self.dropout,
            "seed": self.seed,
        }


@keras.saving.register_keras_serializable(package="multiattn")
class AdditiveAttention(keras.layers.Layer):
    """Additive (Bahdanau) attention: ``score = w_v . tanh(q W_q + k W_k)``.

    Query and key widths may differ. Weights: ``w_q (d_q, units)``, ``w_k (d_k, units)``,
    ``w_v (units,)``, no biases.

    Args:
        units: width of the hidden scoring layer.
        dropout: drop probability on the attention weights, training only.
        kernel_initializer: initializer of the three kernels.
        seed: int seed for dropout.

    Call arguments:
        query: ``(batch, queries, d_q)``; value: ``(batch, keys, d_v)``;
        key: ``(batch, keys, d_k)``, defaults to ``value``; mask, valid_lens, causal,
        return_weights, training: as in `DotProductAttention`.

    Returns:
        ``(batch, queries, d_v)`` (and the weights ``(batch, queries, keys)``).
    """

    def __init__(
        self,
        units: int,
        dropout: float = 0.0,
        kernel_initializer: Any = "glorot_uniform",
        seed: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.units = check_positive_int("AdditiveAttention", "units", units)
        self.dropout = check_rate("AdditiveAttention", "dropout", dropout)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.seed = seed
        self.seed_generator = seed_generator(seed)
        self.supports_masking = True

    def build(self, query_shape, value_shape, key_shape=None):
        where = "AdditiveAttention"
        dq = static_width(where, "query", query_shape)
        static_width(where, "value", value_shape)
        dk = static_width(where, "key", value_shape if key_shape is None else key_shape)
        init = self.kernel_initializer
        self.w_q = self.add_weight(name="w_q", shape=(dq, self.units), initializer=init)
        self.w_k = self.add_weight(name="w_k", shape=(dk, self.units), initializer=init)
        self.w_v = self.add_weight(
            name="w_v", shape=(self.units,), initializer=keras.initializers.RandomUniform(-0.1, 0.1)
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
        key = value if key is None else key
        check_input_width("AdditiveAttention", "query", query, self.w_q.shape[0])
        check_input_width("AdditiveAttention", "key", key, self.w_k.shape[0])
        w_q, w_k, w_v = (
            keras.ops.cast(w, self.compute_dtype) for w in (self.w_q, self.w_k, self.w_v)
        )
        scores = additive_scores(query, key, w_q, w_k, w_v)
        return score_attention(
            scores,
            value,
            mask=mask,
            valid_lens=valid_lens,
            causal=causal,
            dropout=self.dropout,
            training=bool(training),
            seed=self.seed_generator,
            return_weights=return_weights,
        )

    def compute_mask(self, inputs, mask=None):
        return getattr(inputs, "_keras_mask", None)  # the query's sequence mask, if any

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "units": self.units,
            "dropout": self.dropout,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "seed": self.seed,
        }

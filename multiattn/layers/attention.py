"""Attention layers without head projections: dot-product and additive."""

from __future__ import annotations

from typing import Any

import keras

from .._checks import (
    check_default_scale,
    check_flag,
    check_positive_int,
    check_rate,
    check_scale,
)
from ..namespaces.keras import get_ops
from ..ops.attention import scaled_dot_product_attention, score_attention
from ..ops.scoring import additive_scores
from ._base import (
    check_input_width,
    check_layer_seed,
    get_initializer,
    seed_generator,
    static_width,
)


def _flags(where: str, query: Any, return_weights: Any, training: Any) -> tuple[bool, bool]:
    """The ``return_weights`` and ``training`` flags of a layer call, validated."""
    ops = get_ops(query) if hasattr(query, "dtype") else None
    return (
        check_flag(where, "return_weights", return_weights, ops),
        check_flag(where, "training", training, ops, allow_none=True),
    )


__all__ = ["AdditiveAttention", "DotProductAttention"]


@keras.saving.register_keras_serializable(package="multiattn")
class DotProductAttention(keras.layers.Layer):
    """Scaled dot-product attention as a layer (no weights).

    Args:
        scale: multiplier of the dot products, default ``1/sqrt(d)``.
        dropout: drop probability on the attention weights, active in training only.
        seed: int seed for dropout.

    Call arguments:
        query: ``(batch, queries, d)``, ``d >= 1`` unless ``scale`` is given.
        value: ``(batch, keys, d_v)``.
        key: ``(batch, keys, d)``; defaults to ``value``.
        mask: bool (True = may attend), broadcastable to ``(batch, queries, keys)``.
        valid_lens: ``(batch,)`` or ``(batch, queries)``.
        causal: bottom-right aligned causal mask.
        return_weights: also return the weights ``(batch, queries, keys)``: a bool
            (Python or NumPy), else ``TypeError``.
        training: enables dropout: a bool (Python or NumPy) or None (Keras' default),
            else ``TypeError``.

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
        where = "DotProductAttention"
        self.scale = check_scale(where, scale)
        self.dropout = check_rate(where, "dropout", dropout)
        self.seed = check_layer_seed(where, seed)
        self.seed_generator = seed_generator(where, seed)
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
        where = "DotProductAttention"
        return_weights, training = _flags(where, query, return_weights, training)
        check_default_scale(where, query, self.scale)
        return scaled_dot_product_attention(
            query,
            value if key is None else key,
            value,
            mask=mask,
            valid_lens=valid_lens,
            causal=causal,
            scale=self.scale,
            dropout=self.dropout,
            training=training,
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
        where = "AdditiveAttention"
        self.units = check_positive_int(where, "units", units)
        self.dropout = check_rate(where, "dropout", dropout)
        self.kernel_initializer = get_initializer(where, "kernel_initializer", kernel_initializer)
        self.seed = check_layer_seed(where, seed)
        self.seed_generator = seed_generator(where, seed)
        self.supports_masking = True

    def build(self, query_shape, value_shape=None, key_shape=None):
        where = "AdditiveAttention"
        if value_shape is None:
            raise TypeError(f"{where}: `value` is required; received None.")
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
        where = "AdditiveAttention"
        return_weights, training = _flags(where, query, return_weights, training)
        check_input_width(where, "query", query, self.w_q.shape[0])
        if key is None:  # the keys are the values: an error about them names `value`
            check_input_width(where, "value", value, self.w_k.shape[0])
            key = value
        else:
            check_input_width(where, "key", key, self.w_k.shape[0])
        ops = get_ops(query)
        w_q, w_k, w_v = (ops.cast(w, self.compute_dtype) for w in (self.w_q, self.w_k, self.w_v))
        scores = additive_scores(query, key, w_q, w_k, w_v)
        return score_attention(
            scores,
            value,
            mask=mask,
            valid_lens=valid_lens,
            causal=causal,
            dropout=self.dropout,
            training=training,
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

"""Attention of a decoder state over a grid of CNN features (document 003, captioning)."""

from __future__ import annotations

from typing import Any

import keras

from .._checks import check_flag, check_positive_int, check_rank, check_rate, describe, fmt_shape
from ..namespaces.keras import get_ops
from ._base import check_layer_seed, get_initializer
from .attention import AdditiveAttention

__all__ = ["FeatureMapAttention"]


@keras.saving.register_keras_serializable(package="multiattn")
class FeatureMapAttention(keras.layers.Layer):
    """Additive attention of a query (a decoder state) over an ``H x W`` feature map.

    The grid is flattened to ``H * W`` keys, scored with
    `multiattn.layers.AdditiveAttention` (``w_v . tanh(q W_q + f W_k)``), normalised with
    the core's masked softmax, and the features are averaged with those weights into the
    context vector. The weights come back as an ``H x W`` map, ready to overlay on the
    image.

    Args:
        units: hidden width of the additive scoring layer.
        dropout: drop probability on the weights used for the context, training only (the
            returned map is the weights before dropout).
        kernel_initializer: initializer of the scoring kernels.
        seed: int seed for dropout.

    Call arguments:
        query: ``(batch, d_q)`` (one state) or ``(batch, queries, d_q)``.
        features: ``(batch, H, W, channels)``, channels last, same float dtype as ``query``.
        mask: optional bool ``(batch, H, W)``, True = the cell may be attended. A query
            whose cells are all masked gets a zero map and a zero context vector.
        training: enables dropout.

    Returns:
        ``context`` ``(batch, channels)`` (or ``(batch, queries, channels)``) and
        ``weights`` ``(batch, H, W)`` (or ``(batch, queries, H, W)``), summing to 1 over the
        grid, in the layer's compute dtype (the normalisation of half precision inputs runs
        in float32).
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
        where = "FeatureMapAttention"
        self.units = check_positive_int(where, "units", units)
        self.dropout = check_rate(where, "dropout", dropout)
        self.kernel_initializer = get_initializer(where, "kernel_initializer", kernel_initializer)
        self.seed = check_layer_seed(where, seed)
        self.attention = AdditiveAttention(
            units,
            dropout=dropout,
            kernel_initializer=kernel_initializer,
            seed=self.seed,
            dtype=self.dtype_policy,
            name="attention",
        )

    @staticmethod
    def _shapes(query_shape, features_shape) -> tuple[tuple, tuple]:
        where = "FeatureMapAttention"
        qs, fs = tuple(query_shape), tuple(features_shape)
        check_rank(where, "query", qs, 2, 3)
        check_rank(where, "features", fs, 4, 4)
        for name, shape in (("query", qs), ("features", fs)):
            if shape[-1] is None:
                raise ValueError(
                    f"{where}: the last dimension of `{name}` must be static; "
                    f"received {fmt_shape(shape)}."
                )
        return qs, fs

    def build(self, query_shape, features_shape):
        qs, fs = self._shapes(query_shape, features_shape)
        cells = None if None in fs[1:3] else fs[1] * fs[2]
        self.attention.build((qs[0], 1, qs[-1]), (fs[0], cells, fs[-1]))

    def call(self, query, features, mask=None, training=None):
        where = "FeatureMapAttention"
        for name, x in (("query", query), ("features", features)):
            if not (hasattr(x, "shape") and hasattr(x, "dtype")):
                raise TypeError(f"{where}: `{name}` must be a tensor; received {describe(x)}.")
        training = check_flag(where, "training", training, get_ops(query), allow_none=True)
        qs, fs = self._shapes(query.shape, features.shape)
        shape = keras.ops.shape(features)
        batch, height, width, channels = shape[0], shape[1], shape[2], shape[3]
        single = len(qs) == 2
        q = keras.ops.expand_dims(query, 1) if single else query
        keys = keras.ops.reshape(features, (batch, height * width, channels))
        keep = None
        if mask is not None:
            ms = tuple(mask.shape)
            if len(ms) != 3 or any(
                a is not None and b is not None and a != b for a, b in zip(ms, fs[:3])
            ):
                raise ValueError(
                    f"FeatureMapAttention: `mask` must have shape (batch, H, W) = "
                    f"{fmt_shape(fs[:3])}; received {fmt_shape(ms)}."
                )
            keep = keras.ops.reshape(keras.ops.cast(mask, "bool"), (batch, 1, height * width))
        context, weights = self.attention(
            q, keys, mask=keep, return_weights=True, training=training
        )
        weights = keras.ops.reshape(weights, (batch, -1, height, width))
        if single:
            return context[:, 0, :], weights[:, 0]
        return context, weights

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "units": self.units,
            "dropout": self.dropout,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "seed": self.seed,
        }

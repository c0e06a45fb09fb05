"""What the Transformer blocks share: their arguments, the feed-forward network, the
normalisations and dropouts, the width check and the config."""

from __future__ import annotations

from typing import Any

import keras

from ..ops.activations import activation as apply_activation
from ._base import (
    TANH_GELU,
    block_initializers,
    check_block_args,
    check_layer_seed,
    static_width,
    sublayer_initializers,
)
from .multi_head import MultiHeadAttention
from .normalization import LayerNormalization

__all__ = ["TransformerBlock"]


class TransformerBlock(keras.layers.Layer):
    """Base of `TransformerEncoderLayer` and `TransformerDecoderLayer` (not a layer of its
    own): validates the shared arguments (errors name the subclass, the argument and the
    value) and makes the shared sublayers.

    A subclass creates its attention sublayers with `_attention` first, then calls
    `_make_ffn_norms(norms)`, so that the weights are listed attention first, then
    ``ffn_1``, ``ffn_2`` and ``norm_1 .. norm_<norms>`` (with ``dropout_1 ..``).
    """

    _WHERE = "TransformerBlock"

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dff: int,
        rate: float,
        norm_first: bool,
        epsilon: float,
        activation: Any,
        seed: int | None,
        kernel_initializer: Any,
        bias_initializer: Any,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = self._WHERE
        (
            self.d_model,
            self.num_heads,
            self.dff,
            self.rate,
            self.norm_first,
            self.epsilon,
            self.activation,
        ) = check_block_args(where, d_model, num_heads, dff, rate, norm_first, epsilon, activation)
        self.seed = check_layer_seed(where, seed)
        self.kernel_initializer, self.bias_initializer = block_initializers(
            where, kernel_initializer, bias_initializer
        )
        self.supports_masking = True

    def _attention(self, name: str, **kwargs: Any) -> MultiHeadAttention:
        """A `MultiHeadAttention` of ``num_heads`` heads of width ``d_model // num_heads``
        with the block's dtype policy and initializers."""
        return MultiHeadAttention(
            self.num_heads,
            self.d_model // self.num_heads,
            name=name,
            dtype=self.dtype_policy,
            **sublayer_initializers(self),
            **kwargs,
        )

    def _make_ffn_norms(self, norms: int) -> None:
        """``ffn_1`` (``dff`` wide, the activation), ``ffn_2``, and ``norms`` layer
        normalisations with as many dropouts (seeds ``seed``, ``seed + 1``, ...)."""
        dtype = self.dtype_policy
        # EinsumDense rather than Dense: Keras' matmul computes float64 in float32 on the
        # torch backend, its einsum does not.
        self.ffn_1 = keras.layers.EinsumDense(
            "btd,df->btf",
            (None, self.dff),
            bias_axes="f",
            # a tanh GELU (not a Keras activation) is applied in `_ffn`
            activation=None if self._tanh_gelu else self.activation,
            name="ffn_1",
            dtype=dtype,
            **sublayer_initializers(self),
        )
        self.ffn_2 = keras.layers.EinsumDense(
            "btf,fd->btd",
            (None, self.d_model),
            bias_axes="d",
            name="ffn_2",
            dtype=dtype,
            **sublayer_initializers(self),
        )
        self._norm_count = norms
        for i in range(1, norms + 1):
            norm = LayerNormalization(epsilon=self.epsilon, name=f"norm_{i}", dtype=dtype)
            setattr(self, f"norm_{i}", norm)
        for i in range(1, norms + 1):
            seed = None if self.seed is None else self.seed + i - 1
            dropout = keras.layers.Dropout(self.rate, seed=seed, name=f"dropout_{i}", dtype=dtype)
            setattr(self, f"dropout_{i}", dropout)

    def _checked_shape(self, x_shape: Any) -> tuple:
        """``x_shape`` as a tuple, its last axis static and equal to ``d_model``."""
        width = static_width(self._WHERE, "x", x_shape)
        if width != self.d_model:
            raise ValueError(
                f"{self._WHERE}: `x` must have width d_model={self.d_model}; received shape "
                f"{tuple(x_shape)}."
            )
        return tuple(x_shape)

    def _build_ffn_norms(self, shape: tuple) -> None:
        for i in range(1, self._norm_count + 1):
            getattr(self, f"norm_{i}").build(shape)
        self.ffn_1.build(shape)
        self.ffn_2.build((*shape[:-1], self.dff))

    @property
    def _tanh_gelu(self) -> bool:
        return isinstance(self.activation, str) and self.activation in TANH_GELU

    def _ffn(self, h: Any) -> Any:
        h = self.ffn_1(h)
        if self._tanh_gelu:
            h = apply_activation(h, self.activation)
        return self.ffn_2(h)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "dff": self.dff,
            "rate": self.rate,
            "norm_first": self.norm_first,
            "epsilon": self.epsilon,
            "activation": self.activation,
            "seed": self.seed,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
        }

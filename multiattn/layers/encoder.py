"""Transformer encoder layer."""

from __future__ import annotations

from typing import Any

import keras

from .._checks import broadcast_shape, check_flag, check_float, check_rank, shape_of
from ..namespaces.keras import get_ops
from ._base import (
    as_mask,
    check_input_width,
)
from ._block import TransformerBlock

__all__ = ["TransformerEncoderLayer"]


@keras.saving.register_keras_serializable(package="multiattn")
class TransformerEncoderLayer(TransformerBlock):
    _WHERE = "TransformerEncoderLayer"

    """Self-attention and a position-wise feed-forward network, each with a residual
    connection and layer normalisation.

    Post-LayerNorm (default, as the TensorFlow document and the original Transformer)::

        h = norm_1(x + dropout_1(attention(x)))
        y = norm_2(h + dropout_2(ffn(h)))

    Pre-LayerNorm (``norm_first=True``)::

        h = x + dropout_1(attention(norm_1(x)))
        y = h + dropout_2(ffn(norm_2(h)))

    Sublayers: ``attention`` (`MultiHeadAttention`, ``key_dim = d_model // num_heads``),
    ``ffn_1`` (``Dense(dff, activation)``), ``ffn_2`` (``Dense(d_model)``), ``norm_1``,
    ``norm_2`` (`multiattn.layers.LayerNormalization`, float64-exact), ``dropout_1``, ``dropout_2``.

    Args:
        d_model: model width; must be divisible by ``num_heads``.
        num_heads: attention heads.
        dff: hidden width of the feed-forward network.
        rate: dropout rate (training only).
        norm_first: pre-LayerNorm instead of post-LayerNorm.
        epsilon: LayerNormalization epsilon.
        activation: activation of the first feed-forward layer: a Keras activation, or
            one of transformers' tanh GELUs ``"gelu_new"``, ``"gelu_tanh"``,
            ``"gelu_pytorch_tanh"`` (applied by `multiattn.ops.activation`).
        seed: int seed for the dropout layers.
        kernel_initializer, bias_initializer: Keras initializers (names, objects or
            configs) of the attention projections and the feed-forward layers; each
            sublayer gets its own copy. Defaults: Keras' ``glorot_uniform`` and ``zeros``.

    Call arguments:
        x: ``(batch, seq, d_model)``, floating (integer, bool and complex inputs raise
            ``TypeError``).
        mask: bool, True = may attend: ``(batch, seq)`` key padding (Keras' sequence
            mask, also taken automatically from an upstream ``Embedding(mask_zero=True)``),
            or any mask accepted by `MultiHeadAttention`; a tensor, an array or a nested
            Python list.
        valid_lens, causal: as in `MultiHeadAttention`.
        training: enables dropout: a bool (Python or NumPy) or None (Keras' default);
            anything else raises ``TypeError``.

    Returns:
        ``(batch, seq, d_model)``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dff: int,
        rate: float = 0.1,
        norm_first: bool = False,
        epsilon: float = 1e-6,
        activation: str = "relu",
        seed: int | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        **kwargs: Any,
    ):
        super().__init__(
            d_model,
            num_heads,
            dff,
            rate,
            norm_first,
            epsilon,
            activation,
            seed,
            kernel_initializer,
            bias_initializer,
            **kwargs,
        )
        self.attention = self._attention("attention")
        self._make_ffn_norms(2)

    def build(self, input_shape):
        shape = self._checked_shape(input_shape)
        self.attention.build(shape, shape)
        self._build_ffn_norms(shape)

    def call(self, x, *, mask=None, valid_lens=None, causal=False, training=None):
        where = "TransformerEncoderLayer"
        check_input_width(where, "x", x, self.d_model)
        ops = get_ops(x)
        check_float(where, "x", x, ops)
        training = check_flag(where, "training", training, ops, allow_none=True)
        mask = as_mask(where, "mask", mask)
        if mask is not None:
            ms, xs = shape_of(mask), shape_of(x)
            if len(ms) == 2:
                broadcast_shape(where, "mask", ms, (xs[0], xs[1]))
            else:
                check_rank(where, "mask", ms, 0, 4)
        if mask is not None and len(shape_of(mask)) == 2:
            # A (batch, seq) mask (Keras' sequence mask, e.g. from Embedding(mask_zero=True)):
            # padding of the keys, the same for every query.
            mask = get_ops(x).expand_dims(mask, 1)

        def attention(h):
            return self.attention(
                h, h, mask=mask, valid_lens=valid_lens, causal=causal, training=training
            )

        if self.norm_first:
            h = self.norm_1(x)
            x = x + self.dropout_1(attention(h), training=training)
            return x + self.dropout_2(self._ffn(self.norm_2(x)), training=training)
        x = self.norm_1(x + self.dropout_1(attention(x), training=training))
        return self.norm_2(x + self.dropout_2(self._ffn(x), training=training))

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_mask(self, inputs, mask=None):
        if mask is not None and not hasattr(mask, "shape"):
            mask = keras.ops.convert_to_tensor(as_mask("TransformerEncoderLayer", "mask", mask))
        return mask if mask is not None and len(tuple(mask.shape)) == 2 else None

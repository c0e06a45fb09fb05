"""Transformer decoder layer, with incremental decoding through a key/value cache."""

from __future__ import annotations

from typing import Any

import keras

from .._checks import broadcast_shape, check_flag, check_float, check_rank, shape_of
from ..namespaces.keras import get_ops
from ..ops.masking import check_valid_lens
from ._base import (
    as_mask,
    check_input_width,
    static_width,
)
from ._block import TransformerBlock

__all__ = ["TransformerDecoderLayer"]


@keras.saving.register_keras_serializable(package="multiattn")
class TransformerDecoderLayer(TransformerBlock):
    _WHERE = "TransformerDecoderLayer"

    """Causal self-attention, cross-attention over an encoder output and a position-wise
    feed-forward network, each with a residual connection and layer normalisation.

    Post-LayerNorm (default, as the original Transformer)::

        h1 = norm_1(x + dropout_1(self_attention(x, causal)))
        h2 = norm_2(h1 + dropout_2(cross_attention(h1, context)))
        y  = norm_3(h2 + dropout_3(ffn(h2)))

    Pre-LayerNorm (``norm_first=True``)::

        h1 = x + dropout_1(self_attention(norm_1(x), causal))
        h2 = h1 + dropout_2(cross_attention(norm_2(h1), context))
        y  = h2 + dropout_3(ffn(norm_3(h2)))

    Sublayers: ``self_attention`` and ``cross_attention`` (`MultiHeadAttention`,
    ``key_dim = d_model // num_heads``), ``ffn_1`` (``dff`` units, ``activation``),
    ``ffn_2`` (``d_model`` units), ``norm_1``, ``norm_2``, ``norm_3``
    (`multiattn.layers.LayerNormalization`), ``dropout_1``, ``dropout_2``, ``dropout_3``.

    Args:
        d_model: model width; must be divisible by ``num_heads``.
        num_heads: attention heads (of both attentions).
        dff: hidden width of the feed-forward network.
        rate: dropout rate (training only).
        norm_first: pre-LayerNorm instead of post-LayerNorm.
        epsilon: LayerNormalization epsilon.
        activation: activation of the first feed-forward layer: a Keras activation, or
            one of transformers' tanh GELUs ``"gelu_new"``, ``"gelu_tanh"``,
            ``"gelu_pytorch_tanh"`` (applied by `multiattn.ops.activation`).
        num_key_value_heads: key/value heads of both attentions (grouped-query attention,
            see `MultiHeadAttention`); None: ``num_heads``.
        rotary_max_length: rotary position embedding in the self-attention, for positions
            up to this many; None (default): none.
        seed: int seed for the dropout layers.
        kernel_initializer, bias_initializer: Keras initializers (names, objects or
            configs) of the attention projections and the feed-forward layers; each
            sublayer gets its own copy. Defaults: Keras' ``glorot_uniform`` and ``zeros``.

    Call arguments:
        x: ``(batch, target_len, d_model)``, the target tokens (embedded), floating
            (integer, bool and complex inputs raise ``TypeError``).
        context: ``(batch, source_len, context_width)``, floating, the encoder output; may
            be omitted when ``context_key_value`` is given.
        context_mask: bool ``(batch, source_len)``, True = a real source token (Keras'
            sequence mask), or any mask `MultiHeadAttention` accepts for the cross-attention
            (rank 3 or 4); a tensor, an array or a nested Python list.
        context_valid_lens: ``(batch,)`` lengths of the source sequences.
        context_key_value: the cross-attention keys/values precomputed once with
            `precompute_context` (decoding reuses them at every step).
        mask: extra mask of the self-attention (ANDed with the causal mask), full pass only.
        cache, cache_index: incremental decoding. ``cache`` is the self-attention cache of
            `init_cache`; ``x`` holds the tokens at positions ``cache_index ..
            cache_index + target_len - 1``. ``cache_index`` is an int, a NumPy integer or
            an integer scalar tensor, checked as in `MultiHeadAttention` (a known value
            out of range raises ``ValueError``; a traced one out of range writes nothing
            and gives NaN outputs).
        training: enables dropout: a bool (Python or NumPy) or None (Keras' default);
            anything else raises ``TypeError``.

    Returns:
        ``(batch, target_len, d_model)``; with ``cache``, ``(output, new_cache)``. Feeding a
        sequence token by token through the cache gives the outputs of one full causal pass.
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
        num_key_value_heads: int | None = None,
        rotary_max_length: int | None = None,
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
        self.num_key_value_heads = num_key_value_heads
        self.rotary_max_length = rotary_max_length
        self.self_attention = self._attention(
            "self_attention",
            num_key_value_heads=num_key_value_heads,
            rotary_max_length=rotary_max_length,
        )
        self.cross_attention = self._attention(
            "cross_attention", num_key_value_heads=num_key_value_heads
        )
        self._make_ffn_norms(3)

    def build(self, x_shape, context_shape=None):
        shape = self._checked_shape(x_shape)
        if context_shape is None:
            context_shape = (shape[0], None, self.d_model)
        else:
            static_width(self._WHERE, "context", context_shape)
        self.self_attention.build(shape, shape)
        self.cross_attention.build(shape, tuple(context_shape))
        self._build_ffn_norms(shape)

    def init_cache(self, batch_size: int, max_length: int, dtype: str | None = None):
        """An empty self-attention cache for ``max_length`` positions (see
        `MultiHeadAttention.init_cache`)."""
        return self.self_attention.init_cache(batch_size, max_length, dtype)

    def precompute_context(self, context):
        """The cross-attention keys and values of ``context`` ``(batch, source_len, width)``,
        projected once; pass the result as ``context_key_value``."""
        return self.cross_attention.project_key_value(context)

    def call(
        self,
        x,
        context=None,
        *,
        context_mask=None,
        context_valid_lens=None,
        context_key_value=None,
        mask=None,
        cache=None,
        cache_index=None,
        training=None,
    ):
        where = "TransformerDecoderLayer"
        check_input_width(where, "x", x, self.d_model)
        ops = get_ops(x)
        check_float(where, "x", x, ops)
        training = check_flag(where, "training", training, ops, allow_none=True)
        if (context is None) == (context_key_value is None):
            raise ValueError(f"{where}: give exactly one of `context` and `context_key_value`.")
        if context is not None:
            check_input_width(where, "context", context, self.cross_attention.key_kernel.shape[0])
            check_float(where, "context", context, get_ops(context))
        context_mask = as_mask(where, "context_mask", context_mask)
        mask = as_mask(where, "mask", mask)
        if context_mask is not None:
            self._check_context_mask(where, context_mask, x, context, context_key_value)
        if context_valid_lens is not None:
            xs = shape_of(x)
            context_valid_lens = check_valid_lens(
                get_ops(x),
                context_valid_lens,
                (xs[0], 1, xs[1], _source_len(context, context_key_value)),
                where,
                name="context_valid_lens",
            )
        if context_mask is not None and len(shape_of(context_mask)) == 2:
            context_mask = get_ops(x).expand_dims(context_mask, 1)  # key padding, every query
        new_cache = None

        def self_attention(h):
            nonlocal new_cache
            if cache is not None:
                if mask is not None:
                    raise ValueError(f"{where}: `mask` cannot be combined with `cache`.")
                out, new_cache = self.self_attention(
                    h, cache=cache, cache_index=cache_index, training=training
                )
                return out
            if cache_index is not None:
                raise ValueError(f"{where}: `cache_index` is only meaningful with `cache`.")
            return self.self_attention(h, h, mask=mask, causal=True, training=training)

        def cross_attention(h):
            kw = dict(mask=context_mask, valid_lens=context_valid_lens, training=training)
            if context_key_value is not None:
                return self.cross_attention(h, key_value=context_key_value, **kw)
            return self.cross_attention(h, context, **kw)

        if self.norm_first:
            x = x + self.dropout_1(self_attention(self.norm_1(x)), training=training)
            x = x + self.dropout_2(cross_attention(self.norm_2(x)), training=training)
            y = x + self.dropout_3(self._ffn(self.norm_3(x)), training=training)
        else:
            x = self.norm_1(x + self.dropout_1(self_attention(x), training=training))
            x = self.norm_2(x + self.dropout_2(cross_attention(x), training=training))
            y = self.norm_3(x + self.dropout_3(self._ffn(x), training=training))
        return (y, new_cache) if cache is not None else y

    def _check_context_mask(self, where, context_mask, x, context, context_key_value) -> None:
        """A ``(batch, source_len)`` key padding mask, or a mask of rank 3 or 4 that
        broadcasts to ``(batch, target_len, source_len)`` /
        ``(batch, heads, target_len, source_len)``; errors name ``context_mask``."""
        ms, xs = shape_of(context_mask), shape_of(x)
        source = _source_len(context, context_key_value)
        check_rank(where, "context_mask", ms, 0, 4)
        if len(ms) <= 2:
            broadcast_shape(where, "context_mask", ms, (xs[0], source))
        elif len(ms) == 3:
            broadcast_shape(where, "context_mask", ms, (xs[0], xs[1], source))
        else:
            broadcast_shape(where, "context_mask", ms, (xs[0], self.num_heads, xs[1], source))

    def compute_output_shape(self, x_shape, context_shape=None):
        return x_shape

    def compute_mask(self, inputs, mask=None):
        return None

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "num_key_value_heads": self.num_key_value_heads,
            "rotary_max_length": self.rotary_max_length,
        }


def _source_len(context: Any, context_key_value: Any) -> int | None:
    """The number of source positions of the cross-attention (None: unknown, or a
    ``context_key_value`` the cross-attention will refuse, naming it)."""
    if context is not None:
        return shape_of(context)[1]
    if isinstance(context_key_value, (tuple, list)) and len(context_key_value) == 2:
        keys = context_key_value[0]
        return shape_of(keys)[1] if len(getattr(keys, "shape", ())) == 4 else None
    return None

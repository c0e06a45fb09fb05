"""Grouped-query attention with the interface of ``keras.layers.GroupedQueryAttention``."""

from __future__ import annotations

from typing import Any

import keras

from ._mha_checks import positive_int
from .multi_head import MultiHeadAttention

__all__ = ["GroupQueryAttention", "GroupedQueryAttention"]


@keras.saving.register_keras_serializable(package="multiattn")
class GroupedQueryAttention(MultiHeadAttention):
    """Grouped-query attention, a drop-in for ``keras.layers.GroupedQueryAttention``.

    `MultiHeadAttention` with ``num_key_value_heads`` under Keras' names: ``num_query_heads``
    heads of width ``head_dim`` for queries, keys and values, ``num_key_value_heads`` of
    them for keys and values (query head ``h`` uses key/value head ``h // (num_query_heads
    / num_key_value_heads)``), output as wide as the query. The weights are Keras' (
    sublayers ``query``, ``key``, (``gate``), ``value``, ``attention_output``) and the
    guarantees multiattn's: zero weights on a query with nothing to attend, half precision
    normalised in float32. Call arguments are `MultiHeadAttention`'s: Keras' (``query``,
    ``value``, ``key``, ``attention_mask``, ``return_attention_scores``, ``training``,
    ``use_causal_mask`` and the inputs' Keras masks) and multiattn's (``valid_lens``,
    ``causal``, ``cache``, ...).

    Args:
        head_dim: per-head width of queries, keys and values.
        num_query_heads: number of query heads.
        num_key_value_heads: number of key/value heads, dividing ``num_query_heads``.
        **kwargs: ``dropout``, ``use_bias``, ``sliding_window``, ``flash_attention``,
            ``kernel_initializer``, ``bias_initializer``, ``kernel_regularizer``,
            ``bias_regularizer``, ``activity_regularizer``, ``kernel_constraint``,
            ``bias_constraint``, ``use_gate``, ``seed``, and the rotary position embedding
            (``rotary_max_length``, ``rotary_base``): as in `MultiHeadAttention`; and
            ``keras.layers.Layer`` arguments.

    Keras' ``_compute_attention(query, key, value, attention_mask, training,
    use_causal_mask)`` override point is kept; it receives the key/value heads repeated to
    ``num_query_heads`` when a subclass overrides it, as Keras' layer passes them.
    """

    _WHERE = "GroupedQueryAttention"
    _CLEAR_INPUT_MASKS = False
    # Keras saves sublayers under the attribute it finds first, public names before
    # private ones. Keras' GroupedQueryAttention has no public ``query_dense`` etc., so its
    # checkpoints hold ``_query_dense``...: without these (inherited) names here, ours
    # are saved and loaded under the same paths.
    query_dense = key_dense = value_dense = output_dense = None

    def __init__(
        self,
        head_dim: int,
        num_query_heads: int,
        num_key_value_heads: int,
        dropout: float = 0.0,
        use_bias: bool = True,
        sliding_window: int | None = None,
        flash_attention: bool | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        activity_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        use_gate: bool = False,
        seed: int | None = None,
        *,
        rotary_max_length: int | None = None,
        rotary_base: float = 10000.0,
        **kwargs: Any,
    ):
        where = self._WHERE
        head_dim = positive_int(where, "head_dim", head_dim)
        num_query_heads = positive_int(where, "num_query_heads", num_query_heads)
        num_key_value_heads = positive_int(where, "num_key_value_heads", num_key_value_heads)
        if num_query_heads % num_key_value_heads:
            raise ValueError(
                f"{where}: `num_query_heads` must be divisible by `num_key_value_heads`; "
                f"received num_query_heads={num_query_heads}, num_key_value_heads="
                f"{num_key_value_heads}."
            )
        super().__init__(
            num_heads=num_query_heads,
            key_dim=head_dim,
            value_dim=head_dim,
            dropout=dropout,
            use_bias=use_bias,
            sliding_window=sliding_window,
            flash_attention=flash_attention,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
            use_gate=use_gate,
            seed=seed,
            num_key_value_heads=num_key_value_heads,
            rotary_max_length=rotary_max_length,
            rotary_base=rotary_base,
            **kwargs,
        )
        self._return_attention_scores = False

    @property
    def head_dim(self) -> int:
        return self.key_dim

    @property
    def num_query_heads(self) -> int:
        return self.num_heads

    @property
    def num_repeats(self) -> int:
        return self.num_heads // self.kv_heads

    @property
    def feature_dim(self) -> int:
        return self._widths[0]

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        value_shape = query_shape if value_shape is None else value_shape
        if query_shape[-1] != value_shape[-1]:
            raise ValueError(
                f"{self._WHERE}: The last dimension of `query_shape` and `value_shape` must "
                f"be equal, but are {query_shape[-1]}, {value_shape[-1]}. Received: "
                f"query_shape={tuple(query_shape)}, value_shape={tuple(value_shape)}."
            )
        return super().compute_output_shape(query_shape, value_shape, key_shape)

    def _compute_attention(
        self, query, key, value, attention_mask=None, training=None, use_causal_mask=False
    ):
        """Keras' override point (see `MultiHeadAttention._compute_attention`); whether the
        weights are returned follows the call's ``return_attention_scores`` as in Keras."""
        return super()._compute_attention(
            query,
            key,
            value,
            attention_mask,
            training,
            self._return_attention_scores,
            use_causal_mask,
        )

    def _call_hook(self, q, k, v, keep, training, return_weights):
        self._return_attention_scores = return_weights
        ops = keras.ops
        k = ops.repeat(k, self.num_repeats, axis=2)
        v = ops.repeat(v, self.num_repeats, axis=2)
        return self._compute_attention(q, k, v, attention_mask=keep, training=training)

    def get_config(self) -> dict:
        config = super().get_config()
        for key in (
            "num_heads",
            "key_dim",
            "value_dim",
            "output_shape",
            "attention_axes",
            "output_dim",
            "num_key_value_heads",
        ):
            config.pop(key)
        return {
            **config,
            "head_dim": self.head_dim,
            "num_query_heads": self.num_query_heads,
            "num_key_value_heads": self.kv_heads,
        }


GroupedQueryAttention._compute_attention._multiattn_own = True

# Keras exports its class as ``keras.layers.GroupQueryAttention`` (and names it
# GroupedQueryAttention inside keras.src): both names work here too.
GroupQueryAttention = GroupedQueryAttention

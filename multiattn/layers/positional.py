"""Positional encoding layer."""

from __future__ import annotations

from typing import Any

import keras

from .._checks import (
    check_choice,
    check_flag,
    check_float,
    check_positive_int,
    check_rate,
    fmt_shape,
)
from ..namespaces.keras import get_ops
from ..ops.positional import PE_LAYOUTS, sinusoidal_table
from ._base import check_input_width, get_initializer, seed_generator, static_width
from .rotary import check_offset, table_rows

__all__ = ["PositionEmbedding", "PositionalEncoding"]


@keras.saving.register_keras_serializable(package="multiattn")
class PositionalEncoding(keras.layers.Layer):
    """Adds the sinusoidal positional encoding to ``(batch, seq, depth)`` inputs.

    ``output = dropout(x + P[:seq])`` with ``P`` from
    `multiattn.ops.sinusoidal_encoding` (computed once in float64, cast to the
    layer's compute dtype).

    Args:
        max_length: longest sequence accepted.
        layout: ``"interleaved"`` (d2l) or ``"concatenated"``.
        base: wavelength base, 10000 in the documents.
        dropout: drop probability on the sum, training only.
        seed: int seed for dropout.
    """

    def __init__(
        self,
        max_length: int = 2048,
        layout: str = "interleaved",
        base: float = 10000.0,
        dropout: float = 0.0,
        seed: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = "PositionalEncoding"
        self.max_length = check_positive_int(where, "max_length", max_length)
        self.layout = check_choice(where, "layout", layout, PE_LAYOUTS)
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
            raise ValueError(f"{where}: `base` must be a number > 1; received {base!r}.")
        self.base = float(base)
        self.dropout = check_rate(where, "dropout", dropout)
        self.seed = seed
        self.seed_generator = seed_generator(where, seed)
        self._table = None
        self.supports_masking = True

    def build(self, input_shape):
        depth = static_width("PositionalEncoding", "inputs", input_shape)
        self._table = sinusoidal_table(self.max_length, depth, self.layout, self.base)

    def call(self, inputs, training=None):
        where = "PositionalEncoding"
        ops = get_ops(inputs)
        training = check_flag(where, "training", training, ops, allow_none=True)
        check_input_width(where, "inputs", inputs, self._table.shape[1])
        check_float(where, "inputs", inputs, ops)
        length = inputs.shape[1]
        if length is not None and length > self.max_length:
            raise ValueError(
                f"PositionalEncoding: sequence length {length} of `inputs` "
                f"{fmt_shape(tuple(inputs.shape))} exceeds max_length={self.max_length}."
            )
        table = ops.convert_to_tensor(self._table, dtype=self.compute_dtype)
        x = inputs + table[: ops.shape(inputs)[1]]
        if self.dropout > 0.0 and training:
            x = ops.dropout(x, self.dropout, seed=self.seed_generator)
        return x

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "max_length": self.max_length,
            "layout": self.layout,
            "base": self.base,
            "dropout": self.dropout,
            "seed": self.seed,
        }


@keras.saving.register_keras_serializable(package="multiattn")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned position embedding to ``(batch, seq, depth)`` inputs.

    ``output = x + E[offset : offset + seq]`` with the trainable table ``embeddings``
    ``(max_length, depth)``.

    Args:
        max_length: number of positions in the table.
        embeddings_initializer: Keras initializer of the table.

    Call arguments:
        inputs: ``(batch, seq, depth)`` floating.
        offset: position of the first token: an int, a NumPy integer or an integer scalar
            tensor (the cache index when decoding token by token). A known value (eager
            tensors included) must satisfy ``0 <= offset`` and ``offset + seq <=
            max_length`` (``ValueError`` otherwise). A traced offset (``jax.jit`` /
            ``tf.function``) cannot be checked when the call runs: the rows of positions
            outside ``[0, max_length)`` are NaN there, never a clamped row.

    Returns:
        ``(batch, seq, depth)`` in the compute dtype.
    """

    def __init__(
        self,
        max_length: int,
        embeddings_initializer: Any = "glorot_uniform",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = "PositionEmbedding"
        self.max_length = check_positive_int(where, "max_length", max_length)
        self.embeddings_initializer = get_initializer(
            where, "embeddings_initializer", embeddings_initializer
        )
        self.supports_masking = True

    def build(self, input_shape):
        depth = static_width("PositionEmbedding", "inputs", input_shape)
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.max_length, depth),
            initializer=self.embeddings_initializer,
        )

    def call(self, inputs, offset=0):
        where = "PositionEmbedding"
        ops = get_ops(inputs)
        check_input_width(where, "inputs", inputs, self.embeddings.shape[1])
        check_float(where, "inputs", inputs, ops)
        length = inputs.shape[1]
        if length is None:
            raise ValueError(
                f"{where}: the sequence axis of `inputs` must be static; received "
                f"{fmt_shape(tuple(inputs.shape))}."
            )
        offset = check_offset(where, offset, length, self.max_length, ops)
        table = ops.cast(self.embeddings, self.compute_dtype)
        rows = table_rows(ops, table, offset, length, self.max_length)
        return ops.cast(inputs, self.compute_dtype) + rows

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "max_length": self.max_length,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
        }

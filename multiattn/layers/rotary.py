"""Rotary position embedding layer."""

from __future__ import annotations

from typing import Any

import keras

from .._checks import check_positive_int, check_rank, fmt_shape, shape_of
from .._namespace import get_ops
from ..ops.rotary import _check_base, apply_rotary, compute_dtype, rotary_table

__all__ = ["RotaryEmbedding", "check_offset", "table_rows"]


def table_rows(table: Any, offset: Any, length: int) -> Any:
    """Rows ``offset .. offset + length - 1`` of a ``(positions, width)`` table.

    ``offset`` is a Python int or an integer scalar tensor (traced under ``jax.jit`` or
    ``tf.function``); the start indices then share its dtype (``jax.lax.dynamic_slice``
    requires one index dtype).
    """
    if isinstance(offset, int):
        return table[offset : offset + length]
    offset = keras.ops.cast(offset, "int32")
    start = (offset, keras.ops.zeros_like(offset))
    return keras.ops.slice(table, start, (length, tuple(table.shape)[1]))


def check_offset(where: str, offset: Any, length: int | None, max_length: int) -> Any:
    """A Python int offset must fit ``offset + length <= max_length``; a tensor is cast."""
    if isinstance(offset, bool):
        raise TypeError(
            f"{where}: `offset` must be an int or an integer tensor; received {offset!r}."
        )
    if isinstance(offset, int):
        if offset < 0 or (length is not None and offset + length > max_length):
            raise ValueError(
                f"{where}: positions {offset}..{offset + (length or 1) - 1} exceed "
                f"max_length={max_length} (`offset`={offset!r})."
            )
        return offset
    dtype = keras.backend.standardize_dtype(getattr(offset, "dtype", "float32"))
    if "int" not in dtype or len(tuple(offset.shape)) != 0:
        raise TypeError(
            f"{where}: `offset` must be an int or an integer scalar tensor; received dtype "
            f"{dtype} and shape {tuple(offset.shape)}."
        )
    return offset


@keras.saving.register_keras_serializable(package="multiattn")
class RotaryEmbedding(keras.layers.Layer):
    """Rotary position embedding (RoPE) of ``(batch, seq, heads, dim)`` queries or keys.

    Features ``i`` and ``i + dim/2`` of the token at position ``offset + s`` are rotated by
    the angle ``(offset + s) * base**(-2i/dim)`` (see `multiattn.ops.rotary_embedding`).
    The cos/sin tables ``(max_length, dim/2)`` are computed once in float64 with NumPy and
    rounded to float32 (float64 under a float64 policy), so all backends agree bit for bit;
    float16/bfloat16 inputs are rotated in float32 and cast back. No weights.

    Args:
        max_length: number of positions in the tables (the longest ``offset + seq``).
        base: wavelength base, 10000 in RoFormer.

    Call arguments:
        x: ``(batch, seq, heads, dim)``, ``dim`` even.
        offset: position of the first token: a Python int, or an integer scalar tensor
            (e.g. the cache index under ``jax.jit`` / ``tf.function``; not range-checked).

    Returns:
        ``(batch, seq, heads, dim)`` in the compute dtype.
    """

    def __init__(self, max_length: int = 2048, base: float = 10000.0, **kwargs: Any):
        super().__init__(**kwargs)
        where = "RotaryEmbedding"
        self.max_length = check_positive_int(where, "max_length", max_length)
        self.base = _check_base(where, base)
        self._tables = None

    def build(self, input_shape):
        where = "RotaryEmbedding"
        shape = tuple(input_shape)
        check_rank(where, "x", shape, 4, 4)
        if shape[-1] is None or shape[-1] % 2:
            raise ValueError(
                f"{where}: the last axis of `x` must be static and even; received "
                f"{fmt_shape(shape)}."
            )
        self._tables = rotary_table(self.max_length, int(shape[-1]), self.base)

    def call(self, x, offset=0):
        where = "RotaryEmbedding"
        shape = shape_of(x)
        if shape[1] is None:
            raise ValueError(
                f"{where}: the sequence axis of `x` must be static; received {fmt_shape(shape)}."
            )
        offset = check_offset(where, offset, shape[1], self.max_length)
        ops = get_ops(x)
        dtype = self.compute_dtype
        wide = compute_dtype(dtype)
        cos, sin = (ops.convert_to_tensor(t.astype(wide), dtype=wide) for t in self._tables)
        cos = table_rows(cos, offset, shape[1])
        sin = table_rows(sin, offset, shape[1])
        return apply_rotary(ops, ops.cast(x, dtype), cos, sin)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {**super().get_config(), "max_length": self.max_length, "base": self.base}

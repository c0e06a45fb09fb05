"""Rotary position embedding layer, and the position offsets shared with the cache."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from .._checks import (
    check_float,
    check_integer_scalar,
    check_positive_int,
    check_rank,
    fmt_shape,
    shape_of,
)
from .._namespace import get_ops
from ..ops.rotary import _check_base, apply_rotary, compute_dtype, rotary_angles, rotary_table

__all__ = ["RotaryEmbedding", "check_offset", "table_rows"]


def check_offset(
    where: str,
    offset: Any,
    length: int | None,
    max_length: int,
    ns: Any,
    *,
    name: str = "offset",
    limit: str = "max_length",
) -> Any:
    """The position of the first of ``length`` tokens in a range of ``max_length``
    positions.

    ``offset`` is an int, a NumPy integer or an integer scalar tensor. When its value is
    known (Python and NumPy integers, eager tensors on every backend, TensorFlow
    constants) it is returned as a Python int, after checking ``0 <= offset`` and
    ``offset + length <= max_length`` (``ValueError`` naming ``name`` and ``limit``).
    A symbolic tensor (traced under ``jax.jit`` / ``tf.function``) cannot be checked
    when the call runs; it is returned as it is, and the caller keeps out-of-range
    positions harmless (see `table_rows`). Bools, floats and non-scalars raise
    ``TypeError``.
    """
    offset = check_integer_scalar(where, name, offset, ns)
    if not isinstance(offset, int):
        return offset
    if offset < 0:
        raise ValueError(f"{where}: `{name}` must be non-negative; received {offset}.")
    if length is not None and offset + length > max_length:
        raise ValueError(
            f"{where}: `{name}`={offset} with {length} token(s) needs positions "
            f"{offset}..{offset + length - 1}, past the last position {max_length - 1} "
            f"({limit}={max_length})."
        )
    return offset


def table_rows(ops: Any, table: Any, offset: Any, length: int, max_length: int) -> Any:
    """Rows ``offset .. offset + length - 1`` of a ``(max_length, width)`` table.

    ``offset`` is a Python int (checked by `check_offset`: a plain slice) or a symbolic
    integer scalar (traced under ``jax.jit`` / ``tf.function``). The rows of a traced
    offset are gathered at their positions; a position outside ``[0, max_length)`` gets
    a row of NaN, never a clamped or wrapped row of another position (``jax.lax``'s
    dynamic slice would clamp silently, TensorFlow's fails only outside XLA).
    """
    if isinstance(offset, int):
        return table[offset : offset + length]
    positions = ops.arange(length, dtype="int32") + ops.cast(offset, "int32")
    inside = ops.logical_and(ops.greater_equal(positions, 0), ops.less(positions, max_length))
    rows = ops.take(table, ops.where(inside, positions, 0), axis=0)
    return ops.where(ops.expand_dims(inside, 1), rows, float("nan"))


@keras.saving.register_keras_serializable(package="multiattn")
class RotaryEmbedding(keras.layers.Layer):
    """Rotary position embedding (RoPE) of ``(batch, seq, heads, dim)`` queries or keys.

    Features ``i`` and ``i + dim/2`` of the token at position ``offset + s`` are rotated by
    the angle ``(offset + s) * base**(-2i/dim)`` (see `multiattn.ops.rotary_embedding`).
    The angles are computed in float64 with NumPy and rounded to float32 (float64 under a
    float64 policy), so all backends agree bit for bit; float16/bfloat16 inputs are
    rotated in float32 and cast back. No weights.

    Args:
        max_length: number of positions (the longest ``offset + seq``).
        base: wavelength base, 10000 in RoFormer.

    Call arguments:
        x: ``(batch, seq, heads, dim)`` floating, ``dim`` even.
        offset: position of the first token: an int, a NumPy integer or an integer
            scalar tensor. A known value (eager tensors included) must satisfy
            ``0 <= offset`` and ``offset + seq <= max_length`` (``ValueError``
            otherwise); only the ``seq`` rows of angles needed are computed. A traced
            offset (``jax.jit`` / ``tf.function``, e.g. the cache index of a compiled
            decoding step) reads rows of a ``(max_length, dim/2)`` table computed once;
            positions outside ``[0, max_length)`` cannot raise there and come out as NaN
            (never as the rotation of a clamped position).

    Returns:
        ``(batch, seq, heads, dim)`` in the compute dtype.
    """

    def __init__(self, max_length: int = 2048, base: float = 10000.0, **kwargs: Any):
        super().__init__(**kwargs)
        where = "RotaryEmbedding"
        self.max_length = check_positive_int(where, "max_length", max_length)
        self.base = _check_base(where, base)
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _check_x(self, shape: tuple) -> None:
        where = "RotaryEmbedding"
        check_rank(where, "x", shape, 4, 4)
        if shape[-1] is None or shape[-1] % 2:
            raise ValueError(
                f"{where}: the last axis of `x` must be static and even; received "
                f"{fmt_shape(shape)}."
            )

    def build(self, input_shape):
        self._check_x(tuple(input_shape))

    def _table(self, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """The float64 cos/sin tables ``(max_length, dim/2)``, built on first use (a
        traced offset)."""
        if dim not in self._tables:
            self._tables[dim] = rotary_table(self.max_length, dim, self.base)
        return self._tables[dim]

    def call(self, x, offset=0):
        where = "RotaryEmbedding"
        ops = get_ops(x)
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{where}: `x` must be a tensor; received {type(x).__name__}.")
        shape = shape_of(x)
        self._check_x(shape)
        check_float(where, "x", x, ops)
        if shape[1] is None:
            raise ValueError(
                f"{where}: the sequence axis of `x` must be static; received {fmt_shape(shape)}."
            )
        length, dim = shape[1], shape[-1]
        offset = check_offset(where, offset, length, self.max_length, ops)
        dtype = self.compute_dtype
        wide = compute_dtype(dtype)
        if isinstance(offset, int):
            tables = rotary_angles(offset + np.arange(length), dim, self.base)
            cos, sin = (ops.convert_to_tensor(t.astype(wide), dtype=wide) for t in tables)
        else:
            cos, sin = (
                table_rows(
                    ops,
                    ops.convert_to_tensor(t.astype(wide), dtype=wide),
                    offset,
                    length,
                    self.max_length,
                )
                for t in self._table(dim)
            )
        return apply_rotary(ops, ops.cast(x, dtype), cos, sin)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {**super().get_config(), "max_length": self.max_length, "base": self.base}

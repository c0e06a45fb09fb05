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
from ..namespaces.keras import get_ops
from ..ops.rotary import (
    _check_base,
    apply_rotary,
    check_rotary_dim,
    check_rotary_scaling,
    compute_dtype,
    rotary_angles,
    rotary_table,
)

__all__ = ["RotaryEmbedding", "check_offset", "table_rows"]

#: The most angles (positions x dim/2) a `RotaryEmbedding` keeps as a tensor table per
#: dtype: 2**20, 4 MiB in float32 (2048 positions of 128-wide heads take an eighth).
TABLE_ENTRIES = 2**20


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

    Features ``i`` and ``i + R/2`` (``R = rotary_dim``, default ``dim``; features ``2i`` and
    ``2i + 1`` with ``interleaved``) of the token at position ``offset + s`` are rotated by
    the angle ``(offset + s) * theta_i``, ``theta_i = base**(-2i/R)`` unless ``scaling``
    rescales it; features past ``R`` pass through (see `multiattn.ops.rotary_embedding`).
    The angles are computed in float64 with NumPy and rounded to float32 (float64 under a
    float64 policy), so all backends agree bit for bit; float16/bfloat16 inputs are
    rotated in float32 and cast back. No weights.

    Args:
        max_length: number of positions (the longest ``offset + seq``).
        base: wavelength base, 10000 in RoFormer (``rope_theta`` in Hugging Face configs).
        rotary_dim: how many leading features of each head are rotated (even, at most
            ``dim``); None (default): all of them.
        interleaved: pair features ``(2i, 2i + 1)`` (RoFormer, GPT-J) instead of ``(i,
            i + R/2)`` (GPT-NeoX, Llama; the default).
        scaling: frequency scaling, a dict as Hugging Face's ``rope_scaling``: None,
            ``{"rope_type": "linear", "factor": f}`` or ``{"rope_type": "llama3", ...}``
            (see `multiattn.ops.rotary_embedding`).

    Call arguments:
        x: ``(batch, seq, heads, dim)`` floating, ``dim`` even (at least ``rotary_dim``
            when given).
        offset: position of the first token: an int, a NumPy integer or an integer
            scalar tensor. A known value (eager tensors included) must satisfy
            ``0 <= offset`` and ``offset + seq <= max_length`` (``ValueError``
            otherwise); its rows are sliced from cos/sin tables converted to tensors
            once per backend and dtype (up to `TABLE_ENTRIES` angles; rows past them are
            computed for the call alone, so a huge offset costs what a small one does).
            A traced offset (``jax.jit`` / ``tf.function``, e.g. the cache index of a
            compiled decoding step) reads rows of a ``(max_length, R/2)`` table;
            positions outside ``[0, max_length)`` cannot raise there and come out as NaN
            (never as the rotation of a clamped position).

    Returns:
        ``(batch, seq, heads, dim)`` in the compute dtype.
    """

    def __init__(
        self,
        max_length: int = 2048,
        base: float = 10000.0,
        rotary_dim: int | None = None,
        interleaved: bool = False,
        scaling: dict | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = "RotaryEmbedding"
        self.max_length = check_positive_int(where, "max_length", max_length)
        self.base = _check_base(where, base)
        self.rotary_dim = check_rotary_dim(where, rotary_dim, None)
        if not isinstance(interleaved, bool):
            raise TypeError(f"{where}: `interleaved` must be a bool; received {interleaved!r}.")
        self.interleaved = interleaved
        self.scaling = check_rotary_scaling(where, scaling)
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # (framework, dim, dtype) -> cos/sin tensors of positions 0 .. rows - 1, made once
        self._tensor_tables: dict[tuple[str, int, str], tuple[Any, Any]] = {}

    def _check_x(self, shape: tuple) -> None:
        where = "RotaryEmbedding"
        check_rank(where, "x", shape, 4, 4)
        if shape[-1] is None or (self.rotary_dim is None and shape[-1] % 2):
            raise ValueError(
                f"{where}: the last axis of `x` must be static and even; received "
                f"{fmt_shape(shape)}."
            )
        if self.rotary_dim is not None and shape[-1] < self.rotary_dim:
            raise ValueError(
                f"{where}: the last axis of `x` must hold at least rotary_dim="
                f"{self.rotary_dim} features; received {fmt_shape(shape)}."
            )

    def _angles(self, positions: Any, dim: int) -> tuple[np.ndarray, np.ndarray]:
        return rotary_angles(positions, dim, self.base, self.scaling)

    def build(self, input_shape):
        self._check_x(tuple(input_shape))

    def _table(self, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """The float64 cos/sin tables ``(max_length, dim/2)``, built on first use (a
        traced offset)."""
        if dim not in self._tables:
            self._tables[dim] = rotary_table(self.max_length, dim, self.base, self.scaling)
        return self._tables[dim]

    def _table_rows(self, dim: int) -> int:
        """How many positions the tensor tables of ``dim`` cover: all ``max_length``, or
        as many as `TABLE_ENTRIES` angles hold (positions past them are computed per
        call, as an offset of 10**8 needs)."""
        return min(self.max_length, max(1, TABLE_ENTRIES // (dim // 2)))

    def _tensor_table(self, ops: Any, dim: int, wide: str) -> tuple[Any, Any] | None:
        """The cos/sin tables of positions ``0 .. _table_rows(dim) - 1`` as tensors of
        ``ops`` in ``wide``, converted on first use and kept: a decoding step slices them
        instead of converting angles. None where the conversion gives symbolic tensors
        (first use inside ``jax.jit`` / ``tf.function``), which must not outlive their
        trace."""
        key = (ops.backend, dim, wide)
        tables = self._tensor_tables.get(key)
        if tables is None:
            rows = self._table_rows(dim)
            if rows == self.max_length:
                source = self._table(dim)
            else:
                source = self._angles(np.arange(rows), dim)
            tables = tuple(ops.convert_to_tensor(t.astype(wide), dtype=wide) for t in source)
            if any(ops.is_symbolic(t) for t in tables):
                return None
            self._tensor_tables[key] = tables
        return tables

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
        length, dim = shape[1], self.rotary_dim or shape[-1]
        offset = check_offset(where, offset, length, self.max_length, ops)
        dtype = self.compute_dtype
        wide = compute_dtype(dtype)
        if isinstance(offset, int):
            tables = None
            if offset + length <= self._table_rows(dim):
                tables = self._tensor_table(ops, dim, wide)
            if tables is not None:
                cos, sin = (t[offset : offset + length] for t in tables)
            else:
                angles = self._angles(offset + np.arange(length), dim)
                cos, sin = (ops.convert_to_tensor(t.astype(wide), dtype=wide) for t in angles)
        else:
            tables = None
            if self._table_rows(dim) == self.max_length:
                tables = self._tensor_table(ops, dim, wide)
            if tables is None:
                tables = (
                    ops.convert_to_tensor(t.astype(wide), dtype=wide) for t in self._table(dim)
                )
            cos, sin = (table_rows(ops, t, offset, length, self.max_length) for t in tables)
        return apply_rotary(ops, ops.cast(x, dtype), cos, sin, self.interleaved)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "max_length": self.max_length,
            "base": self.base,
            "rotary_dim": self.rotary_dim,
            "interleaved": self.interleaved,
            "scaling": None if self.scaling is None else dict(self.scaling),
        }

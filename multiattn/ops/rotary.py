"""Rotary position embedding (RoPE, Su et al. 2021, "RoFormer").

Each head's ``dim`` features are rotated in ``dim / 2`` planes, the plane of features
``i`` and ``i + dim/2`` (the "rotate half" pairing) by the angle ``t * theta_i`` with
``theta_i = base**(-2i / dim)`` and ``t`` the token's position. The dot product of a
rotated query at position ``m`` and a rotated key at position ``n`` then depends on
``m - n`` only.

The cos/sin tables depend on no input tensor: they are computed once in float64 with
NumPy and cast, so every backend receives bit-identical values.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._checks import (
    as_array,
    check_float,
    check_integer_scalar,
    check_positive_int,
    check_rank,
    fmt_shape,
    shape_of,
    to_tensor,
)
from .._namespace import get_ops

__all__ = ["apply_rotary", "rotary_angles", "rotary_embedding", "rotary_table"]


def _check_base(where: str, base: Any, name: str = "base") -> float:
    if (
        isinstance(base, bool)
        or not isinstance(base, (int, float, np.integer, np.floating))
        or not math.isfinite(base)
        or not base > 1
    ):
        raise ValueError(f"{where}: `{name}` must be a finite number > 1; received {base!r}.")
    return float(base)


def rotary_angles(
    positions: np.ndarray, dim: int, base: float = 10000.0
) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of the rotation angles of the given positions, float64 NumPy
    arrays ``(len(positions), dim/2)`` (validated ``dim`` and ``base``; internal).

    Entry ``[j, i]`` is for position ``positions[j]`` and plane ``i``, angle
    ``positions[j] * base**(-2i/dim)``: the rows of `rotary_table` at those positions,
    bit for bit, computed without the rows before them.
    """
    theta = base ** (-2.0 * np.arange(dim // 2, dtype=np.float64) / dim)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * theta[None, :]
    return np.cos(angles), np.sin(angles)


def rotary_table(length: int, dim: int, base: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of the rotation angles as float64 NumPy arrays ``(length, dim/2)``.

    Entry ``[t, i]`` belongs to position ``t`` and plane ``i`` (angle ``t * base**(-2i/dim)``).
    ``dim`` must be even.
    """
    where = "rotary_table"
    length = check_positive_int(where, "length", length)
    dim = check_positive_int(where, "dim", dim)
    if dim % 2:
        raise ValueError(f"{where}: `dim` must be even (features rotate in pairs); received {dim}.")
    base = _check_base(where, base)
    return rotary_angles(np.arange(length), dim, base)


def compute_dtype(dtype: str) -> str:
    """The dtype the rotation is computed in: float64 stays, everything else float32."""
    return "float64" if dtype == "float64" else "float32"


def apply_rotary(ops: Any, x: Any, cos: Any, sin: Any) -> Any:
    """Rotate ``x`` ``(B, T, H, D)`` by ``cos``/``sin`` ``(T, D/2)`` (validated; internal).

    The tables are in ``compute_dtype(x.dtype)``; half-precision ``x`` is rotated in
    float32 and the result cast back.
    """
    dtype = ops.dtype_name(x)
    if dtype != compute_dtype(dtype):
        x = ops.cast(x, "float32")
    half = shape_of(x)[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = ops.expand_dims(cos, 1)  # (T, 1, D/2): broadcast over heads
    sin = ops.expand_dims(sin, 1)
    out = ops.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out if dtype == compute_dtype(dtype) else ops.cast(out, dtype)


def rotary_embedding(x: Any, *, offset: int = 0, base: float = 10000.0) -> Any:
    """Rotary position embedding of ``x`` ``(batch, seq, heads, dim)``.

    Features ``i`` and ``i + dim/2`` of the token at position ``p = offset + s`` are
    rotated by ``p * base**(-2i/dim)``::

        out[..., i]         = x[..., i] cos - x[..., i + dim/2] sin
        out[..., i + dim/2] = x[..., i + dim/2] cos + x[..., i] sin

    Args:
        x: ``(batch, seq, heads, dim)`` floating, ``dim`` even, ``seq`` static: a tensor
            of the active backend (or a Paddle tensor), a NumPy array or a nested list.
        offset: position of the first token, a non-negative integer (0 for a whole
            sequence, the cache index when decoding token by token): a Python or NumPy
            integer, or an integer scalar tensor whose value is known (eager). Under
            ``jax.jit`` / ``tf.function`` a traced offset is refused (``TypeError``): the
            angles are computed in float64 NumPy from the value; use `RotaryEmbedding`,
            which takes traced offsets.
        base: the wavelength base (10000 in RoFormer), a finite number > 1.

    Returns:
        The rotated tensor, same shape and dtype as ``x``. Only the ``seq`` rows of
        angles needed (positions ``offset .. offset + seq - 1``) are computed, in float64,
        and rounded to float32 (kept in float64 for float64 ``x``): any offset costs the
        same. float16/bfloat16 ``x`` is rotated in float32 and the result cast back.
    """
    where = "rotary_embedding"
    ops = get_ops(x)
    x = to_tensor(ops, as_array(x))
    dtype = check_float(where, "x", x, ops)
    shape = shape_of(x)
    check_rank(where, "x", shape, 4, 4)
    if shape[1] is None or shape[3] is None:
        raise ValueError(
            f"{where}: the sequence and feature axes of `x` must be static; received "
            f"{fmt_shape(shape)}."
        )
    if shape[3] % 2:
        raise ValueError(
            f"{where}: the feature axis of `x` must be even; received shape {fmt_shape(shape)}."
        )
    base = _check_base(where, base)
    offset = check_integer_scalar(where, "offset", offset, ops)
    if not isinstance(offset, int):
        raise TypeError(
            f"{where}: `offset` must have a value when the call runs; received a symbolic "
            "(traced) tensor. Use multiattn.layers.RotaryEmbedding for traced offsets."
        )
    if offset < 0:
        raise ValueError(f"{where}: `offset` must be a non-negative int; received {offset!r}.")
    cos, sin = rotary_angles(offset + np.arange(shape[1]), shape[3], base)
    wide = compute_dtype(dtype)
    cos = ops.convert_to_tensor(cos.astype(wide), dtype=wide)
    sin = ops.convert_to_tensor(sin.astype(wide), dtype=wide)
    return apply_rotary(ops, x, cos, sin)

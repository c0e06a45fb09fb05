"""Argument validation shared by the core functions and layers.

Every check raises ``ValueError`` or ``TypeError`` naming the function, the argument
and the value or shape received, so bad input never reaches a backend kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Shape = tuple[int | None, ...]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")


def as_array(x: Any) -> Any:
    """Leave tensors alone; turn Python lists and scalars into NumPy arrays."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return x
    return np.asarray(x)


def to_tensor(ops: Any, x: Any) -> Any:
    """A NumPy array as a tensor of the ``ops`` namespace's framework (its dtype kept);
    anything else unchanged. Arithmetic mixing NumPy arrays with framework tensors fails
    on some backends (torch), so public entry points convert NumPy inputs first."""
    if isinstance(x, np.ndarray):
        return ops.convert_to_tensor(x, dtype=str(x.dtype) if x.dtype != np.bool_ else "bool")
    return x


def shape_of(x: Any) -> Shape:
    """Static shape of ``x`` with ``None`` for unknown dimensions."""
    shape = x.shape
    if hasattr(shape, "as_list"):  # tf.TensorShape
        shape = shape.as_list() if shape.rank is not None else ()
    return tuple(_static_dim(d) for d in shape)


def _static_dim(d: Any) -> int | None:
    if d is None:
        return None
    try:
        return int(d)
    except Exception:  # a symbolic dimension (JAX shape polymorphism, graph tensors)
        return None


def check_float(where: str, name: str, x: Any, ns: Any) -> str:
    """Require a floating dtype; return the dtype name."""
    dtype = ns.dtype_name(x)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{where}: `{name}` must be a floating tensor ({', '.join(FLOAT_DTYPES)}); "
            f"received dtype {dtype}."
        )
    return dtype


def check_rank(where: str, name: str, shape: Shape, min_rank: int, max_rank: int | None = None):
    rank = len(shape)
    if rank < min_rank or (max_rank is not None and rank > max_rank):
        want = (
            f"at least {min_rank}"
            if max_rank is None
            else (f"{min_rank}" if min_rank == max_rank else f"{min_rank} to {max_rank}")
        )
        raise ValueError(
            f"{where}: `{name}` must have rank {want}; received shape {fmt_shape(shape)}."
        )


def fmt_shape(shape: Sequence[int | None]) -> str:
    return (
        "("
        + ", ".join("?" if d is None else str(d) for d in shape)
        + ("," if len(shape) == 1 else "")
        + ")"
    )


def dims_match(a: int | None, b: int | None) -> bool:
    return a is None or b is None or a == b


def broadcast_shape(where: str, name: str, shape: Shape, target: Shape) -> None:
    """Require ``shape`` to broadcast to ``target`` (NumPy rules, right-aligned)."""
    ok = len(shape) <= len(target) and all(
        s == 1 or dims_match(s, t) for s, t in zip(reversed(shape), reversed(target))
    )
    if not ok:
        raise ValueError(
            f"{where}: `{name}` of shape {fmt_shape(shape)} does not broadcast to "
            f"{fmt_shape(target)}."
        )


def check_rate(where: str, name: str, rate: Any) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.floating)):
        raise TypeError(f"{where}: `{name}` must be a float in [0, 1); received {rate!r}.")
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{where}: `{name}` must be in [0, 1); received {rate!r}.")
    return rate


def check_scale(where: str, scale: Any) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"{where}: `scale` must be a positive float or None; received {scale!r}.")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{where}: `scale` must be a positive finite float; received {scale!r}.")
    return scale


def check_positive_int(where: str, name: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{where}: `{name}` must be a positive integer; received {value!r}.")
    return int(value)


def check_choice(where: str, name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(
            f"{where}: `{name}` must be one of {', '.join(map(repr, choices))}; received {value!r}."
        )
    return value


def concrete(ns: Any, x: Any) -> np.ndarray | None:
    """The value of ``x`` as NumPy, or None when ``x`` is symbolic (traced, graph)."""
    if isinstance(x, np.ndarray):
        return x
    if ns.is_symbolic(x):
        return None
    try:
        return np.asarray(ns.convert_to_numpy(x))
    except Exception:  # a tensor with no value in this context
        return None

"""Argument validation shared by the core functions and layers.

Every check raises ``ValueError`` or ``TypeError`` naming the function, the argument
and the value or shape received, so bad input never reaches a backend kernel.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

Shape = tuple[int | None, ...]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")


def as_array(x: Any) -> Any:
    """Leave tensors alone; turn Python lists and scalars into NumPy arrays.

    What NumPy cannot make a numeric array of (``None``, strings, ragged nested lists)
    becomes an array of dtype object or string, which the dtype checks (`check_float`)
    refuse naming the argument, instead of failing here without a name."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return x
    try:
        return np.asarray(x)
    except ValueError:  # a ragged nested list
        arr = np.empty((), dtype=object)
        arr[()] = x
        return arr


def to_tensor(ops: Any, x: Any) -> Any:
    """A NumPy array as a tensor of the ``ops`` namespace's framework (its dtype kept);
    anything else unchanged. Arithmetic mixing NumPy arrays with framework tensors fails
    on some backends (torch), so public entry points convert NumPy inputs first."""
    if isinstance(x, np.ndarray) and x.dtype.kind not in "OSU":  # others: refused later
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
    """Require a floating dtype; return the dtype name. ``None``, strings and other
    objects (NumPy object or string arrays, dtypes the namespace does not know) raise
    ``TypeError`` naming the argument too."""
    if isinstance(x, np.ndarray) and x.dtype.kind in "OSU":
        got = repr(x.item()) if x.ndim == 0 else f"an array of dtype {x.dtype}"
        if x.ndim == 0 and isinstance(x.item(), (list, tuple)):
            got = "a ragged nested list (rows of different lengths)"
        raise TypeError(
            f"{where}: `{name}` must be a floating tensor ({', '.join(FLOAT_DTYPES)}); "
            f"received {got[:80]}."
        )
    try:
        dtype = ns.dtype_name(x)
    except Exception:  # a dtype the backend does not know (object, string, complex on Paddle)
        dtype = str(getattr(x, "dtype", type(x).__name__))
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
    """The value of ``x`` as NumPy, or None when ``x`` is symbolic (traced, graph) and
    not a TensorFlow constant."""
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x)
    if ns.is_symbolic(x):
        return _tf_static_value(x)  # a TensorFlow constant has a value in a graph too
    try:
        return np.asarray(ns.convert_to_numpy(x))
    except Exception:  # a tensor with no value in this context
        return None


def describe(x: Any) -> str:
    """A short description of ``x`` for error messages: the repr of a Python value (cut
    at 80 characters), the dtype and shape of an array or tensor."""
    if hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.generic):
        try:
            shape = fmt_shape(shape_of(x))
        except Exception:  # pragma: no cover - a shape that cannot be read
            shape = "?"
        return f"a {type(x).__name__} of dtype {x.dtype} and shape {shape}"
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _tf_static_value(x: Any) -> np.ndarray | None:
    """The value of a TensorFlow graph tensor that is a constant (``tf.get_static_value``),
    else None."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(x, tf.Tensor):
        return None
    try:
        value = tf.get_static_value(x)
    except Exception:  # pragma: no cover - not a tensor TensorFlow can fold
        return None
    return None if value is None else np.asarray(value)


def check_flag(where: str, name: str, value: Any, ns: Any = None, allow_none: bool = False) -> bool:
    """A Python flag: ``True``/``False`` or a NumPy bool (None too with ``allow_none``,
    meaning False). A 0-d bool tensor with a value counts as its value: Keras turns a
    NumPy bool passed to a layer into one. Anything else (``"False"``, ``1``, a symbolic
    tensor) raises ``TypeError``: the flag picks the computation in Python, so its value
    must be known when the call runs."""
    if value is None and allow_none:
        return False
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if ns is not None and hasattr(value, "shape") and hasattr(value, "dtype"):
        try:
            is_bool = shape_of(value) == () and ns.dtype_name(value) == "bool"
        except Exception:
            is_bool = False
        if is_bool:
            known = concrete(ns, value)
            if known is not None:
                return bool(known)
            raise TypeError(
                f"{where}: `{name}` must be a Python bool; received a symbolic (traced) bool "
                "tensor, whose value is not known when the call decides what to compute."
            )
    none = " or None" if allow_none else ""
    raise TypeError(f"{where}: `{name}` must be a bool{none}; received {describe(value)}.")


def check_seed(where: str, seed: Any, name: str = "seed") -> Any:
    """A dropout seed: None, an int (a NumPy integer is returned as an int), a
    ``keras.random.SeedGenerator``, or on JAX a ``jax.Array`` key (as Keras' JAX backend
    takes); anything else raises ``TypeError``."""
    if seed is None:
        return None
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
        return int(seed)
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(seed, keras.random.SeedGenerator):
        return seed
    jax = sys.modules.get("jax")
    if (
        jax is not None
        and keras is not None
        and keras.backend.backend() == "jax"
        and isinstance(seed, jax.Array)
    ):
        return seed
    raise TypeError(
        f"{where}: `{name}` must be None, an int or a keras.random.SeedGenerator; "
        f"received {describe(seed)}."
    )


def check_call_flags(
    where: str,
    *,
    training: Any,
    return_weights: Any,
    seed: Any,
    query: Any = None,
    scale: Any = None,
) -> tuple[bool, bool, Any]:
    """The entry checks of an attention function: ``training`` (a bool, None meaning
    False), ``return_weights`` (a bool), the dropout ``seed`` (`check_seed`) and, when
    ``query`` is given, that the default scale exists (`check_default_scale`). Returns
    ``(training, return_weights, seed)`` as ``(bool, bool, seed)``."""
    flags = (
        check_flag(where, "training", training, allow_none=True),
        check_flag(where, "return_weights", return_weights),
        check_seed(where, seed),
    )
    if query is not None:
        check_default_scale(where, query, scale)
    return flags


def check_default_scale(where: str, query: Any, scale: Any, name: str = "query") -> None:
    """With no ``scale`` the dot products are scaled by ``1/sqrt(width)``: a ``query``
    whose last axis is statically 0 has no such scale and raises ``ValueError``."""
    if scale is not None:
        return
    try:
        shape = shape_of(query) if hasattr(query, "shape") else np.shape(query)
    except Exception:  # a ragged list or an object without a shape: refused later
        return
    if len(shape) and shape[-1] == 0:
        raise ValueError(
            f"{where}: `{name}` has width 0 (shape {fmt_shape(shape)}): the default scale "
            "1/sqrt(width) is undefined; give inputs with at least one feature."
        )


def check_integer_scalar(where: str, name: str, value: Any, ns: Any) -> int | Any:
    """An integer scalar: a Python or NumPy integer, or a 0-d integer array or tensor.

    Returns a Python int when the value is known (Python and NumPy values, eager tensors,
    TensorFlow constants) and the tensor itself when it is symbolic (traced under
    ``jax.jit`` or ``tf.function``). Bools, floats and non-scalars raise ``TypeError``.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: `{name}` must be an integer; received {value!r}.")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise TypeError(
            f"{where}: `{name}` must be an int or an integer scalar tensor; received "
            f"{describe(value)}."
        )
    try:
        dtype = ns.dtype_name(value)
    except Exception:
        dtype = str(value.dtype)
    shape = shape_of(value)
    if "int" not in dtype or shape != ():
        raise TypeError(
            f"{where}: `{name}` must be an int or an integer scalar tensor; received dtype "
            f"{dtype} and shape {fmt_shape(shape)}."
        )
    known = concrete(ns, value)
    return value if known is None else int(known)


def check_relative_buckets(
    where: str, num_buckets: int, max_distance: int, names: tuple[str, str]
) -> None:
    """T5's relative position buckets need ``num_buckets >= 4`` (the encoder's buckets of
    one direction, half of them, hold an exact half of 1 or more) and ``max_distance >
    num_buckets // 2`` (the logarithmic buckets need a range past the exact ones); else
    the bucket arithmetic divides by zero and gives NaN or wrapped indices. ``names``:
    the two arguments' names in the messages."""
    if num_buckets < 4:
        raise ValueError(
            f"{where}: `{names[0]}` must be at least 4 (the encoder's buckets of one "
            f"direction must be 2 or more); received {num_buckets}."
        )
    if max_distance <= num_buckets // 2:
        raise ValueError(
            f"{where}: `{names[1]}` must exceed {names[0]} // 2 = {num_buckets // 2} (the "
            f"distances with a bucket each); received {max_distance}."
        )


def check_bool(where: str, name: str, value: Any) -> bool:
    """``value`` if it is a bool (NumPy bools and ints refused: a config flag of 1 or
    "yes" is a mistake); else `TypeError` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: `{name}` must be a bool; received {describe(value)}.")
    return value


def is_floating(dtype: Any) -> bool:
    """Whether ``dtype`` (a NumPy dtype or an array's) is a floating dtype NumPy holds:
    float16, float32, float64 or ml_dtypes' bfloat16 (which NumPy lists as kind ``V``;
    ml_dtypes' float8 types are not included)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"


def check_mask_dtype(where: str, name: str, dtype: str) -> None:
    """A padding mask's dtype (its name: ``"bool"``, ``"int64"``, ``"<U1"``, ...) must be
    bool, integer or floating: ValueError naming ``name`` and the dtype otherwise (strings,
    objects, complex), before a framework converts it with a message naming neither."""
    if dtype != "bool" and not dtype.startswith(("int", "uint", "float", "bfloat")):
        raise ValueError(
            f"{where}: `{name}` must hold 1 / True for real tokens and 0 / False for padding "
            f"(bool, integer or floating); received {dtype}."
        )

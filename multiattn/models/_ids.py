"""The token-id inputs of the models' calls: an integer ``(batch, seq)`` array whose
values index a table of ``vocab`` rows.

Eagerly the values are checked (`ValueError` naming the argument, the first bad value
and the table size). Inside a compiled function (``jax.jit``, ``tf.function``, a Keras
symbolic call) no value can be checked: there an id outside ``[0, vocab)``, int64 ids
of 2**31 or more included, gives NaN states for its token (`poison`), never another
row's embedding.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from .._checks import check_mask_dtype, concrete
from ..namespaces.keras import get_ops

__all__ = ["ids_and_mask", "padding_mask", "poison", "token_ids"]


def token_ids(where: str, name: str, ids: Any, vocab: int) -> tuple[Any, Any]:
    """``(ids as int32, valid)``: ``ids`` (NumPy, a nested list or a tensor, integer
    ``(batch, seq)``) checked. ``valid`` is None when the values were checked, else a bool
    ``(batch, seq)`` tensor of the ids inside ``[0, vocab)`` (the others read row 0; give
    the states to `poison`).

    Raises:
        ValueError: not an integer ``(batch, seq)`` array, an empty one (a batch or a
            length of 0); eagerly, a value outside
            ``[0, vocab)`` (named with the value and ``vocab``).
    """
    raw = ids if hasattr(ids, "shape") and hasattr(ids, "dtype") else np.asarray(ids)
    ns = get_ops(raw, names=(name,), where=where)
    dtype = _dtype(ns, raw)
    if len(raw.shape) != 2 or not dtype.startswith(("int", "uint")):
        raise ValueError(
            f"{where}: `{name}` must be an integer (batch, seq) array; received shape "
            f"{tuple(raw.shape)} of {dtype}."
        )
    if any(d == 0 for d in raw.shape):  # nothing to embed: a model of no token
        raise ValueError(
            f"{where}: `{name}` must hold at least one row of at least one token; received "
            f"shape {tuple(raw.shape)}."
        )
    value = concrete(ns, raw)
    ops = keras.ops
    if value is not None:
        bad = value[(value < 0) | (value >= vocab)]
        if bad.size:
            raise ValueError(
                f"{where}: `{name}` must hold token ids in [0, {vocab}) (vocab_size="
                f"{vocab}); received {bad.flat[0]} (values in [{value.min()}, {value.max()}])."
            )
        return ops.cast(ops.convert_to_tensor(raw), "int32"), None  # in range: no wrap
    tensor = ops.convert_to_tensor(raw)
    valid = ops.logical_and(ops.greater_equal(tensor, 0), ops.less(tensor, vocab))
    return ops.cast(ops.where(valid, tensor, 0), "int32"), valid


def _dtype(ns: Any, raw: Any) -> str:
    try:
        return ns.dtype_name(raw)
    except (ValueError, TypeError):  # strings, objects: no framework dtype
        return str(raw.dtype)


def padding_mask(where: str, name: str, mask: Any, ids: Any) -> Any:
    """``mask`` (NumPy, a nested list or a tensor; non-zero / True = a real token, 0 /
    False = padding) as a tensor of its own dtype, checked to be bool, integer or floating
    and of the shape of ``ids``.

    Raises:
        ValueError: another dtype (strings, objects, complex) or another shape, naming
            ``name``, the dtype or both shapes.
    """
    raw = mask if hasattr(mask, "shape") and hasattr(mask, "dtype") else np.asarray(mask)
    check_mask_dtype(where, name, _dtype(get_ops(raw, names=(name,), where=where), raw))
    if tuple(raw.shape) != tuple(ids.shape):
        raise ValueError(
            f"{where}: `{name}` must have the shape of the ids {tuple(ids.shape)}; received "
            f"{tuple(raw.shape)}."
        )
    return keras.ops.convert_to_tensor(raw)


def ids_and_mask(where: str, input_ids: Any, attention_mask: Any, vocab: int) -> tuple:
    """``(int32 ids, valid or None, int32 0/1 mask)`` of a model's ``input_ids`` and
    ``attention_mask`` (`token_ids`, `padding_mask`; no mask: all ones)."""
    ops = keras.ops
    ids, valid = token_ids(where, "input_ids", input_ids, vocab)
    if attention_mask is None:
        return ids, valid, ops.ones_like(ids)
    mask = padding_mask(where, "attention_mask", attention_mask, ids)
    return ids, valid, ops.cast(ops.not_equal(mask, 0), "int32")


def poison(x: Any, valid: Any) -> Any:
    """``x`` ``(batch, seq, ...)`` with NaN at the tokens ``valid`` marks False (`token_ids`
    of a compiled call); unchanged when ``valid`` is None."""
    if valid is None:
        return x
    ops = keras.ops
    for _ in range(len(x.shape) - 2):
        valid = ops.expand_dims(valid, -1)
    return ops.where(valid, x, ops.cast(float("nan"), x.dtype))

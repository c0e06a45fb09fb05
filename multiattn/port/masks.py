"""Translate attention masks between frameworks and multiattn's keep mask.

Pure NumPy: every function takes NumPy arrays or any framework's tensors (they go through
``np.asarray``, so move GPU tensors to the CPU first) and returns NumPy arrays. No
framework is imported.

**Canonical form** (what every ``from_*`` function returns and every ``to_*`` function
takes): a boolean *keep* mask of rank 4, broadcastable to
``(batch, heads, queries, keys)``, **True = may attend**. Axes of size 1 broadcast. It is
what `multiattn.layers.MultiHeadAttention` takes as ``mask`` (and, after dropping the
head axis, what `multiattn.ops.scaled_dot_product_attention` takes for 3-D inputs).

The conventions (measured by running each framework, see ``docs/masks.md``):

| source | argument | polarity |
| --- | --- | --- |
| ``torch.nn.MultiheadAttention`` | ``key_padding_mask (B, S)`` | bool True = ignore key; float added |
| ``torch.nn.MultiheadAttention`` | ``attn_mask (T, S)`` or ``(B*H, T, S)`` | bool True = *not* allowed; float added |
| ``F.scaled_dot_product_attention`` | ``attn_mask (..., T, S)`` | bool True = take part; float added |
| ``keras.layers.MultiHeadAttention`` | ``attention_mask (B, T, S)`` | True / 1 = attend |
| ``jax.nn.dot_product_attention`` | ``mask (B, H, T, S)`` | bool True = keep |
| ``paddle.nn.MultiHeadAttention`` | ``attn_mask (B, H, T, S)`` | bool True / int 1 = keep; float added |
| TensorFlow tutorial document | ``mask``, float | 1 = masked out |
| d2l document | ``valid_lens (B,)`` or ``(B, T)`` | keys ``< length`` kept |

An additive (float) mask translates to a keep mask only when it holds nothing but ``0``
(allowed) and blocking values: ``-inf`` or anything ``<= blocked_at`` (default ``-1e4``;
``-1e9`` and the float16 minimum qualify). Any other value is a *bias*, not a mask, and
is refused with ``ValueError``.

A query row in which no key may be attended is translated like any other row; what each
framework then computes for it differs (NaN, uniform weights or zeros, see
``docs/fully-masked-rows.md``); `empty_rows` finds such rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._checks import is_floating

__all__ = [
    "additive_to_keep",
    "as_keep",
    "causal_keep",
    "combine",
    "empty_rows",
    "from_jax_mask",
    "from_keras_mask",
    "from_paddle_mask",
    "from_sdpa_mask",
    "from_tf_document_mask",
    "from_torch_attn_mask",
    "from_torch_key_padding_mask",
    "from_valid_lens",
    "keep_to_additive",
    "to_jax_mask",
    "to_keras_mask",
    "to_paddle_mask",
    "to_sdpa_mask",
    "to_tf_document_mask",
    "to_torch_attn_mask",
    "to_torch_key_padding_mask",
    "to_valid_lens",
]

BLOCKED_AT = -1e4  # additive values at or below this count as "blocked"
Shape4 = tuple[int, int, int, int]


# --- helpers -----------------------------------------------------------------------------


def _array(x: Any, name: str) -> np.ndarray:
    if x is None:
        raise ValueError(f"`{name}` must be an array; received None.")
    if hasattr(x, "detach"):  # a torch tensor that requires grad
        x = x.detach()
    if hasattr(x, "cpu") and not isinstance(x, np.ndarray):
        x = x.cpu()
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):
        x = x.numpy()
    return np.asarray(x)


def _kind(arr: np.ndarray) -> str:
    if arr.dtype == bool:
        return "bool"
    if np.issubdtype(arr.dtype, np.integer):
        return "int"
    if is_floating(arr.dtype):
        return "float"
    return "other"


def _check_rank(name: str, arr: np.ndarray, ranks: Sequence[int]) -> None:
    if arr.ndim not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ValueError(f"`{name}` must have rank {want}; received shape {arr.shape}.")


def _zero_one(name: str, arr: np.ndarray) -> np.ndarray:
    """A 0/1 array (any numeric dtype) as bool; ValueError quoting the first other value."""
    values = arr.astype(np.float64) if _kind(arr) == "float" else arr
    bad = ~((values == 0) | (values == 1))
    if np.any(bad):
        raise ValueError(
            f"`{name}` must hold only 0 and 1; received the value {arr[bad].flat[0].item()!r}."
        )
    return values == 1


def _rank4(keep: np.ndarray) -> np.ndarray:
    return keep.reshape((1,) * (4 - keep.ndim) + keep.shape)


def _broadcast(keep: np.ndarray, shape: Sequence[int] | None, name: str = "shape") -> np.ndarray:
    if shape is None:
        return keep
    shape = tuple(int(d) for d in shape)
    if len(shape) != 4:
        raise ValueError(
            f"`{name}` must be (batch, heads, queries, keys), 4 sizes; received {shape}."
        )
    try:
        return np.broadcast_to(keep, shape)
    except ValueError:
        raise ValueError(
            f"`keep` of shape {keep.shape} does not broadcast to `{name}` {shape}."
        ) from None


def _constant_along(keep: np.ndarray, axis: int, what: str, target: str) -> np.ndarray:
    """``keep`` with ``axis`` reduced to size 1; ValueError if it varies along it."""
    if keep.shape[axis] == 1:
        return keep
    first = np.take(keep, [0], axis=axis)
    if not np.all(keep == first):
        raise ValueError(
            f"{target} cannot express a mask that differs between {what}; `keep` of shape "
            f"{keep.shape} does."
        )
    return first


# --- the canonical form ------------------------------------------------------------------


def as_keep(mask: Any, name: str = "keep") -> np.ndarray:
    """Validate a keep mask (True / non-zero = may attend) and return it in canonical form.

    ``mask``: bool, or integer 0/1, of rank 0 to 4, broadcastable to
    ``(batch, heads, queries, keys)``; lower ranks get leading axes of size 1 (a
    ``(queries, keys)`` mask becomes ``(1, 1, queries, keys)``). Float masks are refused
    with ``TypeError``: they may be additive, so pass them through `additive_to_keep`.
    Returns a bool array of rank 4.
    """
    arr = _array(mask, name)
    kind = _kind(arr)
    if kind == "float" or kind == "other":
        raise TypeError(
            f"`{name}` must be a boolean (True = may attend) or 0/1 integer mask; received "
            f"dtype {arr.dtype}. Convert an additive float mask with additive_to_keep()."
        )
    if arr.ndim > 4:
        raise ValueError(
            f"`{name}` must be broadcastable to (batch, heads, queries, keys), rank <= 4; "
            f"received shape {arr.shape}."
        )
    keep = arr if kind == "bool" else _zero_one(name, arr)
    return _rank4(keep)


def combine(*keeps: Any) -> np.ndarray:
    """Logical AND of keep masks (None entries are ignored): a key may be attended only
    where every mask allows it. Returns the canonical rank-4 bool mask of the broadcast
    shape; ValueError if the shapes do not broadcast together."""
    masks = [as_keep(k, f"keeps[{i}]") for i, k in enumerate(keeps) if k is not None]
    if not masks:
        raise ValueError("combine() needs at least one mask; received none.")
    try:
        shape = np.broadcast_shapes(*(m.shape for m in masks))
    except ValueError:
        raise ValueError(
            f"masks of shapes {[m.shape for m in masks]} do not broadcast together."
        ) from None
    out = np.ones(shape, dtype=bool)
    for m in masks:
        out = out & m
    return out


def empty_rows(keep: Any, shape: Sequence[int] | None = None) -> np.ndarray:
    """Query rows in which no key may be attended: bool ``(batch, heads, queries)``
    (broadcast axes stay of size 1 unless ``shape`` gives the full size)."""
    k = _broadcast(as_keep(keep), shape)
    return ~np.any(k, axis=-1)


def causal_keep(query_len: int, key_len: int, align: str = "bottom_right") -> np.ndarray:
    """Causal keep mask ``(1, 1, query_len, key_len)``.

    ``align="bottom_right"`` (multiattn's ``causal=True``): query ``i`` may attend key ``j``
    when ``j <= i + key_len - query_len``. ``align="top_left"`` (PyTorch's ``is_causal``,
    Keras' ``use_causal_mask``, JAX's ``is_causal``): when ``j <= i``. The two agree when
    ``query_len == key_len``.
    """
    for name, value in (("query_len", query_len), ("key_len", key_len)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"`{name}` must be an integer >= 0; received {value!r}.")
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"`align` must be 'bottom_right' or 'top_left'; received {align!r}.")
    offset = key_len - query_len if align == "bottom_right" else 0
    i = np.arange(query_len)[:, None]
    j = np.arange(key_len)[None, :]
    return _rank4(j <= i + offset)


def additive_to_keep(mask: Any, blocked_at: float = BLOCKED_AT, name: str = "mask") -> np.ndarray:
    """An additive float mask (0 = allowed, ``-inf`` or ``<= blocked_at`` = blocked) as a
    bool keep mask of the same shape (not reshaped).

    Any other value (a positive number, a small negative bias, NaN) has no boolean
    meaning: ``ValueError`` quoting it. ``blocked_at`` must be negative.
    """
    if not blocked_at < 0:
        raise ValueError(f"`blocked_at` must be negative; received {blocked_at!r}.")
    arr = _array(mask, name)
    if _kind(arr) != "float":
        raise TypeError(f"`{name}` must be a float (additive) mask; received dtype {arr.dtype}.")
    values = arr.astype(np.float64)
    keep = values == 0
    blocked = values <= blocked_at  # -inf included; NaN is neither
    bad = ~(keep | blocked)
    if np.any(bad):
        raise ValueError(
            f"`{name}` is an additive mask: every value must be 0 (allowed) or <= {blocked_at:g} "
            f"(blocked, -inf included); received the value {values[bad].flat[0].item()!r}, a bias with "
            "no boolean equivalent."
        )
    return keep


def keep_to_additive(
    keep: Any, fill: float = float("-inf"), dtype: str = "float32", name: str = "keep"
) -> np.ndarray:
    """A keep mask (any rank) as an additive float mask: 0 where kept, ``fill`` elsewhere.

    ``fill`` must be ``-inf`` or ``<= -1e4`` so that `additive_to_keep` reads it back.
    ``dtype`` is a NumPy float dtype name. Same shape as ``keep``.
    """
    if not fill <= BLOCKED_AT:
        raise ValueError(f"`fill` must be -inf or <= {BLOCKED_AT:g}; received {fill!r}.")
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"`dtype` must be a NumPy float dtype name; received {dtype!r}.") from None
    if np_dtype.kind != "f":
        raise ValueError(f"`dtype` must be a float dtype; received {dtype!r}.")
    k = _array(keep, name)
    if _kind(k) != "bool":
        k = as_keep(k, name).reshape(k.shape)
    return np.where(k, np.asarray(0, np_dtype), np.asarray(fill, np_dtype)).astype(np_dtype)


def _from_bool_or_additive(mask: Any, name: str, blocked_at: float, true_means_keep: bool):
    arr = _array(mask, name)
    kind = _kind(arr)
    if kind == "bool":
        return arr if true_means_keep else ~arr
    if kind == "float":
        return additive_to_keep(arr, blocked_at, name)
    raise TypeError(
        f"`{name}` must be boolean or an additive float mask; received dtype {arr.dtype}."
    )


def _to_bool_or_additive(keep: np.ndarray, additive: bool, true_means_keep: bool, dtype: str):
    if additive:
        return keep_to_additive(keep, dtype=dtype)
    return np.array(keep if true_means_keep else ~keep)


# --- PyTorch -----------------------------------------------------------------------------


def from_torch_key_padding_mask(key_padding_mask: Any, blocked_at: float = BLOCKED_AT):
    """``torch.nn.MultiheadAttention``'s ``key_padding_mask`` ``(batch, keys)`` as a keep
    mask ``(batch, 1, 1, keys)``.

    Bool: **True = ignore this key**. Float: added to the scores (0 / ``-inf``).
    """
    arr = _array(key_padding_mask, "key_padding_mask")
    _check_rank("key_padding_mask", arr, (2,))
    keep = _from_bool_or_additive(arr, "key_padding_mask", blocked_at, true_means_keep=False)
    return keep[:, None, None, :]


def to_torch_key_padding_mask(
    keep: Any, shape: Sequence[int] | None = None, additive: bool = False, dtype: str = "float32"
) -> np.ndarray:
    """A keep mask as ``key_padding_mask`` ``(batch, keys)``: bool True = ignore (or, with
    ``additive=True``, float 0 / ``-inf`` of ``dtype``).

    ``keep`` must not vary over heads or queries (ValueError otherwise: use
    `to_torch_attn_mask`). ``shape`` ``(batch, heads, queries, keys)`` broadcasts
    ``keep`` first (to give the batch and key sizes when ``keep`` has size-1 axes).
    """
    k = _broadcast(as_keep(keep), shape)
    k = _constant_along(k, 1, "heads", "key_padding_mask")
    k = _constant_along(k, 2, "queries", "key_padding_mask")
    return _to_bool_or_additive(k[:, 0, 0, :], additive, False, dtype)


def from_torch_attn_mask(
    attn_mask: Any, num_heads: int | None = None, blocked_at: float = BLOCKED_AT
) -> np.ndarray:
    """``torch.nn.MultiheadAttention``'s ``attn_mask`` as a keep mask.

    ``(queries, keys)`` gives ``(1, 1, queries, keys)``; ``(batch * num_heads, queries,
    keys)`` gives ``(batch, num_heads, queries, keys)`` (torch orders the first axis batch
    major, head minor) and needs ``num_heads``. Bool: **True = not allowed**. Float: added
    to the scores.
    """
    arr = _array(attn_mask, "attn_mask")
    _check_rank("attn_mask", arr, (2, 3))
    keep = _from_bool_or_additive(arr, "attn_mask", blocked_at, true_means_keep=False)
    if arr.ndim == 2:
        return _rank4(keep)
    if num_heads is None or isinstance(num_heads, bool) or int(num_heads) < 1:
        raise ValueError(
            f"`num_heads` (>= 1) is needed to split a 3-D attn_mask of shape {arr.shape}; "
            f"received {num_heads!r}."
        )
    if arr.shape[0] % num_heads:
        raise ValueError(
            f"`attn_mask` of shape {arr.shape}: the first axis must be batch * num_heads, a "
            f"multiple of num_heads={num_heads}."
        )
    return keep.reshape(arr.shape[0] // num_heads, num_heads, *arr.shape[1:])


def to_torch_attn_mask(
    keep: Any,
    num_heads: int | None = None,
    shape: Sequence[int] | None = None,
    additive: bool = False,
    dtype: str = "float32",
) -> np.ndarray:
    """A keep mask as ``torch.nn.MultiheadAttention``'s ``attn_mask``: bool **True = not
    allowed** (or, with ``additive=True``, float 0 / ``-inf`` of ``dtype``).

    A mask that is the same for every batch entry and head becomes ``(queries, keys)``;
    otherwise ``(batch * num_heads, queries, keys)``, which needs ``num_heads`` (and the
    batch size, from ``keep`` or ``shape``). ``shape`` ``(batch, heads, queries, keys)``
    broadcasts ``keep`` first.
    """
    k = _broadcast(as_keep(keep), shape)
    if k.shape[0] == 1 and k.shape[1] == 1:
        return _to_bool_or_additive(k[0, 0], additive, False, dtype)
    if num_heads is None or isinstance(num_heads, bool) or int(num_heads) < 1:
        raise ValueError(
            f"`num_heads` (>= 1) is needed for a mask that varies over batch or heads; "
            f"`keep` has shape {k.shape}; received num_heads={num_heads!r}."
        )
    if k.shape[1] not in (1, num_heads):
        raise ValueError(
            f"`keep` of shape {k.shape} has {k.shape[1]} heads; num_heads={num_heads}."
        )
    k = np.broadcast_to(k, (k.shape[0], num_heads, *k.shape[2:]))
    flat = k.reshape(k.shape[0] * num_heads, *k.shape[2:])
    return _to_bool_or_additive(flat, additive, False, dtype)


def from_sdpa_mask(attn_mask: Any, blocked_at: float = BLOCKED_AT) -> np.ndarray:
    """``torch.nn.functional.scaled_dot_product_attention``'s ``attn_mask`` (rank 2 to 4,
    broadcastable to ``(batch, heads, queries, keys)``) as a keep mask of rank 4.

    Bool: **True = takes part** (the opposite of ``nn.MultiheadAttention``). Float: added
    to the scores.
    """
    arr = _array(attn_mask, "attn_mask")
    _check_rank("attn_mask", arr, (2, 3, 4))
    return _rank4(_from_bool_or_additive(arr, "attn_mask", blocked_at, true_means_keep=True))


def to_sdpa_mask(
    keep: Any, shape: Sequence[int] | None = None, additive: bool = False, dtype: str = "float32"
) -> np.ndarray:
    """A keep mask as ``F.scaled_dot_product_attention``'s ``attn_mask``, rank 4: bool
    True = takes part, or with ``additive=True`` float 0 / ``-inf`` of ``dtype``.
    ``shape`` broadcasts it first. (For ``is_causal=True``, which is top-left aligned, the
    equivalent keep mask is ``causal_keep(T, S, "top_left")``.)"""
    k = _broadcast(as_keep(keep), shape)
    return _to_bool_or_additive(k, additive, True, dtype)


# --- Keras and JAX -----------------------------------------------------------------------


def from_keras_mask(attention_mask: Any) -> np.ndarray:
    """``keras.layers.MultiHeadAttention``'s ``attention_mask`` ``(batch, queries, keys)``
    (bool, or 0/1 integer or float: **1 / True = may attend**) as ``(batch, 1, queries,
    keys)``."""
    arr = _array(attention_mask, "attention_mask")
    _check_rank("attention_mask", arr, (3,))
    keep = arr if _kind(arr) == "bool" else _zero_one("attention_mask", arr)
    return keep[:, None]


def to_keras_mask(keep: Any, shape: Sequence[int] | None = None) -> np.ndarray:
    """A keep mask as Keras' ``attention_mask``: bool ``(batch, queries, keys)``, True = may
    attend. Keras applies one mask to every head: a ``keep`` that differs between heads
    raises ValueError. ``shape`` ``(batch, heads, queries, keys)`` broadcasts ``keep``
    first (Keras wants the full batch, query and key sizes)."""
    k = _broadcast(as_keep(keep), shape)
    k = _constant_along(k, 1, "heads", "Keras' attention_mask")
    return np.array(k[:, 0])


def from_jax_mask(mask: Any) -> np.ndarray:
    """``jax.nn.dot_product_attention``'s (or ``flax.nnx.MultiHeadAttention``'s) ``mask``,
    bool **True = keep**, broadcastable to ``(batch, heads, queries, keys)``, as a keep
    mask of rank 4."""
    arr = _array(mask, "mask")
    if _kind(arr) != "bool":
        raise TypeError(f"`mask` for JAX must be boolean (True = keep); received {arr.dtype}.")
    return as_keep(arr, "mask")


def to_jax_mask(keep: Any, shape: Sequence[int] | None = None) -> np.ndarray:
    """A keep mask as JAX's ``mask``: bool rank 4, True = keep. Note the axis order
    ``(batch, heads, queries, keys)`` although JAX lays out query, key and value as
    ``(batch, seq, heads, dim)``."""
    return np.array(_broadcast(as_keep(keep), shape))


# --- Paddle ------------------------------------------------------------------------------


def from_paddle_mask(attn_mask: Any, blocked_at: float = BLOCKED_AT) -> np.ndarray:
    """``paddle.nn.MultiHeadAttention``'s ``attn_mask`` (rank 2 to 4, broadcastable to
    ``(batch, heads, queries, keys)``) as a keep mask of rank 4.

    Bool: **True = keep**. Integer: **1 = keep**, 0 = blocked. Float: added to the scores
    (so a float 0/1 mask is *not* a keep mask; it is refused as a bias).
    """
    arr = _array(attn_mask, "attn_mask")
    _check_rank("attn_mask", arr, (2, 3, 4))
    if _kind(arr) == "int":
        return _rank4(_zero_one("attn_mask", arr))
    return _rank4(_from_bool_or_additive(arr, "attn_mask", blocked_at, true_means_keep=True))


def to_paddle_mask(
    keep: Any, shape: Sequence[int] | None = None, additive: bool = False, dtype: str = "float32"
) -> np.ndarray:
    """A keep mask as Paddle's ``attn_mask``: bool rank 4, True = keep (or, with
    ``additive=True``, float 0 / ``-inf`` of ``dtype``). ``shape`` broadcasts it first."""
    k = _broadcast(as_keep(keep), shape)
    return _to_bool_or_additive(k, additive, True, dtype)


# --- the documents ----------------------------------------------------------------------


def from_tf_document_mask(mask: Any) -> np.ndarray:
    """The TensorFlow tutorial document's mask (numeric 0/1, **1 = masked out**, applied as
    ``logits += mask * -1e9``) as a keep mask of rank 4.

    Shapes: the padding mask ``(batch, 1, 1, keys)``, the look-ahead mask ``(queries,
    keys)``, or anything of rank 2 to 4 broadcastable to ``(batch, heads, queries, keys)``.
    A boolean mask is refused (``TypeError``): the document never uses one, and its
    polarity would be a guess.
    """
    arr = _array(mask, "mask")
    if _kind(arr) not in ("int", "float"):
        raise TypeError(
            f"`mask` (TensorFlow document) must be a 0/1 number mask with 1 = masked out; "
            f"received dtype {arr.dtype}. For a boolean keep mask use as_keep()."
        )
    _check_rank("mask", arr, (2, 3, 4))
    return _rank4(~_zero_one("mask", arr))


def to_tf_document_mask(
    keep: Any, shape: Sequence[int] | None = None, dtype: str = "float32"
) -> np.ndarray:
    """A keep mask as the TensorFlow document's mask: rank 4, ``dtype``, **1.0 = masked
    out**, 0.0 = may attend. ``shape`` broadcasts it first."""
    k = _broadcast(as_keep(keep), shape)
    return (~k).astype(dtype)


def from_valid_lens(valid_lens: Any, num_keys: int) -> np.ndarray:
    """d2l-style valid lengths as a keep mask: key ``j`` is kept when ``j < length``.

    ``valid_lens``: ``(batch,)`` (one length for every query; gives ``(batch, 1, 1,
    num_keys)``) or ``(batch, queries)`` (one per query; gives ``(batch, 1, queries,
    num_keys)``). Integers, or floats holding whole numbers (the PaddlePaddle document
    passes floats), in ``[0, num_keys]``.
    """
    if isinstance(num_keys, bool) or not isinstance(num_keys, (int, np.integer)) or num_keys < 0:
        raise ValueError(f"`num_keys` must be an integer >= 0; received {num_keys!r}.")
    arr = _array(valid_lens, "valid_lens")
    _check_rank("valid_lens", arr, (1, 2))
    if _kind(arr) == "float":
        if not np.all(arr == np.round(arr)):
            raise ValueError(f"`valid_lens` must hold whole numbers; received {arr.tolist()}.")
    elif _kind(arr) != "int":
        raise TypeError(f"`valid_lens` must be integer; received dtype {arr.dtype}.")
    lens = arr.astype(np.int64)
    if np.any(lens < 0) or np.any(lens > num_keys):
        raise ValueError(
            f"`valid_lens` must lie in [0, {num_keys}] (num_keys); received {lens.tolist()}."
        )
    keep = np.arange(num_keys) < lens[..., None]
    return keep[:, None, None, :] if lens.ndim == 1 else keep[:, None, :, :]


def to_valid_lens(keep: Any, shape: Sequence[int] | None = None) -> np.ndarray:
    """A keep mask as d2l-style valid lengths (int64): ``(batch,)`` when every query of a
    batch entry has the same length, else ``(batch, queries)``.

    Every row must keep a prefix of the keys (``True ... True False ... False``) and the
    mask must not differ between heads; ValueError otherwise (a causal or scattered mask
    has no valid-lengths form except where it happens to be a prefix per query).
    """
    k = _broadcast(as_keep(keep), shape)
    k = _constant_along(k, 1, "heads", "valid lengths")[:, 0]  # (batch, queries, keys)
    lens = k.sum(axis=-1)
    prefix = np.arange(k.shape[-1]) < lens[..., None]
    if not np.array_equal(np.broadcast_to(prefix, k.shape), np.broadcast_to(k, prefix.shape)):
        raise ValueError(
            f"`keep` of shape {(*k.shape[:1], 1, *k.shape[1:])} is not a prefix mask "
            "(True for keys 0 .. n-1 only), so it has no valid-lengths form."
        )
    if lens.shape[1] == 1 or np.all(lens == lens[:, :1]):
        return lens[:, 0].astype(np.int64)
    return lens.astype(np.int64)

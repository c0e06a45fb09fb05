"""The KV cache of `multiattn.layers.MultiHeadAttention`: incremental causal
self-attention through a fixed-size cache (decoding).

A cache is the pair ``(key_cache, value_cache)``, heads first: ``(B, H_kv, L, D)`` and
``(B, H_kv, L, D_v)`` (``L`` = ``max_length`` slots; the layout of transformers' caches,
each head's positions contiguous), of a floating dtype (`cache_dtype`: an integer or
bool cache would truncate what is written into it), made by `empty_cache`. A step's
query ``(B, t, E_q)`` holds the tokens at positions ``index .. index + t - 1``; their
keys and values ``(B, t, H_kv, D)`` are written into the cache at ``index`` (`write`),
cast to the cache's dtype, and query ``i`` attends the slots ``j <= index + i`` (and,
with a sliding window ``w``, only ``index + i - j < w``) in the layer's compute dtype
(`attend_cache`). The optional slot mask ``(B, L)`` is bool, True = the slot may be
attended (`slot_mask`); the masks built here are bool ``(B or 1, 1, t, slots)``, True =
may attend.

``index`` is a Python int when its value is known (checked in range: a slice write and
attention over the filled prefix alone), else an int32 scalar tensor (``jax.jit`` /
``tf.function``): then a traced index out of range writes nothing and the step's output
is NaN (``in_range``), unless the caller checked it
(`multiattn.namespaces.keras.owned_caches`).
"""

from __future__ import annotations

from typing import Any

import keras

from .._checks import FLOAT_DTYPES, check_positive_int, describe, fmt_shape, shape_of
from ..distributed.layout import place_cache
from ..namespaces.keras import cache_index_checked, cache_values_checked, caches_owned
from ..ops.masking import check_bias
from ._mha_checks import check_kv_pair
from .rotary import check_offset

# -- the cache and its writes ------------------------------------------------------------


def cache_dtype(where: str, dtype: Any) -> str:
    """A cache dtype: a known floating dtype name (an integer or bool cache would truncate
    the keys and values written into it)."""
    try:
        name = keras.backend.standardize_dtype(dtype)
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"{where}: unknown `dtype` {describe(dtype)}.") from err
    if name not in FLOAT_DTYPES:
        raise TypeError(
            f"{where}: `dtype` must be a floating dtype ({', '.join(FLOAT_DTYPES)}): a "
            f"cache of dtype {name} would truncate the keys and values; received {dtype!r}."
        )
    return name


def empty_cache(
    where: str, batch_size: Any, max_length: Any, dims: tuple, dtype: Any, default: str
) -> tuple[Any, Any]:
    """Zeros ``(batch_size, H_kv, max_length, D)`` and ``(batch_size, H_kv, max_length,
    D_v)`` (``dims`` = ``(H_kv, D, D_v)``) in ``dtype`` (`cache_dtype`; None:
    ``default``). Under `multiattn.distributed.model_parallel` (jax) both are split by
    batch and key/value head where those divide (`multiattn.distributed.layout.place_cache`),
    as the key and value kernels are."""
    batch_size = check_positive_int(where, "batch_size", batch_size)
    max_length = check_positive_int(where, "max_length", max_length)
    dtype = default if dtype is None else cache_dtype(where, dtype)
    heads, key_dim, value_dim = dims
    shape = (batch_size, heads, max_length)
    return (
        place_cache(keras.ops.zeros((*shape, key_dim), dtype=dtype)),
        place_cache(keras.ops.zeros((*shape, value_dim), dtype=dtype)),
    )


def write(ops: Any, cache: Any, new: Any, index: Any, in_range: Any = None) -> Any:
    """``cache`` ``(B, H, L, D)`` (heads first) with ``new`` ``(B, t, H, D)`` written at
    positions ``index .. index + t - 1``.

    A known ``index`` (a Python int, checked in range) is a slice write: the cache rows
    before and after the new tokens, and the tokens between them, joined along the
    positions. Its cost is one copy of the cache whatever ``t``, it is an exact copy on
    every backend, and it differentiates everywhere (TensorFlow has no gradient for the
    dynamic update slice ``keras.ops.slice_update`` lowers to; a concatenation has one).
    A traced ``index`` (``jax.jit`` / ``tf.function``) goes to `write_select`.

    Inside `multiattn.namespaces.keras.owned_caches` (``generate``), a namespace that
    ``writes_in_place`` writes ``new`` into ``cache`` itself (`write_owned`).
    """
    new = ops.transpose(ops.cast(new, cache.dtype), (0, 2, 1, 3))
    if ops.writes_in_place and caches_owned():
        return write_owned(ops, cache, new, index, in_range)
    if not isinstance(index, int):
        return write_select(ops, cache, new, index, in_range)
    tokens, length = shape_of(new)[2], shape_of(cache)[2]
    parts = [new]
    if index > 0:
        parts.insert(0, cache[:, :, :index])
    if index + tokens < length:
        parts.append(cache[:, :, index + tokens :])
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=2)


def write_owned(ops: Any, cache: Any, new: Any, index: Any, in_range: Any = None) -> Any:
    """`write` of ``new`` ``(B, H, t, D)`` into a cache its caller owns
    (`multiattn.namespaces.keras.owned_caches`): the namespace's ``write_cache``, whose cost
    follows the tokens written. Where ``in_range`` is False, the tokens at position 0 are
    written back unchanged."""
    if in_range is not None:
        index = ops.where(in_range, index, 0)
        zero = index * 0  # the starts of a dynamic slice share one integer dtype (JAX)
        old = ops.slice(cache, (zero, zero, index, zero), shape_of(new))
        new = ops.where(in_range, new, old)
    return ops.write_cache(cache, new, index)


def write_select(ops: Any, cache: Any, new: Any, index: Any, in_range: Any = None) -> Any:
    """`write` of ``new`` ``(B, H, t, D)`` at an index known only as a tensor: ``new``
    is placed by a select against the positions, and nothing is written where
    ``in_range`` (a scalar bool, or None) is False.

    Differentiable on every backend, under ``jax.jit``/``tf.function`` too (a traced
    index has no value to slice at). One token (the decoding step) is broadcast and
    selected, an exact copy; several tokens (a prompt) are spread by a one-hot
    contraction, exact wherever the backend's float matmul is (reduced-precision matmul
    modes, e.g. TF32 on GPUs, round it), at a cost that grows with ``t`` times the cache
    length.
    """
    tokens, length = shape_of(new)[2], shape_of(cache)[2]
    # place[j, i]: cache position j receives token i (j == index + i)
    slots = ops.arange(length, dtype="int32")[:, None]
    place = ops.equal(slots, ops.arange(tokens, dtype="int32")[None, :] + index)
    if in_range is not None:
        place = ops.logical_and(place, in_range)
    if tokens == 1:
        spread = new  # broadcasts over the cache positions
    else:
        spread = ops.einsum("lt,bhtd->bhld", ops.cast(place, cache.dtype), new)
    written = ops.any(place, axis=1)[None, None, :, None]
    return ops.where(written, spread, cache)


# -- the arguments of a cached call ------------------------------------------------------


def refuse_with_cache(where: str, given: dict, causal: Any, top_left: bool) -> None:
    """With ``cache`` (causal self-attention through the cache), none of the arguments
    ``given`` (name -> value) may be set, nor the causal flags."""
    named = [n for n, a in given.items() if a is not None]
    if causal:
        named.append("causal")
    if top_left:
        named.append("use_causal_mask")
    if named:
        raise ValueError(
            f"{where}: with `cache` (causal self-attention through the cache), "
            f"{', '.join(f'`{n}`' for n in named)} must not be given."
        )


def slot_mask(where: str, ops: Any, slots: Any, batch: Any, max_length: int) -> Any:
    """``key_mask`` with a cache: ``(batch, max_length)`` bool (True = the slot may be
    attended) or integer (non-zero = may be attended), as a bool tensor."""
    if slots is None:
        return None
    slots = ops.convert_to_tensor(slots)
    shape = shape_of(slots)
    if (
        len(shape) != 2
        or shape[1] != max_length
        or (batch is not None and shape[0] is not None and shape[0] != batch)
    ):
        raise ValueError(
            f"{where}: with `cache`, `key_mask` must have shape ({batch}, {max_length}) "
            f"(one flag per cache slot); received {fmt_shape(shape)}."
        )
    return slots if "bool" in str(slots.dtype) else ops.not_equal(slots, 0)


def cache_position(
    where: str, ops: Any, qs: tuple, cache_shape: tuple, cache_index: Any,
    rotary_length: int | None,
) -> tuple[Any, Any, Any]:  # fmt: skip
    """``(cache_index, index, in_range)`` of a step of query shape ``qs`` into a cache of
    ``cache_shape`` (and a rotary table of ``rotary_length`` positions, or None):
    ``cache_index`` checked (`multiattn.layers.rotary.check_offset`), ``index`` its int
    (known) or int32 tensor (traced) and ``in_range`` None or, for a traced index the
    caller has not checked, a scalar bool: whether the step's positions fit."""
    max_length, tokens = cache_shape[2], qs[1]
    if max_length is None or tokens is None:
        raise ValueError(
            f"{where}: with `cache`, the cache length and the query length must be "
            f"static; received cache {fmt_shape(cache_shape)} and query {fmt_shape(qs)}."
        )
    if cache_index is None:
        raise ValueError(f"{where}: `cache` needs `cache_index` (the first position).")
    if tokens > max_length:
        raise ValueError(
            f"{where}: `query` holds {tokens} tokens, more than the cache holds "
            f"(max_length={max_length}, `cache` of shape {fmt_shape(cache_shape)})."
        )
    cache_index = check_offset(
        where, cache_index, tokens, max_length, ops, name="cache_index", limit="max_length"
    )
    bound = max_length
    if rotary_length is not None:
        bound = min(bound, rotary_length)
        if isinstance(cache_index, int):
            check_offset(where, cache_index, tokens, rotary_length, ops, name="cache_index",
                         limit="rotary_max_length")  # fmt: skip
    if isinstance(cache_index, int):
        return cache_index, cache_index, None
    # A traced index cannot raise: out of range, nothing is written and the outputs are
    # NaN (see `MultiHeadAttention.call`), unless the caller checked it
    # (``owned_caches(index_checked=True)``).
    index = ops.cast(cache_index, "int32")
    in_range = None
    if not cache_index_checked():
        in_range = ops.logical_and(
            ops.greater_equal(index, 0), ops.less_equal(index + tokens, bound)
        )
    return cache_index, index, in_range


# -- the cached call ---------------------------------------------------------------------


def _cache_keep(ops: Any, index: Any, tokens: int, filled: int, window: Any, usable: Any) -> Any:
    """The mask ``(1 or B, 1, tokens, filled)`` of the queries at positions ``index ..
    index + tokens - 1`` over the first ``filled`` slots: query ``i`` sees the slots
    ``j <= index + i`` (less than ``window`` behind it), and only those ``usable``
    ``(B, max_length)`` marks True."""
    positions = ops.expand_dims(ops.arange(tokens, dtype="int32") + index, 1)
    slots = ops.arange(filled, dtype="int32")[None, :]
    keep = ops.less_equal(slots, positions)
    if window is not None:
        keep = ops.logical_and(keep, ops.less(positions - slots, window))
    keep = ops.expand_dims(ops.expand_dims(keep, 0), 0)  # (1, 1, t, filled)
    if usable is not None:
        keep = ops.logical_and(keep, usable[:, None, None, :filled])
    return keep


def attend_cache(
    layer: Any, ops: Any, q: Any, k_cache: Any, v_cache: Any, index: Any, tokens: int,
    return_weights: bool, training: Any, usable: Any = None, bias: Any = None,
) -> tuple[Any, Any]:  # fmt: skip
    """``(heads, weights or None)`` of the queries ``q`` ``(B, t, H, D)`` at positions
    ``index .. index + tokens - 1`` over the cache of ``layer`` (through its ``_attend``),
    query ``i`` seeing the positions ``j <= index + i`` (and, with ``sliding_window``, only
    those less than the window behind it).

    A known ``index`` attends over the filled prefix alone (``index + tokens`` keys),
    so a step costs in proportion to the positions written, not to the cache length;
    its weights are padded with the zeros of the unwritten slots. A traced ``index``
    attends over every slot with a mask. ``usable`` (``(batch, max_length)`` bool or
    None) removes the slots it marks False (padding)."""
    window = layer.sliding_window
    max_length = shape_of(k_cache)[2]
    filled = index + tokens if isinstance(index, int) else max_length
    # Heads first, as cached: the explicit attention contracts them in place.
    keys, values = (ops.cast(c[:, :, :filled], layer.compute_dtype) for c in (k_cache, v_cache))
    keep = None
    if not isinstance(index, int) or window is not None or usable is not None:
        keep = _cache_keep(ops, index, tokens, filled, window, usable)
    causal = keep is None  # a known index: bottom-right causal over the prefix
    if bias is not None and shape_of(bias)[-1] != 1:
        bias = bias[..., :filled]  # a bias over the cache slots: those attended
    # A checked cache (`owned_caches(values_checked=True)`) needs no screen for NaN in
    # masked slots, except where slots leave a sliding window (one holding NaN would
    # make its row NaN only while attended).
    checked = cache_values_checked() and window is None
    result = layer._attend(
        ops, q, keys, values, keep, None, causal, return_weights, training, bias, True,
        checked,
    )  # fmt: skip
    if not return_weights:
        return result, None
    heads, weights = result
    if filled < max_length:
        pad = ops.broadcast_to(
            ops.zeros_like(weights[..., :1]), (*shape_of(weights)[:-1], max_length - filled)
        )
        weights = ops.concatenate([weights, pad], axis=-1)
    return heads, weights


def cached_call(
    layer: Any, ops: Any, query: Any, cache: Any, cache_index: Any, return_weights: bool,
    training: Any, slots: Any = None, bias: Any = None,
) -> tuple:  # fmt: skip
    """``layer``'s call through ``cache`` (see `MultiHeadAttention.call`): ``(output,
    new_cache)``, or ``(output, weights, new_cache)`` with ``return_weights``. ``slots``
    is the call's ``key_mask`` over the cache slots, ``bias`` its ``attention_bias`` over
    them."""
    where = layer._WHERE
    qs = shape_of(query)
    dims = (layer.kv_heads, layer.key_dim, layer.value_dim)
    k_cache, v_cache = check_kv_pair(where, "cache", cache, qs[0], dims, heads_first=True)
    max_length = shape_of(k_cache)[2]
    if bias is not None:
        shape4 = (qs[0], layer.num_heads, qs[1], max_length)
        bias = check_bias(ops, bias, shape4, where, "attention_bias")
    slots = slot_mask(where, ops, slots, qs[0], max_length)
    rotary_length = None if layer.rotary is None else layer.rotary_max_length
    cache_index, index, in_range = cache_position(
        where, ops, qs, shape_of(k_cache), cache_index, rotary_length
    )
    gate = layer._gate(ops, query)
    q, k, v = layer._project_self(ops, query)
    q, k = layer._rotate(q, k, cache_index, cache_index)
    k_cache = write(ops, k_cache, k, index, in_range)
    v_cache = write(ops, v_cache, v, index, in_range)
    heads, weights = attend_cache(
        layer, ops, q, k_cache, v_cache, index, qs[1], return_weights, training, slots, bias
    )
    out = layer._output(ops, heads, gate)
    if in_range is not None:
        out = ops.where(in_range, out, float("nan"))
        if weights is not None:
            weights = ops.where(in_range, weights, float("nan"))
    new_cache = (k_cache, v_cache)
    return (out, weights, new_cache) if return_weights else (out, new_cache)

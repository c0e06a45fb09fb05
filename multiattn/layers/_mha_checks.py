"""The argument and input checks of `multiattn.layers.MultiHeadAttention`.

Constructor arguments (`positive_int`, `check_output_shape`, `check_attention_axes`,
`check_sliding_window`, `check_flash`, `check_rotary_args`, ...), the shapes ``build``
receives (`check_build_shapes`), and the tensors a call receives: ``query``, ``value``,
``key`` (`query_namespace`, `check_input`, `check_key_value_inputs`) and the ``(keys,
values)`` pairs of ``key_value`` and ``cache`` (`check_kv_pair`). Each check raises
``ValueError`` or ``TypeError`` with a message that starts with ``where`` (the layer's
name) and names the argument as Keras' layer does; none computes anything. Inputs are
floating tensors (integer, bool and complex ones raise ``TypeError``); the feature
widths are those the layer was built with.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from .._checks import (
    check_float,
    check_positive_int,
    check_rank,
    describe,
    fmt_shape,
    shape_of,
)
from ..namespaces.keras import get_ops
from ..ops.masking import check_bias
from ..ops.rotary import _check_base, check_plane_count, check_rotary_dim, check_rotary_scaling

# -- constructor arguments ---------------------------------------------------------------


def positive_int(where: str, name: str, value: Any, allow_none: bool = False) -> int | None:
    """A positive int (NumPy integers too); the message names the argument as Keras' does
    ("argument `num_heads`") and quotes the value."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        none = " or None" if allow_none else ""
        raise ValueError(
            f"{where}: received an invalid value for argument `{name}`, expected a positive "
            f"integer{none}; received {name}={value!r}."
        )
    return int(value)


def check_kv_heads(where: str, num_heads: int, num_key_value_heads: Any) -> int | None:
    """``num_key_value_heads``: None or a positive int dividing ``num_heads``."""
    kv_heads = check_positive_int(
        where, "num_key_value_heads", num_key_value_heads, allow_none=True
    )
    if kv_heads is not None and num_heads % kv_heads:
        raise ValueError(
            f"{where}: `num_key_value_heads` ({num_key_value_heads}) must divide "
            f"`num_heads` ({num_heads})."
        )
    return kv_heads


def check_output_shape(where: str, value: Any) -> tuple[int, ...] | None:
    """Keras' ``output_shape``: None, a positive int or a tuple/list of positive ints."""
    if value is None:
        return None
    dims = (value,) if isinstance(value, (int, np.integer)) else value
    if isinstance(value, (bool, str, bytes)) or not isinstance(dims, (tuple, list)):
        dims = None
    elif not dims or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in dims
    ):
        dims = None
    if dims is None:
        raise ValueError(
            f"{where}: Invalid `output_shape` {value!r}: expected a positive int or a tuple or "
            "list of positive ints (the output's shape after the batch and sequence axes)."
        )
    return tuple(int(d) for d in dims)


def check_output(where: str, output_shape: Any, output_dim: Any) -> tuple[int, ...] | None:
    """The output's shape after the batch and sequence axes from Keras' ``output_shape``
    or multiattn's ``output_dim`` (``output_dim=n`` is ``output_shape=(n,)``); None: the
    query width."""
    shape = check_output_shape(where, output_shape)
    dim = check_positive_int(where, "output_dim", output_dim, allow_none=True)
    if dim is not None:
        if shape is not None and shape != (dim,):
            raise ValueError(
                f"{where}: `output_dim` ({dim}) and `output_shape` ({output_shape!r}) "
                "disagree; give one of them (output_dim=n is output_shape=(n,))."
            )
        shape = (dim,)
    return shape


def check_bias_flags(where: str, use_bias: Any, use_gate: Any, use_output_bias: Any) -> None:
    """``use_bias`` and ``use_gate`` are bools, ``use_output_bias`` a bool or None."""
    if not isinstance(use_bias, bool):
        raise TypeError(f"{where}: `use_bias` must be a bool; received {use_bias!r}.")
    if not isinstance(use_gate, bool):
        raise TypeError(f"{where}: `use_gate` must be a bool; received {use_gate!r}.")
    if use_output_bias is not None and not isinstance(use_output_bias, bool):
        raise TypeError(
            f"{where}: `use_output_bias` must be a bool or None; received {use_output_bias!r}."
        )


def check_attention_axes(where: str, value: Any) -> tuple[int, ...] | None:
    """Keras' ``attention_axes``: None, an int or a non-empty tuple/list of ints (their
    range is checked against the inputs' rank by `multiattn.layers._mha_axes`)."""
    if value is None:
        return None
    axes = (value,) if isinstance(value, (int, np.integer)) else value
    if (
        isinstance(value, bool)
        or not isinstance(axes, (tuple, list))
        or not axes
        or not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in axes)
    ):
        raise ValueError(
            f"{where}: `attention_axes` must be an int, list, or tuple of ints; received "
            f"attention_axes={value!r}."
        )
    return tuple(int(a) for a in axes)


def check_sliding_window(where: str, value: Any) -> int | None:
    """``sliding_window``: None or a positive int."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(
            f"{where}: `sliding_window` must be `None` or a positive integer; received "
            f"sliding_window={value!r}."
        )
    return int(value)


def check_flash(where: str, flash_attention: Any, rate: float, given: Any) -> bool:
    """Keras' ``flash_attention`` switch (a bool or None; Keras' global
    ``enable_flash_attention`` counts as True), which refuses a dropout ``rate`` above 0
    (``given``: the ``dropout`` argument, quoted in the message)."""
    if flash_attention is not None and not isinstance(flash_attention, bool):
        raise TypeError(
            f"{where}: `flash_attention` must be a bool or None; received {flash_attention!r}."
        )
    flash = flash_attention or keras.config.is_flash_attention_enabled()
    if flash and rate > 0.0:
        raise ValueError(
            f"{where}: Dropout is not supported when flash attention is enabled "
            f"(dropout={given}). Please set dropout to 0.0 to use flash attention, or "
            "pass flash_attention=False."
        )
    return flash


def check_flash_scores(where: str, flash: bool, return_scores: bool) -> None:
    """Keras' flash attention returns no attention scores."""
    if flash and return_scores:
        raise ValueError(
            f"{where}: Returning attention scores is not supported when flash "
            "attention is enabled. Please disable flash attention to access attention "
            "scores."
        )


def keras_object(where: str, name: str, value: Any) -> Any:
    """A regularizer or (``name`` ending in ``constraint``) a constraint, by Keras' rules."""
    module = keras.constraints if name.endswith("constraint") else keras.regularizers
    try:
        return module.get(value)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: unknown `{name}` {describe(value)}.") from err


def check_rotary_args(
    where: str, key_dim: int, max_length: Any, base: Any, dim: Any, interleaved: Any,
    scaling: Any,
) -> tuple[int | None, float, int | None, bool, dict | None]:  # fmt: skip
    """The rotary options ``(rotary_max_length, rotary_base, rotary_dim,
    rotary_interleaved, rotary_scaling)`` checked; with ``rotary_max_length`` the rotated
    width (``rotary_dim``, else ``key_dim``) must be even."""
    max_length = check_positive_int(where, "rotary_max_length", max_length, allow_none=True)
    base = _check_base(where, base, "rotary_base")
    dim = check_rotary_dim(where, dim, key_dim)
    if not isinstance(interleaved, bool):
        raise TypeError(f"{where}: `rotary_interleaved` must be a bool; received {interleaved!r}.")
    scaling = check_rotary_scaling(where, scaling, "rotary_scaling")
    check_plane_count(where, scaling, dim or key_dim)
    if max_length is not None and dim is None and key_dim % 2:
        raise ValueError(
            f"{where}: rotary position embedding needs an even `key_dim` (or an "
            f"even `rotary_dim`); received {key_dim}."
        )
    return max_length, base, dim, interleaved, scaling


def check_keras_flag(where: str, name: str, value: Any) -> bool:
    """Keras' call flags that it reads by truthiness (``use_causal_mask=0`` in Keras' own
    tests): bools and the integers 0 and 1."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{where}: `{name}` must be a bool; received {describe(value)}.")


# -- shapes and inputs -------------------------------------------------------------------


def check_build_shapes(where: str, query_shape: Any, value_shape: Any, key_shape: Any) -> tuple:
    """The three input shapes of ``build`` as tuples, after Keras' checks (and
    multiattn's: equal ranks, at least 3, static feature widths)."""
    shapes = []
    for name, s in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
        try:
            shapes.append(tuple(None if d is None else int(d) for d in s))
        except TypeError as err:
            raise ValueError(
                f"{where}: the shape of `{name}` must be a tuple of dimensions; received {s!r}."
            ) from err
    qs, vs, ks = shapes
    if vs[1:-1] != ks[1:-1]:
        raise ValueError(
            f"{where}: All dimensions of `value` and `key`, except the last one, must be "
            f"equal. Received: value_shape={vs} and key_shape={ks}."
        )
    for name, s in (("query", qs), ("value", vs), ("key", ks)):
        if len(s) < 3:
            raise ValueError(
                f"{where}: `{name}` must have rank 3 (batch, sequence, features), or more "
                f"for attention over several axes; received shape {fmt_shape(s)}."
            )
        if s[-1] is None:
            raise ValueError(
                f"{where}: the last dimension of `{name}` must be static; received {fmt_shape(s)}."
            )
    if len(qs) != len(vs):
        raise ValueError(
            f"{where}: `query` and `value` must have the same rank; received query "
            f"{fmt_shape(qs)} and value {fmt_shape(vs)}."
        )
    return qs, vs, ks


def check_rank3(where: str, rank: int) -> None:
    """The cache and projected keys/values need a layer built for rank-3 inputs."""
    if rank != 3:
        raise ValueError(
            f"{where}: the cache and projected keys/values need a layer built for "
            f"(batch, sequence, features) inputs; this one was built for rank {rank}."
        )


def check_input(where: str, name: str, x: Any, width: int, rank: int) -> None:
    """``x`` is a floating tensor (or array) of ``rank`` with the width the layer was
    built with; ``None``, strings and lists raise ``TypeError`` naming ``name``."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{where}: `{name}` must be a tensor; received {describe(x)}.")
    shape = shape_of(x)
    check_rank(where, name, shape, rank, rank)
    if shape[-1] is not None and shape[-1] != width:
        raise ValueError(
            f"{where}: `{name}` must have width {width} (the width the layer was built "
            f"with); received shape {fmt_shape(shape)}."
        )
    check_float(where, name, x, get_ops(x))


def query_namespace(where: str, query: Any, value: Any, key: Any) -> Any:
    """The namespace of a call's inputs (one framework for all three; ``query`` must be
    a tensor or an array)."""
    if not (hasattr(query, "shape") and hasattr(query, "dtype")):
        raise TypeError(f"{where}: `query` must be a tensor; received {describe(query)}.")
    return get_ops(query, value, key, names=("query", "value", "key"), where=where)


def check_key_value_inputs(where: str, value: Any, key: Any, widths: tuple, rank: int) -> None:
    """``value`` (and ``key`` when given) are floating tensors of the widths the layer
    was built with (``widths``: ``(E_q, E_v, E_k)``); a ``key`` left out is ``value``,
    and an error about it names ``value``."""
    _, e_v, e_k = widths
    check_input(where, "value", value, e_v, rank)
    if key is None:
        check_input(where, "value", value, e_k, rank)
    else:
        check_input(where, "key", key, e_k, rank)


def check_same_positions(where: str, qs: tuple, ks: tuple, vs: tuple) -> None:
    """``key`` and ``value`` agree on every axis but the features (where both are
    static), and the three inputs on the batch size."""
    if ks[1:-1] != vs[1:-1] and all(d is not None for d in (*ks[1:-1], *vs[1:-1])):
        raise ValueError(
            f"{where}: All dimensions of `value` and `key`, except the last one, must "
            f"be equal. Received: value_shape={fmt_shape(vs)} and key_shape="
            f"{fmt_shape(ks)}."
        )
    batches = {s[0] for s in (qs, ks, vs) if s[0] is not None}
    if len(batches) > 1:
        raise ValueError(
            f"{where}: `query`, `key` and `value` must share the batch size; received "
            f"{fmt_shape(qs)}, {fmt_shape(ks)} and {fmt_shape(vs)}."
        )


def check_rotary_length(where: str, name: str, length: int | None, max_length: int) -> None:
    """Positions ``0 .. length - 1`` of ``name`` must fit the rotary table of
    ``max_length`` (``rotary_max_length``) positions."""
    if length is not None and length > max_length:
        raise ValueError(
            f"{where}: `{name}` has {length} positions, more than the rotary embedding "
            f"covers (rotary_max_length={max_length})."
        )


def check_kv_pair(
    where: str, name: str, pair: Any, batch: Any, dims: tuple, heads_first: bool = False
) -> tuple[Any, Any]:
    """``(keys, values)`` of ``pair`` checked against ``dims`` ``(H_kv, D, D_v)``:
    floating tensors ``(B, T, H_kv, D)`` and ``(B, T, H_kv, D_v)``, or with
    ``heads_first`` (a cache) ``(B, H_kv, T, D)`` and ``(B, H_kv, T, D_v)``."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(
            f"{where}: `{name}` must be a pair (keys, values); received {type(pair).__name__}."
        )
    k, v = pair
    for label, t in (("keys", k), ("values", v)):
        if not (hasattr(t, "shape") and hasattr(t, "dtype")):
            raise TypeError(
                f"{where}: the {label} of `{name}` must be a tensor; received {describe(t)}."
            )
        check_float(where, name, t, get_ops(t))
    ks, vs = shape_of(k), shape_of(v)
    length = ks[2 if heads_first else 1] if len(ks) == 4 else None  # the values': the keys'
    heads, key_dim, value_dim = dims
    if heads_first:
        want_k = (batch, heads, None, key_dim)
        want_v = (batch, heads, length, value_dim)
    else:
        want_k = (batch, None, heads, key_dim)
        want_v = (batch, length, heads, value_dim)
    for label, got, want in (("keys", ks, want_k), ("values", vs, want_v)):
        if len(got) != 4 or any(
            w is not None and g is not None and g != w for g, w in zip(got, want)
        ):
            raise ValueError(
                f"{where}: the {label} of `{name}` must have shape {fmt_shape(want)}; "
                f"received {fmt_shape(got)}."
            )
    return k, v


def check_attention_bias(where: str, ops: Any, bias: Any, own: bool, shape4: tuple) -> Any:
    """A call's ``attention_bias`` as a floating tensor broadcastable to the scores
    ``shape4`` ``(B, H, T_q, T_k)``; it needs rank-3 inputs and multiattn's own attention
    (``own``: no ``attention_axes``, no ``_compute_attention`` override)."""
    if not own:
        raise ValueError(
            f"{where}: `attention_bias` needs (batch, sequence, features) inputs and "
            "multiattn's own attention (no `attention_axes`, no `_compute_attention` "
            f"override); received `attention_bias` {describe(bias)}."
        )
    return check_bias(ops, bias, shape4, where, "attention_bias")

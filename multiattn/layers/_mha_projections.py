"""The projections of `multiattn.layers.MultiHeadAttention`: its ``EinsumDense``
sublayers and the products through them.

For inputs ``(B, *dims, E)`` the sublayers are (Keras' names and order) ``query``
``(E_q) -> (H, D)``, ``key`` ``(E_k) -> (H_kv, D)``, with ``use_gate`` ``gate``
``(E_q) -> (H, D_v)`` (sigmoid), ``value`` ``(E_v) -> (H_kv, D_v)`` and
``attention_output`` ``(H, D_v) -> output_shape`` (`einsum_dense` makes each one, with
the layer's initializers, regularizers, constraints and dtype policy). The projected
queries are ``(B, *dims, H, D)``, the keys and values ``(B, *dims, H_kv, D)`` and
``(B, *dims, H_kv, D_v)``, in the layer's compute dtype; rotary position embedding,
when the layer has it, is applied to the projected queries and keys.

`project_inputs` projects a call's ``query`` with its ``value``/``key`` (or takes the
``key_value`` pair projected once by `project_cross`); `project_cross` projects them once for `MultiHeadAttention.project_key_value`;
`load_flat_layout` reads the
weights files written before the projections moved into sublayers.
"""

from __future__ import annotations

import string
from typing import Any

import keras

from .._checks import shape_of
from ..namespaces.keras import get_ops
from ._base import fresh_initializer
from ._mha_checks import (
    check_key_value_inputs,
    check_kv_pair,
    check_rank3,
    check_rotary_length,
    check_same_positions,
)


def proj_equation(free: int, bound: int, out: int) -> tuple[str, str]:
    """The einsum equation of a projection contracting the last ``bound`` axes of an input
    with ``free`` leading axes into ``out`` new axes, and the bias axes."""
    letters = string.ascii_lowercase
    lead, mid = letters[:free], letters[free : free + bound]
    new = letters[free + bound : free + bound + out]
    return f"{lead}{mid},{mid}{new}->{lead}{new}", new


def einsum_dense(
    layer: Any, name: str, rank: int, bound: int, out: tuple, activation: Any = None,
    use_bias: bool | None = None,
) -> Any:  # fmt: skip
    """An unbuilt ``EinsumDense`` sublayer ``name`` of ``layer`` for inputs of ``rank``,
    contracting their last ``bound`` axes into the axes ``out``, with a bias when
    ``use_bias`` (None: the layer's ``use_bias``), the layer's initializers (a fresh
    object each), regularizers, constraints and dtype policy."""
    equation, bias_axes = proj_equation(rank - bound, bound, len(out))
    use_bias = layer.use_bias if use_bias is None else use_bias
    return keras.layers.EinsumDense(
        equation,
        output_shape=[None] * (rank - bound - 1) + list(out),
        bias_axes=bias_axes if use_bias else None,
        activation=activation,
        name=name,
        kernel_initializer=fresh_initializer(layer.kernel_initializer),
        bias_initializer=fresh_initializer(layer.bias_initializer),
        kernel_regularizer=layer.kernel_regularizer,
        bias_regularizer=layer.bias_regularizer,
        activity_regularizer=layer.sublayer_activity_regularizer,
        kernel_constraint=layer.kernel_constraint,
        bias_constraint=layer.bias_constraint,
        dtype=layer.dtype_policy,
    )


def project_cross(layer: Any, where: str, value: Any, key: Any) -> tuple[Any, Any]:
    """The keys and values of cross-attention projected by ``layer`` (see
    `MultiHeadAttention.project_key_value`): ``(B, T, H_kv, D)`` and ``(B, T, H_kv,
    D_v)``, RoPE applied to the keys when the layer has it."""
    check_rank3(where, layer._rank)
    check_key_value_inputs(where, value, key, layer._widths, layer._rank)
    key = value if key is None else key
    ops = get_ops(value)
    k = layer._project(ops, key, layer._key_dense)
    v = layer._project(ops, value, layer._value_dense)
    k = layer._qk_normed(None, k)[1]
    if layer.rotary is not None:
        check_rotary_length(where, "key", shape_of(key)[1], layer.rotary_max_length)
        k = layer.rotary(k)
    return k, v


def _given_key_value(layer: Any, ops: Any, where: str, query: Any, key_value: Any) -> tuple:
    """``(q, k, v)`` of a call with ``key_value``: the query projected (and rotated), the
    pair checked and cast to the compute dtype."""
    qs = shape_of(query)
    check_rank3(where, layer._rank)
    dims = (layer.kv_heads, layer.key_dim, layer.value_dim)
    k, v = check_kv_pair(where, "key_value", key_value, qs[0], dims)
    dtype = layer.compute_dtype
    k, v = ops.cast(k, dtype), ops.cast(v, dtype)
    q = layer._qk_normed(layer._project(ops, query, layer._query_dense), None)[0]
    if layer.rotary is not None:
        check_rotary_length(where, "query", qs[1], layer.rotary_max_length)
        q = layer.rotary(q)
    return q, k, v


def project_inputs(
    layer: Any, ops: Any, where: str, query: Any, value: Any, key: Any, key_value: Any
) -> tuple[Any, Any, Any]:
    """The projected ``(q, k, v)`` of a call of ``layer`` without a cache: from
    ``key_value``, or from ``value`` and ``key`` (default ``value``), checked against the
    widths the layer was built with; one input for all three is self-attention. RoPE is
    applied to the queries and keys when the layer has it."""
    if key_value is not None:
        if value is not None or key is not None:
            raise ValueError(f"{where}: give either `key_value` or `value`/`key`, not both.")
        return _given_key_value(layer, ops, where, query, key_value)
    if value is None:
        raise ValueError(f"{where}: `value` is required (or `key_value`, or `cache`).")
    check_key_value_inputs(where, value, key, layer._widths, layer._rank)
    key = value if key is None else key
    qs, ks = shape_of(query), shape_of(key)
    check_same_positions(where, qs, ks, shape_of(value))
    if query is key and key is value:  # self-attention: one input, three kernels
        q, k, v = layer._project_self(ops, query)
    else:
        q = layer._project(ops, query, layer._query_dense)
        k = layer._project(ops, key, layer._key_dense)
        v = layer._project(ops, value, layer._value_dense)
    if layer.rotary is not None:
        check_rotary_length(where, "query", qs[1], layer.rotary_max_length)
        check_rotary_length(where, "key", ks[1], layer.rotary_max_length)
    return (*layer._rotate(q, k), v)


def _skip_one_load(layer: Any) -> Any:
    """A stand-in for ``layer.load_own_variables`` that ignores one call (the sublayer's
    absent entry in a file of the flat layout, already loaded by its parent) and then
    removes itself."""

    def skip(store: Any) -> None:
        del layer.load_own_variables

    return skip


def load_flat_layout(where: str, dense: tuple, store: Any) -> None:
    """Load a weights file written by multiattn before the projections moved into
    sublayers: it holds them as the layer's own ``vars/0 ..`` (the kernels of ``dense``,
    the query, key, value and output sublayers, then their biases)."""
    targets = [d.kernel for d in dense] + [d.bias for d in dense if d.bias is not None]
    if len(store.keys()) != len(targets):
        raise ValueError(
            f"{where}: the weights file holds {len(store.keys())} "
            f"variables of the layer itself; a file of the layout before the "
            f"projections moved into sublayers would hold {len(targets)} here."
        )
    for i, variable in enumerate(targets):
        variable.assign(store[str(i)])
    for layer in dense:  # their own entries are absent from such a file: skip once
        layer.load_own_variables = _skip_one_load(layer)

"""Sequence-parallel exact attention on JAX: ring attention.

Queries, keys and values are split along the sequence over the ``n`` devices of one mesh
axis. Each device keeps its block of queries and, in ``n`` steps, meets every block of
keys and values: after each step it passes the key/value block it holds to the next
device of the ring (``jax.lax.ppermute``) and receives one from the previous device. The
blocks are folded into the running maximum, running sum and weighted sum of the core's
online softmax (`multiattn.ops.blockwise`, the same step the blockwise path uses), so
the result is exact attention and no device ever holds more than one block of keys,
values and scores. Masks are built per block from global positions: the causal mask
(bottom-right aligned, as everywhere in multiattn) and valid lengths. A query with
nothing to attend gets zeros.

The ring is a ``jax.shard_map`` over the mesh; the operations inside are ``keras.ops`` of
the JAX backend, so this module needs ``KERAS_BACKEND=jax``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from .._checks import HALF_DTYPES, check_float, check_scale, fmt_shape, shape_of
from ..namespaces.keras import get_ops
from ..ops import blockwise, masking
from ..ops.masking import check_valid_lens

__all__ = ["ring_attention"]

_WHERE = "ring_attention"


def _jax_mesh(mesh: Any) -> Any:
    import jax

    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    from keras.distribution import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        return mesh.backend_mesh
    raise TypeError(
        f"{_WHERE}: `mesh` must be a jax.sharding.Mesh or a keras.distribution.DeviceMesh; "
        f"received {type(mesh).__name__}."
    )


def _check_axis(mesh: Any, name: str, axis: Any, allow_none: bool = False) -> None:
    if axis is None and allow_none:
        return
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(
            f"{_WHERE}: `{name}` must name an axis of the mesh {list(mesh.axis_names)}; "
            f"received {axis!r}."
        )


def _check_shapes(query: Any, key: Any, value: Any) -> tuple[tuple, tuple, tuple]:
    qs, ks, vs = shape_of(query), shape_of(key), shape_of(value)
    for name, s in (("query", qs), ("key", ks), ("value", vs)):
        if len(s) not in (3, 4) or any(d is None for d in s):
            raise ValueError(
                f"{_WHERE}: `{name}` must have a static shape (batch, seq, dim) or "
                f"(batch, seq, heads, dim); received {fmt_shape(s)}."
            )
    if not len(qs) == len(ks) == len(vs):
        raise ValueError(
            f"{_WHERE}: `query`, `key` and `value` must have the same rank; received "
            f"{fmt_shape(qs)}, {fmt_shape(ks)} and {fmt_shape(vs)}."
        )
    if qs[0] != ks[0] or ks[0] != vs[0] or qs[2:-1] != ks[2:-1] or ks[2:-1] != vs[2:-1]:
        raise ValueError(
            f"{_WHERE}: `query`, `key` and `value` must share batch (and heads); received "
            f"{fmt_shape(qs)}, {fmt_shape(ks)} and {fmt_shape(vs)}."
        )
    if qs[-1] != ks[-1]:
        raise ValueError(
            f"{_WHERE}: `query` and `key` must have the same width; received "
            f"{fmt_shape(qs)} and {fmt_shape(ks)}."
        )
    if ks[1] != vs[1]:
        raise ValueError(
            f"{_WHERE}: `key` and `value` must have the same length; received "
            f"{fmt_shape(ks)} and {fmt_shape(vs)}."
        )
    return qs, ks, vs


def ring_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    mesh: Any,
    seq_axis: str = "seq",
    batch_axis: str | None = None,
    valid_lens: Any = None,
    causal: bool = False,
    scale: float | None = None,
) -> Any:
    """Exact scaled dot-product attention with the sequence split over a mesh axis.

    ``softmax(scale * q k^T) v`` is computed blockwise: device ``i`` of ``seq_axis`` holds
    queries, keys and values ``[i * T / n, (i + 1) * T / n)`` and receives the other
    key/value blocks one after another around the ring. Works under ``jax.jit`` and
    ``jax.grad``; needs ``KERAS_BACKEND=jax``.

    Args:
        query: ``(batch, queries, dim)`` or ``(batch, queries, heads, dim)``.
        key: ``(batch, keys, dim)`` or ``(batch, keys, heads, dim)``.
        value: ``(batch, keys, dim_v)`` or ``(batch, keys, heads, dim_v)``. Query and key
            lengths must be divisible by the size of ``seq_axis``. float32 or float64;
            float16/bfloat16 are computed in float32 and cast back.
        mesh: ``jax.sharding.Mesh`` or ``keras.distribution.DeviceMesh``.
        seq_axis: mesh axis the sequences are split over.
        batch_axis: mesh axis the batch is split over, or None (batch replicated).
        valid_lens: ``(batch,)`` or ``(batch, queries)`` integer lengths of the keys (key
            positions ``>= length`` are masked), or None.
        causal: bottom-right aligned causal mask over global positions (query ``i`` sees
            key ``j`` iff ``j <= i + keys - queries``).
        scale: multiplier of the dot products, default ``1 / sqrt(dim)``.

    Returns:
        ``(batch, queries, dim_v)`` or ``(batch, queries, heads, dim_v)``, split along the
        sequence over ``seq_axis`` like the query. Queries with no key to attend give
        zeros.
    """
    import jax
    import keras

    if keras.backend.backend() != "jax":
        raise RuntimeError(
            f"{_WHERE}: needs the JAX backend of Keras (KERAS_BACKEND=jax); the active "
            f"backend is {keras.backend.backend()!r}."
        )
    jmesh = _jax_mesh(mesh)
    _check_axis(jmesh, "seq_axis", seq_axis)
    _check_axis(jmesh, "batch_axis", batch_axis, allow_none=True)
    if batch_axis == seq_axis:
        raise ValueError(
            f"{_WHERE}: `batch_axis` and `seq_axis` must differ; both are {seq_axis!r}."
        )
    causal = masking.check_causal(_WHERE, causal)
    ops = get_ops()
    query, key, value = (jax.numpy.asarray(t) for t in (query, key, value))
    dtypes = {
        check_float(_WHERE, n, t, ops)
        for n, t in zip(("query", "key", "value"), (query, key, value))
    }
    if len(dtypes) != 1:
        raise TypeError(
            f"{_WHERE}: `query`, `key` and `value` must share a dtype; received {sorted(dtypes)}."
        )
    dtype = dtypes.pop()
    qs, ks, _ = _check_shapes(query, key, value)
    n = jmesh.shape[seq_axis]
    for name, length in (("query", qs[1]), ("key", ks[1])):
        if length % n:
            raise ValueError(
                f"{_WHERE}: the {name} length ({length}) must be divisible by the size of "
                f"mesh axis {seq_axis!r} ({n}); received {name} of shape {fmt_shape(qs if name == 'query' else ks)}."
            )
    if batch_axis is not None and qs[0] % jmesh.shape[batch_axis]:
        raise ValueError(
            f"{_WHERE}: the batch ({qs[0]}) must be divisible by the size of mesh axis "
            f"{batch_axis!r} ({jmesh.shape[batch_axis]})."
        )
    scale = check_scale(_WHERE, scale)
    if scale is None:
        scale = 1.0 / math.sqrt(qs[-1])
    rank3 = len(qs) == 3
    if rank3:
        query, key, value = (t[:, :, None, :] for t in (query, key, value))
    heads = shape_of(query)[2]
    lens = None
    if valid_lens is not None:
        lens = check_valid_lens(
            ops, jax.numpy.asarray(valid_lens), (qs[0], heads, qs[1], ks[1]), _WHERE
        )
    if dtype in HALF_DTYPES:
        query, key, value = (t.astype("float32") for t in (query, key, value))
    ring = _ring(
        jmesh,
        seq_axis,
        batch_axis,
        causal,
        float(scale),
        ks[1] - qs[1],
        None if lens is None else len(shape_of(lens)),
    )
    out = ring(query, key, value) if lens is None else ring(query, key, value, lens)
    if dtype in HALF_DTYPES:
        out = out.astype(dtype)
    return out[:, :, 0] if rank3 else out


@functools.lru_cache(maxsize=64)
def _ring(
    mesh: Any,
    seq_axis: str,
    batch_axis: str | None,
    causal: bool,
    scale: float,
    offset: int,
    lens_rank: int | None,
) -> Any:
    """The jitted ring for one configuration (cached, so that jit's cache applies)."""
    import jax
    from jax.sharding import PartitionSpec as P

    ops = get_ops()
    n = mesh.shape[seq_axis]
    ring_perm = [(i, (i + 1) % n) for i in range(n)]
    spec = P(batch_axis, seq_axis, None, None)
    in_specs = [spec, spec, spec]
    if lens_rank == 1:
        in_specs.append(P(batch_axis))
    elif lens_rank == 2:
        in_specs.append(P(batch_axis, seq_axis))  # per query: split like the queries

    def local(q, k, v, lens=None):
        # q: (B, bq, H, D), k: (B, bk, H, D), v: (B, bk, H, Dv): this device's blocks.
        idx = jax.lax.axis_index(seq_axis)
        bq, bk = shape_of(q)[1], shape_of(k)[1]
        q_pos = idx * bq + ops.arange(bq, dtype="int32")  # (bq,)
        lens4 = masking.lens_rank4(ops, lens)  # (B, 1, 1, 1) or (B, 1, bq, 1)
        q = q * scale
        state = None
        for step in range(n):
            src = (idx - step) % n  # the device whose keys and values this device holds
            k_pos = src * bk + ops.arange(bk, dtype="int32")  # (bk,)
            keep = masking.position_keep(ops, q_pos, k_pos, lens4, causal=causal, offset=offset)
            scores = ops.einsum("bqhd,bkhd->bhqk", q, k)
            state = blockwise._step(ops, state, scores, keep, v)
            if step < n - 1:
                k = jax.lax.ppermute(k, seq_axis, ring_perm)
                v = jax.lax.ppermute(v, seq_axis, ring_perm)
        out = state.acc / ops.where(state.total > 0, state.total, 1.0)  # empty rows: 0
        return ops.transpose(out, (0, 2, 1, 3))

    mapped = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=spec)
    return jax.jit(mapped)

"""Worker: ring attention on 8 host devices against the float64 oracle and against the
core's direct attention on one device (JAX).

Run by ``tests/test_distributed_jax.py`` in a process of its own with
``KERAS_BACKEND=jax``, ``JAX_PLATFORMS=cpu``, ``JAX_ENABLE_X64=1`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=8``. Prints one JSON object of
relative errors per case.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.sharding import Mesh

from multiattn import reference
from multiattn.config import settings
from multiattn.distributed import ring_attention
from multiattn.ops import scaled_dot_product_attention
from multiattn.tuning import Fixed

DEVICES = 8
BLOCK = 256  # tokens per device
HEADS, DIM = 2, 16
#: the core's direct attention as the gradients' reference: explicit, in one piece,
#: differentiated automatically
PLAIN = dict(
    fused_attention=False,
    autotune=Fixed(attention_chunks=1, attention_backward="autodiff"),
)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def oracle(q, k, v, lens, causal):
    """The float64 oracle on ``(B, T, H, D)`` arrays, `BLOCK` query rows at a time (the
    whole score matrix of the longest case would take 128 MiB per head)."""
    qh, kh, vh = (np.transpose(np.asarray(t, np.float64), (0, 2, 1, 3)) for t in (q, k, v))
    tq, tk = qh.shape[2], kh.shape[2]
    full = reference.causal_mask(tq, tk) if causal else np.ones((tq, tk), bool)
    outs = []
    for r in range(0, tq, BLOCK):
        rows = slice(r, r + BLOCK)
        rows_lens = None if lens is None else (lens if lens.ndim == 1 else lens[:, rows])
        out, _ = reference.scaled_dot_product_attention(
            qh[:, :, rows], kh, vh, mask=full[rows], valid_lens=rows_lens
        )
        outs.append(out)
    return np.transpose(np.concatenate(outs, axis=2), (0, 2, 1, 3))


def case(rng, mesh, *, dtype, tq, tk, causal, lens_kind, batch=2):
    q = rng.standard_normal((batch, tq, HEADS, DIM)).astype(dtype)
    k = rng.standard_normal((batch, tk, HEADS, DIM)).astype(dtype)
    v = rng.standard_normal((batch, tk, HEADS, DIM)).astype(dtype)
    lens = None
    if lens_kind == "batch":
        lens = np.array([tk // 3 + 5, tk][:batch], "int32")
    elif lens_kind == "query":  # per query; query rows of length 0 attend to nothing
        lens = rng.integers(0, tk + 1, size=(batch, tq)).astype("int32")
        lens[:, :7] = 0
    got = np.asarray(ring_attention(q, k, v, mesh=mesh, valid_lens=lens, causal=causal))
    result = {"oracle": rel_err(got, oracle(q, k, v, lens, causal))}
    if lens_kind == "query":
        result["empty_rows_zero"] = bool(np.all(got[:, :7] == 0.0))
    return result


def gradients(rng, mesh):
    """Gradients w.r.t. query, key and value of ``sum(out * probe)`` under causal masking
    and lengths: ring attention on 8 devices, in float32 and in float64, against the
    core's direct attention in float64 on one device (the oracle has no gradients; the
    core's direct path is checked against it in ``tests/backend``)."""
    batch, t = 1, DEVICES * BLOCK
    q, k, v, probe = (
        rng.standard_normal((batch, t, HEADS, DIM)).astype("float32") for _ in range(4)
    )
    lens = np.array([t - 100], "int32")

    def ring_loss(q, k, v):
        out = ring_attention(q, k, v, mesh=mesh, valid_lens=lens, causal=True)
        return (out * probe.astype(out.dtype)).sum()

    def direct_loss(q, k, v):
        # The core on (batch, heads, seq, dim): heads as a leading axis.
        qh, kh, vh = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        out = scaled_dot_product_attention(qh, kh, vh, valid_lens=lens, causal=True)
        return (out.transpose(0, 2, 1, 3) * probe.astype(out.dtype)).sum()

    q64, k64, v64 = (t.astype("float64") for t in (q, k, v))
    # the plain direct path: measuring the kernel choices here would time a reference
    with jax.default_device(jax.devices()[0]), settings(**PLAIN):
        want = jax.jit(jax.grad(direct_loss, argnums=(0, 1, 2)))(q64, k64, v64)
    report = {}
    for dtype, args in (("float32", (q, k, v)), ("float64", (q64, k64, v64))):
        got = jax.jit(jax.grad(ring_loss, argnums=(0, 1, 2)))(*args)
        assert all(g.dtype == dtype for g in got)
        report[dtype] = {n: rel_err(g, w) for n, g, w in zip(("query", "key", "value"), got, want)}
    return report


def main() -> dict:
    rng = np.random.default_rng(0)
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("seq",))
    mesh_2d = Mesh(np.array(jax.devices()[:DEVICES]).reshape(2, 4), ("batch", "seq"))
    t = DEVICES * BLOCK
    report = {"devices": len(jax.devices()), "tokens": t}
    report["float32_full"] = case(
        rng, mesh, dtype="float32", tq=t, tk=t, causal=False, lens_kind="batch"
    )
    report["float32_causal"] = case(
        rng, mesh, dtype="float32", tq=t, tk=t, causal=True, lens_kind="query"
    )
    report["float64_causal"] = case(
        rng, mesh, dtype="float64", tq=t, tk=t, causal=True, lens_kind="batch", batch=1
    )
    report["float32_causal_cross"] = case(
        rng, mesh, dtype="float32", tq=t // 2, tk=t, causal=True, lens_kind=None, batch=1
    )
    # Batch split over a second mesh axis, sequence over 4 devices.
    q = rng.standard_normal((2, 1024, HEADS, DIM)).astype("float32")
    got = ring_attention(q, q, q, mesh=mesh_2d, batch_axis="batch", causal=True)
    report["float32_batch_x_seq"] = {"oracle": rel_err(got, oracle(q, q, q, None, True))}
    report["output_spec"] = [a for a in got.sharding.spec]
    report["gradients"] = gradients(rng, mesh)
    return report


if __name__ == "__main__":
    print(json.dumps(main()))

"""Worker: a TransformerEncoderLayer under keras.distribution on 8 host devices (JAX).

Run by ``tests/test_distributed_jax.py`` in a process of its own with
``KERAS_BACKEND=jax``, ``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=8``. Prints one JSON object: the
relative errors of the sharded runs against the single-device run, the shardings the
weights got, and per-device memory of a large layer.
"""

from __future__ import annotations

import json
import sys

import jax
import keras
import numpy as np
from keras.distribution import DataParallel, DeviceMesh, distribute_tensor, list_devices

from multiattn.distributed import layout_map, model_parallel, sharded_heads_rules
from multiattn.layers import TransformerEncoderLayer

D_MODEL, HEADS, DFF, BATCH, SEQ = 64, 8, 128, 8, 32


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def make_layer(weights=None, d_model=D_MODEL, heads=HEADS, dff=DFF, batch=BATCH, seq=SEQ):
    layer = TransformerEncoderLayer(d_model, heads, dff, rate=0.0, norm_first=True, seed=1)
    layer.build((batch, seq, d_model))
    if weights is not None:
        layer.set_weights(weights)
    return layer


def forward_and_grads(layer, x, lens, probe, distribution=None):
    """Output and the gradients of ``sum(output * probe)`` w.r.t. the weights and ``x``."""
    if distribution is not None:
        x = distribute_tensor(x, distribution.get_data_layout(x.shape))
        probe = distribute_tensor(probe, distribution.get_data_layout(probe.shape))
        lens = distribute_tensor(lens, distribution.get_data_layout(lens.shape))
    trainable = [v.value for v in layer.trainable_variables]
    fixed = [v.value for v in layer.non_trainable_variables]  # the dropout seed state

    @jax.jit
    def run(trainable, x, lens, probe):
        def loss(trainable, x):
            out, _ = layer.stateless_call(trainable, fixed, x, valid_lens=lens, causal=True)
            return keras.ops.sum(out * probe), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(trainable, x)
        return out, grads

    out, (g_weights, g_x) = run(trainable, x, lens, probe)
    return out, list(g_weights), g_x


def compare(reference, got, paths) -> dict:
    """Relative errors against the single-device run. The gradient of the key bias is
    zero in exact arithmetic (a shift of every score of a row by the same amount), so it
    is checked against the scale of all weight gradients instead of its own."""
    out0, gw0, gx0 = reference
    out, gw, gx = got
    scale = max(float(np.abs(np.asarray(g)).max()) for g in gw0)
    exact_zero = [p.endswith("key_bias") for p in paths]
    return {
        "forward": rel_err(out, out0),
        "grad_weights": max(rel_err(a, b) for a, b, zero in zip(gw, gw0, exact_zero) if not zero),
        "grad_key_bias": max(
            float(max(np.abs(np.asarray(a)).max(), np.abs(np.asarray(b)).max())) / scale
            for a, b, zero in zip(gw, gw0, exact_zero)
            if zero
        ),
        "grad_input": rel_err(gx, gx0),
    }


def spec_axes(sharding, rank: int) -> list:
    spec = list(sharding.spec) + [None] * (rank - len(sharding.spec))
    return [a if a is None or isinstance(a, str) else list(a) for a in spec]


def equality() -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SEQ, D_MODEL)).astype("float32")
    probe = rng.standard_normal((BATCH, SEQ, D_MODEL)).astype("float32")
    lens = rng.integers(1, SEQ + 1, size=(BATCH,)).astype("int32")
    single = make_layer()
    weights = single.get_weights()
    reference = forward_and_grads(single, x, lens, probe)
    paths = [v.path.split("/", 1)[1] for v in single.trainable_variables]
    report = {"devices": len(jax.devices())}

    data = DataParallel(device_mesh=DeviceMesh((8,), ("batch",), list_devices()))
    with data.scope():
        layer = make_layer(weights)
        report["data_parallel"] = compare(
            reference, forward_and_grads(layer, x, lens, probe, data), paths
        )

    mesh = DeviceMesh((2, 4), ("batch", "model"), list_devices())
    model = model_parallel(mesh)
    with model.scope():
        layer = make_layer(weights)
        got = forward_and_grads(layer, x, lens, probe, model)
        report["model_parallel"] = compare(reference, got, paths)
        layouts = layout_map(mesh)
        report["weights"] = {
            v.path: {
                "shape": list(v.shape),
                "layout": None if layouts[v.path] is None else list(layouts[v.path].axes),
                "spec": spec_axes(v.value.sharding, len(v.shape)),
                "shard_shape": list(v.value.addressable_shards[0].data.shape),
                "devices": len(v.value.sharding.device_set),
            }
            for v in layer.weights
        }
        report["output_spec"] = spec_axes(got[0].sharding, 3)
    report["rules"] = {k: list(v) for k, v in sharded_heads_rules().items()}
    return report


def memory() -> dict:
    """Per-device memory of one training step's gradient computation of a large layer,
    from XLA's buffer assignment (``compiled.memory_analysis()``), on one device and on a
    (2 batch x 4 model) mesh; and the bytes of the weight shards each device holds."""
    d_model, heads, dff, batch, seq = 1024, 16, 4096, 8, 1024
    x_shape = (batch, seq, d_model)

    def measure(distribution=None):
        layer = make_layer(None, d_model, heads, dff, batch, seq)
        trainable = [v.value for v in layer.trainable_variables]
        fixed = [v.value for v in layer.non_trainable_variables]
        sharding = None
        if distribution is not None:
            sharding = distribution.get_data_layout(x_shape).backend_layout
        x = jax.ShapeDtypeStruct(x_shape, "float32", sharding=sharding)

        def loss(trainable, x):
            out, _ = layer.stateless_call(trainable, fixed, x, causal=True)
            return keras.ops.mean(out**2)

        compiled = jax.jit(jax.grad(loss)).lower(trainable, x).compile()
        stats = compiled.memory_analysis()
        device0 = jax.devices()[0]
        weight_bytes = sum(
            s.data.nbytes for v in trainable for s in v.addressable_shards if s.device == device0
        )
        return {
            "arguments": int(stats.argument_size_in_bytes),
            "outputs": int(stats.output_size_in_bytes),
            "temporaries": int(stats.temp_size_in_bytes),
            "aliased": int(stats.alias_size_in_bytes),
            "total": int(
                stats.argument_size_in_bytes
                + stats.output_size_in_bytes
                + stats.temp_size_in_bytes
                - stats.alias_size_in_bytes
            ),
            "weights_on_device0": int(weight_bytes),
        }

    report = {
        "size": {"d_model": d_model, "num_heads": heads, "dff": dff, "batch": batch, "seq": seq}
    }
    report["one_device"] = measure()
    mesh = DeviceMesh((2, 4), ("batch", "model"), list_devices())
    model = model_parallel(mesh)
    with model.scope():
        report["mesh_2x4"] = measure(model)
    return report


if __name__ == "__main__":
    part = sys.argv[1]
    print(json.dumps(equality() if part == "equality" else memory()))

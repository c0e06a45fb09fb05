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

from multiattn.config import settings
from multiattn.distributed import layout_map, model_parallel
from multiattn.layers import TransformerEncoderLayer
from multiattn.tuning import Fixed

D_MODEL, HEADS, DFF, BATCH, SEQ = 64, 8, 128, 8, 32
#: the kernel choices of the memory measurement: the plain explicit path, differentiated
#: automatically, in one piece (every projection is its own product)
PINNED = dict(
    fused_attention=False,
    autotune=Fixed(attention_chunks=1, attention_backward="autodiff"),
)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def make_layer(
    weights=None, d_model=D_MODEL, heads=HEADS, dff=DFF, batch=BATCH, seq=SEQ, dtype="float32"
):
    layer = TransformerEncoderLayer(
        d_model, heads, dff, rate=0.0, norm_first=True, seed=1, dtype=dtype
    )
    layer.build((batch, seq, d_model))
    if weights is not None:
        layer.set_weights(weights)
    return layer


def numpy_weights(layer, seed=2):
    """Fixed random weights for ``layer`` (kernels scaled by 1/sqrt(fan-in), norms near
    1 and 0, biases small), so that every run computes the same numbers."""
    rng = np.random.default_rng(seed)
    out = []
    for w in layer.weights:
        shape = tuple(w.shape)
        if w.path.endswith("gamma"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1 or w.path.endswith("_bias"):
            value = 0.1 * rng.standard_normal(shape)
        else:
            fan_in = (
                shape[0] if not w.path.endswith("attention_output/kernel") else shape[0] * shape[1]
            )
            value = rng.standard_normal(shape) / np.sqrt(fan_in)
        out.append(value.astype("float32"))
    return out


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
    exact_zero = [p.endswith("key/bias") for p in paths]
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


def fit_weights(weights=None, distribution=None):
    """Weights of a functional model around the layer after two epochs of ``model.fit``
    (SGD, one batch of 8 per epoch, split over the batch axis by Keras)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, SEQ, D_MODEL)).astype("float32")
    y = rng.standard_normal((BATCH, SEQ, D_MODEL)).astype("float32")

    def build():
        inputs = keras.Input((SEQ, D_MODEL))
        outputs = TransformerEncoderLayer(D_MODEL, HEADS, DFF, rate=0.0)(inputs, causal=True)
        model = keras.Model(inputs, outputs)
        model.set_weights(numpy_weights(model) if weights is None else weights)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    if distribution is None:
        model = build()
    else:
        with distribution.scope():
            model = build()
    initial = [np.array(w) for w in model.get_weights()]
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return initial, [np.array(w) for w in model.get_weights()], [w.path for w in model.weights]


def compare_fit(reference, got) -> dict:
    """Weights after ``fit`` against one device; the key bias (zero gradient in exact
    arithmetic, initialised to zero) against the scale of all weights."""
    (_, want, paths), (_, weights, _) = reference, got
    scale = max(float(np.abs(w).max()) for w in want)
    return {
        "weights": max(
            rel_err(a, b) for a, b, p in zip(weights, want, paths) if not p.endswith("key/bias")
        ),
        "key_bias": max(
            float(np.abs(a - b).max()) / scale
            for a, b, p in zip(weights, want, paths)
            if p.endswith("key/bias")
        ),
    }


def spec_axes(sharding, rank: int) -> list:
    spec = list(sharding.spec) + [None] * (rank - len(sharding.spec))
    return [a if a is None or isinstance(a, str) else list(a) for a in spec]


def equality() -> dict:
    """Forward and gradients in float32 and float64 (``JAX_ENABLE_X64=1``), and two
    epochs of ``model.fit`` in float32: data parallel on 8 devices and model parallel on
    a 2 x 4 mesh against one device; the shardings the weights got."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SEQ, D_MODEL))
    probe = rng.standard_normal((BATCH, SEQ, D_MODEL))
    lens = rng.integers(1, SEQ + 1, size=(BATCH,)).astype("int32")
    data = DataParallel(device_mesh=DeviceMesh((8,), ("batch",), list_devices()))
    mesh = DeviceMesh((2, 4), ("batch", "model"), list_devices())
    model = model_parallel(mesh)
    report = {"devices": len(jax.devices())}
    for dtype in ("float32", "float64"):
        xs, probes = x.astype(dtype), probe.astype(dtype)
        single = make_layer(dtype=dtype)
        weights = [w.astype(dtype) for w in numpy_weights(single)]
        single.set_weights(weights)
        reference = forward_and_grads(single, xs, lens, probes)
        paths = [v.path.split("/", 1)[1] for v in single.trainable_variables]
        for name, distribution in (("data_parallel", data), ("model_parallel", model)):
            with distribution.scope():
                layer = make_layer(weights, dtype=dtype)
                got = forward_and_grads(layer, xs, lens, probes, distribution)
            report[f"{name}_{dtype}"] = compare(reference, got, paths)
            if name == "model_parallel" and dtype == "float32":
                sharded_float32, output_float32 = layer, got[0]

    fit_single = fit_weights()
    report["fit_data_parallel"] = compare_fit(fit_single, fit_weights(fit_single[0], data))
    report["fit_model_parallel"] = compare_fit(fit_single, fit_weights(fit_single[0], model))

    layouts = layout_map(mesh)
    report["weights"] = {
        v.path: {
            "shape": list(v.shape),
            "layout": None if layouts[v.path] is None else list(layouts[v.path].axes),
            "spec": spec_axes(v.value.sharding, len(v.shape)),
            "shard_shape": list(v.value.addressable_shards[0].data.shape),
            "devices": len(v.value.sharding.device_set),
        }
        for v in sharded_float32.weights
    }
    report["output_spec"] = spec_axes(output_float32.sharding, 3)
    return report


def memory() -> dict:
    """Per-device memory of one training step's gradient computation of a large layer,
    from XLA's buffer assignment (``compiled.memory_analysis()``), on one device and on a
    (2 batch x 4 model) mesh; and the bytes of the weight shards each device holds.

    The measured kernel choices are pinned (`PINNED`): the program's memory depends on
    them, and measuring them at this size ran the layer's attention and projections for
    about three minutes, where compiling alone takes seconds."""
    with settings(**PINNED):
        return _memory()


def _memory() -> dict:
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
    parts = {"equality": equality, "memory": memory}
    names = sys.argv[1:] or list(parts)
    print(json.dumps({name: parts[name]() for name in names}))

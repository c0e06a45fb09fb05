"""The implementations timed in each framework's worker process.

Every builder takes the run's configuration and the input (a NumPy array ``(batch,
length, width)``) and returns a `Framework`: its implementations, each with a
``forward`` and a ``fwd_bwd`` call that blocks until the result is computed, and a
square matmul of the framework for the peak. Builders import their framework; a worker
process calls exactly one of them (Keras reads ``KERAS_BACKEND`` once per process, and
Paddle must never share a process with TensorFlow).

The loss of every backward pass is the sum of the output; gradients are taken with
respect to every trainable parameter and the input.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import config
from .common import Impl, describe_error

#: framework -> (Keras backend of its worker or None, modules it needs)
FRAMEWORKS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "jax": ("jax", ("jax",)),
    "torch": ("torch", ("torch",)),
    "tensorflow": ("tensorflow", ("tensorflow",)),
    "paddle": (None, ("paddle",)),
}

#: Which native layers each multiattn path is compared with.
NATIVE_NOTE = {
    "jax": "keras.layers.MultiHeadAttention (Keras jax) and flax.nnx.MultiHeadAttention",
    "torch": "torch.nn.MultiheadAttention and keras.layers.MultiHeadAttention (Keras torch)",
    "tensorflow": "keras.layers.MultiHeadAttention (Keras tensorflow)",
    "paddle": "paddle.nn.MultiHeadAttention",
}


@dataclass
class Framework:
    impls: list[Impl] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"id", "label", "kind", "reason"}
    matmul: Callable[[int], Callable[[], Any]] | None = None
    #: further square matrix products the framework offers (name -> factory); the peak
    #: is the fastest of these and ``matmul``
    other_matmuls: dict[str, Callable[[int], Callable[[], Any]]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    #: context manager measuring a call's peak memory (``delta`` bytes, ``method``);
    #: None: `multiattn.bench.common.PeakRSS`
    memory: Callable[[], Any] | None = None
    #: ``--autotune``: every multiattn implementation also runs a second time, built
    #: anew, its calls under ``settings(autotune=True)`` (id ``<id>-autotuned``)
    autotune: bool = False


def missing_modules(framework: str) -> list[str]:
    return [m for m in FRAMEWORKS[framework][1] if importlib.util.find_spec(m) is None]


def _add(fw: Framework, spec: tuple[str, str, str], build: Callable[[], dict]) -> None:
    """Build one implementation; a failure skips it with the reason, not the framework."""
    ident, label, kind = spec
    try:
        calls = build()
    except Exception as err:
        fw.skipped.append(
            {"id": ident, "label": label, "kind": kind, "reason": "failed: " + describe_error(err)}
        )
        return
    fw.impls.append(Impl(ident, label, kind, calls))
    if fw.autotune and kind == "multiattn":
        tuned = {mode: _autotuned(call) for mode, call in build().items()}
        fw.impls.append(Impl(f"{ident}-autotuned", f"{label}, autotune on", kind, tuned))


def _autotuned(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` under ``settings(autotune=True)`` (its first call times the choices)."""

    def run() -> Any:
        with config.settings(autotune=True):
            return call()

    return run


# --- jax --------------------------------------------------------------------------------


def build_jax(cfg: dict, x_np: np.ndarray) -> Framework:
    import jax
    import jax.numpy as jnp
    import keras

    from multiattn.layers import MultiHeadAttention

    h, e, dtype = cfg["heads"], cfg["width"], cfg["dtype"]
    x = jnp.asarray(x_np, dtype=dtype)
    fw = Framework(
        autotune=cfg.get("autotune", False),
        info={"versions": {"jax": jax.__version__, "keras": keras.__version__}},
    )

    def keras_calls(layer: Any) -> dict:
        layer(x, x)  # build
        tv = [v.value for v in layer.trainable_variables]
        ntv = [v.value for v in layer.non_trainable_variables]

        def fwd(tv, ntv, x):
            return layer.stateless_call(tv, ntv, x, x)[0]

        def loss(tv, x, ntv):
            return jnp.sum(layer.stateless_call(tv, ntv, x, x)[0].astype("float32"))

        fwd_jit = jax.jit(fwd)
        grad_jit = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return {
            "forward": lambda: jax.block_until_ready(fwd_jit(tv, ntv, x)),
            "fwd_bwd": lambda: jax.block_until_ready(grad_jit(tv, x, ntv)),
        }

    _add(
        fw,
        ("multiattn-jax", "multiattn MultiHeadAttention (Keras jax, jax.jit)", "multiattn"),
        lambda: keras_calls(MultiHeadAttention(num_heads=h, key_dim=e // h, dtype=dtype)),
    )
    _add(
        fw,
        ("keras-jax", "keras.layers.MultiHeadAttention (Keras jax, jax.jit)", "native"),
        lambda: keras_calls(
            keras.layers.MultiHeadAttention(num_heads=h, key_dim=e // h, dtype=dtype)
        ),
    )

    flax_spec = ("flax-nnx", "flax.nnx.MultiHeadAttention (jax.jit)", "native")
    if importlib.util.find_spec("flax") is None:
        fw.skipped.append(
            dict(zip(("id", "label", "kind"), flax_spec), reason="flax is not installed")
        )
    else:

        def flax_calls() -> dict:
            import flax
            from flax import nnx

            fw.info["versions"]["flax"] = flax.__version__
            model = nnx.MultiHeadAttention(
                num_heads=h,
                in_features=e,
                qkv_features=e,
                out_features=e,
                dtype=dtype,
                param_dtype=dtype,
                decode=False,
                deterministic=True,
                rngs=nnx.Rngs(0),
            )
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)

            def fwd(params, x):
                return nnx.merge(graphdef, params, rest)(x)

            def loss(params, x):
                return jnp.sum(nnx.merge(graphdef, params, rest)(x).astype("float32"))

            fwd_jit = jax.jit(fwd)
            grad_jit = jax.jit(jax.grad(loss, argnums=(0, 1)))
            return {
                "forward": lambda: jax.block_until_ready(fwd_jit(params, x)),
                "fwd_bwd": lambda: jax.block_until_ready(grad_jit(params, x)),
            }

        _add(fw, flax_spec, flax_calls)

    def matmul(n: int) -> Callable[[], Any]:
        a = jnp.asarray(np.random.default_rng(1).standard_normal((n, n)), dtype=dtype)
        mm = jax.jit(jnp.matmul)
        return lambda: jax.block_until_ready(mm(a, a))

    fw.matmul = matmul
    fw.info["threads"] = "XLA CPU (all cores)"
    return fw


# --- torch ------------------------------------------------------------------------------


def build_torch(cfg: dict, x_np: np.ndarray) -> Framework:
    import keras
    import torch

    from multiattn.layers import MultiHeadAttention

    h, e, dtype = cfg["heads"], cfg["width"], cfg["dtype"]
    tdtype = getattr(torch, dtype)
    x = torch.from_numpy(np.asarray(x_np, dtype="float32")).to(tdtype)
    fw = Framework(
        autotune=cfg.get("autotune", False),
        info={
            "versions": {"torch": torch.__version__, "keras": keras.__version__},
            "threads": torch.get_num_threads(),
        },
    )

    def calls(run: Callable[[Any], Any], params: list[Any]) -> dict:
        leaf = x.detach().clone().requires_grad_(True)

        def forward() -> Any:
            with torch.no_grad():
                return run(x)

        def fwd_bwd() -> Any:
            for p in params:
                p.grad = None
            leaf.grad = None
            run(leaf).sum().backward()
            return leaf.grad

        return {"forward": forward, "fwd_bwd": fwd_bwd}

    def keras_calls(layer: Any) -> dict:
        layer(x, x)  # build
        return calls(lambda t: layer(t, t), [v.value for v in layer.trainable_variables])

    def torch_calls() -> dict:
        mha = torch.nn.MultiheadAttention(e, h, batch_first=True, dtype=tdtype).eval()
        return calls(lambda t: mha(t, t, t, need_weights=False)[0], list(mha.parameters()))

    _add(
        fw,
        ("multiattn-torch", "multiattn MultiHeadAttention (Keras torch, eager)", "multiattn"),
        lambda: keras_calls(MultiHeadAttention(num_heads=h, key_dim=e // h, dtype=dtype)),
    )
    _add(
        fw,
        ("torch-nn", "torch.nn.MultiheadAttention (eager)", "native"),
        torch_calls,
    )
    _add(
        fw,
        ("keras-torch", "keras.layers.MultiHeadAttention (Keras torch, eager)", "native"),
        lambda: keras_calls(
            keras.layers.MultiHeadAttention(num_heads=h, key_dim=e // h, dtype=dtype)
        ),
    )

    def matmul(n: int) -> Callable[[], Any]:
        a = torch.randn(n, n, generator=torch.Generator().manual_seed(1)).to(tdtype)
        return lambda: torch.matmul(a, a)

    fw.matmul = matmul
    from multiattn.tuning import torch_linear

    if torch_linear.available() and dtype == "float32":
        # The second library multiattn's projections may run on under autotune.

        def onednn(n: int) -> Callable[[], Any]:
            a = torch.randn(n, n, generator=torch.Generator().manual_seed(1))
            return lambda: torch_linear.onednn(a, a, None)

        fw.other_matmuls["oneDNN linear"] = onednn
    fw.info["torch_onednn_projections"] = torch_linear.available() and dtype == "float32"
    fw.info["torch_projection_library"] = (
        "torch.addmm (default; oneDNN or BLAS measured per shape class under autotune)"
    )
    return fw


# --- tensorflow -------------------------------------------------------------------------


def build_tensorflow(cfg: dict, x_np: np.ndarray) -> Framework:
    import keras
    import tensorflow as tf

    from multiattn.layers import MultiHeadAttention

    h, e, dtype = cfg["heads"], cfg["width"], cfg["dtype"]
    x = tf.cast(tf.constant(np.asarray(x_np, dtype="float32")), dtype)
    fw = Framework(
        autotune=cfg.get("autotune", False),
        info={
            "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
            "threads": tf.config.threading.get_intra_op_parallelism_threads() or "default",
        },
    )

    def keras_calls(layer: Any) -> dict:
        layer(x, x)  # build

        @tf.function
        def forward(x):
            return layer(x, x)

        @tf.function
        def fwd_bwd(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(tf.cast(layer(x, x), "float32"))
            return tape.gradient(loss, [*layer.trainable_variables, x])

        return {"forward": lambda: forward(x), "fwd_bwd": lambda: fwd_bwd(x)}

    _add(
        fw,
        (
            "multiattn-tf",
            "multiattn MultiHeadAttention (Keras tensorflow, tf.function)",
            "multiattn",
        ),
        lambda: keras_calls(MultiHeadAttention(num_heads=h, key_dim=e // h, dtype=dtype)),
    )
    _add(
        fw,
        ("keras-tf", "keras.layers.MultiHeadAttention (Keras tensorflow, tf.function)", "native"),
        lambda: keras_calls(
            keras.layers.MultiHeadAttention(num_heads=h, key_dim=e // h, dtype=dtype)
        ),
    )

    def matmul(n: int) -> Callable[[], Any]:
        a = tf.cast(tf.random.stateless_normal((n, n), seed=(1, 0)), dtype)
        return lambda: tf.linalg.matmul(a, a)

    fw.matmul = matmul
    try:
        tf.config.experimental.get_memory_info("CPU:0")
    except (ValueError, RuntimeError, tf.errors.OpError):
        pass  # no allocator statistics: RSS
    else:
        fw.memory = _TFAllocatorPeak
    return fw


class _TFAllocatorPeak:
    """Peak bytes in use by TensorFlow's CPU allocator during a ``with`` block, above the
    bytes in use at entry.

    TensorFlow with oneDNN keeps freed memory in its own pool (a BFC allocator), so once
    warmed up a call no longer grows the process's RSS; the allocator's own statistics
    see what the call allocates.
    """

    method = "tf-allocator"

    def __enter__(self) -> _TFAllocatorPeak:
        import tensorflow as tf

        tf.config.experimental.reset_memory_stats("CPU:0")
        self.base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        return self

    def __exit__(self, *exc: Any) -> None:
        import tensorflow as tf

        self.delta = max(0, tf.config.experimental.get_memory_info("CPU:0")["peak"] - self.base)


# --- paddle -----------------------------------------------------------------------------


def build_paddle(cfg: dict, x_np: np.ndarray) -> Framework:
    # The adapter imports paddle first (paddle after TensorFlow segfaults) and registers
    # the Paddle namespace of the core.
    import paddle

    from multiattn.backends import paddle as adapter

    b, length, h, e, dtype = cfg["batch"], cfg["length"], cfg["heads"], cfg["width"], cfg["dtype"]
    paddle.set_device("cpu")
    paddle.set_default_dtype(dtype)
    x = paddle.to_tensor(np.asarray(x_np, dtype="float32")).astype(dtype)
    fw = Framework(
        autotune=cfg.get("autotune", False), info={"versions": {"paddle": paddle.__version__}}
    )
    del b

    def calls(run: Callable[[Any], Any], layer: Any) -> dict:
        leaf = x.detach().clone()
        leaf.stop_gradient = False

        def forward() -> Any:
            with paddle.no_grad():
                return run(x)

        def fwd_bwd() -> Any:
            layer.clear_gradients(set_to_zero=False)
            leaf.clear_gradient(set_to_zero=False)
            run(leaf).sum().backward()
            return leaf.grad

        return {"forward": forward, "fwd_bwd": fwd_bwd}

    def ours() -> dict:
        layer = adapter.MultiHeadAttention(length, e, e // h, e, h)
        return calls(lambda t: layer(t, t, t, None), layer)

    def native() -> dict:
        layer = paddle.nn.MultiHeadAttention(e, h)
        layer.eval()
        return calls(lambda t: layer(t), layer)

    _add(
        fw,
        (
            "multiattn-paddle",
            "multiattn.backends.paddle.MultiHeadAttention (adapter, eager)",
            "multiattn",
        ),
        ours,
    )
    _add(fw, ("paddle-nn", "paddle.nn.MultiHeadAttention (eager)", "native"), native)

    def matmul(n: int) -> Callable[[], Any]:
        a = paddle.to_tensor(np.random.default_rng(1).standard_normal((n, n)), dtype=dtype)
        return lambda: paddle.matmul(a, a)

    fw.matmul = matmul
    fw.info["threads"] = "default"
    return fw


BUILDERS = {
    "jax": build_jax,
    "torch": build_torch,
    "tensorflow": build_tensorflow,
    "paddle": build_paddle,
}

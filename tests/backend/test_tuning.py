"""Kernel choices by measurement (`multiattn.tuning`) on each backend: the projection
library on torch (given by `multiattn.tuning.Fixed`, one timing per shape class, the same
results whichever library wins, nothing timed while a compiler traces),
fused-or-explicit attention, and nothing timed, recorded or even imported without a
tuner.

Where a test depends on which candidate wins, the timing is replaced by a fake that
declares the winner and counts how often it runs; no assertion depends on how fast
anything actually runs."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _support import BACKEND, assert_close, cast

from multiattn import config, tuning
from multiattn.namespaces.keras import get_ops
from multiattn.tuning import Fixed, _store, choices

# the timing of choices is what these tests exercise
pytestmark = pytest.mark.usefixtures("autotuned")

RNG = np.random.default_rng(11)
torch_only = pytest.mark.skipif(BACKEND != "torch", reason="the projection choice is PyTorch's")


@pytest.fixture(autouse=True)
def fresh():
    tuning.reset()
    yield
    tuning.reset()


def fake_timing(monkeypatch, winner: str) -> list:
    """Replace the timing by one in which ``winner`` takes 1 ms and the others 2 ms;
    returns the list of timed candidate sets (one entry per timing)."""
    timed: list = []

    def measure(fns, repeats, sync):
        timed.append(sorted(fns))
        return {name: [0.001 if name == winner else 0.002] for name in fns}, {}

    monkeypatch.setattr(_store, "_measure", measure)
    return timed


def no_timing(monkeypatch) -> None:
    def measure(fns, repeats, sync):
        raise AssertionError("nothing should be timed here")

    monkeypatch.setattr(_store, "_measure", measure)


@pytest.fixture
def routes(monkeypatch):
    """Counts the products run by each library of `multiattn.tuning.torch_linear`
    (``{"onednn": n, "blas": n}``; PyTorch's own product, without a tuner, is neither)."""
    from multiattn.tuning import torch_linear

    if not torch_linear.available():
        pytest.skip("this PyTorch build has no oneDNN linear operator")
    counts = {"onednn": 0, "blas": 0}
    for name in counts:
        real = getattr(torch_linear, name)

        def counted(*args, _name=name, _real=real):
            counts[_name] += 1
            return _real(*args)

        monkeypatch.setattr(torch_linear, name, counted)
    return counts


def _projection(rows_a: int, rows_b: int, width: int = 16, out: int = 8):
    x = RNG.standard_normal((rows_a, rows_b, width))
    kernel = RNG.standard_normal((width, out))
    bias = RNG.standard_normal((out,))
    return x, kernel, bias


def _forward_backward(x, kernel, bias, w=None):
    """Value and the gradients of ``sum(linear * w)`` (float32 torch), as float64 NumPy."""
    import torch

    if w is None:
        w = RNG.standard_normal(x.shape[:-1] + kernel.shape[-1:])
    leaves = [torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in (x, kernel, bias)]
    y = get_ops().linear(*leaves)
    grads = torch.autograd.grad((y * torch.tensor(w, dtype=torch.float32)).sum(), leaves)
    return [t.detach().numpy().astype(np.float64) for t in (y, *grads)], w


@torch_only
def test_a_fixed_library_is_obeyed(monkeypatch, routes):
    no_timing(monkeypatch)
    x, kernel, bias = _projection(3, 10)
    with config.settings(autotune=Fixed(torch_linear="onednn")):
        _forward_backward(x, kernel, bias)
    assert routes == {"onednn": 3, "blas": 0}  # forward, input and weight gradients
    for given in (Fixed(torch_linear="blas"), Fixed(), False):
        with config.settings(autotune=given):
            _forward_backward(x, kernel, bias)
    assert routes == {"onednn": 3, "blas": 0}  # PyTorch's own product
    assert tuning.decisions() == []


@torch_only
def test_timing_runs_once_per_shape_class(monkeypatch, routes):
    timed = fake_timing(monkeypatch, "blas")
    ops = get_ops()
    for rows_a, rows_b in ((3, 10), (2, 14), (3, 10)):  # 30, 28, 30 rows: class 32
        ops.linear(*(cast(a, "float32") for a in _projection(rows_a, rows_b)))
    assert timed == [["blas", "onednn"]]
    assert routes == {"onednn": 0, "blas": 3}
    ops.linear(*(cast(a, "float32") for a in _projection(5, 10)))  # 50 rows: class 64
    assert len(timed) == 2
    ops.linear(*(cast(a, "float32") for a in _projection(3, 10, width=40)))  # in 64
    assert len(timed) == 3
    # the backward pass decides its two products for their own shapes, once
    for _ in range(2):
        _forward_backward(*_projection(3, 10))
    assert len(timed) == 5
    found = tuning.decisions()
    assert all(d["op"] == "torch-linear" and d["choice"] == "blas" for d in found)
    assert {(d["shape_class"]["rows"], d["shape_class"]["in"]) for d in found} == {
        (32, 16),
        (64, 16),
        (32, 64),
        (32, 8),  # input gradient: (30, 8) @ (8, 16)
        (16, 32),  # weight gradient: (16, 30) @ (30, 8)
    }
    assert routes == {"onednn": 0, "blas": 3 + 2 + 3 * 2}


@torch_only
def test_either_winner_gives_the_same_results(monkeypatch, routes):
    x, kernel, bias = _projection(4, 9, width=24, out=12)
    w = RNG.standard_normal((4, 9, 12))
    results = {}
    for winner in ("onednn", "blas"):
        tuning.reset()
        fake_timing(monkeypatch, winner)
        before = dict(routes)
        results[winner], _ = _forward_backward(x, kernel, bias, w)
        assert routes[winner] - before[winner] == 3
        assert {d["choice"] for d in tuning.decisions()} == {winner}
    y = np.tensordot(x, kernel, 1) + bias
    want = [y, np.tensordot(w, kernel, (2, 1)), np.tensordot(x, w, ((0, 1), (0, 1))), w.sum((0, 1))]
    for got in results.values():
        for g, expected in zip(got, want):
            assert_close(g, expected, "float32")
    for a, b in zip(results["onednn"], results["blas"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@torch_only
@pytest.mark.parametrize("layout", ["rows", "cols", "strided"])
def test_both_libraries_compute_the_same_product(layout):
    import torch

    from multiattn.tuning import torch_linear

    if not torch_linear.available():
        pytest.skip("this PyTorch build has no oneDNN linear operator")
    gen = torch.Generator().manual_seed(3)
    a = torch_linear._random(37, 20, layout, gen)
    b = torch_linear._random(20, 11, "cols" if layout == "rows" else "rows", gen)
    assert torch_linear._layout(a) == layout
    bias = torch.randn(11, generator=gen)
    want = a.double() @ b.double() + bias.double()
    for fn in (torch_linear.onednn, torch_linear.blas):
        assert_close(fn(a, b, bias), want.numpy(), "float32")


@torch_only
def test_nothing_is_timed_while_a_compiler_traces(monkeypatch, routes):
    import torch

    from multiattn.tuning import torch_linear

    no_timing(monkeypatch)
    monkeypatch.setattr(choices, "torch_is_tracing", lambda: True)
    monkeypatch.setattr(torch_linear, "torch_is_tracing", lambda: True)
    _forward_backward(*_projection(3, 10))
    assert routes == {"onednn": 0, "blas": 0}  # PyTorch's own product
    a, b = torch.randn(30, 16), torch.randn(16, 8)
    assert torch_linear.route(a, b, None) == "blas"
    (decision,) = tuning.decisions()
    assert decision["how"] == "fallback" and "torch.compile" in decision["reason"]


@torch_only
def test_real_measurement_is_recorded(routes):
    _forward_backward(*_projection(3, 10))
    found = tuning.decisions()
    assert len(found) == 3 and all(d["how"] == "measured" for d in found)
    for d in found:
        assert set(d["median_ms"]) == {"onednn", "blas"} and d["choice"] in d["median_ms"]
        assert d["shape_class"]["threads"] >= 1 and d["timed"]
    assert sum(routes.values()) == 3  # forward, input and weight gradients


# --- fused or explicit attention ------------------------------------------------------


def _explicit(ops, q, k, v, scale, kv_heads_first=False):
    from multiattn.ops.attention import explicit_unmasked

    return explicit_unmasked(ops, q, k, v, scale, kv_heads_first)


def _qkv(tq: int, tk: int, heads: int = 2, dim: int = 4):
    return [cast(RNG.standard_normal((1, n, heads, dim)), "float32") for n in (tq, tk, tk)]


def _has_fused(ops) -> bool:
    return hasattr(ops, "fused_attention")


@pytest.mark.parametrize("winner", ["fused", "explicit"])
def test_attention_choice_follows_the_timing_once_per_class(monkeypatch, winner):
    ops = get_ops()
    timed = fake_timing(monkeypatch, winner)
    for tq in (5, 7, 8):  # one class: 8 queries
        got = tuning.fused_attention_pays(ops, *_qkv(tq, 6), explicit=_explicit)
        assert got is (winner == "fused")
    assert timed == [["explicit", "fused"]]
    tuning.fused_attention_pays(ops, *_qkv(9, 6), explicit=_explicit)
    assert len(timed) == 2
    (first, second) = tuning.decisions()
    assert first["op"] == "attention" and first["shape_class"]["queries"] == 8
    assert second["shape_class"]["queries"] == 16 and first["shape_class"]["backend"] == BACKEND


def test_long_attention_is_timed_on_fewer_queries(monkeypatch):
    """One head of 8192 x 8192 scores of width 64 is over the cap: the timing takes 2048
    queries."""
    fake_timing(monkeypatch, "fused")
    q, k, v = _qkv(8192, 8192, heads=1, dim=64)
    assert tuning.fused_attention_pays(get_ops(), q, k, v, explicit=_explicit)
    (decision,) = tuning.decisions()
    assert 2 * 8192 * 128 * 2048 == tuning.ATTENTION_FLOP_CAP
    assert decision["timed"].startswith("(1, 2048, 1, 64) queries, (1, 8192, 1, 64/64)")


def test_attention_choice_is_measured_eagerly():
    ops = get_ops()
    got = tuning.fused_attention_pays(ops, *_qkv(8, 8), explicit=_explicit)
    (decision,) = tuning.decisions()
    assert decision["how"] == "measured" and set(decision["median_ms"]) == {"fused", "explicit"}
    assert got is (decision["choice"] == "fused")


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="traced backends")
def test_attention_choice_is_measured_outside_the_trace():
    ops = get_ops()
    q, k, v = _qkv(8, 8)
    seen = []

    def traced(q, k, v):
        seen.append(tuning.fused_attention_pays(ops, q, k, v, explicit=_explicit))
        return q

    if BACKEND == "jax":
        import jax

        jax.jit(traced)(q, k, v)
    else:
        import tensorflow as tf

        tf.function(traced)(q, k, v)
    (decision,) = tuning.decisions()
    assert decision["how"] == "measured" and seen == [decision["choice"] == "fused"]


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="XLA backends")
def test_a_cache_under_xla_takes_the_explicit_path_untimed(monkeypatch):
    """Keys and values heads first (a cache) in code XLA compiles take the explicit path
    without timing (in a loop that carries the cache the fused layout copies it)."""
    no_timing(monkeypatch)
    ops = get_ops()
    q, k, v = _qkv(1, 8)
    k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in (k, v))
    seen = _cache_choice_under_xla(ops, q, k, v)
    (decision,) = tuning.decisions()
    assert seen == [False] and decision["choice"] == "explicit"
    assert decision["how"] == "fallback" and "heads first" in decision["reason"]


def _cache_choice_under_xla(ops, q, k, v) -> list:
    """`fused_attention_pays` for heads-first keys and values (a cache), taken while XLA
    compiles the caller (``jax.jit``, or ``tf.function`` with ``jit_compile``)."""
    seen = []

    def traced(q, k, v):
        seen.append(
            tuning.fused_attention_pays(ops, q, k, v, explicit=_explicit, kv_heads_first=True)
        )
        return q

    if BACKEND == "jax":
        import jax

        jax.jit(traced)(q, k, v)
    else:
        import tensorflow as tf

        tf.function(traced, jit_compile=True)(q, k, v)
    return seen


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="XLA backends")
def test_an_eager_decision_is_not_reused_for_a_cache_under_xla(monkeypatch):
    """The fused kernel measured faster on eager calls of the same sizes does not carry
    over to the cache in compiled code, which keeps the explicit path (the two are
    classes of their own)."""
    ops = get_ops()
    q, k, v = _qkv(1, 8)
    k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in (k, v))
    monkeypatch.setattr(
        _store, "_measure", lambda fns, repeats, sync: ({"fused": [1.0], "explicit": [2.0]}, {})
    )
    assert tuning.fused_attention_pays(ops, q, k, v, explicit=_explicit, kv_heads_first=True)
    seen = _cache_choice_under_xla(ops, q, k, v)
    assert seen == [False]


def test_symbolic_tensors_take_the_namespace_default(monkeypatch):
    no_timing(monkeypatch)
    ops = get_ops()
    q = keras.KerasTensor((1, 8, 2, 4), dtype="float32")
    got = tuning.fused_attention_pays(ops, q, q, q, explicit=_explicit)
    assert got is bool(getattr(ops, "fused_attention_pays", True))
    (decision,) = tuning.decisions()
    assert decision["how"] == "fallback" and "symbolic" in decision["reason"]


@pytest.mark.parametrize("forced", [True, False])
def test_fused_attention_setting_forces_the_path_without_timing(monkeypatch, forced):
    """``settings(fused_attention=...)`` takes the fused kernel (where the backend has
    one) or the explicit softmax without timing either; both give the oracle's numbers."""
    from multiattn import reference as ref
    from multiattn.ops.attention import attend

    ops = get_ops()

    def no_timing(*args, **kwargs):
        raise AssertionError("a forced choice was timed")

    monkeypatch.setattr(choices, "fused_attention_pays", no_timing)
    calls = []
    if _has_fused(ops):
        real = type(ops).fused_attention

        def spy(self, *args, **kwargs):
            calls.append(1)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(type(ops), "fused_attention", spy)
    q, k, v = _qkv(5, 7)
    with config.settings(fused_attention=forced):
        got = attend(ops, q, k, v, causal=True, scale=0.5)
    assert bool(calls) is (forced and _has_fused(ops))
    q64, k64, v64 = (np.swapaxes(keras.ops.convert_to_numpy(t), 1, 2) for t in (q, k, v))
    want, _ = ref.scaled_dot_product_attention(q64, k64, v64, causal=True, scale=0.5)
    assert_close(got, np.swapaxes(want, 1, 2), "float32")


def test_fused_attention_setting_refuses_non_bools():
    with pytest.raises(TypeError, match="fused_attention"):
        with config.settings(fused_attention="yes"):
            pass


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="traced backends")
@pytest.mark.parametrize("xla", [False, True])
def test_traced_choice_times_many_passes_compiled_as_the_caller(xla):
    """Under jax.jit / tf.function a small candidate is timed as many passes in one
    compiled loop (its work in compiled code, not the cost of a call), compiled as the
    caller is: on TensorFlow with XLA exactly where the caller's graph is, which the
    class records."""
    ops = get_ops()
    q, k, v = _qkv(8, 8)

    def traced(q, k, v):
        tuning.fused_attention_pays(ops, q, k, v, explicit=_explicit)
        return q

    if BACKEND == "jax":
        import jax

        if not xla:
            pytest.skip("jax always compiles with XLA")
        jax.jit(traced)(q, k, v)
    else:
        import tensorflow as tf

        tf.function(traced, jit_compile=xla)(q, k, v)
    (decision,) = tuning.decisions()
    assert decision["how"] == "measured"
    # 2 heads of 8 queries and 8 keys of width 4: 2 * 2 * 8 * 8 * (4 + 4) = 2048
    # operations a pass, far under FLOP_CAP: the most passes, 64
    assert decision["timed"] == (
        "(1, 8, 2, 4) queries, (1, 8, 2, 4/4) keys/values, 64 passes per call"
    )
    assert decision["shape_class"].get("xla", True) is xla or BACKEND == "jax"


# --- who decides: the tuner in force ----------------------------------------------------


def _attend(q, k, v):
    from multiattn.ops.attention import attend

    return attend(get_ops(), q, k, v, scale=0.5)


def test_the_attention_choice_is_timed_through_the_tuner_only_under_autotune(monkeypatch):
    """``attend`` asks the measuring tuner under autotune=True (the fused kernel against
    the explicit path, where the backend has one); a Fixed tuner and autotune off time
    nothing and record nothing."""
    ops = get_ops()
    asked = []
    real = choices.fused_attention_pays
    monkeypatch.setattr(choices, "fused_attention_pays", lambda *a: asked.append(1) or real(*a))
    fake_timing(monkeypatch, "explicit")
    q, k, v = _qkv(8, 8)
    _attend(q, k, v)  # autotune=True (the module's fixture)
    fused = _has_fused(ops) and not ops.fused_attention_streams  # torch's streams: untimed
    assert bool(asked) is fused and len(tuning.decisions()) == int(fused)
    tuning.reset()
    asked.clear()
    for given in (Fixed(), Fixed(attention_chunks=2), False):
        with config.settings(autotune=given):
            _attend(q, k, v)
    assert asked == [] and tuning.decisions() == []


def test_without_a_tuner_layers_record_no_decision():
    from multiattn import layers

    layer = layers.MultiHeadAttention(2, 4)
    x = cast(RNG.standard_normal((2, 5, 8)), "float32")
    with config.settings(autotune=False):
        layer(x, x)
        if BACKEND == "jax":
            import jax

            jax.jit(lambda x: layer(x, x))(x)
        elif BACKEND == "tensorflow":
            import tensorflow as tf

            tf.function(lambda x: layer(x, x), jit_compile=True)(x)
        assert config.tuner() is None
    assert tuning.decisions() == []


_UNTUNED_PROCESS = """\
import sys
import numpy as np
import keras
from multiattn import layers, ops
rng = np.random.default_rng(0)
layer = layers.MultiHeadAttention(2, 4)
x = keras.ops.convert_to_tensor(rng.standard_normal((2, 5, 8)).astype("float32"))
layer(x, x)
q = keras.ops.convert_to_tensor(rng.standard_normal((2, 2, 6, 4)).astype("float32"))
ops.scaled_dot_product_attention(q, q, q, causal=True)
backend = keras.backend.backend()
if backend == "jax":
    import jax
    jax.jit(lambda x: layer(x, x))(x)
elif backend == "tensorflow":
    import tensorflow as tf
    tf.function(lambda x: layer(x, x), jit_compile=True)(x)
assert "multiattn.tuning" not in sys.modules, "multiattn.tuning was imported"
print("untuned")
"""


def test_without_a_tuner_the_tuning_package_is_never_imported():
    """autotune off (the default): the layers and the core, eager and compiled, take the
    static defaults without importing `multiattn.tuning`."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != config.AUTOTUNE_ENV_VAR}
    env.update(KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, "-c", _UNTUNED_PROCESS],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "untuned" in done.stdout, done.stderr[-3000:]


def test_xla_device_says_where_xla_compiles_the_call():
    """The static fact `multiattn.ops.plan.default_chunks` reads: jax's default backend
    (XLA compiles every jax computation); on TensorFlow only inside a graph XLA compiles;
    None on the eager backends."""
    ops = get_ops()
    x = cast(RNG.standard_normal((2, 3)), "float32")
    if BACKEND == "jax":
        import jax

        assert ops.xla_device(x) == jax.default_backend()
        seen = []
        jax.jit(lambda t: seen.append(ops.xla_device(t)) or t)(x)
        assert seen == [jax.default_backend()]
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        device = "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
        seen = []

        def f(t):
            seen.append(ops.xla_device(t))
            return t

        tf.function(f)(x)
        tf.function(f, jit_compile=True)(x)
        assert ops.xla_device(x) is None and seen == [None, device]
    else:
        assert ops.xla_device(x) is None

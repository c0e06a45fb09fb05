"""Slices of the batch on Paddle: the document layers and the core's explicit attention
path run over slices side by side on the CPU's threads (`PaddleNamespace.map_batch`),
given by ``settings(autotune=Fixed(attention_chunks=n))`` or measured (``autotune=True``;
without a tuner, one piece). Values against the float64
oracle, gradients against the same call in one piece (itself checked against finite
differences of the oracle in ``test_adapter.py``), the threads, the gradient mode and the
settings the slices run under, and the measured choice."""

from __future__ import annotations

import os
import select
import signal
import threading

import numpy as np
import paddle
import pytest
from _paddle_support import assert_close, paddle_grads, tensor, to_np
from multiattn.backends import paddle as adapter
from test_adapter import HIDDEN, LENS, OUT_TOL, heads_of, inputs, make, oracle, params_of

from multiattn import config, ops, tuning
from multiattn import reference as ref
from multiattn.namespaces import paddle as _paddle_ops
from multiattn.tuning import Fixed

# the timing of choices is what these tests exercise
pytestmark = pytest.mark.usefixtures("autotuned")

RNG = np.random.default_rng(17)
SIDE_BY_SIDE = _paddle_ops.cpu_threads() >= 2


@pytest.fixture
def slices(monkeypatch):
    """The slice counts `PaddleNamespace.map_batch` was called with during the test."""
    seen: list[int] = []
    original = _paddle_ops.PaddleNamespace.map_batch

    def spy(self, fn, args, chunks, **kw):
        seen.append(chunks)
        return original(self, fn, args, chunks, **kw)

    monkeypatch.setattr(_paddle_ops.PaddleNamespace, "map_batch", spy)
    return seen


def _grads(layer, xs, lens, weights):
    out = layer(*xs, lens)
    loss = paddle.sum(out * tensor(weights, "float64"))
    params = [p for _, p in layer.named_parameters()]
    return out, paddle_grads(loss, [*params, *xs])


@pytest.mark.parametrize("lens", ["none", "int"])
@pytest.mark.parametrize("kind", ["dot", "mha"])
@pytest.mark.parametrize(("asked", "taken"), [(2, 2), (4, 4), (3, 2)])
def test_layer_slices_give_the_oracle_values_and_the_one_piece_gradients(
    slices, kind, lens, asked, taken
):
    layer = make(kind, "float64", seed=4)
    arrays = inputs(batch=4)
    xs = [tensor(x, "float64", grad=True) for x in arrays]
    lens_t = None if LENS[lens] is None else paddle.to_tensor(LENS[lens])
    weights = RNG.standard_normal((4, *tuple(layer(*xs, lens_t).shape)[1:]))
    with config.settings(autotune=Fixed(attention_chunks=1)):
        _, want_grads = _grads(layer, xs, lens_t, weights)
    assert slices == []
    with config.settings(autotune=Fixed(attention_chunks=asked)):
        out, got_grads = _grads(layer, xs, lens_t, weights)
    assert slices == [taken]
    want = oracle(*arrays, LENS[lens], params_of(layer), heads_of(kind), HIDDEN)
    assert_close(out, want, "float64", OUT_TOL["float64"])
    # against the largest gradient: W_k.bias's is zero up to rounding (see test_adapter)
    scale = max(np.abs(g).max() for g in want_grads)
    for got, expected in zip(got_grads, want_grads):
        assert np.abs(got - expected).max() <= 1e-12 * scale


def test_slices_run_on_the_pool_under_the_callers_gradient_mode_and_settings(monkeypatch):
    layer = make("mha", seed=5)
    seen = []
    attend = layer._attend

    def spy(*args):
        seen.append(
            (
                threading.current_thread().name,
                paddle.is_grad_enabled(),
                config.tuner(),
            )
        )
        return attend(*args)

    monkeypatch.setattr(layer, "_attend", spy)
    xs = [tensor(x) for x in inputs(batch=4)]
    given = Fixed(attention_chunks=4)
    with config.settings(autotune=given):
        with paddle.no_grad():
            out = layer(*xs)
        assert out.stop_gradient
        grad_out = layer(*(tensor(x, grad=True) for x in inputs(batch=4)))
    assert not grad_out.stop_gradient
    names = {name.startswith("multiattn-paddle") for name, _, _ in seen}
    assert names == {SIDE_BY_SIDE}, seen
    assert [grad for _, grad, _ in seen] == [False] * 4 + [True] * 4
    assert all(tuner is given for _, _, tuner in seen), seen


def test_a_large_call_measures_the_slices_once_per_class(slices):
    tuning.reset()
    # 2 * 4 * 256 * (3*128*128 + 2*256*128 + 128*128) flops: above SLICE_MIN_FLOPS
    layer = adapter.MultiHeadAttention(256, 128, 32, 128, 4)
    x = tensor(RNG.standard_normal((4, 256, 128)))
    with paddle.no_grad():
        first = layer(x, x, x)
        second = layer(x, x, x)
    found = [d for d in tuning.decisions() if d["op"] == "paddle-batch-slices"]
    assert len(found) == 1 and found[0]["how"] == "measured", found
    assert set(found[0]["median_ms"]) == {"1", "2", "4"}
    choice = int(found[0]["choice"])
    # the candidates above one piece were timed, then two calls took the choice
    assert set(slices) == {2, 4}
    if choice > 1:
        assert slices[-2:] == [choice, choice]
    assert_close(first, to_np(second), "float32", 1e-6)
    tuning.reset()


def test_without_a_tuner_calls_run_in_one_piece_untimed(slices):
    """autotune off: the document layers and the core's eager calls run in one piece,
    nothing timed or recorded, however large the call."""
    tuning.reset()
    layer = adapter.MultiHeadAttention(256, 128, 32, 128, 4)  # above SLICE_MIN_FLOPS
    x = tensor(RNG.standard_normal((4, 256, 128)))
    q = tensor(RNG.standard_normal((8, 4, 128, 16)))  # 2 MiB of scores
    with config.settings(autotune=False), paddle.no_grad():
        layer(x, x, x)
        ops.scaled_dot_product_attention(q, q, q)
        assert config.tuner() is None
    assert slices == [] and tuning.decisions() == []


def test_a_small_call_runs_in_one_piece_untimed(slices):
    tuning.reset()
    layer = make("mha")
    layer(*(tensor(x) for x in inputs(batch=4)))
    found = [d for d in tuning.decisions() if d["op"] == "paddle-batch-slices"]
    assert [(d["choice"], d["how"]) for d in found] == [("1", "fallback")]
    assert "SLICE_MIN_FLOPS" in found[0]["reason"]
    assert slices == []
    tuning.reset()


@pytest.mark.parametrize("mask", ["none", "causal", "lengths"])
def test_core_attention_slices_give_the_oracle_values_and_gradients(slices, mask):
    b, h, t, d = 4, 2, 6, 3
    arrays = [RNG.standard_normal((b, h, t, d)) for _ in range(3)]
    kw = {"none": {}, "causal": {"causal": True}, "lengths": {"valid_lens": [6, 0, 2, 5]}}[mask]
    xs = [tensor(a, "float64", grad=True) for a in arrays]
    g = RNG.standard_normal((b, h, t, d))

    def run(chunks):
        with config.settings(autotune=Fixed(attention_chunks=chunks), fused_attention=False):
            out = ops.scaled_dot_product_attention(*xs, **kw)
        return out, paddle_grads(paddle.sum(out * tensor(g, "float64")), xs)

    want_out, want_grads = run(1)
    out, grads = run(2)
    assert slices == [2]
    assert_close(out, ref.scaled_dot_product_attention(*arrays, **kw)[0], "float64")
    assert_close(want_out, to_np(out), "float64")
    for got, expected in zip(grads, want_grads):
        assert_close(got, expected, "float64")


@pytest.mark.parametrize("grad", [True, False], ids=["gradients", "no-gradients"])
def test_the_batch_is_split_where_gradients_flow_and_viewed_elsewhere(monkeypatch, grad):
    """Where a gradient can reach an argument the pieces come from ``paddle.split``
    (whose gradient is one ``concat``); elsewhere from indexing (views, no copy)."""
    splits: list[int] = []
    original = paddle.split

    def spy(x, num_or_sections, *args, **kwargs):
        splits.append(num_or_sections)
        return original(x, num_or_sections, *args, **kwargs)

    monkeypatch.setattr(paddle, "split", spy)
    xs = [tensor(RNG.standard_normal((4, 3)), "float32", grad=grad) for _ in range(2)]
    got = _paddle_ops.PaddleNamespace().map_batch(lambda a, b: a * b, xs, 2)
    assert splits == ([2, 2] if grad else [])
    assert_close(got, to_np(xs[0]) * to_np(xs[1]), "float32")


def test_core_attention_measures_the_slices_in_eager_calls():
    tuning.reset()
    # scores of 8 * 4 * 128 * 128 float32 = 2 MiB, above CHUNK_MIN_BYTES
    q, k, v = (tensor(RNG.standard_normal((8, 4, 128, 16))) for _ in range(3))
    with config.settings(fused_attention=False):
        got = ops.scaled_dot_product_attention(q, k, v)
    want = ref.scaled_dot_product_attention(*(to_np(t) for t in (q, k, v)))[0]
    assert_close(got, want, "float32")
    found = [d for d in tuning.decisions() if d["op"] == "attention-chunks"]
    assert len(found) == 1 and found[0]["how"] == "measured", found
    tuning.reset()


def test_a_forked_child_runs_its_slices_on_a_pool_of_its_own():
    if not hasattr(os, "fork") or not SIDE_BY_SIDE:
        pytest.skip("no fork, or one CPU: the slices run in turn")
    layer = make("mha", seed=6)
    xs = [tensor(x) for x in inputs(batch=4)]
    with config.settings(autotune=Fixed(attention_chunks=2)):
        want = to_np(layer(*xs))  # the parent's pool exists now
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: exits with 0 when its call finished and agreed
            code = 1
            try:
                code = 0 if np.allclose(to_np(layer(*xs)), want, rtol=1e-6, atol=1e-6) else 2
            finally:
                os.write(write, bytes([code]))
                os._exit(code)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 120)
        assert ready, "the forked child's sliced call did not finish in 120 s"
        assert os.read(read, 1) == b"\x00"
    finally:
        os.close(read)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_static_graph_takes_the_slices_in_one_program(slices):
    from multiattn.paddle import layers

    layer = layers.MultiHeadAttention(2, 4)
    layer.eval()
    x = tensor(RNG.standard_normal((4, 6, 8)))
    want = to_np(layer(x, x, causal=True))
    with config.settings(autotune=Fixed(attention_chunks=2)):
        static = paddle.jit.to_static(layer)
        got = static(x, x, causal=True)
    assert 2 in slices
    assert_close(got, want, "float32", 1e-6)

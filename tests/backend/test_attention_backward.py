"""The explicit attention path's own backward pass (`multiattn.ops.explicit_grad`, the
weights recomputed or saved: ``settings(autotune=Fixed(attention_backward="recompute"))``
or ``"saved"``)
against the float64 oracle: values and gradients with every kind of mask, grouped heads,
slices of the batch and a cache's layout; where it is taken and where not; the measured
decision in compiled calls."""

import keras
import numpy as np
import pytest
from _support import (
    BACKEND,
    TOL,
    assert_close,
    attention_cases,
    cast,
    compiler,
    gradients,
    grouped_oracle,
    numeric_grad,
    sdpa_call,
    to_np,
)

from multiattn import config, ops, tuning
from multiattn import reference as ref
from multiattn.namespaces.keras import get_ops, keras_namespace
from multiattn.ops import attention as core
from multiattn.ops import explicit_grad
from multiattn.ops.masking import softmax_lse, softmax_where
from multiattn.tuning import Fixed, choices

# the timing of choices is what these tests exercise
pytestmark = pytest.mark.usefixtures("autotuned")

RNG = np.random.default_rng(23)
MAPS = keras_namespace().maps_batch
B, H, TQ, TK, D = 4, 4, 9, 7, 8

CASES = attention_cases(RNG, B, H, TQ, TK, [7, 3, 0, 5])
OWN = ("recompute", "saved")


@pytest.fixture
def own_backward(monkeypatch):
    """Each time the core took the own backward pass during the test: ``"saved"`` where
    the weights were saved, else ``"recompute"``."""
    calls: list[str] = []
    original = explicit_grad.attention

    def spy(*args, **kwargs):
        saves = args[9] if len(args) > 9 else kwargs.get("keeps_weights", False)
        calls.append("saved" if saves else "recompute")
        return original(*args, **kwargs)

    monkeypatch.setattr(explicit_grad, "attention", spy)
    return calls


def _inputs(kv_heads: int = H) -> list[np.ndarray]:
    shapes = ((B, H, TQ, D), (B, kv_heads, TK, D), (B, kv_heads, TK, D))
    return [RNG.standard_normal(s) for s in shapes]


def _oracle(q, k, v, kw):
    return grouped_oracle(q, k, v, kw)[0]


def _settings(backward="recompute", chunks=1):
    given = Fixed(attention_backward=backward, attention_chunks=chunks)
    return config.settings(autotune=given, fused_attention=False)


@pytest.mark.parametrize("backward", OWN)
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["heads", "grouped"])
@pytest.mark.parametrize("case", list(CASES))
def test_values_are_the_oracle_values(own_backward, case, kv_heads, backward):
    q, k, v = _inputs(kv_heads)
    with _settings(backward):
        got = sdpa_call(*(cast(a, "float32") for a in (q, k, v)), CASES[case])
    assert_close(got, _oracle(q, k, v, CASES[case]), "float32", TOL)
    # every call takes the explicit path (fused_attention=False), even where the fused
    # kernel streams (PyTorch's)
    assert own_backward == [backward], f"own backward pass: {own_backward} ({BACKEND})"


@pytest.mark.parametrize("backward", OWN)
@pytest.mark.parametrize("chunks", [1, 2], ids=["one piece", "two slices"])
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["heads", "grouped"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_are_the_oracle_gradients(own_backward, case, kv_heads, chunks, backward):
    q, k, v = _inputs(kv_heads)
    kw = CASES[case]
    g = RNG.standard_normal((B, H, TQ, D))

    def fn(qt, kt, vt):
        with _settings(backward, chunks):
            out = sdpa_call(qt, kt, vt, kw)
        return keras.ops.sum(out * cast(g, "float32"))

    grads = gradients(fn, *(cast(a, "float32") for a in (q, k, v)))

    def oracle(qa, ka, va):
        return float((_oracle(qa, ka, va, kw) * g).sum())

    for name, got, want in zip("qkv", grads, numeric_grad(oracle, q, k, v)):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 1e-5, f"d{name}: relative error {err:.2e} ({BACKEND}, {case})"
    assert set(own_backward) == {backward}, f"own backward pass: {own_backward} ({BACKEND})"


@pytest.mark.parametrize("backward", OWN)
def test_a_cache_layout_gets_its_gradients_in_place(own_backward, backward):
    """Keys and values heads first ``(B, Hkv, Tk, D)`` (a KV cache's layout): the
    gradients come back in that layout."""
    q, k, v = _inputs(2)  # (B, H, T, D): the core wants queries (B, Tq, H, D)
    g = RNG.standard_normal((B, TQ, H, D))
    mask = CASES["mask with empty rows"]["mask"]
    keep = keras.ops.convert_to_tensor(mask)
    ns = get_ops(cast(q, "float32"))

    def fn(qt, kt, vt):
        with _settings(backward):
            out = core.attend(ns, qt, kt, vt, keep=keep, scale=D**-0.5, kv_heads_first=True)
        return keras.ops.sum(out * cast(g, "float32"))

    qt = np.transpose(q, (0, 2, 1, 3))
    grads = gradients(fn, *(cast(a, "float32") for a in (qt, k, v)))

    def oracle(qa, ka, va):
        out = _oracle(np.transpose(qa, (0, 2, 1, 3)), ka, va, {"mask": mask})
        return float((np.transpose(out, (0, 2, 1, 3)) * g).sum())

    for name, got, want in zip("qkv", grads, numeric_grad(oracle, qt, k, v)):
        assert got.shape == want.shape, (name, got.shape, want.shape)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 1e-5, f"d{name}: relative error {err:.2e} ({BACKEND})"
    assert own_backward == [backward]


@pytest.mark.parametrize("backward", OWN)
def test_weights_dropout_and_bias_are_differentiated_automatically(own_backward, backward):
    q, k, v = (cast(a, "float32") for a in _inputs())
    with _settings(backward):
        _, weights = ops.scaled_dot_product_attention(q, k, v, return_weights=True)
        ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=True, seed=1)
        ops.scaled_dot_product_attention(
            q, k, v, bias=cast(RNG.standard_normal((B, 1, TQ, TK)), "float32")
        )
    assert own_backward == []
    want = ref.scaled_dot_product_attention(*(to_np(t) for t in (q, k, v)))[1]
    assert_close(weights, want, "float32", TOL)


def test_off_by_setting_and_in_eager_calls_by_default(own_backward):
    q, k, v = (cast(a, "float32") for a in _inputs())
    tuning.reset()
    with _settings("autodiff"):
        ops.scaled_dot_product_attention(q, k, v)
    with config.settings(fused_attention=False):
        ops.scaled_dot_product_attention(q, k, v)  # eager: not measured, automatic
    assert own_backward == []
    assert not _decisions()


def test_softmax_lse_gives_the_softmax_and_its_log_denominator():
    x = RNG.standard_normal((B, H, TQ, TK)) * 3
    mask = CASES["mask with empty rows"]["mask"]
    ns = get_ops(cast(x, "float32"))
    for keep in (None, mask):
        kt = None if keep is None else keras.ops.convert_to_tensor(keep)
        weights, lse = softmax_lse(ns, cast(x, "float32"), kt)
        same = softmax_where(ns, cast(x, "float32"), kt, zero_empty_rows=False)
        np.testing.assert_array_equal(to_np(weights), to_np(same))
        kept = np.ones(x.shape, bool) if keep is None else np.broadcast_to(keep, x.shape)
        rows = kept.any(axis=-1)
        masked = np.where(kept, x, -np.inf)
        peak = masked.max(axis=-1, keepdims=True)
        with np.errstate(invalid="ignore"):
            want = (peak + np.log(np.exp(masked - peak).sum(axis=-1, keepdims=True)))[..., 0]
        got = to_np(lse)[..., 0]
        np.testing.assert_allclose(got[rows], want[rows], rtol=0, atol=2e-6)


def _decisions() -> list[dict]:
    return [d for d in tuning.decisions() if d["op"] == "attention-backward"]


def test_compiled_calls_measure_the_choice_once_per_class(monkeypatch):
    jit = compiler()
    tuning.reset()
    # the slices taken as two (measured, their count would vary from run to run)
    monkeypatch.setattr(choices, "attention_chunks", lambda *args: 2)
    # scores of 8 * 4 * 128 * 128 float32 = 2 MiB, above CHUNK_MIN_BYTES
    q, k, v = (cast(RNG.standard_normal((8, 4, 128, 16)), "float32") for _ in range(3))
    assert 8 * 4 * 128 * 128 * 4 >= tuning.CHUNK_MIN_BYTES

    def f(q, k, v):
        with config.settings(fused_attention=False):
            return ops.scaled_dot_product_attention(q, k, v)

    got = jit(f)(q, k, v)
    want = ref.scaled_dot_product_attention(*(to_np(t) for t in (q, k, v)))[0]
    assert_close(got, want, "float32", TOL)
    found = _decisions()
    assert len(found) == 1 and found[0]["how"] == "measured", found
    assert set(found[0]["median_ms"]) == {"autodiff", "recompute", "saved"}
    # the class holds the slices the call runs in (the batch of 32: 2 slices asked for)
    assert found[0]["shape_class"]["chunks"] == (2 if MAPS else 1), found[0]["shape_class"]
    jit(f)(q, k, v)  # a second trace: the decision is reused, not timed again
    assert len(_decisions()) == 1
    tuning.reset()


def test_small_score_matrices_are_not_timed():
    jit = compiler()
    tuning.reset()
    q, k, v = (cast(a, "float32") for a in _inputs())

    def f(q, k, v):
        with config.settings(fused_attention=False):
            return ops.scaled_dot_product_attention(q, k, v)

    jit(f)(q, k, v)
    found = _decisions()
    assert [(d["choice"], d["how"]) for d in found] == [("autodiff", "fallback")]
    assert "CHUNK_MIN_BYTES" in found[0]["reason"]
    tuning.reset()


def test_a_cache_layout_is_not_timed():
    """Keys and values heads first (a KV cache) are decoding: differentiated
    automatically, and nothing is timed that only a backward pass would use."""
    jit = compiler()
    tuning.reset()
    q = cast(RNG.standard_normal((8, 128, 4, 16)), "float32")
    k, v = (cast(RNG.standard_normal((8, 4, 128, 16)), "float32") for _ in range(2))
    ns = get_ops(q)

    def f(q, k, v):
        with config.settings(fused_attention=False):
            return core.attend(ns, q, k, v, scale=0.25, kv_heads_first=True)

    got = jit(f)(q, k, v)
    qa, ka, va = (to_np(t) for t in (q, k, v))
    want = _oracle(np.transpose(qa, (0, 2, 1, 3)), ka, va, {})
    assert_close(got, np.transpose(want, (0, 2, 1, 3)), "float32", TOL)
    found = _decisions()
    assert [(d["choice"], d["how"]) for d in found] == [("autodiff", "fallback")]
    assert "KV cache" in found[0]["reason"]
    tuning.reset()


@pytest.mark.skipif(BACKEND != "jax", reason="jax's slices are one compiled loop")
@pytest.mark.parametrize(("backward", "products"), [("recompute", 7), ("saved", 6)])
def test_jax_slices_run_each_forward_pass_once(backward, products):
    """The own backward pass over jax's slices keeps what each slice saved: the
    differentiated program has the forward pass's two products (scores, weighted sum)
    and the backward pass's four (``dP``, ``dV``, ``dQ``, ``dK``), and recomputing the
    weights a fifth (the scores); rematerialised slices would run the forward pass's
    two again."""
    import jax

    q, k, v = (cast(a, "float32") for a in _inputs())
    kw = {"mask": RNG.random((B, 1, TQ, TK)) < 0.7}

    def loss(q, k, v):
        return jax.numpy.sum(sdpa_call(q, k, v, kw))

    with _settings(backward, chunks=2):
        program = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    assert "scan" in program, "the slices are not one compiled loop"
    assert program.count("dot_general") == products, program


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's slices are cut in its graph")
@pytest.mark.parametrize("backward", ["recompute", "saved", "autodiff"])
def test_tensorflow_slices_take_their_gradients_without_batch_sized_buffers(backward):
    """Differentiated, the slices of the batch are cut by a split, whose gradient joins
    the slices' gradients: no slice's gradient is a zero-filled batch
    (``StridedSliceGrad``, ``Slice`` gradients padded to the batch)."""
    import tensorflow as tf

    q, k, v = (tf.constant(a, tf.float32) for a in _inputs())
    kw = {"mask": RNG.random((B, 1, TQ, TK)) < 0.7}

    @tf.function
    def grads(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = sdpa_call(q, k, v, kw)
        return tape.gradient(out, [q, k, v])

    with _settings(backward, chunks=2):
        graph = grads.get_concrete_function(q, k, v).graph
    kinds = {op.type for op in graph.get_operations()}
    assert "Split" in kinds, sorted(kinds)
    assert not kinds & {"StridedSliceGrad", "Pad", "PadV2"}, sorted(kinds)

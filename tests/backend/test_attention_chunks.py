"""The explicit attention path over slices of the batch
(``settings(autotune=Fixed(attention_chunks=n))``) against the float64 oracle: values with
every kind of mask and bias, grouped heads, gradients, compiled calls, the slices
actually taken, measured (``autotune=True``) and by default (`plan.default_chunks`)."""

import functools

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
from multiattn.namespaces.keras import keras_namespace
from multiattn.ops import plan
from multiattn.tuning import Fixed, choices

# the timing of choices is what these tests exercise
pytestmark = pytest.mark.usefixtures("autotuned")

RNG = np.random.default_rng(11)
# jax's and tensorflow's namespaces map batches; the others run in one piece whatever
# the setting
MAPS = keras_namespace().maps_batch
B, H, TQ, TK, D = 4, 4, 9, 7, 8  # TQ: the screen runs before the path (`_screens_scores`)


@pytest.fixture
def slices(monkeypatch):
    """The slice counts `map_batch` was called with during the test."""
    seen: list[int] = []
    cls = type(keras_namespace())
    original = cls.map_batch

    def spy(self, fn, args, chunks, **kw):
        seen.append(chunks)
        return original(self, fn, args, chunks, **kw)

    monkeypatch.setattr(cls, "map_batch", spy)
    return seen


def test_jax_and_tensorflow_map_batches():
    assert MAPS == (BACKEND in ("jax", "tensorflow"))


def _inputs(kv_heads: int = H) -> list[np.ndarray]:
    shapes = ((B, H, TQ, D), (B, kv_heads, TK, D), (B, kv_heads, TK, D))
    return [RNG.standard_normal(s) for s in shapes]


CASES = attention_cases(RNG, B, H, TQ, TK, [7, 3, 0, 5])
# drawn after the masks, as before the cases were shared
CASES["bias per row"] = {"bias": RNG.standard_normal((B, 1, TQ, TK))}
CASES["bias broadcast"] = {"bias": RNG.standard_normal((H, TQ, TK))}
_oracle = grouped_oracle


@pytest.mark.parametrize("kv_heads", [H, 2], ids=["heads", "grouped"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("asked", "taken"), [(2, 2), (4, 4), (3, 2)])
def test_slices_give_the_oracle_values(slices, case, kv_heads, asked, taken):
    q, k, v = _inputs(kv_heads)
    kw = CASES[case]
    with config.settings(autotune=Fixed(attention_chunks=asked), fused_attention=False):
        got = sdpa_call(*(cast(a, "float32") for a in (q, k, v)), kw)
    want = _oracle(q, k, v, kw)[0]
    assert_close(got, want, "float32", TOL)
    assert slices == ([taken] if MAPS else []), f"map_batch calls {slices}, {BACKEND}"


def test_one_slice_and_the_weights_run_in_one_piece(slices):
    q, k, v = (cast(a, "float32") for a in _inputs())
    with config.settings(autotune=Fixed(attention_chunks=1), fused_attention=False):
        ops.scaled_dot_product_attention(
            q, k, v, bias=cast(CASES["bias per row"]["bias"], "float32")
        )
    with config.settings(autotune=Fixed(attention_chunks=4), fused_attention=False):
        _, weights = ops.scaled_dot_product_attention(q, k, v, return_weights=True)
    assert slices == []
    want = ref.scaled_dot_product_attention(*(to_np(t) for t in (q, k, v)))[1]
    assert_close(weights, want, "float32", TOL)


@pytest.mark.parametrize("case", ["mask per row", "mask with empty rows", "bias per row"])
def test_slices_give_the_oracle_gradients(slices, case):
    q, k, v = _inputs(2)
    kw = CASES[case]
    g = RNG.standard_normal((B, H, TQ, D))

    def fn(qt, kt, vt):
        with config.settings(autotune=Fixed(attention_chunks=2), fused_attention=False):
            out = sdpa_call(qt, kt, vt, kw)
        return keras.ops.sum(out * cast(g, "float32"))

    grads = gradients(fn, *(cast(a, "float32") for a in (q, k, v)))

    def oracle(qa, ka, va):
        return float((_oracle(qa, ka, va, kw)[0] * g).sum())

    for name, got, want in zip("qkv", grads, numeric_grad(oracle, q, k, v)):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 1e-5, f"d{name}: relative error {err:.2e} ({BACKEND})"
    assert set(slices) == ({2} if MAPS else set())


def test_compiled_calls_take_the_slices_asked_for(slices):
    q, k, v = (cast(a, "float32") for a in _inputs())
    mask = CASES["mask per row"]["mask"]

    def f(q, k, v):
        with config.settings(autotune=Fixed(attention_chunks=4), fused_attention=False):
            return ops.scaled_dot_product_attention(q, k, v, mask=mask)

    got = compiler()(f)(q, k, v)
    want = ref.scaled_dot_product_attention(*(to_np(t) for t in (q, k, v)), mask=mask)[0]
    assert_close(got, want, "float32", TOL)
    assert slices == ([4] if MAPS else [])


def test_compiled_calls_measure_the_slices_once_per_class(slices, monkeypatch):
    jit = compiler()
    if not MAPS:
        pytest.skip(f"{BACKEND} runs attention in one piece: nothing to measure")
    tuning.reset()
    # scores of 8 * 4 * 128 * 128 float32 = 2 MiB, above CHUNK_MIN_BYTES
    q, k, v = (cast(RNG.standard_normal((8, 4, 128, 16)), "float32") for _ in range(3))
    assert 8 * 4 * 128 * 128 * 4 >= tuning.CHUNK_MIN_BYTES

    # the own backward pass set aside: its decision would slice the batch too
    monkeypatch.setattr(choices, "attention_backward", lambda *args: "autodiff")

    def f(q, k, v):
        with config.settings(fused_attention=False):
            return ops.scaled_dot_product_attention(q, k, v)

    got = jit(f)(q, k, v)
    want = ref.scaled_dot_product_attention(*(to_np(t) for t in (q, k, v)))[0]
    assert_close(got, want, "float32", TOL)
    found = [d for d in tuning.decisions() if d["op"] == "attention-chunks"]
    assert len(found) == 1 and found[0]["how"] == "measured", found
    # the leading axes (8, 4) are the batch of 32: powers of two up to 16
    assert set(found[0]["median_ms"]) == {"1", "2", "4", "8", "16"}
    choice = int(found[0]["choice"])
    # the candidates above one slice are traced first, then the call takes the choice
    assert slices == [2, 4, 8, 16] + ([choice] if choice > 1 else [])
    jit(f)(q, k, v)  # a second trace: the decision is reused, not timed again
    assert len([d for d in tuning.decisions() if d["op"] == "attention-chunks"]) == 1
    tuning.reset()


def test_small_score_matrices_are_not_timed():
    jit = compiler()
    if not MAPS:
        pytest.skip(f"{BACKEND} runs attention in one piece: nothing to measure")
    tuning.reset()
    q, k, v = (cast(a, "float32") for a in _inputs())

    def f(q, k, v):
        with config.settings(fused_attention=False):
            return ops.scaled_dot_product_attention(q, k, v)

    jit(f)(q, k, v)
    found = [d for d in tuning.decisions() if d["op"] == "attention-chunks"]
    assert [(d["choice"], d["how"]) for d in found] == [("1", "fallback")]
    assert "CHUNK_MIN_BYTES" in found[0]["reason"]
    tuning.reset()


def test_without_a_tuner_compiled_calls_take_the_default_slices(slices):
    """autotune off: nothing is timed or recorded; XLA:CPU's compiled calls on glibc cut
    a score matrix above the allocator's mapping threshold (32 MiB) into slices of at
    most 16 MiB (`multiattn.ops.plan.default_chunks`)."""
    jit = compiler()
    tuning.reset()
    # scores of 8 * 4 * 512 * 512 float32: 32 MiB, at the threshold; twice the batch: 64
    small, large = ((cast(RNG.standard_normal((b, 4, 512, 8)), "float32"),) * 3 for b in (8, 16))

    def f(q, k, v):
        with config.settings(autotune=False, fused_attention=False):
            return ops.scaled_dot_product_attention(q, k, v)

    if BACKEND == "jax":
        import jax

        xla_cpu = jax.default_backend() == "cpu"
    else:  # compiled by XLA only where asked
        import tensorflow as tf

        xla_cpu = not tf.config.list_logical_devices("GPU")
        jit = functools.partial(tf.function, jit_compile=True)
    jit(f)(*small)
    assert slices == []  # one piece at the threshold
    got = jit(f)(*large)
    assert slices == ([4] if xla_cpu and plan.glibc() else []), slices
    want = ref.scaled_dot_product_attention(*(to_np(t) for t in large))[0]
    assert_close(got, want, "float32", TOL)
    assert tuning.decisions() == []


@pytest.mark.skipif(BACKEND != "tensorflow", reason="XLA compiles TensorFlow only where asked")
def test_one_row_under_xla_projects_through_the_joined_kernels():
    """A batch-1 decoding step compiled by XLA for a CPU takes the joined query, key and
    value product (`plan.joins_projections`), and gives the separate products' output."""
    import tensorflow as tf

    from multiattn.layers import MultiHeadAttention, _base

    layer = MultiHeadAttention(num_heads=4, key_dim=8, num_key_value_heads=2)
    x = cast(RNG.standard_normal((1, 1, 32)), "float32")
    want = to_np(layer(x, x))  # eager: separate products
    joined = []
    real = _base.joined_linear

    def spy(*args):
        joined.append(True)
        return real(*args)

    import multiattn.layers.multi_head as mha

    original, mha.joined_linear = mha.joined_linear, spy
    try:
        got = tf.function(lambda t: layer(t, t), jit_compile=True)(x)
    finally:
        mha.joined_linear = original
    on_cpu = not tf.config.list_logical_devices("GPU")
    assert joined == ([True] if on_cpu else [])
    assert_close(got, want, "float32", TOL)

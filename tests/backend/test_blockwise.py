"""The blockwise (online-softmax) attention path against the float64 oracle and the
direct path; its automatic selection by the memory budget; `multiattn.config`."""

import keras
import numpy as np
import pytest
from _support import (
    BACKEND,
    DTYPES,
    TOL,
    assert_close,
    cast,
    gradients,
    numeric_grad,
    requires_grad,
    rounded,
    to_np,
)

from multiattn import config, layers, ops
from multiattn import reference as ref
from multiattn.namespaces.keras import get_ops
from multiattn.ops import attention, blockwise, blockwise_grad

RNG = np.random.default_rng(23)


def data(*shapes, scale=1.0):
    return [RNG.standard_normal(s) * scale for s in shapes]


CASES = {
    # name: (lead, tq, tk, dv, kwargs builder)
    "self": ((2,), 7, 7, 4, lambda: {}),
    "cross": ((2,), 5, 9, 4, lambda: {}),
    "causal_self": ((2,), 8, 8, 4, lambda: {"causal": True}),
    "causal_fewer_queries": ((2,), 4, 9, 4, lambda: {"causal": True}),
    "causal_more_queries": ((2,), 9, 4, 4, lambda: {"causal": True}),
    "lens_1d": ((2,), 5, 7, 4, lambda: {"valid_lens": np.array([3, 0])}),
    "lens_2d_zeros": (
        (2,),
        5,
        7,
        4,
        lambda: {"valid_lens": np.array([[0, 1, 7, 2, 0], [7, 7, 0, 3, 4]])},
    ),
    "mask": ((2,), 5, 7, 4, lambda: {"mask": _mask((2, 5, 7), empty_rows=((0, 1), (1, 4)))}),
    "mask_broadcast_keys": ((2,), 5, 7, 4, lambda: {"mask": _mask((2, 1, 7))}),
    "everything": (
        (2,),
        6,
        8,
        3,
        lambda: {
            "mask": _mask((2, 6, 8)),
            "valid_lens": np.array([[8, 5, 0, 8, 2, 8], [1, 8, 8, 3, 8, 0]]),
            "causal": True,
            "scale": 0.6,
        },
    ),
    "heads_4d": ((2, 3), 6, 6, 4, lambda: {"valid_lens": np.array([2, 5]), "causal": True}),
    "heads_4d_lens_2d": (
        (2, 3),
        4,
        6,
        4,
        lambda: {"valid_lens": np.array([[6, 0, 3, 1], [2, 6, 6, 0]])},
    ),
    "unbatched": ((), 5, 7, 4, lambda: {"valid_lens": np.array([0, 1, 7, 2, 0])}),
}


def _jit(fn):
    """``fn`` compiled under ``jax.jit`` on JAX (op-by-op JAX compiles every small op for
    every new shape: far slower here), as it is on the other backends."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    return fn


def _grads(fn, *args):
    """`gradients`, with the whole gradient computation compiled at once on JAX."""
    if BACKEND == "jax":
        import jax

        grad = jax.jit(jax.grad(fn, argnums=tuple(range(len(args)))))
        return [to_np(g) for g in grad(*args)]
    return gradients(fn, *args)


def _mask(shape, empty_rows=()):
    mask = RNG.random(shape) > 0.4
    for b, row in empty_rows:
        mask[b, row] = False
    return mask


def _inputs(case, dtype):
    lead, tq, tk, dv = CASES[case][:4]
    q, k, v = data((*lead, tq, 4), (*lead, tk, 4), (*lead, tk, dv))
    return (q, k, v), CASES[case][4](), dtype


# Every case in float32; the other dtypes (float64, and half precision, computed in
# float32 by the same code) on the cases that combine the most.
DTYPE_CASES = ("everything", "causal_more_queries", "heads_4d_lens_2d", "lens_2d_zeros")
CASE_DTYPES = [
    (case, dtype) for dtype in DTYPES for case in CASES if dtype == "float32" or case in DTYPE_CASES
]


@pytest.mark.parametrize("case,dtype", CASE_DTYPES)
def test_blockwise_matches_oracle_and_direct_path(case, dtype):
    (q, k, v), kwargs, _ = _inputs(case, dtype)
    qr, kr, vr = (rounded(a, dtype) for a in (q, k, v))
    want, want_w = ref.scaled_dot_product_attention(qr, kr, vr, **kwargs)
    args = [cast(a, dtype) for a in (q, k, v)]

    def both(*a):
        return (
            ops.scaled_dot_product_attention(*a, block_size=(4, 3), **kwargs),
            ops.scaled_dot_product_attention(*a, **kwargs),
        )

    got, direct = _jit(both)(*args)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    assert_close(got, want, dtype)
    assert_close(got, to_np(direct), dtype)
    zero_rows = ~np.any(want_w > 0, axis=-1)
    assert np.all(to_np(got)[zero_rows] == 0.0)


@pytest.mark.parametrize(
    "block_size", [1, 2, (1, 5), (5, 1), (3, 4), 7, 100], ids=lambda b: str(b).replace(" ", "")
)
def test_every_block_shape_gives_the_same_result(block_size):
    q, k, v = data((2, 7, 4), (2, 10, 4), (2, 10, 3))
    kwargs = {"causal": True, "valid_lens": np.array([[10, 2, 0, 10, 6, 10, 1], [0] * 7])}
    want = ref.scaled_dot_product_attention(q, k, v, **kwargs)[0]
    args = [cast(a, "float32") for a in (q, k, v)]
    got = _jit(lambda *a: ops.scaled_dot_product_attention(*a, block_size=block_size, **kwargs))(
        *args
    )
    assert_close(got, want, "float32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_of_large_magnitude_stay_exact(dtype):
    """The running max keeps exp() in range when the scores span hundreds (exp(89)
    overflows float32)."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) for s in ((2, 6, 4), (2, 9, 4), (2, 9, 4)))
    q = q * 40.0
    q[0, 0] = -q[0, 0]  # a row whose largest score comes in a late block
    mask = rng.random((2, 6, 9)) > 0.4
    mask[1, 2] = False
    qr, kr, vr = (rounded(a, dtype) for a in (q, k, v))
    want = ref.scaled_dot_product_attention(qr, kr, vr, mask=mask)[0]

    def both(*a):
        return (
            ops.scaled_dot_product_attention(*a, mask=mask, block_size=2),
            ops.scaled_dot_product_attention(*a, mask=mask),
        )

    got, direct = _jit(both)(*(cast(a, dtype) for a in (q, k, v)))
    # Scores of ~100 carry ~100x the rounding error of scores of ~1, on every path.
    tol = {name: 10 * bound for name, bound in TOL.items()}
    assert_close(got, want, dtype, tol)
    assert_close(direct, want, dtype, tol)
    assert np.all(to_np(got)[1, 2] == 0.0)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in ("float64", "float32")])
def test_everything_masked_gives_zeros(dtype):
    q, k, v = (cast(a, dtype) for a in data((2, 5, 4), (2, 6, 4), (2, 6, 4)))

    def outs(q, k, v):
        return [
            ops.scaled_dot_product_attention(q, k, v, block_size=2, **kwargs)
            for kwargs in (
                {"mask": np.zeros((2, 5, 6), bool)},
                {"valid_lens": np.array([0, 0])},
                {"valid_lens": np.zeros((2, 5), np.int32), "causal": True},
            )
        ]

    for out in _jit(outs)(q, k, v):
        assert np.all(to_np(out) == 0.0)


GRAD_SEED = 17


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_oracle_and_direct_path(dtype, seed=GRAD_SEED):
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal(s) for s in ((2, 5, 4), (2, 7, 4), (2, 7, 3), (2, 5, 3)))
    q = q * 3.0  # scores of a wider range: the running max moves between blocks
    lens = np.array([[0, 2, 7, 5, 7], [7, 0, 1, 7, 3]])
    mask = rng.random((2, 5, 7)) > 0.4
    mask[:, :, 0] = True
    kwargs = {"valid_lens": lens, "mask": mask, "causal": True}
    acc = "float64" if dtype == "float64" else "float32"

    def make(block_size):
        def fn(qt, kt, vt):
            out = ops.scaled_dot_product_attention(qt, kt, vt, block_size=block_size, **kwargs)
            return keras.ops.sum(keras.ops.cast(out, acc) * cast(g, acc))

        return fn

    args = [cast(a, dtype) for a in (q, k, v)]
    grads, direct = _grads(make((2, 3)), *args), _grads(make(None), *args)

    def oracle(qa, ka, va):
        return float((ref.scaled_dot_product_attention(qa, ka, va, **kwargs)[0] * g).sum())

    wants = numeric_grad(oracle, *(rounded(a, dtype) for a in (q, k, v)))
    bound = {"float64": 1e-7, "float32": 1e-5, "float16": 1e-2, "bfloat16": 6e-2}[dtype]
    for name, got, want, other in zip("qkv", grads, wants, direct):
        assert np.all(np.isfinite(got)), f"d{name} has NaN/Inf"
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= bound, f"d{name}: relative error {err:.2e} > {bound:.0e}"
        err = np.abs(got - other).max() / np.abs(other).max()
        assert err <= bound, f"d{name} vs direct path: relative error {err:.2e} > {bound:.0e}"
    # rows 0 of batch 0 and 1 of batch 1 attend nothing: no gradient reaches them
    assert np.all(grads[0][0, 0] == 0.0) and np.all(grads[0][1, 1] == 0.0)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_of_every_case_match_the_oracle(case):
    """The blockwise path's own backward pass (`multiattn.ops.blockwise_grad`) against
    central differences of the float64 oracle, for every mask kind; blocks of 2 queries
    and 3 keys (so causal blocks are skipped, masked and looped) on even cases, 3 and 2
    on odd ones."""
    requires_grad()
    (q, k, v), kwargs, _ = _inputs(case, "float64")
    q = q * 3.0  # a wider range of scores: the running maximum moves between blocks
    g = RNG.standard_normal((*q.shape[:-1], v.shape[-1]))
    blocks = (2, 3) if list(CASES).index(case) % 2 == 0 else (3, 2)

    def fn(qt, kt, vt):
        out = ops.scaled_dot_product_attention(qt, kt, vt, block_size=blocks, **kwargs)
        return keras.ops.sum(out * cast(g, "float64"))

    got = _grads(fn, *(cast(a, "float64") for a in (q, k, v)))

    def oracle(qa, ka, va):
        return float((ref.scaled_dot_product_attention(qa, ka, va, **kwargs)[0] * g).sum())

    for name, grad, want in zip("qkv", got, numeric_grad(oracle, q, k, v)):
        err = np.abs(grad - want).max() / np.abs(want).max()
        assert err <= 1e-7, f"d{name}: relative error {err:.2e} > 1e-7"


def test_gradients_compile_under_the_backend_jit():
    """The backward pass under ``tf.function`` (TensorFlow) and ``jax.jit`` (JAX), with
    the query blocks looped over key blocks and key blocks over query blocks."""
    requires_grad()
    q, k, v, g = data((2, 12, 4), (2, 10, 4), (2, 10, 3), (2, 12, 3))
    lens = np.array([[10, 0, 3, 10, 5, 10, 10, 2, 7, 1, 10, 4], [4] * 12])
    kwargs = {"valid_lens": lens, "causal": True}

    def fn(qt, kt, vt):
        out = ops.scaled_dot_product_attention(qt, kt, vt, block_size=(2, 2), **kwargs)
        return keras.ops.sum(out * cast(g, "float32"))

    args = [cast(a, "float32") for a in (q, k, v)]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function
        def compiled(*a):
            with tf.GradientTape() as tape:
                tape.watch(a)
                value = fn(*a)
            return tape.gradient(value, a)

        got = [to_np(t) for t in compiled(*args)]
    else:
        got = _grads(fn, *args)

    def oracle(qa, ka, va):
        return float((ref.scaled_dot_product_attention(qa, ka, va, **kwargs)[0] * g).sum())

    for grad, want in zip(got, numeric_grad(oracle, *(rounded(a, "float32") for a in (q, k, v)))):
        assert np.abs(grad - want).max() / np.abs(want).max() <= 1e-5


def test_custom_gradient_replaces_the_backward_pass():
    """The namespace's ``custom_gradient``: the gradient is what ``backward`` says (not
    the derivative of ``forward``), a closed-over tensor gets none, ``forward`` runs
    once per call (eagerly); on numpy (no gradients) ``forward`` alone."""
    ns = get_ops(cast(np.ones(1), "float32"))
    closed = cast(np.array([2.0, 2.0, 2.0]), "float32")
    runs = []

    def forward(a):
        runs.append(1)
        return a * a * closed, (a,)

    def backward(saved, grad):
        (a,) = saved
        return (grad * 10.0 * a,)

    def fn(x):
        return keras.ops.sum(
            ns.custom_gradient(forward, backward, (x,)) * cast([1, 2, 3.0], "float32")
        )

    x = np.array([1.0, -2.0, 3.0])
    assert float(to_np(fn(cast(x, "float32")))) == 2.0 + 16.0 + 54.0
    requires_grad()
    (got,) = gradients(fn, cast(x, "float32"))
    np.testing.assert_array_equal(got, [10.0, -40.0, 90.0])
    assert len(runs) == 2


def test_second_derivatives_match_the_direct_path_or_raise():
    """The gradient of a gradient through the blockwise path: JAX (``custom_vjp``
    differentiates the forward and backward rules) and TensorFlow (nested tapes) match
    the direct path; PyTorch refuses (its backward takes the saved output as a
    constant)."""
    requires_grad()
    q, k, v = data((1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 3))
    kt, vt = cast(k, "float64"), cast(v, "float64")

    def inner(block_size):
        def fn(qt):
            out = ops.scaled_dot_product_attention(qt, kt, vt, causal=True, block_size=block_size)
            return keras.ops.sum(out * out)

        return fn

    if BACKEND == "torch":
        import torch

        leaf = cast(q, "float64").requires_grad_(True)
        (grad,) = torch.autograd.grad(inner((2, 3))(leaf), leaf, create_graph=True)
        with pytest.raises(RuntimeError):
            torch.autograd.grad(keras.ops.sum(grad * grad), leaf)
        return
    if BACKEND == "jax":
        import jax

        def second(block_size):
            first = jax.grad(inner(block_size))
            return to_np(jax.grad(lambda a: keras.ops.sum(first(a) ** 2))(cast(q, "float64")))
    else:
        import tensorflow as tf

        def second(block_size):
            leaf = cast(q, "float64")
            with tf.GradientTape() as outer:
                outer.watch(leaf)
                with tf.GradientTape() as tape:
                    tape.watch(leaf)
                    value = inner(block_size)(leaf)
                total = tf.reduce_sum(tape.gradient(value, leaf) ** 2)
            return to_np(outer.gradient(total, leaf))

    got, want = second((2, 3)), second(None)
    assert np.abs(got - want).max() <= 1e-10 * np.abs(want).max()


def test_gradients_finite_when_everything_is_masked():
    q, k, v = data((1, 4, 4), (1, 5, 4), (1, 5, 4))

    def fn(qt, kt, vt):
        out = ops.scaled_dot_product_attention(
            qt, kt, vt, mask=np.zeros((1, 4, 5), bool), block_size=2
        )
        return keras.ops.sum(out)

    for grad in _grads(fn, *(cast(a, "float32") for a in (q, k, v))):
        assert np.all(grad == 0.0)


# --- automatic selection by the memory budget ---------------------------------------------


class _Spy:
    """Records the blockwise calls; with ``forbid_direct``, fails on the direct path."""

    def __init__(self, monkeypatch, forbid_direct=True):
        self.blockwise = []
        real = blockwise.blockwise_attention

        def spy(*args, **kwargs):
            self.blockwise.append(kwargs["blocks"])
            return real(*args, **kwargs)

        def no_direct(*args, **kwargs):
            raise AssertionError("the direct path (full score matrix) was taken")

        monkeypatch.setattr(blockwise, "blockwise_attention", spy)
        if forbid_direct:
            monkeypatch.setattr(attention, "_direct_attention", no_direct)


def _counting(monkeypatch):
    calls = []
    real = attention._direct_attention

    def direct(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "_direct_attention", direct)
    return calls


def _streams(x) -> bool:
    return bool(getattr(get_ops(x), "fused_attention_streams", False))


@pytest.mark.parametrize("kind", ["plain", "masks"])
def test_a_small_budget_selects_the_blockwise_path(monkeypatch, kind):
    q, k, v = (cast(a, "float32") for a in data((2, 3, 40, 8), (2, 3, 48, 8), (2, 3, 48, 8)))
    if kind == "plain" and _streams(q):
        pytest.skip("the backend's fused kernel streams: no mask never needs blocks")
    kwargs = {}
    if kind == "masks":
        kwargs = {"valid_lens": np.array([[0] * 20 + [48] * 20, [7] * 40]), "causal": True}
    scores_bytes = 2 * 3 * 40 * 48 * 4
    calls = _counting(monkeypatch)
    spy = _Spy(monkeypatch, forbid_direct=False)
    with config.attention_memory_budget(scores_bytes):  # fits: the direct path
        direct = to_np(ops.scaled_dot_product_attention(q, k, v, **kwargs))
    assert len(calls) == 1 and not spy.blockwise
    spy = _Spy(monkeypatch)
    with config.attention_memory_budget(scores_bytes - 1):
        got = to_np(ops.scaled_dot_product_attention(q, k, v, **kwargs))
    assert len(spy.blockwise) == 1
    assert_close(got, direct, "float32")
    want = ref.scaled_dot_product_attention(*(to_np(a) for a in (q, k, v)), **kwargs)[0]
    assert_close(got, want, "float32")


@pytest.mark.parametrize(
    "kind, streams",
    [
        ("plain", True),
        ("causal_square", True),
        ("lens_1d", True),
        ("causal_more_keys", False),
        ("lens_2d", False),
        ("lens_and_causal", False),
        ("mask", False),
    ],
)
def test_a_streaming_fused_kernel_is_preferred_to_blocks(monkeypatch, kind, streams):
    """Over the budget, a backend whose fused kernel never forms the score matrix (torch's
    flash kernel) runs it whenever the mask it needs is linear in the lengths; anything
    else still goes blockwise. Either way the numbers are the oracle's."""
    tk = 48 if kind == "causal_more_keys" else 40
    q, k, v = (cast(a, "float32") for a in data((2, 3, 40, 8), (2, 3, tk, 8), (2, 3, tk, 8)))
    kwargs = {
        "plain": {},
        "causal_square": {"causal": True},
        "lens_1d": {"valid_lens": np.array([0, 17])},
        "causal_more_keys": {"causal": True},
        "lens_2d": {"valid_lens": np.array([[3] * 40, [40] * 20 + [0] * 20])},
        "lens_and_causal": {"valid_lens": np.array([5, 40]), "causal": True},
        "mask": {"mask": RNG.random((2, 1, 40, 40)) < 0.5},
    }[kind]
    calls = _counting(monkeypatch)
    spy = _Spy(monkeypatch, forbid_direct=False)
    with config.attention_memory_budget(1):
        got = to_np(ops.scaled_dot_product_attention(q, k, v, **kwargs))
    if _streams(q) and streams:
        assert len(calls) == 1 and not spy.blockwise
    else:
        assert len(spy.blockwise) == 1 and not calls
    want = ref.scaled_dot_product_attention(*(to_np(a) for a in (q, k, v)), **kwargs)[0]
    assert_close(got, want, "float32")


def test_float64_scores_count_eight_bytes(monkeypatch):
    if "float64" not in DTYPES:
        pytest.skip("no float64 on this backend")
    q = cast(RNG.standard_normal((1, 10, 4)), "float64")
    calls = _counting(monkeypatch)
    spy = _Spy(monkeypatch, forbid_direct=False)
    with config.attention_memory_budget(10 * 10 * 8):
        ops.scaled_dot_product_attention(q, q, q)
    with config.attention_memory_budget(10 * 10 * 8 - 1):
        ops.scaled_dot_product_attention(q, q, q)
    assert len(calls) == 1 and len(spy.blockwise) == 1


def test_weights_and_dropout_keep_the_direct_path(monkeypatch):
    q, k, v = (cast(a, "float32") for a in data((2, 6, 4), (2, 6, 4), (2, 6, 4)))
    calls = _counting(monkeypatch)
    with config.attention_memory_budget(1):
        out, w = ops.scaled_dot_product_attention(q, k, v, block_size=2, return_weights=True)
        assert tuple(w.shape) == (2, 6, 6)
        ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=True, seed=1)
    assert len(calls) == 2
    want = ref.scaled_dot_product_attention(*(to_np(a) for a in (q, k, v)))[0]
    assert_close(out, want, "float32")


def test_the_layer_takes_the_blockwise_path_under_a_small_budget(monkeypatch):
    layer = layers.MultiHeadAttention(2, 4, dtype="float32")
    x = cast(RNG.standard_normal((2, 9, 6)), "float32")
    lens = np.array([9, 4])
    want = to_np(layer(x, x, valid_lens=lens, causal=True))
    spy = _Spy(monkeypatch)
    with config.attention_memory_budget(64):
        got = layer(x, x, valid_lens=lens, causal=True)
    assert spy.blockwise
    assert_close(got, want, "float32")


class _Recorder:
    """A namespace that records the size of every tensor its operations return."""

    def __init__(self, inner):
        self._inner = inner
        self.largest = 0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            out = attr(*args, **kwargs)
            for t in out if isinstance(out, (tuple, list)) else (out,):
                shape = getattr(t, "shape", None)
                if shape is not None and name != "shape":
                    self.largest = max(self.largest, int(np.prod(tuple(shape))))
            return out

        return call


@pytest.mark.parametrize("masks", ["none", "lens_2d_causal", "lens_1d"])
def test_no_tensor_of_the_full_score_size_is_formed(masks):
    b, h, tq, tk, d = 1, 2, 64, 48, 4
    q, k, v = (cast(a, "float32") for a in data((b, tq, h, d), (b, tk, h, d), (b, tk, h, d)))
    lens, causal = None, False
    if masks == "lens_2d_causal":
        lens, causal = cast(RNG.integers(0, tk + 1, (b, tq)), "int32"), True
    if masks == "lens_1d":
        lens = cast(np.array([30]), "int32")
    rec = _Recorder(get_ops(q))
    out = attention.attend(
        rec, q, k, v, valid_lens=lens, causal=causal, scale=0.5, block_size=(16, 16)
    )
    assert tuple(out.shape) == (b, tq, h, d)
    assert rec.largest <= max(b * h * 16 * 16, b * tq * h * d) < b * h * tq * tk // 4


@pytest.mark.parametrize("masks", ["none", "lens_2d_causal", "mask_lens_1d"])
def test_the_backward_pass_forms_no_tensor_of_the_full_score_size(masks):
    """Gradients through the blockwise path recompute each block's weights: no tensor
    the size of the score matrix is formed in the backward pass either."""
    requires_grad()
    b, h, tq, tk, d = 1, 2, 64, 48, 4
    g = cast(RNG.standard_normal((b, tq, h, d)), "float32")
    lens, keep, causal = None, None, False
    if masks == "lens_2d_causal":
        lens, causal = cast(RNG.integers(0, tk + 1, (b, tq)), "int32"), True
    if masks == "mask_lens_1d":
        lens = cast(np.array([30]), "int32")
        keep = keras.ops.convert_to_tensor(RNG.random((b, 1, 1, tk)) > 0.3)
    rec = _Recorder(get_ops(g))

    def fn(q, k, v):
        out = attention.attend(
            rec,
            q,
            k,
            v,
            keep=keep,
            valid_lens=lens,
            causal=causal,
            scale=0.5,
            block_size=(16, 16),
        )
        return keras.ops.sum(out * g)

    grads = gradients(
        fn, *(cast(a, "float32") for a in data((b, tq, h, d), (b, tk, h, d), (b, tk, h, d)))
    )
    assert [g.shape for g in grads] == [(b, tq, h, d), (b, tk, h, d), (b, tk, h, d)]
    assert rec.largest <= max(b * h * 16 * 16, b * tq * h * d) < b * h * tq * tk // 4


@pytest.mark.parametrize("causal", [False, True], ids=["lens", "lens_causal"])
def test_what_torch_keeps_for_the_backward_pass_is_linear_in_the_lengths(causal):
    """Every tensor autograd saves for the backward pass, counted through torch's
    saved-tensor hooks: the inputs, the output and one number per query row, never the
    blocks' scores (together the size of the score matrix, 16 times the inputs here)."""
    if BACKEND != "torch":
        pytest.skip("saved-tensor hooks are PyTorch's")
    import torch

    b, h, tq, tk, d = 1, 2, 256, 256, 8
    q, k, v = (
        cast(a, "float32").requires_grad_(True)
        for a in data((b, tq, h, d), (b, tk, h, d), (b, tk, h, d))
    )
    lens = cast(np.array([200]), "int32")
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention.attend(
            get_ops(q), q, k, v, valid_lens=lens, causal=causal, scale=0.3, block_size=(32, 32)
        )
    out.sum().backward()
    inputs = 4 * b * tq * h * d  # q, k, v and the output
    assert sum(saved) <= inputs + b * h * tq + b  # + lse and the lengths
    assert all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


def test_compiles_under_the_backend_jit():
    q, k, v = (cast(a, "float32") for a in data((2, 8, 4), (2, 11, 4), (2, 11, 4)))
    lens = cast(np.array([[11, 0, 3, 11, 5, 11, 11, 2], [4] * 8]), "int32")

    def f(q, k, v, lens):
        return ops.scaled_dot_product_attention(
            q, k, v, valid_lens=lens, causal=True, block_size=(3, 4)
        )

    if BACKEND == "jax":
        import jax

        compiled = jax.jit(f)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(f)
    else:
        pytest.skip(f"{BACKEND} has no graph compiler in this suite")
    want = ref.scaled_dot_product_attention(
        *(to_np(a) for a in (q, k, v)), valid_lens=to_np(lens), causal=True
    )[0]
    assert_close(compiled(q, k, v, lens), want, "float32", TOL)


# --- block sizes and the budget ---------------------------------------------------------------


def test_chosen_blocks_respect_the_budget_and_the_query_block_limit():
    # 16k x 16k, 8 heads, float32: 8 GiB of scores under a 1 GiB budget
    bq, bk = blockwise.choose_blocks(8, 16384, 16384, 4, 1 << 30)
    assert 8 * bq * bk * 4 <= blockwise.PREFERRED_BLOCK_BYTES
    assert blockwise.plan_blocks((1, 8, 16384, 16384), 4, None) == (bq, bk)
    # traced: at most MAX_QUERY_BLOCKS query blocks, blocks still of the same size
    n = blockwise.MAX_QUERY_BLOCKS
    bq, bk = blockwise.choose_blocks(8, 65536, 65536, 4, 1 << 30, n)
    assert -(-65536 // bq) <= n
    assert 8 * bq * bk * 4 <= blockwise.PREFERRED_BLOCK_BYTES
    assert blockwise.plan_blocks((1, 8, 65536, 65536), 4, None, traced=True) == (bq, bk)
    # short rows: whole rows of keys, many queries at once
    bq, bk = blockwise.choose_blocks(64, 1000, 300, 4, 1 << 20)
    assert bk == 300 or 64 * bq * bk * 4 <= (1 << 20) // blockwise.SCORE_SHARE
    # a tiny budget gives blocks of about MIN_BLOCK (split evenly), not smaller
    assert blockwise.choose_blocks(8, 100, 100, 4, 1) == (15, 15)
    # blocks split the sequences evenly: the last block is at most one short per block
    for size in (1000, 999, 4097):
        bq, bk = blockwise.choose_blocks(1, size, size, 4, 4 * size * size - 1)
        for block in (bq, bk):
            count = -(-size // block)
            assert count > 1 and count * block - size < count
    assert blockwise.plan_blocks((2, 2, 10, 10), 4, None) is None
    assert blockwise.plan_blocks((2, 2, 10, 10), 4, (3, 30)) == (3, 10)
    assert blockwise.plan_blocks((None, 2, None, 10), 4, None) is None
    with pytest.raises(ValueError, match="static"):
        blockwise.plan_blocks((None, 2, None, 10), 4, (3, 3))


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, (2,), (2, 0), "3", (1, 2, 3)])
def test_bad_block_size(bad):
    q = cast(RNG.standard_normal((2, 3, 4)), "float32")
    with pytest.raises(ValueError, match="`block_size`"):
        ops.scaled_dot_product_attention(q, q, q, block_size=bad)


def test_config_budget_set_get_env_and_context(monkeypatch):
    monkeypatch.delenv(config.BUDGET_ENV_VAR, raising=False)
    monkeypatch.setattr(config, "_budget", None)
    monkeypatch.setattr(config, "_environment", None)
    assert config.get_attention_memory_budget() == config.DEFAULT_ATTENTION_MEMORY_BUDGET == 2**30
    monkeypatch.setenv(config.BUDGET_ENV_VAR, "512MiB")
    assert config.get_attention_memory_budget() == 2**30  # read once, at first use
    config.reload_environment()
    assert config.get_attention_memory_budget() == 512 * 2**20
    for text, value in (("1073741824", 2**30), ("1.5GB", 1.5e9), ("64k", 64000), ("2 GiB", 2**31)):
        monkeypatch.setenv(config.BUDGET_ENV_VAR, text)
        config.reload_environment()
        assert config.get_attention_memory_budget() == int(value)
    config.set_attention_memory_budget(1000)
    assert config.get_attention_memory_budget() == 1000  # the set value beats the variable
    with config.attention_memory_budget("1KiB") as inside:
        assert inside == config.get_attention_memory_budget() == 1024
    assert config.get_attention_memory_budget() == 1000
    config.set_attention_memory_budget(None)
    assert config.get_attention_memory_budget() == 2**31
    monkeypatch.setenv(config.BUDGET_ENV_VAR, "lots")
    config.reload_environment()
    with pytest.raises(ValueError, match=config.BUDGET_ENV_VAR):
        config.get_attention_memory_budget()
    for bad, error in (("12 parsecs", ValueError), (0, ValueError), (-5, ValueError)):
        with pytest.raises(error, match="budget"):
            config.set_attention_memory_budget(bad)
    for bad in (True, [1], float("nan")):
        with pytest.raises((TypeError, ValueError), match="budget"):
            config.set_attention_memory_budget(bad)
    config.reload_environment()


def test_settings_block_size_takes_the_blockwise_path(monkeypatch):
    """A block size of `multiattn.config.settings` applies to calls without their own,
    and a call's own `block_size` beats it."""
    q = cast(RNG.standard_normal((2, 6, 4)), "float32")
    seen = []
    real = blockwise_grad.attention
    monkeypatch.setattr(
        blockwise_grad, "attention", lambda *a, **k: seen.append(k["blocks"]) or real(*a, **k)
    )
    want = ops.scaled_dot_product_attention(q, q, q, causal=True)
    assert seen == []
    with config.settings(block_size=(2, 3)):
        got = ops.scaled_dot_product_attention(q, q, q, causal=True)
        ops.scaled_dot_product_attention(q, q, q, causal=True, block_size=4)
        with config.settings(block_size=None):
            ops.scaled_dot_product_attention(q, q, q, causal=True)
    assert seen == [(2, 3), (4, 4)]
    assert_close(got, to_np(want), "float32")

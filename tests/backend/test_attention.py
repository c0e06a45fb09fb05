"""Scoring functions and scaled dot-product attention against the float64 oracle."""

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
    rounded,
    to_np,
)

from multiattn import ops
from multiattn import reference as ref

RNG = np.random.default_rng(7)


def data(*shapes):
    return [RNG.standard_normal(s) for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_and_scaled_dot_scores(dtype):
    q, k = data((2, 3, 4), (2, 5, 4))
    qr, kr = rounded(q, dtype), rounded(k, dtype)
    assert_close(ops.dot_scores(cast(q, dtype), cast(k, dtype)), ref.dot_scores(qr, kr), dtype)
    assert_close(
        ops.scaled_dot_scores(cast(q, dtype), cast(k, dtype)), ref.scaled_dot_scores(qr, kr), dtype
    )
    assert_close(
        ops.scaled_dot_scores(cast(q, dtype), cast(k, dtype), scale=0.3),
        ref.scaled_dot_scores(qr, kr, scale=0.3),
        dtype,
    )


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in ("float64", "float32")])
def test_additive_and_general_scores_with_different_widths(dtype):
    q, k, wq, wk, wv, w = data((2, 3, 4), (2, 5, 6), (4, 7), (6, 7), (7,), (4, 6))
    got = ops.additive_scores(*(cast(a, dtype) for a in (q, k, wq, wk, wv)))
    assert_close(got, ref.additive_scores(q, k, wq, wk, wv), dtype)
    got = ops.general_scores(cast(q, dtype), cast(k, dtype), cast(w, dtype))
    assert_close(got, ref.general_scores(q, k, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("return_weights", [False, True], ids=["fused", "explicit"])
@pytest.mark.parametrize(
    "case",
    [
        "self",
        "cross",
        "causal_self",
        "causal_fewer_queries",
        "causal_more_queries",
        "custom_scale",
        "lens_1d",
        "lens_2d_zero",
        "mask",
        "value_dim",
        "heads_4d",
    ],
)
def test_sdpa_against_oracle(dtype, return_weights, case):
    tq, tk, d, dv = 5, 5, 4, 4
    if case in ("cross", "causal_fewer_queries", "lens_2d_zero", "mask"):
        tk = 7
    if case == "causal_more_queries":
        tq, tk = 7, 4
    if case == "value_dim":
        dv = 3
    lead = (2, 3) if case == "heads_4d" else (2,)
    q, k, v = data((*lead, tq, d), (*lead, tk, d), (*lead, tk, dv))
    kwargs = {}
    if case.startswith("causal"):
        kwargs["causal"] = True
    if case == "custom_scale":
        kwargs["scale"] = 0.7
    if case == "lens_1d":
        kwargs["valid_lens"] = np.array([3, 0])
    if case == "lens_2d_zero":
        kwargs["valid_lens"] = np.array([[0, 1, 7, 2, 0], [7, 7, 0, 3, 4]])
    if case == "mask":
        mask = RNG.random((2, tq, tk)) > 0.5
        mask[0, 1] = False
        kwargs["mask"] = mask
    if case == "heads_4d":
        kwargs["valid_lens"] = np.array([2, 5])
        kwargs["causal"] = True
    qr, kr, vr = (rounded(a, dtype) for a in (q, k, v))
    want, want_w = ref.scaled_dot_product_attention(qr, kr, vr, **kwargs)
    got = ops.scaled_dot_product_attention(
        cast(q, dtype), cast(k, dtype), cast(v, dtype), return_weights=return_weights, **kwargs
    )
    if return_weights:
        got, got_w = got
        assert_close(got_w, want_w, dtype)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    assert_close(got, want, dtype)
    zero_rows = ~np.any(want_w > 0, axis=-1)
    assert np.all(to_np(got)[zero_rows] == 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_and_explicit_paths_agree_on_fully_masked_rows(dtype):
    q, k, v = data((2, 4, 8), (2, 6, 8), (2, 6, 8))
    lens = np.array([[0, 3, 0, 6], [6, 0, 2, 1]])
    args = [cast(a, dtype) for a in (q, k, v)]
    fused = to_np(ops.scaled_dot_product_attention(*args, valid_lens=lens))
    explicit, _ = ops.scaled_dot_product_attention(*args, valid_lens=lens, return_weights=True)
    assert np.all(fused[0, 0] == 0.0) and np.all(fused[1, 1] == 0.0)
    assert_close(fused, to_np(explicit), dtype)


def test_dropout_only_in_training():
    q, k, v = (cast(a, "float32") for a in data((2, 4, 8), (2, 6, 8), (2, 6, 8)))
    base = to_np(ops.scaled_dot_product_attention(q, k, v))
    off = to_np(ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=False))
    np.testing.assert_array_equal(base, off)
    _, w = ops.scaled_dot_product_attention(
        q, k, v, dropout=0.5, training=True, seed=3, return_weights=True
    )
    out = to_np(ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=True, seed=3))
    assert not np.allclose(out, base)
    w = to_np(w)  # returned weights are the pre-dropout weights
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_oracle_and_stay_finite(dtype):
    q, k, v, g = data((2, 3, 4), (2, 5, 4), (2, 5, 3), (2, 3, 3))
    lens = np.array([[0, 2, 5], [5, 0, 1]])
    acc = "float64" if dtype == "float64" else "float32"

    def fn(qt, kt, vt):
        out = ops.scaled_dot_product_attention(qt, kt, vt, valid_lens=lens, causal=False)
        return keras.ops.sum(keras.ops.cast(out, acc) * cast(g, acc))

    grads = gradients(fn, *(cast(a, dtype) for a in (q, k, v)))
    rounded_in = [rounded(a, dtype) for a in (q, k, v)]

    def oracle(qa, ka, va):
        return float((ref.scaled_dot_product_attention(qa, ka, va, valid_lens=lens)[0] * g).sum())

    wants = numeric_grad(oracle, *rounded_in)
    bound = {"float64": 1e-7, "float32": 1e-5, "float16": 1e-2, "bfloat16": 6e-2}[dtype]
    for name, got, want in zip("qkv", grads, wants):
        assert np.all(np.isfinite(got)), f"d{name} has NaN/Inf"
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= bound, f"d{name}: relative error {err:.2e} > {bound:.0e}"
    assert np.all(grads[0][0, 0] == 0.0) and np.all(grads[0][1, 1] == 0.0)


def test_fused_path_gradients_finite_with_fully_masked_rows():
    q, k, v = data((1, 3, 4), (1, 3, 4), (1, 3, 4))
    mask = np.array([[[False] * 3, [True, False, True], [True] * 3]])

    def fn(qt, kt, vt):
        return keras.ops.sum(ops.scaled_dot_product_attention(qt, kt, vt, mask=mask))

    for grad in gradients(fn, *(cast(a, "float32") for a in (q, k, v))):
        assert np.all(np.isfinite(grad))


def test_compiles_under_the_backend_jit():
    q, k, v = (cast(a, "float32") for a in data((2, 4, 8), (2, 6, 8), (2, 6, 8)))
    lens = cast(np.array([0, 4]), "int32")

    def f(q, k, v, lens):
        return ops.scaled_dot_product_attention(q, k, v, valid_lens=lens, causal=True)

    if BACKEND == "jax":
        import jax

        compiled = jax.jit(f)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(f)
    elif BACKEND == "torch":
        pytest.skip("torch runs eagerly; torch.compile is outside this suite's scope")
    else:
        pytest.skip("numpy has no compiler")
    want = ref.scaled_dot_product_attention(
        *(to_np(a) for a in (q, k, v)), valid_lens=np.array([0, 4]), causal=True
    )[0]
    assert_close(compiled(q, k, v, lens), want, "float32", TOL)

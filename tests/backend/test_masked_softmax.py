"""masked_softmax against the float64 oracle, every dtype, masks and gradients."""

import keras
import numpy as np
import pytest
from _support import DTYPES, TOL, assert_close, cast, gradients, numeric_grad, rounded, to_np

from multiattn import ops
from multiattn import reference as ref

RNG = np.random.default_rng(1234)
X = RNG.standard_normal((3, 4, 6)) * 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    ["none", "lens_1d", "lens_2d", "lens_zero", "mask", "mask_all_false_row", "lens_and_mask"],
)
def test_against_oracle(dtype, case):
    valid_lens = mask = None
    if case == "lens_1d":
        valid_lens = np.array([2, 6, 1])
    elif case == "lens_2d":
        valid_lens = np.array([[1, 2, 3, 4], [6, 5, 4, 3], [2, 2, 6, 1]])
    elif case == "lens_zero":
        valid_lens = np.array([[0, 2, 0, 4], [6, 0, 4, 3], [0, 0, 0, 0]])
    elif case in ("mask", "mask_all_false_row", "lens_and_mask"):
        mask = RNG.random((3, 4, 6)) > 0.4
        if case == "mask_all_false_row":
            mask[1, 2] = False
            mask[0] = False
        if case == "lens_and_mask":
            valid_lens = np.array([3, 0, 5])
    x = rounded(X, dtype)
    got = ops.masked_softmax(cast(X, dtype), valid_lens, mask=mask)
    want = ref.masked_softmax(x, valid_lens=valid_lens, mask=mask)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    assert_close(got, want, dtype)
    empty = ~np.any(want > 0, axis=-1)
    assert np.all(to_np(got)[empty] == 0.0)


def test_fully_masked_row_is_zero_not_nan_or_uniform():
    got = to_np(ops.masked_softmax(cast(X, "float32"), np.array([0, 6, 0])))
    assert np.all(got[0] == 0.0) and np.all(got[2] == 0.0)
    np.testing.assert_allclose(got[1].sum(-1), 1.0, rtol=1e-6)


def test_axis_other_than_last_matches_moved_axis():
    mask = RNG.random((3, 4, 6)) > 0.3
    got = ops.masked_softmax(cast(X, "float32"), mask=mask, axis=1)
    want = np.moveaxis(
        ref.masked_softmax(np.moveaxis(X, 1, -1), mask=np.moveaxis(mask, 1, -1)), -1, 1
    )
    assert_close(got, want, "float32")


def test_integer_mask_nonzero_means_attend():
    mask = (RNG.random((3, 4, 6)) > 0.5).astype("int32")
    got = ops.masked_softmax(cast(X, "float32"), mask=mask)
    assert_close(got, ref.masked_softmax(X, mask=mask.astype(bool)), "float32")


def test_float_valid_lens_are_accepted():
    got = ops.masked_softmax(cast(X, "float32"), np.array([2.0, 6.0, 1.0]))
    assert_close(got, ref.masked_softmax(X, valid_lens=np.array([2, 6, 1])), "float32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_finite_with_fully_masked_rows(dtype):
    valid_lens = np.array([[0, 2, 6, 1], [0, 0, 0, 0], [3, 3, 3, 3]])
    weights = RNG.standard_normal((3, 4, 6))

    acc = "float64" if dtype == "float64" else "float32"

    def fn(x):
        w = keras.ops.cast(ops.masked_softmax(x, valid_lens), acc)
        return keras.ops.sum(w * cast(weights, acc))

    (grad,) = gradients(fn, cast(X, dtype))
    assert np.all(np.isfinite(grad))
    assert np.all(grad[1] == 0.0) and np.all(grad[0, 0] == 0.0)
    xr = rounded(X, dtype)
    (want,) = numeric_grad(lambda x: float((ref.masked_softmax(x, valid_lens) * weights).sum()), xr)
    scale = np.abs(want).max()
    bound = max(TOL[dtype] * 10, 1e-7)
    assert np.abs(grad - want).max() / scale <= bound


@pytest.mark.parametrize("dtype", DTYPES)
def test_minus_inf_scores_get_zero_weight(dtype):
    """A kept score of -inf (an additive mask) gets weight 0, the row's other scores
    share the rest, and the gradient stays finite."""
    x = X.copy()
    x[1, 2, 1:] = -np.inf  # all but one
    x[2, 0, ::2] = -np.inf
    valid_lens = np.array([6, 4, 6])
    got = to_np(ops.masked_softmax(cast(x, dtype), valid_lens))
    assert np.all(np.isfinite(got))
    assert got[1, 2, 0] == 1.0 and np.all(got[1, 2, 1:] == 0.0)
    assert np.all(got[2, 0, ::2] == 0.0)
    assert_close(got, ref.masked_softmax(rounded(x, dtype), valid_lens=valid_lens), dtype)
    if dtype in ("float32", "float64"):
        (grad,) = gradients(
            lambda t: keras.ops.sum(ops.masked_softmax(t, valid_lens) * cast(X, dtype)),
            cast(x, dtype),
        )
        assert np.all(np.isfinite(grad)) and np.all(grad[1, 2] == 0.0)


@pytest.mark.parametrize("fn", ["masked_softmax", "score_attention", "sdpa"])
def test_numpy_inputs_are_accepted_on_every_backend(fn):
    """Plain NumPy arrays go in as they are (they become tensors of the backend)."""
    x = rounded(X, "float32").astype("float32")
    lens = np.array([2, 0, 6])
    if fn == "masked_softmax":
        got = ops.masked_softmax(x, lens)
        want = ref.masked_softmax(x, valid_lens=lens)
    elif fn == "score_attention":
        value = RNG.standard_normal((3, 6, 5)).astype("float32")
        got = ops.score_attention(x, value, valid_lens=lens)
        want = ref.masked_softmax(x, valid_lens=lens) @ value
    else:
        q = RNG.standard_normal((3, 4, 8)).astype("float32")
        kv = RNG.standard_normal((3, 6, 8)).astype("float32")
        got = ops.scaled_dot_product_attention(q, kv, kv, valid_lens=lens)
        want = ref.scaled_dot_product_attention(q, kv, kv, valid_lens=lens)[0]
    assert keras.backend.standardize_dtype(got.dtype) == "float32"
    assert_close(got, want, "float32")

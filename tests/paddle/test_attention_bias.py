"""On Paddle: the additive attention bias of `multiattn.ops.scaled_dot_product_attention`
(Paddle tensors, direct and blockwise paths) against the float64 oracle, with shapes
from hypothesis (one query, more keys than queries, length 1, fully masked rows, every
broadcast pattern of the bias), its gradient against differences of the oracle, and bad
arguments."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from _paddle_support import assert_close, numeric_grad, paddle_grads, rounded, tensor, to_np
from hypothesis import given, settings
from hypothesis import strategies as st

from multiattn import ops
from multiattn import reference as ref

PATHS = {"direct": None, "blockwise": (2, 3)}


@st.composite
def cases(draw):
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    tq, tk = draw(st.sampled_from([1, 2, 5])), draw(st.sampled_from([1, 4, 7]))
    full = (b, h, tq, tk)
    pattern = draw(st.lists(st.booleans(), min_size=4, max_size=4))
    rank = draw(st.integers(2, 4))
    bias_shape = tuple(d if keep else 1 for d, keep in zip(full, pattern))[4 - rank :]
    return full, bias_shape, draw(st.booleans()), draw(st.integers(0, 2**16))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("path", sorted(PATHS))
@settings(max_examples=10, deadline=None)
@given(case=cases())
def test_bias_matches_the_oracle(dtype, path, case):
    (b, h, tq, tk), bias_shape, masked, seed = case
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s) for s in ((b, h, tq, 4), (b, h, tk, 4), (b, h, tk, 3)))
    bias = 2.0 * rng.standard_normal(bias_shape)
    mask = None
    if masked:
        mask = rng.random((b, 1, tq, tk)) < 0.6
        mask[0, 0, 0] = False  # a row with nothing to attend
    inputs = [rounded(a, dtype) for a in (q, k, v, bias)]
    want, _ = ref.scaled_dot_product_attention(*inputs[:3], mask=mask, bias=inputs[3])
    got = ops.scaled_dot_product_attention(
        *(tensor(a, dtype) for a in inputs[:3]),
        mask=mask,
        bias=tensor(inputs[3], dtype),
        block_size=PATHS[path],
    )
    assert_close(got, want, dtype, tol=1e-11 if dtype == "float64" else 1e-5)
    if masked:
        assert np.all(to_np(got)[0, :, 0] == 0.0)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("bias_shape", [(2, 2, 3, 5), (1, 2, 1, 5)], ids=str)
def test_bias_gradient_matches_oracle_differences(path, bias_shape):
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal(s) for s in ((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3),
                                                   (2, 2, 3, 3)))  # fmt: skip
    bias = rng.standard_normal(bias_shape)
    mask = rng.random((2, 1, 3, 5)) < 0.7
    leaves = [tensor(a, "float64", grad=True) for a in (q, k, v, bias)]
    out = ops.scaled_dot_product_attention(
        *leaves[:3], mask=mask, bias=leaves[3], causal=True, block_size=PATHS[path]
    )
    got = paddle_grads((out * paddle.to_tensor(g)).sum(), leaves)

    def oracle(q_, k_, v_, b_):
        out = ref.scaled_dot_product_attention(q_, k_, v_, mask=mask, bias=b_, causal=True)[0]
        return float((out * g).sum())

    for name, a, want in zip("qkvb", got, numeric_grad(oracle, q, k, v, bias)):
        assert a.shape == want.shape
        assert np.abs(a - want).max() <= 1e-8 * max(np.abs(want).max(), 1.0), f"d{name} ({path})"


def test_bad_bias_is_refused_by_name():
    q = tensor(np.zeros((2, 3, 4)), "float32")
    with pytest.raises(TypeError, match="`bias`"):
        ops.scaled_dot_product_attention(q, q, q, bias=paddle.zeros([3, 3], "int32"))
    with pytest.raises(ValueError, match=r"`bias` of shape \(5, 3\)"):
        ops.scaled_dot_product_attention(q, q, q, bias=tensor(np.zeros((5, 3)), "float32"))

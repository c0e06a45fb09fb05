"""`multiattn.ops.rms_norm` on Paddle tensors (through the Paddle ops namespace) against
the float64 oracle: every dtype, gradients by Paddle autograd, bad input."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from _paddle_support import (
    FLOAT_DTYPES,
    assert_close,
    numeric_grad,
    paddle_grads,
    rel_err,
    rounded,
    tensor,
)

from multiattn import ops
from multiattn import reference as ref
from multiattn.namespaces.keras import get_ops

PNS = get_ops(paddle.zeros([1]))
RNG = np.random.default_rng(17)
X = RNG.standard_normal((2, 3, 6)) * 3 + 1  # rows of non-zero mean: RMSNorm != LayerNorm
SCALE = RNG.standard_normal(6)


@pytest.mark.parametrize("with_scale", [True, False], ids=["scale", "no_scale"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_rms_norm_vs_oracle(dtype, with_scale):
    scale = tensor(SCALE, dtype) if with_scale else None
    out = ops.rms_norm(tensor(X, dtype), scale, epsilon=1e-5)
    assert isinstance(out, paddle.Tensor)
    assert PNS.dtype_name(out) == dtype
    want = ref.rms_norm(rounded(X, dtype), rounded(SCALE, dtype) if with_scale else None, 1e-5)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_gradients_vs_oracle(dtype):
    """Gradients of sum(rms_norm(x, scale) * r) by Paddle autograd against fourth-order
    differences of the oracle, a row of zeros included (finite gradient)."""
    x = X.copy()
    x[1, 0] = 0.0
    r = RNG.standard_normal(x.shape)
    leaves = [tensor(a, dtype, grad=True) for a in (x, SCALE)]
    out = ops.rms_norm(*leaves, epsilon=1e-3)
    got = paddle_grads(PNS.sum(out * tensor(r, dtype)), leaves)
    want = numeric_grad(
        lambda a, s: float(np.sum(ref.rms_norm(a, s, 1e-3) * r)),
        *(rounded(a, dtype) for a in (x, SCALE)),
        h=1e-4,  # the zero row varies on the scale sqrt(epsilon): a smaller step than 1e-3
    )
    for g, w in zip(got, want):
        assert rel_err(g, w) <= {"float64": 1e-9, "float32": 1e-5}[dtype]


def test_rms_norm_default_epsilon_on_paddle():
    x = np.full((2, 4), 1e-3)
    out = ops.rms_norm(tensor(x, "float64"))
    assert_close(out, ref.rms_norm(x, None, 1e-6), "float64")
    np.testing.assert_allclose(out.numpy(), np.sqrt(0.5), rtol=1e-12)


BAD = {
    "x_int": (lambda: ops.rms_norm(paddle.zeros([2, 4], dtype="int32")), TypeError, "`x`"),
    "scale_width": (
        lambda: ops.rms_norm(tensor(X), tensor(np.ones(5))),
        ValueError,
        "`scale` must have shape (6,)",
    ),
    "scale_int": (
        lambda: ops.rms_norm(tensor(X), paddle.ones([6], dtype="int64")),
        TypeError,
        "`scale`",
    ),
    "epsilon_zero": (lambda: ops.rms_norm(tensor(X), epsilon=0.0), ValueError, "`epsilon`"),
    "epsilon_str": (lambda: ops.rms_norm(tensor(X), epsilon="1e-6"), TypeError, "`epsilon`"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_rms_norm_bad_input_on_paddle(case):
    fn, error, fragment = BAD[case]
    with pytest.raises(error) as info:
        fn()
    assert fragment in str(info.value), str(info.value)

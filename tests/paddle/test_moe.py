"""The Paddle twin of `multiattn.layers.MixtureOfExperts` against the float64 loop
oracle (tests/_moe_oracle.py): outputs in float32 and float64, with and without the
shared expert, and gradients by Paddle autograd reaching the router, the experts and
the input."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from _moe_oracle import moe_oracle
from _paddle_support import numeric_grad, paddle_grads, rel_err, tensor

from multiattn.paddle.layers import MixtureOfExperts

RNG = np.random.default_rng(7)
TOL = {"float64": 1e-12, "float32": 1e-5}


def _layer(dtype, shared=None, norm=True, width=6, hidden=5):
    layer = MixtureOfExperts(4, 2, hidden, norm_topk_prob=norm, shared_expert_dim=shared,
                             dtype=dtype)  # fmt: skip
    layer.eval()
    layer(tensor(np.zeros((1, 2, width)), dtype))  # built on the first call
    values = {}
    for p in layer.trainable_variables:
        value = (RNG.standard_normal(tuple(p.shape)) * 0.5).astype(dtype)
        p.set_value(value)
        values[p.path.split("/", 1)[1]] = value.astype(np.float64)
    return layer, values


def _oracle(x, v, norm, shared):
    parts = None
    if shared:
        parts = tuple(v[f"shared_expert/{p}/kernel"] for p in ("gate", "up", "down"))
        parts += (v["shared_expert_gate/kernel"],)
    return moe_oracle(x, v["router/kernel"], v["gate_kernel"], v["up_kernel"], v["down_kernel"],
                      2, norm, parts)  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("shared", "norm"), [(None, True), (7, False)], ids=["mixtral", "shared"])
def test_paddle_moe_matches_the_oracle(dtype, shared, norm):
    layer, v = _layer(dtype, shared, norm)
    x = RNG.standard_normal((2, 3, 6)).astype(dtype)
    got = layer(tensor(x, dtype))
    assert isinstance(got, paddle.Tensor) and str(got.dtype) == f"paddle.{dtype}"
    assert rel_err(got, _oracle(x.astype(np.float64), v, norm, shared)) <= TOL[dtype]


def test_paddle_moe_gradients_reach_router_experts_and_input():
    layer, v = _layer("float64", shared=3, width=4, hidden=3)
    x = RNG.standard_normal((1, 3, 4))
    r = RNG.standard_normal((1, 3, 4))
    xt = tensor(x, "float64", grad=True)
    params = list(layer.trainable_variables)
    names = [p.path.split("/", 1)[1] for p in params]
    loss = paddle.sum(layer(xt) * tensor(r, "float64"))
    got = paddle_grads(loss, [xt, *params])

    def fn(xa, *arrays):
        return float((_oracle(xa, dict(zip(names, arrays)), True, True) * r).sum())

    want = numeric_grad(fn, x, *(v[n] for n in names))
    assert {"router/kernel", "gate_kernel", "up_kernel", "down_kernel"} <= set(names)
    for name, g, w in zip(["x", *names], got, want):
        assert np.abs(w).max() > 0, name
        assert np.abs(g - w).max() / np.abs(w).max() <= 1e-7, name

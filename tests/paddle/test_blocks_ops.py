"""The decoder-only building blocks of the core on Paddle tensors: the feed-forward
activations and the rotary variants, against the float64 oracle."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from _paddle_support import assert_close, rounded, tensor

from multiattn import ops
from multiattn import reference as ref
from multiattn.namespaces.keras import get_ops

RNG = np.random.default_rng(23)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(ops.ACTIVATIONS))
def test_activation_on_paddle(name, dtype):
    x = rounded(np.r_[RNG.standard_normal(30) * 3, -40.0, 0.0, 40.0], dtype)
    got = ops.activation(tensor(x, dtype), name)
    assert isinstance(got, paddle.Tensor)
    assert_close(got, ref.activation(x, name), dtype)


def test_activation_gradient_on_paddle():
    x = RNG.standard_normal(6)
    leaf = tensor(x, "float64", grad=True)
    ops.activation(leaf, "silu").sum().backward()
    sig = 1.0 / (1.0 + np.exp(-x))
    np.testing.assert_allclose(leaf.grad.numpy(), sig * (1 + x * (1 - sig)), rtol=1e-12)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"interleaved": True},
        {"rotary_dim": 4},
        {"rotary_dim": 4, "interleaved": True, "scaling": LLAMA3},
        {"scaling": {"rope_type": "linear", "factor": 2.0}},
    ],
)
def test_rotary_variants_on_paddle(kwargs, dtype):
    x = rounded(RNG.standard_normal((2, 5, 3, 8)), dtype)
    got = ops.rotary_embedding(tensor(x, dtype), offset=20, base=100.0, **kwargs)
    assert isinstance(got, paddle.Tensor)
    want = ref.rotary_embedding(x.transpose(0, 2, 1, 3), 20 + np.arange(5), 100.0, **kwargs)
    assert_close(got, want.transpose(0, 2, 1, 3), dtype)


@pytest.mark.parametrize("kwargs", [{}, {"interleaved": True}, {"rotary_dim": 4}])
def test_rotary_broadcasts_its_tables_once_and_rotates_the_same(kwargs, monkeypatch):
    # Paddle declares `broadcasts_slowly`: the tables go to the full shape first
    x = tensor(RNG.standard_normal((2, 5, 3, 8)), "float32")
    ns = type(get_ops(x))
    seen: list = []
    spy = ns.broadcast_to
    monkeypatch.setattr(
        ns, "broadcast_to", lambda self, t, shape: seen.append(shape) or spy(self, t, shape)
    )
    got = ops.rotary_embedding(x, offset=3, **kwargs).numpy()
    half = (kwargs.get("rotary_dim") or 8) // 2
    assert [tuple(s) for s in seen] == [(2, 5, 3, half)] * 2
    monkeypatch.setattr(ns, "broadcasts_slowly", False)
    seen.clear()
    np.testing.assert_array_equal(got, ops.rotary_embedding(x, offset=3, **kwargs).numpy())
    assert seen == []

"""Grouped-query attention and rotary position embedding of the core on Paddle tensors."""

from __future__ import annotations

import numpy as np
import pytest
from _paddle_support import TOL, assert_close, rounded, tensor, to_np

from multiattn import ops
from multiattn import reference as ref
from multiattn._namespace import get_ops
from multiattn.ops.attention import attend

RNG = np.random.default_rng(5)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("weights", [False, True])
def test_grouped_query_attend_on_paddle(dtype, kv_heads, weights):
    b, tq, tk, h, d = 2, 4, 5, 4, 3
    q = rounded(RNG.standard_normal((b, tq, h, d)), dtype)
    k = rounded(RNG.standard_normal((b, tk, kv_heads, d)), dtype)
    v = rounded(RNG.standard_normal((b, tk, kv_heads, d)), dtype)
    lens = np.array([[0, 2, 5, 1], [5, 3, 0, 4]])
    args = [tensor(x, dtype) for x in (q, k, v)]
    result = attend(
        get_ops(args[0]),
        *args,
        valid_lens=tensor(lens, "int32"),
        causal=True,
        scale=0.5,
        return_weights=weights,
    )
    got = result[0] if weights else result
    g = h // kv_heads
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    want, want_w = ref.scaled_dot_product_attention(
        qh, np.repeat(kh, g, 1), np.repeat(vh, g, 1), valid_lens=lens, causal=True, scale=0.5
    )
    assert_close(got, want.transpose(0, 2, 1, 3), dtype)
    if weights:
        assert_close(result[1], want_w, dtype)
    assert np.all(to_np(got)[lens == 0] == 0.0)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_rotary_embedding_on_paddle(dtype):
    x = rounded(RNG.standard_normal((2, 5, 3, 4)), dtype)
    got = ops.rotary_embedding(tensor(x, dtype), offset=2)
    want = ref.rotary_embedding(x.transpose(0, 2, 1, 3), 2 + np.arange(5))
    assert_close(got, want.transpose(0, 2, 1, 3), dtype, TOL[dtype])

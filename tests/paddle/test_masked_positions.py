"""On Paddle: masked positions have no effect whatever they hold, causal attention with one
query, grouped heads in the public op (`multiattn.ops.scaled_dot_product_attention` on
Paddle tensors, every internal path, against the float64 oracle)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from _paddle_support import assert_close, numeric_grad, paddle_grads, rounded, tensor, to_np

from multiattn import ops
from multiattn import reference as ref

RNG = np.random.default_rng(17)
PATHS = {"fused": {}, "explicit": {"return_weights": True}, "blockwise": {"block_size": 2}}
POISONS = {"nan": np.nan, "inf": np.inf, "minus_inf": -np.inf, "huge": 1e30}


def _attend(q, k, v, path, **kwargs):
    got = ops.scaled_dot_product_attention(q, k, v, **PATHS[path], **kwargs)
    return got[0] if path == "explicit" else got


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tq,tk", [(1, 5), (2, 7), (6, 3)], ids=str)
def test_causal_attention_with_any_query_and_key_counts(dtype, path, tq, tk):
    q, k, v = (RNG.standard_normal(s) for s in ((2, tq, 8), (2, tk, 8), (2, tk, 8)))
    kwargs = {"causal": True, "valid_lens": np.array([tk, max(tk - 2, 0)])}
    want, _ = ref.scaled_dot_product_attention(*(rounded(a, dtype) for a in (q, k, v)), **kwargs)
    got = _attend(*(tensor(a, dtype) for a in (q, k, v)), path, **kwargs)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("poison", POISONS)
def test_a_position_no_row_attends_has_no_effect(dtype, path, poison):
    """Padding holding NaN, infinities or 1e30 changes nothing (Paddle's softmax floors its
    exponentials: a masked weight was 1.6e-28, enough for 1e30 to move the output)."""
    q, k, v = (RNG.standard_normal(s) for s in ((2, 3, 4), (2, 6, 4), (2, 6, 4)))
    lens = np.array([4, 2])
    want, _ = ref.scaled_dot_product_attention(
        *(rounded(a, dtype) for a in (q, k, v)), valid_lens=lens, causal=True
    )
    kp, vp = rounded(k, dtype), rounded(v, dtype)
    hidden = np.arange(6)[None, :] >= lens[:, None]
    kp[hidden] = vp[hidden] = POISONS[poison]
    got = _attend(
        tensor(q, dtype), tensor(kp, dtype), tensor(vp, dtype), path, valid_lens=lens, causal=True
    )
    assert_close(got, want, dtype)


@pytest.mark.parametrize("path", PATHS)
def test_a_nan_key_poisons_exactly_the_rows_that_see_it(path):
    q, k, v = (RNG.standard_normal(s) for s in ((1, 4, 4), (1, 4, 4), (1, 4, 4)))
    want, _ = ref.scaled_dot_product_attention(q, k, v, causal=True)
    kp = k.copy()
    kp[0, 2, 0] = np.nan  # key 2: seen by queries 2 and 3 under the causal mask
    got = to_np(_attend(*(tensor(a, "float64") for a in (q, kp, v)), path, causal=True))
    assert np.isnan(got[0, 2:]).all()
    assert_close(got[:, :2], want[:, :2], "float64")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_gradients_ignore_masked_positions(path, poison):
    q, k, v, g = (RNG.standard_normal(s) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 3), (2, 3, 3)))
    lens = np.array([3, 1])
    hidden = np.arange(5)[None, :] >= lens[:, None]
    kp, vp = k.copy(), v.copy()
    kp[hidden] = vp[hidden] = POISONS[poison]
    leaves = [tensor(a, "float64", grad=True) for a in (q, kp, vp)]
    out = _attend(*leaves, path, valid_lens=lens, causal=True)
    got = paddle_grads((out * paddle.to_tensor(g)).sum(), leaves)

    def oracle(q_, k_, v_):
        out = ref.scaled_dot_product_attention(q_, k_, v_, valid_lens=lens, causal=True)[0]
        return float((out * g).sum())

    for name, a, b in zip("qkv", got, numeric_grad(oracle, q, k, v)):
        assert np.abs(a - b).max() <= 1e-8 * max(np.abs(b).max(), 1.0), f"d{name} ({path})"
    assert np.all(got[1][hidden] == 0.0) and np.all(got[2][hidden] == 0.0)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
def test_grouped_heads_in_the_public_op(dtype, path, kv_heads):
    q, k, v = (
        RNG.standard_normal(s) for s in ((2, 4, 5, 8), (2, kv_heads, 7, 8), (2, kv_heads, 7, 6))
    )
    kwargs = {"valid_lens": np.array([[1, 7, 3, 0, 2], [7, 7, 6, 5, 4]]), "causal": True}
    qr, kr, vr = (rounded(a, dtype) for a in (q, k, v))
    group = 4 // kv_heads
    want, _ = ref.scaled_dot_product_attention(
        qr, np.repeat(kr, group, axis=1), np.repeat(vr, group, axis=1), **kwargs
    )
    got = _attend(*(tensor(a, dtype) for a in (q, k, v)), path, **kwargs)
    assert tuple(got.shape) == (2, 4, 5, 6)
    assert_close(got, want, dtype)


def test_head_counts_that_do_not_divide_raise():
    q = tensor(np.zeros((2, 4, 5, 8)))
    kv = tensor(np.zeros((2, 3, 7, 8)))
    with pytest.raises(ValueError, match="must divide"):
        ops.scaled_dot_product_attention(q, kv, kv)

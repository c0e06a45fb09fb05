"""Grouped-query attention and rotary position embedding of the core on Paddle tensors."""

from __future__ import annotations

import numpy as np
import pytest
from _paddle_support import TOL, assert_close, rounded, tensor, to_np

from multiattn import ops
from multiattn import reference as ref
from multiattn.namespaces.keras import get_ops
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


# --- offsets, flags and unclear input on Paddle tensors (issue 13) -----------------------------


def test_rotary_offset_of_every_integer_kind_on_paddle():
    """A NumPy integer and an eager Paddle integer tensor are offsets as the int is; a
    negative one raises naming `offset`, a float tensor is refused."""
    import paddle

    x = tensor(RNG.standard_normal((2, 3, 2, 4)), "float32")
    want = to_np(ops.rotary_embedding(x, offset=4))
    for offset in (np.int64(4), np.int32(4), paddle.to_tensor(4), paddle.to_tensor(np.int64(4))):
        np.testing.assert_array_equal(to_np(ops.rotary_embedding(x, offset=offset)), want)
    for offset in (-1, np.int64(-1), paddle.to_tensor(-1)):
        with pytest.raises(ValueError, match="`offset`"):
            ops.rotary_embedding(x, offset=offset)
    for offset in (1.5, True, paddle.to_tensor(1.0), paddle.to_tensor([1, 2])):
        with pytest.raises(TypeError, match="`offset`"):
            ops.rotary_embedding(x, offset=offset)


def test_rotary_huge_offset_on_paddle_computes_only_the_rows_needed(monkeypatch):
    import multiattn.ops.rotary as rotary_ops

    def whole_table(*args, **kwargs):
        raise AssertionError("rotary_embedding built a whole table")

    monkeypatch.setattr(rotary_ops, "rotary_table", whole_table)
    x = rounded(RNG.standard_normal((1, 5, 2, 8)), "float64")
    got = ops.rotary_embedding(tensor(x, "float64"), offset=10**8)
    want = ref.rotary_embedding(x.transpose(0, 2, 1, 3), 10**8 + np.arange(5))
    # the angles are about 1e8 rad: float64 rounding of the oracle's frequencies shows
    assert_close(got, want.transpose(0, 2, 1, 3), "float64", 1e-7)


@pytest.mark.parametrize(
    "flags,name",
    [
        ({"training": "False"}, "training"),
        ({"training": 2}, "training"),
        ({"return_weights": 2}, "return_weights"),
        ({"return_weights": "True"}, "return_weights"),
        ({"seed": "a"}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_attention_flags_and_seed_are_checked_on_paddle(flags, name):
    q, k, v = (tensor(RNG.standard_normal(s)) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 4)))
    with pytest.raises(TypeError, match=f"`{name}`"):
        ops.scaled_dot_product_attention(q, k, v, dropout=0.5, **flags)
    scores = tensor(RNG.standard_normal((2, 3, 5)))
    with pytest.raises(TypeError, match=f"`{name}`"):
        ops.score_attention(scores, v, dropout=0.5, **flags)


def test_numpy_bool_flags_on_paddle():
    q, k, v = (tensor(RNG.standard_normal(s)) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 4)))
    plain = to_np(ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=False))
    got = ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=np.False_)
    np.testing.assert_array_equal(to_np(got), plain)
    dropped = ops.scaled_dot_product_attention(
        q, k, v, dropout=0.5, training=np.True_, seed=np.int64(3)
    )
    again = ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=True, seed=3)
    np.testing.assert_array_equal(to_np(dropped), to_np(again))
    assert not np.array_equal(to_np(dropped), plain)
    _, weights = ops.scaled_dot_product_attention(q, k, v, return_weights=np.True_)
    assert tuple(weights.shape) == (2, 3, 5)


def test_unclear_input_is_named_on_paddle():
    k, v = tensor(RNG.standard_normal((2, 5, 4))), tensor(RNG.standard_normal((2, 5, 4)))
    for query in (None, "query", [[1.0, 2.0], [3.0]]):
        with pytest.raises(TypeError, match="`query`"):
            ops.scaled_dot_product_attention(query, k, v)
    with pytest.raises(ValueError, match="`query` has width 0"):
        ops.scaled_dot_product_attention(
            tensor(np.zeros((2, 3, 0))), tensor(np.zeros((2, 5, 0))), v
        )
    with pytest.raises(TypeError, match="`scores`"):
        ops.score_attention(None, v)
    with pytest.raises(TypeError, match="`x`"):
        ops.rotary_embedding(tensor(np.zeros((1, 2, 1, 4)), "float32").astype("int32"))
    with pytest.raises(ValueError, match="`base`"):
        ops.rotary_embedding(tensor(np.zeros((1, 2, 1, 4))), base=float("inf"))

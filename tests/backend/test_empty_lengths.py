"""Sequences of length 0: attention with no queries, no keys or neither, through the
functional ops, the layer and the core under a compiler, against the float64 oracle:
the shapes, zeros where the output has entries (with no key every query has nothing
to attend), and gradients of the inputs' shapes, all zero."""

import keras
import numpy as np
import pytest
from _support import BACKEND, HAS_GRAD, TOL, assert_close, cast, compiler, gradients, to_np

from multiattn import ops
from multiattn import reference as ref
from multiattn.layers import MultiHeadAttention

RNG = np.random.default_rng(41)
B, H, D, DV = 2, 4, 4, 5
LENGTHS = [(0, 3), (3, 0), (0, 0)]
IDS = ["no queries", "no keys", "neither"]


def _inputs(tq: int, tk: int, kv_heads: int = H) -> list[np.ndarray]:
    shapes = ((B, H, tq, D), (B, kv_heads, tk, D), (B, kv_heads, tk, DV))
    return [RNG.standard_normal(s) for s in shapes]


def _kwargs(kind: str, tq: int, tk: int) -> dict:
    return {
        "plain": {},
        "causal": {"causal": True},
        "mask": {"mask": RNG.random((B, 1, tq, tk)) > 0.5},
        "lengths": {"valid_lens": np.zeros((B,), "int32")},
    }[kind]


def _oracle(q, k, v, kw):
    groups = q.shape[1] // k.shape[1]
    k, v = (np.repeat(t, groups, axis=1) for t in (k, v))
    return ref.scaled_dot_product_attention(q, k, v, **kw)


def _tensors(kw: dict) -> dict:
    out = dict(kw)
    if "valid_lens" in out:
        out["valid_lens"] = keras.ops.convert_to_tensor(out["valid_lens"], "int32")
    return out


@pytest.mark.parametrize("kv_heads", [H, 2], ids=["heads", "grouped"])
@pytest.mark.parametrize("kind", ["plain", "causal", "mask", "lengths"])
@pytest.mark.parametrize("tq, tk", LENGTHS, ids=IDS)
def test_sdpa_gives_the_oracle_shapes_and_zeros(tq, tk, kind, kv_heads):
    q, k, v = _inputs(tq, tk, kv_heads)
    kw = _kwargs(kind, tq, tk)
    want, want_w = _oracle(q, k, v, kw)
    got, got_w = ops.scaled_dot_product_attention(
        *(cast(a, "float32") for a in (q, k, v)), return_weights=True, **_tensors(kw)
    )
    assert to_np(got).shape == want.shape == (B, H, tq, DV)
    assert to_np(got_w).shape == want_w.shape == (B, H, tq, tk)
    assert_close(got, want, "float32", TOL)
    assert not np.any(to_np(got))


@pytest.mark.skipif(not HAS_GRAD, reason=f"{BACKEND} has no gradients")
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["heads", "grouped"])
@pytest.mark.parametrize("tq, tk", LENGTHS, ids=IDS)
def test_gradients_have_the_inputs_shapes_and_are_zero(tq, tk, kv_heads):
    arrays = _inputs(tq, tk, kv_heads)

    def fn(q, k, v):
        out, weights = ops.scaled_dot_product_attention(q, k, v, return_weights=True)
        if BACKEND == "torch":  # connected to the inputs: `backward` would work
            assert out.requires_grad and weights.requires_grad
        return keras.ops.sum(out) + keras.ops.sum(weights)

    grads = gradients(fn, *(cast(a, "float32") for a in arrays))
    for name, g, a in zip("qkv", grads, arrays):
        assert g.shape == a.shape and not np.any(g), (name, g.shape, BACKEND)


@pytest.mark.parametrize("tq, tk", LENGTHS, ids=IDS)
def test_the_layer_takes_empty_sequences(tq, tk):
    layer = MultiHeadAttention(num_heads=2, key_dim=4)
    x = cast(RNG.standard_normal((B, tq, 8)), "float32")
    y = cast(RNG.standard_normal((B, tk, 8)), "float32")
    out, scores = layer(x, y, return_attention_scores=True)
    assert tuple(out.shape) == (B, tq, 8) and tuple(scores.shape) == (B, 2, tq, tk)
    # no key: each query's output is the output projection's bias (zero at build)
    assert not np.any(to_np(out))


@pytest.mark.parametrize("tq, tk", LENGTHS, ids=IDS)
def test_a_compiled_call_takes_empty_sequences(tq, tk):
    jit = compiler()
    q, k, v = (cast(a, "float32") for a in _inputs(tq, tk))
    got = jit(lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, causal=True))(q, k, v)
    assert tuple(to_np(got).shape) == (B, H, tq, DV) and not np.any(to_np(got))


@pytest.mark.parametrize("shape", [(B, 3, 0), (B, 0, 3), (B, 0, 0)])
def test_masked_softmax_and_score_attention_take_empty_scores(shape):
    x = RNG.standard_normal(shape)
    lens = np.zeros((B,), "int32")
    got = ops.masked_softmax(cast(x, "float32"), keras.ops.convert_to_tensor(lens))
    want = ref.masked_softmax(x, lens)
    assert to_np(got).shape == want.shape == shape
    value = RNG.standard_normal((B, shape[2], DV))
    out, weights = ops.score_attention(
        cast(x, "float32"), cast(value, "float32"), return_weights=True
    )
    want_out, want_w = ref.attention(x, value)
    assert to_np(out).shape == want_out.shape == (B, shape[1], DV)
    assert to_np(weights).shape == want_w.shape == shape
    assert not np.any(to_np(out))

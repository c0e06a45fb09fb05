"""Additive attention bias (``bias=`` of `multiattn.ops.scaled_dot_product_attention`,
``attention_bias=`` of `multiattn.layers.MultiHeadAttention`) on every path against the
float64 oracle: shapes from hypothesis (one query, more keys than queries, length 1,
fully masked rows, every broadcast pattern of the bias), the blockwise path forced,
the fused kernel asked for, gradients (against central differences of the oracle),
cached decoding with a bias over the cache slots, and bad arguments."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _support import BACKEND, HAS_GRAD, TOL, gradients, numeric_grad, rel_err, to_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiattn import config
from multiattn import reference as ref
from multiattn.layers import MultiHeadAttention
from multiattn.ops import alibi_bias
from multiattn.ops import scaled_dot_product_attention as sdpa

DTYPE = "float32" if BACKEND == "numpy" else "float64"
PATHS = {"direct": None, "blockwise": (2, 3)}
# Fewer examples on the blockwise path, and on jax, where every new shape compiles again.
SHORT = BACKEND == "jax"
EXAMPLES = {"direct": 6 if SHORT else 12, "blockwise": 4 if SHORT else 8}


@st.composite
def cases(draw):
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    tq = draw(st.sampled_from([1, 4, 5]))  # one query; fewer queries than keys
    tk = draw(st.sampled_from([1, 6]))  # one key; more keys than queries
    full = (b, h, tq, tk)
    pattern = draw(st.lists(st.booleans(), min_size=4, max_size=4))
    rank = draw(st.integers(2, 4))
    bias_shape = tuple(d if keep else 1 for d, keep in zip(full, pattern))[4 - rank :]
    masked = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return full, bias_shape, masked, seed


def _inputs(full, bias_shape, masked, seed):
    b, h, tq, tk = full
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(b, h, tq, 4)), rng.normal(size=(b, h, tk, 4))
    v = rng.normal(size=(b, h, tk, 3))
    bias = 2.0 * rng.normal(size=bias_shape)
    mask = None
    if masked:
        mask = rng.random((b, 1, tq, tk)) < 0.6
        mask[0, 0, 0] = False  # a row with nothing to attend
    return q, k, v, bias, mask


def _t(x):
    return keras.ops.convert_to_tensor(np.asarray(x, DTYPE))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_bias_matches_oracle(path):
    @settings(max_examples=EXAMPLES[path], deadline=None,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(case=cases())
    def check(case):
        _check_against_oracle(path, case)

    check()


def _check_against_oracle(path, case):
    q, k, v, bias, mask = _inputs(*case)
    got = sdpa(_t(q), _t(k), _t(v), mask=mask, bias=_t(bias), block_size=PATHS[path])
    want, _ = ref.scaled_dot_product_attention(q, k, v, mask=mask, bias=bias)
    assert rel_err(to_np(got), want) <= TOL[DTYPE] * 10
    if mask is not None:  # the fully masked row stays exactly zero
        assert np.all(to_np(got)[0, :, 0] == 0.0)


@settings(max_examples=4 if SHORT else 8, deadline=None)
@given(case=cases(), causal=st.booleans())
def test_bias_with_causal_mask_and_returned_weights(case, causal):
    q, k, v, bias, mask = _inputs(*case)
    out, weights = sdpa(_t(q), _t(k), _t(v), mask=mask, bias=_t(bias), causal=causal,
                        return_weights=True)  # fmt: skip
    want, want_w = ref.scaled_dot_product_attention(q, k, v, mask=mask, bias=bias, causal=causal)
    assert rel_err(to_np(out), want) <= TOL[DTYPE] * 10
    assert rel_err(to_np(weights), want_w) <= TOL[DTYPE] * 10


@pytest.mark.parametrize("fused", [True, False])
def test_bias_takes_a_non_fused_path_when_the_fused_kernel_is_asked_for(fused):
    q, k, v, bias, mask = _inputs((2, 2, 4, 4), (1, 2, 4, 4), True, 3)
    q, k, v, bias = (keras.ops.convert_to_tensor(np.float32(x)) for x in (q, k, v, bias))
    with config.settings(fused_attention=fused):
        got = sdpa(q, k, v, mask=mask, bias=bias)
    q, k, v, bias = (to_np(x) for x in (q, k, v, bias))
    want, _ = ref.scaled_dot_product_attention(q, k, v, mask=mask, bias=bias)
    assert rel_err(to_np(got), want) <= 1e-5


def test_grouped_heads_take_a_per_query_head_bias():
    rng = np.random.default_rng(4)
    q, k, v = (
        rng.normal(size=(2, 4, 3, 4)),
        rng.normal(size=(2, 2, 5, 4)),
        rng.normal(size=(2, 2, 5, 4)),
    )
    bias = rng.normal(size=(4, 3, 5))
    for blocks in (None, (2, 2)):
        got = sdpa(_t(q), _t(k), _t(v), bias=_t(bias), block_size=blocks)
        want, _ = ref.scaled_dot_product_attention(q, np.repeat(k, 2, 1), np.repeat(v, 2, 1),
                                                   bias=bias)  # fmt: skip
        assert rel_err(to_np(got), want) <= TOL[DTYPE] * 10


@pytest.mark.skipif(not HAS_GRAD, reason="the numpy backend is inference only")
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("bias_shape", [(2, 2, 4, 5), (2, 1, 1, 5), (4, 5)])
def test_bias_gradient_matches_oracle_differences(path, bias_shape):
    rng = np.random.default_rng(5)
    q, k, v = (
        rng.normal(size=(2, 2, 4, 3)),
        rng.normal(size=(2, 2, 5, 3)),
        rng.normal(size=(2, 2, 5, 3)),
    )
    bias, w = rng.normal(size=bias_shape), rng.normal(size=(2, 2, 4, 3))
    mask = rng.random((2, 1, 4, 5)) < 0.7
    mask[1, 0, 2] = False

    def loss(q_, k_, v_, b_):
        out = sdpa(q_, k_, v_, mask=mask, bias=b_, causal=True, block_size=PATHS[path])
        return keras.ops.sum(out * _t(w))

    def oracle(q_, k_, v_, b_):
        out, _ = ref.scaled_dot_product_attention(q_, k_, v_, mask=mask, bias=b_, causal=True)
        return float(np.sum(out * w))

    got = gradients(loss, _t(q), _t(k), _t(v), _t(bias))
    want = numeric_grad(oracle, q, k, v, bias)
    for name, g, wnt in zip("qkvb", got, want):
        assert g.shape == wnt.shape, name
        assert rel_err(g, wnt) <= 1e-7, name


def test_bad_bias_is_refused_by_name():
    q = _t(np.zeros((2, 3, 4)))
    with pytest.raises(TypeError, match=r"`bias`.*int32"):
        sdpa(q, q, q, bias=keras.ops.zeros((3, 3), "int32"))
    with pytest.raises(TypeError, match="`bias`"):
        sdpa(q, q, q, bias="zeros")
    with pytest.raises(ValueError, match=r"`bias` of shape \(4, 3\)"):
        sdpa(q, q, q, bias=_t(np.zeros((4, 3))))
    with pytest.raises(ValueError, match="`bias` of shape"):
        sdpa(q, q, q, bias=_t(np.zeros((1, 2, 3, 3))))


# --- MultiHeadAttention -------------------------------------------------------------------


def _mha(seed=0):
    layer = MultiHeadAttention(num_heads=2, key_dim=4, dtype=DTYPE, seed=seed)
    layer.build((None, None, 6), (None, None, 6))
    rng = np.random.default_rng(seed)
    for var in layer.weights:
        var.assign(rng.normal(size=tuple(var.shape)) * 0.5)
    names = ["query_kernel", "query_bias", "key_kernel", "key_bias", "value_kernel",
             "value_bias", "output_kernel", "output_bias"]  # fmt: skip
    return layer, {n: to_np(getattr(layer, n)) for n in names}


@settings(max_examples=3 if SHORT else 6, deadline=None)
@given(tq=st.integers(1, 4), tk=st.integers(1, 6), heads_axis=st.booleans())
def test_mha_attention_bias_matches_oracle(tq, tk, heads_axis):
    layer, weights = _mha()
    rng = np.random.default_rng(tq * 10 + tk)
    x, y = rng.normal(size=(2, tq, 6)), rng.normal(size=(2, tk, 6))
    bias = rng.normal(size=(1, 2, tq, tk) if heads_axis else (2, 1, tq, tk))
    got = layer(_t(x), _t(y), attention_bias=_t(bias))
    want, _ = ref.multi_head_attention(x, y, weights=weights, attention_bias=bias)
    assert rel_err(to_np(got), want) <= TOL[DTYPE] * 10


def test_mha_cached_decoding_with_a_bias_over_the_slots_matches_one_pass():
    layer, weights = _mha(1)
    rng = np.random.default_rng(2)
    x, steps = rng.normal(size=(2, 5, 6)), 5
    bias = rng.normal(size=(1, 2, steps, steps))
    want, _ = ref.multi_head_attention(x, x, weights=weights, attention_bias=bias, causal=True)
    cache = layer.init_cache(2, steps)
    outs = []
    for t in range(steps):
        out, cache = layer(_t(x[:, t : t + 1]), cache=cache, cache_index=t,
                           attention_bias=_t(bias[:, :, t : t + 1]))  # fmt: skip
        outs.append(to_np(out))
    assert rel_err(np.concatenate(outs, axis=1), want) <= TOL[DTYPE] * 10


def test_mha_bad_attention_bias_is_refused_by_name():
    layer, _ = _mha()
    x = _t(np.zeros((2, 3, 6)))
    with pytest.raises(ValueError, match="`attention_bias` of shape"):
        layer(x, x, attention_bias=_t(np.zeros((2, 3, 3, 3))))
    with pytest.raises(TypeError, match="`attention_bias`"):
        layer(x, x, attention_bias=keras.ops.zeros((3, 3), "int32"))
    grid = MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=(1, 2), dtype=DTYPE)
    x4 = _t(np.zeros((1, 2, 3, 6)))
    with pytest.raises(ValueError, match="`attention_bias` needs"):
        grid(x4, x4, attention_bias=_t(np.zeros((1, 2, 6, 6))))
    cache = layer.init_cache(2, 4)
    with pytest.raises(ValueError, match=r"`attention_bias` of shape \(1, 2, 1, 3\)"):
        layer(x[:, :1], cache=cache, cache_index=0, attention_bias=_t(np.zeros((1, 2, 1, 3))))


# --- ALiBi ----------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [1, 2, 3, 6, 8, 12])
def test_alibi_bias_matches_oracle_and_attends_as_a_bias(heads):
    got = to_np(alibi_bias(heads, 3, 5, dtype=DTYPE))
    want = ref.alibi_bias(heads, 3, 5)
    assert got.shape == (1, heads, 3, 5) and rel_err(got, want) <= TOL[DTYPE]
    rng = np.random.default_rng(heads)
    q, k, v = (rng.normal(size=(1, heads, t, 4)) for t in (3, 5, 5))
    out = sdpa(_t(q), _t(k), _t(v), causal=True, bias=alibi_bias(heads, 3, 5, dtype=DTYPE))
    expected, _ = ref.scaled_dot_product_attention(q, k, v, causal=True, bias=want)
    assert rel_err(to_np(out), expected) <= TOL[DTYPE] * 10


def test_alibi_bias_refuses_bad_sizes():
    with pytest.raises(ValueError, match="num_heads"):
        alibi_bias(0, 3, 3)
    with pytest.raises(ValueError, match="k_len"):
        alibi_bias(2, 3, -1)

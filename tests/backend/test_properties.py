"""Hypothesis property tests: random shapes (lengths from 0), masks, valid lengths and
dtypes vs the oracle."""

import numpy as np
from _support import DTYPES, TOL, assert_close, cast, rounded, to_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiattn import ops
from multiattn import reference as ref

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@st.composite
def attention_case(draw):
    batch = draw(st.integers(1, 3))
    tq, tk = draw(st.integers(0, 6)), draw(st.integers(0, 6))  # 0: no queries, or no keys
    d, dv = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.standard_normal((batch, tq, d)),
        rng.standard_normal((batch, tk, d)),
        rng.standard_normal((batch, tk, dv)),
    )
    kwargs = {}
    kind = draw(st.sampled_from(["none", "lens1", "lens2", "mask", "mask_and_lens"]))
    if kind in ("lens1", "mask_and_lens"):
        kwargs["valid_lens"] = rng.integers(0, tk + 1, size=batch)
    if kind == "lens2":
        kwargs["valid_lens"] = rng.integers(0, tk + 1, size=(batch, tq))
    if kind in ("mask", "mask_and_lens"):
        shape = draw(st.sampled_from([(batch, tq, tk), (1, tq, tk), (batch, 1, tk), (tk,)]))
        kwargs["mask"] = rng.random(shape) > draw(st.floats(0.0, 1.0))
    kwargs["causal"] = draw(st.booleans())
    return q, k, v, dtype, kwargs


@SETTINGS
@given(case=attention_case(), return_weights=st.booleans())
def test_sdpa_matches_oracle(case, return_weights):
    q, k, v, dtype, kwargs = case
    want, want_w = ref.scaled_dot_product_attention(
        *(rounded(a, dtype) for a in (q, k, v)), **kwargs
    )
    got = ops.scaled_dot_product_attention(
        *(cast(a, dtype) for a in (q, k, v)), return_weights=return_weights, **kwargs
    )
    if return_weights:
        got, got_w = got
        assert_close(got_w, want_w, dtype)
    got = to_np(got)
    empty = ~np.any(want_w > 0, axis=-1)
    assert np.all(got[empty] == 0.0)
    assert got.shape == want.shape
    if want.size and np.abs(want).max() > 0:
        assert_close(got, want, dtype, {k: 4 * t for k, t in TOL.items()})


@SETTINGS
@given(case=attention_case())
def test_masked_softmax_rows_sum_to_one_or_zero(case):
    q, k, _, dtype, kwargs = case
    x = ref.scaled_dot_scores(q, k)
    kwargs.pop("causal")
    got = to_np(
        ops.masked_softmax(cast(x, dtype), kwargs.get("valid_lens"), mask=kwargs.get("mask"))
    )
    want = ref.masked_softmax(rounded(x, dtype), **kwargs)
    sums = got.sum(-1)
    empty = ~np.any(want > 0, axis=-1)
    assert np.all(sums[empty] == 0.0)
    assert np.allclose(sums[~empty], 1.0, atol=8 * TOL[dtype] + 1e-12)
    assert_close(got, want, dtype)

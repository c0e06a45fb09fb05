"""Tests for the float64 NumPy oracle in ``multiattn.reference``.

Expected values come from hand computation, element-by-element loops written out here with
``math``, or mathematical identities; never from output printed by the oracle itself.
"""

import math

import numpy as np
import pytest

from multiattn import reference as ref

RNG_SEED = 1234


def rng() -> np.random.Generator:
    return np.random.default_rng(RNG_SEED)


# ----------------------------------------------------------------------------- loop helpers


def loop_softmax_row(row: list[float], allowed: list[bool]) -> list[float]:
    """Softmax of one row over the allowed entries, written out with math.exp."""
    kept = [v for v, a in zip(row, allowed, strict=True) if a]
    if not kept:
        return [0.0] * len(row)
    m = max(kept)
    total = sum(math.exp(v - m) for v in kept)
    return [math.exp(v - m) / total if a else 0.0 for v, a in zip(row, allowed, strict=True)]


def loop_mha(query, value, key, w, allowed, scale=None):
    """Multi-head attention with explicit loops; allowed is a bool (B, H, Tq, Tk) array."""
    b_n, tq_n, _ = query.shape
    tk_n = value.shape[1]
    wq, wk, wv, wo = w["query_kernel"], w["key_kernel"], w["value_kernel"], w["output_kernel"]
    h_n, d_n = wq.shape[1], wq.shape[2]
    dv_n, eo_n = wv.shape[2], wo.shape[2]
    bq = w.get("query_bias", np.zeros((h_n, d_n)))
    bk = w.get("key_bias", np.zeros((h_n, d_n)))
    bv = w.get("value_bias", np.zeros((h_n, dv_n)))
    bo = w.get("output_bias", np.zeros(eo_n))
    scale = 1.0 / math.sqrt(d_n) if scale is None else scale
    out = np.zeros((b_n, tq_n, eo_n))
    attn = np.zeros((b_n, h_n, tq_n, tk_n))

    def project(x, kernel, bias, t, h, d):
        return sum(x[t, e] * kernel[e, h, d] for e in range(x.shape[1])) + bias[h, d]

    for b in range(b_n):
        for h in range(h_n):
            q = [[project(query[b], wq, bq, t, h, d) for d in range(d_n)] for t in range(tq_n)]
            k = [[project(key[b], wk, bk, t, h, d) for d in range(d_n)] for t in range(tk_n)]
            v = [[project(value[b], wv, bv, t, h, d) for d in range(dv_n)] for t in range(tk_n)]
            for i in range(tq_n):
                row = [scale * sum(q[i][d] * k[j][d] for d in range(d_n)) for j in range(tk_n)]
                p = loop_softmax_row(row, list(allowed[b, h, i]))
                attn[b, h, i] = p
                for o in range(eo_n):
                    out[b, i, o] += sum(
                        p[j] * v[j][c] * wo[h, c, o] for j in range(tk_n) for c in range(dv_n)
                    )
        out[b] += bo
    return out, attn


def loop_layer_norm(x, gamma, beta, eps):
    out = np.zeros_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = list(x[idx])
        mean = sum(row) / len(row)
        var = sum((v - mean) ** 2 for v in row) / len(row)
        out[idx] = [
            (v - mean) / math.sqrt(var + eps) * g + bt
            for v, g, bt in zip(row, gamma, beta, strict=True)
        ]
    return out


def random_mha_weights(g, eq, ek, ev, h, d, dv, eo, biases=True):
    w = {
        "query_kernel": g.normal(size=(eq, h, d)),
        "key_kernel": g.normal(size=(ek, h, d)),
        "value_kernel": g.normal(size=(ev, h, dv)),
        "output_kernel": g.normal(size=(h, dv, eo)),
    }
    if biases:
        w["query_bias"] = g.normal(size=(h, d))
        w["key_bias"] = g.normal(size=(h, d))
        w["value_bias"] = g.normal(size=(h, dv))
        w["output_bias"] = g.normal(size=(eo,))
    return w


# ----------------------------------------------------------------------------- masks


def test_version():
    assert ref.ORACLE_VERSION == "2"


def test_causal_mask_hand_cases():
    t, f = True, False
    np.testing.assert_array_equal(ref.causal_mask(3, 3), [[t, f, f], [t, t, f], [t, t, t]])
    np.testing.assert_array_equal(ref.causal_mask(2, 3), [[t, t, f], [t, t, t]])
    np.testing.assert_array_equal(ref.causal_mask(3, 2), [[f, f], [t, f], [t, t]])
    np.testing.assert_array_equal(ref.causal_mask(1, 4), [[t, t, t, t]])


@pytest.mark.parametrize(("tq", "tk"), [(4, 4), (3, 7), (6, 2), (1, 1), (5, 1)])
def test_causal_mask_matches_loop(tq, tk):
    m = ref.causal_mask(tq, tk)
    assert m.shape == (tq, tk) and m.dtype == bool
    for i in range(tq):
        for j in range(tk):
            assert m[i, j] == (j <= i + (tk - tq))
    assert m[-1].all()  # the last query sees every key
    if tq == tk:
        np.testing.assert_array_equal(m, np.tril(np.ones((tq, tk), dtype=bool)))


def test_valid_lens_mask_per_batch_broadcasts_over_heads():
    lens = np.array([2, 0, 4])
    shape = (3, 2, 5, 4)  # (batch, heads, queries, keys)
    m = ref.valid_lens_mask(lens, shape)
    full = np.broadcast_to(m, shape)
    for b, h, i, j in np.ndindex(shape):
        assert full[b, h, i, j] == (j < lens[b])


def test_valid_lens_mask_per_query():
    lens = np.array([[1, 2, 3], [3, 0, 1]])
    shape = (2, 3, 3)
    full = np.broadcast_to(ref.valid_lens_mask(lens, shape), shape)
    for b, i, j in np.ndindex(shape):
        assert full[b, i, j] == (j < lens[b, i])
    shape4 = (2, 4, 3, 3)
    full4 = np.broadcast_to(ref.valid_lens_mask(lens, shape4), shape4)
    for b, h, i, j in np.ndindex(shape4):
        assert full4[b, h, i, j] == (j < lens[b, i])


@pytest.mark.parametrize(
    ("lens", "shape", "match"),
    [
        ([1, 2], (3, 2, 4), "valid_lens"),  # wrong batch
        ([1, -1, 2], (3, 2, 4), "valid_lens"),  # negative
        ([1, 5, 2], (3, 2, 4), "valid_lens"),  # longer than keys
        ([[1, 2, 3]] * 2, (2, 2, 4), "valid_lens"),  # wrong number of queries
        ([[[1]]], (1, 1, 1), "valid_lens"),  # too many dims
        ([1.5], (1, 2, 4), "valid_lens"),  # not whole
    ],
)
def test_valid_lens_mask_errors(lens, shape, match):
    with pytest.raises(ValueError, match=match):
        ref.valid_lens_mask(np.array(lens), shape)


# ----------------------------------------------------------------------------- softmax


def test_masked_softmax_hand_values():
    x = np.log([[1.0, 2.0, 3.0]])[None]  # (1, 1, 3): softmax = [1, 2, 3] / 6
    np.testing.assert_allclose(ref.masked_softmax(x), [[[1 / 6, 2 / 6, 3 / 6]]], rtol=1e-15)
    np.testing.assert_allclose(ref.masked_softmax(x, valid_lens=[2]), [[[1 / 3, 2 / 3, 0.0]]])
    mask = np.array([True, False, True])
    np.testing.assert_allclose(ref.masked_softmax(x, mask=mask), [[[1 / 4, 0.0, 3 / 4]]])
    np.testing.assert_array_equal(ref.masked_softmax(x, valid_lens=[0]), [[[0.0, 0.0, 0.0]]])


def test_masked_softmax_matches_loop_and_rows_sum_to_one():
    g = rng()
    x = g.normal(size=(3, 2, 4, 5)) * 3
    lens = np.array([[5, 1, 3, 0], [2, 2, 4, 5], [0, 0, 1, 5]])
    mask = g.random(size=(1, 2, 4, 5)) > 0.3
    out = ref.masked_softmax(x, valid_lens=lens, mask=mask)
    assert out.dtype == np.float64 and out.shape == x.shape
    for b, h, i in np.ndindex(x.shape[:3]):
        allowed = [bool(mask[0, h, i, j]) and j < lens[b, i] for j in range(5)]
        np.testing.assert_allclose(out[b, h, i], loop_softmax_row(list(x[b, h, i]), allowed))
        expected_sum = 1.0 if any(allowed) else 0.0
        assert math.isclose(out[b, h, i].sum(), expected_sum, abs_tol=1e-12)


def test_masked_softmax_fully_masked_row_is_zero_not_nan():
    x = np.array([[[np.nan, np.inf, -np.inf], [1.0, 2.0, 3.0]]])
    mask = np.array([[False] * 3, [True] * 3])
    out = ref.masked_softmax(x, mask=mask)
    np.testing.assert_array_equal(out[0, 0], [0.0, 0.0, 0.0])
    assert np.isfinite(out).all()
    # Masked-out NaN / inf values must not leak into allowed entries.
    y = np.array([[[1.0, np.nan, 1.0]]])
    np.testing.assert_allclose(ref.masked_softmax(y, mask=[True, False, True]), [[[0.5, 0, 0.5]]])


def test_masked_softmax_is_stable_for_huge_scores():
    x = np.array([[[1000.0, 1000.0, -1000.0], [-5e5, -5e5 + math.log(3), 0.0]]])
    out = ref.masked_softmax(x, mask=np.array([[True, True, True], [True, True, False]]))
    np.testing.assert_allclose(out, [[[0.5, 0.5, 0.0], [0.25, 0.75, 0.0]]], atol=1e-12)


def test_masked_softmax_shift_and_permutation_invariance():
    g = rng()
    x = g.normal(size=(2, 3, 6))
    shift = g.normal(size=(2, 3, 1)) * 50
    np.testing.assert_allclose(ref.masked_softmax(x + shift), ref.masked_softmax(x), atol=1e-12)
    perm = g.permutation(6)
    np.testing.assert_allclose(
        ref.masked_softmax(x[..., perm]), ref.masked_softmax(x)[..., perm], atol=1e-15
    )


def test_masked_softmax_valid_lens_equals_explicit_mask():
    g = rng()
    x = g.normal(size=(3, 2, 4))
    lens = np.array([1, 4, 2])
    mask = np.zeros((3, 2, 4), dtype=bool)
    for b in range(3):
        mask[b, :, : lens[b]] = True
    np.testing.assert_array_equal(
        ref.masked_softmax(x, valid_lens=lens), ref.masked_softmax(x, mask=mask)
    )


def test_masked_softmax_other_axis_is_transpose():
    x = rng().normal(size=(4, 3))
    np.testing.assert_allclose(ref.masked_softmax(x, axis=0), ref.masked_softmax(x.T).T)
    np.testing.assert_allclose(ref.masked_softmax(x, axis=0).sum(axis=0), np.ones(3))


def test_masked_softmax_errors():
    x = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="axis"):
        ref.masked_softmax(x, valid_lens=[1, 2], axis=1)
    with pytest.raises(ValueError, match="mask"):
        ref.masked_softmax(x, mask=np.zeros((2, 3, 4)))  # float (additive) masks are rejected
    with pytest.raises(ValueError, match="mask"):
        ref.masked_softmax(x, mask=np.ones((2, 5, 4), dtype=bool))
    # 0/1 integer masks are accepted as boolean.
    np.testing.assert_array_equal(
        ref.masked_softmax(x, mask=np.array([1, 1, 0, 0])),
        ref.masked_softmax(x, mask=np.array([True, True, False, False])),
    )


# ----------------------------------------------------------------------------- scores


def test_dot_and_scaled_dot_scores_match_loops():
    g = rng()
    q, k = g.normal(size=(2, 3, 4)), g.normal(size=(2, 5, 4))
    s = ref.dot_scores(q, k)
    assert s.shape == (2, 3, 5)
    for b, i, j in np.ndindex(s.shape):
        assert math.isclose(s[b, i, j], sum(q[b, i, d] * k[b, j, d] for d in range(4)))
    np.testing.assert_allclose(ref.scaled_dot_scores(q, k), s / 2.0)  # 1/sqrt(4)
    np.testing.assert_allclose(ref.scaled_dot_scores(q, k, scale=0.3), s * 0.3)
    np.testing.assert_array_equal(
        ref.dot_scores([[1.0, 2.0]], [[3.0, 4.0], [0.0, -1.0]]), [[11, -2]]
    )
    with pytest.raises(ValueError):
        ref.dot_scores(q, g.normal(size=(2, 5, 3)))


def test_additive_scores_match_loop():
    g = rng()
    q, k = g.normal(size=(2, 3, 4)), g.normal(size=(2, 5, 6))
    w_q, w_k, w_v = g.normal(size=(4, 7)), g.normal(size=(6, 7)), g.normal(size=(7,))
    s = ref.additive_scores(q, k, w_q, w_k, w_v)
    assert s.shape == (2, 3, 5)
    for b, i, j in np.ndindex(s.shape):
        expected = 0.0
        for u in range(7):
            pre = sum(q[b, i, a] * w_q[a, u] for a in range(4))
            pre += sum(k[b, j, c] * w_k[c, u] for c in range(6))
            expected += w_v[u] * math.tanh(pre)
        assert math.isclose(s[b, i, j], expected, rel_tol=1e-12, abs_tol=1e-12)
    with pytest.raises(ValueError, match="w_k"):
        ref.additive_scores(q, k, w_q, g.normal(size=(5, 7)), w_v)


def test_additive_scores_hand_value():
    # tanh(1*1 + 2*0.5) = tanh(2), times w_v = 3.
    s = ref.additive_scores([[1.0]], [[2.0]], [[1.0]], [[0.5]], [3.0])
    assert math.isclose(s[0, 0], 3 * math.tanh(2.0))


def test_general_scores_match_loop_and_identity():
    g = rng()
    q, k, w = g.normal(size=(2, 3, 4)), g.normal(size=(2, 5, 6)), g.normal(size=(4, 6))
    s = ref.general_scores(q, k, w)
    for b, i, j in np.ndindex(s.shape):
        expected = sum(q[b, i, a] * w[a, c] * k[b, j, c] for a in range(4) for c in range(6))
        assert math.isclose(s[b, i, j], expected, rel_tol=1e-12, abs_tol=1e-12)
    k4 = g.normal(size=(2, 5, 4))
    np.testing.assert_allclose(ref.general_scores(q, k4, np.eye(4)), ref.dot_scores(q, k4))
    with pytest.raises(ValueError, match="w"):
        ref.general_scores(q, k, np.eye(4))


# ----------------------------------------------------------------------------- attention


def test_attention_uniform_scores_average_values():
    value = np.array([[[1.0, 10.0], [2.0, 20.0], [6.0, 60.0]]])
    out, w = ref.attention(np.zeros((1, 2, 3)), value, valid_lens=[2])
    np.testing.assert_allclose(w, [[[0.5, 0.5, 0.0]] * 2])
    np.testing.assert_allclose(out, [[[1.5, 15.0]] * 2])
    with pytest.raises(ValueError, match="value"):
        ref.attention(np.zeros((1, 2, 3)), np.zeros((1, 4, 2)))


def test_scaled_dot_product_attention_matches_loop():
    g = rng()
    q, k, v = g.normal(size=(2, 3, 4)), g.normal(size=(2, 5, 4)), g.normal(size=(2, 5, 2))
    out, w = ref.scaled_dot_product_attention(q, k, v, valid_lens=[3, 5])
    for b in range(2):
        for i in range(3):
            row = [sum(q[b, i, d] * k[b, j, d] for d in range(4)) / 2.0 for j in range(5)]
            p = loop_softmax_row(row, [j < [3, 5][b] for j in range(5)])
            np.testing.assert_allclose(w[b, i], p)
            for c in range(2):
                assert math.isclose(out[b, i, c], sum(p[j] * v[b, j, c] for j in range(5)))


@pytest.mark.parametrize(("tq", "tk"), [(4, 4), (2, 5), (5, 3)])
def test_causal_equals_explicit_mask(tq, tk):
    g = rng()
    q, k, v = g.normal(size=(2, tq, 3)), g.normal(size=(2, tk, 3)), g.normal(size=(2, tk, 2))
    explicit = np.array([[j <= i + tk - tq for j in range(tk)] for i in range(tq)])
    out_c, w_c = ref.scaled_dot_product_attention(q, k, v, causal=True)
    out_m, w_m = ref.scaled_dot_product_attention(q, k, v, mask=explicit)
    np.testing.assert_array_equal(w_c, w_m)
    np.testing.assert_array_equal(out_c, out_m)
    for i in range(tq):
        if i + tk - tq < 0:  # no key visible: zero weights and zero output
            assert not w_c[:, i].any() and not out_c[:, i].any()


def test_causal_combines_with_mask_and_valid_lens():
    g = rng()
    q, k, v = g.normal(size=(2, 4, 3)), g.normal(size=(2, 4, 3)), g.normal(size=(2, 4, 2))
    extra = g.random(size=(2, 4, 4)) > 0.4
    lens = np.array([3, 2])
    combined = extra & np.tril(np.ones((4, 4), dtype=bool))
    for b in range(2):
        combined[b, :, lens[b] :] = False
    _, w1 = ref.scaled_dot_product_attention(q, k, v, mask=extra, valid_lens=lens, causal=True)
    _, w2 = ref.scaled_dot_product_attention(q, k, v, mask=combined)
    np.testing.assert_array_equal(w1, w2)


def test_attention_invariant_to_joint_key_value_permutation():
    g = rng()
    q, k, v = g.normal(size=(2, 3, 4)), g.normal(size=(2, 6, 4)), g.normal(size=(2, 6, 5))
    perm = g.permutation(6)
    out, w = ref.scaled_dot_product_attention(q, k, v)
    out_p, w_p = ref.scaled_dot_product_attention(q, k[:, perm], v[:, perm])
    np.testing.assert_allclose(out_p, out, atol=1e-13)
    np.testing.assert_allclose(w_p, w[..., perm], atol=1e-15)


# ----------------------------------------------------------------------------- heads


def test_split_heads_contiguous_and_interleaved_match_loops():
    x = rng().normal(size=(2, 3, 12))
    c = ref.split_heads(x, 3)
    i = ref.split_heads(x, 3, layout="interleaved")
    assert c.shape == i.shape == (2, 3, 3, 4)
    for b, h, t, d in np.ndindex(c.shape):
        assert c[b, h, t, d] == x[b, t, h * 4 + d]
        assert i[b, h, t, d] == x[b, t, d * 3 + h]


def test_split_heads_hand_case():
    x = np.arange(6.0).reshape(1, 1, 6)
    np.testing.assert_array_equal(ref.split_heads(x, 2)[0, :, 0], [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(
        ref.split_heads(x, 2, layout="interleaved")[0, :, 0], [[0, 2, 4], [1, 3, 5]]
    )


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_merge_heads_inverts_split_heads(layout):
    g = rng()
    x = g.normal(size=(2, 5, 8))
    np.testing.assert_array_equal(ref.merge_heads(ref.split_heads(x, 4, layout), layout), x)
    y = g.normal(size=(2, 4, 5, 2))
    np.testing.assert_array_equal(ref.split_heads(ref.merge_heads(y, layout), 4, layout), y)


def test_interleaved_is_feature_permutation_of_contiguous():
    x = rng().normal(size=(2, 3, 15))
    heads, depth = 5, 3
    # contiguous position h*depth + d holds interleaved feature d*heads + h.
    perm = [d * heads + h for h in range(heads) for d in range(depth)]
    assert sorted(perm) == list(range(15))
    np.testing.assert_array_equal(
        ref.split_heads(x, heads, "interleaved"), ref.split_heads(x[..., perm], heads)
    )


def test_split_merge_errors():
    with pytest.raises(ValueError, match="divisible"):
        ref.split_heads(np.zeros((1, 2, 7)), 2)
    with pytest.raises(ValueError, match="layout"):
        ref.split_heads(np.zeros((1, 2, 8)), 2, layout="blocked")
    with pytest.raises(ValueError, match="layout"):
        ref.merge_heads(np.zeros((1, 2, 2, 2)), layout="blocked")
    with pytest.raises(ValueError, match="x"):
        ref.merge_heads(np.zeros((2, 2, 2)))


# ----------------------------------------------------------------------------- positions


@pytest.mark.parametrize("depth", [1, 6, 7])
def test_sinusoidal_encoding_matches_formula(depth):
    length, base = 9, 10000.0
    p_int = ref.sinusoidal_encoding(length, depth)
    p_cat = ref.sinusoidal_encoding(length, depth, layout="concatenated")
    n_sin = math.ceil(depth / 2)
    for t in range(length):
        for k in range(n_sin):
            w = 1.0 / base ** (2 * k / depth)
            assert math.isclose(p_int[t, 2 * k], math.sin(t * w), abs_tol=1e-15)
            assert math.isclose(p_cat[t, k], math.sin(t * w), abs_tol=1e-15)
            if 2 * k + 1 < depth:
                assert math.isclose(p_int[t, 2 * k + 1], math.cos(t * w), abs_tol=1e-15)
                assert math.isclose(p_cat[t, n_sin + k], math.cos(t * w), abs_tol=1e-15)


def test_sinusoidal_encoding_hand_values_and_permutation():
    p = ref.sinusoidal_encoding(2, 4, base=100.0)
    # omega = [1, 1/10]
    expected = [[0, 1, 0, 1], [math.sin(1), math.cos(1), math.sin(0.1), math.cos(0.1)]]
    np.testing.assert_allclose(p, expected, rtol=1e-15)
    p_int = ref.sinusoidal_encoding(5, 8)
    p_cat = ref.sinusoidal_encoding(5, 8, layout="concatenated")
    np.testing.assert_array_equal(p_cat, p_int[:, [0, 2, 4, 6, 1, 3, 5, 7]])
    with pytest.raises(ValueError, match="layout"):
        ref.sinusoidal_encoding(3, 4, layout="contiguous")


# ----------------------------------------------------------------------------- multi-head


@pytest.mark.parametrize("biases", [True, False])
def test_multi_head_attention_matches_loop(biases):
    g = rng()
    query, value = g.normal(size=(2, 3, 4)), g.normal(size=(2, 5, 6))
    key = g.normal(size=(2, 5, 3))
    w = random_mha_weights(g, 4, 3, 6, h=2, d=3, dv=2, eo=5, biases=biases)
    mask = g.random(size=(2, 3, 5)) > 0.3
    lens = np.array([4, 5])
    out, attn = ref.multi_head_attention(query, value, key, weights=w, mask=mask, valid_lens=lens)
    allowed = np.zeros((2, 2, 3, 5), dtype=bool)
    for b, h, i, j in np.ndindex(allowed.shape):
        allowed[b, h, i, j] = mask[b, i, j] and j < lens[b]
    exp_out, exp_attn = loop_mha(query, value, key, w, allowed)
    assert out.shape == (2, 3, 5) and attn.shape == (2, 2, 3, 5)
    np.testing.assert_allclose(attn, exp_attn, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out, exp_out, rtol=1e-11, atol=1e-12)


def test_multi_head_attention_causal_scale_and_key_default():
    g = rng()
    x = g.normal(size=(1, 4, 4))
    w = random_mha_weights(g, 4, 4, 4, h=2, d=2, dv=3, eo=4)
    out, attn = ref.multi_head_attention(x, x, weights=w, causal=True, scale=0.7)
    allowed = np.broadcast_to(np.tril(np.ones((4, 4), dtype=bool)), (1, 2, 4, 4))
    exp_out, exp_attn = loop_mha(x, x, x, w, allowed, scale=0.7)
    np.testing.assert_allclose(attn, exp_attn, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out, exp_out, rtol=1e-11, atol=1e-12)


def test_multi_head_attention_three_dim_mask_equals_four_dim():
    g = rng()
    x, y = g.normal(size=(2, 3, 4)), g.normal(size=(2, 5, 4))
    w = random_mha_weights(g, 4, 4, 4, h=3, d=2, dv=2, eo=4)
    mask3 = g.random(size=(2, 3, 5)) > 0.5
    mask4 = np.repeat(mask3[:, None], 3, axis=1)
    o3, a3 = ref.multi_head_attention(x, y, weights=w, mask=mask3)
    o4, a4 = ref.multi_head_attention(x, y, weights=w, mask=mask4)
    np.testing.assert_array_equal(a3, a4)
    np.testing.assert_array_equal(o3, o4)


def test_multi_head_attention_fully_masked_row_gives_output_bias():
    g = rng()
    x = g.normal(size=(2, 3, 4))
    w = random_mha_weights(g, 4, 4, 4, h=2, d=2, dv=2, eo=3)
    mask = np.ones((2, 3, 3), dtype=bool)
    mask[1, 2, :] = False
    out, attn = ref.multi_head_attention(x, x, weights=w, mask=mask)
    np.testing.assert_array_equal(attn[1, :, 2], 0.0)
    np.testing.assert_allclose(out[1, 2], w["output_bias"], rtol=0, atol=0)
    del w["output_bias"]
    out, _ = ref.multi_head_attention(x, x, weights=w, valid_lens=[3, 0])
    np.testing.assert_array_equal(out[1], 0.0)


def test_single_identity_head_reduces_to_sdpa():
    g = rng()
    q, v = g.normal(size=(2, 3, 4)), g.normal(size=(2, 5, 4))
    eye = np.eye(4)[:, None, :]  # (4, 1, 4)
    w = {
        "query_kernel": eye,
        "key_kernel": eye,
        "value_kernel": eye,
        "output_kernel": eye[:, 0][None],
    }
    out, attn = ref.multi_head_attention(q, v, weights=w, valid_lens=[2, 4])
    exp_out, exp_w = ref.scaled_dot_product_attention(q, v, v, valid_lens=[2, 4])
    np.testing.assert_allclose(out, exp_out, atol=1e-14)
    np.testing.assert_allclose(attn[:, 0], exp_w, atol=1e-15)


def test_multi_head_attention_errors():
    g = rng()
    x = g.normal(size=(2, 3, 4))
    w = random_mha_weights(g, 4, 4, 4, h=2, d=2, dv=2, eo=3)
    with pytest.raises(ValueError, match="key_kernel"):
        ref.multi_head_attention(x, x, weights={**w, "key_kernel": np.zeros((4, 2, 3))})
    with pytest.raises(ValueError, match="output_kernel"):
        ref.multi_head_attention(x, x, weights={k: a for k, a in w.items() if k != "output_kernel"})
    with pytest.raises(ValueError, match="query_bias"):
        ref.multi_head_attention(x, x, weights={**w, "query_bias": np.zeros(2)})
    with pytest.raises(ValueError, match="valid_lens"):
        ref.multi_head_attention(x, x, weights=w, valid_lens=[1, 2, 3])
    with pytest.raises(ValueError, match="value"):
        ref.multi_head_attention(x, g.normal(size=(3, 3, 4)), weights=w)


# ----------------------------------------------------------------------------- blocks


def test_layer_norm_hand_value_and_loop():
    out = ref.layer_norm([[1.0, 2.0, 3.0]], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], 0.0)
    s = math.sqrt(2.0 / 3.0)  # biased variance of [1, 2, 3] is 2/3
    np.testing.assert_allclose(out, [[-1 / s, 0.0, 1 / s]], rtol=1e-15)
    g = rng()
    x, gamma, beta = g.normal(size=(2, 3, 5)), g.normal(size=5), g.normal(size=5)
    np.testing.assert_allclose(
        ref.layer_norm(x, gamma, beta, 1e-3), loop_layer_norm(x, gamma, beta, 1e-3), rtol=1e-12
    )
    with pytest.raises(ValueError, match="gamma"):
        ref.layer_norm(x, np.ones(4), beta, 1e-6)


def test_rms_norm_hand_value_loop_and_identities():
    # [3, 4]: mean square (9 + 16) / 2 = 12.5, root 5 / sqrt(2)
    out = ref.rms_norm([[3.0, 4.0]], None, 0.0)
    np.testing.assert_allclose(out, [[3 * math.sqrt(2) / 5, 4 * math.sqrt(2) / 5]], rtol=1e-15)
    # epsilon goes under the root: [1, 1] with eps 3 -> 1 / sqrt(1 + 3) = 0.5; scale multiplies
    np.testing.assert_allclose(ref.rms_norm([1.0, 1.0], [2.0, -4.0], 3.0), [1.0, -2.0])
    g = rng()
    x, scale = g.normal(size=(2, 3, 5)) * 3 + 2, g.normal(size=5)
    loop = np.zeros_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = list(x[idx])
        rms = math.sqrt(sum(v * v for v in row) / len(row) + 1e-3)
        loop[idx] = [v / rms * s for v, s in zip(row, scale, strict=True)]
    np.testing.assert_allclose(ref.rms_norm(x, scale, 1e-3), loop, rtol=1e-12)
    plain = ref.rms_norm(x, None, 0.0)
    # unit root mean square per row, invariant to a positive rescaling of the row
    np.testing.assert_allclose(np.mean(plain**2, axis=-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(ref.rms_norm(7.5 * x, None, 0.0), plain, rtol=1e-12)
    # not layer norm: equal to it (beta 0) only on rows of mean zero
    centred = x - x.mean(axis=-1, keepdims=True)
    np.testing.assert_allclose(
        ref.rms_norm(centred, scale, 1e-3),
        ref.layer_norm(centred, scale, np.zeros(5), 1e-3),
        rtol=1e-12,
    )
    assert np.abs(plain - ref.layer_norm(x, np.ones(5), np.zeros(5), 0.0)).max() > 0.1
    np.testing.assert_array_equal(ref.rms_norm(np.zeros((2, 4)), None, 1e-6), 0.0)
    with pytest.raises(ValueError, match="scale"):
        ref.rms_norm(x, np.ones(4), 1e-6)


def test_feed_forward_activations():
    x = np.array([[1.0, -2.0]])
    w1, b1 = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]), np.array([0.0, 0.5, 0.0])
    w2, b2 = np.ones((3, 1)), np.array([10.0])
    # hidden pre-activation: [1, -1.5, -1]
    np.testing.assert_allclose(ref.feed_forward(x, w1, b1, w2, b2), [[11.0]])
    np.testing.assert_allclose(ref.feed_forward(x, w1, b1, w2, b2, "linear"), [[8.5]])
    phi = [0.5 * (1 + math.erf(v / math.sqrt(2))) for v in (1.0, -1.5, -1.0)]
    gelu = 1.0 * phi[0] - 1.5 * phi[1] - 1.0 * phi[2]
    np.testing.assert_allclose(ref.feed_forward(x, w1, b1, w2, b2, "gelu"), [[10.0 + gelu]])
    with pytest.raises(ValueError, match="activation"):
        ref.feed_forward(x, w1, b1, w2, b2, "swish")


def test_gelu_identities():
    # gelu(v) - gelu(-v) = v, and gelu(1) = Phi(1) = 0.8413447460685429...
    v = np.linspace(-4, 4, 17)[None, :]
    eye = np.eye(17)
    zero = np.zeros(17)
    g_pos = ref.feed_forward(v, eye, zero, eye, zero, "gelu")
    g_neg = ref.feed_forward(-v, eye, zero, eye, zero, "gelu")
    np.testing.assert_allclose(g_pos - g_neg, v, atol=1e-14)
    one = ref.feed_forward([[1.0]], [[1.0]], [0.0], [[1.0]], [0.0], "gelu")
    assert math.isclose(one[0, 0], 0.8413447460685429, rel_tol=1e-14)


def encoder_weights(g, d_model=4, heads=2, dff=6):
    return {
        "attention": random_mha_weights(g, d_model, d_model, d_model, heads, 2, 2, d_model),
        "ffn_w1": g.normal(size=(d_model, dff)),
        "ffn_b1": g.normal(size=dff),
        "ffn_w2": g.normal(size=(dff, d_model)),
        "ffn_b2": g.normal(size=d_model),
        "norm1_gamma": g.normal(size=d_model),
        "norm1_beta": g.normal(size=d_model),
        "norm2_gamma": g.normal(size=d_model),
        "norm2_beta": g.normal(size=d_model),
    }


def loop_ffn(x, w):
    out = np.zeros_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        hidden = [
            max(
                0.0, sum(x[idx][a] * w["ffn_w1"][a, f] for a in range(x.shape[-1])) + w["ffn_b1"][f]
            )
            for f in range(w["ffn_w1"].shape[1])
        ]
        for o in range(x.shape[-1]):
            out[idx][o] = (
                sum(hv * w["ffn_w2"][f, o] for f, hv in enumerate(hidden)) + w["ffn_b2"][o]
            )
    return out


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer_matches_loops(norm_first):
    g = rng()
    x = g.normal(size=(2, 3, 4))
    w = encoder_weights(g)
    lens = np.array([3, 2])
    eps = 1e-5
    allowed = np.zeros((2, 2, 3, 3), dtype=bool)
    for b, h, i, j in np.ndindex(allowed.shape):
        allowed[b, h, i, j] = j < lens[b]

    def mha(inp):
        return loop_mha(inp, inp, inp, w["attention"], allowed)[0]

    def ln(inp, n):
        return loop_layer_norm(inp, w[f"norm{n}_gamma"], w[f"norm{n}_beta"], eps)

    if norm_first:
        h = x + mha(ln(x, 1))
        expected = h + loop_ffn(ln(h, 2), w)
    else:
        h = ln(x + mha(x), 1)
        expected = ln(h + loop_ffn(h, w), 2)
    out = ref.transformer_encoder_layer(
        x, weights=w, num_heads=2, norm_first=norm_first, epsilon=eps, valid_lens=lens
    )
    assert out.shape == (2, 3, 4) and out.dtype == np.float64
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-11)


def test_transformer_encoder_layer_zero_sublayers():
    g = rng()
    x = g.normal(size=(2, 3, 4)).astype(np.float32)
    w = encoder_weights(g)
    w["attention"] = {k: np.zeros_like(a) for k, a in w["attention"].items()}
    w["ffn_w2"], w["ffn_b2"] = np.zeros((6, 4)), np.zeros(4)
    # Pre-LN with zero sublayers is the identity (residual stream untouched).
    pre = ref.transformer_encoder_layer(x, weights=w, num_heads=2, norm_first=True)
    np.testing.assert_array_equal(pre, x.astype(np.float64))
    # Post-LN with unit gamma and zero beta normalises every row: mean 0, variance ~1.
    for n in (1, 2):
        w[f"norm{n}_gamma"], w[f"norm{n}_beta"] = np.ones(4), np.zeros(4)
    post = ref.transformer_encoder_layer(x, weights=w, num_heads=2, epsilon=0.0)
    np.testing.assert_allclose(post.mean(axis=-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(post.var(axis=-1), 1.0, rtol=1e-12)
    with pytest.raises(ValueError, match="num_heads"):
        ref.transformer_encoder_layer(x, weights=w, num_heads=3)


# --- decoder-only building blocks ---------------------------------------------------------


def test_rotary_pairings_and_partial_rotation_hand_values():
    p = 0.7
    x = np.array([1.0, 0.0, 0.0, 0.0])[None, :]  # plane 0 turns by 1 radian per position
    half = ref.rotary_embedding(x, [p])
    np.testing.assert_allclose(half, [[np.cos(p), 0.0, np.sin(p), 0.0]], atol=1e-15)
    inter = ref.rotary_embedding(x, [p], interleaved=True)
    np.testing.assert_allclose(inter, [[np.cos(p), np.sin(p), 0.0, 0.0]], atol=1e-15)
    y = np.array([[0.0, 1.0, 5.0, -2.0]])
    part = ref.rotary_embedding(y, [p], rotary_dim=2)
    np.testing.assert_allclose(part, [[-np.sin(p), np.cos(p), 5.0, -2.0]], atol=1e-15)


def test_rotary_inverse_frequencies_hand_values():
    plain = ref.rotary_inverse_frequencies(4, 100.0)
    np.testing.assert_allclose(plain, [1.0, 0.1], rtol=1e-15)
    linear = ref.rotary_inverse_frequencies(4, 100.0, {"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(linear, [0.25, 0.025], rtol=1e-15)
    llama = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    # wavelengths 2 pi and 20 pi: against n = 32 (bands 8 and 32) the first is kept and
    # the second slowed by 8; against n = 100 (bands 25 and 100) the second is blended.
    got = ref.rotary_inverse_frequencies(
        4, 100.0, {**llama, "original_max_position_embeddings": 32}
    )
    np.testing.assert_allclose(got, [1.0, 0.1 / 8], rtol=1e-15)
    got = ref.rotary_inverse_frequencies(
        4, 100.0, {**llama, "original_max_position_embeddings": 100}
    )
    s = (100 / (20 * np.pi) - 1) / 3
    np.testing.assert_allclose(got, [1.0, (1 - s) * 0.1 / 8 + s * 0.1], rtol=1e-14)


def test_activation_hand_values():
    x = np.array([-2.0, 0.0, 1.0])
    np.testing.assert_array_equal(ref.activation(x, "relu"), [0.0, 0.0, 1.0])
    np.testing.assert_allclose(ref.activation(x, "gelu")[1:], [0.0, 0.8413447460685429])
    np.testing.assert_allclose(ref.activation(x, "silu"), x / (1 + np.exp(-x)), rtol=1e-15)
    np.testing.assert_allclose(ref.activation([1.0], "gelu_new"), [0.8411919906082768])
    with pytest.raises(ValueError, match="activation"):
        ref.activation(x, "elu")


def test_decoder_only_layer_one_token_by_hand():
    """One token attends only to itself: the attention is the value and output
    projections of the normalised token, whatever the queries and keys."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 1, 4))
    att = {
        "query_kernel": rng.standard_normal((4, 2, 2)),
        "key_kernel": rng.standard_normal((4, 1, 2)),
        "value_kernel": rng.standard_normal((4, 1, 2)),
        "output_kernel": rng.standard_normal((2, 2, 4)),
    }
    ffn = {k: rng.standard_normal(s) for k, s in (("gate_kernel", (4, 3)), ("up_kernel", (4, 3)),
                                                   ("down_kernel", (3, 4)))}  # fmt: skip
    scales = rng.standard_normal(4), rng.standard_normal(4)
    weights = {"attention": att, "ffn": ffn, "norm1_scale": scales[0], "norm2_scale": scales[1]}
    got = ref.transformer_decoder_only_layer(
        x, weights=weights, norm="rms", norm_first=True, activation_name="silu", gated=True,
        rotary_base=10.0,
    )  # fmt: skip

    def rms(v, s):
        return v / np.sqrt(np.mean(v**2) + 1e-6) * s

    v = rms(x[0, 0], scales[0]) @ att["value_kernel"][:, 0, :]  # (2,), shared by both heads
    h = x[0, 0] + np.einsum("hv,hvo->o", np.stack([v, v]), att["output_kernel"])
    n = rms(h, scales[1])
    gate = n @ ffn["gate_kernel"]
    want = h + (gate / (1 + np.exp(-gate)) * (n @ ffn["up_kernel"])) @ ffn["down_kernel"]
    np.testing.assert_allclose(got[0, 0], want, rtol=1e-12)


def test_bias_is_added_to_the_scaled_scores():
    q, k = np.zeros((1, 1, 2)), np.zeros((1, 2, 2))
    v = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    out, weights = ref.scaled_dot_product_attention(q, k, v, bias=np.array([0.0, np.log(3.0)]))
    np.testing.assert_allclose(weights, [[[0.25, 0.75]]], rtol=1e-15)
    np.testing.assert_allclose(out, [[[0.25, 0.75]]], rtol=1e-15)
    masked, _ = ref.scaled_dot_product_attention(
        q, k, v, mask=np.array([[True, False]]), bias=np.array([0.0, 100.0])
    )
    np.testing.assert_allclose(masked, [[[1.0, 0.0]]], rtol=1e-15)  # masked whatever the bias


def test_alibi_slopes_and_distances():
    two = ref.alibi_bias(2, 1, 3)  # slopes 2**-4, 2**-8; the query sits at position 2
    np.testing.assert_array_equal(
        two[0, :, 0], [[-2 / 16, -1 / 16, 0.0], [-2 / 256, -1 / 256, 0.0]]
    )
    three = ref.alibi_bias(3, 1, 2)[0, :, 0, 0]  # 2 heads' slopes, then 4 heads' first one
    np.testing.assert_array_equal(three, [-(2.0**-4), -(2.0**-8), -(2.0**-2)])

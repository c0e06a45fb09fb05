"""Masked positions have no effect, causal attention with one query, grouped heads in the
public op: `multiattn.ops.scaled_dot_product_attention` on every internal path (fused,
explicit, blockwise) against the float64 oracle."""

import keras
import numpy as np
import pytest
from _support import (
    BACKEND,
    DTYPES,
    HAS_GRAD,
    assert_close,
    cast,
    gradients,
    numeric_grad,
    rounded,
    to_np,
)

from multiattn import ops
from multiattn import reference as ref

RNG = np.random.default_rng(13)
# How each internal path is reached: the fused kernel (where the backend has one), the
# explicit path (weights returned) and the blockwise path (forced by `block_size`).
PATHS = {"fused": {}, "explicit": {"return_weights": True}, "blockwise": {"block_size": 2}}
POISONS = {"nan": np.nan, "inf": np.inf, "minus_inf": -np.inf, "huge": 1e30}
FLOATS = [d for d in DTYPES if d in ("float64", "float32")]


def _attend(q, k, v, path, **kwargs):
    """Output (and weights, None off the explicit path) as NumPy."""
    got = ops.scaled_dot_product_attention(q, k, v, **PATHS[path], **kwargs)
    out, weights = got if path == "explicit" else (got, None)
    return to_np(out), None if weights is None else to_np(weights)


def _allowed(tq, tk, batch, kwargs):
    """The oracle's allowed positions ``(batch, Tq, Tk)`` for ``kwargs``."""
    mask = kwargs.get("mask")
    if kwargs.get("causal"):
        c = ref.causal_mask(tq, tk)
        mask = c if mask is None else np.asarray(mask, bool) & c
    return np.broadcast_to(
        ref._allowed((batch, tq, tk), kwargs.get("valid_lens"), mask, 2), (batch, tq, tk)
    )


MASK_KINDS = {
    "lens": lambda tq, tk: {"valid_lens": np.array([3, 1])},
    "lens_per_query": lambda tq, tk: {"valid_lens": np.array([[2, 0, 4], [5, 1, 3]])},
    "mask": lambda tq, tk: {"mask": RNG.random((2, tq, tk)) > 0.4},
    "causal": lambda tq, tk: {"causal": True},
    "lens_and_causal": lambda tq, tk: {"valid_lens": np.array([4, 2]), "causal": True},
}


# --- causal attention with fewer queries than keys -----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tq,tk", [(1, 5), (1, 1), (2, 7), (6, 3)], ids=lambda s: str(s))
@pytest.mark.parametrize("lens", [False, True], ids=["causal", "causal_lens"])
def test_causal_attention_with_any_query_and_key_counts(dtype, path, tq, tk, lens):
    """One query (a decoding step), fewer or more queries than keys: bottom-right causal
    attention equals the oracle on every path (one query with more keys crashed before)."""
    q, k, v = (RNG.standard_normal(s) for s in ((2, tq, 8), (2, tk, 8), (2, tk, 8)))
    kwargs = {"causal": True}
    if lens:
        kwargs["valid_lens"] = np.array([tk, max(tk - 2, 0)])
    want, want_w = ref.scaled_dot_product_attention(
        *(rounded(a, dtype) for a in (q, k, v)), **kwargs
    )
    got, got_w = _attend(*(cast(a, dtype) for a in (q, k, v)), path, **kwargs)
    assert_close(got, want, dtype)
    if got_w is not None:
        assert_close(got_w, want_w, dtype)
    assert np.all(got[~np.any(want_w > 0, axis=-1)] == 0.0)


def test_layers_take_one_causal_query_against_several_keys():
    """`MultiHeadAttention` with one query over a longer key sequence and the decoder layer
    on a target of one token, both causal: the first token of a full causal pass."""
    from multiattn import layers

    x = cast(RNG.standard_normal((2, 4, 8)), "float32")
    mha = layers.MultiHeadAttention(num_heads=2, key_dim=4)
    full = to_np(mha(x, x, causal=True))
    last = to_np(mha(x[:, -1:], x, causal=True))  # bottom-right: the last query sees all
    assert_close(last, full[:, -1:], "float32")
    decoder = layers.TransformerDecoderLayer(d_model=8, num_heads=2, dff=16)
    context = cast(RNG.standard_normal((2, 3, 8)), "float32")
    assert_close(to_np(decoder(x[:, :1], context)), to_np(decoder(x, context))[:, :1], "float32")


# --- masked positions hold anything ---------------------------------------------------------


# Every mask kind and poison in float32; every dtype on padding with causal.
POISON_CASES = [
    *(
        ("float32", poison, kind, where)
        for poison in ("nan", "inf", "huge")
        for kind in MASK_KINDS
        for where in ("key", "value", "both")
    ),
    *(
        (dtype, poison, "lens_and_causal", "both")
        for dtype in DTYPES
        for poison in POISONS
        if dtype != "float32" or poison == "minus_inf"
    ),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "dtype,poison,kind,where", POISON_CASES, ids=lambda x: x if isinstance(x, str) else None
)
def test_a_position_no_row_attends_has_no_effect(dtype, path, poison, kind, where):
    """Keys and values at positions hidden from a row (padding, the future, unwritten cache
    slots) may hold NaN, infinities or 1e30: the rows that cannot see them equal the
    oracle on clean inputs, exactly zero weight there; rows that do see a NaN or an
    infinity are NaN (rows that see 1e30 get what the arithmetic gives)."""
    tq, tk = 3, 6
    q, k, v = (RNG.standard_normal(s) for s in ((2, tq, 4), (2, tk, 4), (2, tk, 4)))
    kwargs = MASK_KINDS[kind](tq, tk)
    allowed = _allowed(tq, tk, 2, kwargs)
    hidden = ~allowed.any(axis=1)  # (batch, Tk): positions no row may attend
    bad = hidden.copy()
    bad[:, -1] = True  # plus the last key: attended by some rows of some kinds
    qr, kr, vr = (rounded(a, dtype) for a in (q, k, v))
    want, want_w = ref.scaled_dot_product_attention(qr, kr, vr, **kwargs)
    kp, vp = kr.copy(), vr.copy()
    fill = POISONS[poison] if dtype not in ("float16",) or poison != "huge" else 6e4
    if where in ("key", "both"):
        kp[bad] = fill
    if where in ("value", "both"):
        vp[bad] = fill
    got, got_w = _attend(cast(qr, dtype), cast(kp, dtype), cast(vp, dtype), path, **kwargs)
    sees_bad = (allowed & bad[:, None, :]).any(axis=-1)  # (batch, Tq)
    assert_close(got[~sees_bad], want[~sees_bad], dtype)
    if got_w is not None:
        assert_close(got_w[~sees_bad], want_w[~sees_bad], dtype)
        unseen = ~allowed & ~sees_bad[..., None]
        if poison == "huge" or where == "value":  # the weights stay finite in every row
            unseen = ~allowed
        assert np.all(got_w[unseen] == 0.0)
    if poison != "huge":
        assert np.isnan(got[sees_bad]).all()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("poison", ["nan", "inf", "huge"])
def test_gradients_ignore_masked_positions(path, poison, compiled):
    """Gradients with NaN, infinities or 1e30 at the positions no row attends equal the
    oracle's gradients of the clean inputs (central differences), and are exactly 0 at
    those positions; eagerly and with the whole gradient compiled (``jax.jit``,
    ``tf.function``: there both branches of the screen's ``cond`` are in the program)."""
    if not HAS_GRAD:
        pytest.skip("the numpy backend is inference only")
    dtype = "float64"
    q, k, v, g = (RNG.standard_normal(s) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 3), (2, 3, 3)))
    lens = np.array([3, 1])
    hidden = np.arange(5)[None, :] >= lens[:, None]
    kp, vp = k.copy(), v.copy()
    kp[hidden] = vp[hidden] = POISONS[poison]

    def loss(q_, k_, v_):
        out = ops.scaled_dot_product_attention(
            q_, k_, v_, valid_lens=lens, causal=True, **PATHS[path]
        )
        out = out[0] if path == "explicit" else out
        return keras.ops.sum(out * cast(g, dtype))

    got = gradients(loss, *(cast(a, dtype) for a in (q, kp, vp)), compiled=compiled)

    def oracle(q_, k_, v_):
        return float(
            (
                ref.scaled_dot_product_attention(q_, k_, v_, valid_lens=lens, causal=True)[0] * g
            ).sum()
        )

    want = numeric_grad(oracle, q, k, v)
    for name, a, b in zip("qkv", got, want):
        assert np.all(np.isfinite(a)), f"d{name} has NaN/Inf ({BACKEND}, {path})"
        assert np.abs(a - b).max() <= 1e-7 * max(np.abs(b).max(), 1.0), f"d{name} ({path})"
    assert np.all(got[1][hidden] == 0.0) and np.all(got[2][hidden] == 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "lens"])
def test_a_nan_query_gives_a_nan_row_on_every_path(dtype, path, masked):
    """A query holding NaN gives its own row NaN and no other row anything different, on
    every path (torch's fused kernel zeroed such a row); with nothing to attend it stays
    zero."""
    q, k, v = (RNG.standard_normal(s) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 4)))
    kwargs = {"valid_lens": np.array([0, 4])} if masked else {}
    qr, kr, vr = (rounded(a, dtype) for a in (q, k, v))
    want, _ = ref.scaled_dot_product_attention(qr, kr, vr, **kwargs)
    qp = qr.copy()
    qp[:, 1, 2] = np.nan
    got, _ = _attend(cast(qp, dtype), cast(kr, dtype), cast(vr, dtype), path, **kwargs)
    assert np.isnan(got[1, 1]).all()
    if masked:
        assert np.all(got[0] == 0.0)  # batch 0 attends nothing: zeros, NaN query or not
    else:
        assert np.isnan(got[0, 1]).all()
    keep = np.ones((2, 3), bool)
    keep[:, 1] = False
    assert_close(got[keep], want[keep], dtype)


# --- grouped heads in the public op ---------------------------------------------------------

GQA_KINDS = {
    "plain": lambda: {},
    "causal": lambda: {"causal": True},
    "lens": lambda: {"valid_lens": np.array([5, 2])},
    "lens_per_query": lambda: {"valid_lens": np.array([[1, 7, 3, 0, 2], [7, 7, 6, 5, 4]])},
    "mask_per_head": lambda: {"mask": RNG.random((2, 4, 5, 7)) > 0.4},
    "mask_shared": lambda: {"mask": RNG.random((5, 7)) > 0.4, "causal": True},
}


def _grouped_oracle(q, k, v, **kwargs):
    group = q.shape[-3] // k.shape[-3]
    return ref.scaled_dot_product_attention(
        q, np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3), **kwargs
    )


# Every kind in float32; every dtype with causal lengths.
GQA_CASES = [
    *(("float32", kind) for kind in GQA_KINDS),
    *((dtype, "lens_per_query") for dtype in DTYPES if dtype != "float32"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("dtype,kind", GQA_CASES)
def test_grouped_heads_in_the_public_op(dtype, path, kv_heads, kind):
    """query ``(B, H, Tq, d)`` with key/value ``(B, H_kv, Tk, d)``, ``H_kv`` dividing ``H``:
    query head ``h`` attends key/value head ``h // (H / H_kv)``, as torch's ``enable_gqa``."""
    q, k, v = (
        RNG.standard_normal(s) for s in ((2, 4, 5, 8), (2, kv_heads, 7, 8), (2, kv_heads, 7, 6))
    )
    kwargs = GQA_KINDS[kind]()
    want, want_w = _grouped_oracle(*(rounded(a, dtype) for a in (q, k, v)), **kwargs)
    got, got_w = _attend(*(cast(a, dtype) for a in (q, k, v)), path, **kwargs)
    assert got.shape == (2, 4, 5, 6)
    assert_close(got, want, dtype)
    if got_w is not None:
        assert_close(got_w, want_w, dtype)
    assert np.all(got[~np.any(want_w > 0, axis=-1)] == 0.0)


@pytest.mark.parametrize("path", PATHS)
def test_grouped_heads_rank_3_and_5(path):
    """Rank 3 ``(H, T, d)`` (the lengths' batch axis is then the heads axis) and rank 5
    ``(B, S, H, T, d)`` (extra leading axes)."""
    dtype = "float32"
    q, k, v = (RNG.standard_normal(s) for s in ((4, 3, 8), (2, 5, 8), (2, 5, 8)))
    lens = np.array([1, 5, 0, 3])
    want, _ = _grouped_oracle(q, k, v, valid_lens=lens)
    got, _ = _attend(*(cast(a, dtype) for a in (q, k, v)), path, valid_lens=lens)
    assert_close(got, want, dtype)
    q, k, v = (RNG.standard_normal(s) for s in ((2, 3, 4, 3, 8), (2, 3, 2, 5, 8), (2, 3, 2, 5, 8)))
    want, _ = _grouped_oracle(q, k, v, causal=True)
    got, _ = _attend(*(cast(a, dtype) for a in (q, k, v)), path, causal=True)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("path", PATHS)
def test_grouped_heads_gradients_sum_over_each_group(path):
    if not HAS_GRAD:
        pytest.skip("the numpy backend is inference only")
    q, k, v, g = (
        RNG.standard_normal(s) for s in ((2, 4, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), (2, 4, 3, 3))
    )
    lens = np.array([4, 2])

    def loss(q_, k_, v_):
        out = ops.scaled_dot_product_attention(
            q_, k_, v_, valid_lens=lens, causal=True, **PATHS[path]
        )
        out = out[0] if path == "explicit" else out
        return keras.ops.sum(out * cast(g, "float64"))

    got = gradients(loss, *(cast(a, "float64") for a in (q, k, v)))
    want = numeric_grad(
        lambda *a: float((_grouped_oracle(*a, valid_lens=lens, causal=True)[0] * g).sum()), q, k, v
    )
    for name, a, b in zip("qkv", got, want):
        assert np.abs(a - b).max() <= 1e-7 * max(np.abs(b).max(), 1.0), f"d{name} ({path})"


@pytest.mark.parametrize(
    "kv_shape,match",
    [
        ((2, 3, 7, 8), "must divide"),
        ((2, 8, 7, 8), "must divide"),
        ((3, 2, 7, 8), "leading axis 0"),
    ],
    ids=["three_of_four", "more_than_query", "batch"],
)
def test_head_counts_that_do_not_divide_raise(kv_shape, match):
    q = cast(np.zeros((2, 4, 5, 8)), "float32")
    kv = cast(np.zeros(kv_shape), "float32")
    with pytest.raises(ValueError, match=match):
        ops.scaled_dot_product_attention(q, kv, kv)


def test_key_and_value_head_counts_must_agree():
    q = cast(np.zeros((2, 4, 5, 8)), "float32")
    with pytest.raises(ValueError, match="same number of heads"):
        ops.scaled_dot_product_attention(
            q, cast(np.zeros((2, 2, 7, 8)), "float32"), cast(np.zeros((2, 1, 7, 8)), "float32")
        )

"""Grouped-query attention, rotary/learned positions, the KV cache and the decoder layer.

Every number is compared with the float64 oracle (`multiattn.reference`); the cache is
also compared with one causal pass of the same layer, step by step and in chunks, eagerly
and under the backend's compiler (``jax.jit``, ``tf.function``) with a tensor index.
"""

import contextlib

import keras
import numpy as np
import pytest
from _support import BACKEND, DTYPES, LAYER_TOL, assert_close, cast, rounded, to_np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from multiattn import layers, ops
from multiattn import reference as ref
from multiattn.config import owned_caches
from multiattn.namespaces.keras import get_ops
from multiattn.ops.attention import attend

RNG = np.random.default_rng(7)
MHA_NAMES = ("query", "key", "value", "output")
# float64 where the backend has it, and float32; every dtype runs in the conformance cases.
FAST_DTYPES = tuple(dict.fromkeys((DTYPES[0], "float32")))
SETTINGS = settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def randomise(layer, scale=0.5):
    for w in layer.weights:
        if w.trainable:
            w.assign(RNG.standard_normal(tuple(w.shape)) * scale)


def mha_weights(layer) -> dict:
    out = {}
    for name in MHA_NAMES:
        out[f"{name}_kernel"] = to_np(getattr(layer, f"{name}_kernel"))
        if getattr(layer, f"{name}_bias") is not None:
            out[f"{name}_bias"] = to_np(getattr(layer, f"{name}_bias"))
    return out


def decoder_weights(layer) -> dict:
    w = {
        "self_attention": mha_weights(layer.self_attention),
        "cross_attention": mha_weights(layer.cross_attention),
        "ffn_w1": to_np(layer.ffn_1.kernel),
        "ffn_b1": to_np(layer.ffn_1.bias),
        "ffn_w2": to_np(layer.ffn_2.kernel),
        "ffn_b2": to_np(layer.ffn_2.bias),
    }
    for i in (1, 2, 3):
        norm = getattr(layer, f"norm_{i}")
        w[f"norm{i}_gamma"], w[f"norm{i}_beta"] = to_np(norm.gamma), to_np(norm.beta)
    return w


def compiled(fn):
    """``fn`` under the backend's compiler, if it has one."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


# --- grouped-query attention ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", FAST_DTYPES)
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("kind", ["weights", "self_causal"])
def test_grouped_query_attention_against_oracle(dtype, kv_heads, kind):
    """Hkv = 1 is multi-query attention: on TensorFlow the fused kernel rejects one key/value
    head, so this also checks that the core routes around it (float32 takes that path)."""
    b, tq, tk, e = 2, 5, 6, 8
    layer = layers.MultiHeadAttention(4, 4, num_key_value_heads=kv_heads, dtype=dtype)
    q = rounded(RNG.standard_normal((b, tq, e)), dtype)
    v = rounded(RNG.standard_normal((b, tk, e)), dtype)
    call, oracle = {}, {}
    if kind == "self_causal":
        v = q
        call["causal"] = oracle["causal"] = True
    else:
        call["valid_lens"] = oracle["valid_lens"] = np.array([tk, 2])
    layer.build(q.shape, v.shape)
    randomise(layer)
    assert tuple(layer.key_kernel.shape) == (e, kv_heads, 4)
    qt = cast(q, dtype)
    vt = qt if kind == "self_causal" else cast(v, dtype)
    want, want_w = ref.multi_head_attention(q, v, weights=mha_weights(layer), **oracle)
    got = layer(qt, vt, **call)  # the fused path where the backend has one (float32)
    assert_close(got, want, dtype, LAYER_TOL)
    if kind == "weights":
        got, got_w = layer(qt, vt, return_weights=True, **call)
        assert_close(got_w, want_w, dtype, LAYER_TOL)
        assert_close(got, want, dtype, LAYER_TOL)


@pytest.mark.parametrize("path", ["fused", "explicit", "blockwise"])
def test_grouped_query_paths_agree_with_fully_masked_rows(path):
    """All three paths of `attend` with 4 query heads over 1 key/value head; rows with no
    key to attend are zero on every path."""
    b, tq, tk, h, d = 2, 6, 7, 4, 3
    q = RNG.standard_normal((b, tq, h, d))
    k, v = RNG.standard_normal((b, tk, 1, d)), RNG.standard_normal((b, tk, 1, d))
    lens = np.array([[0, 2, 7, 1, 0, 5], [3, 0, 7, 7, 4, 0]])
    args = [cast(x, "float32") for x in (q, k, v)]
    kw = dict(valid_lens=keras.ops.convert_to_tensor(lens, "int32"), scale=0.5)
    if path == "explicit":
        got, _ = attend(get_ops(args[0]), *args, return_weights=True, **kw)
    else:
        blocks = (2, 3) if path == "blockwise" else None
        got = attend(get_ops(args[0]), *args, block_size=blocks, **kw)
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    want, _ = ref.scaled_dot_product_attention(
        qh, np.repeat(kh, h, 1), np.repeat(vh, h, 1), valid_lens=lens, scale=0.5
    )
    want = want.transpose(0, 2, 1, 3)
    assert_close(got, want, "float32")
    assert np.all(to_np(got)[lens == 0] == 0.0)


@pytest.mark.parametrize("path", ["fused", "explicit", "blockwise"])
@pytest.mark.parametrize("poison", [None, "masked", "attended"])
@pytest.mark.parametrize("queries", ["three", "one"])
def test_heads_first_keys_and_values_give_the_same_attention(path, poison, queries):
    """`attend` with the keys and values heads first (``kv_heads_first``, a KV cache's
    layout) computes what it computes on ``(B, T, H, D)`` on every path, grouped heads,
    a mask, and a NaN key at a masked or an attended position included (the NaN row
    rule holds on either layout), weights too on the explicit path. One query of width
    8 (two query rows per key/value head) is a decoding step, whose scores the explicit
    path takes keys first."""
    from multiattn import config

    b, tq, tk, h, kv, d = (2, 3, 6, 4, 2, 3) if queries == "three" else (2, 1, 6, 4, 2, 8)
    q = RNG.standard_normal((b, tq, h, d))
    k, v = RNG.standard_normal((b, tk, kv, d)), RNG.standard_normal((b, tk, kv, d))
    lens = np.array([4, 6])
    if poison is not None:
        k[0, 5 if poison == "masked" else 1, 1, 2] = np.nan  # row 0 attends keys 0..3
    args = [cast(x, "float32") for x in (q, k, v)]
    ns = get_ops(args[0])
    first = [ns.transpose(x, (0, 2, 1, 3)) for x in args[1:]]
    kw = dict(valid_lens=keras.ops.convert_to_tensor(lens, "int32"), scale=0.5)
    if path == "blockwise":
        kw["block_size"] = (2, 3)
    else:
        kw["return_weights"] = path == "explicit"
    with config.settings(fused_attention=path == "fused"):
        want = attend(ns, *args, **kw)
        got = attend(ns, args[0], *first, kv_heads_first=True, **kw)
    for g, w in zip(*((x,) if path != "explicit" else x for x in (got, want))):
        np.testing.assert_allclose(to_np(g), to_np(w), rtol=1e-6, atol=1e-6)
    out = to_np(got[0] if path == "explicit" else got)
    assert np.isnan(out[0]).any() == (poison == "attended")
    assert np.isfinite(out[1]).all()


@pytest.mark.parametrize("path", ["fused", "explicit"])
@pytest.mark.parametrize("query_nan", [False, True])
def test_finite_keys_and_values_skip_their_screen_with_the_same_numbers(path, query_nan):
    """``kv_finite`` (a checked cache) leaves out the screen of the keys and values: on
    finite keys and values the same outputs as with it, heads first and grouped, and the
    rows of a non-finite query are NaN still (rows that attend nothing stay 0)."""
    from multiattn import config

    b, tq, tk, h, kv, d = 2, 3, 6, 4, 2, 3
    q = RNG.standard_normal((b, tq, h, d))
    k, v = RNG.standard_normal((b, kv, tk, d)), RNG.standard_normal((b, kv, tk, d))
    if query_nan:
        q[1, 2, 0, 1] = np.nan
    args = [cast(x, "float32") for x in (q, k, v)]
    ns = get_ops(args[0])
    kw = dict(valid_lens=keras.ops.convert_to_tensor(np.array([4, 6]), "int32"), scale=0.5)
    with config.settings(fused_attention=path == "fused"):
        want = to_np(attend(ns, *args, kv_heads_first=True, **kw))
        got = to_np(attend(ns, *args, kv_heads_first=True, kv_finite=True, **kw))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.isnan(got[1, 2, 0]).all() == query_nan and np.isfinite(got[0]).all()


@st.composite
def gqa_case(draw):
    kv = draw(st.sampled_from([1, 2, 3]))
    heads = kv * draw(st.integers(1, 3))
    return (
        draw(st.integers(1, 3)),  # batch
        draw(st.integers(1, 5)),  # queries
        draw(st.integers(1, 6)),  # keys
        heads,
        kv,
        draw(st.integers(1, 4)),  # key_dim
        draw(st.booleans()),  # causal
        draw(st.integers(0, 2**31 - 1)),
    )


@SETTINGS
@given(gqa_case())
@example((1, 1, 1, 1, 1, 1, False, 0))  # one query, one key, one head of width 1
@example((2, 1, 6, 3, 1, 4, True, 1))  # one query (a decoding step), multi-query
@example((1, 5, 1, 2, 2, 1, True, 2))  # one key
def test_grouped_query_shapes_property(case):
    b, tq, tk, h, kv, d, causal, seed = case
    rng = np.random.default_rng(seed)
    layer = layers.MultiHeadAttention(h, d, num_key_value_heads=kv)
    q, v = rng.standard_normal((b, tq, 5)), rng.standard_normal((b, tk, 5))
    layer.build(q.shape, v.shape)
    for w in layer.weights:
        w.assign(rng.standard_normal(tuple(w.shape)) * 0.5)
    lens = rng.integers(0, tk + 1, size=b)
    got = layer(cast(q, "float32"), cast(v, "float32"), valid_lens=lens, causal=causal)
    q, v = rounded(q, "float32"), rounded(v, "float32")
    want, _ = ref.multi_head_attention(
        q, v, weights=mha_weights(layer), valid_lens=lens, causal=causal
    )
    assert_close(got, want, "float32", LAYER_TOL)


# --- rotary and learned positions -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 5])
def test_rotary_embedding_op_against_oracle(dtype, offset):
    x = rounded(RNG.standard_normal((2, 4, 3, 8)), dtype)
    got = ops.rotary_embedding(cast(x, dtype), offset=offset, base=500.0)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    want = ref.rotary_embedding(x.transpose(0, 2, 1, 3), offset + np.arange(4), 500.0)
    assert_close(got, want.transpose(0, 2, 1, 3), dtype)


def test_rotary_layer_tensor_offset_and_relative_positions():
    """The layer with a tensor offset equals the op with an int one (also compiled), and
    rotated query-key products depend only on the distance (checked on the oracle's side
    too: both against the same numbers)."""
    layer = layers.RotaryEmbedding(16)
    x = cast(RNG.standard_normal((1, 3, 2, 6)), "float32")
    want = to_np(ops.rotary_embedding(x, offset=4))
    got = layer(x, offset=keras.ops.convert_to_tensor(4, "int32"))
    assert_close(got, want, "float32")
    run = compiled(lambda t, i: layer(t, offset=i))
    assert_close(run(x, keras.ops.convert_to_tensor(4, "int32")), want, "float32")
    qk = RNG.standard_normal((2, 6))
    q = np.broadcast_to(qk[0], (1, 12, 1, 6))
    k = np.broadcast_to(qk[1], (1, 12, 1, 6))
    rq = to_np(layers.RotaryEmbedding(16)(cast(q, "float64" if BACKEND != "numpy" else "float32")))
    rk = to_np(layers.RotaryEmbedding(16)(cast(k, "float64" if BACKEND != "numpy" else "float32")))
    dots = (
        np.einsum("d,d->", rq[0, 7, 0], rk[0, 4, 0]),
        np.einsum("d,d->", rq[0, 3, 0], rk[0, 0, 0]),
    )
    assert abs(dots[0] - dots[1]) < 1e-5 * max(1.0, abs(dots[0]))


def test_position_embedding_offsets():
    layer = layers.PositionEmbedding(10)
    x = cast(RNG.standard_normal((2, 3, 4)), "float32")
    full = to_np(layer(x))
    table = to_np(layer.embeddings).astype(np.float32)
    x32 = to_np(x).astype(np.float32)
    np.testing.assert_array_equal(full, x32 + table[:3])  # float32 sums, exactly
    shifted = layer(x, offset=keras.ops.convert_to_tensor(6, "int32"))
    np.testing.assert_array_equal(to_np(shifted), x32 + table[6:9])
    assert_close(layer(x, offset=6), to_np(x) + table[6:9], "float32")


# --- the KV cache ----------------------------------------------------------------------------


def _mha_for_cache(kv_heads, rotary, dtype="float32", value_dim=None):
    layer = layers.MultiHeadAttention(
        4,
        4,
        value_dim=value_dim,
        num_key_value_heads=kv_heads,
        rotary_max_length=16 if rotary else None,
        dtype=dtype,
    )
    layer.build((2, None, 8), (2, None, 8))
    randomise(layer)
    return layer


@pytest.mark.parametrize("dtype", FAST_DTYPES)
@pytest.mark.parametrize(
    "kv_heads,rotary,value_dim", [(4, False, None), (2, True, None), (1, True, 6)]
)
def test_cache_step_by_step_equals_full_causal_pass(dtype, kv_heads, rotary, value_dim):
    layer = _mha_for_cache(kv_heads, rotary, dtype, value_dim)
    x = rounded(RNG.standard_normal((2, 6, 8)), dtype)
    xt = cast(x, dtype)
    want, _ = ref.multi_head_attention(
        x, x, weights=mha_weights(layer), causal=True, rotary_base=10000.0 if rotary else None
    )
    full = layer(xt, xt, causal=True)
    assert_close(full, want, dtype, LAYER_TOL)
    cache = layer.init_cache(2, 9)
    assert tuple(cache[0].shape) == (2, kv_heads, 9, 4)  # heads first
    outs = []
    for t in range(6):
        out, cache = layer(xt[:, t : t + 1], cache=cache, cache_index=t)
        outs.append(to_np(out))
    assert_close(np.concatenate(outs, 1), want, dtype, LAYER_TOL)
    # chunks of 2 and 4 tokens through a fresh cache give the same
    cache = layer.init_cache(2, 9)
    a, cache = layer(xt[:, :2], cache=cache, cache_index=0)
    b, cache = layer(xt[:, 2:], cache=cache, cache_index=2)
    assert_close(np.concatenate([to_np(a), to_np(b)], 1), want, dtype, LAYER_TOL)
    # positions never written stay zero
    assert np.all(to_np(cache[0])[:, :, 6:] == 0.0)


def test_cache_under_compilation_with_tensor_index():
    layer = _mha_for_cache(2, True)
    x = cast(RNG.standard_normal((2, 5, 8)), "float32")
    want = to_np(layer(x, x, causal=True))
    step = compiled(lambda t, c, i: layer(t, cache=c, cache_index=i))
    cache = layer.init_cache(2, 8)
    outs = []
    for t in range(5):
        out, cache = step(x[:, t : t + 1], cache, keras.ops.convert_to_tensor(t, "int32"))
        outs.append(to_np(out))
    assert_close(np.concatenate(outs, 1), want, "float32", LAYER_TOL)


@pytest.mark.parametrize("dtype", FAST_DTYPES)
@pytest.mark.parametrize("index_kind", ["int", "tensor"])
def test_owned_cache_writes_in_place_and_equal_the_copying_writes(dtype, index_kind):
    """Inside `owned_caches` (``generate``) the keys and values go into the cache itself
    (where the namespace ``writes_in_place``): the same outputs and caches, bit for bit,
    as the writes that make a new cache; outside, the cache passed in is left as it was."""
    layer = _mha_for_cache(2, True, dtype)
    x = cast(rounded(RNG.standard_normal((2, 5, 8)), dtype), dtype)

    def run(owned):
        cache = layer.init_cache(2, 7)
        given, outs = cache, []
        with owned_caches() if owned else contextlib.nullcontext():
            for start, stop in ((0, 3), (3, 4), (4, 5)):
                index = start if index_kind == "int" else keras.ops.convert_to_tensor(start)
                out, cache = layer(x[:, start:stop], cache=cache, cache_index=index)
                outs.append(to_np(out))
        return np.concatenate(outs, 1), [to_np(c) for c in cache], given, cache

    copied, copied_cache, given, _ = run(False)
    assert all(np.all(to_np(c) == 0.0) for c in given)  # the caller's cache is untouched
    written, written_cache, given, final = run(True)
    np.testing.assert_array_equal(written, copied)
    for a, b in zip(written_cache, copied_cache):
        np.testing.assert_array_equal(a, b)
    assert np.all(copied_cache[0][:, :, 5:] == 0.0) and np.any(copied_cache[0][:, :, :5] != 0.0)
    if BACKEND in ("torch", "numpy"):  # the write went into the caller's buffers
        assert all(f is g for f, g in zip(final, given))


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="no compiler: indices are eager")
@pytest.mark.parametrize("index_checked", [False, True])
@pytest.mark.parametrize(
    "batch,kv_heads", [(2, 2), (1, 1), (1, 4)], ids=["b2-kv2", "b1-kv1", "b1-kv4"]
)
def test_owned_cache_under_compilation_with_tensor_index(index_checked, batch, kv_heads):
    """The compiled step writing into caches it owns (a dynamic update slice on JAX)
    gives the full causal pass, for prompts and single tokens, with the traced index's
    range test and without it (``index_checked``, as ``generate`` runs). At batch 1 the
    write drops the cache's unit axes, and with one query row per key/value head the
    scores are taken keys first and the output projection is a single row."""
    layer = _mha_for_cache(kv_heads, True)
    x = cast(RNG.standard_normal((batch, 5, 8)), "float32")
    want = to_np(layer(x, x, causal=True))
    with owned_caches(index_checked=index_checked):
        step = compiled(lambda t, c, i: layer(t, cache=c, cache_index=i))
        out, cache = step(x[:, :2], layer.init_cache(batch, 8), keras.ops.convert_to_tensor(0))
        outs = [to_np(out)]
        for t in range(2, 5):
            out, cache = step(x[:, t : t + 1], cache, keras.ops.convert_to_tensor(t, "int32"))
            outs.append(to_np(out))
    assert_close(np.concatenate(outs, 1), want, "float32", LAYER_TOL)


@pytest.mark.parametrize("name", ["index_checked", "values_checked"])
def test_owned_caches_checks_its_arguments(name):
    with pytest.raises(TypeError, match=rf"{name}.*received 1"):
        with owned_caches(**{name: 1}):
            pass


def _decoder(norm_first, kv_heads, rotary, dtype="float32"):
    layer = layers.TransformerDecoderLayer(
        8,
        4,
        12,
        rate=0.0,
        norm_first=norm_first,
        num_key_value_heads=kv_heads,
        rotary_max_length=16 if rotary else None,
        dtype=dtype,
    )
    layer.build((2, None, 8), (2, None, 8))
    randomise(layer, 0.4)
    return layer


@pytest.mark.parametrize("dtype", FAST_DTYPES)
@pytest.mark.parametrize("norm_first,kv_heads,rotary", [(False, 4, False), (True, 2, True)])
def test_decoder_layer_against_oracle_full_and_cached(dtype, norm_first, kv_heads, rotary):
    layer = _decoder(norm_first, kv_heads, rotary, dtype)
    x = rounded(RNG.standard_normal((2, 5, 8)), dtype)
    ctx = rounded(RNG.standard_normal((2, 6, 8)), dtype)
    lens = np.array([6, 2])
    want = ref.transformer_decoder_layer(
        x,
        ctx,
        weights=decoder_weights(layer),
        norm_first=norm_first,
        context_valid_lens=lens,
        rotary_base=10000.0 if rotary else None,
    )
    xt, ct = cast(x, dtype), cast(ctx, dtype)
    assert_close(layer(xt, ct, context_valid_lens=lens), want, dtype, LAYER_TOL)
    kv = layer.precompute_context(ct)
    cache = layer.init_cache(2, 7)
    outs = []
    for t in range(5):
        out, cache = layer(
            xt[:, t : t + 1],
            context_key_value=kv,
            context_valid_lens=lens,
            cache=cache,
            cache_index=t,
        )
        outs.append(to_np(out))
    assert_close(np.concatenate(outs, 1), want, dtype, LAYER_TOL)


def test_decoder_context_mask_and_compiled_decoding():
    layer = _decoder(False, 1, True)
    x = cast(RNG.standard_normal((2, 4, 8)), "float32")
    ctx = cast(RNG.standard_normal((2, 6, 8)), "float32")
    keep = np.array([[True] * 6, [True, True, True, False, False, False]])
    want = ref.transformer_decoder_layer(
        to_np(x),
        to_np(ctx),
        weights=decoder_weights(layer),
        context_mask=keep,
        rotary_base=10000.0,
    )
    assert_close(layer(x, ctx, context_mask=keep), want, "float32", LAYER_TOL)
    kv = layer.precompute_context(ctx)
    mask = keras.ops.convert_to_tensor(keep)
    step = compiled(
        lambda t, c, i: layer(t, context_key_value=kv, context_mask=mask, cache=c, cache_index=i)
    )
    cache = layer.init_cache(2, 4)
    outs = []
    for t in range(4):
        out, cache = step(x[:, t : t + 1], cache, keras.ops.convert_to_tensor(t, "int32"))
        outs.append(to_np(out))
    assert_close(np.concatenate(outs, 1), want, "float32", LAYER_TOL)


# --- saving and configuration ------------------------------------------------------------------


def _roundtrip(tmp_path, build_layer, *inputs, **call):
    layer = build_layer()
    symbolic = [keras.Input(tuple(x.shape[1:]), dtype=str(x.dtype)) for x in inputs]
    model = keras.Model(symbolic, layer(*symbolic, **call))
    randomise(model, 0.3)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    arrays = [keras.ops.convert_to_tensor(x) for x in inputs]
    np.testing.assert_array_equal(to_np(model(arrays)), to_np(loaded(arrays)))
    inner = loaded.layers[-1]
    assert inner.get_config() == layer.get_config()
    return inner


def test_save_load_decoder_and_positions(tmp_path):
    x = RNG.standard_normal((2, 5, 8)).astype("float32")
    ctx = RNG.standard_normal((2, 6, 8)).astype("float32")
    inner = _roundtrip(
        tmp_path,
        lambda: layers.TransformerDecoderLayer(
            8, 4, 12, num_key_value_heads=2, rotary_max_length=8, norm_first=True
        ),
        x,
        ctx,
    )
    assert inner.self_attention.num_key_value_heads == 2
    _roundtrip(tmp_path, lambda: layers.PositionEmbedding(7), x)
    _roundtrip(
        tmp_path,
        lambda: layers.MultiHeadAttention(4, 2, num_key_value_heads=1, rotary_max_length=9),
        x,
        x,
    )
    rot = layers.RotaryEmbedding(12, base=100.0)
    assert layers.RotaryEmbedding.from_config(rot.get_config()).get_config() == rot.get_config()


def test_old_multi_head_attention_config_loads():
    """A config written before grouped-query and rotary options existed."""
    config = layers.MultiHeadAttention(2, 3).get_config()
    for key in ("num_key_value_heads", "rotary_max_length", "rotary_base"):
        config.pop(key)
    layer = layers.MultiHeadAttention.from_config(config)
    assert layer.kv_heads == 2 and layer.rotary is None


# --- bad input ---------------------------------------------------------------------------------


def test_bad_arguments_raise_with_names():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        layers.MultiHeadAttention(4, 2, num_key_value_heads=3)
    with pytest.raises(ValueError, match="key_dim"):
        layers.MultiHeadAttention(2, 3, rotary_max_length=8)
    with pytest.raises(ValueError, match="even"):
        ops.rotary_embedding(cast(np.zeros((1, 2, 1, 3)), "float32"))
    with pytest.raises(ValueError, match="offset"):
        ops.rotary_embedding(cast(np.zeros((1, 2, 1, 4)), "float32"), offset=-1)
    with pytest.raises(ValueError, match="max_length"):
        layers.PositionEmbedding(4)(cast(np.zeros((1, 3, 2)), "float32"), offset=2)
    layer = _mha_for_cache(2, False)
    x = cast(np.zeros((2, 1, 8)), "float32")
    cache = layer.init_cache(2, 4)
    with pytest.raises(ValueError, match="`value`"):
        layer(x, x, cache=cache, cache_index=0)
    with pytest.raises(ValueError, match="cache_index"):
        layer(x, cache=cache)
    with pytest.raises(ValueError, match="max_length=4"):
        layer(x, cache=cache, cache_index=4)
    with pytest.raises(ValueError, match="cache"):
        layer(x, cache=(cache[0][:, :, :1], cache[1]), cache_index=0)
    with pytest.raises(ValueError, match="cache_index"):
        layer(x, x, cache_index=0)
    dec = _decoder(False, 2, False)
    ctx = cast(np.zeros((2, 3, 8)), "float32")
    with pytest.raises(ValueError, match="exactly one"):
        dec(x, ctx, context_key_value=dec.precompute_context(ctx))
    with pytest.raises(ValueError, match="divisible"):
        layers.TransformerDecoderLayer(6, 4, 8)


# --- cache indices and offsets: every integer kind, eagerly checked; traced ones safe -------

INDEX_KINDS = ("int", "np.int64", "np.int32", "tensor_int32", "tensor_int64")


def as_index(value, kind):
    """``value`` as a Python int, a NumPy integer or an eager integer scalar tensor."""
    if kind == "int":
        return int(value)
    if kind.startswith("np."):
        return getattr(np, kind[3:])(value)
    return keras.ops.convert_to_tensor(np.array(value, kind.split("_")[1]))


@st.composite
def cache_case(draw):
    """A cache of ``length`` slots, ``tokens`` tokens written at ``index`` given as one of
    the integer kinds; edge shapes come first (see the examples of the test)."""
    length = draw(st.integers(1, 6))
    tokens = draw(st.integers(1, length))
    index = draw(st.integers(0, length - tokens))
    return length, tokens, index, draw(st.sampled_from(INDEX_KINDS))


@SETTINGS
@given(cache_case())
@example((1, 1, 0, "int"))  # a cache of one slot, one token
@example((5, 1, 4, "np.int64"))  # the last slot, a NumPy index
@example((5, 1, 4, "tensor_int64"))  # the last slot, an eager tensor index
@example((4, 2, 2, "tensor_int32"))  # a prompt that ends at the last slot
@example((3, 3, 0, "np.int32"))  # a prompt that fills the cache
def test_cache_index_of_every_integer_kind_matches_the_full_pass(case):
    length, tokens, index, kind = case
    layer = _mha_for_cache(2, True)
    x = rounded(RNG.standard_normal((2, index + tokens, 8)), "float32")
    xt = cast(x, "float32")
    want, _ = ref.multi_head_attention(
        x, x, weights=mha_weights(layer), causal=True, rotary_base=10000.0
    )
    want = want[:, index:]
    cache = layer.init_cache(2, length)
    if index:
        _, cache = layer(xt[:, :index], cache=cache, cache_index=0)
    got, cache = layer(xt[:, index:], cache=cache, cache_index=as_index(index, kind))
    assert_close(got, want, "float32", LAYER_TOL)
    written = np.abs(to_np(cache[0])).sum(axis=(0, 1, 3)) > 0
    assert written[: index + tokens].all() and not written[index + tokens :].any()


@pytest.mark.parametrize("kind", INDEX_KINDS)
@pytest.mark.parametrize("index,tokens", [(-1, 1), (4, 1), (3, 2), (9, 1)])
def test_cache_index_out_of_range_raises_for_every_integer_kind(kind, index, tokens):
    """A negative index or one whose tokens pass the end of the cache (length 4) raises,
    whether it is an int, a NumPy integer or an eager tensor; the decoder layer too."""
    layer = _mha_for_cache(2, False)
    x = cast(np.zeros((2, tokens, 8)), "float32")
    with pytest.raises(ValueError, match="cache_index") as info:
        layer(x, cache=layer.init_cache(2, 4), cache_index=as_index(index, kind))
    if index >= 0:
        assert "max_length=4" in str(info.value)
    dec = _decoder(False, 2, False)
    with pytest.raises(ValueError, match="cache_index"):
        dec(
            x,
            x,
            cache=dec.init_cache(2, 4),
            cache_index=as_index(index, kind),
        )


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_cache_index_past_the_rotary_table_raises(kind):
    """The cache (8 slots) is longer than the rotary table (6 positions): an index the
    cache holds but RoPE does not cover names `rotary_max_length`."""
    layer = layers.MultiHeadAttention(2, 4, rotary_max_length=6)
    layer.build((2, None, 8), (2, None, 8))
    x = cast(np.zeros((2, 1, 8)), "float32")
    cache = layer.init_cache(2, 8)
    layer(x, cache=cache, cache_index=as_index(5, kind))  # the last rotary position
    with pytest.raises(ValueError, match="rotary_max_length=6"):
        layer(x, cache=cache, cache_index=as_index(6, kind))


@pytest.mark.parametrize(
    "index,error",
    [
        (1.0, TypeError),
        (float("nan"), TypeError),
        (True, TypeError),
        (np.bool_(True), TypeError),
        ("2", TypeError),
        ("float_tensor", TypeError),
        ("vector_tensor", TypeError),
    ],
    ids=["float", "nan", "bool", "np.bool", "string", "float_tensor", "vector_tensor"],
)
def test_cache_index_of_a_wrong_type_raises_type_error(index, error):
    layer = _mha_for_cache(2, False)
    if index == "float_tensor":
        index = keras.ops.convert_to_tensor(1.0)
    elif index == "vector_tensor":
        index = keras.ops.convert_to_tensor(np.array([1, 2], "int32"))
    x = cast(np.zeros((2, 1, 8)), "float32")
    with pytest.raises(error, match="cache_index"):
        layer(x, cache=layer.init_cache(2, 4), cache_index=index)


def test_one_token_causal_full_pass():
    """A target of one token through the full causal pass (the first decoding step, or a
    decoder called on length 1) equals the oracle."""
    layer = _mha_for_cache(2, True)
    x = rounded(RNG.standard_normal((2, 1, 8)), "float32")
    want, _ = ref.multi_head_attention(
        x, x, weights=mha_weights(layer), causal=True, rotary_base=10000.0
    )
    assert_close(
        layer(cast(x, "float32"), cast(x, "float32"), causal=True), want, "float32", LAYER_TOL
    )


def test_query_longer_than_the_cache_names_query():
    layer = _mha_for_cache(2, False)
    with pytest.raises(ValueError, match="`query` holds 5 tokens"):
        layer(cast(np.zeros((2, 5, 8)), "float32"), cache=layer.init_cache(2, 4), cache_index=0)


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="no compiler: indices are eager")
@pytest.mark.parametrize("owned", [False, True], ids=["copied", "owned"])
@pytest.mark.parametrize("index", [-1, 6, 7, 8, 20])
def test_traced_cache_index_out_of_range_writes_nothing_and_returns_nan(index, owned):
    """Under jax.jit / tf.function the index has no value when the step is traced, so it
    cannot raise: out of range (negative, past the cache of 8 slots or past the rotary
    table of 6 positions), the step writes nothing and returns NaN outputs and weights;
    never a write at another slot, never a clamped index. The same inside `owned_caches`
    (the dynamic update slice)."""
    with owned_caches() if owned else contextlib.nullcontext():
        _check_out_of_range_step(index)


def _check_out_of_range_step(index):
    layer = layers.MultiHeadAttention(2, 4, rotary_max_length=6)
    layer.build((2, None, 8), (2, None, 8))
    randomise(layer)
    x = cast(RNG.standard_normal((2, 1, 8)), "float32")
    step = compiled(lambda t, c, i: layer(t, cache=c, cache_index=i, return_weights=True))
    cache = layer.init_cache(2, 8)
    _, cache = layer(x, cache=cache, cache_index=0)  # slot 0 holds a token
    before = [to_np(c) for c in cache]
    out, weights, new = step(x, cache, keras.ops.convert_to_tensor(index, "int32"))
    assert np.isnan(to_np(out)).all() and np.isnan(to_np(weights)).all()
    for old, got in zip(before, new):
        np.testing.assert_array_equal(to_np(got), old)
    # the same compiled step with an index in range is the eager step
    out, _, _ = step(x, cache, keras.ops.convert_to_tensor(5, "int32"))
    want, _, _ = layer(x, cache=cache, cache_index=5, return_weights=True)
    assert_close(out, to_np(want), "float32")


@pytest.mark.parametrize("kind", INDEX_KINDS)
@pytest.mark.parametrize("offset", [-1, 6])
def test_position_offset_out_of_range_raises_for_every_integer_kind(kind, offset):
    """RotaryEmbedding and PositionEmbedding with 8 positions and 3 tokens: offset 6 needs
    positions 6..8. Eager tensors and NumPy integers are checked as ints are (before,
    JAX clamped them silently and the other backends failed with their own errors)."""
    x = cast(np.zeros((2, 3, 2, 4)), "float32")
    with pytest.raises(ValueError, match="`offset`"):
        layers.RotaryEmbedding(8)(x, offset=as_index(offset, kind))
    with pytest.raises(ValueError, match="`offset`"):
        layers.PositionEmbedding(8)(
            cast(np.zeros((2, 3, 4)), "float32"), offset=as_index(offset, kind)
        )


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_position_offset_at_the_last_rows_matches_int(kind):
    x = cast(RNG.standard_normal((2, 3, 2, 4)), "float32")
    rot = layers.RotaryEmbedding(8)
    np.testing.assert_array_equal(to_np(rot(x, offset=as_index(5, kind))), to_np(rot(x, offset=5)))
    want = ref.rotary_embedding(to_np(x).transpose(0, 2, 1, 3), 5 + np.arange(3))
    assert_close(rot(x, offset=as_index(5, kind)), want.transpose(0, 2, 1, 3), "float32")
    pe = layers.PositionEmbedding(8)
    y = cast(RNG.standard_normal((2, 3, 4)), "float32")
    pe(y)
    table = to_np(pe.embeddings).astype(np.float32)
    got = to_np(pe(y, offset=as_index(5, kind)))
    np.testing.assert_array_equal(got, to_np(y).astype(np.float32) + table[5:8])


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="no compiler: offsets are eager")
def test_traced_position_offset_past_the_table_is_nan_not_clamped():
    """A traced offset cannot raise: rows of positions outside the table are NaN (JAX's
    dynamic slice clamped them to the last rows before), rows inside are exact."""
    x = cast(RNG.standard_normal((2, 3, 2, 4)), "float32")
    rot = layers.RotaryEmbedding(8)
    run = compiled(lambda t, i: rot(t, offset=i))
    for offset, inside in [(5, [True] * 3), (6, [True, True, False]), (-1, [False, True, True])]:
        got = to_np(run(x, keras.ops.convert_to_tensor(offset, "int32")))
        assert (~np.isnan(got).any(axis=(0, 2, 3)) == np.array(inside)).all(), offset
        assert np.isnan(got[:, ~np.array(inside)]).all()
        positions = offset + np.arange(3)
        want = ref.rotary_embedding(to_np(x).transpose(0, 2, 1, 3), positions).transpose(0, 2, 1, 3)
        assert_close(got[:, inside], want[:, inside], "float32")
    pe = layers.PositionEmbedding(4)
    y = cast(RNG.standard_normal((2, 2, 4)), "float32")
    pe(y)
    run = compiled(lambda t, i: pe(t, offset=i))
    got = to_np(run(y, keras.ops.convert_to_tensor(3, "int32")))
    assert not np.isnan(got[:, 0]).any() and np.isnan(got[:, 1]).all()


@pytest.mark.parametrize(
    "offset", [1.5, True, "1", "float_tensor", "vector_tensor"], ids=lambda o: str(o)
)
def test_position_offset_of_a_wrong_type_raises_type_error(offset):
    if offset == "float_tensor":
        offset = keras.ops.convert_to_tensor(1.0)
    elif offset == "vector_tensor":
        offset = keras.ops.convert_to_tensor(np.array([1, 2], "int32"))
    with pytest.raises(TypeError, match="`offset`"):
        layers.RotaryEmbedding(8)(cast(np.zeros((1, 2, 1, 4)), "float32"), offset=offset)
    with pytest.raises(TypeError, match="`offset`"):
        ops.rotary_embedding(cast(np.zeros((1, 2, 1, 4)), "float32"), offset=offset)


# --- cache dtypes ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int32", "int64", "bool", "uint8"])
def test_init_cache_refuses_non_float_dtypes(dtype):
    """An integer or bool cache would truncate the keys and values written into it."""
    layer = _mha_for_cache(2, False)
    with pytest.raises(TypeError, match="`dtype`"):
        layer.init_cache(2, 4, dtype=dtype)
    with pytest.raises(TypeError, match="`dtype`"):
        _decoder(False, 2, False).init_cache(2, 4, dtype=dtype)
    cache = tuple(keras.ops.zeros((2, 4, 2, 4), dtype=dtype) for _ in range(2))
    with pytest.raises(TypeError, match="`cache`"):
        layer(cast(np.zeros((2, 1, 8)), "float32"), cache=cache, cache_index=0)


def test_init_cache_names_an_unknown_dtype_and_keeps_float_ones():
    layer = _mha_for_cache(2, False)
    with pytest.raises(ValueError, match="`dtype`"):
        layer.init_cache(2, 4, dtype="nope")
    for dtype in (*FAST_DTYPES, "float16"):
        cache = layer.init_cache(2, 4, dtype=dtype)
        assert keras.backend.standardize_dtype(cache[0].dtype) == dtype


# --- rotary_embedding: NumPy input, only the rows needed ---------------------------------------


def test_rotary_embedding_takes_numpy_arrays_and_lists():
    """NumPy input is documented (it failed on torch, mixing NumPy and torch tensors)."""
    x = RNG.standard_normal((2, 3, 2, 4)).astype(np.float32)
    want = to_np(ops.rotary_embedding(cast(x, "float32"), offset=2))
    np.testing.assert_array_equal(to_np(ops.rotary_embedding(x, offset=2)), want)
    from_list = ops.rotary_embedding(x.tolist(), offset=2)  # Python floats: float64
    assert_close(from_list, want, "float32")
    got = ops.rotary_embedding(x, offset=np.int64(2))
    np.testing.assert_array_equal(to_np(got), want)
    got = ops.rotary_embedding(x, offset=keras.ops.convert_to_tensor(2))
    np.testing.assert_array_equal(to_np(got), want)


def test_rotary_embedding_huge_offset_computes_only_the_rows_needed(monkeypatch):
    """offset 10**8 for 5 tokens built the whole 10**8-row table (13 s, 5 GB); the angles
    of the 5 positions are now computed from the frequencies directly."""
    import tracemalloc

    import multiattn.ops.rotary as rotary_ops

    def whole_table(*args, **kwargs):
        raise AssertionError("rotary_embedding built a whole table")

    monkeypatch.setattr(rotary_ops, "rotary_table", whole_table)
    x = rounded(RNG.standard_normal((1, 5, 2, 8)), "float32")
    xt = cast(x, "float32")
    tracemalloc.start()
    try:
        got = ops.rotary_embedding(xt, offset=10**8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"peak NumPy/Python memory {peak} bytes"
    want = ref.rotary_embedding(x.transpose(0, 2, 1, 3), 10**8 + np.arange(5))
    assert_close(got, want.transpose(0, 2, 1, 3), "float32")


def test_rotary_layer_concrete_offset_builds_no_table():
    """The layer with a known offset computes its rows directly too: a table of 10**8
    positions is never built."""
    import tracemalloc

    layer = layers.RotaryEmbedding(10**8)
    x = rounded(RNG.standard_normal((1, 4, 1, 6)), "float32")
    tracemalloc.start()
    try:
        got = layer(cast(x, "float32"), offset=10**8 - 4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"peak NumPy/Python memory {peak} bytes"
    want = ref.rotary_embedding(x.transpose(0, 2, 1, 3), 10**8 - 4 + np.arange(4))
    assert_close(got, want.transpose(0, 2, 1, 3), "float32")


def test_rotary_layer_slices_tensor_tables_made_once(monkeypatch):
    """A known offset slices cos/sin tensors converted once per dtype (no conversion per
    call); the rows equal the ones computed directly, bit for bit, at every offset."""
    import multiattn.layers.rotary as rotary_layer

    layer = layers.RotaryEmbedding(40)
    x = cast(rounded(RNG.standard_normal((2, 3, 2, 8)), "float32"), "float32")
    first = to_np(layer(x, offset=5))
    assert len(layer._tensor_tables) == 1

    def no_angles(*args, **kwargs):
        raise AssertionError("RotaryEmbedding computed angles again")

    monkeypatch.setattr(rotary_layer, "rotary_angles", no_angles)
    for offset in (0, 5, 37):
        got = to_np(layer(x, offset=offset))
        want = to_np(ops.rotary_embedding(x, offset=offset))
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(to_np(layer(x, offset=5)), first)


def test_rotary_tables_kept_after_a_symbolic_build_hold_values():
    """A layer first called on symbolic inputs (a functional model; on torch Keras runs the
    call on ``meta``-device tensors, which hold no values) keeps no table from that call:
    the model then computes the oracle's rotation eagerly, and trains to finite numbers
    (a kept meta table once gave NaN losses)."""
    layer = layers.RotaryEmbedding(12)
    inputs = keras.Input((4, 2, 8))
    model = keras.Model(inputs, layer(inputs, offset=3))
    assert all(
        not get_ops(t).is_symbolic(t) for pair in layer._tensor_tables.values() for t in pair
    )
    x = rounded(RNG.standard_normal((2, 4, 2, 8)), "float32")
    want = ref.rotary_embedding(x.transpose(0, 2, 1, 3), 3 + np.arange(4), 10000.0)
    assert_close(model(cast(x, "float32")), want.transpose(0, 2, 1, 3), "float32")
    assert_close(layer(cast(x, "float32"), offset=3), want.transpose(0, 2, 1, 3), "float32")


@pytest.mark.skipif(BACKEND == "numpy", reason="the numpy backend does not train")
def test_decoder_with_rotary_trains_to_finite_losses():
    """A functional decoder with rotary self-attention, built symbolically and then
    trained a few steps by ``fit``, keeps finite losses and weights."""
    inputs = keras.Input((6, 16))
    block = layers.TransformerDecoderLayer(16, 2, 32, rate=0.0, rotary_max_length=6)
    model = keras.Model(inputs, block(inputs, inputs))
    model.compile(optimizer="adam", loss="mse")
    x = rounded(RNG.standard_normal((8, 6, 16)), "float32")
    history = model.fit(x, x, batch_size=4, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all(), history.history
    assert all(np.isfinite(to_np(w)).all() for w in model.weights)


@pytest.mark.parametrize("return_weights", [False, True])
def test_cached_step_attends_over_the_filled_prefix_only(monkeypatch, return_weights):
    """A known cache index attends over the ``index + tokens`` written positions only
    (the step's cost follows the positions written, not the cache length), with the
    numbers of the masked attention over every slot; the weights of unwritten slots are
    exactly 0."""
    from functools import partial

    import multiattn.layers._mha_cache as mc
    import multiattn.layers.multi_head as mh

    layer = layers.MultiHeadAttention(num_heads=4, key_dim=4, num_key_value_heads=2)
    x = cast(rounded(RNG.standard_normal((2, 6, 16)), "float32"), "float32")
    cache = layer.init_cache(2, 32)
    _, cache = layer(x[:, :4], cache=cache, cache_index=0)
    want = partial(mc.attend_cache, layer)  # the masked path, reached with a tensor index below
    seen = []
    real = mh.attend

    def spy(ops_, q, k, v, **kw):
        seen.append(shape_of_keys(k))
        return real(ops_, q, k, v, **kw)

    monkeypatch.setattr(mh, "attend", spy)
    got = layer(x[:, 4:5], cache=cache, cache_index=4, return_weights=return_weights)
    assert seen == [5], seen
    ns = get_ops(x)
    q, k, v = layer._project_self(ns, x[:, 4:5])
    q, k = layer._rotate(q, k, 4, 4)
    k_cache = mc.write(ns, cache[0], k, 4)
    v_cache = mc.write(ns, cache[1], v, 4)
    index = ns.convert_to_tensor(np.int32(4))
    masked = want(ns, q, k_cache, v_cache, index, 1, return_weights, False)
    assert seen[-1] == 32
    full = layer._output(ns, masked[0], None)
    assert_close(got[0], to_np(full), "float32")
    if return_weights:
        weights = to_np(got[1])
        assert weights.shape == (2, 4, 1, 32)
        assert (weights[..., 5:] == 0).all()
        assert_close(weights, to_np(masked[1]), "float32")


def shape_of_keys(k) -> int:
    return int(k.shape[2])  # the cache's keys reach attention heads first


def test_cache_slice_write_equals_the_select_write(monkeypatch):
    """A known index writes the new tokens by slices, never by the one-hot contraction,
    with the very bits the select write gives; the cache's gradients stay those of the
    full pass (test_cache_step_by_step_equals_full_causal_pass, conformance cache_*)."""
    import multiattn.layers._mha_cache as mc

    ns = get_ops(cast(np.zeros(1), "float32"))
    cache = cast(rounded(RNG.standard_normal((2, 2, 7, 3)), "float32"), "float32")
    for index, tokens in ((0, 1), (0, 4), (3, 2), (6, 1), (0, 7), (2, 5)):
        new = cast(rounded(RNG.standard_normal((2, tokens, 2, 3)), "float32"), "float32")
        heads_first = ns.transpose(new, (0, 2, 1, 3))
        want = to_np(mc.write_select(ns, cache, heads_first, ns.convert_to_tensor(index)))
        assert (want[:, :, index : index + tokens] == to_np(heads_first)).all()
        np.testing.assert_array_equal(to_np(mc.write(ns, cache, new, index)), want)

    def no_select(*args, **kwargs):
        raise AssertionError("a known cache index went through the select write")

    monkeypatch.setattr(mc, "write_select", no_select)
    layer = layers.MultiHeadAttention(num_heads=2, key_dim=4, num_key_value_heads=1)
    x = cast(rounded(RNG.standard_normal((1, 5, 8)), "float32"), "float32")
    cache = layer.init_cache(1, 8)
    out, cache = layer(x[:, :3], cache=cache, cache_index=0)
    out, cache = layer(x[:, 3:], cache=cache, cache_index=np.int64(3))
    assert tuple(out.shape) == (1, 2, 8)


@pytest.mark.parametrize("weights", [True, False])
def test_grouped_query_attention_repeats_no_key_value_heads(monkeypatch, weights):
    """The explicit path (and PyTorch's fused kernel, ``enable_gqa``) contract each group
    of queries with its key/value head: `repeat_kv_heads` is not called; the result is
    the oracle's with the heads repeated."""
    import multiattn.ops.attention as attention

    b, tq, tk, h, hkv, d = 2, 3, 5, 6, 2, 4
    q = RNG.standard_normal((b, tq, h, d))
    k, v = RNG.standard_normal((b, tk, hkv, d)), RNG.standard_normal((b, tk, hkv, d))
    keep = np.tril(np.ones((tq, tk), bool), tk - tq)
    args = [cast(x, "float32") for x in (q, k, v)]
    ns = get_ops(args[0])
    if not weights and ns.has_fused_attention and not ns.fused_attention_groups:
        pytest.skip(
            f"{BACKEND}'s fused kernel takes no grouped heads: where taken, they are repeated"
        )
    real = attention.repeat_kv_heads

    def no_repeat(ops, x, groups):
        if groups != 1:
            raise AssertionError("the key/value heads were repeated")
        return real(ops, x, groups)

    monkeypatch.setattr(attention, "repeat_kv_heads", no_repeat)
    got = attend(ns, *args, keep=cast(keep, "bool"), scale=0.5, return_weights=weights)
    got = got[0] if weights else got
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    g = h // hkv
    want, _ = ref.scaled_dot_product_attention(
        qh, np.repeat(kh, g, 1), np.repeat(vh, g, 1), mask=keep, scale=0.5
    )
    assert_close(got, want.transpose(0, 2, 1, 3), "float32")

"""Grouped-query attention, rotary/learned positions, the KV cache and the decoder layer.

Every number is compared with the float64 oracle (`multiattn.reference`); the cache is
also compared with one causal pass of the same layer, step by step and in chunks, eagerly
and under the backend's compiler (``jax.jit``, ``tf.function``) with a tensor index.
"""

import keras
import numpy as np
import pytest
from _support import BACKEND, DTYPES, LAYER_TOL, assert_close, cast, rounded, to_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiattn import layers, ops
from multiattn import reference as ref
from multiattn._namespace import get_ops
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
    assert tuple(cache[0].shape) == (2, 9, kv_heads, 4)
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
    assert np.all(to_np(cache[0])[:, 6:] == 0.0)


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

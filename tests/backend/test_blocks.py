"""Building blocks of decoder-only language models: rotary variants (interleaved pairs,
partial rotation, linear and Llama 3 frequency scaling), activations, the plain and gated
feed-forward network and the decoder-only block with its key/value cache.

Every number is compared with the float64 oracle (`multiattn.reference`); the cached
block is also compared with one full causal pass, eagerly and under the backend's
compiler (``jax.jit``, ``tf.function``) with a tensor cache index.
"""

import keras
import numpy as np
import pytest
from _support import (
    BACKEND,
    DTYPES,
    LAYER_TOL,
    TOL,
    assert_close,
    cast,
    gradients,
    rounded,
    to_np,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from multiattn import layers, ops
from multiattn import reference as ref

RNG = np.random.default_rng(11)
FAST_DTYPES = tuple(dict.fromkeys((DTYPES[0], "float32")))
SETTINGS = settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
LINEAR = {"rope_type": "linear", "factor": 4.0}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
SCALINGS = {"none": None, "linear": LINEAR, "llama3": LLAMA3}
# float32 bound of a whole block (two projections, a normalisation and an activation past
# the attention): LAYER_TOL's float32 bound is the attention's.
BLOCK_TOL = {**LAYER_TOL, "float32": 2e-6}


def compiled(fn):
    """``fn`` under the backend's compiler, if it has one."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


def randomise(layer, scale=0.4):
    for w in layer.weights:
        if w.trainable:
            w.assign(RNG.standard_normal(tuple(w.shape)) * scale)


def heads_first(x):
    return np.asarray(x).transpose(0, 2, 1, 3)


# --- rotary variants ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FAST_DTYPES)
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("rotary_dim", [None, 4])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_variants_op_against_oracle(dtype, scaling, rotary_dim, interleaved):
    x = rounded(RNG.standard_normal((2, 5, 3, 10 if rotary_dim else 8)), dtype)
    kw = dict(rotary_dim=rotary_dim, interleaved=interleaved, scaling=SCALINGS[scaling])
    got = ops.rotary_embedding(cast(x, dtype), offset=40, base=50.0, **kw)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    want = ref.rotary_embedding(heads_first(x), 40 + np.arange(5), 50.0, **kw)
    assert_close(got, heads_first(want), dtype)
    if rotary_dim:  # the features past rotary_dim are copied, bit for bit
        np.testing.assert_array_equal(to_np(got)[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("dtype", FAST_DTYPES)
@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_per_plane_scaling_op_against_oracle(dtype, rotary_dim):
    """Phi-3's longrope short factors: one divisor per plane and the tables' gain; the
    same divisor on every plane with gain 1 is the linear scaling."""
    width = rotary_dim or 8
    factors = list(1.0 + np.arange(width // 2) * 0.75)
    scaling = {"rope_type": "per_plane", "factors": factors, "attention_factor": 1.25}
    x = rounded(RNG.standard_normal((2, 5, 3, 10 if rotary_dim else 8)), dtype)
    kw = dict(rotary_dim=rotary_dim, scaling=scaling)
    got = ops.rotary_embedding(cast(x, dtype), offset=40, base=50.0, **kw)
    want = ref.rotary_embedding(heads_first(x), 40 + np.arange(5), 50.0, **kw)
    assert_close(got, heads_first(want), dtype)
    flat = {"rope_type": "per_plane", "factors": [4.0] * (width // 2), "attention_factor": 1.0}
    assert_close(ops.rotary_embedding(cast(x, dtype), offset=3, rotary_dim=rotary_dim,
                                      scaling=flat),
                 to_np(ops.rotary_embedding(cast(x, dtype), offset=3, rotary_dim=rotary_dim,
                                            scaling=LINEAR)), dtype)  # fmt: skip
    with pytest.raises(ValueError, match="factors"):
        layers.MultiHeadAttention(2, width, rotary_max_length=8, rotary_scaling={
            **scaling, "factors": [*factors, 1.0]})  # fmt: skip


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("rotary_dim,interleaved", [(None, True), (6, False), (6, True)])
def test_rotary_layer_variants_match_the_op_with_tensor_offsets(scaling, rotary_dim, interleaved):
    kw = dict(rotary_dim=rotary_dim, interleaved=interleaved, scaling=SCALINGS[scaling])
    layer = layers.RotaryEmbedding(32, base=80.0, **kw)
    x = cast(RNG.standard_normal((2, 3, 2, 8)), "float32")
    want = heads_first(ref.rotary_embedding(heads_first(to_np(x)), 7 + np.arange(3), 80.0, **kw))
    assert_close(layer(x, offset=7), want, "float32")
    index = keras.ops.convert_to_tensor(7, "int32")
    assert_close(layer(x, offset=index), want, "float32")
    assert_close(compiled(lambda t, i: layer(t, offset=i))(x, index), want, "float32")


def test_interleaved_rotation_is_the_half_split_one_of_permuted_features():
    """Rotating pairs (2i, 2i + 1) equals rotating pairs (i, i + D/2) of the features
    reordered evens-then-odds, and reordering back."""
    x = cast(RNG.standard_normal((1, 4, 2, 8)), "float32")
    order = np.r_[0:8:2, 1:8:2]
    inverse = np.argsort(order)
    inter = to_np(ops.rotary_embedding(x, offset=3, interleaved=True))
    half = to_np(ops.rotary_embedding(cast(to_np(x)[..., order], "float32"), offset=3))
    np.testing.assert_allclose(inter, half[..., inverse], rtol=0, atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_variant_gradients_are_the_inverse_rotation(interleaved):
    """The rotation is linear and orthogonal: the gradient of ``sum(r * rotate(x))`` is
    ``r`` rotated back (the oracle's rotation at the negated positions)."""
    dtype = DTYPES[0]
    kw = dict(rotary_dim=4, interleaved=interleaved, scaling=LLAMA3)
    x = RNG.standard_normal((1, 3, 2, 6))
    r = RNG.standard_normal((1, 3, 2, 6))
    rt = cast(r, dtype)
    (got,) = gradients(
        lambda t: keras.ops.sum(ops.rotary_embedding(t, offset=5, **kw) * rt), cast(x, dtype)
    )
    want = ref.rotary_embedding(heads_first(r), -(5 + np.arange(3)), **kw)
    assert_close(got, heads_first(want), dtype)


def test_rotary_scaling_hand_values():
    """Linear scaling by 4 rotates position 8 as the unscaled rotation rotates position 2;
    llama3 keeps the fastest plane, divides the slowest by ``factor`` and blends the band
    between (the oracle's numbers, by hand)."""
    x = cast(RNG.standard_normal((1, 1, 1, 8)), "float32")
    scaled = ops.rotary_embedding(x, offset=8, scaling=LINEAR)
    assert_close(scaled, to_np(ops.rotary_embedding(x, offset=2)), "float32")
    plain = ref.rotary_inverse_frequencies(16, 10000.0)
    speeds = ref.rotary_inverse_frequencies(16, 10000.0, LLAMA3)
    wavelengths = 2 * np.pi / plain  # 6.3 .. 19000 against 64/4 = 16 and 64/1 = 64
    assert speeds[0] == plain[0] and wavelengths[0] < 16
    assert speeds[-1] == plain[-1] / 8 and wavelengths[-1] > 64
    inside = (wavelengths >= 16) & (wavelengths <= 64)
    assert inside.any()
    assert np.all((speeds[inside] < plain[inside]) & (speeds[inside] > plain[inside] / 8))
    want = ops.rotary_frequencies(16, 10000.0, LLAMA3)
    np.testing.assert_allclose(want, speeds, rtol=1e-15)


@pytest.mark.skipif(BACKEND != "torch", reason="transformers runs on torch")
@pytest.mark.parametrize("scaling", ["linear", "llama3"])
def test_rotary_scaling_oracle_agrees_with_transformers(scaling):
    """The oracle's frequencies against transformers' own (computed in float32 there)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**SCALINGS[scaling], "rope_theta": 500000.0}
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=params)
    theirs, attention_factor = ROPE_INIT_FUNCTIONS[scaling](config, "cpu")
    assert attention_factor == 1.0
    ours = ref.rotary_inverse_frequencies(128, 500000.0, SCALINGS[scaling])
    assert_close(theirs.double().numpy(), ours, "float32")


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"rotary_dim": 3}, "rotary_dim"),
        ({"rotary_dim": 10}, "rotary_dim"),
        ({"interleaved": 1}, "interleaved"),
        ({"scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
        ({"scaling": {"rope_type": "linear"}}, "factor"),
        ({"scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_theta"),
        ({"scaling": {"rope_type": "linear", "factor": 0.5}}, "factor"),
        ({"scaling": {**LLAMA3, "high_freq_factor": 0.5}}, "high_freq_factor"),
        ({"scaling": {**LLAMA3, "original_max_position_embeddings": 0}}, "original_max"),
        ({"scaling": "linear"}, "scaling"),
    ],
)
def test_rotary_bad_options_raise_naming_them(kwargs, name):
    x = cast(np.zeros((1, 2, 1, 8)), "float32")
    with pytest.raises((ValueError, TypeError), match=name):
        ops.rotary_embedding(x, **kwargs)
    if "rotary_dim" not in kwargs or kwargs["rotary_dim"] % 2:
        with pytest.raises((ValueError, TypeError), match=name):
            layers.RotaryEmbedding(8, **kwargs)
    renamed = {f"rotary_{k}" if k != "rotary_dim" else k: v for k, v in kwargs.items()}
    with pytest.raises((ValueError, TypeError), match=name):
        layers.MultiHeadAttention(2, 8, rotary_max_length=8, **renamed)


def test_rotary_defaults_unchanged_and_type_alias_accepted():
    x = cast(RNG.standard_normal((1, 3, 2, 8)), "float32")
    want = heads_first(ref.rotary_embedding(heads_first(to_np(x)), np.arange(3)))
    assert_close(ops.rotary_embedding(x), want, "float32")
    assert_close(ops.rotary_embedding(x, scaling={"rope_type": "default"}), want, "float32")
    old = ops.rotary_embedding(x, scaling={"type": "linear", "factor": 4.0})
    new = ops.rotary_embedding(x, scaling=LINEAR)
    np.testing.assert_array_equal(to_np(old), to_np(new))
    config = layers.MultiHeadAttention(2, 4).get_config()
    assert config["rotary_dim"] is None and config["rotary_scaling"] is None
    assert config["rotary_interleaved"] is False


# --- activations and the feed-forward network --------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ops.ACTIVATIONS))
def test_activation_against_oracle(name, dtype):
    x = rounded(np.r_[RNG.standard_normal(40) * 3, -30.0, -8.0, 0.0, 8.0, 30.0], dtype)
    got = ops.activation(cast(x, dtype), name)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    assert_close(got, ref.activation(x, name), dtype, {**TOL, "float32": 2e-6})


def test_activation_names_differ_as_documented():
    x = np.linspace(-3, 3, 13)
    exact, approx = ref.activation(x, "gelu"), ref.activation(x, "gelu_new")
    assert 1e-5 < np.abs(exact - approx).max() < 1e-2
    with pytest.raises(ValueError, match="name"):
        ops.activation(cast(x, "float32"), "gelu_fast")
    with pytest.raises(TypeError, match="x"):
        ops.activation(keras.ops.convert_to_tensor(np.arange(3)), "relu")


def ffn_weights(layer) -> dict:
    out = {}
    for name in ("gate", "up", "down"):
        dense = getattr(layer, name)
        if dense is None:
            continue
        out[f"{name}_kernel"] = to_np(dense.kernel)
        if dense.bias is not None:
            out[f"{name}_bias"] = to_np(dense.bias)
    return out


@pytest.mark.parametrize("dtype", FAST_DTYPES)
@pytest.mark.parametrize(
    "activation,gated,use_bias",
    [("relu", False, True), ("gelu_new", False, True), ("silu", True, False), ("gelu", True, True)],
)
def test_feed_forward_against_oracle(dtype, activation, gated, use_bias):
    layer = layers.FeedForward(12, activation, gated=gated, use_bias=use_bias, dtype=dtype)
    layer.build((2, None, 6))
    randomise(layer)
    names = [w.path.split("/", 1)[1] for w in layer.weights]
    want_names = (["gate/kernel"] if gated else []) + ["up/kernel"]
    want_names += ["down/kernel"]
    if use_bias:
        want_names = [n for k in want_names for n in (k, k.replace("kernel", "bias"))]
    assert sorted(names) == sorted(want_names)
    x = rounded(RNG.standard_normal((2, 5, 6)), dtype)
    want = ref.gated_feed_forward(x, ffn_weights(layer), activation, gated)
    assert_close(layer(cast(x, dtype)), want, dtype, BLOCK_TOL)


def test_feed_forward_output_dim_any_rank_and_bad_arguments():
    layer = layers.FeedForward(5, "gelu_tanh", output_dim=3)
    x = cast(RNG.standard_normal((2, 3, 4, 7)), "float32")
    y = layer(x)
    assert tuple(y.shape) == (2, 3, 4, 3)
    want = ref.gated_feed_forward(to_np(x), ffn_weights(layer), "gelu_tanh", False)
    assert_close(y, want, "float32", BLOCK_TOL)
    with pytest.raises(ValueError, match="width 7"):
        layer(cast(np.zeros((1, 2, 6)), "float32"))
    with pytest.raises(ValueError, match="hidden_dim"):
        layers.FeedForward(0)
    with pytest.raises(ValueError, match="activation"):
        layers.FeedForward(4, "tanh")
    with pytest.raises(TypeError, match="gated"):
        layers.FeedForward(4, gated="yes")
    with pytest.raises(ValueError, match="output_dim"):
        layers.FeedForward(4, output_dim=-1)


# --- the decoder-only block ---------------------------------------------------------------------

# Families of checkpoints, as block options (small sizes).
FAMILIES = {
    "gpt2": dict(norm="layer", norm_first=True, activation="gelu_new"),
    "llama": dict(
        norm="rms",
        norm_first=True,
        activation="silu",
        gated=True,
        num_key_value_heads=2,
        attention_bias=False,
        output_bias=False,
        ffn_bias=False,
        rotary_max_length=16,
        rotary_base=500.0,
        rotary_scaling={**LLAMA3, "original_max_position_embeddings": 8},
    ),
    "qwen2": dict(
        norm="rms",
        norm_first=True,
        activation="silu",
        gated=True,
        num_key_value_heads=1,
        output_bias=False,
        ffn_bias=False,
        rotary_max_length=16,
    ),
    "mistral": dict(
        norm="rms",
        norm_first=True,
        activation="silu",
        gated=True,
        num_key_value_heads=2,
        attention_bias=False,
        output_bias=False,
        ffn_bias=False,
        rotary_max_length=16,
        sliding_window=3,
    ),
    "neox": dict(
        norm="layer",
        norm_first=True,
        activation="gelu",
        rotary_max_length=16,
        rotary_dim=2,
        rotary_interleaved=True,
        head_dim=6,
    ),
    "post_norm": dict(norm="layer", activation="relu", rotary_max_length=16, num_key_value_heads=4),
}


def block_weights(layer) -> dict:
    att = layer.self_attention
    w = {"attention": {}, "ffn": ffn_weights(layer.ffn)}
    for name in ("query", "key", "value", "output"):
        w["attention"][f"{name}_kernel"] = to_np(getattr(att, f"{name}_kernel"))
        bias = getattr(att, f"{name}_bias")
        if bias is not None:
            w["attention"][f"{name}_bias"] = to_np(bias)
    for i in (1, 2):
        norm = getattr(layer, f"norm_{i}")
        if layer.norm == "rms":
            w[f"norm{i}_scale"] = to_np(norm.scale)
        else:
            w[f"norm{i}_gamma"], w[f"norm{i}_beta"] = to_np(norm.gamma), to_np(norm.beta)
    return w


def block_oracle(layer, x, mask=None):
    base = layer.rotary_base if layer.rotary_max_length else None
    return ref.transformer_decoder_only_layer(
        x,
        weights=block_weights(layer),
        norm=layer.norm,
        norm_first=layer.norm_first,
        epsilon=layer.epsilon,
        activation_name=layer.activation,
        gated=layer.gated,
        rotary_base=base,
        rotary_dim=layer.rotary_dim,
        rotary_interleaved=layer.rotary_interleaved,
        rotary_scaling=layer.rotary_scaling,
        sliding_window=layer.sliding_window,
        mask=mask,
    )


def make_block(family, dtype="float32", heads=4, **extra):
    layer = layers.TransformerDecoderOnlyLayer(
        8, heads, 12, rate=0.0, dtype=dtype, **{**FAMILIES[family], **extra}
    )
    layer.build((None, None, 8))
    randomise(layer)
    return layer


def decode(layer, x, steps, cache_length, index=lambda i: i):
    """``x`` through the cache in chunks of the given sizes; the outputs joined."""
    cache = layer.init_cache(x.shape[0], cache_length)
    outs, start = [], 0
    for size in steps:
        out, cache = layer(x[:, start : start + size], cache=cache, cache_index=index(start))
        outs.append(to_np(out))
        start += size
    return np.concatenate(outs, 1), cache


@pytest.mark.parametrize("dtype", FAST_DTYPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoder_only_block_against_oracle_full_and_cached(family, dtype):
    layer = make_block(family, dtype)
    x = rounded(RNG.standard_normal((2, 6, 8)), dtype)
    want = block_oracle(layer, x)
    xt = cast(x, dtype)
    assert_close(layer(xt), want, dtype, BLOCK_TOL)
    by_token, cache = decode(layer, xt, [1] * 6, 8)
    assert_close(by_token, want, dtype, BLOCK_TOL)
    assert np.all(to_np(cache[0])[:, :, 6:] == 0.0)
    by_chunk, _ = decode(layer, xt, [2, 3, 1], 6)
    assert_close(by_chunk, want, dtype, BLOCK_TOL)


def test_sliding_window_changes_the_output_and_ignores_far_tokens():
    """With a window of 3, changing token 0 leaves the outputs at positions >= 3 alone
    (one block: nothing carries it further), in the full pass and through the cache."""
    layer = make_block("mistral")
    x = RNG.standard_normal((1, 6, 8))
    y = x.copy()
    y[:, 0] += 1.0
    full_x, full_y = to_np(layer(cast(x, "float32"))), to_np(layer(cast(y, "float32")))
    assert np.abs(full_x[:, :3] - full_y[:, :3]).max() > 1e-3
    np.testing.assert_array_equal(full_x[:, 3:], full_y[:, 3:])
    cached_y, _ = decode(layer, cast(y, "float32"), [1] * 6, 6)
    np.testing.assert_allclose(cached_y[:, 3:], full_x[:, 3:], atol=2e-6)
    wide = make_block("mistral", sliding_window=None)
    for a, b in zip(layer.weights, wide.weights):
        b.assign(a)
    assert np.abs(to_np(wide(cast(x, "float32")))[:, 3:] - full_x[:, 3:]).max() > 1e-3


def test_decoder_only_block_padding_mask_against_oracle():
    layer = make_block("llama")
    x = RNG.standard_normal((2, 5, 8))
    padding = np.array([[True] * 5, [False, False, True, True, True]])
    mask = np.broadcast_to(padding[:, None, :], (2, 5, 5))
    got = layer(cast(x, "float32"), mask=mask)
    assert_close(got, block_oracle(layer, x, mask), "float32", BLOCK_TOL)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
def test_decoder_only_block_compiled_decoding_with_tensor_index(family):
    """One compiled step function (jax.jit / tf.function; eager elsewhere) fed a tensor
    index at every step gives the full pass."""
    layer = make_block(family)
    x = cast(RNG.standard_normal((2, 5, 8)), "float32")
    want = to_np(layer(x))
    step = compiled(lambda t, c, i: layer(t, cache=c, cache_index=i))
    cache = layer.init_cache(2, 7)
    outs = []
    for t in range(5):
        out, cache = step(x[:, t : t + 1], cache, keras.ops.convert_to_tensor(t, "int32"))
        outs.append(to_np(out))
    assert_close(np.concatenate(outs, 1), want, "float32", BLOCK_TOL)


@st.composite
def block_case(draw):
    """Edge shapes: one token, a cache of exactly the sequence's length (length 1 for one
    token), 1, 2 or 4 key/value heads under 4 query heads, batch 1 or 3."""
    return dict(
        batch=draw(st.sampled_from([1, 3])),
        length=draw(st.integers(1, 5)),
        kv_heads=draw(st.sampled_from([1, 2, 4])),
        family=draw(st.sampled_from(["llama", "gpt2", "mistral", "neox"])),
        spare=draw(st.sampled_from([0, 2])),
    )


# Every example builds a block and decodes token by token, which compiles each op anew
# for its shapes on JAX: the edge shapes are explicit examples (every family, each
# key/value head count, batch 1 and 3, lengths 1 to 5, caches of exactly the length and
# longer) and one drawn example joins them (the first draw is the all-smallest case).
@settings(SETTINGS, max_examples=1)
@given(case=block_case())
@example(case=dict(batch=1, length=1, kv_heads=1, family="llama", spare=0))
@example(case=dict(batch=3, length=1, kv_heads=4, family="mistral", spare=2))
@example(case=dict(batch=1, length=5, kv_heads=2, family="neox", spare=0))
@example(case=dict(batch=3, length=4, kv_heads=1, family="gpt2", spare=2))
@example(case=dict(batch=3, length=3, kv_heads=2, family="llama", spare=0))
def test_decoder_only_block_shapes_property(case):
    extra = {"num_key_value_heads": case["kv_heads"]}
    layer = make_block(case["family"], **extra)
    x = RNG.standard_normal((case["batch"], case["length"], 8))
    xt = cast(x, "float32")
    want = block_oracle(layer, x)
    assert_close(layer(xt), want, "float32", BLOCK_TOL)
    got, cache = decode(layer, xt, [1] * case["length"], case["length"] + case["spare"])
    assert tuple(cache[0].shape)[1:3] == (case["kv_heads"], case["length"] + case["spare"])
    assert_close(got, want, "float32", BLOCK_TOL)


def test_decoder_only_block_save_load_and_config(tmp_path):
    x = RNG.standard_normal((2, 4, 8)).astype("float32")
    for family in ("llama", "neox"):
        layer = make_block(family)
        model = keras.Sequential([keras.Input((4, 8)), layer])
        path = tmp_path / f"{family}.keras"
        model.save(path)
        loaded = keras.saving.load_model(path)
        np.testing.assert_array_equal(to_np(model(x)), to_np(loaded(x)))
        inner = loaded.layers[-1]
        assert isinstance(inner, layers.TransformerDecoderOnlyLayer)
        assert inner.get_config() == layer.get_config()
    ffn = layers.FeedForward(6, "silu", gated=True, use_bias=False, output_dim=4)
    assert layers.FeedForward.from_config(ffn.get_config()).get_config() == ffn.get_config()
    rot = layers.RotaryEmbedding(12, rotary_dim=4, interleaved=True, scaling=LLAMA3)
    assert layers.RotaryEmbedding.from_config(rot.get_config()).get_config() == rot.get_config()


def test_decoder_only_block_weight_names():
    names = sorted(w.path.split("/", 1)[1] for w in make_block("qwen2").weights)
    assert names == sorted(
        [
            "self_attention/query/kernel",
            "self_attention/query/bias",
            "self_attention/key/kernel",
            "self_attention/key/bias",
            "self_attention/value/kernel",
            "self_attention/value/bias",
            "self_attention/attention_output/kernel",
            "ffn/gate/kernel",
            "ffn/up/kernel",
            "ffn/down/kernel",
            "norm_1/scale",
            "norm_2/scale",
        ]
    )
    gpt2 = sorted(w.path.split("/", 1)[1] for w in make_block("gpt2").weights)
    assert "self_attention/attention_output/bias" in gpt2 and "norm_1/beta" in gpt2
    assert not any(n.startswith("ffn/gate") for n in gpt2)


@pytest.mark.parametrize(
    "kwargs,error,name",
    [
        ({"norm": "batch"}, ValueError, "norm"),
        ({"norm_first": 1}, TypeError, "norm_first"),
        ({"epsilon": 0.0}, ValueError, "epsilon"),
        ({"activation": "gelu_fast"}, ValueError, "activation"),
        ({"gated": None}, TypeError, "gated"),
        ({"attention_bias": "no"}, TypeError, "attention_bias"),
        ({"output_bias": 0}, TypeError, "output_bias"),
        ({"ffn_bias": 1}, TypeError, "ffn_bias"),
        ({"head_dim": 0}, ValueError, "head_dim"),
        ({"num_key_value_heads": 3}, ValueError, "num_key_value_heads"),
        ({"sliding_window": 0}, ValueError, "sliding_window"),
        ({"rotary_max_length": 8, "rotary_dim": 3}, ValueError, "rotary_dim"),
        ({"rotary_max_length": 8, "rotary_scaling": {"rope_type": "x"}}, ValueError, "rope_type"),
        ({"rate": 1.5}, ValueError, "rate"),
    ],
)
def test_decoder_only_block_bad_arguments_raise_naming_them(kwargs, error, name):
    with pytest.raises(error, match=name):
        layers.TransformerDecoderOnlyLayer(8, 4, 12, **kwargs)


def test_decoder_only_block_config_holds_every_option():
    config = layers.DecoderBlockConfig(8, 4, 12, norm="rms", num_key_value_heads=2,
                                       rotary_max_length=8, rotary_scaling={"type": "linear", "factor": 2.0})  # fmt: skip
    layer = layers.TransformerDecoderOnlyLayer(config=config, name="b")
    assert layer.config == config and layer.norm == "rms" and layer.num_key_value_heads == 2
    assert config.rotary_scaling["rope_type"] == "linear"  # normalised as the attention does
    assert layer.self_attention.rotary_scaling == config.rotary_scaling
    # keyword options replace the config's fields; get_config is flat and round-trips
    wide = layers.TransformerDecoderOnlyLayer(config=config, sliding_window=3)
    assert wide.config.sliding_window == 3 and wide.self_attention.sliding_window == 3
    again = layers.TransformerDecoderOnlyLayer.from_config(wide.get_config())
    assert again.config == wide.config
    assert layers.TransformerDecoderOnlyLayer(config=config.to_dict()).config == config
    with pytest.raises(ValueError, match=r"not DecoderBlockConfig fields.*'heads'"):
        layers.TransformerDecoderOnlyLayer(config={**config.to_dict(), "heads": 2})
    with pytest.raises(TypeError, match="`config`"):
        layers.TransformerDecoderOnlyLayer(config=[8, 4, 12])
    with pytest.raises(TypeError, match="missing \\['dff'\\]"):
        layers.TransformerDecoderOnlyLayer(8, 4)
    with pytest.raises(ValueError, match="sliding_window"):
        layers.DecoderBlockConfig(8, 4, 12, sliding_window=-1)


def test_decoder_only_block_bad_calls_raise_naming_them():
    with pytest.raises(ValueError, match="divisible"):
        layers.TransformerDecoderOnlyLayer(10, 4, 12)
    layer = make_block("llama")
    x = cast(np.zeros((2, 1, 8)), "float32")
    cache = layer.init_cache(2, 4)
    with pytest.raises(ValueError, match="mask"):
        layer(x, mask=np.ones((2, 1, 1), bool), cache=cache, cache_index=0)
    with pytest.raises(ValueError, match="cache_index"):
        layer(x, cache_index=0)
    with pytest.raises(ValueError, match="cache_index"):
        layer(x, cache=cache, cache_index=4)
    with pytest.raises(ValueError, match="width 8"):
        layer(cast(np.zeros((2, 1, 6)), "float32"))
    with pytest.raises(TypeError, match="`x`"):
        layer(keras.ops.convert_to_tensor(np.zeros((2, 1, 8), "int32")))

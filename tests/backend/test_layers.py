"""Keras layers against the oracle, config and .keras round trips, a training step."""

import keras
import numpy as np
import pytest
from _support import (
    BACKEND,
    DTYPES,
    LAYER_TOL,
    assert_close,
    cast,
    requires_grad,
    rounded,
    to_np,
)

from multiattn import layers, ops
from multiattn import reference as ref

RNG = np.random.default_rng(11)
MHA_NAMES = ("query", "key", "value", "output")


def mha_weights(layer) -> dict:
    out = {}
    for name in MHA_NAMES:
        out[f"{name}_kernel"] = to_np(getattr(layer, f"{name}_kernel"))
        bias = getattr(layer, f"{name}_bias")
        if bias is not None:
            out[f"{name}_bias"] = to_np(bias)
    return out


def randomise(layer, scale=0.5):
    for w in layer.weights:
        if w.trainable:
            w.assign(RNG.standard_normal(tuple(w.shape)) * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case", ["self", "cross_widths", "value_dim", "no_bias", "causal", "lens_2d", "mask3", "mask4"]
)
def test_multi_head_attention_against_oracle(dtype, case):
    b, tq, tk = 2, 5, 5
    eq = ek = ev = 8
    kwargs, call = {}, {}
    if case == "cross_widths":
        tk, ek, ev = 6, 5, 3
        kwargs["output_dim"] = 4
    if case == "value_dim":
        kwargs["value_dim"] = 6
    if case == "no_bias":
        kwargs["use_bias"] = False
    if case == "causal":
        call["causal"] = True
    if case == "lens_2d":
        call["valid_lens"] = np.array([[0, 1, 5, 2, 3], [5, 5, 0, 4, 1]])
    if case == "mask3":
        mask = RNG.random((b, tq, tk)) > 0.4
        mask[1, 0] = False
        call["mask"] = mask
    if case == "mask4":
        call["mask"] = RNG.random((b, 2, tq, tk)) > 0.4
    layer = layers.MultiHeadAttention(2, 4, dtype=dtype, **kwargs)
    q, k, v = (
        RNG.standard_normal((b, tq, eq)),
        RNG.standard_normal((b, tk, ek)),
        RNG.standard_normal((b, tk, ev)),
    )
    args = [cast(q, dtype), cast(v, dtype), cast(k, dtype)]
    layer(*args)
    randomise(layer)
    out, w = layer(*args, return_weights=True, **call)
    want, want_w = ref.multi_head_attention(
        *(to_np(a) for a in args[:1]),
        to_np(args[1]),
        to_np(args[2]),
        weights=mha_weights(layer),
        **call,
    )
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    assert_close(out, want, dtype, LAYER_TOL)
    assert_close(w, want_w, dtype, LAYER_TOL)
    fused = layer(*args, **call)  # no weights requested: the fused path where available
    assert_close(fused, want, dtype, LAYER_TOL)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in ("float64", "float32")])
def test_encoder_layer_against_oracle(dtype, norm_first):
    x = RNG.standard_normal((2, 6, 8))
    layer = layers.TransformerEncoderLayer(8, 2, 16, rate=0.1, norm_first=norm_first, dtype=dtype)
    layer(cast(x, dtype))
    randomise(layer, 0.3)
    lens = np.array([6, 2])
    got = layer(cast(x, dtype), valid_lens=lens, training=False)
    weights = {
        "attention": mha_weights(layer.attention),
        "ffn_w1": to_np(layer.ffn_1.kernel),
        "ffn_b1": to_np(layer.ffn_1.bias),
        "ffn_w2": to_np(layer.ffn_2.kernel),
        "ffn_b2": to_np(layer.ffn_2.bias),
        "norm1_gamma": to_np(layer.norm_1.gamma),
        "norm1_beta": to_np(layer.norm_1.beta),
        "norm2_gamma": to_np(layer.norm_2.gamma),
        "norm2_beta": to_np(layer.norm_2.beta),
    }
    want = ref.transformer_encoder_layer(
        x, weights=weights, num_heads=2, norm_first=norm_first, epsilon=1e-6, valid_lens=lens
    )
    assert_close(got, want, dtype, {"float64": 1e-10, "float32": 2e-6})


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_against_oracle(dtype):
    x = RNG.standard_normal((2, 5, 8)) * 3 + 1
    gamma, beta = RNG.standard_normal(8), RNG.standard_normal(8)
    want = ref.layer_norm(rounded(x, dtype), rounded(gamma, dtype), rounded(beta, dtype), 1e-6)
    got = ops.layer_norm(cast(x, dtype), cast(gamma, dtype), cast(beta, dtype), epsilon=1e-6)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    assert_close(got, want, dtype, {**LAYER_TOL, "float32": 2e-6})
    layer = layers.LayerNormalization(epsilon=1e-6, dtype=dtype)
    layer.build(x.shape)
    layer.gamma.assign(gamma)
    layer.beta.assign(beta)
    assert_close(layer(cast(x, dtype)), want, dtype, {**LAYER_TOL, "float32": 2e-6})


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in ("float64", "float32")])
def test_additive_and_dot_product_layers_against_oracle(dtype):
    q, k, v = (
        RNG.standard_normal((2, 3, 4)),
        RNG.standard_normal((2, 5, 6)),
        RNG.standard_normal((2, 5, 3)),
    )
    lens = np.array([2, 0])
    layer = layers.AdditiveAttention(7, dtype=dtype)
    out, w = layer(
        cast(q, dtype), cast(v, dtype), cast(k, dtype), valid_lens=lens, return_weights=True
    )
    scores = ref.additive_scores(q, k, to_np(layer.w_q), to_np(layer.w_k), to_np(layer.w_v))
    want, want_w = ref.attention(scores, v, valid_lens=lens)
    assert_close(out, want, dtype)
    assert_close(w, want_w, dtype)
    k2 = RNG.standard_normal((2, 5, 4))
    dot = layers.DotProductAttention(scale=0.4, dtype=dtype)
    got = dot(cast(q, dtype), cast(v, dtype), cast(k2, dtype), valid_lens=lens, causal=True)
    want, _ = ref.scaled_dot_product_attention(q, k2, v, valid_lens=lens, causal=True, scale=0.4)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_positional_encoding_layer(layout):
    x = RNG.standard_normal((2, 9, 6))
    got = layers.PositionalEncoding(20, layout=layout)(cast(x, "float32"))
    assert_close(got, x + ref.sinusoidal_encoding(9, 6, layout=layout), "float32")


def build_model(kind: str):
    inputs = keras.Input((6, 8))
    if kind == "mha":
        x = layers.MultiHeadAttention(2, 4, value_dim=3, output_dim=8, dropout=0.1, seed=1)(
            inputs, inputs
        )
    elif kind == "encoder":
        x = layers.TransformerEncoderLayer(8, 2, 16, norm_first=True, seed=2)(inputs)
    elif kind == "additive":
        x = layers.AdditiveAttention(5, dropout=0.2, seed=3)(inputs, inputs)
    elif kind == "dot":
        x = layers.DotProductAttention(scale=0.5, dropout=0.1, seed=4)(inputs, inputs)
    else:
        x = layers.PositionalEncoding(16, layout="concatenated", dropout=0.1, seed=5)(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


KINDS = ["mha", "encoder", "additive", "dot", "positional"]


@pytest.mark.parametrize("kind", KINDS)
def test_keras_file_round_trip_is_exact(kind, tmp_path):
    model = build_model(kind)
    x = RNG.standard_normal((3, 6, 8)).astype("float32")
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(to_np(model(x)), to_np(loaded(x)))
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    for layer, twin in zip(model.layers, loaded.layers):
        assert layer.get_config() == twin.get_config()


@pytest.mark.parametrize("kind", KINDS)
def test_config_round_trip(kind):
    layer = build_model(kind).layers[1]
    clone = type(layer).from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()


@pytest.mark.parametrize("kind", KINDS)
def test_training_step_updates_weights(kind):
    requires_grad()
    keras.utils.set_random_seed(0)
    model = build_model(kind)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = RNG.standard_normal((4, 6, 8)).astype("float32")
    y = RNG.standard_normal((4, 6, 1)).astype("float32")
    before = [to_np(w) for w in model.trainable_weights]
    history = model.fit(x, y, epochs=2, batch_size=2, verbose=0)
    assert all(np.isfinite(history.history["loss"]))
    after = [to_np(w) for w in model.trainable_weights]
    changed = [not np.array_equal(a, b) for a, b in zip(before, after)]
    assert all(changed), f"weights not updated on {BACKEND}: {changed}"


@pytest.mark.parametrize("use_bias", [True, False])
def test_self_attention_one_input_matches_oracle(use_bias):
    x = RNG.standard_normal((2, 5, 8))
    layer = layers.MultiHeadAttention(2, 4, use_bias=use_bias)
    xt = cast(x, "float32")
    layer(xt, xt)
    randomise(layer)
    fused = layer(xt, xt, causal=True)  # query is value is key
    separate = layer(xt, keras.ops.add(xt, 0.0), causal=True)  # a distinct tensor
    want, _ = ref.multi_head_attention(x, x, weights=mha_weights(layer), causal=True)
    assert_close(fused, want, "float32")
    assert_close(separate, want, "float32")


# --- what the layers accept (issue 13) ---------------------------------------------------------


def _layer_calls(dtype):
    """name -> a call of the layer on inputs of ``dtype`` (the other inputs float32)."""
    x = keras.ops.convert_to_tensor(np.ones((2, 3, 8), dtype))
    f = cast(np.ones((2, 3, 8)), "float32")
    x4 = keras.ops.convert_to_tensor(np.ones((2, 3, 2, 4), dtype))
    return {
        "MultiHeadAttention": lambda: layers.MultiHeadAttention(2, 4)(x, f),
        "MultiHeadAttention_value": lambda: layers.MultiHeadAttention(2, 4)(f, x),
        "DotProductAttention": lambda: layers.DotProductAttention()(x, f),
        "AdditiveAttention": lambda: layers.AdditiveAttention(4)(x, f),
        "TransformerEncoderLayer": lambda: layers.TransformerEncoderLayer(8, 2, 16)(x),
        "TransformerDecoderLayer": lambda: layers.TransformerDecoderLayer(8, 2, 16)(x, f),
        "TransformerDecoderLayer_context": lambda: layers.TransformerDecoderLayer(8, 2, 16)(f, x),
        "PositionalEncoding": lambda: layers.PositionalEncoding(8)(x),
        "PositionEmbedding": lambda: layers.PositionEmbedding(8)(x),
        "RotaryEmbedding": lambda: layers.RotaryEmbedding(8)(x4),
    }


@pytest.mark.parametrize("dtype", ["int32", "int64", "bool", "complex64"])
@pytest.mark.parametrize("layer", sorted(_layer_calls("float32")))
def test_integer_bool_and_complex_inputs_raise_type_error(layer, dtype):
    """These were computed (complex on JAX, integers on numpy and JAX, cast on the fly) or
    failed inside the backend; the layers take floating inputs."""
    with pytest.raises(TypeError, match="must be a floating tensor"):
        _layer_calls(dtype)[layer]()


@pytest.mark.parametrize("layer", sorted(_layer_calls("float32")))
def test_float_inputs_still_accepted(layer):
    """The counterpart of the test above: the same calls with float32 inputs run."""
    out = _layer_calls("float32")[layer]()
    assert np.isfinite(to_np(out[0] if isinstance(out, tuple) else out)).all()


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="no compiler here")
def test_traced_training_flag_raises_type_error():
    """A bool tensor without a value cannot choose between dropout and none: under
    jax.jit / tf.function the layers ask for a Python bool (Keras' loops pass one)."""
    layer = layers.MultiHeadAttention(2, 4, dropout=0.5)
    x = cast(np.ones((2, 3, 8)), "float32")
    layer(x, x)
    if BACKEND == "jax":
        import jax

        run = jax.jit(lambda t, flag: layer(t, t, training=flag))
    else:
        import tensorflow as tf

        run = tf.function(lambda t, flag: layer(t, t, training=flag))
    with pytest.raises(TypeError, match="`training` must be a Python bool"):
        run(x, keras.ops.convert_to_tensor(True))

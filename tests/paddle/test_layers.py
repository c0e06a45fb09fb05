"""The Paddle twins of the layers (`multiattn.paddle.layers`) against the float64 oracle:
outputs, input gradients and weight gradients (central differences of the oracle), in
float32 and float64; the same arguments, configs and neutral weights as the Keras twins."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from _paddle_support import FLOAT_DTYPES, assert_close, numeric_grad, tensor, to_np

from multiattn import port
from multiattn import reference as ref
from multiattn.paddle import layers as L

# Relative error bounds of outputs and gradients against the oracle (whole layers).
TOL = {"float64": 1e-9, "float32": 5e-5}


def randomise(layer, seed: int = 0) -> None:
    """Random parameters, scaled so that softmax rows are not one-hot."""
    rng = np.random.default_rng(seed)
    for p in layer.parameters():
        p.set_value(rng.standard_normal(p.shape).astype(p.numpy().dtype) * 0.4)


def mha_weights(m) -> dict:
    w = {}
    for name in ("query", "key", "value", "output"):
        w[f"{name}_kernel"] = to_np(getattr(m, f"{name}_kernel"))
        if getattr(m, f"{name}_bias") is not None:
            w[f"{name}_bias"] = to_np(getattr(m, f"{name}_bias"))
    return w


def ffn_weights(f) -> dict:
    w = {}
    for name in ("gate", "up", "down"):
        dense = getattr(f, name, None)
        if dense is None:
            continue
        w[f"{name}_kernel"] = to_np(dense.kernel)
        if dense.bias is not None:
            w[f"{name}_bias"] = to_np(dense.bias)
    return w


def norm_weights(layer, i: int, rms: bool = False) -> dict:
    norm = getattr(layer, f"norm_{i}")
    if rms:
        return {f"norm{i}_scale": to_np(norm.scale)}
    return {f"norm{i}_gamma": to_np(norm.gamma), f"norm{i}_beta": to_np(norm.beta)}


def block_ffn(layer) -> dict:
    return {
        "ffn_w1": to_np(layer.ffn_1.kernel),
        "ffn_b1": to_np(layer.ffn_1.bias),
        "ffn_w2": to_np(layer.ffn_2.kernel),
        "ffn_b2": to_np(layer.ffn_2.bias),
    }


# -- the layers, their calls and their oracles ----------------------------------------------
# name -> (make(dtype), inputs {name: shape}, call(layer, tensors), oracle(layer, arrays))

RNG = np.random.default_rng(7)


def _mha(key_dim=3, **kw):
    return lambda dtype: L.MultiHeadAttention(4, key_dim, dtype=dtype, **kw)


def _mha_oracle(**kw):
    def oracle(m, a):
        return ref.multi_head_attention(a["q"], a["v"], weights=mha_weights(m), **kw)[0]

    return oracle


CASES = {
    "mha": (
        _mha(value_dim=2, output_dim=5),
        {"q": (2, 3, 6), "v": (2, 4, 6)},
        lambda m, t: m(t["q"], t["v"], mask=np.tril(np.ones((3, 4), bool))),
        lambda m, a: ref.multi_head_attention(
            a["q"], a["v"], weights=mha_weights(m), mask=np.tril(np.ones((3, 4), bool))
        )[0],
    ),
    "mha_grouped_rotary_causal": (
        _mha(4, num_key_value_heads=2, rotary_max_length=16),
        {"q": (2, 4, 6), "v": (2, 4, 6)},
        lambda m, t: m(t["q"], t["v"], causal=True),
        _mha_oracle(causal=True, rotary_base=10000.0),
    ),
    "mha_no_bias_window": (
        _mha(use_bias=False, sliding_window=2),
        {"q": (1, 5, 6), "v": (1, 5, 6)},
        lambda m, t: m(t["q"], t["v"], causal=True),
        _mha_oracle(causal=True, sliding_window=2),
    ),
    "grouped_query_attention": (
        lambda dtype: L.GroupedQueryAttention(3, 4, 2, dtype=dtype),
        {"q": (2, 3, 6), "v": (2, 5, 6)},
        lambda m, t: m(t["q"], t["v"]),
        _mha_oracle(),
    ),
    "rotary": (
        lambda dtype: L.RotaryEmbedding(16, rotary_dim=2, interleaved=True, dtype=dtype),
        {"x": (2, 5, 3, 4)},
        lambda m, t: m(t["x"], offset=3),
        lambda m, a: np.moveaxis(
            ref.rotary_embedding(
                np.moveaxis(a["x"], 1, 2), np.arange(3, 8), rotary_dim=2, interleaved=True
            ),
            2,
            1,
        ),
    ),
    "layer_norm": (
        lambda dtype: L.LayerNormalization(epsilon=1e-5, dtype=dtype),
        {"x": (2, 3, 6)},
        lambda m, t: m(t["x"]),
        lambda m, a: ref.layer_norm(a["x"], to_np(m.gamma), to_np(m.beta), 1e-5),
    ),
    "rms_norm": (
        lambda dtype: L.RMSNormalization(epsilon=1e-5, dtype=dtype),
        {"x": (2, 3, 6)},
        lambda m, t: m(t["x"]),
        lambda m, a: ref.rms_norm(a["x"], to_np(m.scale), 1e-5),
    ),
    "positional_encoding": (
        lambda dtype: L.PositionalEncoding(16, layout="concatenated", dtype=dtype),
        {"x": (2, 5, 6)},
        lambda m, t: m(t["x"]),
        lambda m, a: a["x"] + ref.sinusoidal_encoding(5, 6, "concatenated"),
    ),
    "position_embedding": (
        lambda dtype: L.PositionEmbedding(16, dtype=dtype),
        {"x": (2, 5, 6)},
        lambda m, t: m(t["x"], offset=2),
        lambda m, a: a["x"] + to_np(m.embeddings)[2:7],
    ),
    "feed_forward_gated": (
        lambda dtype: L.FeedForward(8, activation="silu", gated=True, dtype=dtype),
        {"x": (2, 3, 6)},
        lambda m, t: m(t["x"]),
        lambda m, a: ref.gated_feed_forward(a["x"], ffn_weights(m), "silu", True),
    ),
    "encoder": (
        lambda dtype: L.TransformerEncoderLayer(6, 2, 8, rate=0.0, norm_first=True, dtype=dtype),
        {"x": (2, 4, 6)},
        lambda m, t: m(t["x"], valid_lens=np.array([4, 2])),
        lambda m, a: ref.transformer_encoder_layer(
            a["x"],
            weights={
                "attention": mha_weights(m.attention),
                **block_ffn(m),
                **norm_weights(m, 1),
                **norm_weights(m, 2),
            },
            num_heads=2,
            norm_first=True,
            valid_lens=np.array([4, 2]),
        ),
    ),
    "decoder": (
        lambda dtype: L.TransformerDecoderLayer(6, 2, 8, rate=0.0, dtype=dtype),
        {"x": (2, 3, 6), "c": (2, 4, 6)},
        lambda m, t: m(t["x"], t["c"]),
        lambda m, a: ref.transformer_decoder_layer(
            a["x"],
            a["c"],
            weights={
                "self_attention": mha_weights(m.self_attention),
                "cross_attention": mha_weights(m.cross_attention),
                **block_ffn(m),
                **{k: v for i in (1, 2, 3) for k, v in norm_weights(m, i).items()},
            },
        ),
    ),
    "decoder_only_llama": (
        lambda dtype: L.TransformerDecoderOnlyLayer(
            8,
            2,
            8,
            rate=0.0,
            norm="rms",
            norm_first=True,
            activation="silu",
            gated=True,
            num_key_value_heads=1,
            rotary_max_length=16,
            attention_bias=False,
            output_bias=False,
            ffn_bias=False,
            dtype=dtype,
        ),
        {"x": (2, 4, 8)},
        lambda m, t: m(t["x"]),
        lambda m, a: ref.transformer_decoder_only_layer(
            a["x"],
            weights={
                "attention": mha_weights(m.self_attention),
                "ffn": ffn_weights(m.ffn),
                **norm_weights(m, 1, rms=True),
                **norm_weights(m, 2, rms=True),
            },
            norm="rms",
            norm_first=True,
            activation_name="silu",
            gated=True,
            rotary_base=m.rotary_base,
            epsilon=m.epsilon,
        ),
    ),
}


def _built(name: str, dtype: str):
    make, shapes, call, oracle = CASES[name]
    layer = make(dtype)
    layer.eval()
    arrays = {k: RNG.standard_normal(s) for k, s in shapes.items()}
    call(layer, {k: tensor(v, dtype) for k, v in arrays.items()})  # builds
    randomise(layer)
    return layer, arrays, call, oracle


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_layer_outputs_and_gradients_match_the_oracle(name, dtype):
    layer, arrays, call, oracle = _built(name, dtype)
    arrays = {k: to_np(tensor(v, dtype)) for k, v in arrays.items()}  # rounded to dtype
    cot = RNG.standard_normal(oracle(layer, arrays).shape)
    inputs = {k: tensor(v, dtype, grad=True) for k, v in arrays.items()}
    out = call(layer, inputs)
    assert_close(out, oracle(layer, arrays), dtype, TOL[dtype])
    params = [p for p in layer.parameters() if not p.stop_gradient][:2]
    loss = (out.astype("float64") * paddle.to_tensor(cot)).sum()
    grads = paddle.grad([loss], [*inputs.values(), *params], allow_unused=True)
    keys = list(arrays)
    # The oracle reads the weights of a float64 copy, so that the differences are exact.
    exact, *_ = _built(name, "float64")
    for p, q in zip(exact.parameters(), layer.parameters()):
        p.set_value(to_np(q))
    exact_params = [p for p in exact.parameters() if not p.stop_gradient][:2]

    def oracle_loss(*values):
        for p, v in zip(exact_params, values[len(keys) :]):
            p.set_value(v)
        return float(np.sum(oracle(exact, dict(zip(keys, values[: len(keys)]))) * cot))

    start = [arrays[k] for k in keys] + [to_np(p) for p in params]
    want = numeric_grad(oracle_loss, *start, h=1e-4)
    for got, expected in zip(grads, want):
        assert got is not None
        assert_close(got, expected, dtype, max(TOL[dtype], 1e-7))


# Keras twin name -> (constructor arguments, call inputs {name: shape})
TWINS = {
    "MultiHeadAttention": (
        dict(num_heads=4, key_dim=2, num_key_value_heads=2, rotary_max_length=16, use_gate=True),
        {"query": (2, 3, 6), "value": (2, 5, 6)},
    ),
    "TransformerEncoderLayer": (dict(d_model=6, num_heads=2, dff=8), {"x": (2, 4, 6)}),
    "TransformerDecoderOnlyLayer": (
        dict(
            d_model=8,
            num_heads=2,
            dff=8,
            norm="rms",
            gated=True,
            activation="silu",
            num_key_value_heads=1,
            rotary_max_length=8,
        ),
        {"x": (2, 4, 8)},
    ),
    "FeedForward": (dict(hidden_dim=8, activation="gelu_tanh", gated=True), {"x": (2, 3, 6)}),
}


@pytest.mark.parametrize("name", list(TWINS))
def test_same_arguments_weights_and_outputs_as_the_keras_twin(name):
    """Built with the Keras twin's arguments, loaded with its weights (by Keras path), the
    Paddle layer computes what the Keras layer computes; ``from_config`` takes the Keras
    layer's config."""
    from multiattn import layers as keras_layers

    kwargs, shapes = TWINS[name]
    arrays = {k: RNG.standard_normal(s).astype("float32") for k, s in shapes.items()}
    keras_layer = getattr(keras_layers, name)(**kwargs)
    want = keras_layer(**arrays)
    for cfg in (kwargs, keras_layer.get_config()):
        layer = getattr(L, name).from_config(cfg) if cfg is not kwargs else getattr(L, name)(**cfg)
        layer.eval()
        layer(**{k: tensor(v) for k, v in arrays.items()})
        paths = [v.path for v in keras_layer.trainable_variables]
        assert [p.path for p in layer.trainable_variables] == paths
        for p, v in zip(layer.trainable_variables, keras_layer.trainable_variables):
            p.set_value(np.asarray(v.numpy() if hasattr(v, "numpy") else v.value))
        got = layer(**{k: tensor(v) for k, v in arrays.items()})
        assert_close(got, to_np(want), "float32", 1e-5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_port_neutral_weights_round_trip_between_the_twins(dtype):
    from multiattn import layers as keras_layers

    q = RNG.standard_normal((2, 3, 6))
    keras_layer = keras_layers.MultiHeadAttention(4, 3, num_key_value_heads=2)
    keras_layer(q.astype("float32"), q.astype("float32"))
    weights = port.get_weights(keras_layer)
    layer = L.MultiHeadAttention(4, 3, num_key_value_heads=2, dtype=dtype)
    port.set_weights(layer, weights)  # built from the weights' shapes
    assert port.detect(layer) == "multiattn-paddle"
    back = port.get_weights(layer)
    assert back.kind == weights.kind and back.config == weights.config
    for key, value in weights.weights.items():
        np.testing.assert_array_equal(back.weights[key].astype("float32"), value)
    want = ref.multi_head_attention(q, q, weights=mha_weights(layer))[0]
    assert_close(layer(tensor(q, dtype), tensor(q, dtype)), want, dtype, TOL[dtype])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cached_decoding_gives_the_causal_pass(dtype):
    layer, arrays, _, _ = _built("decoder_only_llama", dtype)
    x = tensor(arrays["x"], dtype)
    full = layer(x)
    cache = layer.init_cache(2, 6)
    outs = []
    for t in range(4):
        out, cache = layer(x[:, t : t + 1], cache=cache, cache_index=t)
        outs.append(out)
    assert_close(paddle.concat(outs, 1), to_np(full), dtype, TOL[dtype])
    assert tuple(cache[0].shape) == (2, 1, 6, 4)  # one key/value head kept, heads first


def test_training_mode_drives_dropout_and_seeds_repeat():
    x = tensor(RNG.standard_normal((2, 4, 6)))
    layer = L.TransformerEncoderLayer(6, 2, 8, rate=0.5, seed=3)
    assert layer.training  # Paddle's convention: a new layer trains
    a, b = layer(x), layer(x)
    assert not np.allclose(to_np(a), to_np(b))  # dropout on, fresh draws
    layer.eval()
    np.testing.assert_array_equal(to_np(layer(x)), to_np(layer(x)))
    np.testing.assert_array_equal(to_np(layer(x, training=False)), to_np(layer(x)))


def test_parameters_train_with_a_paddle_optimizer_and_state_dict_round_trips():
    layer = L.MultiHeadAttention(2, 3)
    x = tensor(RNG.standard_normal((2, 4, 6)))
    layer(x, x)
    state = {k: v.numpy().copy() for k, v in layer.state_dict().items()}
    assert len(state) == 8 and all("dense" in k for k in state)
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=layer.parameters())
    losses = []
    for _ in range(3):
        loss = (layer(x, x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    assert losses[2] < losses[0]
    other = L.MultiHeadAttention(2, 3)
    other(x, x)
    other.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    for k, v in other.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), state[k])


def test_to_static_gives_the_eager_result():
    layer = L.MultiHeadAttention(2, 3)
    layer.eval()
    x = tensor(RNG.standard_normal((2, 4, 6)))
    want = to_np(layer(x, x, causal=True))
    static = paddle.jit.to_static(layer)
    assert_close(static(x, x, causal=True), want, "float32", 1e-6)


def test_other_frameworks_tensors_and_keras_only_settings_are_refused():
    layer = L.MultiHeadAttention(2, 3)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"`query` must be a Paddle tensor.*torch"):
        layer(torch.zeros(2, 3, 6), torch.zeros(2, 3, 6))
    import keras

    with pytest.raises(TypeError, match=r"`query` must be a Paddle tensor.*KerasTensor"):
        layer(keras.KerasTensor((2, 3, 6)), keras.KerasTensor((2, 3, 6)))
    with pytest.raises(TypeError, match=r"unknown argument.*autocast"):
        L.RMSNormalization(autocast=False)
    with pytest.raises(ValueError, match=r"mixed-precision.*mixed_float16"):
        L.RMSNormalization(dtype="mixed_float16")
    with pytest.raises(ValueError, match="`kernel_regularizer` not supported on Paddle"):
        L.MultiHeadAttention(2, 3, kernel_regularizer="l2")(np.zeros((1, 2, 4), "float32"),
                                                             np.zeros((1, 2, 4), "float32"))  # fmt: skip
    with pytest.raises(ValueError, match="last axis only"):
        L.LayerNormalization(axis=1)(np.ones((2, 3, 4), "float32"))
    with pytest.raises(ValueError, match="num_heads"):  # the definition's own validation
        L.MultiHeadAttention(0, 3)

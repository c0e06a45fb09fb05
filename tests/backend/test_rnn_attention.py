"""RNN attention layers (document 003) against the float64 oracle.

The attention parts use `multiattn.reference`; the GRU recurrence is written out below in
plain float64 NumPy from the Keras GRU equations (``reset_after=True``: gates z, r, h;
input and recurrent biases apart), using the layers' own weights.
"""

import keras
import numpy as np
import pytest
from _support import BACKEND, DTYPES, LAYER_TOL, assert_close, cast, requires_grad, to_np

from multiattn import layers
from multiattn import reference as ref

RNG = np.random.default_rng(2026)
FLOATS = ("float32",) if BACKEND == "numpy" else ("float64", "float32")
# GRU steps and several chained steps accumulate rounding; float32 stays well within this.
# Keras' own GRU cell is not float64-exact (about 1e-7 from the float64 oracle on JAX and
# PyTorch), so float64 results that pass through the GRU get a looser bound.
SEQ_TOL = {"float64": 1e-6, "float32": 2e-5}


def randomise(layer, scale=0.5):
    for w in layer.weights:
        if w.trainable:
            w.assign(RNG.standard_normal(tuple(w.shape)) * scale)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def gru_step(x, h, cell):
    kernel, recurrent, bias = (to_np(w) for w in (cell.kernel, cell.recurrent_kernel, cell.bias))
    u = h.shape[-1]
    xi = x @ kernel + bias[0]
    hr = h @ recurrent + bias[1]
    z = sigmoid(xi[:, :u] + hr[:, :u])
    r = sigmoid(xi[:, u : 2 * u] + hr[:, u : 2 * u])
    candidate = np.tanh(xi[:, 2 * u :] + r * hr[:, 2 * u :])
    return z * h + (1.0 - z) * candidate


def encoder_oracle(encoder, tokens, lens):
    emb = to_np(encoder.embedding.embeddings)[tokens]
    h = np.zeros((tokens.shape[0], encoder.hidden_dim))
    outputs = []
    for t in range(tokens.shape[1]):
        new = gru_step(emb[:, t], h, encoder.gru.cell)
        h = np.where((t < lens)[:, None], new, h)
        outputs.append(new)
    return np.stack(outputs, 1), h


def decoder_oracle(decoder, enc_out, state, lens, targets=None, start=None, steps=None):
    """Teacher forcing over ``targets`` or greedy decoding from ``start``."""
    table = to_np(decoder.embedding.embeddings)
    att = decoder.attention
    w_q, w_k, w_v = (to_np(w) for w in (att.w_q, att.w_k, att.w_v))
    kernel, bias = to_np(decoder.output_layer.kernel), to_np(decoder.output_layer.bias)
    h, logits, weights, tokens = state, [], [], []
    token = None if start is None else np.full(enc_out.shape[0], start)
    for t in range(targets.shape[1] if targets is not None else steps):
        token = targets[:, t] if targets is not None else token
        scores = ref.additive_scores(h[:, None, :], enc_out, w_q, w_k, w_v)
        context, w = ref.attention(scores, enc_out, valid_lens=lens)
        h = gru_step(np.concatenate([table[token], context[:, 0]], -1), h, decoder.cell)
        step_logits = h @ kernel + bias
        top2 = np.sort(step_logits, -1)[:, -2:]
        assert np.all(top2[:, 1] - top2[:, 0] > 1e-5), "oracle logits nearly tied"
        token = step_logits.argmax(-1)
        logits.append(step_logits)
        weights.append(w[:, 0])
        tokens.append(token)
    return np.stack(logits, 1), np.stack(weights, 1), np.stack(tokens, 1)


def built_pair(dtype, vocab=11, src_len=6, hidden=8, enc_hidden=8):
    encoder = layers.Seq2SeqEncoder(vocab, 5, enc_hidden, dtype=dtype)
    decoder = layers.Seq2SeqAttentionDecoder(vocab, 4, hidden, attention_units=7, dtype=dtype)
    src = RNG.integers(0, vocab, (3, src_len)).astype("int32")
    out, state = encoder(src)
    decoder(src[:, :2], out, state)
    randomise(encoder)
    randomise(decoder)
    return encoder, decoder


@pytest.mark.parametrize("dtype", FLOATS)
def test_encoder_against_oracle(dtype):
    encoder, _ = built_pair(dtype)
    src = RNG.integers(0, 11, (3, 6)).astype("int32")
    lens = np.array([6, 3, 1], "int32")
    out, state = encoder(src, valid_lens=lens)
    want_out, want_state = encoder_oracle(encoder, src, lens)
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    assert_close(state, want_state, dtype, SEQ_TOL)
    valid = np.arange(6)[None, :] < lens[:, None]
    assert_close(to_np(out)[valid], want_out[valid], dtype, SEQ_TOL)


@pytest.mark.parametrize("dtype", FLOATS)
def test_decoder_teacher_forcing_against_oracle(dtype):
    _, decoder = built_pair(dtype)
    enc_out = RNG.standard_normal((3, 6, 8))
    state = RNG.standard_normal((3, 8))
    targets = RNG.integers(0, 11, (3, 5)).astype("int32")
    lens = np.array([6, 2, 0], "int32")  # the last row has no source: zero weights
    logits, weights = decoder(
        targets, cast(enc_out, dtype), cast(state, dtype), valid_lens=lens, return_weights=True
    )
    want_logits, want_weights, _ = decoder_oracle(decoder, enc_out, state, lens, targets=targets)
    assert tuple(logits.shape) == (3, 5, 11) and tuple(weights.shape) == (3, 5, 6)
    assert_close(weights, want_weights, dtype, SEQ_TOL)
    assert_close(logits, want_logits, dtype, SEQ_TOL)
    assert np.all(to_np(weights)[2] == 0.0)
    np.testing.assert_allclose(to_np(weights)[:2].sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("dtype", FLOATS)
def test_step_and_greedy_decode_against_oracle(dtype):
    _, decoder = built_pair(dtype)
    enc_out = RNG.standard_normal((3, 6, 8))
    state = RNG.standard_normal((3, 8))
    lens = np.array([4, 6, 1], "int32")
    args = (cast(enc_out, dtype), cast(state, dtype))
    tokens, weights = decoder.decode(*args, 1, 4, valid_lens=lens)
    want_logits, want_weights, want_tokens = decoder_oracle(
        decoder, enc_out, state, lens, start=1, steps=4
    )
    np.testing.assert_array_equal(to_np(tokens), want_tokens)
    assert keras.backend.standardize_dtype(tokens.dtype) == "int32"
    assert_close(weights, want_weights, dtype, SEQ_TOL)
    logits, new_state, w = decoder.step(np.ones(3, "int32"), *args, valid_lens=lens)
    assert_close(logits, want_logits[:, 0], dtype, SEQ_TOL)
    assert_close(w, want_weights[:, 0], dtype, SEQ_TOL)
    assert tuple(new_state.shape) == (3, 8)


def feature_map_case(dtype, query_rank, masked):
    layer = layers.FeatureMapAttention(6, dtype=dtype)
    qshape = (2, 5) if query_rank == 2 else (2, 3, 5)
    query = RNG.standard_normal(qshape)
    features = RNG.standard_normal((2, 3, 4, 7))
    mask = None
    if masked:
        mask = RNG.random((2, 3, 4)) > 0.5
        mask[1] = False  # a map with nothing to attend: zeros
    q, f = cast(query, dtype), cast(features, dtype)
    layer(q, f)
    randomise(layer)
    return layer, mask, q, f


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("query_rank", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_feature_map_attention_against_oracle(dtype, query_rank, masked):
    layer, mask, q, f = feature_map_case(dtype, query_rank, masked)
    context, weights = layer(q, f, mask=mask)
    att = layer.attention
    q3 = to_np(q)[:, None] if query_rank == 2 else to_np(q)
    keys = to_np(f).reshape(2, 12, 7)
    scores = ref.additive_scores(q3, keys, *(to_np(w) for w in (att.w_q, att.w_k, att.w_v)))
    want_c, want_w = ref.attention(
        scores, keys, mask=None if mask is None else mask.reshape(2, 1, 12)
    )
    want_w = want_w.reshape(2, -1, 3, 4)
    if query_rank == 2:
        want_c, want_w = want_c[:, 0], want_w[:, 0]
    assert keras.backend.standardize_dtype(context.dtype) == dtype
    assert tuple(weights.shape) == want_w.shape
    assert_close(weights, want_w, dtype, LAYER_TOL)
    assert_close(context, want_c, dtype, LAYER_TOL)
    if masked:
        assert np.all(to_np(weights)[1] == 0.0) and np.all(to_np(context)[1] == 0.0)


def seq2seq_model():
    src = keras.Input((6,), dtype="int32")
    lens = keras.Input((), dtype="int32")
    tgt = keras.Input((4,), dtype="int32")
    out, state = layers.Seq2SeqEncoder(9, 5, 8, dropout=0.1, seed=3)(src, valid_lens=lens)
    logits = layers.Seq2SeqAttentionDecoder(9, 4, 8, attention_units=6, dropout=0.2, seed=4)(
        tgt, out, state, valid_lens=lens
    )
    return keras.Model([src, lens, tgt], logits)


def feature_map_model():
    query = keras.Input((5,))
    features = keras.Input((3, 4, 7))
    context, weights = layers.FeatureMapAttention(6, dropout=0.1, seed=5)(query, features)
    return keras.Model([query, features], [keras.layers.Dense(2)(context), weights])


def model_inputs(kind, batch=3):
    if kind == "seq2seq":
        return [
            RNG.integers(0, 9, (batch, 6)).astype("int32"),
            np.array([6, 2, 4, 1][:batch], "int32"),
            RNG.integers(0, 9, (batch, 4)).astype("int32"),
        ]
    return [
        RNG.standard_normal((batch, 5)).astype("float32"),
        RNG.standard_normal((batch, 3, 4, 7)).astype("float32"),
    ]


MODELS = {"seq2seq": seq2seq_model, "feature_map": feature_map_model}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_keras_file_round_trip_is_exact(kind, tmp_path):
    model = MODELS[kind]()
    x = model_inputs(kind)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    for got, want in zip(keras.tree.flatten(loaded(x)), keras.tree.flatten(model(x))):
        np.testing.assert_array_equal(to_np(got), to_np(want))
    assert len(model.weights) == len(loaded.weights)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    for layer, twin in zip(model.layers, loaded.layers):
        assert layer.get_config() == twin.get_config()


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (layers.Seq2SeqEncoder, {"vocab_size": 9, "embed_dim": 5, "hidden_dim": 8}),
        (
            layers.Seq2SeqAttentionDecoder,
            {"vocab_size": 9, "embed_dim": 4, "hidden_dim": 8, "attention_units": 3},
        ),
        (layers.FeatureMapAttention, {"units": 6, "dropout": 0.25, "seed": 2}),
    ],
)
def test_config_round_trip(cls, kwargs):
    layer = cls(**kwargs)
    clone = cls.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    for key, value in kwargs.items():
        assert clone.get_config()[key] == value


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_training_step_updates_weights(kind):
    requires_grad()
    keras.utils.set_random_seed(0)
    model = MODELS[kind]()
    x = model_inputs(kind, batch=4)
    if kind == "seq2seq":
        y = RNG.integers(0, 9, (4, 4)).astype("int32")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        y = [RNG.standard_normal((4, 2)).astype("float32"), np.zeros((4, 3, 4), "float32")]
        loss = ["mse", None]
    # Adam: the attention kernels' first gradients are tiny (w_v starts small), and an SGD
    # step on them can vanish in float32 rounding; Adam moves every weight with a gradient.
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    before = [to_np(w) for w in model.trainable_weights]
    history = model.fit(x, y, epochs=2, batch_size=2, verbose=0)
    assert all(np.isfinite(history.history["loss"]))
    after = [to_np(w) for w in model.trainable_weights]
    changed = [not np.array_equal(a, b) for a, b in zip(before, after)]
    assert all(changed), f"weights not updated on {BACKEND}: {changed}"


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: layers.Seq2SeqEncoder(0, 4, 4), ValueError, "vocab_size.*received 0"),
        (lambda: layers.Seq2SeqEncoder(5, 4, 4, dropout=1.5), ValueError, "dropout.*1.5"),
        (lambda: layers.Seq2SeqEncoder(5, 4, 4, seed="a"), TypeError, "seed"),
        (lambda: layers.Seq2SeqAttentionDecoder(5, 4, 2.5), ValueError, "hidden_dim.*2.5"),
        (
            lambda: layers.Seq2SeqAttentionDecoder(5, 4, 4, attention_units=-1),
            ValueError,
            "attention_units.*-1",
        ),
        (lambda: layers.FeatureMapAttention(0), ValueError, "units.*received 0"),
        (lambda: layers.FeatureMapAttention(3, dropout=-0.1), ValueError, "dropout"),
    ],
)
def test_bad_constructor_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_bad_call_arguments():
    encoder = layers.Seq2SeqEncoder(9, 4, 8)
    with pytest.raises(TypeError, match=r"tokens.*integer.*float32"):
        encoder(np.zeros((2, 5), "float32"))
    with pytest.raises(ValueError, match="tokens"):
        encoder(np.zeros((2, 5, 1), "int32"))
    decoder = layers.Seq2SeqAttentionDecoder(9, 4, 8)
    out = cast(np.zeros((2, 5, 6)), "float32")
    state = cast(np.zeros((2, 8)), "float32")
    with pytest.raises(ValueError, match=r"state.*hidden_dim=8.*\(2, 3\)"):
        decoder(np.zeros((2, 3), "int32"), out, cast(np.zeros((2, 3)), "float32"))
    decoder(np.zeros((2, 3), "int32"), out, state)
    with pytest.raises(ValueError, match=r"enc_outputs.*width 6.*\(2, 5, 4\)"):
        decoder(np.zeros((2, 3), "int32"), cast(np.zeros((2, 5, 4)), "float32"), state)
    with pytest.raises(ValueError, match=r"steps.*received 0"):
        decoder.decode(out, state, 1, 0)
    with pytest.raises(ValueError, match="tokens"):
        decoder.step(np.zeros((2, 1), "int32"), out, state)
    fma = layers.FeatureMapAttention(4)
    query, grid = cast(np.zeros((2, 5)), "float32"), cast(np.zeros((2, 3, 4, 7)), "float32")
    with pytest.raises(ValueError, match=r"features.*\(2, 12, 7\)"):
        fma(query, cast(np.zeros((2, 12, 7)), "float32"))
    with pytest.raises(ValueError, match=r"mask.*\(2, 3, 4\).*\(2, 12\)"):
        fma(query, grid, mask=np.ones((2, 12), bool))

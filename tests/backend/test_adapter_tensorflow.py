"""The TensorFlow adapter (document 004) against the document's formulas, the oracle and the core.

The document's formulas are re-derived here in float64 NumPy (``doc_*``): the scaled logits
get ``mask * -1e9`` added (mask 1 = masked out) before a softmax over the keys.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

if keras.backend.backend() != "tensorflow":
    pytest.skip("the TensorFlow adapter runs on Keras' tensorflow backend", allow_module_level=True)

import tensorflow as tf
from _support import TOL, numeric_grad, rel_err, to_np
from multiattn.backends import tensorflow as adapter

from multiattn import layers
from multiattn import reference as ref

RNG = np.random.default_rng(4004)
GRAD_TOL = 1e-5
# Measured max relative errors, printed at the end of the module (run with -s to see them).
MEASURED: dict[str, float] = {}


def check(label: str, got, want, bound: float) -> None:
    err = rel_err(got if isinstance(got, np.ndarray) else to_np(got), want)
    MEASURED[label] = max(MEASURED.get(label, 0.0), err)
    assert err <= bound, f"{label}: max relative error {err:.3e} > {bound:.1e}"


def t(x, dtype: str = "float32") -> tf.Tensor:
    return tf.constant(np.asarray(x), dtype=dtype)


# --- the document's formulas, float64 NumPy ---------------------------------------------


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def doc_sdpa(q, k, v, mask):
    """``softmax(q k^T / sqrt(d_k) + mask * -1e9) v``.

    The document adds the -1e9 term in float32, where a masked logit rounds to a multiple
    of 64 (to -1e9 itself for logits below 32 in magnitude), which is what makes a fully
    masked row uniform. The masked entries are rounded the same way here; the others stay
    float64. (Without that rounding a fully masked row would come out as the unmasked
    softmax in float64, a precision artefact the adapter does not reproduce.)
    """
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(k.shape[-1])
    if mask is not None:
        m = np.broadcast_to(np.asarray(mask, np.float64), logits.shape)
        shifted = (logits + m * -1e9).astype(np.float32).astype(np.float64)
        logits = np.where(m == 1, shifted, logits)
    weights = softmax(logits)
    return weights @ v, weights


def dense_weights(layer) -> tuple[np.ndarray, np.ndarray]:
    return to_np(layer.kernel), to_np(layer.bias)


def doc_mha(v, k, q, mask, w, num_heads):
    """``w``: (kernel, bias) of ``wq``, ``wk``, ``wv``, ``dense``; contiguous heads."""

    def split(x):
        b, s, d = x.shape
        return x.reshape(b, s, num_heads, d // num_heads).transpose(0, 2, 1, 3)

    heads = [split(x @ w[n][0] + w[n][1]) for n, x in (("wq", q), ("wk", k), ("wv", v))]
    attention, weights = doc_sdpa(*heads, mask)
    b, _, s, _ = attention.shape
    concat = attention.transpose(0, 2, 1, 3).reshape(b, s, -1)
    return concat @ w["dense"][0] + w["dense"][1], weights


def mha_weights(mha) -> dict:
    return {n: dense_weights(getattr(mha, n)) for n in ("wq", "wk", "wv", "dense")}


def oracle_mha_weights(w: dict, num_heads: int) -> dict:
    """Dense kernels ``(E, d_model)`` as the oracle's ``(E, H, D)`` / ``(H, D, E_out)``."""
    out = {}
    for name, key in (("wq", "query"), ("wk", "key"), ("wv", "value")):
        kernel, bias = w[name]
        out[f"{key}_kernel"] = kernel.reshape(kernel.shape[0], num_heads, -1)
        out[f"{key}_bias"] = bias.reshape(num_heads, -1)
    kernel, bias = w["dense"]
    out["output_kernel"] = kernel.reshape(num_heads, -1, kernel.shape[1])
    out["output_bias"] = bias
    return out


def randomise(layer, scale: float = 0.5) -> None:
    for var in layer.weights:
        var.assign(RNG.standard_normal(tuple(var.shape)) * scale)


def padding_mask(lengths, seq: int) -> np.ndarray:
    """The document's padding mask ``(batch, 1, 1, seq)``: 1 beyond each length."""
    return (np.arange(seq)[None, :] >= np.asarray(lengths)[:, None]).astype(np.float32)[
        :, None, None, :
    ]


MASKS = {
    "none": lambda: None,
    "padding": lambda: padding_mask([3, 5], 5),
    "padding_empty": lambda: padding_mask([0, 2], 5),  # a whole sequence masked out
    "look_ahead": lambda: 1 - np.tril(np.ones((4, 5), np.float32), 1),  # (seq_q, seq_k)
    "random_rows": lambda: np.concatenate(
        [RNG.random((2, 2, 3, 5)) > 0.5, np.ones((2, 2, 1, 5), bool)], axis=2
    ).astype(np.float32),  # last query row fully masked in every head
}


def keep_of(mask, shape) -> np.ndarray:
    return np.ones(shape, bool) if mask is None else np.broadcast_to(mask == 0, shape)


# --- scaled_dot_product_attention ------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(MASKS))
def test_sdpa_matches_document_and_oracle(dtype, case):
    q, k, v = (
        t(RNG.standard_normal(s) * 2, dtype) for s in ((2, 2, 4, 6), (2, 2, 5, 6), (2, 2, 5, 3))
    )
    mask = MASKS[case]()
    out, weights = adapter.scaled_dot_product_attention(q, k, v, None if mask is None else t(mask))
    assert out.dtype == q.dtype and weights.dtype == q.dtype
    q64, k64, v64 = (to_np(a) for a in (q, k, v))
    want, want_w = doc_sdpa(q64, k64, v64, mask)
    check(f"scaled_dot_product_attention output vs document ({dtype})", out, want, TOL[dtype])
    check(
        f"scaled_dot_product_attention weights vs document ({dtype})", weights, want_w, TOL[dtype]
    )
    keep = keep_of(mask, (2, 2, 4, 5))
    rows = keep.any(-1)
    ref_out, ref_w = ref.scaled_dot_product_attention(q64, k64, v64, mask=keep)
    core_out, core_w = layers.DotProductAttention(dtype=dtype)(
        q, v, k, mask=keep, return_weights=True
    )
    for label, got, a, b in (
        ("output", out, ref_out, core_out),
        ("weights", weights, ref_w, core_w),
    ):
        got = to_np(got)
        check(
            f"scaled_dot_product_attention {label} vs oracle ({dtype})",
            got[rows],
            a[rows],
            TOL[dtype],
        )
        check(
            f"scaled_dot_product_attention {label} vs core layer ({dtype})",
            got[rows],
            to_np(b)[rows],
            TOL[dtype],
        )
    np.testing.assert_allclose(to_np(weights)[~rows], 0.2)  # the document: uniform
    np.testing.assert_array_equal(to_np(core_w)[~rows], 0.0)  # the core: zeros


def test_sdpa_equals_the_documents_float32_arithmetic():
    """The document's own float32 steps (matmul, += mask * -1e9, softmax), in TensorFlow."""
    q, k, v = (t(RNG.standard_normal(s)) for s in ((2, 1, 4, 8), (2, 1, 5, 8), (2, 1, 5, 3)))
    mask = t(MASKS["padding_empty"]())
    logits = tf.matmul(q, k, transpose_b=True) / tf.math.sqrt(8.0) + mask * -1e9
    want_w = tf.nn.softmax(logits, axis=-1)
    out, weights = adapter.scaled_dot_product_attention(q, k, v, mask)
    check(
        "scaled_dot_product_attention weights vs document in TF (float32)",
        weights,
        to_np(want_w),
        1e-6,
    )
    check(
        "scaled_dot_product_attention output vs document in TF (float32)",
        out,
        to_np(want_w @ v),
        1e-6,
    )
    # The document's uniform rows (batch 0 is fully padded): 0.2 up to TensorFlow's
    # rounding of its softmax, which differs between CPUs (0.19999999 without AVX-512).
    uniform = np.full(to_np(want_w)[0].shape, 0.2, np.float32)
    np.testing.assert_array_max_ulp(to_np(want_w)[0].astype(np.float32), uniform, maxulp=4)
    np.testing.assert_array_max_ulp(to_np(weights)[0].astype(np.float32), uniform, maxulp=4)


@pytest.mark.parametrize("case", ["padding_empty", "random_rows", "look_ahead"])
def test_sdpa_gradients(case):
    arrays = [RNG.standard_normal(s) for s in ((2, 2, 4, 3), (2, 2, 5, 3), (2, 2, 5, 2))]
    mask = MASKS[case]()
    c = RNG.standard_normal((2, 2, 4, 2))
    variables = [tf.Variable(t(a)) for a in arrays]
    with tf.GradientTape() as tape:
        out, _ = adapter.scaled_dot_product_attention(*variables, t(mask))
        loss = tf.reduce_sum(out * t(c))
    grads = tape.gradient(loss, variables)
    wants = numeric_grad(
        lambda q, k, v: float((doc_sdpa(q, k, v, mask)[0] * c).sum()),
        *(to_np(a) for a in variables),
    )
    for name, g, want in zip("qkv", grads, wants):
        check(
            f"scaled_dot_product_attention grad vs finite differences (float32) [{name}]",
            g,
            want,
            GRAD_TOL,
        )


def test_sdpa_accepts_integer_masks_and_numpy():
    q, k, v = (RNG.standard_normal(s).astype(np.float32) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 2)))
    mask = (RNG.random((2, 1, 5)) > 0.6).astype(np.int32)
    out, w = adapter.scaled_dot_product_attention(q, k, v, mask)
    want, want_w = doc_sdpa(q.astype(float), k.astype(float), v.astype(float), mask)
    check("scaled_dot_product_attention output vs document (float32)", out, want, TOL["float32"])
    check("scaled_dot_product_attention weights vs document (float32)", w, want_w, TOL["float32"])


# --- MultiHeadAttention ----------------------------------------------------------------


def build_mha(dtype: str, widths=(5, 6, 7), lengths=(4, 5)) -> adapter.MultiHeadAttention:
    mha = adapter.MultiHeadAttention(d_model=8, num_heads=2, dtype=dtype)
    ev, ek, eq = widths
    tq, tk = lengths
    mha(
        t(np.zeros((2, tk, ev)), dtype),
        t(np.zeros((2, tk, ek)), dtype),
        t(np.zeros((2, tq, eq)), dtype),
        None,
    )
    randomise(mha)
    return mha


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["none", "padding", "padding_empty", "look_ahead", "random_rows"])
def test_mha_matches_document_oracle_and_core(dtype, case):
    mha = build_mha(dtype)
    assert [w.path.split("/", 1)[1] for w in mha.weights] == [
        f"{n}/{p}" for n in ("wq", "wk", "wv", "dense") for p in ("kernel", "bias")
    ]
    v, k, q = (t(RNG.standard_normal(s), dtype) for s in ((2, 5, 5), (2, 5, 6), (2, 4, 7)))
    mask = MASKS[case]()
    out, weights = mha(v, k, q, None if mask is None else t(mask))  # the document's order
    assert tuple(out.shape) == (2, 4, 8) and tuple(weights.shape) == (2, 2, 4, 5)
    w = mha_weights(mha)
    v64, k64, q64 = (to_np(a) for a in (v, k, q))
    want, want_w = doc_mha(v64, k64, q64, mask, w, 2)
    tol = TOL[dtype]
    check(f"MultiHeadAttention output vs document ({dtype})", out, want, tol)
    check(f"MultiHeadAttention weights vs document ({dtype})", weights, want_w, TOL[dtype])
    keep = keep_of(mask, (2, 2, 4, 5))
    rows = keep.any(-1)  # (batch, heads, queries)
    oracle_w = oracle_mha_weights(w, 2)
    ref_out, ref_w = ref.multi_head_attention(q64, v64, k64, weights=oracle_w, mask=keep)
    core = core_mha(oracle_w, q, v, k, dtype)
    core_out, core_w = core(q, v, k, mask=keep, return_weights=True)
    out_rows = rows.all(1)  # queries whose rows are non-empty in every head
    check(
        f"MultiHeadAttention output vs oracle ({dtype})",
        to_np(out)[out_rows],
        ref_out[out_rows],
        tol,
    )
    check(
        f"MultiHeadAttention output vs core layer ({dtype})",
        to_np(out)[out_rows],
        to_np(core_out)[out_rows],
        tol,
    )
    check(
        f"MultiHeadAttention weights vs oracle ({dtype})",
        to_np(weights)[rows],
        ref_w[rows],
        TOL[dtype],
    )
    check(
        f"MultiHeadAttention weights vs core layer ({dtype})",
        to_np(weights)[rows],
        to_np(core_w)[rows],
        TOL[dtype],
    )
    np.testing.assert_allclose(to_np(weights)[~rows], 0.2)


def core_mha(oracle_w: dict, q, v, k, dtype: str = "float32") -> layers.MultiHeadAttention:
    """The core layer holding the adapter's weights (``oracle_mha_weights`` layout)."""
    core = layers.MultiHeadAttention(2, 4, output_dim=8, dtype=dtype)
    core(q, v, k)
    for name, value in oracle_w.items():
        getattr(core, name).assign(value)
    return core


def test_mha_split_heads_is_contiguous():
    mha = adapter.MultiHeadAttention(12, 3)
    x = RNG.standard_normal((2, 5, 12)).astype(np.float32)
    got = mha.split_heads(t(x), 2)
    assert tuple(got.shape) == (2, 3, 5, 4)
    np.testing.assert_array_equal(to_np(got), ref.split_heads(x, 3, "contiguous"))
    np.testing.assert_array_equal(to_np(got)[:, 1], x[..., 4:8].astype(float))


def test_mha_gradients():
    mha = build_mha("float32", widths=(3, 4, 5), lengths=(2, 3))
    mask = padding_mask([0, 2], 3)
    arrays = [RNG.standard_normal(s) for s in ((2, 3, 3), (2, 3, 4), (2, 2, 5))]
    c = RNG.standard_normal((2, 2, 8))
    variables = [tf.Variable(t(a)) for a in arrays]
    kernel = mha.wq.kernel
    with tf.GradientTape() as tape:
        out, _ = mha(*variables, t(mask))
        loss = tf.reduce_sum(out * t(c))
    grads = tape.gradient(loss, [*variables, kernel])
    w = mha_weights(mha)

    def loss_np(v, k, q, wq):
        return float((doc_mha(v, k, q, mask, {**w, "wq": (wq, w["wq"][1])}, 2)[0] * c).sum())

    wants = numeric_grad(loss_np, *(to_np(a) for a in variables), to_np(kernel))
    for name, g, want in zip(("v", "k", "q", "wq.kernel"), grads, wants):
        check(
            f"MultiHeadAttention grad vs finite differences (float32) [{name}]", g, want, GRAD_TOL
        )


# --- EncoderLayer ----------------------------------------------------------------------


def build_encoder(dtype: str = "float32", rate: float = 0.1) -> adapter.EncoderLayer:
    layer = adapter.EncoderLayer(8, 2, 16, rate, dtype=dtype)
    layer(t(np.zeros((2, 5, 8)), dtype), False, None)
    randomise(layer, 0.4)
    return layer


def encoder_weights(layer) -> dict:
    (w1, b1), (w2, b2) = (dense_weights(d) for d in layer.ffn.layers)
    return {
        "mha": mha_weights(layer.mha),
        "ffn": (w1, b1, w2, b2),
        "norm1": (to_np(layer.layernorm1.gamma), to_np(layer.layernorm1.beta)),
        "norm2": (to_np(layer.layernorm2.gamma), to_np(layer.layernorm2.beta)),
    }


def doc_encoder(x, mask, w, num_heads=2):
    attn, _ = doc_mha(x, x, x, mask, w["mha"], num_heads)
    out1 = ref.layer_norm(x + attn, *w["norm1"], 1e-6)
    return ref.layer_norm(out1 + ref.feed_forward(out1, *w["ffn"]), *w["norm2"], 1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["none", "padding", "padding_empty"])
def test_encoder_matches_document_oracle_and_core(dtype, case):
    layer = build_encoder(dtype)
    assert layer.layernorm1.epsilon == layer.layernorm2.epsilon == 1e-6
    assert [type(s).__name__ for s in layer.ffn.layers] == ["Dense", "Dense"]
    assert layer.ffn.layers[0].activation is keras.activations.relu
    x = t(RNG.standard_normal((2, 5, 8)), dtype)
    mask = MASKS[case]()
    got = layer(x, False, None if mask is None else t(mask))  # the document's (x, training, mask)
    w = encoder_weights(layer)
    x64 = to_np(x)
    tol = TOL[dtype]
    check(f"EncoderLayer output vs document ({dtype})", got, doc_encoder(x64, mask, w), tol)
    if case == "padding_empty":
        return  # the oracle and core give zero weights to the empty sequence
    oracle = {
        "attention": oracle_mha_weights(w["mha"], 2),
        "ffn_w1": w["ffn"][0],
        "ffn_b1": w["ffn"][1],
        "ffn_w2": w["ffn"][2],
        "ffn_b2": w["ffn"][3],
        "norm1_gamma": w["norm1"][0],
        "norm1_beta": w["norm1"][1],
        "norm2_gamma": w["norm2"][0],
        "norm2_beta": w["norm2"][1],
    }
    keep = None if mask is None else mask == 0
    want = ref.transformer_encoder_layer(x64, weights=oracle, num_heads=2, epsilon=1e-6, mask=keep)
    check(f"EncoderLayer output vs oracle ({dtype})", got, want, tol)
    core = core_encoder(w, x, dtype)
    core_mask = None if keep is None else keep[:, 0]  # (batch, 1, seq): the same for every head
    check(f"EncoderLayer output vs core layer ({dtype})", got, to_np(core(x, mask=core_mask)), tol)


def core_encoder(w: dict, x, dtype: str = "float32") -> layers.TransformerEncoderLayer:
    """The core layer holding the adapter's weights (``encoder_weights`` layout)."""
    core = layers.TransformerEncoderLayer(8, 2, 16, dtype=dtype)
    core(x)
    for name, value in oracle_mha_weights(w["mha"], 2).items():
        getattr(core.attention, name).assign(value)
    for var, value in zip(
        (core.ffn_1.kernel, core.ffn_1.bias, core.ffn_2.kernel, core.ffn_2.bias), w["ffn"]
    ):
        var.assign(value)
    for norm, (gamma, beta) in ((core.norm_1, w["norm1"]), (core.norm_2, w["norm2"])):
        norm.gamma.assign(gamma)
        norm.beta.assign(beta)
    return core


def test_gradients_match_the_core_layers():
    """Same weights, no empty rows: GradientTape gives the core layers' gradients."""
    mask = padding_mask([3, 5], 5)
    keep = mask == 0
    mha = build_mha("float32")
    v, k, q = (
        tf.Variable(RNG.standard_normal(s), dtype="float32")
        for s in ((2, 5, 5), (2, 5, 6), (2, 4, 7))
    )
    core = core_mha(oracle_mha_weights(mha_weights(mha), 2), q, v, k)
    c = t(RNG.standard_normal((2, 4, 8)))
    grads = []
    for fn in (lambda: mha(v, k, q, t(mask))[0], lambda: core(q, v, k, mask=keep[:, 0])):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(fn() * c)
        grads.append(tape.gradient(loss, [v, k, q]))
    for name, g, want in zip("vkq", *grads):
        check(f"MultiHeadAttention grad vs core layer (float32) [{name}]", g, to_np(want), 1e-6)
    encoder = build_encoder()
    x = tf.Variable(RNG.standard_normal((2, 5, 8)), dtype="float32")
    core = core_encoder(encoder_weights(encoder), x)
    c = t(RNG.standard_normal((2, 5, 8)))
    grads = []
    for fn in (lambda: encoder(x, False, t(mask)), lambda: core(x, mask=keep[:, 0])):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(fn() * c)
        grads.append(to_np(tape.gradient(loss, x)))
    check("EncoderLayer grad vs core layer (float32) [x]", grads[0], grads[1], 1e-6)


def test_encoder_dropout_only_in_training():
    layer = build_encoder(rate=0.5)
    x = t(RNG.standard_normal((2, 5, 8)))
    a, b = layer(x, False, None), layer(x, training=False)
    np.testing.assert_array_equal(to_np(a), to_np(b))
    assert np.abs(to_np(layer(x, True, None)) - to_np(a)).max() > 1e-3
    assert np.abs(to_np(layer(x, True)) - to_np(layer(x, True))).max() > 1e-3


# --- graphs and training ---------------------------------------------------------------


def test_tf_function_matches_eager():
    layer = build_encoder()
    x = t(RNG.standard_normal((2, 5, 8)))
    mask = t(MASKS["padding_empty"]())

    @tf.function
    def run(x_, m_):
        h = layer(x_, False, m_)
        out, w = layer.mha(h, h, h, m_)
        return out, w, adapter.scaled_dot_product_attention(x_, x_, x_, m_[:, 0])[1]

    graph = run(x, mask)
    h = layer(x, False, mask)
    eager = (
        *layer.mha(h, h, h, mask),
        adapter.scaled_dot_product_attention(x, x, x, mask[:, 0])[1],
    )
    for g, e in zip(graph, eager):
        check("tf.function vs eager (float32)", g, to_np(e), 1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="`mask` must hold only 0"):
        run(x, mask * 0.5)


class DocumentStyleModel(keras.Model):
    """A model written as the document's code would use the layers."""

    def __init__(self):
        super().__init__()
        self.encoder = adapter.EncoderLayer(8, 2, 16, rate=0.1)
        self.head = keras.layers.Dense(1)

    def call(self, inputs, training=None):
        x, mask = inputs
        h = self.encoder(x, training, mask)
        return self.head(keras.ops.mean(h, axis=1))


@pytest.mark.parametrize("jit_compile", ["auto", True], ids=["auto", "xla"])
def test_model_fit_trains(jit_compile):
    x = RNG.standard_normal((32, 5, 8)).astype(np.float32)
    mask = padding_mask(RNG.integers(1, 6, 32), 5)
    y = x[:, 0, :1] - x[:, 1, 1:2]
    model = DocumentStyleModel()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=jit_compile)
    before = model.evaluate((x, mask), y, verbose=0)
    history = model.fit((x, mask), y, epochs=15, batch_size=8, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert model.evaluate((x, mask), y, verbose=0) < 0.7 * before
    inputs = keras.Input((5, 8))  # and the functional API
    functional = keras.Model(inputs, adapter.EncoderLayer(8, 2, 16)(inputs))
    assert tuple(functional(x[:2]).shape) == (2, 5, 8)


def test_config_and_keras_file_round_trip(tmp_path):
    for layer in (adapter.MultiHeadAttention(8, 2), adapter.EncoderLayer(8, 2, 16, rate=0.2)):
        clone = type(layer).from_config(layer.get_config())
        assert clone.get_config() == layer.get_config()
    inputs = keras.Input((5, 8))
    model = keras.Model(inputs, adapter.EncoderLayer(8, 2, 16)(inputs))
    model.save(tmp_path / "encoder.keras")
    loaded = keras.saving.load_model(tmp_path / "encoder.keras")
    x = RNG.standard_normal((2, 5, 8)).astype(np.float32)
    np.testing.assert_array_equal(to_np(model(x)), to_np(loaded(x)))


# --- bad input -------------------------------------------------------------------------

Q4 = np.zeros((2, 2, 3, 4), np.float32)
K4 = np.zeros((2, 2, 5, 4), np.float32)
V4 = np.zeros((2, 2, 5, 6), np.float32)


def sdpa(q=Q4, k=K4, v=V4, mask=None):
    return adapter.scaled_dot_product_attention(t(q), t(k), t(v), mask)


def built_mha():
    mha = adapter.MultiHeadAttention(8, 2)
    x = t(np.zeros((2, 5, 8)))
    mha(x, x, x, None)
    return mha


BAD = {
    "fractional_mask": (
        lambda: sdpa(mask=t(np.full((2, 1, 1, 5), 0.5))),
        ValueError,
        ["`mask`", "0 (attend) and 1 (masked out)", "0.5"],
    ),
    "bool_mask": (lambda: sdpa(mask=tf.ones((2, 1, 1, 5), tf.bool)), TypeError, ["`mask`", "bool"]),
    "mask_not_broadcastable": (
        lambda: sdpa(mask=t(np.zeros((3, 1, 1, 5)))),
        ValueError,
        ["`mask`", "(3, 1, 1, 5)", "(2, 2, 3, 5)"],
    ),
    "depths": (
        lambda: sdpa(k=np.zeros((2, 2, 5, 3), np.float32)),
        ValueError,
        ["`q` and `k`", "(2, 2, 3, 4)", "(2, 2, 5, 3)"],
    ),
    "kv_lengths": (
        lambda: sdpa(v=np.zeros((2, 2, 4, 6), np.float32)),
        ValueError,
        ["`k` and `v`", "(2, 2, 4, 6)"],
    ),
    "rank": (lambda: sdpa(q=np.zeros((4,), np.float32)), ValueError, ["`q`", "(4,)"]),
    "lead_axes": (
        lambda: sdpa(q=np.zeros((3, 2, 3, 4), np.float32)),
        ValueError,
        ["leading", "(3, 2, 3, 4)"],
    ),
    "d_model_heads": (
        lambda: adapter.MultiHeadAttention(10, 3),
        ValueError,
        ["`d_model` (10)", "`num_heads` (3)"],
    ),
    "encoder_d_model_heads": (
        lambda: adapter.EncoderLayer(10, 4, 16),
        ValueError,
        ["`d_model` (10)", "`num_heads` (4)"],
    ),
    "rate": (lambda: adapter.EncoderLayer(8, 2, 16, rate=1.5), ValueError, ["`rate`", "1.5"]),
    "mha_width": (
        lambda: built_mha()(
            t(np.zeros((2, 5, 8))), t(np.zeros((2, 5, 8))), t(np.zeros((2, 4, 6))), None
        ),
        ValueError,
        ["`q`", "width 8", "(2, 4, 6)"],
    ),
    "mha_kv_lengths": (
        lambda: built_mha()(
            t(np.zeros((2, 5, 8))), t(np.zeros((2, 4, 8))), t(np.zeros((2, 4, 8))), None
        ),
        ValueError,
        ["`k` and `v`", "(2, 4, 8)", "(2, 5, 8)"],
    ),
    "mha_rank": (
        lambda: built_mha()(
            t(np.zeros((2, 5, 8))), t(np.zeros((2, 5, 8))), t(np.zeros((4, 8))), None
        ),
        ValueError,
        ["`q`", "(4, 8)"],
    ),
    "mha_mask": (
        lambda: built_mha()(*(t(np.zeros((2, 5, 8))),) * 3, t(np.zeros((2, 3, 5, 5)))),
        ValueError,
        ["MultiHeadAttention", "`mask`", "(2, 3, 5, 5)"],
    ),
    "encoder_width": (
        lambda: adapter.EncoderLayer(8, 2, 16)(t(np.zeros((2, 5, 6))), False, None),
        ValueError,
        ["`x`", "d_model=8", "(2, 5, 6)"],
    ),
    "keras_style_mask": (
        lambda: adapter.EncoderLayer(8, 2, 16)(
            t(np.zeros((2, 5, 8))), False, tf.ones((2, 1, 1, 5), tf.bool)
        ),
        TypeError,
        ["`mask`", "polarity"],
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_argument(case):
    fn, exc, fragments = BAD[case]
    with pytest.raises(exc) as info:
        fn()
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_zz_report_measured_errors():
    """Prints the measured errors (pytest -s); runs last in this module."""
    for label, err in sorted(MEASURED.items()):
        print(f"{label}: {err:.2e}")
    assert MEASURED

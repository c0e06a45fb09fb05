"""multiattn.port in the Paddle worker (paddle first, Keras numpy backend, no TensorFlow):
paddle.nn.MultiHeadAttention / TransformerEncoderLayer and the PaddlePaddle document's
MultiHeadAttention (interleaved heads) converted to and from multiattn.layers and torch.nn;
weights come back bit-identical, outputs agree with each other and the float64 oracle."""

from __future__ import annotations

import keras
import multiattn.backends.paddle as doc
import numpy as np
import paddle
import pytest
from _port_oracle import (
    ORACLE_RTOL,
    PAIR_RTOL,
    assert_same_weights,
    compare,
    inputs,
    oracle_encoder,
    oracle_mha,
)

from multiattn import port


def _np(x) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(x) if not isinstance(x, paddle.Tensor) else
                      x.numpy())  # fmt: skip


def _randomise(layer, seed: int = 0) -> None:
    """Random parameters (LayerNorm scales around 1): paddle initialises biases to 0."""
    rng = np.random.default_rng(seed)
    for name, p in layer.named_parameters():
        noise = rng.normal(0.0, 1.0, p.shape).astype("float32")
        scale = "norm" in name and name.endswith("weight")
        p.set_value(1.0 + 0.1 * noise if scale else 0.5 * noise)


def _shape_config(pw) -> dict:
    return {k: v for k, v in pw.config.items() if k not in ("dropout", "norm_first", "epsilon",
                                                            "activation")}  # fmt: skip


PADDLE_MHA = {
    "self": dict(),
    "kdim_vdim": dict(kdim=5, vdim=3),
    "no_bias": dict(bias_attr=False),
}


@pytest.mark.parametrize("case", list(PADDLE_MHA))
def test_paddle_mha_multiattn(backend, case):
    m = paddle.nn.MultiHeadAttention(8, 2, **PADDLE_MHA[case])
    m.eval()
    _randomise(m)
    source = port.get_weights(m)
    other = port.convert(m, "multiattn")
    back = port.convert(other, "paddle")
    assert_same_weights(port.get_weights(back), source)
    for (na, a), (nb, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert na == nb and np.array_equal(a.numpy(), b.numpy()), na
    q, k, v = inputs((2, 3, 8), (2, 4, m.kdim), (2, 4, m.vdim))
    a = _np(m(*(paddle.to_tensor(t) for t in (q, k, v))))
    compare(f"paddle-multiattn mha {case}", a, _np(other(q, v, k)), PAIR_RTOL)
    compare(f"paddle-oracle mha {case}", a, oracle_mha(source.weights, q, v, k), ORACLE_RTOL)


@pytest.mark.parametrize("normalize_before", [False, True])
def test_paddle_encoder_multiattn(backend, normalize_before):
    m = paddle.nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, activation="gelu",
                                          normalize_before=normalize_before)  # fmt: skip
    m.eval()
    _randomise(m, seed=1)
    source = port.get_weights(m)
    assert source.config["norm_first"] is normalize_before
    assert source.config["activation"] == "gelu" and source.config["epsilon"] == 1e-5
    other = port.convert(m, "multiattn")
    back = port.convert(other, "paddle")
    assert back.normalize_before is normalize_before
    assert_same_weights(port.get_weights(back), source)
    (x,) = inputs((2, 5, 8))
    a = _np(m(paddle.to_tensor(x)))
    name = "pre-LN" if normalize_before else "post-LN"
    compare(f"paddle-multiattn encoder {name}", a, _np(other(x)), PAIR_RTOL)
    compare(f"paddle-oracle encoder {name}", a, oracle_encoder(source.weights, source.config, x),
            ORACLE_RTOL)  # fmt: skip


def test_paddle_document_mha_interleaved_heads(backend):
    m = doc.MultiHeadAttention(query_size=4, query_vec_size=6, hidden_vec_size=3,
                               output_vec_size=5, head_num=2)  # fmt: skip
    _randomise(m, seed=2)
    source = port.get_weights(m)
    # feature f of W_q belongs to head f % 2 at depth f // 2
    wq = m.W_q.weight.numpy()
    assert np.array_equal(source.weights["query/kernel"][:, 1, 2], wq[:, 2 * 2 + 1])
    other = port.convert(m, "multiattn")
    back = port.convert(other, "paddle-doc", query_size=4)
    assert_same_weights(port.get_weights(back), source)
    q, k, v = inputs((2, 4, 6), (2, 4, 6), (2, 4, 6))
    a = _np(m(*(paddle.to_tensor(t) for t in (q, k, v))))
    compare("paddle-doc-multiattn mha", a, _np(other(q, v, k)), PAIR_RTOL)
    compare("paddle-doc-oracle mha", a, oracle_mha(source.weights, q, v, k), ORACLE_RTOL)
    with pytest.raises(ValueError, match="query_size"):
        port.convert(other, "paddle-doc")


def test_paddle_torch_pairs(backend):
    torch = pytest.importorskip("torch")
    m = paddle.nn.MultiHeadAttention(6, 3, kdim=4, vdim=5)
    m.eval()
    _randomise(m, seed=3)
    t = port.convert(m, "torch").eval()
    back = port.convert(t, "paddle")
    assert_same_weights(port.get_weights(back), port.get_weights(m))
    q, k, v = inputs((2, 3, 6), (2, 4, 4), (2, 4, 5))
    a = _np(m(*(paddle.to_tensor(x) for x in (q, k, v))))
    with torch.no_grad():
        b = t(*(torch.from_numpy(x) for x in (q, k, v)), need_weights=False)[0].numpy()
    compare("paddle-torch mha", a, b, PAIR_RTOL)

    e = paddle.nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, normalize_before=True)
    e.eval()
    _randomise(e, seed=4)
    te = port.convert(e, "torch").eval()
    assert te.norm_first and te.self_attn.batch_first
    assert_same_weights(port.get_weights(port.convert(te, "paddle")), port.get_weights(e))
    (x,) = inputs((2, 5, 8))
    with torch.no_grad():
        b = te(torch.from_numpy(x)).numpy()
    compare("paddle-torch encoder pre-LN", _np(e(paddle.to_tensor(x))), b, PAIR_RTOL)

    d = doc.MultiHeadAttention(4, 8, 4, 8, 2)
    _randomise(d, seed=5)
    td = port.convert(d, "torch").eval()
    assert_same_weights(port.get_weights(port.convert(td, "paddle-doc", query_size=4)),
                        port.get_weights(d))  # fmt: skip
    q, k, v = inputs((2, 4, 8), (2, 4, 8), (2, 4, 8))
    with torch.no_grad():
        b = td(*(torch.from_numpy(x) for x in (q, k, v)), need_weights=False)[0].numpy()
    compare("paddle-doc-torch mha", _np(d(*(paddle.to_tensor(x) for x in (q, k, v)))), b,
            PAIR_RTOL)  # fmt: skip


def test_paddle_keras_mha(backend):
    m = paddle.nn.MultiHeadAttention(8, 4, kdim=6, vdim=6)
    m.eval()
    _randomise(m, seed=6)
    k = port.convert(m, "keras")
    assert type(k) is keras.layers.MultiHeadAttention
    assert_same_weights(port.get_weights(port.convert(k, "paddle")), port.get_weights(m))
    q, kk, v = inputs((2, 3, 8), (2, 4, 6), (2, 4, 6))
    a = _np(m(*(paddle.to_tensor(x) for x in (q, kk, v))))
    compare("paddle-keras mha", a, _np(k(q, v, kk)), PAIR_RTOL)


# --- grouped key/value heads and rotary position embedding ---------------------------


def _settings_layer(seed: int, **settings):
    """A built multiattn layer (Keras numpy backend in this worker) with random weights."""
    from _port_oracle import random_weights

    from multiattn.layers import MultiHeadAttention

    h = 4 if "num_key_value_heads" in settings else 2
    layer = MultiHeadAttention(h, 8 // h, **settings)
    layer.build((None, None, 8), (None, None, 8), (None, None, 8))
    config = port.get_weights(layer).config
    port.set_weights(layer, port.PortableWeights("mha", config, random_weights(
        "mha", {k: v for k, v in config.items() if k != "dropout"}, seed=seed)))  # fmt: skip
    return layer


def test_paddle_refuses_grouped_and_rotary(backend):
    grouped = _settings_layer(51, num_key_value_heads=2)
    rotary = _settings_layer(52, rotary_max_length=16, rotary_base=500.0)
    with pytest.raises(ValueError, match=r"convert\(to='paddle'\): paddle\.nn\.MultiHeadAttention "
                                         r"has no grouped key/value heads; received "
                                         r"num_key_value_heads=2 \(num_heads=4\)"):  # fmt: skip
        port.convert(grouped, "paddle")
    with pytest.raises(ValueError, match=r"paddle\.nn\.MultiHeadAttention has no rotary position "
                                         r"embedding; received rotary_max_length=16"):  # fmt: skip
        port.convert(rotary, "paddle")
    with pytest.raises(ValueError, match=r"PaddlePaddle document's MultiHeadAttention has no "
                                         r"grouped key/value heads"):  # fmt: skip
        port.convert(grouped, "paddle-doc", query_size=4)
    with pytest.raises(ValueError, match=r"document's MultiHeadAttention has no rotary"):
        port.convert(rotary, "paddle-doc", query_size=4)
    m = paddle.nn.MultiHeadAttention(8, 2)
    before = {k: v.numpy().copy() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=r"weights have rotary_max_length=16, the module "
                                         r"\(MultiHeadAttention\) has rotary_max_length=None"):  # fmt: skip
        port.set_weights(m, port.get_weights(rotary))
    assert all(np.array_equal(v.numpy(), before[k]) for k, v in m.state_dict().items())


def test_grouped_and_rotary_round_trip_in_the_paddle_worker(backend):
    """The neutral layout keeps the settings in this process too: converted layers give
    identical outputs, and agree with the float64 oracle."""
    from _port_oracle import _mha_ref

    from multiattn import reference

    q, kv = inputs((2, 5, 8), (2, 6, 8), seed=9)
    for layer, base in ((_settings_layer(53, num_key_value_heads=1), None),
                        (_settings_layer(54, rotary_max_length=8, rotary_base=100.0), 100.0)):  # fmt: skip
        source = port.get_weights(layer)
        other = port.convert(layer, "multiattn")
        assert_same_weights(port.get_weights(other), source)
        a = _np(layer(q, kv))
        assert np.array_equal(a, _np(other(q, kv)))
        want, _ = reference.multi_head_attention(q, kv, weights=_mha_ref(source.weights),
                                                 rotary_base=base)  # fmt: skip
        compare(f"paddle worker settings {source.config}", a, want, ORACLE_RTOL)

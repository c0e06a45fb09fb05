"""multiattn.port in a Keras backend worker: every module pair that can live in this
process is converted both ways; weights come back bit-identical and the two modules (and
the float64 oracle) agree on the same inputs.

* every backend: multiattn.layers <-> keras.layers.MultiHeadAttention;
* torch: torch.nn.MultiheadAttention / TransformerEncoderLayer <-> multiattn and Keras,
  the PyTorch document's AdditiveAttention <-> multiattn.layers.AdditiveAttention;
* tensorflow: the TensorFlow document's MultiHeadAttention / EncoderLayer <-> multiattn;
* jax: flax.nnx.MultiHeadAttention <-> multiattn, Keras and torch.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _port_oracle import (
    ORACLE_RTOL,
    PAIR_RTOL,
    assert_same_weights,
    compare,
    inputs,
    oracle_additive,
    oracle_encoder,
    oracle_mha,
    random_weights,
)
from _support import BACKEND, to_np

from multiattn import port
from multiattn.layers import AdditiveAttention, MultiHeadAttention, TransformerEncoderLayer

MHA_CASES = {
    "self": dict(num_heads=2, key_dim=4, widths=(8, 8, 8)),
    "cross": dict(num_heads=3, key_dim=2, value_dim=5, output_dim=7, widths=(6, 5, 4)),
    "no_bias": dict(num_heads=2, key_dim=3, use_bias=False, widths=(4, 5, 6)),
}


def _mha(case: dict) -> tuple[MultiHeadAttention, tuple]:
    case = dict(case)
    e_q, e_k, e_v = case.pop("widths")
    layer = MultiHeadAttention(**case)
    port.set_weights(layer, random_weights("mha", _neutral_config(layer, e_q, e_k, e_v)))
    return layer, inputs((2, 3, e_q), (2, 5, e_k), (2, 5, e_v))


def _neutral_config(layer: MultiHeadAttention, e_q: int, e_k: int, e_v: int) -> dict:
    return {
        "num_heads": layer.num_heads,
        "key_dim": layer.key_dim,
        "value_dim": layer.value_dim,
        "query_width": e_q,
        "key_width": e_k,
        "value_width": e_v,
        "output_width": layer.output_dim or e_q,
        "use_bias": layer.use_bias,
    }


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multiattn_keras_mha(backend, case):
    layer, (q, k, v) = _mha(MHA_CASES[case])
    source = port.get_weights(layer)
    other = port.convert(layer, "keras")
    assert type(other) is keras.layers.MultiHeadAttention
    back = port.convert(other, "multiattn")
    assert_same_weights(port.get_weights(back), source)
    a = to_np(layer(q, v, k))
    # keras.layers.MultiHeadAttention cannot run value_dim != key_dim on the jax backend
    # (its jax dot_product_attention reshapes the values with the key width); the weights
    # still round-trip above, and multiattn is checked against the oracle below.
    if not (BACKEND == "jax" and layer.value_dim != layer.key_dim):
        compare(f"multiattn-keras mha {case} [{BACKEND}]", a, to_np(other(q, v, k)), PAIR_RTOL)
    compare(f"multiattn-oracle mha {case} [{BACKEND}]", a, oracle_mha(source.weights, q, v, k),
            ORACLE_RTOL)  # fmt: skip


def test_set_weights_builds_unbuilt_layer_and_checks_shapes(backend):
    config = {"d_model": 8, "num_heads": 2, "dff": 12}
    w = random_weights("encoder", config)
    layer = TransformerEncoderLayer(8, 2, 12)
    port.set_weights(layer, w)
    assert layer.built
    assert_same_weights(port.get_weights(layer), w)
    bad = dict(w, **{"attention/key/bias": np.zeros((2, 5), np.float32)})
    with pytest.raises(ValueError, match=r"'attention/key/bias' must have shape \(2, 4\); "
                                         r"received \(2, 5\)"):  # fmt: skip
        port.set_weights(layer, bad)
    with pytest.raises(ValueError, match=r"kind 'encoder'.*kind 'mha'"):
        port.set_weights(MultiHeadAttention(2, 4), port.get_weights(layer))


def test_encoder_keras_save_load_after_set_weights(backend, tmp_path):
    config = {"d_model": 4, "num_heads": 2, "dff": 6}
    layer = TransformerEncoderLayer(4, 2, 6, norm_first=True)
    port.set_weights(layer, random_weights("encoder", config, seed=3))
    model = keras.Sequential([keras.Input((3, 4)), layer])
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert_same_weights(port.get_weights(loaded.layers[0]), port.get_weights(layer))


# --- torch -------------------------------------------------------------------------------

torch_only = pytest.mark.skipif(BACKEND != "torch", reason="torch.nn modules: torch worker")


def _randomise(module, seed: int = 0) -> None:
    """Random parameters (LayerNorm scales around 1): torch initialises biases to 0."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            norm_scale = "norm" in name and name.endswith("weight")
            p.copy_(1.0 + 0.1 * noise if norm_scale else 0.5 * noise)


TORCH_MHA = {
    "packed": dict(kdim=None, vdim=None, bias=True, batch_first=True),
    "packed_seq_first_no_bias": dict(kdim=None, vdim=None, bias=False, batch_first=False),
    "separate": dict(kdim=5, vdim=3, bias=True, batch_first=True),
    "separate_seq_first": dict(kdim=6, vdim=8, bias=True, batch_first=False),
}


def _torch_mha_out(m, q, k, v):
    import torch

    t = [torch.from_numpy(a) for a in (q, k, v)]
    if not m.batch_first:
        t = [a.transpose(0, 1) for a in t]
    out = m(*t, need_weights=False)[0]
    return (out if m.batch_first else out.transpose(0, 1)).detach().numpy()


@torch_only
@pytest.mark.parametrize("case", list(TORCH_MHA))
@pytest.mark.parametrize("to", ["multiattn", "keras"])
def test_torch_mha(backend, case, to):
    import torch

    m = torch.nn.MultiheadAttention(8, 2, **TORCH_MHA[case]).eval()
    _randomise(m)
    q, k, v = inputs((2, 3, 8), (2, 4, m.kdim), (2, 4, m.vdim))
    source = port.get_weights(m)
    other = port.convert(m, to)
    back = port.convert(other, "torch", batch_first=m.batch_first).eval()
    assert back._qkv_same_embed_dim == m._qkv_same_embed_dim
    for (na, a), (nb, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert na == nb and torch.equal(a, b), na
    a, b = _torch_mha_out(m, q, k, v), to_np(other(q, v, k))
    compare(f"torch-{to} mha {case}", a, b, PAIR_RTOL)
    compare(f"torch-oracle mha {case}", a, oracle_mha(source.weights, q, v, k), ORACLE_RTOL)


@torch_only
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_torch_encoder(backend, norm_first, activation):
    import torch

    m = torch.nn.TransformerEncoderLayer(8, 2, 12, batch_first=True, norm_first=norm_first,
                                         activation=activation).eval()  # fmt: skip
    _randomise(m, seed=1)
    (x,) = inputs((2, 5, 8))
    source = port.get_weights(m)
    assert source.config == {
        "d_model": 8,
        "num_heads": 2,
        "dff": 12,
        "dropout": 0.1,
        "norm_first": norm_first,
        "epsilon": 1e-5,
        "activation": activation,
    }
    other = port.convert(m, "multiattn")
    assert other.norm_first is norm_first and other.epsilon == 1e-5
    back = port.convert(other, "torch").eval()
    for (na, a), (nb, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert na == nb and torch.equal(a, b), na
    with torch.no_grad():
        a = m(torch.from_numpy(x)).numpy()
    name = f"{'pre' if norm_first else 'post'}-LN {activation}"
    compare(f"torch-multiattn encoder {name}", a, to_np(other(x)), PAIR_RTOL)
    compare(f"torch-oracle encoder {name}", a, oracle_encoder(source.weights, source.config, x),
            ORACLE_RTOL)  # fmt: skip


@torch_only
def test_torch_mha_and_keras_mha_directly(backend):
    import torch

    m = torch.nn.MultiheadAttention(6, 3, kdim=4, vdim=5, batch_first=True).eval()
    _randomise(m, seed=2)
    k_layer = port.convert(m, "keras")
    back = port.convert(k_layer, "torch").eval()
    assert_same_weights(port.get_weights(back), port.get_weights(m))
    q, k, v = inputs((2, 3, 6), (2, 4, 4), (2, 4, 5))
    compare("torch-keras mha direct", _torch_mha_out(m, q, k, v), to_np(k_layer(q, v, k)),
            PAIR_RTOL)  # fmt: skip


@torch_only
def test_torch_document_additive_attention(backend):
    import multiattn.backends.torch as doc
    import torch

    m = doc.AdditiveAttention(key_size=3, query_size=5, num_hiddens=4, dropout=0.0).eval()
    _randomise(m, seed=3)
    source = port.get_weights(m)
    other = port.convert(m, "multiattn")
    assert type(other) is AdditiveAttention
    back = port.convert(other, "torch-doc").eval()
    assert_same_weights(port.get_weights(back), source)
    q, k, v = inputs((2, 2, 5), (2, 6, 3), (2, 6, 4))
    with torch.no_grad():
        a = m(*(torch.from_numpy(t) for t in (q, k, v))).numpy()
    compare("torch-doc-multiattn additive", a, to_np(other(q, v, k)), PAIR_RTOL)
    compare("torch-doc-oracle additive", a, oracle_additive(source.weights, q, v, k), ORACLE_RTOL)


@torch_only
def test_torch_refusals(backend):
    import torch

    with pytest.raises(ValueError, match="add_bias_kv"):
        port.get_weights(torch.nn.MultiheadAttention(4, 2, add_bias_kv=True))
    layer, _ = _mha(MHA_CASES["cross"])
    with pytest.raises(ValueError, match=r"torch\.nn\.MultiheadAttention needs key_dim"):
        port.convert(layer, "torch")
    with pytest.raises(TypeError, match=r"unsupported module of type torch\.nn\.modules\.linear"):
        port.get_weights(torch.nn.Linear(2, 3))


# --- tensorflow ------------------------------------------------------------------------

tf_only = pytest.mark.skipif(BACKEND != "tensorflow", reason="document 004: tensorflow worker")


@tf_only
def test_tensorflow_document_mha(backend):
    import multiattn.backends.tensorflow as doc

    m = doc.MultiHeadAttention(d_model=8, num_heads=2)
    q, k, v = inputs((2, 3, 6), (2, 4, 5), (2, 4, 7))
    m(v, k, q, None)
    w = random_weights("mha", port.get_weights(m).config, seed=4)
    port.set_weights(m, w)
    other = port.convert(m, "multiattn")
    back = port.convert(other, "tensorflow-doc")
    assert type(back) is doc.MultiHeadAttention
    assert_same_weights(port.get_weights(back), w)
    a = to_np(m(v, k, q, None)[0])
    compare("tensorflow-doc-multiattn mha", a, to_np(other(q, v, k)), PAIR_RTOL)
    compare("tensorflow-doc-oracle mha", a, oracle_mha(w, q, v, k), ORACLE_RTOL)


@tf_only
def test_tensorflow_document_encoder(backend):
    import multiattn.backends.tensorflow as doc

    m = doc.EncoderLayer(8, 2, 12, rate=0.0)
    (x,) = inputs((2, 5, 8))
    m(x, False, None)
    source = port.get_weights(m)
    port.set_weights(m, random_weights("encoder", source.config, seed=5))
    source = port.get_weights(m)
    other = port.convert(m, "multiattn")
    assert not other.norm_first and other.epsilon == 1e-6
    back = port.convert(other, "tensorflow-doc")
    assert_same_weights(port.get_weights(back), source)
    a = to_np(m(x, False, None))
    compare("tensorflow-doc-multiattn encoder", a, to_np(other(x)), PAIR_RTOL)
    compare("tensorflow-doc-oracle encoder", a, oracle_encoder(source.weights, source.config, x),
            ORACLE_RTOL)  # fmt: skip
    pre = TransformerEncoderLayer(8, 2, 12, norm_first=True)
    pre.build((None, None, 8))
    with pytest.raises(ValueError, match="post-LayerNorm"):
        port.convert(pre, "tensorflow-doc")


# --- jax / flax ------------------------------------------------------------------------

jax_only = pytest.mark.skipif(BACKEND != "jax", reason="flax.nnx: jax worker")


@jax_only
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("to", ["multiattn", "keras", "torch"])
def test_flax_mha(backend, use_bias, to):
    import jax.numpy as jnp
    from flax import nnx

    torch_target = to == "torch"
    m = nnx.MultiHeadAttention(2, 6, qkv_features=6 if torch_target else 8,
                               out_features=6 if torch_target else 5, in_kv_features=4,
                               use_bias=use_bias, decode=False, rngs=nnx.Rngs(0))  # fmt: skip
    config = port.get_weights(m).config
    w = random_weights("mha", {k: v for k, v in config.items() if k != "dropout"}, seed=6)
    port.set_weights(m, w)
    other = port.convert(m, to)
    back = port.convert(other, "flax")
    assert type(back) is nnx.MultiHeadAttention
    assert_same_weights(port.get_weights(back), w)
    q, k, v = inputs((2, 3, 6), (2, 4, 4), (2, 4, 4))
    a = np.asarray(m(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), deterministic=True))
    if torch_target:
        b = _torch_mha_out(other.eval(), q, k, v)
    else:
        b = to_np(other(q, v, k))
    compare(f"flax-{to} mha bias={use_bias}", a, b, PAIR_RTOL)
    compare(f"flax-oracle mha bias={use_bias}", a, oracle_mha(w, q, v, k), ORACLE_RTOL)


# --- grouped key/value heads and rotary position embedding (every backend) -------------

GROUPED_CASE = dict(num_heads=4, key_dim=2, num_key_value_heads=2)
ROTARY_CASE = dict(num_heads=2, key_dim=4, rotary_max_length=16, rotary_base=500.0)


def _oracle_settings(weights: dict, q, v, k=None, rotary_base=None) -> np.ndarray:
    """The float64 oracle with grouped heads (read from the kernels) and RoPE."""
    from _port_oracle import _mha_ref

    from multiattn import reference

    out, _ = reference.multi_head_attention(q, v, k, weights=_mha_ref(weights),
                                            rotary_base=rotary_base)  # fmt: skip
    return out


def _settings_layer(case: dict, widths: tuple, seed: int) -> MultiHeadAttention:
    layer = MultiHeadAttention(**case)
    config = _neutral_config(layer, *widths)
    if "num_key_value_heads" in case:
        config["num_key_value_heads"] = case["num_key_value_heads"]
    port.set_weights(layer, random_weights("mha", config, seed=seed))
    return layer


def test_grouped_round_trip_through_the_layout(backend):
    """A grouped layer's weights, config and outputs survive get_weights / convert /
    set_weights exactly; the key/value kernels have H_kv heads."""
    layer = _settings_layer(dict(GROUPED_CASE, value_dim=3, output_dim=5), (6, 7, 8), seed=31)
    source = port.get_weights(layer)
    assert source.config["num_key_value_heads"] == 2 and source.config["num_heads"] == 4
    assert source.weights["key/kernel"].shape == (7, 2, 2)
    assert source.weights["value/bias"].shape == (2, 3)
    other = port.convert(layer, "multiattn")
    assert other.num_key_value_heads == 2
    assert_same_weights(port.get_weights(other), source)
    fresh = MultiHeadAttention(4, 2, value_dim=3, output_dim=5, num_key_value_heads=2)
    port.set_weights(fresh, source)  # unbuilt: built from the weights' shapes
    q, k, v = inputs((2, 3, 6), (2, 5, 7), (2, 5, 8), seed=5)
    a = to_np(layer(q, v, k))
    assert np.array_equal(a, to_np(other(q, v, k))) and np.array_equal(a, to_np(fresh(q, v, k)))
    compare(f"grouped multiattn-oracle [{BACKEND}]", a, _oracle_settings(source.weights, q, v, k),
            ORACLE_RTOL)  # fmt: skip


def test_rotary_round_trip_through_the_layout(backend):
    layer = _settings_layer(ROTARY_CASE, (8, 8, 8), seed=32)
    source = port.get_weights(layer)
    assert source.config["rotary_max_length"] == 16 and source.config["rotary_base"] == 500.0
    other = port.convert(layer, "multiattn")
    assert other.rotary_max_length == 16 and other.rotary_base == 500.0
    assert_same_weights(port.get_weights(other), source)
    q, kv = inputs((2, 5, 8), (2, 7, 8), seed=6)
    a = to_np(layer(q, kv))
    assert np.array_equal(a, to_np(other(q, kv)))
    want = _oracle_settings(source.weights, q, kv, rotary_base=500.0)
    compare(f"rotary multiattn-oracle [{BACKEND}]", a, want, ORACLE_RTOL)
    # without the rotation the outputs differ: the setting matters
    assert not np.allclose(want, _oracle_settings(source.weights, q, kv), rtol=1e-3, atol=0)


def test_grouped_to_keras_group_query_attention(backend):
    """Keras' own layer with grouped heads is GroupQueryAttention (value_dim = key_dim,
    output width = query width)."""
    layer = _settings_layer(GROUPED_CASE, (8, 5, 6), seed=33)
    source = port.get_weights(layer)
    other = port.convert(layer, "keras")
    assert type(other) is keras.layers.GroupQueryAttention
    assert other.num_key_value_heads == 2 and other.num_query_heads == 4
    assert port.get_weights(other).config == source.config
    back = port.convert(other, "multiattn")
    assert back.num_key_value_heads == 2
    assert_same_weights(port.get_weights(back), source)
    q, k, v = inputs((2, 3, 8), (2, 4, 5), (2, 4, 6), seed=7)
    a = to_np(layer(q, v, k))
    compare(f"grouped multiattn-keras GQA [{BACKEND}]", a, to_np(other(q, v, k)), PAIR_RTOL)
    compare(f"grouped keras GQA-oracle [{BACKEND}]", to_np(other(q, v, k)),
            _oracle_settings(source.weights, q, v, k), ORACLE_RTOL)  # fmt: skip


def test_settings_refusals(backend):
    rotary = _settings_layer(ROTARY_CASE, (8, 8, 8), seed=34)
    with pytest.raises(ValueError, match=r"convert\(to='keras'\): .* no rotary position "
                                         r"embedding; received rotary_max_length=16"):  # fmt: skip
        port.convert(rotary, "keras")
    wide = _settings_layer(dict(GROUPED_CASE, value_dim=3), (8, 8, 8), seed=35)
    with pytest.raises(ValueError, match=r"GroupQueryAttention .* needs value_dim = key_dim.*"
                                         r"num_key_value_heads=2"):  # fmt: skip
        port.convert(wide, "keras")
    grouped = port.get_weights(_settings_layer(GROUPED_CASE, (8, 8, 8), seed=36))
    # set_weights into a layer with other settings is refused, naming the setting
    for layer, match in (
        (MultiHeadAttention(4, 2), r"weights have num_key_value_heads=2, .* has "
                                   r"num_key_value_heads=None \(= num_heads\)"),
        (MultiHeadAttention(4, 2, num_key_value_heads=1), r"num_key_value_heads=2, .* has "
                                                          r"num_key_value_heads=1"),
        (MultiHeadAttention(4, 2, num_key_value_heads=2, rotary_max_length=8),
         r"rotary_max_length=None \(no RoPE\), .* has rotary_max_length=8"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            port.set_weights(layer, grouped)
        assert not layer.built  # refused before anything was built or assigned
    other_base = MultiHeadAttention(2, 4, rotary_max_length=16, rotary_base=10000.0)
    with pytest.raises(ValueError, match=r"rotary_base=500\.0, .* has rotary_base=10000\.0"):
        port.set_weights(other_base, port.get_weights(rotary))
    # a plain dict records no settings: the key/value heads must match the layer's
    with pytest.raises(ValueError, match=r"'key/kernel' must have shape \(8, 4, 2\); received "
                                         r"\(8, 2, 2\).*num_key_value_heads=4"):  # fmt: skip
        port.set_weights(MultiHeadAttention(4, 2), grouped.weights)


@torch_only
def test_torch_refuses_grouped_and_rotary(backend):
    import torch

    grouped = _settings_layer(dict(num_heads=4, key_dim=2, num_key_value_heads=2), (8, 8, 8), 37)
    with pytest.raises(ValueError, match=r"convert\(to='torch'\): torch\.nn\.MultiheadAttention "
                                         r"has no grouped key/value heads; received "
                                         r"num_key_value_heads=2"):  # fmt: skip
        port.convert(grouped, "torch")
    rotary = _settings_layer(ROTARY_CASE, (8, 8, 8), seed=38)
    with pytest.raises(ValueError, match=r"torch\.nn\.MultiheadAttention has no rotary position "
                                         r"embedding; received rotary_max_length=16 "
                                         r"\(rotary_base=500\.0\)"):  # fmt: skip
        port.convert(rotary, "torch")
    m = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    with pytest.raises(ValueError, match=r"rotary_max_length=16, the module \(MultiheadAttention"
                                         r"\) has rotary_max_length=None"):  # fmt: skip
        port.set_weights(m, port.get_weights(rotary))


@tf_only
def test_tensorflow_document_refuses_grouped_and_rotary(backend):
    import multiattn.backends.tensorflow  # noqa: F401  (the adapter must be loaded)

    grouped = _settings_layer(dict(num_heads=4, key_dim=2, num_key_value_heads=2), (8, 8, 8), 39)
    with pytest.raises(ValueError, match=r"TensorFlow document's MultiHeadAttention has no "
                                         r"grouped key/value heads"):  # fmt: skip
        port.convert(grouped, "tensorflow-doc")
    with pytest.raises(ValueError, match="no rotary position embedding; received "
                                         "rotary_max_length=16"):  # fmt: skip
        port.convert(_settings_layer(ROTARY_CASE, (8, 8, 8), seed=40), "tensorflow-doc")


@jax_only
def test_flax_grouped_heads(backend):
    """flax.nnx.MultiHeadAttention has grouped heads (num_kv_heads), grouped as in the
    neutral layout; it has no RoPE."""
    import jax.numpy as jnp
    from flax import nnx

    m = nnx.MultiHeadAttention(4, 6, qkv_features=8, out_features=5, in_kv_features=4,
                               num_kv_heads=2, decode=False, rngs=nnx.Rngs(0))  # fmt: skip
    source = port.get_weights(m)
    assert source.config["num_key_value_heads"] == 2
    w = random_weights("mha", {k: v for k, v in source.config.items() if k != "dropout"}, 41)
    port.set_weights(m, w)
    other = port.convert(m, "multiattn")
    assert other.num_key_value_heads == 2
    back = port.convert(other, "flax")
    assert back.num_kv_heads == 2
    assert_same_weights(port.get_weights(back), w)
    q, k, v = inputs((2, 3, 6), (2, 4, 4), (2, 4, 4), seed=8)
    a = np.asarray(m(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), deterministic=True))
    compare("flax-multiattn grouped", a, to_np(other(q, v, k)), PAIR_RTOL)
    compare("flax-oracle grouped", a, _oracle_settings(w, q, v, k), ORACLE_RTOL)
    with pytest.raises(ValueError, match=r"convert\(to='flax'\): flax\.nnx\.MultiHeadAttention "
                                         r"has no rotary position embedding"):  # fmt: skip
        port.convert(_settings_layer(ROTARY_CASE, (8, 8, 8), seed=42), "flax")


# --- Keras .weights.h5 files: the sublayer layout, and files of the flat layout --------------


def _save_weights(layer, path) -> None:
    from keras.src.saving import saving_lib

    saving_lib.save_weights_only(layer, str(path))


def _load_weights(layer, path) -> None:
    from keras.src.saving import saving_lib

    saving_lib.load_weights_only(layer, str(path))


def _write_flat_h5(path, weights: dict, names: list[str]) -> None:
    """A ``.weights.h5`` file as multiattn wrote it before the projections moved into
    sublayers: the layer's own ``vars/0 ..``, all kernels then all biases."""
    import h5py

    with h5py.File(path, "w") as fh:
        for i, name in enumerate(names):
            fh.create_dataset(f"vars/{i}", data=np.asarray(weights[name]))


@pytest.mark.parametrize("case", ["grouped", "rotary", "no_bias"])
def test_keras_weights_file_round_trip(backend, case, tmp_path):
    """A layer saved by Keras (projections in the sublayers query .. attention_output)
    converts through the port to the neutral layout and back, and Keras loads the
    result into a fresh layer: same weights, same outputs, bit for bit."""
    from multiattn.port.checkpoint import convert_file

    spec, widths = {
        "grouped": (dict(GROUPED_CASE, value_dim=3, output_dim=5), (6, 6, 6)),
        "rotary": (ROTARY_CASE, (8, 8, 8)),
        "no_bias": (dict(num_heads=2, key_dim=3, use_bias=False), (4, 4, 4)),
    }[case]
    layer = _settings_layer(spec, widths, seed=41)
    _save_weights(layer, tmp_path / "a.weights.h5")
    convert_file(tmp_path / "a.weights.h5", tmp_path / "n.safetensors", "keras", "safetensors")
    convert_file(tmp_path / "n.safetensors", tmp_path / "b.weights.h5", "safetensors", "keras")
    fresh = MultiHeadAttention(**spec)
    q = inputs((2, 3, widths[0]), seed=7)[0]
    fresh.build(q.shape, q.shape)
    _load_weights(fresh, tmp_path / "b.weights.h5")
    assert_same_weights(port.get_weights(fresh), port.get_weights(layer))
    assert np.array_equal(to_np(fresh(q, q)), to_np(layer(q, q)))


def test_flat_weights_file_loads_and_converts(backend, tmp_path):
    """A file of the flat layout (multiattn before the sublayers) loads into the layer
    with Keras' own loading, also inside an encoder, and converts through the port to
    the current layout: the same weights and outputs either way."""
    from multiattn.port.checkpoint import convert_file

    layer, (q, k, v) = _mha(MHA_CASES["cross"])
    source = port.get_weights(layer)
    order = [f"{n}/{p}" for p in ("kernel", "bias") for n in ("query", "key", "value", "output")]
    _write_flat_h5(tmp_path / "old.weights.h5", source.weights, order)
    for path in ("old", "new"):
        if path == "new":
            convert_file(tmp_path / "old.weights.h5", tmp_path / "new.weights.h5", "keras", "keras")
        fresh = MultiHeadAttention(3, 2, value_dim=5, output_dim=7)
        fresh.build(q.shape, v.shape, k.shape)
        _load_weights(fresh, tmp_path / f"{path}.weights.h5")
        assert_same_weights(port.get_weights(fresh), source)
        assert np.array_equal(to_np(fresh(q, v, k)), to_np(layer(q, v, k)))
        # loading again (now a file of the current layout) still works
        _save_weights(fresh, tmp_path / "again.weights.h5")
        _load_weights(fresh, tmp_path / "again.weights.h5")


def test_flat_weights_file_of_a_whole_encoder_loads(backend, tmp_path):
    import h5py

    config = {"d_model": 4, "num_heads": 2, "dff": 6}
    layer = TransformerEncoderLayer(4, 2, 6)
    port.set_weights(layer, random_weights("encoder", config, seed=5))
    _save_weights(layer, tmp_path / "cur.weights.h5")
    w = port.get_weights(layer).weights
    order = [f"{n}/{p}" for p in ("kernel", "bias") for n in ("query", "key", "value", "output")]
    with (
        h5py.File(tmp_path / "cur.weights.h5", "r") as src,
        h5py.File(tmp_path / "old.weights.h5", "w") as dst,
    ):
        for name in ("ffn_1", "ffn_2", "norm_1", "norm_2"):
            src.copy(src[name], dst, name)
        for i, name in enumerate(order):
            dst.create_dataset(f"attention/vars/{i}", data=w[f"attention/{name}"])
    fresh = TransformerEncoderLayer(4, 2, 6)
    fresh.build((None, 3, 4))
    _load_weights(fresh, tmp_path / "old.weights.h5")
    assert_same_weights(port.get_weights(fresh), port.get_weights(layer))


def test_flat_weights_file_with_the_wrong_count_is_refused(backend, tmp_path):
    layer, (q, k, v) = _mha(MHA_CASES["self"])
    w = port.get_weights(layer).weights
    _write_flat_h5(tmp_path / "bad.weights.h5", w, ["query/kernel", "key/kernel", "value/kernel"])
    fresh = MultiHeadAttention(2, 4)
    fresh.build(q.shape, v.shape, k.shape)
    with pytest.raises(ValueError, match="holds 3 variables of the layer itself"):
        _load_weights(fresh, tmp_path / "bad.weights.h5")

"""multiattn.distributed in one process: argument checks, the layout rules, and ring
attention on a one-device mesh against the oracle (JAX only; the multi-device runs are
in tests/test_distributed_jax.py)."""

import numpy as np
import pytest
from _support import BACKEND, TOL, rel_err

from multiattn import reference
from multiattn.distributed import layout_map, model_parallel, ring_attention, sharded_heads_rules

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution and shard_map: JAX")


def one_device_mesh(axes=("batch", "model")):
    from keras.distribution import DeviceMesh, list_devices

    return DeviceMesh((1,) * len(axes), axes, list_devices()[:1])


def jax_mesh(axes=("seq",)):
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(axes)), axes)


def test_rules_cover_every_sharded_weight_once():
    rules = sharded_heads_rules("m")
    import re

    paths = {
        "enc/attention/query/kernel": (None, "m", None),
        "multi_head_attention/key/kernel": (None, "m", None),
        "value/kernel": (None, "m", None),
        "mha/gate/kernel": (None, "m", None),
        "x/attention/attention_output/kernel": ("m", None, None),
        "x/attention/value/bias": ("m", None),
        "enc/ffn_1/kernel": (None, "m"),
        "enc/ffn_1/bias": ("m",),
        "enc/ffn_2/kernel": ("m", None),
        "enc/ffn_2/bias": None,
        "enc/norm_1/gamma": None,
        "x/attention/attention_output/bias": None,
        "x/my_query_kernel": None,  # not a multiattn weight name
    }
    for path, want in paths.items():
        hits = [axes for pattern, axes in rules.items() if re.fullmatch(pattern, path)]
        assert hits == ([] if want is None else [want]), path


def test_layout_map_answers_for_layer_paths():
    layouts = layout_map(one_device_mesh())
    assert tuple(layouts["transformer_encoder_layer/attention/query/kernel"].axes) == (
        None,
        "model",
        None,
    )
    assert layouts["transformer_encoder_layer/norm_1/gamma"] is None
    assert model_parallel(one_device_mesh(), batch_axis="batch").batch_dim_name == "batch"


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: layout_map("mesh"), TypeError, "`device_mesh`"),
        (lambda: layout_map(one_device_mesh(), model_axis="heads"), ValueError, "'heads'"),
        (lambda: layout_map(one_device_mesh(), model_axis=3), TypeError, "`model_axis`"),
        (lambda: model_parallel(one_device_mesh(), batch_axis="data"), ValueError, "`batch_axis`"),
        (lambda: sharded_heads_rules(""), TypeError, "`model_axis`"),
    ],
)
def test_layout_bad_arguments(call, error, words):
    with pytest.raises(error, match=words):
        call()


Q = np.ones((2, 8, 4), np.float32)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"mesh": "mesh"}, TypeError, "`mesh`"),
        ({"seq_axis": "tokens"}, ValueError, "`seq_axis`"),
        ({"batch_axis": "seq"}, ValueError, "`batch_axis`"),
        ({"key": np.ones((2, 8, 3), np.float32)}, ValueError, "same width"),
        ({"value": np.ones((2, 6, 4), np.float32)}, ValueError, "same length"),
        ({"query": np.ones((8, 4), np.float32)}, ValueError, "`query`"),
        ({"key": np.ones((2, 8, 4), np.float64)}, TypeError, "share a dtype"),
        ({"valid_lens": np.array([9, 1])}, ValueError, "may not exceed"),
        ({"valid_lens": np.array([1, 2, 3])}, ValueError, "`valid_lens`"),
        ({"causal": 1}, TypeError, "`causal`"),
        ({"scale": -1.0}, ValueError, "scale"),
    ],
)
def test_ring_bad_arguments(kwargs, error, words):
    args = {"query": Q, "key": Q, "value": Q, "mesh": jax_mesh()}
    args.update(kwargs)
    q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
    with pytest.raises(error, match=words):
        ring_attention(q, k, v, **args)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_ring_on_one_device_equals_the_oracle(dtype):
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 12, 5)) for _ in range(3))
    lens = np.array([12, 4])
    got = ring_attention(
        *(jnp.asarray(t, dtype) for t in (q, k, v)), mesh=jax_mesh(), valid_lens=lens, causal=True
    )
    assert str(got.dtype) == dtype
    rounded = [np.asarray(jnp.asarray(t, dtype).astype("float64")) for t in (q, k, v)]
    want, _ = reference.scaled_dot_product_attention(*rounded, valid_lens=lens, causal=True)
    assert rel_err(np.asarray(got.astype("float64")), want) <= TOL[dtype]

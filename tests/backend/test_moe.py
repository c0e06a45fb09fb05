"""`multiattn.layers.MixtureOfExperts` against the float64 loop oracle
(tests/_moe_oracle.py): outputs with and without the shared expert and with either
normalisation, gradients of the router, the experts and the input, a block with
``moe``, the top-k tie rule and argument checks."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _moe_oracle import moe_oracle
from _support import BACKEND, DTYPES, cast, gradients, numeric_grad, rel_err, requires_grad, to_np

from multiattn.layers import MixtureOfExperts, MoEConfig, TransformerDecoderOnlyLayer
from multiattn.layers.moe import top_k_mask
from multiattn.namespaces.keras import get_ops

RNG = np.random.default_rng(7)
FLOATS = [d for d in DTYPES if d in ("float64", "float32")]
TOL = {"float64": 1e-12, "float32": 1e-5}


def _layer(dtype, shared=None, norm=True, width=6, experts=4, k=2, hidden=5):
    layer = MixtureOfExperts(experts, k, hidden, norm_topk_prob=norm, shared_expert_dim=shared,
                             dtype=dtype)  # fmt: skip
    layer.build((2, 3, width))
    values = {}
    for w in layer.weights:
        value = RNG.standard_normal(tuple(w.shape)) * 0.5
        w.assign(cast(value, dtype))
        values[w.path.split("/", 1)[1]] = to_np(w)
    return layer, values


def _oracle(x, v, k, norm, shared):
    parts = None
    if shared:
        parts = tuple(v[f"shared_expert/{p}/kernel"] for p in ("gate", "up", "down"))
        parts += (v["shared_expert_gate/kernel"],)
    return moe_oracle(x, v["router/kernel"], v["gate_kernel"], v["up_kernel"], v["down_kernel"],
                      k, norm, parts)  # fmt: skip


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("shared", "norm"), [(None, True), (7, False)], ids=["mixtral", "shared"])
def test_moe_matches_the_oracle(dtype, shared, norm):
    layer, v = _layer(dtype, shared, norm)
    x = RNG.standard_normal((2, 3, 6))
    got = layer(cast(x, dtype))
    assert keras.backend.standardize_dtype(got.dtype) == dtype and tuple(got.shape) == (2, 3, 6)
    want = _oracle(to_np(cast(x, dtype)), v, 2, norm, shared)
    assert rel_err(to_np(got), want) <= TOL[dtype]
    flat = layer(cast(x[0], dtype))  # any rank: (tokens, d)
    assert rel_err(to_np(flat), want[0]) <= TOL[dtype]


def test_moe_half_precision_runs_in_its_dtype():
    dtype = "bfloat16"
    layer, _ = _layer(dtype, shared=7)
    x = RNG.standard_normal((2, 3, 6))
    got = layer(cast(x, dtype))
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    assert np.isfinite(to_np(got)).all()


def test_moe_gradients_reach_router_experts_and_input():
    requires_grad()
    dtype = FLOATS[0]
    layer, v = _layer(dtype, shared=3, norm=True, width=4, hidden=3)
    x = RNG.standard_normal((1, 3, 4))
    r = RNG.standard_normal((1, 3, 4))
    names = [w.path.split("/", 1)[1] for w in layer.trainable_variables]

    def fn(xt, *weights):
        out, _ = layer.stateless_call(list(weights), [], xt)
        return keras.ops.sum(out * cast(r, dtype))

    got = gradients(fn, cast(x, dtype), *(cast(v[n], dtype) for n in names))

    def loss(xa, *arrays):
        w = dict(zip(names, arrays))
        return float((_oracle(xa, w, 2, True, True) * r).sum())

    want = numeric_grad(loss, x.copy(), *(v[n].copy() for n in names))
    assert {"router/kernel", "gate_kernel", "up_kernel", "down_kernel"} <= set(names)
    for name, g, w in zip(["x", *names], got, want):
        assert np.abs(w).max() > 0, name  # every weight takes part
        assert np.abs(g - w).max() / np.abs(w).max() <= 1e-6, name


def test_top_k_ties_go_to_the_lower_index():
    probs = keras.ops.convert_to_tensor(np.array([[0.25, 0.25, 0.25, 0.25],
                                                  [0.1, 0.4, 0.1, 0.4]], "float32"))  # fmt: skip
    got = to_np(top_k_mask(get_ops(probs), probs, 2))
    np.testing.assert_array_equal(got, [[True, True, False, False], [False, True, False, True]])


def test_block_with_moe_and_its_config():
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "expert_dff": 5, "dense_layers": [1]}
    block = TransformerDecoderOnlyLayer(8, 2, 12, rate=0.0, norm="rms", norm_first=True,
                                        gated=True, ffn_bias=False, activation="silu",
                                        moe=moe)  # fmt: skip
    assert isinstance(block.ffn, MixtureOfExperts) and isinstance(block.config.moe, MoEConfig)
    assert block.config.for_layer(0) is block.config and block.config.for_layer(1).moe is None
    x = RNG.standard_normal((2, 3, 8)).astype("float32")
    assert tuple(block(x).shape) == (2, 3, 8)
    again = TransformerDecoderOnlyLayer.from_config(block.get_config())
    assert again.config == block.config
    with pytest.raises(ValueError, match="gated=True"):
        TransformerDecoderOnlyLayer(8, 2, 12, moe=moe)
    with pytest.raises(ValueError, match="not MoEConfig fields"):
        TransformerDecoderOnlyLayer(8, 2, 12, gated=True, ffn_bias=False, moe={"experts": 4})
    with pytest.raises(TypeError, match="moe"):
        TransformerDecoderOnlyLayer(8, 2, 12, gated=True, ffn_bias=False, moe=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"num_experts": 0}, ValueError, "num_experts"),
        ({"num_experts_per_tok": 5}, ValueError, "num_experts_per_tok"),
        ({"hidden_dim": 2.0}, ValueError, "hidden_dim"),
        ({"norm_topk_prob": 1}, TypeError, "norm_topk_prob"),
        ({"activation": "tanh"}, ValueError, "activation"),
        ({"shared_expert_dim": -1}, ValueError, "shared_expert_dim"),
    ],
)
def test_moe_arguments_are_checked(kwargs, error, named):
    args = {"num_experts": 4, "num_experts_per_tok": 2, "hidden_dim": 5, **kwargs}
    with pytest.raises(error, match=named):
        MixtureOfExperts(**args)
    config = {"num_experts": 4, "num_experts_per_tok": 2, "expert_dff": 5}
    with pytest.raises(ValueError, match="dense_layers"):
        MoEConfig(**config, dense_layers=[-1])
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEConfig(**{**config, "num_experts_per_tok": 9})


def test_moe_refuses_other_widths():
    layer, _ = _layer(FLOATS[-1])
    with pytest.raises(ValueError, match="width 6"):
        layer(cast(RNG.standard_normal((2, 3, 5)), FLOATS[-1]))
    assert BACKEND  # the runner names the backend in the test id

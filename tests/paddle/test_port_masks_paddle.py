"""`multiattn.port.masks` against ``paddle.nn.MultiHeadAttention``: the canonical keep mask
translated to Paddle's ``attn_mask`` (bool, 0/1 integer, additive float) gives Paddle's
layer the same output as multiattn's core layer given the canonical mask, on every row
with an allowed key; and the polarity is measured, not assumed."""

from __future__ import annotations

import keras
import numpy as np
import paddle
import pytest
from _paddle_support import to_np

from multiattn import layers
from multiattn.port import masks as M

RNG = np.random.default_rng(9)
B, H, T, S, D = 2, 2, 4, 5, 3
E = H * D


def keeps() -> dict[str, np.ndarray]:
    scattered = RNG.random((B, 1, T, S)) > 0.4
    scattered[..., 0] = True
    scattered[1, 0, 2] = False  # a fully masked row
    per_head = RNG.random((B, H, T, S)) > 0.3
    per_head[..., 1] = True
    return {
        "scattered": scattered,
        "padding": M.from_valid_lens(np.array([3, 0]), S),
        "per_head": per_head,
        "causal": M.combine(M.causal_keep(T, S), M.from_valid_lens(np.array([5, 1]), S)),
    }


KEEPS = keeps()


def test_a_boolean_attn_mask_is_true_to_keep():
    mha = paddle.nn.MultiHeadAttention(E, H, need_weights=True)
    x = paddle.to_tensor(RNG.standard_normal((1, 2, E)).astype("float32"))
    keep = np.array([[True, False], [True, True]])
    _, weights = mha(x, x, x, attn_mask=paddle.to_tensor(M.to_paddle_mask(keep)))
    w = weights.numpy()
    assert np.all(w[..., 0, 1] < 1e-20)  # blocked where keep is False
    assert np.all(w[..., 1, :] > 1e-3)  # kept where keep is True
    assert M.from_paddle_mask(keep)[0, 0].tolist() == keep.tolist()


@pytest.mark.parametrize("kind", KEEPS)
@pytest.mark.parametrize("form", ["bool", "int", "additive"])
def test_paddle_multi_head_attention_matches_the_core(kind, form):
    keep = np.broadcast_to(KEEPS[kind], (B, H, T, S))
    q = RNG.standard_normal((B, T, E)).astype("float32")
    kv = RNG.standard_normal((B, S, E)).astype("float32")
    ours = layers.MultiHeadAttention(H, D)
    ours.build(q.shape, kv.shape, kv.shape)
    for w in ours.weights:
        w.assign(RNG.standard_normal(tuple(w.shape)).astype("float32") * 0.5)
    want = keras.ops.convert_to_numpy(ours(q, kv, kv, mask=keep))
    mha = paddle.nn.MultiHeadAttention(E, H)
    for name, proj in (("query", mha.q_proj), ("key", mha.k_proj), ("value", mha.v_proj)):
        proj.weight.set_value(
            keras.ops.convert_to_numpy(getattr(ours, f"{name}_kernel")).reshape(E, E)
        )
        proj.bias.set_value(keras.ops.convert_to_numpy(getattr(ours, f"{name}_bias")).reshape(E))
    mha.out_proj.weight.set_value(keras.ops.convert_to_numpy(ours.output_kernel).reshape(E, E))
    mha.out_proj.bias.set_value(keras.ops.convert_to_numpy(ours.output_bias))
    mask = M.to_paddle_mask(keep, additive=form == "additive")
    if form == "int":
        mask = mask.astype(np.int32)
    assert np.array_equal(M.from_paddle_mask(mask), keep)
    out = to_np(
        mha(
            paddle.to_tensor(q),
            paddle.to_tensor(kv),
            paddle.to_tensor(kv),
            attn_mask=paddle.to_tensor(mask),
        )
    )
    rows = keep.all(axis=1).any(axis=-1) if kind != "per_head" else keep.any(axis=-1).all(axis=1)
    scale = np.abs(want[rows]).max()
    assert np.abs(out[rows] - want[rows]).max() / scale <= 1e-5

"""`multiattn.port.masks` against the frameworks' own layers: a mask translated from the
canonical keep mask and fed to the framework's layer gives the same output as multiattn's
core given the canonical mask, on every row that has an allowed key. Runs on every Keras
backend (Keras' MultiHeadAttention); torch's layers on the torch worker, JAX's on jax, the
document adapters' masks on theirs."""

import keras
import numpy as np
import pytest
from _support import BACKEND, to_np

from multiattn import layers, ops
from multiattn.port import masks as M

RNG = np.random.default_rng(5)
B, H, T, S, D = 2, 2, 4, 5, 3
E = H * D


def canonical_keeps() -> dict[str, np.ndarray]:
    """Keep masks ``(B, 1, T, S)`` of several kinds, each with one fully masked row."""
    scattered = RNG.random((B, 1, T, S)) > 0.4
    scattered[..., 0] = True
    scattered[1, 0, 2] = False  # a fully masked row
    padding = M.from_valid_lens(np.array([3, 0]), S)
    per_query = M.from_valid_lens(np.array([[0, 2, 5, 1], [4, 4, 3, 5]]), S)
    causal = M.combine(M.causal_keep(T, S), M.from_valid_lens(np.array([5, 1]), S))
    return {"scattered": scattered, "padding": padding, "per_query": per_query, "causal": causal}


KEEPS = canonical_keeps()


def full(keep: np.ndarray) -> np.ndarray:
    return np.broadcast_to(keep, (B, 1, T, S))


def kept_rows(keep: np.ndarray) -> np.ndarray:
    """(B, T): rows with at least one allowed key."""
    return full(keep)[:, 0].any(axis=-1)


def assert_rows_close(got, want, keep, tol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    rows = kept_rows(keep)
    scale = max(np.abs(want[rows]).max(), 1e-30)
    err = np.abs(got[rows] - want[rows]).max() / scale
    assert err <= tol, f"max relative error {err:.2e} on rows with an allowed key"


def inputs():
    q = RNG.standard_normal((B, T, E)).astype("float32")
    kv = RNG.standard_normal((B, S, E)).astype("float32")
    return q, kv


def core_mha(q, kv, keep, weights=None):
    """multiattn's MultiHeadAttention with the canonical mask; weights (E, H, D) etc."""
    layer = layers.MultiHeadAttention(H, D)
    layer.build(q.shape, kv.shape, kv.shape)
    if weights is not None:
        for name, value in weights.items():
            getattr(layer, name).assign(value)
    return to_np(layer(q, kv, kv, mask=full(keep))), layer


@pytest.mark.parametrize("kind", KEEPS)
def test_keras_multi_head_attention(kind):
    keep = KEEPS[kind]
    q, kv = inputs()
    ours, layer = core_mha(q, kv, keep)
    theirs = keras.layers.MultiHeadAttention(H, D)
    theirs(q, kv, kv)
    names = {"query": "query", "key": "key", "value": "value", "attention_output": "output"}
    for var in theirs.weights:
        sub, kind_ = var.path.split("/")[-2:]
        var.assign(getattr(layer, f"{names[sub]}_{kind_}"))
    mask = M.to_keras_mask(keep, (B, H, T, S))
    assert mask.shape == (B, T, S)
    for scores in (False, True):  # both of Keras' paths
        out = theirs(q, kv, kv, attention_mask=mask, return_attention_scores=scores)
        assert_rows_close(to_np(out[0] if scores else out), ours, keep)


@pytest.mark.parametrize("kind", KEEPS)
def test_torch_multihead_attention_masks(kind):
    if BACKEND != "torch":
        pytest.skip("torch's own layer runs on the torch worker")
    import torch

    keep = KEEPS[kind]
    q, kv = inputs()
    ours, layer = core_mha(q, kv, keep)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True)
    w = {n: to_np(getattr(layer, f"{n}_kernel")).reshape(E, E) for n in ("query", "key", "value")}
    b = {n: to_np(getattr(layer, f"{n}_bias")).reshape(E) for n in ("query", "key", "value")}
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.tensor(np.concatenate([w[n].T for n in w])))
        mha.in_proj_bias.copy_(torch.tensor(np.concatenate([b[n] for n in b])))
        mha.out_proj.weight.copy_(torch.tensor(to_np(layer.output_kernel).reshape(E, E).T))
        mha.out_proj.bias.copy_(torch.tensor(to_np(layer.output_bias)))
    tq, tkv = torch.tensor(q), torch.tensor(kv)
    for additive in (False, True):
        for need_weights in (False, True):
            kw = {"need_weights": need_weights}
            if kind == "padding":
                kpm = M.to_torch_key_padding_mask(keep, (B, H, T, S), additive=additive)
                kw["key_padding_mask"] = torch.tensor(kpm)
            else:
                am = M.to_torch_attn_mask(keep, H, (B, H, T, S), additive=additive)
                assert am.shape == (B * H, T, S)
                kw["attn_mask"] = torch.tensor(am)
            with torch.no_grad():
                out, _ = mha(tq, tkv, tkv, **kw)
            assert_rows_close(out.numpy(), ours, keep)


def test_torch_multihead_attention_gives_nan_on_a_fully_masked_row():
    """The departure recorded for the native-torch conformance target, measured here."""
    if BACKEND != "torch":
        pytest.skip("torch's own layer runs on the torch worker")
    import torch

    keep = KEEPS["padding"]  # batch 1 has no valid key
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True)
    q, kv = (torch.tensor(a) for a in inputs())
    kpm = torch.tensor(M.to_torch_key_padding_mask(keep, (B, H, T, S)))
    with torch.no_grad():
        out, weights = mha(q, kv, kv, key_padding_mask=kpm, need_weights=True)
        fast, _ = mha(q, kv, kv, key_padding_mask=kpm, need_weights=False)
    assert torch.isnan(out[1]).all() and torch.isnan(weights[1]).all()
    assert torch.isfinite(out[0]).all()
    assert torch.equal(fast[1], torch.zeros_like(fast[1]))  # the SDPA path gives zeros


@pytest.mark.parametrize("kind", KEEPS)
@pytest.mark.parametrize("additive", [False, True])
def test_torch_scaled_dot_product_attention(kind, additive):
    if BACKEND != "torch":
        pytest.skip("torch's own function runs on the torch worker")
    import torch

    keep = KEEPS[kind]
    q = RNG.standard_normal((B, H, T, D)).astype("float32")
    k = RNG.standard_normal((B, H, S, D)).astype("float32")
    v = RNG.standard_normal((B, H, S, D)).astype("float32")
    ours = to_np(ops.scaled_dot_product_attention(q, k, v, mask=keep))
    mask = torch.tensor(M.to_sdpa_mask(keep, additive=additive))
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(a) for a in (q, k, v)), attn_mask=mask
    )
    rows = full(keep)[:, 0].any(-1)  # (B, T), the same for every head
    for h in range(H):
        assert_rows_close(theirs.numpy()[:, h], ours[:, h], keep)
    assert rows.any()


def test_torch_is_causal_is_the_top_left_keep_mask():
    if BACKEND != "torch":
        pytest.skip("torch's own function runs on the torch worker")
    import torch

    q = RNG.standard_normal((1, T, D)).astype("float32")
    kv = RNG.standard_normal((1, S, D)).astype("float32")
    theirs = torch.nn.functional.scaled_dot_product_attention(
        torch.tensor(q), torch.tensor(kv), torch.tensor(kv), is_causal=True
    )
    top_left = M.causal_keep(T, S, "top_left")[0]
    ours = to_np(ops.scaled_dot_product_attention(q, kv, kv, mask=top_left))
    np.testing.assert_allclose(theirs.numpy(), ours, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KEEPS)
def test_jax_dot_product_attention(kind):
    if BACKEND != "jax":
        pytest.skip("jax.nn runs on the jax worker")
    import jax

    keep = KEEPS[kind]
    q = RNG.standard_normal((B, T, H, D)).astype("float32")  # JAX: (batch, seq, heads, dim)
    k = RNG.standard_normal((B, S, H, D)).astype("float32")
    v = RNG.standard_normal((B, S, H, D)).astype("float32")
    theirs = np.asarray(jax.nn.dot_product_attention(q, k, v, mask=M.to_jax_mask(keep)))
    ours = to_np(
        ops.scaled_dot_product_attention(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), mask=keep)
    )
    for h in range(H):
        assert_rows_close(theirs[:, :, h], ours[:, h], keep)


@pytest.mark.parametrize("kind", ["padding", "causal"])
def test_tensorflow_document_mask(kind):
    if BACKEND != "tensorflow":
        pytest.skip("the TensorFlow document's adapter runs on the tensorflow worker")
    from multiattn.backends import tensorflow as doc

    keep = KEEPS[kind]
    q = RNG.standard_normal((B, H, T, D)).astype("float32")
    kv = RNG.standard_normal((B, H, S, D)).astype("float32")
    mask = M.to_tf_document_mask(keep)  # 1.0 = masked out
    out, _ = doc.scaled_dot_product_attention(q, kv, kv, mask)
    ours = to_np(ops.scaled_dot_product_attention(q, kv, kv, mask=keep))
    for h in range(H):
        assert_rows_close(to_np(out)[:, h], ours[:, h], keep)


@pytest.mark.parametrize("kind", ["padding", "per_query"])
def test_d2l_valid_lens(kind):
    if BACKEND != "torch":
        pytest.skip("the d2l document's adapter runs on the torch worker")
    import torch
    from multiattn.backends import torch as doc

    keep = KEEPS[kind]
    x = RNG.standard_normal((B, T, S)).astype("float32")
    lens = M.to_valid_lens(keep, (B, 1, T, S))
    theirs = doc.masked_softmax(torch.tensor(x), torch.tensor(lens))
    ours = to_np(ops.masked_softmax(keras.ops.convert_to_tensor(x), mask=full(keep)[:, 0]))
    assert_rows_close(theirs.numpy(), ours, keep)

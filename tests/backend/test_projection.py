"""The namespace's dense projection (``linear``) against a float64 NumPy oracle: values
and gradients, both contraction ranks, with and without bias; on torch, the oneDNN path,
PyTorch's own product and the product measured faster (`multiattn.tuning`), chosen by
the tuner in force (``settings(autotune=Fixed(torch_linear="onednn"))``, ``True``)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _support import BACKEND, DTYPES, LAYER_TOL, assert_close, cast, gradients, rounded

from multiattn import config, tuning
from multiattn.namespaces.keras import get_ops
from multiattn.tuning import Fixed

RNG = np.random.default_rng(7)
#: how the projections run: the tuner in force (`multiattn.config.tuner`)
TUNERS = {
    "onednn": Fixed(torch_linear="onednn"),
    "blas": Fixed(torch_linear="blas"),
    "measured": True,
    "default": False,
}
ONEDNN = list(TUNERS) if BACKEND == "torch" else ["default"]


def _oracle(x, kernel, bias, contract):
    y = np.tensordot(x, kernel, axes=contract)
    return y if bias is None else y + bias


def _case(contract: int, with_bias: bool, rows: str = "many"):
    """x (2, 5, 3, 4) [contract 2: (..., 3, 4)] or (2, 5, 12) and a kernel to (3, 2);
    ``rows="one"``: leading sizes (1, 1) (a decoding step at batch 1, which TensorFlow's
    namespace contracts over several axes in two steps)."""
    lead = (2, 5) if rows == "many" else (1, 1)
    if contract == 1:
        x, kernel = RNG.standard_normal((*lead, 12)), RNG.standard_normal((12, 3, 2))
    else:
        x, kernel = RNG.standard_normal((*lead, 3, 4)), RNG.standard_normal((3, 4, 6))
    bias = RNG.standard_normal(kernel.shape[contract:]) if with_bias else None
    return x, kernel, bias


@pytest.fixture(params=ONEDNN)
def onednn(request):
    tuning.reset()  # decisions held by the process make the measuring tuner the default
    with config.settings(autotune=TUNERS[request.param]):
        yield request.param
    tuning.reset()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("contract", [1, 2])
@pytest.mark.parametrize("rows", ["many", "one"])
def test_linear_against_oracle(dtype, contract, with_bias, rows, onednn):
    x, kernel, bias = _case(contract, with_bias, rows)
    ops = get_ops()
    got = ops.linear(
        cast(x, dtype),
        cast(kernel, dtype),
        None if bias is None else cast(bias, dtype),
        contract=contract,
    )
    want = _oracle(
        rounded(x, dtype),
        rounded(kernel, dtype),
        None if bias is None else rounded(bias, dtype),
        contract,
    )
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    assert_close(got, want, dtype, LAYER_TOL)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in ("float32", "float64")])
@pytest.mark.parametrize("contract", [1, 2])
@pytest.mark.parametrize("rows", ["many", "one"])
def test_linear_gradients_against_oracle(dtype, contract, rows, onednn):
    x, kernel, bias = _case(contract, True, rows)
    weights = RNG.standard_normal(x.shape[: x.ndim - contract] + kernel.shape[contract:])
    ops = get_ops()
    w = cast(weights, dtype)

    def loss(x, kernel, bias):
        return keras.ops.sum(ops.linear(x, kernel, bias, contract=contract) * w)

    got = gradients(loss, cast(x, dtype), cast(kernel, dtype), cast(bias, dtype))
    lead = tuple(range(x.ndim - contract))
    n_axes = tuple(range(x.ndim - contract, weights.ndim))
    want_x = np.tensordot(weights, kernel, axes=(n_axes, tuple(range(contract, kernel.ndim))))
    want_kernel = np.tensordot(x, weights, axes=(lead, lead))
    want_bias = weights.sum(axis=lead)
    for g, want in zip(got, (want_x, want_kernel, want_bias)):
        assert_close(g, want, dtype)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="leading sizes unknown to a graph")
@pytest.mark.parametrize("contract", [1, 2])
def test_linear_with_leading_sizes_unknown_in_a_graph(contract):
    """TensorFlow's ``linear`` is one ``MatMul`` and a ``BiasAdd`` over the flattened
    rows; traced with unknown leading sizes, it shapes them back from the input."""
    import tensorflow as tf

    x, kernel, bias = _case(contract, True)
    ops = get_ops()
    spec = tf.TensorSpec((None, None, *x.shape[2:]), "float32")

    @tf.function(input_signature=[spec])
    def f(t):
        y = ops.linear(t, cast(kernel, "float32"), cast(bias, "float32"), contract=contract)
        assert y.shape.as_list() == [None, None, *kernel.shape[contract:]], y.shape
        return y

    assert_close(f(cast(x, "float32")), _oracle(x, kernel, bias, contract), "float32", LAYER_TOL)


@pytest.mark.skipif(BACKEND != "torch", reason="the oneDNN path is PyTorch's")
def test_torch_onednn_path_is_taken_where_the_tuner_says(monkeypatch):
    from multiattn.tuning import torch_linear

    if not torch_linear.available():
        pytest.skip("this PyTorch build has no oneDNN linear operator")
    calls = []
    real = torch_linear.matmul_bias

    def spy(a, b, bias, measure=False):
        calls.append(measure)
        return real(a, b, bias, measure)

    monkeypatch.setattr(torch_linear, "matmul_bias", spy)
    tuning.reset()  # no decision held: autotune off is no tuner
    x, kernel, bias = _case(1, True)
    ops = get_ops()
    args = (cast(x, "float32"), cast(kernel, "float32"), cast(bias, "float32"))
    with config.settings(autotune=False):
        ops.linear(*args)
    assert calls == []  # no tuner: PyTorch's own product
    with config.settings(autotune=True):
        ops.linear(*args)
    assert calls == [True]  # measured
    with config.settings(autotune=Fixed(torch_linear="onednn")):
        ops.linear(*args)
        ops.linear(*(cast(a, "float64") for a in (x, kernel, bias)))  # float64: BLAS
    assert calls == [True, False]  # given
    for given in (Fixed(torch_linear="blas"), Fixed(), Fixed(attention_chunks=2)):
        with config.settings(autotune=given):
            ops.linear(*args)
    assert calls == [True, False]
    tuning.reset()


@pytest.mark.skipif(BACKEND != "torch", reason="the oneDNN path is PyTorch's")
def test_torch_onednn_second_order_gradients_match_blas():
    """The backward pass is made of the same differentiable product, so gradients of
    gradients exist and agree with PyTorch's own product."""
    import torch

    x, kernel, bias = _case(2, True)
    tuning.reset()
    results = []
    for tuner in (Fixed(torch_linear="onednn"), True, False):
        with config.settings(autotune=tuner):
            leaves = [
                torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in (x, kernel, bias)
            ]
            y = get_ops().linear(*leaves, contract=2)
            (gx,) = torch.autograd.grad((y**2).sum(), leaves[0], create_graph=True)
            second = torch.autograd.grad(gx.square().sum(), leaves)
            results.append([g.detach().numpy().astype(np.float64) for g in second])
    tuning.reset()
    for other in results[:2]:
        for got, want in zip(other, results[2]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(BACKEND != "torch", reason="the oneDNN path is PyTorch's")
def test_torch_onednn_takes_strided_inputs():
    """A transposed (non-contiguous) input gives the product of its values."""
    import torch

    x = torch.tensor(RNG.standard_normal((12, 2, 5)), dtype=torch.float32).permute(1, 2, 0)
    kernel = torch.tensor(RNG.standard_normal((12, 4)), dtype=torch.float32)
    with config.settings(autotune=Fixed(torch_linear="onednn")):
        got = get_ops().linear(x, kernel)
    want = np.tensordot(x.numpy().astype(np.float64), kernel.numpy().astype(np.float64), 1)
    assert_close(got, want, "float32")

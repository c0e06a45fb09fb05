"""The Paddle namespace against ``keras.ops`` (Keras' numpy backend), and the core on
Paddle tensors against the float64 oracle."""

from __future__ import annotations

import math

import keras
import ml_dtypes
import numpy as np
import paddle
import pytest
from _paddle_support import (
    FLOAT_DTYPES,
    TOL,
    assert_close,
    numeric_grad,
    paddle_grads,
    rel_err,
    rounded,
    tensor,
    to_np,
)

from multiattn import ops
from multiattn import reference as ref
from multiattn.namespaces.contract import check_namespace
from multiattn.namespaces.keras import KerasNamespace, get_ops, keras_namespace
from multiattn.namespaces.paddle import (
    PaddleNamespace,
    einsum_by_broadcast,
    result_type,
    standardize_dtype,
)

PNS = get_ops(paddle.zeros([1]))
KNS = keras_namespace()
RNG = np.random.default_rng(11)
DTYPES = ("bool", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64")


# --- helpers ---------------------------------------------------------------------------


def sample(shape, dtype: str, low: int = -5, high: int = 6) -> np.ndarray:
    """NumPy data of ``dtype`` (bfloat16 as ml_dtypes.bfloat16)."""
    if dtype == "bool":
        return RNG.random(shape) < 0.5
    if "int" in dtype:
        return RNG.integers(low, high, shape).astype(dtype)
    data = RNG.standard_normal(shape)
    return data.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def pd(x):
    """NumPy -> Paddle with the same dtype (anything else unchanged)."""
    if isinstance(x, np.ndarray):
        name = standardize_dtype(x.dtype)
        return tensor(x.astype(np.float32) if name == "bfloat16" else x, name)
    return x


def widened(keras_dtype: str, inputs) -> str:
    """Keras' numpy backend narrows 64-bit types to 32 bits; the Paddle namespace keeps
    them (as Keras does with JAX_ENABLE_X64 or TensorFlow)."""
    names = {standardize_dtype(a.dtype) for a in inputs if isinstance(a, np.ndarray)}
    if keras_dtype == "float32" and "float64" in names:
        return "float64"
    if keras_dtype == "int32" and "int64" in names:
        return "int64"
    return keras_dtype


def tolerance(dtype: str) -> float:
    return {"float16": 5e-3, "bfloat16": 2e-2, "float32": 2e-6, "float64": 2e-6}[dtype]


def compare(name: str, *args, value_args=None, **kwargs):
    """``PNS.<name>`` on Paddle tensors against ``keras.ops.<name>`` on the same NumPy
    inputs: same dtype (64-bit kept) and same values."""
    want = np.asarray(getattr(KNS, name)(*args, **kwargs))
    got = getattr(PNS, name)(*(pd(a) for a in args), **kwargs)
    assert isinstance(got, paddle.Tensor)
    want_dtype = widened(standardize_dtype(want.dtype), args if value_args is None else value_args)
    assert PNS.dtype_name(got) == want_dtype, (name, PNS.dtype_name(got), want_dtype)
    assert tuple(got.shape) == want.shape
    got_np = to_np(got)
    if want_dtype in ("float16", "bfloat16", "float32", "float64"):
        np.testing.assert_allclose(
            got_np,
            want.astype(np.float64),
            rtol=tolerance(want_dtype),
            atol=tolerance(want_dtype),
        )
    else:
        np.testing.assert_array_equal(got_np, want)
    return got


# --- registration and the op list -------------------------------------------------------


def test_registration_dispatches_paddle_tensors_to_the_paddle_namespace():
    t = paddle.ones([2])
    assert isinstance(get_ops(t), PaddleNamespace)
    assert isinstance(get_ops(None, np.ones(2), t), PaddleNamespace)
    assert isinstance(get_ops(np.ones(2)), KerasNamespace)
    assert get_ops(t) is get_ops(paddle.zeros([3]))
    assert not PNS.has_fused_attention  # the core takes its explicit path
    assert PNS.backend == "paddle" and not PNS.softmax_exact_zeros


def test_paddle_namespace_implements_the_contract():
    """Every operation and capability of `multiattn.namespaces.contract.Namespace`, with compatible
    signatures (``tests/test_contract.py`` checks that the contract covers every
    operation the library uses)."""
    check_namespace(PNS)
    check_namespace(PaddleNamespace)
    with pytest.raises(NotImplementedError, match="has_fused_attention is False"):
        PNS.fused_attention(None, None, None, None, 1.0)


def test_mixing_paddle_with_another_framework_is_a_type_error():
    t = paddle.ones([2, 3, 4])
    k = keras.Variable(np.ones((2, 3, 4), "float32"))
    with pytest.raises(
        TypeError, match=r"`key` is a .*\(keras\) but `query` is a paddle\..*\(paddle\)"
    ):
        ops.scaled_dot_product_attention(t, k, t)
    with pytest.raises(TypeError, match=r"expected Paddle tensors.*received a keras"):
        PNS.exp(k)
    # NumPy arrays and Python values go with Paddle tensors
    out = ops.scaled_dot_product_attention(t, np.ones((2, 3, 4), "float32"), t.numpy())
    assert isinstance(out, paddle.Tensor)


# --- dtypes and conversion --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_name_and_convert_round_trip(dtype):
    arr = sample((2, 3), dtype)
    t = PNS.convert_to_tensor(arr)
    assert isinstance(t, paddle.Tensor)
    assert PNS.dtype_name(t) == dtype
    assert PNS.dtype_name(arr) == dtype
    back = PNS.convert_to_numpy(t)
    assert standardize_dtype(back.dtype) == dtype
    np.testing.assert_array_equal(back, arr)
    assert PNS.dtype_name(PNS.convert_to_tensor(arr, dtype="float64")) == "float64"


@pytest.mark.parametrize(
    "value", [3, 2.5, True, [1, 2], [1.0, 2], [[True, False]], np.float64(1.5), np.int64(2)]
)
def test_convert_to_tensor_of_python_values_matches_keras(value):
    want = np.asarray(KNS.convert_to_tensor(value))
    got = PNS.convert_to_tensor(value)
    # NumPy scalars keep their 64-bit dtype; Python scalars are int32/float32 as in Keras.
    kept = [np.asarray(value)] if isinstance(value, np.generic) else []
    assert PNS.dtype_name(got) == widened(standardize_dtype(want.dtype), kept)
    np.testing.assert_array_equal(to_np(got), want)


def test_result_type_lattice():
    assert result_type("float32", float) == "float32"
    assert result_type("float64", float) == "float64"
    assert result_type("float16", float) == "float16"
    assert result_type("int32", float) == "float32"
    assert result_type("int8", int) == "int8"
    assert result_type("bool", int) == "int32"
    assert result_type("float16", "bfloat16") == "float32"
    assert result_type("int64", "float32") == "float32"
    assert result_type("uint8", "int8") == "int16"
    assert result_type("int64", "int32") == "int64"
    assert result_type(bool) == "bool"
    with pytest.raises(TypeError, match="unsupported dtype"):
        standardize_dtype("complex64")


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_cast(src, dst):
    if src == "bool":
        arr = np.array([True, False, True, True])
    elif "int" in src:
        arr = np.array([-3, 0, 2, 100], dtype=src)
    else:
        arr = np.array([-2.7, -0.5, 0.0, 3.9, 100.2, 0.4])
        arr = arr.astype(ml_dtypes.bfloat16 if src == "bfloat16" else src)
    compare("cast", arr, dst, value_args=[])


# --- shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bool", "int8", "float16", "float64"])
def test_shape_ops(dtype):
    x = sample((2, 3, 4), dtype)
    assert PNS.shape(pd(x)) == (2, 3, 4)
    assert all(type(d) is int for d in PNS.shape(pd(x)))
    compare("reshape", x, (-1, 4))
    compare("reshape", x, (4, 6))
    compare("reshape", x, 24)
    compare("reshape", x, (*PNS.shape(pd(x))[:1], -1))
    for axis in (0, -1, 2, (0, -1), (1, 2)):
        compare("expand_dims", x, axis)
    compare("transpose", x)
    compare("transpose", x, (1, 0, 2))
    compare("moveaxis", x, 0, -1)
    compare("moveaxis", x, [0, 1], [-1, -2])
    compare("broadcast_to", x[:1], (5, 3, 4))
    compare("broadcast_to", x[:, :1, :], (2, 3, 4))


@pytest.mark.parametrize("dtype", ["bool", "int32", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize(
    "shape, perm",
    [
        ((2, 3, 4, 5), (0, 2, 1, 3)),  # heads first: the data moves
        ((2, 1, 4, 5), (0, 2, 1, 3)),  # one query: only an axis of length 1 moves
        ((1, 3, 1, 5), (2, 0, 3, 1)),
        ((2, 0, 4), (1, 0, 2)),  # empty
        ((3,), (0,)),
    ],
)
def test_permutations(dtype, shape, perm):
    x = sample(shape, dtype)
    got = compare("transpose", x, perm)
    if dtype in ("float32", "float64"):
        assert got.is_contiguous()  # (strided views are read through a slow copy)
    if len(shape) > 1:
        compare("moveaxis", x, perm[0], -1)
        compare("moveaxis", x, [0, -1], [-1, 0])


def test_a_permutation_passes_gradients_back_permuted():
    rng = np.random.default_rng(5)
    x = paddle.to_tensor(rng.standard_normal((2, 3, 4, 5)), stop_gradient=False)
    weights = rng.standard_normal((2, 4, 3, 5))
    (PNS.transpose(x, (0, 2, 1, 3)) * paddle.to_tensor(weights)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), weights.transpose(0, 2, 1, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_concatenate(dtype):
    a, b, c = sample((2, 3, 4), dtype), sample((2, 1, 4), dtype), sample((2, 2, 4), dtype)
    compare("concatenate", [a, b, c], axis=1)
    compare("concatenate", [a, a], axis=0)
    compare("concatenate", [a, sample((2, 3, 2), dtype)], axis=-1)
    compare("concatenate", [a], axis=2)
    compare("concatenate", [a, b], axis=None)


def test_concatenate_of_mixed_dtypes_and_gradient():
    mixed = [sample((2, 3), "float16"), sample((1, 3), "float32"), sample((1, 3), "int32")]
    compare("concatenate", mixed, axis=0, value_args=mixed)
    ints = [sample((2,), "int8"), sample((3,), "int64")]
    compare("concatenate", ints, axis=0, value_args=ints)
    x = RNG.standard_normal((2, 3))
    leaf = tensor(x, "float64", grad=True)
    weights = RNG.standard_normal((2, 6))
    loss = PNS.sum(PNS.concatenate([leaf, leaf * 2.0], axis=1) * paddle.to_tensor(weights))
    (got,) = paddle_grads(loss, [leaf])
    assert rel_err(got, weights[:, :3] + 2.0 * weights[:, 3:]) <= 1e-12
    with pytest.raises(ValueError, match="at least one"):
        PNS.concatenate([], axis=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_slice(dtype):
    x = sample((3, 5, 4), dtype)
    compare("slice", x, (0, 1, 0), (3, 3, 4))
    compare("slice", x, (2, 0, 1), (1, 5, 2))
    compare("slice", x, (1, 2, 3), (2, 3, 1))
    compare("slice", x, (0, 4, 0), (3, 1, 4))
    got = PNS.slice(pd(x), (0, 2, 1), (-1, -1, 2))
    np.testing.assert_array_equal(to_np(got), to_np(pd(x))[:, 2:, 1:3])


def test_slice_with_tensor_starts_gradient_and_errors():
    x = RNG.standard_normal((4, 6))
    got = PNS.slice(paddle.to_tensor(x), (paddle.to_tensor(1), paddle.to_tensor(2)), (2, 3))
    np.testing.assert_array_equal(to_np(got), x[1:3, 2:5])
    leaf = tensor(x, "float64", grad=True)
    weights = RNG.standard_normal((2, 3))
    (grad,) = paddle_grads(
        PNS.sum(PNS.slice(leaf, (1, 2), (2, 3)) * paddle.to_tensor(weights)), [leaf]
    )
    want = np.zeros_like(x)
    want[1:3, 2:5] = weights
    np.testing.assert_array_equal(to_np(grad), want)
    with pytest.raises(ValueError, match="inside"):
        PNS.slice(paddle.to_tensor(x), (3, 0), (2, 6))
    with pytest.raises(ValueError, match="one start"):
        PNS.slice(paddle.to_tensor(x), (0,), (2, 6))


def test_fori_loop_matches_keras_and_carries_gradients():
    def body(i, val):
        return val[0] * 0.5 + i, val[1] + 1

    want = KNS.fori_loop(1, 4, body, (np.ones(4), 0))
    got = PNS.fori_loop(1, 4, body, (paddle.ones([4], dtype="float64"), 0))
    np.testing.assert_allclose(to_np(got[0]), np.asarray(want[0]))
    assert got[1] == want[1] == 3
    assert PNS.fori_loop(2, 2, body, "untouched") == "untouched"
    x = RNG.standard_normal((3, 4))
    leaf = tensor(x, "float64", grad=True)

    def rows(i, acc):
        return acc + PNS.slice(leaf, (i, 0), (1, 4)) * float(i + 1)

    out = PNS.fori_loop(0, 3, rows, PNS.slice(leaf, (0, 0), (1, 4)) * 0.0)
    np.testing.assert_allclose(to_np(out)[0], x[0] + 2 * x[1] + 3 * x[2])
    (grad,) = paddle_grads(PNS.sum(out), [leaf])
    np.testing.assert_array_equal(to_np(grad), np.repeat([[1.0], [2.0], [3.0]], 4, axis=1))


def test_reshape_with_zero_size_dimensions():
    got = PNS.reshape(paddle.zeros([0, 3]), (3, 0))
    assert tuple(got.shape) == (3, 0)
    got = PNS.reshape(paddle.zeros([2, 0]), (0, 5))
    assert tuple(got.shape) == (0, 5)
    with pytest.raises(ValueError, match="cannot reshape"):
        PNS.reshape(paddle.zeros([2, 3]), (0, 3))


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((5,), {"dtype": "int32"}),
        ((5,), {}),
        ((2, 9, 3), {}),
        ((5.0,), {}),
        ((0, 1, 0.25), {"dtype": "float64"}),
        ((7,), {"dtype": "int64"}),
        ((4,), {"dtype": "float16"}),
        ((6,), {"dtype": "int8"}),
        ((0,), {"dtype": "int32"}),
    ],
)
def test_arange(args, kwargs):
    want = np.asarray(KNS.arange(*args, **kwargs))
    got = PNS.arange(*args, **kwargs)
    assert PNS.dtype_name(got) == kwargs.get("dtype", standardize_dtype(want.dtype))
    np.testing.assert_array_equal(to_np(got), want)


# --- elementwise --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["tanh", "exp"])
def test_unary_float_ops(name, dtype):
    compare(name, sample((3, 4), dtype, -3, 4))


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_erf(dtype):
    """Floating inputs only: the core takes erf of floats (the GELU), and Keras' numpy
    backend returns integers for integer inputs. Own generator: the module's feeds the
    tests after this one."""
    data = np.random.default_rng(5).standard_normal((3, 4)) * 2
    compare("erf", data.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype))


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_exp_underflows_to_exactly_zero(dtype):
    """Paddle's vectorised exp returns a denormal floor where the result underflows (also
    for -inf): the namespace flushes it to 0, so masked exponentials are exactly 0."""
    x = np.array([-np.inf, -1e4, -800.0, -120.0, 0.0, 1.0] * 4)
    got = to_np(PNS.exp(tensor(x, dtype)))
    tiny = np.finfo(np.float64 if dtype == "float64" else np.float32).tiny
    flushed = np.exp(x) < tiny  # float64: -inf, -1e4, -800; else also -120
    assert np.all(got[flushed] == 0.0)
    np.testing.assert_allclose(got[~flushed], np.exp(x[~flushed]), rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_abs_and_multiply(dtype):
    a, b = sample((3, 4), dtype, -3, 4), sample((3, 4), dtype, -3, 4)
    compare("abs", a)
    compare("multiply", a, b)
    compare("multiply", a[:1], b)
    compare("multiply", a, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_take(dtype):
    x = sample((4, 3, 2), dtype, -3, 4)
    idx = np.array([[0, 3], [-1, 2]], dtype="int32")
    compare("take", x, idx, axis=0)
    compare("take", x, idx % 3, axis=1, value_args=[x])
    compare("take", x, np.array([5, 0, -2]), value_args=[x])  # flattened
    with pytest.raises(TypeError, match="`indices` must be integers"):
        PNS.take(pd(x), np.array([0.5]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("contract", [1, 2])
@pytest.mark.parametrize("out", [(5,), (3, 2)], ids=["out5", "out3x2"])
def test_linear(dtype, contract, out):
    x = sample((2, 3, 4, 2), dtype)
    kernel = sample(((4, 2) if contract == 2 else (2,)) + out, dtype)
    bias = sample(out, dtype)
    compare("linear", x, kernel, bias, contract=contract)
    compare("linear", x, kernel, contract=contract)
    with pytest.raises(ValueError, match="`contract`"):
        PNS.linear(pd(x), pd(kernel), contract=5)


def test_linear_of_empty_inputs():
    kernel = sample((4, 3, 2), "float32")
    compare("linear", np.zeros((0, 5, 4), "float32"), kernel, sample((3, 2), "float32"))
    compare("linear", np.zeros((2, 0, 4), "float32"), kernel)


def test_linear_refuses_contracted_axes_that_differ_from_the_kernels():
    x, kernel = pd(sample((2, 3, 2, 6), "float32")), pd(sample((3, 4, 5), "float32"))
    with pytest.raises(ValueError, match=r"last 2 axes of `x` \[2, 6\].*\[3, 4\]"):
        PNS.linear(x, kernel, contract=2)  # 2 * 6 == 3 * 4: a flat product would run


@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_gradients_match_the_einsum_and_addition(with_bias):
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s) for s in ((2, 3, 4), (4, 3, 2), (3, 2))]
    weights = rng.standard_normal((2, 3, 3, 2))

    def grads(fn):
        x, kernel, bias = (paddle.to_tensor(a, stop_gradient=False) for a in arrays)
        y = fn(x, kernel, bias if with_bias else None)
        (y * paddle.to_tensor(weights)).sum().backward()
        return [t.grad.numpy() if t.grad is not None else None for t in (x, kernel, bias)]

    def einsum_and_add(x, kernel, bias):
        y = PNS.einsum("abc,cde->abde", x, kernel)
        return y if bias is None else y + bias

    got = grads(PNS.linear)
    want = grads(einsum_and_add)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log(dtype):
    compare("log", sample((3, 4), dtype, 1, 5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_like(dtype):
    compare("zeros_like", sample((3, 4), dtype, -3, 4))
    compare("zeros_like", sample((2, 3), dtype, -3, 4), dtype="float64")


@pytest.mark.parametrize("dtype", DTYPES)
def test_square(dtype):
    compare("square", sample((3, 4), dtype, -3, 4))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_rsqrt(dtype):
    compare("rsqrt", (np.abs(sample((3, 4), "float64")) + 0.1).astype(sample((1,), dtype).dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_logical_ops(dtype):
    a, b = sample((3, 4), dtype, -1, 2), sample((3, 4), dtype, -1, 2)
    compare("logical_and", a, b)
    compare("logical_or", a, b)
    compare("logical_not", a)
    compare("logical_and", a, True)
    compare("logical_or", a[:1], b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["less", "less_equal", "not_equal", "equal", "greater_equal"])
def test_comparisons(name, dtype):
    a, b = sample((3, 4), dtype, -2, 3), sample((3, 4), dtype, -2, 3)
    compare(name, a, b)
    compare(name, a, a)
    compare(name, a[:, :1], b)
    compare(name, a, 0)
    if dtype != "bool":
        compare(name, a, 0.5)


def test_comparisons_of_mixed_dtypes():
    compare("less", sample((4,), "int32"), sample((4,), "float32"))
    compare("not_equal", sample((4,), "int8"), sample((4,), "int64"))
    compare("less_equal", np.arange(5, dtype="int32"), np.int32(2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_where(dtype):
    cond = RNG.random((2, 1, 4)) < 0.5
    x = sample((1, 3, 4), dtype)
    y = sample((2, 3, 1), dtype)
    compare("where", cond, x, y, value_args=[x, y])
    if dtype != "bool":
        compare("where", cond, x, float("-inf"), value_args=[x])
        compare("where", cond, x, 0.0, value_args=[x])
        compare("where", cond, 1.0, x, value_args=[x])
    compare("where", cond, x, 0, value_args=[x])
    compare("where", cond.astype("int32"), x, y, value_args=[x, y])


def test_where_mixed_and_index_forms():
    cond = np.array([[True, False, True], [False, False, True]])
    x16, x32 = sample((2, 3), "float16"), sample((2, 3), "float32")
    compare("where", cond, x16, x32)
    compare("where", cond, 1.0, 0)
    got = PNS.where(pd(cond))
    want = KNS.where(cond)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        np.testing.assert_array_equal(to_np(g), np.asarray(w))
    with pytest.raises(ValueError, match="both"):
        PNS.where(pd(cond), pd(x32))


def test_where_with_minus_inf_keeps_float64():
    x = paddle.to_tensor(np.array([[1.0, 2.0], [3.0, 4.0]]))
    got = PNS.where(paddle.to_tensor([[True, False], [False, False]]), x, float("-inf"))
    assert PNS.dtype_name(got) == "float64"
    assert to_np(got).tolist() == [[1.0, -np.inf], [-np.inf, -np.inf]]


# --- reductions ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [None, -1, (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(dtype, axis, keepdims):
    x = sample((2, 3, 4), dtype)
    compare("any", x, axis=axis, keepdims=keepdims)
    compare("sum", x, axis=axis, keepdims=keepdims)
    compare("max", x, axis=axis, keepdims=keepdims)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_max_over_minus_inf(dtype):
    x = np.array([[-np.inf, 1.0, -2.0], [-np.inf, -np.inf, -np.inf], [0.5, -np.inf, 3.0]])
    x = x.astype(dtype)
    got = compare("max", x, axis=-1, keepdims=True)
    assert to_np(got)[1, 0] == -np.inf
    compare("max", x, axis=-1, initial=0.0)
    compare("max", x, initial=10.0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("axis", [-1, 0, (1, 2)])
def test_softmax(dtype, axis):
    compare("softmax", sample((2, 3, 4), dtype), axis=axis)


# --- einsum -------------------------------------------------------------------------------

CORE_EINSUMS = {
    "bqhd,bkhd->bhqk": [(2, 3, 4, 5), (2, 6, 4, 5)],
    "bhqk,bkhd->bqhd": [(2, 4, 3, 6), (2, 6, 4, 5)],
    "...qd,...kd->...qk": [(2, 1, 3, 5), (2, 4, 6, 5)],
    "...qd,du->...qu": [(2, 3, 5), (5, 7)],
    "...qku,u->...qk": [(2, 3, 6, 7), (7,)],
    "...qe,ed->...qd": [(4, 3, 5), (5, 6)],
    "...qk,...kd->...qd": [(1, 4, 3, 6), (2, 1, 6, 5)],
    "bte,ehd->bthd": [(2, 3, 8), (8, 2, 4)],
    "bthv,hvo->bto": [(2, 3, 2, 4), (2, 4, 7)],
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("subscripts", list(CORE_EINSUMS))
def test_einsum_core_subscripts(subscripts, dtype):
    arrays = [sample(s, dtype) for s in CORE_EINSUMS[subscripts]]
    want = np.asarray(KNS.einsum(subscripts, *arrays))
    got = PNS.einsum(subscripts, *(pd(a) for a in arrays))
    assert PNS.dtype_name(got) == dtype
    exact = np.einsum(subscripts, *(a.astype(np.float64) for a in arrays))
    assert rel_err(got, exact) <= {"float64": 1e-14, "float32": 1e-6}.get(dtype, TOL[dtype])
    assert rel_err(got, want.astype(np.float64)) <= tolerance(dtype)


@pytest.mark.parametrize("dtype", ["bool", "int8", "int32", "int64"])
def test_einsum_of_integers_and_bools(dtype):
    a, b = sample((2, 3, 4), dtype), sample((2, 5, 4), dtype)
    compare("einsum", "...qd,...kd->...qk", a, b)
    compare("einsum", "bqd,bkd->bqk", a, b)


@pytest.mark.parametrize(
    "subscripts,shapes",
    [
        *CORE_EINSUMS.items(),
        ("ij,jk", [(2, 3), (3, 4)]),
        ("i,i", [(5,), (5,)]),
        ("...ij,...jk->...ik", [(1, 2, 3), (4, 3, 2)]),
        ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
        ("ij->ji", [(2, 3)]),
        ("...->...", [(2, 3)]),
    ],
)
def test_einsum_by_broadcast_fallback(subscripts, shapes):
    arrays = [RNG.standard_normal(s) for s in shapes]
    got = einsum_by_broadcast(subscripts, *(paddle.to_tensor(a) for a in arrays))
    assert rel_err(got, np.einsum(subscripts, *arrays)) <= 1e-14


def test_einsum_falls_back_when_paddle_einsum_fails(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel")

    a, b = RNG.standard_normal((2, 3, 4)), RNG.standard_normal((2, 5, 4))
    monkeypatch.setattr(paddle, "einsum", broken)
    got = PNS.einsum("...qd,...kd->...qk", paddle.to_tensor(a), paddle.to_tensor(b))
    assert rel_err(got, np.einsum("...qd,...kd->...qk", a, b)) <= 1e-14


def test_einsum_fallback_errors():
    with pytest.raises(ValueError, match="sizes"):
        einsum_by_broadcast("ij,jk->ik", paddle.ones([2, 3]), paddle.ones([4, 2]))
    with pytest.raises(NotImplementedError, match="diagonal"):
        einsum_by_broadcast("ii->i", paddle.ones([2, 2]))
    with pytest.raises(ValueError, match="operands"):
        einsum_by_broadcast("ij,jk->ik", paddle.ones([2, 3]))


# --- gradients of the namespace's own operations -------------------------------------------

COND = np.array([[True, False, True, True], [False, True, True, False], [True, True, False, True]])
GRAD_CASES = {
    "tanh": (lambda ns, x: ns.tanh(x), np.tanh),
    "erf": (lambda ns, x: ns.erf(x), np.vectorize(math.erf)),
    "exp": (lambda ns, x: ns.exp(x), np.exp),
    "softmax": (
        lambda ns, x: ns.softmax(x, axis=-1),
        lambda x: (
            np.exp(x - x.max(-1, keepdims=True))
            / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
        ),
    ),
    "where": (lambda ns, x: ns.where(COND, x, 0.5), lambda x: np.where(COND, x, 0.5)),
    "max": (lambda ns, x: ns.max(x, axis=-1, keepdims=True), lambda x: x.max(-1, keepdims=True)),
    "sum": (lambda ns, x: ns.sum(x, axis=0), lambda x: x.sum(0)),
    "einsum": (
        lambda ns, x: ns.einsum("...qd,...kd->...qk", x, x),
        lambda x: np.einsum("...qd,...kd->...qk", x, x),
    ),
    "shape_ops": (
        lambda ns, x: ns.broadcast_to(
            ns.expand_dims(ns.moveaxis(ns.transpose(ns.reshape(x, (2, 6))), 0, 1), 0), (3, 2, 6)
        ),
        lambda x: np.broadcast_to(x.reshape(2, 6).T.T[None], (3, 2, 6)),
    ),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradients_flow_through_namespace_ops(name):
    fn, np_fn = GRAD_CASES[name]
    x = RNG.standard_normal((3, 4))
    weights = RNG.standard_normal(np.shape(np_fn(x)))
    leaf = tensor(x, "float64", grad=True)
    loss = PNS.sum(fn(PNS, leaf) * paddle.to_tensor(weights))
    (got,) = paddle_grads(loss, [leaf])
    (want,) = numeric_grad(lambda a: float(np.sum(np_fn(a) * weights)), x)
    assert rel_err(got, want) <= 1e-9


def test_stop_gradient_cuts_the_gradient():
    x = tensor(np.array([1.0, 2.0, 3.0]), "float64", grad=True)
    frozen = PNS.stop_gradient(x * 2.0)
    np.testing.assert_array_equal(to_np(frozen), [2.0, 4.0, 6.0])
    (grad,) = paddle_grads(PNS.sum(frozen * x), [x])
    np.testing.assert_array_equal(grad, [2.0, 4.0, 6.0])  # d/dx (c * x) with c held constant


def test_custom_gradient_replaces_the_backward_pass():
    """The gradient is what ``backward`` says (not the derivative of ``forward``); a
    tensor ``forward`` closes over gets none; ``forward`` runs once."""
    x = tensor(np.array([1.0, -2.0, 3.0]), "float64", grad=True)
    closed = tensor(np.array([2.0, 2.0, 2.0]), "float64", grad=True)
    runs = []

    def forward(a):
        runs.append(1)
        return a * a * closed, (a,)

    def backward(saved, grad):
        (a,) = saved
        return (grad * 10.0 * a,)

    out = PNS.custom_gradient(forward, backward, (x,))
    np.testing.assert_array_equal(to_np(out), [2.0, 8.0, 18.0])
    (got,) = paddle_grads(PNS.sum(out * tensor(np.array([1.0, 2.0, 3.0]), "float64")), [x])
    np.testing.assert_array_equal(got, [10.0, -40.0, 90.0])
    assert closed.grad is None and len(runs) == 1


# --- dropout and symbolic values --------------------------------------------------------------


def test_dropout_with_an_int_seed_matches_keras_numpy_backend():
    x = sample((4, 6), "float32")
    got = PNS.dropout(pd(x), 0.3, 5)
    np.testing.assert_array_equal(to_np(got), keras.random.dropout(x, 0.3, seed=5))
    np.testing.assert_array_equal(to_np(PNS.dropout(pd(x), 0.3, 5)), to_np(got))


def test_dropout_with_a_seed_generator_follows_keras():
    x = sample((4, 6), "float32")
    ours, theirs = keras.random.SeedGenerator(3), keras.random.SeedGenerator(3)
    first = to_np(PNS.dropout(pd(x), 0.4, ours))
    np.testing.assert_array_equal(first, keras.random.dropout(x, 0.4, seed=theirs))
    second = to_np(PNS.dropout(pd(x), 0.4, ours))
    np.testing.assert_array_equal(second, keras.random.dropout(x, 0.4, seed=theirs))
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_dropout_without_seed_uses_paddle_generator(dtype):
    paddle.seed(0)
    x = tensor(np.ones((100, 100)), dtype)
    out = to_np(PNS.dropout(x, 0.3, None))
    assert PNS.dtype_name(PNS.dropout(x, 0.3, None)) == dtype
    assert abs((out == 0).mean() - 0.3) < 0.03
    np.testing.assert_allclose(out[out != 0], 1 / 0.7, rtol=1e-3)
    assert PNS.dropout(x, 0.0, None) is x


def test_dropout_gradient_and_bad_seed():
    x = tensor(RNG.standard_normal((5, 5)), "float64", grad=True)
    out = PNS.dropout(x, 0.5, 1)
    (grad,) = paddle_grads(PNS.sum(out), [x])
    kept = to_np(out) != 0
    np.testing.assert_allclose(grad, np.where(kept, 2.0, 0.0))
    with pytest.raises(TypeError, match="seed"):
        PNS.dropout(x, 0.5, "seed")


def test_is_symbolic():
    assert PNS.is_symbolic(paddle.ones([2])) is False
    assert PNS.is_symbolic(np.ones(2)) is False
    paddle.enable_static()
    try:
        with paddle.static.program_guard(paddle.static.Program()):
            value = paddle.static.data("v", [2, 3], "float32")
            assert PNS.is_symbolic(value) is True
    finally:
        paddle.disable_static()
    assert paddle.in_dynamic_mode()


# --- the core on Paddle tensors against the oracle ----------------------------------------------

SOFTMAX_CASES = {
    "none": {},
    "lens_1d": {"valid_lens": np.array([2, 0])},
    "lens_2d": {"valid_lens": np.array([[1, 4, 0], [3, 2, 4]])},
    "lens_float": {"valid_lens": np.array([3.0, 1.0])},
    "mask_bool": {"mask": RNG.random((2, 3, 4)) < 0.6},
    "mask_int": {"mask": (RNG.random((1, 3, 4)) < 0.6).astype("int32")},
    "mask_and_lens": {"mask": RNG.random((2, 3, 4)) < 0.7, "valid_lens": np.array([4, 1])},
    "fully_masked": {"mask": np.array([[True, True, False, True], [False] * 4, [True] * 4])},
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", list(SOFTMAX_CASES))
@pytest.mark.parametrize("lens_as", ["numpy", "paddle"])
def test_masked_softmax_vs_oracle(case, dtype, lens_as):
    x = RNG.standard_normal((2, 3, 4)) * 3
    kwargs = dict(SOFTMAX_CASES[case])
    if lens_as == "paddle":
        kwargs = {k: paddle.to_tensor(v) for k, v in kwargs.items()}
    got = ops.masked_softmax(tensor(x, dtype), **kwargs)
    assert isinstance(got, paddle.Tensor) and PNS.dtype_name(got) == dtype
    want = ref.masked_softmax(rounded(x, dtype), **SOFTMAX_CASES[case])
    assert_close(got, want, dtype)
    if case == "fully_masked":
        assert np.all(to_np(got)[:, 1] == 0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_masked_softmax_on_another_axis_and_with_heads(dtype):
    x = RNG.standard_normal((2, 2, 3, 4))
    mask = RNG.random((2, 1, 3, 4)) < 0.6
    got = ops.masked_softmax(tensor(x, dtype), mask=paddle.to_tensor(mask), axis=1)
    want = np.moveaxis(
        ref.masked_softmax(
            np.moveaxis(rounded(x, dtype), 1, -1),
            mask=np.moveaxis(np.broadcast_to(mask, x.shape), 1, -1),
        ),
        -1,
        1,
    )
    assert_close(got, want, dtype)
    lens = np.array([[1, 0, 3], [4, 2, 2]])
    got = ops.masked_softmax(tensor(x, dtype), valid_lens=paddle.to_tensor(lens))
    assert_close(got, ref.masked_softmax(rounded(x, dtype), valid_lens=lens), dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_masked_softmax_half_precision(dtype):
    x = RNG.standard_normal((2, 3, 4))
    got = ops.masked_softmax(tensor(x, dtype), valid_lens=paddle.to_tensor([0, 3]))
    assert PNS.dtype_name(got) == dtype
    assert_close(got, ref.masked_softmax(rounded(x, dtype), valid_lens=[0, 3]), dtype)


SDPA_CASES = {
    "self": ((2, 4, 8), (2, 4, 8), (2, 4, 8), {}),
    "cross_dv": ((2, 3, 8), (2, 5, 8), (2, 5, 6), {}),
    "lens_1d": ((2, 3, 8), (2, 5, 8), (2, 5, 6), {"valid_lens": np.array([0, 3])}),
    "lens_2d": ((2, 3, 8), (2, 5, 8), (2, 5, 6), {"valid_lens": np.array([[1, 0, 5], [2, 3, 4]])}),
    "mask": ((2, 3, 8), (2, 5, 8), (2, 5, 8), {"mask": RNG.random((2, 3, 5)) < 0.5}),
    "causal_fewer_queries": ((2, 3, 8), (2, 5, 8), (2, 5, 8), {"causal": True}),
    "causal_more_queries": ((2, 5, 8), (2, 3, 8), (2, 3, 8), {"causal": True}),
    "heads_4d": (
        (2, 3, 4, 8),
        (2, 3, 6, 8),
        (2, 3, 6, 5),
        {"mask": RNG.random((1, 3, 4, 6)) < 0.6, "valid_lens": np.array([6, 2])},
    ),
    "scale": ((2, 4, 8), (2, 4, 8), (2, 4, 8), {"scale": 0.3, "valid_lens": np.array([1, 4])}),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_scaled_dot_product_attention_vs_oracle(case, dtype):
    qs, ks, vs, kwargs = SDPA_CASES[case]
    q, k, v = (RNG.standard_normal(s) for s in (qs, ks, vs))
    args = {
        key: paddle.to_tensor(val) if isinstance(val, np.ndarray) else val
        for key, val in kwargs.items()
    }
    out, weights = ops.scaled_dot_product_attention(
        *(tensor(a, dtype) for a in (q, k, v)), return_weights=True, **args
    )
    plain = ops.scaled_dot_product_attention(*(tensor(a, dtype) for a in (q, k, v)), **args)
    oracle_kwargs = dict(kwargs)
    if case == "heads_4d":  # the oracle's valid_lens broadcast over heads the same way
        oracle_kwargs["valid_lens"] = kwargs["valid_lens"]
    want_out, want_w = ref.scaled_dot_product_attention(
        *(rounded(a, dtype) for a in (q, k, v)), **oracle_kwargs
    )
    assert PNS.dtype_name(out) == dtype
    assert_close(out, want_out, dtype)
    assert_close(plain, want_out, dtype)
    assert_close(weights, want_w, dtype)
    if case == "causal_more_queries":  # the first two queries see no key: zero rows
        assert np.all(to_np(weights)[:, :2] == 0) and np.all(to_np(out)[:, :2] == 0)
    if case == "lens_1d":
        assert np.all(to_np(weights)[0] == 0) and np.all(to_np(out)[0] == 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scaled_dot_product_attention_half_precision(dtype):
    q, k, v = (RNG.standard_normal(s) for s in ((2, 3, 8), (2, 5, 8), (2, 5, 8)))
    out = ops.scaled_dot_product_attention(
        *(tensor(a, dtype) for a in (q, k, v)), valid_lens=paddle.to_tensor([2, 0])
    )
    assert PNS.dtype_name(out) == dtype
    want, _ = ref.scaled_dot_product_attention(
        *(rounded(a, dtype) for a in (q, k, v)), valid_lens=[2, 0]
    )
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scoring_functions_and_score_attention_vs_oracle(dtype):
    q, k, v, wq, wk, wv, w = (
        RNG.standard_normal(s)
        for s in ((2, 3, 4), (2, 5, 6), (2, 5, 3), (4, 7), (6, 7), (7,), (4, 6))
    )
    kk = RNG.standard_normal((2, 5, 4))
    r = {
        n: rounded(a, dtype)
        for n, a in dict(q=q, k=k, v=v, wq=wq, wk=wk, wv=wv, w=w, kk=kk).items()
    }
    t = {
        n: tensor(a, dtype) for n, a in dict(q=q, k=k, v=v, wq=wq, wk=wk, wv=wv, w=w, kk=kk).items()
    }
    assert_close(ops.dot_scores(t["q"], t["kk"]), ref.dot_scores(r["q"], r["kk"]), dtype)
    assert_close(
        ops.scaled_dot_scores(t["q"], t["kk"], scale=0.7),
        ref.scaled_dot_scores(r["q"], r["kk"], scale=0.7),
        dtype,
    )
    scores = ops.additive_scores(t["q"], t["k"], t["wq"], t["wk"], t["wv"])
    want_scores = ref.additive_scores(r["q"], r["k"], r["wq"], r["wk"], r["wv"])
    assert_close(scores, want_scores, dtype)
    assert_close(
        ops.general_scores(t["q"], t["k"], t["w"]),
        ref.general_scores(r["q"], r["k"], r["w"]),
        dtype,
    )
    lens = np.array([[2, 0, 5], [1, 1, 3]])
    out, weights = ops.score_attention(
        scores, t["v"], valid_lens=paddle.to_tensor(lens), return_weights=True
    )
    want_out, want_w = ref.attention(want_scores, r["v"], valid_lens=lens)
    assert_close(out, want_out, dtype)
    assert_close(weights, want_w, dtype)


@pytest.mark.parametrize("dtype", ["bool", "int32", "float32", "float64"])
@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_heads_vs_oracle(layout, dtype):
    x = sample((2, 3, 12), dtype)
    heads = ops.split_heads(pd(x), 4, layout=layout)
    assert PNS.dtype_name(heads) == dtype
    np.testing.assert_array_equal(
        to_np(heads), ref.split_heads(x, 4, layout).astype(to_np(heads).dtype)
    )
    back = ops.merge_heads(heads, layout=layout)
    np.testing.assert_array_equal(to_np(back), to_np(pd(x)))


def test_dropout_inside_the_core_is_seeded():
    q = tensor(RNG.standard_normal((2, 4, 8)))

    def run(seed):
        return to_np(
            ops.scaled_dot_product_attention(q, q, q, dropout=0.5, training=True, seed=seed)
        )

    assert np.array_equal(run(4), run(4))
    assert not np.array_equal(run(4), to_np(ops.scaled_dot_product_attention(q, q, q)))
    assert np.all(np.isfinite(run(None)))


def test_core_input_errors_on_paddle_tensors():
    x = tensor(RNG.standard_normal((2, 3, 4)))
    with pytest.raises(ValueError, match="valid_lens"):
        ops.masked_softmax(x, paddle.to_tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="valid_lens"):
        ops.masked_softmax(x, paddle.to_tensor([1, 5]))
    with pytest.raises(TypeError, match="mask"):
        ops.masked_softmax(x, mask=paddle.ones([3, 4]))
    with pytest.raises(TypeError, match="x"):
        ops.masked_softmax(paddle.ones([2, 3], dtype="int32"))


# --- gradients through the core -------------------------------------------------------------------


@pytest.mark.parametrize("backward", ["autodiff", "recompute", "saved"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_attention_gradients_match_finite_differences_of_the_oracle(dtype, backward, monkeypatch):
    """The explicit path differentiated by Paddle, and by its own backward pass
    (`multiattn.ops.explicit_grad`,
    ``settings(autotune=Fixed(attention_backward="recompute"))`` or ``"saved"``)."""
    from multiattn import config
    from multiattn.ops import explicit_grad
    from multiattn.tuning import Fixed

    taken = []
    original = explicit_grad.attention
    monkeypatch.setattr(
        explicit_grad, "attention", lambda *a, **kw: taken.append(1) or original(*a, **kw)
    )
    # more queries than keys: the NaN screen runs before the path (`_screens_scores`)
    q, k, v = (RNG.standard_normal(s) for s in ((2, 9, 4), (2, 5, 4), (2, 5, 3)))
    lens = np.array([[2, 0, 5, 5, 1, 3, 5, 4, 2], [1, 4, 3, 0, 5, 5, 2, 1, 1]])
    weights = RNG.standard_normal((2, 9, 3))
    leaves = [tensor(a, dtype, grad=True) for a in (q, k, v)]
    with config.settings(autotune=Fixed(attention_backward=backward)):
        out = ops.scaled_dot_product_attention(*leaves, valid_lens=paddle.to_tensor(lens))
    loss = PNS.sum(out * tensor(weights, dtype))
    got = paddle_grads(loss, leaves)

    def oracle(qa, ka, va):
        return float(
            np.sum(ref.scaled_dot_product_attention(qa, ka, va, valid_lens=lens)[0] * weights)
        )

    want = numeric_grad(oracle, *(rounded(a, dtype) for a in (q, k, v)))
    bound = {"float64": 1e-9, "float32": 2e-6}[dtype]
    for g, w in zip(got, want):
        assert np.all(np.isfinite(g))
        assert rel_err(g, w) <= bound
    assert np.all(got[0][0, 1] == 0) and np.all(got[0][1, 3] == 0)  # rows with no key
    assert taken == ([] if backward == "autodiff" else [1])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["lens", "lens_causal"])
def test_blockwise_gradients_match_finite_differences_of_the_oracle(dtype, causal):
    """The blockwise path's own backward pass (`multiattn.ops.blockwise_grad`) on Paddle
    tensors."""
    q, k, v = (RNG.standard_normal(s) for s in ((2, 7, 4), (2, 5, 4), (2, 5, 3)))
    q = q * 3.0
    lens = np.array([[2, 0, 5, 5, 1, 3, 5], [1, 4, 3, 0, 5, 5, 2]])
    weights = RNG.standard_normal((2, 7, 3))
    leaves = [tensor(a, dtype, grad=True) for a in (q, k, v)]
    out = ops.scaled_dot_product_attention(
        *leaves, valid_lens=paddle.to_tensor(lens), causal=causal, block_size=(2, 2)
    )
    got = paddle_grads(PNS.sum(out * tensor(weights, dtype)), leaves)

    def oracle(qa, ka, va):
        out = ref.scaled_dot_product_attention(qa, ka, va, valid_lens=lens, causal=causal)[0]
        return float(np.sum(out * weights))

    want = numeric_grad(oracle, *(rounded(a, dtype) for a in (q, k, v)))
    bound = {"float64": 1e-9, "float32": 2e-6}[dtype]
    for g, w in zip(got, want):
        assert np.all(np.isfinite(g))
        assert rel_err(g, w) <= bound
    assert np.all(got[0][0, 1] == 0) and np.all(got[0][1, 3] == 0)  # rows with no key


def test_blockwise_gradient_of_the_queries_alone_and_no_second_differentiation():
    """Keys and values that take no gradient get none (Paddle wants None for them); a
    gradient with ``create_graph=True`` raises instead of missing the terms of the saved
    output."""
    q, k, v = (RNG.standard_normal(s) for s in ((1, 5, 4), (1, 6, 4), (1, 6, 3)))
    leaf = tensor(q, "float64", grad=True)
    kt, vt = tensor(k, "float64"), tensor(v, "float64")
    out = ops.scaled_dot_product_attention(leaf, kt, vt, causal=True, block_size=(2, 3))
    (got,) = paddle_grads(PNS.sum(out), [leaf])
    assert np.all(np.isfinite(got)) and kt.grad is None and vt.grad is None
    leaf2 = tensor(q, "float64", grad=True)
    (want,) = paddle_grads(
        PNS.sum(ops.scaled_dot_product_attention(leaf2, kt, vt, causal=True)), [leaf2]
    )
    assert rel_err(got, want) <= 1e-12
    again = ops.scaled_dot_product_attention(leaf, kt, vt, causal=True, block_size=(2, 3))
    with pytest.raises(Exception, match="differentiable once"):
        paddle.grad(PNS.sum(again), leaf, create_graph=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_masked_softmax_and_additive_gradients_match_finite_differences(dtype):
    x = RNG.standard_normal((2, 3, 4))
    mask = np.array([[True, False, True, True], [False] * 4, [True] * 4])
    r = RNG.standard_normal((2, 3, 4))
    leaf = tensor(x, dtype, grad=True)
    loss = PNS.sum(ops.masked_softmax(leaf, mask=paddle.to_tensor(mask)) * tensor(r, dtype))
    (got,) = paddle_grads(loss, [leaf])
    (want,) = numeric_grad(
        lambda a: float(np.sum(ref.masked_softmax(a, mask=mask) * r)), rounded(x, dtype)
    )
    assert np.all(got[:, 1] == 0)
    bound = {"float64": 1e-9, "float32": 2e-6}[dtype]
    assert rel_err(got, want) <= bound

    q, k, wq, wk, wv = (
        RNG.standard_normal(s) for s in ((2, 3, 4), (2, 5, 6), (4, 7), (6, 7), (7,))
    )
    r = RNG.standard_normal((2, 3, 5))
    leaves = [tensor(a, dtype, grad=True) for a in (q, k, wq, wk, wv)]
    loss = PNS.sum(ops.additive_scores(*leaves) * tensor(r, dtype))
    got = paddle_grads(loss, leaves)
    want = numeric_grad(
        lambda *a: float(np.sum(ref.additive_scores(*a) * r)),
        *(rounded(a, dtype) for a in (q, k, wq, wk, wv)),
    )
    for g, w in zip(got, want):
        assert rel_err(g, w) <= bound


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_vs_oracle_with_gradients(dtype):
    x, gamma, beta = (RNG.standard_normal(s) for s in ((2, 3, 6), (6,), (6,)))
    r = RNG.standard_normal((2, 3, 6))
    leaves = [tensor(a, dtype, grad=True) for a in (x, gamma, beta)]
    out = ops.layer_norm(*leaves, epsilon=1e-5)
    want = ref.layer_norm(*(rounded(a, dtype) for a in (x, gamma, beta)), 1e-5)
    assert PNS.dtype_name(out) == dtype
    assert_close(out, want, dtype, tol={"float64": 1e-12, "float32": 2e-6}[dtype])
    got = paddle_grads(PNS.sum(out * tensor(r, dtype)), leaves)
    want = numeric_grad(
        lambda *a: float(np.sum(ref.layer_norm(*a, 1e-5) * r)),
        *(rounded(a, dtype) for a in (x, gamma, beta)),
    )
    for g, w in zip(got, want):
        assert rel_err(g, w) <= {"float64": 1e-9, "float32": 1e-5}[dtype]


HALF_CORE = {
    "dot_scores": lambda q, k, v, w: (
        ops.dot_scores(q, k),
        lambda q, k, v, w: ref.dot_scores(q, k),
    ),
    "scaled_dot_scores": lambda q, k, v, w: (
        ops.scaled_dot_scores(q, k),
        lambda q, k, v, w: ref.scaled_dot_scores(q, k),
    ),
    "general_scores": lambda q, k, v, w: (
        ops.general_scores(q, k, w),
        lambda q, k, v, w: ref.general_scores(q, k, w),
    ),
    "layer_norm": lambda q, k, v, w: (
        ops.layer_norm(q, epsilon=1e-5),
        lambda q, k, v, w: ref.layer_norm(q, np.ones(4), np.zeros(4), 1e-5),
    ),
    "score_attention": lambda q, k, v, w: (
        ops.score_attention(ops.dot_scores(q, k), v),
        lambda q, k, v, w: ref.attention(ref.dot_scores(q, k), v)[0],
    ),
    "additive_scores": lambda q, k, v, w: (
        ops.additive_scores(q, k, w, w, w[0]),
        lambda q, k, v, w: ref.additive_scores(q, k, w, w, w[0]),
    ),
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(HALF_CORE))
def test_half_precision_core_functions_on_paddle_cpu(name, dtype):
    arrays = [RNG.standard_normal(s) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 4), (4, 4))]
    got, oracle_fn = HALF_CORE[name](*(tensor(a, dtype) for a in arrays))
    assert PNS.dtype_name(got) == dtype
    want = oracle_fn(*(rounded(a, dtype) for a in arrays))
    # Scores are computed in the input dtype (one more rounding than attention).
    assert_close(got, want, dtype, tol=4 * TOL[dtype])


# --- sequences of length 0 ----------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["heads", "grouped"])
@pytest.mark.parametrize(
    "tq, tk", [(0, 3), (3, 0), (0, 0)], ids=["no queries", "no keys", "neither"]
)
def test_attention_over_empty_sequences_gives_zeros_and_zero_gradients(tq, tk, kv_heads):
    """No queries, no keys or neither: the oracle's shapes, zeros where the output has
    entries, and zero gradients of the inputs' shapes (connected: Paddle's backward runs)."""
    arrays = [
        RNG.standard_normal(s) for s in ((2, 4, tq, 4), (2, kv_heads, tk, 4), (2, kv_heads, tk, 5))
    ]
    leaves = [tensor(a, "float32", grad=True) for a in arrays]
    out, weights = ops.scaled_dot_product_attention(*leaves, causal=True, return_weights=True)
    groups = 4 // kv_heads
    want, want_w = ref.scaled_dot_product_attention(
        arrays[0], *(np.repeat(a, groups, axis=1) for a in arrays[1:]), causal=True
    )
    assert to_np(out).shape == want.shape and to_np(weights).shape == want_w.shape
    assert not np.any(to_np(out))
    assert not out.stop_gradient and not weights.stop_gradient  # connected to the inputs
    grads = paddle_grads(PNS.sum(out) + PNS.sum(weights), leaves)
    for g, a in zip(grads, arrays):
        assert g.shape == a.shape and not np.any(g)


def test_bad_permutations_raise():
    x = pd(sample((2, 3, 4), "float32"))
    for bad in ((0, 1), (0, 1, 3), (0, 0, 1)):  # (paddle.transpose takes the first)
        with pytest.raises(ValueError, match=r"`axes` must order each of the 3 axes"):
            PNS.transpose(x, bad)
    for source, destination in ((3, 0), ([0, 0], [1, 2]), ([0, 1], [2])):
        with pytest.raises(ValueError, match="`source` and `destination`"):
            PNS.moveaxis(x, source, destination)
    compare("transpose", sample((2, 3, 4), "float32"), (0, -1, 1))
    compare("moveaxis", sample((2, 3, 4), "float32"), -3, -1)
    # NumPy refuses these too; Paddle's namespace used to wrap 4 to 0 and -5 to 3
    for bad in (4, -5, (0, 0), (0, 5)):
        with pytest.raises(ValueError, match=r"`axis` must name distinct axes of the rank"):
            PNS.expand_dims(x, bad)
    for axis in (3, -4, (0, 4), (-1, -5)):
        compare("expand_dims", sample((2, 3, 4), "float32"), axis)

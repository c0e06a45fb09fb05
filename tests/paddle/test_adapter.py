"""The PaddlePaddle document's layers (`multiattn.backends.paddle`) against the float64
oracle and a direct NumPy transcription of the document's formula."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import paddle
import pytest
from _paddle_support import (
    FLOAT_DTYPES,
    assert_close,
    numeric_grad,
    rel_err,
    tensor,
    to_np,
)
from multiattn.backends.paddle import FILL_VALUE, DotProductAttention, MultiHeadAttention

from multiattn import ops
from multiattn import reference as ref

RNG = np.random.default_rng(3)
ROOT = Path(__file__).resolve().parents[2]
# Bounds on max |got - want| / max |want| of the layers against the oracle. The float32
# layers run their Linear projections in float32, one rounding step more than the core.
OUT_TOL = {"float64": 1e-12, "float32": 1e-6}
GRAD_TOL = {"float64": 1e-9, "float32": 1e-5}

T, D_IN, HIDDEN, HEADS, D_OUT = 5, 6, 3, 2, 4


# --- oracles ------------------------------------------------------------------------------


def params_of(layer: paddle.nn.Layer) -> dict[str, np.ndarray]:
    """The layer's parameters as float64 NumPy (Linear weights are ``(in, out)``)."""
    return {name: to_np(value) for name, value in layer.state_dict().items()}


def oracle(xq, xk, xv, lens, p: dict, heads: int | None, hidden: int) -> np.ndarray:
    """The document's layer from `multiattn.reference`.

    ``heads=None``: DotProductAttention; otherwise MultiHeadAttention with the document's
    interleaved split and contiguous merge. The oracle's attention gives a zero row for
    a zero valid length; the document's fill (-1e6 everywhere in the row) gives uniform
    weights instead, so those rows are the mean of the values.
    """

    def proj(x, name):
        return np.asarray(x, np.float64) @ p[f"{name}.weight"] + p[f"{name}.bias"]

    q, k, v = proj(xq, "W_q"), proj(xk, "W_k"), proj(xv, "W_v")
    if heads is not None:
        q, k, v = (ref.split_heads(a, heads, "interleaved") for a in (q, k, v))
    scale = 1.0 / math.sqrt(hidden)
    if lens is None:
        z, _ = ref.scaled_dot_product_attention(q, k, v, scale=scale)
    else:
        lens = np.minimum(np.asarray(lens, np.float64).astype(np.int64), k.shape[-2])
        z, _ = ref.scaled_dot_product_attention(q, k, v, valid_lens=lens, scale=scale)
        empty = (lens == 0).reshape((-1,) + (1,) * (z.ndim - 1))
        z = np.where(empty, v.mean(axis=-2, keepdims=True), z)
    if heads is None:
        return z
    return proj(ref.merge_heads(z, "contiguous"), "W_o")


def document_formula(xq, xk, xv, lens, p: dict, heads: int | None, hidden: int) -> np.ndarray:
    """The document's computation written directly in float64 NumPy: project, split
    features ``(hidden, heads)`` with the head axis moved forward, scores / sqrt(hidden),
    masked scores *replaced* by -1e6, softmax, weighted sum, heads moved back and
    flattened, output projection."""

    def proj(x, name):
        return np.asarray(x, np.float64) @ p[f"{name}.weight"] + p[f"{name}.bias"]

    n_heads = 1 if heads is None else heads
    batch, length = np.shape(xq)[:2]

    def split(y):
        return y.reshape(batch, length, hidden, n_heads).transpose(0, 3, 1, 2)

    q, k, v = split(proj(xq, "W_q")), split(proj(xk, "W_k")), split(proj(xv, "W_v"))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hidden)
    if lens is not None:
        keep = np.arange(length) < np.asarray(lens, np.float64).reshape(-1, 1, 1, 1)
        scores = np.where(keep, scores, -1e6)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    z = (e / e.sum(axis=-1, keepdims=True)) @ v
    z = z.transpose(0, 2, 1, 3).reshape(batch, length, n_heads * hidden)
    return z if heads is None else proj(z, "W_o")


def make(kind: str, dtype: str = "float32", seed: int = 0) -> paddle.nn.Layer:
    paddle.seed(seed)
    if kind == "dot":
        layer = DotProductAttention(T, D_IN, HIDDEN)
    else:
        layer = MultiHeadAttention(T, D_IN, HIDDEN, D_OUT, HEADS)
    if dtype != "float32":
        layer.to(dtype=dtype)
    return layer


def heads_of(kind: str) -> int | None:
    return None if kind == "dot" else HEADS


def inputs(batch: int = 4):
    return [RNG.standard_normal((batch, T, D_IN)) for _ in range(3)]


LENS = {
    "none": None,
    "int": np.array([0, 2, T, 3]),
    "float": np.array([3.0, 0.0, 1.0, T], dtype=np.float32),
    "above_query_size": np.array([T + 4, 1, 0, 9]),
}


# --- structure ------------------------------------------------------------------------------


def test_parameters_are_linear_layers_with_bias_named_as_in_the_document():
    dot = make("dot")
    assert {n: tuple(v.shape) for n, v in dot.state_dict().items()} == {
        "W_q.weight": (D_IN, HIDDEN),
        "W_q.bias": (HIDDEN,),
        "W_k.weight": (D_IN, HIDDEN),
        "W_k.bias": (HIDDEN,),
        "W_v.weight": (D_IN, HIDDEN),
        "W_v.bias": (HIDDEN,),
    }
    mha = make("mha")
    width = HIDDEN * HEADS
    assert {n: tuple(v.shape) for n, v in mha.state_dict().items()} == {
        "W_q.weight": (D_IN, width),
        "W_q.bias": (width,),
        "W_k.weight": (D_IN, width),
        "W_k.bias": (width,),
        "W_v.weight": (D_IN, width),
        "W_v.bias": (width,),
        "W_o.weight": (width, D_OUT),
        "W_o.bias": (D_OUT,),
    }
    assert all(isinstance(getattr(mha, n), paddle.nn.Linear) for n in ("W_q", "W_k", "W_v", "W_o"))
    assert (mha.query_size, mha.query_vec_size, mha.hidden_vec_size) == (T, D_IN, HIDDEN)
    assert (mha.output_vec_size, mha.head_num) == (D_OUT, HEADS)


def test_no_attention_weights_are_kept():
    layer = make("mha")
    layer(*(tensor(x) for x in inputs()), tensor(LENS["float"]))
    assert not any("attention" in name for name in vars(layer))
    assert not hasattr(layer, "attention_weights")


def test_the_documents_example_shapes_run():
    # The document's worked example: two words ("Thinking Machines"), three heads, the
    # output width equal to the input width; valid_lens passed as float32 as it does.
    paddle.seed(1)
    x = paddle.randn([1, 2, 4])
    lens = paddle.to_tensor([2.0], dtype="float32")
    mha = MultiHeadAttention(
        query_size=2, query_vec_size=4, hidden_vec_size=3, output_vec_size=4, head_num=3
    )
    assert tuple(mha(x, x, x, lens).shape) == (1, 2, 4)
    dot = DotProductAttention(query_size=2, query_vec_size=4, hidden_vec_size=3)
    assert tuple(dot(x, x, x, lens).shape) == (1, 2, 3)
    batch = paddle.randn([3, 2, 4])
    out = mha(batch, batch, batch, paddle.to_tensor([1.0, 2.0, 0.0]))
    assert tuple(out.shape) == (3, 2, 4) and bool(paddle.isfinite(out).all())


# --- outputs --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("lens", list(LENS))
@pytest.mark.parametrize("kind", ["dot", "mha"])
def test_outputs_match_the_oracle(kind, lens, dtype):
    layer = make(kind, dtype)
    xq, xk, xv = inputs()
    valid = LENS[lens]
    got = layer(
        *(tensor(x, dtype) for x in (xq, xk, xv)),
        None if valid is None else paddle.to_tensor(valid),
    )
    assert str(got.dtype) == f"paddle.{dtype}"
    p = params_of(layer)
    xs = [to_np(tensor(x, dtype)) for x in (xq, xk, xv)]
    assert_close(got, oracle(*xs, valid, p, heads_of(kind), HIDDEN), dtype, OUT_TOL[dtype])
    assert_close(
        got, document_formula(*xs, valid, p, heads_of(kind), HIDDEN), dtype, OUT_TOL[dtype]
    )


@pytest.mark.parametrize("kind", ["dot", "mha"])
def test_oracle_and_the_document_formula_agree(kind):
    """The fill -1e6 equals masking for rows with a key, and uniform weights without one."""
    layer = make(kind, "float64", seed=5)
    p = params_of(layer)
    xs = [x * 4 for x in inputs(batch=6)]
    lens = np.array([0, 1, 2, 3, 5, 0])
    want = document_formula(*xs, lens, p, heads_of(kind), HIDDEN)
    assert rel_err(oracle(*xs, lens, p, heads_of(kind), HIDDEN), want) <= 1e-13


def test_a_zero_length_gives_the_documents_uniform_row_not_the_cores_zero_row():
    layer = make("dot", "float64")
    xq, xk, xv = (tensor(x, "float64") for x in inputs(batch=2))
    out = to_np(layer(xq, xk, xv, paddle.to_tensor([0, 3])))
    values = to_np(layer.W_v(xv))
    # Every query of batch row 0 averages all keys' values with equal weights.
    np.testing.assert_allclose(
        out[0], np.broadcast_to(values[0].mean(axis=0), out[0].shape), rtol=1e-13
    )
    # The core's own masking gives a zero row for the same length...
    q, k, v = layer.W_q(xq), layer.W_k(xk), layer.W_v(xv)
    scale = 1 / math.sqrt(HIDDEN)
    core = to_np(
        ops.scaled_dot_product_attention(q, k, v, valid_lens=paddle.to_tensor([0, 3]), scale=scale)
    )
    assert np.all(core[0] == 0)
    # ...and replacing the zero length by the full length is not the document's row either:
    # it weights the keys by their real scores instead of uniformly.
    full = to_np(
        ops.scaled_dot_product_attention(q, k, v, valid_lens=paddle.to_tensor([T, 3]), scale=scale)
    )
    assert rel_err(full[0], out[0]) > 1e-3
    np.testing.assert_allclose(full[1], out[1], rtol=1e-13)


def test_the_fill_value_is_the_documents():
    assert FILL_VALUE == -1e6


@pytest.mark.parametrize("kind", ["dot", "mha"])
def test_int_float_numpy_and_list_valid_lens_agree(kind):
    layer = make(kind)
    xs = [tensor(x) for x in inputs()]
    lens = [0, 2, 5, 3]
    outs = [
        to_np(layer(*xs, v))
        for v in (
            paddle.to_tensor(lens, dtype="float32"),
            paddle.to_tensor(lens, dtype="int64"),
            paddle.to_tensor(lens, dtype="int32"),
            np.array(lens, dtype=np.float64),
            lens,
        )
    ]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    full = to_np(layer(*xs, [T, T, 99, T + 1]))
    np.testing.assert_array_equal(full, to_np(layer(*xs)))
    np.testing.assert_array_equal(full, to_np(layer(*xs, None)))


def test_interleaved_split_and_contiguous_merge():
    """Permuting the projection features as the document's heads read them changes the
    output unless W_o's rows are permuted to match: the merge is contiguous."""
    layer = make("mha", "float64")
    xs = [tensor(x, "float64") for x in inputs()]
    q = layer.W_q(xs[0])
    heads = to_np(ops.split_heads(q, HEADS, layout="interleaved"))
    np.testing.assert_array_equal(heads[:, 1, :, :], to_np(q)[:, :, 1::HEADS])
    z = paddle.to_tensor(heads)
    merged = to_np(ops.merge_heads(z, layout="contiguous"))
    np.testing.assert_array_equal(merged[:, :, HIDDEN : 2 * HIDDEN], heads[:, 1])


# --- gradients and training ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind", ["dot", "mha"])
def test_gradients_match_finite_differences_of_the_oracle(kind, dtype):
    layer = make(kind, dtype, seed=2)
    xq, xk, xv = inputs(batch=3)
    lens = np.array([0.0, 2.0, 4.0], dtype=np.float32)
    xs = [tensor(x, dtype, grad=True) for x in (xq, xk, xv)]
    out = layer(*xs, paddle.to_tensor(lens))
    weights = RNG.standard_normal(tuple(out.shape))
    loss = paddle.sum(out * tensor(weights, dtype))
    loss.backward()
    names = list(params_of(layer))
    params = dict(layer.named_parameters())
    assert set(params) == set(names)
    got = [to_np(params[n].grad) for n in names] + [to_np(x.grad) for x in xs]
    for g in got:
        assert np.all(np.isfinite(g))

    def f(*arrays):
        p = dict(zip(names, arrays[: len(names)]))
        return float(
            np.sum(oracle(*arrays[len(names) :], lens, p, heads_of(kind), HIDDEN) * weights)
        )

    p0 = params_of(layer)
    want = numeric_grad(f, *(p0[n] for n in names), *(to_np(x) for x in xs))
    scale = max(np.abs(w).max() for w in want)
    for name, g, w in zip([*names, "queries", "keys", "values"], got, want):
        if name == "W_k.bias":
            # Adding a bias to every key adds the same q.b to a query's scores, which the
            # softmax ignores: this gradient is zero up to rounding.
            assert np.abs(g).max() <= GRAD_TOL[dtype] * scale
            continue
        assert rel_err(g, w) <= GRAD_TOL[dtype], name
        assert np.any(g != 0), name


@pytest.mark.parametrize("optimizer", ["Adam", "SGD"])
def test_an_optimizer_step_lowers_the_loss(optimizer):
    layer = make("mha")
    xs = [tensor(x) for x in inputs()]
    target = tensor(RNG.standard_normal((4, T, D_OUT)))
    lens = paddle.to_tensor([5.0, 3.0, 0.0, 1.0])
    opt_cls = getattr(paddle.optimizer, optimizer)
    opt = opt_cls(learning_rate=0.05, parameters=layer.parameters())
    losses = []
    for _ in range(5):
        loss = paddle.mean((layer(*xs, lens) - target) ** 2)
        loss.backward()
        for name, param in layer.named_parameters():
            assert param.grad is not None and bool(paddle.isfinite(param.grad).all()), name
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]


# --- errors -------------------------------------------------------------------------------------


def _call(layer, q=None, k=None, v=None, lens="default"):
    xs = [tensor(x) for x in inputs()]
    q, k, v = (xs[i] if a is None else a for i, a in enumerate((q, k, v)))
    lens = paddle.to_tensor([1.0, 2.0, 3.0, 4.0]) if isinstance(lens, str) else lens
    return layer(q, k, v, lens)


BAD_CALLS = {
    "lens_longer_than_batch": (
        {"lens": paddle.to_tensor([1.0, 2.0, 3.0, 4.0, 5.0])},
        ValueError,
        r"`valid_lens` must have shape \(batch,\) = \(4,\)",
    ),
    "lens_2d": ({"lens": paddle.ones([4, T])}, ValueError, "valid_lens"),
    "lens_negative": ({"lens": [1, -1, 0, 2]}, ValueError, "valid_lens.*non-negative"),
    "lens_fraction": ({"lens": [1.5, 1, 0, 2]}, ValueError, "valid_lens.*whole"),
    "lens_nan": ({"lens": [float("nan"), 1, 0, 2]}, ValueError, "valid_lens"),
    "lens_bool": ({"lens": paddle.to_tensor([True] * 4)}, TypeError, "valid_lens"),
    "lens_strings": ({"lens": ["a", "b", "c", "d"]}, TypeError, "valid_lens"),
    "queries_length": (
        {"q": tensor(np.zeros((4, T + 1, D_IN)))},
        ValueError,
        r"`queries` must have shape .*\(batch, 5, 6\).*query_size",
    ),
    "keys_length": ({"k": tensor(np.zeros((4, T - 1, D_IN)))}, ValueError, "`keys`.*query_size"),
    "values_width": ({"v": tensor(np.zeros((4, T, D_IN + 1)))}, ValueError, "`values`"),
    "rank": ({"q": tensor(np.zeros((T, D_IN)))}, ValueError, "`queries`"),
    "batch_mismatch": ({"k": tensor(np.zeros((3, T, D_IN)))}, ValueError, "batch size"),
    "dtype": ({"q": tensor(np.zeros((4, T, D_IN)), "float64")}, TypeError, "`queries`.*float32"),
    "int_input": ({"v": paddle.zeros([4, T, D_IN], dtype="int32")}, TypeError, "`values`"),
    "keras_input": (
        {"q": keras.Variable(np.zeros((4, T, D_IN), "float32"))},
        TypeError,
        r"`queries` must be a paddle.Tensor, a NumPy array or Python values; received a "
        r"keras\..*\(keras\)",
    ),
    "keras_lens": (
        {"lens": keras.Variable(np.ones(4, "float32"))},
        TypeError,
        r"`valid_lens` must be a paddle.Tensor.*\(keras\)",
    ),
}


@pytest.mark.parametrize("kind", ["dot", "mha"])
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_gets_a_clear_error_naming_the_argument(case, kind):
    kwargs, error, match = BAD_CALLS[case]
    layer = make(kind)
    with pytest.raises(error, match=match) as info:
        _call(layer, **kwargs)
    name = "DotProductAttention" if kind == "dot" else "MultiHeadAttention"
    assert str(info.value).startswith(name)


@pytest.mark.parametrize(
    "cls,args,error,match",
    [
        (MultiHeadAttention, (0, 4, 3, 4, 2), ValueError, "query_size"),
        (MultiHeadAttention, (5, 4, 3, 4, 0), ValueError, "head_num"),
        (MultiHeadAttention, (5, 4.0, 3, 4, 2), TypeError, "query_vec_size"),
        (MultiHeadAttention, (5, 4, True, 4, 2), TypeError, "hidden_vec_size"),
        (MultiHeadAttention, (5, 4, 3, -1, 2), ValueError, "output_vec_size"),
        (DotProductAttention, (5, 0, 3), ValueError, "query_vec_size"),
        (DotProductAttention, (5, 4, 2.5), TypeError, "hidden_vec_size"),
    ],
)
def test_bad_constructor_arguments(cls, args, error, match):
    with pytest.raises(error, match=f"{cls.__name__}: `{match}`"):
        cls(*args)


# --- imports ------------------------------------------------------------------------------------


IMPORT_ALONE = """
import json, os, sys
from multiattn.backends import paddle
import keras
print(json.dumps([os.environ.get("KERAS_BACKEND"), keras.backend.backend(),
                  "tensorflow" in sys.modules]))
"""
# A stand-in TensorFlow module: the check looks at sys.modules, and importing the real
# TensorFlow would only cost time (paddle is never imported, so nothing crashes).
AFTER_TENSORFLOW = """
import sys, types
sys.modules["tensorflow"] = types.ModuleType("tensorflow")
try:
    from multiattn.backends import paddle
except ImportError as exc:
    print("paddle" in sys.modules, exc)
"""
UNDER_JAX = """
import json, os
from multiattn.backends import paddle as adapter
import keras, paddle
paddle.seed(0)
layer = adapter.MultiHeadAttention(3, 4, 2, 5, 2)
x = paddle.randn([2, 3, 4])
out = layer(x, x, x, paddle.to_tensor([0.0, 2.0]))
print(json.dumps([os.environ["KERAS_BACKEND"], keras.backend.backend(), list(out.shape),
                  bool(paddle.isfinite(out).all())]))
"""
# name -> (KERAS_BACKEND, or None for unset; code)
SUBPROCESSES = {
    "import_alone": (None, IMPORT_ALONE),
    "after_tensorflow": (None, AFTER_TENSORFLOW),
    "under_jax": ("jax", UNDER_JAX),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    """Every interpreter of this section, started together (each takes seconds)."""
    procs = {}
    for name, (backend, code) in SUBPROCESSES.items():
        env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        if backend is not None:
            env["KERAS_BACKEND"] = backend
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def last_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_worker_received_no_keras_backend(keras_backend_at_start):
    import keras

    assert keras_backend_at_start is None
    assert keras.backend.backend() == "numpy"


def test_import_alone_picks_numpy_and_loads_no_tensorflow(runs):
    assert last_json(runs["import_alone"]) == ["numpy", "numpy", False]


def test_importing_after_tensorflow_raises_an_explaining_import_error(runs):
    proc = runs["after_tensorflow"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("False ")  # paddle was not imported
    assert "segmentation fault" in proc.stdout
    assert "Import paddle (or multiattn.backends.paddle) first" in proc.stdout


def test_a_chosen_keras_backend_is_kept_and_the_layers_run_under_it(runs):
    assert last_json(runs["under_jax"]) == ["jax", "jax", [2, 3, 5], True]

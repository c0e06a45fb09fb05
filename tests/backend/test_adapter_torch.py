"""The PyTorch adapter (document 002) against the document's formulas, the oracle and the core.

The document's formulas are re-derived here in float64 NumPy (``doc_*``): keys at positions
``>= valid_len`` are replaced by ``-1e6`` before a softmax over the keys.
"""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("the PyTorch adapter runs on Keras' torch backend", allow_module_level=True)

import torch
from _support import TOL, numeric_grad, rel_err, to_np
from multiattn.backends import torch as adapter
from torch import nn

from multiattn import layers
from multiattn import reference as ref

RNG = np.random.default_rng(2002)
GRAD_TOL = 1e-5
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}
# Measured max relative errors, printed at the end of the module (run with -s to see them).
MEASURED: dict[str, float] = {}


def check(label: str, got, want, bound: float) -> None:
    got = got.detach().numpy() if isinstance(got, torch.Tensor) else got
    err = rel_err(got, want)
    MEASURED[label] = max(MEASURED.get(label, 0.0), err)
    assert err <= bound, f"{label}: max relative error {err:.3e} > {bound:.1e}"


def t(x: np.ndarray, dtype: str = "float32") -> torch.Tensor:
    return torch.tensor(np.asarray(x), dtype=TORCH_DTYPES[dtype])


# --- the document's formulas, float64 NumPy ---------------------------------------------


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def doc_masked_softmax(x: np.ndarray, valid_lens: np.ndarray | None) -> np.ndarray:
    """Positions ``>= valid_len`` replaced by -1e6, then softmax (lens per row or per query)."""
    x = np.asarray(x, np.float64)
    if valid_lens is None:
        return softmax(x)
    lens = np.asarray(valid_lens)
    per_row = np.repeat(lens, x.shape[1]) if lens.ndim == 1 else lens.reshape(-1)
    flat = x.reshape(-1, x.shape[-1])
    flat = np.where(np.arange(x.shape[-1])[None, :] < per_row[:, None], flat, -1e6)
    return softmax(flat.reshape(x.shape))


def doc_additive(q, k, v, lens, w_q, w_k, w_v):
    """``w_q``/``w_k``/``w_v`` as stored by nn.Linear: ``(out, in)``."""
    features = np.tanh((q @ w_q.T)[:, :, None, :] + (k @ w_k.T)[:, None, :, :])
    weights = doc_masked_softmax((features @ w_v.T)[..., 0], lens)
    return weights @ v, weights


def doc_dot(q, k, v, lens):
    weights = doc_masked_softmax(q @ np.swapaxes(k, 1, 2) / np.sqrt(q.shape[-1]), lens)
    return weights @ v, weights


def empty_rows(lens: np.ndarray, batch: int, queries: int) -> np.ndarray:
    """Bool ``(batch, queries)``: True where a query has no valid key."""
    lens = np.asarray(lens)
    return np.broadcast_to(lens[:, None] if lens.ndim == 1 else lens, (batch, queries)) == 0


LENS_CASES = {
    "none": None,
    "1d": np.array([3, 5]),
    "1d_zero": np.array([0, 4]),
    "2d_zero": np.array([[0, 1, 5], [2, 0, 3]]),
}


# --- masked_softmax --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(LENS_CASES))
def test_masked_softmax_matches_document_and_oracle(dtype, case):
    x = RNG.standard_normal((2, 3, 5)) * 3
    lens = LENS_CASES[case]
    xt = t(x, dtype)
    x64 = to_np(xt)
    got = adapter.masked_softmax(xt, None if lens is None else torch.tensor(lens))
    assert got.dtype == xt.dtype and tuple(got.shape) == x.shape
    check(
        f"masked_softmax weights vs document ({dtype})",
        got,
        doc_masked_softmax(x64, lens),
        TOL[dtype],
    )
    if lens is None:
        check(
            f"masked_softmax weights vs oracle ({dtype})", got, ref.masked_softmax(x64), TOL[dtype]
        )
        return
    empty = empty_rows(lens, 2, 3)
    oracle = ref.masked_softmax(x64, valid_lens=lens)  # zeros in empty rows
    check(
        f"masked_softmax weights vs oracle ({dtype})",
        got.numpy()[~empty],
        oracle[~empty],
        TOL[dtype],
    )
    np.testing.assert_array_equal(
        got.numpy()[empty], got.numpy().dtype.type(1 / 5)
    )  # the -1e6 fill: uniform
    np.testing.assert_array_equal(oracle[empty], 0.0)  # where the core/oracle give zeros


def test_masked_softmax_keeps_input_and_accepts_float_lengths():
    x = torch.rand(2, 3, 6)
    before, version = x.clone(), x._version
    got = adapter.masked_softmax(x, torch.tensor([3.0, 0.0]))
    torch.testing.assert_close(x, before, rtol=0, atol=0)
    assert x._version == version
    assert torch.all(got[0, :, 3:] == 0)
    torch.testing.assert_close(got[1], torch.full((3, 6), 1 / 6))


def test_document_masked_softmax_example():
    """The document's example: rand(2, 3, 6) with lengths 3 and 5 (values are random)."""
    x = torch.rand(2, 3, 6)
    got = adapter.masked_softmax(x, torch.tensor([3, 5]))
    assert tuple(got.shape) == (2, 3, 6)
    assert torch.all(got[0, :, 3:] == 0) and torch.all(got[1, :, 5:] == 0)
    assert torch.all(got[0, :, :3] > 0) and torch.all(got[1, :, :5] > 0)
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 3))


@pytest.mark.parametrize("case", ["1d_zero", "2d_zero"])
def test_masked_softmax_gradient(case):
    x = RNG.standard_normal((2, 3, 5))
    lens = LENS_CASES[case]
    c = RNG.standard_normal((2, 3, 5))
    xt = t(x).requires_grad_(True)
    (adapter.masked_softmax(xt, torch.tensor(lens)) * t(c)).sum().backward()
    x64 = to_np(t(x))
    (want,) = numeric_grad(lambda a: float((doc_masked_softmax(a, lens) * c).sum()), x64)
    check("masked_softmax grad vs finite differences (float32)", xt.grad, want, GRAD_TOL)
    assert torch.all(xt.grad[torch.tensor(empty_rows(lens, 2, 3))] == 0)


# --- the document's printed examples ---------------------------------------------------


def document_qkv(query_width: int):
    queries = torch.normal(0, 1, (2, 1, query_width))
    keys = torch.ones((2, 10, 2))
    values = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
    return queries, keys, values, torch.tensor([2, 6])


def test_document_additive_example():
    queries, keys, values, valid_lens = document_qkv(20)
    attention = adapter.AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1)
    attention.eval()
    output = attention(queries, keys, values, valid_lens)
    want = torch.tensor([[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]])
    torch.testing.assert_close(output, want)
    assert output.grad_fn is not None
    weights = attention.attention_weights
    assert tuple(weights.shape) == (2, 1, 10)
    torch.testing.assert_close(weights[0, 0, :2], torch.full((2,), 0.5))
    torch.testing.assert_close(weights[1, 0, :6], torch.full((6,), 1 / 6))
    assert torch.all(weights[0, 0, 2:] == 0) and torch.all(weights[1, 0, 6:] == 0)
    assert tuple(weights.reshape((1, 1, 2, 10)).shape) == (1, 1, 2, 10)  # the heat-map call


def dropout_outcomes(weights: np.ndarray, values: np.ndarray, p: float) -> np.ndarray:
    """Every output inverted dropout on ``weights (keys,)`` can give: ``(2**n, d_v)``."""
    live = np.flatnonzero(weights)
    outs = []
    for kept in itertools.product([0.0, 1.0], repeat=live.size):
        w = np.zeros_like(weights)
        w[live] = weights[live] * np.array(kept) / (1 - p)
        outs.append(w @ values)
    return np.array(outs)


def test_document_dot_product_example():
    queries, keys, values, valid_lens = document_qkv(2)
    attention = adapter.DotProductAttention(dropout=0.5)
    output = attention(queries, keys, values, valid_lens)  # train mode, as printed
    assert tuple(output.shape) == (2, 1, 4)
    assert tuple(attention.attention_weights.shape) == (2, 1, 10)
    printed = np.array([[0.0, 1.0, 2.0, 3.0], [8.0, 28 / 3, 32 / 3, 12.0]])
    for row in range(2):
        outcomes = dropout_outcomes(
            attention.attention_weights[row, 0].numpy(), values[row].numpy(), 0.5
        )
        for got in (output[row, 0].numpy(), printed[row]):  # ours and the document's
            assert np.min(np.abs(outcomes - got).max(axis=1)) < 1e-5
    attention.eval()
    output = attention(queries, keys, values, valid_lens)
    torch.testing.assert_close(
        output, torch.tensor([[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]])
    )


# --- parameters and state dicts --------------------------------------------------------


class DocumentAdditiveParameters(nn.Module):
    """The parameter layout of document 002's AdditiveAttention (no forward needed)."""

    def __init__(self, key_size: int, query_size: int, num_hiddens: int, dropout: float):
        super().__init__()
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)


def test_state_dict_loads_strictly_and_gives_document_results():
    saved = DocumentAdditiveParameters(3, 5, 6, 0.1).state_dict()
    module = adapter.AdditiveAttention(3, 5, 6, 0.1)
    assert list(module.state_dict()) == list(saved)
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {
        k: tuple(v.shape) for k, v in saved.items()
    }
    module.load_state_dict(saved, strict=True)
    module.eval()
    q, k, v = (RNG.standard_normal(s) for s in ((2, 3, 5), (2, 4, 3), (2, 4, 2)))
    lens = np.array([3, 0])
    out = module(t(q), t(k), t(v), torch.tensor(lens))
    w = {name: saved[f"{name}.weight"].double().numpy() for name in ("W_q", "W_k", "w_v")}
    want, want_w = doc_additive(
        *(to_np(t(a)) for a in (q, k, v)), lens, w["W_q"], w["W_k"], w["w_v"]
    )
    check("AdditiveAttention output vs document (float32)", out, want, TOL["float32"])
    check(
        "AdditiveAttention weights vs document (float32)",
        module.attention_weights,
        want_w,
        TOL["float32"],
    )
    assert list(adapter.DotProductAttention(0.2).state_dict()) == []


# --- against the oracle and the core layers --------------------------------------------


def random_additive(dtype: str):
    module = adapter.AdditiveAttention(3, 5, 6, 0.3).to(TORCH_DTYPES[dtype]).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(t(RNG.standard_normal(tuple(p.shape)) * 0.7, dtype))
    q, k, v = (t(RNG.standard_normal(s), dtype) for s in ((2, 3, 5), (2, 5, 3), (2, 5, 2)))
    return module, q, k, v


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(LENS_CASES))
def test_additive_against_document_oracle_and_core(dtype, case):
    lens = LENS_CASES[case]
    module, q, k, v = random_additive(dtype)
    out = module(q, k, v, None if lens is None else torch.tensor(lens))
    weights = module.attention_weights
    assert out.dtype == TORCH_DTYPES[dtype]
    kernels = {n: to_np(getattr(module, n).weight) for n in ("W_q", "W_k", "w_v")}
    q64, k64, v64 = (to_np(a) for a in (q, k, v))
    want, want_w = doc_additive(q64, k64, v64, lens, kernels["W_q"], kernels["W_k"], kernels["w_v"])
    check(f"AdditiveAttention output vs document ({dtype})", out, want, TOL[dtype])
    check(f"AdditiveAttention weights vs document ({dtype})", weights, want_w, TOL[dtype])
    scores = ref.additive_scores(q64, k64, kernels["W_q"].T, kernels["W_k"].T, kernels["w_v"][0])
    ref_out, ref_w = ref.attention(scores, v64, valid_lens=lens)
    core = layers.AdditiveAttention(6, dtype=dtype)
    core(q, v, k)
    core.w_q.assign(kernels["W_q"].T)
    core.w_k.assign(kernels["W_k"].T)
    core.w_v.assign(kernels["w_v"][0])
    core_out, core_w = core(q, v, k, valid_lens=lens, return_weights=True)
    keep = ~empty_rows(lens, 2, 3) if lens is not None else np.ones((2, 3), bool)
    for label, got, a, b in (
        ("output", out, ref_out, to_np(core_out)),
        ("weights", weights, ref_w, to_np(core_w)),
    ):
        got = got.detach().numpy()
        check(f"AdditiveAttention {label} vs oracle ({dtype})", got[keep], a[keep], TOL[dtype])
        check(f"AdditiveAttention {label} vs core layer ({dtype})", got[keep], b[keep], TOL[dtype])
    np.testing.assert_array_equal(to_np(core_w)[~keep], 0.0)  # the core: zero rows
    np.testing.assert_allclose(weights.detach().numpy()[~keep], 0.2)  # the document: uniform


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(LENS_CASES))
def test_dot_product_against_document_oracle_and_core(dtype, case):
    lens = LENS_CASES[case]
    q, k, v = (t(RNG.standard_normal(s), dtype) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 3)))
    module = adapter.DotProductAttention(0.4).eval()
    out = module(q, k, v, None if lens is None else torch.tensor(lens))
    weights = module.attention_weights
    q64, k64, v64 = (to_np(a) for a in (q, k, v))
    want, want_w = doc_dot(q64, k64, v64, lens)
    check(f"DotProductAttention output vs document ({dtype})", out, want, TOL[dtype])
    check(f"DotProductAttention weights vs document ({dtype})", weights, want_w, TOL[dtype])
    ref_out, ref_w = ref.scaled_dot_product_attention(q64, k64, v64, valid_lens=lens)
    core_out, core_w = layers.DotProductAttention(dtype=dtype)(
        q, v, k, valid_lens=lens, return_weights=True
    )
    keep = ~empty_rows(lens, 2, 3) if lens is not None else np.ones((2, 3), bool)
    for label, got, a, b in (
        ("output", out, ref_out, to_np(core_out)),
        ("weights", weights, ref_w, to_np(core_w)),
    ):
        got = got.detach().numpy()
        check(f"DotProductAttention {label} vs oracle ({dtype})", got[keep], a[keep], TOL[dtype])
        check(
            f"DotProductAttention {label} vs core layer ({dtype})", got[keep], b[keep], TOL[dtype]
        )
    np.testing.assert_allclose(weights.detach().numpy()[~keep], 0.2)


# --- gradients -------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["1d_zero", "2d_zero"])
def test_additive_gradients(case):
    lens = LENS_CASES[case]
    module, q, k, v = random_additive("float32")
    c = RNG.standard_normal((2, 3, 2))
    inputs = [a.clone().requires_grad_(True) for a in (q, k, v)]
    (module(*inputs, torch.tensor(lens)) * t(c)).sum().backward()
    params = [module.W_q.weight, module.W_k.weight, module.w_v.weight]
    got = [a.grad for a in inputs] + [p.grad for p in params]
    arrays = [to_np(a) for a in (*inputs, *params)]

    def loss(q_, k_, v_, w_q, w_k, w_v):
        return float((doc_additive(q_, k_, v_, lens, w_q, w_k, w_v)[0] * c).sum())

    names = ("queries", "keys", "values", "W_q.weight", "W_k.weight", "w_v.weight")
    for name, g, want in zip(names, got, numeric_grad(loss, *arrays)):
        check(f"AdditiveAttention grad vs finite differences (float32) [{name}]", g, want, GRAD_TOL)


@pytest.mark.parametrize("case", ["none", "1d_zero", "2d_zero"])
def test_dot_product_gradients(case):
    lens = LENS_CASES[case]
    arrays = [RNG.standard_normal(s) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 3))]
    c = RNG.standard_normal((2, 3, 3))
    inputs = [t(a).requires_grad_(True) for a in arrays]
    module = adapter.DotProductAttention(0.1).eval()
    (module(*inputs, None if lens is None else torch.tensor(lens)) * t(c)).sum().backward()

    def loss(q_, k_, v_):
        return float((doc_dot(q_, k_, v_, lens)[0] * c).sum())

    wants = numeric_grad(loss, *(to_np(a) for a in inputs))
    for name, a, want in zip(("queries", "keys", "values"), inputs, wants):
        check(
            f"DotProductAttention grad vs finite differences (float32) [{name}]",
            a.grad,
            want,
            GRAD_TOL,
        )


def test_gradients_match_the_core_layers():
    """Same weights, no empty rows: adapter and core layers give the same autograd gradients."""
    lens = torch.tensor([3, 5])
    module, q, k, v = random_additive("float32")
    core = layers.AdditiveAttention(6)
    core(q, v, k)
    core.w_q.assign(module.W_q.weight.detach().T)
    core.w_k.assign(module.W_k.weight.detach().T)
    core.w_v.assign(module.w_v.weight.detach()[0])
    dot = adapter.DotProductAttention(0.0)
    k2 = t(RNG.standard_normal((2, 5, 5)))
    pairs = (
        (
            "AdditiveAttention",
            lambda a, b, c: module(a, b, c, lens),
            lambda a, b, c: core(a, c, b, valid_lens=lens),
            k,
        ),
        (
            "DotProductAttention",
            lambda a, b, c: dot(a, b, c, lens),
            lambda a, b, c: layers.DotProductAttention()(a, c, b, valid_lens=lens),
            k2,
        ),
    )
    c_out = t(RNG.standard_normal((2, 3, 2)))
    for name, ours, theirs, key in pairs:
        grads = []
        for fn in (ours, theirs):
            leaves = [a.clone().requires_grad_(True) for a in (q, key, v)]
            grads.append(torch.autograd.grad((fn(*leaves) * c_out).sum(), leaves))
        for arg, g, want in zip(("queries", "keys", "values"), *grads):
            check(f"{name} grad vs core layer (float32) [{arg}]", g, want.numpy(), 1e-6)


# --- dropout ---------------------------------------------------------------------------


class DocumentDotProduct(nn.Module):
    """Document 002's dot-product attention written in torch, to compare dropout draws."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens):
        scores = queries @ keys.transpose(1, 2) / queries.shape[-1] ** 0.5
        per_row = torch.repeat_interleave(valid_lens, scores.shape[1])
        flat = scores.reshape(-1, scores.shape[-1])
        keep = per_row[:, None] > torch.arange(flat.shape[-1])
        flat = torch.where(keep, flat, torch.tensor(-1e6))
        self.attention_weights = torch.softmax(flat.reshape(scores.shape), dim=-1)
        return self.dropout(self.attention_weights) @ values


def test_dropout_draws_like_the_document_under_torch_manual_seed():
    q, k, v = (t(RNG.standard_normal(s)) for s in ((2, 3, 4), (2, 6, 4), (2, 6, 5)))
    lens = torch.tensor([4, 6])
    ours, theirs = adapter.DotProductAttention(0.5), DocumentDotProduct(0.5)
    torch.manual_seed(7)
    got = ours(q, k, v, lens)
    torch.manual_seed(7)
    want = theirs(q, k, v, lens)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(ours.attention_weights, theirs.attention_weights)
    assert not torch.allclose(got, ours.attention_weights @ v)  # dropout was active
    ours.eval()
    torch.testing.assert_close(ours(q, k, v, lens), ours(q, k, v, lens), rtol=0, atol=0)
    torch.testing.assert_close(ours(q, k, v, lens), ours.attention_weights @ v)


def test_additive_dropout_is_on_the_weights_in_train_mode():
    module, q, k, v = random_additive("float32")
    module.train()
    torch.manual_seed(3)
    out = module(q, k, v, torch.tensor([4, 2]))
    w = module.attention_weights  # before dropout: rows sum to 1
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3))
    dropped = (out - w @ v).abs().max()
    assert dropped > 1e-3
    module.dropout.p = 0.0  # the submodule's rate is read at every call
    torch.testing.assert_close(module(q, k, v, torch.tensor([4, 2])), w @ v)


# --- bad input -------------------------------------------------------------------------

X = torch.zeros(2, 3, 4)
Q, K, V = torch.zeros(2, 3, 5), torch.zeros(2, 4, 3), torch.zeros(2, 4, 2)


def additive(*args):
    return adapter.AdditiveAttention(3, 5, 6, 0.0)(*args)


BAD = {
    "lens_longer_than_batch": (
        lambda: adapter.masked_softmax(X, torch.tensor([1, 2, 3])),
        ValueError,
        ["`valid_lens`", "(3,)"],
    ),
    "lens_2d_wrong_queries": (
        lambda: adapter.masked_softmax(X, torch.ones(2, 2, dtype=torch.int64)),
        ValueError,
        ["`valid_lens`", "(2, 2)"],
    ),
    "lens_rank_3": (
        lambda: adapter.masked_softmax(X, torch.ones(2, 3, 1, dtype=torch.int64)),
        ValueError,
        ["`valid_lens`", "(2, 3, 1)"],
    ),
    "lens_too_long": (
        lambda: adapter.masked_softmax(X, torch.tensor([1, 5])),
        ValueError,
        ["`valid_lens`", "5"],
    ),
    "lens_negative": (
        lambda: adapter.masked_softmax(X, torch.tensor([1, -1])),
        ValueError,
        ["`valid_lens`", "-1"],
    ),
    "int_scores": (
        lambda: adapter.masked_softmax(torch.zeros(2, 3, 4, dtype=torch.int64), None),
        TypeError,
        ["`X`", "int64"],
    ),
    "queries_rank": (
        lambda: additive(torch.zeros(3, 5), K, V),
        ValueError,
        ["`queries`", "(3, 5)"],
    ),
    "queries_width": (
        lambda: additive(torch.zeros(2, 3, 7), K, V),
        ValueError,
        ["`queries`", "query_size=5", "(2, 3, 7)"],
    ),
    "keys_width": (
        lambda: additive(Q, torch.zeros(2, 4, 2), V),
        ValueError,
        ["`keys`", "key_size=3", "(2, 4, 2)"],
    ),
    "values_positions": (
        lambda: additive(Q, K, torch.zeros(2, 5, 2)),
        ValueError,
        ["`keys` and `values`", "(2, 5, 2)"],
    ),
    "batch": (
        lambda: additive(torch.zeros(3, 3, 5), K, V),
        ValueError,
        ["batch size", "(3, 3, 5)"],
    ),
    "module_lens": (
        lambda: additive(Q, K, V, torch.tensor([1, 2, 3])),
        ValueError,
        ["`valid_lens`", "(3,)"],
    ),
    "int_values": (
        lambda: additive(Q, K, torch.zeros(2, 4, 2, dtype=torch.int64)),
        TypeError,
        ["`values`", "int64"],
    ),
    "dot_widths": (
        lambda: adapter.DotProductAttention(0.0)(torch.zeros(2, 3, 4), K, V),
        ValueError,
        ["`queries` and `keys`", "(2, 3, 4)", "(2, 4, 3)"],
    ),
    "numpy_queries": (
        lambda: adapter.DotProductAttention(0.0)(np.zeros((2, 3, 4)), K, V),
        TypeError,
        ["`queries`", "ndarray"],
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

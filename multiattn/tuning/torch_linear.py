"""Dense projections on PyTorch CPU: oneDNN or BLAS, given or measured (internal).

PyTorch sends float32 CPU matrix products to its BLAS (MKL in the official wheels) and
also ships oneDNN, whose linear operator is a second implementation of the same product.
Which one is faster depends on the CPU: on an AMD EPYC with AVX-512 oneDNN ran about
twice MKL's rate, on an AVX2-only CPU it was the slower of the two (measured:
docs/benchmarks.md, 'Measurements behind the defaults'). `matmul_bias` runs ``a @ b +
bias`` as a differentiable product whose backward pass is made of the same product (so
gradients of every order exist), each of its products (forward, input gradient, weight
gradient) on oneDNN (``Fixed(torch_linear="onednn")``) or, under autotune, on the library
`route` measured faster for its shape class. Imported by `multiattn.tuning.choices` (and
the benchmark) on the torch backend, never by the default path; it imports torch.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ._store import FLOP_CAP, bucket, decide, torch_is_tracing

__all__ = ["available", "blas", "matmul_bias", "onednn", "route"]


try:  # PyTorch's oneDNN linear operator; None where this build has no oneDNN
    _LINEAR = torch.ops.mkldnn._linear_pointwise if torch.backends.mkldnn.is_available() else None
except (AttributeError, RuntimeError):
    _LINEAR = None


def available() -> bool:
    """True when this PyTorch build has oneDNN and its linear operator."""
    return _LINEAR is not None


def onednn(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``a (N, K) @ b (K, M) (+ bias (M,))`` by PyTorch's oneDNN linear operator (not
    differentiable)."""
    # The operator computes x @ w.T + bias with w laid out (out, in).
    return _LINEAR(a.contiguous(), b.t().contiguous(), bias, "none", [], "")


def blas(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The same product by PyTorch's BLAS (``torch.addmm`` / ``torch.mm``, not
    differentiable here)."""
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


_ROUTES = {"onednn": onednn, "blas": blas}


def _layout(t: torch.Tensor) -> str:
    """``"rows"`` (row-major), ``"cols"`` (a transposed row-major matrix) or
    ``"strided"``."""
    if t.is_contiguous():
        return "rows"
    return "cols" if t.t().is_contiguous() else "strided"


def _random(rows: int, cols: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """A random float32 ``(rows, cols)`` matrix laid out as ``layout`` says."""
    if layout == "cols":
        return torch.randn(cols, rows, generator=gen).t()
    if layout == "strided":
        return torch.randn(rows, 2 * cols, generator=gen)[:, ::2]
    return torch.randn(rows, cols, generator=gen)


def route(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> str:
    """``"onednn"`` or ``"blas"``: the library measured faster on this machine for the
    shape class of ``a (N, K) @ b (K, M)``: ``N``, ``K`` and ``M`` rounded up to powers of
    two, the layouts of ``a`` and ``b``, whether there is a bias, the dtype and PyTorch's
    thread count. The first product of a class times both on random inputs with its ``K``
    and ``M`` and ``min(N, max(64, FLOP_CAP / (2 K M)))`` rows (`multiattn.tuning.decide`);
    later ones reuse the decision. While a compiler traces the call, the class's earlier
    decision, else ``"blas"`` (PyTorch's own product)."""
    n, k = a.shape
    m = b.shape[1]
    layouts = (_layout(a), _layout(b))
    cls = {
        "rows": bucket(n),
        "in": bucket(k),
        "out": bucket(m),
        "a": layouts[0],
        "b": layouts[1],
        "bias": bias is not None,
        "dtype": str(a.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }
    tracing = torch_is_tracing()

    def candidates() -> tuple[dict, str]:
        rows = min(n, max(64, FLOP_CAP // max(2 * k * m, 1)))
        gen = torch.Generator().manual_seed(0)
        x = _random(rows, k, layouts[0], gen).to(a.dtype)
        w = _random(k, m, layouts[1], gen).to(a.dtype)
        c = None if bias is None else torch.randn(m, generator=gen).to(a.dtype)
        fns = {name: functools.partial(fn, x, w, c) for name, fn in _ROUTES.items()}
        return fns, f"({rows}, {k}) @ ({k}, {m})" + (" + bias" if c is not None else "")

    why = "torch.compile or torch.jit traces the call" if tracing else ""
    return decide(
        "torch-linear", cls, candidates, fallback="blas", measurable=not tracing, reason=why
    )


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, measure: bool) -> Any:
    # torch.jit.trace cannot record oneDNN's operator (its argument list of optional
    # scalars is refused, even empty): a recording takes the BLAS product, whatever was
    # measured or forced
    if torch.jit.is_tracing() or (measure and route(a, b, bias) == "blas"):
        return blas(a, b, bias)
    return onednn(a, b, bias)


class _MatmulBias(torch.autograd.Function):
    """``a (N, K) @ b (K, M) + bias (M,)`` (``bias`` may be None); every product on oneDNN,
    or (``measure``) on the library measured faster for its shape."""

    @staticmethod
    def forward(
        a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, measure: bool
    ) -> torch.Tensor:
        return _product(a, b, bias, measure)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        a, b, bias, measure = inputs
        ctx.save_for_backward(a, b)
        ctx.has_bias = bias is not None
        ctx.measure = measure

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        a, b = ctx.saved_tensors
        grad_a = grad_b = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_a = _MatmulBias.apply(grad, b.t(), None, ctx.measure)
        if ctx.needs_input_grad[1]:
            grad_b = _MatmulBias.apply(a.t(), grad, None, ctx.measure)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_a, grad_b, grad_bias, None


def matmul_bias(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, measure: bool = False
) -> torch.Tensor:
    """``a (N, K) @ b (K, M) (+ bias (M,))``, differentiable; float32 CPU tensors only (the
    caller checks, see `multiattn.namespaces.keras.KerasNamespace.linear`). ``measure=False``:
    every product (forward and backward) on oneDNN; ``True``: each on the library `route`
    measured faster for its shape class. While ``torch.jit.trace`` records the call,
    every product is BLAS's (oneDNN's operator cannot be recorded). Where nothing needs
    a gradient (``no_grad``, inference) the product runs without the autograd Function,
    whose per-call cost is a large part of a small projection's."""
    if torch.is_grad_enabled() and (
        a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _MatmulBias.apply(a, b, bias, measure)
    return _product(a, b, bias, measure)

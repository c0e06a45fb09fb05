"""Dense projections on PyTorch CPU through oneDNN (internal).

PyTorch sends float32 CPU matrix products to its BLAS (MKL in the official wheels). On
CPUs where that BLAS takes a slow code path (measured here on an AMD EPYC with AVX-512:
MKL 167 GFLOP/s, oneDNN 333 to 403 GFLOP/s on ``(4096, 512) @ (512, 512)``), the oneDNN
library that PyTorch also ships is about twice as fast. This module runs ``a @ b + bias``
through PyTorch's oneDNN linear operator, with a backward pass made of the same product,
so gradients of every order exist.

Imported only by `multiattn._namespace` on the torch backend; it imports torch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["available", "matmul_bias"]


def _operator() -> Any:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        return getattr(mkldnn, "_linear_pointwise", None) if mkldnn is not None else None
    except (AttributeError, RuntimeError):  # not built with oneDNN
        return None


_LINEAR = _operator() if torch.backends.mkldnn.is_available() else None


def available() -> bool:
    """True when this PyTorch build has oneDNN and its linear operator."""
    return _LINEAR is not None


class _MatmulBias(torch.autograd.Function):
    """``a (N, K) @ b (K, M) + bias (M,)`` (``bias`` may be None) on oneDNN."""

    @staticmethod
    def forward(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # The operator computes x @ w.T + bias with w laid out (out, in).
        return _LINEAR(a.contiguous(), b.t().contiguous(), bias, "none", [], "")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        a, b, bias = inputs
        ctx.save_for_backward(a, b)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        a, b = ctx.saved_tensors
        grad_a = grad_b = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_a = _MatmulBias.apply(grad, b.t(), None)
        if ctx.needs_input_grad[1]:
            grad_b = _MatmulBias.apply(a.t(), grad, None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_a, grad_b, grad_bias


def matmul_bias(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``a (N, K) @ b (K, M) (+ bias (M,))`` through oneDNN, differentiable; float32 CPU
    tensors only (the caller checks, see `multiattn._namespace.KerasNamespace.linear`)."""
    return _MatmulBias.apply(a, b, bias)

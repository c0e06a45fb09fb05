"""Helpers for the Paddle tests: conversion, error measures, gradients."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import paddle

# Max relative error (max |got - want| / max |want|) against the float64 oracle.
TOL = {"float64": 1e-12, "float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}
FLOAT_DTYPES = ("float32", "float64")


def tensor(x, dtype: str = "float32", grad: bool = False) -> paddle.Tensor:
    """NumPy data as a Paddle tensor of ``dtype`` (float data goes through float32 for
    half precision, as the other backends' tests do)."""
    arr = np.asarray(x)
    if dtype in ("float16", "bfloat16"):
        t = paddle.to_tensor(arr.astype(np.float32)).astype(dtype)
    else:
        t = paddle.to_tensor(arr.astype(dtype))
    t.stop_gradient = not grad
    return t


def to_np(x) -> np.ndarray:
    """A Paddle tensor as NumPy (floats as float64)."""
    if isinstance(x, paddle.Tensor):
        if str(x.dtype) in ("paddle.bfloat16", "paddle.float16"):
            x = x.astype("float32")
        x = x.numpy()
    arr = np.asarray(x)
    return arr.astype(np.float64) if arr.dtype.kind == "f" else arr


def rounded(x, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and back to float64 (the oracle's inputs)."""
    return to_np(tensor(x, dtype))


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (finite results required)."""
    got, want = to_np(got), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), "result holds NaN or Inf"
    scale = max(np.abs(want).max(initial=0.0), 1e-30)
    return float(np.abs(got - want).max(initial=0.0) / scale)


def assert_close(got, want, dtype: str, tol: float | None = None) -> float:
    err = rel_err(got, want)
    bound = TOL[dtype] if tol is None else tol
    assert err <= bound, f"max relative error {err:.3e} > {bound:.1e} ({dtype})"
    return err


def numeric_grad(
    fn: Callable[..., float], *arrays: np.ndarray, h: float = 1e-3
) -> list[np.ndarray]:
    """Fourth-order central differences of the float64 scalar ``fn(*arrays)``.

    ``(-f(x+2h) + 8 f(x+h) - 8 f(x-h) + f(x-2h)) / 12h``: truncation error O(h^4), so
    with ``h = 1e-3`` the result is good to about 1e-11 relative for smooth ``fn``.
    """
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    out = []
    for i, arr in enumerate(arrays):
        grad = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            values = []
            for step in (2 * h, h, -h, -2 * h):
                shifted = [a.copy() for a in arrays]
                shifted[i][idx] += step
                values.append(fn(*shifted))
            grad[idx] = (-values[0] + 8 * values[1] - 8 * values[2] + values[3]) / (12 * h)
        out.append(grad)
    return out


def paddle_grads(loss: paddle.Tensor, leaves: Sequence[paddle.Tensor]) -> list[np.ndarray]:
    """d loss / d leaf for every leaf (zeros where no gradient reached it)."""
    grads = paddle.grad([loss], list(leaves), allow_unused=True)
    return [np.zeros(tuple(t.shape)) if g is None else to_np(g) for t, g in zip(leaves, grads)]

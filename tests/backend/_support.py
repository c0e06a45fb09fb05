"""Helpers for the backend tests: conversion, gradients and oracle comparisons."""

from __future__ import annotations

import keras
import numpy as np
import pytest

BACKEND = keras.backend.backend()

# Keras' numpy backend computes most float64 arithmetic in float32 (its type promotion
# maps float64 to float32 outside TensorFlow), so float64 is not offered there.
DTYPES = (
    ("float32", "float16", "bfloat16")
    if BACKEND == "numpy"
    else ("float64", "float32", "float16", "bfloat16")
)
# Max relative error (max |got - want| / max |want|) against the float64 oracle, for
# attention on inputs already rounded to the dtype. float32 is the project's bound.
TOL = {"float64": 1e-12, "float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}
# Bounds for layers whose projections run in the dtype itself.
LAYER_TOL = {"float64": 1e-12, "float32": 1e-6, "float16": 1e-2, "bfloat16": 6e-2}
HAS_GRAD = BACKEND != "numpy"


def to_np(x) -> np.ndarray:
    """A backend tensor as a float64 (or bool/int) NumPy array."""
    arr = np.asarray(keras.ops.convert_to_numpy(x))
    return arr.astype(np.float64) if arr.dtype.kind == "f" or "bfloat16" in str(arr.dtype) else arr


def cast(x: np.ndarray, dtype: str):
    """NumPy float64 data as a backend tensor of ``dtype``."""
    return keras.ops.convert_to_tensor(
        np.asarray(x, np.float32 if dtype != "float64" else np.float64), dtype=dtype
    )


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and back to float64 (the oracle's inputs)."""
    return to_np(cast(x, dtype))


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), "result holds NaN or Inf"
    scale = max(np.abs(want).max(initial=0.0), 1e-30)
    return float(np.abs(got - want).max(initial=0.0) / scale)


def assert_close(got, want, dtype: str, tol: dict | None = None) -> float:
    err = rel_err(to_np(got) if not isinstance(got, np.ndarray) else got, want)
    bound = (tol or TOL)[dtype]
    assert err <= bound, f"max relative error {err:.3e} > {bound:.1e} ({dtype}, {BACKEND})"
    return err


def requires_grad():
    if not HAS_GRAD:
        pytest.skip("the numpy backend is inference only")


def gradients(fn, *args, compiled: bool = False):
    """Gradients of the scalar ``fn(*tensors)`` with respect to every argument (NumPy);
    ``compiled``: the whole gradient computation under the backend's `compiler`."""
    requires_grad()
    if BACKEND == "jax":
        import jax

        grad = jax.grad(fn, argnums=tuple(range(len(args))))
        return [to_np(g) for g in (compiler()(grad) if compiled else grad)(*args)]
    if BACKEND == "torch":
        if compiled:
            compiler()  # skips
        import torch

        leaves = [a.detach().clone().requires_grad_(True) for a in args]
        grads = torch.autograd.grad(fn(*leaves), leaves, allow_unused=True)
        return [np.zeros(tuple(a.shape)) if g is None else to_np(g) for a, g in zip(leaves, grads)]
    import tensorflow as tf

    leaves = [tf.Variable(a) for a in args]

    def grad():
        with tf.GradientTape() as tape:
            value = fn(*leaves)
        return tape.gradient(value, leaves)

    grads = (compiler()(grad) if compiled else grad)()
    return [np.zeros(tuple(a.shape)) if g is None else to_np(g) for a, g in zip(leaves, grads)]


def numeric_grad(fn, *arrays, eps: float = 1e-6):
    """Central-difference gradients of the float64 scalar ``fn(*arrays)`` (oracle side)."""
    out = []
    for i, arr in enumerate(arrays):
        grad = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            plus = [a.copy() for a in arrays]
            minus = [a.copy() for a in arrays]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            grad[idx] = (fn(*plus) - fn(*minus)) / (2 * eps)
        out.append(grad)
    return out


def compiler():
    """The compiler of the running backend's user code (``jax.jit``, ``tf.function``);
    skips the test on the backends this suite runs eagerly."""
    if BACKEND == "jax":
        import jax

        return jax.jit
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function
    pytest.skip(f"{BACKEND} is not compiled in this suite")


def attention_cases(rng, b: int, h: int, tq: int, tk: int, lengths) -> dict[str, dict]:
    """Keyword arguments of `multiattn.ops.scaled_dot_product_attention` for every kind of
    mask on ``(b, h, tq, tk)`` scores: none, a mask per row, one broadcast, one with
    empty rows, and ``lengths`` (``(b,)``) with the causal mask."""
    return {
        "plain": {},
        "mask per row": {"mask": rng.random((b, h, tq, tk)) < 0.7},
        "mask broadcast": {"mask": rng.random((1, 1, tq, tk)) < 0.7},
        "mask with empty rows": {"mask": np.arange(tq)[:, None] > np.zeros((b, 1, 1, tk))},
        "lengths and causal": {"valid_lens": np.asarray(lengths), "causal": True},
    }


def grouped_oracle(q, k, v, kw: dict):
    """The float64 oracle's output and weights for ``(B, H, T, D)`` inputs, the key/value
    heads repeated for their query heads (head ``h`` reads key/value head ``h // (H /
    H_kv)``)."""
    from multiattn import reference

    groups = q.shape[1] // k.shape[1]
    k, v = (np.repeat(t, groups, axis=1) for t in (k, v))
    return reference.scaled_dot_product_attention(q, k, v, **kw)


def sdpa_call(q, k, v, kw: dict):
    """`multiattn.ops.scaled_dot_product_attention` with the keyword arguments of an
    `attention_cases` case: the lengths as an int32 tensor, a bias as float32."""
    from multiattn import ops

    tensors = {
        name: cast(value, "float32") if name == "bias" else value for name, value in kw.items()
    }
    if "valid_lens" in tensors:
        tensors["valid_lens"] = keras.ops.convert_to_tensor(kw["valid_lens"], "int32")
    return ops.scaled_dot_product_attention(q, k, v, **tensors)

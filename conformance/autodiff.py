"""Outputs and gradients through the autodiff of the running framework."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def to_numpy(x: Any) -> np.ndarray:
    """Any framework tensor as a float64 (or original integer/bool) NumPy array."""
    if type(x).__module__.startswith("paddle"):
        if "bfloat16" in str(x.dtype):
            x = x.astype("float32")  # paddle's .numpy() gives bfloat16 as raw uint16 bits
        x = x.numpy()
    elif hasattr(x, "detach"):  # torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    elif hasattr(x, "numpy") and not isinstance(x, np.ndarray):  # tf
        x = x.numpy()
    arr = np.asarray(x)
    if arr.dtype.kind == "f" or "bfloat16" in str(arr.dtype):
        return arr.astype(np.float64)
    return arr


def value_and_grad(
    framework: str,
    fn: Callable[[dict[str, Any]], tuple[Any, dict[str, Any]]],
    args: dict[str, Any],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Run ``fn(args) -> (scalar loss, outputs)``; return outputs and d loss / d args.

    ``framework`` is ``"jax"``, ``"torch"``, ``"tensorflow"`` or ``"paddle"``; any other
    value (``"numpy"``) computes outputs only. On jax the whole computation runs under
    ``jax.jit``.
    """
    if framework == "jax":
        import jax

        # compiled, as jax programs run (one XLA program per case: eager dispatch compiled
        # every primitive of every new shape, about three times slower)
        (_, outputs), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(args)
    elif framework == "torch":
        import torch

        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in args.items()}
        loss, outputs = fn(leaves)
        values = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        grads = {
            k: (torch.zeros_like(leaves[k]) if g is None else g) for k, g in zip(leaves, values)
        }
    elif framework == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            for v in args.values():
                tape.watch(v)
            loss, outputs = fn(args)
        values = tape.gradient(loss, list(args.values()))
        grads = {k: (tf.zeros_like(args[k]) if g is None else g) for k, g in zip(args, values)}
    elif framework == "paddle":
        import paddle

        leaves = {}
        for k, v in args.items():
            leaf = v.detach().clone()
            leaf.stop_gradient = False
            leaves[k] = leaf
        loss, outputs = fn(leaves)
        values = paddle.grad([loss], list(leaves.values()), allow_unused=True)
        grads = {
            k: (paddle.zeros_like(leaves[k]) if g is None else g) for k, g in zip(leaves, values)
        }
    else:
        _, outputs = fn(args)
        grads = {}
    return {k: to_numpy(v) for k, v in outputs.items()}, {k: to_numpy(v) for k, v in grads.items()}

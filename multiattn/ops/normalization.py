"""Layer normalisation over the last axis."""

from __future__ import annotations

from typing import Any

from .._checks import HALF_DTYPES, as_array, check_float, check_rank, fmt_shape, shape_of
from .._namespace import get_ops

__all__ = ["layer_norm"]


def layer_norm(x: Any, gamma: Any = None, beta: Any = None, *, epsilon: float = 1e-6) -> Any:
    """``(x - mean) / sqrt(var + epsilon) * gamma + beta`` over the last axis.

    The variance is the biased one (divided by the width). float16/bfloat16 inputs are
    computed in float32 and cast back; float64 stays float64 on every backend (Keras'
    own layer normalisation computes float64 in float32 outside TensorFlow).

    Args:
        x: ``(..., width)``, floating.
        gamma: optional scale ``(width,)``.
        beta: optional offset ``(width,)``.
        epsilon: positive float added to the variance.

    Returns:
        The normalised tensor, shape and dtype of ``x``.
    """
    where = "layer_norm"
    ops = get_ops(x, gamma, beta)
    x = as_array(x)
    dtype = check_float(where, "x", x, ops)
    shape = shape_of(x)
    check_rank(where, "x", shape, 1)
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
        raise ValueError(f"{where}: `epsilon` must be a positive float; received {epsilon!r}.")
    compute = "float32" if dtype in HALF_DTYPES else dtype
    params = []
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p is not None:
            p = as_array(p)
            ps = shape_of(p)
            if len(ps) != 1 or (ps[0] is not None and shape[-1] is not None and ps[0] != shape[-1]):
                raise ValueError(
                    f"{where}: `{name}` must have shape ({shape[-1]},) for `x` of shape "
                    f"{fmt_shape(shape)}; received shape {fmt_shape(ps)}."
                )
            check_float(where, name, p, ops)
            p = ops.cast(p, compute)
        params.append(p)
    if compute != dtype:
        x = ops.cast(x, compute)
    if shape[-1] is None:
        raise ValueError(
            f"{where}: the last axis of `x` must be static; received {fmt_shape(shape)}."
        )
    # sum / width rather than keras.ops.mean/var: those compute float64 in float32 on the
    # torch (mean) and jax/torch (var) backends.
    width = float(shape[-1])
    mean = ops.sum(x, axis=-1, keepdims=True) / width
    centered = x - mean
    variance = ops.sum(ops.square(centered), axis=-1, keepdims=True) / width
    out = centered * ops.rsqrt(variance + float(epsilon))
    if params[0] is not None:
        out = out * params[0]
    if params[1] is not None:
        out = out + params[1]
    return ops.cast(out, dtype) if compute != dtype else out

"""Layer normalisation and RMS normalisation over the last axis."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._checks import (
    HALF_DTYPES,
    as_array,
    check_float,
    check_rank,
    dims_match,
    fmt_shape,
    shape_of,
    to_tensor,
)
from ..namespaces.keras import get_ops

__all__ = ["RMS_NORM_EPSILON", "layer_norm", "rms_norm"]


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
    ops = get_ops(x, gamma, beta, names=("x", "gamma", "beta"), where=where)
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


#: Default ``epsilon`` of `rms_norm` and `multiattn.layers.RMSNormalization`: the default
#: of ``keras.layers.RMSNormalization`` and of `layer_norm`. It is added to the mean
#: square, so it sets the floor of the root mean square to ``sqrt(1e-6) = 1e-3``.
RMS_NORM_EPSILON = 1e-6


def _short_repr(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"a {type(value).__name__} of dtype {value.dtype} and shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_epsilon(where: str, epsilon: Any) -> float:
    """``epsilon`` as a Python float: a positive finite number (Python or NumPy; bools
    refused). Other types raise ``TypeError``, zero, negative, NaN and infinite values
    ``ValueError``, naming ``epsilon`` and quoting the value."""
    if isinstance(epsilon, (bool, np.bool_)) or not isinstance(
        epsilon, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"{where}: `epsilon` must be a positive finite float; received {_short_repr(epsilon)}."
        )
    value = float(epsilon)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{where}: `epsilon` must be a positive finite float; received {epsilon!r}."
        )
    return value


def rms_norm(
    x: Any, scale: Any = None, *, epsilon: float = RMS_NORM_EPSILON, offset: float = 0.0
) -> Any:
    """Root mean square normalisation over the last axis (RMSNorm, Zhang and Sennrich 2019).

    ``x / sqrt(mean(x**2, axis=-1) + epsilon) * scale``: no mean is subtracted and no
    offset added (unlike `layer_norm`), and ``epsilon`` is added to the mean square under
    the root, as in ``keras.ops.rms_normalization`` and ``torch.nn.functional.rms_norm``.
    A row of zeros gives zeros, with finite gradients.

    float16/bfloat16 inputs are computed in float32 and cast back; float32 and float64 are
    computed in their own dtype (float64 stays float64 on every backend). ``scale`` is cast
    to that compute dtype, so the result has the dtype of ``x`` whatever the dtype of
    ``scale``. Runs on every Keras backend and on Paddle tensors.

    Args:
        x: ``(..., d)``, floating (float16, bfloat16, float32, float64); ``d`` static.
        scale: optional ``(d,)`` floating multiplier (the learnable gain of RMSNorm);
            None multiplies by nothing (a gain of ones).
        epsilon: positive finite float added to the mean square; default ``1e-6``
            (``RMS_NORM_EPSILON``, as ``keras.layers.RMSNormalization``).
        offset: a float added to ``scale`` before it multiplies, in the compute dtype
            (float32 for half-precision inputs): ``1.0`` gives Gemma's ``(1 + scale)``
            gain, whose checkpoints store the gain minus one. Default 0.0. Ignored
            without ``scale``.

    Returns:
        The normalised tensor, shape and dtype of ``x``.

    Raises:
        TypeError: ``x`` or ``scale`` not floating, ``epsilon`` or ``offset`` not a number.
        ValueError: ``x`` of rank 0 or with a non-static last axis, ``scale`` not of shape
            ``(d,)``, ``epsilon`` not positive and finite.
    """
    where = "rms_norm"
    ops = get_ops(x, scale, names=("x", "scale"), where=where)
    x = as_array(x)
    dtype = check_float(where, "x", x, ops)
    shape = shape_of(x)
    check_rank(where, "x", shape, 1)
    if shape[-1] is None:
        raise ValueError(
            f"{where}: the last axis of `x` must be static; received {fmt_shape(shape)}."
        )
    epsilon = check_epsilon(where, epsilon)
    compute = "float32" if dtype in HALF_DTYPES else dtype
    if scale is not None:
        scale = as_array(scale)
        check_float(where, "scale", scale, ops)
        ss = shape_of(scale)
        if len(ss) != 1 or not dims_match(ss[0], shape[-1]):
            raise ValueError(
                f"{where}: `scale` must have shape ({shape[-1]},) for `x` of shape "
                f"{fmt_shape(shape)}; received shape {fmt_shape(ss)}."
            )
        scale = ops.cast(to_tensor(ops, scale), compute)
        if isinstance(offset, bool) or not isinstance(offset, (int, float)):
            raise TypeError(f"{where}: `offset` must be a float; received {offset!r}.")
        if offset:
            scale = scale + float(offset)
    x = to_tensor(ops, x)
    if compute != dtype:
        x = ops.cast(x, compute)
    # sum / width rather than keras.ops.mean, which computes float64 in float32 on torch.
    mean_square = ops.sum(ops.square(x), axis=-1, keepdims=True) / float(shape[-1])
    out = x * ops.rsqrt(mean_square + epsilon)
    if scale is not None:
        out = out * scale
    return ops.cast(out, dtype) if compute != dtype else out

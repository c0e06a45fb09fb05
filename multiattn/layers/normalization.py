"""Layer normalisation and RMS normalisation computed by the core."""

from __future__ import annotations

import math
from typing import Any

import keras

from .._checks import as_array, check_float, fmt_shape, shape_of
from ..namespaces.keras import get_ops
from ..ops.normalization import RMS_NORM_EPSILON, check_epsilon, layer_norm, rms_norm

__all__ = ["LayerNormalization", "RMSNormalization"]


@keras.saving.register_keras_serializable(package="multiattn")
class LayerNormalization(keras.layers.LayerNormalization):
    """``keras.layers.LayerNormalization`` computed by `multiattn.ops.layer_norm`.

    Same arguments, weights (``gamma``, ``beta``) and config as the Keras layer. For the
    usual normalisation over the last axis it keeps float64 exact on every backend
    (Keras computes float64 in float32 outside TensorFlow); other axes fall back to the
    Keras implementation.

    ``rms_scaling=True`` is **not** RMS normalisation. It keeps the meaning it has in
    Keras 3.15, which deprecates it (Keras warns when such a layer is created): the
    inputs are divided by the square root of their *centred* variance, ``x / sqrt(var(x)
    + epsilon) * gamma`` with ``var(x) = mean((x - mean(x))**2)``, without subtracting
    the mean from ``x`` and without ``beta``. This differs from RMSNorm (``x /
    sqrt(mean(x**2) + epsilon)``) on any input whose mean is not zero. It is computed by
    the Keras implementation and kept only so that Keras configs and weights load
    unchanged; for RMSNorm use `multiattn.layers.RMSNormalization` (or
    `multiattn.ops.rms_norm`).

    Call arguments:
        inputs: ``(..., width)``, floating.

    Returns:
        The normalised inputs in the layer's compute dtype.

    Raises:
        TypeError: ``center``, ``scale`` or ``rms_scaling`` not a bool, ``axis`` not an
            int or a list of ints, integer or bool ``inputs``.
        ValueError: ``axis`` repeated or out of range for the inputs.
    """

    def __init__(self, axis: Any = -1, epsilon: float = 1e-3, **kwargs: Any):
        where = "LayerNormalization"
        for flag in ("center", "scale", "rms_scaling"):
            value = kwargs.get(flag, False)
            if not isinstance(value, bool):
                raise TypeError(f"{where}: `{flag}` must be a bool; received {value!r}.")
        super().__init__(axis=_check_axis(where, axis), epsilon=epsilon, **kwargs)

    def build(self, input_shape):
        _normalised_axes("LayerNormalization", self.axis, tuple(input_shape))
        super().build(input_shape)

    def call(self, inputs):
        check_float("LayerNormalization", "inputs", inputs, get_ops(inputs))
        rank = len(inputs.shape)
        axes = _normalised_axes("LayerNormalization", self.axis, tuple(inputs.shape))
        if self.rms_scaling or axes != [rank - 1]:
            return super().call(inputs)
        out = layer_norm(
            inputs,
            self.gamma if self.scale else None,
            self.beta if self.center else None,
            epsilon=self.epsilon,
        )
        return get_ops(out).cast(out, self.compute_dtype)


def _normalised_axes(where: str, axis: Any, shape: tuple) -> list[int]:
    """The axes ``axis`` (an int or a list of ints) normalises in inputs of shape
    ``shape``, in [0, rank), sorted; ``ValueError`` naming ``axis`` when one is out of
    range or two name the same axis."""
    rank = len(shape)
    axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    for a in axes:
        if not -rank <= a < rank:
            raise ValueError(
                f"{where}: `axis` {a} is out of range for inputs of shape "
                f"{fmt_shape(shape)}; received axis={axis!r}."
            )
    positive = sorted(a % rank for a in axes)
    if len(set(positive)) != len(positive):
        raise ValueError(
            f"{where}: `axis` {axis!r} names an axis twice for inputs of shape {fmt_shape(shape)}."
        )
    return positive


def _check_axis(where: str, axis: Any) -> int | list[int]:
    """``axis``: an int, or a non-empty list or tuple of distinct ints (returned as a list)."""
    if isinstance(axis, int) and not isinstance(axis, bool):
        return axis
    if (
        isinstance(axis, (list, tuple))
        and axis
        and all(isinstance(a, int) and not isinstance(a, bool) for a in axis)
    ):
        if len(set(axis)) != len(axis):
            raise ValueError(f"{where}: `axis` names an axis twice; received {axis!r}.")
        return list(axis)
    raise TypeError(
        f"{where}: `axis` must be an int or a non-empty list of ints; received {axis!r}."
    )


@keras.saving.register_keras_serializable(package="multiattn")
class RMSNormalization(keras.layers.Layer):
    """Root mean square normalisation (RMSNorm) with a learnable scale.

    ``inputs / sqrt(mean(inputs**2 over axis) + epsilon) * scale``, computed by
    `multiattn.ops.rms_norm` (the layer only moves the normalised axes last). No mean is
    subtracted and there is no offset. Arguments, weight and config follow
    ``keras.layers.RMSNormalization``: ``axis`` (default ``-1``), ``epsilon`` (default
    ``1e-6``, added to the mean square) and one weight, ``scale`` (the gain, called gamma
    in the RMSNorm paper), of shape ``(inputs.shape[a] for a in sorted axes)``,
    initialised to ones.

    Dtypes: as in ``keras.layers.LayerNormalization``, the inputs are not cast to the
    compute dtype first (the layer's ``autocast`` is off, and so is the weight's);
    float16 and bfloat16 inputs are normalised in float32, float32 and float64 in their
    own dtype (float64 stays float64 on every backend), ``scale`` is used in that dtype,
    and the result is cast to the layer's compute dtype. Under ``mixed_float16`` or
    ``mixed_bfloat16`` the float32 ``scale`` multiplies in float32 before the cast.

    Unlike ``keras.layers.LayerNormalization(rms_scaling=True)``, which divides by the
    centred variance (see `multiattn.layers.LayerNormalization`), this is RMSNorm.

    With ``unit_offset=True`` the gain is ``1 + scale`` (Gemma's RMSNorm, whose
    checkpoints store the gain minus one): ``scale`` starts at zeros, and the one is
    added in the compute dtype (float32 for half-precision inputs), so under
    ``mixed_bfloat16`` the whole gain multiplies in float32 before the cast, as
    transformers' Gemma computes it.

    Args:
        axis: int or non-empty list of distinct ints: the axes normalised together
            (negative values count from the end). Default ``-1``, the last axis.
        epsilon: positive finite float added to the mean square (default ``1e-6``).
        unit_offset: the gain is ``1 + scale`` (default False: ``scale``).
        **kwargs: ``keras.layers.Layer`` arguments (``name``, ``dtype``, ...).

    Call arguments:
        inputs: ``(..., d)`` floating tensor; the normalised axes must be static and, once
            the layer is built, equal to the ones it was built with.

    Returns:
        The normalised inputs, shape of ``inputs``, in the layer's compute dtype.

    Raises:
        TypeError: ``axis`` not an int or a list of ints, ``epsilon`` not a number.
        ValueError: ``axis`` repeated or out of range for the inputs, ``epsilon`` not
            positive and finite, inputs whose normalised axes differ from the built ones.
    """

    def __init__(
        self, axis: Any = -1, epsilon: float = RMS_NORM_EPSILON, unit_offset: bool = False,
        **kwargs,
    ):  # fmt: skip
        where = "RMSNormalization"
        axis = _check_axis(where, axis)
        epsilon = check_epsilon(where, epsilon)
        if not isinstance(unit_offset, bool):
            raise TypeError(f"{where}: `unit_offset` must be a bool; received {unit_offset!r}.")
        super().__init__(**kwargs)
        self.axis = axis
        self.epsilon = epsilon
        self.unit_offset = unit_offset
        self.supports_masking = True
        self.autocast = False
        self.scale = None

    def _axes(self, shape: Any) -> list[int]:
        return _normalised_axes("RMSNormalization", self.axis, shape)

    def build(self, input_shape):
        shape = tuple(None if d is None else int(d) for d in input_shape)
        axes = self._axes(shape)
        dims = tuple(shape[a] for a in axes)
        if None in dims:
            raise ValueError(
                f"RMSNormalization: the normalised axes {axes} of the inputs must be static; "
                f"received shape {fmt_shape(shape)}."
            )
        self.scale = self.add_weight(
            name="scale",
            shape=dims,
            initializer="zeros" if self.unit_offset else "ones",
            trainable=True,
            autocast=False,
        )

    def call(self, inputs):
        inputs = as_array(inputs)
        check_float("RMSNormalization", "inputs", inputs, get_ops(inputs))
        shape = shape_of(inputs)
        axes = self._axes(shape)
        dims = tuple(shape[a] for a in axes)
        built = tuple(self.scale.shape)
        if any(d is not None and d != b for d, b in zip(dims, built)) or len(dims) != len(built):
            raise ValueError(
                f"RMSNormalization: `inputs` must have sizes {built} on axes {axes} (the layer "
                f"was built with them); received shape {fmt_shape(shape)}."
            )
        rank = len(shape)
        offset = 1.0 if self.unit_offset else 0.0
        if axes == [rank - 1]:
            out = rms_norm(inputs, self.scale, epsilon=self.epsilon, offset=offset)
        else:
            ops = get_ops(inputs)
            rest = [a for a in range(rank) if a not in axes]
            perm = rest + axes
            moved = ops.transpose(inputs, perm)
            moved_shape = ops.shape(moved)
            width = math.prod(built)
            flat = ops.reshape(moved, (*moved_shape[: len(rest)], width))
            out = rms_norm(
                flat, ops.reshape(self.scale, (width,)), epsilon=self.epsilon, offset=offset
            )
            out = ops.reshape(out, moved_shape)
            out = ops.transpose(out, [perm.index(a) for a in range(rank)])
        return get_ops(out).cast(out, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        self._axes(tuple(input_shape))
        return tuple(input_shape)

    def get_config(self) -> dict:
        config = {**super().get_config(), "axis": self.axis, "epsilon": self.epsilon}
        if self.unit_offset:
            config["unit_offset"] = True
        return config

"""Position-wise feed-forward network: a plain MLP or a gated linear unit (GLU)."""

from __future__ import annotations

from typing import Any

import keras

from .._checks import check_float, check_positive_int
from ..namespaces.keras import get_ops
from ..ops.activations import activation as apply_activation
from ..ops.activations import check_activation
from ._base import (
    block_initializers,
    project,
    static_width,
    sublayer_initializers,
)

__all__ = ["FeedForward"]


@keras.saving.register_keras_serializable(package="multiattn")
class FeedForward(keras.layers.Layer):
    """Position-wise feed-forward network, plain or gated.

    Plain (``gated=False``; BERT, GPT-2)::

        y = down(act(up(x)))

    Gated (``gated=True``; a gated linear unit: SwiGLU with ``activation="silu"`` as in
    Llama, Qwen2 and Mistral, GeGLU with ``"gelu"`` or ``"gelu_tanh"``)::

        y = down(act(gate(x)) * up(x))

    Sublayers (``keras.layers.EinsumDense``): ``gate`` (gated only) and ``up``, kernels
    ``(width, hidden_dim)``, and ``down``, kernel ``(hidden_dim, output_dim)``; with
    ``use_bias`` each has a bias over its output features. The activation is applied by
    `multiattn.ops.activation`, not by the sublayers. Plain float sublayers are computed
    as one matrix product each with the bias inside (the namespace's ``linear``), not by
    the sublayers' einsum. Quantized or LoRA sublayers are called.

    Args:
        hidden_dim: width of the hidden layer (``intermediate_size`` in Hugging Face
            configs), a positive int.
        activation: one of `multiattn.ops.ACTIVATIONS`: ``"relu"`` (default), ``"gelu"``
            (exact, erf), ``"gelu_tanh"`` / ``"gelu_new"`` / ``"gelu_pytorch_tanh"``
            (tanh approximation), ``"silu"`` / ``"swish"``, ``"linear"``.
        gated: a gated linear unit instead of a plain MLP (adds the ``gate`` sublayer).
        use_bias: biases in the three projections (Llama: False; GPT-2: True).
        output_dim: width of the output; None (default): the input width.
        kernel_initializer, bias_initializer: Keras initializers of the projections (each
            sublayer gets its own copy). Defaults ``glorot_uniform`` and ``zeros``.
        **kwargs: ``keras.layers.Layer`` arguments (``name``, ``dtype``, ...).

    Call arguments:
        x: ``(..., width)`` floating tensor with a static last axis, usually ``(batch,
            seq, width)``.

    Returns:
        ``(..., output_dim)`` in the layer's compute dtype (float16/bfloat16 activations
        are computed in float32 and cast back).

    Raises:
        TypeError: ``gated`` or ``use_bias`` not a bool, ``activation`` not a string,
            ``x`` not floating.
        ValueError: ``hidden_dim`` or ``output_dim`` not a positive int, an unknown
            ``activation``, ``x`` with a width other than the built one.
    """

    def __init__(
        self,
        hidden_dim: int,
        activation: str = "relu",
        gated: bool = False,
        use_bias: bool = True,
        output_dim: int | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = "FeedForward"
        self.hidden_dim = check_positive_int(where, "hidden_dim", hidden_dim)
        self.activation = check_activation(where, activation)
        for name, value in (("gated", gated), ("use_bias", use_bias)):
            if not isinstance(value, bool):
                raise TypeError(f"{where}: `{name}` must be a bool; received {value!r}.")
        self.gated, self.use_bias = gated, use_bias
        self.output_dim = check_positive_int(where, "output_dim", output_dim, allow_none=True)
        self.kernel_initializer, self.bias_initializer = block_initializers(
            where, kernel_initializer, bias_initializer
        )
        self.gate = self._dense("gate", "...d,df->...f", self.hidden_dim) if gated else None
        self.up = self._dense("up", "...d,df->...f", self.hidden_dim)
        self.down = None  # needs the input width when output_dim is None: made in build

    def _dense(self, name: str, equation: str, units: int) -> keras.layers.EinsumDense:
        return keras.layers.EinsumDense(
            equation,
            (units,),
            bias_axes=equation[-1] if self.use_bias else None,
            name=name,
            dtype=self.dtype_policy,
            **sublayer_initializers(self),
        )

    def build(self, input_shape):
        shape = tuple(input_shape)
        width = static_width("FeedForward", "x", shape, max(len(shape), 1))
        self._width = width
        if self.gate is not None:
            self.gate.build(shape)
        self.up.build(shape)
        self.down = self._dense("down", "...f,fd->...d", self.output_dim or width)
        self.down.build((*shape[:-1], self.hidden_dim))

    def call(self, x):
        where = "FeedForward"
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{where}: `x` must be a tensor; received {type(x).__name__}.")
        check_float(where, "x", x, get_ops(x))
        if x.shape[-1] is not None and x.shape[-1] != self._width:
            raise ValueError(
                f"{where}: `x` must have width {self._width} (the width the layer was built "
                f"with); received shape {tuple(x.shape)}."
            )
        ops, dtype = get_ops(x), self.compute_dtype
        if self.gate is None:
            hidden = apply_activation(project(ops, x, self.up, dtype), self.activation)
        else:
            gate, up = (project(ops, x, d, dtype) for d in (self.gate, self.up))
            hidden = apply_activation(gate, self.activation) * up
        return project(ops, hidden, self.down, dtype)

    def compute_output_shape(self, input_shape):
        shape = tuple(input_shape)
        return (*shape[:-1], self.output_dim or shape[-1])

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "hidden_dim": self.hidden_dim,
            "activation": self.activation,
            "gated": self.gated,
            "use_bias": self.use_bias,
            "output_dim": self.output_dim,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
        }

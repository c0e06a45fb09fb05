"""The activations of feed-forward networks, by the names checkpoints give them.

Each one is written once from the operations of the namespace contract, so it runs on
every Keras backend and on Paddle tensors alike (see `activation`).
"""

from __future__ import annotations

import math
from typing import Any

from .._checks import HALF_DTYPES, as_array, check_float, to_tensor
from ..namespaces.keras import get_ops

__all__ = ["ACTIVATIONS", "activation", "check_activation"]

#: Activation names and the function each one stands for. ``gelu`` is the exact GELU
#: (with the error function); ``gelu_tanh``, ``gelu_new`` and ``gelu_pytorch_tanh`` are
#: the tanh approximation (the names GPT-2, Gemma and PyTorch's ``approximate="tanh"``
#: use); ``silu`` and ``swish`` are ``x * sigmoid(x)``.
ACTIVATIONS = {
    "linear": "x",
    "relu": "max(x, 0)",
    "gelu": "x / 2 * (1 + erf(x / sqrt(2)))",
    "gelu_tanh": "x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x**3)))",
    "gelu_new": "x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x**3)))",
    "gelu_pytorch_tanh": "x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x**3)))",
    "silu": "x * sigmoid(x)",
    "swish": "x * sigmoid(x)",
}
_TANH_GELU = ("gelu_tanh", "gelu_new", "gelu_pytorch_tanh")


def check_activation(where: str, name: Any, argument: str = "activation") -> str:
    """``name`` if it is one of `ACTIVATIONS`, else ``ValueError`` naming ``argument``
    (``TypeError`` for a value that is not a string)."""
    if not isinstance(name, str):
        raise TypeError(
            f"{where}: `{argument}` must be one of {sorted(ACTIVATIONS)}; received {name!r}."
        )
    if name not in ACTIVATIONS:
        raise ValueError(
            f"{where}: `{argument}` must be one of {sorted(ACTIVATIONS)}; received {name!r}."
        )
    return name


def _apply(ops: Any, x: Any, name: str) -> Any:
    if name == "linear":
        return x
    if name == "relu":
        return ops.where(ops.less(x, 0.0), ops.zeros_like(x), x)
    if name == "gelu":
        return 0.5 * x * (1.0 + ops.erf(x * (1.0 / math.sqrt(2.0))))
    if name in _TANH_GELU:  # one fused kernel where the framework has one
        return ops.gelu(x, approximate=True)
    return ops.silu(x)  # silu / swish


def activation(x: Any, name: str = "relu") -> Any:
    """The activation ``name`` applied elementwise to ``x``.

    Args:
        x: floating tensor of any shape (a tensor of the active Keras backend, a Paddle
            tensor, a NumPy array or a nested list).
        name: one of `ACTIVATIONS`: ``"linear"``, ``"relu"``, ``"gelu"`` (exact),
            ``"gelu_tanh"`` / ``"gelu_new"`` / ``"gelu_pytorch_tanh"`` (tanh
            approximation), ``"silu"`` / ``"swish"``.

    Returns:
        Shape and dtype of ``x``. float16/bfloat16 are computed in float32 and cast back;
        float32 and float64 in their own dtype.

    Raises:
        TypeError: ``x`` not floating, ``name`` not a string.
        ValueError: an unknown ``name``.
    """
    where = "activation"
    name = check_activation(where, name, "name")
    ops = get_ops(x)
    x = to_tensor(ops, as_array(x))
    dtype = check_float(where, "x", x, ops)
    if dtype in HALF_DTYPES:
        return ops.cast(_apply(ops, ops.cast(x, "float32"), name), dtype)
    return _apply(ops, x, name)

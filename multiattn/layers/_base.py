"""Pieces shared by the multiattn Keras layers."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from .._checks import (
    check_positive_int,
    check_rank,
    check_rate,
    check_seed,
    describe,
    fmt_shape,
    shape_of,
)
from ..namespaces.keras import get_ops


def static_width(where: str, name: str, shape: Any, rank: int = 3) -> int:
    """The static last dimension of a ``(batch, seq, width)`` input shape."""
    shape = tuple(shape)
    check_rank(where, name, shape, rank, rank)
    if shape[-1] is None:
        raise ValueError(
            f"{where}: the last dimension of `{name}` must be static; received {fmt_shape(shape)}."
        )
    return int(shape[-1])


def check_input_width(where: str, name: str, x: Any, expected: int) -> None:
    """``x`` is a tensor (or array) ``(batch, seq, expected)``; ``None``, strings and lists
    raise ``TypeError`` naming ``name``."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{where}: `{name}` must be a tensor; received {describe(x)}.")
    shape = shape_of(x)
    check_rank(where, name, shape, 3, 3)
    if shape[-1] is not None and shape[-1] != expected:
        raise ValueError(
            f"{where}: `{name}` must have width {expected} (the width the layer was built "
            f"with); received shape {fmt_shape(shape)}."
        )


def check_layer_seed(where: str, seed: Any) -> int | None:
    """A layer's ``seed``: an int (NumPy integers too, returned as int) or None."""
    if seed is not None and not (
        isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_))
    ):
        raise TypeError(f"{where}: `seed` must be an int or None; received {describe(seed)}.")
    return check_seed(where, seed)


def seed_generator(where: str, seed: Any) -> keras.random.SeedGenerator:
    """A ``keras.random.SeedGenerator`` for dropout, after `check_layer_seed`."""
    return keras.random.SeedGenerator(check_layer_seed(where, seed))


_ZERO_INITIALIZED = contextvars.ContextVar("multiattn_zero_initialized", default=False)


@contextlib.contextmanager
def zero_initialized() -> Iterator[None]:
    """A scope in which the multiattn layers made take ``zeros`` for every kernel, bias
    and embedding initializer they are given (still checked), so that building draws no
    random numbers: for a model whose every weight is assigned right after, as
    `multiattn.models.from_pretrained` does. Layers made outside are unaffected; a
    layer made inside reports ``zeros`` in its ``get_config``."""
    token = _ZERO_INITIALIZED.set(True)
    try:
        yield
    finally:
        _ZERO_INITIALIZED.reset(token)


def keras_default(name: str) -> Any:
    """The initializer ``name`` that a Keras layer would take by default (``"uniform"``
    for embeddings, ``"glorot_uniform"`` for kernels), ``zeros`` inside
    `zero_initialized`: for the Keras sublayers of the models."""
    return get_initializer("keras_default", "name", name)


def get_initializer(where: str, name: str, value: Any) -> Any:
    """``keras.initializers.get(value)``, with an error naming the argument (``zeros``
    inside `zero_initialized`)."""
    try:
        initializer = keras.initializers.get(value)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: unknown `{name}` {describe(value)}.") from err
    return keras.initializers.Zeros() if _ZERO_INITIALIZED.get() else initializer


try:  # Keras keeps a tensor's mask beside the tensor where it cannot be an attribute (JAX)
    from keras.src.backend import get_keras_mask as _get_keras_mask
except ImportError:  # pragma: no cover - other Keras layouts

    def _get_keras_mask(x: Any) -> Any:
        return getattr(x, "_keras_mask", None)


def keras_mask_of(x: Any) -> Any:
    """The Keras mask a tensor carries (``Embedding(mask_zero=True)`` and friends), or
    None."""
    if x is None or not hasattr(x, "shape"):
        return None
    try:
        return _get_keras_mask(x)
    except (AttributeError, TypeError):
        return None


def call_sublayer(layer: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """``layer(x, *args, **kwargs)``, calling ``layer.call`` directly where Keras'
    ``__call__`` would change nothing: a built, unquantized layer without an activity
    regularizer, called eagerly on a tensor already in its compute dtype that carries no
    Keras mask. Keras' per-call bookkeeping (argument binding, autocast and name scopes,
    mask and loss tracking) costs more than the tensor work of a decoding step of a small
    model; symbolic and traced calls (functional models, ``jax.jit``, ``tf.function``)
    always go through ``__call__``."""
    if (
        layer.built
        and getattr(layer, "quantization_mode", None) is None
        and getattr(layer, "activity_regularizer", None) is None
        and hasattr(x, "dtype")
        and get_ops(x).dtype_name(x) == layer.compute_dtype
        and not get_ops(x).is_symbolic(x)
        and keras_mask_of(x) is None
    ):
        return layer.call(x, *args, **kwargs)
    return layer(x, *args, **kwargs)


def joined_linear(ops: Any, x: Any, kernels: list, biases: list) -> list:
    """``[ops.linear(x, k, b) for k, b in zip(kernels, biases)]`` as one product: the
    kernels ``(E, ...)`` flattened and joined along their output columns (the biases
    likewise; all given or all None), the product's columns then split and shaped back.
    ``x`` ``(..., E)`` with static sizes. The numbers are the separate products' up to
    the rounding of the product's blocking."""
    width = shape_of(kernels[0])[0]
    flat = [ops.reshape(k, (width, -1)) for k in kernels]
    bias = None
    if biases[0] is not None:
        bias = ops.concatenate([ops.reshape(b, (-1,)) for b in biases], axis=0)
    y = ops.linear(x, ops.concatenate(flat, axis=1), bias)
    lead = list(shape_of(y)[:-1])
    outs, start = [], 0
    for kernel, f in zip(kernels, flat):
        n = shape_of(f)[1]
        part = ops.slice(y, [*([0] * len(lead)), start], [*lead, n])
        outs.append(ops.reshape(part, tuple(lead) + tuple(shape_of(kernel)[1:])))
        start += n
    return outs


def plain_dense(dense: Any, dtype: str) -> bool:
    """Whether `project` may read ``dense`` (a Keras ``Dense``/``EinsumDense``) as a
    kernel and a bias: a float sublayer, not quantized, without LoRA or an activity
    regularizer, computing in ``dtype``."""
    return (
        dense.quantization_mode is None
        and not dense.lora_enabled
        and dense.activity_regularizer is None
        and dense.compute_dtype == dtype
    )


def project(ops: Any, x: Any, dense: Any, dtype: str, contract: int = 1) -> Any:
    """``dense(x)`` for a sublayer whose kernel is ``(*k, *n)`` (``k`` the ``contract``
    trailing axes of ``x``) and whose bias is ``(*n)`` or None: for a `plain_dense`
    sublayer and ``x`` in ``dtype``, `ops.linear` on its kernel and bias (one matrix
    product with the bias inside), then its activation; else the sublayer called (quantized, LoRA, another dtype)."""
    if not plain_dense(dense, dtype) or ops.dtype_name(x) != dtype:
        return call_sublayer(dense, x)
    bias = None if dense.bias is None else ops.cast(dense.bias, dtype)
    y = ops.linear(x, ops.cast(dense.kernel, dtype), bias, contract=contract)
    if dense.activation is not keras.activations.linear:
        y = dense.activation(y)
    return y


def fresh_initializer(init: Any) -> Any:
    """A new initializer object with the configuration of ``init``: each sublayer needs
    its own, since a seeded initializer object gives every weight it makes the same
    values."""
    return init.__class__.from_config(init.get_config())


def block_initializers(where: str, kernel_initializer: Any, bias_initializer: Any) -> tuple:
    """The ``kernel_initializer`` and ``bias_initializer`` of a Transformer block,
    validated (errors name the argument)."""
    return (
        get_initializer(where, "kernel_initializer", kernel_initializer),
        get_initializer(where, "bias_initializer", bias_initializer),
    )


def sublayer_initializers(layer: Any) -> dict:
    """Fresh copies of ``layer.kernel_initializer`` and ``layer.bias_initializer``, as
    keyword arguments of one sublayer."""
    return {
        "kernel_initializer": fresh_initializer(layer.kernel_initializer),
        "bias_initializer": fresh_initializer(layer.bias_initializer),
    }


def as_mask(where: str, name: str, mask: Any) -> Any:
    """A mask given as a tensor or an array, unchanged; a nested Python list as a NumPy
    array. Ragged lists and non-numeric values raise naming ``name``."""
    if mask is None or (hasattr(mask, "shape") and hasattr(mask, "dtype")):
        return mask
    try:
        arr = np.asarray(mask)
    except ValueError as err:
        raise ValueError(
            f"{where}: `{name}` must be a tensor, an array or a rectangular nested list; "
            f"received {describe(mask)}."
        ) from err
    if arr.dtype.kind not in "biu":
        raise TypeError(
            f"{where}: `{name}` must be boolean (True = may attend) or integer; received "
            f"{describe(mask)}."
        )
    return arr


#: the tanh approximations of GELU a block's ``activation`` may also name (transformers'
#: names; Keras has no activation of these names): applied by `multiattn.ops.activation`.
TANH_GELU = ("gelu_new", "gelu_tanh", "gelu_pytorch_tanh")


def check_block_args(
    where: str,
    d_model: Any,
    num_heads: Any,
    dff: Any,
    rate: Any,
    norm_first: Any,
    epsilon: Any,
    activation: Any,
) -> tuple[int, int, int, float, bool, float, Any]:
    """The arguments shared by the Transformer blocks, validated: ``(d_model, num_heads,
    dff, rate, norm_first, epsilon, activation)``. ``d_model`` must be divisible by
    ``num_heads``; errors name the argument and quote the value."""
    d_model = check_positive_int(where, "d_model", d_model)
    num_heads = check_positive_int(where, "num_heads", num_heads)
    dff = check_positive_int(where, "dff", dff)
    if d_model % num_heads:
        raise ValueError(
            f"{where}: `d_model` ({d_model}) must be divisible by `num_heads` ({num_heads})."
        )
    rate = check_rate(where, "rate", rate)
    if not isinstance(norm_first, bool):
        raise TypeError(f"{where}: `norm_first` must be a bool; received {norm_first!r}.")
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
        raise ValueError(f"{where}: `epsilon` must be a positive float; received {epsilon!r}.")
    if not (isinstance(activation, str) and activation in TANH_GELU):
        try:
            keras.activations.get(activation)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{where}: unknown `activation` {activation!r}.") from err
    return d_model, num_heads, dff, rate, norm_first, float(epsilon), activation

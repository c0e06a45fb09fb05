"""Pieces shared by the multiattn Keras layers."""

from __future__ import annotations

from typing import Any

import keras

from .._checks import check_positive_int, check_rank, check_rate, fmt_shape


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
    shape = tuple(x.shape)
    check_rank(where, name, shape, 3, 3)
    if shape[-1] is not None and shape[-1] != expected:
        raise ValueError(
            f"{where}: `{name}` must have width {expected} (the width the layer was built "
            f"with); received shape {fmt_shape(shape)}."
        )


def seed_generator(seed: int | None) -> keras.random.SeedGenerator:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"`seed` must be an int or None; received {seed!r}.")
    return keras.random.SeedGenerator(seed)


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
    try:
        keras.activations.get(activation)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: unknown `activation` {activation!r}.") from err
    return d_model, num_heads, dff, rate, norm_first, float(epsilon), activation

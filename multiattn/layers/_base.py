"""Pieces shared by the multiattn Keras layers."""

from __future__ import annotations

from typing import Any

import keras

from .._checks import check_rank, fmt_shape


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

"""Sinusoidal positional encoding (omega_k = 1 / base**(2k / depth)) and the ALiBi
attention bias."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._checks import check_choice, check_positive_int
from ..namespaces.keras import get_ops

__all__ = ["PE_LAYOUTS", "alibi_bias", "sinusoidal_encoding"]

PE_LAYOUTS = ("interleaved", "concatenated")


def sinusoidal_table(
    length: int, depth: int, layout: str = "interleaved", base: float = 10000.0
) -> np.ndarray:
    """The encoding as a float64 NumPy array ``(length, depth)`` (validated inputs)."""
    where = "sinusoidal_encoding"
    length = check_positive_int(where, "length", length)
    depth = check_positive_int(where, "depth", depth)
    check_choice(where, "layout", layout, PE_LAYOUTS)
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
        raise ValueError(f"{where}: `base` must be a number > 1; received {base!r}.")
    n_sin, n_cos = (depth + 1) // 2, depth // 2
    omega = float(base) ** (-2.0 * np.arange(n_sin, dtype=np.float64) / depth)
    angles = np.arange(length, dtype=np.float64)[:, None] * omega[None, :]
    sin, cos = np.sin(angles), np.cos(angles[:, :n_cos])
    table = np.empty((length, depth), dtype=np.float64)
    if layout == "interleaved":
        table[:, 0::2], table[:, 1::2] = sin, cos
    else:
        table[:, :n_sin], table[:, n_sin:] = sin, cos
    return table


def sinusoidal_encoding(
    length: int,
    depth: int,
    *,
    layout: str = "interleaved",
    base: float = 10000.0,
    dtype: str = "float32",
) -> Any:
    """Sinusoidal positional encoding of shape ``(length, depth)``.

    With ``omega_k = 1 / base**(2k/depth)`` and position ``t``:

    * ``"interleaved"`` (the d2l layout): ``P[t, 2k] = sin(t omega_k)``,
      ``P[t, 2k+1] = cos(t omega_k)``;
    * ``"concatenated"``: the ``ceil(depth/2)`` sines first, then the ``floor(depth/2)``
      cosines.

    The table depends on no input tensor, so it is computed once in float64 with NumPy
    and cast to ``dtype``: every backend receives bit-identical values.

    Args:
        length: number of positions (positive int).
        depth: encoding width (positive int, odd allowed).
        layout: ``"interleaved"`` or ``"concatenated"``.
        base: the wavelength base (10000 in the documents).
        dtype: a floating dtype name.

    Returns:
        A tensor of the active backend, ``(length, depth)``.
    """
    check_choice(
        "sinusoidal_encoding", "dtype", dtype, ("float16", "bfloat16", "float32", "float64")
    )
    table = sinusoidal_table(length, depth, layout, base)
    return get_ops().convert_to_tensor(
        table.astype(np.float32) if dtype != "float64" else table, dtype=dtype
    )


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's per-head slopes, float64 ``(num_heads,)``: ``2 ** (-8 h / n)`` for
    ``h = 1 .. n`` when ``n`` is a power of two; otherwise those of the power of two ``p``
    below ``n``, then every other slope of ``2 p`` for the remaining heads."""
    num_heads = check_positive_int("alibi_bias", "num_heads", num_heads)

    def geometric(n: int) -> np.ndarray:
        return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)

    low = 1 << (num_heads.bit_length() - 1)
    if low == num_heads:
        return geometric(num_heads)
    return np.concatenate([geometric(low), geometric(2 * low)[0::2][: num_heads - low]])


def alibi_bias(num_heads: int, q_len: int, k_len: int, *, dtype: str = "float32") -> Any:
    """The ALiBi attention bias ``(1, num_heads, q_len, k_len)``, to pass as ``bias=`` /
    ``attention_bias=``: ``-slope_h * |p_i - j|`` with query ``i`` at position ``p_i = i +
    k_len - q_len`` (aligned bottom-right, as ``causal=True``) and `alibi_slopes`. Under
    a causal mask this is the bias of Press et al. (2022); without one, keys after the
    query are penalised by their distance too. Computed in float64 with NumPy, returned in
    ``dtype`` on the active backend."""
    where = "alibi_bias"
    q_len = check_positive_int(where, "q_len", q_len)
    k_len = check_positive_int(where, "k_len", k_len)
    check_choice(where, "dtype", dtype, ("float16", "bfloat16", "float32", "float64"))
    distance = np.abs(np.arange(q_len)[:, None] + (k_len - q_len) - np.arange(k_len)[None, :])
    bias = -alibi_slopes(num_heads)[:, None, None] * distance[None]
    return get_ops().convert_to_tensor(bias[None].astype(np.float64), dtype=dtype)

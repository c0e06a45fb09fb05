"""Splitting features into attention heads and merging them back.

Two layouts appear in the source documents:

* ``"contiguous"`` (the usual one): head ``h`` owns features ``h*depth ... (h+1)*depth - 1``.
* ``"interleaved"`` (the PaddlePaddle document's split): head ``h`` owns features
  ``h, h + heads, h + 2*heads, ...``, i.e. feature ``f = d*heads + h``.
"""

from __future__ import annotations

from typing import Any

from .._checks import as_array, check_choice, check_positive_int, check_rank, fmt_shape, shape_of
from ..namespaces.keras import get_ops

__all__ = ["HEAD_LAYOUTS", "merge_heads", "split_heads"]

HEAD_LAYOUTS = ("contiguous", "interleaved")


def split_heads(x: Any, num_heads: int, *, layout: str = "contiguous") -> Any:
    """``(batch, seq, num_heads * depth)`` -> ``(batch, num_heads, seq, depth)``.

    Args:
        x: any dtype, rank 3.
        num_heads: number of heads; must divide the feature width.
        layout: ``"contiguous"`` or ``"interleaved"`` (see the module docstring).
    """
    where = "split_heads"
    num_heads = check_positive_int(where, "num_heads", num_heads)
    check_choice(where, "layout", layout, HEAD_LAYOUTS)
    ops = get_ops(x)
    x = as_array(x)
    shape = shape_of(x)
    check_rank(where, "x", shape, 3, 3)
    width = shape[-1]
    if width is None or width % num_heads:
        raise ValueError(
            f"{where}: the feature width of `x` {fmt_shape(shape)} must be divisible by "
            f"num_heads={num_heads}."
        )
    depth = width // num_heads
    dyn = ops.shape(x)
    if layout == "contiguous":
        return ops.transpose(ops.reshape(x, (dyn[0], dyn[1], num_heads, depth)), (0, 2, 1, 3))
    return ops.transpose(ops.reshape(x, (dyn[0], dyn[1], depth, num_heads)), (0, 3, 1, 2))


def merge_heads(x: Any, *, layout: str = "contiguous") -> Any:
    """``(batch, num_heads, seq, depth)`` -> ``(batch, seq, num_heads * depth)``.

    The exact inverse of `split_heads` for the same ``layout``. (The PaddlePaddle
    document splits interleaved but merges contiguously; pass the layout you need.)
    """
    where = "merge_heads"
    check_choice(where, "layout", layout, HEAD_LAYOUTS)
    ops = get_ops(x)
    x = as_array(x)
    shape = shape_of(x)
    check_rank(where, "x", shape, 4, 4)
    if shape[1] is None or shape[3] is None:
        raise ValueError(
            f"{where}: heads and depth of `x` must be static; received {fmt_shape(shape)}."
        )
    dyn = ops.shape(x)
    perm = (0, 2, 1, 3) if layout == "contiguous" else (0, 2, 3, 1)
    return ops.reshape(ops.transpose(x, perm), (dyn[0], dyn[2], shape[1] * shape[3]))

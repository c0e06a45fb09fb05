"""The integer check of ``generate``'s arguments (internal)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_int"]


def check_int(where: str, name: str, value: Any, low: int = 1) -> int | None:
    """``value`` as an int (None stays None), refusing bools, other types
    (`TypeError`) and values below ``low`` (`ValueError`); ``where`` and ``name`` name the
    function and argument in the message."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: `{name}` must be an int or None; received {value!r}.")
    if value < low:
        raise ValueError(f"{where}: `{name}` must be >= {low}; received {value!r}.")
    return int(value)

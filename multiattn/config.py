"""Runtime settings of multiattn.

Two settings: the *attention memory budget* and which library runs dense projections
on PyTorch CPU (see `set_torch_onednn`; unset, it is measured on the running machine by
`multiattn.tuning`).

The *attention memory budget* is the most memory, in bytes, that
the attention score matrix of one call may take. When the scores of a call
(``batch * heads * queries * keys`` elements of the compute dtype: float32 for float16,
bfloat16 and float32 inputs, float64 for float64) would exceed the budget, attention is
computed block by block with an online softmax (see ``docs/long-sequences.md``), which
never holds the whole score matrix; below it, the direct path (one score matrix, one
softmax) is used.

The budget is, in order of precedence:

1. the value given to `set_attention_memory_budget` (or the `attention_memory_budget`
   context manager);
2. the environment variable ``MULTIATTN_ATTENTION_MEMORY_BUDGET``, read at every call,
   as a number of bytes with an optional unit: ``1073741824``, ``512MiB``, ``2GiB``,
   ``1.5GB``, ``64k`` (``k``/``M``/``G``/``T`` and ``KB``... are powers of 1000,
   ``KiB``... powers of 1024);
3. `DEFAULT_ATTENTION_MEMORY_BUDGET`, 1 GiB.

The budget is read when attention is traced or run: under ``jax.jit`` or
``tf.function`` the value at tracing time is compiled in.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = [
    "BUDGET_ENV_VAR",
    "DEFAULT_ATTENTION_MEMORY_BUDGET",
    "ONEDNN_ENV_VAR",
    "attention_memory_budget",
    "get_attention_memory_budget",
    "get_torch_onednn",
    "set_attention_memory_budget",
    "set_torch_onednn",
]

BUDGET_ENV_VAR = "MULTIATTN_ATTENTION_MEMORY_BUDGET"
DEFAULT_ATTENTION_MEMORY_BUDGET = 1 << 30  # 1 GiB

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

ONEDNN_ENV_VAR = "MULTIATTN_TORCH_ONEDNN"

_budget: int | None = None
_torch_onednn: bool | None = None


def parse_bytes(value: Any, *, what: str = "attention memory budget") -> int:
    """A positive number of bytes from an int, a float or a string with a unit."""
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected a number of bytes; received {value!r}.")
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{what}: cannot read {value!r} as a number of bytes (examples: "
                "1073741824, 512MiB, 2GiB, 1.5GB)."
            )
        number = float(match.group(1)) * _UNITS[unit]
    elif isinstance(value, (int, np.integer)):
        number = int(value)
    elif isinstance(value, (float, np.floating)):
        number = float(value)
    else:
        raise TypeError(f"{what}: expected a number of bytes; received {value!r}.")
    if not math.isfinite(number) or number < 1:
        raise ValueError(f"{what}: must be at least 1 byte; received {value!r}.")
    return int(number)


def set_attention_memory_budget(nbytes: int | str | None) -> None:
    """Set the attention memory budget, in bytes (or a string such as ``"512MiB"``).

    ``None`` forgets the value set here: the environment variable
    ``MULTIATTN_ATTENTION_MEMORY_BUDGET``, or the 1 GiB default, applies again.
    """
    global _budget
    _budget = None if nbytes is None else parse_bytes(nbytes)


def get_attention_memory_budget() -> int:
    """The attention memory budget in bytes (set value, else environment, else 1 GiB)."""
    if _budget is not None:
        return _budget
    raw = os.environ.get(BUDGET_ENV_VAR, "").strip()
    if raw:
        return parse_bytes(raw, what=BUDGET_ENV_VAR)
    return DEFAULT_ATTENTION_MEMORY_BUDGET


@contextmanager
def attention_memory_budget(nbytes: int | str | None) -> Iterator[int]:
    """Temporarily set the budget (``with attention_memory_budget("64MiB"): ...``).

    Yields the budget in effect inside the block; the previous setting is restored on
    exit.
    """
    global _budget
    saved = _budget
    set_attention_memory_budget(nbytes)
    try:
        yield get_attention_memory_budget()
    finally:
        _budget = saved


def set_torch_onednn(enabled: bool | None) -> None:
    """Which library runs multiattn's dense projections on PyTorch CPU in float32 (the
    query, key, value and output projections of `multiattn.layers.MultiHeadAttention`):
    PyTorch's oneDNN linear operator or its BLAS product.

    Which one is faster depends on the CPU: oneDNN was twice as fast as MKL on an AMD EPYC
    with AVX-512, and 22% slower than ``torch.matmul`` on an AVX2-only CPU. So by default
    (``None``, and ``MULTIATTN_TORCH_ONEDNN`` unset, empty or ``auto``) neither is assumed:
    each product of a projection (forward, and the two of its backward pass) runs on the
    library that `multiattn.tuning` timed faster on the running machine for its shape
    class, once per process and class (``multiattn.tuning.decisions()`` lists the
    choices). While ``torch.compile`` or ``torch.jit`` traces the call, nothing is timed
    and the projection is PyTorch's own ``einsum``.

    ``True`` forces oneDNN for every product, ``False`` PyTorch's own ``einsum`` (its
    BLAS), without timing anything. ``None`` forgets the value set here: the environment
    variable ``MULTIATTN_TORCH_ONEDNN`` (``1``, ``true``, ``yes`` or ``on`` force oneDNN;
    ``0``, ``false``, ``no`` or ``off`` force BLAS; ``auto`` or empty measure), else
    measurement, applies again. Read when a projection runs (or is traced). The two
    libraries compute the same product and differ only by rounding (a few units in the
    last place), so two processes that measured differently agree to float32 rounding,
    not bit for bit: force a library for bitwise-repeatable runs. oneDNN is used only
    where PyTorch has it.
    """
    global _torch_onednn
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_torch_onednn: expected True, False or None; received {enabled!r}.")
    _torch_onednn = enabled


def get_torch_onednn() -> bool | None:
    """The projection library setting: ``True`` (oneDNN forced), ``False`` (BLAS forced) or
    ``None`` (measured per shape class, `multiattn.tuning`); the value set by
    `set_torch_onednn`, else ``MULTIATTN_TORCH_ONEDNN``, else None."""
    if _torch_onednn is not None:
        return _torch_onednn
    raw = os.environ.get(ONEDNN_ENV_VAR, "").strip().lower()
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("", "auto"):
        return None
    raise ValueError(
        f"{ONEDNN_ENV_VAR}: expected 1/0, true/false, yes/no, on/off or auto; received {raw!r}."
    )

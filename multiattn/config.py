"""Runtime settings of multiattn, scoped or process-wide.

The settings are the arguments of `settings` (documented there). These shape memory and
kernels everywhere:

* ``attention_memory_budget``: the most memory, in bytes, that the attention score
  matrix of one call may take. When the scores of a call (``batch * heads * queries *
  keys`` elements of the compute dtype: float32 for float16, bfloat16 and float32 inputs,
  float64 for float64) would exceed the budget, attention is computed block by block with
  an online softmax (see ``docs/long-sequences.md``), which never holds the whole score
  matrix; below it, the direct path (one score matrix, one softmax) is used.
* ``block_size``: force that blockwise path with blocks of this many ``(queries, keys)``
  for attention calls that give no ``block_size`` of their own (None: decided by the
  budget).
* ``fused_attention``: force the backend's fused attention kernel, or the explicit
  softmax, where a call allows either.
* ``autotune``: who makes the kernel choices that depend on the machine: nobody (the
  default: each takes its documented default, from the call's static facts), the
  measuring tuner (True: timed on the running machine, `multiattn.tuning`), or a
  `multiattn.tuning.Fixed` that gives them; `tuner` is the one function that answers.

A value is looked up, in order of precedence:

1. the innermost `settings` block that gives it (``with settings(block_size=64): ...``):
   a `contextvars` variable, so nested blocks restore the outer value on exit and each
   thread and asyncio task sees its own;
2. the process-wide value of a setter (`set_attention_memory_budget`);
3. the environment variables ``MULTIATTN_ATTENTION_MEMORY_BUDGET`` (a number of bytes
   with an optional unit: ``1073741824``, ``512MiB``, ``2GiB``, ``1.5GB``, ``64k``;
   ``k``/``M``/``G``/``T`` and ``KB``... are powers of 1000, ``KiB``... powers of 1024),
   and ``MULTIATTN_AUTOTUNE``, read once, at first use
   (`reload_environment` reads them again);
4. the defaults: `DEFAULT_ATTENTION_MEMORY_BUDGET` (1 GiB), no forced block size,
   autotune off.

`owned_caches` is a scope of another kind: inside it, a caller that owns the KV caches
it passes to the layers (``generate``, or a decoding loop of one's own) lets them write
new keys and values into those caches instead of copying them (see ``docs/decoding.md``).

Settings are read when attention is traced or run: under ``jax.jit`` or
``tf.function`` the values in force when the function is *traced* are compiled in, and a
later `settings` block around a call of the compiled function changes nothing until it
is traced again (under ``torch.compile`` likewise, until it recompiles).
"""

from __future__ import annotations

import contextvars
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import numpy as np

from .namespaces.keras import owned_caches

__all__ = [
    "AUTOTUNE_ENV_VAR",
    "BUDGET_ENV_VAR",
    "DEFAULT_ATTENTION_MEMORY_BUDGET",
    "attention_memory_budget",
    "fingerprint",
    "get_attention_memory_budget",
    "get_autotune",
    "get_block_size",
    "get_fused_attention",
    "owned_caches",
    "process_cores",
    "reload_environment",
    "set_attention_memory_budget",
    "settings",
    "tuner",
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

AUTOTUNE_ENV_VAR = "MULTIATTN_AUTOTUNE"

_budget: int | None = None
#: the environment's values, read at first use: {"budget": int | None, "autotune": ...}
_environment: dict[str, Any] | None = None
#: the values of the enclosing `settings` blocks (name -> value)
_scoped: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "multiattn_settings", default=MappingProxyType({})
)
_UNSET: Any = object()


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
    """The attention memory budget in bytes: the innermost `settings` value, else the set
    value, else the environment, else 1 GiB."""
    scoped = _scoped.get().get("attention_memory_budget")
    if scoped is not None:
        return scoped
    if _budget is not None:
        return _budget
    env = _read_environment()["budget"]
    return DEFAULT_ATTENTION_MEMORY_BUDGET if env is None else env


def get_block_size() -> tuple[int, int] | None:
    """The ``(queries, keys)`` blocks the innermost `settings` block forces on attention
    calls that give no ``block_size`` of their own, or None."""
    return _scoped.get().get("block_size")


def reload_environment() -> None:
    """Read ``MULTIATTN_ATTENTION_MEMORY_BUDGET`` and ``MULTIATTN_AUTOTUNE`` again at their next use (they are otherwise read once per
    process)."""
    global _environment
    _environment = None


def _read_environment() -> dict[str, Any]:
    global _environment
    if _environment is None:
        raw = os.environ.get(BUDGET_ENV_VAR, "").strip()
        budget = parse_bytes(raw, what=BUDGET_ENV_VAR) if raw else None
        _environment = {
            "budget": budget,
            "autotune": _parse_switch(AUTOTUNE_ENV_VAR, os.environ.get(AUTOTUNE_ENV_VAR, "")),
        }
    return _environment


def _parse_switch(name: str, raw: str, expected: str = "1/0, true/false, yes/no or on/off"):
    """An environment switch: True, False, or None where it is unset or empty."""
    raw = raw.strip().lower()
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw == "":
        return None
    raise ValueError(f"{name}: expected {expected}; received {raw!r}.")


@contextmanager
def settings(
    *,
    attention_memory_budget: int | str | None = _UNSET,
    block_size: int | tuple[int, int] | None = _UNSET,
    fused_attention: bool | None = _UNSET,
    autotune: Any = _UNSET,
) -> Iterator[None]:
    """Scoped settings: inside the block, the given values apply to every multiattn call
    in this thread or asyncio task (``with settings(attention_memory_budget="64MiB",
    block_size=(128, 256)): ...``); on exit the previous values apply again. Blocks nest;
    an argument left out keeps the enclosing value, and None means the process-wide value
    (the setters', else the environment's, else the default).

    Args:
        attention_memory_budget: bytes (an int or a string such as ``"512MiB"``).
        block_size: a positive int or a pair ``(queries, keys)``: attention calls without
            a ``block_size`` of their own take the blockwise path with these blocks
            (not when the weights or dropout are needed; as the argument of
            `multiattn.ops.scaled_dot_product_attention`, it needs static lengths).
        fused_attention: True takes the backend's fused attention kernel wherever the
            call allows it (no weights or dropout wanted, a backend that has one), False
            the explicit softmax wherever the scores fit the attention memory budget
            (beyond it a streaming path is taken either way); None (the default): the
            namespace's ``fused_attention_pays``, or under ``autotune=True`` whichever
            is measured faster on the running machine, once per shape class.
        autotune: who makes the choices that depend on the machine (`tuner`): False
            (nobody: each takes its documented default, from the call's static facts),
            True (the measuring tuner: the first call of each shape class times the
            candidates, later calls take the faster, `multiattn.tuning`), or a
            `multiattn.tuning.Fixed` giving them (the slices of the batch, the backward
            pass, PyTorch's projection library). None (the
            default) means the process-wide value: ``MULTIATTN_AUTOTUNE`` (``1``/``0``,
            read once), else False. Decisions already timed in the process, or read by
            `multiattn.tuning.load_decisions`, apply with False too.

    Values are read when a function is traced: under ``jax.jit`` and ``tf.function`` the
    values in force at tracing time are compiled in.
    """
    changes: dict[str, Any] = {}
    if attention_memory_budget is not _UNSET:
        changes["attention_memory_budget"] = (
            None if attention_memory_budget is None else parse_bytes(attention_memory_budget)
        )
    if block_size is not _UNSET:
        changes["block_size"] = None if block_size is None else _block_pair(block_size)
    if fused_attention is not _UNSET:
        changes["fused_attention"] = _check_flag("settings", "fused_attention", fused_attention)
    if autotune is not _UNSET:
        changes["autotune"] = _check_tuner(autotune)
    token = _scoped.set({**_scoped.get(), **changes})
    try:
        yield
    finally:
        _scoped.reset(token)


def _block_pair(block_size: Any) -> tuple[int, int]:
    pair = block_size if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    ok = len(pair) == 2 and all(
        not isinstance(b, bool) and isinstance(b, (int, np.integer)) and b >= 1 for b in pair
    )
    if not ok:
        raise ValueError(
            "settings: `block_size` must be None, a positive integer or a pair of positive "
            f"integers (queries, keys); received {block_size!r}."
        )
    return int(pair[0]), int(pair[1])


def _check_tuner(value: Any) -> Any:
    """``autotune``: True, False, None or a tuner object (`multiattn.tuning.Fixed`)."""
    if value is None or isinstance(value, bool):
        return value
    if all(callable(getattr(value, m, None)) for m in ("attention", "linear", "batch_slices")):
        return value
    raise TypeError(
        "settings: `autotune` expects True, False, None or a tuner such as "
        f"multiattn.tuning.Fixed(...); received {value!r}."
    )


def _check_flag(where: str, name: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{where}: `{name}` expects True, False or None; received {value!r}.")
    return value


@contextmanager
def attention_memory_budget(nbytes: int | str | None) -> Iterator[int]:
    """``settings(attention_memory_budget=nbytes)`` that yields the budget in effect
    inside the block (``with attention_memory_budget("64MiB") as budget: ...``)."""
    with settings(attention_memory_budget=nbytes):
        yield get_attention_memory_budget()


def get_fused_attention() -> bool | None:
    """The innermost `settings` value of ``fused_attention``: True (the fused kernel where
    the call allows it), False (the explicit softmax) or None (the namespace's default; measured under
    ``autotune``)."""
    return _scoped.get().get("fused_attention")


def get_autotune() -> Any:
    """The ``autotune`` in force: the innermost `settings` value, else
    ``MULTIATTN_AUTOTUNE``, else False; True, False or a tuner object
    (`multiattn.tuning.Fixed`)."""
    value = _scoped.get().get("autotune")
    if value is None:
        value = _read_environment()["autotune"]
    return False if value is None else value


def tuner() -> Any:
    """Who makes the choices that depend on the machine, for the call being made: None
    (the static defaults; `multiattn.tuning` is not even imported), the tuner given as
    ``settings(autotune=...)`` (`multiattn.tuning.Fixed`), or the measuring tuner
    (`multiattn.tuning.MEASURED`) under ``autotune=True`` and wherever this process
    holds timed or loaded decisions. The one place the attention planner, PyTorch's
    projections and the Paddle document layers ask."""
    value = get_autotune()
    if value is not True and value is not False:
        return value
    if value:
        from . import tuning

        return tuning.MEASURED
    tuning = sys.modules.get(f"{__package__}.tuning")
    return tuning.MEASURED if tuning is not None and tuning.has_decisions() else None


def process_cores() -> int:
    """The number of cores this process may run on (``os.sched_getaffinity``;
    ``os.cpu_count`` where that is missing)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def fingerprint() -> tuple:
    """The settings in force that decide what an attention call computes with, as a
    hashable tuple of ``(name, value)`` pairs: the effective memory budget (the innermost
    `settings` block's, else the setter's, else the environment's, else the default),
    ``block_size``, ``fused_attention`` and ``autotune`` (`get_autotune`). A compiled or
    recorded computation that reads them (``generate``'s kept steps) is kept per
    fingerprint, so that a changed setting takes effect at the next call instead of
    replaying what was compiled under the old one."""
    return (
        ("attention_memory_budget", get_attention_memory_budget()),
        ("block_size", get_block_size()),
        ("fused_attention", _scoped.get().get("fused_attention")),
        ("autotune", get_autotune()),
    )

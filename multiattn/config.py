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
* ``autotune``: whether the kernel choices that no setting forces are timed on the
  running machine (`multiattn.tuning`) or take their documented defaults (the default:
  every choice then depends only on the call's static facts).

The others force one kernel choice each (``torch_onednn``, ``fused_attention``,
``blockwise_attention``, ``fused_projections``, ``attention_chunks``,
``attention_backward``) or say how ``generate`` runs (``torch_traced_step``,
``compiled_loop``).

A value is looked up, in order of precedence:

1. the innermost `settings` block that gives it (``with settings(block_size=64): ...``):
   a `contextvars` variable, so nested blocks restore the outer value on exit and each
   thread and asyncio task sees its own;
2. the process-wide value of a setter (`set_attention_memory_budget`,
   `set_torch_onednn`);
3. the environment variables ``MULTIATTN_ATTENTION_MEMORY_BUDGET`` (a number of bytes
   with an optional unit: ``1073741824``, ``512MiB``, ``2GiB``, ``1.5GB``, ``64k``;
   ``k``/``M``/``G``/``T`` and ``KB``... are powers of 1000, ``KiB``... powers of 1024),
   ``MULTIATTN_TORCH_ONEDNN`` and ``MULTIATTN_AUTOTUNE``, read once, at first use
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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import numpy as np

from ._namespace import owned_caches

__all__ = [
    "AUTOTUNE_ENV_VAR",
    "BUDGET_ENV_VAR",
    "DEFAULT_ATTENTION_MEMORY_BUDGET",
    "ONEDNN_ENV_VAR",
    "attention_memory_budget",
    "fingerprint",
    "get_attention_backward",
    "get_attention_chunks",
    "get_attention_memory_budget",
    "get_autotune",
    "get_block_size",
    "get_blockwise_attention",
    "get_compiled_loop",
    "get_fused_attention",
    "get_fused_projections",
    "get_torch_onednn",
    "get_torch_traced_step",
    "owned_caches",
    "process_cores",
    "reload_environment",
    "set_attention_memory_budget",
    "set_torch_onednn",
    "settings",
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
AUTOTUNE_ENV_VAR = "MULTIATTN_AUTOTUNE"

_budget: int | None = None
_torch_onednn: bool | None = None
#: the environment's values, read at first use: {"budget": int | None, "onednn": ...}
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
    """Read ``MULTIATTN_ATTENTION_MEMORY_BUDGET``, ``MULTIATTN_TORCH_ONEDNN`` and
    ``MULTIATTN_AUTOTUNE`` again at their next use (they are otherwise read once per
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
            "onednn": _parse_onednn(os.environ.get(ONEDNN_ENV_VAR, "")),
            "autotune": _parse_switch(AUTOTUNE_ENV_VAR, os.environ.get(AUTOTUNE_ENV_VAR, "")),
        }
    return _environment


def _parse_onednn(raw: str) -> bool | None:
    if raw.strip().lower() == "auto":
        return None
    return _parse_switch(ONEDNN_ENV_VAR, raw, "1/0, true/false, yes/no, on/off or auto")


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
    torch_onednn: bool | None = _UNSET,
    fused_attention: bool | None = _UNSET,
    torch_traced_step: bool | None = _UNSET,
    fused_projections: bool | None = _UNSET,
    compiled_loop: bool | None = _UNSET,
    attention_chunks: int | None = _UNSET,
    attention_backward: str | None = _UNSET,
    blockwise_attention: bool | None = _UNSET,
    autotune: bool | None = _UNSET,
) -> Iterator[None]:
    """Scoped settings: inside the block, the given values apply to every multiattn call
    in this thread or asyncio task (``with settings(attention_memory_budget="64MiB",
    block_size=(128, 256)): ...``); on exit the previous values apply again. Blocks nest;
    an argument left out keeps the enclosing value, and None means the process-wide value
    (the setters', else the environment's, else the default).

    Where a choice below is *measured*, that is under ``autotune``; with it off (the
    default) nothing is timed and each choice takes its documented default, the
    framework's own operation: the namespace's ``fused_attention_pays`` for fused or
    explicit attention, the direct path within the memory budget, a product per kernel,
    the batch in one piece (in slices only where `multiattn.tuning.default_chunks` says),
    automatic differentiation, and PyTorch's BLAS product for projections.

    Args:
        attention_memory_budget: bytes (an int or a string such as ``"512MiB"``).
        block_size: a positive int or a pair ``(queries, keys)``: attention calls without
            a ``block_size`` of their own take the blockwise path with these blocks
            (not when the weights or dropout are needed; as the argument of
            `multiattn.ops.scaled_dot_product_attention`, it needs static lengths).
        torch_onednn: True (oneDNN) or False (BLAS) for the dense projections on PyTorch
            CPU (see `set_torch_onednn`).
        fused_attention: True takes the backend's fused attention kernel wherever the
            call allows it (no weights or dropout wanted, a backend that has one), False
            the explicit softmax wherever the scores fit the attention memory budget
            (beyond it a streaming path is taken either way); None (the default): the
            namespace's ``fused_attention_pays``, or under ``autotune`` whichever is
            measured faster on the running machine, once per shape class
            (`multiattn.tuning`).
        blockwise_attention: True takes the blockwise path (exact attention block by
            block with an online softmax, ``docs/long-sequences.md``) wherever the call
            allows it (static lengths, no weights or dropout wanted), with the blocks the
            memory budget gives, also where the scores would fit the budget and where
            PyTorch's kernel streams; False takes it only where the scores exceed the
            budget; None (the default) does that, and under ``autotune``, for compiled
            calls (``jax.jit``, ``tf.function``) whose scores fit the budget but take at
            least ``multiattn.ops.plan.BLOCKWISE_MIN_BYTES`` (32 MiB), measures whether
            the blockwise path is faster on the running machine, once per shape class
            (`multiattn.tuning.blockwise_attention_pays`). A forced ``block_size`` takes
            the blockwise path whatever this says.
        torch_traced_step: on Keras' torch backend, whether ``generate`` runs its
            one-token decoding step recorded by ``torch.jit.trace`` and replayed (True,
            the default; None means the default) or as eager Keras calls (False). Read
            at each ``generate`` call.
        fused_projections: True computes the query, key and value projections of
            self-attention as one product over the three kernels joined (and the gate
            and up projections of a gated feed-forward layer over their two), False as a
            product per kernel; None (the default): a product per kernel, or under
            ``autotune`` whichever is measured faster on the running machine, once per
            shape class (`multiattn.tuning.fused_projections_pay`).
        compiled_loop: on jax and TensorFlow, whether greedy ``generate`` runs every
            token after the prompt inside one compiled loop (True, the default; None
            means the default): ``jax.lax.while_loop`` under ``jax.jit``, or
            ``tf.while_loop`` compiled by XLA, with no return to Python between tokens.
            False loops in Python over the compiled one-token step (as sampling always
            does). Both give the same tokens. Read at each ``generate`` call.
        attention_chunks: the explicit attention path (the core's own softmax, taken
            where the fused kernel is not) runs over at most this many slices of the
            batch in turn: the largest divisor of the batch not above it, so ``8`` runs a
            batch of 6 in 6 slices and a batch of 1 in one piece. 1 runs it in one
            piece; None (the default): `multiattn.tuning.default_chunks` (slices where
            XLA compiles the call for a CPU and its score matrix exceeds glibc's largest
            mapping threshold, else one piece), or under ``autotune`` the fastest count
            measured on the running machine for compiled calls (``jax.jit``,
            ``tf.function``) and on Paddle, once per shape class
            (`multiattn.tuning.attention_chunks`). A positive int. The slices hold a
            smaller score matrix each: on XLA:CPU, whose buffers of a call are fresh
            memory, that is fewer pages for the kernel to hand out and zero on every
            call; TensorFlow runs its slices side by side on its inter-op threads, and
            Paddle on a pool of one thread per CPU (its CPU kernels use one thread
            each). Not with the weights or dropout (they need the whole matrix), and
            only on a namespace that maps batches (jax's, whose slices are
            rematerialised, so the backward pass runs in slices too; TensorFlow's;
            Paddle's); elsewhere one piece. The Paddle document layers
            (`multiattn.backends.paddle`) run their whole computation in at most this
            many slices (one piece when None, measured under ``autotune``).
        attention_backward: how the explicit attention path (without weights, dropout
            or bias) is differentiated. ``"autodiff"``: by the framework's automatic
            differentiation. ``"recompute"``: by a backward pass of its own
            (`multiattn.ops.explicit_grad`) that recomputes the weights from the log of
            each row's softmax denominator saved by the forward pass. ``"saved"``: by
            that backward pass reading the weights the forward pass saved (no
            recomputation; the weights are held between the passes, as automatic
            differentiation holds them). None (the default): automatic
            differentiation, or under ``autotune``, for compiled calls (``jax.jit``,
            ``tf.function``), whichever is measured fastest forward and backward on the
            running machine, once per shape class (`multiattn.tuning.attention_backward`). The gradients are equal up to rounding. On jax the own
            backward pass is a ``jax.custom_vjp``: reverse mode (``jax.grad``,
            ``jax.vjp``) works, forward mode (``jax.jvp``, ``jax.jacfwd``,
            ``jax.hessian``) does not, so set ``"autodiff"`` for those.

        autotune: whether the kernel and decoding choices that no setting forces are
            timed on the running machine (True: the first call of each shape class times
            its candidates and later calls take the faster, `multiattn.tuning`) or take
            their documented defaults (False). None (the default) means the process-wide
            value: the environment variable ``MULTIATTN_AUTOTUNE`` (``1``/``0``, read
            once), else False. Decisions already made in the process (timed, or read by
            `multiattn.tuning.load_decisions`) are used either way.

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
    flags = {
        "torch_onednn": torch_onednn,
        "fused_attention": fused_attention,
        "blockwise_attention": blockwise_attention,
        "torch_traced_step": torch_traced_step,
        "fused_projections": fused_projections,
        "compiled_loop": compiled_loop,
        "autotune": autotune,
    }
    for name, value in flags.items():
        if value is not _UNSET:
            changes[name] = _check_flag("settings", name, value)
    if attention_chunks is not _UNSET:
        changes["attention_chunks"] = _check_positive("attention_chunks", attention_chunks)
    if attention_backward is not _UNSET:
        changes["attention_backward"] = _check_backward(attention_backward)
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


def _check_positive(name: str, value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
        raise TypeError(f"settings: `{name}` must be an int or None; received {value!r}.")
    if value is not None and value < 1:
        raise ValueError(f"settings: `{name}` must be >= 1; received {value!r}.")
    return None if value is None else int(value)


def _check_backward(value: Any) -> str | None:
    from .ops.plan import BACKWARDS

    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"settings: `attention_backward` must be one of {BACKWARDS} or None; received "
            f"{value!r}."
        )
    if value is not None and value not in BACKWARDS:
        raise ValueError(
            f"settings: `attention_backward` must be one of {BACKWARDS} or None; received "
            f"{value!r}."
        )
    return value


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


def set_torch_onednn(enabled: bool | None) -> None:
    """Which library runs multiattn's dense projections on PyTorch CPU in float32 (the
    query, key, value and output projections of `multiattn.layers.MultiHeadAttention`):
    PyTorch's oneDNN linear operator or its BLAS product.

    Which one is faster depends on the CPU (docs/benchmarks.md has runs on several). By
    default (``None``, and ``MULTIATTN_TORCH_ONEDNN`` unset, empty or ``auto``) each
    product runs on PyTorch's own ``einsum`` (its BLAS); under
    ``settings(autotune=True)`` each product of a projection (forward, and the two of its
    backward pass) runs on the library that `multiattn.tuning` timed faster on the
    running machine for its shape class, once per process and class
    (``multiattn.tuning.decisions()`` lists the choices). While ``torch.compile`` or
    ``torch.jit`` traces the call, nothing is timed and the projection is PyTorch's own
    ``einsum``.

    ``True`` forces oneDNN for every product, ``False`` PyTorch's own ``einsum`` (its
    BLAS), without timing anything. ``None`` forgets the value set here: the environment
    variable ``MULTIATTN_TORCH_ONEDNN`` (``1``, ``true``, ``yes`` or ``on`` force oneDNN;
    ``0``, ``false``, ``no`` or ``off`` force BLAS; ``auto`` or empty: the default; read once),
    else the default, applies again. A `settings` block overrides it in its scope. Read
    when a projection runs (or is traced). The two
    libraries compute the same product and differ only by rounding (a few units in the
    last place), so two processes that measured differently agree to float32 rounding,
    not bit for bit: force a library for bitwise-repeatable runs. oneDNN is used only
    where PyTorch has it.
    """
    global _torch_onednn
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_torch_onednn: expected True, False or None; received {enabled!r}.")
    _torch_onednn = enabled


def get_fused_attention() -> bool | None:
    """The innermost `settings` value of ``fused_attention``: True (the fused kernel where
    the call allows it), False (the explicit softmax) or None (the namespace's default; measured under
    ``autotune``)."""
    return _scoped.get().get("fused_attention")


def get_blockwise_attention() -> bool | None:
    """The innermost `settings` value of ``blockwise_attention``: True (the blockwise path
    wherever the call allows it), False (only over the memory budget) or None (only over
    the budget; under ``autotune`` measured for compiled calls within the budget,
    `multiattn.tuning.blockwise_attention_pays`)."""
    return _scoped.get().get("blockwise_attention")


def get_attention_chunks() -> int | None:
    """The innermost `settings` value of ``attention_chunks``: at most that many slices
    of the batch for the explicit attention path, or None (`multiattn.tuning.default_chunks`;
    under ``autotune`` measured in compiled calls and on Paddle)."""
    return _scoped.get().get("attention_chunks")


def get_attention_backward() -> str | None:
    """The innermost `settings` value of ``attention_backward``: ``"autodiff"``,
    ``"recompute"``, ``"saved"`` (how the explicit attention path is differentiated) or
    None (automatic differentiation; under ``autotune`` measured in compiled calls)."""
    return _scoped.get().get("attention_backward")


def get_fused_projections() -> bool | None:
    """The innermost `settings` value of ``fused_projections``: True (one product over
    the joined query, key and value kernels), False (three products) or None
    (three products; measured under ``autotune``)."""
    return _scoped.get().get("fused_projections")


def get_torch_traced_step() -> bool:
    """The innermost `settings` value of ``torch_traced_step`` (default True): whether
    ``generate`` replays a traced decoding step on Keras' torch backend."""
    value = _scoped.get().get("torch_traced_step")
    return True if value is None else value


def get_compiled_loop() -> bool:
    """The innermost `settings` value of ``compiled_loop`` (default True): whether greedy
    ``generate`` runs its tokens in one compiled loop on jax and TensorFlow."""
    value = _scoped.get().get("compiled_loop")
    return True if value is None else value


def get_autotune() -> bool:
    """Whether choices that no setting forces are timed on the running machine: the
    innermost `settings` value of ``autotune``, else ``MULTIATTN_AUTOTUNE``, else False
    (every choice takes its documented default)."""
    value = _scoped.get().get("autotune")
    if value is None:
        value = _read_environment()["autotune"]
    return bool(value)


def process_cores() -> int:
    """The number of cores this process may run on (``os.sched_getaffinity``;
    ``os.cpu_count`` where that is missing)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def get_torch_onednn() -> bool | None:
    """The projection library setting: ``True`` (oneDNN forced), ``False`` (BLAS forced) or
    ``None`` (the default; measured per shape class under autotune): the innermost `settings`
    value, else the value set by `set_torch_onednn`, else ``MULTIATTN_TORCH_ONEDNN``, else
    None."""
    scoped = _scoped.get().get("torch_onednn")
    if scoped is not None:
        return scoped
    if _torch_onednn is not None:
        return _torch_onednn
    return _read_environment()["onednn"]


def fingerprint() -> tuple:
    """The settings in force that decide what an attention call computes with, as a
    hashable tuple of ``(name, value)`` pairs: the effective memory budget (the innermost
    `settings` block's, else the setter's, else the environment's, else the default),
    ``block_size``, the effective ``torch_onednn``, and ``fused_attention``,
    ``blockwise_attention``, ``fused_projections``, ``attention_chunks`` and
    ``attention_backward``. A compiled or
    recorded computation that reads them (``generate``'s kept steps) is kept per
    fingerprint, so that a changed setting takes effect at the next call instead of
    replaying what was compiled under the old one."""
    scoped = _scoped.get()
    kernels = (
        "fused_attention",
        "blockwise_attention",
        "fused_projections",
        "attention_chunks",
        "attention_backward",
    )
    return (
        ("attention_memory_budget", get_attention_memory_budget()),
        ("block_size", get_block_size()),
        ("torch_onednn", get_torch_onednn()),
        *((name, scoped.get(name)) for name in kernels),
    )

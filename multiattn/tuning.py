"""Kernel choices: documented defaults, or measured on the machine that runs, when asked.

Where two kernels compute the same thing and which one is faster depends on the CPU
(whether it has AVX-512 or only AVX2, which BLAS the framework ships, how many cores),
each choice has a default, the framework's own operation, that depends only on the
call's static facts (`decide`'s ``fallback``). Timing is opt-in:
``multiattn.config.settings(autotune=True)`` (or ``MULTIATTN_AUTOTUNE=1``) makes the
first call of each *shape class* time the candidates on the running machine, and every
later call of that class takes the faster one. Decisions are kept per process and per
shape class (sizes rounded up to powers of two, the dtype, the layout of the operands,
the thread count), behind a lock, so the timing runs once per class however many
threads call; `save_decisions` writes them to a file and `load_decisions` takes them back
in another process on the same CPU (``multiattn tune`` makes such a file for a model).

How a decision is timed (`decide`):

* each candidate runs twice untimed (allocation, kernel selection, compilation), then
  `REPEATS` timed rounds take one sample of every candidate (a sample: as many calls as
  last `MIN_SAMPLE_S`), alternating which goes first, so that a slow moment of the machine
  falls on both; the candidate with the lower median time per call wins (for the
  layers' choices only by more than `MARGIN` over the fallback, which wins ties);
* on inputs of the class's size, capped at about `FLOP_CAP` floating-point operations per
  call by taking fewer rows (the contraction and output widths are kept: they decide how
  the kernels block), so that one decision costs a few milliseconds (about 15 ms at the
  cap on a machine running 300 GFLOP/s);
* never while a compiler traces the caller: under ``torch.compile`` (and
  ``torch.jit.trace``) nothing is timed and the choice made earlier for the class is
  used, or else the documented fallback of the choice (the framework's own operation).
  Under ``jax.jit`` and ``tf.function`` the timing runs at trace time *outside* the trace
  (``jax.ensure_compile_time_eval``, ``tf.init_scope``) on inputs of its own, so the
  compiled program holds only the chosen kernel; a decision is read when a function is
  traced and compiled in, like every setting of `multiattn.config`;
* the candidates compute the same product (or the same attention), so whichever wins,
  results agree within the rounding of the dtype.

Choices made this way (each, with autotune off, its fallback):

* ``torch-linear``: a dense projection's matrix product on PyTorch CPU in float32, PyTorch's
  oneDNN linear operator or its BLAS product (``torch.addmm``, the default). Each of the
  three products of a projection (forward, and the input and weight gradients of the
  backward pass) is decided for its own shape. `multiattn.config.set_torch_onednn`
  (``True``/``False``) or ``MULTIATTN_TORCH_ONEDNN`` (``1``/``0``) force one route.
* ``attention``: the backend's fused attention kernel or the core's explicit path, by
  `fused_attention_pays` (float32, equal key and value widths); where nothing can be timed
  (Keras symbolic tensors, ``torch.compile``) the namespace's ``fused_attention_pays``
  applies.
* ``attention-chunks``: how many slices of the batch the explicit attention path runs
  over (`attention_chunks`: 1, 2, 4, 8 or 16, timed at the call's full size; the
  namespaces that map batches: jax's and TensorFlow's in compiled calls, Paddle's in
  eager calls too, its slices running side by side on the CPU's threads);
  ``settings(attention_chunks=n)`` forces one; other eager calls and small score
  matrices run in one piece.
* ``paddle-batch-slices``: how many slices of the batch the Paddle document layers
  (`multiattn.backends.paddle`) run in, side by side (timed on the call's own inputs;
  ``settings(attention_chunks=n)`` forces at most ``n``).
* ``attention-backward``: whether the explicit attention path is differentiated
  automatically or by its own backward pass (`multiattn.ops.explicit_grad`), which
  recomputes the weights or reads those the forward pass saved (`attention_backward`,
  forward and backward at the call's full size, in compiled calls on jax and
  TensorFlow); ``settings(attention_backward="autodiff" | "recompute" | "saved")``
  forces one; eager calls and small score matrices are differentiated automatically.
* ``attention-blockwise``: whether a compiled call (``jax.jit``, ``tf.function``) whose
  scores fit the attention memory budget runs faster on the blockwise path than on the
  direct one (`blockwise_attention_pays`, forward, then forward and backward, at the
  call's full size);
  ``settings(blockwise_attention=True/False)`` forces one; eager calls, and scores under
  ``multiattn.ops.plan.BLOCKWISE_MIN_BYTES``, take the blockwise path only over the
  budget.
* ``fused-qkv``: the query, key and value projections of self-attention as three
  products or as one over the three kernels joined (`fused_projections_pay`);
  ``settings(fused_projections=True/False)`` forces one; where nothing can be timed, three
  products.
* ``fused-gate-up``: the gate and up projections of a gated feed-forward layer (SwiGLU,
  GeGLU) likewise, as two products or one over the two kernels joined.

`decisions` lists what was decided in this process (with the medians that decided it),
`reset` forgets it, `cpu_info` describes the CPU (model and instruction sets), which the
benchmark prints next to its results.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import config
from ._checks import _static_dim

__all__ = [
    "ATTENTION_FLOP_CAP",
    "CHUNK_MIN_BYTES",
    "FLOP_CAP",
    "ISA_FLAGS",
    "MARGIN",
    "MAX_CALLS",
    "MIN_SAMPLE_S",
    "PROJECTION_FLOP_CAP",
    "REPEATS",
    "Decision",
    "attention_chunks",
    "backward_margin",
    "blockwise_attention_pays",
    "bucket",
    "cpu_info",
    "decide",
    "decisions",
    "default_chunks",
    "describe_decision",
    "describe_decisions",
    "fused_attention_pays",
    "fused_projections_pay",
    "load_decisions",
    "parse_cpuinfo",
    "reset",
    "save_decisions",
    "torch_is_tracing",
]

#: Timed rounds per decision (each takes one sample of every candidate); the median
#: decides.
REPEATS = 5
#: Seconds one sample lasts at least (short calls are repeated, up to `MAX_CALLS` times).
MIN_SAMPLE_S = 5e-4
MAX_CALLS = 64
#: How much faster than the fallback (the framework's own operation, three separate
#: products, one piece) another candidate of `fused_attention_pays`,
#: `fused_projections_pay` or `attention_chunks` must be to be chosen (see `decide`).
#: Ties are common there: PyTorch's joined and separate projections both took 14.9 ms
#: forward at the benchmark's shape, and the joined ones, chosen, made the layer's
#: forward and backward pass 1.10 times the fastest native layer's (1.01 with three).
MARGIN = 0.05
#: About the most floating-point operations one timed call performs (rows are cut to fit).
FLOP_CAP = 1 << 28
#: About the most floating-point operations one timed call of `fused_attention_pays`
#: performs (see there).
ATTENTION_FLOP_CAP = 16 * FLOP_CAP
#: About the most floating-point operations one timed call of `fused_projections_pay`
#: performs (see there).
PROJECTION_FLOP_CAP = 64 * FLOP_CAP
#: The instruction-set flags of ``/proc/cpuinfo`` that `cpu_info` reports as ``isa``:
#: those that decide which kernels a BLAS, oneDNN or XLA can use (x86 vector and matrix
#: extensions, Arm's SIMD and scalable vectors).
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
    "asimd",
    "asimdhp",
    "bf16",
    "i8mm",
    "sve",
    "sve2",
)

#: Why a choice took its default: timing was not asked for (`multiattn.config.settings`
#: ``autotune``).
UNTUNED = "autotune off"

_clock = time.perf_counter
_LOCK = threading.RLock()
_DECISIONS: dict[tuple, Decision] = {}
_FALLBACKS: dict[tuple, Decision] = {}


@dataclass(frozen=True)
class Decision:
    """One kernel choice for one shape class.

    ``how`` is ``"measured"`` (``median_ms`` holds each candidate's median, ``timed`` the
    inputs it was timed on), ``"default"`` (timing was not asked for: `UNTUNED`) or
    ``"fallback"`` (nothing could be timed, ``reason`` says why); after the last two, a
    later call that times still measures.
    """

    op: str
    shape_class: tuple[tuple[str, Any], ...]
    choice: str
    how: str
    median_ms: dict[str, float] = field(default_factory=dict)
    timed: str = ""
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "shape_class": dict(self.shape_class),
            "choice": self.choice,
            "how": self.how,
            "median_ms": dict(self.median_ms),
            "timed": self.timed,
            "reason": self.reason,
        }

    def describe(self) -> str:
        """One line (`describe_decision`)."""
        return describe_decision(self.as_dict())


def describe_decision(decision: Mapping[str, Any]) -> str:
    """A decision (as `decisions` lists it) in one line: ``torch-linear rows=4096 in=512
    out=512 ...: onednn (onednn 0.91 ms, blas 1.32 ms)``."""
    cls = " ".join(f"{k}={v}" for k, v in decision["shape_class"].items())
    head = f"{decision['op']} {cls}: {decision['choice']}"
    if decision["how"] not in ("measured", "loaded"):
        return f"{head} ({decision['how']}: {decision['reason']})"
    times = ", ".join(f"{k} {v:.3g} ms" for k, v in decision["median_ms"].items())
    return f"{head} (median {times}; timed on {decision['timed']})"


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (1 for 0): the size classes of `decide`."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def decide(
    op: str,
    shape_class: Mapping[str, Any],
    candidates: Callable[[], tuple[Mapping[str, Callable[[], Any]], str]],
    *,
    fallback: str,
    measurable: bool = True,
    reason: str = "",
    sync: Callable[[Any], Any] | None = None,
    margin: float = 0.0,
    prefer: Sequence[str] = (),
) -> str:
    """The name of the faster candidate for ``op`` on ``shape_class``, timed once per
    process and class.

    Args:
        op: what is chosen (``"torch-linear"``); part of the cache key.
        shape_class: the class's fields (sizes already bucketed, dtype, layout, ...).
        candidates: called only when the class has no decision yet; returns the
            candidates (name -> zero-argument callable, each running one call on inputs of
            its own) and a description of those inputs.
        fallback: the choice when nothing can be timed.
        measurable: False where timing is impossible now (a compiler traces the
            caller); ``reason`` says why. The class's earlier decision is used if there is
            one, else ``fallback``, and nothing is cached: a later call measures.
        sync: called on each candidate's result before the clock stops (for frameworks
            that run asynchronously); None: the call returns when the work is done.
        margin: the ``fallback`` candidate, if it ran, keeps the class unless another's
            median is lower than its own by more than this fraction (`MARGIN` for the
            layers' choices: what a candidate costs beyond its timed forward call, its
            backward pass or its buffers in a larger program, is not timed, and a tie
            went either way from process to process).
        prefer: candidates in order of preference among those that tie: where the
            fallback does not keep the class, the first of ``prefer`` whose median is
            within ``margin`` of the lowest is taken instead of the fastest.

    A candidate that raises drops out; if all do, ``fallback`` is taken and recorded.
    """
    key = (op, tuple(shape_class.items()))
    found = _DECISIONS.get(key)
    if found is not None:
        return found.choice
    untuned = not config.get_autotune()
    if untuned or not measurable:
        how, why = ("default", UNTUNED) if untuned else ("fallback", reason)
        with _LOCK:
            if key not in _DECISIONS and key not in _FALLBACKS:
                _FALLBACKS[key] = Decision(op, key[1], fallback, how, reason=why)
        return fallback
    with _LOCK:
        found = _DECISIONS.get(key)
        if found is not None:
            return found.choice
        fns, timed = candidates()
        samples, errors = _measure(dict(fns), REPEATS, sync)
        medians = {name: statistics.median(ts) * 1e3 for name, ts in samples.items() if ts}
        if medians:
            choice = _fastest(medians, fallback, margin, prefer)
            decision = Decision(op, key[1], choice, "measured", medians, timed)
        else:
            why = "; ".join(f"{k}: {v}" for k, v in errors.items()) or "no candidate ran"
            decision = Decision(op, key[1], fallback, "fallback", timed=timed, reason=why)
        with _LOCK:
            decision = _DECISIONS.setdefault(key, decision)
            _FALLBACKS.pop(key, None)
        return decision.choice


def _fastest(
    medians: Mapping[str, float], fallback: str, margin: float, prefer: Sequence[str]
) -> str:
    """`decide`'s rule: the lowest median, unless the fallback's is within ``margin`` of
    it (the fallback), or a candidate earlier in ``prefer`` is (that one)."""
    best = min(medians, key=medians.__getitem__)
    if fallback in medians and medians[best] >= medians[fallback] * (1 - margin):
        return fallback
    ties = [c for c in prefer if c in medians and medians[best] >= medians[c] * (1 - margin)]
    return ties[0] if ties else best


def _measure(
    fns: dict[str, Callable[[], Any]], repeats: int, sync: Callable[[Any], Any] | None
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Seconds per call of every candidate, ``repeats`` samples each, interleaved.

    Each candidate first runs twice untimed (the first call sets up, the second is timed
    to size the samples); then ``repeats`` rounds run every candidate for one sample, the
    order reversed on every other round. A sample is as many calls as last about
    `MIN_SAMPLE_S` (at least one): a call of a few microseconds is not timer noise.
    Returns the samples and the errors of candidates that raised."""

    def once(fn: Callable[[], Any]) -> None:
        out = fn()
        if sync is not None:
            sync(out)

    samples: dict[str, list[float]] = {}
    number: dict[str, int] = {}
    errors: dict[str, str] = {}
    for name, fn in fns.items():
        try:
            once(fn)
            start = _clock()
            once(fn)
            took = _clock() - start
        except Exception as err:  # a candidate this input cannot take; the others decide
            errors[name] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            continue
        samples[name] = []
        number[name] = max(1, min(MAX_CALLS, math.ceil(MIN_SAMPLE_S / max(took, 1e-9))))
    names = list(samples)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            fn, n = fns[name], number[name]
            start = _clock()
            for _ in range(n):
                once(fn)
            samples[name].append((_clock() - start) / n)
    return samples, errors


def decisions() -> list[dict[str, Any]]:
    """The kernel choices of this process: measured ones, then fallbacks taken where
    nothing could be timed (as dicts: ``op``, ``shape_class``, ``choice``, ``how``,
    ``median_ms``, ``timed``, ``reason``)."""
    with _LOCK:
        found = list(_DECISIONS.values()) + list(_FALLBACKS.values())
    return [d.as_dict() for d in found]


def describe_decisions() -> list[str]:
    """`decisions` as one line each (`describe_decision`)."""
    return [describe_decision(d) for d in decisions()]


def save_decisions(path: str | os.PathLike) -> int:
    """Write this process's measured decisions to a JSON file (`load_decisions` reads it
    back), with the CPU they were measured on (`cpu_info`'s ``model``, ``isa`` and
    ``cores``); returns how many were written. ``multiattn tune`` makes such a file."""
    with _LOCK:
        found = [d.as_dict() for d in _DECISIONS.values()]
    text = json.dumps({"format": _FILE_FORMAT, "cpu": _this_cpu(), "decisions": found}, indent=1)
    pathlib.Path(path).write_text(text + "\n")
    return len(found)


def load_decisions(path: str | os.PathLike, *, any_cpu: bool = False) -> int:
    """Take the decisions of a file of `save_decisions` as this process's own: every
    call of their shape classes takes the choice they record, with or without
    ``settings(autotune=True)``. Returns how many were loaded.

    Raises ``ValueError`` where the file is not such a file, or where it was measured on
    another CPU (another model, instruction sets or core count than `cpu_info` reads
    here) unless ``any_cpu``: a choice timed on one CPU can lose on another."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
        ok = data.get("format") == _FILE_FORMAT and isinstance(data["decisions"], list)
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as err:
        raise ValueError(f"load_decisions: cannot read {str(path)!r}: {err}") from err
    if not ok:
        raise ValueError(f"load_decisions: {str(path)!r} is not a file of save_decisions.")
    here = _this_cpu()
    if not any_cpu and data.get("cpu") != here:
        raise ValueError(
            f"load_decisions: {str(path)!r} was measured on {data.get('cpu')!r}, not on "
            f"this CPU ({here!r}); pass any_cpu=True to take its choices anyway."
        )
    loaded = [_decision_of(d) for d in data["decisions"]]
    with _LOCK:
        for d in loaded:
            _DECISIONS[(d.op, d.shape_class)] = d
            _FALLBACKS.pop((d.op, d.shape_class), None)
    return len(loaded)


def _decision_of(d: Mapping[str, Any]) -> Decision:
    """A `Decision` from its `Decision.as_dict` read back from JSON (lists as tuples)."""

    def frozen(v: Any) -> Any:
        return tuple(frozen(x) for x in v) if isinstance(v, list) else v

    cls = tuple((k, frozen(v)) for k, v in d["shape_class"].items())
    return Decision(d["op"], cls, d["choice"], "loaded", dict(d["median_ms"]), d["timed"])


_FILE_FORMAT = "multiattn-decisions-1"


def _this_cpu() -> dict[str, Any]:
    """What a file of `save_decisions` records of the CPU, and `load_decisions` compares:
    `cpu_info`'s ``model``, ``isa`` and ``cores``."""
    info = cpu_info()
    return {k: info[k] for k in ("model", "isa", "cores")}


def reset() -> None:
    """Forget every decision: the next call of each class measures again (after changing
    the thread count, say)."""
    with _LOCK:
        _DECISIONS.clear()
        _FALLBACKS.clear()


# --- CPU ------------------------------------------------------------------------------


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """The CPU model and feature flags in the text of Linux's ``/proc/cpuinfo``.

    The model is the first ``model name`` line (x86; also ``Model name``, ``Hardware``,
    ``Processor`` or ``cpu model`` elsewhere); the flags are the first ``flags`` line (x86)
    or ``Features`` line (Arm). Returns ``{"model": str, "flags": [sorted flags], "isa":
    [the `ISA_FLAGS` present, in that order]}``.
    """
    model, flags = "", None
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if not sep:
            continue
        name, value = name.strip().lower(), value.strip()
        if not model and name in ("model name", "hardware", "processor", "cpu model") and value:
            if name == "processor" and value.isdigit():
                continue  # x86 and Arm number their cores on "processor" lines
            model = value
        elif flags is None and name in ("flags", "features"):
            flags = set(value.split())
    found = flags or set()
    return {
        "model": model,
        "flags": sorted(found),
        "isa": [f for f in ISA_FLAGS if f in found],
    }


@functools.cache
def _proc_cpuinfo() -> dict[str, Any]:
    try:
        with open("/proc/cpuinfo") as fh:
            info = parse_cpuinfo(fh.read())
    except OSError:
        info = {"model": "", "flags": [], "isa": []}
    info["model"] = info["model"] or platform.processor() or platform.machine()
    info["source"] = "/proc/cpuinfo" if info["flags"] else "platform"
    return info


def cpu_info() -> dict[str, Any]:
    """The running CPU: ``model``, ``isa`` (the instruction sets of `ISA_FLAGS` it has),
    ``flags`` (every flag of ``/proc/cpuinfo``), ``cores`` (usable by this process),
    ``machine`` (``x86_64``, ``aarch64``...) and, where PyTorch is already imported,
    ``torch_cpu_capability`` (``torch.backends.cpu.get_cpu_capability()``: the vector
    instruction set PyTorch's own kernels dispatch to, ``AVX512``, ``AVX2``, ``DEFAULT``...).

    Read from ``/proc/cpuinfo`` (Linux); elsewhere the model is `platform.processor` and the
    flag lists are empty. Imports no framework.
    """
    info = dict(_proc_cpuinfo())
    try:
        info["cores"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["cores"] = os.cpu_count() or 0
    info["machine"] = platform.machine()
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        except (AttributeError, RuntimeError):
            pass
    return info


# --- fused or explicit attention ------------------------------------------------------


_CACHE_UNDER_XLA = (
    "keys and values of a cache, heads first, compiled by XLA: the explicit path reads "
    "them in place; the fused kernel takes them positions first, and a compiled loop "
    "that carries the cache then copies it on every step"
)


def _random_tensors(ops: Any, shapes: Sequence[tuple | None], dtype: str, like: Any) -> list:
    """A decision's inputs: standard normal tensors of ``shapes`` (None for a shape of
    None), the same on every run (seed 0), in ``dtype`` (drawn in float32 for half
    precision), on ``like``'s device where PyTorch keeps it off the CPU. Call inside
    `_eager`."""
    rng = np.random.default_rng(0)
    np_dtype = "float64" if dtype == "float64" else "float32"
    elsewhere = ops.backend == "torch" and _device(ops.backend, like) not in ("cpu", None)

    def one(shape: tuple) -> Any:
        t = ops.cast(ops.convert_to_tensor(rng.standard_normal(shape).astype(np_dtype)), dtype)
        return t.to(like.device) if elsewhere else t

    return [None if shape is None else one(shape) for shape in shapes]


def _attention_class(
    ops: Any, query: Any, key: Any, value: Any, kv_heads_first: bool
) -> tuple[tuple, dict[str, Any], _Compilation, bool, str]:
    """What the two attention choices share: the sizes ``(B, Tq, H, H_kv, Tk, D, Dv)``
    (None where unknown at trace time), the class (the backend, its device, the dtype,
    ``Tq`` and ``Tk`` rounded up to powers of two, ``D``, ``Dv``, the key/value layout
    and, on TensorFlow, whether XLA compiles the caller), how the caller is compiled, and
    whether it can be timed now (and why not)."""
    backend = ops.backend
    b, tq, h, d = (_static(n) for n in query.shape)
    tk = _static(key.shape[2 if kv_heads_first else 1])
    hkv = _static(key.shape[1 if kv_heads_first else 2])
    dv = _static(value.shape[-1])
    cls = {
        "backend": backend,
        "device": _device(backend, query),
        "dtype": ops.dtype_name(query),
        "queries": None if tq is None else bucket(tq),
        "keys": None if tk is None else bucket(tk),
        "dim": d,
        "value_dim": dv,
        "kv_heads_first": kv_heads_first,
    }
    how = _Compilation.of(ops, query)
    if backend == "tensorflow":
        cls["xla"] = how.xla
    measurable, why = _can_time(ops, backend, query)
    if measurable and None in (tq, tk, h, d, dv):
        measurable, why = False, "a length or width unknown at trace time"
    return (b, tq, h, hkv, tk, d, dv), cls, how, measurable, why


def fused_attention_pays(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    explicit: Callable[..., Any],
    kv_heads_first: bool = False,
) -> bool:
    """True when the backend's fused attention (``ops.fused_attention``) is faster than
    the core's explicit path on the running machine for attention of this shape class.

    ``query`` ``(B, Tq, H, D)``, ``key`` ``(B, Tk, H, D)``, ``value`` ``(B, Tk, H, Dv)``
    as `multiattn.ops.attention.attend` passes them (as many key/value heads as query
    heads), or with ``kv_heads_first`` (a KV cache) ``key`` ``(B, H, Tk, D)`` and
    ``value`` ``(B, H, Tk, Dv)``: then the fused candidate moves them to ``(B, Tk, H, D)``
    first, as the fused path does, and the explicit one reads them in place;
    ``explicit(ops, q, k, v, scale, kv_heads_first)`` runs the explicit path without a
    mask and returns its output. Both are timed without a mask on random inputs of the same dtype
    with ``Tk``, ``D`` and ``Dv`` of the call and as many of its ``B * H`` heads as fit
    `ATTENTION_FLOP_CAP` (one head over the cap: as many of its ``Tq`` queries as fit, at
    least 64, so the explicit candidate's score matrix stays small): 16 times the usual
    cap, the whole call at the benchmark's shape (64 heads of 512 queries and keys). On
    TensorFlow, timed on 4 of those heads, Keras' attention beat the explicit path (1.83
    against 2.09 ms) while in the layer it lost (42.2 against 41.3 ms forward, 133
    against 120 forward and backward); at the full size the two tie forward and the
    explicit path, the fallback there, keeps the class (`MARGIN`). The class is the backend, its
    device, the dtype, ``Tq`` and ``Tk`` rounded up to powers of two, ``D``, ``Dv`` and
    the key/value layout.
    This compares the two paths that hold a whole score matrix: where the scores exceed
    the attention memory budget the alternative to a streaming fused kernel is the
    blockwise path, which this does not time. Eager calls time directly; under
    ``jax.jit`` and ``tf.function`` the candidates are compiled as the caller is (on
    TensorFlow with XLA where the caller's graph is, a part of the class) and timed at
    trace time outside the trace, each call running the candidate as many times as reach
    `FLOP_CAP` in a compiled loop (`_compiled`). Where nothing can be timed (Keras symbolic tensors, ``torch.compile``,
    a length unknown at trace time) the class's earlier decision is used, else the
    namespace's ``fused_attention_pays`` (`multiattn._contract.Namespace`). Keys and
    values heads first under XLA (a cache in a compiled step) take the explicit path
    without timing: timed alone the two tie, but in a loop that carries the cache the
    fused kernel's layout copies the cache on every step (`_CACHE_UNDER_XLA`).
    """
    if not ops.has_fused_attention:
        return False
    fallback = bool(ops.fused_attention_pays)
    sizes, cls, how, measurable, why = _attention_class(ops, query, key, value, kv_heads_first)
    b, tq, h, _, tk, d, dv = sizes
    if kv_heads_first and how.traced and how.xla:
        # Not timed: alone the two tie, but the loop differs (generate, Llama shape,
        # prompt 512, batch 8, TensorFlow: 1.5 ms per token explicit, 5.9 ms fused). A
        # class of its own, so that a decision timed on eager calls of the same sizes
        # is not reused here.
        cls["cache_under_xla"] = True
        measurable, why, fallback = False, _CACHE_UNDER_XLA, False
    heads, queries = max(1, (b or 1) * (h or 1)), tq
    if measurable:
        # fewer heads first, then (one head over the cap) fewer queries, at least 64
        per_query = 2 * tk * (d + dv)
        heads = max(1, min(heads, ATTENTION_FLOP_CAP // max(per_query * tq, 1)))
        if per_query * tq > ATTENTION_FLOP_CAP:
            queries = min(tq, max(64, ATTENTION_FLOP_CAP // max(per_query, 1)))

    def candidates() -> tuple[dict[str, Callable[[], Any]], str]:
        kv = (1, heads, tk) if kv_heads_first else (1, tk, heads)
        shapes = [(1, queries, heads, d), (*kv, d), (*kv, dv)]
        scale = 1.0 / math.sqrt(d)

        def fused(q, k, v):
            if kv_heads_first:
                k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in (k, v))
            return ops.fused_attention(q, k, v, None, scale)

        fns = {
            "fused": fused,
            "explicit": lambda q, k, v: explicit(ops, q, k, v, scale, kv_heads_first),
        }
        with _eager(ops.backend):
            tensors = _random_tensors(ops, shapes, cls["dtype"], query)
            passes = how.passes(2 * heads * queries * tk * (d + dv))
            runs = {
                name: _compiled(ops.backend, fn, tensors, how, passes) for name, fn in fns.items()
            }
        kv = f"(1, {heads}, {tk}, {d}/{dv})" if kv_heads_first else f"(1, {tk}, {heads}, {d}/{dv})"
        looped = f", {passes} passes per call" if passes > 1 else ""
        return runs, f"(1, {queries}, {heads}, {d}) queries, {kv} keys/values{looped}"

    fallback_choice = "fused" if fallback else "explicit"
    choice = _decide_eagerly("attention", cls, candidates, fallback_choice, measurable, why)
    return choice == "fused"


#: Score matrices of fewer bytes than this (one call's ``B*H*Tq*Tk`` entries) are not
#: timed for `attention_chunks` and run in one piece: timing compiles every candidate,
#: which costs more than slicing a matrix of a few pages could save.
CHUNK_MIN_BYTES = 1 << 20


def _at_full_size(sizes: tuple, cls: dict, measurable: bool, why: str) -> tuple[bool, str]:
    """What the choices timed at the call's full size (`attention_chunks`,
    `attention_backward`) add to `_attention_class`: the class also holds ``B``,
    ``H`` and ``H_kv`` (``cls`` is updated), and nothing is timed where one of them is
    unknown at trace time or the score matrix is under `CHUNK_MIN_BYTES`. Returns
    ``(measurable, why)``."""
    b, tq, h, hkv, tk = sizes[:5]
    cls.update(batch=b, heads=h, kv_heads=hkv)
    if measurable and None in (b, hkv):
        return False, "a size unknown at trace time"
    itemsize = 8 if cls["dtype"] == "float64" else 4
    if measurable and b * h * tq * tk * itemsize < CHUNK_MIN_BYTES:
        return False, "a score matrix under CHUNK_MIN_BYTES"
    return measurable, why


def _full_size_inputs(
    ops: Any, sizes: tuple, dtype: str, like: Any, kv_heads_first: bool
) -> tuple[list, str]:
    """Random query, key and value of the call's full size (`_random_tensors`; call
    inside `_eager`), and their description for the decision."""
    b, tq, h, hkv, tk, d, dv = sizes
    kv = (b, hkv, tk) if kv_heads_first else (b, tk, hkv)
    tensors = _random_tensors(ops, [(b, tq, h, d), (*kv, d), (*kv, dv)], dtype, like)
    return tensors, f"({b}, {tq}, {h}, {d}) queries, {(*kv, d)} keys"


def _in_slices(
    ops: Any, explicit: Callable[..., Any], sizes: tuple, chunks: int, kv_heads_first: bool
) -> Callable[..., Any]:
    """``explicit(ops, q, k, v, scale, kv_heads_first)`` (the explicit path without a
    mask) as ``fn(q, k, v)`` over ``chunks`` slices of the batch (`Namespace.map_batch`;
    one piece for 1), the scale that of the key width in ``sizes``."""
    scale = 1.0 / math.sqrt(sizes[5])

    def one(q: Any, k: Any, v: Any) -> Any:
        return explicit(ops, q, k, v, scale, kv_heads_first)

    return one if chunks == 1 else lambda q, k, v: ops.map_batch(one, (q, k, v), chunks)


def attention_chunks(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    explicit: Callable[..., Any],
    kv_heads_first: bool = False,
) -> int:
    """How many slices of the batch the core's explicit attention path runs fastest in,
    on the running machine, for attention of this shape class: 1 (one piece) or a power
    of two dividing the batch, up to 16 (`multiattn.config.settings`
    ``attention_chunks`` forces a count instead).

    Why it depends on the machine: XLA:CPU takes the buffers of every call of a compiled
    function from the C allocator, and glibc's hands a buffer above its mapping
    threshold (at most 32 MiB) back to the kernel when it is freed, so each call maps it
    again and the kernel zeroes every page on first touch. With the batch in slices, one
    slice's score matrix is what the program holds: below the threshold, it is reused
    from call to call. Multi-head self-attention on jax, batch 8, length 512, width 512,
    8 heads, float32: 62 against 55 ms forward in 4 slices (16,600 against 8,700 page
    faults per call). Whether it pays depends on the allocator, its thresholds and the
    kernel's page size, so it is measured.

    ``query`` ``(B, Tq, H, D)``, ``key`` ``(B, Tk, Hkv, D)`` and ``value``
    ``(B, Tk, Hkv, Dv)`` (heads first with ``kv_heads_first``) as
    `multiattn.ops.attention.attend` passes them; ``explicit(ops, q, k, v, scale,
    kv_heads_first)`` runs the explicit path without a mask. The candidates run it
    forward on random inputs of the call's full size (what is measured is the cost of
    the buffers of that size), compiled as the caller is, through `Namespace.map_batch`
    for the counts above 1. The class is the backend, its device, the dtype, ``B``,
    ``H``, ``Hkv``, ``Tq`` and ``Tk`` rounded up to powers of two, ``D``, ``Dv`` and the
    key/value layout. Counts that tie (within `MARGIN` of the fastest) go to the most
    slices: the smallest buffers, and a tie went either way from run to run. Not timed
    (one piece): score matrices under `CHUNK_MIN_BYTES`,
    sizes unknown at trace time, and where nothing can be timed (Keras symbolic tensors,
    ``torch.compile``).

    TensorFlow's slices are written out side by side in the graph and run on its
    inter-op threads; Paddle's run side by side on a pool of one thread per CPU, and are
    timed in eager calls too (``maps_batch_eagerly``): there the reason is not pages
    but cores, Paddle's CPU kernels running on one thread each.
    """
    sizes, cls, how, measurable, why = _attention_class(ops, query, key, value, kv_heads_first)
    measurable, why = _at_full_size(sizes, cls, measurable, why)
    b = sizes[0]
    counts = [c for c in (1, 2, 4, 8, 16) if measurable and c <= b and b % c == 0]

    def candidates() -> tuple[dict[str, Callable[[], Any]], str]:
        with _eager(ops.backend):
            tensors, timed = _full_size_inputs(ops, sizes, cls["dtype"], query, kv_heads_first)
            runs = {
                str(c): _compiled(
                    ops.backend, _in_slices(ops, explicit, sizes, c, kv_heads_first), tensors, how
                )
                for c in counts
            }
        return runs, f"{timed}, forward"

    # among counts that tie, the most slices: the smallest buffers (in the layer at the
    # default shape, 8 slices tied with 4 forward and took 168 against 175 ms forward and
    # backward with the own backward pass)
    prefer = [str(c) for c in sorted(counts, reverse=True)]
    default = str(default_chunks(sizes, cls, how))
    return int(
        _decide_eagerly("attention-chunks", cls, candidates, default, measurable, why, prefer)
    )


#: glibc's largest dynamic mapping threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``,
#: documented in ``mallopt(3)``): a buffer above it is mapped afresh on every allocation
#: and handed back to the kernel when freed, so the kernel zeroes its pages on every call.
MMAP_THRESHOLD_MAX = 32 << 20
#: The most bytes of scores one slice of `default_chunks` holds: half the threshold.
SLICE_SCORE_BYTES = MMAP_THRESHOLD_MAX // 2


@functools.cache
def _glibc() -> bool:
    """Whether this process runs on glibc (``confstr(_CS_GNU_LIBC_VERSION)``, which only
    glibc answers), asked once per process."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr, or not that name
        return False


def default_chunks(sizes: tuple, cls: Mapping[str, Any], how: _Compilation) -> int:
    """The slices of the batch the explicit attention path runs in when nothing is timed
    (`attention_chunks`' default), from static facts: where XLA compiles the call for a
    CPU (jax's CPU backend, TensorFlow with XLA) and the C library is glibc (whose
    allocator XLA:CPU's buffers come from), a score matrix above `MMAP_THRESHOLD_MAX`
    is cut into the fewest power-of-two slices (dividing the batch, at most 16) whose
    scores take at most `SLICE_SCORE_BYTES` each, so each slice's buffer is kept by the
    allocator from call to call; elsewhere one piece. ``sizes`` and ``cls`` are
    `_attention_class`' (``cls["dtype"]``, ``cls["device"]``)."""
    b, tq, h, _, tk = sizes[:5]
    if None in (b, tq, h, tk) or not how.xla or cls["device"] != "cpu" or not _glibc():
        return 1
    scores = b * h * tq * tk * (8 if cls["dtype"] == "float64" else 4)
    if scores <= MMAP_THRESHOLD_MAX:
        return 1
    counts = [c for c in (2, 4, 8, 16) if c <= b and b % c == 0]
    fitting = [c for c in counts if scores // c <= SLICE_SCORE_BYTES]
    return fitting[0] if fitting else max(counts, default=1)


def attention_backward(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    explicit: Callable[..., Any],
    own: Callable[..., Any],
    chunks: int = 1,
    kv_heads_first: bool = False,
) -> str:
    """How the explicit attention path is differentiated fastest, forward and backward,
    on the running machine, for attention of this shape class: ``"autodiff"`` (the
    framework's automatic differentiation), ``"recompute"`` (the path's own backward
    pass, `multiattn.ops.explicit_grad`, with the weights recomputed from the log of
    each row's softmax denominator) or ``"saved"`` (the same backward pass on the
    weights the forward pass saved).

    Why it depends on the machine and the framework: automatic differentiation keeps the
    weights (or, over jax's slices of the batch, recomputes the slice's whole forward
    pass) and runs the softmax's backward pass, a product and a sum over the score
    matrix; the own backward pass sums over the outputs instead (``rowsum(dO * O)``),
    and recomputing the weights trades a product and an exponential for the memory that
    holds them. Which costs less is a matter of memory traffic and of what the compiler
    fuses. Multi-head self-attention (batch 8, length 512, width 512, 8 heads, float32)
    forward and backward: on jax under ``jax.jit``, 168 ms recomputing against 187 with
    automatic differentiation in 8 slices, 175 against 179 in 4; on TensorFlow under
    ``tf.function`` recomputing lost (121 against 115 ms) and the saved weights won
    (attention alone, ``(8, 512, 8, 64)``: 48.8 against 56.4 ms). The loss timed is the
    sum of the outputs' squares (`_and_backward`): with a constant output gradient XLA
    simplifies automatic differentiation's backward pass as no real loss lets it.

    ``query`` ``(B, Tq, H, D)``, ``key`` ``(B, Tk, Hkv, D)`` and ``value`` ``(B, Tk,
    Hkv, Dv)`` (heads first with ``kv_heads_first``) as `multiattn.ops.attention.attend`
    passes them; ``explicit(ops, q, k, v, scale, kv_heads_first)`` runs the explicit
    path without a mask (differentiated automatically, over ``chunks`` slices of the
    batch through `Namespace.map_batch` where ``chunks`` is above 1), and ``own(ops, q,
    k, v, scale, chunks, kv_heads_first, backward)`` the same with its own backward pass
    (``backward`` ``"recompute"`` or ``"saved"``). All are timed forward and backward
    on random inputs of the call's full size, compiled as the caller is; automatic
    differentiation keeps the class unless another is faster by more than
    `backward_margin` (`MARGIN`; none on TensorFlow). The
    class is `attention_chunks`' with the slices. Not timed (automatic
    differentiation): eager calls (they are not compiled: the caller asks only when
    tracing), backends other than jax and TensorFlow, keys and values heads first (a KV
    cache: decoding, which nothing differentiates), score matrices under
    `CHUNK_MIN_BYTES` and sizes unknown at trace time.
    """
    sizes, cls, how, measurable, why = _attention_class(ops, query, key, value, kv_heads_first)
    if measurable and ops.backend not in ("jax", "tensorflow"):
        measurable, why = False, "a backend whose gradients are not timed"
    if measurable and kv_heads_first:
        # a KV cache's layout: decoding, which nothing differentiates; timing would only
        # delay the first `generate` call
        measurable, why = False, "keys and values heads first (a KV cache: decoding)"
    measurable, why = _at_full_size(sizes, cls, measurable, why)
    cls["chunks"] = chunks

    def candidates() -> tuple[dict[str, Callable[[], Any]], str]:
        scale = 1.0 / math.sqrt(sizes[5])

        def own_way(backward: str) -> Callable[..., Any]:
            return lambda q, k, v: own(ops, q, k, v, scale, chunks, kv_heads_first, backward)

        fns = {
            "autodiff": _in_slices(ops, explicit, sizes, chunks, kv_heads_first),
            "recompute": own_way("recompute"),
            "saved": own_way("saved"),
        }
        with _eager(ops.backend):
            tensors, timed = _full_size_inputs(ops, sizes, cls["dtype"], query, kv_heads_first)
            runs = {
                name: _compiled(ops.backend, _and_backward(fn, ops.backend), tensors, how)
                for name, fn in fns.items()
            }
        sliced = f" in {chunks} slices" if chunks > 1 else ""
        return runs, f"{timed}{sliced}, forward and backward"

    return _decide_eagerly(
        "attention-backward", cls, candidates, "autodiff", measurable, why,
        margin=backward_margin(ops.backend),
    )  # fmt: skip


def backward_margin(backend: str) -> float:
    """How much faster than automatic differentiation another way of differentiating
    the explicit path must be to be chosen (`attention_backward`): `MARGIN`, except on
    TensorFlow, where none.

    The margin stands for what the timed attention does not show, and on jax that
    favours automatic differentiation: over slices it recomputes each slice's forward
    pass instead of holding its weights, memory the timing does not see. On TensorFlow
    automatic differentiation and the saved weights hold the same tensors (the
    weights) and the saved weights' backward pass does less (a sum over the outputs
    instead of the softmax's product and sum over the score matrix), so nothing untimed
    favours automatic differentiation, and a margin handed it a choice that lost in the
    layer: the attention alone at ``(8, 512, 8, 64)`` in 8 slices,
    forward and backward, 68.6 to 74.8 ms with the saved weights against 73.9 to 78.9
    (three processes, 15 interleaved runs each), within the margin in some processes;
    the layer (batch 8, length 512, width 512, 8 heads) 151 and 153 ms against 158 and
    158 (two processes)."""
    return 0.0 if backend == "tensorflow" else MARGIN


def blockwise_attention_pays(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    run: Callable[..., Any],
    causal: bool = False,
    kv_heads_first: bool = False,
) -> bool:
    """True when the blockwise path (exact attention block by block with an online
    softmax, `multiattn.ops.blockwise`) is faster than the direct path on the running
    machine for attention of this shape class whose scores fit the memory budget.

    Why it depends on the machine: the direct path writes and reads the whole score
    matrix several times (scores, softmax, weighted sum), the blockwise path one block
    at a time, which can stay in the caches, at the cost of a loop and of rescaling its
    running sums. Which wins depends on the cache sizes and the memory bandwidth: under
    ``jax.jit``, ``(1, 8, L, 64)`` float32, the blockwise path took 246 against 471 ms
    at L = 4096 on a 2-core Intel Xeon (AVX-512) and lost at 1024 and 2048 without a
    causal mask on a 2-core AMD EPYC (AVX2: 70 against 49 ms at 1024).

    ``query`` ``(B, Tq, H, D)``, ``key`` ``(B, Tk, Hkv, D)`` and ``value`` ``(B, Tk,
    Hkv, Dv)`` (heads first with ``kv_heads_first``) as `multiattn.ops.attention.attend`
    passes them; ``run(q, k, v, blockwise)`` runs the call's attention without a mask
    other than ``causal``, on the direct path as planned (``blockwise`` False: the
    fused or explicit path, the slices and the backward pass the other decisions chose)
    or on the blockwise path with the blocks the budget gives (True). Both are timed on
    random inputs of the call's full size, compiled as the caller is, forward (decision
    ``attention-blockwise``) and, where the blockwise path won that, forward and
    backward (``attention-blockwise-backward``): it is taken only where it wins both by
    more than `MARGIN`, since a compiled call does not say whether it will be
    differentiated (multi-head self-attention under ``tf.function`` on the AMD CPU,
    batch 8, length 512, width 512, 8 heads: 202 against 218 ms forward, 783 against 579
    forward and backward).
    The class is `attention_chunks`' and whether the mask is causal (the blockwise path
    skips the blocks a causal mask hides). Not timed (the direct path): where nothing
    can be timed (Keras symbolic tensors, ``torch.compile``) and sizes unknown at trace
    time.
    """
    sizes, cls, how, measurable, why = _attention_class(ops, query, key, value, kv_heads_first)
    measurable, why = _at_full_size(sizes, cls, measurable, why)
    cls["causal"] = bool(causal)

    def candidates(backward: bool) -> Callable[[], tuple[dict[str, Callable[[], Any]], str]]:
        def timed_runs() -> tuple[dict[str, Callable[[], Any]], str]:
            with _eager(ops.backend):
                tensors, timed = _full_size_inputs(ops, sizes, cls["dtype"], query, kv_heads_first)
                runs = {}
                for name in ("direct", "blockwise"):
                    fn = functools.partial(run, blockwise=name == "blockwise")
                    fn = _and_backward(fn, ops.backend) if backward else fn
                    runs[name] = _compiled(ops.backend, fn, tensors, how)
            what = "forward and backward" if backward else "forward"
            return runs, f"{timed}{', causal' if causal else ''}, {what}"

        return timed_runs

    forward = _decide_eagerly(
        "attention-blockwise", cls, candidates(False), "direct", measurable, why
    )
    if forward != "blockwise":
        return False
    both = _decide_eagerly(
        "attention-blockwise-backward", cls, candidates(True), "direct", measurable, why
    )
    return both == "blockwise"


def fused_projections_pay(
    ops: Any,
    x: Any,
    kernels: Sequence[Any],
    biases: Sequence[Any],
    fused: Callable[[Any, Any, list, list], list],
    kind: str = "fused-qkv",
) -> bool:
    """True when one product over the joined kernels of projections of one input is
    faster than a product per kernel on the running machine, for this shape class: the
    query, key and value projections of self-attention (``kind`` ``"fused-qkv"``), the
    gate and up projections of a gated feed-forward layer (``"fused-gate-up"``).

    ``x`` ``(..., E)``, ``kernels`` the ``(E, ...)`` kernels and ``biases`` theirs (all
    tensors or all None) as `multiattn.layers._base.project_joined` passes them;
    ``fused(ops, x, kernels, biases)`` computes the products as one (the layers' own
    function). Both candidates are timed forward on random inputs of the call's dtype
    with ``min(rows, PROJECTION_FLOP_CAP / (2 E N))`` rows, ``N`` the widths together
    (at least 64 rows): 64 times the usual cap, so that common shapes are timed at their
    full size. Which candidate wins depends on the rows, not only on the widths: on jax
    at width 512 the joined product won at 682 rows (3.0 against 3.4 ms) and lost at
    the 4096 rows of the benchmark's shape (19.5 against 17.7 ms; inside the layer the
    joined projections cost 6 to 13 ms of 57 to 76 more, their larger buffer taking
    fresh pages on every call); the joined candidate also joins the kernels on every
    call, a cost that does not shrink with the rows. The class is the backend, its device, the dtype, the rows (``x``'s
    leading sizes multiplied) rounded up to a power of two, ``E``, the output widths and
    whether there are biases (and on TensorFlow whether XLA compiles the caller).
    Eager calls time directly; under ``jax.jit`` and ``tf.function`` the candidates are
    compiled as the caller is and timed at trace time outside the trace, each call
    running the candidate as many times as reach `FLOP_CAP` in a compiled loop
    (`_compiled`). On PyTorch, where the call is recorded for a backward pass (gradients
    enabled, the input or a kernel requiring one), the candidates are timed forward and
    backward, and that is part of the class: the joined products took 15.0 against
    16.4 ms forward at the benchmark's shape, and made the layer's forward and backward
    pass 1.13 times the fastest native layer's (three products: 1.00 to 1.02). Where
    nothing can be timed (Keras symbolic tensors, ``torch.compile`` and ``torch.jit``, a
    size unknown at trace time) the class's earlier decision is used, else three
    products.
    """
    backend, dtype = ops.backend, ops.dtype_name(x)
    device = _device(backend, x)
    dims = [_static(d) for d in x.shape]
    widths = tuple(math.prod(_static(d) or 0 for d in k.shape[1:]) for k in kernels)
    rows = None if None in dims else math.prod(dims[:-1])
    cls = {
        "backend": backend,
        "device": device,
        "dtype": dtype,
        "rows": None if rows is None else bucket(rows),
        "in": dims[-1],
        "out": widths,
        "bias": biases[0] is not None,
    }
    how = _Compilation.of(ops, x)
    if backend == "tensorflow":
        cls["xla"] = how.xla
    backward = backend == "torch" and _torch_records(x, kernels)
    if backend == "torch":
        cls["backward"] = backward
    measurable, why = _can_time(ops, backend, x)
    if measurable and (rows is None or dims[-1] is None or 0 in widths):
        measurable, why = False, "a size unknown at trace time"

    def candidates() -> tuple[dict[str, Callable[[], Any]], str]:
        n = min(rows, max(64, PROJECTION_FLOP_CAP // max(2 * dims[-1] * sum(widths), 1)))
        passes = how.passes(2 * n * dims[-1] * sum(widths))
        shapes = [(n, dims[-1])]
        shapes += [tuple(int(d) for d in t.shape) for t in kernels]
        shapes += [None if t is None else tuple(int(d) for d in t.shape) for t in biases]

        with _eager(backend):
            tensors = _random_tensors(ops, shapes, dtype, x)
            m = len(kernels)
            fns = {
                "separate": lambda x, *w: [ops.linear(x, k, b) for k, b in zip(w[:m], w[m:])],
                "fused": lambda x, *w: fused(ops, x, list(w[:m]), list(w[m:])),
            }
            if backward:
                fns = {name: _and_backward(fn) for name, fn in fns.items()}
                tensors = [t if t is None else t.requires_grad_(True) for t in tensors]
            runs = {name: _compiled(backend, fn, tensors, how, passes) for name, fn in fns.items()}
        looped = f", {passes} passes per call" if passes > 1 else ""
        passes_timed = "forward and backward" if backward else "forward"
        return runs, f"({n}, {dims[-1]}) inputs, kernels to {widths}{looped}, {passes_timed}"

    return _decide_eagerly(kind, cls, candidates, "separate", measurable, why) == "fused"


def _torch_records(x: Any, kernels: Sequence[Any]) -> bool:
    """PyTorch records the call for a backward pass: gradients are enabled and the input
    or a kernel requires one."""
    import torch

    wants = [getattr(t, "requires_grad", False) for t in (x, *kernels)]
    return torch.is_grad_enabled() and any(wants)


def _and_backward(fn: Callable[..., Any], backend: str = "torch") -> Callable[..., Any]:
    """``fn`` followed by the gradients of the sum of its outputs (an array or a list of
    them) with respect to its tensor arguments: a candidate timed forward and backward
    (``torch.autograd.grad`` on PyTorch, whose inputs require gradients; ``jax.grad``;
    ``tf.gradients`` inside the compiled function on TensorFlow). On jax and TensorFlow
    the sum is of the outputs' squares: with the sum itself the output's gradient is a
    constant, which lets XLA simplify the backward pass of the explicit attention path
    (78 against 112 ms at ``(8, 512, 8, 64)`` in 4 slices) where a real loss would not."""
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def jax_total(*tensors: Any) -> Any:
            return sum(jnp.sum(o * o) for o in jax.tree_util.tree_leaves(fn(*tensors)))

        return lambda *tensors: jax.grad(jax_total, tuple(range(len(tensors))))(*tensors)
    if backend == "tensorflow":
        import tensorflow as tf

        def tf_run(*tensors: Any) -> Any:
            # tf.gradients, not a tape: the decision runs in tf.init_scope, which stops
            # every tape from recording, and the candidate runs as a graph anyway
            total = tf.add_n([tf.reduce_sum(o * o) for o in tf.nest.flatten(fn(*tensors))])
            return tf.gradients(total, list(tensors))

        return tf_run

    def run(*tensors: Any) -> Any:
        import torch

        outs = fn(*tensors)
        total = sum(out.sum() for out in (outs if isinstance(outs, (list, tuple)) else [outs]))
        leaves = [t for t in tensors if t is not None]
        return torch.autograd.grad(total, leaves)

    return run


def _decide_eagerly(
    op: str,
    cls: dict,
    candidates: Callable,
    fallback: str,
    measurable: bool,
    why: str,
    prefer: Sequence[str] = (),
    margin: float = MARGIN,
) -> str:
    """`decide` for a class whose ``backend`` and ``device`` fields name the framework,
    timing outside any ``jax.jit`` / ``tf.function`` trace under way."""
    backend = cls["backend"]
    with _eager(backend) if measurable else contextlib.nullcontext():
        return decide(
            op,
            cls,
            candidates,
            fallback=fallback,
            measurable=measurable,
            reason=why,
            sync=_sync(backend, cls["device"]),
            margin=margin,
            prefer=prefer,
        )


def _static(n: Any) -> int | None:
    return _static_dim(n)  # None for a symbolic size (JAX shape polymorphism, graphs)


def _device(backend: str, x: Any) -> str | None:
    """The device a backend computes on: ``x``'s on torch (``"cpu"``, ``"cuda"``,
    ...), jax's default backend, ``"gpu"`` where TensorFlow sees one, else ``"cpu"``."""
    if backend == "torch":
        return getattr(getattr(x, "device", None), "type", None)
    if backend == "jax":
        import jax

        return jax.default_backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    return "cpu"


def _can_time(ops: Any, backend: str, x: Any) -> tuple[bool, str]:
    """Whether `fused_attention_pays` can time now, and why not."""
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(x, keras.KerasTensor):
        return False, "Keras symbolic tensors (nothing runs)"
    if backend == "torch":
        if torch_is_tracing():
            return False, "torch.compile or torch.jit traces the call"
        if getattr(x, "device", None) is not None and x.device.type == "meta":
            return False, "meta tensors (shape inference)"
    return True, ""


def torch_is_tracing() -> bool:
    """True while ``torch.compile`` (dynamo), ``torch.export`` or ``torch.jit`` traces the
    caller: nothing may be timed then (the timing code would be traced)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling():
        return True
    return bool(torch.jit.is_tracing() or torch.jit.is_scripting())


def _eager(backend: str) -> Any:
    """A context in which operations run eagerly even while ``jax.jit`` or
    ``tf.function`` traces the caller."""
    if backend == "jax":
        import jax

        return jax.ensure_compile_time_eval()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.init_scope()
    return contextlib.nullcontext()


@dataclass(frozen=True)
class _Compilation:
    """How the caller's code is compiled, for timing candidates the same way: whether it
    is traced (``jax.jit``, ``tf.function``) and, on TensorFlow, compiled by XLA."""

    traced: bool = False
    xla: bool = False

    @classmethod
    def of(cls, ops: Any, x: Any) -> _Compilation:
        """Read at the decision point, inside the caller's trace."""
        traced = bool(ops.is_symbolic(x))
        in_xla = traced and ops.backend == "tensorflow" and _tf_in_xla()
        return cls(traced, ops.backend == "jax" or in_xla)

    def passes(self, flops: int) -> int:
        """Passes of a candidate of ``flops`` per timed call: traced, as many as reach
        `FLOP_CAP` (at most 64), so that a candidate of a few microseconds is timed by its
        work inside compiled code, not by the cost of a call; one otherwise."""
        return max(1, min(64, FLOP_CAP // max(flops, 1))) if self.traced else 1


def _tf_in_xla() -> bool:
    """Whether the TensorFlow graph being built is compiled by XLA (a
    ``tf.function(jit_compile=True)``, its loops included)."""
    try:
        from tensorflow.python.framework import ops as tf_ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - TensorFlow's layout changed
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()))


def _compiled(
    backend: str,
    fn: Callable[..., Any],
    tensors: list,
    how: _Compilation = _Compilation(),
    passes: int = 1,
) -> Callable[[], Any]:
    """``fn(*tensors)`` as a zero-argument call, compiled as the user's calls are on
    JAX (``jax.jit``) and TensorFlow (``tf.function``, with XLA where ``how.xla``).

    With ``passes > 1`` one call runs ``fn`` that many times in a compiled loop, the first
    input shifted on each pass by a zero the compiler cannot see through (the sum of the
    last pass's outputs times 0), so that no pass is hoisted out of the loop or merged."""
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def looped(*ts):
            def body(_, shift):
                out = fn(ts[0] + shift, *ts[1:])
                return sum(jnp.sum(o) for o in jax.tree_util.tree_leaves(out)) * 0.0

            return jax.lax.fori_loop(0, passes, body, jnp.zeros((), ts[0].dtype))

        jitted = jax.jit(fn if passes == 1 else looped)
        return lambda: jitted(*tensors)
    if backend == "tensorflow":
        import tensorflow as tf

        def tf_looped(*ts):
            def body(i, shift):
                out = fn(ts[0] + shift, *ts[1:])
                total = tf.add_n([tf.reduce_sum(o) for o in tf.nest.flatten(out)])
                return i + 1, total * 0.0

            start = (tf.constant(0), tf.zeros((), ts[0].dtype))
            return tf.while_loop(lambda i, _: i < passes, body, start)[1]

        # autograph=False: the candidates are the core's code (`multiattn._autograph`)
        graph = tf.function(
            fn if passes == 1 else tf_looped, jit_compile=how.xla or None, autograph=False
        )
        return lambda: graph(*tensors)
    return lambda: fn(*tensors)


def _sync(backend: str, device: str | None) -> Callable[[Any], Any] | None:
    if backend == "jax":
        import jax

        return jax.block_until_ready  # any structure of arrays
    if backend == "tensorflow":
        import tensorflow as tf

        return lambda out: tf.nest.map_structure(lambda t: t.numpy(), out)
    if backend == "torch" and device == "cuda":
        import torch

        return lambda out: torch.cuda.synchronize()
    return None

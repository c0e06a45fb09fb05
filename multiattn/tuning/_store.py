"""Decisions: timing candidates, keeping the faster per shape class, and their files.

`decide` times the candidates of one choice once per process and shape class (behind a
lock, so however many threads call, the timing runs once), keeps the faster and returns
its name; `decisions` lists what was decided, `save_decisions` / `load_decisions` write
and read them (a JSON file recording the CPU they were measured on), `reset` forgets them.
A decision is kept as the dict `decisions` lists. Imports no framework.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import config
from .cpu import cpu_info

#: Timed rounds per decision (each takes one sample of every candidate); the median
#: decides.
REPEATS = 5

#: Seconds one sample lasts at least (short calls are repeated, up to `MAX_CALLS` times).
MIN_SAMPLE_S = 5e-4

MAX_CALLS = 64

#: How much faster than the fallback (the framework's own operation, one piece) another
#: candidate of the layers' choices must be to be chosen (see `decide`): what a candidate
#: costs beyond its timed call is not timed, and a tie went either way from process to
#: process.
MARGIN = 0.05

#: About the most floating-point operations one timed call performs (rows are cut to fit).
FLOP_CAP = 1 << 28

#: Why a choice took its default: timing was not asked for (`multiattn.config.settings`
#: ``autotune``).
UNTUNED = "autotune off"

_FILE_FORMAT = "multiattn-decisions-1"

_clock = time.perf_counter

_LOCK = threading.RLock()

#: (op, shape class as JSON) -> a measured or loaded decision: later calls take it
_DECISIONS: dict[tuple[str, str], dict[str, Any]] = {}

#: the same for a default or a fallback taken where nothing was timed: a later call that
#: can time still measures
_FALLBACKS: dict[tuple[str, str], dict[str, Any]] = {}


def _decision(op: str, cls: Mapping[str, Any], choice: str, how: str, **rest: Any) -> dict:
    """One decision as `decisions` lists it. ``how``: ``"measured"`` (``median_ms`` holds
    each candidate's median, ``timed`` the inputs it was timed on), ``"loaded"``,
    ``"default"`` (timing was not asked for: `UNTUNED`) or ``"fallback"`` (nothing could
    be timed; ``reason`` says why)."""
    return dict(
        op=op, shape_class=dict(cls), choice=choice, how=how, median_ms={}, timed="", reason="",
    ) | rest  # fmt: skip


def describe_decision(decision: Mapping[str, Any]) -> str:
    """A decision (as `decisions` lists it) in one line: ``torch-linear rows=4096 in=512
    out=512 ...: onednn (median onednn ... ms, blas ... ms; timed on ...)``."""
    cls = " ".join(f"{k}={v}" for k, v in decision["shape_class"].items())
    head = f"{decision['op']} {cls}: {decision['choice']}"
    if decision["how"] not in ("measured", "loaded"):
        return f"{head} ({decision['how']}: {decision['reason']})"
    times = ", ".join(f"{k} {v:.3g} ms" for k, v in decision["median_ms"].items())
    return f"{head} (median {times}; timed on {decision['timed']})"


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
            layers' choices).
        prefer: candidates in order of preference among those that tie: where the
            fallback does not keep the class, the first of ``prefer`` whose median is
            within ``margin`` of the lowest is taken instead of the fastest.

    A candidate that raises drops out; if all do, ``fallback`` is taken and recorded.
    """
    key = (op, json.dumps(shape_class, default=str))
    found = _DECISIONS.get(key)
    if found is not None:
        return found["choice"]
    untuned = not config.get_autotune()
    if untuned or not measurable:
        how, why = ("default", UNTUNED) if untuned else ("fallback", reason)
        with _LOCK:
            if key not in _DECISIONS:
                _FALLBACKS.setdefault(key, _decision(op, shape_class, fallback, how, reason=why))
        return fallback
    with _LOCK:
        found = _DECISIONS.get(key)
        if found is None:
            fns, timed = candidates()
            samples, errors = _measure(dict(fns), REPEATS, sync)
            medians = {name: statistics.median(ts) * 1e3 for name, ts in samples.items() if ts}
            if medians:
                choice = _fastest(medians, fallback, margin, prefer)
                found = _decision(
                    op, shape_class, choice, "measured", median_ms=medians, timed=timed
                )
            else:
                why = "; ".join(f"{k}: {v}" for k, v in errors.items()) or "no candidate ran"
                found = _decision(op, shape_class, fallback, "fallback", timed=timed, reason=why)
            _DECISIONS[key] = found
            _FALLBACKS.pop(key, None)
    return found["choice"]


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
    """The kernel choices of this process: measured and loaded ones, then the defaults
    and fallbacks taken where nothing was timed (as dicts: ``op``, ``shape_class``,
    ``choice``, ``how``, ``median_ms``, ``timed``, ``reason``)."""
    with _LOCK:
        found = [*_DECISIONS.values(), *_FALLBACKS.values()]
    return [
        {**d, "shape_class": dict(d["shape_class"]), "median_ms": dict(d["median_ms"])}
        for d in found
    ]


def has_decisions() -> bool:
    """Whether this process holds a measured or loaded decision (`multiattn.config.tuner`
    then asks this package with autotune off too)."""
    return bool(_DECISIONS)


def describe_decisions() -> list[str]:
    """`decisions` as one line each (`describe_decision`)."""
    return [describe_decision(d) for d in decisions()]


def save_decisions(path: str | os.PathLike) -> int:
    """Write this process's measured decisions to a JSON file (`load_decisions` reads it
    back), with the CPU they were measured on (`cpu_info`'s ``model``, ``isa`` and
    ``cores``); returns how many were written. ``multiattn tune`` makes such a file."""
    with _LOCK:
        found = list(_DECISIONS.values())
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

    def frozen(v: Any) -> Any:  # JSON's lists back to the tuples of the shape class
        return tuple(frozen(x) for x in v) if isinstance(v, list) else v

    with _LOCK:
        for d in data["decisions"]:
            cls = {k: frozen(v) for k, v in d["shape_class"].items()}
            key = (d["op"], json.dumps(cls, default=str))
            medians, timed = dict(d["median_ms"]), d["timed"]
            _DECISIONS[key] = _decision(
                d["op"], cls, d["choice"], "loaded", median_ms=medians, timed=timed
            )
            _FALLBACKS.pop(key, None)
    return len(data["decisions"])


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

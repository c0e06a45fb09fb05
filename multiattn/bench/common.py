"""Framework-free helpers of the benchmark: FLOP counts, timing, process memory.

Nothing here imports a framework, so the parent process and every worker can use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MODES = ("forward", "fwd_bwd")
MODE_LABELS = {"forward": "forward", "fwd_bwd": "fwd+bwd"}
MIB = 1024 * 1024


# --- FLOP counts ------------------------------------------------------------------------


def attention_flops(batch: int, length: int, width: int, heads: int) -> dict[str, int]:
    """FLOPs of one multi-head self-attention call (a multiply-add counts 2).

    Forward: the four projections (query, key, value, output) ``4 * 2*B*L*E*E``, the
    scores ``2*B*H*L*L*D`` and the weighted sum of the values ``2*B*H*L*L*D``, with
    ``D = E / H``. Biases, scaling, softmax and masking are not counted. Forward and
    backward: 3 times the forward (the backward pass of each matmul is two matmuls).
    """
    head_dim = width // heads
    projections = 4 * 2 * batch * length * width * width
    scores = 2 * batch * heads * length * length * head_dim
    weighted = 2 * batch * heads * length * length * head_dim
    forward = projections + scores + weighted
    return {
        "projections": projections,
        "scores": scores,
        "weighted_sum": weighted,
        "forward": forward,
        "fwd_bwd": 3 * forward,
    }


# --- process memory ---------------------------------------------------------------------

_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    return _LIBC


def trim_heap() -> None:
    """Collect garbage and hand the C heap's free pages back to the OS (glibc
    ``malloc_trim``), so that the next call's working memory shows up in the RSS again
    instead of reusing pages freed by an earlier call."""
    gc.collect()
    libc = _libc()
    if libc and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _status_kib(key: str, pid: int | str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes(pid: int | str = "self") -> int | None:
    """Current resident set size (Linux ``VmRSS``), or None where unavailable."""
    kib = _status_kib("VmRSS", pid)
    return None if kib is None else kib * 1024


def reset_hwm() -> bool:
    """Reset the kernel's RSS high-water mark of this process (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def hwm_bytes() -> int | None:
    """The RSS high-water mark (Linux ``VmHWM``) since start or the last `reset_hwm`."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def max_rss_bytes() -> int:
    """The process's RSS high-water mark since it started (``getrusage`` ``ru_maxrss``)."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024


class PeakRSS:
    """Peak RSS of this process during a ``with`` block, in bytes above the RSS at entry.

    On Linux the kernel's high-water mark is reset at entry (``/proc/self/clear_refs``
    ``5``) and read at exit (``VmHWM``), which catches every page touched, however
    briefly. Elsewhere, or where ``clear_refs`` is not writable, a thread samples the RSS
    every millisecond (psutil) and ``method`` says so.
    """

    def __init__(self) -> None:
        self.base = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        trim_heap()
        current = rss_bytes()
        if current is not None and reset_hwm():
            self.base = rss_bytes() or current
            self.method = "VmHWM"
            return self
        try:
            import psutil
        except ImportError:
            self.base = max_rss_bytes()
            self.method = "ru_maxrss"
            return self
        proc = psutil.Process()
        self.base = self.peak = proc.memory_info().rss
        self.method = "sampled"

        def sample() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, proc.memory_info().rss)
                time.sleep(0.001)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.method == "VmHWM":
            self.peak = hwm_bytes() or 0
        elif self.method == "sampled":
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
        else:
            self.peak = max_rss_bytes()

    @property
    def delta(self) -> int:
        return max(0, self.peak - self.base)


# --- timing -----------------------------------------------------------------------------


@dataclass
class Impl:
    """One implementation as the timing loop sees it: two calls that block until done."""

    id: str
    label: str
    kind: str  # "multiattn" or "native"
    calls: dict[str, Callable[[], Any]] = field(default_factory=dict)


@dataclass
class Timing:
    times: list[float] = field(default_factory=list)  # seconds per call, one per repeat
    number: int = 1  # calls per repeat
    compile_s: float = 0.0  # the first call (tracing/compilation included)
    error: str | None = None


def summarize(times: list[float]) -> dict[str, Any]:
    ms = sorted(t * 1e3 for t in times)
    q1, q3 = (ms[0], ms[-1]) if len(ms) < 4 else statistics.quantiles(ms, n=4)[::2]
    return {
        "median_ms": statistics.median(ms),
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "iqr_ms": q3 - q1,
        "times_ms": [t * 1e3 for t in times],
    }


def describe_error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def time_interleaved(
    entries: list[tuple[str, Callable[[], Any]]],
    *,
    warmup: int,
    repeats: int,
    min_time: float,
    on_progress: Callable[[str], None] | None = None,
) -> dict[str, Timing]:
    """Time every entry, interleaved: repeat ``r`` runs each entry once (starting at entry
    ``r`` of the list and wrapping, so no entry is always first), ``repeats`` times.

    Each entry's first call (compilation, tracing) is timed separately and never counted,
    then ``warmup`` untimed calls run; the last of these sets how many calls make up one
    repeat (enough for ``min_time`` seconds, so short calls are not timer noise). An
    entry that raises is dropped with its error.
    """
    results: dict[str, Timing] = {}
    live: list[tuple[str, Callable[[], Any]]] = []
    for key, fn in entries:
        timing = results[key] = Timing()
        try:
            start = time.perf_counter()
            fn()
            timing.compile_s = time.perf_counter() - start
            last = timing.compile_s
            for _ in range(warmup):
                start = time.perf_counter()
                fn()
                last = time.perf_counter() - start
        except Exception as err:  # reported, never fatal for the others
            timing.error = describe_error(err)
            continue
        timing.number = max(1, math.ceil(min_time / max(last, 1e-9)))
        live.append((key, fn))
        if on_progress:
            on_progress(f"warmed up {key}")
    for r in range(repeats):
        order = live[r % len(live) :] + live[: r % len(live)] if live else []
        for key, fn in order:
            timing = results[key]
            if timing.error:
                continue
            try:
                start = time.perf_counter()
                for _ in range(timing.number):
                    fn()
                timing.times.append((time.perf_counter() - start) / timing.number)
            except Exception as err:
                timing.error = describe_error(err)
    return results


def peak_matmul_gflops(
    matmul: Callable[[], Any], size: int, *, repeats: int, min_time: float = 0.2
) -> float:
    """GFLOP/s of the fastest repeat of a ``size x size`` square matmul callable
    (``2 * size**3`` FLOPs): the peak is the best the framework reached in this run, so
    the load of other processes lowers it as little as possible."""
    timing = time_interleaved([("mm", matmul)], warmup=1, repeats=repeats, min_time=min_time)["mm"]
    if timing.error:
        raise RuntimeError(timing.error)
    return 2 * size**3 / min(timing.times) / 1e9


def machine_info() -> dict[str, Any]:
    """The machine the benchmark runs on: platform, CPU model and instruction sets
    (`multiattn.tuning.cpu_info`: ``cpu_isa`` the vector and matrix extensions that decide
    which kernels the libraries can use, ``cpu_flags`` every flag), usable cores, memory
    and Python."""
    import platform

    from ..tuning import cpu_info

    cpu = cpu_info()
    mem = None
    try:
        with open("/proc/meminfo") as fh:
            mem = int(fh.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu["model"],
        "cpu_isa": cpu["isa"],
        "cpu_flags": cpu["flags"],
        "cores": cpu["cores"],
        "memory_gib": None if mem is None else round(mem / 2**30, 1),
        **memory_setup(),
        "python": platform.python_version(),
    }


#: Environment variables that change how the C allocator (glibc) or PyTorch's CPU
#: allocator take memory from the kernel; the benchmark records those set.
MALLOC_ENV = ("GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE", "LD_PRELOAD")


def memory_setup() -> dict[str, Any]:
    """How fresh memory reaches the processes: the kernel's transparent huge page mode
    (``transparent_hugepages``: ``always``, ``madvise`` or ``never``; None where Linux
    does not say) and the allocator variables of `MALLOC_ENV` that are set
    (``malloc_env``). A buffer the allocator maps anew on every call costs a page fault
    per page it touches (4 KiB, or 2 MiB with huge pages)."""
    mode = None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            text = fh.read()
        mode = text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        pass
    return {
        "transparent_hugepages": mode,
        "malloc_env": {k: os.environ[k] for k in MALLOC_ENV if k in os.environ},
    }


def page_faults_per_call(fn: Callable[[], Any], runs: int = 3) -> float:
    """The median number of minor page faults of the process during one call of
    ``fn`` (``getrusage``: pages the kernel handed out and zeroed for it), over ``runs``
    calls."""
    counts = []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return float(statistics.median(counts))


def describe_memory(machine: dict[str, Any]) -> str:
    """``Memory: transparent huge pages madvise; allocator variables: none set``."""
    env = machine.get("malloc_env") or {}
    found = ", ".join(f"{k}={v}" for k, v in env.items()) or "none set"
    mode = machine.get("transparent_hugepages") or "unknown"
    return f"Memory: transparent huge pages {mode}; allocator variables: {found}"


def code_origin() -> dict[str, Any]:
    """Where the running ``multiattn`` and its adapters (``multiattn.backends``) come
    from, found without importing a framework: ``core`` and ``adapters`` (folders) and
    ``mixed`` (`trees_differ`). An editable install maps the adapters to its own
    checkout whatever ``PYTHONPATH`` puts first, so a run of another tree's core (a
    worktree of an older commit) would time the installed checkout's adapters with it."""
    import importlib.util
    from pathlib import Path

    core = Path(__file__).resolve().parents[1]
    spec = importlib.util.find_spec("multiattn.backends")
    places = list(spec.submodule_search_locations or []) if spec else []
    adapters = Path(places[0]).resolve() if places else None
    return {
        "core": str(core),
        "adapters": None if adapters is None else str(adapters),
        "mixed": adapters is not None and trees_differ(core, adapters),
    }


def trees_differ(core: Any, adapters: Any) -> bool:
    """Whether the adapters' folder is not that of the core's tree: ``multiattn/backends``
    inside the core (an installed wheel) or ``backends`` beside it (a checkout)."""
    return adapters.parent not in (core, core.parent)


def describe_code(code: dict[str, Any]) -> str | None:
    """A warning line where `code_origin` found two trees; None otherwise."""
    if not code.get("mixed"):
        return None
    return (
        f"note: multiattn runs from {code['core']} but its adapters (multiattn.backends) "
        f"from {code['adapters']}, another tree (an editable install's checkout): the "
        "Paddle rows time that tree's adapters with this tree's core"
    )


def describe_cpu(machine: dict[str, Any]) -> str:
    """``CPU: <model>, <n> cores; instruction sets: avx2 fma avx512f ...``."""
    isa = " ".join(machine.get("cpu_isa") or []) or "unknown (no /proc/cpuinfo flags)"
    model = machine.get("cpu") or "unknown"
    return f"CPU: {model}, {machine.get('cores')} cores; instruction sets: {isa}"

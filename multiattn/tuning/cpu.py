"""The running CPU: its model and instruction sets, read from ``/proc/cpuinfo``.

What `multiattn.tuning` records with a decision file (a choice timed on one CPU can lose
on another) and what the benchmark prints beside its tables. Imports no framework.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from typing import Any

#: The instruction-set flags of ``/proc/cpuinfo`` that `cpu_info` reports as ``isa``:
#: those that decide which kernels a BLAS, oneDNN or XLA can use (x86 vector and matrix
#: extensions, Arm's SIMD and scalable vectors).
ISA_FLAGS = (
    *("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni"),
    *("avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16"),
    *("amx_tile", "amx_bf16", "amx_int8", "amx_fp16"),
    *("asimd", "asimdhp", "bf16", "i8mm", "sve", "sve2"),
)


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
    return {"model": model, "flags": sorted(found), "isa": [f for f in ISA_FLAGS if f in found]}


@functools.cache
def _proc_cpuinfo() -> dict[str, Any]:
    try:
        with open("/proc/cpuinfo") as fh:
            info = parse_cpuinfo(fh.read())
    except OSError:
        info = parse_cpuinfo("")
    info["model"] = info["model"] or platform.processor() or platform.machine()
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

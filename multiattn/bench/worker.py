"""One framework's benchmark in its own process; writes its results as JSON.

    python -m multiattn.bench.worker --framework torch --config '{"batch": 8, ...}' --out F

The parent (`multiattn.bench.main`) sets ``KERAS_BACKEND`` for the process, starts one
worker per framework, one at a time, and turns the raw times into the report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from .. import tuning
from .common import (
    MIB,
    MODES,
    PeakRSS,
    describe_error,
    max_rss_bytes,
    page_faults_per_call,
    peak_matmul_gflops,
    summarize,
    time_interleaved,
)
from .impls import BUILDERS


def log(message: str) -> None:
    sys.stderr.write(f"[bench] {message}\n")
    sys.stderr.flush()


def peak_memory(fn: Any, probe: Any = None, runs: int = 2) -> tuple[int, str]:
    """Largest memory increase of ``fn()`` over ``runs`` calls, each measured from just
    before it: by default the RSS (after garbage collection and trimming the C heap),
    or the framework's ``probe`` (`multiattn.bench.impls.Framework.memory`)."""
    peak, method = 0, ""
    for _ in range(runs):
        with (probe or PeakRSS)() as mem:
            fn()
        peak, method = max(peak, mem.delta), mem.method
    return peak, method


def numpy_matmul(n: int) -> Any:
    a = np.random.default_rng(1).standard_normal((n, n)).astype("float32")
    return lambda: a @ a


def measure_matmuls(fw: Any, cfg: dict, matmul: dict[str, Any]) -> None:
    """Time every square matrix product of the framework (`Framework.matmul` and
    `Framework.other_matmuls`) into ``matmul``, keeping each route's best over the calls
    of this function (``samples`` keeps every measurement). The worker measures before
    and after the timed runs, so one slow moment of the machine lowers the peak as little
    as possible."""
    size = cfg["matmul_size"]
    routes = {"matmul": fw.matmul, **fw.other_matmuls}
    found = matmul.setdefault("routes", {})
    for name, factory in routes.items():
        try:
            assert factory is not None
            gflops = peak_matmul_gflops(factory(size), size, repeats=cfg["mm_repeats"])
        except Exception as err:
            matmul.setdefault("errors", {})[name] = describe_error(err)
            continue
        matmul.setdefault("samples", {}).setdefault(name, []).append(gflops)
        found[name] = max(gflops, found.get(name, 0.0))
    if found:
        matmul["route"] = max(found, key=found.__getitem__)
        matmul["gflops"] = found[matmul["route"]]
        matmul.pop("error", None)
    else:
        matmul["error"] = "; ".join(f"{k}: {v}" for k, v in matmul.get("errors", {}).items())


def run(framework: str, cfg: dict) -> dict[str, Any]:
    start = time.monotonic()
    x_np = (
        np.random.default_rng(cfg["seed"])
        .standard_normal((cfg["batch"], cfg["length"], cfg["width"]))
        .astype("float32")
    )
    log(f"{framework}: building")
    fw = BUILDERS[framework](cfg, x_np)
    log(f"{framework}: matmul peak")
    matmul: dict[str, Any] = {"size": cfg["matmul_size"], "dtype": cfg["dtype"]}
    measure_matmuls(fw, cfg, matmul)
    entries = [(f"{impl.id}/{mode}", impl.calls[mode]) for impl in fw.impls for mode in MODES]
    log(f"{framework}: timing {len(entries)} calls x {cfg['repeats']} repeats, interleaved")
    timings = time_interleaved(
        entries,
        warmup=cfg["warmup"],
        repeats=cfg["repeats"],
        min_time=cfg["min_time"],
        on_progress=log,
    )
    impls = []
    method = ""
    for impl in fw.impls:
        rec: dict[str, Any] = {"id": impl.id, "label": impl.label, "kind": impl.kind}
        errors = []
        for mode in MODES:
            timing = timings[f"{impl.id}/{mode}"]
            if timing.error or not timing.times:
                errors.append(f"{mode}: {timing.error or 'no times'}")
                continue
            peak, method = peak_memory(impl.calls[mode], fw.memory)
            rec[mode] = {
                **summarize(timing.times),
                "calls_per_repeat": timing.number,
                "first_call_s": timing.compile_s,
                "peak_mem_mib": peak / MIB,
                "page_faults_per_call": page_faults_per_call(impl.calls[mode]),
            }
        rec["status"] = "ok" if not errors else "failed"
        if errors:
            rec["reason"] = "failed: " + "; ".join(errors)
        impls.append(rec)
    impls += [{**s, "status": "skipped"} for s in fw.skipped]
    measure_matmuls(fw, cfg, matmul)
    matmul["numpy_float32_gflops"] = peak_matmul_gflops(
        numpy_matmul(cfg["matmul_size"]), cfg["matmul_size"], repeats=cfg["mm_repeats"]
    )
    return {
        "framework": framework,
        "status": "ran",
        "info": fw.info,
        # what multiattn's kernel choices measured in this process (multiattn.tuning)
        "kernel_choices": tuning.decisions(),
        "cpu_capability": tuning.cpu_info().get("torch_cpu_capability"),
        "implementations": impls,
        "matmul": matmul,
        "memory_method": method,
        "process_max_rss_mib": max_rss_bytes() / MIB,
        "seconds": time.monotonic() - start,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m multiattn.bench.worker")
    parser.add_argument("--framework", required=True, choices=sorted(BUILDERS))
    parser.add_argument("--config", required=True, help="JSON configuration")
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    args = parser.parse_args(argv)
    result = run(args.framework, json.loads(args.config))
    with open(args.out, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())

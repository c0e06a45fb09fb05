"""Long-sequence attention: time and peak memory of `multiattn.ops.scaled_dot_product_attention`.

Each length runs in a fresh process (so the RSS high-water mark is that length's own):

    python -m multiattn.bench.long --backend torch --length 4096 --out F [--causal] [--backward]

on ``(batch, heads, length, head_dim) = (1, 8, L, 64)`` float32 query, key and value,
forward (or, with ``--backward``, forward and the gradients of the output's sum with
respect to query, key and value), along three paths (``--path``):

* ``auto``: the default dispatch (blockwise once the score matrix exceeds the attention
  memory budget, unless the backend's fused kernel streams, as torch's does);
* ``blockwise``: the core's blockwise path forced at every length, with the blocks the
  budget would choose;
* ``direct``: the budget lifted, so the fused or explicit path runs at every length
  whose score matrix fits ``--long-max-gib``.

The parent (`run_long`) starts one process per length and path and watches its
memory: a length whose full score matrix would not fit in ``--long-max-gib`` is stopped
when its RSS grows past the budget and reported as "failed: out of memory".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import tuning
from .._system import available_memory
from .common import MIB, describe_error, hwm_bytes, reset_hwm, rss_bytes, summarize, trim_heap

BATCH, HEADS, HEAD_DIM = 1, 8, 64
GIB = 2**30
OOM = "failed: out of memory"
_OOM_WORDS = ("out of memory", "resource_exhausted", "resource exhausted", "can't allocate")
_OOM_WORDS += ("cannot allocate", "failed to allocate", "bad_alloc", "oom")


def score_matrix_bytes(length: int) -> int:
    """Bytes of the full float32 score matrix ``(1, 8, L, L)``."""
    return BATCH * HEADS * length * length * 4


def long_flops(length: int, backward: bool = False) -> int:
    """FLOPs of the scores and the weighted sum (``2 * 2*B*H*L*L*D``), counted in full
    also when causal (the work a kernel that skips masked blocks avoids is not subtracted);
    with ``backward`` three times that (the convention of the main benchmark: the
    backward pass as two forward passes, recomputation not counted)."""
    return (3 if backward else 1) * 2 * 2 * BATCH * HEADS * length * length * HEAD_DIM


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    text = str(err).lower()
    return any(word in text for word in _OOM_WORDS)


def _attention_call(
    backend: str, length: int, causal: bool, path: str, backward: bool = False
) -> Callable[[], Any]:
    """The public op on the backend's arrays, compiled the way the backend is used.

    ``path``: "auto", "blockwise" or "direct" (see the module's docstring); ``backward``:
    the call also computes the gradients of the output's sum with respect to query, key
    and value.
    """
    import keras

    from multiattn import config, ops
    from multiattn.ops import blockwise

    blocks = None
    if path == "direct":
        config.set_attention_memory_budget(2**62)
    elif path == "blockwise":
        traced = backend in ("jax", "tensorflow")
        limit = blockwise.MAX_QUERY_BLOCKS if traced else None
        budget = config.get_attention_memory_budget()
        blocks = blockwise.choose_blocks(BATCH * HEADS, length, length, 4, budget, limit)

    rng = np.random.default_rng(0)
    shape = (BATCH, HEADS, length, HEAD_DIM)
    q, k, v = (
        keras.ops.convert_to_tensor(rng.standard_normal(shape, dtype="float32")) for _ in range(3)
    )

    def sdpa(q, k, v):
        return ops.scaled_dot_product_attention(q, k, v, causal=causal, block_size=blocks)

    if backward and backend == "numpy":
        raise ValueError("--backward: the numpy backend computes no gradients")
    if backend == "jax":
        import jax

        if backward:
            fn = jax.jit(jax.grad(lambda *a: keras.ops.sum(sdpa(*a)), argnums=(0, 1, 2)))
        else:
            fn = jax.jit(sdpa)
        return lambda: jax.block_until_ready(fn(q, k, v))
    if backend == "tensorflow":
        import tensorflow as tf

        def grads(*a):
            with tf.GradientTape() as tape:
                tape.watch(a)
                total = tf.reduce_sum(sdpa(*a))
            return tape.gradient(total, a)

        fn = tf.function(grads if backward else sdpa)
        return lambda: fn(q, k, v)
    if backend == "torch":
        import torch

        if backward:
            leaves = [t.requires_grad_(True) for t in (q, k, v)]
            return lambda: torch.autograd.grad(sdpa(*leaves).sum(), leaves)

        def call() -> Any:
            with torch.no_grad():
                return sdpa(q, k, v)

        return call
    return lambda: sdpa(q, k, v)


def worker(
    backend: str,
    length: int,
    causal: bool,
    warmup: int,
    repeats: int,
    path: str = "auto",
    backward: bool = False,
) -> dict:
    result: dict[str, Any] = {"length": length, "path": path}
    try:
        call = _attention_call(backend, length, causal, path, backward)
    except Exception as err:
        return {**result, "status": "failed", "reason": "failed: " + describe_error(err)}
    trim_heap()
    base = rss_bytes()
    hwm_reset = reset_hwm()
    # Tell the parent the baseline: it stops this process if the RSS grows past the budget.
    sys.stdout.write(f"BASELINE {base or 0}\n")
    sys.stdout.flush()
    times = []
    try:
        start = time.perf_counter()
        call()
        result["first_call_s"] = time.perf_counter() - start
        for _ in range(warmup):
            call()
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    except Exception as err:
        reason = OOM if is_out_of_memory(err) else "failed: " + describe_error(err)
        return {**result, "status": "failed", "reason": reason}
    peak = None
    if hwm_reset and base is not None:
        peak = max(0, (hwm_bytes() or 0) - base)
    return {
        **result,
        "status": "ok",
        **summarize(times),
        "kernel_choices": tuning.decisions(),
        "baseline_mib": None if base is None else base / MIB,
        "peak_mem_mib": None if peak is None else peak / MIB,
    }


def _run_one(
    backend: str,
    length: int,
    cfg: dict,
    limit: int | None,
    on_line: Callable[[str], None],
    path: str = "auto",
) -> dict:
    """One length in a fresh process; ``limit``: bytes of RSS growth above the child's
    baseline after which it is killed (None: no limit)."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "multiattn.bench.long", "--backend", backend]
        cmd += ["--length", str(length), "--out", out]
        cmd += ["--warmup", str(cfg["warmup"]), "--repeats", str(cfg["repeats"])]
        cmd += ["--path", path] + (["--causal"] if cfg["causal"] else [])
        cmd += ["--backward"] if cfg.get("backward") else []
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        state: dict[str, Any] = {"base": None, "killed": False, "peak_seen": 0}
        err_chunks: list[str] = []

        def read_stdout() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("BASELINE "):
                    state["base"] = int(line.split()[1])
                    on_line(f"L={length} {path}: running")

        def read_stderr() -> None:
            assert proc.stderr is not None
            err_chunks.append(proc.stderr.read())

        readers = [threading.Thread(target=f, daemon=True) for f in (read_stdout, read_stderr)]
        for t in readers:
            t.start()
        while proc.poll() is None:
            if limit is not None and state["base"] is not None:
                rss = rss_bytes(proc.pid)
                if rss is not None:
                    state["peak_seen"] = max(state["peak_seen"], rss - state["base"])
                    if rss - state["base"] > limit:
                        state["killed"] = True
                        proc.send_signal(signal.SIGKILL)
                        break
            time.sleep(0.005)
        proc.wait()
        for t in readers:
            t.join()
        if state["killed"]:
            return {
                "length": length,
                "status": "failed",
                "reason": f"{OOM} (RSS grew past --long-max-gib = {limit / GIB:g} GiB)",
            }
        if proc.returncode == -signal.SIGKILL:
            return {"length": length, "status": "failed", "reason": f"{OOM} (killed by the OS)"}
        if proc.returncode != 0 or not os.path.exists(out):
            tail = " | ".join("".join(err_chunks).strip().splitlines()[-3:])
            if is_out_of_memory(RuntimeError(tail)):
                return {"length": length, "status": "failed", "reason": OOM}
            reason = f"failed: exit code {proc.returncode}: {tail}"
            return {"length": length, "status": "failed", "reason": reason}
        with open(out) as fh:
            return json.load(fh)


def _add_gflops(entry: dict, backward: bool) -> None:
    """``entry["gflops"]`` from its median time, for a length that ran."""
    if entry.get("status") == "ok":
        flops = long_flops(entry["length"], backward)
        entry["gflops"] = flops / (entry["median_ms"] / 1e3) / 1e9


def run_long(cfg: dict, on_line: Callable[[str], None] = lambda s: None) -> dict:
    """Every length of ``cfg["lengths"]`` in its own process; the ``long`` section of the
    report.

    Lengths whose full score matrix exceeds ``cfg["max_gib"]`` run too (a memory-efficient
    path may fit them) but are stopped once their RSS grows past that budget; every
    length is also stopped at 80% of the memory available when the run starts, so the
    machine never runs out. Once a length ran out of memory, longer ones are skipped.
    """
    backend, max_bytes = cfg["backend"], int(cfg["max_gib"] * GIB)
    backward = bool(cfg.get("backward"))
    available = available_memory()
    safety = None if available is None else int(0.8 * available)
    results = []
    out_of_memory = None
    for length in cfg["lengths"]:
        scores = score_matrix_bytes(length)
        entry: dict[str, Any]
        if out_of_memory is not None:
            entry = {
                "length": length,
                "status": "skipped",
                "reason": f"skipped: length {out_of_memory} ran out of memory",
            }
        else:
            limit = max_bytes if scores > max_bytes else safety
            if safety is not None and limit is not None:
                limit = min(limit, safety)
            on_line(f"L={length}: starting")
            entry = _run_one(backend, length, cfg, limit, on_line)
            if entry["status"] == "failed" and entry["reason"].startswith(OOM):
                out_of_memory = length
        entry["score_matrix_gib"] = scores / GIB
        entry["over_budget"] = scores > max_bytes
        _add_gflops(entry, backward)
        results.append(entry)
    extra: dict[str, list] = {}
    for path in ("blockwise", "direct"):
        extra[path] = []
        for length in cfg["lengths"]:
            if path == "direct" and score_matrix_bytes(length) > max_bytes:
                reason = "skipped: the score matrix alone exceeds --long-max-gib"
                extra[path].append(
                    {"length": length, "path": path, "status": "skipped", "reason": reason}
                )
                continue
            on_line(f"L={length} {path}: starting")
            entry = _run_one(backend, length, cfg, safety, on_line, path=path)
            _add_gflops(entry, backward)
            extra[path].append(entry)
    return {
        "backend": backend,
        "causal": cfg["causal"],
        "backward": backward,
        "shape": {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32"},
        "max_gib": cfg["max_gib"],
        "warmup": cfg["warmup"],
        "repeats": cfg["repeats"],
        "memory": (
            "peak RSS of the length's own process above its RSS just before the first "
            "attention call (inputs created; compilation on jax/tensorflow included)"
        ),
        "results": results,
        "blockwise_results": extra["blockwise"],
        "direct_results": extra["direct"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m multiattn.bench.long")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--path", choices=("auto", "blockwise", "direct"), default="auto")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", args.backend)
    result = worker(
        args.backend,
        args.length,
        args.causal,
        args.warmup,
        args.repeats,
        args.path,
        args.backward,
    )
    with open(args.out, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())

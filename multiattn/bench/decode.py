"""``multiattn bench --decode``: greedy decoding through the KV cache, side by side with
transformers' ``generate``.

Two model shapes, made by transformers with random weights and saved to a temporary
folder: a GPT-2-shaped one (learned positions, LayerNorm, GELU) and a Llama-shaped one
(RMSNorm, SwiGLU, rotary positions, grouped-query attention with 2 key/value heads), of
the sizes `SIZES` gives (``--decode-size``: ``small``, width 256 and 4 layers, or
``real``, GPT-2 small and Qwen2-0.5B). With ``--autotune`` every case also runs a second
multiattn model whose calls are under ``settings(autotune=True)``, side by side with the
defaults (``multiattn-autotuned``), and each ``--decode-with NAME=VALUE`` one more under
those settings (``multiattn[NAME=VALUE]``): paired runs of a strategy against the default. Each framework runs in a process of its own
(``python -m multiattn.bench.decode --worker``): it loads the folders with
`multiattn.models.from_pretrained` (on Paddle, ``framework="paddle"``) and times
``model.generate`` (greedy) for every prompt length and batch, and times transformers'
``generate`` (torch) on the same inputs in the same process, repeat by repeat beside
multiattn's: each framework's ratio is to the transformers rate measured beside it, so
that a machine whose speed drifts between the processes moves both sides of a ratio.

Per case: **prefill ms** is the median time of ``generate(max_new_tokens=1)`` (the prompt
through the cache, and one token); **tokens/s** is ``batch * (new_tokens - 1)`` over the
median, across repeats, of ``generate(max_new_tokens=new_tokens)``'s time minus that of
the ``generate(max_new_tokens=1)`` run just before it: the rate of the steps after the
prompt, each difference taken from two runs next to each other in time, so that a slow
spell of the machine moves both (None, printed ``noise``, where that median is not
positive). Timing runs each case once untimed first (compilation on jax and tensorflow,
the recording of the step on torch). The repeats of transformers and of multiattn
alternate.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

FRAMEWORKS = ("jax", "torch", "tensorflow", "paddle")
MODELS = ("gpt2", "llama", "qwen2", "llama1b")
#: ``--decode-models``' default per ``--decode-size``.
DEFAULT_MODELS = {"small": ("gpt2", "llama"), "real": ("gpt2", "qwen2", "llama1b")}
#: Each model's transformers config class and the dtype its checkpoint is saved in.
KINDS = {
    "gpt2": ("GPT2Config", "float32"),
    "llama": ("LlamaConfig", "float32"),
    "qwen2": ("Qwen2Config", "bfloat16"),
    "llama1b": ("LlamaConfig", "bfloat16"),
}
#: Llama 3.2's rotary scaling (``rope_scaling`` of Llama-3.2-1B's config).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
#: ``--decode-size``: the models' shapes. ``small``: every model of width 256, 4 layers
#: (a step there is mostly Python and dispatch), in its dtype of `KINDS`. ``real``:
#: ``gpt2`` GPT-2 small (124 M parameters, float32); ``llama`` Qwen2-0.5B's shape as a
#: Llama model in float32 (grouped-query attention with 2 key/value heads for 14 query
#: heads, tied embeddings: 494 M parameters); ``qwen2`` Qwen2-0.5B (Qwen2 with the
#: projections' biases, bfloat16); ``llama1b`` Llama-3.2-1B (1.24 B parameters, 8
#: key/value heads for 32, tied embeddings, llama3 rotary scaling, bfloat16). At real
#: size a step is bound by the weights' memory traffic. ``max_position_embeddings``
#: (``n_positions``) is the real model's, or the run's length where that is longer.
SIZES = {
    "small": {
        "gpt2": {"vocab_size": 1000, "n_embd": 256, "n_layer": 4, "n_head": 8},
        "llama": {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 688,
                  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2},
        "qwen2": {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 688,
                  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                  "tie_word_embeddings": True},
        "llama1b": {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 688,
                    "num_hidden_layers": 4, "num_attention_heads": 8,
                    "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True,
                    "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE,
                    "max_position_embeddings": 131072},
    },
    "real": {
        "gpt2": {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
                 "n_positions": 1024},
        "llama": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                  "num_hidden_layers": 24, "num_attention_heads": 14,
                  "num_key_value_heads": 2, "tie_word_embeddings": True},
        "qwen2": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                  "num_hidden_layers": 24, "num_attention_heads": 14,
                  "num_key_value_heads": 2, "tie_word_embeddings": True,
                  "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                  "max_position_embeddings": 32768},
        "llama1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                    "num_hidden_layers": 16, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                    "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE,
                    "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
    },
}  # fmt: skip
#: Token ids of the prompts are drawn below this (inside every size's vocabulary).
VOCAB = 1000


def weight_bytes(model: Any) -> int:
    """The bytes of a torch model's parameters, each in its own dtype; a tensor shared by
    two modules (tied embeddings) counted once, as ``model.parameters()`` yields it once:
    the bytes one decoding step reads."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def make_model(folder: Path, name: str, max_positions: int, seed: int = 0,
               size: str = "small") -> dict[str, Any]:  # fmt: skip
    """Model ``name`` of `SIZES`' ``size``, made by transformers with random weights in
    its dtype of `KINDS` (built in that dtype: no float32 copy first) and saved to
    ``folder``; its dtype, parameter count and `weight_bytes`."""
    import torch
    import transformers

    config_class, dtype = KINDS[name]
    shape = dict(SIZES[size][name])
    positions = "n_positions" if name == "gpt2" else "max_position_embeddings"
    shape[positions] = max(shape.get(positions, 0), max_positions)
    config = getattr(transformers, config_class)(bos_token_id=0, eos_token_id=0, **shape)
    transformers.utils.logging.disable_progress_bar()  # the saves' "Writing model shards"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(folder)
    info = {"path": str(folder), "dtype": dtype, "parameters": model.num_parameters(),
            "weight_bytes": weight_bytes(model)}  # fmt: skip
    del model
    return info


def make_models(
    folder: Path, max_positions: int, seed: int = 0, size: str = "small",
    models: tuple[str, ...] | list[str] = ("gpt2", "llama"),
) -> dict[str, Path]:  # fmt: skip
    """The model folders (by default ``gpt2`` and ``llama``) of `SIZES`' ``size``, written
    by transformers with random weights, one model in memory at a time."""
    return {name: Path(make_model(folder / name, name, max_positions, seed, size)["path"])
            for name in models}  # fmt: skip


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 7,
                   threads: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The machine's memory read bandwidth: NumPy sums of an int64 array of ``nbytes``
    (much larger than a last-level cache), split over ``threads`` threads (default: the
    usable cores, as the frameworks decode on all of them; NumPy releases the GIL in
    sums), timed ``repeats`` times after one untimed pass; ``gb_per_s`` from the median.
    int64, whose additions NumPy vectorises, where a float32 sum (pairwise) is slower
    than memory on some CPUs."""
    from concurrent.futures import ThreadPoolExecutor

    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    data = np.ones(nbytes // 8, dtype=np.int64)
    parts = np.array_split(data, threads)
    with ThreadPoolExecutor(threads) as pool:

        def once() -> float:
            return _timed_s(lambda: list(pool.map(np.sum, parts)))

        once()
        times = [once() for _ in range(repeats)]
    return {"gb_per_s": nbytes / statistics.median(times) / 1e9, "bytes": nbytes,
            "threads": threads, "repeats": repeats, "seconds": times}  # fmt: skip


def bandwidth_bound(weight_bytes: int, gb_per_s: float, batch: int) -> float:
    """The tokens/s a decoding step could reach if reading the weights once per step (for
    the whole batch) at ``gb_per_s`` were all it cost: ``batch * gb_per_s * 1e9 /
    weight_bytes``. It leaves out the caches' bytes and the arithmetic, so at a batch
    above one it is an upper bound only."""
    return batch * gb_per_s * 1e9 / weight_bytes


def _timed_s(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _paired_ms(runs: dict, new: int, repeats: int) -> dict[str, tuple[float, float, float]]:
    """Per implementation, the medians (ms) of the prefill (``fn(1)``), of the whole
    (``fn(new)``) and of their difference: each repeat times the two of one
    implementation next to each other, then those of the next implementation."""
    pairs: dict[str, list] = {impl: [] for impl in runs}
    for _ in range(repeats):
        for impl, fn in runs.items():
            pairs[impl].append((_timed_s(lambda fn=fn: fn(1)), _timed_s(lambda fn=fn: fn(new))))
    out = {}
    for impl, timed in pairs.items():
        prefill, total = zip(*timed)
        steps = [t - p for p, t in timed]
        out[impl] = tuple(statistics.median(x) * 1e3 for x in (prefill, total, steps))
    return out


def _case(row: dict, framework: bool = False) -> tuple:
    """A row's case (model, prompt, batch), with its framework's process first."""
    case = (row["model"], row["prompt"], row["batch"])
    return (row["framework"], *case) if framework else case


def _inputs(prompt: int, batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, VOCAB, (batch, prompt)).astype(np.int64)


def _loaded(load) -> tuple[Any, dict[str, Any]]:
    """``load()``'s result and what loading cost: ``load_s`` seconds, ``rss_added`` the
    resident set size after it (garbage collected and the C heap trimmed, as before it)
    minus before it, ``peak_added`` the peak above before (`multiattn.bench.common.PeakRSS`:
    the kernel's high-water mark, reset at the start), ``peak_method`` how it was read."""
    from .common import PeakRSS, rss_bytes, trim_heap

    with PeakRSS() as peak:
        start = time.perf_counter()
        obj = load()
        seconds = time.perf_counter() - start
    trim_heap()
    after = rss_bytes()
    return obj, {
        "load_s": seconds, "rss_added": None if after is None else after - peak.base,
        "peak_added": peak.delta if peak.method != "ru_maxrss" else None,
        "peak_method": peak.method,
    }  # fmt: skip


def worker(framework: str, cfg: dict, folders: dict[str, str]) -> dict:
    """Load each model (multiattn's, then transformers' in the checkpoint's dtype), time
    each one's first ``generate``, then multiattn's ``generate`` and transformers' for
    every case, alternating; on Paddle the models are the Paddle twins
    (``framework="paddle"``). Everything the loads need is imported first, so that the
    memory a load adds is the model's."""
    if framework == "paddle":
        import multiattn.paddle  # noqa: F401 - Paddle before anything loads TensorFlow
    import keras
    import torch
    import transformers  # noqa: F401 - imported before the loads are measured

    from multiattn.models import from_pretrained  # noqa: F401 - likewise

    if framework == "torch":
        torch.set_grad_enabled(False)
    rows, loads = [], {}
    for name in cfg.get("models") or MODELS:
        if name in folders:
            loads[name] = _time_model(framework, name, folders[name], cfg, rows)
    from multiattn import tuning

    backend = "paddle" if framework == "paddle" else keras.backend.backend()
    return {"backend": backend, "rows": rows, "loads": loads, "decisions": tuning.decisions()}


def _time_model(framework: str, name: str, folder: str, cfg: dict, rows: list) -> dict:
    """Model ``name``'s loads and first calls (returned) and its cases' rows (appended to
    ``rows``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from multiattn import config
    from multiattn.models import from_pretrained

    new = cfg["new_tokens"]
    dtype = json.loads((Path(folder) / "config.json").read_text()).get("dtype") or "float32"
    kind = "paddle" if framework == "paddle" else None
    model, load = _loaded(lambda: from_pretrained(folder, framework=kind))
    hf, hf_load = _loaded(
        lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    )
    load.update({"dtype": dtype, "transformers": hf_load})
    runs = {"multiattn": _runner(model), "transformers": _transformers_runner(hf)}
    for label, scoped in twins(cfg).items():  # a model each: its compiled functions too
        runs[label] = _runner(from_pretrained(folder, framework=kind), config, scoped)
    first = _inputs(cfg["prompts"][0], cfg["batches"][0], cfg["seed"])
    load["first_call_s"] = _timed_s(lambda: runs["multiattn"](first, new))
    hf_load["first_call_s"] = _timed_s(lambda: runs["transformers"](first, new))
    for prompt, batch in ((p, b) for p in cfg["prompts"] for b in cfg["batches"]):
        ids = _inputs(prompt, batch, cfg["seed"])
        case = {impl: functools.partial(run, ids) for impl, run in runs.items()}
        for n in (1, new):  # compile and warm every shape first
            for fn in case.values():
                fn(n)
        for impl, (prefill, total, steps) in _paired_ms(case, new, cfg["repeats"]).items():
            rows.append({
                "model": name, "prompt": prompt, "batch": batch, "implementation": impl,
                "prefill_ms": prefill, "total_ms": total,
                # not positive: noise swamped the steps (None)
                "tokens_per_s": batch * (new - 1) / (steps / 1e3) if steps > 0 else None,
            })  # fmt: skip
    return load


def twins(cfg: dict) -> dict[str, dict[str, Any]]:
    """The extra multiattn rows of each case: label -> the `multiattn.config.settings`
    its calls run under (``--autotune``: ``multiattn-autotuned``; each ``--decode-with``
    NAME=VALUE[,NAME=VALUE]: ``multiattn[NAME=VALUE,...]``)."""
    out = {"multiattn-autotuned": {"autotune": True}} if cfg.get("autotune") else {}
    for scoped in cfg.get("with", []):
        out["multiattn[" + ",".join(f"{k}={v}" for k, v in scoped.items()) + "]"] = scoped
    return out


def _runner(model: Any, config: Any = None, scoped: dict | None = None):
    """multiattn's greedy ``generate`` of ``model`` on ids, each call under
    ``config.settings(**scoped)`` where ``scoped`` is given."""
    scope = functools.partial(config.settings, **scoped) if scoped else contextlib.nullcontext

    def run(ids: np.ndarray, n: int) -> Any:
        with scope():
            return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)

    return run


def _transformers_runner(hf: Any):
    import torch

    def run(ids: np.ndarray, n: int) -> Any:
        return hf.generate(torch.from_numpy(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)  # fmt: skip

    return run


def run_decode(cfg: dict, on_line) -> dict:
    """The machine's read bandwidth (`read_bandwidth`, before any model exists), every
    model made in turn, then a process per framework and model (so that each load's
    memory is measured in a process that has loaded nothing else); the report's
    ``decode`` section."""
    models = cfg.get("models") or DEFAULT_MODELS[cfg.get("size", "small")]
    out: dict[str, Any] = {"config": cfg, "frameworks": {}, "rows": [], "models": {}}
    on_line("measuring the read bandwidth")
    out["bandwidth"] = read_bandwidth(cfg.get("bandwidth_bytes", 1 << 30))
    with tempfile.TemporaryDirectory(prefix="multiattn-bench-decode-") as tmp:
        folders = {}
        for name in models:
            on_line(f"making {name}")
            out["models"][name] = make_model(
                Path(tmp) / name, name, max(cfg["prompts"]) + cfg["new_tokens"] + 8,
                cfg["seed"], cfg.get("size", "small"))  # fmt: skip
            folders[name] = out["models"][name].pop("path")
        for fw in cfg["frameworks"]:
            info: dict[str, Any] = {"status": "ran", "loads": {}, "decisions": [],
                                    "processes": {}}  # fmt: skip
            for name in models:
                on_line(f"{fw}: {name}")
                result = _run_worker(fw, {**cfg, "models": [name]}, folders, Path(tmp))
                info["processes"][name] = {k: result[k] for k in ("status", "reason")
                                           if k in result}  # fmt: skip
                if result["status"] != "ran" and info["status"] == "ran":
                    info.update(status=result["status"], reason=f"{name}: {result['reason']}")
                info["backend"] = result.get("backend", info.get("backend"))
                info["loads"].update(result.get("loads", {}))
                info["decisions"] += result.get("decisions", [])
                out["rows"] += [{"framework": fw, **r} for r in result.get("rows", [])]
            out["frameworks"][fw] = info
    return out


def _run_worker(framework: str, cfg: dict, folders: dict, tmp: Path) -> dict:
    result_path = tmp / f"{framework}.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("KERAS_BACKEND", None)
    if framework != "paddle":
        env["KERAS_BACKEND"] = framework
    cmd = [sys.executable, "-m", "multiattn.bench.decode", "--worker", framework,
           "--config", json.dumps(cfg), "--folders", json.dumps(folders),
           "--out", str(result_path)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=cfg["timeout"])  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"status": "hung", "reason": f"killed after {cfg['timeout']:g} s"}
    if proc.returncode != 0 or not result_path.exists():
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"status": "crashed", "reason": f"exit code {proc.returncode}: {tail}"}
    return {"status": "ran", **json.loads(result_path.read_text())}


def _gb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}" if seconds >= 1 else f"{seconds:.2f}"


def _bound(section: dict, row: dict) -> float | None:
    """The row's `bandwidth_bound` (None without the bandwidth or the model's bytes)."""
    info = section.get("models", {}).get(row["model"], {})
    bandwidth = section.get("bandwidth", {}).get("gb_per_s")
    if not info.get("weight_bytes") or not bandwidth:
        return None
    return bandwidth_bound(info["weight_bytes"], bandwidth, row["batch"])


def print_decode(section: dict, console: Any) -> None:
    """The bandwidth and each model's bytes, the loading table (load seconds, memory
    added, first call) and the decoding table (prefill, tokens/s, the ratio to
    transformers in the same process and the fraction of the bandwidth bound)."""
    from rich.table import Table

    cfg = section["config"]
    bw = section.get("bandwidth")
    if bw:
        console.print(
            f"Read bandwidth: {bw['gb_per_s']:.1f} GB/s (NumPy sums of {bw['bytes'] / 2**30:g}"
            f" GiB on {bw['threads']} threads, median of {bw['repeats']}); bound = batch x "
            "bandwidth / the weights' bytes (read once per step)", markup=False,
        )  # fmt: skip
    for name, info in section.get("models", {}).items():
        console.print(
            f"{name}: {info['parameters'] / 1e6:.0f} M parameters, {info['dtype']}, weights "
            f"{_gb(info['weight_bytes'])} GB (tied counted once)" + (
                f", bound {bandwidth_bound(info['weight_bytes'], bw['gb_per_s'], 1):.1f} "
                "tokens/s at batch 1" if bw else ""), markup=False,
        )  # fmt: skip
    loads = Table(title="Loading (from_pretrained) and the first generate after it; "
                  "transformers' (hf) in the same process")  # fmt: skip
    for col in ("model", "framework", "dtype", "load s", "added GB", "x weights",
                "peak added GB", "first call s", "hf load s", "hf added GB",
                "hf first call s"):  # fmt: skip
        loads.add_column(col, justify="left" if col in ("model", "framework", "dtype")
                         else "right")  # fmt: skip
    for fw, info in section["frameworks"].items():
        for name, load in info.get("loads", {}).items():
            weights = section.get("models", {}).get(name, {}).get("weight_bytes")
            added, hf = load.get("rss_added"), load.get("transformers", {})
            loads.add_row(
                name, fw, str(load.get("dtype")), _s(load.get("load_s")), _gb(added),
                f"{added / weights:.2f}" if added is not None and weights else "-",
                _gb(load.get("peak_added")), _s(load.get("first_call_s")),
                _s(hf.get("load_s")), _gb(hf.get("rss_added")), _s(hf.get("first_call_s")),
            )  # fmt: skip
    if loads.row_count:
        console.print(loads)
    table = Table(
        title=f"Greedy decoding, {cfg['new_tokens']} new tokens (median of {cfg['repeats']})"
    )
    for col in ("model", "prompt", "batch", "framework", "implementation", "prefill ms",
                "tokens/s", "x transformers", "x bound"):  # fmt: skip
        table.add_column(col, justify="right" if col not in ("model", "framework") else "left")
    hf = {_case(r, framework=True): r["tokens_per_s"] for r in section["rows"]
          if r["implementation"] == "transformers"}  # fmt: skip
    for r in sorted(section["rows"], key=_case):
        base, rate, bound = hf.get(_case(r, framework=True)), r["tokens_per_s"], _bound(section, r)
        table.add_row(
            r["model"], str(r["prompt"]), str(r["batch"]), r["framework"], r["implementation"],
            f"{r['prefill_ms']:.1f}", "noise" if rate is None else f"{rate:.0f}",
            f"{rate / base:.2f}" if base and rate is not None else "",
            f"{rate / bound:.2f}" if bound and rate is not None else "",
        )  # fmt: skip
    console.print(table)
    for fw, info in section["frameworks"].items():
        if info.get("status") != "ran":
            console.print(f"{fw}: {info.get('status')} ({info.get('reason', '')})")


def write_decode_plot(section: dict, path: Path) -> None:
    """Two panels, one bar group per case: tokens/s of multiattn per framework beside
    transformers' (the median of its rates in the frameworks' processes), and each
    framework's ratio to the transformers rate of its own process, with the targets' 1x
    and 3x drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in section["rows"] if r["tokens_per_s"] is not None]
    cases = sorted({_case(r) for r in section["rows"]})
    ours = {_case(r, framework=True): r["tokens_per_s"] for r in rows
            if r["implementation"] == "multiattn"}  # fmt: skip
    hf = {_case(r, framework=True): r["tokens_per_s"] for r in rows
          if r["implementation"] == "transformers"}  # fmt: skip
    frameworks = sorted({r["framework"] for r in section["rows"]})
    fig, (rate_ax, ratio_ax) = plt.subplots(2, 1, figsize=(max(6, 1.6 * len(cases)) + 3, 7))
    width = 0.8 / (len(frameworks) + 1)
    x = np.arange(len(cases))
    for i, fw in enumerate(frameworks):
        rate_ax.bar(x + i * width, [ours.get((fw, *c), 0.0) for c in cases], width,
                    label=f"multiattn ({fw})")  # fmt: skip
        ratio_ax.bar(x + i * width, [ours[(fw, *c)] / hf[(fw, *c)]
                                     if (fw, *c) in ours and hf.get((fw, *c)) else 0.0
                                     for c in cases], width, label=fw)  # fmt: skip
    medians = [statistics.median([v for k, v in hf.items() if k[1:] == c] or [0.0])
               for c in cases]  # fmt: skip
    rate_ax.bar(x + len(frameworks) * width, medians, width,
                label="transformers (median of the processes)")  # fmt: skip
    for level in (1.0, 3.0):
        ratio_ax.axhline(level, color="grey", linestyle="--", linewidth=0.8)
    rate_ax.set_ylabel("new tokens / s")
    ratio_ax.set_ylabel("x transformers (same process)")
    for ax in (rate_ax, ratio_ax):
        ax.set_xticks(x + 0.4 - width / 2)
        ax.set_xticklabels([f"{m}\nprompt {p}, batch {b}" for m, p, b in cases], fontsize=8)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m multiattn.bench.decode")
    parser.add_argument("--worker", required=True, choices=FRAMEWORKS)
    parser.add_argument("--config", required=True)
    parser.add_argument("--folders", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = worker(args.worker, json.loads(args.config), json.loads(args.folders))
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

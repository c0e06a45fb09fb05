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
MODELS = ("gpt2", "llama")
#: ``--decode-size``: the two models' shapes. ``small``: both of width 256, 4 layers
#: (a step there is mostly Python and dispatch). ``real``: GPT-2 small (124 M parameters)
#: and Qwen2-0.5B's shape (a Llama-family model, grouped-query attention with 2
#: key/value heads for 14 query heads, tied embeddings: 494 M parameters), where a step
#: is bound by the weights' memory traffic.
SIZES = {
    "small": {
        "gpt2": {"vocab_size": 1000, "n_embd": 256, "n_layer": 4, "n_head": 8},
        "llama": {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 688,
                  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2},
    },
    "real": {
        "gpt2": {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12},
        "llama": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                  "num_hidden_layers": 24, "num_attention_heads": 14,
                  "num_key_value_heads": 2, "tie_word_embeddings": True},
    },
}  # fmt: skip
#: Token ids of the prompts are drawn below this (inside every size's vocabulary).
VOCAB = 1000


def make_models(
    folder: Path, max_positions: int, seed: int = 0, size: str = "small"
) -> dict[str, Path]:
    """The two model folders (``gpt2``, ``llama``) of `SIZES`' ``size``, written by
    transformers with random weights."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    shapes = SIZES[size]
    torch.manual_seed(seed)
    gpt2 = GPT2LMHeadModel(GPT2Config(
        n_positions=max_positions, bos_token_id=0, eos_token_id=0, **shapes["gpt2"]
    ))  # fmt: skip
    llama = LlamaForCausalLM(LlamaConfig(
        max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=0,
        **shapes["llama"],
    ))  # fmt: skip
    paths = {}
    for name, model in (("gpt2", gpt2), ("llama", llama)):
        paths[name] = folder / name
        model.save_pretrained(paths[name])
    del gpt2, llama
    return paths


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


def _cases(cfg: dict) -> list[tuple[str, int, int]]:
    models = cfg.get("models") or MODELS
    return [(m, p, b) for m in models for p in cfg["prompts"] for b in cfg["batches"]]


def _case(row: dict, framework: bool = False) -> tuple:
    """A row's case (model, prompt, batch), with its framework's process first."""
    case = (row["model"], row["prompt"], row["batch"])
    return (row["framework"], *case) if framework else case


def _inputs(prompt: int, batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, VOCAB, (batch, prompt)).astype(np.int64)


def worker(framework: str, cfg: dict, folders: dict[str, str]) -> dict:
    """Time multiattn's ``generate`` and transformers' for every case, alternating; on
    Paddle the models are the Paddle twins (``framework="paddle"``)."""
    if framework == "paddle":
        import multiattn.paddle  # noqa: F401 - Paddle before anything loads TensorFlow
    import keras

    from multiattn import config

    if framework == "torch":
        import torch

        torch.set_grad_enabled(False)
    new = cfg["new_tokens"]
    rows = []
    for name, prompt, batch in _cases(cfg):
        ids = _inputs(prompt, batch, cfg["seed"])
        runs = {"multiattn": _runner(framework, folders[name], ids)}
        for label, scoped in twins(cfg).items():  # a model each: its compiled functions too
            runs[label] = _runner(framework, folders[name], ids, config, scoped)
        runs["transformers"] = _transformers_runner(folders[name], ids)
        for n in (1, new):  # compile and warm every shape first
            for fn in runs.values():
                fn(n)
        for impl, (prefill, total, steps) in _paired_ms(runs, new, cfg["repeats"]).items():
            rows.append({
                "model": name, "prompt": prompt, "batch": batch, "implementation": impl,
                "prefill_ms": prefill, "total_ms": total,
                # not positive: noise swamped the steps (None)
                "tokens_per_s": batch * (new - 1) / (steps / 1e3) if steps > 0 else None,
            })  # fmt: skip
        del runs
    from multiattn import tuning

    backend = "paddle" if framework == "paddle" else keras.backend.backend()
    return {"backend": backend, "rows": rows, "decisions": tuning.decisions()}


def twins(cfg: dict) -> dict[str, dict[str, Any]]:
    """The extra multiattn rows of each case: label -> the `multiattn.config.settings`
    its calls run under (``--autotune``: ``multiattn-autotuned``; each ``--decode-with``
    NAME=VALUE[,NAME=VALUE]: ``multiattn[NAME=VALUE,...]``)."""
    out = {"multiattn-autotuned": {"autotune": True}} if cfg.get("autotune") else {}
    for scoped in cfg.get("with", []):
        out["multiattn[" + ",".join(f"{k}={v}" for k, v in scoped.items()) + "]"] = scoped
    return out


def _runner(framework: str, folder: str, ids: np.ndarray, config: Any = None,
            scoped: dict | None = None):  # fmt: skip
    """multiattn's greedy ``generate`` of the model in ``folder`` on ``ids``, each call
    under ``config.settings(**scoped)`` where ``scoped`` is given."""
    from multiattn.models import from_pretrained

    model = from_pretrained(folder, framework="paddle" if framework == "paddle" else None)
    scope = functools.partial(config.settings, **scoped) if scoped else contextlib.nullcontext

    def run(n: int) -> Any:
        with scope():
            return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)

    return run


def _transformers_runner(folder: str, ids: np.ndarray):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    tensor = torch.from_numpy(ids)

    def run(n: int) -> Any:
        return hf.generate(
            tensor, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )

    return run


def run_decode(cfg: dict, on_line) -> dict:
    """Every framework's process in turn; the report's ``decode`` section."""
    out: dict[str, Any] = {"config": cfg, "frameworks": {}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="multiattn-bench-decode-") as tmp:
        folders = make_models(Path(tmp), max(cfg["prompts"]) + cfg["new_tokens"] + 8,
                              size=cfg.get("size", "small"))  # fmt: skip
        for fw in cfg["frameworks"]:
            on_line(f"{fw}: generating")
            result = _run_worker(fw, cfg, {k: str(v) for k, v in folders.items()}, Path(tmp))
            out["frameworks"][fw] = {k: v for k, v in result.items() if k != "rows"}
            out["rows"] += [{"framework": fw, **r} for r in result.get("rows", [])]
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


def print_decode(section: dict, console: Any) -> None:
    from rich.table import Table

    cfg = section["config"]
    table = Table(
        title=f"Greedy decoding, {cfg['new_tokens']} new tokens (median of {cfg['repeats']})"
    )
    for col in ("model", "prompt", "batch", "framework", "implementation", "prefill ms",
                "tokens/s", "x transformers"):  # fmt: skip
        table.add_column(col, justify="right" if col not in ("model", "framework") else "left")
    hf = {_case(r, framework=True): r["tokens_per_s"] for r in section["rows"]
          if r["implementation"] == "transformers"}  # fmt: skip
    for r in sorted(section["rows"], key=_case):
        base, rate = hf.get(_case(r, framework=True)), r["tokens_per_s"]
        table.add_row(
            r["model"], str(r["prompt"]), str(r["batch"]), r["framework"], r["implementation"],
            f"{r['prefill_ms']:.1f}", "noise" if rate is None else f"{rate:.0f}",
            f"{rate / base:.2f}" if base and rate is not None else "",
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

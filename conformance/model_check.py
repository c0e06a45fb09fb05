"""``multiattn conformance --model DIR``: your own Hugging Face model folder, checked.

Loads ``DIR`` (``config.json`` and safetensors weights, as `multiattn.models.from_pretrained`
reads them) on every installed framework, one process each (Keras' backend is chosen once
per process), runs it on generated inputs and compares every output with the reference:
``transformers`` in float64 where it is installed, else the float64 run of the same
multiattn definition on NumPy. Prints the agreement table (largest absolute error, and
that error over the largest reference magnitude, per output and framework) and, for
models that generate, how many greedy tokens match the reference's; ``--json`` writes it.

Only the positions a real token occupies are compared (``attention_mask`` 1): what a
model computes at padding is not defined the same way everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .import_order import import_triton_first

#: Frameworks a model folder is tried on, in this order.
FRAMEWORKS = ("jax", "torch", "tensorflow", "numpy", "paddle")
#: Seconds one framework's process may run before it is killed and reported as hung.
DEFAULT_TIMEOUT = 600.0
#: The error a run may show against a reference computed exactly in float64 (relative to
#: the largest reference magnitude of the output) when its own arithmetic is that of the
#: dtype. `tolerance` adds what the reference itself computes in float32.
TOLERANCE = {"float32": 1e-4, "float64": 1e-9}
#: The spacing of float32 numbers at 1 (2**-23): one float32 step rounds a value by up to
#: half of it, relative.
FLOAT32_EPS = float(np.finfo(np.float32).eps)
#: How far a relative error made by one float32 step of the reference may grow before it
#: reaches an output: the step's own arithmetic (rounding its input, a sum over the hidden
#: size, an inverse square root or a cosine) is a few float32 steps, and the products
#: after it scale an error by their conditioning. Measured on the shipped family cases and
#: the tests' models: 1 to 2 float32 eps per step at the outputs.
GROWTH = 8
#: TensorFlow's exact GELU in float64 is off by up to 5.0e-9 (against ``math.erf`` over
#: [-6, 6]): one such error per feed-forward layer.
TENSORFLOW_FLOAT64_GELU = 5.1e-9


def float32_steps(config: dict, positions: int) -> list[tuple[int, str]]:
    """Where transformers computes in float32 inside a float64 model of ``config``, as
    ``(count, what)``: each rounds the activations it produces by about float32's eps
    (rotary angles by eps times the position, ``positions`` being the largest). T5's
    relative-position buckets are computed in float32 too, but they are integers: the same
    unless a logarithm lands within a float32 step of a bucket's edge. The reference runs
    transformers' default attention (SDPA), whose softmax stays in float64; its eager
    path would round that to float32 as well."""
    family, sizes = _sizes(config)
    layers = sizes["num_layers"]
    steps: list[tuple[int, str]] = []
    if family.model_type == "t5":
        norms = 2 * layers + 1 + 3 * sizes["num_decoder_layers"] + 1
        steps.append((norms, "RMS norm variances"))
    elif sizes.get("norm") == "rms":  # Llama, Qwen2, Mistral: the norm's input too
        steps.append((2 * layers + 1, "RMS norms"))
    if not sizes.get("learned_positions", True):  # rotary: the causal LMs but GPT-2
        steps.append((layers * (1 + positions), f"rotary angles (positions to {positions})"))
    return steps


def _sizes(config: dict) -> tuple[Any, dict]:
    from multiattn.hf.families import family_of

    family = family_of(config, "config.json")
    return family, family.read_sizes(config, "config.json")


def tolerance(config: dict, inputs: dict, dtype: str, framework: str, reference: str) -> dict:
    """The bound a ``framework`` run in ``dtype`` is held to against ``reference``
    (``"transformers"``: transformers in float64; ``"numpy"``: multiattn on Keras' NumPy
    backend asked for float64), and what it is made of: ``{"tolerance", "basis"}``. The
    bound follows what each side computes: its own dtype's `TOLERANCE` (float32's for
    Keras' NumPy backend, which computes float64 in float32), TensorFlow's float64 GELU,
    and the reference's float32 steps (`float32_steps`, times `GROWTH` float32 eps)."""
    parts: list[tuple[float, str]] = []
    if framework == "numpy" and dtype == "float64":
        parts.append((TOLERANCE["float32"], "float32 arithmetic (Keras' NumPy backend)"))
    else:
        parts.append((TOLERANCE[dtype], f"{dtype} arithmetic"))
    family, sizes = _sizes(config)
    if (
        framework == "tensorflow"
        and dtype == "float64"
        and family.fixed.get("hidden_act") == ("gelu",)
    ):  # BERT, ViT
        layers = sizes["num_layers"]
        parts.append((GROWTH * layers * TENSORFLOW_FLOAT64_GELU,
                      f"TensorFlow's float64 GELU in {layers} layer(s)"))  # fmt: skip
    if reference == "numpy":
        parts.append((TOLERANCE["float32"], "a reference in float32 arithmetic (Keras' NumPy)"))
    else:
        ids = [v for k, v in inputs.items() if k.endswith("input_ids")]
        positions = max((np.shape(v)[-1] for v in ids), default=1) - 1
        steps = float32_steps(config, positions)
        count = sum(n for n, _ in steps)
        if count:
            what = ", ".join(f"{n} {name}" for n, name in steps)
            parts.append((GROWTH * FLOAT32_EPS * count,
                          f"transformers' float32 steps: {GROWTH} eps32 x ({what})"))  # fmt: skip
    bound = sum(value for value, _ in parts)
    return {"tolerance": bound, "basis": " + ".join(f"{v:.1e} {text}" for v, text in parts)}


def _config(model: Path) -> dict:
    path = model / "config.json"
    if not path.is_file():
        raise SystemExit(f"--model {model}: no config.json in the folder.")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"--model {model}: config.json does not parse: {err}") from None
    if not isinstance(config, dict):
        raise SystemExit(f"--model {model}: config.json must hold a JSON object.")
    return config


def make_inputs(config: dict, inputs: tuple[str, ...], batch: int, length: int, seed: int):
    """Inputs for a model taking ``inputs`` (transformers' names): random token ids (the
    second row padded by two positions on the left for causal language models, on the
    right otherwise), token types, or images of the configured size."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    if "pixel_values" in inputs:
        size = config.get("image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        channels = config.get("num_channels", 3)
        out["pixel_values"] = rng.standard_normal((batch, channels, h, w))
        return out
    vocab = int(config["vocab_size"])
    out["input_ids"] = rng.integers(0, vocab, (batch, length)).astype(np.int64)
    if "attention_mask" in inputs:
        mask = np.ones((batch, length), np.int64)
        if batch > 1 and length > 2:
            if _causal_lm(config):
                mask[1, :2] = 0
            else:
                mask[1, -2:] = 0
        out["attention_mask"] = mask
    if "decoder_input_ids" in inputs:  # encoder-decoder: a decoder prefix of its own
        start = int(config.get("decoder_start_token_id") or 0)
        prefix = rng.integers(0, vocab, (batch, max(1, length // 2))).astype(np.int64)
        prefix[:, 0] = start
        out["decoder_input_ids"] = prefix
    if "token_type_ids" in inputs and config.get("type_vocab_size", 1) > 1:
        out["token_type_ids"] = rng.integers(0, 2, (batch, length)).astype(np.int64)
    return out


def _generative(config: dict) -> bool:
    """A language model with ``generate``: causal, or encoder-decoder (T5)."""
    return _causal_lm(config) or any(
        a.endswith("ForConditionalGeneration") for a in config.get("architectures") or ()
    )


def _causal_lm(config: dict) -> bool:
    return any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in
               config.get("architectures") or ())  # fmt: skip


# --- the worker: one framework, one process, any number of folders ------------------------


def _worker(args: argparse.Namespace) -> int:
    """Run each job of ``--jobs`` (a JSON list: ``model``, ``inputs``, ``out``, ``status``,
    ``tokens``) on one framework; write each one's outputs (or why not) to its files."""
    framework = args.framework
    # Paddle runs beside Keras' NumPy backend: TensorFlow (Keras' default) must not be
    # imported before Paddle in one process.
    os.environ["KERAS_BACKEND"] = "numpy" if framework == "paddle" else framework
    for job in json.loads(Path(args.jobs).read_text()):
        result = _run_job(framework, job, args.dtype)
        Path(job["status"]).write_text(json.dumps(result))
    return 0


def _run_job(framework: str, job: dict, dtype: str) -> dict:
    try:
        from multiattn.models import from_pretrained

        inputs = dict(np.load(job["inputs"]))
        model = from_pretrained(
            job["model"], framework="paddle" if framework == "paddle" else None, dtype=dtype
        )
        outputs = model(**inputs)
        arrays = {k: _to_numpy(v) for k, v in outputs.items()}
        if job["tokens"] and hasattr(model, "generate") and "input_ids" in inputs:
            ids = model.generate(
                inputs["input_ids"],
                attention_mask=inputs.get("attention_mask"),
                max_new_tokens=job["tokens"],
                do_sample=False,
            )
            arrays["generated_ids"] = np.asarray(ids)
        np.savez(job["out"], **arrays)
        return {"status": "ran"}
    except NotImplementedError as err:
        return {"status": "unsupported", "reason": str(err).splitlines()[0]}
    except Exception as err:  # reported in the table, not raised: other jobs go on
        return {"status": "error", "reason": f"{type(err).__name__}: {err}".splitlines()[0]}


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):
        try:
            return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x.numpy())
        except (TypeError, RuntimeError, AttributeError):
            pass
    return np.asarray(x)


# --- the reference --------------------------------------------------------------------------


def transformers_reference(model: Path, config: dict, inputs: dict, tokens: int) -> dict:
    """The outputs of ``transformers`` in float64 (its class named by the config's
    ``architectures``, else ``AutoModel``); raises ImportError without transformers.

    A causal language model runs each prompt of a left-padded batch alone, without its
    pads: transformers' Gemma 2 in float64 gives NaN at every position of a padded row
    (its padded queries are masked twice, to -inf), and alone a prompt's outputs at its
    real positions and its greedy tokens are those the padded batch must give. The pad
    positions of the outputs hold zeros; the tokens follow the row's pad ids as given."""
    import torch
    import transformers

    names = config.get("architectures") or []
    cls = next((getattr(transformers, n) for n in names if hasattr(transformers, n)), None)
    cls = cls or transformers.AutoModel
    hf = cls.from_pretrained(str(model), dtype=torch.float64).eval()
    if hasattr(hf, "set_experts_implementation"):  # grouped_mm has no float64 kernel
        hf.set_experts_implementation("eager")
    if _causal_lm(config) and "attention_mask" in inputs:
        return _per_prompt(torch, hf, config, inputs, tokens)
    feed = {k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()}
    if "pixel_values" in feed:
        feed["pixel_values"] = feed["pixel_values"].to(torch.float64)
    with torch.no_grad():
        out = hf(**feed)
        arrays = {k: v.numpy() for k, v in out.items() if isinstance(v, torch.Tensor)}
        if tokens and hasattr(hf, "generate") and _generative(config):
            arrays["generated_ids"] = _greedy(hf, config, feed, tokens).numpy()
    return arrays


def _greedy(hf: Any, config: dict, feed: dict, tokens: int) -> Any:
    """transformers' greedy tokens, ``tokens`` new ones: no end id, as multiattn's
    ``generate`` without ``eos_token_id`` (the config's is not read there), so that
    neither stops nor suppresses one (``min_new_tokens`` would)."""
    return hf.generate(
        **{k: feed[k] for k in ("input_ids", "attention_mask") if k in feed},
        max_new_tokens=tokens, do_sample=False, eos_token_id=None,
        pad_token_id=config.get("pad_token_id") or 0,
    )  # fmt: skip


def _per_prompt(torch: Any, hf: Any, config: dict, inputs: dict, tokens: int) -> dict:
    """`transformers_reference` of a causal LM: each left-padded prompt alone."""
    ids, mask = np.asarray(inputs["input_ids"]), np.asarray(inputs["attention_mask"], bool)
    rows: dict[str, list] = {}
    for row, keep in zip(ids, mask):
        pads = int(np.argmax(keep)) if keep.any() else len(keep)
        alone = torch.from_numpy(row[None, pads:])
        # the mask given: without one, transformers' generate masks every id equal to the
        # config's pad id (OPT's is 1), real tokens included
        feed = {"input_ids": alone, "attention_mask": torch.ones_like(alone)}
        with torch.no_grad():
            out = hf(**feed)
            for k, v in out.items():
                if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == len(row) - pads:
                    full = np.zeros((len(row), *v.shape[2:]))
                    full[pads:] = v.numpy()[0]
                    rows.setdefault(k, []).append(full)
            if tokens and hasattr(hf, "generate"):
                got = _greedy(hf, config, feed, tokens).numpy()[0]
                rows.setdefault("generated_ids", []).append(
                    np.concatenate([row[:pads].astype(got.dtype), got])
                )
    return {k: np.stack(v) for k, v in rows.items()}


# --- comparing ------------------------------------------------------------------------------


def compare(got: dict, want: dict, inputs: dict) -> dict[str, dict]:
    """Per output present in both: ``max_abs`` and ``relative`` (max_abs over the largest
    reference magnitude), over real-token positions; ``generated_ids``: the fraction of
    equal tokens."""
    mask = inputs.get("attention_mask")
    rows: dict[str, dict] = {}
    for name in sorted(set(got) & set(want)):
        a, b = np.asarray(got[name]), np.asarray(want[name])
        if a.shape != b.shape:
            rows[name] = {"shape": [list(a.shape), list(b.shape)], "agree": False}
            continue
        if name == "generated_ids":
            rows[name] = {"token_match": float(np.mean(a == b))}
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        if mask is not None and a.ndim >= 2 and a.shape[:2] == mask.shape:
            keep = mask.astype(bool)
            a, b = a[keep], b[keep]
        err = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        rows[name] = {"max_abs": err, "relative": err / scale if scale else err}
    return rows


def _run_worker(framework: str, jobs: list[dict], dtype: str, timeout: float, tmp: Path):
    """Run ``jobs`` (`_jobs`) in one process of ``framework``, its files in ``tmp``,
    killed after ``timeout`` seconds: ``name -> (result, arrays)``. A job the process did
    not finish is reported ``hung`` or ``crashed``; the finished ones keep their results."""
    jobs = [{**job, "out": str(tmp / f"{framework}-{job['name']}.npz"),
             "status": str(tmp / f"{framework}-{job['name']}.json")} for job in jobs]  # fmt: skip
    for job in jobs:
        Path(job["status"]).unlink(missing_ok=True)  # only this run's results count
    jobs_path = tmp / f"{framework}-jobs.json"
    jobs_path.write_text(json.dumps(jobs))
    env = dict(os.environ)
    env.pop("KERAS_BACKEND", None)
    if dtype == "float64":
        env["JAX_ENABLE_X64"] = "1"
    cmd = [sys.executable, "-m", "multiattn.conformance.model_check", "--worker",
           "--framework", framework, "--jobs", str(jobs_path), "--dtype", dtype]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=timeout)
        unfinished = _crashed(proc.returncode, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        unfinished = {"status": "hung", "reason": f"killed after {timeout:g}s (--timeout)"}
    return {job["name"]: _job_result(job, unfinished) for job in jobs}


def _crashed(returncode: int, err: bytes) -> dict:
    tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    return {"status": "crashed", "reason": f"exit {returncode}: {tail[0]}"}


def _job_result(job: dict, unfinished: dict) -> tuple[dict, dict]:
    status = Path(job["status"])
    if not status.is_file():
        return dict(unfinished), {}
    result = json.loads(status.read_text())
    arrays = dict(np.load(job["out"])) if result.get("status") == "ran" else {}
    return result, arrays


def _installed(framework: str) -> bool:
    import importlib.util

    module = {"tensorflow": "tensorflow", "numpy": "numpy"}.get(framework, framework)
    return importlib.util.find_spec(module) is not None


def check_model(args: argparse.Namespace) -> dict:
    """The whole check: the report as a dict (also what ``--json`` writes)."""
    config = _config(args.model)
    from multiattn.hf.families import family_of

    family = family_of(config, str(args.model))
    inputs = make_inputs(config, family.inputs, args.batch, args.length, args.seed)
    report: dict[str, Any] = {
        "model": str(args.model),
        "model_type": family.model_type,
        "dtype": args.dtype,
        "inputs": {k: list(v.shape) for k, v in inputs.items()},
        "frameworks": {},
    }
    case = {"name": "model", "model": args.model, "inputs": inputs, "tokens": args.tokens,
            "config": config, "reference": "transformers"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="multiattn-model-check-") as tmp:
        try:
            case["want"] = transformers_reference(args.model, config, inputs, args.tokens)
            report["reference"] = "transformers, float64"
        except ImportError:
            print("conformance --model: transformers is not installed (pip install "
                  "'multiattn[hf]'); the reference is multiattn on NumPy in float64, so the "
                  "frameworks are checked against each other, not against transformers.",
                  file=sys.stderr, flush=True)  # fmt: skip
            ref = Path(tmp) / "reference"
            jobs = _jobs([case], ref)
            result, case["want"] = _run_worker("numpy", jobs, "float64", args.timeout, ref)["model"]
            if result.get("status") != "ran":
                raise SystemExit(f"no reference: {result.get('reason')}") from None
            report["reference"] = "multiattn on NumPy, float64"
            case["reference"] = "numpy"
        rows = run_frameworks([case], args.frameworks, args.dtype, args.timeout, Path(tmp))
    report["frameworks"] = rows["model"]
    return report


def run_frameworks(
    cases: list[dict], frameworks: list[str], dtype: str, timeout: float, tmp: Path
) -> dict[str, dict[str, dict]]:
    """Each case (``name``, ``model`` folder, ``config``, ``inputs``, ``want``, ``tokens``,
    ``reference``: see `tolerance`) on each framework against its ``want``, one process
    per framework running every case (killed after ``timeout`` seconds): name ->
    framework -> result (``status``, ``outputs`` as `compare` gives them, ``agree``, and
    the bound applied: ``tolerance`` and its ``basis``)."""
    results: dict[str, dict[str, dict]] = {case["name"]: {} for case in cases}
    jobs = _jobs(cases, tmp)
    for framework in frameworks:
        if not _installed(framework):
            for rows in results.values():
                rows[framework] = {"status": "not installed"}
            continue
        ran = _run_worker(framework, jobs, dtype, timeout, tmp)
        for case in cases:
            result, got = ran[case["name"]]
            if result.get("status") == "ran":
                bound = tolerance(case["config"], case["inputs"], dtype, framework,
                                  case["reference"])  # fmt: skip
                result.update(bound)
                _judge(result, compare(got, case["want"], case["inputs"]), bound["tolerance"])
            results[case["name"]][framework] = result
    return results


def _jobs(cases: list[dict], folder: Path) -> list[dict]:
    """The worker's jobs for ``cases`` (``name``, ``model``, ``inputs``, ``tokens``), their
    inputs saved once under ``folder`` for every framework's run."""
    folder.mkdir(parents=True, exist_ok=True)
    jobs = []
    for case in cases:
        inputs_path = folder / f"{case['name']}-inputs.npz"
        np.savez(inputs_path, **case["inputs"])
        jobs.append({"name": case["name"], "model": str(case["model"]),
                     "inputs": str(inputs_path), "tokens": case["tokens"]})  # fmt: skip
    return jobs


def _judge(result: dict, rows: dict, tol: float) -> None:
    result["outputs"] = rows
    result["agree"] = all(
        r.get("relative", 0.0) <= tol and r.get("token_match", 1.0) == 1.0 and r.get("agree", True)
        for r in rows.values()
    )


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{report['model']} ({report['model_type']}, {report['dtype']}) against "
        f"{report['reference']}"
    )
    columns = ("framework", "status", "output", "max abs error", "relative", "bound", "tokens",
               "note")  # fmt: skip
    for col in columns:
        table.add_column(col, overflow="fold" if col == "note" else "ellipsis")
    for name, res in report["frameworks"].items():
        rows = res.get("outputs") or {"": {}}
        status = res["status"] if res["status"] != "ran" else (
            "agrees" if res.get("agree") else "DISAGREES")  # fmt: skip
        for i, (out, r) in enumerate(rows.items()):
            table.add_row(
                name if i == 0 else "",
                status if i == 0 else "",
                out,
                f"{r['max_abs']:.2e}" if "max_abs" in r else "",
                f"{r['relative']:.2e}" if "relative" in r else "",
                f"{res['tolerance']:.1e}" if "tolerance" in res and "relative" in r else "",
                f"{r['token_match']:.0%}" if "token_match" in r else "",
                first_line(res.get("reason", "")) if i == 0 else "",
            )
    console = Console(width=max(120, Console().width))
    console.print(table)
    for line in bound_lines({report["model"]: report["frameworks"]}):
        console.print(line, highlight=False, soft_wrap=True, markup=False)


def first_line(text: str) -> str:
    """The first line of a reason (the rest is in ``--json``)."""
    return (str(text).strip().splitlines() or [""])[0]


def bound_lines(results: dict[str, dict[str, dict]]) -> list[str]:
    """What the console says under a table of ``results`` (name -> framework -> result):
    the bound each comparison was held to and what it is made of (`tolerance`), frameworks
    with the same bound on one line, then the first line of each failure's reason."""
    lines = []
    for name, rows in results.items():
        by_basis: dict[str, list[str]] = {}
        for framework, res in rows.items():
            if "tolerance" in res:
                text = f"{res['tolerance']:.1e} ({res['basis']})"
                by_basis.setdefault(text, []).append(framework)
        for text, frameworks in by_basis.items():
            lines.append(f"bound for {name} on {', '.join(frameworks)}: {text}")
    for name, rows in results.items():
        for framework, res in rows.items():
            if res.get("agree") is False or res.get("status") in ("error", "crashed", "hung"):
                why = first_line(res.get("reason", "")) or _worst(res)
                lines.append(f"FAILED {name} on {framework}: {why}")
    return lines


def _worst(res: dict) -> str:
    """Why a comparison without a reason disagrees: its worst output."""
    bad = []
    for out, r in (res.get("outputs") or {}).items():
        if "shape" in r:
            bad.append(f"{out}: shape {r['shape'][0]}, expected {r['shape'][1]}")
        elif r.get("relative", 0.0) > res.get("tolerance", float("inf")):
            bad.append(f"{out}: relative error {r['relative']:.2e} > {res['tolerance']:.1e}")
        elif r.get("token_match", 1.0) < 1.0:
            bad.append(f"{out}: {r['token_match']:.0%} of the greedy tokens match")
    return "; ".join(bad) or "disagrees"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="multiattn conformance --model",
        description="Run a Hugging Face model folder on every installed framework and "
        "compare it with transformers in float64.",
    )
    p.add_argument("--model", type=Path, required=True, help="the model folder")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                   help=f"comma-separated subset of {','.join(FRAMEWORKS)}")  # fmt: skip
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=8, help="tokens per input row")
    p.add_argument("--tokens", type=int, default=8, help="greedy tokens to compare (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds per framework before it is killed")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="write the report as JSON")
    return p


def _worker_parser() -> argparse.ArgumentParser:
    """The internal worker's arguments (``--worker`` first)."""
    p = argparse.ArgumentParser(prog="multiattn.conformance.model_check --worker")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--framework", choices=FRAMEWORKS, required=True)
    p.add_argument("--jobs", required=True)
    p.add_argument("--dtype", choices=("float32", "float64"), required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when every framework that ran agrees, 1 otherwise."""
    argv = sys.argv[1:] if argv is None else argv
    # transformers (the reference, here) and a worker's framework may bring torch's triton
    # and TensorFlow into one process: triton first (see `import_order`)
    import_triton_first()
    if argv[:1] == ["--worker"]:
        return _worker(_worker_parser().parse_args(argv))
    parser = _parser()
    args = parser.parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown or not frameworks:
        parser.error(f"--frameworks: unknown {unknown or frameworks!r}; expected among "
                     f"{', '.join(FRAMEWORKS)}.")  # fmt: skip
    for name in ("batch", "length"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer; received {getattr(args, name)}")
    if args.tokens < 0:
        parser.error(f"--tokens must be 0 or more; received {args.tokens}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds; received {args.timeout}")
    if not args.model.is_dir():
        parser.error(f"--model {args.model}: not a folder")
    if args.json is not None and not os.access(args.json.parent.resolve(), os.W_OK):
        parser.error(f"--json {args.json}: its folder does not exist or is not writable")
    args.frameworks = frameworks
    from multiattn.hf.files import read_folder

    try:  # multiattn's own checks first: transformers opens whatever the folder names
        loaded = read_folder(args.model)
        for name in loaded.weights:  # each read once, one at a time: NaN and Inf refused
            loaded.weights[name]
    except (ValueError, TypeError) as err:
        print(f"conformance --model: {err}", file=sys.stderr)
        return 2
    context = loaded.sizes.get("max_positions")
    tokens = args.tokens if loaded.family.layer.endswith(":CausalLM") else 0  # generated
    if context is not None and args.length + tokens > context:
        parser.error(f"--length {args.length} and {tokens} generated tokens pass the model's "
                     f"context of {context} positions (max_position_embeddings)")  # fmt: skip
    report = check_model(args)
    _print(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    ran = [r for r in report["frameworks"].values() if r["status"] == "ran"]
    return 0 if ran and all(r.get("agree") for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())

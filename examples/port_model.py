"""Port a Hugging Face language model to every framework, generate, and bring it back.

    python examples/port_model.py                      # a tiny random Llama, made here
    python examples/port_model.py --model path/to/dir  # your causal-LM folder
    python examples/port_model.py --frameworks torch,paddle --max-new-tokens 30

For each framework (jax, torch, tensorflow on Keras, and paddle), in a process of its own
(Keras reads ``KERAS_BACKEND`` once; paddle must be imported before TensorFlow), the folder
is loaded with `multiattn.models.from_pretrained`, the prompt is continued greedily with
``generate`` through the KV cache, and the tokens are compared with transformers'
``generate`` on the same folder. Then, on Paddle, the model takes one training step
(Paddle autograd and optimizer on the ported parameters) and is written back with
``save_pretrained``: transformers loads that folder and computes the same logits as the
trained Paddle model.

With a tokenizer in the folder, the prompt is text and the continuations are decoded;
without one (the random model made here), the prompt is token ids. Nothing is downloaded.
Prints one table and a final ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

FRAMEWORKS = ("jax", "torch", "tensorflow", "paddle")
PROMPTS = ["The attention layer", "Frameworks agree"]


def make_tiny_llama(path: Path) -> Path:
    """A random Llama (grouped-query attention, RoPE) saved by transformers, offline."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: well-separated logits
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    model.eval().save_pretrained(path)
    return path


def prompt_ids(model: Path) -> tuple[np.ndarray, np.ndarray, object]:
    """``(ids, mask, tokenizer or None)``: a left-padded batch of two prompts."""
    try:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    except Exception:  # no tokenizer files: token ids
        tokenizer = None
    if tokenizer is not None:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        batch = tokenizer(PROMPTS, return_tensors="np", padding=True)
        return batch["input_ids"], batch["attention_mask"], tokenizer
    ids = np.array([[5, 17, 42, 8, 23, 61, 3], [0, 0, 0, 11, 29, 7, 50]])
    mask = (np.arange(7) >= np.array([[0], [3]])).astype(np.int64)
    return ids, mask, None


# -- one framework, in its own process ----------------------------------------------------


def worker(framework: str, model: str, inputs: str, out: str, tokens: int, train: bool) -> None:
    if framework == "paddle":
        import multiattn.paddle  # noqa: F401  (paddle first)
    else:
        os.environ["KERAS_BACKEND"] = framework
    from multiattn.models import from_pretrained

    data = np.load(inputs)
    ids, mask = data["input_ids"], data["attention_mask"]
    lm = from_pretrained(model, framework=framework)
    generated = lm.generate(ids, attention_mask=mask, max_new_tokens=tokens, pad_token_id=0)
    result = {"generated": generated}
    if train and framework == "paddle":
        result.update(paddle_training_step(lm, ids, mask, Path(out).with_suffix(".folder")))
    np.savez(out, **result)


def paddle_training_step(lm, ids, mask, folder: Path) -> dict:
    """One SGD step of next-token cross-entropy on the prompt, then ``save_pretrained``."""
    import paddle

    layer = lm.layer
    before = lm(input_ids=ids, attention_mask=mask)["logits"].numpy()
    layer.train()
    opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=layer.parameters())
    logits = lm(input_ids=ids, attention_mask=mask)["logits"]
    target = paddle.to_tensor(ids[:, 1:])
    loss = paddle.nn.functional.cross_entropy(logits[:, :-1], target, reduction="none")
    weight = paddle.to_tensor(mask[:, 1:], dtype=loss.dtype)
    loss = (loss.squeeze(-1) * weight).sum() / weight.sum()
    loss.backward()
    opt.step()
    layer.eval()
    lm.save_pretrained(folder)
    after = lm(input_ids=ids, attention_mask=mask)["logits"].numpy()
    change = np.abs(after - before).max() / np.abs(before).max()
    return {"trained_logits": after, "loss": np.float64(float(loss)), "change": change}


# -- the parent: transformers as the reference ----------------------------------------------


def run_framework(framework: str, model: Path, inputs: Path, tmp: Path, args) -> dict:
    out = tmp / f"{framework}.npz"
    cmd = [sys.executable, __file__, "--worker", framework, "--model", str(model),
           "--inputs", str(inputs), "--out", str(out), "--max-new-tokens",
           str(args.max_new_tokens)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1]}
    return dict(np.load(out))


def reference_tokens(model: Path, ids: np.ndarray, mask: np.ndarray, tokens: int) -> np.ndarray:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model).eval()
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                          do_sample=False, max_new_tokens=tokens, pad_token_id=0,
                          eos_token_id=None)  # fmt: skip
    return out.numpy()


def reference_logits(folder: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(positions)).logits.numpy()  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a causal-LM folder (default: a tiny random Llama)")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per framework")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--inputs", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, str(args.model), args.inputs, args.out, args.max_new_tokens, True)
        return 0
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown or args.max_new_tokens < 1:
        p.error(f"--frameworks takes {', '.join(FRAMEWORKS)}; --max-new-tokens >= 1")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = args.model or make_tiny_llama(tmp / "tiny-llama")
        ids, mask, tokenizer = prompt_ids(model)
        inputs = tmp / "inputs.npz"
        np.savez(inputs, input_ids=ids, attention_mask=mask)
        want = reference_tokens(model, ids, mask, args.max_new_tokens)
        report = {"model": str(args.model or "tiny random Llama"), "frameworks": {}}
        for framework in frameworks:
            got = run_framework(framework, model, inputs, tmp, args)
            row = {"error": got["error"]} if "error" in got else {
                "tokens_equal": bool(np.array_equal(got["generated"], want)),
                "continuation": _show(got["generated"][:, ids.shape[1]:], tokenizer),
            }  # fmt: skip
            if "trained_logits" in got:
                back = reference_logits(tmp / "paddle.folder", ids, mask)
                real = mask.astype(bool)
                diff = np.abs(back[real] - got["trained_logits"][real]).max()
                row["trained_on_paddle_back_in_transformers"] = float(diff / np.abs(back).max())
                row["training_changed_logits_by"] = float(got["change"])
            report["frameworks"][framework] = row
        _print(report, _show(want[:, ids.shape[1] :], tokenizer))
    ok = all(r.get("tokens_equal") for r in report["frameworks"].values())
    print("RESULT " + json.dumps(report))
    return 0 if ok else 1


def _show(tokens: np.ndarray, tokenizer) -> list[str]:
    if tokenizer is not None:
        return tokenizer.batch_decode(tokens, skip_special_tokens=True)
    return [" ".join(map(str, row)) for row in tokens.tolist()]


def _print(report: dict, reference: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['model']}: greedy continuation of a left-padded batch of two")
    for col in ("framework", "tokens = transformers", "first continuation", "note"):
        table.add_column(col)
    table.add_row("transformers", "-", reference[0], "torch, the reference")
    for name, row in report["frameworks"].items():
        if "error" in row:
            table.add_row(name, "error", "", row["error"])
            continue
        note = ""
        if "trained_on_paddle_back_in_transformers" in row:
            err = row["trained_on_paddle_back_in_transformers"]
            note = (
                f"1 SGD step on Paddle (logits moved {row['training_changed_logits_by']:.1e}),"
                f" saved, reloaded by transformers: logits rel. err {err:.1e}"
            )
        table.add_row(name, "yes" if row["tokens_equal"] else "NO", row["continuation"][0], note)
    Console(width=140).print(table)


if __name__ == "__main__":
    sys.exit(main())

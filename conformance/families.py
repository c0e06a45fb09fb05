"""Conformance cases per model family: ``multiattn conformance --families``.

Each shipped case (``fixtures_families/<name>/``) is a small random-init model made by
transformers and saved with ``save_pretrained`` (``config.json``, ``model.safetensors``),
with ``expected.npz``: the generated inputs (a batch of two, the second row padded) and
transformers' float64 outputs on them (``logits`` or ``last_hidden_state`` and
``pooler_output``; for language models 8 greedy tokens as ``generated_ids``). The check
runs every case on every installed framework through `multiattn.models.from_pretrained`
(the workers of `multiattn.conformance.model_check`, one process per framework) and
compares with the stored expectation, so it needs neither transformers nor torch.

``python -m multiattn.conformance.families --write`` remakes the cases (needs
transformers and torch); the digests of the shipped files are pinned in
``fixtures_families/manifest.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from . import model_check as mc

DIRECTORY = Path(__file__).resolve().parent / "fixtures_families"
VOCAB, CONTEXT, TOKENS = 48, 24, 8
_DECODER = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=24, max_position_embeddings=CONTEXT)  # fmt: skip
_LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8}  # fmt: skip

_ENCODER = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                intermediate_size=24, max_position_embeddings=CONTEXT + 2)  # fmt: skip

#: case name -> (transformers class name, config class name, config arguments)
CASES: dict[str, tuple[str, str, dict]] = {
    "bert": ("BertModel", "BertConfig", dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=24, max_position_embeddings=CONTEXT)),
    "vit": ("ViTModel", "ViTConfig", dict(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=24)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=4, n_positions=CONTEXT)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(**_DECODER, rope_scaling=_LLAMA3)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(_DECODER)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(**_DECODER, sliding_window=3)),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(
        vocab_size=VOCAB, d_model=16, d_kv=4, num_heads=4, num_layers=1, d_ff=24,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=VOCAB - 1)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(**_DECODER, head_dim=8)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(**_DECODER, head_dim=8)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        **{**_DECODER, "num_hidden_layers": 2}, head_dim=4, sliding_window=3,
        query_pre_attn_scalar=6, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        **{**_DECODER, "num_hidden_layers": 2}, head_dim=4, sliding_window=3,
        sliding_window_pattern=2, query_pre_attn_scalar=4, rope_local_base_freq=50.0)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        **_DECODER, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        **_DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
        shared_expert_intermediate_size=20)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        **_DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
        head_dim=8, norm_topk_prob=True)),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", dict(_ENCODER)),
    "xlm-roberta": ("XLMRobertaForMaskedLM", "XLMRobertaConfig", dict(_ENCODER)),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig", dict(
        vocab_size=VOCAB, dim=16, n_layers=1, n_heads=4, hidden_dim=24,
        max_position_embeddings=CONTEXT)),
    "albert": ("AlbertForMaskedLM", "AlbertConfig", dict(
        **_ENCODER, embedding_size=8, num_hidden_groups=1)),
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=24,
        decoder_ffn_dim=24, max_position_embeddings=CONTEXT, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=24, max_position_embeddings=CONTEXT, rotary_pct=0.5)),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(_DECODER)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(
        **_DECODER, pad_token_id=None, bos_token_id=1, eos_token_id=2)),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
        ffn_dim=24, max_position_embeddings=CONTEXT, do_layer_norm_before=False,
        word_embed_proj_dim=8)),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_kv_heads=2, new_decoder_architecture=True, ffn_hidden_size=24,
        max_position_embeddings=CONTEXT, bias=True)),
    "electra": ("ElectraForPreTraining", "ElectraConfig", dict(**_ENCODER, embedding_size=8)),
    "modernbert": ("ModernBertForMaskedLM", "ModernBertConfig", dict(
        **{**_ENCODER, "num_hidden_layers": 2}, local_attention=4, global_attn_every_n_layers=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)),
}  # fmt: skip


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def redraw(model: Any, seed: int = 0) -> Any:
    """A transformers model's parameters redrawn at a scale where greedy tokens are well
    separated (normalisation weights N(1, 0.1), everything else N(0, 0.3)); returns the
    model in eval mode. Used for the shipped cases and by the tests that build models."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            norm = "norm" in name.lower() or ".ln_" in name
            p.copy_(1.0 + 0.1 * noise if norm and name.endswith("weight") else 0.3 * noise)
    return model.eval()


def write(directory: Path = DIRECTORY) -> dict:
    """Make every case with transformers (weights redrawn at a scale where greedy tokens
    are well separated) and write it with its expectation and a manifest."""
    import torch
    import transformers

    manifest: dict[str, Any] = {"transformers": transformers.__version__, "files": {}}
    for name, (model_cls, config_cls, kwargs) in CASES.items():
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
        folder = directory / name
        redraw(model).save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        family = _family(config, folder)
        inputs = mc.make_inputs(config, family.inputs, 2, 6, 0)
        want = mc.transformers_reference(folder, config, inputs, TOKENS)
        keep = {k: v for k, v in want.items() if k in _OUTPUTS}
        np.savez(folder / "expected.npz", **{f"input/{k}": v for k, v in inputs.items()},
                 **{f"output/{k}": v for k, v in keep.items()})  # fmt: skip
        for f in sorted(folder.iterdir()):
            manifest["files"][f"{name}/{f.name}"] = _digest(f)
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


_OUTPUTS = ("logits", "last_hidden_state", "pooler_output", "encoder_last_hidden_state",
            "generated_ids")  # fmt: skip


def _family(config: dict, folder: Path) -> Any:
    from multiattn.hf.families import family_of

    return family_of(config, str(folder))


def verify(directory: Path = DIRECTORY) -> list[str]:
    """The shipped files whose digest differs from the manifest (empty: intact)."""
    manifest = json.loads((directory / "manifest.json").read_text())
    bad = [rel for rel, digest in manifest["files"].items()
           if not (directory / rel).is_file() or _digest(directory / rel) != digest]  # fmt: skip
    return bad


def load_expected(folder: Path) -> tuple[dict, dict]:
    """``(inputs, outputs)`` of a case's ``expected.npz``."""
    with np.load(folder / "expected.npz", allow_pickle=False) as archive:
        inputs = {k[6:]: archive[k] for k in archive.files if k.startswith("input/")}
        outputs = {k[7:]: archive[k] for k in archive.files if k.startswith("output/")}
    return inputs, outputs


def check(names: list[str], frameworks: list[str], dtype: str, timeout: float) -> dict:
    """Every case on every framework against its stored expectation: the report."""
    tampered = verify()
    report: dict[str, Any] = {"dtype": dtype, "tampered": tampered, "families": {}}
    cases = []
    for name in names:
        inputs, want = load_expected(DIRECTORY / name)
        config = json.loads((DIRECTORY / name / "config.json").read_text())
        cases.append({"name": name, "model": DIRECTORY / name, "inputs": inputs, "want": want,
                      "tokens": TOKENS if "generated_ids" in want else 0, "config": config,
                      "reference": "transformers"})  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="multiattn-families-") as tmp:
        report["families"] = mc.run_frameworks(cases, frameworks, dtype, timeout, Path(tmp))
    for case in cases:  # every stored output must have been compared
        for res in report["families"][case["name"]].values():
            missing = sorted(set(case["want"]) - set(res.get("outputs", case["want"])))
            if missing:
                res["agree"], res["reason"] = False, f"no {', '.join(missing)}"
    return report


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    frameworks = sorted({f for rows in report["families"].values() for f in rows},
                        key=mc.FRAMEWORKS.index)  # fmt: skip
    table = Table(title=f"model families against transformers in float64 (stored), "
                  f"{report['dtype']}: largest relative error / greedy tokens (bounds "
                  f"below)")  # fmt: skip
    table.add_column("family")
    for f in frameworks:
        table.add_column(f)
    for family, rows in report["families"].items():
        table.add_row(family, *(_cell(rows.get(f, {})) for f in frameworks))
    console = Console(width=max(120, Console().width))
    console.print(table)
    for line in mc.bound_lines(report["families"]):
        console.print(line, highlight=False, soft_wrap=True, markup=False)
    if report["tampered"]:
        print(f"TAMPERED fixture files: {', '.join(report['tampered'])}")


def _cell(res: dict) -> str:
    if res.get("status") != "ran":
        return res.get("status", "")
    rel = max((r.get("relative", 0.0) for r in res["outputs"].values()), default=0.0)
    tokens = [r["token_match"] for r in res["outputs"].values() if "token_match" in r]
    text = f"{rel:.1e}" + (f" / {tokens[0]:.0%}" if tokens else "")
    return text if res.get("agree") else f"FAIL {text}"


def passed(report: dict) -> bool:
    return not report["tampered"] and all(
        res.get("agree", res.get("status") == "not installed")
        for rows in report["families"].values()
        for res in rows.values()
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="multiattn conformance --families", description=__doc__)
    p.add_argument("--families", nargs="?", const=",".join(CASES), default=",".join(CASES),
                   help=f"comma-separated subset of {','.join(CASES)} (default: all)")  # fmt: skip
    p.add_argument("--frameworks", default=",".join(mc.FRAMEWORKS))
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--timeout", type=float, default=mc.DEFAULT_TIMEOUT)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--write", action="store_true", help="remake the cases (maintainers)")
    args = p.parse_args(argv)
    if args.write:
        write()
        return 0
    names = [n for n in args.families.split(",") if n]
    frameworks = [f for f in args.frameworks.split(",") if f]
    bad = [n for n in names if n not in CASES] + [f for f in frameworks if f not in mc.FRAMEWORKS]
    if bad or not names or not frameworks:
        p.error(f"unknown family or framework {bad}; families: {', '.join(CASES)}; "
                f"frameworks: {', '.join(mc.FRAMEWORKS)}")  # fmt: skip
    report = check(names, frameworks, args.dtype, args.timeout)
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    ok = passed(report)
    print("conformance --families: " + ("every family agrees on every framework that ran"
                                        if ok else "FAILED"))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

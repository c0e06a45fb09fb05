"""Tiny BART checkpoints for the BART tests (tests/backend/test_bart.py,
tests/paddle/test_bart.py): built offline from a config, parameters redrawn, saved with
transformers' ``save_pretrained``; the reference is transformers itself, reloaded from
the saved folder in float64 (so that it reads the folder's generation config)."""

from __future__ import annotations

import json

import numpy as np

VOCAB = 64
SIZES = {"vocab_size": VOCAB, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
         "encoder_attention_heads": 4, "decoder_attention_heads": 2, "encoder_ffn_dim": 48,
         "decoder_ffn_dim": 40, "max_position_embeddings": 40}  # fmt: skip
#: What transformers' generate reads from the folder's generation_config.json, added to
#: what save_pretrained writes (decoder_start_token_id 2, forced_eos_token_id 2):
#: the first new token forced to 0, as facebook/bart-large's generation config does.
GENERATION = {"forced_bos_token_id": 0}


def build_bart(path, base: bool = False, **config):
    """A ``BartForConditionalGeneration`` (``BartModel`` if ``base``) of `SIZES` and
    ``config``, redrawn (`multiattn.conformance.families.redraw`; the self-attention
    weights tripled and the cross-attention ones scaled by 0.3, so that greedy decoding
    does not repeat one token; a non-zero ``final_logits_bias``), saved to ``path`` with `GENERATION` in its generation
    config. Returns transformers' model reloaded from ``path`` in float64."""
    import torch
    import transformers
    from multiattn.conformance.families import redraw

    torch.manual_seed(0)
    cls = transformers.BartModel if base else transformers.BartForConditionalGeneration
    model = redraw(cls(transformers.BartConfig(**SIZES, **config)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and name.endswith("weight") and "norm" not in name:
                p.mul_(0.3 if "encoder_attn" in name else 3.0 if "self_attn" in name else 1.0)
        if not base:
            gen = torch.Generator().manual_seed(5)
            model.final_logits_bias.copy_(0.5 * torch.randn((1, VOCAB), generator=gen))
    model.save_pretrained(path)
    side = path / "generation_config.json"
    if side.exists():
        side.write_text(json.dumps({**json.loads(side.read_text()), **GENERATION}, indent=2))
    return cls.from_pretrained(path, dtype=torch.float64).eval()


def decoder_ids(length: int = 6) -> np.ndarray:
    """Two rows of decoder ids starting with the start token (2)."""
    ids = np.random.default_rng(2).integers(3, VOCAB, (2, length))
    ids[:, 0] = 2
    return ids

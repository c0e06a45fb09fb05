"""Shared by the beam search tests (tests/backend/test_beam_search.py and
tests/paddle/test_beam_search.py): the tiny transformers models, the prompts, the beam
settings and transformers' tokens for them.

The end ids come from transformers' own beam output: the new tokens it emits most often
without an end id, so that they fire for some beams. Every expected token comes from
transformers' ``generate(num_beams=k, do_sample=False, ...)`` on the float64 model.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

VOCAB, CONTEXT, NEW = 64, 40, 12
LLAMA = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
         "max_position_embeddings": CONTEXT}  # fmt: skip
T5 = {"vocab_size": VOCAB, "d_model": 32, "d_kv": 8, "num_heads": 4, "num_layers": 2,
      "num_decoder_layers": 2, "d_ff": 64, "decoder_start_token_id": 0,
      "feed_forward_proj": "gated-gelu"}  # fmt: skip

#: (num_beams, length_penalty, early_stopping, end ids, num_return_sequences); the end ids
#: "one" and "two" are transformers' most frequent new tokens (`end_ids`).
SETTINGS = [
    (2, 1.0, False, "one", 1),
    (3, 2.0, True, "one", 3),
    (3, 0.5, "never", "two", 2),
    (3, 1.0, False, "none", 1),
]


def makers(transformers) -> dict:
    """``case -> function making the transformers model``."""
    return {
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)),
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=CONTEXT)),
        "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(**T5)),
    }  # fmt: skip


def prompts(case: str) -> tuple:
    """A batch of two: left padded (decoder-only), right padded (T5's encoder)."""
    ids = np.random.default_rng(1).integers(2, VOCAB, (2, 9))
    mask = np.ones((2, 9), np.int64)
    pads = np.s_[:3] if case != "t5" else np.s_[6:]
    ids[1, pads], mask[1, pads] = 0, 0
    return ids, mask


def hf_generate(torch, hf, ids, mask, **options) -> np.ndarray:
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                          do_sample=False, max_new_tokens=NEW, **options)  # fmt: skip
    return out.numpy()


def end_ids(torch, hf, ids, mask, start: int) -> dict:
    """``"none" | "one" | "two" -> eos_token_id``: the new tokens transformers' beam
    search (3 beams, no end id) emits most often."""
    free = hf_generate(torch, hf, ids, mask, num_beams=3, eos_token_id=None, pad_token_id=5)
    common = [int(t) for t, _ in Counter(free[:, start:].ravel()).most_common(2)]
    return {"none": None, "one": common[0], "two": common}


def options(setting: tuple, ends: dict) -> dict:
    """``generate``'s keyword arguments of one of `SETTINGS` (pad id 5 unless noted)."""
    beams, penalty, early, eos, returned = setting
    return {"num_beams": beams, "length_penalty": penalty, "early_stopping": early,
            "eos_token_id": ends[eos], "pad_token_id": 5,
            "num_return_sequences": returned}  # fmt: skip


def ended_early(tokens: np.ndarray, eos, start: int) -> bool:
    """Whether some returned hypothesis holds an end id before its last column."""
    eos = [] if eos is None else np.atleast_1d(eos)
    return bool(np.isin(tokens[:, start:-1], eos).any())

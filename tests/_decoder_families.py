"""The cases of the decoder-only families of issues 49 (Qwen3, Gemma, Gemma 2, Gemma 3
text) and 50 (GPT-NeoX, Phi, Phi-3, OPT, Falcon), shared by tests/backend/test_decoder_families.py and
tests/paddle/test_decoder_families.py: tiny transformers configs (hidden 32, 2 layers
unless a layer pattern needs more, vocab 64) and transformers' float64 logits."""

from __future__ import annotations

import numpy as np

VOCAB, CONTEXT = 64, 40
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
         "max_position_embeddings": CONTEXT}  # fmt: skip
_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
_NEOX = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "intermediate_size": 48, "max_position_embeddings": CONTEXT,
         **_TOKENS}  # fmt: skip
_PHI = {**SIZES, **_TOKENS}
_PHI3 = {**SIZES, **_TOKENS}
_OPT = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "ffn_dim": 48, "max_position_embeddings": CONTEXT,
        **_TOKENS}  # fmt: skip
_FALCON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "ffn_hidden_size": 48,
           "max_position_embeddings": CONTEXT, **_TOKENS}  # fmt: skip
CONFIGS = {
    # head_dim 16 != hidden / heads, grouped-query attention, untied head
    "qwen3": ("Qwen3", {**SIZES, "head_dim": 16}),
    # biases on all four projections, tied head, linear rope scaling
    "qwen3-bias-tied": ("Qwen3", {**SIZES, "head_dim": 8, "attention_bias": True,
                                  "tie_word_embeddings": True, "rope_theta": 500.0,
                                  "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # (1 + w) norms, scaled embeddings, gated tanh GELU, head_dim 16, tied head
    "gemma": ("Gemma", {**SIZES, "head_dim": 16}),
    # biases on all four projections, an untied head
    "gemma-bias-untied": ("Gemma", {**SIZES, "head_dim": 8, "attention_bias": True,
                                    "tie_word_embeddings": False}),
    # sliding (window 4) and full layers alternating, both soft-caps, query_pre_attn_scalar
    "gemma2": ("Gemma2", {**SIZES, "num_hidden_layers": 3, "head_dim": 8,
                          "sliding_window": 4, "query_pre_attn_scalar": 12,
                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    # q/k norms, local/global rotary bases, linear scaling on the full layers, layers
    # sliding, full, sliding (pattern 2), no soft-caps
    "gemma3": ("Gemma3Text", {**SIZES, "num_hidden_layers": 3, "head_dim": 8,
                              "sliding_window": 4, "sliding_window_pattern": 2,
                              "query_pre_attn_scalar": 8, "rope_theta": 5000.0,
                              "rope_local_base_freq": 50.0,
                              "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # issue 50. GPT-NeoX: parallel residual on two norms, rotary on half of each head,
    # per-head fused QKV with biases, untied head
    "gpt_neox": ("GPTNeoX", {**_NEOX, "rotary_pct": 0.5}),
    # sequential residual, no attention biases, whole-head rotary, tied head, base 500
    "gpt_neox-sequential": ("GPTNeoX", {**_NEOX, "use_parallel_residual": False,
                                        "attention_bias": False, "rotary_pct": 1.0,
                                        "rotary_emb_base": 500.0,
                                        "tie_word_embeddings": True}),
    # Phi: one shared norm, partial rotary (0.5), grouped kv heads, head bias, untied
    "phi": ("Phi", {**_PHI, "num_key_value_heads": 2}),
    # whole-head rotary with linear scaling, tied head (its bias stays)
    "phi-tied": ("Phi", {**_PHI, "partial_rotary_factor": 1.0, "tie_word_embeddings": True,
                         "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # Phi-3: fused qkv_proj (grouped kv heads) and gate_up_proj, untied head
    "phi3": ("Phi3", {**_PHI3, "num_key_value_heads": 2}),
    # a sliding window of 4, rotary on half of each head, tied head
    "phi3-window": ("Phi3", {**_PHI3, "sliding_window": 4, "partial_rotary_factor": 0.5,
                             "tie_word_embeddings": True}),
    # longrope within its original context of 32: the short factors and the gain
    # sqrt(1 + ln 2 / ln 32) (max_position_embeddings 64 = 2 x 32)
    "phi3-longrope": ("Phi3", {**_PHI3, "max_position_embeddings": 64,
                               "original_max_position_embeddings": 32,
                               "rope_scaling": {"rope_type": "longrope",
                                                "short_factor": [1.0, 1.25, 1.5, 2.0],
                                                "long_factor": [2.0, 3.0, 4.0, 6.0]}}),
    # OPT: learned positions from row 2, pre-norm with a final norm, tied head
    "opt": ("OPT", _OPT),
    # OPT-350m's layout: post-norm without a final norm, 16-wide word embeddings projected
    # in and out, untied head
    "opt-postnorm-projected": ("OPT", {**_OPT, "do_layer_norm_before": False,
                                       "word_embed_proj_dim": 16,
                                       "tie_word_embeddings": False}),
    # no biases anywhere, the final norm removed
    "opt-nobias": ("OPT", {**_OPT, "enable_bias": False, "_remove_final_layer_norm": True}),
    # Falcon-7B's layout: one key/value head, parallel branches on one norm, tied head
    "falcon": ("Falcon", _FALCON),
    # Falcon-40B's: grouped kv heads (2 of 4), parallel on two norms, every bias, untied
    "falcon-new": ("Falcon", {**_FALCON, "new_decoder_architecture": True, "num_kv_heads": 2,
                              "bias": True, "tie_word_embeddings": False}),
    # the first layout, a kv head per query head, sequential blocks, base 500
    "falcon-sequential": ("Falcon", {**_FALCON, "multi_query": False, "parallel_attn": False,
                                     "rope_theta": 500.0}),
}  # fmt: skip
#: float32 logits against transformers in float64 (max |diff| / max |want|).
TOL = 1e-5


def make(case: str):
    """The transformers model of ``case`` (random weights; `_hf_models.build` redraws)."""
    import transformers

    prefix = CONFIGS[case][0].removesuffix("Text")
    return getattr(transformers, f"{prefix}ForCausalLM")(config_of(case))


def config_of(case: str, **changes):
    """The transformers config of ``case`` with ``changes``."""
    import transformers

    prefix, config = CONFIGS[case]
    return getattr(transformers, f"{prefix}Config")(**{**config, **changes})


def _rows(ids, mask):
    """Each row of a left-padded batch without its pads: ``(pads, ids (1, T))``."""
    for row, keep in zip(ids, mask.astype(bool)):
        pads = int(np.argmax(keep)) if keep.any() else len(keep)
        yield pads, row[None, pads:]


# transformers runs each prompt alone: its Gemma 2 in float64 gives NaN at every position
# of a left-padded row (the padded queries' scores are masked twice, to -inf, and their
# NaN outputs reach the real positions through the next layer's keys), so a padded batch
# has no float64 reference there. Alone, a prompt's logits and greedy tokens are those a
# left-padded batch must give (the positions come from the mask).


def hf_logits(model, ids, mask) -> np.ndarray:
    """transformers' logits of each prompt of a left-padded batch, run alone, at its
    positions in the batch (the pad positions hold zeros)."""
    import torch

    out = np.zeros((*ids.shape, model.config.vocab_size))
    for i, (pads, row) in enumerate(_rows(ids, mask)):
        with torch.no_grad():
            out[i, pads:] = model(input_ids=torch.tensor(row)).logits.numpy()[0]
    return out


def hf_greedy(model, ids, mask, new: int = 20) -> np.ndarray:
    """transformers' greedy tokens (``generate(do_sample=False)``, no end token) of each
    prompt run alone, after the row's pads (id 0), as a left-padded batch gives them."""
    import torch

    rows = []
    for pads, row in _rows(ids, mask):
        with torch.no_grad():
            got = model.generate(input_ids=torch.tensor(row), do_sample=False,
                                 attention_mask=torch.ones_like(torch.tensor(row)),
                                 max_new_tokens=new, pad_token_id=0,
                                 eos_token_id=None).numpy()[0]  # fmt: skip
        rows.append(np.concatenate([np.zeros(pads, got.dtype), got]))
    return np.stack(rows)


def check_saved(hf, folder) -> None:
    """``folder`` (written by multiattn's ``save_pretrained``) read back by transformers
    holds exactly the float32 parameters of ``hf`` (built float32, held in float64)."""
    import torch
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    original = hf.float().state_dict()
    assert sorted(back) == sorted(original)
    for name, value in original.items():
        assert torch.equal(back[name], value), name

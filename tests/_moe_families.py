"""The mixture-of-experts cases shared by tests/backend/test_moe_families.py and
tests/paddle/test_moe_families.py: tiny transformers configs (4 experts, top-2; hidden
32, 2 layers, vocabulary 64), transformers' float64 logits and greedy tokens, and the
check that a saved folder reads back into transformers bit for bit."""

from __future__ import annotations

import numpy as np

VOCAB, CONTEXT = 64, 40
TOL = 1e-5  # float32 logits against transformers in float64 (max |diff| / max |want|)
_SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
          "max_position_embeddings": CONTEXT, "num_experts_per_tok": 2}  # fmt: skip
CONFIGS = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                {**_SIZES, "num_local_experts": 4, "sliding_window": 5}),
    # Qwen2-MoE: a shared expert, top-2 not renormalised, layer 0 dense (mlp_only_layers)
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  {**_SIZES, "num_experts": 4, "moe_intermediate_size": 24,
                   "shared_expert_intermediate_size": 40, "mlp_only_layers": [0]}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  {**_SIZES, "num_experts": 4, "moe_intermediate_size": 24, "head_dim": 16,
                   "norm_topk_prob": True}),
}  # fmt: skip


def config_of(case: str):
    import transformers

    _, config_cls, kwargs = CONFIGS[case]
    return getattr(transformers, config_cls)(**kwargs)


def make(case: str):
    import transformers

    model = getattr(transformers, CONFIGS[case][0])(config_of(case))
    # transformers' default grouped_mm experts have no float64 kernel; the eager loop over
    # the chosen experts is the reference
    model.set_experts_implementation("eager")
    return model


def hf_logits(model, ids, mask) -> np.ndarray:
    import torch

    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions))  # fmt: skip
    return out.logits.numpy()


def hf_greedy(model, ids, mask, new: int = 20) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                              do_sample=False, max_new_tokens=new, pad_token_id=0,
                              eos_token_id=None).numpy()  # fmt: skip


def check_saved(hf, folder) -> None:
    """``folder`` (written by multiattn's ``save_pretrained``) loads into transformers as
    ``hf``'s class with every tensor equal to ``hf``'s (in float32) bit for bit."""
    import torch
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(back) is type(hf)
    want, got = hf.float().state_dict(), back.state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name

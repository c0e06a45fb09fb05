"""Shared by tests/backend/test_encoder_families.py and tests/paddle/test_encoder_families.py:
tiny BERT, RoBERTa, XLM-RoBERTa, DistilBERT, ALBERT, ELECTRA and ModernBERT models (every config option
multiattn implements set away from its default somewhere), a padded batch of two, the
float64 reference and the checks of a saved folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB, CONTEXT = 64, 24
_SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 48,
          "max_position_embeddings": CONTEXT}  # fmt: skip
# ModernBERT's token ids default to 50281..50283: inside the tiny vocabulary here
_MODERN = {**_SIZES, "num_hidden_layers": 3, "pad_token_id": 0, "bos_token_id": 1,
           "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2}  # fmt: skip
_DISTIL = {"vocab_size": VOCAB, "dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 48,
           "max_position_embeddings": CONTEXT}  # fmt: skip

#: family -> (config class, masked-LM class, base class, masked-LM config, base config)
CASES = {
    "bert": ("BertConfig", "BertForMaskedLM", "BertModel",
             {**_SIZES, "type_vocab_size": 3, "layer_norm_eps": 1e-7}, {**_SIZES}),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", "RobertaModel",
                {**_SIZES, "type_vocab_size": 2, "pad_token_id": 1, "layer_norm_eps": 1e-5},
                {**_SIZES, "pad_token_id": 3}),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForMaskedLM", "XLMRobertaModel",
                    {**_SIZES, "pad_token_id": 1}, {**_SIZES, "pad_token_id": 0}),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", "DistilBertModel",
                   {**_DISTIL, "activation": "gelu"},
                   {**_DISTIL, "activation": "relu", "sinusoidal_pos_embds": True}),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", "AlbertModel",
               {**_SIZES, "num_hidden_layers": 3, "embedding_size": 16,
                "num_hidden_groups": 2, "inner_group_num": 2, "hidden_act": "gelu_new",
                "type_vocab_size": 3},
               {**_SIZES, "embedding_size": 40, "hidden_act": "gelu", "num_hidden_layers": 3}),
    # the generator: 16-wide embeddings projected; the base model: embeddings as wide as
    # the blocks (no projection)
    "electra": ("ElectraConfig", "ElectraForMaskedLM", "ElectraModel",
                {**_SIZES, "embedding_size": 16, "layer_norm_eps": 1e-7},
                {**_SIZES, "embedding_size": 32, "type_vocab_size": 3}),
    # the masked LM: windows of 2 tokens on either side on layer 1 of 3 (every 2nd layer
    # global, from 0), every bias, the head's tanh GELU, no decoder bias; the base model:
    # the layer kinds listed, windows of 3, own rotary bases, the tanh GELU in the blocks
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", "ModernBertModel",
                   {**_MODERN, "local_attention": 4, "global_attn_every_n_layers": 2,
                    "norm_bias": True, "attention_bias": True, "mlp_bias": True,
                    "classifier_bias": True, "classifier_activation": "gelu_new",
                    "decoder_bias": False, "norm_eps": 1e-6},
                   {**_MODERN, "local_attention": 6, "hidden_activation": "gelu_pytorch_tanh",
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                    "rope_parameters": {"full_attention": {"rope_type": "default",
                                                           "rope_theta": 500.0},
                                        "sliding_attention": {"rope_type": "default",
                                                              "rope_theta": 40.0}}}),
}  # fmt: skip
#: families whose base model has no pooler
NO_POOLER = ("distilbert", "electra", "modernbert")


def make_discriminator():
    """``() -> ElectraForPreTraining``: the discriminator head (one logit per token) on
    24-wide embeddings projected to the blocks' 32."""
    import transformers

    config = transformers.ElectraConfig(**{**_SIZES, "embedding_size": 24})
    return lambda: transformers.ElectraForPreTraining(config)


def make(family: str, masked_lm: bool):
    """``() -> transformers model`` of ``family`` (the masked-LM or the base class)."""
    import transformers

    config_cls, head_cls, base_cls, head_cfg, base_cfg = CASES[family]
    config = getattr(transformers, config_cls)(**(head_cfg if masked_lm else base_cfg))
    return lambda: getattr(transformers, head_cls if masked_lm else base_cls)(config)


def batch(hf_config) -> dict[str, np.ndarray]:
    """Two rows of 9 tokens, the second left-padded with 3 of the config's pad id (0
    under the mask); no other id is the pad id. Token types where the family has them."""
    pad = hf_config.pad_token_id or 0
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB - 1, (2, 9))
    ids = ids + (ids >= pad)  # every id but the pad
    mask = np.ones((2, 9), np.int64)
    ids[1, :3], mask[1, :3] = pad, 0
    out = {"input_ids": ids, "attention_mask": mask}
    if getattr(hf_config, "type_vocab_size", 0):
        out["token_type_ids"] = rng.integers(0, hf_config.type_vocab_size, (2, 9))
    return out


def reference(hf, inputs: dict) -> dict[str, np.ndarray]:
    """transformers' outputs (the float64 model): ``logits`` and the base model's last
    hidden state of a masked-LM model, ``last_hidden_state`` (and ``pooler_output``) of a
    base model. (ModernBERT's ``hidden_states[-1]`` precedes its final norm; its base
    model's ``last_hidden_state`` follows it, as the other families' do.)"""
    import torch

    feed = {k: torch.tensor(v) for k, v in inputs.items()}
    with torch.no_grad():
        out = hf(**feed)
        if "logits" in out:
            base = hf.base_model(**feed).last_hidden_state
            return {"logits": out.logits.numpy(), "last_hidden_state": base.numpy()}
    return {k: out[k].numpy() for k in ("last_hidden_state", "pooler_output") if k in out}


def errors(ours: dict, want: dict, mask: np.ndarray) -> dict[str, float]:
    """Max relative error per output (max |diff| / max |want|), over the real tokens."""
    assert sorted(ours) == sorted(want)
    keep = mask.astype(bool)
    out = {}
    for key, value in want.items():
        got = np.asarray(ours[key], np.float64)
        assert got.shape == value.shape, key
        if got.ndim == 3:
            got, value = got[keep], value[keep]
        out[key] = float(np.abs(got - value).max() / np.abs(value).max())
    return out


def check_saved(src: Path, out: Path, architecture: str) -> None:
    """``out`` (our save_pretrained of ``src``) holds ``src``'s tensors bit for bit, is
    written as ``architecture``, and transformers reads it with nothing missing."""
    import json

    import torch
    import transformers
    from safetensors.numpy import load_file

    stored = load_file(src / "model.safetensors")
    written = load_file(out / "model.safetensors")
    assert sorted(written) == sorted(stored)
    for name, value in stored.items():
        assert written[name].dtype == value.dtype, name
        assert written[name].tobytes() == value.tobytes(), name
    assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
    back, info = getattr(transformers, architecture).from_pretrained(out, output_loading_info=True)
    assert type(back).__name__ == architecture
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = back.state_dict()
    for name, value in stored.items():
        assert torch.equal(state[name], torch.from_numpy(value)), name


def check_discriminator(tmp_path: Path, to_np, tol: float, **load) -> None:
    """ELECTRA's discriminator (`make_discriminator`) through ``from_pretrained(path,
    **load)``: a logit per token within ``tol`` of transformers in float64, written back
    bit for bit as ``ElectraForPreTraining``."""
    from _hf_models import build

    from multiattn.hf.pretrained import from_pretrained

    hf = build(make_discriminator(), tmp_path / "src")
    model = from_pretrained(tmp_path / "src", **load)
    inputs = batch(hf.config)
    got = {k: to_np(v) for k, v in model(**inputs).items()}
    assert got["logits"].shape == inputs["input_ids"].shape
    err = errors(got, reference(hf, inputs), inputs["attention_mask"])
    assert max(err.values()) <= tol, err
    model.save_pretrained(tmp_path / "out")
    check_saved(tmp_path / "src", tmp_path / "out", "ElectraForPreTraining")

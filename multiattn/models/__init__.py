"""Whole models assembled from multiattn layers and core functions.

* `multiattn.models.checkpoint`: BERT checkpoints (``config.json``, ``model.safetensors``,
  ``tokenizer.json``) read into the framework-neutral weight names of `multiattn.port`;
  imports no framework.
* `multiattn.models.bert`: `BertSentenceEncoder`, a BERT encoder with mean pooling as a
  Keras layer (Keras jax, torch, tensorflow, numpy).
* On Paddle, `multiattn.paddle.models` holds the Paddle twins of these definitions
  (``from_pretrained(path, framework="paddle")`` builds them).
* `multiattn.models.pretrained`: `from_pretrained` reads a Hugging Face model folder
  (BERT's ``BertModel``, ViT's ``ViTModel``) into multiattn layers; ``save_pretrained``
  writes one transformers reads back. `multiattn.models.vit`: the ViT Keras layer.
  `multiattn.models.hf_families` and `multiattn.models.hf_files`: the config options,
  tensor tables and file handling (no framework).
* `multiattn.models.causal_lm`: `CausalLM`, the decoder-only language model that
  ``from_pretrained`` builds for GPT-2, Llama, Qwen2 and Mistral checkpoints
  (`multiattn.models.hf_causal_lm`: their config options and tensor tables), with
  ``generate`` through the KV cache (`multiattn.decoding`).
* `multiattn.models.t5`: `T5ForConditionalGeneration`, the encoder-decoder built for T5
  checkpoints (`multiattn.models.hf_t5`: config options and tensor table), with
  ``generate`` through the same loop.

Submodules are imported on use, so ``import multiattn.models`` loads no framework.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("bert", "causal_lm", "checkpoint", "hf_causal_lm", "hf_families", "hf_files",
               "hf_t5", "pretrained", "t5", "vit")  # fmt: skip
_NAMES = {"from_pretrained": "pretrained", "PretrainedModel": "pretrained",
          "PretrainedCausalLM": "pretrained", "CausalLM": "causal_lm",
          "T5ForConditionalGeneration": "t5"}  # fmt: skip

__all__ = [*_SUBMODULES, *_NAMES]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'multiattn.models' has no attribute {name!r}")

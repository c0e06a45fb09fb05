"""Whole models assembled from multiattn layers and core functions (their definitions;
Hugging Face files are `multiattn.hf`'s, decoding is `multiattn.decoding`'s).

* `multiattn.models.bert`: `BertModel` and `BertSentenceEncoder` (a BERT encoder with
  mean pooling) as Keras layers (Keras jax, torch, tensorflow, numpy).
* `multiattn.models.vit`: the ViT Keras layer.
* `multiattn.models.causal_lm`: `CausalLM`, the decoder-only language model that
  ``from_pretrained`` builds for GPT-2, Llama, Qwen2 and Mistral checkpoints, with
  ``generate`` through the KV cache (`multiattn.decoding`).
* `multiattn.models.modernbert`: `ModernBertModel`, the bidirectional encoder of rotary
  blocks (local and global attention) built for ModernBERT checkpoints, with its
  masked-LM head.
* `multiattn.models.t5`: `T5ForConditionalGeneration`, the encoder-decoder built for T5
  checkpoints, with ``generate`` through the same seam.
* ``multiattn.models.from_pretrained`` (and `PretrainedModel`, `PretrainedCausalLM`):
  `multiattn.hf.pretrained`'s, which reads a Hugging Face model folder into these models.
* On Paddle, `multiattn.paddle.models` holds the Paddle twins of these definitions
  (``from_pretrained(path, framework="paddle")`` builds them).

Submodules are imported on use, so ``import multiattn.models`` loads no framework.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("bart", "bert", "causal_lm", "modernbert", "t5", "vit")
_NAMES = {"from_pretrained": "pretrained", "PretrainedModel": "pretrained",
          "PretrainedCausalLM": "pretrained", "CausalLM": "causal_lm",
          "CausalLMConfig": "causal_lm", "ModernBertConfig": "modernbert",
          "ModernBertModel": "modernbert", "T5Config": "t5",
          "T5ForConditionalGeneration": "t5"}  # fmt: skip

__all__ = [*_SUBMODULES, *_NAMES]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        module = _NAMES[name]
        package = "multiattn.hf" if module == "pretrained" else __name__
        return getattr(importlib.import_module(f".{module}", package), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'multiattn.models' has no attribute {name!r}")

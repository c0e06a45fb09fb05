"""multiattn: attention written once with keras.ops, identical across frameworks.

Import under the Keras backend of your choice (``KERAS_BACKEND`` = ``jax``, ``torch``,
``tensorflow`` or ``numpy``, read once when Keras is imported). ``import multiattn`` itself
imports no framework; Keras (and with it the chosen backend) is imported on first use of
`multiattn.ops` or `multiattn.layers`.

* `multiattn.ops`: the math (masked softmax, scoring functions, scaled dot-product
  attention, head split/merge, positional encoding).
* `multiattn.layers`: Keras 3 layers.
* `multiattn.models`: whole models (BERT, ViT, the causal LMs, T5) and ``from_pretrained``.
* `multiattn.hf`: Hugging Face folders: config tables, tensor names, loading and saving.
* `multiattn.decoding`: ``generate``: samplers, stopping and the decoding strategies.
* `multiattn.config`: ``settings``, the few options the attention planner reads.
* `multiattn.reference`: the float64 NumPy oracle used by tests and fixtures.
* `multiattn.tuning`: kernel choices measured on the running machine (opt-in), its CPU.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = ("config", "decoding", "hf", "layers", "models", "ops", "reference", "tuning")

__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'multiattn' has no attribute {name!r}")

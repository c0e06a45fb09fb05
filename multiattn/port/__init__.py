"""Moving attention weights between frameworks.

One framework-neutral representation, `PortableWeights` (a kind, a config and a dict of
NumPy arrays with documented names and shapes, see `multiattn.port.layout`), and three
functions for every supported module:

* `get_weights(module) -> PortableWeights`
* `set_weights(module, weights)` (a `PortableWeights` or a dict of neutral arrays)
* `convert(module, to)`: an equivalent module in another framework.

Supported: `multiattn.layers.MultiHeadAttention` (grouped heads and rotary position
embedding included), ``TransformerEncoderLayer``, ``AdditiveAttention``, and the decoder
blocks ``TransformerDecoderLayer`` and ``TransformerDecoderOnlyLayer`` (multiattn's
layers and their Paddle twins only, `multiattn.port.decoders`);
``keras.layers.MultiHeadAttention`` and ``GroupQueryAttention``;
``torch.nn.MultiheadAttention`` and ``TransformerEncoderLayer``;
``paddle.nn.MultiHeadAttention`` and ``TransformerEncoderLayer``;
``flax.nnx.MultiHeadAttention``; the document adapters' weighted layers.

A grouped or rotary layer's settings are part of the layout; a target that cannot
represent one refuses it, naming it (see `multiattn.port.layout`).

``import multiattn.port`` imports no framework: a module's framework is found through
``sys.modules``, and the framework code is imported when first needed.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PortableWeights": "layout",
    "expected_shapes": "layout",
    "TARGETS": "api",
    "convert": "api",
    "detect": "api",
    "get_weights": "api",
    "set_weights": "api",
    "load_portable": "checkpoint",
    "save_portable": "checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'multiattn.port' has no attribute {name!r}")

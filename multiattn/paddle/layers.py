"""``paddle.nn.Layer`` twins of `multiattn.layers`.

Each class here is its Keras twin's definition on a Paddle holder (see
`multiattn.paddle._twin`): the same constructor and call arguments, the same validation
and errors, the same math, with

* parameters as Paddle parameters (``parameters()``, ``state_dict()``, Paddle autograd
  and optimizers), under the Keras twin's attribute names (``query_dense.kernel``, ...),
  initialised by the same Keras initializers;
* calls on Paddle tensors (NumPy arrays are converted; tensors of other frameworks raise
  ``TypeError``); ``training`` defaults to the layer's mode (``train()`` / ``eval()``);
* the layer built on its first call, from the shapes of the call's arguments, as in
  Keras; ``from_config`` takes a Keras twin's ``get_config()``.

`multiattn.port.get_weights` / `set_weights` read and write them under the same neutral
names as the Keras layers. Not on Paddle: Keras masks carried by tensors, mixed-precision
policies, regularizers, constraints, LoRA and quantization (refused where given).
"""

from __future__ import annotations

from .. import layers as _keras
from ._holder import PaddleLayer
from ._twin import twin

__all__ = [
    "AdditiveAttention",
    "DecoderBlockConfig",
    "DotProductAttention",
    "FeedForward",
    "GroupQueryAttention",
    "GroupedQueryAttention",
    "LayerNormalization",
    "MixtureOfExperts",
    "MoEConfig",
    "MultiHeadAttention",
    "PaddleLayer",
    "PositionEmbedding",
    "PositionalEncoding",
    "RMSNormalization",
    "RotaryEmbedding",
    "TransformerDecoderLayer",
    "TransformerDecoderOnlyLayer",
    "TransformerEncoderLayer",
]

DecoderBlockConfig = _keras.DecoderBlockConfig  # a plain dataclass: the same on Keras
DotProductAttention = twin(_keras.DotProductAttention)
AdditiveAttention = twin(_keras.AdditiveAttention)
RotaryEmbedding = twin(_keras.RotaryEmbedding)
LayerNormalization = twin(_keras.LayerNormalization)
RMSNormalization = twin(_keras.RMSNormalization)
PositionalEncoding = twin(_keras.PositionalEncoding)
PositionEmbedding = twin(_keras.PositionEmbedding)
FeedForward = twin(_keras.FeedForward)
MoEConfig = _keras.MoEConfig  # a plain dataclass: the same on Keras
MixtureOfExperts = twin(_keras.MixtureOfExperts)
MultiHeadAttention = twin(_keras.MultiHeadAttention)
GroupedQueryAttention = twin(_keras.GroupedQueryAttention)
GroupQueryAttention = GroupedQueryAttention
TransformerEncoderLayer = twin(_keras.TransformerEncoderLayer)
TransformerDecoderLayer = twin(_keras.TransformerDecoderLayer)
TransformerDecoderOnlyLayer = twin(_keras.TransformerDecoderOnlyLayer)

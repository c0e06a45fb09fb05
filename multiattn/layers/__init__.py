"""Keras 3 layers built on `multiattn.ops`.

Every layer validates its arguments in ``__init__``, creates weights in ``build`` and
computes in ``call``; ``get_config`` is complete and ``.keras`` files round-trip exactly.
"""

from .attention import AdditiveAttention, DotProductAttention
from .encoder import TransformerEncoderLayer
from .multi_head import MultiHeadAttention
from .normalization import LayerNormalization
from .positional import PositionalEncoding

__all__ = [
    "AdditiveAttention",
    "DotProductAttention",
    "LayerNormalization",
    "MultiHeadAttention",
    "PositionalEncoding",
    "TransformerEncoderLayer",
]

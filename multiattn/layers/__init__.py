"""Keras 3 layers built on `multiattn.ops`.

Every layer validates its arguments in ``__init__``, creates weights in ``build`` and
computes in ``call``; ``get_config`` is complete and ``.keras`` files round-trip exactly.
"""

from ._base import zero_initialized
from .attention import AdditiveAttention, DotProductAttention
from .decoder import TransformerDecoderLayer
from .decoder_only import DecoderBlockConfig, TransformerDecoderOnlyLayer
from .encoder import TransformerEncoderLayer
from .feature_map import FeatureMapAttention
from .feed_forward import FeedForward
from .grouped_query import GroupedQueryAttention, GroupQueryAttention
from .moe import MixtureOfExperts, MoEConfig
from .multi_head import MultiHeadAttention
from .normalization import LayerNormalization, RMSNormalization
from .positional import PositionalEncoding, PositionEmbedding
from .rotary import RotaryEmbedding
from .seq2seq import Seq2SeqAttentionDecoder, Seq2SeqEncoder

__all__ = [
    "AdditiveAttention",
    "DecoderBlockConfig",
    "DotProductAttention",
    "FeatureMapAttention",
    "FeedForward",
    "GroupQueryAttention",
    "GroupedQueryAttention",
    "LayerNormalization",
    "MixtureOfExperts",
    "MoEConfig",
    "MultiHeadAttention",
    "PositionEmbedding",
    "PositionalEncoding",
    "RMSNormalization",
    "RotaryEmbedding",
    "Seq2SeqAttentionDecoder",
    "Seq2SeqEncoder",
    "TransformerDecoderLayer",
    "TransformerDecoderOnlyLayer",
    "TransformerEncoderLayer",
    "zero_initialized",
]

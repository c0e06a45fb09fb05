"""The attention math, written once with ``keras.ops``.

Shapes: scores are ``(batch, ..., queries, keys)``; masks are bool with True = may
attend; valid lengths are ``(batch,)`` or ``(batch, queries)``.
"""

from .._autograph import mark_public
from .activations import ACTIVATIONS, activation
from .attention import scaled_dot_product_attention, score_attention
from .heads import HEAD_LAYOUTS, merge_heads, split_heads
from .masking import causal_mask, combine_masks, masked_softmax, valid_lens_to_mask
from .normalization import RMS_NORM_EPSILON, layer_norm, rms_norm
from .positional import PE_LAYOUTS, alibi_bias, sinusoidal_encoding
from .rotary import ROTARY_SCALINGS, rotary_embedding, rotary_frequencies, rotary_table
from .scoring import additive_scores, dot_scores, general_scores, scaled_dot_scores

__all__ = [
    "ACTIVATIONS",
    "HEAD_LAYOUTS",
    "PE_LAYOUTS",
    "RMS_NORM_EPSILON",
    "ROTARY_SCALINGS",
    "activation",
    "additive_scores",
    "alibi_bias",
    "causal_mask",
    "combine_masks",
    "dot_scores",
    "general_scores",
    "layer_norm",
    "masked_softmax",
    "merge_heads",
    "rms_norm",
    "rotary_embedding",
    "rotary_frequencies",
    "rotary_table",
    "scaled_dot_product_attention",
    "scaled_dot_scores",
    "score_attention",
    "sinusoidal_encoding",
    "split_heads",
    "valid_lens_to_mask",
]

mark_public(globals(), __all__)  # tf.function need not convert the core's source

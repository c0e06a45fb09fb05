"""ModernBERT, a bidirectional encoder of rotary blocks, from multiattn layers (Keras jax,
torch, tensorflow; numpy for inference).

`ModernBertModel` is transformers' ``ModernBertModel`` (and, with ``masked_lm``,
``ModernBertForMaskedLM``): the word embeddings and their LayerNorm, pre-norm
`multiattn.layers.TransformerDecoderOnlyLayer` blocks made bidirectional
(``causal=False``) with rotary positions, a gated feed-forward network and, on the
sliding layers, a symmetric window (``layer_overrides`` give each block its window and
rotary base; the first block has no attention norm), and a final LayerNorm. The
blocks are the decoder families' own block; only the stack around them is written here.

Positions are the slots ``0 .. seq - 1`` of each row, padded or not, as transformers
computes them; padding is masked as keys. The rotary scores depend only on position
differences and the window on slot differences, so a left-padded row gives its real
tokens the states of the same row unpadded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np

from .._checks import check_bool, check_positive_int
from ..layers import TransformerDecoderOnlyLayer
from ..layers._base import call_sublayer
from ..layers.decoder_only import (
    DecoderBlockConfig,
    block_config,
    check_overrides,
    make_norm,
    override_of,
)
from ..namespaces.keras import get_ops
from ..ops.activations import activation as apply_activation
from ..ops.activations import check_activation
from ._ids import ids_and_mask, poison
from .bert import assign_weight
from .causal_lm import _fuse, _split_fused, split_sizes

__all__ = ["ModernBertConfig", "ModernBertModel"]

_MODEL_KEYS = ("vocab_size", "num_layers", "max_positions", "masked_lm", "head_activation",
               "head_bias", "decoder_bias")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModernBertConfig:
    """The options of a `ModernBertModel`, checked when made (errors name the field and
    quote the value).

    Fields:
        vocab_size, num_layers: sizes.
        max_positions: the context (``max_position_embeddings``): the rotary tables'
            length; longer inputs are refused.
        block: every block's options, a `multiattn.layers.DecoderBlockConfig` (or a dict
            of its fields) with ``causal=False``, pre-norm (``norm_first=True``) and
            rotary positions (``rotary_max_length``).
        layer_overrides: per-block differences from ``block`` (as
            `multiattn.models.CausalLMConfig`'s): ModernBERT's sliding layers'
            ``sliding_window`` and ``rotary_base``, the first block's
            ``attention_norm=False``. None (default): every block is ``block``.
        masked_lm: the masked-LM head (``ModernBertForMaskedLM``): ``mlm_dense`` (``hidden
            -> hidden``, with a bias when ``head_bias``), the activation
            ``head_activation`` (one of `multiattn.ops.ACTIVATIONS`), ``mlm_norm`` (the
            blocks' LayerNorm), then the product with the word embeddings (tied) plus
            ``mlm_bias`` when ``decoder_bias``. Default False: the base model.

    The neutral weights keep ModernBERT's fused projections (``layer_<i>/qkv``, the query
    heads' columns, the keys', the values'; ``layer_<i>/ffn/gate_up``, the activated half
    first): ``fused_qkv`` and ``fused_gate_up`` are always true.
    """

    vocab_size: int
    num_layers: int
    max_positions: int
    block: DecoderBlockConfig
    layer_overrides: tuple[dict, ...] | None = None
    masked_lm: bool = False
    head_activation: str = "gelu"
    head_bias: bool = False
    decoder_bias: bool = True

    fused_qkv = True  # class constants, not fields: the layout of the neutral weights
    fused_gate_up = True

    def __post_init__(self) -> None:
        where = "ModernBertConfig"
        for name in ("vocab_size", "num_layers", "max_positions"):
            object.__setattr__(self, name, check_positive_int(where, name, getattr(self, name)))
        for name in ("masked_lm", "head_bias", "decoder_bias"):
            check_bool(where, name, getattr(self, name))
        check_activation(where, self.head_activation, "head_activation")
        block = block_config(where, self.block, {})
        if block.causal or not block.norm_first or block.rotary_max_length is None:
            raise ValueError(
                f"{where}: `block` must be bidirectional (causal=False), pre-norm "
                f"(norm_first=True) and rotary (rotary_max_length); received causal="
                f"{block.causal!r}, norm_first={block.norm_first!r}, rotary_max_length="
                f"{block.rotary_max_length!r}."
            )
        object.__setattr__(self, "block", block)
        overrides = check_overrides(where, block, self.layer_overrides, self.num_layers)
        object.__setattr__(self, "layer_overrides", overrides)

    def block_of(self, index: int) -> DecoderBlockConfig:
        """The options of block ``index``: ``block`` with ``layer_overrides[index]``."""
        return override_of(self.block, self.layer_overrides, index)

    @classmethod
    def from_sizes(cls, sizes: dict[str, Any]) -> ModernBertConfig:
        """The config of the flat sizes dict of `multiattn.hf.modernbert` (Hugging Face
        names, as `multiattn.models.CausalLMConfig.from_sizes` reads them): bidirectional
        pre-norm blocks without dropout, rotary over ``max_positions``."""
        model, block = split_sizes(sizes, _MODEL_KEYS)
        block.update(rate=0.0, norm_first=True, causal=False,
                     rotary_max_length=sizes["max_positions"])  # fmt: skip
        return cls(**model, block=block)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``block`` a dict too; JSON-ready)."""
        return dataclasses.asdict(self)


@keras.saving.register_keras_serializable(package="multiattn")
class ModernBertModel(keras.layers.Layer):
    """ModernBERT's encoder: token ids -> states (and, with ``masked_lm``, logits).

    Weights: ``word`` ``(vocab_size, hidden_size)``, ``embed_norm``, ``blocks``
    (``num_layers`` `TransformerDecoderOnlyLayer` named ``layer_<i>``), ``final_norm``;
    with ``masked_lm`` also ``mlm_kernel`` ``(hidden, hidden)`` (and ``mlm_dense_bias``),
    ``mlm_norm`` and ``mlm_bias`` ``(vocab_size,)``.

    Args:
        config: a `ModernBertConfig` (or a dict of its fields, ``block`` a dict too).
        **kwargs: ``keras.layers.Layer`` arguments (``name``, ``dtype``, ...).

    Call arguments:
        input_ids: int ``(batch, seq)``, values in ``[0, vocab_size)`` (checked eagerly;
            inside a compiled function an id outside gives NaN outputs, never another
            id's), ``seq <= max_positions``.
        attention_mask: ``(batch, seq)``, 1 / True = real token, 0 = padding (masked as a
            key, on either side); default all ones.

    Returns:
        ``{"last_hidden_state": (batch, seq, hidden_size)}`` (after the final norm) in the
        compute dtype; with ``masked_lm`` also ``"logits"`` ``(batch, seq, vocab_size)``.
        Rows of pad positions are computed too and carry no meaning.
    """

    def __init__(self, config: ModernBertConfig | dict, **kwargs: Any):
        super().__init__(**kwargs)
        if isinstance(config, dict):
            config = ModernBertConfig(**config)
        if not isinstance(config, ModernBertConfig):
            raise TypeError(
                f"ModernBertModel: `config` must be a ModernBertConfig or a dict of its "
                f"fields; received {type(config).__name__}."
            )
        self.config = config
        policy = self.dtype_policy
        self.blocks = [
            TransformerDecoderOnlyLayer(config=config.block_of(i), name=f"layer_{i}", dtype=policy)
            for i in range(config.num_layers)
        ]
        self.embed_norm = make_norm(config.block, "embed_norm", policy)
        self.final_norm = make_norm(config.block, "final_norm", policy)
        self.mlm_norm = make_norm(config.block, "mlm_norm", policy) if config.masked_lm else None

    vocab_size = property(lambda self: self.config.vocab_size)
    hidden_size = property(lambda self: self.config.block.d_model)
    num_layers = property(lambda self: self.config.num_layers)
    max_positions = property(lambda self: self.config.max_positions)

    def build(self, input_ids_shape=None, attention_mask_shape=None):
        e, v, c = self.hidden_size, self.vocab_size, self.config
        add = lambda shape, name: self.add_weight(shape=shape, initializer="zeros", name=name)  # noqa: E731
        self.word = add((v, e), "word")
        self.mlm_kernel = add((e, e), "mlm_kernel") if c.masked_lm else None
        self.mlm_dense_bias = add((e,), "mlm_dense_bias") if c.masked_lm and c.head_bias else None
        self.mlm_bias = add((v,), "mlm_bias") if c.masked_lm and c.decoder_bias else None
        for layer in (*self.blocks, self.embed_norm, self.final_norm, self.mlm_norm):
            if layer is not None:
                layer.build((None, None, e))

    def call(self, input_ids, attention_mask=None):
        ops = keras.ops
        ids, valid, mask = ids_and_mask("ModernBertModel", input_ids, attention_mask,
                                        self.vocab_size)  # fmt: skip
        seq = ids.shape[1]
        if seq is not None and seq > self.max_positions:
            raise ValueError(
                f"ModernBertModel: `input_ids` holds {seq} tokens, more than the context "
                f"(max_positions={self.max_positions})."
            )
        x = poison(ops.cast(ops.take(self.word, ids, axis=0), self.compute_dtype), valid)
        x = call_sublayer(self.embed_norm, x)
        keep = ops.expand_dims(ops.cast(mask, "bool"), 1)  # (batch, 1, keys)
        for block in self.blocks:
            x = block(x, mask=keep)
        x = call_sublayer(self.final_norm, x)
        if not self.config.masked_lm:
            return {"last_hidden_state": x}
        return {"logits": self._logits(x), "last_hidden_state": x}

    def _logits(self, x):
        """The masked-LM head on the final states ``x``."""
        ops = get_ops(x)
        bias = self.mlm_dense_bias
        h = ops.linear(x, ops.cast(self.mlm_kernel, x.dtype),
                       None if bias is None else ops.cast(bias, x.dtype))  # fmt: skip
        h = call_sublayer(self.mlm_norm, apply_activation(h, self.config.head_activation))
        bias = None if self.mlm_bias is None else ops.cast(self.mlm_bias, x.dtype)
        return ops.linear(h, ops.cast(ops.transpose(self.word), x.dtype), bias)

    def compute_output_shape(self, input_ids_shape, attention_mask_shape=None):
        b, s = input_ids_shape
        out = {"last_hidden_state": (b, s, self.hidden_size)}
        return {"logits": (b, s, self.vocab_size), **out} if self.config.masked_lm else out

    def get_config(self) -> dict:
        return {**super().get_config(), "config": self.config.to_dict()}

    # --- the protocol of `multiattn.hf.pretrained` --------------------------------

    @classmethod
    def from_sizes(cls, sizes: dict, pooler: bool = False, dtype: Any = None) -> ModernBertModel:
        """A built `ModernBertModel` from `multiattn.hf.modernbert` sizes."""
        model = cls(ModernBertConfig.from_sizes(sizes), dtype=dtype)
        model.build()
        return model

    def _variables(self) -> dict[str, Any]:
        out = {"embed/word": self.word}
        norms = (("embed/norm", self.embed_norm), ("final_norm", self.final_norm),
                 ("mlm/norm", self.mlm_norm))  # fmt: skip
        for prefix, norm in norms:
            for v in norm.weights if norm is not None else ():
                out[f"{prefix}/{v.path.rsplit('/', 1)[-1]}"] = v
        heads = (("mlm/dense/kernel", self.mlm_kernel), ("mlm/dense/bias", self.mlm_dense_bias),
                 ("mlm/bias", self.mlm_bias))  # fmt: skip
        out.update({name: v for name, v in heads if v is not None})
        for i, block in enumerate(self.blocks):
            for v in block.weights:
                out[f"layer_{i}/{v.path.split(block.name + '/', 1)[1]}"] = v
        return out

    def set_neutral_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Assign neutral weights (`multiattn.hf.modernbert` names: the fused ``qkv``
        and ``ffn/gate_up`` projections are split here)."""
        weights = _split_fused(self, weights)
        for name, variable in self._variables().items():
            assign_weight(name, variable, weights, "ModernBertModel")

    def neutral_weights(self) -> dict[str, np.ndarray]:
        """The neutral weights as NumPy arrays in the variables' dtype (fused again)."""
        out = {k: np.asarray(keras.ops.convert_to_numpy(v)) for k, v in self._variables().items()}
        return _fuse(self, out)

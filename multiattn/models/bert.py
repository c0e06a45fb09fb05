"""A BERT sentence encoder built from multiattn layers (Keras jax, torch, tensorflow, numpy).

``BertSentenceEncoder`` is BERT's encoder (post-LayerNorm
`multiattn.layers.TransformerEncoderLayer` blocks with exact GELU) under the embeddings
BERT uses (token + position + token type, LayerNorm), followed by sentence-transformers'
mean pooling over the real tokens and optional L2 normalisation. `from_checkpoint` reads
a sentence-transformers directory (see `multiattn.hf.bert_weights`) and loads the encoder
blocks through `multiattn.port.set_weights`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np

from .._checks import check_positive_int
from ..hf.bert_weights import SentenceOptions, bert_sizes, layer_weights, load_checkpoint
from ..layers import LayerNormalization, TransformerEncoderLayer
from ..layers._base import keras_default
from ..ops.activations import activation as apply_activation
from ..ops.activations import check_activation
from ._ids import padding_mask, poison
from ._ids import token_ids as checked_ids

__all__ = [
    "BertModel",
    "BertSentenceEncoder",
    "bert_weights",
    "from_checkpoint",
    "set_bert_weights",
]


def _tanh(x):
    # 2 sigmoid(2x) - 1: keras.ops.tanh computes float64 in float32 on the JAX backend.
    # The cast keeps half precision on the NumPy backend, where `2.0 * x` promotes it.
    return keras.ops.cast(2.0 * keras.ops.sigmoid(2.0 * x) - 1.0, x.dtype)


def pooler_activation(name: str) -> Any:
    """The activation of a pooler by its transformers name (``tanh``, ``relu``, exact
    ``gelu``, ``sigmoid``, ``linear``); each keeps its input's dtype on every backend."""
    return {
        "tanh": _tanh,
        "relu": keras.ops.relu,
        "gelu": lambda x: keras.ops.gelu(x, approximate=False),
        "sigmoid": keras.ops.sigmoid,
        "linear": lambda x: x,
    }[name]


class _BertStack(keras.layers.Layer):
    """BERT's embeddings and encoder blocks, shared by `BertSentenceEncoder` and
    `BertModel` (one forward pass: `token_states`).

    The options beyond BERT (each off by default, BERT unchanged) are the encoder
    families' differences: ``position_padding_idx`` (RoBERTa, XLM-RoBERTa: position of
    a token = ``padding_idx + 1 +`` the number of non-pad ids up to it, a pad id gets
    ``padding_idx``; computed from the ids, not the attention mask), ``type_vocab_size=0``
    (DistilBERT: no token-type embedding), ``embedding_size`` (ALBERT: embeddings of that
    width, their LayerNorm, then the projection ``embedding_projection`` to
    ``hidden_size``) and ``num_groups``/``group_size`` (ALBERT: ``num_groups * group_size``
    distinct blocks; application ``i < num_layers`` runs group
    ``int(i / (num_layers / num_groups))``, i.e. its ``group_size`` blocks in order: one
    set of weights used repeatedly).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        intermediate_size: int,
        max_positions: int = 512,
        type_vocab_size: int = 2,
        epsilon: float = 1e-12,
        activation: str = "gelu",
        position_padding_idx: int | None = None,
        embedding_size: int | None = None,
        num_groups: int | None = None,
        group_size: int = 1,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = type(self).__name__
        sizes = {
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "num_layers": num_layers,
            "num_heads": num_heads,
            "intermediate_size": intermediate_size,
            "max_positions": max_positions,
        }
        for name, value in sizes.items():
            setattr(self, name, check_positive_int(where, name, value))
        self.type_vocab_size = (
            0 if type_vocab_size == 0 and not isinstance(type_vocab_size, bool)
            else check_positive_int(where, "type_vocab_size", type_vocab_size)
        )  # fmt: skip
        pad = position_padding_idx
        if pad is not None and (
            isinstance(pad, bool) or not isinstance(pad, (int, np.integer))
            or not 0 <= pad < min(self.max_positions - 1, self.vocab_size)
        ):  # fmt: skip
            raise ValueError(
                f"{where}: `position_padding_idx` must be None or an integer id below "
                f"vocab_size={self.vocab_size} and max_positions - 1={self.max_positions - 1}; "
                f"received {pad!r}."
            )
        self.position_padding_idx = None if pad is None else int(pad)
        self.embedding_size = check_positive_int(where, "embedding_size", embedding_size, True)
        self.num_groups = check_positive_int(where, "num_groups", num_groups, True)
        self.group_size = check_positive_int(where, "group_size", group_size)
        if self.num_groups is None and self.group_size != 1:
            raise ValueError(
                f"{where}: `group_size` ({self.group_size}) needs `num_groups` (None: every "
                "layer has its own block)."
            )
        if self.num_groups is not None and self.num_groups > self.num_layers:
            raise ValueError(
                f"{where}: `num_groups` ({self.num_groups}) must be at most `num_layers` "
                f"({self.num_layers})."
            )
        self.epsilon = epsilon
        self.activation = activation
        dtype = self.dtype_policy
        width = self.embedding_size or hidden_size
        tables = [(vocab_size, "word"), (max_positions, "position")]
        tables += [(self.type_vocab_size, "token_type")] if self.type_vocab_size else []
        embeddings = [
            keras.layers.Embedding(rows, width, name=name, dtype=dtype,
                                   embeddings_initializer=keras_default("uniform"))
            for rows, name in tables
        ]  # fmt: skip
        self.word, self.position = embeddings[:2]
        self.token_type = embeddings[2] if self.type_vocab_size else None
        self.embedding_norm = LayerNormalization(
            epsilon=epsilon, name="embedding_norm", dtype=dtype
        )
        self.embedding_projection = None
        if self.embedding_size is not None:
            self.embedding_projection = keras.layers.EinsumDense(
                "bte,eh->bth", (None, hidden_size), bias_axes="h",
                name="embedding_projection", dtype=dtype,
                kernel_initializer=keras_default("glorot_uniform"),
            )  # fmt: skip
        # which block each application runs (ALBERT's groups), in order
        if self.num_groups is None:
            distinct, self.schedule = num_layers, list(range(num_layers))
        else:
            distinct = self.num_groups * self.group_size
            per_group = self.num_layers / self.num_groups
            self.schedule = [
                int(i / per_group) * self.group_size + j
                for i in range(self.num_layers)
                for j in range(self.group_size)
            ]
        # TransformerEncoderLayer validates num_heads, epsilon and activation.
        self.blocks = [
            TransformerEncoderLayer(
                hidden_size,
                num_heads,
                intermediate_size,
                rate=0.0,
                epsilon=epsilon,
                activation=activation,
                name=f"layer_{i}",
                dtype=dtype,
            )
            for i in range(distinct)
        ]

    def build(self, token_ids_shape, attention_mask_shape=None, token_type_ids_shape=None):
        for emb in (self.word, self.position, self.token_type):
            if emb is not None:
                emb.build((None, None))
        width = self.embedding_size or self.hidden_size
        self.embedding_norm.build((None, None, width))
        if self.embedding_projection is not None:
            self.embedding_projection.build((None, None, width))
        shape = (None, None, self.hidden_size)
        for block in self.blocks:
            block.build(shape)

    def token_states(self, token_ids, attention_mask=None, token_type_ids=None,
                     ids_name="token_ids"):  # fmt: skip
        """``(states (batch, seq, hidden), keep (batch, seq) bool)``: the last encoder
        block's output for every token, and which tokens are real (True). ``ids_name``:
        the ids' argument in the caller's signature (named by errors)."""
        ops = keras.ops
        where, n = type(self).__name__, ids_name
        token_ids, valid = checked_ids(where, n, token_ids, self.vocab_size)
        if attention_mask is None:
            attention_mask = ops.ones_like(token_ids)
        attention_mask = padding_mask(where, "attention_mask", attention_mask, token_ids)
        seq, pad = token_ids.shape[1], self.position_padding_idx
        limit = self.max_positions - (0 if pad is None else pad + 1)
        if seq is not None and seq > limit:
            offset = "" if pad is None else f" less position_padding_idx + 1 = {pad + 1}"
            raise ValueError(
                f"{where}: sequences may hold at most max_positions={self.max_positions}"
                f"{offset} tokens; received `{n}` of shape {tuple(token_ids.shape)}."
            )
        types, type_valid = ops.zeros_like(token_ids), None
        if token_type_ids is not None and self.token_type is None:
            raise ValueError(
                f"{where}: this model has no token types (type_vocab_size=0); received "
                "`token_type_ids`."
            )
        if token_type_ids is not None:
            types, type_valid = checked_ids(where, "token_type_ids", token_type_ids,
                                            self.type_vocab_size)  # fmt: skip
            if tuple(types.shape) != tuple(token_ids.shape):
                raise ValueError(
                    f"{where}: `token_type_ids` must have the shape of `{n}` "
                    f"{tuple(token_ids.shape)}; received {tuple(types.shape)}."
                )
        if pad is None:
            positions = ops.cumsum(ops.ones_like(token_ids), axis=1) - 1  # 0, 1, ... per row
        else:  # pad + 1, pad + 2, ... over the non-pad ids; a pad id gets pad
            real = ops.cast(ops.not_equal(token_ids, pad), "int32")  # the ids are int32
            # (cast: Paddle's cumsum of int32 is int64)
            positions = ops.cast(ops.cumsum(real, axis=1), "int32") * real + pad
        # BERT's order: (word + token type) + position.
        x = self.word(token_ids)
        if self.token_type is not None:
            x = x + self.token_type(types)
        x = poison(poison(self.embedding_norm(x + self.position(positions)), valid), type_valid)
        if self.embedding_projection is not None:
            x = self.embedding_projection(x)
        keep = ops.not_equal(attention_mask, 0)  # (batch, seq), True = real token
        # (batch, 1, seq): padded keys are masked for every query, padded queries included
        # (as BERT). A (batch, seq) mask would become the blocks' Keras sequence mask and
        # also mask the padded queries of the next block.
        key_mask = ops.expand_dims(keep, 1)
        for index in self.schedule:
            x = self.blocks[index](x, mask=key_mask)
        return x, keep

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "max_positions": self.max_positions,
            "type_vocab_size": self.type_vocab_size,
            "epsilon": self.epsilon,
            "activation": self.activation,
            "position_padding_idx": self.position_padding_idx,
            "embedding_size": self.embedding_size,
            "num_groups": self.num_groups,
            "group_size": self.group_size,
        }


@keras.saving.register_keras_serializable(package="multiattn")
class BertSentenceEncoder(_BertStack):
    """BERT encoder with mean pooling: token ids -> one embedding per sentence.

    Sublayers: ``word``, ``position``, ``token_type`` (``keras.layers.Embedding``),
    ``embedding_norm`` (`multiattn.layers.LayerNormalization`) and ``blocks``, a list of
    ``num_layers`` `multiattn.layers.TransformerEncoderLayer` (post-LayerNorm, no dropout).

    Args:
        vocab_size, hidden_size, num_layers, num_heads: BERT's sizes (``hidden_size``
            divisible by ``num_heads``).
        intermediate_size, max_positions, type_vocab_size: feed-forward width, number of
            position embeddings, number of token types.
        epsilon: LayerNormalization epsilon (BERT: 1e-12).
        activation: feed-forward activation; ``"gelu"`` is Keras' exact (erf) GELU, as BERT.
        normalize: L2-normalise the pooled embedding (sentence-transformers' ``Normalize``).

    Call arguments:
        token_ids: int ``(batch, seq)``, ``seq <= max_positions``.
        attention_mask: int or bool ``(batch, seq)``; non-zero / True = a real token that
            may be attended and is pooled, 0 / False = padding (gets exactly zero
            attention weight and is left out of the mean).
        token_type_ids: int ``(batch, seq)``, default all zeros.

    Returns:
        ``(batch, hidden_size)`` in the layer's compute dtype (float32 by default). A row
        with no real token pools to zeros.
    """

    def __init__(self, *args: Any, normalize: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not isinstance(normalize, bool):
            raise TypeError(
                f"BertSentenceEncoder: `normalize` must be a bool; received {normalize!r}."
            )
        self.normalize = normalize

    def call(self, token_ids, attention_mask, token_type_ids=None):
        ops = keras.ops
        x, keep = self.token_states(token_ids, attention_mask, token_type_ids)
        weight = ops.expand_dims(ops.cast(keep, x.dtype), -1)
        count = ops.maximum(ops.sum(weight, axis=1), 1e-9)
        pooled = ops.sum(x * weight, axis=1) / count
        if not self.normalize:
            return pooled
        norm = ops.sqrt(ops.sum(ops.square(pooled), axis=-1, keepdims=True))
        return pooled / ops.maximum(norm, 1e-12)

    def compute_output_shape(self, token_ids_shape, *args, **kwargs):
        return (token_ids_shape[0], self.hidden_size)

    def get_config(self) -> dict:
        return {**super().get_config(), "normalize": self.normalize}


@keras.saving.register_keras_serializable(package="multiattn")
class BertModel(_BertStack):
    """BERT's base model as transformers' ``BertModel`` computes it (inference).

    The sublayers, arguments and token handling of `BertSentenceEncoder` (without
    ``normalize``; with the encoder families' options of `_BertStack`:
    ``position_padding_idx``, ``type_vocab_size=0``, ``embedding_size``, ``num_groups``,
    ``group_size``), plus, with ``add_pooling_layer``, ``pooler``: a ``(hidden, hidden)``
    projection with tanh applied to the first token's state.

    With ``masked_lm`` (transformers' ``*ForMaskedLM``), the masked-LM head: ``mlm_dense``
    (``hidden_size -> embedding_size or hidden_size``), the activation ``head_activation``
    (one of `multiattn.ops.ACTIVATIONS`), ``mlm_norm`` (LayerNorm, epsilon
    ``head_epsilon``, default ``epsilon``), then the product with the word embeddings
    (tied: the same variable as ``word``) plus ``mlm_bias`` ``(vocab_size,)``. A pooler
    held with the head (checkpoints that carry one) is kept for saving, not computed.

    With ``discriminator`` (ELECTRA's ``ElectraForPreTraining``: is each token the original
    or a replacement?), the head ``discriminator_dense`` (``hidden -> hidden``), the
    activation ``head_activation``, then ``discriminator_prediction`` (``hidden -> 1``):
    one logit per token. It excludes ``masked_lm``.

    Call arguments:
        input_ids: int ``(batch, seq)``, ``seq <= max_positions``.
        attention_mask: int or bool ``(batch, seq)``, default all ones; non-zero / True =
            a real token that may be attended, 0 / False = padding (exactly zero attention
            weight). Padded positions still get a state (computed from the real tokens).
            A row with no real token gives zero attention output (transformers averages
            uniformly over the padding there instead).
        token_type_ids: int ``(batch, seq)``, default zeros.

    Returns:
        ``{"last_hidden_state": (batch, seq, hidden), "pooler_output": (batch, hidden)}``
        (``pooler_output`` only with ``add_pooling_layer``), in the compute dtype; with
        ``masked_lm``: ``{"logits": (batch, seq, vocab_size), "last_hidden_state": ...}``;
        with ``discriminator``: ``{"logits": (batch, seq), "last_hidden_state": ...}``.
    """

    def __init__(self, *args: Any, add_pooling_layer: bool = True, masked_lm: bool = False,
                 head_activation: str = "gelu", head_epsilon: float | None = None,
                 discriminator: bool = False, **kwargs: Any):  # fmt: skip
        super().__init__(*args, **kwargs)
        flags = (("add_pooling_layer", add_pooling_layer), ("masked_lm", masked_lm),
                 ("discriminator", discriminator))  # fmt: skip
        for name, flag in flags:
            if not isinstance(flag, bool):
                raise TypeError(f"BertModel: `{name}` must be a bool; received {flag!r}.")
        if masked_lm and discriminator:
            raise ValueError("BertModel: `masked_lm` and `discriminator` exclude each other.")
        self.add_pooling_layer, self.masked_lm = add_pooling_layer, masked_lm
        self.discriminator = discriminator
        self.head_activation = check_activation("BertModel", head_activation, "head_activation")
        if head_epsilon is not None and (
            isinstance(head_epsilon, bool) or not isinstance(head_epsilon, (int, float))
            or not head_epsilon > 0
        ):  # fmt: skip
            raise ValueError(
                f"BertModel: `head_epsilon` must be None or a positive float; received "
                f"{head_epsilon!r}."
            )
        self.head_epsilon = None if head_epsilon is None else float(head_epsilon)
        dtype = self.dtype_policy
        self.pooler = None
        if add_pooling_layer:
            self.pooler = keras.layers.EinsumDense(
                "be,ef->bf", (self.hidden_size,), bias_axes="f", name="pooler",
                dtype=dtype, kernel_initializer=keras_default("glorot_uniform"),
            )  # fmt: skip
        self.mlm_dense = self.mlm_norm = self.mlm_bias = None
        if masked_lm:
            self.mlm_dense = keras.layers.EinsumDense(
                "bte,ef->btf", (None, self.embedding_size or self.hidden_size),
                bias_axes="f", name="mlm_dense", dtype=dtype,
                kernel_initializer=keras_default("glorot_uniform"),
            )  # fmt: skip
            self.mlm_norm = LayerNormalization(
                epsilon=self.head_epsilon or self.epsilon, name="mlm_norm", dtype=dtype
            )
        self.discriminator_dense = self.discriminator_prediction = None
        if discriminator:
            self.discriminator_dense, self.discriminator_prediction = (
                keras.layers.EinsumDense(
                    "bte,ef->btf", (None, width), bias_axes="f", name=f"discriminator_{name}",
                    dtype=dtype, kernel_initializer=keras_default("glorot_uniform"),
                )
                for name, width in (("dense", self.hidden_size), ("prediction", 1))
            )  # fmt: skip

    def build(self, input_ids_shape, attention_mask_shape=None, token_type_ids_shape=None):
        super().build(input_ids_shape)
        if self.pooler is not None:
            self.pooler.build((None, self.hidden_size))
        if self.masked_lm:
            self.mlm_dense.build((None, None, self.hidden_size))
            self.mlm_norm.build((None, None, self.embedding_size or self.hidden_size))
            self.mlm_bias = self.add_weight(
                shape=(self.vocab_size,), initializer="zeros", name="mlm_bias"
            )
        if self.discriminator:
            self.discriminator_dense.build((None, None, self.hidden_size))
            self.discriminator_prediction.build((None, None, self.hidden_size))

    def call(self, input_ids, attention_mask=None, token_type_ids=None):
        x, _ = self.token_states(input_ids, attention_mask, token_type_ids, "input_ids")
        if self.masked_lm:
            h = self.mlm_norm(apply_activation(self.mlm_dense(x), self.head_activation))
            # the decoder is tied to the word embeddings (vocab, width)
            logits = keras.ops.einsum("btf,vf->btv", h, self.word.embeddings) + self.mlm_bias
            return {"logits": logits, "last_hidden_state": x}
        if self.discriminator:
            h = apply_activation(self.discriminator_dense(x), self.head_activation)
            return {"logits": self.discriminator_prediction(h)[..., 0], "last_hidden_state": x}
        out = {"last_hidden_state": x}
        if self.pooler is not None:
            out["pooler_output"] = pooler_activation("tanh")(self.pooler(x[:, 0]))
        return out

    def get_config(self) -> dict:
        return {**super().get_config(), "add_pooling_layer": self.add_pooling_layer,
                "masked_lm": self.masked_lm, "head_activation": self.head_activation,
                "head_epsilon": self.head_epsilon,
                "discriminator": self.discriminator}  # fmt: skip

    #: the optional `from_sizes` keys (absent: BERT's value)
    _OPTIONS = ("position_padding_idx", "embedding_size", "num_groups", "group_size",
                "activation", "masked_lm", "head_activation", "head_epsilon",
                "discriminator")  # fmt: skip

    @classmethod
    def from_sizes(cls, sizes: dict, pooler: bool, dtype: Any = None) -> BertModel:
        """A built `BertModel` from `multiattn.hf.families` / `multiattn.hf.encoders`
        sizes (used by `multiattn.hf.pretrained`)."""
        keys = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                "max_positions", "type_vocab_size", "epsilon")  # fmt: skip
        options = {k: sizes[k] for k in cls._OPTIONS if sizes.get(k) is not None}
        model = cls(**{k: sizes[k] for k in keys}, **options, add_pooling_layer=pooler,
                    dtype=dtype)  # fmt: skip
        model.build((None, None))
        return model

    def set_neutral_weights(self, weights: dict[str, np.ndarray]) -> None:
        set_bert_weights(self, weights)

    def neutral_weights(self) -> dict[str, np.ndarray]:
        return bert_weights(self)


def set_bert_weights(encoder: _BertStack, weights: dict[str, np.ndarray]) -> None:
    """Assign neutral BERT weights (`multiattn.hf.bert_weights` names) to ``encoder``
    (a `BertSentenceEncoder` or `BertModel`; the latter's pooler takes ``pooler/kernel``
    ``(hidden, hidden)`` and ``pooler/bias``).

    The embeddings are assigned directly; each encoder block goes through
    `multiattn.port.set_weights` with its ``layer_<i>/`` weights. Builds ``encoder`` first
    if needed.

    Raises:
        ValueError: a weight is missing or has the wrong shape.
    """
    from ..port import set_weights

    if not encoder.built:
        encoder.build((None, None))
    for name, variable in _variables(encoder).items():
        assign_weight(name, variable, weights)
    for i, block in enumerate(encoder.blocks):
        set_weights(block, layer_weights(weights, i))


def bert_weights(encoder: _BertStack) -> dict[str, np.ndarray]:
    """The neutral weights of a built ``encoder`` (the inverse of `set_bert_weights`), as
    NumPy arrays in the variables' dtype; the blocks' through `multiattn.port`'s reader of
    the layer (its weights only: `multiattn.port.get_weights` also checks the block's
    config for other frameworks, whose encoder layers have no tanh GELU, ALBERT's)."""
    from ..port.api import _handler, detect

    out = {
        name: np.asarray(keras.ops.convert_to_numpy(v)) for name, v in _variables(encoder).items()
    }
    for i, block in enumerate(encoder.blocks):
        target = detect(block)
        _, _, weights = _handler(target).read(target, block)
        out.update({f"layer_{i}/{k}": v for k, v in weights.items()})
    return out


def _variables(encoder: _BertStack) -> dict[str, Any]:
    """Neutral name -> variable, for everything outside the encoder blocks."""
    out = {
        "embeddings/word": encoder.word.embeddings,
        "embeddings/position": encoder.position.embeddings,
        "embeddings/norm/gamma": encoder.embedding_norm.gamma,
        "embeddings/norm/beta": encoder.embedding_norm.beta,
    }
    if encoder.token_type is not None:
        out["embeddings/token_type"] = encoder.token_type.embeddings
    projection = encoder.embedding_projection
    if projection is not None:
        out["embeddings/projection/kernel"] = projection.kernel
        out["embeddings/projection/bias"] = projection.bias
    pooler = getattr(encoder, "pooler", None)
    if pooler is not None:
        out["pooler/kernel"], out["pooler/bias"] = pooler.kernel, pooler.bias
    if getattr(encoder, "masked_lm", False):
        out["mlm/dense/kernel"], out["mlm/dense/bias"] = (
            encoder.mlm_dense.kernel,
            encoder.mlm_dense.bias,
        )
        out["mlm/norm/gamma"], out["mlm/norm/beta"] = encoder.mlm_norm.gamma, encoder.mlm_norm.beta
        out["mlm/bias"] = encoder.mlm_bias
    if getattr(encoder, "discriminator", False):
        for part in ("dense", "prediction"):
            layer = getattr(encoder, f"discriminator_{part}")
            out[f"discriminator/{part}/kernel"] = layer.kernel
            out[f"discriminator/{part}/bias"] = layer.bias
    return out


def assign_weight(
    name: str, variable: Any, weights: dict[str, np.ndarray], where: str = "set_bert_weights"
) -> None:
    """``variable`` set to ``weights[name]`` in its dtype; ``ValueError`` (starting with
    ``where``) when the name is missing or the shape differs."""
    if name not in weights:
        raise ValueError(f"{where}: `weights` has no {name!r}.")
    value = np.asarray(weights[name])
    if value.shape != tuple(variable.shape):
        raise ValueError(
            f"{where}: {name!r} must have shape {tuple(variable.shape)}; received {value.shape}."
        )
    variable.assign(value)  # cast to the variable's dtype


def from_checkpoint(model_dir: str | Path) -> tuple[BertSentenceEncoder, SentenceOptions]:
    """A `BertSentenceEncoder` with the weights of a sentence-transformers BERT directory.

    Returns:
        ``(encoder, options)``; ``options.max_length`` is the tokenizer's truncation length.
    """
    config, options, weights = load_checkpoint(model_dir)
    encoder = BertSentenceEncoder(**bert_sizes(config), normalize=options.normalize)
    set_bert_weights(encoder, weights)
    return encoder, options

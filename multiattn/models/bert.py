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
    `BertModel` (one forward pass: `token_states`)."""

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
            "type_vocab_size": type_vocab_size,
        }
        for name, value in sizes.items():
            setattr(self, name, check_positive_int(where, name, value))
        self.epsilon = epsilon
        self.activation = activation
        dtype = self.dtype_policy
        self.word, self.position, self.token_type = (
            keras.layers.Embedding(rows, hidden_size, name=name, dtype=dtype,
                                   embeddings_initializer=keras_default("uniform"))
            for rows, name in ((vocab_size, "word"), (max_positions, "position"),
                               (type_vocab_size, "token_type"))
        )  # fmt: skip
        self.embedding_norm = LayerNormalization(
            epsilon=epsilon, name="embedding_norm", dtype=dtype
        )
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
            for i in range(num_layers)
        ]

    def build(self, token_ids_shape, attention_mask_shape=None, token_type_ids_shape=None):
        for emb in (self.word, self.position, self.token_type):
            emb.build((None, None))
        shape = (None, None, self.hidden_size)
        self.embedding_norm.build(shape)
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
        seq = token_ids.shape[1]
        if seq is not None and seq > self.max_positions:
            raise ValueError(
                f"{where}: sequences may hold at most max_positions={self.max_positions} "
                f"tokens; received `{n}` of shape {tuple(token_ids.shape)}."
            )
        types, type_valid = ops.zeros_like(token_ids), None
        if token_type_ids is not None:
            types, type_valid = checked_ids(where, "token_type_ids", token_type_ids,
                                            self.type_vocab_size)  # fmt: skip
            if tuple(types.shape) != tuple(token_ids.shape):
                raise ValueError(
                    f"{where}: `token_type_ids` must have the shape of `{n}` "
                    f"{tuple(token_ids.shape)}; received {tuple(types.shape)}."
                )
        positions = ops.cumsum(ops.ones_like(token_ids), axis=1) - 1  # 0, 1, ... per row
        # BERT's order: (word + token type) + position.
        x = self.word(token_ids) + self.token_type(types)
        x = poison(poison(self.embedding_norm(x + self.position(positions)), valid), type_valid)
        keep = ops.not_equal(attention_mask, 0)  # (batch, seq), True = real token
        # (batch, 1, seq): padded keys are masked for every query, padded queries included
        # (as BERT). A (batch, seq) mask would become the blocks' Keras sequence mask and
        # also mask the padded queries of the next block.
        key_mask = ops.expand_dims(keep, 1)
        for block in self.blocks:
            x = block(x, mask=key_mask)
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
    ``normalize``), plus, with ``add_pooling_layer``, ``pooler``: a ``(hidden, hidden)``
    projection with tanh applied to the first token's state.

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
        (``pooler_output`` only with ``add_pooling_layer``), in the compute dtype.
    """

    def __init__(self, *args: Any, add_pooling_layer: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not isinstance(add_pooling_layer, bool):
            raise TypeError(
                f"BertModel: `add_pooling_layer` must be a bool; received {add_pooling_layer!r}."
            )
        self.add_pooling_layer = add_pooling_layer
        self.pooler = None
        if add_pooling_layer:
            self.pooler = keras.layers.EinsumDense(
                "be,ef->bf", (self.hidden_size,), bias_axes="f", name="pooler",
                dtype=self.dtype_policy, kernel_initializer=keras_default("glorot_uniform"),
            )  # fmt: skip

    def build(self, input_ids_shape, attention_mask_shape=None, token_type_ids_shape=None):
        super().build(input_ids_shape)
        if self.pooler is not None:
            self.pooler.build((None, self.hidden_size))

    def call(self, input_ids, attention_mask=None, token_type_ids=None):
        x, _ = self.token_states(input_ids, attention_mask, token_type_ids, "input_ids")
        out = {"last_hidden_state": x}
        if self.pooler is not None:
            out["pooler_output"] = pooler_activation("tanh")(self.pooler(x[:, 0]))
        return out

    def get_config(self) -> dict:
        return {**super().get_config(), "add_pooling_layer": self.add_pooling_layer}

    @classmethod
    def from_sizes(cls, sizes: dict, pooler: bool, dtype: Any = None) -> BertModel:
        """A built `BertModel` from `multiattn.hf.families` sizes (used by
        `multiattn.hf.pretrained`)."""
        keys = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                "max_positions", "type_vocab_size", "epsilon")  # fmt: skip
        model = cls(**{k: sizes[k] for k in keys}, add_pooling_layer=pooler, dtype=dtype)
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
    NumPy arrays in the variables' dtype; the blocks' through `multiattn.port.get_weights`."""
    from ..port import get_weights

    out = {
        name: np.asarray(keras.ops.convert_to_numpy(v)) for name, v in _variables(encoder).items()
    }
    for i, block in enumerate(encoder.blocks):
        out.update({f"layer_{i}/{k}": v for k, v in get_weights(block).weights.items()})
    return out


def _variables(encoder: _BertStack) -> dict[str, Any]:
    """Neutral name -> variable, for everything outside the encoder blocks."""
    out = {
        "embeddings/word": encoder.word.embeddings,
        "embeddings/position": encoder.position.embeddings,
        "embeddings/token_type": encoder.token_type.embeddings,
        "embeddings/norm/gamma": encoder.embedding_norm.gamma,
        "embeddings/norm/beta": encoder.embedding_norm.beta,
    }
    pooler = getattr(encoder, "pooler", None)
    if pooler is not None:
        out["pooler/kernel"], out["pooler/bias"] = pooler.kernel, pooler.bias
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

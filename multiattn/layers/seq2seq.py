"""RNN encoder-decoder with additive attention (document 003, machine translation).

The encoder reads the source tokens with a GRU. At every decoder step the previous hidden
state is the query of additive attention over the encoder outputs; the context vector it
returns is concatenated with the embedding of the step's input token and fed to a GRU
cell, whose new state gives the next token's logits. The attention itself is
`multiattn.layers.AdditiveAttention` (``additive_scores`` + the core's masked softmax).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from .._checks import (
    check_flag,
    check_positive_int,
    check_rank,
    check_rate,
    describe,
    fmt_shape,
)
from ..namespaces.keras import get_ops
from ..ops.masking import valid_lens_to_mask
from ._base import check_layer_seed, seed_generator, static_width
from .attention import AdditiveAttention

__all__ = ["Seq2SeqAttentionDecoder", "Seq2SeqEncoder"]


def _check_tokens(where: str, name: str, tokens: Any, rank: int) -> None:
    if not (hasattr(tokens, "shape") and hasattr(tokens, "dtype")):
        raise TypeError(f"{where}: `{name}` must be a tensor; received {describe(tokens)}.")
    shape = tuple(tokens.shape)
    check_rank(where, name, shape, rank, rank)
    dtype = keras.backend.standardize_dtype(tokens.dtype)
    if "int" not in dtype:
        raise TypeError(f"{where}: `{name}` must hold integer token ids; received dtype {dtype}.")


def _lens_mask(valid_lens: Any, batch: Any, length: Any) -> Any:
    """``(batch, length)`` bool, True at positions ``< valid_lens`` (the core's masking)."""
    keep = valid_lens_to_mask(valid_lens, (batch, 1, length), where="Seq2SeqEncoder")
    return keras.ops.reshape(keep, (batch, length))


@keras.saving.register_keras_serializable(package="multiattn")
class Seq2SeqEncoder(keras.layers.Layer):
    """GRU encoder of token sequences, the source side of `Seq2SeqAttentionDecoder`.

    ``outputs, state = GRU(dropout(Embedding(tokens)))``. With ``valid_lens`` the GRU skips
    the padding: positions ``>= valid_lens`` leave the state unchanged, so ``state`` is the
    state after the last valid token.

    Args:
        vocab_size: number of source token ids.
        embed_dim: width of the token embeddings.
        hidden_dim: GRU width (the width of ``outputs`` and ``state``).
        dropout: drop probability on the embeddings, training only.
        seed: int seed for dropout.

    Call arguments:
        tokens: ``(batch, src_len)`` integer ids.
        valid_lens: ``(batch,)`` integer source lengths in ``[0, src_len]``; None means
            every position is valid.
        training: enables dropout.

    Returns:
        ``outputs (batch, src_len, hidden_dim)`` (positions past a row's length hold
        whatever the GRU emits there; mask them with the same ``valid_lens`` downstream) and
        ``state (batch, hidden_dim)``, both in the layer's compute dtype.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        hidden_dim: int,
        dropout: float = 0.0,
        seed: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = "Seq2SeqEncoder"
        self.vocab_size = check_positive_int(where, "vocab_size", vocab_size)
        self.embed_dim = check_positive_int(where, "embed_dim", embed_dim)
        self.hidden_dim = check_positive_int(where, "hidden_dim", hidden_dim)
        self.dropout = check_rate(where, "dropout", dropout)
        self.seed = check_layer_seed(where, seed)
        self.seed_generator = seed_generator(where, seed)
        self.embedding = keras.layers.Embedding(
            vocab_size, embed_dim, dtype=self.dtype_policy, name="embedding"
        )
        self.gru = keras.layers.GRU(
            hidden_dim,
            return_sequences=True,
            return_state=True,
            dtype=self.dtype_policy,
            name="gru",
        )

    def build(self, tokens_shape):
        tokens_shape = tuple(tokens_shape)
        check_rank("Seq2SeqEncoder", "tokens", tokens_shape, 2, 2)
        self.embedding.build(tokens_shape)
        self.gru.build((*tokens_shape, self.embed_dim))

    def call(self, tokens, valid_lens=None, training=None):
        _check_tokens("Seq2SeqEncoder", "tokens", tokens, 2)
        training = check_flag(
            "Seq2SeqEncoder", "training", training, get_ops(tokens), allow_none=True
        )
        x = self.embedding(tokens)
        if self.dropout > 0.0 and training:
            x = keras.random.dropout(x, self.dropout, seed=self.seed_generator)
        mask = None
        if valid_lens is not None:
            shape = keras.ops.shape(tokens)
            mask = _lens_mask(valid_lens, shape[0], shape[1])
        outputs, state = self.gru(x, mask=mask, training=training)
        return outputs, state

    def compute_output_shape(self, tokens_shape, valid_lens_shape=None):
        batch, length = tuple(tokens_shape)
        return (batch, length, self.hidden_dim), (batch, self.hidden_dim)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "embed_dim": self.embed_dim,
            "hidden_dim": self.hidden_dim,
            "dropout": self.dropout,
            "seed": self.seed,
        }


@keras.saving.register_keras_serializable(package="multiattn")
class Seq2SeqAttentionDecoder(keras.layers.Layer):
    """GRU decoder with additive attention over the encoder outputs (Bahdanau style).

    One step, from the input token ``y`` and the state ``h`` (initially the encoder's
    final state)::

        context, weights = AdditiveAttention(query=h, value=enc_outputs, valid_lens)
        h = GRUCell(concat([dropout(Embedding(y)), context]), h)
        logits = Dense(h)

    `call` runs the steps with teacher forcing (the inputs are the target tokens shifted
    right); `step` runs one step and `decode` decodes greedily, both for inference.

    Args:
        vocab_size: number of target token ids (the width of the logits).
        embed_dim: width of the target token embeddings.
        hidden_dim: GRU width; the ``state`` passed in must have this width.
        attention_units: hidden width of the additive scoring layer (default
            ``hidden_dim``).
        dropout: drop probability on the target embeddings, training only.
        seed: int seed for dropout.

    Call arguments:
        targets: ``(batch, tgt_len)`` integer ids of the decoder inputs (teacher forcing);
            ``tgt_len`` must be static (known when the graph is traced).
        enc_outputs: ``(batch, src_len, enc_dim)`` floating, the encoder outputs (keys and
            values of the attention).
        state: ``(batch, hidden_dim)``, the initial decoder state.
        valid_lens: ``(batch,)`` integer source lengths; source positions ``>= valid_lens``
            get zero attention weight (True = may attend, as everywhere in multiattn).
        return_weights: also return the attention weights.
        training: enables dropout.

    Returns:
        ``logits (batch, tgt_len, vocab_size)`` in the compute dtype, and with
        ``return_weights=True`` also ``weights (batch, tgt_len, src_len)``: row ``t`` is the
        attention used to predict token ``t``. A row whose source length is 0 has zero
        weights and a zero context vector.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        hidden_dim: int,
        attention_units: int | None = None,
        dropout: float = 0.0,
        seed: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = "Seq2SeqAttentionDecoder"
        self.vocab_size = check_positive_int(where, "vocab_size", vocab_size)
        self.embed_dim = check_positive_int(where, "embed_dim", embed_dim)
        self.hidden_dim = check_positive_int(where, "hidden_dim", hidden_dim)
        self.attention_units = check_positive_int(
            where, "attention_units", attention_units, allow_none=True
        )
        self.dropout = check_rate(where, "dropout", dropout)
        self.seed = check_layer_seed(where, seed)
        self.seed_generator = seed_generator(where, seed)
        policy = self.dtype_policy
        self.embedding = keras.layers.Embedding(
            vocab_size, embed_dim, dtype=policy, name="embedding"
        )
        self.attention = AdditiveAttention(
            attention_units or hidden_dim, dtype=policy, name="attention"
        )
        self.cell = keras.layers.GRUCell(hidden_dim, dtype=policy, name="cell")
        self.output_layer = keras.layers.Dense(vocab_size, dtype=policy, name="output")
        self._enc_dim = None

    def build(self, targets_shape, enc_outputs_shape, state_shape):
        where = "Seq2SeqAttentionDecoder"
        targets_shape = tuple(targets_shape)
        check_rank(where, "targets", targets_shape, 2, 2)
        enc_dim = static_width(where, "enc_outputs", enc_outputs_shape)
        self._check_state_shape(tuple(state_shape))
        batch, src_len = tuple(enc_outputs_shape)[:2]
        self.embedding.build(targets_shape)
        self.attention.build((batch, 1, self.hidden_dim), (batch, src_len, enc_dim))
        self.cell.build((batch, self.embed_dim + enc_dim))
        self.output_layer.build((batch, self.hidden_dim))
        self._enc_dim = enc_dim

    def _check_state_shape(self, shape: tuple) -> None:
        where = "Seq2SeqAttentionDecoder"
        check_rank(where, "state", shape, 2, 2)
        if shape[-1] is not None and shape[-1] != self.hidden_dim:
            raise ValueError(
                f"{where}: `state` must have shape (batch, hidden_dim={self.hidden_dim}); "
                f"received {fmt_shape(shape)}."
            )

    def _check_inputs(self, enc_outputs, state) -> None:
        where = "Seq2SeqAttentionDecoder"
        es = tuple(enc_outputs.shape)
        check_rank(where, "enc_outputs", es, 3, 3)
        if self._enc_dim is not None and es[-1] is not None and es[-1] != self._enc_dim:
            raise ValueError(
                f"{where}: `enc_outputs` must have width {self._enc_dim} (the width the layer "
                f"was built with); received shape {fmt_shape(es)}."
            )
        self._check_state_shape(tuple(state.shape))

    def _advance(self, embedded, enc_outputs, state, valid_lens, training):
        """One step from an embedded input ``(batch, embed_dim)``."""
        context, weights = self.attention(
            keras.ops.expand_dims(state, 1),
            enc_outputs,
            valid_lens=valid_lens,
            return_weights=True,
            training=training,
        )
        x = keras.ops.concatenate([embedded, context[:, 0, :]], axis=-1)
        state, _ = self.cell(x, state, training=training)
        return self.output_layer(state), state, weights[:, 0, :]

    def _embed(self, tokens, training):
        x = self.embedding(tokens)
        if self.dropout > 0.0 and training:
            x = keras.random.dropout(x, self.dropout, seed=self.seed_generator)
        return x

    def call(
        self,
        targets,
        enc_outputs,
        state,
        valid_lens=None,
        return_weights=False,
        training=None,
    ):
        where = "Seq2SeqAttentionDecoder"
        _check_tokens(where, "targets", targets, 2)
        self._check_inputs(enc_outputs, state)
        ops = get_ops(targets)
        return_weights = check_flag(where, "return_weights", return_weights, ops)
        training = check_flag(where, "training", training, ops, allow_none=True)
        steps = targets.shape[1]
        if steps is None:
            raise ValueError(
                f"{where}: the length of `targets` must be static; received shape "
                f"{fmt_shape(tuple(targets.shape))}."
            )
        embedded = self._embed(targets, training)
        logits, weights = [], []
        for t in range(steps):
            step_logits, state, step_weights = self._advance(
                embedded[:, t, :], enc_outputs, state, valid_lens, training
            )
            logits.append(step_logits)
            weights.append(step_weights)
        logits = keras.ops.stack(logits, axis=1)
        return (logits, keras.ops.stack(weights, axis=1)) if return_weights else logits

    def compute_output_spec(
        self,
        targets,
        enc_outputs,
        state,
        valid_lens=None,
        return_weights=False,
        training=None,
    ):
        return_weights = check_flag(
            "Seq2SeqAttentionDecoder", "return_weights", return_weights, get_ops(targets)
        )
        batch, steps = tuple(targets.shape)
        logits = keras.KerasTensor((batch, steps, self.vocab_size), dtype=self.compute_dtype)
        if not return_weights:
            return logits
        src_len = tuple(enc_outputs.shape)[1]
        return logits, keras.KerasTensor((batch, steps, src_len), dtype=self.compute_dtype)

    def step(self, tokens, enc_outputs, state, valid_lens=None):
        """One inference step.

        Args:
            tokens: ``(batch,)`` integer ids of the step's input tokens.
            enc_outputs, state, valid_lens: as in `call`.

        Returns:
            ``logits (batch, vocab_size)``, the new ``state (batch, hidden_dim)`` and the
            attention ``weights (batch, src_len)`` that the step used.
        """
        _check_tokens("Seq2SeqAttentionDecoder.step", "tokens", tokens, 1)
        self._check_inputs(enc_outputs, state)
        if not self.built:
            self.build((tokens.shape[0], 1), tuple(enc_outputs.shape), tuple(state.shape))
        return self._advance(self._embed(tokens, False), enc_outputs, state, valid_lens, False)

    def decode(self, enc_outputs, state, start_tokens, steps, valid_lens=None):
        """Greedy decoding: each step's input is the previous step's most likely token.

        Args:
            enc_outputs, state, valid_lens: as in `call`.
            start_tokens: the first input token id, an int or ``(batch,)`` integers.
            steps: number of tokens to produce (a positive int).

        Returns:
            ``tokens (batch, steps)`` int32 and ``weights (batch, steps, src_len)``, the
            attention of each step. Decoding does not stop at an end token: cut the
            sequences where your end token first appears.
        """
        where = "Seq2SeqAttentionDecoder.decode"
        steps = check_positive_int(where, "steps", steps)
        batch = keras.ops.shape(enc_outputs)[0]
        if isinstance(start_tokens, (int, np.integer)) and not isinstance(start_tokens, bool):
            tokens = keras.ops.full((batch,), int(start_tokens), dtype="int32")
        else:
            tokens = keras.ops.convert_to_tensor(start_tokens)
        out, weights = [], []
        for _ in range(steps):
            logits, state, step_weights = self.step(tokens, enc_outputs, state, valid_lens)
            tokens = keras.ops.cast(keras.ops.argmax(logits, axis=-1), "int32")
            out.append(tokens)
            weights.append(step_weights)
        return keras.ops.stack(out, axis=1), keras.ops.stack(weights, axis=1)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "embed_dim": self.embed_dim,
            "hidden_dim": self.hidden_dim,
            "attention_units": self.attention_units,
            "dropout": self.dropout,
            "seed": self.seed,
        }

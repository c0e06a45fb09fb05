"""BART (``BartForConditionalGeneration``) built from multiattn's Transformer blocks
(Keras jax, torch, tensorflow; numpy for inference), with greedy and sampled generation.

An encoder of `multiattn.layers.TransformerEncoderLayer` s and a decoder of
`multiattn.layers.TransformerDecoderLayer` s, both post-LayerNorm (``x = norm(x +
sublayer(x))``) with biases in every projection, LayerNorm epsilon 1e-5 (PyTorch's
default, which BART uses) and the feed-forward activation of the config (exact ``gelu``
by default). Each stack embeds its tokens with the shared table, scaled by
``sqrt(hidden_size)`` when ``scale_embedding``, adds learned absolute positions read at
``position + 2`` (BART's offset: the first two rows of each table are never read), and
normalises the sum (``layernorm_embedding``). Positions count from the first column
whatever the padding (as transformers: a left-padded row's first real token is not at
position 0). The logits are the decoder output projected onto the shared embeddings
(tied) plus ``final_logits_bias``.

Generation (`multiattn.decoding.GenerationMixin`) encodes the prompt once, projects each
decoder block's cross-attention keys and values once, and decodes through the decoder's
self-attention KV cache from ``decoder_start_token_id``; the first new token is forced to
``forced_bos_token_id`` and the last one (the ``max_new_tokens``-th) to
``forced_eos_token_id`` where they are set, as transformers' ``ForcedBOSTokenLogitsProcessor``
and ``ForcedEOSTokenLogitsProcessor`` do (the logits of those steps become 0 at the forced
ids and ``-inf`` elsewhere, before sampling).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np

from .._checks import check_bool, check_positive_int, describe
from ..decoding._checks import check_int
from ..decoding.generation import (
    GenerationMixin,
    check_cache_size,
    check_new_tokens,
    prompt_arrays,
)
from ..layers import LayerNormalization, TransformerDecoderLayer, TransformerEncoderLayer
from ._ids import padding_mask, poison, token_ids
from .bert import assign_weight
from .causal_lm import step_ids, step_index

__all__ = ["BartConfig", "BartForConditionalGeneration"]

_SIZE_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_decoder_layers", "num_heads",
              "num_decoder_heads", "intermediate_size", "decoder_intermediate_size",
              "max_positions")  # fmt: skip
#: BART's positions start at row 2 of each table (`BartLearnedPositionalEmbedding`).
POSITION_OFFSET = 2
#: The activations the blocks take here (Keras' names; ``gelu`` is the exact GELU).
ACTIVATIONS = ("gelu", "relu", "silu")


@dataclasses.dataclass(frozen=True)
class BartConfig:
    """The options of a `BartForConditionalGeneration`, checked when made (errors name the
    field and quote the value).

    Fields:
        vocab_size, hidden_size: the vocabulary and the width (``d_model``); the width
            must be divisible by both head counts.
        num_layers, num_decoder_layers: encoder and decoder blocks (``encoder_layers``,
            ``decoder_layers``).
        num_heads, num_decoder_heads: the heads of the encoder's and of the decoder's
            attentions (``encoder_attention_heads``, ``decoder_attention_heads``; the
            decoder's cross-attention has the decoder's heads).
        intermediate_size, decoder_intermediate_size: the feed-forward widths
            (``encoder_ffn_dim``, ``decoder_ffn_dim``).
        max_positions: ``max_position_embeddings``; each position table has
            ``max_positions + 2`` rows.
        activation: of the feed-forward networks, one of `ACTIVATIONS`.
        scale_embedding: multiply the token embeddings by ``sqrt(hidden_size)``.
        epsilon: of every LayerNorm (1e-5 in BART).
        decoder_start_token_id: the first decoder token of `generate`, in ``[0,
            vocab_size)``.
        forced_bos_token_id: None, or the id `generate` forces as the first new token.
        forced_eos_token_id: ids (a tuple; empty for none) `generate` forces as the last
            new token (greedy decoding takes the smallest of them, as transformers).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_decoder_layers: int
    num_heads: int
    num_decoder_heads: int
    intermediate_size: int
    decoder_intermediate_size: int
    max_positions: int
    activation: str = "gelu"
    scale_embedding: bool = False
    epsilon: float = 1e-5
    decoder_start_token_id: int = 2
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple = (2,)

    def __post_init__(self) -> None:
        where = "BartConfig"
        checked = {k: check_positive_int(where, k, getattr(self, k)) for k in _SIZE_KEYS}
        for key in ("num_heads", "num_decoder_heads"):
            if checked["hidden_size"] % checked[key]:
                raise ValueError(f"{where}: `hidden_size` ({self.hidden_size}) must be "
                                 f"divisible by `{key}` ({checked[key]}).")  # fmt: skip
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{where}: `activation` must be one of {list(ACTIVATIONS)}; "
                             f"received {self.activation!r}.")  # fmt: skip
        check_bool(where, "scale_embedding", self.scale_embedding)
        eps = self.epsilon
        if (
            isinstance(eps, bool)
            or not isinstance(eps, (int, float))
            or not (eps > 0 and math.isfinite(eps))
        ):
            raise ValueError(f"{where}: `epsilon` must be a positive finite number; "
                             f"received {eps!r}.")  # fmt: skip
        vocab = checked["vocab_size"]
        checked["decoder_start_token_id"] = self._token("decoder_start_token_id",
                                                        self.decoder_start_token_id, vocab)  # fmt: skip
        if self.forced_bos_token_id is not None:
            checked["forced_bos_token_id"] = self._token("forced_bos_token_id",
                                                         self.forced_bos_token_id, vocab)  # fmt: skip
        eos = self.forced_eos_token_id
        if not isinstance(eos, (tuple, list)):
            raise TypeError(f"{where}: `forced_eos_token_id` must be a tuple of token ids; "
                            f"received {describe(eos)}.")  # fmt: skip
        checked["forced_eos_token_id"] = tuple(self._token("forced_eos_token_id", t, vocab)
                                               for t in eos)  # fmt: skip
        checked["epsilon"] = float(eps)
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @staticmethod
    def _token(name: str, value: Any, vocab: int) -> int:
        token = check_int("BartConfig", name, value, 0)
        if token is None or token >= vocab:
            raise ValueError(f"BartConfig: `{name}` must be a token id in [0, {vocab}); "
                             f"received {value!r}.")  # fmt: skip
        return token

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``BartConfig(**d)`` remakes it)."""
        return dataclasses.asdict(self)


def bart_config(where: str, config: Any) -> BartConfig:
    """``config`` as a `BartConfig` (a dict of its fields is made into one)."""
    if isinstance(config, dict):
        config = BartConfig(**config)
    if not isinstance(config, BartConfig):
        raise TypeError(f"{where}: `config` must be a BartConfig or a dict of its fields; "
                        f"received {describe(config)}.")  # fmt: skip
    return config


@keras.saving.register_keras_serializable(package="multiattn")
class BartForConditionalGeneration(GenerationMixin, keras.layers.Layer):
    """BART encoder-decoder: token ids -> next-token logits of the decoder.

    Weights: ``shared`` ``(vocab_size, hidden_size)`` (the embeddings of both stacks and
    the output projection), ``encoder_positions`` / ``decoder_positions``
    ``(max_positions + 2, hidden_size)``, ``encoder_norm`` / ``decoder_norm`` (the
    LayerNorms after the embeddings), ``encoder_blocks`` (`TransformerEncoderLayer`,
    named ``encoder_<i>``), ``decoder_blocks`` (`TransformerDecoderLayer`, named
    ``decoder_<i>``) and ``final_logits_bias`` ``(vocab_size,)``.

    Args:
        config: a `BartConfig` (or a dict of its fields).
        **kwargs: ``keras.layers.Layer`` arguments (``name``, ``dtype``, ...).

    Call arguments:
        input_ids: int ``(batch, src)``, ``src <= max_positions``; attention_mask:
            ``(batch, src)``, 1 / True = real token (any padding pattern), default all ones.
        decoder_input_ids: int ``(batch, tgt)`` (required), ``tgt <= max_positions``;
            decoder_attention_mask: ``(batch, tgt)`` keys the decoder may attend (with the
            causal mask), default all ones.

    Returns:
        ``{"logits": (batch, tgt, vocab_size), "last_hidden_state": (batch, tgt,
        hidden_size) (the decoder's), "encoder_last_hidden_state": (batch, src,
        hidden_size)}`` in the compute dtype. Rows of padded positions are computed too and
        carry no meaning.
    """

    def __init__(self, config: BartConfig | dict, **kwargs):
        super().__init__(**kwargs)
        self.config = c = bart_config("BartForConditionalGeneration", config)
        for name in _SIZE_KEYS:
            setattr(self, name, getattr(c, name))
        self.decoder_start_token_id = c.decoder_start_token_id
        policy = self.dtype_policy
        common = {"rate": 0.0, "epsilon": c.epsilon, "activation": c.activation, "dtype": policy}
        self.encoder_blocks = [
            TransformerEncoderLayer(
                c.hidden_size, c.num_heads, c.intermediate_size, name=f"encoder_{i}", **common
            )
            for i in range(c.num_layers)
        ]
        self.decoder_blocks = [
            TransformerDecoderLayer(
                c.hidden_size,
                c.num_decoder_heads,
                c.decoder_intermediate_size,
                name=f"decoder_{i}",
                **common,
            )
            for i in range(c.num_decoder_layers)
        ]
        norm = {"epsilon": c.epsilon, "dtype": policy}
        self.encoder_norm = LayerNormalization(name="encoder_norm", **norm)
        self.decoder_norm = LayerNormalization(name="decoder_norm", **norm)
        self.max_positions = c.max_positions
        self.embed_scale = math.sqrt(c.hidden_size) if c.scale_embedding else 1.0

    def build(self, input_shape=None):
        v, e, p = self.vocab_size, self.hidden_size, self.max_positions + POSITION_OFFSET
        self.shared = self.add_weight(shape=(v, e), initializer="zeros", name="shared")
        self.encoder_positions = self.add_weight(shape=(p, e), initializer="zeros",
                                                 name="encoder_positions")  # fmt: skip
        self.decoder_positions = self.add_weight(shape=(p, e), initializer="zeros",
                                                 name="decoder_positions")  # fmt: skip
        self.final_logits_bias = self.add_weight(shape=(v,), initializer="zeros",
                                                 name="final_logits_bias")  # fmt: skip
        shape = (None, None, e)
        for block in (*self.encoder_blocks, *self.decoder_blocks):
            block.build(shape)
        self.encoder_norm.build(shape)
        self.decoder_norm.build(shape)

    # --- pieces of the forward pass ---------------------------------------------------

    def _embed(self, ids, positions, table, norm):
        """``norm(shared[ids] * embed_scale + table[positions + 2])``: ids int ``(batch,
        T)``, positions int ``(T,)``."""
        ops = keras.ops
        x = ops.cast(ops.take(self.shared, ids, axis=0), self.compute_dtype)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        rows = ops.take(table, ops.cast(positions, "int32") + POSITION_OFFSET, axis=0)
        return norm(x + ops.expand_dims(ops.cast(rows, self.compute_dtype), 0))

    def _head(self, x):
        """The tied projection plus ``final_logits_bias``."""
        ops = keras.ops
        logits = ops.einsum("bte,ve->btv", x, ops.cast(self.shared, x.dtype))
        return logits + ops.cast(self.final_logits_bias, x.dtype)

    def _ids(self, name, ids):
        """``(int32 ids, valid or None)`` (`multiattn.models._ids.token_ids`), the length
        checked against ``max_positions``."""
        ids, valid = token_ids("BartForConditionalGeneration", name, ids, self.vocab_size)
        length = ids.shape[1]
        if length is not None and length > self.max_positions:
            raise ValueError(
                f"BartForConditionalGeneration: `{name}` holds {length} tokens, more than "
                f"the positions (max_position_embeddings={self.max_positions})."
            )
        return ids, valid

    def _keep(self, name, mask, ids):
        """``(batch, seq)`` 0/1 -> bool ``(batch, seq)`` (None: all ones)."""
        if mask is None:
            return None
        mask = padding_mask("BartForConditionalGeneration", name, mask, ids)
        return keras.ops.not_equal(mask, 0)

    def encode(self, input_ids, attention_mask=None):
        """The encoder: ``(states (batch, src, hidden_size), bool keys (batch, src) or
        None)``."""
        ids, valid = self._ids("input_ids", input_ids)
        keep = self._keep("attention_mask", attention_mask, ids)
        positions = keras.ops.arange(ids.shape[1])
        x = poison(self._embed(ids, positions, self.encoder_positions, self.encoder_norm), valid)
        for block in self.encoder_blocks:
            x = block(x, mask=keep)
        return x, keep

    def call(self, input_ids, attention_mask=None, decoder_input_ids=None,
             decoder_attention_mask=None):  # fmt: skip
        if decoder_input_ids is None:
            raise ValueError("BartForConditionalGeneration: `decoder_input_ids` is required.")
        memory, memory_keep = self.encode(input_ids, attention_mask)
        ids, valid = self._ids("decoder_input_ids", decoder_input_ids)
        keep = self._keep("decoder_attention_mask", decoder_attention_mask, ids)
        if keep is not None:  # keys the decoder may attend, for every query
            keep = keras.ops.reshape(keep, (ids.shape[0], 1, 1, ids.shape[1]))
        positions = keras.ops.arange(ids.shape[1])
        x = poison(self._embed(ids, positions, self.decoder_positions, self.decoder_norm), valid)
        for block in self.decoder_blocks:
            x = block(x, memory, context_mask=memory_keep, mask=keep)
        return {"logits": self._head(x), "last_hidden_state": x,
                "encoder_last_hidden_state": memory}  # fmt: skip

    def compute_output_shape(self, input_ids_shape, attention_mask_shape=None,
                             decoder_input_ids_shape=None, decoder_attention_mask_shape=None):  # fmt: skip
        b, s = input_ids_shape
        t = None if decoder_input_ids_shape is None else decoder_input_ids_shape[1]
        e = self.hidden_size
        return {"logits": (b, t, self.vocab_size), "last_hidden_state": (b, t, e),
                "encoder_last_hidden_state": (b, s, e)}  # fmt: skip

    # --- generation -------------------------------------------------------------------

    def step(self, ids, caches, index, cross, memory_mask):
        """One decoder token ``ids`` ``(batch, 1)`` at cache slot (and position)
        ``index`` through the self-attention ``caches`` and the projected cross-attention
        keys/values ``cross`` (one pair per block; ``memory_mask`` bool ``(batch, src)``
        or None). Returns ``(logits (batch, vocab_size), new caches)``."""
        index = keras.ops.convert_to_tensor(index)
        positions = keras.ops.reshape(index, (1,))
        x = self._embed(ids, positions, self.decoder_positions, self.decoder_norm)
        new = []
        for block, cache, kv in zip(self.decoder_blocks, caches, cross):
            x, cache = block(x, context_key_value=kv, context_mask=memory_mask, cache=cache,
                             cache_index=index)  # fmt: skip
            new.append(cache)
        return self._head(x)[:, -1], new

    def init_caches(self, batch_size: int, max_length: int) -> list:
        """One empty self-attention KV cache per decoder block."""
        return [b.init_cache(batch_size, max_length, self.compute_dtype)
                for b in self.decoder_blocks]  # fmt: skip

    def _decoding_inputs(self, input_ids, attention_mask, max_new_tokens) -> tuple:
        """``(ids, mask, new)``: the encoder's prompt as int64 ``(batch, seq)`` (any
        padding pattern, at most ``max_positions`` tokens), its int64 0/1 mask and the
        number of new decoder tokens (at most ``max_positions``: the start token and the
        fed tokens take positions ``0 .. new - 1``)."""
        ids, mask = prompt_arrays(input_ids, attention_mask, self.vocab_size)
        new = check_new_tokens(max_new_tokens)
        p = self.max_positions
        if ids.shape[1] > p:
            raise ValueError(
                f"generate: the prompt (`input_ids`) holds {ids.shape[1]} tokens, more than "
                f"the encoder's positions (max_position_embeddings={p})."
            )
        if new > p:
            raise ValueError(
                f"generate: max_new_tokens={new} past the decoder's positions "
                f"(max_position_embeddings={p})."
            )
        c = self.config  # self-attention caches of new slots, cross-attention of the prompt
        per_slot = 2 * c.hidden_size * c.num_decoder_layers
        check_cache_size(ids.shape[0] * (new + ids.shape[1]) * per_slot, self.compute_dtype)
        return ids, mask, new

    def _forced(self, logits, t, new):
        """``logits`` ``(batch, vocab)`` of the ``t``-th new token (an int, or an int32
        tensor in a compiled loop) of ``new``, as transformers' forced-token processors
        leave them: 0 at ``forced_bos_token_id`` and ``-inf`` elsewhere for the first,
        the same at ``forced_eos_token_id`` for the last (which wins when they are one)."""
        ops, c = keras.ops, self.config
        rules = []
        if c.forced_bos_token_id is not None:
            rules.append((0, (c.forced_bos_token_id,)))
        if c.forced_eos_token_id:
            rules.append((new - 1, c.forced_eos_token_id))
        for at, ids in rules:
            row = np.full((1, self.vocab_size), -np.inf, np.float32)
            row[0, list(ids)] = 0.0
            row = ops.cast(ops.convert_to_tensor(row), logits.dtype)
            if isinstance(t, (int, np.integer)):
                logits = ops.broadcast_to(row, ops.shape(logits)) if int(t) == at else logits
            else:
                logits = ops.where(ops.equal(t, at), row, logits)
        return logits

    def _prefill(self, ids, mask, new, step) -> tuple:
        """Encode once, project the cross-attention keys/values once, then feed
        ``decoder_start_token_id`` at slot 0 of caches of ``new`` slots: ``(logits
        (batch, vocab) of the first new token, forced as `_forced` says, state, start)``,
        ``start`` the int64 ``(batch, 1)`` start tokens. The start token runs through the
        eager `step`, not ``step`` (the strategy's prompt step): one token after the eager
        encoder pass."""
        memory, memory_keep = self.encode(ids, mask)
        cross = [b.precompute_context(memory) for b in self.decoder_blocks]
        start = np.full((ids.shape[0], 1), self.decoder_start_token_id, np.int64)
        caches = self.init_caches(ids.shape[0], new)
        logits, caches = self.step(start.astype(np.int32), caches, np.asarray(0, np.int32),
                                   cross, memory_keep)  # fmt: skip
        state = {"caches": caches, "cross": cross, "memory_mask": memory_keep}
        return self._forced(logits, 0, new), state, start

    def _feed(self, step, token, t, state) -> Any:
        """Feed int ``(batch,)`` ``token`` (the ``t``-th new one) through ``step`` at slot
        ``t + 1``; updates ``state["caches"]`` and returns the logits of new token
        ``t + 1`` (forced as `_forced` says; the number of new tokens is the caches'
        slots)."""
        logits, state["caches"] = step(step_ids(token), state["caches"], step_index(t + 1),
                                       state["cross"], state["memory_mask"])  # fmt: skip
        new = int(state["caches"][0][0].shape[2])
        return self._forced(logits, t + 1, new)

    def get_config(self) -> dict:
        return {**super().get_config(), "config": self.config.to_dict()}

    # --- the protocol of `multiattn.hf.pretrained` --------------------------------

    @classmethod
    def from_sizes(cls, sizes: dict, pooler: bool = False, dtype: Any = None):
        """A built model from `multiattn.hf.bart` sizes."""
        model = cls(BartConfig(**sizes), dtype=dtype)
        model.build()
        return model

    def _variables(self) -> dict[str, Any]:
        out = {"shared": self.shared, "encoder/positions": self.encoder_positions,
               "decoder/positions": self.decoder_positions,
               "final_logits_bias": self.final_logits_bias}  # fmt: skip
        for side, norm in (("encoder", self.encoder_norm), ("decoder", self.decoder_norm)):
            for v in norm.weights:
                out[f"{side}/embedding_norm/{v.path.rsplit('/', 1)[-1]}"] = v
        for side, blocks in (("encoder", self.encoder_blocks), ("decoder", self.decoder_blocks)):
            for i, block in enumerate(blocks):
                for v in block.weights:
                    out[f"{side}/layer_{i}/{v.path.split(block.name + '/', 1)[1]}"] = v
        return out

    def set_neutral_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Assign neutral weights (`multiattn.hf.bart` names)."""
        for name, variable in self._variables().items():
            assign_weight(name, variable, weights, "BartForConditionalGeneration")

    def neutral_weights(self) -> dict[str, np.ndarray]:
        """The neutral weights as NumPy arrays in the variables' dtype."""
        return {k: np.asarray(keras.ops.convert_to_numpy(v)) for k, v in self._variables().items()}

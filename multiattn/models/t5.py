"""T5 (``T5ForConditionalGeneration``) built from multiattn layers (Keras jax, torch,
tensorflow; numpy for inference), with greedy and sampled generation.

An encoder and a decoder of pre-norm blocks: `T5Attention` (a `MultiHeadAttention`
without projection biases and without the ``1/sqrt(d)`` scaling of the scores),
`multiattn.layers.RMSNormalization` (no mean, no offset) and
`multiattn.layers.FeedForward` (``relu``, or gated ``gelu_new``). Positions enter only as
a relative position bias added to the self-attention scores (`relative_buckets`: a
learned ``(num_buckets, heads)`` table per stack, held by the first block in transformers
and shared by every block; the encoder's buckets are bidirectional, the decoder's look
back only). The decoder's output is scaled by ``d_model ** -0.5`` (unless
``scale_output`` is False) and projected onto the shared embeddings (tied).

Generation (`multiattn.decoding.GenerationMixin`) encodes the prompt once,
projects each decoder block's cross-attention keys and values once, and decodes through
the decoder's self-attention KV cache from ``decoder_start_token_id``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np

from .._checks import check_bool, check_positive_int, check_relative_buckets, describe
from ..decoding._checks import check_int
from ..decoding.generation import (
    GenerationMixin,
    check_cache_size,
    check_new_tokens,
    prompt_arrays,
)
from ..layers import FeedForward, MultiHeadAttention, RMSNormalization
from ..ops.activations import check_activation
from ..ops.normalization import check_epsilon
from ._ids import padding_mask, poison, token_ids
from .bert import assign_weight
from .causal_lm import CausalLM, step_ids, step_index

__all__ = ["T5Attention", "T5Block", "T5Config", "T5ForConditionalGeneration", "relative_buckets"]

_SIZE_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim",
              "intermediate_size", "num_buckets", "max_distance")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class T5Config:
    """The options of a `T5ForConditionalGeneration` and its `T5Block` s, checked when
    made (errors name the field and quote the value).

    Fields:
        vocab_size, hidden_size: the vocabulary and the width (``d_model``).
        num_layers, num_decoder_layers: encoder and decoder blocks (the second defaults
            to ``num_layers``).
        num_heads, head_dim, intermediate_size: the heads, their width (``d_kv``) and the
            feed-forward width (``d_ff``).
        num_buckets, max_distance: ``relative_attention_num_buckets`` (at least 4) and
            ``relative_attention_max_distance`` (more than ``num_buckets // 2``): see
            `multiattn._checks.check_relative_buckets`.
        epsilon: of every norm. activation, gated: the feed-forward network
            (``relu``/False, or ``gelu_new``/True for ``gated-gelu``).
        decoder_start_token_id: the first decoder token of `generate`, in ``[0,
            vocab_size)``.
        scale_output: scale the decoder output by ``d_model ** -0.5`` before the tied
            projection (original T5; transformers' ``scale_decoder_outputs``).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    num_decoder_layers: int | None = None
    num_buckets: int = 32
    max_distance: int = 128
    epsilon: float = 1e-6
    activation: str = "relu"
    gated: bool = False
    decoder_start_token_id: int = 0
    scale_output: bool = True

    def __post_init__(self) -> None:
        where = "T5Config"
        checked = {k: check_positive_int(where, k, getattr(self, k)) for k in _SIZE_KEYS}
        layers = self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers
        checked["num_decoder_layers"] = check_positive_int(where, "num_decoder_layers", layers)
        names = ("num_buckets", "max_distance")
        check_relative_buckets(where, checked["num_buckets"], checked["max_distance"], names)
        checked["epsilon"] = check_epsilon(where, self.epsilon)
        checked["activation"] = check_activation(where, self.activation)
        for name in ("gated", "scale_output"):
            check_bool(where, name, getattr(self, name))
        start = check_int(where, "decoder_start_token_id", self.decoder_start_token_id, 0)
        if start is None or start >= checked["vocab_size"]:
            raise ValueError(
                f"{where}: `decoder_start_token_id` must be a token id in [0, "
                f"{self.vocab_size}); received {self.decoder_start_token_id!r}."
            )
        checked["decoder_start_token_id"] = start
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``T5Config(**d)`` remakes it)."""
        return dataclasses.asdict(self)


def t5_config(where: str, config: Any) -> T5Config:
    """``config`` as a `T5Config` (a dict of its fields is made into one)."""
    if isinstance(config, dict):
        config = T5Config(**config)
    if not isinstance(config, T5Config):
        raise TypeError(f"{where}: `config` must be a T5Config or a dict of its fields; "
                        f"received {describe(config)}.")  # fmt: skip
    return config


def relative_buckets(
    distance: Any, bidirectional: bool, num_buckets: int, max_distance: int
) -> Any:
    """T5's bucket of each relative position ``distance`` (int tensor, key position minus
    query position): distances below half the buckets (of one direction) have a bucket
    each; longer ones share buckets spaced logarithmically up to ``max_distance``, beyond
    which they all fall into the last. ``bidirectional`` (the encoder) gives keys after
    the query the upper half of the buckets; otherwise (the decoder) keys after the query
    count as distance 0. The logarithm is taken in float32, as transformers does, so the
    buckets agree at their edges. Returns int32 of ``distance``'s shape."""
    ops = keras.ops
    distance = ops.cast(distance, "int32")
    offset = 0
    if bidirectional:
        num_buckets //= 2
        offset = ops.where(distance > 0, num_buckets, 0)
        distance = ops.abs(distance)
    else:
        distance = ops.maximum(-distance, 0)
    exact = num_buckets // 2
    ratio = ops.cast(ops.maximum(distance, 1), "float32") / float(exact)
    spread = ops.log(ratio) / math.log(max_distance / exact) * float(num_buckets - exact)
    far = ops.minimum(exact + ops.cast(spread, "int32"), num_buckets - 1)
    return offset + ops.where(distance < exact, distance, far)


@keras.saving.register_keras_serializable(package="multiattn")
class T5Attention(MultiHeadAttention):
    """`MultiHeadAttention` whose scores are the plain dot products (``scale = 1``), as
    in T5, where the ``1/sqrt(d)`` factor is folded into the initialisation. Arguments,
    weights and call as `MultiHeadAttention` (T5 uses ``use_bias=False`` and passes its
    relative position bias as ``attention_bias``)."""

    score_scale = 1.0


@keras.saving.register_keras_serializable(package="multiattn")
class T5Block(keras.layers.Layer):
    """One pre-norm T5 block: self-attention, cross-attention (``decoder`` only) and the
    feed-forward network, each ``x + sublayer(norm(x))``.

    Sublayers: ``self_attention``, ``norm_1``, ``cross_attention`` and ``norm_2``
    (decoder), ``ffn`` (`FeedForward`, no biases), ``norm_3``; every norm is
    `RMSNormalization` with ``epsilon``.

    Args:
        config: the model's `T5Config` (or a dict of its fields): the widths, heads,
            ``epsilon`` of the norms, ``activation`` and ``gated`` of the feed-forward
            network.
        decoder: add the cross-attention.

    The sublayers validate their own arguments (``ValueError``/``TypeError`` naming them).
    """

    def __init__(self, config: T5Config | dict, decoder: bool = False, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(decoder, bool):
            raise TypeError(f"T5Block: `decoder` must be a bool; received {decoder!r}.")
        self.config = c = t5_config("T5Block", config)
        self.hidden_size, self.decoder = c.hidden_size, decoder
        policy = self.dtype_policy

        def attention(name):
            return T5Attention(c.num_heads, c.head_dim, use_bias=False,
                               output_dim=c.hidden_size, name=name, dtype=policy)  # fmt: skip

        def norm(name):
            return RMSNormalization(epsilon=c.epsilon, name=name, dtype=policy)

        self.self_attention, self.norm_1 = attention("self_attention"), norm("norm_1")
        self.cross_attention = attention("cross_attention") if decoder else None
        self.norm_2 = norm("norm_2") if decoder else None
        self.ffn = FeedForward(c.intermediate_size, activation=c.activation, gated=c.gated,
                               use_bias=False, name="ffn", dtype=policy)  # fmt: skip
        self.norm_3 = norm("norm_3")

    def build(self, input_shape=None):
        shape = (None, None, self.hidden_size)
        for layer in (self.norm_1, self.norm_2, self.norm_3, self.ffn):
            if layer is not None:
                layer.build(shape)
        self.self_attention.build(shape, shape)
        if self.cross_attention is not None:
            self.cross_attention.build(shape, shape)

    def call(self, x, bias, keys=None, memory=None, memory_keys=None, causal=False):
        """``x`` ``(B, T, E)``; ``bias`` the relative position bias ``(1, H, T, T)``;
        ``keys`` bool ``(B, 1, 1, T)`` (keys that may be attended) or None; ``memory``
        the encoder output ``(B, S, E)`` (decoder) with its ``memory_keys`` ``(B, 1, 1,
        S)``; ``causal`` the decoder's self-attention mask."""
        h = self.norm_1(x)
        x = x + self.self_attention(h, h, mask=keys, causal=causal, attention_bias=bias)
        if self.cross_attention is not None:
            h = self.norm_2(x)
            x = x + self.cross_attention(h, memory, mask=memory_keys)
        return x + self.ffn(self.norm_3(x))

    def step(self, x, bias, cache, index, cross, memory_mask):
        """One decoding pass through the self-attention ``cache`` (at slot ``index``,
        ``bias`` over the cache slots) and the cross-attention keys and values
        ``cross`` projected once (`MultiHeadAttention.project_key_value`). Returns
        ``(x, new cache)``."""
        h = self.norm_1(x)
        out, cache = self.self_attention(h, cache=cache, cache_index=index, attention_bias=bias)
        x = x + out
        h = self.norm_2(x)
        x = x + self.cross_attention(h, key_value=cross, mask=memory_mask)
        return x + self.ffn(self.norm_3(x)), cache

    def get_config(self) -> dict:
        return {**super().get_config(), "config": self.config.to_dict(), "decoder": self.decoder}


@keras.saving.register_keras_serializable(package="multiattn")
class T5ForConditionalGeneration(GenerationMixin, keras.layers.Layer):
    """T5 encoder-decoder: token ids -> next-token logits of the decoder.

    Weights: ``shared`` ``(vocab_size, hidden_size)`` (the embeddings of both stacks and
    the output projection), ``encoder_bias`` and ``decoder_bias`` ``(num_buckets,
    num_heads)`` (relative position biases), ``encoder_blocks`` / ``decoder_blocks``
    (`T5Block`, named ``encoder_<i>`` / ``decoder_<i>``), ``encoder_norm`` and ``decoder_norm``.

    Args:
        config: a `T5Config` (or a dict of its fields).
        **kwargs: ``keras.layers.Layer`` arguments (``name``, ``dtype``, ...).

    Call arguments:
        input_ids: int ``(batch, src)``; attention_mask: ``(batch, src)``, 1 / True = real
            token (any padding pattern), default all ones.
        decoder_input_ids: int ``(batch, tgt)`` (required); decoder_attention_mask:
            ``(batch, tgt)`` keys the decoder may attend (with the causal mask), default
            all ones.

    Returns:
        ``{"logits": (batch, tgt, vocab_size), "last_hidden_state": (batch, tgt,
        hidden_size) (the decoder's, normalised, before the output scaling),
        "encoder_last_hidden_state": (batch, src, hidden_size)}`` in the compute dtype.
        Rows of padded positions are computed too and carry no meaning.
    """

    def __init__(self, config: T5Config | dict, **kwargs):
        super().__init__(**kwargs)
        self.config = c = t5_config("T5ForConditionalGeneration", config)
        for name in (*_SIZE_KEYS, "decoder_start_token_id", "scale_output"):
            setattr(self, name, getattr(c, name))
        policy = self.dtype_policy
        self.encoder_blocks = [T5Block(c, name=f"encoder_{i}", dtype=policy)
                               for i in range(c.num_layers)]  # fmt: skip
        self.decoder_blocks = [T5Block(c, decoder=True, name=f"decoder_{i}", dtype=policy)
                               for i in range(c.num_decoder_layers)]  # fmt: skip
        self.encoder_norm = RMSNormalization(epsilon=c.epsilon, name="encoder_norm", dtype=policy)
        self.decoder_norm = RMSNormalization(epsilon=c.epsilon, name="decoder_norm", dtype=policy)
        self.max_positions = None  # relative positions: no context limit

    def build(self, input_shape=None):
        v, e, b, h = self.vocab_size, self.hidden_size, self.num_buckets, self.num_heads
        self.shared = self.add_weight(shape=(v, e), initializer="zeros", name="shared")
        self.encoder_bias = self.add_weight(shape=(b, h), initializer="zeros", name="encoder_bias")
        self.decoder_bias = self.add_weight(shape=(b, h), initializer="zeros", name="decoder_bias")
        for block in (*self.encoder_blocks, *self.decoder_blocks):
            block.build()
        self.encoder_norm.build((None, None, e))
        self.decoder_norm.build((None, None, e))

    # --- pieces of the forward pass ---------------------------------------------------

    def _embed(self, ids):
        return keras.ops.cast(keras.ops.take(self.shared, ids, axis=0), self.compute_dtype)

    def _position_bias(self, queries, keys, decoder):
        """The relative position bias ``(1, H, Tq, Tk)`` of the queries at int positions
        ``queries`` ``(Tq,)`` (a tensor) over the keys ``0 .. keys - 1``."""
        ops = keras.ops
        distance = ops.arange(keys, dtype="int32")[None, :] - ops.cast(queries, "int32")[:, None]
        buckets = relative_buckets(distance, not decoder, self.num_buckets, self.max_distance)
        table = self.decoder_bias if decoder else self.encoder_bias
        bias = ops.take(ops.cast(table, self.compute_dtype), buckets, axis=0)  # (Tq, Tk, H)
        return ops.expand_dims(ops.transpose(bias, (2, 0, 1)), 0)

    def _head(self, x):
        """Final decoder norm, the ``d_model ** -0.5`` scaling (``scale_output``) and the
        tied projection."""
        x = self.decoder_norm(x)
        scaled = x * (self.hidden_size**-0.5) if self.scale_output else x
        logits = keras.ops.einsum("bte,ve->btv", scaled, keras.ops.cast(self.shared, x.dtype))
        return logits, x

    def _ids(self, name, ids):
        """``(int32 ids, valid or None)`` (`multiattn.models._ids.token_ids`)."""
        return token_ids("T5ForConditionalGeneration", name, ids, self.vocab_size)

    def _keys_mask(self, name, mask, ids):
        """``(batch, seq)`` 0/1 -> bool ``(batch, 1, 1, seq)`` (None: all ones)."""
        ops = keras.ops
        if mask is None:
            return None
        mask = padding_mask("T5ForConditionalGeneration", name, mask, ids)
        return ops.reshape(ops.not_equal(mask, 0), (ids.shape[0], 1, 1, ids.shape[1]))

    def encode(self, input_ids, attention_mask=None):
        """The encoder: ``(states (batch, src, hidden_size), keys mask or None)``."""
        ids, valid = self._ids("input_ids", input_ids)
        keep = self._keys_mask("attention_mask", attention_mask, ids)
        x = poison(self._embed(ids), valid)
        length = ids.shape[1]
        bias = self._position_bias(keras.ops.arange(length), length, decoder=False)
        for block in self.encoder_blocks:
            x = block(x, bias, keys=keep)
        return self.encoder_norm(x), keep

    def call(self, input_ids, attention_mask=None, decoder_input_ids=None,
             decoder_attention_mask=None):  # fmt: skip
        if decoder_input_ids is None:
            raise ValueError("T5ForConditionalGeneration: `decoder_input_ids` is required.")
        memory, memory_keep = self.encode(input_ids, attention_mask)
        ids, valid = self._ids("decoder_input_ids", decoder_input_ids)
        keep = self._keys_mask("decoder_attention_mask", decoder_attention_mask, ids)
        x = poison(self._embed(ids), valid)
        length = ids.shape[1]
        bias = self._position_bias(keras.ops.arange(length), length, decoder=True)
        for block in self.decoder_blocks:
            x = block(x, bias, keys=keep, memory=memory, memory_keys=memory_keep, causal=True)
        logits, x = self._head(x)
        return {"logits": logits, "last_hidden_state": x, "encoder_last_hidden_state": memory}

    def compute_output_shape(self, input_ids_shape, attention_mask_shape=None,
                             decoder_input_ids_shape=None, decoder_attention_mask_shape=None):  # fmt: skip
        b, s = input_ids_shape
        t = None if decoder_input_ids_shape is None else decoder_input_ids_shape[1]
        e = self.hidden_size
        return {"logits": (b, t, self.vocab_size), "last_hidden_state": (b, t, e),
                "encoder_last_hidden_state": (b, s, e)}  # fmt: skip

    # --- generation -------------------------------------------------------------------

    def step(self, ids, caches, index, cross, memory_mask):
        """One decoder token ``ids`` ``(batch, 1)`` at cache slot ``index`` through the
        self-attention ``caches`` and the projected cross-attention keys/values
        ``cross`` (one pair per block). Returns ``(logits (batch, vocab_size), new
        caches)``."""
        x = self._embed(ids)
        slots = keras.ops.shape(caches[0][0])[2]
        index = keras.ops.convert_to_tensor(index)
        bias = self._position_bias(keras.ops.reshape(index, (1,)), slots, decoder=True)
        new = []
        for block, cache, kv in zip(self.decoder_blocks, caches, cross):
            x, cache = block.step(x, bias, cache, index, kv, memory_mask)
            new.append(cache)
        return self._head(x)[0][:, -1], new

    def init_caches(self, batch_size: int, max_length: int) -> list:
        """One empty self-attention KV cache per decoder block."""
        return [b.self_attention.init_cache(batch_size, max_length, self.compute_dtype)
                for b in self.decoder_blocks]  # fmt: skip

    def _decoding_inputs(self, input_ids, attention_mask, max_new_tokens) -> tuple:
        """``(ids, mask, new)``: the encoder's prompt as int64 ``(batch, seq)`` (any
        padding pattern), its int64 0/1 mask and the number of new decoder tokens."""
        ids, mask = prompt_arrays(input_ids, attention_mask, self.vocab_size)
        new = check_new_tokens(max_new_tokens)
        c = self.config  # self-attention caches of new slots, cross-attention of the prompt
        per_slot = 2 * c.num_heads * c.head_dim * c.num_decoder_layers
        check_cache_size(ids.shape[0] * (new + ids.shape[1]) * per_slot, self.compute_dtype)
        return ids, mask, new

    def _prefill(self, ids, mask, new, step) -> tuple:
        """Encode once, project the cross-attention keys/values once, then feed
        ``decoder_start_token_id`` at slot 0 of caches of ``new`` slots: ``(logits
        (batch, vocab), state, start)``, ``start`` the int64 ``(batch, 1)`` start tokens.
        The start token runs through the eager `step`, not ``step`` (the strategy's
        prompt step): one token after the eager encoder pass."""
        memory, memory_keep = self.encode(ids, mask)
        cross = [b.cross_attention.project_key_value(memory) for b in self.decoder_blocks]
        start = np.full((ids.shape[0], 1), self.decoder_start_token_id, np.int64)
        caches = self.init_caches(ids.shape[0], new)
        logits, caches = self.step(start.astype(np.int32), caches, np.asarray(0, np.int32),
                                   cross, memory_keep)  # fmt: skip
        return logits, {"caches": caches, "cross": cross, "memory_mask": memory_keep}, start

    def _feed(self, step, token, t, state) -> Any:
        """Feed int ``(batch,)`` ``token`` (the ``t``-th new one) through ``step`` at slot
        ``t + 1``; updates ``state["caches"]`` and returns the next logits."""
        logits, state["caches"] = step(step_ids(token), state["caches"], step_index(t + 1),
                                       state["cross"], state["memory_mask"])  # fmt: skip
        return logits

    # beam search: the self-attention caches gathered by rows (the cross-attention keys,
    # values and mask are the same for every beam of a prompt)
    _reorder = CausalLM._reorder

    def get_config(self) -> dict:
        return {**super().get_config(), "config": self.config.to_dict()}

    # --- the protocol of `multiattn.hf.pretrained` --------------------------------

    @classmethod
    def from_sizes(cls, sizes: dict, pooler: bool = False, dtype: Any = None):
        """A built model from `multiattn.hf.t5` sizes."""
        model = cls(T5Config(**sizes), dtype=dtype)
        model.build()
        return model

    def _variables(self) -> dict[str, Any]:
        out = {"shared": self.shared, "encoder/relative_bias": self.encoder_bias,
               "decoder/relative_bias": self.decoder_bias}  # fmt: skip
        for side, norm in (("encoder", self.encoder_norm), ("decoder", self.decoder_norm)):
            for v in norm.weights:
                out[f"{side}/final_norm/{v.path.rsplit('/', 1)[-1]}"] = v
        for side, blocks in (("encoder", self.encoder_blocks), ("decoder", self.decoder_blocks)):
            for i, block in enumerate(blocks):
                for v in block.weights:
                    out[f"{side}/layer_{i}/{v.path.split(block.name + '/', 1)[1]}"] = v
        return out

    def set_neutral_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Assign neutral weights (`multiattn.hf.t5` names)."""
        for name, variable in self._variables().items():
            assign_weight(name, variable, weights, "T5ForConditionalGeneration")

    def neutral_weights(self) -> dict[str, np.ndarray]:
        """The neutral weights as NumPy arrays in the variables' dtype."""
        return {k: np.asarray(keras.ops.convert_to_numpy(v)) for k, v in self._variables().items()}

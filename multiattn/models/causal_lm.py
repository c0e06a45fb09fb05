"""A decoder-only language model built from multiattn layers (Keras jax, torch,
tensorflow; numpy for inference), with greedy and sampled generation through the KV cache.

`CausalLM` is one model for GPT-2, Llama, Qwen2 and Mistral: token embeddings (plus learned
position embeddings for GPT-2), pre-norm `multiattn.layers.TransformerDecoderOnlyLayer`
blocks (rotary positions inside the attention for the others), a final normalisation and
the output projection to the vocabulary (tied to the word embeddings or not). The family
only chooses the `CausalLMConfig` (from `multiattn.hf.causal_lm`); there is one
forward pass.

Positions of a left-padded batch are those transformers computes from the mask: a real
token's position is the number of real tokens before it (pads get 0), and pads are masked
as keys. Rotary attention depends only on position differences, so the rotary blocks run
on slot indices and give the same scores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from .._checks import check_bool, check_positive_int
from ..decoding.generation import (
    GenerationMixin,
    check_cache_size,
    check_lengths,
    left_padded_prompt,
)
from ..hf._tensors import Lazy
from ..layers import TransformerDecoderOnlyLayer
from ..layers._base import call_sublayer
from ..layers.decoder_only import (
    DecoderBlockConfig,
    block_config,
    check_float_option,
    check_overrides,
    make_norm,
    override_of,
)
from ..namespaces.keras import get_ops
from ._ids import ids_and_mask, poison
from ._moe_weights import stack_experts, unstack_experts
from .bert import assign_weight

__all__ = ["CausalLM", "CausalLMConfig"]

# The model's own fields among the flat sizes of `multiattn.hf.causal_lm`; the other keys
# are the blocks' (`DecoderBlockConfig`), four of them under Hugging Face names.
_MODEL_KEYS = ("vocab_size", "num_layers", "max_positions", "learned_positions", "tied",
               "fused_qkv", "fused_gate_up", "embed_scale", "logit_softcap", "head_bias",
               "position_offset", "final_norm", "embed_projection")  # fmt: skip
_BLOCK_NAMES = {"hidden_size": "d_model", "intermediate_size": "dff",
                "rope_theta": "rotary_base", "rope_scaling": "rotary_scaling"}  # fmt: skip


def split_sizes(sizes: dict[str, Any], model_keys: tuple[str, ...]) -> tuple[dict, dict]:
    """``(model fields, block fields)`` of a family's flat sizes dict: the ``model_keys``,
    with the per-layer sizes ``layers`` (the same names) as ``layer_overrides``, and the
    rest as `DecoderBlockConfig` fields (four of them renamed from Hugging Face's,
    `_BLOCK_NAMES`)."""
    rename = lambda d: {_BLOCK_NAMES.get(k, k): v for k, v in d.items()}  # noqa: E731
    model = {k: sizes[k] for k in model_keys if k in sizes}
    block = rename({k: v for k, v in sizes.items() if k not in model_keys and k != "layers"})
    if sizes.get("layers") is not None:
        model["layer_overrides"] = tuple(rename(layer) for layer in sizes["layers"])
    return model, block


@dataclasses.dataclass(frozen=True)
class CausalLMConfig:
    """The options of a `CausalLM`, checked when made (errors name the field and quote
    the value).

    Fields:
        vocab_size, num_layers: sizes.
        max_positions: the context (``max_position_embeddings`` / ``n_positions``): the
            learned position table's length; longer inputs are refused.
        block: every block's options, a `multiattn.layers.DecoderBlockConfig` (or a dict
            of its fields): widths, heads, normalisation, feed-forward network, biases,
            rotary positions, sliding window.
        learned_positions: learned absolute position embeddings added to the tokens
            (GPT-2); False (default): positions only inside the blocks (rotary).
        tied: the output projection is the word embedding matrix.
        fused_qkv: the neutral weights hold one ``layer_<i>/qkv`` projection (GPT-2's
            ``c_attn``, Phi-3's ``qkv_proj``): kernel ``(hidden_size, (H + 2 H_kv) D)``,
            the query heads' columns, then the keys', then the values' (and a bias of
            that width where the block has biases), instead of separate query, key and
            value kernels; the model is the same.
        fused_gate_up: likewise one ``layer_<i>/ffn/gate_up`` kernel ``(hidden_size, 2 *
            intermediate_size)``, the gate's columns then the up projection's (Phi-3's
            ``gate_up_proj``).
        embed_scale: the token embeddings are multiplied by this positive float (Gemma:
            ``sqrt(hidden_size)``), rounded to float32 first and then to the compute
            dtype, as transformers' float32 buffer is; None (default): not scaled.
        logit_softcap: soft-cap ``c`` of the logits, ``c * tanh(logits / c)`` in the
            compute dtype (Gemma 2's ``final_logit_softcapping``); None (default): none.
        layer_overrides: per-block differences from ``block``: a tuple (or list) of
            ``num_layers`` dicts of `DecoderBlockConfig` fields, block ``i`` being
            ``block`` with ``layer_overrides[i]`` replaced (e.g. Gemma 2's alternating
            ``{"sliding_window": 4096}`` / ``{}``, Gemma 3's per-layer ``rotary_base``);
            each is checked as a `DecoderBlockConfig` here. None (default): every block
            is ``block``. See `block_of`.
        head_bias: the output projection has a bias ``(vocab_size,)`` (Phi). Default
            False.
        position_offset: rows of the learned position table before position 0: the
            token at position ``p`` takes row ``p + position_offset`` of a table of
            ``max_positions + position_offset`` rows (OPT: 2). Default 0.
        final_norm: a normalisation after the last block (default True; False for
            post-norm models such as OPT-350m, whose blocks end in one).
        embed_projection: the word embeddings' width when it differs from
            ``hidden_size`` (OPT's ``word_embed_proj_dim``): the embedded tokens are
            projected to ``hidden_size`` (``project_in``, no bias) before the blocks
            and back (``project_out``) before the output projection, which then maps
            this width to the vocabulary. None (default): no projections.
    """

    vocab_size: int
    num_layers: int
    max_positions: int
    block: DecoderBlockConfig
    learned_positions: bool = False
    tied: bool = False
    fused_qkv: bool = False
    embed_scale: float | None = None
    logit_softcap: float | None = None
    layer_overrides: tuple[dict, ...] | None = None
    fused_gate_up: bool = False
    head_bias: bool = False
    position_offset: int = 0
    final_norm: bool = True
    embed_projection: int | None = None

    def __post_init__(self) -> None:
        where = "CausalLMConfig"
        for name in ("vocab_size", "num_layers", "max_positions"):
            object.__setattr__(self, name, check_positive_int(where, name, getattr(self, name)))
        for name in ("learned_positions", "tied", "fused_qkv", "fused_gate_up", "head_bias",
                     "final_norm"):  # fmt: skip
            check_bool(where, name, getattr(self, name))
        offset = self.position_offset
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(
                f"{where}: `position_offset` must be a non-negative int; received {offset!r}."
            )
        object.__setattr__(self, "embed_projection",
                           check_positive_int(where, "embed_projection", self.embed_projection,
                                              True))  # fmt: skip
        object.__setattr__(self, "block", block_config(where, self.block, {}))
        for name in ("embed_scale", "logit_softcap"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_float_option(where, name, getattr(self, name)))
        self._check_overrides(where)

    def _check_overrides(self, where: str) -> None:
        overrides = check_overrides(where, self.block, self.layer_overrides, self.num_layers)
        object.__setattr__(self, "layer_overrides", overrides)

    def block_of(self, index: int) -> DecoderBlockConfig:
        """The options of block ``index``: ``block`` with ``layer_overrides[index]``."""
        return override_of(self.block, self.layer_overrides, index)

    @classmethod
    def from_sizes(cls, sizes: dict[str, Any]) -> CausalLMConfig:
        """The config of the flat sizes dict of `multiattn.hf.causal_lm` (Hugging Face
        names): pre-norm blocks without dropout, rotary over ``max_positions`` unless
        the positions are learned."""
        model, block = split_sizes(sizes, _MODEL_KEYS)
        rotary = None if model.get("learned_positions") else sizes.get("max_positions")
        block.update(rate=0.0, norm_first=block.get("norm_first", True), rotary_max_length=rotary)
        return cls(**model, block=block)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``block`` a dict too; JSON-ready)."""
        return dataclasses.asdict(self)


@keras.saving.register_keras_serializable(package="multiattn")
class CausalLM(GenerationMixin, keras.layers.Layer):
    """Decoder-only language model: token ids -> next-token logits.

    Weights: ``word`` ``(vocab_size, hidden_size)``, ``position`` ``(max_positions,
    hidden_size)`` (``learned_positions`` only), ``blocks`` (``num_layers``
    `TransformerDecoderOnlyLayer` named ``layer_<i>``, pre-norm, no dropout),
    ``final_norm`` and ``lm_head`` ``(hidden_size, vocab_size)`` (unless ``tied``: the
    logits are then ``states @ word.T``).

    Args:
        config: a `CausalLMConfig` (or a dict of its fields, ``block`` a dict too).
        **kwargs: ``keras.layers.Layer`` arguments (``name``, ``dtype``, ...).

    Call arguments:
        input_ids: int ``(batch, seq)``, values in ``[0, vocab_size)``: checked eagerly
            (`ValueError` naming the value); inside a compiled function an id outside
            gives NaN outputs (`multiattn.models._ids`), never another id's.
        attention_mask: ``(batch, seq)``, 1 / True = real token, 0 = padding (left
            padding for generation); default all ones.

    Returns:
        ``{"logits": (batch, seq, vocab_size), "last_hidden_state": (batch, seq,
        hidden_size)}`` in the compute dtype. Rows of pad positions are computed too
        (from no keys, see docs/fully-masked-rows.md) and carry no meaning.
    """

    def __init__(self, config: CausalLMConfig | dict, **kwargs: Any):
        super().__init__(**kwargs)
        if isinstance(config, dict):
            config = CausalLMConfig(**config)
        if not isinstance(config, CausalLMConfig):
            raise TypeError(
                f"CausalLM: `config` must be a CausalLMConfig or a dict of its fields; "
                f"received {type(config).__name__}."
            )
        self.config = config
        policy = self.dtype_policy
        self.blocks = [
            TransformerDecoderOnlyLayer(
                config=config.block_of(i).for_layer(i), name=f"layer_{i}", dtype=policy
            )
            for i in range(config.num_layers)
        ]
        self.final_norm = (
            make_norm(config.block, "final_norm", self.dtype_policy) if config.final_norm else None
        )

    vocab_size = property(lambda self: self.config.vocab_size)
    hidden_size = property(lambda self: self.config.block.d_model)
    num_heads = property(lambda self: self.config.block.num_heads)
    num_layers = property(lambda self: self.config.num_layers)
    max_positions = property(lambda self: self.config.max_positions)
    learned_positions = property(lambda self: self.config.learned_positions)
    tied = property(lambda self: self.config.tied)
    fused_qkv = property(lambda self: self.config.fused_qkv)
    embed_width = property(lambda self: self.config.embed_projection or self.hidden_size)

    def build(self, input_ids_shape=None):
        e, v, w, c = self.hidden_size, self.vocab_size, self.embed_width, self.config
        add = lambda shape, name: self.add_weight(shape=shape, initializer="zeros", name=name)  # noqa: E731
        self.word = add((v, w), "word")
        rows = self.max_positions + c.position_offset
        self.position = add((rows, e), "position") if self.learned_positions else None
        self.lm_head = None if self.tied else add((w, v), "lm_head")
        self.lm_head_bias = add((v,), "lm_head_bias") if c.head_bias else None
        self.project_in = self.project_out = None
        if c.embed_projection is not None:
            self.project_in, self.project_out = (
                add((w, e), "project_in"),
                add((e, w), "project_out"),
            )
        for block in self.blocks:
            block.build((None, None, e))
        if self.final_norm is not None:
            self.final_norm.build((None, None, e))

    # --- the forward pass -------------------------------------------------------------

    def _embed(self, ids, positions):
        """Token (and learned position) embeddings of int ``ids`` at int ``positions``."""
        ops = keras.ops
        x = ops.cast(ops.take(self.word, ids, axis=0), self.compute_dtype)
        if self.config.embed_scale is not None:  # float32 first, as transformers' buffer
            x = x * ops.cast(float(np.float32(self.config.embed_scale)), self.compute_dtype)
        if self.project_in is not None:
            x = get_ops(x).linear(x, ops.cast(self.project_in, x.dtype))
        if self.position is not None:
            rows = positions + self.config.position_offset
            x = x + ops.cast(ops.take(self.position, rows, axis=0), self.compute_dtype)
        return x

    def _head(self, x) -> dict:
        if self.final_norm is not None:
            x = call_sublayer(self.final_norm, x)
        # The namespace's `linear` (one matrix product on torch CPU), not Keras' matmul,
        # whose torch float64 product returns float32.
        ops = get_ops(x)
        if self.project_out is not None:
            x = ops.linear(x, ops.cast(self.project_out, x.dtype))
        weight = ops.transpose(self.word) if self.tied else self.lm_head
        bias = None if self.lm_head_bias is None else ops.cast(self.lm_head_bias, x.dtype)
        logits = ops.linear(x, ops.cast(weight, x.dtype), bias)
        cap = self.config.logit_softcap
        if cap is not None:
            logits = ops.tanh(logits / cap) * cap
        return {"logits": logits, "last_hidden_state": x}

    def call(self, input_ids, attention_mask=None):
        ops = keras.ops
        ids, valid, mask = ids_and_mask("CausalLM", input_ids, attention_mask, self.vocab_size)
        seq = ids.shape[1]
        if seq is not None and seq > self.max_positions:
            raise ValueError(
                f"CausalLM: `input_ids` holds {seq} tokens, more than the context "
                f"(max_positions={self.max_positions})."
            )
        positions = ops.maximum(ops.cumsum(mask, axis=1) - 1, 0)
        x = poison(self._embed(ids, positions), valid)
        keep = ops.expand_dims(ops.cast(mask, "bool"), 1)  # (batch, 1, keys)
        for block in self.blocks:
            x = block(x, mask=keep)
        return self._head(x)

    def step(self, ids, positions, caches, index, slots):
        """One pass through the caches: ``ids`` ``(batch, t)`` at cache slots ``index ..
        index + t - 1`` with (learned) ``positions`` ``(batch, t)``; ``slots`` ``(batch,
        max_length)`` bool marks the cache slots that may be attended. Returns ``(logits
        of the last token (batch, vocab_size), new caches)``. Called eagerly, the blocks'
        ``call`` runs without Keras' per-call bookkeeping (`call_sublayer`)."""
        x = self._embed(ids, positions)
        new = []
        for block, cache in zip(self.blocks, caches):
            x, cache = call_sublayer(block, x, cache=cache, cache_index=index, key_mask=slots)
            new.append(cache)
        return self._head(x[:, -1:])["logits"][:, 0], new

    def init_caches(self, batch_size: int, max_length: int) -> list:
        """One empty KV cache per block (see `TransformerDecoderOnlyLayer.init_cache`)."""
        return [b.init_cache(batch_size, max_length, self.compute_dtype) for b in self.blocks]

    # --- the seams of `multiattn.decoding` (``generate``) -----------------------------

    def _decoding_inputs(self, input_ids, attention_mask, max_new_tokens) -> tuple:
        """``(ids, mask, new)``: the left-padded prompt as int64 ``(batch, seq)``, its
        mask as int64 0/1 and the number of new tokens, checked against the context."""
        ids, mask = left_padded_prompt(input_ids, attention_mask, self.vocab_size)
        new = check_lengths(ids.shape[1], max_new_tokens, self.max_positions)
        block = self.config.block
        per_slot = 2 * (block.num_key_value_heads or block.num_heads) * block.key_dim
        slots = ids.shape[0] * (ids.shape[1] + new) * self.num_layers
        check_cache_size(slots * per_slot, self.compute_dtype)
        return ids, mask, new

    def _prefill(self, ids, mask, new, step) -> tuple:
        """The prompt through ``step`` (`step`'s signature; the strategy's: eager, or
        compiled with the index static) into caches of ``seq + new`` slots: ``(logits of
        the last position (batch, vocab), state, ids)``; ``state`` holds the caches, the
        bool ``(batch, seq + new)`` slots that may be attended, each row's int32 number
        of real tokens and ``seq``."""
        batch, seq = ids.shape
        caches = self.init_caches(batch, seq + new)
        slots = keras.ops.convert_to_tensor(
            np.concatenate([mask, np.ones((batch, new), np.int64)], axis=1).astype(bool)
        )
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        logits, caches = step(ids, positions, caches, 0, slots)
        lengths = mask.sum(axis=1).astype(np.int32)
        return logits, {"caches": caches, "slots": slots, "lengths": lengths, "seq": seq}, ids

    def _feed(self, step, token, t, state):
        """Feed int ``(batch,)`` ``token`` (the ``t``-th new one; both may be traced, in
        a compiled loop) through ``step`` at slot ``seq + t``; updates ``state["caches"]``
        and returns the next float ``(batch, vocab)`` logits."""
        ops = keras.ops
        positions = ops.expand_dims(ops.convert_to_tensor(state["lengths"]) + t, 1)
        logits, state["caches"] = step(step_ids(token), positions, state["caches"],
                                       step_index(state["seq"] + t), state["slots"])  # fmt: skip
        return logits

    def _reorder(self, state, rows) -> None:
        """Beam search's seam (`multiattn.decoding.beams`): every cache of
        ``state["caches"]`` gathered along its batch axis at int ``(batch,)`` ``rows`` (row
        ``i`` becomes row ``rows[i]``), in place in ``state``. The rest of ``state`` is the
        same for every beam of a prompt. One definition: T5's is this one."""
        rows = np.asarray(rows, np.int32)
        take = lambda c: keras.ops.take(c, rows, axis=0)  # noqa: E731
        state["caches"] = keras.tree.map_structure(take, state["caches"])

    def compute_output_shape(self, input_ids_shape, attention_mask_shape=None):
        b, s = input_ids_shape
        return {"logits": (b, s, self.vocab_size), "last_hidden_state": (b, s, self.embed_width)}

    def get_config(self) -> dict:
        return {**super().get_config(), "config": self.config.to_dict()}

    # --- the protocol of `multiattn.hf.pretrained` --------------------------------

    @classmethod
    def from_sizes(cls, sizes: dict, pooler: bool = False, dtype: Any = None) -> CausalLM:
        """A built `CausalLM` from `multiattn.hf.causal_lm` sizes."""
        model = cls(CausalLMConfig.from_sizes(sizes), dtype=dtype)
        model.build()
        return model

    def _variables(self) -> dict[str, Any]:
        out = {"embed/word": self.word}
        if self.position is not None:
            out["embed/position"] = self.position
        if self.lm_head is not None:
            out["lm_head/kernel"] = self.lm_head
        if self.lm_head_bias is not None:
            out["lm_head/bias"] = self.lm_head_bias
        if self.project_in is not None:
            out["embed/project_in"], out["project_out/kernel"] = self.project_in, self.project_out
        for v in self.final_norm.weights if self.final_norm is not None else ():
            out[f"final_norm/{v.path.rsplit('/', 1)[-1]}"] = v
        for i, block in enumerate(self.blocks):
            for v in block.weights:
                out[f"layer_{i}/{v.path.split(block.name + '/', 1)[1]}"] = v
        return out

    def set_neutral_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Assign neutral weights (`multiattn.hf.causal_lm` names)."""
        weights = _split_fused(self, weights) if _fusions(self) else weights
        weights = stack_experts(weights, _experts(self)) if _experts(self) else weights
        for name, variable in self._variables().items():
            assign_weight(name, variable, weights, "CausalLM")

    def neutral_weights(self) -> dict[str, np.ndarray]:
        """The neutral weights as NumPy arrays in the variables' dtype."""
        out = {k: np.asarray(keras.ops.convert_to_numpy(v)) for k, v in self._variables().items()}
        out = unstack_experts(out, _experts(self)) if _experts(self) else out
        return _fuse(self, out) if _fusions(self) else out


def _experts(model: CausalLM) -> dict[str, int]:
    """``layer_<i>/ffn`` -> the number of experts, for each mixture-of-experts block (its
    neutral weights name each expert's kernels, `multiattn.models._moe_weights`)."""
    return {f"layer_{i}/ffn": b.config.moe.num_experts
            for i, b in enumerate(model.blocks) if b.config.moe is not None}  # fmt: skip


def step_index(index: Any) -> Any:
    """A step's cache index: a NumPy int32 for a Python int (a Python loop), the int32
    tensor itself in a compiled loop."""
    return np.int32(index) if isinstance(index, int) else index


def step_ids(token: Any) -> Any:
    """Int ``(batch,)`` chosen tokens (NumPy or tensor) as the int32 ``(batch, 1)`` ids of
    a step, a tensor of the model's framework."""
    return keras.ops.expand_dims(keras.ops.cast(token, "int32"), 1)


def _fusions(model: CausalLM) -> dict[str, list[str]]:
    """Fused neutral projections -> their parts, in column order (``fused_qkv``,
    ``fused_gate_up``): ``"layer_<i>/qkv/"`` -> the query, key and value prefixes."""
    out = {}
    for i in range(model.num_layers):
        if model.config.fused_qkv:
            out[f"layer_{i}/qkv/"] = [f"layer_{i}/self_attention/{p}/" for p in _QKV]
        if model.config.fused_gate_up:
            out[f"layer_{i}/ffn/gate_up/"] = [f"layer_{i}/ffn/gate/", f"layer_{i}/ffn/up/"]
    return out


_QKV = ("query", "key", "value")


def _split_fused(model: CausalLM, weights: Mapping) -> Lazy:
    """Each fused ``kernel`` ``(E, n)`` (and ``bias`` ``(n,)``) of `_fusions` -> its
    parts' variables, consecutive column ranges reshaped to the variables' shapes (exact
    copies), made as each is looked up (``weights`` may be lazy)."""
    shapes = {k: tuple(v.shape) for k, v in model._variables().items()}
    parts = {}
    for fused, names in _fusions(model).items():
        for kind in ("kernel", "bias"):
            if names[0] + kind not in shapes:
                continue
            if fused + kind not in weights:
                raise ValueError(f"CausalLM: `weights` has no {fused + kind!r}.")
            start = 0
            for name in names:
                width = int(np.prod(shapes[name + kind][1 if kind == "kernel" else 0 :]))
                parts[name + kind] = (fused + kind, start, start + width)
                start += width

    def make(name: str) -> np.ndarray:
        if name not in parts:
            return weights[name]
        fused, start, stop = parts[name]
        value = np.asarray(weights[fused])[..., start:stop]
        return np.ascontiguousarray(value.reshape(shapes[name]))

    used = {fused for fused, _, _ in parts.values()}
    return Lazy([k for k in weights if k not in used] + list(parts), make)


def _fuse(model: CausalLM, weights: dict) -> dict:
    """The inverse of `_split_fused`."""
    out = dict(weights)
    for fused, names in _fusions(model).items():
        for kind in ("kernel", "bias"):
            if names[0] + kind in out:
                rows = (out[names[0] + kind].shape[0],) if kind == "kernel" else ()
                values = [out.pop(n + kind).reshape(*rows, -1) for n in names]
                out[fused + kind] = np.concatenate(values, axis=-1)
    return out

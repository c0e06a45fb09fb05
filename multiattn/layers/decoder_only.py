"""Decoder-only Transformer block (GPT-2, Llama, Qwen2, Mistral): causal self-attention
and a feed-forward network, with incremental decoding through a key/value cache."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras

from .._checks import (
    check_bool,
    check_flag,
    check_float,
    check_positive_int,
    check_rate,
    describe,
)
from ..namespaces.keras import get_ops
from ..ops.activations import check_activation
from ..ops.normalization import check_epsilon
from ._base import (
    as_mask,
    block_initializers,
    call_sublayer,
    check_input_width,
    check_layer_seed,
    static_width,
    sublayer_initializers,
)
from ._mha_checks import check_kv_heads, check_rotary_args, check_sliding_window
from .feed_forward import FeedForward
from .moe import MixtureOfExperts, MoEConfig, moe_config
from .multi_head import MultiHeadAttention
from .normalization import LayerNormalization, RMSNormalization

__all__ = ["BLOCK_OPTIONS", "NORMS", "DecoderBlockConfig", "TransformerDecoderOnlyLayer"]

#: The normalisations of `TransformerDecoderOnlyLayer`: ``"layer"`` (LayerNorm, with
#: scale and offset: GPT-2) and ``"rms"`` (RMSNorm, scale only: Llama, Qwen2, Mistral).
NORMS = ("layer", "rms")


@dataclasses.dataclass(frozen=True)
class DecoderBlockConfig:
    """The options of one `TransformerDecoderOnlyLayer`, checked when made (errors name
    the field and quote the value). A model holds one and hands it to every block, so a
    new option of the block is one field here and the code that reads it.

    Fields:
        d_model: model width (``hidden_size``).
        num_heads: query heads.
        dff: hidden width of the feed-forward network (``intermediate_size``).
        rate: dropout rate after the attention and the feed-forward network (training
            only); default 0.1 as the other blocks.
        norm: ``"layer"`` (default) or ``"rms"`` (see `NORMS`).
        norm_first: pre-norm instead of post-norm (default False).
        epsilon: epsilon of both normalisations, a positive float (default 1e-6;
            GPT-2 uses 1e-5, Llama 1e-5 or 1e-6: read ``layer_norm_epsilon`` /
            ``rms_norm_eps`` from the checkpoint's config).
        activation: feed-forward activation, one of `multiattn.ops.ACTIVATIONS` (default
            ``"relu"``; GPT-2: ``"gelu_new"``; Llama, Qwen2, Mistral: ``"silu"`` with
            ``gated=True``).
        gated: gated feed-forward network (SwiGLU / GeGLU, see `FeedForward`).
        num_key_value_heads: key/value heads (grouped-query attention), a divisor of
            ``num_heads``; None: ``num_heads``.
        head_dim: per-head width of queries, keys and values; None (default): ``d_model
            // num_heads`` (``d_model`` must then be divisible by ``num_heads``).
        attention_bias: biases on the query, key and value projections (GPT-2 and Qwen2:
            True; Llama and Mistral: False). Default True.
        output_bias: bias on the attention output projection (GPT-2: True; Qwen2, Llama,
            Mistral: False). Default True.
        ffn_bias: biases in the feed-forward projections (GPT-2: True; Llama: False).
            Default True.
        rotary_max_length: rotary position embedding in the attention for positions up to
            this many; None (default): no positions inside the block.
        rotary_base, rotary_dim, rotary_interleaved, rotary_scaling: the rotary options of
            `MultiHeadAttention` (base ``rope_theta``; rotated features per head; pairs
            ``(2i, 2i + 1)``; Hugging Face style ``rope_scaling`` dict, kept normalised).
        sliding_window: each position attends only to itself and the ``sliding_window
            - 1`` positions before it (Mistral), in the full pass and through the cache;
            None (default): all earlier positions.
        qk_norm: RMSNorm over each head's ``head_dim`` queries and keys after their
            projections and before the rotary rotation (Qwen3, Gemma 3): sublayers
            ``self_attention/query_norm`` and ``self_attention/key_norm``, each a
            ``scale`` ``(head_dim,)`` shared by the heads, with the block's ``epsilon``
            (and ``norm_offset``). Needs ``norm="rms"``. Default False.
        norm_offset: every RMSNorm of the block (and of the model, its final norm)
            multiplies by ``1 + scale`` instead of ``scale`` (Gemma's checkpoints store
            the gain minus one), the one added in float32 for half-precision inputs
            (see `RMSNormalization`'s ``unit_offset``). Needs ``norm="rms"``. Default
            False.
        moe: a mixture of experts instead of the dense feed-forward network (Mixtral,
            Qwen2-MoE, Qwen3-MoE): a `multiattn.layers.MoEConfig` (or a dict of its
            fields; number of experts, top-k, expert width, normalisation, shared expert,
            the blocks left dense), the sublayer ``ffn`` then a `MixtureOfExperts` with
            the block's ``activation``. Needs ``gated=True`` and ``ffn_bias=False``.
            None (default): the dense network.
        parallel_residual: the attention and the feed-forward network read the block's
            input side by side and both add to it, ``y = x + (self_attention(norm_1(x))
            + ffn(norm_2(x)))`` (GPT-NeoX, Phi); needs ``norm_first=True`` and no
            ``post_norms``. Default False: one after the other.
        shared_norm: with ``parallel_residual``, both branches read ``norm_1(x)`` and
            the block has no ``norm_2`` (Phi's one ``input_layernorm``). Default False.
        causal: True (default): each position attends to itself and the positions
            before it (a decoder). False: to every position of the sequence, in both
            directions (an encoder block: ModernBERT); ``sliding_window`` is then the
            symmetric band ``|i - j| < sliding_window``, and the block has no KV cache.
        norm_bias: the LayerNorms have an offset ``beta`` (default True); False: scale
            only (ModernBERT's ``norm_bias: false``). Needs ``norm="layer"`` when False.
        attention_norm: the attention reads ``norm_1(x)`` (default True); False: the
            block has no ``norm_1`` and the attention reads ``x`` itself (ModernBERT's
            first block). Needs ``norm_first=True`` and no ``parallel_residual``.
    """

    d_model: int
    num_heads: int
    dff: int
    rate: float = 0.1
    norm: str = "layer"
    norm_first: bool = False
    epsilon: float = 1e-6
    activation: str = "relu"
    gated: bool = False
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    attention_bias: bool = True
    output_bias: bool = True
    ffn_bias: bool = True
    rotary_max_length: int | None = None
    rotary_base: float = 10000.0
    rotary_dim: int | None = None
    rotary_interleaved: bool = False
    rotary_scaling: dict | None = None
    sliding_window: int | None = None
    qk_norm: bool = False
    norm_offset: bool = False
    post_norms: bool = False
    query_scale: float | None = None
    attention_softcap: float | None = None
    moe: MoEConfig | None = None
    parallel_residual: bool = False
    shared_norm: bool = False
    causal: bool = True
    norm_bias: bool = True
    attention_norm: bool = True

    def __post_init__(self) -> None:
        where = "DecoderBlockConfig"
        checked = {
            name: check_positive_int(where, name, getattr(self, name))
            for name in ("d_model", "num_heads", "dff")
        }
        checked["head_dim"] = check_positive_int(where, "head_dim", self.head_dim, True)
        if checked["head_dim"] is None and checked["d_model"] % checked["num_heads"]:
            raise ValueError(
                f"{where}: `d_model` ({self.d_model}) must be divisible by `num_heads` "
                f"({self.num_heads}), or give `head_dim`."
            )
        if self.norm not in NORMS:
            raise ValueError(f"{where}: `norm` must be one of {NORMS}; received {self.norm!r}.")
        for name in ("norm_first", "gated", "attention_bias", "output_bias", "ffn_bias",
                     "qk_norm", "norm_offset", "post_norms", "parallel_residual",
                     "shared_norm", "causal", "norm_bias", "attention_norm"):  # fmt: skip
            check_bool(where, name, getattr(self, name))
        self._check_layout(where)
        for name in ("query_scale", "attention_softcap"):
            value = getattr(self, name)
            if value is not None:
                checked[name] = check_float_option(where, name, value)
        for name in ("qk_norm", "norm_offset"):
            if getattr(self, name) and self.norm != "rms":
                raise ValueError(
                    f"{where}: `{name}` needs norm='rms'; received norm={self.norm!r}."
                )
        checked["rate"] = check_rate(where, "rate", self.rate)
        checked["epsilon"] = check_epsilon(where, self.epsilon)
        checked["activation"] = check_activation(where, self.activation)
        checked["num_key_value_heads"] = check_kv_heads(
            where, checked["num_heads"], self.num_key_value_heads
        )
        checked["sliding_window"] = check_sliding_window(where, self.sliding_window)
        rotary = check_rotary_args(
            where, checked["head_dim"] or checked["d_model"] // checked["num_heads"],
            self.rotary_max_length, self.rotary_base, self.rotary_dim,
            self.rotary_interleaved, self.rotary_scaling,
        )  # fmt: skip
        names = ("rotary_max_length", "rotary_base", "rotary_dim", "rotary_interleaved",
                 "rotary_scaling")  # fmt: skip
        checked.update(zip(names, rotary))
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        self._check_moe(where)

    @property
    def key_dim(self) -> int:
        """The per-head width: ``head_dim``, else ``d_model // num_heads``."""
        return self.head_dim or self.d_model // self.num_heads

    def attention_options(self) -> dict[str, Any]:
        """The self-attention's `MultiHeadAttention` arguments (the one place where the
        block's field names meet the attention layer's)."""
        return {
            "num_heads": self.num_heads, "key_dim": self.key_dim,
            "use_bias": self.attention_bias, "use_output_bias": self.output_bias,
            "output_shape": self.d_model, "sliding_window": self.sliding_window,
            "num_key_value_heads": self.num_key_value_heads,
            "rotary_max_length": self.rotary_max_length, "rotary_base": self.rotary_base,
            "rotary_dim": self.rotary_dim, "rotary_interleaved": self.rotary_interleaved,
            "rotary_scaling": self.rotary_scaling, "qk_norm": self.qk_norm,
            "qk_norm_epsilon": self.epsilon, "qk_norm_offset": self.norm_offset,
            "score_scale": self.query_scale, "score_softcap": self.attention_softcap,
        }  # fmt: skip

    def _check_layout(self, where: str) -> None:
        """``post_norms`` and ``parallel_residual`` need pre-norm blocks and exclude each
        other; ``shared_norm`` needs ``parallel_residual``."""
        if self.post_norms and not self.norm_first:
            raise ValueError(f"{where}: `post_norms` needs norm_first=True (pre-norm blocks).")
        if self.parallel_residual and (not self.norm_first or self.post_norms):
            raise ValueError(
                f"{where}: `parallel_residual` needs norm_first=True and post_norms=False; "
                f"received norm_first={self.norm_first!r}, post_norms={self.post_norms!r}."
            )
        if self.shared_norm and not self.parallel_residual:
            raise ValueError(f"{where}: `shared_norm` needs parallel_residual=True.")
        if not self.attention_norm and (not self.norm_first or self.parallel_residual):
            raise ValueError(
                f"{where}: `attention_norm=False` needs norm_first=True and "
                f"parallel_residual=False; received norm_first={self.norm_first!r}, "
                f"parallel_residual={self.parallel_residual!r}."
            )
        if not self.norm_bias and self.norm != "layer":
            raise ValueError(
                f"{where}: `norm_bias=False` needs norm='layer' (RMSNorm has no offset); "
                f"received norm={self.norm!r}."
            )

    def _check_moe(self, where: str) -> None:
        """``moe`` as a `MoEConfig` (a dict of its fields is converted); its experts are
        gated and have no biases, so it needs ``gated=True`` and ``ffn_bias=False``."""
        moe = moe_config(where, self.moe)
        object.__setattr__(self, "moe", moe)
        if moe is not None and (self.gated is not True or self.ffn_bias is not False):
            raise ValueError(
                f"{where}: `moe` (gated experts without biases) needs gated=True and "
                f"ffn_bias=False; received gated={self.gated!r}, ffn_bias={self.ffn_bias!r}."
            )

    def for_layer(self, index: int) -> DecoderBlockConfig:
        """The options of the model's block ``index``: this config, or for a block listed
        in ``moe.dense_layers`` the same without ``moe`` (a dense feed-forward network of
        width ``dff``)."""
        if self.moe is not None and index in self.moe.dense_layers:
            return dataclasses.replace(self, moe=None)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON-ready; ``DecoderBlockConfig(**d)`` remakes it)."""
        return dataclasses.asdict(self)


#: The field names of `DecoderBlockConfig`: the options `TransformerDecoderOnlyLayer`
#: takes as keyword arguments.
BLOCK_OPTIONS = tuple(f.name for f in dataclasses.fields(DecoderBlockConfig))


def check_float_option(where: str, name: str, value: Any) -> float:
    """``value`` as a Python float: a positive finite number (bools refused), else
    ``ValueError`` naming ``name`` and quoting the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value > 0
    ):  # fmt: skip
        raise ValueError(f"{where}: `{name}` must be a positive finite float; received {value!r}.")
    return float(value)


def check_overrides(
    where: str, block: DecoderBlockConfig, overrides: Any, num_layers: int
) -> tuple[dict, ...] | None:
    """A model's ``layer_overrides`` checked: None, or a tuple (or list) of ``num_layers``
    dicts of `DecoderBlockConfig` fields, each valid over ``block``; returned as a tuple
    of dicts."""
    if overrides is None:
        return None
    if not isinstance(overrides, (tuple, list)) or len(overrides) != num_layers:
        raise ValueError(
            f"{where}: `layer_overrides` must be a tuple of num_layers={num_layers} "
            f"dicts; received {overrides!r}."
        )
    for i, override in enumerate(overrides):
        if not isinstance(override, dict):
            raise ValueError(
                f"{where}: `layer_overrides[{i}]` must be a dict of DecoderBlockConfig "
                f"fields; received {override!r}."
            )
        block_config(f"{where}: `layer_overrides[{i}]`", block, dict(override))
    return tuple(dict(o) for o in overrides)


def override_of(
    block: DecoderBlockConfig, overrides: tuple[dict, ...] | None, index: int
) -> DecoderBlockConfig:
    """Block ``index``'s options: ``block`` with ``overrides[index]`` (checked by
    `check_overrides`) replaced."""
    if overrides is None or not overrides[index]:
        return block
    return block_config("layer_overrides", block, overrides[index])


def make_norm(config: DecoderBlockConfig, name: str, dtype: Any = None) -> Any:
    """One normalisation of a block (or a model's final one) as ``config`` describes
    it: `LayerNormalization` (``norm="layer"``) or `RMSNormalization` (``"rms"``, with
    ``norm_offset`` as its ``unit_offset``), epsilon ``config.epsilon``. A module
    function, not a method of the config, so that a Paddle twin's call makes the twins."""
    if config.norm == "layer":
        return LayerNormalization(
            epsilon=config.epsilon, center=config.norm_bias, name=name, dtype=dtype
        )
    return RMSNormalization(
        epsilon=config.epsilon, unit_offset=config.norm_offset, name=name, dtype=dtype
    )


def block_config(where: str, config: Any, options: dict[str, Any]) -> DecoderBlockConfig:
    """``config`` (a `DecoderBlockConfig`, a dict of its fields or None) with ``options``
    (field values given as keyword arguments) applied over it."""
    if isinstance(config, DecoderBlockConfig):
        return dataclasses.replace(config, **options) if options else config
    if isinstance(config, dict):
        unknown = sorted(set(config) - set(BLOCK_OPTIONS))
        if unknown:
            raise ValueError(
                f"{where}: `config` holds keys that are not DecoderBlockConfig fields: "
                f"{unknown}; the fields are {list(BLOCK_OPTIONS)}."
            )
        options = {**config, **options}
    elif config is not None:
        raise TypeError(
            f"{where}: `config` must be a DecoderBlockConfig, a dict of its fields or None; "
            f"received {describe(config)}."
        )
    missing = [k for k in ("d_model", "num_heads", "dff") if k not in options]
    if missing:
        raise TypeError(f"{where}: give `d_model`, `num_heads` and `dff` (or `config`); "
                        f"missing {missing}.")  # fmt: skip
    return DecoderBlockConfig(**options)


@keras.saving.register_keras_serializable(package="multiattn")
class TransformerDecoderOnlyLayer(keras.layers.Layer):
    """One block of a decoder-only language model: causal self-attention and a
    feed-forward network, each with a residual connection and a normalisation. There is
    no cross-attention (for an encoder-decoder block see `TransformerDecoderLayer`).

    Pre-norm (``norm_first=True``: GPT-2, Llama, Qwen2, Mistral)::

        h = x + dropout_1(self_attention(norm_1(x), causal))
        y = h + dropout_2(ffn(norm_2(h)))

    With ``parallel_residual`` (GPT-NeoX, Phi) the branches read the same input::

        y = x + (dropout_1(self_attention(norm_1(x), causal)) + dropout_2(ffn(norm_2(x))))

    (with ``shared_norm``, Phi's, ``norm_1`` in both places and no ``norm_2``).

    With ``post_norms`` (Gemma 2 and 3) the two branches are normalised once more before
    their residual additions: ``h = x + dropout_1(post_norm_1(self_attention(norm_1(x),
    causal)))`` and ``y = h + dropout_2(post_norm_2(ffn(norm_2(h))))``.

    Post-norm (``norm_first=False``, the default, as `TransformerDecoderLayer`)::

        h = norm_1(x + dropout_1(self_attention(x, causal)))
        y = norm_2(h + dropout_2(ffn(h)))

    Positions: rotary embedding inside the attention (``rotary_max_length`` and the
    ``rotary_*`` options), or none (GPT-2 adds learned positions to the embeddings before
    the first block, e.g. with `PositionEmbedding`). A final normalisation after the last
    block is the model's, not the block's.

    Sublayers: ``self_attention`` (`MultiHeadAttention`: ``query``, ``key``, ``value``,
    ``attention_output``), ``ffn`` (`FeedForward`: ``gate`` (gated only), ``up``,
    ``down``), ``norm_1``, ``norm_2`` (`LayerNormalization` with ``gamma`` and ``beta``,
    or `RMSNormalization` with ``scale``), with ``post_norms`` also ``post_norm_1`` and
    ``post_norm_2``, ``dropout_1``, ``dropout_2``.

    Args:
        d_model, num_heads, dff: the sizes (``hidden_size``, query heads,
            ``intermediate_size``).
        config: every option at once, a `DecoderBlockConfig` (or a dict of its fields);
            None (default): the options are the keyword arguments.
        **options: any field of `DecoderBlockConfig` (``rate``, ``norm``, ``norm_first``,
            ``epsilon``, ``activation``, ``gated``, ``num_key_value_heads``, ``head_dim``,
            ``attention_bias``, ``output_bias``, ``ffn_bias``, the ``rotary_*`` options,
            ``sliding_window``), with the defaults and meaning given there; given with
            ``config``, they replace its fields. The layer keeps the result as
            ``config`` and each field as an attribute of the same name.
        seed: int seed for the dropout layers.
        kernel_initializer, bias_initializer: Keras initializers of every projection (each
            sublayer gets its own copy). Defaults ``glorot_uniform`` and ``zeros``.
        **kwargs: ``keras.layers.Layer`` arguments (``name``, ``dtype``, ...).

    Call arguments:
        x: ``(batch, seq, d_model)`` floating (the embedded tokens, or the previous
            block's output).
        mask: extra mask of the self-attention, ANDed with the causal mask (full pass
            only): bool, True = may attend (or integer, non-zero = may attend),
            broadcastable to ``(batch, seq, seq)`` or ``(batch, heads, seq, seq)``; e.g.
            ``padding[:, None, :]`` for a ``(batch, seq)`` padding mask.
        cache, cache_index: incremental decoding, as `TransformerDecoderLayer`: ``cache``
            from `init_cache`, ``x`` holds the tokens at positions ``cache_index ..
            cache_index + seq - 1``; ``cache_index`` is an int, a NumPy integer or an
            integer scalar tensor (traced under ``jax.jit`` / ``tf.function`` too; see
            `MultiHeadAttention` for out-of-range indices).
        key_mask: with ``cache`` only: ``(batch, max_length)`` bool (True = the cache
            slot may be attended; False for padding such as a left-padded prompt's pads),
            ANDed with the causal (and sliding-window) mask; None: every written slot.
            (Not named ``cache_mask``: Keras fills ``<input>_mask`` arguments itself.)
        training: enables dropout: a bool or None.

    Returns:
        ``(batch, seq, d_model)`` in the compute dtype; with ``cache``, ``(output,
        new_cache)``. Feeding a sequence through the cache, token by token or in chunks,
        gives the outputs of one full causal pass.

    Raises:
        TypeError: a flag not a bool, ``activation`` not a string, ``x`` not floating.
        ValueError: a size not a positive int, ``d_model`` not divisible by ``num_heads``
            (without ``head_dim``), an unknown ``norm`` or ``activation``, a bad rotary
            option (named as `MultiHeadAttention` names it), ``x`` of another width.
    """

    _WHERE = "TransformerDecoderOnlyLayer"

    def __init__(
        self,
        d_model: int | None = None,
        num_heads: int | None = None,
        dff: int | None = None,
        *,
        config: DecoderBlockConfig | dict | None = None,
        seed: int | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        **kwargs: Any,
    ):
        options = {k: kwargs.pop(k) for k in BLOCK_OPTIONS if k in kwargs}
        sizes = {"d_model": d_model, "num_heads": num_heads, "dff": dff}
        options.update({k: v for k, v in sizes.items() if v is not None})
        super().__init__(**kwargs)
        where = self._WHERE
        self.config = config = block_config(where, config, options)
        for field in dataclasses.fields(config):  # the options as Keras-style attributes
            setattr(self, field.name, getattr(config, field.name))
        self.seed = seed = check_layer_seed(where, seed)
        self.kernel_initializer, self.bias_initializer = block_initializers(
            where, kernel_initializer, bias_initializer
        )
        self.supports_masking = True
        dtype = self.dtype_policy
        self.self_attention = MultiHeadAttention(
            **config.attention_options(),
            name="self_attention",
            dtype=dtype,
            **sublayer_initializers(self),
        )
        self.ffn = (
            MixtureOfExperts(
                **config.moe.layer_options(),
                activation=config.activation,
                name="ffn",
                dtype=dtype,
                kernel_initializer=self.kernel_initializer,
            )
            if config.moe is not None
            else FeedForward(
                config.dff,
                activation=config.activation,
                gated=config.gated,
                use_bias=config.ffn_bias,
                name="ffn",
                dtype=dtype,
                **sublayer_initializers(self),
            )
        )
        self.norm_1 = make_norm(config, "norm_1", dtype) if config.attention_norm else None
        self.norm_2 = None if config.shared_norm else make_norm(config, "norm_2", dtype)
        self.post_norm_1 = self.post_norm_2 = None
        if config.post_norms:
            self.post_norm_1 = make_norm(config, "post_norm_1", dtype)
            self.post_norm_2 = make_norm(config, "post_norm_2", dtype)
        seeds = [None if seed is None else seed + i for i in range(2)]
        self.dropout_1, self.dropout_2 = (
            keras.layers.Dropout(config.rate, seed=s, name=f"dropout_{i + 1}", dtype=dtype)
            for i, s in enumerate(seeds)
        )

    def build(self, x_shape):
        where = self._WHERE
        width = static_width(where, "x", x_shape)
        if width != self.d_model:
            raise ValueError(
                f"{where}: `x` must have width d_model={self.d_model}; received shape "
                f"{tuple(x_shape)}."
            )
        shape = tuple(x_shape)
        self.self_attention.build(shape, shape)
        if self.norm_1 is not None:
            self.norm_1.build(shape)
        if self.norm_2 is not None:
            self.norm_2.build(shape)
        self.ffn.build(shape)
        if self.post_norm_1 is not None:
            self.post_norm_1.build(shape)
            self.post_norm_2.build(shape)

    def init_cache(self, batch_size: int, max_length: int, dtype: str | None = None):
        """An empty self-attention cache for ``max_length`` positions: zeros ``(batch_size,
        H_kv, max_length, head_dim)`` for keys and for values, heads first (see
        `MultiHeadAttention.init_cache`). Pass it as ``cache`` with ``cache_index=0``."""
        return self.self_attention.init_cache(batch_size, max_length, dtype)

    def call(self, x, *, mask=None, cache=None, cache_index=None, key_mask=None, training=None):
        where = self._WHERE
        check_input_width(where, "x", x, self.d_model)
        ops = get_ops(x)
        check_float(where, "x", x, ops)
        training = check_flag(where, "training", training, ops, allow_none=True)
        mask = as_mask(where, "mask", mask)
        if cache is not None and mask is not None:
            raise ValueError(f"{where}: `mask` cannot be combined with `cache`.")
        if cache is not None and not self.causal:
            raise ValueError(f"{where}: a bidirectional block (causal=False) has no `cache`.")
        for name, value in (("cache_index", cache_index), ("key_mask", key_mask)):
            if cache is None and value is not None:
                raise ValueError(f"{where}: `{name}` is only meaningful with `cache`.")
        new_cache = None

        def attend(h):
            nonlocal new_cache
            if cache is None:
                return self.self_attention(h, h, mask=mask, causal=self.causal, training=training)
            out, new_cache = call_sublayer(
                self.self_attention,
                h,
                cache=cache,
                cache_index=cache_index,
                key_mask=key_mask,
                training=training,
            )
            return out

        def drop(dropout, h):
            return h if self.rate == 0 else dropout(h, training=training)

        def run(layer, h):
            return call_sublayer(layer, h)

        def post(layer, h):
            return h if layer is None else run(layer, h)

        if self.parallel_residual:
            h = run(self.norm_1, x)
            a = drop(self.dropout_1, attend(h))
            f = run(self.ffn, h if self.norm_2 is None else run(self.norm_2, x))
            y = x + (a + drop(self.dropout_2, f))
        elif self.norm_first:
            h = x + drop(self.dropout_1, post(self.post_norm_1, attend(post(self.norm_1, x))))
            f = post(self.post_norm_2, run(self.ffn, run(self.norm_2, h)))
            y = h + drop(self.dropout_2, f)
        else:
            h = run(self.norm_1, x + drop(self.dropout_1, attend(x)))
            y = run(self.norm_2, h + drop(self.dropout_2, run(self.ffn, h)))
        return (y, new_cache) if cache is not None else y

    def compute_output_shape(self, x_shape):
        return x_shape

    def compute_mask(self, inputs, mask=None):
        return None

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            **self.config.to_dict(),
            "seed": self.seed,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
        }

"""Multi-head attention layer: a drop-in for ``keras.layers.MultiHeadAttention``.

This module is the layer's Keras-compatible facade: its constructor arguments, attribute
names, sublayers (in Keras' build order), config and call signature. The work is done
by the focused modules beside it: `multiattn.layers._mha_checks` (argument and input
checks), `multiattn.layers._mha_projections` (the ``EinsumDense`` sublayers and the
products through them), `multiattn.layers._mha_masks` (Keras' and multiattn's masks,
True = may attend), `multiattn.layers._mha_axes` (attention over several axes) and
`multiattn.layers._mha_cache` (the KV cache of decoding); the attention itself is
`multiattn.ops.attention.attend`.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np

from .._checks import check_flag, check_rate, fmt_shape, shape_of
from ..namespaces.keras import get_ops
from ..ops.attention import attend
from ..ops.normalization import check_epsilon
from ..ops.plan import joins_projections
from ._base import (
    call_sublayer,
    check_layer_seed,
    get_initializer,
    joined_linear,
    keras_mask_of,
    plain_dense,
    project,
    seed_generator,
)
from ._mha_axes import attention_over_axes, normalise_axes, scores_shape
from ._mha_cache import cached_call, empty_cache, refuse_with_cache
from ._mha_checks import (
    check_attention_axes,
    check_attention_bias,
    check_bias_flags,
    check_build_shapes,
    check_flash,
    check_flash_scores,
    check_input,
    check_keras_flag,
    check_kv_heads,
    check_output,
    check_rank3,
    check_rotary_args,
    check_sliding_window,
    keras_object,
    positive_int,
    query_namespace,
)
from ._mha_masks import (
    call_keep,
    carry_keras_mask,
    fold,
    keras_causal_keep,
    keras_rule,
    read_keras_masks,
)
from ._mha_projections import einsum_dense, load_flat_layout, project_cross, project_inputs
from .normalization import RMSNormalization
from .rotary import RotaryEmbedding

__all__ = ["MultiHeadAttention"]


@keras.saving.register_keras_serializable(package="multiattn")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention (self- and cross-attention), a drop-in for
    ``keras.layers.MultiHeadAttention``.

    It takes every constructor and call argument of ``keras.layers.MultiHeadAttention``
    (Keras 3.15) with Keras' meaning, and holds its weights the way Keras does: in
    ``EinsumDense`` sublayers ``query``, ``key``, (``gate``), ``value`` and
    ``attention_output`` (attributes ``_query_dense``, ``_key_dense``, ``_gate_dense``,
    ``_value_dense``, ``_output_dense``), in that order, so that ``set_weights`` in Keras'
    order, Keras checkpoints, dtype-policy maps, ``quantize("int8")`` and
    ``enable_lora`` work unchanged. The attention itself is multiattn's (a query with
    nothing to attend gets zero weights; half precision is normalised in float32). See
    ``docs/keras-drop-in.md`` for the argument names of both APIs and the remaining
    differences.

    Weights (for rank-3 inputs): ``query_kernel (E_q, H, D)``, ``key_kernel
    (E_k, H_kv, D)``, ``value_kernel (E_v, H_kv, D_v)``, ``output_kernel (H, D_v,
    *output_shape)``, and with ``use_bias`` the biases ``query_bias (H, D)``, ``key_bias
    (H_kv, D)``, ``value_bias (H_kv, D_v)``, ``output_bias (*output_shape,)`` (the last
    one follows ``use_output_bias`` when given; ``output_shape`` defaults to
    ``(E_q,)``); with ``use_gate`` also ``gate`` ``(E_q, H, D_v)`` and ``(H, D_v)``. The
    ``*_kernel``/``*_bias`` attributes are read-only views of the sublayers' weights.
    ``H_kv = H`` unless ``num_key_value_heads`` is set. Heads are contiguous in this
    layout; the interleaved heads of the PaddlePaddle document are a permutation of the
    kernels' columns (see `multiattn.ops.split_heads`).

    Args (Keras' order):
        num_heads: number of heads ``H``.
        key_dim: per-head width ``D`` of queries and keys.
        value_dim: per-head width ``D_v`` of values, default ``key_dim``.
        dropout: drop probability on the attention weights, training only.
        use_bias: add biases to the projections.
        output_shape: the output's shape after the batch and sequence axes (an int or a
            tuple), default the query width. ``output_dim=n`` (multiattn's name) is
            ``output_shape=n``.
        attention_axes: the axes attention runs over (Keras' meaning), default all axes
            but the batch and the features; several axes attend as one flattened axis.
        sliding_window: each query attends the keys ``j`` with ``|i - j| < sliding_window``
            (a symmetric band; with ``use_causal_mask``, or through the ``cache``, the causal
            band: the query at position ``p`` sees ``p - sliding_window < j <= p``).
        flash_attention: Keras' switch. multiattn chooses its fused path itself; ``True``
            (or Keras' global ``enable_flash_attention``) keeps Keras' restrictions: no
            dropout, no attention scores.
        kernel_initializer, bias_initializer, kernel_regularizer, bias_regularizer,
        activity_regularizer, kernel_constraint, bias_constraint: for the sublayers.
        use_gate: gate the attention output with ``sigmoid(query @ W_gate + b_gate)`` per
            head before the output projection.
        seed: int seed for dropout.
        output_dim: multiattn's name for a one-axis ``output_shape``.
        num_key_value_heads: number ``H_kv`` of key/value heads, dividing ``num_heads``;
            None (default) means ``num_heads``. Fewer is grouped-query attention (query
            head ``h`` uses key/value head ``h // (H / H_kv)``), one is multi-query
            attention.
        rotary_max_length: apply rotary position embedding (`RotaryEmbedding`, sublayer
            ``rotary``) to the projected queries and keys, for positions up to this
            many; None (default): no RoPE. Queries and keys are at positions ``0, 1, ...``
            (``cache_index, ...`` when decoding through the cache). ``key_dim`` must be even.
        rotary_base: wavelength base of the rotary embedding (``rope_theta``).
        rotary_dim: rotate only the first ``rotary_dim`` features of each query and key
            head (even, at most ``key_dim``; partial rotary as in GPT-NeoX and Phi); None
            (default): all ``key_dim`` (then even).
        rotary_interleaved: rotate feature pairs ``(2i, 2i + 1)`` instead of ``(i,
            i + R/2)`` (see `RotaryEmbedding`).
        rotary_scaling: frequency scaling of the rotary embedding, a dict as Hugging
            Face's ``rope_scaling`` (``{"rope_type": "linear", "factor": f}`` or
            ``{"rope_type": "llama3", ...}``, see `multiattn.ops.rotary_embedding`);
            None (default): none.
        use_output_bias: whether the output projection has a bias; None (default):
            ``use_bias``. ``use_bias=True, use_output_bias=False`` gives biases on the
            query, key and value projections only (as Qwen2 checkpoints have them).
        qk_norm: RMS-normalise each head's projected queries and keys over its ``D``
            features (sublayers ``query_norm`` and ``key_norm``, `RMSNormalization` with
            a ``scale`` of shape ``(D,)`` shared by the heads) before the rotary
            embedding (Qwen3, Gemma 3). Default False.
        qk_norm_epsilon: those norms' epsilon (default ``1e-6``).
        qk_norm_offset: those norms' gain is ``1 + scale`` (Gemma 3; see
            `RMSNormalization`'s ``unit_offset``). Default False.
        score_scale: the multiplier of the query-key dot products, a positive finite
            float (Gemma 2 and 3: ``query_pre_attn_scalar ** -0.5``); None (default):
            ``1 / sqrt(key_dim)``.
        score_softcap: soft-cap ``c`` of the scaled scores, a positive finite float:
            ``s -> c * tanh(s / c)`` before the bias and the mask (Gemma 2's
            ``attn_logit_softcapping``), in the full pass and through the cache; it keeps
            the attention on the explicit path. None (default): none.

    Call arguments (Keras'):
        query: ``(batch, queries, E_q)`` (or more axes with ``attention_axes``), floating
            (integer, bool and complex inputs raise ``TypeError``).
        value: ``(batch, keys, E_v)``, floating.
        key: ``(batch, keys, E_k)``, floating, defaults to ``value``.
        query_mask, value_mask, key_mask: the Keras masks of the inputs (``(batch,
            queries)`` / ``(batch, keys)``, True = valid); filled in from the inputs'
            ``_keras_mask`` (e.g. after ``Embedding(mask_zero=True)``).
        attention_mask: bool, or numbers (non-zero = may attend), ``(batch, queries,
            keys)`` or anything Keras broadcasts to the scores (the heads axis is inserted
            before the query and key axes).
        return_attention_scores: also return the attention weights ``(batch, heads,
            queries, keys)``.
        training: enables dropout: a bool or None.
        use_causal_mask: Keras' causal mask, aligned top-left: query ``i`` sees keys
            ``j <= i`` (with as many queries as keys the same as ``causal``).

    Call arguments (multiattn's, keyword-only):
        mask: bool (True = may attend) or integer (non-zero = may attend), broadcastable
            to ``(batch, queries, keys)`` (the same for every head), or rank 4 broadcastable
            to ``(batch, heads, queries, keys)``: ``attention_mask`` without float masks.
            Give one of the two.
        valid_lens: ``(batch,)`` or ``(batch, queries)`` lengths of the keys.
        causal: bottom-right aligned causal mask (the last query sees every key, as when
            decoding).
        return_weights: the same as ``return_attention_scores``.
        cache: incremental causal self-attention (decoding): the pair
            ``(key_cache, value_cache)`` of ``init_cache``, heads first: ``(batch, H_kv,
            max_length, D)`` and ``(batch, H_kv, max_length, D_v)`` (the layout of
            transformers' caches; each head's positions are contiguous, so attention reads
            them without moving them). ``query`` ``(batch, t, E_q)`` holds the
            tokens at positions ``cache_index .. cache_index + t - 1``; their keys and
            values are written into the cache at ``cache_index`` and each query attends to
            the cached positions up to its own. ``key_mask`` may then be given as
            ``(batch, max_length)``: the cache slots that may be attended (True / non-zero;
            False for padding, e.g. a left-padded prompt); ``value``, ``key``, the other
            masks, ``valid_lens`` and the causal flags must not be given.
        cache_index: the position of ``query``'s first token: an int, a NumPy integer or
            an integer scalar tensor (bools, floats and non-scalars raise ``TypeError``).
            A known value (Python and NumPy integers, eager tensors on every backend)
            must satisfy ``0 <= cache_index`` and ``cache_index + queries <= max_length``
            (and ``<= rotary_max_length`` with RoPE), else ``ValueError``. A traced index
            (``jax.jit`` / ``tf.function``) cannot raise when the step runs; if it is out
            of that range, nothing is written (``new_cache`` equals ``cache``) and the
            output (and the weights) are NaN: never a write at another position, never
            a clamped index. Inside ``owned_caches(index_checked=True)`` (``generate``)
            the caller has checked the index and that test is left out.
        key_value: cross-attention over keys and values projected once by
            `project_key_value` (the pair it returns); ``value`` and ``key`` must not
            be given. ``mask``/``valid_lens`` refer to those keys.
        attention_bias: additive float bias broadcastable to ``(batch, num_heads,
            queries, keys)`` (with ``cache``: ``keys`` = the cache slots ``max_length``),
            added to the scaled scores before the masked softmax (relative position
            biases, ALiBi); rank-3 inputs only. Masked positions stay masked whatever it
            holds. Integer or bool dtypes raise ``TypeError``, other shapes ``ValueError``.

    Returns:
        ``(batch, queries, *output_shape)`` in the layer's compute dtype (and the weights).
        A query with nothing to attend gets zero weights, so its output is
        ``output_bias`` (Keras gives such a row uniform weights). float16/bfloat16
        attention is computed in float32 internally. With ``cache``: ``(output,
        new_cache)`` (``(output, weights, new_cache)`` with ``return_weights``),
        ``new_cache`` the updated pair; decoding a sequence through the cache gives the
        outputs of one ``causal=True`` pass over the whole sequence. The cache must be
        floating (`init_cache` refuses other dtypes). The query's Keras mask is carried
        to the output.
    """

    _WHERE = "MultiHeadAttention"
    # Keras' MultiHeadAttention removes the Keras masks from its inputs once it has read
    # them; its GroupedQueryAttention leaves them.
    _CLEAR_INPUT_MASKS = True

    def __init__(
        self, num_heads: int, key_dim: int, value_dim: int | None = None,
        dropout: float = 0.0, use_bias: bool = True, output_shape: Any = None,
        attention_axes: Any = None, sliding_window: int | None = None,
        flash_attention: bool | None = None, kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros", kernel_regularizer: Any = None,
        bias_regularizer: Any = None, activity_regularizer: Any = None,
        kernel_constraint: Any = None, bias_constraint: Any = None, use_gate: bool = False,
        seed: int | None = None, *, output_dim: int | None = None,
        num_key_value_heads: int | None = None, rotary_max_length: int | None = None,
        rotary_base: float = 10000.0, rotary_dim: int | None = None,
        rotary_interleaved: bool = False, rotary_scaling: dict | None = None,
        use_output_bias: bool | None = None, qk_norm: bool = False,
        qk_norm_epsilon: float = 1e-6, qk_norm_offset: bool = False,
        score_scale: float | None = None, score_softcap: float | None = None, **kwargs: Any,
    ):  # fmt: skip
        where = self._WHERE
        num_heads = positive_int(where, "num_heads", num_heads)
        key_dim = positive_int(where, "key_dim", key_dim)
        value_dim = positive_int(where, "value_dim", value_dim, allow_none=True)
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.num_key_value_heads = check_kv_heads(where, num_heads, num_key_value_heads)
        self.key_dim = key_dim
        self.value_dim = value_dim or key_dim
        self._output_shape = shape = check_output(where, output_shape, output_dim)
        self.output_dim = shape[0] if shape is not None and len(shape) == 1 else None
        check_bias_flags(where, use_bias, use_gate, use_output_bias)
        self.use_bias = use_bias
        self.use_output_bias = use_bias if use_output_bias is None else use_output_bias
        self.use_gate = use_gate
        self.dropout = check_rate(where, "dropout", dropout)
        self.attention_axes = check_attention_axes(where, attention_axes)
        self.sliding_window = check_sliding_window(where, sliding_window)
        self._flash_attention = check_flash(where, flash_attention, self.dropout, dropout)
        self.kernel_initializer = get_initializer(where, "kernel_initializer", kernel_initializer)
        self.bias_initializer = get_initializer(where, "bias_initializer", bias_initializer)
        self.kernel_regularizer = keras_object(where, "kernel_regularizer", kernel_regularizer)
        self.bias_regularizer = keras_object(where, "bias_regularizer", bias_regularizer)
        self.sublayer_activity_regularizer = keras_object(
            where, "activity_regularizer", activity_regularizer
        )
        self.kernel_constraint = keras_object(where, "kernel_constraint", kernel_constraint)
        self.bias_constraint = keras_object(where, "bias_constraint", bias_constraint)
        self.seed = check_layer_seed(where, seed)
        # Like Keras' Dropout: a seed generator only when there is dropout to seed.
        self.seed_generator = seed_generator(where, seed) if self.dropout > 0.0 else None
        self.supports_masking = True
        self._init_rotary(rotary_max_length, rotary_base, rotary_dim, rotary_interleaved,
                          rotary_scaling)  # fmt: skip
        self._init_qk_norm(qk_norm, qk_norm_epsilon, qk_norm_offset)
        if score_scale is not None:  # else the class's (T5's attention sets 1.0)
            self.score_scale = _positive_float(where, "score_scale", score_scale)
        self.score_softcap = None
        if score_softcap is not None:
            self.score_softcap = _positive_float(where, "score_softcap", score_softcap)
        self._axes: tuple[int, ...] = (1,)

    def _init_qk_norm(self, qk_norm: Any, epsilon: Any, offset: Any) -> None:
        """The query/key norm options (checked) and the ``query_norm`` and ``key_norm``
        sublayers when ``qk_norm`` is True."""
        where = self._WHERE
        for name, value in (("qk_norm", qk_norm), ("qk_norm_offset", offset)):
            if not isinstance(value, bool):
                raise TypeError(f"{where}: `{name}` must be a bool; received {value!r}.")
        self.qk_norm, self.qk_norm_offset = qk_norm, offset
        self.qk_norm_epsilon = check_epsilon(where, epsilon)
        self.query_norm = self.key_norm = None
        if qk_norm:
            policy, eps = self.dtype_policy, self.qk_norm_epsilon
            self.query_norm, self.key_norm = (
                RMSNormalization(epsilon=eps, unit_offset=offset, name=name, dtype=policy)
                for name in ("query_norm", "key_norm")
            )

    def _init_rotary(self, max_length, base, dim, interleaved, scaling) -> None:
        """The rotary options (checked) and the ``rotary`` sublayer when
        ``rotary_max_length`` is given."""
        where, key_dim = self._WHERE, self.key_dim
        rotary = check_rotary_args(where, key_dim, max_length, base, dim, interleaved, scaling)
        self.rotary_max_length, self.rotary_base, self.rotary_dim = rotary[:3]
        self.rotary_interleaved, self.rotary_scaling = rotary[3:]
        self.rotary = None
        if self.rotary_max_length is not None:
            self.rotary = RotaryEmbedding(
                self.rotary_max_length,
                base,
                rotary_dim=self.rotary_dim,
                interleaved=interleaved,
                scaling=self.rotary_scaling,
                name="rotary",
                dtype=self.dtype_policy,
            )

    # -- Keras' attribute names ------------------------------------------------------------

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads ``H_kv``."""
        return self.num_key_value_heads or self.num_heads

    _num_heads = property(lambda self: self.num_heads)
    _key_dim = property(lambda self: self.key_dim)
    _value_dim = property(lambda self: self.value_dim)
    _dropout = property(lambda self: self.dropout)
    _use_bias = property(lambda self: self.use_bias)
    _use_gate = property(lambda self: self.use_gate)
    _sliding_window = property(lambda self: self.sliding_window)
    _attention_axes = property(lambda self: self.attention_axes)
    _kernel_initializer = property(lambda self: self.kernel_initializer)
    _bias_initializer = property(lambda self: self.bias_initializer)
    _inverse_sqrt_key_dim = property(lambda self: 1.0 / math.sqrt(self.key_dim))

    query_dense = property(lambda self: self._query_dense)
    key_dense = property(lambda self: self._key_dense)
    value_dense = property(lambda self: self._value_dense)
    output_dense = property(lambda self: self._output_dense)

    # The weights under multiattn's names (read-only; they live in the sublayers).
    query_kernel = property(lambda self: self._query_dense.kernel)
    key_kernel = property(lambda self: self._key_dense.kernel)
    value_kernel = property(lambda self: self._value_dense.kernel)
    output_kernel = property(lambda self: self._output_dense.kernel)
    query_bias = property(lambda self: self._query_dense.bias)
    key_bias = property(lambda self: self._key_dense.bias)
    value_bias = property(lambda self: self._value_dense.bias)
    output_bias = property(lambda self: self._output_dense.bias)

    # -- building --------------------------------------------------------------------------

    def build(self, query_shape, value_shape=None, key_shape=None):
        where = self._WHERE
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        qs, vs, ks = check_build_shapes(where, query_shape, value_shape, key_shape)
        rank = len(qs)
        self._axes = normalise_axes(where, self.attention_axes, rank)
        if rank > 3 and self.rotary is not None:
            raise ValueError(
                f"{where}: rotary position embedding needs (batch, sequence, features) "
                f"inputs; received query {fmt_shape(qs)}."
            )
        h, hkv, d, dv = self.num_heads, self.kv_heads, self.key_dim, self.value_dim
        out = self._output_shape or (qs[-1],)
        self._widths = (qs[-1], vs[-1], ks[-1])
        self._rank = rank
        # Keras' sublayers and build order: query, key, (gate), value, attention_output.
        self._query_dense = einsum_dense(self, "query", rank, 1, (h, d))
        self._query_dense.build(qs)
        self._key_dense = einsum_dense(self, "key", rank, 1, (hkv, d))
        self._key_dense.build(ks)
        if self.use_gate:
            self._gate_dense = einsum_dense(self, "gate", rank, 1, (h, dv), activation="sigmoid")
            self._gate_dense.build(qs)
        self._value_dense = einsum_dense(self, "value", rank, 1, (hkv, dv))
        self._value_dense.build(vs)
        self._output_dense = einsum_dense(
            self, "attention_output", rank + 1, 2, out, use_bias=self.use_output_bias
        )
        self._output_dense.build((*qs[:-1], h, dv))
        if self.rotary is not None:
            self.rotary.build((None, None, h, d))
        if self.query_norm is not None:
            self.query_norm.build((None, None, h, d))
            self.key_norm.build((None, None, hkv, d))

    # -- projections -------------------------------------------------------------------------

    def _plain(self, dense: Any) -> bool:
        """`multiattn.layers._base.plain_dense` in the layer's compute dtype."""
        return plain_dense(dense, self.compute_dtype)

    def _project(self, ops: Any, x: Any, dense: Any, contract: int = 1) -> Any:
        """``dense(x)`` (`multiattn.layers._base.project`: `ops.linear` for a plain
        float sublayer, else the sublayer called)."""
        return project(ops, x, dense, self.compute_dtype, contract)

    def _project_self(self, ops: Any, x: Any) -> tuple[Any, Any, Any]:
        """Self-attention: the query, key and value projections of one input, as one
        product over the joined kernels where `multiattn.ops.plan.joins_projections`
        says (plain float sublayers without activations, biases on all or none)."""
        dense = (self._query_dense, self._key_dense, self._value_dense)
        sizes = shape_of(x)[:-1]
        rows = None if None in sizes else math.prod(sizes)
        if (
            joins_projections(ops.backend, ops.xla_device(x), rows)
            and ops.dtype_name(x) == self.compute_dtype
            and all(self._plain(d) and d.activation is keras.activations.linear for d in dense)
            and len({d.bias is None for d in dense}) == 1
        ):
            dtype = self.compute_dtype
            kernels = [ops.cast(d.kernel, dtype) for d in dense]
            biases = [None if d.bias is None else ops.cast(d.bias, dtype) for d in dense]
            return tuple(joined_linear(ops, x, kernels, biases))
        return tuple(self._project(ops, x, d) for d in dense)

    def _gate(self, ops: Any, query: Any) -> Any:
        return self._project(ops, query, self._gate_dense) if self.use_gate else None

    def _output(self, ops: Any, heads: Any, gate: Any = None) -> Any:
        if gate is not None:
            heads = ops.multiply(heads, ops.cast(gate, heads.dtype))
        return self._project(ops, heads, self._output_dense, contract=2)

    def _rotate(self, q: Any, k: Any, q_offset: Any = 0, k_offset: Any = 0) -> tuple[Any, Any]:
        """Projected ``q`` and ``k`` ``(B, T, H, D)`` with the query/key norms (``qk_norm``)
        and then the rotary embedding applied (each when the layer has it)."""
        q, k = self._qk_normed(q, k)
        if self.rotary is None:
            return q, k
        return (
            call_sublayer(self.rotary, q, offset=q_offset),
            call_sublayer(self.rotary, k, offset=k_offset),
        )

    def _qk_normed(self, q: Any, k: Any) -> tuple[Any, Any]:
        """``q`` and ``k`` through ``query_norm`` / ``key_norm`` (with ``qk_norm``); either
        may be None (not normalised)."""
        if self.query_norm is None:
            return q, k
        return (
            None if q is None else call_sublayer(self.query_norm, q),
            None if k is None else call_sublayer(self.key_norm, k),
        )

    # -- attention ---------------------------------------------------------------------------

    def _attend(
        self, ops, q, k, v, keep, lens, causal, return_weights, training, bias=None,
        kv_heads_first=False, kv_finite=False,
    ):  # fmt: skip
        # `score_scale` (set by subclasses such as T5's attention): the scores' multiplier.
        scale = getattr(self, "score_scale", None)
        scale = 1.0 / math.sqrt(self.key_dim) if scale is None else scale
        return attend(
            ops, q, k, v, keep=keep, valid_lens=lens, causal=causal, scale=scale,
            dropout=self.dropout, training=training, seed=self.seed_generator,
            return_weights=return_weights, bias=bias, kv_heads_first=kv_heads_first,
            kv_finite=kv_finite, softcap=self.score_softcap,
        )  # fmt: skip

    def _scores_shape(self, q: Any, k: Any) -> tuple:
        """The shape of the attention scores of projected ``q`` ``(B, *dims, H, D)`` and
        ``k`` (`multiattn.layers._mha_axes.scores_shape`)."""
        return scores_shape(shape_of(q)[:-2], shape_of(k)[:-2], self._axes, self.num_heads)

    def _attention(
        self, ops, q, k, v, keep, lens, causal, top_left, window, return_weights, training,
        bias=None,
    ) -> tuple[Any, Any]:  # fmt: skip
        """The attention of projected ``q`` ``(B, *dims, H, D)``, ``k`` and ``v``:
        ``(output (B, *dims, H, D_v), weights or None)``. ``keep`` is aligned with the
        scores (see `_scores_shape`); ``lens`` and ``causal`` (bottom-right) apply to
        rank-4 inputs; ``top_left`` is Keras' causal mask and ``window`` its sliding
        window."""
        if len(shape_of(q)) == 4:
            keep, causal = keras_causal_keep(ops, keep, q, k, causal, top_left, window)
            result = self._attend(ops, q, k, v, keep, lens, causal, return_weights, training, bias)
            return result if return_weights else (result, None)

        def run(qf: Any, kf: Any, vf: Any, keep4: Any) -> tuple[Any, Any]:
            result = self._attend(ops, qf, kf, vf, keep4, None, False, return_weights, training)
            return result if return_weights else (result, None)

        return attention_over_axes(
            ops, self._WHERE, self._axes, self.num_heads, q, k, v, keep, top_left, window, run
        )

    def _compute_attention(
        self, query, key, value, attention_mask=None, training=None,
        return_attention_scores=False, use_causal_mask=False,
    ):  # fmt: skip
        """Keras' override point: the attention of the projected ``query`` ``(B, T, H,
        D)``, ``key`` ``(B, S, H_kv, D)`` and ``value`` ``(B, S, H_kv, D_v)`` (more axes
        with ``attention_axes``) under Keras' ``attention_mask`` (True or non-zero = may
        attend) and Keras' top-left ``use_causal_mask``. Returns ``(output (B, T, H, D_v),
        weights (B, H, T, S) or None)``; the weights are returned when asked for."""
        where = self._WHERE
        query, key, value = (
            keras.ops.convert_to_tensor(t) if isinstance(t, (np.ndarray, np.generic)) else t
            for t in (query, key, value)
        )
        ops = get_ops(query)
        return_attention_scores = check_flag(
            where, "return_attention_scores", return_attention_scores, ops
        )
        check_flash_scores(where, self._flash_attention, return_attention_scores)
        use_causal_mask = check_keras_flag(where, "use_causal_mask", use_causal_mask)
        training = check_flag(where, "training", training, ops, allow_none=True)
        keep = None
        if attention_mask is not None:
            scores = self._scores_shape(query, key)
            keep = keras_rule(ops, where, "attention_mask", attention_mask, scores, len(self._axes))
        return self._attention(ops, query, key, value, keep, None, False, use_causal_mask, None,
                               return_attention_scores, training)  # fmt: skip

    def _hook_overridden(self) -> bool:
        return getattr(type(self)._compute_attention, "_multiattn_own", False) is not True

    def _call_hook(self, q, k, v, keep, training, return_weights) -> tuple[Any, Any]:
        """A subclass's ``_compute_attention``, called as Keras calls it."""
        return self._compute_attention(q, k, v, keep, training, return_weights)

    # -- decoding and cross-attention helpers ----------------------------------------------

    def init_cache(self, batch_size: int, max_length: int, dtype: str | None = None):
        """An empty self-attention cache: zeros ``(batch_size, H_kv, max_length, D)`` for
        the keys and ``(batch_size, H_kv, max_length, D_v)`` for the values, in ``dtype``
        (default the compute dtype; a floating dtype, since an integer or bool cache would
        truncate the keys and values). Pass it as ``cache`` with ``cache_index=0``."""
        where = f"{self._WHERE}.init_cache"
        dims = (self.kv_heads, self.key_dim, self.value_dim)
        return empty_cache(where, batch_size, max_length, dims, dtype, self.compute_dtype)

    def project_key_value(self, value, key=None):
        """Project the keys and values of cross-attention once, for reuse across calls.

        Args:
            value: ``(batch, keys, E_v)``; key: ``(batch, keys, E_k)``, default ``value``.

        Returns:
            ``(keys, values)``: ``(batch, keys, H_kv, D)`` and ``(batch, keys, H_kv, D_v)``
            in the compute dtype (RoPE applied to the keys when enabled), to pass as
            ``key_value``.
        """
        where = f"{self._WHERE}.project_key_value"
        if not self.built:
            raise ValueError(f"{where}: the layer must be built (called once) first.")
        return project_cross(self, where, value, key)

    # -- the call ----------------------------------------------------------------------------

    def call(
        self, query, value=None, key=None, query_mask=None, value_mask=None, key_mask=None,
        attention_mask=None, return_attention_scores=False, training=None,
        use_causal_mask=False, *, mask=None, valid_lens=None, causal=False,
        return_weights=False, cache=None, cache_index=None, key_value=None,
        attention_bias=None,
    ):  # fmt: skip
        where = self._WHERE
        ops = query_namespace(where, query, value, key)
        check_input(where, "query", query, self._widths[0], self._rank)
        return_weights = check_flag(where, "return_weights", return_weights, ops)
        return_weights = return_weights or check_flag(
            where, "return_attention_scores", return_attention_scores, ops
        )
        check_flash_scores(where, self._flash_attention, return_weights)
        training = check_flag(where, "training", training, ops, allow_none=True)
        top_left = check_keras_flag(where, "use_causal_mask", use_causal_mask)
        # The Keras masks of the inputs are handled here (as Keras' layer does): read, then
        # removed from the inputs so that no sublayer warns about them; the query's mask
        # goes on the output.
        masks = read_keras_masks(query, value, key, query_mask, value_mask, key_mask,
                                 self._CLEAR_INPUT_MASKS)  # fmt: skip
        if cache is not None:
            given = dict(value=value, key=key, mask=mask, attention_mask=attention_mask,
                         valid_lens=valid_lens, key_value=key_value, value_mask=masks[1])  # fmt: skip
            refuse_with_cache(where, given, causal, top_left)
            check_rank3(where, self._rank)
            result = cached_call(self, ops, query, cache, cache_index, return_weights, training,
                                 masks[2], attention_bias)  # fmt: skip
            carry_keras_mask(result[0], masks[0])
            return result
        if cache_index is not None:
            raise ValueError(f"{where}: `cache_index` is only meaningful with `cache`.")
        if mask is not None and attention_mask is not None:
            raise ValueError(
                f"{where}: give `mask` (multiattn's name) or `attention_mask` (Keras'), not "
                "both: they are the same argument."
            )
        gate = self._gate(ops, query)
        q, k, v = project_inputs(self, ops, where, query, value, key, key_value)
        scores = self._scores_shape(q, k)
        keep, lens = call_keep(ops, where, scores, self._axes, masks, attention_mask, mask,
                               valid_lens, causal)  # fmt: skip
        if isinstance(causal, (bool, np.bool_)):
            causal = bool(causal)
        if attention_bias is not None:
            own = self._rank == 3 and not self._hook_overridden()
            qs = shape_of(query)
            shape4 = (qs[0], self.num_heads, qs[1], shape_of(k)[1])
            attention_bias = check_attention_bias(where, ops, attention_bias, own, shape4)
        window = self.sliding_window
        if self._hook_overridden():
            keep = fold(ops, where, q, k, keep, lens, causal, top_left, window, scores,
                        len(self._axes))  # fmt: skip
            heads, weights = self._call_hook(q, k, v, keep, training, return_weights)
        else:
            heads, weights = self._attention(ops, q, k, v, keep, lens, causal, top_left, window,
                                             return_weights, training, attention_bias)  # fmt: skip
        out = self._output(ops, heads, gate)
        carry_keras_mask(out, masks[0])
        return (out, weights) if return_weights else out

    # -- shapes, masks, config -------------------------------------------------------------

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        query_shape = tuple(query_shape)
        value_shape = query_shape if value_shape is None else tuple(value_shape)
        key_shape = value_shape if key_shape is None else tuple(key_shape)
        if value_shape[1:-1] != key_shape[1:-1]:
            raise ValueError(
                f"{self._WHERE}: All dimensions of `value` and `key`, except the last one, "
                f"must be equal. Received: value_shape={value_shape} and key_shape="
                f"{key_shape}."
            )
        if self._output_shape:
            return query_shape[:-1] + self._output_shape
        return query_shape

    def compute_output_spec(
        self, query, value=None, key=None, query_mask=None, value_mask=None, key_mask=None,
        attention_mask=None, return_attention_scores=False, training=None,
        use_causal_mask=False, *, mask=None, valid_lens=None, causal=False,
        return_weights=False, cache=None, cache_index=None, key_value=None,
        attention_bias=None,
    ):  # fmt: skip
        qs = tuple(query.shape)
        if cache is not None:
            source = tuple(cache[0].shape)
            value_shape = key_shape = (qs[0], source[1], self._widths[1] if self.built else qs[-1])
        elif key_value is not None:
            source = tuple(key_value[0].shape)
            value_shape = key_shape = (qs[0], source[1], qs[-1])
        else:
            value_shape = tuple(value.shape) if value is not None else qs
            key_shape = tuple(key.shape) if key is not None else value_shape
        out = keras.KerasTensor(
            self.compute_output_shape(qs, value_shape, key_shape), dtype=self.compute_dtype
        )
        result = [out]
        if bool(return_weights) or bool(return_attention_scores):
            axes = normalise_axes(self._WHERE, self.attention_axes, len(qs))
            scores = scores_shape(qs[:-1], key_shape[:-1], axes, self.num_heads)
            result.append(keras.KerasTensor(scores, dtype=self.compute_dtype))
        if cache is not None:
            result.append(tuple(keras.KerasTensor(tuple(c.shape), dtype=c.dtype) for c in cache))
        return result[0] if len(result) == 1 else tuple(result)

    def compute_mask(self, inputs, mask=None):
        return keras_mask_of(inputs)  # the query's sequence mask, if any

    def load_own_variables(self, store):
        """Keras' loading of this layer's own variables. The layer has none (the weights
        live in the sublayers), but files written by multiattn before the projections
        moved into sublayers hold them as the layer's own ``vars/0 ..`` (the four
        kernels, then the four biases): such files load too, into the sublayers."""
        if self._trainable_variables or self._non_trainable_variables or not len(store.keys()):
            return super().load_own_variables(store)
        dense = (self._query_dense, self._key_dense, self._value_dense, self._output_dense)
        load_flat_layout(f"{self._WHERE} {self.name!r}", dense, store)

    def get_config(self) -> dict:
        serialize = keras.saving.serialize_keras_object
        extra = {}  # only the options set: configs without them stay as they were
        if self.qk_norm:
            extra = {"qk_norm": True, "qk_norm_epsilon": self.qk_norm_epsilon,
                     "qk_norm_offset": self.qk_norm_offset}  # fmt: skip
        if "score_scale" in vars(self):
            extra["score_scale"] = self.score_scale
        if self.score_softcap is not None:
            extra["score_softcap"] = self.score_softcap
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "dropout": self.dropout,
            "use_bias": self.use_bias,
            "use_gate": self.use_gate,
            "output_shape": self._output_shape,
            "attention_axes": self.attention_axes,
            "sliding_window": self.sliding_window,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "kernel_regularizer": serialize(self.kernel_regularizer),
            "bias_regularizer": serialize(self.bias_regularizer),
            "activity_regularizer": serialize(self.sublayer_activity_regularizer),
            "kernel_constraint": serialize(self.kernel_constraint),
            "bias_constraint": serialize(self.bias_constraint),
            "seed": self.seed,
            "output_dim": self.output_dim,
            "num_key_value_heads": self.num_key_value_heads,
            "rotary_max_length": self.rotary_max_length,
            "rotary_base": self.rotary_base,
            "rotary_dim": self.rotary_dim,
            "rotary_interleaved": self.rotary_interleaved,
            "rotary_scaling": None if self.rotary_scaling is None else dict(self.rotary_scaling),
            "use_output_bias": self.use_output_bias,
            **extra,
        }


MultiHeadAttention._compute_attention._multiattn_own = True


def _positive_float(where: str, name: str, value: Any) -> float:
    """``value`` as a Python float: a positive finite number (bools refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ) or not (math.isfinite(float(value)) and float(value) > 0):  # fmt: skip
        raise ValueError(f"{where}: `{name}` must be a positive finite float; received {value!r}.")
    return float(value)

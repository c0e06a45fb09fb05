"""Multi-head attention layer."""

from __future__ import annotations

import math
from typing import Any

import keras

from .._checks import (
    FLOAT_DTYPES,
    broadcast_shape,
    check_flag,
    check_float,
    check_positive_int,
    check_rank,
    check_rate,
    describe,
    fmt_shape,
    shape_of,
)
from .._namespace import get_ops
from ..ops.attention import attend
from ..ops.blockwise import split_masks
from ..ops.rotary import _check_base
from ._base import (
    check_input_width,
    check_layer_seed,
    get_initializer,
    seed_generator,
    static_width,
)
from .rotary import RotaryEmbedding, check_offset

__all__ = ["MultiHeadAttention"]


def _write(ops: Any, cache: Any, new: Any, place: Any) -> Any:
    """``cache`` ``(B, L, H, D)`` with ``new`` ``(B, t, H, D)`` written where ``place``
    ``(L, t)`` says (one token per written row).

    Selects rather than ``slice_update``: TensorFlow has no gradient for the dynamic
    update slice Keras lowers that to; this is differentiable on every backend, under
    ``jax.jit``/``tf.function`` with a traced index too. One token (the decoding step) is
    broadcast and selected, an exact copy; several tokens (a prompt) are spread by a
    one-hot contraction, exact wherever the backend's float matmul is (reduced-precision
    matmul modes, e.g. TF32 on GPUs, round it).
    """
    new = ops.cast(new, cache.dtype)
    if shape_of(new)[1] == 1:
        spread = new  # broadcasts over the cache positions
    else:
        spread = ops.einsum("lt,bthd->blhd", ops.cast(place, cache.dtype), new)
    written = ops.any(place, axis=1)[None, :, None, None]
    return ops.where(written, spread, cache)


def _cache_dtype(where: str, dtype: Any) -> str:
    """A cache dtype: a known floating dtype name (an integer or bool cache would truncate
    the keys and values written into it)."""
    try:
        name = keras.backend.standardize_dtype(dtype)
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"{where}: unknown `dtype` {describe(dtype)}.") from err
    if name not in FLOAT_DTYPES:
        raise TypeError(
            f"{where}: `dtype` must be a floating dtype ({', '.join(FLOAT_DTYPES)}): a "
            f"cache of dtype {name} would truncate the keys and values; received {dtype!r}."
        )
    return name


@keras.saving.register_keras_serializable(package="multiattn")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention (self- and cross-attention).

    Weights (the layout of ``keras.layers.MultiHeadAttention``):
    ``query_kernel (E_q, H, D)``, ``key_kernel (E_k, H_kv, D)``, ``value_kernel
    (E_v, H_kv, D_v)``, ``output_kernel (H, D_v, E_out)``, and with ``use_bias`` the biases
    ``query_bias (H, D)``, ``key_bias (H_kv, D)``, ``value_bias (H_kv, D_v)``,
    ``output_bias (E_out,)``; ``H_kv = H`` unless ``num_key_value_heads`` is set. Heads are
    contiguous in this layout; the interleaved heads of the PaddlePaddle document are a
    permutation of the kernels' columns (see `multiattn.ops.split_heads`).

    Args:
        num_heads: number of heads ``H``.
        key_dim: per-head width ``D`` of queries and keys.
        value_dim: per-head width ``D_v`` of values, default ``key_dim``.
        output_dim: output width ``E_out``, default the query width ``E_q``.
        use_bias: add biases to the four projections.
        dropout: drop probability on the attention weights, training only.
        kernel_initializer, bias_initializer: Keras initializers.
        seed: int seed for dropout.
        num_key_value_heads: number ``H_kv`` of key/value heads, dividing ``num_heads``;
            None (default) means ``num_heads``. Fewer is grouped-query attention (query
            head ``h`` uses key/value head ``h // (H / H_kv)``), one is multi-query
            attention.
        rotary_max_length: apply rotary position embedding (`RotaryEmbedding`, sublayer
            ``rotary``) to the projected queries and keys, for positions up to this
            many; None (default): no RoPE. Queries and keys are at positions ``0, 1, ...``
            (``cache_index, ...`` when decoding through the cache). ``key_dim`` must be even.
        rotary_base: wavelength base of the rotary embedding.

    Call arguments:
        query: ``(batch, queries, E_q)``, floating (integer, bool and complex inputs raise
            ``TypeError``; Keras casts floating inputs to the compute dtype).
        value: ``(batch, keys, E_v)``, floating.
        key: ``(batch, keys, E_k)``, floating, defaults to ``value``.
        mask: bool (True = may attend) or integer (non-zero = may attend), broadcastable
            to ``(batch, queries, keys)`` (the same for every head), or rank 4 broadcastable
            to ``(batch, heads, queries, keys)``.
        valid_lens: ``(batch,)`` or ``(batch, queries)`` lengths of the keys.
        causal: bottom-right aligned causal mask (the last query sees every key).
        return_weights: also return the weights ``(batch, heads, queries, keys)``: a bool
            (Python or NumPy); anything else (``"False"``, ``2``) raises ``TypeError``.
        training: enables dropout: a bool (Python or NumPy) or None (Keras' default:
            the training flag of the enclosing call, else inference); anything else
            raises ``TypeError``.
        cache: incremental causal self-attention (decoding): the pair
            ``(key_cache, value_cache)`` of ``init_cache``, ``(batch, max_length, H_kv, D)``
            and ``(batch, max_length, H_kv, D_v)``. ``query`` ``(batch, t, E_q)`` holds the
            tokens at positions ``cache_index .. cache_index + t - 1``; their keys and
            values are written into the cache at ``cache_index`` and each query attends to
            the cached positions up to its own. ``value``, ``key``, ``mask``,
            ``valid_lens`` and ``causal`` must not be given.
        cache_index: the position of ``query``'s first token: an int, a NumPy integer or
            an integer scalar tensor (bools, floats and non-scalars raise ``TypeError``).
            A known value (Python and NumPy integers, eager tensors on every backend)
            must satisfy ``0 <= cache_index`` and ``cache_index + queries <= max_length``
            (and ``<= rotary_max_length`` with RoPE), else ``ValueError``. A traced index
            (``jax.jit`` / ``tf.function``) cannot raise when the step runs; if it is out
            of that range, nothing is written (``new_cache`` equals ``cache``) and the
            output (and the weights) are NaN: never a write at another position, never
            a clamped index.
        key_value: cross-attention over keys and values projected once by
            `project_key_value` (the pair it returns); ``value`` and ``key`` must not
            be given. ``mask``/``valid_lens`` refer to those keys.

    Returns:
        ``(batch, queries, E_out)`` in the layer's compute dtype (and the weights). A query
        with nothing to attend gets zero weights, so its output is ``output_bias``.
        float16/bfloat16 attention is computed in float32 internally. With ``cache``:
        ``(output, new_cache)`` (``(output, weights, new_cache)`` with
        ``return_weights``), ``new_cache`` the updated pair; decoding a sequence through
        the cache gives the outputs of one ``causal=True`` pass over the whole sequence.
        The cache must be floating (`init_cache` refuses other dtypes).
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        output_dim: int | None = None,
        use_bias: bool = True,
        dropout: float = 0.0,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        seed: int | None = None,
        num_key_value_heads: int | None = None,
        rotary_max_length: int | None = None,
        rotary_base: float = 10000.0,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = "MultiHeadAttention"
        self.num_heads = check_positive_int(where, "num_heads", num_heads)
        self.num_key_value_heads = check_positive_int(
            where, "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        if self.num_key_value_heads is not None and self.num_heads % self.num_key_value_heads:
            raise ValueError(
                f"{where}: `num_key_value_heads` ({num_key_value_heads}) must divide "
                f"`num_heads` ({num_heads})."
            )
        self.key_dim = check_positive_int(where, "key_dim", key_dim)
        self.value_dim = (
            check_positive_int(where, "value_dim", value_dim, allow_none=True) or self.key_dim
        )
        self.output_dim = check_positive_int(where, "output_dim", output_dim, allow_none=True)
        if not isinstance(use_bias, bool):
            raise TypeError(f"{where}: `use_bias` must be a bool; received {use_bias!r}.")
        self.use_bias = use_bias
        self.dropout = check_rate(where, "dropout", dropout)
        self.kernel_initializer = get_initializer(where, "kernel_initializer", kernel_initializer)
        self.bias_initializer = get_initializer(where, "bias_initializer", bias_initializer)
        self.seed = check_layer_seed(where, seed)
        self.seed_generator = seed_generator(where, seed)
        self.supports_masking = True
        self.rotary_max_length = check_positive_int(
            where, "rotary_max_length", rotary_max_length, allow_none=True
        )
        self.rotary_base = _check_base(where, rotary_base, "rotary_base")
        self.rotary = None
        if self.rotary_max_length is not None:
            if self.key_dim % 2:
                raise ValueError(
                    f"{where}: rotary position embedding needs an even `key_dim`; received "
                    f"{key_dim}."
                )
            self.rotary = RotaryEmbedding(
                self.rotary_max_length, rotary_base, name="rotary", dtype=self.dtype_policy
            )

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads ``H_kv``."""
        return self.num_key_value_heads or self.num_heads

    def _kernel(self, name: str, shape: tuple) -> Any:
        return self.add_weight(name=name, shape=shape, initializer=self.kernel_initializer)

    def _bias(self, name: str, shape: tuple) -> Any:
        if not self.use_bias:
            return None
        return self.add_weight(name=name, shape=shape, initializer=self.bias_initializer)

    def build(self, query_shape, value_shape=None, key_shape=None):
        where = "MultiHeadAttention"
        value_shape = query_shape if value_shape is None else value_shape
        e_q = static_width(where, "query", query_shape)
        e_v = static_width(where, "value", value_shape)
        e_k = static_width(where, "key", value_shape if key_shape is None else key_shape)
        h, hkv, d, dv = self.num_heads, self.kv_heads, self.key_dim, self.value_dim
        e_out = self.output_dim or e_q
        self.query_kernel = self._kernel("query_kernel", (e_q, h, d))
        self.key_kernel = self._kernel("key_kernel", (e_k, hkv, d))
        self.value_kernel = self._kernel("value_kernel", (e_v, hkv, dv))
        self.output_kernel = self._kernel("output_kernel", (h, dv, e_out))
        self.query_bias = self._bias("query_bias", (h, d))
        self.key_bias = self._bias("key_bias", (hkv, d))
        self.value_bias = self._bias("value_bias", (hkv, dv))
        self.output_bias = self._bias("output_bias", (e_out,))
        if self.rotary is not None:
            self.rotary.build((None, None, h, d))

    def _project_self(self, ops: Any, x: Any) -> tuple[Any, Any, Any]:
        """Self-attention: the query, key and value projections of one input.

        Three contractions, not one over the concatenated ``(E, 3H, D)`` kernels: measured
        with the benchmark's shape (batch 8, length 512, width 512, 8 heads, float32), the
        fused form was no faster on torch and jax and slower on TensorFlow (about 25% in
        forward+backward under ``tf.function``), and it makes head-sharded kernels
        reshuffle under model parallelism.
        """
        return (
            self._project(ops, x, self.query_kernel, self.query_bias),
            self._project(ops, x, self.key_kernel, self.key_bias),
            self._project(ops, x, self.value_kernel, self.value_bias),
        )

    def _project(self, ops: Any, x: Any, kernel: Any, bias: Any) -> Any:
        dtype = self.compute_dtype
        return ops.linear(
            x, ops.cast(kernel, dtype), None if bias is None else ops.cast(bias, dtype)
        )

    def _keep(
        self, where: str, ops: Any, shape4: tuple, mask: Any, valid_lens: Any, causal: bool
    ) -> Any:
        if mask is not None:
            ms = shape_of(mask)
            if len(ms) <= 3:
                b, _, q, k = shape4
                broadcast_shape(where, "mask", ms, (b, q, k))
                if len(ms) == 3:
                    mask = ops.expand_dims(mask, 1)
            else:
                check_rank(where, "mask", ms, 0, 4)
        return split_masks(
            ops, shape4, mask=mask, valid_lens=valid_lens, causal=causal, where=where
        )

    def _rotate(self, q: Any, k: Any, q_offset: Any = 0, k_offset: Any = 0) -> tuple[Any, Any]:
        if self.rotary is None:
            return q, k
        return self.rotary(q, offset=q_offset), self.rotary(k, offset=k_offset)

    def _output(self, ops: Any, heads: Any) -> Any:
        dtype = self.compute_dtype
        bias = None if self.output_bias is None else ops.cast(self.output_bias, dtype)
        return ops.linear(heads, ops.cast(self.output_kernel, dtype), bias, contract=2)

    def _attend(self, ops, q, k, v, keep, lens, causal, return_weights, training) -> Any:
        return attend(
            ops,
            q,
            k,
            v,
            keep=keep,
            valid_lens=lens,
            causal=causal,
            scale=1.0 / math.sqrt(self.key_dim),
            dropout=self.dropout,
            training=training,
            seed=self.seed_generator,
            return_weights=return_weights,
        )

    def init_cache(self, batch_size: int, max_length: int, dtype: str | None = None):
        """An empty self-attention cache: zeros ``(batch_size, max_length, H_kv, D)`` for
        the keys and ``(batch_size, max_length, H_kv, D_v)`` for the values, in ``dtype``
        (default the compute dtype; a floating dtype, since an integer or bool cache would
        truncate the keys and values). Pass it as ``cache`` with ``cache_index=0``."""
        where = "MultiHeadAttention.init_cache"
        batch_size = check_positive_int(where, "batch_size", batch_size)
        max_length = check_positive_int(where, "max_length", max_length)
        dtype = self.compute_dtype if dtype is None else _cache_dtype(where, dtype)
        shape = (batch_size, max_length, self.kv_heads)
        return (
            keras.ops.zeros((*shape, self.key_dim), dtype=dtype),
            keras.ops.zeros((*shape, self.value_dim), dtype=dtype),
        )

    def project_key_value(self, value, key=None):
        """Project the keys and values of cross-attention once, for reuse across calls.

        Args:
            value: ``(batch, keys, E_v)``; key: ``(batch, keys, E_k)``, default ``value``.

        Returns:
            ``(keys, values)``: ``(batch, keys, H_kv, D)`` and ``(batch, keys, H_kv, D_v)``
            in the compute dtype (RoPE applied to the keys when enabled), to pass as
            ``key_value``.
        """
        where = "MultiHeadAttention.project_key_value"
        if not self.built:
            raise ValueError(f"{where}: the layer must be built (called once) first.")
        self._check_key_value_inputs(where, value, key)
        key = value if key is None else key
        ops = get_ops(value)
        k = self._project(ops, key, self.key_kernel, self.key_bias)
        v = self._project(ops, value, self.value_kernel, self.value_bias)
        if self.rotary is not None:
            self._check_rotary_length(where, "key", shape_of(key)[1])
            k = self.rotary(k)
        return k, v

    def _check_key_value_inputs(self, where: str, value: Any, key: Any) -> None:
        """``value`` (and ``key`` when given) are floating ``(batch, keys, width)`` tensors
        of the widths the layer was built with; a ``key`` left out is ``value``, and an
        error about it names ``value``."""
        check_input_width(where, "value", value, self.value_kernel.shape[0])
        ops = get_ops(value)
        check_float(where, "value", value, ops)
        if key is None:
            check_input_width(where, "value", value, self.key_kernel.shape[0])
        else:
            check_input_width(where, "key", key, self.key_kernel.shape[0])
            check_float(where, "key", key, ops)

    def _check_rotary_length(self, where: str, name: str, length: int | None) -> None:
        """Positions ``0 .. length - 1`` of ``name`` must fit the rotary table."""
        if length is not None and length > self.rotary_max_length:
            raise ValueError(
                f"{where}: `{name}` has {length} positions, more than the rotary embedding "
                f"covers (rotary_max_length={self.rotary_max_length})."
            )

    def _check_kv_pair(self, where: str, name: str, pair: Any, batch: Any) -> tuple[Any, Any]:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(
                f"{where}: `{name}` must be a pair (keys, values); received {type(pair).__name__}."
            )
        k, v = pair
        for label, t in (("keys", k), ("values", v)):
            if not (hasattr(t, "shape") and hasattr(t, "dtype")):
                raise TypeError(
                    f"{where}: the {label} of `{name}` must be a tensor; received {describe(t)}."
                )
            check_float(where, name, t, get_ops(t))
        ks, vs = shape_of(k), shape_of(v)
        want_k = (batch, None, self.kv_heads, self.key_dim)
        want_v = (batch, ks[1] if len(ks) == 4 else None, self.kv_heads, self.value_dim)
        for label, got, want in (("keys", ks, want_k), ("values", vs, want_v)):
            if len(got) != 4 or any(
                w is not None and g is not None and g != w for g, w in zip(got, want)
            ):
                raise ValueError(
                    f"{where}: the {label} of `{name}` must have shape {fmt_shape(want)}; "
                    f"received {fmt_shape(got)}."
                )
        return k, v

    def _cached_call(self, ops, query, cache, cache_index, return_weights, training):
        """Incremental causal self-attention through a fixed-size cache (see ``call``)."""
        where = "MultiHeadAttention"
        qs = shape_of(query)
        k_cache, v_cache = self._check_kv_pair(where, "cache", cache, qs[0])
        max_length = shape_of(k_cache)[1]
        if max_length is None or qs[1] is None:
            raise ValueError(
                f"{where}: with `cache`, the cache length and the query length must be "
                f"static; received cache {fmt_shape(shape_of(k_cache))} and query "
                f"{fmt_shape(qs)}."
            )
        if cache_index is None:
            raise ValueError(f"{where}: `cache` needs `cache_index` (the first position).")
        if qs[1] > max_length:
            raise ValueError(
                f"{where}: `query` holds {qs[1]} tokens, more than the cache holds "
                f"(max_length={max_length}, `cache` of shape {fmt_shape(shape_of(k_cache))})."
            )
        tokens = qs[1]
        cache_index = check_offset(
            where, cache_index, tokens, max_length, ops, name="cache_index", limit="max_length"
        )
        bound = max_length
        if self.rotary is not None:
            bound = min(bound, self.rotary_max_length)
            if isinstance(cache_index, int):
                check_offset(
                    where,
                    cache_index,
                    tokens,
                    self.rotary_max_length,
                    ops,
                    name="cache_index",
                    limit="rotary_max_length",
                )
        in_range = None
        if isinstance(cache_index, int):
            index = cache_index
        else:
            # A traced index cannot raise: out of range, nothing is written and the
            # outputs are NaN (see `call`).
            index = ops.cast(cache_index, "int32")
            in_range = ops.logical_and(
                ops.greater_equal(index, 0), ops.less_equal(index + tokens, bound)
            )
        q, k, v = self._project_self(ops, query)
        q, k = self._rotate(q, k, cache_index, cache_index)
        # place[j, i]: cache position j receives token i (j == index + i)
        slots = ops.arange(max_length, dtype="int32")[:, None]
        place = ops.equal(slots, ops.arange(tokens, dtype="int32")[None, :] + index)
        if in_range is not None:
            place = ops.logical_and(place, in_range)
        k_cache = _write(ops, k_cache, k, place)
        v_cache = _write(ops, v_cache, v, place)
        # Query i (position index + i) sees the cached positions j <= index + i.
        positions = ops.expand_dims(ops.arange(tokens, dtype="int32") + index, 1)
        keep = ops.less_equal(ops.arange(max_length, dtype="int32")[None, :], positions)
        keep = ops.expand_dims(ops.expand_dims(keep, 0), 0)  # (1, 1, t, max_length)
        dtype = self.compute_dtype
        result = self._attend(
            ops,
            q,
            ops.cast(k_cache, dtype),
            ops.cast(v_cache, dtype),
            keep,
            None,
            False,
            return_weights,
            training,
        )
        heads, weights = result if return_weights else (result, None)
        out = self._output(ops, heads)
        if in_range is not None:
            out = ops.where(in_range, out, float("nan"))
            if weights is not None:
                weights = ops.where(in_range, weights, float("nan"))
        new_cache = (k_cache, v_cache)
        return (out, weights, new_cache) if return_weights else (out, new_cache)

    def call(
        self,
        query,
        value=None,
        key=None,
        *,
        mask=None,
        valid_lens=None,
        causal=False,
        return_weights=False,
        training=None,
        cache=None,
        cache_index=None,
        key_value=None,
    ):
        where = "MultiHeadAttention"
        check_input_width(where, "query", query, self.query_kernel.shape[0])
        ops = get_ops(query)
        check_float(where, "query", query, ops)
        return_weights = check_flag(where, "return_weights", return_weights, ops)
        training = check_flag(where, "training", training, ops, allow_none=True)
        if cache is not None:
            given = [
                n
                for n, a in (
                    ("value", value),
                    ("key", key),
                    ("mask", mask),
                    ("valid_lens", valid_lens),
                    ("key_value", key_value),
                )
                if a is not None
            ]
            if causal:
                given.append("causal")
            if given:
                raise ValueError(
                    f"{where}: with `cache` (causal self-attention through the cache), "
                    f"{', '.join(f'`{n}`' for n in given)} must not be given."
                )
            return self._cached_call(ops, query, cache, cache_index, return_weights, training)
        if cache_index is not None:
            raise ValueError(f"{where}: `cache_index` is only meaningful with `cache`.")
        qs = shape_of(query)
        if key_value is not None:
            if value is not None or key is not None:
                raise ValueError(f"{where}: give either `key_value` or `value`/`key`, not both.")
            k, v = self._check_kv_pair(where, "key_value", key_value, qs[0])
            dtype = self.compute_dtype
            k, v = ops.cast(k, dtype), ops.cast(v, dtype)
            q = self._project(ops, query, self.query_kernel, self.query_bias)
            if self.rotary is not None:
                self._check_rotary_length(where, "query", qs[1])
                q = self.rotary(q)
            ks = shape_of(k)
        else:
            if value is None:
                raise ValueError(f"{where}: `value` is required (or `key_value`, or `cache`).")
            self._check_key_value_inputs(where, value, key)
            key = value if key is None else key
            ks, vs = shape_of(key), shape_of(value)
            if ks[1] is not None and vs[1] is not None and ks[1] != vs[1]:
                raise ValueError(
                    f"{where}: `key` and `value` must have the same length; received key "
                    f"{fmt_shape(ks)} and value {fmt_shape(vs)}."
                )
            batches = {s[0] for s in (qs, ks, vs) if s[0] is not None}
            if len(batches) > 1:
                raise ValueError(
                    f"{where}: `query`, `key` and `value` must share the batch size; received "
                    f"{fmt_shape(qs)}, {fmt_shape(ks)} and {fmt_shape(vs)}."
                )
            q = self._project(ops, query, self.query_kernel, self.query_bias)
            k = self._project(ops, key, self.key_kernel, self.key_bias)
            v = self._project(ops, value, self.value_kernel, self.value_bias)
            if self.rotary is not None:
                self._check_rotary_length(where, "query", qs[1])
                self._check_rotary_length(where, "key", ks[1])
            q, k = self._rotate(q, k)
        keep, lens, causal = self._keep(
            where, ops, (qs[0], self.num_heads, qs[1], ks[1]), mask, valid_lens, causal
        )
        result = self._attend(ops, q, k, v, keep, lens, causal, return_weights, training)
        heads, weights = result if return_weights else (result, None)
        out = self._output(ops, heads)
        return (out, weights) if return_weights else out

    def compute_mask(self, inputs, mask=None):
        return getattr(inputs, "_keras_mask", None)  # the query's sequence mask, if any

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "output_dim": self.output_dim,
            "use_bias": self.use_bias,
            "dropout": self.dropout,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "seed": self.seed,
            "num_key_value_heads": self.num_key_value_heads,
            "rotary_max_length": self.rotary_max_length,
            "rotary_base": self.rotary_base,
        }

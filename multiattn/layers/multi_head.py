"""Multi-head attention layer: a drop-in for ``keras.layers.MultiHeadAttention``."""

from __future__ import annotations

import math
import string
from typing import Any

import keras
import numpy as np

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
from .._namespace import cache_index_checked, cache_values_checked, caches_owned, get_ops
from ..ops.attention import attend
from ..ops.masking import (
    block_keep,
    check_bias,
    keras_keep,
    lens_rank4,
    split_masks,
    top_left_keep,
    truthy_keep,
    window_keep,
)
from ..ops.rotary import _check_base, check_rotary_dim, check_rotary_scaling
from ._base import (
    as_mask,
    call_sublayer,
    check_layer_seed,
    fresh_initializer,
    get_initializer,
    keras_mask_of,
    plain_dense,
    project,
    seed_generator,
)
from .rotary import RotaryEmbedding, check_offset

__all__ = ["MultiHeadAttention"]

try:  # Keras keeps a tensor's mask beside the tensor where it cannot be an attribute (JAX)
    from keras.src.backend import set_keras_mask as _set_keras_mask
except ImportError:  # pragma: no cover - other Keras layouts

    def _set_keras_mask(x: Any, mask: Any) -> None:
        x._keras_mask = mask


_keras_mask_of = keras_mask_of


def _clear_keras_mask(x: Any) -> None:
    if x is not None and _keras_mask_of(x) is not None:
        try:
            _set_keras_mask(x, None)
        except (AttributeError, TypeError):
            pass


def _write(ops: Any, cache: Any, new: Any, index: Any, in_range: Any = None) -> Any:
    """``cache`` ``(B, H, L, D)`` (heads first) with ``new`` ``(B, t, H, D)`` written at
    positions ``index .. index + t - 1``.

    A known ``index`` (a Python int, checked in range) is a slice write: the cache rows
    before and after the new tokens, and the tokens between them, joined along the
    positions. Its cost is one copy of the cache whatever ``t``, it is an exact copy on
    every backend, and it differentiates everywhere (TensorFlow has no gradient for the
    dynamic update slice ``keras.ops.slice_update`` lowers to; a concatenation has one).
    A traced ``index`` (``jax.jit`` / ``tf.function``) goes to `_write_select`.

    Inside `multiattn._namespace.owned_caches` (``generate``), a namespace that
    ``writes_in_place`` writes ``new`` into ``cache`` itself (`_write_owned`).
    """
    new = ops.transpose(ops.cast(new, cache.dtype), (0, 2, 1, 3))
    if ops.writes_in_place and caches_owned():
        return _write_owned(ops, cache, new, index, in_range)
    if not isinstance(index, int):
        return _write_select(ops, cache, new, index, in_range)
    tokens, length = shape_of(new)[2], shape_of(cache)[2]
    parts = [new]
    if index > 0:
        parts.insert(0, cache[:, :, :index])
    if index + tokens < length:
        parts.append(cache[:, :, index + tokens :])
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=2)


def _write_owned(ops: Any, cache: Any, new: Any, index: Any, in_range: Any = None) -> Any:
    """`_write` of ``new`` ``(B, H, t, D)`` into a cache its caller owns
    (`multiattn._namespace.owned_caches`): the namespace's ``write_cache``, whose cost
    follows the tokens written. Where ``in_range`` is False, the tokens at position 0 are
    written back unchanged."""
    if in_range is not None:
        index = ops.where(in_range, index, 0)
        zero = index * 0  # the starts of a dynamic slice share one integer dtype (JAX)
        old = ops.slice(cache, (zero, zero, index, zero), shape_of(new))
        new = ops.where(in_range, new, old)
    return ops.write_cache(cache, new, index)


def _write_select(ops: Any, cache: Any, new: Any, index: Any, in_range: Any = None) -> Any:
    """`_write` of ``new`` ``(B, H, t, D)`` at an index known only as a tensor: ``new``
    is placed by a select against the positions, and nothing is written where
    ``in_range`` (a scalar bool, or None) is False.

    Differentiable on every backend, under ``jax.jit``/``tf.function`` too (a traced
    index has no value to slice at). One token (the decoding step) is broadcast and
    selected, an exact copy; several tokens (a prompt) are spread by a one-hot
    contraction, exact wherever the backend's float matmul is (reduced-precision matmul
    modes, e.g. TF32 on GPUs, round it), at a cost that grows with ``t`` times the cache
    length.
    """
    tokens, length = shape_of(new)[2], shape_of(cache)[2]
    # place[j, i]: cache position j receives token i (j == index + i)
    slots = ops.arange(length, dtype="int32")[:, None]
    place = ops.equal(slots, ops.arange(tokens, dtype="int32")[None, :] + index)
    if in_range is not None:
        place = ops.logical_and(place, in_range)
    if tokens == 1:
        spread = new  # broadcasts over the cache positions
    else:
        spread = ops.einsum("lt,bhtd->bhld", ops.cast(place, cache.dtype), new)
    written = ops.any(place, axis=1)[None, None, :, None]
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


def _positive_int(where: str, name: str, value: Any, allow_none: bool = False) -> int | None:
    """A positive int (NumPy integers too); the message names the argument as Keras' does
    ("argument `num_heads`") and quotes the value."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        none = " or None" if allow_none else ""
        raise ValueError(
            f"{where}: received an invalid value for argument `{name}`, expected a positive "
            f"integer{none}; received {name}={value!r}."
        )
    return int(value)


def _check_output_shape(where: str, value: Any) -> tuple[int, ...] | None:
    """Keras' ``output_shape``: None, a positive int or a tuple/list of positive ints."""
    if value is None:
        return None
    dims = (value,) if isinstance(value, (int, np.integer)) else value
    if isinstance(value, (bool, str, bytes)) or not isinstance(dims, (tuple, list)):
        dims = None
    elif not dims or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in dims
    ):
        dims = None
    if dims is None:
        raise ValueError(
            f"{where}: Invalid `output_shape` {value!r}: expected a positive int or a tuple or "
            "list of positive ints (the output's shape after the batch and sequence axes)."
        )
    return tuple(int(d) for d in dims)


def _check_attention_axes(where: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    axes = (value,) if isinstance(value, (int, np.integer)) else value
    if (
        isinstance(value, bool)
        or not isinstance(axes, (tuple, list))
        or not axes
        or not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in axes)
    ):
        raise ValueError(
            f"{where}: `attention_axes` must be an int, list, or tuple of ints; received "
            f"attention_axes={value!r}."
        )
    return tuple(int(a) for a in axes)


def _check_sliding_window(where: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(
            f"{where}: `sliding_window` must be `None` or a positive integer; received "
            f"sliding_window={value!r}."
        )
    return int(value)


def _check_keras_flag(where: str, name: str, value: Any) -> bool:
    """Keras' call flags that it reads by truthiness (``use_causal_mask=0`` in Keras' own
    tests): bools and the integers 0 and 1."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{where}: `{name}` must be a bool; received {describe(value)}.")


def _proj_equation(free: int, bound: int, out: int) -> tuple[str, str]:
    """The einsum equation of a projection contracting the last ``bound`` axes of an input
    with ``free`` leading axes into ``out`` new axes, and the bias axes."""
    letters = string.ascii_lowercase
    lead, mid = letters[:free], letters[free : free + bound]
    new = letters[free + bound : free + bound + out]
    return f"{lead}{mid},{mid}{new}->{lead}{new}", new


def _and(ops: Any, a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return ops.logical_and(a, b)


def _rank4(ops: Any, keep: Any) -> Any:
    if keep is None:
        return None
    for _ in range(4 - len(shape_of(keep))):
        keep = ops.expand_dims(keep, 0)
    return keep


def _length(ops: Any, x: Any, axis: int) -> Any:
    s = shape_of(x)[axis]
    return s if s is not None else ops.shape(x)[axis]


def _keras_rule(
    ops: Any, where: str, name: str, mask: Any, scores_shape: tuple, n_axes: int
) -> Any:
    """`multiattn.ops.masking.keras_keep` of ``mask`` given as a tensor, an array or a
    nested list."""
    return keras_keep(ops, where, name, as_mask(where, name, mask), scores_shape, n_axes)


def _skip_one_load(layer: Any) -> Any:
    """A stand-in for ``layer.load_own_variables`` that ignores one call (the sublayer's
    absent entry in a file of the flat layout, already loaded by its parent) and then
    removes itself."""

    def skip(store: Any) -> None:
        del layer.load_own_variables

    return skip


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
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_shape: Any = None,
        attention_axes: Any = None,
        sliding_window: int | None = None,
        flash_attention: bool | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        activity_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        use_gate: bool = False,
        seed: int | None = None,
        *,
        output_dim: int | None = None,
        num_key_value_heads: int | None = None,
        rotary_max_length: int | None = None,
        rotary_base: float = 10000.0,
        rotary_dim: int | None = None,
        rotary_interleaved: bool = False,
        rotary_scaling: dict | None = None,
        use_output_bias: bool | None = None,
        **kwargs: Any,
    ):
        where = self._WHERE
        num_heads = _positive_int(where, "num_heads", num_heads)
        key_dim = _positive_int(where, "key_dim", key_dim)
        value_dim = _positive_int(where, "value_dim", value_dim, allow_none=True)
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.num_key_value_heads = check_positive_int(
            where, "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        if self.num_key_value_heads is not None and self.num_heads % self.num_key_value_heads:
            raise ValueError(
                f"{where}: `num_key_value_heads` ({num_key_value_heads}) must divide "
                f"`num_heads` ({num_heads})."
            )
        self.key_dim = key_dim
        self.value_dim = value_dim or key_dim
        shape = _check_output_shape(where, output_shape)
        dim = check_positive_int(where, "output_dim", output_dim, allow_none=True)
        if dim is not None:
            if shape is not None and shape != (dim,):
                raise ValueError(
                    f"{where}: `output_dim` ({dim}) and `output_shape` ({output_shape!r}) "
                    "disagree; give one of them (output_dim=n is output_shape=(n,))."
                )
            shape = (dim,)
        self._output_shape = shape
        self.output_dim = shape[0] if shape is not None and len(shape) == 1 else None
        if not isinstance(use_bias, bool):
            raise TypeError(f"{where}: `use_bias` must be a bool; received {use_bias!r}.")
        if not isinstance(use_gate, bool):
            raise TypeError(f"{where}: `use_gate` must be a bool; received {use_gate!r}.")
        if use_output_bias is not None and not isinstance(use_output_bias, bool):
            raise TypeError(
                f"{where}: `use_output_bias` must be a bool or None; received {use_output_bias!r}."
            )
        self.use_bias = use_bias
        self.use_output_bias = use_bias if use_output_bias is None else use_output_bias
        self.use_gate = use_gate
        self.dropout = check_rate(where, "dropout", dropout)
        self.attention_axes = _check_attention_axes(where, attention_axes)
        self.sliding_window = _check_sliding_window(where, sliding_window)
        if flash_attention is not None and not isinstance(flash_attention, bool):
            raise TypeError(
                f"{where}: `flash_attention` must be a bool or None; received {flash_attention!r}."
            )
        self._flash_attention = flash_attention or keras.config.is_flash_attention_enabled()
        if self._flash_attention and self.dropout > 0.0:
            raise ValueError(
                f"{where}: Dropout is not supported when flash attention is enabled "
                f"(dropout={dropout}). Please set dropout to 0.0 to use flash attention, or "
                "pass flash_attention=False."
            )
        self.kernel_initializer = get_initializer(where, "kernel_initializer", kernel_initializer)
        self.bias_initializer = get_initializer(where, "bias_initializer", bias_initializer)
        self.kernel_regularizer = self._get(where, "kernel_regularizer", kernel_regularizer)
        self.bias_regularizer = self._get(where, "bias_regularizer", bias_regularizer)
        self.sublayer_activity_regularizer = self._get(
            where, "activity_regularizer", activity_regularizer
        )
        self.kernel_constraint = self._get(where, "kernel_constraint", kernel_constraint)
        self.bias_constraint = self._get(where, "bias_constraint", bias_constraint)
        self.seed = check_layer_seed(where, seed)
        # Like Keras' Dropout: a seed generator only when there is dropout to seed.
        self.seed_generator = seed_generator(where, seed) if self.dropout > 0.0 else None
        self.supports_masking = True
        self.rotary_max_length = check_positive_int(
            where, "rotary_max_length", rotary_max_length, allow_none=True
        )
        self.rotary_base = _check_base(where, rotary_base, "rotary_base")
        self.rotary_dim = check_rotary_dim(where, rotary_dim, self.key_dim)
        if not isinstance(rotary_interleaved, bool):
            raise TypeError(
                f"{where}: `rotary_interleaved` must be a bool; received {rotary_interleaved!r}."
            )
        self.rotary_interleaved = rotary_interleaved
        self.rotary_scaling = check_rotary_scaling(where, rotary_scaling, "rotary_scaling")
        self.rotary = None
        if self.rotary_max_length is not None:
            if self.rotary_dim is None and self.key_dim % 2:
                raise ValueError(
                    f"{where}: rotary position embedding needs an even `key_dim` (or an "
                    f"even `rotary_dim`); received {key_dim}."
                )
            self.rotary = RotaryEmbedding(
                self.rotary_max_length,
                rotary_base,
                rotary_dim=self.rotary_dim,
                interleaved=rotary_interleaved,
                scaling=self.rotary_scaling,
                name="rotary",
                dtype=self.dtype_policy,
            )
        self._axes: tuple[int, ...] = (1,)

    @staticmethod
    def _get(where: str, name: str, value: Any) -> Any:
        module = keras.constraints if name.endswith("constraint") else keras.regularizers
        try:
            return module.get(value)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{where}: unknown `{name}` {describe(value)}.") from err

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

    @property
    def query_dense(self) -> Any:
        return self._query_dense

    @property
    def key_dense(self) -> Any:
        return self._key_dense

    @property
    def value_dense(self) -> Any:
        return self._value_dense

    @property
    def output_dense(self) -> Any:
        return self._output_dense

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

    def _sublayer_kwargs(self) -> dict:
        return dict(
            kernel_initializer=fresh_initializer(self.kernel_initializer),
            bias_initializer=fresh_initializer(self.bias_initializer),
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            activity_regularizer=self.sublayer_activity_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            dtype=self.dtype_policy,
        )

    def _dense(
        self, name: str, rank: int, bound: int, out: tuple, activation=None, use_bias=None
    ) -> Any:
        equation, bias_axes = _proj_equation(rank - bound, bound, len(out))
        use_bias = self.use_bias if use_bias is None else use_bias
        return keras.layers.EinsumDense(
            equation,
            output_shape=[None] * (rank - bound - 1) + list(out),
            bias_axes=bias_axes if use_bias else None,
            activation=activation,
            name=name,
            **self._sublayer_kwargs(),
        )

    def _check_shapes(self, query_shape: Any, value_shape: Any, key_shape: Any) -> tuple:
        """The three input shapes as tuples, after Keras' checks (and multiattn's: equal
        ranks, at least 3, static feature widths)."""
        where = self._WHERE
        shapes = []
        for name, s in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            try:
                shapes.append(tuple(None if d is None else int(d) for d in s))
            except TypeError as err:
                raise ValueError(
                    f"{where}: the shape of `{name}` must be a tuple of dimensions; received {s!r}."
                ) from err
        qs, vs, ks = shapes
        if vs[1:-1] != ks[1:-1]:
            raise ValueError(
                f"{where}: All dimensions of `value` and `key`, except the last one, must be "
                f"equal. Received: value_shape={vs} and key_shape={ks}."
            )
        for name, s in (("query", qs), ("value", vs), ("key", ks)):
            if len(s) < 3:
                raise ValueError(
                    f"{where}: `{name}` must have rank 3 (batch, sequence, features), or more "
                    f"for attention over several axes; received shape {fmt_shape(s)}."
                )
            if s[-1] is None:
                raise ValueError(
                    f"{where}: the last dimension of `{name}` must be static; received "
                    f"{fmt_shape(s)}."
                )
        if len(qs) != len(vs):
            raise ValueError(
                f"{where}: `query` and `value` must have the same rank; received query "
                f"{fmt_shape(qs)} and value {fmt_shape(vs)}."
            )
        return qs, vs, ks

    def _normalise_axes(self, rank: int) -> tuple[int, ...]:
        """The attention axes of inputs of ``rank`` (Keras' rule: negative axes count from
        the end of the input), each in ``1 .. rank - 2``."""
        if self.attention_axes is None:
            return tuple(range(1, rank - 1))
        axes = tuple(a + rank if a < 0 else a for a in self.attention_axes)
        if any(not 1 <= a <= rank - 2 for a in axes) or len(set(axes)) != len(axes):
            raise ValueError(
                f"{self._WHERE}: `attention_axes` {self.attention_axes!r} is out of range for "
                f"inputs of rank {rank}: each axis must name one of the axes 1 .. {rank - 2} "
                f"(or -{rank - 1} .. -2), once; the batch (0) and feature (-1) axes cannot be "
                "attended over."
            )
        return axes

    def build(self, query_shape, value_shape=None, key_shape=None):
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        qs, vs, ks = self._check_shapes(query_shape, value_shape, key_shape)
        rank = len(qs)
        self._axes = self._normalise_axes(rank)
        if rank > 3 and self.rotary is not None:
            raise ValueError(
                f"{self._WHERE}: rotary position embedding needs (batch, sequence, features) "
                f"inputs; received query {fmt_shape(qs)}."
            )
        h, hkv, d, dv = self.num_heads, self.kv_heads, self.key_dim, self.value_dim
        out = self._output_shape or (qs[-1],)
        self._widths = (qs[-1], vs[-1], ks[-1])
        self._rank = rank
        self._query_dense = self._dense("query", rank, 1, (h, d))
        self._query_dense.build(qs)
        self._key_dense = self._dense("key", rank, 1, (hkv, d))
        self._key_dense.build(ks)
        if self.use_gate:
            self._gate_dense = self._dense("gate", rank, 1, (h, dv), activation="sigmoid")
            self._gate_dense.build(qs)
        self._value_dense = self._dense("value", rank, 1, (hkv, dv))
        self._value_dense.build(vs)
        self._output_dense = self._dense(
            "attention_output", rank + 1, 2, out, use_bias=self.use_output_bias
        )
        self._output_dense.build((*qs[:-1], h, dv))
        if self.rotary is not None:
            self.rotary.build((None, None, h, d))

    # -- projections -------------------------------------------------------------------------

    def _plain(self, dense: Any) -> bool:
        """`multiattn.layers._base.plain_dense` in the layer's compute dtype."""
        return plain_dense(dense, self.compute_dtype)

    def _project(self, ops: Any, x: Any, dense: Any, contract: int = 1) -> Any:
        """``dense(x)`` (`multiattn.layers._base.project`: `ops.linear` for a plain
        float sublayer, else the sublayer called)."""
        return project(ops, x, dense, self.compute_dtype, contract)

    def _project_self(self, ops: Any, x: Any) -> tuple[Any, Any, Any]:
        """Self-attention: the query, key and value projections of one input."""
        dense = (self._query_dense, self._key_dense, self._value_dense)
        return tuple(self._project(ops, x, d) for d in dense)

    def _gate(self, ops: Any, query: Any) -> Any:
        return self._project(ops, query, self._gate_dense) if self.use_gate else None

    def _output(self, ops: Any, heads: Any, gate: Any = None) -> Any:
        if gate is not None:
            heads = ops.multiply(heads, ops.cast(gate, heads.dtype))
        return self._project(ops, heads, self._output_dense, contract=2)

    def _rotate(self, q: Any, k: Any, q_offset: Any = 0, k_offset: Any = 0) -> tuple[Any, Any]:
        if self.rotary is None:
            return q, k
        return (
            call_sublayer(self.rotary, q, offset=q_offset),
            call_sublayer(self.rotary, k, offset=k_offset),
        )

    # -- attention ---------------------------------------------------------------------------

    def _attend(
        self, ops, q, k, v, keep, lens, causal, return_weights, training, bias=None,
        kv_heads_first=False, kv_finite=False,
    ):  # fmt: skip
        # `score_scale` (set by subclasses such as T5's attention): the scores' multiplier.
        scale = getattr(self, "score_scale", None)
        return attend(
            ops,
            q,
            k,
            v,
            keep=keep,
            valid_lens=lens,
            causal=causal,
            scale=1.0 / math.sqrt(self.key_dim) if scale is None else scale,
            dropout=self.dropout,
            training=training,
            seed=self.seed_generator,
            return_weights=return_weights,
            bias=bias,
            kv_heads_first=kv_heads_first,
            kv_finite=kv_finite,
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

    def _scores_shape(self, q: Any, k: Any) -> tuple:
        """The shape of the attention scores of projected ``q`` ``(B, *dims, H, D)`` and
        ``k``: ``(B, <other axes>, H, <query attention axes>, <key attention axes>)``."""
        qs, ks = shape_of(q), shape_of(k)
        rest = [a for a in range(1, len(qs) - 2) if a not in self._axes]
        return (
            qs[0],
            *(qs[a] for a in rest),
            self.num_heads,
            *(qs[a] for a in self._axes),
            *(ks[a] for a in self._axes),
        )

    def _attention(
        self,
        ops: Any,
        q: Any,
        k: Any,
        v: Any,
        keep: Any,
        lens: Any,
        causal: bool,
        top_left: bool,
        window: int | None,
        return_weights: bool,
        training: Any,
        bias: Any = None,
    ) -> tuple[Any, Any]:
        """The attention of projected ``q`` ``(B, *dims, H, D)``, ``k`` and ``v``:
        ``(output (B, *dims, H, D_v), weights or None)``. ``keep`` is aligned with the
        scores (see `_scores_shape`); ``lens`` and ``causal`` (bottom-right) apply to
        rank-4 inputs; ``top_left`` is Keras' causal mask and ``window`` its sliding
        window."""
        if len(shape_of(q)) == 4:
            tq, tk = shape_of(q)[1], shape_of(k)[1]
            if top_left and not causal and tq is not None and tq == tk:
                causal = True  # as many queries as keys: top-left is bottom-right
            elif top_left:
                keep = _and(ops, keep, _rank4(ops, top_left_keep(ops, *self._lengths(ops, q, k))))
            if window is not None:
                keep = _and(
                    ops, keep, _rank4(ops, window_keep(ops, *self._lengths(ops, q, k), window))
                )
            result = self._attend(ops, q, k, v, keep, lens, causal, return_weights, training, bias)
            return result if return_weights else (result, None)
        return self._attention_axes_flat(
            ops, q, k, v, keep, top_left, window, return_weights, training
        )

    @staticmethod
    def _lengths(ops: Any, q: Any, k: Any) -> tuple[Any, Any]:
        return _length(ops, q, 1), _length(ops, k, 1)

    def _attention_axes_flat(
        self, ops, q, k, v, keep, top_left, window, return_weights, training
    ) -> tuple[Any, Any]:
        """Attention over several axes: the other axes join the batch, the attention axes
        are flattened into one (a softmax over several axes is one over their product),
        and the core runs on ``(batch, positions, heads, dim)``."""
        where = self._WHERE
        qs, ks = shape_of(q), shape_of(k)
        n = len(qs) - 3
        axes = self._axes
        rest = [a for a in range(1, n + 1) if a not in axes]
        for a in (*rest, *axes):
            if qs[a] is None or ks[a] is None:
                raise ValueError(
                    f"{where}: attention over axes {axes} needs static sizes on every axis "
                    f"but the batch; received query {fmt_shape(qs)} and key {fmt_shape(ks)} "
                    "(projected)."
                )
        if any(qs[a] != ks[a] for a in rest):
            raise ValueError(
                f"{where}: `query` and `key` must agree on the axes not attended over "
                f"{tuple(rest)}; received {fmt_shape(qs)} and {fmt_shape(ks)} (projected)."
            )
        scores = self._scores_shape(q, k)
        extra = [None]
        if top_left:
            extra.append(top_left_keep(ops, qs[1], ks[1]))
        if window is not None:
            extra.append(window_keep(ops, qs[1], ks[1], window))
        for m in extra[1:]:
            keep = _and(ops, keep, _keras_rule(ops, where, "use_causal_mask", m, scores, len(axes)))
        perm = [0, *rest, *axes, n + 1, n + 2]
        tq = math.prod(qs[a] for a in axes)
        tk = math.prod(ks[a] for a in axes)

        def flat(x: Any, t: int) -> Any:
            s = shape_of(x)
            return ops.reshape(ops.transpose(x, perm), (-1, t, s[-2], s[-1]))

        qf, kf, vf = flat(q, tq), flat(k, tk), flat(v, tk)
        keep4 = None
        if keep is not None:
            batch = _length(ops, q, 0)
            ks_ = shape_of(keep)
            heads = ks_[len(rest) + 1]
            full = (batch, *(qs[a] for a in rest), heads, *scores[len(rest) + 2 :])
            keep4 = ops.reshape(ops.broadcast_to(keep, full), (-1, heads, tq, tk))
        result = self._attend(ops, qf, kf, vf, keep4, None, False, return_weights, training)
        out, weights = result if return_weights else (result, None)
        lead = (-1, *(qs[a] for a in rest))
        out = ops.reshape(out, (*lead, *(qs[a] for a in axes), *shape_of(out)[-2:]))
        out = ops.transpose(out, list(np.argsort(perm)))
        if weights is not None:
            weights = ops.reshape(weights, (*lead, *scores[len(rest) + 1 :]))
        return out, weights

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
    ):
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
        self._check_flash(return_attention_scores)
        use_causal_mask = _check_keras_flag(where, "use_causal_mask", use_causal_mask)
        training = check_flag(where, "training", training, ops, allow_none=True)
        keep = None
        if attention_mask is not None:
            keep = _keras_rule(
                ops,
                where,
                "attention_mask",
                attention_mask,
                self._scores_shape(query, key),
                len(self._axes),
            )
        return self._attention(
            ops,
            query,
            key,
            value,
            keep,
            None,
            False,
            use_causal_mask,
            None,
            return_attention_scores,
            training,
        )

    def _check_flash(self, return_scores: bool) -> None:
        if self._flash_attention and return_scores:
            raise ValueError(
                f"{self._WHERE}: Returning attention scores is not supported when flash "
                "attention is enabled. Please disable flash attention to access attention "
                "scores."
            )

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
        batch_size = check_positive_int(where, "batch_size", batch_size)
        max_length = check_positive_int(where, "max_length", max_length)
        dtype = self.compute_dtype if dtype is None else _cache_dtype(where, dtype)
        shape = (batch_size, self.kv_heads, max_length)
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
        where = f"{self._WHERE}.project_key_value"
        if not self.built:
            raise ValueError(f"{where}: the layer must be built (called once) first.")
        self._check_rank3(where)
        self._check_key_value_inputs(where, value, key)
        key = value if key is None else key
        ops = get_ops(value)
        k = self._project(ops, key, self._key_dense)
        v = self._project(ops, value, self._value_dense)
        if self.rotary is not None:
            self._check_rotary_length(where, "key", shape_of(key)[1])
            k = self.rotary(k)
        return k, v

    def _check_rank3(self, where: str) -> None:
        if self._rank != 3:
            raise ValueError(
                f"{where}: the cache and projected keys/values need a layer built for "
                f"(batch, sequence, features) inputs; this one was built for rank {self._rank}."
            )

    def _check_input(self, where: str, name: str, x: Any, width: int, rank: int) -> None:
        """``x`` is a floating tensor (or array) of ``rank`` with the width the layer was
        built with; ``None``, strings and lists raise ``TypeError`` naming ``name``."""
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{where}: `{name}` must be a tensor; received {describe(x)}.")
        shape = shape_of(x)
        check_rank(where, name, shape, rank, rank)
        if shape[-1] is not None and shape[-1] != width:
            raise ValueError(
                f"{where}: `{name}` must have width {width} (the width the layer was built "
                f"with); received shape {fmt_shape(shape)}."
            )
        check_float(where, name, x, get_ops(x))

    def _check_key_value_inputs(self, where: str, value: Any, key: Any) -> None:
        """``value`` (and ``key`` when given) are floating tensors of the widths the layer
        was built with; a ``key`` left out is ``value``, and an error about it names
        ``value``."""
        rank = self._rank
        _, e_v, e_k = self._widths
        self._check_input(where, "value", value, e_v, rank)
        if key is None:
            self._check_input(where, "value", value, e_k, rank)
        else:
            self._check_input(where, "key", key, e_k, rank)

    def _check_rotary_length(self, where: str, name: str, length: int | None) -> None:
        """Positions ``0 .. length - 1`` of ``name`` must fit the rotary table."""
        if length is not None and length > self.rotary_max_length:
            raise ValueError(
                f"{where}: `{name}` has {length} positions, more than the rotary embedding "
                f"covers (rotary_max_length={self.rotary_max_length})."
            )

    def _check_kv_pair(
        self, where: str, name: str, pair: Any, batch: Any, heads_first: bool = False
    ) -> tuple[Any, Any]:
        """``(keys, values)`` of ``pair`` checked: ``(B, T, H_kv, D)`` and ``(B, T, H_kv,
        D_v)``, or with ``heads_first`` (a cache) ``(B, H_kv, T, D)`` and ``(B, H_kv, T,
        D_v)``."""
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
        length = ks[2 if heads_first else 1] if len(ks) == 4 else None  # the values': the keys'
        if heads_first:
            want_k = (batch, self.kv_heads, None, self.key_dim)
            want_v = (batch, self.kv_heads, length, self.value_dim)
        else:
            want_k = (batch, None, self.kv_heads, self.key_dim)
            want_v = (batch, length, self.kv_heads, self.value_dim)
        for label, got, want in (("keys", ks, want_k), ("values", vs, want_v)):
            if len(got) != 4 or any(
                w is not None and g is not None and g != w for g, w in zip(got, want)
            ):
                raise ValueError(
                    f"{where}: the {label} of `{name}` must have shape {fmt_shape(want)}; "
                    f"received {fmt_shape(got)}."
                )
        return k, v

    def _attend_cache(
        self, ops, q, k_cache, v_cache, index, tokens, return_weights, training, usable=None,
        bias=None,
    ):  # fmt: skip
        """``(heads, weights or None)`` of the queries at positions ``index .. index +
        tokens - 1`` over the cache, query ``i`` seeing the positions ``j <= index + i``
        (and, with ``sliding_window``, only those less than the window behind it).

        A known ``index`` attends over the filled prefix alone (``index + tokens`` keys),
        so a step costs in proportion to the positions written, not to the cache length;
        its weights are padded with the zeros of the unwritten slots. A traced ``index``
        attends over every slot with a mask. ``usable`` (``(batch, max_length)`` bool or
        None) removes the slots it marks False (padding)."""
        dtype = self.compute_dtype
        max_length = shape_of(k_cache)[2]
        filled = index + tokens if isinstance(index, int) else max_length
        # Heads first, as cached: the explicit attention contracts them in place.
        keys, values = (ops.cast(c[:, :, :filled], dtype) for c in (k_cache, v_cache))
        keep = None
        if not isinstance(index, int) or self.sliding_window is not None or usable is not None:
            # Query i (position index + i) sees the slots j <= index + i (in the window).
            positions = ops.expand_dims(ops.arange(tokens, dtype="int32") + index, 1)
            slots = ops.arange(filled, dtype="int32")[None, :]
            keep = ops.less_equal(slots, positions)
            if self.sliding_window is not None:
                keep = ops.logical_and(keep, ops.less(positions - slots, self.sliding_window))
            keep = ops.expand_dims(ops.expand_dims(keep, 0), 0)  # (1, 1, t, filled)
            if usable is not None:
                keep = ops.logical_and(keep, usable[:, None, None, :filled])
        causal = keep is None  # a known index: bottom-right causal over the prefix
        if bias is not None and shape_of(bias)[-1] != 1:
            bias = bias[..., :filled]  # a bias over the cache slots: those attended
        # A checked cache (`owned_caches(values_checked=True)`) needs no screen for NaN in
        # masked slots, except where slots leave a sliding window (one holding NaN would
        # make its row NaN only while attended).
        checked = cache_values_checked() and self.sliding_window is None
        result = self._attend(
            ops, q, keys, values, keep, None, causal, return_weights, training, bias, True,
            checked,
        )  # fmt: skip
        if not return_weights:
            return result, None
        heads, weights = result
        if filled < max_length:
            pad = ops.broadcast_to(
                ops.zeros_like(weights[..., :1]), (*shape_of(weights)[:-1], max_length - filled)
            )
            weights = ops.concatenate([weights, pad], axis=-1)
        return heads, weights

    def _slot_mask(self, where: str, ops: Any, slots: Any, batch: Any, max_length: int) -> Any:
        """``key_mask`` with a cache: ``(batch, max_length)`` bool (True = the slot may be
        attended) or integer (non-zero = may be attended), as a bool tensor."""
        if slots is None:
            return None
        slots = ops.convert_to_tensor(slots)
        shape = shape_of(slots)
        if (
            len(shape) != 2
            or shape[1] != max_length
            or (batch is not None and shape[0] is not None and shape[0] != batch)
        ):
            raise ValueError(
                f"{where}: with `cache`, `key_mask` must have shape ({batch}, {max_length}) "
                f"(one flag per cache slot); received {fmt_shape(shape)}."
            )
        return slots if "bool" in str(slots.dtype) else ops.not_equal(slots, 0)

    def _cached_call(
        self, ops, query, cache, cache_index, return_weights, training, slots=None, bias=None
    ):
        """Incremental causal self-attention through a fixed-size cache (see ``call``)."""
        where = self._WHERE
        qs = shape_of(query)
        k_cache, v_cache = self._check_kv_pair(where, "cache", cache, qs[0], heads_first=True)
        max_length = shape_of(k_cache)[2]
        if bias is not None:
            shape4 = (qs[0], self.num_heads, qs[1], max_length)
            bias = check_bias(ops, bias, shape4, where, "attention_bias")
        slots = self._slot_mask(where, ops, slots, qs[0], max_length)
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
            # outputs are NaN (see `call`), unless the caller checked it
            # (``owned_caches(index_checked=True)``).
            index = ops.cast(cache_index, "int32")
            if not cache_index_checked():
                in_range = ops.logical_and(
                    ops.greater_equal(index, 0), ops.less_equal(index + tokens, bound)
                )
        gate = self._gate(ops, query)
        q, k, v = self._project_self(ops, query)
        q, k = self._rotate(q, k, cache_index, cache_index)
        k_cache = _write(ops, k_cache, k, index, in_range)
        v_cache = _write(ops, v_cache, v, index, in_range)
        heads, weights = self._attend_cache(
            ops, q, k_cache, v_cache, index, tokens, return_weights, training, slots, bias
        )
        out = self._output(ops, heads, gate)
        if in_range is not None:
            out = ops.where(in_range, out, float("nan"))
            if weights is not None:
                weights = ops.where(in_range, weights, float("nan"))
        new_cache = (k_cache, v_cache)
        return (out, weights, new_cache) if return_weights else (out, new_cache)

    # -- the call ----------------------------------------------------------------------------

    def call(
        self,
        query,
        value=None,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        *,
        mask=None,
        valid_lens=None,
        causal=False,
        return_weights=False,
        cache=None,
        cache_index=None,
        key_value=None,
        attention_bias=None,
    ):
        where = self._WHERE
        if not (hasattr(query, "shape") and hasattr(query, "dtype")):
            raise TypeError(f"{where}: `query` must be a tensor; received {describe(query)}.")
        ops = get_ops(query, value, key, names=("query", "value", "key"), where=where)
        e_q = self._widths[0]
        self._check_input(where, "query", query, e_q, self._rank)
        return_weights = check_flag(where, "return_weights", return_weights, ops)
        return_weights = return_weights or check_flag(
            where, "return_attention_scores", return_attention_scores, ops
        )
        self._check_flash(return_weights)
        training = check_flag(where, "training", training, ops, allow_none=True)
        top_left = _check_keras_flag(where, "use_causal_mask", use_causal_mask)
        # The Keras masks of the inputs are handled here (as Keras' layer does): read, then
        # removed from the inputs so that no sublayer warns about them; the query's mask
        # goes on the output.
        q_mask = _keras_mask_of(query)
        q_mask = query_mask if q_mask is None else q_mask
        v_mask = value_mask if value_mask is not None else _keras_mask_of(value)
        k_mask = key_mask if key_mask is not None else _keras_mask_of(key)
        if self._CLEAR_INPUT_MASKS:
            for t in (query, value, key):
                _clear_keras_mask(t)
        if cache is not None:
            given = [
                n
                for n, a in (
                    ("value", value),
                    ("key", key),
                    ("mask", mask),
                    ("attention_mask", attention_mask),
                    ("valid_lens", valid_lens),
                    ("key_value", key_value),
                    ("value_mask", v_mask),
                )
                if a is not None
            ]
            if causal:
                given.append("causal")
            if top_left:
                given.append("use_causal_mask")
            if given:
                raise ValueError(
                    f"{where}: with `cache` (causal self-attention through the cache), "
                    f"{', '.join(f'`{n}`' for n in given)} must not be given."
                )
            self._check_rank3(where)
            result = self._cached_call(
                ops, query, cache, cache_index, return_weights, training, k_mask, attention_bias
            )
            self._carry_mask(result[0], q_mask)
            return result
        if cache_index is not None:
            raise ValueError(f"{where}: `cache_index` is only meaningful with `cache`.")
        if mask is not None and attention_mask is not None:
            raise ValueError(
                f"{where}: give `mask` (multiattn's name) or `attention_mask` (Keras'), not "
                "both: they are the same argument."
            )
        qs = shape_of(query)
        gate = self._gate(ops, query)
        if key_value is not None:
            if value is not None or key is not None:
                raise ValueError(f"{where}: give either `key_value` or `value`/`key`, not both.")
            self._check_rank3(where)
            k, v = self._check_kv_pair(where, "key_value", key_value, qs[0])
            dtype = self.compute_dtype
            k, v = ops.cast(k, dtype), ops.cast(v, dtype)
            q = self._project(ops, query, self._query_dense)
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
            if ks[1:-1] != vs[1:-1] and all(d is not None for d in (*ks[1:-1], *vs[1:-1])):
                raise ValueError(
                    f"{where}: All dimensions of `value` and `key`, except the last one, must "
                    f"be equal. Received: value_shape={fmt_shape(vs)} and key_shape="
                    f"{fmt_shape(ks)}."
                )
            batches = {s[0] for s in (qs, ks, vs) if s[0] is not None}
            if len(batches) > 1:
                raise ValueError(
                    f"{where}: `query`, `key` and `value` must share the batch size; received "
                    f"{fmt_shape(qs)}, {fmt_shape(ks)} and {fmt_shape(vs)}."
                )
            if query is key and key is value:  # self-attention: one input, three kernels
                q, k, v = self._project_self(ops, query)
            else:
                q = self._project(ops, query, self._query_dense)
                k = self._project(ops, key, self._key_dense)
                v = self._project(ops, value, self._value_dense)
            if self.rotary is not None:
                self._check_rotary_length(where, "query", qs[1])
                self._check_rotary_length(where, "key", ks[1])
            q, k = self._rotate(q, k)
        keep, lens = self._call_masks(
            ops, q, k, q_mask, v_mask, k_mask, attention_mask, mask, valid_lens, causal
        )
        if isinstance(causal, (bool, np.bool_)):
            causal = bool(causal)
        if attention_bias is not None:
            if self._rank != 3 or self._hook_overridden():
                raise ValueError(
                    f"{where}: `attention_bias` needs (batch, sequence, features) inputs and "
                    "multiattn's own attention (no `attention_axes`, no `_compute_attention` "
                    f"override); received `attention_bias` {describe(attention_bias)}."
                )
            shape4 = (qs[0], self.num_heads, qs[1], shape_of(k)[1])
            attention_bias = check_bias(ops, attention_bias, shape4, where, "attention_bias")
        if self._hook_overridden():
            keep = self._fold(ops, q, k, keep, lens, causal, top_left, self.sliding_window)
            heads, weights = self._call_hook(q, k, v, keep, training, return_weights)
        else:
            heads, weights = self._attention(
                ops,
                q,
                k,
                v,
                keep,
                lens,
                causal,
                top_left,
                self.sliding_window,
                return_weights,
                training,
                attention_bias,
            )
        out = self._output(ops, heads, gate)
        self._carry_mask(out, q_mask)
        return (out, weights) if return_weights else out

    @staticmethod
    def _carry_mask(out: Any, q_mask: Any) -> None:
        if q_mask is not None:
            try:
                _set_keras_mask(out, q_mask)
            except (AttributeError, TypeError):
                pass

    def _call_masks(
        self, ops, q, k, q_mask, v_mask, k_mask, attention_mask, mask, valid_lens, causal
    ) -> tuple[Any, Any]:
        """The masks of a call as ``(keep, lens)``: ``keep`` bool aligned with the scores
        (rank 4 for rank-3 inputs) or None, ``lens`` the validated lengths or None.
        Validates ``causal`` (multiattn's) too."""
        where = self._WHERE
        scores = self._scores_shape(q, k)
        n = len(self._axes)
        keep = None
        auto = None
        for name, m, axis in (("query_mask", q_mask, -1), ("value_mask", v_mask, -2),
                              ("key_mask", k_mask, -2)):  # fmt: skip
            if m is None:
                continue
            m = truthy_keep(ops, where, name, as_mask(where, name, m))
            auto = _and(ops, auto, ops.expand_dims(m, axis))
        if auto is not None:
            keep = _keras_rule(ops, where, "the inputs' Keras masks", auto, scores, n)
        if attention_mask is not None:
            keep = _and(
                ops, keep, _keras_rule(ops, where, "attention_mask", attention_mask, scores, n)
            )
        if len(scores) != 4:
            multi = [
                name for name, a in (("mask", mask), ("valid_lens", valid_lens)) if a is not None
            ]
            if causal is not False:
                multi.append("causal")
            if multi:
                raise ValueError(
                    f"{where}: {', '.join(f'`{m}`' for m in multi)} need (batch, sequence, "
                    f"features) inputs; with attention over axes {self._axes} use "
                    "`attention_mask` and `use_causal_mask` (Keras' meaning)."
                )
            return keep, None
        own, lens, _ = self._keep(where, ops, scores, mask, valid_lens, causal)
        return _and(ops, keep, _rank4(ops, own)), lens

    def _fold(self, ops, q, k, keep, lens, causal, top_left, window) -> Any:
        """Every mask of a call as one explicit bool mask aligned with the scores, for a
        subclass's ``_compute_attention`` (which knows only ``attention_mask``)."""
        if len(shape_of(q)) == 4:
            tq, tk = self._lengths(ops, q, k)
            sizes = (tq, tk)
            keep = block_keep(ops, keep, lens_rank4(ops, lens), causal, sizes)
            if top_left:
                keep = _and(ops, keep, _rank4(ops, top_left_keep(ops, tq, tk)))
            if window is not None:
                keep = _and(ops, keep, _rank4(ops, window_keep(ops, tq, tk, window)))
            return keep
        scores = self._scores_shape(q, k)
        qs, ks = shape_of(q), shape_of(k)
        for flag, make in ((top_left, top_left_keep), (window is not None, None)):
            if not flag:
                continue
            m = make(ops, qs[1], ks[1]) if make else window_keep(ops, qs[1], ks[1], window)
            keep = _and(
                ops, keep, _keras_rule(ops, self._WHERE, "mask", m, scores, len(self._axes))
            )
        return keep

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
        self,
        query,
        value=None,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        *,
        mask=None,
        valid_lens=None,
        causal=False,
        return_weights=False,
        cache=None,
        cache_index=None,
        key_value=None,
        attention_bias=None,
    ):
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
            rank = len(qs)
            axes = self._normalise_axes(rank)
            rest = [a for a in range(1, rank - 1) if a not in axes]
            scores = (
                qs[0],
                *(qs[a] for a in rest),
                self.num_heads,
                *(qs[a] for a in axes),
                *(key_shape[a] for a in axes),
            )
            result.append(keras.KerasTensor(scores, dtype=self.compute_dtype))
        if cache is not None:
            result.append(tuple(keras.KerasTensor(tuple(c.shape), dtype=c.dtype) for c in cache))
        return result[0] if len(result) == 1 else tuple(result)

    def compute_mask(self, inputs, mask=None):
        return _keras_mask_of(inputs)  # the query's sequence mask, if any

    def load_own_variables(self, store):
        """Keras' loading of this layer's own variables. The layer has none (the weights
        live in the sublayers), but files written by multiattn before the projections
        moved into sublayers hold them as the layer's own ``vars/0 ..`` (the four
        kernels, then the four biases): such files load too, into the sublayers."""
        if self._trainable_variables or self._non_trainable_variables or not len(store.keys()):
            return super().load_own_variables(store)
        dense = (self._query_dense, self._key_dense, self._value_dense, self._output_dense)
        targets = [d.kernel for d in dense] + [d.bias for d in dense if d.bias is not None]
        if len(store.keys()) != len(targets):
            raise ValueError(
                f"{self._WHERE} {self.name!r}: the weights file holds {len(store.keys())} "
                f"variables of the layer itself; a file of the layout before the "
                f"projections moved into sublayers would hold {len(targets)} here."
            )
        for i, variable in enumerate(targets):
            variable.assign(store[str(i)])
        for layer in dense:  # their own entries are absent from such a file: skip once
            layer.load_own_variables = _skip_one_load(layer)

    def get_config(self) -> dict:
        serialize = keras.saving.serialize_keras_object
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
        }


MultiHeadAttention._compute_attention._multiattn_own = True

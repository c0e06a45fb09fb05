"""TensorFlow adapter for the tf.keras Transformer code of document 004.

Code written against that document (``scaled_dot_product_attention(q, k, v, mask)``,
``MultiHeadAttention(d_model, num_heads)`` with ``call(v, k, q, mask)``,
``point_wise_feed_forward_network`` and ``EncoderLayer``) runs unchanged on these
definitions, as Keras 3 layers on Keras' tensorflow backend, while the scores, the
softmax, the weighted sum and the head split/merge come from `multiattn.ops`.

The document's mask convention is the opposite of multiattn's: a mask value of **1 means
masked out** and 0 means attend; the document adds ``mask * -1e9`` to the scaled logits.
The adapter turns it into the core's boolean mask ``keep = (mask == 0)``. For rows that
keep at least one key both give the same weights (the masked terms are exactly 0). A row
whose mask is all ones has every logit shifted by ``-1e9``; in float32 these round to the
same value (for logits below 32 in magnitude) and the document returns a *uniform* row,
where the core returns zeros. The adapter reproduces the uniform row by giving the core a
constant row with every key allowed. Masks must hold only 0 and 1 (a ``ValueError``
names ``mask`` otherwise; the document would scale ``-1e9`` by fractional values); boolean
masks are refused because their polarity is ambiguous (Keras' own masks use True = keep).

Importing this module selects Keras' tensorflow backend when Keras is not imported yet;
if Keras already runs (or ``KERAS_BACKEND`` names) another backend it raises ImportError.
"""

from __future__ import annotations

from ._select import require_keras_backend

require_keras_backend("tensorflow")

from typing import Any  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from multiattn import ops as _ops  # noqa: E402
from multiattn._autograph import mark_public  # noqa: E402
from multiattn._checks import (  # noqa: E402
    broadcast_shape,
    check_positive_int,
    check_rank,
    check_rate,
    fmt_shape,
    shape_of,
)

__all__ = [
    "MASK_FILL",
    "EncoderLayer",
    "MultiHeadAttention",
    "point_wise_feed_forward_network",
    "scaled_dot_product_attention",
]

MASK_FILL = -1e9
"""The document's additive mask value: logits ``+= mask * MASK_FILL``."""

_NUMERIC_PREFIXES = ("float", "bfloat", "int", "uint")


def _document_keep(where: str, mask: Any, scores_shape: tuple) -> tf.Tensor:
    """The core's keep mask (True = may attend) from a document mask (1 = masked out).

    Args:
        mask: float or integer 0/1 tensor broadcastable to ``scores_shape``.
        scores_shape: ``(..., queries, keys)``, static shape of the logits.

    Returns:
        Bool ``mask == 0`` with the mask's shape.
    """
    mask_t = tf.convert_to_tensor(mask)
    dtype = keras.backend.standardize_dtype(mask_t.dtype)
    if not dtype.startswith(_NUMERIC_PREFIXES):
        raise TypeError(
            f"{where}: `mask` must be a float (or integer) tensor of 0 (attend) and 1 (masked "
            f"out), as in the document; received dtype {dtype}. A boolean mask is refused "
            "because its polarity is ambiguous: for a Keras-style mask `m` (True = attend) "
            "pass `tf.cast(tf.logical_not(m), tf.float32)`."
        )
    broadcast_shape(where, "mask", shape_of(mask_t), scores_shape)
    is_binary = tf.logical_or(tf.equal(mask_t, 0), tf.equal(mask_t, 1))
    message = (
        f"{where}: `mask` must hold only 0 (attend) and 1 (masked out); fractional or other "
        "values are not supported (the document would scale -1e9 by them)."
    )
    if tf.executing_eagerly():
        values = np.asarray(mask_t)
        bad = values[~np.asarray(is_binary)]
        if bad.size:
            raise ValueError(f"{message} Received {bad.ravel()[0].item()!r}.")
        return tf.equal(mask_t, 0)
    check = tf.debugging.Assert(tf.reduce_all(is_binary), [message])
    with tf.control_dependencies([check]):
        return tf.equal(mask_t, 0)


def scaled_dot_product_attention(q: Any, k: Any, v: Any, mask: Any) -> tuple[Any, Any]:
    """``softmax(q k^T / sqrt(d_k) + mask * -1e9) v``, the document's attention.

    Args:
        q: ``(..., seq_q, depth)``, e.g. ``(batch, heads, seq_q, depth)``.
        k: ``(..., seq_k, depth)``, same leading axes and dtype as ``q``.
        v: ``(..., seq_k, depth_v)``.
        mask: None, or 0/1 (1 = masked out) float or integer tensor broadcastable to the
            logits ``(..., seq_q, seq_k)``, e.g. a padding mask ``(batch, 1, 1, seq_k)`` or
            a look-ahead mask ``(seq_q, seq_k)``.

    Returns:
        ``(output, attention_weights)``: ``(..., seq_q, depth_v)`` and
        ``(..., seq_q, seq_k)``. Masked keys get weight 0; a query whose keys are all
        masked gets uniform weights ``1 / seq_k`` (the document's float32 result).

    Raises:
        ValueError: shapes that do not line up, a mask that does not broadcast or holds
            values other than 0 and 1.
        TypeError: non-floating ``q``, ``k``, ``v``; boolean or non-numeric ``mask``.
    """
    return _attention("scaled_dot_product_attention", q, k, v, mask)


def _check_qkv(where: str, q: Any, k: Any, v: Any) -> None:
    """Same rank >= 2 and leading axes, ``q``/``k`` widths equal, ``k``/``v`` lengths equal."""
    qs, ks, vs = (shape_of(t if hasattr(t, "shape") else np.asarray(t)) for t in (q, k, v))
    for name, shape in (("q", qs), ("k", ks), ("v", vs)):
        check_rank(where, name, shape, 2)
    problem = None
    if not len(qs) == len(ks) == len(vs):
        problem = "`q`, `k` and `v` must have the same rank"
    elif any(
        len({d for d in dims if d is not None}) > 1 for dims in zip(qs[:-2], ks[:-2], vs[:-2])
    ):
        problem = "`q`, `k` and `v` must have the same leading (batch, heads) axes"
    elif None not in (qs[-1], ks[-1]) and qs[-1] != ks[-1]:
        problem = "`q` and `k` must have the same depth (last axis)"
    elif None not in (ks[-2], vs[-2]) and ks[-2] != vs[-2]:
        problem = "`k` and `v` must have the same length (axis -2)"
    if problem:
        raise ValueError(
            f"{where}: {problem}; received q {fmt_shape(qs)}, k {fmt_shape(ks)} and "
            f"v {fmt_shape(vs)}."
        )


def _attention(where: str, q: Any, k: Any, v: Any, mask: Any) -> tuple[Any, Any]:
    """`scaled_dot_product_attention` with error messages prefixed by ``where``."""
    _check_qkv(where, q, k, v)
    scores = _ops.scaled_dot_scores(q, k)
    if mask is None:
        return _ops.score_attention(scores, v, return_weights=True)
    keep = _document_keep(where, mask, shape_of(scores))
    row_any = tf.reduce_any(keep, axis=-1, keepdims=True)
    # All-masked rows: a constant row attending every key is the document's uniform row.
    scores = tf.where(row_any, scores, tf.constant(MASK_FILL, dtype=scores.dtype))
    keep = tf.logical_or(keep, tf.logical_not(row_any))
    return _ops.score_attention(scores, v, mask=keep, return_weights=True)


def _check_sizes(where: str, d_model: Any, num_heads: Any) -> tuple[int, int]:
    d_model = check_positive_int(where, "d_model", d_model)
    num_heads = check_positive_int(where, "num_heads", num_heads)
    if d_model % num_heads:
        raise ValueError(
            f"{where}: `d_model` ({d_model}) must be divisible by `num_heads` ({num_heads})."
        )
    return d_model, num_heads


@keras.saving.register_keras_serializable(package="multiattn.tensorflow")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention of document 004: ``call(v, k, q, mask)``.

    Sublayers: ``wq``, ``wk``, ``wv`` (``Dense(d_model)`` with bias, applied to ``q``,
    ``k``, ``v``) and ``dense`` (``Dense(d_model)``, the output projection). Heads are
    contiguous: head ``h`` owns features ``h*depth ... (h+1)*depth - 1`` with
    ``depth = d_model // num_heads``.

    Args:
        d_model: model width; must be divisible by ``num_heads``.
        num_heads: number of heads.
        **kwargs: Keras layer arguments (``name``, ``dtype``).
    """

    def __init__(self, d_model: int, num_heads: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.d_model, self.num_heads = _check_sizes("MultiHeadAttention", d_model, num_heads)
        self.depth = self.d_model // self.num_heads
        policy = self.dtype_policy
        self.wq = keras.layers.Dense(self.d_model, name="wq", dtype=policy)
        self.wk = keras.layers.Dense(self.d_model, name="wk", dtype=policy)
        self.wv = keras.layers.Dense(self.d_model, name="wv", dtype=policy)
        self.dense = keras.layers.Dense(self.d_model, name="dense", dtype=policy)
        # `mask` is the document's attention mask, not a Keras sequence mask: accept it
        # without warnings and propagate nothing (see `compute_mask`).
        self.supports_masking = True

    def build(self, v_shape: tuple, k_shape: tuple, q_shape: tuple) -> None:
        where = "MultiHeadAttention"
        for name, shape in (("v", v_shape), ("k", k_shape), ("q", q_shape)):
            check_rank(where, name, tuple(shape), 3, 3)
            if shape[-1] is None:
                raise ValueError(
                    f"{where}: the last dimension of `{name}` must be static; received "
                    f"{fmt_shape(tuple(shape))}."
                )
        self.wq.build(tuple(q_shape))
        self.wk.build(tuple(k_shape))
        self.wv.build(tuple(v_shape))
        self.dense.build((*tuple(q_shape)[:-1], self.d_model))

    def split_heads(self, x: Any, batch_size: Any = None) -> Any:
        """``(batch, seq, d_model)`` -> ``(batch, num_heads, seq, depth)``, contiguous heads.

        ``batch_size`` is accepted for the document's signature; the batch is read from
        ``x``.
        """
        return _ops.split_heads(x, self.num_heads)

    def _check_call(self, v: Any, k: Any, q: Any) -> None:
        where = "MultiHeadAttention"
        shapes = {}
        for name, x, layer in (("v", v, self.wv), ("k", k, self.wk), ("q", q, self.wq)):
            shape = shape_of(x)
            check_rank(where, name, shape, 3, 3)
            want = layer.kernel.shape[0]
            if shape[-1] is not None and shape[-1] != want:
                raise ValueError(
                    f"{where}: `{name}` must have width {want} (the width the layer was "
                    f"built with); received shape {fmt_shape(shape)}."
                )
            shapes[name] = shape
        vs, ks, qs = shapes["v"], shapes["k"], shapes["q"]
        if vs[1] is not None and ks[1] is not None and vs[1] != ks[1]:
            raise ValueError(
                f"{where}: `k` and `v` must have the same length; received k {fmt_shape(ks)} "
                f"and v {fmt_shape(vs)}."
            )
        if len({s[0] for s in (vs, ks, qs) if s[0] is not None}) > 1:
            raise ValueError(
                f"{where}: `v`, `k` and `q` must share the batch size; received "
                f"{fmt_shape(vs)}, {fmt_shape(ks)} and {fmt_shape(qs)}."
            )

    def call(self, v: Any, k: Any, q: Any, mask: Any = None) -> tuple[Any, Any]:
        """Attend from ``q`` over ``k``/``v`` (note the document's argument order).

        Args:
            v: ``(batch, seq_k, d_v_in)``.
            k: ``(batch, seq_k, d_k_in)``.
            q: ``(batch, seq_q, d_q_in)``.
            mask: None or 0/1 float mask (1 = masked out) broadcastable to
                ``(batch, num_heads, seq_q, seq_k)``.

        Returns:
            ``(output, attention_weights)``: ``(batch, seq_q, d_model)`` and
            ``(batch, num_heads, seq_q, seq_k)``.
        """
        self._check_call(v, k, q)
        heads = [
            self.split_heads(dense(x)) for dense, x in ((self.wq, q), (self.wk, k), (self.wv, v))
        ]
        attention, weights = _attention("MultiHeadAttention", *heads, mask)
        return self.dense(_ops.merge_heads(attention)), weights

    def compute_mask(self, inputs: Any, mask: Any = None) -> None:
        """No Keras mask leaves the layer: ``mask`` is an attention mask (1 = masked out)."""
        return None

    def get_config(self) -> dict:
        return {**super().get_config(), "d_model": self.d_model, "num_heads": self.num_heads}


def point_wise_feed_forward_network(
    d_model: int, dff: int, *, dtype: Any = None, name: str | None = None
) -> keras.Sequential:
    """``Sequential([Dense(dff, relu), Dense(d_model)])``: ``(..., d) -> (..., d_model)``.

    ``dtype`` (a Keras dtype policy) and ``name`` are optional extras for the document's
    two-argument signature.
    """
    where = "point_wise_feed_forward_network"
    d_model = check_positive_int(where, "d_model", d_model)
    dff = check_positive_int(where, "dff", dff)
    return keras.Sequential(
        [
            keras.layers.Dense(dff, activation="relu", dtype=dtype),
            keras.layers.Dense(d_model, dtype=dtype),
        ],
        name=name,
    )


@keras.saving.register_keras_serializable(package="multiattn.tensorflow")
class EncoderLayer(keras.layers.Layer):
    """Post-LayerNorm Transformer encoder layer of document 004.

    ``out1 = layernorm1(x + dropout1(mha(x, x, x, mask)[0]))``,
    ``out2 = layernorm2(out1 + dropout2(ffn(out1)))``.

    Sublayers: ``mha`` (`MultiHeadAttention`), ``ffn``
    (`point_wise_feed_forward_network`), ``layernorm1``, ``layernorm2``
    (``LayerNormalization(epsilon=1e-6)``), ``dropout1``, ``dropout2`` (``Dropout(rate)``).

    Args:
        d_model: model width, divisible by ``num_heads``.
        num_heads: attention heads.
        dff: hidden width of the feed-forward network.
        rate: dropout rate, active when ``training`` is True.
        **kwargs: Keras layer arguments (``name``, ``dtype``).
    """

    def __init__(self, d_model: int, num_heads: int, dff: int, rate: float = 0.1, **kwargs: Any):
        super().__init__(**kwargs)
        where = "EncoderLayer"
        self.d_model, self.num_heads = _check_sizes(where, d_model, num_heads)
        self.dff = check_positive_int(where, "dff", dff)
        self.rate = check_rate(where, "rate", rate)
        policy = self.dtype_policy
        self.mha = MultiHeadAttention(self.d_model, self.num_heads, name="mha", dtype=policy)
        self.ffn = point_wise_feed_forward_network(self.d_model, self.dff, dtype=policy, name="ffn")
        self.layernorm1 = keras.layers.LayerNormalization(
            epsilon=1e-6, name="layernorm1", dtype=policy
        )
        self.layernorm2 = keras.layers.LayerNormalization(
            epsilon=1e-6, name="layernorm2", dtype=policy
        )
        self.dropout1 = keras.layers.Dropout(self.rate, name="dropout1", dtype=policy)
        self.dropout2 = keras.layers.Dropout(self.rate, name="dropout2", dtype=policy)
        self.supports_masking = True  # see MultiHeadAttention

    def build(self, x_shape: tuple) -> None:
        shape = tuple(x_shape)
        check_rank("EncoderLayer", "x", shape, 3, 3)
        if shape[-1] != self.d_model:
            raise ValueError(
                f"EncoderLayer: `x` must have width d_model={self.d_model}; received shape "
                f"{fmt_shape(shape)}."
            )
        self.mha.build(shape, shape, shape)
        self.ffn.build(shape)
        self.layernorm1.build(shape)
        self.layernorm2.build(shape)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Accept the document's positional ``layer(x, training, mask)``.

        Keras 3 takes only tensors positionally, so ``training`` and ``mask`` are passed on
        as keywords; a ``training`` of None is left out so Keras can inherit it from an
        outer call (``model.fit``).
        """
        if len(args) > 2:
            raise TypeError(
                f"EncoderLayer: expected (x, training, mask); received {1 + len(args)} "
                "positional arguments."
            )
        for name, value in zip(("training", "mask"), args):
            if name in kwargs:
                raise TypeError(f"EncoderLayer: got multiple values for `{name}`.")
            kwargs[name] = value
        if kwargs.get("training", 0) is None:
            del kwargs["training"]
        return super().__call__(x, **kwargs)

    def call(self, x: Any, training: Any = None, mask: Any = None) -> Any:
        """``(batch, seq, d_model)`` -> ``(batch, seq, d_model)``.

        Args:
            x: ``(batch, seq, d_model)``.
            training: enables the two dropout layers.
            mask: None or 0/1 float mask (1 = masked out) broadcastable to
                ``(batch, num_heads, seq, seq)``, e.g. ``(batch, 1, 1, seq)`` padding.
        """
        attn_output, _ = self.mha(x, x, x, mask)
        out1 = self.layernorm1(x + self.dropout1(attn_output, training=training))
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)

    def compute_output_shape(self, x_shape: tuple) -> tuple:
        return tuple(x_shape)

    def compute_mask(self, inputs: Any, mask: Any = None) -> None:
        """No Keras mask leaves the layer (see `MultiHeadAttention.compute_mask`)."""
        return None

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "dff": self.dff,
            "rate": self.rate,
        }


# tf.function need not convert the adapter's source (multiattn._autograph)
mark_public(globals(), __all__)

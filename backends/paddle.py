"""PaddlePaddle adapter: the layers of the PaddlePaddle source document (document 000).

Importing this module

1. checks the import order and imports paddle first (importing paddle after TensorFlow
   in one process segfaults; ImportError explains the fix when TensorFlow came first);
2. picks Keras' numpy backend when Keras is not imported yet and ``KERAS_BACKEND`` is
   unset (the Paddle path needs no other framework);
3. registers `multiattn.namespaces.paddle.PaddleNamespace` for ``paddle.Tensor``, so
   every `multiattn.ops` function runs on Paddle tensors with Paddle autograd.

The layers reproduce the document's behaviour and are thin: they convert arguments, run
the document's ``paddle.nn.Linear`` projections and call the core for heads, scores,
masking and attention.

* `DotProductAttention(query_size, query_vec_size, hidden_vec_size)`
* `MultiHeadAttention(query_size, query_vec_size, hidden_vec_size, output_vec_size,
  head_num)`

Both take ``forward(queries, keys, values, valid_lens)``. The document's quirks are kept:
``query_size`` fixes the length of queries *and* keys/values; masked scores are replaced
by -1e6 (so a zero valid length gives uniform weights over all keys, where the core's
own masking gives a zero row); heads are split interleaved and merged contiguously; the
scale is ``1/sqrt(hidden_vec_size)``; no attention weights are kept.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

# First of all: importing the Paddle namespace checks the import order (ImportError when TensorFlow
# came first) and then imports paddle, before anything below could load TensorFlow.
from ..namespaces.paddle import PaddleNamespace, check_import_order, cpu_threads

check_import_order()  # a no-op once the import above succeeded; states the invariant

import numpy as np  # noqa: E402
import paddle  # noqa: E402

if "keras" not in sys.modules and "KERAS_BACKEND" not in os.environ:
    os.environ["KERAS_BACKEND"] = "numpy"

from .. import config  # noqa: E402
from .. import ops as core  # noqa: E402
from ..namespaces.keras import framework_of, get_ops, register_namespace  # noqa: E402

__all__ = ["FILL_VALUE", "DotProductAttention", "MultiHeadAttention", "PaddleNamespace"]

register_namespace(
    "paddle", is_tensor=lambda t: isinstance(t, paddle.Tensor), factory=PaddleNamespace
)
_NS = get_ops(paddle.zeros([0]))  # the registered PaddleNamespace

#: The score the document writes into masked positions before its softmax.
FILL_VALUE = -1e6

_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _positive_int(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: `{name}` must be a positive integer; received {value!r}.")
    if value < 1:
        raise ValueError(f"{where}: `{name}` must be a positive integer; received {value!r}.")
    return int(value)


def _fmt(shape: Any) -> str:
    dims = tuple(int(d) for d in shape)
    return "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"


def _check_not_foreign(where: str, name: str, x: Any) -> None:
    """Refuse a tensor of another framework (a Keras, torch or jax tensor): the layers take
    Paddle tensors, NumPy arrays or Python values."""
    framework = framework_of(x)
    if framework not in (None, "paddle"):
        raise TypeError(
            f"{where}: `{name}` must be a paddle.Tensor, a NumPy array or Python values; "
            f"received a {type(x).__module__}.{type(x).__qualname__} ({framework})."
        )


def _as_input(where: str, name: str, x: Any, dtype: str, length: int, width: int) -> Any:
    """``x`` checked to be ``(batch, length, width)`` floating of the parameters' dtype."""
    _check_not_foreign(where, name, x)
    if not isinstance(x, paddle.Tensor):
        arr = np.asarray(x)
        if arr.dtype.kind not in "fiub":
            raise TypeError(f"{where}: `{name}` must be a paddle.Tensor; received {type(x)!r}.")
        x = paddle.to_tensor(arr)
    got = _NS.dtype_name(x)
    if got != dtype:
        raise TypeError(
            f"{where}: `{name}` must have the dtype of the layer's parameters ({dtype}); "
            f"received {got}. Cast the input, or the layer with layer.to(dtype=...)."
        )
    if x.ndim != 3 or int(x.shape[1]) != length or int(x.shape[2]) != width:
        raise ValueError(
            f"{where}: `{name}` must have shape (batch, query_size, query_vec_size) = "
            f"(batch, {length}, {width}); received {_fmt(x.shape)}. The document's layers "
            "fix the sequence length of queries, keys and values to `query_size`."
        )
    return x


def _document_lens(where: str, valid_lens: Any, batch: int, num_keys: int) -> Any:
    """The document's ``valid_lens`` (float or int, ``(batch,)``) as int64 lengths clipped
    to ``num_keys``, or None."""
    if valid_lens is None:
        return None
    _check_not_foreign(where, "valid_lens", valid_lens)
    if not isinstance(valid_lens, paddle.Tensor):
        arr = np.asarray(valid_lens)
        if arr.dtype.kind not in "fiu":
            raise TypeError(
                f"{where}: `valid_lens` must hold numbers (int or float lengths); received "
                f"{arr.dtype}."
            )
        valid_lens = paddle.to_tensor(arr)
    dtype = _NS.dtype_name(valid_lens)
    if dtype not in _INT_DTYPES + _FLOAT_DTYPES:
        raise TypeError(
            f"{where}: `valid_lens` must hold int or float lengths; received dtype {dtype}."
        )
    if tuple(valid_lens.shape) != (batch,):
        raise ValueError(
            f"{where}: `valid_lens` must have shape (batch,) = ({batch},): one length per batch "
            f"row, shared by every query (and head); received shape {_fmt(valid_lens.shape)}."
        )
    if not _NS.is_symbolic(valid_lens):
        values = _NS.convert_to_numpy(valid_lens).astype(np.float64)
        bad = values[~np.isfinite(values) | (values < 0) | (values != np.floor(values))]
        if bad.size:
            raise ValueError(
                f"{where}: `valid_lens` must hold non-negative whole numbers; received {bad[0]!r}."
            )
    # The document keeps key j iff j < valid_len: a length above the key count keeps all.
    # (float64 holds every length up to 2**53 exactly; larger ones are clipped anyway.)
    return paddle.clip(valid_lens.astype("float64"), 0, num_keys).astype("int64")


def _document_attention(queries: Any, keys: Any, values: Any, lens: Any, scale: float) -> Any:
    """The document's masked attention, computed by the core.

    ``queries``/``keys``/``values``: ``(batch, [heads,] seq, depth)``; ``lens``: int
    ``(batch,)`` or None. Masked scores are *replaced* by `FILL_VALUE` (the document's
    fill) and the core's unmasked `score_attention` normalises them: exactly the
    document's formula, so a row with length 0 (all scores -1e6) gets uniform weights
    ``1/keys``, and in every other row a masked key gets weight ``exp(-1e6 - max)``, which
    is 0 in float32 and float64 unless real scores come near -1e6.
    """
    scores = core.scaled_dot_scores(queries, keys, scale=scale)  # (batch, [heads,] q, k)
    if lens is not None:
        keep = core.valid_lens_to_mask(lens, tuple(int(d) for d in scores.shape))
        scores = _NS.where(keep, scores, FILL_VALUE)
    return core.score_attention(scores, values)


#: Calls of fewer floating-point operations than this run in one piece, untimed: below
#: it a thread's start-up is a large part of a slice (the threshold is a few
#: milliseconds of Paddle's one-thread matrix products; measured: docs/benchmarks.md,
#: 'Measurements behind the defaults').
SLICE_MIN_FLOPS = 1 << 27


def _in_slices(compute: Any, args: tuple, chunks: int) -> Any:
    """``compute(*args)`` in one piece, or over ``chunks`` slices of the batch side by
    side (`PaddleNamespace.map_batch`)."""
    return compute(*args) if chunks == 1 else _NS.map_batch(compute, args, chunks)


class _DocumentAttention(paddle.nn.Layer):
    """Shared checks of the two document layers, and their slices of the batch."""

    query_size: int
    query_vec_size: int

    def _over_batch(self, compute: Any, args: tuple, flops: int) -> Any:
        """``compute(*args)`` (every argument's leading axis the batch), in the slices of
        the batch `_batch_slices` gives (`PaddleNamespace.map_batch`: side by side on the
        CPU's cores) or in one piece."""
        return _in_slices(compute, args, self._batch_slices(compute, args, flops))

    def _batch_slices(self, compute: Any, args: tuple, flops: int) -> int:
        """How many slices of the batch the layer runs in: one piece, unless the tuner in
        force (`multiattn.config.tuner`) says otherwise.

        Why it depends on the machine: Paddle's CPU kernels, its matrix products
        included, run on one thread, so a layer in one piece uses one core; slices run
        side by side use the others, for the cost of starting them (and smaller score
        matrices, which stay in cache). ``settings(autotune=Fixed(attention_chunks=n))``
        gives at most ``n`` slices. Under ``autotune=True``, 1, 2, 4, 8 and 16 slices
        (those dividing the batch) are timed forward on the call's own inputs, once per
        process and class (the layer type, dtype, device, batch, ``query_size`` rounded
        up to a power of two, the widths, the heads, the threads of the pool); one piece
        keeps the class unless another count is more than `multiattn.tuning.MARGIN`
        faster, and counts that tie go to the fewest. Not timed (one piece): calls under
        `SLICE_MIN_FLOPS`."""
        batch = int(args[0].shape[0])
        counts = [c for c in (1, 2, 4, 8, 16) if c <= batch and batch % c == 0]
        tuner = config.tuner()
        if tuner is None or len(counts) == 1:
            return 1
        from ..tuning import bucket  # a tuner is in force: its package is loaded

        measurable, why = flops >= SLICE_MIN_FLOPS, "a call under SLICE_MIN_FLOPS"
        cls = {
            "backend": "paddle",
            "layer": type(self).__name__,
            "device": str(args[0].place),
            "dtype": _NS.dtype_name(args[0]),
            "batch": batch,
            "queries": bucket(int(self.query_size)),
            **{k: v for k, v in vars(self).items() if k.endswith(("_vec_size", "_num"))},
            "threads": cpu_threads(),
        }

        def candidates() -> tuple[dict[str, Any], str]:
            def timed(c: int) -> Any:
                def call() -> Any:
                    with paddle.no_grad():
                        return _in_slices(compute, args, c)

                return call

            return {str(c): timed(c) for c in counts}, f"the call's inputs {_fmt(args[0].shape)}"

        return tuner.batch_slices(cls, candidates, counts, measurable, why)

    def _inputs(self, where: str, queries: Any, keys: Any, values: Any) -> tuple[Any, ...]:
        dtype = _NS.dtype_name(self.W_q.weight)
        q, k, v = (
            _as_input(where, name, x, dtype, self.query_size, self.query_vec_size)
            for name, x in (("queries", queries), ("keys", keys), ("values", values))
        )
        batch = int(q.shape[0])
        if int(k.shape[0]) != batch or int(v.shape[0]) != batch:
            raise ValueError(
                f"{where}: `queries`, `keys` and `values` must share the batch size; received "
                f"{_fmt(q.shape)}, {_fmt(k.shape)} and {_fmt(v.shape)}."
            )
        return q, k, v, batch


class DotProductAttention(_DocumentAttention):
    """Single-head scaled dot-product self-attention of the PaddlePaddle document.

    Args:
        query_size: the sequence length (number of words). Fixed: queries, keys and values
            must all have exactly this many positions.
        query_vec_size: width of the input word vectors.
        hidden_vec_size: width of the projections and of the output.
        **kwargs: passed to ``paddle.nn.Layer``.

    Parameters: ``W_q``, ``W_k``, ``W_v``: ``paddle.nn.Linear(query_vec_size,
    hidden_vec_size)`` with bias (weight ``(query_vec_size, hidden_vec_size)``).
    """

    def __init__(
        self, query_size: int, query_vec_size: int, hidden_vec_size: int, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        where = "DotProductAttention"
        self.query_size = _positive_int(where, "query_size", query_size)
        self.query_vec_size = _positive_int(where, "query_vec_size", query_vec_size)
        self.hidden_vec_size = _positive_int(where, "hidden_vec_size", hidden_vec_size)
        self.W_q = paddle.nn.Linear(self.query_vec_size, self.hidden_vec_size)
        self.W_k = paddle.nn.Linear(self.query_vec_size, self.hidden_vec_size)
        self.W_v = paddle.nn.Linear(self.query_vec_size, self.hidden_vec_size)

    def forward(self, queries: Any, keys: Any, values: Any, valid_lens: Any = None) -> Any:
        """Attend ``queries`` to ``keys``/``values``.

        Args:
            queries, keys, values: ``(batch, query_size, query_vec_size)``, the dtype of
                the parameters (float32 unless the layer was cast).
            valid_lens: ``(batch,)`` int or float whole numbers (the document passes
                float32), or None for no masking. Keys at positions ``>= valid_lens[b]``
                get the score -1e6; a length of 0 gives uniform weights over all keys
                (the output row is the mean of the projected values); lengths above
                ``query_size`` keep every key.

        Returns:
            ``(batch, query_size, hidden_vec_size)``.
        """
        where = "DotProductAttention"
        q, k, v, batch = self._inputs(where, queries, keys, values)
        lens = _document_lens(where, valid_lens, batch, self.query_size)
        t, e, d = self.query_size, self.query_vec_size, self.hidden_vec_size
        flops = 2 * batch * t * d * (3 * e + 2 * t)
        return self._over_batch(self._attend, (q, k, v, lens), flops)

    def _attend(self, q: Any, k: Any, v: Any, lens: Any) -> Any:
        """The document's computation on checked inputs (any slice of the batch)."""
        scale = 1.0 / math.sqrt(self.hidden_vec_size)
        return _document_attention(self.W_q(q), self.W_k(k), self.W_v(v), lens, scale)

    def extra_repr(self) -> str:
        return (
            f"query_size={self.query_size}, query_vec_size={self.query_vec_size}, "
            f"hidden_vec_size={self.hidden_vec_size}"
        )


class MultiHeadAttention(_DocumentAttention):
    """Multi-head attention of the PaddlePaddle document.

    Args:
        query_size: the sequence length; fixed for queries, keys and values.
        query_vec_size: width of the input word vectors.
        hidden_vec_size: width of each head (the scale is ``1/sqrt(hidden_vec_size)``).
        output_vec_size: width of the output.
        head_num: number of heads.
        **kwargs: passed to ``paddle.nn.Layer``.

    Parameters (all ``paddle.nn.Linear`` with bias; Paddle weights are ``(in, out)``):
    ``W_q``, ``W_k``, ``W_v``: ``query_vec_size -> hidden_vec_size * head_num``;
    ``W_o``: ``hidden_vec_size * head_num -> output_vec_size``.

    Heads: projection feature ``f`` belongs to head ``f % head_num`` (interleaved split:
    head ``h`` owns features ``h, h + head_num, ...``), while the merged heads are laid
    out contiguously (head ``h`` fills features ``h*hidden_vec_size ...`` of ``W_o``'s
    input), as in the document.
    """

    def __init__(
        self,
        query_size: int,
        query_vec_size: int,
        hidden_vec_size: int,
        output_vec_size: int,
        head_num: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        where = "MultiHeadAttention"
        self.query_size = _positive_int(where, "query_size", query_size)
        self.query_vec_size = _positive_int(where, "query_vec_size", query_vec_size)
        self.hidden_vec_size = _positive_int(where, "hidden_vec_size", hidden_vec_size)
        self.output_vec_size = _positive_int(where, "output_vec_size", output_vec_size)
        self.head_num = _positive_int(where, "head_num", head_num)
        width = self.hidden_vec_size * self.head_num
        self.W_q = paddle.nn.Linear(self.query_vec_size, width)
        self.W_k = paddle.nn.Linear(self.query_vec_size, width)
        self.W_v = paddle.nn.Linear(self.query_vec_size, width)
        self.W_o = paddle.nn.Linear(width, self.output_vec_size)

    def forward(self, queries: Any, keys: Any, values: Any, valid_lens: Any = None) -> Any:
        """Multi-head attention of ``queries`` over ``keys``/``values``.

        Args:
            queries, keys, values: ``(batch, query_size, query_vec_size)``.
            valid_lens: ``(batch,)`` int or float lengths, shared by every head and query
                (see `DotProductAttention.forward`), or None.

        Returns:
            ``(batch, query_size, output_vec_size)``.
        """
        where = "MultiHeadAttention"
        q, k, v, batch = self._inputs(where, queries, keys, values)
        lens = _document_lens(where, valid_lens, batch, self.query_size)
        t, e, w = self.query_size, self.query_vec_size, self.hidden_vec_size * self.head_num
        flops = 2 * batch * t * (3 * e * w + 2 * t * w + w * self.output_vec_size)
        return self._over_batch(self._attend, (q, k, v, lens), flops)

    def _attend(self, q: Any, k: Any, v: Any, lens: Any) -> Any:
        """The document's computation on checked inputs (any slice of the batch)."""
        heads = [
            core.split_heads(proj(x), self.head_num, layout="interleaved")
            for proj, x in ((self.W_q, q), (self.W_k, k), (self.W_v, v))
        ]  # each (batch, head_num, query_size, hidden_vec_size)
        scale = 1.0 / math.sqrt(self.hidden_vec_size)
        z = _document_attention(*heads, lens, scale)
        return self.W_o(core.merge_heads(z, layout="contiguous"))

    def extra_repr(self) -> str:
        return (
            f"query_size={self.query_size}, query_vec_size={self.query_vec_size}, "
            f"hidden_vec_size={self.hidden_vec_size}, output_vec_size={self.output_vec_size}, "
            f"head_num={self.head_num}"
        )

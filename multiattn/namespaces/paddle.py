"""The ``keras.ops`` subset the multiattn core uses, implemented on Paddle tensors.

Keras has no Paddle backend. The core reaches every array operation through
`multiattn.namespaces.keras.get_ops`, so a namespace object whose methods have the
``keras.ops`` signatures and semantics, registered for ``paddle.Tensor``, makes the
unchanged core run on Paddle tensors (with Paddle autograd). This module holds that
object, `PaddleNamespace`; `multiattn.backends.paddle` registers it.

Semantics follow ``keras.ops`` with two deliberate differences:

* Dtypes follow Keras' promotion lattice *with 64-bit types kept* (as Keras' JAX backend
  with ``JAX_ENABLE_X64`` or its TensorFlow backend do): float64 stays float64 and int64
  stays int64, where Keras' numpy backend would narrow them to 32 bits. Python scalars
  are weak (``float32_tensor * 0.5`` stays float32; an integer tensor with a Python float
  becomes float32).
* Paddle has no ``uint16``/``uint32``/``uint64``; ``sum`` of ``uint8`` gives ``int64``
  where Keras gives ``uint32``.

Paddle's CPU kernels lack many float16/bfloat16 and small-integer variants (no
float16 ``softmax``, ``tanh``, ``max``, ``einsum``, ``where``; no int8 ``max``; no
integer ``einsum``). Such operations are computed in a wider carrier dtype that holds
every value exactly (float32 for half precision, int32/int64 for small integers) and the
result is cast back, so results keep the dtype ``keras.ops`` would give.

Import order: importing paddle after TensorFlow in one process crashes (paddle 3.3,
tensorflow 2.21), so this module refuses to import paddle when TensorFlow is already
loaded and paddle is not.
"""

from __future__ import annotations

import contextvars
import functools
import math
import string
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._threads import kept_pool
from ..config import process_cores
from .contract import Namespace
from .keras import batch_pieces, batch_views, framework_of, join_pieces

__all__ = ["PaddleNamespace", "check_import_order"]


def check_import_order() -> None:
    """Raise ImportError when importing paddle now would crash the process.

    Importing paddle (3.3) after tensorflow (2.21) in one process ends in a segmentation
    fault; paddle first is fine.
    """
    if "tensorflow" in sys.modules and "paddle" not in sys.modules:
        raise ImportError(
            "multiattn.backends.paddle: TensorFlow is already imported but Paddle is not. "
            "Importing paddle after tensorflow in one process crashes it with a "
            "segmentation fault (paddle 3.3, tensorflow 2.21). Import paddle (or "
            "multiattn.backends.paddle) first, before anything that loads TensorFlow "
            "(tensorflow itself, or Keras with KERAS_BACKEND=tensorflow)."
        )


check_import_order()

import paddle  # noqa: E402  (only after the import-order check)

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_HALF = ("float16", "bfloat16")
_SIGNED = ("int8", "int16", "int32", "int64")
_UNSIGNED = ("uint8",)  # Paddle's only unsigned integer type
_KNOWN = ("bool", *_SIGNED, *_UNSIGNED, *_FLOATS)
_BITS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64, "uint8": 8}
_FLOAT_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}
_ALIASES = {
    "int": "int32",
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "bool_": "bool",
}
_DEFAULT_INT = "int32"  # Keras: a Python int becomes int32
_DEFAULT_FLOAT = "float32"  # Keras' floatx

# Carrier dtypes: a dtype Paddle's CPU kernels support that holds every value exactly.
_FLOAT_CARRIER = {"float16": "float32", "bfloat16": "float32"}
_SMALL_INT_CARRIER = {"bool": "int32", "int8": "int32", "int16": "int32", "uint8": "int32"}
_WHERE_CARRIER = {**_FLOAT_CARRIER, "int8": "int32", "int16": "int32", "uint8": "int32"}
_ANY_CARRIER = {**_FLOAT_CARRIER, **_SMALL_INT_CARRIER}


#: The standard name of each Paddle dtype met (`standardize_dtype` runs for nearly every
#: operation; Paddle's own ``str`` of a dtype took most of its time).
_PADDLE_DTYPE_NAMES: dict = {}


def standardize_dtype(dtype: Any) -> str:
    """A dtype spec (name, Paddle dtype, NumPy dtype, Python type) as a standard name."""
    name = _PADDLE_DTYPE_NAMES.get(dtype) if isinstance(dtype, paddle.dtype) else None
    if name is not None:
        return name
    if dtype is bool:
        return "bool"
    if dtype is int:
        return _DEFAULT_INT
    if dtype is float:
        return _DEFAULT_FLOAT
    if isinstance(dtype, str):
        name = dtype.removeprefix("paddle.")
    elif isinstance(dtype, paddle.dtype):
        name = str(dtype).removeprefix("paddle.")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            from paddle.base.data_feeder import convert_dtype  # legacy VarType dtypes

            name = convert_dtype(dtype)
    name = _ALIASES.get(name, name)
    if name not in _KNOWN:
        raise TypeError(f"PaddleNamespace: unsupported dtype {dtype!r}.")
    if isinstance(dtype, paddle.dtype):
        _PADDLE_DTYPE_NAMES[dtype] = name
    return name


def _promote_pair(a: str, b: str) -> str:
    """Least upper bound of two strong dtype names (Keras/JAX lattice, 64-bit kept)."""
    if a == b:
        return a
    if a == "bool":
        return b
    if b == "bool":
        return a
    a_float, b_float = a in _FLOATS, b in _FLOATS
    if a_float and b_float:
        if _FLOAT_RANK[a] == _FLOAT_RANK[b]:  # float16 with bfloat16
            return "float32"
        return a if _FLOAT_RANK[a] > _FLOAT_RANK[b] else b
    if a_float:
        return a
    if b_float:
        return b
    a_signed, b_signed = a in _SIGNED, b in _SIGNED
    if a_signed == b_signed:
        return a if _BITS[a] >= _BITS[b] else b
    signed, unsigned = (a, b) if a_signed else (b, a)
    return f"int{max(_BITS[signed], 2 * _BITS[unsigned])}"


def result_type(*items: Any) -> str:
    """Result dtype of combining ``items``: dtype names (strong) or Python types (weak).

    A weak Python ``int`` takes the dtype of a strong integer or float partner (int32
    alone or with bool); a weak ``float`` takes the dtype of a strong float partner
    (float32 otherwise); a weak ``bool`` never widens anything.
    """
    strong = [i for i in items if isinstance(i, str)]
    weak = {i for i in items if not isinstance(i, str)}
    out = None
    for name in strong:
        out = name if out is None else _promote_pair(out, name)
    if float in weak and (out is None or out not in _FLOATS):
        out = _DEFAULT_FLOAT
    elif int in weak and (out is None or out == "bool"):
        out = _DEFAULT_INT
    elif out is None:
        out = "bool"
    return out


def _axis_arg(axis: Any) -> Any:
    """A Keras axis (None, int, tuple) as Paddle takes it (None, int, list)."""
    if axis is None or isinstance(axis, (int, np.integer)):
        return None if axis is None else int(axis)
    return [int(a) for a in axis]


def _axes_in(ndim: int, axes: Any) -> list[int] | None:
    """``axes`` (an int or a sequence) as distinct axes in ``[0, ndim)``, negative ones
    counted from the end; None where one is out of range or repeated."""
    given = [int(a) for a in np.atleast_1d(np.asarray(axes))]
    if not all(-ndim <= a < ndim for a in given):
        return None
    out = [a % ndim for a in given]
    return out if len(set(out)) == len(out) else None


def _permuted(x: paddle.Tensor, perm: list[int]) -> paddle.Tensor:
    """``x`` with its axes in the order ``perm`` (checked), as a tensor of its own layout.

    ``paddle.transpose`` gives a view with permuted strides, and Paddle's CPU kernels
    read such a view through a slow copy: a matrix product of two heads-first views
    of ``(8, 512, 8, 64)`` float32 queries and keys took over twice as long as the same
    product of contiguous tensors, the copy alone a large part of it, where the transpose
    written by ``paddle.einsum`` costs a small fraction of that copy (measured:
    docs/benchmarks.md, 'Measurements behind the defaults'). So a permutation that moves
    data is written by ``paddle.einsum`` (floating dtypes, which its kernels take), and
    one that only moves
    axes of length 1 (the data in the same order: a decoding step's single query or
    key) is a reshape. Elsewhere (other dtypes, empty tensors, ``paddle.jit.to_static``'s
    translation, see `_in_sot`) it stays ``paddle.transpose``."""
    shape = [int(d) for d in x.shape]
    if 0 in shape or _in_sot():
        return paddle.transpose(x, perm)
    if [a for a in perm if shape[a] != 1] == [a for a in range(x.ndim) if shape[a] != 1]:
        return paddle.reshape(x, [shape[a] for a in perm])
    if x.dtype not in (paddle.float32, paddle.float64):
        return paddle.transpose(x, perm)
    labels = string.ascii_lowercase[: x.ndim]
    return paddle.einsum(f"{labels}->{''.join(labels[a] for a in perm)}", x)


def _expanded(a: paddle.Tensor, b: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``a`` and ``b`` expanded to their broadcast shape where their shapes differ:
    Paddle's logical operations broadcast slowly on the CPU (a causal mask ``(1, 1, 512,
    512)`` AND the slots ``(8, 1, 1, 512)`` took several times as long as with the two
    expanded first; measured: docs/benchmarks.md, 'Measurements behind the
    defaults')."""
    if a.shape == b.shape:
        return a, b
    shape = paddle.broadcast_shape(a.shape, b.shape)
    return paddle.expand(a, shape), paddle.expand(b, shape)


def _exp_flushed(x: paddle.Tensor) -> paddle.Tensor:
    """``paddle.exp`` with results below the dtype's smallest normal number set to 0 (see
    `PaddleNamespace.exp`)."""
    tiny = float(np.finfo(np.float64 if x.dtype == paddle.float64 else np.float32).tiny)
    out = paddle.exp(x)
    return paddle.where(x < float(np.log(tiny)), paddle.zeros_like(out), out)


def _lowercase(subscripts: str) -> str:
    """``subscripts`` with its upper-case labels renamed to unused lower-case ones:
    ``paddle.einsum`` (3.3) gives wrong results for some upper-case labels (``"ABab,abc->ABc"``
    contracted the wrong axes when measured), lower-case ones are right."""
    upper = sorted({c for c in subscripts if c.isupper()})
    if not upper:
        return subscripts
    free = [c for c in string.ascii_lowercase if c not in subscripts]
    if len(free) < len(upper):
        raise ValueError(f"einsum: too many labels in {subscripts!r} for paddle.einsum.")
    return subscripts.translate(str.maketrans(dict(zip(upper, free))))


# Whether ``paddle.jit.to_static``'s bytecode translation (SOT, its default mode) is
# simulating the call (SOT answers True for ``in_sot``): there `PaddleNamespace.linear`
# keeps ``paddle.einsum``, which SOT leaves to Python (a break in its graph) as it did
# before the matrix-product path; with the product, SOT went on to simulate the attention
# planner (`multiattn.ops.plan`), whose dataclass properties it cannot read (Paddle 3.3:
# ``HasNoAttributeError``).
try:
    from paddle.jit.sot.psdb import in_sot as _in_sot
except ImportError:  # a Paddle without SOT translates nothing

    def _in_sot() -> bool:
        return False


_IN_POOL = threading.local()


def cpu_threads() -> int:
    """The threads `_side_by_side` runs pieces on: the cores this process may run on
    (`multiattn.config.process_cores`)."""
    return process_cores()


def _pool() -> ThreadPoolExecutor:
    """The pool of `_side_by_side`: `cpu_threads` threads, kept per process."""
    return kept_pool("paddle", cpu_threads())


def _side_by_side(fn: Callable[..., Any], pieces: Sequence[tuple], like: Any) -> list:
    """``[fn(*piece) for piece in pieces]``, run on a pool of `cpu_threads` threads where
    that can run them side by side: Paddle releases the interpreter lock inside its
    kernels, and its CPU kernels use one thread each. Each piece runs under the caller's
    gradient mode (Paddle keeps it per thread) and a copy of its context variables
    (`multiattn.config.settings`). In turn instead: static-graph values
    (``paddle.jit.to_static``: the pieces are written into one program), tensors off the
    CPU (a GPU queues kernels anyway), under ``paddle.amp.auto_cast`` (its state is not
    carried to other threads), on one CPU, and inside a piece already on the pool."""
    in_turn = (
        len(pieces) < 2
        or cpu_threads() < 2
        or getattr(_IN_POOL, "active", False)
        or not isinstance(like, paddle.Tensor)
        or not like.place.is_cpu_place()
        or paddle.amp.is_autocast_enabled()
    )
    if in_turn:
        return [fn(*piece) for piece in pieces]
    grad = paddle.is_grad_enabled()

    def run(piece: tuple) -> Any:
        _IN_POOL.active = True
        try:
            with paddle.set_grad_enabled(grad):
                return fn(*piece)
        finally:
            _IN_POOL.active = False

    futures = [_pool().submit(contextvars.copy_context().run, run, p) for p in pieces]
    return [f.result() for f in futures]


class PaddleNamespace(Namespace):
    """``keras.ops`` semantics on ``paddle.Tensor``: the namespace contract
    (`multiattn.namespaces.contract.Namespace`) the multiattn core uses.

    Every method accepts Paddle tensors, NumPy arrays and Python scalars where
    ``keras.ops`` does, and returns Paddle tensors (dygraph); a tensor of another
    framework raises ``TypeError``. Gradients flow through every floating operation
    (Paddle autograd); `stop_gradient` cuts them. There is no fused attention
    (``has_fused_attention`` is False), so the core takes its explicit attention path.
    """

    backend = "paddle"

    #: Paddle's softmax kernel floors the exponentials at ``exp(-64)``: a score far below
    #: its row's maximum (a masked score) gets a weight of about ``1.6e-28 / sum`` instead
    #: of 0. The core then zeroes masked weights by a select (`multiattn.ops.masking`).
    softmax_exact_zeros = False
    #: `write_cache` assigns into the cache tensor (dygraph).
    writes_in_place = True
    #: `map_batch` runs the slices side by side on the CPU's cores (`_side_by_side`):
    #: Paddle's CPU kernels run on one thread (its matrix products included), so the
    #: explicit attention path in slices uses cores that one piece leaves idle. Eager
    #: calls take it too, and the slice count is timed there
    #: (`multiattn.tuning.attention_chunks`).
    maps_batch = True
    maps_batch_eagerly = True
    #: Paddle's CPU kernels broadcast an operand over inner axes slowly: rotary's ``(T, 1,
    #: R/2)`` tables against ``(8, 512, 8, 32)`` halves of the queries, the rotation took
    #: about twice as long as with the tables broadcast to the full shape first
    #: (measured: docs/benchmarks.md, 'Measurements behind the defaults').
    broadcasts_slowly = True

    # --- conversion and dtypes -----------------------------------------------------------

    def _weak_or_name(self, x: Any) -> Any:
        """The dtype name of ``x``, or its Python type when ``x`` is a Python scalar."""
        if type(x) in (bool, int, float):
            return type(x)
        return self.dtype_name(x)

    def dtype_name(self, x: Any) -> str:
        """The standardised dtype name of ``x`` (``"float32"``, ``"bool"``, ``"int64"``...).

        Python scalars and lists report the dtype `convert_to_tensor` gives them.
        """
        dtype = getattr(x, "dtype", None)
        if dtype is not None:
            return standardize_dtype(dtype)
        return self._infer_dtype(x)

    def _infer_dtype(self, x: Any) -> str:
        """The dtype ``keras.ops.convert_to_tensor`` gives a non-tensor ``x``."""
        if isinstance(x, (np.ndarray, np.generic)):
            return standardize_dtype(x.dtype)
        if isinstance(x, (list, tuple)):
            leaves: list[Any] = []
            stack = list(x)
            while stack:
                item = stack.pop()
                if isinstance(item, (list, tuple)):
                    stack.extend(item)
                else:
                    leaves.append(self._weak_or_name(item))
            return result_type(*leaves) if leaves else _DEFAULT_FLOAT
        return result_type(self._weak_or_name(x))

    def _t(self, x: Any, dtype: str | None = None) -> paddle.Tensor:
        """``x`` as a Paddle tensor, cast to ``dtype`` when given."""
        if isinstance(x, paddle.Tensor):
            if dtype is not None and self.dtype_name(x) != dtype:
                return x.astype(dtype)
            return x
        if framework_of(x) is not None:
            raise TypeError(
                "PaddleNamespace: expected Paddle tensors, NumPy arrays or Python values; "
                f"received a {type(x).__module__}.{type(x).__qualname__} "
                f"({framework_of(x)}). Convert it with numpy.asarray first."
            )
        if dtype is None:
            dtype = self._infer_dtype(x)
        if isinstance(x, (list, tuple)) and any(isinstance(i, paddle.Tensor) for i in x):
            return paddle.stack([self._t(i, dtype) for i in x])
        arr = np.asarray(x)
        if dtype == "bfloat16":  # NumPy has no native bfloat16: go through float32
            return paddle.to_tensor(arr.astype(np.float32)).astype("bfloat16")
        return paddle.to_tensor(arr.astype(dtype, copy=False))

    def _bool(self, x: Any) -> paddle.Tensor:
        return self._t(x, "bool")

    def convert_to_tensor(
        self, x: Any, dtype: Any = None, sparse: bool | None = None, ragged: bool | None = None
    ) -> paddle.Tensor:
        """``x`` as a Paddle tensor (NumPy dtypes kept; Python floats -> float32, ints ->
        int32, as in Keras)."""
        if sparse or ragged:
            raise ValueError("PaddleNamespace.convert_to_tensor: no sparse or ragged tensors.")
        return self._t(x, None if dtype is None else standardize_dtype(dtype))

    def convert_to_numpy(self, x: Any) -> np.ndarray:
        """``x`` as a NumPy array (bfloat16 as ``ml_dtypes.bfloat16``, as Keras does)."""
        if not isinstance(x, paddle.Tensor):
            return np.asarray(x)
        if self.dtype_name(x) == "bfloat16":
            arr = x.astype("float32").numpy()
            try:
                import ml_dtypes
            except ImportError:  # pragma: no cover - ml_dtypes ships with Keras
                return arr
            return arr.astype(ml_dtypes.bfloat16)
        return np.asarray(x.numpy())

    def cast(self, x: Any, dtype: Any) -> paddle.Tensor:
        """``x`` in ``dtype`` (float -> int truncates toward zero; non-zero -> True)."""
        return self._t(x, standardize_dtype(dtype))

    def is_symbolic(self, x: Any) -> bool:
        """True for a static-graph value (PIR ``Value`` or legacy ``Variable``); False for
        dygraph tensors, NumPy arrays and Python scalars."""
        if isinstance(x, paddle.Tensor):  # eager (dygraph) tensors hold values
            return False
        pir_value = getattr(getattr(paddle, "pir", None), "Value", None)
        if pir_value is not None and isinstance(x, pir_value):
            return True
        # paddle.static.Variable's isinstance also accepts eager tensors: checked above.
        return not paddle.in_dynamic_mode() and isinstance(x, paddle.static.Variable)

    # --- carriers ------------------------------------------------------------------------

    @staticmethod
    def _carried(
        x: paddle.Tensor, dtype: str, fn: Callable[[paddle.Tensor], paddle.Tensor], carrier: dict
    ) -> paddle.Tensor:
        """``fn(x)`` computed in ``carrier.get(dtype, dtype)`` and cast back to ``dtype``."""
        wide = carrier.get(dtype)
        if wide is None:
            return fn(x)
        return fn(x.astype(wide)).astype(dtype)

    # --- shapes --------------------------------------------------------------------------

    def shape(self, x: Any) -> tuple[int, ...]:
        """The shape of ``x`` as a tuple of Python ints (usable in `reshape`)."""
        if isinstance(x, paddle.Tensor):
            return tuple(int(d) for d in x.shape)
        return tuple(np.shape(x))

    def reshape(self, x: Any, newshape: Any) -> paddle.Tensor:
        """``x`` with shape ``newshape`` (one entry may be -1; 0 means size 0, not Paddle's
        "copy this dimension")."""
        x = self._t(x)
        if isinstance(newshape, (int, np.integer)):
            newshape = (newshape,)
        dims = [int(d) for d in newshape]
        if 0 in dims:
            known = [d for d in dims if d != -1]
            if dims.count(-1) > 0 and math.prod(known) == 0:
                raise ValueError(
                    f"PaddleNamespace.reshape: cannot infer -1 in {tuple(dims)} for a "
                    "zero-size result."
                )
            if math.prod(self.shape(x)) != 0:
                raise ValueError(
                    f"PaddleNamespace.reshape: cannot reshape {self.shape(x)} into {tuple(dims)}."
                )
            return paddle.zeros(dims, dtype=x.dtype)
        return paddle.reshape(x, dims)

    def concatenate(self, xs: Sequence[Any], axis: int | None = 0) -> paddle.Tensor:
        """``xs`` joined along ``axis`` (flattened first when ``axis`` is None), in the
        dtype the inputs promote to (Keras' lattice, 64-bit kept)."""
        tensors = [self._t(x) for x in xs]
        if not tensors:
            raise ValueError("PaddleNamespace.concatenate: need at least one tensor.")
        dtype = result_type(*(self.dtype_name(t) for t in tensors))
        tensors = [self._t(t, dtype) for t in tensors]
        if axis is None:
            tensors, axis = [paddle.reshape(t, [-1]) for t in tensors], 0
        return paddle.concat(tensors, axis=int(axis))

    def expand_dims(self, x: Any, axis: int | Sequence[int]) -> paddle.Tensor:
        """``x`` with new axes of size 1 at ``axis`` (positions in the result, NumPy-style:
        distinct, in ``[-r, r)`` for a result of rank ``r``, else ``ValueError``)."""
        x = self._t(x)
        ndim = x.ndim + int(np.size(axis))
        normalized = _axes_in(ndim, axis)
        if normalized is None:
            raise ValueError(
                f"PaddleNamespace.expand_dims: `axis` must name distinct axes of the rank-{ndim} "
                f"result, in [{-ndim}, {ndim}); received {axis!r}."
            )
        for a in sorted(normalized):
            x = paddle.unsqueeze(x, a)
        return x

    def transpose(self, x: Any, axes: Sequence[int] | None = None) -> paddle.Tensor:
        """``x`` with its axes permuted (reversed when ``axes`` is None)."""
        x = self._t(x)
        perm = list(range(x.ndim))[::-1] if axes is None else _axes_in(x.ndim, axes)
        if perm is None or len(perm) != x.ndim:
            raise ValueError(
                f"PaddleNamespace.transpose: `axes` must order each of the {x.ndim} axes "
                f"once; received {axes!r}."
            )
        return _permuted(x, perm)

    def moveaxis(
        self, x: Any, source: int | Sequence[int], destination: int | Sequence[int]
    ) -> paddle.Tensor:
        """``x`` with axes ``source`` moved to ``destination``."""
        x = self._t(x)
        sources, destinations = (_axes_in(x.ndim, v) for v in (source, destination))
        if sources is None or destinations is None or len(sources) != len(destinations):
            raise ValueError(
                f"PaddleNamespace.moveaxis: `source` and `destination` must name as many "
                f"distinct axes of the {x.ndim}; received {source!r} and {destination!r}."
            )
        perm = [a for a in range(x.ndim) if a not in sources]
        for dest, src in sorted(zip(destinations, sources)):
            perm.insert(dest, src)
        return _permuted(x, perm)

    def broadcast_to(self, x: Any, shape: Sequence[int]) -> paddle.Tensor:
        """``x`` broadcast to ``shape``."""
        return paddle.broadcast_to(self._t(x), [int(d) for d in shape])

    def write_cache(self, cache: Any, new: Any, index: Any) -> paddle.Tensor:
        """``new`` assigned into ``cache[:, :, index : index + t]`` (in place) and
        ``cache`` returned; ``index`` a Python int or a 0-d integer tensor.

        The assignment goes through ``(B * H, max_length * D)`` views of the cache and of
        ``new`` (one block of ``t * D`` values per row): a prompt of 512 tokens into an
        ``(8, 8, 576, 32)`` float32 cache took under a third of the time of the same
        assignment through the rank-4 slice (measured: docs/benchmarks.md,
        'Measurements behind the defaults')."""
        start, tokens = int(index), int(new.shape[2])
        b, h, slots, width = (int(d) for d in cache.shape)
        flat = paddle.reshape(cache, [b * h, slots * width])  # a view of the cache
        flat[:, start * width : (start + tokens) * width] = paddle.reshape(
            self._t(new), [b * h, tokens * width]
        )
        return cache

    def slice(
        self, inputs: Any, start_indices: Sequence[Any], shape: Sequence[Any]
    ) -> paddle.Tensor:
        """The block of ``inputs`` starting at ``start_indices`` with sizes ``shape``
        (``-1``: the rest of that axis). Starts may be ints or 0-d tensors; the block
        must lie inside ``inputs``."""
        x = self._t(inputs)
        dims = [int(d) for d in x.shape]
        if len(start_indices) != x.ndim or len(shape) != x.ndim:
            raise ValueError(
                f"PaddleNamespace.slice: need one start and one size per axis of a rank "
                f"{x.ndim} tensor; received {len(start_indices)} and {len(shape)}."
            )
        starts = [int(s) for s in start_indices]
        sizes = [d - b if int(n) == -1 else int(n) for d, b, n in zip(dims, starts, shape)]
        if any(b < 0 or n < 0 or b + n > d for d, b, n in zip(dims, starts, sizes)):
            raise ValueError(
                f"PaddleNamespace.slice: the block at {starts} of sizes {sizes} does not "
                f"lie inside a tensor of shape {dims}."
            )
        return paddle.slice(
            x, axes=list(range(x.ndim)), starts=starts, ends=[b + n for b, n in zip(starts, sizes)]
        )

    def take(self, x: Any, indices: Any, axis: int | None = None) -> paddle.Tensor:
        """Entries of ``x`` at integer ``indices`` along ``axis`` (of the flattened ``x``
        when None; negative indices count from the end): shape ``x.shape[:axis] +
        indices.shape + x.shape[axis + 1:]``, dtype of ``x``."""
        x = self._t(x)
        idx = self._t(indices)
        if self.dtype_name(idx) not in (*_SIGNED, *_UNSIGNED):
            raise TypeError(
                f"PaddleNamespace.take: `indices` must be integers; received "
                f"{self.dtype_name(idx)}."
            )
        if axis is None:
            x, axis = paddle.reshape(x, [-1]), 0
        axis = int(axis) % max(x.ndim, 1)
        size = int(x.shape[axis])
        idx = idx.astype("int64")
        idx = paddle.where(idx < 0, idx + size, idx)
        dims = [int(d) for d in x.shape]
        out_shape = [*dims[:axis], *(int(d) for d in idx.shape), *dims[axis + 1 :]]

        def gather(t: paddle.Tensor) -> paddle.Tensor:
            return paddle.reshape(paddle.gather(t, paddle.reshape(idx, [-1]), axis=axis), out_shape)

        return self._carried(x, self.dtype_name(x), gather, _ANY_CARRIER)

    def arange(
        self, start: Any, stop: Any = None, step: Any = None, dtype: Any = None
    ) -> paddle.Tensor:
        """``[start, stop)`` by ``step``; Python ints give int32 and floats float32 by default."""
        if dtype is None:
            parts = [p for p in (start, stop, step) if p is not None]
            dtype = result_type(*(self._weak_or_name(p) for p in parts))
        else:
            dtype = standardize_dtype(dtype)
        if stop is None:
            start, stop = 0, start
        if step is None:
            step = 1
        if dtype in ("int32", "int64", "float32", "float64"):
            carrier = dtype
        else:
            carrier = "float32" if dtype in _HALF else "int64"
        out = paddle.arange(start, stop, step, dtype=carrier)
        return out if carrier == dtype else out.astype(dtype)

    # --- elementwise ---------------------------------------------------------------------

    def where(self, condition: Any, x1: Any = None, x2: Any = None) -> Any:
        """Elementwise ``x1`` where ``condition`` else ``x2`` (broadcast; Python scalars such
        as ``float("-inf")`` take the other operand's dtype). With neither ``x1`` nor
        ``x2``: the indices of the non-zero entries, one tensor per axis."""
        cond = self._bool(condition)
        if x1 is None and x2 is None:
            return tuple(paddle.nonzero(cond, as_tuple=True))
        if x1 is None or x2 is None:
            raise ValueError("PaddleNamespace.where: pass both `x1` and `x2`, or neither.")
        dtype = result_type(self._weak_or_name(x1), self._weak_or_name(x2))
        a, b = self._t(x1, dtype), self._t(x2, dtype)
        wide = _WHERE_CARRIER.get(dtype)
        if wide is None:
            return paddle.where(cond, a, b)
        return paddle.where(cond, a.astype(wide), b.astype(wide)).astype(dtype)

    def _unary_float(self, x: Any, fn: Callable[[paddle.Tensor], paddle.Tensor], name: str):
        x = self._t(x)
        dtype = self.dtype_name(x)
        if dtype in _FLOATS:
            out_dtype = dtype
        elif name == "tanh" and dtype != "int64":
            out_dtype = result_type(dtype, float)
        else:  # Keras: integers and bool go to floatx
            out_dtype = _DEFAULT_FLOAT
        return self._carried(x.astype(out_dtype), out_dtype, fn, _FLOAT_CARRIER)

    def tanh(self, x: Any) -> paddle.Tensor:
        """Hyperbolic tangent; integers give float32, floats keep their dtype."""
        return self._unary_float(x, paddle.tanh, "tanh")

    def gelu(self, x: Any, approximate: bool = True) -> paddle.Tensor:
        """``paddle.nn.functional.gelu`` (the tanh form with ``approximate``); integers
        give float32, floats keep their dtype."""
        return self._unary_float(
            x, functools.partial(paddle.nn.functional.gelu, approximate=approximate), "gelu"
        )

    def silu(self, x: Any) -> paddle.Tensor:
        """``paddle.nn.functional.silu``; integers give float32, floats keep their dtype."""
        return self._unary_float(x, paddle.nn.functional.silu, "silu")

    def erf(self, x: Any) -> paddle.Tensor:
        """Gauss error function; integers give float32, floats keep their dtype."""
        return self._unary_float(x, paddle.erf, "erf")

    def exp(self, x: Any) -> paddle.Tensor:
        """Exponential; integers and bool give float32, floats keep their dtype.

        Paddle's vectorised kernel (tensors of 8 entries or more) returns a floor of
        about 2.9e-39 (float32) or 5.6e-309 (float64) where the exponential underflows,
        ``exp(-inf)`` included. Results below the smallest normal number of the computing
        dtype are flushed to 0 here (a select: no gradient flows through them), so that
        ``exp(-inf)`` is exactly 0 as the core's masked softmax requires."""
        return self._unary_float(x, _exp_flushed, "exp")

    def log(self, x: Any) -> paddle.Tensor:
        """Natural logarithm; integers and bool give float32, floats keep their dtype."""
        return self._unary_float(x, paddle.log, "log")

    def square(self, x: Any) -> paddle.Tensor:
        """``x * x`` in the dtype of ``x`` (bool gives int32, as in Keras)."""
        x = self._t(x)
        dtype = self.dtype_name(x)
        if dtype == "bool":
            x, dtype = x.astype("int32"), "int32"
        return self._carried(x, dtype, paddle.square, _ANY_CARRIER)

    def rsqrt(self, x: Any) -> paddle.Tensor:
        """``1 / sqrt(x)``; floats keep their dtype, integers and bool give float32."""
        x = self._t(x)
        dtype = self.dtype_name(x)
        out_dtype = dtype if dtype in _FLOATS else _DEFAULT_FLOAT
        return self._carried(x.astype(out_dtype), out_dtype, paddle.rsqrt, _FLOAT_CARRIER)

    def abs(self, x: Any) -> paddle.Tensor:
        """``|x|`` in the dtype of ``x`` (bool unchanged)."""
        x = self._t(x)
        dtype = self.dtype_name(x)
        if dtype == "bool":
            return x
        return self._carried(x, dtype, paddle.abs, _ANY_CARRIER)

    def multiply(self, x1: Any, x2: Any) -> paddle.Tensor:
        """``x1 * x2`` elementwise (broadcast), in the dtype both promote to (bool: and)."""
        dtype = result_type(self._weak_or_name(x1), self._weak_or_name(x2))
        a, b = self._t(x1, dtype), self._t(x2, dtype)
        if dtype == "bool":
            return paddle.logical_and(a, b)
        wide = _ANY_CARRIER.get(dtype)
        if wide is None:
            return paddle.multiply(a, b)
        return paddle.multiply(a.astype(wide), b.astype(wide)).astype(dtype)

    def logical_and(self, x1: Any, x2: Any) -> paddle.Tensor:
        """Elementwise AND of the truth values of ``x1`` and ``x2`` (bool, broadcast)."""
        return paddle.logical_and(*_expanded(self._bool(x1), self._bool(x2)))

    def logical_or(self, x1: Any, x2: Any) -> paddle.Tensor:
        """Elementwise OR of the truth values of ``x1`` and ``x2`` (bool, broadcast)."""
        return paddle.logical_or(*_expanded(self._bool(x1), self._bool(x2)))

    def logical_not(self, x: Any) -> paddle.Tensor:
        """Elementwise NOT of the truth value of ``x`` (bool)."""
        return paddle.logical_not(self._bool(x))

    def _compare(self, fn: Callable, x1: Any, x2: Any) -> paddle.Tensor:
        dtype = result_type(self._weak_or_name(x1), self._weak_or_name(x2))
        return fn(self._t(x1, dtype), self._t(x2, dtype))

    def less(self, x1: Any, x2: Any) -> paddle.Tensor:
        """``x1 < x2`` elementwise (bool), after promoting both to a common dtype."""
        return self._compare(paddle.less_than, x1, x2)

    def less_equal(self, x1: Any, x2: Any) -> paddle.Tensor:
        """``x1 <= x2`` elementwise (bool), after promoting both to a common dtype."""
        return self._compare(paddle.less_equal, x1, x2)

    def equal(self, x1: Any, x2: Any) -> paddle.Tensor:
        """``x1 == x2`` elementwise (bool), after promoting both to a common dtype."""
        return self._compare(paddle.equal, x1, x2)

    def greater_equal(self, x1: Any, x2: Any) -> paddle.Tensor:
        """``x1 >= x2`` elementwise (bool), after promoting both to a common dtype."""
        return self._compare(paddle.greater_equal, x1, x2)

    def not_equal(self, x1: Any, x2: Any) -> paddle.Tensor:
        """``x1 != x2`` elementwise (bool), after promoting both to a common dtype."""
        return self._compare(paddle.not_equal, x1, x2)

    def zeros(self, shape: Any, dtype: Any = "float32") -> paddle.Tensor:
        """Zeros of ``shape`` (static ints) in ``dtype``."""
        return paddle.zeros([int(d) for d in shape], dtype=dtype)

    def zeros_like(self, x: Any, dtype: Any = None) -> paddle.Tensor:
        """Zeros of the shape of ``x``, in ``dtype`` (default: the dtype of ``x``)."""
        x = self._t(x)
        return paddle.zeros(x.shape, dtype=self.dtype_name(x) if dtype is None else dtype)

    def isfinite(self, x: Any) -> paddle.Tensor:
        """Elementwise: neither NaN nor infinite (bool); integers and bool are always finite."""
        x = self._t(x)
        dtype = self.dtype_name(x)
        if dtype not in _FLOATS:
            return paddle.ones(x.shape, dtype="bool")
        return paddle.isfinite(x.astype(_FLOAT_CARRIER.get(dtype, dtype)))

    def stop_gradient(self, variable: Any) -> paddle.Tensor:
        """``variable`` with no gradient flowing back through it (same values)."""
        return self._t(variable).detach()

    # --- control flow --------------------------------------------------------------------

    def cond(self, pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        """``true_fn()`` if the scalar bool ``pred`` holds, else ``false_fn()`` (a Python
        branch: Paddle runs eagerly)."""
        return true_fn() if bool(self._bool(pred)) else false_fn()

    def fori_loop(self, lower: int, upper: int, body_fun: Callable, init_val: Any) -> Any:
        """``body_fun(i, val)`` for ``i`` in ``[lower, upper)``, threading ``val`` (any
        structure of tensors), as a Python loop (Paddle runs eagerly; gradients flow
        through every iteration)."""
        val = init_val
        for i in range(int(lower), int(upper)):
            val = body_fun(i, val)
        return val

    def custom_gradient(
        self,
        forward: Callable[..., tuple[Any, tuple]],
        backward: Callable[[tuple, Any], tuple],
        inputs: tuple,
    ) -> Any:
        """``forward(*inputs)[0]`` differentiated with ``backward`` (a Paddle
        ``PyLayer``), as `multiattn.namespaces.keras.KerasNamespace.custom_gradient`:
        ``forward`` returns ``(output, saved)``, ``backward(saved, d_output)`` one
        gradient per input; tensors the two close over get no gradient. Differentiable
        once: a gradient taken with ``create_graph=True`` raises ``RuntimeError``
        (``backward`` treats ``saved`` as constants)."""
        return _custom_gradient_layer().apply(forward, backward, *inputs)

    def map_batch(
        self, fn: Callable[..., Any], args: Sequence[Any], chunks: int, remat: bool = True
    ) -> Any:
        """`Namespace.map_batch` with the slices run side by side (`_side_by_side`) and
        joined by ``paddle.concat``; gradients flow through the cut and the join (Paddle
        autograd). ``remat`` changes nothing: each call keeps what Paddle's autograd
        keeps for it.

        Where a gradient can flow into an argument the batch is cut by ``paddle.split``
        (a copy, whose gradient is a ``concat``), elsewhere by indexing (views, no copy,
        whose gradients are each a zero-filled batch summed): the adapter's multi-head
        attention at the benchmark's shape (batch 8, length 512, width 512, 8 heads,
        float32, 8 slices) was faster forward and backward with the split than with
        views, and forward faster with views than with copies (measured:
        docs/benchmarks.md, 'Measurements behind the defaults')."""
        grads = paddle.is_grad_enabled() and any(
            isinstance(a, paddle.Tensor) and not a.stop_gradient for a in args
        )
        pieces = batch_pieces(args, chunks, paddle.split if grads else batch_views)
        return join_pieces(_side_by_side(fn, pieces, args[0]), paddle.concat)

    # --- reductions ----------------------------------------------------------------------

    def any(self, x: Any, axis: Any = None, keepdims: bool = False) -> paddle.Tensor:
        """Whether any entry of ``x`` along ``axis`` is non-zero (bool)."""
        return paddle.any(self._bool(x), axis=_axis_arg(axis), keepdim=keepdims)

    def sum(self, x: Any, axis: Any = None, keepdims: bool = False) -> paddle.Tensor:
        """Sum along ``axis``. bool/int8/int16 give int32 (uint8 gives int64: Paddle has no
        uint32); other dtypes are kept. Half precision accumulates in float32."""
        x = self._t(x)
        dtype = self.dtype_name(x)
        if dtype in ("bool", "int8", "int16"):
            out_dtype = "int32"
        elif dtype == "uint8":
            out_dtype = "int64"
        else:
            out_dtype = dtype
        compute = _FLOAT_CARRIER.get(out_dtype, out_dtype)
        out = paddle.sum(x, axis=_axis_arg(axis), dtype=compute, keepdim=keepdims)
        return out.astype(out_dtype) if compute != out_dtype else out

    def max(
        self, x: Any, axis: Any = None, keepdims: bool = False, initial: Any = None
    ) -> paddle.Tensor:
        """Maximum along ``axis`` in the dtype of ``x`` (``-inf`` entries are fine); with
        ``initial``, the maximum of that and the reduction."""
        x = self._t(x)
        dtype = self.dtype_name(x)
        wide = _ANY_CARRIER.get(dtype, dtype)

        def reduce(t: paddle.Tensor) -> paddle.Tensor:
            out = paddle.max(t, axis=_axis_arg(axis), keepdim=keepdims)
            if initial is not None:
                out = paddle.maximum(out, self._t(initial, wide))
            return out

        return self._carried(x, dtype, reduce, _ANY_CARRIER)

    def softmax(self, x: Any, axis: int | Sequence[int] = -1) -> paddle.Tensor:
        """Softmax over ``axis`` (an int or a tuple of axes normalised jointly).

        Integers give float32; half precision is computed in float32 and cast back.
        """
        x = self._t(x)
        dtype = self.dtype_name(x)
        out_dtype = dtype if dtype in _FLOATS else _DEFAULT_FLOAT
        x = x.astype(out_dtype)

        def fn(t: paddle.Tensor) -> paddle.Tensor:
            if isinstance(axis, (int, np.integer)):
                return paddle.nn.functional.softmax(t, axis=int(axis))
            axes = sorted(int(a) % t.ndim for a in axis)
            keep = [a for a in range(t.ndim) if a not in axes]
            moved = paddle.transpose(t, keep + axes)
            moved_shape = [int(d) for d in moved.shape]
            flat = paddle.reshape(moved, [*moved_shape[: len(keep)], -1])
            out = paddle.reshape(paddle.nn.functional.softmax(flat, axis=-1), moved_shape)
            return paddle.transpose(out, [int(i) for i in np.argsort(keep + axes)])

        return self._carried(x, out_dtype, fn, _FLOAT_CARRIER)

    # --- contractions --------------------------------------------------------------------

    def einsum(self, subscripts: str, *operands: Any) -> paddle.Tensor:
        """Einstein summation with ``keras.ops.einsum``'s dtype rule (int8 gives int32;
        float64 kept).

        Float32/float64 use ``paddle.einsum`` (which handles every subscript the core uses,
        ``...`` broadcasting included); half precision is computed in float32; integer and
        bool operands (no Paddle einsum kernel), or a subscript ``paddle.einsum``
        rejects, go through `einsum_by_broadcast`.
        """
        tensors = [self._t(o) for o in operands]
        names = [self.dtype_name(t) for t in tensors]
        result = "int32" if set(names) == {"int8"} else result_type(*names)
        if result in _FLOATS:
            compute = _FLOAT_CARRIER.get(result, result)
            tensors = [t.astype(compute) if n != compute else t for t, n in zip(tensors, names)]
            matmul = _MATMUL_SUBSCRIPTS.get(subscripts.replace(" ", ""))
            if matmul is not None and len(tensors) == 2:
                # The batched products of attention: paddle.matmul is much faster than
                # paddle.einsum here, in the backward pass above all.
                out = paddle.matmul(tensors[0], tensors[1], transpose_y=matmul)
            else:
                try:
                    out = paddle.einsum(_lowercase(subscripts), *tensors)
                except Exception:  # a subscript paddle.einsum cannot do: the generic path
                    out = einsum_by_broadcast(subscripts, *tensors)
        else:
            compute = "int64"
            out = einsum_by_broadcast(subscripts, *(t.astype(compute) for t in tensors))
        return out.astype(result) if compute != result else out

    def linear(self, x: Any, kernel: Any, bias: Any = None, contract: int = 1) -> paddle.Tensor:
        """A dense projection: ``x`` ``(..., *k)`` contracted with ``kernel`` ``(*k, *n)``
        over the ``contract`` axes ``k``, plus ``bias`` ``(*n)`` (or None): ``(..., *n)``;
        floats as one matrix product and the bias added (`_matmul_bias`), other dtypes
        by `einsum` and an addition."""
        x, kernel = self._t(x), self._t(kernel)
        if isinstance(contract, bool) or not isinstance(contract, (int, np.integer)):
            raise TypeError(
                f"PaddleNamespace.linear: `contract` must be an int; received {contract!r}."
            )
        if not 1 <= contract <= min(x.ndim, kernel.ndim):
            raise ValueError(
                f"PaddleNamespace.linear: `contract` must be between 1 and the rank of `x` "
                f"and `kernel` ({x.ndim}, {kernel.ndim}); received {contract}."
            )
        dtype = self.dtype_name(x)
        empty = 0 in x.shape or 0 in kernel.shape  # (Paddle's reshape reads a 0 as "keep")
        if dtype not in _FLOATS or self.dtype_name(kernel) != dtype or empty or _in_sot():
            lead = "ABCDEFGH"[: x.ndim - contract]
            k, n = "abcdefgh"[:contract], "abcdefgh"[contract : kernel.ndim]
            y = self.einsum(f"{lead}{k},{k}{n}->{lead}{n}", x, kernel)
            return y if bias is None else y + self._t(bias, self.dtype_name(y))
        return self._matmul_bias(x, kernel, bias, contract, dtype)

    def _matmul_bias(self, x, kernel, bias, contract: int, dtype: str) -> paddle.Tensor:
        """`linear` on floats as ``paddle.matmul`` ``(..., K) @ (K, N)`` and the bias
        added, the contracted axes and the kernel's output axes flattened (views), half
        precision computed in float32. (Not while ``paddle.jit.to_static`` translates the
        call, `_in_sot`.)

        Against ``paddle.einsum`` it saves Python and dispatch work per call: the
        projections of a decoding step, ``(1, 1, 256) @ (256, 256)``, ran several times
        faster as a ``paddle.matmul`` than as a ``paddle.einsum`` (measured:
        docs/benchmarks.md, 'Measurements behind the defaults')."""
        taken = [int(d) for d in x.shape[x.ndim - contract :]]
        given = [int(d) for d in kernel.shape[:contract]]
        if taken != given:
            raise ValueError(
                f"PaddleNamespace.linear: the last {contract} axes of `x` {taken} must match "
                f"the first axes of `kernel` {given}."
            )
        lead = [int(d) for d in x.shape[: x.ndim - contract]]
        out = [int(d) for d in kernel.shape[contract:]]
        k, n = math.prod(given), math.prod(out)
        compute = _FLOAT_CARRIER.get(dtype, dtype)

        def flat(t: paddle.Tensor, shape: list) -> paddle.Tensor:
            t = t if list(t.shape) == shape else paddle.reshape(t, shape)
            return t if dtype == compute else t.astype(compute)

        y = paddle.matmul(flat(x, [*lead, k]), flat(kernel, [k, n]))
        if bias is not None:
            y = y + flat(self._t(bias, dtype), [n])
        y = y if len(out) == 1 else paddle.reshape(y, [*lead, *out])
        return y if dtype == compute else y.astype(dtype)

    # --- random --------------------------------------------------------------------------

    def dropout(self, x: Any, rate: float, seed: Any = None) -> paddle.Tensor:
        """Inverted dropout: zero each entry with probability ``rate``, scale the rest by
        ``1 / (1 - rate)``.

        ``seed``:

        * an ``int``: the keep mask is drawn exactly as Keras' numpy backend draws it
          (``numpy.random.default_rng([seed, 0]).uniform(size=x.shape) < 1 - rate``), so it
          is reproducible and independent of Paddle's global generator;
        * a ``keras.random.SeedGenerator``: its next state seeds the same NumPy draw (each
          call advances the generator, as in Keras);
        * ``None``: Paddle's own dropout with Paddle's global generator (``paddle.seed``).
        """
        x = self._t(x)
        rate = float(rate)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"PaddleNamespace.dropout: `rate` must be in [0, 1]; got {rate!r}.")
        if rate == 0.0:
            return x
        dtype = self.dtype_name(x)
        if rate == 1.0:
            return self._carried(x, dtype, lambda t: t * 0.0, _FLOAT_CARRIER)
        if seed is None:
            return paddle.nn.functional.dropout(x, p=rate, training=True)
        rng_seed = self._numpy_seed(seed)
        keep = np.random.default_rng(rng_seed).uniform(size=self.shape(x)) < 1.0 - rate
        keep_t = paddle.to_tensor(keep)

        def fn(t: paddle.Tensor) -> paddle.Tensor:
            return paddle.where(keep_t, t / (1.0 - rate), paddle.zeros_like(t))

        return self._carried(x, dtype, fn, _FLOAT_CARRIER)

    @staticmethod
    def _numpy_seed(seed: Any) -> Any:
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            return np.array([int(seed), 0], dtype=np.uint32)
        keras = sys.modules.get("keras")
        if keras is not None and isinstance(seed, keras.random.SeedGenerator):
            return np.asarray(keras.ops.convert_to_numpy(seed.next()))
        raise TypeError(
            "PaddleNamespace.dropout: `seed` must be None, an int or a "
            f"keras.random.SeedGenerator; received {seed!r}."
        )


@functools.cache
def _custom_gradient_layer() -> Any:
    """The ``PyLayer`` behind `PaddleNamespace.custom_gradient`."""

    class CustomGradient(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx, forward, backward, *inputs):
            out, saved = forward(*inputs)
            ctx.backward_fn = backward
            # Paddle wants None, not a gradient, for an input that takes none.
            ctx.takes_grad = [not t.stop_gradient for t in inputs]
            ctx.save_for_backward(*saved)
            return out

        @staticmethod
        def backward(ctx, grad):
            if paddle.is_grad_enabled():  # create_graph=True: a second differentiation
                raise RuntimeError(
                    "multiattn: this operation (the blockwise attention path) is "
                    "differentiable once; its gradient cannot be differentiated again "
                    "(create_graph=True) on Paddle."
                )
            grads = ctx.backward_fn(tuple(ctx.saved_tensor()), grad)
            return tuple(g if want else None for g, want in zip(grads, ctx.takes_grad))

    return CustomGradient


def _parse_einsum(subscripts: str, ndims: Sequence[int]) -> tuple[list[list], list]:
    """Labels of each operand and of the output; ``...`` becomes right-aligned
    ``("...", i)`` labels so that broadcasting follows NumPy."""
    spec = subscripts.replace(" ", "")
    lhs, arrow, rhs = spec.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise ValueError(
            f"einsum: {subscripts!r} names {len(terms)} operands; received {len(ndims)}."
        )
    n_ell = 0
    for term, nd in zip(terms, ndims):
        letters = len(term.replace("...", ""))
        if ("..." in term and nd < letters) or ("..." not in term and nd != letters):
            raise ValueError(f"einsum: term {term!r} does not fit an operand of rank {nd}.")
        if "..." in term:
            n_ell = max(n_ell, nd - letters)
    ellipsis = [("...", i) for i in range(n_ell)]

    def expand(term: str, nd: int) -> list:
        if "..." not in term:
            return list(term)
        head, _, tail = term.partition("...")
        k = nd - len(head) - len(tail)
        return [*head, *ellipsis[n_ell - k :], *tail]

    labels = [expand(t, nd) for t, nd in zip(terms, ndims)]
    for term, lab in zip(terms, labels):
        if len(set(lab)) != len(lab):
            raise NotImplementedError(f"einsum: repeated index in {term!r} (a diagonal).")
    if arrow:
        out = expand(rhs, len(rhs.replace("...", "")) + n_ell)
    else:
        counts: dict = {}
        for lab in labels:
            for c in lab:
                if isinstance(c, str):
                    counts[c] = counts.get(c, 0) + 1
        out = [*ellipsis, *sorted(c for c, n in counts.items() if n == 1)]
    return labels, out


# subscripts that are a batched matrix product -> transpose_y
_MATMUL_SUBSCRIPTS = {
    "...qd,...kd->...qk": True,
    "...qk,...kd->...qd": False,
    "bhqd,bhkd->bhqk": True,  # the core's explicit attention path (head-major)
    "bhqk,bhkd->bhqd": False,
}


def einsum_by_broadcast(subscripts: str, *operands: paddle.Tensor) -> paddle.Tensor:
    """Einsum as one broadcast product and a sum: each operand is laid out on the union
    of all labels (size-1 axes for the labels it lacks), the operands are multiplied
    (broadcasting) and the labels absent from the output summed.

    Works for any dtype with a multiply and sum kernel; memory is the product of all
    label sizes (the fallback, not the fast path).
    """
    labels, out = _parse_einsum(subscripts, [t.ndim for t in operands])
    order: list = []
    for lab in labels:
        order.extend(c for c in lab if c not in order)
    sizes: dict = {}
    for lab, t in zip(labels, operands):
        for c, d in zip(lab, t.shape):
            d = int(d)
            if d != 1 and sizes.get(c, 1) not in (1, d):
                raise ValueError(
                    f"einsum: index {c!r} has sizes {sizes[c]} and {d} in {subscripts!r}."
                )
            if d != 1 or c not in sizes:
                sizes[c] = d
    product = None
    for lab, t in zip(labels, operands):
        present = [c for c in order if c in lab]
        t = paddle.transpose(t, [lab.index(c) for c in present]) if t.ndim > 1 else t
        own = dict(zip(lab, (int(d) for d in operands[labels.index(lab)].shape)))
        t = paddle.reshape(t, [own.get(c, 1) for c in order])
        product = t if product is None else product * t
    summed = [i for i, c in enumerate(order) if c not in out]
    if summed:
        product = paddle.sum(product, axis=summed)
    remaining = [c for c in order if c in out]
    if len(remaining) > 1:
        product = paddle.transpose(product, [remaining.index(c) for c in out])
    return product

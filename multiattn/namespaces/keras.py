"""How the core reaches its array operations.

Every core function asks `get_ops` for the namespace that holds the operations it
needs, passing the tensors it received. The namespace implements the contract of
`multiattn.namespaces.contract.Namespace`: by default `KerasNamespace` (``keras.ops`` plus the few
helpers the core needs from ``keras.random`` and ``keras.backend``), one small subclass
per Keras backend holding that backend's quirks, chosen once. A framework without a Keras
backend (Paddle) registers a namespace of its own (`register_namespace`); the core then
runs unchanged on that framework's tensors.

`get_ops` finds a tensor's framework from its type (cached per type) and refuses, with a
``TypeError``, tensors of two frameworks in one call, or tensors of a framework other
than the running Keras backend's; NumPy arrays and Python values go with any framework.

Nothing here imports a framework eagerly: a registered namespace is only consulted
when its framework's module is already in ``sys.modules`` (the approach einops uses to
find a tensor's framework).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .._checks import shape_of
from .contract import Namespace, check_namespace

__all__ = [
    "KerasNamespace",
    "caches_owned",
    "framework_of",
    "get_ops",
    "keras_namespace",
    "owned_caches",
    "register_namespace",
]

#: True inside `owned_caches`.
_OWNED_CACHES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "multiattn_owned_caches", default=False
)
#: True inside ``owned_caches(index_checked=True)``.
_CHECKED_INDEX: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "multiattn_checked_cache_index", default=False
)
#: True inside ``owned_caches(values_checked=True)``.
_CHECKED_VALUES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "multiattn_checked_cache_values", default=False
)


@contextlib.contextmanager
def owned_caches(index_checked: bool = False, values_checked: bool = False) -> Iterator[None]:
    """Inside this block, the KV caches handed to the layers' cached calls belong to the
    caller, which needs no gradient through them and reads them only through what the
    layers return: a namespace with ``writes_in_place`` writes the new keys and values
    into them (`multiattn.namespaces.contract.Namespace.write_cache`) instead of making a new cache,
    a copy of the whole cache per call. ``generate`` decodes inside it
    (`multiattn.decoding.GenerationMixin`).

    ``index_checked=True``: the caller has also checked that every cache index it passes
    leaves room for the tokens it writes (``generate`` checks the prompt and
    ``max_new_tokens`` against the context before the first step). The cached calls then
    leave out the range test of a traced index (which turns the outputs of an index out
    of range into NaN and skips its write): a few operations per layer and token, the
    largest share of a recorded torch step's work after the products. An index out of
    range inside such a block gives wrong numbers, not NaN. A Python int index is
    checked (and raises) either way.

    ``values_checked=True``: the caller has also checked that the caches it passes hold
    no NaN or infinity (``generate`` checks them once after the prompt; every later
    write is a key or value that the row writing it attends itself, so a non-finite one
    makes that row NaN whatever the screen does). The cached calls of layers without a
    sliding window then leave out the screen of their keys and values for NaN and
    infinities in masked slots: in code XLA compiles that screen is a conditional that
    takes the caches as operands, and XLA copies every cache for it on every step."""
    for name, flag in (("index_checked", index_checked), ("values_checked", values_checked)):
        if not isinstance(flag, bool):
            raise TypeError(f"owned_caches: `{name}` must be a bool; received {flag!r}.")
    tokens = (
        _OWNED_CACHES.set(True),
        _CHECKED_INDEX.set(index_checked),
        _CHECKED_VALUES.set(values_checked),
    )
    try:
        yield
    finally:
        for var, token in zip((_OWNED_CACHES, _CHECKED_INDEX, _CHECKED_VALUES), tokens):
            var.reset(token)


def caches_owned() -> bool:
    """True inside `owned_caches`."""
    return _OWNED_CACHES.get()


def cache_index_checked() -> bool:
    """True inside ``owned_caches(index_checked=True)``."""
    return _CHECKED_INDEX.get()


def cache_values_checked() -> bool:
    """True inside ``owned_caches(values_checked=True)``."""
    return _CHECKED_VALUES.get()


def cache_scope() -> tuple[bool, bool, bool]:
    """What the enclosing `owned_caches` declares: ``(owned, index_checked,
    values_checked)``; a recording or trace made under one scope holds only for it."""
    return _OWNED_CACHES.get(), _CHECKED_INDEX.get(), _CHECKED_VALUES.get()


def enter_cache_scope(scope: tuple[bool, bool, bool]) -> contextlib.AbstractContextManager:
    """The `owned_caches` block that `cache_scope` returned ``scope`` in (no block for
    ``(False, False, False)``)."""
    owned, index_checked, values_checked = scope
    if not owned:
        return contextlib.nullcontext()
    return owned_caches(index_checked=index_checked, values_checked=values_checked)


def _leads_with(x: Any, batch: int) -> bool:
    """``x`` is an array whose leading size is ``batch`` (sliced by `map_batch`)."""
    shape = getattr(x, "shape", None)
    return bool(shape) and shape[0] == batch


def batch_pieces(
    args: Sequence[Any], chunks: int, split: Callable[[Any, int], Sequence[Any]]
) -> list[tuple]:
    """The arguments of each of ``chunks`` equal slices of the batch (``args[0]``'s
    static leading size): an argument that leads with the batch is cut by ``split(x,
    chunks)`` (the framework's split along axis 0, whose gradient joins the slices'
    gradients), any other is passed whole (`Namespace.map_batch`'s contract).

    A split rather than one slice per piece where gradients flow: differentiated,
    TensorFlow's slice gives each piece a gradient the size of the whole batch, zero
    outside its rows, and sums them (the attention's own forward and backward pass at
    ``(8, 512, 8, 64)`` float32 in 8 slices under ``tf.function`` took nearly twice as
    long with slices as with ``tf.split``; measured: docs/benchmarks.md, 'Measurements
    behind the defaults')."""
    batch = int(args[0].shape[0])
    cut = [split(a, chunks) if _leads_with(a, batch) else [a] * chunks for a in args]
    return list(zip(*cut))


def batch_views(x: Any, chunks: int) -> list:
    """``x`` cut into ``chunks`` equal slices along axis 0 by indexing (a ``split`` for
    `batch_pieces` whose pieces are views where the framework has them)."""
    step = int(x.shape[0]) // chunks
    return [x[i * step : (i + 1) * step] for i in range(chunks)]


def join_pieces(outs: list, concat: Callable[..., Any]) -> Any:
    """The outputs of the slices of `batch_pieces` joined on the batch axis by
    ``concat(list, axis=0)``: one array, or a tuple of them where each slice gave one."""
    if isinstance(outs[0], tuple):
        return tuple(concat(list(parts), axis=0) for parts in zip(*outs))
    return concat(outs, axis=0)


class KerasNamespace(Namespace):
    """The contract on ``keras.ops`` of the running Keras backend.

    Each operation calls its ``keras.ops`` namesake (or, for the helpers ``keras.ops``
    lacks, ``keras.random`` and ``keras.backend``); a name outside the contract raises
    ``AttributeError``. The backends' quirks are methods of the subclasses
    `keras_namespace` picks: ``_JaxNamespace``, ``_TorchNamespace``,
    ``_TensorFlowNamespace``, ``_NumpyNamespace``. This class itself serves any other
    Keras backend (no gradients assumed: `custom_gradient` runs ``forward`` alone).
    """

    has_fused_attention = True
    #: True for every Keras backend; the core relies on it for masked scores on the
    #: attention path (see `multiattn.ops.masking`).
    softmax_exact_zeros = True

    def __init__(self) -> None:
        import keras

        self._keras = keras
        self._ops = keras.ops
        self.backend = keras.backend.backend()

    def __getattr__(self, item: str) -> Any:
        raise AttributeError(
            f"{type(self).__name__} has no attribute {item!r}: the core may use only the "
            "operations and capabilities of the namespace contract "
            "(multiattn.namespaces.contract.Namespace); add an operation there and to every namespace."
        )

    # --- conversion, dtypes and shapes ----------------------------------------------------

    def convert_to_tensor(
        self, x: Any, dtype: Any = None, sparse: bool | None = None, ragged: bool | None = None
    ) -> Any:
        return self._ops.convert_to_tensor(x, dtype=dtype, sparse=sparse, ragged=ragged)

    def convert_to_numpy(self, x: Any) -> Any:
        return self._ops.convert_to_numpy(x)

    def cast(self, x: Any, dtype: Any) -> Any:
        return self._ops.cast(x, dtype)

    def dtype_name(self, x: Any) -> str:
        """The standardised dtype name of ``x`` (``"float32"``, ``"bool"``, ...)."""
        return self._keras.backend.standardize_dtype(x.dtype)

    def is_symbolic(self, x: Any) -> bool:
        """True when ``x`` has no concrete value (Keras symbolic tensor, JAX tracer,
        TensorFlow graph tensor)."""
        if isinstance(x, self._keras.KerasTensor):
            return True
        jax = sys.modules.get("jax")
        if jax is not None and isinstance(x, jax.core.Tracer):
            return True
        tf = sys.modules.get("tensorflow")
        if tf is not None and isinstance(x, tf.Tensor) and not tf.executing_eagerly():
            return True
        return False

    def shape(self, x: Any) -> tuple:
        return self._ops.shape(x)

    def reshape(self, x: Any, newshape: Any) -> Any:
        return self._ops.reshape(x, newshape)

    def expand_dims(self, x: Any, axis: int | Sequence[int]) -> Any:
        return self._ops.expand_dims(x, axis)

    def transpose(self, x: Any, axes: Sequence[int] | None = None) -> Any:
        return self._ops.transpose(x, axes)

    def moveaxis(
        self, x: Any, source: int | Sequence[int], destination: int | Sequence[int]
    ) -> Any:
        return self._ops.moveaxis(x, source, destination)

    def broadcast_to(self, x: Any, shape: Sequence[int]) -> Any:
        return self._ops.broadcast_to(x, shape)

    def concatenate(self, xs: Sequence[Any], axis: int | None = 0) -> Any:
        return self._ops.concatenate(xs, axis=axis)

    def slice(self, inputs: Any, start_indices: Sequence[Any], shape: Sequence[Any]) -> Any:
        return self._ops.slice(inputs, start_indices, shape)

    def take(self, x: Any, indices: Any, axis: int | None = None) -> Any:
        return self._ops.take(x, indices, axis=axis)

    def zeros(self, shape: Sequence[int], dtype: Any = "float32") -> Any:
        return self._keras.ops.zeros(tuple(shape), dtype=dtype)

    def zeros_like(self, x: Any, dtype: Any = None) -> Any:
        return self._ops.zeros_like(x, dtype=dtype)

    def arange(self, start: Any, stop: Any = None, step: Any = None, dtype: Any = None) -> Any:
        return self._ops.arange(start, stop, step, dtype=dtype)

    # --- elementwise ------------------------------------------------------------------------

    def where(self, condition: Any, x1: Any = None, x2: Any = None) -> Any:
        return self._ops.where(condition, x1, x2)

    def abs(self, x: Any) -> Any:
        return self._ops.abs(x)

    def multiply(self, x1: Any, x2: Any) -> Any:
        return self._ops.multiply(x1, x2)

    def exp(self, x: Any) -> Any:
        return self._ops.exp(x)

    def log(self, x: Any) -> Any:
        return self._ops.log(x)

    def tanh(self, x: Any) -> Any:
        return self._ops.tanh(x)

    def erf(self, x: Any) -> Any:
        return self._ops.erf(x)

    def gelu(self, x: Any, approximate: bool = True) -> Any:
        """``keras.ops.gelu``; float64 by the formula (TensorFlow's float64 kernel is off
        by about 3e-11 relative)."""
        if self.dtype_name(x) != "float64":
            return self._ops.gelu(x, approximate=approximate)
        if approximate:
            inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
            return 0.5 * x * (1.0 + self.tanh(inner))
        return 0.5 * x * (1.0 + self.erf(x * (1.0 / math.sqrt(2.0))))

    def silu(self, x: Any) -> Any:
        return self._ops.silu(x)

    def square(self, x: Any) -> Any:
        return self._ops.square(x)

    def rsqrt(self, x: Any) -> Any:
        return self._ops.rsqrt(x)

    def isfinite(self, x: Any) -> Any:
        return self._ops.isfinite(x)

    def equal(self, x1: Any, x2: Any) -> Any:
        return self._ops.equal(x1, x2)

    def not_equal(self, x1: Any, x2: Any) -> Any:
        return self._ops.not_equal(x1, x2)

    def less(self, x1: Any, x2: Any) -> Any:
        return self._ops.less(x1, x2)

    def less_equal(self, x1: Any, x2: Any) -> Any:
        return self._ops.less_equal(x1, x2)

    def greater_equal(self, x1: Any, x2: Any) -> Any:
        return self._ops.greater_equal(x1, x2)

    def logical_and(self, x1: Any, x2: Any) -> Any:
        return self._ops.logical_and(x1, x2)

    def logical_or(self, x1: Any, x2: Any) -> Any:
        return self._ops.logical_or(x1, x2)

    def logical_not(self, x: Any) -> Any:
        return self._ops.logical_not(x)

    def stop_gradient(self, variable: Any) -> Any:
        return self._ops.stop_gradient(variable)

    # --- reductions and softmax -----------------------------------------------------------

    def any(self, x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        return self._ops.any(x, axis=axis, keepdims=keepdims)

    def sum(self, x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        return self._ops.sum(x, axis=axis, keepdims=keepdims)

    def max(self, x: Any, axis: Any = None, keepdims: bool = False, initial: Any = None) -> Any:
        return self._ops.max(x, axis=axis, keepdims=keepdims, initial=initial)

    def softmax(self, x: Any, axis: int | Sequence[int] = -1) -> Any:
        return self._ops.softmax(x, axis=axis)

    # --- contractions -----------------------------------------------------------------------

    def einsum(self, subscripts: str, *operands: Any) -> Any:
        return self._ops.einsum(subscripts, *operands)

    def linear(self, x: Any, kernel: Any, bias: Any = None, contract: int = 1) -> Any:
        """A dense projection: ``x`` ``(..., *k)`` contracted with ``kernel`` ``(*k, *n)``
        over the ``contract`` axes ``k``, plus ``bias`` ``(*n)`` (or None); returns
        ``(..., *n)`` in the dtype of ``x`` and ``kernel`` (which must agree).

        One ``einsum`` with explicit subscripts (TensorFlow's einsum gradient with
        ``...`` broadcasts the operands against each other: a ``(batch, seq, in, out)``
        temporary), then the bias.
        """
        lead = "ABCDEFGH"[: len(x.shape) - contract]
        k, n = "abcdefgh"[:contract], "abcdefgh"[contract : len(kernel.shape)]
        y = self.einsum(f"{lead}{k},{k}{n}->{lead}{n}", x, kernel)
        return y if bias is None else y + bias

    # --- randomness, control flow, gradients --------------------------------------------------

    def dropout(self, x: Any, rate: float, seed: Any = None) -> Any:
        """Inverted dropout of ``x`` with drop probability ``rate``."""
        return self._keras.random.dropout(x, rate, seed=seed)

    def cond(self, pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        return self._ops.cond(pred, true_fn, false_fn)

    def fori_loop(self, lower: Any, upper: Any, body_fun: Callable, init_val: Any) -> Any:
        return self._ops.fori_loop(lower, upper, body_fun, init_val)

    def custom_gradient(
        self,
        forward: Callable[..., tuple[Any, tuple]],
        backward: Callable[[tuple, Any], tuple],
        inputs: tuple,
    ) -> Any:
        """``forward(*inputs)[0]``, differentiated with ``backward`` instead of through
        the operations of ``forward``.

        ``forward(*inputs)`` returns ``(output, saved)``, ``saved`` a tuple of tensors
        (or None) for the backward pass; ``backward(saved, d_output)`` returns one
        gradient per input (None for one that takes none, such as a bool mask).
        ``forward`` runs once; nothing it computes is kept for
        differentiation except ``saved``. Tensors ``forward`` and ``backward`` close over
        get no gradient. Differentiable once: ``backward`` treats ``saved`` as constants
        (PyTorch raises on a second differentiation). Backends: ``jax.custom_vjp``, a
        ``torch.autograd.Function``, ``tf.custom_gradient``; on numpy (no gradients)
        ``forward`` alone.
        """
        return forward(*inputs)[0]

    def fused_attention(
        self, query: Any, key: Any, value: Any, mask: Any, scale: float, is_causal: bool = False
    ) -> Any:
        """``keras.ops.dot_product_attention`` on ``(batch, seq, heads, dim)`` arrays
        (``is_causal``: top-left aligned, used by the core only when queries and keys are
        equally long; ``mask``: bool, True = may attend, rank 4, no row fully masked)."""
        return self._ops.dot_product_attention(
            query, key, value, mask=mask, scale=scale, is_causal=is_causal
        )


class _NumpyNamespace(KerasNamespace):
    """Keras' numpy backend: float64 contractions keep float64; caches written in place."""

    writes_in_place = True

    def tanh(self, x: Any) -> Any:
        """``keras.ops.tanh`` that keeps float64."""
        if self.dtype_name(x) == "float64":
            import numpy as np

            return np.tanh(x)
        return self._ops.tanh(x)

    def silu(self, x: Any) -> Any:
        """``keras.ops.silu``, except that float64 stays float64: ``x * exp(-log(1 +
        exp(-x)))`` (``logaddexp``: no overflow, no cancellation)."""
        if self.dtype_name(x) != "float64":
            return self._ops.silu(x)
        import numpy as np

        x = np.asarray(x)
        return x * np.exp(-np.logaddexp(0.0, -x))

    def write_cache(self, cache: Any, new: Any, index: Any) -> Any:
        start = int(index)
        cache[:, :, start : start + new.shape[2]] = new
        return cache

    def einsum(self, subscripts: str, *operands: Any) -> Any:
        """``keras.ops.einsum``, except that float64 operands go to NumPy's own einsum:
        Keras promotes float64 to float32 here (its type lattice follows JAX's default of
        32-bit floats)."""
        if all(self.dtype_name(o) == "float64" for o in operands):
            import numpy as np

            return np.einsum(subscripts, *(self._ops.convert_to_tensor(o) for o in operands))
        return self._ops.einsum(subscripts, *operands)


def cache_kept_axes(shape: Sequence[Any]) -> tuple[int, ...]:
    """The axes of a cache shape ``(B, H_kv, L, D)`` that stay when its batch and head
    axes are dropped where they are 1: what `_xla_cache_write` updates and what
    ``generate``'s compiled loop carries (`multiattn.decoding.compiled`)."""
    return tuple(i for i, n in enumerate(shape) if i > 1 or n != 1)


def _xla_cache_write(keras_ops: Any, cache: Any, new: Any, index: Any) -> Any:
    """`Namespace.write_cache` where XLA compiles the write (jax, TensorFlow): a dynamic
    update slice (``keras.ops.slice_update``), which XLA does in place in a loop that
    carries the cache. ``keras_ops`` is Keras' ``ops`` module of the backend (the
    namespace's own operations, not the contract's).

    At batch one it stays in place only where nothing else takes the cache in another
    shape: ``generate``'s compiled loop carries its caches without their unit axes
    (`multiattn.decoding.compiled`) and, its caches checked, runs no conditional screen
    over them. A select against the positions, which rewrites the whole cache, was the
    faster write while both were in place (GPT-2 shape, prompt 128); without them the
    dynamic update slice is (measured: docs/benchmarks.md, 'Measurements behind the
    defaults').

    The update is made on the cache with those unit axes dropped as well (reshapes, which
    XLA compiles to bitcasts that cancel the loop's own): TensorFlow's XLA keeps an update
    in place only when it is the last operation of its fusion, and an update of the
    four-axis view ends in a bitcast, so it copied every cache twice per step (GPT-2
    shape, prompt 512, batch 1: slower per token than with the unit axes dropped; jax
    unchanged; measured: docs/benchmarks.md, 'Measurements behind the defaults')."""
    zero = 0 if isinstance(index, int) else index * 0  # starts of one dtype (JAX x64)
    shape, kept = tuple(cache.shape), cache_kept_axes(cache.shape)
    if len(kept) == len(shape):
        return keras_ops.slice_update(cache, (zero, zero, index, zero), new)
    starts = tuple((zero, zero, index, zero)[i] for i in kept)
    cache, new = (keras_ops.reshape(t, tuple(t.shape[i] for i in kept)) for t in (cache, new))
    return keras_ops.reshape(keras_ops.slice_update(cache, starts, new), shape)


#: The guards of the recording under way (see `torch_trace_guards`), or None.
_TRACE_GUARDS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "multiattn_torch_trace_guards", default=None
)


@contextlib.contextmanager
def torch_trace_guards() -> Iterator[list]:
    """While ``torch.jit.trace`` records inside this block, the torch namespace's ``cond``
    records the branch its predicate takes and appends ``(predicate tensor, taken)`` to
    the yielded list: a replay of the recording is valid for inputs whose predicates
    take the same branches (the caller checks them, `multiattn.decoding.torch_step`)."""
    guards: list = []
    token = _TRACE_GUARDS.set(guards)
    try:
        yield guards
    finally:
        _TRACE_GUARDS.reset(token)


class _TorchNamespace(KerasNamespace):
    """Keras' torch backend: float64 einsum, the dense projections as one ``addmm``,
    PyTorch's SDPA called directly, and ``custom_gradient`` as an autograd Function."""

    fused_attention_streams = True
    writes_in_place = True

    def write_cache(self, cache: Any, new: Any, index: Any) -> Any:
        """An in-place copy into ``cache``: a slice for a Python int ``index``, an
        ``index_copy_`` for a tensor one (which ``torch.jit.trace`` records as a write at
        the position the replay passes)."""
        import torch

        tokens = new.shape[2]
        if isinstance(index, torch.Tensor):
            rows = index.reshape(()).to(torch.int64) + torch.arange(tokens, device=cache.device)
            return cache.index_copy_(2, rows, new)
        cache.narrow(2, int(index), tokens).copy_(new)
        return cache

    @property
    def fused_attention_groups(self) -> bool:  # type: ignore[override]
        """PyTorch's SDPA takes grouped key/value heads (``enable_gqa``) from 2.5 on; its
        CPU flash kernel keeps them grouped."""
        import torch

        major, minor = (int(p) for p in torch.__version__.split(".")[:2])
        return (major, minor) >= (2, 5)

    def is_symbolic(self, x: Any) -> bool:
        """`KerasNamespace.is_symbolic`, and also True for tensors on PyTorch's ``meta``
        device (Keras' torch backend infers output shapes by running a layer's ``call``
        on them, and they hold no values: anything made from one must not be kept) and
        for every tensor while ``torch.jit.trace`` records (their values are the example
        inputs', not those the recording will be replayed on)."""
        if getattr(getattr(x, "device", None), "type", None) == "meta":
            return True
        import torch

        return torch.jit.is_tracing() or super().is_symbolic(x)

    def einsum(self, subscripts: str, *operands: Any) -> Any:
        """``keras.ops.einsum``, except that float64 operands go to ``torch.einsum``
        (Keras promotes float64 to float32 here)."""
        if all(self.dtype_name(o) == "float64" for o in operands):
            import torch

            return torch.einsum(subscripts, *(self._ops.convert_to_tensor(o) for o in operands))
        return self._ops.einsum(subscripts, *operands)

    def linear(self, x: Any, kernel: Any, bias: Any = None, contract: int = 1) -> Any:
        """`KerasNamespace.linear` as one ``(N, K) @ (K, M)`` matrix product with the bias
        added inside it (``torch.addmm``) for float32, bfloat16 and float16 CPU tensors of
        one dtype (the einsum would copy a half-precision kernel on every call); for
        float32 a tuner in force (`multiattn.config.tuner`) may run it on oneDNN instead
        (`multiattn.tuning.torch_linear`)."""
        import torch

        tensors = [t for t in (x, kernel, bias) if t is not None]
        if not (
            all(isinstance(t, torch.Tensor) for t in tensors)
            and all(t.device.type == "cpu" and t.dtype == x.dtype for t in tensors)
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.numel() > 0
        ):
            return super().linear(x, kernel, bias, contract)
        from .. import config

        shape = tuple(kernel.shape)
        k, n = math.prod(shape[:contract]), math.prod(shape[contract:])
        a, b = x.reshape(-1, k), kernel.reshape(k, n)
        c = None if bias is None else bias.reshape(n)
        tuner = config.tuner() if x.dtype == torch.float32 else None
        y = tuner.linear(a, b, c) if tuner is not None else None
        if y is None:
            y = torch.mm(a, b) if c is None else torch.addmm(c, a, b)
        return y.reshape(*x.shape[: x.dim() - contract], *shape[contract:])

    def cond(self, pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        """``keras.ops.cond``; a concrete ``pred`` picks its branch here, as Keras' torch
        backend does, without the cost of building a Keras operation on every call.

        While ``torch.jit.trace`` records the call, a Python branch would be recorded as
        taken for every later input. Inside `torch_trace_guards` (how
        `multiattn.decoding.torch_step` records), the branch taken is recorded and ``pred``
        joins the guards, which the replay checks; elsewhere both branches run and each
        output tensor is selected by ``pred`` (``torch.where``), which the contract
        allows (the branches are pure and return tensors of the same structure and
        shapes)."""
        import torch

        if torch.jit.is_tracing() and isinstance(pred, torch.Tensor):
            guards = _TRACE_GUARDS.get()
            if guards is not None:
                taken = bool(pred)
                guards.append((pred, taken))
                return true_fn() if taken else false_fn()
            return self._keras.tree.map_structure(
                lambda a, b: torch.where(pred, a, b), true_fn(), false_fn()
            )
        if self.is_symbolic(pred):
            return self._ops.cond(pred, true_fn, false_fn)
        return true_fn() if bool(pred) else false_fn()

    def custom_gradient(
        self,
        forward: Callable[..., tuple[Any, tuple]],
        backward: Callable[[tuple, Any], tuple],
        inputs: tuple,
    ) -> Any:
        return _torch_custom_gradient().apply(forward, backward, *inputs)

    def fused_attention(
        self, query: Any, key: Any, value: Any, mask: Any, scale: float, is_causal: bool = False
    ) -> Any:
        """PyTorch's ``scaled_dot_product_attention`` on ``(batch, heads, seq, dim)``
        views of the inputs with the bool mask as it is: ``keras.ops.dot_product_attention``
        copies the three inputs to contiguous tensors first and turns the mask into an
        additive float mask. Fewer key/value heads than query heads go to the kernel as
        they are (``enable_gqa``)."""
        import torch

        grouped = {"enable_gqa": True} if key.shape[2] != query.shape[2] else {}
        out = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (query, key, value)),
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            **grouped,
        )
        return out.transpose(1, 2)


class _JaxNamespace(KerasNamespace):
    """Keras' jax backend: float64 ``tanh``, eager ``cond`` in Python,
    ``custom_gradient`` as ``jax.custom_vjp``, fused attention only off the CPU, caches
    written by a dynamic update slice."""

    writes_in_place = True
    #: `map_batch` is ``jax.lax.map`` over the slices (rematerialised unless the slice
    #: has its own backward pass).
    maps_batch = True

    def write_cache(self, cache: Any, new: Any, index: Any) -> Any:
        """`_xla_cache_write`: a new array eagerly, an update of the buffer itself under
        ``jax.jit`` where ``cache`` is a donated argument."""
        return _xla_cache_write(self._ops, cache, new, index)

    def xla_device(self, x: Any) -> str | None:
        """jax's default backend (``"cpu"``, ``"gpu"``, ``"tpu"``): XLA compiles every
        jax computation, eager operations included."""
        import jax

        return jax.default_backend()

    def linear(self, x: Any, kernel: Any, bias: Any = None, contract: int = 1) -> Any:
        """`KerasNamespace.linear`, except for float16/bfloat16 on a CPU: one
        ``jnp.einsum`` that accumulates in float32 (``preferred_element_type``) and rounds
        once to the operands' dtype, as torch's half-precision products do; a single row
        is padded with a zero row and sliced back. XLA's CPU half-precision dot without
        these took 169-209 ms for a (1, 896) @ (896, 151936) bfloat16 product against
        16-20 ms with them (float32: 17 ms) on an AVX-512 EPYC (measured with jax.jit, median of 7).
        Never taken on an accelerator."""
        import jax

        dtype = self.dtype_name(x)
        half = dtype in ("float16", "bfloat16") and self.dtype_name(kernel) == dtype
        if not half or jax.default_backend() != "cpu":
            return super().linear(x, kernel, bias, contract)
        import jax.numpy as jnp

        lead_shape = tuple(x.shape[: len(x.shape) - contract])
        flat = x.reshape((-1, *x.shape[len(lead_shape) :]))
        one_row = flat.shape[0] == 1
        if one_row:
            flat = jnp.concatenate([flat, jnp.zeros_like(flat)], axis=0)
        k, n = "abcdefgh"[:contract], "abcdefgh"[contract : len(kernel.shape)]
        kernel = self._ops.convert_to_tensor(kernel)
        y = jnp.einsum(f"A{k},{k}{n}->A{n}", flat, kernel, preferred_element_type=jnp.float32)
        y = (y[:1] if one_row else y).astype(x.dtype)
        y = y.reshape((*lead_shape, *y.shape[1:]))
        return y if bias is None else y + bias

    def tanh(self, x: Any) -> Any:
        """``keras.ops.tanh`` that keeps float64 (Keras' jax backend returns float32)."""
        if self.dtype_name(x) == "float64":
            import jax.numpy as jnp

            return jnp.tanh(x)
        return self._ops.tanh(x)

    def cond(self, pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        """``keras.ops.cond``, except that a concrete ``pred`` (not under ``jax.jit``)
        picks its branch in Python: ``jax.lax.cond`` would compile both branches on every
        eager call."""
        if not self.is_symbolic(pred):
            return true_fn() if bool(pred) else false_fn()
        return self._ops.cond(pred, true_fn, false_fn)

    def custom_gradient(
        self,
        forward: Callable[..., tuple[Any, tuple]],
        backward: Callable[[tuple, Any], tuple],
        inputs: tuple,
    ) -> Any:
        import jax

        @jax.custom_vjp
        def call(*args):
            return forward(*args)[0]

        call.defvjp(forward, lambda saved, grad: tuple(backward(saved, grad)))
        return call(*inputs)

    def map_batch(
        self, fn: Callable[..., Any], args: Sequence[Any], chunks: int, remat: bool = True
    ) -> Any:
        """`Namespace.map_batch` as ``jax.lax.map``: one compiled loop over the slices,
        whose buffers each slice reuses. With ``remat`` the slice's function is
        rematerialised (``jax.checkpoint``): differentiated, the backward loop recomputes
        each slice's scores rather than keeping every slice's, so it too holds one
        slice's matrices at a time (forward and backward of the attention alone at ``(8,
        512, 8, 64)`` float32 in 4 slices took well under the time of one piece;
        measured: docs/benchmarks.md, 'Measurements behind the defaults')."""
        import jax

        batch = int(args[0].shape[0])
        sliced = tuple(_leads_with(a, batch) for a in args)

        def body(parts: tuple) -> Any:
            it = iter(parts)
            return fn(*(next(it) if s else a for a, s in zip(args, sliced)))

        if remat:
            body = jax.checkpoint(body)

        parts = tuple(
            a.reshape((chunks, batch // chunks, *a.shape[1:])) for a, s in zip(args, sliced) if s
        )
        out = jax.lax.map(body, parts)
        joined = [o.reshape((batch, *o.shape[2:])) for o in jax.tree_util.tree_leaves(out)]
        return tuple(joined) if isinstance(out, tuple) else joined[0]

    @property
    def fused_attention_pays(self) -> bool:  # type: ignore[override]
        """False on CPU: ``jax.nn.dot_product_attention`` (XLA) was slower forward and
        forward+backward than the explicit path on ``(8, 512, 8, 64)`` float32 under
        ``jax.jit`` (measured: docs/benchmarks.md, 'Measurements behind the defaults').
        True on GPU/TPU."""
        import jax

        return jax.default_backend() != "cpu"


class _TensorFlowNamespace(KerasNamespace):
    """Keras' tensorflow backend: ``custom_gradient`` as ``tf.custom_gradient``; the
    fused attention is not taken where it cannot be timed."""

    #: Keras' ``dot_product_attention`` on TensorFlow is an explicit path itself, which
    #: scales the whole score matrix and contracts in ``(B, T, H, D)`` layout; the core's
    #: explicit path (head-major, queries scaled) was 6% to 13% faster forward and
    #: forward+backward in multi-head self-attention under ``tf.function`` (batch 8,
    #: length 512, width 512, 8 heads, float32).
    fused_attention_pays = False
    #: `write_cache` is XLA's dynamic update slice: outside XLA a new tensor (a copy of
    #: the cache, as the select write), inside the loop `generate` compiles with XLA an
    #: update of the loop's buffer itself.
    writes_in_place = True
    #: `map_batch` is the slices written out one after the other in the graph: no data
    #: dependence joins them, so TensorFlow's executor runs them side by side on its
    #: inter-op threads, each on a score matrix ``chunks`` times smaller. The explicit
    #: attention of ``(8, 512, 8, 64)`` float32 under ``tf.function`` on an AMD EPYC
    #: with AVX2 only was faster with every doubling of the slices up to 8, where a
    #: ``tf.map_fn`` loop, which runs the slices in turn, had gained 6% (measured:
    #: docs/benchmarks.md, 'Measurements behind the defaults'). Whether it pays is timed
    #: (`multiattn.tuning.attention_chunks`).
    maps_batch = True

    def write_cache(self, cache: Any, new: Any, index: Any) -> Any:
        """`_xla_cache_write`: in place where XLA compiles it into a loop that carries
        ``cache``."""
        return _xla_cache_write(self._ops, cache, new, index)

    def xla_device(self, x: Any) -> str | None:
        """Inside a graph XLA compiles (``tf.function(jit_compile=True)``, its loops
        included) while ``x`` is a graph tensor: ``"gpu"`` where TensorFlow sees one, else
        ``"cpu"``; None elsewhere (eager operations, graphs TensorFlow runs itself)."""
        if not self.is_symbolic(x) or not _tf_in_xla():
            return None
        import tensorflow as tf

        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"

    def map_batch(
        self, fn: Callable[..., Any], args: Sequence[Any], chunks: int, remat: bool = True
    ) -> Any:
        """`Namespace.map_batch` as ``chunks`` calls of ``fn`` on the pieces of a
        ``tf.split`` of the batch, joined with one ``concat`` per output (see
        `maps_batch`); gradients are those of the slices, through the split and the
        ``concat``. ``remat`` changes nothing: each call keeps what ``tf.GradientTape``
        keeps for it."""
        import tensorflow as tf

        pieces = batch_pieces(args, chunks, tf.split)
        return join_pieces([fn(*piece) for piece in pieces], tf.concat)

    def linear(self, x: Any, kernel: Any, bias: Any = None, contract: int = 1) -> Any:
        """`KerasNamespace.linear` as one matrix product and a ``BiasAdd``
        (`_matrix_product`), except for a single row over several axes (``x``'s leading
        sizes all 1, ``contract > 1``: the output projection of attention in a decoding
        step at batch 1): there the last axis is contracted with the others as batch
        axes, then those are summed.

        XLA in TensorFlow fuses the reshape of the kernel into a matrix-vector product and
        then emits the product as a plain loop: dozens of times slower for ``(1, 8, 32)``
        against an ``(8, 32, 256)`` kernel, and half the time of a Llama step (hidden
        256, 4 layers) at batch 1 (measured: docs/benchmarks.md, 'Measurements behind
        the defaults')."""
        lead = shape_of(x)[: len(x.shape) - contract]
        if contract == 1 or any(n != 1 for n in lead):
            return self._matrix_product(x, kernel, bias, contract)
        a, k = "ABCDEFGH"[: len(lead)], "abcdefgh"[:contract]
        n = "abcdefgh"[contract : len(kernel.shape)]
        parts = self.einsum(f"{a}{k},{k}{n}->{a}{k[:-1]}{n}", x, kernel)
        y = self._ops.sum(parts, axis=tuple(range(len(lead), len(lead) + contract - 1)))
        return y if bias is None else y + bias

    @staticmethod
    def _matrix_product(x: Any, kernel: Any, bias: Any, contract: int) -> Any:
        """`linear` as one ``(N, K) @ (K, M)`` ``MatMul`` and a ``BiasAdd``, which
        TensorFlow's graph optimizer fuses into one kernel, instead of ``einsum`` and an
        addition. The four projections of multi-head self-attention under ``tf.function``
        (batch 8, length 512, width 512, 8 heads, float32) ran faster so, forward and
        forward and backward (measured: docs/benchmarks.md, 'Measurements behind the
        defaults')."""
        import tensorflow as tf

        out_shape = list(kernel.shape[contract:])
        k, n = math.prod(kernel.shape[:contract]), math.prod(out_shape)
        y = tf.matmul(tf.reshape(x, (-1, k)), tf.reshape(kernel, (k, n)))
        if bias is not None:
            y = tf.nn.bias_add(y, tf.reshape(bias, (n,)))
        lead = shape_of(x)[: len(x.shape) - contract]
        if any(s is None for s in lead):
            return tf.reshape(y, tf.concat([tf.shape(x)[: len(lead)], out_shape], 0))
        return tf.reshape(y, (*lead, *out_shape))

    def custom_gradient(
        self,
        forward: Callable[..., tuple[Any, tuple]],
        backward: Callable[[tuple, Any], tuple],
        inputs: tuple,
    ) -> Any:
        import tensorflow as tf

        @tf.custom_gradient
        def call(*args):
            out, saved = forward(*args)
            return out, lambda grad: list(backward(saved, grad))

        # Variables are read here, so that the function sees tensors only.
        return call(*(tf.convert_to_tensor(t) for t in inputs))


_KERAS_NAMESPACES: dict[str, type[KerasNamespace]] = {
    "jax": _JaxNamespace,
    "numpy": _NumpyNamespace,
    "tensorflow": _TensorFlowNamespace,
    "torch": _TorchNamespace,
}


def _tf_in_xla() -> bool:
    """Whether the TensorFlow graph being built is compiled by XLA."""
    try:
        from tensorflow.python.framework import ops as tf_ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - TensorFlow's layout changed
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()))


def keras_namespace() -> KerasNamespace:
    """The namespace of the running Keras backend (built once, then cached)."""
    return _instance("keras", _keras_factory)


def _keras_factory() -> KerasNamespace:
    import keras

    return _KERAS_NAMESPACES.get(keras.backend.backend(), KerasNamespace)()


@dataclass(frozen=True)
class _Registration:
    module: str
    is_tensor: Callable[[Any], bool]
    factory: Callable[[], Any]


_REGISTRY: list[_Registration] = []
_INSTANCES: dict[str, Any] = {}
#: tensor type -> its framework (None: NumPy and Python values, which go with any)
_FRAMEWORK_OF_TYPE: dict[type, str | None] = {}
#: top-level module of a type (or of a base class) -> framework
_FRAMEWORK_MODULES = {
    "jax": "jax",
    "jaxlib": "jax",
    "keras": "keras",
    "paddle": "paddle",
    "tensorflow": "tensorflow",
    "torch": "torch",
}
#: the frameworks Keras backends run on (their tensors need that backend)
_KERAS_FRAMEWORKS = ("jax", "tensorflow", "torch")


def register_namespace(
    module: str, is_tensor: Callable[[Any], bool], factory: Callable[[], Any]
) -> None:
    """Register an ops namespace for tensors of the framework ``module``.

    Args:
        module: top-level module name of the framework (``"paddle"``). The namespace is
            considered only while this module is imported.
        is_tensor: returns True for a tensor of that framework (asked once per type).
        factory: builds the namespace object (called once, lazily); what it returns must
            implement `multiattn.namespaces.contract.Namespace` (checked then: ``TypeError``
            naming what is missing).
    """
    if not isinstance(module, str) or not module or "." in module:
        raise ValueError(
            f"register_namespace: `module` must be a top-level module name; received {module!r}."
        )
    for name, fn in (("is_tensor", is_tensor), ("factory", factory)):
        if not callable(fn):
            raise TypeError(f"register_namespace: `{name}` must be callable; received {fn!r}.")
    _REGISTRY.append(_Registration(module, is_tensor, factory))
    _FRAMEWORK_OF_TYPE.clear()


def _instance(key: str, factory: Callable[[], Any]) -> Any:
    ns = _INSTANCES.get(key)
    if ns is None:
        ns = factory()
        check_namespace(ns)
        _INSTANCES[key] = ns
    return ns


def framework_of(x: Any) -> str | None:
    """The framework of the tensor ``x``: a registered framework's module name
    (``"paddle"``), ``"jax"``, ``"torch"``, ``"tensorflow"``, ``"keras"`` (Keras symbolic
    tensors and variables), or None for NumPy arrays, Python values and anything else,
    which a namespace converts. Decided once per type."""
    tp = type(x)
    try:
        return _FRAMEWORK_OF_TYPE[tp]
    except KeyError:
        pass
    found = None
    for reg in _REGISTRY:
        if reg.module in sys.modules and reg.is_tensor(x):
            found = reg.module
            break
    else:
        for cls in tp.__mro__:
            found = _FRAMEWORK_MODULES.get(cls.__module__.partition(".")[0])
            if found is not None:
                break
    _FRAMEWORK_OF_TYPE[tp] = found
    return found


def _type_name(x: Any) -> str:
    tp = type(x)
    return f"{tp.__module__}.{tp.__qualname__}"


def get_ops(*tensors: Any, names: tuple[str, ...] | None = None, where: str = "multiattn") -> Any:
    """Return the ops namespace for ``tensors`` (``None`` entries are ignored).

    A registered framework's namespace when the tensors are that framework's, else the
    namespace of the running Keras backend (`keras_namespace`). NumPy arrays and Python
    values go with either. ``names`` (one per tensor) and ``where`` (the public function)
    name the arguments in the errors.

    Raises:
        TypeError: tensors of two frameworks in one call (a Paddle tensor with a Keras
            variable, a torch tensor with a jax array), or a tensor of a framework other
            than the running Keras backend's (a torch tensor while Keras runs on jax).
    """

    def label(i: int) -> str:
        return f"`{names[i]}`" if names is not None and i < len(names) else f"argument {i}"

    framework, first = None, None
    for i, t in enumerate(tensors):
        if t is None:
            continue
        found = framework_of(t)
        if found is None or found == framework:
            continue
        if framework is None:
            framework, first = found, i
        elif {framework, found} <= {"keras", *_KERAS_FRAMEWORKS} and "keras" in (
            framework,
            found,
        ):
            framework, first = (found, i) if framework == "keras" else (framework, first)
        else:
            raise TypeError(
                f"{where}: {label(i)} is a {_type_name(t)} ({found}) but {label(first)} is a "
                f"{_type_name(tensors[first])} ({framework}); one call takes tensors of one "
                "framework (NumPy arrays and Python values go with any)."
            )
    if framework is None or framework in ("keras", *_KERAS_FRAMEWORKS):
        ns = keras_namespace()
        if framework in _KERAS_FRAMEWORKS and framework != _framework_of_backend(ns.backend):
            raise TypeError(
                f"{where}: {label(first)} is a {_type_name(tensors[first])} ({framework}), but "
                f"Keras runs on its {ns.backend!r} backend; expected {ns.backend} tensors, "
                "Keras tensors or variables, NumPy arrays or Python values (set KERAS_BACKEND "
                f"to {framework!r} in a new process to compute on {framework})."
            )
        return ns
    for reg in _REGISTRY:
        if reg.module == framework:
            return _instance(reg.module, reg.factory)
    raise AssertionError(framework)  # framework_of names registered modules only


def _framework_of_backend(backend: str) -> str | None:
    """The framework whose tensors Keras' ``backend`` computes on (None: numpy and any
    backend whose tensors are NumPy arrays or its own)."""
    return backend if backend in _KERAS_FRAMEWORKS else None


@functools.cache
def _torch_custom_gradient() -> Any:
    """The ``torch.autograd.Function`` behind `KerasNamespace.custom_gradient` on torch
    (built on first use: this module imports no framework)."""
    import torch

    class CustomGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, forward, backward, *inputs):
            out, saved = forward(*inputs)
            ctx.backward_fn = backward
            ctx.save_for_backward(*saved)
            return out

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad):
            return (None, None, *ctx.backward_fn(ctx.saved_tensors, grad))

    return CustomGradient

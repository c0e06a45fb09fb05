"""The namespace contract: every operation and capability the core may use.

The core (`multiattn.ops`, the layers, `multiattn.distributed`) computes only through
the object `multiattn.namespaces.keras.get_ops` returns. `Namespace` lists what that object
holds: the operations, with the shapes and dtype rules the core relies on, and the
capabilities, attributes the core reads instead of probing with ``hasattr``. One
implementation per framework: `multiattn.namespaces.keras.KerasNamespace` (one small subclass
per Keras backend) and `multiattn.namespaces.paddle.PaddleNamespace`.

The operations have ``keras.ops``' names, signatures and semantics (dtype promotion
included), except where a docstring here says otherwise. Every operation accepts the
namespace's own tensors, NumPy arrays and Python scalars or lists, and returns the
namespace's tensors. "Floating" means float16, bfloat16, float32 or float64.

An implementation subclasses `Namespace` (which makes a missing operation a
``TypeError`` when it is instantiated) and inherits the capability defaults it does not
override; `check_namespace` verifies one (members and signatures), and
``tests/test_contract.py`` checks that every ``ops.<name>`` the library uses is declared
here.
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["CAPABILITIES", "OPERATIONS", "Namespace", "check_namespace", "signature_mismatches"]


class Namespace(Protocol):
    """What the core may use of an ops namespace (see the module docstring)."""

    # --- capabilities ----------------------------------------------------------------------

    #: The framework that computes: ``"jax"``, ``"torch"``, ``"tensorflow"``, ``"numpy"``
    #: (the Keras backends) or ``"paddle"``; it names decisions in `multiattn.tuning`.
    backend: str = ""
    #: `fused_attention` is implemented. False: the core never calls it and always takes
    #: its explicit or blockwise attention path.
    has_fused_attention: bool = False
    #: `fused_attention` never forms the score matrix when its mask is None or broadcast
    #: over the queries (PyTorch's flash kernel): the core then prefers it to its blockwise
    #: path for long sequences.
    fused_attention_streams: bool = False
    #: `fused_attention` takes fewer key/value heads than query heads (dividing them;
    #: query head ``h`` reads key/value head ``h // (H / H_kv)``) without repeating them
    #: in memory (PyTorch's ``enable_gqa``). False: the core repeats the key/value heads
    #: before it calls `fused_attention`, and only then.
    fused_attention_groups: bool = False
    #: Take `fused_attention` where `multiattn.tuning` cannot time it (symbolic tensors,
    #: ``torch.compile``).
    fused_attention_pays: bool = True
    #: `softmax` gives exactly 0 to a score ``3.4e38`` below its row's maximum. False: the
    #: core zeroes masked weights with a second `where` (`multiattn.ops.masking`).
    softmax_exact_zeros: bool = False
    #: `write_cache` is implemented: inside `multiattn.namespaces.keras.owned_caches` the core
    #: writes new keys and values into a KV cache with it, at a cost that follows the
    #: tokens written. False: every write makes a new cache (a copy of the whole cache).
    writes_in_place: bool = False
    #: `map_batch` is implemented: the core's explicit attention path can run over
    #: slices of its batch in turn (`multiattn.ops.plan.default_chunks`, or measured by
    #: `multiattn.tuning.attention_chunks` under autotune). False: it runs in one piece.
    maps_batch: bool = False
    #: With `maps_batch`: the slices pay in eager calls too (they run side by side, not
    #: only in a compiled loop), so under autotune `multiattn.tuning.attention_chunks`
    #: is timed on eager calls as on compiled ones. False: eager calls run in one piece.
    maps_batch_eagerly: bool = False
    #: Elementwise arithmetic broadcasts an operand over inner axes far more slowly than
    #: it combines operands of one shape (Paddle's CPU kernels). True: where the core
    #: reuses such an operand (rotary's cos/sin tables over heads) it broadcasts it to
    #: the full shape once first (`broadcast_to`).
    broadcasts_slowly: bool = False

    # --- conversion, dtypes and shapes ----------------------------------------------------

    @abstractmethod
    def convert_to_tensor(
        self, x: Any, dtype: Any = None, sparse: bool | None = None, ragged: bool | None = None
    ) -> Any:
        """``x`` as a tensor of this namespace; NumPy dtypes are kept, Python floats give
        float32 and ints int32."""

    @abstractmethod
    def convert_to_numpy(self, x: Any) -> Any:
        """``x`` as a NumPy array (bfloat16 as ``ml_dtypes.bfloat16``)."""

    @abstractmethod
    def cast(self, x: Any, dtype: Any) -> Any:
        """``x`` in ``dtype`` (float to int truncates toward zero; non-zero to True)."""

    @abstractmethod
    def dtype_name(self, x: Any) -> str:
        """The standard dtype name of ``x``: ``"float32"``, ``"bool"``, ``"int64"``..."""

    @abstractmethod
    def is_symbolic(self, x: Any) -> bool:
        """True when ``x`` has no concrete value (Keras symbolic tensor, JAX tracer,
        TensorFlow graph tensor, Paddle static-graph value)."""

    def xla_device(self, x: Any) -> str | None:
        """The device kind XLA compiles the computation ``x`` belongs to for (``"cpu"``,
        ``"gpu"``, ``"tpu"``), or None where XLA does not compile it: a static fact the
        attention planner's defaults read (`multiattn.ops.plan.default_chunks`). This
        default: None."""
        return None

    @abstractmethod
    def shape(self, x: Any) -> tuple:
        """The shape of ``x``: Python ints, or symbolic sizes under a trace."""

    @abstractmethod
    def reshape(self, x: Any, newshape: Any) -> Any:
        """``x`` with shape ``newshape`` (one entry may be -1)."""

    @abstractmethod
    def expand_dims(self, x: Any, axis: int | Sequence[int]) -> Any:
        """``x`` with size-1 axes inserted at ``axis``."""

    @abstractmethod
    def transpose(self, x: Any, axes: Sequence[int] | None = None) -> Any:
        """``x`` with its axes permuted (reversed when ``axes`` is None)."""

    @abstractmethod
    def moveaxis(
        self, x: Any, source: int | Sequence[int], destination: int | Sequence[int]
    ) -> Any:
        """``x`` with axes ``source`` moved to ``destination``."""

    @abstractmethod
    def broadcast_to(self, x: Any, shape: Sequence[int]) -> Any:
        """``x`` broadcast to ``shape`` (NumPy rules), dtype kept."""

    @abstractmethod
    def concatenate(self, xs: Sequence[Any], axis: int | None = 0) -> Any:
        """``xs`` joined along ``axis``, in the dtype they promote to."""

    @abstractmethod
    def slice(self, inputs: Any, start_indices: Sequence[Any], shape: Sequence[Any]) -> Any:
        """The block of ``inputs`` of ``shape`` starting at ``start_indices`` (the starts
        may be scalar tensors, as inside `fori_loop`)."""

    @abstractmethod
    def take(self, x: Any, indices: Any, axis: int | None = None) -> Any:
        """Entries of ``x`` at integer ``indices`` along ``axis`` (of the flattened ``x``
        when None); shape ``x.shape[:axis] + indices.shape + x.shape[axis + 1:]``."""

    @abstractmethod
    def zeros(self, shape: Sequence[int], dtype: Any = "float32") -> Any:
        """Zeros of ``shape`` (static ints) in ``dtype``, on the framework's default device."""

    @abstractmethod
    def zeros_like(self, x: Any, dtype: Any = None) -> Any:
        """Zeros of the shape of ``x``, in ``dtype`` (default: the dtype of ``x``)."""

    @abstractmethod
    def arange(self, start: Any, stop: Any = None, step: Any = None, dtype: Any = None) -> Any:
        """``start, start + step, ...`` below ``stop`` (``0 .. start - 1`` with one
        argument); int32 for ints unless ``dtype`` says otherwise."""

    # --- elementwise ------------------------------------------------------------------------

    @abstractmethod
    def where(self, condition: Any, x1: Any = None, x2: Any = None) -> Any:
        """``x1`` where the bool ``condition`` holds, else ``x2`` (broadcast; a Python
        scalar takes the other operand's dtype)."""

    @abstractmethod
    def abs(self, x: Any) -> Any:
        """``|x|``, dtype kept."""

    @abstractmethod
    def multiply(self, x1: Any, x2: Any) -> Any:
        """``x1 * x2`` (broadcast, promoted)."""

    @abstractmethod
    def exp(self, x: Any) -> Any:
        """``e ** x`` (floating; integers give float32)."""

    @abstractmethod
    def log(self, x: Any) -> Any:
        """Natural logarithm (floating; integers give float32)."""

    @abstractmethod
    def tanh(self, x: Any) -> Any:
        """Hyperbolic tangent (floating, float64 kept; integers give float32)."""

    @abstractmethod
    def erf(self, x: Any) -> Any:
        """Gauss error function (floating, float64 kept; integers give float32)."""

    @abstractmethod
    def gelu(self, x: Any, approximate: bool = True) -> Any:
        """GELU of a floating ``x`` in its dtype (float64 kept): with ``approximate``, the
        tanh form ``x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x**3)))``, else
        ``x / 2 * (1 + erf(x / sqrt(2)))``; the framework's own kernel where it has one."""

    @abstractmethod
    def silu(self, x: Any) -> Any:
        """``x * sigmoid(x)`` of a floating ``x`` in its dtype (float64 kept), without
        overflow or cancellation for large ``|x|``; the framework's own kernel where it
        has one."""

    @abstractmethod
    def square(self, x: Any) -> Any:
        """``x * x``, dtype kept (bool gives int32)."""

    @abstractmethod
    def rsqrt(self, x: Any) -> Any:
        """``1 / sqrt(x)`` (floating)."""

    @abstractmethod
    def isfinite(self, x: Any) -> Any:
        """Neither NaN nor infinite (bool; integers and bool are always finite)."""

    @abstractmethod
    def equal(self, x1: Any, x2: Any) -> Any:
        """``x1 == x2`` (bool, after promotion)."""

    @abstractmethod
    def not_equal(self, x1: Any, x2: Any) -> Any:
        """``x1 != x2`` (bool, after promotion)."""

    @abstractmethod
    def less(self, x1: Any, x2: Any) -> Any:
        """``x1 < x2`` (bool, after promotion)."""

    @abstractmethod
    def less_equal(self, x1: Any, x2: Any) -> Any:
        """``x1 <= x2`` (bool, after promotion)."""

    @abstractmethod
    def greater_equal(self, x1: Any, x2: Any) -> Any:
        """``x1 >= x2`` (bool, after promotion)."""

    @abstractmethod
    def logical_and(self, x1: Any, x2: Any) -> Any:
        """Elementwise and (bool; non-zero is True)."""

    @abstractmethod
    def logical_or(self, x1: Any, x2: Any) -> Any:
        """Elementwise or (bool; non-zero is True)."""

    @abstractmethod
    def logical_not(self, x: Any) -> Any:
        """Elementwise not (bool; non-zero is True)."""

    @abstractmethod
    def stop_gradient(self, variable: Any) -> Any:
        """``variable`` with no gradient flowing back through it."""

    # --- reductions and softmax -----------------------------------------------------------

    @abstractmethod
    def any(self, x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        """Whether any entry along ``axis`` is non-zero (bool)."""

    @abstractmethod
    def sum(self, x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        """Sum along ``axis``; bool and small integers give int32, float64 is kept."""

    @abstractmethod
    def max(self, x: Any, axis: Any = None, keepdims: bool = False, initial: Any = None) -> Any:
        """Maximum along ``axis``, dtype kept (``-inf`` entries are fine)."""

    @abstractmethod
    def softmax(self, x: Any, axis: int | Sequence[int] = -1) -> Any:
        """Softmax over ``axis`` (shifted by the maximum), floating dtype kept."""

    # --- contractions -----------------------------------------------------------------------

    @abstractmethod
    def einsum(self, subscripts: str, *operands: Any) -> Any:
        """Einstein summation (``...`` broadcasting); float64 stays float64."""

    @abstractmethod
    def linear(self, x: Any, kernel: Any, bias: Any = None, contract: int = 1) -> Any:
        """A dense projection: ``x`` ``(..., *k)`` contracted with ``kernel`` ``(*k, *n)``
        over the ``contract`` axes ``k``, plus ``bias`` ``(*n)`` (or None): ``(..., *n)``
        in the dtype of ``x`` and ``kernel`` (which must agree)."""

    # --- randomness, control flow, gradients --------------------------------------------------

    @abstractmethod
    def dropout(self, x: Any, rate: float, seed: Any = None) -> Any:
        """Inverted dropout: each entry zeroed with probability ``rate``, the others
        scaled by ``1 / (1 - rate)``; ``seed`` None, an int or a
        ``keras.random.SeedGenerator``."""

    @abstractmethod
    def cond(self, pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        """``true_fn()`` if the scalar bool ``pred`` holds, else ``false_fn()``; under a
        trace both branches return the same structure of tensors."""

    @abstractmethod
    def fori_loop(self, lower: Any, upper: Any, body_fun: Callable, init_val: Any) -> Any:
        """``val = body_fun(i, val)`` for ``i`` in ``[lower, upper)`` from ``init_val``
        (any structure of tensors); differentiable."""

    @abstractmethod
    def custom_gradient(
        self,
        forward: Callable[..., tuple[Any, tuple]],
        backward: Callable[[tuple, Any], tuple],
        inputs: tuple,
    ) -> Any:
        """``forward(*inputs)[0]`` differentiated with ``backward``: ``forward`` returns
        ``(output, saved)``, ``backward(saved, d_output)`` one gradient per input.
        Differentiable once; where the framework has no gradients, ``forward`` alone."""

    # --- optional -----------------------------------------------------------------------------

    def fused_attention(
        self, query: Any, key: Any, value: Any, mask: Any, scale: float, is_causal: bool = False
    ) -> Any:
        """The framework's fused attention on ``(batch, seq, heads, dim)`` float32 arrays
        with equal key and value widths (``mask``: bool, True = may attend, rank 4, no row
        fully masked; ``is_causal``: top-left aligned, equal lengths only), as many
        key/value heads as query heads (or fewer, dividing them, where
        `fused_attention_groups` is True). Called only when `has_fused_attention` is True."""
        raise NotImplementedError(
            f"{type(self).__name__}.fused_attention: this namespace has no fused attention "
            "(has_fused_attention is False); the core takes its explicit path."
        )

    def write_cache(self, cache: Any, new: Any, index: Any) -> Any:
        """``cache`` ``(B, H, L, ...)`` with ``new`` ``(B, H, t, ...)`` (same dtype, same
        other sizes) at positions ``index .. index + t - 1`` of axis 2, written into
        ``cache`` itself where the framework can (PyTorch, NumPy, Paddle: an in-place
        update; JAX: a dynamic update slice, in place under ``jax.jit`` when the cache is
        a donated argument), and returned. ``index`` is a Python int or a 0-d integer
        tensor with ``0 <= index <= L - t``. Nothing differentiates through the write.
        Called only where `writes_in_place` is True, inside
        `multiattn.namespaces.keras.owned_caches`: the caller owns ``cache`` and reads it only
        through what the layers return."""
        raise NotImplementedError(
            f"{type(self).__name__}.write_cache: this namespace does not write caches in "
            "place (writes_in_place is False); the core copies the cache instead."
        )

    def map_batch(
        self, fn: Callable[..., Any], args: Sequence[Any], chunks: int, remat: bool = True
    ) -> Any:
        """``fn(*args)`` computed over ``chunks`` equal slices of the batch in turn and
        joined on the batch axis: the batch is ``args[0]``'s leading size ``B`` (which
        ``chunks`` divides); an argument whose leading size is ``B`` is sliced with it,
        any other (a mask or bias broadcast over the batch, ``None``) is passed whole to
        every slice. ``fn`` returns one array whose leading axis is the batch, or a tuple
        of them (then so does this). The result equals ``fn(*args)`` up to rounding, and
        so do its gradients (taken as those of ``fn(*args)`` where the framework can),
        the gradient of the slicing being the join of the slices' gradients (no
        batch-sized buffer per slice).

        ``remat``: where the namespace runs the slices as one compiled loop (jax), the
        backward pass recomputes each slice's intermediates instead of keeping every
        slice's. False where ``fn`` has its own backward pass
        (`Namespace.custom_gradient`), whose saved tensors are what is to be kept.
        Namespaces that call ``fn`` once per slice keep what their automatic
        differentiation keeps either way. Called only where `maps_batch` is True."""
        raise NotImplementedError(
            f"{type(self).__name__}.map_batch: this namespace does not map over the batch "
            "(maps_batch is False); the core runs attention in one piece."
        )


#: The operations of the contract (the callables of `Namespace`).
OPERATIONS: tuple[str, ...] = tuple(
    sorted(
        name
        for name, member in vars(Namespace).items()
        if not name.startswith("_") and inspect.isfunction(member)
    )
)
#: The capabilities of the contract (attributes with defaults).
CAPABILITIES: tuple[str, ...] = tuple(
    name for name in Namespace.__annotations__ if not name.startswith("_")
)
#: The optional operations and the capability that says each is implemented.
_OPTIONAL = {
    "fused_attention": "has_fused_attention",
    "write_cache": "writes_in_place",
    "map_batch": "maps_batch",
}


def signature_mismatches(contract: Callable, implementation: Callable) -> list[str]:
    """How ``implementation`` fails to accept every call ``contract`` allows (bound
    methods or plain functions with ``self``; empty when compatible): each contract
    parameter must be accepted under the same name and kind (or by ``*args``/``**kwargs``),
    optional parameters must stay optional, and extra parameters must be optional."""
    want = _parameters(contract)
    have = _parameters(implementation)
    varargs = any(p.kind is p.VAR_POSITIONAL for p in have.values())
    varkw = any(p.kind is p.VAR_KEYWORD for p in have.values())
    problems = []
    for name, p in want.items():
        q = have.get(name)
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if not any(h.kind is p.kind for h in have.values()):
                problems.append(f"takes no {'*' if p.kind is p.VAR_POSITIONAL else '**'}{name}")
            continue
        if q is None:
            positional = p.kind is not p.KEYWORD_ONLY
            if not ((positional and varargs) or varkw):
                problems.append(f"has no parameter {name!r}")
            continue
        if p.kind is p.POSITIONAL_OR_KEYWORD and q.kind is not p.POSITIONAL_OR_KEYWORD:
            problems.append(f"parameter {name!r} must be positional-or-keyword")
        if p.default is not p.empty and q.default is p.empty:
            problems.append(f"parameter {name!r} must be optional")
    for name, q in have.items():
        if name not in want and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            if q.default is q.empty:
                problems.append(f"extra parameter {name!r} must be optional")
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    want_pos = [n for n, p in want.items() if p.kind in positional]
    have_pos = [n for n, q in have.items() if q.kind in positional]
    if have_pos[: len(want_pos)] != want_pos and not (
        varargs and have_pos == want_pos[: len(have_pos)]
    ):
        problems.append(f"positional parameters {have_pos} do not start with {want_pos}")
    return problems


def _parameters(fn: Callable) -> dict[str, inspect.Parameter]:
    params = dict(inspect.signature(fn).parameters)
    if not inspect.ismethod(fn) and params:
        params.pop(next(iter(params)))  # self, on a function taken from a class
    return params


def check_namespace(namespace: Any) -> None:
    """Raise ``TypeError`` naming what ``namespace`` (an instance or a class) lacks of
    the contract: a missing or non-callable operation, an operation whose signature does
    not accept the contract's calls, a missing capability, or `fused_attention` missing
    where ``has_fused_attention`` is True, `write_cache` where ``writes_in_place`` is, or
    `map_batch` where ``maps_batch`` is."""
    owner = namespace if isinstance(namespace, type) else type(namespace)
    label = f"{owner.__module__}.{owner.__qualname__}"
    problems = []
    for name in CAPABILITIES:
        if not hasattr(namespace, name):
            problems.append(f"capability {name!r} is missing")
    for name in OPERATIONS:
        member = getattr(namespace, name, None)
        flag = _OPTIONAL.get(name)
        if flag is not None and not getattr(namespace, flag, False):
            continue
        if not callable(member):
            problems.append(f"operation {name!r} is missing")
            continue
        if flag is not None and getattr(owner, name, None) is getattr(Namespace, name):
            problems.append(f"{name!r} is not implemented but {flag} is True")
            continue
        for why in signature_mismatches(getattr(Namespace, name), member):
            problems.append(f"{name}: {why}")
    if problems:
        raise TypeError(
            f"{label} does not implement the namespace contract "
            f"(multiattn.namespaces.contract.Namespace): " + "; ".join(problems) + "."
        )

"""The measured attention choices: fused or explicit, slices of the batch, the backward
pass (each timed only under autotune, see `multiattn.tuning`;
`multiattn.tuning.Measured.attention` asks them). Blockwise or direct is not measured:
the memory budget and a forced block size decide it (`multiattn.ops.plan`).

Each candidate is timed on random inputs of the call's sizes (`_random_tensors`),
compiled as the caller is (`_Compilation`, `_compiled`), outside a ``jax.jit`` /
``tf.function`` trace under way (`_eager`), forward or forward and backward
(`_and_backward`). The measurements behind each default are in docs/benchmarks.md,
'Measurements behind the defaults'.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .._checks import _static_dim
from ._store import FLOP_CAP, MARGIN, bucket, decide, torch_is_tracing

#: About the most floating-point operations one timed call of `fused_attention_pays`
#: performs (see there).
ATTENTION_FLOP_CAP = 16 * FLOP_CAP

#: Score matrices of fewer bytes than this (one call's ``B*H*Tq*Tk`` entries) are not
#: timed for `attention_chunks` and `attention_backward`: timing compiles every
#: candidate, which costs more than a matrix of a few pages could save.
CHUNK_MIN_BYTES = 1 << 20

_CACHE_UNDER_XLA = (
    "keys and values of a cache, heads first, compiled by XLA: the explicit path reads "
    "them in place; the fused kernel takes them positions first, and a compiled loop "
    "that carries the cache then copies it on every step"
)


# --- how a candidate is timed ----------------------------------------------------------


def _random_tensors(ops: Any, shapes: list[tuple], dtype: str, like: Any) -> list:
    """A decision's inputs: standard normal tensors of ``shapes``, the same on every run
    (seed 0), in ``dtype`` (drawn in float32 for half precision), on ``like``'s device
    where PyTorch keeps it off the CPU. Call inside `_eager`."""
    rng = np.random.default_rng(0)
    np_dtype = "float64" if dtype == "float64" else "float32"
    elsewhere = ops.backend == "torch" and _device(ops.backend, like) not in ("cpu", None)

    def one(shape: tuple) -> Any:
        t = ops.cast(ops.convert_to_tensor(rng.standard_normal(shape).astype(np_dtype)), dtype)
        return t.to(like.device) if elsewhere else t

    return [one(shape) for shape in shapes]


class _Compilation(NamedTuple):
    """How the caller's code is compiled, read inside its trace, for timing candidates
    the same way: whether it is traced (``jax.jit``, ``tf.function``) and whether XLA
    compiles it (on TensorFlow, a part of the class)."""

    traced: bool
    xla: bool


def _compiled(
    backend: str,
    fn: Callable[..., Any],
    tensors: list,
    how: _Compilation,
    passes: int = 1,
) -> Callable[[], Any]:
    """``fn(*tensors)`` as a zero-argument call, compiled as the user's calls are on
    JAX (``jax.jit``) and TensorFlow (``tf.function``, with XLA where ``how.xla``).

    With ``passes > 1`` one call runs ``fn`` that many times in a compiled loop, the first
    input shifted on each pass by a zero the compiler cannot see through (the sum of the
    last pass's outputs times 0), so that no pass is hoisted out of the loop or merged."""
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def looped(*ts):
            def body(_, shift):
                out = fn(ts[0] + shift, *ts[1:])
                return sum(jnp.sum(o) for o in jax.tree_util.tree_leaves(out)) * 0.0

            return jax.lax.fori_loop(0, passes, body, jnp.zeros((), ts[0].dtype))

        jitted = jax.jit(fn if passes == 1 else looped)
        return lambda: jitted(*tensors)
    if backend == "tensorflow":
        import tensorflow as tf

        def tf_looped(*ts):
            def body(i, shift):
                out = fn(ts[0] + shift, *ts[1:])
                total = tf.add_n([tf.reduce_sum(o) for o in tf.nest.flatten(out)])
                return i + 1, total * 0.0

            start = (tf.constant(0), tf.zeros((), ts[0].dtype))
            return tf.while_loop(lambda i, _: i < passes, body, start)[1]

        # autograph=False: the candidates are the core's code (`multiattn._autograph`)
        graph = tf.function(
            fn if passes == 1 else tf_looped, jit_compile=how.xla or None, autograph=False
        )
        return lambda: graph(*tensors)
    return lambda: fn(*tensors)


def _and_backward(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """``fn`` followed by the gradients of the sum of its outputs' squares (an array or a
    list of them) with respect to its tensor arguments, on jax (``jax.grad``) or
    TensorFlow (``tf.gradients`` inside the compiled function): a candidate timed forward
    and backward. The squares, not the sum itself: with the sum the output's gradient is
    a constant, which lets XLA simplify the backward pass of the explicit attention path
    (faster with the sum than with the squares at ``(8, 512, 8, 64)`` in 4 slices;
    measured: docs/benchmarks.md, 'Measurements behind the defaults') where a real loss
    would not."""
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def jax_total(*tensors: Any) -> Any:
            return sum(jnp.sum(o * o) for o in jax.tree_util.tree_leaves(fn(*tensors)))

        return lambda *tensors: jax.grad(jax_total, tuple(range(len(tensors))))(*tensors)
    import tensorflow as tf

    def tf_run(*tensors: Any) -> Any:
        # tf.gradients, not a tape: the decision runs in tf.init_scope, which stops every
        # tape from recording, and the candidate runs as a graph anyway
        total = tf.add_n([tf.reduce_sum(o * o) for o in tf.nest.flatten(fn(*tensors))])
        return tf.gradients(total, list(tensors))

    return tf_run


def _device(backend: str, x: Any) -> str | None:
    """The device a backend computes on: ``x``'s on torch (``"cpu"``, ``"cuda"``,
    ...), jax's default backend, ``"gpu"`` where TensorFlow sees one, else ``"cpu"``."""
    if backend == "torch":
        return getattr(getattr(x, "device", None), "type", None)
    if backend == "jax":
        import jax

        return jax.default_backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    return "cpu"


def _eager(backend: str) -> Any:
    """A context in which operations run eagerly even while ``jax.jit`` or
    ``tf.function`` traces the caller."""
    if backend == "jax":
        import jax

        return jax.ensure_compile_time_eval()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.init_scope()
    return contextlib.nullcontext()


def _sync(backend: str, device: str | None) -> Callable[[Any], Any] | None:
    """What waits for a candidate's result before the clock stops (None: the call
    returns when the work is done)."""
    if backend == "jax":
        import jax

        return jax.block_until_ready  # any structure of arrays
    if backend == "tensorflow":
        import tensorflow as tf

        return lambda out: tf.nest.map_structure(lambda t: t.numpy(), out)
    if backend == "torch" and device == "cuda":
        import torch

        return lambda out: torch.cuda.synchronize()
    return None


# --- the choices -----------------------------------------------------------------------


def _attention_class(
    ops: Any, query: Any, key: Any, value: Any, kv_heads_first: bool
) -> tuple[tuple, dict[str, Any], _Compilation, bool, str]:
    """What the attention choices share: the sizes ``(B, Tq, H, H_kv, Tk, D, Dv)`` (None
    where unknown at trace time), the class (the backend, its device, the dtype, ``Tq``
    and ``Tk`` rounded up to powers of two, ``D``, ``Dv``, the key/value layout and, on
    TensorFlow, whether XLA compiles the caller), how the caller is compiled, and whether
    it can be timed now (and why not)."""
    backend = ops.backend
    b, tq, h, d = (_static_dim(n) for n in query.shape)
    tk = _static_dim(key.shape[2 if kv_heads_first else 1])
    hkv = _static_dim(key.shape[1 if kv_heads_first else 2])
    dv = _static_dim(value.shape[-1])
    cls = {
        "backend": backend,
        "device": _device(backend, query),
        "dtype": ops.dtype_name(query),
        "queries": None if tq is None else bucket(tq),
        "keys": None if tk is None else bucket(tk),
        "dim": d,
        "value_dim": dv,
        "kv_heads_first": kv_heads_first,
    }
    how = _Compilation(bool(ops.is_symbolic(query)), ops.xla_device(query) is not None)
    if backend == "tensorflow":
        cls["xla"] = how.xla
    keras = sys.modules.get("keras")
    why = ""
    if keras is not None and isinstance(query, keras.KerasTensor):
        why = "Keras symbolic tensors (nothing runs)"
    elif backend == "torch" and torch_is_tracing():
        why = "torch.compile or torch.jit traces the call"
    elif cls["device"] == "meta":
        why = "meta tensors (shape inference)"
    elif None in (tq, tk, h, d, dv):
        why = "a length or width unknown at trace time"
    return (b, tq, h, hkv, tk, d, dv), cls, how, not why, why


def _decide(
    op: str, cls: dict, candidates: Callable, fallback: str, measurable: bool, why: str,
    prefer: tuple = (), margin: float = MARGIN,
) -> str:  # fmt: skip
    """`decide` for a class of `_attention_class`, timed outside any ``jax.jit`` /
    ``tf.function`` trace under way."""
    with _eager(cls["backend"]) if measurable else contextlib.nullcontext():
        return decide(
            op, cls, candidates, fallback=fallback, measurable=measurable, reason=why,
            sync=_sync(cls["backend"], cls["device"]), margin=margin, prefer=prefer,
        )  # fmt: skip


def fused_attention_pays(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    explicit: Callable[..., Any],
    kv_heads_first: bool = False,
) -> bool:
    """True when the backend's fused attention (``ops.fused_attention``) is faster than
    the core's explicit path on the running machine for attention of this shape class
    (`_attention_class`).

    ``query`` ``(B, Tq, H, D)``, ``key`` ``(B, Tk, H, D)``, ``value`` ``(B, Tk, H, Dv)``
    as `multiattn.ops.attention.attend` passes them, or with ``kv_heads_first`` (a KV
    cache) ``key`` and ``value`` heads first, which the fused candidate moves as the
    fused path does; ``explicit(ops, q, k, v, scale, kv_heads_first)`` runs the explicit
    path without a mask. Both are timed without a mask on random inputs with ``Tk``,
    ``D`` and ``Dv`` of the call and as many of its ``B * H`` heads as fit
    `ATTENTION_FLOP_CAP` (one head over it: as many queries as fit, at least 64): 16
    times the usual cap, the whole call at the benchmark's shape, since on TensorFlow
    Keras' attention won on 4 heads and lost in the layer; at the full size the two tie
    and the explicit path, the fallback there, keeps the class (`MARGIN`). Under
    ``jax.jit`` and ``tf.function`` each timed call runs the candidate as many times as
    reach `FLOP_CAP` in one compiled loop.

    Not timed: where nothing can run (Keras symbolic tensors, ``torch.compile``, a length
    unknown at trace time) the class's earlier decision is used, else the namespace's
    ``fused_attention_pays``; keys and values heads first under XLA (a cache in a
    compiled step) take the explicit path (`_CACHE_UNDER_XLA`).
    """
    if not ops.has_fused_attention:
        return False
    fallback = bool(ops.fused_attention_pays)
    sizes, cls, how, measurable, why = _attention_class(ops, query, key, value, kv_heads_first)
    b, tq, h, _, tk, d, dv = sizes
    if kv_heads_first and how.traced and how.xla:
        # a class of its own, so that a decision timed on eager calls of the same sizes
        # is not reused here
        cls["cache_under_xla"] = True
        measurable, why, fallback = False, _CACHE_UNDER_XLA, False
    heads, queries = max(1, (b or 1) * (h or 1)), tq
    if measurable:
        # fewer heads first, then (one head over the cap) fewer queries, at least 64
        per_query = 2 * tk * (d + dv)
        heads = max(1, min(heads, ATTENTION_FLOP_CAP // max(per_query * tq, 1)))
        if per_query * tq > ATTENTION_FLOP_CAP:
            queries = min(tq, max(64, ATTENTION_FLOP_CAP // max(per_query, 1)))

    def candidates() -> tuple[dict[str, Callable[[], Any]], str]:
        kv = (1, heads, tk) if kv_heads_first else (1, tk, heads)
        scale = 1.0 / math.sqrt(d)

        def fused(q, k, v):
            if kv_heads_first:
                k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in (k, v))
            return ops.fused_attention(q, k, v, None, scale)

        fns = {
            "fused": fused,
            "explicit": lambda q, k, v: explicit(ops, q, k, v, scale, kv_heads_first),
        }
        with _eager(ops.backend):
            shapes = [(1, queries, heads, d), (*kv, d), (*kv, dv)]
            tensors = _random_tensors(ops, shapes, cls["dtype"], query)
            # traced: as many passes per call as reach FLOP_CAP (at most 64), so that a
            # candidate of a few microseconds is timed by its work in compiled code
            flops = 2 * heads * queries * tk * (d + dv)
            passes = max(1, min(64, FLOP_CAP // max(flops, 1))) if how.traced else 1
            runs = {n: _compiled(ops.backend, fn, tensors, how, passes) for n, fn in fns.items()}
        kv_shape = ", ".join(map(str, (*kv, f"{d}/{dv}")))
        timed = f"(1, {queries}, {heads}, {d}) queries, ({kv_shape}) keys/values"
        return runs, timed + (f", {passes} passes per call" if passes > 1 else "")

    choice = _decide(
        "attention", cls, candidates, "fused" if fallback else "explicit", measurable, why
    )
    return choice == "fused"


def _at_full_size(sizes: tuple, cls: dict, measurable: bool, why: str) -> tuple[bool, str]:
    """What the choices timed at the call's full size (`attention_chunks`,
    `attention_backward`) add to `_attention_class`: the class also holds ``B``, ``H``
    and ``H_kv`` (``cls`` is updated), and nothing is timed where one of them is unknown
    at trace time or the score matrix is under `CHUNK_MIN_BYTES`."""
    b, tq, h, hkv, tk = sizes[:5]
    cls.update(batch=b, heads=h, kv_heads=hkv)
    if measurable and None in (b, hkv):
        return False, "a size unknown at trace time"
    itemsize = 8 if cls["dtype"] == "float64" else 4
    if measurable and b * h * tq * tk * itemsize < CHUNK_MIN_BYTES:
        return False, "a score matrix under CHUNK_MIN_BYTES"
    return measurable, why


def _full_size_runs(
    ops: Any, sizes: tuple, cls: dict, like: Any, how: _Compilation, kv_heads_first: bool,
    fns: dict[str, Callable[..., Any]],
) -> tuple[dict[str, Callable[[], Any]], str]:  # fmt: skip
    """Each of ``fns`` (``fn(q, k, v)``) compiled as the caller is, on random query, key
    and value of the call's full size, and a description of those inputs."""
    b, tq, h, hkv, tk, d, dv = sizes
    kv = (b, hkv, tk) if kv_heads_first else (b, tk, hkv)
    with _eager(ops.backend):
        tensors = _random_tensors(ops, [(b, tq, h, d), (*kv, d), (*kv, dv)], cls["dtype"], like)
        runs = {name: _compiled(ops.backend, fn, tensors, how) for name, fn in fns.items()}
    return runs, f"({b}, {tq}, {h}, {d}) queries, {(*kv, d)} keys"


def _in_slices(
    ops: Any, explicit: Callable[..., Any], sizes: tuple, chunks: int, kv_heads_first: bool
) -> Callable[..., Any]:
    """``explicit(ops, q, k, v, scale, kv_heads_first)`` as ``fn(q, k, v)`` over
    ``chunks`` slices of the batch (`Namespace.map_batch`; one piece for 1)."""
    scale = 1.0 / math.sqrt(sizes[5])

    def one(q: Any, k: Any, v: Any) -> Any:
        return explicit(ops, q, k, v, scale, kv_heads_first)

    return one if chunks == 1 else lambda q, k, v: ops.map_batch(one, (q, k, v), chunks)


def attention_chunks(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    explicit: Callable[..., Any],
    kv_heads_first: bool = False,
    default: int = 1,
) -> int:
    """How many slices of the batch the core's explicit attention path runs fastest in,
    on the running machine, for attention of this shape class: 1 or a power of two
    dividing the batch, up to 16 (``default`` where nothing is timed).

    Why it depends on the machine: XLA:CPU takes every call's buffers from the C
    allocator, and glibc's hands one above its mapping threshold back to the kernel when
    freed, so each call maps it again and the kernel zeroes its pages; one slice's score
    matrix, below the threshold, is reused from call to call. Paddle's slices run side
    by side on a pool of one thread per CPU, in eager calls too (``maps_batch_eagerly``):
    there the reason is cores.

    The arguments are `attention_backward`'s. Each count runs ``explicit`` forward
    through `Namespace.map_batch` on random inputs of the call's full size, compiled as
    the caller is. The class is `fused_attention_pays`' with ``B``, ``H`` and ``Hkv``.
    Counts within `MARGIN` of the fastest go to the most slices (the smallest buffers; a
    tie went either way from run to run). Not timed: score matrices under
    `CHUNK_MIN_BYTES`, sizes unknown at trace time, and where nothing can run.
    """
    sizes, cls, how, measurable, why = _attention_class(ops, query, key, value, kv_heads_first)
    measurable, why = _at_full_size(sizes, cls, measurable, why)
    b = sizes[0]
    counts = [c for c in (16, 8, 4, 2, 1) if measurable and c <= b and b % c == 0]

    def candidates() -> tuple[dict[str, Callable[[], Any]], str]:
        fns = {str(c): _in_slices(ops, explicit, sizes, c, kv_heads_first) for c in counts[::-1]}
        runs, timed = _full_size_runs(ops, sizes, cls, query, how, kv_heads_first, fns)
        return runs, f"{timed}, forward"

    prefer = tuple(str(c) for c in counts)
    return int(_decide("attention-chunks", cls, candidates, str(default), measurable, why, prefer))


def attention_backward(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    explicit: Callable[..., Any],
    own: Callable[..., Any],
    chunks: int = 1,
    kv_heads_first: bool = False,
) -> str:
    """How the explicit attention path is differentiated fastest, forward and backward,
    on the running machine, for attention of this shape class: ``"autodiff"`` (the
    framework's automatic differentiation), ``"recompute"`` (the path's own backward
    pass, `multiattn.ops.explicit_grad`, the weights recomputed from the log of each
    row's softmax denominator) or ``"saved"`` (the same backward pass on the weights the
    forward pass saved).

    Why it depends on the machine and the framework: automatic differentiation keeps the
    weights (or, over jax's slices, recomputes each slice's forward pass) and runs the
    softmax's backward pass over the score matrix; the own backward pass sums over the
    outputs instead (``rowsum(dO * O)``), and recomputing the weights trades a product
    and an exponential for the memory that holds them (jax: recomputing won; TensorFlow:
    the saved weights won).

    ``query`` ``(B, Tq, H, D)``, ``key`` ``(B, Tk, Hkv, D)`` and ``value``
    ``(B, Tk, Hkv, Dv)`` (heads first with ``kv_heads_first``) as
    `multiattn.ops.attention.attend` passes them; ``explicit(ops, q, k, v, scale,
    kv_heads_first)`` runs the explicit path without a mask (over ``chunks`` slices of
    the batch here), ``own(ops, q, k, v, scale, chunks, kv_heads_first, backward)`` the
    same with its own backward pass. All three are timed forward and backward
    (`_and_backward`) on random inputs of the call's full size, compiled as the caller
    is; automatic differentiation keeps the class unless another is faster by more than
    `backward_margin`. The class is `attention_chunks`' with the slices. Not timed
    (automatic differentiation): eager calls, backends other than jax and TensorFlow,
    keys and values heads first (a KV cache: decoding, which nothing differentiates),
    score matrices under `CHUNK_MIN_BYTES` and sizes unknown at trace time.
    """
    sizes, cls, how, measurable, why = _attention_class(ops, query, key, value, kv_heads_first)
    if measurable and ops.backend not in ("jax", "tensorflow"):
        measurable, why = False, "a backend whose gradients are not timed"
    if measurable and kv_heads_first:
        measurable, why = False, "keys and values heads first (a KV cache: decoding)"
    measurable, why = _at_full_size(sizes, cls, measurable, why)
    cls["chunks"] = chunks

    def candidates() -> tuple[dict[str, Callable[[], Any]], str]:
        scale = 1.0 / math.sqrt(sizes[5])

        def own_way(backward: str) -> Callable[..., Any]:
            return lambda q, k, v: own(ops, q, k, v, scale, chunks, kv_heads_first, backward)

        fns = {
            "autodiff": _in_slices(ops, explicit, sizes, chunks, kv_heads_first),
            "recompute": own_way("recompute"),
            "saved": own_way("saved"),
        }
        fns = {name: _and_backward(fn, ops.backend) for name, fn in fns.items()}
        runs, timed = _full_size_runs(ops, sizes, cls, query, how, kv_heads_first, fns)
        sliced = f" in {chunks} slices" if chunks > 1 else ""
        return runs, f"{timed}{sliced}, forward and backward"

    return _decide(
        "attention-backward", cls, candidates, "autodiff", measurable, why,
        margin=backward_margin(ops.backend),
    )  # fmt: skip


def backward_margin(backend: str) -> float:
    """How much faster than automatic differentiation another way of differentiating the
    explicit path must be to be chosen (`attention_backward`): `MARGIN`, except on
    TensorFlow, where none. The margin stands for what the timed attention does not
    show: on jax, over slices, automatic differentiation recomputes each slice's forward
    pass instead of holding its weights, memory the timing does not see. On TensorFlow
    automatic differentiation and the saved weights hold the same tensors and the saved
    weights' backward pass does less, so nothing untimed favours automatic
    differentiation, and a margin kept it where the layer was faster with the saved
    weights (measured: docs/benchmarks.md, 'Measurements behind the defaults')."""
    return 0.0 if backend == "tensorflow" else MARGIN

"""The measured attention choices: fused or explicit, slices of the batch, the backward
pass, blockwise or direct (each timed only under autotune, see `multiattn.tuning`;
`multiattn.tuning.Measured.attention` asks them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from ._store import MARGIN, bucket
from ._timing import (
    FLOP_CAP,
    _and_backward,
    _can_time,
    _Compilation,
    _compiled,
    _decide_eagerly,
    _device,
    _eager,
    _random_tensors,
    _static,
)

#: About the most floating-point operations one timed call of `fused_attention_pays`
#: performs (see there).
ATTENTION_FLOP_CAP = 16 * FLOP_CAP


_CACHE_UNDER_XLA = (
    "keys and values of a cache, heads first, compiled by XLA: the explicit path reads "
    "them in place; the fused kernel takes them positions first, and a compiled loop "
    "that carries the cache then copies it on every step"
)


def _attention_class(
    ops: Any, query: Any, key: Any, value: Any, kv_heads_first: bool
) -> tuple[tuple, dict[str, Any], _Compilation, bool, str]:
    """What the two attention choices share: the sizes ``(B, Tq, H, H_kv, Tk, D, Dv)``
    (None where unknown at trace time), the class (the backend, its device, the dtype,
    ``Tq`` and ``Tk`` rounded up to powers of two, ``D``, ``Dv``, the key/value layout
    and, on TensorFlow, whether XLA compiles the caller), how the caller is compiled, and
    whether it can be timed now (and why not)."""
    backend = ops.backend
    b, tq, h, d = (_static(n) for n in query.shape)
    tk = _static(key.shape[2 if kv_heads_first else 1])
    hkv = _static(key.shape[1 if kv_heads_first else 2])
    dv = _static(value.shape[-1])
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
    how = _Compilation.of(ops, query)
    if backend == "tensorflow":
        cls["xla"] = how.xla
    measurable, why = _can_time(ops, backend, query)
    if measurable and None in (tq, tk, h, d, dv):
        measurable, why = False, "a length or width unknown at trace time"
    return (b, tq, h, hkv, tk, d, dv), cls, how, measurable, why


def fused_attention_pays(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    explicit: Callable[..., Any],
    kv_heads_first: bool = False,
) -> bool:
    """True when the backend's fused attention (``ops.fused_attention``) is faster than
    the core's explicit path on the running machine for attention of this shape class.

    ``query`` ``(B, Tq, H, D)``, ``key`` ``(B, Tk, H, D)``, ``value`` ``(B, Tk, H, Dv)``
    as `multiattn.ops.attention.attend` passes them (as many key/value heads as query
    heads), or with ``kv_heads_first`` (a KV cache) ``key`` ``(B, H, Tk, D)`` and
    ``value`` ``(B, H, Tk, Dv)``: then the fused candidate moves them to ``(B, Tk, H, D)``
    first, as the fused path does, and the explicit one reads them in place;
    ``explicit(ops, q, k, v, scale, kv_heads_first)`` runs the explicit path without a
    mask and returns its output. Both are timed without a mask on random inputs of the same dtype
    with ``Tk``, ``D`` and ``Dv`` of the call and as many of its ``B * H`` heads as fit
    `ATTENTION_FLOP_CAP` (one head over the cap: as many of its ``Tq`` queries as fit, at
    least 64, so the explicit candidate's score matrix stays small): 16 times the usual
    cap, the whole call at the benchmark's shape (64 heads of 512 queries and keys). On
    TensorFlow, timed on 4 of those heads, Keras' attention beat the explicit path while
    in the layer it lost, forward and forward and backward (measured:
    docs/benchmarks.md, 'Measurements behind the defaults'); at the full size the two tie
    forward and the explicit path, the fallback there, keeps the class (`MARGIN`). The
    class is the backend, its device, the dtype, ``Tq`` and ``Tk`` rounded up to powers
    of two, ``D``, ``Dv`` and the key/value layout.
    This compares the two paths that hold a whole score matrix: where the scores exceed
    the attention memory budget the alternative to a streaming fused kernel is the
    blockwise path, which this does not time. Eager calls time directly; under
    ``jax.jit`` and ``tf.function`` the candidates are compiled as the caller is (on
    TensorFlow with XLA where the caller's graph is, a part of the class) and timed at
    trace time outside the trace, each call running the candidate as many times as reach
    `FLOP_CAP` in a compiled loop (`_compiled`). Where nothing can be timed (Keras symbolic tensors, ``torch.compile``,
    a length unknown at trace time) the class's earlier decision is used, else the
    namespace's ``fused_attention_pays`` (`multiattn.namespaces.contract.Namespace`). Keys and
    values heads first under XLA (a cache in a compiled step) take the explicit path
    without timing: timed alone the two tie, but in a loop that carries the cache the
    fused kernel's layout copies the cache on every step (`_CACHE_UNDER_XLA`).
    """
    if not ops.has_fused_attention:
        return False
    fallback = bool(ops.fused_attention_pays)
    sizes, cls, how, measurable, why = _attention_class(ops, query, key, value, kv_heads_first)
    b, tq, h, _, tk, d, dv = sizes
    if kv_heads_first and how.traced and how.xla:
        # Not timed: alone the two tie, but the loop differs (generate, Llama shape,
        # prompt 512, batch 8, TensorFlow: several times slower per token fused;
        # measured: docs/benchmarks.md, 'Measurements behind the defaults'). A
        # class of its own, so that a decision timed on eager calls of the same sizes
        # is not reused here.
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
        shapes = [(1, queries, heads, d), (*kv, d), (*kv, dv)]
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
            tensors = _random_tensors(ops, shapes, cls["dtype"], query)
            passes = how.passes(2 * heads * queries * tk * (d + dv))
            runs = {
                name: _compiled(ops.backend, fn, tensors, how, passes) for name, fn in fns.items()
            }
        kv = f"(1, {heads}, {tk}, {d}/{dv})" if kv_heads_first else f"(1, {tk}, {heads}, {d}/{dv})"
        looped = f", {passes} passes per call" if passes > 1 else ""
        return runs, f"(1, {queries}, {heads}, {d}) queries, {kv} keys/values{looped}"

    fallback_choice = "fused" if fallback else "explicit"
    choice = _decide_eagerly("attention", cls, candidates, fallback_choice, measurable, why)
    return choice == "fused"


#: Score matrices of fewer bytes than this (one call's ``B*H*Tq*Tk`` entries) are not
#: timed for `attention_chunks` and run in one piece: timing compiles every candidate,
#: which costs more than slicing a matrix of a few pages could save.
CHUNK_MIN_BYTES = 1 << 20


def _at_full_size(sizes: tuple, cls: dict, measurable: bool, why: str) -> tuple[bool, str]:
    """What the choices timed at the call's full size (`attention_chunks`,
    `attention_backward`) add to `_attention_class`: the class also holds ``B``,
    ``H`` and ``H_kv`` (``cls`` is updated), and nothing is timed where one of them is
    unknown at trace time or the score matrix is under `CHUNK_MIN_BYTES`. Returns
    ``(measurable, why)``."""
    b, tq, h, hkv, tk = sizes[:5]
    cls.update(batch=b, heads=h, kv_heads=hkv)
    if measurable and None in (b, hkv):
        return False, "a size unknown at trace time"
    itemsize = 8 if cls["dtype"] == "float64" else 4
    if measurable and b * h * tq * tk * itemsize < CHUNK_MIN_BYTES:
        return False, "a score matrix under CHUNK_MIN_BYTES"
    return measurable, why


def _full_size_inputs(
    ops: Any, sizes: tuple, dtype: str, like: Any, kv_heads_first: bool
) -> tuple[list, str]:
    """Random query, key and value of the call's full size (`_random_tensors`; call
    inside `_eager`), and their description for the decision."""
    b, tq, h, hkv, tk, d, dv = sizes
    kv = (b, hkv, tk) if kv_heads_first else (b, tk, hkv)
    tensors = _random_tensors(ops, [(b, tq, h, d), (*kv, d), (*kv, dv)], dtype, like)
    return tensors, f"({b}, {tq}, {h}, {d}) queries, {(*kv, d)} keys"


def _in_slices(
    ops: Any, explicit: Callable[..., Any], sizes: tuple, chunks: int, kv_heads_first: bool
) -> Callable[..., Any]:
    """``explicit(ops, q, k, v, scale, kv_heads_first)`` (the explicit path without a
    mask) as ``fn(q, k, v)`` over ``chunks`` slices of the batch (`Namespace.map_batch`;
    one piece for 1), the scale that of the key width in ``sizes``."""
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
    on the running machine, for attention of this shape class: 1 (one piece) or a power
    of two dividing the batch, up to 16 (``default`` where nothing is timed;
    `multiattn.tuning.Fixed` gives a count instead).

    Why it depends on the machine: XLA:CPU takes the buffers of every call of a compiled
    function from the C allocator, and glibc's hands a buffer above its mapping
    threshold (at most 32 MiB) back to the kernel when it is freed, so each call maps it
    again and the kernel zeroes every page on first touch. With the batch in slices, one
    slice's score matrix is what the program holds: below the threshold, it is reused
    from call to call. Multi-head self-attention on jax, batch 8, length 512, width 512,
    8 heads, float32, ran faster forward in 4 slices, with about half the page faults
    per call (measured: docs/benchmarks.md, 'Measurements behind the defaults'). Whether
    it pays depends on the allocator, its thresholds and the kernel's page size, so it is
    measured.

    ``query`` ``(B, Tq, H, D)``, ``key`` ``(B, Tk, Hkv, D)`` and ``value``
    ``(B, Tk, Hkv, Dv)`` (heads first with ``kv_heads_first``) as
    `multiattn.ops.attention.attend` passes them; ``explicit(ops, q, k, v, scale,
    kv_heads_first)`` runs the explicit path without a mask. The candidates run it
    forward on random inputs of the call's full size (what is measured is the cost of
    the buffers of that size), compiled as the caller is, through `Namespace.map_batch`
    for the counts above 1. The class is the backend, its device, the dtype, ``B``,
    ``H``, ``Hkv``, ``Tq`` and ``Tk`` rounded up to powers of two, ``D``, ``Dv`` and the
    key/value layout. Counts that tie (within `MARGIN` of the fastest) go to the most
    slices: the smallest buffers, and a tie went either way from run to run. Not timed
    (one piece): score matrices under `CHUNK_MIN_BYTES`,
    sizes unknown at trace time, and where nothing can be timed (Keras symbolic tensors,
    ``torch.compile``).

    TensorFlow's slices are written out side by side in the graph and run on its
    inter-op threads; Paddle's run side by side on a pool of one thread per CPU, and are
    timed in eager calls too (``maps_batch_eagerly``): there the reason is not pages
    but cores, Paddle's CPU kernels running on one thread each.
    """
    sizes, cls, how, measurable, why = _attention_class(ops, query, key, value, kv_heads_first)
    measurable, why = _at_full_size(sizes, cls, measurable, why)
    b = sizes[0]
    counts = [c for c in (1, 2, 4, 8, 16) if measurable and c <= b and b % c == 0]

    def candidates() -> tuple[dict[str, Callable[[], Any]], str]:
        with _eager(ops.backend):
            tensors, timed = _full_size_inputs(ops, sizes, cls["dtype"], query, kv_heads_first)
            runs = {
                str(c): _compiled(
                    ops.backend, _in_slices(ops, explicit, sizes, c, kv_heads_first), tensors, how
                )
                for c in counts
            }
        return runs, f"{timed}, forward"

    # among counts that tie, the most slices: the smallest buffers (in the layer at the
    # default shape, 8 slices tied with 4 forward and were faster forward and backward
    # with the own backward pass; measured: docs/benchmarks.md, 'Measurements behind the
    # defaults')
    prefer = [str(c) for c in sorted(counts, reverse=True)]
    return int(
        _decide_eagerly("attention-chunks", cls, candidates, str(default), measurable, why, prefer)
    )


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
    pass, `multiattn.ops.explicit_grad`, with the weights recomputed from the log of
    each row's softmax denominator) or ``"saved"`` (the same backward pass on the
    weights the forward pass saved).

    Why it depends on the machine and the framework: automatic differentiation keeps the
    weights (or, over jax's slices of the batch, recomputes the slice's whole forward
    pass) and runs the softmax's backward pass, a product and a sum over the score
    matrix; the own backward pass sums over the outputs instead (``rowsum(dO * O)``),
    and recomputing the weights trades a product and an exponential for the memory that
    holds them. Which costs less is a matter of memory traffic and of what the compiler
    fuses. Multi-head self-attention (batch 8, length 512, width 512, 8 heads, float32)
    forward and backward: on jax under ``jax.jit``, recomputing beat automatic
    differentiation in 8 slices and, by less, in 4; on TensorFlow under ``tf.function``
    recomputing lost and the saved weights won, in the layer and for the attention alone
    at ``(8, 512, 8, 64)`` (measured: docs/benchmarks.md, 'Measurements behind the
    defaults'). The loss timed is the sum of the outputs' squares (`_and_backward`): with
    a constant output gradient XLA simplifies automatic differentiation's backward pass
    as no real loss lets it.

    ``query`` ``(B, Tq, H, D)``, ``key`` ``(B, Tk, Hkv, D)`` and ``value`` ``(B, Tk,
    Hkv, Dv)`` (heads first with ``kv_heads_first``) as `multiattn.ops.attention.attend`
    passes them; ``explicit(ops, q, k, v, scale, kv_heads_first)`` runs the explicit
    path without a mask (differentiated automatically, over ``chunks`` slices of the
    batch through `Namespace.map_batch` where ``chunks`` is above 1), and ``own(ops, q,
    k, v, scale, chunks, kv_heads_first, backward)`` the same with its own backward pass
    (``backward`` ``"recompute"`` or ``"saved"``). All are timed forward and backward
    on random inputs of the call's full size, compiled as the caller is; automatic
    differentiation keeps the class unless another is faster by more than
    `backward_margin` (`MARGIN`; none on TensorFlow). The
    class is `attention_chunks`' with the slices. Not timed (automatic
    differentiation): eager calls (they are not compiled: the caller asks only when
    tracing), backends other than jax and TensorFlow, keys and values heads first (a KV
    cache: decoding, which nothing differentiates), score matrices under
    `CHUNK_MIN_BYTES` and sizes unknown at trace time.
    """
    sizes, cls, how, measurable, why = _attention_class(ops, query, key, value, kv_heads_first)
    if measurable and ops.backend not in ("jax", "tensorflow"):
        measurable, why = False, "a backend whose gradients are not timed"
    if measurable and kv_heads_first:
        # a KV cache's layout: decoding, which nothing differentiates; timing would only
        # delay the first `generate` call
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
        with _eager(ops.backend):
            tensors, timed = _full_size_inputs(ops, sizes, cls["dtype"], query, kv_heads_first)
            runs = {
                name: _compiled(ops.backend, _and_backward(fn, ops.backend), tensors, how)
                for name, fn in fns.items()
            }
        sliced = f" in {chunks} slices" if chunks > 1 else ""
        return runs, f"{timed}{sliced}, forward and backward"

    return _decide_eagerly(
        "attention-backward", cls, candidates, "autodiff", measurable, why,
        margin=backward_margin(ops.backend),
    )  # fmt: skip


def backward_margin(backend: str) -> float:
    """How much faster than automatic differentiation another way of differentiating
    the explicit path must be to be chosen (`attention_backward`): `MARGIN`, except on
    TensorFlow, where none.

    The margin stands for what the timed attention does not show, and on jax that
    favours automatic differentiation: over slices it recomputes each slice's forward
    pass instead of holding its weights, memory the timing does not see. On TensorFlow
    automatic differentiation and the saved weights hold the same tensors (the
    weights) and the saved weights' backward pass does less (a sum over the outputs
    instead of the softmax's product and sum over the score matrix), so nothing untimed
    favours automatic differentiation, and a margin handed it a choice that lost in the
    layer: the attention alone at ``(8, 512, 8, 64)`` in 8 slices, forward and backward,
    was faster with the saved weights by less than the margin in some processes, while
    the layer (batch 8, length 512, width 512, 8 heads) was faster with them in every
    process (measured: docs/benchmarks.md, 'Measurements behind the defaults')."""
    return 0.0 if backend == "tensorflow" else MARGIN


def blockwise_attention_pays(
    ops: Any,
    query: Any,
    key: Any,
    value: Any,
    run: Callable[..., Any],
    causal: bool = False,
    kv_heads_first: bool = False,
) -> bool:
    """True when the blockwise path (exact attention block by block with an online
    softmax, `multiattn.ops.blockwise`) is faster than the direct path on the running
    machine for attention of this shape class whose scores fit the memory budget.

    Why it depends on the machine: the direct path writes and reads the whole score
    matrix several times (scores, softmax, weighted sum), the blockwise path one block
    at a time, which can stay in the caches, at the cost of a loop and of rescaling its
    running sums. Which wins depends on the cache sizes and the memory bandwidth: under
    ``jax.jit``, ``(1, 8, L, 64)`` float32, the blockwise path won at L = 4096 on an
    Intel Xeon with AVX-512 and lost at 1024 and 2048 without a causal mask on an AMD
    EPYC with AVX2 only (measured: docs/benchmarks.md, 'Measurements behind the
    defaults').

    ``query`` ``(B, Tq, H, D)``, ``key`` ``(B, Tk, Hkv, D)`` and ``value`` ``(B, Tk,
    Hkv, Dv)`` (heads first with ``kv_heads_first``) as `multiattn.ops.attention.attend`
    passes them; ``run(q, k, v, blockwise)`` runs the call's attention without a mask
    other than ``causal``, on the direct path as planned (``blockwise`` False: the
    fused or explicit path, the slices and the backward pass the other decisions chose)
    or on the blockwise path with the blocks the budget gives (True). Both are timed on
    random inputs of the call's full size, compiled as the caller is, forward (decision
    ``attention-blockwise``) and, where the blockwise path won that, forward and
    backward (``attention-blockwise-backward``): it is taken only where it wins both by
    more than `MARGIN`, since a compiled call does not say whether it will be
    differentiated (multi-head self-attention under ``tf.function`` on the AMD CPU,
    batch 8, length 512, width 512, 8 heads: the blockwise path won forward and lost
    forward and backward; measured: docs/benchmarks.md, 'Measurements behind the
    defaults').
    The class is `attention_chunks`' and whether the mask is causal (the blockwise path
    skips the blocks a causal mask hides). Not timed (the direct path): where nothing
    can be timed (Keras symbolic tensors, ``torch.compile``) and sizes unknown at trace
    time.
    """
    sizes, cls, how, measurable, why = _attention_class(ops, query, key, value, kv_heads_first)
    measurable, why = _at_full_size(sizes, cls, measurable, why)
    cls["causal"] = bool(causal)

    def candidates(backward: bool) -> Callable[[], tuple[dict[str, Callable[[], Any]], str]]:
        def timed_runs() -> tuple[dict[str, Callable[[], Any]], str]:
            with _eager(ops.backend):
                tensors, timed = _full_size_inputs(ops, sizes, cls["dtype"], query, kv_heads_first)
                runs = {}
                for name in ("direct", "blockwise"):
                    fn = functools.partial(run, blockwise=name == "blockwise")
                    fn = _and_backward(fn, ops.backend) if backward else fn
                    runs[name] = _compiled(ops.backend, fn, tensors, how)
            what = "forward and backward" if backward else "forward"
            return runs, f"{timed}{', causal' if causal else ''}, {what}"

        return timed_runs

    forward = _decide_eagerly(
        "attention-blockwise", cls, candidates(False), "direct", measurable, why
    )
    if forward != "blockwise":
        return False
    both = _decide_eagerly(
        "attention-blockwise-backward", cls, candidates(True), "direct", measurable, why
    )
    return both == "blockwise"

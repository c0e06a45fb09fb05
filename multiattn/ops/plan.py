"""Which way one attention call runs: a pure decision on static facts (internal).

`multiattn.ops.attention.attend` describes a call once as an `AttentionSpec` (shapes,
dtype, which masks are present, what the caller wants, what the backend's namespace can
do, the scoped settings of `multiattn.config`) and asks `plan_attention` for an
`AttentionPlan`: the path (``"fused"``, ``"explicit"`` or ``"blockwise"``), the blocks,
how the causal mask, the lengths and rows with nothing to attend are handled, whether
grouped key/value heads are repeated and which inputs are screened for NaN and
infinities. Nothing here touches a tensor or imports a framework, so every rule can be
tested on plain values; ``docs/design.md`` ("The attention planner") tabulates them.

The choices that depend on the machine are left open in the spec (None) and take their
defaults here, unless the tuner in force (`multiattn.config.tuner`) fills them in: whether
the fused kernel is faster than the explicit path (``fused_faster``, where `wants_timing`;
default: the namespace's ``fused_attention_pays``), how many slices of the batch the
explicit path runs in (``chunks``, where `wants_chunks`; default: `default_chunks`, a
static rule) and how it is differentiated (``backward``, where `wants_backward_timing`;
default: automatically). Blockwise or direct is not among them: the memory budget and a
forced block size decide it. `multiattn.tuning` measures them; this module never
imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, Literal

from .._checks import HALF_DTYPES
from .blockwise import plan_blocks

__all__ = [
    "BACKWARDS",
    "MMAP_THRESHOLD_MAX",
    "SLICE_SCORE_BYTES",
    "AttentionPlan",
    "AttentionSpec",
    "Backward",
    "Capabilities",
    "default_chunks",
    "glibc",
    "largest_divisor",
    "plan_attention",
    "wants_backward_timing",
    "wants_chunks",
    "wants_timing",
    "with_default_chunks",
]

Path = Literal["fused", "explicit", "blockwise"]
#: How a causal mask is applied: not at all (none asked, or one query, which it cannot
#: hide anything from), folded into the mask the direct path gets, by the fused kernel's
#: own flag (equal lengths, no other mask), or per block by the blockwise path.
CausalMode = Literal["none", "mask", "kernel", "blocks"]
#: How valid lengths are applied: folded into the mask of the direct path, or per block.
LengthsMode = Literal["none", "mask", "blocks"]
#: How a row with nothing to attend becomes zeros: it cannot occur (no mask), the fused
#: kernel lets it attend everything and its output is zeroed afterwards, the explicit
#: path zeroes its weights (they are returned) or its output, or the online softmax of
#: the blockwise path leaves it zero.
EmptyRows = Literal["none", "kernel_then_zero", "zero_weights", "zero_outputs", "online"]
#: Which inputs are screened for NaN and infinities before they meet a mask or a kernel.
Screen = Literal["none", "query", "all"]
Lengths = Literal["none", "per_sequence", "per_query"]
#: How the explicit path is differentiated: by the framework's automatic
#: differentiation, or by its own backward pass (`multiattn.ops.explicit_grad`) with the
#: weights recomputed from each row's log-sum-exp or saved by the forward pass.
Backward = Literal["autodiff", "recompute", "saved"]
BACKWARDS = ("autodiff", "recompute", "saved")

_PATHS = ("fused", "explicit", "blockwise")


def _check_size(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(
            f"AttentionSpec: `{name}` must be None or an int >= 0; received {value!r}."
        )


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"AttentionSpec: `{name}` must be one of {choices}; received {value!r}.")


@dataclass(frozen=True)
class Capabilities:
    """What a namespace offers the planner (the flags of `multiattn.namespaces.contract`)."""

    has_fused_attention: bool = False
    fused_attention_streams: bool = False
    fused_attention_groups: bool = False
    fused_attention_pays: bool = True
    softmax_exact_zeros: bool = False
    maps_batch: bool = False
    maps_batch_eagerly: bool = False

    @classmethod
    def of(cls, ops: Any) -> Capabilities:
        """The flags of the namespace ``ops`` (every namespace has them: the contract
        gives defaults)."""
        return cls(
            has_fused_attention=bool(ops.has_fused_attention),
            fused_attention_streams=bool(ops.fused_attention_streams),
            fused_attention_groups=bool(ops.fused_attention_groups),
            fused_attention_pays=bool(ops.fused_attention_pays),
            softmax_exact_zeros=bool(ops.softmax_exact_zeros),
            maps_batch=bool(ops.maps_batch),
            maps_batch_eagerly=bool(ops.maps_batch_eagerly),
        )


@dataclass(frozen=True)
class AttentionSpec:
    """The static facts of one attention call on ``(B, T, H, D)`` arrays.

    Sizes are ints, or None where unknown until the call runs (a trace). ``dtype`` is the
    inputs' dtype name (half precision is computed in float32). ``mask``: a boolean mask
    is given; ``lengths``: valid lengths, one per sequence ``(B,)`` or one per query
    ``(B, Tq)``; ``causal``: the bottom-right aligned causal mask; ``bias``: an additive
    float bias is added to the scores (no fused kernel takes one: the explicit or the
    blockwise path runs); ``softcap``: the scores are soft-capped, ``c * tanh(s / c)``
    before the bias and the mask (Gemma 2): only the explicit path computes it (no fused
    kernel takes it, the blockwise path does not; the explicit path is then taken
    whatever the memory budget, and differentiated automatically). ``weights``: the
    weights are returned; ``dropout``: dropout is active (a rate above 0 while
    training); ``traced``: the inputs are symbolic (``jax.jit``, ``tf.function``).
    ``memory_budget`` (bytes) and ``block_size`` (forced ``(queries, keys)`` blocks, or
    None) are the scoped settings of `multiattn.config` (or the call's own block size).
    ``fused_faster``: whether the fused kernel beat the explicit path on this machine
    for this shape class; None where not measured (the namespace's
    ``fused_attention_pays`` then applies). ``chunks``: at most this many slices of the
    batch for the explicit path to run over in turn (`default_chunks`, or a tuner's);
    None: one piece.
    ``backward``: how the explicit path is differentiated, one of `BACKWARDS`
    (a tuner's); None: not decided (automatic).

    A key/value head count that does not divide the query heads is refused here
    (``ValueError``), so no spec describes one.
    """

    batch: int | None
    heads: int | None
    kv_heads: int | None
    queries: int | None
    keys: int | None
    key_width: int | None
    value_width: int | None
    dtype: str
    capabilities: Capabilities
    memory_budget: int
    mask: bool = False
    lengths: Lengths = "none"
    causal: bool = False
    bias: bool = False
    softcap: bool = False
    weights: bool = False
    dropout: bool = False
    traced: bool = False
    block_size: tuple[int, int] | None = None
    fused_faster: bool | None = None
    chunks: int | None = None
    backward: Backward | None = None

    def __post_init__(self) -> None:
        _check_size("chunks", self.chunks)
        if self.backward is not None:
            _check_choice("backward", self.backward, BACKWARDS)
        for name in ("batch", "heads", "kv_heads", "queries", "keys", "key_width", "value_width"):
            _check_size(name, getattr(self, name))
        _check_choice("lengths", self.lengths, ("none", "per_sequence", "per_query"))
        if self.heads != self.kv_heads and (
            self.heads is None or self.kv_heads is None or self.heads % self.kv_heads
        ):
            raise ValueError(
                f"attention: the key/value heads ({self.kv_heads}) must divide the query "
                f"heads ({self.heads})."
            )

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return 1 if self.heads == self.kv_heads else self.heads // self.kv_heads

    @property
    def compute_dtype(self) -> str:
        return "float32" if self.dtype in HALF_DTYPES else self.dtype

    @property
    def needs_matrix(self) -> bool:
        """The weights, dropout or a score soft-cap need the whole score matrix: only the
        explicit path."""
        return self.weights or self.dropout or self.softcap

    @property
    def effective_causal(self) -> bool:
        """Causal and more than one query (one query sees every key bottom-right)."""
        return self.causal and self.queries != 1

    @property
    def masked(self) -> bool:
        return self.mask or self.lengths != "none" or self.effective_causal


@dataclass(frozen=True)
class AttentionPlan:
    """How one call runs; see the module docstring for the meaning of each mode.

    Construction refuses combinations no path implements (``ValueError``): blocks
    without the blockwise path (or the reverse), the kernel's causal flag off the fused
    path or with lengths, per-block masks off the blockwise path, weights or dropout off
    the explicit path, an empty-row mode of another path, slices of the batch
    (``chunks > 1``) off the explicit path or with weights or dropout, the explicit
    path's own backward pass (``backward`` other than ``"autodiff"``) elsewhere or
    with weights, dropout or a bias.
    """

    path: Path
    causal: CausalMode = "none"
    lengths: LengthsMode = "none"
    empty_rows: EmptyRows = "none"
    blocks: tuple[int, int] | None = None
    repeat_kv: bool = False
    screen: Screen = "none"
    weights: bool = False
    dropout: bool = False
    chunks: int = 1
    backward: Backward = "autodiff"
    bias: bool = False
    softcap: bool = False

    def __post_init__(self) -> None:
        if self.path not in _PATHS:
            raise ValueError(f"AttentionPlan: unknown path {self.path!r}.")
        for problem in _plan_problems(self):
            raise ValueError(f"AttentionPlan: {problem}; received {self!r}.")

    @property
    def fold_masks(self) -> bool:
        """The lengths or the causal mask are folded into one mask before the direct path."""
        return self.lengths == "mask" or self.causal == "mask"


def _plan_problems(plan: AttentionPlan) -> list[str]:
    blockwise = plan.path == "blockwise"
    rules = [
        (blockwise == (plan.blocks is None), "blocks go with the blockwise path only"),
        (plan.causal == "kernel" and plan.path != "fused", "the kernel's causal flag is fused"),
        (plan.causal == "kernel" and plan.lengths != "none", "the kernel's flag takes no lengths"),
        (
            not blockwise and "blocks" in (plan.causal, plan.lengths),
            "per-block masks are blockwise",
        ),
        (blockwise and "mask" in (plan.causal, plan.lengths), "the blockwise path folds nothing"),
        (
            (plan.weights or plan.dropout) and plan.path != "explicit",
            "weights need the explicit path",
        ),
        (plan.empty_rows not in _EMPTY_ROWS[plan.path], "this path treats empty rows otherwise"),
        (plan.repeat_kv and plan.path == "explicit", "the explicit path keeps heads grouped"),
        (
            plan.screen == "none" and plan.path == "fused",
            "the fused kernel needs its query screened",
        ),
        (
            isinstance(plan.chunks, bool) or not isinstance(plan.chunks, int) or plan.chunks < 1,
            "chunks is an int >= 1",
        ),
        (
            plan.chunks != 1 and (plan.path != "explicit" or plan.weights or plan.dropout),
            "slices of the batch go with the explicit path without weights or dropout",
        ),
        (plan.backward not in BACKWARDS, f"backward is one of {BACKWARDS}"),
        (
            plan.backward != "autodiff"
            and (plan.path != "explicit" or plan.weights or plan.dropout or plan.bias),
            "the own backward pass goes with the explicit path without weights, dropout or bias",
        ),
        (
            plan.softcap and (plan.path != "explicit" or plan.backward != "autodiff"),
            "a score soft-cap goes with the explicit path, differentiated automatically",
        ),
    ]
    return [message for broken, message in rules if broken]


_EMPTY_ROWS = {
    "fused": ("none", "kernel_then_zero"),
    "explicit": ("none", "zero_weights", "zero_outputs"),
    "blockwise": ("online",),
}


def _eligible(spec: AttentionSpec) -> bool:
    """The backend has a fused kernel for these arrays: float32 compute, value width
    == key width (Keras' fused attention fails otherwise on jax) and no additive bias (the
    namespace's kernel takes a boolean mask only)."""
    return (
        spec.capabilities.has_fused_attention
        and not spec.bias
        and spec.compute_dtype == "float32"
        and spec.key_width is not None
        and spec.key_width == spec.value_width
    )


def _streams(spec: AttentionSpec) -> bool:
    """The fused kernel runs in memory linear in the lengths: the kernel streams, there is
    no caller mask, lengths (if any) are one per sequence (a mask broadcast over the
    queries) and a causal mask is square without lengths (the kernel's own flag). No
    blocks are needed then, whatever the budget; a forced block size still takes them, and
    so does a fused kernel refused by the caller (``fused_faster`` False, which only
    ``settings(fused_attention=False)`` gives a streaming kernel: it is not timed)."""
    if spec.block_size is not None or spec.needs_matrix or spec.mask:
        return False
    if spec.fused_faster is False:
        return False
    if not spec.capabilities.fused_attention_streams or not _eligible(spec):
        return False
    causal = spec.effective_causal
    if spec.lengths == "per_query" or (spec.lengths != "none" and causal):
        return False
    return not causal or (spec.queries is not None and spec.queries == spec.keys)


def _itemsize(spec: AttentionSpec) -> int:
    return 8 if spec.compute_dtype == "float64" else 4


def _blocks(spec: AttentionSpec) -> tuple[int, int] | None:
    """The blockwise path's blocks, or None for a direct path: forced blocks, or scores
    over the budget."""
    if spec.needs_matrix or _streams(spec):
        return None
    return plan_blocks(
        (spec.batch, spec.heads, spec.queries, spec.keys),
        _itemsize(spec),
        spec.block_size,
        traced=spec.traced,
        budget=spec.memory_budget,
    )


def wants_timing(spec: AttentionSpec) -> bool:
    """The plan depends on whether the fused kernel is faster here (``fused_faster``): it
    is eligible, not required by the budget (streaming) and the direct path is taken."""
    return (
        _eligible(spec) and not spec.needs_matrix and not _streams(spec) and _blocks(spec) is None
    )


def wants_chunks(spec: AttentionSpec) -> bool:
    """The explicit path's slices of the batch are to be chosen (`default_chunks`, or
    measured by `multiattn.tuning.attention_chunks` under autotune): none were asked for
    (``chunks`` None), the namespace maps batches, the call is compiled (``traced``: one program runs the
    slices) or the namespace's slices pay eagerly too (``maps_batch_eagerly``: Paddle's
    run side by side; other eager calls run in one piece), the batch is known and above
    1, and the plan is the explicit path without weights or dropout."""
    caps = spec.capabilities
    return (
        spec.chunks is None
        and caps.maps_batch
        and (spec.traced or caps.maps_batch_eagerly)
        and (spec.batch or 0) > 1
        and not spec.needs_matrix
        and plan_attention(spec).path == "explicit"
    )


def wants_backward_timing(spec: AttentionSpec) -> bool:
    """Whether how the explicit path is differentiated is to be measured
    (`multiattn.tuning.attention_backward`): not decided (``backward`` None), the call
    is compiled (eager calls are differentiated automatically), and the plan is the
    explicit path without weights, dropout or bias."""
    return (
        spec.backward is None
        and spec.traced
        and not spec.needs_matrix
        and not spec.bias
        and plan_attention(spec).path == "explicit"
    )


#: glibc's largest dynamic mapping threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``,
#: documented in ``mallopt(3)``): a buffer above it is mapped afresh on every allocation
#: and handed back to the kernel when freed, so the kernel zeroes its pages on every call.
MMAP_THRESHOLD_MAX = 32 << 20
#: The most bytes of scores one slice of `default_chunks` holds: half the threshold.
SLICE_SCORE_BYTES = MMAP_THRESHOLD_MAX // 2


@functools.cache
def glibc() -> bool:
    """Whether this process runs on glibc (``confstr(_CS_GNU_LIBC_VERSION)``, which only
    glibc answers), asked once per process."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr, or not that name
        return False


def default_chunks(spec: AttentionSpec, xla_device: str | None) -> int:
    """The slices of the batch the explicit path runs in where nothing is measured, from
    static facts: where XLA compiles the call for a CPU (``xla_device`` ``"cpu"``, the
    namespace's ``xla_device``) and the C library is glibc (whose allocator XLA:CPU's
    buffers come from), a score matrix above `MMAP_THRESHOLD_MAX` is cut into the fewest
    power-of-two slices (dividing the batch, at most 16) whose scores take at most
    `SLICE_SCORE_BYTES` each, so that each slice's buffer is kept by the allocator from
    call to call instead of being mapped and zeroed afresh; elsewhere one piece."""
    sizes = (spec.batch, spec.heads, spec.queries, spec.keys)
    if None in sizes or xla_device != "cpu" or not glibc():
        return 1
    b, h, tq, tk = sizes
    scores = b * h * tq * tk * _itemsize(spec)
    if scores <= MMAP_THRESHOLD_MAX:
        return 1
    counts = [c for c in (2, 4, 8, 16) if c <= b and b % c == 0]
    fitting = [c for c in counts if scores // c <= SLICE_SCORE_BYTES]
    return fitting[0] if fitting else max(counts, default=1)


def joins_projections(backend: str, xla_device: str | None, rows: int | None) -> bool:
    """Whether self-attention's query, key and value projections run as one product over
    their joined kernels (`multiattn.layers._base.joined_linear`), from static facts:
    only where TensorFlow's XLA compiles the call for a CPU and it projects a single row
    (``rows``: the input's leading sizes multiplied; a batch-1 decoding step). There, at
    GPT-2 small's size in the compiled decoding loop, the joined product made a step
    about a third faster; at batch 8 it was slower, and on jax no faster, so everywhere
    else each projection is its own product (the paired runs: ``docs/benchmarks.md``,
    "Issue 46's paired runs")."""
    return backend == "tensorflow" and xla_device == "cpu" and rows == 1


def with_default_chunks(spec: AttentionSpec, xla_device: str | None) -> AttentionSpec:
    """``spec`` with `default_chunks` as its ``chunks`` where the slices are to be chosen
    (`wants_chunks`), else ``spec`` itself: what a call gets where no tuner times the
    slices."""
    if not wants_chunks(spec):
        return spec
    return dataclasses.replace(spec, chunks=default_chunks(spec, xla_device))


def largest_divisor(batch: int, wanted: int) -> int:
    """The largest divisor of ``batch`` not above ``wanted`` (at least 1): the slices of
    a batch of ``batch`` rows that a ``chunks`` of ``wanted`` gives."""
    return max(d for d in range(1, max(1, min(wanted, batch)) + 1) if batch % d == 0)


def _chunks(spec: AttentionSpec) -> int:
    """`largest_divisor` of the batch and ``spec.chunks``; 1 where the namespace does
    not map batches, the batch is unknown or the whole weight matrix is needed."""
    wanted = spec.chunks or 1
    if wanted <= 1 or not spec.capabilities.maps_batch or not spec.batch or spec.needs_matrix:
        return 1
    return largest_divisor(spec.batch, wanted)


def _use_fused(spec: AttentionSpec) -> bool:
    if spec.needs_matrix or not _eligible(spec):
        return False
    if _streams(spec):
        return True
    faster = spec.fused_faster
    return spec.capabilities.fused_attention_pays if faster is None else faster


def plan_attention(spec: AttentionSpec) -> AttentionPlan:
    """The plan of the call ``spec`` describes; pure (no tensor, no framework)."""
    blocks = _blocks(spec)
    if blocks is not None:
        return _blockwise_plan(spec, blocks)
    if _use_fused(spec):
        return _fused_plan(spec)
    return _explicit_plan(spec)


def _blockwise_plan(spec: AttentionSpec, blocks: tuple[int, int]) -> AttentionPlan:
    return AttentionPlan(
        path="blockwise",
        causal="blocks" if spec.effective_causal else "none",
        lengths="none" if spec.lengths == "none" else "blocks",
        empty_rows="online",
        blocks=blocks,
        repeat_kv=spec.groups > 1,
        screen="all" if spec.masked else "none",
    )


def _fused_plan(spec: AttentionSpec) -> AttentionPlan:
    causal = "none"
    if spec.effective_causal:
        causal = "kernel" if _streams(spec) else "mask"  # streams: equal lengths
    lengths = "none" if spec.lengths == "none" else "mask"
    folded = spec.mask or "mask" in (lengths, causal)
    return AttentionPlan(
        path="fused",
        causal=causal,
        lengths=lengths,
        empty_rows="kernel_then_zero" if folded else "none",
        repeat_kv=spec.groups > 1 and not spec.capabilities.fused_attention_groups,
        screen="all" if spec.masked else "query",
    )


def _explicit_plan(spec: AttentionSpec) -> AttentionPlan:
    empty = "none"
    if spec.masked:
        empty = "zero_weights" if spec.weights else "zero_outputs"
    return AttentionPlan(
        path="explicit",
        causal="mask" if spec.effective_causal else "none",
        lengths="none" if spec.lengths == "none" else "mask",
        empty_rows=empty,
        screen="all" if spec.masked else "none",
        weights=spec.weights,
        dropout=spec.dropout,
        chunks=_chunks(spec),
        backward=_backward(spec),
        bias=spec.bias,
        softcap=spec.softcap,
    )


def _backward(spec: AttentionSpec) -> Backward:
    """The spec's ``backward`` where the explicit path's own backward pass applies (no
    weights, dropout or bias), else automatic differentiation."""
    if spec.backward is None or spec.needs_matrix or spec.bias:
        return "autodiff"
    return spec.backward

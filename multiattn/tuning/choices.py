"""The two tuners: `Measured` (times the choices, ``settings(autotune=True)``) and
`Fixed` (gives them, ``settings(autotune=Fixed(...))``).

A tuner is what `multiattn.config.tuner` returns when a call's choices are not left to
their static defaults; the attention planner (`multiattn.ops.attention`), PyTorch's
projections (`multiattn.namespaces.keras`) and the Paddle document layers ask it through that
one function, and never import this package. Its three methods:

* ``attention(ops, spec, query, key, value, kv_heads_first)``: the
  `multiattn.ops.plan.AttentionSpec` with its choices filled in (``fused_faster``,
  ``chunks``, ``backward``);
* ``linear(a, b, bias)``: ``a (N, K) @ b (K, M) (+ bias (M,))`` for PyTorch CPU
  tensors in float32, or None for PyTorch's own product (the default);
* ``batch_slices(cls, candidates, counts, measurable, why)``: the slices of the batch
  the Paddle document layers run in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..ops import plan
from ..ops.attention import explicit_unmasked, own_backward_unmasked
from ._store import MARGIN, decide, torch_is_tracing
from .attention import attention_backward, attention_chunks, fused_attention_pays

__all__ = ["Fixed", "Measured"]


class Measured:
    """The tuner of ``settings(autotune=True)``: each choice the call leaves open is timed
    on the running machine, once per shape class (`multiattn.tuning.decide`); decisions
    loaded by `multiattn.tuning.load_decisions` are used as if timed here."""

    def attention(self, ops, spec, query, key, value, kv_heads_first):
        """`fused_attention_pays`, `attention_chunks` and `attention_backward`, each where
        the plan depends on it (`multiattn.ops.plan.wants_timing` and the like), on the
        core's explicit path without a mask and its own backward pass."""
        qkv = (query, key, value)
        if spec.fused_faster is None and plan.wants_timing(spec):
            faster = fused_attention_pays(ops, *qkv, explicit_unmasked, kv_heads_first)
            spec = dataclasses.replace(spec, fused_faster=faster)
        if plan.wants_chunks(spec):
            default = plan.default_chunks(spec, ops.xla_device(query))
            chunks = attention_chunks(ops, *qkv, explicit_unmasked, kv_heads_first, default)
            spec = dataclasses.replace(spec, chunks=chunks)
        if plan.wants_backward_timing(spec):
            chunks = plan.plan_attention(spec).chunks
            backward = attention_backward(
                ops, *qkv, explicit_unmasked, own_backward_unmasked, chunks, kv_heads_first
            )
            spec = dataclasses.replace(spec, backward=backward)
        return spec

    def linear(self, a: Any, b: Any, bias: Any) -> Any:
        """Each product of the projection (forward, and its two gradients) on oneDNN or
        BLAS, whichever `multiattn.tuning.torch_linear.route` measured faster; None
        (PyTorch's own product) while a compiler traces the call or where this PyTorch
        has no oneDNN."""
        from . import torch_linear

        if torch_is_tracing() or not torch_linear.available():
            return None
        return torch_linear.matmul_bias(a, b, bias, measure=True)

    def batch_slices(self, cls: Mapping[str, Any], candidates, counts, measurable, why) -> int:
        """The count of ``counts`` measured fastest (one piece unless another is more than
        `MARGIN` faster; ties go to the fewest)."""
        choice = decide(
            "paddle-batch-slices", cls, candidates, fallback="1", measurable=measurable,
            reason=why, margin=MARGIN, prefer=[str(c) for c in counts],
        )  # fmt: skip
        return int(choice)


@dataclasses.dataclass(frozen=True)
class Fixed:
    """A tuner that times nothing and gives the choices named here wherever a call allows
    them (the plan still refuses what a call cannot take: slices with the weights
    returned, the own backward pass with a bias, ...); a choice left None takes its
    static default. For bitwise-repeatable runs, or to run a path on purpose::

        with settings(autotune=Fixed(attention_chunks=4, attention_backward="recompute")):
            ...

    Args:
        attention_chunks: at most this many slices of the batch for the explicit attention
            path (the largest divisor of the batch not above it), a positive int; also the
            Paddle document layers' slices.
        attention_backward: how the explicit path is differentiated, one of
            `multiattn.ops.plan.BACKWARDS` (``"autodiff"``, ``"recompute"``, ``"saved"``).
        torch_linear: ``"onednn"`` runs PyTorch CPU float32 projections on oneDNN's linear
            operator (where PyTorch has it), ``"blas"`` on PyTorch's own product (the
            default).

    The blockwise path is not a choice here: ``settings(block_size=...)`` forces it.
    """

    attention_chunks: int | None = None
    attention_backward: str | None = None
    torch_linear: str | None = None

    def __post_init__(self) -> None:
        n = self.attention_chunks
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"Fixed: `attention_chunks` must be a positive int; received {n!r}.")
        if self.attention_backward not in (None, *plan.BACKWARDS):
            raise ValueError(
                f"Fixed: `attention_backward` must be one of {plan.BACKWARDS} or None; "
                f"received {self.attention_backward!r}."
            )
        if self.torch_linear not in (None, "onednn", "blas"):
            raise ValueError(
                f"Fixed: `torch_linear` must be 'onednn', 'blas' or None; received "
                f"{self.torch_linear!r}."
            )

    def attention(self, ops, spec, query, key, value, kv_heads_first):
        """The spec with the choices given here; the slices' static default where none."""
        given = {"chunks": self.attention_chunks, "backward": self.attention_backward}
        spec = dataclasses.replace(spec, **{k: v for k, v in given.items() if v is not None})
        return plan.with_default_chunks(spec, ops.xla_device(query))

    def linear(self, a: Any, b: Any, bias: Any) -> Any:
        """oneDNN's product where ``torch_linear="onednn"`` (and this PyTorch has it),
        else None (PyTorch's own product)."""
        from . import torch_linear

        if self.torch_linear != "onednn" or not torch_linear.available():
            return None
        return torch_linear.matmul_bias(a, b, bias, measure=False)

    def batch_slices(self, cls: Mapping[str, Any], candidates, counts, measurable, why) -> int:
        """The largest divisor of the batch (``cls["batch"]``) not above
        ``attention_chunks`` (one piece where None)."""
        return plan.largest_divisor(int(cls["batch"]), self.attention_chunks or 1)

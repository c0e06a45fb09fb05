"""The decoding step on PyTorch, recorded once and replayed (internal).

An eager decoding step of a small model spends most of its time in Python (Keras'
dispatch, the layers' checks), not in its tensor operations. `TracedStep` records the
operations of one step with ``torch.jit.trace``, once per set of input shapes and dtypes,
and replays the recording for every later step of that shape: the tensor work alone.
``generate`` uses it on Keras' torch backend (the strategy
`multiattn.decoding.strategies.TracedLoop`, its default there); ``generate(...,
strategy="eager")`` keeps the eager step.

What makes a recording replay correctly for other inputs:

* every tensor argument (token ids, positions, caches, the cache index, masks) is an
  input of the recording; NumPy arrays and NumPy scalars are turned into tensors first,
  so the cache index is recorded as a tensor, not as a number;
* while it records, the torch namespace treats every tensor as symbolic
  (`multiattn.namespaces.keras` ``is_symbolic``), as under ``jax.jit``: the cache index is a
  traced position (a masked attention over every cache slot and a select that writes the
  new keys and values) rather than a value read once, and ``cond`` runs both branches and
  selects between their results instead of recording the branch taken;
* where the step branches on a tensor's value (``cond``: the attention's test for
  non-finite inputs), the recording keeps the branch taken and returns the predicate
  as a guard; a replay whose guards take another branch is thrown away and that step
  runs eagerly (`multiattn.namespaces.keras.torch_trace_guards`). Inside
  `multiattn.namespaces.keras.owned_caches` the thrown-away replay has already written its
  keys and values into the caches; the eager step computes and writes the same ones;
* the weights are constants of the recording: it is traced from a module that holds
  them (read through ``keras.StatelessScope``) and frozen (``torch.jit.freeze``), so what
  depends on the weights alone (the joined q/k/v kernels, casts, reshapes) is computed
  once, when it is made. `TracedStep.sync` (once per ``generate``) reads the weights and
  drops every recording when one has changed since (a new tensor, or an in-place
  update: PyTorch's version counter), so a kept recording follows training and
  ``set_weights``. At most `KEPT` recordings are kept (the oldest goes first): each holds
  its folded constants (the joined kernels, where the step joins them);
* arguments that are not arrays (None, Python numbers) are part of the key that selects a
  recording, with the shapes and dtypes of the tensors, the enclosing
  `multiattn.namespaces.keras.owned_caches` block (what it vouches for changes what is
  recorded) and the settings that shape attention (`multiattn.config.fingerprint`: a
  ``settings(fused_attention=False)`` block records a step of its own).

It runs under ``torch.no_grad()``: generation needs no gradients. A step that cannot be
recorded runs eagerly, with a ``RuntimeWarning`` that says why.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["KEPT", "TracedStep"]

#: The recordings a `TracedStep` keeps, one per set of shapes (prompt length and
#: ``max_new_tokens`` give the cache length).
KEPT = 8


@dataclass(frozen=True, repr=False)
class _Slot:
    """The place of the ``index``-th tensor in an argument or result structure."""

    index: int

    def __repr__(self) -> str:  # part of every step's key: short, and no recursion guard
        return f"@{self.index}"


def _split(x: Any, tensors: list, torch: Any) -> Any:
    """``x`` with each array replaced by a `_Slot` and appended to ``tensors`` (as a
    torch tensor); lists and tuples are walked, anything else is kept as it is."""
    if isinstance(x, (list, tuple)):
        return type(x)(_split(v, tensors, torch) for v in x)
    if isinstance(x, torch.Tensor):
        tensors.append(x)
    elif isinstance(x, (np.ndarray, np.generic)):
        tensors.append(torch.from_numpy(np.asarray(x)))
    else:
        return x
    return _Slot(len(tensors) - 1)


def _fill(skeleton: Any, tensors: Any) -> Any:
    """The inverse of `_split`."""
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return tensors[skeleton.index] if isinstance(skeleton, _Slot) else skeleton


class TracedStep:
    """``step(*args)`` replayed from ``torch.jit.trace`` recordings (see the module
    docstring); ``variables`` are the Keras variables ``step`` reads."""

    def __init__(self, step: Callable[..., Any], variables: list) -> None:
        self._step = step
        self._variables = variables
        #: key -> (recording, result skeleton, the branches its guards took), or None
        #: where recording failed
        self._recordings: dict[Any, tuple[Any, Any, tuple] | None] = {}
        self._values: list | None = None
        self._stamp: tuple = ()

    def sync(self) -> None:
        """Read the weights now, once for the replays that follow (``generate`` calls it
        once per call: reading some 70 Keras variables costs about a fifth of a small
        model's step); drop the recordings made with other weights."""
        values = [v.value for v in self._variables]
        stamp = tuple((id(t), t._version) for t in values)
        if stamp != self._stamp:
            self._recordings.clear()
            self._values, self._stamp = values, stamp

    def __call__(self, *args: Any) -> Any:
        import torch

        from .. import config
        from ..namespaces.keras import cache_scope

        tensors: list = []
        skeleton = _split(args, tensors, torch)
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensors)
        key = (repr(skeleton), shapes, cache_scope(), config.fingerprint())
        if self._values is None:
            self.sync()
        with torch.no_grad():
            recording = self._recordings.get(key, False)
            if recording is False:
                recording = self._keep(key, self._record(skeleton, tensors))
            if recording is None:
                return self._step(*args)
            frozen, result, taken = recording
            out = frozen(tensors)
            guards, out = out[: len(taken)], out[len(taken) :]
            if any(bool(g) != t for g, t in zip(guards, taken)):
                return self._step(*args)
            return _fill(result, out)

    def _keep(self, key: Any, recording: Any) -> Any:
        while len(self._recordings) >= KEPT:
            del self._recordings[next(iter(self._recordings))]
        self._recordings[key] = recording
        return recording

    def _record(self, skeleton: Any, tensors: list) -> tuple[Any, Any, tuple] | None:
        import keras
        import torch

        from ..namespaces.keras import torch_trace_guards

        variables, step, result, taken = self._variables, self._step, [], []

        class Weights(torch.nn.Module):
            """The step with the weights as buffers: constants once frozen."""

            def __init__(self, values: list) -> None:
                super().__init__()
                for i, value in enumerate(values):
                    self.register_buffer(f"w{i}", value.detach())

            def forward(self, flat: list) -> tuple:
                values = [getattr(self, f"w{i}") for i in range(len(variables))]
                with torch_trace_guards() as guards:
                    with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                        out = step(*_fill(skeleton, flat))
                leaves: list = []
                result.append(_split(out, leaves, torch))
                taken[:] = [t for _, t in guards]
                return (*(g for g, _ in guards), *leaves)

        try:
            with warnings.catch_warnings():
                # The tracer's notes on shapes read as Python numbers (static here) and
                # the deprecation notice of torch.jit.trace.
                warnings.simplefilter("ignore")
                traced = torch.jit.trace(
                    Weights(self._values).eval(), (tensors,), check_trace=False, strict=False
                )
                frozen = torch.jit.freeze(traced)
        except Exception as err:  # any failure: this shape runs eagerly
            warnings.warn(
                f"generate: the decoding step could not be recorded with torch.jit.trace "
                f"({type(err).__name__}: {err}); it runs eagerly for these shapes.",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        return frozen, result[0], tuple(taken)

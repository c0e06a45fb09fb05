"""How a candidate is timed: as the caller's code is compiled, outside its trace.

Shared by the measured choices of `multiattn.tuning`: random inputs of a decision
(`_random_tensors`), candidates compiled as the caller is (`_Compilation`, `_compiled`)
and run outside a ``jax.jit`` / ``tf.function`` trace (`_eager`), forward and backward
(`_and_backward`), and `decide` called that way (`_decide_eagerly`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import _static_dim
from ._store import MARGIN, decide

#: About the most floating-point operations one timed call performs (rows are cut to fit).
FLOP_CAP = 1 << 28


def _random_tensors(ops: Any, shapes: Sequence[tuple | None], dtype: str, like: Any) -> list:
    """A decision's inputs: standard normal tensors of ``shapes`` (None for a shape of
    None), the same on every run (seed 0), in ``dtype`` (drawn in float32 for half
    precision), on ``like``'s device where PyTorch keeps it off the CPU. Call inside
    `_eager`."""
    rng = np.random.default_rng(0)
    np_dtype = "float64" if dtype == "float64" else "float32"
    elsewhere = ops.backend == "torch" and _device(ops.backend, like) not in ("cpu", None)

    def one(shape: tuple) -> Any:
        t = ops.cast(ops.convert_to_tensor(rng.standard_normal(shape).astype(np_dtype)), dtype)
        return t.to(like.device) if elsewhere else t

    return [None if shape is None else one(shape) for shape in shapes]


def _and_backward(fn: Callable[..., Any], backend: str = "torch") -> Callable[..., Any]:
    """``fn`` followed by the gradients of the sum of its outputs (an array or a list of
    them) with respect to its tensor arguments: a candidate timed forward and backward
    (``torch.autograd.grad`` on PyTorch, whose inputs require gradients; ``jax.grad``;
    ``tf.gradients`` inside the compiled function on TensorFlow). On jax and TensorFlow
    the sum is of the outputs' squares: with the sum itself the output's gradient is a
    constant, which lets XLA simplify the backward pass of the explicit attention path
    (faster with the sum than with the squares at ``(8, 512, 8, 64)`` in 4 slices;
    measured: docs/benchmarks.md, 'Measurements behind the defaults') where a real loss
    would not."""
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def jax_total(*tensors: Any) -> Any:
            return sum(jnp.sum(o * o) for o in jax.tree_util.tree_leaves(fn(*tensors)))

        return lambda *tensors: jax.grad(jax_total, tuple(range(len(tensors))))(*tensors)
    if backend == "tensorflow":
        import tensorflow as tf

        def tf_run(*tensors: Any) -> Any:
            # tf.gradients, not a tape: the decision runs in tf.init_scope, which stops
            # every tape from recording, and the candidate runs as a graph anyway
            total = tf.add_n([tf.reduce_sum(o * o) for o in tf.nest.flatten(fn(*tensors))])
            return tf.gradients(total, list(tensors))

        return tf_run

    def run(*tensors: Any) -> Any:
        import torch

        outs = fn(*tensors)
        total = sum(out.sum() for out in (outs if isinstance(outs, (list, tuple)) else [outs]))
        leaves = [t for t in tensors if t is not None]
        return torch.autograd.grad(total, leaves)

    return run


def _decide_eagerly(
    op: str,
    cls: dict,
    candidates: Callable,
    fallback: str,
    measurable: bool,
    why: str,
    prefer: Sequence[str] = (),
    margin: float = MARGIN,
) -> str:
    """`decide` for a class whose ``backend`` and ``device`` fields name the framework,
    timing outside any ``jax.jit`` / ``tf.function`` trace under way."""
    backend = cls["backend"]
    with _eager(backend) if measurable else contextlib.nullcontext():
        return decide(
            op,
            cls,
            candidates,
            fallback=fallback,
            measurable=measurable,
            reason=why,
            sync=_sync(backend, cls["device"]),
            margin=margin,
            prefer=prefer,
        )


def _static(n: Any) -> int | None:
    return _static_dim(n)  # None for a symbolic size (JAX shape polymorphism, graphs)


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


def _can_time(ops: Any, backend: str, x: Any) -> tuple[bool, str]:
    """Whether `fused_attention_pays` can time now, and why not."""
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(x, keras.KerasTensor):
        return False, "Keras symbolic tensors (nothing runs)"
    if backend == "torch":
        if torch_is_tracing():
            return False, "torch.compile or torch.jit traces the call"
        if getattr(x, "device", None) is not None and x.device.type == "meta":
            return False, "meta tensors (shape inference)"
    return True, ""


def torch_is_tracing() -> bool:
    """True while ``torch.compile`` (dynamo), ``torch.export`` or ``torch.jit`` traces the
    caller: nothing may be timed then (the timing code would be traced)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling():
        return True
    return bool(torch.jit.is_tracing() or torch.jit.is_scripting())


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


@dataclass(frozen=True)
class _Compilation:
    """How the caller's code is compiled, for timing candidates the same way: whether it
    is traced (``jax.jit``, ``tf.function``) and, on TensorFlow, compiled by XLA."""

    traced: bool = False
    xla: bool = False

    @classmethod
    def of(cls, ops: Any, x: Any) -> _Compilation:
        """Read at the decision point, inside the caller's trace."""
        return cls(bool(ops.is_symbolic(x)), ops.xla_device(x) is not None)

    def passes(self, flops: int) -> int:
        """Passes of a candidate of ``flops`` per timed call: traced, as many as reach
        `FLOP_CAP` (at most 64), so that a candidate of a few microseconds is timed by its
        work inside compiled code, not by the cost of a call; one otherwise."""
        return max(1, min(64, FLOP_CAP // max(flops, 1))) if self.traced else 1


def _compiled(
    backend: str,
    fn: Callable[..., Any],
    tensors: list,
    how: _Compilation = _Compilation(),
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


def _sync(backend: str, device: str | None) -> Callable[[Any], Any] | None:
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

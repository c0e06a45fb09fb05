"""How the core reaches its array operations.

Every core function asks `get_ops` for the namespace that holds the operations
it needs, passing the tensors it received. By default this is ``keras.ops`` (plus the
few helpers the core needs from ``keras.random`` and ``keras.backend``), which is what
every Keras backend uses. A framework without a Keras backend (Paddle) registers a
namespace of its own that implements the same subset; the core then runs unchanged
on that framework's tensors.

Nothing here imports a framework eagerly: a registered namespace is only consulted
when its framework's module is already in ``sys.modules`` (the approach einops uses to
find a tensor's framework).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["KerasNamespace", "get_ops", "register_namespace"]


class KerasNamespace:
    """``keras.ops`` plus the helpers the core uses from other Keras modules.

    Attribute access falls through to ``keras.ops``; the extra methods below are the only
    operations the core needs that ``keras.ops`` does not hold.
    """

    name = "keras"

    def __init__(self) -> None:
        import keras

        self._keras = keras
        self._ops = keras.ops

    def __getattr__(self, item: str) -> Any:
        return getattr(self._ops, item)

    def einsum(self, subscripts: str, *operands: Any) -> Any:
        """``keras.ops.einsum`` that keeps float64.

        Keras promotes float64 to float32 on the numpy and torch backends (its type
        lattice follows JAX's default of 32-bit floats); float64 contractions there go to
        the backend's own einsum so that float64 stays float64.
        """
        backend = self._keras.backend.backend()
        if backend in ("numpy", "torch") and all(self.dtype_name(o) == "float64" for o in operands):
            operands = [self._ops.convert_to_tensor(o) for o in operands]
            if backend == "numpy":
                import numpy as np

                return np.einsum(subscripts, *operands)
            import torch

            return torch.einsum(subscripts, *operands)
        return self._ops.einsum(subscripts, *operands)

    def tanh(self, x: Any) -> Any:
        """``keras.ops.tanh`` that keeps float64 (Keras' jax backend returns float32)."""
        if self._keras.backend.backend() == "jax" and self.dtype_name(x) == "float64":
            import jax.numpy as jnp

            return jnp.tanh(x)
        return self._ops.tanh(x)

    def dtype_name(self, x: Any) -> str:
        """The standardised dtype name of ``x`` (``"float32"``, ``"bool"``, ...)."""
        return self._keras.backend.standardize_dtype(x.dtype)

    def dropout(self, x: Any, rate: float, seed: Any) -> Any:
        """Inverted dropout of ``x`` with drop probability ``rate``."""
        return self._keras.random.dropout(x, rate, seed=seed)

    def linear(self, x: Any, kernel: Any, bias: Any = None, contract: int = 1) -> Any:
        """A dense projection: ``x`` ``(..., *k)`` contracted with ``kernel`` ``(*k, *n)``
        over the ``contract`` axes ``k``, plus ``bias`` ``(*n)`` (or None); returns
        ``(..., *n)`` in the dtype of ``x`` and ``kernel`` (which must agree).

        ``keras.ops.einsum`` on every backend, except float32 CPU tensors on PyTorch
        with oneDNN: there the product runs as one ``(N, K) @ (K, M)`` matrix product
        with the bias added inside it, on oneDNN or PyTorch's BLAS, whichever
        `multiattn.tuning` measured faster for its shape class (or as
        `multiattn.config.set_torch_onednn` forces).
        """
        route = self._torch_route(x, kernel, bias)
        if route is not None:
            from . import _torch_matmul

            shape = tuple(kernel.shape)
            k = math.prod(shape[:contract])
            n = math.prod(shape[contract:])
            y = _torch_matmul.matmul_bias(
                x.reshape(-1, k),
                kernel.reshape(k, n),
                None if bias is None else bias.reshape(n),
                route == "measure",
            )
            return y.reshape(*x.shape[: x.dim() - contract], *shape[contract:])
        # Explicit subscripts: TensorFlow's einsum gradient with "..." broadcasts the
        # operands against each other (an (batch, seq, in, out) temporary).
        lead = "ABCDEFGH"[: len(x.shape) - contract]
        k, n = "abcdefgh"[:contract], "abcdefgh"[contract : len(kernel.shape)]
        y = self.einsum(f"{lead}{k},{k}{n}->{lead}{n}", x, kernel)
        return y if bias is None else y + bias

    def _torch_route(self, x: Any, kernel: Any, bias: Any) -> str | None:
        """How `linear` runs on torch: ``"onednn"`` (forced), ``"measure"`` (each product
        on the library measured faster) or None (``einsum``: other backends, dtypes and
        devices, no oneDNN in this PyTorch, BLAS forced, or a compiler tracing the call)."""
        if self._keras.backend.backend() != "torch":
            return None
        from . import config

        setting = config.get_torch_onednn()
        if setting is False:
            return None
        from . import _torch_matmul

        tensors = [t for t in (x, kernel, bias) if t is not None]
        import torch

        if not (
            _torch_matmul.available()
            and all(isinstance(t, torch.Tensor) for t in tensors)
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and x.numel() > 0
        ):
            return None
        if setting is True:
            return "onednn"
        from . import tuning

        return None if tuning.torch_is_tracing() else "measure"

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
        gradient per input. ``forward`` runs once; nothing it computes is kept for
        differentiation except ``saved``. Tensors ``forward`` and ``backward`` close over
        get no gradient. Differentiable once: ``backward`` treats ``saved`` as constants
        (PyTorch raises on a second differentiation). Backends: ``jax.custom_vjp``, a
        ``torch.autograd.Function``, ``tf.custom_gradient``; on numpy (no gradients)
        ``forward`` alone.
        """
        backend = self._keras.backend.backend()
        if backend == "jax":
            import jax

            @jax.custom_vjp
            def call(*args):
                return forward(*args)[0]

            call.defvjp(forward, lambda saved, grad: tuple(backward(saved, grad)))
            return call(*inputs)
        if backend == "torch":
            return _torch_custom_gradient().apply(forward, backward, *inputs)
        if backend == "tensorflow":
            import tensorflow as tf

            @tf.custom_gradient
            def call(*args):
                out, saved = forward(*args)
                return out, lambda grad: list(backward(saved, grad))

            # Variables are read here, so that the function sees tensors only.
            return call(*(tf.convert_to_tensor(t) for t in inputs))
        return forward(*inputs)[0]

    def fused_attention(self, query, key, value, mask, scale, is_causal=False):
        """The backend's fused attention on ``(batch, seq, heads, dim)`` arrays
        (``is_causal``: top-left aligned, used by the core only when queries and keys are
        equally long; ``mask``: bool, True = may attend, rank 4, no row fully masked).

        On torch, PyTorch's ``scaled_dot_product_attention`` is called on ``(batch,
        heads, seq, dim)`` views of the inputs with the bool mask as it is:
        ``keras.ops.dot_product_attention`` copies the three inputs to contiguous
        tensors first and turns the mask into an additive float mask.
        """
        if self._keras.backend.backend() == "torch":
            import torch

            out = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (query, key, value)),
                attn_mask=mask,
                is_causal=is_causal,
                scale=scale,
            )
            return out.transpose(1, 2)
        return self._ops.dot_product_attention(
            query, key, value, mask=mask, scale=scale, is_causal=is_causal
        )

    def cond(self, pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        """``true_fn()`` if the scalar bool ``pred`` holds, else ``false_fn()``:
        ``keras.ops.cond``, except that on JAX a concrete ``pred`` (not under ``jax.jit``)
        picks its branch in Python: ``jax.lax.cond`` would compile both branches on every
        eager call. Under a trace (``jax.jit``, ``tf.function``, Keras symbolic tensors)
        both branches are traced and must return the same structure of tensors."""
        if self._keras.backend.backend() == "jax" and not self.is_symbolic(pred):
            return true_fn() if bool(pred) else false_fn()
        return self._ops.cond(pred, true_fn, false_fn)

    #: The backend's ``softmax`` gives exactly 0 to a score ``3.4e38`` below its row's
    #: maximum (the exponential underflows). True for every Keras backend; the core relies
    #: on it for masked scores on the attention path (see `multiattn.ops.masking`).
    softmax_exact_zeros = True

    @property
    def fused_attention_pays(self) -> bool:
        """Whether to take the backend's fused attention where it cannot be timed:
        `multiattn.tuning.fused_attention_pays` measures the choice on the running machine
        and falls back to this value for Keras symbolic tensors and under
        ``torch.compile``. False where the backend's fused attention was measured slower
        than the core's explicit path (`multiattn.ops.attention`) on the project's machine:

        * JAX on CPU: ``jax.nn.dot_product_attention`` (XLA) took 153 ms forward and
          263 ms forward+backward against 123 ms and 251 ms for the explicit path, on
          ``(8, 512, 8, 64)`` float32 under ``jax.jit`` (2-core CPU);
        * TensorFlow: Keras' ``dot_product_attention`` there is an explicit path itself,
          which scales the whole score matrix and contracts in ``(B, T, H, D)`` layout;
          the core's explicit path (head-major, queries scaled) was 6% to 13% faster
          forward and forward+backward in multi-head self-attention under
          ``tf.function`` (batch 8, length 512, width 512, 8 heads, float32).
        """
        backend = self._keras.backend.backend()
        if backend == "tensorflow":
            return False
        if backend != "jax":
            return True
        import jax

        return jax.default_backend() != "cpu"

    @property
    def fused_attention_streams(self) -> bool:
        """True when the backend's fused attention never forms the score matrix as long as
        its mask is None or broadcast over the queries: PyTorch's
        ``scaled_dot_product_attention`` (flash kernel on CPU). The core then prefers it to
        its own blockwise path for long sequences."""
        return self._keras.backend.backend() == "torch"

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


@dataclass(frozen=True)
class _Registration:
    module: str
    is_tensor: Callable[[Any], bool]
    factory: Callable[[], Any]


_REGISTRY: list[_Registration] = []
_INSTANCES: dict[str, Any] = {}


def register_namespace(
    module: str, is_tensor: Callable[[Any], bool], factory: Callable[[], Any]
) -> None:
    """Register an ops namespace for tensors of the framework ``module``.

    Args:
        module: top-level module name of the framework (``"paddle"``). The namespace is
            considered only while this module is imported.
        is_tensor: returns True for a tensor of that framework.
        factory: builds the namespace object (called once, lazily).
    """
    _REGISTRY.append(_Registration(module, is_tensor, factory))


def _instance(key: str, factory: Callable[[], Any]) -> Any:
    ns = _INSTANCES.get(key)
    if ns is None:
        ns = _INSTANCES[key] = factory()
    return ns


def get_ops(*tensors: Any) -> Any:
    """Return the ops namespace for ``tensors`` (``None`` entries are ignored).

    A registered framework's namespace is returned when any tensor belongs to it;
    otherwise the Keras namespace (``keras.ops`` of the active Keras backend).
    """
    for reg in _REGISTRY:
        if reg.module in sys.modules and any(t is not None and reg.is_tensor(t) for t in tensors):
            return _instance(reg.module, reg.factory)
    return _instance("keras", KerasNamespace)


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

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

    def fused_attention(self, query, key, value, mask, scale, is_causal=False):
        """The backend's fused attention on ``(batch, seq, heads, dim)`` arrays
        (``is_causal``: top-left aligned, used by the core only when queries and keys are
        equally long)."""
        return self._ops.dot_product_attention(
            query, key, value, mask=mask, scale=scale, is_causal=is_causal
        )

    @property
    def fused_attention_pays(self) -> bool:
        """False where the backend's fused attention is measured slower than the core's
        explicit path: JAX on CPU, where ``jax.nn.dot_product_attention`` (XLA) took
        153 ms forward and 263 ms forward+backward against 123 ms and 251 ms for the
        explicit path, on ``(8, 512, 8, 64)`` float32 under ``jax.jit`` (2-core CPU)."""
        if self._keras.backend.backend() != "jax":
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

"""A model's function compiled by XLA for decoding (internal): `xla_function` (``jax.jit``
or ``tf.function(jit_compile=True)``), the key that selects a TensorFlow trace
(`signature`) and the caches carried without their unit axes (`without_unit_axes`).

Either way the `multiattn.namespaces.keras.owned_caches` block in force at the call
(`cache_scope`) and the settings that shape attention (`multiattn.config.fingerprint`)
are arguments that select the trace: a trace made under one block or one setting is not
reused under another.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import keras
import optree

from ..namespaces.keras import cache_kept_axes, cache_scope, enter_cache_scope

__all__ = ["signature", "with_unit_axes", "without_unit_axes", "xla_function"]


def without_unit_axes(caches: Any) -> Any:
    """Each cache ``(B, H_kv, L, D)`` with its batch and head axes dropped where they are
    1, as the compiled loop carries it (`with_unit_axes` restores them in each step).

    XLA:CPU reads a cache through a bitcast that drops its unit axes; when the loop
    carries the cache with a unit axis, the in-place update of the cache and that read
    meet, and XLA copies the whole cache several times per step. Carried without them
    (the reshapes are bitcasts), the update stays in place. A toy loop of 4 layers
    (8 heads, 576 slots of 32, batch 1) on jax took several times as long per step with
    the batch axis carried as without (measured: docs/benchmarks.md, 'Measurements
    behind the defaults')."""
    flat = keras.tree.flatten(caches)
    kept = [keras.ops.reshape(c, tuple(c.shape[i] for i in cache_kept_axes(c.shape))) for c in flat]
    return keras.tree.pack_sequence_as(caches, kept)


def with_unit_axes(caches: Any, shapes: list) -> Any:
    """The inverse of `without_unit_axes`: ``caches`` reshaped to ``shapes`` (theirs,
    flattened)."""
    flat = keras.tree.flatten(caches)
    return keras.tree.pack_sequence_as(
        caches, [keras.ops.reshape(c, shape) for c, shape in zip(flat, shapes)]
    )


def signature(tree: Any) -> tuple:
    """What selects a TensorFlow trace of a call with arguments ``tree``: their structure,
    each array's (a tensor's, a NumPy array's or scalar's) shape and dtype, and each
    Python value's type and value (static in ``tf.function``)."""
    leaves, structure = optree.tree_flatten(tree, none_is_leaf=True)
    return structure, tuple(_leaf_key(x) for x in leaves)


def _leaf_key(x: Any) -> tuple:
    shape = None if isinstance(x, (int, float, str, type(None))) else getattr(x, "shape", None)
    return (type(x), x) if shape is None else (tuple(shape), str(x.dtype))


def xla_function(model: Any, fn: Callable, static: tuple = (), donate: str | None = None):
    """``fn`` (a function of the model ``model``: its weights are ``model.variables``)
    compiled by XLA on the running Keras backend, jax or tensorflow.

    On TensorFlow, ``tf.function(jit_compile=True)`` (`_TfFunction`), traced once per set
    of shapes and Python values (static there): the cache length must stay static
    (``reduce_retracing`` would relax it to unknown on the first call with another
    ``max_new_tokens`` or prompt length, which the cache refuses); it reads the weights
    as variables. On jax, ``jax.jit`` (`_JaxFunction`) with the arguments named in
    ``static`` static, the one named ``donate`` donated, and the weights passed as
    arguments (read through ``keras.StatelessScope``), not constants of the trace, so the
    kept function follows weights changed later (training, ``set_weights``).

    The result is called with ``fn``'s arguments and has ``optimized_hlo(*args)``: XLA's
    optimised program for those arguments, as text (the tests read it for copies of a
    cache)."""
    if keras.backend.backend() == "tensorflow":
        return _TfFunction(fn)
    return _JaxFunction(model, fn, static, donate)


class _JaxFunction:
    """``fn`` under ``jax.jit``, the weights, the `cache_scope` and the settings
    fingerprint its leading arguments (see `xla_function`)."""

    def __init__(self, model: Any, fn: Callable, static: tuple, donate: str | None) -> None:
        import jax

        names = list(inspect.signature(fn).parameters)
        self._fn = fn
        self._variables = list(model.variables)
        self._compiled = jax.jit(
            self._pure,
            static_argnums=(1, 2, *(3 + names.index(n) for n in static)),
            donate_argnums=() if donate is None else (3 + names.index(donate),),
        )

    def _pure(self, values: list, scope: tuple, settings: tuple, *args: Any) -> Any:
        with keras.StatelessScope(state_mapping=list(zip(self._variables, values))):
            with enter_cache_scope(scope):
                return self._fn(*args)

    def _leading(self) -> tuple:
        from .. import config

        return [v.value for v in self._variables], cache_scope(), config.fingerprint()

    def __call__(self, *args: Any) -> Any:
        return self._compiled(*self._leading(), *args)

    def optimized_hlo(self, *args: Any) -> str:
        return self._compiled.lower(*self._leading(), *args).compile().as_text()


class _TfFunction:
    """``fn`` under ``tf.function(jit_compile=True)``, called through the concrete
    function of each signature of its arguments, kept here by `signature`: TensorFlow's
    own dispatch (binding every argument, building its trace type, looking it up in the
    function's cache) cost several times the Python time of a kept concrete function per
    call of a function of 12 tensors and a few Python values (measured:
    docs/benchmarks.md, 'Measurements behind the defaults'). A decoding loop is one call
    per ``generate``; the Python loop over the compiled step is one per token."""

    def __init__(self, fn: Callable) -> None:
        import tensorflow as tf

        self._fn = fn
        # autograph=False: the model's code is not to be converted (multiattn._autograph)
        self._compiled = tf.function(
            self._scoped, reduce_retracing=False, jit_compile=True, autograph=False
        )
        self._kept: dict = {}

    def _scoped(self, scope: tuple, settings: tuple, *args: Any) -> Any:
        with enter_cache_scope(scope):
            return self._fn(*args)

    @staticmethod
    def _head() -> tuple:
        from .. import config

        return cache_scope(), config.fingerprint()

    def __call__(self, *args: Any) -> Any:
        head = self._head()
        key = signature((head, args))
        concrete = self._kept.get(key)
        if concrete is None:
            concrete = self._kept.setdefault(
                key, self._compiled.get_concrete_function(*head, *args)
            )
        return concrete(*head, *args)

    def optimized_hlo(self, *args: Any) -> str:
        ir = self._compiled.experimental_get_compiler_ir(*self._head(), *args)
        return ir(stage="optimized_hlo")

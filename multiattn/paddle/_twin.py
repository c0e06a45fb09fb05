"""One definition, two holders: the Paddle twin of a multiattn Keras layer class.

A multiattn layer is defined once, as a Keras layer whose math goes through the
`multiattn.ops` namespace of its inputs. `twin` makes the Paddle class of such a layer
from that very definition: the twin's methods are the Keras class's functions (the same
code objects), rebound so that

* their base is the Paddle holder (`multiattn.paddle._holder.PaddleLayer`) instead of
  ``keras.layers.Layer`` (``super()`` inside them names the twin);
* the module globals they read name the twins: ``keras.layers.EinsumDense``,
  ``keras.layers.Dropout`` and ``keras.layers.LayerNormalization`` are the Paddle holders,
  and a multiattn layer class (``RotaryEmbedding`` inside ``MultiHeadAttention``, ...)
  is its twin.

Nothing of the forward pass is written again; what differs between the frameworks is
declared in `multiattn.paddle._holder`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import keras

from ._holder import (
    Dropout,
    EinsumDense,
    Embedding,
    KerasLayerNormalization,
    PaddleLayer,
    keras_on_paddle,
)

__all__ = ["definition", "twin"]

# Keras classes a definition may derive from or build, and their Paddle holders.
_HOLDERS: dict[type, type] = {
    keras.layers.Layer: PaddleLayer,
    keras.layers.LayerNormalization: KerasLayerNormalization,
    keras.layers.EinsumDense: EinsumDense,
    keras.layers.Dropout: Dropout,
    keras.layers.Embedding: Embedding,
}
# The modules whose classes and functions are definitions (rebound for Paddle).
_DEFINITIONS = ("multiattn.layers.", "multiattn.models.")
_TWINS: dict[type, type] = {}
_GLOBALS: dict[str, dict] = {}  # module name -> the globals the twins' functions read
_KERAS = keras_on_paddle()


def _is_definition(obj: Any) -> bool:
    return getattr(obj, "__module__", "").startswith(_DEFINITIONS)


def _globals_of(module_name: str) -> dict:
    """A copy of a definition module's globals with ``keras`` swapped for
    `keras_on_paddle`, its definition functions (its own and imported ones) rebound onto
    such copies, and the layer classes swapped for their twins (as twins are made)."""
    if module_name not in _GLOBALS:
        table = dict(vars(sys.modules[module_name]))
        _GLOBALS[module_name] = table  # first: functions of two modules may refer to each other
        table["keras"] = _KERAS
        for name, value in list(table.items()):
            if isinstance(value, type) and value in _TWINS:
                table[name] = _TWINS[value]
            elif isinstance(value, types.FunctionType) and _is_definition(value):
                table[name] = _rebind(value, None, _globals_of(value.__module__))
    return _GLOBALS[module_name]


def _rebind(fn: Any, owner: types.CellType, table: dict) -> Any:
    """``fn`` with globals ``table`` and its ``__class__`` cell (zero-argument ``super()``)
    replaced by ``owner`` (the cell that will hold the twin)."""
    if isinstance(fn, (staticmethod, classmethod)):
        return type(fn)(_rebind(fn.__func__, owner, table))
    if isinstance(fn, property):
        parts = (fn.fget, fn.fset, fn.fdel)
        return property(*(p and _rebind(p, owner, table) for p in parts), fn.__doc__)
    if not isinstance(fn, types.FunctionType):
        return fn
    cells = fn.__closure__
    if cells is not None:
        names = fn.__code__.co_freevars
        cells = tuple(
            owner if name == "__class__" and owner is not None else cell
            for name, cell in zip(names, cells)
        )
    new = types.FunctionType(fn.__code__, table, fn.__name__, fn.__defaults__, cells)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__doc__, new.__qualname__ = fn.__doc__, fn.__qualname__
    new.__module__ = fn.__module__
    return new


def twin(cls: type) -> type:
    """The Paddle twin of the multiattn Keras layer class ``cls`` (made once)."""
    if cls in _HOLDERS:
        return _HOLDERS[cls]
    if cls in _TWINS:
        return _TWINS[cls]
    if not _is_definition(cls):
        if issubclass(cls, keras.layers.Layer):
            raise TypeError(
                f"twin: `cls` must be a multiattn layer class (or a Keras class with a "
                f"Paddle holder); received {cls.__module__}.{cls.__qualname__}."
            )
        return cls  # a plain base (object, a typing class): shared as it is
    bases = tuple(twin(b) for b in cls.__bases__)
    table = _globals_of(cls.__module__)
    owner = types.CellType()
    body = {
        name: _rebind(value, owner, table)
        for name, value in vars(cls).items()
        if name not in ("__dict__", "__weakref__", "__init_subclass__")
    }
    body["__module__"] = "multiattn.paddle.layers"
    result = types.new_class(cls.__name__, bases, {}, lambda ns: ns.update(body))
    owner.cell_contents = result
    _TWINS[cls] = result
    for other in _GLOBALS.values():
        for name, value in list(other.items()):
            if value is cls:
                other[name] = result
    return result


def definition(fn: types.FunctionType) -> types.FunctionType:
    """The Paddle form of a definition module's function (its globals name the twins)."""
    return _globals_of(fn.__module__)[fn.__name__]

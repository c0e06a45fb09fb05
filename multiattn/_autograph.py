"""TensorFlow's AutoGraph and multiattn's functions.

``tf.function`` converts the Python source of every function a traced function calls
(AutoGraph), unless the function is TensorFlow's, Keras' or NumPy's, or is marked as
not to be converted. multiattn's code needs no conversion: it is written for tracing
compilers that run Python as it is (``jax.jit``, ``torch.compile``), with loops and
branches on tensors as ``keras.ops`` calls. Converting it only costs time: a causal
`multiattn.ops.scaled_dot_product_attention` call traced under ``tf.function`` took 13.6 s
with AutoGraph converting the core (about 800 functions) and 0.24 s without (a 2-core
AMD EPYC). Keras layers are not converted either (Keras is on AutoGraph's own list).

`as_written` marks a public function the way
``tf.autograph.experimental.do_not_convert`` marks its result (the ``autograph_info__``
attribute AutoGraph looks for), without importing TensorFlow: AutoGraph then calls the
function as it is, and so everything it calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: The attribute by which AutoGraph recognises a function it must not convert.
MARK = "autograph_info__"


def as_written(fn: F) -> F:
    """Mark ``fn`` (a plain function) as not to be converted by AutoGraph; returns it."""
    if not callable(fn):
        raise TypeError(f"as_written: expected a function; received {type(fn).__name__}")
    setattr(fn, MARK, None)
    return fn


def mark_public(namespace: dict[str, Any], names: list[str]) -> None:
    """`as_written` on every function among ``names`` in a module's ``namespace``."""
    for name in names:
        obj = namespace[name]
        if callable(obj) and not isinstance(obj, type):
            as_written(obj)

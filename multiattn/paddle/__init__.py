"""multiattn on PaddlePaddle.

Keras has no Paddle backend, so the Paddle side of multiattn is its own package:

* `multiattn.ops` runs on Paddle tensors as it is (the namespace of
  `multiattn.backends.paddle`, registered on import of this package);
* `multiattn.paddle.layers`: ``paddle.nn.Layer`` twins of `multiattn.layers`, made from
  the same definitions (see `multiattn.paddle._twin`).

Importing this package imports paddle first (importing it after TensorFlow in one process
segfaults) and, when Keras is not imported yet and ``KERAS_BACKEND`` is unset, picks Keras'
numpy backend (Keras supplies only initializers and configs here).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..backends import paddle as _adapter  # noqa: F401  (paddle first; the namespace)

__all__ = ["layers"]


def __getattr__(name: str) -> Any:
    if name == "layers":
        return importlib.import_module(".layers", __name__)
    raise AttributeError(f"module 'multiattn.paddle' has no attribute {name!r}")

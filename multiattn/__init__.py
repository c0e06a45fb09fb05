"""multiattn: attention written once with keras.ops, identical across frameworks.

Import under the Keras backend of your choice (``KERAS_BACKEND`` = ``jax``, ``torch``,
``tensorflow`` or ``numpy``, read once when Keras is imported). multiattn itself imports
no framework but Keras and its backend.

* :mod:`multiattn.ops`: the math (masked softmax, scoring functions, scaled dot-product
  attention, head split/merge, positional encoding).
* :mod:`multiattn.layers`: Keras 3 layers.
* :mod:`multiattn.reference`: the float64 NumPy oracle used by tests and fixtures.
"""

from . import layers, ops

__version__ = "0.1.0"

__all__ = ["__version__", "layers", "ops"]

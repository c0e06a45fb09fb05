"""Import order between torch's compile stack and TensorFlow in one process.

With the CUDA build of torch (PyPI's default wheel on Linux), torch brings ``triton``,
which links its own LLVM; so does TensorFlow. Importing ``triton`` after TensorFlow
registers LLVM's command-line options a second time, and the process dies (``LLVM ERROR:
inconsistency in registered CommandLine options``: an abort, or a segmentation fault):
``python -c "import tensorflow; import triton"``. The other order works. ``triton`` comes
in quietly: ``transformers`` imports ``torch._dynamo``, and that imports ``triton``.

Every process that may import both (the conformance workers, ``conformance --model``,
the test suite's workers) calls `import_triton_first` before any framework.
"""

from __future__ import annotations

import importlib.util
import sys


def import_triton_first() -> bool:
    """Import ``triton`` now when it and TensorFlow are both installed and TensorFlow is not
    imported yet, so that a later ``import triton`` (through ``torch._dynamo``) finds it
    loaded. Returns whether it did. Cheap where either is missing: two
    `importlib.util.find_spec` look-ups, nothing imported."""
    if "tensorflow" in sys.modules or "triton" in sys.modules:
        return False
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("tensorflow") is None:
        return False
    import triton  # noqa: F401

    return True

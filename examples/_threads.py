"""Backend choice and CPU thread limits for the examples (imports no framework).

Call `limit_threads` before anything imports Keras or a framework.
"""

from __future__ import annotations

import os


def limit_threads(backend: str, threads: int) -> None:
    """Select the Keras backend and cap each framework's CPU threads.

    The examples' operations are tiny; spreading each over several threads costs more in
    synchronisation than it gains, badly so on a busy machine.
    """
    os.environ["KERAS_BACKEND"] = backend
    n = str(threads)
    os.environ.setdefault("OMP_NUM_THREADS", n)
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", n)
    os.environ.setdefault("TF_NUM_INTEROP_THREADS", n)
    if threads == 1:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()

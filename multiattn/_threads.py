"""Thread pools kept for the life of a process (`kept_pool`)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_POOLS: dict[tuple[int, str], ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def kept_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The thread pool ``name`` of this process, made on its first use: at most
    ``workers`` threads, each started when a call finds no idle one and kept for the
    next calls. A forked child makes pools of its own (its parent's threads do not exist
    there).

    A pool made per call pays for starting its threads on every call, and starting a
    thread waits until the new thread has run, under Python's lock, which the threads
    still running hold in turn: eight decoding loops side by side spent about two thirds
    of the caller's time of a call with no token to decode starting their threads (jax,
    GPT-2 shape, prompt 512 x 8)."""
    key = (os.getpid(), name)
    with _LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            for stale in [k for k in _POOLS if k[0] != key[0]]:
                del _POOLS[stale]
            pool = _POOLS[key] = ThreadPoolExecutor(workers, thread_name_prefix=f"multiattn-{name}")
        return pool

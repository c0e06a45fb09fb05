"""`multiattn._threads.kept_pool`: one pool per name and process, kept from call to call."""

from __future__ import annotations

import multiprocessing
import threading

from multiattn._threads import kept_pool


def test_a_pool_is_kept_per_name_and_its_threads_are_reused():
    pool = kept_pool("test-kept", 4)
    assert kept_pool("test-kept", 4) is pool
    assert kept_pool("test-other", 4) is not pool
    names = {pool.submit(lambda: threading.current_thread().name).result(timeout=30)
             for _ in range(20)}  # fmt: skip
    assert len(names) == 1 and names.pop().startswith("multiattn-test-kept")


def test_calls_made_inside_the_pool_run_side_by_side_without_waiting_for_a_thread():
    """Each task waits for tasks it submits itself, and every task waits for all four
    of a barrier: the pool starts a thread for each task that finds none idle."""
    pool = kept_pool("test-nested", 1 << 10)
    barrier = threading.Barrier(4, timeout=30)

    def inner() -> int:
        return barrier.wait()

    def outer() -> list[int]:
        return [f.result(timeout=30) for f in [pool.submit(inner) for _ in range(2)]]

    got = [f.result(timeout=60) for f in [pool.submit(outer) for _ in range(2)]]
    assert sorted(i for pair in got for i in pair) == [0, 1, 2, 3]


def _in_child(queue) -> None:
    pool = kept_pool("test-fork", 2)
    queue.put(pool.submit(lambda: 41 + 1).result(timeout=20))


def test_a_forked_child_makes_a_pool_of_its_own():
    pool = kept_pool("test-fork", 2)
    assert pool.submit(lambda: 1).result(timeout=30) == 1  # a thread started here
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(queue,))
    child.start()
    try:
        answer = queue.get(timeout=60)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    # the parent's pool, kept in the child, has an idle thread on its books that does
    # not exist there: its task would never run (the child's wait times out)
    assert answer == 42 and child.exitcode == 0

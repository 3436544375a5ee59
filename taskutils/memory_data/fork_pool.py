"""A ``fork`` process pool that always ends: workers take SIGTERM with its default action, and the pool is closed
and joined when the work is done (terminated only on an error).

Why: ``Pool.terminate()`` (also what ``with Pool(...)`` does on exit) stops its workers with SIGTERM. A forked
worker inherits the parent's Python signal handlers; when the parent has one for SIGTERM that does not exit (a
trainer's graceful stop, an evaluation's "stop after this batch", Ray's driver handler), a worker idle in the task
queue's lock runs that handler and goes back to waiting, and ``terminate()`` waits for it forever (seen as a hung
test run). Data builders fork to share large read-only state without pickling it, so they use this pool.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.pool import Pool

__all__ = ["fork_available", "fork_pool"]


def fork_available() -> bool:
    """True where the ``fork`` start method exists (not on Windows)."""
    return "fork" in multiprocessing.get_all_start_methods()


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def fork_pool(workers: int) -> Iterator[Pool]:
    """``workers`` forked processes; on leaving the block: close + join after success, terminate + join after an
    exception (the workers die on SIGTERM whatever handler the parent had)."""
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=_default_sigterm)
    try:
        yield pool
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()

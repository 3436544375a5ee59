"""``taskutils.memory_data.fork_pool``: a forked pool ends after its work and after an error, also when the parent
has a SIGTERM handler that does not exit (what hung a whole test run: ``Pool.terminate`` waited forever for
workers that had inherited such a handler)."""

from __future__ import annotations

import multiprocessing
import signal

import pytest

from taskutils.memory_data.fork_pool import fork_available, fork_pool

pytestmark = pytest.mark.skipif(not fork_available(), reason="needs the fork start method")


def _sigterm_is_default(_=None) -> bool:
    return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.fixture
def parent_sigterm_handler():
    """A SIGTERM handler in this process that does not exit (as a trainer's graceful stop or Ray's driver has)."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_workers_take_sigterm_with_the_default_action(parent_sigterm_handler):
    with fork_pool(2) as pool:
        assert pool.map(_sigterm_is_default, range(4)) == [True] * 4


def test_control_a_plain_fork_pool_inherits_the_parents_handler(parent_sigterm_handler):
    """Without the initializer the workers keep the parent's handler, survive Pool.terminate's SIGTERM when idle in
    the task queue's lock, and terminate() waits for them forever: what the test above guards against. So this
    pool ends with close() + join() (the workers leave on the queue's sentinel), never terminate(): ``with Pool``
    hung the suite here for 7 min."""
    pool = multiprocessing.get_context("fork").Pool(1)
    try:
        assert pool.apply(_sigterm_is_default) is False
    finally:
        pool.close()
        pool.join()


def test_results_and_clean_exit():
    with fork_pool(2) as pool:
        assert sorted(pool.imap_unordered(abs, range(-5, 0))) == [1, 2, 3, 4, 5]
    assert pool._state == "CLOSE"  # closed and joined, not terminated

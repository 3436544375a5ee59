"""Keeping the trainer's helper processes out of the launching command's process group.

A signal sent to a process group (``timeout``'s SIGTERM, ``kill -TERM -- -PGID``, Ctrl-C in a shell script) reaches
every process in it. The trainer handles SIGTERM gracefully (``verl/trainer/ppo/signals.py``: finish the step,
checkpoint, exit 0), but only if the processes it needs for that step are still alive: a local Ray instance's
processes (GCS, raylet and every Ray worker), data-loader workers and the rollout engine's own process
(``rollout.engine_process=child``) would take the same signal's default action and die. So they are started in
process groups of their own; the driver stays in the launching group, gets the signal, and stops them itself.

A job scheduler that signals every process of a job by other means (Slurm's ``scancel`` signals the whole job step)
still reaches them all.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["children_in_their_own_group", "leave_process_group"]

logger = logging.getLogger(__name__)


@contextmanager
def children_in_their_own_group() -> Iterator[None]:
    """Processes this process starts inside the block land in a new process group; this process returns to its own
    group after the block.

    Children inherit their parent's process group when they are created, so this process moves into a new group
    for the block (e.g. while ``ray.init`` starts GCS and the raylet; the raylet later starts every Ray worker, which
    inherit its group) and moves back after. Does nothing where it cannot work: off POSIX, and when this process
    leads its group already (a command typed at an interactive shell: its children share that group whatever it
    does) or cannot change group (a session leader).
    """
    if os.name != "posix":
        yield
        return
    own_group = os.getpgrp()
    if own_group == os.getpid():
        logger.debug("this process leads its process group %d: the processes it starts share it", own_group)
        yield
        return
    try:
        os.setpgid(0, 0)
    except OSError as exc:
        logger.debug("cannot start a process group of its own (%s): its children share group %d", exc, own_group)
        yield
        return
    try:
        yield
    finally:
        try:
            os.setpgid(0, own_group)
        except OSError as exc:  # the group is gone (its other members exited): stay in the new one
            logger.warning(
                "could not return to process group %d (%s): signals sent to that group no longer reach this process",
                own_group,
                exc,
            )


def leave_process_group(*_: Any) -> None:
    """Move the calling process into a process group of its own (a ``worker_init_fn`` for data-loader workers: its
    arguments are ignored). Its parent still stops it by its pid; a signal to the parent's group no longer does."""
    if os.name != "posix" or os.getpgrp() == os.getpid():
        return
    try:
        os.setpgid(0, 0)
    except OSError as exc:
        logger.debug("cannot leave process group %d: %s", os.getpgrp(), exc)

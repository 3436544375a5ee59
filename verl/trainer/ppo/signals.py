"""Graceful stop on SIGTERM for the training loop (clusters send SIGTERM some time before SIGKILL).

* first SIGTERM: :attr:`GracefulStop.requested` turns true; the loop finishes the current step, writes a
  checkpoint and returns normally (exit code 0);
* second SIGTERM: the handler raises :class:`StepAbandoned` (a ``SystemExit`` with code 143, ``128 + SIGTERM``)
  wherever the loop is, so the current step (or checkpoint write) is abandoned; nothing half-updated is saved
  and the latest complete checkpoint stays the one to resume from. Where the exception cannot land safely (the
  signal interrupted the ``logging`` or ``threading`` modules' own code, e.g. logging's lock release in a fork
  hook, where it would be ignored and leave the lock held) and where a library swallows it, the loop raises it at
  its next safe point instead (:meth:`GracefulStop.start`: the next step or checkpoint write), saving nothing;
* a third SIGTERM gets the default action (the process dies at once).

The handler is installed only in the main thread and the previous one is restored on exit.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

ABANDONED_EXIT_CODE = 128 + signal.SIGTERM  # 143, what a shell reports for "killed by SIGTERM"


def _say(message: str) -> None:
    """Print from a signal handler: the handler may run while the main thread is inside a buffered write to
    stdout, where ``print`` raises ``RuntimeError: reentrant call``; then write to the file descriptor."""
    try:
        print(message, flush=True)
    except RuntimeError:
        os.write(sys.stdout.fileno(), (message + "\n").encode())


_UNSAFE_DIRS = (os.path.dirname(logging.__file__),)
_UNSAFE_FILES = (threading.__file__,)


def _unsafe_to_raise(frame: FrameType | None) -> bool:
    """Whether the interrupted code is the ``logging`` or ``threading`` modules' own: an exception raised there can
    be ignored by the interpreter (fork hooks, finalisers) after a lock was taken and before it was released."""
    if frame is None:
        return False
    filename = frame.f_code.co_filename
    return filename in _UNSAFE_FILES or os.path.dirname(filename) in _UNSAFE_DIRS


class StepAbandoned(SystemExit):
    """Raised by the second SIGTERM; a ``SystemExit`` so that ``except Exception`` blocks do not swallow it."""

    def __init__(self) -> None:
        super().__init__(ABANDONED_EXIT_CODE)


class GracefulStop:
    """Context manager: count SIGTERMs while the training loop runs (see the module docstring)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.received = 0
        self.doing: str | None = None  # what the loop is doing, for the messages ("step 3/5", ...)
        self.announced: str | None = None  # ``doing`` as the first signal's message named it
        self._previous: Any = None
        self._installed = False

    @property
    def requested(self) -> bool:
        return self.received > 0

    def start(self, doing: str) -> None:
        """Name the work about to start (``doing``, for the messages); raise :class:`StepAbandoned` instead when the
        second signal came but its exception did not unwind the loop (deferred by the handler, or swallowed)."""
        self.doing = doing
        if self.abandoned:
            raise StepAbandoned()

    def stop_before(self, doing: str) -> bool:
        """Name the work about to start (``doing``), then say whether to stop instead: a signal came and its message
        did not name this work. A signal that lands once ``doing`` is set names it and lets it finish; one that
        landed before named what was already done (checking :attr:`requested` before setting ``doing`` let a
        signal in between name the finished step while the loop went on to finish and checkpoint the next).
        Raises :class:`StepAbandoned` as :meth:`start` does."""
        self.start(doing)
        return self.requested and self.announced != doing

    @property
    def abandoned(self) -> bool:
        """The second signal came: whatever exception unwinds the loop now was caused by it, even when a library
        caught :class:`StepAbandoned` and raised its own (``torch.distributed.checkpoint`` wraps it in a
        ``CheckpointException``)."""
        return self.received > 1

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        name = self.signal_name
        if self.received == 1:
            self.announced = self.doing
            _say(
                f"[trainer] {name} received: finishing {self.doing or 'the current work'}, then writing a "
                f"checkpoint and exiting; send {name} again to abandon it"
            )
            return
        signal.signal(self.signum, signal.SIG_DFL)  # a third one kills at once
        _say(f"[trainer] second {name} received: abandoning {self.doing or 'the current work'}")
        if _unsafe_to_raise(frame):  # the loop raises it at its next safe point (``start``)
            return
        raise StepAbandoned()

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handle)
            self._installed = True
        else:
            logger.info("not in the main thread: %s keeps its current handler", self.signal_name)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

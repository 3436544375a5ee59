"""GracefulStop (verl/trainer/ppo/signals.py): the first SIGTERM's message names the step the loop then finishes and
checkpoints, wherever between two steps it lands (seen in a suite run: "finishing step 1/5", then step 2 ran and
was checkpointed, because the loop checked for the signal before naming the next step)."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest

from verl.trainer.ppo.signals import ABANDONED_EXIT_CODE, GracefulStop, StepAbandoned


def test_a_signal_before_the_next_step_is_named_stops_there():
    stop = GracefulStop()
    assert not stop.stop_before("step 1/5")
    stop._handle(signal.SIGTERM, None)  # lands in step 1 (or after its log line, before the loop's next check)
    assert stop.announced == "step 1/5"
    assert stop.stop_before("step 2/5")  # step 1 is done: checkpoint it, do not start step 2


def test_a_signal_once_the_next_step_is_named_lets_that_step_finish():
    stop = GracefulStop()
    assert not stop.stop_before("step 1/5")
    stop.doing = "step 2/5"  # stop_before sets the name first, then checks: the signal lands in between
    stop._handle(signal.SIGTERM, None)
    assert stop.announced == "step 2/5"
    assert not stop.stop_before("step 2/5")  # its message said step 2: the loop runs it
    assert stop.stop_before("step 3/5")  # and stops after it


def test_the_real_signal_is_counted_and_named(capsys):
    with GracefulStop() as stop:
        assert not stop.stop_before("step 4/5")
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the Python-level handler runs at the next bytecode boundary of the main thread
            if stop.received:
                break
        assert stop.received == 1 and stop.announced == "step 4/5"
        assert not stop.stop_before("step 4/5") and stop.stop_before("step 5/5")
    assert "[trainer] SIGTERM received: finishing step 4/5, then writing a checkpoint" in capsys.readouterr().out


def _frame_in(filename: str):
    """A real frame whose code belongs to ``filename`` (what the handler sees when the signal lands there)."""
    scope: dict = {}
    exec(compile("import sys\nframe = sys._getframe()", filename, "exec"), scope)
    return scope["frame"]


def test_a_second_signal_inside_logging_is_raised_at_the_next_safe_point(capsys):
    """Seen in a suite run: the second SIGTERM landed in logging's lock release of a fork hook, where the interpreter
    ignores exceptions; the lock stayed held, the step went on, wrote a checkpoint and the process hung on exit. Inside
    the logging and threading modules the handler now raises nothing; the loop's next ``start`` (step or checkpoint
    write) raises ``StepAbandoned``, so nothing new is saved. Elsewhere it raises at once, as before."""
    previous = signal.getsignal(signal.SIGTERM)  # each second signal sets the default action for a third
    for unsafe in (logging.__file__, threading.__file__):
        stop = GracefulStop()
        stop.stop_before("step 2/5")
        stop._handle(signal.SIGTERM, None)
        stop._handle(signal.SIGTERM, _frame_in(unsafe))  # no exception here
        assert stop.abandoned
        with pytest.raises(StepAbandoned) as raised:
            stop.start("the checkpoint of step 2")
        assert raised.value.code == ABANDONED_EXIT_CODE and stop.doing == "the checkpoint of step 2"
        with pytest.raises(StepAbandoned):
            stop.stop_before("step 3/5")
        assert "[trainer] second SIGTERM received: abandoning step 2/5" in capsys.readouterr().out
    stop = GracefulStop()
    stop._handle(signal.SIGTERM, None)
    with pytest.raises(StepAbandoned):
        stop._handle(signal.SIGTERM, _frame_in(__file__))
    signal.signal(signal.SIGTERM, previous)

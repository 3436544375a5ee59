"""GracefulStop (verl/trainer/ppo/signals.py): the first SIGTERM's message names the step the loop then finishes and
checkpoints, wherever between two steps it lands (seen in a suite run: "finishing step 1/5", then step 2 ran and
was checkpointed, because the loop checked for the signal before naming the next step)."""

from __future__ import annotations

import os
import signal

from verl.trainer.ppo.signals import GracefulStop


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

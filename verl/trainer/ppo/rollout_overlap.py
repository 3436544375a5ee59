"""One-step-off training (``trainer.rollout_overlap``): the next step's rollout runs while this step trains.

As verl's one-step-off-policy recipe: step k+1's rollout is launched in a background thread before step k's actor
update, against the rollout engine, which still holds the weights from before that update; the weight sync waits
for that rollout to finish. So every step after the first trains on a batch generated with weights one update old
(staleness 1), and the rollout overlaps the old/ref log-probs, the update and the driver's own work (rewards,
advantages, the workflow's prompt building between turns).

Generation and update run at the same time in each worker: the in-process worker (one CPU process) runs the
engine's scheduler thread next to the actor's update; colocated Ray workers (one process per GPU) are created with
a ``rollout`` and a ``train`` thread (Ray concurrency groups, ``verl/trainer/ppo/ray_worker_group.py``), where
generation and the FSDP calls run respectively. Separate rollout GPUs (verl's recipe) are not implemented here.

Policy versions: the actor's weights after step s's update have version s; the engine's are those of its last
sync. A :class:`Rollout` records the engine's version when it was launched; a step trains it from the actor's
version, and ``staleness = actor version - rollout version``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Rollout", "RolloutAhead", "staleness_metrics"]


@dataclass
class Rollout:
    """One step's rollout: what the trainer's rollout function returned, its timings and metrics, and the
    policy version of the engine weights it was generated with."""

    result: Any
    policy_version: int
    timing: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    ahead: bool = False  # generated in the background during the previous step


RolloutFn = Callable[..., tuple[Any, dict[str, float], dict[str, float]]]


def make_rollout(fn: RolloutFn, questions: Any, policy_version: int, ahead: bool = False, **kwargs: Any) -> Rollout:
    """Run ``fn(questions, **kwargs) -> (result, timing, metrics)`` and wrap it in a :class:`Rollout`."""
    result, timing, metrics = fn(questions, **kwargs)
    return Rollout(result, policy_version, dict(timing), dict(metrics), ahead)


class RolloutAhead:
    """At most one rollout generated in a background thread for the next step's questions.

    ``launch`` starts it (a no-op when disabled or without questions), ``wait`` blocks until it has finished
    (call it before the weight sync, so it ran entirely on the old weights) and re-raises its error, ``take``
    hands it to the step whose questions it was launched for (None when there is none).
    """

    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead") if self.enabled else None
        self._questions: Any = None
        self._future: Future | None = None
        self._launched_version: int | None = None
        self._launched_at = 0.0  # time.perf_counter() when the rollout was launched
        self._finished_at: float | None = None  # time.perf_counter() when the launched rollout returned

    @property
    def running(self) -> bool:
        """A rollout has been launched and not taken yet."""
        return self._future is not None

    def launch(self, fn: RolloutFn, questions: Any, policy_version: int, **kwargs: Any) -> bool:
        """Start ``fn(questions, **kwargs)`` in the background; returns whether it started."""
        if not self.enabled or questions is None:
            return False
        if self._future is not None:
            raise RuntimeError("trainer.rollout_overlap: a rollout is already running ahead; take it first")
        self._questions, self._launched_version, self._finished_at = questions, policy_version, None
        self._launched_at = time.perf_counter()
        self._future = self._pool.submit(self._run, fn, questions, policy_version, **kwargs)
        return True

    def _run(self, fn: RolloutFn, questions: Any, policy_version: int, **kwargs: Any) -> Rollout:
        rollout = make_rollout(fn, questions, policy_version, True, **kwargs)
        self._finished_at = time.perf_counter()
        return rollout

    def launched_s(self) -> float:
        """Seconds since the rollout not taken yet was launched (0 when there is none): the part of the step it ran
        beside, once waited for."""
        return 0.0 if self._future is None else time.perf_counter() - self._launched_at

    def idle_s(self) -> float:
        """Seconds since the launched rollout finished (0 while it runs, or when none was launched): how long it has
        been waiting for the step that will take it."""
        if self._future is None or self._finished_at is None:
            return 0.0
        return time.perf_counter() - self._finished_at

    def wait(self) -> float:
        """Block until the launched rollout (if any) has finished; seconds waited. Raises the rollout's error."""
        if self._future is None:
            return 0.0
        t0 = time.perf_counter()
        self._future.result()
        return time.perf_counter() - t0

    def take(self, questions: Any) -> Rollout | None:
        """The rollout launched for ``questions`` (the same object), or None when none was launched."""
        if self._future is None:
            return None
        if questions is not self._questions:
            raise RuntimeError(
                "trainer.rollout_overlap: the step's batch is not the one whose rollout ran ahead (fit must hand "
                "train_step the `upcoming` batch of the previous step)"
            )
        future, self._future, self._questions = self._future, None, None
        return future.result()

    def close(self) -> None:
        """Forget a rollout nobody will take and stop the thread (after it finishes)."""
        self._future, self._questions = None, None
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def staleness_metrics(rollout: Rollout, actor_version: int) -> dict[str, float]:
    """``rollout/staleness`` (the actor's version minus the rollout's) and ``rollout/policy_version``.

    Checks the one-step-off contract: a rollout generated in its own step is current (0); one generated ahead is
    at most one update old (exactly 1 when the previous step updated the actor, as every multi-turn step does; 0
    after a single-turn critic warm-up step). Anything else means the weights changed under a rollout.
    """
    staleness = int(actor_version) - int(rollout.policy_version)
    allowed = (0, 1) if rollout.ahead else (0,)
    if staleness not in allowed:
        raise RuntimeError(
            f"rollout staleness {staleness} (generated with policy version {rollout.policy_version}, trained from "
            f"{actor_version}); a rollout {'generated ahead (trainer.rollout_overlap)' if rollout.ahead else 'of its own step'} "
            f"must have staleness in {list(allowed)}"
        )
    return {"rollout/staleness": float(staleness), "rollout/policy_version": float(rollout.policy_version)}

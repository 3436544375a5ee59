"""One-step-off training on colocated Ray workers (``trainer.rollout_overlap``): the next step's generation and this
step's update run at the same time inside one worker process.

* Ray concurrency groups through ``@register(concurrency_group=...)``: two calls that must meet (a barrier) meet
  only when the group's actors were created with the groups; without them the worker runs one call at a time.
* :class:`~verl.workers.rollout.guard.RolloutGuard` on a real worker (tiny Qwen2, HF engine): a weight sync, sleep
  or wake-up while a generation is in flight is refused, and the generation's result is intact.
* End to end (memory agent, one Ray worker process, 3 steps): each worker records the wall-clock intervals of its
  generate and update calls; the rollouts of steps 2 and 3 were generated during the updates of steps 1 and 2, the
  last update (no rollout ahead) overlaps no generation; staleness exactly 1 after the first step; finite numbers.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import ray

import verl.trainer.main_ppo as main_ppo
from tests.meeting_worker import MeetingWorker
from tests.test_trainer_e2e import _cfg
from verl.single_controller import (
    Dispatch,
    RayClassWithInitArgs,
    RayWorkerGroup,
    ResourcePool,
    register,
)
from verl.workers.fsdp_workers import OVERLAP_CONCURRENCY_GROUPS, TRAIN_GROUP, ActorRolloutRefWorker
from verl.workers.rollout.guard import RolloutGuard

QUIET = ["trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console]"]
GEN_SECONDS = 0.5  # added to every generate call of the recording worker: the tiny model decodes in milliseconds


# ------------------------------------------------------------------------------------------ concurrency groups


def test_concurrency_groups_run_rollout_and_train_calls_at_once(ray_cluster):
    cls = RayClassWithInitArgs(MeetingWorker).update_options({"concurrency_groups": dict(OVERLAP_CONCURRENCY_GROUPS)})
    threaded = RayWorkerGroup(ResourcePool([1], use_gpu=False, name_prefix="meet2"), cls, name_prefix="meet2")
    single = RayWorkerGroup(
        ResourcePool([1], use_gpu=False, name_prefix="meet1"), RayClassWithInitArgs(MeetingWorker), name_prefix="meet1"
    )
    try:
        assert threaded.concurrency_group("default", "meet_from_rollout") == "rollout"
        assert threaded.concurrency_group("default", "meet_from_train") == "train"
        assert threaded.concurrency_group("default", "plain") is None
        assert single.concurrency_group("default", "meet_from_rollout") is None  # the actors have no such group
        # with the groups both calls are inside the worker at once, each in its own thread
        a, b = threaded.meet_from_rollout(20.0), threaded.meet_from_train(20.0)
        names = [a.get()[0], b.get()[0]]
        assert "alone" not in names and names[0] != names[1], names
        assert threaded.plain()[0] not in names  # the default group: a third thread
        # call_rank (the async rollout's replicas) routes the same way
        a = threaded.call_rank(0, "meet_from_rollout", 20.0)
        b = threaded.call_rank(0, "meet_from_train", 20.0)
        assert "alone" not in ray.get([a, b])
        # without them (the default, trainer.rollout_overlap=False) one call at a time: neither meets the other
        a, b = single.meet_from_rollout(1.0), single.meet_from_train(1.0)
        assert [a.get()[0], b.get()[0]] == ["alone", "alone"]
    finally:
        threaded.shutdown()
        single.shutdown()


def test_trainer_builds_the_threaded_worker_only_with_the_overlap():
    from tests.test_config import compose_config
    from verl.trainer.ppo.ray_worker_group import actor_rollout_ref_class

    on = actor_rollout_ref_class(compose_config(["trainer.rollout_overlap=True"]), "cpu")
    off = actor_rollout_ref_class(compose_config([]), "cpu")
    assert on.options == {"concurrency_groups": {"rollout": 1, "train": 1}}
    assert off.options == {}  # one call at a time, as before
    specs = {name: spec.concurrency_group for name, spec in _registered(ActorRolloutRefWorker).items()}
    assert {n for n, g in specs.items() if g == "rollout"} == {"generate", "sleep_rollout", "wake_up_rollout"}
    assert {n for n, g in specs.items() if g == "train"} == {
        "compute_log_prob",
        "compute_ref_log_prob",
        "update_actor",
        "sync_rollout_weights",
        "shift_engine_reserved_sms",  # rollout.balance_reserved_sms: the training passes' SMs, between steps
        "save_checkpoint",
        "load_checkpoint",
    }


def _registered(cls):
    from verl.single_controller.decorator import registered_methods

    return registered_methods(cls)


# ------------------------------------------------------------------------------------------ the guard


def test_guard_refuses_engine_changes_during_a_generation_and_generations_during_a_change():
    guard = RolloutGuard()
    with guard.generating(), guard.generating():  # generations may run together
        assert guard.in_flight == 2
        with pytest.raises(RuntimeError, match="sync_rollout_weights refused: 2 generate call"):
            with guard.changing("sync_rollout_weights"):
                pass
    assert guard.in_flight == 0
    with guard.changing("sleep_rollout"):
        with pytest.raises(RuntimeError, match="generate refused: sleep_rollout is changing"):
            with guard.generating():
                pass
        with pytest.raises(RuntimeError, match="wake_up_rollout refused: sleep_rollout is already"):
            with guard.changing("wake_up_rollout"):
                pass
    with guard.changing("sync_rollout_weights"):  # released after each block, also after an error
        pass


def test_guard_clocks_the_time_with_a_generation_in_flight():
    guard = RolloutGuard()
    assert guard.busy_seconds() == 0.0
    t0 = time.perf_counter()
    with guard.generating():
        time.sleep(0.05)
        with guard.generating():  # nested: counted once
            time.sleep(0.05)
        assert guard.busy_seconds() >= 0.1  # a running clock
    inside = time.perf_counter() - t0
    time.sleep(0.05)  # idle: not counted
    assert 0.1 <= guard.busy_seconds() <= inside


def test_worker_refuses_a_weight_sync_while_it_generates(tiny_model_path):
    from tests.test_config import compose_config

    cfg = compose_config(
        [
            f"actor_rollout_ref.model.path={tiny_model_path}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.prompt_length=16",
            "actor_rollout_ref.rollout.response_length=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.use_kl_loss=False",
        ]
    )
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, "cpu")
    worker.init_model()
    try:
        engine, started, release = worker.rollout, threading.Event(), threading.Event()
        real = engine.generate_requests

        def held(prompts, params):  # the real engine, held until the test has tried the sync
            started.set()
            assert release.wait(30)
            return real(prompts, params)

        engine.generate_requests = held
        out: list = []
        gen = threading.Thread(target=lambda: out.append(worker.generate([[1, 2, 3]], {"max_tokens": 4})))
        gen.start()
        assert started.wait(30)
        for method in ("sync_rollout_weights", "sleep_rollout", "wake_up_rollout"):
            with pytest.raises(RuntimeError, match=f"{method} refused: 1 generate call\\(s\\) in flight"):
                getattr(worker, method)()
        release.set()
        gen.join(30)
        assert len(out) == 1 and len(out[0][0][0].token_ids) >= 1  # the generation itself finished intact
        assert worker.sync_rollout_weights() >= 0.0  # no generation in flight: allowed again
    finally:
        worker.shutdown_engines()


# ------------------------------------------------------------------------------------------ end to end


class RecordingWorker(ActorRolloutRefWorker):
    """The real worker, recording the intervals of its generate and update calls; every generation lasts
    ``GEN_SECONDS`` longer (inside the guarded call, so the rollout thread is busy for it). The clock is
    ``perf_counter``, as the worker's own ``RolloutGuard``: the wall clock may be stepped (NTP) mid-test, which would
    make the recorded intervals disagree with the worker's ``perf/rollout/generate_s``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.intervals: list[tuple[str, float, float]] = []

    def _generate(self, prompts, params, seeds):
        t0 = time.perf_counter()
        out = super()._generate(prompts, params, seeds)
        time.sleep(GEN_SECONDS)
        self.intervals.append(("generate", t0, time.perf_counter()))
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRICS, concurrency_group=TRAIN_GROUP)
    def update_actor(self, data):
        t0 = time.perf_counter()
        out = super().update_actor(data)
        self.intervals.append(("update", t0, time.perf_counter()))
        return out

    def recorded(self) -> list[tuple[str, float, float]]:
        return list(self.intervals)


def test_next_rollout_generates_while_the_update_runs_on_the_same_ray_worker(
    tiny_model_path, tmp_path, ray_cluster, monkeypatch
):
    import verl.trainer.ppo.ray_worker_group as ray_wg
    from verl.single_controller import ray_worker_group as sc

    monkeypatch.setattr(ray_wg, "ActorRolloutRefWorker", RecordingWorker)
    recorded: list = []
    shutdown = sc.RayWorkerGroup.shutdown

    def keep_records(self):
        recorded.extend(self.execute_all("recorded"))
        shutdown(self)

    monkeypatch.setattr(sc.RayWorkerGroup, "shutdown", keep_records)
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "ckpt"),
            3,
            extra=[*QUIET, "trainer.force_ray_workers=True", "trainer.rollout_overlap=True"],
        )
    )
    steps = {h["step"]: h for h in hist if h["step"] > 0}
    assert [steps[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for step, h in steps.items():
        for key, value in h.items():
            if isinstance(value, float):
                assert math.isfinite(value), (step, key)
    assert len(recorded) == 1  # one worker process
    intervals = recorded[0]
    updates = [(t0, t1) for kind, t0, t1 in intervals if kind == "update"]
    gens = [(t0, t1) for kind, t0, t1 in intervals if kind == "generate"]
    assert len(updates) == 3 and len(gens) >= 3 * 4  # every rollout: memory turns + the final answer

    def overlap(u):  # seconds of the update during which a generation ran
        return sum(max(0.0, min(u[1], g1) - max(u[0], g0)) for g0, g1 in gens)

    # updates 1 and 2 ran while the rollouts of steps 2 and 3 were generated; update 3 has no rollout ahead
    assert overlap(updates[0]) > 0 and overlap(updates[1]) > 0, (updates, gens)
    assert overlap(updates[2]) == 0.0
    # the worker's own account (perf/update_generation_overlap_*, rank 0; what the GPU benchmark reports) agrees
    for step, u in zip((1, 2, 3), updates):
        seconds, frac = (steps[step][f"perf/update_generation_overlap_{k}"] for k in ("s", "frac"))
        assert seconds == pytest.approx(overlap(u), abs=0.05), step
        assert frac == pytest.approx(seconds / (u[1] - u[0]), rel=0.2, abs=0.05), step
    assert steps[1]["perf/update_generation_overlap_frac"] > 0 and steps[3]["perf/update_generation_overlap_s"] == 0
    # perf/rollout/generate_s: the seconds with a generation in flight since the previous update; every rollout ran
    # before the last update ended (the last step launches none ahead), so the steps' sum is all of them
    gen_union = sum(t1 - t0 for t0, t1 in gens)  # generations never overlap each other here (one rollout thread)
    per_step = [steps[s]["perf/rollout/generate_s"] for s in (1, 2, 3)]
    assert sum(per_step) == pytest.approx(gen_union, abs=0.1), (per_step, gens, updates)
    assert all(steps[s]["perf/rollout/generate_s"] > 0 for s in (1, 2, 3))
    for s in (1, 2, 3):  # the hf engine's forwards and the seconds its batches ran, within the generate calls' time
        assert steps[s]["perf/rollout/engine_steps"] >= 4  # at least one memory turn + the final answer, each a batch
        assert 0 < steps[s]["perf/rollout/engine_step_s"] <= steps[s]["perf/rollout/generate_s"] + 0.05


def test_bench_train_step_reports_the_update_time_overlapped_by_generation():
    """``bench_train_step.py --overlap both``: per step the seconds and fraction of the update during which the worker
    generated (the worker's ``perf/update_generation_overlap_*``), and over the steps with a rollout ahead (not the
    last) the fraction of all their update seconds."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_train_step import overlap_summary, overlap_table, step_rows

    def history(overlaps: list[tuple[float, float]]) -> list[dict]:
        return [
            {
                "step": i + 1,
                "timing_s/step": 10.0,
                "timing_s/update_actor": update,
                "perf/update_generation_overlap_s": during,
                "perf/update_generation_overlap_frac": during / update,
                "rollout/staleness": float(i > 0),
            }
            for i, (update, during) in enumerate(overlaps)
        ]

    sync = step_rows(history([(4.0, 0.0), (4.0, 0.0), (4.0, 0.0)]), 4)
    ahead = step_rows(history([(4.0, 3.0), (6.0, 6.0), (5.0, 0.0)]), 4)
    assert [r["update_gen_overlap_s"] for r in ahead] == [3.0, 6.0, 0.0]
    assert [r["update_gen_overlap_frac"] for r in ahead] == [0.75, 1.0, 0.0]
    summary = overlap_summary(sync, ahead)
    assert summary["update_gen_overlap_frac"] == pytest.approx((3.0 + 6.0) / (4.0 + 6.0))  # the last step left out
    assert overlap_summary(sync, sync)["update_gen_overlap_frac"] == 0.0
    table = overlap_table({"steps": sync, "overlap_steps": ahead, "overlap_summary": summary})
    assert "| update during gen |" in table.splitlines()[2] and "| 3 (75%) |" in table
    assert "90% of the update time (steps with a rollout ahead) ran while the worker generated" in table

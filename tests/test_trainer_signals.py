"""Faults around the trainer's outer loop (verl/trainer/ppo/fit.py), on real tiny CPU runs.

* SIGTERM to ``python -m verl.trainer.main_ppo``: the step in flight finishes, is logged and checkpointed, the
  process exits 0 and the same command continues from that step; a second SIGTERM abandons the step (exit 143)
  and keeps the last complete checkpoint.
* A step's metrics are logged before its checkpoint is written (a crash right after the save keeps them).
* Resuming logs every step once in metrics.jsonl (lines of redone steps move to metrics.jsonl.superseded).
* SIGTERM to the trainer's whole process group (``timeout``, a shell script's job): the trainer's helper processes
  (Ray's, data-loader workers, the engine's own process) are in groups of their own, so the step still finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from hydra import compose, initialize_config_dir

import verl.trainer.main_ppo as main_ppo
from tests.test_config import compose_config
from tests.test_trainer_e2e import _data
from verl.utils.checkpoint import CheckpointManager

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(Path(main_ppo.__file__).parent / "config")


def _overrides(tmp: Path, model: Path, out: Path, steps: int, extra=()) -> list[str]:
    """A tiny memory-agent GRPO run on CPU (one in-process rank, HF rollout), logs in ``out/logs``."""
    return [
        f"data.train_files={_data(tmp, 4, 'train', doc_chars=100)}",
        f"data.val_files={_data(tmp, 2, 'val', doc_chars=100)}",
        "data.train_batch_size=2",
        "data.truncation=center",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.seed=123",
        "actor_rollout_ref.rollout.prompt_length=256",
        "actor_rollout_ref.rollout.response_length=8",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "algorithm.adv_estimator=grpo",
        "recurrent.enable=memory",
        "recurrent.memory.config.chunk_size=32",
        "recurrent.memory.config.max_memorization_length=8",
        "recurrent.memory.config.max_final_response_length=8",
        "recurrent.memory.config.max_chunks=2",
        "recurrent.memory.config.max_prompt_length=32",
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "trainer.ray_num_cpus=1",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=True",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={out}",
        "trainer.progress_bar=False",
        "trainer.project_name=t",
        "trainer.experiment_name=t",
        f"custom_reward_function.path={REPO / 'tests' / 'fixtures' / 'parity_reward.py'}",
        *extra,
    ]


def _logged_steps(out: Path) -> list[int]:
    path = out / "logs" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def _start(overrides: list[str], log: Path, ray_address: str | None = None) -> subprocess.Popen:
    """``ray_address``: join that running cluster through ``RAY_ADDRESS`` (the command line stays the same)
    instead of starting a local one (5-9 s of a 2-core machine per run)."""
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides, f"hydra.run.dir={log.parent / 'hydra'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    with log.open("w") as f:
        return subprocess.Popen(cmd, cwd=str(log.parent), env=env, stdout=f, stderr=subprocess.STDOUT)


def _wait_for(predicate, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"trainer exited with {proc.returncode} early:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out; log:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"trainer did not exit; log:\n{log.read_text()[-4000:]}")
    return rc, log.read_text()


def test_sigterm_finishes_the_step_checkpoints_exits_0_and_the_same_command_resumes(
    tiny_model_path, tmp_path, ray_cluster
):
    out = tmp_path / "run"
    # trainer.ray_num_cpus=null: the runs that join the session's Ray cluster may not size it. The thread reward
    # manager (Ray actors) makes the trainer start Ray: a single CPU rank with the naive one runs without it.
    extra = ["trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.ray_num_cpus=null"]
    extra.append("reward_model.reward_manager=thread")
    overrides = _overrides(tmp_path, tiny_model_path, out, 5, extra=extra)
    manager = CheckpointManager(out)

    # 1. SIGTERM while step 2 runs (sent as soon as step 1 is logged); this run starts (and stops) its own Ray
    log1 = tmp_path / "first.log"
    proc = _start(overrides, log1)
    _wait_for(lambda: 1 in _logged_steps(out), proc, log1)
    proc.send_signal(signal.SIGTERM)
    # runs 2 and 3 join the session's cluster: the same command (RAY_ADDRESS in the environment), without two more
    # Ray start-ups. Run 1 keeps the SIGTERM handler of a self-started Ray head. The cluster already runs the reward
    # actor (started here while run 1 winds down), which the trainers reuse by name instead of starting their own.
    from verl.workers.reward_manager.thread import RewardActorPool

    try:
        pool = RewardActorPool()
    except BaseException:
        proc.kill()
        raise
    try:
        _check_the_three_runs(overrides, out, manager, tmp_path, proc, log1, ray_cluster)
    finally:
        for actor in pool.actors:
            ray.kill(actor)


def _check_the_three_runs(overrides, out, manager, tmp_path, proc, log1, ray_address) -> None:
    rc, text = _finish(proc, log1)
    assert rc == 0, text[-4000:]
    assert "Started a local Ray instance." in text  # the SIGTERM reached a trainer that started its own Ray head
    assert "[trainer] SIGTERM received: finishing step " in text
    latest = manager.find_latest()
    assert latest is not None, text[-4000:]
    stopped = manager.step_of(latest)
    # save_freq=-1: only the signal wrote a checkpoint, for the step it let finish: step 2 when the signal (sent as
    # soon as step 1 is logged) landed in step 2, step 1 when it landed between step 1's log line and step 2's start
    assert 1 <= stopped < 5
    assert f"[trainer] SIGTERM received: finishing step {stopped}/5, then writing a " in text
    assert [s for s, _ in manager.list_checkpoints()] == [stopped]
    assert f"stopped after step {stopped}/5; checkpoint written to {latest}" in text
    assert f"Run the same command again (trainer.resume_mode=auto) to continue from step {stopped}" in text
    assert _logged_steps(out) == list(range(stopped + 1))  # the finished step was logged, nothing after it

    # 2. the same command resumes there; two SIGTERMs abandon the step in flight: exit 143, no new checkpoint
    log2 = tmp_path / "second.log"
    proc = _start(overrides, log2, ray_address)
    # the first SIGTERM once the resumed run has logged a step: it lands in the next one, not the last (the steps take
    # ~0.2 s here: a fixed delay after the resume could land in step 5, which then ends the run normally)
    _wait_for(lambda: stopped + 1 in _logged_steps(out), proc, log2)
    proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: "SIGTERM received" in log2.read_text(), proc, log2)
    proc.send_signal(signal.SIGTERM)
    rc, text = _finish(proc, log2)
    assert rc == 143, text[-4000:]
    assert f"Connecting to existing Ray cluster at address: {ray_address}" in text
    assert f"[trainer] resumed from {latest} (step {stopped})" in text
    assert "[trainer] second SIGTERM received: abandoning " in text
    assert f"nothing new was saved. Latest checkpoint: {latest}." in text
    assert [s for s, _ in manager.list_checkpoints()] == [stopped]

    # 3. the same command again runs to the end; every step is in metrics.jsonl exactly once
    log3 = tmp_path / "third.log"
    proc = _start(overrides, log3, ray_address)
    rc, text = _finish(proc, log3)
    assert rc == 0, text[-4000:]
    assert f"Connecting to existing Ray cluster at address: {ray_address}" in text
    assert f"[trainer] resumed from {latest} (step {stopped})" in text
    assert _logged_steps(out) == [0, 1, 2, 3, 4, 5]


# the leader of a new session that runs the trainer (argv) as a member of its group, ignores SIGTERM itself and
# exits with the trainer's exit code: what `timeout` does (it signals its whole group)
GROUP_LEADER = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: None)  # a handler, not SIG_IGN: the trainer starts with the default action
sys.exit(subprocess.call(sys.argv[1:]))
"""


# the helper processes of the process-group test's two runs (its parameters)
GROUP_HELPERS = {
    "ray_worker": ["trainer.force_ray_workers=True", "trainer.ray_num_cpus=2"],
    "engine_in_a_child_process": ["actor_rollout_ref.rollout.engine_process=child"],
}


@pytest.fixture(scope="module")
def process_group_runs(tiny_model_path, tmp_path_factory) -> dict[str, tuple]:
    """The runs of the process-group test, each in a session of its own, started at once: both spend most of their
    time importing and starting up on one core, so the module waits for the slower instead of their sum. Each
    group gets its SIGTERM as soon as its own step 1 is logged; returns ``{name: (exit code or None if it exited
    before its signal or hung, log text, out folder)}``."""
    started = {}
    for name, helpers in GROUP_HELPERS.items():
        tmp = tmp_path_factory.mktemp(f"group_{name}")
        out = tmp / "run"
        extra = ["trainer.save_freq=-1", "trainer.test_freq=-1", "data.dataloader_num_workers=1", *helpers]
        overrides = _overrides(tmp, tiny_model_path, out, 5, extra=extra)
        log = tmp / "trainer.log"
        cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides, f"hydra.run.dir={tmp / 'hydra'}"]
        env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}
        env.pop("RAY_ADDRESS", None)  # its own Ray instance (ray_worker), not the session's
        with log.open("w") as f:
            proc = subprocess.Popen(
                [sys.executable, "-c", GROUP_LEADER, *cmd],
                cwd=str(tmp),
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started[name] = (proc, out, log)
    signalled = set()
    try:
        deadline = time.monotonic() + 300.0
        waiting = dict(started)
        while waiting and time.monotonic() < deadline:
            for name, (proc, out, _) in list(waiting.items()):
                if 1 in _logged_steps(out):
                    os.killpg(proc.pid, signal.SIGTERM)
                    signalled.add(name)
                    del waiting[name]
                elif proc.poll() is not None:  # exited early: its test fails with the log
                    del waiting[name]
            time.sleep(0.05)
        results = {}
        for name, (proc, out, log) in started.items():
            try:
                rc = proc.wait(timeout=300) if name in signalled else None
            except subprocess.TimeoutExpired:
                rc = None
            results[name] = (rc, log.read_text(), out)
    finally:
        for proc, _, _ in started.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


@pytest.mark.parametrize("helpers", list(GROUP_HELPERS))
def test_sigterm_to_the_whole_process_group_still_finishes_the_step_and_checkpoints(process_group_runs, helpers):
    """The trainer runs in a process group whose every member gets SIGTERM once step 1 is logged. Its rank runs in a
    Ray worker of a Ray instance it starts itself (or in-process with the rollout engine in a child process), and it
    loads data in a worker process: all of those would die of the same SIGTERM (a Ray actor gone, "DataLoader worker
    is killed by signal") were they in the trainer's group."""
    rc, text, out = process_group_runs[helpers]
    assert rc is not None, f"the trainer exited before step 1 was logged, or did not exit; log:\n{text[-4000:]}"
    assert rc == 0, text[-4000:]
    assert "[trainer] SIGTERM received: finishing step " in text
    latest = CheckpointManager(out).find_latest()
    assert latest is not None, text[-4000:]
    stopped = CheckpointManager(out).step_of(latest)
    assert 1 <= stopped < 5
    assert f"stopped after step {stopped}/5; checkpoint written to {latest}" in text
    assert _logged_steps(out) == list(range(stopped + 1))
    if helpers == "ray_worker":
        assert "Started a local Ray instance." in text


def test_step_metrics_are_logged_before_its_checkpoint_and_resume_logs_each_step_once(
    tiny_model_path, tmp_path, monkeypatch, capsys
):
    """The save of step 3 crashes right after the checkpoint is complete (like a kill at that moment): step 3's
    metrics and validation are already in metrics.jsonl. The resumed run starts from checkpoint 3 and logs steps 4
    on; a second crash, this time while step 4's checkpoint is written, leaves step 4 logged but checkpoint 3
    latest: the next resume redoes step 4 and metrics.jsonl still holds each step once."""
    out = tmp_path / "run"
    extra = ["trainer.save_freq=1", "trainer.test_freq=3", "trainer.logger=[jsonl]"]

    def cfg(steps: int):
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            return compose(
                config_name="ppo_trainer", overrides=_overrides(tmp_path, tiny_model_path, out, steps, extra)
            )

    real_save = CheckpointManager.save
    crash = {"after_save_of": 3, "before_save_of": None}

    def save(self, step, write_fn, *args, **kwargs):
        if step == crash["before_save_of"]:
            raise RuntimeError(f"killed while writing checkpoint {step}")
        path = real_save(self, step, write_fn, *args, **kwargs)
        if step == crash["after_save_of"]:
            raise RuntimeError(f"killed right after checkpoint {step}")
        return path

    monkeypatch.setattr(CheckpointManager, "save", save)
    with pytest.raises(RuntimeError, match="killed right after checkpoint 3"):
        main_ppo.run(cfg(5))
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "val-core/hotpotqa/reward/mean@1" in rows[3] and "actor/pg_loss" in rows[3]
    assert CheckpointManager(out).find_latest().name == "global_step_3"

    crash.update(after_save_of=None, before_save_of=4)
    with pytest.raises(RuntimeError, match="killed while writing checkpoint 4"):
        main_ppo.run(cfg(5))
    assert _logged_steps(out) == [0, 1, 2, 3, 4]
    assert CheckpointManager(out).find_latest().name == "global_step_3"

    crash.update(before_save_of=None)
    history = main_ppo.run(cfg(5))
    assert [h["step"] for h in history] == [4, 5]
    assert _logged_steps(out) == [0, 1, 2, 3, 4, 5]
    superseded = (out / "logs" / "metrics.jsonl.superseded").read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded] == [4]  # the first try of step 4

    # SIGTERM while the checkpoint is being loaded: no step runs, nothing is saved, the handler is put back
    real_resolve = CheckpointManager.resolve_resume

    def resolve_then_sigterm(self, *args, **kwargs):
        found = real_resolve(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return found

    monkeypatch.setattr(CheckpointManager, "resolve_resume", resolve_then_sigterm)
    capsys.readouterr()
    before = signal.getsignal(signal.SIGTERM)
    assert main_ppo.run(cfg(6)) == []
    printed = capsys.readouterr().out
    assert "[trainer] SIGTERM received: finishing loading the checkpoint to resume from" in printed
    assert "SIGTERM: stopping before step 6/6; no step ran since the last checkpoint, so none is written" in printed
    assert "continue from step 5" in printed
    assert [s for s, _ in CheckpointManager(out).list_checkpoints()][-1] == 5
    assert _logged_steps(out) == [0, 1, 2, 3, 4, 5]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_sigterm_re_raised_by_a_library_as_its_own_error_still_exits_143(tmp_path):
    """torch.distributed.checkpoint catches the handler's StepAbandoned inside a save and raises a
    CheckpointException: the run must still end as abandoned (exit 143, no new checkpoint), not as a crash."""
    from tests.test_config_consumed_run import ScriptedTrainer
    from verl.trainer.ppo.signals import ABANDONED_EXIT_CODE, StepAbandoned

    class SaveInterruptedBySecondSigterm(ScriptedTrainer):
        def train_step(self, batch, next_batch=None, upcoming=None):
            if self.global_step == 1:  # the second step: the first SIGTERM, so the step ends with a save ...
                os.kill(os.getpid(), signal.SIGTERM)
            return {"critic/score/mean": 0.5}

    def interrupted_save(path):  # ... during which the second SIGTERM arrives inside a library that wraps it
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except StepAbandoned as exc:
            raise RuntimeError("CheckpointException ranks: dict_keys([0])") from exc

    from verl.trainer.ppo.fit import fit
    from verl.utils.dataset.sampler import ResumableDataLoader

    cfg = compose_config([f"trainer.default_local_dir={tmp_path}", "trainer.save_freq=-1", "trainer.test_freq=-1"])
    rows = [{"x": torch.tensor([i])} for i in range(4)]
    loader = ResumableDataLoader(
        rows,
        batch_size=1,
        shuffle=False,
        seed=0,
        collate_fn=lambda items: {"x": torch.stack([it["x"] for it in items])},
    )
    trainer = SaveInterruptedBySecondSigterm(cfg)
    trainer.groups["actor"].save_checkpoint = interrupted_save
    ckpt = CheckpointManager(str(tmp_path), max_ckpt_to_keep=None)
    with pytest.raises(StepAbandoned) as abandoned:
        fit(trainer, loader, [], ckpt, 4)
    assert abandoned.value.code == ABANDONED_EXIT_CODE
    assert isinstance(abandoned.value.__cause__, RuntimeError)  # the library's error is kept as the cause
    assert trainer.global_step == 1 and ckpt.find_latest() is None  # step 1 finished; its save was abandoned
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back

"""One-step-off training (``trainer.rollout_overlap``) and its truncated importance-sampling correction
(``algorithm.rollout_is``, ``algorithm.rollout_is_threshold``): the TIS weight against hand-computed values, the
actor applying it to the policy loss only, the background rollout and staleness bookkeeping, and ``fit`` handing
each step the next step's batch (kept by a checkpoint).

The end-to-end runs of the memory-agent trainer with overlap on and off are in ``test_rollout_overlap_e2e.py``.
"""

from __future__ import annotations

import copy
import math
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.test_config import compose_config
from tests.test_config_consumed_run import ScriptedTrainer
from tests.test_dp_actor import _loss_and_grads, base_model, make_update_data  # noqa: F401 (base_model: fixture)
from verl.trainer.ppo.rollout_correction import compute_rollout_is_weights, rollout_is_metrics
from verl.trainer.ppo.rollout_overlap import Rollout, RolloutAhead, staleness_metrics

# ------------------------------------------------------------------------------------------------ TIS weights


def test_truncated_is_weights_match_hand_computed_values():
    old = torch.tensor([[-1.0, -2.0, -0.1, -0.5, -3.0], [-0.2, -0.3, 0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -1.0, 0.0, -1.0], [-0.2, -0.1, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    w = compute_rollout_is_weights(old, rollout, mask, threshold=2.0)
    expected = torch.tensor(
        [
            # exp(0.5), exp(-1), exp(0.9)=2.4596 capped at 2, no engine log-prob (0) -> 1, outside the mask -> 1
            [math.exp(0.5), math.exp(-1.0), 2.0, 1.0, 1.0],
            # exp(0) = 1, exp(-0.2), padding -> 1
            [1.0, math.exp(-0.2), 1.0, 1.0, 1.0],
        ]
    )
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    assert not w.requires_grad
    # a cap of 1.5 truncates exp(0.5) = 1.6487 too
    assert compute_rollout_is_weights(old, rollout, mask, threshold=1.5)[0, 0].item() == pytest.approx(1.5)
    m = rollout_is_metrics(w, old, rollout, mask, 2.0)
    valid = [math.exp(0.5), math.exp(-1.0), 2.0, 1.0, math.exp(-0.2)]  # masked tokens with an engine log-prob
    assert m["rollout/is_weight_mean"] == pytest.approx(sum(valid) / 5, abs=1e-6)
    assert m["rollout/is_weight_min"] == pytest.approx(math.exp(-1.0), abs=1e-6)
    assert m["rollout/is_weight_max"] == pytest.approx(2.0)
    assert m["rollout/is_truncated_frac"] == pytest.approx(1 / 5)
    # a ratio exactly at the cap (old == rollout, cap 1) is not truncated
    at_cap = rollout_is_metrics(torch.ones(1, 2), rollout[:1, :2], rollout[:1, :2], mask[:1, :2], 1.0)
    assert at_cap["rollout/is_truncated_frac"] == 0.0
    with pytest.raises(ValueError, match="rollout_is_threshold must be > 0"):
        compute_rollout_is_weights(old, rollout, mask, threshold=0.0)


def test_actor_multiplies_is_weights_into_the_policy_loss_only(base_model):  # noqa: F811 (fixture)
    """``rollout_is_weights`` scale the PPO term per token; the KL term and the entropy metric are unweighted."""
    data = make_update_data(base_model, num_conv=4, seed=6)
    loss_1, grads_1, metrics_1 = _loss_and_grads(base_model, data, calculate_entropy=True)
    weighted = copy.deepcopy(data)
    weighted.batch["rollout_is_weights"] = torch.full_like(data.batch["old_log_probs"], 2.0)
    _, grads_2, metrics_2 = _loss_and_grads(base_model, weighted, calculate_entropy=True)
    assert metrics_2["actor/pg_loss"] == pytest.approx(2 * metrics_1["actor/pg_loss"], abs=1e-6)
    assert metrics_2["actor/kl_loss"] == pytest.approx(metrics_1["actor/kl_loss"], abs=1e-7)
    assert metrics_2["actor/entropy"] == pytest.approx(metrics_1["actor/entropy"], abs=1e-7)
    assert metrics_1["actor/pg_loss"] != pytest.approx(0.0, abs=1e-4)  # the comparison means something
    # per token: weight 0 on the first row removes exactly that row's policy-gradient contribution
    zero_first = copy.deepcopy(data)
    zero_first.batch["rollout_is_weights"] = torch.ones_like(data.batch["old_log_probs"])
    zero_first.batch["rollout_is_weights"][0] = 0.0
    without_first = copy.deepcopy(data)
    without_first.batch["advantages"][0] = 0.0
    _, grads_a, m_a = _loss_and_grads(base_model, zero_first, use_kl_loss=False)
    _, grads_b, m_b = _loss_and_grads(base_model, without_first, use_kl_loss=False)
    assert m_a["actor/pg_loss"] == pytest.approx(m_b["actor/pg_loss"], abs=1e-6)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------ rollout ahead


def test_rollout_ahead_runs_in_the_background_and_is_taken_by_its_batch():
    started, release = threading.Event(), threading.Event()
    seen = {}

    def make(questions, step):
        seen["thread"], seen["step"] = threading.current_thread().name, step
        started.set()
        assert release.wait(10)
        return [q * 10 for q in questions], {"gen": 1.5}, {"train/num_gen_batches": 1}

    ahead = RolloutAhead(enabled=True)
    questions = [1, 2]
    assert ahead.launch(make, questions, policy_version=4, step=6)
    assert started.wait(10) and ahead.running  # running while this thread goes on (the actor update)
    release.set()
    assert ahead.wait() >= 0.0
    with pytest.raises(RuntimeError, match="not the one whose rollout ran ahead"):
        ahead.take([1, 2])  # an equal batch, but not the one drawn for it
    rollout = ahead.take(questions)
    assert rollout == Rollout([10, 20], 4, {"gen": 1.5}, {"train/num_gen_batches": 1}, ahead=True)
    assert seen == {"thread": seen["thread"], "step": 6} and seen["thread"].startswith("rollout-ahead")
    assert ahead.take(questions) is None and not ahead.running
    ahead.close()
    # disabled (trainer.rollout_overlap=False) or no next batch (last step): nothing starts
    assert not RolloutAhead(enabled=False).launch(make, questions, 0, step=1)
    assert not RolloutAhead(enabled=True).launch(make, None, 0, step=1)


def test_rollout_ahead_reraises_the_rollouts_error_at_wait():
    def make(questions, step):
        raise KeyError("engine died")

    ahead = RolloutAhead(enabled=True)
    ahead.launch(make, [1], 0, step=1)
    with pytest.raises(KeyError, match="engine died"):
        ahead.wait()
    ahead.close()


def test_staleness_is_checked_and_recorded():
    assert staleness_metrics(Rollout(None, 3, ahead=False), 3) == {
        "rollout/staleness": 0.0,
        "rollout/policy_version": 3.0,
    }
    assert staleness_metrics(Rollout(None, 2, ahead=True), 3)["rollout/staleness"] == 1.0
    with pytest.raises(RuntimeError, match="staleness 1 .* must have staleness in \\[0\\]"):
        staleness_metrics(Rollout(None, 2, ahead=False), 3)  # the weights changed under a synchronous rollout
    with pytest.raises(RuntimeError, match="staleness 2"):
        staleness_metrics(Rollout(None, 1, ahead=True), 3)  # two updates behind: the pipelining is broken


def test_rollout_is_defaults_to_the_overlap_key():
    from verl.trainer.ppo.trainer_core import TrainerCore

    def use_is(*overrides):
        return TrainerCore(compose_config(list(overrides)), None, None, None, None).use_rollout_is

    assert use_is() is False
    assert use_is("trainer.rollout_overlap=True") is True
    assert use_is("trainer.rollout_overlap=True", "algorithm.rollout_is=False") is False
    assert use_is("algorithm.rollout_is=True") is True
    from verl.trainer.config_schema import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm.rollout_is_threshold must be > 0 .*\(got -1.0\)"):
        use_is("algorithm.rollout_is_threshold=-1.0")


# ------------------------------------------------------------------------------------------------ fit


class LookaheadTrainer(ScriptedTrainer):
    """Records the batch and the upcoming batch of every step."""

    def __init__(self, config):
        super().__init__(config)
        self.steps = []

    def train_step(self, batch, next_batch=None, upcoming=None):
        self.steps.append((self.global_step, batch, upcoming))
        return {"critic/score/mean": 0.5}


def run_fit(tmp_path, *overrides, total_steps=4):
    from verl.trainer.ppo.fit import fit
    from verl.utils.checkpoint import CheckpointManager
    from verl.utils.dataset.sampler import ResumableDataLoader

    cfg = compose_config([f"trainer.default_local_dir={tmp_path}", "trainer.val_before_train=False", *overrides])
    rows = [{"x": torch.tensor([i])} for i in range(6)]
    loader = ResumableDataLoader(
        rows, batch_size=1, shuffle=False, seed=0, collate_fn=lambda items: {"x": torch.stack([i["x"] for i in items])}
    )
    trainer = LookaheadTrainer(cfg)
    fit(trainer, loader, None, CheckpointManager(str(tmp_path), max_ckpt_to_keep=None), total_steps)
    return trainer


def _row(batch) -> int | None:
    return None if batch is None else int(batch.batch["x"][0])


def test_fit_hands_each_step_the_next_steps_batch(tmp_path):
    on = run_fit(tmp_path / "on", "trainer.rollout_overlap=True", "trainer.save_freq=2", total_steps=3)
    assert [(s, _row(b), _row(u)) for s, b, u in on.steps] == [(1, 0, 1), (2, 1, 2), (3, 2, None)]
    assert on.steps[1][1] is on.steps[0][2] and on.steps[2][1] is on.steps[1][2]  # the same object: taken as is
    # the checkpoint of step 2 keeps the batch drawn for step 3 (the loader is already past it) ...
    with open(tmp_path / "on" / "global_step_2" / "trainer_state.pkl", "rb") as f:
        assert _row(pickle.load(f)["upcoming"]) == 2
    # ... and a resumed run trains step 3 on it, then draws on from the loader
    resumed = run_fit(
        tmp_path / "on",
        "trainer.rollout_overlap=True",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={tmp_path / 'on' / 'global_step_2'}",
        total_steps=4,
    )
    assert [(s, _row(b), _row(u)) for s, b, u in resumed.steps] == [(3, 2, 3), (4, 3, None)]
    # off: no upcoming batch, the same data order
    off = run_fit(tmp_path / "off", "trainer.save_freq=3", total_steps=3)
    assert [(s, _row(b), _row(u)) for s, b, u in off.steps] == [(1, 0, None), (2, 1, None), (3, 2, None)]
    with open(Path(tmp_path / "off" / "global_step_3" / "trainer_state.pkl"), "rb") as f:
        assert "upcoming" not in pickle.load(f)


# ------------------------------------------------------------------------------------------------ memory estimate


def test_memory_estimate_keeps_the_engine_awake_during_the_update_with_overlap(tmp_path):
    """The start-up estimate (trainer.memory_check) counts vLLM's weights and KV cache in the training phases when
    the next rollout runs during the update, and names the key when that no longer fits."""
    from transformers import Qwen2Config

    from tests.test_memory_estimate import H200, HOST, QWEN25_7B, _compose
    from verl.utils.memory_estimate import ModelShape, estimate_memory, plan_from_config

    shape = ModelShape.from_hf_config(Qwen2Config(**QWEN25_7B))
    base = [
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.8",  # fits asleep during the update, not awake
    ]
    sync = estimate_memory(shape, plan_from_config(_compose(tmp_path, QWEN25_7B, base)), H200, HOST)
    plan = plan_from_config(_compose(tmp_path, QWEN25_7B, [*base, "trainer.rollout_overlap=True"]))
    overlap = estimate_memory(shape, plan, H200, HOST)
    assert sync.problems() == [] and not sync.gpu["update"].get("KV cache")
    kv = overlap.gpu["rollout"]["KV cache"]
    assert kv > 0 and overlap.gpu["update"]["KV cache"] == kv
    assert overlap.gpu_total("update") == pytest.approx(
        sync.gpu_total("update") + kv + overlap.gpu["rollout"]["rollout weights"]
    )
    problems = "\n".join(overlap.problems())
    assert "while training; set trainer.rollout_overlap=False" in problems


def test_weight_sync_waits_for_the_rollout_running_ahead():
    """The engine's weights change only after the rollout launched on them has finished; versions follow."""
    import types

    from verl.trainer.ppo.trainer_core import TrainerCore

    finished = threading.Event()
    order = []

    def make(questions, step):
        time.sleep(0.3)  # still generating when the update is done
        order.append(f"rollout of step {step} done")
        finished.set()
        return questions, {}, {}

    wg = types.SimpleNamespace(sync_rollout_weights=lambda: order.append(f"sync (rollout done: {finished.is_set()})"))
    trainer = TrainerCore(compose_config(["trainer.rollout_overlap=True"]), None, wg, None, None)
    trainer.global_step = 1
    first = trainer.step_rollout("batch 1", make)  # step 1: generated now, on version 0
    assert (first.policy_version, first.ahead, trainer.policy_version) == (0, False, 0)
    assert trainer.launch_next_rollout("batch 2", make)
    trainer.policy_version = 1  # the update of step 1
    timing = {}
    trainer.sync_rollout_weights(timing)
    assert order == ["rollout of step 1 done", "rollout of step 2 done", "sync (rollout done: True)"]
    assert trainer.rollout_version == 1 and timing["wait_rollout_ahead"] > 0.1
    trainer.global_step = 2
    second = trainer.step_rollout("batch 2", make)
    assert (second.result, second.policy_version, second.ahead) == ("batch 2", 0, True)
    assert trainer.rollout_metrics(second, timing)["rollout/staleness"] == 1.0


def test_rollout_ahead_says_how_long_it_has_run_and_been_finished():
    release = threading.Event()

    def make(questions, step):
        assert release.wait(10)
        return questions, {}, {}

    ahead, questions = RolloutAhead(enabled=True), [1]
    assert ahead.idle_s() == 0.0 and ahead.launched_s() == 0.0  # none launched
    ahead.launch(make, questions, 0, step=1)
    assert ahead.idle_s() == 0.0  # still running
    time.sleep(0.2)
    release.set()
    ahead.wait()
    time.sleep(0.2)
    idle = ahead.idle_s()
    assert 0.2 <= idle < 5.0 and ahead.launched_s() - idle >= 0.2  # it ran 0.2 s, then waited
    ahead.take(questions)
    assert ahead.idle_s() == 0.0 and ahead.launched_s() == 0.0
    ahead.close()


def _balancing_trainer(*overrides: str):
    """A TrainerCore over two fake ranks whose shift_engine_reserved_sms moves real TrainingSMs (no device)."""
    import types

    from verl.trainer.ppo.trainer_core import TrainerCore
    from verl.workers.training_sms import TrainingSMs

    config = compose_config(["trainer.rollout_overlap=True", *overrides])
    ranks = [TrainingSMs(int(config.actor_rollout_ref.rollout.engine_reserved_sms), None) for _ in range(2)]
    shifts = []

    def shift(delta):
        shifts.append(delta)
        return [r.shift(delta) for r in ranks]

    wg = types.SimpleNamespace(sync_rollout_weights=lambda: None, shift_engine_reserved_sms=shift)
    trainer = TrainerCore(config, None, wg, None, None)
    trainer.global_step = 1
    trainer.step_rollout("batch 1", lambda q, step: (q, {}, {}))
    return trainer, ranks, shifts


def _overlapped_step(trainer, rollout_s: float, training_s: float) -> tuple[dict, dict]:
    """One step: the next rollout runs ``rollout_s`` in the background while the training passes take
    ``training_s``; returns (timing, metrics) of the weight sync."""

    def make(questions, step):
        time.sleep(rollout_s)
        return questions, {}, {}

    upcoming = f"batch {trainer.global_step + 1}"
    assert trainer.launch_next_rollout(upcoming, make)
    time.sleep(training_s)  # the training passes
    timing = {}
    trainer.policy_version = trainer.global_step
    metrics = trainer.sync_rollout_weights(timing)
    trainer.global_step += 1
    trainer.step_rollout(upcoming, make)
    return timing, metrics


def test_balance_reserved_sms_moves_the_split_towards_the_slower_side():
    """``rollout.balance_reserved_sms``: a step whose training waited for the rollout gives the engine 8 SMs more;
    one whose rollout waited for the training gives them back; ``perf/engine_reserved_sms`` is each step's split.
    The first step with a rollout ahead moves nothing (its training passes carry one-time costs)."""
    trainer, ranks, shifts = _balancing_trainer(
        "actor_rollout_ref.rollout.engine_reserved_sms=16", "actor_rollout_ref.rollout.balance_reserved_sms=True"
    )
    timing, metrics = _overlapped_step(trainer, rollout_s=0.6, training_s=0.05)  # the first: no move
    assert timing["wait_rollout_ahead"] > 0.4 and metrics == {"perf/engine_reserved_sms": 16.0} and shifts == []
    timing, metrics = _overlapped_step(trainer, rollout_s=0.6, training_s=0.05)  # the engine is slower
    assert timing["wait_rollout_ahead"] > 0.4 and timing["rollout_ahead_idle"] == 0.0
    assert metrics == {"perf/engine_reserved_sms": 16.0} and shifts == [8]
    assert trainer.engine_reserved_sms == 24 and [r.reserved for r in ranks] == [24, 24]
    timing, metrics = _overlapped_step(trainer, rollout_s=0.0, training_s=0.6)  # the training is slower
    assert timing["rollout_ahead_idle"] > 0.4 and timing["wait_rollout_ahead"] < 0.1
    assert metrics == {"perf/engine_reserved_sms": 24.0} and shifts == [8, -8]
    assert trainer.engine_reserved_sms == 16 and [r.reserved for r in ranks] == [16, 16]


def test_without_balancing_the_split_stays_and_is_logged_where_one_is_kept():
    trainer, ranks, shifts = _balancing_trainer("actor_rollout_ref.rollout.engine_reserved_sms=16")
    _, metrics = _overlapped_step(trainer, rollout_s=0.5, training_s=0.0)
    assert metrics == {"perf/engine_reserved_sms": 16.0} and shifts == [] and ranks[0].reserved == 16
    trainer, _, shifts = _balancing_trainer()
    timing, metrics = _overlapped_step(trainer, rollout_s=0.5, training_s=0.0)
    assert metrics == {} and shifts == [] and timing["wait_rollout_ahead"] > 0.3  # no split kept, none moved


def test_ranks_that_disagree_on_the_split_are_an_error():
    trainer, ranks, _ = _balancing_trainer(
        "actor_rollout_ref.rollout.engine_reserved_sms=16", "actor_rollout_ref.rollout.balance_reserved_sms=True"
    )
    _overlapped_step(trainer, rollout_s=0.0, training_s=0.0)  # the first step with a rollout ahead moves nothing
    ranks[1].reserved = 8
    with pytest.raises(RuntimeError, match=r"engine_reserved_sms disagree after a shift by 8: \{(24, 16|16, 24)\}"):
        _overlapped_step(trainer, rollout_s=0.6, training_s=0.0)


def test_scores_at_last_token_put_each_rows_score_on_its_last_response_token():
    """The last masked position, not the mask's length: a response mask may have holes (an agent's tool output
    inside its response is masked out)."""
    from verl.trainer.ppo.trainer_core import scores_at_last_token

    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    out = scores_at_last_token(torch.tensor([1.0, 0.5, 2.0]), mask)
    assert out.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]

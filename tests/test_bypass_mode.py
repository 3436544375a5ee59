"""``algorithm.bypass_mode``: PPO's old log-probs are the rollout engine's (verl's rollout_correction.bypass_mode).

The step then skips the actor's recompute pass; TIS stays off (its weight would be 1); the engine-vs-actor metrics
are not logged (they would read 0). Launch refuses it without engine log-probs and in async mode, naming the keys.
The end-to-end run against the recomputed one is in ``tests/test_trainer_e2e.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_config import compose_config
from verl import DataProto
from verl.trainer.config.algorithm import rollout_is_on
from verl.trainer.config_preflight import bypass_mode_errors
from verl.trainer.config_schema import ConfigError, validate_config
from verl.trainer.ppo.trainer_core import TrainerCore


class _Actor:
    """Stands in for the worker group: records the recompute calls."""

    def __init__(self):
        self.calls = 0

    def compute_log_prob(self, data: DataProto) -> DataProto:
        self.calls += 1
        return DataProto.from_dict(tensors={"old_log_probs": torch.full(data.batch["response_mask"].shape, -9.0)})


def _batch() -> DataProto:
    return DataProto.from_dict(
        tensors={
            "rollout_log_probs": torch.tensor([[-0.5, -1.25, 0.0], [-2.0, 0.0, 0.0]]),
            "response_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        }
    )


def test_bypass_takes_the_engine_log_probs_without_a_recompute_pass():
    trainer = TrainerCore(compose_config(["algorithm.bypass_mode=True"]), None, _Actor(), None, None)
    timing: dict[str, float] = {}
    out = trainer.old_log_probs(_batch(), timing)
    assert trainer.wg.calls == 0 and "old_log_prob" not in timing
    # a log-prob of exactly 0 (probability 1) is a log-prob like any other here
    assert out.batch["old_log_probs"].tolist() == [[-0.5, -1.25, 0.0], [-2.0, 0.0, 0.0]]
    assert trainer.off_policy_correction(out) == {}  # no TIS weights, no engine-vs-actor metrics
    assert "rollout_is_weights" not in out.batch.keys()


def test_without_bypass_the_actor_recomputes_them():
    trainer = TrainerCore(compose_config([]), None, _Actor(), None, None)
    timing: dict[str, float] = {}
    out = trainer.old_log_probs(_batch(), timing)
    assert trainer.wg.calls == 1 and "old_log_prob" in timing
    assert out.batch["old_log_probs"].eq(-9.0).all()
    assert "rollout/logprob_abs_diff_max" in trainer.off_policy_correction(out)


def test_bypass_on_a_batch_without_engine_log_probs_stops():
    trainer = TrainerCore(compose_config(["algorithm.bypass_mode=True"]), None, _Actor(), None, None)
    batch = DataProto.from_dict(tensors={"response_mask": torch.ones(1, 2, dtype=torch.long)})
    with pytest.raises(RuntimeError, match="calculate_log_probs=True or algorithm.bypass_mode=False"):
        trainer.old_log_probs(batch, {})


def test_tis_is_off_by_default_in_bypass_mode_even_with_the_overlap():
    assert rollout_is_on(None, rollout_overlap=True) is True
    assert rollout_is_on(None, rollout_overlap=True, bypass_mode=True) is False
    assert rollout_is_on(False, rollout_overlap=False, bypass_mode=True) is False
    trainer = TrainerCore(
        compose_config(["algorithm.bypass_mode=True", "trainer.rollout_overlap=True"]), None, None, None, None
    )
    assert trainer.use_rollout_is is False


def test_bypass_with_tis_forced_on_is_refused_naming_both_keys():
    cfg = compose_config(["algorithm.bypass_mode=True", "algorithm.rollout_is=True"])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert "algorithm.bypass_mode=True with algorithm.rollout_is=True" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["actor_rollout_ref.rollout.calculate_log_probs=False"],
            "actor_rollout_ref.rollout.calculate_log_probs=False",
        ),
        (["actor_rollout_ref.rollout.mode=async"], "actor_rollout_ref.rollout.mode=async"),
    ],
)
def test_bypass_without_engine_log_probs_for_every_token_is_refused(overrides, expected):
    (error,) = bypass_mode_errors(compose_config(["algorithm.bypass_mode=True", *overrides]))
    assert error.startswith(f"algorithm.bypass_mode=True with {expected}")
    assert bypass_mode_errors(compose_config(overrides)) == []  # without bypass mode: nothing to refuse
    assert bypass_mode_errors(compose_config(["algorithm.bypass_mode=True"])) == []

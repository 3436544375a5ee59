"""``actor_rollout_ref.rollout.calculate_log_probs``: whether training rollouts return the engine's log-probs.

On (default): the sampling parameters ask the engine for the sampled tokens' log-probs, the conversation batch carries
``rollout_log_probs`` and the engine-vs-actor metrics are logged. Off: nothing is asked, no ``rollout_log_probs``, no
such metrics; a config that needs them for TIS (``algorithm.rollout_is``, on by default with
``trainer.rollout_overlap``) is refused at launch, naming the keys. The engine-vs-actor metric skips tokens without
an engine log-prob (async turns re-tokenised from text carry 0 there), as TIS does.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.test_config import compose_config
from verl import DataProto
from verl.trainer.config_preflight import rollout_log_prob_errors
from verl.trainer.ppo.trainer_core import rollout_actor_mismatch, rollout_sampling
from verl.workers.rollout import SamplingParams

KEY = "actor_rollout_ref.rollout.calculate_log_probs"


def test_training_rollouts_ask_for_log_probs_by_default_and_not_when_off():
    on = SamplingParams.from_dict(rollout_sampling(compose_config([]), global_step=3, validate=False))
    off = SamplingParams.from_dict(rollout_sampling(compose_config([f"{KEY}=False"]), global_step=3, validate=False))
    assert (on.logprobs, off.logprobs) == (True, False)
    assert (on.temperature, on.top_p, on.top_k, on.seed) == (off.temperature, off.top_p, off.top_k, off.seed)
    # validation never asked for them
    assert not SamplingParams.from_dict(rollout_sampling(compose_config([]), global_step=3, validate=True)).logprobs


def test_the_single_turn_trainer_and_its_batch_follow_the_key():
    """The single-turn trainers' sampling (rollout_sampling plus max_tokens) asks for log-probs only when on, and
    outputs without log-probs give a batch without ``rollout_log_probs`` (TIS and the metric then skip it)."""
    from verl.trainer.ppo.single_turn import single_turn_sampling
    from verl.utils.conversation_batch import engine_log_probs

    for value in (True, False):
        params = single_turn_sampling(compose_config([f"{KEY}={value}"]), global_step=0, validate=False)
        assert params["logprobs"] is value
    outputs = [SimpleNamespace(token_ids=[5, 6], log_probs=None), SimpleNamespace(token_ids=[7], log_probs=None)]
    assert engine_log_probs(outputs, 4) is None
    outputs = [
        SimpleNamespace(token_ids=[5, 6], log_probs=[-0.5, -1.5]),
        SimpleNamespace(token_ids=[7], log_probs=[-2.0]),
    ]
    assert engine_log_probs(outputs, 3).tolist() == [[-0.5, -1.5, 0.0], [-2.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ([f"{KEY}=False", "algorithm.rollout_is=True"], "algorithm.rollout_is=True"),
        ([f"{KEY}=False", "trainer.rollout_overlap=True"], "trainer.rollout_overlap=True"),
    ],
)
def test_tis_without_engine_log_probs_is_refused_naming_the_keys(overrides, names):
    (error,) = rollout_log_prob_errors(compose_config(overrides))
    assert error.startswith(f"{KEY}=False with {names}")
    assert f"set {KEY}=True or algorithm.rollout_is=False" in error


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [f"{KEY}=False"],
        [f"{KEY}=False", "trainer.rollout_overlap=True", "algorithm.rollout_is=False"],
        [f"{KEY}=True", "trainer.rollout_overlap=True"],
        [f"{KEY}=True", "algorithm.rollout_is=True"],
    ],
)
def test_configs_that_do_not_need_the_missing_log_probs_pass(overrides):
    assert rollout_log_prob_errors(compose_config(overrides)) == []


def test_the_memory_agent_turn_batch_has_rollout_log_probs_only_when_the_engine_gave_them():
    from recurrent.generation_manager import LLMGenerationManager

    manager = object.__new__(LLMGenerationManager)
    manager.pad_id = 0
    with_lp = [SimpleNamespace(token_ids=[5, 6], log_probs=[-0.5, -1.5], finish_reason="stop")]
    without = [SimpleNamespace(token_ids=[5, 6], log_probs=None, finish_reason="stop")]
    batch = manager._turn_batch([[1, 2, 3]], with_lp)
    assert batch.batch["rollout_log_probs"][0, :2].tolist() == [-0.5, -1.5]
    assert "rollout_log_probs" not in manager._turn_batch([[1, 2, 3]], without).batch.keys()


def test_engine_vs_actor_metric_skips_tokens_without_an_engine_log_prob():
    """Row 0: engine log-probs on both tokens; row 1: a re-tokenised turn (0 = none) and one real token; padding
    (mask 0) never counts. Only |diff| of tokens with an engine log-prob: 0.1, 0.3, 0.2."""
    conv = DataProto.from_dict(
        tensors={
            "rollout_log_probs": torch.tensor([[-1.0, -2.0, -9.0], [0.0, -0.5, 0.0]]),
            "old_log_probs": torch.tensor([[-1.1, -1.7, -1.0], [-4.0, -0.7, -3.0]]),
            "response_mask": torch.tensor([[1, 1, 0], [1, 1, 0]]),
        }
    )
    metrics = rollout_actor_mismatch(conv)
    assert metrics["rollout/logprob_abs_diff_mean"] == pytest.approx(0.2, abs=1e-6)
    assert metrics["rollout/logprob_abs_diff_max"] == pytest.approx(0.3, abs=1e-6)
    none = DataProto.from_dict(tensors={k: v for k, v in conv.batch.items() if k != "rollout_log_probs"})
    assert rollout_actor_mismatch(none) == {}


def test_tis_on_a_batch_without_engine_log_probs_stops_instead_of_weighing_nothing():
    """A trainer built without the launch check (e.g. from Python) with TIS on: the step raises, naming the keys;
    with TIS off the same batch passes (only the engine-vs-actor metrics are missing)."""
    from verl.trainer.ppo.trainer_core import TrainerCore

    batch = DataProto.from_dict(
        tensors={"old_log_probs": torch.zeros(1, 2), "response_mask": torch.ones(1, 2, dtype=torch.long)}
    )
    on = TrainerCore(compose_config(["algorithm.rollout_is=True"]), None, None, None, None)
    with pytest.raises(RuntimeError, match=r"set actor_rollout_ref.rollout.calculate_log_probs=True or algorithm"):
        on.off_policy_correction(batch)
    off = TrainerCore(compose_config([]), None, None, None, None)
    assert off.off_policy_correction(batch) == {}


def test_in_async_mode_tis_without_engine_log_probs_is_refused_too():
    """Async mode follows the key (its chat proxy asks the engine for log-probs only with it): TIS is refused
    without them, as in sync mode (the proxy side: ``tests/test_async_mode.py``)."""
    cfg = compose_config([f"{KEY}=False", "algorithm.rollout_is=True", "actor_rollout_ref.rollout.mode=async"])
    (error,) = rollout_log_prob_errors(cfg)
    assert error.startswith(f"{KEY}=False with algorithm.rollout_is=True")

"""The multi-turn trainer drives any workflow through ``verl/trainer/ppo/workflow.py``.

* ``recurrent.provider`` names the provider (``module:function``); bad values fail with the key in the message;
* a provider from outside ``recurrent/`` (a test fixture wrapping it) is what the trainer calls, every step;
* the multi-turn estimator comes from the core_algos registry (``grpo`` -> ``grpo_multiconv``); others are refused.
"""

from __future__ import annotations

import pytest

from tests.fixtures import recording_provider
from tests.test_trainer_e2e import _cfg
from verl.trainer import main_ppo
from verl.trainer.ppo.workflow import load_workflow_provider


def test_load_workflow_provider_errors_name_the_key():
    assert callable(load_workflow_provider("recurrent.workflow_provider:build_workflow"))
    with pytest.raises(ValueError, match=r"recurrent.provider must be 'module:function', got 'nocolon'"):
        load_workflow_provider("nocolon")
    with pytest.raises(ValueError, match=r"recurrent.provider='no_such_mod:f': cannot import module 'no_such_mod'"):
        load_workflow_provider("no_such_mod:f")
    with pytest.raises(ValueError, match=r"recurrent.workflow_provider has no callable 'nope'"):
        load_workflow_provider("recurrent.workflow_provider:nope")


def test_trainer_runs_a_provider_named_in_the_config(tiny_model_path, tmp_path):
    recording_provider.CALLS.clear()
    cfg = _cfg(
        tmp_path,
        tiny_model_path,
        str(tmp_path / "out"),
        1,
        extra=["recurrent.provider=tests.fixtures.recording_provider:build", "trainer.val_before_train=False"],
    )
    history = main_ppo.run(cfg)
    # one training step of 2 questions x n=4 trajectories, then the final validation (2 questions x 1)
    assert recording_provider.CALLS == [8, 2]
    step = history[-1]
    assert step["trajectory/count"] == 8
    assert step["trajectory/num_conv/mean"] > 1  # memory turns + the final answer


def test_multi_turn_trainer_refuses_a_single_turn_estimator():
    from omegaconf import OmegaConf

    from verl.trainer.ppo.ray_trainer import MultiConvTrainer
    from verl.trainer.ppo.workflow import MultiTurnWorkflow

    cfg = OmegaConf.create({"algorithm": {"adv_estimator": "rloo", "norm_adv_by_std_in_grpo": True}})
    workflow = MultiTurnWorkflow("toy", train_dataset=None, val_dataset=None, build_rollout=lambda client: None)
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator='rloo' is not a multi-turn estimator"):
        MultiConvTrainer(cfg, None, worker_group=None, workflow=workflow, reward_fn=None, val_reward_fn=None)

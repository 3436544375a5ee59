"""The single-turn PPO/GRPO trainer (``recurrent.enable`` off): one prompt -> one response per rollout row.

One training step reads top to bottom in :meth:`SingleTurnPPOTrainer.train_step`. Sampling, seeds, mini-batch
ids, validation metrics and checkpoint groups come from :class:`verl.trainer.ppo.trainer_core.TrainerCore`, shared
with the multi-turn trainer; ``fit`` drives both through the ``verl.trainer.ppo.fit.Trainer`` protocol.

Advantage estimators (``algorithm.adv_estimator``): any name in the ``core_algos`` registry, called through
:func:`verl.trainer.ppo.advantage.compute_advantage` with upstream's keyword inputs, including estimators a recipe
registers with ``@register_adv_est`` in the module ``algorithm.adv_estimator_module`` names. ``gae`` also needs the
critic group (values from the critic, critic update every step). Refused (``config_preflight.estimator_error``):
``remax`` (needs a greedy baseline rollout per prompt, not run here) and ``grpo_multiconv`` (recurrent mode).

Critic warm-up: the first ``trainer.critic_warmup`` steps (``global_step`` is 1-based inside ``train_step``)
update only the critic; the actor (and hence the rollout weights) stays as it is.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from verl.protocol import DataProto
from verl.trainer.config import PPOConfig
from verl.trainer.config_preflight import (
    NOT_IMPLEMENTED_ESTIMATORS,
    estimator_error,
    filter_groups_error,
    kl_in_reward_error,
)
from verl.trainer.ppo.advantage import apply_kl_penalty, compute_advantage
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_kl_controller
from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_throughout_metrics, compute_timing_metrics
from verl.trainer.ppo.trainer_core import (
    TrainerCore,
    mini_batch_ids,
    rollout_sampling,
    scores_at_last_token,
    timer,
    typed_config,
)
from verl.utils.conversation_batch import build_conversation_batch, engine_log_probs
from verl.utils.import_utils import import_external_libs
from verl.workers.rollout.base import SamplingParams

__all__ = [
    "SingleTurnPPOTrainer",
    "scores_at_last_token",
    "single_turn_sampling",
    "mini_batch_ids",
]

logger = logging.getLogger(__name__)

# Tensors the critic update needs (sent without the non-tensor columns).
_CRITIC_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "values", "returns")


def single_turn_sampling(config: DictConfig | PPOConfig, global_step: int, validate: bool) -> dict[str, Any]:
    """The trainers' sampling parameters (:func:`rollout_sampling`) with ``max_tokens=rollout.response_length``."""
    config = typed_config(config)
    params = rollout_sampling(config, global_step, validate)
    params["max_tokens"] = int(config.actor_rollout_ref.rollout.response_length)
    return params


class SingleTurnPPOTrainer(TrainerCore):
    """Sync single-turn PPO (GAE with a critic) / GRPO / RLOO / REINFORCE++ / registered-estimator trainer.

    Args:
        config: the full trainer config.
        tokenizer: the policy's tokenizer (pad id; decoding for the reward manager).
        worker_group: the actor/rollout/ref group (local or Ray).
        train_dataset, val_dataset: ``RLHFDataset`` (rows carry ``raw_prompt_ids``).
        reward_fn, val_reward_fn: reward managers: ``fn(batch) -> (scores [B], extra)``.
        tracker: logger (``Tracking``) or None.
        critic_group: the critic group (local or Ray); required for ``gae``.
    """

    def __init__(
        self,
        config: DictConfig,
        tokenizer,
        worker_group,
        train_dataset,
        val_dataset,
        reward_fn,
        val_reward_fn,
        tracker=None,
        critic_group=None,
    ):
        super().__init__(config, tokenizer, worker_group, reward_fn, val_reward_fn, tracker)
        self.critic_wg = critic_group
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

        algo = self.conf.algorithm
        self.adv_estimator = algo.adv_estimator
        import_external_libs(algo.adv_estimator_module)  # a recipe's @register_adv_est estimators
        # the same rules check_config applies at launch (verl/trainer/config_preflight.py)
        problem = estimator_error(self.adv_estimator, multi_turn=False)
        if self.adv_estimator in NOT_IMPLEMENTED_ESTIMATORS:
            raise NotImplementedError(problem)
        get_adv_estimator_fn(self.adv_estimator)  # ValueError listing the valid names for an unknown one
        if problem:
            raise ValueError(problem)
        self.use_critic = self.adv_estimator == "gae"
        if self.use_critic and critic_group is None:
            raise ValueError("algorithm.adv_estimator=gae needs a critic worker group (critic_group=None)")
        self.use_kl_loss = self.conf.actor_rollout_ref.actor.use_kl_loss
        self.use_kl_in_reward = algo.use_kl_in_reward
        problem = kl_in_reward_error(self.use_kl_in_reward, self.use_kl_loss) or filter_groups_error(
            algo.filter_groups.enable, multi_turn=False
        )
        if problem:
            raise ValueError(problem)
        self.kl_ctrl = get_kl_controller(algo.kl_ctrl) if self.use_kl_in_reward else None

    def checkpoint_groups(self) -> dict[str, Any]:
        """Worker groups to checkpoint, by sub-folder name (``fit`` saves/loads each)."""
        groups = super().checkpoint_groups()
        if self.use_critic:
            groups["critic"] = self.critic_wg
        return groups

    # ---------------------------------------------------------------- rollout
    def generate(self, batch: DataProto, n: int, validate: bool, step: int | None = None) -> DataProto:
        """uid per prompt, repeat ``n`` (interleaved), one response per row; returns the batch with verl's tensors
        (``prompts, responses, input_ids, attention_mask, position_ids, response_mask``; responses padded to
        ``rollout.response_length``) and ``finish_reason``."""
        if "raw_prompt_ids" not in batch.non_tensor_batch:
            raise KeyError(
                f"single-turn batches need 'raw_prompt_ids' (RLHFDataset); got {sorted(batch.non_tensor_batch)}"
            )
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch = batch.repeat(n, interleave=True)
        try:
            prompts = [[int(t) for t in ids] for ids in batch.non_tensor_batch["raw_prompt_ids"]]
        except (TypeError, ValueError) as err:
            first = batch.non_tensor_batch["raw_prompt_ids"][0]
            raise TypeError(f"raw_prompt_ids must hold lists of token ids; row 0 holds {first!r}") from err
        step = self.global_step if step is None else step
        params = SamplingParams.from_dict(single_turn_sampling(self.conf, step, validate))
        outputs = [result[0] for result in self.rollout.generate_batch(prompts, params)]
        response_width = int(self.conf.actor_rollout_ref.rollout.response_length)
        tensors = build_conversation_batch(
            prompts, [o.token_ids for o in outputs], self.pad_id, response_width=response_width
        )
        log_probs = engine_log_probs(outputs, tensors["responses"].shape[1])
        if log_probs is not None:
            tensors["rollout_log_probs"] = log_probs
        finish = np.array([o.finish_reason for o in outputs], dtype=object)
        batch = batch.union(DataProto.from_dict(tensors=tensors, non_tensors={"finish_reason": finish}))
        batch.meta_info["temperature"] = params.temperature if params.temperature > 0 else 1.0
        return batch

    # ---------------------------------------------------------------- one step
    def train_step(self, batch: DataProto, next_batch=None, upcoming: DataProto | None = None) -> dict[str, float]:
        """One PPO step on ``batch`` (prompts). ``next_batch`` is accepted for ``fit`` and unused; ``upcoming`` (with
        ``trainer.rollout_overlap``) is the next step's batch, whose rollout runs during this step's update."""
        del next_batch
        cfg, timing, metrics = self.conf, {}, {}
        with timer("step", timing):
            # 1. rollout: one response per row (with trainer.rollout_overlap it ran during the previous step), then
            #    the next step's rollout starts on the pre-update weights, or the engine's KV cache is freed
            rollout = self.step_rollout(batch, self.rollouts)
            batch = rollout.result
            metrics.update(self.rollout_metrics(rollout, timing))  # incl. rollout/staleness
            if not self.launch_next_rollout(upcoming, self.rollouts):
                self.wg.sleep_rollout()  # free the rollout's KV cache for training (woken by the weight sync)
            # 2. reward: the sequence score sits on the last response token
            with timer("reward", timing):
                scores, _ = self.reward_fn(batch)
                batch.batch["token_level_scores"] = scores_at_last_token(scores, batch.batch["response_mask"])
            self.dump_generations(False, self._records(False, batch, scores))  # to trainer.rollout_data_dir if set
            # 3. old (and reference) log-probs, off-policy correction (TIS), values
            batch = self.old_log_probs(batch, timing)  # bypass mode: the engine's
            metrics.update(self.off_policy_correction(batch))
            if self.use_kl_loss or self.use_kl_in_reward:
                with timer("ref", timing):
                    batch = batch.union(self.wg.compute_ref_log_prob(batch))
            if self.use_critic:
                with timer("values", timing):
                    batch = batch.union(self.critic_wg.compute_values(batch))
            # 4. rewards (optionally minus a KL penalty) and advantages
            with timer("adv", timing):
                metrics.update(self._apply_rewards(batch))
                self._compute_advantages(batch)
            # 5. critic update, then actor update and weight sync (not during critic warm-up)
            if self.use_critic:
                with timer("update_critic", timing):
                    metrics.update(self.critic_wg.update_critic(self._critic_batch(batch, metrics)))
            if self.global_step > cfg.trainer.critic_warmup:
                batch.batch["mini_batch_id"] = self.actor_mini_batch_ids(len(batch))
                spread = self.spread_over_ranks(batch, metrics)[0]  # every rank a share of every mini-batch
                with timer("update_actor", timing):
                    metrics.update(self.wg.update_actor(spread))  # globally reduced metrics
                self.policy_version = self.global_step
                metrics.update(self.sync_rollout_weights(timing))  # after the rollout running ahead has finished
            else:
                self.ahead.wait()
                self.wg.wake_up_rollout()  # weights unchanged: only re-allocate what sleep_rollout freed
        metrics.update(compute_data_metrics(batch, use_critic=self.use_critic))
        metrics.update(compute_timing_metrics(batch, timing))
        metrics.update(compute_throughout_metrics(batch, timing, n_gpus=max(int(self.wg.world_size), 1)))
        return metrics

    def rollouts(self, batch: DataProto, step: int):
        """Step ``step``'s training rollout of ``batch``: ``(batch with responses, timing, metrics)``; seeds depend on
        (step, request) only."""
        timing: dict[str, float] = {}
        self.rollout.calls = 0
        with timer("gen", timing):
            batch = self.generate(batch, self.conf.actor_rollout_ref.rollout.n, validate=False, step=step)
        return batch, timing, {}

    def _apply_rewards(self, batch: DataProto) -> dict[str, float]:
        """``token_level_rewards`` = scores, or scores - beta * KL(old || ref) per token with ``use_kl_in_reward``."""
        if not self.use_kl_in_reward:
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"].clone()
            return {}
        return apply_kl_penalty(batch, self.kl_ctrl, kl_penalty=self.conf.algorithm.kl_penalty)[1]

    def _compute_advantages(self, batch: DataProto) -> None:
        """``advantages`` and ``returns`` ``[B, R]`` by ``algorithm.adv_estimator`` (any registered estimator,
        called with upstream's inputs: :mod:`verl.trainer.ppo.advantage`)."""
        algo = self.conf.algorithm
        compute_advantage(
            batch,
            self.adv_estimator,
            gamma=algo.gamma,
            lam=algo.lam,
            num_repeat=self.conf.actor_rollout_ref.rollout.n,
            norm_adv_by_std_in_grpo=self.norm_by_std,
            config=self.config.algorithm,  # the section as a mapping: recipes' estimators read it with .get
        )

    def _critic_batch(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        """The tensors of the critic update plus the critic's own global mini-batch ids, in the order that gives each
        critic rank a share of every mini-batch (``perf/critic_update_*`` metrics)."""
        data = batch.select(batch_keys=list(_CRITIC_KEYS), non_tensor_batch_keys=[])
        data.batch["mini_batch_id"] = mini_batch_ids(
            len(data), self.conf.data.train_batch_size, self.conf.critic.ppo_mini_batch_size
        )
        return self.spread_over_ranks(data, metrics, group=self.critic_wg, prefix="perf/critic_update")[0]

    # ---------------------------------------------------------------- validation
    def validate(self, val_loader) -> dict[str, float]:
        """Generate ``val_kwargs.n`` responses per prompt, score them; ``val-core/<source>/reward/mean@n`` etc."""
        n = self.conf.actor_rollout_ref.rollout.val_kwargs.n
        self.rollout.calls = 0
        self.last_val_samples = []
        sources: list[str] = []
        questions: list[str] = []
        rewards: list[float] = []
        records: list[dict] = []  # for trainer.validation_data_dir
        for batch_dict in val_loader:
            batch = self.generate(DataProto.from_single_dict(batch_dict), n, validate=True)
            scores, _ = self.val_reward_fn(batch)
            self.keep_val_samples(batch, batch, scores)
            records += self._records(True, batch, scores, first_trajectory=len(sources))
            nt = batch.non_tensor_batch
            sources += [str(s) for s in nt.get("data_source", np.array(["unknown"] * len(batch), dtype=object))]
            questions += [str(q) for q in nt.get("sample_uuid", nt["uid"])]
            rewards += [float(s) for s in scores.tolist()]
        self.dump_generations(True, records)
        return self.validation_metrics(sources, questions, rewards)

    def _records(self, validate: bool, batch: DataProto, scores, first_trajectory: int = 0) -> list[dict]:
        """Dump records of single-turn rows: each row is a trajectory of one conversation."""
        rows, finals = torch.arange(len(batch)), torch.ones(len(batch), dtype=torch.bool)
        return self.generation_records(validate, batch, rows, finals, batch, scores, first_trajectory)

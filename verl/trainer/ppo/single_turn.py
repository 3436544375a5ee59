"""The single-turn PPO/GRPO trainer (``recurrent.enable`` off): one prompt -> one response per rollout row.

One training step reads top to bottom in :meth:`SingleTurnPPOTrainer.train_step`. The public surface is the
one ``verl.trainer.ppo.fit`` uses for ``MultiConvTrainer`` (``config, tokenizer, wg, rollout, global_step,
tracker, train_step, validate, last_val_samples``) plus :meth:`SingleTurnPPOTrainer.checkpoint_groups`.

Advantage estimators (``algorithm.adv_estimator``, through the ``core_algos`` registry): ``gae`` (needs the
critic group: values from the critic, critic update every step), ``grpo``, ``rloo``, ``reinforce_plus_plus``.
``remax`` needs a greedy baseline rollout per prompt and is not implemented; ``grpo_multiconv`` belongs to
recurrent mode.

Critic warm-up: the first ``trainer.critic_warmup`` steps (``global_step`` is 1-based inside ``train_step``)
update only the critic; the actor (and hence the rollout weights) stays as it is.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import DictConfig

from recurrent.utils import build_conversation_batch
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_kl_controller, kl_penalty
from verl.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    process_validation_metrics,
)
from verl.trainer.ppo.ray_trainer import RolloutClient, timer
from verl.utils.torch_functional import masked_mean
from verl.workers.rollout.base import SamplingParams

__all__ = ["SingleTurnPPOTrainer", "scores_at_last_token", "single_turn_sampling", "mini_batch_ids"]

logger = logging.getLogger(__name__)

_SINGLE_TURN_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus")
# Tensors the critic update needs (sent without the non-tensor columns).
_CRITIC_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "values", "returns")


def single_turn_sampling(config: DictConfig, global_step: int, validate: bool) -> dict[str, Any]:
    """Sampling parameters of a rollout (``actor_rollout_ref.rollout`` or its ``val_kwargs``), with a seed that
    depends on the step and on train/validation when ``rollout.seed`` is set, and ``max_tokens=response_length``."""
    rc = config.actor_rollout_ref.rollout
    if validate:
        vk = rc.val_kwargs
        params = {
            "temperature": float(vk.get("temperature", 0)),
            "top_p": float(vk.get("top_p", 1.0)),
            "top_k": int(vk.get("top_k", -1)),
            "greedy": not bool(vk.get("do_sample", False)),
        }
    else:
        params = {
            "temperature": float(rc.get("temperature", 1.0)),
            "top_p": float(rc.get("top_p", 1.0)),
            "top_k": int(rc.get("top_k", -1)),
        }
    seed = rc.get("seed", None)
    if seed is not None:
        params["seed"] = int(seed) + 7919 * global_step + (1 << 20) * int(validate)
    params["max_tokens"] = int(rc.response_length)
    return params


def scores_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` token-level scores: each row's score at its last response token (rows without one get 0).

    Example: scores ``[1.0]``, mask ``[[1, 1, 0]]`` -> ``[[0, 1.0, 0]]``.
    """
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = scores.to(out)[rows]
    return out


def mini_batch_ids(num_rows: int, train_batch_size: int, ppo_mini_batch_size: int) -> torch.Tensor:
    """Global mini-batch of each row: ``train_batch_size // ppo_mini_batch_size`` contiguous, nearly equal parts
    (rows are grouped by prompt, so each part holds whole groups when the batch is full)."""
    num = max(1, int(train_batch_size) // int(ppo_mini_batch_size))
    ids = torch.zeros(num_rows, dtype=torch.long)
    for m, part in enumerate(np.array_split(np.arange(num_rows), min(num, max(num_rows, 1)))):
        ids[part] = m
    return ids


def _first(metrics: Any) -> dict[str, float]:
    """A Ray group returns one (identical, globally reduced) dict per rank; the local group one dict."""
    return metrics[0] if isinstance(metrics, list) else metrics


class SingleTurnPPOTrainer:
    """Sync single-turn PPO (GAE with a critic) / GRPO / RLOO / REINFORCE++ trainer.

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
        self.config = config
        self.tokenizer = tokenizer
        self.wg = worker_group
        self.critic_wg = critic_group
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.reward_fn, self.val_reward_fn = reward_fn, val_reward_fn
        self.tracker = tracker
        self.rollout = RolloutClient(worker_group)
        self.global_step = 0
        self.last_val_samples: list[dict] = []
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

        algo = config.algorithm
        self.adv_estimator = str(algo.adv_estimator)
        if self.adv_estimator == "remax":
            raise NotImplementedError(
                "algorithm.adv_estimator=remax needs a greedy baseline rollout per prompt, "
                "which the single-turn trainer does not run; use gae, grpo, rloo or "
                "reinforce_plus_plus"
            )
        get_adv_estimator_fn(self.adv_estimator)  # ValueError listing the valid names for an unknown one
        if self.adv_estimator not in _SINGLE_TURN_ESTIMATORS:
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator!r} is not a single-turn estimator "
                f"(valid: {', '.join(_SINGLE_TURN_ESTIMATORS)}; grpo_multiconv needs recurrent.enable)"
            )
        self.use_critic = self.adv_estimator == "gae"
        if self.use_critic and critic_group is None:
            raise ValueError("algorithm.adv_estimator=gae needs a critic worker group (critic_group=None)")
        actor = config.actor_rollout_ref.actor
        self.use_kl_loss = bool(actor.get("use_kl_loss", False))
        self.use_kl_in_reward = bool(algo.get("use_kl_in_reward", False))
        if self.use_kl_in_reward and not self.use_kl_loss:
            raise ValueError(
                "algorithm.use_kl_in_reward=True needs the reference model, which the actor worker builds "
                "only with actor_rollout_ref.actor.use_kl_loss=True (set actor.kl_loss_coef=0 to use it "
                "for the in-reward penalty only)"
            )
        self.kl_ctrl = get_kl_controller(algo.kl_ctrl) if self.use_kl_in_reward else None
        use_adv = algo.get("grpo_use_adv", None)
        self.norm_by_std = bool(use_adv) if use_adv is not None else bool(algo.get("norm_adv_by_std_in_grpo", True))

    def checkpoint_groups(self) -> dict[str, Any]:
        """Worker groups to checkpoint, by sub-folder name (``fit`` saves/loads each)."""
        groups = {"actor": self.wg}
        if self.use_critic:
            groups["critic"] = self.critic_wg
        return groups

    # ---------------------------------------------------------------- rollout
    def generate(self, batch: DataProto, n: int, validate: bool) -> DataProto:
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
        params = SamplingParams.from_dict(single_turn_sampling(self.config, self.global_step, validate))
        outputs = [result[0] for result in self.rollout.generate_batch(prompts, params)]
        response_width = int(self.config.actor_rollout_ref.rollout.response_length)
        tensors = build_conversation_batch(
            prompts, [o.token_ids for o in outputs], self.pad_id, response_width=response_width
        )
        finish = np.array([o.finish_reason for o in outputs], dtype=object)
        batch = batch.union(DataProto.from_dict(tensors=tensors, non_tensors={"finish_reason": finish}))
        batch.meta_info["temperature"] = params.temperature if params.temperature > 0 else 1.0
        return batch

    # ---------------------------------------------------------------- one step
    def train_step(self, batch: DataProto, next_batch=None) -> dict[str, float]:
        """One PPO step on ``batch`` (prompts). ``next_batch`` is accepted for ``fit`` and unused."""
        del next_batch
        cfg, timing, metrics = self.config, {}, {}
        n = int(cfg.actor_rollout_ref.rollout.n)
        self.rollout.calls = 0  # seeds depend on (step, request) only
        with timer("step", timing):
            # 1. rollout: one response per row, then free the engine's KV cache for training
            with timer("gen", timing):
                batch = self.generate(batch, n, validate=False)
            self.wg.sleep_rollout()
            # 2. reward: the sequence score sits on the last response token
            with timer("reward", timing):
                scores, _ = self.reward_fn(batch)
                batch.batch["token_level_scores"] = scores_at_last_token(scores, batch.batch["response_mask"])
            # 3. old (and reference) log-probs, values
            with timer("old_log_prob", timing):
                batch = batch.union(self.wg.compute_log_prob(batch))
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
                    metrics.update(_first(self.critic_wg.update_critic(self._critic_batch(batch))))
            if self.global_step > int(cfg.trainer.get("critic_warmup", 0) or 0):
                actor_cfg = cfg.actor_rollout_ref.actor
                batch.batch["mini_batch_id"] = mini_batch_ids(
                    len(batch), cfg.data.train_batch_size, actor_cfg.ppo_mini_batch_size
                )
                with timer("update_actor", timing):
                    metrics.update(_first(self.wg.update_actor(batch)))
                with timer("sync_weights", timing):
                    self.wg.sync_rollout_weights()
            else:
                self.wg.wake_up_rollout()  # weights unchanged: only re-allocate what sleep_rollout freed
        metrics.update(compute_data_metrics(batch, use_critic=self.use_critic))
        metrics.update(compute_timing_metrics(batch, timing))
        metrics.update(compute_throughout_metrics(batch, timing, n_gpus=max(int(self.wg.world_size), 1)))
        return metrics

    def _apply_rewards(self, batch: DataProto) -> dict[str, float]:
        """``token_level_rewards`` = scores, or scores - beta * KL(old || ref) per token with ``use_kl_in_reward``."""
        scores = batch.batch["token_level_scores"]
        if not self.use_kl_in_reward:
            batch.batch["token_level_rewards"] = scores.clone()
            return {}
        algo = self.config.algorithm
        mask = batch.batch["response_mask"].float()
        estimator = str(algo.get("kl_penalty", "kl"))
        kld = kl_penalty(batch.batch["old_log_probs"], batch.batch["ref_log_prob"], estimator) * mask
        beta = self.kl_ctrl.value
        batch.batch["token_level_rewards"] = scores - beta * kld
        current_kl = float(masked_mean(kld, mask, axis=-1).mean())
        self.kl_ctrl.update(current_kl=current_kl, n_steps=len(batch))
        return {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(beta)}

    def _compute_advantages(self, batch: DataProto) -> None:
        """``advantages`` and ``returns`` ``[B, R]`` by ``algorithm.adv_estimator`` (core_algos registry)."""
        algo = self.config.algorithm
        fn = get_adv_estimator_fn(self.adv_estimator)
        rewards = batch.batch["token_level_rewards"]
        mask = batch.batch["response_mask"].float()
        uid = batch.non_tensor_batch["uid"]
        if self.adv_estimator == "gae":
            adv, ret = fn(rewards, batch.batch["values"], mask, float(algo.gamma), float(algo.lam))
        elif self.adv_estimator == "grpo":
            adv, ret = fn(rewards, mask, uid, norm_adv_by_std_in_grpo=self.norm_by_std)
        elif self.adv_estimator == "rloo":
            adv, ret = fn(rewards, mask, uid)
        else:  # reinforce_plus_plus
            adv, ret = fn(rewards, mask, float(algo.gamma))
        batch.batch["advantages"], batch.batch["returns"] = adv, ret

    def _critic_batch(self, batch: DataProto) -> DataProto:
        """The tensors of the critic update plus the critic's own global mini-batch ids."""
        data = batch.select(batch_keys=list(_CRITIC_KEYS), non_tensor_batch_keys=[])
        critic_cfg = self.config.critic
        data.batch["mini_batch_id"] = mini_batch_ids(
            len(data), self.config.data.train_batch_size, critic_cfg.ppo_mini_batch_size
        )
        return data

    # ---------------------------------------------------------------- validation
    def validate(self, val_loader) -> dict[str, float]:
        """Generate ``val_kwargs.n`` responses per prompt, score them; ``val-core/<source>/reward/mean@n`` etc."""
        n = int(self.config.actor_rollout_ref.rollout.val_kwargs.get("n", 1))
        self.rollout.calls = 0
        self.last_val_samples = []
        sources: list[str] = []
        questions: list[str] = []
        rewards: list[float] = []
        for batch_dict in val_loader:
            batch = self.generate(DataProto.from_single_dict(batch_dict), n, validate=True)
            scores, _ = self.val_reward_fn(batch)
            self._keep_val_samples(batch, scores)
            nt = batch.non_tensor_batch
            sources += [str(s) for s in nt.get("data_source", np.array(["unknown"] * len(batch), dtype=object))]
            questions += [str(q) for q in nt.get("sample_uuid", nt["uid"])]
            rewards += [float(s) for s in scores.tolist()]
        out = process_validation_metrics(sources, questions, {"reward": rewards})
        out["val/num_questions"] = len(set(questions))
        return out

    def _keep_val_samples(self, batch: DataProto, scores: torch.Tensor, limit: int = 8) -> None:
        """Keep a few decoded responses for logging (``trainer.log_val_generations``)."""
        k = min(limit - len(self.last_val_samples), len(batch))
        if k <= 0:
            return
        resp, mask = batch.batch["responses"][:k], batch.batch["response_mask"][:k].bool()
        texts = self.tokenizer.batch_decode([r[m].tolist() for r, m in zip(resp, mask)], skip_special_tokens=True)
        reward_model = batch.non_tensor_batch.get("reward_model")
        for i, text in enumerate(texts):
            gold: Optional[Any] = (reward_model[i] or {}).get("ground_truth") if reward_model is not None else None
            self.last_val_samples.append({"answer": text, "ground_truth": gold, "score": float(scores[i])})

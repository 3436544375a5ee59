"""The Multi-Conv GRPO/DAPO trainer: one training step reads top to bottom in :meth:`train_step`.

A multi-turn workflow (``verl.trainer.ppo.workflow``) turns each trajectory into several conversations;
the final answer's reward becomes one group-relative advantage per trajectory, broadcast to every turn.
Distributed mechanics live below (worker groups, engines, FSDP); algorithms live beside
(``core_algos``/``dapo``); shared trainer plumbing in ``trainer_core``; this file is the driver program.
"""

from __future__ import annotations

import logging
import uuid

import numpy as np
import torch
from omegaconf import DictConfig

from verl.protocol import DataProto
from verl.trainer.config_preflight import estimator_error
from verl.trainer.ppo.advantage import (  # upstream's import path
    apply_kl_penalty,
    compute_advantage,
    compute_response_mask,
)
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.dapo import (
    filter_zero_variance_groups,
    overlong_reward_penalty,
    trajectory_token_weights,
)
from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_throughout_metrics, compute_timing_metrics
from verl.trainer.ppo.trainer_core import (
    RolloutClient,
    TrainerCore,
    rollout_actor_mismatch,
    scores_at_last_token,
    timer,
)
from verl.trainer.ppo.workflow import MultiTurnWorkflow
from verl.utils.conversation_batch import concat_conversations, final_batch

__all__ = [
    "MultiConvTrainer",
    "RolloutClient",
    "timer",
    "rollout_actor_mismatch",
    "MULTICONV_ESTIMATORS",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_response_mask",
]

logger = logging.getLogger(__name__)

# ``algorithm.adv_estimator`` values of the multi-turn trainer, mapped to the registered estimator
# (core_algos registry): MemAgent's scripts say ``grpo``; in multi-turn mode that is Multi-Conv GRPO.
MULTICONV_ESTIMATORS = {"grpo": "grpo_multiconv", "grpo_multiconv": "grpo_multiconv"}


class MultiConvTrainer(TrainerCore):
    """Sync-mode multi-turn trainer (Multi-Conv GRPO with DAPO options) over a :class:`MultiTurnWorkflow`."""

    def __init__(
        self,
        config: DictConfig,
        tokenizer,
        worker_group,
        workflow: MultiTurnWorkflow,
        reward_fn,
        val_reward_fn,
        tracker=None,
    ):
        super().__init__(config, tokenizer, worker_group, reward_fn, val_reward_fn, tracker)
        self.workflow = workflow
        self.train_dataset, self.val_dataset = workflow.train_dataset, workflow.val_dataset
        self.manager = workflow.build_rollout(self.rollout)
        estimator = self.conf.algorithm.adv_estimator
        problem = estimator_error(estimator, multi_turn=True)  # as check_config at launch (config_preflight.py)
        if problem:
            raise ValueError(problem)
        self.advantage_fn = get_adv_estimator_fn(MULTICONV_ESTIMATORS[estimator])

    # ---------------------------------------------------------------- one step
    def train_step(self, batch: DataProto, next_batch=None, upcoming: DataProto | None = None) -> dict[str, float]:
        """One training step. ``next_batch()`` supplies more questions for DAPO dynamic sampling; ``upcoming`` (with
        ``trainer.rollout_overlap``) is the next step's batch, whose rollout runs during this step's update."""
        cfg, timing, metrics = self.conf, {}, {}
        with timer("step", timing):
            # 1-3. rollout through the workflow, strict verifier on final answers (trajectory level), optional DAPO
            #      shaping and dynamic sampling; with trainer.rollout_overlap it ran during the previous step
            rollout = self.step_rollout(batch, self.rollouts, next_batch=next_batch)
            traj, conv, final_mask, sample_index, scores = rollout.result
            metrics.update(self.rollout_metrics(rollout, timing))  # incl. rollout/staleness
            # one-step-off: the next step's rollout starts now, on the engine's pre-update weights
            if not self.launch_next_rollout(upcoming, self.rollouts, next_batch=next_batch):
                self.wg.sleep_rollout()  # free the rollout's KV cache for training (woken by the weight sync)
            conv.meta_info["temperature"] = self.log_prob_temperature()
            metrics.update(conv.meta_info.get("metrics", {}))  # workflow metrics (async mode)
            # 4. group-relative advantages on trajectory rewards, broadcast to every turn
            adv, returns, _ = self.advantage_fn(
                scores,
                traj.non_tensor_batch["uid"],
                sample_index,
                conv.batch["response_mask"],
                norm_adv_by_std_in_grpo=self.norm_by_std,
            )
            conv.batch["advantages"], conv.batch["returns"] = adv, returns
            # each conversation carries its trajectory's score at its last response token (metrics)
            conv.batch["token_level_scores"] = scores_at_last_token(scores[sample_index], conv.batch["response_mask"])
            conv.batch["token_level_rewards"] = conv.batch["token_level_scores"]
            if cfg.actor_rollout_ref.actor.turn_weighting == "trajectory":
                weights = trajectory_token_weights(sample_index, conv.batch["response_mask"], "trajectory")
                conv.batch["loss_weights"] = weights
            # a mini-batch = every conversation of ppo_mini_batch_size questions' trajectories (all their turns)
            conv.batch["mini_batch_id"] = self.actor_mini_batch_ids(len(traj))[sample_index]
            # the step's conversations as text, to trainer.rollout_data_dir when it is set
            self.dump_generations(False, self.generation_records(False, conv, sample_index, final_mask, traj, scores))
            # rows to ranks: every rank a share of every mini-batch (token-balanced with trainer.balance_batch)
            conv, sample_index, final_mask = self.spread_over_ranks(conv, metrics, sample_index, final_mask)
            # 5. old (or, bypass mode, the engine's) and reference log-probs, off-policy correction (TIS), actor
            #    update, weight sync
            conv = self.old_log_probs(conv, timing)
            metrics.update(self.off_policy_correction(conv))
            if cfg.actor_rollout_ref.actor.use_kl_loss:
                with timer("ref", timing):
                    conv = conv.union(self.wg.compute_ref_log_prob(conv))
            with timer("update_actor", timing):
                metrics.update(self.wg.update_actor(conv))  # globally reduced metrics
            self.policy_version = self.global_step
            metrics.update(self.sync_rollout_weights(timing))  # after the rollout running ahead has finished
        metrics.update(compute_data_metrics(conv, sample_index=sample_index, final_mask=final_mask))
        metrics.update(compute_timing_metrics(conv, timing))
        metrics.update(compute_throughout_metrics(conv, timing, n_gpus=max(int(self.wg.world_size), 1)))
        return metrics

    def rollouts(self, batch: DataProto, step: int, next_batch=None):
        """Step ``step``'s training rollouts of ``batch``: ``((traj, conv, final_mask, sample_index, scores), timing,
        metrics)``. Seeds depend on (step, turn, request) only, not on earlier validation or other steps."""
        timing, metrics = {}, {}
        self.rollout.calls = 0
        n = self.conf.actor_rollout_ref.rollout.n
        result = self.collect_rollouts(batch, n, next_batch, timing, metrics, step)
        return result, timing, metrics

    def rollout_and_score(self, batch: DataProto, n: int, validate: bool, timing: dict, step: int | None = None):
        """uid per question, repeat n, run the workflow, score final answers (trajectory level); sampling seeds of
        ``step`` (default: this step)."""
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch = batch.repeat(n, interleave=True)
        tensor_keys, non_tensor_keys = self.train_dataset.get_batch_keys()
        gen_batch = batch.pop(batch_keys=tensor_keys, non_tensor_batch_keys=non_tensor_keys)
        gen_batch.meta_info["sampling"] = self.sampling(validate, step)
        with timer("gen", timing):
            conv, final_mask, sample_index = self.manager.run_llm_loop(gen_batch, timing)
        kept = conv.meta_info.get("kept_sample_index")  # async mode may drop failed samples (flagged)
        if kept is not None:
            batch = batch[np.asarray(kept)]
        with timer("reward", timing):
            finals = final_batch(conv, final_mask, sample_index)
            finals.non_tensor_batch.update(batch.non_tensor_batch)
            scores, extra = (self.val_reward_fn if validate else self.reward_fn)(finals)
            finals.meta_info["reward_extra_info"] = extra  # the scorer's other dict keys (filter_groups.metric)
        return batch, conv, final_mask, sample_index, scores, finals

    # ---------------------------------------------------------------- rollouts, shaping, DAPO filter
    def collect_rollouts(self, batch, n, next_batch, timing, metrics, step=None):
        dapo = self.conf.algorithm.filter_groups
        dapo_filter = dapo.enable
        want_groups = self.conf.data.train_batch_size  # a generation batch has data.gen_batch_size prompts
        max_gen = dapo.max_num_gen_batches
        parts, num_gen = [], 0
        while True:
            num_gen += 1
            traj, conv, final_mask, sample_index, scores, finals = self.rollout_and_score(batch, n, False, timing, step)
            rewards = self._shape_rewards(scores, finals, metrics)
            part = (traj, conv, final_mask, sample_index, rewards)
            if dapo_filter:
                part, stats = self._filter_groups(*part, by=self._filter_metric(dapo.metric, scores, rewards, finals))
                for k, v in stats.items():
                    metrics[f"train/{k}"] = metrics.get(f"train/{k}", 0) + v
            parts.append(part)
            kept = sum(len(p[0]) for p in parts) // n
            if not dapo_filter or kept >= want_groups or next_batch is None or (max_gen > 0 and num_gen >= max_gen):
                break
            batch = next_batch()
        metrics["train/num_gen_batches"] = num_gen
        traj, conv, final_mask, sample_index, scores = _concat_parts(parts)
        if dapo_filter and len(traj) > want_groups * n:  # trim to exactly the train batch (whole groups)
            keep_traj = torch.arange(len(traj)) < want_groups * n
            traj, conv, final_mask, sample_index, scores = _select_trajectories(
                traj, conv, final_mask, sample_index, scores, keep_traj
            )
        if len(traj) == 0:
            raise RuntimeError(
                "dynamic sampling kept no group with reward variance; raise "
                "algorithm.filter_groups.max_num_gen_batches or disable the filter"
            )
        return traj, conv, final_mask, sample_index, scores

    def _shape_rewards(self, scores, finals, metrics):
        """DAPO overlong shaping on the final answer's length (limit: the workflow's final response length)."""
        ob = self.conf.algorithm.overlong_buffer
        if not ob.enable:
            return scores
        limit = int(self.workflow.final_response_length or self.conf.actor_rollout_ref.rollout.response_length)
        lengths = finals.batch["response_mask"].sum(-1)
        penalty = overlong_reward_penalty(lengths, limit, ob.len, ob.penalty_factor)
        metrics["train/overlong_penalty_mean"] = float(penalty.mean())
        return scores + penalty.to(scores.dtype)

    @staticmethod
    def _filter_metric(name: str, scores, rewards, finals) -> torch.Tensor:
        """``algorithm.filter_groups.metric``: ``score`` (the verifier's), ``reward`` (after the overlong penalty)
        or a key of the scorer's result dict (e.g. ``acc``), one value per trajectory."""
        if name == "score":
            return scores
        if name == "reward":
            return rewards
        extra = finals.meta_info.get("reward_extra_info") or {}
        if name not in extra:
            raise KeyError(
                f"algorithm.filter_groups.metric={name!r}: the scorer's results have no {name!r} key (they have: "
                f"{', '.join(sorted(extra)) or 'only score'}); use score, reward or one of those keys"
            )
        return torch.tensor([float(v) for v in extra[name]], dtype=torch.float64)

    def _filter_groups(self, traj, conv, final_mask, sample_index, scores, by):
        """Keep the groups whose ``by`` values [T] are not all equal; ``scores`` are what the step trains on."""
        keep, stats = filter_zero_variance_groups(by, traj.non_tensor_batch["uid"])
        return _select_trajectories(traj, conv, final_mask, sample_index, scores, keep), stats

    # ---------------------------------------------------------------- validation
    def validate(self, val_loader) -> dict[str, float]:
        """``val_kwargs.n`` trajectories per question, scored; metrics per data source (``val-core/...``)."""
        n = self.conf.actor_rollout_ref.rollout.val_kwargs.n
        sources: list[str] = []
        questions: list[str] = []
        rewards: list[float] = []
        timing: dict[str, float] = {}
        self.rollout.calls = 0
        self.last_val_samples = []
        records: list[dict] = []  # for trainer.validation_data_dir
        for batch_dict in val_loader:
            batch = DataProto.from_single_dict(batch_dict)
            traj, conv, final_mask, sample_index, scores, finals = self.rollout_and_score(batch, n, True, timing)
            self.keep_val_samples(finals, traj, scores)
            records += self.generation_records(True, conv, sample_index, final_mask, traj, scores, len(sources))
            nt = traj.non_tensor_batch
            sources += [str(s) for s in nt["data_source"]]
            questions += [str(q) for q in nt["sample_uuid"]]
            rewards += [float(s) for s in scores.tolist()]
        self.dump_generations(True, records)
        return self.validation_metrics(sources, questions, rewards)


def _select_trajectories(traj, conv, final_mask, sample_index, scores, keep):
    """Keep the trajectories in ``keep`` [T] and their conversations; renumber ``sample_index``."""
    keep = torch.as_tensor(keep, dtype=torch.bool)
    new_index = torch.cumsum(keep.long(), 0) - 1
    conv_keep = keep[sample_index]
    rows = conv_keep.numpy()
    return (traj[keep.numpy()], conv[rows], final_mask[conv_keep], new_index[sample_index[conv_keep]], scores[keep])


def _concat_parts(parts):
    """Concatenate rollout parts (each with its own trajectory numbering) into one."""
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [len(p[0]) for p in parts[:-1]])
    traj = DataProto.concat([p[0] for p in parts])
    pad_id = int(parts[0][1].meta_info.get("pad_token_id", 0))
    conv = concat_conversations([p[1] for p in parts], pad_id)
    final_mask = torch.cat([p[2] for p in parts])
    sample_index = torch.cat([p[3] + int(o) for p, o in zip(parts, offsets)])
    scores = torch.cat([p[4] for p in parts])
    return traj, conv, final_mask, sample_index, scores

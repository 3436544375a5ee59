"""The Multi-Conv GRPO/DAPO trainer: one training step reads top to bottom in :meth:`train_step`.

Distributed mechanics live below (worker groups, engines, FSDP); algorithms live beside
(``core_algos``/``dapo``); this file is the driver program.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from recurrent.generation_manager import LLMGenerationManager
from recurrent.utils import final_batch
from verl.protocol import DataProto
from verl.trainer.ppo.dapo import (
    compute_multiconv_advantage,
    filter_zero_variance_groups,
    overlong_reward_penalty,
    trajectory_token_weights,
)

logger = logging.getLogger(__name__)


@contextmanager
def timer(name: str, timing: dict[str, float]):
    t0 = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0


class RolloutClient:
    """Driver-side rollout: splits a turn's prompts across the worker group's engines (uneven OK).

    With a ``seed`` in the sampling parameters every request gets its own seed
    (``seed + request index``), so the n trajectories of a question differ and a rerun
    reproduces them.
    """

    def __init__(self, worker_group):
        self.wg = worker_group
        self.calls = 0

    def generate_batch(self, prompts: list[list[int]], params) -> list:
        from dataclasses import asdict

        n = self.wg.world_size
        parts = np.array_split(np.arange(len(prompts)), n)
        p = asdict(params)
        seeds = None
        if params.seed is not None:
            base = params.seed + self.calls * 1_000_003
            seeds = [[base + int(i) for i in part] for part in parts]
        self.calls += 1
        results = self.wg.generate(
            [[prompts[i] for i in part] for part in parts], [p] * n, seeds if seeds else [None] * n
        )
        return [r for part in results for r in part]


class MultiConvTrainer:
    """Sync-mode recurrent trainer (Multi-Conv GRPO with DAPO options)."""

    def __init__(
        self,
        config: DictConfig,
        tokenizer,
        worker_group,
        register,
        recurrent_config,
        train_dataset,
        val_dataset,
        reward_fn,
        val_reward_fn,
        tracker=None,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.wg = worker_group
        self.register = register
        self.recurrent_config = recurrent_config
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.reward_fn, self.val_reward_fn = reward_fn, val_reward_fn
        self.tracker = tracker
        self.rollout = RolloutClient(worker_group)
        if config.actor_rollout_ref.rollout.get("mode", "sync") == "async":
            from recurrent.async_generation_manager import build_async_manager

            self.manager = build_async_manager(config, tokenizer, self.rollout, register, recurrent_config)
        else:
            self.manager = LLMGenerationManager(
                tokenizer, self.rollout, register.agent_cls(tokenizer, recurrent_config)
            )
        self.global_step = 0
        algo = config.algorithm
        use_adv = algo.get("grpo_use_adv", None)
        self.norm_by_std = bool(use_adv) if use_adv is not None else bool(algo.get("norm_adv_by_std_in_grpo", True))

    # ---------------------------------------------------------------- sampling parameters
    def _sampling(self, validate: bool) -> dict[str, Any]:
        rc = self.config.actor_rollout_ref.rollout
        seed = rc.get("seed", None)
        if validate:
            vk = rc.val_kwargs
            s = {
                "temperature": float(vk.get("temperature", 0)),
                "top_p": float(vk.get("top_p", 1.0)),
                "top_k": int(vk.get("top_k", -1)),
                "greedy": not bool(vk.get("do_sample", False)),
            }
        else:
            # the engine's own log-probs of its samples: compared with the actor's to check weight sync
            s = {
                "temperature": float(rc.get("temperature", 1.0)),
                "top_p": float(rc.get("top_p", 1.0)),
                "top_k": int(rc.get("top_k", -1)),
                "logprobs": True,
            }
        if seed is not None:
            s["seed"] = int(seed) + 7919 * self.global_step + (1 << 20) * int(validate)
        return s

    # ---------------------------------------------------------------- one step
    def rollout_and_score(self, batch: DataProto, n: int, validate: bool, timing: dict):
        """uid per question, repeat n, run the workflow, score final answers (trajectory level)."""
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch = batch.repeat(n, interleave=True)
        tensor_keys, non_tensor_keys = self.train_dataset.get_batch_keys()
        gen_batch = batch.pop(batch_keys=tensor_keys, non_tensor_batch_keys=non_tensor_keys)
        gen_batch.meta_info["sampling"] = self._sampling(validate)
        with timer("gen", timing):
            conv, final_mask, sample_index = self.manager.run_llm_loop(gen_batch, timing)
        kept = conv.meta_info.get("kept_sample_index")  # async mode may drop failed samples (flagged)
        if kept is not None:
            batch = batch[np.asarray(kept)]
        with timer("reward", timing):
            finals = final_batch(conv, final_mask, sample_index)
            finals.non_tensor_batch.update(batch.non_tensor_batch)
            scores, _ = (self.val_reward_fn if validate else self.reward_fn)(finals)
        return batch, conv, final_mask, sample_index, scores, finals

    def train_step(self, batch: DataProto, next_batch=None) -> dict[str, float]:
        """One training step. ``next_batch()`` supplies more questions for DAPO dynamic sampling."""
        cfg, timing, metrics = self.config, {}, {}
        n = int(cfg.actor_rollout_ref.rollout.n)
        self.rollout.calls = 0  # seeds depend on (step, turn, request) only, not on earlier validation
        with timer("step", timing):
            # 1-3. rollout through the workflow, strict verifier on final answers (trajectory level),
            #      optional DAPO overlong shaping and dynamic sampling (refill until the batch is full)
            traj, conv, final_mask, sample_index, scores = self.collect_rollouts(batch, n, next_batch, timing, metrics)
            # log-probs of the distribution that was sampled from (logits / rollout temperature)
            conv.meta_info["temperature"] = float(self._sampling(validate=False)["temperature"]) or 1.0
            self.wg.sleep_rollout()  # free the rollout's KV cache for training (woken by the weight sync)
            metrics.update(conv.meta_info.get("metrics", {}))  # workflow metrics (async mode)
            # 4. group-relative advantages on trajectory rewards, broadcast to every turn
            adv, returns, traj_adv = compute_multiconv_advantage(
                scores,
                traj.non_tensor_batch["uid"],
                sample_index,
                conv.batch["response_mask"],
                norm_adv_by_std_in_grpo=self.norm_by_std,
            )
            conv.batch["advantages"], conv.batch["returns"] = adv, returns
            conv.batch["token_level_scores"] = scores[sample_index][:, None] * conv.batch["response_mask"]
            if cfg.actor_rollout_ref.actor.get("turn_weighting", "token") == "trajectory":
                conv.batch["loss_weights"] = trajectory_token_weights(
                    sample_index, conv.batch["response_mask"], "trajectory"
                )
            conv.batch["mini_batch_id"] = self._mini_batch_ids(len(conv))
            # 5. old and reference log-probs, actor update, weight sync
            with timer("old_log_prob", timing):
                conv = conv.union(self.wg.compute_log_prob(conv))
            metrics.update(rollout_actor_mismatch(conv))
            if cfg.actor_rollout_ref.actor.get("use_kl_loss", False):
                with timer("ref", timing):
                    conv = conv.union(self.wg.compute_ref_log_prob(conv))
            with timer("update_actor", timing):
                update_metrics = self.wg.update_actor(conv)
                # a Ray group returns one dict per rank; the values are already global (all-reduced)
                metrics.update(update_metrics[0] if isinstance(update_metrics, list) else update_metrics)
            with timer("sync_weights", timing):
                self.wg.sync_rollout_weights()
        metrics.update(self._step_metrics(conv, final_mask, sample_index, scores, traj_adv, timing))
        return metrics

    def _mini_batch_ids(self, num_rows: int) -> torch.Tensor:
        """Global mini-batch of each conversation: ``train_batch_size // ppo_mini_batch_size`` contiguous,
        nearly equal parts (16 optimizer steps per step in MemAgent), whatever the number of ranks."""
        actor = self.config.actor_rollout_ref.actor
        num = max(1, int(self.config.data.train_batch_size) // int(actor.ppo_mini_batch_size))
        ids = torch.zeros(num_rows, dtype=torch.long)
        for m, part in enumerate(np.array_split(np.arange(num_rows), min(num, max(num_rows, 1)))):
            ids[part] = m
        return ids

    # ---------------------------------------------------------------- rollouts, shaping, DAPO filter
    def collect_rollouts(self, batch, n, next_batch, timing, metrics):
        algo = self.config.algorithm
        dapo_filter = bool(algo.get("filter_groups", {}).get("enable", False))
        want_groups = len(batch)
        max_gen = int(algo.get("filter_groups", {}).get("max_num_gen_batches", 0) or 0)
        parts, num_gen = [], 0
        while True:
            num_gen += 1
            traj, conv, final_mask, sample_index, scores, finals = self.rollout_and_score(batch, n, False, timing)
            scores = self._shape_rewards(scores, finals, metrics)
            part = (traj, conv, final_mask, sample_index, scores)
            if dapo_filter:
                part, stats = self._filter_groups(*part)
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
        """DAPO overlong shaping on the final answer's length (limit: max_final_response_length)."""
        ob = self.config.algorithm.get("overlong_buffer", {})
        if not ob.get("enable", False):
            return scores
        limit = int(
            getattr(self.recurrent_config, "max_final_response_length", 0)
            or self.config.actor_rollout_ref.rollout.response_length
        )
        lengths = finals.batch["response_mask"].sum(-1)
        penalty = overlong_reward_penalty(lengths, limit, int(ob.get("len", 1)), float(ob.get("penalty_factor", 1.0)))
        metrics["train/overlong_penalty_mean"] = float(penalty.mean())
        return scores + penalty.to(scores.dtype)

    def _filter_groups(self, traj, conv, final_mask, sample_index, scores):
        keep, stats = filter_zero_variance_groups(scores, traj.non_tensor_batch["uid"])
        return _select_trajectories(traj, conv, final_mask, sample_index, scores, keep), stats

    # ---------------------------------------------------------------- metrics
    def _step_metrics(self, conv, final_mask, sample_index, scores, traj_adv, timing) -> dict[str, float]:
        resp_len = conv.batch["response_mask"].sum(-1).float()
        n_conv = torch.bincount(sample_index, minlength=len(scores)).float()
        tokens = int(conv.batch["attention_mask"].sum())
        m = {
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "critic/pass@n": float((scores[sample_index] == 1.0).float().mean()),
            "critic/advantages/mean": float(traj_adv.mean()),
            "critic/advantages/max": float(traj_adv.max()),
            "critic/advantages/min": float(traj_adv.min()),
            "trajectory/num_conv/mean": float(n_conv.mean()),
            "trajectory/num_conv/max": float(n_conv.max()),
            "trajectory/num_conv/min": float(n_conv.min()),
            "response_length/memory_turn/mean": float(resp_len[~final_mask].mean()) if (~final_mask).any() else 0.0,
            "response_length/final_turn/mean": float(resp_len[final_mask].mean()),
            "response_length/mean": float(resp_len.mean()),
            "perf/total_num_tokens": tokens,
            "perf/throughput": tokens / max(timing.get("step", 1e-9), 1e-9) / max(self.wg.world_size, 1),
        }
        m.update({f"timing_s/{k}": v for k, v in timing.items()})
        return m

    # ---------------------------------------------------------------- validation
    def _keep_val_samples(self, traj, finals, scores, limit: int = 8) -> None:
        """Keep a few decoded final answers for logging (``trainer.log_val_generations``)."""
        k = min(limit - len(self.last_val_samples), len(traj))
        if k <= 0:
            return
        resp, mask = finals.batch["responses"][:k], finals.batch["response_mask"][:k].bool()
        texts = self.tokenizer.batch_decode([r[m].tolist() for r, m in zip(resp, mask)], skip_special_tokens=True)
        nt = traj.non_tensor_batch
        for i, text in enumerate(texts):
            gold = (nt["reward_model"][i] or {}).get("ground_truth") if "reward_model" in nt else None
            self.last_val_samples.append({"answer": text, "ground_truth": gold, "score": float(scores[i])})

    def validate(self, val_loader) -> dict[str, float]:
        n = int(self.config.actor_rollout_ref.rollout.val_kwargs.get("n", 1))
        per_source: dict[str, list[float]] = {}
        per_question: dict[str, list[float]] = {}
        timing: dict[str, float] = {}
        self.rollout.calls = 0
        self.last_val_samples = []
        for batch_dict in val_loader:
            batch = DataProto.from_single_dict(batch_dict)
            traj, _, _, _, scores, finals = self.rollout_and_score(batch, n, True, timing)
            self._keep_val_samples(traj, finals, scores)
            for src, q, s in zip(
                traj.non_tensor_batch["data_source"], traj.non_tensor_batch["sample_uuid"], scores.tolist()
            ):
                per_source.setdefault(str(src), []).append(s)
                per_question.setdefault(str(q), []).append(s)
        out = {f"val-core/{src}/reward/mean@{n}": float(np.mean(v)) for src, v in per_source.items()}
        if per_question:
            out[f"val-aux/best@{n}/mean"] = float(np.mean([max(v) for v in per_question.values()]))
            out["val/num_questions"] = len(per_question)
        return out


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
    from recurrent.utils import concat_conversations

    offsets = np.cumsum([0] + [len(p[0]) for p in parts[:-1]])
    traj = DataProto.concat([p[0] for p in parts])
    pad_id = int(parts[0][1].meta_info.get("pad_token_id", 0))
    conv = concat_conversations([p[1] for p in parts], pad_id)
    final_mask = torch.cat([p[2] for p in parts])
    sample_index = torch.cat([p[3] + int(o) for p, o in zip(parts, offsets)])
    scores = torch.cat([p[4] for p in parts])
    return traj, conv, final_mask, sample_index, scores


def rollout_actor_mismatch(conv: DataProto) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the actor's recomputed ones (response tokens).

    Near 0 when the rollout engine holds the actor's current weights; a stale engine (broken
    weight sync) shows up here at once. Differences also come from bf16 vs fp32 and kernels.
    """
    if "rollout_log_probs" not in conv.batch.keys():
        return {}
    mask = conv.batch["response_mask"].bool()
    diff = (conv.batch["rollout_log_probs"] - conv.batch["old_log_probs"]).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {"rollout/logprob_abs_diff_mean": float(diff.mean()), "rollout/logprob_abs_diff_max": float(diff.max())}

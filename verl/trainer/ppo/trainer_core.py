"""What every PPO-family trainer shares: sampling parameters and seeds, rollout dispatch, mini-batch ids,
validation metrics and samples, checkpoint groups.

The two trainers build on :class:`TrainerCore`:

* :class:`verl.trainer.ppo.ray_trainer.MultiConvTrainer`: a multi-turn workflow (e.g. the memory agent)
  turns each trajectory into several conversations; trajectory-level advantages are broadcast to them;
* :class:`verl.trainer.ppo.single_turn.SingleTurnPPOTrainer`: one prompt -> one response per row.

:func:`verl.trainer.ppo.fit.fit` drives either through the :class:`verl.trainer.ppo.fit.Trainer` protocol.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from verl.protocol import DataProto
from verl.trainer.config import PPOConfig, from_config
from verl.trainer.config.algorithm import rollout_is_on
from verl.trainer.ppo.generation_dump import generation_records, ground_truth, write_generations
from verl.trainer.ppo.metric_utils import process_validation_metrics
from verl.trainer.ppo.rank_spread import spread_metrics, spread_order
from verl.trainer.ppo.rollout_correction import compute_rollout_is_weights, engine_token_mask, rollout_is_metrics
from verl.trainer.ppo.rollout_overlap import Rollout, RolloutAhead, make_rollout, staleness_metrics
from verl.utils.conversation_batch import decode_rows
from verl.workers.training_sms import balance_shift

__all__ = [
    "TrainerCore",
    "RolloutClient",
    "timer",
    "rollout_sampling",
    "mini_batch_ids",
    "scores_at_last_token",
    "rollout_actor_mismatch",
    "MAX_VAL_SAMPLES",
]

# Decoded validation answers kept per validation for ``trainer.log_val_generations``.
MAX_VAL_SAMPLES = 8


@contextmanager
def timer(name: str, timing: dict[str, float]):
    """Add the wall time of the block to ``timing[name]`` (seconds)."""
    t0 = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0


class RolloutClient:
    """Driver-side rollout: splits a batch of prompts across the worker group's engines (uneven OK).

    With a ``seed`` in the sampling parameters every request gets its own seed
    (``seed + request index``), so the n samples of a prompt differ and a rerun reproduces them.

    Engines shared by a tensor-parallel group of ranks (``rollout.tensor_model_parallel_size > 1``, see
    ``verl/workers/rollout/tp_layout.py``): the batch is split over the groups, every rank of a group gets its
    group's prompts and seeds (without ``seed``, random ones drawn here, the same for the whole group), and each
    group's outputs come from its TP rank 0 after the other ranks' digests are checked against them.
    """

    def __init__(self, worker_group):
        self.wg = worker_group
        self.calls = 0
        self._info: list[tuple[int, bool]] | None = None
        self._rng = np.random.default_rng()

    def rollout_info(self) -> list[tuple[int, bool]]:
        """Per-rank ``(dp_rank, is_collect)`` the workers declared for the ``rollout`` mesh (one rank per engine
        for workers that declare none, or a group without mesh dispatch)."""
        from verl.workers.rollout.tp_layout import ROLLOUT_MESH

        if self._info is None:
            info = None
            if callable(getattr(self.wg, "dispatch_info", None)):
                try:
                    info = self.wg.dispatch_info(ROLLOUT_MESH)
                except KeyError:  # the workers declare no rollout mesh: one engine per rank
                    info = None
            self._info = list(info) if info else [(rank, True) for rank in range(self.wg.world_size)]
        return self._info

    def generate_batch(self, prompts: list[list[int]], params) -> list:
        from verl.workers.rollout.tp_layout import collect_by_dp, split_by_dp

        info = self.rollout_info()
        n = self.wg.world_size
        groups, per_rank = split_by_dp(len(prompts), info)
        p = asdict(params)
        seeds = None
        if params.seed is not None:
            base = params.seed + self.calls * 1_000_003
            seeds = [[base + int(i) for i in part] for part in groups]
        elif len(groups) < n:  # a tensor-parallel engine: its ranks must sample alike
            seeds = [[int(s) for s in self._rng.integers(0, 2**31 - 1, len(part))] for part in groups]
        self.calls += 1
        results = self.wg.generate(
            [[prompts[i] for i in part] for part in per_rank],
            [p] * n,
            [seeds[dp] for dp, _ in info] if seeds else [None] * n,
        )
        return collect_by_dp(results, info)


def typed_config(config: DictConfig | PPOConfig) -> PPOConfig:
    """The typed trainer config of a composed config (unchanged when already typed)."""
    return config if isinstance(config, PPOConfig) else from_config(config)


def rollout_sampling(config: DictConfig | PPOConfig, global_step: int, validate: bool) -> dict[str, Any]:
    """Sampling parameters of a rollout: ``actor_rollout_ref.rollout`` (training) or its ``val_kwargs``.

    Training requests the engine's own log-probs of its samples (compared with the actor's to check the weight sync;
    TIS) unless ``rollout.calculate_log_probs`` is False. With ``rollout.seed`` set, the seed depends on the step and
    on train vs validation only. Per-turn limits (``max_tokens``) are the caller's: a workflow sets them per turn.
    """
    rc = typed_config(config).actor_rollout_ref.rollout
    if validate:
        vk = rc.val_kwargs
        params = {"temperature": vk.temperature, "top_p": vk.top_p, "top_k": vk.top_k, "greedy": not vk.do_sample}
    else:
        params = {
            "temperature": rc.temperature,
            "top_p": rc.top_p,
            "top_k": rc.top_k,
            "logprobs": bool(rc.calculate_log_probs),
        }
    if rc.seed is not None:
        params["seed"] = rc.seed + 7919 * global_step + (1 << 20) * int(validate)
    return params


def mini_batch_ids(num_rows: int, train_batch_size: int, ppo_mini_batch_size: int) -> torch.Tensor:
    """Global mini-batch of each row: ``train_batch_size // ppo_mini_batch_size`` contiguous, nearly equal parts,
    whatever the number of rows (conversations) or ranks (16 optimizer steps per step in MemAgent).

    Example: 5 rows, ``train_batch_size=4``, ``ppo_mini_batch_size=2`` -> ``[0, 0, 0, 1, 1]``.
    """
    num = max(1, int(train_batch_size) // int(ppo_mini_batch_size))
    ids = torch.zeros(num_rows, dtype=torch.long)
    for m, part in enumerate(np.array_split(np.arange(num_rows), min(num, max(num_rows, 1)))):
        ids[part] = m
    return ids


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


def rollout_actor_mismatch(conv: DataProto) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the actor's recomputed ones (response tokens).

    Near 0 when the rollout engine holds the actor's current weights; a stale engine (broken
    weight sync) shows up here at once. Differences also come from bf16 vs fp32 and kernels. Tokens without an
    engine log-prob (0: async turns re-tokenised from text) do not count, as in TIS.
    """
    if "rollout_log_probs" not in conv.batch.keys():
        return {}
    rollout_lp = conv.batch["rollout_log_probs"]
    mask = engine_token_mask(rollout_lp, conv.batch["response_mask"])
    diff = (rollout_lp - conv.batch["old_log_probs"]).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {"rollout/logprob_abs_diff_mean": float(diff.mean()), "rollout/logprob_abs_diff_max": float(diff.max())}


class TrainerCore:
    """State and helpers shared by the trainers; subclasses implement ``train_step`` and ``validate``.

    Attributes read by ``fit``: ``config`` (the composed DictConfig), ``conf`` (the same as typed sections,
    :class:`~verl.trainer.config.PPOConfig`: what the trainers read), ``wg``, ``tracker``, ``global_step``,
    ``last_val_samples``.
    """

    def __init__(self, config: DictConfig, tokenizer, worker_group, reward_fn, val_reward_fn, tracker=None):
        self.config = config
        self.conf = typed_config(config)
        self.tokenizer = tokenizer
        self.wg = worker_group
        self.reward_fn, self.val_reward_fn = reward_fn, val_reward_fn
        self.tracker = tracker
        self.rollout = RolloutClient(worker_group)
        self.global_step = 0
        self.last_val_samples: list[dict] = []
        # ``algorithm.grpo_use_adv`` (MemAgent's alias), when set, overrides norm_adv_by_std_in_grpo
        self.norm_by_std = self.conf.algorithm.norm_adv_by_std
        # one-step-off training (verl/trainer/ppo/rollout_overlap.py) and its off-policy correction
        self.ahead = RolloutAhead(self.conf.trainer.rollout_overlap)
        algo = self.conf.algorithm
        self.use_rollout_is = rollout_is_on(algo.rollout_is, self.conf.trainer.rollout_overlap, algo.bypass_mode)
        self.policy_version: int | None = None  # the actor's weights: the step whose update made them
        self.rollout_version: int | None = None  # the engine's weights: the actor's version at the last sync
        # SMs kept for the engine while a rollout runs beside the training passes (moved by balance_reserved_sms)
        self.engine_reserved_sms = int(self.conf.actor_rollout_ref.rollout.engine_reserved_sms)
        self.balanced_steps = 0  # steps with a rollout ahead this process has seen (the first one is not balanced)

    # ---------------------------------------------------------------- rollout parameters
    def sampling(self, validate: bool, step: int | None = None) -> dict[str, Any]:
        """Sampling parameters of the rollout of ``step`` (default: this step; see :func:`rollout_sampling`)."""
        return rollout_sampling(self.conf, self.global_step if step is None else step, validate)

    def log_prob_temperature(self) -> float:
        """Log-probs are of the distribution sampled from: logits / rollout temperature (1 for greedy)."""
        return float(self.sampling(validate=False)["temperature"]) or 1.0

    def actor_mini_batch_ids(self, num_rows: int) -> torch.Tensor:
        """The actor's global mini-batch of each of ``num_rows`` rows (:func:`mini_batch_ids`). The multi-turn trainer
        numbers trajectories, ordered by question (``repeat(n, interleave=True)``), so that a mini-batch holds every
        conversation of ``ppo_mini_batch_size`` questions' trajectories: upstream's meaning of the key (questions per
        optimizer step), and at the original's scale (its ranks each split their own rows, every optimizer step drew
        from the whole step) a mix of all turns in every optimizer step, never one kind of turn alone."""
        actor = self.conf.actor_rollout_ref.actor
        return mini_batch_ids(num_rows, self.conf.data.train_batch_size, actor.ppo_mini_batch_size)

    def spread_over_ranks(
        self, data: DataProto, metrics: dict[str, float], *aligned: Any, group: Any = None, prefix: str = "perf/update"
    ) -> tuple[Any, ...]:
        """``(data, *aligned)`` with their rows (``aligned``: row-aligned tensors or arrays) in the order under which
        the data-parallel dispatch gives each rank of ``group`` (default: the actor's) a share of every mini-batch
        (``mini_batch_id``), longest rows dealt first with ``trainer.balance_batch``
        (:mod:`~verl.trainer.ppo.rank_spread`); unchanged on one rank. Adds the split's ``<prefix>_*`` metrics to
        ``metrics`` when the group has several ranks."""
        ranks = int((self.wg if group is None else group).world_size)
        if ranks <= 1:
            return (data, *aligned)
        ids, tokens = data.batch["mini_batch_id"], data.batch["attention_mask"].sum(dim=-1)
        order = spread_order(ids, tokens, ranks, by_tokens=self.conf.trainer.balance_batch)
        metrics.update(spread_metrics(ids[order], tokens[order], ranks, prefix))
        index = order.numpy()
        return (data[index], *(a[order] if isinstance(a, torch.Tensor) else a[index] for a in aligned))

    # ---------------------------------------------------------------- rollouts: this step's, the next one's
    def step_rollout(self, batch: DataProto, make, **kwargs: Any) -> Rollout:
        """This step's rollout: the one generated ahead during the previous step (``trainer.rollout_overlap``),
        else ``make(batch, step=global_step, **kwargs) -> (result, timing, metrics)`` run now."""
        if self.policy_version is None:  # first step of this process: the engine holds the actor's weights
            self.policy_version = self.rollout_version = self.global_step - 1
        rollout = self.ahead.take(batch)
        if rollout is None:
            rollout = make_rollout(make, batch, self.rollout_version, step=self.global_step, **kwargs)
        return rollout

    def launch_next_rollout(self, upcoming: DataProto | None, make, **kwargs: Any) -> bool:
        """``trainer.rollout_overlap``: start the next step's rollout in the background now, on the engine's current
        (pre-update) weights; False (nothing started) when off or on the last step."""
        return self.ahead.launch(make, upcoming, self.rollout_version, step=self.global_step + 1, **kwargs)

    def rollout_metrics(self, rollout: Rollout, timing: dict[str, float]) -> dict[str, float]:
        """The rollout's own metrics and timings (added to ``timing``) plus its staleness."""
        for name, seconds in rollout.timing.items():
            timing[name] = timing.get(name, 0.0) + seconds
        return {**rollout.metrics, **staleness_metrics(rollout, self.policy_version)}

    def sync_rollout_weights(self, timing: dict[str, float]) -> dict[str, float]:
        """After the actor update: wait for a rollout running ahead (it must finish on the old weights), then push
        the actor's weights into the engine. With a rollout ahead, ``timing_s/rollout_ahead_idle`` is how long it had
        been finished when the training passes were done (``timing_s/wait_rollout_ahead``: how long they waited for
        it); returns the SM split's metrics (:meth:`balance_engine_sms`)."""
        metrics: dict[str, float] = {}
        if self.ahead.running:
            timing["rollout_ahead_idle"] = self.ahead.idle_s()
            with timer("wait_rollout_ahead", timing):
                self.ahead.wait()
            metrics = self.balance_engine_sms(timing["wait_rollout_ahead"], timing["rollout_ahead_idle"])
        with timer("sync_weights", timing):
            self.wg.sync_rollout_weights()
        self.rollout_version = self.policy_version
        return metrics

    def balance_engine_sms(self, waited: float, idle: float) -> dict[str, float]:
        """``perf/engine_reserved_sms`` (the split this step's training passes ran with, where one is kept) and,
        with ``rollout.balance_reserved_sms``, the split moved by one partition group towards the side of the step
        that finished last (:func:`~verl.workers.training_sms.balance_shift` of ``waited`` for the rollout ahead, of
        its ``idle`` time, over the part of the step it ran beside) for the next step. Not after this process's first
        such step: its training passes pay one-time costs (compiles, first calls: the ref pass 12.1 s against 4-8 s
        later at 1.5B), which the split cannot win back (one H200: moved 16 -> 8 SMs after it, the next step's
        training then waited 10.1 s for the rollout)."""
        balance = self.conf.actor_rollout_ref.rollout.balance_reserved_sms
        if not (self.engine_reserved_sms or balance):
            return {}
        metrics = {"perf/engine_reserved_sms": float(self.engine_reserved_sms)}
        self.balanced_steps += 1
        warm = self.balanced_steps > 1
        delta = balance_shift(waited, idle, self.ahead.launched_s()) if balance and warm else 0
        if delta:
            counts = set(self.wg.shift_engine_reserved_sms(delta))
            if len(counts) != 1:
                raise RuntimeError(f"the workers' engine_reserved_sms disagree after a shift by {delta}: {counts}")
            self.engine_reserved_sms = counts.pop()
        return metrics

    def old_log_probs(self, data: DataProto, timing: dict[str, float]) -> DataProto:
        """``data`` with PPO's ``old_log_probs``: recomputed by the actor (``timing_s/old_log_prob``), or with
        ``algorithm.bypass_mode`` the rollout engine's log-probs of the sampled tokens (no pass)."""
        if not self.conf.algorithm.bypass_mode:
            with timer("old_log_prob", timing):
                return data.union(self.wg.compute_log_prob(data))
        if "rollout_log_probs" not in data.batch.keys():  # launch refuses such configs (bypass_mode_errors)
            raise RuntimeError(
                "algorithm.bypass_mode is on but the rollout returned no engine log-probs to use as PPO's old "
                "log-probs; set actor_rollout_ref.rollout.calculate_log_probs=True or algorithm.bypass_mode=False"
            )
        data.batch["old_log_probs"] = data.batch["rollout_log_probs"]
        return data

    def off_policy_correction(self, data: DataProto) -> dict[str, float]:
        """Engine vs actor log-prob metrics and, with TIS on (``algorithm.rollout_is``), the per-token
        ``rollout_is_weights`` the actor multiplies into the policy loss (``rollout_correction.py``). In bypass
        mode the old log-probs are the engine's: no metrics (they would read 0), no weights."""
        if self.conf.algorithm.bypass_mode:
            return {}
        metrics = rollout_actor_mismatch(data)
        if not self.use_rollout_is:
            return metrics
        if "rollout_log_probs" not in data.batch.keys():  # launch refuses this config (rollout_log_prob_errors)
            raise RuntimeError(
                "algorithm.rollout_is is on but the rollout returned no engine log-probs to weigh the loss with "
                "(actor_rollout_ref.rollout.calculate_log_probs=False, or an engine that gives none); set "
                "actor_rollout_ref.rollout.calculate_log_probs=True or algorithm.rollout_is=False"
            )
        b, cap = data.batch, self.conf.algorithm.rollout_is_threshold
        weights = compute_rollout_is_weights(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"], cap)
        b["rollout_is_weights"] = weights
        metrics.update(rollout_is_metrics(weights, b["old_log_probs"], b["rollout_log_probs"], b["response_mask"], cap))
        return metrics

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_groups(self) -> dict[str, Any]:
        """Worker groups to checkpoint, by sub-folder name (``fit`` saves and loads each)."""
        return {"actor": self.wg}

    # ---------------------------------------------------------------- validation
    def validation_metrics(self, sources: list[str], questions: list[str], rewards: list[float]) -> dict[str, float]:
        """``val-core/<source>/reward/mean@n`` (and ``best@n``/``std@n``/``worst@n`` for n > 1) per data source,
        grouping the ``n`` samples of each question, plus ``val/num_questions``."""
        out = process_validation_metrics(sources, questions, {"reward": rewards})
        out["val/num_questions"] = len(set(questions))
        return out

    def keep_val_samples(self, responses: DataProto, rows: DataProto, scores: torch.Tensor) -> None:
        """Keep up to :data:`MAX_VAL_SAMPLES` decoded answers (``responses``: one answer per row of ``rows``,
        which carries ``reward_model``) for ``trainer.log_val_generations``."""
        k = min(MAX_VAL_SAMPLES - len(self.last_val_samples), len(rows))
        if k <= 0:
            return
        texts = decode_rows(self.tokenizer, responses.batch["responses"][:k], responses.batch["response_mask"][:k])
        for i, text in enumerate(texts):
            gold = ground_truth(rows.non_tensor_batch, i)
            self.last_val_samples.append({"answer": text, "ground_truth": gold, "score": float(scores[i])})

    # ---------------------------------------------------------------- generation dumps
    def generation_records(
        self,
        validate: bool,
        conversations: DataProto,
        sample_index,
        final_mask,
        trajectories,
        scores,
        first_trajectory: int = 0,
    ) -> list[dict]:
        """Records of these conversations for ``trainer.validation_data_dir`` (``validate``) or
        ``trainer.rollout_data_dir`` (:mod:`~verl.trainer.ppo.generation_dump`); [] when that folder is not set.
        ``first_trajectory``: the trajectories of a validation's earlier batches."""
        if not self._generations_dir(validate):
            return []
        return generation_records(
            self.tokenizer,
            conversations,
            sample_index,
            final_mask,
            trajectories,
            scores,
            self.global_step,
            first_trajectory,
        )

    def dump_generations(self, validate: bool, records: list[dict]) -> None:
        """Write ``records`` to ``<folder>/<global_step>.jsonl`` when the folder is set."""
        folder = self._generations_dir(validate)
        if folder:
            write_generations(folder, self.global_step, records)

    def _generations_dir(self, validate: bool) -> str | None:
        trainer = self.conf.trainer
        return trainer.validation_data_dir if validate else trainer.rollout_data_dir

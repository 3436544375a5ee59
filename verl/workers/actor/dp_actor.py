"""Data-parallel PPO/GRPO actor: log-prob recomputation and the policy update (verl's ``DataParallelPPOActor``).

Works with a plain module (one process), an FSDP2 module (``verl.utils.fsdp_utils.apply_fsdp2``; CUDA+NCCL or
CPU+gloo) and, as a fallback, an unsharded module replicated over several ranks (gradients are then averaged
with an explicit all-reduce).

Loss normalisation (docs/spec.md#policy-loss). For every mini-batch the actor counts the loss
normaliser of the whole mini-batch over *all* data-parallel ranks before micro-batching: response tokens for
``token-mean`` (rows with at least one response token for the ``seq-mean-*`` modes). Each micro-batch loss is
``sum(loss * mask) / global_count``; it is multiplied by the DP world size before ``backward`` because FSDP
averages gradients over ranks. The accumulated gradient is therefore the gradient of the global mini-batch
token-mean, and it does not change with the micro-batch size, dynamic batching or the number of ranks.

Per-token loss (each term aggregated as above, optional per-token ``loss_weights`` multiplied into all terms):
``pg_loss`` (PPO clip with ``clip_ratio_low/high`` and dual clip ``clip_ratio_c``; times the optional per-token
``rollout_is_weights``, the driver's truncated importance weights: ``verl/trainer/ppo/rollout_correction.py``)
``+ kl_loss_coef * kl_penalty(log_prob, ref_log_prob, kl_loss_type)`` when ``use_kl_loss``
``- entropy_coeff * entropy``.

The entropy (an extra pass over the ``[tokens, vocab]`` logits of every micro-batch) is computed only when
``entropy_coeff != 0`` or ``calculate_entropy`` (upstream verl's rule); the ``actor/entropy`` metric is
reported only then.

Every rank performs the same number of forward/backward passes (FSDP collectives must line up): the numbers
of mini-batches and micro-batches are all-reduced (max) and a rank with fewer rows runs zero-weight dummy
passes.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, grad_acc_mode, kl_penalty, local_loss_normalizer
from verl.utils.fsdp_utils import clip_grad_norm
from verl.workers.actor.forward import (
    HostPlan,
    forward_response_log_probs,
    supports_logits_to_keep,
)
from verl.workers.actor.fused_logprob import supports_fused_head
from verl.workers.actor.packed_block_mask import attn_implementation, supports_shared_prompts
from verl.workers.actor.settings import ActorSettings
from verl.workers.actor.shared_prompts import micro_batch_units
from verl.workers.dp_common import FORWARD_KEYS as _FORWARD_KEYS
from verl.workers.dp_common import DataParallelComponent

__all__ = ["DataParallelPPOActor"]

logger = logging.getLogger(__name__)

# Metric sums all-reduced once per mini-batch (order matters).
_STAT_NAMES = ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "tokens")


class DataParallelPPOActor(DataParallelComponent):
    """PPO actor over one data-parallel shard of the batch.

    Args:
        config: the actor config (``actor_rollout_ref.actor``; DictConfig, dict or object), see ``ActorSettings``.
        actor_module: the causal LM (plain, FSDP2-sharded, or peft-wrapped).
        optimizer: required for ``update_policy``; ``None`` for a log-prob-only (reference) actor.
        dp_group: data-parallel process group (default: the default group when torch.distributed is initialised).
    """

    def __init__(
        self,
        config: Any,
        actor_module: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        dp_group: Optional[dist.ProcessGroup] = None,
    ):
        super().__init__(actor_module, dp_group)
        self.config = config
        self.settings = ActorSettings.from_config(config, dp_size=self.dp_size)
        self.actor_module = actor_module
        self.actor_optimizer = optimizer
        self.use_logits_to_keep = supports_logits_to_keep(actor_module)
        # log-probs from hidden states, chunked (model.use_fused_kernels); models that post-process their
        # logits (soft-capping, scaling) keep the unfused path
        self.use_fused_kernels = bool(self.settings.use_fused_kernels) and supports_fused_head(actor_module)
        if self.settings.use_fused_kernels and not self.use_fused_kernels:
            logger.warning(
                "model.use_fused_kernels=True ignored for %s: its forward post-processes the logits; using the "
                "unfused log-prob path",
                type(actor_module).__name__,
            )
        self._warn_if_slow_packing()
        # packed rows with identical prompts hold the prompt once (model.share_prompts; shared_prompts.py)
        wants_sharing = bool(self.settings.share_prompts and self.settings.use_remove_padding)
        self.share_prompts = wants_sharing and supports_shared_prompts(actor_module)
        if wants_sharing and not self.share_prompts:
            logger.info(
                "model.share_prompts: rows are packed without sharing prompts under attn_implementation=%s "
                "(variable-length kernels take no mask; the automatic choice shares prompts on flex_attention only "
                "for models with a hidden size of 1024 or more, where it pays)",
                attn_implementation(actor_module),
            )
        # prompt tokens not computed again thanks to share_prompts, summed over this actor's passes
        self.shared_prompt_tokens = 0
        # around each micro-batch's device work (forward, or forward + backward): the worker sets it to run that work
        # on the SMs left to training while a generation runs beside it (verl/workers/training_sms.py)
        self.micro_batch_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    # ------------------------------------------------------------------ helpers
    def _warn_if_slow_packing(self) -> None:
        """Packed rows under sdpa/eager attention get a dense [T, T] block-diagonal mask: exact, but on a GPU
        slower than the padded forward (H200, Qwen2.5-1.5B: 11.0k vs 22.7k tokens/s/GPU for update_policy;
        flex_attention 32.9k). Say so once; the result is the same either way."""
        attn = getattr(getattr(self.actor_module, "config", None), "_attn_implementation", None)
        if self.settings.use_remove_padding and self.device.type == "cuda" and attn in ("sdpa", "eager"):
            logger.warning(
                "use_remove_padding with attn_implementation=%s builds a dense block-diagonal mask per micro-batch "
                "(correct but slow on GPU); install flash-attn or load the model with "
                "attn_implementation='flex_attention'",
                attn,
            )

    def _micro_batches(
        self, batch: TensorDict, use_dynamic: bool, micro_batch_size: int, max_token_len: int
    ) -> list[list[int]]:
        """Row-index lists of the micro-batches of ``batch`` (``_micro_batch_rows``). With ``share_prompts`` the rows
        of a group sharing a prompt stay together: token budgets count the group as packed (prompt once,
        ``shared_prompts.micro_batch_units``); fixed-size micro-batches take the group's rows one after another."""
        seqlens = batch["attention_mask"].sum(dim=-1)
        if not self.share_prompts:
            return self._micro_batch_rows(seqlens, use_dynamic, micro_batch_size, max_token_len)
        host = batch.select("input_ids", "attention_mask").to("cpu")
        units, lengths = micro_batch_units(
            host["input_ids"],
            host["attention_mask"],
            batch["responses"].shape[-1],
            max_token_len if use_dynamic else None,
        )
        if use_dynamic:
            parts = self._micro_batch_rows(torch.tensor(lengths), True, micro_batch_size, max_token_len)
            return [[row for unit in part for row in units[unit]] for part in parts]
        order = [row for unit in units for row in unit]
        return [[order[i] for i in part] for part in self._micro_batch_rows(seqlens, False, micro_batch_size, 0)]

    def _host_plan(self, host: TensorDict) -> HostPlan:
        plan = super()._host_plan(host)
        if plan.packed is not None:
            self.shared_prompt_tokens += plan.packed.tokens_saved
        return plan

    def _forward(
        self,
        micro: TensorDict,
        temperature: float,
        calculate_entropy: bool,
        entropy_with_grad: bool = False,
        plan: Optional[HostPlan] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        micro = micro.to(self.device)
        return forward_response_log_probs(
            self.actor_module,
            input_ids=micro["input_ids"],
            attention_mask=micro["attention_mask"],
            position_ids=micro["position_ids"],
            response_length=micro["responses"].shape[-1],
            temperature=temperature,
            use_remove_padding=self.settings.use_remove_padding,
            calculate_entropy=calculate_entropy,
            entropy_with_grad=entropy_with_grad,
            use_logits_to_keep=self.use_logits_to_keep,
            entropy_chunk_size=self.settings.entropy_chunk_size,
            use_fused_kernels=self.use_fused_kernels,
            fused_chunk_size=self.settings.fused_chunk_size,
            fused_backend=self.settings.fused_backend,
            plan=plan,
        )

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def compute_log_prob(
        self, data: DataProto, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs ``[B, R]`` of ``data.batch["responses"]`` (and entropies, or None), in row order.

        ``data.meta_info`` may override ``micro_batch_size``, ``use_dynamic_bsz``, ``max_token_len`` and sets
        ``temperature`` (default 1.0). Rows without any valid token get zeros. Outputs live on the device of
        ``data.batch``.
        """
        s = self.settings
        meta = data.meta_info
        temperature = float(meta.get("temperature", 1.0))
        use_dynamic = bool(meta.get("use_dynamic_bsz", s.log_prob_dynamic))
        micro_batch_size = int(meta.get("micro_batch_size") or s.log_prob_micro_batch_size)
        max_token_len = int(meta.get("max_token_len") or s.log_prob_token_budget)
        batch = data.select(batch_keys=list(_FORWARD_KEYS)).batch
        out_device = batch["input_ids"].device

        was_training = self.actor_module.training
        self.actor_module.eval()
        # outputs stay on the device until all micro-batches are done (one copy back, not one per micro-batch)
        log_probs = torch.zeros(batch["responses"].shape, dtype=torch.float32, device=self.device)
        entropys = torch.zeros_like(log_probs) if calculate_entropy else None
        for rows, micro, plan in self._forward_micro_batches(batch, use_dynamic, micro_batch_size, max_token_len):
            with self.micro_batch_scope():
                lp, ent = self._forward(micro, temperature, calculate_entropy and rows is not None, plan=plan)
            if rows is None:  # a dummy pass (this rank has fewer micro-batches): keeps collectives in step
                continue
            log_probs[rows] = lp.float()
            if entropys is not None:
                entropys[rows] = ent.float()
        log_probs = log_probs.to(out_device)
        entropys = entropys.to(out_device) if entropys is not None else None
        self.actor_module.train(was_training)
        return log_probs, entropys

    # ------------------------------------------------------------------ update
    def _select_update_batch(self, data: DataProto) -> tuple[TensorDict, TensorDict]:
        keys = [*_FORWARD_KEYS, "response_mask", "old_log_probs", "advantages"]
        if self.settings.use_kl_loss:
            keys.append("ref_log_prob")
        return self._select_update_rows(data, keys, ("loss_weights", "rollout_is_weights"), "update_policy")

    def update_policy(self, data: DataProto) -> dict[str, float]:
        """Run ``ppo_epochs`` passes of mini-batch updates on this rank's rows; return averaged metrics.

        Needs ``input_ids, attention_mask, position_ids, responses, response_mask, old_log_probs, advantages``
        (+ ``ref_log_prob`` with ``use_kl_loss``; optional per-token ``loss_weights`` and ``rollout_is_weights``). Rows flagged as padding
        (``no_padding_mask == False`` or ``is_padding == True``) and rows without valid tokens are dropped first.
        Metric values are global over all ranks (token-weighted means; losses are the mini-batch objective
        terms), averaged over mini-batches and epochs.
        """
        if self.actor_optimizer is None:
            raise RuntimeError("update_policy needs an optimizer; this actor was built with optimizer=None")
        s = self.settings
        temperature = float(data.meta_info.get("temperature", 1.0))
        batch, dummy = self._select_update_batch(data)
        shared_before = self.shared_prompt_tokens
        result, skipped, num_mini_batches = self._run_mini_batches(
            batch, lambda mini_batch: self._update_mini_batch(mini_batch, dummy, temperature)
        )
        result["actor/lr"] = float(self.actor_optimizer.param_groups[0]["lr"])
        result["actor/skipped_steps"] = float(skipped)
        result["actor/num_mini_batches"] = float(num_mini_batches)
        # prompt tokens of this rank's passes not computed again (model.share_prompts), forward and backward
        result["actor/shared_prompt_tokens"] = float(self.shared_prompt_tokens - shared_before)
        if s.use_kl_loss:
            result["actor/kl_coef"] = float(s.kl_loss_coef)
        return result

    def _update_mini_batch(self, mini_batch: TensorDict, dummy: TensorDict, temperature: float) -> dict[str, float]:
        """Accumulate the mini-batch gradient over its micro-batches and take one optimizer step."""
        s = self.settings
        mode = s.loss_agg_mode
        local_norm = local_loss_normalizer(mini_batch["response_mask"], mode).to(self.device)
        global_norm = self._all_reduce_sum(local_norm.clone().reshape(1))[0]
        count_key = "global_token_count" if grad_acc_mode(mode) == "token" else "global_seq_count"
        micro_batch_size = int(s.ppo_micro_batch_size_per_gpu or 1)
        micro_rows = self._micro_batches(
            mini_batch, s.use_dynamic_bsz, micro_batch_size, int(s.ppo_max_token_len_per_gpu)
        )

        self.actor_optimizer.zero_grad(set_to_none=True)
        stats = torch.zeros(len(_STAT_NAMES), dtype=torch.float32, device=self.device)
        for index, micro, plan in self._device_micro_batches(mini_batch, micro_rows, dummy):
            with self.micro_batch_scope():
                micro_stats = self._micro_batch_backward(
                    micro, temperature, {count_key: global_norm}, zero_weight=index is None, plan=plan
                )
            stats += micro_stats

        if self.dp_size > 1 and not self.is_fsdp:
            self._all_reduce_mean_grads()
        params = [p for p in self.actor_module.parameters() if p.requires_grad]
        grad_norm = clip_grad_norm(params, s.grad_clip)
        skipped = not math.isfinite(grad_norm)
        if skipped:
            logger.warning("actor: grad norm is %s; skipping this optimizer step", grad_norm)
        else:
            self.actor_optimizer.step()
        self.actor_optimizer.zero_grad(set_to_none=True)

        stats = self._all_reduce_sum(stats).tolist()
        values = dict(zip(_STAT_NAMES, stats))
        tokens = max(values["tokens"], 1.0)
        metrics = {
            "actor/pg_loss": values["pg_loss"],
            "actor/pg_clipfrac": values["pg_clipfrac"] / tokens,
            "actor/ppo_kl": values["ppo_kl"] / tokens,
            "actor/pg_clipfrac_lower": values["pg_clipfrac_lower"] / tokens,
            "actor/grad_norm": grad_norm,
            "skipped": float(skipped),
        }
        if s.entropy_coeff != 0 or s.calculate_entropy:
            metrics["actor/entropy"] = values["entropy"]
        if s.use_kl_loss:
            metrics["actor/kl_loss"] = values["kl_loss"]
        return metrics

    def _micro_batch_backward(
        self,
        micro: TensorDict,
        temperature: float,
        norm_kwargs: dict[str, torch.Tensor],
        zero_weight: bool,
        plan: Optional[HostPlan] = None,
    ) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns its contribution to the ``_STAT_NAMES`` sums."""
        s = self.settings
        mask = micro["response_mask"]
        agg_kwargs = dict(norm_kwargs, weights=micro.get("loss_weights", None))
        calculate_entropy = s.entropy_coeff != 0 or s.calculate_entropy
        log_prob, entropy = self._forward(
            micro, temperature, calculate_entropy=calculate_entropy, entropy_with_grad=s.entropy_coeff != 0, plan=plan
        )
        policy_loss = get_policy_loss_fn(s.policy_loss_mode)  # core_algos registry (actor.policy_loss.loss_mode)
        # truncated importance weights of the rollout policy (the driver's algorithm.rollout_is), policy loss only
        is_weights = micro.get("rollout_is_weights", None)
        pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = policy_loss(
            micro["old_log_probs"],
            log_prob,
            micro["advantages"],
            mask,
            cliprange=s.clip_ratio,
            cliprange_low=s.clip_low,
            cliprange_high=s.clip_high,
            clip_ratio_c=s.clip_ratio_c,
            loss_agg_mode=s.loss_agg_mode,
            loss_scale_factor=s.loss_scale_factor,
            **({} if is_weights is None else {"rollout_is_weights": is_weights}),
            **agg_kwargs,
        )
        loss = pg_loss
        if s.entropy_coeff != 0:
            entropy_loss = agg_loss(entropy, mask, s.loss_agg_mode, loss_scale_factor=s.loss_scale_factor, **agg_kwargs)
            loss = loss - s.entropy_coeff * entropy_loss
        # the entropy metric is not weighted by loss_weights
        entropy_metric = (
            agg_loss(entropy.detach(), mask, s.loss_agg_mode, loss_scale_factor=s.loss_scale_factor, **norm_kwargs)
            if calculate_entropy
            else torch.zeros((), device=log_prob.device)
        )
        kl_loss = torch.zeros((), device=loss.device)
        if s.use_kl_loss:
            kld = kl_penalty(log_prob, micro["ref_log_prob"], s.kl_loss_type)
            kl_loss = agg_loss(kld, mask, s.loss_agg_mode, loss_scale_factor=s.loss_scale_factor, **agg_kwargs)
            loss = loss + s.kl_loss_coef * kl_loss
        if zero_weight:
            loss = loss * 0.0
        # FSDP (or the manual all-reduce) averages gradients over ranks; undo that average.
        (loss * self.dp_size).backward()
        if zero_weight:
            return torch.zeros(len(_STAT_NAMES), dtype=torch.float32, device=self.device)
        tokens = mask.to(torch.float32).sum()
        return torch.stack(
            [
                pg_loss.detach().float(),
                kl_loss.detach().float(),
                entropy_metric.float(),
                pg_clipfrac.float() * tokens,
                ppo_kl.float() * tokens,
                pg_clipfrac_lower.float() * tokens,
                tokens,
            ]
        )

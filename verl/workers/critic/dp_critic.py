"""Data-parallel PPO critic: value predictions and the clipped value-function update (verl's ``DataParallelPPOCritic``).

The value model is a causal LM backbone with a scalar head (``AutoModelForTokenClassification`` with
``num_labels=1``, see ``critic_worker.load_value_model``): one value per sequence position.

Which position holds the value of a response token. ``values[:, t]`` is the head's output at the sequence
position *before* response token ``t`` (the state from which token ``t`` is generated), i.e. the last
``R + 1`` positions of the padded row without the final one, exactly like the actor's log-probs
(``verl.workers.actor.forward``). Positions that are not valid response tokens hold 0.

Loss normalisation is the actor's (``verl.workers.actor.dp_actor``): for every mini-batch the loss normaliser
(response tokens for ``token-mean``, rows for the ``seq-mean-*`` modes) is all-reduced over the data-parallel
ranks before micro-batching; each micro-batch loss is ``0.5 * sum(clipped squared error * mask) / global_count``,
multiplied by the DP world size before ``backward`` because FSDP averages gradients over ranks. The mini-batch
gradient therefore does not depend on the micro-batch size, dynamic batching or the number of ranks. Every rank
runs the same number of forward/backward passes (zero-weight dummy passes fill the gaps).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import AGG_MODES, compute_value_loss, grad_acc_mode, local_loss_normalizer
from verl.utils.fsdp_utils import clip_grad_norm
from verl.workers.actor.forward import (
    HostPlan,
    pack_rows,
    packed_length_multiple,
    packed_model_inputs,
    scatter_targets,
)
from verl.workers.actor.settings import apply_legacy_micro_batches, plain_values
from verl.workers.config.actor import ActorConfig
from verl.workers.config.base import Checks
from verl.workers.config.critic import CriticConfig
from verl.workers.dp_common import FORWARD_KEYS as _FORWARD_KEYS
from verl.workers.dp_common import DataParallelComponent

__all__ = ["CriticSettings", "DataParallelPPOCritic", "forward_response_values"]

logger = logging.getLogger(__name__)

# Metric sums all-reduced once per mini-batch (order matters).
_STAT_NAMES = ("vf_loss", "vf_clipfrac", "vpred_sum", "tokens")


# critic keys that follow the actor's in the YAML (``${actor_rollout_ref.actor.<key>}``): on their own (a partial
# dict, as in tests) a null takes the actor's default
_FOLLOWS_ACTOR = ("ppo_mini_batch_size", "use_dynamic_bsz", "ppo_epochs", "shuffle")


@dataclass
class CriticSettings(CriticConfig):
    """The ``critic`` section (every field of :class:`CriticConfig`, same defaults) plus the worker's overlay.

    Mini-batches: rows carrying ``mini_batch_id`` (assigned by the trainer) are grouped by it; otherwise
    ``train_batch_size // ppo_mini_batch_size`` contiguous mini-batches when ``train_batch_size`` is set, else
    mini-batches of ``ppo_mini_batch_size`` rows (as the actor does).
    """

    # Prompts per step as seen by the critic (the trainer's batch); null = mini-batches of ppo_mini_batch_size rows.
    train_batch_size: Optional[int] = None
    # Unpad sequences (the worker copies critic.model.use_remove_padding).
    use_remove_padding: bool = False
    # Loss aggregation of the value loss (the actor's modes).
    loss_agg_mode: str = "token-mean"

    @classmethod
    def from_config(cls, config: Any, dp_size: int = 1, path: Optional[str] = None) -> CriticSettings:
        """Build from a DictConfig / dict / typed config; absent keys take the defaults above. The deprecated
        global ``ppo_micro_batch_size`` / ``forward_micro_batch_size`` are divided by ``dp_size`` (verl)."""
        values = apply_legacy_micro_batches(
            plain_values(config),
            {
                "ppo_micro_batch_size_per_gpu": "ppo_micro_batch_size",
                "forward_micro_batch_size_per_gpu": "forward_micro_batch_size",
            },
            dp_size,
            "critic",
            keep_legacy=("ppo_micro_batch_size", "forward_micro_batch_size"),
        )
        actor_defaults = ActorConfig()
        for key in _FOLLOWS_ACTOR:
            if values.get(key) is None:
                values[key] = getattr(actor_defaults, key)
        return super().from_config(values, path)

    def check(self, c: Checks) -> None:
        super().check(c)
        c.choice("loss_agg_mode", AGG_MODES)
        mini, train = self.ppo_mini_batch_size, self.train_batch_size
        if not c.bad & {"ppo_mini_batch_size", "train_batch_size"} and train is not None and train < (mini or 1):
            c.error(f"{c.key('train_batch_size')} ({train}) must be >= {c.key('ppo_mini_batch_size')} ({mini})")
        per_gpu = self.ppo_micro_batch_size_per_gpu
        if not self.use_dynamic_bsz and (per_gpu is None or per_gpu < 1):
            c.error(
                f"{c.key('ppo_micro_batch_size_per_gpu')} must be >= 1 when {c.key('use_dynamic_bsz')} is False, "
                f"got {per_gpu}"
            )

    @property
    def forward_rows(self) -> int:
        """Rows per value-forward micro-batch (its own key, else the update's)."""
        return int(self.forward_micro_batch_size_per_gpu or self.ppo_micro_batch_size_per_gpu or 1)

    @property
    def forward_token_budget(self) -> int:
        return int(self.forward_max_token_len_per_gpu or self.ppo_max_token_len_per_gpu)


def _head_output(output: Any) -> torch.Tensor:
    """``[b, S]`` scalar head output from a model output (``.logits`` of shape ``[b, S, 1]``) or a tensor."""
    values = output.logits if hasattr(output, "logits") else output
    if values.dim() == 3:
        if values.shape[-1] != 1:
            raise ValueError(
                "value model must output one value per position, got logits of shape "
                f"{tuple(values.shape)} (load it with num_labels=1)"
            )
        values = values.squeeze(-1)
    return values.float()


def forward_response_values(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    use_remove_padding: bool = False,
    plan: Optional[HostPlan] = None,
) -> torch.Tensor:
    """Values ``[b, R]`` of the last ``R = response_length`` token positions (see the module docstring).

    ``use_remove_padding`` packs the valid tokens of all rows into one sequence whose ``position_ids`` restart at
    0 per row (same numbers; falls back to the padded layout when rows cannot be packed exactly). ``plan``: that
    layout precomputed from host copies of the masks (``forward.host_plan``), so this function does not
    synchronise the device; same numbers.
    """
    if plan is not None:
        packed = plan.packed
    elif use_remove_padding:
        packed = pack_rows(input_ids, attention_mask, position_ids, response_length, packed_length_multiple(model))
    else:
        packed = None
    if packed is not None:
        # under flex_attention with the BlockMask built without a compile (packed_block_mask.py)
        output = model(**packed_model_inputs(model, packed), use_cache=False)
        token_values = _head_output(output)[0, packed.predictor_index]
        return scatter_targets(token_values, packed.target_mask, packed.target_index)
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    values = _head_output(output)[:, -response_length - 1 : -1]
    return values * attention_mask[:, -response_length:].to(values.dtype)


class DataParallelPPOCritic(DataParallelComponent):
    """PPO critic over one data-parallel shard of the batch.

    Args:
        config: the ``critic`` config (DictConfig, dict or object), see ``CriticSettings``; ``use_remove_padding``
            may be given at the top level (the worker copies it from ``critic.model``).
        critic_module: the value model (plain or FSDP2-sharded).
        optimizer: required for ``update_critic``.
        dp_group: data-parallel process group (default: the default group when torch.distributed is initialised).
    """

    def __init__(
        self,
        config: Any,
        critic_module: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        dp_group: Optional[dist.ProcessGroup] = None,
    ):
        super().__init__(critic_module, dp_group)
        self.config = config
        self.settings = CriticSettings.from_config(config, dp_size=self.dp_size)
        self.critic_module = critic_module
        self.critic_optimizer = optimizer

    # ------------------------------------------------------------------ helpers
    def _forward(self, micro: TensorDict, plan: HostPlan) -> torch.Tensor:
        return forward_response_values(
            self.critic_module,
            input_ids=micro["input_ids"],
            attention_mask=micro["attention_mask"],
            position_ids=micro["position_ids"],
            response_length=micro["responses"].shape[-1],
            plan=plan,
        )

    # ------------------------------------------------------------------ values
    @torch.no_grad()
    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values ``[B, R]`` at the response positions, in row order (0 where a position is not a valid token).

        ``data.meta_info`` may override ``micro_batch_size``, ``use_dynamic_bsz`` and ``max_token_len``.
        Needs ``input_ids, attention_mask, position_ids, responses``. Output lives on the device of ``data.batch``.
        """
        s = self.settings
        meta = data.meta_info
        use_dynamic = bool(meta.get("use_dynamic_bsz", s.use_dynamic_bsz))
        micro_batch_size = int(meta.get("micro_batch_size") or s.forward_rows)
        max_token_len = int(meta.get("max_token_len") or s.forward_token_budget)
        batch = data.select(batch_keys=list(_FORWARD_KEYS)).batch
        out_device = batch["input_ids"].device

        was_training = self.critic_module.training
        self.critic_module.eval()
        # values stay on the device until all micro-batches are done (one copy back, not one per micro-batch)
        values = torch.zeros(batch["responses"].shape, dtype=torch.float32, device=self.device)
        for rows, micro, plan in self._forward_micro_batches(batch, use_dynamic, micro_batch_size, max_token_len):
            micro_values = self._forward(micro, plan)
            if rows is not None:  # None: a dummy pass (this rank has fewer micro-batches), keeps collectives in step
                values[rows] = micro_values
        values = values.to(out_device)
        self.critic_module.train(was_training)
        return values

    # ------------------------------------------------------------------ update
    def _select_update_batch(self, data: DataProto) -> tuple[TensorDict, TensorDict]:
        keys = [*_FORWARD_KEYS, "response_mask", "values", "returns"]
        available = data.batch.keys() if data.batch is not None else []
        missing = [k for k in keys if k not in available]
        if missing:
            raise KeyError(f"update_critic needs batch keys {missing}; the batch has {sorted(available)}")
        return self._select_update_rows(data, keys, (), "update_critic")

    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Run ``ppo_epochs`` passes of mini-batch value updates on this rank's rows; return averaged metrics.

        Needs ``input_ids, attention_mask, position_ids, responses, response_mask, values`` (the values at
        rollout time, for clipping) and ``returns``; optional ``mini_batch_id``. Metric values are global over all
        ranks (``critic/vf_loss`` is the mini-batch objective), averaged over mini-batches and epochs.
        """
        if self.critic_optimizer is None:
            raise RuntimeError("update_critic needs an optimizer; this critic was built with optimizer=None")
        batch, dummy = self._select_update_batch(data)
        result, skipped, num_mini_batches = self._run_mini_batches(
            batch, lambda mini_batch: self._update_mini_batch(mini_batch, dummy)
        )
        result["critic/lr"] = float(self.critic_optimizer.param_groups[0]["lr"])
        result["critic/skipped_steps"] = float(skipped)
        result["critic/num_mini_batches"] = float(num_mini_batches)
        return result

    def _update_mini_batch(self, mini_batch: TensorDict, dummy: TensorDict) -> dict[str, float]:
        """Accumulate the mini-batch gradient over its micro-batches and take one optimizer step."""
        s = self.settings
        mode = s.loss_agg_mode
        local_norm = local_loss_normalizer(mini_batch["response_mask"], mode).to(self.device)
        global_norm = self._all_reduce_sum(local_norm.clone().reshape(1))[0]
        count_key = "global_token_count" if grad_acc_mode(mode) == "token" else "global_seq_count"
        seqlens = mini_batch["attention_mask"].sum(dim=-1)
        micro_rows = self._micro_batch_rows(
            seqlens, bool(s.use_dynamic_bsz), int(s.ppo_micro_batch_size_per_gpu or 1), int(s.ppo_max_token_len_per_gpu)
        )

        self.critic_optimizer.zero_grad(set_to_none=True)
        stats = torch.zeros(len(_STAT_NAMES), dtype=torch.float32, device=self.device)
        for index, micro, plan in self._device_micro_batches(mini_batch, micro_rows, dummy):
            stats += self._micro_batch_backward(micro, {count_key: global_norm}, zero_weight=index is None, plan=plan)

        if self.dp_size > 1 and not self.is_fsdp:
            self._all_reduce_mean_grads()
        params = [p for p in self.critic_module.parameters() if p.requires_grad]
        grad_norm = clip_grad_norm(params, s.grad_clip)
        skipped = not math.isfinite(grad_norm)
        if skipped:
            logger.warning("critic: grad norm is %s; skipping this optimizer step", grad_norm)
        else:
            self.critic_optimizer.step()
        self.critic_optimizer.zero_grad(set_to_none=True)

        values = dict(zip(_STAT_NAMES, self._all_reduce_sum(stats).tolist()))
        tokens = max(values["tokens"], 1.0)
        return {
            "critic/vf_loss": values["vf_loss"],
            "critic/vf_clipfrac": values["vf_clipfrac"] / tokens,
            "critic/vpred_mean": values["vpred_sum"] / tokens,
            "critic/grad_norm": grad_norm,
            "skipped": float(skipped),
        }

    def _micro_batch_backward(
        self, micro: TensorDict, norm_kwargs: dict[str, torch.Tensor], zero_weight: bool, plan: HostPlan
    ) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns its contribution to the ``_STAT_NAMES`` sums."""
        s = self.settings
        mask = micro["response_mask"]
        vpreds = self._forward(micro, plan)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds,
            micro["returns"].float(),
            micro["values"].float(),
            mask,
            float(s.cliprange_value),
            loss_agg_mode=s.loss_agg_mode,
            **norm_kwargs,
        )
        loss = vf_loss * 0.0 if zero_weight else vf_loss
        (loss * self.dp_size).backward()  # FSDP (or the manual all-reduce) averages gradients over ranks
        if zero_weight:
            return torch.zeros(len(_STAT_NAMES), dtype=torch.float32, device=self.device)
        tokens = mask.to(torch.float32).sum()
        vpred_sum = (vpreds.detach() * mask.to(vpreds.dtype)).sum()
        return torch.stack([vf_loss.detach().float(), vf_clipfrac.float() * tokens, vpred_sum.float(), tokens])

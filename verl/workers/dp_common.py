"""Data-parallel mechanics shared by the actor and the critic.

Both split this rank's rows into mini-batches and micro-batches whose counts agree across ranks
(so FSDP collectives line up; a rank with fewer rows runs zero-weight dummy passes), reduce
statistics over the data-parallel group, and average gradients for replicated (non-FSDP) modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from verl.protocol import DataProto
from verl.utils.fsdp_utils import is_fsdp2_module
from verl.utils.seqlen_balancing import rearrange_micro_batches, split_rows_evenly, sync_max_count
from verl.utils.torch_functional import host_to_device

if TYPE_CHECKING:  # the actor package imports this module
    from verl.workers.actor.forward import HostPlan

# Tensors a forward pass reads; every other tensor of a dummy row is zeroed.
FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
# Row flags: ``no_padding_mask`` (False = padding row, the original's key) and ``is_padding`` (ours).
KEEP_ROW_KEY, PADDING_ROW_KEY = "no_padding_mask", "is_padding"
# Optional per-row tensor: global mini-batch index assigned by the driver. With it, a mini-batch is the
# union of its rows on all ranks, so results do not depend on how rows were spread across ranks.
MINI_BATCH_ID_KEY = "mini_batch_id"


class DataParallelComponent:
    """Base of :class:`DataParallelPPOActor` and :class:`DataParallelPPOCritic`.

    Subclasses set ``self.settings`` (with ``train_batch_size`` and ``ppo_mini_batch_size``) and call
    ``super().__init__(module, dp_group)``.
    """

    # what each micro-batch's host plan prepares beyond packing (``_host_plan``); the actor may turn them on
    use_fused_kernels = False
    share_prompts = False

    def __init__(self, module: nn.Module, dp_group: Optional[dist.ProcessGroup] = None):
        self.module = module
        self.dp_group = dp_group
        distributed = dist.is_available() and dist.is_initialized()
        self.dp_size = dist.get_world_size(dp_group) if distributed else 1
        self.is_fsdp = is_fsdp2_module(module)
        self._update_calls = 0
        # Metrics of each optimizer step of the last update call (for debugging and tests).
        self.mini_batch_metrics: list[dict[str, float]] = []

    @property
    def device(self) -> torch.device:
        """Device of the module's (local shards of) parameters; collectives and compute run there."""
        for param in self.module.parameters():
            return param.device
        return torch.device("cpu")

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.dp_group)
        return tensor

    def _micro_batches(
        self, batch: TensorDict, use_dynamic: bool, micro_batch_size: int, max_token_len: int
    ) -> list[list[int]]:
        """Row-index lists of the micro-batches of ``batch`` (``_micro_batch_rows`` of its row lengths; the actor
        keeps rows sharing a prompt together)."""
        seqlens = batch["attention_mask"].sum(dim=-1)
        return self._micro_batch_rows(seqlens, use_dynamic, micro_batch_size, max_token_len)

    def _forward_micro_batches(
        self, batch: TensorDict, use_dynamic: bool, micro_batch_size: int, max_token_len: int
    ) -> Iterator[tuple[Optional[torch.Tensor], TensorDict, HostPlan]]:
        """The no-grad passes' micro-batches (``compute_log_prob``, ``compute_values``): the rows of ``batch`` with
        a valid token, split by :meth:`_micro_batches`, as ``(their row positions in batch, on the device, or None
        for a dummy pass; micro-batch on the device; its HostPlan)`` (:meth:`_device_micro_batches`)."""
        active = torch.nonzero(batch["attention_mask"].sum(dim=-1) > 0).flatten()  # rows without tokens: skipped
        active_batch = batch[active]
        micro_rows = self._micro_batches(active_batch, use_dynamic, micro_batch_size, max_token_len)
        dummy = self._dummy_row(batch) if batch.batch_size[0] else None
        active_device = host_to_device(active, self.device)
        for index, micro, plan in self._device_micro_batches(active_batch, micro_rows, dummy):
            yield (None if index is None else active_device[index]), micro, plan

    def _device_micro_batches(
        self, batch: TensorDict, micro_rows: list[list[int]], dummy: Optional[TensorDict]
    ) -> Iterator[tuple[Optional[torch.Tensor], TensorDict, HostPlan]]:
        """``(row index on the device or None for a dummy pass, micro-batch on the device, its HostPlan)``.

        Host syncs: ``batch`` goes to the device once and the row indices of all micro-batches in one copy;
        the layout of each micro-batch (packing, valid positions) is computed from host copies of its masks,
        so the device work of a micro-batch does not wait on the device (see ``forward.HostPlan``)."""
        host = batch.select(*FORWARD_KEYS)
        if host["input_ids"].device.type != "cpu":
            host = host.to("cpu")  # one device -> host copy per call, not one per micro-batch
        device_batch = batch.to(self.device)
        flat = torch.tensor([i for rows in micro_rows for i in rows], dtype=torch.long)
        device_index = host_to_device(flat, self.device).split([len(rows) for rows in micro_rows])
        for rows, index in zip(micro_rows, device_index):
            if rows:
                yield index, device_batch[index], self._host_plan(host[torch.tensor(rows, dtype=torch.long)])
            elif dummy is None:
                raise ValueError("got a DataProto with 0 rows while other ranks have data")
            else:  # this rank has fewer micro-batches than another one: keep collectives in step
                yield None, dummy.to(self.device), self._host_plan(dummy.select(*FORWARD_KEYS).to("cpu"))

    def _host_plan(self, host: TensorDict) -> HostPlan:
        """The layout of one micro-batch (``forward.host_plan``) from host copies of its ``FORWARD_KEYS``: packed rows
        under ``settings.use_remove_padding``, the fused head's valid positions and shared prompts where the subclass
        turned ``use_fused_kernels`` / ``share_prompts`` on (the actor)."""
        from verl.workers.actor.forward import host_plan, packed_length_multiple  # the actor package imports us

        return host_plan(
            host["input_ids"],
            host["attention_mask"],
            host["position_ids"],
            host["responses"].shape[-1],
            use_remove_padding=bool(self.settings.use_remove_padding),
            use_fused_kernels=self.use_fused_kernels,
            length_multiple=packed_length_multiple(self.module),
            device=self.device,
            share_prompts=self.share_prompts,
        )

    def _micro_batch_rows(
        self, seqlens: torch.Tensor, use_dynamic: bool, micro_batch_size: int, max_token_len: int
    ) -> list[list[int]]:
        """Row-index lists of the micro-batches (same count on every rank; some may be empty)."""
        if use_dynamic:
            return rearrange_micro_batches(seqlens, max_token_len, dp_group=self.dp_group, device=self.device)
        num_rows = int(seqlens.numel())
        count = sync_max_count(max(1, math.ceil(num_rows / micro_batch_size)), self.dp_group, self.device)
        return [list(range(i * micro_batch_size, min(num_rows, (i + 1) * micro_batch_size))) for i in range(count)]

    @staticmethod
    def _dummy_row(batch: TensorDict) -> TensorDict:
        """A one-row batch with a valid full-length sequence and every loss tensor zero (collective parity)."""
        row = batch[:1].clone()
        seq_len = row["input_ids"].shape[1]
        row["attention_mask"] = torch.ones_like(row["attention_mask"])
        row["position_ids"] = torch.arange(seq_len, device=row["input_ids"].device).unsqueeze(0)
        for key in row.keys():
            if key not in FORWARD_KEYS:
                row[key] = torch.zeros_like(row[key])
        return row

    def _num_mini_batches(self, num_rows: int) -> int:
        """``train_batch_size // ppo_mini_batch_size`` optimizer steps (MemAgent), else ceil(rows / mini)."""
        s: Any = self.settings
        if s.train_batch_size is not None:
            count = int(s.train_batch_size) // int(s.ppo_mini_batch_size)
        else:
            count = max(1, math.ceil(num_rows / int(s.ppo_mini_batch_size)))
        return sync_max_count(count, self.dp_group, self.device)

    def _all_reduce_mean_grads(self) -> None:
        """Average gradients over ranks for an unsharded, replicated module (no FSDP wrapper)."""
        for param in self.module.parameters():
            if param.requires_grad:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.dp_group)
                param.grad.div_(self.dp_size)

    def _select_update_rows(
        self, data: DataProto, keys: list[str], optional: tuple[str, ...], what: str
    ) -> tuple[TensorDict, TensorDict]:
        """The tensors an update needs, without padding rows or rows without tokens, plus a dummy row."""
        available = data.batch.keys() if data.batch is not None else []
        keys = list(keys) + [k for k in (*optional, MINI_BATCH_ID_KEY) if k in available]
        batch = data.select(batch_keys=keys).batch
        if len(batch) == 0:
            raise ValueError(f"{what} got a DataProto with 0 rows")
        dummy = self._dummy_row(batch)
        keep = batch["attention_mask"].sum(dim=-1) > 0
        if KEEP_ROW_KEY in available:
            keep &= data.batch[KEEP_ROW_KEY].bool().reshape(-1)
        if PADDING_ROW_KEY in available:
            keep &= ~data.batch[PADDING_ROW_KEY].bool().reshape(-1)
        return batch[torch.nonzero(keep).flatten()], dummy

    def _run_mini_batches(
        self, batch: TensorDict, step: Callable[[TensorDict], dict[str, float]]
    ) -> tuple[dict[str, float], int, int]:
        """``ppo_epochs`` passes of ``step(mini_batch)`` (one optimizer step each) over this rank's rows.

        Mini-batches are the driver's ``mini_batch_id`` groups when present, else contiguous nearly-equal
        parts (optionally shuffled per epoch). Returns ``(metrics averaged over steps, skipped steps,
        number of mini-batches)``; ``step`` returns its metrics with a ``skipped`` flag.
        """
        s: Any = self.settings
        num_rows = len(batch)
        assigned = MINI_BATCH_ID_KEY in batch.keys()
        if assigned:  # the driver assigned global mini-batches: same optimizer steps for any rank count
            ids = batch[MINI_BATCH_ID_KEY].reshape(-1).long()
            num_mini_batches = sync_max_count(int(ids.max()) + 1 if num_rows else 1, self.dp_group, self.device)
            chunks = [torch.nonzero(ids == m).flatten().tolist() for m in range(num_mini_batches)]
        else:
            num_mini_batches = self._num_mini_batches(num_rows)
            chunks = split_rows_evenly(num_rows, num_mini_batches)
        self.module.train()
        history: dict[str, list[float]] = {}
        skipped = 0
        self.mini_batch_metrics = []
        for epoch in range(int(s.ppo_epochs)):
            order = torch.arange(num_rows)
            if s.shuffle and not assigned:
                generator = torch.Generator().manual_seed(int(s.seed) + 1000003 * self._update_calls + epoch)
                order = torch.randperm(num_rows, generator=generator)
            for chunk in chunks:
                metrics = step(batch[order[torch.tensor(chunk, dtype=torch.long)]])
                self.mini_batch_metrics.append(dict(metrics))
                skipped += int(metrics.pop("skipped"))
                for key, value in metrics.items():
                    history.setdefault(key, []).append(value)
        self._update_calls += 1
        return {key: sum(values) / len(values) for key, values in history.items()}, skipped, num_mini_batches

"""Deterministic, resumable batch sampling for the RL prompt dataloader.

``ResumableSampler`` turns ``dataset_len`` rows into index batches, one epoch at a time. The order of epoch ``e``
depends only on ``(seed, e)``: with ``shuffle=True`` it is ``torch.randperm(dataset_len)`` drawn from a
``torch.Generator`` seeded with ``seed + e``; without shuffling it is ``0, 1, ..., dataset_len - 1``. The
state is two integers, ``{"epoch", "position"}`` (``position`` = batches of ``epoch`` already handed out), so a
run restored from a checkpoint continues with exactly the batches an uninterrupted run would have produced.

``ResumableDataLoader`` wraps ``torch.utils.data.DataLoader`` with that sampler. It counts the batches it has
*handed to the caller* (not those prefetched by worker processes), so ``state_dict()`` is exact even with
``num_workers > 0``. Iterating it yields the rest of the current epoch and then moves to the next epoch; a new
``iter()`` after a ``break`` continues where the previous one stopped (it does not restart the epoch). The
loader never draws from the global torch RNG (worker seeds come from a generator seeded with ``seed + epoch``),
so iterating it does not change the model's random stream.

Typical trainer loop::

    loader = ResumableDataLoader(dataset, batch_size=128, shuffle=True, seed=1, collate_fn=collate_fn)
    if resumed:
        loader.load_state_dict(saved_state)          # e.g. torch.load(ckpt / "data.pt")["dataloader"]
    while loader.epoch < total_epochs:
        for batch in loader:
            ...                                      # loader.state_dict() here = "this batch consumed"
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from verl.utils.process_groups import leave_process_group

__all__ = ["ResumableSampler", "ResumableDataLoader", "train_dataloader"]

# Keys that must agree between a saved state and the sampler loading it (else the batch order would differ).
_CONFIG_KEYS = ("dataset_len", "batch_size", "shuffle", "seed", "drop_last")


class ResumableSampler:
    """Per-epoch deterministic index batches with an ``{epoch, position}`` state.

    Args:
        dataset_len: number of rows (> 0).
        batch_size: rows per batch (> 0).
        shuffle: permute the rows each epoch (``torch.Generator`` seeded with ``seed + epoch``).
        seed: base seed of the permutations.
        drop_last: drop the final incomplete batch of each epoch (verl drops it for training).

    Iterating yields the remaining batches (lists of ints) of the current epoch and advances the state as each
    batch is handed out; when the epoch is exhausted the state moves to ``(epoch + 1, 0)``.
    """

    def __init__(
        self, dataset_len: int, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> None:
        if int(dataset_len) <= 0:
            raise ValueError(f"ResumableSampler: dataset_len must be > 0, got {dataset_len}")
        if int(batch_size) <= 0:
            raise ValueError(f"ResumableSampler: batch_size must be > 0, got {batch_size}")
        self.dataset_len = int(dataset_len)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        if len(self) == 0:
            raise ValueError(
                f"ResumableSampler: dataset_len={self.dataset_len} < batch_size={self.batch_size} with "
                "drop_last=True gives 0 batches per epoch; lower the batch size or set drop_last=False"
            )
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Batches per (full) epoch."""
        if self.drop_last:
            return self.dataset_len // self.batch_size
        return -(-self.dataset_len // self.batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        """Row order of ``epoch`` (a permutation of ``range(dataset_len)``)."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        generator = torch.Generator()
        generator.manual_seed(self.seed + int(epoch))
        return torch.randperm(self.dataset_len, generator=generator).tolist()

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All index batches of ``epoch``, in order."""
        order = self.epoch_order(epoch)
        return [order[i * self.batch_size : (i + 1) * self.batch_size] for i in range(len(self))]

    def _roll_over_finished_epoch(self) -> None:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0

    def remaining_batches(self) -> list[list[int]]:
        """The batches of the current epoch not handed out yet (the next epoch's if this one is exhausted)."""
        self._roll_over_finished_epoch()
        return self.epoch_batches(self.epoch)[self.position :]

    def advance(self) -> None:
        """Record that one more batch of the current epoch was handed out."""
        self.position += 1

    def finish_epoch(self) -> None:
        """Move to the start of the next epoch (called when an iteration reaches the end of the epoch)."""
        self.position = len(self)
        self._roll_over_finished_epoch()

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.remaining_batches():
            self.advance()  # before yielding: state_dict() taken after receiving a batch counts it as consumed
            yield batch
        self.finish_epoch()

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch``."""
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position"}`` (an exhausted epoch reads as the start of the next one) plus the settings
        that determine the order (checked by ``load_state_dict``)."""
        epoch, position = (self.epoch + 1, 0) if self.position >= len(self) else (self.epoch, self.position)
        state: dict[str, Any] = {"epoch": epoch, "position": position}
        state.update({key: getattr(self, key) for key in _CONFIG_KEYS})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``{"epoch", "position"}``. Raises ``ValueError`` when the saved settings (dataset length,
        batch size, shuffle, seed, drop_last) differ from this sampler's: the batches would not match."""
        for key in ("epoch", "position"):
            if key not in state:
                raise ValueError(f"sampler state is missing '{key}' (got keys {sorted(state)})")
        mismatched = [
            f"{key}: saved {state[key]!r}, now {getattr(self, key)!r}"
            for key in _CONFIG_KEYS
            if key in state and state[key] != getattr(self, key)
        ]
        if mismatched:
            raise ValueError(
                "cannot resume the dataloader, its settings changed since the checkpoint ("
                + "; ".join(mismatched)
                + ")"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self):
            raise ValueError(
                f"invalid sampler state epoch={epoch}, position={position} (batches per epoch: {len(self)})"
            )
        self.epoch, self.position = epoch, position
        self._roll_over_finished_epoch()


def _init_worker(worker_init_fn: Optional[Callable[[int], Any]], worker_id: int) -> None:
    """A data-loader worker's ``worker_init_fn``: leave the trainer's process group (``verl/utils/process_groups.py``:
    the trainer finishes its step on SIGTERM, which needs its workers alive), then ``worker_init_fn`` if given."""
    leave_process_group()
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


class ResumableDataLoader:
    """``torch.utils.data.DataLoader`` over a ``ResumableSampler``, with ``state_dict``/``load_state_dict``.

    ``len(loader)`` is the number of batches per epoch; ``loader.epoch`` the epoch the next batch belongs to.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Optional[Callable[[list[Any]], Any]] = None,
        drop_last: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        **dataloader_kwargs: Any,
    ) -> None:
        for key in ("sampler", "batch_sampler", "generator"):
            if key in dataloader_kwargs:
                raise ValueError(f"ResumableDataLoader sets '{key}' itself; do not pass it")
        self.dataset = dataset
        self.sampler = ResumableSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.collate_fn = collate_fn
        self.num_workers = int(num_workers)
        self.pin_memory = pin_memory
        self.dataloader_kwargs = dataloader_kwargs

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    @property
    def epoch(self) -> int:
        """Epoch of the next batch (an exhausted epoch counts as finished)."""
        return self.sampler.state_dict()["epoch"]

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        batches = self.sampler.remaining_batches()
        generator = torch.Generator()
        generator.manual_seed(self.sampler.seed + self.sampler.epoch)  # worker seeds; keeps global RNG untouched
        kwargs = dict(self.dataloader_kwargs)
        if self.num_workers > 0:  # workers out of the trainer's process group: a SIGTERM to it is the trainer's alone
            kwargs["worker_init_fn"] = functools.partial(_init_worker, kwargs.get("worker_init_fn"))
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=batches,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            generator=generator,
            **kwargs,
        )
        for batch in loader:
            self.sampler.advance()
            yield batch
        self.sampler.finish_epoch()

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch``."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The sampler state: ``{"epoch", "position", ...}`` (batches handed to the caller so far)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()`` (see ``ResumableSampler.load_state_dict``)."""
        self.sampler.load_state_dict(state)


def train_dataloader(dataset: Any, data_cfg: Any, collate_fn: Optional[Callable[[list[Any]], Any]] = None):
    """The trainer's training loader from the ``data`` section: ``gen_batch_size`` prompts per batch (null:
    ``train_batch_size``; DAPO draws generation batches until ``train_batch_size`` groups survive its filter),
    ``shuffle``, ``seed`` and ``dataloader_num_workers`` worker processes (0 = load in the trainer's process;
    resuming stays exact either way, see ``ResumableDataLoader``). ``data_cfg``: the typed ``DataConfig``, a
    DictConfig or a dict (absent keys take the YAML's defaults)."""
    from verl.trainer.config.data import DataConfig

    data = DataConfig.from_config(data_cfg)  # ConfigError (a ValueError) naming data.<key> for a bad value
    return ResumableDataLoader(
        dataset,
        batch_size=data.gen_batch_size or data.train_batch_size,
        shuffle=data.shuffle,
        seed=data.seed,
        collate_fn=collate_fn,
        num_workers=data.dataloader_num_workers,
    )

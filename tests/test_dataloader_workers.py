"""``data.dataloader_num_workers``: the trainer's training loader (``train_dataloader``, called by ``main_ppo``)
loads rows in that many worker processes, and resuming from its state still yields the uninterrupted batches."""

from __future__ import annotations

import os

import pytest
import torch

from tests.test_config import compose_config
from verl.utils.dataset.sampler import train_dataloader


class PidDataset(torch.utils.data.Dataset):
    """Row ``i`` is ``(i, pid of the process that loaded it)``."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict:
        return {"row": i, "pid": os.getpid()}


def collate(rows: list[dict]) -> dict:
    return {"rows": [r["row"] for r in rows], "pids": {r["pid"] for r in rows}}


def data_section(*overrides: str):
    return compose_config(["data.train_batch_size=3", "data.seed=4", *overrides]).data


def test_rows_load_in_the_configured_worker_processes():
    loader = train_dataloader(PidDataset(), data_section("data.dataloader_num_workers=2"), collate)
    assert loader.num_workers == 2 and loader.batch_size == 3 and len(loader) == 4
    pids = set().union(*(batch["pids"] for batch in loader))
    assert os.getpid() not in pids and len(pids) == 2
    inline = train_dataloader(PidDataset(), data_section("data.dataloader_num_workers=0"), collate)
    assert set().union(*(batch["pids"] for batch in inline)) == {os.getpid()}
    # the YAML default is the original trainer's 8
    assert train_dataloader(PidDataset(), data_section(), collate).num_workers == 8


def test_resume_with_workers_is_exact():
    cfg = data_section("data.dataloader_num_workers=2")
    uninterrupted, loader = [], train_dataloader(PidDataset(), cfg, collate)
    while loader.epoch < 2:
        uninterrupted.extend(batch["rows"] for batch in loader)
    first = train_dataloader(PidDataset(), cfg, collate)
    it = iter(first)
    head = [next(it)["rows"] for _ in range(3)]  # the workers have prefetched more than they handed out
    state = first.state_dict()
    del it
    resumed = train_dataloader(PidDataset(), cfg, collate)
    resumed.load_state_dict(state)
    tail = []
    while resumed.epoch < 2:
        tail.extend(batch["rows"] for batch in resumed)
    assert head + tail == uninterrupted and len(uninterrupted) == 8


@pytest.mark.parametrize("bad", [-1, "two", None])
def test_bad_worker_count_is_named(bad):
    with pytest.raises(ValueError, match="data.dataloader_num_workers must be an integer >= 0"):
        train_dataloader(PidDataset(), {"train_batch_size": 3, "dataloader_num_workers": bad}, collate)

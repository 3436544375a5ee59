"""``tests.rank_processes.spawn``, the multi-rank tests' launcher: each rank is its own process that gets the
caller's environment and working directory of the moment of the call (not the forkserver's), and a rank's
exception fails the call, as with ``torch.multiprocessing.spawn``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.rank_processes import spawn

MARK = "RANK_PROCESSES_TEST_MARK"


def _report(rank: int, out_dir: str, fail_rank: int) -> None:
    if rank == fail_rank:
        raise ValueError(f"rank {rank} failed on purpose")
    record = {"pid": os.getpid(), "cwd": os.getcwd(), "mark": os.environ.get(MARK)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def test_ranks_are_processes_with_the_callers_environment_and_directory(tmp_path, monkeypatch):
    (tmp_path / "warm").mkdir()
    spawn(_report, args=(str(tmp_path / "warm"), -1), nprocs=1)  # the session's forkserver is up before the changes
    monkeypatch.setenv(MARK, "set-after-the-forkserver-started")
    monkeypatch.chdir(tmp_path)
    spawn(_report, args=(str(tmp_path), -1), nprocs=2)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len({r["pid"] for r in records} | {os.getpid()}) == 3
    assert {r["cwd"] for r in records} == {str(tmp_path)}
    assert {r["mark"] for r in records} == {"set-after-the-forkserver-started"}


def test_a_failing_rank_fails_the_call(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 failed on purpose"):
        spawn(_report, args=(str(tmp_path), 1), nprocs=2)
    assert not (tmp_path / "rank1.json").exists()

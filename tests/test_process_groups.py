"""``verl/utils/process_groups.py``: the trainer's helper processes (a local Ray instance, data-loader workers, the
rollout engine's own process) live in process groups of their own, so that a signal sent to the launching command's
group reaches the driver only. Process groups are read with ``os.getpgid``; the trainer-level check (a SIGTERM to
the whole group still lets the step finish and checkpoint) is in ``test_trainer_signals.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl.utils.dataset.sampler import ResumableDataLoader

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(os.name != "posix", reason="process groups are POSIX")

# started as a child of the test process (in its group, not its leader), or as the leader of a new session
PROBE = """
import json, os, subprocess, sys
from verl.utils.process_groups import children_in_their_own_group
before = os.getpgrp()
with children_in_their_own_group():
    inside = os.getpgrp()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
after = os.getpgrp()
try:
    print(json.dumps({"pid": os.getpid(), "before": before, "inside": inside, "after": after,
                      "child": os.getpgid(child.pid)}))
finally:
    child.kill()
"""


def _probe(**popen_kwargs) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60, check=True, **popen_kwargs
    )
    return json.loads(out.stdout)


def test_children_started_in_the_block_get_a_group_of_their_own_and_the_process_returns_to_its_group():
    seen = _probe()
    assert seen["before"] == os.getpgrp()  # the probe shares the test's group and does not lead it
    assert seen["inside"] == seen["pid"]  # a new group, led by the probe, for the block
    assert seen["child"] == seen["pid"] != seen["before"]  # the child started inside stays in that group
    assert seen["after"] == seen["before"]  # the probe itself is back in its group: signals to it still reach it


def test_a_group_leader_keeps_its_children_in_its_group():
    """Nothing to do for a process that leads its group (a session leader here): no error, children share it."""
    seen = _probe(start_new_session=True)
    assert seen["before"] == seen["inside"] == seen["after"] == seen["pid"] == seen["child"]


class _Groups:
    """Items are the process group of the process that loads them."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return os.getpgrp() * 10 + int(os.environ.get("INIT_FN_RAN", "0"))


def _mark_init(worker_id: int) -> None:
    os.environ["INIT_FN_RAN"] = "1"


def test_data_loader_workers_leave_the_trainers_group_and_still_run_the_users_init_fn():
    own = os.getpgrp()
    in_process = ResumableDataLoader(_Groups(), batch_size=2, shuffle=False, collate_fn=list)
    assert [x for b in in_process for x in b] == [own * 10] * 4  # num_workers=0: loaded here, nothing changes
    loader = ResumableDataLoader(
        _Groups(), batch_size=2, shuffle=False, collate_fn=list, num_workers=1, worker_init_fn=_mark_init
    )
    seen = [x for b in loader for x in b]
    assert len(set(seen)) == 1
    group, init_ran = divmod(seen[0], 10)
    assert group != own  # the worker's own group
    assert init_ran == 1  # the user's worker_init_fn ran after it

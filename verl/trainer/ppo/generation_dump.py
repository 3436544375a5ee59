"""``trainer.rollout_data_dir`` and ``trainer.validation_data_dir``: a step's generations as JSON lines.

Upstream verl writes ``<dir>/<step>.jsonl`` with one line per rollout row: ``input`` (the decoded prompt),
``output`` (the decoded response), ``gts`` (the ground truth), ``score`` and ``step``. The same file here holds
one line per conversation, with the multi-turn fields a memory agent's rollout needs to be read back:

* ``trajectory``: the trajectory's index in the step (``sample_index``); ``uid``: its question group;
* ``turn``: the conversation's place in its trajectory (0 = the first memory update); ``final``: the answer turn;
* ``score``: the trajectory's score (the one the advantage was computed from), on every one of its conversations;
* ``data_source``.

A single-turn rollout is the case of one conversation per trajectory (``turn`` 0, ``final`` true). Training
rollouts are written once per step (``<step>.jsonl``), validation generations once per validation (``<step>.jsonl``
with the step it ran after, 0 before training). Special tokens are dropped from the text, as upstream does. A
file is written whole, through a temporary file and a rename, so a run stopped mid-write leaves no half file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto
from verl.utils.conversation_batch import decode_rows

__all__ = ["generation_records", "ground_truth", "write_generations"]


def ground_truth(non_tensors: dict[str, Any], row: int) -> Any:
    """Row ``row``'s ``reward_model["ground_truth"]`` (None without one)."""
    reward_model = non_tensors["reward_model"][row] if "reward_model" in non_tensors else None
    return reward_model.get("ground_truth") if isinstance(reward_model, dict) else None


def _listed(value: Any) -> Any:
    """A numpy array (a parquet list column) as a list, for JSON; other values as they are."""
    return value.tolist() if isinstance(value, np.ndarray) else value


def generation_records(
    tokenizer: Any,
    conversations: DataProto,
    sample_index: torch.Tensor,
    final_mask: torch.Tensor,
    trajectories: DataProto,
    scores: torch.Tensor,
    step: int,
    first_trajectory: int = 0,
) -> list[dict[str, Any]]:
    """One record per conversation (module docstring). ``trajectories`` holds one row per trajectory
    (``uid``, ``data_source``, ``reward_model`` where present); ``scores`` [T] one score per trajectory;
    ``first_trajectory`` numbers them on from an earlier batch (a validation's later batches)."""
    b = conversations.batch
    width = b["prompts"].shape[1]
    inputs = decode_rows(tokenizer, b["prompts"], b["attention_mask"][:, :width])
    outputs = decode_rows(tokenizer, b["responses"], b["attention_mask"][:, width:])
    nt = trajectories.non_tensor_batch
    index = [int(i) for i in sample_index.tolist()]
    last = max(index, default=-1)
    if len(scores) != len(trajectories) or last >= len(trajectories):
        raise ValueError(
            f"{len(trajectories)} trajectories and {len(scores)} scores for conversations of trajectories 0..{last}"
        )
    turns: dict[int, int] = {}
    records = []
    for traj, text_in, text_out, final in zip(index, inputs, outputs, final_mask.tolist()):
        turn = turns.get(traj, 0)
        turns[traj] = turn + 1
        record = {
            "input": text_in,
            "output": text_out,
            "gts": _listed(ground_truth(nt, traj)),
            "score": float(scores[traj]),
            "step": int(step),
            "trajectory": first_trajectory + traj,
            "turn": turn,
            "final": bool(final),
        }
        for key in ("uid", "data_source"):
            if key in nt:
                record[key] = str(nt[key][traj])
        records.append(record)
    return records


def write_generations(directory: str | os.PathLike, step: int, records: Sequence[dict[str, Any]]) -> Path:
    """Write ``records`` to ``<directory>/<step>.jsonl`` (replacing it: a resumed run rewrites the step it redoes)."""
    folder = Path(directory).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{int(step)}.jsonl"
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path

"""``verl/trainer/ppo/generation_dump.py``: conversations as JSON lines (``trainer.rollout_data_dir``,
``trainer.validation_data_dir``); the trainers' dumps are checked end to end in test_trainer_e2e.py (memory agent)
and test_critic.py (single turn)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from verl.protocol import DataProto
from verl.trainer.ppo.generation_dump import generation_records, write_generations
from verl.utils.conversation_batch import build_conversation_batch


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _conversations(tok, texts: list[tuple[str, str]]) -> DataProto:
    prompts = [tok.encode(p, add_special_tokens=False) for p, _ in texts]
    responses = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for _, r in texts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return DataProto.from_dict(tensors=build_conversation_batch(prompts, responses, pad))


def test_records_follow_the_trajectories_turn_by_turn(tok, tmp_path):
    # lock step's order: turn 0 of both trajectories, turn 1 of both, then the two final answers
    texts = [("read one", "memo a"), ("read two", "memo b"), ("read three", "memo c")]
    texts += [("read four", "memo d"), ("ask one", "alpha"), ("ask two", "beta")]
    conv = _conversations(tok, texts)
    sample_index = torch.tensor([0, 1, 0, 1, 0, 1])
    final_mask = torch.tensor([False, False, False, False, True, True])
    trajectories = DataProto.from_dict(
        non_tensors={
            "uid": np.array(["q0", "q0"], dtype=object),
            "data_source": np.array(["hotpotqa", "hotpotqa"], dtype=object),
            "reward_model": np.array([{"ground_truth": np.array(["7"])}, {"ground_truth": "x"}], dtype=object),
        }
    )
    records = generation_records(tok, conv, sample_index, final_mask, trajectories, torch.tensor([1.0, 0.0]), 5)
    assert [(r["trajectory"], r["turn"], r["final"]) for r in records] == [
        (0, 0, False),
        (1, 0, False),
        (0, 1, False),
        (1, 1, False),
        (0, 2, True),
        (1, 2, True),
    ]
    assert [(r["input"], r["output"]) for r in records] == texts  # pads and the EOS dropped
    assert [r["score"] for r in records] == [1.0, 0.0] * 3
    assert {(r["uid"], r["data_source"], r["step"]) for r in records} == {("q0", "hotpotqa", 5)}
    path = write_generations(tmp_path, 5, records)
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["gts"] for r in written] == [["7"], "x"] * 3  # arrays become lists (JSON)
    # a validation's later batch numbers its trajectories on from the earlier ones
    later = generation_records(tok, conv, sample_index, final_mask, trajectories, torch.tensor([1.0, 0.0]), 5, 10)
    assert [r["trajectory"] for r in later] == [10, 11] * 3
    with pytest.raises(ValueError, match="2 trajectories and 3 scores for conversations of trajectories 0..1"):
        generation_records(tok, conv, sample_index, final_mask, trajectories, torch.zeros(3), 5)


def test_a_step_file_is_written_whole_and_replaced_on_a_rerun(tmp_path):
    folder = tmp_path / "dumps" / "nested"
    path = write_generations(folder, 3, [{"input": "é", "score": 1.0}, {"input": "b", "score": 0.0}])
    assert path == folder / "3.jsonl"
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == [
        {"input": "é", "score": 1.0},
        {"input": "b", "score": 0.0},
    ]
    write_generations(folder, 3, [{"input": "c"}])  # a resumed run redoes step 3
    assert path.read_text() == '{"input": "c"}\n'
    assert sorted(p.name for p in folder.iterdir()) == ["3.jsonl"]  # no temporary file left

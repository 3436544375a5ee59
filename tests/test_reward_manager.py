"""Reward managers: naive (in process) and thread (per-node Ray actor with a process pool)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from transformers import AutoTokenizer

from recurrent.utils import build_conversation_batch
from verl.protocol import DataProto
from verl.workers.reward_manager import get_reward_manager_cls, load_reward_manager


def _batch(tok, answers, golds):
    resp = [tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for a in answers]
    tensors = build_conversation_batch([[1, 2]] * len(answers), resp, tok.pad_token_id)
    nt = {
        "data_source": np.array(["hotpotqa"] * len(answers), dtype=object),
        "reward_model": np.array([{"style": "rule", "ground_truth": g} for g in golds], dtype=object),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=nt)


def _length_bonus(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(len(solution_str) % 2) + bonus, "length": len(solution_str)}


def test_naive_and_thread_agree(ray_cluster, tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    answers = ["so \\boxed{Paris}", "\\boxed{London}", "no box", "\\boxed{ paris }", "\\boxed{the Paris}"]
    golds = [["Paris"], ["paris", "x"], ["Paris"], ["PARIS"], ["Paris"]]
    data = _batch(tok, answers, golds)
    naive, _ = load_reward_manager("naive", tok)(data)
    thread, _ = load_reward_manager("thread", tok)(data)
    assert naive.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert thread.tolist() == naive.tolist()


def test_thread_custom_fn_extra_info_and_edge_sizes(ray_cluster, tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    mgr = load_reward_manager("thread", tok, compute_score=_length_bonus, bonus=10.0)
    scores, extra = mgr(_batch(tok, ["ab", "abc"], [["x"], ["y"]]))
    assert scores.tolist() == [10.0, 11.0] and extra["length"] == [2, 3]
    one, _ = mgr(_batch(tok, ["a"], [["x"]]))  # fewer requests than workers/actors
    assert one.tolist() == [11.0]


def test_the_reward_actor_process_does_not_import_torch():
    """Ray imports the actor class's module in the actor's process: that module (and ``verl``) import no torch, so a
    reward actor starts without torch's ~3 s; the default verifier it unpickles in its process pool imports none."""
    from verl.utils.reward_actors import RewardActor
    from verl.workers.reward_manager.thread import RewardActorPool

    assert RewardActor.__module__ == RewardActorPool.__module__ == "verl.utils.reward_actors"
    probe = (
        "import sys, verl.utils.reward_actors, verl.utils.reward_score;"
        "loaded = [m for m in ('torch', 'tensordict', 'verl.protocol') if m in sys.modules];"
        "assert not loaded, loaded"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_unknown_manager_named():
    with pytest.raises(ValueError, match="unknown reward_model.reward_manager 'fast'; valid: naive, thread"):
        get_reward_manager_cls("fast")

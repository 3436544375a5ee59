"""``verl/trainer/ppo/rank_spread.py``: rows to data-parallel ranks so that every rank computes part of every
mini-batch (the e2e two-rank runs in test_trainer_e2e.py and test_critic.py check it through Ray)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.rank_spread import spread_metrics, spread_order
from verl.trainer.ppo.trainer_core import mini_batch_ids


def _per_rank(ids: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor, ranks: int):
    """What ``DataProto.chunk`` hands each rank: ``[(mini-batch ids, tokens)]``."""
    data = DataProto.from_dict(tensors={"mini_batch_id": ids[order], "tokens": tokens[order]})
    return [(part.batch["mini_batch_id"], part.batch["tokens"]) for part in data.chunk(ranks)]


@pytest.mark.parametrize("rows,ranks", [(2048, 8), (37, 4), (16, 8), (5, 3), (40, 2)])
@pytest.mark.parametrize("by_tokens", [True, False])
def test_every_rank_gets_an_equal_share_of_every_mini_batch(rows, ranks, by_tokens):
    ids = mini_batch_ids(rows, 128, 8)  # 16 mini-batches of contiguous rows (fewer when there are fewer rows)
    tokens = torch.randint(50, 7000, (rows,), generator=torch.Generator().manual_seed(rows))
    order = spread_order(ids, tokens, ranks, by_tokens)
    assert sorted(order.tolist()) == list(range(rows))  # a permutation
    counts = torch.stack(
        [torch.bincount(mb, minlength=int(ids.max()) + 1) for mb, _ in _per_rank(ids, tokens, order, ranks)]
    )
    # per mini-batch, the ranks' row counts differ by at most one: no rank idles while a mini-batch has rows for it
    assert int((counts.max(dim=0).values - counts.min(dim=0).values).max()) <= 1
    sizes = torch.bincount(ids)
    assert torch.equal(counts.sum(dim=0), sizes)
    assert int((counts == 0).sum()) == int(sum(max(ranks - int(s), 0) for s in sizes))


def test_contiguous_rows_put_each_mini_batch_on_one_rank_and_the_spread_fixes_it():
    """The defect it fixes: 16 mini-batches of 128 rows in order over 8 ranks, rank r holds mini-batches 2r and 2r+1
    only, so in every optimizer step one rank computes (max over mean 8) and seven wait (112 idle rank-steps)."""
    ids = mini_batch_ids(2048, 128, 8)
    tokens = torch.randint(100, 7000, (2048,), generator=torch.Generator().manual_seed(0))
    before = spread_metrics(ids, tokens, 8)
    assert before == {"perf/update_rank_tokens_max_over_mean": 8.0, "perf/update_idle_rank_steps": 112.0}
    for by_tokens, bound in ((False, 1.6), (True, 1.08)):
        order = spread_order(ids, tokens, 8, by_tokens)
        after = spread_metrics(ids[order], tokens[order], 8)
        assert after["perf/update_idle_rank_steps"] == 0.0
        assert after["perf/update_rank_tokens_max_over_mean"] < bound, by_tokens


def test_longest_first_snake_dealing_bounds_each_steps_imbalance_by_one_row():
    """With ``by_tokens`` the ranks' tokens in each mini-batch differ by at most the longest row of that mini-batch."""
    ranks = 4
    ids = torch.tensor([0] * 13 + [1] * 9)
    tokens = torch.tensor(
        [5000, 40, 3000, 3100, 900, 60, 2500, 2600, 10, 7000, 30, 800, 1200] + [9, 1, 7, 3, 5, 8, 2, 6, 4]
    )
    order = spread_order(ids, tokens, ranks, by_tokens=True)
    loads = torch.zeros(ranks, 2, dtype=torch.long)
    for rank, (mb, tok) in enumerate(_per_rank(ids, tokens, order, ranks)):
        loads[rank].index_add_(0, mb, tok)
    for m in (0, 1):
        assert int(loads[:, m].max() - loads[:, m].min()) <= int(tokens[ids == m].max())
    # the deal itself: mini-batch 0 sorted 7000, 5000, 3100, 3000 | 2600, 2500, 1200, 900 | 800, 60, 40, 30 | 10
    assert loads[:, 0].tolist() == [7000 + 900 + 800 + 10, 5000 + 1200 + 60, 3100 + 2500 + 40, 3000 + 2600 + 30]
    # the same rows without it, in their order: equal counts, tokens as they come
    plain = spread_order(ids, tokens, ranks, by_tokens=False)
    first = _per_rank(ids, tokens, plain, ranks)[0][1]
    assert first[:4].tolist() == [5000, 2600, 10, 1200]  # rows 0, 7 (the snake's second round), 8, and 12 (spare)


def test_one_rank_or_no_rows_keep_the_order():
    ids, tokens = torch.tensor([0, 0, 1]), torch.tensor([3, 1, 2])
    assert spread_order(ids, tokens, 1, True).tolist() == [0, 1, 2]
    assert spread_order(torch.zeros(0, dtype=torch.long), torch.zeros(0), 4, True).tolist() == []


def test_the_trainer_spreads_by_tokens_only_with_balance_batch():
    """``trainer.balance_batch`` reaches the trainer's dealing: True deals longest first, False in row order."""
    from types import SimpleNamespace

    from tests.test_config import compose_config
    from verl.trainer.ppo.trainer_core import TrainerCore

    ids = torch.tensor([0, 0, 0, 0])
    mask = torch.zeros(4, 10, dtype=torch.long)
    for row, length in enumerate([1, 9, 3, 7]):
        mask[row, :length] = 1
    data = DataProto.from_dict(tensors={"mini_batch_id": ids, "attention_mask": mask})
    orders = {}
    for value in (True, False):
        core = TrainerCore(
            compose_config([f"trainer.balance_batch={value}"]), None, SimpleNamespace(world_size=2), None, None
        )
        metrics: dict[str, float] = {}
        spread, index, flags = core.spread_over_ranks(data, metrics, torch.arange(4), np.array([0, 1, 2, 3]))
        orders[value] = index.tolist()
        assert flags.tolist() == orders[value]  # numpy arrays follow the rows too
        assert torch.equal(spread.batch["attention_mask"], mask[index])
        assert metrics["perf/update_idle_rank_steps"] == 0.0
    assert orders[True] == [1, 0, 3, 2]  # longest first, snake: 9 + 1 tokens to rank 0, 7 + 3 to rank 1
    assert orders[False] == [0, 3, 1, 2]  # in row order, snake: 1 + 7 tokens to rank 0, 9 + 3 to rank 1
    one_rank: dict[str, float] = {}
    core = TrainerCore(compose_config([]), None, SimpleNamespace(world_size=1), None, None)
    assert core.spread_over_ranks(data, one_rank, index) == (data, index) and one_rank == {}  # untouched


def test_a_mini_batch_holds_every_turn_of_its_questions_trajectories_on_every_rank(monkeypatch):
    """The multi-turn trainer: 2 questions x 2 samples, train_batch_size 2 / ppo_mini_batch_size 1 = 2 optimizer steps.
    Mini-batch 0 is both turns and the final answer of question 0's two trajectories (not the step's first rows, all
    memory turns), and on 2 ranks each rank gets part of both mini-batches."""
    from types import SimpleNamespace

    from tests.test_config import compose_config
    from verl.trainer.ppo.ray_trainer import MultiConvTrainer

    class Sent(Exception):
        pass

    def compute_log_prob(conv):
        raise Sent(conv)

    cfg = compose_config(
        [
            "algorithm.adv_estimator=grpo",
            "recurrent.enable=memory",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        ]
    )
    workflow = SimpleNamespace(
        train_dataset=None, val_dataset=None, build_rollout=lambda client: None, final_response_length=None
    )
    wg = SimpleNamespace(world_size=2, sleep_rollout=lambda: None, compute_log_prob=compute_log_prob)
    trainer = MultiConvTrainer(cfg, None, wg, workflow, None, None)
    # lock step's rows: turn 0 of trajectories 0-3, turn 1 of 0-3, then the 4 final answers
    sample_index = torch.tensor([0, 1, 2, 3] * 3)
    final_mask = torch.tensor([False] * 8 + [True] * 4)
    lengths = torch.tensor([9, 8, 7, 6, 9, 8, 7, 6, 3, 3, 2, 2])
    mask = (torch.arange(10) < lengths.unsqueeze(1)).long()
    conv = DataProto.from_dict(tensors={"attention_mask": mask, "response_mask": mask[:, -3:], "row": torch.arange(12)})
    traj = DataProto.from_dict(tensors={"x": torch.zeros(4, 1)}, non_tensors={"uid": np.array(["a", "a", "b", "b"])})
    rollout = (traj, conv, final_mask, sample_index, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    monkeypatch.setattr(trainer, "collect_rollouts", lambda *a: rollout)
    with pytest.raises(Sent) as seen:
        trainer.train_step(None)
    sent = seen.value.args[0]
    rows, ids = sent.batch["row"], sent.batch["mini_batch_id"]
    assert sorted(rows.tolist()) == list(range(12))
    assert torch.equal(ids, sample_index[rows] // 2)  # trajectories 0-1 (question a): 0; 2-3 (question b): 1
    for part in sent.chunk(2):  # what each rank gets
        assert sorted(set(part.batch["mini_batch_id"].tolist())) == [0, 1]


def test_the_benchmark_runs_the_three_orders_through_a_ray_worker_group(ray_cluster, tmp_path):
    """``benchmarks/bench_rank_spread.py`` on 2 CPU ranks with the tiny model: the in-order rows leave each rank
    idle in one of the two optimizer steps, the dealt ones in none."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_rank_spread

    out = tmp_path / "spread.json"
    args = ["--shape", "tiny", "--trajectories", "4", "--chunks", "2", "--chunk", "32", "--memory", "8"]
    args += ["--final-len", "4", "--question-len", "8", "--mini-batches", "2", "--rounds", "1", "--out", str(out)]
    assert bench_rank_spread.main(args) == 0
    report = json.loads(out.read_text())
    assert report["conversations"] == 12 and list(report["results"]) == ["contiguous", "spread_rows", "spread_tokens"]
    results = report["results"]
    assert results["contiguous"]["perf/update_idle_rank_steps"] == 2  # 2 mini-batches of 6 rows: one rank each
    assert results["spread_rows"]["perf/update_idle_rank_steps"] == 0
    assert results["spread_tokens"]["perf/update_idle_rank_steps"] == 0
    assert results["contiguous"]["speedup_vs_contiguous"] == 1.0
    assert all(r["median_s"] > 0 and len(r["seconds"]) == 1 for r in results.values())

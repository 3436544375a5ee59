"""The log-prob passes use their own micro-batch budgets (verl semantics).

``actor_rollout_ref.rollout.log_prob_*`` micro-batches the old-log-prob pass (``compute_log_prob``) and
``actor_rollout_ref.ref.log_prob_*`` the reference pass (``compute_ref_log_prob``); the actor's
``ppo_micro_batch_size_per_gpu`` stays the update's, and is the fallback when a ``log_prob_*`` size is null.
Checked on one in-process CPU worker (tiny Qwen2 model, padded forwards): the rows of every forward call of
each pass follow the keys, and the log-probs do not change with them.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_config import compose_config
from tests.test_dp_actor import make_update_data
from verl.utils.model_loading import load_causal_lm

NUM_ROWS = 8


@pytest.fixture(scope="module")
def data(tiny_model_path):
    model = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
    return make_update_data(model, num_conv=NUM_ROWS, seed=5)


def build_worker(monkeypatch, model_path, *overrides: str):
    import verl.workers.rollout.base as rollout_base
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kwargs: None)
    cfg = compose_config(
        [
            f"actor_rollout_ref.model.path={model_path}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.model.attn_implementation=sdpa",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.train_batch_size=1",
            *overrides,
        ]
    )
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, "cpu")
    worker.init_model()
    return worker


def forward_calls(module: torch.nn.Module, run) -> tuple[list[tuple[int, int]], object]:
    """``(rows, valid tokens)`` of each forward call of ``module`` while ``run()`` runs, and its result."""
    calls: list[tuple[int, int]] = []

    def hook(_module, _args, kwargs):
        calls.append((int(kwargs["input_ids"].shape[0]), int(kwargs["attention_mask"].sum())))

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        result = run()
    finally:
        handle.remove()
    return calls, result


def old_and_ref_passes(worker, data):
    old_calls, old = forward_calls(worker.actor_module, lambda: worker.compute_log_prob(data))
    ref_calls, ref = forward_calls(worker.ref.actor_module, lambda: worker.compute_ref_log_prob(data))
    return old_calls, old.batch["old_log_probs"], ref_calls, ref.batch["ref_log_prob"]


def rows_of(calls: list[tuple[int, int]]) -> list[int]:
    return [rows for rows, _ in calls]


def test_rollout_and_ref_log_prob_budgets_drive_their_passes(monkeypatch, tiny_model_path, data):
    # defaults: both passes fall back to the actor's ppo_micro_batch_size_per_gpu=2
    worker = build_worker(monkeypatch, tiny_model_path)
    old_calls, old_default, ref_calls, ref_default = old_and_ref_passes(worker, data)
    assert rows_of(old_calls) == [2, 2, 2, 2] and rows_of(ref_calls) == [2, 2, 2, 2]

    # rollout.* sizes the old-log-prob pass, ref.* the reference pass; the actor's update keeps its own 2
    worker = build_worker(
        monkeypatch,
        tiny_model_path,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3",
    )
    old_calls, old_log_probs, ref_calls, ref_log_probs = old_and_ref_passes(worker, data)
    assert rows_of(old_calls) == [4, 4]
    assert rows_of(ref_calls) == [3, 3, 2]
    assert worker.actor.settings.ppo_micro_batch_size_per_gpu == 2
    torch.testing.assert_close(old_log_probs, old_default, atol=1e-6, rtol=0)
    torch.testing.assert_close(ref_log_probs, ref_default, atol=1e-6, rtol=0)

    # token budgets: rollout.log_prob_use_dynamic_bsz + log_prob_max_token_len_per_gpu (ref: its own budget)
    seqlens = data.batch["attention_mask"].sum(-1)
    budget = int(seqlens.max())
    worker = build_worker(
        monkeypatch,
        tiny_model_path,
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={2 * budget}",
    )
    old_calls, old_log_probs, ref_calls, ref_log_probs = old_and_ref_passes(worker, data)
    # upstream's count, ceil(total tokens / budget); a micro-batch over its budget by less than one row (the
    # longest row is <= budget here) only where no partition into that count fits (verl/utils/seqlen_balancing.py)
    assert all(tokens < 2 * budget for _, tokens in old_calls)
    assert all(tokens < 3 * budget for _, tokens in ref_calls)
    assert sum(rows_of(old_calls)) == sum(rows_of(ref_calls)) == NUM_ROWS
    minimum = -(-int(seqlens.sum()) // budget)  # ceil(total tokens / budget)
    assert len(old_calls) == minimum > 2  # more micro-batches than a fixed size of 4 would give
    assert len(ref_calls) == -(-int(seqlens.sum()) // (2 * budget))
    assert len(ref_calls) < len(old_calls)
    assert worker.actor.settings.use_dynamic_bsz is False  # the update's batching is untouched
    torch.testing.assert_close(old_log_probs, old_default, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref_log_probs, ref_default, atol=1e-5, rtol=0)

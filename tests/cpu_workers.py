"""An actor/rollout/ref worker and a critic worker built on CPU from config overrides, for tests that check what the
workers load (the rollout engine is not built)."""

from __future__ import annotations

from pathlib import Path


def build_cpu_workers(monkeypatch, model_path: Path, overrides: list[str]):
    """``(actor, critic)``: ``ActorRolloutRefWorker`` and ``CriticWorker`` on ``cpu`` with ``init_model()`` done, both
    models from ``model_path``, the HF rollout (its engine replaced by ``None``) and ``overrides`` on top."""
    import verl.workers.rollout.base as rollout_base
    from tests.test_config import compose_config
    from verl.workers.critic.critic_worker import CriticWorker
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kwargs: None)
    cfg = compose_config(
        [
            f"actor_rollout_ref.model.path={model_path}",
            f"critic.model.path={model_path}",
            "actor_rollout_ref.rollout.name=hf",
            *overrides,
        ]
    )
    actor = ActorRolloutRefWorker(cfg.actor_rollout_ref, "cpu")
    actor.init_model()
    critic = CriticWorker(cfg.critic, "cpu")
    critic.init_model()
    return actor, critic

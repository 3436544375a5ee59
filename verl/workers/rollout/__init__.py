"""Rollout engines: token-in/token-out generation behind one async interface.

``get_rollout_engine("vllm" | "hf", **kwargs)`` builds the engine named by
``actor_rollout_ref.rollout.name``. Importing this package does not import vLLM.
"""

from verl.workers.rollout.base import (
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    get_rollout_engine,
    register_rollout_engine,
)

__all__ = [
    "GenerationOutput",
    "RolloutEngine",
    "SamplingParams",
    "get_rollout_engine",
    "register_rollout_engine",
]

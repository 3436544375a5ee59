"""The interface between the multi-turn trainer and an agent workflow package.

The core (``verl/``) defines what a workflow must provide; a workflow package (``recurrent/`` for the
memory agent, or a user's own) implements it. ``verl/`` never imports a workflow package by name: the
entry point loads the provider named by ``recurrent.provider`` (a ``module:function`` string), as it
loads ``custom_reward_function.path``.

A provider is a function ``provider(config, tokenizer) -> MultiTurnWorkflow`` called once at startup.
Each step the trainer hands the workflow's rollout a trajectory-level batch (one row per trajectory)
and gets back the flat batch of conversations it produced::

    conversations, final_mask, sample_index = rollout.run_llm_loop(gen_batch, timing)

* ``conversations``: one row per conversation (verl's ``prompts, responses, input_ids, attention_mask,
  position_ids, response_mask``, optionally ``rollout_log_probs``); ``meta_info`` may carry
  ``kept_sample_index`` (trajectories kept when some failed) and ``metrics`` (workflow metrics);
* ``final_mask`` ``[C]`` bool: True for the trajectory's final-answer conversation (exactly one each);
* ``sample_index`` ``[C]`` long: the trajectory row each conversation belongs to.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from verl.protocol import DataProto

__all__ = ["ConversationRollout", "MultiTurnWorkflow", "WorkflowProvider", "load_workflow_provider"]


class ConversationRollout(Protocol):
    """Drives the rollout engines turn by turn for a batch of trajectories."""

    def run_llm_loop(
        self, gen_batch: DataProto, timing: dict[str, float]
    ) -> tuple[DataProto, torch.Tensor, torch.Tensor]: ...


@dataclass
class MultiTurnWorkflow:
    """Everything the multi-turn trainer needs from a workflow.

    Attributes:
        name: the workflow's name (``recurrent.enable``), for messages.
        train_dataset, val_dataset: map-style datasets whose rows the rollout understands; ``get_batch_keys()``
            returns ``(tensor_keys, non_tensor_keys)`` the rollout needs (the rest stays with the trajectory).
        build_rollout: ``build_rollout(rollout_client) -> ConversationRollout``; ``rollout_client`` is the
            trainer's :class:`verl.trainer.ppo.trainer_core.RolloutClient` (``generate_batch`` + ``wg``).
        final_response_length: token limit of the final answer (DAPO overlong shaping); None = the rollout's
            ``response_length``.
    """

    name: str
    train_dataset: Any
    val_dataset: Any | None
    build_rollout: Callable[[Any], ConversationRollout]
    final_response_length: int | None = None


WorkflowProvider = Callable[[Any, Any], MultiTurnWorkflow]


def load_workflow_provider(spec: str, key: str = "recurrent.provider") -> WorkflowProvider:
    """Import ``module:function``; errors name the config ``key`` and the value."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{key} must be 'module:function', got {spec!r}")
    module_name, func_name = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(f"{key}={spec!r}: cannot import module {module_name!r} ({err})") from err
    provider = getattr(module, func_name, None)
    if not callable(provider):
        raise ValueError(f"{key}={spec!r}: {module_name} has no callable {func_name!r}")
    return provider

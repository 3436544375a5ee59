"""Abstractions of the recurrent (multi-conversation) workflow framework.

A *workflow* is a triple registered under a name:

* a config dataclass (``RConfig`` subclass), built from ``recurrent.<name>.config``;
* a dataset class (``RDataset`` subclass) that turns parquet/json rows into tensors;
* an agent class (``RAgent`` subclass) that decides, turn by turn, which prompts to send to the
  rollout engine, and finally says which conversation belongs to which trajectory.

The sync agent lifecycle, driven by :class:`recurrent.generation_manager.LLMGenerationManager`::

    agent.start(gen_batch, timing_raw)
    while not agent.done():
        prompts, meta = agent.action()      # list of 1-D LongTensors + generation meta-info
        out = engine(prompts, meta)         # DataProto with prompts/responses/...
        out = agent.update(out)             # may post-process; what it returns is trained on
    final_mask, sample_index = agent.end()  # one entry per conversation, in generation order
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl.protocol import DataProto

logger = logging.getLogger(__name__)


@dataclass
class RConfig:
    """Marker base class for workflow configs (``config_cls(**recurrent.<name>.config)``)."""


class RAgent(ABC):
    """A synchronous, tensor-level agent driving many trajectories in lock-step.

    Subclasses append, in :meth:`action`, one entry per emitted prompt to ``self.sample_index_list``
    (the trajectory row the conversation belongs to) and ``self.final_mask_list`` (True for the
    trajectory's final-answer conversation); :meth:`end` concatenates them.
    """

    def __init__(self, tokenizer, config: RConfig):
        self.tokenizer = tokenizer
        self.config = config
        self.sample_index_list: list[torch.Tensor] = []
        self.final_mask_list: list[torch.Tensor] = []

    @abstractmethod
    def start(self, gen_batch: DataProto, timing_raw: dict) -> None:
        """Receive the trajectory-level batch (one row per trajectory)."""

    @abstractmethod
    def action(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Return the next turn's prompts (unpadded 1-D token-id tensors) and generation meta-info.

        Meta-info keys understood by the generation manager: ``generation_kwargs`` (sampling
        parameters for this turn, e.g. ``{"max_tokens": 1024, "n": 1}``).
        """

    @abstractmethod
    def update(self, gen_output: DataProto) -> DataProto:
        """Consume the engine's output for the last :meth:`action`; return what is trained on."""

    @abstractmethod
    def done(self) -> bool:
        """True once the final turn has been generated."""

    def free_running_loops(self, gen_batch: DataProto) -> list[Any] | None:
        """Free-running turns (``actor_rollout_ref.rollout.free_running_turns``,
        :mod:`recurrent.free_running_manager`): one state machine per trajectory of ``gen_batch``, in row order,
        each with ``done``, ``next_request()`` (a :class:`~recurrent.memory_loop.MemoryRequest` of token ids) and
        ``take(response)``, as :class:`~recurrent.memory_loop.MemoryLoop`; ``take`` receives
        :meth:`response_of`'s value. None (this default): the agent runs in lock step only."""
        return None

    def response_of(self, token_ids: list[int], request: Any) -> Any:
        """What a free-running trajectory's state machine takes for the engine's ``token_ids`` answering
        ``request`` (default: the ids as they are)."""
        return list(token_ids)

    def end(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(final_mask [C] bool, sample_index [C] long)`` and reset per-batch state."""
        final_mask = torch.cat(self.final_mask_list).bool()
        sample_index = torch.cat(self.sample_index_list).long()
        self.final_mask_list, self.sample_index_list = [], []
        return final_mask, sample_index


def require_free_running(agent_cls: type) -> None:
    """Raise ``ValueError`` (naming ``actor_rollout_ref.rollout.free_running_turns``) unless ``agent_cls``
    implements :meth:`RAgent.free_running_loops`."""
    if getattr(agent_cls, "free_running_loops", RAgent.free_running_loops) is RAgent.free_running_loops:
        raise ValueError(
            "actor_rollout_ref.rollout.free_running_turns=True needs a sync agent with free_running_loops(); "
            f"{agent_cls.__name__} runs in lock step only: set it to False"
        )


@dataclass
class RRegister:
    """A workflow: ``config_cls``, ``dataset_cls`` and ``agent_cls`` (and, for async mode, an agent)."""

    config_cls: type
    dataset_cls: type
    agent_cls: type

    @classmethod
    def from_filename(cls, file_path: str, obj_name: str = "REGISTER") -> RRegister:
        """Import ``file_path`` (a ``.py`` file) and return its ``obj_name`` attribute."""
        path = Path(file_path)
        if not path.exists():
            raise FileNotFoundError(f"recurrent workflow file not found: {file_path}")
        spec = importlib.util.spec_from_file_location(f"recurrent_custom_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - re-raised with context
            sys.modules.pop(spec.name, None)
            raise RuntimeError(f"failed to import recurrent workflow file {file_path}: {e}") from e
        return cls._check(getattr(module, obj_name, None), f"{file_path}:{obj_name}")

    @classmethod
    def from_module(cls, module_name: str, obj_name: str = "REGISTER") -> RRegister:
        module = importlib.import_module(module_name)
        return cls._check(getattr(module, obj_name, None), f"{module_name}:{obj_name}")

    @staticmethod
    def _check(obj, where: str) -> RRegister:
        if obj is None:
            raise AttributeError(f"{where} does not exist")
        if not isinstance(obj, RRegister):
            raise TypeError(f"{where} must be an RRegister, got {type(obj).__name__}")
        return obj


# Built-in workflows selectable by name with ``recurrent.enable=<name>``.
BUILTIN_WORKFLOWS = {
    "memory": "recurrent.impls.memory",
    "async_memory": "recurrent.impls.async_memory",
    "tool_gsm8k": "recurrent.impls.async_tool_gsm8k",
    "trival": "recurrent.impls.async_trival",
    "trivial": "recurrent.impls.async_trival",
}


def load_register(name_or_path: str, path: str | None = None, obj_name: str | None = None) -> RRegister:
    """Resolve a workflow by built-in name, ``package.module[:OBJ]`` path or ``file.py`` path.

    ``path``/``obj_name`` are the original config's ``recurrent.<name>.path`` / ``.name`` keys; when
    given they win (so an existing MemAgent config pointing at a file keeps working).
    """
    obj_name = obj_name or "REGISTER"
    target = path or BUILTIN_WORKFLOWS.get(name_or_path, name_or_path)
    if ":" in target and not target.endswith(".py"):
        target, obj_name = target.split(":", 1)
    if target.endswith(".py"):
        file = Path(target)
        # The original configs name files relative to the repository root
        # (``recurrent/impls/memory.py``); map those onto the installed package so the
        # workflow's classes are the package's own (not a second copy of the module).
        if not file.is_absolute():
            module_name = target[:-3].replace("/", ".")
            if importlib.util.find_spec(module_name.split(".")[0]) is not None:
                try:
                    reg = RRegister.from_module(module_name, obj_name)
                except ModuleNotFoundError:
                    reg = None
                if reg is not None:
                    logger.info("[RECURRENT] using register '%s' from '%s'", obj_name, module_name)
                    return reg
        reg = RRegister.from_filename(target, obj_name)
    else:
        try:
            reg = RRegister.from_module(target, obj_name)
        except ModuleNotFoundError as e:
            raise ValueError(
                f"unknown recurrent workflow {name_or_path!r}: not a built-in "
                f"({', '.join(sorted(BUILTIN_WORKFLOWS))}), an importable module or a .py file ({e})"
            ) from e
    logger.info("[RECURRENT] recurrent enabled, using register '%s' from '%s'", obj_name, target)
    return reg

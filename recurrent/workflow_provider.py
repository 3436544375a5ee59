"""The recurrent framework as a workflow provider of the multi-turn trainer (``recurrent.provider``).

``build_workflow(config, tokenizer)`` resolves the active ``recurrent.<name>`` section (``recurrent.enable``),
loads its register (sync ``path``/``name`` or, with ``actor_rollout_ref.rollout.mode=async``,
``async_path``/``async_name``), builds the workflow config, the datasets, and the rollout: the sync
:class:`recurrent.generation_manager.LLMGenerationManager` around the register's agent (lock step), the
:class:`recurrent.free_running_manager.FreeRunningGenerationManager` with ``rollout.free_running_turns``, or the async
manager.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf

from recurrent.interface import load_register, require_free_running
from verl.trainer.ppo.workflow import MultiTurnWorkflow

logger = logging.getLogger(__name__)

__all__ = ["build_workflow"]


def build_workflow(cfg: DictConfig, tokenizer: Any) -> MultiTurnWorkflow:
    from verl.trainer.config import DataConfig, RecurrentConfig
    from verl.workers.config import RolloutConfig

    name = RecurrentConfig.from_config(cfg.recurrent).name
    wf_cfg = cfg.recurrent.get(name)  # the workflow's free-form sub-config
    if wf_cfg is None:
        raise ValueError(f"recurrent.enable={name!r} but there is no recurrent.{name} section")
    data_key = cfg.data.get("context_key")
    wf_key = (wf_cfg.get("config") or {}).get("context_key")
    if data_key is not None and wf_key is not None and data_key != wf_key:
        logger.warning(
            "data.context_key=%r is informational; the workflow reads recurrent.%s.config.context_key=%r",
            data_key,
            name,
            wf_key,
        )
    rollout_config = RolloutConfig.from_config(cfg.actor_rollout_ref.rollout)
    is_async = rollout_config.mode == "async"
    if is_async:
        if not wf_cfg.get("async_path"):
            raise ValueError(f"actor_rollout_ref.rollout.mode=async needs recurrent.{name}.async_path")
        register = load_register(name, path=wf_cfg.get("async_path"), obj_name=wf_cfg.get("async_name"))
    else:
        if not wf_cfg.get("path"):
            raise ValueError(f"recurrent.{name} has no sync workflow (path); use actor_rollout_ref.rollout.mode=async")
        register = load_register(name, path=wf_cfg.get("path"), obj_name=wf_cfg.get("name"))
    if rollout_config.free_running_turns and not is_async:
        require_free_running(register.agent_cls)
    workflow_config = register.config_cls(**OmegaConf.to_container(wf_cfg.get("config") or {}, resolve=True))

    data = DataConfig.from_config(cfg.data)
    data_cfg = data.to_dict()  # the workflow datasets take the data section as a dict
    train_ds = register.dataset_cls(workflow_config, data.train_file_list, tokenizer, data_cfg)
    val_ds = None
    if data.val_file_list:
        val_ds = register.dataset_cls(workflow_config, data.val_file_list, tokenizer, data_cfg)

    def build_rollout(rollout_client):
        if is_async:
            from recurrent.async_generation_manager import build_async_manager

            return build_async_manager(cfg, tokenizer, rollout_client, register, workflow_config)
        agent = register.agent_cls(tokenizer, workflow_config)
        if rollout_config.free_running_turns:
            from recurrent.free_running_manager import FreeRunningGenerationManager
            from verl.trainer.ppo.ray_worker_group import trajectories_per_rank

            return FreeRunningGenerationManager(tokenizer, rollout_client, agent, trajectories_per_rank(cfg))
        from recurrent.generation_manager import LLMGenerationManager

        return LLMGenerationManager(tokenizer, rollout_client, agent)

    return MultiTurnWorkflow(
        name=str(name),
        train_dataset=train_ds,
        val_dataset=val_ds,
        build_rollout=build_rollout,
        final_response_length=getattr(workflow_config, "max_final_response_length", None) or None,
    )

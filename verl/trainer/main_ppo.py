"""Entry point: ``python -m verl.trainer.main_ppo [hydra overrides]``.

Builds everything from the config (tokenizer, workflow, datasets, workers, reward managers,
loggers, checkpoints) and runs :func:`verl.trainer.ppo.fit.fit`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

logger = logging.getLogger(__name__)


def pick_device(cfg: DictConfig) -> str:
    dev = cfg.trainer.get("device", None)
    if dev in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if dev not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device must be cpu, cuda or null, got {dev!r}")
    if dev == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA GPU is visible")
    return dev


def build_worker_group(cfg: DictConfig, device: str):
    """One worker per rank: in-process for a single CPU rank, else a Ray worker group."""
    world = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    if world == 1 and device == "cpu" and not cfg.trainer.get("force_ray_workers", False):
        from verl.trainer.ppo.local_worker_group import LocalWorkerGroup

        return LocalWorkerGroup(cfg.actor_rollout_ref, device)
    from verl.trainer.ppo.ray_worker_group import build_ray_worker_group

    return build_ray_worker_group(cfg, device)


def run(cfg: DictConfig) -> list[dict]:
    import ray

    from recurrent.interface import load_register
    from verl.trainer.config_schema import apply_config_aliases, validate_config
    from verl.trainer.ppo.fit import fit
    from verl.trainer.ppo.ray_trainer import MultiConvTrainer
    from verl.utils.checkpoint import CheckpointManager
    from verl.utils.dataset.rl_dataset import collate_fn
    from verl.utils.dataset.sampler import ResumableDataLoader, train_dataloader
    from verl.utils.model_loading import load_tokenizer
    from verl.utils.tracking import Tracking
    from verl.workers.reward_manager import load_reward_manager

    validate_config(cfg)
    with open_dict(cfg):
        apply_config_aliases(cfg)  # grpo_use_adv, ray_init.num_cpus, trainer.device
    device = pick_device(cfg)
    name = cfg.recurrent.get("enable")
    if name:  # recurrent (multi-conversation) workflow
        wf_cfg = cfg.recurrent.get(name)
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
        if cfg.actor_rollout_ref.rollout.get("mode", "sync") == "async":
            if not wf_cfg.get("async_path"):
                raise ValueError(f"actor_rollout_ref.rollout.mode=async needs recurrent.{name}.async_path")
            register = load_register(name, path=wf_cfg.get("async_path"), obj_name=wf_cfg.get("async_name"))
        else:
            if not wf_cfg.get("path"):
                raise ValueError(
                    f"recurrent.{name} has no sync workflow (path); use actor_rollout_ref.rollout.mode=async"
                )
            register = load_register(name, path=wf_cfg.get("path"), obj_name=wf_cfg.get("name"))
        recurrent_config = register.config_cls(**OmegaConf.to_container(wf_cfg.get("config") or {}, resolve=True))
    elif cfg.actor_rollout_ref.rollout.get("mode", "sync") == "async":
        raise ValueError("actor_rollout_ref.rollout.mode=async needs recurrent.enable (e.g. trival for single-turn)")
    use_critic = not name and cfg.algorithm.adv_estimator == "gae"

    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)  # with model.trust_remote_code
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    if name:
        train_ds = register.dataset_cls(recurrent_config, list(_files(cfg.data.train_files)), tokenizer, data_cfg)
        val_ds = (
            register.dataset_cls(recurrent_config, list(_files(cfg.data.val_files)), tokenizer, data_cfg)
            if cfg.data.get("val_files")
            else None
        )
    else:  # single-turn PPO/GRPO on chat prompts
        from verl.utils.dataset.rl_dataset import RLHFDataset

        train_ds = RLHFDataset(list(_files(cfg.data.train_files)), tokenizer, data_cfg)
        val_ds = (
            RLHFDataset(list(_files(cfg.data.val_files)), tokenizer, data_cfg) if cfg.data.get("val_files") else None
        )
    seed = int(cfg.data.get("seed", 1) or 1)
    train_loader = train_dataloader(train_ds, cfg.data, collate_fn)  # with data.dataloader_num_workers
    val_loader = None
    if val_ds is not None:
        vbs = cfg.data.get("val_batch_size") or len(val_ds)
        val_loader = ResumableDataLoader(
            val_ds, batch_size=int(vbs), shuffle=False, seed=seed, collate_fn=collate_fn, drop_last=False
        )
    total_steps = cfg.trainer.get("total_training_steps") or len(train_loader) * int(cfg.trainer.total_epochs)
    with open_dict(cfg):
        cfg.actor_rollout_ref.actor.optim.total_training_steps = int(total_steps)
        if use_critic:
            cfg.critic.optim.total_training_steps = int(total_steps)

    if not ray.is_initialized():
        ray.init(
            address=cfg.trainer.get("ray_address"),
            num_cpus=cfg.trainer.get("ray_num_cpus"),
            include_dashboard=False,
            ignore_reinit_error=True,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
        )
    critic_wg = None
    if use_critic:
        from verl.trainer.ppo.critic_worker_group import build_actor_and_critic_groups

        wg, critic_wg = build_actor_and_critic_groups(cfg, device)
        critic_wg.init_model()
    else:
        wg = build_worker_group(cfg, device)
    wg.init_model()
    rm_name = cfg.reward_model.get("reward_manager", "naive")
    compute_score = load_custom_reward_fn(cfg)
    reward_fn = load_reward_manager(rm_name, tokenizer, compute_score=compute_score, num_examine=0)
    val_reward_fn = load_reward_manager(rm_name, tokenizer, compute_score=compute_score, num_examine=1)
    log_dir = Path(cfg.trainer.get("log_dir") or Path(cfg.trainer.default_local_dir) / "logs")
    tracker = Tracking(
        project_name=cfg.trainer.project_name,
        experiment_name=cfg.trainer.experiment_name,
        default_backend=list(cfg.trainer.logger),
        config=OmegaConf.to_container(cfg, resolve=True),
        log_dir=str(log_dir),
    )
    if name:
        trainer = MultiConvTrainer(
            cfg, tokenizer, wg, register, recurrent_config, train_ds, val_ds, reward_fn, val_reward_fn, tracker
        )
    else:
        from verl.trainer.ppo.single_turn import SingleTurnPPOTrainer

        trainer = SingleTurnPPOTrainer(
            cfg, tokenizer, wg, train_ds, val_ds, reward_fn, val_reward_fn, tracker, critic_group=critic_wg
        )
    ckpt = CheckpointManager(cfg.trainer.default_local_dir, max_ckpt_to_keep=cfg.trainer.get("max_actor_ckpt_to_keep"))
    try:
        history = fit(trainer, train_loader, val_loader, ckpt, int(total_steps))
    finally:
        tracker.finish()
        wg.shutdown_engines()
        wg.shutdown()
        if critic_wg is not None:
            critic_wg.shutdown()
    return history


def load_custom_reward_fn(cfg: DictConfig):
    """``custom_reward_function.path`` / ``.name``: a user scorer with the verl signature
    ``(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``; None = built-in."""
    spec = cfg.get("custom_reward_function") or {}
    path = spec.get("path")
    if not path:
        return None
    import importlib.util

    if not os.path.exists(path):
        raise FileNotFoundError(f"custom_reward_function.path not found: {path}")
    module_spec = importlib.util.spec_from_file_location("custom_reward_module", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    name = spec.get("name") or "compute_score"
    if not hasattr(module, name):
        raise AttributeError(f"custom_reward_function.name={name!r} is not defined in {path}")
    return getattr(module, name)


def _files(spec) -> list[str]:
    if spec is None:
        return []
    if isinstance(spec, str):
        return [spec]
    return [str(s) for s in spec]


@hydra.main(config_path="config", config_name="ppo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(cfg)


if __name__ == "__main__":
    main()

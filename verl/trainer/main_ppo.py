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

    from verl.trainer.config_keys import check_config_keys
    from verl.trainer.config_preflight import check_config
    from verl.trainer.config_schema import apply_config_aliases, validate_config
    from verl.trainer.ppo.fit import fit
    from verl.trainer.ppo.ray_trainer import MultiConvTrainer
    from verl.trainer.ppo.single_turn import SingleTurnPPOTrainer
    from verl.trainer.ppo.workflow import load_workflow_provider
    from verl.utils.checkpoint import CheckpointManager
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.utils.dataset.sampler import ResumableDataLoader, train_dataloader
    from verl.utils.model_loading import load_tokenizer
    from verl.utils.tracking import Tracking
    from verl.workers.reward_manager import load_reward_manager

    check_config_keys(cfg)  # unknown keys (did you mean ...?) raise; INERT keys set by the user are listed
    validate_config(cfg)
    with open_dict(cfg):
        apply_config_aliases(cfg)  # grpo_use_adv, ray_init.num_cpus, trainer.device
    check_config(cfg)  # paths, data rows, resume, unsupported combinations: before any model, tokenizer or Ray
    device = pick_device(cfg)
    from verl.utils.memory_estimate import startup_memory_check

    startup_memory_check(cfg, device)  # trainer.memory_check: per-rank GPU/host estimate, refuses what cannot fit
    name = cfg.recurrent.get("enable")
    if not name and cfg.actor_rollout_ref.rollout.get("mode", "sync") == "async":
        raise ValueError("actor_rollout_ref.rollout.mode=async needs recurrent.enable (e.g. trival for single-turn)")
    use_critic = not name and cfg.algorithm.adv_estimator == "gae"

    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)  # with model.trust_remote_code
    workflow = None
    if name:  # multi-turn workflow, built by its provider (recurrent.provider: module:function)
        workflow = load_workflow_provider(cfg.recurrent.provider)(cfg, tokenizer)
        train_ds, val_ds = workflow.train_dataset, workflow.val_dataset
    else:  # single-turn PPO/GRPO on chat prompts
        data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
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
    if workflow is not None:
        trainer = MultiConvTrainer(cfg, tokenizer, wg, workflow, reward_fn, val_reward_fn, tracker)
    else:
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
    from verl.utils.import_utils import FILE_PATH_PREFIX, load_module

    spec = cfg.get("custom_reward_function") or {}
    path = spec.get("path")
    if not path:
        return None
    if not os.path.exists(path):
        raise FileNotFoundError(f"custom_reward_function.path not found: {path}")
    module = load_module(FILE_PATH_PREFIX + path)  # loaded once: it may be algorithm.adv_estimator_module too
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

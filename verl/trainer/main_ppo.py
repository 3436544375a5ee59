"""Entry point: ``python -m verl.trainer.main_ppo [hydra overrides]``.

Builds everything from the config (tokenizer, workflow, datasets, workers, reward managers,
loggers, checkpoints) and runs :func:`verl.trainer.ppo.fit.fit`.
"""

from __future__ import annotations

import logging
import os

import hydra
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from verl.trainer.config import CustomRewardFunctionConfig, PPOConfig, TrainerConfig, from_config
from verl.workers.config.rollout import (
    engine_sms_not_applicable,
    resolve_engine_reserved_sms,
    resolve_engine_stream,
)

logger = logging.getLogger(__name__)


def pick_device(conf: PPOConfig) -> str:
    dev = conf.trainer.device
    if dev in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if dev not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device must be cpu, cuda or null, got {dev!r}")
    if dev == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA GPU is visible")
    return dev


def needs_ray(conf: PPOConfig, device: str) -> bool:
    """Ray is started (or joined) only for what runs on it: the worker groups of every layout but one
    in-process CPU rank (``TrainerConfig.runs_in_process``) and the ``thread`` reward manager's actors. A single
    CPU rank with the ``naive`` manager runs without Ray (no cluster start-up of several seconds)."""
    return not conf.trainer.runs_in_process(device) or conf.reward_model.reward_manager == "thread"


def build_worker_group(cfg: DictConfig, device: str):
    """One worker per rank: in-process for a single CPU rank, else a Ray worker group."""
    if TrainerConfig.from_config(cfg.trainer).runs_in_process(device):
        from verl.trainer.ppo.local_worker_group import LocalWorkerGroup

        return LocalWorkerGroup(cfg.actor_rollout_ref, device)
    from verl.trainer.ppo.ray_worker_group import build_ray_worker_group

    return build_ray_worker_group(cfg, device)


def run(cfg: DictConfig) -> list[dict]:
    import ray

    from verl.single_controller.cluster import init_ray
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
    conf = from_config(cfg)  # the typed sections: what this function reads
    device = pick_device(conf)
    from verl.utils.memory_startup import startup_memory_check

    startup_memory_check(cfg, device)  # trainer.memory_check: per-rank GPU/host estimate, refuses what cannot fit
    name = conf.recurrent.name
    if not name and conf.actor_rollout_ref.rollout.mode == "async":
        raise ValueError("actor_rollout_ref.rollout.mode=async needs recurrent.enable (e.g. trival for single-turn)")
    use_critic = not name and conf.algorithm.adv_estimator == "gae"
    if not name and conf.actor_rollout_ref.rollout.free_running_turns:
        logger.warning(
            "actor_rollout_ref.rollout.free_running_turns=True has no effect without a multi-turn workflow "
            "(recurrent.enable): a single-turn rollout is one turn"
        )
        with open_dict(cfg):
            cfg.actor_rollout_ref.rollout.free_running_turns = False

    from verl.utils.import_utils import import_external_libs

    import_external_libs(conf.actor_rollout_ref.model.external_lib)  # custom architectures/tokenizers register here
    tokenizer = load_tokenizer(conf.actor_rollout_ref.model)  # with model.trust_remote_code
    workflow = None
    if name:  # multi-turn workflow, built by its provider (recurrent.provider: module:function)
        workflow = load_workflow_provider(conf.recurrent.provider)(cfg, tokenizer)
        train_ds, val_ds = workflow.train_dataset, workflow.val_dataset
    else:  # single-turn PPO/GRPO on chat prompts
        data = conf.data
        train_ds = RLHFDataset(data.train_file_list, tokenizer, data)
        val_ds = RLHFDataset(data.val_file_list, tokenizer, data) if data.val_file_list else None
    train_loader = train_dataloader(train_ds, conf.data, collate_fn)  # with data.dataloader_num_workers
    val_loader = None
    if val_ds is not None:
        val_loader = ResumableDataLoader(
            val_ds,
            batch_size=conf.data.val_batch_size or len(val_ds),
            shuffle=False,
            seed=conf.data.seed,
            collate_fn=collate_fn,
            drop_last=False,
        )
    total_steps = conf.trainer.total_training_steps or len(train_loader) * conf.trainer.total_epochs
    with open_dict(cfg):
        cfg.actor_rollout_ref.actor.optim.total_training_steps = int(total_steps)
        cfg.actor_rollout_ref.rollout.engine_stream = resolve_engine_stream(
            conf.actor_rollout_ref.rollout.engine_stream,
            conf.trainer.rollout_overlap,
            uses_vllm_on_gpu=conf.actor_rollout_ref.rollout.name == "vllm" and device == "cuda",
        )
        rollout = conf.actor_rollout_ref.rollout
        reserved, why_not = resolve_engine_reserved_sms(
            rollout.engine_reserved_sms,
            conf.trainer.rollout_overlap,
            uses_vllm_on_gpu=rollout.name == "vllm" and device == "cuda",
            engine_process=rollout.engine_process,
        )
        if why_not is not None:
            logger.warning(
                "actor_rollout_ref.rollout.engine_reserved_sms=%d has no effect: %s",
                rollout.engine_reserved_sms,
                why_not,
            )
        cfg.actor_rollout_ref.rollout.engine_reserved_sms = reserved
        if rollout.balance_reserved_sms:
            why_not = engine_sms_not_applicable(
                conf.trainer.rollout_overlap, rollout.name == "vllm" and device == "cuda", rollout.engine_process
            )
            if why_not is not None:
                logger.warning("actor_rollout_ref.rollout.balance_reserved_sms=True has no effect: %s", why_not)
                cfg.actor_rollout_ref.rollout.balance_reserved_sms = False
        if use_critic:
            cfg.critic.optim.total_training_steps = int(total_steps)

    if needs_ray(conf, device) and not ray.is_initialized():
        # a local instance's processes get a process group of their own: a SIGTERM to the launching command's
        # group (timeout, a shell script's job) reaches this driver only, which finishes the step and checkpoints
        init_ray(
            address=conf.trainer.ray_address,
            num_cpus=conf.trainer.ray_num_cpus,
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
    rm_name = conf.reward_model.reward_manager
    compute_score = load_custom_reward_fn(conf.custom_reward_function)
    # data.reward_fn_key: the column routed to the scorer as data_source; reward_model.reward_kwargs: extra keyword
    # arguments of every scorer call (custom or built-in), as upstream's managers take them
    reward_kw = {"reward_fn_key": conf.data.reward_fn_key, **conf.reward_model.reward_kwargs}
    reward_fn = load_reward_manager(rm_name, tokenizer, compute_score=compute_score, num_examine=0, **reward_kw)
    val_reward_fn = load_reward_manager(rm_name, tokenizer, compute_score=compute_score, num_examine=1, **reward_kw)
    tracker = Tracking(
        project_name=conf.trainer.project_name,
        experiment_name=conf.trainer.experiment_name,
        default_backend=list(conf.trainer.logger),
        config=OmegaConf.to_container(cfg, resolve=True),
        log_dir=conf.trainer.logs_dir,
    )
    if workflow is not None:
        trainer = MultiConvTrainer(cfg, tokenizer, wg, workflow, reward_fn, val_reward_fn, tracker)
    else:
        trainer = SingleTurnPPOTrainer(
            cfg, tokenizer, wg, train_ds, val_ds, reward_fn, val_reward_fn, tracker, critic_group=critic_wg
        )
    ckpt = CheckpointManager(conf.trainer.local_dir, max_ckpt_to_keep=conf.trainer.max_actor_ckpt_to_keep)
    try:
        history = fit(trainer, train_loader, val_loader, ckpt, int(total_steps))
    finally:
        tracker.finish()
        wg.shutdown_engines()
        wg.shutdown()
        if critic_wg is not None:
            critic_wg.shutdown()
    return history


def load_custom_reward_fn(spec: CustomRewardFunctionConfig | DictConfig):
    """``custom_reward_function.path`` / ``.name``: a user scorer with the verl signature
    ``(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``; None = built-in.
    ``spec``: the typed section, or the whole composed config."""
    from verl.utils.import_utils import FILE_PATH_PREFIX, load_module

    if not isinstance(spec, CustomRewardFunctionConfig):
        spec = from_config(spec).custom_reward_function
    path = spec.path
    if not path:
        return None
    if not os.path.exists(path):
        raise FileNotFoundError(f"custom_reward_function.path not found: {path}")
    module = load_module(FILE_PATH_PREFIX + path)  # loaded once: it may be algorithm.adv_estimator_module too
    name = spec.name
    if not hasattr(module, name):
        raise AttributeError(f"custom_reward_function.name={name!r} is not defined in {path}")
    return getattr(module, name)


@hydra.main(config_path="config", config_name="ppo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(cfg)


if __name__ == "__main__":
    main()

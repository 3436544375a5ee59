"""The config contract: every key of ``ppo_trainer.yaml`` does what it says, or says that it does nothing.

Every leaf key of the default config (and every key of ``config_keys.EXTRA_KEYS``) is exactly one of:

(a) CONSUMED: listed below with the pytest node id(s) of tests that fail when the key stops reaching code;
(b) INERT: listed in ``verl.trainer.config_keys.INERT`` with the reason (a warning names it when it is set);
(c) below a ``config_keys.FREE_FORM`` section.

A new YAML key that is none of them fails ``test_every_key_is_consumed_inert_or_free_form``; a table entry naming
a key that no longer exists, or a test that no longer exists, fails too. Unknown keys (``+a.typo=1``) are an
error naming the closest valid key, before anything loads; the launch scripts' override lists validate with no key
silently dropped.
"""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path

import pytest

from tests.test_config import REPO, SCRIPTS, compose_config, script_overrides
from verl.trainer import config_keys
from verl.trainer.config_keys import (
    EXTRA_KEYS,
    FREE_FORM,
    INERT,
    UPSTREAM_NAMES,
    UnknownConfigKeyError,
    check_config_keys,
    find_inert_keys,
    find_unknown_keys,
    is_free_form,
    leaf_keys,
    valid_keys,
)

W = "tests/test_config_consumed_workers.py"
R = "tests/test_config_consumed_run.py"
DEPRECATED = "tests/test_deprecated_micro_batch.py::test_global_sizes_are_divided_by_the_data_parallel_size"
LOG_PROB = "tests/test_log_prob_budgets.py::test_rollout_and_ref_log_prob_budgets_drive_their_passes"
LR = "tests/test_lr_schedule.py::test_workers_build_the_configured_schedule"
OVERRIDES = "tests/test_model_overrides.py::test_override_and_trust_remote_code_reach_actor_ref_hf_engine_and_tokenizer"
CRITIC_OVERRIDES = "tests/test_model_overrides.py::test_critic_gets_its_override_and_the_policys_trust_remote_code"
HSDP = "tests/test_hsdp.py::test_hsdp_2x2_matches_plain_fsdp_and_one_process"
RESHARD = "tests/test_reshard_after_forward.py::test_keeping_layers_gathered_changes_no_number_and_halves_the_gathers"
DAPO = "tests/test_trainer_e2e.py::test_dapo_dynamic_sampling_and_overlong_shaping"
KEYS3 = "tests/test_reward_and_dapo_keys.py"
KL_REWARD = "tests/test_critic.py::test_rloo_with_kl_in_reward"
RUN_LOG = f"{R}::test_run_passes_logging_checkpoint_and_ray_keys"
RUN_SIZES = f"{R}::test_run_sizes_the_loaders_and_the_step_count"
RUN_CLUSTER = f"{R}::test_run_picks_device_and_worker_group_from_the_cluster_keys"
RUN_REWARD = f"{R}::test_run_loads_the_reward_manager_and_custom_reward_function"
SAMPLING = f"{R}::test_sampling_parameters_follow_the_config"
DATASET = f"{R}::test_single_turn_dataset_follows_prompt_key_length_and_truncation"
WORKFLOW = f"{R}::test_memory_workflow_gets_its_config_and_register"
ASYNC = f"{R}::test_async_manager_options"
ASYNC_BUILD = "tests/test_async_mode.py::test_build_async_manager_from_config"
N_COUNTS = f"{R}::test_single_turn_trainer_generates_rollout_n_and_val_kwargs_n"
ENGINE_EXTRA = f"{W}::test_max_model_len_dtype_and_sleep_mode_reach_the_engine"
OFFLOAD = f"{W}::test_offload_keys_move_the_models_on_gpu"
OVERLAP = "tests/test_rollout_overlap.py"
OVERLAP_STALE = "tests/test_rollout_overlap_e2e.py::test_overlap_trains_on_rollouts_one_step_stale"
OVERLAP_IS = "tests/test_rollout_overlap_e2e.py::test_overlap_corrects_with_truncated_importance_weights"


def _actor(key: str) -> str:
    return f"{W}::test_actor_settings_follow_the_config[{key}]"


def _loader(key: str) -> str:
    return f"{W}::test_model_keys_reach_the_loader[{key}]"


def _engine(key: str) -> str:
    return f"{W}::test_rollout_keys_reach_the_engine[{key}]"


def _critic(key: str) -> str:
    return f"{W}::test_critic_settings_follow_the_config[{key}]"


A, M, RO, C = "actor_rollout_ref.actor", "actor_rollout_ref.model", "actor_rollout_ref.rollout", "critic"

# key -> the tests that fail when the key stops reaching code
CONSUMED: dict[str, tuple[str, ...]] = {
    # data
    "data.train_files": (RUN_SIZES,),
    "data.val_files": (RUN_SIZES,),
    "data.prompt_key": (DATASET,),
    "data.max_prompt_length": (DATASET, _engine("data.max_prompt_length")),
    "data.max_response_length": (SAMPLING, _engine("data.max_response_length")),
    "data.train_batch_size": (RUN_SIZES,),
    "data.val_batch_size": (RUN_SIZES,),
    "data.shuffle": (RUN_SIZES,),
    "data.seed": (RUN_SIZES,),
    "data.filter_overlong_prompts": (
        "tests/test_filter_overlong_prompts.py::test_single_turn_drops_prompts_over_max_prompt_length",
    ),
    "data.truncation": (DATASET,),
    "data.dataloader_num_workers": (
        "tests/test_dataloader_workers.py::test_rows_load_in_the_configured_worker_processes",
    ),
    # model
    f"{M}.path": (OVERRIDES,),
    f"{M}.override_config": (
        OVERRIDES,
        "tests/test_model_overrides.py::test_vllm_engine_gets_hf_overrides_and_trust_remote_code",
    ),
    f"{M}.enable_gradient_checkpointing": (_loader(f"{M}.enable_gradient_checkpointing"),),
    f"{M}.gradient_checkpointing_every": (
        _loader(f"{M}.gradient_checkpointing_every"),
        "tests/test_selective_checkpointing.py::test_only_every_nth_layer_recomputes_and_gradients_are_unchanged",
        "tests/test_selective_checkpointing.py::test_key_is_validated_from_the_yaml",
    ),
    f"{M}.use_remove_padding": (_actor(f"{M}.use_remove_padding"),),
    f"{M}.share_prompts": (
        _actor(f"{M}.share_prompts"),
        _loader(f"{M}.share_prompts"),
        "tests/test_shared_prompts.py::test_actor_log_probs_and_update_equal_without_sharing",
    ),
    f"{M}.attn_implementation": (_loader(f"{M}.attn_implementation"),),
    f"{M}.lora_rank": (
        _loader(f"{M}.lora_rank"),
        "tests/test_lora.py::test_worker_trains_only_the_adapters_under_fsdp2",
    ),
    f"{M}.lora_alpha": (_loader(f"{M}.lora_alpha"), "tests/test_lora.py::test_engine_holds_the_merged_actor_weights"),
    f"{M}.target_modules": (_loader(f"{M}.target_modules"), "tests/test_lora.py::test_target_modules_must_be_names"),
    f"{M}.use_liger": (
        _loader(f"{M}.use_liger"),
        "tests/test_liger_choice.py::test_worker_resolves_once_and_the_ref_follows_the_actor",
        "tests/test_liger_choice.py::test_cpu_workers_on_a_gpu_host_keep_liger_off",
        "tests/test_liger_choice.py::test_liger_with_compile_layers_is_refused_at_validation",
    ),
    f"{M}.compile_layers": (
        "tests/test_compile_layers.py::test_worker_compiles_the_actor_and_ref_layers",
        "tests/test_compile_layers.py::test_flex_attention_refused_at_validation",
        "tests/test_liger_choice.py::test_worker_resolves_once_and_the_ref_follows_the_actor",
    ),
    f"{M}.trust_remote_code": (OVERRIDES,),
    # actor
    **{
        f"{A}.{k}": (_actor(f"{A}.{k}"),)
        for k in (
            "train_batch_size",
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "use_dynamic_bsz",
            "ppo_max_token_len_per_gpu",
            "grad_clip",
            "clip_ratio",
            "clip_ratio_low",
            "clip_ratio_high",
            "clip_ratio_c",
            "loss_agg_mode",
            "entropy_coeff",
            "calculate_entropy",
            "use_kl_loss",
            "kl_loss_coef",
            "kl_loss_type",
            "ppo_epochs",
            "shuffle",
        )
    },
    f"{A}.seed": (f"{W}::test_actor_seed_reaches_the_actor_settings",),
    f"{A}.ppo_micro_batch_size": (DEPRECATED,),
    f"{A}.policy_loss.loss_mode": ("tests/test_dp_actor.py::test_policy_loss_is_selected_from_the_registry",),
    f"{A}.turn_weighting": (f"{R}::test_multi_turn_trainer_turn_weighting",),
    f"{A}.optim.lr": (f"{W}::test_optimizer_follows_the_config[{A}.optim.lr]",),
    f"{A}.optim.weight_decay": (f"{W}::test_optimizer_follows_the_config[{A}.optim.weight_decay]",),
    f"{A}.optim.betas": (f"{W}::test_optimizer_follows_the_config[{A}.optim.betas]",),
    f"{A}.optim.fused": (f"{W}::test_optimizer_follows_the_config[{A}.optim.fused]",),
    f"{A}.optim.lr_warmup_steps": (LR,),
    f"{A}.optim.lr_warmup_steps_ratio": (LR,),
    f"{A}.optim.min_lr_ratio": (LR,),
    f"{A}.optim.warmup_style": (LR,),
    f"{A}.optim.total_training_steps": (LR, RUN_SIZES),
    f"{A}.fsdp_config.param_offload": (OFFLOAD,),
    f"{A}.fsdp_config.optimizer_offload": (OFFLOAD,),
    f"{A}.fsdp_config.fsdp_size": (HSDP,),
    f"{A}.fsdp_config.reshard_after_forward": (RESHARD,),
    "actor_rollout_ref.ref.fsdp_config.reshard_after_forward": (RESHARD,),
    # reference model
    "actor_rollout_ref.ref.fsdp_config.param_offload": (OFFLOAD,),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": (DEPRECATED,),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (LOG_PROB,),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": (LOG_PROB,),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": (LOG_PROB,),
    # rollout
    f"{RO}.name": (_engine(f"{RO}.name"), f"{W}::test_hf_engine_batch_rows"),
    f"{RO}.mode": (WORKFLOW,),
    f"{RO}.chat_scheduler": (ASYNC,),
    f"{RO}.temperature": (SAMPLING, "tests/test_trainer_e2e.py::test_actor_log_probs_use_the_rollout_temperature"),
    f"{RO}.top_k": (SAMPLING,),
    f"{RO}.top_p": (SAMPLING,),
    f"{RO}.prompt_length": (_engine("data.max_prompt_length"),),
    f"{RO}.response_length": (_engine("data.max_response_length"), ASYNC),
    f"{RO}.dtype": (ENGINE_EXTRA,),
    f"{RO}.gpu_memory_utilization": (_engine(f"{RO}.gpu_memory_utilization"),),
    f"{RO}.enforce_eager": (_engine(f"{RO}.enforce_eager"),),
    f"{RO}.free_cache_engine": (ENGINE_EXTRA, ASYNC_BUILD),
    f"{RO}.sleep_level": ("tests/test_config.py::test_rollout_engine_options_reach_vllm",),
    f"{RO}.tensor_model_parallel_size": (_engine(f"{RO}.tensor_model_parallel_size"),),
    f"{RO}.max_num_batched_tokens": (_engine(f"{RO}.max_num_batched_tokens"),),
    f"{RO}.cudagraph_max_tokens": ("tests/test_config.py::test_rollout_engine_options_reach_vllm",),
    f"{RO}.max_model_len": (ENGINE_EXTRA,),
    f"{RO}.max_num_seqs": (_engine(f"{RO}.max_num_seqs"),),
    f"{RO}.engine_stream": (
        _engine(f"{RO}.engine_stream"),
        "tests/test_config.py::test_rollout_engine_options_reach_vllm",
    ),
    f"{RO}.engine_reserved_sms": (
        f"{W}::test_engine_reserved_sms_reaches_the_actor_and_ref_micro_batch_scope",
        f"{R}::test_run_sets_engine_reserved_sms_to_0_with_a_warning_where_nothing_runs_beside_training",
    ),
    f"{RO}.balance_reserved_sms": (
        "tests/test_rollout_overlap.py::test_balance_reserved_sms_moves_the_split_towards_the_slower_side",
        "tests/test_rollout_overlap_e2e.py::test_the_memory_trainer_balances_the_sm_split_from_each_steps_timings",
        f"{W}::test_engine_reserved_sms_reaches_the_actor_and_ref_micro_batch_scope",
        f"{R}::test_run_turns_balance_reserved_sms_off_with_a_warning_where_nothing_runs_beside_training",
    ),
    f"{RO}.gil_switch_interval_ms": (f"{W}::test_gil_switch_interval_is_set_for_the_worker_process",),
    f"{RO}.engine_process": (
        f"{W}::test_engine_process_child_builds_the_engine_in_a_child_process",
        "tests/test_rollout_overlap_e2e.py::test_one_step_off_with_the_engine_in_a_child_process",
        "tests/test_memory_estimate.py::test_engine_in_a_child_process_adds_its_runtime_and_resident_memory",
    ),
    f"{RO}.calculate_log_probs": (
        "tests/test_calculate_log_probs.py::test_training_rollouts_ask_for_log_probs_by_default_and_not_when_off",
        "tests/test_calculate_log_probs.py::test_tis_without_engine_log_probs_is_refused_naming_the_keys",
        "tests/test_async_mode.py::test_without_engine_log_probs_only_requests_asking_for_them_get_them",
    ),
    f"{RO}.hf_max_batch_size": (f"{W}::test_hf_engine_batch_rows",),
    f"{RO}.seed": (SAMPLING, _engine(f"{RO}.seed")),
    f"{RO}.log_prob_micro_batch_size": (DEPRECATED,),
    f"{RO}.log_prob_micro_batch_size_per_gpu": (LOG_PROB,),
    f"{RO}.log_prob_use_dynamic_bsz": (LOG_PROB,),
    f"{RO}.log_prob_max_token_len_per_gpu": (LOG_PROB,),
    f"{RO}.n": (N_COUNTS, "tests/test_trainer_e2e.py::test_two_steps_with_multiple_chunks_and_finite_metrics"),
    f"{RO}.chat_template": (ASYNC,),
    f"{RO}.async_drop_failed_samples": (ASYNC_BUILD,),
    f"{RO}.async_max_concurrency": (ASYNC,),
    f"{RO}.async_http_server": (ASYNC,),
    f"{RO}.async_free_running_calls": (
        "tests/test_async_free_running.py::test_the_trainer_gives_the_rollout_thread_k_threads_in_async_mode_only",
        "tests/test_trainer_e2e.py::test_async_memory_agent_training_step[free_running]",
    ),
    f"{RO}.free_running_turns": (
        "tests/test_free_running_turns.py::test_the_trainer_wires_free_running_turns",
        "tests/test_rollout_overlap_e2e.py::test_overlap_with_free_running_turns_on_two_ray_ranks",
        "tests/test_config_consumed_run.py::test_run_turns_free_running_turns_off_with_a_warning_for_single_turn_rollouts",
    ),
    f"{RO}.val_kwargs.top_k": (SAMPLING,),
    f"{RO}.val_kwargs.top_p": (SAMPLING,),
    f"{RO}.val_kwargs.temperature": (SAMPLING,),
    f"{RO}.val_kwargs.n": (N_COUNTS,),
    f"{RO}.val_kwargs.do_sample": (SAMPLING,),
    # critic
    f"{C}.optim.lr": (f"{W}::test_critic_optimizer_follows_the_config[critic.optim.lr]",),
    f"{C}.optim.weight_decay": (f"{W}::test_critic_optimizer_follows_the_config[critic.optim.weight_decay]",),
    f"{C}.optim.lr_warmup_steps": (f"{W}::test_critic_warmup_steps_reach_the_critic_schedule",),
    f"{C}.optim.betas": (f"{W}::test_critic_optimizer_follows_the_config[critic.optim.betas]",),
    f"{C}.optim.fused": (f"{W}::test_critic_optimizer_follows_the_config[critic.optim.fused]",),
    f"{C}.optim.lr_warmup_steps_ratio": (LR,),
    f"{C}.optim.min_lr_ratio": (LR,),
    f"{C}.optim.warmup_style": (LR,),
    f"{C}.optim.total_training_steps": (LR,),
    f"{C}.model.path": (f"{W}::test_critic_model_keys_reach_the_loader",),
    f"{C}.model.override_config": (CRITIC_OVERRIDES,),
    f"{C}.model.trust_remote_code": (CRITIC_OVERRIDES,),
    f"{C}.model.enable_gradient_checkpointing": (f"{W}::test_critic_model_keys_reach_the_loader",),
    f"{C}.model.use_remove_padding": (_critic(f"{C}.model.use_remove_padding"),),
    f"{C}.model.fsdp_config.fsdp_size": (HSDP,),
    f"{C}.model.fsdp_config.reshard_after_forward": (RESHARD,),
    **{
        f"{C}.{k}": (_critic(f"{C}.{k}"),)
        for k in (
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "forward_micro_batch_size_per_gpu",
            "use_dynamic_bsz",
            "ppo_max_token_len_per_gpu",
            "forward_max_token_len_per_gpu",
            "ppo_epochs",
            "shuffle",
            "grad_clip",
            "cliprange_value",
        )
    },
    f"{C}.ppo_micro_batch_size": (DEPRECATED,),
    f"{C}.forward_micro_batch_size": (DEPRECATED,),
    f"{C}.seed": (f"{W}::test_critic_seed_sets_the_value_head",),
    # reward
    "reward_model.reward_manager": (RUN_REWARD,),
    "custom_reward_function.path": (RUN_REWARD,),
    "custom_reward_function.name": (RUN_REWARD,),
    # algorithm
    "algorithm.gamma": (f"{R}::test_gae_gamma_and_lam_shape_the_advantages",),
    "algorithm.lam": (f"{R}::test_gae_gamma_and_lam_shape_the_advantages",),
    "algorithm.adv_estimator": (
        f"{R}::test_gae_gamma_and_lam_shape_the_advantages",
        "tests/test_workflow_interface.py::test_multi_turn_trainer_refuses_a_single_turn_estimator",
    ),
    "algorithm.adv_estimator_module": (
        "tests/test_verl_recipe.py::test_adv_estimator_module_registers_names_before_validation",
        "tests/test_verl_recipe.py::test_adv_estimator_module_reaches_the_single_turn_trainer",
    ),
    "algorithm.norm_adv_by_std_in_grpo": ("tests/test_config.py::test_resolve_grpo_use_adv",),
    "algorithm.grpo_use_adv": ("tests/test_config.py::test_resolve_grpo_use_adv",),
    "algorithm.use_kl_in_reward": (KL_REWARD,),
    "algorithm.kl_penalty": (KL_REWARD,),
    "algorithm.kl_ctrl.type": ("tests/test_core_algos.py::test_kl_controllers",),
    "algorithm.kl_ctrl.kl_coef": ("tests/test_core_algos.py::test_kl_controllers", KL_REWARD),
    "algorithm.kl_ctrl.horizon": ("tests/test_core_algos.py::test_kl_controllers",),
    "algorithm.kl_ctrl.target_kl": ("tests/test_core_algos.py::test_kl_controllers",),
    "algorithm.filter_groups.enable": (DAPO,),
    "algorithm.filter_groups.max_num_gen_batches": (DAPO,),
    "algorithm.filter_groups.metric": (f"{KEYS3}::test_filter_groups_metric_picks_what_must_vary",),
    "data.gen_batch_size": (f"{KEYS3}::test_gen_batch_size_draws_more_prompts_than_the_step_trains_on",),
    "data.reward_fn_key": (f"{KEYS3}::test_reward_kwargs_and_reward_fn_key_reach_the_scorer",),
    "reward_model.reward_kwargs": (f"{KEYS3}::test_reward_kwargs_and_reward_fn_key_reach_the_scorer",),
    "actor_rollout_ref.model.external_lib": (f"{KEYS3}::test_external_lib_is_imported_before_the_models_load",),
    "critic.model.external_lib": (f"{KEYS3}::test_external_lib_is_imported_before_the_models_load",),
    "algorithm.overlong_buffer.enable": (DAPO,),
    "algorithm.overlong_buffer.len": (DAPO,),
    "algorithm.overlong_buffer.penalty_factor": (DAPO,),
    "algorithm.rollout_is": (f"{OVERLAP}::test_rollout_is_defaults_to_the_overlap_key", OVERLAP_IS),
    "algorithm.rollout_is_threshold": (f"{OVERLAP}::test_rollout_is_defaults_to_the_overlap_key", OVERLAP_IS),
    "algorithm.bypass_mode": (
        "tests/test_trainer_e2e.py::test_bypass_mode_trains_like_the_recomputed_run_without_its_pass",
        "tests/test_bypass_mode.py::test_bypass_takes_the_engine_log_probs_without_a_recompute_pass",
    ),
    # trainer
    "trainer.total_epochs": (RUN_SIZES,),
    "trainer.total_training_steps": (RUN_SIZES,),
    "trainer.project_name": (RUN_LOG,),
    "trainer.experiment_name": (RUN_LOG,),
    "trainer.logger": (RUN_LOG,),
    "trainer.log_val_generations": (f"{R}::test_fit_logs_validation_generations",),
    "trainer.log_dir": (RUN_LOG,),
    "trainer.balance_batch": ("tests/test_rank_spread.py::test_the_trainer_spreads_by_tokens_only_with_balance_batch",),
    "trainer.rollout_data_dir": ("tests/test_trainer_e2e.py::test_generations_are_dumped_per_step_and_per_validation",),
    "trainer.validation_data_dir": (
        "tests/test_trainer_e2e.py::test_generations_are_dumped_per_step_and_per_validation",
    ),
    "trainer.nnodes": (RUN_CLUSTER,),
    "trainer.n_gpus_per_node": (RUN_CLUSTER,),
    "trainer.device": (RUN_CLUSTER,),
    "trainer.force_ray_workers": (RUN_CLUSTER,),
    "trainer.save_freq": (f"{R}::test_fit_follows_save_test_and_validation_keys",),
    "trainer.max_wall_time_s": (f"{R}::test_fit_resume_keys_and_wall_time",),
    "trainer.rollout_overlap": (f"{OVERLAP}::test_fit_hands_each_step_the_next_steps_batch", OVERLAP_STALE),
    "trainer.resume_mode": (f"{R}::test_fit_resume_keys_and_wall_time",),
    "trainer.resume_from_path": (f"{R}::test_fit_resume_keys_and_wall_time",),
    "trainer.val_before_train": (f"{R}::test_fit_follows_save_test_and_validation_keys",),
    "trainer.test_freq": (f"{R}::test_fit_follows_save_test_and_validation_keys",),
    "trainer.critic_warmup": ("tests/test_critic.py::test_critic_warmup_skips_the_actor",),
    "trainer.default_local_dir": (RUN_LOG,),
    "trainer.max_actor_ckpt_to_keep": (RUN_LOG,),
    "trainer.ray_address": (RUN_LOG,),
    "trainer.ray_num_cpus": (RUN_LOG,),
    "actor_rollout_ref.model.use_fused_kernels": (
        "tests/test_fused_logprob.py::test_config_keys_reach_the_actor_ref_and_old_log_prob_passes",
    ),
    "actor_rollout_ref.model.fused_kernel_options.impl_backend": (
        "tests/test_fused_logprob.py::test_bad_backend_is_refused_naming_the_key",
    ),
    "actor_rollout_ref.model.fused_kernel_options.chunk_size": (
        "tests/test_fused_logprob.py::test_config_keys_reach_the_actor_ref_and_old_log_prob_passes",
    ),
    "trainer.progress_bar": (f"{R}::test_fit_progress_bar_key",),
    "trainer.memory_check": (
        "tests/test_memory_estimate.py::test_memory_check_warn_logs_and_off_skips",
        "tests/test_memory_estimate.py::test_main_ppo_refuses_before_any_model_loads",
    ),
    "ray_init.num_cpus": (RUN_LOG,),
    # recurrent
    "recurrent.enable": (WORKFLOW,),
    "recurrent.provider": ("tests/test_workflow_interface.py::test_trainer_runs_a_provider_named_in_the_config",),
    "recurrent.trival.async_path": (WORKFLOW,),
    "recurrent.trival.async_name": (WORKFLOW,),
    "recurrent.trival.config": (WORKFLOW,),
    "recurrent.memory.path": (WORKFLOW,),
    "recurrent.memory.name": (WORKFLOW,),
    "recurrent.memory.async_path": (WORKFLOW,),
    "recurrent.memory.async_name": (WORKFLOW,),
    **{
        f"recurrent.memory.config.{k}": (WORKFLOW,)
        for k in (
            "context_key",
            "chunk_size",
            "max_prompt_length",
            "max_memorization_length",
            "max_chunks",
            "max_final_response_length",
        )
    },
    "recurrent.tool_gsm8k.async_path": ("tests/test_trainer_e2e.py::test_async_tool_gsm8k_training_step",),
    "recurrent.tool_gsm8k.async_name": ("tests/test_trainer_e2e.py::test_async_tool_gsm8k_training_step",),
    "recurrent.tool_gsm8k.config.max_turn": (ASYNC_BUILD,),
    "recurrent.tool_gsm8k.config.max_generation_per_turn": (ASYNC,),
}


# --------------------------------------------------------------------------------------------------------------
# the contract
# --------------------------------------------------------------------------------------------------------------


def contract_keys() -> list[str]:
    """Every leaf key of the default YAML and every EXTRA_KEYS key."""
    return [k for k, _ in leaf_keys(config_keys.default_config())] + list(EXTRA_KEYS)


def contract_violations(keys: list[str], consumed: dict, inert: dict) -> list[str]:
    """What is wrong with the tables for ``keys``: keys in none of (a)/(b)/(c), keys in both (a) and (b), and
    table entries naming keys that do not exist."""
    problems = []
    for key in keys:
        if key in consumed and key in inert:
            problems.append(f"{key} is both CONSUMED and INERT")
        elif key not in consumed and key not in inert and not is_free_form(key):
            problems.append(f"{key} is neither CONSUMED (tests/test_config_contract.py), INERT nor free-form")
    known = set(keys)
    for table, name in ((consumed, "CONSUMED"), (inert, "INERT")):
        problems += [f"{name} names {key}, which is not a config key" for key in table if key not in known]
    for section in FREE_FORM:
        if "*" not in section and not config_keys._has_node(section):
            problems.append(f"FREE_FORM names {section}, which is not a config key")
    return problems


def test_every_key_is_consumed_inert_or_free_form():
    assert contract_violations(contract_keys(), CONSUMED, INERT) == []


def test_the_contract_fails_on_a_new_key_and_on_a_stale_entry():
    keys = contract_keys()
    assert contract_violations(keys + ["data.brand_new_key"], CONSUMED, INERT) == [
        "data.brand_new_key is neither CONSUMED (tests/test_config_contract.py), INERT nor free-form"
    ]
    stale = {**CONSUMED, "data.removed_key": (RUN_SIZES,)}
    assert contract_violations(keys, stale, INERT) == ["CONSUMED names data.removed_key, which is not a config key"]
    both = {**CONSUMED, "trainer.default_hdfs_dir": (RUN_SIZES,)}
    assert contract_violations(keys, both, INERT) == ["trainer.default_hdfs_dir is both CONSUMED and INERT"]


def test_extra_keys_are_not_in_the_yaml():
    yaml_keys = {k for k, _ in leaf_keys(config_keys.default_config())}
    assert not set(EXTRA_KEYS) & yaml_keys


def node_exists(node_id: str) -> bool:
    """``path.py::function`` or ``path.py::function[param]`` names a test function (and parametrize id)."""
    path, _, rest = node_id.partition("::")
    name, _, param = rest.partition("[")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    func = getattr(module, name, None)
    if not callable(func) or not name.startswith("test_"):
        return False
    if not param:
        return True
    param = param.removesuffix("]")
    for mark in getattr(func, "pytestmark", []):
        if mark.name == "parametrize":
            ids = mark.kwargs.get("ids") or [str(v) for v in mark.args[1]]
            if param in ids:
                return True
    return False


@pytest.mark.parametrize("table_key", sorted(CONSUMED))
def test_consumed_keys_name_existing_tests(table_key):
    missing = [node for node in CONSUMED[table_key] if not node_exists(node)]
    assert not missing, f"{table_key}: no such test {missing}"


def test_node_exists_rejects_missing_tests():
    assert node_exists(f"{W}::test_actor_settings_follow_the_config[{A}.clip_ratio]")
    assert not node_exists(f"{W}::test_actor_settings_follow_the_config[{A}.no_such_key]")
    assert not node_exists(f"{R}::test_no_such_test")


def test_inert_and_free_form_reasons_are_written():
    for table in (INERT, FREE_FORM, EXTRA_KEYS):
        assert all(isinstance(reason, str) and len(reason) > 10 for reason in table.values())


# --------------------------------------------------------------------------------------------------------------
# unknown keys and inert keys at start-up
# --------------------------------------------------------------------------------------------------------------


def test_a_typo_added_with_plus_is_an_error_naming_the_closest_key():
    cfg = compose_config(["+actor_rollout_ref.actor.ppo_mini_batchsize=2", "+trainer.totl_epochs=3", "+trainer.zzz=1"])
    with pytest.raises(UnknownConfigKeyError) as error:
        check_config_keys(cfg)
    assert error.value.messages == [
        "unknown key actor_rollout_ref.actor.ppo_mini_batchsize; did you mean actor_rollout_ref.actor.ppo_mini_batch_size?",
        "unknown key trainer.totl_epochs; did you mean trainer.total_epochs?",
        "unknown key trainer.zzz",
    ]
    # a known key in the wrong section
    assert find_unknown_keys(compose_config(["+actor_rollout_ref.ppo_mini_batch_size=2"])) == [
        "unknown key actor_rollout_ref.ppo_mini_batch_size; did you mean actor_rollout_ref.actor.ppo_mini_batch_size?"
    ]


def test_upstream_verl_names_of_keys_name_ours():
    """Current verl nests the rollout-correction keys under algorithm.rollout_correction; here they are flat."""
    cfg = compose_config([f"+{key}=True" for key in UPSTREAM_NAMES])
    assert find_unknown_keys(cfg) == [
        f"unknown key {key} (upstream verl's name); here it is {ours}" for key, ours in UPSTREAM_NAMES.items()
    ]
    assert all(ours in valid_keys() for ours in UPSTREAM_NAMES.values())


def test_main_ppo_rejects_an_unknown_key_before_anything_loads(monkeypatch):
    import verl.utils.model_loading as model_loading
    from verl.trainer import main_ppo

    def load(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the key check")

    monkeypatch.setattr(model_loading, "load_tokenizer", load)
    cfg = compose_config(["+actor_rollout_ref.actor.ppo_mini_batchsize=2"])
    with pytest.raises(UnknownConfigKeyError, match="did you mean actor_rollout_ref.actor.ppo_mini_batch_size"):
        main_ppo.run(cfg)


def test_the_key_check_uses_the_config_the_run_was_composed_from(tmp_path, monkeypatch):
    """main_ppo with --config-path/--config-name: keys of that config are valid, typos of them are refused."""
    import sys

    from verl.trainer import config_schema, main_ppo

    (tmp_path / "custom.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - _self_\n"
        f"hydra:\n  searchpath:\n    - file://{Path(config_keys.CONFIG_PATH).parent}\n"
        "my_section:\n  depth: 2\n"
    )
    reached = []

    def stop(cfg):  # the step after the key check: record the config and go no further
        reached.append(cfg)
        raise RuntimeError("stop after the key check")

    monkeypatch.setattr(config_schema, "validate_config", stop)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")

    def launch(*overrides):
        argv = ["main_ppo", f"--config-path={tmp_path}", "--config-name=custom", f"hydra.run.dir={tmp_path / 'run'}"]
        monkeypatch.setattr(sys, "argv", argv + ["hydra/job_logging=none", "hydra/hydra_logging=none", *overrides])
        main_ppo.main()

    with pytest.raises(RuntimeError, match="stop after the key check"):
        launch("my_section.depth=5")
    assert reached[0].my_section.depth == 5 and reached[0].data.train_batch_size == 1024
    with pytest.raises(UnknownConfigKeyError) as error:
        launch("+my_section.deph=1")
    assert error.value.messages == ["unknown key my_section.deph; did you mean my_section.depth?"]
    # outside a Hydra app the default ppo_trainer.yaml decides: the custom section is unknown there
    assert find_unknown_keys({"my_section": {"depth": 2}}) == ["unknown key my_section.depth"]


def test_free_form_sections_accept_any_key():
    cfg = compose_config(
        [
            "+actor_rollout_ref.model.override_config.attention_dropout=0.1",
            "+critic.model.override_config.rope_theta=10",
            "+actor_rollout_ref.rollout.engine_kwargs.max_logprobs=7",
            "+reward_model.reward_kwargs.strict=false",
            "+recurrent.mine.path=my_flow.py",
            "+recurrent.mine.config.anything=1",
        ]
    )
    assert find_unknown_keys(cfg) == []
    # the YAML's own workflow sections are checked key by key
    assert find_unknown_keys(compose_config(["+recurrent.memory.config.chunk_sise=1"])) == [
        "unknown key recurrent.memory.config.chunk_sise; did you mean recurrent.memory.config.chunk_size?"
    ]


def test_an_inert_key_set_warns_once_naming_it(caplog):
    cfg = compose_config(["actor_rollout_ref.actor.use_torch_compile=False", "trainer.del_local_ckpt_after_load=True"])
    with caplog.at_level(logging.WARNING, logger="verl.trainer.config_keys"):
        inert = check_config_keys(cfg)
    assert [i.key for i in inert] == ["actor_rollout_ref.actor.use_torch_compile", "trainer.del_local_ckpt_after_load"]
    text = caplog.text
    assert (
        text.count("actor_rollout_ref.actor.use_torch_compile") == 1
        and text.count("trainer.del_local_ckpt_after_load") == 1
    )
    # ref.use_torch_compile follows the actor's by interpolation: not reported unless set itself
    assert "actor_rollout_ref.ref.use_torch_compile" not in text
    assert "2 config key(s) you set have no effect" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verl.trainer.config_keys"):
        assert (
            check_config_keys(compose_config(["trainer.del_local_ckpt_after_load=False"])) == []
        )  # the default: silent
    assert caplog.text == ""


def differences_doc() -> str:
    return (REPO / "docs" / "differences.md").read_text()


@pytest.fixture(scope="module")
def script_configs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("contract")
    return {script: compose_config(script_overrides(script, tmp)) for script in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS)
def test_launch_scripts_drop_no_key_silently(script, script_configs):
    """Every key the original scripts set is known; the inert ones are each justified in docs/differences.md."""
    cfg = script_configs[script]
    assert find_unknown_keys(cfg) == []
    doc = differences_doc()
    section = doc[doc.index("## Keys the launch scripts set that do nothing") :]
    unjustified = [i.key for i in find_inert_keys(cfg) if f"`{i.key}`" not in section]
    assert unjustified == []


def test_memory_scripts_inert_table(script_configs):
    """run_memory_7B.sh / run_memory_14B.sh: only the informational data.context_key."""
    for script in ("run_memory_7B.sh", "run_memory_14B.sh"):
        assert [i.key for i in find_inert_keys(script_configs[script])] == ["data.context_key"]


def test_docs_list_every_inert_and_free_form_key():
    doc = (REPO / "docs" / "config.md").read_text()
    missing = [key for key in list(INERT) + list(FREE_FORM) if f"`{key}`" not in doc]
    assert missing == []
    yaml = Path(config_keys.CONFIG_PATH).read_text()
    assert re.search(r"config_keys\.py", yaml)


def yaml_inert_marks() -> dict[str, bool]:
    """Dotted key -> whether the comment block right above it has an ``# INERT`` line."""
    key_line = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*:")
    marks, stack, comments = {}, [], []
    for line in Path(config_keys.CONFIG_PATH).read_text().splitlines():
        if line.lstrip().startswith("#"):
            comments.append(line.strip())
            continue
        match = key_line.match(line)
        if match:
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match["key"]))
            marks[".".join(k for _, k in stack)] = any(c.startswith("# INERT") for c in comments)
        comments = []
    return marks


def test_yaml_comments_mark_exactly_the_inert_keys():
    marks = yaml_inert_marks()
    assert sorted(k for k, marked in marks.items() if marked) == sorted(k for k in INERT if k in marks)

"""``fsdp_config.reshard_after_forward=False``: each layer stays gathered from its forward to its backward (and
through a log-prob pass), so the backward gathers nothing; the numbers are those of the default.

Two CPU ranks (gloo, ``tests.rank_processes.spawn``), the tiny Qwen2 model:
* a log-prob pass, then an update of two optimizer steps (two micro-batches each): the same log-probs and the same
  parameters with and without resharding (a gathered copy left stale by an optimizer step would differ), and the
  update gathers each layer once per micro-batch instead of twice;
* after the pass the worker frees what stays gathered (``reshard_fsdp``): nothing is left gathered between calls;
* the keys reach the workers: the actor's layers (``actor_rollout_ref.actor.fsdp_config``), the ref's
  (``actor_rollout_ref.ref.fsdp_config``) and the critic's (``critic.model.fsdp_config``) keep their parameters after
  forward.
"""

from __future__ import annotations

import copy
import os

import torch
from omegaconf import OmegaConf

from tests.rank_processes import spawn_with_data
from tests.test_config import worker_config
from tests.test_dp_actor import actor_config, make_update_data
from verl.utils.model_loading import load_causal_lm
from verl.workers.actor import DataParallelPPOActor

WORLD = 2
ROWS_PER_RANK = 4
# two optimizer steps, each over two micro-batches of one row per rank
UPDATE_CONFIG = dict(train_batch_size=2, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, use_kl_loss=False)


def _fsdp_groups(module: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in module.modules() if isinstance(m, FSDPModule)]
    return [g for g in groups if g is not None]


def _keeps_after_forward(module: torch.nn.Module) -> list[bool]:
    """Per decoder layer: True when FSDP2 keeps its gathered parameters after forward."""
    from torch.distributed.fsdp import FSDPModule

    layers = [m for m in module.modules() if isinstance(m, FSDPModule) and m is not module]
    return [m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None for m in layers]


def _log_probs_then_update(model_path: str, data, reshard: bool) -> dict:
    """The trainer's order: a log-prob pass (no grad), then update_policy; counts the gathers of each."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from verl.utils.fsdp_utils import apply_fsdp2, get_full_state_dict, init_dp_mesh, reshard_fsdp

    model = load_causal_lm(model_path, dtype="float32", attn_implementation="sdpa")
    apply_fsdp2(model, mesh=init_dp_mesh("cpu"), reshard_after_forward=reshard)
    actor = DataParallelPPOActor(actor_config(**UPDATE_CONFIG), model, torch.optim.SGD(model.parameters(), lr=1.0))
    gathers = {"n": 0}
    real = _fsdp_param_group.foreach_all_gather

    def counted(*args, **kwargs):
        gathers["n"] += 1
        return real(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted
    try:
        log_probs, _ = actor.compute_log_prob(data, calculate_entropy=False)
        gathered_after_pass = sum(g.is_unsharded for g in _fsdp_groups(model))
        reshard_fsdp(model)
        left_after_reshard = sum(g.is_unsharded for g in _fsdp_groups(model))
        pass_gathers, gathers["n"] = gathers["n"], 0
        actor.update_policy(data)
        update_gathers = gathers["n"]
    finally:
        _fsdp_param_group.foreach_all_gather = real
    return {
        "log_probs": log_probs,
        "state": get_full_state_dict(model),
        "gathered_after_pass": gathered_after_pass,
        "left_after_reshard": left_after_reshard,
        "left_after_update": sum(g.is_unsharded for g in _fsdp_groups(model)),
        "groups": len(_fsdp_groups(model)),
        "pass_gathers": pass_gathers,
        "update_gathers": update_gathers,
    }


def _rank_main(rank: int, init_file: str, model_path: str, data_file: str, configs: dict, out_dir: str):
    import torch.distributed as dist

    import verl.workers.rollout.base as rollout_base

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", VERL_SC_DEVICE="cpu")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        rows = list(range(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK))
        data = torch.load(data_file, weights_only=False)[rows]
        out = {reshard: _log_probs_then_update(model_path, data, reshard) for reshard in (True, False)}

        rollout_base.get_rollout_engine = lambda name, **kwargs: None  # the rollout is not what is tested here
        from verl.workers.critic.critic_worker import CriticWorker
        from verl.workers.fsdp_workers import ActorRolloutRefWorker

        for name in ("actor_keeps", "ref_keeps"):  # the actor's key alone, then the ref's alone
            worker = ActorRolloutRefWorker(configs[name], "cpu")
            worker.init_model()
            out[name] = (_keeps_after_forward(worker.actor_module), _keeps_after_forward(worker.ref.actor_module))
            worker.compute_log_prob(data)  # forward-only passes through the worker: nothing stays gathered after
            worker.compute_ref_log_prob(data)
            out[f"{name}_left_gathered"] = sum(
                g.is_unsharded for m in (worker.actor_module, worker.ref.actor_module) for g in _fsdp_groups(m)
            )
        critic = CriticWorker(configs["critic"], "cpu")
        critic.init_model()
        out["critic_keeps"] = _keeps_after_forward(critic.critic_module)
        critic.compute_values(data)
        out["critic_left_gathered"] = sum(g.is_unsharded for g in _fsdp_groups(critic.critic_module))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _worker_configs(model_path: str) -> dict:
    common = ["actor_rollout_ref.rollout.name=hf", "critic.model.fsdp_config.reshard_after_forward=False"]
    actor = worker_config(model_path, *common, "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=False")
    ref = worker_config(model_path, *common, "actor_rollout_ref.ref.fsdp_config.reshard_after_forward=False")
    return {
        "actor_keeps": OmegaConf.to_container(actor.actor_rollout_ref, resolve=True),
        "ref_keeps": OmegaConf.to_container(ref.actor_rollout_ref, resolve=True),
        "critic": OmegaConf.to_container(actor.critic, resolve=True),
    }


def test_keeping_layers_gathered_changes_no_number_and_halves_the_gathers(tiny_model_path, tmp_path):
    base = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
    data = make_update_data(base, num_conv=WORLD * ROWS_PER_RANK, seed=5)
    results = spawn_with_data(_rank_main, WORLD, tmp_path, tiny_model_path, data, _worker_configs(tiny_model_path))
    layers = base.config.num_hidden_layers
    for out in results:
        resharding, keeping = out[True], out[False]
        torch.testing.assert_close(keeping["log_probs"], resharding["log_probs"], atol=0, rtol=0)
        for name, value in resharding["state"].items():
            torch.testing.assert_close(keeping["state"][name], value, atol=1e-6, rtol=0, msg=name)
        # the log-prob pass (4 rows, micro-batches of 1): gathered once and kept across its micro-batches
        assert keeping["pass_gathers"] == layers + 1 < resharding["pass_gathers"]
        assert keeping["gathered_after_pass"] == keeping["groups"] and resharding["gathered_after_pass"] <= 1
        assert keeping["left_after_reshard"] == 0 and keeping["left_after_update"] == 0
        # the update (4 micro-batches): each layer once per micro-batch (forward), not again in the backward
        micro_batches = ROWS_PER_RANK
        assert keeping["update_gathers"] <= micro_batches * (layers + 1)
        assert resharding["update_gathers"] >= micro_batches * (2 * layers + 1)
        assert out["actor_keeps"] == ([True] * layers, [False] * layers)  # each model reads its own key
        assert out["ref_keeps"] == ([False] * layers, [True] * layers)
        assert out["critic_keeps"] == [True] * layers
        assert out["actor_keeps_left_gathered"] == out["ref_keeps_left_gathered"] == out["critic_left_gathered"] == 0
    moved = [k for k, v in results[0][True]["state"].items() if not torch.equal(v, copy.deepcopy(base).state_dict()[k])]
    assert len(moved) == len(results[0][True]["state"])  # the steps changed every parameter: not vacuous

"""Parameter and optimizer offload (``fsdp_config.param_offload`` / ``optimizer_offload``).

What offload does: the actor's FSDP2 parameter shards (``ActorRolloutRefWorker._resident`` with
``verl/utils/fsdp_utils.py``: ``model.cpu()``, which FSDP2 follows with ``reset_sharded_param``) live on the host
between computations and come back to the worker's device for log-probs, the update, the weight sync and
checkpoints; the reference model's parameters likewise. The AdamW moments of ``optimizer_offload`` never leave the
host: the actor's optimizer is ``OffloadedAdamW`` (``verl/utils/offload_optim.py``, tested in
``tests/test_offload_optim.py``), which streams them through the device inside ``step()``.

* CPU (the code path): two gloo ranks (FSDP2, DTensor shards) run the real worker with every offload on and with
  none; the parameter offload and reload functions are called around each computation in the expected order with
  the expected targets, no optimizer state is moved, the Adam moments are host tensors after every update and
  after a checkpoint round trip, and the parameters after two updates are bitwise those of the worker without
  offload. The load direction is observed on the meta device (every tensor moves).
* GPU (``@pytest.mark.gpu``): the sharded parameters and the per-tensor offloaded Adam moments
  (``offload_fsdp_optimizer``, for optimizers other than the actor's) really leave the GPU (allocated memory drops
  by their size), come back equal, and training with offload gives the parameters of training without.
"""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from tests.rank_processes import spawn_with_data
from tests.test_config import compose_config
from tests.test_dp_actor import make_update_data
from verl.utils.fsdp_utils import load_fsdp_model_to_gpu, load_fsdp_optimizer, offload_fsdp_optimizer
from verl.utils.model_loading import load_causal_lm

WORLD = 2
RANK_ROWS = ([0, 1], [2, 3])


def _adam_after_one_step(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def test_load_moves_every_parameter_and_every_optimizer_state_tensor(tiny_model_path) -> None:
    model = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
    optimizer = _adam_after_one_step(model)
    params = list(model.parameters())
    state = [optimizer.state[p] for p in params]
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in state)
    saved = [{k: v.clone() for k, v in s.items()} for s in state]
    # a round trip through the host keeps every value
    offload_fsdp_optimizer(optimizer)
    load_fsdp_optimizer(optimizer, "cpu")
    for before, s in zip(saved, state):
        assert all(torch.equal(before[k], s[k]) for k in before)
    # on CPU the host and the device are the same; the meta device shows that every tensor is moved
    load_fsdp_optimizer(optimizer, "meta")
    assert all(v.device.type == "meta" for s in optimizer.state.values() for v in s.values())
    load_fsdp_model_to_gpu(model, "meta")
    assert all(p.device.type == "meta" for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- the worker
def _worker_config(model_path: str, offload: bool) -> dict:
    cfg = compose_config(
        [
            f"actor_rollout_ref.model.path={model_path}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.train_batch_size=1",
            "actor_rollout_ref.rollout.name=hf",
            f"actor_rollout_ref.actor.fsdp_config.param_offload={offload}",
            f"actor_rollout_ref.actor.fsdp_config.optimizer_offload={offload}",
            f"actor_rollout_ref.ref.fsdp_config.param_offload={offload}",
        ]
    )
    return OmegaConf.to_container(cfg.actor_rollout_ref, resolve=True)


def _rank_main(rank: int, init_file: str, model_path: str, data_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    import verl.utils.fsdp_utils as fsdp_utils
    import verl.workers.rollout.base as rollout_base

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", VERL_SC_DEVICE="cpu")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    rollout_base.get_rollout_engine = lambda name, **kwargs: None  # the engine is not what is tested here
    events: list[tuple] = []

    def spy(name, fn):
        def wrapped(target, *args, **kwargs):
            if isinstance(target, torch.optim.Optimizer):
                tensors = [v for s in target.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
                events.append((name, len(tensors)))
            else:
                events.append((name, id(target), str(args[0]) if args else None))
            out = fn(target, *args, **kwargs)
            if isinstance(target, torch.optim.Optimizer) and name == "offload_optimizer":
                moved = [v for s in target.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
                assert all(v.device.type == "cpu" for v in moved)
            return out

        return wrapped

    for attr, name in (
        ("load_fsdp_model_to_gpu", "load_model"),
        ("offload_fsdp_model_to_cpu", "offload_model"),
        ("load_fsdp_optimizer", "load_optimizer"),
        ("offload_fsdp_optimizer", "offload_optimizer"),
    ):
        setattr(fsdp_utils, attr, spy(name, getattr(fsdp_utils, attr)))
    try:
        data = torch.load(data_file, weights_only=False)[list(RANK_ROWS[rank])]
        out = {offload: _run_worker(offload, model_path, data, out_dir, events, rank) for offload in (True, False)}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _host_moments(optimizer) -> list[torch.Tensor]:
    from verl.utils.offload_optim import iter_state_tensors

    tensors = list(iter_state_tensors(optimizer))
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    return [t.clone() for t in tensors]


def _run_worker(offload: bool, model_path: str, data, out_dir: str, events: list[tuple], rank: int) -> dict:
    """Init, old and ref log-probs, two updates and a checkpoint; the offload calls of each, by module name."""
    from verl.utils.fsdp_utils import get_full_state_dict
    from verl.utils.offload_optim import OffloadedAdamW
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    torch.manual_seed(0)
    worker = ActorRolloutRefWorker(_worker_config(model_path, offload), "cpu")
    worker.init_model()
    assert isinstance(worker.optimizer, OffloadedAdamW) == offload
    modules = {id(worker.actor_module): "actor", id(worker.ref.actor_module): "ref"}

    def named() -> list[tuple]:
        calls = [(c[0], modules.get(c[1], "?"), c[2]) if len(c) == 3 else c for c in events]
        events.clear()
        return calls

    log = {"init": named()}
    log_probs = [worker.compute_log_prob(data).batch["old_log_probs"].clone()]
    log["log_prob"] = named()
    log_probs.append(worker.compute_ref_log_prob(data).batch["ref_log_prob"].clone())
    log["ref_log_prob"] = named()
    worker.update_actor(data)
    log["update1"] = named()
    worker.update_actor(data)
    log["update2"] = named()
    ckpt = os.path.join(out_dir, f"ckpt_{offload}")
    worker.save_checkpoint(ckpt)
    log["save"] = named()
    moments = None
    if offload:  # the moments are host tensors between steps and survive a checkpoint round trip in place
        flats = {t.untyped_storage().data_ptr() for t in worker.optimizer._flat.values()}
        for state in worker.optimizer.state.values():  # DTensors over views of the flat host buffers
            assert {type(state[k]).__name__ for k in ("exp_avg", "exp_avg_sq")} == {"DTensor"}
            assert {state[k].to_local().untyped_storage().data_ptr() for k in ("exp_avg", "exp_avg_sq")} <= flats
        moments = _host_moments(worker.optimizer)
        for t in worker.optimizer._flat.values():
            t.zero_()
        worker.load_checkpoint(ckpt)
        log["load"] = named()
        again = _host_moments(worker.optimizer)
        assert len(again) == len(moments) and all(torch.equal(a, b) for a, b in zip(again, moments))
        assert any(bool(t.abs().sum() > 0) for t in moments)
    state = get_full_state_dict(worker.actor_module)  # a collective: every rank gathers
    return {"events": log, "state": state if rank == 0 else None, "log_probs": log_probs}


@pytest.mark.slow
def test_worker_offload_code_path_on_cpu_matches_no_offload(tiny_model_path, tmp_path) -> None:
    base = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
    data = make_update_data(base, num_conv=4, seed=5)
    results = spawn_with_data(_rank_main, WORLD, tmp_path, tiny_model_path, data)
    for out in results:
        on, off = out[True]["events"], out[False]["events"]
        assert all(not calls for calls in off.values())  # no offload configured: nothing moves
        # after init: actor and ref parked on the host; the optimizer state is never moved (it lives there)
        assert on["init"] == [
            ("load_model", "actor", "cpu"),
            ("offload_model", "actor", None),
            ("load_model", "ref", "cpu"),
            ("offload_model", "ref", None),
        ]
        assert on["log_prob"] == [("load_model", "actor", "cpu"), ("offload_model", "actor", None)]
        assert on["ref_log_prob"] == [("load_model", "ref", "cpu"), ("offload_model", "ref", None)]
        for phase in ("update1", "update2", "save", "load"):
            assert on[phase] == [("load_model", "actor", "cpu"), ("offload_model", "actor", None)], phase
        for got, want in zip(out[True]["log_probs"], out[False]["log_probs"]):
            assert torch.equal(got, want)
    with_offload, without = results[0][True]["state"], results[0][False]["state"]
    assert set(with_offload) == set(without)
    for name, value in without.items():
        assert torch.equal(with_offload[name], value), name
    initial = base.state_dict()
    changed = [name for name in without if not torch.equal(without[name], initial[name])]
    assert len(changed) == len(without)  # both updates moved every parameter: the comparison is not vacuous


# ---------------------------------------------------------------------------------------------------- GPU
def _train(model, optimizer, batches, offload: bool, drops: list[int]) -> None:
    from verl.utils.fsdp_utils import offload_fsdp_model_to_cpu

    device = torch.device("cuda", torch.cuda.current_device())
    for input_ids in batches:
        if offload:
            load_fsdp_model_to_gpu(model, device)
            load_fsdp_optimizer(optimizer, device)
        loss = model(input_ids=input_ids.to(device), labels=input_ids.to(device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if offload:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            offload_fsdp_model_to_cpu(model)
            offload_fsdp_optimizer(optimizer)
            drops.append(before - torch.cuda.memory_allocated())


@pytest.mark.gpu
def test_offload_frees_gpu_memory_and_keeps_the_training_numbers(tmp_path, monkeypatch) -> None:
    import torch.distributed as dist
    from transformers import Qwen2Config

    from verl.utils.fsdp_utils import apply_fsdp2, get_full_state_dict, init_dp_mesh
    from verl.utils.model_loading import build_causal_lm_from_config

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        config = Qwen2Config(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
        )
        mesh = init_dp_mesh("cuda")
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, 4096, (2, 64), generator=gen) for _ in range(3)]
        states, drops = {}, []
        for offload in (True, False):
            model = build_causal_lm_from_config(config, dtype="float32", attn_implementation="sdpa", seed=0)
            model = apply_fsdp2(model.cuda(), mesh=mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            _train(model, optimizer, batches, offload, drops)
            if offload:
                assert all(p.to_local().device.type == "cpu" for p in model.parameters())
                assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())
                load_fsdp_model_to_gpu(model, torch.device("cuda", 0))
                assert all(p.to_local().device.type == "cuda" for p in model.parameters())
            states[offload] = get_full_state_dict(model)
            del model, optimizer
            torch.cuda.empty_cache()
        n = sum(v.numel() for v in states[False].values())
        # fp32 parameters (4 bytes) + Adam's two fp32 moments (8 bytes) leave the GPU at every offload
        assert len(drops) == 3 and all(d >= 0.95 * 12 * n for d in drops), (drops, 12 * n)
        for name, value in states[False].items():
            torch.testing.assert_close(states[True][name], value, atol=1e-6, rtol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()

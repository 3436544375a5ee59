"""torch's fused AdamW for the actor, critic and SFT optimizers (``optim.fused``, ``verl/utils/fsdp_utils.py``).

* Numbers: N steps of the fused AdamW give the parameters of torch's default implementation (and of foreach) within
  1e-6 relative on CPU, on a plain model and on a one-rank gloo FSDP2 model (DTensor parameters and state).
* The rule (``resolve_fused_adamw``): null -> fused when every trainable parameter is on CUDA, torch's default
  otherwise; ``optimizer_offload`` -> ``OffloadedAdamW`` untouched; explicit values kept; True where torch cannot
  fuse, or with offload, is an error naming the key. ``build_optimizer`` builds what the rule says
  (``defaults['fused'] is True``), and False/CPU keep torch's default (``fused=None``: foreach on CUDA, not the
  per-tensor loop that ``fused=False`` would force).
* Checkpoints: a checkpoint's param groups carry the writer's ``fused``/``foreach``; loading keeps the configured
  implementation and the resumed run continues like the uninterrupted one.
* Config: ``optim.fused`` is null or a bool; True with ``optimizer_offload`` is refused; the SFT trainer's key.
* GPU (``@pytest.mark.gpu``): the fused step allocates no full-size temporary, foreach 4 bytes x parameters.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import verl.utils.fsdp_utils as fsdp_utils
from verl.utils.fsdp_utils import build_lr_scheduler, build_optimizer, resolve_fused_adamw
from verl.utils.model_loading import load_causal_lm
from verl.utils.offload_optim import OffloadedAdamW

STEPS = 5
KEY = "actor_rollout_ref.actor.optim.fused"


def _model(path):
    torch.manual_seed(0)
    return load_causal_lm(path, dtype="float32", attn_implementation="sdpa")


def _batches(vocab: int, count: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 12), generator=gen) for _ in range(count)]


def _train(model, optimizer, steps: int, first: int = 0) -> None:
    """``steps`` optimizer steps on fixed gradients (step ``first + i`` always gets the same ones): a real forward and
    backward (FSDP2's hooks, DTensor gradients), then each gradient overwritten with N(0, 0.01^2) of a seeded
    generator. Gradients that do not depend on the parameters keep the comparison about the optimizer: through the
    loss, rounding differences of one step would be amplified by the next steps' gradients (entries whose gradient
    is below eps move by ~lr x g / eps)."""
    scheduler = build_lr_scheduler(optimizer, 8, lr_warmup_steps=2, warmup_style="cosine", min_lr_ratio=0.1)
    with warnings.catch_warnings():  # a resumed run's schedule, before its first optimizer step
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(first):
            scheduler.step()
    ids = _batches(model.config.vocab_size, 1)[0]
    for step in range(first, first + steps):
        model(input_ids=ids, labels=ids).loss.backward()
        gen = torch.Generator().manual_seed(100 + step)
        for p in model.parameters():
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grad.copy_(torch.randn(grad.shape, generator=gen) * 0.01)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


def _assert_close(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


# ---------------------------------------------------------------------------------------------------- numbers
def test_fused_steps_give_the_parameters_of_the_default_and_foreach_steps(tiny_model_path) -> None:
    kw = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    models = {name: _model(tiny_model_path) for name in ("fused", "default", "foreach")}
    opts = {
        "fused": build_optimizer(models["fused"], fused=True, **kw),
        "default": build_optimizer(models["default"], fused=None, **kw),  # CPU: torch's default
        "foreach": torch.optim.AdamW(models["foreach"].parameters(), foreach=True, **kw),
    }
    assert opts["fused"].defaults["fused"] is True and opts["default"].defaults["fused"] is None
    for name in opts:
        _train(models[name], opts[name], STEPS)
    initial = _model(tiny_model_path).state_dict()
    moved = 0
    for (name, fused), default, foreach in zip(
        models["fused"].named_parameters(), models["default"].parameters(), models["foreach"].parameters()
    ):
        _assert_close(fused, default, name)
        _assert_close(fused, foreach, name)
        moved += not torch.allclose(fused, initial[name], rtol=1e-4, atol=0)
    assert moved == len(
        list(models["fused"].parameters())
    )  # every parameter moved well beyond the tolerance: the comparison is not vacuous
    for p_fused, p_default in zip(models["fused"].parameters(), models["default"].parameters()):
        s_fused, s_default = opts["fused"].state[p_fused], opts["default"].state[p_default]
        _assert_close(s_fused["exp_avg_sq"], s_default["exp_avg_sq"], "exp_avg_sq")
        assert float(s_fused["step"]) == float(s_default["step"]) == STEPS


def _fsdp2_worker(rank: int, init_file: str, model_path: str, out_file: str) -> None:
    """One gloo rank: the tiny model sharded with FSDP2 as the workers do it; STEPS fused and default AdamW steps."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from verl.utils.fsdp_utils import apply_fsdp2, init_dp_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        out = {}
        for fused in (True, None):
            model = apply_fsdp2(_model(model_path), mesh=init_dp_mesh("cpu"), param_dtype=torch.float32)
            opt = build_optimizer(model, lr=3e-3, weight_decay=0.1, fused=fused)
            _train(model, opt, STEPS)
            params = list(model.parameters())
            out[fused] = {
                "fused": opt.defaults["fused"],
                "dtensor_params": all(isinstance(p, DTensor) for p in params),
                "dtensor_state": all(isinstance(opt.state[p]["exp_avg_sq"], DTensor) for p in params),
                "params": {n: p.full_tensor() for n, p in model.named_parameters()},
            }
        torch.save(out, out_file)
    finally:
        dist.destroy_process_group()


def test_fused_steps_dtensor_params_of_a_one_rank_fsdp2_model(tiny_model_path, tmp_path) -> None:
    """torch's CPU fused kernel takes FSDP2's DTensor parameters (its sharding rule for ``_fused_adamw_``)."""
    from tests.rank_processes import spawn

    spawn(_fsdp2_worker, args=(str(tmp_path / "init"), str(tiny_model_path), str(tmp_path / "out.pt")), nprocs=1)
    out = torch.load(tmp_path / "out.pt")
    fused, default = out[True], out[None]
    assert fused["fused"] is True and default["fused"] is None
    assert fused["dtensor_params"] and fused["dtensor_state"]
    initial = _model(tiny_model_path).state_dict()
    for name, value in fused["params"].items():
        _assert_close(value, default["params"][name], name)
        assert not torch.allclose(value, initial[name], rtol=1e-4, atol=0), name


# ---------------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    ("fused", "devices", "offload", "expected"),
    [
        (None, {"cuda"}, False, True),  # the CUDA default
        (None, {"cpu"}, False, False),  # CPU: torch's default
        (None, {"cuda", "cpu"}, False, False),  # not every parameter on CUDA
        (None, set(), False, False),
        (None, {"cuda"}, True, False),  # optimizer_offload: OffloadedAdamW's own step
        (False, {"cuda"}, False, False),
        (False, {"cuda"}, True, False),
        (True, {"cuda"}, False, True),
        (True, {"cpu"}, False, True),  # torch 2.13 has a CPU fused AdamW
    ],
)
def test_the_rule(fused, devices, offload, expected) -> None:
    assert resolve_fused_adamw(fused, devices, offload=offload, key=KEY) is expected


def test_true_where_torch_cannot_fuse_or_with_offload_is_an_error_naming_the_key(monkeypatch) -> None:
    monkeypatch.setattr(fsdp_utils, "fused_adamw_devices", lambda: ["cuda"])  # a torch without the CPU kernel
    with pytest.raises(ValueError, match=rf"{KEY}=True but torch .* no fused AdamW for parameters on \['cpu'\]"):
        resolve_fused_adamw(True, {"cpu"}, key=KEY)
    with pytest.raises(ValueError, match=rf"{KEY}=True but"):
        build_optimizer(torch.nn.Linear(2, 2), lr=1e-3, fused=True, key=KEY)
    assert resolve_fused_adamw(None, {"cpu"}, key=KEY) is False  # null never errs
    with pytest.raises(ValueError, match=rf"{KEY}=True does not apply with fsdp_config.optimizer_offload=True"):
        resolve_fused_adamw(True, {"cuda"}, offload=True, key=KEY)
    with pytest.raises(ValueError, match=rf"{KEY} must be True, False or null \(got 'yes'\)"):
        resolve_fused_adamw("yes", {"cuda"}, key=KEY)


def test_build_optimizer_follows_the_rule(monkeypatch) -> None:
    model = torch.nn.Linear(4, 3)
    cpu = build_optimizer(model, lr=1e-3)
    # torch's default on CPU (not fused=False, which would force the per-tensor loop on CUDA too)
    assert type(cpu) is torch.optim.AdamW and cpu.defaults["fused"] is None and cpu.defaults["foreach"] is None
    monkeypatch.setattr(fsdp_utils, "_device_types", lambda params: {"cuda"})  # the parameters "on CUDA"
    on_cuda = build_optimizer(model, lr=1e-3)
    assert on_cuda.defaults["fused"] is True and on_cuda.param_groups[0]["fused"] is True
    explicit_off = build_optimizer(model, lr=1e-3, fused=False)
    assert explicit_off.defaults["fused"] is None and explicit_off.defaults["foreach"] is None  # foreach on CUDA
    offloaded = build_optimizer(model, lr=1e-3, offload=True)
    assert type(offloaded) is OffloadedAdamW and offloaded.defaults["fused"] is None
    # the fused optimizer steps (the CPU kernel here)
    model(torch.ones(2, 4)).sum().backward()
    before = model.weight.detach().clone()
    on_cuda.step()
    assert not torch.equal(before, model.weight)


def test_the_key_reaches_the_optimizer_through_build_optim_and_scheduler() -> None:
    from verl.workers.config.optimizer import CriticOptimizerConfig, OptimizerConfig

    model = torch.nn.Linear(4, 3)
    for cls in (OptimizerConfig, CriticOptimizerConfig):
        on, _ = fsdp_utils.build_optim_and_scheduler(model, cls(fused=True))
        off, _ = fsdp_utils.build_optim_and_scheduler(model, cls())
        assert on.defaults["fused"] is True and off.defaults["fused"] is None


# ---------------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("written_fused", [None, True], ids=["foreach-ckpt-into-fused", "fused-ckpt-into-foreach"])
def test_a_checkpoint_keeps_the_configured_implementation_and_resumes_like_the_uninterrupted_run(
    tiny_model_path, tmp_path, written_fused
) -> None:
    from verl.utils.checkpoint.model_state import load_model_shards, save_model_shards

    resumed_fused = None if written_fused else True

    def build(fused):
        model = _model(tiny_model_path)
        return model, build_optimizer(model, lr=2e-3, weight_decay=0.05, fused=fused)

    whole, whole_opt = build(resumed_fused)
    _train(whole, whole_opt, 4)
    first, first_opt = build(written_fused)
    _train(first, first_opt, 2)
    save_model_shards(tmp_path, first, first_opt, save_rng=False)
    resumed, opt = build(resumed_fused)
    load_model_shards(tmp_path, resumed, opt, load_rng=False)
    assert [g["fused"] for g in opt.param_groups] == [resumed_fused]  # not the writer's
    assert len(opt.state) == len(list(resumed.parameters()))  # every parameter's state loaded (all() below not vacuous)
    assert all(s["step"].dtype == torch.float32 and float(s["step"]) == 2 for s in opt.state.values())
    _train(resumed, opt, 2, first=2)
    assert opt.param_groups[0]["fused"] is resumed_fused
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        _assert_close(b, a, name)


def test_a_loaded_step_is_placed_where_the_fused_implementation_keeps_it() -> None:
    """torch places a loaded ``step`` by the *saved* groups' flags: a foreach state (its steps on the host, float64
    under a float64 default dtype) loaded into the fused optimizer needs them float32 on the parameters' device
    (on a CUDA run: on the GPU), and the fused kernel refuses anything else."""
    model = torch.nn.Linear(4, 3)
    foreach = build_optimizer(model, lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    foreach.step()
    state = foreach.state_dict()
    for values in state["state"].values():
        values["step"] = values["step"].to(torch.float64)
    fused = build_optimizer(model, lr=1e-3, fused=True)
    fused.load_state_dict(state)
    assert fused.param_groups[0]["fused"] is True
    for p in model.parameters():
        assert fused.state[p]["step"].dtype == torch.float32 and fused.state[p]["step"].device == p.device
    fused.step()
    assert all(float(fused.state[p]["step"]) == 2 for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([f"{KEY}=yes"], rf"{KEY} must be True, False or null \(got 'yes'\)"),
        (["critic.optim.fused=1"], r"critic.optim.fused must be True, False or null \(got 1\)"),
        (
            [f"{KEY}=True", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"],
            rf"{KEY}=True does not apply with actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
        ),
    ],
)
def test_config_validation_names_the_key(overrides, message) -> None:
    from tests.test_config import compose_config
    from verl.trainer.config_schema import ConfigError, validate_config

    sizes = [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=1",
    ]
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(compose_config(sizes + overrides))
    assert len(err.value.errors) == 1, err.value.errors
    for ok in ([f"{KEY}=True"], [f"{KEY}=False", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"]):
        validate_config(compose_config(sizes + ok))


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_fused_step_has_no_full_size_temporary() -> None:
    """On CUDA, null resolves to fused; the second step's peak over what was allocated before it is ~0 for fused and
    4 bytes x parameters for foreach (``torch._foreach_sqrt(exp_avg_sqs)``), the estimate's ``adam_step_temp_bytes``."""
    n = 0
    extra = {}
    for fused in (None, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(8)]).cuda()
        n = sum(p.numel() for p in model.parameters())  # 33.6M: 134 MB per fp32 copy
        opt = build_optimizer(model, lr=1e-3, fused=fused)
        assert opt.defaults["fused"] is (True if fused is None else None)
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            torch.cuda.synchronize()
            extra[fused] = torch.cuda.max_memory_allocated() - before  # the second step's (state exists)
        del model, opt
        torch.cuda.empty_cache()
    assert extra[False] >= 0.95 * 4 * n, extra
    assert extra[None] <= 0.05 * 4 * n, extra

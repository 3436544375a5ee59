"""The automatic liger-kernel choice (``model.use_liger: null``, ``verl/utils/liger.py``): on exactly when the
device the model is loaded for is CUDA, ``liger_kernel`` imports, ``compile_layers`` is off and liger-kernel patches
the model's type; explicit ``True``/``False`` kept; ``True`` with ``compile_layers`` refused at validation and at
load. CUDA and liger-kernel cannot exist here: ``torch.cuda.is_available`` and the probe ``liger_model_types`` are
faked (as the attention tests fake CUDA and torch's varlen)."""

from __future__ import annotations

import itertools
import logging

import pytest
from transformers import LlamaConfig, Qwen2Config

from verl.utils import liger, model_loading
from verl.utils.liger import resolve_use_liger, unsupported

PATCHED = frozenset({"qwen2", "llama"})  # the faked liger table


def _no_liger():
    raise ModuleNotFoundError("No module named 'liger_kernel'")


@pytest.fixture
def fake_host(monkeypatch):
    """``fake_host(cuda, importable)``: whether the host has CUDA and whether liger_kernel imports (with PATCHED)."""

    def set_host(cuda: bool = True, importable: bool = True):
        monkeypatch.setattr(liger.torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(liger, "liger_model_types", (lambda: PATCHED) if importable else _no_liger)

    return set_host


class UnpatchedConfig(Qwen2Config):
    model_type = "not_in_ligers_table"


CASES = list(itertools.product(["cuda", "cuda:1", "cpu", None], [True, False], [True, False], [True, False]))


@pytest.mark.parametrize(("device", "importable", "compile_layers", "patched"), CASES)
@pytest.mark.parametrize("host_cuda", [True, False], ids=["gpu-host", "cpu-host"])
def test_truth_table(fake_host, host_cuda, device, importable, compile_layers, patched):
    """Each condition flips the choice on its own: on only when all hold; the device given wins over the host's."""
    fake_host(cuda=host_cuda, importable=importable)
    config = Qwen2Config() if patched else UnpatchedConfig()
    on_cuda = device.startswith("cuda") if device is not None else host_cuda
    expected = on_cuda and importable and not compile_layers and patched
    chosen = resolve_use_liger(None, device, model_config=config, compile_layers=compile_layers)
    assert chosen is expected
    assert (unsupported(device, config, compile_layers) == "") is expected
    for requested in (True, False):  # asked for: kept, whatever holds
        assert resolve_use_liger(requested, device, model_config=config, compile_layers=compile_layers) is requested


def test_reasons_name_what_rules_liger_out_in_order(fake_host):
    fake_host(cuda=True, importable=False)
    cpu = "the model is loaded on cpu; liger-kernel's Triton kernels need CUDA"
    assert unsupported("cpu", UnpatchedConfig(), compile_layers=True) == cpu
    assert unsupported("cuda", UnpatchedConfig(), compile_layers=True).startswith("compile_layers is on")
    no_import = "liger_kernel does not import (ModuleNotFoundError: No module named 'liger_kernel')"
    assert unsupported("cuda", UnpatchedConfig()) == no_import
    fake_host(cuda=False, importable=True)
    assert (
        unsupported(None, Qwen2Config())
        == "the model is loaded on this host (no CUDA); liger-kernel's Triton kernels need CUDA"
    )
    assert unsupported("cuda", UnpatchedConfig()) == "liger-kernel has no kernels for model type 'not_in_ligers_table'"
    assert unsupported("cuda", LlamaConfig()) == "" == unsupported("cuda", None)  # no config: its type is not checked


def test_the_choice_is_logged_with_its_reason(fake_host, caplog):
    fake_host(cuda=True, importable=True)
    with caplog.at_level(logging.INFO, logger="verl.utils.liger"):
        assert resolve_use_liger(None, "cuda", model_config=Qwen2Config()) is True
        assert resolve_use_liger(None, "cuda", model_config=UnpatchedConfig(), key="model.use_liger") is False
        assert resolve_use_liger(True, "cpu") is True  # explicit: nothing to log
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]
    assert caplog.records[0].getMessage().startswith("actor_rollout_ref.model.use_liger=null -> True: CUDA")
    assert caplog.records[1].getMessage() == (
        "model.use_liger=null -> False: liger-kernel has no kernels for model type 'not_in_ligers_table'"
    )


def test_the_probe_reads_ligers_table_or_raises():
    """The real probe here: liger-kernel is not installed on this CPU machine, so importing it raises."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            liger.liger_model_types()
    else:  # a machine with liger-kernel: its table, with the types this project trains
        assert {"qwen2", "llama"} <= liger.liger_model_types()


def test_explicit_true_is_skipped_with_a_warning_where_liger_cannot_patch(fake_host, caplog, tiny_model_path):
    """``apply_liger_kernel`` (explicit True): the model's device, not the host's, decides; an unpatched type or a
    missing package is a warning; nothing is imported from liger_kernel (absent here) in these cases."""
    model = model_loading.load_causal_lm(str(tiny_model_path))
    fake_host(cuda=True, importable=True)
    with caplog.at_level(logging.WARNING, logger="verl.utils.liger"):
        assert liger.apply_liger_kernel(model, "cpu") is False  # a CPU model on a GPU host
        model.config.model_type = "not_in_ligers_table"
        assert liger.apply_liger_kernel(model, "cuda") is False
        fake_host(cuda=True, importable=False)
        model.config.model_type = "qwen2"
        assert liger.apply_liger_kernel(model, "cuda") is False
    assert [r.getMessage() for r in caplog.records] == [
        "use_liger=True ignored: liger-kernel needs CUDA (its Triton kernels have no CPU backend)",
        "use_liger=True ignored: liger-kernel has no kernels for model type 'not_in_ligers_table'",
        "use_liger=True ignored: liger_kernel does not import (ModuleNotFoundError: No module named 'liger_kernel')",
    ]
    assert not liger.liger_applied(model)


def test_liger_applied_sees_ligers_instance_patch(tiny_model_path):
    """liger patches a built model by binding its ``forward`` on each norm/MLP instance (the class stays): that
    counts, as does a liger class; a plain model does not."""
    model = model_loading.load_causal_lm(str(tiny_model_path))
    assert not liger.liger_applied(model)

    def forward(self, hidden_states):
        return hidden_states

    forward.__module__ = "liger_kernel.transformers.rms_norm"
    norm = model.model.norm
    norm.__dict__["forward"] = forward.__get__(norm, type(norm))
    assert liger.liger_applied(model)
    del norm.__dict__["forward"]
    norm.__class__ = type("LigerRMSNorm", (type(norm),), {"__module__": "liger_kernel.transformers.rms_norm"})
    assert liger.liger_applied(model)


def test_loader_refuses_liger_with_compile_layers_and_resolves_null(fake_host, tiny_model_path, monkeypatch):
    """``prepare_for_training``: True + compile_layers raises naming both keys; null is resolved with the model's
    config and the device it was loaded for (CPU here: off, on a faked GPU host)."""
    fake_host(cuda=True, importable=True)
    with pytest.raises(ValueError, match=r"use_liger=True with actor_rollout_ref.model.compile_layers=True"):
        model_loading.load_causal_lm(str(tiny_model_path), use_liger=True, compile_layers=True)
    seen, applied = [], []
    real = model_loading.resolve_use_liger

    def spy(requested, device=None, **kwargs):
        seen.append((requested, device, kwargs["model_config"].model_type, kwargs["compile_layers"]))
        return real(requested, device, **kwargs)

    monkeypatch.setattr(model_loading, "resolve_use_liger", spy)
    monkeypatch.setattr(model_loading, "apply_liger_kernel", lambda model, device=None: applied.append(device))
    model_loading.load_causal_lm(str(tiny_model_path), use_liger=None, device="cpu")
    assert seen == [(None, "cpu", "qwen2", False)] and applied == []
    model_loading.load_causal_lm(str(tiny_model_path), use_liger=None)  # no device: the (faked) GPU host's choice
    assert applied == [None]


def _worker_config(tiny_model_path, *extra):
    from tests.test_config import compose_config

    return compose_config(
        [
            f"actor_rollout_ref.model.path={tiny_model_path}",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            *extra,
        ]
    )


def test_cpu_workers_on_a_gpu_host_keep_liger_off(tiny_model_path, fake_host, monkeypatch, caplog):
    """A real CPU actor/ref worker (trainer.device=cpu on a GPU machine) with the default ``use_liger: null``: off,
    logged once, nothing patched, though the host has CUDA and liger-kernel (both faked)."""
    import verl.workers.rollout.base as rollout_base
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    fake_host(cuda=True, importable=True)
    assert resolve_use_liger(None, None, model_config=Qwen2Config()) is True  # control: the host's choice is on
    applied = []
    monkeypatch.setattr(model_loading, "apply_liger_kernel", lambda model, device=None: applied.append(device))
    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kwargs: None)
    cfg = _worker_config(tiny_model_path)
    assert cfg.actor_rollout_ref.model.use_liger is None  # the default
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, "cpu")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="verl.utils.liger"):
        worker.init_model()
    assert applied == [] and worker.ref is not None
    assert not liger.liger_applied(worker.actor_module) and not liger.liger_applied(worker.ref.actor_module)
    logged = [r.getMessage() for r in caplog.records]
    assert logged == [
        "actor_rollout_ref.model.use_liger=null -> False: the model is loaded on cpu; liger-kernel's Triton "
        "kernels need CUDA"
    ]


@pytest.mark.parametrize(
    ("given", "compile_layers"),
    [(None, False), (None, True), (True, False), (False, False)],
    ids=["null", "null-compile-layers", "true", "false"],
)
def test_worker_resolves_once_and_the_ref_follows_the_actor(tiny_model_path, monkeypatch, given, compile_layers):
    """The worker resolves null once, for its device, the model's config and compile_layers, and hands the result to
    the actor and the ref model; explicit values reach both unchanged, unresolved."""
    import verl.utils.liger as liger_module
    import verl.workers.rollout.base as rollout_base
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    resolved, loads = [], []
    real_load = model_loading.load_causal_lm

    def resolve(requested, device=None, **kwargs):
        resolved.append((requested, str(device), type(kwargs["model_config"]).__name__, kwargs["compile_layers"]))
        return not kwargs["compile_layers"]  # as on a GPU with liger-kernel

    def load(*args, **kwargs):
        loads.append(kwargs["use_liger"])
        return real_load(*args, **{**kwargs, "use_liger": False})

    monkeypatch.setattr(liger_module, "resolve_use_liger", resolve)
    monkeypatch.setattr(model_loading, "load_causal_lm", load)
    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kwargs: None)
    extra = [] if given is None else [f"actor_rollout_ref.model.use_liger={given}"]
    extra += [f"actor_rollout_ref.model.compile_layers={compile_layers}"]
    ActorRolloutRefWorker(_worker_config(tiny_model_path, *extra).actor_rollout_ref, "cpu").init_model()
    if given is None:
        assert resolved == [(None, "cpu", "Qwen2Config", compile_layers)]
        assert loads == [not compile_layers] * 2
    else:
        assert resolved == [] and loads == [given, given]


def test_liger_with_compile_layers_is_refused_at_validation(tmp_path):
    """Explicit ``use_liger=True`` with ``compile_layers=True``: a ConfigError naming both keys, why and what to do,
    on either device; null (or False) with compile_layers, and True without it, pass."""
    from tests.test_config import compose_config, script_overrides
    from verl.trainer.config_schema import ConfigError, validate_config

    base = script_overrides("run_memory_7B.sh", tmp_path) + ["actor_rollout_ref.model.attn_implementation=sdpa"]
    m = "actor_rollout_ref.model"
    for device in ("cpu", "cuda"):
        both = base + [f"{m}.use_liger=True", f"{m}.compile_layers=True", f"trainer.device={device}"]
        with pytest.raises(ConfigError) as err:
            validate_config(compose_config(both))
        message = str(err.value)
        assert f"{m}.use_liger=True with {m}.compile_layers=True is not supported: dynamo cannot trace" in message
        assert "LigerRMSNormFunction.apply" in message and "set one of them to False" in message
        assert f"leave {m}.use_liger null" in message
        for ok in ([f"{m}.compile_layers=True"], [f"{m}.use_liger=False", f"{m}.compile_layers=True"]):
            validate_config(compose_config(base + ok + [f"trainer.device={device}"]))
        validate_config(compose_config(base + [f"{m}.use_liger=True", f"trainer.device={device}"]))
    with pytest.raises(ConfigError, match=rf"{m}.use_liger must be True, False or null \(got 'yes'\)"):
        validate_config(compose_config(base + [f"{m}.use_liger=yes"]))

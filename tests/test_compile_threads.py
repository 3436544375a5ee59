"""Inductor compile threads after vLLM (``verl/utils/compile_threads.py``).

``import vllm`` sets ``TORCHINDUCTOR_COMPILE_THREADS=1``; a fresh interpreter shows what that does to inductor and
that building a real (CPU) vLLM engine through ``VLLMRolloutEngine`` gives the training side torch's default back,
unless the user chose a value before. Each case runs in its own interpreter because ``torch._inductor.config``
reads the variable once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from verl.utils import compile_threads

PROBE = r"""
import json, os
import verl  # records the user's setting (unless inherited), imports torch._inductor.config via transformers
import torch._inductor.config as cfg
before = cfg.compile_threads
import vllm  # noqa: F401  (sets TORCHINDUCTOR_COMPILE_THREADS=1)
from verl.utils.compile_threads import restore_after_vllm
returned = restore_after_vllm()
print(json.dumps({"env": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"), "before": before,
                  "after": cfg.compile_threads, "returned": returned}))
"""
DEFAULT = min(32, compile_threads.usable_cpus())


def _start_probe(env_extra: dict[str, str]) -> subprocess.Popen:
    drop = ("TORCHINDUCTOR_COMPILE_THREADS", compile_threads.USER_SETTING_ENV)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra)
    return subprocess.Popen(
        [sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _result(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


# the three environments the vLLM tests probe, each in its own interpreter
CASES = {
    "vllm_in_the_worker_env": {"TORCHINDUCTOR_COMPILE_THREADS": "1", compile_threads.USER_SETTING_ENV: ""},
    "user_chose_serial": {"TORCHINDUCTOR_COMPILE_THREADS": "1"},
    "nothing_set": {},
}


@pytest.fixture(scope="module")
def probes() -> dict[str, dict]:
    """Every probe's interpreter starts at once (each spends ~5 s importing torch and vLLM, mostly on one core):
    the module waits for the slowest instead of their sum."""
    started = {name: _start_probe(env) for name, env in CASES.items()}
    try:
        return {name: _result(proc) for name, proc in started.items()}
    finally:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.vllm
@pytest.mark.skipif(DEFAULT <= 1, reason="one CPU: inductor compiles serially anyway")
def test_a_worker_started_after_vllm_was_imported_compiles_in_parallel_again(probes):
    """A Ray worker inherits the driver's environment: vLLM's ``1`` and verl's record that the user set nothing."""
    got = probes["vllm_in_the_worker_env"]
    assert got["env"] == "1"  # vLLM's override stays in the environment (for the processes vLLM starts)
    assert got["before"] == 1  # inductor read vLLM's value: serial Triton compiles in this process
    assert got["after"] == DEFAULT and got["returned"] == DEFAULT


@pytest.mark.vllm
def test_the_users_own_setting_stands(probes):
    got = probes["user_chose_serial"]  # the user chose serial compiles before verl started
    assert got["before"] == 1 and got["after"] == 1 and got["returned"] is None
    got = probes["nothing_set"]  # nothing set, verl imported before vLLM: inductor already parallel, nothing to do
    assert got["before"] == DEFAULT and got["after"] == DEFAULT and got["returned"] is None


def test_building_the_engine_restores_the_threads(monkeypatch):
    """``VLLMRolloutEngine`` calls the restore once its engine exists (the driver stands in for vLLM here)."""
    from verl.workers.rollout import vllm_engine

    order: list[str] = []

    class Driver:
        max_model_len, tokenizer = 1024, None

        def __init__(self, args, engine_stream="shared"):
            order.append("engine")

    monkeypatch.setattr(vllm_engine, "_InprocDriver", Driver)
    monkeypatch.setattr(vllm_engine, "restore_after_vllm", lambda: order.append("restore"))
    vllm_engine.VLLMRolloutEngine("/m")
    assert order == ["engine", "restore"]


def test_remember_keeps_the_first_record(monkeypatch):
    monkeypatch.delenv(compile_threads.USER_SETTING_ENV, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")
    compile_threads.remember_user_setting()
    assert os.environ[compile_threads.USER_SETTING_ENV] == "4"
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # vLLM's override later
    compile_threads.remember_user_setting()
    assert os.environ[compile_threads.USER_SETTING_ENV] == "4"


def test_restore_leaves_a_parallel_setting_alone(monkeypatch):
    import torch._inductor.config as cfg

    monkeypatch.setenv(compile_threads.USER_SETTING_ENV, "")
    with cfg.patch(compile_threads=5):
        assert compile_threads.restore_after_vllm() is None and cfg.compile_threads == 5
    with cfg.patch(compile_threads=1):
        assert compile_threads.restore_after_vllm() == (DEFAULT if DEFAULT > 1 else None)
        assert cfg.compile_threads == max(DEFAULT, 1)


def test_restore_on_a_torch_without_utils_cpu_count(monkeypatch):
    """torch 2.11 has no ``torch._utils.cpu_count`` (the 135M rollout benchmark died on it on a GPU machine): the
    count falls back to the CPUs this process may use."""
    import torch._inductor.config as cfg

    monkeypatch.delattr(torch._utils, "cpu_count", raising=False)
    monkeypatch.setenv(compile_threads.USER_SETTING_ENV, "")
    expected = min(32, len(os.sched_getaffinity(0)))
    assert compile_threads.usable_cpus() == len(os.sched_getaffinity(0))
    with cfg.patch(compile_threads=1):
        assert compile_threads.restore_after_vllm() == (expected if expected > 1 else None)

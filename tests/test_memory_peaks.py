"""Per-phase GPU peaks of the actor worker (``perf/max_memory_allocated_gb/<phase>``, verl/workers/memory_peaks.py)
and each phase's growth over what was allocated as it started (``perf/phase_growth_gb/<phase>``).

torch's device counters (``memory_allocated`` / ``max_memory_allocated`` / ``reset_peak_memory_stats``) need CUDA; a counter with the same
semantics stands in for them (allocations planted by forward hooks and stub engines), on one in-process CPU worker
(tiny Qwen2) for the wiring of each phase."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.test_log_prob_budgets import build_worker
from verl.utils.model_loading import load_causal_lm
from verl.workers.memory_peaks import GROWTH_PREFIX, IN_USE_PREFIX, METRIC_PREFIX, PhasePeaks, memory_metrics

GIB = 2**30


class FakeDeviceCounter:
    """``torch.cuda``'s allocated-bytes counter: the peak since the last reset, a reset sets it to the current; and
    the caching allocator's reserved bytes (kept after a free until ``empty_cache``), whose peak a reset clears too."""

    def __init__(self, current_gib: float = 0.0):
        self.current = int(current_gib * GIB)
        self.peak = self.current
        self.reserved = self.reserved_peak = self.current

    def alloc(self, gib: float) -> None:
        self.current += int(gib * GIB)
        self.peak = max(self.peak, self.current)
        self.reserved = max(self.reserved, self.current)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, gib: float) -> None:
        self.current -= int(gib * GIB)

    def empty_cache(self) -> None:
        self.reserved = self.current

    def memory_allocated(self, device=None) -> int:
        return self.current

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def max_memory_reserved(self, device=None) -> int:
        return self.reserved_peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak = self.current
        self.reserved_peak = self.reserved


@pytest.fixture
def counter(monkeypatch):
    fake = FakeDeviceCounter(current_gib=10)
    monkeypatch.setattr(torch.cuda, "memory_allocated", fake.memory_allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", fake.max_memory_reserved)
    monkeypatch.setattr(torch.cuda, "empty_cache", fake.empty_cache)
    return fake


def _gib(report: dict) -> dict:
    """The peaks per phase (GiB) of a report."""
    return {k.removeprefix(METRIC_PREFIX): round(v, 6) for k, v in report.items() if k.startswith(METRIC_PREFIX)}


def _growth(report: dict) -> dict:
    """The growth per phase (GiB) of a report."""
    return {k.removeprefix(GROWTH_PREFIX): round(v, 6) for k, v in report.items() if k.startswith(GROWTH_PREFIX)}


def test_each_phase_keeps_its_own_peak_and_the_process_peak_survives_the_resets(counter):
    peaks = PhasePeaks(enabled=True)
    counter.alloc(20)  # before any phase: 30 GiB, the process peak so far
    counter.free(20)
    with peaks.phase("rollout"):
        counter.alloc(7)
        counter.free(7)
    with peaks.phase("log-prob"):
        counter.alloc(3)
        counter.free(3)
    with peaks.phase("rollout"):  # a second generation call of the same step: the larger of the two
        counter.alloc(9)
        counter.free(9)
    report = peaks.report()
    assert _gib(report) == {"rollout": 19.0, "log-prob": 13.0}
    assert _growth(report) == {"rollout": 9.0, "log-prob": 3.0}  # each started with 10 GiB allocated
    assert peaks.report() == {}  # reported once
    assert peaks.lifetime_peaks()[0] == 30 * GIB
    with peaks.phase("update"):
        counter.alloc(1)
        counter.free(1)
    report = peaks.report()
    assert _gib(report) == {"update": 11.0} and _growth(report) == {"update": 1.0}


def test_growth_is_the_peak_over_what_that_call_started_with(counter):
    """A pool held across phases (vLLM's sleep-mode pool counts as allocated) is in every peak, not in the growth.
    Of repeated calls of a phase, the one with the largest peak is kept with its own start (not the smallest start of
    all the calls: no call grew by that); on equal peaks the one that grew more."""
    peaks = PhasePeaks(enabled=True)
    with peaks.phase("update"):  # starts at 10, peaks at 13
        counter.alloc(3)
        counter.free(3)
    counter.alloc(40)  # the rollout engine's pool, held from here on
    with peaks.phase("update"):  # starts at 50, peaks at 51: the larger peak, with its own growth
        counter.alloc(1)
        counter.free(1)
    with peaks.phase("rollout"):
        counter.alloc(2)
        counter.free(2)
    report = peaks.report()
    assert _gib(report) == {"update": 51.0, "rollout": 52.0}
    assert _growth(report) == {"update": 1.0, "rollout": 2.0}
    counter.alloc(4)  # held for a while: 54 allocated
    with peaks.phase("ref"):  # starts at 54, peaks at 56
        counter.alloc(2)
        counter.free(2)
    counter.free(4)
    with peaks.phase("ref"):  # starts at 50, peaks at 56 too: grew by 6, more than the first call's 2
        counter.alloc(6)
        counter.free(6)
    with peaks.phase("ref"):  # starts at 50, peaks at 55: a smaller peak, not kept
        counter.alloc(5)
        counter.free(5)
    with peaks.phase("log-prob"):  # a phase that keeps what it allocates grows by it
        counter.alloc(3)
    report = peaks.report()
    assert _gib(report) == {"ref": 56.0, "log-prob": 53.0}
    assert _growth(report) == {"ref": 6.0, "log-prob": 3.0}


def test_phases_running_at_the_same_time_report_nothing(counter):
    """rollout_overlap: generation (rollout thread) during the update (train thread); one counter mixes them."""
    peaks = PhasePeaks(enabled=True)
    in_update, generated = threading.Event(), threading.Event()

    def generation():
        in_update.wait()
        with peaks.phase("rollout"):
            counter.alloc(5)
            counter.free(5)
        generated.set()

    thread = threading.Thread(target=generation)
    thread.start()
    with peaks.phase("update"):
        counter.alloc(2)
        in_update.set()
        generated.wait()
        counter.free(2)
    thread.join()
    assert peaks.report() == {}
    assert peaks.lifetime_peaks()[0] == 17 * GIB
    with peaks.phase("update"):  # the next report, without overlap, is per phase again
        counter.alloc(2)
        counter.free(2)
    assert _gib(peaks.report()) == {"update": 12.0}


def test_a_phase_running_across_a_report_leaves_the_next_report_empty(counter):
    """rollout_overlap: the update's metrics are reported while the rollout thread generates; that generation's peak
    (counted from its start, before the report) lands in the next report, which therefore says nothing per phase."""
    peaks = PhasePeaks(enabled=True)
    with peaks.phase("log-prob"):
        counter.alloc(3)
        counter.free(3)
    started, reported = threading.Event(), threading.Event()

    def generation():
        with peaks.phase("rollout"):
            counter.alloc(6)
            started.set()
            reported.wait()
            counter.free(6)

    thread = threading.Thread(target=generation)
    thread.start()
    started.wait()
    assert _gib(peaks.report()) == {"log-prob": 13.0}  # ended before the generation began: its own peak
    reported.set()
    thread.join()
    assert peaks.report() == {}
    assert peaks.lifetime_peaks()[0] == 16 * GIB


def test_disabled_touches_no_device_counter(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CPU worker must not read CUDA counters")

    monkeypatch.setattr(torch.cuda, "memory_allocated", no_cuda)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", no_cuda)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", no_cuda)
    peaks = PhasePeaks(enabled=False)
    with peaks.phase("update"):
        pass
    assert peaks.report() == {} and peaks.lifetime_peaks()[0] == 0
    assert set(memory_metrics("cpu", peaks)) == {"perf/cpu_memory_peak_rss_gb"}
    assert peaks.lifetime_peaks()[1] == 0


def test_memory_metrics_reports_the_process_peak_across_resets(counter, monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 40 * GIB)
    peaks = PhasePeaks(enabled=True)
    counter.alloc(25)
    counter.free(25)
    with peaks.phase("update"):
        counter.alloc(4)
        counter.free(4)
    out = memory_metrics("cuda", peaks)
    assert out["perf/max_memory_allocated_gb"] == 35.0  # not the last phase's 14
    assert out[METRIC_PREFIX + "update"] == 14.0
    assert out[GROWTH_PREFIX + "update"] == 4.0  # started with 10 GiB allocated


def test_memory_metrics_reports_the_process_reserved_peak_across_resets(counter):
    """torch's reset clears the reserved peak too: 30 GiB reserved before the phases (the cache emptied since) is
    still the process's reserved peak, not the 14 GiB reserved since the update phase began."""
    peaks = PhasePeaks(enabled=True)
    counter.alloc(20)
    counter.free(20)
    counter.empty_cache()
    with peaks.phase("update"):
        counter.alloc(4)
        counter.free(4)
    assert torch.cuda.max_memory_reserved() == 14 * GIB  # what the counter alone says after the phase's reset
    out = memory_metrics("cuda", peaks)
    assert out["perf/max_memory_reserved_gb"] == 30.0
    assert out["perf/max_memory_allocated_gb"] == 30.0
    assert peaks.lifetime_peaks()[1] == 30 * GIB


class _StubEngine:
    """The rollout engine's calls the worker makes in generate and the weight sync, each planting GPU memory."""

    def __init__(self, counter: FakeDeviceCounter):
        self.counter = counter

    def generate_requests(self, prompts, sampling_params):
        self.counter.alloc(7)
        self.counter.free(7)
        return [[1] for _ in prompts]

    def wake_up(self, tags=None):
        pass

    def update_weights(self, bucket):
        self.counter.alloc(1)
        self.counter.free(1)

    def step_counters(self):
        return None  # no step loop of its own (RolloutEngine's default)


def test_worker_phases_are_measured_where_they_run(monkeypatch, tiny_model_path, counter):
    """generate -> rollout, compute_log_prob -> log-prob, compute_ref_log_prob -> ref, update_actor -> update (its
    metrics carry the step's phases), sync_rollout_weights -> sync (in the next update's metrics)."""
    model = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
    from tests.test_dp_actor import make_update_data

    data = make_update_data(model, num_conv=4, seed=5)
    worker = build_worker(monkeypatch, tiny_model_path)
    worker.phase_peaks = PhasePeaks(enabled=True)
    worker.rollout = _StubEngine(counter)

    def planted(gib_no_grad: float, gib_grad: float):
        def pre(_module, _args):
            counter.alloc(gib_grad if torch.is_grad_enabled() else gib_no_grad)

        def post(_module, _args, _out):
            counter.free(gib_grad if torch.is_grad_enabled() else gib_no_grad)

        return pre, post

    for module, (lp, upd) in ((worker.actor_module, (3, 5)), (worker.ref.actor_module, (2, 2))):
        pre, post = planted(lp, upd)
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    counter.alloc(40)  # the rollout engine's pool: torch counts it as allocated in every phase, asleep or not
    worker.generate([[1, 2, 3]], {"max_tokens": 1})
    worker.compute_log_prob(data)
    worker.compute_ref_log_prob(data)
    metrics = worker.update_actor(data)
    assert _gib(metrics) == {"rollout": 57.0, "log-prob": 53.0, "ref": 52.0, "update": 55.0}
    assert _growth(metrics) == {"rollout": 7.0, "log-prob": 3.0, "ref": 2.0, "update": 5.0}
    worker.sync_rollout_weights()
    metrics = worker.update_actor(data)
    assert _gib(metrics) == {"sync": 51.0, "update": 55.0}
    assert _growth(metrics) == {"sync": 1.0, "update": 5.0}


def test_in_use_subtracts_what_the_sleeping_engine_released(counter):
    """vLLM's sleep-mode pool counts as allocated also while released (7B shape on one H200: the update's peak read
    167.6 GiB on a 140 GiB GPU). A phase that ran with the pool released at its start and its end reports its peak
    less that; one that woke the engine (the weight sync) reports its whole peak; without a source, no such key."""
    released = {"bytes": 0}
    peaks = PhasePeaks(enabled=True, released=lambda: released["bytes"])
    counter.alloc(40)  # the engine's pool: 50 GiB allocated
    with peaks.phase("rollout"):  # awake
        counter.alloc(5)
        counter.free(5)
    released["bytes"] = 40 * GIB  # sleep: the pool's memory goes back to the device, torch still counts it
    with peaks.phase("update"):
        counter.alloc(30)
        counter.free(30)
    with peaks.phase("sync"):  # starts asleep, wakes the engine
        counter.alloc(1)
        released["bytes"] = 0
        counter.free(1)
    report = peaks.report()
    in_use = {k.removeprefix(IN_USE_PREFIX): v for k, v in report.items() if k.startswith(IN_USE_PREFIX)}
    assert _gib(report) == {"rollout": 55.0, "update": 80.0, "sync": 51.0}
    assert in_use == {"rollout": 55.0, "update": 40.0, "sync": 51.0}
    assert _growth(report) == {"rollout": 5.0, "update": 30.0, "sync": 1.0}  # unchanged by the source

    plain = PhasePeaks(enabled=True)
    with plain.phase("update"):
        counter.alloc(1)
        counter.free(1)
    assert not [k for k in plain.report() if k.startswith(IN_USE_PREFIX)]


class _FreeBytes:
    """The device's free bytes as the driver counts them: sleep releases the pool, each wake-up takes a part back."""

    def __init__(self):
        self.free = 10 * GIB
        self.cached = 0  # torch's cached, unallocated blocks (vLLM's sleep ends with torch.cuda.empty_cache())
        self.freed_elsewhere = 0  # bytes another allocator frees while a wake-up runs

    def empty_cache(self):
        self.free, self.cached = self.free + self.cached, 0

    def call(self, name, **kwargs):
        if name == "sleep":
            self.free += 69 * GIB
            self.empty_cache()
        elif name == "wake_up":
            self.free -= sum({"weights": 15, "kv_cache": 54}[t] for t in kwargs["tags"]) * GIB
            self.free += self.freed_elsewhere


def _engine(vllm_engine, driver, backend):
    eng = object.__new__(vllm_engine.VLLMRolloutEngine)
    eng.backend, eng.enable_sleep_mode, eng.sleep_level, eng._driver = backend, True, 2, driver
    eng._asleep, eng._sleeping_tags, eng._weights_discarded, eng._released_bytes = False, set(), False, 0
    return eng


def test_engine_counts_what_its_sleep_released_until_woken(monkeypatch):
    """``VLLMRolloutEngine.released_bytes``: the device's free bytes after sleep minus before, less each wake-up's
    take; 0 once all is awake. The driver stands in for vLLM (sleep mode needs CUDA)."""
    from verl.workers.rollout import vllm_engine

    device = _FreeBytes()
    monkeypatch.setattr(vllm_engine, "_device_free_bytes", lambda: device.free)
    monkeypatch.setattr(vllm_engine, "_empty_cache", device.empty_cache)
    eng = _engine(vllm_engine, device, "inproc")
    assert eng.released_bytes == 0
    device.cached = 2 * GIB  # e.g. the weight sync's buckets: never allocated, so not the engine's release
    eng.sleep()
    assert eng.released_bytes == 69 * GIB
    eng.sleep()  # already asleep: nothing more
    assert eng.released_bytes == 69 * GIB
    eng.wake_up(tags=["weights"])
    assert eng.released_bytes == 54 * GIB
    device.freed_elsewhere = 3 * GIB  # the wake-up seems to take only 51 GiB: the last wake-up still ends at 0
    eng.wake_up(tags=["kv_cache"])
    assert eng.released_bytes == 0


def test_engine_in_another_process_releases_nothing_of_this_process(monkeypatch):
    """``backend="async_llm"``: vLLM's pool lives in the engine-core process, so this process's torch counters never
    had it; the device's free bytes still rise at its sleep, and subtracting them would understate a phase's memory."""
    from verl.workers.rollout import vllm_engine

    device = _FreeBytes()
    monkeypatch.setattr(vllm_engine, "_device_free_bytes", lambda: device.free)
    monkeypatch.setattr(vllm_engine, "_empty_cache", device.empty_cache)
    eng = _engine(vllm_engine, device, "async_llm")
    eng.sleep()
    assert device.free == 79 * GIB and eng.released_bytes == 0
    eng.wake_up()
    assert eng.released_bytes == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_peak_rss_is_the_processes_own_not_its_parents():
    """``perf/cpu_memory_peak_rss_gb`` is this process's VmHWM; a process this one starts while holding 1.5 GiB more
    reports its own peak (``ru_maxrss``, carried over fork and exec on Linux, would report this process's)."""
    from verl.utils.host_memory import peak_rss_bytes

    ballast = torch.ones(3 * 2**27, dtype=torch.float32)  # 1.5 GiB, touched
    with open("/proc/self/status") as f:
        hwm_gib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    assert memory_metrics("cpu")["perf/cpu_memory_peak_rss_gb"] == pytest.approx(hwm_gib, rel=0.01)
    probe = "from verl.utils.host_memory import peak_rss_bytes; print(peak_rss_bytes())"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    child_gib = int(out.stdout) / 2**30
    assert 0.005 < child_gib < hwm_gib - 1.0
    assert peak_rss_bytes() / 2**30 == pytest.approx(hwm_gib, rel=0.01)
    del ballast

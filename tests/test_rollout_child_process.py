"""ChildProcessEngine: the HF rollout engine run in a child process, compared with the same engine in process (CPU)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_rollout_hf import PROMPTS, _perturbed
from verl.workers.rollout import SamplingParams, child_process, get_rollout_engine
from verl.workers.rollout.child_process import ChildProcessEngine, EngineProcessError, pack_flat, unpack_flat

GREEDY = SamplingParams(greedy=True, max_tokens=8, logprobs=True)


def _kwargs(path) -> dict:
    return dict(model=str(path), device="cpu", dtype="float32", max_batch_size=4, max_model_len=128)


def _tokens(outputs) -> list[list[list[int]]]:
    return [[o.token_ids for o in outs] for outs in outputs]


@pytest.fixture(scope="module")
def child(varied_path):
    eng = ChildProcessEngine("hf", _kwargs(varied_path), start_timeout_s=300)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def local(varied_path):
    eng = get_rollout_engine("hf", **_kwargs(varied_path))
    yield eng
    eng.shutdown()


def test_child_outputs_equal_in_process_engine(child, local):
    """Greedy tokens and log-probs, and seeded samples (n=2), from the child equal the in-process engine's."""
    assert child.pid != os.getpid() and child.max_model_len == 128
    mine, theirs = child.generate_batch(PROMPTS, GREEDY), local.generate_batch(PROMPTS, GREEDY)
    assert _tokens(mine) == _tokens(theirs)
    assert len({tuple(o[0].token_ids) for o in mine}) > 1  # the outputs differ between prompts
    for a, b in zip(mine, theirs):
        assert a[0].finish_reason == b[0].finish_reason
        torch.testing.assert_close(torch.tensor(a[0].log_probs), torch.tensor(b[0].log_probs), atol=1e-5, rtol=0)
    sampled = SamplingParams(n=2, temperature=1.0, seed=123, max_tokens=8)
    mine, theirs = child.generate_batch(PROMPTS[:2], sampled), local.generate_batch(PROMPTS[:2], sampled)
    assert _tokens(mine) == _tokens(theirs)
    assert mine[0][0].token_ids != mine[0][1].token_ids  # sample i uses seed + i


def test_update_weights_in_several_buffers_matches_in_process(varied_path, monkeypatch):
    """update_weights with 4 KiB buckets sends several flat buffers holding every tensor once; afterwards the child's
    greedy outputs changed and equal those of an in-process engine given the same weights."""
    buffers = []

    def counting_pack(bucket):
        flat, layout = pack_flat(bucket)
        buffers.append([name for name, *_ in layout])
        return flat, layout

    monkeypatch.setattr(child_process, "pack_flat", counting_pack)
    new_model = _perturbed(AutoModelForCausalLM.from_pretrained(varied_path, dtype=torch.float32), seed=11)
    state = list(new_model.state_dict().items())
    eng = ChildProcessEngine("hf", _kwargs(varied_path), weight_bucket_bytes=4096, start_timeout_s=300)
    ref = get_rollout_engine("hf", **_kwargs(varied_path))
    try:
        before = _tokens(eng.generate_batch(PROMPTS, GREEDY))
        eng.update_weights(state)
        ref.update_weights(state)
        after, expected = eng.generate_batch(PROMPTS, GREEDY), ref.generate_batch(PROMPTS, GREEDY)
        assert len(buffers) > 1 and sorted(sum(buffers, [])) == sorted(name for name, _ in state)
        assert _tokens(after) != before
        assert _tokens(after) == _tokens(expected)
        for a, b in zip(after, expected):
            torch.testing.assert_close(torch.tensor(a[0].log_probs), torch.tensor(b[0].log_probs), atol=1e-5, rtol=0)
    finally:
        eng.shutdown()
        ref.shutdown()


def test_pack_flat_round_trip_aligned_views():
    """pack_flat: every offset a multiple of 16, the buffer the sum of the sizes rounded up to 16; unpack_flat gives
    back each tensor bit-exactly, as views into the buffer."""
    gen = torch.Generator().manual_seed(0)
    bucket = [
        ("a", torch.randn(3, generator=gen)),
        ("b", torch.randn(5, 7, generator=gen).to(torch.bfloat16)),
        ("c", torch.tensor([-(2**40) - 3], dtype=torch.int64)),
        ("d", torch.randn(2, 3, 3, generator=gen).to(torch.float16)),
        ("e", torch.randn(4, 6, generator=gen).t()),  # not contiguous
    ]
    flat, layout = pack_flat(bucket)
    sizes = [t.numel() * t.element_size() for _, t in bucket]  # 12, 70, 8, 36, 96 bytes
    assert flat.dtype == torch.uint8 and flat.numel() == sum(-(-s // 16) * 16 for s in sizes) == 16 + 80 + 16 + 48 + 96
    assert [offset for *_, offset in layout] == [0, 16, 96, 112, 160]
    unpacked = unpack_flat(flat, layout)
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel()
    for (name, tensor), (name2, out) in zip(bucket, unpacked):
        assert name2 == name and out.dtype == tensor.dtype and out.shape == tensor.shape
        assert torch.equal(out.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8))
        assert start <= out.data_ptr() < end and out.data_ptr() % 16 == start % 16
    unpacked[0][1].fill_(7.0)  # a view: writing it writes the buffer
    assert torch.equal(flat[:12].view(torch.float32), torch.full((3,), 7.0))


def test_concurrent_async_generate_equals_generate_batch(child):
    """Concurrent generate() coroutines on a user event loop get the same greedy tokens as generate_batch."""

    async def run_all():
        return await asyncio.gather(*(child.generate(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(PROMPTS)))

    results = asyncio.run(run_all())
    assert _tokens(results) == _tokens(child.generate_batch(PROMPTS, GREEDY))


def test_errors_come_back_with_their_type_and_child_keeps_serving(child, local):
    """A prompt longer than max_model_len raises the in-process engine's ValueError and message, from
    generate_batch and from generate; the child serves the next call."""
    long_prompt = [5] * 200
    with pytest.raises(ValueError, match="max_model_len=128") as in_process:
        local.generate_batch([long_prompt], GREEDY)
    with pytest.raises(ValueError) as raised:
        child.generate_batch([long_prompt], GREEDY)
    assert type(raised.value) is type(in_process.value) and str(raised.value) == str(in_process.value)
    with pytest.raises(ValueError, match="prompt of 200 tokens"):
        asyncio.run(child.generate(long_prompt, GREEDY))
    assert _tokens(child.generate_batch(PROMPTS[:1], GREEDY)) == _tokens(local.generate_batch(PROMPTS[:1], GREEDY))


def test_step_counters_count_child_forwards(child):
    """step_counters through the child: 5 greedy tokens of one prompt are 5 forwards (prefill + 4 decode steps) and
    took some seconds."""
    steps0, seconds0 = child.step_counters()
    out = child.generate_batch([PROMPTS[1]], SamplingParams(greedy=True, max_tokens=5))[0][0]
    steps, seconds = child.step_counters()
    assert len(out.token_ids) == 5 and out.finish_reason == "length"  # precondition: no EOS
    assert steps - steps0 == 5
    assert seconds > seconds0 and seconds > 0


def test_killed_child_raises_engine_process_error(varied_path):
    """After the child is killed, calls raise EngineProcessError naming its pid and exit code; shutdown still works."""
    eng = ChildProcessEngine("hf", _kwargs(varied_path), start_timeout_s=300)
    try:
        os.kill(eng.pid, signal.SIGKILL)
        assert eng._proc.wait(timeout=30) == -signal.SIGKILL
        with pytest.raises(EngineProcessError, match=rf"pid {eng.pid}\) exited with code -9"):
            eng.generate_batch(PROMPTS[:1], GREEDY)
        with pytest.raises(EngineProcessError, match="exited with code -9"):
            eng.step_counters()
    finally:
        eng.shutdown()


def test_shutdown_ends_child_and_is_idempotent(varied_path):
    """shutdown() ends the child process; later calls raise EngineProcessError('... shut down'); shutdown again is a
    no-op."""
    eng = ChildProcessEngine("hf", _kwargs(varied_path), start_timeout_s=300)
    assert eng._proc.poll() is None
    eng.shutdown()
    assert eng._proc.poll() == 0
    with pytest.raises(EngineProcessError, match="shut down"):
        eng.generate_batch(PROMPTS[:1], GREEDY)
    with pytest.raises(EngineProcessError, match="shut down"):
        asyncio.run(eng.generate(PROMPTS[0], GREEDY))
    eng.shutdown()
    assert eng._proc.poll() == 0


def test_engine_that_fails_to_start_raises_and_child_exits(monkeypatch):
    """An engine that cannot be built raises its error (naming the missing folder) and its child process exits."""
    real_popen, procs = subprocess.Popen, []

    def recording_popen(*args, **kwargs):
        procs.append(real_popen(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(child_process.subprocess, "Popen", recording_popen)
    kwargs = dict(model="/nonexistent/model/folder", device="cpu", dtype="float32", max_batch_size=4, max_model_len=128)
    with pytest.raises(Exception, match="/nonexistent/model/folder") as raised:
        ChildProcessEngine("hf", kwargs, start_timeout_s=300)
    assert not isinstance(raised.value, EngineProcessError)  # the child's own error, not a death report
    assert len(procs) == 1 and procs[0].wait(timeout=30) == 0


def test_external_launcher_is_refused_before_starting_a_process(monkeypatch):
    """A tensor-parallel engine across trainer ranks (external_launcher) is refused without starting a process."""

    def no_popen(*args, **kwargs):
        raise AssertionError("a child process was started")

    monkeypatch.setattr(child_process.subprocess, "Popen", no_popen)
    with pytest.raises(ValueError, match="engine_process"):
        ChildProcessEngine("vllm", {"distributed_executor_backend": "external_launcher"})


def test_weights_discarded_sleep_and_wake_up(child, local):
    """weights_discarded is False for hf through the child; sleep/wake_up return None and the child still generates
    what the in-process engine does."""
    assert child.weights_discarded is False
    before = _tokens(child.generate_batch(PROMPTS[:2], GREEDY))
    assert child.sleep() is None
    assert child.wake_up() is None and child.wake_up(["weights"]) is None
    assert (
        _tokens(child.generate_batch(PROMPTS[:2], GREEDY))
        == before
        == _tokens(local.generate_batch(PROMPTS[:2], GREEDY))
    )


def _peak_rss_gib(pid: int) -> float:
    """The kernel's peak resident set of ``pid`` (VmHWM, kB) in GiB."""
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kb / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_memory_metrics_are_the_child_processes_own(varied_path):
    """The engine process's peak RSS as the kernel counts it for the child's pid, though this process (its parent)
    holds 1.5 GiB more: Linux carries ``ru_maxrss`` over fork and exec, so that count would report the parent's.
    No GPU counters without CUDA. Answered while a generation runs in the child."""
    ballast = torch.ones(3 * 2**27, dtype=torch.float32)  # 1.5 GiB, touched
    eng = ChildProcessEngine("hf", _kwargs(varied_path), start_timeout_s=300)
    try:
        running = eng.submit_on_loop(eng.generate(PROMPTS[0], SamplingParams(greedy=True, max_tokens=64)))
        metrics = eng.memory_metrics()
        running.result(timeout=120)
        assert set(metrics) == {"perf/rollout/engine_process_cpu_memory_peak_rss_gb"}
        rss = metrics["perf/rollout/engine_process_cpu_memory_peak_rss_gb"]
        assert rss == pytest.approx(_peak_rss_gib(eng.pid), rel=0.05)
        assert 0.1 < rss < _peak_rss_gib(os.getpid()) - 1.0  # python + torch + the model; not this process's
    finally:
        eng.shutdown()
        del ballast


def test_the_child_entry_point_explains_itself_when_run_by_hand(capsys):
    from verl.workers.rollout.child_process import main

    assert main(["--help"]) == 0
    assert "usage: python -m verl.workers.rollout.child_process FD" in capsys.readouterr().err
    assert main([]) == 2 and main(["not-a-descriptor"]) == 2
    assert "not run by hand" in capsys.readouterr().err

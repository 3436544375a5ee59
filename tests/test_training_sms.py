"""``actor_rollout_ref.rollout.engine_reserved_sms``: the training passes' SMs (verl/workers/training_sms.py).

CPU: the SM count arithmetic, refusals naming the key, the scope a no-op off CUDA. GPU (``gpu``): inside the scope
the kernels run on the green context's stream with the results of the whole GPU, and a compute-bound loop on 8 SMs
takes several times as long as on all of them (the partition is real); the caller's stream waits for the scope's
work on exit.
"""

from __future__ import annotations

import time

import pytest
import torch

from verl.workers.training_sms import SM_GRANULARITY, TrainingSMs, training_sm_count


def test_training_keeps_the_rest_rounded_down_to_the_partition_granularity():
    assert SM_GRANULARITY == 8
    assert training_sm_count(132, 0) == 128  # H200: 132 SMs, partitions of 8
    assert training_sm_count(132, 4) == 128
    assert training_sm_count(132, 5) == 120
    assert training_sm_count(132, 32) == 96
    assert training_sm_count(132, 124) == 8
    assert training_sm_count(40, 8, granularity=2) == 32


def test_too_many_reserved_sms_are_refused_naming_the_key_and_the_limit():
    with pytest.raises(
        ValueError, match=r"engine_reserved_sms=125 leaves the training passes 7 of the device's 132 SMs"
    ):
        training_sm_count(132, 125)
    with pytest.raises(ValueError, match=r"set it to at most 124"):
        training_sm_count(132, 130)
    with pytest.raises(ValueError, match=r"engine_reserved_sms must be >= 0, got -1"):
        training_sm_count(132, -1)
    with pytest.raises(ValueError, match=r"engine_reserved_sms must be >= 0, got -8"):
        TrainingSMs(-8, None)


def test_the_scope_does_nothing_off_cuda_or_with_nothing_reserved():
    for sms in (TrainingSMs(32, None), TrainingSMs(0, None)):
        assert not sms.enabled
        with sms.scope():
            x = torch.ones(3) * 2
        assert sms.num_sms is None and x.sum().item() == 6


def test_a_torch_without_green_context_streams_is_refused_naming_the_key(monkeypatch):
    """The partition runs on the green context's own stream (torch >= 2.11); an older torch is refused when the
    first partitioned pass starts, before any CUDA call, with the key and the way out."""
    import torch.cuda.green_contexts as green_contexts

    class OldGreenContext:  # torch 2.10's: set_context/pop_context, no Stream()
        @staticmethod
        def create(num_sms, device_id=0):
            raise AssertionError("must not be reached")

    monkeypatch.setattr(green_contexts, "GreenContext", OldGreenContext)
    sms = TrainingSMs(32, 0)
    with pytest.raises(RuntimeError, match=r"engine_reserved_sms needs CUDA green contexts .* set it to 0"):
        with sms.scope():
            pass
    assert sms.num_sms is None


def _has_green_contexts() -> bool:
    try:
        from torch.cuda.green_contexts import GreenContext  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_green_contexts(), reason="needs CUDA and torch.cuda.green_contexts")
def test_on_a_gpu_the_training_passes_run_on_the_partition_only():
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).multi_processor_count
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    expected = a @ a

    def seconds(sms: TrainingSMs) -> tuple[float, torch.Tensor]:
        with sms.scope():
            out = a @ a  # warm-up and the result to compare
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(50):
                a @ a
            torch.cuda.synchronize()
            return time.perf_counter() - start, out

    whole, _ = seconds(TrainingSMs(0, device))
    few = TrainingSMs(total - SM_GRANULARITY, device)
    narrow, out = seconds(few)
    assert few.num_sms == SM_GRANULARITY
    torch.testing.assert_close(out, expected)
    # 8 of 132 SMs: a GEMM-bound loop takes many times as long (not exactly total / 8: clocks, tile shapes)
    assert narrow > 4 * whole, (narrow, whole)
    # no generation in flight: the pass runs on the whole device, at the whole device's speed
    idle = TrainingSMs(total - SM_GRANULARITY, device, busy=lambda: False)
    idle_seconds, _ = seconds(idle)
    assert idle.partitioned_passes == 0 and idle_seconds < narrow / 2, (idle_seconds, narrow)
    # the caller's stream waits for the scope's work: a result made inside is complete once the caller syncs
    with few.scope():
        inside = a @ a
    assert torch.cuda.current_stream(device) == torch.cuda.default_stream(device)
    torch.cuda.current_stream(device).synchronize()
    torch.testing.assert_close(inside, expected)


def test_nothing_is_partitioned_while_no_generation_runs():
    """``busy`` false: the scope runs the pass as it is and never touches CUDA (this runs on CPU with device 0)."""
    generating = []
    sms = TrainingSMs(32, 0, busy=lambda: bool(generating))
    assert sms.enabled
    with sms.scope():
        pass
    assert sms.partitioned_passes == 0 and sms.num_sms is None

"""``actor_rollout_ref.rollout.engine_reserved_sms``: the training passes' SMs (verl/workers/training_sms.py).

CPU: the SM count arithmetic, refusals naming the key, the scope a no-op off CUDA; ``rollout.balance_reserved_sms``'s
rule and shifts. GPU (``gpu``): inside the scope
the kernels run on the green context's stream with the results of the whole GPU, and a compute-bound loop on 8 SMs
takes several times as long as on all of them (the partition is real), faster once shifted to 16; the caller's
stream waits for the scope's work on exit.
"""

from __future__ import annotations

import time
import types

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


def test_balance_moves_one_group_towards_the_side_that_finished_last():
    from verl.workers.training_sms import BALANCE_TOLERANCE, balance_shift

    assert BALANCE_TOLERANCE == 0.05
    # the fourteenth GPU run's steps: 16 SMs kept, the training waited 5.9 s for the rollout in a 36.5 s step
    assert balance_shift(5.91, 0.0, 5.75 + 24.8 + 5.91) == 8
    assert balance_shift(0.0, 3.0, 37.0) == -8  # the rollout had been done 3 s when the training was
    assert balance_shift(1.0, 0.0, 37.0) == 0 and balance_shift(0.0, 1.8, 37.0) == 0  # within 5% (1.85 s)
    assert balance_shift(1.9, 0.0, 37.0) == 8 and balance_shift(0.0, 1.9, 37.0) == -8
    assert balance_shift(2.0, 0.0, 10.0, tolerance=0.25) == 0 and balance_shift(2.0, 0.0, 10.0, granularity=4) == 4
    assert balance_shift(0.0, 0.0, 0.0) == 0
    # both past the tolerance (not one step's timings, but the rule is total): the longer wait decides
    assert balance_shift(3.0, 4.0, 37.0) == -8 and balance_shift(4.0, 3.0, 37.0) == 8
    with pytest.raises(ValueError, match="seconds >= 0"):
        balance_shift(-1.0, 0.0, 10.0)


def test_shifting_the_split_clamps_at_zero_and_drops_the_built_context():
    sms = TrainingSMs(16, None)
    assert sms.shift(8) == 24 and sms.reserved == 24
    assert sms.shift(0) == 24
    assert sms.shift(-16) == 8 and sms.shift(-16) == 0 and not sms.enabled
    assert sms.shift(8) == 8  # back from 0: the partition applies again where there is a device
    sms._context, sms._stream, sms.num_sms = "built", None, 120
    sms.shift(0)
    assert sms._context == "built" and sms.num_sms == 120  # unchanged split: the context stays
    sms.shift(8)
    assert sms._context is None and sms.num_sms is None  # the next partitioned pass builds the new size


def test_shifting_the_split_on_a_device_keeps_one_group_for_the_training(monkeypatch):
    """On a device of 132 SMs the engine keeps at most 124: the training passes keep one group of 8."""
    props = types.SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    sms = TrainingSMs(112, 0)
    assert sms.shift(8) == 120 and sms.shift(8) == 124 and sms.shift(8) == 124
    assert sms.shift(-8) == 116


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
    # balance_reserved_sms moves the split: the next pass runs in a new green context of the new size
    assert few.shift(SM_GRANULARITY) == total - SM_GRANULARITY  # at most total - 8 kept
    assert few.shift(-SM_GRANULARITY) == total - 2 * SM_GRANULARITY and few.num_sms is None
    wider, out = seconds(few)
    assert few.num_sms == 2 * SM_GRANULARITY and wider < 0.75 * narrow, (wider, narrow)
    torch.testing.assert_close(out, expected)
    few.shift(SM_GRANULARITY)
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


def test_the_trainer_does_not_balance_after_its_first_step_with_a_rollout_ahead():
    """The first such step's training passes pay one-time costs (compiles, first calls): the split stays; from the
    second step on it moves by ``balance_shift`` of the step's waits (one H200: moved 16 -> 8 after the first step,
    the next step's training then waited 10.1 s for the rollout)."""
    from tests.test_config import compose_config
    from verl.trainer.ppo.trainer_core import TrainerCore

    shifts = []

    class Group:
        def shift_engine_reserved_sms(self, delta):
            shifts.append(delta)
            return [16 + sum(shifts)]

    cfg = compose_config(
        ["actor_rollout_ref.rollout.engine_reserved_sms=16", "actor_rollout_ref.rollout.balance_reserved_sms=True"]
    )
    trainer = TrainerCore(cfg, None, Group(), None, None)
    trainer.ahead = types.SimpleNamespace(launched_s=lambda: 37.0)
    assert trainer.balance_engine_sms(0.0, 13.2) == {"perf/engine_reserved_sms": 16.0}  # first: rollout 13 s early
    assert shifts == [] and trainer.engine_reserved_sms == 16
    assert trainer.balance_engine_sms(0.0, 13.2) == {"perf/engine_reserved_sms": 16.0}
    assert shifts == [-8] and trainer.engine_reserved_sms == 8
    assert trainer.balance_engine_sms(10.1, 0.0) == {"perf/engine_reserved_sms": 8.0}
    assert shifts == [-8, 8] and trainer.engine_reserved_sms == 16

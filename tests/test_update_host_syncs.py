"""Device -> host synchronisations of the actor's micro-batch loop, counted on CPU.

On a GPU every ``.item()``/``int(tensor)``/``bool(tensor)`` (``aten::_local_scalar_dense``), ``nonzero``,
boolean-mask indexing, ``torch.equal``, ``repeat_interleave`` without an output size and ``masked_select``
on a device tensor makes the host wait for the device, so it cannot queue the next kernels meanwhile. The
actor computes each micro-batch's layout (packing, valid positions) from host copies of its masks
(``verl/workers/actor/forward.py:HostPlan``), so the device work of a micro-batch (``_micro_batch_backward``,
the forwards of ``compute_log_prob``) issues none from this project's code. transformers' mask helpers issue
at most two per forward (``masking_utils``: all-ones checks of the padding mask, the packed-sequence check);
they are counted separately and bounded.

A ``TorchDispatchMode`` sees every aten op; an op is attributed to the innermost frame outside torch.
"""

from __future__ import annotations

import collections
import copy
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_dp_actor import actor_config, make_update_data
from verl.utils.fsdp_utils import build_optimizer
from verl.utils.model_loading import load_causal_lm
from verl.workers.actor import DataParallelPPOActor

SYNC_OPS = {"_local_scalar_dense", "nonzero", "equal", "masked_select", "repeat_interleave", "unique", "_unique2"}


class SyncCounter(TorchDispatchMode):
    """Counts ops that synchronise a CUDA device, by origin: ``verl`` (this project), ``transformers``, other."""

    def __init__(self):
        super().__init__()
        self.by_origin: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        indices = args[1] if name.startswith("index") and len(args) > 1 else ()
        bool_index = isinstance(indices, (list, tuple)) and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices
        )
        if name in SYNC_OPS or bool_index:
            frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and f.filename != __file__]
            where = frames[-1].filename if frames else "?"
            origin = "transformers" if "/transformers/" in where else "verl" if "/verl/" in where else "other"
            self.by_origin[origin] += 1
            self.sites[(origin, f"{where.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?", name)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def base_model(tiny_model_path):
    return load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")


def _count_micro_batches(actor: DataParallelPPOActor, method: str) -> tuple[list[SyncCounter], object]:
    counters: list[SyncCounter] = []
    original = getattr(actor, method)

    def counted(*args, **kwargs):
        with SyncCounter() as counter:
            out = original(*args, **kwargs)
        counters.append(counter)
        return out

    setattr(actor, method, counted)
    return counters, original


@pytest.mark.parametrize("remove_padding", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_micro_batch_device_work_issues_no_host_sync_of_ours(base_model, remove_padding, fused):
    data = make_update_data(base_model, num_conv=7, seed=5)
    model = copy.deepcopy(base_model)
    config = actor_config(
        use_remove_padding=remove_padding,
        use_fused_kernels=fused,
        ppo_micro_batch_size_per_gpu=2,
        train_batch_size=2,
        ppo_mini_batch_size=1,
    )
    actor = DataParallelPPOActor(config, model, build_optimizer(model, lr=1e-3))
    counters, _ = _count_micro_batches(actor, "_micro_batch_backward")
    actor.update_policy(data)
    assert len(counters) == 4  # 2 mini-batches of 4 and 3 rows, micro-batches of 2 rows
    for counter in counters:
        assert counter.by_origin["verl"] == 0, counter.sites
        assert counter.by_origin["other"] == 0, counter.sites
        assert counter.by_origin["transformers"] <= 2, counter.sites  # masking_utils' checks, per forward

    # compute_log_prob: the forwards too (dynamic batching: a token budget)
    data.meta_info.update(use_dynamic_bsz=True, max_token_len=40)
    counters, _ = _count_micro_batches(actor, "_forward")
    actor.compute_log_prob(data, calculate_entropy=True)
    assert len(counters) >= 2
    for counter in counters:
        assert counter.by_origin["verl"] == 0 and counter.by_origin["other"] == 0, counter.sites
        assert counter.by_origin["transformers"] <= 2, counter.sites


def test_host_syncs_of_an_update_do_not_grow_with_micro_batches(base_model):
    """The whole update_policy: this project's sync-ops per mini-batch are the same for 1 and 7 micro-batches
    (partitioning and packing run on host tensors: on CPU they are counted here too, on a GPU they are free;
    what must not grow with the micro-batch count is what runs per micro-batch on the device)."""
    data = make_update_data(base_model, num_conv=7, seed=5)

    def ours(micro_batch_size: int) -> int:
        model = copy.deepcopy(base_model)
        config = actor_config(use_remove_padding=False, use_fused_kernels=False)
        config["ppo_micro_batch_size_per_gpu"] = micro_batch_size
        actor = DataParallelPPOActor(config, model, build_optimizer(model, lr=1e-3))
        with SyncCounter() as counter:
            actor.update_policy(data)
        return counter.by_origin["verl"]

    assert ours(7) == ours(1)

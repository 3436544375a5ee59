"""``perf/mfu/actor`` (verl/utils/flops.py): 6 x parameters x tokens over the update's seconds and the GPU's dense bf16
peak, found by the device's name (the longest matching part: "H20" is also in "H200")."""

from __future__ import annotations

import time

import pytest
import torch

from tests.test_log_prob_budgets import build_worker
from verl.utils import flops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H20", 148e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_by_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert flops.peak_flops_per_gpu("cuda") == peak
    assert flops.peak_flops_per_gpu("cpu") is None


def test_update_mfu_by_hand():
    assert flops.update_mfu(1_000_000, 500, 2.0, 1e12) == pytest.approx(6 * 1e6 * 500 / 2.0 / 1e12)
    assert flops.update_mfu(1_000_000, 500, 2.0, None) is None and flops.update_mfu(1, 1, 0.0, 1e12) is None


def test_worker_reports_the_update_mfu(monkeypatch, tiny_model_path):
    """The actor worker's update metrics carry perf/mfu/actor: this rank's valid tokens x 6 x the model's parameters
    over the update's wall time and the peak (on CPU the peak is unknown: no metric)."""
    from tests.test_dp_actor import make_update_data
    from verl.utils.model_loading import count_parameters, load_causal_lm

    model = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
    data = make_update_data(model, num_conv=4, seed=5)
    worker = build_worker(monkeypatch, tiny_model_path)
    assert "perf/mfu/actor" not in worker.update_actor(data)  # CPU
    assert worker.actor_parameters == count_parameters(model)
    worker.__dict__["peak_flops"] = 1e12  # as on a GPU of that peak
    t0 = time.perf_counter()
    metrics = worker.update_actor(data)
    wall = time.perf_counter() - t0
    tokens = int(data.batch["attention_mask"].sum())
    seconds = 6 * count_parameters(model) * tokens / 1e12 / metrics["perf/mfu/actor"]  # the time it divided by
    assert 0 < seconds <= wall

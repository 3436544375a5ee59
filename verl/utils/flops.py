"""Model FLOPs utilisation of the actor update: ``perf/mfu/actor`` (upstream verl's metric name).

MFU = 6 x parameters x tokens / seconds / the GPU's peak: the forward and backward matmuls of a dense decoder per
token (2 + 4 FLOPs per parameter), attention's quadratic part and any recomputation under gradient checkpointing not
counted, the embedding counted as the other weights (as ``benchmarks/bench_update_policy.py`` does). The peak is the
vendor's dense bf16 tensor-core figure of the device named by ``torch.cuda.get_device_name``; the benchmarks here
use 790 TFLOP/s for an H200 instead (dense bf16 as measured on one), so their MFU reads 989/790 = 1.25x this one.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["PEAK_BF16_FLOPS", "peak_flops_per_gpu", "update_mfu"]

# dense bf16 tensor-core FLOP/s per GPU (vendor specifications), by a part of the device's name; longest match wins
# ("H20" is also part of "H200")
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
}


def peak_flops_per_gpu(device: str) -> Optional[float]:
    """The peak of the current CUDA device (None on another device or an unknown GPU)."""
    if device != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name()
    matches = [key for key in PEAK_BF16_FLOPS if key in name]
    return PEAK_BF16_FLOPS[max(matches, key=len)] if matches else None


def update_mfu(num_params: int, tokens: int, seconds: float, peak_flops: Optional[float]) -> Optional[float]:
    """6 x ``num_params`` x ``tokens`` / ``seconds`` / ``peak_flops`` (None without a peak or time)."""
    if not peak_flops or seconds <= 0:
        return None
    return 6.0 * num_params * tokens / seconds / peak_flops

"""Small masked tensor helpers shared by the RL algorithms (``verl.trainer.ppo.core_algos``) and the workers.

Conventions:
* ``mask`` is a 0/1 tensor (bool, int or float) broadcastable to ``values``; 1 marks a position that counts.
* Reductions over an empty mask return 0 instead of NaN (the numerator is 0 and the denominator is clamped),
  so a micro-batch made only of padding rows contributes nothing rather than poisoning the loss.
* Values at masked-out positions never reach a reduction, not even NaN/inf (as upstream verl):
  ``masked_mean([1, nan, 4], [1, 0, 1]) == 2.5``.

Names follow upstream ``verl.utils.torch_functional`` (the tensor helpers; the flash-attn and distributed ones
are not here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional, Union

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "host_to_device",
    "clip_by_value",
    "compute_grad_norm",
    "entropy_from_logits_with_chunking",
    "gather_from_labels",
    "get_constant_schedule_with_warmup",
    "get_cosine_schedule_with_warmup",
    "get_eos_mask",
    "get_response_mask",
    "logprobs_from_logits_naive",
    "logprobs_from_logits_v2",
    "pad_2d_list_to_length",
    "pad_sequence_to_length",
    "split_dict_tensor_into_batches",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "entropy_from_logits",
    "logprobs_from_logits",
    "postprocess_data",
    "tokenize_and_postprocess_data",
    "remove_pad_token",
    "log_probs_from_logits_response",
    "get_unpad_data",
    "compute_position_id_with_mask",
]

# Denominators are clamped to this value; with a 0/1 mask a non-empty count is >= 1, so the clamp only ever
# applies to empty masks (numerator 0 -> result 0) and never biases a real mean.
_MIN_DENOMINATOR = 1e-8


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device copy that does not wait for the device: from pinned memory, non-blocking (a copy from
    pageable memory synchronises the CUDA stream first)."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """Sum of ``values * mask`` where ``mask`` is set (over ``axis``, or everything when ``axis`` is None);
    positions with ``mask == 0`` count as 0 whatever they hold (NaN included)."""
    mask_f = mask.to(values.dtype)
    masked = torch.where(mask_f != 0, values * mask_f, torch.zeros((), dtype=values.dtype, device=values.device))
    return masked.sum() if axis is None else masked.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set; 0 for an empty mask.

    Example: ``masked_mean(tensor([1., 2., 3.]), tensor([1, 1, 0])) == 1.5``; NaN at a masked-out position is
    ignored: ``masked_mean(tensor([1., nan, 4.]), tensor([1, 0, 1])) == 2.5``.
    """
    mask_f = mask.to(values.dtype)
    count = mask_f.sum() if axis is None else mask_f.sum(dim=axis)
    return masked_sum(values, mask_f, axis) / count.clamp_min(_MIN_DENOMINATOR)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the masked positions (all axes together).

    ``unbiased=True`` applies Bessel's correction (divide by N-1), which needs at least 2 masked positions;
    fewer raise ``ValueError`` naming the count.
    """
    mask_f = mask.to(values.dtype)
    count = mask_f.sum()
    n = int(count.item())
    if n == 0:
        raise ValueError("masked_var: the mask selects no positions (mask.sum() == 0)")
    mean = masked_mean(values, mask_f)
    centered = values - mean
    variance = masked_mean(centered * centered, mask_f)
    if unbiased:
        if n == 1:
            raise ValueError("masked_var(unbiased=True): the mask selects 1 position; need at least 2")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise ``values`` with the masked mean and unbiased masked variance: ``(x - mean) / sqrt(var + 1e-8)``.

    With ``shift_mean=False`` the mean is added back (only the scale changes). Positions outside the mask are
    transformed too (callers multiply by the mask when they need zeros there).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution ``softmax(logits)`` over the last axis: ``[..., V] -> [...]``.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)``, which is exact and stable for large logits.
    """
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits)``: logits ``[..., V]``, labels ``[...]`` -> ``[...]``."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(dim=-1, index=labels.long().unsqueeze(-1)).squeeze(-1)


def gather_from_labels(data: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """``data[..., label]`` per position: ``[..., V]`` and ``[...]`` -> ``[...]``."""
    return torch.gather(data, -1, label.long().unsqueeze(-1)).squeeze(-1)


def logprobs_from_logits_naive(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` at ``labels`` (in the logits' dtype)."""
    return gather_from_labels(F.log_softmax(logits, dim=-1), labels)


def logprobs_from_logits_v2(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Row-by-row ``logprobs_from_logits`` (lower peak memory); same values, in float32."""
    return torch.stack([logprobs_from_logits(row, row_labels) for row, row_labels in zip(logits, labels)])


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """``entropy_from_logits`` of ``[N, V]`` logits, ``chunk_size`` rows at a time (float32 per chunk)."""
    parts = [entropy_from_logits(chunk.float()) for chunk in logits.split(chunk_size, dim=0)]
    return torch.cat(parts, dim=0) if parts else logits.new_zeros(logits.shape[:-1])


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Element-wise ``min(max(x, tensor_min), tensor_max)`` with tensor bounds."""
    return torch.max(torch.min(x, tensor_max), tensor_min)


def get_response_mask(
    response_id: torch.Tensor, eos_token: Union[int, Sequence[int]] = 2, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """1 up to and including the first EOS token of each row, 0 after it (``eos_token`` an id or a list).

    Example: ``[[5, 2, 7, 2]]`` with ``eos_token=2`` -> ``[[1, 1, 0, 0]]``.
    """
    tokens = [eos_token] if isinstance(eos_token, int) else list(eos_token)
    is_eos = torch.zeros_like(response_id, dtype=torch.bool)
    for token in tokens:
        is_eos |= response_id.eq(token)
    eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()  # EOS tokens strictly before position t
    return (eos_before == 0).to(dtype)


get_eos_mask = get_response_mask  # upstream's older name


def compute_grad_norm(model: torch.nn.Module) -> float:
    """Sum of squared gradient entries over the parameters (upstream's name; it is the *squared* norm)."""
    return float(sum(torch.sum(p.grad.detach().float() ** 2).item() for p in model.parameters() if p.grad is not None))


def split_dict_tensor_into_batches(tensors: TensorDict, batch_size: int) -> list[TensorDict]:
    """Split a TensorDict into pieces of ``batch_size`` rows; the row count must divide evenly."""
    num_rows = int(tensors.batch_size[0])
    if batch_size < 1 or num_rows % batch_size:
        raise ValueError(f"split_dict_tensor_into_batches: {num_rows} rows do not split into batches of {batch_size}")
    return list(tensors.split(batch_size))


def pad_2d_list_to_length(response: Sequence[Sequence[int]], pad_token_id: int, max_length: Optional[int] = None):
    """Right-pad a list of id lists to a ``[B, max(longest, max_length)]`` tensor."""
    width = max((len(row) for row in response), default=0)
    width = max(width, max_length or 0)
    return torch.tensor([list(row) + [pad_token_id] * (width - len(row)) for row in response])


def pad_sequence_to_length(
    tensors: torch.Tensor, max_seq_len: int, pad_token_id: int, left_pad: bool = False
) -> torch.Tensor:
    """Pad the last dimension to ``max_seq_len`` (left or right); a longer tensor is returned unchanged."""
    missing = max_seq_len - tensors.shape[-1]
    if missing <= 0:
        return tensors
    return F.pad(tensors, (missing, 0) if left_pad else (0, missing), "constant", pad_token_id)


TRUNCATIONS = ("left", "right", "error")


def postprocess_data(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_length: int,
    pad_token_id: int,
    left_pad: bool = True,
    truncation: str = "error",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L]`` ids and mask padded (``pad_token_id`` / 0, left or right) or truncated to ``max_length``:
    ``left`` keeps the last tokens, ``right`` the first, ``error`` raises ``ValueError`` naming both lengths."""
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    length = input_ids.shape[-1]
    if length < max_length:
        input_ids = pad_sequence_to_length(input_ids, max_length, pad_token_id, left_pad=left_pad)
        attention_mask = pad_sequence_to_length(attention_mask, max_length, 0, left_pad=left_pad)
    elif length > max_length:
        if truncation == "error":
            raise ValueError(f"sequence length {length} is larger than max_length {max_length} (truncation='error')")
        kept = slice(-max_length, None) if truncation == "left" else slice(None, max_length)
        input_ids, attention_mask = input_ids[:, kept], attention_mask[:, kept]
    return input_ids, attention_mask


def tokenize_and_postprocess_data(
    prompt: str, tokenizer, max_length: int, pad_token_id: int, left_pad: bool = True, truncation: str = "error"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize ``prompt`` (no special tokens added) to ``[1, max_length]`` ids and mask (:func:`postprocess_data`)."""
    encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    return postprocess_data(
        encoded["input_ids"], encoded["attention_mask"], max_length, pad_token_id, left_pad, truncation
    )


def remove_pad_token(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The ids of each left-padded row without its padding: the last ``mask.sum()`` tokens, as lists."""
    return [ids[len(ids) - int(mask.sum()) :].tolist() for ids, mask in zip(input_ids, attention_mask)]


def log_probs_from_logits_response(input_ids: torch.Tensor, logits: torch.Tensor, response_length: int):
    """Log-probs ``[B, R]`` of the last ``R`` tokens of ``input_ids`` under ``logits = model(input_ids)``
    (the logits one position earlier predict each token)."""
    response_logits = logits[:, -response_length - 1 : -1]
    return logprobs_from_logits(response_logits, input_ids[:, -response_length:])


def get_unpad_data(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(indices of the kept tokens in the flattened batch, cu_seqlens int32 [B + 1], longest row)``."""
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(seqlens.max().item()) if seqlens.numel() else 0


def compute_position_id_with_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting only attended tokens: ``clip(cumsum(mask) - 1, min=0)`` (left padding gets 0)."""
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0)


def get_constant_schedule_with_warmup(optimizer, num_warmup_steps: int, last_epoch: int = -1) -> LambdaLR:
    """lr factor ``step / num_warmup_steps`` during warm-up (0 at step 0), then 1."""

    def factor(step: int) -> float:
        return min(1.0, float(step) / float(max(1, num_warmup_steps)))

    return LambdaLR(optimizer, factor, last_epoch)


def get_cosine_schedule_with_warmup(
    optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
) -> LambdaLR:
    """Linear warm-up to the base lr, then a cosine from 1 down to ``min_lr_ratio`` over the remaining steps
    (``num_cycles=0.5``: one half cosine): ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(2 pi c p)) / 2``."""
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        return max(0.0, min_lr_ratio + (1.0 - min_lr_ratio) * cosine)

    return LambdaLR(optimizer, factor, last_epoch)

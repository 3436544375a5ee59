"""Forward passes that return per-token log-probs (and entropies) of the response tokens.

Two layouts, same numbers (tested to 1e-5 in float32):

* **padded**: the ``[b, S]`` batch (left-padded prompt + right-padded response) goes through the model with
  its ``attention_mask`` and ``position_ids``; only the last ``R + 1`` positions go through ``lm_head``.
* **packed** (``use_remove_padding``): the valid tokens of all rows are concatenated into one ``[1, T]``
  sequence whose ``position_ids`` restart at 0 for every row, and no attention mask is passed (flex_attention
  aside, below). transformers turns such position_ids into exact per-row attention: variable-length
  flash-attention (``flash_attention_2``, CUDA) or a block-diagonal causal mask (``sdpa``/``eager``, CPU and
  GPU). Only the positions that predict a valid response token go through ``lm_head`` (``logits_to_keep`` as an
  index tensor), which for MemAgent (prompts of ~6K tokens, responses of <= 1K) skips most of the vocabulary
  projection.
  Rows whose valid ``position_ids`` are not ``0, 1, ..., n-1`` cannot be packed exactly; such micro-batches
  fall back to the padded layout (logged once).
* **packed, flex_attention**: the block-diagonal causal ``BlockMask`` is passed as ``attention_mask``, built
  from the position_ids with plain tensor ops on the device (``packed_block_mask.py``; equal to
  ``create_block_mask``'s, field by field). Left to itself, transformers builds it with an inductor-compiled
  ``create_block_mask`` per new shape and grad mode (minutes of a 1.5B training step with ``T ~ 30K`` on
  GPU); transformers returns a prepared 4-D mask as is, so that compile no longer happens (models with
  sliding-window layers keep transformers' masks). flex_attention itself is still compiled per shape, and ``T``
  changes with every micro-batch. The packed sequence is therefore padded at the end up to a multiple of flex's
  block size (128) and to at least two blocks (``packed_length_multiple``, ``pack_rows``): one trailing
  "document" of padding tokens with position_ids ``0, 1, ...``, which no real token attends to (causal +
  per-document mask) and whose outputs are never read. Every shape is then a whole number of blocks, so after
  the first (static) compile torch's automatic dynamic shapes give one dynamic compile that serves every later
  length (per grad mode); without the padding a micro-batch of one block (``T <= 128``) is a third
  specialisation (CPU, torch 2.13, 8 lengths: 2 graphs instead of 3; 4 instead of 6 while transformers compiled
  the mask too; ``tests/test_flex_attention_shapes.py``, ``benchmarks/bench_flex_shapes.py``). The padding adds
  fewer than 256 tokens per micro-batch.
* **packed, shared prompts** (``share_prompts``, ``shared_prompts.py``): rows of the micro-batch with identical
  prompts hold the prompt once, each response placed after it with position_ids continuing from the prompt and a
  mask letting it see the prompt and itself (flex_attention on CUDA, sdpa, eager); same numbers, fewer tokens.
* **packed, torch_varlen** (opt-in ``attn_implementation``; CUDA, torch >= 2.10): PyTorch's FA2 variable-length
  kernels (``torch.nn.attention.varlen.varlen_attn``) with no mask, no compile and no flash-attn package
  (``varlen_attention.py``). ``pack_rows`` computes the sequence boundaries (``cu_seq_lens``, ``max_length``)
  from the row lengths, on the host when a host plan is used, and ``packed_model_inputs`` passes them as
  transformers' ``cu_seq_lens_q``/``max_length_q`` keyword arguments, which reach every attention layer: one
  tensor per micro-batch, no per-layer device synchronisation. Tested on CPU with a reference in place of the
  kernel (``tests/test_varlen_attention.py``); its GPU speed is not measured yet (the command is in
  ``verl/utils/model_loading.py``'s docstring and ``docs/config.md``).

Where it runs: on CPU (tests) packing goes through sdpa's dense block-diagonal mask (exact: 1e-6 in fp32).
On GPU, fp32 packed vs padded agree within 6e-6 for sdpa and flex_attention (H200). Speed on GPU: FA2 varlen
or flex_attention are fast; sdpa's dense ``[T, T]`` mask makes packing slower than the padded layout
(numbers in ``benchmarks/bench_update_policy.py``), and the actor warns about that combination.

Fused head (``use_fused_kernels``, the default of the actor): the model runs its own forward with the output
projection replaced (``fused_logprob.lm_head_override``) by one that takes the hidden states of the positions
that predict a valid response token and returns their log-probs (and entropies) computed ``fused_chunk_size``
tokens at a time (``fused_logprob.chunked_log_probs``), so neither the forward nor the backward holds
``[tokens, vocab]`` float32 logits; same numbers as the unfused path (1e-5 in float32, gradients included).

Outputs are ``[b, R]``; positions that are not valid tokens (``attention_mask == 0`` in the response part)
hold 0.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from verl.utils.lora import base_model
from verl.utils.torch_functional import entropy_from_logits, host_to_device, logprobs_from_logits
from verl.workers.actor import varlen_attention
from verl.workers.actor.fused_logprob import chunked_log_probs, liger_available, liger_log_probs, lm_head_override
from verl.workers.actor.packed_block_mask import attn_implementation, packed_attention_mask, supports_shared_prompts
from verl.workers.actor.packed_rows import PackedRows, padded_packed_length
from verl.workers.actor.shared_prompts import shared_prompt_layout

__all__ = [
    "supports_logits_to_keep",
    "packed_length_multiple",
    "PackedRows",
    "pack_rows",
    "scatter_targets",
    "packed_model_inputs",
    "HostPlan",
    "host_plan",
    "padded_packed_length",
    "forward_response_log_probs",
]

logger = logging.getLogger(__name__)
_warned_fallback = False


def supports_logits_to_keep(model: nn.Module) -> bool:
    """True when the (unwrapped) model's forward accepts ``logits_to_keep`` (transformers >= 4.50 LMs)."""
    try:
        return "logits_to_keep" in inspect.signature(type(base_model(model)).forward).parameters
    except (TypeError, ValueError):
        return False


def packed_length_multiple(model: nn.Module) -> int:
    """Length multiple for packed rows: flex_attention's block size (128) under ``flex_attention``, else 1.

    Padding the packed sequence to whole blocks keeps flex_attention and its block mask from being compiled
    again for new lengths (module docstring); the other attention implementations take any length as is.
    """
    if attn_implementation(model) != "flex_attention":
        return 1
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE

    return int(_DEFAULT_SPARSE_BLOCK_SIZE)


@dataclass
class HostPlan:
    """What ``forward_response_log_probs`` would otherwise derive from the masks on the device (each step a
    device -> host synchronisation: ``nonzero``, boolean indexing, ``torch.equal``, ``int(tensor)``), computed
    from host copies of the micro-batch and moved to the device without waiting (``host_plan``).

    ``packed``: the packed layout (None: use the padded one); ``valid_index``: ``[K]`` flat (row-major)
    positions of the valid response tokens of the padded layout, for the fused head (None otherwise)."""

    packed: Optional[PackedRows] = None
    valid_index: Optional[torch.Tensor] = None


def host_plan(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    use_remove_padding: bool,
    use_fused_kernels: bool,
    length_multiple: int,
    device: torch.device,
    share_prompts: bool = False,
) -> HostPlan:
    """``HostPlan`` of a ``[b, S]`` micro-batch from its host (CPU) tensors, on ``device``."""
    if use_remove_padding:
        packed = pack_rows(input_ids, attention_mask, position_ids, response_length, length_multiple, share_prompts)
        if packed is not None:
            packed.target_index = torch.nonzero(packed.target_mask.reshape(-1)).reshape(-1)
            return HostPlan(packed=packed.to(device))
        _warn_fallback()
    if use_fused_kernels:
        valid = attention_mask[:, -response_length:].reshape(-1).bool()
        return HostPlan(valid_index=host_to_device(torch.nonzero(valid).reshape(-1), device))
    return HostPlan()


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    length_multiple: int = 1,
    share_prompts: bool = False,
) -> Optional[PackedRows]:
    """Pack the valid tokens of a ``[b, S]`` batch; ``None`` when exact packing is impossible (positions that
    do not restart at 0 and count up by 1 within each row, multi-dimensional rope positions, no tokens).

    ``length_multiple > 1`` appends padding tokens (``padded_packed_length``) as one extra sequence whose
    position_ids restart at 0, so the per-row attention of the valid tokens is unchanged. ``share_prompts``:
    rows with identical prompts hold the prompt once (``shared_prompts.py``; only where the caller checked
    ``packed_block_mask.supports_shared_prompts``); packed as before when no two rows share one."""
    if position_ids.dim() != 2:
        return None
    valid = attention_mask.bool()
    lengths = valid.sum(dim=1)
    total = int(lengths.sum())
    if total == 0:
        return None
    packed_positions = position_ids[valid]
    row_starts = torch.cumsum(lengths, dim=0) - lengths
    expected = torch.arange(total, device=input_ids.device) - torch.repeat_interleave(row_starts, lengths)
    if not torch.equal(packed_positions, expected.to(packed_positions.dtype)):
        return None
    if share_prompts:
        shared = shared_prompt_layout(input_ids, attention_mask, response_length, length_multiple)  # on the host
        if shared is not None:
            shared.position_ids = shared.position_ids.to(packed_positions.dtype)
            return shared.to(input_ids.device)
    flat_index = torch.full_like(input_ids, -1)
    flat_index[valid] = torch.arange(total, device=input_ids.device)
    response_flat = flat_index[:, -response_length:]
    # a response token is predicted by the previous valid token of the same row
    target_mask = valid[:, -response_length:] & (response_flat > row_starts.unsqueeze(1))
    label_index = response_flat[target_mask]
    packed_ids = input_ids[valid]
    num_padding = padded_packed_length(total, length_multiple) - total
    sequence_lengths = lengths[lengths > 0]
    if num_padding:
        packed_ids = torch.cat([packed_ids, packed_ids.new_zeros(num_padding)])
        pad_positions = torch.arange(num_padding, device=packed_positions.device, dtype=packed_positions.dtype)
        packed_positions = torch.cat([packed_positions, pad_positions])
        sequence_lengths = torch.cat([sequence_lengths, sequence_lengths.new_tensor([num_padding])])
    return PackedRows(
        input_ids=packed_ids.unsqueeze(0),
        position_ids=packed_positions.unsqueeze(0),
        predictor_index=label_index - 1,
        label_index=label_index,
        target_mask=target_mask,
        num_padding=num_padding,
        cu_seq_lens=varlen_attention.cu_seq_lens_from_lengths(sequence_lengths),
        max_length=int(sequence_lengths.max()),
    )


def _entropy(logits: torch.Tensor, with_grad: bool, chunk_size: int) -> torch.Tensor:
    """Entropy per row of ``[K, V]`` logits; without grad it is computed in chunks to bound memory."""
    if with_grad:
        return entropy_from_logits(logits)
    with torch.no_grad():
        return (
            torch.cat([entropy_from_logits(c) for c in logits.split(max(1, chunk_size), dim=0)])
            if logits.numel()
            else logits.new_zeros(logits.shape[0])
        )


def _padded_forward(model, input_ids, attention_mask, position_ids, response_length, use_logits_to_keep):
    kwargs = {"logits_to_keep": response_length + 1} if use_logits_to_keep else {}
    output = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
    )
    return output.logits[:, -response_length - 1 : -1, :]


def scatter_targets(
    values: Optional[torch.Tensor], mask: torch.Tensor, index: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """``[K]`` values into a zero ``[b, R]`` tensor at the True positions of ``mask`` (row-major); ``index``:
    those positions, flat, when known (no device synchronisation)."""
    if values is None:
        return None
    if index is not None:
        return values.new_zeros(mask.numel()).scatter(0, index, values).view(mask.shape)
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def packed_model_inputs(model: nn.Module, packed: PackedRows, use_logits_to_keep: bool = False) -> dict:
    """Model inputs of packed rows: ids, restarting position_ids, the predictor positions as ``logits_to_keep``
    and, under flex_attention, the block-diagonal causal ``BlockMask`` built without a compile
    (``packed_block_mask.packed_attention_mask``; other implementations get no mask); under ``torch_varlen`` the
    sequence boundaries ``cu_seq_lens``/``max_length`` (``varlen_attention.varlen_kwargs``: the same tensor for
    every layer, no per-layer device synchronisation)."""
    kwargs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids)
    if use_logits_to_keep:
        kwargs["logits_to_keep"] = packed.predictor_index
    if packed.cu_seq_lens is not None and attn_implementation(model) == varlen_attention.NAME:
        kwargs.update(varlen_attention.varlen_kwargs(packed.cu_seq_lens, packed.max_length))
    block_mask = packed_attention_mask(model, packed.position_ids, packed.segment_ids, packed.prefix_ids)
    if block_mask is not None:
        kwargs["attention_mask"] = block_mask
    return kwargs


def _warn_fallback() -> None:
    global _warned_fallback
    if not _warned_fallback:
        logger.warning(
            "remove-padding: rows cannot be packed exactly (position_ids do not restart at 0 per row); "
            "using the padded forward for such micro-batches"
        )
        _warned_fallback = True


def _fused_forward(
    model: nn.Module,
    model_kwargs: dict,
    select,
    labels: torch.Tensor,
    temperature: float,
    calculate_entropy: bool,
    entropy_with_grad: bool,
    chunk_size: int,
    backend: str,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run ``model`` with its head computing log-probs ``[K]`` (and entropies) of ``labels`` for the hidden
    states ``select(hidden_states) -> [K, H]``."""
    use_liger = (
        backend in ("triton", "liger")
        and not torch.is_grad_enabled()
        and not calculate_entropy
        and liger_available(labels.device)
    )

    def head(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = select(hidden_states)
        bias = getattr(module, "bias", None)
        if use_liger:
            return liger_log_probs(hidden, module.weight, labels, bias, temperature)[None, :, None]
        log_probs, entropy = chunked_log_probs(
            hidden, module.weight, labels, bias, temperature, chunk_size, calculate_entropy, entropy_with_grad
        )
        stacked = log_probs.unsqueeze(-1) if entropy is None else torch.stack([log_probs, entropy], dim=-1)
        return stacked.unsqueeze(0)  # returned as output.logits: [1, K, 1 or 2]

    with lm_head_override(model, head):
        out = model(**model_kwargs, use_cache=False).logits[0]
    return out[:, 0], (out[:, 1] if calculate_entropy else None)


def forward_response_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    use_remove_padding: bool = False,
    calculate_entropy: bool = False,
    entropy_with_grad: bool = False,
    use_logits_to_keep: bool = True,
    entropy_chunk_size: int = 2048,
    use_fused_kernels: bool = False,
    fused_chunk_size: int = 1024,
    fused_backend: str = "torch",
    plan: Optional[HostPlan] = None,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs ``[b, R]`` of the last ``R = response_length`` tokens (and their entropies when asked).

    Logits are divided by ``temperature`` (the sampling temperature) before the softmax. Entropy is computed
    with gradient only when ``entropy_with_grad`` (an entropy bonus in the loss); otherwise it is a detached
    metric computed in chunks. ``use_fused_kernels``: log-probs from the hidden states without full-vocabulary
    logits (see the module docstring; the caller checks ``fused_logprob.supports_fused_head``), with
    ``fused_backend`` ``torch`` (chunked) or ``triton``/``liger`` (liger-kernel for passes without gradient and
    entropy, on CUDA when installed; chunked otherwise). ``plan``: the layout precomputed from host copies of
    the masks (``host_plan``), so that this function does not synchronise the device; same numbers.
    ``share_prompts``: packed rows with identical prompts hold the prompt once (``shared_prompts.py``).
    """
    if plan is not None:
        packed = plan.packed
    else:
        share_prompts = share_prompts and supports_shared_prompts(model)
        packed = (
            pack_rows(
                input_ids, attention_mask, position_ids, response_length, packed_length_multiple(model), share_prompts
            )
            if use_remove_padding
            else None
        )
        if use_remove_padding and packed is None:
            _warn_fallback()

    fused = dict(
        temperature=temperature,
        calculate_entropy=calculate_entropy,
        entropy_with_grad=entropy_with_grad,
        chunk_size=fused_chunk_size,
        backend=fused_backend,
    )
    if packed is not None and use_fused_kernels:
        index = packed.predictor_index
        token_log_probs, token_entropy = _fused_forward(
            model,
            packed_model_inputs(model, packed, use_logits_to_keep),
            (lambda hidden: hidden[0]) if use_logits_to_keep else (lambda hidden: hidden[0, index]),
            packed.input_ids[0, packed.label_index],
            **fused,
        )
        target, target_index = packed.target_mask, packed.target_index
        return scatter_targets(token_log_probs, target, target_index), scatter_targets(
            token_entropy, target, target_index
        )

    if packed is not None:
        output = model(**packed_model_inputs(model, packed, use_logits_to_keep), use_cache=False)
        logits = output.logits[0] if use_logits_to_keep else output.logits[0, packed.predictor_index]
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        labels = packed.input_ids[0, packed.label_index]
        token_log_probs = logprobs_from_logits(logits, labels)
        token_entropy = _entropy(logits, entropy_with_grad, entropy_chunk_size) if calculate_entropy else None
        target, target_index = packed.target_mask, packed.target_index
        return scatter_targets(token_log_probs, target, target_index), scatter_targets(
            token_entropy, target, target_index
        )

    if use_fused_kernels:
        valid = attention_mask[:, -response_length:].bool()
        valid_index = plan.valid_index if plan is not None else None
        kwargs = {"logits_to_keep": response_length + 1} if use_logits_to_keep else {}
        if valid_index is not None:  # gathers by precomputed positions: no boolean indexing on the device

            def select(hidden: torch.Tensor) -> torch.Tensor:
                predictors = hidden[:, -response_length - 1 : -1]
                return predictors.reshape(-1, predictors.shape[-1]).index_select(0, valid_index)

            labels = input_ids[:, -response_length:].reshape(-1).index_select(0, valid_index)
        else:

            def select(hidden: torch.Tensor) -> torch.Tensor:
                return hidden[:, -response_length - 1 : -1][valid]

            labels = input_ids[:, -response_length:][valid]
        token_log_probs, token_entropy = _fused_forward(
            model,
            dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs),
            select,
            labels,
            **fused,
        )
        return scatter_targets(token_log_probs, valid, valid_index), scatter_targets(token_entropy, valid, valid_index)

    logits = _padded_forward(model, input_ids, attention_mask, position_ids, response_length, use_logits_to_keep)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    valid = attention_mask[:, -response_length:].to(logits.dtype)
    log_probs = logprobs_from_logits(logits, input_ids[:, -response_length:]) * valid
    entropy = None
    if calculate_entropy:
        flat = logits.reshape(-1, logits.shape[-1])
        entropy = _entropy(flat, entropy_with_grad, entropy_chunk_size).reshape(valid.shape) * valid
    return log_probs, entropy

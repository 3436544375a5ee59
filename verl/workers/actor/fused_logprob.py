"""Log-probs (and entropies) of target tokens straight from hidden states, without ``[tokens, vocab]`` logits.

``chunked_log_probs(hidden, weight, bias, labels, temperature, chunk_size)`` computes, for ``chunk_size``
tokens at a time, ``logits = (hidden_chunk @ weight.T + bias).float() / temperature`` and from them the
log-prob of each label and (when asked) the entropy, in float32 for that chunk only. The backward pass
recomputes each chunk's logits from the saved hidden states instead of keeping ``[T, V]`` float32 logits (and
their softmax) alive: for a Qwen2.5 vocabulary (151,936) and 8K tokens that is ~5 GB per copy in float32.
The numbers are those of the unfused ``model(...).logits.float() / temperature`` -> ``log_softmax`` ->
``gather`` path: the same operations in the same dtypes per element (tested to 1e-5 in float32, gradients of
hidden states, lm_head weight and bias included). The weight gradient is accumulated over chunks in the
weight's dtype (``addmm``), as liger-kernel does.

``lm_head_override(model, fn)`` runs a causal LM's own forward with its output projection replaced by
``fn(hidden_states)``: the decoder body, position handling, FSDP2 unsharding (the lm_head weight is gathered
by the root module's hooks) and peft wrappers all stay as they are, and whatever ``fn`` returns comes back as
``output.logits``. Models that post-process logits (soft-capping, logit scaling) are not eligible
(``supports_fused_head``); the caller then uses the unfused path.

On CUDA, ``impl_backend`` ``triton``/``liger`` uses liger-kernel's fused linear cross-entropy (when importable)
for log-prob passes without gradient and without entropy (old and reference log-probs): ``-loss`` with
``reduction='none'`` is the log-prob per token. The policy update always uses the chunked path here, because
liger's ``reduction='none'`` backward scales its precomputed gradients by a single scalar, which is wrong for a
per-token loss such as PPO's (a known liger-kernel issue).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from verl.utils.lora import base_model

__all__ = [
    "FUSED_BACKENDS",
    "chunked_log_probs",
    "liger_available",
    "liger_log_probs",
    "lm_head_override",
    "supports_fused_head",
]


# ``actor_rollout_ref.model.fused_kernel_options.impl_backend`` values (upstream verl: torch | triton)
FUSED_BACKENDS = ("torch", "triton", "liger")

# config attributes of models whose forward changes the lm_head output before returning it
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling")


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], temperature: float
) -> torch.Tensor:
    """float32 logits of one chunk, computed as the unfused path does (linear in the model dtype, then
    ``.float()``, then the division by the temperature: in place, the tensor is this function's own)."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class _ChunkedLogProbs(torch.autograd.Function):
    """See ``chunked_log_probs``. Saves hidden states, labels and per-token logsumexp/entropy only; every
    ``[chunk, V]`` temporary is updated in place where the math allows (they dominate the time next to the
    matmuls on a GPU)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, with_entropy, entropy_grad):
        num_tokens = hidden.shape[0]
        log_probs = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if with_entropy else None
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits = _chunk_logits(hidden[start:end], weight, bias, temperature)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[start:end] = chunk_lse
            log_probs[start:end] = logits.gather(-1, labels[start:end].unsqueeze(-1)).squeeze(-1) - chunk_lse
            if with_entropy:  # H = lse - sum(p * z)
                entropy[start:end] = chunk_lse - F.softmax(logits, dim=-1).mul_(logits).sum(dim=-1)
            del logits
        ctx.temperature, ctx.chunk_size, ctx.entropy_grad = temperature, chunk_size, entropy_grad
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy if with_entropy else None)
        ctx.set_materialize_grads(False)
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return (log_probs, entropy) if with_entropy else (log_probs,)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy=None):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        use_entropy = grad_entropy is not None and ctx.entropy_grad
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        if grad_log_probs is None and not use_entropy:
            grad_hidden = torch.zeros_like(hidden) if need_hidden else None
            return grad_hidden, grad_weight, grad_bias, None, None, None, None, None
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        # z = raw / T: every gradient w.r.t. z is divided by T on the way to the raw logits (folded in here)
        scale = 1.0 / temperature
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end]
            logits = _chunk_logits(h, weight, bias, temperature)
            chunk_lse = lse[start:end].unsqueeze(-1)
            # d log p(y) / d z = onehot(y) - p ;  d H / d z = -p * (z - sum(p * z)),  sum(p * z) = lse - H
            if use_entropy:
                probs = (logits - chunk_lse).exp_()  # one [chunk, V] temporary, not two
                expected = (lse[start:end] - entropy[start:end]).unsqueeze(-1)
                grad_entropy_chunk = grad_entropy[start:end].unsqueeze(-1) * scale
                grad_logits = logits.sub_(expected).mul_(probs).mul_(-grad_entropy_chunk)  # reuses logits
            else:
                probs = logits.sub_(chunk_lse).exp_()  # reuses logits
                grad_logits = None
            if grad_log_probs is not None:
                g = grad_log_probs[start:end].unsqueeze(-1) * scale
                probs.mul_(-g)
                probs.scatter_add_(-1, labels[start:end].unsqueeze(-1), g)
                grad_logits = probs if grad_logits is None else grad_logits.add_(probs)
            del logits, probs
            if grad_bias is not None:
                grad_bias += grad_logits.sum(dim=0)
            grad_logits = grad_logits.to(h.dtype)  # the backward of ``.float()``
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h)
            del grad_logits
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def chunked_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    calculate_entropy: bool = False,
    entropy_with_grad: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs ``[K]`` (float32) of ``labels`` under ``softmax((hidden @ weight.T + bias) / temperature)`` for
    ``hidden`` ``[K, H]``, and the entropies ``[K]`` when ``calculate_entropy`` (differentiable only with
    ``entropy_with_grad``; otherwise a detached metric) or None. At most ``chunk_size x V`` logits exist at once."""
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_log_probs: hidden must be [K, H] and labels [K], got {hidden.shape} and {labels.shape}"
        )
    if int(chunk_size) < 1:
        raise ValueError(f"chunked_log_probs: chunk_size must be >= 1, got {chunk_size}")
    out = _ChunkedLogProbs.apply(
        hidden,
        weight,
        bias,
        labels.long(),
        float(temperature),
        int(chunk_size),
        bool(calculate_entropy),
        bool(entropy_with_grad),
    )
    return (out[0], out[1]) if calculate_entropy else (out[0], None)


# ---------------------------------------------------------------------------------------------- liger-kernel
def liger_available(device: torch.device) -> bool:
    """True on CUDA when liger-kernel's fused linear cross-entropy imports."""
    if device.type != "cuda":
        return False
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or a broken Triton install
        return False
    return True


def liger_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs ``[K]`` via liger-kernel's fused linear cross-entropy (CUDA; no gradient: see the module doc).
    The temperature scales the hidden states (in float32, rounded back to their dtype), a difference of
    rounding only from the unfused path."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        raise RuntimeError("liger_log_probs is for passes without gradient; use chunked_log_probs for the update")
    if temperature != 1.0:
        hidden = (hidden.float() / temperature).to(hidden.dtype)
        if bias is not None:
            bias = (bias.float() / temperature).to(bias.dtype)
    loss = liger_fused_linear_cross_entropy(hidden, weight, labels.long(), bias=bias, reduction="none")
    if isinstance(loss, tuple):  # versions that return (loss, z_loss, ...)
        loss = loss[0]
    return -loss.float()


# ---------------------------------------------------------------------------------------------- the model's head
def supports_fused_head(model: nn.Module) -> bool:
    """True when the model's forward returns its output projection unchanged as ``logits`` (checked by the
    config's logit post-processing keys) and the projection is a plain linear layer (``weight`` [V, H])."""
    base = base_model(model)
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dim() != 2:
        return False
    config = getattr(base, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _LOGIT_POSTPROCESSING:
        value = getattr(text_config, key, None)
        if value is not None and value != 1.0 and value is not False:
            return False
    return True


@contextlib.contextmanager
def lm_head_override(model: nn.Module, fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Within the block, the model's output projection returns ``fn(head, hidden_states)`` (``head`` is the
    projection module: read ``head.weight`` inside ``fn``, where FSDP has gathered it)."""
    head = base_model(model).get_output_embeddings()
    head.forward = lambda hidden_states: fn(head, hidden_states)
    try:
        yield
    finally:
        del head.forward

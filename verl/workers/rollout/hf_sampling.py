"""Batched token sampling with per-row settings (temperature, top-k, top-p, greedy, seeded generators).

Used by :class:`verl.workers.rollout.hf_engine.HFRolloutEngine`. Everything is torch ops on the
logits' device; the only per-row Python loop draws noise for rows that carry their own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIN_TEMPERATURE = 1e-5


@dataclass
class RowSamplingState:
    """Per-row sampling settings of the current batch, as tensors on the logits' device."""

    temperature: torch.Tensor  # [B] float; 1.0 for greedy rows
    top_k: torch.Tensor  # [B] long; vocab size when off
    top_p: torch.Tensor  # [B] float; 1.0 when off
    greedy: torch.Tensor  # [B] bool
    generators: list[torch.Generator | None]  # per row; None -> the engine's shared generator
    any_sampled: bool
    any_filtered: bool  # some row uses top-k or top-p

    def select(self, index: torch.Tensor, index_list: list[int]) -> RowSamplingState:
        """Keep only the rows in ``index`` (same order)."""
        return RowSamplingState(
            temperature=self.temperature[index],
            top_k=self.top_k[index],
            top_p=self.top_p[index],
            greedy=self.greedy[index],
            generators=[self.generators[i] for i in index_list],
            any_sampled=self.any_sampled,
            any_filtered=self.any_filtered,
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to ``-inf`` the logits outside each row's top-k, then outside its top-p nucleus.

    Top-p is applied to the distribution renormalised after top-k (the order HF and vLLM use); the most
    likely token is always kept.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove_sorted = ranks >= top_k.clamp(min=1, max=vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove_sorted, float("-inf"))
    probs_sorted = sorted_logits.softmax(dim=-1)
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    remove_sorted |= mass_before > top_p.unsqueeze(1)
    remove_sorted[:, 0] = False
    remove = torch.zeros_like(remove_sorted).scatter_(1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def sample_tokens(
    logits: torch.Tensor, state: RowSamplingState, shared_generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return ``(tokens [B] long, log_probs [B] float32)``.

    Greedy rows take the arg-max and report the temperature-1 log-prob. Sampled rows draw from
    ``softmax(top_k_top_p(logits / T))`` using the exponential-race trick
    (``argmax(log p - log E)``, ``E ~ Exp(1)``), with noise from the row's own generator when it has one,
    so a seeded row's draws do not depend on the other rows of the batch. Their log-prob is taken from
    that same processed distribution.
    """
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if not state.any_sampled:
        log_probs = torch.log_softmax(logits, dim=-1)
        return greedy_tokens, log_probs.gather(1, greedy_tokens.unsqueeze(1)).squeeze(1)

    temperature = torch.where(state.greedy, torch.ones_like(state.temperature), state.temperature)
    scaled = logits / temperature.clamp(min=_MIN_TEMPERATURE).unsqueeze(1)
    if state.any_filtered:
        # Greedy rows keep their full distribution (their log-prob is the temperature-1 one).
        vocab = logits.shape[-1]
        top_k = torch.where(state.greedy, torch.full_like(state.top_k, vocab), state.top_k)
        top_p = torch.where(state.greedy, torch.ones_like(state.top_p), state.top_p)
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    log_probs = torch.log_softmax(scaled, dim=-1)

    noise = torch.empty_like(log_probs)
    if shared_generator is not None:
        noise.exponential_(generator=shared_generator)
    else:
        noise.exponential_()
    for row, gen in enumerate(state.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    sampled_tokens = (log_probs - noise.clamp(min=1e-20).log()).argmax(dim=-1)

    tokens = torch.where(state.greedy, greedy_tokens, sampled_tokens)
    return tokens, log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)

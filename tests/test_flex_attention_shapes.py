"""Packed rows under flex_attention: lengths padded to whole flex blocks, a bounded number of compilations.

What is checked (CPU, float32, the tiny Qwen2 model; flex_attention runs on CPU through inductor):
* ``padded_packed_length`` / ``pack_rows(length_multiple=...)`` against hand-computed layouts: padding is appended
  as one extra sequence with position_ids ``0, 1, ...`` and never indexed by the log-prob gather;
* ``packed_length_multiple`` is flex's block size (128) for a flex_attention model and 1 for sdpa;
* padding changes no log-prob: sdpa packed with and without padding agree to 1e-6;
* over 8 packed lengths from 60 to 1000 tokens (one-block and many-block micro-batches, in an order that makes
  torch specialise without the padding), flex_attention compiles 2 graphs in all (one static, one dynamic; 3
  without the padding, measured; the block mask is built without compiling, ``test_packed_block_mask.py``;
  while transformers compiled it, 4 and 6), and every call's log-probs equal the padded
  sdpa forward to 1e-5 (also through the fused log-prob head). (flex_attention has no backward on CPU: the update path's compile is GPU-only.)
"""

from __future__ import annotations

import pytest
import torch

from tests.packed_batches import RESPONSE_LENGTH, padded_batch
from verl.utils.model_loading import load_causal_lm
from verl.workers.actor.forward import (
    forward_response_log_probs,
    pack_rows,
    packed_length_multiple,
    padded_packed_length,
)


def test_padded_packed_length():
    assert padded_packed_length(100, 1) == 100
    assert [padded_packed_length(t, 128) for t in (1, 100, 128, 255, 256, 257, 1000)] == [
        256,
        256,
        256,
        256,
        256,
        384,
        1024,
    ]


def test_pack_rows_pads_with_one_extra_sequence():
    input_ids = torch.tensor([[0, 5, 6, 7, 0], [0, 0, 8, 9, 10]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    position_ids = torch.tensor([[0, 0, 1, 2, 2], [0, 0, 0, 1, 2]])
    packed = pack_rows(input_ids, attention_mask, position_ids, response_length=2, length_multiple=4)
    # 6 valid tokens -> 8 (two multiples of 4): two padding tokens, a new sequence starting at position 0
    assert packed.num_padding == 2
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    assert packed.label_index.tolist() == [2, 4, 5] and packed.predictor_index.tolist() == [1, 3, 4]
    assert packed.target_mask.tolist() == [[True, False], [True, True]]
    unpadded = pack_rows(input_ids, attention_mask, position_ids, response_length=2)
    assert unpadded.num_padding == 0 and unpadded.input_ids.shape == (1, 6)


def test_packed_length_multiple(sdpa_model, tiny_model_path):
    flex = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="flex_attention")
    assert packed_length_multiple(flex) == 128
    assert packed_length_multiple(sdpa_model) == 1


@torch.no_grad()
def test_padding_changes_no_log_prob_sdpa(sdpa_model):
    input_ids, attention_mask, position_ids = padded_batch([37, 90, 5], seed=0)
    results = []
    for multiple in (1, 128):
        packed = pack_rows(input_ids, attention_mask, position_ids, RESPONSE_LENGTH, length_multiple=multiple)
        logits = sdpa_model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
        log_probs = torch.log_softmax(logits[0, packed.predictor_index].float(), dim=-1)
        results.append(log_probs.gather(-1, packed.input_ids[0, packed.label_index].unsqueeze(-1)).squeeze(-1))
    assert results[0].numel() > 20
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-6)


@pytest.mark.slow  # ~85 s on 2 busy cores with a cold inductor cache (compiles on CPU), ~10 s warm
@torch.no_grad()
def test_flex_packed_lengths_compile_a_bounded_number_of_times(sdpa_model, tiny_model_path):
    from torch._dynamo.utils import counters

    flex = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="flex_attention").eval()
    torch._dynamo.reset()
    counters.clear()
    # 100 then 140 (static, then dynamic compile), 60 and 90 (a single flex block), then longer ones
    totals = [100, 140, 60, 300, 700, 90, 1000, 513]
    for call, total in enumerate(totals):
        lengths = [total // 3, total // 3, total - 2 * (total // 3)]
        input_ids, attention_mask, position_ids = padded_batch(lengths, seed=call)
        log_probs, _ = forward_response_log_probs(
            flex, input_ids, attention_mask, position_ids, RESPONSE_LENGTH, use_remove_padding=True
        )
        reference, _ = forward_response_log_probs(
            sdpa_model, input_ids, attention_mask, position_ids, RESPONSE_LENGTH, use_remove_padding=False
        )
        assert int(attention_mask.sum()) == total
        torch.testing.assert_close(log_probs, reference, rtol=0, atol=1e-5)
    # the fused log-prob head reads the same packed positions (padding is never selected)
    fused, _ = forward_response_log_probs(
        flex, input_ids, attention_mask, position_ids, RESPONSE_LENGTH, use_remove_padding=True, use_fused_kernels=True
    )
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-5)
    # flex_attention: one static and one dynamic graph (no create_block_mask graph: our BlockMask is not compiled)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_benchmark_batches_hold_the_asked_packed_length():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_flex_shapes import make_batch

    gen = torch.Generator().manual_seed(0)
    for total in (60, 257, 1500):
        input_ids, attention_mask, position_ids = make_batch(total, rows=4, response_length=32, vocab=100, gen=gen)
        assert int(attention_mask.sum()) == total and attention_mask[:, -32:].sum(dim=1).min() >= 1
        packed = pack_rows(input_ids, attention_mask, position_ids, 32, length_multiple=128)
        assert packed is not None and packed.input_ids.shape[1] == padded_packed_length(total, 128)

"""Rows sharing a prompt packed with the prompt once (``verl/workers/actor/shared_prompts.py``).

What is checked (CPU, float32):
* grouping by identical valid prompt tokens (whatever the left padding), empty prompts alone, units split at the
  token budget; the packed layout of a small batch checked by hand (tokens, positions, segments, predictors);
* the shared-prompt ``BlockMask`` equals torch's ``create_block_mask`` of the same mask function (every field),
  on hand-made, random and synthetic layouts (many segments, block sizes 1-128), with chunked evaluation; at 65,536
  tokens against ``packed_block_mask`` (rows alone) and the element mask (sampled query blocks); built without a
  host synchronisation; the dense sdpa/eager masks equal its element mask;
* the tiny Qwen2 model: shared-prompt packing under sdpa (boolean mask) and eager (additive mask) gives the
  padded forward's log-probs (1e-5), fused and unfused head, with and without a host plan; gradients under sdpa
  equal the unshared packed ones (1e-5); flex_attention shares prompts on CUDA only (the GPU test below);
* the actor: micro-batches keep a group together under a token budget; ``compute_log_prob`` and ``update_policy``
  (loss, gradients, updated parameters) equal ``share_prompts=False``; ``actor/shared_prompt_tokens`` counts the
  prompt tokens not repeated; variable-length kernels (and flex_attention on CPU) turn sharing off;
* the MemAgent training step (bench_train_step's trainer run, CPU) with and without sharing: same losses and norms.
* GPU (``@pytest.mark.gpu``): flex_attention gradients with shared prompts equal the unshared packed ones.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from verl.protocol import DataProto
from verl.utils.model_loading import load_causal_lm
from verl.utils.seqlen_balancing import split_rows_evenly
from verl.workers.actor import DataParallelPPOActor
from verl.workers.actor.forward import forward_response_log_probs, host_plan, pack_rows
from verl.workers.actor.packed_block_mask import (
    packed_attention_mask,
    shared_prompt_block_mask,
    shared_prompt_dense_mask,
    supports_shared_prompts,
)
from verl.workers.actor.shared_prompts import micro_batch_units, prompt_groups, shared_prompt_layout

R = 6  # response columns


def shared_batch(prompts: list[list[int]], responses: list[list[int]]):
    """Left-padded prompts + right-padded responses (``R`` columns): input_ids, attention_mask, position_ids."""
    width = max(len(p) for p in prompts)
    rows, masks = [], []
    for prompt, response in zip(prompts, responses):
        pad = width - len(prompt)
        rows.append([0] * pad + prompt + response + [0] * (R - len(response)))
        masks.append([0] * pad + [1] * (len(prompt) + len(response)) + [0] * (R - len(response)))
    attention_mask = torch.tensor(masks)
    return torch.tensor(rows), attention_mask, (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


def random_shared_batch(seed: int, groups=((3, 40), (1, 25), (4, 57), (2, 9)), vocab: int = 1000):
    """``groups``: (rows, prompt length) per prompt; rows of a group interleaved with the others' (as a shuffled
    mini-batch would hold them); responses of 1..R tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for count, length in groups:
        prompt = torch.randint(5, vocab, (length,), generator=gen).tolist()
        for _ in range(count):
            prompts.append(prompt)
            responses.append(
                torch.randint(5, vocab, (int(torch.randint(1, R + 1, (1,), generator=gen)),), generator=gen).tolist()
            )
    order = torch.randperm(len(prompts), generator=gen).tolist()
    return shared_batch([prompts[i] for i in order], [responses[i] for i in order])


# ------------------------------------------------------------------------------------------- grouping and layout
def test_prompt_groups_ignore_left_padding_and_keep_empty_prompts_alone():
    ids, mask, _ = shared_batch(
        [[7, 8, 9], [5], [7, 8, 9], [], [], [8, 9], [7, 8, 9]], [[1], [2], [3, 4], [5], [6], [1], [2]]
    )
    assert prompt_groups(ids, mask, R) == [[0, 2, 6], [1], [3], [4], [5]]


def test_micro_batch_units_count_the_prompt_once_and_split_at_the_budget():
    ids, mask, _ = shared_batch([[7, 8, 9], [5], [7, 8, 9], [7, 8, 9]], [[1, 1], [2], [3, 4, 4, 4], [1]])
    units, lengths = micro_batch_units(ids, mask, R, None)
    assert (units, lengths) == ([[0, 2, 3], [1]], [3 + 2 + 4 + 1, 2])
    # budget 9: 3 + 2 + 4 = 9 fits, the third row starts a new unit with its own copy of the prompt
    assert micro_batch_units(ids, mask, R, 9) == ([[0, 2], [3], [1]], [9, 4, 2])
    # a row longer than the budget alone still forms a unit
    assert micro_batch_units(ids, mask, R, 4) == ([[0], [2], [3], [1]], [5, 7, 4, 2])


def test_layout_by_hand():
    # rows 0 and 2 share [7, 8, 9]; row 1 alone
    ids, mask, positions = shared_batch([[7, 8, 9], [5, 6], [7, 8, 9]], [[11, 12], [21], [31, 32, 33]])
    layout = shared_prompt_layout(ids, mask, R)
    #                 prompt     | row 0 resp | row 2 resp    | row 1 (prompt + response)
    assert layout.input_ids[0].tolist() == [7, 8, 9, 11, 12, 31, 32, 33, 5, 6, 21]
    assert layout.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2]
    assert layout.segment_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3]
    assert layout.prefix_ids.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 3, 3, 3]
    # targets in row-major order: row 0 (11, 12), row 1 (21), row 2 (31, 32, 33)
    assert layout.label_index.tolist() == [3, 4, 10, 5, 6, 7]
    assert layout.predictor_index.tolist() == [2, 3, 9, 2, 5, 6]
    assert layout.target_mask.sum(dim=1).tolist() == [2, 1, 3]
    assert layout.tokens_saved == 3
    assert shared_prompt_layout(*shared_batch([[1], [2]], [[3], [4]])[:2], R) is None
    packed = pack_rows(ids, mask, positions, R, length_multiple=8, share_prompts=True)
    assert packed.input_ids.shape == (1, 16) and packed.num_padding == 5 and packed.cu_seq_lens is None
    assert packed.segment_ids[-5:].tolist() == [4] * 5 and packed.prefix_ids[-5:].tolist() == [4] * 5
    assert packed.position_ids[0, -5:].tolist() == [0, 1, 2, 3, 4]
    # without a shared prompt (or not asked), the plain packing
    plain = pack_rows(ids, mask, positions, R, share_prompts=False)
    assert plain.segment_ids is None and plain.input_ids.shape[1] == 14


def test_a_row_with_an_empty_prompt_has_no_predictor_for_its_first_token():
    ids, mask, _ = shared_batch([[4, 4], [], [4, 4]], [[1], [2, 3], [5]])
    layout = shared_prompt_layout(ids, mask, R)
    assert layout.target_mask.sum(dim=1).tolist() == [1, 1, 1]
    assert layout.input_ids[0].tolist() == [4, 4, 1, 5, 2, 3]
    assert layout.label_index.tolist() == [2, 5, 3] and layout.predictor_index.tolist() == [1, 4, 1]


def test_a_row_without_response_tokens_shares_its_prompt_and_has_no_targets():
    ids, mask, positions = shared_batch([[4, 5, 6], [4, 5, 6], [9]], [[], [1, 2], [3]])
    layout = shared_prompt_layout(ids, mask, R)
    assert layout.input_ids[0].tolist() == [4, 5, 6, 1, 2, 9, 3]
    assert layout.segment_ids.tolist() == [0, 0, 0, 2, 2, 3, 3]  # segment 1: the empty response
    assert layout.prefix_ids.tolist() == [0, 0, 0, 0, 0, 3, 3]
    assert layout.target_mask.sum(dim=1).tolist() == [0, 2, 1]
    assert layout.label_index.tolist() == [3, 4, 6] and layout.predictor_index.tolist() == [2, 3, 5]
    packed = pack_rows(ids, mask, positions, R, length_multiple=8, share_prompts=True)
    assert packed.segment_ids[7:].tolist() == [4] * 9  # the padding segment follows the last one


# ------------------------------------------------------------------------------------------- masks
def _mask_mod(segment_ids, prefix_ids):
    def mask_mod(b, h, q, kv):
        return (q >= kv) & ((segment_ids[kv] == segment_ids[q]) | (segment_ids[kv] == prefix_ids[q]))

    return mask_mod


def _layouts():
    yield "by hand", torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3]), torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 3, 3, 3])
    for seed in range(4):
        ids, mask, positions = random_shared_batch(seed)
        packed = pack_rows(ids, mask, positions, R, length_multiple=1, share_prompts=True)
        yield f"random {seed}", packed.segment_ids, packed.prefix_ids


@pytest.mark.parametrize("block_size", [1, 4, 16, 128])
def test_shared_prompt_block_mask_equals_create_block_mask(block_size):
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices")
    for name, segment_ids, prefix_ids in _layouts():
        length = segment_ids.numel()
        reference = create_block_mask(
            _mask_mod(segment_ids, prefix_ids),
            1,
            None,
            length,
            length,
            device="cpu",
            BLOCK_SIZE=block_size,
            _compile=False,
        )
        # one evaluation, and one query block at a time (block_size queries x n key/value blocks)
        for chunk in (1 << 26, block_size * -(-length // block_size)):
            ours = shared_prompt_block_mask(segment_ids, prefix_ids, block_size, max_chunk_elements=chunk)
            for field in fields:
                torch.testing.assert_close(getattr(ours, field), getattr(reference, field), msg=f"{name}: {field}")
            assert torch.equal(ours.to_dense(), reference.to_dense()), name
        dense = create_mask(_mask_mod(segment_ids, prefix_ids), 1, 1, length, length, device="cpu")
        assert torch.equal(shared_prompt_dense_mask(segment_ids, prefix_ids, additive=False), dense)
        additive = shared_prompt_dense_mask(segment_ids, prefix_ids, additive=True)
        assert torch.equal(additive == 0, dense) and additive.dtype == torch.float32


def synthetic_layout(seed: int, length: int, max_piece: int):
    """segment_ids/prefix_ids of ``length`` tokens as ``shared_prompt_layout`` lays them out: groups (a prompt
    segment, then 1-8 responses whose prefix it is, the first response right after it) and rows alone (their own
    prefix), pieces of 1..``max_piece`` tokens, and a padding segment at the end."""
    gen = torch.Generator().manual_seed(seed)
    lengths, prefixes = [], []
    while sum(lengths) < length:
        prompt = len(lengths)
        if torch.rand((), generator=gen) < 0.7:
            responses = int(torch.randint(1, 9, (1,), generator=gen))
            for _ in range(responses + 1):
                lengths.append(int(torch.randint(1, max_piece + 1, (1,), generator=gen)))
                prefixes.append(prompt)
        else:
            lengths.append(int(torch.randint(1, max_piece + 1, (1,), generator=gen)))
            prefixes.append(prompt)
    while sum(lengths) - lengths[-1] >= length:  # whole pieces past the end
        lengths.pop(), prefixes.pop()
    lengths[-1] -= sum(lengths) - length
    if len(lengths) > 2:  # the last piece: padding, a segment of its own
        prefixes[-1] = len(lengths) - 1
    counts = torch.tensor(lengths)
    return torch.repeat_interleave(torch.arange(len(lengths)), counts), torch.repeat_interleave(
        torch.tensor(prefixes), counts
    )


@pytest.mark.parametrize("block_size", [1, 2, 16, 128])
def test_shared_prompt_block_mask_equals_create_block_mask_on_synthetic_layouts(block_size):
    """Many segments, pieces shorter and longer than a block, lengths not a multiple of the block: every field."""
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    for seed in range(6):
        length, max_piece = (700, 40) if block_size < 16 else (3000 + 37 * seed, [20, 300, 900][seed % 3])
        segment_ids, prefix_ids = synthetic_layout(seed, length, max_piece)
        reference = create_block_mask(
            _mask_mod(segment_ids, prefix_ids), 1, None, length, length, device="cpu", BLOCK_SIZE=block_size,
            _compile=False,
        )  # fmt: skip
        ours = shared_prompt_block_mask(segment_ids, prefix_ids, block_size, max_chunk_elements=block_size * 40)
        for field in fields:
            torch.testing.assert_close(getattr(ours, field), getattr(reference, field), msg=f"seed {seed}: {field}")


def test_shared_prompt_block_mask_at_a_micro_batch_of_65536_tokens():
    """At the 135M recipe's update budget (65,536 tokens, 512 blocks; the T x T element mask would be 4.3G values):
    rows alone (each its own prefix) give the block-diagonal causal mask of ``packed_block_mask``, an independent
    builder; with shared prompts, the partial and full key/value blocks of five query blocks are those of the element
    mask evaluated for them."""
    from verl.workers.actor.packed_block_mask import packed_block_mask

    length = 65536
    segment_ids, prefix_ids = synthetic_layout(7, length, 2000)
    alone = shared_prompt_block_mask(segment_ids, segment_ids)
    starts = torch.diff(segment_ids, prepend=segment_ids[:1] - 1) != 0
    position_ids = torch.arange(length) - torch.cummax(torch.where(starts, torch.arange(length), 0), dim=0).values
    documents = packed_block_mask(position_ids[None])
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(alone, field), getattr(documents, field)), field
    shared = shared_prompt_block_mask(segment_ids, prefix_ids)
    allowed = _mask_mod(segment_ids, prefix_ids)
    kv = torch.arange(length)
    for block in (0, 1, 255, 388, 511):
        q = torch.arange(block * 128, block * 128 + 128)
        grid = allowed(0, 0, q[:, None], kv[None, :]).reshape(128, 512, 128)
        full = grid.all(dim=2).all(dim=0)
        partial = grid.any(dim=2).any(dim=0) & ~full
        for kind, expected in (("kv", partial), ("full_kv", full)):
            count = int(getattr(shared, f"{kind}_num_blocks")[0, 0, block])
            assert count == int(expected.sum()), (block, kind)
            indices = getattr(shared, f"{kind}_indices")[0, 0, block, :count]
            assert indices.tolist() == expected.nonzero().flatten().tolist(), (block, kind)


def test_shared_prompt_block_mask_builds_without_host_synchronisation():
    from tests.test_update_host_syncs import SyncCounter

    segment_ids, prefix_ids = synthetic_layout(3, 4096, 200)
    with SyncCounter() as counter:
        shared_prompt_block_mask(segment_ids, prefix_ids)
    assert sum(counter.by_origin.values()) == 0, counter.sites


def test_only_masked_attention_implementations_share_prompts(sdpa_model, flex_model):
    assert supports_shared_prompts(sdpa_model)
    # flex_attention: on CUDA only (inductor's CPU code for this mask does not compile under dynamic shapes)
    assert not supports_shared_prompts(flex_model)
    on_gpu = SimpleNamespace(config=flex_model.config, parameters=lambda: iter([torch.empty(1, device="meta")]))
    assert supports_shared_prompts(on_gpu)
    for attn in ("flash_attention_2", "torch_varlen"):
        config = SimpleNamespace(_attn_implementation=attn, sliding_window=None, layer_types=None)
        assert not supports_shared_prompts(SimpleNamespace(config=config))
    window = SimpleNamespace(_attn_implementation="flex_attention", sliding_window=64, layer_types=None)
    assert not supports_shared_prompts(SimpleNamespace(config=window))
    segments = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="flash_attention_2"):
        config = SimpleNamespace(_attn_implementation="flash_attention_2", sliding_window=None, layer_types=None)
        packed_attention_mask(SimpleNamespace(config=config), segments[None], segments, segments)


# ------------------------------------------------------------------------------------------- the model
@torch.no_grad()
def test_shared_prompt_log_probs_equal_the_padded_forward(sdpa_model, eager_model):
    for seed in range(2):
        batch = random_shared_batch(seed, vocab=sdpa_model.config.vocab_size)
        reference, reference_entropy = forward_response_log_probs(sdpa_model, *batch, R, calculate_entropy=True)
        assert (reference != 0).sum() > 20
        for model, multiple in ((sdpa_model, 1), (eager_model, 8)):
            for fused in (False, True):
                log_probs, entropy = forward_response_log_probs(
                    model,
                    *batch,
                    R,
                    use_remove_padding=True,
                    use_fused_kernels=fused,
                    share_prompts=True,
                    calculate_entropy=True,
                )
                torch.testing.assert_close(log_probs, reference, rtol=0, atol=1e-5)
                torch.testing.assert_close(entropy, reference_entropy, rtol=0, atol=1e-5)
            plan = host_plan(*batch, R, True, True, multiple, torch.device("cpu"), share_prompts=True)
            assert plan.packed.tokens_saved == 2 * 40 + 3 * 57 + 1 * 9
            log_probs, _ = forward_response_log_probs(
                model, *batch, R, use_remove_padding=True, use_fused_kernels=True, plan=plan
            )
            torch.testing.assert_close(log_probs, reference, rtol=0, atol=1e-5)


def test_shared_prompt_gradients_equal_unshared_packing(tiny_model_path):
    batch = random_shared_batch(3)
    weights = torch.linspace(-1, 1, R)
    grads = {}
    model = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa").train()
    for share in (False, True):
        model.zero_grad()
        log_probs, _ = forward_response_log_probs(
            model, *batch, R, use_remove_padding=True, use_fused_kernels=True, share_prompts=share
        )
        (log_probs * weights).sum().backward()
        grads[share] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert sum(g.abs().sum() for g in grads[True].values()) > 0


# ------------------------------------------------------------------------------------------- the actor
def actor_config(**overrides) -> dict:
    config = dict(
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=200,
        ppo_epochs=1,
        clip_ratio=0.2,
        loss_agg_mode="token-mean",
        use_kl_loss=False,
        entropy_coeff=0.0,
        grad_clip=1.0,
        use_remove_padding=True,
        optim={"lr": 1e-3},
    )
    config.update(overrides)
    return config


def update_data(seed: int, vocab: int) -> DataProto:
    ids, mask, positions = random_shared_batch(seed, vocab=vocab)
    gen = torch.Generator().manual_seed(seed)
    response_mask = mask[:, -R:].float()
    return DataProto.from_dict(
        tensors={
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": positions,
            "responses": ids[:, -R:],
            "response_mask": response_mask,
            "old_log_probs": -torch.rand(ids.shape[0], R, generator=gen) * response_mask,
            "advantages": torch.randn(ids.shape[0], 1, generator=gen).expand(-1, R) * response_mask,
        }
    )


def test_micro_batches_keep_a_group_together(sdpa_model):
    actor = DataParallelPPOActor(actor_config(ppo_max_token_len_per_gpu=120), sdpa_model)
    data = update_data(0, sdpa_model.config.vocab_size)
    groups = prompt_groups(data.batch["input_ids"], data.batch["attention_mask"], R)
    parts = actor._micro_batches(data.batch, True, 1, 120)
    assert sorted(row for part in parts for row in part) == list(range(10))
    for rows in groups:  # every group packs to <= 120 tokens here: one micro-batch each
        assert sum(set(rows) <= set(part) for part in parts) == 1, (rows, parts)
    unshared = DataParallelPPOActor(actor_config(ppo_max_token_len_per_gpu=120), sdpa_model)
    unshared.share_prompts = False
    assert len(parts) < len(unshared._micro_batches(data.batch, True, 1, 120))


def test_fixed_size_micro_batches_take_a_groups_rows_one_after_another(sdpa_model):
    actor = DataParallelPPOActor(actor_config(use_dynamic_bsz=False), sdpa_model)
    data = update_data(0, sdpa_model.config.vocab_size)
    groups = prompt_groups(data.batch["input_ids"], data.batch["attention_mask"], R)
    parts = actor._micro_batches(data.batch, False, 3, 0)
    assert [row for part in parts for row in part] == [row for rows in groups for row in rows]
    assert [len(part) for part in parts] == [3, 3, 3, 1]
    unshared, _ = DataParallelPPOActor(
        actor_config(use_dynamic_bsz=False, share_prompts=False), sdpa_model
    ).compute_log_prob(data)
    shared, _ = actor.compute_log_prob(data)
    torch.testing.assert_close(shared, unshared, rtol=0, atol=1e-5)
    assert actor.shared_prompt_tokens > 0


def test_actor_log_probs_and_update_equal_without_sharing(tiny_model_path):
    results = {}
    for share in (False, True):
        torch.manual_seed(0)
        model = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
        before = copy.deepcopy(model.state_dict())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        actor = DataParallelPPOActor(actor_config(share_prompts=share), model, optimizer)
        assert actor.share_prompts is share
        data = update_data(1, model.config.vocab_size)
        log_probs, _ = actor.compute_log_prob(data)
        metrics = actor.update_policy(data)
        results[share] = (log_probs, metrics, model.state_dict())
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=1e-5)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert results[True][1][key] == pytest.approx(results[False][1][key], rel=1e-4, abs=1e-7), key
    # 3 contiguous mini-batches of 4, 3, 3 rows: a group shares its prompt within each mini-batch it has rows in
    batch = data.batch
    expected = 0
    for rows in split_rows_evenly(len(batch), 3):
        part = batch[torch.tensor(rows)]
        for group in prompt_groups(part["input_ids"], part["attention_mask"], R):
            expected += (len(group) - 1) * int(part["attention_mask"][group[0], :-R].sum())
    assert 0 < expected < 2 * 40 + 3 * 57 + 1 * 9
    assert results[True][1]["actor/shared_prompt_tokens"] == expected
    assert results[False][1]["actor/shared_prompt_tokens"] == 0
    changed = [k for k, v in results[True][2].items() if not torch.equal(v, before[k])]
    assert changed
    for key, value in results[True][2].items():
        torch.testing.assert_close(value, results[False][2][key], rtol=1e-4, atol=1e-6, msg=key)


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_flex_shared_prompt_gradients_equal_unshared(tiny_model_path):
    batch = [t.cuda() for t in random_shared_batch(5)]
    weights = torch.linspace(-1, 1, R, device="cuda")
    model = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="flex_attention").cuda().train()
    grads = {}
    for share in (False, True):
        model.zero_grad()
        log_probs, _ = forward_response_log_probs(
            model, *batch, R, use_remove_padding=True, use_fused_kernels=True, share_prompts=share
        )
        (log_probs * weights).sum().backward()
        grads[share] = (log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(grads[True][0], grads[False][0], rtol=0, atol=1e-5)
    for name, grad in grads[False][1].items():
        torch.testing.assert_close(grads[True][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------- the whole step
def test_memory_agent_step_is_the_same_with_and_without_sharing(tiny_model_path, tmp_path):
    """The MemAgent training step (``benchmarks/bench_train_step.py``: hf rollout, 2 questions x 4, 2 chunks, packed
    rows, 2 mini-batches) with shared prompts and without: the same rollouts (seeded), the same losses, gradient
    norms and KL (an entropy bonus makes the gradient non-zero on the random tiny model, whose rewards are 0); the
    shared run reports the repeated first-turn prompts it skipped."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_train_step import main

    steps = {}
    for share in (True, False):
        out = tmp_path / f"share_{share}.json"
        argv = ["--model", str(tiny_model_path), "--steps", "1", "--batch", "2", "--n", "4", "--chunks", "2"]
        overrides = [
            "actor_rollout_ref.model.use_remove_padding=True",
            f"actor_rollout_ref.model.share_prompts={share}",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
        ]
        assert main([*argv, "--out", str(out), "--", *overrides]) == 0
        log = tmp_path / f"share_{share}.steps" / "sync" / "metrics.jsonl"
        steps[share] = [json.loads(line) for line in log.read_text().splitlines()][-1]
    shared, unshared = steps[True], steps[False]
    assert shared["response_length/mean"] == unshared["response_length/mean"]  # the same rollouts
    assert shared["actor/shared_prompt_tokens"] > 0 and unshared["actor/shared_prompt_tokens"] == 0
    assert shared["actor/grad_norm"] > 0
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy", "actor/kl_loss"):
        assert shared[key] == pytest.approx(unshared[key], rel=1e-4, abs=1e-7), key

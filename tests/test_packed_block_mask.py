"""The BlockMask of packed rows built with tensor ops (``verl/workers/actor/packed_block_mask.py``).

What is checked (CPU, float32):
* ``packed_block_mask`` equals torch's ``create_block_mask`` over transformers' own mask function for packed
  position_ids (``find_packed_sequence_indices`` + ``causal_mask_function``): every index/count field (partial
  and full, kv and q), ``to_dense()``, the sequence lengths, and the element mask of its ``mask_mod``; over
  hand-picked layouts (one block, many blocks, documents crossing block boundaries, documents of length 1,
  block-aligned documents, a length that is not a multiple of the block size, the trailing padding document of
  ``pack_rows``), random layouts with small block sizes (many blocks), two rows at once and one-token blocks;
  built without ``torch.compile`` and without an op that synchronises a CUDA device (counted on CPU);
* ``packed_attention_mask`` gives a mask only to flex_attention models without sliding-window layers;
* the tiny Qwen2 model under flex_attention with our mask (packed, unfused and fused head, with a host plan)
  equals the padded sdpa forward to 1e-5, and transformers' ``create_block_mask`` is never called (patched to
  raise; the same patch makes a packed flex forward without our mask fail, so it sits on transformers' path);
  flex_attention is the only graph compiled; the critic's packed values likewise;
* FSDP2 (one gloo rank, forward inputs cast by the mixed-precision policy) passes the mask through (10-15 s);
* GPU (``@pytest.mark.gpu``): gradients with gradient checkpointing equal the padded sdpa ones (flex_attention
  has no backward on CPU).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
)

from tests.packed_batches import RESPONSE_LENGTH, padded_batch
from tests.rank_processes import spawn
from verl.utils.model_loading import load_causal_lm
from verl.workers.actor.forward import forward_response_log_probs, host_plan, pack_rows
from verl.workers.actor.packed_block_mask import (
    document_ids,
    document_starts,
    packed_attention_mask,
    packed_block_mask,
)

FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _positions(*rows: list[int]) -> torch.Tensor:
    """``[len(rows), T]`` position_ids restarting at 0 for every document length of each row."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


def _reference(position_ids: torch.Tensor, block_size: int):
    """What transformers builds for packed position_ids under flex_attention, without its compile."""
    docs = find_packed_sequence_indices(position_ids)
    mask_mod = causal_mask_function
    if docs is not None:
        mask_mod = and_masks(causal_mask_function, packed_sequence_mask_function(docs))
    batch, length = position_ids.shape
    return create_block_mask(mask_mod, batch, None, length, length, device="cpu", BLOCK_SIZE=block_size), mask_mod


def _assert_same_block_mask(position_ids: torch.Tensor, block_size: int = 128) -> None:
    ours = packed_block_mask(position_ids, block_size)
    ref, ref_mask_mod = _reference(position_ids, block_size)
    for name in FIELDS:
        mine, theirs = getattr(ours, name), getattr(ref, name)
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), (name, mine, theirs)
    assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    assert torch.equal(ours.to_dense(), ref.to_dense())
    batch, length = position_ids.shape
    elements = create_mask(ours.mask_mod, batch, 1, length, length, device="cpu")
    assert torch.equal(elements, create_mask(ref_mask_mod, batch, 1, length, length, device="cpu"))


def test_document_ids():
    assert document_ids(torch.tensor([[0, 1, 0, 1, 2, 0, 0, 1]])).tolist() == [[0, 0, 1, 1, 1, 2, 3, 3]]
    # every row starts a document, also where its positions do not start at 0 (varlen_attention's boundaries)
    starts = document_starts(torch.tensor([[0, 1, 2, 3], [4, 5, 0, 1]]))
    assert starts.tolist() == [[True, False, False, False], [True, False, True, False]]
    assert document_ids(torch.tensor([[4, 5, 0, 1]])).tolist() == [[0, 0, 1, 1]]


LAYOUTS = {
    "one block, one document": [128],
    "one block, three documents": [100, 1, 27],
    "documents crossing block boundaries": [37, 90, 5, 124, 128, 256, 3, 125],
    "documents of length 1": [1, 1, 1, 1, 300, 1, 1, 75, 1, 1, 1, 128],
    "block-aligned documents": [128, 256, 128, 512],
    "one document over many blocks": [1024],
    "length not a multiple of the block size": [100, 57],
    "one document, the last block cut short": [300],
    "a document over whole blocks, the last block cut short": [20, 400, 3],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_equals_create_block_mask(name):
    _assert_same_block_mask(_positions(LAYOUTS[name]))


def test_equals_create_block_mask_with_pack_rows_padding():
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 1000, (3, 200), generator=gen)
    attention_mask = torch.zeros(3, 200, dtype=torch.long)
    for row, (start, end) in enumerate([(150, 190), (10, 200), (60, 110)]):
        attention_mask[row, start:end] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    packed = pack_rows(input_ids, attention_mask, position_ids, response_length=20, length_multiple=128)
    # 40 + 190 + 50 = 280 valid tokens + 104 padding tokens: a fourth document inside the last of 3 blocks
    assert packed.num_padding == 104 and packed.position_ids.shape == (1, 384)
    assert document_ids(packed.position_ids)[0, -1] == 3
    _assert_same_block_mask(packed.position_ids)


@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_equals_create_block_mask_on_random_layouts(block_size):
    gen = torch.Generator().manual_seed(block_size)
    for _ in range(6):
        blocks, cut = (int(torch.randint(1, high, (1,), generator=gen)) for high in (40, block_size))
        length = block_size * blocks - cut * (blocks % 2)  # whole blocks, or a last block cut short
        rows = []
        for _ in range(2):  # two rows of the same length, different documents
            lengths, left = [], length
            while left:
                # mostly short documents, some of one token, some over several blocks
                kind = int(torch.randint(0, 3, (1,), generator=gen))
                upper = (2, block_size, 4 * block_size)[kind]
                lengths.append(min(left, int(torch.randint(1, upper + 1, (1,), generator=gen))))
                left -= lengths[-1]
            rows.append(lengths)
        _assert_same_block_mask(_positions(rows[0]), block_size)
        _assert_same_block_mask(_positions(*rows), block_size)


def test_equals_create_block_mask_with_one_token_blocks():
    _assert_same_block_mask(_positions([3, 1, 4, 1, 5]), block_size=1)


def test_builds_by_hand_without_compiling(monkeypatch):
    import torch._dynamo

    def no_compile(*args, **kwargs):
        raise AssertionError("torch.compile called")

    monkeypatch.setattr(torch, "compile", no_compile)
    monkeypatch.setattr(torch._dynamo, "optimize", no_compile)
    # 64 + 448 tokens, 4 blocks: block 0 holds both documents, blocks 1-3 the second one only
    mask = packed_block_mask(_positions([64, 448]))
    # per query block: the first block (it shares document 1) and the diagonal are partial, the ones between full
    assert mask.kv_num_blocks.tolist() == [[[1, 2, 2, 2]]] and mask.full_kv_num_blocks.tolist() == [[[0, 0, 1, 2]]]
    assert mask.kv_indices[0, 0, 3, :2].tolist() == [0, 3] and mask.full_kv_indices[0, 0, 3, :2].tolist() == [1, 2]


def test_builds_without_host_synchronisation():
    from tests.test_update_host_syncs import SyncCounter

    position_ids = _positions([64, 448, 1, 100])
    with SyncCounter() as counter:
        packed_block_mask(position_ids)
    assert sum(counter.by_origin.values()) == 0, counter.sites
    with SyncCounter() as counter:  # the counter sees such ops
        torch.repeat_interleave(torch.tensor([2, 3]))
    assert sum(counter.by_origin.values()) == 1


# ---------------------------------------------------------------------------------------------- on the model
def test_packed_attention_mask_only_for_flex_without_sliding_windows(sdpa_model, flex_model):
    from transformers import MistralConfig, Qwen2Config

    position_ids = _positions([100, 156])
    assert packed_attention_mask(sdpa_model, position_ids) is None
    assert packed_attention_mask(flex_model, position_ids).shape == (1, 1, 256, 256)

    class Model(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config

    sliding = Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=1, num_hidden_layers=2)
    sliding._attn_implementation = "flex_attention"
    assert "sliding_attention" in sliding.layer_types
    assert packed_attention_mask(Model(sliding), position_ids) is None
    window = MistralConfig(sliding_window=64, num_hidden_layers=2)  # every layer slides, no layer_types
    window._attn_implementation = "flex_attention"
    assert packed_attention_mask(Model(window), position_ids) is None
    hybrid = SimpleNamespace(_attn_implementation="flex_attention", layer_types=["full_attention", "linear_attention"])
    assert packed_attention_mask(Model(hybrid), position_ids) is None  # e.g. linear-attention layers in between
    for config in (Qwen2Config(num_hidden_layers=2), MistralConfig(sliding_window=None, num_hidden_layers=2)):
        config._attn_implementation = "flex_attention"
        assert packed_attention_mask(Model(config), position_ids) is not None


def _forbid_create_block_mask(monkeypatch) -> None:
    """transformers' mask builders raise instead of compiling ``create_block_mask``."""
    import transformers.integrations.flex_attention as hf_flex
    import transformers.masking_utils as masking_utils

    def forbidden(*args, **kwargs):
        raise AssertionError("create_block_mask called")

    monkeypatch.setattr(masking_utils, "create_block_mask", forbidden)
    monkeypatch.setattr(hf_flex, "create_block_mask", forbidden)


@torch.no_grad()
def test_flex_forward_with_our_mask_equals_padded_sdpa_without_create_block_mask(flex_model, sdpa_model, monkeypatch):
    from torch._dynamo.utils import counters

    _forbid_create_block_mask(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    # the patched function is the one transformers' packed flex path calls: without our mask it raises
    batch = padded_batch([33, 1, 66, 100], seed=0)
    packed = pack_rows(*batch, RESPONSE_LENGTH, length_multiple=128)
    with pytest.raises(AssertionError, match="create_block_mask called"):
        flex_model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
    for seed, lengths in enumerate([[33, 1, 66, 100], [300, 2, 129, 90, 17]]):
        batch = padded_batch(lengths, seed)
        reference, _ = forward_response_log_probs(sdpa_model, *batch, RESPONSE_LENGTH)
        for fused in (False, True):
            log_probs, _ = forward_response_log_probs(
                flex_model, *batch, RESPONSE_LENGTH, use_remove_padding=True, use_fused_kernels=fused
            )
            torch.testing.assert_close(log_probs, reference, rtol=0, atol=1e-5)
        plan = host_plan(*batch, RESPONSE_LENGTH, True, True, 128, torch.device("cpu"))
        log_probs, _ = forward_response_log_probs(
            flex_model, *batch, RESPONSE_LENGTH, use_remove_padding=True, use_fused_kernels=True, plan=plan
        )
        torch.testing.assert_close(log_probs, reference, rtol=0, atol=1e-5)
    assert (reference != 0).sum() > 20
    # flex_attention alone (static, then dynamic shapes); no create_block_mask graph
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


@torch.no_grad()
def test_critic_packed_flex_values_equal_padded_sdpa_without_create_block_mask(tiny_model_path, monkeypatch):
    from verl.workers.critic.critic_worker import load_value_model
    from verl.workers.critic.dp_critic import forward_response_values

    _forbid_create_block_mask(monkeypatch)
    models = {}
    for attn in ("sdpa", "flex_attention"):
        torch.manual_seed(0)  # same value head
        models[attn] = load_value_model(tiny_model_path, dtype="float32", attn_implementation=attn).eval()
    batch = padded_batch([40, 3, 90], seed=3)
    reference = forward_response_values(models["sdpa"], *batch, RESPONSE_LENGTH)
    values = forward_response_values(models["flex_attention"], *batch, RESPONSE_LENGTH, use_remove_padding=True)
    assert (reference != 0).sum() > 10
    torch.testing.assert_close(values, reference, rtol=0, atol=1e-5)


def _fsdp2_worker(rank: int, init_file: str, model_path: str, data_file: str, out_file: str) -> None:
    import torch.distributed as dist

    from verl.utils.fsdp_utils import apply_fsdp2, init_dp_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        import pytest as _pytest

        patch = _pytest.MonkeyPatch()
        _forbid_create_block_mask(patch)
        model = load_causal_lm(model_path, dtype="float32", attn_implementation="flex_attention").eval()
        # param_dtype set: FSDP2 casts the floating-point forward inputs (the BlockMask passes through as is)
        apply_fsdp2(model, mesh=init_dp_mesh("cpu"), param_dtype=torch.float32)
        batch = torch.load(data_file)
        with torch.no_grad():
            log_probs, _ = forward_response_log_probs(model, *batch, RESPONSE_LENGTH, use_remove_padding=True)
        torch.save(log_probs, out_file)
    finally:
        dist.destroy_process_group()


def test_fsdp2_packed_flex_forward_with_our_mask(sdpa_model, tiny_model_path, tmp_path):
    batch = padded_batch([70, 5, 120], seed=5)
    torch.save(batch, tmp_path / "batch.pt")
    args = (str(tmp_path / "init"), str(tiny_model_path), str(tmp_path / "batch.pt"), str(tmp_path / "out.pt"))
    spawn(_fsdp2_worker, args=args, nprocs=1, join=True)
    with torch.no_grad():
        reference, _ = forward_response_log_probs(sdpa_model, *batch, RESPONSE_LENGTH)
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), reference, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------- GPU (the lead's)
@pytest.mark.gpu
def test_cuda_flex_gradient_checkpointing_gradients_equal_padded_sdpa(tiny_model_path, monkeypatch):
    """fp32 on CUDA, train mode with gradient checkpointing: packed flex with our mask (no create_block_mask)
    gives the padded sdpa log-probs and gradients (checkpointed layers recompute their forward with the same BlockMask)."""
    _forbid_create_block_mask(monkeypatch)
    batch = [t.cuda() for t in padded_batch([300, 2, 129, 90, 17], seed=7)]
    weights = torch.linspace(-1, 1, RESPONSE_LENGTH, device="cuda")
    results = {}
    for attn, packed in (("sdpa", False), ("flex_attention", True)):
        model = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation=attn).cuda().train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        log_probs, _ = forward_response_log_probs(model, *batch, RESPONSE_LENGTH, use_remove_padding=packed)
        (log_probs * weights).sum().backward()
        results[attn] = (log_probs.detach(), {n: p.grad for n, p in model.named_parameters()})
    # a wrong mask moves log-probs by O(0.1) and gradients by O(their scale); kernels differ by ~1e-6
    torch.testing.assert_close(results["flex_attention"][0], results["sdpa"][0], rtol=0, atol=1e-4)
    for name, grad in results["sdpa"][1].items():
        assert (results["flex_attention"][1][name] - grad).abs().max() <= 1e-3 * grad.abs().max() + 1e-6, name

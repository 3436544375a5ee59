"""The weight sync's producer, ``verl/utils/rollout_weights.py::iter_rollout_weights``.

* tied weights (the tiny Qwen2 ties ``lm_head`` to ``embed_tokens``) are gathered once and handed over under both
  names as the same tensor; ``rollout_weight_bytes`` counts exactly the bytes gathered;
* the tensors come in the engine's dtype, equal to the model's values cast to it;
* under FSDP2 on 2 gloo ranks every rank gets the full tensors of one process, and each sharded parameter is
  cast **before** its all-gather (the gathered DTensor is already bf16: half the bytes of the fp32 masters);
* an HF rollout engine loaded from it generates exactly what the actor generates.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.rank_processes import spawn
from verl.utils.model_loading import load_causal_lm
from verl.utils.rollout_weights import iter_rollout_weights, rollout_weight_bytes


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")


def _flatten(buckets):
    return [pair for bucket in buckets for pair in bucket]


def test_tied_weights_once_in_the_engine_dtype(model):
    state = model.state_dict()
    assert (
        "lm_head.weight" in state
        and state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    )
    pairs = _flatten(iter_rollout_weights(model, dtype=torch.bfloat16, bucket_bytes=1 << 16))
    names = [n for n, _ in pairs]
    assert names == list(state)
    tensors = dict(pairs)
    assert tensors["lm_head.weight"] is tensors["model.embed_tokens.weight"]  # one gather, two names
    for name, tensor in pairs:
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, state[name].to(torch.bfloat16), atol=0, rtol=0)
    unique = {id(t): t for _, t in pairs}.values()
    assert sum(t.numel() * t.element_size() for t in unique) == rollout_weight_bytes(model, torch.bfloat16)
    fp32_bytes = rollout_weight_bytes(model)
    assert rollout_weight_bytes(model, torch.bfloat16) * 2 == fp32_bytes


def test_only_floating_point_tensors_take_the_engine_dtype():
    """An integer buffer in the state dict (a step counter, an index table) is sent as it is, not cast."""
    module = torch.nn.Linear(2, 2)
    module.register_buffer("table", torch.arange(3, dtype=torch.long))
    tensors = dict(_flatten(iter_rollout_weights(module, dtype=torch.bfloat16)))
    assert tensors["weight"].dtype == torch.bfloat16 and tensors["table"].dtype == torch.long
    assert tensors["table"].tolist() == [0, 1, 2]


def test_buckets_respect_the_size_and_keep_order(model):
    buckets = list(iter_rollout_weights(model, bucket_bytes=1 << 14))
    assert len(buckets) > 1
    for bucket in buckets[:-1]:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size >= 1 << 14 and size - bucket[-1][1].numel() * bucket[-1][1].element_size() < 1 << 14
    order = [n for n, _ in _flatten(buckets)]
    assert order == list(model.state_dict())
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        next(iter_rollout_weights(model, bucket_bytes=0))


def test_hf_engine_loaded_from_it_generates_what_the_actor_does(model, tiny_model_path):
    from verl.workers.rollout.base import SamplingParams, get_rollout_engine

    trained = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
    # a seeded perturbation: with the global RNG the outcome depended on the tests run before (about 1 draw in 6,
    # e.g. seed 0, leaves the greedy continuation of this random model unchanged and failed `after != before`)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    engine = get_rollout_engine("hf", model=str(tiny_model_path), device="cpu", dtype="float32", max_batch_size=2)
    try:
        prompt = [5, 17, 42, 7]
        greedy = SamplingParams(greedy=True, max_tokens=6)
        before = engine.generate_batch([prompt], greedy)[0][0].token_ids
        for bucket in iter_rollout_weights(trained):
            engine.update_weights(bucket)
        after = engine.generate_batch([prompt], greedy)[0][0].token_ids
        with torch.no_grad():
            expected = trained.generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
    finally:
        engine.shutdown()
    assert after == expected[: len(after)] and after != before


def _fsdp_rank(rank: int, init_file: str, model_path: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from verl.utils.fsdp_utils import apply_fsdp2, init_dp_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        sharded = load_causal_lm(model_path, dtype="float32", attn_implementation="sdpa")
        apply_fsdp2(sharded, mesh=init_dp_mesh("cpu"))
        gathered_dtypes = []
        original = DTensor.full_tensor

        def recording_full_tensor(self, *args, **kwargs):
            gathered_dtypes.append(self.dtype)
            return original(self, *args, **kwargs)

        DTensor.full_tensor = recording_full_tensor
        try:
            pairs = _flatten(iter_rollout_weights(sharded, dtype=torch.bfloat16))
        finally:
            DTensor.full_tensor = original
        torch.save(
            {
                "pairs": pairs,
                "gathered_dtypes": gathered_dtypes,
                "bytes": rollout_weight_bytes(sharded, torch.bfloat16),
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_two_ranks_gather_full_bf16_tensors_cast_before_the_gather(model, tiny_model_path, tmp_path):
    spawn(_fsdp_rank, nprocs=2, join=True, args=(str(tmp_path / "init"), str(tiny_model_path), str(tmp_path)))
    expected = _flatten(iter_rollout_weights(model, dtype=torch.bfloat16))
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert [n for n, _ in result["pairs"]] == [n for n, _ in expected]
        for (name, got), (_, want) in zip(result["pairs"], expected):
            assert got.dtype == torch.bfloat16 and not hasattr(got, "placements"), name
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert result["gathered_dtypes"] and set(result["gathered_dtypes"]) == {torch.bfloat16}
        assert result["bytes"] == rollout_weight_bytes(model, torch.bfloat16)

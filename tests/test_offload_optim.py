"""The streamed, host-resident AdamW of ``fsdp_config.optimizer_offload`` (verl/utils/offload_optim.py).

* Numbers: N steps of ``OffloadedAdamW`` (state in several buckets) give bitwise the parameters and moments of
  ``torch.optim.AdamW`` on the same gradients, with weight decay, a warm-up + cosine LR schedule, gradient clipping
  and a parameter without a gradient in one step; with amsgrad too.
* Memory: the state is on the host between steps, in buffers of exactly 2 x 4 bytes x parameters that the steps
  write in place (never reallocated); at most two buckets are staged at once; pinned where CUDA exists.
* Checkpoints: save/resume through ``save_model_shards``/``load_model_shards`` (DCP) round-trips the state and the
  resumed run continues bitwise like the uninterrupted one; a checkpoint of a plain AdamW resumes into the offloaded
  one (the on-disk format is the same).
* The per-tensor offload this replaces: its pinned host bytes at the Qwen2.5-7B shape (the allocator's power-of-two
  rounding) against the state size.
* GPU (``@pytest.mark.gpu``): peak GPU memory at the step and host RSS for a Qwen2.5-0.5B shape with and without.
"""

from __future__ import annotations

import copy

import pytest
import torch

from verl.utils.fsdp_utils import build_lr_scheduler, build_optimizer, clip_grad_norm
from verl.utils.model_loading import load_causal_lm
from verl.utils.offload_optim import (
    OffloadedAdamW,
    pinned_bytes_of_per_tensor_offload,
    plan_buckets,
    streamed_peak_bytes,
)

STEPS = 5


def _model(path):
    torch.manual_seed(0)
    return load_causal_lm(path, dtype="float32", attn_implementation="sdpa")


def _batches(model, count: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (2, 12), generator=gen) for _ in range(count)]


def _train(model, optimizer, scheduler, batches, skip_grad: str = "") -> list[float]:
    norms = []
    for i, ids in enumerate(batches):
        model(input_ids=ids, labels=ids).loss.backward()
        if i == 1 and skip_grad:  # a parameter without a gradient in one step: AdamW leaves it (and its state) alone
            dict(model.named_parameters())[skip_grad].grad = None
        norms.append(clip_grad_norm(model.parameters(), 0.5))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return norms


def _states_equal(a: torch.optim.Optimizer, pa, b: torch.optim.Optimizer, pb) -> None:
    for x, y in zip(pa, pb):
        sa, sb = a.state[x], b.state[y]
        assert set(sa) == set(sb)
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_streamed_steps_equal_plain_adamw_bitwise(tiny_model_path, amsgrad) -> None:
    plain, offloaded = _model(tiny_model_path), _model(tiny_model_path)
    kw = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, amsgrad=amsgrad)
    ref_opt = torch.optim.AdamW(plain.parameters(), **kw)
    opt = OffloadedAdamW(offloaded.parameters(), bucket_bytes=64 << 10, **kw)
    assert len(opt._buckets) >= 4  # several buckets: the streaming is exercised

    def schedule(o):  # warm-up then cosine: the lr changes every step
        return build_lr_scheduler(o, STEPS, lr_warmup_steps=2, warmup_style="cosine", min_lr_ratio=0.1)

    batches = _batches(plain, STEPS)
    skip = "model.layers.0.mlp.up_proj.weight"
    norms_ref = _train(plain, ref_opt, schedule(ref_opt), batches, skip)
    norms = _train(offloaded, opt, schedule(opt), batches, skip)
    assert norms == norms_ref and norms_ref[0] > 0.5  # clipping was active
    initial = _model(tiny_model_path).state_dict()
    changed = 0
    for (name, a), b in zip(plain.named_parameters(), offloaded.parameters()):
        assert torch.equal(a, b), name
        changed += not torch.equal(a, initial[name])
    assert changed == len(list(plain.parameters()))  # every parameter moved: the comparison is not vacuous
    _states_equal(ref_opt, list(plain.parameters()), opt, list(offloaded.parameters()))
    skipped = dict(offloaded.named_parameters())[skip]
    assert float(opt.state[skipped]["step"]) == STEPS - 1  # the step without a gradient did not count
    assert float(opt.state[next(offloaded.parameters())]["step"]) == STEPS


def test_state_stays_on_host_in_place_and_at_most_two_buckets_are_staged(tiny_model_path, monkeypatch) -> None:
    import verl.utils.offload_optim as oo

    model = _model(tiny_model_path)
    opt = build_optimizer(model, lr=1e-3, offload=True)
    assert isinstance(opt, OffloadedAdamW)
    opt.bucket_bytes = 64 << 10
    opt._buckets.clear(), opt._offset.clear(), opt._flat.clear()
    opt._layout()
    opt._install_host_state()
    n = sum(p.numel() for p in model.parameters())
    assert opt.host_state_bytes() == 2 * 4 * n  # exactly the two fp32 moments, nothing rounded up
    ptrs = {k: t.data_ptr() for k, t in opt._flat.items()}

    staged, peak = [0], [0]
    fetch, store = oo._Stager.fetch, oo._Stager.store

    def counting_fetch(self, host):
        staged[0] += 1
        peak[0] = max(peak[0], staged[0])
        return fetch(self, host)

    def counting_store(self, host, tensors):
        staged[0] -= 1
        return store(self, host, tensors)

    monkeypatch.setattr(oo._Stager, "fetch", counting_fetch)
    monkeypatch.setattr(oo._Stager, "store", counting_store)
    for ids in _batches(model, 2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for p in model.parameters():
            state = opt.state[p]
            assert state["step"].device.type == "cpu" and float(state["step"]) > 0
            for key in ("exp_avg", "exp_avg_sq"):
                flat = opt._flat[(key, torch.float32)]
                assert state[key].device.type == "cpu"
                # a view of the flat host buffer: written in place by the step, never reallocated
                assert state[key].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert any(opt.state[p]["exp_avg"].abs().sum() > 0 for p in model.parameters())
    assert {k: t.data_ptr() for k, t in opt._flat.items()} == ptrs
    assert staged[0] == 0 and peak[0] == 2 and len(opt._buckets) > 2  # one computing, one arriving
    assert opt.is_pinned() == torch.cuda.is_available()


def test_checkpoint_round_trip_and_resume_continue_bitwise(tiny_model_path, tmp_path) -> None:
    from verl.utils.checkpoint.model_state import load_model_shards, save_model_shards

    batches = _batches(_model(tiny_model_path), 4, seed=3)

    def build(offload: bool):
        model = _model(tiny_model_path)
        opt = build_optimizer(model, lr=2e-3, weight_decay=0.05, offload=offload)
        return model, opt, build_lr_scheduler(opt, lr_warmup_steps=3)

    # uninterrupted: 4 steps
    model, opt, sched = build(True)
    _train(model, opt, sched, batches)
    # interrupted after 2 steps, then resumed into fresh objects
    for first_offload in (True, False):  # a plain AdamW checkpoint resumes into the offloaded optimizer too
        m1, o1, s1 = build(first_offload)
        _train(m1, o1, s1, batches[:2])
        ckpt = tmp_path / f"ckpt_{first_offload}"
        save_model_shards(ckpt, m1, o1, s1, save_rng=False)
        m2, o2, s2 = build(True)
        load_model_shards(ckpt, m2, o2, s2, load_rng=False)
        _states_equal(o1, list(m1.parameters()), o2, list(m2.parameters()))
        assert all(t.device.type == "cpu" for s in o2.state.values() for t in s.values())
        assert all(
            s["exp_avg"].untyped_storage().data_ptr() == o2._flat[("exp_avg", torch.float32)].data_ptr()
            for s in o2.state.values()
        )  # loaded into the host buffers, not beside them
        _train(m2, o2, s2, batches[2:])
        for a, b in zip(model.parameters(), m2.parameters()):
            assert torch.equal(a, b)
        _states_equal(opt, list(model.parameters()), o2, list(m2.parameters()))


def test_load_state_dict_refuses_a_state_it_has_no_buffer_for(tiny_model_path) -> None:
    model = _model(tiny_model_path)
    ams = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    ids = _batches(model, 1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    ams.step()
    with pytest.raises(KeyError, match="max_exp_avg_sq"):
        OffloadedAdamW(model.parameters(), lr=1e-3).load_state_dict(copy.deepcopy(ams.state_dict()))
    with pytest.raises(ValueError, match="bucket_bytes"):
        OffloadedAdamW(model.parameters(), bucket_bytes=0)


def test_per_tensor_pinned_offload_nearly_doubles_the_7b_adam_state() -> None:
    """Why the worker grew to 115 GB with the per-tensor ``to("cpu", non_blocking=True)`` offload: the Qwen2.5-7B
    tensors' fp32 moments rounded up to powers of two by torch's caching host allocator."""
    h, i, kv, v, layers = 3584, 18944, 512, 152064, 28
    layer = [h * h, h, kv * h, kv, kv * h, kv, h * h, i * h, i * h, h * i, h, h]  # q(+b) k(+b) v(+b) o mlp norms
    numels = [v * h, v * h, h] + layer * layers  # embed, lm_head (untied), final norm
    n = sum(numels)
    assert n == 7_615_616_512
    state = 8 * n
    pinned = pinned_bytes_of_per_tensor_offload(numels)
    assert state / 1e9 == pytest.approx(60.92, abs=0.01)
    assert pinned / 1e9 == pytest.approx(115.83, abs=0.01)  # 1.90 x the state: beyond a 128 GB host with the rest
    assert pinned_bytes_of_per_tensor_offload([3, 4]) == 2 * (16 + 16)


def test_bucket_plan_closes_before_overflow_and_the_streamed_peak_counts_three_buckets() -> None:
    # 10-byte buckets: [4, 4] (a third 4 would overflow), [4], [30] alone (larger than a bucket), [2, 3, 5], [6]
    sizes = [4, 4, 4, 30, 2, 3, 5, 6]
    assert plan_buckets(sizes, 10) == [(0, 2), (2, 3), (3, 4), (4, 7), (7, 8)]
    # bucket bytes 8, 4, 30, 10, 6: the worst window is 4 + 30 * 1.5 + 10 around the 30-byte bucket
    assert streamed_peak_bytes(sizes, 10) == 4 + 45 + 10
    assert plan_buckets([], 10) == [] and streamed_peak_bytes([], 10) == 0


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_peak_and_host_rss_for_a_half_billion_shape_with_and_without(tmp_path, monkeypatch) -> None:
    """Qwen2.5-0.5B shape, one GPU, FSDP2 over a 1-rank NCCL mesh as the worker runs it (DTensor shards, fp32 master
    weights, bf16 compute): plain AdamW's step holds params + grads + 2 moments + the foreach sqrt temporary on the
    GPU; the offloaded one params + grads + at most three buckets, with the moments in host memory (RSS grows by
    their size, not by a power-of-two rounding of it) as host DTensors over the flat buffers. Parameters after 3
    steps agree to 1e-7."""
    import gc

    import psutil
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import Qwen2Config

    from verl.utils.fsdp_utils import apply_fsdp2, get_full_state_dict, init_dp_mesh
    from verl.utils.model_loading import build_causal_lm_from_config
    from verl.utils.offload_optim import DEFAULT_BUCKET_BYTES, streamed_peak_bytes

    GiB = 2**30

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        mesh = init_dp_mesh("cuda")
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
        device = torch.device("cuda", 0)
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, 151936, (1, 256), generator=gen) for _ in range(3)]
        proc = psutil.Process()
        results = {}
        for offload in (False, True):
            model = build_causal_lm_from_config(config, dtype="float32", attn_implementation="sdpa", seed=0)
            model = apply_fsdp2(model.to(device), mesh=mesh)
            n = sum(p.numel() for p in model.parameters())
            gc.collect()
            rss0 = proc.memory_info().rss
            # fused=False: torch's default (foreach) AdamW, which the offloaded step mirrors; fused AdamW (the default
            # on CUDA) has no full-size temporary and rounds differently (tests/test_fused_adamw.py)
            opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, offload=offload, fused=False)
            peaks = []
            for ids in batches:
                model(input_ids=ids.to(device), labels=ids.to(device)).loss.backward()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()  # params + grads (activations freed)
                opt.step()
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() - base)
                opt.zero_grad(set_to_none=True)
            rss = proc.memory_info().rss - rss0
            if offload:
                assert opt.is_pinned()
                for p in model.parameters():
                    value = opt.state[p]["exp_avg"]
                    assert isinstance(value, DTensor) and value.to_local().device.type == "cpu"
                    flat = opt._flat[("exp_avg", torch.float32)]
                    assert value.to_local().untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            sizes = [8 * p.to_local().numel() for p in model.parameters()]
            results[offload] = dict(
                n=n, step_extra=max(peaks), resident=torch.cuda.memory_allocated(), rss=rss, sizes=sizes
            )
            results[offload]["params"] = get_full_state_dict(model)
            print(f"offload={offload}: step extra {max(peaks) / 2**30:.2f} GiB, host RSS +{rss / 2**30:.2f} GiB")
            del model, opt
            gc.collect()
            torch.cuda.empty_cache()
        n = results[True]["n"]
        # plain: the moments (8 N) stay on the GPU and the foreach step adds ~4 N; offloaded: three buckets and the
        # sqrt temporary of one (the largest bucket is the tied embedding's: 151936 x 896 x 8 bytes = 1.09 GB)
        streamed = streamed_peak_bytes(results[True]["sizes"], DEFAULT_BUCKET_BYTES)
        assert streamed < 2 * GiB < 8 * n
        assert results[False]["step_extra"] >= 3.5 * n
        assert results[True]["step_extra"] <= 1.05 * streamed + (32 << 20)
        assert results[False]["resident"] - results[True]["resident"] >= 0.99 * 8 * n
        assert 0.95 * 8 * n <= results[True]["rss"] <= 1.1 * 8 * n  # the moments once, not power-of-two rounded
        for name, value in results[False]["params"].items():
            assert (results[True]["params"][name] - value).abs().max() <= 1e-7, name
    finally:
        dist.destroy_process_group()

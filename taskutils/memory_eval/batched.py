"""Batched, resumable evaluation on an in-process rollout engine (no HTTP, no server).

The HTTP agents (:mod:`taskutils.memory_eval.agents`) send one request per turn per item; with a
small model and long documents the per-request work (HTTP, JSON, chat templating under one GIL)
can outweigh the generation (an H200 run measured 1.4-6 s per memory turn through the HTTP endpoint
with ~1,500 items in flight). Here every unfinished item is in flight at once on the engine's own
event loop, so the engine batches their requests, with the same memory loop
(:class:`recurrent.memory_loop.MemoryLoop`, built by :func:`~taskutils.memory_eval.agents.memory_loop`),
chunking (:func:`~taskutils.memory_eval.agents.memory_chunks`), chat template
(:func:`recurrent.chat_template.load_chat_template`, as ``serve.inproc_server``), sampling and
scoring (:func:`~taskutils.memory_eval.scoring.score_response`), and the same record and meta files
(:mod:`~taskutils.memory_eval.results`), so summaries and reports read them unchanged.

Schedule: by default each item sends its next request as soon as its previous one returns
(``schedule="items"``). A 512-chunk document is 513 requests in a row, so its time is the sum of its
own memory updates; in lockstep (``schedule="turns"``) every turn would last as long as the longest
update of the turn (up to ``max_memory_tokens`` decode steps) and short items would wait for it.

Resume: finished items are skipped (their records exist); the memory of unfinished memory-agent
items is saved to ``{label}.state.json`` beside the records every ``save_every_s`` seconds, at the
end, on a failure and when the ``deadline`` passes, so a run stopped by a time limit continues
mid-document next time.

    cells = [BatchCell(info, items, out_dir) ...]
    run_batched(cells, engine, tokenizer, AgentConfig(chunk_tokens=512, ...), deadline=time.time() + 500)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recurrent.async_utils import turn_end_token_ids
from recurrent.chat_template import load_chat_template, tokenize_conversation
from recurrent.memory_loop import MemoryLoop
from recurrent.prompts import render_template
from taskutils.memory_eval.agents import (
    DIRECT_TEMPLATE_ANSWER_IS,
    DIRECT_TEMPLATE_BOXED,
    MEMORY_METHODS,
    AgentConfig,
    memory_chunks,
    memory_loop,
)
from taskutils.memory_eval.chunking import HFTokenizer, middle_truncate
from taskutils.memory_eval.data import EvalItem
from taskutils.memory_eval.results import ResultStore, result_paths, write_meta
from taskutils.memory_eval.runner import CellInfo, item_record
from taskutils.memory_eval.scoring import score_response

__all__ = ["BatchCell", "run_batched"]

logger = logging.getLogger(__name__)

DIRECT_METHODS = {"openai": DIRECT_TEMPLATE_ANSWER_IS, "boxed": DIRECT_TEMPLATE_BOXED}


@dataclass
class BatchCell:
    """One (task, length, label) cell: its items and where its records go (``out_dir`` = harness --out)."""

    info: CellInfo
    items: Sequence[EvalItem]
    out_dir: str | Path

    def paths(self) -> tuple[Path, Path, Path]:
        results, meta = result_paths(self.out_dir, self.info.task, self.info.length, self.info.label)
        return results, meta, results.with_suffix(".state.json")


@dataclass
class _Job:
    """One unfinished item: its cell and its memory loop (memory agent) or its single prompt (direct)."""

    cell: int
    item: EvalItem
    loop: MemoryLoop | None = None  # the memory agent's loop (chunks, memory, position); None: direct
    started: float = field(default_factory=time.perf_counter)
    requests: int = 0
    truncated_from: int | None = None
    prompt: str | None = None  # the direct baseline's single prompt
    final_prompt: str | None = None  # the memory agent's final-turn user message, as sent (recorded)
    requests_before: int = 0  # requests made by earlier runs (resumed state)
    done: bool = False  # finished or failed (its record is written)


def _params(config: AgentConfig, max_tokens: int):
    from verl.workers.rollout.base import SamplingParams

    return SamplingParams(n=1, temperature=config.temperature, top_p=config.top_p, max_tokens=max_tokens)


def _save_state(path: Path, jobs: list[_Job]) -> None:
    state = {
        str(j.item.id): {"next_chunk": j.loop.chunks_read, "memory": j.loop.memory, "requests": j.requests}
        for j in jobs
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


SCHEDULES = ("items", "turns")


def run_batched(
    cells: Sequence[BatchCell],
    engine: Any,
    tokenizer: Any,
    config: AgentConfig,
    *,
    chat_template: str | None = None,
    schedule: str = "items",
    save_every_s: float = 30.0,
    deadline: float | None = None,
    stop: threading.Event | None = None,
    force: bool = False,
    workers: int | None = None,
    log_every_s: float = 30.0,
) -> dict[str, float]:
    """Run every unfinished item of ``cells`` on ``engine``, all items in flight at once; return counts.

    Args:
        engine: a :class:`~verl.workers.rollout.base.RolloutEngine` (vLLM in-process or HF).
        tokenizer: the model's Hugging Face (fast) tokenizer.
        config: chunk size, token budgets and sampling (as for the HTTP agents).
        schedule: ``"items"`` (default): each item sends its next request as soon as its previous one
            returns, so the engine never waits for the slowest memory update of a turn; ``"turns"``:
            lockstep, every item's turn k before any item's turn k + 1 (the same results; kept to
            measure the difference, see ``benchmarks/bench_eval_schedule.py``).
        save_every_s: seconds between saves of the unfinished items' memory (also saved at the end,
            on a failure and at the deadline).
        deadline: ``time.time()`` after which no new request starts; the run saves its state and
            returns (``stopped=1``).
        stop: once set (e.g. by a signal handler), the same as a passed deadline.
        force: redo every item (records and saved state are discarded).
        workers: threads that tokenize (documents at the start, prompts of every request); default: all cores.
        log_every_s: seconds between progress lines.

    Returns:
        Counts: ``finished``, ``failed`` (items whose request the engine rejected, recorded with
        ``status="error"``), ``resumed``, ``remaining``, ``requests``, ``turns`` (the most requests one
        item made in this run), ``stopped``; seconds: ``prepare_s`` (chunking the documents),
        ``generate_s`` (wall time from the first request to the last) and ``tokenize_s`` (thread
        seconds spent tokenizing prompts, overlapping ``generate_s``).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: expected one of {SCHEDULES}")
    template = load_chat_template(tokenizer, chat_template)
    spanner = HFTokenizer(tokenizer)
    stores: list[ResultStore] = []
    todo: list[tuple[int, EvalItem, dict | None]] = []
    counts: dict[str, float] = {"finished": 0, "failed": 0, "resumed": 0, "remaining": 0, "requests": 0,
                                "turns": 0, "stopped": 0}  # fmt: skip
    for k, cell in enumerate(cells):
        if cell.info.method not in MEMORY_METHODS and cell.info.method not in DIRECT_METHODS:
            raise ValueError(f"cell {cell.info.task}_{cell.info.length}: unknown method {cell.info.method!r}")
        results_path, meta_path, state_path = cell.paths()
        write_meta(meta_path, {**cell.info.__dict__, "n_items": len(cell.items), "n_invalid": 0,
                               "started_at": time.time(), "runner": "batched"})  # fmt: skip
        store = ResultStore(results_path)
        done = store.open(force=force)
        stores.append(store)
        saved = {} if force or not state_path.exists() else json.loads(state_path.read_text(encoding="utf-8"))
        todo.extend((k, item, saved.get(str(item.id))) for item in cell.items if item.id not in done)

    def prepare(task: tuple[int, EvalItem, dict | None]) -> _Job:
        """An unfinished item's job: its chunks (memory agent) or its truncated prompt (direct)."""
        k, item, state = task
        job = _Job(k, item)
        method = cells[k].info.method
        if method in MEMORY_METHODS:
            chunks, job.truncated_from = memory_chunks(item.get_context(), config, spanner)
            state = state or {}
            job.loop = memory_loop(item.question, list(chunks), config, MEMORY_METHODS[method],
                                   state.get("memory"), state.get("next_chunk", 0))  # fmt: skip
            job.requests = state.get("requests", 0)
        else:
            context = item.get_context().strip()
            document, before, after = middle_truncate(context, config.max_input_tokens, spanner)
            job.truncated_from = before if after < before else None
            job.prompt = render_template(DIRECT_METHODS[cells[k].info.method], prompt=item.question, chunk=document)
        job.requests_before = job.requests
        return job

    # Tokenizing is the host's work (chunking whole documents, then every request's prompt); the Rust
    # tokenizer releases the GIL, so a thread pool spreads it over the cores.
    n_workers = max(1, workers or os.cpu_count() or 1)
    pool = ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="eval-tok")
    t_prepare = time.perf_counter()
    try:
        jobs: list[_Job] = list(pool.map(prepare, todo))
    except BaseException:  # saved states stay as they were (nothing ran)
        pool.shutdown(wait=False, cancel_futures=True)
        for store in stores:
            store.close()
        raise
    counts["resumed"] = sum(1 for k, _, state in todo if state and cells[k].info.method in MEMORY_METHODS)
    counts["prepare_s"] = round(time.perf_counter() - t_prepare, 3)
    logger.info("batched eval: %d unfinished items of %d cells prepared in %.1f s (%d threads), schedule=%s",
                len(jobs), len(cells), counts["prepare_s"], n_workers, schedule)  # fmt: skip

    def ids_of(message: str) -> tuple[list[int], float]:
        started = time.perf_counter()
        ids = tokenize_conversation(tokenizer, template, [{"role": "user", "content": message}], True, None).ids
        return ids, time.perf_counter() - started

    turn_ends = turn_end_token_ids(tokenizer)

    def text_of(output: Any) -> str:
        tokens = list(output.token_ids)
        if output.finish_reason == "stop" and tokens and tokens[-1] in turn_ends:
            tokens = tokens[:-1]  # the end-of-turn token is not content (see recurrent.async_utils)
        return tokenizer.decode(tokens, skip_special_tokens=True)

    def finish(job: _Job, response: str) -> None:
        cell = cells[job.cell]
        read = job.loop.chunks_read if job.loop is not None else 0
        scores = score_response(response.strip(), job.item.answers, cell.info.method)
        stores[job.cell].append({
            **item_record(job.item, cell.info), "status": "ok", "error": None, "response": response,
            "pred": scores.pop("pred"), **{f"judge_{k}": v for k, v in scores.items()},
            "num_chunks": read, "requests": job.requests, "retries": 0,
            "elapsed_s": round(time.perf_counter() - job.started, 3), "truncated_from_tokens": job.truncated_from,
            "memory": job.loop.memory if read else None, "final_prompt": job.final_prompt})  # fmt: skip
        job.done = True
        counts["finished"] += 1

    def fail(job: _Job, error: ValueError) -> None:
        """A request the engine rejected: the item is recorded as failed (redone by the next run)."""
        cell = cells[job.cell]
        message = f"{type(error).__name__}: {error}"
        stores[job.cell].append({**item_record(job.item, cell.info), "status": "error", "error": message,
                                 "requests": job.requests, "retries": 0,
                                 "elapsed_s": round(time.perf_counter() - job.started, 3)})  # fmt: skip
        job.done = True
        counts["failed"] += 1
        if counts["failed"] <= 3:
            logger.warning("batched eval: %s item %s failed: %s", cell.info.label, job.item.id, message)

    direct_params = _params(config, config.max_output_tokens)

    def next_request(job: _Job) -> tuple[str, Any]:
        """The job's next prompt and sampling: its loop's next request, or the direct baseline's prompt."""
        if job.loop is None:
            return job.prompt, direct_params
        request = job.loop.next_request()
        if request.is_final:
            job.final_prompt = request.prompt  # recorded: the format warm-up trains on this turn
        return request.prompt, _params(config, request.max_tokens)

    async def step(job: _Job) -> bool:
        """Send the job's next request and take in the answer; True while the job has more to do. An
        engine ``ValueError`` (e.g. a prompt longer than its window) fails this item only; any other
        failure is raised (the engine is broken)."""
        if (deadline is not None and time.time() > deadline) or (stop is not None and stop.is_set()):
            counts["stopped"] = 1
            return False
        message, params = next_request(job)
        ids, seconds = await asyncio.get_running_loop().run_in_executor(pool, ids_of, message)
        counts["tokenize_s"] += seconds
        try:
            output = (await engine.generate(ids, params))[0]
        except ValueError as error:
            job.requests += 1
            fail(job, error)
            return False
        job.requests += 1
        counts["requests"] += 1
        if job.loop is None:
            finish(job, text_of(output))
            return False
        job.loop.take(text_of(output))
        if job.loop.done:
            finish(job, job.loop.answer)
            return False
        return True

    async def run_item(job: _Job) -> None:
        while await step(job):
            pass

    def unfinished() -> list[_Job]:
        return [job for job in jobs if not job.done]

    def progress() -> None:
        logger.info("batched eval: %d requests, %d items in flight (the furthest at request %d), %d finished, "
                    "%d failed; %.0f s running, %.0f thread-s tokenizing", counts["requests"], len(unfinished()),
                    max((j.requests for j in jobs), default=0), counts["finished"], counts["failed"],
                    time.perf_counter() - t_requests, counts["tokenize_s"])  # fmt: skip

    async def every(seconds: float, action) -> None:
        while True:
            await asyncio.sleep(seconds)
            action()

    async def run_all() -> None:
        background = [asyncio.ensure_future(every(save_every_s, lambda: _save_states(cells, unfinished()))),
                      asyncio.ensure_future(every(log_every_s, progress))]  # fmt: skip
        try:
            if schedule == "items":
                await _all_or_cancel([run_item(job) for job in jobs])
            else:
                active = list(jobs)
                while active:
                    more = await _all_or_cancel([step(job) for job in active])
                    active = [job for job, again in zip(active, more, strict=True) if again]
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)

    counts["tokenize_s"] = 0.0
    t_requests = time.perf_counter()
    try:
        if jobs:
            engine.run_on_loop(run_all())
    finally:
        counts["generate_s"] = round(time.perf_counter() - t_requests, 3)
        pool.shutdown(wait=False, cancel_futures=True)
        _save_states(cells, unfinished())
        for store in stores:
            store.close()
    progress()
    counts["remaining"] = len(unfinished())
    counts["turns"] = max((job.requests - job.requests_before for job in jobs), default=0)
    counts["tokenize_s"] = round(counts["tokenize_s"], 3)
    return counts


async def _all_or_cancel(coros: list) -> list:
    """``asyncio.gather`` that, when one awaitable fails, cancels the others before raising."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _save_states(cells: Sequence[BatchCell], jobs: list[_Job]) -> None:
    """Write every cell's state file (unfinished memory items), removing it once the cell is done."""
    for k, cell in enumerate(cells):
        state_path = cell.paths()[2]
        mine = [j for j in jobs if j.cell == k and j.loop is not None]
        if mine:
            _save_state(state_path, mine)
        elif state_path.exists():
            state_path.unlink()

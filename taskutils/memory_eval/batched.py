"""Batched, resumable evaluation on an in-process rollout engine (no HTTP, no server).

The HTTP agents (:mod:`taskutils.memory_eval.agents`) send one request per turn per item; with a
small model and long documents the per-request work (HTTP, JSON, chat templating under one GIL)
can outweigh the generation (an H200 run measured 1.4-6 s per memory turn through the HTTP endpoint
with ~1,500 items in flight). Here every unfinished item's next turn goes to the engine in **one batch**, with the same
prompts (:mod:`recurrent.prompts`), chunking (:func:`~taskutils.memory_eval.chunking.iter_chunks`),
chat template (:func:`recurrent.chat_template.load_chat_template`, as ``serve.inproc_server``),
sampling and scoring (:func:`~taskutils.memory_eval.scoring.score_response`), and the same record
and meta files (:mod:`~taskutils.memory_eval.results`), so summaries and reports read them unchanged.

Resume: finished items are skipped (their records exist); the memory of unfinished memory-agent
items is saved to ``{label}.state.json`` beside the records every ``save_every`` turns and when the
``deadline`` passes, so a run stopped by a time limit continues mid-document next time.

    cells = [BatchCell(info, items, out_dir) ...]
    run_batched(cells, engine, tokenizer, AgentConfig(chunk_tokens=512, ...), deadline=time.time() + 500)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recurrent.async_utils import turn_end_token_ids
from recurrent.chat_template import load_chat_template, tokenize_conversation
from recurrent.prompts import (
    NO_MEMORY,
    render_final_prompt,
    render_template,
    render_update_prompt,
)
from taskutils.memory_eval.agents import (
    DIRECT_TEMPLATE_ANSWER_IS,
    DIRECT_TEMPLATE_BOXED,
    AgentConfig,
    _strip_think,
)
from taskutils.memory_eval.chunking import HFTokenizer, iter_chunks, middle_truncate
from taskutils.memory_eval.data import EvalItem
from taskutils.memory_eval.results import ResultStore, result_paths, write_meta
from taskutils.memory_eval.runner import CellInfo, item_record
from taskutils.memory_eval.scoring import score_response

__all__ = ["BatchCell", "run_batched"]

logger = logging.getLogger(__name__)

MEMORY_METHODS = {"recurrent": "answer_is", "recurrent-boxed": "boxed"}
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
    """One unfinished item: its cell, chunks still to read and the memory so far."""

    cell: int
    item: EvalItem
    chunks: list[str] = field(default_factory=list)
    next_chunk: int = 0
    memory: str = NO_MEMORY
    started: float = field(default_factory=time.perf_counter)
    requests: int = 0
    truncated_from: int | None = None
    prompt: str | None = None  # the direct baseline's single prompt


def _params(config: AgentConfig, max_tokens: int):
    from verl.workers.rollout.base import SamplingParams

    return SamplingParams(n=1, temperature=config.temperature, top_p=config.top_p, max_tokens=max_tokens)


def _save_state(path: Path, jobs: list[_Job]) -> None:
    state = {str(j.item.id): {"next_chunk": j.next_chunk, "memory": j.memory, "requests": j.requests} for j in jobs}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def run_batched(
    cells: Sequence[BatchCell],
    engine: Any,
    tokenizer: Any,
    config: AgentConfig,
    *,
    chat_template: str | None = None,
    save_every: int = 8,
    deadline: float | None = None,
    force: bool = False,
    workers: int | None = None,
    log_every_s: float = 30.0,
) -> dict[str, float]:
    """Run every unfinished item of ``cells`` turn by turn in batches; return counts.

    Args:
        engine: a :class:`~verl.workers.rollout.base.RolloutEngine` (vLLM in-process or HF).
        tokenizer: the model's Hugging Face (fast) tokenizer.
        config: chunk size, token budgets and sampling (as for the HTTP agents).
        save_every: memory turns between state saves.
        deadline: ``time.time()`` after which the run saves its state and returns (``stopped=1``).
        force: redo every item (records and saved state are discarded).
        workers: threads that tokenize (documents at the start, prompts every turn); default: all cores.
        log_every_s: seconds between progress lines (turn, items in flight, tokenizing vs generating time).

    Returns:
        ``{"finished", "failed", "resumed", "remaining", "turns", "stopped"}`` (counts; ``failed``: items
        whose request the engine rejected, recorded with ``status="error"``) and ``{"prepare_s",
        "tokenize_s", "generate_s"}`` (seconds: chunking the documents, tokenizing the prompts, the engine).
    """
    template = load_chat_template(tokenizer, chat_template)
    spanner = HFTokenizer(tokenizer)
    stores: list[ResultStore] = []
    todo: list[tuple[int, EvalItem, dict | None]] = []
    counts: dict[str, float] = {"finished": 0, "failed": 0, "resumed": 0, "remaining": 0, "turns": 0, "stopped": 0}
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
        context = item.get_context().strip()
        if cells[k].info.method in MEMORY_METHODS:
            if config.max_context_tokens is not None:
                context, before, after = middle_truncate(context, config.max_context_tokens, spanner)
                job.truncated_from = before if after < before else None
            job.chunks = list(iter_chunks(context, config.chunk_tokens, spanner))
            if state:
                job.next_chunk, job.memory, job.requests = state["next_chunk"], state["memory"], state["requests"]
        else:
            document, before, after = middle_truncate(context, config.max_input_tokens, spanner)
            job.truncated_from = before if after < before else None
            job.prompt = render_template(DIRECT_METHODS[cells[k].info.method], prompt=item.question, chunk=document)
        return job

    # Tokenizing is the host's work (chunking whole documents, then every turn's prompt); the Rust
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
    logger.info("batched eval: %d unfinished items of %d cells prepared in %.1f s (%d threads)", len(jobs),
                len(cells), counts["prepare_s"], n_workers)

    def ids_of(message: str) -> list[int]:
        return tokenize_conversation(tokenizer, template, [{"role": "user", "content": message}], True, None).ids

    def generate(requests: list[tuple[list[int], Any]]) -> list[Any]:
        """One output per request, or the ``ValueError`` with which the engine rejected that request
        (e.g. a prompt longer than its window); any other failure is raised (the engine is broken)."""

        async def _all() -> list[Any]:
            return list(await asyncio.gather(*(engine.generate(p, params) for p, params in requests),
                                             return_exceptions=True))

        # all at once on the engine's own loop, so that it batches them (as RolloutEngine.generate_batch)
        outputs = engine._engine_loop().run(_all())
        for out in outputs:
            if isinstance(out, BaseException) and not isinstance(out, ValueError):
                raise out
        return [out if isinstance(out, ValueError) else out[0] for out in outputs]

    turn_ends = turn_end_token_ids(tokenizer)

    def text_of(output: Any) -> str:
        tokens = list(output.token_ids)
        if output.finish_reason == "stop" and tokens and tokens[-1] in turn_ends:
            tokens = tokens[:-1]  # the end-of-turn token is not content (see recurrent.async_utils)
        return tokenizer.decode(tokens, skip_special_tokens=True)

    def finish(job: _Job, response: str) -> None:
        cell = cells[job.cell]
        scores = score_response(response.strip(), job.item.answers, cell.info.method)
        stores[job.cell].append({
            **item_record(job.item, cell.info), "status": "ok", "error": None, "response": response,
            "pred": scores.pop("pred"), **{f"judge_{k}": v for k, v in scores.items()},
            "num_chunks": job.next_chunk if job.chunks else 0, "requests": job.requests, "retries": 0,
            "elapsed_s": round(time.perf_counter() - job.started, 3), "truncated_from_tokens": job.truncated_from,
            "memory": job.memory if job.chunks else None})  # fmt: skip
        counts["finished"] += 1

    def fail(job: _Job, error: ValueError) -> None:
        """A request the engine rejected: the item is recorded as failed (redone by the next run)."""
        cell = cells[job.cell]
        message = f"{type(error).__name__}: {error}"
        stores[job.cell].append({**item_record(job.item, cell.info), "status": "error", "error": message,
                                 "requests": job.requests, "retries": 0,
                                 "elapsed_s": round(time.perf_counter() - job.started, 3)})  # fmt: skip
        counts["failed"] += 1
        if counts["failed"] <= 3:
            logger.warning("batched eval: %s item %s failed: %s", cell.info.label, job.item.id, message)

    memory_params, final_params = _params(config, config.max_memory_tokens), _params(config, config.max_final_tokens)
    direct_params = _params(config, config.max_output_tokens)
    counts["tokenize_s"] = counts["generate_s"] = 0.0
    last_log = time.perf_counter()
    try:
        while jobs:
            if deadline is not None and time.time() > deadline:
                counts["stopped"] = 1
                break
            # one turn of every unfinished item: a memory update, a final answer or the direct prompt
            batch: list[tuple[_Job, str, Any]] = []
            for job in jobs:
                if job.prompt is not None:
                    batch.append((job, "direct", direct_params))
                elif job.next_chunk < len(job.chunks):
                    batch.append((job, "memory", memory_params))
                else:
                    batch.append((job, "final", final_params))
            messages = []
            for job, kind, _ in batch:
                if kind == "direct":
                    messages.append(job.prompt)
                elif kind == "memory":
                    messages.append(render_update_prompt(job.item.question, job.memory, job.chunks[job.next_chunk]))
                else:
                    messages.append(render_final_prompt(job.item.question, job.memory,
                                                        style=MEMORY_METHODS[cells[job.cell].info.method]))
            t_host = time.perf_counter()
            prompts = list(pool.map(ids_of, messages))
            t_engine = time.perf_counter()
            outputs = generate([(ids, params) for ids, (_, _, params) in zip(prompts, batch, strict=True)])
            counts["tokenize_s"] += t_engine - t_host
            counts["generate_s"] += time.perf_counter() - t_engine
            counts["turns"] += 1
            still = []
            for (job, kind, _), output in zip(batch, outputs, strict=True):
                job.requests += 1
                if isinstance(output, ValueError):
                    fail(job, output)
                elif kind == "memory":
                    job.memory = _strip_think(text_of(output)) or NO_MEMORY
                    job.next_chunk += 1
                    still.append(job)
                else:
                    finish(job, text_of(output))
            jobs = still
            if counts["turns"] % max(1, save_every) == 0:
                _save_states(cells, jobs)
            if time.perf_counter() - last_log >= log_every_s or not jobs:
                last_log = time.perf_counter()
                logger.info("batched eval: turn %d, %d items in flight, %d finished; %.0f s tokenizing, "
                            "%.0f s generating so far", counts["turns"], len(jobs), counts["finished"],
                            counts["tokenize_s"], counts["generate_s"])  # fmt: skip
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        _save_states(cells, jobs)
        for store in stores:
            store.close()
    counts["remaining"] = len(jobs)
    counts["tokenize_s"], counts["generate_s"] = round(counts["tokenize_s"], 3), round(counts["generate_s"], 3)
    return counts


def _save_states(cells: Sequence[BatchCell], jobs: list[_Job]) -> None:
    """Write every cell's state file (unfinished memory items), removing it once the cell is done."""
    for k, cell in enumerate(cells):
        state_path = cell.paths()[2]
        mine = [j for j in jobs if j.cell == k and j.chunks]
        if mine:
            _save_state(state_path, mine)
        elif state_path.exists():
            state_path.unlink()

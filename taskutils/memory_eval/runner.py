"""Run one evaluation cell (model x method x task x length): bounded concurrency, resume, scoring."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from taskutils.memory_eval.agents import DirectAgent, MemoryAgentClient
from taskutils.memory_eval.client import RequestFailed, RequestStats, describe_error
from taskutils.memory_eval.data import EvalItem
from taskutils.memory_eval.results import ResultStore, write_meta
from taskutils.memory_eval.scoring import score_response

__all__ = ["CellInfo", "CellResult", "item_record", "run_cell"]


@dataclass
class CellInfo:
    """What one cell runs; written to its meta file and copied into every record."""

    task: str
    length: int | str
    label: str
    model: str
    method: str
    data_file: str = ""


@dataclass
class CellResult:
    """Counts of one run of a cell (this invocation only; the summary reads the files)."""

    n_items: int = 0
    n_resumed: int = 0
    n_ok: int = 0
    n_failed: int = 0
    n_invalid: int = 0
    requests: int = 0
    retries: int = 0
    errors: list[str] = field(default_factory=list)


def _base_record(info: CellInfo, item_id: int) -> dict[str, Any]:
    return {
        "_id": item_id,
        "task": info.task,
        "length": info.length,
        "label": info.label,
        "model": info.model,
        "method": info.method,
    }


def item_record(item: EvalItem, info: CellInfo) -> dict[str, Any]:
    """The fields every result record of ``item`` starts with: its public meta, the cell, the question
    and the gold answers (status, response and scores are added by the runner)."""
    record = {**{k: v for k, v in item.meta.items() if not k.startswith("_")}, **_base_record(info, item.id)}
    record.update(question=item.question, answers=item.answers)
    return record


async def _run_item(
    item: EvalItem, agent: MemoryAgentClient | DirectAgent, info: CellInfo, result: CellResult
) -> dict[str, Any]:
    record = item_record(item, info)
    start = time.perf_counter()
    stats = RequestStats()
    try:
        output = await agent.run(item.question, item.get_context(), stats=stats)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, never dropped
        message = str(exc) if isinstance(exc, RequestFailed) else describe_error(exc)
        record.update(
            status="error",
            error=message,
            requests=stats.requests,
            retries=stats.retries,
            elapsed_s=round(time.perf_counter() - start, 3),
        )
        result.n_failed += 1
        result.requests += stats.requests
        result.retries += stats.retries
        result.errors.append(f"item {item.id}: {message}")
        return record
    scores = score_response(output.response.strip(), item.answers, info.method)
    record.update(
        status="ok",
        error=None,
        response=output.response,
        pred=scores.pop("pred"),
        **{f"judge_{k}": v for k, v in scores.items()},
        num_chunks=output.num_chunks,
        requests=output.stats.requests,
        retries=output.stats.retries,
        elapsed_s=round(output.elapsed_s, 3),
        truncated_from_tokens=output.truncated_from_tokens,
    )
    result.n_ok += 1
    result.requests += output.stats.requests
    result.retries += output.stats.retries
    return record


async def run_cell(
    items: Sequence[EvalItem],
    invalid: Sequence[tuple[int, str]],
    store: ResultStore,
    meta_path: Any,
    info: CellInfo,
    agent_for: Callable[[int], MemoryAgentClient | DirectAgent],
    concurrency: int = 64,
    force: bool = False,
    redo_failed: bool = True,
    progress: bool = True,
) -> CellResult:
    """Run every unfinished item of one cell and append its record to ``store``.

    Args:
        items: validated rows; ``invalid``: ``(row, message)`` of rejected rows (recorded as
            ``status="invalid"`` so they are counted).
        agent_for: item position -> agent (round-robin over server replicas).
        concurrency: items in flight at once (each memory-agent item issues its turns sequentially).
        force: redo everything; ``redo_failed``: redo items whose last record is an error.
    """
    result = CellResult(n_items=len(items) + len(invalid))
    write_meta(
        meta_path,
        {**info.__dict__, "n_items": result.n_items, "n_invalid": len(invalid), "started_at": time.time()},
    )
    done = store.open(force=force, redo_failed=redo_failed)
    for row, message in invalid:
        if row not in done:
            store.append({**_base_record(info, row), "status": "invalid", "error": message})
            result.n_invalid += 1
    todo = [(pos, item) for pos, item in enumerate(items) if item.id not in done]
    result.n_resumed = len(items) - len(todo)
    semaphore = asyncio.Semaphore(max(1, concurrency))
    bar = tqdm(total=len(todo), desc=f"{info.label} {info.task}_{info.length}", disable=not progress, leave=False)

    async def one(pos: int, item: EvalItem) -> None:
        async with semaphore:
            record = await _run_item(item, agent_for(pos), info, result)
        store.append(record)
        bar.update(1)

    try:
        await asyncio.gather(*(one(pos, item) for pos, item in todo))
    finally:
        bar.close()
        store.close()
    return result

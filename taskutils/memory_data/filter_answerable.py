"""Remove questions that models answer without the context (docs/spec.md#filtering-answerable-questions).

Every question (no context) is sent to each OpenAI-compatible endpoint with the prompt
``"{question}\\nYour final answer in \\boxed{}.\\n"``, sampling ``n=2`` answers (temperature 1.0,
top-p 0.7, 512 tokens). Per endpoint and response the row gets ``score_boxed_<name>`` (strict boxed
exact match, :func:`verl.utils.reward_score.hotpotqa.compute_score`) and ``score_contains_<name>``
(some gold answer is a case-insensitive substring of the response). A row is *answerable* (and
removed) if any score of any endpoint is positive. The first ``--keep`` surviving rows, in input
order, are written to ``--out`` (the paper kept 32,768 train rows and 128 dev rows); all rows with
their responses and scores go to ``--result``.

    python -m taskutils.memory_data.filter_answerable --input data/hotpotqa_train_process.parquet \\
        --endpoint pretrain=http://localhost:8000/v1 --endpoint instruct=http://localhost:8001/v1 \\
        --keep 32768 --out data/hotpotqa_train.parquet

Responses are cached in ``<result>.cache.jsonl`` as they arrive, so an interrupted run resumes
(``--no-resume`` starts over). Requests run with bounded concurrency per endpoint and are retried
with exponential backoff on connection errors, timeouts, 429 and 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from taskutils.memory_data.sources import DataFormatError

logger = logging.getLogger(__name__)

PROMPT_TEMPLATE = "{question}\nYour final answer in \\boxed{{}}.\n"


@dataclass
class Endpoint:
    """One judged model behind an OpenAI-compatible server."""

    name: str
    base_url: str
    model: str | None = None
    api_key: str = "EMPTY"


@dataclass
class SamplingSettings:
    """Sampling and retry settings of the no-context queries (docs/spec.md#filtering-answerable-questions)."""

    n: int = 2
    temperature: float = 1.0
    top_p: float = 0.7
    max_tokens: int = 512
    max_retries: int = 6
    retry_base_delay: float = 1.0
    retry_max_delay: float = 60.0
    timeout: float = 3600.0


def build_prompt(question: str) -> str:
    """The no-context prompt: the question, then ``Your final answer in \\boxed{}.``."""
    return PROMPT_TEMPLATE.format(question=question)


def score_contains(response: str, ground_truth: Sequence[str]) -> float:
    """1.0 if some gold answer occurs case-insensitively in ``response``, else 0.0."""
    low = response.lower()
    return 1.0 if any(str(g).lower() in low for g in ground_truth) else 0.0


def score_boxed(response: str, ground_truth: Sequence[str]) -> float:
    """Strict boxed exact match (max over gold answers), the training reward (docs/spec.md#training-reward)."""
    from verl.utils.reward_score.hotpotqa import compute_score

    return float(compute_score(response, list(ground_truth)))


async def query_with_retries(client: Any, model: str, prompt: str, settings: SamplingSettings) -> list[str]:
    """Sample ``settings.n`` chat completions for one prompt, retrying transient failures with backoff
    (the evaluation harness's retry policy: 429, 5xx, timeouts and dropped connections)."""
    from taskutils.memory_eval.client import RetryPolicy, create_with_retries

    policy = RetryPolicy(
        max_attempts=settings.max_retries + 1, base_delay=settings.retry_base_delay, max_delay=settings.retry_max_delay
    )
    resp = await create_with_retries(
        client,
        policy,
        model=model,
        messages=[{"role": "user", "content": prompt}],
        n=settings.n,
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_tokens=settings.max_tokens,
    )
    return [c.message.content or "" for c in resp.choices]


def load_cache(path: Path, questions: Sequence[str] | None = None) -> dict[tuple[int, str], list[str]]:
    """Cached responses: (row, endpoint name) -> responses. Ignores a torn last line, and (given
    ``questions``) entries whose row is out of range or was asked for a different question."""
    cache: dict[tuple[int, str], list[str]] = {}
    if not path.exists():
        return cache
    stale = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            row = int(rec["row"])
            if questions is not None and (
                row >= len(questions) or rec.get("question", questions[row]) != questions[row]
            ):
                stale += 1
                continue
            cache[(row, rec["endpoint"])] = list(rec["responses"])
    if stale:
        logger.warning("%s: ignored %d cached responses for other questions", path, stale)
    return cache


async def collect_responses(
    questions: Sequence[str],
    endpoints: Sequence[Endpoint],
    settings: SamplingSettings,
    cache_path: Path,
    concurrency: int = 256,
) -> dict[tuple[int, str], list[str]]:
    """Query every (row, endpoint) pair missing from the cache; returns all responses obtained.

    New responses are appended to ``cache_path`` as they arrive. Pairs that still fail after the
    retries are logged and left out of the result.
    """
    from openai import AsyncOpenAI

    cache = load_cache(cache_path, questions)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    jobs = []
    clients = []
    for ep in endpoints:
        client = AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=settings.timeout)
        clients.append(client)
        if ep.model is None:
            models = await client.models.list()
            ep.model = models.data[0].id
            logger.info("endpoint %s (%s): using model %s", ep.name, ep.base_url, ep.model)
        sem = asyncio.Semaphore(concurrency)
        for row, q in enumerate(questions):
            if (row, ep.name) not in cache:
                jobs.append((row, ep, client, sem, q))
    failures = 0
    bar = tqdm(total=len(jobs), desc="no-context queries", unit="req")

    async def run_one(row: int, ep: Endpoint, client: Any, sem: asyncio.Semaphore, question: str, out) -> None:
        nonlocal failures
        async with sem:
            try:
                responses = await query_with_retries(client, ep.model, build_prompt(question), settings)
            except Exception as exc:  # noqa: BLE001 - count and report, keep the other rows going
                failures += 1
                logger.warning("row %d, endpoint %s failed: %s: %s", row, ep.name, type(exc).__name__, exc)
                return
            finally:
                bar.update(1)
        cache[(row, ep.name)] = responses
        out.write(json.dumps({"row": row, "endpoint": ep.name, "question": question, "responses": responses}) + "\n")
        out.flush()

    try:
        with open(cache_path, "a", encoding="utf-8") as out:
            await asyncio.gather(*(run_one(*job, out) for job in jobs))
    finally:
        bar.close()
        for client in clients:
            await client.close()
    if failures:
        logger.warning("%d requests failed after retries; rerun to retry them (cached responses are kept)", failures)
    return cache


def _score_columns(
    rows: range,
    ground_truths: Sequence[Sequence[str]],
    endpoints: Sequence[Endpoint],
    cache: dict[tuple[int, str], list[str]],
) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {}
    answerable: list[bool | None] = []
    for ep in endpoints:
        cols[f"responses_{ep.name}"] = []
        cols[f"score_boxed_{ep.name}"] = []
        cols[f"score_contains_{ep.name}"] = []
    for row in rows:
        any_correct, complete = False, True
        for ep in endpoints:
            responses = cache.get((row, ep.name))
            if responses is None:
                complete = False
                boxed = contains = None
            else:
                boxed = [score_boxed(r, ground_truths[row]) for r in responses]
                contains = [score_contains(r, ground_truths[row]) for r in responses]
                any_correct = any_correct or any(s > 0 for s in boxed + contains)
            cols[f"responses_{ep.name}"].append(responses)
            cols[f"score_boxed_{ep.name}"].append(boxed)
            cols[f"score_contains_{ep.name}"].append(contains)
        answerable.append(True if any_correct else (False if complete else None))
    cols["answerable"] = answerable
    return cols


def write_outputs(
    input_path: Path,
    result_path: Path,
    out_path: Path,
    endpoints: Sequence[Endpoint],
    cache: dict[tuple[int, str], list[str]],
    ground_truths: Sequence[Sequence[str]],
    keep: int | None,
    batch_size: int = 512,
) -> tuple[int, int, int]:
    """Stream the input parquet into the result file (+ score columns) and the filtered file.

    Returns ``(rows, unanswerable rows, rows kept)``. Rows with missing responses are never kept.
    """
    extra_types = {}
    for ep in endpoints:
        extra_types[f"responses_{ep.name}"] = pa.list_(pa.string())
        extra_types[f"score_boxed_{ep.name}"] = pa.list_(pa.float64())
        extra_types[f"score_contains_{ep.name}"] = pa.list_(pa.float64())
    extra_types["answerable"] = pa.bool_()
    source = pq.ParquetFile(input_path)
    schema = source.schema_arrow
    for name, typ in extra_types.items():
        schema = schema.append(pa.field(name, typ))
    tmp_result = result_path.with_name(result_path.name + ".tmp")
    tmp_out = out_path.with_name(out_path.name + ".tmp")
    n_rows = n_clean = n_kept = 0
    with pq.ParquetWriter(tmp_result, schema) as result_writer, pq.ParquetWriter(tmp_out, schema) as out_writer:
        for batch in source.iter_batches(batch_size=batch_size):
            table = pa.Table.from_batches([batch])
            cols = _score_columns(range(n_rows, n_rows + table.num_rows), ground_truths, endpoints, cache)
            for name, typ in extra_types.items():
                table = table.append_column(pa.field(name, typ), pa.array(cols[name], type=typ))
            table = table.cast(schema)
            result_writer.write_table(table)
            clean = [i for i, a in enumerate(cols["answerable"]) if a is False]
            n_clean += len(clean)
            if keep is not None:
                clean = clean[: max(0, keep - n_kept)]
            if clean:
                out_writer.write_table(table.take(pa.array(clean, type=pa.int64())))
                n_kept += len(clean)
            n_rows += table.num_rows
    os.replace(tmp_result, result_path)
    os.replace(tmp_out, out_path)
    return n_rows, n_clean, n_kept


def read_questions(path: Path) -> tuple[list[str], list[list[str]]]:
    """Questions (``prompt[0].content``) and gold answers (``reward_model.ground_truth``) of a parquet.

    Raises:
        DataFormatError: naming the file, row and field of a malformed row.
    """
    df = pd.read_parquet(path, columns=["prompt", "reward_model"])
    questions, answers = [], []
    for row, (prompt, rm) in enumerate(zip(df["prompt"], df["reward_model"])):
        try:
            question = prompt[0]["content"]
        except (TypeError, IndexError, KeyError):
            question = None
        if not isinstance(question, str) or not question.strip():
            raise DataFormatError(f"{path}: row {row}: field 'prompt[0].content' is missing or empty")
        gts = rm.get("ground_truth") if isinstance(rm, dict) else None
        if isinstance(gts, str):
            gts = [gts]
        if gts is None or len(gts) == 0 or not all(isinstance(g, str) for g in gts):
            raise DataFormatError(
                f"{path}: row {row}: field 'reward_model.ground_truth' must be a non-empty list of strings, got {gts!r}"
            )
        questions.append(question)
        answers.append(list(gts))
    return questions, answers


def parse_endpoints(specs: Sequence[str], models: Sequence[str], api_key: str) -> list[Endpoint]:
    """``NAME=URL`` endpoint specs plus optional ``NAME=MODEL`` model names -> Endpoint list."""
    endpoints: list[Endpoint] = []
    for spec in specs:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url:
            raise SystemExit(
                f"--endpoint must look like NAME=URL (e.g. pretrain=http://localhost:8000/v1), got {spec!r}"
            )
        if any(ep.name == name for ep in endpoints):
            raise SystemExit(f"--endpoint name {name!r} given twice")
        endpoints.append(Endpoint(name, url, None, api_key))
    by_name = {ep.name: ep for ep in endpoints}
    for spec in models:
        name, sep, model = spec.partition("=")
        if not sep or name not in by_name:
            raise SystemExit(f"--model must look like NAME=MODEL with NAME one of {sorted(by_name)}, got {spec!r}")
        by_name[name].model = model
    return endpoints


def default_result_path(input_path: Path, out_path: Path) -> Path:
    """``x_process.parquet`` -> ``x_result.parquet`` next to the output; else ``<out stem>_result.parquet``."""
    stem = input_path.stem
    stem = stem[: -len("_process")] + "_result" if stem.endswith("_process") else out_path.stem + "_result"
    return out_path.with_name(stem + ".parquet")


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m taskutils.memory_data.filter_answerable",
        description="Drop questions that models answer correctly without context (Best-of-n).",
    )
    p.add_argument("--input", required=True, help="process parquet (hotpotqa_*_process.parquet)")
    p.add_argument("--out", required=True, help="filtered parquet (first --keep unanswerable rows)")
    p.add_argument("--result", help="all rows with responses/scores (default: <input>_result.parquet)")
    p.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="judged model endpoint, repeatable (e.g. pretrain=http://localhost:8000/v1)",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=MODEL",
        help="model name for an endpoint (default: the first model the server lists)",
    )
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    p.add_argument("--keep", type=int, default=None, help="rows to keep (paper: 32768 train, 128 dev; default all)")
    p.add_argument("--n", type=int, default=2, help="samples per question and endpoint (2)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=256, help="in-flight requests per endpoint (256)")
    p.add_argument("--max-retries", type=int, default=6)
    p.add_argument("--retry-base-delay", type=float, default=1.0, help="first backoff delay in seconds")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout in seconds")
    p.add_argument("--no-resume", action="store_true", help="ignore and delete cached responses")
    p.add_argument(
        "--allow-failed",
        action="store_true",
        help="write outputs even if some requests failed (those rows are not kept)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns 1 if requests failed and --allow-failed was not given."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_arg_parser().parse_args(argv)
    input_path, out_path = Path(args.input), Path(args.out)
    result_path = Path(args.result) if args.result else default_result_path(input_path, out_path)
    cache_path = result_path.with_name(result_path.name + ".cache.jsonl")
    if args.no_resume and cache_path.exists():
        cache_path.unlink()
    endpoints = parse_endpoints(args.endpoint, args.model, args.api_key)
    settings = SamplingSettings(
        args.n,
        args.temperature,
        args.top_p,
        args.max_tokens,
        args.max_retries,
        args.retry_base_delay,
        timeout=args.timeout,
    )
    questions, ground_truths = read_questions(input_path)
    cache = asyncio.run(collect_responses(questions, endpoints, settings, cache_path, args.concurrency))
    missing = sum((row, ep.name) not in cache for row in range(len(questions)) for ep in endpoints)
    if missing and not args.allow_failed:
        logger.error(
            "%d of %d requests have no response; rerun to retry, or pass --allow-failed",
            missing,
            len(questions) * len(endpoints),
        )
        return 1
    out_path.parent.mkdir(parents=True, exist_ok=True)
    n_rows, n_clean, n_kept = write_outputs(
        input_path, result_path, out_path, endpoints, cache, ground_truths, args.keep
    )
    logger.info(
        "%d rows: %d not answerable without context (%.1f%%); kept %d -> %s; all rows -> %s",
        n_rows,
        n_clean,
        100.0 * n_clean / max(1, n_rows),
        n_kept,
        out_path,
        result_path,
    )
    if args.keep is not None and n_kept < args.keep:
        logger.warning("only %d rows survived, fewer than --keep %d", n_kept, args.keep)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DataFormatError as exc:  # a clean message instead of a traceback
        sys.exit(f"error: {exc}")

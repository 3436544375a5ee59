"""HotpotQA long-context synthesis (docs/spec.md#hotpotqa-synthesis, #ruler-hotpotqa).

Stage ``process``: ``hotpotqa_{train,dev}_process.parquet`` — the first N questions of each split,
each with D documents (its 10 own paragraphs + distractors sampled from the split's document pool),
rendered as ``Document i:`` blocks; parquet rows in the original schema.

Stage ``eval``: ``eval_{D}.json`` for every D in ``--eval-lengths`` — the dev questions listed in
``--eval-from`` (the filtered ``hotpotqa_dev.parquet`` or an eval JSON; default: the first
``--eval-questions`` dev questions), each with D documents from the dev pool. For D above
``--index-only-above`` (10,000) the context is the list of document indices into the sorted dev
pool (render it with :func:`taskutils.memory_data.documents.expand_index_context` and the pool from
:func:`taskutils.memory_data.sources.read_hotpotqa`).

    python -m taskutils.memory_data.hotpotqa_synth --train hotpot_train_v1.1.json \\
        --dev hotpot_dev_distractor_v1.json --out data/hotpotqa

Gold documents are placed at random positions per sample unless ``--fixed-layout`` (the original's
``random.Random(4)`` shuffle, identical positions for every sample of a size; docs/spec.md#bug-fixed-shuffle).
Everything is deterministic for ``--seed`` and independent of ``--workers``. Finished files are
skipped on a rerun (``--force`` rebuilds); the process stage resumes from finished shards.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
from tqdm.auto import tqdm

from taskutils.memory_data.documents import (
    apply_layout,
    gold_positions,
    render_documents,
    sample_rng,
    select_documents,
)
from taskutils.memory_data.fork_pool import fork_available, fork_pool
from taskutils.memory_data.io_utils import qa_row, qa_schema, write_json_list, write_sharded_parquet
from taskutils.memory_data.sources import DataFormatError, QAItem, QASource, read_hotpotqa

logger = logging.getLogger(__name__)

DATA_SOURCE = "hotpotqa"
DEFAULT_EVAL_LENGTHS = (50, 100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600)
PROCESS_SCHEMA = qa_schema([("num_docs", pa.int64()), ("gold_docs", pa.list_(pa.int64()))])


def layout_documents(
    item: QAItem, source: QASource, num_docs: int, seed: int, stage: str, fixed_layout: bool
) -> list[int]:
    """Ordered pool indices of one sample's documents (selection + layout), deterministic per seed."""
    rng = sample_rng(seed, stage, num_docs, item.index)
    ids = select_documents(item, num_docs, len(source.docs), rng)
    return apply_layout(ids, "fixed" if fixed_layout else "random", rng)


def make_process_row(
    item: QAItem, source: QASource, num_docs: int, seed: int, split: str, fixed_layout: bool
) -> dict[str, Any]:
    """One parquet row: the question with ``num_docs`` rendered documents (docs/spec.md#hotpotqa-synthesis schema)."""
    ids = layout_documents(item, source, num_docs, seed, split, fixed_layout)
    context = render_documents([source.docs[i] for i in ids])
    extra = {"index": item.index, "num_docs": len(ids), "gold_docs": gold_positions(ids, item.gold_doc_ids)}
    return qa_row(DATA_SOURCE, item.question, context, item.answers, extra)


def make_eval_record(
    item: QAItem, source: QASource, num_docs: int, seed: int, fixed_layout: bool, index_only: bool
) -> dict[str, Any]:
    """One ``eval_{D}.json`` record: context (text or index list), input, answers, num_docs, index."""
    ids = layout_documents(item, source, num_docs, seed, "eval", fixed_layout)
    context: str | list[int] = ids if index_only else render_documents([source.docs[i] for i in ids])
    return {
        "context": context,
        "input": item.question,
        "answers": list(item.answers),
        "num_docs": len(ids),
        "index": item.index,
        "gold_docs": gold_positions(ids, item.gold_doc_ids),
    }


# Worker-process state (inherited through fork; never pickled).
_STATE: dict[str, Any] = {}


def _rows_for_range(args: tuple[int, int]) -> list[dict[str, Any]]:
    start, end = args
    s = _STATE
    return [
        make_process_row(item, s["source"], s["num_docs"], s["seed"], s["split"], s["fixed_layout"])
        for item in s["items"][start:end]
    ]


def build_process_split(
    source: QASource,
    split: str,
    out_dir: Path,
    num_questions: int,
    num_docs: int,
    seed: int,
    fixed_layout: bool,
    workers: int = 1,
    shard_size: int = 2000,
    force: bool = False,
) -> Path:
    """Write ``hotpotqa_{split}_process.parquet`` (first ``num_questions`` questions) and return its path."""
    out = out_dir / f"hotpotqa_{split}_process.parquet"
    if out.exists() and not force:
        logger.info("%s exists; skipping (use --force to rebuild)", out)
        return out
    parts = out.with_name(out.name + ".parts")
    if force and parts.exists():
        import shutil

        shutil.rmtree(parts)
    items = source.items[:num_questions]
    if len(items) < num_questions:
        logger.warning("%s has only %d valid questions (< %d requested)", source.path, len(items), num_questions)
    _STATE.update(source=source, items=items, num_docs=num_docs, seed=seed, split=split, fixed_layout=fixed_layout)
    params = {
        "input": os.path.abspath(source.path),
        "num_docs": num_docs,
        "seed": seed,
        "fixed_layout": fixed_layout,
        "pool_size": len(source.docs),
    }
    use_pool = workers > 1 and fork_available()
    bar = tqdm(total=len(items), desc=f"{split} ({num_docs} docs)", unit="q")

    def write(pool: Pool | None) -> None:
        def make_rows(start: int, end: int) -> Iterator[dict[str, Any]]:
            step = max(1, (end - start + 4 * workers - 1) // (4 * workers)) if pool else end - start
            ranges = [(a, min(end, a + step)) for a in range(start, end, step)]
            results = pool.imap(_rows_for_range, ranges) if pool else map(_rows_for_range, ranges)
            for rows in results:
                yield from rows

        write_sharded_parquet(out, len(items), make_rows, PROCESS_SCHEMA, params, shard_size, bar.update)

    try:
        if use_pool:
            with fork_pool(workers) as pool:
                write(pool)
        else:
            write(None)
    finally:
        bar.close()
        _STATE.clear()
    return out


def read_eval_question_indices(path: str | Path) -> list[int]:
    """Question indices listed by a filtered parquet (``extra_info.index``) or an eval JSON (``index``)."""
    path = Path(path)
    if path.suffix == ".parquet":
        df = pd.read_parquet(path, columns=["extra_info"])
        return [int(e["index"]) for e in df["extra_info"]]
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of eval records with an 'index' field")
    return [int(rec["index"]) for rec in data]


def build_eval_sets(
    source: QASource,
    question_indices: Sequence[int],
    lengths: Sequence[int],
    out_dir: Path,
    seed: int,
    fixed_layout: bool,
    index_only_above: int = 10_000,
    force: bool = False,
) -> list[Path]:
    """Write ``eval_{D}.json`` for each D in ``lengths``; returns the paths."""
    by_index = source.item_by_index()
    missing = [i for i in question_indices if i not in by_index]
    if missing:
        raise ValueError(f"{source.path}: eval question indices not found among valid questions: {missing[:10]}")
    items = [by_index[i] for i in question_indices]
    paths = []
    for num_docs in lengths:
        out = out_dir / f"eval_{num_docs}.json"
        paths.append(out)
        if out.exists() and not force:
            logger.info("%s exists; skipping (use --force to rebuild)", out)
            continue
        index_only = num_docs > index_only_above
        records = (
            make_eval_record(item, source, num_docs, seed, fixed_layout, index_only)
            for item in tqdm(items, desc=f"eval_{num_docs}", unit="q")
        )
        write_json_list(records, out)
    return paths


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m taskutils.memory_data.hotpotqa_synth",
        description="Synthesize long-context HotpotQA training parquet and eval_{D}.json sets.",
    )
    p.add_argument("--train", help="HotpotQA train JSON (e.g. hotpot_train_v1.1.json)")
    p.add_argument("--dev", help="HotpotQA dev JSON, distractor setting (hotpot_dev_distractor_v1.json)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--stages", default="process,eval", help="comma list of: process, eval (default both)")
    p.add_argument("--train-questions", type=int, default=80_000, help="first N train questions (80000)")
    p.add_argument("--dev-questions", type=int, default=200, help="first N dev questions (200)")
    p.add_argument("--train-docs", type=int, default=200, help="documents per train sample (200)")
    p.add_argument("--dev-docs", type=int, default=200, help="documents per dev sample (200)")
    p.add_argument(
        "--eval-lengths",
        type=_int_list,
        default=list(DEFAULT_EVAL_LENGTHS),
        help="comma list of document counts for eval_{D}.json (50,100,...,25600)",
    )
    p.add_argument("--eval-from", help="filtered dev parquet or eval JSON whose question indices to use")
    p.add_argument(
        "--eval-questions", type=int, default=128, help="without --eval-from: use the first N dev questions (128)"
    )
    p.add_argument(
        "--index-only-above",
        type=int,
        default=10_000,
        help="eval sets with more documents store index lists instead of text (10000)",
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--fixed-layout", action="store_true", help="reproduce the original layout: random.Random(4).shuffle per sample"
    )
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--shard-size", type=int, default=2000, help="rows per resumable shard (2000)")
    p.add_argument("--skip-malformed", action="store_true", help="log and skip malformed input rows")
    p.add_argument("--force", action="store_true", help="rebuild outputs that already exist")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_arg_parser().parse_args(argv)
    stages = {s.strip() for s in args.stages.split(",") if s.strip()}
    unknown = stages - {"process", "eval"}
    if unknown:
        raise SystemExit(f"--stages: unknown stage(s) {sorted(unknown)}; expected process, eval")
    if not args.train and not args.dev:
        raise SystemExit("give --train and/or --dev")
    if "eval" in stages and not args.dev:
        raise SystemExit("the eval stage needs --dev (its document pool and questions)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = read_hotpotqa(args.dev, args.skip_malformed) if args.dev else None
    if "process" in stages:
        if args.train:
            train = read_hotpotqa(args.train, args.skip_malformed)
            logger.info("train: %d questions, %d unique documents", len(train.items), len(train.docs))
            build_process_split(
                train,
                "train",
                out_dir,
                args.train_questions,
                args.train_docs,
                args.seed,
                args.fixed_layout,
                args.workers,
                args.shard_size,
                args.force,
            )
            del train
        if dev is not None:
            logger.info("dev: %d questions, %d unique documents", len(dev.items), len(dev.docs))
            build_process_split(
                dev,
                "dev",
                out_dir,
                args.dev_questions,
                args.dev_docs,
                args.seed,
                args.fixed_layout,
                args.workers,
                args.shard_size,
                args.force,
            )
    if "eval" in stages:
        if args.eval_from:
            indices = read_eval_question_indices(args.eval_from)
        else:
            logger.warning("no --eval-from: using the first %d dev questions (not filtered)", args.eval_questions)
            indices = [item.index for item in dev.items[: args.eval_questions]]
        build_eval_sets(
            dev, indices, args.eval_lengths, out_dir, args.seed, args.fixed_layout, args.index_only_above, args.force
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DataFormatError as exc:  # a clean message instead of a traceback
        sys.exit(f"error: {exc}")

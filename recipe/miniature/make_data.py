"""Data of the miniature extrapolation experiment (docs/results/): train, validation and eval sets.

Four task kinds (``taskutils.memory_data.synthetic_qa``): RULER-style needle retrieval with one key
(``niah_single``) and four keys (``niah_multikey``), variable tracking over 1-2 hops
(``variable_tracking``) and a multi-document QA in the HotpotQA schema (``multidoc_qa``), each with
the question and the haystack stored separately and one short gold answer. Lengths are counted in
chunks of ``--chunk-tokens`` tokens of the model's tokenizer: a row of ``L`` chunks has more than
``(L-1) * chunk`` and at most ``L * chunk`` context tokens, so the memory agent reads exactly ``L``
sections.

    python -m recipe.miniature.make_data --tokenizer MODEL_DIR --out runs/miniature/data

writes::

    {out}/train.parquet                    --train-n rows, 1..--train-max-chunks chunks, seed 0
    {out}/val.parquet                      --val-n rows, same lengths, seed 100
    {out}/eval/seed{S}/eval_{kind}_{L}.parquet   --eval-n rows per kind and length L, seed S

Train, validation and each evaluation seed use disjoint sample seeds (different needles, keys and
haystack positions). Row ``i`` of a file is exactly row ``i`` of
``make_needle_qa_dataset(n, chunks, chunk_tokens, tokenizer, seed, kinds)``; rows are made in jobs of a
few rows over ``--workers`` processes, so one long file does not hold up the rest. Existing files
with the expected number of rows are kept (``--force`` redoes them).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from taskutils.memory_data.io_utils import write_parquet
from taskutils.memory_data.synthetic_qa import DEFAULT_KINDS, SYNTHETIC_SCHEMA, make_needle_qa_rows, synthetic_haystack

logger = logging.getLogger("miniature.data")

EVAL_LENGTHS = (1, 2, 8, 32, 128, 512)
"""Document lengths (in chunks) of the evaluation grid."""
TRAIN_SEED, VAL_SEED = 0, 100
DATA_SOURCE = "synthetic_qa"  # routed to the strict boxed verifier (verl.utils.reward_score)


def _rows_in(path: Path) -> int:
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowException):  # missing or unreadable: regenerate
        return -1


@dataclass(frozen=True)
class FileSpec:
    """One parquet file: ``n`` rows of ``kinds`` with ``chunks`` (low, high) chunks, sample seed ``seed``."""

    path: Path
    n: int
    chunks: tuple[int, int]
    seed: int
    kinds: tuple[str, ...]


_WORKER: dict = {}


def _worker_init(tokenizer: str, chunk_tokens: int) -> None:
    from taskutils.memory_data.tokens import TokenCounter, load_tokenizer

    counter = TokenCounter(load_tokenizer(tokenizer))
    _WORKER.update(counter=counter, haystack=synthetic_haystack(counter, chunk_tokens), chunk_tokens=chunk_tokens)


def _rows(job: tuple[int, FileSpec, int, int]) -> tuple[int, int, list[dict]]:
    """Rows ``start..stop-1`` of file ``spec`` (as make_needle_qa_dataset(spec.n, ...) makes them)."""
    file_id, spec, start, stop = job
    rows = make_needle_qa_rows(
        range(start, stop),
        spec.chunks,
        _WORKER["chunk_tokens"],
        _WORKER["counter"],
        _WORKER["haystack"],
        spec.seed,
        spec.kinds,
        DATA_SOURCE,
    )
    return file_id, start, rows


def plan_files(args: argparse.Namespace) -> list[FileSpec]:
    """Every file of the experiment (train, validation, each seed x length x kind of the eval grid)."""
    out, kinds = Path(args.out), tuple(args.kinds)
    files = [
        FileSpec(out / "train.parquet", args.train_n, (1, args.train_max_chunks), TRAIN_SEED, kinds),
        FileSpec(out / "val.parquet", args.val_n, (1, args.train_max_chunks), VAL_SEED, kinds),
    ]
    if not args.only_train:
        for seed in args.eval_seeds:
            for length in args.eval_lengths:
                for kind in kinds:
                    # the sample seed mixes the evaluation seed and the length: lengths do not share needles
                    files.append(
                        FileSpec(
                            out / "eval" / f"seed{seed}" / f"eval_{kind}_{length}.parquet",
                            args.eval_n,
                            (length, length),
                            1000 * seed + length,
                            (kind,),
                        )
                    )
    return files


def write_files(
    files: list[FileSpec], tokenizer: str, chunk_tokens: int, workers: int, force: bool = False, rows_per_job: int = 4
) -> list[Path]:
    """Generate the missing files in ``workers`` processes (jobs of ``rows_per_job`` rows, longest first)."""
    from tqdm.auto import tqdm

    todo = [f for f in files if force or _rows_in(f.path) != f.n]
    for f in files:
        if f not in todo:
            logger.info("kept %s (%d rows)", f.path, f.n)
    jobs = [(k, f, a, min(a + rows_per_job, f.n)) for k, f in enumerate(todo) for a in range(0, f.n, rows_per_job)]
    jobs.sort(key=lambda j: -(j[3] - j[2]) * j[1].chunks[1])
    parts: dict[int, dict[int, list[dict]]] = {k: {} for k in range(len(todo))}
    written = []

    def collect(result: tuple[int, int, list[dict]]) -> None:
        k, start, rows = result
        parts[k][start] = rows
        if sum(len(r) for r in parts[k].values()) == todo[k].n:  # file complete: write it, free the rows
            rows_all = [row for a in sorted(parts[k]) for row in parts[k][a]]
            written.append(write_parquet(rows_all, todo[k].path, SYNTHETIC_SCHEMA))  # atomic (temp + rename)
            parts[k].clear()
            logger.info("wrote %s (%d rows)", todo[k].path, todo[k].n)

    bar = tqdm(total=sum(j[3] - j[2] for j in jobs), desc="rows", unit="row")
    if workers > 1 and len(jobs) > 1:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer, chunk_tokens)) as pool:
            for result in pool.imap_unordered(_rows, jobs):
                collect(result)
                bar.update(len(result[2]))
    else:
        _worker_init(tokenizer, chunk_tokens)
        for job in jobs:
            result = _rows(job)
            collect(result)
            bar.update(len(result[2]))
    bar.close()
    return written


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.miniature.make_data", description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="local HF model/tokenizer folder that counts tokens")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk (the agent's chunk_size)")
    p.add_argument("--train-n", type=int, default=2048, help="training rows")
    p.add_argument("--val-n", type=int, default=64, help="validation rows")
    p.add_argument("--train-max-chunks", type=int, default=8, help="training/validation rows have 1..N chunks")
    p.add_argument("--eval-n", type=int, default=16, help="evaluation rows per kind, length and seed")
    p.add_argument("--eval-lengths", type=_ints, default=list(EVAL_LENGTHS), help="comma list of chunk counts")
    p.add_argument("--eval-seeds", type=_ints, default=[1, 2], help="comma list of evaluation seeds")
    p.add_argument(
        "--kinds",
        type=lambda s: [k for k in s.split(",") if k],
        default=list(DEFAULT_KINDS),
        help=f"comma list of task kinds (default: {','.join(DEFAULT_KINDS)})",
    )
    p.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    p.add_argument("--only-train", action="store_true", help="write train.parquet and val.parquet only")
    p.add_argument("--force", action="store_true", help="regenerate existing files")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    unknown = [k for k in args.kinds if k not in DEFAULT_KINDS]
    if unknown:
        raise SystemExit(f"--kinds: unknown kind(s) {unknown}; known: {', '.join(DEFAULT_KINDS)}")
    if not Path(args.tokenizer, "tokenizer_config.json").is_file():
        raise SystemExit(f"--tokenizer {args.tokenizer}: no tokenizer_config.json there (need a local HF folder)")
    write_files(plan_files(args), args.tokenizer, args.chunk_tokens, args.workers, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())

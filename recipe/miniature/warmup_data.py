"""The format warm-up: SFT data that teaches ``\\boxed{}`` and nothing about memory (docs/differences.md).

From the untrained model's own memory-agent rollouts on TRAINING data, keep the trajectories whose final answer
already contains a gold answer (whole word, case-insensitive) and rewrite only that final answer as the model's
own text followed by ``\\boxed{gold}``. Each kept trajectory becomes one SFT conversation of its final turn only:
the final-turn user message exactly as the model received it (question + the model's own memory) and the
rewritten answer. The memory updates are never trained, so the warm-up cannot teach what to remember; it only
teaches the answer format that the strict verifier reads.

    # 1. rollouts of the untrained model on the training file (records with the final-turn prompt)
    python -m recipe.miniature.warmup_data rollouts --data runs/miniature/data/train.parquet \\
        --model MODEL_DIR --out runs/miniature/warmup/rollouts
    # 2. the SFT conversations (parquet with a `messages` column, read by verl.trainer.main_sft)
    python -m recipe.miniature.warmup_data build --records runs/miniature/warmup/rollouts \\
        --out runs/miniature/warmup/warmup.parquet
    # 3. SFT: python -m verl.trainer.main_sft data.train_files=runs/miniature/warmup/warmup.parquet ...

Training data only: both commands refuse a data file whose name marks it as held-out (val, valid, validation,
dev, test, eval, evaluation as a word of the file name) and ``build`` refuses records that do not show positive
evidence of training data (a ``split`` field equal to ``train``, or a data file named ``train...``).

Records are those of the evaluation harness's batched runner (``taskutils.memory_eval.batched``): ``question``,
``answers``, ``response`` (the final answer), ``method``, ``status`` and ``final_prompt`` (the final turn's user
message as sent); records without ``final_prompt`` fall back to rendering it from ``question`` and ``memory``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from recurrent.prompts import render_final_prompt
from taskutils.memory_eval.agents import MEMORY_METHODS
from taskutils.memory_eval.results import read_meta, read_records
from taskutils.memory_eval.scoring import gold_as_whole_word
from verl.utils.reward_score.math_normalize import as_answer_list

logger = logging.getLogger("miniature.warmup")

HELD_OUT_WORDS = ("val", "valid", "validation", "dev", "test", "eval", "evaluation", "heldout")
TRAIN_SPLITS = ("train", "training")
LABEL = "untrained-memory"


class NotTrainingData(ValueError):
    """Records or a data file that are not (provably) from the training split."""


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


def check_training_file(path: str | Path) -> None:
    """Raise :class:`NotTrainingData` when the file name marks a held-out split (``val.parquet``,
    ``eval_niah_single_8.parquet``, ``test-2.jsonl``, ...)."""
    held = sorted(set(_words(Path(path).name)) & set(HELD_OUT_WORDS))
    if held:
        raise NotTrainingData(
            f"{path}: the file name marks held-out data ({', '.join(held)}); the warm-up uses training data only"
        )


def record_split(record: dict[str, Any], meta: dict[str, Any] | None) -> str:
    """``"train"`` when the record is provably from training data; :class:`NotTrainingData` otherwise."""
    extra = record.get("extra_info") if isinstance(record.get("extra_info"), dict) else {}
    split = record.get("split", extra.get("split", (meta or {}).get("split")))
    data_file = record.get("data_file") or (meta or {}).get("data_file")
    if split is not None and str(split).lower() not in TRAIN_SPLITS:
        raise NotTrainingData(f"record {record.get('_id')} has split={split!r}; the warm-up uses training data only")
    if data_file:
        check_training_file(data_file)
    if split is None and not (data_file and set(_words(Path(data_file).name)) & set(TRAIN_SPLITS)):
        raise NotTrainingData(
            f"record {record.get('_id')}: neither a split field nor a training data file name "
            f"(data_file={data_file!r}) shows that it comes from training data"
        )
    return "train"


def contains_gold(response: str, answers: Iterable[str]) -> str | None:
    """The first gold answer that occurs in ``response`` as a whole word (case-insensitive), else None.
    ``Castel`` does not match ``Castell``; ``new york`` matches ``New York City``."""
    for answer in answers:
        gold = str(answer).strip()
        if gold_as_whole_word(response, gold):  # the report's whole-word score uses the same test
            return gold
    return None


def rewrite_answer(response: str, gold: str) -> str:
    """The model's answer text, then ``\\boxed{gold}``."""
    return f"{response.rstrip()} \\boxed{{{gold}}}"


def final_prompt_of(record: dict[str, Any]) -> str | None:
    """The final turn's user message: recorded as sent, or rendered from the question and the memory."""
    if record.get("final_prompt"):
        return str(record["final_prompt"])
    style = MEMORY_METHODS.get(str(record.get("method")))
    if style is None or "question" not in record or ("memory" not in record and record.get("num_chunks")):
        return None
    return render_final_prompt(str(record["question"]), record.get("memory"), style=style)


def warmup_row(record: dict[str, Any], methods: Sequence[str] = ("recurrent-boxed",)) -> tuple[dict | None, str]:
    """``(row, "kept")`` for a record the warm-up keeps, else ``(None, reason)``."""
    if record.get("status") != "ok" or not isinstance(record.get("response"), str):
        return None, "not_ok"
    if record.get("method") not in methods:
        return None, "other_method"
    response = record["response"]
    gold = contains_gold(response, as_answer_list(record.get("answers")))
    if gold is None:
        return None, "no_gold"
    if "\\boxed{" in response:  # already boxed: appending a second box would teach two answers
        return None, "already_boxed"
    prompt = final_prompt_of(record)
    if prompt is None:
        return None, "no_final_prompt"
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": rewrite_answer(response, gold)}]
    row = {"messages": messages, "split": "train", "gold": gold, "item_id": record.get("_id")}
    row.update({k: record.get(k) for k in ("task", "length", "label")})
    return row, "kept"


def _record_files(paths: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.rglob("*.jsonl"))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"--records {path}: no such file or folder")
    if not files:
        raise FileNotFoundError(f"no *.jsonl record files under {[str(p) for p in paths]}")
    return files


def build_warmup(
    record_paths: Sequence[str | Path], out: str | Path, methods: Sequence[str] = ("recurrent-boxed",)
) -> dict[str, int]:
    """Write the warm-up conversations of every record file under ``record_paths`` to ``out`` (parquet);
    return the counts (``kept`` and one count per rejection reason). Raises :class:`NotTrainingData` for any
    record not provably from training data (nothing is written then)."""
    import pandas as pd

    rows, counts = [], Counter()
    for path in _record_files(record_paths):
        meta = read_meta(path.with_name(path.name.removesuffix(".jsonl") + ".meta.json"))
        for record in read_records(path).values():
            try:
                record_split(record, meta)
            except NotTrainingData as error:
                raise NotTrainingData(f"{path}: {error}") from None
            row, reason = warmup_row(record, methods)
            counts[reason] += 1
            if row is not None:
                rows.append({**row, "source_file": str(path)})
    if not rows:
        raise ValueError(f"no record kept ({dict(counts)}): nothing to write to {out}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    pd.DataFrame(rows).to_parquet(tmp)
    tmp.replace(out)
    return {"kept": counts.pop("kept", 0), **dict(counts)}


def rollouts(args: argparse.Namespace) -> int:
    """The untrained model's memory-agent rollouts on the training file (the batched harness, one cell)."""
    from transformers import AutoTokenizer

    from serve.inproc_server import build_engine
    from taskutils.memory_eval.agents import AgentConfig
    from taskutils.memory_eval.batched import BatchCell, run_batched
    from taskutils.memory_eval.data import load_eval_items
    from taskutils.memory_eval.runner import CellInfo

    check_training_file(args.data)
    items, _ = load_eval_items(args.data, limit=args.limit)
    engine = build_engine(
        argparse.Namespace(engine=args.engine, model=str(args.model), dtype=args.dtype,
                           max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=4096, enforce_eager=False, seed=0,
                           cudagraph_max_tokens=4096)  # CUDA graphs up to the step budget, as recipe.miniature.evaluate
    )  # fmt: skip
    cells = [
        BatchCell(
            CellInfo("train", "all", f"{LABEL}-s{k}", "untrained", "recurrent-boxed", str(args.data)), items, args.out
        )  # fmt: skip
        for k in range(args.samples)
    ]
    config = AgentConfig(chunk_tokens=args.chunk_tokens, max_memory_tokens=args.max_memory_tokens,
                         max_final_tokens=args.max_final_tokens, temperature=args.temperature, top_p=args.top_p)  # fmt: skip
    try:
        counts = run_batched(cells, engine, AutoTokenizer.from_pretrained(str(args.model)), config)
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
    print(f"[warmup] rollouts: {json.dumps(counts)}")
    return 3 if counts["remaining"] else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.miniature.warmup_data", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("rollouts", help="the untrained model's rollouts on the training file")
    r.add_argument("--data", required=True, help="the TRAINING parquet (make_data's train.parquet)")
    r.add_argument("--model", required=True, help="HF folder of the untrained model")
    r.add_argument("--out", required=True, help="record folder (train_all/untrained-memory-s{k}.jsonl inside)")
    r.add_argument("--samples", type=int, default=1, help="rollouts per training item")
    r.add_argument("--limit", type=int, help="only the first N training items")
    r.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--max-model-len", type=int, default=8192)
    r.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    r.add_argument("--max-num-seqs", type=int, default=512)
    r.add_argument("--chunk-tokens", type=int, default=512, help="the training chunk size")
    r.add_argument("--max-memory-tokens", type=int, default=128)
    r.add_argument("--max-final-tokens", type=int, default=96)
    r.add_argument("--temperature", type=float, default=0.7, help="run_memory_smollm2.sh's rollout temperature")
    r.add_argument("--top-p", type=float, default=1.0)
    b = sub.add_parser("build", help="the SFT conversations from rollout records")
    b.add_argument("--records", nargs="+", required=True, help="record files or folders (*.jsonl)")
    b.add_argument("--out", required=True, help="output parquet (a `messages` column)")
    b.add_argument("--methods", nargs="+", default=["recurrent-boxed"], help="record methods to use")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "rollouts":
            return rollouts(args)
        counts = build_warmup(args.records, args.out, args.methods)
    except NotTrainingData as error:
        print(f"[warmup] refused: {error}", file=sys.stderr)
        return 2
    print(f"[warmup] wrote {args.out}: {json.dumps(counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host-side cost of the batched evaluation runner (taskutils.memory_eval.batched), without a model.

The miniature experiment's H200 run spent most of its evaluation time on the CPU, not the GPU
(9 % GPU utilisation): chunking every document before the first turn (14 min for the untrained
system) and tokenizing every turn's prompts (~4 s per turn with 768 items in flight). This script
measures exactly that host work: the engine answers instantly with a fixed memory, so what is left
is chunking, truncation for the direct baseline, prompt rendering and tokenizing. It runs the same
cells with 1 tokenizing thread and with N (default: all cores), side by side, and prints a table.

    python benchmarks/bench_eval_host.py                          # SmolLM2 tokenizer if cached, else tiny
    python benchmarks/bench_eval_host.py --tokenizer PATH --items 32 --chunks 8 128 --workers 1 16

``--out`` writes the JSON report (``speedup`` = total time with 1 thread / with the last ``--workers``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402  (also puts the repository root on sys.path)

from verl.workers.rollout.base import FixedWeightsEngine, GenerationOutput  # noqa: E402


class InstantEngine(FixedWeightsEngine):
    """A rollout engine that answers every request at once with the same ``reply`` tokens."""

    def __init__(self, reply: list[int]):
        self.reply = reply

    async def generate(self, prompt_ids, params, request_id=None):
        return [GenerationOutput(list(self.reply[: params.max_tokens]), None, "length")]


def default_tokenizer() -> str:
    from verl.utils.smollm import smollm2_path

    path = smollm2_path()
    return str(path) if (path / "tokenizer.json").exists() else str(bc.tiny_model_path())


def make_cells(out_dir: Path, items: int, chunks: list[int], chunk_tokens: int, methods: list[str]):
    """``items`` documents of each length (English text, ~4 characters per token), one cell per method."""
    from taskutils.memory_eval.batched import BatchCell
    from taskutils.memory_eval.data import EvalItem
    from taskutils.memory_eval.runner import CellInfo

    text = "\n\n".join(Path(f).read_text(encoding="utf-8", errors="replace") for f in bc.haystack_files())
    cells = []
    for n in chunks:
        size = n * chunk_tokens * 4
        docs = [(text * (1 + size // max(1, len(text))))[i * 997 % len(text) :][:size] for i in range(items)]
        batch = [EvalItem(i, f"What is the magic number {i}?", doc, ["1234"]) for i, doc in enumerate(docs)]
        for method in methods:
            label = "bench-memory" if method.startswith("recurrent") else "bench-direct"
            cells.append(BatchCell(CellInfo("bench", n, label, "bench", method, "-"), batch, out_dir))
    return cells


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--tokenizer", help="HF folder with a fast tokenizer (default: SmolLM2-135M if converted, else tiny)"
    )
    p.add_argument("--items", type=int, default=16, help="documents per length")
    p.add_argument("--chunks", type=int, nargs="+", default=[8, 64], help="document lengths in chunks")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--memory-tokens", type=int, default=64, help="tokens of every (instant) memory update")
    p.add_argument("--methods", nargs="+", default=["recurrent-boxed", "boxed"], help="memory agent and/or direct")
    p.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    p.add_argument("--out", help="JSON report path")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from taskutils.memory_eval.agents import AgentConfig
    from taskutils.memory_eval.batched import run_batched

    tok = AutoTokenizer.from_pretrained(args.tokenizer or default_tokenizer())
    reply = tok.encode(" The special magic number is 1234, kept in memory." * 20, add_special_tokens=False)
    config = AgentConfig(
        chunk_tokens=args.chunk_tokens,
        max_memory_tokens=args.memory_tokens,
        max_final_tokens=32,
        max_input_tokens=7900,
        max_output_tokens=32,
    )
    rows, runs = [], []
    for workers in args.workers:
        with tempfile.TemporaryDirectory() as tmp:
            cells = make_cells(Path(tmp), args.items, args.chunks, args.chunk_tokens, args.methods)
            engine = InstantEngine(reply)
            t0 = time.perf_counter()
            try:
                counts = run_batched(cells, engine, tok, config, workers=workers, force=True)
            finally:
                engine.shutdown()
            total = time.perf_counter() - t0
        turns = max(1, int(counts["turns"]))
        runs.append({"workers": workers, "total_s": total, **counts})
        rows.append(
            [
                workers,
                counts["prepare_s"],
                counts["tokenize_s"],
                1e3 * counts["tokenize_s"] / turns,
                total,
                runs[0]["total_s"] / total,
            ]
        )
    print(
        f"items {args.items} x lengths {args.chunks} chunks of {args.chunk_tokens} tokens x methods {args.methods}; "
        f"{runs[0]['turns']} turns"
    )
    print(
        bc.markdown_table(
            ["threads", "prepare s", "tokenize s", "tokenize thread-ms/turn", "total s", "speed-up"], rows
        )
    )
    bc.write_json(
        args.out,
        {
            "args": vars(args),
            "runs": runs,
            "speedup": runs[0]["total_s"] / runs[-1]["total_s"],
            "environment": bc.environment(),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

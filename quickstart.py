"""Run the MemAgent memory loop on a document against any OpenAI-compatible endpoint.

    # local vLLM server (GPU: `vllm serve`; CPU build: python -m serve --model PATH):
    python -m serve --model BytedTsinghua-SIA/RL-MemoryAgent-14B --tp 2 &
    python quickstart.py --model BytedTsinghua-SIA/RL-MemoryAgent-14B

    # an online service (plain or Azure deployment URL):
    export URL=https://{endpoint}/v1                                   # or
    export URL=https://{endpoint}/openai/deployments/gpt-4o-2024-11-20
    export API_KEY=...
    python quickstart.py --model gpt-4o-2024-11-20 --context-file paper.txt --question "Who ...?"

Without ``--context-file`` a short built-in example document and question are used (read in
256-token chunks so the memory visibly evolves). Each chunk's progress and the memory after it are
printed, then the final answer. Chunks are measured with ``--tokenizer`` (or ``--model`` when it is
a local folder) if given, else approximately (4 characters per token).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from recurrent.prompts import FINAL_STYLES
from taskutils.memory_eval.agents import AgentConfig, MemoryAgentClient
from taskutils.memory_eval.chunking import iter_chunks, load_tokenizer
from taskutils.memory_eval.client import (
    EndpointError,
    RequestFailed,
    RetryPolicy,
    check_endpoint,
    endpoint_from_env,
    make_client,
)
from verl.utils.reward_score.lenient import extract_prediction

EXAMPLE_QUESTION = "Which town did the keeper of the Harrow Point lighthouse move to after it was automated?"
EXAMPLE_ANSWER = "Port Ellery"
EXAMPLE_DOCUMENT = """\
Document 1:
Harrow Point Lighthouse
The Harrow Point lighthouse stands on a granite spur at the northern end of Saltmere Bay. It was first lit
in 1871 with a fixed white oil lamp, replaced in 1903 by a rotating lens that gave one white flash every
ten seconds. The tower is 31 metres tall and is painted in red and white bands so that fishermen can
recognise it in daylight. For most of its history it was run by a single keeper and an assistant, who
lived in two small cottages at the foot of the tower and kept a garden of potatoes and kale behind a
stone wall that still stands today.

Document 2:
Saltmere Bay fisheries
Herring and mackerel were the main catch of the Saltmere Bay boats until the middle of the twentieth
century. The village of Calder Rock, on the southern shore, had a curing yard and a small boatyard. Its
harbour was too shallow for larger vessels, so the fish were carried by cart to the railway at Brennock.
When the railway branch closed in 1958, most of the curing trade moved away from the bay.

Document 3:
Edmund Vasse
Edmund Vasse was the last keeper of the Harrow Point lighthouse. He arrived as assistant keeper in 1949
and became principal keeper in 1956. He kept detailed weather logs, which are now held in the county
archive, and he was known for rescuing the crew of the trawler Morning Gull during a storm in 1962.
When the lighthouse was automated in 1978 and the keepers were withdrawn, Vasse moved with his wife to
the harbour town of Port Ellery, where he worked as a harbour pilot until he retired in 1985.

Document 4:
Port Ellery
Port Ellery is a harbour town about forty kilometres west of Saltmere Bay. It grew around a deep-water
quay built in 1890 and is known for its covered fish market and its annual regatta, held on the first
Saturday of August. The town museum has a room about the lighthouses of the coast, including a lens
from Harrow Point and a copy of one of Edmund Vasse's weather logs.

Document 5:
Brennock
Brennock is an inland market town on the river Tarn. Its railway station opened in 1866 and was the
terminus of the Saltmere branch line until that line closed. The town is known for its livestock market
and for a bridge of seven arches that carries the old coach road over the river.
"""
EXAMPLE_CHUNK_TOKENS = 256


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="MemAgent quickstart: read a document chunk by chunk, then answer.")
    p.add_argument("--model", required=True, help="model name as served (e.g. the vLLM --served-model-name)")
    p.add_argument("--context-file", help="text file to read (default: a built-in example document)")
    p.add_argument("--question", help="question to answer (default: the built-in example's question)")
    p.add_argument("--url", help="endpoint base URL (default: $URL, else http://127.0.0.1:8000/v1)")
    p.add_argument("--tokenizer", help="local tokenizer folder for exact token chunks (default: --model if a folder)")
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default 5000; 256 for the example)")
    p.add_argument("--max-memory-tokens", type=int, default=1024, help="max new tokens per memory update")
    p.add_argument("--max-final-tokens", type=int, default=1024, help="max new tokens of the final answer")
    p.add_argument(
        "--final-style", choices=sorted(FINAL_STYLES), default="boxed", help="final prompt (training: boxed)"
    )
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--max-attempts", type=int, default=4, help="attempts per request on 429/5xx/timeouts")
    return p


def _indent(text: str, width: int = 100) -> str:
    lines = []
    for line in text.strip().splitlines() or [""]:
        lines.extend(textwrap.wrap(line, width) or [""])
    return "\n".join("    " + line for line in lines)


async def run(args: argparse.Namespace) -> int:
    """The quickstart; returns the process exit code."""
    if args.context_file:
        if not args.question:
            print("error: --question is required with --context-file", file=sys.stderr)
            return 2
        try:
            document = Path(args.context_file).read_text(encoding="utf-8")
        except OSError as exc:
            print(f"error: cannot read --context-file {args.context_file!r}: {exc}", file=sys.stderr)
            return 2
        chunk_tokens = args.chunk_size or 5000
    else:
        document = EXAMPLE_DOCUMENT
        chunk_tokens = args.chunk_size or EXAMPLE_CHUNK_TOKENS
    question = args.question or EXAMPLE_QUESTION
    try:
        endpoint = endpoint_from_env(args.url)
    except EndpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer_path = args.tokenizer or (args.model if Path(args.model).is_dir() else None)
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    client = make_client(endpoint, timeout=args.timeout)
    try:
        try:
            await check_endpoint(client, endpoint, args.model)
        except EndpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        config = AgentConfig(
            chunk_tokens=chunk_tokens,
            max_memory_tokens=args.max_memory_tokens,
            max_final_tokens=args.max_final_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
        )
        total = sum(1 for _ in iter_chunks(document.strip(), chunk_tokens, tokenizer))
        unit = "tokens" if tokenizer is not None else "tokens, approximated as 4 characters each"
        print(f"endpoint: {endpoint.base_url}  model: {args.model}")
        print(f"question: {question}")
        print(f"document: {len(document)} characters -> {total} chunk(s) of up to {chunk_tokens} {unit}\n")

        def on_step(kind: str, index: int, chunk: str, text: str) -> None:
            if kind == "chunk":
                print(f"[chunk {index + 1}/{total}] read {len(chunk)} characters; memory is now:")
                print(_indent(text), flush=True)
            else:
                print(f"\n[final] answering from the memory ({args.final_style} prompt)", flush=True)

        agent = MemoryAgentClient(
            client, args.model, config, tokenizer, args.final_style, RetryPolicy(max_attempts=args.max_attempts)
        )
        try:
            output = await agent.run(question, document, on_step=on_step)
        except RequestFailed as exc:
            hint = " (check --model: unknown model or deployment)" if "HTTP 404" in str(exc) else ""
            print(f"error: request to {endpoint.base_url} failed: {exc}{hint}", file=sys.stderr)
            return 1
    finally:
        await client.close()
    method = "recurrent-boxed" if args.final_style == "boxed" else "recurrent"
    answer = extract_prediction(output.response, method)
    print("\nfinal response:")
    print(_indent(output.response))
    print(f"\nanswer: {answer if answer is not None else '(no answer found in the response)'}")
    print(f"({output.num_chunks} chunks, {output.stats.requests} requests, {output.elapsed_s:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

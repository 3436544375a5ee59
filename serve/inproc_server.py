"""An OpenAI-compatible chat endpoint over the project's own rollout engine, in one process.

    python -m serve.inproc_server --model /models/m --port 8000 [--engine vllm|hf] [--gpu-memory-utilization 0.2]

``vllm serve`` runs vLLM's engine core in a child process. Where that multi-process engine does not
work (seen on some sandboxed GPU machines, where it hangs) or where the exact engine used in
training should answer, this server puts :class:`~verl.workers.rollout.vllm_engine.VLLMRolloutEngine`
(its in-process backend, continuous batching) or the HF engine behind
:class:`~recurrent.async_utils.ChatCompletionProxy` and :class:`~recurrent.chat_server.ChatServer`:
``POST /v1/chat/completions`` (non-streaming), ``GET /v1/models``, ``GET /health``. The chat template
is the tokenizer's own (rendered like ``apply_chat_template``). Stop it with SIGINT or SIGTERM.

``serve.vllm_server.ServerSpec(backend="inproc")`` launches it like ``vllm serve`` (so the evaluation
harness can use it with ``--serve-backend inproc``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

logger = logging.getLogger("serve.inproc")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve.inproc_server", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="local HF model folder")
    p.add_argument("--served-model-name", help="model id clients send (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="rollout engine behind the endpoint")
    p.add_argument("--max-model-len", type=int, help="prompt + completion token limit (default: the model's)")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM: fraction of GPU memory to use")
    p.add_argument("--max-num-seqs", type=int, help="vLLM: sequences batched at once")
    p.add_argument("--max-num-batched-tokens", type=int, help="vLLM: tokens per scheduler step")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM: no CUDA graphs")
    p.add_argument(
        "--cudagraph-max-tokens",
        type=int,
        help="vLLM: capture CUDA graphs for steps of up to this many tokens (default: vLLM's, 512)",
    )
    p.add_argument("--seed", type=int, default=0, help="engine sampling seed")
    p.add_argument("--default-max-tokens", type=int, default=1024, help="when a request gives no max_tokens")
    return p


def build_engine(args: argparse.Namespace):
    """The rollout engine named by ``args.engine`` for ``args.model``."""
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from verl.workers.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(
            args.model, dtype=args.dtype, max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
            enable_sleep_mode=False, seed=args.seed, logprobs_mode=None,
            engine_kwargs=getattr(args, "engine_kwargs", None),
            cudagraph_max_tokens=getattr(args, "cudagraph_max_tokens", None),
        )  # fmt: skip
    from verl.workers.rollout.hf_engine import HFRolloutEngine

    dtype = None if args.dtype == "auto" else args.dtype  # None: the checkpoint's dtype
    return HFRolloutEngine(args.model, dtype=dtype, max_model_len=args.max_model_len or 4096)  # GPU if there is one


def record_sigint(stop: threading.Event) -> None:
    """SIGINT while the server starts: set ``stop`` and raise KeyboardInterrupt, as Python's default handler does.

    Python can swallow that KeyboardInterrupt: raised inside a callback whose errors it only prints ("Exception
    ignored in: <function _get_module_lock.<locals>.cb ...>", importlib's module-lock callback, seen when the
    launcher's SIGINT came while this process imported transformers). The start-up then went on, the server
    served, and ``VLLMServerGroup.stop`` waited out its 30 s grace before its SIGKILL. With the signal recorded,
    ``main`` stops as soon as the server is up instead."""

    def handler(signum, frame):
        stop.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    stop = threading.Event()
    record_sigint(stop)
    from transformers import AutoTokenizer

    from recurrent.async_utils import ChatCompletionProxy
    from recurrent.chat_server import ChatServer

    name = args.served_model_name or args.model
    engine = build_engine(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # max_records=1: an evaluation endpoint never maps messages back to engine turns (training does)
    proxy = ChatCompletionProxy(
        engine, tokenizer, model_name=name, default_max_tokens=args.default_max_tokens, max_records=1
    )
    server = ChatServer(proxy, host=args.host, port=args.port).start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"[serve.inproc] {name} ({args.engine}) at {server.url}", flush=True)
    stop.wait()
    logger.info("stopping")
    proxy.close()
    shutdown = getattr(engine, "shutdown", None)
    if callable(shutdown):
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

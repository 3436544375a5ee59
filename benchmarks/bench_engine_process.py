"""What generation beside training costs each side, with the rollout engine in the training process or in its own.

One-step-off training (``trainer.rollout_overlap``) runs the next rollout while the actor updates. With the engine in
the worker's process (``rollout.engine_process=worker``) its engine thread and the training thread share one Python
interpreter lock; with ``engine_process=child`` (``verl/workers/rollout/child_process.py``) the engine has a process of
its own on the same device. This benchmark measures, side by side in one run, for each placement:

* a training loop alone: ``--train-iters`` iterations of forward + backward + AdamW of the model on
  ``--train-rows x --train-len`` tokens (a plain module in this process, bf16 on a GPU, fp32 on CPU);
* one generation call alone: ``generate_batch`` of ``--batch`` random prompts of ``--prompt-len`` tokens,
  ``--new-tokens`` new tokens each (seeded sampling, as training rollouts);
* the two at once: the generation calls loop in a thread of this process (the worker's rollout thread) while the
  training loop runs; each side's time per iteration / call during the overlap, and its slowdown against alone.

The engines are built one after the other (the in-process one shut down before the child starts), each with
``--gpu-memory-utilization`` of the GPU. With ``--engine-reserved-sms K1 K2 ...`` the in-process engine's rows repeat
for each ``K``: the training loop then runs with ``K`` of the GPU's SMs kept free for the engine
(``rollout.engine_reserved_sms``, a CUDA green context; ``verl/workers/training_sms.py``), alone and beside
generation; 0 is the whole GPU. ``--engine-stream high_priority`` puts the engine thread on its own high-priority
stream, as the trainer does with one-step-off.

    # one H200, the 1.5B memory turn beside the 1.5B update, SMs kept for the engine side by side
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/bench_engine_process.py --shape qwen2.5-1.5b --device cuda \
        --placements worker --engine-stream high_priority --engine-reserved-sms 0 16 32 48 --batch 32 \
        --prompt-len 6000 --new-tokens 256 --train-rows 2 --train-len 8192 --train-iters 10
    # one H200, the 135M shape at the memory agent's rollout sizes
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/bench_engine_process.py --shape smollm2-135m --device cuda \\
        --batch 128 --prompt-len 704 --new-tokens 128 --train-rows 8 --train-len 4096 --train-iters 20
    # CPU smoke run (HF engine, tiny model)
    python benchmarks/bench_engine_process.py --shape tiny --device cpu --rollout hf --batch 2 --prompt-len 16 \\
        --new-tokens 4 --train-rows 2 --train-len 32 --train-iters 2

Prints a markdown table and writes the numbers as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import bench_common as bc
import torch
from bench_rollout import vllm_engine_args

PLACEMENTS = ("worker", "child")


def engine_kwargs(args: argparse.Namespace, model_path: Path, dtype: str, placement: str) -> dict[str, Any]:
    """The rollout engine's arguments (picklable: the child process gets the same)."""
    max_len = args.prompt_len + args.new_tokens
    if args.rollout == "hf":
        return dict(
            model=str(model_path), device=args.device, dtype=dtype, max_batch_size=args.batch, max_model_len=max_len
        )
    options = {"engine_stream": args.engine_stream} if placement == "worker" and args.device == "cuda" else {}
    return vllm_engine_args(
        model_path, dtype, max_len, max(args.batch, 1), args.device != "cuda", args.gpu_memory_utilization, **options
    )


def build_engine(placement: str, name: str, kwargs: dict[str, Any]) -> Any:
    from verl.workers.rollout.base import get_rollout_engine
    from verl.workers.rollout.child_process import ChildProcessEngine

    return ChildProcessEngine(name, kwargs) if placement == "child" else get_rollout_engine(name, **kwargs)


class TrainLoop:
    """Forward + backward + AdamW of ``model`` on one fixed batch of random tokens; its kernels on the SMs of
    ``sms`` (all of them by default)."""

    def __init__(self, model: torch.nn.Module, rows: int, length: int, vocab: int, device: str):
        from verl.workers.training_sms import TrainingSMs

        self.model, self.device = model, device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        self.ids = torch.randint(2, vocab, (rows, length), generator=torch.Generator().manual_seed(0)).to(device)
        self.sms = TrainingSMs(0, None)

    def step(self) -> None:
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, iters: int) -> float:
        """Seconds per iteration over ``iters`` iterations (the device's queue drained at both ends)."""
        bc.device_sync(self.device)
        start = time.perf_counter()
        with self.sms.scope():
            for _ in range(iters):
                self.step()
        bc.device_sync(self.device)
        return (time.perf_counter() - start) / iters


def overlapped(train: TrainLoop, iters: int, generate) -> tuple[float, list[float]]:
    """The training loop while ``generate()`` loops in another thread: seconds per training iteration, and the
    seconds of each generation call that started and finished while training ran (at least the first one)."""
    calls: list[tuple[float, float]] = []
    started, stop = threading.Event(), threading.Event()

    def loop() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            started.set()
            generate()
            calls.append((t0, time.perf_counter()))

    thread = threading.Thread(target=loop, name="bench-generation", daemon=True)
    thread.start()
    started.wait()
    per_iter = train.run(iters)
    train_end = time.perf_counter()
    stop.set()
    thread.join()
    inside = [end - t0 for t0, end in calls if end <= train_end]
    if not inside:  # one call outlasted the training: it is the only one there is
        inside = [calls[0][1] - calls[0][0]]
    return per_iter, inside


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from verl.workers.rollout.base import SamplingParams

    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    model_path = bc.model_folder(args.model, args.shape, dtype)
    vocab = bc.prompt_vocab_limit(model_path)
    prompts = bc.random_prompts(args.batch, args.prompt_len, vocab, bc.special_ids(model_path))
    sampling = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, seed=1, logprobs=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(args.device)
    train = TrainLoop(model, args.train_rows, args.train_len, vocab, args.device)
    train.run(args.warmup_iters)
    from verl.workers.training_sms import TrainingSMs

    rows = []
    train_whole_gpu = None  # the training loop alone on the whole GPU (the first in-process measurement)
    for placement in args.placements:
        engine = build_engine(placement, args.rollout, engine_kwargs(args, model_path, dtype, placement))
        try:

            def generate(engine: Any = engine) -> int:
                return sum(len(o[0].token_ids) for o in engine.generate_batch(prompts, sampling))

            generate()  # warm-up (graphs, caches)
            gen_times, tokens = bc.time_calls(generate, args.repeats, args.device, warmup=0)
            gen_alone = bc.median(gen_times)
            splits = args.engine_reserved_sms if placement == "worker" else [0]
            for reserved in splits:
                device = torch.cuda.current_device() if args.device == "cuda" else None
                train.sms = TrainingSMs(reserved, device)
                train.run(1)  # builds the green context
                train_alone = train.run(args.train_iters)
                train_beside, gen_beside = overlapped(train, args.train_iters, generate)
                if reserved == 0 and train_whole_gpu is None:
                    train_whole_gpu = train_alone
                rows.append(
                    {
                        "placement": placement,
                        "engine_reserved_sms": reserved,
                        "training_sms": train.sms.num_sms,
                        "train_s_per_iter_alone": train_alone,
                        "train_s_per_iter_beside_generation": train_beside,
                        "train_slowdown": train_beside / train_alone,
                        "gen_s_alone": gen_alone,
                        "gen_s_beside_training": bc.median(gen_beside),
                        "gen_calls_beside_training": len(gen_beside),
                        "gen_slowdown": bc.median(gen_beside) / gen_alone,
                        "generated_tokens": tokens,
                    }
                )
                r = rows[-1]
                print(
                    f"[bench_engine_process] {placement}, {reserved} SMs kept: train {r['train_slowdown']:.2f}x, "
                    f"gen {r['gen_slowdown']:.2f}x ({r['gen_s_alone']:.2f} -> {r['gen_s_beside_training']:.2f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                if args.device == "cuda":  # the next split's training runs on another stream: its own cached pool
                    torch.cuda.empty_cache()
        finally:
            engine.shutdown()
    for row in rows:  # against the training loop alone on the whole GPU
        if train_whole_gpu:
            row["train_beside_vs_whole_gpu_alone"] = row["train_s_per_iter_beside_generation"] / train_whole_gpu
    return {
        "benchmark": "bench_engine_process",
        "model": str(model_path),
        "device": bc.device_name(args.device),
        "rollout": args.rollout,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "engine_stream": args.engine_stream,
        "train_tokens_per_iter": args.train_rows * args.train_len,
        "train_iters": args.train_iters,
        "results": rows,
        "env": bc.environment(),
    }


def table(report: dict[str, Any]) -> str:
    rows = [
        [
            r["placement"],
            str(r.get("engine_reserved_sms", 0)),
            f"{1000 * r['train_s_per_iter_alone']:.1f}",
            f"{1000 * r['train_s_per_iter_beside_generation']:.1f}",
            f"{r['train_slowdown']:.2f}x",
            f"{r['gen_s_alone']:.3f}",
            f"{r['gen_s_beside_training']:.3f}",
            f"{r['gen_slowdown']:.2f}x",
        ]
        for r in report["results"]
    ]
    head = (
        f"Generation beside training ({report['model']}, {report['device']}, rollout={report['rollout']}: "
        f"{report['batch']} prompts x {report['prompt_len']} tokens, {report['new_tokens']} new; training "
        f"{report['train_tokens_per_iter']} tokens an iteration)\n\n"
    )
    return head + bc.markdown_table(
        [
            "engine process",
            "SMs kept for the engine",
            "train ms/iter alone",
            "beside generation",
            "train slowdown",
            "gen s/call alone",
            "beside training",
            "gen slowdown",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bc.add_model_args(p)
    p.add_argument("--rollout", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS)
    p.add_argument("--batch", type=int, default=128, help="prompts per generation call")
    p.add_argument("--prompt-len", type=int, default=704)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed generation calls alone (after a warm-up)")
    p.add_argument("--train-rows", type=int, default=8)
    p.add_argument("--train-len", type=int, default=4096)
    p.add_argument("--train-iters", type=int, default=20, help="timed training iterations, alone and beside")
    p.add_argument("--warmup-iters", type=int, default=2)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument(
        "--engine-stream",
        default="shared",
        choices=["shared", "high_priority"],
        help="the in-process engine thread's CUDA stream (rollout.engine_stream; one-step-off's default is high_priority)",
    )
    p.add_argument(
        "--engine-reserved-sms",
        type=int,
        nargs="+",
        default=[0],
        help="in-process rows for each: SMs kept free of the training loop for the engine (rollout.engine_reserved_sms)",
    )
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    report = measure(args)
    print(table(report))
    bc.write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

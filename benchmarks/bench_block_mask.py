"""Building flex_attention's ``BlockMask`` for one packed micro-batch (``verl/workers/actor/packed_block_mask.py``).

The actor builds one mask per micro-batch of every training pass (old and reference log-probs, the update). With
shared prompts (``model.share_prompts``, default on; flex_attention on CUDA) that is ``shared_prompt_block_mask``;
without, ``packed_block_mask``. This times both against torch's own ``create_block_mask(..., _compile=False)`` of
the same element mask (which evaluates all ``T x T`` query/key pairs; the shared-prompt builder did the same until
it tested intervals against blocks), for packed micro-batches of MemAgent's layout at several token budgets:

* each piece laid out next is, with probability ``--shared-frac``, a group of ``--group`` rows whose first turn
  shares one prompt (``--prompt`` tokens, one segment, then each row's response of up to ``--response`` tokens),
  else a row alone (its own prompt + response: the later turns, whose memories differ);
* the budget filled to exactly ``--tokens``, the last piece cut (as ``padded_packed_length`` pads).

Each setting runs ``--repeats`` times after one warm-up; the median is reported (ms), with the ratio to the
reference where it ran (``--reference-max``: torch's mask of ``T x T`` booleans, 17.2 GB at 131,072 tokens) and a
check that the fields are equal. Each row also gives the block fill: of the element pairs flex_attention computes
(whole 128 x 128 blocks), the share the mask lets attend, for the shared and the plain mask, beside the share for
causal 128-token tiles per document (roughly a variable-length kernel's work).

Examples:

    # CPU, up to 32K tokens against torch's builder, 131K ours only
    python benchmarks/bench_block_mask.py --device cpu --tokens 8192 16384 32768 131072 --json /tmp/block_mask.json
    # one GPU: the 135M recipe's budgets (update 65,536, log-probs 131,072 tokens)
    python benchmarks/bench_block_mask.py --device cuda --tokens 16384 65536 131072 --reference-max 65536
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

from verl.workers.actor.packed_block_mask import packed_block_mask, shared_prompt_block_mask  # noqa: E402

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def memagent_layout(tokens: int, prompt: int, response: int, group: int, shared_frac: float, seed: int):
    """``segment_ids``, ``prefix_ids`` (shared prompts) and ``position_ids`` (one document per segment, for the
    plain packed mask) of one packed micro-batch of exactly ``tokens`` tokens (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, prefixes = [], []  # per segment
    while sum(lengths) < tokens:
        first = len(lengths)
        if torch.rand((), generator=gen) < shared_frac:
            lengths.append(prompt)
            prefixes.append(first)
            for _ in range(group):
                lengths.append(int(torch.randint(1, response + 1, (1,), generator=gen)))
                prefixes.append(first)
        else:
            lengths.append(prompt + int(torch.randint(1, response + 1, (1,), generator=gen)))
            prefixes.append(first)
    while sum(lengths) - lengths[-1] >= tokens:
        lengths.pop(), prefixes.pop()
    lengths[-1] -= sum(lengths) - tokens
    counts = torch.tensor(lengths)
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    prefix_ids = torch.repeat_interleave(torch.tensor(prefixes), counts)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return segment_ids, prefix_ids, position_ids


def attended_pairs(segment_ids: torch.Tensor, prefix_ids: torch.Tensor) -> int:
    """Query/key pairs the shared-prompt mask lets attend: each query sees its own segment up to itself and, when its
    prefix is another segment (a shared prompt), all of that segment; ``prefix_ids == segment_ids`` gives plain
    causal documents."""
    lengths = torch.bincount(segment_ids)
    starts = torch.cumsum(lengths, 0) - lengths
    own = torch.arange(segment_ids.numel(), device=segment_ids.device) - starts[segment_ids] + 1
    prefix = torch.where(prefix_ids != segment_ids, lengths[prefix_ids], 0)
    return int((own + prefix).sum())


def block_fill(block_mask, pairs: int) -> float:
    """Share of the element pairs flex_attention computes (every listed block, partial or full, is a whole
    ``BLOCK_SIZE`` square) that the mask lets attend."""
    blocks = int(block_mask.kv_num_blocks.sum())
    if block_mask.full_kv_num_blocks is not None:
        blocks += int(block_mask.full_kv_num_blocks.sum())
    q_block, kv_block = block_mask.BLOCK_SIZE
    return pairs / (blocks * q_block * kv_block)


def document_tile_fill(segment_ids: torch.Tensor, tile: int = 128) -> float:
    """The same share for a kernel that tiles each causal document on its own (roughly what a variable-length
    kernel computes): ``tile``-square tiles on or below each document's diagonal."""
    lengths = torch.bincount(segment_ids)
    pairs = int((lengths * (lengths + 1) // 2).sum())
    tiles = -(-lengths // tile)
    return pairs / (int((tiles * (tiles + 1) // 2).sum()) * tile * tile)


def reference_mask(segment_ids: torch.Tensor, prefix_ids: torch.Tensor, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, kv):
        return (q >= kv) & ((segment_ids[kv] == segment_ids[q]) | (segment_ids[kv] == prefix_ids[q]))

    length = segment_ids.numel()
    return create_block_mask(mask_mod, 1, None, length, length, device=device, _compile=False)


def timed(fn, fn_args: tuple, device: str, repeats: int):
    """``fn(*fn_args)`` and the median of ``repeats`` timed calls after one warm-up (seconds)."""
    fn(*fn_args)
    bc.device_sync(device)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn(*fn_args)
        bc.device_sync(device)
        seconds.append(time.perf_counter() - t0)
    return result, bc.median(seconds)


def run(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    rows = []
    for tokens in args.tokens:
        segment_ids, prefix_ids, position_ids = (
            t.to(args.device)
            for t in memagent_layout(tokens, args.prompt, args.response, args.group, args.shared_frac, args.seed)
        )
        shared, shared_s = timed(shared_prompt_block_mask, (segment_ids, prefix_ids), args.device, args.repeats)
        plain, plain_s = timed(packed_block_mask, (position_ids,), args.device, args.repeats)
        row = {
            "tokens": tokens,
            "blocks": -(-tokens // 128),
            "shared_prompt_tokens": int((prefix_ids != segment_ids).sum()),
            "shared_prompt_block_mask_ms": 1e3 * shared_s,
            "packed_block_mask_ms": 1e3 * plain_s,
            # attended pairs / computed pairs: flex's blocks with shared prompts and plain (one document per
            # segment), and per-document causal tiles for comparison
            "shared_block_fill": block_fill(shared, attended_pairs(segment_ids, prefix_ids)),
            "packed_block_fill": block_fill(plain, attended_pairs(segment_ids, segment_ids)),
            "document_tile_fill": document_tile_fill(segment_ids),
            "reference_ms": None,
            "vs_reference": None,
            "equal_to_reference": None,
        }
        if tokens <= args.reference_max:
            reference, reference_s = timed(
                reference_mask, (segment_ids, prefix_ids, args.device), args.device, args.repeats
            )
            row["reference_ms"] = 1e3 * reference_s
            row["vs_reference"] = reference_s / shared_s
            row["equal_to_reference"] = all(torch.equal(getattr(shared, f), getattr(reference, f)) for f in FIELDS)
        rows.append(row)
        print(f"[bench_block_mask] {tokens} tokens: {row}", file=sys.stderr)
    return {
        "benchmark": "block_mask",
        "device": bc.device_name(args.device),
        "layout": {k: getattr(args, k) for k in ("prompt", "response", "group", "shared_frac", "seed")},
        "repeats": args.repeats,
        "threads": args.threads if args.device == "cpu" else None,
        "results": rows,
        "env": bc.environment(),
    }


def table(report: dict) -> str:
    def ms(value):
        return "" if value is None else f"{value:,.1f}"

    def fill(row):  # reports written before 2026-12-06 have no block fill
        keys = ("shared_block_fill", "packed_block_fill", "document_tile_fill")
        return " / ".join(f"{row[k]:.0%}" for k in keys) if all(k in row for k in keys) else ""

    return bc.markdown_table(
        ["tokens", "blocks", "shared prompt tokens", "shared-prompt mask ms", "plain packed mask ms",
         "torch create_block_mask ms", "vs torch", "equal", "block fill shared / plain / per-document tiles"],
        [
            [f"{r['tokens']:,}", r["blocks"], f"{r['shared_prompt_tokens']:,}", ms(r["shared_prompt_block_mask_ms"]),
             ms(r["packed_block_mask_ms"]), ms(r["reference_ms"]),
             "" if r["vs_reference"] is None else f"{r['vs_reference']:.1f}x",
             "" if r["equal_to_reference"] is None else str(r["equal_to_reference"]),
             fill(r)]
            for r in report["results"]
        ],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768], help="packed micro-batch sizes")
    p.add_argument("--prompt", type=int, default=700, help="prompt tokens (135M recipe: chunk 512 + memory + task)")
    p.add_argument("--response", type=int, default=128, help="most response tokens (the memory budget)")
    p.add_argument("--group", type=int, default=8, help="rows sharing one prompt (GRPO n)")
    p.add_argument("--shared-frac", type=float, default=0.12, help="chance that a piece is a group sharing a prompt")
    p.add_argument("--reference-max", type=int, default=32768, help="largest T timed with torch's builder")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    for name in ("tokens", "prompt", "response", "group", "repeats"):
        values = getattr(args, name) if name == "tokens" else [getattr(args, name)]
        if min(values) < 1:
            p.error(f"--{name} must be at least 1, got {min(values)}")
    if not 0.0 <= args.shared_frac <= 1.0:
        p.error(f"--shared-frac must be within [0, 1], got {args.shared_frac}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    report = run(args)
    bc.write_json(args.json, report)
    print(f"\nBlockMask build, one packed micro-batch ({report['device']}, median of {args.repeats})\n")
    print(table(report))
    return report


if __name__ == "__main__":
    main()

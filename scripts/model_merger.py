"""Merge a checkpoint's model shards into a Hugging Face folder (safetensors + config + tokenizer files).

    python scripts/model_merger.py --local_dir <root>/global_step_N/actor --target_dir <hf_out>
    python scripts/model_merger.py merge --backend fsdp --local_dir <root>/global_step_N/actor --target_dir <hf_out>

``--local_dir`` may also be the ``global_step_N`` folder (its ``actor/`` is used). The output loads with
``AutoModelForCausalLM.from_pretrained(<hf_out>)`` and with vLLM. Config and tokenizer come from the
checkpoint's ``actor/huggingface/`` (written at save time), or from ``--hf_model_path`` when that is missing.
Runs on CPU in one process, whatever the number of ranks that wrote the checkpoint. A LoRA checkpoint
(``actor_rollout_ref.model.lora_rank > 0``) is written merged (``W + lora_alpha / r * B @ A``): a plain model
of the base architecture, no adapter files.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (verl's names where they exist)."""
    parser = argparse.ArgumentParser(prog="model_merger", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backend",
        default="fsdp",
        choices=["fsdp", "megatron"],
        help="checkpoint type (only fsdp: DCP shards written by save_model_shards)",
    )
    parser.add_argument("--local_dir", required=True, help="checkpoint folder: global_step_N/actor or global_step_N")
    parser.add_argument("--target_dir", required=True, help="output Hugging Face folder")
    parser.add_argument(
        "--hf_model_path",
        default=None,
        help="base model folder for config/tokenizer when the checkpoint has no huggingface/",
    )
    parser.add_argument(
        "--dtype", default="auto", help="output weight dtype: auto (the config's), float32, bfloat16, float16"
    )
    parser.add_argument("--trust_remote_code", action="store_true")
    parser.add_argument(
        "--tie-word-embedding",
        dest="tie_word_embedding",
        action="store_true",
        help="accepted for verl compatibility; tying follows the config's tie_word_embeddings",
    )
    parser.add_argument(
        "--is-value-model", dest="is_value_model", action="store_true", help="not supported (critic checkpoints)"
    )
    parser.add_argument("--hf_upload_path", default=None, help="not supported (no uploads from this tool)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Run the merger; returns the exit status (0 ok, 1 bad checkpoint, 2 bad arguments)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "merge":
        args_list = args_list[1:]
    elif args_list and args_list[0] == "test":
        print("model_merger: error: the 'test' subcommand is not supported", file=sys.stderr)
        return 2
    args = build_parser().parse_args(args_list)
    unsupported = {
        "--backend megatron": args.backend != "fsdp",
        "--is-value-model": args.is_value_model,
        "--hf_upload_path": args.hf_upload_path is not None,
    }
    for option, used in unsupported.items():
        if used:
            print(f"model_merger: error: {option} is not supported", file=sys.stderr)
            return 2

    from verl.utils.checkpoint import CheckpointError, merge_checkpoint_to_hf

    try:
        target = merge_checkpoint_to_hf(
            args.local_dir,
            args.target_dir,
            dtype=args.dtype,
            hf_model_path=args.hf_model_path,
            trust_remote_code=args.trust_remote_code,
        )
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"model_merger: error: {exc}", file=sys.stderr)
        return 1
    print(f"merged {args.local_dir} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Turn local GSM8K files into the tool-calling training schema of ``recurrent/impls/async_tool_gsm8k.py``.

Nothing is downloaded: give the GSM8K split files you have (parquet, jsonl or json with
``question`` and ``answer`` columns; the answer ends with ``#### <number>``)::

    python examples/data_preprocess/gsm8k_multiturn_w_tools.py \
        --train_file gsm8k/train.jsonl --test_file gsm8k/test.jsonl --local_dir data/tool_gsm8k

writes ``train.parquet`` / ``test.parquet`` with one row per problem:

* ``data_source`` = ``openai/gsm8k``; ``ability`` = ``math``;
* ``prompt``: a system message asking to check the answer with the ``calc_gsm8k_reward`` tool,
  and the user message (question + "think step by step" instruction);
* ``reward_model`` = ``{"style": "rule", "ground_truth": "<number>"}``;
* ``extra_info``: ``split``, ``index``, ``answer``, ``question``, ``need_tools_kwargs=True`` and
  ``tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd

DATA_SOURCE = "openai/gsm8k"
SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step. Before you give the final answer, check "
    "it at least once with the `calc_gsm8k_reward` tool and revise it if the tool says it is wrong. "
    "Write the final answer as `#### <answer>`."
)
INSTRUCTION = "Think step by step, then give the final answer after `####`."

_GOLD = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def extract_ground_truth(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer, without thousands separators.

    Raises:
        ValueError: when the answer has no ``#### <number>`` line.
    """
    match = _GOLD.search(answer or "")
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def read_gsm8k(path: str | Path) -> pd.DataFrame:
    """Read a GSM8K split (parquet/jsonl/json) and check it has ``question`` and ``answer``."""
    from verl.utils.dataset.rl_dataset import read_rows

    df = read_rows(str(path)).drop(columns=["_source_file"])
    missing = {"question", "answer"} - set(df.columns)
    if missing:
        raise ValueError(f"{path}: missing column(s) {sorted(missing)}; found {sorted(df.columns)}")
    return df


def make_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One training row in the tool-calling schema (see the module docstring)."""
    gold = extract_ground_truth(answer)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{question} {INSTRUCTION}"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gold},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": answer,
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": gold}}},
        },
    }


def convert(path: str | Path, split: str) -> pd.DataFrame:
    """Convert one GSM8K split file to the training schema."""
    df = read_gsm8k(path)
    rows = [make_row(str(q), str(a), split, i) for i, (q, a) in enumerate(zip(df["question"], df["answer"]))]
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train_file", help="GSM8K train split (parquet/jsonl/json)")
    parser.add_argument("--test_file", help="GSM8K test split (parquet/jsonl/json)")
    parser.add_argument("--local_dir", default="data/tool_gsm8k", help="output folder for train/test.parquet")
    args = parser.parse_args(argv)
    if not args.train_file and not args.test_file:
        parser.error("give --train_file and/or --test_file (local GSM8K files; nothing is downloaded)")
    out = Path(args.local_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    for split, path in (("train", args.train_file), ("test", args.test_file)):
        if path:
            df = convert(path, split)
            df.to_parquet(out / f"{split}.parquet")
            print(f"{split}: {len(df)} rows -> {out / f'{split}.parquet'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

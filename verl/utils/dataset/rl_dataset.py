"""Prompt datasets for RL: rows from parquet / json / jsonl files, tokenised with the chat template.

Row schema (the HotpotQA/MemAgent one): ``prompt`` (list of chat messages), ``data_source``,
``reward_model`` (``{"style": "rule", "ground_truth": ...}``), ``extra_info`` (dict), plus any
other columns, which pass through to the batch as per-row objects.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

logger = logging.getLogger(__name__)

TRUNCATIONS = ("error", "left", "right", "center", "middle")


def read_rows(files: str | Sequence[str]) -> pd.DataFrame:
    """Read and concatenate parquet/json/jsonl files into one DataFrame (clear error per file)."""
    if isinstance(files, str):
        files = [files]
    frames = []
    columns_by_file: dict[str, list[str]] = {}
    for f in files:
        path = Path(f)
        if not path.exists():
            raise FileNotFoundError(f"data file not found: {f}")
        suffix = path.suffix.lower()
        if suffix not in (".parquet", ".jsonl", ".json"):
            raise ValueError(f"unsupported data file type {suffix!r} for {f} (expected .parquet, .json, .jsonl)")
        if path.stat().st_size == 0:
            raise ValueError(f"data file {f} is empty (0 bytes); check how it was written")
        try:
            df = _read_file(path, suffix)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"cannot read data file {f}: {e}") from e
        if len(df) == 0:
            raise ValueError(f"data file {f} has no rows (an empty {suffix} file); check how it was written")
        columns_by_file[str(path)] = [str(c) for c in df.columns]
        df["_source_file"] = str(path)
        frames.append(df)
    if not frames:
        raise ValueError("no data files given (data.train_files / data.val_files is empty)")
    out = pd.concat(frames, ignore_index=True)
    out.attrs["columns_by_file"] = columns_by_file
    return out


def _read_file(path: Path, suffix: str) -> pd.DataFrame:
    if suffix == ".parquet":
        return pd.read_parquet(path)
    if suffix == ".jsonl":
        return pd.read_json(path, lines=True)
    with open(path) as fh:
        data = json.load(fh)
    return pd.DataFrame(data if isinstance(data, list) else data.get("data", data))


def require_column(df: pd.DataFrame, column: str, config_key: str) -> None:
    """Raise ``ValueError("missing column ...")`` naming ``column``, the file(s) without it and ``config_key``
    (the setting that names the column), for a frame from :func:`read_rows`."""
    columns_by_file = df.attrs.get("columns_by_file") or {"(data)": [str(c) for c in df.columns]}
    missing = [f for f, cols in columns_by_file.items() if column not in cols]
    if missing:
        present = columns_by_file[missing[0]]
        raise ValueError(
            f"missing column {column!r} ({config_key}) in {', '.join(missing)}; "
            f"its columns are {', '.join(repr(c) for c in present)}"
        )


def _to_python(v: Any) -> Any:
    """numpy arrays inside parquet cells -> lists, recursively (so rows are plain Python)."""
    if isinstance(v, np.ndarray):
        return [_to_python(x) for x in v.tolist()]
    if isinstance(v, dict):
        return {k: _to_python(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_to_python(x) for x in v]
    return v


def truncate_ids(ids: list[int], max_length: int, truncation: str, what: str) -> list[int]:
    """Apply ``data.truncation`` to a token-id list."""
    if len(ids) <= max_length:
        return ids
    if truncation == "error":
        raise ValueError(f"{what} has {len(ids)} tokens > max length {max_length} (data.truncation=error)")
    if truncation == "left":
        return ids[-max_length:]
    if truncation == "right":
        return ids[:max_length]
    head = max_length // 2
    return ids[:head] + ids[len(ids) - (max_length - head) :]


class RLHFDataset(torch.utils.data.Dataset):
    """Chat prompts for single-turn RL: ``raw_prompt_ids`` per row, plus pass-through columns."""

    def __init__(self, data_files, tokenizer, config, processor=None):
        from verl.trainer.config.data import DataConfig

        self.tokenizer = tokenizer
        # the ``data`` section (typed DataConfig, DictConfig or dict; absent keys take the YAML's defaults)
        self.config = config = DataConfig.from_config(config)
        self.prompt_key = config.prompt_key
        self.max_prompt_length = config.max_prompt_length
        self.truncation = config.truncation  # one of TRUNCATIONS (checked by DataConfig)
        self.files = [data_files] if isinstance(data_files, str) else list(data_files)
        self.dataframe = read_rows(self.files)
        self.rows = [{k: _to_python(v) for k, v in row.items()} for row in self.dataframe.to_dict(orient="records")]
        self._validate_rows()
        # position of each kept row among all rows read (index / sample_uuid stay those of the unfiltered files)
        self.row_positions = list(range(len(self.rows)))
        if config.filter_overlong_prompts:
            self._drop_overlong_prompts()

    # ------------------------------------------------------------------ data.filter_overlong_prompts
    def prompt_length(self, row: dict[str, Any]) -> int:
        """Tokens of a row's prompt as the rollout sees it: the chat-templated messages with the generation
        prompt (what ``__getitem__`` puts in ``raw_prompt_ids`` before truncation)."""
        ids = self.tokenizer.apply_chat_template(row[self.prompt_key], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return len(ids)

    def prompt_length_limit(self) -> tuple[int, str]:
        """``(max tokens, the key that sets it)`` for ``data.filter_overlong_prompts``."""
        return self.max_prompt_length, "data.max_prompt_length"

    def _drop_overlong_prompts(self) -> None:
        """Drop the rows whose ``prompt_length`` exceeds ``prompt_length_limit``; log how many per file."""
        limit, key = self.prompt_length_limit()
        keep = [self.prompt_length(row) <= limit for row in self.rows]
        dropped: dict[str, int] = {}
        totals: dict[str, int] = {}
        for row, ok in zip(self.rows, keep):
            source = str(row.get("_source_file"))
            totals[source] = totals.get(source, 0) + 1
            if not ok:
                dropped[source] = dropped.get(source, 0) + 1
        for source, count in dropped.items():
            logger.warning(
                "data.filter_overlong_prompts: dropped %d of %d rows of %s (prompt longer than %s=%d tokens)",
                count,
                totals[source],
                source,
                key,
                limit,
            )
        if not any(keep):
            raise ValueError(
                f"data.filter_overlong_prompts dropped every row of {', '.join(self.files)}: no prompt fits in "
                f"{key}={limit} tokens"
            )
        self.rows = [row for row, ok in zip(self.rows, keep) if ok]
        self.row_positions = [pos for pos, ok in zip(self.row_positions, keep) if ok]
        self.dataframe = self.dataframe[keep].reset_index(drop=True)

    def _validate_rows(self) -> None:
        require_column(self.dataframe, self.prompt_key, "data.prompt_key")
        for i, row in enumerate(self.rows):
            where = f"{row.get('_source_file')} row {i}"
            msgs = row.get(self.prompt_key)
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                raise ValueError(f"{where}: field {self.prompt_key!r} must be a non-empty list of chat messages")
            if not isinstance(msgs[-1].get("content"), str) or not msgs[-1]["content"].strip():
                raise ValueError(f"{where}: field {self.prompt_key!r} has an empty question")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = dict(self.rows[i])
        messages = row.pop(self.prompt_key)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding (a Mapping, not a dict)
            ids = ids["input_ids"]
        row["raw_prompt_ids"] = truncate_ids(list(ids), self.max_prompt_length, self.truncation, f"row {i} prompt")
        row["raw_prompt"] = messages
        return self.stamp_row(row, self.row_positions[i])

    @staticmethod
    def stamp_row(row: dict[str, Any], i: int) -> dict[str, Any]:
        """Add ``index`` (from ``extra_info``) and ``sample_uuid``, stable per row (not per access), so
        validation repeats group per question and resumed runs agree."""
        row["index"] = (row.get("extra_info") or {}).get("index", i)
        row["sample_uuid"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{row.get('_source_file')}#{i}"))
        return row


def collate_fn(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors; everything else becomes a 1-D numpy object array (one entry per row)."""
    out: dict[str, Any] = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if isinstance(values[0], torch.Tensor):
            out[key] = torch.stack(values)
        else:
            arr = np.empty(len(values), dtype=object)
            arr[:] = values
            out[key] = arr
    return out

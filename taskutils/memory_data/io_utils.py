"""Row schema (docs/spec.md#data-formats) and resumable, memory-bounded writers for parquet and JSON-list files."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

PROMPT_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
REWARD_MODEL_TYPE = pa.struct([("style", pa.string()), ("ground_truth", pa.list_(pa.string()))])


def qa_row(
    data_source: str,
    question: str,
    context: str,
    answers: list[str],
    extra_info: dict[str, Any],
    ability: str = "memory",
) -> dict[str, Any]:
    """One training/validation row in the MemAgent parquet schema (docs/spec.md#hotpotqa-synthesis).

    ``extra_info`` must hold at least ``index`` (int); ``question`` is filled in.
    """
    if "index" not in extra_info:
        raise ValueError("extra_info needs an 'index'")
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question}],
        "context": context,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": list(answers)},
        "extra_info": {"index": int(extra_info["index"]), "question": question, **extra_info},
    }


def qa_schema(extra_fields: list[tuple[str, pa.DataType]]) -> pa.Schema:
    """Parquet schema of :func:`qa_row` rows whose ``extra_info`` has ``index``, ``question`` and ``extra_fields``."""
    extra = pa.struct([("index", pa.int64()), ("question", pa.string()), *extra_fields])
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", PROMPT_TYPE),
            ("context", pa.string()),
            ("ability", pa.string()),
            ("reward_model", REWARD_MODEL_TYPE),
            ("extra_info", extra),
        ]
    )


def write_parquet(rows: list[dict[str, Any]], path: str | Path, schema: pa.Schema | None = None) -> Path:
    """Write rows to ``path`` atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The JSON manifest at ``path`` or None if it does not exist."""
    return json.loads(path.read_text()) if path.exists() else None


def write_sharded_parquet(
    out_path: str | Path,
    num_rows: int,
    make_rows: Callable[[int, int], Iterable[dict[str, Any]]],
    schema: pa.Schema,
    params: dict[str, Any],
    shard_size: int = 2000,
    on_shard_done: Callable[[int], None] | None = None,
) -> Path:
    """Build a large parquet file shard by shard, resuming after an interruption.

    Rows ``[start, end)`` come from ``make_rows(start, end)`` and are written to
    ``<out>.parts/part-XXXXX.parquet`` (atomically); finished shards are skipped on a rerun if the
    manifest (``params`` + sizes) matches, otherwise ValueError asks for ``--force``. At the end the
    shards are concatenated into ``out_path`` one at a time (bounded memory) and removed.
    """
    out_path = Path(out_path)
    parts = out_path.with_name(out_path.name + ".parts")
    manifest = {"params": params, "num_rows": num_rows, "shard_size": shard_size}
    old = read_manifest(parts / "manifest.json")
    if old is not None and old != json.loads(json.dumps(manifest)):
        raise ValueError(f"{parts} holds shards made with other settings ({old}); rerun with --force to rebuild")
    parts.mkdir(parents=True, exist_ok=True)
    (parts / "manifest.json").write_text(json.dumps(manifest, indent=2))
    shard_files = []
    for k, start in enumerate(range(0, num_rows, shard_size)):
        end = min(num_rows, start + shard_size)
        shard = parts / f"part-{k:05d}.parquet"
        shard_files.append(shard)
        if not shard.exists():
            write_parquet(list(make_rows(start, end)), shard, schema)
        if on_shard_done is not None:
            on_shard_done(end - start)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        for shard in shard_files:
            writer.write_table(pq.read_table(shard, schema=schema))
    os.replace(tmp, out_path)
    shutil.rmtree(parts)
    return out_path


def write_json_list(records: Iterator[dict[str, Any]], path: str | Path, indent: int = 4) -> int:
    """Stream records into a pretty-printed JSON list at ``path`` (atomic); returns the record count.

    Only one record is held in memory at a time, so multi-GB eval files can be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pad = " " * indent
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("[")
        for rec in records:
            body = json.dumps(rec, indent=indent, ensure_ascii=False)
            f.write(("," if count else "") + "\n" + "\n".join(pad + line for line in body.split("\n")))
            count += 1
        f.write("\n]\n" if count else "]\n")
    os.replace(tmp, path)
    return count


def json_list_length(path: str | Path) -> int:
    """Number of records in an existing JSON list file (-1 if missing or unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return -1
    return len(data) if isinstance(data, list) else -1

"""JSONL result files with resume: one line per finished item, the last line of an ``_id`` wins.

Layout of a run directory (``--out``)::

    {out}/{task}_{length}/{label}.jsonl       one record per item (status ok | error | invalid)
    {out}/{task}_{length}/{label}.meta.json   what was run: model, method, data file, item count
    {out}/summary.md, summary.csv, accuracy_vs_length.png

Every item of the data file ends up with a record: ``status="ok"`` with the response and scores,
``status="error"`` with the error text (after retries), or ``status="invalid"`` for a malformed input
row (with ``--skip-invalid``). Nothing is silently dropped: the summary counts ok, failed and
missing items against the item count in the meta file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["ResultStore", "read_jsonl_last_by", "read_records", "write_meta", "read_meta", "result_paths"]

logger = logging.getLogger(__name__)


def result_paths(out_dir: str | Path, task: str, length: int | str, label: str) -> tuple[Path, Path]:
    """``(results.jsonl, meta.json)`` paths of one (task, length, label) cell."""
    cell = Path(out_dir) / f"{task}_{length}"
    safe = label.replace("/", "_")
    return cell / f"{safe}.jsonl", cell / f"{safe}.meta.json"


def read_jsonl_last_by(path: str | Path, key: str, what: str = "record") -> dict[int, dict[str, Any]]:
    """JSON lines of ``path`` keyed by the integer field ``key`` (the last line of a key wins).

    Missing file -> ``{}``. Unparsable lines (a crash can leave a half-written last one) and lines
    without ``key`` are skipped with a warning naming the file, the line and ``what`` they should be.
    """
    records: dict[int, dict[str, Any]] = {}
    path = Path(path)
    if not path.exists():
        return records
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                records[int(record[key])] = record
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                logger.warning("%s: line %d is not a %s; ignored", path, lineno, what)
    return records


def read_records(path: str | Path) -> dict[int, dict[str, Any]]:
    """Records of a results file keyed by ``_id`` (last one wins); unparsable lines are skipped.

    A crash can leave a half-written last line; it is ignored with a warning (that item is redone).
    """
    return read_jsonl_last_by(path, "_id", "result record (the item will be redone)")


def write_meta(path: str | Path, meta: dict[str, Any]) -> None:
    """Write the meta file of a cell atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def read_meta(path: str | Path) -> dict[str, Any] | None:
    path = Path(path)
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


class ResultStore:
    """Append-only JSONL store of one cell, with resume.

    ``open(redo_failed=True)`` compacts the file to one line per ``_id``, dropping failed records
    that are going to be redone, and returns the ids already finished.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh = None

    def open(self, force: bool = False, redo_failed: bool = True) -> set[int]:
        """Prepare the file for appending; return the ``_id``s that need no new run.

        Args:
            force: start over (truncate the file).
            redo_failed: failed (``error``) records are removed and redone; with False they count
                as finished.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records = {} if force else read_records(self.path)
        keep = {i: r for i, r in records.items() if r.get("status", "ok") == "ok" or not redo_failed}
        tmp = self.path.with_suffix(".jsonl.tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            for i in sorted(keep):
                fh.write(json.dumps(keep[i], ensure_ascii=False) + "\n")
        os.replace(tmp, self.path)
        self._fh = self.path.open("a", encoding="utf-8")
        return set(keep)

    def append(self, record: dict[str, Any]) -> None:
        """Write one record and flush it (a crash loses at most the line being written)."""
        if self._fh is None:
            raise RuntimeError(f"ResultStore({self.path}) is not open")
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_cells(out_dir: str | Path) -> Iterable[tuple[Path, Path]]:
    """``(results.jsonl, meta.json)`` of every cell found under ``out_dir``."""
    for meta in sorted(Path(out_dir).glob("*/*.meta.json")):
        yield meta.with_name(meta.name[: -len(".meta.json")] + ".jsonl"), meta

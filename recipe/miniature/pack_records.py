"""One compressed file per run: everything the miniature report (:mod:`recipe.miniature.report`) reads.

A run folder of the pipeline (``recipe/miniature/pipeline.sh``) holds one JSONL file and one meta file per
(evaluation seed, task, length, system) cell, the trainer's ``metrics.jsonl`` and a few ``meta/`` text files.
:func:`pack_run` reads those into a :class:`RunRecords`; :func:`write_pack` stores it as one gzip'd JSON-lines
file (``.jsonl.gz``), byte-identical for the same run (sorted keys and rows, gzip header without a time stamp);
:func:`read_pack` reads it back. Lines, each a JSON object with a ``type``::

    {"type": "run", "format": 1, "name": "run5", "train_seed": 0}      first line (train_seed may be null)
    {"type": "cell", "seed": 1, "meta": {...}}                         a cell's meta file ({label}.meta.json)
    {"type": "record", "seed": 1, "record": {...}}                     one item's result (last line of its _id)
    {"type": "train", "metrics": {...}}                                one line of train/logs/metrics.jsonl
    {"type": "file", "path": "meta/commands.txt", "text": "..."}       a meta/ or bench/ text file, verbatim

One pack holds one trained model (the run's training seed, ``meta/train_seed.txt`` or ``--train-seed``); runs of
several training seeds are several packs, which the report reads together.

    python -m recipe.miniature.pack_records --root runs/miniature --out docs/results/records/run6.jsonl.gz \\
        [--name run6] [--train-seed 1]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taskutils.memory_eval.results import iter_cells, read_meta, read_records

__all__ = ["FORMAT", "RunRecords", "load_run", "main", "pack_run", "read_pack", "write_pack"]

FORMAT = 1
TRAIN_LOG = Path("train") / "logs" / "metrics.jsonl"  # relative to the run root
TRAIN_SEED_FILE = Path("meta") / "train_seed.txt"
META_SUFFIXES = (".txt", ".json", ".jsonl", ".tsv")
FILE_DIRS = ("meta", "bench")  # their text files (suffixes above) are stored verbatim
_SEED_DIR = re.compile(r"^seed(\d+)$")


@dataclass
class RunRecords:
    """One run: per-item evaluation records and cell metas (with their evaluation ``seed``), training metrics, files."""

    name: str
    train_seed: int | None = None
    cells: list[dict[str, Any]] = field(default_factory=list)  # {"seed", "meta"}
    records: list[dict[str, Any]] = field(default_factory=list)  # {"seed", "record"}
    train: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl lines, in file order
    files: dict[str, str] = field(default_factory=dict)  # "meta/commands.txt" -> text

    def training_by_step(self) -> dict[int, dict[str, Any]]:
        """The metrics of each step (a step logged again after a resume: the last line wins)."""
        by_step: dict[int, dict[str, Any]] = {}
        for line in self.train:
            if "step" in line:
                by_step[int(line["step"])] = line
        return by_step


def _seed_dirs(root: Path) -> dict[int, Path]:
    found: dict[int, Path] = {}
    eval_dir = root / "eval"
    if eval_dir.is_dir():
        for child in sorted(eval_dir.iterdir()):
            match = _SEED_DIR.match(child.name)
            if child.is_dir() and match:
                found[int(match.group(1))] = child
    return found


def _cell_key(meta: dict[str, Any]) -> tuple:
    return (str(meta.get("task", "")), int(meta.get("length", 0)), str(meta.get("label", "")))


def pack_run(root: str | Path, name: str | None = None, train_seed: int | None = None) -> RunRecords:
    """Read the run folder ``root`` (``eval/seed{S}/``, ``train/logs/metrics.jsonl``, ``meta/``) into a RunRecords.

    ``name`` defaults to the folder's name, ``train_seed`` to the integer in ``meta/train_seed.txt`` (None if
    absent). A cell's records are its JSONL's last line per ``_id`` (as the harness reads them), sorted by ``_id``.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"run root {root} is not a directory")
    if train_seed is None and (root / TRAIN_SEED_FILE).is_file():
        text = (root / TRAIN_SEED_FILE).read_text().strip()
        try:
            train_seed = int(text)
        except ValueError:
            raise ValueError(f"{root / TRAIN_SEED_FILE}: expected an integer training seed, got {text!r}") from None
    run = RunRecords(name=name or root.resolve().name, train_seed=train_seed)
    for seed, out_dir in _seed_dirs(root).items():
        for results_path, meta_path in iter_cells(out_dir):
            meta = read_meta(meta_path) or {}
            meta.setdefault("task", results_path.parent.name.rsplit("_", 1)[0])
            meta.setdefault("length", int(results_path.parent.name.rsplit("_", 1)[1]))
            meta.setdefault("label", results_path.stem)
            run.cells.append({"seed": seed, "meta": meta})
            for _, record in sorted(read_records(results_path).items()):
                run.records.append({"seed": seed, "record": record})
    log = root / TRAIN_LOG
    if log.is_file():  # every parsable line, in order (resumed steps appear twice; readers keep the last)
        for line in log.read_text(encoding="utf-8").splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "step" in obj:
                run.train.append(obj)
    for folder in FILE_DIRS:
        if (root / folder).is_dir():
            for path in sorted((root / folder).iterdir()):
                if path.is_file() and path.suffix in META_SUFFIXES:
                    run.files[f"{folder}/{path.name}"] = path.read_text(encoding="utf-8", errors="replace")
    _sort(run)
    return run


def _sort(run: RunRecords) -> None:
    run.cells.sort(key=lambda c: (c["seed"], *_cell_key(c["meta"])))
    run.records.sort(key=lambda r: (r["seed"], *_cell_key(r["record"]), int(r["record"].get("_id", -1))))


def _lines(run: RunRecords) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = [{"type": "run", "format": FORMAT, "name": run.name, "train_seed": run.train_seed}]
    lines += [{"type": "cell", **c} for c in run.cells]
    lines += [{"type": "record", **r} for r in run.records]
    lines += [{"type": "train", "metrics": m} for m in run.train]
    lines += [{"type": "file", "path": p, "text": run.files[p]} for p in sorted(run.files)]
    return lines


def write_pack(run: RunRecords, path: str | Path) -> Path:
    """Write ``run`` as gzip'd JSON lines; the same run gives the same bytes (no time stamp, sorted keys)."""
    _sort(run)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(line, sort_keys=True, ensure_ascii=False) + "\n" for line in _lines(run))
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as gz:
        gz.write(text.encode("utf-8"))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(path)
    return path


def read_pack(path: str | Path) -> RunRecords:
    """The RunRecords stored by :func:`write_pack` (a line of unknown ``type`` is an error naming it)."""
    path = Path(path)
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        lines = [json.loads(line) for line in fh if line.strip()]
    if not lines or lines[0].get("type") != "run":
        raise ValueError(f"{path}: not a packed run (the first line must be a 'run' header)")
    head = lines[0]
    if head.get("format") != FORMAT:
        raise ValueError(f"{path}: pack format {head.get('format')!r}, this reader knows {FORMAT}")
    run = RunRecords(name=str(head["name"]), train_seed=head.get("train_seed"))
    for no, line in enumerate(lines[1:], start=2):
        kind = line.get("type")
        if kind == "cell":
            run.cells.append({"seed": int(line["seed"]), "meta": line["meta"]})
        elif kind == "record":
            run.records.append({"seed": int(line["seed"]), "record": line["record"]})
        elif kind == "train":
            run.train.append(line["metrics"])
        elif kind == "file":
            run.files[str(line["path"])] = str(line["text"])
        else:
            raise ValueError(f"{path}: line {no} has unknown type {kind!r}")
    return run


def load_run(source: str | Path) -> RunRecords:
    """A packed file (``*.jsonl.gz``) or a run folder, as a RunRecords."""
    source = Path(source)
    return pack_run(source) if source.is_dir() else read_pack(source)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.miniature.pack_records", description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="run folder (eval/seed*/, train/logs/metrics.jsonl, meta/)")
    p.add_argument("--out", required=True, help="packed file to write (*.jsonl.gz)")
    p.add_argument("--name", help="run name stored in the pack (default: the folder's name)")
    p.add_argument(
        "--train-seed", type=int, help="training seed of the run's trained model (default: meta/train_seed.txt)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run = pack_run(args.root, args.name, args.train_seed)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = write_pack(run, args.out)
    print(f"packed {len(run.records)} records of {len(run.cells)} cells, {len(run.train)} training lines and "
          f"{len(run.files)} files into {path} ({path.stat().st_size} bytes)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Summaries of a results directory: Table-2-style tables (markdown + CSV) and an accuracy plot.

Scores are means over **all** items of the data file, x 100: a failed, invalid or missing item
scores 0 (the original harness silently dropped failures, docs/spec.md#bug-dropped-failures, which inflates
accuracy). ``n_ok`` / ``n_failed`` / ``n_missing`` are reported next to the scores, and the lenient
metrics (``em``, ``sub_em``, ``f1``, ``string_match_all``) sit beside the strict training verifier
(``strict_boxed``) computed on the same responses.

    python -m taskutils.memory_eval.summary --out results/
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taskutils.memory_eval.results import iter_cells, read_meta, read_records
from taskutils.memory_eval.scoring import LENIENT_METRICS, SCORE_KEYS, STRICT_METRIC, primary_metric

__all__ = ["SummaryRow", "collect_rows", "length_label", "length_tokens", "main", "plot_accuracy", "write_summary"]

# RULER-HotpotQA: documents -> paper's token label and approximate tokens (docs/spec.md#ruler-hotpotqa).
HOTPOTQA_DOC_TOKENS = {
    50: (7_000, "7K"),
    100: (14_000, "14K"),
    200: (28_000, "28K"),
    400: (56_000, "56K"),
    800: (112_000, "112K"),
    1600: (224_000, "224K"),
    3200: (448_000, "448K"),
    6400: (896_000, "896K"),
    12800: (1_750_000, "1.75M"),
    25600: (3_500_000, "3.5M"),
}
TOKENS_PER_HOTPOTQA_DOC = 140

# Paper (arXiv 2507.02259 v1) Table 2: RULER-HotpotQA accuracy (sub_em %, 128 questions) by document
# count; None = N/A. Shown next to our numbers with --with-paper (paper Table 2).
PAPER_TABLE2: dict[str, list[float | None]] = {
    "QwenLong-L1-32B": [72.66, 75.00, 72.66, 60.94, 31.25, 17.19, 13.28, 11.72, None, None],
    "Qwen2.5-Instruct-14B-1M": [60.16, 60.94, 50.00, 57.03, 50.00, 37.50, 8.59, 0.00, None, None],
    "Qwen2.5-Instruct-7B-1M": [61.72, 56.25, 53.91, 55.47, 51.56, 33.59, 12.50, 0.00, None, None],
    "DS-Distill-Qwen-32B": [70.31, 66.41, 65.62, 46.88, 23.44, 13.28, 7.81, 7.03, None, None],
    "DS-Distill-Qwen-14B": [64.06, 64.84, 57.03, 40.62, 14.84, 8.59, 3.12, 6.25, None, None],
    "DS-Distill-Qwen-7B": [30.47, 12.50, 3.12, 0.00, 0.00, 0.78, 0.00, 0.00, None, None],
    "RL-MemAgent-14B": [83.59, 82.03, 84.38, 80.47, 76.56, 81.25, 75.00, 77.34, 76.56, 78.12],
    "RL-MemAgent-7B": [82.03, 79.69, 78.91, 77.34, 79.69, 72.66, 74.22, 76.56, 75.78, 71.09],
}
PAPER_TABLE2_DOCS = [50, 100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600]


def _is_doc_count_task(task: str) -> bool:
    return "hotpot" in task.lower() and "ruler" not in task.lower()


def length_tokens(task: str, length: int | str) -> float:
    """Approximate context tokens of a length setting (documents for HotpotQA, tokens otherwise)."""
    n = int(length)
    if _is_doc_count_task(task):
        return HOTPOTQA_DOC_TOKENS.get(n, (n * TOKENS_PER_HOTPOTQA_DOC, ""))[0]
    return n


def _human_tokens(n: float) -> str:
    if n >= 1_000_000:
        return f"{n / 1_048_576:.3g}M" if n % 1_048_576 == 0 else f"{n / 1_000_000:.3g}M"
    if n >= 1000:
        return f"{n / 1024:.0f}K" if n % 1024 == 0 else f"{n / 1000:.0f}K"
    return str(int(n))


def length_label(task: str, length: int | str) -> str:
    """Column label: the paper's ``7K``...``3.5M`` for HotpotQA doc counts, ``8K``... for RULER lengths."""
    n = int(length)
    if _is_doc_count_task(task) and n in HOTPOTQA_DOC_TOKENS:
        return HOTPOTQA_DOC_TOKENS[n][1]
    return _human_tokens(length_tokens(task, n))


@dataclass
class SummaryRow:
    """Scores of one cell."""

    task: str
    length: int
    label: str
    model: str
    method: str
    n_items: int
    n_ok: int
    n_failed: int
    n_invalid: int
    n_missing: int
    scores: dict[str, float]  # metric -> percent over all items

    def as_dict(self) -> dict[str, Any]:
        row = {
            "task": self.task,
            "length": self.length,
            "length_label": length_label(self.task, self.length),
            "label": self.label,
            "model": self.model,
            "method": self.method,
            "n_items": self.n_items,
            "n_ok": self.n_ok,
            "n_failed": self.n_failed,
            "n_invalid": self.n_invalid,
            "n_missing": self.n_missing,
        }
        row.update({key: round(self.scores[key], 2) for key in SCORE_KEYS})
        return row


def collect_rows(out_dir: str | Path) -> list[SummaryRow]:
    """One :class:`SummaryRow` per cell found under ``out_dir``."""
    rows: list[SummaryRow] = []
    for results_path, meta_path in iter_cells(out_dir):
        meta = read_meta(meta_path) or {}
        records = read_records(results_path)
        n_items = int(meta.get("n_items", len(records)))
        statuses = [r.get("status", "ok") for r in records.values()]
        ok = [r for r in records.values() if r.get("status", "ok") == "ok"]
        denominator = max(n_items, len(records), 1)
        scores = {key: 100.0 * sum(float(r.get(f"judge_{key}", 0.0)) for r in ok) / denominator for key in SCORE_KEYS}
        rows.append(
            SummaryRow(
                task=str(meta.get("task", results_path.parent.name)),
                length=int(meta.get("length", 0)),
                label=str(meta.get("label", results_path.stem)),
                model=str(meta.get("model", "")),
                method=str(meta.get("method", "")),
                n_items=n_items,
                n_ok=len(ok),
                n_failed=statuses.count("error"),
                n_invalid=statuses.count("invalid"),
                n_missing=max(0, n_items - len(records)),
                scores=scores,
            )
        )
    rows.sort(key=lambda r: (r.task, r.label, r.length))
    return rows


def _natural_key(text: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _markdown_table(header: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _paper_table(lengths: Sequence[int]) -> str:
    cols = [n for n in lengths if n in PAPER_TABLE2_DOCS] or PAPER_TABLE2_DOCS
    header = ["paper model (Table 2)"] + [length_label("hotpotqa", n) for n in cols]
    body = [
        [name] + [_fmt(values[PAPER_TABLE2_DOCS.index(n)]) or "N/A" for n in cols]
        for name, values in PAPER_TABLE2.items()
    ]
    return _markdown_table(header, body)


def render_markdown(rows: Sequence[SummaryRow], with_paper: bool = False) -> str:
    """Per task: a pivot (rows label x {lenient primary, strict}, columns lengths), then all columns.

    ``with_paper`` adds the paper's Table 2 (sub_em %) under RULER-HotpotQA for comparison.
    """
    parts = ["# Evaluation summary", ""]
    parts.append(
        "Scores are accuracy in % over all items of each data file (failed/invalid/missing items score 0). "
        'Lenient = the evaluation metrics of the paper (answer after "the answer is" or in \\boxed{}, '
        "normalised sub-EM etc.); strict_boxed = the training verifier (last \\boxed{} in the last 300 "
        "characters must equal a gold answer) on the same responses."
    )
    for task in sorted({r.task for r in rows}, key=_natural_key):
        task_rows = [r for r in rows if r.task == task]
        primary = primary_metric(task)
        lengths = sorted({r.length for r in task_rows})
        labels = sorted({r.label for r in task_rows}, key=_natural_key)
        cell = {(r.label, r.length): r for r in task_rows}
        parts += ["", f"## {task}", "", f"Lenient `{primary}` vs strict `{STRICT_METRIC}` (accuracy %):", ""]
        header = ["label", "metric"] + [length_label(task, n) for n in lengths]
        body = []
        for label in labels:
            for metric in (primary, STRICT_METRIC):
                kind = "lenient" if metric != STRICT_METRIC else "strict"
                values = [_fmt(cell[(label, n)].scores[metric]) if (label, n) in cell else "" for n in lengths]
                body.append([label, f"{metric} ({kind})"] + values)
        parts.append(_markdown_table(header, body))
        if with_paper and _is_doc_count_task(task):
            parts += ["", "Paper, Table 2 (sub_em %, 128 questions; for comparison):", "", _paper_table(lengths)]
        parts += ["", "All metrics:", ""]
        columns = ["length_label", "label", "method", "n_items", "n_ok", "n_failed", "n_invalid", "n_missing"]
        columns += list(LENIENT_METRICS) + [STRICT_METRIC]
        detail = [[r.as_dict()[c] for c in columns] for r in sorted(task_rows, key=lambda r: (r.label, r.length))]
        parts.append(_markdown_table(columns, detail))
    return "\n".join(parts) + "\n"


def write_csv(rows: Sequence[SummaryRow], path: str | Path) -> None:
    """Long-format CSV: one line per cell with every count and metric."""
    dicts = [r.as_dict() for r in rows]
    fields = list(dicts[0]) if dicts else ["task", "length", "label"]
    with Path(path).open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(dicts)


def plot_accuracy(rows: Sequence[SummaryRow], path: str | Path, with_paper: bool = False) -> None:
    """Accuracy against context length: one panel per task, one line per label.

    Solid lines: the task's lenient metric; dashed: the strict boxed verifier. Log-scaled x axis
    labelled like the paper (7K ... 3.5M), as in its Figure 1. ``with_paper`` adds the paper's
    RL-MemAgent curves (grey, dotted) to RULER-HotpotQA panels.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r.task for r in rows}, key=_natural_key) or ["(no results)"]
    ncols = min(3, len(tasks))
    nrows = (len(tasks) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.0 * ncols, 4.2 * nrows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        task_rows = [r for r in rows if r.task == task]
        primary = primary_metric(task)
        lengths = sorted({r.length for r in task_rows})
        for i, label in enumerate(sorted({r.label for r in task_rows}, key=_natural_key)):
            points = sorted((r for r in task_rows if r.label == label), key=lambda r: r.length)
            xs = [length_tokens(task, r.length) for r in points]
            color = f"C{i % 10}"
            ax.plot(xs, [r.scores[primary] for r in points], "-o", color=color, label=f"{label} ({primary})")
            ax.plot(
                xs, [r.scores[STRICT_METRIC] for r in points], "--x", color=color, alpha=0.6, label=f"{label} (strict)"
            )
        if with_paper and _is_doc_count_task(task):
            for name in ("RL-MemAgent-14B", "RL-MemAgent-7B"):
                pts = [
                    (length_tokens(task, n), v) for n, v in zip(PAPER_TABLE2_DOCS, PAPER_TABLE2[name]) if n in lengths
                ]
                if pts:
                    ax.plot(*zip(*pts), ":", color="grey", alpha=0.7, label=f"paper {name}")
        if lengths:
            ticks = [length_tokens(task, n) for n in lengths]
            ax.set_xscale("log")
            ax.set_xticks(ticks)
            ax.set_xticklabels([length_label(task, n) for n in lengths])
            ax.minorticks_off()
        ax.set_ylim(-2, 102)
        ax.set_title(task)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
        if task_rows:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_summary(out_dir: str | Path, with_paper: bool = False) -> dict[str, Path]:
    """Write ``summary.md``, ``summary.csv`` and ``accuracy_vs_length.png`` into ``out_dir``."""
    out = Path(out_dir)
    rows = collect_rows(out)
    paths = {"markdown": out / "summary.md", "csv": out / "summary.csv", "plot": out / "accuracy_vs_length.png"}
    paths["markdown"].write_text(render_markdown(rows, with_paper), encoding="utf-8")
    write_csv(rows, paths["csv"])
    plot_accuracy(rows, paths["plot"], with_paper)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tabulate and plot a memory_eval results directory.")
    parser.add_argument("--out", required=True, help="results directory written by taskutils.memory_eval.run")
    parser.add_argument("--with-paper", action="store_true", help="add the paper's Table 2 for RULER-HotpotQA")
    args = parser.parse_args(argv)
    if not Path(args.out).is_dir():
        parser.error(f"--out {args.out}: no such directory")
    if next(iter(iter_cells(args.out)), None) is None:
        parser.error(
            f"--out {args.out}: no results there (taskutils.memory_eval.run writes <cell>/<label>.jsonl and "
            "<cell>/<label>.meta.json per evaluated cell)"
        )
    paths = write_summary(args.out, args.with_paper)
    print(paths["markdown"].read_text(encoding="utf-8"))
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

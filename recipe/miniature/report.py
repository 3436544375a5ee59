"""Report of the miniature MemAgent reproduction: accuracy vs document length, training curve, tables, claim check.

Run layout read from ``--root``::

    {root}/eval/seed{S}/{task}_{length}/{label}.jsonl + .meta.json   one harness out dir per evaluation seed
    {root}/train/logs/metrics.jsonl                                  the trainer's jsonl logger (one object a step)
    {root}/meta/reward.txt                                           the reward definition (optional)
    {root}/meta/*.json | *.txt                                       free-form facts (optional)

``length`` is the number of chunks of a document; ``label`` is the system (``untrained-memory``,
``rl-memory``, ``untrained-direct``). Scores come from :func:`taskutils.memory_eval.summary.collect_rows`,
so they are percentages over **all** items of a cell (failed, invalid or missing items score 0), exactly
as the harness's own summary. Three scores per cell: ``lenient`` (the task's evaluation metric, the
paper's), ``strict`` (the training verifier) and ``in_response`` (format-free: the gold answer anywhere
in the raw final response). Written into ``--out``: ``accuracy_vs_chunks.png``, ``training_curve.png``,
``results.csv`` and ``results.md`` (paths in it are relative to ``--root``). Cells not (yet) run show as
"—" and are skipped in the plots.

    python -m recipe.miniature.report --root RUNROOT --out docs/results [--commands FILE] [--hardware FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from recipe.miniature.make_data import EVAL_LENGTHS
from recipe.miniature.report_plots import plot_accuracy, plot_training
from taskutils.memory_data.synthetic_qa import DEFAULT_KINDS
from taskutils.memory_eval.results import read_jsonl_last_by
from taskutils.memory_eval.scoring import (
    FORMAT_FREE_METRIC,
    STRICT_METRIC,
    primary_metric,
)
from taskutils.memory_eval.summary import collect_rows

__all__ = [
    "ClaimResult",
    "ReportSettings",
    "build_grid",
    "check_claims",
    "load_cells",
    "main",
    "read_training_log",
    "seed_means",
    "system_means",
    "write_report",
]

logger = logging.getLogger(__name__)

DEFAULT_SYSTEMS = ("untrained-memory", "rl-memory", "untrained-direct")
DEFAULT_TASKS = DEFAULT_KINDS  # the evaluation grid of make_data
DEFAULT_LENGTHS = EVAL_LENGTHS
MISSING = "—"
INCOMPLETE_MARK = "*"
NOT_REPORTED = ("missing", "unfinished")
"""Cell states shown as no number: never run, or stopped with more than half of the items undone."""
TRAIN_REWARD_KEY = "critic/score/mean"
VAL_PREFIX = "val-core/"
SCORES = ("lenient", "strict", "in_response")  # score columns of every frame, in the order cells show them
SCORES_LABEL = "lenient / strict / in-response"
TRAIN_LOG = Path("train") / "logs" / "metrics.jsonl"  # relative to the root
REWARD_FILE = Path("meta") / "reward.txt"
NO_RESULTS = "No evaluation results were found under the root (no `eval/seed{S}/` folder with harness results)."
HOLDS, FAILS, UNCHECKED, PARTIAL = (
    "holds",
    "does not hold",
    "cannot be checked",
    "holds where measured, not fully checked",
)
_SEED_DIR = re.compile(r"^seed(\d+)$")
_MAX_FACT_CHARS = 4000


@dataclass
class ReportSettings:
    """What the report expects to find and how it checks the claims."""

    systems: Sequence[str] = DEFAULT_SYSTEMS
    tasks: Sequence[str] = DEFAULT_TASKS
    lengths: Sequence[int] = DEFAULT_LENGTHS
    seeds: Sequence[int] | None = None  # None: the seeds found under {root}/eval
    train_chunks: int = 8
    far_chunks: int = 512
    tolerance_points: float = 10.0
    trained: str = "rl-memory"
    baseline: str = "untrained-memory"


@dataclass
class ClaimResult:
    """Verdict of one claim (one of HOLDS, FAILS, UNCHECKED, PARTIAL) with its evidence lines."""

    name: str
    verdict: str
    summary: str
    details: list[str] = field(default_factory=list)

    def as_markdown(self) -> str:
        lines = [f"**{self.name}: {self.verdict}.** {self.summary}"]
        lines += [f"  - {d}" for d in self.details]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------


def seed_dirs(root: str | Path) -> dict[int, Path]:
    """``{seed: harness out dir}`` for every ``{root}/eval/seed{S}`` folder."""
    found: dict[int, Path] = {}
    eval_dir = Path(root) / "eval"
    if eval_dir.is_dir():
        for child in sorted(eval_dir.iterdir()):
            match = _SEED_DIR.match(child.name)
            if child.is_dir() and match:
                found[int(match.group(1))] = child
    return found


def load_cells(root: str | Path) -> pd.DataFrame:
    """One row per (system, task, length, seed) cell found, scores in % (via the harness's ``collect_rows``)."""
    rows: list[dict[str, Any]] = []
    for seed, out_dir in seed_dirs(root).items():
        for row in collect_rows(out_dir):
            metric = primary_metric(row.task)
            rows.append(
                {
                    "system": row.label,
                    "task": row.task,
                    "length": int(row.length),
                    "seed": seed,
                    "metric": metric,
                    "n_items": row.n_items,
                    "n_ok": row.n_ok,
                    "n_failed": row.n_failed,
                    "n_invalid": row.n_invalid,
                    "n_missing": row.n_missing,
                    "lenient": float(row.scores[metric]),
                    "strict": float(row.scores[STRICT_METRIC]),
                    "in_response": float(row.scores[FORMAT_FREE_METRIC]),
                }
            )
    columns = ["system", "task", "length", "seed", "metric", "n_items", "n_ok", "n_failed", "n_invalid",
               "n_missing", *SCORES]  # fmt: skip
    frame = pd.DataFrame(rows, columns=columns)
    return frame.astype({"length": "int64", "seed": "int64", **{k: "float64" for k in SCORES}})


def read_training_log(path: str | Path) -> pd.DataFrame:
    """The trainer's ``metrics.jsonl`` as a frame indexed by step (a re-logged step after a resume: last wins)."""
    by_step = read_jsonl_last_by(path, "step", "metrics record")
    if not by_step:
        return pd.DataFrame(index=pd.Index([], name="step"))
    frame = pd.DataFrame([by_step[s] for s in sorted(by_step)]).set_index("step")
    return frame.apply(pd.to_numeric, errors="coerce")


# --------------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------------


def _ordered(preferred: Sequence[Any], found: Sequence[Any]) -> list[Any]:
    extra = sorted(set(found) - set(preferred), key=str)
    return list(dict.fromkeys(list(preferred) + extra))


def build_grid(cells: pd.DataFrame, settings: ReportSettings) -> tuple[pd.DataFrame, ReportSettings]:
    """Every expected (system, task, length, seed), found or not, with ``status`` ok | incomplete |
    unfinished | missing.

    Expected = the settings' systems/tasks/lengths/seeds plus whatever was found. ``incomplete``: the
    cell exists but some items have no record yet (they score 0, as in the harness). ``unfinished``:
    more than half of its items have no record (a run stopped early): like ``missing``, it is not
    reported as a number, since scoring the unrun items 0 would pass a time-out off as a result.
    """
    seeds = settings.seeds if settings.seeds is not None else sorted(cells["seed"].unique().tolist())
    resolved = ReportSettings(**settings.__dict__)
    resolved.systems = _ordered(settings.systems, cells["system"].tolist())
    resolved.tasks = _ordered(settings.tasks, cells["task"].tolist())
    resolved.lengths = sorted({int(n) for n in settings.lengths} | {int(n) for n in cells["length"]})
    resolved.seeds = sorted({int(s) for s in seeds} | {int(s) for s in cells["seed"]})
    index = pd.MultiIndex.from_product(
        [resolved.systems, resolved.tasks, resolved.lengths, resolved.seeds], names=["system", "task", "length", "seed"]
    )
    grid = pd.DataFrame(index=index).reset_index()
    grid = grid.merge(cells, on=["system", "task", "length", "seed"], how="left")
    grid["metric"] = [primary_metric(t) for t in grid["task"]]
    counts = ["n_items", "n_ok", "n_failed", "n_invalid", "n_missing"]
    grid[counts] = grid[counts].astype("Int64")
    grid["status"] = "ok"
    grid.loc[grid["n_items"].isna(), "status"] = "missing"
    grid.loc[grid["n_missing"].fillna(0) > 0, "status"] = "incomplete"
    grid.loc[grid["n_missing"].fillna(0) > grid["n_items"].fillna(0) / 2, "status"] = "unfinished"
    return grid, resolved


def seed_means(grid: pd.DataFrame) -> pd.DataFrame:
    """Per (system, length, seed): scores averaged over the tasks present, questions, tasks present."""
    present = grid[~grid["status"].isin(NOT_REPORTED)].copy()
    present["is_incomplete"] = present["status"] == "incomplete"
    out = present.groupby(["system", "length", "seed"], sort=False).agg(
        **{k: (k, "mean") for k in SCORES},
        n_items=("n_items", "sum"),
        n_tasks=("task", "count"),
        n_incomplete=("is_incomplete", "sum"),
    )
    out["n_items"] = out["n_items"].astype(int)
    return out


def system_means(seeds: pd.DataFrame, settings: ReportSettings) -> pd.DataFrame:
    """Per (system, length): mean over seeds of the task-averaged scores, seed spread and completeness.

    ``spread_*`` is max - min over the seeds (|seed1 - seed2| for two seeds), NaN with fewer than two.
    ``complete`` is False when a task or seed is missing or some items have no record.
    """
    rows = []
    for (system, length), group in seeds.groupby(level=["system", "length"], sort=False):
        n_seeds = len(group)
        spread = {k: float(group[k].max() - group[k].min()) if n_seeds >= 2 else math.nan for k in SCORES}
        complete = (
            n_seeds == len(settings.seeds)
            and bool((group["n_tasks"] == len(settings.tasks)).all())
            and int(group["n_incomplete"].sum()) == 0
        )
        rows.append(
            {
                "system": system,
                "length": length,
                **{k: float(group[k].mean()) for k in SCORES},
                **{f"spread_{k}": spread[k] for k in SCORES},
                "n_seeds": n_seeds,
                "n_per_seed": [int(n) for n in group["n_items"]],
                "complete": complete,
            }
        )
    columns = ["system", "length", *SCORES, *(f"spread_{k}" for k in SCORES), "n_seeds", "n_per_seed", "complete"]
    return pd.DataFrame(rows, columns=columns).set_index(["system", "length"])


def task_means(grid: pd.DataFrame) -> pd.DataFrame:
    """Per (system, task, length): scores averaged over the seeds present; ``complete`` as in :func:`system_means`."""
    present = grid[~grid["status"].isin(NOT_REPORTED)]
    n_expected = grid["seed"].nunique()
    out = present.groupby(["system", "task", "length"], sort=False).agg(
        **{k: (k, "mean") for k in SCORES}, n_seeds=("seed", "count"),
        n_ok_status=("status", lambda s: int((s == "ok").sum())),
    )  # fmt: skip
    out["complete"] = (out["n_seeds"] == n_expected) & (out["n_ok_status"] == out["n_seeds"])
    return out


# --------------------------------------------------------------------------------------------------
# claim check
# --------------------------------------------------------------------------------------------------


def _cell(table: pd.DataFrame, system: str, length: int) -> pd.Series | None:
    key = (system, length)
    return table.loc[key] if key in table.index else None


def _pts(value: float) -> str:
    return f"{value:+.1f}"


def check_claims(
    table: pd.DataFrame, settings: ReportSettings, score: str = "lenient", tag: str = ""
) -> list[ClaimResult]:
    """(a) trained beats baseline beyond the training length by more than the seed spread; (b) far ≈ train length.

    ``table`` is :func:`system_means`' output; all numbers are its ``score`` column in % (the lenient
    primary metric by default, the paper's; ``"in_response"`` for the format-free check). ``tag`` is
    appended to the claim letters, e.g. ``", in-response"`` -> "(a, in-response)". With an empty
    ``table`` both claims cannot be checked.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    trained, baseline, train = settings.trained, settings.baseline, settings.train_chunks
    far, tol = settings.far_chunks, settings.tolerance_points
    beyond = [n for n in settings.lengths if n > train]
    name_a = f"(a{tag}) {trained} beats {baseline} at every length > {train} chunks by more than the seed spread"
    name_b = f"(b{tag}) {trained}'s accuracy at {far} chunks is within {tol:g} points of its accuracy at {train} chunks"
    if table.empty:
        return [ClaimResult(name_a, UNCHECKED, NO_RESULTS), ClaimResult(name_b, UNCHECKED, NO_RESULTS)]
    details, failing, unchecked, incomplete = [], [], [], []
    for n in beyond:
        t_cell, b_cell = _cell(table, trained, n), _cell(table, baseline, n)
        absent = [s for s, c in ((trained, t_cell), (baseline, b_cell)) if c is None]
        if absent:
            unchecked.append(n)
            details.append(f"{n} chunks: no data for {', '.join(absent)}")
            continue
        margin = float(t_cell[score] - b_cell[score])
        spreads = {s: float(c[f"spread_{score}"]) for s, c in ((trained, t_cell), (baseline, b_cell))}
        known = [v for v in spreads.values() if not math.isnan(v)]
        spread_text = ", ".join(f"{s} {MISSING if math.isnan(v) else f'{v:.1f}'}" for s, v in spreads.items())
        if not t_cell["complete"] or not b_cell["complete"]:
            incomplete.append(n)
        line = f"{n} chunks: {trained} {t_cell[score]:.1f}% vs {baseline} {b_cell[score]:.1f}%, margin {_pts(margin)} points"
        if len(known) < 2:
            unchecked.append(n)
            details.append(f"{line}; seed spread unknown (fewer than two seeds: {spread_text}) -> not checked")
            continue
        threshold = max(known)
        ok = margin > threshold
        if not ok:
            failing.append(n)
        verdict = "beats it" if ok else "does NOT beat it by more than the spread"
        details.append(f"{line}; spread {threshold:.1f} (max of {spread_text}) -> {verdict}")
    if not beyond:
        claim_a = ClaimResult(name_a, UNCHECKED, f"No evaluated length is longer than {train} chunks.")
    elif failing:
        claim_a = ClaimResult(name_a, FAILS, f"It fails at {', '.join(map(str, failing))} chunks.", details)
    elif unchecked:
        checked = [n for n in beyond if n not in unchecked]
        where = f"It holds at {', '.join(map(str, checked))} chunks" if checked else "No length could be checked"
        verdict = PARTIAL if checked else UNCHECKED
        claim_a = ClaimResult(
            name_a, verdict, f"{where}; not checked at {', '.join(map(str, unchecked))} chunks.", details
        )
    else:
        claim_a = ClaimResult(name_a, HOLDS, f"At all of {', '.join(map(str, beyond))} chunks.", details)
    if incomplete:
        claim_a.details.append(
            f"cells with missing tasks/seeds/items at {', '.join(map(str, incomplete))} chunks (marked *)"
        )

    f_cell, t_cell = _cell(table, trained, far), _cell(table, trained, train)
    absent = [str(n) for n, c in ((train, t_cell), (far, f_cell)) if c is None]
    if absent:
        claim_b = ClaimResult(name_b, UNCHECKED, f"No {trained} data at {', '.join(absent)} chunks.")
    else:
        diff = float(f_cell[score] - t_cell[score])
        holds = abs(diff) <= tol
        comparison = "<=" if holds else ">"
        summary = (f"{far} chunks: {f_cell[score]:.1f}%, {train} chunks: {t_cell[score]:.1f}%, difference "
                   f"{_pts(diff)} points (|{diff:.1f}| {comparison} {tol:g}).")  # fmt: skip
        claim_b = ClaimResult(name_b, HOLDS if holds else FAILS, summary)
        if not f_cell["complete"] or not t_cell["complete"]:
            claim_b.details.append("computed from incomplete cells (marked *)")
    return [claim_a, claim_b]


# --------------------------------------------------------------------------------------------------
# markdown
# --------------------------------------------------------------------------------------------------


def _markdown_table(header: Sequence[Any], body: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def _pct(value: Any) -> str:
    return MISSING if value is None or (isinstance(value, float) and math.isnan(value)) else f"{float(value):.1f}"


def _score_cell(row: pd.Series | dict | None, keys: Sequence[str] = SCORES) -> str:
    """``lenient / strict / in-response`` of ``row`` (its ``keys`` columns), ``*`` if not complete."""
    if row is None:
        return MISSING
    mark = "" if bool(row.get("complete", True)) else INCOMPLETE_MARK
    return " / ".join(_pct(row[k]) for k in keys) + mark


def _count_label(row: pd.Series | None) -> str:
    if row is None:
        return MISSING
    counts = list(row["n_per_seed"])
    return f"{counts[0]} × {len(counts)}" if len(set(counts)) == 1 else " + ".join(str(c) for c in counts)


def _main_table(table: pd.DataFrame, s: ReportSettings) -> str:
    header = ["system"] + [f"{n} ch" for n in s.lengths]
    body = [[f"`{sys_}`"] + [_score_cell(_cell(table, sys_, n)) for n in s.lengths] for sys_ in s.systems]
    counts = {sys_: [_count_label(_cell(table, sys_, n)) for n in s.lengths] for sys_ in s.systems}
    if len({tuple(c) for c in counts.values()}) == 1:
        body.append(["questions (per seed × seeds)"] + counts[s.systems[0]])
    else:
        body += [[f"questions `{sys_}`"] + c for sys_, c in counts.items()]
    return _markdown_table(header, body)


def _seed_table(seeds: pd.DataFrame, table: pd.DataFrame, s: ReportSettings) -> str:
    header = ["system", "seed"] + [f"{n} ch" for n in s.lengths]
    body = []
    for sys_ in s.systems:
        for seed in s.seeds:
            cells = []
            for n in s.lengths:
                key = (sys_, n, seed)
                row = None
                if key in seeds.index:
                    found = seeds.loc[key]
                    complete = int(found["n_tasks"]) == len(s.tasks) and int(found["n_incomplete"]) == 0
                    row = {**{k: found[k] for k in SCORES}, "complete": complete}
                cells.append(_score_cell(row))
            body.append([f"`{sys_}`", str(seed)] + cells)
        spread = [_score_cell(_cell(table, sys_, n), [f"spread_{k}" for k in SCORES]) for n in s.lengths]
        body.append([f"`{sys_}`", "spread (max − min)"] + [c.rstrip(INCOMPLETE_MARK) for c in spread])
    return _markdown_table(header, body)


def _task_table(tasks: pd.DataFrame, s: ReportSettings) -> str:
    header = ["system", "task", "lenient metric"] + [f"{n} ch" for n in s.lengths]
    body = []
    for sys_ in s.systems:
        for task in s.tasks:
            cells = []
            for n in s.lengths:
                key = (sys_, task, n)
                cells.append(_score_cell(tasks.loc[key] if key in tasks.index else None))
            body.append([f"`{sys_}`", task, primary_metric(task)] + cells)
    return _markdown_table(header, body)


def _missing_lines(grid: pd.DataFrame, s: ReportSettings) -> list[str]:
    """One line per (system, length) with missing or incomplete cells, naming the seeds and tasks."""
    lines = []
    for sys_ in s.systems:
        for n in s.lengths:
            part = grid[(grid["system"] == sys_) & (grid["length"] == n)]
            bad = part[part["status"] != "ok"]
            if bad.empty:
                continue
            if (part["status"] == "missing").all():
                lines.append(f"`{sys_}` at {n} chunks: not run (all tasks, all seeds)")
                continue
            items = []
            for seed in s.seeds:
                seed_bad = bad[bad["seed"] == seed]
                missing = seed_bad[seed_bad["status"] == "missing"]["task"].tolist()
                if len(missing) == len(s.tasks):
                    items.append(f"seed {seed}: not run")
                elif missing:
                    items.append(f"seed {seed}: missing {', '.join(missing)}")
                for _, r in seed_bad[seed_bad["status"] == "incomplete"].iterrows():
                    items.append(
                        f"seed {seed}: {r['task']} has {int(r['n_missing'])} of {int(r['n_items'])} items without a record (scored 0)"
                    )
                for _, r in seed_bad[seed_bad["status"] == "unfinished"].iterrows():
                    done = int(r["n_items"]) - int(r["n_missing"])
                    items.append(
                        f"seed {seed}: {r['task']} unfinished, {done} of {int(r['n_items'])} items done (not reported)"
                    )
            lines.append(f"`{sys_}` at {n} chunks: " + "; ".join(items))
    return lines


def _shown_path(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` when it lies under it, else only its file name (no absolute local path)."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.name


def _without_root(text: str, root: Path) -> str:
    """``text`` with the absolute run root replaced by ``<root>`` (copied files name it, e.g. ``ROOT=/abs/run``)."""
    for form in sorted({str(root.resolve()), str(root.absolute())}, key=len, reverse=True):
        if len(form) > 1:
            text = text.replace(form, "<root>")
    return text


def _read_fact(path: Path, root: Path) -> str:
    """A copied file's text: JSON pretty-printed, cut at ``_MAX_FACT_CHARS``, the absolute root as ``<root>``."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            text = json.dumps(json.loads(text), indent=2, sort_keys=True)
        except json.JSONDecodeError:
            pass
    if len(text) > _MAX_FACT_CHARS:
        text = text[:_MAX_FACT_CHARS] + f"\n... (truncated; {len(text)} characters in all)"
    return _without_root(text, root).rstrip()


def _training_section(log: pd.DataFrame, root: Path) -> list[str]:
    """Reward definition (``meta/reward.txt``, if any), train-reward summary, timing and validation table."""
    parts: list[str] = []
    reward_file = root / REWARD_FILE
    if reward_file.is_file():
        parts += [f"Reward definition (from `{REWARD_FILE.as_posix()}`):", "", _read_fact(reward_file, root), ""]
    if log.empty:
        return parts + [f"No training log at `{TRAIN_LOG.as_posix()}`."]
    parts.append(f"- From `{TRAIN_LOG.as_posix()}` ({len(log)} logged steps).")
    if TRAIN_REWARD_KEY in log:
        reward = log[TRAIN_REWARD_KEY].dropna()
        reward = reward[reward.index > 0]
        if not reward.empty:
            k = min(10, len(reward))
            parts.append(
                f"- Train reward `{TRAIN_REWARD_KEY}` over steps {reward.index.min()}–{reward.index.max()}: "
                f"mean of the first {k} steps {reward.iloc[:k].mean():.3f}, of the last {k} steps {reward.iloc[-k:].mean():.3f} "
                f"(min {reward.min():.3f}, max {reward.max():.3f})."
            )
    if "timing_s/step" in log:
        total = float(log["timing_s/step"].dropna().sum())
        parts.append(f"- Sum of `timing_s/step`: {total:.0f} s ({total / 60:.1f} min; validation time not included).")
    val_keys = [k for k in log.columns if str(k).startswith(VAL_PREFIX)]
    val = log[val_keys].dropna(how="all") if val_keys else pd.DataFrame()
    if not val.empty:
        shown = val if len(val) <= 20 else pd.concat([val.iloc[:10], val.iloc[-10:]])
        body = [[str(step)] + [MISSING if pd.isna(v) else f"{v:.3f}" for v in row] for step, row in shown.iterrows()]
        parts += ["", "Validation (0–1 scale):", "", _markdown_table(["step"] + [f"`{k}`" for k in val_keys], body)]
    return parts


def _facts_section(root: Path, commands: Path | None, hardware: Path | None) -> list[str]:
    """``--hardware``, ``--commands`` and every ``meta/*.json|*.txt`` (except ``reward.txt``) as code blocks."""
    parts: list[str] = []

    def block(title: str, text: str) -> None:
        parts.extend(["", f"### {title}", "", "```", text, "```"])

    shown: set[Path] = {(root / REWARD_FILE).resolve()}
    for title, path in (("Hardware", hardware), ("Commands", commands)):
        if path is not None:
            name = _shown_path(path, root)
            block(f"{title} (`{name}`)", _read_fact(path, root) if path.exists() else f"(file not found: {name})")
            shown.add(path.resolve())
    meta_dir = root / "meta"
    facts = sorted(p for p in meta_dir.glob("*") if p.suffix in (".json", ".txt")) if meta_dir.is_dir() else []
    for path in (p for p in facts if p.resolve() not in shown):
        block(f"`meta/{path.name}`", _read_fact(path, root))
    return parts


def render_markdown(grid: pd.DataFrame, seeds: pd.DataFrame, table: pd.DataFrame, tasks: pd.DataFrame,
                    claims: Sequence[ClaimResult], log: pd.DataFrame, s: ReportSettings, root: Path,
                    commands: Path | None = None, hardware: Path | None = None,
                    format_free_claims: Sequence[ClaimResult] = ()) -> str:  # fmt: skip
    """The whole ``results.md`` (``claims`` on the lenient metric, ``format_free_claims`` on ``in_response``)."""
    metrics = ", ".join(f"{t}: `{primary_metric(t)}`" for t in s.tasks)
    parts = [
        "# Miniature MemAgent reproduction: results",
        "",
        (
            f"Accuracy in % over **all** questions of a cell (failed or unanswered questions score 0), as "
            f"`{SCORES_LABEL}`. Lenient = the evaluation metric of each task ({metrics}), read from the answer "
            f"format the prompt asks for (the paper's metric); strict = `{STRICT_METRIC}`, the training verifier, "
            f"on the same responses; in-response = `{FORMAT_FREE_METRIC}`, format-free: the fraction of gold "
            f"answers that appear anywhere in the raw final response, whatever its format (it shows whether the "
            f"memory kept the answer when the model does not follow the answer format). Length = number of chunks "
            f"of the document; training used documents of <= {s.train_chunks} chunks. "
            f"Seeds: {', '.join(map(str, s.seeds)) or 'none found'}. `{MISSING}` = not run, or stopped with "
            f"more than half of its questions unanswered (not reported); `{INCOMPLETE_MARK}` = incomplete cell (a task, a seed or some questions missing; see below). Paths are relative to the run "
            f"root (`<root>` in copied files)."
        ),
        "",
        "## Claim check",
        "",
        "Numbers: lenient accuracy averaged over the tasks of each seed, then over seeds; spread = max − min over seeds.",
        "",
    ]
    parts += [c.as_markdown() + "\n" for c in claims]
    if format_free_claims:
        parts += ["### Supplementary: the same checks on the format-free score (`in_response`)", "",
                  (f"Not the paper's metric: the same two checks with `{FORMAT_FREE_METRIC}` (gold answer anywhere "
                   "in the final response) in place of the lenient metric, same averaging and spread."), ""]  # fmt: skip
        parts += [c.as_markdown() + "\n" for c in format_free_claims]
    parts += ["## Accuracy vs document length", "", "![accuracy vs chunks](accuracy_vs_chunks.png)", "",
              f"Mean over tasks and seeds ({SCORES_LABEL}, %):", "", _main_table(table, s), ""]  # fmt: skip
    parts += ["## Per seed", "", f"Mean over tasks ({SCORES_LABEL}, %); the spread row is max − min over seeds.", "",
              _seed_table(seeds, table, s), ""]  # fmt: skip
    parts += ["## Per task", "", f"Mean over seeds ({SCORES_LABEL}, %).", "", _task_table(tasks, s), ""]
    parts += ["## Missing or incomplete cells", ""]
    if (grid["status"] == "missing").all():  # also true for an empty grid (no seed folder found)
        parts.append(NO_RESULTS + " Every cell is missing; the claim checks cannot be checked.")
    else:
        missing = _missing_lines(grid, s)
        parts += [f"- {line}" for line in missing] if missing else ["None: every expected cell is complete."]
    parts += ["", "## Training", "", "![training curve](training_curve.png)", ""]
    parts += _training_section(log, root)
    facts = _facts_section(root, commands, hardware)
    if facts:
        parts += ["", "## Run facts"] + facts
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------------------


def write_report(root: str | Path, out: str | Path, settings: ReportSettings | None = None,
                 commands: str | Path | None = None, hardware: str | Path | None = None) -> dict[str, Path]:  # fmt: skip
    """Write ``accuracy_vs_chunks.png``, ``training_curve.png``, ``results.csv`` and ``results.md`` into ``out``."""
    root, out = Path(root), Path(out)
    if not root.is_dir():
        raise FileNotFoundError(f"--root {root} is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    grid, s = build_grid(load_cells(root), settings or ReportSettings())
    seeds = seed_means(grid)
    table = system_means(seeds, s)
    tasks = task_means(grid)
    claims = check_claims(table, s)
    format_free_claims = check_claims(table, s, score="in_response", tag=", in-response")
    log = read_training_log(root / TRAIN_LOG)
    paths = {
        "plot": out / "accuracy_vs_chunks.png",
        "training": out / "training_curve.png",
        "csv": out / "results.csv",
        "markdown": out / "results.md",
    }
    panels = [("lenient", "lenient (task metric)"), ("strict", f"strict ({STRICT_METRIC})"),
              ("in_response", f"format-free ({FORMAT_FREE_METRIC}: answer anywhere in response)")]  # fmt: skip
    plot_accuracy(seeds, table, s, paths["plot"], panels)
    plot_training(log, paths["training"], TRAIN_REWARD_KEY, VAL_PREFIX)
    csv_columns = ["system", "task", "length", "seed", "status", "metric", "n_items", "n_ok", "n_failed", "n_invalid",
                   "n_missing", *SCORES]  # fmt: skip
    grid[csv_columns].round({k: 4 for k in SCORES}).to_csv(paths["csv"], index=False)
    markdown = render_markdown(grid, seeds, table, tasks, claims, log, s, root,
                               Path(commands) if commands else None, Path(hardware) if hardware else None,
                               format_free_claims)  # fmt: skip
    paths["markdown"].write_text(markdown, encoding="utf-8")
    return paths


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _str_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    d = ReportSettings()
    p = argparse.ArgumentParser(description="Tables, plots and claim check of a miniature MemAgent run.")
    p.add_argument("--root", required=True, help="run root with eval/seed*/, train/logs/metrics.jsonl, meta/")
    p.add_argument("--out", required=True, help="folder for the report files (e.g. docs/results)")
    p.add_argument("--commands", help="text file with the commands that produced the run (copied into results.md)")
    p.add_argument("--hardware", help="text file describing the hardware (e.g. nvidia-smi output)")
    p.add_argument("--train-chunks", type=int, default=d.train_chunks, help="training length in chunks")
    p.add_argument(
        "--far-chunks", type=int, default=d.far_chunks, help="length compared with the training length in claim (b)"
    )
    p.add_argument(
        "--tolerance", type=float, default=d.tolerance_points, help="points allowed between far and train length"
    )
    p.add_argument("--systems", type=_str_list, default=list(d.systems), help="expected labels, comma-separated")
    p.add_argument("--tasks", type=_str_list, default=list(d.tasks), help="expected tasks, comma-separated")
    p.add_argument("--lengths", type=_int_list, default=list(d.lengths), help="expected lengths in chunks")
    p.add_argument("--seeds", type=_int_list, default=None, help="expected seeds (default: those found)")
    p.add_argument("--trained", default=d.trained, help="label of the RL-trained system")
    p.add_argument("--baseline", default=d.baseline, help="label of the untrained system in the same workflow")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = ReportSettings(
        systems=args.systems, tasks=args.tasks, lengths=args.lengths, seeds=args.seeds, train_chunks=args.train_chunks,
        far_chunks=args.far_chunks, tolerance_points=args.tolerance, trained=args.trained, baseline=args.baseline,
    )  # fmt: skip
    try:
        paths = write_report(args.root, args.out, settings, args.commands, args.hardware)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

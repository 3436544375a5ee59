"""Report of the miniature MemAgent reproduction: accuracy vs document length, claim checks, tables, curves.

Reads packed runs (``*.jsonl.gz`` of :mod:`recipe.miniature.pack_records`) or run folders of the pipeline, each
holding ONE trained model (``rl-memory``; several training seeds = several runs) and the baselines evaluated on
the same questions. The numbers come from :mod:`recipe.miniature.report_data`; three scores per cell, in %, in
this order: ``lenient`` (the paper's metric: the task's evaluation metric read from ``\\boxed{}``), ``strict``
(the training verifier) and ``whole_word`` (format-free: the gold answer as whole words anywhere in the final
response). Systems with several trained models show the mean over ALL of them and the across-model spread; the
baseline of the claims is the warmed model (``warmed-memory``) when present, else ``untrained-memory``.

Written into ``--out``: ``results.md``, ``results.csv`` (one row per cell, with ``model`` and ``train_seed``),
``runs.csv`` (each run's own cells condensed: the runs' summary table), ``accuracy_vs_chunks.png`` and
``training_curve.png``.

    python -m recipe.miniature.report --records docs/results/records/*.jsonl.gz --out docs/results
    python -m recipe.miniature.report --records runs/miniature --out docs/results   # a run folder, unpacked
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from recipe.miniature.pack_records import RunRecords, load_run
from recipe.miniature.report_data import (
    BOOTSTRAP_RESAMPLES,
    CI_LEVEL,
    NO_RESULTS,
    NOT_REPORTED,
    SCORES,
    ClaimResult,
    ReportData,
    ReportSettings,
    build_report_data,
    chance_floor,
    chance_note,
    check_claims,
    run_summary,
)
from recipe.miniature.report_plots import plot_accuracy, plot_training
from taskutils.memory_eval.scoring import STRICT_METRIC, WHOLE_WORD_METRIC, primary_metric

__all__ = ["ClaimResult", "ReportSettings", "main", "render_markdown", "write_report"]

MISSING = "—"
INCOMPLETE_MARK = "*"
SCORES_LABEL = "paper's lenient / strict / whole-word"
TRAIN_REWARD_KEY = "critic/score/mean"
VAL_PREFIX = "val-core/"
SHOWN_FILES = ("meta/commands.txt", "meta/hardware.txt", "meta/stages.tsv", "meta/rl_checkpoint.txt")
"""Files of a run copied into results.md under "Run facts" (meta/reward.txt goes to the training section)."""
_MAX_FACT_CHARS = 6000


def _markdown_table(header: Sequence[Any], body: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def _pct(value: Any) -> str:
    return MISSING if value is None or (isinstance(value, float) and math.isnan(value)) else f"{float(value):.1f}"


def _scores(row: Any, prefix: str = "", complete: bool = True) -> str:
    if row is None:
        return MISSING
    return " / ".join(_pct(row[f"{prefix}{k}"]) for k in SCORES) + ("" if complete else INCOMPLETE_MARK)


def _cell(table: pd.DataFrame, system: str, length: int) -> pd.Series | None:
    return table.loc[(system, length)] if (system, length) in table.index else None


def _model_label(model: str, runs: Sequence[RunRecords]) -> str:
    seed = next((r.train_seed for r in runs if r.name == model), None)
    return f"{model} (train seed {seed})" if seed is not None else model


# --------------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------------


def _intro(d: ReportData) -> list[str]:
    s = d.settings
    metrics = ", ".join(f"{t}: `{primary_metric(t)}`" for t in s.tasks)
    trained = sorted(set(d.grid.loc[d.grid["system"] == s.trained, "model"]) - {""})
    models = ", ".join(_model_label(m, d.runs) for m in trained) or "none"
    return [
        "# Miniature MemAgent reproduction: results",
        "",
        (f"Accuracy in % over **all** questions of a cell (failed or unanswered questions score 0), as `{SCORES_LABEL}`, "
         f"in that order. **Paper's lenient** = the paper's metric: each task's evaluation metric ({metrics}) read from "
         f"the `\\boxed{{}}` the prompt asks for; **strict** = `{STRICT_METRIC}`, the training verifier, on the same "
         f"responses; **whole-word** = `{WHOLE_WORD_METRIC}`, format-free: the gold answer anywhere in the final "
         "response as whole words, case-insensitive (`Castel` does not match `Castell`). Length = chunks of the "
         f"document; training used documents of <= {s.train_chunks} chunks. Evaluation seeds (question sets): "
         f"{', '.join(map(str, s.seeds)) or 'none found'}."),
        "",
        (f"Trained system `{s.trained}`: one model per run, {len(trained)} in all: {models}. Its numbers are the "
         "mean over **all** its models measured at that length (no best-of); spread = max − min over them. "
         f"Baseline of the claims and the paired intervals: `{s.baseline}`. `{MISSING}` = not run, or stopped with "
         f"more than half of its questions unanswered; `{INCOMPLETE_MARK}` = some questions without a record "
         "(scored 0). Runs: " + ", ".join(f"`{r.name}`" for r in d.runs) + "."),
        "",
    ]  # fmt: skip


def _claims_section(d: ReportData) -> list[str]:
    parts = ["## Claim check (the paper's metric)", "",
             ("Numbers: paper's lenient accuracy, mean over tasks and evaluation seeds of each model, then over the "
              f"models; spread = max − min over the trained models; paired {CI_LEVEL:.0%} CI = bootstrap over the "
              "same questions (see \"Paired comparison\")."), ""]  # fmt: skip
    parts += [c.as_markdown() + "\n" for c in check_claims(d)]
    parts += ["### Supplementary: the same checks on the whole-word score", "",
              "Not the paper's metric: the gold answer as whole words anywhere in the final response.", ""]  # fmt: skip
    parts += [c.as_markdown() + "\n" for c in check_claims(d, score="whole_word", tag=", whole-word")]
    return parts


def _main_table(d: ReportData) -> str:
    s, table = d.settings, d.table
    header = ["system"] + [f"{n} ch" for n in s.lengths]
    body = []
    for sys_ in s.systems:
        cells = [_cell(table, sys_, n) for n in s.lengths]
        body.append(
            [f"`{sys_}`"] + [_scores(c, complete=bool(c["complete"])) if c is not None else MISSING for c in cells]
        )
        if sys_ == s.trained:
            body.append(
                [f"`{sys_}` spread (max − min over models)"]
                + [_scores(c, "spread_") if c is not None else MISSING for c in cells]
            )
            body.append(
                [f"`{sys_}` models measured"] + [str(int(c["n_models"])) if c is not None else "0" for c in cells]
            )
    return _markdown_table(header, body)  # fmt: skip


def _model_table(d: ReportData) -> str:
    s, m = d.settings, d.models
    header = ["system", "model"] + [f"{n} ch" for n in s.lengths]
    body = []
    for sys_, model in d.grid[["system", "model"]].drop_duplicates().itertuples(index=False):
        rows = m[(m["system"] == sys_) & (m["model"] == model)].set_index("length")
        cells = []
        for n in s.lengths:
            if n not in rows.index:
                cells.append(MISSING)
                continue
            r = rows.loc[n]
            text = _scores(r, complete=bool(r["complete"]))
            cells.append(text if bool(r["counted"]) else f"({text}; {int(r['n_cells'])} cells, not counted)")
        body.append([f"`{sys_}`", _model_label(model, d.runs) if model else "(one model)"] + cells)
    return _markdown_table(header, body)


def _paired_table(d: ReportData) -> str:
    header = ["length", "questions"] + [
        f"{name}: diff [{CI_LEVEL:.0%} CI]" for name in ("paper's lenient", "strict", "whole-word")
    ]
    body = []
    for n, r in d.paired.iterrows():
        cells = [f"{r[f'diff_{k}']:+.1f} [{r[f'low_{k}']:+.1f}, {r[f'high_{k}']:+.1f}]" for k in SCORES]
        body.append([f"{n} ch", str(int(r["n_questions"]))] + cells)
    return _markdown_table(header, body) if body else "No length with both systems measured."  # fmt: skip


def _task_table(d: ReportData) -> str:
    s, tasks = d.settings, d.tasks
    header = ["system", "task", "paper's metric", "chance floor %"] + [f"{n} ch" for n in s.lengths]
    body = []
    for sys_ in s.systems:
        for task in s.tasks:
            cells = []
            for n in s.lengths:
                key = (sys_, task, n)
                row = tasks.loc[key] if key in tasks.index else None
                cells.append(MISSING if row is None else _scores(row, complete=bool(row["complete"])))
            body.append([f"`{sys_}`", task, f"`{primary_metric(task)}`", f"{chance_floor(task):.2g}"] + cells)
    return _markdown_table(header, body)


def _chance_lines(d: ReportData) -> list[str]:
    tasks = d.settings.tasks
    mean = sum(chance_floor(t) for t in tasks) / len(tasks) if tasks else math.nan
    lines = [f"- {t}: {chance_floor(t):.2g}% ({chance_note(t)})" for t in tasks]
    return lines + [f"- mean over the {len(tasks)} tasks: {mean:.2f}%"]


def _missing_lines(d: ReportData) -> list[str]:
    """Per (system, model, length) with a cell not ok: what is missing, in one line."""
    s, grid = d.settings, d.grid
    lines = []
    for (sys_, model), part_model in grid.groupby(["system", "model"], sort=False):
        who = f"`{sys_}`" + (f" {model}" if model else "")
        for n in s.lengths:
            part = part_model[part_model["length"] == n]
            bad = part[part["status"] != "ok"]
            if bad.empty:
                continue
            if (part["status"] == "missing").all():
                lines.append(f"{who} at {n} chunks: not run")
                continue
            if (part["status"] == "unfinished").all():
                done = (part["n_items"] - part["n_missing"]).astype(int).tolist()
                lines.append(f"{who} at {n} chunks: stopped before the end, {sum(done)} of "
                             f"{int(part['n_items'].sum())} questions done (not counted)")  # fmt: skip
                continue
            items = []
            for _, r in bad.iterrows():
                where = f"seed {r['seed']} {r['task']}"
                if r["status"] == "missing":
                    items.append(f"{where}: not run")
                elif r["status"] == "incomplete":
                    items.append(f"{where}: {int(r['n_missing'])} of {int(r['n_items'])} without a record (scored 0)")
                else:
                    items.append(
                        f"{where}: unfinished, {int(r['n_items']) - int(r['n_missing'])} of {int(r['n_items'])} done"
                    )
            counted = not bool(part["status"].isin(NOT_REPORTED).any())
            lines.append(
                f"{who} at {n} chunks: " + "; ".join(items) + ("" if counted else " (not counted at this length)")
            )
    return lines  # fmt: skip


def _training_lines(run: RunRecords) -> list[str]:
    by_step = run.training_by_step()
    if not by_step:
        return [f"- `{run.name}`: no training metrics."]
    log = pd.DataFrame([by_step[k] for k in sorted(by_step)]).set_index("step").apply(pd.to_numeric, errors="coerce")
    parts = [f"- `{run.name}`: {len([k for k in by_step if k > 0])} steps logged"]
    if TRAIN_REWARD_KEY in log:
        reward = log[TRAIN_REWARD_KEY].dropna()
        reward = reward[reward.index > 0]
        if not reward.empty:
            k = min(10, len(reward))
            parts.append(f"train reward `{TRAIN_REWARD_KEY}` mean of the first {k} steps {reward.iloc[:k].mean():.3f}, "
                         f"of the last {k} {reward.iloc[-k:].mean():.3f} (max {reward.max():.3f})")  # fmt: skip
    if "timing_s/step" in log:
        total = float(log["timing_s/step"].dropna().sum())
        parts.append(f"sum of `timing_s/step` {total:.0f} s")
    val_keys = [c for c in log.columns if str(c).startswith(VAL_PREFIX)]
    for key in val_keys:
        val = log[key].dropna()
        if not val.empty:
            points = ", ".join(f"{int(i)}: {v:.3f}" for i, v in val.items())
            parts.append(f"`{key}` by step {points}")
    return ["; ".join(parts) + "."]


def _fact(text: str) -> str:
    if len(text) > _MAX_FACT_CHARS:
        text = text[:_MAX_FACT_CHARS] + f"\n... (truncated; {len(text)} characters in all)"
    return text.rstrip()


def _facts_section(d: ReportData) -> list[str]:
    parts = ["## Run facts: commands, hardware, stage times", "",
             ("Each run's files, verbatim as the run wrote them (the folders they name are those of the run's "
              "time; the pack holds what the report reads)."), ""]  # fmt: skip
    for run in d.runs:
        shown = [p for p in SHOWN_FILES if p in run.files]
        parts += [f"### `{run.name}`", ""]
        if not shown:
            parts += ["(no meta files)", ""]
        for path in shown:
            text = run.files[path]
            if path.endswith(".json"):
                text = json.dumps(json.loads(text), indent=2, sort_keys=True)
            parts += [f"`{path}`:", "", "```", _fact(text), "```", ""]
    return parts


def render_markdown(d: ReportData) -> str:
    """The whole ``results.md``."""
    parts = _intro(d) + _claims_section(d)
    parts += ["## Accuracy vs document length", "", "![accuracy vs chunks](accuracy_vs_chunks.png)", "",
              f"Mean over tasks and evaluation seeds, then over the models measured ({SCORES_LABEL}, %):", "",
              _main_table(d), ""]  # fmt: skip
    parts += ["## Per model", "",
              (f"Each model's mean over tasks and evaluation seeds ({SCORES_LABEL}, %). A model with some cells "
               "of a length not run or unfinished is not counted in that length's mean (shown in brackets)."), "",
              _model_table(d), ""]  # fmt: skip
    parts += ["## Paired comparison with the baseline", "",
              (f"`{d.settings.trained}` (mean over its models) minus `{d.settings.baseline}`, question by question on "
               f"the same questions, in points; {CI_LEVEL:.0%} CI = percentile interval of {BOOTSTRAP_RESAMPLES:,} "
               "bootstrap resamples of the questions (the spread across trained models is not in it; see the claims)."),
              "", _paired_table(d), ""]  # fmt: skip
    parts += ["## Per task", "", f"Mean over the counted models of each model's mean over seeds ({SCORES_LABEL}, %).",
              "", _task_table(d), "", "Chance floors (a guess uniform over the answers the data generator draws from, "
              "`taskutils/memory_data/synthetic_qa.py`), in %:", ""] + _chance_lines(d) + [""]  # fmt: skip
    parts += ["## Missing or incomplete cells", ""]
    if (d.grid["status"] == "missing").all():
        parts.append(NO_RESULTS + " Every cell is missing; the claims cannot be checked.")
    else:
        missing = _missing_lines(d)
        parts += [f"- {line}" for line in missing] if missing else ["None: every expected cell is complete."]
    parts += ["", "## Training", "", "![training curve](training_curve.png)", ""]
    for run in d.runs:
        if "meta/reward.txt" in run.files:
            parts += [f"Reward of `{run.name}` (`meta/reward.txt`):", "", _fact(run.files["meta/reward.txt"]), ""]
    trained_runs = [r for r in d.runs if (d.grid["model"] == r.name).any()]
    parts += [line for r in trained_runs for line in _training_lines(r)] or ["No trained model."]
    parts += [""] + _facts_section(d)
    return "\n".join(parts).rstrip() + "\n"


# --------------------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------------------


def write_report(
    sources: Sequence[str | Path], out: str | Path, settings: ReportSettings | None = None
) -> dict[str, Path]:
    """Write every report file into ``out`` from packed runs or run folders ``sources`` (one trained model each)."""
    runs = [load_run(src) for src in sources]
    d = build_report_data(runs, settings)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"plot": out / "accuracy_vs_chunks.png", "training": out / "training_curve.png",
             "csv": out / "results.csv", "runs": out / "runs.csv", "markdown": out / "results.md"}  # fmt: skip
    panels = [("lenient", "paper's metric (lenient, from \\boxed{})"), ("strict", f"strict ({STRICT_METRIC})"),
              ("whole_word", "format-free (gold as whole words in the response)")]  # fmt: skip
    floor = sum(chance_floor(t) for t in d.settings.tasks) / max(1, len(d.settings.tasks))
    plot_accuracy(d.models, d.table, d.settings, paths["plot"], panels, floor)
    logs = {}
    for run in runs:
        by_step = run.training_by_step()
        if by_step and (d.grid["model"] == run.name).any():
            logs[run.name] = pd.DataFrame([by_step[k] for k in sorted(by_step)]).set_index("step")
    plot_training(logs, paths["training"], TRAIN_REWARD_KEY, VAL_PREFIX)
    columns = ["system", "model", "train_seed", "run", "task", "length", "seed", "status", "metric", "n_items", "n_ok",
               "n_failed", "n_invalid", "n_missing", *SCORES]  # fmt: skip
    d.grid[columns].round({k: 4 for k in SCORES}).to_csv(paths["csv"], index=False)
    run_summary(runs, d.settings).to_csv(paths["runs"], index=False)
    paths["markdown"].write_text(render_markdown(d), encoding="utf-8")
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
    p = argparse.ArgumentParser(description="Tables, plots and claim checks of miniature MemAgent runs.")
    p.add_argument(
        "--records", nargs="+", default=[], help="packed runs (*.jsonl.gz) or run folders, one trained model each"
    )
    p.add_argument("--root", action="append", default=[], help="a run folder (same as giving it to --records)")
    p.add_argument("--out", required=True, help="folder for the report files (e.g. docs/results)")
    p.add_argument("--train-chunks", type=int, default=d.train_chunks, help="training length in chunks")
    p.add_argument(
        "--far-chunks", type=int, default=d.far_chunks, help="length compared with the training length in claim (b)"
    )
    p.add_argument("--tolerance", type=float, default=d.tolerance_points, help="points allowed in claim (b)")
    p.add_argument("--systems", type=_str_list, default=list(d.systems), help="expected labels, comma-separated")
    p.add_argument("--tasks", type=_str_list, default=list(d.tasks), help="expected tasks, comma-separated")
    p.add_argument("--lengths", type=_int_list, default=list(d.lengths), help="expected lengths in chunks")
    p.add_argument("--seeds", type=_int_list, default=None, help="expected evaluation seeds (default: those found)")
    p.add_argument("--trained", default=d.trained, help="label of the RL-trained system (one model per run)")
    p.add_argument(
        "--baselines",
        type=_str_list,
        default=list(d.baselines),
        help="baseline labels in order of preference; the first one found is the claims' baseline",
    )
    return p  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sources = list(args.records) + list(args.root)
    if not sources:
        print("error: give --records (packed runs or run folders) or --root", file=sys.stderr)
        return 2
    missing = [src for src in sources if not Path(src).exists()]
    if missing:
        print(f"error: not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    settings = ReportSettings(
        systems=args.systems, tasks=args.tasks, lengths=args.lengths, seeds=args.seeds, train_chunks=args.train_chunks,
        far_chunks=args.far_chunks, tolerance_points=args.tolerance, trained=args.trained, baselines=args.baselines,
    )  # fmt: skip
    try:
        paths = write_report(sources, args.out, settings)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

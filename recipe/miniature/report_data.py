"""The numbers of the miniature report (:mod:`recipe.miniature.report`): per-question scores from packed runs,
cells, per-model and per-system means, the across-model spread, paired bootstrap intervals, chance floors and
the claim checks.

Inputs are :class:`recipe.miniature.pack_records.RunRecords`, one per run. Each run holds ONE trained model (the
``trained`` system's records; model id = the run's name, with its training seed); every other system (the
untrained or warmed baseline, the direct baseline) is one model evaluated on the same questions in every run, so
each of its cells is taken from one run: the one with the most records, the later run on a tie.

Scores per question, in [0, 1] (a question without a finished record scores 0, as in the harness summary):

* ``lenient``: the task's evaluation metric read from the answer format the prompt asks for (``\\boxed{}``):
  the paper's metric (``sub_em`` for multidoc_qa, ``string_match_all`` for the rest);
* ``strict``: the training verifier (``strict_boxed``);
* ``whole_word``: format-free, the gold answer anywhere in the final response as whole words
  (:func:`taskutils.memory_eval.scoring.whole_word_match`), recomputed from the stored response.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from recipe.miniature.make_data import EVAL_LENGTHS
from recipe.miniature.pack_records import RunRecords
from taskutils.memory_data.synthetic_qa import DEFAULT_KINDS, MULTIKEY_NEEDLES, answer_options
from taskutils.memory_eval.scoring import STRICT_METRIC, primary_metric, whole_word_match

__all__ = [
    "ClaimResult",
    "ReportData",
    "ReportSettings",
    "bootstrap_mean_ci",
    "build_report_data",
    "chance_floor",
    "check_claims",
    "mean_chance_floor",
]

SCORES = ("lenient", "strict", "whole_word")  # score columns, in the order every table shows them
NOT_REPORTED = ("missing", "unfinished")
"""Cell states shown as no number: never run, or stopped with more than half of the items undone."""
PASS, FAIL, UNCHECKED, PARTIAL = "PASS", "FAIL", "NOT CHECKED", "PASS where checked, NOT CHECKED elsewhere"
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
CI_LEVEL = 0.95
NO_RESULTS = "No evaluation results were found (no packed run or run folder with evaluation records)."


@dataclass
class ReportSettings:
    """What the report expects to find and how it checks the claims."""

    systems: Sequence[str] = ("warmed-memory", "untrained-memory", "rl-memory", "untrained-direct")
    tasks: Sequence[str] = DEFAULT_KINDS
    lengths: Sequence[int] = EVAL_LENGTHS
    seeds: Sequence[int] | None = None  # evaluation seeds; None: those found
    train_chunks: int = 8
    far_chunks: int = 512
    tolerance_points: float = 10.0
    trained: str = "rl-memory"
    baselines: Sequence[str] = ("warmed-memory", "untrained-memory")  # the first one found is THE baseline
    baseline: str = ""  # resolved by build_report_data


@dataclass
class ClaimResult:
    """Verdict (PASS, FAIL, NOT CHECKED, PARTIAL) of one claim with its measured numbers."""

    name: str
    verdict: str
    summary: str
    details: list[str] = field(default_factory=list)

    def as_markdown(self) -> str:
        return "\n".join([f"**{self.name}: {self.verdict}.** {self.summary}"] + [f"  - {d}" for d in self.details])


@dataclass
class ReportData:
    """Every frame the report writes (scores in %), built by :func:`build_report_data`."""

    settings: ReportSettings
    runs: list[RunRecords]
    grid: pd.DataFrame  # one row per expected cell (system, model, task, length, seed), with status
    items: pd.DataFrame  # one row per (system, model, task, length, seed, qid) of a reported cell, scores 0/1
    models: pd.DataFrame  # per (system, model, length): mean over tasks and seeds, counted, complete
    table: pd.DataFrame  # per (system, length): mean over counted models, spread, n_models
    tasks: pd.DataFrame  # per (system, task, length): mean over the counted models of the seed means
    paired: pd.DataFrame  # per length: trained - baseline on the same questions, mean and CI per score


def chance_floor(task: str) -> float:
    """Chance floor of ``task`` in %: a uniform guess over the task's answers (the data generator's options)."""
    return 100.0 / answer_options(task)


def mean_chance_floor(tasks: Sequence[str]) -> float:
    """Mean of the tasks' chance floors in % (the floor of a score averaged over the tasks)."""
    return sum(chance_floor(t) for t in tasks) / len(tasks) if tasks else 0.0


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def chance_note(task: str) -> str:
    options = answer_options(task)
    if task == "multidoc_qa":
        return f"1 of the {options} options of the relation asked"
    note = f"1 of {options:,} numbers"
    if task == "niah_multikey":
        note += f" ({100 / MULTIKEY_NEEDLES:.0f}% by naming one of the {MULTIKEY_NEEDLES} numbers in the document)"
    return note


# --------------------------------------------------------------------------------------------------
# cells and questions
# --------------------------------------------------------------------------------------------------


def _record_scores(record: dict[str, Any], task: str) -> dict[str, float]:
    if record.get("status", "ok") != "ok":
        return dict.fromkeys(SCORES, 0.0)
    return {
        "lenient": float(record.get(f"judge_{primary_metric(task)}", 0.0) or 0.0),
        "strict": float(record.get(f"judge_{STRICT_METRIC}", 0.0) or 0.0),
        "whole_word": whole_word_match(record.get("response"), record.get("answers") or []),
    }


def _cells_of(run: RunRecords) -> dict[tuple, dict[str, Any]]:
    """``{(label, task, length, seed): {"meta", "records"}}`` of one run."""
    cells: dict[tuple, dict[str, Any]] = {}
    for c in run.cells:
        meta = c["meta"]
        key = (str(meta["label"]), str(meta["task"]), int(meta["length"]), int(c["seed"]))
        cells[key] = {"meta": meta, "records": {}}
    for r in run.records:
        rec = r["record"]
        key = (str(rec.get("label")), str(rec.get("task")), int(rec.get("length", 0)), int(r["seed"]))
        cells.setdefault(key, {"meta": {}, "records": {}})["records"][int(rec.get("_id", -1))] = rec
    return cells


def _ordered(preferred: Sequence[Any], found: Sequence[Any]) -> list[Any]:
    extra = sorted(set(found) - set(preferred), key=str)
    return list(dict.fromkeys(list(preferred) + extra))


def _score_cell(cell: dict[str, Any], task: str) -> tuple[dict[str, Any], list[tuple[int, dict[str, float]]]]:
    """Counts and % scores of one cell (also ``in_response``, the substring score the whole-word one replaces),
    and the per-question scores; ``n_items`` from the meta, questions without a finished record score 0."""
    meta, records = cell["meta"], cell["records"]
    n_items = int(meta.get("n_items", len(records)))
    statuses = [r.get("status", "ok") for r in records.values()]
    questions = []
    for qid in sorted(set(range(n_items)) | set(records)):
        rec = records.get(qid)
        questions.append((qid, _record_scores(rec, task) if rec is not None else dict.fromkeys(SCORES, 0.0)))
    denominator = max(n_items, len(records), 1)
    ok = [r for r in records.values() if r.get("status", "ok") == "ok"]
    summary = {
        "n_items": n_items,
        "n_ok": statuses.count("ok"),
        "n_failed": statuses.count("error"),
        "n_invalid": statuses.count("invalid"),
        "n_missing": max(0, n_items - len(records)),
        **{k: 100.0 * sum(q[k] for _, q in questions) / denominator for k in SCORES},
        "in_response": 100.0 * sum(float(r.get("judge_in_response", 0.0) or 0.0) for r in ok) / denominator,
    }
    return summary, questions


def run_summary(runs: Sequence[RunRecords], s: ReportSettings) -> pd.DataFrame:
    """The condensed table of every run: per (run, system, length), each run's OWN cells (as its own report
    showed them): scores in % averaged over the reported cells, how many of the expected cells were reported,
    and the trained model's training steps."""
    rows = []
    expected = len(s.tasks) * len(s.seeds)
    for run in runs:
        steps = [int(k) for k in run.training_by_step() if int(k) > 0]
        per: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for (label, task, length, _seed), cell in _cells_of(run).items():
            summary, _ = _score_cell(cell, task)
            per.setdefault((label, length), []).append(summary)
        for (label, length), cells in sorted(per.items(), key=lambda kv: (_rank(s.systems, kv[0][0]), kv[0][1])):
            shown = [c for c in cells if c["n_missing"] <= c["n_items"] / 2]
            rows.append(
                {
                    "run": run.name,
                    "train_seed": run.train_seed if label == s.trained else None,
                    "train_steps": max(steps) if steps and label == s.trained else None,
                    "system": label,
                    "length": length,
                    "cells_reported": len(shown),
                    "cells_expected": expected,
                    "n_items": sum(c["n_items"] for c in shown),
                    **{k: round(float(np.mean([c[k] for c in shown])), 2) if shown else None
                       for k in (*SCORES, "in_response")},
                }
            )  # fmt: skip
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame[["train_seed", "train_steps"]] = frame[["train_seed", "train_steps"]].astype("Int64")
    return frame


def _rank(order: Sequence[str], name: str) -> tuple[int, str]:
    return (list(order).index(name), name) if name in order else (len(order), name)


def _collect(runs: Sequence[RunRecords], trained: str) -> tuple[list[dict], list[dict]]:
    """Cell rows and question rows of every model: trained = one per run, others = one cell source per cell."""
    chosen: dict[tuple, tuple[RunRecords, dict]] = {}
    cell_rows, item_rows = [], []
    for run in runs:
        for key, cell in _cells_of(run).items():
            label, task, length, seed = key
            if label == trained:
                chosen[(label, run.name, task, length, seed)] = (run, cell)
                continue
            prev = chosen.get((label, "", task, length, seed))
            if prev is None or len(cell["records"]) >= len(prev[1]["records"]):  # most records; later run on a tie
                chosen[(label, "", task, length, seed)] = (run, cell)
    for (label, model, task, length, seed), (run, cell) in chosen.items():
        summary, questions = _score_cell(cell, task)
        for qid, row in questions:
            item_rows.append({"system": label, "model": model, "task": task, "length": length, "seed": seed,
                              "qid": qid, **row})  # fmt: skip
        cell_rows.append({"system": label, "model": model, "run": run.name, "task": task, "length": length,
                          "seed": seed, **summary})  # fmt: skip
    return cell_rows, item_rows


def _grid(cells: pd.DataFrame, s: ReportSettings, runs: Sequence[RunRecords]) -> pd.DataFrame:
    """Every expected cell with ``status`` ok | incomplete | unfinished | missing (see the report's docstring)."""
    ran = set(cells.loc[cells["system"] == s.trained, "model"])
    trained_models = [r.name for r in runs if r.name in ran]
    rows = []
    for system in s.systems:
        for model in trained_models if system == s.trained else [""]:
            for task in s.tasks:
                for length in s.lengths:
                    for seed in s.seeds:
                        rows.append((system, model, task, length, seed))
    grid = pd.DataFrame(rows, columns=["system", "model", "task", "length", "seed"])
    grid = grid.merge(cells, on=["system", "model", "task", "length", "seed"], how="left")
    seeds = {r.name: r.train_seed for r in runs}
    grid["train_seed"] = [seeds.get(m) if sys_ == s.trained else None for sys_, m in zip(grid["system"], grid["model"])]
    grid["train_seed"] = grid["train_seed"].astype("Int64")
    grid["metric"] = [primary_metric(t) for t in grid["task"]]
    counts = ["n_items", "n_ok", "n_failed", "n_invalid", "n_missing"]
    grid[counts] = grid[counts].astype("Int64")
    grid["status"] = "ok"
    grid.loc[grid["n_items"].isna(), "status"] = "missing"
    grid.loc[grid["n_missing"].fillna(0) > 0, "status"] = "incomplete"
    grid.loc[grid["n_missing"].fillna(0) > grid["n_items"].fillna(0) / 2, "status"] = "unfinished"
    return grid


# --------------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------------


def _model_means(grid: pd.DataFrame, s: ReportSettings) -> pd.DataFrame:
    """Per (system, model, length): mean over its reported cells; ``counted`` iff every task and seed is reported."""
    expected = len(s.tasks) * len(s.seeds)
    rows = []
    for (system, model, length), part in grid.groupby(["system", "model", "length"], sort=False):
        shown = part[~part["status"].isin(NOT_REPORTED)]
        if shown.empty:
            continue
        rows.append(
            {
                "system": system,
                "model": model,
                "length": int(length),
                **{k: float(shown[k].mean()) for k in SCORES},
                "n_cells": len(shown),
                "n_items": int(shown["n_items"].sum()),
                "counted": len(shown) == expected,
                "complete": len(shown) == expected and bool((shown["status"] == "ok").all()),
            }
        )
    columns = ["system", "model", "length", *SCORES, "n_cells", "n_items", "counted", "complete"]
    return pd.DataFrame(rows, columns=columns)


def _system_table(models: pd.DataFrame) -> pd.DataFrame:
    """Per (system, length): mean over the counted models, across-model spread (max - min; NaN for one model)."""
    rows = []
    for (system, length), part in models[models["counted"].astype(bool)].groupby(["system", "length"], sort=False):
        n = len(part)
        rows.append(
            {
                "system": system,
                "length": int(length),
                **{k: float(part[k].mean()) for k in SCORES},
                **{f"spread_{k}": float(part[k].max() - part[k].min()) if n >= 2 else math.nan for k in SCORES},
                **{f"min_{k}": float(part[k].min()) for k in SCORES},
                **{f"max_{k}": float(part[k].max()) for k in SCORES},
                "n_models": n,
                "models": list(part["model"]),
                "complete": bool(part["complete"].all()),
            }
        )
    columns = ["system", "length", *SCORES, *(f"{p}_{k}" for p in ("spread", "min", "max") for k in SCORES),
               "n_models", "models", "complete"]  # fmt: skip
    return pd.DataFrame(rows, columns=columns).set_index(["system", "length"])


def _task_table(grid: pd.DataFrame, models: pd.DataFrame) -> pd.DataFrame:
    """Per (system, task, length): over the models counted at that length, mean of each model's seed mean."""
    counted = models[models["counted"].astype(bool)][["system", "model", "length"]]
    part = grid.merge(counted, on=["system", "model", "length"], how="inner")
    per_model = part.groupby(["system", "task", "length", "model"], sort=False).agg(
        **{k: (k, "mean") for k in SCORES}, ok=("status", lambda x: bool((x == "ok").all()))
    )
    out = per_model.groupby(level=["system", "task", "length"], sort=False).agg(
        **{k: (k, "mean") for k in SCORES}, n_models=("ok", "count"), complete=("ok", "all")
    )
    return out


def bootstrap_mean_ci(diffs: Sequence[float], level: float = CI_LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = BOOTSTRAP_SEED) -> tuple[float, float, float]:  # fmt: skip
    """``(mean, low, high)`` of paired differences: the percentile interval of the means of ``resamples``
    resamples of the questions with replacement (numpy generator ``seed``: the same inputs give the same interval).

    Example: ``[1, 0, 0, 0, 0, 0, 0, 0, 0, 0]``: a resample's mean is Binomial(10, 0.1) / 10, whose CDF is
    0.349, 0.736, 0.930, 0.987 at 0, 0.1, 0.2, 0.3, so the 95% interval is (0.0, 0.3) around the mean 0.1.
    """
    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(d.mean()), float(low), float(high)


def _paired(items: pd.DataFrame, models: pd.DataFrame, s: ReportSettings) -> pd.DataFrame:
    """Per length: trained (mean over its counted models) minus baseline, question by question, with a CI."""
    rows = []
    counted = models[models["counted"].astype(bool)]
    for length in s.lengths:
        sides = {}
        for system in (s.trained, s.baseline):
            names = counted[(counted["system"] == system) & (counted["length"] == length)]["model"]
            part = items[(items["system"] == system) & (items["length"] == length) & items["model"].isin(names)]
            if part.empty:
                break
            sides[system] = part.groupby(["seed", "task", "qid"])[list(SCORES)].mean()
        if len(sides) < 2:
            continue
        both = sides[s.trained].merge(sides[s.baseline], left_index=True, right_index=True, suffixes=("_t", "_b"))
        both = both.sort_index()
        row: dict[str, Any] = {"length": length, "n_questions": len(both)}
        for k in SCORES:
            mean, low, high = bootstrap_mean_ci((both[f"{k}_t"] - both[f"{k}_b"]).to_numpy())
            row.update({f"diff_{k}": 100 * mean, f"low_{k}": 100 * low, f"high_{k}": 100 * high})
        rows.append(row)
    columns = ["length", "n_questions", *(f"{p}_{k}" for k in SCORES for p in ("diff", "low", "high"))]
    return pd.DataFrame(rows, columns=columns).set_index("length")


def build_report_data(runs: Sequence[RunRecords], settings: ReportSettings | None = None) -> ReportData:
    """All frames of the report from ``runs`` (trained system: one model per run)."""
    s = ReportSettings(**(settings or ReportSettings()).__dict__)
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"two runs have the same name ({names}): each run's trained model needs its own name")
    cell_rows, item_rows = _collect(runs, s.trained)
    cells = pd.DataFrame(cell_rows, columns=["system", "model", "run", "task", "length", "seed", "n_items", "n_ok",
                                             "n_failed", "n_invalid", "n_missing", *SCORES, "in_response"])  # fmt: skip
    found_systems = cells["system"].tolist()
    s.baseline = next((b for b in s.baselines if b in set(found_systems)), s.baselines[-1])
    shown = [x for x in s.systems if x in set(found_systems) or x in (s.trained, s.baseline)]
    s.systems = _ordered(shown, found_systems)
    s.tasks = _ordered(s.tasks, cells["task"].tolist())
    s.lengths = sorted({int(n) for n in s.lengths} | {int(n) for n in cells["length"]})
    s.seeds = sorted({int(x) for x in (s.seeds or [])} | {int(x) for x in cells["seed"]})
    grid = _grid(cells, s, runs)
    items = pd.DataFrame(item_rows, columns=["system", "model", "task", "length", "seed", "qid", *SCORES])
    reported = grid[~grid["status"].isin(NOT_REPORTED)][["system", "model", "task", "length", "seed"]]
    items = items.merge(reported, on=["system", "model", "task", "length", "seed"], how="inner")
    models = _model_means(grid, s)
    return ReportData(s, list(runs), grid, items, models, _system_table(models), _task_table(grid, models),
                      _paired(items, models, s))  # fmt: skip


# --------------------------------------------------------------------------------------------------
# claims
# --------------------------------------------------------------------------------------------------


def _cell(table: pd.DataFrame, system: str, length: int) -> pd.Series | None:
    return table.loc[(system, length)] if (system, length) in table.index else None


def _model_values(data: ReportData, system: str, length: int, score: str) -> str:
    part = data.models[(data.models["system"] == system) & (data.models["length"] == length)]
    part = part[part["counted"].astype(bool)]
    return ", ".join(f"{m} {v:.1f}" for m, v in zip(part["model"], part[score]))


def check_claims(data: ReportData, score: str = "lenient", tag: str = "") -> list[ClaimResult]:
    """(a) the trained system beats the baseline at every length beyond training by more than the across-model
    spread; (b) its accuracy at ``far_chunks`` is within ``tolerance_points`` of its accuracy at ``train_chunks``.

    Numbers are ``score`` in % (the paper's lenient metric by default). (a) needs at least two trained models at
    a length (the spread of one model is unknown: NOT CHECKED there). (b) compares the models measured at both
    lengths, so that the same models stand on both sides.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    s, table = data.settings, data.table
    trained, baseline, train, far, tol = s.trained, s.baseline, s.train_chunks, s.far_chunks, s.tolerance_points
    beyond = [n for n in s.lengths if n > train]
    name_a = (
        f"(a{tag}) {trained} beats {baseline} at every length > {train} chunks by more than the across-model spread"
    )
    name_b = f"(b{tag}) {trained} at {far} chunks is within {tol:g} points of {trained} at {train} chunks"
    if table.empty:
        return [ClaimResult(name_a, UNCHECKED, NO_RESULTS), ClaimResult(name_b, UNCHECKED, NO_RESULTS)]
    details, failing, unchecked = [], [], []
    for n in beyond:
        t_cell, b_cell = _cell(table, trained, n), _cell(table, baseline, n)
        absent = [x for x, c in ((trained, t_cell), (baseline, b_cell)) if c is None]
        if absent:
            unchecked.append(n)
            details.append(f"{n} chunks: not measured for {', '.join(absent)}")
            continue
        margin = float(t_cell[score] - b_cell[score])
        line = (f"{n} chunks: {trained} {t_cell[score]:.1f}% (mean of {_n(int(t_cell['n_models']), 'model')}: "
                f"{_model_values(data, trained, n, score)}) vs {baseline} {b_cell[score]:.1f}%, margin {margin:+.1f} points")  # fmt: skip
        if n in data.paired.index:
            p = data.paired.loc[n]
            line += f" (paired {CI_LEVEL:.0%} CI {p[f'low_{score}']:+.1f} to {p[f'high_{score}']:+.1f})"
        spread = float(t_cell[f"spread_{score}"])
        if math.isnan(spread):
            unchecked.append(n)
            details.append(f"{line}; across-model spread unknown (one trained model) -> not checked")
            continue
        ok = margin > spread
        if not ok:
            failing.append(n)
        details.append(f"{line}; across-model spread {spread:.1f} -> " + ("beats it" if ok else "does NOT beat it"))
    if not beyond:
        claim_a = ClaimResult(name_a, UNCHECKED, f"No evaluated length is longer than {train} chunks.")
    elif failing:
        claim_a = ClaimResult(name_a, FAIL, f"It fails at {', '.join(map(str, failing))} chunks.", details)
    elif unchecked:
        checked = [n for n in beyond if n not in unchecked]
        verdict = PARTIAL if checked else UNCHECKED
        where = f"It holds at {', '.join(map(str, checked))} chunks; n" if checked else "N"
        claim_a = ClaimResult(
            name_a, verdict, f"{where}ot checked at {', '.join(map(str, unchecked))} chunks.", details
        )
    else:
        claim_a = ClaimResult(name_a, PASS, f"At all of {', '.join(map(str, beyond))} chunks.", details)

    both = data.models[data.models["system"] == trained]
    both = both[both["counted"].astype(bool)].pivot_table(index="model", columns="length", values=score, sort=False)
    both = both[[c for c in (train, far) if c in both.columns]].dropna() if not both.empty else both
    if both.empty or far not in both.columns or train not in both.columns:
        claim_b = ClaimResult(name_b, UNCHECKED, f"No {trained} model was measured at both {train} and {far} chunks.")
    else:
        f_mean, t_mean = float(both[far].mean()), float(both[train].mean())
        diff = f_mean - t_mean
        floor = mean_chance_floor(s.tasks)
        above = t_mean > floor
        holds = abs(diff) <= tol and above
        summary = (f"Over the {_n(len(both), 'model')} measured at both lengths: {far} chunks {f_mean:.1f}%, {train} chunks "
                   f"{t_mean:.1f}%, difference {diff:+.1f} points (|{diff:.1f}| {'<=' if abs(diff) <= tol else '>'} {tol:g}).")  # fmt: skip
        if not above:
            summary += (f" At {train} chunks it is not above the chance floor ({floor:.2f}%, mean over the tasks): "
                        "there is no accuracy to keep, so the claim fails whatever the difference.")  # fmt: skip
        details_b = [f"{m}: {train} chunks {r[train]:.1f}%, {far} chunks {r[far]:.1f}%" for m, r in both.iterrows()]
        claim_b = ClaimResult(name_b, PASS if holds else FAIL, summary, details_b)
    return [claim_a, claim_b]

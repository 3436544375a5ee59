"""recipe.miniature.report and pack_records on fake runs written with the harness's own ResultStore/write_meta and
the trainer's jsonl logger: the packed file round-trips (byte-identical, the same report as the folder); tables
(paper's lenient / strict / whole-word) against hand-computed means over ALL trained models and their spread;
the claim checks with hand-computed PASS/FAIL; the paired bootstrap interval against hand values; the whole-word
score (Castel is not Castell); the chance floors from the data generator; and the committed report regenerates
byte for byte from the committed packs by the command docs/results/README.md lists."""

from __future__ import annotations

import csv
import gzip
import json
import shlex
from pathlib import Path

import pytest

from recipe.miniature import pack_records, report
from recipe.miniature.report_data import ReportSettings, bootstrap_mean_ci, build_report_data, check_claims
from taskutils.memory_data import synthetic_qa
from taskutils.memory_eval.results import ResultStore, result_paths, write_meta
from taskutils.memory_eval.scoring import score_response, whole_word_match
from verl.utils.tracking import Tracking

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TASKS = ["niah_single", "multidoc_qa"]  # paper's metric: string_match_all, sub_em
LENGTHS = [8, 32, 512]
GOLD = {"niah_single": "4826", "multidoc_qa": "Castel"}
WRONG = {"niah_single": "14826", "multidoc_qa": "Mara Castell"}  # substrings of the gold's neighbours, not the gold


def _write_cell(out_dir: Path, task: str, length: int, label: str, correct: int, n_items: int = 4,
                whole_word: int | None = None, n_records: int = 4) -> None:  # fmt: skip
    """``n_items`` questions in the meta, ``n_records`` records: the first ``correct`` right on the paper's
    (lenient) metric, one fewer strict, the first ``whole_word`` (default ``correct + 1``) with the gold as a whole
    word in the response; the others answer a string that merely contains the gold (judge_in_response = 1)."""
    whole_word = min(n_records, correct + 1) if whole_word is None else whole_word
    results_path, meta_path = result_paths(out_dir, task, length, label)
    write_meta(meta_path, {"task": task, "length": length, "label": label, "model": "m", "method": "recurrent-boxed",
                           "data_file": "x.json", "n_items": n_items, "n_invalid": 0})  # fmt: skip
    primary = "sub_em" if task == "multidoc_qa" else "string_match_all"
    other = "string_match_all" if primary == "sub_em" else "sub_em"
    store = ResultStore(results_path)
    store.open(force=True)
    with store:
        for i in range(n_records):
            right = i < correct
            response = f"The answer is {GOLD[task]}." if i < whole_word else f"It is {WRONG[task]}."
            store.append({"_id": i, "task": task, "length": length, "label": label, "status": "ok",
                          "answers": [GOLD[task]], "response": response,
                          f"judge_{primary}": float(right), f"judge_{other}": float(not right),  # the other metric differs
                          "judge_strict_boxed": float(i < correct - 1), "judge_in_response": 1.0})  # fmt: skip


# Correct answers (paper's metric) out of 4 questions per cell, by (run, system, task, seed), one per length of
# LENGTHS (None = not run). Two trained models (rl-memory in runA and runB); the untrained baseline in runB.
COUNTS = {
    ("runA", "rl-memory", "niah_single", 1): [4, 4, 3],
    ("runA", "rl-memory", "niah_single", 2): [4, 3, 3],
    ("runA", "rl-memory", "multidoc_qa", 1): [3, 3, 3],
    ("runA", "rl-memory", "multidoc_qa", 2): [3, 2, 3],
    ("runB", "rl-memory", "niah_single", 1): [4, 2, 1],
    ("runB", "rl-memory", "niah_single", 2): [4, 2, 1],
    ("runB", "rl-memory", "multidoc_qa", 1): [2, 2, 1],
    ("runB", "rl-memory", "multidoc_qa", 2): [2, 2, 1],
    ("runB", "untrained-memory", "niah_single", 1): [1, 0, 0],
    ("runB", "untrained-memory", "niah_single", 2): [1, 0, 0],
    ("runB", "untrained-memory", "multidoc_qa", 1): [1, 0, 0],
    ("runB", "untrained-memory", "multidoc_qa", 2): [1, 0, 0],
}
SETTINGS = ReportSettings(systems=["untrained-memory", "rl-memory"], tasks=TASKS, lengths=LENGTHS)
ARGS = ["--systems", "untrained-memory,rl-memory", "--tasks", ",".join(TASKS), "--lengths", "8,32,512"]


def _make_runs(tmp_path: Path, counts: dict = COUNTS, seeds: dict | None = None) -> list[Path]:
    """Run folders (one per run name in ``counts``), each with its training seed in meta/train_seed.txt."""
    roots: dict[str, Path] = {}
    for (run, system, task, seed), per_length in counts.items():
        root = roots.setdefault(run, tmp_path / run)
        for length, correct in zip(LENGTHS, per_length):
            if correct is not None:
                _write_cell(root / "eval" / f"seed{seed}", task, length, system, correct)
    for k, (run, root) in enumerate(sorted(roots.items())):
        (root / "meta").mkdir(parents=True, exist_ok=True)
        (root / "meta" / "train_seed.txt").write_text(f"{(seeds or {}).get(run, k + 1)}\n")
    return [roots[r] for r in sorted(roots)]


def _log_training(root: Path) -> None:
    tracker = Tracking("p", "e", default_backend="jsonl", log_dir=root / "train" / "logs")
    tracker.log({"val-core/memory/reward/mean@1": 0.10}, step=0)
    for step in range(1, 31):
        metrics = {"critic/score/mean": step / 100, "timing_s/step": 2.0}
        if step % 10 == 0:
            metrics["val-core/memory/reward/mean@1"] = 0.1 + step / 100
        tracker.log(metrics, step=step)
    tracker.log({"critic/score/mean": 0.5, "timing_s/step": 2.0, "val-core/memory/reward/mean@1": 0.45}, step=30)
    tracker.finish()


def _table(markdown: str, heading: str) -> list[list[str]]:
    """Rows (cells stripped) of the first markdown table after ``heading``."""
    rows, started = [], False
    for line in markdown.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            started = True
            if not line.startswith("|---"):
                rows.append([c.strip() for c in line.strip("|").split("|")])
        elif started:
            break
    assert rows, f"no table after {heading!r}"
    return rows


def _by_first_cells(rows: list[list[str]], n_key: int) -> dict[tuple, dict[str, str]]:
    return {tuple(r[:n_key]): dict(zip(rows[0], r)) for r in rows[1:]}


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


# --------------------------------------------------------------------------------------------------
# scores
# --------------------------------------------------------------------------------------------------


def test_whole_word_score_is_not_a_substring_test():
    assert whole_word_match("He lives in Castell.", ["Castel"]) == 0.0  # the substring test says 1
    assert score_response("He lives in Castell.", ["Castel"], "boxed")["in_response"] == 1.0
    assert score_response("He lives in Castell.", ["Castel"], "boxed")["whole_word"] == 0.0
    assert whole_word_match("He lives in castel.", ["Castel"]) == 1.0  # case-insensitive, punctuation is a boundary
    assert whole_word_match("Castel-on-sea", ["Castel"]) == 1.0
    assert whole_word_match("number 14826", ["4826"]) == 0.0 and whole_word_match("(4826)", ["4826"]) == 1.0
    assert whole_word_match("in New York City", ["new york", "Boston"]) == 0.5  # fraction of golds, like RULER's
    assert (
        whole_word_match(None, ["x"]) == 0.0 and whole_word_match("x", []) == 0.0 and whole_word_match("x", [""]) == 0.0
    )


def test_chance_floors_come_from_the_data_generator():
    # multidoc_qa: every relation of the generator has 10 options; the numbers are 100..9999
    assert {len(set(opts)) for _, _, opts in synthetic_qa._RELATIONS.values()} == {10}
    assert synthetic_qa.answer_options("multidoc_qa") == 10
    assert synthetic_qa.answer_options("niah_single") == 9999 - 100 + 1
    assert synthetic_qa.answer_options("variable_tracking") == 9900
    with pytest.raises(ValueError, match="unknown synthetic QA kind"):
        synthetic_qa.answer_options("nope")


def test_bootstrap_interval_against_hand_values():
    # d = [1, 0 x 9]: a resample's mean is Binomial(10, 0.1)/10 with CDF 0.3487 (0), 0.7361 (0.1), 0.9298 (0.2),
    # 0.9872 (0.3): the 2.5% quantile is 0 and the 97.5% quantile 0.3
    mean, low, high = bootstrap_mean_ci([1] + [0] * 9)
    assert (mean, low, high) == (pytest.approx(0.1), 0.0, pytest.approx(0.3))
    # d = [1, -1]: the resample means are -1, 0, 1 with probabilities 1/4, 1/2, 1/4 -> interval (-1, 1)
    assert bootstrap_mean_ci([1, -1]) == (0.0, -1.0, 1.0)
    # every difference equal: no spread at all
    assert bootstrap_mean_ci([0.5] * 7) == (pytest.approx(0.5), pytest.approx(0.5), pytest.approx(0.5))
    assert bootstrap_mean_ci([1, 0, 1, 1]) == bootstrap_mean_ci([1, 0, 1, 1])  # seeded: the same numbers


# --------------------------------------------------------------------------------------------------
# packing
# --------------------------------------------------------------------------------------------------


def test_pack_round_trip_is_byte_identical_and_reports_like_the_folder(tmp_path):
    root = _make_runs(tmp_path)[0]
    _log_training(root)
    (root / "meta" / "commands.txt").write_text("ROOT=/tmp/mini bash recipe/miniature/pipeline.sh all\n")
    first, second = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    assert pack_records.main(["--root", str(root), "--out", str(first)]) == 0
    pack_records.write_pack(pack_records.read_pack(first), second)
    assert first.read_bytes() == second.read_bytes()  # no time stamp in the gzip header, sorted rows and keys
    run = pack_records.read_pack(first)
    assert (run.name, run.train_seed) == ("runA", 1)
    assert len(run.cells) == 2 * 2 * 3 and len(run.records) == 4 * len(run.cells)
    assert run.training_by_step()[30]["critic/score/mean"] == pytest.approx(0.5)  # the re-logged step wins
    assert len(run.train) == 32  # every line kept
    assert run.files["meta/commands.txt"].startswith("ROOT=/tmp/mini")
    with gzip.open(first, "rt") as fh:
        assert json.loads(fh.readline()) == {"type": "run", "format": 1, "name": "runA", "train_seed": 1}

    out_pack, out_dir = tmp_path / "from_pack", tmp_path / "from_dir"
    assert report.main(["--records", str(first), "--out", str(out_pack)] + ARGS) == 0
    assert report.main(["--root", str(root), "--out", str(out_dir)] + ARGS) == 0
    for name in ("results.md", "results.csv", "runs.csv"):
        assert (out_pack / name).read_bytes() == (out_dir / name).read_bytes(), name
    assert pack_records.main(["--root", str(tmp_path / "nope"), "--out", str(tmp_path / "x.jsonl.gz")]) == 2
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as fh:
        fh.write(json.dumps({"type": "run", "format": 1, "name": "x"}) + "\n" + json.dumps({"type": "oops"}) + "\n")
    with pytest.raises(ValueError, match="line 2 has unknown type 'oops'"):
        pack_records.read_pack(bad)
    with gzip.open(bad, "wt") as fh:
        fh.write(json.dumps({"type": "run", "format": 99, "name": "x"}) + "\n")
    with pytest.raises(ValueError, match="pack format 99"):
        pack_records.read_pack(bad)


# --------------------------------------------------------------------------------------------------
# tables and claims
# --------------------------------------------------------------------------------------------------


def test_tables_average_all_trained_models_with_their_spread(tmp_path):
    roots = _make_runs(tmp_path)
    _log_training(roots[0])
    out = tmp_path / "results"
    assert report.main(["--records", *map(str, roots), "--out", str(out)] + ARGS) == 0
    md = (out / "results.md").read_text()

    main = _by_first_cells(_table(md, "## Accuracy vs document length"), 1)
    # 8 chunks, paper's metric: runA cells 4,4,3,3 of 4 -> 87.5; runB 4,4,2,2 -> 75; mean 81.25, spread 12.5.
    # strict (one fewer): runA 3,3,2,2 -> 62.5, runB 3,3,1,1 -> 50 -> 56.25; whole-word (one more, at most 4):
    # runA 4,4,4,4 -> 100, runB 4,4,3,3 -> 87.5 -> 93.75
    assert main[("`rl-memory`",)]["8 ch"] == "81.2 / 56.2 / 93.8"
    assert main[("`rl-memory` spread (max − min over models)",)]["8 ch"] == "12.5 / 12.5 / 12.5"
    # 512: runA 3,3,3,3 -> 75, runB 1,1,1,1 -> 25: mean 50, spread 50
    assert main[("`rl-memory`",)]["512 ch"].startswith("50.0 / ")
    assert main[("`rl-memory` spread (max − min over models)",)]["512 ch"].startswith("50.0 / ")
    assert main[("`rl-memory` models measured",)]["32 ch"] == "2"
    assert main[("`untrained-memory`",)]["8 ch"] == "25.0 / 0.0 / 50.0"  # 1 right of 4; whole-word 2 of 4

    models = _by_first_cells(_table(md, "## Per model"), 2)
    assert models[("`rl-memory`", "runA (train seed 1)")]["32 ch"] == "75.0 / 50.0 / 93.8"  # 4,3,3,2; strict 3,2,2,1
    assert models[("`rl-memory`", "runB (train seed 2)")]["32 ch"] == "50.0 / 25.0 / 75.0"

    tasks = _by_first_cells(_table(md, "## Per task"), 2)
    # multidoc_qa at 32 chunks: runA seeds 3, 2 -> 62.5; runB 2, 2 -> 50; mean 56.25
    assert tasks[("`rl-memory`", "multidoc_qa")]["32 ch"].startswith("56.2 / ")
    assert tasks[("`rl-memory`", "multidoc_qa")]["chance floor %"] == "10"
    assert tasks[("`rl-memory`", "niah_single")]["chance floor %"] == "0.01"
    assert "multidoc_qa: 10% (1 of the 10 options of the relation asked)" in md

    paired = _by_first_cells(_table(md, "## Paired comparison with the baseline"), 1)
    # the paired mean difference is the margin of the tables: 32 chunks 62.5 - 0
    assert paired[("32 ch",)]["questions"] == "16"
    assert paired[("32 ch",)]["paper's lenient: diff [95% CI]"].startswith("+62.5 [")

    with (out / "results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0])[:4] == ["system", "model", "train_seed", "run"]
    assert {"lenient", "strict", "whole_word", "metric"} <= set(rows[0])
    assert {r["train_seed"] for r in rows if r["system"] == "rl-memory"} == {"1", "2"}
    assert len(rows) == (1 + 2) * 2 * 3 * 2  # (untrained + 2 rl models) x tasks x lengths x seeds
    row = next(r for r in rows if (r["model"], r["task"], r["length"], r["seed"]) == ("runA", "multidoc_qa", "32", "2"))
    assert (row["metric"], float(row["lenient"]), float(row["strict"]), float(row["whole_word"])) == (
        "sub_em", 50.0, 25.0, 75.0)  # fmt: skip
    with (out / "runs.csv").open() as fh:
        runs = list(csv.DictReader(fh))
    a8 = next(r for r in runs if (r["run"], r["system"], r["length"]) == ("runA", "rl-memory", "8"))
    assert (float(a8["lenient"]), a8["train_steps"], a8["in_response"]) == (87.5, "30", "100.0")
    _check_png(out / "accuracy_vs_chunks.png")
    _check_png(out / "training_curve.png")


def test_claim_checks_with_hand_computed_outcomes(tmp_path):
    runs = [pack_records.pack_run(r) for r in _make_runs(tmp_path)]
    a, b = check_claims(build_report_data(runs, SETTINGS))
    # (a) 32 chunks: margin 62.5 - 0 = 62.5 > spread 25 (75 vs 50); 512: margin 50 - 0 = 50, NOT > spread 50
    assert a.verdict == "FAIL" and a.summary == "It fails at 512 chunks."
    assert a.details[0].startswith("32 chunks: rl-memory 62.5% (mean of 2 models: runA 75.0, runB 50.0) vs "
                                   "untrained-memory 0.0%, margin +62.5 points")  # fmt: skip
    assert a.details[0].endswith("across-model spread 25.0 -> beats it")
    assert a.details[1].endswith("across-model spread 50.0 -> does NOT beat it")
    # (b) both models at 8 and 512: runA 87.5 -> 75, runB 75 -> 25: 50 - 81.25 = -31.25
    assert (
        b.verdict == "FAIL" and "512 chunks 50.0%, 8 chunks 81.2%, difference -31.2 points (|-31.2| > 10)" in b.summary
    )
    assert b.details == ["runA: 8 chunks 87.5%, 512 chunks 75.0%", "runB: 8 chunks 75.0%, 512 chunks 25.0%"]

    # both models flat and far above the baseline: runA 3 right everywhere, runB 3 at 8 and 32, 2 at 512
    flat = {k: ([3, 3, 3] if k[1] == "rl-memory" and k[0] == "runA" else [3, 3, 2] if k[1] == "rl-memory" else v)
            for k, v in COUNTS.items()}  # fmt: skip
    runs = [pack_records.pack_run(r) for r in _make_runs(tmp_path / "flat", flat)]
    a, b = check_claims(build_report_data(runs, SETTINGS))
    # (a) 32: 75 - 0 > spread 0; 512: (75 + 50)/2 = 62.5 - 0 > spread 25. (b) 62.5 - 75 = -12.5 -> > 10: FAIL
    assert a.verdict == "PASS" and a.summary == "At all of 32, 512 chunks."
    assert b.verdict == "FAIL" and "difference -12.5 points" in b.summary
    b_loose = check_claims(build_report_data(runs, ReportSettings(**{**SETTINGS.__dict__, "tolerance_points": 15})))[1]
    assert b_loose.verdict == "PASS" and "(|-12.5| <= 15)" in b_loose.summary


def test_claims_on_a_model_that_learned_nothing_and_on_one_model(tmp_path):
    zero = {k: [0, 0, 0] for k in COUNTS}  # the paper's metric at 0 everywhere (SmolLM2 never writes \boxed{})
    runs = [pack_records.pack_run(r) for r in _make_runs(tmp_path, zero)]
    a, b = check_claims(build_report_data(runs, SETTINGS))
    assert a.verdict == "FAIL" and "margin +0.0 points (paired 95% CI +0.0 to +0.0)" in a.details[0]
    # 0 at 8 chunks and 0 at 512: the difference is within 10 points, but there is nothing to keep; the floor is
    # the mean over the two tasks of 100/10 (multidoc_qa) and 100/9900 (niah_single): 5.005
    assert b.verdict == "FAIL" and "(|0.0| <= 10)" in b.summary and "not above the chance floor (5.01%" in b.summary

    one = {k: v for k, v in COUNTS.items() if k[0] == "runB"}  # one trained model: its spread is unknown
    runs = [pack_records.pack_run(r) for r in _make_runs(tmp_path / "one", one)]
    a, _ = check_claims(build_report_data(runs, SETTINGS))
    assert a.verdict == "NOT CHECKED" and "across-model spread unknown (one trained model)" in a.details[0]


def test_baseline_cells_come_from_the_fullest_run_and_the_warmed_model_is_the_baseline(tmp_path):
    counts = dict(COUNTS)
    for task in TASKS:  # runA holds the untrained model too, with better counts, but one cell has fewer records
        for seed in (1, 2):
            counts[("runA", "untrained-memory", task, seed)] = [2, 2, 2]
    roots = _make_runs(tmp_path, counts)
    _write_cell(roots[0] / "eval" / "seed1", "niah_single", 32, "untrained-memory", 2, n_records=3)
    d = build_report_data([pack_records.pack_run(r) for r in roots], SETTINGS)
    untrained = d.grid[d.grid["system"] == "untrained-memory"]
    picked = untrained.set_index(["task", "length", "seed"])["run"]
    assert picked[("niah_single", 32, 1)] == "runB"  # runB has all 4 records there
    assert picked[("niah_single", 8, 1)] == "runB"  # a tie goes to the later run
    assert d.settings.baseline == "untrained-memory"

    for task in TASKS:  # a warmed model (format SFT) becomes the baseline when present
        for length in LENGTHS:
            for seed in (1, 2):
                _write_cell(roots[1] / "eval" / f"seed{seed}", task, length, "warmed-memory", 1)
    d = build_report_data([pack_records.pack_run(r) for r in roots], ReportSettings(tasks=TASKS, lengths=LENGTHS))
    assert d.settings.baseline == "warmed-memory" and d.settings.systems[0] == "warmed-memory"
    a = check_claims(d)[0]
    assert "vs warmed-memory 25.0%" in a.details[0]  # 1 right of 4


def test_unfinished_and_missing_cells_are_not_counted(tmp_path):
    counts = {k: (v[:2] + [None] if k[:2] == ("runB", "rl-memory") else v) for k, v in COUNTS.items()}
    roots = _make_runs(tmp_path, counts)
    for seed in (1, 2):  # runB stopped at 512 chunks with 1 of 16 questions done in each cell
        for task in TASKS:
            _write_cell(roots[1] / "eval" / f"seed{seed}", task, 512, "rl-memory", 1, n_items=16, n_records=1)
    paths = report.write_report(roots, tmp_path / "out", SETTINGS)
    md = paths["markdown"].read_text()
    main = _by_first_cells(_table(md, "## Accuracy vs document length"), 1)
    assert main[("`rl-memory` models measured",)]["512 ch"] == "1"
    assert main[("`rl-memory`",)]["512 ch"].startswith("75.0 / ")  # runA alone
    assert "`rl-memory` runB at 512 chunks: stopped before the end, 4 of 64 questions done (not counted)" in md
    assert "across-model spread unknown (one trained model) -> not checked" in md


def test_empty_and_bad_inputs(tmp_path, capsys):
    (tmp_path / "run" / "eval").mkdir(parents=True)
    out = tmp_path / "results"
    assert report.main(["--root", str(tmp_path / "run"), "--out", str(out)]) == 0
    md = (out / "results.md").read_text()
    claims = md.split("## Claim check", 1)[1].split("## Accuracy", 1)[0]
    assert claims.count("NOT CHECKED") == 4 and "PASS" not in claims
    assert "Every cell is missing; the claims cannot be checked." in md
    for name in ("accuracy_vs_chunks.png", "training_curve.png"):
        _check_png(out / name)
    assert report.main(["--records", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "nope" in capsys.readouterr().err
    assert report.main(["--out", str(out)]) == 2
    roots = _make_runs(tmp_path / "dup")
    assert report.main(["--records", str(roots[0]), str(roots[0]), "--out", str(out)]) == 2  # two runs named runA
    assert "same name" in capsys.readouterr().err


def test_training_and_run_facts(tmp_path):
    roots = _make_runs(tmp_path)
    _log_training(roots[0])
    (roots[0] / "meta" / "reward.txt").write_text("1 iff the last \\boxed{} equals a gold answer, else 0\n")
    (roots[0] / "meta" / "hardware.txt").write_text("NVIDIA H200, 143771 MiB\n")
    (roots[0] / "meta" / "stages.tsv").write_text("train\t501\t0\n")
    md = report.write_report(roots, tmp_path / "out", SETTINGS)["markdown"].read_text()
    # first 10 steps: 0.01..0.10 -> 0.055; last 10: 0.21..0.29 and the re-logged 0.5 -> 0.275
    assert "- `runA`: 30 steps logged; train reward `critic/score/mean` mean of the first 10 steps 0.055, of the " \
           "last 10 0.275 (max 0.500); sum of `timing_s/step` 60 s" in md  # fmt: skip
    assert "`val-core/memory/reward/mean@1` by step 0: 0.100, 10: 0.200, 20: 0.300, 30: 0.450" in md
    assert "- `runB`: no training metrics." in md
    assert md.count("equals a gold answer") == 1
    assert "`meta/hardware.txt`:\n\n```\nNVIDIA H200, 143771 MiB\n```" in md and "train\t501\t0" in md


# --------------------------------------------------------------------------------------------------
# the committed report
# --------------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"


def _listed_command() -> list[str]:
    """The report command docs/results/README.md lists (the line after the marker comment)."""
    lines = (RESULTS / "README.md").read_text().splitlines()
    start = lines.index("# the report, from the packed records:") + 1
    command = []
    for line in lines[start:]:
        command.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    return shlex.split(" ".join(command))


def test_committed_report_regenerates_from_the_packed_records(tmp_path):
    """docs/results: results.md, results.csv and runs.csv are what the listed command makes of the packs."""
    argv = _listed_command()
    assert argv[:3] == ["python", "-m", "recipe.miniature.report"]
    args = argv[3:]
    out_at = args.index("--out")
    assert args[out_at + 1] == "docs/results"
    args[out_at + 1] = str(tmp_path)
    args = [str(REPO / a) if a.startswith("docs/results/records/") else a for a in args]
    packs = sorted(p.name for p in (RESULTS / "records").glob("*.jsonl.gz"))
    assert [Path(a).name for a in args if a.endswith(".jsonl.gz")] == packs  # every pack, none forgotten
    assert report.main(args) == 0
    for name in ("results.md", "results.csv", "runs.csv"):
        assert (tmp_path / name).read_bytes() == (RESULTS / name).read_bytes(), f"docs/results/{name} is stale"
    with (RESULTS / "results.csv").open() as fh:
        header = next(csv.reader(fh))
    assert header.index("lenient") < header.index("strict") < header.index("whole_word") and "train_seed" in header


def test_docs_results_holds_no_raw_run_folders():
    """The raw per-cell records live only in the packs (git history keeps the old folders)."""
    kept = {p.name for p in RESULTS.iterdir()}
    assert kept == {"README.md", "results.md", "results.csv", "runs.csv", "accuracy_vs_chunks.png",
                    "training_curve.png", "records"}  # fmt: skip
    sizes = [p.stat().st_size for p in RESULTS.rglob("*") if p.is_file()]
    assert sum(sizes) < 2_000_000 and len(sizes) < 20

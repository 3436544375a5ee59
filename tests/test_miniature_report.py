"""recipe.miniature.report on a fake run root written with the harness's own ResultStore/write_meta and the
trainer's jsonl logger: table numbers (lenient / strict / in-response) against hand-computed means, the claim
check on the lenient and on the format-free score, missing cells, no absolute paths in results.md, PNGs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from recipe.miniature import report
from taskutils.memory_eval.results import ResultStore, result_paths, write_meta
from verl.utils.tracking import Tracking

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TASKS = ["niah_single", "multidoc_qa"]  # lenient metric: string_match_all, sub_em
LENGTHS = [1, 8, 32, 128, 512]  # expected lengths also include 2, which is never run
ARGS_BASE = ["--tasks", ",".join(TASKS), "--lengths", "1,2,8,32,128,512"]

# Correct answers out of 4 questions per cell, by (system, task, seed), one entry per length of LENGTHS
# (None = cell not run). Strict score = lenient count - 1 (at least 0); in-response (format-free) score =
# lenient count + 1 (at most 4), unless _write_cell is given another in-response count.
GOOD = {
    ("rl-memory", "niah_single", 1): [4, 4, 4, 4, 3],
    ("rl-memory", "niah_single", 2): [4, 3, 3, 3, 3],
    ("rl-memory", "multidoc_qa", 1): [3, 3, 3, 3, 3],
    ("rl-memory", "multidoc_qa", 2): [3, 3, 3, 2, 3],
    ("untrained-memory", "niah_single", 1): [2, 1, 1, 0, 0],
    ("untrained-memory", "niah_single", 2): [2, 1, 0, 0, 0],
    ("untrained-memory", "multidoc_qa", 1): [1, 1, 0, 0, 0],
    ("untrained-memory", "multidoc_qa", 2): [1, 0, 1, 0, 0],
    ("untrained-direct", "niah_single", 1): [4, 2, 0, 0, None],
    ("untrained-direct", "niah_single", 2): [4, 2, 1, 0, None],
    ("untrained-direct", "multidoc_qa", 1): [2, 1, 0, 0, None],
    ("untrained-direct", "multidoc_qa", 2): [2, 1, 0, 0, None],
}


def _bad() -> dict:
    """GOOD, but rl-memory collapses for seed 2 at 128 chunks and drops at 512 (one 512 cell not run)."""
    bad = {k: list(v) for k, v in GOOD.items()}
    bad[("rl-memory", "niah_single", 2)][3] = 0
    bad[("rl-memory", "multidoc_qa", 2)][3] = 0
    bad[("rl-memory", "niah_single", 1)][4] = 2
    bad[("rl-memory", "multidoc_qa", 1)][4] = 1
    bad[("rl-memory", "niah_single", 2)][4] = 2
    bad[("rl-memory", "multidoc_qa", 2)][4] = None
    return bad


def _write_cell(out_dir: Path, task: str, length: int, label: str, correct: int, n_items: int = 4,
                in_response: int | None = None) -> None:  # fmt: skip
    """``n_items`` questions in the meta, 4 records: the first ``correct`` right (lenient), one fewer strict,
    the first ``in_response`` (default ``correct + 1``) with the answer somewhere in the response."""
    in_response = min(4, correct + 1) if in_response is None else in_response
    results_path, meta_path = result_paths(out_dir, task, length, label)
    write_meta(meta_path, {"task": task, "length": length, "label": label, "model": "m", "method": "recurrent-boxed",
                           "data_file": "x.json", "n_items": n_items, "n_invalid": 0})  # fmt: skip
    primary = "sub_em" if task == "multidoc_qa" else "string_match_all"
    other = "string_match_all" if primary == "sub_em" else "sub_em"
    store = ResultStore(results_path)
    store.open(force=True)
    with store:
        for i in range(4):
            right = i < correct
            store.append({"_id": i, "task": task, "length": length, "label": label, "status": "ok",
                          f"judge_{primary}": float(right), f"judge_{other}": float(not right),  # wrong metric differs
                          "judge_em": 0.0, "judge_f1": 0.0, "judge_strict_boxed": float(i < correct - 1),
                          "judge_in_response": float(i < in_response)})  # fmt: skip


def _make_root(tmp_path: Path, counts: dict, short_cell: bool = False) -> Path:
    root = tmp_path / "run"
    for (system, task, seed), per_length in counts.items():
        for length, correct in zip(LENGTHS, per_length):
            if correct is not None:
                n_items = (
                    5
                    if short_cell and (system, task, seed, length) == ("untrained-memory", "niah_single", 1, 32)
                    else 4
                )
                _write_cell(root / "eval" / f"seed{seed}", task, length, system, correct, n_items)
    return root


def _log_training(root: Path) -> None:
    tracker = Tracking("p", "e", default_backend="jsonl", log_dir=root / "train" / "logs")
    tracker.log({"val-core/memory/reward/mean@1": 0.10}, step=0)
    for step in range(1, 31):
        metrics = {"critic/score/mean": step / 100, "timing_s/step": 2.0}
        if step % 10 == 0:
            metrics["val-core/memory/reward/mean@1"] = 0.1 + step / 100
        tracker.log(metrics, step=step)
    tracker.log(
        {"critic/score/mean": 0.5, "timing_s/step": 2.0, "val-core/memory/reward/mean@1": 0.45}, step=30
    )  # resumed
    tracker.finish()


def _table(markdown: str, heading: str) -> list[list[str]]:
    """Rows (cells stripped) of the first markdown table after ``heading``."""
    section = markdown.split(heading, 1)[1]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    rows, started = [], False
    for line in section.splitlines():
        if line.startswith("|"):
            started = True
            if not line.startswith("|---"):
                rows.append([c.strip() for c in line.strip("|").split("|")])
        elif started:
            break
    assert lines, f"no table after {heading!r}"
    return rows


def _by_first_cells(rows: list[list[str]], n_key: int) -> dict[tuple, dict[str, str]]:
    header = rows[0]
    return {tuple(r[:n_key]): dict(zip(header, r)) for r in rows[1:]}


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_tables_match_hand_computed_means(tmp_path):
    root = _make_root(tmp_path, GOOD)
    _log_training(root)
    out = tmp_path / "results"
    assert report.main(["--root", str(root), "--out", str(out)] + ARGS_BASE) == 0
    md = (out / "results.md").read_text()

    main = _by_first_cells(_table(md, "## Accuracy vs document length"), 1)
    # rl-memory, 1 chunk: lenient seeds (4+3)/8 and (4+3)/8 -> 87.5; strict (3+2)/8 twice -> 62.5;
    # in-response (4+4)/8 twice -> 100
    assert main[("`rl-memory`",)]["1 ch"] == "87.5 / 62.5 / 100.0"
    # 8 chunks: lenient (4+3)/8=87.5, (3+3)/8=75 -> 81.25; strict (3+2)/8=62.5, (2+2)/8=50 -> 56.25; in-resp 100
    assert main[("`rl-memory`",)]["8 ch"] == "81.2 / 56.2 / 100.0"
    # 512: lenient (3+3)/8 both -> 75; strict (2+2)/8 -> 50; in-response (4+4)/8 -> 100
    assert main[("`rl-memory`",)]["512 ch"] == "75.0 / 50.0 / 100.0"
    # untrained-memory, 8: lenient (1+1)/8=25, (1+0)/8=12.5 -> 18.75; strict 0; in-response (2+2)/8=50,
    # (2+1)/8=37.5 -> 43.75
    assert main[("`untrained-memory`",)]["8 ch"] == "18.8 / 0.0 / 43.8"
    assert main[("`untrained-direct`",)]["1 ch"] == "75.0 / 50.0 / 87.5"  # (4+2)/8; strict (3+1)/8; in-resp (4+3)/8
    assert main[("`untrained-direct`",)]["512 ch"] == "—"  # not run
    assert all(row["2 ch"] == "—" for row in main.values())  # length 2 never run
    # question counts: 2 tasks x 4 questions per seed, 2 seeds
    assert main[("questions `rl-memory`",)]["512 ch"] == "8 × 2"
    assert main[("questions `untrained-direct`",)]["512 ch"] == "—"

    seeds = _by_first_cells(_table(md, "## Per seed"), 2)
    assert seeds[("`rl-memory`", "2")]["8 ch"] == "75.0 / 50.0 / 100.0"
    assert seeds[("`rl-memory`", "1")]["8 ch"] == "87.5 / 62.5 / 100.0"
    assert seeds[("`untrained-memory`", "2")]["8 ch"] == "12.5 / 0.0 / 37.5"  # in-response (2+1)/8
    assert seeds[("`rl-memory`", "spread (max − min)")]["8 ch"] == "12.5 / 12.5 / 0.0"
    # 128: lenient 87.5 vs 62.5; in-response seed 1 (4+4)/8=100, seed 2 (4+3)/8=87.5
    assert seeds[("`rl-memory`", "spread (max − min)")]["128 ch"] == "25.0 / 25.0 / 12.5"

    tasks = _by_first_cells(_table(md, "## Per task"), 2)
    # lenient (3+2)/2 of 4; strict (2+1)/2 of 4; in-response (4+3)/2 of 4
    assert tasks[("`rl-memory`", "multidoc_qa")]["128 ch"] == "62.5 / 37.5 / 87.5"
    assert tasks[("`rl-memory`", "multidoc_qa")]["lenient metric"] == "sub_em"
    assert tasks[("`rl-memory`", "niah_single")]["lenient metric"] == "string_match_all"

    with (out / "results.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 3 * 2 * 6 * 2  # systems x tasks x lengths x seeds, missing cells included
    row = next(
        r for r in table if (r["system"], r["task"], r["length"], r["seed"]) == ("rl-memory", "multidoc_qa", "128", "2")
    )
    assert (row["metric"], float(row["lenient"]), float(row["strict"]), float(row["in_response"]), row["n_items"],
            row["status"]) == ("sub_em", 50.0, 25.0, 75.0, "4", "ok")  # fmt: skip
    missing = [r for r in table if r["status"] == "missing"]
    assert len(missing) == 3 * 2 * 2 + 2 * 2  # length 2 everywhere + untrained-direct at 512
    assert all(r["lenient"] == "" and r["in_response"] == "" for r in missing)

    claims, supplementary = md.split("## Claim check", 1)[1].split("## Accuracy", 1)[0].split("### Supplementary", 1)
    assert (
        "(a) rl-memory beats untrained-memory at every length > 8 chunks by more than the seed spread: holds.**"
        in claims
    )
    assert "128 chunks: rl-memory 75.0% vs untrained-memory 0.0%, margin +75.0 points; spread 25.0" in claims
    assert "(b) rl-memory's accuracy at 512 chunks is within 10 points of its accuracy at 8 chunks: holds.**" in claims
    assert "difference -6.2 points" in claims  # 75 - 81.25
    assert "does not hold" not in claims
    # format-free: 128 chunks rl (100 + 87.5)/2 = 93.75 vs untrained (1+1)/8 = 25 both seeds; spread max(12.5, 0)
    assert "in_response" in supplementary.split("\n", 1)[0]
    assert (
        "(a, in-response) rl-memory beats untrained-memory at every length > 8 chunks by more than the seed spread: holds.**"
        in supplementary
    )
    assert "128 chunks: rl-memory 93.8% vs untrained-memory 25.0%, margin +68.8 points; spread 12.5" in supplementary
    assert "(b, in-response) rl-memory's accuracy at 512 chunks is within 10 points" in supplementary
    assert "512 chunks: 100.0%, 8 chunks: 100.0%, difference +0.0 points" in supplementary
    assert "`untrained-direct` at 512 chunks: not run" in md and "`rl-memory` at 2 chunks: not run" in md
    _check_png(out / "accuracy_vs_chunks.png")
    _check_png(out / "training_curve.png")


def test_claim_check_reports_failures_and_incomplete_cells(tmp_path):
    root = _make_root(tmp_path, _bad(), short_cell=True)
    out = tmp_path / "results"
    paths = report.write_report(root, out, report.ReportSettings(tasks=TASKS))
    md = paths["markdown"].read_text()
    claims = md.split("## Claim check", 1)[1].split("## Accuracy", 1)[0]
    # 128: rl seeds 87.5 and 0 -> 43.75, spread 87.5 > margin 43.75 -> fails; 32 and 512 still pass
    assert "by more than the seed spread: does not hold.** It fails at 128 chunks." in claims
    assert "margin +43.8 points; spread 87.5" in claims and "does NOT beat it" in claims
    # 32: untrained niah seed 1 has 1 right of 5 questions (20%) -> seeds 10 and 12.5 -> 11.25
    assert "32 chunks: rl-memory 81.2% vs untrained-memory 11.2%, margin +70.0 points; spread 12.5" in claims
    # 512: rl seed 1 (2+1)/8 = 37.5, seed 2 only niah 2/4 = 50 -> 43.75 (incomplete); (b) 43.75 - 81.25
    assert "of its accuracy at 8 chunks: does not hold.**" in claims
    assert "difference -37.5 points (|-37.5| > 10)" in claims
    assert "computed from incomplete cells" in claims

    main = _by_first_cells(_table(md, "## Accuracy vs document length"), 1)
    # strict: seed 1 (1+0)/8=12.5, seed 2 1/4=25; in-response: seed 1 (3+2)/8=62.5, seed 2 3/4=75 -> 68.75
    assert main[("`rl-memory`",)]["512 ch"] == "43.8 / 18.8 / 68.8*"
    assert main[("`untrained-memory`",)]["32 ch"].endswith("*")
    assert "`rl-memory` at 512 chunks: seed 2: missing multidoc_qa" in md
    assert "seed 1: niah_single has 1 of 5 items without a record (scored 0)" in md
    assert "No training log at `train/logs/metrics.jsonl`." in md
    assert str(tmp_path) not in md
    _check_png(paths["plot"])
    _check_png(paths["training"])  # a placeholder figure when there is no log


def test_claims_not_checked_where_cells_are_missing(tmp_path):
    counts = {k: (v[:4] + [None] if k[0] == "rl-memory" else v) for k, v in GOOD.items()}  # rl-memory never at 512
    root = _make_root(tmp_path, counts)
    md = report.write_report(root, tmp_path / "out", report.ReportSettings(tasks=TASKS))["markdown"].read_text()
    assert (
        "seed spread: holds where measured, not fully checked.** It holds at 32, 128 chunks; not checked at 512" in md
    )
    assert "512 chunks: no data for rl-memory" in md
    assert "8 chunks: cannot be checked.** No rl-memory data at 512 chunks." in md

    one_seed = {k: v for k, v in GOOD.items() if k[2] == 1}
    root = _make_root(tmp_path / "one", one_seed)
    md = report.write_report(root, tmp_path / "out1", report.ReportSettings(tasks=TASKS))["markdown"].read_text()
    assert "seed spread: cannot be checked.**" in md and "seed spread unknown" in md


def test_training_log_and_run_facts(tmp_path):
    root = _make_root(tmp_path, GOOD)
    _log_training(root)
    (root / "meta").mkdir()
    (root / "meta" / "walltime.json").write_text(json.dumps({"train_s": 1234, "out": str(root / "train")}))
    (root / "meta" / "reward.txt").write_text("1 iff the last \\boxed{} equals a gold answer, else 0\n")
    commands = root / "meta" / "commands.txt"  # under the root, like the committed runs' records
    commands.write_text(f"ROOT={root.resolve()} python -m recipe.miniature.train --steps 30\n")
    hardware = tmp_path / "hw.txt"  # outside the root: shown by file name only
    hardware.write_text("NVIDIA H200, 143771 MiB\n")
    log = report.read_training_log(root / "train" / "logs" / "metrics.jsonl")
    assert list(log.index) == list(range(31))
    assert log.loc[30, "critic/score/mean"] == pytest.approx(0.5)  # the re-logged step wins
    assert log["val-core/memory/reward/mean@1"].dropna().to_dict() == pytest.approx(
        {0: 0.1, 10: 0.2, 20: 0.3, 30: 0.45}
    )

    out = tmp_path / "results"
    rc = report.main(["--root", str(root), "--out", str(out), "--commands", str(commands), "--hardware", str(hardware)]
                     + ARGS_BASE)  # fmt: skip
    assert rc == 0
    md = (out / "results.md").read_text()
    # first 10 steps: 0.01..0.10 -> 0.055; last 10: 0.21..0.29 (sum 2.25) and the re-logged 0.5 -> 0.275
    assert "mean of the first 10 steps 0.055, of the last 10 steps 0.275" in md
    assert "Sum of `timing_s/step`: 60 s" in md  # 30 steps x 2 s
    val = _by_first_cells(_table(md, "Validation (0–1 scale):"), 1)
    assert (
        val[("0",)]["`val-core/memory/reward/mean@1`"] == "0.100"
        and val[("30",)]["`val-core/memory/reward/mean@1`"] == "0.450"
    )
    assert "ROOT=<root> python -m recipe.miniature.train --steps 30" in md and "NVIDIA H200, 143771 MiB" in md
    assert '"train_s": 1234' in md and '"out": "<root>/train"' in md
    # paths relative to the root (or the bare file name outside it), never absolute
    assert str(tmp_path) not in md and "/tmp" not in md
    assert "- From `train/logs/metrics.jsonl` (31 logged steps)." in md
    assert "### Commands (`meta/commands.txt`)" in md and "### Hardware (`hw.txt`)" in md
    # the reward definition is copied into the training section once (not repeated under run facts),
    # and meta/commands.txt is not repeated either
    training = md.split("## Training", 1)[1].split("## Run facts", 1)[0]
    assert (
        "Reward definition (from `meta/reward.txt`):\n\n1 iff the last \\boxed{} equals a gold answer, else 0"
        in training
    )
    assert md.count("equals a gold answer") == 1 and md.count("--steps 30") == 1
    _check_png(out / "training_curve.png")


def test_empty_root_and_bad_root(tmp_path, capsys):
    (tmp_path / "run" / "eval").mkdir(parents=True)  # an empty {root}/eval: no seed folder
    out = tmp_path / "results"
    assert report.main(["--root", str(tmp_path / "run"), "--out", str(out)]) == 0
    md = (out / "results.md").read_text()
    assert "cannot be checked" in md and "holds" not in md.split("## Accuracy", 1)[0]
    claims = md.split("## Claim check", 1)[1].split("## Accuracy", 1)[0]
    assert claims.count("No evaluation results were found under the root") == 4  # (a), (b), both metrics
    missing = md.split("## Missing or incomplete cells", 1)[1].split("## Training", 1)[0]
    assert "No evaluation results were found under the root" in missing and "claim checks cannot be checked" in missing
    assert "every expected cell is complete" not in md
    assert str(tmp_path) not in md
    main = _by_first_cells(_table(md, "## Accuracy vs document length"), 1)
    assert main[("`rl-memory`",)]["512 ch"] == "—"
    for name in ("accuracy_vs_chunks.png", "training_curve.png"):
        _check_png(out / name)
    assert report.main(["--root", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "nope" in capsys.readouterr().err


def test_format_free_check_where_the_lenient_metric_is_zero(tmp_path):
    """The SmolLM2 case: no answer in the asked format (lenient 0 everywhere), but answers in the response."""
    in_response = {  # (system, seed) -> in-response count out of 4 per task, by length 8, 32, 512
        ("rl-memory", 1): [3, 3, 2],
        ("rl-memory", 2): [3, 2, 2],
        ("untrained-memory", 1): [2, 1, 0],
        ("untrained-memory", 2): [2, 1, 1],
    }
    root = tmp_path / "run"
    for (system, seed), counts in in_response.items():
        for task in TASKS:
            for length, count in zip([8, 32, 512], counts):
                _write_cell(root / "eval" / f"seed{seed}", task, length, system, 0, in_response=count)
    settings = report.ReportSettings(systems=["rl-memory", "untrained-memory"], tasks=TASKS, lengths=[8, 32, 512])
    md = report.write_report(root, tmp_path / "out", settings)["markdown"].read_text()
    claims, supplementary = md.split("## Claim check", 1)[1].split("## Accuracy", 1)[0].split("### Supplementary", 1)
    # lenient: 0 vs 0 with spread 0 -> margin 0 is not more than the spread
    assert (
        "(a) rl-memory beats untrained-memory" in claims
        and "seed spread: does not hold.** It fails at 32, 512" in claims
    )
    # in-response (both tasks alike, so a seed's mean is count/4): rl 32 -> 75, 50 -> 62.5, spread 25;
    # untrained 32 -> 25 both, spread 0; margin 37.5 > 25. 512: rl 50 both; untrained 0, 25 -> 12.5, spread 25;
    # margin 37.5 > 25
    assert (
        "(a, in-response) rl-memory beats untrained-memory at every length > 8 chunks by more than the seed spread: holds.**"
        in supplementary
    )
    assert "32 chunks: rl-memory 62.5% vs untrained-memory 25.0%, margin +37.5 points; spread 25.0" in supplementary
    assert "512 chunks: rl-memory 50.0% vs untrained-memory 12.5%, margin +37.5 points; spread 25.0" in supplementary
    # (b): rl 8 chunks 75 both seeds; 512: 50 -> difference -25 > 10
    assert (
        "(b, in-response) rl-memory's accuracy at 512 chunks is within 10 points of its accuracy at 8 chunks: does not hold.**"
        in supplementary
    )
    assert "512 chunks: 50.0%, 8 chunks: 75.0%, difference -25.0 points (|-25.0| > 10)" in supplementary
    main = _by_first_cells(_table(md, "## Accuracy vs document length"), 1)
    assert main[("`untrained-memory`",)]["512 ch"] == "0.0 / 0.0 / 12.5"
    assert "None: every expected cell is complete." in md


def test_cells_stopped_with_most_items_undone_are_not_reported(tmp_path):
    """A time-out is not a score: a cell with 4 records of 16 questions shows no number (—), and the
    missing section says how far it got; the claims treat it as not measured."""
    counts = {k: (v[:4] + [None] if k[0] == "rl-memory" else v) for k, v in GOOD.items()}
    root = _make_root(tmp_path, counts)
    for seed in (1, 2):
        for task in TASKS:
            _write_cell(root / "eval" / f"seed{seed}", task, 512, "rl-memory", correct=4, n_items=16)
    md = report.write_report(root, tmp_path / "out", report.ReportSettings(tasks=TASKS))["markdown"].read_text()
    main = _by_first_cells(_table(md, "## Accuracy vs document length"), 1)
    assert main[("`rl-memory`",)]["512 ch"] == "—"
    assert "unfinished, 4 of 16 items done (not reported)" in md
    assert "No rl-memory data at 512 chunks." in md


REPO = Path(__file__).resolve().parents[1]
COMMITTED_RUNS = [
    ("run5", "docs/results"),
    ("run4", "docs/results/run4"),
    ("run3", "docs/results/run3"),
    ("run", "docs/results/run"),
]


@pytest.mark.parametrize(("run", "out"), COMMITTED_RUNS)
def test_committed_reports_regenerate_from_their_records(run, out, tmp_path):
    """docs/results: every committed report's tables are what its listed command makes of its records."""
    root = REPO / "docs" / "results" / run
    argv = [
        "--root",
        str(root),
        "--out",
        str(tmp_path),
        "--commands",
        str(root / "meta" / "commands.txt"),
        "--hardware",
        str(root / "meta" / "hardware.txt"),
    ]
    assert report.main(argv) == 0
    for name in ("results.md", "results.csv"):
        assert (tmp_path / name).read_text() == (REPO / out / name).read_text(), f"{out}/{name} is stale"
    assert f"--root docs/results/{run} --out {out}" in (root / "meta" / "commands.txt").read_text()

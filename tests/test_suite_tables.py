"""``benchmarks/suite_tables.py`` on a ``gpu_suite.sh`` output folder: the committed H200 reports of 2026-12-03
(``liger/``, ``steps/``, ``attn/``) copied into one folder, tabulated, and the printed cells checked against the
numbers in those JSON files; an incomplete report, a torn file and a report of another kind listed with the reason.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
H200 = RESULTS / "h200-2026-12-03"
sys.path.insert(0, str(BENCH))

import suite_tables  # noqa: E402

INCOMPLETE = "train_step_cut_short.json"
TORN = "update_policy_torn.json"
COUNTS = "update_counts.json"
ONE_STEP_OFF = "train_step_qwen2.5-1.5b_one_step_off.json"


def sections(text: str) -> dict[str, str]:
    """The printed output by ``## `` heading (the heading's text up to `` (``)."""
    out = {}
    for block in text.split("\n## ")[1:]:
        title, _, body = block.partition("\n")
        out[title.split(" (")[0]] = body
    return out


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table of ``text``: its rows as {header: cell}."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---") and i > 0 and lines[i - 1].startswith("| "):
            headers = _cells(lines[i - 1])
            rows = []
            for row in lines[i + 1 :]:
                if not row.startswith("| "):
                    break
                rows.append(dict(zip(headers, _cells(row), strict=True)))
            found.append(rows)
    return found


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip()[1:-1].split(" | ")]


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """The folder (real reports, plus the three that are not tabulated) and what the script printed for it."""
    folder = tmp_path_factory.mktemp("gpu_out")
    for sub in ("liger", "steps", "attn"):
        for path in (H200 / sub).glob("*.json"):
            shutil.copy(path, folder / path.name)
    cut = _load(H200 / "steps" / "train_step_smollm2-135m_packed.json")
    cut.update(steps=cut["steps"][:2], complete=False, error="RuntimeError: stopped in step 3")
    (folder / INCOMPLETE).write_text(json.dumps(cut))
    (folder / TORN).write_text('{"shape": "qwen2.5-1.5b", "log_prob": {"sec')
    (folder / COUNTS).write_text(json.dumps({"benchmark": "update_policy_counts", "micro_batches": 3}))
    out = subprocess.run(
        [sys.executable, str(BENCH / "suite_tables.py"), str(folder)], capture_output=True, text=True, timeout=300
    )
    return folder, out


def expected_update_row(name: str, r: dict) -> dict[str, str]:
    lp, up = r["log_prob"], r["update_policy"]
    every = r.get("ckpt_every", 1)
    return {
        "file": name,
        "shape": f"{r['shape']} x1",
        "attention": r["attn_implementation"],
        "checkpointing": ("all" if every == 1 else f"every {every}") if r["grad_ckpt"] else "none",
        "liger": ("on" if r["liger"] else "off") + "\\*",  # these reports predate use_liger
        "compile_layers": "on" if r["compile_layers"] else "off",
        "log-prob tok/s/GPU": f"{lp['tokens_per_s_per_gpu']:,.0f}",
        "log-prob MFU": f"{100 * lp['mfu']:.1f}%",
        "update tok/s/GPU": f"{up['tokens_per_s_per_gpu']:,.0f}",
        "update MFU": f"{100 * up['mfu']:.1f}%",
        "update s": f"{up['seconds']:.2f}",
        "peak GiB": f"{up['peak_mem_gib_rank0']:.1f}",
        "grad norm": f"{up['grad_norm']:.5f}",
    }


def test_update_policy_one_row_per_report_side_by_side(suite):
    folder, out = suite
    body = sections(out.stdout)["update_policy: log-prob and update passes"]
    [rows] = tables(body)
    files = sorted(p.name for sub in ("liger", "attn") for p in (H200 / sub).glob("update_policy_*.json"))
    assert [row["file"] for row in rows] == files and len(files) == 8
    for row in rows:
        assert row == expected_update_row(row["file"], _load(folder / row["file"]))
    by_file = {row["file"]: row for row in rows}
    best = by_file["update_policy_varlen_liger_nockpt.json"]  # the figures RESULTS.md quotes
    assert (best["update MFU"], best["peak GiB"], best["checkpointing"], best["liger"]) == (
        "47.5%",
        "62.4",
        "none",
        "on\\*",
    )
    assert (best["log-prob MFU"], best["update tok/s/GPU"], best["update s"]) == ("54.1%", "40,554", "16.27")
    assert by_file["update_policy_varlen_liger_ckpt_every2.json"]["checkpointing"] == "every 2"
    assert by_file["update_policy_varlen_compile_layers_ckpt.json"]["compile_layers"] == "on"
    assert by_file["update_policy_varlen_nockpt.json"]["peak GiB"] == "77.1"
    # the liger_applied of these reports is False on liger runs: the footnote says the requested value is shown
    assert "have no `use_liger`" in body and "liger_applied` read False" in body


def test_train_step_per_report_tables_and_summary(suite):
    folder, out = suite
    body = sections(out.stdout)["Training step by phase"]
    header, _, rest = body.partition(f"**{ONE_STEP_OFF}**: ")
    assert "qwen2.5-1.5b-bfloat16, overlap on, overrides: actor_rollout_ref.model.use_remove_padding=True" in rest
    report = _load(folder / ONE_STEP_OFF)
    steps = tables(rest)[0]
    assert [row["step"] for row in steps] == ["1", "2", "3"]
    assert [row["total"] for row in steps] == ["72.3", "54.9", "39.5"]
    assert [row["update"] for row in steps] == [f"{s['update_actor']:.3g}" for s in report["steps"]]

    summary = {(row["file"], row["overlap"]): row for row in tables(body)[-1]}
    assert len(summary) == 4
    row = summary[(ONE_STEP_OFF, "one-step-off")]
    # step 3, the run's last, launched no rollout ahead (its update overlapped nothing): not the steady state
    assert report["steps"][2]["update_gen_overlap_frac"] == 0.0 < report["steps"][1]["update_gen_overlap_frac"]
    step2 = report["steps"][1]
    assert row["mean total s"] == f"{step2['total']:.1f}" == "54.9"
    assert row["tokens/s"] == f"{step2['tokens'] / step2['total']:,.0f}"
    assert (row["steps"], row["update peak GiB"], row["update growth GiB"], row["note"]) == (
        "2",
        "",
        "",
        "left out: step 3 (no rollout ahead)",
    )
    for name, peak in (
        ("train_step_smollm2-135m_packed.json", "59.7"),
        ("train_step_smollm2-135m_padded_sdpa.json", "61.1"),
    ):
        row, later = summary[(name, "sync")], _load(folder / name)["steps"][1:]
        assert row["update peak GiB"] == f"{max(s['gpu_peak_by_phase_gib']['update'] for s in later):.1f}" == peak
        assert row["mean total s"] == f"{sum(s['total'] for s in later) / len(later):.1f}"
    assert summary[("train_step_smollm2-135m_packed.json", "sync")]["tokens/s"] == "42,102"  # RESULTS.md: 42.1K


def test_incomplete_and_unreadable_reports_are_listed_with_the_reason(suite):
    _, out = suite
    assert out.returncode == 1, out.stderr
    printed = sections(out.stdout)
    [problems] = tables(printed["Not tabulated or incomplete"])
    reasons = {row["file"]: row["reason"] for row in problems}
    assert set(reasons) == {INCOMPLETE, TORN, COUNTS}
    assert reasons[INCOMPLETE] == "incomplete: RuntimeError: stopped in step 3"
    assert reasons[TORN].startswith("unreadable: JSONDecodeError: Unterminated string")
    assert reasons[COUNTS] == "not tabulated here: benchmark 'update_policy_counts'"
    # the incomplete report's finished steps are still shown, and marked so in the summary
    body = printed["Training step by phase"]
    _, _, rest = body.partition(f"**{INCOMPLETE}**: ")
    assert "**incomplete: RuntimeError: stopped in step 3**" in rest.splitlines()[0]
    assert [row["step"] for row in tables(rest)[0]] == ["1", "2"]
    summary = {row["file"]: row for row in tables(body)[-1]}
    assert (summary[INCOMPLETE]["steps"], summary[INCOMPLETE]["note"]) == ("2", "incomplete")


def test_a_folder_of_complete_reports_exits_0(tmp_path, capsys):
    for path in (H200 / "liger").glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    assert suite_tables.main([str(tmp_path)]) == 0
    assert "Not tabulated" not in capsys.readouterr().out
    assert suite_tables.main([str(tmp_path / "empty")]) == 1  # no report at all


def test_resolved_liger_shown_where_recorded():
    base = _load(H200 / "liger" / "update_policy_varlen_liger_nockpt.json")
    auto = {**base, "liger": "auto", "use_liger": True, "liger_applied": True}
    off = {**base, "liger": "off", "use_liger": False, "liger_applied": False}
    problems: list = []
    text = suite_tables.update_policy_rows([("auto.json", auto), ("off.json", off)], problems)
    [rows] = tables(text)
    assert [row["liger"] for row in rows] == ["on (auto)", "off"]
    assert "use_liger" not in text and problems == []  # no footnote: every report says what it resolved to


def test_block_mask_reports_use_their_bench_table(tmp_path, capsys):
    report = RESULTS / "cpu-2026-12-05" / "block_mask.json"
    shutil.copy(report, tmp_path / report.name)
    assert suite_tables.main([str(tmp_path)]) == 0
    [rows] = tables(sections(capsys.readouterr().out)["BlockMask build per packed micro-batch"])
    results = _load(report)["results"]
    assert [row["tokens"] for row in rows] == [f"{r['tokens']:,}" for r in results]
    assert rows[3]["shared-prompt mask ms"] == f"{results[3]['shared_prompt_block_mask_ms']:,.1f}" == "88.2"
    assert rows[3]["vs torch"] == "122.0x" and rows[3]["equal"] == "True" and rows[4]["equal"] == ""


def test_weight_sync_and_vs_verl_use_their_bench_tables(tmp_path, capsys):
    ws = RESULTS / "h200-2026-12-02" / "weight_sync_qwen2.5-1.5b.json"
    vs = RESULTS / "cpu-2026-12-02" / "vs_verl_tiny.json"  # written before bench_vs_verl named its reports
    for path in (ws, vs):
        shutil.copy(path, tmp_path / path.name)
    assert suite_tables.report_kind(_load(vs)) == "vs_verl"
    assert suite_tables.report_kind(_load(H200 / "attn" / "update_policy_qwen2.5-1.5b_memagent_ckpt_flex.json")) == (
        "update_policy"
    )
    assert suite_tables.main([str(tmp_path)]) == 0
    printed = sections(capsys.readouterr().out)
    [sync] = tables(printed["Weight sync"])
    seconds = _load(ws)["seconds"]
    assert sync[0]["phase"] == "sync after sleep (per training step)"
    assert sync[0]["seconds"] == f"{seconds['sync_after_sleep']:.3g}" == "0.556"
    [sides] = tables(printed["This actor vs upstream verl"])
    assert [row["side"] for row in sides] == ["ours", "upstream"]
    assert sides[0]["grad_norm"] == f"{_load(vs)['sides']['ours']['first_step']['grad_norm']:.6g}"


def test_overlap_both_report_has_a_row_per_run(tmp_path, capsys):
    from bench_train_step import overlap_summary

    sync = _load(H200 / "steps" / "train_step_smollm2-135m_packed.json")["steps"]
    ahead = _load(H200 / "steps" / ONE_STEP_OFF)
    report = {**ahead, "rollout_overlap": "both", "steps": sync, "overlap_steps": ahead["steps"]}
    report["overlap_summary"] = overlap_summary(sync, ahead["steps"])
    (tmp_path / "train_step_both.json").write_text(json.dumps(report))
    assert suite_tables.main([str(tmp_path)]) == 0
    body = sections(capsys.readouterr().out)["Training step by phase"]
    assert "One-step-off (trainer.rollout_overlap) vs synchronous" in body
    summary = tables(body)[-1]
    assert [(row["overlap"], row["mean total s"]) for row in summary] == [("sync", "24.0"), ("one-step-off", "54.9")]
    # the synchronous run keeps its last step (it has no rollout ahead to miss)
    assert suite_tables.step_summary(sync)["steps"] == [s["step"] for s in sync[1:]]
    assert [row["step MFU"] for row in summary] == ["", ""]  # reports written before bench_train_step's MFU
    timed = [{**s, "mfu": m} for s, m in zip(sync, (0.5, 0.1, 0.3), strict=False)]
    later = timed[1:]
    expected = sum(s["mfu"] * s["total"] for s in later) / sum(s["total"] for s in later)
    assert suite_tables.step_summary(timed)["mfu"] == pytest.approx(expected)  # weighted by each step's seconds


def test_vllm_step_reports_use_their_bench_table_and_failed_settings_are_listed(tmp_path, capsys):
    """The committed H200 vllm_step report (2026-12-03, seventh run): its cells from the JSON; a copy with a failed
    setting is tabulated and listed as incomplete."""
    src = H200 / "seventh" / "vllm_step_1p5b.json"
    report = _load(src)
    shutil.copy(src, tmp_path / src.name)
    (tmp_path / "vllm_step_failed.json").write_text(json.dumps({**report, "failed": {"engine_thread": "oom"}}))
    assert suite_tables.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    printed = sections(out)
    first, _ = tables(printed["vLLM engine step: wall vs GPU kernel time"])
    default = report["results"][0]
    assert first[0]["setting"] == "default" and first[0]["steps"] == f"{default['steps']:,}" == "1,048"
    assert first[0]["kernel ms/step"] == f"{default['kernel_ms_per_step']:.2f}" == "4.29"
    assert first[0]["host ms/step"] == f"{default['host_ms_per_step']:.2f}"
    assert "| vllm_step_failed.json | incomplete: settings failed: engine_thread |" in out


def test_bypass_mode_runs_are_marked_in_the_summary(tmp_path, capsys):
    src = H200 / "seventh" / "train_step_qwen2.5-1.5b_nockpt_bypass_sync.json"
    shutil.copy(src, tmp_path / src.name)
    assert suite_tables.main([str(tmp_path)]) == 0
    *_, summary = tables(sections(capsys.readouterr().out)["Training step by phase"])
    assert [(row["steps"], row["mean total s"], row["note"]) for row in summary] == [
        ("2, 3", "46.2", "bypass mode (no old-log-prob pass)")
    ]


def test_train_step_header_names_the_settings_that_had_no_effect():
    from suite_tables import train_step_header

    report = {"model": "/m/smollm2", "rollout_overlap": "on", "overrides": ["a=1", "b=2"]}
    assert train_step_header("r.json", report) == "**r.json**: smollm2, overlap on, overrides: a=1 b=2"
    report["inert_settings"] = {"overlap": ["b=2 has no effect: why"], "sync": []}
    assert train_step_header("r.json", report).endswith("overrides: a=1 b=2; **no effect**: b=2 has no effect: why")

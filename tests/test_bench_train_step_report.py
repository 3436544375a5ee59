"""``benchmarks/bench_train_step.py`` keeps what a cut-short run finished: every step is logged as it ends
(``<log dir>/{sync,overlap}/metrics.jsonl``), a run that raises writes the finished steps to ``--out`` with
``"complete": false``, a run stopped early (SIGTERM) starts no further run, and ``--report-from`` rebuilds the report
from the log after a SIGKILL. The real end-to-end path (the trainer writing the log) is checked in
``tests/test_rollout_overlap_e2e.py::test_bench_train_step_runs_overlapped_and_synchronous_side_by_side``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_train_step as bts  # noqa: E402
import suite_tables  # noqa: E402

META = {
    "gpus": 1,
    "rollout": "hf",
    "batch": 2,
    "n": 2,
    "chunks": 3,
    "chunk": 64,
    "memory": 16,
    "steps": 3,
    "overlap": "both",
    "model": "m",
    "device": "cpu",
    "overrides": ["x=1"],
}


def _metrics(step: int, total: float) -> dict:
    return {
        "step": step,
        "timing_s/gen": 1.0,
        "timing_s/update_actor": 2.0,
        "timing_s/step": total,
        "perf/total_num_tokens": 400,
        "trajectory/num_conv/mean": 3.0,
        "response_length/mean": 10.0,
        "rollout/staleness": 0.0 if step == 1 else 1.0,
        "perf/max_memory_allocated_gb": 30.0,
        "perf/max_memory_allocated_gb/update": 28.5,
        "perf/max_memory_allocated_gb/rollout": 29.0,
        "perf/phase_growth_gb/update": 2.5,
        "perf/phase_growth_gb/rollout": 1.0,
        "perf/max_memory_in_use_gb/update": 8.5,  # 20 GiB of the update's peak was the sleeping engine's pool
        "perf/max_memory_in_use_gb/rollout": 29.0,
    }


def _log(log_dir: Path, name: str, steps: list[tuple[int, float]], torn: bool = False) -> None:
    (log_dir / name).mkdir(parents=True)
    text = "".join(json.dumps(_metrics(*s)) + "\n" for s in steps)
    if torn:
        text += '{"step": 9, "timing_s/'  # a writer killed mid-line
    (log_dir / name / "metrics.jsonl").write_text(text)


def test_report_from_a_killed_run_keeps_the_logged_steps(tmp_path, capsys):
    """A SIGKILL during the overlapped run's step 2: the sync run's 3 steps and the overlapped run's step 1 come back,
    numbers as logged (tokens/s = 400 / step seconds; generated = 10 tokens x 3 conversations x 4 trajectories)."""
    log_dir = tmp_path / "steps"
    log_dir.mkdir()
    ran_on = {"torch": "2.11.0+cu130", "cuda_device": "NVIDIA H200"}  # the run's machine, not the one rebuilding
    (log_dir / "run.json").write_text(json.dumps({**META, "env": ran_on}))
    _log(log_dir, "sync", [(1, 8.0), (2, 4.0), (3, 5.0)])
    _log(log_dir, "overlap", [(1, 10.0)], torn=True)
    out = tmp_path / "report.json"
    assert bts.main(["--report-from", str(log_dir), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] is False
    assert [r["step"] for r in report["steps"]] == [1, 2, 3]
    assert [r["total"] for r in report["steps"]] == [8.0, 4.0, 5.0]
    assert report["steps"][1]["tokens_per_s"] == pytest.approx(100.0)
    assert report["steps"][1]["generated_tokens_per_s"] == pytest.approx(10 * 3 * 4 / 4.0)
    assert [r["step"] for r in report["overlap_steps"]] == [1]
    assert report["overlap_summary"]["overlap_step_s"] is None  # no steady-state step of the overlapped run
    assert report["overrides"] == ["x=1"] and report["batch"] == 2 and report["env"] == ran_on
    assert report["steps"][0]["gpu_peak_by_phase_gib"] == {"update": 28.5, "rollout": 29.0}
    assert report["steps"][0]["gpu_growth_by_phase_gib"] == {"update": 2.5, "rollout": 1.0}
    assert report["steps"][0]["gpu_peak_allocated_gib"] == 30.0
    printed = capsys.readouterr().out
    assert "incomplete" in printed
    assert report["steps"][0]["gpu_in_use_by_phase_gib"] == {"update": 8.5, "rollout": 29.0}
    assert "update 28.5 (+2.5) [in use 8.5], rollout 29.0 (+1.0))" in printed  # shown only where it differs


def test_report_from_a_folder_without_a_run_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no run.json"):
        bts.main(["--report-from", str(tmp_path)])
    (tmp_path / "run.json").write_text(json.dumps(META))
    with pytest.raises(SystemExit, match="no logged steps"):
        bts.main(["--report-from", str(tmp_path)])


def test_default_log_dir_is_beside_out(tmp_path):
    assert bts.default_log_dir(str(tmp_path / "r" / "step.json"), tmp_path / "w") == tmp_path / "r" / "step.steps"
    assert bts.default_log_dir(None, tmp_path / "w") == tmp_path / "w" / "logs"


def _fake_trainer(steps_done: int, error: BaseException | None):
    """Stands in for ``main_ppo.run``: logs ``steps_done`` steps where the composed config says (trainer.log_dir,
    through the real jsonl logger), then raises ``error`` or returns the history like a trainer stopped by SIGTERM."""
    from verl.utils.tracking import Tracking

    calls = []

    def run(cfg):
        calls.append(bool(cfg.trainer.rollout_overlap))
        tracking = Tracking("p", "e", default_backend=["jsonl"], log_dir=cfg.trainer.log_dir)
        history = []
        for step in range(1, steps_done + 1):
            tracking.log(_metrics(step, 2.0 * step), step=step)
            history.append(_metrics(step, 2.0 * step))
        tracking.finish()
        if error is not None:
            raise error
        return history

    return run, calls


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory"), SystemExit(143)], ids=["error", "2nd_sigterm"])
def test_a_run_that_raises_writes_its_finished_steps(tiny_model_path, tmp_path, monkeypatch, error):
    import verl.trainer.main_ppo as main_ppo

    run, calls = _fake_trainer(2, error)
    monkeypatch.setattr(main_ppo, "run", run)
    out = tmp_path / "step.json"
    _log(tmp_path / "step.steps", "overlap", [(1, 7.0), (2, 7.0)])  # an earlier benchmark's log at the same --out
    argv = ["--model", str(tiny_model_path), "--steps", "3", "--overlap", "both", "--out", str(out)]
    with pytest.raises(type(error)):
        bts.main(argv)
    report = json.loads(out.read_text())
    assert calls == [False]  # the overlapped run never started
    assert "overlap_steps" not in report  # so no overlapped steps, not the earlier benchmark's
    assert (tmp_path / "step.steps" / "overlap" / "metrics.jsonl.superseded").read_text().count("\n") == 2
    assert report["complete"] is False and report["error"].startswith(type(error).__name__)
    assert [r["total"] for r in report["steps"]] == [2.0, 4.0]
    assert (tmp_path / "step.steps" / "run.json").exists()


def test_a_run_stopped_early_starts_no_further_run(tiny_model_path, tmp_path, monkeypatch):
    """SIGTERM: the trainer finishes its step and returns a short history; ``--overlap both`` then stops there."""
    import verl.trainer.main_ppo as main_ppo

    run, calls = _fake_trainer(1, None)
    monkeypatch.setattr(main_ppo, "run", run)
    out = tmp_path / "step.json"
    argv = ["--model", str(tiny_model_path), "--steps", "3", "--overlap", "both", "--out", str(out)]
    assert bts.main(argv) == 0
    report = json.loads(out.read_text())
    assert calls == [False]
    assert report["complete"] is False and "error" not in report
    assert [r["step"] for r in report["steps"]] == [1] and "overlap_steps" not in report


def test_mfu_columns_from_the_parameter_count_and_peak(tmp_path, capsys):
    """With a parameter count and a peak (a CUDA run): per step the training passes' FLOPs (6 x params x tokens for
    the update, 2 x each for the old log-prob and reference passes that ran) over the step's seconds, and the
    update's 6 x over its own; the table gets both columns."""
    meta = {**META, "overlap": "off", "num_params": 2_000_000, "peak_flops": 1e12}
    history = [_metrics(1, 8.0), {**_metrics(2, 4.0), "timing_s/old_log_prob": 0.5, "timing_s/ref": 0.5}]
    report = bts.build_report(meta, {"sync": history})
    first, second = report["steps"]
    assert first["mfu"] == pytest.approx(6 * 2e6 * 400 / 8.0 / 1e12)  # no old/ref pass timed in step 1
    assert second["mfu"] == pytest.approx(10 * 2e6 * 400 / 4.0 / 1e12)
    assert second["update_mfu"] == pytest.approx(6 * 2e6 * 400 / 2.0 / 1e12)
    table = bts.train_step_table(report)
    assert "| MFU | update MFU |" in table and f"| {100 * second['mfu']:.1f}% |" in table
    plain = bts.build_report({**META, "overlap": "off"}, {"sync": history})  # CPU, or a run logged before
    assert "mfu" not in plain["steps"][0] and "MFU" not in bts.train_step_table(plain)


def test_model_parameters_counts_the_folder_model_once(tiny_model_path):
    from verl.utils.model_loading import count_parameters, load_causal_lm

    assert bts.model_parameters(tiny_model_path) == count_parameters(load_causal_lm(tiny_model_path, dtype="float32"))


def test_the_steady_steps_spread_is_in_the_report_and_printed(capsys):
    """``report["steady"]``: the steps after the first, their seconds' min / median / max (a per-step target held or
    reached once); one-step-off leaves out the last step too (its update ran with no rollout ahead)."""
    sync = [_metrics(1, 8.0), _metrics(2, 4.0), _metrics(3, 5.0), _metrics(4, 3.0)]
    report = bts.build_report({**META, "overlap": "off", "steps": 4}, {"sync": sync})
    steady = report["steady"]
    assert steady["steps"] == [2, 3, 4]
    assert (steady["min_total_s"], steady["median_total_s"], steady["max_total_s"]) == (3.0, 4.0, 5.0)
    assert steady["mean_total_s"] == pytest.approx(4.0) and steady["tokens_per_s"] == pytest.approx(1200 / 12.0)
    ahead = {"perf/update_generation_overlap_frac": 0.6, "timing_s/wait_rollout_ahead": 0.1}
    # step 2's rollout ahead was done before its update began (135M, engine in a child process): it ran ahead all
    # the same, and is a steady step
    done_early = {"perf/update_generation_overlap_frac": 0.0, "timing_s/wait_rollout_ahead": 0.0}
    overlap = [{**_metrics(1, 9.0), **ahead}, {**_metrics(2, 6.0), **done_early}, {**_metrics(3, 7.0), **ahead}]
    on = bts.build_report({**META, "overlap": "on"}, {"overlap": [*overlap, _metrics(4, 2.0)]})
    assert [s["rollout_ahead"] for s in on["steps"]] == [True, True, True, False]
    assert on["steady"]["steps"] == [2, 3] and on["steady"]["left_out"] == [4]
    # a report from before ``rollout_ahead``: an update that overlapped no generation is the sign
    old_rows = [{k: v for k, v in s.items() if k != "rollout_ahead"} for s in on["steps"]]
    assert suite_tables.step_summary(old_rows, one_step_off=True)["left_out"] == [2, 4]
    assert (on["steady"]["min_total_s"], on["steady"]["median_total_s"], on["steady"]["max_total_s"]) == (6, 6.5, 7)
    bts.print_report(on)
    assert "steady steps 2, 3: 6 / 6.5 / 7 s per step (min / median / max), 62 tokens/s" in capsys.readouterr().out
    assert bts.steady_line(bts.build_report(META, {"sync": sync[:1]})["steady"]).startswith("steady steps: none")

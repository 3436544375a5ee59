"""Loggers (verl.utils.tracking) and step/validation metrics (verl.trainer.ppo.metric_utils).

The metric tests use a hand-made conversation batch: 2 trajectories of one question, trajectory 0 with
3 conversations (2 memory turns + final answer, reward 1) and trajectory 1 with only its final answer
(reward 0). Every expected number below is worked out by hand in the comments.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from verl.protocol import DataProto, pad_dataproto_to_divisor
from verl.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    process_validation_metrics,
    reduce_metrics,
)
from verl.utils.tracking import VALID_BACKENDS, Tracking, format_console_line

# --------------------------------------------------------------------------------------------------
# Tracking
# --------------------------------------------------------------------------------------------------


def test_console_line_format() -> None:
    stream = io.StringIO()
    tracker = Tracking("p", "e", "console", console_stream=stream)
    tracker.log({"b": 2, "a": 1 / 3, "c": 12345.678, "d": torch.tensor(0.5), "e": np.float32(2.0)}, step=3)
    tracker.log({"z": 1e-6}, step=4)
    tracker.finish()
    assert stream.getvalue().splitlines() == [
        "step:3 - a:0.3333 - b:2 - c:1.235e+04 - d:0.5 - e:2",
        "step:4 - z:1e-06",
    ]


def test_console_prints_to_stdout_by_default(capsys: pytest.CaptureFixture) -> None:
    Tracking("p", "e", ["console"]).log({"x": 1.0}, step=1)
    assert capsys.readouterr().out == "step:1 - x:1\n"
    assert format_console_line({}, 7) == "step:7"


def test_unknown_backend_lists_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        Tracking("p", "e", ["console", "mlflow"], log_dir=tmp_path)
    assert "mlflow" in str(info.value)
    for name in VALID_BACKENDS:
        assert name in str(info.value)


def test_jsonl_lines_parse_and_match_logged_values(tmp_path: Path) -> None:
    tracker = Tracking("p", "e", ["jsonl"], log_dir=tmp_path)
    tracker.log({"critic/score/mean": 0.75, "n": 3, "t": torch.tensor(2.5), "a": np.int64(4)}, step=1)
    path = tmp_path / "metrics.jsonl"
    # Flushed at once: readable before finish() (nothing is lost if the process dies here).
    assert json.loads(path.read_text().splitlines()[0]) == {
        "step": 1,
        "critic/score/mean": 0.75,
        "n": 3,
        "t": 2.5,
        "a": 4,
    }
    tracker.log({"critic/score/mean": 0.5}, step=2)
    tracker.finish()
    tracker.finish()  # idempotent
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [
        {"step": 1, "critic/score/mean": 0.75, "n": 3, "t": 2.5, "a": 4},
        {"step": 2, "critic/score/mean": 0.5},
    ]
    # A resumed run appends instead of overwriting.
    with Tracking("p", "e", "jsonl", log_dir=tmp_path) as again:
        again.log({"x": 1}, step=3)
    assert len(path.read_text().splitlines()) == 3


def test_generations_go_to_their_own_jsonl(tmp_path: Path) -> None:
    with Tracking("p", "e", ["jsonl"], log_dir=tmp_path) as tracker:
        tracker.log_generations(
            [{"input": "q1", "output": "a1", "score": 1.0}, {"input": "q2", "output": "a2", "score": 0}], 5
        )
    lines = [json.loads(x) for x in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 5, "input": "q1", "output": "a1", "score": 1.0},
        {"step": 5, "input": "q2", "output": "a2", "score": 0},
    ]


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_resume_drops_steps_after_the_checkpoint_so_each_step_is_logged_once(tmp_path: Path) -> None:
    """A killed run logged steps 0..3 (and a torn line), its checkpoint is step 2: the resumed run's logger keeps
    0..2, moves 3 and the torn line to metrics.jsonl.superseded, and appends the redone steps after them."""
    with Tracking("p", "e", ["jsonl"], log_dir=tmp_path) as first:
        for step in range(4):
            first.log({"critic/score/mean": 0.1 * step}, step=step)
        first.log_generations([{"input": "q", "output": "a2"}], 2)
        first.log_generations([{"input": "q", "output": "a3"}], 3)
    metrics = tmp_path / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 4, "critic/sc')  # the writer was killed mid-line
    with Tracking("p", "e", ["jsonl"], log_dir=tmp_path) as resumed:
        resumed.resume_at(2)
        for step in (3, 4):
            resumed.log({"critic/score/mean": 1.0 + step}, step=step)
        resumed.log_generations([{"input": "q", "output": "b3"}], 3)
    assert _steps(metrics) == [0, 1, 2, 3, 4]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["critic/score/mean"] for r in rows] == pytest.approx([0.0, 0.1, 0.2, 4.0, 5.0])  # the redone values
    superseded = (tmp_path / "metrics.jsonl.superseded").read_text().splitlines()
    assert json.loads(superseded[0]) == {"step": 3, "critic/score/mean": pytest.approx(0.3)}
    assert superseded[1] == '{"step": 4, "critic/sc'
    generations = [json.loads(x) for x in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert [(g["step"], g["output"]) for g in generations] == [(2, "a2"), (3, "b3")]

    # resuming again at the same step, with nothing after it, changes nothing
    with Tracking("p", "e", ["jsonl"], log_dir=tmp_path) as again:
        again.resume_at(4)
    assert _steps(metrics) == [0, 1, 2, 3, 4]
    assert len((tmp_path / "metrics.jsonl.superseded").read_text().splitlines()) == 2

    # a fresh start (no checkpoint) in the same folder keeps no old lines: step 0 is logged anew
    with Tracking("p", "e", ["jsonl"], log_dir=tmp_path) as fresh:
        fresh.resume_at(None)
        fresh.log({"val-core/x": 1.0}, step=0)
    assert _steps(metrics) == [0]
    assert len((tmp_path / "metrics.jsonl.superseded").read_text().splitlines()) == 7


def test_tensorboard_resume_hides_the_redone_steps(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracking("p", "e", ["tensorboard"], log_dir=tmp_path) as first:
        for step in (1, 2, 3):
            first.log({"critic/score/mean": float(step)}, step=step)
    with Tracking("p", "e", ["tensorboard"], log_dir=tmp_path) as resumed:
        resumed.resume_at(2)
        resumed.log({"critic/score/mean": 30.0}, step=3)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_tensorboard_event_file_holds_the_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracking("p", "e", ["tensorboard"], log_dir=tmp_path)
    tracker.log({"critic/score/mean": 0.25, "note": "text is skipped"}, step=1)
    tracker.log({"critic/score/mean": 0.75}, step=2)
    tracker.finish()
    event_files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["critic/score/mean"]
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.75)]


def test_wandb_offline_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    tracker = Tracking(
        "proj", "exp", ["wandb"], config={"algorithm": {"adv_estimator": "grpo"}}, log_dir=tmp_path / "logs"
    )
    run = tracker.backends["wandb"].run
    assert run.project == "proj" and run.name == "exp"
    assert run.config["algorithm"] == {"adv_estimator": "grpo"}
    tracker.log({"critic/score/mean": 0.5}, step=1)
    tracker.finish()
    run_dirs = list((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    assert list(run_dirs[0].glob("run-*.wandb"))


# --------------------------------------------------------------------------------------------------
# metric_utils
# --------------------------------------------------------------------------------------------------

PROMPT_W, RESP_W = 4, 3
PROMPT_LENS = [4, 3, 2, 4]  # rows: traj0 memory, traj0 memory, traj0 final, traj1 final
RESP_LENS = [3, 2, 1, 3]
SAMPLE_INDEX = [0, 0, 0, 1]
FINAL_MASK = [False, False, True, True]
TRAJ_SCORE = [1.0, 0.0]  # verifier score of each trajectory's final answer
TRAJ_ADV = [0.5, -0.5]  # R - mean(R of the group) = 1 - 0.5, 0 - 0.5


def make_batch(with_final_mask_tensor: bool = False) -> DataProto:
    rows = len(PROMPT_LENS)
    attention = torch.zeros(rows, PROMPT_W + RESP_W, dtype=torch.long)
    scores = torch.zeros(rows, RESP_W)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESP_LENS)):
        attention[i, PROMPT_W - p : PROMPT_W] = 1  # left-padded prompt
        attention[i, PROMPT_W : PROMPT_W + r] = 1  # right-padded response
        scores[i, r - 1] = TRAJ_SCORE[SAMPLE_INDEX[i]]  # broadcast score at the last response token
    response_mask = attention[:, PROMPT_W:].float()
    advantages = torch.tensor([TRAJ_ADV[t] for t in SAMPLE_INDEX]).unsqueeze(-1) * response_mask
    tensors = {
        "responses": torch.ones(rows, RESP_W, dtype=torch.long),
        "attention_mask": attention,
        "response_mask": response_mask,
        "token_level_scores": scores,
        "token_level_rewards": scores * 0.5,  # distinct from scores, so the two keys cannot be swapped
        "advantages": advantages,
        "returns": advantages.clone(),
        "values": advantages.clone(),
    }
    if with_final_mask_tensor:
        tensors["final_mask"] = torch.tensor(FINAL_MASK)
    return DataProto.from_dict(tensors)


EXPECTED_DATA_METRICS = {
    # conversation-weighted: scores per conversation are [1, 1, 1, 0]
    "critic/score/mean": 0.75,
    "critic/score/max": 1.0,
    "critic/score/min": 0.0,
    "critic/rewards/mean": 0.375,
    "critic/rewards/max": 0.5,
    "critic/rewards/min": 0.0,
    "critic/pass@n": 0.75,
    # 6 response tokens at +0.5 (traj 0: 3 + 2 + 1) and 3 at -0.5 (traj 1): (3 - 1.5) / 9
    "critic/advantages/mean": 1.5 / 9,
    "critic/advantages/max": 0.5,
    "critic/advantages/min": -0.5,
    "critic/returns/mean": 1.5 / 9,
    "response_length/mean": 2.25,
    "response_length/max": 3.0,
    "response_length/min": 1.0,
    "response_length/clip_ratio": 0.5,  # rows 0 and 3 use the full width 3
    "prompt_length/mean": 3.25,
    "prompt_length/max": 4.0,
    "prompt_length/min": 2.0,
    "prompt_length/clip_ratio": 0.5,
    "response_length/memory_turn/mean": 2.5,
    "response_length/memory_turn/max": 3.0,
    "response_length/memory_turn/clip_ratio": 0.5,
    "response_length/final_turn/mean": 2.0,
    "response_length/final_turn/max": 3.0,
    "response_length/final_turn/clip_ratio": 0.5,
    # trajectory-weighted: final answers score [1, 0]
    "trajectory/count": 2.0,
    "trajectory/score/mean": 0.5,
    "trajectory/reward/mean": 0.25,
    "trajectory/reward/max": 0.5,
    "trajectory/reward/min": 0.0,
    "trajectory/pass_rate": 0.5,
    "trajectory/num_conv/mean": 2.0,
    "trajectory/num_conv/min": 1.0,
    "trajectory/num_conv/max": 3.0,
}


def assert_metrics(metrics: dict, expected: dict) -> None:
    for key, value in expected.items():
        assert key in metrics, f"missing {key}"
        assert metrics[key] == pytest.approx(value, abs=1e-6), f"{key}: {metrics[key]} != {value}"


def test_data_metrics_by_hand() -> None:
    metrics = compute_data_metrics(make_batch(), sample_index=SAMPLE_INDEX, final_mask=np.array(FINAL_MASK))
    assert_metrics(metrics, EXPECTED_DATA_METRICS)
    assert "critic/values/mean" not in metrics
    assert all(isinstance(v, float) for v in metrics.values())


def test_data_metrics_take_final_mask_from_the_batch_and_drop_padding_rows() -> None:
    padded, pad_size = pad_dataproto_to_divisor(make_batch(with_final_mask_tensor=True), 3)
    assert pad_size == 2  # copies of rows 0 and 1 (memory turns of trajectory 0) flagged is_padding
    metrics = compute_data_metrics(padded, sample_index=SAMPLE_INDEX + [0, 0])
    assert_metrics(metrics, EXPECTED_DATA_METRICS)


def test_data_metrics_single_turn_defaults_and_critic() -> None:
    metrics = compute_data_metrics(make_batch(), use_critic=True)
    # No sample_index / final_mask: every row is its own one-conversation trajectory.
    assert metrics["trajectory/count"] == 4.0 and metrics["trajectory/num_conv/max"] == 1.0
    assert metrics["trajectory/score/mean"] == pytest.approx(0.75)
    assert "response_length/memory_turn/mean" not in metrics
    # values == returns: explained variance 1 - 0 / (var + 1e-5)
    assert metrics["critic/values/mean"] == pytest.approx(1.5 / 9)
    assert metrics["critic/vf_explained_var"] == pytest.approx(1.0, abs=1e-3)


def test_pass_at_n_counts_full_scores_only() -> None:
    """critic/pass@n and trajectory/pass_rate count scores of exactly 1 (a partial credit of 0.5 is no pass)."""
    batch = make_batch()
    partial = batch.batch["token_level_scores"].clone()
    partial[partial == 1.0] = 0.5
    batch.batch["token_level_scores"] = partial
    metrics = compute_data_metrics(batch, sample_index=SAMPLE_INDEX, final_mask=np.array(FINAL_MASK))
    assert metrics["critic/pass@n"] == 0.0 and metrics["trajectory/pass_rate"] == 0.0
    assert metrics["critic/score/mean"] == pytest.approx(0.375)


def test_data_metrics_length_mismatch_is_named() -> None:
    with pytest.raises(ValueError, match="sample_index has 3 entries but the batch has 4 rows"):
        compute_data_metrics(make_batch(), sample_index=[0, 0, 1])


def test_timing_metrics() -> None:
    timing = {"gen": 2.0, "update_actor": 4.4, "mt_prepare": 0.1, "step": 10.0}
    metrics = compute_timing_metrics(make_batch(), timing)
    assert metrics["timing_s/gen"] == 2.0 and metrics["timing_s/mt_prepare"] == 0.1 and metrics["timing_s/step"] == 10.0
    # 9 response tokens; 9 + 13 prompt tokens = 22 tokens overall
    assert metrics["timing_per_token_ms/gen"] == pytest.approx(2000.0 / 9)
    assert metrics["timing_per_token_ms/update_actor"] == pytest.approx(4400.0 / 22)
    assert "timing_per_token_ms/mt_prepare" not in metrics and "timing_per_token_ms/step" not in metrics


def test_throughput_metrics() -> None:
    batch = make_batch()
    metrics = compute_throughout_metrics(batch, {"step": 10.0}, n_gpus=2)
    assert metrics == {"perf/total_num_tokens": 22.0, "perf/time_per_step": 10.0, "perf/throughput": 1.1}
    batch.meta_info["global_token_num"] = [10, 12, 8]
    assert compute_throughout_metrics(batch, {"step": 10.0}, n_gpus=2)["perf/throughput"] == pytest.approx(1.5)
    with pytest.raises(KeyError, match="step"):
        compute_throughout_metrics(batch, {"gen": 1.0}, n_gpus=2)


def test_validation_metrics_grouped_by_sample_uid() -> None:
    # hotpotqa: question u1 rewards [1, 0, 0, 1], question u2 [1, 1, 1, 1]; squad: v1 [0, 0, 0, 0].
    # Interleaved order as after repeat(interleave=False) to show grouping is by uid, not position.
    sources = ["hotpotqa", "hotpotqa"] * 4 + ["squad"] * 4
    uids = ["u1", "u2"] * 4 + ["v1"] * 4
    rewards = [1, 1, 0, 1, 0, 1, 1, 1] + [0, 0, 0, 0]
    preds = ["a"] * 12  # non-numeric infos are skipped
    metrics = process_validation_metrics(sources, uids, {"reward": rewards, "pred": preds})
    assert metrics == pytest.approx(
        {
            "val-core/hotpotqa/reward/mean@4": 0.75,  # (0.5 + 1) / 2
            "val-core/hotpotqa/reward/best@4": 1.0,  # (1 + 1) / 2
            "val-aux/hotpotqa/reward/worst@4": 0.5,  # (0 + 1) / 2
            "val-aux/hotpotqa/reward/std@4": 0.25,  # (0.5 + 0) / 2
            "val-core/squad/reward/mean@4": 0.0,
            "val-core/squad/reward/best@4": 0.0,
            "val-aux/squad/reward/worst@4": 0.0,
            "val-aux/squad/reward/std@4": 0.0,
        }
    )


def test_validation_metrics_core_is_the_largest_group_size() -> None:
    """A question sampled fewer times (a group of 1 beside groups of 2) reports under val-aux: val-core holds the
    mean and best at the largest n only."""
    metrics = process_validation_metrics(["d"] * 3, ["u", "u", "v"], {"reward": [1.0, 0.0, 1.0]})
    assert metrics == pytest.approx(
        {
            "val-core/d/reward/mean@2": 0.5,
            "val-core/d/reward/best@2": 1.0,
            "val-aux/d/reward/worst@2": 0.0,
            "val-aux/d/reward/std@2": 0.5,
            "val-aux/d/reward/mean@1": 1.0,
        }
    )


def test_validation_metrics_acc_is_core_when_present() -> None:
    metrics = process_validation_metrics(["d", "d"], ["u", "u"], {"reward": [1.0, 0.0], "acc": [True, False]})
    assert metrics["val-core/d/acc/mean@2"] == 0.5
    assert metrics["val-aux/d/reward/mean@2"] == 0.5
    with pytest.raises(ValueError, match="infos_dict\\['reward'\\] has 1 entries"):
        process_validation_metrics(["d", "d"], ["u", "u"], {"reward": [1.0]})


def test_reduce_metrics() -> None:
    assert reduce_metrics({"actor/pg_loss": [1.0, 2.0, 3.0], "empty": []}) == {"actor/pg_loss": 2.0}

"""End to end: one-step-off training of the memory agent (``trainer.rollout_overlap``) through the real trainer
(CPU, tiny Qwen2, HF engine, in-process worker), against the same run with the overlap off; then the async memory
agent on 2 Ray worker processes (colocated engines: each worker generates in one thread while it trains in another,
``test_rollout_overlap_threads.py``), the in-process vLLM engine (CPU build) and
the single-turn trainer; and ``benchmarks/bench_train_step.py --overlap both`` (CPU smoke).

With the overlap on, step k+1's rollout is generated while step k updates the actor, on the engine's pre-update
weights. Two independent records show it: the policy versions the trainer books (``rollout/policy_version``,
``rollout/staleness``), and the numbers themselves: the engine's log-probs of its own samples equal the actor's
(to float noise) when the engine holds the actor's weights, and differ after an update at lr 1e-2 (the rollout
was sampled by the previous weights); the TIS weights that correct for it are capped at
``algorithm.rollout_is_threshold``. With ``algorithm.bypass_mode`` the same overlap takes PPO's ratio against the
stale engine's log-probs instead (no recompute pass, no TIS).
"""

from __future__ import annotations

import pytest
import torch

import verl.trainer.main_ppo as main_ppo
from tests.test_critic import _cfg as single_turn_cfg
from tests.test_trainer_e2e import _cfg

pytestmark = pytest.mark.slow

CAP = 1.05  # algorithm.rollout_is_threshold: small, so truncation shows up on a tiny model
QUIET = ["trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console]"]


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlap")
    torch.manual_seed(0)

    def run(name: str, *extra: str) -> dict[int, dict]:
        history = main_ppo.run(_cfg(tmp, tiny_model_path, str(tmp / name), 3, extra=[*QUIET, *extra]))
        return {h["step"]: h for h in history}

    return {
        "on": run("on", "trainer.rollout_overlap=True", f"algorithm.rollout_is_threshold={CAP}"),
        "off": run("off"),
        # bypass mode: PPO's old log-probs are the (stale) engine's; no recompute pass, no TIS
        "bypass": run("bypass", "trainer.rollout_overlap=True", "algorithm.bypass_mode=True"),
        # the same as "on" with the engine in a child process of the worker (rollout.engine_process=child)
        "child": run(
            "child",
            "trainer.rollout_overlap=True",
            f"algorithm.rollout_is_threshold={CAP}",
            "actor_rollout_ref.rollout.engine_process=child",
        ),
    }


def test_overlap_trains_on_rollouts_one_step_stale(runs):
    on = runs["on"]
    assert sorted(on) == [1, 2, 3]
    for step, h in on.items():
        for k, v in h.items():
            if isinstance(v, float):
                assert v == v and abs(v) != float("inf"), (step, k)
        assert h["trajectory/num_conv/min"] >= 4 and "actor/pg_loss" in h  # memory turns + the final answer
    # the first step's rollout is generated in the step (current weights); every later one ran ahead during the
    # previous step's update: step k+1 trains on a batch generated with version k-1, before update k was applied
    assert [on[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [on[s]["rollout/policy_version"] for s in (1, 2, 3)] == [0.0, 0.0, 1.0]
    # steps 1 and 2 waited for the next step's rollout before their weight sync; the last step has no next one
    assert [("timing_s/wait_rollout_ahead" in on[s]) for s in (1, 2, 3)] == [True, True, False]
    assert [("timing_s/rollout_ahead_idle" in on[s]) for s in (1, 2, 3)] == [True, True, False]
    assert "perf/engine_reserved_sms" not in on[1]  # no SMs kept (CPU), none logged
    # the numbers agree: the engine sampled step 1 with the actor's weights, steps 2 and 3 with the previous ones
    assert on[1]["rollout/logprob_abs_diff_max"] < 1e-3
    for s in (2, 3):
        assert on[s]["rollout/logprob_abs_diff_mean"] > 1e-2, s


def test_one_step_off_with_the_engine_in_a_child_process(runs):
    """rollout.engine_process=child: the same rollouts and updates as the engine in the worker's process (the same
    seeds; weights handed over as flat buffers): staleness one step, the engine's log-probs equal the actor's at
    step 1 and differ after, and the losses and rewards equal the in-process run's."""
    on, child = runs["on"], runs["child"]
    assert [child[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert child[1]["rollout/logprob_abs_diff_max"] < 1e-3
    for s in (1, 2, 3):
        for key in ("critic/score/mean", "actor/pg_loss", "rollout/logprob_abs_diff_mean", "rollout/is_weight_mean"):
            assert child[s][key] == pytest.approx(on[s][key], rel=1e-4, abs=1e-6), (s, key)
    # the engine process's own peak host memory is reported beside the worker's (which no longer includes it)
    for s in (1, 2, 3):
        assert child[s]["perf/rollout/engine_process_cpu_memory_peak_rss_gb"] > 0.1, s
        assert "perf/rollout/engine_process_cpu_memory_peak_rss_gb" not in on[s]


def test_overlap_corrects_with_truncated_importance_weights(runs):
    on = runs["on"]
    assert on[1]["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # no staleness: weights ~1
    assert on[1]["rollout/is_truncated_frac"] == 0.0
    for s in (2, 3):
        assert on[s]["rollout/is_weight_max"] == pytest.approx(CAP)  # algorithm.rollout_is_threshold caps them
        assert on[s]["rollout/is_truncated_frac"] > 0
        assert abs(on[s]["rollout/is_weight_mean"] - 1.0) > 1e-3
        assert on[s]["rollout/is_weight_min"] < 1.0


def test_overlap_off_is_the_synchronous_step(runs):
    on, off = runs["on"], runs["off"]
    assert [off[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert [off[s]["rollout/policy_version"] for s in (1, 2, 3)] == [0.0, 1.0, 2.0]
    for s in (1, 2, 3):
        assert off[s]["rollout/logprob_abs_diff_max"] < 1e-3, s  # the engine follows the actor every step
        assert "rollout/is_weight_mean" not in off[s]  # TIS off by default without the overlap
        assert "timing_s/wait_rollout_ahead" not in off[s]
    # the first step is the same in both runs (same data, seeds and weights; TIS weights ~1)
    assert on[1]["trajectory/num_conv/mean"] == off[1]["trajectory/num_conv/mean"]
    assert on[1]["critic/score/mean"] == off[1]["critic/score/mean"]
    assert on[1]["actor/pg_loss"] == pytest.approx(off[1]["actor/pg_loss"], rel=5e-3, abs=1e-5)
    assert off[1]["actor/grad_norm"] > 1e-3  # non-zero advantages: the comparison means something


def _staleness_and_drift(hist: list[dict]) -> tuple[list[float], list[float]]:
    steps = {h["step"]: h for h in hist if h["step"] > 0}
    return (
        [steps[s]["rollout/staleness"] for s in sorted(steps)],
        [steps[s]["rollout/logprob_abs_diff_mean"] for s in sorted(steps)],
    )


@pytest.mark.parametrize("engine_process", ["worker", "child"])
def test_overlap_with_the_async_memory_agent_on_two_ray_ranks(tiny_model_path, tmp_path, ray_cluster, engine_process):
    """actor_rollout_ref.rollout.mode=async: the agents' coroutines run in the background thread against the
    engines of 2 Ray worker processes, whose generate calls run in each worker's rollout thread while the update runs
    in its train thread; the engines stay awake between the rollouts (no sleep after a rollout with the overlap).
    ``child``: each Ray worker's engine runs in a child process of that worker (that its weight syncs land is
    checked over 3 steps by ``test_one_step_off_with_the_engine_in_a_child_process``)."""
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "async"),
            2,
            extra=[
                *QUIET,
                "actor_rollout_ref.rollout.mode=async",
                "trainer.n_gpus_per_node=2",
                "trainer.rollout_overlap=True",
                f"actor_rollout_ref.rollout.engine_process={engine_process}",
            ],
        )
    )
    staleness, drift = _staleness_and_drift(hist)
    assert staleness == [0.0, 1.0]
    assert drift[0] < 1e-3 < 1e-2 < drift[1]  # step 2 was sampled by the weights before update 1
    assert hist[-1]["trajectory/num_conv/min"] >= 4 and hist[-1]["rollout/is_weight_mean"] != 1.0


def test_overlap_with_free_running_turns_on_two_ray_ranks(tiny_model_path, tmp_path, ray_cluster):
    """rollout.free_running_turns (the sync memory agent, each trajectory's turns on their own, a Ray call per
    request) with the rollout running ahead: each worker's rollout group has a thread per trajectory of the rank (4
    here) beside its train thread."""
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "free"),
            2,
            extra=[
                *QUIET,
                "actor_rollout_ref.rollout.free_running_turns=True",
                "trainer.n_gpus_per_node=2",
                "trainer.rollout_overlap=True",
            ],
        )
    )
    staleness, drift = _staleness_and_drift(hist)
    assert staleness == [0.0, 1.0]
    assert drift[0] < 1e-3 < 1e-2 < drift[1]  # step 2 was sampled by the weights before update 1
    for h in hist[-2:]:
        assert h["trajectory/count"] == 8 and h["trajectory/num_conv/min"] >= 4
        assert h["rollout/replica_calls"] == h["trajectory/num_conv/mean"] * 8  # one call per conversation


def test_the_memory_trainer_balances_the_sm_split_from_each_steps_timings(tiny_model_path, tmp_path, monkeypatch):
    """``rollout.balance_reserved_sms`` through the real trainer and in-process worker: main_ppo's check that the
    split can apply (vLLM on a GPU beside training) is bypassed, as the split itself only acts on a GPU; each step
    with a rollout ahead logs the split it ran with, and the next step's is the previous one moved by
    ``balance_shift`` of the step's own logged waits (over the part of the step the rollout ran beside: at least the
    passes and the wait, at most the step)."""
    from verl.workers.training_sms import balance_shift

    monkeypatch.setattr(main_ppo, "engine_sms_not_applicable", lambda *args: None)
    monkeypatch.setattr(main_ppo, "resolve_engine_reserved_sms", lambda value, *args, **kwargs: (value, None))
    extra = [
        *QUIET,
        "trainer.rollout_overlap=True",
        "algorithm.bypass_mode=True",
        "actor_rollout_ref.rollout.engine_reserved_sms=16",
        "actor_rollout_ref.rollout.balance_reserved_sms=True",
    ]
    hist = {h["step"]: h for h in main_ppo.run(_cfg(tmp_path, tiny_model_path, str(tmp_path / "b"), 4, extra=extra))}
    assert [("perf/engine_reserved_sms" in hist[s]) for s in (1, 2, 3, 4)] == [True, True, True, False]  # 4: none
    # no move after the first step (its training passes pay one-time costs), then by the step's own waits
    assert hist[1]["perf/engine_reserved_sms"] == hist[2]["perf/engine_reserved_sms"] == 16.0
    h = hist[2]
    waited, idle = h["timing_s/wait_rollout_ahead"], h["timing_s/rollout_ahead_idle"]
    shortest, longest = h["timing_s/ref"] + h["timing_s/update_actor"] + waited, h["timing_s/step"]
    shifts = {balance_shift(waited, idle, shortest), balance_shift(waited, idle, longest)}
    assert hist[3]["perf/engine_reserved_sms"] - 16.0 in shifts


def test_overlap_with_the_single_turn_trainer(tiny_model_path, tmp_path):
    hist = main_ppo.run(
        single_turn_cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "st"),
            3,
            "grpo",
            extra=[
                "critic.model.path=/nonexistent",
                "trainer.save_freq=-1",
                "actor_rollout_ref.actor.optim.lr=1e-2",
                "trainer.rollout_overlap=True",
            ],
        )
    )
    staleness, drift = _staleness_and_drift(hist)
    assert staleness == [0.0, 1.0, 1.0]
    assert drift[0] < 1e-3 and min(drift[1:]) > 1e-2
    assert all(h["actor/pg_loss"] == h["actor/pg_loss"] for h in hist)


def test_bench_train_step_runs_overlapped_and_synchronous_side_by_side(tiny_model_path, tmp_path, capsys):
    """``benchmarks/bench_train_step.py --overlap both`` (CPU smoke, tiny): both runs in one process, same data."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_train_step import main

    out = tmp_path / "train_step.json"
    argv = ["--model", str(tiny_model_path), "--overlap", "both", "--steps", "3", "--batch", "1", "--n", "2"]
    # two settings with no effect here: an INERT key, and SMs kept for an engine that is not vLLM on a GPU
    no_effect = ["actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.engine_reserved_sms=16"]
    assert main([*argv, "--chunks", "2", "--out", str(out), "--", *no_effect]) == 0
    report = json.loads(out.read_text())
    for name in ("sync", "overlap"):  # each run's, in the report and printed
        inert = report["inert_settings"][name]
        assert len(inert) == 2 and inert[0].startswith("actor_rollout_ref.hybrid_engine = False (default True)")
        assert inert[1].startswith("actor_rollout_ref.rollout.engine_reserved_sms=16 has no effect: "), inert
    assert [r["staleness"] for r in report["steps"]] == [0.0, 0.0, 0.0]
    assert [r["staleness"] for r in report["overlap_steps"]] == [0.0, 1.0, 1.0]
    assert [r["wait_rollout_ahead"] for r in report["steps"]] == [0.0, 0.0, 0.0]
    summary = report["overlap_summary"]
    assert summary["steady_steps"] == [2]
    assert summary["sync_step_s"] == pytest.approx(report["steps"][1]["total"])
    assert summary["overlap_step_s"] == pytest.approx(report["overlap_steps"][1]["total"])
    assert summary["speedup"] == pytest.approx(summary["sync_step_s"] / summary["overlap_step_s"])
    printed = capsys.readouterr().out
    assert "One-step-off (trainer.rollout_overlap) vs synchronous" in printed and "speedup x" in printed
    assert printed.index("settings with no effect in the sync run:\n  actor_rollout_ref.hybrid_engine") < printed.index(
        "settings with no effect in the overlap run:"
    )
    # which side of each overlapped step finished last: steps 1-2 had a rollout ahead, step 3 none
    ahead = report["overlap_steps"]
    assert [r["wait_rollout_ahead"] + r["rollout_ahead_idle"] > 0 for r in ahead] == [True, True, False]
    assert printed.count("One-step-off balance (seconds)") == 1  # the synchronous run has none
    assert report["complete"] is True and "error" not in report
    # every step of both runs was logged beside --out as it ended; the report rebuilt from that log is the same
    log_dir = tmp_path / "train_step.steps"
    for name in ("sync", "overlap"):
        lines = (log_dir / name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2, 3], name
    rebuilt_path = tmp_path / "rebuilt.json"
    assert main(["--report-from", str(log_dir), "--out", str(rebuilt_path)]) == 0
    rebuilt = json.loads(rebuilt_path.read_text())
    keys = ("steps", "overlap_steps", "overlap_summary", "complete", "batch", "n", "chunks", "overrides", "env")
    for key in (*keys, "inert_settings"):
        assert rebuilt[key] == report[key], key


@pytest.mark.vllm
def test_overlap_with_the_vllm_engine(tiny_model_path, tmp_path):
    """rollout.name=vllm (in-process vLLM, CPU build): the rollout running ahead uses the engine while the actor
    updates in the same process; the sync after it loads the new weights."""
    vllm = [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
    ]
    hist = main_ppo.run(
        _cfg(tmp_path, tiny_model_path, str(tmp_path / "v"), 3, extra=[*QUIET, *vllm, "trainer.rollout_overlap=True"])
    )
    staleness, drift = _staleness_and_drift(hist)
    assert staleness == [0.0, 1.0, 1.0]
    assert drift[0] < 1e-3 and min(drift[1:]) > 1e-2


def test_bypass_mode_takes_the_ratio_against_the_stale_engine(runs):
    """One-step-off with ``algorithm.bypass_mode``: the same staleness, no old-log-prob pass and no TIS; PPO's ratio
    starts from the engine's (previous) weights, so the update sees the one-step gap the recomputing run's TIS
    weights corrected for."""
    bypass, on = runs["bypass"], runs["on"]
    assert [bypass[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for s in (1, 2, 3):
        assert "timing_s/old_log_prob" not in bypass[s] and "timing_s/old_log_prob" in on[s]
        assert not any(k.startswith("rollout/is_") or k.startswith("rollout/logprob_abs_diff") for k in bypass[s])
    # step 1 is on-policy in both: the same rollout and loss (engine log-probs = actor's here)
    assert bypass[1]["actor/pg_loss"] == pytest.approx(on[1]["actor/pg_loss"], rel=1e-3, abs=1e-5)
    # steps 2-3: the ratio is against the previous weights from the first mini-batch on (measured 0.048/0.044 vs
    # 0.034/-0.028 recomputed, where only the second mini-batch sees the first one's update; clipped fraction
    # 0.27/0.24 vs 0.20/0.12)
    for s in (2, 3):
        assert bypass[s]["actor/ppo_kl"] > max(on[s]["actor/ppo_kl"], 1e-2), s
        assert bypass[s]["actor/pg_clipfrac"] > on[s]["actor/pg_clipfrac"], s

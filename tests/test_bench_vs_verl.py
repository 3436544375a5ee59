"""benchmarks/bench_vs_verl.py on the tiny model, CPU: this project's actor against upstream verl 0.7.1's.

Upstream is the PyPI wheel ``verl==0.7.1`` installed with ``--no-deps`` into its own folder (scripts/install.sh puts
it in ``.venv/verl-upstream-0.7.1``; ``$VERL_UPSTREAM_PATH`` or ``$VERL_UPSTREAM_WHEEL`` name another one). Without
it these tests skip. Each run starts two subprocesses (torch, transformers and a ``verl`` each): ~40-90 s a test
on 2 shared cores, hence ``slow``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_vs_verl  # noqa: E402

UPSTREAM_ARGS = (
    ["--upstream-path", os.environ["VERL_UPSTREAM_PATH"]]
    if os.environ.get("VERL_UPSTREAM_PATH")
    else ["--upstream-wheel", os.environ["VERL_UPSTREAM_WHEEL"]]
    if os.environ.get("VERL_UPSTREAM_WHEEL")
    else ["--upstream-path", str(bench_vs_verl.installed_upstream())]
    if bench_vs_verl.installed_upstream()
    else None
)
pytestmark = pytest.mark.skipif(
    UPSTREAM_ARGS is None,
    reason="upstream verl 0.7.1 not installed: `.venv/bin/pip install --no-deps --target "
    ".venv/verl-upstream-0.7.1 verl==0.7.1` (scripts/install.sh does it), or set VERL_UPSTREAM_PATH / "
    "VERL_UPSTREAM_WHEEL",
)

TINY = ["--shape", "tiny", "--device", "cpu", "--prompt-len", "48", "--response-len", "32", "--steps", "1"]


def _run(tmp_path: Path, *extra: str) -> dict:
    return bench_vs_verl.main([*TINY, *UPSTREAM_ARGS, "--workdir", str(tmp_path), *extra])


def _on_policy_loss(advantages: torch.Tensor, mask: torch.Tensor) -> float:
    """PPO clip at ratio 1 is ``-advantage`` per token; its global token-mean."""
    return float(-(advantages * mask).sum() / mask.sum())


@pytest.mark.slow
def test_one_micro_batch_same_weights_same_losses(tmp_path):
    report = _run(tmp_path, "--rows", "4", "--token-budget", "4096", "--out", str(tmp_path / "out.json"))
    assert json.loads((tmp_path / "out.json").read_text())["benchmark"] == "vs_verl"  # what suite_tables.py reads
    ours, up = report["sides"]["ours"], report["sides"]["upstream"]
    # each side imported its own verl
    assert Path(ours["verl_from"]) == REPO / "verl"
    assert up["verl_version"] == "0.7.1" and Path(up["verl_from"]) != REPO / "verl"
    assert up["stubs"] == [] and up["fused_kernels"] is False and ours["fused_kernels"] is True
    assert ours["attn_implementation"] == up["attn_implementation"] == report["spec"]["attn"] == "sdpa"
    assert (
        bool(up["substitutions"]) != up["flash_attn_available"]
    )  # upstream's own unpad copies only without flash-attn

    batches = torch.load(tmp_path / "batches.pt")
    # two warm-up calls (bench_update_policy.py's module docstring), then the one timed call
    assert report["spec"]["warmup_calls"] == 2 and len(batches) == 3
    tokens = float(batches[2]["attention_mask"].sum())
    expected = _on_policy_loss(batches[0]["advantages"], batches[0]["response_mask"])
    for side in (ours, up):
        assert side["tokens_per_call"] == tokens
        assert side["log_prob"]["compiled_graphs_timed"] == 0 == side["update_policy"]["compiled_graphs_timed"]
        assert side["update_policy"]["tokens_per_s"] == pytest.approx(tokens / side["update_policy"]["seconds"])
        assert side["update_policy"]["mfu"] == pytest.approx(
            6 * report["spec"]["num_params"] * tokens / side["update_policy"]["seconds"] / 790e12
        )
        assert side["log_prob"]["mfu"] == pytest.approx(
            2 * report["spec"]["num_params"] * tokens / side["log_prob"]["seconds"] / 790e12
        )
        assert side["first_step"]["micro_batches"] == [1]
        assert side["first_step"]["pg_loss"] == pytest.approx(expected, abs=1e-6)
        assert side["first_step"]["pg_loss_expected_on_policy"] == pytest.approx(
            expected, abs=1e-7
        )  # float32 sums here

    c = report["comparison"]
    assert c["same_objective"] is True
    # fp32 on CPU, same weights and rows: the two actors compute the same log-probs and the same first gradient
    assert c["log_prob_batch0_max_abs_diff"] < 1e-5
    assert abs(c["pg_loss_diff"]) < 1e-6
    assert abs(c["grad_norm_rel_diff"]) < 1e-5
    assert ours["first_step"]["grad_norm"] > 0.1
    assert (tmp_path / "out.json").is_file()
    table = bench_vs_verl.table(report)
    assert "| ours |" in table and "| upstream |" in table and "same objective: True" in table


@pytest.mark.slow
def test_several_micro_batches_each_side_follows_its_normalisation(tmp_path):
    """A 100-token budget splits every mini-batch: ours keeps the global token-mean, upstream 0.7.1 weights the
    token-mean of each micro-batch by its share of rows (and sums over mini-batches), so the losses differ."""
    report = _run(
        tmp_path,
        *("--rows", "6", "--token-budget", "100", "--mini-batches", "2", "--upstream-fused-kernels"),
        *("--upstream-attn", "eager"),  # each side its own attention (the models still agree: fp32, same weights)
    )
    ours, up = report["sides"]["ours"], report["sides"]["upstream"]
    assert up["fused_kernels"] is True
    assert (ours["attn_implementation"], up["attn_implementation"]) == ("sdpa", "eager")
    assert report["spec"]["attn"] == "sdpa (ours) / eager (upstream)"
    batch = torch.load(tmp_path / "batches.pt")[0]
    adv, mask = batch["advantages"], batch["response_mask"]
    ours_expected = (_on_policy_loss(adv[:3], mask[:3]) + _on_policy_loss(adv[3:], mask[3:])) / 2
    assert ours["first_step"]["pg_loss_expected_on_policy"] == pytest.approx(
        ours_expected, abs=1e-7
    )  # float32 sums here
    for side in (ours, up):
        assert len(side["first_step"]["micro_batches"]) == 2
        assert min(side["first_step"]["micro_batches"]) >= 2
        assert side["first_step"]["pg_loss"] == pytest.approx(
            side["first_step"]["pg_loss_expected_on_policy"], abs=1e-5
        )
    c = report["comparison"]
    assert c["same_objective"] is False
    assert abs(c["pg_loss_diff"]) > 1e-3
    assert c["log_prob_batch0_max_abs_diff"] < 1e-5  # the log-prob pass (one micro-batch) still agrees


def test_spec_names_the_attention_both_sides_run(tmp_path):
    """``spec["attn"]`` (the table's title) names what the sides run: with both set apart from ``--attn``, their
    common backend, not ``--attn``; different ones, both."""
    args = bench_vs_verl.parse_args([*TINY, "--attn", "eager", "--ours-attn", "sdpa", "--upstream-attn", "sdpa"])
    spec = bench_vs_verl.write_inputs(args, tmp_path, "cpu")
    assert (spec["attn"], spec["ours_attn"], spec["upstream_attn"]) == ("sdpa", "sdpa", "sdpa")
    spec = bench_vs_verl.write_inputs(bench_vs_verl.parse_args([*TINY, "--ours-attn", "eager"]), tmp_path, "cpu")
    assert (spec["attn"], spec["ours_attn"], spec["upstream_attn"]) == (
        "eager (ours) / sdpa (upstream)",
        "eager",
        "sdpa",
    )


def test_side_pythonpath_keeps_inherited_entries_without_a_verl(tmp_path):
    """A ``pip --target`` environment on PYTHONPATH stays importable; a folder holding a ``verl`` (this repository
    or another upstream copy) never follows a side's own ``verl``."""
    site, other = tmp_path / "site", tmp_path / "other"
    site.mkdir()
    (other / "verl").mkdir(parents=True)
    upstream = tmp_path / "upstream"
    inherited = os.pathsep.join([str(site), str(bench_vs_verl.REPO), "", str(other)])
    assert bench_vs_verl.side_pythonpath("upstream", upstream, inherited).split(os.pathsep) == [
        str(upstream),
        str(site),
    ]
    assert bench_vs_verl.side_pythonpath("ours", None, inherited).split(os.pathsep) == [
        str(bench_vs_verl.REPO),
        str(site),
    ]
    assert bench_vs_verl.side_pythonpath("ours", None, "") == str(bench_vs_verl.REPO)


def test_a_failing_side_is_logged_and_its_tail_reported(tmp_path, capfd):
    """A side's output streams as it runs and lands in <workdir>/<side>.log; a failure repeats its tail, and a
    side past --timeout is killed and said to be."""
    with pytest.raises(RuntimeError, match=r"ours side failed \(exit 1\)") as failed:
        bench_vs_verl.run_side("ours", tmp_path, None, timeout=120)  # no spec.json in the work folder
    assert "spec.json" in str(failed.value)
    assert "spec.json" in (tmp_path / "ours.log").read_text()
    assert "spec.json" in capfd.readouterr().err
    with pytest.raises(RuntimeError, match=r"killed after --timeout 0.5 s"):
        bench_vs_verl.run_side("ours", tmp_path, None, timeout=0.5)


def test_a_side_killed_from_elsewhere_is_not_reported_as_the_timeout(tmp_path, monkeypatch):
    """A side killed by a signal it did not get from --timeout's watchdog (the OOM killer's SIGKILL) is reported by
    its exit status, with its output's tail, not as a timeout."""
    killer = tmp_path / "killed.sh"
    killer.write_text("#!/bin/sh\necho about to be killed\nkill -9 $$\n")
    killer.chmod(0o755)
    monkeypatch.setattr(bench_vs_verl.sys, "executable", str(killer))
    with pytest.raises(RuntimeError, match=r"ours side failed \(exit -9\)") as failed:
        bench_vs_verl.run_side("ours", tmp_path, None, timeout=120)
    assert "about to be killed" in str(failed.value)


def test_ours_only_attention_for_upstream_is_refused_before_anything_runs(tmp_path):
    """``torch_varlen`` is registered by this repository's loader only: naming it for upstream (through --attn or
    --upstream-attn) stops at once with the flags to use instead, before the wheel is installed or weights written."""
    for flags in (["--attn", "torch_varlen"], ["--upstream-attn", "torch_varlen"]):
        with pytest.raises(SystemExit, match="--ours-attn torch_varlen"):
            bench_vs_verl.main(
                [*TINY, "--upstream-wheel", str(tmp_path / "none.whl"), "--workdir", str(tmp_path), *flags]
            )
        assert not (tmp_path / "model").exists() and not (tmp_path / "upstream").exists()

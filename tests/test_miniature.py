"""The miniature experiment's own pieces: data files, the launch script's config, the in-process
OpenAI endpoint and the evaluation driver (tiny model, HF engine, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

import verl.trainer.main_ppo as main_ppo
from recipe.miniature import make_data
from serve.vllm_server import ServerSpec, build_launch_plans
from taskutils.memory_data.synthetic_qa import make_needle_qa_dataset
from verl.trainer.config_schema import ConfigError, validate_config

REPO = Path(__file__).resolve().parents[1]
CHUNK = 128


def _args(out: Path, tok: Path, *extra: str):
    return make_data.build_parser().parse_args(
        [
            "--tokenizer",
            str(tok),
            "--out",
            str(out),
            "--chunk-tokens",
            str(CHUNK),
            "--train-n",
            "6",
            "--val-n",
            "3",
            "--train-max-chunks",
            "3",
            "--eval-n",
            "2",
            "--eval-lengths",
            "1,4",
            "--eval-seeds",
            "1,2",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def data_dir(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("mini") / "data"
    args = _args(out, tiny_model_path)
    make_data.write_files(make_data.plan_files(args), str(tiny_model_path), CHUNK, workers=2, rows_per_job=2)
    return out


def test_data_files_match_the_generator_row_for_row(data_dir, tiny_model_path):
    train = pd.read_parquet(data_dir / "train.parquet")
    ref = pd.DataFrame(
        make_needle_qa_dataset(
            6, (1, 3), CHUNK, str(tiny_model_path), seed=make_data.TRAIN_SEED, data_source=make_data.DATA_SOURCE
        )
    )
    assert list(train["context"]) == list(ref["context"])
    assert [r["ground_truth"][0] for r in train["reward_model"]] == [r["ground_truth"][0] for r in ref["reward_model"]]
    assert set(train["data_source"]) == {"synthetic_qa"}
    # all four kinds, lengths within 1..3 chunks
    assert {e["kind"] for e in train["extra_info"]} == set(make_data.DEFAULT_KINDS)
    assert all(
        1 <= e["num_chunks"] <= 3 and e["context_tokens"] <= e["num_chunks"] * CHUNK for e in train["extra_info"]
    )


def test_eval_grid_has_every_kind_length_and_seed_with_exact_chunk_counts(data_dir):
    for seed in (1, 2):
        for length in (1, 4):
            for kind in make_data.DEFAULT_KINDS:
                df = pd.read_parquet(data_dir / "eval" / f"seed{seed}" / f"eval_{kind}_{length}.parquet")
                assert len(df) == 2
                for e in df["extra_info"]:
                    assert e["kind"] == kind and e["num_chunks"] == length
                    assert (length - 1) * CHUNK < e["context_tokens"] <= length * CHUNK
    # seeds (and train vs eval) ask different questions
    q1 = set(pd.read_parquet(data_dir / "eval" / "seed1" / "eval_niah_single_4.parquet")["context"])
    q2 = set(pd.read_parquet(data_dir / "eval" / "seed2" / "eval_niah_single_4.parquet")["context"])
    assert not q1 & q2


def test_existing_files_are_kept(data_dir, tiny_model_path):
    path = data_dir / "val.parquet"
    before = path.stat().st_mtime_ns
    written = make_data.write_files(
        make_data.plan_files(_args(data_dir, tiny_model_path)), str(tiny_model_path), CHUNK, workers=1
    )
    assert written == [] and path.stat().st_mtime_ns == before


def test_make_data_rejects_unknown_kinds(tiny_model_path, tmp_path):
    with pytest.raises(SystemExit, match="unknown kind"):
        make_data.main(["--tokenizer", str(tiny_model_path), "--out", str(tmp_path), "--kinds", "niah_single,bogus"])


def _launch_overrides(tmp_path, *extra: str, **env: str) -> list[str]:
    """The Hydra overrides run_memory_smollm2.sh passes to main_ppo (DRY_RUN), with ``env`` on top."""
    base = {"DRY_RUN": "1", "DATA_DIR": "/data", "MODEL_PATH": "/models/smollm2", "OUT_DIR": str(tmp_path)}
    out = subprocess.run(
        ["bash", str(REPO / "recipe" / "miniature" / "run_memory_smollm2.sh"), *extra],
        env={**os.environ, **base, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[1:3] == ["-m", "verl.trainer.main_ppo"]
    return out[3:]


def _compose_ppo(overrides: list[str]):
    with initialize_config_dir(config_dir=str(Path(main_ppo.__file__).parent / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    validate_config(cfg)
    return cfg


def test_launch_script_overrides_compose_and_validate(tmp_path):
    overrides = _launch_overrides(tmp_path, "trainer.test_freq=3", STEPS="7", MAX_WALL="300")
    assert overrides[-1] == "trainer.test_freq=3"  # extra arguments come last and win
    cfg = _compose_ppo(overrides)
    mem = cfg.recurrent.memory.config
    assert (mem.chunk_size, mem.max_memorization_length, mem.max_chunks) == (512, 128, 8)
    assert cfg.trainer.total_training_steps == 7 and cfg.trainer.max_wall_time_s == 300 and cfg.trainer.test_freq == 3
    assert cfg.actor_rollout_ref.rollout.n == 8 and cfg.data.train_files == "/data/train.parquet"
    # the defaults: the paper's strict verifier alone (the built-in synthetic_qa route), seed 0, 200 steps, no
    # wall-clock limit, resume from the latest of the two kept checkpoints
    cfg = _compose_ppo(_launch_overrides(tmp_path))
    assert cfg.custom_reward_function.path is None
    from verl.utils.reward_score import default_compute_score

    boxed, unboxed = "The answer is \\boxed{6235}.", "The special magic number is 6235."
    assert default_compute_score("synthetic_qa", boxed, ["6235"]) == 1.0
    assert default_compute_score("synthetic_qa", unboxed, ["6235"]) == 0.0  # no partial credit
    assert (cfg.data.seed, cfg.actor_rollout_ref.actor.seed, cfg.actor_rollout_ref.rollout.seed) == (0, 0, 0)
    assert cfg.trainer.total_training_steps == 200 and cfg.trainer.max_wall_time_s is None
    assert (cfg.trainer.resume_mode, cfg.trainer.max_actor_ckpt_to_keep) == ("auto", 2)


def test_launch_script_seed_steps_and_demo_reward_reach_the_config(tmp_path):
    cfg = _compose_ppo(_launch_overrides(tmp_path, TRAIN_SEED="3", TRAIN_STEPS="500", STEPS="7", REWARD="demo"))
    assert (cfg.data.seed, cfg.actor_rollout_ref.actor.seed, cfg.actor_rollout_ref.rollout.seed) == (3, 3, 3)
    assert cfg.trainer.total_training_steps == 500  # TRAIN_STEPS wins over the older STEPS
    assert cfg.custom_reward_function.path == str(REPO / "scripts" / "demo_reward.py")
    for env, message in (
        ({"REWARD": "lenient"}, "REWARD=lenient: expected strict"),
        ({"TRAIN_SEED": "-1"}, "TRAIN_SEED=-1: expected a non-negative integer"),
        ({"TRAIN_STEPS": "0"}, "TRAIN_STEPS=0: expected a positive integer"),
    ):
        with pytest.raises(subprocess.CalledProcessError) as error:
            _launch_overrides(tmp_path, **env)
        assert error.value.returncode == 2 and message in error.value.stderr


def test_recipe_scripts_parse():
    scripts = sorted((REPO / "recipe" / "miniature").glob("*.sh"))
    assert {p.name for p in scripts} >= {"pipeline.sh", "run_memory_smollm2.sh", "seeds.sh"}
    for script in scripts:  # bash scripts (arrays, here-strings): `bash -n`, not a POSIX sh
        assert script.read_text().startswith("#!/usr/bin/env bash\n"), script
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, (script, proc.stderr)


def test_wall_time_limit_is_validated():
    with initialize_config_dir(config_dir=str(Path(main_ppo.__file__).parent / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=["trainer.max_wall_time_s=-5"])
    with pytest.raises(ConfigError, match="trainer.max_wall_time_s"):
        validate_config(cfg)


def test_inproc_launch_plans():
    spec = ServerSpec(
        model_path="/m",
        served_model_name="m",
        port=9000,
        device="gpu",
        replicas=2,
        gpu_memory_utilization=0.2,
        backend="inproc",
        gpu_ids=["0", "1"],
        max_model_len=8192,
    )
    plans = build_launch_plans(spec)
    assert [p.port for p in plans] == [9000, 9001]
    assert plans[0].cmd[1:3] == ["-m", "serve.inproc_server"]
    assert "--gpu-memory-utilization" in plans[0].cmd and "8192" in plans[0].cmd
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0", "1"]
    assert all(p.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" for p in plans)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        build_launch_plans(ServerSpec(model_path="/m", backend="inproc", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="backend must be"):
        build_launch_plans(ServerSpec(model_path="/m", backend="sglang"))


RUNNERS = ("http", "batched")


def _evaluate_cmd(root: Path, runner: str, model: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "recipe.miniature.evaluate",
        "--root",
        str(root),
        "--system",
        "untrained",
        "--runner",
        runner,
        "--model",
        str(model),
        "--device",
        "cpu",
        "--engine",
        "hf",
        "--dtype",
        "float32",
        "--lengths",
        "1,4",
        "--chunk-tokens",
        str(CHUNK),
        "--max-memory-tokens",
        "8",
        "--max-final-tokens",
        "8",
        "--max-input-tokens",
        "200",
        "--max-model-len",
        "1024",
        "--port",
        "8741",
        "--serve-timeout",
        "120",
    ]


@pytest.fixture(scope="module")
def evaluate_runs(data_dir, tiny_model_path, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """One ``recipe.miniature.evaluate`` process per runner, each in its own root, started at once: both spend
    most of their start-up importing torch/transformers on one core, so the module waits for the slower one
    instead of their sum."""
    started = {}
    for runner in RUNNERS:
        root = tmp_path_factory.mktemp(f"evaluate_{runner}") / "root"
        root.mkdir()
        (root / "data").symlink_to(data_dir)
        cmd = _evaluate_cmd(root, runner, tiny_model_path)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        # output to files, not pipes: a full pipe would stall one process while the other is waited for
        with (root.parent / "stdout").open("w") as out, (root.parent / "stderr").open("w") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        started[runner] = (root, cmd, proc)
    done = {}
    try:
        for runner, (root, cmd, proc) in started.items():
            rc = proc.wait(timeout=300)
            out, err = ((root.parent / name).read_text() for name in ("stdout", "stderr"))
            done[runner] = (root, subprocess.CompletedProcess(cmd, rc, out, err))
    finally:
        for _, _, proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


@pytest.mark.parametrize("runner", RUNNERS)
def test_evaluate_driver_runs_every_cell(evaluate_runs, runner):
    """recipe.miniature.evaluate, both runners (the HTTP harness against serve.inproc_server, and the
    batched in-process one): every seed x label x kind x length recorded, meta written."""
    root, proc = evaluate_runs[runner]
    assert proc.returncode == 0, proc.stderr[-3000:]
    for seed in (1, 2):
        for kind in make_data.DEFAULT_KINDS:
            for length in (1, 4):
                for label, requests in (("untrained-memory", length + 1), ("untrained-direct", 1)):
                    path = root / "eval" / f"seed{seed}" / f"{kind}_{length}" / f"{label}.jsonl"
                    records = [json.loads(line) for line in path.read_text().splitlines()]
                    assert sorted(r["_id"] for r in records) == [0, 1], path
                    assert all(r["status"] == "ok" and r["requests"] == requests for r in records), path
    if runner == "http":
        meta = json.loads((root / "meta" / "eval_untrained.json").read_text())
        assert meta["failed_items"] == 0 and meta["eval_wall_s"] > 0
    else:
        meta = json.loads((root / "meta" / "eval_untrained_runs.jsonl").read_text().splitlines()[-1])
        assert (meta["finished"], meta["remaining"]) == (
            2 * 2 * 4 * 2 * 2,
            0,
        )  # seeds x labels x kinds x lengths x items


def test_shards_partition_the_seed_kind_groups():
    from recipe.miniature.evaluate import build_parser, shard_groups

    seeds, kinds = [1, 2], ["a", "b", "c", "d"]
    shards = [shard_groups(seeds, kinds, (i, 4)) for i in range(4)]
    assert shards[0] == [(1, "a"), (2, "a")] and shards[3] == [(1, "d"), (2, "d")]
    assert sorted(g for shard in shards for g in shard) == [(s, k) for s in seeds for k in kinds]
    assert shard_groups(seeds, kinds, (1, 3)) == [(1, "b"), (2, "a"), (2, "d")]
    assert shard_groups(seeds, kinds, (0, 1)) == [(s, k) for s in seeds for k in kinds]
    parser = build_parser()
    base = ["--root", "r", "--system", "rl", "--model", "m"]
    assert parser.parse_args([*base, "--shard", "2/4"]).shard == (2, 4)
    for bad in ("4/4", "x", "1/0", "-1/2"):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "--shard", bad])
    from recipe.miniature.evaluate import main

    with pytest.raises(SystemExit, match="--shard 8/9: no .seed, kind. group falls in it .8 groups."):
        main([*base, "--shard", "8/9"])


def test_pipeline_runs_the_rl_evaluation_as_shards(data_dir, tiny_model_path, tmp_path):
    """pipeline.sh eval_rl with RL_SHARDS=2: two evaluate processes side by side, each with its own
    engine and log, together record every cell once; the stage fails if a shard fails."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "data").symlink_to(data_dir)
    (root / "rl_model").symlink_to(tiny_model_path)
    eval_args = (
        f"--device cpu --engine hf --dtype float32 --lengths 1,4 --chunk-tokens {CHUNK} "
        "--max-memory-tokens 8 --max-final-tokens 8 --max-model-len 1024"
    )
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "ROOT": str(root),
        "MODEL_PATH": str(tiny_model_path),
        "PYTHON": sys.executable,
        "RL_SHARDS": "2",
        "EVAL_ARGS": eval_args,
    }
    proc = subprocess.run(
        ["bash", str(REPO / "recipe/miniature/pipeline.sh"), "eval_rl"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    logs = {p.name: p.read_text() for p in (root / "logs").glob("*.log")}
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:] + str(logs)[-3000:]
    assert "shard 0/2: rc=0" in logs["eval_rl.log"] and "shard 1/2: rc=0" in logs["eval_rl.log"]
    assert "(shard 0/2)" in logs["eval_rl_shard0.log"] and "(shard 1/2)" in logs["eval_rl_shard1.log"]
    for seed in (1, 2):
        for kind in make_data.DEFAULT_KINDS:
            for length in (1, 4):
                path = root / "eval" / f"seed{seed}" / f"{kind}_{length}" / "rl-memory.jsonl"
                records = [json.loads(line) for line in path.read_text().splitlines()]
                assert sorted(r["_id"] for r in records) == [0, 1], path
    runs = [json.loads(line) for line in (root / "meta" / "eval_rl_runs.jsonl").read_text().splitlines()]
    assert sorted((r["shard"], r["finished"]) for r in runs) == [("0/2", 16), ("1/2", 16)]
    (root / "rl_model").unlink()  # no model: both shards fail, and so does the stage
    (root / "eval").rename(root / "eval_done")
    failed = subprocess.run(
        ["bash", str(REPO / "recipe/miniature/pipeline.sh"), "eval_rl"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert failed.returncode != 0 and "rc=0" not in (root / "logs" / "eval_rl.log").read_text()


def test_serve_cli_dry_run_with_the_inproc_backend(capsys):
    from serve.vllm_server import main as serve_main

    assert (
        serve_main(
            [
                "--model",
                "/models/m",
                "--backend",
                "inproc",
                "--device",
                "gpu",
                "--port",
                "9100",
                "--gpu-memory-utilization",
                "0.2",
                "--dry-run",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert "-m serve.inproc_server --model /models/m" in line and "--port 9100" in line
    assert line.startswith("VLLM_ENABLE_V1_MULTIPROCESSING=0 ")


def test_pipeline_evaluates_an_existing_model_without_training(tmp_path):
    """pipeline.sh all with TRAIN=0 EVAL_UNTRAINED=0 RL_SHARDS=2: no training, merge or untrained evaluation;
    the RL shards on $ROOT/rl_model, then the report; ends in DONE (a stale FAILED is cleared)."""
    root, calls = tmp_path / "mini", tmp_path / "calls.log"
    (root / "data").mkdir(parents=True)
    (root / "rl_model").mkdir()
    (root / "rl_model" / "config.json").write_text("{}")
    (root / "FAILED").write_text("eval_rl\n")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    stub = tmp_path / "py"
    stub.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')
    stub.chmod(0o755)
    env = {
        **os.environ,
        "ROOT": str(root),
        "MODEL_PATH": str(tmp_path / "base"),
        "PYTHON": str(stub),
        "RL_SHARDS": "2",
        "TRAIN": "0",
        "EVAL_UNTRAINED": "0",
        "WARMUP": "0",
    }
    proc = subprocess.run(
        ["bash", str(REPO / "recipe/miniature/pipeline.sh"), "all"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert (root / "DONE").is_file() and not (root / "FAILED").exists()
    lines = calls.read_text().splitlines()
    assert sum("recipe.miniature.evaluate" in line and "--system rl" in line for line in lines) == 2
    assert any("--shard 1/2" in line for line in lines) and "recipe.miniature.report" in lines[-1]
    pack = f"recipe.miniature.pack_records --root {root} --out {root}/records.jsonl.gz"
    assert lines[-2] == f"-m {pack}" and f"--records {root}/records.jsonl.gz --out docs/results" in lines[-1]
    assert not any("main_ppo" in line or "--system untrained" in line or "model_merger" in line for line in lines)
    (root / "rl_model" / "config.json").unlink()  # TRAIN=0 without a model: the run fails at `train`
    failed = subprocess.run(
        ["bash", str(REPO / "recipe/miniature/pipeline.sh"), "all"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert failed.returncode == 0 and (root / "FAILED").read_text().strip() == "train"


# A stand-in for the Python interpreter in the orchestration tests below: it logs each command and leaves the
# files the real command would leave (checkpoints with their COMPLETE marker, the merged models, the warm-up
# parquet, the pack, the evaluation's ready file), so that pipeline.sh's decisions can be checked in seconds.
# The RL "training" advances STUB_STEPS steps per command from the latest checkpoint, up to total_training_steps.
STUB = r"""#!/usr/bin/env bash
echo "$*" >> "$STUB_CALLS"
arg() { local key=$1 a; shift; for a; do [ "${a%%=*}" = "$key" ] && echo "${a#*=}"; done; }
flag() { local key=$1; shift; while [ $# -gt 1 ]; do [ "$1" = "$key" ] && { echo "$2"; return; }; shift; done; }
checkpoint() { mkdir -p "$1/actor/huggingface" && echo '{}' > "$1/actor/huggingface/config.json" && touch "$1/COMPLETE"; }
case "$*" in
    *verl.trainer.main_sft*) checkpoint "$(arg trainer.default_local_dir "$@")/global_step_3" ;;
    *verl.trainer.main_ppo*)
        dir=$(arg trainer.default_local_dir "$@"); total=$(arg trainer.total_training_steps "$@")
        last=$(ls -d "$dir"/global_step_* 2>/dev/null | sort -V | tail -1); last=${last##*_}
        next=$(( ${last:-0} + STUB_STEPS )); [ "$next" -gt "$total" ] && next=$total
        checkpoint "$dir/global_step_$next" ;;
    *recipe.miniature.make_data*) mkdir -p "$(flag --out "$@")" ;;
    *"warmup_data build"*) out=$(flag --out "$@"); mkdir -p "$(dirname "$out")" && touch "$out" ;;
    *model_merger*) out=$(flag --target_dir "$@"); mkdir -p "$out" && echo '{}' > "$out/config.json" ;;
    *pack_records*) touch "$(flag --out "$@")" ;;
    *recipe.miniature.evaluate*) ready=$(flag --ready-file "$@"); [ -n "$ready" ] && touch "$ready" ;;
esac
exit 0
"""


def _stub_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    stub, base = tmp_path / "py", tmp_path / "base"
    stub.write_text(STUB)
    stub.chmod(0o755)
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text("{}")
    return {**os.environ, "PYTHON": str(stub), "MODEL_PATH": str(base), "STUB_CALLS": str(tmp_path / "calls.log"),
            "STUB_STEPS": "5", **extra}  # fmt: skip


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def _script(name: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "recipe" / "miniature" / name), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip


def _one(lines: list[str], *parts: str) -> str:
    found = [line for line in lines if all(p in line for p in parts)]
    assert len(found) == 1, (parts, lines)
    return found[0]


def test_pipeline_warms_up_trains_from_the_warmed_model_and_continues_a_paused_run(tmp_path):
    """pipeline.sh all with the warm-up: untrained evaluation, rollouts on the training split, SFT data, SFT,
    warmed evaluation, RL from the warmed model with the training seed; MAX_WALL-style early stops leave PAUSED
    (exit 3) and the same command continues (finished stages skipped, training resumed) until DONE."""
    root = tmp_path / "mini"
    env = _stub_env(tmp_path, ROOT=str(root), TRAIN_SEED="2", TRAIN_STEPS="8")
    first = _script("pipeline.sh", "all", env=env)
    assert first.returncode == 3, first.stdout + first.stderr
    assert (root / "PAUSED").read_text().strip() == "train at step 5 of 8"
    assert not (root / "DONE").exists() and not (root / "FAILED").exists()
    lines, warmed = _calls(tmp_path), root / "warmed_model"
    assert _one(lines, "--system untrained").startswith("-m recipe.miniature.evaluate")
    rollouts = _one(lines, "warmup_data rollouts")
    assert f"--data {root}/data/train.parquet --model {tmp_path}/base" in rollouts and "--samples 2" in rollouts
    assert f"build --records {root}/warmup/rollouts --out {root}/warmup/warmup.parquet" in _one(lines, "build")
    sft = _one(lines, "main_sft").split()
    assert f"data.train_files={root}/warmup/warmup.parquet" in sft and f"model.partial_pretrain={tmp_path}/base" in sft
    assert (warmed / "config.json").is_file()
    assert f"--system warmed --model {warmed}" in _one(lines, "recipe.miniature.evaluate --root", "warmed")
    order = [next(i for i, line in enumerate(lines) if key in line)
             for key in ("rollouts", "build", "main_sft", "--system warmed", "main_ppo")]  # fmt: skip
    assert order == sorted(order)
    ppo = _one(lines, "main_ppo").split()[2:]
    assert not any("model_merger" in line or "--system rl" in line or "pack_records" in line for line in lines)
    cfg = _compose_ppo(ppo)  # the trainer's composed config: the warmed start, the seed, the strict reward
    assert cfg.actor_rollout_ref.model.path == str(warmed) and cfg.trainer.total_training_steps == 8
    assert (cfg.data.seed, cfg.actor_rollout_ref.actor.seed, cfg.actor_rollout_ref.rollout.seed) == (2, 2, 2)
    assert cfg.custom_reward_function.path is None and cfg.trainer.default_local_dir == f"{root}/train"
    assert (root / "meta" / "train_seed.txt").read_text().strip() == "2"
    assert (root / "meta" / "rl_init.txt").read_text().strip() == str(warmed)
    assert (root / "meta" / "reward.txt").read_text().startswith("strict: the strict boxed verifier alone")
    assert (root / "meta" / "train_overrides.txt").read_text().splitlines()[3:] == ppo  # packed with the run

    second = _script("pipeline.sh", "all", env=env)  # the next lease: everything finished is skipped
    assert second.returncode == 0 and (root / "DONE").is_file() and not (root / "PAUSED").exists(), second.stderr
    lines = _calls(tmp_path)
    assert not any(key in line for line in lines for key in ("--system untrained", "--system warmed", "warmup_data", "main_sft"))  # fmt: skip
    assert len([line for line in lines if "main_ppo" in line]) == 1
    assert f"--local_dir {root}/train/global_step_8/actor" in _one(lines, "model_merger")
    assert f"--hf_model_path {warmed}" in _one(lines, "model_merger")
    assert f"--system rl --model {root}/rl_model" in _one(lines, "--system rl")
    assert _one(lines, "pack_records").endswith("--train-seed 2") and "recipe.miniature.report" in lines[-1]
    log = (root / "logs" / "pipeline.log").read_text()
    assert "eval_untrained already done" in log and f"sft: {root}/warmed_model exists" in log

    third = _script("pipeline.sh", "all", env=env)  # nothing left but the report
    lines = _calls(tmp_path)
    assert third.returncode == 0 and [line.split()[1] for line in lines] == [
        "recipe.miniature.make_data", "recipe.miniature.make_data", "recipe.miniature.pack_records",
        "recipe.miniature.report"]  # fmt: skip

    other_seed = _script("pipeline.sh", "train", env={**env, "TRAIN_SEED": "3", "TRAIN_STEPS": "20"})
    assert other_seed.returncode == 1 and not _calls(tmp_path)
    assert "holds checkpoints of training seed 2, not TRAIN_SEED=3" in (root / "logs" / "train.log").read_text()


def test_seeds_script_runs_each_seed_in_its_own_root_from_the_base_seeds_warmed_model(tmp_path):
    """seeds.sh: the base seed runs everything; a later seed trains from the base's warmed model on the base's data
    with no baseline evaluations; each report covers every seed packed so far; `report` reports them all."""
    from recipe.miniature.evaluate import build_parser as eval_parser

    # every seed's evaluation (no --lengths given) covers the study's lengths
    assert make_data.EVAL_LENGTHS == (1, 2, 8, 32, 128, 512)
    assert eval_parser().parse_args(["--root", "r", "--system", "warmed", "--model", "m"]).lengths == [
        1,
        2,
        8,
        32,
        128,
        512,
    ]
    study = tmp_path / "study"
    env = _stub_env(tmp_path, STUDY=str(study), TRAIN_STEPS="4", SEEDS="1 2 3")
    env.pop("TRAIN_SEED", None)
    early = _script("seeds.sh", "2", env=env)
    assert early.returncode == 2 and "run recipe/miniature/seeds.sh 1 first" in early.stderr and not _calls(tmp_path)
    assert _script("seeds.sh", "1", env=env).returncode == 0 and (study / "seed1" / "DONE").is_file()
    lines = _calls(tmp_path)
    assert _one(lines, "pack_records").endswith("--train-seed 1") and any("main_sft" in line for line in lines)
    assert lines[-1].endswith(f"--records {study}/seed1/records.jsonl.gz --out {study}/report")
    second = _script("seeds.sh", "2", env=env)
    assert second.returncode == 0 and (study / "seed2" / "DONE").is_file(), second.stderr
    lines = _calls(tmp_path)
    assert (study / "seed2" / "data").resolve() == (study / "seed1" / "data").resolve()
    assert not any(key in line for line in lines for key in ("--system untrained", "--system warmed", "warmup_data", "main_sft"))  # fmt: skip
    cfg = _compose_ppo(_one(lines, "main_ppo").split()[2:])
    assert cfg.actor_rollout_ref.model.path == str(study / "seed1" / "warmed_model")
    assert cfg.actor_rollout_ref.rollout.seed == 2 and cfg.trainer.default_local_dir == f"{study}/seed2/train"
    assert _one(lines, "pack_records").endswith("--train-seed 2")
    assert f"--records {study}/seed1/records.jsonl.gz {study}/seed2/records.jsonl.gz --out {study}/report" in lines[-1]
    assert _script("seeds.sh", "report", env=env).returncode == 0
    assert _calls(tmp_path) == [f"-m recipe.miniature.report --records {study}/seed1/records.jsonl.gz "
                                f"{study}/seed2/records.jsonl.gz --out {study}/report"]  # fmt: skip


@pytest.mark.slow
def test_pipeline_warmup_data_sft_and_warmed_evaluation_on_the_tiny_model(data_dir, tiny_model_path, tmp_path):
    """The warm-up's real stages, one pipeline.sh call each (CPU, tiny model): warmup_data keeps the rollouts
    whose final answer holds the gold and boxes it; sft trains on them and leaves $ROOT/warmed_model, a Hugging
    Face folder with other weights than the untrained model's; eval_warmed records every cell as warmed-memory."""
    from safetensors.torch import load_file

    from recurrent.prompts import render_final_prompt

    root = tmp_path / "mini"
    (root / "warmup" / "rollouts" / "train_all").mkdir(parents=True)
    (root / "data").symlink_to(data_dir)
    (data_dir / ".eval_ready").touch()  # make_data's data_eval stage marks the evaluation data ready
    cell = root / "warmup" / "rollouts" / "train_all"
    question = "What is the special magic number for sacred-garlic?"
    records = [{"_id": i, "task": "train", "length": "all", "label": "untrained-memory-s0", "status": "ok",
                "method": "recurrent-boxed", "question": question, "answers": [str(6230 + i)],
                "response": f"The number is {6230 + i if i < 4 else 1}.", "num_chunks": 1,
                "final_prompt": render_final_prompt(question, f"sacred-garlic: {6230 + i}")} for i in range(6)]  # fmt: skip
    (cell / "untrained-memory-s0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = {"task": "train", "length": "all", "method": "recurrent-boxed", "data_file": str(data_dir / "train.parquet")}
    (cell / "untrained-memory-s0.meta.json").write_text(json.dumps(meta))
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "ROOT": str(root),
        "MODEL_PATH": str(tiny_model_path),
        "PYTHON": sys.executable,
        # no data.train_batch_size: the stage's 32 shrinks to the 4 kept conversations (32 > 4 rows is refused)
        "SFT_OVERRIDES": "trainer.device=cpu data.micro_batch_size_per_gpu=1 optim.lr=1e-3 "
        "optim.warmup_steps_ratio=0 trainer.total_epochs=2 trainer.logger=[jsonl]",
        "EVAL_ARGS": f"--device cpu --engine hf --dtype float32 --seeds 1 --lengths 1 --chunk-tokens {CHUNK} "
        "--max-memory-tokens 8 --max-final-tokens 8 --max-model-len 1024",
    }
    for stage in ("warmup_data", "sft", "eval_warmed"):
        proc = _script("pipeline.sh", stage, env=env)
        log = root / "logs" / f"{stage}.log"
        assert proc.returncode == 0, (stage, log.read_text()[-3000:] if log.exists() else proc.stderr)
    rows = pd.read_parquet(root / "warmup" / "warmup.parquet")
    assert [m[1]["content"] for m in rows["messages"]] == [
        f"The number is {6230 + i}. \\boxed{{{6230 + i}}}" for i in range(4)
    ]
    metrics = [json.loads(line) for line in (root / "sft" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]  # 4 conversations, all 4 per step, two epochs
    assert [m["train/epoch"] for m in metrics] == [1.0, 2.0]
    warmed, untrained = root / "warmed_model", tiny_model_path
    assert (root / "meta" / "warmed_checkpoint.txt").read_text().strip() == f"{root}/sft/global_step_2"
    assert (warmed / "config.json").is_file() and (warmed / "tokenizer.json").is_file()
    after, before = load_file(warmed / "model.safetensors"), load_file(untrained / "model.safetensors")
    assert sorted(after) == sorted(before)
    changed = [k for k in before if not torch.equal(after[k].float(), before[k].float())]
    assert len(changed) > len(before) // 2, changed
    for kind in make_data.DEFAULT_KINDS:
        path = root / "eval" / "seed1" / f"{kind}_1" / "warmed-memory.jsonl"
        got = [json.loads(line) for line in path.read_text().splitlines()]
        assert sorted(r["_id"] for r in got) == [0, 1] and {r["status"] for r in got} == {"ok"}, path
        assert {r["method"] for r in got} == {"recurrent-boxed"}
    assert not (root / "eval" / "seed2").exists() and not (root / "eval" / "seed1" / "niah_single_4").exists()
    assert (root / "meta" / "done" / "eval_warmed").is_file()
    assert json.loads((root / "meta" / "eval_warmed_runs.jsonl").read_text())["model"] == str(warmed)


def test_evaluate_checks_the_model_folder_and_every_data_file_before_starting_anything(tmp_path, monkeypatch):
    from recipe.miniature import evaluate

    monkeypatch.setattr(evaluate, "main_batched", lambda args: pytest.fail("started without its files"))
    monkeypatch.setattr(evaluate, "VLLMServerGroup", lambda *a, **k: pytest.fail("started without its files"))
    model = tmp_path / "model"
    base = [
        "--root",
        str(tmp_path / "run"),
        "--system",
        "rl",
        "--seeds",
        "1",
        "--kinds",
        "hotpotqa",
        "--lengths",
        "2,4",
    ]
    with pytest.raises(SystemExit, match=f"--model {tmp_path / 'nope'}: not a local model folder"):
        evaluate.main([*base, "--model", str(tmp_path / "nope")])
    model.mkdir()
    with pytest.raises(SystemExit, match="seed1 is missing: run python -m recipe.miniature.make_data"):
        evaluate.main([*base, "--model", str(model), "--runner", "batched"])
    data = tmp_path / "run" / "data" / "eval" / "seed1"
    data.mkdir(parents=True)
    (data / "eval_2.json").write_text("[]")
    with pytest.raises(SystemExit, match="no data file for task 'hotpotqa' length 4; tried .*eval_4.json"):
        evaluate.main([*base, "--model", str(model)])

"""``benchmarks/gpu_suite.sh``: every command it would run names a benchmark that exists, passes flags and choices that
benchmark's parser accepts, and Hydra overrides that the trainer's config has and that act in the step benchmark's run
(no INERT key, no SM split the engine cannot use; checked with ``DRY_RUN=1``: nothing runs, no GPU needed)."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
from pathlib import Path

import pytest

from tests.test_config import compose_config

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


class _Parsed(Exception):
    """Raised by the patched parser once the arguments parsed (the benchmark's main stops there)."""

    def __init__(self, result):
        self.result = result


def suite_commands(tmp_path: Path) -> dict[str, list[str]]:
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "VERL_WHEEL": str(tmp_path / "verl.whl")}
    out = subprocess.run(["bash", str(SUITE)], env=env, capture_output=True, text=True, check=True).stdout
    commands = {}
    for line in out.splitlines():
        name, _, command = line.partition(": ")
        if command:
            commands[name] = command.split()
    return commands


def parse_with(script: str, argv: list[str], monkeypatch):
    """Run ``benchmarks/<script>``'s ``main(argv)`` up to its argument parsing; return what the parser returned."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = importlib.import_module(Path(script).stem)
    real_parse_known = argparse.ArgumentParser.parse_known_args

    def parse_args(self, args=None, namespace=None):  # argparse's own rule: no argument left over
        parsed, extra = real_parse_known(self, args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        raise _Parsed(parsed)

    def parse_known_args(self, args=None, namespace=None):
        raise _Parsed(real_parse_known(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    with pytest.raises(_Parsed) as parsed:
        module.main(argv)
    return parsed.value.result


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    return suite_commands(tmp_path_factory.mktemp("suite"))


def test_every_section_has_commands(commands):
    assert {"update_flex", "update_varlen", "update_compile", "update_liger", "update_ckpt_every2", "train_step_1p5b", "train_step_7b",
            "train_step_135m_packed", "train_step_135m_sdpa", "weight_sync_1p5b", "weight_sync_7b", "vs_verl",
            "gpu_tests"} <= set(commands)  # fmt: skip


def test_only_picks_sections(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "ONLY": "weight_sync"}
    out = subprocess.run(["bash", str(SUITE)], env=env, capture_output=True, text=True, check=True).stdout
    assert [line.split(":")[0] for line in out.splitlines()] == ["weight_sync_1p5b", "weight_sync_7b", "tables"]


def test_tables_of_the_output_folder_come_last(commands, tmp_path):
    """The suite ends with the comparison tables of whatever reports its output folder holds."""
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "ONLY": "update_attn"}
    out = subprocess.run(["bash", str(SUITE)], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == f"tables: python3 benchmarks/suite_tables.py {tmp_path}"
    assert list(commands)[-1] == "tables"


def test_benchmark_flags_parse(commands, monkeypatch):
    checked = 0
    for name, command in commands.items():
        scripts = [i for i, word in enumerate(command) if word.startswith("benchmarks/bench_")]
        if not scripts:
            continue
        script = command[scripts[0]]
        assert (ROOT / script).is_file(), f"{name}: {script} does not exist"
        argv = command[scripts[0] + 1 :]
        with monkeypatch.context() as patch:
            result = parse_with(script, argv, patch)
        if isinstance(result, tuple):  # parse_known_args: (namespace, the Hydra overrides)
            parsed, extra = result
            overrides = [word for word in extra if word != "--"]
            assert all("=" in word and not word.startswith("-") for word in overrides), f"{name}: {overrides}"
            cfg = compose_config(overrides)  # every key exists in the trainer's config
            if script.endswith("bench_train_step.py"):
                assert settings_without_effect(parsed, cfg) == [], name
        checked += 1
    assert checked >= 11


def settings_without_effect(parsed: argparse.Namespace, cfg) -> list[str]:
    """What a ``bench_train_step.py`` entry sets that cannot act in its (last) run: INERT keys set away from their
    default, and SMs kept for an engine that does not share the training process's SMs
    (``verl/workers/config/rollout.py::engine_sms_not_applicable``). The suite's runs are vLLM on a GPU."""
    from verl.trainer.config_keys import find_inert_keys, format_inert_table
    from verl.workers.config.rollout import engine_sms_not_applicable

    found = format_inert_table(find_inert_keys(cfg))
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.engine_reserved_sms > 0 or rollout.balance_reserved_sms:
        why_not = engine_sms_not_applicable(parsed.overlap != "off", parsed.rollout == "vllm", rollout.engine_process)
        found += [f"rollout.engine_reserved_sms / balance_reserved_sms: {why_not}"] if why_not else []
    return found


def test_settings_without_effect_are_found(monkeypatch):
    """The check above can fail: the SM split with the engine in a child process (an entry of the nineteenth run's
    suite, inert in the twentieth run), and an INERT key."""
    sms = ["actor_rollout_ref.rollout.engine_reserved_sms=16", "actor_rollout_ref.rollout.balance_reserved_sms=True"]
    argv = ["--device", "cuda", "--rollout", "vllm", "--overlap", "on", "--", *sms]
    parsed, _ = parse_with("benchmarks/bench_train_step.py", argv, monkeypatch)
    assert settings_without_effect(parsed, compose_config(sms)) == []  # in the worker's process: it acts
    child = compose_config([*sms, "actor_rollout_ref.rollout.engine_process=child"])
    assert settings_without_effect(parsed, child) == [
        "rollout.engine_reserved_sms / balance_reserved_sms: rollout.engine_process=child (the engine's process does "
        "not share the training SMs)"
    ]
    [row] = settings_without_effect(parsed, compose_config(["actor_rollout_ref.hybrid_engine=False"]))
    assert row.startswith("actor_rollout_ref.hybrid_engine = False (default True)")


def test_a_wrong_flag_is_caught(monkeypatch):
    """The check above can fail: an unknown flag or choice stops the parser."""
    with pytest.raises(SystemExit):
        parse_with("benchmarks/bench_update_policy.py", ["--attn", "flex_attention", "--no-such-flag"], monkeypatch)
    with pytest.raises(SystemExit):
        parse_with("benchmarks/bench_weight_sync.py", ["--shape", "qwen9"], monkeypatch)

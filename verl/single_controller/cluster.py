"""Connecting the driver to Ray: a local cluster for tests and single machines, or an existing one.

``init_ray(address=None)`` resolves the address like ``ray.init`` (argument, then ``RAY_ADDRESS``,
then a cluster started with ``ray start`` on this machine, else a new local instance). ``num_cpus``
only applies when a new local instance is started: Ray refuses it when joining a running cluster,
so it is dropped (with a log line) in that case. See ``docs/cluster.md`` for multi-node setups.

A new local instance's processes (GCS, raylet, and through it every Ray worker) are started in a process group of
their own (``verl/utils/process_groups.py``): a signal sent to the launching command's process group
(``timeout``, ``kill -TERM -- -PGID``, Ctrl-C in a shell script) then reaches the driver only, which finishes its
step, checkpoints and shuts the cluster down itself (``verl/trainer/ppo/signals.py``) instead of finding its workers
already killed by the same signal.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from verl.utils.process_groups import children_in_their_own_group

__all__ = ["init_ray", "describe_cluster"]

logger = logging.getLogger(__name__)


def init_ray(
    address: str | None = None, num_cpus: int | None = None, runtime_env: dict | None = None, **kwargs: Any
) -> None:
    """Start or join Ray once (no-op when already initialised).

    Args:
        address: ``None`` (auto-detect, else start locally), ``"auto"`` (must join an existing
            cluster), ``"local"`` (always start a new one) or ``"HOST:6379"``.
        num_cpus: CPUs of a *new* local instance (ignored when joining a cluster).
        runtime_env: Ray runtime environment (``env_vars``, ``working_dir``, ...).
        **kwargs: passed to ``ray.init`` (e.g. ``include_dashboard``, ``namespace``).
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    joining = address not in (None, "local")
    if joining and num_cpus is not None:
        logger.info("init_ray: joining the cluster at %s, so num_cpus=%s is ignored", address, num_cpus)
        num_cpus = None
    if joining:
        ray.init(address=address, num_cpus=num_cpus, runtime_env=runtime_env, **kwargs)
    else:  # ray.init may start a local instance: its processes go into a group of their own
        with children_in_their_own_group():
            ray.init(address=address, num_cpus=num_cpus, runtime_env=runtime_env, **kwargs)
    logger.info("Ray cluster: %s", describe_cluster())


def describe_cluster() -> list[dict[str, Any]]:
    """One entry per alive node: IP, CPUs, GPUs (totals)."""
    import ray

    return [
        {"node_ip": n["NodeManagerAddress"], "CPU": n["Resources"].get("CPU", 0), "GPU": n["Resources"].get("GPU", 0)}
        for n in ray.nodes()
        if n.get("Alive")
    ]

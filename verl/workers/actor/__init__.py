"""Actor workers' training side: log-prob recomputation and the PPO/GRPO policy update."""

from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.actor.settings import ActorSettings

__all__ = ["DataParallelPPOActor", "ActorSettings"]

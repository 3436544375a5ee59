"""A worker group of one in-process rank (a single unsharded CPU process).

It exposes the same methods as the Ray worker group (``ray_worker_group.py``), with the same
argument layout (per-rank lists for ``generate``), so the trainer is identical in both modes.
"""

from __future__ import annotations

from verl.workers.fsdp_workers import ActorRolloutRefWorker


class LocalWorkerGroup:
    world_size = 1

    def __init__(self, config, device: str = "cpu"):
        self.worker = ActorRolloutRefWorker(config, device=device)

    def init_model(self):
        self.worker.init_model()

    def generate(self, prompts_per_rank, params_per_rank, seeds_per_rank):
        return [self.worker.generate(prompts_per_rank[0], params_per_rank[0], seeds_per_rank[0])]

    def compute_log_prob(self, data):
        return self.worker.compute_log_prob(data)

    def compute_ref_log_prob(self, data):
        return self.worker.compute_ref_log_prob(data)

    def update_actor(self, data):
        return self.worker.update_actor(data)

    def wake_up_rollout(self):
        self.worker.wake_up_rollout()

    def sleep_rollout(self):
        self.worker.sleep_rollout()

    def sync_rollout_weights(self):
        return self.worker.sync_rollout_weights()

    def shift_engine_reserved_sms(self, delta):
        return [self.worker.shift_engine_reserved_sms(delta)]

    def save_checkpoint(self, path):
        self.worker.save_checkpoint(path)

    def load_checkpoint(self, path):
        self.worker.load_checkpoint(path)

    def shutdown_engines(self):
        self.worker.shutdown_engines()

    def shutdown(self):
        pass

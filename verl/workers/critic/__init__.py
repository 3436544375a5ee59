"""Critic (value model) workers: value predictions and the clipped value-function update for PPO/GAE."""

from verl.workers.critic.dp_critic import CriticSettings, DataParallelPPOCritic

__all__ = ["CriticSettings", "DataParallelPPOCritic"]

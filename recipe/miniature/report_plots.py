"""Figures of the miniature MemAgent report (:mod:`recipe.miniature.report`): accuracy vs chunks, training curve.

Both functions take the report's frames and write one PNG; they know no column or log key names of their
own (the report passes them), so this module does not import the report (no import cycle).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    from recipe.miniature.report import ReportSettings

__all__ = ["plot_accuracy", "plot_training"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(seeds: pd.DataFrame, table: pd.DataFrame, s: ReportSettings, path: Path,
                  panels: Sequence[tuple[str, str]]) -> None:  # fmt: skip
    """One panel per ``(score column, title)`` of ``panels``: accuracy vs chunks (log2 x) of every system.

    ``table`` is the report's per-(system, length) mean over seeds, ``seeds`` the per-seed means: the line
    is the mean, error bars the seed range, faint dots the seeds, hollow markers incomplete cells.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.8 * len(panels), 4.6), sharey=True, squeeze=False)
    axes = axes[0]
    plotted_lengths: set[int] = set()
    for ax, (key, title) in zip(axes, panels):
        for i, sys_ in enumerate(s.systems):
            if sys_ not in table.index.get_level_values("system"):
                continue
            rows = table.loc[sys_].sort_index()
            xs, ys = rows.index.to_numpy(), rows[key].to_numpy()
            plotted_lengths.update(int(x) for x in xs)
            per_seed = seeds.loc[sys_][key]
            lo = [ys[j] - per_seed.loc[x].min() for j, x in enumerate(xs)]
            hi = [per_seed.loc[x].max() - ys[j] for j, x in enumerate(xs)]
            color = f"C{i % 10}"
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="-o", color=color, capsize=3, label=sys_)
            ax.scatter(per_seed.index.get_level_values("length"), per_seed.to_numpy(), color=color, alpha=0.3, s=14)
            partial = rows[~rows["complete"].astype(bool)]
            if not partial.empty:
                ax.scatter(partial.index, partial[key], facecolors="white", edgecolors=color, s=40, zorder=3)
        ax.axvline(s.train_chunks, color="grey", linestyle="--", linewidth=1, label=f"train length ({s.train_chunks})")
        ax.set_xscale("log", base=2)
        ticks = sorted(plotted_lengths | {s.train_chunks}) if plotted_lengths else list(s.lengths)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_ylim(-2, 102)
        ax.set_title(title)
        ax.set_xlabel("document length (chunks)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%), mean over tasks")
    if table.empty:
        axes[0].text(0.5, 0.5, "no evaluation results", ha="center", transform=axes[0].transAxes)
    axes[0].legend(fontsize=8)
    fig.suptitle("Mean over tasks and seeds (error bars: seed range; hollow: incomplete cell)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_training(log: pd.DataFrame, path: Path, reward_key: str, val_prefix: str) -> None:
    """Train reward ``reward_key`` per step (raw and a moving average) and every ``val_prefix*`` score."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    drawn = False
    if reward_key in log:
        reward = log[reward_key].dropna()
        reward = reward[reward.index > 0]
        if not reward.empty:
            ax.plot(reward.index, reward.to_numpy(), color="C0", alpha=0.35 if len(reward) > 20 else 1.0,
                    label=f"train {reward_key}")  # fmt: skip
            if len(reward) > 20:
                window = max(5, len(reward) // 20)
                ax.plot(reward.index, reward.rolling(window, min_periods=1).mean().to_numpy(), color="C0",
                        label=f"train reward, moving mean ({window} steps)")  # fmt: skip
            drawn = True
    for i, key in enumerate(k for k in log.columns if str(k).startswith(val_prefix)):
        val = log[key].dropna()
        if not val.empty:
            ax.plot(val.index, val.to_numpy(), "-s", color=f"C{(i + 1) % 10}", label=str(key))
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no training log", ha="center", transform=ax.transAxes)
    ax.set_xlabel("training step")
    ax.set_ylabel("reward (0–1)")
    ax.set_title("Training reward and validation score")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

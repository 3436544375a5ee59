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
    from recipe.miniature.report_data import ReportSettings

__all__ = ["plot_accuracy", "plot_training"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(models: pd.DataFrame, table: pd.DataFrame, s: ReportSettings, path: Path,
                  panels: Sequence[tuple[str, str]], chance: float | None = None) -> None:  # fmt: skip
    """One panel per ``(score column, title)`` of ``panels``: accuracy vs chunks (log2 x) of every system.

    ``table`` is the report's per-(system, length) mean over the counted models, ``models`` the per-model means:
    the line is the mean, error bars the range over the models, faint dots the models, hollow markers incomplete
    cells; ``chance`` (%, the mean chance floor over the tasks) is a dotted line.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.8 * len(panels), 4.6), sharey=True, squeeze=False)
    axes = axes[0]
    plotted_lengths: set[int] = set()
    counted = models[models["counted"].astype(bool)] if not models.empty else models
    for ax, (key, title) in zip(axes, panels):
        for i, sys_ in enumerate(s.systems):
            if sys_ not in table.index.get_level_values("system"):
                continue
            rows = table.loc[sys_].sort_index()
            xs, ys = rows.index.to_numpy(), rows[key].to_numpy()
            plotted_lengths.update(int(x) for x in xs)
            color = f"C{i % 10}"
            lo, hi = ys - rows[f"min_{key}"].to_numpy(), rows[f"max_{key}"].to_numpy() - ys
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="-o", color=color, capsize=3, label=sys_)
            mine = counted[counted["system"] == sys_]
            if mine["model"].nunique() > 1:
                ax.scatter(mine["length"], mine[key], color=color, alpha=0.3, s=14)
            partial = rows[~rows["complete"].astype(bool)]
            if not partial.empty:
                ax.scatter(partial.index, partial[key], facecolors="white", edgecolors=color, s=40, zorder=3)
        if chance is not None:
            ax.axhline(chance, color="black", linestyle=":", linewidth=1, label=f"chance floor ({chance:.1f}%)")
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
    fig.suptitle("Mean over tasks, seeds and trained models (error bars and dots: the models; hollow: incomplete)",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_training(logs: dict[str, pd.DataFrame], path: Path, reward_key: str, val_prefix: str) -> None:
    """Per trained model (``{name: metrics frame indexed by step}``): train reward ``reward_key`` (thin) and every
    ``val_prefix*`` score (squares), one colour per model."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    drawn = False
    for i, (name, log) in enumerate(logs.items()):
        color = f"C{i % 10}"
        log = log.apply(pd.to_numeric, errors="coerce")
        if reward_key in log:
            reward = log[reward_key].dropna()
            reward = reward[reward.index > 0]
            if not reward.empty:
                ax.plot(reward.index, reward.to_numpy(), color=color, alpha=0.5, label=f"{name}: train reward")
                drawn = True
        for key in (k for k in log.columns if str(k).startswith(val_prefix)):
            val = log[key].dropna()
            if not val.empty:
                ax.plot(val.index, val.to_numpy(), "-s", color=color, label=f"{name}: {key}")
                drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no training log", ha="center", transform=ax.transAxes)
    ax.set_xlabel("training step")
    ax.set_ylabel("reward (0–1)")
    ax.set_title(f"Training reward ({reward_key}) and validation score, per trained model")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""PNG plots of simulated runs and reproduced figures (matplotlib, Agg backend: no display)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvcake.sim.records import RequestState, tbt_values  # noqa: E402


def plot_run(states: Sequence[RequestState], path: Path, title: str) -> None:
    """CDFs of TTFT and of TBT (mean of each request's slowest 10% of gaps) of one run."""
    ttfts = sorted(s.ttft_s for s in states if s.finish_s is not None and s.ttft_s is not None)
    tbts = sorted(t * 1000.0 for t in tbt_values(states))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, values, label in ((axes[0], ttfts, "TTFT (s)"), (axes[1], tbts, "TBT (ms)")):
        if values:
            ax.plot(values, np.arange(1, len(values) + 1) / len(values))
        ax.set_xlabel(label)
        ax.set_ylabel("share of completed requests")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(path: Path, title: str, groups: Sequence[str], series: Mapping[str, Sequence[float]],
              ylabel: str) -> None:
    """Grouped bars: one group per label in `groups`, one bar per series (None-free values)."""
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for i, (name, values) in enumerate(series.items()):
        bars = ax.bar(x + i * width, values, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(x + width * (len(series) - 1) / 2, groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lines(path: Path, title: str, panels: Sequence[tuple[str, str, Mapping[str, tuple[
        Sequence[float], Sequence[float]]]]], logx: bool = False,
               marker: str | None = "o") -> None:
    """Side-by-side line panels: each is (xlabel, ylabel, {series: (xs, ys)}); `marker` None
    for long time series."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (xlabel, ylabel, series) in zip(axes[0], panels, strict=True):
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker=marker, label=name)
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

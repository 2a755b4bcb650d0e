"""TTFT and TBT CDF plots of a run (PNG, matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from kvcake.bench.stats import Outcome, RequestResult, paper_tbt_s  # noqa: E402


def _cdf(ax: plt.Axes, values_ms: Sequence[float], slo_ms: float, xlabel: str) -> None:
    if values_ms:
        xs = np.sort(np.asarray(values_ms))
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
    ax.axvline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share of completed requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


def plot_cdfs(results: Sequence[RequestResult], out_dir: Path, ttft_slo_s: float,
              tbt_slo_s: float, title: str = "") -> list[Path]:
    """Writes ttft_cdf.png and tbt_cdf.png into `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    done = [r for r in results if r.outcome is Outcome.OK]
    series = {
        "ttft": ([r.ttft_s * 1000 for r in done if r.ttft_s is not None], ttft_slo_s * 1000,
                 "TTFT (ms)"),
        "tbt": ([paper_tbt_s(r.gaps_s) * 1000 for r in done], tbt_slo_s * 1000,
                "TBT: mean of the slowest 10% of token gaps (ms)"),
    }
    paths = []
    for name, (values, slo_ms, xlabel) in series.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        _cdf(ax, values, slo_ms, xlabel)
        ax.set_title(f"{name.upper()} CDF {title}".strip())
        path = out_dir / f"{name}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths

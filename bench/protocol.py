"""The evaluation protocol of every bench claim (issue 14), in one place.

- One policy: >= 50 deterministic evaluation episodes (100 where cheap) on reset seeds disjoint
  from training, summarised by ``rlfunc.core.stats.summarize_returns`` (mean, std, episodes, 95% CI).
- Across seeds (>= 5): median and interquartile mean (IQM) with stratified-bootstrap 95% CIs
  (Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice"), from rliable.
- Time to a threshold: "first touch" (the first evaluation >= threshold) and "reach and stay" (the
  first evaluation >= threshold after which every later one stays >= threshold;
  ``rlfunc.core.stats.reach_and_stay``). A run that never stays is reported as such.
- Learning curves: mean and 95% CI band over seeds (Student t over the seeds at each evaluation),
  against env steps and against training wall-clock, written as PNG under bench/figures/.

A curve is a list of (env steps, training seconds, mean evaluation return) triples, one per evaluation.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np

from rlfunc.core.stats import first_touch, mean_interval, reach_and_stay

BOOTSTRAP_REPS = 20_000


def aggregate(scores: list[float], reps: int = BOOTSTRAP_REPS, seed: int = 0) -> dict:
    """Median and IQM of per-seed scores with rliable's stratified-bootstrap 95% CIs (the median
    over seeds, not rliable's aggregate_median, which for one task is the mean over seeds).

    Args:
        scores: one number per seed (e.g. a final policy's mean return over its evaluation episodes).

    Returns:
        {"seeds", "median", "median_ci95", "iqm", "iqm_ci95", "mean"}.
    """
    from rliable import library as rly
    from rliable import metrics

    x = np.asarray(scores, dtype=np.float64).reshape(-1, 1)  # [runs, tasks=1]
    # the median over seeds (rliable's aggregate_median is the median over tasks of the mean over
    # runs: with one task, the mean); the IQM over all runs is rliable's own
    point, ci = rly.get_interval_estimates(
        {"a": x}, lambda s: np.array([np.median(s), metrics.aggregate_iqm(s)]), reps=reps,
        random_state=np.random.RandomState(seed),
    )
    return {
        "seeds": len(scores),
        "median": float(point["a"][0]), "median_ci95": [float(ci["a"][0, 0]), float(ci["a"][1, 0])],
        "iqm": float(point["a"][1]), "iqm_ci95": [float(ci["a"][0, 1]), float(ci["a"][1, 1])],
        "mean": float(np.mean(x)),
    }


def thresholds(curve: list[tuple[int, float, float]], threshold: float) -> dict:
    """First touch and reach-and-stay of one curve, in env steps and training seconds (None: never)."""
    returns = [c[2] for c in curve]
    out = {}
    for name, index in (("first_touch", first_touch(returns, threshold)), ("reach_and_stay", reach_and_stay(returns, threshold))):
        out[name] = None if index is None else {"steps": curve[index][0], "seconds": curve[index][1]}
    return out


def fmt_aggregate(agg: dict, digits: int = 1) -> str:
    m, (ml, mh), q, (ql, qh) = agg["median"], agg["median_ci95"], agg["iqm"], agg["iqm_ci95"]
    return (f"median {m:.{digits}f} [{ml:.{digits}f}, {mh:.{digits}f}], IQM {q:.{digits}f} [{ql:.{digits}f}, {qh:.{digits}f}] "
            f"(95% stratified-bootstrap CIs, {agg['seeds']} seeds)")


def median_or_none(values: list[float | None]) -> float | None:
    """Median of the values, where None (never reached) counts as +inf; None if the median is inf."""
    finite = [math.inf if v is None else v for v in values]
    med = statistics.median(finite) if finite else math.inf
    return None if math.isinf(med) else med


def plot_curves(sides: dict[str, list[list[tuple[int, float, float]]]], path: Path, title: str,
                threshold: float | None = None) -> None:
    """Two panels (return vs env steps, return vs training wall-clock): per side, the mean over seeds
    and its 95% CI band (Student t over seeds), at each evaluation index; the wall-clock x of an
    index is the mean over seeds of the training seconds at that evaluation.

    Args:
        sides: {label: [curve of seed 0, curve of seed 1, ...]}; a side's curves are cut to the
            shortest one.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    for label, curves in sides.items():
        curves = [c for c in curves if c]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        steps = np.array([curves[0][i][0] for i in range(n)])
        secs = np.array([np.mean([c[i][1] for c in curves]) for i in range(n)])
        values = np.array([[c[i][2] for c in curves] for i in range(n)])  # [n, seeds]
        mean = values.mean(1)
        band = [mean_interval(values[i].tolist()) if values.shape[1] > 1 else (mean[i], mean[i]) for i in range(n)]
        low, high = np.array([b[0] for b in band]), np.array([b[1] for b in band])
        for ax, x in zip(axes, (steps, secs)):
            (line,) = ax.plot(x, mean, label=f"{label} ({values.shape[1]} seeds)")
            ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    for ax, xlabel in zip(axes, ("env steps", "training wall-clock (s)")):
        if threshold is not None:
            ax.axhline(threshold, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("evaluation return")
        ax.grid(alpha=0.3)
    axes[0].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:g}k"))
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)

"""The evaluation protocol's statistics: what one policy's evaluation episodes say, and when a
learning curve reached a threshold for good.

- :func:`summarize_returns`: mean, std, number of episodes and the Student-t 95% confidence
  interval of the mean over one policy's episodes (what ``rlfunc eval`` and every run's final
  evaluation report).
- :func:`success_interval`: the Wilson interval of a success rate.
- :func:`first_touch` / :func:`reach_and_stay`: the first evaluation at or above a threshold, and
  the first one after which the curve never falls below it again.

Claims across seeds (median and IQM with stratified-bootstrap CIs, Agarwal et al. 2021) belong to
bench/ and use rliable there. The quantiles come from scipy (``scipy.stats``), imported when needed.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from rlfunc.errors import ConfigError, ShapeError


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence={confidence}: expected a value in (0, 1)")


def mean_interval(values: Tensor | Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Student-t confidence interval of the mean, mean -+ t_{(1+c)/2, n-1} * s / sqrt(n).

    Args:
        values: [n] float, one number per episode (e.g. its return, in the env's reward units).
        confidence: coverage of the interval, in (0, 1).

    Returns:
        (low, high) floats; (mean, mean) when every value is equal, (nan, nan) when n == 1 (one
        episode says nothing about the spread).

    Raises:
        ShapeError: ``values`` is not one-dimensional or is empty, or holds a NaN / inf.
        ConfigError: ``confidence`` outside (0, 1).

    Reference: Student (1908); the interval of e.g. Wasserman (2004), "All of Statistics", sec. 6.3.2.
    """
    _check_confidence(confidence)
    x = _as_vector(values, "values")
    n = x.numel()
    mean = float(x.mean())
    if n == 1:
        return float("nan"), float("nan")
    if bool((x == x[0]).all()):  # no spread: the point itself, as documented (not the rounding of a mean and std)
        return float(x[0]), float(x[0])
    from scipy.stats import t

    half = float(t.ppf(0.5 + confidence / 2, n - 1)) * float(x.std(correction=1)) / math.sqrt(n)
    return mean - half, mean + half


def summarize_returns(values: Tensor | Sequence[float], confidence: float = 0.95, *, nonfinite: str = "raise") -> dict:
    """What one policy's evaluation episodes say: ``{"mean", "std", "episodes", "ci95"}``.

    Args:
        values: [n] float, one return per episode (env reward units).
        confidence: coverage of "ci95" (keep 0.95 so the key means what it says).
        nonfinite: "raise" (a NaN or inf return is a ShapeError), or "count": the statistics are over
            the finite returns, "nonfinite_episodes" counts the others (when there are any) and a
            warning says so; with no finite return, "mean", "std" and "ci95" are None. What a run's
            final evaluation uses: an env that gave a NaN reward in one episode failed the whole
            evaluation, after the training, with a traceback and no eval.json.

    Returns:
        "mean" and "std" (population std, ``correction=0``) over the episodes, "episodes" (n) and
        "ci95" = [low, high], the Student-t interval of the mean (:func:`mean_interval`), or None
        for a single episode (so the dict stays valid JSON: no NaN).

    Raises:
        ShapeError: empty or not one-dimensional ``values``; non-finite ones with ``nonfinite="raise"``.
        ConfigError: ``nonfinite`` is neither "raise" nor "count".
    """
    if nonfinite not in ("raise", "count"):
        raise ConfigError(f"nonfinite={nonfinite!r}: expected 'raise' or 'count'")
    if nonfinite == "count":
        x, bad = finite_returns(values)
        if bad:
            warnings.warn(f"{bad} of {x.numel() + bad} evaluation episodes have a NaN or inf return (the env's rewards): "
                          f"the statistics are over the other {x.numel()} (counted as nonfinite_episodes)", stacklevel=2)
        if x.numel() == 0:
            return {"mean": None, "std": None, "episodes": 0, "ci95": None, "nonfinite_episodes": bad}
        return {**summarize_returns(x, confidence), **({"nonfinite_episodes": bad} if bad else {})}
    x = _as_vector(values, "values")
    ci = list(mean_interval(x, confidence)) if x.numel() > 1 else None
    return {"mean": float(x.mean()), "std": float(x.std(correction=0)), "episodes": x.numel(), "ci95": ci}


def seeds_summary(returns: Tensor, num_seeds: int) -> dict:
    """What an evaluation of ``num_seeds`` = S seeds says, from their episodes' returns [S * E] (seed-major,
    E episodes per seed, env reward units): :func:`summarize_returns` of all S * E (``nonfinite="count"``),
    "episodes" E (per seed), "per_seed_mean" [S] (None for a seed without a finite return) and, with
    S > 1, "per_seed_ci95" (Student-t, None below 2 finite returns) and "pooled_episodes" S * E, what
    "mean", "std" and "ci95" pool (a CI of episodes, not of seeds).

    Raises:
        ShapeError: ``returns`` is not 1-D of a multiple of ``num_seeds`` elements."""
    if returns.dim() != 1 or returns.numel() == 0 or returns.numel() % num_seeds:
        raise ShapeError(f"returns: shape {tuple(returns.shape)}, expected [num_seeds * episodes] with num_seeds={num_seeds}")
    episodes = returns.numel() // num_seeds
    per_seed = [finite_returns(r)[0] for r in returns.view(num_seeds, episodes)]  # a NaN-return episode left out
    out = {**summarize_returns(returns, nonfinite="count"), "episodes": episodes,
           "per_seed_mean": [float(r.mean()) if r.numel() else None for r in per_seed]}
    if num_seeds > 1:
        out["per_seed_ci95"] = [list(mean_interval(r)) if r.numel() > 1 else None for r in per_seed]
        out["pooled_episodes"] = num_seeds * episodes
    return out


def finite_returns(values: Tensor | Sequence[float]) -> tuple[Tensor, int]:
    """(the finite values of ``values`` [n] as a double-precision CPU vector, how many were NaN or inf)."""
    x = _host_double(values)
    if x.dim() != 1 or x.numel() == 0:
        raise ShapeError(f"values: expected a non-empty 1-D sequence of numbers, got shape {tuple(x.shape)}")
    ok = torch.isfinite(x)
    return x[ok], int((~ok).sum())


def success_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a success rate ``successes / trials`` (scipy's ``binomtest``).

    Raises:
        ConfigError: ``successes`` or ``trials`` not an integer, ``trials < 1`` or ``successes`` outside
            [0, trials], or ``confidence`` outside (0, 1).

    Reference: Wilson (1927), "Probable inference, the law of succession, and statistical inference".
    """
    _check_confidence(confidence)
    for name, v in (("successes", successes), ("trials", trials)):  # the bug: 2.5 successes were truncated to 2
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ConfigError(f"{name}={v!r}: expected an integer count")
    if trials < 1 or not 0 <= successes <= trials:
        raise ConfigError(f"successes={successes}, trials={trials}: expected trials >= 1 and 0 <= successes <= trials")
    from scipy.stats import binomtest

    ci = binomtest(int(successes), int(trials)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def success_summary(success: torch.Tensor | None) -> dict:
    """{"success_rate", "success_ci95" (Wilson, :func:`success_interval`)} of per-episode success flags
    ``success`` [N] bool (N >= 1); {} for None (an env that reports no success)."""
    if success is None:
        return {}
    return {"success_rate": float(success.float().mean()),
            "success_ci95": list(success_interval(int(success.sum()), success.numel()))}


def first_touch(curve: Sequence[float], threshold: float) -> int | None:
    """Index of the first evaluation with return >= ``threshold``; None if there is none.

    Args:
        curve: evaluation returns of one run, in the order they were measured.
    """
    for i, value in enumerate(curve):
        if value >= threshold:
            return i
    return None


def reach_and_stay(curve: Sequence[float], threshold: float) -> int | None:
    """Index of the first evaluation with return >= ``threshold`` such that every later evaluation
    of the run is >= ``threshold`` as well; None if the run does not end at or above it.

    A run that touches the threshold, falls below and comes back has reached it at its last
    return above it; one whose final evaluation is below the threshold has not reached it.
    """
    reached = None
    for i, value in enumerate(curve):
        if value >= threshold:
            reached = i if reached is None else reached
        else:
            reached = None
    return reached


def _host_double(values: Tensor | Sequence[float]) -> Tensor:
    """``values`` on the host in double precision: the statistics of a report, not of training (in float32 the mean of
    50 returns near 1e7 lost its decimals, and 1000 copies of 1.7 had an interval without 1.7 in it)."""
    if isinstance(values, Tensor):
        return values.detach().to("cpu", torch.float64)  # ok-float64
    return torch.tensor(list(values), dtype=torch.float64)  # ok-float64


def _as_vector(values: Tensor | Sequence[float], name: str) -> Tensor:
    x = _host_double(values)
    if x.dim() != 1 or x.numel() == 0:
        raise ShapeError(f"{name}: expected a non-empty 1-D sequence of numbers, got shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ShapeError(f"{name}: holds a NaN or inf ({int((~torch.isfinite(x)).sum())} of {x.numel()} values)")
    return x

"""Running mean and variance as TensorDict state, merged with the parallel (Chan et al.) formulas.

The statistics of a stream of samples x of shape [*shape] are a TensorDict with batch_size []:

    "mean"   [*shape]  float   sample mean
    "var"    [*shape]  float   population variance M2 / count (1 before any sample)
    "count"  []        float32 number of samples merged so far (exact up to 2^24, see below)

Every function is pure (returns a new TensorDict, never mutates its inputs) and free of
value-dependent Python control flow, so a stack of statistics (batch_size [S], one per seed or
device) is handled with ``torch.func.vmap`` (or ``rlfunc.core.func.vmap``) over the leading dim.

"count" is float32 (saved snapshots hold it so), which counts exactly up to 2^24 = 16777216
samples. Past it, count + n_b is rounded to the nearest float32 (ties to even), whose spacing is 2
in [2^24, 2^25), 4 in [2^25, 2^26), ...: a batch of fewer than half that spacing leaves the count
unchanged, one of exactly half rounds to even (one sample at count 2^24: unchanged), a larger one
advances it by n_b rounded to a multiple of the spacing. mean and var are still merged with the
weight n_b / (count + n_b) of the stored count; where that count stays frozen (small batches), each
update moves them by that fixed weight: an exponential moving average with a time constant of about
count / n_b updates (2^24 samples), no longer the exact moments of every sample seen.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as tdist
from tensordict import TensorDict
from torch import Tensor

from rlfunc.errors import ConfigError, ShapeError

__all__ = [
    "all_reduce_running_stats",
    "denormalize",
    "init_running_stats",
    "merge_running_stats",
    "normalize",
    "scale_reward",
    "update_running_stats",
]

_KEYS = ("mean", "var", "count")


def _check_stats(stats: TensorDict, name: str) -> torch.Size:
    """The sample shape of ``stats``; ShapeError naming ``name`` when it is not running stats."""
    if not isinstance(stats, TensorDict):
        raise ShapeError(f"{name}: expected a TensorDict from init_running_stats, got {type(stats).__name__}")
    missing = [k for k in _KEYS if k not in stats.keys()]
    if missing:
        raise ShapeError(f"{name}: missing keys {missing}; expected keys {list(_KEYS)}")
    mean, var, count = stats["mean"], stats["var"], stats["count"]
    if mean.shape != var.shape:
        raise ShapeError(f"{name}: 'mean' shape {tuple(mean.shape)} != 'var' shape {tuple(var.shape)}")
    if count.ndim != 0:
        raise ShapeError(
            f"{name}: 'count' has shape {tuple(count.shape)}, expected []"
            " (stacked statistics are handled with torch.func.vmap over the stack dim)"
        )
    return mean.shape


def _check_sample(x: Tensor, shape: torch.Size, name: str) -> torch.Size:
    """The batch shape of ``x`` = [*batch, *shape]; ShapeError naming ``name`` otherwise."""
    if not isinstance(x, Tensor):
        raise ShapeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    k = len(shape)
    if x.ndim < k or tuple(x.shape[x.ndim - k :]) != tuple(shape):
        raise ShapeError(f"{name}: shape {tuple(x.shape)} does not end with the statistics' shape {tuple(shape)}")
    return x.shape[: x.ndim - k]


def _check_device(x: Tensor, stats: TensorDict, name: str) -> None:
    """ShapeError naming ``name`` when ``x`` is on another device than the statistics."""
    if x.device != stats["mean"].device:
        raise ShapeError(f"{name}: on device {x.device}, but stats are on {stats['mean'].device}")


def _check_eps(eps: float) -> None:
    if isinstance(eps, torch.Tensor):  # a tensor as before (its value not read: a host sync)
        return
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0.0:  # a str or None was a TypeError
        raise ConfigError(f"eps={eps!r}: expected a number >= 0")


def init_running_stats(
    shape: int | Sequence[int] | torch.Size,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> TensorDict:
    """Empty running statistics: mean = 0, var = 1, count = 0.

    With count 0 the first update replaces mean and var exactly by the batch's moments (no
    epsilon-count prior); var = 1 only makes ``normalize`` the identity before any data.

    Args:
        shape: shape of one sample, e.g. (obs_dim,) for observations or () for scalar returns; an
            int n is the shape (n,), as in ``torch.zeros``.
        device: where the statistics live (keep them on the training device).
        dtype: floating dtype of "mean" and "var"; "count" is always float32.

    Returns:
        TensorDict, batch_size [], keys "mean" [*shape], "var" [*shape] ``dtype``, "count" [] float32.

    Raises:
        ConfigError: ``shape`` is not an int or a sequence of ints, has a negative entry, or
            ``dtype`` is not floating.
    """
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    entries = tuple(shape) if isinstance(shape, Iterable) and not isinstance(shape, (str, bytes)) else None
    if entries is None or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in entries):
        raise ConfigError(f"shape={shape!r}: expected an int or a sequence of ints, the shape of one sample")
    shape = tuple(int(s) for s in entries)
    if not dtype.is_floating_point:
        raise ConfigError(f"dtype={dtype}: expected a floating dtype")
    if any(s < 0 for s in shape):
        raise ConfigError(f"shape={shape}: entries must be >= 0")
    return TensorDict(
        {
            "mean": torch.zeros(shape, device=device, dtype=dtype),
            "var": torch.ones(shape, device=device, dtype=dtype),
            "count": torch.zeros((), device=device, dtype=torch.float32),
        },
        batch_size=[],
        device=device,
    )


def _merge(mean_a: Tensor, var_a: Tensor, n_a: Tensor, mean_b: Tensor, var_b: Tensor, n_b: Tensor):
    """Chan et al. merge of (mean, population var, count) pairs; empty sides are passed through exactly."""
    n = n_a + n_b
    # the counts' ratio in the statistics' own dtype (with double-precision stats the weight was single-precision,
    # and so were their means and variances); single-precision stats: the same division as before, bit for bit
    dtype = mean_a.dtype
    w_b = n_b.to(dtype) / torch.where(n > 0, n, torch.ones_like(n)).to(dtype)
    w_a = 1 - w_b
    delta = mean_b - mean_a
    mean = mean_a + w_b * delta
    var = w_a * var_a + w_b * var_b + (w_a * w_b) * delta.square()
    mean = torch.where(n_b == 0, mean_a, torch.where(n_a == 0, mean_b, mean))
    var = torch.where(n_b == 0, var_a, torch.where(n_a == 0, var_b, var))
    return mean, var, n


def merge_moments(mean_a: Tensor, var_a: Tensor, weight_a, mean_b: Tensor, var_b: Tensor, weight_b) -> tuple[Tensor, Tensor]:
    """The (mean, population variance) of two parts of a batch of weights (sizes, numbers) ``weight_a``
    and ``weight_b`` from theirs: :func:`merge_running_stats`'s pairwise update on bare tensors (it adds
    the squared difference of the means: no difference of large squares)."""
    mean, var, _ = _merge(mean_a, var_a, torch.tensor(float(weight_a), device=mean_a.device),
                          mean_b, var_b, torch.tensor(float(weight_b), device=mean_a.device))
    return mean, var


def merge_running_stats(a: TensorDict, b: TensorDict) -> TensorDict:
    """Statistics of the union of two disjoint sample sets (Chan, Golub & LeVeque 1979):

        n = n_a + n_b,  delta = mean_b - mean_a,
        mean = mean_a + delta * n_b / n,
        var  = (n_a var_a + n_b var_b) / n + delta^2 n_a n_b / n^2.

    Exact when either side is empty (count 0): the other side is returned unchanged. Symmetric up to
    rounding. Use it to combine statistics gathered on different seeds, workers or devices.

    Args:
        a: running statistics (see module docstring).
        b: running statistics of the same sample shape, device and dtype.

    Returns:
        New TensorDict with a's layout; a and b are not modified.

    Raises:
        ShapeError: an argument is not running statistics, or the sample shapes differ.

    Reference: Chan, Golub & LeVeque (1979), "Updating formulae and a pairwise algorithm for
    computing sample variances", eq. 2.1.
    """
    shape_a = _check_stats(a, "a")
    shape_b = _check_stats(b, "b")
    if shape_a != shape_b:
        raise ShapeError(f"b: sample shape {tuple(shape_b)} != a's sample shape {tuple(shape_a)}")
    mean, var, count = _merge(a["mean"], a["var"], a["count"], b["mean"], b["var"], b["count"])
    return TensorDict({"mean": mean, "var": var, "count": count}, batch_size=[], device=a.device)


def update_running_stats(stats: TensorDict, x: Tensor, mask: Tensor | None = None) -> TensorDict:
    """Merge a batch of samples into running statistics.

    The batch's own moments (count n_b, mean, population variance; two-pass, so no cancellation)
    are merged with ``merge_running_stats``. A row is one sample x[i] of shape [*shape]; it is
    counted only if ``mask[i]`` is True (when a mask is given) and every value in it is finite.
    Rows with NaN or +-inf, or with a value so large that the squared deviations could overflow
    the dtype (|x| > sqrt(finfo.max / (4 rows)): about 9e16 in float32 for 10^4 rows), are skipped,
    never merged: one bad observation cannot poison the statistics. If no row is counted, or the
    merge itself is not finite, the statistics come back unchanged.

    Args:
        stats: running statistics with sample shape [*shape] (see module docstring).
        x: [*batch, *shape] samples, any real dtype; cast to the statistics' dtype.
        mask: optional [*batch] bool, True for rows to include (e.g. valid steps of a padded rollout).

    Returns:
        New statistics TensorDict; ``stats`` is not modified. The float32 count stops being exact
        at 2^24 samples; past it the count (nearly) freezes and the update is an exponential
        moving average (module docstring).

    Raises:
        ShapeError: ``stats`` is not running statistics; ``x`` does not end with [*shape] or is on
            another device; ``mask`` is not bool or its shape is not x's batch shape.

    Reference: Chan, Golub & LeVeque (1979), eq. 2.1; Welford (1962) for the streaming case.
    """
    shape = _check_stats(stats, "stats")
    batch = _check_sample(x, shape, "x")
    _check_device(x, stats, "x")
    mean_a = stats["mean"]
    rows = batch.numel()
    x = x.to(mean_a.dtype).reshape(rows, *shape)
    # finite, and small enough that the squared deviations' sum cannot overflow the dtype (the bug: one 1e20
    # in float32 made the variance inf for good, and that feature normalised to 0 from then on)
    bound = math.sqrt(torch.finfo(x.dtype).max / (4 * max(rows, 1)))
    valid = (torch.isfinite(x) & (x.abs() <= bound)).reshape(rows, math.prod(shape)).all(-1)
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise ShapeError(f"mask: expected a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        if tuple(mask.shape) != tuple(batch):
            raise ShapeError(f"mask: shape {tuple(mask.shape)} != x's batch shape {tuple(batch)}")
        valid = valid & mask.to(valid.device).reshape(rows)
    keep = valid.reshape(rows, *([1] * len(shape)))
    n_b = valid.sum().to(torch.float32)
    denom = torch.where(n_b > 0, n_b, torch.ones_like(n_b)).to(mean_a.dtype)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    mean_b = torch.where(keep, x, zero).sum(0) / denom
    var_b = torch.where(keep, x - mean_b, zero).square().sum(0) / denom
    mean, var, count = _merge(mean_a, stats["var"], stats["count"], mean_b, var_b, n_b)
    # the merge itself overflowing (a huge batch mean against the running one): the statistics stay as they were
    ok = torch.isfinite(mean).all() & torch.isfinite(var).all()
    mean, var, count = torch.where(ok, mean, mean_a), torch.where(ok, var, stats["var"]), torch.where(ok, count, stats["count"])
    return TensorDict({"mean": mean, "var": var, "count": count}, batch_size=[], device=stats.device)


def normalize(stats: TensorDict, x: Tensor, *, clip: float | None = None, eps: float = 1e-8) -> Tensor:
    """y = clamp((x - mean) / sqrt(var + eps), -clip, clip).

    Args:
        stats: running statistics with sample shape [*shape].
        x: [*batch, *shape] float.
        clip: optional bound > 0 on |y| (e.g. 10.0 as in SB3 VecNormalize); None: no clipping.
        eps: >= 0, added to the variance (units of x^2) so constant features do not divide by 0.

    Returns:
        [*batch, *shape] float, dtype by torch type promotion of x and the statistics.

    Raises:
        ShapeError: ``stats`` is not running statistics, or ``x`` does not end with [*shape] or is on
            another device than the statistics.
        ConfigError: clip <= 0 or eps < 0.
    """
    shape = _check_stats(stats, "stats")
    _check_sample(x, shape, "x")
    _check_device(x, stats, "x")
    _check_eps(eps)
    if clip is not None and not isinstance(clip, torch.Tensor) and (isinstance(clip, bool) or not isinstance(clip, numbers.Real)
                                                                    or not clip > 0):
        raise ConfigError(f"clip={clip!r}: expected a number > 0 or None")
    y = (x - stats["mean"]) * torch.rsqrt(stats["var"] + eps)
    return y if clip is None else y.clamp(-clip, clip)


def denormalize(stats: TensorDict, y: Tensor, *, eps: float = 1e-8) -> Tensor:
    """x = y * sqrt(var + eps) + mean, the inverse of ``normalize`` without clipping (same ``eps``).

    Args:
        stats: running statistics with sample shape [*shape].
        y: [*batch, *shape] float, normalised values.
        eps: >= 0, must equal the ``eps`` used to normalise.

    Returns:
        [*batch, *shape] float.

    Raises:
        ShapeError: ``stats`` is not running statistics, or ``y`` does not end with [*shape] or is on
            another device than the statistics.
        ConfigError: eps < 0.
    """
    shape = _check_stats(stats, "stats")
    _check_sample(y, shape, "y")
    _check_device(y, stats, "y")
    _check_eps(eps)
    return y * torch.sqrt(stats["var"] + eps) + stats["mean"]


def scale_reward(reward: Tensor, return_stats: TensorDict, eps: float = 1e-8) -> Tensor:
    """r' = r / sqrt(Var[G] + eps): rewards scaled by the running std of the discounted return.

    ``return_stats`` are running statistics (usually sample shape []) of the discounted return
    G_t = gamma * G_{t-1} + r_t accumulated per environment and reset at episode ends, as in SB3's
    VecNormalize; maintaining G and updating the statistics is the caller's job. The mean is not
    subtracted (that would change the optimal policy's incentives to end or prolong episodes).

    Args:
        reward: [*batch, *shape] float, e.g. [*B, T, 1] rewards with statistics of shape [1] or [].
        return_stats: running statistics of the discounted return, sample shape [*shape].
        eps: >= 0, added to the variance.

    Returns:
        [*batch, *shape] float, the scaled reward.

    Raises:
        ShapeError: ``return_stats`` is not running statistics, or ``reward`` does not end with [*shape].
        ConfigError: eps < 0.

    Reference: Stable-Baselines3 ``VecNormalize`` (norm_reward=True); Engstrom et al. (2020),
    "Implementation Matters in Deep Policy Gradients", reward scaling.
    """
    shape = _check_stats(return_stats, "return_stats")
    _check_sample(reward, shape, "reward")
    _check_eps(eps)
    return reward * torch.rsqrt(return_stats["var"] + eps)


def all_reduce_running_stats(stats: TensorDict, group=None) -> TensorDict:
    """The statistics of every rank's samples together, on every rank (a data-parallel merge).

    With n_r, mean_r, M2_r = n_r var_r the statistics of rank r (Chan et al.'s merge of W sets):

        n = sum_r n_r,  mean = sum_r n_r mean_r / n,
        var = sum_r (M2_r + n_r (mean_r - mean)^2) / n,

    two ``all_reduce(SUM)`` (n and n mean in one buffer, then the M2 terms). Ranks with count 0
    contribute nothing; if every count is 0 the statistics come back unchanged. Works on stacked
    statistics too (batch_size [S], "count" [S]: one per seed), elementwise over the stack. The
    identity (a copy) when torch.distributed is not initialised or the group has one rank.

    Merge the *increments*: pass the statistics of each rank's new batch alone, then fold the result
    into the shared running statistics, which are the same on every rank::

        batch = update_running_stats(init_running_stats(shape), x)     # this rank's new samples
        shared = merge_running_stats(shared, all_reduce_running_stats(batch))

    Reducing the running statistics themselves would count the shared history W times.

    Args:
        stats: running statistics, unstacked (batch_size [], count []) or stacked ([*S], count [*S]).
        group: the process group (None: the default one).

    Returns:
        New statistics with ``stats``' layout, the same on every rank (to float rounding, the
        statistics of the union of the ranks' samples).

    Raises:
        ShapeError: ``stats`` is not running statistics.

    Reference: Chan, Golub & LeVeque (1979), eq. 2.1, for W sets at once.
    """
    if not isinstance(stats, TensorDict) or any(k not in stats.keys() for k in _KEYS):
        raise ShapeError(f"stats: expected running statistics with keys {list(_KEYS)}")
    mean, var, count = stats["mean"], stats["var"], stats["count"]
    if mean.shape != var.shape or tuple(mean.shape[: count.ndim]) != tuple(count.shape):
        raise ShapeError(f"stats: 'count' {tuple(count.shape)} is not the leading shape of 'mean' {tuple(mean.shape)}")
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size(group) == 1:
        return stats.clone()
    expand = (*count.shape, *([1] * (mean.ndim - count.ndim)))
    dt = torch.promote_types(mean.dtype, torch.float32)  # the statistics' own precision (double ones were reduced in single)
    n_r = count.to(dt)
    w = n_r.reshape(expand)
    m = mean.to(dt)
    first = torch.cat([n_r.reshape(-1), (w * m).reshape(-1)])
    tdist.all_reduce(first, group=group)
    n = first[: n_r.numel()].view(count.shape)
    safe = torch.where(n > 0, n, torch.ones_like(n)).reshape(expand)
    total_mean = first[n_r.numel() :].view(mean.shape) / safe
    m2 = w * var.to(dt) + w * (m - total_mean).square()  # 0 where n_r == 0
    tdist.all_reduce(m2, group=group)
    total_var = m2 / safe
    empty = (n == 0).reshape(expand)
    return TensorDict(
        {
            "mean": torch.where(empty, mean, total_mean.to(mean.dtype)),
            "var": torch.where(empty, var, total_var.to(var.dtype)),
            "count": n.to(count.dtype),
        },
        batch_size=stats.batch_size,
        device=stats.device,
    )

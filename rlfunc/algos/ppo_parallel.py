"""The pieces that make PPO's iteration data-parallel and equal to the single-process one (those
bc and dppo use too are in :mod:`rlfunc.algos.data_parallel`).

``make_ppo(config, spec, device, dist)`` with a :class:`rlfunc.run.distributed.Distributed` of W > 1
ranks runs the update of the single process that steps all ``config.num_envs`` envs, with each rank
collecting ``num_envs / W`` of them (rank r: envs r*N/W .. (r+1)*N/W - 1 of the single process):

1. the policy draws the action noise (Gaussian noise, or gSDE's exploration matrices) for all N
   envs from the seed's generator and keeps its own rows (:func:`rlfunc.algos.data_parallel.own_rows`): the same noise as
   the single process's envs, and the generators, which draw the same numbers on every rank, stay
   in sync;
2. ``prepare`` (normalisation with the old statistics, reward scaling, GAE) runs per env on the
   rank's envs; the observation and return statistics of the new batch are merged across ranks
   (:func:`update_stats_across_ranks`), so they are the statistics of all N envs' samples;
3. the flat batch [S, N/W * T] is all-gathered into the global [S, N * T] (rank order = the single
   process's env order); the running discounted returns [S, N/W, 1] and the finiteness flags too
   (:func:`gather_env_rows`), so the learner state is the same on every rank;
4. every rank draws the same permutation of the global batch and takes its share of each
   minibatch of size m: positions [r m/W, (r+1) m/W) (:func:`local_share`); the advantages are
   normalised over the whole (global) minibatch before the share is taken
   (:func:`normalized_share`);
5. the loss is the mean over the local share; the gradients, the loss and the metrics go through
   one ``all_reduce_mean`` (:func:`rlfunc.algos.data_parallel.average`), so the gradient is the single process's, and the
   finiteness mask, the grad norms, clipping, Adam and ``target_kl`` decide alike on every rank.

What stays approximate: float rounding (a sum over halves then a mean, not one sum; Chan merges
of the statistics, not one pass; the "explained_variance" metric pooled from the shares' moments,
:func:`rlfunc.losses.ppo.pool_explained_variance`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.algos.data_parallel import check_divides
from rlfunc.core.normalize import all_reduce_running_stats, merge_running_stats, update_running_stats
from rlfunc.errors import ConfigError

SHAPING = ("oscillation_damping", "adaptive_clip", "prioritized_minibatches")


def check_config(config, world_size: int) -> None:
    """ConfigError unless ``config`` (a PPOConfig) can be split over ``world_size`` ranks: W must
    divide ``num_envs`` (each rank collects num_envs / W) and ``minibatch_size`` (each rank's share),
    and the gradient-shaping options, not yet data-parallel, must be off."""
    if world_size == 1:
        return
    check_divides(world_size, num_envs=config.num_envs, minibatch_size=config.minibatch_size)
    on = [name for name in SHAPING if getattr(config, name)]
    if on:
        raise ConfigError(f"{', '.join(on)}: gradient shaping is not data-parallel yet; run it in one process")


def update_stats_across_ranks(vmap: Callable, group=None) -> Callable[[TensorDict, Tensor], TensorDict]:
    """``update(stats [S], x [S, ..., *shape])``: the stacked running statistics with every rank's
    new samples merged in (:func:`rlfunc.core.normalize.all_reduce_running_stats` of the batch's
    statistics, then folded into ``stats``, which every rank holds alike). ``vmap`` maps over S."""
    batch_stats, merge = vmap(update_running_stats), vmap(merge_running_stats)

    def update(stats: TensorDict, x: Tensor) -> TensorDict:
        empty = stats.clone()
        empty["count"] = torch.zeros_like(stats["count"])  # count 0: the batch's moments come back exactly
        return merge(stats, all_reduce_running_stats(batch_stats(empty, x), group))

    return update


def gather_env_rows(dist, finite: Tensor, discounted_return: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(``finite`` [3, S] and-ed over the ranks, ``discounted_return`` [S, N/W, 1] of every rank
    concatenated in rank order, [S, N, 1]; None stays None), in one all_gather."""
    parts = {"finite": finite[None]}
    if discounted_return is not None:
        parts["discounted_return"] = discounted_return[None]
    out = dist.all_gather_batch(TensorDict(parts, batch_size=[1]), dim=0)  # [W, ...]
    gathered = None
    if discounted_return is not None:
        d = out["discounted_return"]  # [W, S, N/W, 1]
        gathered = d.transpose(0, 1).reshape(d.shape[1], -1, *d.shape[3:])
    return out["finite"].all(0), gathered


def local_share(perm: Tensor, minibatch_size: int, rank: int, world_size: int) -> Tensor:
    """perm [S, B] (the order of the global batch) -> [S, B/W]: positions [r m/W, (r+1) m/W) of every
    minibatch of m = ``minibatch_size``, minibatch after minibatch (so local minibatch k is
    ``[:, k m/W : (k+1) m/W]``)."""
    S, B = perm.shape
    share = minibatch_size // world_size
    return perm.view(S, B // minibatch_size, world_size, share)[:, :, rank].reshape(S, -1)


def normalized_share(normalize: Callable[[Tensor], Tensor], advantage: Tensor, rows: Tensor, minibatch: Tensor,
                     rank: int, world_size: int) -> Tensor:
    """This rank's share of the minibatch's advantages, normalised over the whole minibatch.

    ``minibatch`` [S, m] indexes the global batch's ``advantage`` [S, B, 1]; ``normalize`` is the
    loss's own rule (``vmap(rlfunc.losses.ppo.normalize_advantage)``), so the numbers are those the
    single process computes. Every rank holds the global batch, so it normalises locally: no
    collective, and the same two-pass std as the single process (an all_reduce of sums and sums of
    squares would be a one-pass variance, with its cancellation)."""
    share = minibatch.shape[1] // world_size
    return normalize(advantage[rows, minibatch])[:, rank * share : (rank + 1) * share]

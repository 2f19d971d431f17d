"""Data-parallel gradient averaging as the first link of an update chain."""

from __future__ import annotations

import torch
import torch.distributed as tdist
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.errors import ConfigError
from rlfunc.optim.base import GradientTransform, from_leaves


def world_size(group=None) -> int:
    """The number of ranks of ``group`` (None: the default group); 1 when torch.distributed is not
    initialised."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return 1
    return tdist.get_world_size(group)


def buckets(leaves: list[Tensor], bucket_bytes: int) -> list[list[int]]:
    """The indices of ``leaves`` grouped by (dtype, device), in their order, into lists of at most
    ``bucket_bytes`` each (a larger leaf alone): each list is one flat buffer, one collective."""
    out: list[list[int]] = []
    current: dict[tuple, tuple[list[int], int]] = {}
    for i, t in enumerate(leaves):
        key = (t.dtype, t.device)
        size = t.numel() * t.element_size()
        bucket, used = current.get(key, (None, 0))
        if bucket is None or (used + size > bucket_bytes and bucket):
            bucket, used = [], 0
            out.append(bucket)
        bucket.append(i)
        current[key] = (bucket, used + size)
    return out


def flatten_dense(tensors: list[Tensor]) -> Tensor:
    """One new contiguous 1-d buffer holding ``tensors`` (same dtype and device) one after another
    (a copy even of a single tensor, so a collective on it never writes into the inputs)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_dense(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    """Views of ``flat`` shaped like ``like`` (the inverse of :func:`flatten_dense`)."""
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in like]), like)]


def all_reduce_mean(group=None, bucket_bytes: int = 25 * 2**20) -> GradientTransform:
    """The mean of every rank's gradients: g <- (1/W) sum_r g_r, the same result on every rank.

    The leaves are packed in order into flat buffers of at most ``bucket_bytes`` (per dtype and
    device; a larger leaf alone), one ``all_reduce(SUM)`` per buffer, then divided by W: a 13-leaf
    PPO actor-critic is one collective per gradient step (CleanRL's ``ppo_atari_multigpu`` recipe,
    DDP's bucketing without its overlap with the backward pass). A non-finite gradient on any rank
    makes the mean non-finite on every rank, so a finiteness check after this link decides alike
    everywhere. Put it first in the chain (``chain(all_reduce_mean(), clip_by_global_norm(0.5),
    adam(3e-4))``): clipping and Adam then see the averaged gradient, and every rank takes the same
    step. The identity (no copy, no communication) at world size 1 or when torch.distributed is
    not initialised. Stateless: the state is an empty TensorDict.

    With the mean of per-rank losses each averaged over an equal share of the samples, the result is
    the gradient of the loss averaged over all the ranks' samples, to float rounding.

    Args:
        group: the process group (None: the default one).
        bucket_bytes: > 0, the size of one flat buffer.

    Raises:
        ConfigError: ``bucket_bytes`` is not > 0.

    Reference: Li et al. (2020) "PyTorch Distributed: Experiences on Accelerating Data Parallel
    Training" (gradient bucketing).
    """
    if not bucket_bytes > 0:
        raise ConfigError(f"bucket_bytes={bucket_bytes}: expected > 0")

    def init(params: TensorDictBase) -> TensorDict:
        return TensorDict({}, batch_size=[], device=params.device)

    def update_leaves(g: list[Tensor], treedef: tuple, state: TensorDictBase, params: TensorDictBase | None = None, **extra):
        w = world_size(group)
        if w == 1:
            return g, state
        out: list[Tensor] = list(g)
        with torch.no_grad():
            for idx in buckets(out, bucket_bytes):
                bucket = [g[i].detach() for i in idx]
                flat = flatten_dense(bucket)
                tdist.all_reduce(flat, op=tdist.ReduceOp.SUM, group=group)
                flat.div_(w)
                for i, mean in zip(idx, unflatten_dense(flat, bucket)):
                    out[i] = mean
        return out, state

    return from_leaves(init, update_leaves)

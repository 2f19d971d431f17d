"""What every data-parallel algorithm (ppo, ppo-encoder, bc, dppo, grpo, gspo, mappo, sac, td3, td3-diffusion,
sac-diffusion) shares to make its update equal the single process's, to float rounding: ``make_X(..., dist)``
with a :class:`rlfunc.run.distributed.Distributed` of W > 1 ranks.

- the randomness of the single process is drawn on every rank (every rank's generator draws the same
  numbers, so they stay in sync); where a rank acts for a part of the envs it keeps its rows
  (:func:`own_rows`), where it takes a part of a minibatch it keeps its share (:func:`share`);
- the loss is the mean over the rank's share of the minibatch (m / W samples of m); the gradients,
  the loss and the metrics go through one ``all_reduce_mean`` (:func:`average`, or
  :func:`average_grads_` for gradients left in ``.grad``) before the norms, the finiteness mask and
  the update chain, so clipping, Adam and early stopping decide alike on every rank and the learner
  state keeps the single process's layout (snapshots move between world sizes).

Metrics that are not means over the samples are pooled as the whole minibatch's: a max through
``average``'s ``maxima``, an explained variance from its parts (``ppo_loss(..., poolable=True)``,
``average``'s ``moments`` and ``maxima``, then :func:`rlfunc.losses.ppo.pool_explained_variance`; the
mean of the ranks' values flipped its sign on 8-sample shares), each rank's value in its own slot of
the same collective. A mean over items whose
number differs between the shares (grpo's valid steps) is weighted first (:func:`count_weight`); a loss
that is not a mean over the samples (Diffusion-QL's -E[Q] / E|Q|) needs its whole-minibatch statistic
averaged inside the gradient (:func:`mean_in_graph`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.errors import ConfigError
from rlfunc.optim.base import GradientTransform

_EMPTY = TensorDict({}, batch_size=[])


def check_divides(world_size: int, **sizes: int) -> None:
    """ConfigError naming the first of ``sizes`` (name=value: envs, minibatch samples ...) that
    ``world_size`` does not divide; nothing at world size 1."""
    for name, value in sizes.items():
        if value % world_size:
            raise ConfigError(f"{name}={value} does not divide by the {world_size} ranks of the data-parallel run")


def own_rows(rank: int, world_size: int) -> Callable[[Callable[[int], Tensor], int, int], Tensor]:
    """``own(draw, n, dim)``: ``draw(n)`` at world size 1, else the rows [rank n, (rank+1) n) along
    ``dim`` of ``draw(world_size * n)`` (``draw(k)`` draws for k envs). The generator advances by
    the draws of all the envs, as the single process's does."""
    if world_size == 1:
        return lambda draw, n, dim: draw(n)
    return lambda draw, n, dim: draw(world_size * n).narrow(dim, rank * n, n)


def share(x: Tensor | TensorDictBase, rank: int, world_size: int, dim: int = 0) -> Tensor | TensorDictBase:
    """Positions [r m/W, (r+1) m/W) of ``x`` along ``dim`` (of size m, divisible by W): rank r's
    share of a minibatch; ``x`` itself at world size 1."""
    if world_size == 1:
        return x
    m = x.shape[dim] if isinstance(x, Tensor) else x.batch_size[dim]
    return x.narrow(dim, rank * (m // world_size), m // world_size)


def mean_in_graph(x: Tensor, world_size: int, group=None) -> Tensor:
    """The mean over the ``world_size`` ranks of ``x`` (detached, the same shape on every rank), by a
    functional all_reduce (``torch.distributed._functional_collectives``): unlike ``all_reduce`` on
    the tensor itself it runs inside ``torch.func.grad``, so a loss can use a whole-minibatch
    statistic (Diffusion-QL's E|Q| normaliser) without a second forward pass; ``x`` at world size 1."""
    if world_size == 1:
        return x
    import torch.distributed as tdist
    import torch.distributed._functional_collectives as fc

    out = fc.all_reduce(x.detach(), "sum", tdist.group.WORLD if group is None else group)
    return fc.wait_tensor(out) / world_size


def average(reduce: GradientTransform, grads: list[Tensor], treedef: tuple | None, loss: Tensor,
            metrics: TensorDictBase, *, maxima: Collection[str] = (), moments: Collection[tuple[str, str]] = (),
            rank: int = 0, world_size: int = 1) -> tuple[list[Tensor], Tensor, TensorDict]:
    """(gradients, loss [*S], metrics [*S]) averaged over the ranks by the ``all_reduce_mean`` link
    ``reduce``, the loss and the metrics in the gradients' last bucket: one collective for all.
    ``loss`` and every metric share the shape [*S] (0-dim for one seed, [S] for stacked seeds).

    Two kinds of metric are not averaged, each rank (``rank`` of ``world_size``) putting its value in
    its own slot of W zeros, so that the mean times W holds every rank's: those named in ``maxima``
    come back as their max over the ranks; the (mean, population variance) pairs of ``moments`` (the
    explained variance's parts: equal shares) as the whole minibatch's, mean(m_r) and
    mean(v_r) + mean((m_r - M)^2) (stable: no difference of large squares)."""
    peaks = sorted(k for k in maxima if k in metrics.keys())
    pairs = [(mk, vk) for mk, vk in moments if mk in metrics.keys()]
    slotted = [*peaks, *(k for pair in pairs for k in pair)]
    names = sorted(k for k in metrics.keys() if k not in slotted)
    packed = torch.stack([loss.detach(), *[metrics[k].detach().to(loss.dtype) for k in names]], -1)  # [*S, 1 + K]
    if slotted:
        slots = loss.new_zeros(*loss.shape, len(slotted), world_size)
        slots[..., rank] = torch.stack([metrics[k].detach().to(loss.dtype) for k in slotted], -1)
        packed = torch.cat([packed, slots.flatten(-2)], -1)  # [*S, 1 + K + P W]
    out, _ = reduce.update_leaves([*grads, packed], treedef, _EMPTY)
    packed = out[-1]
    mean = TensorDict({k: packed[..., i + 1] for i, k in enumerate(names)}, batch_size=metrics.batch_size)
    if slotted:
        every = dict(zip(slotted, (packed[..., 1 + len(names):].unflatten(-1, (len(slotted), world_size)) * world_size).unbind(-2)))
        for k in peaks:  # [*S, W] each
            mean[k] = every[k].amax(-1)
        for mk, vk in pairs:
            m = every[mk].mean(-1)
            mean[mk], mean[vk] = m, every[vk].mean(-1) + (every[mk] - m.unsqueeze(-1)).square().mean(-1)
    return out[:-1], packed[..., 0], mean


def average_grads_(reduce: GradientTransform, leaves: list[Tensor], loss: Tensor,
                   metrics: TensorDictBase, **slots) -> tuple[Tensor, TensorDict]:
    """The ``.grad`` of ``leaves`` (those that have one: every rank backpropagated the same graph)
    replaced by its mean over the ranks, with the loss and the metrics in the same collective
    (:func:`average`); returns (mean loss, mean metrics). Call it between the backward passes
    (:func:`rlfunc.optim.amp.accumulate_gradients`) and the step (:func:`rlfunc.optim.amp.transform_step`):
    an fp16 loss scale (:func:`rlfunc.optim.amp.dynamic_loss_scale`, learner state) is the same on every
    rank, and its check of the averaged gradients (non-finite on one rank: non-finite on all) decides alike.
    ``slots``: :func:`average`'s ``maxima``, ``moments``, ``rank`` and ``world_size``."""
    stepped = [p for p in leaves if p.grad is not None]
    grads, loss, metrics = average(reduce, [p.grad for p in stepped], None, loss, metrics, **slots)
    for p, g in zip(stepped, grads):
        p.grad = g
    return loss, metrics


def count_weight(share_count: Tensor, total_count: Tensor, world_size: int) -> Tensor:
    """W * max(c_r, 1) / max(C, 1): the factor that turns rank r's mean over the c_r items of its share
    (valid steps, say; ``share_count``) into its part of the mean over all C items of the minibatch
    (``total_count``, every rank's items), so that the mean over the ranks of the weighted share means
    is (sum over all items) / C, the single process's ratio. The max(., 1) is
    :func:`rlfunc.losses.grpo.masked_aggregate`'s guard (an empty share's mean is 0). Any shape, the
    two counts alike; float32."""
    share = share_count.clamp_min(1).to(torch.float32)
    return world_size * share / total_count.clamp_min(1).to(torch.float32)

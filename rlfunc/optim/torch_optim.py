"""torch.optim over the leaves of a parameter TensorDict, with per-member gradient clipping.

No algorithm steps these any more: each learner state owns its optimizer, the transforms of
:mod:`rlfunc.optim` (the runs convert snapshots of torch.optim's state, layout 1, with
:func:`rlfunc.optim.adam_state_from_torch`). Kept for users' own loops and the tests that check the
transforms against torch.optim.

The optimizer step is the one stateful edge of rlfunc: it updates the parameter TensorDict's leaves
in place, so every policy bound to those leaves (the collector's included) sees the new weights.
With stacked params (a leading seed/ensemble dim) Adam is elementwise, so members stay independent;
gradient-norm clipping and non-finite skipping are done per member.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from rlfunc.core.func import leaves
from rlfunc.errors import CheckpointError, ConfigError, ShapeError


def make_adam(params: TensorDictBase, lr: float, *, eps: float = 1e-5, betas=(0.9, 0.999)) -> torch.optim.Adam:
    """Adam over ``params``' leaves (foreach implementation). ``lr`` in units of the loss per step."""
    if not lr > 0:
        raise ConfigError(f"lr={lr}: expected a positive learning rate")
    return torch.optim.Adam(leaves(params), lr=lr, eps=eps, betas=betas, foreach=True)


def linear_lr(base_lr: float, iteration: int, num_iterations: int, anneal: bool = True) -> float:
    """Linearly annealed learning rate: ``base_lr * (1 - iteration / num_iterations)``, or constant.

    Raises:
        ConfigError: ``iteration`` < 0 (it extrapolated above ``base_lr``: -5 of 10 gave 1.5 x base_lr).
    """
    if iteration < 0:
        raise ConfigError(f"linear_lr: iteration={iteration}: expected >= 0 (the iterations done)")
    if not anneal or num_iterations <= 0:
        return base_lr
    return base_lr * max(1.0 - iteration / num_iterations, 0.0)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group (e.g. to :func:`linear_lr`'s value)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def member_grad_norms(grads: Sequence[torch.Tensor], stacked: bool) -> torch.Tensor:
    """Global L2 norm of the gradients, per member: ``[M]`` when ``stacked`` else ``[1]``; half-precision
    gradients are squared and summed in float32 (in float16 a gradient of 256 squared overflowed:
    a norm of inf, and clipping skipped finite steps).

    Raises:
        ShapeError: no gradients."""
    if not grads:
        raise ShapeError("member_grad_norms: no gradients (an empty list)")
    grads = [g.float() if g.dtype in _HALF else g for g in grads]
    sq = torch._foreach_mul(grads, grads)  # one multi-tensor op for the squares (pow(2) per leaf was one each)
    if stacked:  # a sum over the trailing dims, not over a reshape: a transposed gradient (a weight's, from bmm's
        # backward) then reduces in its memory order, which inductor vectorises (it ran a scalar loop over the reshape)
        sq = [x.sum(dim=tuple(range(1, x.dim()))) if x.dim() > 1 else x for x in sq]
    else:
        sq = [x.sum().reshape(1) for x in sq]
    return torch.stack(sq).sum(0).sqrt()


_HALF = (torch.float16, torch.bfloat16)


def clip_grads_(
    grads: Sequence[torch.Tensor], max_norm: float, stacked: bool, norms: torch.Tensor | None = None
) -> torch.Tensor:
    """Scale gradients in place so each member's global norm is at most ``max_norm``.

    Args:
        norms: the members' norms if already computed (:func:`member_grad_norms`); non-finite
            entries leave that member's gradients unscaled (its step is skipped anyway).

    Returns:
        [M] (or [1]) float, the norms before clipping.
    """
    if norms is None:
        norms = member_grad_norms(grads, stacked)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    scale = torch.where(norms.isfinite(), scale, torch.ones_like(scale))
    for g in grads:
        g.mul_(scale.view(-1, *([1] * (g.dim() - 1))) if stacked else scale)
    return norms


def masked_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], ok: torch.Tensor) -> None:
    """``optimizer.step()`` that leaves members with ``ok[m] == False`` untouched (params and state).

    Args:
        params: the leaves the optimizer steps, each ``[M, ...]`` when ``ok`` has M > 1 entries.
        ok: [M] bool, members whose update is valid (finite loss and gradients).

    The common case (all ok) costs one host read of ``ok``; otherwise the skipped members' params and
    optimizer state are restored after the step, and their (non-finite) gradients never touch them.
    Adam's ``step`` counter is one scalar for all members, so it still advances for a skipped
    member (its later bias correction is that of one more step). ``ok`` of one element ([1] or 0-dim)
    is one flag for the whole step (unstacked params).

    Raises:
        ShapeError: ``ok`` is not a bool tensor, or has M > 1 entries while a param's leading dim is not M.
    """
    if not isinstance(ok, torch.Tensor) or ok.dtype != torch.bool:
        raise ShapeError(f"masked_step: ok is {_what(ok)}, expected a bool tensor [M] (one flag per member)")
    if ok.dim() > 1 or (ok.numel() > 1 and any(p.dim() == 0 or p.shape[0] != ok.numel() for p in params)):
        raise ShapeError(f"masked_step: ok has shape {list(ok.shape)}, expected [M] with M the leading (member) dim "
                         f"of every param (shapes {[list(p.shape) for p in params]}), or [1] for unstacked params")
    if bool(ok.all()):
        optimizer.step()
        return
    bad = ~ok
    saved = []
    for p in params:
        state = optimizer.state.get(p, {})
        saved.append((p.detach().clone(), {k: v.clone() for k, v in state.items() if torch.is_tensor(v)}))
        if p.grad is not None:
            p.grad.nan_to_num_(0.0, 0.0, 0.0)
    if ok.numel() == 1:
        return  # a single member: skip the whole step
    optimizer.step()
    idx = bad.nonzero().squeeze(-1)
    with torch.no_grad():
        for p, (old, old_state) in zip(params, saved):
            p.index_copy_(0, idx, old.index_select(0, idx))
            state = optimizer.state.get(p, {})
            for k, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == ok.numel():
                    if k in old_state:
                        v.index_copy_(0, idx, old_state[k].index_select(0, idx))
                    else:  # state created by this (first) step: skipped members keep the initial zeros
                        v.index_fill_(0, idx, 0.0)


def _what(x) -> str:
    return f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


def optimizer_state(optimizer: torch.optim.Optimizer) -> TensorDict:
    """The optimizer's tensor state as a TensorDict ``{"<i>": {"step", "exp_avg", ...}}`` for checkpoints."""
    sd = optimizer.state_dict()["state"]
    # clone: a snapshot, not a view of the live state that later steps update in place
    return TensorDict({str(i): TensorDict(dict(s), batch_size=[]) for i, s in sd.items()}, batch_size=[]).clone()


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: TensorDictBase) -> None:
    """Inverse of :func:`optimizer_state`, keeping the optimizer's current hyperparameters."""
    sd = optimizer.state_dict()
    try:
        sd["state"] = {int(i): {k: v.clone() for k, v in s.items()} for i, s in state.items()}
        optimizer.load_state_dict(sd)
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"optimizer state does not match the parameters: {e}") from e


def minibatch_epochs(
    batch: TensorDictBase,
    minibatch_size: int,
    num_epochs: int,
    update,
    *,
    generator: torch.Generator,
    target_kl: float | None = None,
) -> tuple[TensorDict, int]:
    """PPO's update schedule (Schulman et al. 2017, Algorithm 1): ``num_epochs`` passes over a flat
    ``batch`` [B], each in a fresh random order (``torch.randperm`` from ``generator``) cut into
    ``B // minibatch_size`` minibatches (a remainder is dropped); ``update(minibatch) -> metrics``
    (0-dim tensors) does one gradient step. The iteration stops early, after the minibatch whose
    metrics["approx_kl"] exceeds ``target_kl`` (None: never), as in SB3 / CleanRL.

    Returns:
        (the metrics averaged over the updates done, the number of updates).
    """
    total, updates = None, 0
    size = batch.batch_size[0]
    for _ in range(num_epochs):
        perm = torch.randperm(size, generator=generator, device=generator.device)
        for k in range(size // minibatch_size):
            metrics = update(batch[perm[k * minibatch_size : (k + 1) * minibatch_size]])
            total = metrics if total is None else total + metrics
            updates += 1
            if target_kl is not None and float(metrics["approx_kl"]) > target_kl:
                return total / updates, updates
    return total / updates, updates

"""The update chain over flat leaf lists: the form a pure gradient step takes, so torch.compile can
trace it whole (no TensorDict in or out: tensordict's pytree cache would make the second call
recompile). sac, td3, dppo, their diffusion variants, grpo and mappo build their compiled steps on these.

Example::

    w, treedef = leaf_list(params), flatten(params)[1]
    opt = chain_state(state["optim"])
    grads, loss = ...                         # torch.func.grad over w
    norm = chain_step(transform, grads, w, treedef, opt, loss)   # w and opt move in place
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.optim.base import flatten, unflatten
from rlfunc.optim.torch_optim import member_grad_norms


def leaf_list(td: TensorDict) -> list[Tensor]:
    """``td``'s leaves in :func:`rlfunc.optim.flatten` order, detached: views a pure step writes in place."""
    return [t.detach() for t in flatten(td)[0]]


def chain_state(td: TensorDict) -> tuple[list[Tensor], tuple]:
    """(leaves, tree definition) of an update chain's state, as a pure step takes it."""
    leaves, treedef = flatten(td)
    return [t.detach() for t in leaves], treedef


def chain_step(transform, grads: list[Tensor], leaves: list[Tensor], treedef: tuple, opt: tuple[list[Tensor], tuple],
               loss: Tensor, *, stacked: bool = False, allowed: Tensor | None = None, with_params: bool = False, **extra) -> Tensor:
    """One step of the update chain ``transform`` on flat ``leaves`` (tree definition ``treedef``)
    with their ``grads``, in place on the leaves and on the chain's state ``opt`` (:func:`chain_state`;
    a link's new state tensors, such as clip's norm, are copied into the old ones). A step whose
    gradient norm or ``loss`` is not finite is skipped (adam's mask: nothing moves), without a host
    read, so a pure step compiles whole. Returns the global gradient norm before clipping (0-dim).

    ``stacked``: the leaves carry a leading member (seed) dim S and ``loss`` is [S]: each member's
    norm and skip are its own, and the norms [S] come back. ``allowed``: a further bool mask ([S], or
    [1] unstacked) of the members that may step. ``extra``: the links' per-step arguments (``lr=``,
    a 0-dim tensor in a compiled step, so a new value is no recompilation). ``with_params``: the links
    get the leaves (as the TensorDict of ``treedef``) as their params, which a decoupled weight decay
    (``adam(weight_decay > 0)``) reads; else None."""
    norm = member_grad_norms(grads, stacked=stacked)
    ok = norm.isfinite() & loss.detach().isfinite().reshape(norm.shape)
    if allowed is not None:
        ok = ok & allowed
    opt_leaves, opt_def = opt
    delta, new_state = transform.update_leaves([g.nan_to_num(0.0, 0.0, 0.0) for g in grads], treedef, unflatten(opt_def, opt_leaves),
                                               unflatten(treedef, leaves) if with_params else None, mask=ok, grad_norm=norm, **extra)
    for old, new in zip(opt_leaves, flatten(new_state)[0]):
        if new is not old:
            old.copy_(new)
    with torch.no_grad():
        torch._foreach_add_(leaves, delta)
    return norm if stacked else norm.reshape(())


def skipped(grad_norm: Tensor, loss: Tensor) -> Tensor:
    """1.0 where :func:`chain_step` skipped the step (the gradient norm or the loss not finite: nothing
    moved), else 0.0; shaped like ``grad_norm`` (a metric line's mean over steps is the fraction skipped)."""
    return (~(grad_norm.isfinite() & loss.detach().isfinite())).float()


def objective_step(transform, objective, leaves: list[Tensor], treedef: tuple, opt: tuple[list[Tensor], tuple],
                   name: str, mean_over_ranks=None) -> dict[str, Tensor]:
    """One gradient step of ``objective`` on flat ``leaves`` through the update chain ``transform``
    (:func:`chain_step`, in place on the leaves and on ``opt``). ``objective(leaves) -> (loss, (loss,
    metrics TensorDict))``, the form ``torch.func.grad(..., has_aux=True)`` takes. Returns the
    objective's metrics with ``{name}_grad_norm`` (0-dim, before clipping) and ``skipped_{name}``
    (1.0 where the gradient norm or the loss was not finite, so nothing moved; else 0.0).
    ``mean_over_ranks``: data parallel, ``(grads, loss, metrics) -> the same averaged over the ranks``
    (:func:`rlfunc.algos.data_parallel.average` with its all_reduce link), applied before the chain."""
    grads, (loss, m) = torch.func.grad(objective, has_aux=True)(leaves)
    if mean_over_ranks is not None:
        grads, loss, m = mean_over_ranks(grads, loss, m)
    metrics = m.to_dict()
    norm = chain_step(transform, grads, leaves, treedef, opt, loss)
    metrics[f"{name}_grad_norm"] = norm
    metrics[f"skipped_{name}"] = skipped(norm, loss)
    return metrics

"""Global gradient-norm clipping, per seed member, as a gradient transform."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.errors import ConfigError
from rlfunc.optim.base import GradientTransform, from_leaves, node, tree_leaves
from rlfunc.optim.torch_optim import member_grad_norms


def global_norm(grads: TensorDictBase, stacked: bool) -> Tensor:
    """The L2 norm of all of ``grads``' leaves, per member: ``[S]`` when ``stacked`` (leading seed
    dim S on every leaf) else ``[1]``. Non-finite iff some gradient of that member is."""
    return member_grad_norms(tree_leaves(grads), stacked)


def clip_by_global_norm(max_norm: float, stacked: bool = True) -> GradientTransform:
    """Scale the gradients of each seed member so that their global L2 norm is at most ``max_norm``:
    g <- g * min(1, max_norm / (||g|| + 1e-6)), ||g|| over all leaves of that member.

    Args:
        max_norm: > 0, in gradient units.
        stacked: every leaf has a leading seed dim S, and each member is clipped alone; False: one
            parameter set, one norm.

    A member whose norm is not finite is left unscaled (its step is to be skipped: adam's ``mask``).
    ``update`` takes the norms as ``grad_norm=`` when the caller has them already (``[S]``, from
    :func:`global_norm`), and keeps the pre-clip norms in its state, ``{"norm": [S] float}`` (zeros
    before the first update), for metrics. The numbers are those of
    :func:`rlfunc.optim.clip_grads_` (which torch.nn.utils.clip_grad_norm_ gives for one member).

    Raises:
        ConfigError: ``max_norm`` is not > 0.

    Reference: Pascanu et al. (2013) "On the difficulty of training recurrent neural networks".
    """
    if not max_norm > 0:
        raise ConfigError(f"max_norm={max_norm}: expected > 0")

    def init(params: TensorDictBase) -> TensorDict:
        first = tree_leaves(params)[0]
        members = first.shape[0] if stacked else 1
        return TensorDict({"norm": torch.zeros(members, device=first.device)}, batch_size=[], device=params.device)

    def update_leaves(g: list[Tensor], treedef: tuple, state: TensorDictBase, params: TensorDictBase | None = None, *,
                      grad_norm: Tensor | None = None, **extra):
        norms = member_grad_norms(g, stacked) if grad_norm is None else grad_norm
        scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        scale = torch.where(norms.isfinite(), scale, torch.ones_like(scale))
        if stacked:
            out = [x * scale.view(-1, *([1] * (x.dim() - 1))) for x in g]
        else:
            out = [x * scale.reshape(()) for x in g]
        new_state = node({"norm": norms.detach()}, state.device)
        return out, new_state

    return from_leaves(init, update_leaves)

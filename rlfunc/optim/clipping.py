"""Global gradient-norm clipping, per seed member, as a gradient transform."""

from __future__ import annotations

import numbers

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.optim.base import GradientTransform, _dict, from_leaves, node, tree_leaves
from rlfunc.optim.torch_optim import member_grad_norms


def global_norm(grads: TensorDictBase, stacked: bool) -> Tensor:
    """The L2 norm of all of ``grads``' leaves, per member: ``[S]`` when ``stacked`` (leading seed
    dim S on every leaf) else ``[1]``. Non-finite iff some gradient of that member is."""
    return member_grad_norms(tree_leaves(grads), stacked)


def _check_stacked(leaves: list[Tensor]) -> None:
    """ShapeError unless every leaf has the same leading (seed) dim."""
    sizes = {tuple(leaf.shape[:1]) for leaf in leaves}
    if any(leaf.dim() == 0 for leaf in leaves) or len(sizes) != 1:
        shapes = ", ".join(str(tuple(leaf.shape)) for leaf in leaves[:6])
        raise ShapeError(f"clip_by_global_norm(stacked=True): the leaves' shapes ({shapes}{', ...' if len(leaves) > 6 else ''}) "
                         "share no leading seed dim; stacked=False clips one parameter set")


def clip_by_global_norm(max_norm: float, stacked: bool = False) -> GradientTransform:
    """Scale the gradients of each seed member so that their global L2 norm is at most ``max_norm``:
    g <- g * min(1, max_norm / (||g|| + 1e-6)), ||g|| over all leaves of that member.

    Args:
        max_norm: > 0, in gradient units.
        stacked: every leaf has a leading seed dim S (a stack of seeds' parameters,
            :func:`rlfunc.core.func.stack_params`), and each member is clipped alone; False (the
            default, as optax's): one parameter set, one norm.

    A member whose norm is not finite is left unscaled (its step is to be skipped: adam's ``mask``).
    ``update`` takes the norms as ``grad_norm=`` when the caller has them already (``[S]``, from
    :func:`global_norm`), and keeps the pre-clip norms in its state, ``{"norm": [S] float}`` (zeros
    before the first update), for metrics. The numbers are those of
    :func:`rlfunc.optim.clip_grads_` (which torch.nn.utils.clip_grad_norm_ gives for one member).

    Raises:
        ConfigError: ``max_norm`` is not > 0. ShapeError: with ``stacked``, leaves without one
            common leading dim (``init``).

    Reference: Pascanu et al. (2013) "On the difficulty of training recurrent neural networks".
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0:
        raise ConfigError(f"max_norm={max_norm!r}: expected > 0")

    def init(params: TensorDictBase) -> TensorDict:
        leaves = tree_leaves(params)
        if not leaves:
            raise ShapeError("clip_by_global_norm: params has no tensors to clip (an empty TensorDict)")
        if stacked:
            _check_stacked(leaves)
        first = leaves[0]
        members = first.shape[0] if stacked else 1
        return TensorDict({"norm": torch.zeros(members, device=first.device)}, batch_size=[], device=params.device)

    def update_leaves(g: list[Tensor], treedef: tuple, state: TensorDictBase, params: TensorDictBase | None = None, *,
                      grad_norm: Tensor | None = None, **extra):
        if not g:  # no gradients (every leaf frozen): nothing to scale (torch.stack of none was a RuntimeError)
            return [], state
        members = g[0].shape[0] if stacked and g[0].dim() > 0 else 1
        # a caller's norm of another count is not per member (amp.transform_step's and dynamic_loss_scale's one
        # global norm [1]: every member was clipped by all members' norm): computed here per member then
        if grad_norm is None or grad_norm.shape != (members,):
            if stacked:  # leaves of different leading dims: torch.stack's RuntimeError, naming nothing
                _check_stacked(g)
            norms = member_grad_norms(g, stacked)
        else:
            norms = grad_norm
        before = _dict(state).get("norm")
        if before is not None and before.shape != norms.shape:
            raise ShapeError(f"clip_by_global_norm: gradients of {norms.shape[0]} member(s), a state of {before.shape[0]} "
                             "(a state of other params: init it with these)")
        scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        scale = torch.where(norms.isfinite(), scale, torch.ones_like(scale))
        if stacked and scale.numel() > 1:  # one multi-tensor op, each leaf times its members' scales (in its dtype:
            # a float32 scale promoted a bfloat16 leaf's gradient to float32, which adam then refused)
            out = list(torch._foreach_mul(g, [scale.to(x.dtype).view(-1, *([1] * (x.dim() - 1))) for x in g]))
        else:  # one member
            out = list(torch._foreach_mul(g, scale.reshape(())))
        new_state = node({"norm": norms.detach()}, state.device)
        return out, new_state

    return from_leaves(init, update_leaves)

"""Gradient transforms in the optax shape (every algorithm's update chain), and a torch.optim path
for callers who keep a torch.optim optimizer.

Transforms (the learner state owns the optimizer's state):

- :class:`GradientTransform` (``init(params) -> state``, ``update(grads, state, params, **extra) ->
  (updates, state)``), :func:`chain`, :func:`apply_updates`, :func:`tree_leaves`, :func:`tree_like`, :func:`flatten` /
  :func:`unflatten` (the leaf lists ``update_leaves`` works on), :func:`from_leaves`, :func:`partition` (a
  transform per top-level group of the params: torch.optim's parameter groups) (rlfunc/optim/base.py);
- :func:`clip_by_global_norm`, :func:`global_norm`: per seed member (rlfunc/optim/clipping.py);
- :func:`all_reduce_mean`: the mean of every rank's gradients, one flat all_reduce per bucket, the
  first link of a data-parallel chain (rlfunc/optim/distributed.py);
- :func:`adam`: torch.optim's foreach Adam over the leaves, with a per-step ``lr``, a per-member
  skip ``mask`` and optionally AdamW's decoupled ``weight_decay`` (rlfunc/optim/functional_adam.py).

The same chain over flat leaf lists, the form a compiled step takes (rlfunc/optim/leaves.py):
:func:`leaf_list`, :func:`chain_state`, :func:`chain_step`.

torch.optim over a parameter TensorDict's leaves (rlfunc/optim/torch_optim.py): :func:`make_adam`,
:func:`set_lr`, :func:`masked_step`, :func:`clip_grads_`, :func:`member_grad_norms`,
:func:`optimizer_state` / :func:`load_optimizer_state`; and the schedules :func:`linear_lr`,
:func:`minibatch_epochs`.

Example::

    update = chain(clip_by_global_norm(0.5, stacked=True), adam(3e-4, eps=1e-5))
    state = update.init(params)                  # part of the learner TensorDict
    updates, state = update.update(grads, state, params, lr=lr, mask=ok)
    apply_updates(params, updates)               # in place
"""

from rlfunc.optim.base import (GradientTransform, apply_updates, chain, flatten, from_leaves, partition, tree_leaves, tree_like,
                               unflatten)
from rlfunc.optim.distributed import all_reduce_mean
from rlfunc.optim.clipping import clip_by_global_norm, global_norm
from rlfunc.optim.functional_adam import adam, adam_state_from_torch
from rlfunc.optim.torch_optim import (
    clip_grads_,
    linear_lr,
    load_optimizer_state,
    make_adam,
    masked_step,
    member_grad_norms,
    minibatch_epochs,
    optimizer_state,
    set_lr,
)

__all__ = [
    "GradientTransform", "adam", "all_reduce_mean", "adam_state_from_torch", "apply_updates", "chain", "clip_by_global_norm", "clip_grads_", "global_norm",
    "linear_lr", "load_optimizer_state", "make_adam", "masked_step", "member_grad_norms", "minibatch_epochs",
    "optimizer_state", "partition", "set_lr", "tree_leaves", "tree_like", "flatten", "unflatten", "from_leaves",
]

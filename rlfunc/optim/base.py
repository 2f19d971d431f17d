"""Gradient transforms in the optax shape, over parameter TensorDicts.

A transform is ``init(params) -> state`` and ``update(grads, state, params=None, **extra) ->
(updates, new_state)``: ``grads``, ``updates`` and the per-leaf parts of ``state`` are TensorDicts
with the keys of ``params`` (optax's ``GradientTransformationExtraArgs``: ``extra`` holds per-step
arguments such as ``lr``, ``mask`` or ``grad_norm``, each link reads the ones it knows and ignores
the rest). The caller owns the state, so it is just more of the learner TensorDict and goes into
every snapshot. :func:`chain` composes links; :func:`apply_updates` adds the result to the params.

``grads`` may hold a subset of the params' leaves (frozen leaves left out): links then read and
write only the state of the leaves present, and :func:`apply_updates` moves only those.

Leaves are matched by key, in the order of :func:`tree_leaves` (that of :func:`rlfunc.func.leaves`), so
the insertion order of a TensorDict (a loaded snapshot's is alphabetical) never matters.

Reference: optax (Babuschkin et al. 2020), ``optax/_src/base.py`` and ``optax/_src/combine.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.errors import ShapeError


class GradientTransform(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params=None, **extra) -> (updates, new_state)``."""

    init: Callable[[TensorDictBase], TensorDict]
    update: Callable[..., tuple[TensorDict, TensorDict]]


def tree_leaves(td: TensorDictBase) -> list[Tensor]:
    """The tensors of ``td`` in the order of :func:`rlfunc.func.leaves` (keys sorted as ``str``:
    at the top level the nested groups before the plain leaves, below it by name), the order
    torch.optim's state of the same leaves is numbered in.

    A plain TensorDict is walked through its key -> value dict (about 10 us for 13 leaves, where
    the public ``keys``/``get`` take 70 us: this runs several times per gradient step).
    """
    out: list[Tensor] = []
    _walk(td, out, True)
    return out


def _items(td: TensorDictBase, top: bool = False) -> list:
    if type(td) is TensorDict:
        d = td._tensordict
        items = [(k, d[k]) for k in sorted(d)]
    else:
        items = [(k, td.get(k)) for k in sorted(td.keys())]
    if top:  # func.leaves sorts str(key): "('actor', ...)" before "log_std"
        items.sort(key=lambda kv: not isinstance(kv[1], TensorDictBase))
    return items


def _walk(td: TensorDictBase, out: list[Tensor], top: bool) -> None:
    for _, v in _items(td, top):
        if isinstance(v, TensorDictBase):
            _walk(v, out, False)
        else:
            out.append(v)


def tree_like(template: TensorDictBase, tensors: Sequence[Tensor]) -> TensorDict:
    """A TensorDict with ``template``'s keys holding ``tensors`` (in :func:`tree_leaves` order).

    Every level gets batch_size [] and ``template``'s device; no copy is made.

    Raises:
        ShapeError: ``tensors`` has another length than ``template``'s leaves.
    """
    it = iter(tensors)
    out = _build(template, it, True)
    if next(it, None) is not None:
        raise ShapeError(f"tree_like: more tensors than the template's leaves ({len(tree_leaves(template))})")
    return out


def _build(template: TensorDictBase, it, top: bool) -> TensorDict:
    d = {}
    for k, v in _items(template, top):
        if isinstance(v, TensorDictBase):
            d[k] = _build(v, it, False)
        else:
            t = next(it, None)
            if t is None:
                raise ShapeError(f"tree_like: fewer tensors than the template's leaves ({len(tree_leaves(template))})")
            d[k] = t
    return TensorDict._new_unsafe(d, batch_size=torch.Size([]), device=template.device)


def aligned(part: TensorDictBase, whole: TensorDictBase, what: str) -> list[Tensor]:
    """The leaves of ``whole`` at the keys of ``part`` (a subset of them), in ``part``'s leaf order.

    Raises:
        ShapeError: a key of ``part`` is missing from ``whole``, or a leaf's shape differs; the key named.
    """
    got = tree_leaves(part)
    want = tree_leaves(whole)
    if len(got) != len(want):
        keys = list(part.keys(include_nested=True, leaves_only=True))
        missing = [k for k in keys if k not in whole.keys(include_nested=True, leaves_only=True)]
        if missing:
            raise ShapeError(f"{what}: key {missing[0]!r} of the gradients is not in the state")
        want = tree_leaves(whole.select(*keys))
    for g, w in zip(got, want):
        if g.shape != w.shape:
            key = next(k for k, v in part.items(include_nested=True, leaves_only=True) if v is g)
            raise ShapeError(f"{what}: {key!r} has shape {list(g.shape)} in the gradients, {list(w.shape)} in the state")
    return want


def chain(*transforms: GradientTransform) -> GradientTransform:
    """Apply ``transforms`` in order, each to the previous one's updates; ``extra`` reaches every link.

    The state is ``{"0": state_0, "1": state_1, ...}``.
    """

    def init(params: TensorDictBase) -> TensorDict:
        return TensorDict({str(i): t.init(params) for i, t in enumerate(transforms)}, batch_size=[], device=params.device)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None, **extra):
        new = {}
        parts = dict(_items(state))
        for i, t in enumerate(transforms):
            grads, new[str(i)] = t.update(grads, parts[str(i)], params, **extra)
        return grads, TensorDict._new_unsafe(new, batch_size=torch.Size([]), device=state.device)

    return GradientTransform(init, update)


def apply_updates(params: TensorDictBase, updates: TensorDictBase) -> TensorDictBase:
    """``params + updates``, written into ``params``' tensors in place, which it returns.

    In place, as torch.optim steps: the leaves keep their identity, so they stay the autograd leaves
    the next loss differentiates, and every policy or freeze mask holding them sees the new values.
    ``updates`` may hold a subset of the keys (frozen leaves left out).

    Raises:
        ShapeError: a key of ``updates`` is missing from ``params`` or has another shape.
    """
    targets = aligned(updates, params, "apply_updates")
    with torch.no_grad():
        torch._foreach_add_(targets, tree_leaves(updates))
    return params

"""Gradient transforms in the optax shape, over parameter TensorDicts.

A transform is ``init(params) -> state`` and ``update(grads, state, params=None, **extra) ->
(updates, new_state)``: ``grads``, ``updates`` and the per-leaf parts of ``state`` are TensorDicts
with the keys of ``params`` (optax's ``GradientTransformationExtraArgs``: ``extra`` holds per-step
arguments such as ``lr``, ``mask`` or ``grad_norm``, each link reads the ones it knows and ignores
the rest). The caller owns the state, so it is just more of the learner TensorDict and goes into
every snapshot. :func:`chain` composes links; :func:`apply_updates` adds the result to the params.

``grads`` may hold a subset of the params' leaves (frozen leaves left out): links then read and
write only the state of the leaves present, and :func:`apply_updates` moves only those.

Leaves are matched by key, in the order of :func:`tree_leaves` (that of :func:`rlfunc.core.func.leaves`), so
the insertion order of a TensorDict (a loaded snapshot's is alphabetical) never matters.

The links of rlfunc.optim also have ``update_leaves(grads, treedef, state, params=None, **extra) -> (updates,
new_state)`` over the flat list of gradient leaves (``grads, treedef = flatten(grads_td)``): the same
function, without building the nested TensorDicts of every intermediate result. :func:`chain` runs its
links that way, and a training loop may call it directly (PPO does: a 13-leaf TensorDict costs about
40 us to build, against a whole Adam step of 400 us).

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
    """``init(params) -> state``; ``update(grads, state, params=None, **extra) -> (updates, new_state)``;
    optionally ``update_leaves(grads, treedef, state, params=None, **extra) -> (updates, new_state)``,
    the same over lists of leaves (:func:`flatten`)."""

    init: Callable[[TensorDictBase], TensorDict]
    update: Callable[..., tuple[TensorDict, TensorDict]]
    update_leaves: Callable[..., tuple[list[Tensor], TensorDict]] | None = None


def from_leaves(init: Callable[[TensorDictBase], TensorDict], update_leaves: Callable) -> GradientTransform:
    """The transform whose ``update`` flattens the gradients, runs ``update_leaves`` and rebuilds the
    updates with the gradients' keys."""

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None, **extra):
        g, treedef = flatten(grads)
        out, new_state = update_leaves(g, treedef, state, params, **extra)
        return unflatten(treedef, out, grads.device), new_state

    return GradientTransform(init, update, update_leaves)


def tree_leaves(td: TensorDictBase) -> list[Tensor]:
    """The tensors of ``td`` in the order of :func:`rlfunc.core.func.leaves` (keys sorted as ``str``:
    at the top level the nested groups before the plain leaves, below it by name), the order
    torch.optim's state of the same leaves is numbered in. The two orders agree for keys of letters,
    digits, "_" and "." (every module's parameter names); a key with a character that sorts before
    "'" (a space, "#") can order a group apart from it (PPO and GRPO check that they agree)."""
    return flatten(td)[0]


def tree_like(template: TensorDictBase, tensors: Sequence[Tensor]) -> TensorDict:
    """A TensorDict with ``template``'s keys holding ``tensors`` (in :func:`tree_leaves` order).

    Every level gets batch_size [] and ``template``'s device; no copy is made.

    Raises:
        ShapeError: ``tensors`` has another length than ``template``'s leaves.
    """
    leaves, treedef = flatten(template)
    if len(tensors) != len(leaves):
        raise ShapeError(f"tree_like: {len(tensors)} tensors for the template's {len(leaves)} leaves")
    return unflatten(treedef, tensors, template.device)


# The walks below run several times per gradient step, so a plain TensorDict is read through its
# key -> value dict and a tensor is told from a node by its type first: 5-10 us for PPO's 13 leaves,
# where the public keys()/get()/isinstance take 70 us.


def _is_node(v) -> bool:
    t = type(v)
    if t is TensorDict:
        return True
    if t is Tensor or t is torch.nn.Parameter:
        return False
    return isinstance(v, TensorDictBase)


_NO_BATCH = torch.Size([])


def node(d: dict, device=None) -> TensorDict:
    """``TensorDict(d, batch_size=[], device=device)`` without the constructor's checks (the values
    are tensors or TensorDicts already on ``device``): 4 us instead of 15 per node."""
    new = getattr(TensorDict, "_new_unsafe", None)  # a tensordict without it gets the checked constructor
    return new(d, batch_size=_NO_BATCH, device=device) if new is not None else TensorDict(d, batch_size=[], device=device)


def _dict(td: TensorDictBase) -> dict:
    return td._tensordict if type(td) is TensorDict else {k: td.get(k) for k in td.keys()}


def flatten(td: TensorDictBase) -> tuple[list[Tensor], tuple]:
    """(the leaves of ``td`` in :func:`tree_leaves` order, its tree definition for :func:`leaves_at`
    and :func:`unflatten`: a tuple of (key, child definition or None for a leaf))."""
    out: list[Tensor] = []
    return out, _flatten(td, out, True)


def _flatten(td: TensorDictBase, out: list[Tensor], top: bool) -> tuple:
    d = _dict(td)
    keys = sorted(d)
    if top:  # func.leaves sorts str(key): "('actor', ...)" before "log_std"
        keys.sort(key=lambda k: not _is_node(d[k]))
    spec = []
    for k in keys:
        v = d[k]
        if _is_node(v):
            spec.append((k, _flatten(v, out, False)))
        else:
            out.append(v)
            spec.append((k, None))
    return tuple(spec)


def leaves_at(td: TensorDictBase, treedef: tuple, what: str, *, names: tuple[str, str] = ("gradients", "state")) -> list[Tensor]:
    """The leaves of ``td`` at the keys of ``treedef`` (:func:`flatten`), in its order; ``td`` may
    hold more keys (the state of frozen leaves left out of the gradients).

    Raises:
        ShapeError: a key of ``treedef`` is missing from ``td`` (named, with ``what``; ``names``: what
            the two are, for the message: "key K of the gradients is not a leaf of the state").
    """
    return leaves_at_each((td,), treedef, what, names=names)[0]


def leaves_at_each(tds: Sequence[TensorDictBase], treedef: tuple, what: str, *,
                   names: tuple[str, str] = ("gradients", "state")) -> list[list[Tensor]]:
    """:func:`leaves_at` of each of ``tds`` (TensorDicts with the same keys), in one walk."""
    outs: list[list[Tensor]] = [[] for _ in tds]
    _leaves_at([_dict(td) for td in tds], treedef, outs, (), what, names)
    return outs


def _leaves_at(dicts: list[dict], treedef: tuple, outs: list[list[Tensor]], path: tuple, what: str,
               names: tuple[str, str]) -> None:
    for k, sub in treedef:
        values = [d.get(k) for d in dicts]
        for v in values:
            if v is None or (sub is None) == _is_node(v):
                raise ShapeError(f"{what}: key {path + (k,)!r} of the {names[0]} is not a leaf of the {names[1]}")
        if sub is None:
            for out, v in zip(outs, values):
                out.append(v)
        else:
            _leaves_at([_dict(v) for v in values], sub, outs, path + (k,), what, names)


def unflatten(treedef: tuple, tensors: Sequence[Tensor], device=None) -> TensorDict:
    """The TensorDict of ``treedef`` (:func:`flatten`) holding ``tensors``; batch_size [] at every level."""
    return _unflatten(treedef, iter(tensors), device)


def _unflatten(treedef: tuple, it, device) -> TensorDict:
    d = {k: (next(it) if sub is None else _unflatten(sub, it, device)) for k, sub in treedef}
    return node(d, device)


def check_shapes(got: Sequence[Tensor], want: Sequence[Tensor], treedef: tuple, what: str, *, dtypes: bool = False,
                 names: tuple[str, str] = ("gradients", "state")) -> None:
    """ShapeError naming the first leaf whose shape (and, with ``dtypes``, dtype) differs between
    ``got`` (the gradients) and ``want`` (the state; ``names`` says what the two are, for the message)."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            raise ShapeError(f"{what}: {_key(treedef, i)!r} has shape {list(g.shape)} in the {names[0]}, "
                             f"{list(w.shape)} in the {names[1]}")
        if dtypes and g.dtype != w.dtype:
            raise ShapeError(f"{what}: {_key(treedef, i)!r} has dtype {g.dtype} in the {names[0]}, {w.dtype} in the {names[1]}")


def tree_keys(treedef: tuple) -> list[tuple]:
    """The nested keys of ``treedef``'s leaves (:func:`flatten`), in their order: ``[("actor", "0", "weight"), ...]``."""
    keys: list[tuple] = []

    def walk(spec, path):
        for k, sub in spec:
            if sub is None:
                keys.append(path + (k,))
            else:
                walk(sub, path + (k,))

    walk(treedef, ())
    return keys


def _key(treedef: tuple, index: int) -> tuple:
    return tree_keys(treedef)[index]


def chain(*transforms: GradientTransform) -> GradientTransform:
    """Apply ``transforms`` in order, each to the previous one's updates; ``extra`` reaches every link.
    The chain has an ``update_leaves`` also when a link has only ``update`` (:func:`update_leaves_of`).

    The state is ``{"0": state_0, "1": state_1, ...}``.
    """

    def init(params: TensorDictBase) -> TensorDict:
        return TensorDict({str(i): t.init(params) for i, t in enumerate(transforms)}, batch_size=[], device=params.device)

    links = {str(i) for i in range(len(transforms))}

    def parts_of(state: TensorDictBase) -> dict:
        parts = _dict(state)
        if parts.keys() != links:  # a state of another transform (a link added or removed): was a bare KeyError
            raise ShapeError(f"chain: a state with links {sorted(parts)}, this chain has {len(transforms)} "
                             f"({sorted(links)}): a state of another transform; init it with this chain")
        return parts

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None, **extra):
        new = {}
        parts = parts_of(state)
        for i, t in enumerate(transforms):
            grads, new[str(i)] = t.update(grads, parts[str(i)], params, **extra)
        return grads, node(new, state.device)

    def update_leaves(grads: list[Tensor], treedef: tuple, state: TensorDictBase, params: TensorDictBase | None = None,
                      **extra):
        new = {}
        parts = parts_of(state)
        for i, t in enumerate(transforms):
            grads, new[str(i)] = update_leaves_of(t, grads, treedef, parts[str(i)], params, **extra)
        return grads, node(new, state.device)

    if all(t.update_leaves is not None for t in transforms):
        return from_leaves(init, update_leaves)
    # a link with only the TensorDict ``update`` (the optax shape a user writes): the chain still has an
    # update_leaves, which runs that link on rebuilt TensorDicts (the bug: update_leaves was None, and
    # a loop that calls it, PPO's, raised "'NoneType' object is not callable")
    return GradientTransform(init, update, update_leaves)


def partition(transforms: dict[str, GradientTransform]) -> GradientTransform:
    """Each top-level group of the params through its own transform: ``transforms[k]`` updates the
    gradients of ``params[k]`` (e.g. ``{"actor": adam(3e-4), "critic": adam(1e-3)}``: two learning
    rates, as torch.optim's parameter groups give). ``extra`` reaches every transform. A group absent
    from the gradients keeps its state.

    The state is ``{k: state_k}``. Reference: optax's ``multi_transform`` (``optax/_src/combine.py``).

    Raises:
        ShapeError: (init) the params' top-level keys are not the groups, (update) a gradient outside
            every group.
    """
    names = tuple(transforms)

    def init(params: TensorDictBase) -> TensorDict:
        if set(params.keys()) != set(names):
            raise ShapeError(f"partition: params with top-level keys {sorted(params.keys())}, expected the groups {sorted(names)}")
        return TensorDict({k: transforms[k].init(params.get(k)) for k in names}, batch_size=[], device=params.device)

    def update_leaves(grads: list[Tensor], treedef: tuple, state: TensorDictBase, params: TensorDictBase | None = None,
                      **extra):
        parts = _dict(state)
        new = dict(parts)
        out: list[Tensor] = []
        start = 0
        for k, sub in treedef:
            if sub is None or k not in transforms:
                raise ShapeError(f"partition: gradient {k!r} is in none of the groups {sorted(names)}")
            n = _count(sub)
            group_params = None if params is None else params.get(k)
            updates, new[k] = update_leaves_of(transforms[k], grads[start:start + n], sub, parts[k], group_params, **extra)
            out.extend(updates)
            start += n
        return out, node(new, state.device)

    return from_leaves(init, update_leaves)


def update_leaves_of(transform: GradientTransform, grads: list[Tensor], treedef: tuple, state: TensorDictBase,
                     params: TensorDictBase | None = None, **extra) -> tuple[list[Tensor], TensorDict]:
    """``transform``'s update over the leaf list ``grads`` (:func:`flatten` order of ``treedef``): its
    ``update_leaves``, or its TensorDict ``update`` on the rebuilt gradients for a transform that has none.
    Returns (updates in the same order, new state). For the links that wrap or group other transforms."""
    if transform.update_leaves is not None:
        return transform.update_leaves(grads, treedef, state, params, **extra)
    updates, new_state = transform.update(unflatten(treedef, grads), state, params, **extra)
    return leaves_at(updates, treedef, "update"), new_state


def _count(treedef: tuple) -> int:
    return sum(1 if sub is None else _count(sub) for _, sub in treedef)


def apply_updates(params: TensorDictBase, updates: TensorDictBase) -> TensorDictBase:
    """``params + updates``, written into ``params``' tensors in place, which it returns.

    In place, as torch.optim steps: the leaves keep their identity, so they stay the autograd leaves
    the next loss differentiates, and every policy or freeze mask holding them sees the new values.
    ``updates`` may hold a subset of the keys (frozen leaves left out).

    Raises:
        ShapeError: a key of ``updates`` is missing from ``params`` or has another shape.
    """
    deltas, treedef = flatten(updates)
    if not deltas:  # no updates (every leaf frozen): nothing moves (_foreach_add_ of none was a RuntimeError)
        return params
    targets = leaves_at(params, treedef, "apply_updates", names=("updates", "params"))
    check_shapes(deltas, targets, treedef, "apply_updates", names=("updates", "params"))
    with torch.no_grad():
        torch._foreach_add_(targets, deltas)
    return params

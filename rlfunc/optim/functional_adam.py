"""Adam as a gradient transform whose moments and step counts live in the caller's TensorDict."""

from __future__ import annotations

import math
import numbers

from collections.abc import Sequence

import torch
from torch.optim.adam import adam as torch_adam  # the functional form torch.optim.Adam.step calls
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.optim.base import GradientTransform, _dict, _key, check_shapes, from_leaves, leaves_at, leaves_at_each, tree_leaves, tree_like


_ADAM_KEYS = frozenset(("exp_avg", "exp_avg_sq", "step"))


def adam(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, *,
         weight_decay: float = 0.0, member_dims: int = 0) -> GradientTransform:
    """Adam (Kingma & Ba 2015, Algorithm 1): per leaf, with t the leaf's step count,
    m <- b1 m + (1 - b1) g,  v <- b2 v + (1 - b2) g^2,
    update = -lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps);
    with ``weight_decay`` = wd > 0, AdamW's decoupled weight decay (Loshchilov & Hutter 2019,
    Algorithm 2): the new parameter is p (1 - lr wd) + update, as ``torch.optim.AdamW`` steps.

    The arithmetic is torch.optim's own, ``torch.optim.adam.adam(..., foreach=True)`` (the
    multi-tensor kernels ``torch.optim.Adam(foreach=True)`` runs) over the TensorDict's leaves, with
    zeros in place of the params, so that it writes the update (added by ``apply_updates``; torch.optim
    adds it in the same addcdiv, so the two agree to float rounding, and bit for bit on the CPU builds
    tested). On an accelerator it runs capturable: the step counts are not read back to the host
    (untested here for want of one).

    Args:
        lr: > 0, the learning rate when ``update`` is given none.
        betas: (b1, b2), each in [0, 1).
        eps: >= 0, added to the bias-corrected RMS.
        weight_decay: >= 0, the decoupled decay rate per unit of lr (AdamW's ``weight_decay``); 0: Adam.
            With it, ``update`` needs ``params`` (the leaves the update is added to): torch.optim's
            functional AdamW (``torch.optim.adam.adam(..., decoupled_weight_decay=True, foreach=True)``)
            steps a copy of them and the update is the copy's change, so the stepped parameters agree
            with torch.optim.AdamW's to the rounding of that difference (bit for bit but where a
            parameter moves by more than half its magnitude).
        member_dims: 0, or 1 for params stacked over members (seeds: every leaf leads with the same
            dim S): each member then has its own step count per leaf, so a member that skips steps
            (``mask``) keeps the bias correction of its own run, and S members step as S separate
            Adams would: bit for bit in eager steps (torch's arithmetic on each member's rows, tested
            on the CPU against torch.optim.Adam), to float rounding in a compiled one.

    State: ``{"step": {leaf: 0-dim float32, or [S] with member_dims=1}, "exp_avg": like params,
    "exp_avg_sq": like params}``, zeros from ``init`` (torch.optim's initial state). ``update`` writes
    the moments and steps of the leaves present in ``grads`` into these tensors in place (as torch.optim does: a copy per step
    would double the optimizer's memory traffic) and returns the same state; clone it to keep the old.

    ``update(grads, state, params=None, *, lr=None, mask=None)`` (and ``update_leaves``, the same over
    the leaf lists):
        lr: this step's learning rate (a schedule's value): a finite real number >= 0, or a
            floating tensor of one element (0-dim in a compiled step; its value is not checked,
            which would read it back to the host); None: the ``lr`` above.
        mask: [S] bool on the leaves' device, the members (leading dim S of every leaf, S > 1) whose
            step is valid; or one bool flag ([1] or 0-dim) for the whole step, the form for unstacked
            params (one member). A member with False keeps its moments and gets a zero update, so its
            parameters stay bit for bit (its non-finite gradients never reach them). With
            ``member_dims=1`` its step count stays too. Without, the step count is one per leaf,
            shared by the members, and still advances for a skipped member while another steps (its
            later bias correction is that of one more step: the rule of
            :func:`rlfunc.optim.masked_step` over torch.optim.Adam); with a single flag a skipped step
            leaves everything, the count included, untouched. An [S] mask cannot tell stacked params
            from unstacked ones whose leaves all happen to lead with S rows: it is read as per-member there.

    Per-member step counts cost a host read per eager step (whether the members' counts still agree:
    then torch's multi-tensor step for all; else, with some members masked, their counts too, and the
    same arithmetic with a bias correction per member). A compiled step reads none.

    Raises:
        ConfigError: ``lr``, ``betas``, ``eps``, ``weight_decay`` or ``member_dims`` out of range;
            (update) no ``params`` given with a ``weight_decay``; (update) a per-step ``lr`` that is not finite and >= 0, or
            neither a number nor a tensor.
        ShapeError: (init, ``member_dims=1``) a leaf without a leading member dim, or of another S than
            the first; (update) a key of ``grads`` not in the state (or in ``params``), or of another shape
            or dtype; a tensor ``lr`` not floating or of more than one element; a ``mask`` that is not
            a bool tensor of shape [S] (S the leading dim of every leaf) or [1] / [], or on another
            device than the gradients. The ``lr`` and ``mask`` checks are Python-level (no host
            read) and skipped while torch.compile traces the step.
    """
    real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)  # noqa: E731  (numpy scalars are; "1e-3" is not)
    if not real(lr) or not lr > 0:
        raise ConfigError(f"lr={lr!r}: expected a positive learning rate")
    if not lr < math.inf:  # one step made every parameter -inf
        raise ConfigError(f"lr={lr!r}: expected a finite positive learning rate")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(real(b) for b in betas):
        raise ConfigError(f"betas={betas!r}: expected two values in [0, 1)")
    b1, b2 = betas
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ConfigError(f"betas={betas}: expected two values in [0, 1)")
    if not real(eps) or not eps >= 0:
        raise ConfigError(f"eps={eps!r}: expected >= 0")
    if not real(weight_decay) or not weight_decay >= 0:
        raise ConfigError(f"weight_decay={weight_decay!r}: expected >= 0")
    if member_dims not in (0, 1) or isinstance(member_dims, bool):
        raise ConfigError(f"member_dims={member_dims!r}: expected 0 (one step count per leaf) or 1 (one per member)")
    base_lr = lr

    def init(params: TensorDictBase) -> TensorDict:
        leaves = [p.detach() for p in tree_leaves(params)]
        counts = leaves[0].shape[:1] if member_dims and leaves else torch.Size([])
        if member_dims:
            for i, p in enumerate(leaves):
                if p.dim() == 0 or p.shape[:1] != counts:
                    raise ShapeError(f"adam(member_dims=1).init: leaf {i} of the params has shape {list(p.shape)}, expected "
                                     f"a leading member dim of {counts[0] if counts else 'the first leaf'}'s size")
        return TensorDict(
            {
                "step": tree_like(params, [torch.zeros(counts, dtype=torch.float32, device=p.device) for p in leaves]),
                "exp_avg": tree_like(params, [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]),
                "exp_avg_sq": tree_like(params, [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]),
            },
            batch_size=[],
            device=params.device,
        )

    def update_leaves(g: list[Tensor], treedef: tuple, state: TensorDictBase, params: TensorDictBase | None = None, *,
                      lr: float | Tensor | None = None, mask: Tensor | None = None, **extra):
        if not g:  # params without leaves: nothing to step (leaves_at_each's steps[0] was an IndexError)
            return [], state
        parts = _dict(state)
        if not _ADAM_KEYS <= parts.keys():  # a state of another transform: was a bare KeyError
            raise ShapeError(f"adam: a state with keys {sorted(parts)}, expected {sorted(_ADAM_KEYS)}: a state of "
                             "another transform; init it with this one")
        m, v, steps = leaves_at_each((parts["exp_avg"], parts["exp_avg_sq"], parts["step"]), treedef, "adam")
        # v and the steps come with m from init (or a checked snapshot); the bug: double or integer gradients
        # for float32 moments were a RuntimeError from inside torch's adam
        check_shapes(g, m, treedef, "adam", dtypes=True)
        for i, x in enumerate(g):  # an integer leaf with a gradient failed inside torch's adam ("lerp_kernel_scalar"
            if not x.is_floating_point():  # not implemented for 'Long'); without one (a BatchNorm's counter) it is left out
                raise ShapeError(f"adam: {_key(treedef, i)!r} has dtype {x.dtype} in the gradients: Adam steps "
                                 "floating-point leaves only (give no gradient for counters and indices)")
        if not torch.compiler.is_compiling():  # a traced step's arguments are the ones its eager first call checked
            _check_lr(lr)
            if mask is not None:
                _check_mask(mask, g, treedef)
        kw = dict(foreach=True, capturable=steps[0].device.type != "cpu", amsgrad=False, beta1=b1, beta2=b2,
                  lr=base_lr if lr is None else (lr if isinstance(lr, Tensor) and torch.compiler.is_compiling() else float(lr)), weight_decay=weight_decay, eps=eps, maximize=False)
        if weight_decay:
            if params is None:
                raise ConfigError("adam(weight_decay > 0).update: expected the params (the decay is of their values)")
            old = [p.detach() for p in leaves_at(params, treedef, "adam", names=("gradients", "params"))]
            check_shapes(g, old, treedef, "adam", names=("gradients", "params"))
            updates = [p.clone(memory_format=torch.preserve_format) for p in old]  # stepped, then less the old values
            kw["decoupled_weight_decay"] = True
        else:
            old = None
            updates = _zeros_like_each(g)
        members = steps[0].dim() == 1  # member_dims=1: a step count per member (init's or a checked snapshot's)
        if torch.compiler.is_compiling():  # a compiled step (rlfunc.device.compile_step): no host reads
            if members:
                return _traced_member_step(updates, g, m, v, steps, old, mask, kw, lr), state
            return _traced_step(updates, g, m, v, steps, old, mask, kw, lr), state
        if members:
            return _member_step(updates, g, m, v, steps, old, mask, kw), state
        with torch.no_grad():
            bad = None
            if mask is None or bool(mask.all()):
                torch_adam(updates, g, m, v, [], steps, **kw)
            elif mask.numel() > 1:
                bad = (~mask).nonzero().squeeze(-1)
                saved = [(a.index_select(0, bad), b.index_select(0, bad)) for a, b in zip(m, v)]
                g = [x.nan_to_num(0.0, 0.0, 0.0) for x in g]
                torch_adam(updates, g, m, v, [], steps, **kw)
                for a, b, (sa, sb) in zip(m, v, saved):
                    a.index_copy_(0, bad, sa)
                    b.index_copy_(0, bad, sb)
            else:  # one member, skipped: nothing moves
                return _zeros_like_each(g), state
            if old is not None:  # the stepped copies less the old values
                torch._foreach_sub_(updates, old)  # exact where new is within a factor 2 of old (Sterbenz)
            if bad is not None:
                for u in updates:
                    u.index_fill_(0, bad, 0.0)
        return updates, state

    return from_leaves(init, update_leaves)


def _check_lr(lr) -> None:
    """ConfigError / ShapeError for a per-step ``lr`` that :func:`adam`'s ``update`` does not accept.
    Python-level: a tensor's value is not read (that would be a host sync on an accelerator)."""
    if lr is None:
        return
    if isinstance(lr, Tensor):
        if not lr.is_floating_point() or lr.numel() != 1:
            raise ShapeError(f"adam.update: lr is a {lr.dtype} tensor of shape {list(lr.shape)}, "
                             "expected a floating tensor of one element (0-dim)")
        return
    if not isinstance(lr, numbers.Real) or isinstance(lr, bool):
        raise ConfigError(f"adam.update: lr={lr!r}: expected a finite number >= 0 or a 0-dim floating tensor")
    if not (math.isfinite(lr) and lr >= 0):
        raise ConfigError(f"adam.update: lr={lr!r}: expected a finite learning rate >= 0")


def _check_mask(mask, g: list[Tensor], treedef: tuple) -> None:
    """ShapeError unless ``mask`` is a bool tensor on the gradients' device, of one element or of shape
    [S] with S the leading dim of every gradient leaf (shapes and dtypes only: no host read)."""
    if not isinstance(mask, Tensor):
        raise ShapeError(f"adam.update: mask is a {type(mask).__name__}, expected a bool tensor of shape [S] (or [1])")
    if mask.dtype != torch.bool:
        raise ShapeError(f"adam.update: mask has dtype {mask.dtype}, expected torch.bool (one flag per member)")
    if g and mask.device != g[0].device:
        raise ShapeError(f"adam.update: mask is on {mask.device}, expected the gradients' device {g[0].device}")
    if mask.dim() > 1:
        raise ShapeError(f"adam.update: mask has shape {list(mask.shape)}, expected [S] (the members) or [1]")
    if mask.numel() == 1:  # one flag for the whole step
        return
    for i, x in enumerate(g):
        if x.dim() == 0 or x.shape[0] != mask.shape[0]:
            raise ShapeError(f"adam.update: mask has shape {list(mask.shape)}, but leaf {_key(treedef, i)!r} has shape "
                             f"{list(x.shape)}: expected [S] with S the leading (member) dim of every leaf, or [1] for "
                             "unstacked params")


def _traced_step(updates, g, m, v, steps, old, mask, kw, lr):
    """The masked step of ``update_leaves`` without data-dependent branches, for torch.compile:
    ``lr`` may be a 0-dim tensor (one graph for every lr of a schedule); a member with
    ``mask`` False keeps its moments and gets a zero update, and a single member's step count stays
    too, as the eager branches do."""
    # capturable: the bias corrections as tensor ops (the non-capturable foreach path makes host
    # scalars of the step counts, which a trace cannot), also for a float lr
    kw = {**kw, "lr": lr, "capturable": True} if isinstance(lr, Tensor) else {**kw, "capturable": True}
    if mask is None:
        torch_adam(updates, g, m, v, [], steps, **kw)
        if old is not None:
            torch._foreach_sub_(updates, old)
        return updates
    keep = [mask.reshape(()) if x.dim() == 0 else mask.view(-1, *([1] * (x.dim() - 1))) for x in g]  # a 0-dim leaf: one member
    saved = [(a.clone(), b.clone()) for a, b in zip(m, v)]
    saved_steps = [t.clone() for t in steps] if mask.numel() == 1 else None
    g = [torch.where(k, x, torch.zeros_like(x)) for k, x in zip(keep, g)]
    torch_adam(updates, g, m, v, [], steps, **kw)
    if old is not None:
        torch._foreach_sub_(updates, old)
    for k, a, b, u, (sa, sb) in zip(keep, m, v, updates, saved):
        a.copy_(torch.where(k, a, sa))
        b.copy_(torch.where(k, b, sb))
        u.copy_(torch.where(k, u, torch.zeros_like(u)))
    if saved_steps is not None:
        for t, st in zip(steps, saved_steps):
            t.copy_(torch.where(mask.reshape(()), t, st))
    return updates


def _rows(lists, members) -> list[list[Tensor]]:
    """Each list of stacked leaves as the list of its ``members``' rows (views), member-major."""
    out = []
    for xs in lists:
        split = [x.unbind(0) for x in xs]  # one op per leaf for all its rows (indexing was one per row)
        out.append([rows[i] for i in members for rows in split])
    return out


def _member_step(updates, g, m, v, steps, old, mask, kw) -> list[Tensor]:
    """``update_leaves``' eager step with one step count per member (``steps``: [S] per leaf): while
    every member steps and their counts agree, torch's multi-tensor step over the stacked leaves with
    the shared count; otherwise, on the CPU, :func:`_counts_apart_step` (the same arithmetic with a
    bias correction per member), and on an accelerator torch's step over the stepping members' rows
    (views: in place), each with its own count (torch's multi-tensor Adam takes a count per tensor).
    A member ``mask`` leaves out keeps its moments and count and gets a zero update; its gradients
    never reach its parameters."""
    S = steps[0].shape[0]
    with torch.no_grad():
        on = None if mask is None else mask.reshape(-1).expand(S)
        counts = torch.stack(steps)  # [L, S]
        if on is None or bool(on.all()):
            if bool((counts == counts[:, :1]).all()):  # in step: the members' arithmetic, all at once
                shared = list(counts[:, 0].unbind(0))  # 0-dim views of a copy, which torch's adam advances
                torch_adam(updates, g, m, v, [], shared, **kw)
                torch._foreach_add_(steps, 1.0)  # as torch's adam advances a count (float32, exact below 2**24)
                if old is not None:
                    torch._foreach_sub_(updates, old)
                return updates
        if kw["capturable"] or any(x.dtype != g[0].dtype for x in g):  # an accelerator, or mixed dtypes: torch's step
            # on the stepping members' rows, each with its own count
            stepping = range(S) if on is None else on.nonzero().squeeze(-1).tolist()
            if stepping:
                u, gr, a, b, t = _rows((updates, g, m, v, steps), stepping)
                torch_adam(u, gr, a, b, [], t, **kw)
            if old is not None:  # a member not stepped: its copy is its old values, so its update is 0
                torch._foreach_sub_(updates, old)
            return updates
        return _counts_apart_step(updates, g, m, v, steps, counts, old, on, kw)


def _counts_apart_step(updates, g, m, v, steps, counts, old, on, kw) -> list[Tensor]:
    """:func:`_member_step` on the CPU where the members' counts differ or some skip: the arithmetic of
    torch's non-capturable multi-tensor Adam (``torch.optim.adam._multi_tensor_adam``) over the stacked
    leaves, with each member's bias corrections (Python floats of its count, as torch computes them)
    as an [S, 1, ...] column where torch has one scalar per tensor: the same float32 operations, so
    each member's step is the one torch takes on its rows alone (tested bit for bit against
    torch.optim.Adam). A member ``on`` leaves out keeps its moments and count and gets a zero update."""
    S = counts.shape[1]
    lr, b1, b2, eps = kw["lr"], kw["beta1"], kw["beta2"], kw["eps"]
    skipped = None if on is None or bool(on.all()) else (~on).nonzero().squeeze(-1)
    if skipped is not None:
        saved = [(a.index_select(0, skipped), b.index_select(0, skipped)) for a, b in zip(m, v)]
        g = [x.nan_to_num(0.0, 0.0, 0.0) for x in g]  # a skipped member's rows are computed, then put back
        new_counts = counts + on.to(counts.dtype)
    else:
        new_counts = counts + 1.0
    torch._foreach_copy_(steps, list(new_counts.unbind(0)))
    # a member that never stepped (count 0) and skips: any finite value (max 1), its update is 0
    c = [[max(n, 1.0) for n in row] for row in new_counts.tolist()]
    x0 = g[0]
    sizes = torch.tensor([[(lr / (1 - b1 ** n)) * -1 for n in row] for row in c], dtype=x0.dtype, device=x0.device)  # [L, S]
    sqrts = torch.tensor([[(1 - b2 ** n) ** 0.5 for n in row] for row in c], dtype=x0.dtype, device=x0.device)
    column = lambda t, x: t.view(S, *([1] * (x.dim() - 1)))  # noqa: E731  [S, 1, ...] against a leaf [S, ...]
    step_size = [column(t, x) for t, x in zip(sizes.unbind(0), g)]
    bc2_sqrt = [column(t, x) for t, x in zip(sqrts.unbind(0), g)]
    if kw.get("decoupled_weight_decay"):
        torch._foreach_mul_(updates, 1 - lr * kw["weight_decay"])
    torch._foreach_lerp_(m, g, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g, g, 1 - b2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    step = torch._foreach_mul(m, step_size)  # torch's addcdiv: param + value * m / denom, in that order
    torch._foreach_div_(step, denom)
    torch._foreach_add_(updates, step)
    if old is not None:
        torch._foreach_sub_(updates, old)
    if skipped is not None:
        for a, b, u, (sa, sb) in zip(m, v, updates, saved):
            a.index_copy_(0, skipped, sa)
            b.index_copy_(0, skipped, sb)
            u.index_fill_(0, skipped, 0.0)
    return updates


def _traced_member_step(updates, g, m, v, steps, old, mask, kw, lr) -> list[Tensor]:
    """:func:`_member_step` without data-dependent branches, for torch.compile: Adam over the stacked
    leaves with each member's bias corrections as an [S, 1, ...] column of its own count (tensor
    ops, as torch's capturable step computes them), so the graph does not grow with S; a member
    ``mask`` leaves out gets zero gradients, then its moments and count back and a zero update (as
    :func:`_traced_step`). Equal to the eager step to float rounding (tested)."""
    lr = kw["lr"] if lr is None else lr
    b1, b2, eps = kw["beta1"], kw["beta2"], kw["eps"]
    S = steps[0].shape[0]
    on = None if mask is None else mask.reshape(-1).expand(S)
    if on is not None:
        keep = [on.view(-1, *([1] * (x.dim() - 1))) for x in g]
        saved = [(a.clone(), b.clone()) for a, b in zip(m, v)]
        g = [torch.where(k, x, torch.zeros_like(x)) for k, x in zip(keep, g)]
    for t in steps:
        t.add_(1.0 if on is None else on.to(t.dtype))
    if kw.get("decoupled_weight_decay"):
        torch._foreach_mul_(updates, 1 - lr * kw["weight_decay"])
    torch._foreach_lerp_(m, g, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g, g, 1 - b2)
    for u, a, b, t in zip(updates, m, v, steps):
        c = t.clamp_min(1.0).view(S, *([1] * (u.dim() - 1)))  # a member that never stepped and skips: its update is 0 anyway
        step_size = lr / (1 - b1 ** c)
        u.sub_(step_size * a / (b.sqrt() / (1 - b2 ** c).sqrt() + eps))
    if old is not None:
        torch._foreach_sub_(updates, old)
    if on is not None:
        for k, a, b, u, (sa, sb) in zip(keep, m, v, updates, saved):
            a.copy_(torch.where(k, a, sa))
            b.copy_(torch.where(k, b, sb))
            u.copy_(torch.where(k, u, torch.zeros_like(u)))
    return updates


def adam_state_from_torch(torch_state: TensorDictBase, state: TensorDictBase, params: TensorDictBase, *,
                          indices: Sequence[int] | None = None) -> TensorDict:
    """``state`` (an :func:`adam` state, or a :func:`rlfunc.optim.chain` state holding one) with its
    Adam part filled from ``torch_state``, torch.optim.Adam's state as :func:`rlfunc.optim.optimizer_state`
    writes it: ``{"<i>": {"step", "exp_avg", "exp_avg_sq"}}``, i numbering ``params``' leaves in
    :func:`rlfunc.core.func.leaves` order. For snapshots written before the optimizer's state moved into the
    learner state. Returns a new TensorDict; the other links' states are copied from ``state``.

    Args:
        indices: the leaves ``torch_state`` holds entries for (torch.optim keeps none for a leaf that
            never had a gradient); the others keep ``state``'s values (:func:`adam`'s ``init``: zero
            moments and step count, torch.optim's state before a first step). None: every leaf.

    Raises:
        ValueError: ``state`` holds no Adam state, ``torch_state`` has other entries than one per leaf
            of ``indices``, or an entry another shape than its leaf (the key named).
        KeyError: an entry lacks "step", "exp_avg" or "exp_avg_sq".
    """
    out = state.clone()
    names = ("exp_avg", "exp_avg_sq", "step")
    if set(names) <= set(out.keys()):
        target = out
    else:
        parts = [v for v in out.values() if isinstance(v, TensorDictBase) and set(names) <= set(v.keys())]
        if len(parts) != 1:
            raise ValueError(f"the state holds {len(parts)} Adam states, expected one")
        target = parts[0]
    keys = sorted(params.keys(include_nested=True, leaves_only=True), key=str)  # func.leaves order
    if indices is None:
        indices = range(len(keys))
    elif not all(type(i) is int and 0 <= i < len(keys) for i in indices):
        raise ValueError(f"leaf indices {list(indices)} outside the {len(keys)} parameter leaves")
    if set(torch_state.keys()) != {str(i) for i in indices}:
        raise ValueError(f"{len(list(torch_state.keys()))} torch.optim entries for {len(indices)} parameter leaves")
    for i in indices:
        key, entry = keys[i], torch_state[str(i)]
        for name in names:
            value = entry[name]
            want = target[name].get(key)
            if name == "step" and value.dim() == 0 and want.dim() == 1:  # one count per member (member_dims=1): torch.optim's was shared
                value = value.expand(want.shape).clone()  # a count of each member's own (expand alone aliased them)
            if value.shape != want.shape:
                raise ValueError(f"{name} of {key!r} (entry {i}) has shape {list(value.shape)}, expected {list(want.shape)}")
            target[name].set(key, value.to(want.dtype))
    return out


def _zeros_like_each(tensors: list[Tensor]) -> list[Tensor]:
    """Zeros of each tensor's shape, dtype and layout in two multi-tensor ops (a zeros_like per leaf was one
    op each, ~2 us apiece in a small MLP's step); not inside a traced step, where inductor sees the zeros."""
    if torch.compiler.is_compiling():
        return [torch.zeros_like(x, memory_format=torch.preserve_format) for x in tensors]
    out = torch._foreach_mul(tensors, 0.0)  # new tensors; their NaN/inf and -0 values zeroed next
    torch._foreach_zero_(out)
    return out

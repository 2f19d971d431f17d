"""Gradient shaping: composable update transforms and prioritised minibatches, as pure functions.

A transform is optax-style: ``init(params) -> state`` and ``update(updates, state, **context) ->
(new_updates, new_state, metrics)``, all TensorDicts keyed like ``params`` (flat keys such as
``"actor/0/weight"``, :data:`SEP`); :func:`chain` composes them. Every tensor may carry ``member_dims`` leading
member dims (stacked seeds/ensembles: ``[S, *shape]`` with ``member_dims=1``); per-tensor statistics
are then per member, shape ``[S]``. Transforms ignore context they do not use.

``updates`` are parameter steps (``new_params - params``), not raw gradients: Adam divides each
coordinate by its own running RMS, so a per-tensor factor on the gradient before Adam is (nearly)
undone by it. :func:`shape_steps` therefore makes Adam and the transforms after it one link of
:mod:`rlfunc.optim.base`'s chain, whose state the learner owns (:mod:`rlfunc.algos.shaped` builds it
for :mod:`rlfunc.algos.ppo` and :mod:`rlfunc.algos.grpo`).

Transforms
- :func:`oscillation_damping`: per tensor, the sign agreement of successive gradients
  ``a = EMA(mean(sign(g_t) * sign(g_{t-1})))`` in [-1, 1] (Rprop's signal, Riedmiller & Braun
  1993) scales the step by ``1 + strength * min(a, 0)`` (oscillating tensors slow down, consistent
  ones are untouched), times a curvature factor ``1 / (1 + lr * max(c, 0) / rms(g))`` where ``c`` is
  the Hutchinson estimate (Hutchinson 1989) of the mean of the tensor's Hessian diagonal from a
  double-backward Hessian-vector product on a Rademacher probe (as AdaHessian, Yao et al. 2021),
  refreshed every ``hessian_interval`` updates. ``lr / rms(g)`` is Adam's effective per-coordinate
  step size, so ``lr * c / rms(g)`` is the step's curvature in Newton units (SGD's stability
  condition is ``lr * c < 2``).
- :func:`layer_trust_region`: per-layer clip radius. Each policy tensor l gets a radius
  ``r_l = epsilon_t * share_l / s_l`` around its value at the start of the policy update (the
  "anchor"), where ``s_l = sqrt(mean_i ||d log pi(a_i|s_i) / d theta_l||^2)`` is the RMS over samples
  of the per-sample log-likelihood gradient norm (the layer's sensitivity: first-order change of the
  log-ratio per unit parameter step) and ``share_l = 1 / L`` over the L tensors with ``s_l > 0``.
  Steps are projected so that ``||theta_l - anchor_l|| <= r_l``; then by Cauchy-Schwarz and the
  triangle inequality the RMS over samples of the predicted (first-order) log-ratio change
  ``|sum_l g_il . (theta_l - anchor_l)|`` is at most ``sum_l s_l r_l = epsilon_t``. The ratio clip
  itself decays as ``epsilon_t = epsilon_0 * decay^t`` (:func:`decayed_clip_epsilon`), t counting
  policy updates (PPO iterations).

Prioritised minibatches (Schaul et al. 2016, "Prioritized Experience Replay", sec. 3.3 and 3.4):
priorities ``p_i = (m_i + eps)^alpha / sum_j (m_j + eps)^alpha`` from per-sample gradient magnitudes
m_i, sampling with replacement from a ``torch.Generator``, importance weights
``w_i = (N p_i)^-beta / max_j (N p_j)^-beta``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.core import func
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.optim.base import GradientTransform, flatten, from_leaves, leaves_at, tree_keys, update_leaves_of

Generators = torch.Generator | Sequence[torch.Generator]
SEP = "/"  # joins nested parameter keys into flat ones ("actor/0/weight"); snapshots reserve "."


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(updates, state, **context) -> (updates, state, metrics)``."""

    init: Callable[..., TensorDict]
    update: Callable[..., tuple[TensorDict, TensorDict, TensorDict]]


def _td(tensors: dict[str, Tensor]) -> TensorDict:
    return TensorDict(tensors, batch_size=[])


def tensor_mean(t: Tensor, member_dims: int) -> Tensor:
    """Mean over every dim after the first ``member_dims``: ``[*M, ...] -> [*M]``."""
    return t.mean(dim=tuple(range(member_dims, t.dim()))) if t.dim() > member_dims else t


def tensor_norm(t: Tensor, member_dims: int) -> Tensor:
    """L2 norm over every dim after the first ``member_dims``: ``[*M, ...] -> [*M]``."""
    return t.square().sum(dim=tuple(range(member_dims, t.dim()))).sqrt() if t.dim() > member_dims else t.abs()


def _expand(factor: Tensor, like: Tensor) -> Tensor:
    return factor.reshape(*factor.shape, *([1] * (like.dim() - factor.dim())))


def _check_member_dims(member_dims: int) -> None:
    if member_dims not in (0, 1):
        raise ConfigError(f"member_dims={member_dims}: expected 0 (one parameter set) or 1 (stacked members)")


# ----------------------------------------------------------------------------- composition


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order; the state is ``{"0": state_0, "1": state_1, ...}`` and the
    metrics are merged (later transforms win on a repeated name). Context reaches every transform."""

    def init(params: TensorDictBase, **context) -> TensorDict:
        return _td({str(i): t.init(params, **context) for i, t in enumerate(transforms)})

    def update(updates: TensorDictBase, state: TensorDictBase, **context):
        new_state, metrics = {}, {}
        for i, t in enumerate(transforms):
            updates, new_state[str(i)], m = t.update(updates, state[str(i)], **context)
            metrics.update(m.items())
        return updates, _td(new_state), _td(metrics)

    return GradientTransformation(init, update)


def shape_steps(inner: GradientTransform, transform: GradientTransformation, metrics: Sequence[str],
                member_dims: int = 0) -> GradientTransform:
    """``inner`` (Adam: gradients in, parameter steps out), then ``transform`` on the step it took: one
    link of :func:`rlfunc.optim.base.chain`, e.g. ``chain(clip, shape_steps(adam(lr), transform, ...))``.

    The link wraps ``inner`` instead of following it because the transforms read the gradients
    ``inner`` saw (the sign agreement and RMS of :func:`oscillation_damping`), which a later link of
    the chain would not get; placed after the clip, both see the clipped gradients.

    State: ``{"inner": inner's, "transform": transform's (flat keys, :data:`SEP`), "step": 0-dim int64
    (updates taken), "metrics": {name: [*M]}}``, the last update's ``metrics`` (0 before the first;
    a metric the transform did not give keeps its last value). ``update`` reads ``params`` (the values
    before the step; :func:`layer_trust_region` projects from them) and ``curvature`` (flat keys, per
    tensor ``[*M]``, :func:`hutchinson_curvature`; None: the stored estimate) from its arguments; the
    other ``extra`` (``lr``, ``grad_norm``) reach ``inner``. ``mask`` (bool ``[*M]``, as Adam's) reaches
    ``inner`` too, and a member it leaves out (a skipped update) keeps its part of the transforms'
    state and metrics and gets a zero step (its counts too, such as :func:`oscillation_damping`'s
    "count"); the shared counter "step" advances when any member steps. Gradients of a subset of
    the params' leaves (frozen ones left out) step and shape that subset.

    Raises:
        ConfigError: ``update`` without ``params``.
    """
    _check_member_dims(member_dims)

    def init(params: TensorDictBase) -> TensorDict:
        leaves, treedef = flatten(params)
        names = [SEP.join(k) for k in tree_keys(treedef)]
        member = leaves[0].shape[:member_dims] if leaves else torch.Size([])
        device = params.device if params.device is not None else _device(params)
        return TensorDict({
            "inner": inner.init(params),
            "transform": transform.init(_td({n: t.detach() for n, t in zip(names, leaves)})),
            "step": torch.zeros((), dtype=torch.int64, device=device),
            "metrics": _td({m: torch.zeros(member, device=device) for m in metrics}),
        }, batch_size=[], device=params.device)

    def update_leaves(grads: list[Tensor], treedef: tuple, state: TensorDictBase, params: TensorDictBase | None = None,
                      *, curvature: TensorDictBase | None = None, **extra):
        if params is None:
            raise ConfigError("shape_steps.update: params=... (the parameters before the step) is required")
        steps, inner_state = update_leaves_of(inner, grads, treedef, state["inner"], params, **extra)
        names = [SEP.join(k) for k in tree_keys(treedef)]
        before = leaves_at(params, treedef, "shape_steps")
        with torch.no_grad():
            shaped, new_transform, m = transform.update(
                _td(dict(zip(names, steps))), state["transform"], grads=_td({n: g.detach() for n, g in zip(names, grads)}),
                curvature=curvature, params=_td({n: p.detach() for n, p in zip(names, before)}),
            )
        last = state["metrics"]
        new_metrics = _td({k: m.get(k).detach() if k in m.keys() else last.get(k) for k in last.keys()})
        out = [shaped.get(n) for n in names]
        mask = extra.get("mask", None)
        if mask is not None:  # skipped members: their old state, no step
            keep = lambda new, old: _where_members(mask, new, old)  # noqa: E731
            new_transform = new_transform.apply(keep, state["transform"])
            new_metrics = new_metrics.apply(keep, last)
            out = [_where_members(mask, u, torch.zeros_like(u)) for u in out]
        step = state["step"] + (1 if mask is None else mask.any().to(state["step"].dtype))
        new_state = TensorDict({"inner": inner_state, "transform": new_transform, "step": step,
                                "metrics": new_metrics}, batch_size=[], device=state.device)
        return out, new_state

    return from_leaves(init, update_leaves)


def _where_members(mask: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """``new`` for the members ``mask`` [*M] keeps, ``old`` for the others: per member where the
    tensor leads with the member dims, else (a counter shared by the members) ``new`` if any is kept."""
    m = mask.dim()
    if m and new.dim() >= m and new.shape[:m] == mask.shape:
        return torch.where(mask.reshape(*mask.shape, *([1] * (new.dim() - m))), new, old)
    return torch.where(mask.any(), new, old)


# ----------------------------------------------------------------------------- curvature


def rademacher_like(params: TensorDictBase, generator: Generators, member_dims: int = 0) -> TensorDict:
    """A Rademacher probe v (entries +-1 with probability 1/2 each), shaped and typed like ``params``.

    Args:
        params: TensorDict of float tensors ``[*M, *shape]``.
        generator: one ``torch.Generator``, or with ``member_dims=1`` one per member (members draw
            independently, so a member's probe depends only on its own generator).
        member_dims: 0 or 1.

    Raises:
        ConfigError: the number of generators does not match the member dim.
    """
    _check_member_dims(member_dims)
    keys = sorted(params.keys(include_nested=True, leaves_only=True), key=str)
    if isinstance(generator, torch.Generator):
        gens = None
    else:
        gens = list(generator)
        sizes = {params.get(k).shape[0] for k in keys} if member_dims else {1}
        if member_dims != 1 or sizes != {len(gens)}:
            raise ConfigError(f"generator: {len(gens)} generators given, expected one per member (sizes {sizes})")

    def draw(t: Tensor, g: torch.Generator) -> Tensor:
        return torch.randint(0, 2, t.shape, generator=g, device=t.device).to(t.dtype).mul_(2).sub_(1)

    out = {}
    for k in keys:
        t = params.get(k)
        out[k] = draw(t, generator) if gens is None else torch.stack([draw(t[m], g) for m, g in enumerate(gens)])
    return TensorDict(out, batch_size=[])


def hessian_vector_product(grads: Sequence[Tensor], params: Sequence[Tensor], vector: Sequence[Tensor]) -> list[Tensor]:
    """``H v`` by double backward: ``d (g . v) / d theta`` with ``g = d loss / d theta``.

    Args:
        grads: the loss's gradients w.r.t. ``params``, computed with ``create_graph=True``.
        params: the tensors the gradients are taken w.r.t. (autograd leaves or graph nodes).
        vector: v, one tensor per param, same shapes.

    Returns:
        ``H v``, one tensor per param (zeros where the gradient does not depend on that param).

    Built on ``torch.autograd.grad`` only (no ``torch.func.jvp`` / ``hessian``, which torch_npu
    lacks); the graph is retained so several products can share it. Pearlmutter (1994).

    Raises:
        ShapeError: the three sequences differ in length or shapes.
    """
    if not len(grads) == len(params) == len(vector):
        raise ShapeError(f"hessian_vector_product: {len(grads)} grads, {len(params)} params, {len(vector)} vectors")
    for g, v in zip(grads, vector):
        if g.shape != v.shape:
            raise ShapeError(f"hessian_vector_product: vector shape {tuple(v.shape)} != gradient shape {tuple(g.shape)}")
    hv = torch.autograd.grad(list(grads), list(params), grad_outputs=list(vector), retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if h is None else h for h, p in zip(hv, params)]


def hutchinson_curvature(hvp: Sequence[Tensor], probe: Sequence[Tensor], member_dims: int = 0) -> list[Tensor]:
    """Per tensor l, ``c_l = v_l . (H v)_l / |v_l|^2``: an unbiased estimate of the mean of the
    diagonal of H's block l over Rademacher probes v (Hutchinson 1989), exact when H is diagonal.

    Args:
        hvp: ``H v`` per tensor ``[*M, *shape]`` (:func:`hessian_vector_product`).
        probe: v per tensor, same shapes (:func:`rademacher_like`).

    Returns:
        One ``[*M]`` tensor per param (units of loss / param^2).
    """
    _check_member_dims(member_dims)
    return [tensor_mean(h * v, member_dims) / tensor_mean(v * v, member_dims).clamp_min(1e-30) for h, v in zip(hvp, probe)]


# ----------------------------------------------------------------------------- oscillation damping


def oscillation_damping(
    lr: float, *, strength: float = 0.5, agreement_decay: float = 0.9, rms_decay: float = 0.999,
    member_dims: int = 0, eps: float = 1e-8,
) -> GradientTransformation:
    """Per-tensor damping of steps from sign agreement and curvature (see the module docstring).

    Args:
        lr: the optimizer's step size (Adam's lr): converts curvature into Newton units, > 0.
        strength: in [0, 1]; a fully oscillating tensor (a = -1) steps by ``1 - strength``.
            Rprop's decrease factor is 0.5 (Riedmiller & Braun 1993).
        agreement_decay: EMA factor of the sign agreement, in [0, 1).
        rms_decay: EMA factor of the tensor's mean squared gradient (Adam's beta2), in [0, 1).
        member_dims: leading member dims of every tensor (0 or 1).

    ``update(updates, state, grads=None, curvature=None)``: ``grads`` (the raw gradients, default
    ``updates``) feed the sign agreement and the RMS; ``curvature`` (per tensor ``[*M]``, from
    :func:`hutchinson_curvature`), when given, replaces the stored estimate (start: 0, no damping).
    Metrics: ``sign_agreement`` and ``damping`` (mean over tensors, ``[*M]``).

    Raises:
        ConfigError: a hyperparameter is out of range.
    """
    if not lr > 0:
        raise ConfigError(f"lr={lr}: expected > 0")
    if not 0 <= strength <= 1:
        raise ConfigError(f"strength={strength}: expected a value in [0, 1]")
    for name, v in (("agreement_decay", agreement_decay), ("rms_decay", rms_decay)):
        if not 0 <= v < 1:
            raise ConfigError(f"{name}={v}: expected a value in [0, 1)")
    _check_member_dims(member_dims)

    fields = ("prev_sign", "agreement", "curvature", "grad_sq")  # state: one TensorDict per field, keyed by tensor

    def init(params: TensorDictBase, **_) -> TensorDict:
        state = {f: {} for f in fields}
        for k, p in params.items():
            state["prev_sign"][k] = torch.zeros_like(p)
            for f in fields[1:]:
                state[f][k] = p.new_zeros(p.shape[:member_dims])
        first = next(iter(params.values()), None)  # the member dims' sizes (every tensor leads with them)
        count = torch.zeros(() if first is None else first.shape[:member_dims], dtype=torch.int64, device=_device(params))
        return _td({**{f: _td(v) for f, v in state.items()}, "count": count})

    def update(updates: TensorDictBase, state: TensorDictBase, *, grads: TensorDictBase | None = None,
               curvature: TensorDictBase | None = None, **_):
        # all tensors at once: flattened to [*M, P] with a tensor id per entry (segment sums), a few
        # dozen ops per step whatever the number of tensors
        names = list(updates.keys())
        grads = updates if grads is None else grads
        old = {f: dict(state[f].items()) for f in fields}
        g = torch.cat([grads.get(k).detach().flatten(member_dims) for k in names], -1)  # [*M, P]
        sizes = [old["prev_sign"][k][(0,) * member_dims].numel() for k in names]
        seg = torch.repeat_interleave(torch.arange(len(names), device=g.device), torch.tensor(sizes, device=g.device))
        numel = torch.tensor(sizes, dtype=g.dtype, device=g.device)

        def segment_mean(x: Tensor) -> Tensor:  # [*M, P] -> [*M, L]
            return x.new_zeros(*x.shape[:-1], len(names)).index_add_(-1, seg, x) / numel

        stack = lambda f: torch.stack([old[f][k] for k in names], -1)  # noqa: E731  [*M, L]
        sign = g.sign()
        prev = torch.cat([old["prev_sign"][k].flatten(member_dims) for k in names], -1)
        count = state["count"] + 1
        a = agreement_decay * stack("agreement") + (1 - agreement_decay) * segment_mean(sign * prev)
        grad_sq = rms_decay * stack("grad_sq") + (1 - rms_decay) * segment_mean(g.square())
        if curvature is None:
            c = stack("curvature")
        else:
            c = torch.stack([curvature.get(k).detach().to(g.dtype) for k in names], -1)
        bias = (1.0 - rms_decay ** count.to(g.dtype)).unsqueeze(-1)  # [*M, 1]: each member's own steps
        newton = lr * c.clamp_min(0) / ((grad_sq / bias).sqrt() + eps)
        factor = (1 + strength * a.clamp(max=0)) / (1 + newton)  # [*M, L]
        u = torch.cat([updates.get(k).flatten(member_dims) for k in names], -1) * factor.index_select(-1, seg)
        new = {f: dict(v) for f, v in old.items()}  # frozen tensors (not in updates) keep their state
        for i, (k, piece, sg) in enumerate(zip(names, u.split(sizes, -1), sign.split(sizes, -1))):
            shape = old["prev_sign"][k].shape
            new["prev_sign"][k] = sg.reshape(shape)
            new["agreement"][k], new["curvature"][k], new["grad_sq"][k] = a[..., i], c[..., i], grad_sq[..., i]
        out = {k: piece.reshape(old["prev_sign"][k].shape) for k, piece in zip(names, u.split(sizes, -1))}
        metrics = {"sign_agreement": a.mean(-1), "damping": factor.mean(-1)}
        return _td(out), _td({**{f: _td(v) for f, v in new.items()}, "count": count}), _td(metrics)

    return GradientTransformation(init, update)


def _device(td: TensorDictBase) -> torch.device:
    for v in td.values(include_nested=True, leaves_only=True):
        return v.device
    return torch.device("cpu")


# ----------------------------------------------------------------------------- adaptive clip radius


def decayed_clip_epsilon(base: float, decay: float, t: int | Tensor) -> float | Tensor:
    """``epsilon_t = base * decay^t``: the ratio clip after t policy updates (0.2 * 0.995^t in the
    shaped preset). Raises ConfigError unless base > 0 and 0 < decay <= 1."""
    if not base > 0 or not 0 < decay <= 1:
        raise ConfigError(f"clip epsilon base={base}, decay={decay}: expected base > 0 and decay in (0, 1]")
    return base * decay**t


def layer_sensitivity(per_sample_grads: TensorDictBase, member_dims: int = 0) -> TensorDict:
    """``s_l = sqrt(mean_i ||d log pi(a_i|s_i) / d theta_l||^2)`` per tensor l.

    Args:
        per_sample_grads: per tensor ``[*M, N, *shape]``: the gradient of each sample's log-likelihood
            (:func:`per_sample_grads`).

    Returns:
        per tensor ``[*M]`` float (units of log-prob per unit param norm); 0 for tensors the policy
        does not use.
    """
    _check_member_dims(member_dims)
    out = {}
    for k, g in per_sample_grads.items():
        sq = g.square().sum(dim=tuple(range(member_dims + 1, g.dim()))) if g.dim() > member_dims + 1 else g.square()
        out[k] = sq.mean(member_dims).sqrt()
    return _td(out)


def layer_radius(sensitivity: TensorDictBase, epsilon: float | Tensor) -> TensorDict:
    """``r_l = epsilon / (L s_l)`` with L the number of tensors whose ``s_l > 0`` (per member);
    ``inf`` where ``s_l == 0`` (the tensor cannot change the log-ratio to first order).

    Then ``sum_l s_l r_l = epsilon``: the predicted log-ratio change stays within epsilon when every
    tensor stays within its radius (module docstring)."""
    s = dict(sensitivity.items())
    if not s:
        return _td({})
    used = torch.stack([(v > 0).to(v.dtype) for v in s.values()]).sum(0).clamp_min(1)
    return _td({k: torch.where(v > 0, epsilon / (used * v.clamp_min(1e-30)), torch.full_like(v, float("inf"))) for k, v in s.items()})


def layer_trust_region(member_dims: int = 0) -> GradientTransformation:
    """Project steps so each tensor stays within its radius of its anchor: with displacement
    ``D = params - anchor`` and step u, the new step is ``u' = P * min(1, r / ||P||) - D`` where
    ``P = D + u`` (so ``||params + u' - anchor|| <= r``, and ``u' = u`` inside the ball).

    ``init(params, radius=None)``: the anchor is a copy of ``params``; ``radius`` per tensor ``[*M]``
    (:func:`layer_radius`), missing keys or None: unbounded. Call ``init`` again at the start of each
    policy update (new anchor, new radii). ``update(updates, state, params=...)`` needs the current
    params. Metric ``trust_clip_fraction``: the share of tensors whose step was shortened, ``[*M]``.

    Raises:
        ConfigError: ``params`` is not passed to ``update``.
    """
    _check_member_dims(member_dims)

    def init(params: TensorDictBase, *, radius: TensorDictBase | None = None, **_) -> TensorDict:
        out = {}
        for k, p in params.items():
            r = radius.get(k) if radius is not None and k in radius.keys() else None
            r = p.new_full(p.shape[:member_dims], float("inf")) if r is None else r.detach().to(p.dtype)
            out[k] = _td({"anchor": p.detach().clone(), "radius": r})
        return _td(out)

    def update(updates: TensorDictBase, state: TensorDictBase, *, params: TensorDictBase | None = None, **_):
        if params is None:
            raise ConfigError("layer_trust_region.update: params=... (the current parameters) is required")
        out, clipped = {}, []
        for k, u in updates.items():
            s = state[k]
            d = params.get(k).detach() - s["anchor"]
            proposed = d + u
            n = tensor_norm(proposed, member_dims)
            factor = torch.where(n > s["radius"], s["radius"] / n.clamp_min(1e-30), torch.ones_like(n))
            out[k] = proposed * _expand(factor, proposed) - d
            clipped.append((factor < 1).to(u.dtype))
        metrics = {"trust_clip_fraction": torch.stack(clipped).mean(0)} if clipped else {}
        return _td(out), state, _td(metrics)

    return GradientTransformation(init, update)


# ----------------------------------------------------------------------------- prioritised sampling


def per_sample_grads(fn: Callable[..., Tensor], params: TensorDictBase, *inputs: Tensor,
                     use_loop: bool | None = None, device: torch.device | None = None) -> TensorDict:
    """Gradient of ``fn(params, *sample)`` (a 0-dim loss of one sample) w.r.t. ``params`` for every
    sample: ``torch.func.grad`` mapped over dim 0 of ``inputs`` with :func:`rlfunc.core.func.vmap` (a loop
    where vmap is missing). Returns per key of ``params`` ``[N, *shape]``."""
    keys = list(params.keys(include_nested=True, leaves_only=True))
    flat = {SEP.join(k) if isinstance(k, tuple) else k: params.get(k).detach() for k in keys}

    def one(p: dict, *sample: Tensor) -> dict:
        return torch.func.grad(lambda q: fn(TensorDict(q, batch_size=[]).unflatten_keys(SEP), *sample))(p)

    grads = func.vmap(one, in_dims=(None, *([0] * len(inputs))), use_loop=use_loop, device=device)(flat, *inputs)
    return _td(dict(grads))


def priorities(magnitude: Tensor, alpha: float, eps: float = 1e-6) -> Tensor:
    """``p_i = (m_i + eps)^alpha / sum_j (m_j + eps)^alpha`` over the last dim.

    Args:
        magnitude: ``[*M, N]`` float >= 0, e.g. per-sample gradient norms.
        alpha: >= 0; 0 is uniform sampling, 1 is proportional.

    Raises:
        ConfigError: alpha < 0 or eps <= 0.  ShapeError: a magnitude is negative or not finite.
    """
    if not alpha >= 0 or not eps > 0:
        raise ConfigError(f"alpha={alpha}, eps={eps}: expected alpha >= 0 and eps > 0")
    if not bool(torch.isfinite(magnitude).all()) or bool((magnitude < 0).any()):
        raise ShapeError("priorities: magnitude must be finite and >= 0")
    w = (magnitude + eps).pow(alpha)
    return w / w.sum(-1, keepdim=True)


def sample_prioritized(probs: Tensor, num_samples: int, generator: Generators) -> Tensor:
    """``num_samples`` indices drawn with replacement from ``probs`` ``[N]`` (or ``[M, N]`` with one
    generator per member): int64 ``[num_samples]`` / ``[M, num_samples]``."""
    if probs.dim() == 1:
        return torch.multinomial(probs, num_samples, replacement=True, generator=generator)
    gens = list(generator) if not isinstance(generator, torch.Generator) else None
    if gens is None or len(gens) != probs.shape[0]:
        raise ConfigError(f"sample_prioritized: probs {tuple(probs.shape)} needs one generator per member")
    return torch.stack([torch.multinomial(p, num_samples, replacement=True, generator=g) for p, g in zip(probs, gens)])


def importance_weights(probs: Tensor, beta: float) -> Tensor:
    """``w_i = (N p_i)^-beta / max_j (N p_j)^-beta`` over the last dim (N entries): in (0, 1], 1 at
    the least likely sample (Schaul et al. 2016, sec. 3.4).

    Args:
        probs: ``[*M, N]`` float, the sampling probabilities p_i (e.g. :func:`priorities`); finite,
            and > 0 when ``beta`` > 0.
        beta: in [0, 1]; 0 is no correction (all weights 1), 1 the full correction of the sampling bias.

    Raises:
        ConfigError: ``beta`` outside [0, 1].
        ShapeError: ``probs`` is not a float tensor, holds a negative, NaN or inf value, or a 0 with
            ``beta`` > 0: (N p_i)^-beta is then infinite and the max-normalised weights are 0 for
            every sample that can be drawn (NaN for the impossible one), and no finite weight
            corrects for a sample that is never drawn. Keep every p_i > 0, as :func:`priorities`'
            ``eps`` does (Schaul et al.'s epsilon).
    """
    if not 0 <= beta <= 1:
        raise ConfigError(f"beta={beta}: expected a value in [0, 1]")
    if not isinstance(probs, Tensor) or probs.ndim == 0 or not probs.is_floating_point():
        raise ShapeError(f"importance_weights: probs: expected a float tensor [*M, N], got "
                         f"{getattr(probs, 'shape', type(probs).__name__)} {getattr(probs, 'dtype', '')}")
    if not bool((torch.isfinite(probs) & ((probs > 0) if beta > 0 else (probs >= 0))).all()):
        raise ShapeError(f"importance_weights: probs: expected finite probabilities {'> 0 (beta > 0)' if beta > 0 else '>= 0'}, "
                         f"got min {float(probs.min())}, max {float(probs.max())}")
    n = probs.shape[-1]
    w = (n * probs).pow(-beta)
    return w / w.amax(-1, keepdim=True)

"""The gradient-shaping transforms of :mod:`rlfunc.optim.shaping` wired into a PPO-style minibatch loop.

Used by :mod:`rlfunc.algos.ppo` and :mod:`rlfunc.algos.grpo` (GRPO/GSPO) when a config turns a
transform on (all are off by default); the configs share the field names read here:
``oscillation_damping``, ``damping_strength``, ``hessian_interval``, ``adaptive_clip``,
``clip_epsilon_decay``, ``trust_radius_scale`` and ``lr``. Parameters carry a leading seed dim S (``member_dims=1``).

Per gradient step the update chain is ``chain(clip, shape_steps(adam, transforms))``
(:func:`optimizer`): Adam steps on the clipped gradients, and the step it takes goes through the
transforms (oscillation damping, then the per-layer trust region, whose projection must come last
for its bound to hold) before it is applied. Every ``hessian_interval``-th step the gradients are
taken with ``create_graph=True`` and one double-backward Hessian-vector product on a Rademacher
probe (drawn from each seed's generator) refreshes the per-tensor curvature estimate, passed to the
chain as ``curvature``.

Prioritised minibatches are PPO's alone (:mod:`rlfunc.algos.ppo`: priorities from per-sample
loss-gradient norms, importance weights through ``ppo_loss(sample_weight=...)``); GRPO/GSPO
aggregate per-step terms over episodes of unequal length and take the two step transforms only.

The shaping state is the chain's link :data:`LINK` of the learner's "optim": ``"inner"`` (Adam's),
``"transform"`` (the transforms'), ``"step"`` (0-dim int64, gradient steps taken) and ``"metrics"``,
so checkpoints and resume carry it. (Snapshots from before it was a link keep it as the learner's
"shaping"; :func:`rlfunc.run.resume.with_shaping_in_chain` converts them on load.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.errors import ConfigError
from rlfunc.optim import shaping
from rlfunc.optim.base import GradientTransform, chain


def check_config(config) -> None:
    """ConfigError naming the first step-shaping field of ``config`` (PPOConfig, GRPOConfig) out of range."""
    if config.hessian_interval < 1 or not 0 <= config.damping_strength <= 1 or not 0 < config.clip_epsilon_decay <= 1:
        raise ConfigError(
            f"hessian_interval={config.hessian_interval}, damping_strength={config.damping_strength}, clip_epsilon_decay="
            f"{config.clip_epsilon_decay}: expected >= 1, in [0, 1] and in (0, 1]"
        )
    if not (config.trust_radius_scale > 0 and math.isfinite(config.trust_radius_scale)):
        raise ConfigError(f"trust_radius_scale={config.trust_radius_scale}: expected a finite value > 0")


# (switch, on, the fields it reads) of the shaping fields, for rlfunc.config.check_dependents
DEPENDENTS = (
    ("oscillation_damping", lambda c: c.oscillation_damping, ("damping_strength", "hessian_interval")),
    ("adaptive_clip", lambda c: c.adaptive_clip, ("clip_epsilon_decay", "trust_radius_scale")),
)


def make_transform(config) -> shaping.GradientTransformation | None:
    """The chain ``config`` asks for (damping, then the trust region), or None when both are off."""
    parts = []
    if config.oscillation_damping:
        parts.append(shaping.oscillation_damping(config.lr, strength=config.damping_strength, member_dims=1))
    if config.adaptive_clip:
        parts.append(shaping.layer_trust_region(member_dims=1))
    return shaping.chain(*parts) if parts else None


LINK = "1"  # the shaping link's key in the chain's state: chain(clip, shape_steps(adam, ...))


def optimizer(config, clip: GradientTransform, inner: GradientTransform) -> GradientTransform:
    """``chain(clip, inner)``, with ``inner`` (Adam) wrapped in the step transforms ``config`` turns on
    (:func:`rlfunc.optim.shaping.shape_steps`; parameters with a leading seed dim)."""
    transform = make_transform(config)
    if transform is None:
        return chain(clip, inner)
    names = (("sign_agreement", "damping") if config.oscillation_damping else ()) + \
        (("trust_clip_fraction",) if config.adaptive_clip else ())
    return chain(clip, shaping.shape_steps(inner, transform, names, member_dims=1))


def metrics_of(optim_state: TensorDictBase) -> dict[str, Tensor]:
    """The shaping link's metrics of the last step (per seed ``[S]``)."""
    return dict(optim_state[LINK, "metrics"].items())


def flat_name(key: str | tuple[str, ...]) -> str:
    """A parameter key as the transforms' flat name: ("actor", "0", "weight") -> "actor/0/weight"."""
    return shaping.SEP.join(key) if isinstance(key, tuple) else key


def trainable(params: TensorDictBase, frozen: Collection[str] = ()) -> tuple[list[str], list[Tensor]]:
    """Flat names ("actor/0/weight") and tensors of ``params``' trainable leaves (requiring grad, not
    named in ``frozen``: a freeze mask, :mod:`rlfunc.run.ppo`), in ``func.leaves`` order."""
    keys = sorted(params.keys(include_nested=True, leaves_only=True), key=str)
    names, leaves = [], []
    for k in keys:
        t, name = params.get(k), flat_name(k)
        if t.requires_grad and name not in frozen:
            names.append(name)
            leaves.append(t)
    return names, leaves


def clip_epsilon(config, base: float, iteration: Tensor | int) -> float:
    """``base * clip_epsilon_decay^iteration`` with ``adaptive_clip``, else ``base``."""
    if not config.adaptive_clip:
        return base
    return float(shaping.decayed_clip_epsilon(base, config.clip_epsilon_decay, int(iteration)))


def begin_update(config, optim_state: TensorDictBase, params: TensorDictBase, log_prob_grads: TensorDictBase | None,
                 epsilon: float) -> TensorDictBase:
    """At the start of a policy update: the chain's state ``optim_state`` with the trust region
    re-anchored at ``params``, radii ``trust_radius_scale * epsilon / (L s_l)`` from the per-sample
    log-likelihood gradients ``log_prob_grads`` (flat keys, ``[S, N, *shape]``). Every leaf is
    anchored, so the state keeps its structure; a leaf without gradients there (a frozen one, which
    does not move) gets no bound. The other transforms' states are carried over."""
    if not config.adaptive_clip:
        return optim_state
    names, leaves = trainable(params)
    flat = TensorDict({n: t.detach() for n, t in zip(names, leaves)}, batch_size=[])
    radius = shaping.layer_radius(shaping.layer_sensitivity(log_prob_grads, member_dims=1), epsilon * config.trust_radius_scale)
    link = optim_state[LINK].clone(recurse=False)
    transform = link["transform"].clone(recurse=False)
    index = str(int(config.oscillation_damping))  # the trust region is the transforms' last part
    transform[index] = shaping.layer_trust_region(member_dims=1).init(flat, radius=radius)
    link["transform"] = transform
    out = optim_state.clone(recurse=False)
    out[LINK] = link
    return out


def stacked_per_sample_grads(fn: Callable[..., Tensor], params: TensorDictBase, *inputs: Tensor, device=None,
                             use_loop: bool | None = None, frozen: Collection[str] = ()) -> TensorDict:
    """:func:`rlfunc.optim.shaping.per_sample_grads` for each seed s of ``params`` [S, ...] on ``inputs[i][s]``
    ``[S, N, ...]``, over the trainable leaves only (:func:`trainable`): flat keys, ``[S, N, *shape]``."""
    names, _ = trainable(params, frozen)
    per_seed = []
    for s in range(params.batch_size[0] if params.batch_size else next(iter(params.values(True, True))).shape[0]):
        member = params[s] if params.batch_size else params.apply(lambda t, s=s: t[s])
        g = shaping.per_sample_grads(fn, member, *(x[s] for x in inputs), use_loop=use_loop, device=device)
        per_seed.append({n: g[n] for n in names})
    return TensorDict({n: torch.stack([g[n] for g in per_seed]) for n in names}, batch_size=[])


def gradients(loss: Tensor, leaves: Sequence[Tensor], with_curvature: bool):
    """``d loss / d leaves``, set as each leaf's ``.grad``; with ``with_curvature`` also the graph of
    the gradients (``create_graph=True``) for a Hessian-vector product. Returns the gradient list
    (graph-carrying when asked)."""
    if not with_curvature:
        loss.backward(inputs=list(leaves))  # no gradient for the other leaves (frozen ones)
        return [p.grad for p in leaves]
    grads = torch.autograd.grad(loss, list(leaves), create_graph=True, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, leaves)]
    for p, g in zip(leaves, grads):
        p.grad = g.detach().clone()
    return grads


def curvature(graph_grads: Sequence[Tensor], leaves: Sequence[Tensor], names: Sequence[str],
              generators: Sequence[torch.Generator]) -> TensorDict:
    """Hutchinson's per-tensor, per-seed curvature ``[S]`` from one double-backward product."""
    probe_td = shaping.rademacher_like(
        TensorDict({n: p.detach() for n, p in zip(names, leaves)}, batch_size=[]), list(generators), member_dims=1
    )
    probe = [probe_td[n] for n in names]
    hv = shaping.hessian_vector_product(graph_grads, leaves, probe)
    c = [torch.nan_to_num(x, 0.0, 0.0, 0.0) for x in shaping.hutchinson_curvature([h.detach() for h in hv], probe, member_dims=1)]
    return TensorDict(dict(zip(names, c)), batch_size=[])


def curvature_due(config, optim_state: TensorDictBase) -> bool:
    """Whether this gradient step refreshes the curvature estimate (every ``hessian_interval``-th)."""
    return bool(config.oscillation_damping) and int(optim_state[LINK, "step"]) % config.hessian_interval == 0

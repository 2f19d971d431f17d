"""The gradient-shaping transforms of :mod:`rlfunc.optim.shaping` wired into a PPO-style minibatch loop.

Used by :mod:`rlfunc.algos.ppo` and :mod:`rlfunc.algos.grpo` (GRPO/GSPO) when a config turns a
transform on (all are off by default); the configs share the field names read here:
``oscillation_damping``, ``damping_strength``, ``hessian_interval``, ``adaptive_clip``,
``clip_epsilon_decay``, ``trust_radius_scale`` and ``lr``. Parameters carry a leading seed dim S (``member_dims=1``).

Per gradient step: the optimizer steps as usual, the step it took (``new - old`` per tensor) goes
through the transform chain (oscillation damping, then the per-layer trust region, whose projection
must come last for its bound to hold), and ``old + shaped`` is written back. Every
``hessian_interval``-th step the gradients are taken with ``create_graph=True`` and one
double-backward Hessian-vector product on a Rademacher probe (drawn from each seed's generator)
refreshes the per-tensor curvature estimate.

Prioritised minibatches are PPO's alone (:mod:`rlfunc.algos.ppo`: priorities from per-sample
loss-gradient norms, importance weights through ``ppo_loss(sample_weight=...)``); GRPO/GSPO
aggregate per-step terms over episodes of unequal length and take the two step transforms only.

The shaping state lives in the learner state as ``state["shaping"]``: ``"transform"`` (the chain's
state) and ``"step"`` (0-dim int64, gradient steps taken), so checkpoints and resume carry it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.errors import ConfigError
from rlfunc.optim import shaping


def check_config(config) -> None:
    """ConfigError naming the first step-shaping field of ``config`` (PPOConfig, GRPOConfig) out of range."""
    if config.hessian_interval < 1 or not 0 <= config.damping_strength <= 1 or not 0 < config.clip_epsilon_decay <= 1:
        raise ConfigError(
            f"hessian_interval={config.hessian_interval}, damping_strength={config.damping_strength}, clip_epsilon_decay="
            f"{config.clip_epsilon_decay}: expected >= 1, in [0, 1] and in (0, 1]"
        )
    if not (config.trust_radius_scale > 0 and math.isfinite(config.trust_radius_scale)):
        raise ConfigError(f"trust_radius_scale={config.trust_radius_scale}: expected a finite value > 0")


def enabled(config) -> bool:
    """Whether ``config`` turns on a step transform (damping or the adaptive clip radius)."""
    return bool(config.oscillation_damping or config.adaptive_clip)


def make_transform(config) -> shaping.GradientTransformation | None:
    """The chain ``config`` asks for (damping, then the trust region), or None when both are off."""
    parts = []
    if config.oscillation_damping:
        parts.append(shaping.oscillation_damping(config.lr, strength=config.damping_strength, member_dims=1))
    if config.adaptive_clip:
        parts.append(shaping.layer_trust_region(member_dims=1))
    return shaping.chain(*parts) if parts else None


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


def init_state(transform: shaping.GradientTransformation, params: TensorDictBase) -> TensorDict:
    names, leaves = trainable(params)
    flat = TensorDict({n: t.detach() for n, t in zip(names, leaves)}, batch_size=[])
    return TensorDict(
        {"transform": transform.init(flat), "step": torch.zeros((), dtype=torch.int64, device=leaves[0].device)},
        batch_size=[],
    )


def clip_epsilon(config, base: float, iteration: Tensor | int) -> float:
    """``base * clip_epsilon_decay^iteration`` with ``adaptive_clip``, else ``base``."""
    if not config.adaptive_clip:
        return base
    return float(shaping.decayed_clip_epsilon(base, config.clip_epsilon_decay, int(iteration)))


def begin_update(config, shaping_state: TensorDictBase, params: TensorDictBase, log_prob_grads: TensorDictBase | None,
                 epsilon: float) -> TensorDict:
    """At the start of a policy update: re-anchor the trust region at ``params`` with radii
    ``trust_radius_scale * epsilon / (L s_l)`` from the per-sample log-likelihood gradients ``log_prob_grads``
    (flat keys, ``[S, N, *shape]``). Every leaf is anchored, so the state keeps its structure; a leaf
    without gradients there (a frozen one, which does not move) gets no bound. Other transforms' states
    are carried over."""
    if not config.adaptive_clip:
        return shaping_state
    names, leaves = trainable(params)
    flat = TensorDict({n: t.detach() for n, t in zip(names, leaves)}, batch_size=[])
    radius = shaping.layer_radius(shaping.layer_sensitivity(log_prob_grads, member_dims=1), epsilon * config.trust_radius_scale)
    out = shaping_state.clone(recurse=False)
    transform = shaping_state["transform"].clone(recurse=False)
    index = str(int(config.oscillation_damping))  # the trust region is the chain's last part
    transform[index] = shaping.layer_trust_region(member_dims=1).init(flat, radius=radius)
    out["transform"] = transform
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


def curvature_due(config, shaping_state: TensorDictBase) -> bool:
    return bool(config.oscillation_damping) and int(shaping_state["step"]) % config.hessian_interval == 0


def shaped_step(step: Callable[[], None], transform: shaping.GradientTransformation, shaping_state: TensorDictBase,
                names: Sequence[str], leaves: Sequence[Tensor], curvature_td: TensorDictBase | None,
                grads: Sequence[Tensor] | None = None) -> tuple[TensorDict, TensorDict]:
    """Run ``step()`` (the optimizer step), shape the step it took and write ``old + shaped`` back.

    ``grads`` (one per leaf) are the gradients the transforms see; None: each leaf's ``.grad``.
    Returns the new shaping state and the transforms' metrics (per seed, ``[S]``)."""
    with torch.no_grad():
        before = [p.detach().clone() for p in leaves]
        grads = [p.grad for p in leaves] if grads is None else grads
        grads = TensorDict({n: g.detach() for n, g in zip(names, grads)}, batch_size=[])
    step()
    with torch.no_grad():
        updates = TensorDict({n: p.detach() - b for n, p, b in zip(names, leaves, before)}, batch_size=[])
        params = TensorDict(dict(zip(names, before)), batch_size=[])
        shaped, new_transform, metrics = transform.update(
            updates, shaping_state["transform"], grads=grads, curvature=curvature_td, params=params
        )
        for n, p, b in zip(names, leaves, before):
            p.copy_(b + shaped[n])
    # a fresh TensorDict: setting into the learner state's (device-bound) one would copy it with ``to``
    return TensorDict({"transform": new_transform, "step": shaping_state["step"] + 1}, batch_size=[]), metrics

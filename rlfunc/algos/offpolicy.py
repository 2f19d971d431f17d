"""What the replay-buffer actor-critics (sac, td3, td3-diffusion) share: an ensemble of Q critics as
one stacked parameter TensorDict, the [-1, 1] <-> env-bounds action map, the uniform warm-up policy,
the checks of their common hyperparameters, and :class:`OffPolicy`, the algorithm that
:class:`rlfunc.run.offpolicy.OffPolicyRun` drives.

The Polyak update of the target networks is :func:`rlfunc.core.func.polyak_update_`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from rlfunc.core import func
from rlfunc.errors import ConfigError
from rlfunc.nets.mlp import MLP, seeded_init

Policy = Callable[[Tensor], tuple[Tensor, None]]  # observation [N, obs_dim] -> (env action [N, A], no log-prob)


class QEnsemble(NamedTuple):
    """E critics Q_e(s, a) = MLP_e([s, a]) sharing one skeleton ``net``.

    init: ``() -> params`` [E, ...], member e seeded with ``seeds[e]``.
    values: ``(params [E, ...], observation [B, O], action [B, A]) -> [E, B, 1]`` (``func.vmap`` over E).
    value: ``(one member's params, observation, action) -> [B, 1]``.
    """

    net: nn.Module
    init: Callable[[], TensorDict]
    values: Callable[[TensorDict, Tensor, Tensor], Tensor]
    value: Callable[[TensorDict, Tensor, Tensor], Tensor]


def q_ensemble(obs_dim: int, act_dim: int, hidden: Sequence[int], seeds: Sequence[int], device: torch.device, *,
               activation: str = "relu", use_loop: bool | None = None) -> QEnsemble:
    """The critic ensemble of ``len(seeds)`` MLPs ``obs_dim + act_dim -> hidden -> 1`` (orthogonal
    init, :class:`rlfunc.nets.mlp.MLP`) on ``device``; ``use_loop`` as :func:`rlfunc.core.func.vmap`'s."""
    make = lambda: MLP(obs_dim + act_dim, 1, tuple(hidden), activation)  # noqa: E731
    net = make().to(device)

    def init() -> TensorDict:
        return func.init_stacked(lambda s: func.params_from_module(seeded_init(make, s).to(device)), list(seeds))

    def value(params: TensorDict, observation: Tensor, action: Tensor) -> Tensor:
        return func.apply(net, params, torch.cat([observation, action], -1))

    values = func.vmap(value, in_dims=(0, None, None), device=device, use_loop=use_loop)
    return QEnsemble(net, init, values, value)


class ActionScale(NamedTuple):
    """The affine map between [-1, 1] (what actors output and buffers hold) and the env's bounds:
    a_env = center + half_range * a; both [A] float32 on the learner's device."""

    center: Tensor
    half_range: Tensor

    def to_env(self, action: Tensor) -> Tensor:
        return self.center + self.half_range * action

    def to_unit(self, action: Tensor) -> Tensor:
        return ((action - self.center) / self.half_range).clamp(-1.0, 1.0)


def action_scale(low: Sequence[float], high: Sequence[float], device: torch.device) -> ActionScale:
    """:class:`ActionScale` of a Box with finite bounds ``low`` < ``high``.

    Raises:
        ConfigError: a bound is not finite, or low >= high somewhere.
    """
    lo = torch.tensor(list(low), dtype=torch.float32)
    hi = torch.tensor(list(high), dtype=torch.float32)
    if not (lo.isfinite().all() and hi.isfinite().all() and (hi > lo).all()):
        raise ConfigError(f"action bounds low={list(low)}, high={list(high)}: expected finite bounds with low < high "
                          "(a squashed or clipped actor needs a bounded Box)")
    return ActionScale(((hi + lo) / 2).to(device), ((hi - lo) / 2).to(device))


def uniform_policy(scale: ActionScale, generator: torch.Generator) -> Policy:
    """Warm-up actions, uniform in the env's box, drawn from ``generator`` (on the learner's device)."""

    def act(observation: Tensor) -> tuple[Tensor, None]:
        u = torch.rand((observation.shape[0], scale.center.shape[0]), generator=generator, device=scale.center.device)
        return scale.to_env(u * 2 - 1), None

    return act


class OffPolicy(NamedTuple):
    """A replay-buffer actor-critic as :class:`rlfunc.run.offpolicy.OffPolicyRun` drives it.

    init: ``() -> state``, the learner state TensorDict (params, targets, every update chain's state,
        "rng", "iteration", "env_steps", "updates").
    policy: ``(state, generator, deterministic) -> Policy`` acting in env units (exploration noise drawn
        from ``generator``; ``deterministic``: the mean action, no draw).
    iteration: ``(state, buffer, generator, num_updates) -> (state, metrics)``: ``num_updates``
        gradient steps on minibatches of ``buffer`` (a TorchRL replay buffer of :func:`transitions`),
        in place; metrics are their means.
    scale: the action map. optimizers: the learner's update-chain state keys.
    """

    init: Callable[[], TensorDict]
    policy: Callable[..., Policy]
    iteration: Callable[..., tuple[TensorDict, TensorDict]]
    scale: ActionScale
    optimizers: tuple[str, ...]
    extra: Any = None


def transitions(batch: TensorDict, scale: ActionScale) -> TensorDict:
    """A rollout [N, T] (:func:`rlfunc.envs.collect.rollout`) -> flat transitions [N*T]:
    "observation", "action" (in [-1, 1]), ("next", "observation"), ("next", "reward"), ("next", "terminated")."""
    return TensorDict(
        {
            "observation": batch["observation"],
            "action": scale.to_unit(batch["action"]),
            "next": {"observation": batch["next", "observation"], "reward": batch["next", "reward"],
                     "terminated": batch["next", "terminated"]},
        },
        batch_size=batch.batch_size,
    ).reshape(-1)


def sample(buffer, batch_size: int, generator: torch.Generator, device: torch.device) -> TensorDict:
    """``batch_size`` transitions of ``buffer``, uniform with replacement, indices from ``generator``
    (the storage lives on ``device``: no host round trip)."""
    idx = torch.randint(len(buffer), (batch_size,), generator=generator, device=device)
    return buffer[idx]


def check_common(config) -> None:
    """ConfigError for a bad value of the hyperparameters sac and td3 share."""
    for name in ("total_steps", "num_envs", "num_steps", "buffer_size", "batch_size", "updates_per_step", "num_critics"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: expected a positive integer")
    if isinstance(config.learning_starts, bool) or not isinstance(config.learning_starts, int) or config.learning_starts < 0:
        raise ConfigError(f"learning_starts={config.learning_starts!r}: expected an integer >= 0")
    if not 0.0 <= config.gamma <= 1.0:
        raise ConfigError(f"gamma={config.gamma}: expected a value in [0, 1]")
    if not 0.0 < config.tau <= 1.0:
        raise ConfigError(f"tau={config.tau}: expected a value in (0, 1]")
    for name in ("actor_lr", "critic_lr"):
        if not getattr(config, name) > 0:
            raise ConfigError(f"{name}={getattr(config, name)}: expected > 0")
    if config.max_grad_norm is not None and not config.max_grad_norm >= 0:
        raise ConfigError(f"max_grad_norm={config.max_grad_norm}: expected > 0, or 0 / None (off)")
    if not config.hidden or any(h < 1 for h in config.hidden):
        raise ConfigError(f"hidden={config.hidden}: expected positive widths")
    if config.activation not in ("tanh", "relu", "elu", "silu"):
        raise ConfigError(f"activation={config.activation!r}: expected tanh, relu, elu or silu")
    if config.n_step != 1:
        raise ConfigError(f"n_step={config.n_step!r}: only 1-step targets are implemented (n-step returns over the "
                          "vector env's replay are not yet)")

"""Gaussian and categorical actors with a state-value critic: the skeletons PPO's parameter TensorDict is made from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from torch import Tensor, nn

from rlfunc.errors import ConfigError
from rlfunc.nets.mlp import MLP


_EXPLORATIONS = ("gaussian", "gsde")


class GaussianActorCritic(nn.Module):
    """Separate MLPs for the action mean and V(s), plus a state-independent log-std parameter.

    ``forward(observation [*B, obs_dim]) -> (loc [*B, act_dim], log_std, state_value [*B, 1])``, and
    with ``return_latent=True`` also the actor's last hidden features [*B, L] (the z(s) of gSDE, after
    the activation; L = hidden[-1], or obs_dim with ``hidden=()``: the input of the single linear
    layer). ``log_std`` is [act_dim] with ``exploration="gaussian"`` (sigma of the action noise) and
    [L, act_dim] (``full_std``) or [L, 1] with ``exploration="gsde"`` (sigma of the exploration
    matrix, see rlfunc.core.sde). Observations are expected already normalised; actions are in the
    env's units before clipping. The last actor layer has gain 0.01 and the critic's gain 1
    (Huang et al. 2022, detail 2).

    Raises:
        ConfigError: ``exploration`` is not "gaussian" or "gsde"; ``activation`` unknown (:class:`MLP`).
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        hidden: Sequence[int] = (64, 64),
        activation: str = "tanh",
        init_log_std: float = 0.0,
        exploration: str = "gaussian",
        full_std: bool = True,
    ) -> None:
        if exploration not in _EXPLORATIONS:
            raise ConfigError(f"GaussianActorCritic: exploration={exploration!r}: expected one of "
                              f"{', '.join(map(repr, _EXPLORATIONS))}")
        super().__init__()
        self.actor = MLP(obs_dim, act_dim, hidden, activation, out_gain=0.01)
        self.critic = MLP(obs_dim, 1, hidden, activation, out_gain=1.0)
        latent = hidden[-1] if len(hidden) else obs_dim  # the input of the actor's last layer
        shape = (act_dim,) if exploration == "gaussian" else (latent, act_dim if full_std else 1)
        self.log_std = nn.Parameter(torch.full(shape, float(init_log_std)))

    def forward(self, observation: Tensor, return_latent: bool = False):
        if not return_latent:
            return self.actor(observation), self.log_std, self.critic(observation)
        *body, head = list(self.actor)
        latent = observation
        for layer in body:
            latent = layer(latent)
        return head(latent), self.log_std, self.critic(observation), latent

    def value(self, observation: Tensor) -> Tensor:
        return self.critic(observation)


class CategoricalActorCritic(nn.Module):
    """Separate MLPs for the action logits and V(s), for Discrete and MultiDiscrete actions.

    ``forward(observation [*B, obs_dim]) -> (logits [*B, num_logits], state_value [*B, 1])``:
    ``num_logits`` is n for Discrete(n), sum(nvec) for MultiDiscrete(nvec) (the heads concatenated,
    as ``rlfunc.core.distributions.categorical_log_prob`` reads them). No log-std: the categorical
    distribution is the exploration. Gains as :class:`GaussianActorCritic`: 0.01 for the last actor
    layer (near-uniform initial policy), 1 for the critic's (Huang et al. 2022, detail 2).
    """

    def __init__(self, obs_dim: int, num_logits: int, hidden: Sequence[int] = (64, 64), activation: str = "tanh") -> None:
        super().__init__()
        self.actor = MLP(obs_dim, num_logits, hidden, activation, out_gain=0.01)
        self.critic = MLP(obs_dim, 1, hidden, activation, out_gain=1.0)

    def forward(self, observation: Tensor):
        return self.actor(observation), self.critic(observation)

    def value(self, observation: Tensor) -> Tensor:
        return self.critic(observation)


def sequential_apply(module: nn.Sequential, params: TensorDictBase, x: Tensor, *, return_hidden: bool = False):
    """Differentiable forward of an ``nn.Sequential`` of ``nn.Linear`` and parameter-free layers over ``params``.

    The same numbers as ``rlfunc.core.func.apply(module, params, x)`` (each linear layer is the same
    ``F.linear`` call), without ``functional_call``'s per-call module walk, which dominates the
    update step of a small MLP; works under ``torch.func.vmap`` and ``grad``.

    Args:
        module: the skeleton (e.g. ``GaussianActorCritic.actor``), used for its layer order, activations
            and which ``nn.Linear`` layers have a bias.
        params: its parameters as a TensorDict keyed like ``module``'s children ("0", "2", ...).
        x: [*B, in] float input.
        return_hidden: also return the input of the last layer (the last hidden features).

    Returns:
        [*B, out], or ([*B, out], [*B, hidden]) with ``return_hidden``.
    """
    *body, (last_name, last) = list(module._modules.items())  # a layer used twice runs twice, as in nn.Sequential
    for name, layer in body:
        x = _linear(module, layer, params, name, x) if isinstance(layer, nn.Linear) else layer(x)
    out = _linear(module, last, params, last_name, x) if isinstance(last, nn.Linear) else last(x)
    return (out, x) if return_hidden else out


def _linear(module: nn.Module, layer: nn.Linear, params: TensorDictBase | Mapping, name: str, x: Tensor) -> Tensor:
    """``layer``'s F.linear with its weight (and bias, if the layer has one: ``bias=False`` has none) from
    ``params`` (a TensorDict, or nested dicts: PPO's single-seed step passes dicts, ~50x cheaper to index)."""
    try:
        layer_params = params[name]
        weight, bias = layer_params["weight"], (layer_params["bias"] if layer.bias is not None else None)
    except KeyError:  # a reused layer or a tied weight: params_from_module keeps the tensor under its first name only
        key_of = {id(p): n.split(".") for n, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
        weight, bias = (None if p is None else _get(params, key_of[id(p)]) for p in (layer.weight, layer.bias))
    return F.linear(x, weight, bias)


def _get(params: TensorDictBase | Mapping, path: list[str]) -> Tensor:
    for key in path:
        params = params[key]
    return params


def actor_critic_apply(net: GaussianActorCritic, params: TensorDictBase, observation: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``net(observation, return_latent=True)`` with ``params``: (loc, log_std, state_value, latent), via
    :func:`sequential_apply` (same numbers as ``func.apply``, a fraction of the overhead)."""
    loc, latent = sequential_apply(net.actor, params["actor"], observation, return_hidden=True)
    return loc, params["log_std"], sequential_apply(net.critic, params["critic"], observation), latent

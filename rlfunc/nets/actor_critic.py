"""Gaussian actor and state-value critic: the skeleton PPO's parameter TensorDict is made from."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rlfunc.nets.mlp import MLP


class GaussianActorCritic(nn.Module):
    """Separate MLPs for the action mean and V(s), plus a state-independent log-std parameter.

    ``forward(observation [*B, obs_dim]) -> (loc [*B, act_dim], log_std, state_value [*B, 1])``, and
    with ``return_latent=True`` also the actor's last hidden features [*B, hidden[-1]] (the z(s) of
    gSDE, after the activation). ``log_std`` is [act_dim] with ``exploration="gaussian"`` (sigma of
    the action noise) and [hidden[-1], act_dim] (``full_std``) or [hidden[-1], 1] with
    ``exploration="gsde"`` (sigma of the exploration matrix, see rlfunc.sde).
    Observations are expected already normalised; actions are in the env's units before clipping.
    The last actor layer has gain 0.01 and the critic's gain 1 (Huang et al. 2022, detail 2).
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
        super().__init__()
        self.actor = MLP(obs_dim, act_dim, hidden, activation, out_gain=0.01)
        self.critic = MLP(obs_dim, 1, hidden, activation, out_gain=1.0)
        shape = (act_dim,) if exploration == "gaussian" else (hidden[-1], act_dim if full_std else 1)
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

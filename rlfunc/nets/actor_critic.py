"""Gaussian actor and state-value critic: the skeleton PPO's parameter TensorDict is made from."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rlfunc.nets.mlp import MLP


class GaussianActorCritic(nn.Module):
    """Separate MLPs for the action mean and V(s), plus a state-independent log-std.

    ``forward(observation [*B, obs_dim]) -> (loc [*B, act_dim], log_std [act_dim], state_value [*B, 1])``.
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
    ) -> None:
        super().__init__()
        self.actor = MLP(obs_dim, act_dim, hidden, activation, out_gain=0.01)
        self.critic = MLP(obs_dim, 1, hidden, activation, out_gain=1.0)
        self.log_std = nn.Parameter(torch.full((act_dim,), float(init_log_std)))

    def forward(self, observation: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.actor(observation), self.log_std, self.critic(observation)

    def value(self, observation: Tensor) -> Tensor:
        return self.critic(observation)

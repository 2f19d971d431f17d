"""TD3's twin-critic targets and losses, and the Diffusion-QL actor objective, as pure functions.

References: Fujimoto et al. (2018), "Addressing Function Approximation Error in Actor-Critic Methods"
(clipped double-Q target, eq. 10; target policy smoothing, eq. 14); Wang et al. (2022),
"Diffusion Policies as an Expressive Policy Class for Offline RL" (Diffusion-QL), eq. 3: the actor
minimises a denoising (behaviour) loss minus a normalised Q of actions sampled through the chain.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.errors import ConfigError, ShapeError


def td3_target(next_q: Tensor, reward: Tensor, terminated: Tensor, gamma: float) -> Tensor:
    """Clipped double-Q target ``y = r + gamma (1 - terminated) min_e Q'_e(s', a~')``.

    Args:
        next_q: [E, *B, 1] float, target critics at the next state and the smoothed target action.
        reward: [*B, 1] float; terminated: [*B, 1] bool (truncation still bootstraps).
        gamma: discount in [0, 1].

    Returns:
        [*B, 1] float, without gradient.

    Raises:
        ConfigError: gamma outside [0, 1]. ShapeError: shapes disagree.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ConfigError(f"gamma={gamma}: expected a value in [0, 1]")
    if next_q.shape[1:] != reward.shape or terminated.shape != reward.shape:
        raise ShapeError(
            f"td3_target: next_q {tuple(next_q.shape)} must be [E, *reward.shape] and terminated "
            f"{tuple(terminated.shape)} like reward {tuple(reward.shape)}"
        )
    with torch.no_grad():
        return reward + gamma * (~terminated.bool()).to(reward.dtype) * next_q.min(0).values


def critic_loss(q: Tensor, target: Tensor) -> tuple[Tensor, TensorDict]:
    """Sum over the ensemble of mean squared TD errors, ``sum_e E[(Q_e(s, a) - y)^2]``.

    Args:
        q: [E, *B, 1] float; target: [*B, 1] float (no gradient).
    """
    if q.shape[1:] != target.shape:
        raise ShapeError(f"critic_loss: q {tuple(q.shape)} must be [E, *target.shape], target {tuple(target.shape)}")
    err = (q - target.unsqueeze(0)).pow(2)
    loss = err.flatten(1).mean(1).sum()
    return loss, TensorDict({"loss_critic": loss.detach(), "q_mean": q.detach().mean()}, batch_size=[])


def diffusion_ql_actor_loss(q: Tensor, denoising: Tensor, *, q_coef: float = 1.0, bc_coef: float = 1.0) -> tuple[Tensor, TensorDict]:
    """``bc_coef * L_denoise - q_coef * E[Q(s, a_theta)] / E[|Q(s, a_theta)|]`` (normaliser detached).

    Args:
        q: [*B, 1] float, a critic at the actions sampled through the reverse chain (with gradient).
        denoising: 0-dim, the DDPM loss of the actor on buffer/demonstration actions.
        q_coef: alpha of Diffusion-QL, >= 0; bc_coef: weight of the behaviour term, >= 0.
    """
    if q_coef < 0 or bc_coef < 0:
        raise ConfigError(f"q_coef={q_coef}, bc_coef={bc_coef}: expected >= 0")
    scale = q.detach().abs().mean().clamp_min(1e-6)
    loss_q = -q.mean() / scale
    loss = bc_coef * denoising + q_coef * loss_q
    metrics = TensorDict(
        {"loss_actor_q": loss_q.detach(), "loss_denoise": denoising.detach(), "q_policy": q.detach().mean()},
        batch_size=[],
    )
    return loss, metrics

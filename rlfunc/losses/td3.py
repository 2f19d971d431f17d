"""TD3's twin-critic targets and losses, and the Diffusion-QL actor objective, as pure functions.

References: Fujimoto et al. (2018), "Addressing Function Approximation Error in Actor-Critic Methods"
(clipped double-Q target, eq. 10; target policy smoothing, eq. 14); Wang et al. (2022),
"Diffusion Policies as an Expressive Policy Class for Offline RL" (Diffusion-QL), eq. 3: the actor
minimises a denoising (behaviour) loss minus a normalised Q of actions sampled through the chain.
The soft (SAC) variants of the target and critic loss reuse these in :mod:`rlfunc.losses.sac`.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.core.distributions import check_action_bounds
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.losses.checks import check_number


def td3_target(
    next_q: Tensor, reward: Tensor, terminated: Tensor, gamma: float, *, discount: Tensor | None = None
) -> Tensor:
    """Clipped double-Q target ``y = r + gamma (1 - terminated) min_e Q'_e(s', a~')`` (Fujimoto et al. 2018, eq. 10).

    Args:
        next_q: [E, *B, 1] float, target critics at the next state and the smoothed target action
            (:func:`smoothed_target_action`); the min is taken over the ensemble dim E.
        reward: [*B, 1] float, the reward (for an n-step target, the discounted sum
            ``sum_{k<n} gamma^k r_{t+k}``); terminated: [*B, 1] bool (truncation still bootstraps).
        gamma: discount in [0, 1].
        discount: optional [*B, 1] float in [0, 1], the bootstrap's discount per sample, replacing
            ``gamma``: ``gamma^n`` for an n-step target, with n the steps actually taken (fewer when the
            episode ended or was truncated inside the window). Values are not checked (that would read
            them back to the host). ``terminated`` still zeroes the bootstrap.

    Returns:
        [*B, 1] float, without gradient.

    Raises:
        ConfigError: gamma outside [0, 1]. ShapeError: shapes disagree.
    """
    check_number("gamma", gamma, finite=False)
    if not 0.0 <= gamma <= 1.0:
        raise ConfigError(f"gamma={gamma}: expected a value in [0, 1]")
    for name, t in (("next_q", next_q), ("reward", reward), ("terminated", terminated)):
        if not isinstance(t, Tensor):  # a list was "'list' object has no attribute 'shape'"
            raise ShapeError(f"td3_target: {name}: expected a tensor, got {type(t).__name__}")
    if not next_q.is_floating_point() or not reward.is_floating_point():  # an int64 next_q passed, unlike soft_q_target's
        raise ShapeError(f"td3_target: next_q {next_q.dtype} and reward {reward.dtype}: expected float tensors")
    if next_q.shape[1:] != reward.shape or terminated.shape != reward.shape:
        raise ShapeError(
            f"td3_target: next_q {tuple(next_q.shape)} must be [E, *reward.shape] and terminated "
            f"{tuple(terminated.shape)} like reward {tuple(reward.shape)}"
        )
    if next_q.shape[0] == 0:  # min over no critic was an IndexError
        raise ShapeError(f"td3_target: next_q {tuple(next_q.shape)}: an ensemble of 0 critics, expected E >= 1")
    if discount is not None and (not isinstance(discount, Tensor) or discount.shape != reward.shape or not discount.is_floating_point()):
        got = f"{tuple(discount.shape)} {discount.dtype}" if isinstance(discount, Tensor) else repr(discount)
        raise ShapeError(f"discount: {got}, expected a float tensor shaped like reward {tuple(reward.shape)} (gamma takes a number)")
    with torch.no_grad():
        scale = gamma if discount is None else discount
        return reward + scale * (~terminated.bool()).to(reward.dtype) * next_q.min(0).values


def smoothed_target_action(
    target_action: Tensor,
    noise: Tensor,
    *,
    policy_noise: float,
    noise_clip: float,
    low: Tensor | float = -1.0,
    high: Tensor | float = 1.0,
) -> Tensor:
    """Target policy smoothing ``a~' = clip(mu'(s') + clip(sigma eps, -c, c), low, high)`` (Fujimoto et al. 2018, eq. 14).

    Args:
        target_action: [*B, A] float, the target actor's action mu'(s').
        noise: [*B, A] float, standard-normal eps (``rlfunc.core.distributions.standard_normal``),
            scaled here by ``policy_noise``.
        policy_noise: sigma >= 0, the smoothing std (TD3: 0.2 for actions in [-1, 1]).
        noise_clip: c >= 0, the clip of the scaled noise (TD3: 0.5).
        low, high: action bounds, floats or tensors broadcasting to [A] (default: the box [-1, 1]).

    Returns:
        [*B, A] float in [low, high], without gradient.

    Raises:
        ConfigError: ``policy_noise`` not a finite number >= 0, ``noise_clip`` not a number >= 0; bounds that are not finite
            with low < high (:func:`rlfunc.core.distributions.check_action_bounds`). ShapeError: ``noise``
            is not shaped like ``target_action`` or either is not floating; tensor bounds of another width.
    """
    check_number("policy_noise", policy_noise, finite=False)
    check_number("noise_clip", noise_clip, finite=False)
    if not (policy_noise >= 0 and noise_clip >= 0):  # not "< 0": NaN passed that and made every action NaN
        raise ConfigError(f"policy_noise={policy_noise}, noise_clip={noise_clip}: expected values >= 0")
    if policy_noise == math.inf:  # inf x a zero draw is NaN (noise_clip may be inf: no clip)
        raise ConfigError(f"policy_noise={policy_noise}: expected a finite value")
    for name, t in (("target_action", target_action), ("noise", noise)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ShapeError(f"{name}: expected a float tensor [*B, A], got {getattr(t, 'dtype', type(t).__name__)}")
    if noise.shape != target_action.shape:
        raise ShapeError(f"noise: shape {tuple(noise.shape)}, expected target_action's {tuple(target_action.shape)}")
    check_action_bounds(low, high, target_action)  # low > high gave [-1, ...] and a NaN bound NaN, silently
    with torch.no_grad():
        smooth = (policy_noise * noise).clamp(-noise_clip, noise_clip)
        action = target_action + smooth
        if isinstance(low, Tensor) or isinstance(high, Tensor):
            low_t = torch.as_tensor(low, dtype=action.dtype, device=action.device)
            high_t = torch.as_tensor(high, dtype=action.dtype, device=action.device)
            return torch.maximum(torch.minimum(action, high_t), low_t)
        return action.clamp(low, high)


def td3_actor_loss(q1_pi: Tensor) -> tuple[Tensor, TensorDict]:
    """Deterministic policy gradient objective ``-E[Q_1(s, mu(s))]`` (Fujimoto et al. 2018, alg. 1; Silver et al. 2014).

    Args:
        q1_pi: [*B, 1] float, the first critic at the actor's own action (with gradient into the actor).

    Returns:
        (loss 0-dim, metrics {"loss_actor", "q_policy"}).

    Raises:
        ShapeError: ``q1_pi`` is not a float tensor with a last dim of 1.
    """
    if not isinstance(q1_pi, Tensor) or not q1_pi.is_floating_point() or q1_pi.ndim == 0 or q1_pi.shape[-1] != 1:
        raise ShapeError(f"q1_pi: expected a float tensor [*B, 1], got {getattr(q1_pi, 'shape', type(q1_pi).__name__)}")
    if q1_pi.numel() == 0:  # the mean of nothing was a NaN loss, silently
        raise ShapeError(f"q1_pi: shape {tuple(q1_pi.shape)}, an empty minibatch: expected at least one sample")
    loss = -q1_pi.mean()
    return loss, TensorDict({"loss_actor": loss.detach(), "q_policy": q1_pi.detach().mean()}, batch_size=[])


def critic_loss(q: Tensor, target: Tensor) -> tuple[Tensor, TensorDict]:
    """Sum over the ensemble of mean squared TD errors, ``sum_e E[(Q_e(s, a) - y)^2]``.

    Args:
        q: [E, *B, 1] float; target: [*B, 1] float (no gradient).

    Returns:
        (loss 0-dim, metrics {"loss_critic", "q_mean"}).

    Raises:
        ShapeError: ``q`` is not [E, *target.shape], either is not a float tensor, or it is empty (E = 0 or no sample).
    """
    for name, t in (("q", q), ("target", target)):
        if not isinstance(t, Tensor) or not t.is_floating_point():  # a list: no attribute 'shape'; int q: mean()'s dtype error
            raise ShapeError(f"critic_loss: {name}: expected a float tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if q.shape[1:] != target.shape:
        raise ShapeError(f"critic_loss: q {tuple(q.shape)} must be [E, *target.shape], target {tuple(target.shape)}")
    if q.numel() == 0:  # an empty minibatch's mean was a NaN loss, silently; no critic (E = 0) a loss of 0
        raise ShapeError(f"critic_loss: q {tuple(q.shape)}, target {tuple(target.shape)}: expected E >= 1 critics and at "
                         "least one sample")
    err = (q - target.detach().unsqueeze(0)).pow(2)  # a target with a graph leaked gradient into it
    loss = err.flatten(1).mean(1).sum()
    return loss, TensorDict({"loss_critic": loss.detach(), "q_mean": q.detach().mean()}, batch_size=[])


def diffusion_ql_actor_loss(q: Tensor, denoising: Tensor, *, q_coef: float = 1.0, bc_coef: float = 1.0,
                            scale: Tensor | None = None) -> tuple[Tensor, TensorDict]:
    """``bc_coef * L_denoise - q_coef * E[Q(s, a_theta)] / E[|Q(s, a_theta)|]`` (normaliser detached,
    at least 1e-6).

    Args:
        q: [*B, 1] float, a critic at the actions sampled through the reverse chain (with gradient).
        denoising: 0-dim, the DDPM loss of the actor on buffer/demonstration actions.
        q_coef: alpha of Diffusion-QL, >= 0; bc_coef: weight of the behaviour term, >= 0.
        scale: 0-dim, the normaliser E[|Q|] when it is not this ``q``'s: a data-parallel rank, whose
            ``q`` is its share of the minibatch, passes the mean over every rank's share (None: ``q``'s).
    """
    check_number("q_coef", q_coef, finite=False)  # a str was a TypeError from the comparison
    check_number("bc_coef", bc_coef, finite=False)
    if not (q_coef >= 0 and bc_coef >= 0):  # NaN passed "< 0" and made the loss NaN
        raise ConfigError(f"q_coef={q_coef}, bc_coef={bc_coef}: expected >= 0")
    if math.isinf(q_coef) or math.isinf(bc_coef):  # an inf weight gave a loss of -inf
        raise ConfigError(f"q_coef={q_coef}, bc_coef={bc_coef}: expected finite values")
    if scale is not None and not isinstance(scale, Tensor):  # a float was an AttributeError (.detach)
        raise ShapeError(f"scale={scale!r}: expected None or a 0-dim tensor (the mean |Q| over every rank's share)")
    scale = (q.detach().abs().mean() if scale is None else scale.detach()).clamp_min(1e-6)
    loss_q = -q.mean() / scale
    loss = bc_coef * denoising + q_coef * loss_q
    metrics = TensorDict(
        {"loss_actor_q": loss_q.detach(), "loss_denoise": denoising.detach(), "q_policy": q.detach().mean()},
        batch_size=[],
    )
    return loss, metrics

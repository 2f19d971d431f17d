"""Soft Actor-Critic's target, critic, actor and temperature losses as pure functions.

Conventions: a critic ensemble's values are [E, *B, 1] (E members along dim 0, as
``rlfunc.core.func.vmap`` over stacked critic parameters returns them); a per-sample scalar is
[*B, 1]; the temperature is alpha = exp(log_alpha). The target and the critic loss are TD3's
(:func:`rlfunc.losses.td3.td3_target`, :func:`rlfunc.losses.td3.critic_loss`) with the entropy
term added and the 1/2 of eq. 5; nothing here is copied from there.

Where the ensemble is reduced: :func:`soft_q_target` and :func:`sac_actor_loss` take either the
whole ensemble [E, *B, 1], of which they take the min over E (clipped double Q, SAC's two critics),
or an already-reduced [*B, 1] value, used as it is. The reduced form is how to plug in other
reductions: REDQ's min over a random subset (:func:`ensemble_min` with ``subset``) in the target and
the mean over all members in the actor loss (Chen et al. 2021, alg. 1, lines 8 and 11).

References: Haarnoja et al. (2018), "Soft Actor-Critic Algorithms and Applications": eq. 3 (the soft
value V(s') = E[Q(s', a') - alpha log pi(a'|s')]), eq. 5 (the soft Bellman residual), eq. 7/8 (the
policy objective, reparameterised), eq. 18 (the temperature objective with target entropy H_bar);
Chen et al. (2021), "Randomized Ensembled Double Q-Learning" (REDQ).
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.losses.checks import check_number
from rlfunc.losses.td3 import critic_loss, td3_target

__all__ = ["ensemble_min", "sac_actor_loss", "sac_critic_loss", "soft_q_target", "temperature_loss"]


def _check_scalar(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or not t.is_floating_point() or t.ndim == 0 or t.shape[-1] != 1:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ShapeError(f"{name}: expected a float tensor [*B, 1], got {shape} {getattr(t, 'dtype', '')}")
    if t.numel() == 0:  # the mean over an empty minibatch was a NaN loss, silently
        raise ShapeError(f"{name}: shape {tuple(t.shape)}, an empty minibatch: expected at least one sample")


def _as_ensemble(name: str, q: Tensor, like: Tensor) -> Tensor:
    """``q`` as [E, *B, 1]: an ensemble [E, *like.shape] as it is, a reduced [*like.shape] with E = 1."""
    if not isinstance(q, Tensor) or not q.is_floating_point():
        raise ShapeError(f"{name}: expected a float tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    if q.shape == like.shape:
        return q.unsqueeze(0)
    if q.ndim == like.ndim + 1 and q.shape[1:] == like.shape:
        return q
    raise ShapeError(f"{name}: shape {tuple(q.shape)}, expected [E, *B, 1] or [*B, 1] with [*B, 1] = {tuple(like.shape)}")


def _alpha(alpha: Tensor | float) -> Tensor | float:
    if isinstance(alpha, Tensor):
        if alpha.numel() != 1:
            raise ShapeError(f"alpha: expected a scalar (0-d or one element), got shape {tuple(alpha.shape)}")
        return alpha.detach().reshape(())
    check_number("alpha", alpha)  # None or "0.1" was a TypeError from the comparison; inf gave inf targets
    if not alpha >= 0:
        raise ConfigError(f"alpha={alpha}: expected a temperature >= 0")
    return alpha


def ensemble_min(q: Tensor, subset: int | None = None, generator: torch.Generator | None = None) -> Tensor:
    """``min_{e in M} Q_e``: over all E members (M = {1..E}), or over ``subset`` members drawn without replacement (REDQ).

    REDQ draws one subset per update, shared by the whole minibatch (Chen et al. 2021, alg. 1, line 7);
    so does this: the indices are the first ``subset`` entries of a random permutation of [0, E).

    Args:
        q: [E, *B, 1] float, the ensemble's values.
        subset: number of members M in [1, E] to take the min over; None: all E (no randomness).
        generator: the random stream of the subset (a ``torch.Generator`` on ``q``'s device); None
            uses the device's default generator. Unused when ``subset`` is None.

    Returns:
        [*B, 1] float, differentiable in the chosen members (gradient to the argmin).

    Raises:
        ShapeError: ``q`` is not a float tensor with at least two dims. ConfigError: ``subset`` outside [1, E].
    """
    if not isinstance(q, Tensor) or not q.is_floating_point() or q.ndim < 2:
        raise ShapeError(f"q: expected a float tensor [E, *B, 1], got {getattr(q, 'shape', type(q).__name__)}")
    if subset is None:
        return q.min(0).values
    e = q.shape[0]
    if isinstance(subset, bool) or not isinstance(subset, int) or not 1 <= subset <= e:
        raise ConfigError(f"subset={subset!r}: expected an int in [1, E={e}]")
    index = torch.randperm(e, generator=generator, device=q.device)[:subset]
    return q.index_select(0, index).min(0).values


def soft_q_target(
    next_q: Tensor,
    next_log_prob: Tensor,
    reward: Tensor,
    terminated: Tensor,
    gamma: float,
    alpha: Tensor | float,
    *,
    discount: Tensor | None = None,
) -> Tensor:
    """Soft Bellman target ``y = r + gamma (1 - terminated) (min_e Q'_e(s', a') - alpha log pi(a'|s'))``, a' ~ pi(.|s').

    Eq. 3 and 5 of Haarnoja et al. (2018) with a single-sample estimate of V(s') and the clipped
    double-Q min (their sec. 6); computed by :func:`rlfunc.losses.td3.td3_target` on
    ``Q'_e - alpha log pi``, which has the same min.

    Args:
        next_q: [E, *B, 1] float, the target critics at (s', a') (the min over E is taken here), or
            [*B, 1] already reduced (e.g. :func:`ensemble_min` over a REDQ subset).
        next_log_prob: [*B, 1] float, log pi(a'|s') of the same next action a'.
        reward: [*B, 1] float (for an n-step target, the discounted reward sum).
        terminated: [*B, 1] bool; truncation still bootstraps.
        gamma: discount in [0, 1].
        alpha: temperature >= 0, a float or a one-element tensor (detached here).
        discount: optional [*B, 1] float replacing ``gamma`` per sample, e.g. ``gamma^n`` for an n-step
            target with the steps actually taken (see ``td3_target``).

    Returns:
        [*B, 1] float, without gradient.

    Raises:
        ConfigError: gamma outside [0, 1], a float alpha not a finite number >= 0. ShapeError: shapes disagree.
    """
    _check_scalar("next_log_prob", next_log_prob)
    _check_scalar("reward", reward)
    if next_log_prob.shape != reward.shape:
        raise ShapeError(f"next_log_prob: shape {tuple(next_log_prob.shape)}, expected reward's {tuple(reward.shape)}")
    next_q = _as_ensemble("next_q", next_q, reward)
    soft = next_q - _alpha(alpha) * next_log_prob.detach().unsqueeze(0)
    return td3_target(soft, reward, terminated, gamma, discount=discount)


def sac_critic_loss(q: Tensor, target: Tensor) -> tuple[Tensor, TensorDict]:
    """Soft Bellman residual ``J_Q = sum_e E[1/2 (Q_e(s, a) - y)^2]`` (Haarnoja et al. 2018, eq. 5, one term per critic).

    Args:
        q: [E, *B, 1] float, every critic at the replayed (s, a), with gradient.
        target: [*B, 1] float, :func:`soft_q_target` (no gradient).

    Returns:
        (loss 0-dim, metrics {"loss_critic", "q_mean"}): half of :func:`rlfunc.losses.td3.critic_loss`.

    Raises:
        ShapeError: ``q`` is not [E, *target.shape].
    """
    loss, metrics = critic_loss(q, target)
    loss = 0.5 * loss
    metrics["loss_critic"] = loss.detach()
    return loss, metrics


def sac_actor_loss(q_pi: Tensor, log_prob: Tensor, alpha: Tensor | float) -> tuple[Tensor, TensorDict]:
    """Policy objective ``J_pi = E[alpha log pi(a|s) - min_e Q_e(s, a)]``, a = f(eps; s) reparameterised (eq. 7/8).

    Args:
        q_pi: [E, *B, 1] float, the critics at the policy's own reparameterised action (gradient into
            the actor through a); the min over E is taken here. Or [*B, 1] already reduced (REDQ: the
            mean over all members).
        log_prob: [*B, 1] float, log pi(a|s) of that action, with gradient.
        alpha: temperature >= 0, a float or a one-element tensor (detached here).

    Returns:
        (loss 0-dim, metrics {"loss_actor", "q_policy", "entropy"}), ``entropy`` = -E[log pi], a
        single-sample estimate.

    Raises:
        ShapeError: shapes disagree. ConfigError: a float alpha not a finite number >= 0.
    """
    _check_scalar("log_prob", log_prob)
    q = _as_ensemble("q_pi", q_pi, log_prob).min(0).values
    loss = (_alpha(alpha) * log_prob - q).mean()
    metrics = TensorDict(
        {"loss_actor": loss.detach(), "q_policy": q.detach().mean(), "entropy": -log_prob.detach().mean()},
        batch_size=[],
    )
    return loss, metrics


def temperature_loss(log_alpha: Tensor, log_prob: Tensor, target_entropy: float) -> tuple[Tensor, TensorDict]:
    """Temperature objective ``J(alpha) = -E[log_alpha (log pi(a|s) + H_bar)]``, log pi detached (eq. 18, log parameterised).

    Eq. 18 is ``E[-alpha log pi - alpha H_bar]``; optimising log alpha instead keeps alpha > 0 and
    has the same sign of gradient: dJ/dlog_alpha = -(E[log pi] + H_bar) = H - H_bar with the entropy
    estimate H = -E[log pi]. So alpha grows while the policy's entropy is below the target and shrinks
    while it is above.

    Args:
        log_alpha: 0-dim (or one-element) float, the learnable log alpha.
        log_prob: [*B, 1] float, log pi(a|s) of fresh policy actions (detached here). DACER passes
            minus an entropy estimate instead (:func:`rlfunc.diffusion.entropy.gmm_entropy`).
        target_entropy: H_bar, usually -dim(A) (Haarnoja et al. 2018, appendix D).

    Returns:
        (loss 0-dim, metrics {"loss_alpha", "alpha", "entropy"}).

    Raises:
        ShapeError: ``log_alpha`` has more than one element or ``log_prob`` is not [*B, 1] float.
        ConfigError: ``target_entropy`` is not a finite number.
    """
    if not isinstance(log_alpha, Tensor) or log_alpha.numel() != 1 or not log_alpha.is_floating_point():
        raise ShapeError(f"log_alpha: expected a one-element float tensor, got {getattr(log_alpha, 'shape', type(log_alpha).__name__)}")
    _check_scalar("log_prob", log_prob)
    if not isinstance(target_entropy, Tensor):  # None or "x" was "must be real number"; NaN made the loss NaN, silently
        check_number("target_entropy", target_entropy)
    if not isinstance(target_entropy, Tensor) and not math.isfinite(target_entropy):
        raise ConfigError(f"target_entropy={target_entropy!r}: expected a finite number (e.g. -dim(A))")
    log_alpha = log_alpha.reshape(())
    loss = -(log_alpha * (log_prob.detach() + target_entropy)).mean()
    metrics = TensorDict(
        {"loss_alpha": loss.detach(), "alpha": log_alpha.detach().exp(), "entropy": -log_prob.detach().mean()},
        batch_size=[],
    )
    return loss, metrics

"""Generalized state-dependent exploration (gSDE) as pure functions over tensors.

The policy's action noise is a linear function of its last hidden features z(s) [*B, L]:
eps(s) = z(s) @ theta, with an exploration matrix theta [L, A] drawn from N(0, sigma^2) entrywise
and held fixed for ``sde_sample_freq`` steps, so consecutive actions in similar states get similar
noise (smooth exploration). Given z, eps is Gaussian with per-action variance
Var[eps_j] = sum_i z_i^2 sigma_ij^2, i.e. (z^2) @ sigma^2, and the policy is scored as
N(a; mu(s), diag((z^2) @ sigma^2 + epsilon)). sigma = exp(log_std) is learned: log_std is
[L, A] ("full std", one sigma per entry of theta) or [L, 1] (one sigma per feature, shared by the
actions). By default z is detached in the log-likelihood, so the policy gradient does not shape
the features through the noise scale (``learn_features=False``).

Randomness is never drawn inside a function except :func:`draw_exploration_matrix`, which takes the
``torch.Generator`` to draw from; everything else takes the standard-normal noise as an input.

Reference: Raffin, Kober & Stulp (2022), "Smooth Exploration for Robotic Reinforcement Learning",
CoRL, section 3 (eq. 4-6: the noise, its variance and the log-likelihood); the numerics (variance
floor epsilon = 1e-6, detached features, optional tanh squashing) follow stable-baselines3's
``StateDependentNoiseDistribution``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from rlfunc.core.distributions import gaussian_entropy, gaussian_log_prob, tanh_gaussian_log_prob
from rlfunc.errors import ConfigError, ShapeError

__all__ = [
    "draw_exploration_matrix",
    "exploration_matrix",
    "resample_due",
    "sde_entropy",
    "sde_log_prob",
    "sde_log_std",
    "sde_noise",
    "sde_sample",
]

EPSILON = 1e-6  # variance floor added to (z^2) @ sigma^2, as stable-baselines3


def _check(name: str, t: Tensor, min_dim: int) -> None:
    if not isinstance(t, Tensor):
        raise ShapeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ShapeError(f"{name}: expected a floating dtype, got {t.dtype}")
    if t.ndim < min_dim:
        raise ShapeError(f"{name}: expected at least {min_dim} dims, got shape {tuple(t.shape)}")


def _check_log_std(log_std: Tensor, latent: Tensor | None = None, act_dim: int | None = None) -> None:
    _check("log_std", log_std, 2)
    if latent is not None and log_std.shape[-2] != latent.shape[-1]:
        raise ShapeError(
            f"log_std: shape {tuple(log_std.shape)} has {log_std.shape[-2]} feature rows but latent has "
            f"{latent.shape[-1]} features (shape {tuple(latent.shape)})"
        )
    if act_dim is not None and log_std.shape[-1] not in (1, act_dim):
        raise ShapeError(f"log_std: last dim is {log_std.shape[-1]}, expected 1 or the action dim {act_dim}")


def exploration_matrix(log_std: Tensor, noise: Tensor) -> Tensor:
    """theta = sigma * xi with xi ~ N(0, I) given: a draw of the exploration matrix, theta_ij ~ N(0, sigma_ij^2).

    Args:
        log_std: [*M, L, A] or [*M, L, 1] float, log sigma (one per entry of theta, or one per feature).
        noise: [*K, L, A] float, standard-normal xi; leading dims (e.g. one matrix per env) broadcast
            against those of ``log_std``.

    Returns:
        [*broadcast(M, K), L, A] float, differentiable in ``log_std`` (reparameterised).

    Raises:
        ShapeError: an input is not floating or has fewer than 2 dims, the L dims differ, or
            ``log_std``'s last dim is neither 1 nor A.

    Reference: Raffin et al. (2022), section 3.
    """
    _check("noise", noise, 2)
    _check_log_std(log_std, act_dim=noise.shape[-1])
    if log_std.shape[-2] != noise.shape[-2]:
        raise ShapeError(f"log_std: {log_std.shape[-2]} feature rows, noise has {noise.shape[-2]} (shape {tuple(noise.shape)})")
    return torch.exp(log_std) * noise


def draw_exploration_matrix(
    log_std: Tensor, act_dim: int, generator: torch.Generator | None, batch_shape: Sequence[int] = ()
) -> Tensor:
    """:func:`exploration_matrix` with xi drawn from ``generator``: [*batch_shape, L, A] (not differentiable).

    Args:
        log_std: [L, A] or [L, 1] float, log sigma of one learner (no leading dims).
        act_dim: A, the action dim.
        generator: the random stream (on ``log_std``'s device); None uses the global default one.
        batch_shape: leading shape, e.g. ``(num_envs,)`` for one independent matrix per env.

    Returns:
        [*batch_shape, L, A] float, ``log_std``'s dtype and device.

    Raises:
        ShapeError: ``log_std`` is not [L, A] or [L, 1].
    """
    _check_log_std(log_std, act_dim=act_dim)
    if log_std.ndim != 2:
        raise ShapeError(f"log_std: expected shape [L, A] or [L, 1], got {tuple(log_std.shape)}")
    xi = torch.randn((*batch_shape, log_std.shape[0], act_dim), generator=generator, device=log_std.device, dtype=log_std.dtype)
    return exploration_matrix(log_std.detach(), xi)


def resample_due(step: int, sde_sample_freq: int) -> bool:
    """Whether a new exploration matrix is drawn before acting at ``step`` (0-based, within a rollout).

    A matrix is drawn at step 0 and then every ``sde_sample_freq`` steps; ``sde_sample_freq <= 0``
    keeps the step-0 matrix for the whole rollout (stable-baselines3's ``sde_sample_freq=-1``).
    """
    if step < 0:
        raise ConfigError(f"step={step}: expected >= 0")
    return step == 0 or (sde_sample_freq > 0 and step % sde_sample_freq == 0)


def sde_noise(latent: Tensor, exploration_matrix: Tensor) -> Tensor:
    """eps = z @ theta: the action noise of features z under exploration matrix theta.

    Args:
        latent: [*B, L] float, the policy's last hidden features z(s) (pass them detached unless the
            features are to be learned through the noise).
        exploration_matrix: [*B, L, A] float (one matrix per batch element, e.g. per env) or [L, A]
            (one shared matrix).

    Returns:
        [*B, A] float.

    Raises:
        ShapeError: not floating, too few dims, the L dims differ, or the batch dims do not broadcast.
    """
    _check("latent", latent, 1)
    _check("exploration_matrix", exploration_matrix, 2)
    if exploration_matrix.shape[-2] != latent.shape[-1]:
        raise ShapeError(
            f"exploration_matrix: shape {tuple(exploration_matrix.shape)} has {exploration_matrix.shape[-2]} rows, "
            f"latent has {latent.shape[-1]} features"
        )
    if exploration_matrix.ndim == 2:
        return latent @ exploration_matrix
    try:
        return (latent.unsqueeze(-2) @ exploration_matrix).squeeze(-2)
    except RuntimeError as err:
        raise ShapeError(
            f"latent {tuple(latent.shape)} and exploration_matrix {tuple(exploration_matrix.shape)}: batch dims do not broadcast"
        ) from err


def sde_log_std(latent: Tensor, log_std: Tensor, *, epsilon: float = EPSILON) -> Tensor:
    """Per-action log std of the gSDE policy: 0.5 * log((z^2) @ sigma^2 + epsilon).

    Args:
        latent: [*B, L] float, features z(s).
        log_std: [L, A] or [L, 1] float, log sigma (a [L, 1] column is shared by all A actions).
        epsilon: variance floor, > 0, so a zero feature vector gives a finite log-likelihood.

    Returns:
        [*B, A'] float, A' = log_std's last dim (1 when shared: it broadcasts over the actions).

    Raises:
        ShapeError: not floating, too few dims, or the L dims differ. ConfigError: epsilon <= 0.
    """
    _check("latent", latent, 1)
    _check_log_std(log_std, latent)
    if not epsilon > 0:
        raise ConfigError(f"epsilon={epsilon!r}: expected > 0")
    dtype = torch.promote_types(latent.dtype, log_std.dtype)  # as the Gaussian functions (a double-precision latent, float32 log_std)
    variance = latent.to(dtype).square() @ torch.exp(2.0 * log_std.to(dtype))
    return 0.5 * torch.log(variance + epsilon)


def _expand(action_log_std: Tensor, act_dim: int, name: str) -> Tensor:
    """The per-action log std [*B, A] from [*B, A'] (A' = 1: shared); ShapeError naming ``name`` (the
    argument that gave A) when A' is neither 1 nor A (it was torch's "expanded size" error)."""
    if action_log_std.shape[-1] not in (1, act_dim):
        raise ShapeError(f"{name}: {act_dim} actions, but log_std has {action_log_std.shape[-1]} columns (expected 1, "
                         f"shared, or {act_dim})")
    return action_log_std.expand(*action_log_std.shape[:-1], act_dim)


def sde_log_prob(
    action: Tensor | None,
    loc: Tensor,
    latent: Tensor,
    log_std: Tensor,
    *,
    pre_tanh: Tensor | None = None,
    squash: bool = False,
    epsilon: float = EPSILON,
) -> Tensor:
    """log pi(a|s) = log N(a; mu(s), diag((z^2) @ sigma^2 + epsilon)), or its tanh-squashed form.

    Without ``squash`` the action is the Gaussian sample mu + z @ theta itself (clip it outside, in
    the env, as stable-baselines3 does). With ``squash`` the action is tanh(u), u = mu + z @ theta,
    scored with the exact tanh Jacobian (see ``rlfunc.core.distributions.tanh_gaussian_log_prob``; pass
    ``pre_tanh`` = u when you have it).

    Args:
        action: [*B, A] float, or None with ``squash`` and ``pre_tanh`` given.
        loc: [*B, A] float, the mean mu(s).
        latent: [*B, L] float, features z(s) (detach them for SB3's default, learn_features=False).
        log_std: [L, A] or [L, 1] float, log sigma of the exploration matrix.
        pre_tanh: [*B, A] float, u, only with ``squash``.
        squash: score tanh(u) instead of u.
        epsilon: variance floor (> 0).

    Returns:
        [*B, 1] float, summed over the action dim.

    Raises:
        ShapeError / ConfigError: as :func:`sde_log_std` and the ``rlfunc.core.distributions`` functions;
            ``pre_tanh`` given without ``squash``.

    Reference: Raffin et al. (2022), section 3.
    """
    std_log = _expand(sde_log_std(latent, log_std, epsilon=epsilon), loc.shape[-1], f"loc (shape {tuple(loc.shape)})")
    if not squash:
        if pre_tanh is not None:
            raise ConfigError("pre_tanh is given but squash=False: the action is the Gaussian sample itself")
        if action is None:
            raise ConfigError("action=None: give the action to score")
        return gaussian_log_prob(action, loc, std_log)
    return tanh_gaussian_log_prob(action, loc, std_log, pre_tanh)


def sde_entropy(latent: Tensor, log_std: Tensor, act_dim: int, *, epsilon: float = EPSILON) -> Tensor:
    """Entropy of N(mu(s), diag((z^2) @ sigma^2 + epsilon)): sum_j [log std_j + (1 + log 2 pi) / 2].

    The entropy of the Gaussian before any squashing (stable-baselines3 returns none for the squashed
    case; this is the usual stand-in).

    Args:
        latent: [*B, L] float, features z(s).
        log_std: [L, A] or [L, 1] float, log sigma.
        act_dim: A, the action dim (needed when ``log_std`` is a shared [L, 1] column).
        epsilon: variance floor (> 0).

    Returns:
        [*B, 1] float.

    Raises:
        ShapeError: as :func:`sde_log_std`, or ``log_std`` has neither 1 nor ``act_dim`` columns.
        ConfigError: ``act_dim`` is not an int >= 1, or as :func:`sde_log_std`.
    """
    if isinstance(act_dim, bool) or not isinstance(act_dim, numbers.Integral) or act_dim < 1:
        raise ConfigError(f"act_dim={act_dim!r}: expected an int >= 1")
    act_dim = int(act_dim)
    return gaussian_entropy(_expand(sde_log_std(latent, log_std, epsilon=epsilon), act_dim, f"act_dim={act_dim}"))


def sde_sample(loc: Tensor, latent: Tensor, exploration_matrix: Tensor, *, squash: bool = False) -> tuple[Tensor, Tensor]:
    """a = mu + z @ theta (or tanh of it with ``squash``).

    Args:
        loc: [*B, A] float, the mean mu(s).
        latent: [*B, L] float, features z(s).
        exploration_matrix: [*B, L, A] or [L, A] float, theta (see :func:`draw_exploration_matrix`).
        squash: apply tanh (actions in (-1, 1)).

    Returns:
        (action [*B, A], pre_tanh [*B, A]); without ``squash`` both are the same tensor.

    Raises:
        ShapeError: as :func:`sde_noise`, or ``loc``'s last dim is not A.
    """
    noise = sde_noise(latent, exploration_matrix)
    if noise.shape[-1] != loc.shape[-1]:
        raise ShapeError(f"loc: last dim is {loc.shape[-1]}, the exploration matrix gives {noise.shape[-1]} actions")
    u = loc + noise
    return (torch.tanh(u) if squash else u), u

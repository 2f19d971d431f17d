"""DDPM training: the forward (noising) process and the denoising loss (Ho et al. 2020).

An action chunk x_0 is [*B, H, A]; a timestep t is int64 [*B] in [0, T); a condition (observation
features) is [*B, C]. The denoiser is a pure function ``apply(params, x_t, t, cond) -> [*B, H, A]``
(e.g. ``functools.partial(rlfunc.core.func.apply, ConditionalUnet1D(...))``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from rlfunc.core.func import reads_values
from rlfunc.diffusion.schedule import alpha_prod
from rlfunc.errors import ConfigError, ShapeError

__all__ = ["denoising_loss", "q_sample", "sample_timesteps"]

_PREDICTIONS = ("epsilon", "sample")
_REDUCTIONS = ("mean", "none")


def _check_chunk(x0: Tensor, noise: Tensor, t: Tensor) -> torch.Size:
    """The batch shape *B of ``x0`` [*B, H, A]; ShapeError naming the argument that disagrees."""
    for name, x in (("x0", x0), ("noise", noise)):
        if not isinstance(x, Tensor) or x.ndim < 2 or not x.is_floating_point():
            raise ShapeError(
                f"{name}: expected a float tensor [*B, H, A], got "
                f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__} {getattr(x, 'dtype', '')}"
            )
    if noise.shape != x0.shape:
        raise ShapeError(f"noise: shape {tuple(noise.shape)} differs from x0's {tuple(x0.shape)}")
    batch = x0.shape[:-2]
    if not isinstance(t, Tensor) or t.dtype != torch.int64:
        raise ShapeError(f"t: expected an int64 tensor [*B], got {getattr(t, 'dtype', type(t).__name__)}")
    if t.shape != batch and t.ndim != 0:
        raise ShapeError(f"t: shape {tuple(t.shape)}, expected the batch shape {tuple(batch)} of x0 {tuple(x0.shape)} (or 0-d)")
    return batch


def q_sample(x0: Tensor, t: Tensor, noise: Tensor, alphas_cumprod: Tensor) -> Tensor:
    """x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, a draw from q(x_t | x_0) with eps given.

    Args:
        x0: [*B, H, A] float, clean action chunks x_0.
        t: [*B] (or 0-d) int64 timesteps in [0, T) (-1 gives x_0 itself).
        noise: [*B, H, A] float, standard-normal eps.
        alphas_cumprod: [T] float, the schedule's abar.

    Returns:
        [*B, H, A] in ``x0``'s dtype (the coefficients are cast to it). Differentiable in x0 and noise.

    Raises:
        ShapeError: ``x0`` / ``noise`` are not float [*B, H, A] of one shape, or ``t`` is not int64 of
            shape *B (or 0-d), or (on the CPU, where reading it is free; not under torch.compile or a
            torch.func transform) has values outside [-1, T).

    Reference: Ho, Jain & Abbeel (2020), eq. 4.
    """
    _check_chunk(x0, noise, t)
    if t.device.type == "cpu" and t.numel() and reads_values(t):  # t = T was an IndexError
        lo, hi = int(t.min()), int(t.max())
        if lo < -1 or hi >= alphas_cumprod.shape[-1]:
            raise ShapeError(f"t: timesteps in [{lo}, {hi}], expected values in [-1, {alphas_cumprod.shape[-1] - 1}] "
                             f"(T = {alphas_cumprod.shape[-1]} = len(alphas_cumprod); -1: x0 itself)")
    a = alpha_prod(alphas_cumprod, t)[..., None, None].to(x0.dtype)
    return a.sqrt() * x0 + (1.0 - a).sqrt() * noise


def sample_timesteps(
    batch_shape: Sequence[int] | torch.Size,
    num_train_steps: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Training timesteps t ~ Uniform{0, ..., T-1}, one per sample.

    Args:
        batch_shape: *B.
        num_train_steps: T >= 1.
        generator: the random stream (on ``device``); None uses the device's default generator.
        device: where to create them.

    Returns:
        [*B] int64 on ``device``.

    Raises:
        ConfigError: T < 1.
    """
    if isinstance(num_train_steps, bool) or not isinstance(num_train_steps, int) or num_train_steps < 1:
        raise ConfigError(f"num_train_steps={num_train_steps!r}: expected an int >= 1")
    return torch.randint(0, num_train_steps, tuple(batch_shape), generator=generator, device=device, dtype=torch.int64)


def denoising_loss(
    apply: Callable[[Any, Tensor, Tensor, Any], Tensor],
    params: Any,
    x0: Tensor,
    cond: Any,
    t: Tensor,
    noise: Tensor,
    alphas_cumprod: Tensor,
    *,
    prediction: str = "epsilon",
    reduction: str = "mean",
) -> Tensor:
    """The simplified DDPM loss || f_theta(x_t, t, s) - y ||^2 with x_t = q_sample(x_0, t, eps).

    y = eps for ``prediction="epsilon"`` (Ho et al. 2020, eq. 14, "L_simple") and y = x_0 for
    ``prediction="sample"``. The squared error is averaged over H and A, then over the batch.
    It is computed in float32 even when ``apply`` returns bfloat16/float16 (under autocast).

    Args:
        apply: ``apply(params, x_t [*B, H, A], t [*B] int64, cond) -> [*B, H, A]``.
        params: the denoiser's parameters (a TensorDict), passed to ``apply`` as is.
        x0: [*B, H, A] float, demonstration action chunks.
        cond: [*B, C] conditioning (observation features), passed to ``apply`` as is; a tensor's
            leading dims are checked against *B.
        t: [*B] int64 timesteps in [0, T) (``sample_timesteps``).
        noise: [*B, H, A] float, standard-normal eps.
        alphas_cumprod: [T] float, the schedule's abar.
        prediction: "epsilon" (the denoiser predicts eps) or "sample" (it predicts x_0).
        reduction: "mean" (a scalar) or "none" ([*B], the per-sample mean over H and A).

    Returns:
        0-d float32 ("mean") or [*B] float32 ("none"), differentiable in ``params``.

    Raises:
        ConfigError: unknown ``prediction`` or ``reduction``.
        ShapeError: ``x0`` / ``noise`` / ``t`` / ``cond`` disagree on shapes (see :func:`q_sample`),
            or ``apply`` returns a shape other than ``x0``'s.

    Reference: Ho, Jain & Abbeel (2020), Algorithm 1; Chi et al. (2023), "Diffusion Policy", sec. 3.
    """
    if prediction not in _PREDICTIONS:
        raise ConfigError(f"prediction={prediction!r}: expected one of {', '.join(_PREDICTIONS)}")
    if reduction not in _REDUCTIONS:
        raise ConfigError(f"reduction={reduction!r}: expected one of {', '.join(_REDUCTIONS)}")
    batch = _check_chunk(x0, noise, t)
    if isinstance(cond, Tensor) and cond.shape[:-1] != batch:
        raise ShapeError(f"cond: shape {tuple(cond.shape)}, expected [*B, C] with *B = {tuple(batch)} from x0 {tuple(x0.shape)}")
    x_t = q_sample(x0, t, noise, alphas_cumprod)
    pred = apply(params, x_t, t.expand(batch), cond)
    if pred.shape != x0.shape:
        raise ShapeError(f"apply returned shape {tuple(pred.shape)}, expected x0's {tuple(x0.shape)}")
    target = noise if prediction == "epsilon" else x0
    per_sample = (pred.float() - target.float()).square().mean(dim=(-2, -1))
    return per_sample.mean() if reduction == "mean" else per_sample

"""DDIM sampling with the autograd graph kept, and the log-likelihood of a stored denoising chain.

A DDIM step (Song et al. 2021, eq. 12) from timestep t to t' < t, with a = abar_t, a' = abar_{t'}:

    x0_hat = (x_t - sqrt(1 - a) eps_hat) / sqrt(a)                       (eps_hat = f_theta(x_t, t, s))
    sigma  = eta sqrt((1 - a') / (1 - a)) sqrt(1 - a / a')
    x_t'   = sqrt(a') x0_hat + sqrt(1 - a' - sigma^2) eps_hat + sigma z,   z ~ N(0, I)

eta = 0 is the deterministic DDIM sampler, eta = 1 matches DDPM's posterior variance. DPPO (Ren et al.
2024) treats every step as a Gaussian policy pi(x_t' | x_t, s) = N(mean, std^2 I) with the std
floored at ``std_floor`` (so eta = 0 and the last step, where sigma = 0, keep a finite density), and
fine-tunes the denoiser with PPO on the chain's per-step log-likelihoods (:func:`chain_log_prob`).

Shapes: an action chunk is [*B, H, A]; ``cond`` [*B, C]; ``noise`` for :func:`sample` is
[K+1, *B, H, A]; a chain is [*B, K+1, H, A] with index 0 the pure noise x_K and index K the action x_0.
The denoiser is ``apply(params, x [*B, H, A], t [*B] int64, cond [*B, C]) -> [*B, H, A]``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from tensordict import TensorDictBase
from torch import Tensor

from rlfunc.core.func import reads_values, under_transform
from rlfunc.core.shapes import broadcast_shapes
from rlfunc.diffusion.schedule import alpha_prod, ddim_timesteps
from rlfunc.errors import ConfigError, ShapeError

__all__ = ["chain_log_prob", "ddim_step", "gaussian_chain_log_prob", "sample"]

_PREDICTIONS = ("epsilon", "sample")
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)

Apply = Callable[[Any, Tensor, Tensor, Any], Tensor]


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def _check_options(eta: float, prediction: str, clip_sample: float | None, std_floor: float) -> None:
    if not isinstance(eta, numbers.Real) or not 0 <= eta < math.inf:  # inf gave NaN samples
        raise ConfigError(f"eta={eta!r}: expected a finite number >= 0 (0: deterministic DDIM, 1: DDPM variance)")
    if prediction not in _PREDICTIONS:
        raise ConfigError(f"prediction={prediction!r}: expected one of {', '.join(_PREDICTIONS)}")
    if clip_sample is not None and (not isinstance(clip_sample, numbers.Real) or not clip_sample > 0):
        raise ConfigError(f"clip_sample={clip_sample!r}: expected None (no clipping) or a number > 0")
    if not isinstance(std_floor, numbers.Real) or not 0 <= std_floor < math.inf:
        raise ConfigError(f"std_floor={std_floor!r}: expected a finite number >= 0")


def _alphas_cumprod(schedule: TensorDictBase) -> Tensor:
    if not isinstance(schedule, TensorDictBase) or "alphas_cumprod" not in schedule.keys():
        raise ConfigError("schedule: expected the TensorDict of make_schedule, with an 'alphas_cumprod' entry")
    alphas_cumprod = schedule.get("alphas_cumprod")
    if alphas_cumprod.ndim != 1 or alphas_cumprod.numel() < 1:
        raise ShapeError(f"schedule['alphas_cumprod']: expected shape [T], got {tuple(alphas_cumprod.shape)}")
    return alphas_cumprod


def _check_num_steps(num_steps: int, T: int) -> None:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or not 1 <= num_steps <= T:
        raise ConfigError(f"num_steps={num_steps!r}: expected an int in [1, T={T}] (T = len(schedule['alphas_cumprod']))")


def _check_cond(cond: Any, batch: torch.Size, what: str) -> None:
    if isinstance(cond, Tensor) and (cond.ndim < 1 or cond.shape[:-1] != batch):
        raise ShapeError(f"cond: shape {tuple(cond.shape)}, expected [*B, C] with *B = {tuple(batch)} from {what}")


# --------------------------------------------------------------------------------------------
# One step
# --------------------------------------------------------------------------------------------


def _coefficients(a_t: Tensor, a_prev: Tensor, eta: float, std_floor: float) -> tuple[Tensor, ...]:
    """(sqrt(a), sqrt(1 - a), sqrt(a'), sqrt(max(1 - a' - sigma^2, 0)), max(sigma, std_floor)),
    elementwise in the shape of ``a_t`` / ``a_prev``; they depend on the timesteps only."""
    one_minus = 1.0 - a_t
    sigma = eta * ((1.0 - a_prev) / one_minus).sqrt() * (1.0 - a_t / a_prev).clamp(min=0.0).sqrt()
    direction = (1.0 - a_prev - sigma.square()).clamp(min=0.0).sqrt()
    return a_t.sqrt(), one_minus.sqrt(), a_prev.sqrt(), direction, sigma.clamp(min=std_floor)


def _mean(
    model_output: Tensor,
    x: Tensor,
    coefs: tuple[Tensor, ...],
    prediction: str,
    clip_sample: float | None,
) -> Tensor:
    """The DDIM mean sqrt(a') x0_hat + sqrt(1 - a' - sigma^2) eps_hat (see the module docstring)."""
    sqrt_a, sqrt_one_minus_a, sqrt_a_prev, direction = coefs[:4]
    model_output = model_output.to(x.dtype)
    if prediction == "epsilon":
        eps = model_output
        x0 = (x - sqrt_one_minus_a * eps) / sqrt_a
    else:
        x0 = model_output
    if clip_sample is not None:
        x0 = x0.clamp(-clip_sample, clip_sample)
    if prediction == "sample" or clip_sample is not None:  # eps consistent with the (clipped) x0_hat
        eps = (x - sqrt_a * x0) / sqrt_one_minus_a
    return sqrt_a_prev * x0 + direction * eps


def ddim_step(
    model_output: Tensor,
    x: Tensor,
    t: Tensor,
    t_prev: Tensor,
    alphas_cumprod: Tensor,
    *,
    eta: float,
    noise: Tensor | None = None,
    prediction: str = "epsilon",
    clip_sample: float | None = 1.0,
    std_floor: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """One DDIM step x_t -> x_t' = mean + std z: the Gaussian N(mean, std^2 I) and a draw from it.

    With a = abar_t, a' = abar_{t'} (a' = 1 when t' = -1):

        x0_hat = (x_t - sqrt(1 - a) eps_hat) / sqrt(a)      ("epsilon": eps_hat = model_output)
        x0_hat = model_output,  eps_hat = (x_t - sqrt(a) x0_hat) / sqrt(1 - a)      ("sample")
        x0_hat <- clamp(x0_hat, -clip_sample, clip_sample), eps_hat <- (x_t - sqrt(a) x0_hat) / sqrt(1 - a)
        sigma  = eta sqrt((1 - a') / (1 - a)) sqrt(1 - a / a')
        mean   = sqrt(a') x0_hat + sqrt(max(1 - a' - sigma^2, 0)) eps_hat
        std    = max(sigma, std_floor),   x_t' = mean + std z

    Args:
        model_output: [*B, H, A] float, the denoiser's output at (x_t, t) (cast to ``x``'s dtype).
        x: [*B, H, A] float, the current sample x_t.
        t: [*B] or 0-d int64, the current timestep in [0, T).
        t_prev: [*B] or 0-d int64, the timestep stepped to, t' < t, or -1 for the clean sample.
        alphas_cumprod: [T] float, the schedule's abar.
        eta: >= 0, the scale of the step's noise (0: deterministic DDIM; 1: DDPM's posterior variance).
        noise: [*B, H, A] standard-normal z, or None for x_t' = mean.
        prediction: "epsilon" or "sample": what ``model_output`` predicts.
        clip_sample: clamp x0_hat to [-clip_sample, clip_sample] (and recompute eps_hat from it), or
            None for no clamping.
        std_floor: >= 0, lower bound of the std (DPPO's minimum sampling / likelihood std).

    Returns:
        (x_prev, mean, std): x_prev and mean [*B, H, A], std [*B, 1, 1]; in ``x``'s dtype by type
        promotion with ``alphas_cumprod``. Differentiable in model_output and x.

    Raises:
        ConfigError: eta < 0, std_floor < 0, clip_sample <= 0, unknown ``prediction``, a ``t`` outside
            [0, T) or a ``t_prev`` outside [-1, t) (values not checked under torch.compile, nor of
            timesteps batched by torch.func.vmap: a host read).
        ShapeError: model_output / x / noise are not float [*B, H, A] of one shape, t / t_prev are
            not int64 of shape *B (or 0-d), or ``alphas_cumprod`` is not a float tensor [T] (the
            schedule TensorDict itself included: pass ``schedule["alphas_cumprod"]``).

    References: Song, Meng & Ermon (2021), "Denoising Diffusion Implicit Models", eq. 12 and 16;
    Ren et al. (2024), "Diffusion Policy Policy Optimization", sec. 4.
    """
    _check_options(eta, prediction, clip_sample, std_floor)
    if not isinstance(alphas_cumprod, Tensor) or alphas_cumprod.ndim != 1 or not alphas_cumprod.is_floating_point():
        got = (f"a {type(alphas_cumprod).__name__}; pass schedule['alphas_cumprod']" if isinstance(alphas_cumprod, TensorDictBase)
               else f"shape {tuple(alphas_cumprod.shape)} dtype {alphas_cumprod.dtype}" if isinstance(alphas_cumprod, Tensor)
               else type(alphas_cumprod).__name__)
        raise ShapeError(f"alphas_cumprod: expected the schedule's float tensor [T], got {got}")
    for name, tensor in (("x", x), ("model_output", model_output), ("noise", noise)):
        if tensor is None:
            continue
        if not isinstance(tensor, Tensor) or tensor.ndim < 2 or not tensor.is_floating_point():
            raise ShapeError(f"{name}: expected a float tensor [*B, H, A], got {getattr(tensor, 'shape', type(tensor).__name__)}")
        if tensor.shape != x.shape:
            raise ShapeError(f"{name}: shape {tuple(tensor.shape)} differs from x's {tuple(x.shape)}")
    batch = x.shape[:-2]
    for name, tensor in (("t", t), ("t_prev", t_prev)):
        if not isinstance(tensor, Tensor) or tensor.dtype != torch.int64:
            raise ShapeError(f"{name}: expected an int64 tensor, got {getattr(tensor, 'dtype', type(tensor).__name__)}")
        if tensor.ndim != 0 and tensor.shape != batch:
            raise ShapeError(f"{name}: shape {tuple(tensor.shape)}, expected the batch shape {tuple(batch)} of x (or 0-d)")
    if reads_values(t, t_prev):  # values: one host read (not under compile, nor of timesteps batched by vmap)
        T = alphas_cumprod.shape[-1]
        if bool(((t < 0) | (t >= T)).any()):
            raise ConfigError(f"t: expected timesteps in [0, {T}) (the schedule's length), got {t.tolist()}")
        if bool(((t_prev < -1) | (t_prev >= t)).any()):
            raise ConfigError(f"t_prev: expected -1 <= t_prev < t (a step towards the clean sample), got t_prev {t_prev.tolist()} "
                              f"for t {t.tolist()}")
    a_t = alpha_prod(alphas_cumprod, t)[..., None, None]
    a_prev = alpha_prod(alphas_cumprod, t_prev)[..., None, None]
    coefs = _coefficients(a_t, a_prev, eta, std_floor)
    mean = _mean(model_output, x, coefs, prediction, clip_sample)
    std = coefs[4].expand(*batch, 1, 1)
    x_prev = mean if noise is None else mean + std * noise
    return x_prev, mean, std


# --------------------------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------------------------


def _denoise(
    apply: Apply,
    params: Any,
    x: Tensor,
    t: Tensor,
    cond: Any,
    noise: Tensor,
    coefs: tuple[Tensor, ...],
    prediction: str,
    clip_sample: float | None,
) -> Tensor:
    """One denoising step of :func:`sample`: apply, then the DDIM update with the step's noise."""
    out = apply(params, x, t, cond)
    if out.shape != x.shape:  # the bug: a denoiser of the wrong action dim or batch was broadcast, silently
        raise ShapeError(f"apply returned shape {tuple(out.shape)}, expected {tuple(x.shape)} (the sample's)")
    mean = _mean(out, x, coefs, prediction, clip_sample)
    return mean + coefs[4] * noise


def sample(
    apply: Apply,
    params: Any,
    cond: Any,
    noise: Tensor,
    schedule: TensorDictBase,
    num_steps: int,
    eta: float = 1.0,
    *,
    spacing: str = "leading",
    prediction: str = "epsilon",
    clip_sample: float | None = 1.0,
    std_floor: float = 0.0,
    return_chain: bool = False,
    checkpoint: bool = False,
    frozen_params: Any = None,
    finetune_steps: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Draw action chunks with K DDIM steps, x_K = noise[0] -> x_{K-1} -> ... -> x_0, keeping the graph.

    Denoising step k = 1..K goes from timestep tau_k = ``ddim_timesteps(T, K)[0][k-1]`` to the next
    one (or to the clean sample after the last) with :func:`ddim_step` and the noise z = noise[k].
    Nothing is detached: a loss on x_0 back-propagates into every parameter of ``params`` that the
    denoiser uses, through all K steps (DPPO and reward-gradient fine-tuning). Call it under
    ``torch.no_grad()`` for rollouts.

    Args:
        apply: ``apply(params, x [*B, H, A], t [*B] int64, cond) -> [*B, H, A]``.
        params: the denoiser's parameters (a TensorDict), passed to ``apply`` as is.
        cond: [*B, C] conditioning, passed to ``apply`` unchanged at every step.
        noise: [K+1, *B, H, A] float, standard normal: noise[0] is x_K, noise[k] the noise of step k.
        schedule: the TensorDict of :func:`rlfunc.diffusion.schedule.make_schedule`; T = its length.
        num_steps: K in [1, T].
        eta: >= 0, DDIM's noise scale (0: deterministic; 1: DDPM variance).
        spacing: "leading" or "linspace" (:func:`rlfunc.diffusion.schedule.ddim_timesteps`).
        prediction: "epsilon" or "sample": what the denoiser predicts.
        clip_sample: clamp of x0_hat (None: none), as :func:`ddim_step`.
        std_floor: >= 0, lower bound of every step's std (also where eta = 0; DPPO's exploration noise).
        return_chain: also return every intermediate sample.
        checkpoint: recompute each step's activations in the backward pass
            (``torch.utils.checkpoint``, non-reentrant) instead of keeping them: activation memory of
            one step instead of K, for about one extra forward. Same values and gradients. Under a
            torch.func transform (``grad``, ``vjp`` ...), which torch's checkpoint does not support
            (saved-tensor hooks), the steps keep their activations: the same numbers, K steps' memory.
        frozen_params: with ``finetune_steps``, the parameters of the first K - K' steps, which run
            under ``torch.no_grad()`` (DPPO fine-tunes only the last K' denoising steps).
        finetune_steps: K' in [0, K], the number of last steps that use ``params``; requires
            ``frozen_params``.

    Returns:
        x_0 [*B, H, A], or (x_0, chain) with ``return_chain``: chain [*B, K+1, H, A],
        chain[..., 0, :, :] = x_K = noise[0] and chain[..., K, :, :] = x_0. Dtype of ``noise``.

    Raises:
        ConfigError: num_steps outside [1, T], eta < 0, std_floor < 0, clip_sample <= 0, unknown
            ``prediction`` / ``spacing``, a bad schedule, or only one of ``frozen_params`` /
            ``finetune_steps`` (or K' outside [0, K]).
        ShapeError: ``noise`` is not float [K+1, *B, H, A], or ``cond``'s leading dims are not *B.

    References: Song, Meng & Ermon (2021), Algorithm (eq. 12); Ren et al. (2024), "Diffusion Policy
    Policy Optimization", sec. 4-5 (the denoising MDP, fine-tuning the last K' steps).
    """
    _check_options(eta, prediction, clip_sample, std_floor)
    alphas_cumprod = _alphas_cumprod(schedule)
    T = alphas_cumprod.shape[0]
    _check_num_steps(num_steps, T)
    K = num_steps
    if (frozen_params is None) != (finetune_steps is None):
        raise ConfigError(
            f"frozen_params and finetune_steps={finetune_steps!r}: give both (fine-tune the last K' steps) or neither"
        )
    if finetune_steps is not None and (
        isinstance(finetune_steps, bool) or not isinstance(finetune_steps, int) or not 0 <= finetune_steps <= K
    ):
        raise ConfigError(f"finetune_steps={finetune_steps!r}: expected an int in [0, num_steps={K}]")
    if not isinstance(noise, Tensor) or noise.ndim < 3 or not noise.is_floating_point() or noise.shape[0] != K + 1:
        raise ShapeError(
            f"noise: expected a float tensor [K+1={K + 1}, *B, H, A], got "
            f"{tuple(noise.shape) if isinstance(noise, Tensor) else type(noise).__name__}"
        )
    batch = noise.shape[1:-2]
    _check_cond(cond, batch, f"noise {tuple(noise.shape)} = [K+1, *B, H, A]")

    timesteps, prev = ddim_timesteps(T, K, spacing=spacing, device=alphas_cumprod.device)
    coefs = _coefficients(alpha_prod(alphas_cumprod, timesteps), alpha_prod(alphas_cumprod, prev), eta, std_floor)
    t_batch = timesteps.view(K, *(1,) * len(batch)).expand(K, *batch).contiguous()  # [K, *B]
    frozen = K - finetune_steps if finetune_steps is not None else 0

    x = noise[0]
    chain = [x] if return_chain else None
    for i in range(K):  # denoising step k = i + 1
        coefs_i = tuple(c[i] for c in coefs)
        args = (x, t_batch[i], cond, noise[i + 1], coefs_i, prediction, clip_sample)
        if i < frozen:
            with torch.no_grad():
                x = _denoise(apply, frozen_params, *args)
        elif checkpoint and torch.is_grad_enabled() and not under_transform():
            x = torch.utils.checkpoint.checkpoint(_denoise, apply, params, *args, use_reentrant=False)
        else:
            x = _denoise(apply, params, *args)
        if chain is not None:
            chain.append(x)
    if chain is None:
        return x
    return x, torch.stack(chain, dim=-3)


# --------------------------------------------------------------------------------------------
# Log-likelihood of a chain
# --------------------------------------------------------------------------------------------


def gaussian_chain_log_prob(x_next: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """log N(x'; mean, std^2 I) = sum_{h, a} [-(x' - mean)^2 / (2 std^2) - log std - log(2 pi) / 2].

    Args:
        x_next: [*B, H, A] float, the sample x'.
        mean: [*B, H, A] float.
        std: finite and > 0, a Python float or a float tensor broadcasting to [*B, H, A], typically
            [*B, 1, 1] (one std per sample and step).

    Returns:
        [*B] float, summed over H and A.

    Raises:
        ShapeError: ``x_next`` and ``mean`` differ in shape or are below 2-d, or ``std`` is not a
            float / float tensor or does not broadcast.
        ConfigError: a ``std`` that is <= 0, NaN or inf (not checked inside torch.compile, nor of a std
            batched by torch.func.vmap: a host read).
    """
    if x_next.ndim < 2 or x_next.shape != mean.shape:
        raise ShapeError(f"x_next {tuple(x_next.shape)} and mean {tuple(mean.shape)}: expected one shape [*B, H, A]")
    if isinstance(std, numbers.Real) and not isinstance(std, bool):
        if not (math.isfinite(std) and std > 0):
            raise ConfigError(f"std={std}: expected a finite number > 0")
        std = torch.tensor(float(std), dtype=x_next.dtype, device=x_next.device)
    elif not isinstance(std, Tensor) or not std.is_floating_point():
        raise ShapeError(f"std: expected a float or a float tensor, got "
                         f"{std.dtype if isinstance(std, Tensor) else type(std).__name__}")
    try:
        broadcast_shapes(std.shape, x_next.shape)
    except RuntimeError as err:
        raise ShapeError(f"std: shape {tuple(std.shape)} does not broadcast to {tuple(x_next.shape)}") from err
    if reads_values(std) and not bool((torch.isfinite(std) & (std > 0)).all()):  # std 0 gave NaN, silently
        raise ConfigError(f"std: {int((~(torch.isfinite(std) & (std > 0))).sum())} of {std.numel()} values are <= 0, "
                          "NaN or inf; expected finite values > 0")
    return _gaussian_log_density(x_next, mean, std)


def _gaussian_log_density(x_next: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """:func:`gaussian_chain_log_prob` without its checks (``chain_log_prob``'s std >= std_floor)."""
    z = (x_next - mean) / std
    return (-0.5 * z.square() - std.log() - _HALF_LOG_2PI).sum(dim=(-2, -1))


def chain_log_prob(
    apply: Apply,
    params: Any,
    cond: Any,
    chain: Tensor,
    schedule: TensorDictBase,
    num_steps: int,
    eta: float = 1.0,
    *,
    spacing: str = "leading",
    prediction: str = "epsilon",
    clip_sample: float | None = 1.0,
    std_floor: float = 0.1,
    first_step: int = 0,
) -> Tensor:
    """Per-step log pi_theta(x^{k+1} | x^k, s) of a stored chain, for k = first_step .. K-1.

    Step k (0-based; chain index k -> k+1) is the Gaussian of :func:`ddim_step` at timestep
    tau = ``ddim_timesteps(T, K)[0][k]``: N(mean_k, std_k^2 I) with std_k = max(sigma_k, std_floor), its
    density summed over H and A. With the same eta, std_floor, spacing, prediction and clip_sample
    as :func:`sample` and the same params, this is exactly the density of the noise that sample drew
    (up to float rounding between batched and per-step denoiser calls). All steps are evaluated in
    one ``apply`` call on a batch of [*B * (K - first_step)] samples (the PPO update's hot path).

    Args:
        apply: ``apply(params, x [N, H, A], t [N] int64, cond [N, C]) -> [N, H, A]`` (called once,
            with N = prod(*B) * (K - first_step)).
        params: the parameters to evaluate (a TensorDict); differentiable.
        cond: [*B, C] float tensor, the conditioning the chain was sampled with.
        chain: [*B, K+1, H, A] float, from ``sample(..., return_chain=True)`` (x_K first, x_0 last).
        schedule: the TensorDict of ``make_schedule`` the chain was sampled with.
        num_steps: K in [1, T], the number of denoising steps of the chain.
        eta, spacing, prediction, clip_sample: as :func:`sample`.
        std_floor: > 0, lower bound of every step's std; must be positive since the last step's
            sigma is 0 for any eta (DPPO's minimum log-likelihood std).
        first_step: the first step k evaluated, in [0, K-1]; K - K' when only the last K' steps
            are fine-tuned.

    Returns:
        [*B, K - first_step] float (the chain's dtype), differentiable in ``params``.

    Raises:
        ConfigError: num_steps outside [1, T], first_step outside [0, K-1], std_floor <= 0, eta < 0,
            clip_sample <= 0, unknown ``prediction`` / ``spacing``, or a bad schedule.
        ShapeError: ``chain`` is not float [*B, K+1, H, A], or ``cond`` is not a [*B, C] tensor.

    Reference: Ren et al. (2024), "Diffusion Policy Policy Optimization", sec. 4 (eq. 4-5).
    """
    _check_options(eta, prediction, clip_sample, std_floor)
    if not std_floor > 0:
        raise ConfigError(f"std_floor={std_floor!r}: expected > 0 (the last step's sigma is 0, its density would be infinite)")
    alphas_cumprod = _alphas_cumprod(schedule)
    T = alphas_cumprod.shape[0]
    _check_num_steps(num_steps, T)
    K = num_steps
    if isinstance(first_step, bool) or not isinstance(first_step, int) or not 0 <= first_step < K:
        raise ConfigError(f"first_step={first_step!r}: expected an int in [0, num_steps - 1 = {K - 1}]")
    if not isinstance(chain, Tensor) or chain.ndim < 3 or not chain.is_floating_point() or chain.shape[-3] != K + 1:
        raise ShapeError(
            f"chain: expected a float tensor [*B, K+1={K + 1}, H, A], got "
            f"{tuple(chain.shape) if isinstance(chain, Tensor) else type(chain).__name__}"
        )
    batch, (H, A) = chain.shape[:-3], chain.shape[-2:]
    if not isinstance(cond, Tensor):
        raise ShapeError(f"cond: expected a [*B, C] tensor, got {type(cond).__name__}")
    _check_cond(cond, batch, f"chain {tuple(chain.shape)} = [*B, K+1, H, A]")

    n = K - first_step
    timesteps, prev = ddim_timesteps(T, K, spacing=spacing, device=alphas_cumprod.device)
    timesteps, prev = timesteps[first_step:], prev[first_step:]
    x = chain[..., first_step:K, :, :]  # [*B, n, H, A]
    x_next = chain[..., first_step + 1 :, :, :]
    t_flat = timesteps.expand(*batch, n).reshape(-1)
    cond_flat = cond.unsqueeze(-2).expand(*batch, n, cond.shape[-1]).reshape(-1, cond.shape[-1])
    out = apply(params, x.reshape(-1, H, A), t_flat, cond_flat)
    if out.shape != (t_flat.shape[0], H, A):
        raise ShapeError(f"apply returned shape {tuple(out.shape)}, expected {(t_flat.shape[0], H, A)}")
    a_t = alpha_prod(alphas_cumprod, timesteps)[:, None, None]  # [n, 1, 1], broadcasts over *B
    a_prev = alpha_prod(alphas_cumprod, prev)[:, None, None]
    coefs = _coefficients(a_t, a_prev, eta, std_floor)
    mean = _mean(out.reshape(x.shape), x, coefs, prediction, clip_sample)
    return _gaussian_log_density(x_next, mean, coefs[4])  # no host sync on the PPO update's hot path

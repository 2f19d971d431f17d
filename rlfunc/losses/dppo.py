"""DPPO: PPO over the denoising steps of a diffusion policy, as pure functions over tensors.

The environment MDP is unrolled into a two-layer MDP whose inner actions are the K denoising steps
x_k -> x_{k-1}; each step is a Gaussian pi_theta(x_{k-1} | x_k, s), so the PPO ratio is taken per
denoising step and every step shares the environment-level advantage A(s, a), discounted by
``denoising_discount ** (K - 1 - k)`` so that early (noisy) steps weigh less.

Reference: Ren et al. (2024), "Diffusion Policy Policy Optimization", sec. 4 (eq. 4.2-4.3) and
appendix C (denoising discount, clip-range schedule over denoising steps, std floors).
"""

from __future__ import annotations

import math
import numbers

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.core.func import reads_values
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.losses.checks import check_coefficient, check_number
from rlfunc.losses.ppo import explained_variance, explained_variance_parts, normalize_advantage


def clip_schedule(num_steps: int, clip_min: float, clip_max: float, rate: float = 3.0, *, device=None) -> Tensor:
    """Per-denoising-step clip range, growing from ``clip_min`` (first, noisiest step) to ``clip_max``
    (last step): eps_k = clip_min + (clip_max - clip_min) (e^{rate u_k} - 1) / (e^{rate} - 1), u_k = k / (K - 1).

    Returns:
        [K] float32. ``rate = 0`` gives a linear ramp; K = 1 gives ``[clip_max]``.

    Raises:
        ConfigError: ``num_steps`` not an int >= 1, or clip ranges not in 0 < clip_min <= clip_max.

    Reference: Ren et al. (2024), appendix C ("clip_ploss_coef" schedule).
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral) or num_steps < 1:  # 2.5 was linspace's TypeError
        raise ConfigError(f"num_steps={num_steps!r}: expected an int >= 1")
    num_steps = int(num_steps)
    for name, value in (("clip_min", clip_min), ("clip_max", clip_max), ("rate", rate)):  # a str: TypeError; inf/nan rate: NaN
        check_number(name, value)
    if not 0 < clip_min <= clip_max:
        raise ConfigError(f"clip_min={clip_min}, clip_max={clip_max}: expected 0 < clip_min <= clip_max")
    if num_steps == 1:
        return torch.full((1,), clip_max, dtype=torch.float32, device=device)
    u = torch.linspace(0.0, 1.0, num_steps, device=device)
    ramp = u if abs(rate) < 1e-8 else torch.expm1(rate * u) / math.expm1(rate)
    return clip_min + (clip_max - clip_min) * ramp


def dppo_loss(
    log_prob: Tensor,
    sample_log_prob: Tensor,
    advantage: Tensor,
    state_value: Tensor,
    value_target: Tensor,
    *,
    clip_epsilon: Tensor | float,
    denoising_discount: float = 0.99,
    total_steps: int | None = None,
    old_state_value: Tensor | None = None,
    value_clip_epsilon: float | None = None,
    value_coef: float = 0.5,
    normalize_advantages: bool = True,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    poolable: bool = False,
) -> tuple[Tensor, TensorDict]:
    """DPPO loss ``-E_{b,k}[min(r_bk A_bk, clip(r_bk, 1 -+ eps_k) A_bk)] + c_v 0.5 E[(V - V_target)^2]``.

    ``r_bk = exp(log_prob - sample_log_prob)`` per denoising step and
    ``A_bk = A_b * denoising_discount ** (K - 1 - k)`` with k the step's index in the full chain of
    ``total_steps`` = K steps (the K' fine-tuned steps are the last K' of the chain).

    Args:
        log_prob: [B, K'] float, log pi_theta(x_{k-1} | x_k, s) of the stored chain, per step.
        sample_log_prob: [B, K'] float, the same at collection.
        advantage: [B, 1] float, environment-level advantage (e.g. GAE).
        state_value: [B, 1] float, V_phi(s) now; value_target: [B, 1] float.
        clip_epsilon: float or [K'] per-step clip ranges (:func:`clip_schedule`), finite and > 0.
        denoising_discount: gamma_denoise in (0, 1].
        total_steps: K, the chain length (default K').
        old_state_value: [B, 1] float, V at collection; needed when ``value_clip_epsilon`` is set.
        value_clip_epsilon: finite and >= 0 (0 pins the clipped branch at ``old_state_value``), or
            None for the plain squared error; as in :func:`rlfunc.losses.ppo.ppo_loss`.
        value_coef: weight of the value loss, finite and >= 0.
        normalize_advantages: as in :func:`rlfunc.losses.ppo.ppo_loss`.
        entropy: optional [B, 1] entropy estimate for a bonus weighted by ``entropy_coef``.
        entropy_coef: finite and >= 0.
        poolable: also return the explained variance's parts, as :func:`rlfunc.losses.ppo.ppo_loss`'s
            ``poolable`` (ratio_max pools as a max: ``accumulate_gradients``/``average``'s ``maxima``).

    Returns:
        (loss 0-dim, metrics TensorDict of 0-dim floats: loss_objective, loss_critic, approx_kl
        (mean over steps of the k3 estimator), approx_kl_last (the final step's), clip_fraction,
        ratio_max, explained_variance).

    Raises:
        ShapeError: an input that is not a floating-point tensor, mismatched shapes
            (``old_state_value``, ``entropy`` and a tensor ``clip_epsilon`` included), or no sample
            (B = 0) or no denoising step (K' = 0).
        ConfigError: a hyperparameter that is not a number, not finite (NaN, inf) or outside its
            range above; value clipping without old values.
    """
    tensors = (("log_prob", log_prob), ("sample_log_prob", sample_log_prob), ("advantage", advantage), ("state_value", state_value),
               ("value_target", value_target), ("old_state_value", old_state_value), ("entropy", entropy))
    for name, t in tensors:  # a list, a numpy array or an integer tensor fails here, named (an int log_prob blamed clip_epsilon)
        if t is not None and (not isinstance(t, Tensor) or not t.is_floating_point()):
            got = f"dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
            raise ShapeError(f"dppo_loss: {name}: expected a floating-point torch.Tensor, got {got}")
    if log_prob.ndim != 2 or sample_log_prob.shape != log_prob.shape:
        raise ShapeError(
            f"dppo_loss: log_prob {tuple(log_prob.shape)} and sample_log_prob {tuple(sample_log_prob.shape)}: "
            "expected equal shapes [B, K']"
        )
    b, k_ft = log_prob.shape
    if b == 0 or k_ft == 0:  # the means below would be NaN
        raise ShapeError(f"dppo_loss: log_prob has shape {tuple(log_prob.shape)}: expected at least one sample and one denoising step")
    for name, t in tensors[2:]:  # entropy too: a per-dimension [B, A] one was averaged, silently
        if t is not None and t.shape != (b, 1):  # a [B] old_state_value against a [B, 1] state_value broadcast to [B, B]
            raise ShapeError(f"dppo_loss: {name} has shape {tuple(t.shape)}, expected {(b, 1)}")
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral)):
        raise ConfigError(f"dppo_loss: total_steps={total_steps!r}: expected an int (the chain length K) or None")
    if isinstance(denoising_discount, bool) or not isinstance(denoising_discount, numbers.Real):
        raise ConfigError(f"dppo_loss: denoising_discount={denoising_discount!r}: expected a number in (0, 1]")
    total = k_ft if total_steps is None else total_steps
    if total < k_ft:
        raise ConfigError(f"total_steps={total}: expected >= the {k_ft} steps in log_prob")
    if not 0 < denoising_discount <= 1:  # NaN and inf fail it too
        raise ConfigError(f"denoising_discount={denoising_discount}: expected a value in (0, 1]")
    check_coefficient("dppo_loss", "value_coef", value_coef)
    check_coefficient("dppo_loss", "entropy_coef", entropy_coef)
    if value_clip_epsilon is not None:
        check_coefficient("dppo_loss", "value_clip_epsilon", value_clip_epsilon)
    if isinstance(clip_epsilon, bool) or not isinstance(clip_epsilon, (numbers.Real, Tensor)):
        raise ConfigError(f"dppo_loss: clip_epsilon={clip_epsilon!r}: expected a number or a tensor of them")
    eps = torch.as_tensor(clip_epsilon, dtype=log_prob.dtype, device=log_prob.device)
    if eps.dim() > 1 or eps.numel() not in (1, k_ft):
        raise ShapeError(f"dppo_loss: clip_epsilon has shape {tuple(eps.shape)}, expected a number or [K'] = [{k_ft}] (one per step)")
    # a traced step was checked at its eager first call
    if reads_values(eps) and not bool((torch.isfinite(eps) & (eps > 0)).all()):
        raise ConfigError(f"dppo_loss: clip_epsilon={clip_epsilon}: expected finite values > 0")
    if value_clip_epsilon is not None and old_state_value is None:
        raise ConfigError("value_clip_epsilon is set but old_state_value was not given")

    adv = normalize_advantage(advantage) if normalize_advantages else advantage
    step_index = torch.arange(total - k_ft, total, device=log_prob.device, dtype=log_prob.dtype)
    adv = adv * denoising_discount ** (total - 1 - step_index)  # [B, K']
    log_ratio = log_prob - sample_log_prob
    ratio = log_ratio.exp()
    clipped = torch.minimum(torch.maximum(ratio, 1.0 - eps), 1.0 + eps)
    loss_objective = -torch.minimum(ratio * adv, clipped * adv).mean()

    value_error = (state_value - value_target).pow(2)
    if value_clip_epsilon is not None:
        clipped_value = old_state_value + (state_value - old_state_value).clamp(-value_clip_epsilon, value_clip_epsilon)
        value_error = torch.maximum(value_error, (clipped_value - value_target).pow(2))
    loss_critic = value_coef * 0.5 * value_error.mean()
    loss = loss_objective + loss_critic
    if entropy is not None:
        loss = loss - entropy_coef * entropy.mean()

    with torch.no_grad():
        kl = (ratio - 1.0) - log_ratio
        metrics = TensorDict(
            {
                "loss_objective": loss_objective.detach(),
                "loss_critic": loss_critic.detach(),
                "approx_kl": kl.mean(),
                "approx_kl_last": kl[:, -1].mean(),
                "clip_fraction": ((ratio - 1.0).abs() > eps).float().mean(),
                "ratio_max": ratio.max(),
                "explained_variance": explained_variance(state_value, value_target),
                **(explained_variance_parts(state_value, value_target) if poolable else {}),
            },
            batch_size=[],
        )
    return loss, metrics

"""PPO's clipped objective as pure functions over tensors.

Reference: Schulman et al. (2017), "Proximal Policy Optimization Algorithms", eq. 7 (clipped
surrogate) and eq. 9 (value and entropy terms); the clipped value loss and per-minibatch advantage
normalisation follow Huang et al. (2022), "The 37 implementation details of PPO", details 7 and 9.
"""

from __future__ import annotations

import math
import numbers

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.losses.checks import check_coefficient, check_number


def normalize_advantage(advantage: Tensor, eps: float = 1e-8) -> Tensor:
    """``(A - mean(A)) / (std(A) + eps)`` over all elements, with the population std (TorchRL's
    ``_standardize`` and CleanRL divide by the Bessel-corrected one: a factor sqrt(M / (M - 1)) apart
    for a minibatch of M; kept, as every preset's numbers were measured with it).

    Equal advantages (a minibatch of one among them) give exactly 0 (no policy-gradient signal),
    never NaN: a std within float rounding of the values (below 4 ulps of max |A|) is no spread.
    A NaN or infinite advantage makes every output NaN (not 0: a loss that is not finite is skipped).
    Without that rule, 1000 copies of 1.7 in float32 came out as values up to +-0.96, the mean's
    rounding error divided by a std of ~1e-7.

    Args:
        advantage: [*B] float tensor (any shape; normalised over all its elements).
        eps: added to the std.

    Raises:
        ShapeError: ``advantage`` is not a floating-point tensor (an int tensor or a list was a deep
            RuntimeError / AttributeError).
    """
    if not isinstance(advantage, Tensor) or not advantage.is_floating_point():
        raise ShapeError(f"normalize_advantage: advantage: expected a floating-point torch.Tensor, got {_shape_dtype(advantage)}")
    check_number("eps", eps)  # NaN made every output NaN
    return _normalized(advantage, eps)


def _normalized(advantage: Tensor, eps: float) -> Tensor:
    """:func:`normalize_advantage` without its argument checks."""
    if advantage.numel() == 0:
        return advantage
    mean = advantage.mean()
    std = advantage.std(correction=0)
    rounding = 4 * torch.finfo(advantage.dtype).eps * advantage.detach().abs().amax()
    # not "std > rounding": a NaN or inf advantage (std NaN) must come out NaN, so that the loss is not
    # finite and the step is skipped (the bug: every advantage became 0, a silent zero policy gradient)
    return torch.where(~(std <= rounding), (advantage - mean) / (std + eps), torch.zeros_like(advantage))


def clipped_surrogate(log_prob: Tensor, sample_log_prob: Tensor, advantage: Tensor, clip_epsilon: float) -> tuple[Tensor, Tensor]:
    """Per-sample clipped surrogate ``min(r A, clip(r, 1-eps, 1+eps) A)`` with ``r = exp(log_prob - sample_log_prob)``.

    Args:
        log_prob: [*B, 1] float, log pi_theta(a|s) under the current parameters.
        sample_log_prob: [*B, 1] float, log pi_old(a|s) recorded when the action was sampled.
        advantage: [*B, 1] float.
        clip_epsilon: the clip range eps > 0 (a number; or a tensor, e.g. per sample, unchecked).

    Raises:
        ConfigError: a number ``clip_epsilon`` that is not finite and > 0.
        ShapeError: ``sample_log_prob`` or ``advantage`` not a tensor of ``log_prob``'s shape (a [B]
            log-probability against a [B, 1] advantage broadcast to a [B, B] objective, silently).

    Returns:
        (objective [*B, 1], ratio [*B, 1]); the objective is to be maximised.
    """
    if not isinstance(clip_epsilon, Tensor):  # a tensor's values are not read (a host sync)
        check_number("clip_epsilon", clip_epsilon, finite=False)  # a str or None was a TypeError from clamp
    if isinstance(clip_epsilon, numbers.Real) and not 0 < clip_epsilon < math.inf:
        raise ConfigError(f"clip_epsilon={clip_epsilon!r}: expected a finite number > 0")  # -1 gave a garbage objective
    for name, t in (("sample_log_prob", sample_log_prob), ("advantage", advantage)):  # [B] against [B, 1] broadcast to [B, B]
        if not isinstance(t, Tensor) or not isinstance(log_prob, Tensor) or t.shape != log_prob.shape:
            raise ShapeError(f"clipped_surrogate: {name} has shape {_shape(t)}, expected log_prob's {_shape(log_prob)}")
    return _surrogate(log_prob, sample_log_prob, advantage, clip_epsilon)


def _surrogate(log_prob: Tensor, sample_log_prob: Tensor, advantage: Tensor, clip_epsilon) -> tuple[Tensor, Tensor]:
    """:func:`clipped_surrogate` without its argument checks."""
    log_ratio = log_prob - sample_log_prob
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - clip_epsilon, 1.0 + clip_epsilon)
    return torch.minimum(ratio * advantage, clipped * advantage), ratio


def ppo_loss(
    log_prob: Tensor,
    sample_log_prob: Tensor,
    advantage: Tensor,
    state_value: Tensor,
    value_target: Tensor,
    *,
    entropy: Tensor | None = None,
    old_state_value: Tensor | None = None,
    clip_epsilon: float = 0.2,
    value_clip_epsilon: float | None = None,
    entropy_coef: float = 0.0,
    value_coef: float = 0.5,
    normalize_advantages: bool = True,
    sample_weight: Tensor | None = None,
    check: bool = True,
    poolable: bool = False,
) -> tuple[Tensor, TensorDict]:
    """PPO loss ``-E[min(r A, clip(r) A)] + c_v * 0.5 E[(V - V_target)^2] - c_e * E[H]``.

    Args:
        log_prob: [*B, 1] float, log pi_theta(a|s) of the stored actions.
        sample_log_prob: [*B, 1] float, log-probability recorded at collection (TorchRL's key name
            before 0.8; TorchRL 0.14's ProbabilisticActor writes "action_log_prob" of shape [*B]:
            ``unsqueeze(-1)`` it).
        advantage: [*B, 1] float, e.g. from :func:`rlfunc.core.returns.generalized_advantage_estimate`.
        state_value: [*B, 1] float, V_theta(s) under the current parameters.
        value_target: [*B, 1] float, regression target for V.
        entropy: [*B, 1] float policy entropy (or an estimate); None disables the bonus.
        old_state_value: [*B, 1] float (the shape of ``state_value``), V at collection; needed when
            ``value_clip_epsilon`` is set.
        clip_epsilon: surrogate clip range, finite and > 0.
        value_clip_epsilon: clip range of V around ``old_state_value``, finite and >= 0 (max of the
            clipped and unclipped squared errors; 0 pins the clipped branch at ``old_state_value``);
            None for the plain squared error.
        entropy_coef: weight of the entropy bonus, finite and >= 0.
        value_coef: weight of the value loss, finite and >= 0.
        normalize_advantages: normalise ``advantage`` over this minibatch first (finite for one sample;
            :func:`normalize_advantage`, the population std).

    Beside TorchRL's ``ClipPPOLoss``: its ``loss_critic_type="l2"`` with ``critic_coeff=c`` is
    ``value_coef=2c`` here (this value term carries the 0.5); its default ``smooth_l1`` has no
    counterpart; its advantage normalisation (off by default there, on here) divides by the
    Bessel-corrected std; "approx_kl" here is the k3 estimator, its "kl_approx" the mean log-ratio.
    With those aligned the two agree to float rounding.
        sample_weight: [*B, 1] float >= 0, per-sample weight of the surrogate and value terms (the
            importance weights of prioritised sampling, Schaul et al. 2016); None: all 1.
        check: False skips the argument checks below (~20% of this function's time on a 256-sample
            minibatch of a small MLP), for a caller that passed the same shapes, dtypes and
            coefficients through them once (rlfunc.algos.ppo: every minibatch after an iteration's first).
        poolable: also put the parts of the explained variance (:func:`explained_variance_parts`) among
            the metrics, for a caller that merges the metrics of the parts of a minibatch (micro-batches,
            data-parallel ranks' shares) and then calls :func:`pool_explained_variance`.

    Returns:
        (loss 0-dim float, metrics TensorDict of 0-dim floats: loss_objective, loss_critic,
        loss_entropy, entropy, approx_kl (k3 estimator, Schulman 2020), clip_fraction,
        explained_variance).

    Raises:
        ShapeError: an input (``old_state_value``, ``sample_weight`` and ``entropy`` included, when given) is not a
            floating-point tensor, the inputs do not share one shape, or the minibatch is empty.
        ConfigError: ``clip_epsilon``, ``value_clip_epsilon``, ``entropy_coef`` or ``value_coef`` is
            not a number, is not finite (NaN, inf) or is out of its range above, or value clipping
            is asked for without old values.
    """
    if check:
        _check_ppo_loss(log_prob, sample_log_prob, advantage, state_value, value_target, entropy, old_state_value,
                        clip_epsilon, value_clip_epsilon, entropy_coef, value_coef, sample_weight)
    adv = _normalized(advantage, 1e-8) if normalize_advantages else advantage
    objective, ratio = _surrogate(log_prob, sample_log_prob, adv, clip_epsilon)
    if sample_weight is not None:
        objective = objective * sample_weight
    loss_objective = -objective.mean()

    value_error = (state_value - value_target).pow(2)
    if value_clip_epsilon is not None:
        clipped_value = old_state_value + (state_value - old_state_value).clamp(-value_clip_epsilon, value_clip_epsilon)
        value_error = torch.maximum(value_error, (clipped_value - value_target).pow(2))
    if sample_weight is not None:
        value_error = value_error * sample_weight
    loss_critic = value_coef * 0.5 * value_error.mean()

    if entropy is not None:
        mean_entropy = entropy.mean()
        loss_entropy = -entropy_coef * mean_entropy
    else:
        mean_entropy = loss_entropy = torch.zeros((), device=log_prob.device)
    loss = loss_objective + loss_critic + loss_entropy

    with torch.no_grad():
        log_ratio = log_prob - sample_log_prob
        metrics = TensorDict(
            {
                "loss_objective": loss_objective.detach(),
                "loss_critic": loss_critic.detach(),
                "loss_entropy": loss_entropy.detach(),
                "entropy": mean_entropy.detach(),
                "approx_kl": ((ratio - 1.0) - log_ratio).mean(),
                "clip_fraction": ((ratio - 1.0).abs() > clip_epsilon).float().mean(),
                "explained_variance": _explained_variance(state_value, value_target),  # checked with the loss's inputs
                **(explained_variance_parts(state_value, value_target) if poolable else {}),
            },
            batch_size=[],
        )
    return loss, metrics


def _check_ppo_loss(log_prob, sample_log_prob, advantage, state_value, value_target, entropy, old_state_value,
                    clip_epsilon, value_clip_epsilon, entropy_coef, value_coef, sample_weight) -> None:
    """:func:`ppo_loss`'s argument checks (its Raises)."""
    named = (("log_prob", log_prob), ("sample_log_prob", sample_log_prob), ("advantage", advantage), ("state_value", state_value),
             ("value_target", value_target))
    optional = (("old_state_value", old_state_value), ("sample_weight", sample_weight), ("entropy", entropy))
    for name, t in named + tuple((n, t) for n, t in optional if t is not None):  # a list, a numpy array or an integer tensor fails here, named
        if not isinstance(t, Tensor) or not t.is_floating_point():
            got = f"dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
            raise ShapeError(f"ppo_loss: {name}: expected a floating-point torch.Tensor, got {got}")
    shape = log_prob.shape
    for name, t in named[1:]:
        if t.shape != shape:
            raise ShapeError(f"ppo_loss: {name} has shape {tuple(t.shape)}, expected {tuple(shape)} like log_prob")
    for name, t in optional:  # a [B] old_state_value against a [B, 1] state_value broadcast to [B, B]; a per-dimension entropy was averaged
        if t is not None and t.shape != shape:
            raise ShapeError(f"ppo_loss: {name} has shape {tuple(t.shape)}, expected {tuple(shape)} like log_prob")
    if log_prob.numel() == 0:  # the means below would be NaN
        raise ShapeError(f"ppo_loss: log_prob has shape {tuple(shape)}, an empty minibatch: expected at least one sample")
    check_coefficient("ppo_loss", "clip_epsilon", clip_epsilon, positive=True)
    check_coefficient("ppo_loss", "entropy_coef", entropy_coef)
    check_coefficient("ppo_loss", "value_coef", value_coef)
    if value_clip_epsilon is not None:
        check_coefficient("ppo_loss", "value_clip_epsilon", value_clip_epsilon)
    if value_clip_epsilon is not None and old_state_value is None:
        raise ConfigError("value_clip_epsilon is set but old_state_value was not given")


def explained_variance(prediction: Tensor, target: Tensor) -> Tensor:
    """``1 - Var[target - prediction] / Var[target]``; 0-dim, NaN-free (0 when Var[target] == 0, to float
    rounding: equal targets).

    Raises:
        ShapeError: ``prediction`` and ``target`` differ in shape (an [8, 1] against an [8] broadcast
            to [8, 8] and gave a wrong value), or are not floating point.
    """
    if not (isinstance(prediction, Tensor) and isinstance(target, Tensor)) or prediction.shape != target.shape:
        raise ShapeError(f"prediction {_shape(prediction)} and target {_shape(target)}: expected tensors of one shape")
    if not (prediction.dtype.is_floating_point and target.dtype.is_floating_point):
        raise ShapeError(f"prediction ({prediction.dtype}) and target ({target.dtype}): expected floating point tensors")
    return _explained_variance(prediction, target)


def _explained_variance(prediction: Tensor, target: Tensor) -> Tensor:
    """:func:`explained_variance` without its argument checks."""
    return _ev_of(target.var(correction=0), (target - prediction).var(correction=0), target.detach().abs().amax())


def _ev_of(var_t: Tensor, var_r: Tensor, absmax: Tensor) -> Tensor:
    """1 - var_r / var_t, or 0 where the targets have no spread, NaN where they are not finite (the bug:
    0.0 for a NaN target, a real-looking value beside the skipped step's null losses). Equal targets
    have a float variance of rounding (5.7e-14 for 1000 x 1.7 in float32), not 0: a variance within 4
    ulps of max |target|, squared, is none (the bug: -1e12 there, where 0 is documented)."""
    rounding = (4 * torch.finfo(var_t.dtype).eps * absmax).square()
    # the spread's own variance, however small (the bug: clamped to 1e-12, targets of std 1e-7 gave 0.99 for a zero prediction)
    ev = 1.0 - var_r / torch.where(var_t > rounding, var_t, torch.ones_like(var_t))
    return torch.where(var_t > rounding, ev, torch.where(var_t.isnan() | rounding.isnan(), torch.nan, 0.0).to(ev.dtype))


EV_MOMENTS = (("ev_target_mean", "ev_target_var"), ("ev_residual_mean", "ev_residual_var"))  # (mean, variance) pairs
EV_MAXIMA = ("ev_target_absmax",)
EV_PARTS = (*(k for pair in EV_MOMENTS for k in pair), *EV_MAXIMA)


def explained_variance_parts(prediction: Tensor, target: Tensor) -> dict[str, Tensor]:
    """What :func:`explained_variance` is made of, on a part of a batch, 0-dim each (:data:`EV_PARTS`):
    the mean and population variance of the target and of the residual ``target - prediction``
    (:data:`EV_MOMENTS`), and max |target| (:data:`EV_MAXIMA`). Parts merge into the whole batch's
    exactly: the (mean, variance) pairs by Chan et al.'s pairwise update
    (:func:`rlfunc.core.normalize.merge_moments`: ``accumulate_gradients``'s ``moments`` over
    micro-batches; ``rlfunc.algos.data_parallel.average``'s ``moments`` over ranks, each rank's pair
    in its own slot of the all_reduce), max |target| as a max; then
    :func:`pool_explained_variance`. The mean of the parts' explained variances is not the batch's (a
    share of 8 samples gave -1.37 where the minibatch's was 0.25), nor is E[var] + E[mean^2] - E[mean]^2
    in float32 (it cancels: targets of mean 1e4 gave 0.0 for 0.77). Shapes and dtypes as
    :func:`explained_variance`'s arguments (unchecked)."""
    residual = target - prediction
    return {
        "ev_target_mean": target.mean(), "ev_target_var": target.var(correction=0),
        "ev_residual_mean": residual.mean(), "ev_residual_var": residual.var(correction=0),
        "ev_target_absmax": target.abs().amax(),
    }


def pool_explained_variance(metrics: TensorDictBase) -> TensorDictBase:
    """``metrics`` with "explained_variance" computed from the merged parts of
    :func:`explained_variance_parts` (any batch shape: [] or a seed dim [S]) and the parts removed;
    ``metrics`` unchanged when it has no parts. With one part it is :func:`explained_variance` exactly."""
    if EV_PARTS[0] not in metrics.keys():
        return metrics
    out = metrics.exclude(*EV_PARTS)
    out["explained_variance"] = _ev_of(metrics["ev_target_var"], metrics["ev_residual_var"], metrics["ev_target_absmax"])
    return out


def _shape_dtype(x) -> str:
    return f"dtype {x.dtype}" if isinstance(x, Tensor) else type(x).__name__


def _shape(x) -> str:
    return str(list(x.shape)) if isinstance(x, Tensor) else type(x).__name__

"""GRPO's clipped surrogate over masked, variable-length sequences, without a critic.

Every sequence i (an episode, or an LLM completion) of a group carries one group-relative
advantage A_i (:func:`rlfunc.core.returns.group_relative_advantage`) shared by its steps t:

    J = agg_{i,t} [ min(r_{i,t} A_{i,t}, clip(r_{i,t}, 1 - eps_low, 1 + eps_high) A_{i,t})
                    - beta * D_KL[pi_theta || pi_ref]_{i,t} ],   r_{i,t} = pi_theta / pi_old,

with the k3 estimator of the KL to a frozen reference policy,
D_{i,t} = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1 (unbiased, always >= 0), and ``agg`` one of
the aggregations of :func:`masked_aggregate`.

Reference: Shao et al. (2024), "DeepSeekMath", eq. 3 (GRPO objective, per-sequence mean) and
eq. 4 (k3 KL); the token-level aggregation and decoupled clip range ("clip-higher") are from Yu et
al. (2025), "DAPO", eq. 8 and sec. 3.1 / 3.3; the constant normaliser from Liu et al. (2025),
"Understanding R1-Zero-Like Training" (Dr. GRPO), sec. 3.2. The k3 estimator: Schulman (2020),
"Approximating KL divergence".
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.core.shapes import broadcast_shapes
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.losses.checks import check_number

AGGREGATIONS = ("token", "sequence", "constant")


def masked_aggregate(x: Tensor, mask: Tensor, aggregation: str = "token") -> Tensor:
    """Mean of the per-step values ``x`` over the valid steps of a batch of sequences.

    - ``"token"``: sum over every valid step of every sequence / number of valid steps (DAPO): long
      sequences weigh in proportion to their length.
    - ``"sequence"``: mean over sequences of each sequence's mean over its valid steps (GRPO, eq. 3);
      sequences without a valid step are left out.
    - ``"constant"``: sum over every valid step / (number of sequences * T), a constant normaliser
      that does not depend on the lengths (Dr. GRPO).

    Args:
        x: [*B, T, 1] float, one value per step (or any shape that broadcasts to ``mask``'s); values at
            invalid steps are ignored (even NaN/inf).
        mask: [*B, T, 1] bool (or 0/1 numbers, as the losses take), True at the valid steps.
        aggregation: ``"token"`` | ``"sequence"`` | ``"constant"``.

    Returns:
        0-dim tensor of ``x``'s dtype; 0 when no step is valid.

    Raises:
        ConfigError: an unknown ``aggregation``. ShapeError: ``mask`` not a [*B, T, 1] tensor that ``x``
            broadcasts to (a [*B, T] mask against [*B, T, 1] values broadcast to [*B, T, T] and gave a
            "mean" above every value, silently).
    """
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"aggregation={aggregation!r}: expected one of {', '.join(map(repr, AGGREGATIONS))}")
    if (not isinstance(mask, Tensor) or not isinstance(x, Tensor) or mask.dim() < 2 or mask.shape[-1] != 1
            or not _broadcasts_to(x.shape, mask.shape)):
        shape = lambda t: tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__  # noqa: E731
        raise ShapeError(f"masked_aggregate: mask has shape {shape(mask)}, x {shape(x)}: expected a [*B, T, 1] mask "
                         "that x broadcasts to")
    if mask.dtype != torch.bool:
        if mask.is_complex():
            raise ShapeError(f"masked_aggregate: mask must be bool (or 0/1 numbers), got dtype {mask.dtype}")
        mask = mask != 0
    xm = torch.where(mask, x, torch.zeros_like(x))
    if aggregation == "token":
        return xm.sum() / mask.sum().clamp_min(1).to(x.dtype)
    if aggregation == "constant":
        return xm.sum() / max(1, mask.numel())
    count = mask.sum(-2)  # [*B, 1]
    per_sequence = xm.sum(-2) / count.clamp_min(1).to(x.dtype)
    has = count > 0
    return torch.where(has, per_sequence, torch.zeros_like(per_sequence)).sum() / has.sum().clamp_min(1).to(x.dtype)


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return broadcast_shapes(shape, target) == target
    except RuntimeError:  # they do not broadcast at all
        return False


def k3_kl(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k3 estimate of KL[pi_theta || pi_ref] from a sample of pi_theta: exp(d) - d - 1, d = ref_log_prob - log_prob.

    Elementwise, >= 0, differentiable in both arguments (Schulman 2020; DeepSeekMath eq. 4).
    """
    d = ref_log_prob - log_prob
    return torch.expm1(d) - d


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor | None, mask: Tensor, aggregation: str, kl_coef: float
               ) -> tuple[Tensor, Tensor]:
    """``kl_coef`` x the k3 KL to the reference policy (:func:`k3_kl`) over the valid steps of
    ``mask``, aggregated like the objective; returns (loss_kl 0-dim, per-step kl ``[*B, T]``, zero at
    padding). Without ``ref_log_prob``: (0, 0)."""
    zero = log_prob.new_zeros(())
    if ref_log_prob is None:
        return zero, zero
    kl = k3_kl(torch.where(mask, log_prob, zero), torch.where(mask, ref_log_prob.to(log_prob.dtype), zero))
    return kl_coef * masked_aggregate(kl, mask, aggregation), kl


def check_sequence_inputs(
    fn: str, log_prob: Tensor, sample_log_prob: Tensor, mask: Tensor | None, ref_log_prob: Tensor | None
) -> Tensor:
    """Shared argument checks of the sequence losses; returns the mask as bool [*B, T, 1]."""
    if not isinstance(log_prob, Tensor) or log_prob.ndim < 2 or log_prob.shape[-1] != 1:
        shape = tuple(log_prob.shape) if isinstance(log_prob, Tensor) else type(log_prob).__name__
        raise ShapeError(f"{fn}: log_prob has shape {shape}, expected [*B, T, 1] (time along dim -2)")
    if not log_prob.is_floating_point():
        raise ShapeError(f"{fn}: log_prob has dtype {log_prob.dtype}, expected a float dtype")
    shape = log_prob.shape
    others = {"sample_log_prob": sample_log_prob, "mask": mask, "ref_log_prob": ref_log_prob}
    for name, t in others.items():
        if t is not None and (not isinstance(t, Tensor) or t.shape != shape):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ShapeError(f"{fn}: {name} has shape {got}, expected {tuple(shape)} like log_prob")
        if t is not None and t.device != log_prob.device:
            raise ShapeError(f"{fn}: {name} is on {t.device} but log_prob is on {log_prob.device}")
    if mask is None:
        return torch.ones_like(log_prob, dtype=torch.bool)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ShapeError(f"{fn}: mask must be bool (or 0/1 numbers), got dtype {mask.dtype}")
    return mask != 0


def check_advantage(fn: str, advantage: Tensor, log_prob: Tensor, per_step: bool) -> None:
    """``advantage`` must be [*B, 1, 1] (one per sequence) or, with ``per_step``, [*B, T, 1]."""
    shape = log_prob.shape
    sequence = shape[:-2] + (1, 1)
    allowed = [sequence, shape] if per_step else [sequence]
    if not isinstance(advantage, Tensor) or advantage.shape not in allowed:
        got = tuple(advantage.shape) if isinstance(advantage, Tensor) else type(advantage).__name__
        want = " or ".join(str(tuple(s)) for s in allowed)
        raise ShapeError(f"{fn}: advantage has shape {got}, expected {want}")


def check_clip(fn: str, clip_epsilon: float, clip_epsilon_high: float) -> None:
    check_number("clip_epsilon", clip_epsilon, fn=fn, finite=False)
    check_number("clip_epsilon_high", clip_epsilon_high, fn=fn, finite=False)
    if not 0.0 < clip_epsilon < 1.0:
        raise ConfigError(f"{fn}: clip_epsilon={clip_epsilon}: expected a value in (0, 1)")
    if not clip_epsilon_high > 0.0 or clip_epsilon_high == float("inf"):
        raise ConfigError(f"{fn}: clip_epsilon_high={clip_epsilon_high}: expected a finite value > 0")


def check_kl(fn: str, kl_coef: float, ref_log_prob: Tensor | None) -> None:
    check_number("kl_coef", kl_coef, fn=fn, finite=False)
    if not 0.0 <= kl_coef < float("inf"):
        raise ConfigError(f"{fn}: kl_coef={kl_coef}: expected a finite value >= 0")
    if kl_coef > 0 and ref_log_prob is None:
        raise ConfigError(f"{fn}: kl_coef={kl_coef} > 0 needs ref_log_prob (log-probabilities under the reference policy)")


def grpo_loss(
    log_prob: Tensor,
    sample_log_prob: Tensor,
    advantage: Tensor,
    mask: Tensor | None = None,
    *,
    clip_epsilon: float = 0.2,
    clip_epsilon_high: float | None = None,
    ref_log_prob: Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "token",
) -> tuple[Tensor, TensorDict]:
    """GRPO loss ``-agg[min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) - kl_coef * k3(pi_theta, pi_ref)]``.

    One importance ratio per step, r_{i,t} = exp(log_prob - sample_log_prob), clipped per step as in
    PPO; no critic: A is the group-relative advantage of the sequence. See the module docstring.

    Args:
        log_prob: [*B, T, 1] float, log pi_theta(a_t | s_t) of the stored actions (with grad).
        sample_log_prob: [*B, T, 1] float, log pi_old(a_t | s_t) recorded when they were sampled.
        advantage: [*B, 1, 1] float (one per sequence, broadcast over its steps) or [*B, T, 1].
        mask: [*B, T, 1] bool (or 0/1 numbers), True at the valid steps of each sequence (padding
            after an episode's end is False); None: every step is valid. Values at invalid steps
            of every input are ignored, NaN included, and receive zero gradient.
        clip_epsilon: eps_low, the ratio's lower clip 1 - eps_low, in (0, 1).
        clip_epsilon_high: eps_high, the upper clip 1 + eps_high (> 0); None: ``clip_epsilon``.
        ref_log_prob: [*B, T, 1] float, log pi_ref(a_t | s_t) under the frozen reference policy
            (no grad needed); None: no KL term, and kl_ref is reported as 0.
        kl_coef: beta >= 0, weight of the k3 KL to the reference policy; > 0 needs ``ref_log_prob``.
        aggregation: ``"token"`` | ``"sequence"`` | ``"constant"`` (:func:`masked_aggregate`),
            used for both the surrogate and the KL term.

    Returns:
        (loss 0-dim float, metrics TensorDict of 0-dim floats, means over valid steps:
        loss_objective, loss_kl (kl_coef times the aggregated KL), kl_ref (k3 KL to the reference),
        approx_kl (k3 estimate of KL[pi_old || pi_theta], (r - 1) - log r), clip_fraction
        (fraction of steps whose ratio lies outside the clip range), ratio_mean).

    Raises:
        ShapeError: the per-step inputs are not one [*B, T, 1] shape, or ``advantage`` is neither
            [*B, 1, 1] nor [*B, T, 1].
        ConfigError: a clip range outside its interval, a negative ``kl_coef``, ``kl_coef > 0``
            without ``ref_log_prob``, or an unknown ``aggregation``.
    """
    fn = "grpo_loss"
    mask = check_sequence_inputs(fn, log_prob, sample_log_prob, mask, ref_log_prob)
    check_advantage(fn, advantage, log_prob, per_step=True)
    eps_high = clip_epsilon if clip_epsilon_high is None else clip_epsilon_high
    check_clip(fn, clip_epsilon, eps_high)
    check_kl(fn, kl_coef, ref_log_prob)
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"{fn}: aggregation={aggregation!r}: expected one of {', '.join(map(repr, AGGREGATIONS))}")

    zero = torch.zeros_like(log_prob)
    log_ratio = torch.where(mask, log_prob - sample_log_prob, zero)
    ratio = log_ratio.exp()
    adv = torch.where(mask, advantage.expand_as(log_prob), zero)
    clipped = ratio.clamp(1.0 - clip_epsilon, 1.0 + eps_high)
    objective = torch.minimum(ratio * adv, clipped * adv)
    loss_objective = -masked_aggregate(objective, mask, aggregation)
    loss_kl, kl = kl_penalty(log_prob, ref_log_prob, mask, aggregation, kl_coef)
    loss = loss_objective + loss_kl

    with torch.no_grad():
        metrics = TensorDict(
            {
                "loss_objective": loss_objective.detach(),
                "loss_kl": loss_kl.detach(),
                "kl_ref": masked_aggregate(kl.detach(), mask, "token"),
                "approx_kl": masked_aggregate((ratio - 1.0) - log_ratio, mask, "token"),
                "clip_fraction": masked_aggregate(((ratio < 1.0 - clip_epsilon) | (ratio > 1.0 + eps_high)).to(ratio.dtype), mask, "token"),
                "ratio_mean": masked_aggregate(ratio, mask, "token"),
            },
            batch_size=[],
        )
    return loss, metrics

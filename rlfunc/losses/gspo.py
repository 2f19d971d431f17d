"""GSPO: one importance ratio per sequence, clipped at the sequence level.

For a sequence i (an episode, an action chunk, an LLM completion) with |y_i| valid steps,

    s_i = (pi_theta(y_i) / pi_old(y_i)) ^ (1 / |y_i|) = exp( mean_t [log pi_theta - log pi_old]_{i,t} )

    J = mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

with A_i the group-relative advantage of the sequence. The length normalisation keeps s_i near 1
whatever the length, so the clip range is small: the paper uses eps_low = 3e-4 and eps_high = 4e-4
("we set the left and right clipping ranges in Equation (5) to 3e-4 and 4e-4, respectively").

GSPO-token (``variant="token"``) allows a per-step advantage A_{i,t}:
s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)], equal to s_i in value, and
J = mean_i mean_t min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t}); with A_{i,t} = A_i its value and
gradient equal GSPO's.

Reference: Zheng et al. (2025), "Group Sequence Policy Optimization", arXiv 2507.18071: eq. 5 (the
objective) with the length-normalised sequence ratio defined beside it, the experiments section
(clip ranges 3e-4 / 4e-4 for eq. 5), and the GSPO-token variant of sec. 4.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.errors import ConfigError
from rlfunc.losses.grpo import (
    check_advantage, check_clip, check_kl, check_sequence_inputs, kl_penalty, masked_aggregate,
)

VARIANTS = ("sequence", "token")


def sequence_log_ratio(log_prob: Tensor, sample_log_prob: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mean log-ratio of each sequence over its valid steps, log s_i = mean_t (log_prob - sample_log_prob).

    Args:
        log_prob, sample_log_prob: [*B, T, 1] float; mask: [*B, T, 1] bool.

    Returns:
        (log s [*B, 1, 1] float, 0 for a sequence without a valid step; has_step [*B, 1, 1] bool).
    """
    diff = torch.where(mask, log_prob - sample_log_prob, torch.zeros_like(log_prob))
    count = mask.sum(-2, keepdim=True)
    return diff.sum(-2, keepdim=True) / count.clamp_min(1).to(log_prob.dtype), count > 0


def gspo_loss(
    log_prob: Tensor,
    sample_log_prob: Tensor,
    advantage: Tensor,
    mask: Tensor | None = None,
    *,
    clip_epsilon: float = 3e-4,
    clip_epsilon_high: float | None = 4e-4,
    ref_log_prob: Tensor | None = None,
    kl_coef: float = 0.0,
    variant: str = "sequence",
) -> tuple[Tensor, TensorDict]:
    """GSPO loss ``-mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) + kl_coef * KL``.

    See the module docstring for s_i and the token variant. The optional KL to a frozen reference
    policy is the k3 estimator per step, averaged over each sequence's valid steps and then over
    sequences (the GSPO paper itself uses no KL term).

    Args:
        log_prob: [*B, T, 1] float, log pi_theta(a_t | s_t) of the stored actions (with grad).
        sample_log_prob: [*B, T, 1] float, log pi_old(a_t | s_t) recorded at sampling.
        advantage: [*B, 1, 1] float, one per sequence; with ``variant="token"`` also [*B, T, 1].
        mask: [*B, T, 1] bool (or 0/1 numbers), True at valid steps; None: all valid. Values at
            invalid steps are ignored (NaN included) and get zero gradient. A sequence without a
            valid step is left out of every mean.
        clip_epsilon: eps_low in (0, 1), lower clip 1 - eps_low of the sequence ratio (paper: 3e-4).
        clip_epsilon_high: eps_high > 0, upper clip 1 + eps_high (paper: 4e-4); None: ``clip_epsilon``.
        ref_log_prob: [*B, T, 1] float, log pi_ref under the frozen reference policy, or None.
        kl_coef: weight >= 0 of the KL term; > 0 needs ``ref_log_prob``.
        variant: ``"sequence"`` (GSPO) or ``"token"`` (GSPO-token).

    Returns:
        (loss 0-dim float, metrics TensorDict of 0-dim floats: loss_objective, loss_kl, kl_ref,
        approx_kl (k3 of KL[pi_old || pi_theta], mean over valid steps), clip_fraction (fraction of
        sequences whose s_i is outside the clip range), ratio_mean (mean s_i)).

    Raises:
        ShapeError: the per-step inputs are not one [*B, T, 1] shape, or ``advantage`` has another
            shape than those listed.
        ConfigError: a clip range outside its interval, a negative ``kl_coef``, ``kl_coef > 0``
            without ``ref_log_prob``, or an unknown ``variant``.
    """
    fn = "gspo_loss"
    if variant not in VARIANTS:
        raise ConfigError(f"{fn}: variant={variant!r}: expected 'sequence' or 'token'")
    mask = check_sequence_inputs(fn, log_prob, sample_log_prob, mask, ref_log_prob)
    check_advantage(fn, advantage, log_prob, per_step=variant == "token")
    eps_high = clip_epsilon if clip_epsilon_high is None else clip_epsilon_high
    check_clip(fn, clip_epsilon, eps_high)
    check_kl(fn, kl_coef, ref_log_prob)

    zero = torch.zeros_like(log_prob)
    log_s, has = sequence_log_ratio(log_prob, sample_log_prob, mask)  # [*B, 1, 1]
    s = log_s.exp()
    lo, hi = 1.0 - clip_epsilon, 1.0 + eps_high
    if variant == "sequence":
        adv = torch.where(has, advantage, torch.zeros_like(advantage))
        objective = torch.minimum(s * adv, s.clamp(lo, hi) * adv)  # [*B, 1, 1]
        loss_objective = -masked_aggregate(objective, has, "sequence")
    else:
        lp = torch.where(mask, log_prob, zero)
        s_token = (log_s.detach() + lp - lp.detach()).exp()  # value s_i, gradient of each step's log_prob
        adv = torch.where(mask, advantage.expand_as(log_prob), zero)
        objective = torch.minimum(s_token * adv, s_token.clamp(lo, hi) * adv)
        loss_objective = -masked_aggregate(objective, mask, "sequence")
    loss_kl, kl = kl_penalty(log_prob, ref_log_prob, mask, "sequence", kl_coef)
    loss = loss_objective + loss_kl

    with torch.no_grad():
        log_ratio = torch.where(mask, log_prob - sample_log_prob, zero)
        outside = ((s < lo) | (s > hi)).to(s.dtype)
        metrics = TensorDict(
            {
                "loss_objective": loss_objective.detach(),
                "loss_kl": loss_kl.detach(),
                "kl_ref": masked_aggregate(kl.detach(), mask, "token"),
                "approx_kl": masked_aggregate(torch.expm1(log_ratio) - log_ratio, mask, "token"),
                "clip_fraction": masked_aggregate(outside, has, "sequence"),
                "ratio_mean": masked_aggregate(s.detach(), has, "sequence"),
            },
            batch_size=[],
        )
    return loss, metrics

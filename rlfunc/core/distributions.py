"""Diagonal Gaussian, tanh-squashed Gaussian and (masked, multi-head) categorical policies as pure functions.

A policy head outputs ``loc`` and ``log_std`` of shape [*B, D]; these functions turn them into
samples, log-likelihoods and entropies without building ``torch.distributions`` objects, so they run
unchanged under ``torch.func.vmap`` / ``grad`` and on devices without 64-bit floats. Randomness is never
drawn inside: a sample is ``loc + exp(log_std) * noise`` with the standard-normal ``noise`` passed in
(see ``standard_normal``), so the same noise gives the same action.

Every log-likelihood and entropy is summed over the last (action) dimension and returned as
[*B, 1], the shape TorchRL uses for ``"sample_log_prob"``-like per-step scalars.

Categorical policies take ``logits`` [*B, K]. A Discrete action is int64 [*B] (TorchRL's Categorical
spec: ``GymEnv(..., categorical_action_encoding=True)``; GymEnv's default is one-hot, and takes an
index silently as the wrong action); a MultiDiscrete action with ``nvec = (n_1, ..., n_H)`` is int64 [*B, H], its logits are the H
heads concatenated (K = sum n_h), and the heads are independent, so log-probabilities and entropies
are sums over heads. An action mask is bool [*B, K], True where allowed (TorchRL's ``"action_mask"``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from rlfunc.core.shapes import broadcast_shapes
from rlfunc.errors import ConfigError, ShapeError

__all__ = [
    "categorical_entropy",
    "categorical_log_prob",
    "categorical_mode",
    "categorical_sample",
    "gaussian_entropy",
    "gaussian_log_prob",
    "gaussian_sample",
    "masked_logits",
    "standard_normal",
    "tanh_gaussian_log_prob",
    "tanh_gaussian_sample",
]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_LOG_2 = math.log(2.0)


def _event_shape(**tensors: Tensor) -> torch.Size:
    """Broadcast shape of ``tensors``, which must be floating and agree in their last dim.

    Raises ShapeError naming the offending argument.
    """
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise ShapeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.ndim == 0:
            raise ShapeError(f"{name}: expected shape [*B, D] with an action dim D, got a 0-d tensor")
        if not t.is_floating_point():
            raise ShapeError(f"{name}: expected a floating dtype, got {t.dtype}")
    names = list(tensors)
    first = names[0]
    d = tensors[first].shape[-1]
    for name in names[1:]:
        if tensors[name].shape[-1] != d:
            raise ShapeError(
                f"{name}: last (action) dim is {tensors[name].shape[-1]} but {first} has {d} "
                f"(shapes {', '.join(f'{n}={tuple(t.shape)}' for n, t in tensors.items())})"
            )
    try:
        return broadcast_shapes(*(t.shape for t in tensors.values()))
    except RuntimeError as err:
        raise ShapeError(
            f"{', '.join(names)}: shapes do not broadcast "
            f"({', '.join(f'{n}={tuple(t.shape)}' for n, t in tensors.items())})"
        ) from err


def _affine(low: Tensor | float | None, high: Tensor | float | None, like: Tensor) -> tuple[Tensor, Tensor] | None:
    """(center, half_range) of the box [low, high], or None when no bounds are given."""
    if low is None and high is None:
        return None
    if low is None or high is None:
        raise ConfigError(f"low={low!r}, high={high!r}: give both action bounds or neither")
    low_t, high_t = check_action_bounds(low, high, like)
    return (high_t + low_t) / 2, (high_t - low_t) / 2


def check_action_bounds(low: Tensor | float, high: Tensor | float, like: Tensor) -> tuple[Tensor, Tensor]:
    """The action box [low, high] as tensors of ``like``'s dtype and device, checked: numbers finite with
    low < high (without a device sync: tensor values are not read), tensors of a last dim 1 or ``like``'s.

    Raises:
        ConfigError: number bounds not finite or not low < high (low > high gave NaN, low == high +inf,
            silently), or not numbers. ShapeError: a tensor bound of another last dim.
    """
    for name, v in (("low", low), ("high", high)):
        if not isinstance(v, Tensor) and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
            raise ConfigError(f"{name}={v!r}: expected a number or a tensor (an action bound)")
    if isinstance(low, numbers.Real) and isinstance(high, numbers.Real) and not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ConfigError(f"low={low!r}, high={high!r}: expected finite bounds with low < high")
    low_t = torch.as_tensor(low, dtype=like.dtype, device=like.device)
    high_t = torch.as_tensor(high, dtype=like.dtype, device=like.device)
    d = like.shape[-1]
    for name, t in (("low", low_t), ("high", high_t)):
        if t.ndim > 0 and t.shape[-1] not in (1, d):
            raise ShapeError(f"{name}: last dim is {t.shape[-1]}, expected 1 or the action dim {d}")
    return low_t, high_t


def standard_normal(
    shape: Sequence[int] | torch.Size,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Standard-normal noise eps ~ N(0, I) for the ``*_sample`` functions.

    Args:
        shape: shape of the noise, normally the [*B, D] shape of ``loc``.
        generator: the random stream to draw from (``torch.Generator`` on ``device``); None uses the
            global default generator of that device.
        device: where to create the noise; None means the default device.
        dtype: floating dtype of the noise.

    Returns:
        [*shape] ``dtype`` on ``device``.

    Raises:
        ShapeError: ``dtype`` is not floating.
    """
    if not dtype.is_floating_point:
        raise ShapeError(f"dtype={dtype}: expected a floating dtype")
    return torch.randn(tuple(shape), generator=generator, device=device, dtype=dtype)


def gaussian_log_prob(action: Tensor, loc: Tensor, log_std: Tensor) -> Tensor:
    """log N(a; mu, diag(sigma^2)) = sum_i [-(a_i - mu_i)^2 / (2 sigma_i^2) - log sigma_i - log(2 pi) / 2].

    Args:
        action: [*B, D] float, the action a.
        loc: [*B, D] float, the mean mu (any shape broadcasting to the others, same D).
        log_std: [*B, D] or [D] float, log sigma (natural log of the standard deviation).

    Returns:
        [*B, 1] float, summed over the action dim D (keepdim); dtype by torch type promotion.

    Raises:
        ShapeError: an input is not floating, is 0-d, the last dims differ, or the shapes do not
            broadcast; the message names the argument.
    """
    _event_shape(action=action, loc=loc, log_std=log_std)
    z = (action - loc) * torch.exp(-log_std)
    return (-0.5 * z.square() - log_std - _HALF_LOG_2PI).sum(-1, keepdim=True)


def gaussian_entropy(log_std: Tensor, batch_shape: Sequence[int] | torch.Size = ()) -> Tensor:
    """H[N(mu, diag(sigma^2))] = sum_i [log sigma_i + (1 + log(2 pi)) / 2]; independent of mu.

    Args:
        log_std: [*B, D] or [D] float, log sigma.
        batch_shape: batch shape to broadcast ``log_std`` against, e.g. ``loc.shape[:-1]`` when the
            std is a state-independent parameter of shape [D]. Default (): no broadcasting.

    Returns:
        [*broadcast(B, batch_shape), 1] float, same dtype and device as ``log_std``.

    Raises:
        ShapeError: ``log_std`` is not floating or 0-d, or does not broadcast with ``batch_shape``.
    """
    _event_shape(log_std=log_std)
    d = log_std.shape[-1]
    try:
        shape = broadcast_shapes(log_std.shape, (*tuple(batch_shape), d))
    except RuntimeError as err:
        raise ShapeError(
            f"log_std: shape {tuple(log_std.shape)} does not broadcast with batch_shape={tuple(batch_shape)}"
        ) from err
    entropy = (log_std + (0.5 + _HALF_LOG_2PI)).sum(-1, keepdim=True)
    return entropy.expand(*shape[:-1], 1)


def gaussian_sample(loc: Tensor, log_std: Tensor, noise: Tensor) -> Tensor:
    """Reparameterised sample a = mu + sigma * eps, with eps ~ N(0, I) given (differentiable in mu, sigma).

    Args:
        loc: [*B, D] float, the mean mu.
        log_std: [*B, D] or [D] float, log sigma.
        noise: [*S, *B, D] float, standard-normal eps (``standard_normal``); leading sample dims *S
            are allowed and broadcast.

    Returns:
        [*broadcast shape, D] float, the action a.

    Raises:
        ShapeError: an input is not floating, is 0-d, the last dims differ, or the shapes do not broadcast.
    """
    _event_shape(loc=loc, log_std=log_std, noise=noise)
    return loc + torch.exp(log_std) * noise


def tanh_gaussian_sample(
    loc: Tensor,
    log_std: Tensor,
    noise: Tensor,
    *,
    low: Tensor | float | None = None,
    high: Tensor | float | None = None,
) -> tuple[Tensor, Tensor]:
    """Tanh-squashed Gaussian sample a = c + h * tanh(u), u = mu + sigma * eps, eps ~ N(0, I) given.

    Without bounds c = 0, h = 1, so a lies in (-1, 1). With bounds c = (high + low) / 2 and
    h = (high - low) / 2, so a lies in (low, high).

    Args:
        loc: [*B, D] float, mean mu of the pre-squash Gaussian.
        log_std: [*B, D] or [D] float, log sigma of the pre-squash Gaussian.
        noise: [*S, *B, D] float, standard-normal eps; leading sample dims broadcast.
        low: optional lower action bound, float or tensor broadcasting to [D]; requires ``high``.
        high: optional upper action bound, with high > low elementwise (not checked: that would read
            tensor values back to the host).

    Returns:
        (action, pre_tanh): both [*broadcast shape, D] float; ``pre_tanh`` is u. Keep u and pass it to
        ``tanh_gaussian_log_prob``: recovering it from a float32 action is lossy once |u| > ~4.

    Raises:
        ShapeError: as ``gaussian_sample``, or a bound's last dim is neither 1 nor D.
        ConfigError: only one of ``low`` / ``high`` is given.

    Reference: Haarnoja et al. (2018), "Soft Actor-Critic", appendix C.
    """
    pre_tanh = gaussian_sample(loc, log_std, noise)
    action = torch.tanh(pre_tanh)
    box = _affine(low, high, pre_tanh)
    if box is not None:
        center, half_range = box
        action = center + half_range * action
    return action, pre_tanh


def tanh_gaussian_log_prob(
    action: Tensor | None,
    loc: Tensor,
    log_std: Tensor,
    pre_tanh: Tensor | None = None,
    *,
    low: Tensor | float | None = None,
    high: Tensor | float | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """log p(a) = log N(u; mu, sigma^2) - sum_i log(1 - tanh(u_i)^2) - sum_i log h_i, a = c + h tanh(u).

    The tanh Jacobian is evaluated in the overflow-free form
    log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)),
    exact for every finite u (the naive log(1 - tanh(u)^2 + 1e-6) is biased and saturates at |u| ~ 7).
    Without bounds c = 0 and h = 1; with bounds c = (high + low)/2, h = (high - low)/2 and the
    affine map adds -sum_i log h_i.

    Which input is used: ``pre_tanh`` (u) when given, exactly; otherwise u is recovered from
    ``action`` as u = atanh(clamp(y, -1 + eps, 1 - eps)) with y = (a - c) / h. The clamp makes the
    result finite even at |y| = 1, where the true density's log is -inf: an action within ``eps``
    of a bound is scored as if it were at distance ``eps`` (|u| <= atanh(1 - eps), about 7.25 for
    eps = 1e-6). That is a small, deliberate bias at the edge of the box, not a change of density
    inside it. ``eps`` is raised to ``torch.finfo(dtype).eps`` where smaller, so that 1 - eps is
    representable (float32: 1.2e-7, bfloat16: 7.8e-3). Recovery from a float32 action also loses
    precision for |u| > ~4 (tanh rounds to within an ulp of 1), so store and pass ``pre_tanh``.
    An action outside the box (|y| > 1) is clamped the same way and scored as if at its edge: it
    is not checked (that would cost a device sync), so pass ``low``/``high`` for an env's scaled
    actions (Pendulum's [-2, 2]), or the squashed action the policy drew.

    Args:
        action: [*B, D] float, the squashed action a, or None when ``pre_tanh`` is given. Ignored
            (beyond its shape check) when ``pre_tanh`` is given.
        loc: [*B, D] float, mean mu of the pre-squash Gaussian.
        log_std: [*B, D] or [D] float, log sigma of the pre-squash Gaussian.
        pre_tanh: [*B, D] float, the pre-squash sample u, or None.
        low: optional lower action bound, float or tensor broadcasting to [D]; requires ``high``.
        high: optional upper action bound, high > low elementwise (not checked).
        eps: clamp margin of the atanh recovery, in units of the squashed [-1, 1] range; used only
            when ``pre_tanh`` is None.

    Returns:
        [*B, 1] float, log-density of the action summed over the action dim (keepdim).

    Raises:
        ConfigError: both ``action`` and ``pre_tanh`` are None; only one bound is given, or number bounds
            with low >= high; eps not in (0, 1).
        ShapeError: an input is not floating, is 0-d, the last dims differ, or the shapes do not
            broadcast; a bound's last dim is neither 1 nor D.

    Reference: Haarnoja et al. (2018), "Soft Actor-Critic", appendix C, eq. 21; the stable Jacobian
    as in ``torch.distributions.transforms.TanhTransform.log_abs_det_jacobian``.
    """
    if action is None and pre_tanh is None:
        raise ConfigError("action=None and pre_tanh=None: give the squashed action or its pre-tanh value")
    if not 0.0 < eps < 1.0:
        raise ConfigError(f"eps={eps!r}: expected 0 < eps < 1")
    given = {"action": action} if action is not None else {}
    if pre_tanh is not None:
        given["pre_tanh"] = pre_tanh
    _event_shape(**given, loc=loc, log_std=log_std)
    like = pre_tanh if pre_tanh is not None else action
    box = _affine(low, high, like)
    if pre_tanh is not None:
        u = pre_tanh
    else:
        y = action if box is None else (action - box[0]) / box[1]
        margin = max(eps, torch.finfo(y.dtype).eps)
        u = torch.atanh(y.clamp(-1.0 + margin, 1.0 - margin))
    log_jacobian = 2.0 * (_LOG_2 - u - torch.nn.functional.softplus(-2.0 * u))
    if box is not None:
        log_jacobian = log_jacobian + torch.log(box[1])
    return gaussian_log_prob(u, loc, log_std) - log_jacobian.sum(-1, keepdim=True)


def _check_logits(logits: Tensor, action_mask: Tensor | None, nvec: Sequence[int] | None) -> tuple[int, ...]:
    """The head sizes of ``logits`` [*B, K] (one head of K without ``nvec``); ShapeError/ConfigError naming the argument."""
    if not isinstance(logits, Tensor) or logits.ndim == 0 or not logits.is_floating_point():
        raise ShapeError(f"logits: expected a float tensor [*B, K], got {getattr(logits, 'shape', type(logits).__name__)} "
                         f"{getattr(logits, 'dtype', '')}")
    if action_mask is not None and (not isinstance(action_mask, Tensor) or action_mask.dtype != torch.bool
                                    or action_mask.shape != logits.shape):
        raise ShapeError(f"action_mask: expected a bool tensor of the logits' shape {tuple(logits.shape)}, got "
                         f"{getattr(action_mask, 'shape', type(action_mask).__name__)} {getattr(action_mask, 'dtype', '')}")
    k = logits.shape[-1]
    if nvec is None:
        return (k,)
    if any(isinstance(n, bool) or int(n) != n for n in nvec):  # (2.5, 2.5) was read as (2, 2), and the error blamed the sum
        raise ConfigError(f"nvec={tuple(nvec)!r}: expected integer head sizes")
    heads = tuple(int(n) for n in nvec)
    if not heads or any(n < 1 for n in heads):
        raise ConfigError(f"nvec={tuple(nvec)!r}: expected one or more head sizes >= 1")
    if sum(heads) != k:
        raise ShapeError(f"nvec={heads}: the head sizes sum to {sum(heads)}, but logits' last dim is {k}")
    return heads


def _heads(logits: Tensor, action_mask: Tensor | None, heads: tuple[int, ...]) -> list[Tensor]:
    """Masked logits of each head (a list of [*B, n_h])."""
    masks = [None] * len(heads) if action_mask is None else action_mask.split(heads, -1)
    return [masked_logits(x, m) for x, m in zip(logits.split(heads, -1), masks)]


def masked_logits(logits: Tensor, action_mask: Tensor | None) -> Tensor:
    """Logits with invalid actions set to the dtype's lowest finite value (probability 0, no NaN).

    Args:
        logits: [*B, K] float, one categorical head.
        action_mask: [*B, K] bool, True where the action is allowed, or None (nothing masked). A row
            without any allowed action is left unmasked (the env then treats any move as blocked).

    Returns:
        [*B, K], ``logits``' dtype; ``logits`` itself when ``action_mask`` is None.

    Raises:
        ShapeError: the mask is not a bool tensor (a 0/1 float or int mask included), or its shape
            differs from the logits'.
    """
    if action_mask is None:
        return logits
    if not isinstance(action_mask, Tensor) or action_mask.dtype != torch.bool:
        got = f"dtype {action_mask.dtype}" if isinstance(action_mask, Tensor) else type(action_mask).__name__
        raise ShapeError(f"action_mask: expected a bool tensor (True where the action is allowed), got {got}")
    if action_mask.shape != logits.shape:
        raise ShapeError(f"action_mask has shape {tuple(action_mask.shape)}, expected {tuple(logits.shape)} like the logits")
    mask = action_mask | ~action_mask.any(-1, keepdim=True)
    return logits.masked_fill(~mask, torch.finfo(logits.dtype).min)


def categorical_log_prob(
    logits: Tensor, action: Tensor, *, action_mask: Tensor | None = None, nvec: Sequence[int] | None = None
) -> Tensor:
    """log pi(a) = sum_h [l_{h, a_h} - logsumexp_k l_{h, k}] over the (masked) heads' logits.

    Args:
        logits: [*B, K] float, unnormalised log-probabilities (K = sum(nvec) with ``nvec``); a -inf
            logit gives its action log-probability -inf and a finite gradient.
        action: int64 [*B] (Discrete), or [*B, H] with ``nvec`` of length H (MultiDiscrete).
        action_mask: optional [*B, K] bool, True where allowed (per head, see ``masked_logits``). A
            masked action's log-probability is about the dtype's lowest value (finite, not -inf).
        nvec: optional head sizes (n_1, ..., n_H) of a MultiDiscrete action space.

    Returns:
        [*B, 1] float, ``logits``' dtype.

    Raises:
        ShapeError: ``logits`` / ``action`` / ``action_mask`` / ``nvec`` disagree in shape or dtype.
        ConfigError: a head size < 1.
    """
    heads = _check_logits(logits, action_mask, nvec)
    want = logits.shape[:-1] if nvec is None else (*logits.shape[:-1], len(heads))
    if not isinstance(action, Tensor) or action.dtype not in (torch.int64, torch.int32) or action.shape != want:
        raise ShapeError(f"action: expected an int64 tensor of shape {tuple(want)}, got "
                         f"{getattr(action, 'shape', type(action).__name__)} {getattr(action, 'dtype', '')}")
    if action.device != logits.device:  # a meta action against CPU logits returned garbage
        raise ShapeError(f"action is on {action.device} but logits are on {logits.device}")
    actions = action.unsqueeze(-1) if nvec is None else action.split(1, -1)
    if nvec is None:
        actions = (actions,)
    try:
        return sum(
            torch.log_softmax(x, -1).gather(-1, a.long()) for x, a in zip(_heads(logits, action_mask, heads), actions)
        )
    except (RuntimeError, IndexError) as e:  # an action outside its head's range (gather's error named no argument)
        if "out of bounds" not in str(e):
            raise
        raise ShapeError(f"action: expected values in [0, n) for head sizes {tuple(heads)}, got one outside "
                         f"({str(e).splitlines()[0]})") from None


def categorical_entropy(logits: Tensor, *, action_mask: Tensor | None = None, nvec: Sequence[int] | None = None) -> Tensor:
    """H = -sum_h sum_k p_{h,k} log p_{h,k} over the (masked) heads; masked actions add exactly 0.

    Args:
        logits: [*B, K] float (K = sum(nvec) with ``nvec``). A logit may be -inf (probability 0):
            the entropy and its gradient stay finite, equal to ``torch.distributions.Categorical``'s.
        action_mask: optional [*B, K] bool, True where allowed.
        nvec: optional MultiDiscrete head sizes.

    Returns:
        [*B, 1] float, ``logits``' dtype.

    Raises:
        ShapeError / ConfigError: as ``categorical_log_prob``.
    """
    heads = _check_logits(logits, action_mask, nvec)
    total = 0
    for x in _heads(logits, action_mask, heads):
        logp = torch.log_softmax(x, -1)
        p = logp.exp()
        # p log p -> 0 as p -> 0: log p floored at the lowest finite value, so a -inf logit adds
        # 0 * finite = 0 and its gradient 0 (a torch.where around p * log p still back-propagated
        # 0 * -inf = NaN into every logit); torch.distributions.Categorical.entropy does the same
        total = total - (p * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1, keepdim=True)
    return total


def categorical_sample(
    logits: Tensor,
    generator: torch.Generator | None = None,
    *,
    noise: Tensor | None = None,
    action_mask: Tensor | None = None,
    nvec: Sequence[int] | None = None,
) -> Tensor:
    """a_h = argmax_k (l_{h,k} + g_{h,k}), g = -log(-log u), u ~ U(0, 1): the Gumbel-max trick, per head.

    A masked action (logit at the dtype's lowest value) is never drawn: its perturbed logit stays
    below any allowed one's, since the Gumbel noise is bounded (uniforms clamped to [tiny, 1 - eps]).

    Args:
        logits: [*B, K] float (K = sum(nvec) with ``nvec``).
        generator: the random stream of the uniforms u (a ``torch.Generator`` on ``logits``' device);
            None uses the device's default generator. Ignored when ``noise`` is given.
        noise: optional [*B, K] float uniforms u in [0, 1] (then nothing is drawn here).
        action_mask: optional [*B, K] bool, True where allowed.
        nvec: optional MultiDiscrete head sizes.

    Returns:
        int64 [*B] (Discrete) or [*B, H] (MultiDiscrete), without gradient.

    Raises:
        ShapeError: ``noise`` is not shaped like ``logits``; otherwise as ``categorical_log_prob``.
    """
    heads = _check_logits(logits, action_mask, nvec)
    if noise is None:
        u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=logits.dtype)
    elif not isinstance(noise, Tensor) or noise.shape != logits.shape or not noise.is_floating_point():
        raise ShapeError(f"noise: expected float uniforms of the logits' shape {tuple(logits.shape)}, got "
                         f"{getattr(noise, 'shape', type(noise).__name__)}")
    else:
        u = noise.to(logits.dtype)
    tiny = torch.finfo(logits.dtype).tiny
    gumbel = -torch.log(-torch.log(u.clamp(tiny, 1.0 - torch.finfo(logits.dtype).eps)))
    if nvec is None:
        return (masked_logits(logits.detach(), action_mask) + gumbel).argmax(-1)
    perturbed = torch.cat(_heads(logits.detach(), action_mask, heads), -1) + gumbel
    return torch.stack([x.argmax(-1) for x in perturbed.split(heads, -1)], -1)


def categorical_mode(logits: Tensor, *, action_mask: Tensor | None = None, nvec: Sequence[int] | None = None) -> Tensor:
    """The most probable allowed action, a_h = argmax_k l_{h,k} per head (the greedy policy).

    Returns:
        int64 [*B] (Discrete) or [*B, H] (MultiDiscrete).

    Raises:
        ShapeError / ConfigError: as ``categorical_log_prob``.
    """
    heads = _check_logits(logits, action_mask, nvec)
    modes = [x.argmax(-1) for x in _heads(logits, action_mask, heads)]
    return modes[0] if nvec is None else torch.stack(modes, -1)

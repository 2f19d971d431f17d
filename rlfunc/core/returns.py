"""Discounted sums over time (generalized advantage estimates, discounted returns, running returns)
and group-relative advantages (GRPO, at the end of the module).

Every discounted sum here is a first-order linear recurrence along one time dimension,
``y_t = x_t + a_t * y_{t+1}`` (or its forward twin), evaluated exactly by a parallel scan:
ceil(log2 T) vectorised steps, no Python loop over time steps, no division and no 64-bit float tensors
(NPUs lack them), so nothing overflows in float32 for any T (a product of discounts can only
underflow to 0 where its true value is below 1e-38). A discount given as a
number (gamma, lmbda) has its powers formed in double precision (Python floats) on the host and rounded once, which makes
these results more accurate than a float32 loop over time when gamma * lmbda is close to 1.
float16/bfloat16 inputs are computed in float32 and returned in their own dtype. Any device; no
host-device synchronisation except the range check of tensor-valued gamma/lmbda. Differentiable:
when autograd records (an input requires grad), a slower out-of-place path is taken.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import Tensor

from rlfunc.core.func import reads_values
from rlfunc.core.shapes import broadcast_shapes
from rlfunc.errors import ConfigError, ShapeError

__all__ = [
    "reverse_discounted_cumsum",
    "forward_discounted_sum",
    "discounted_returns",
    "generalized_advantage_estimate",
    "group_relative_advantage",
]


# --------------------------------------------------------------------------------------------
# The scan
# --------------------------------------------------------------------------------------------


def _scan(
    x: Tensor, a: Tensor | float, dim: int, reverse: bool, products: bool = False, mask: Tensor | None = None
):
    """Hillis-Steele scan of y_t = x_t + a_t * y_{t+1} (reverse) or y_{t-1} (forward) along ``dim``.

    After the step with shift s, y_t holds the recurrence over the window [t, t + 2s) (reverse) or
    (t - 2s, t] (forward) and a_t the product of the discounts over that window. Only products of
    discounts are formed (no division), so nothing overflows, and a zero discount stays an exact
    zero. ``x`` and ``a`` are only read.

    ``a`` is a tensor, or a number c, optionally times ``mask`` (0/1 in ``x``'s dtype), i.e.
    a_t = c * mask_t. A number's powers c^s are formed as Python floats (double precision) and rounded once, so
    a float32 c^s is as accurate as one rounding (squaring a float32 c k times instead would err by
    2^k roundings of c: 1.5e-5 relative at s = 512). With ``products`` (tensor ``a`` only) the
    products over the windows clipped at the sequence end are returned as well.
    """
    T = x.shape[dim]
    scalar = not isinstance(a, Tensor)
    coef = a if scalar else None  # c^s
    a = mask if scalar else a
    if a is not None:
        a = a.expand_as(x)
    if torch.is_grad_enabled() and (x.requires_grad or (a is not None and a.requires_grad)):
        return _scan_autograd(x, a, coef, dim, reverse, products)
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if wrapped(x) or (a is not None and wrapped(a)):  # under torch.func.vmap: no out= ops (the bug: a deep
        return _scan_autograd(x, a, coef, dim, reverse, products)  # "Batching rule not implemented for aten::addcmul.out")
    y_bufs = [torch.empty_like(x), torch.empty_like(x) if T > 2 else None]
    a_bufs = [None, None]
    y, s, i = x, 1, 0
    while s < T:
        n = T - s
        dst, src, keep = (0, s, n) if reverse else (s, 0, 0)
        out = y_bufs[i]  # ping-pong between two buffers; the caller's x is never written
        y_dst, y_src, y_out = y.narrow(dim, dst, n), y.narrow(dim, src, n), out.narrow(dim, dst, n)
        if a is None:
            torch.add(y_dst, y_src, alpha=coef, out=y_out)
        elif coef is None:
            torch.addcmul(y_dst, a.narrow(dim, dst, n), y_src, out=y_out)
        else:
            torch.addcmul(y_dst, a.narrow(dim, dst, n), y_src, value=coef, out=y_out)
        out.narrow(dim, keep, s).copy_(y.narrow(dim, keep, s))
        # the next step reads a_t only where its window still fits; the rest only for ``products``
        if coef is not None:
            coef = coef * coef
            if abs(coef) < torch.finfo(x.dtype).tiny:  # no subnormal multipliers (slow on CPUs)
                coef = 0.0
        if a is not None and (2 * s < T or products):
            if a_bufs[i] is None:
                a_bufs[i] = torch.empty_like(x)
            a_out = a_bufs[i]
            torch.mul(a.narrow(dim, dst, n), a.narrow(dim, src, n), out=a_out.narrow(dim, dst, n))
            if products:
                a_out.narrow(dim, keep, s).copy_(a.narrow(dim, keep, s))
            a = a_out
        y, s, i = out, 2 * s, i ^ 1
    if y is x:
        y = x.clone()
    return y, (a if products else None)


def _scan_autograd(x: Tensor, a: Tensor | None, coef: float | None, dim: int, reverse: bool, products: bool):
    """:func:`_scan` without ``out=`` (which autograd refuses): the same steps, a_t = coef * a_t
    with either factor absent (``None``), new tensors at every step."""
    T, y, s = x.shape[dim], x, 1

    def join(updated: Tensor, kept: Tensor) -> Tensor:
        return torch.cat([updated, kept] if reverse else [kept, updated], dim)

    while s < T:
        n = T - s
        dst, src, keep = (0, s, n) if reverse else (s, 0, 0)
        term = y.narrow(dim, src, n)
        if a is not None:
            term = a.narrow(dim, dst, n) * term
            a = join(a.narrow(dim, dst, n) * a.narrow(dim, src, n), a.narrow(dim, keep, s))
        if coef is not None:
            term, coef = coef * term, coef * coef
        y, s = join(y.narrow(dim, dst, n) + term, y.narrow(dim, keep, s)), 2 * s
    return (y if y is not x else x.clone()), (a if products else None)


def _blocked_scan(x: Tensor, a: Tensor, dim: int, reverse: bool, block: int) -> Tensor:
    """The same recurrence in blocks of ``block`` steps: a scan inside every block, then a scan of
    the block carries (recursively blocked), then one fused update. O(T log block) work."""
    T = x.shape[dim]
    if T <= block:
        return _scan(x, a, dim, reverse)[0]
    nb = -(-T // block)
    pad = nb * block - T
    a = a.expand_as(x)
    if pad:  # zeros appended after the end change nothing before it, in either direction
        widths = [0, 0] * (x.ndim - 1 - dim) + [0, pad]
        x, a = F.pad(x, widths), F.pad(a, widths)
    xb, ab = x.unflatten(dim, (nb, block)), a.unflatten(dim, (nb, block))
    yb, pb = _scan(xb, ab, dim + 1, reverse, products=True)
    edge = 0 if reverse else block - 1  # the block element that reaches across the boundary
    carry = _blocked_scan(
        yb.select(dim + 1, edge).contiguous(), pb.select(dim + 1, edge).contiguous(), dim, reverse, block
    )
    # the carry each block receives from its neighbour: Y_{b+1} (reverse) or Y_{b-1} (forward)
    shifted = torch.zeros_like(carry)
    if reverse:
        shifted.narrow(dim, 0, nb - 1).copy_(carry.narrow(dim, 1, nb - 1))
    else:
        shifted.narrow(dim, 1, nb - 1).copy_(carry.narrow(dim, 0, nb - 1))
    y = torch.addcmul(yb, pb, shifted.unsqueeze(dim + 1)).flatten(dim, dim + 1)
    return y.narrow(dim, 0, T) if pad else y


def _blocked_scan_scalar(x: Tensor, c: float, dim: int, reverse: bool, block: int) -> Tensor:
    """:func:`_blocked_scan` for a number ``c``: every discount product is a power of ``c`` formed in
    double precision and rounded once (the block scans with ``c``, the carries' scan with
    ``c ** block``, the carry factors ``c ** k``), so it is as accurate as the unblocked scan.
    Forming them as float32 products of ``c`` lost 2^k roundings (a new-user pass measured 2.2e-5
    at gamma 0.999, T 20000, block 64: worse than a float32 loop)."""
    T = x.shape[dim]
    if T <= block:
        return _scan(x, c, dim, reverse)[0]
    nb = -(-T // block)
    pad = nb * block - T
    if pad:  # zeros appended after the end change nothing before it, in either direction
        x = F.pad(x, [0, 0] * (x.ndim - 1 - dim) + [0, pad])
    yb = _scan(x.unflatten(dim, (nb, block)), c, dim + 1, reverse)[0]
    edge = 0 if reverse else block - 1
    carry = _blocked_scan_scalar(yb.select(dim + 1, edge).contiguous(), float(c) ** block, dim, reverse, block)
    shifted = torch.zeros_like(carry)
    if reverse:
        shifted.narrow(dim, 0, nb - 1).copy_(carry.narrow(dim, 1, nb - 1))
    else:
        shifted.narrow(dim, 1, nb - 1).copy_(carry.narrow(dim, 0, nb - 1))
    k = torch.arange(block, dtype=torch.float64)  # ok-float64: on the CPU (NPUs lack float64), rounded once to x's dtype
    power = float(c) ** (block - k if reverse else k + 1)  # the carry's factor at each place in a block
    power = power.to(device=x.device, dtype=x.dtype).view(block, *([1] * (yb.ndim - dim - 2)))
    y = torch.addcmul(yb, power, shifted.unsqueeze(dim + 1)).flatten(dim, dim + 1)
    return y.narrow(dim, 0, T) if pad else y


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _time_index(t: Tensor, time_dim: int, name: str) -> int:
    if not isinstance(t, Tensor):  # a numpy array or a list was an AttributeError deep inside
        raise ShapeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not isinstance(time_dim, numbers.Integral) or isinstance(time_dim, bool):  # 1.0 passed the range check, then failed deep inside
        raise ConfigError(f"time_dim={time_dim!r}: expected an int, a dim of {name} with shape {tuple(t.shape)}")
    time_dim = int(time_dim)
    if not -t.ndim <= time_dim < t.ndim:
        raise ShapeError(f"time_dim={time_dim} is outside the dims of {name} with shape {tuple(t.shape)}")
    return time_dim % t.ndim


def _compute_dtype(*ts: Tensor, names: tuple[str, ...] = ()) -> torch.dtype:
    dtype = torch.float32
    for i, t in enumerate(ts):
        if not t.is_floating_point():
            name = names[i] if i < len(names) else "the input"
            raise ShapeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check_unit(name: str, value) -> None:
    """``value`` (a number or a tensor) must lie in [0, 1]; a tensor costs one device sync."""
    if isinstance(value, Tensor):
        if not reads_values(value):  # batched by vmap (a sweep of gammas) or under compile: no host read
            return
        bad = bool(((value < 0) | (value > 1) | value.isnan()).any())
        if bad:
            raise ConfigError(
                f"{name} must lie in [0, 1], got a tensor with values in "
                f"[{value.min().item():g}, {value.max().item():g}]"
            )
    elif isinstance(value, numbers.Real):
        if not 0.0 <= float(value) <= 1.0:
            raise ConfigError(f"{name} must lie in [0, 1], got {value!r}")
    else:
        raise ConfigError(f"{name} must be a float or a tensor, got {type(value).__name__}")


def _check_same(ref_name: str, ref: Tensor, **others: Tensor) -> None:
    for name, t in ((ref_name, ref), *others.items()):  # a numpy array or a list fails here, named
        if not isinstance(t, Tensor):
            raise ShapeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in others.items():
        if t.shape != ref.shape:
            raise ShapeError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
                "they must be equal"
            )
        if t.device != ref.device:
            raise ShapeError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def _as_bool(name: str, t: Tensor) -> Tensor:
    if t.dtype == torch.bool:
        return t
    if t.is_complex():
        raise ShapeError(f"{name} must be bool (or 0/1 numbers), got dtype {t.dtype}")
    return t != 0


def _discount_tensor(discount, x: Tensor, dtype: torch.dtype, name: str = "discount"):
    """A number stays a float; a tensor must broadcast to ``x`` and is cast to ``dtype``."""
    if isinstance(discount, Tensor):
        try:
            fits = broadcast_shapes(discount.shape, x.shape) == x.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ShapeError(
                f"{name} with shape {tuple(discount.shape)} does not broadcast to the shape {tuple(x.shape)}"
            )
        if discount.ndim == 0:  # a 0-dim tensor may live anywhere, like a number
            return discount.to(device=x.device, dtype=dtype)
        if discount.device != x.device:
            raise ShapeError(f"{name} is on {discount.device} but the values are on {x.device}")
        return discount.to(dtype)
    if isinstance(discount, numbers.Real):
        return float(discount)
    raise ShapeError(f"{name} must be a number or a tensor, got {type(discount).__name__}")


# --------------------------------------------------------------------------------------------
# Public operators
# --------------------------------------------------------------------------------------------


def reverse_discounted_cumsum(
    x: Tensor, discount: Tensor | float, *, time_dim: int = -2, block: int | None = None
) -> Tensor:
    """Reverse discounted cumulative sum, y_t = x_t + discount_t * y_{t+1}, with y_T = 0.

    Equivalently y_t = sum_{k >= t} (prod_{j=t}^{k-1} discount_j) x_k. A zero discount cuts the sum
    exactly (nothing after it reaches back past it).

    Args:
        x: [*B, T, *F] float, the terms, time along ``time_dim``.
        discount: a number, or a float tensor broadcastable to ``x``'s shape, normally in [0, 1]
            (e.g. gamma * (1 - done_t)); values are not checked, and the result is only guaranteed
            free of overflow for |discount| <= 1.
        time_dim: the time dimension of ``x`` (and of ``discount`` once broadcast).
        block: ``None`` (default) scans the whole time axis at once, ceil(log2 T) vectorised steps
            and O(T log T) work, which was fastest measured on CPU up to T of a few thousand. An
            integer scans blocks of ``block`` steps and then the blocks' carries, O(T log block)
            work, a little faster for very long T (T ~ 1e5 or more). Both are exact.

    Returns:
        [*B, T, *F] with ``x``'s dtype and device (float16/bfloat16 are computed in float32).

    Raises:
        ShapeError: ``x`` is not floating point, ``time_dim`` is not a dim of ``x``, or ``discount``
            does not broadcast to ``x``'s shape or lives on another device.
        ConfigError: ``block`` is not an integer >= 2, or ``time_dim`` is not an int.

    Reference: Sutton & Barto (2018), eq. 3.9 (the return as a recursion).
    """
    dim = _time_index(x, time_dim, "x")
    return _run(x, discount, dim, block, reverse=True)


def forward_discounted_sum(
    x: Tensor, discount: Tensor | float, *, time_dim: int = -2, initial: Tensor | None = None
) -> Tensor:
    """Forward discounted sum, z_t = discount_t * z_{t-1} + x_t, with z_{-1} = ``initial``.

    The running discounted return used to normalise rewards by its standard deviation across
    rollouts: z_t = gamma * (1 - done_{t-1}) * z_{t-1} + r_t; pass the last z of one rollout as
    ``initial`` of the next.

    Args:
        x: [*B, T, *F] float, the terms, time along ``time_dim``.
        discount: a number, or a float tensor broadcastable to ``x``'s shape, normally in [0, 1];
            discount_t multiplies the carry entering step t (a zero there starts afresh at t).
        time_dim: the time dimension of ``x``.
        initial: [*B, 1, *F] float (size 1 along ``time_dim``), the carry before the first step;
            ``None`` means zero.

    Returns:
        [*B, T, *F], all z_t, with ``x``'s dtype and device (float16/bfloat16 computed in float32).
        ``result.narrow(time_dim, T - 1, 1)`` is the ``initial`` of the next rollout.

    Raises:
        ShapeError: as for :func:`reverse_discounted_cumsum`, or ``initial`` is not ``x``'s shape
            with size 1 along ``time_dim``.
        ConfigError: ``time_dim`` is not an int.
    """
    dim = _time_index(x, time_dim, "x")
    if initial is None:
        return _run(x, discount, dim, None, reverse=False)
    if not isinstance(initial, Tensor):  # 0.0 was an AttributeError, a numpy array "initial is on cpu but x is on cpu"
        raise ShapeError(f"initial: expected None or a torch.Tensor, got {type(initial).__name__}")
    expected = x.shape[:dim] + (1,) + x.shape[dim + 1 :]
    if initial.shape != expected:
        raise ShapeError(
            f"initial has shape {tuple(initial.shape)}, expected {tuple(expected)} "
            f"(x's shape {tuple(x.shape)} with size 1 along time_dim={time_dim})"
        )
    if initial.device != x.device:
        raise ShapeError(f"initial is on {initial.device} but x is on {x.device}")
    dtype = _compute_dtype(x, initial, names=("x", "initial"))  # before the empty case (an int x was returned as is)
    if x.shape[dim] == 0:
        return x.clone()
    # fold the carry into the first term: z_0 = x_0 + discount_0 * initial
    a = _discount_tensor(discount, x, dtype)
    first = a.expand_as(x).narrow(dim, 0, 1) if isinstance(a, Tensor) else a
    xc = x.to(dtype)  # the first term out of place: under vmap a batched initial cannot be added into an unbatched x
    xc = torch.cat([xc.narrow(dim, 0, 1) + first * initial.to(dtype), xc.narrow(dim, 1, xc.shape[dim] - 1)], dim)
    return _run(xc, a, dim, None, reverse=False).to(x.dtype)


def _run(x: Tensor, discount, dim: int, block: int | None, reverse: bool) -> Tensor:
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 2):
        raise ConfigError(f"block must be an integer >= 2 or None, got {block!r}")
    dtype = _compute_dtype(x, names=("x",))
    a = _discount_tensor(discount, x, dtype)
    xc = x.to(dtype)
    if block is not None and x.shape[dim] > block:
        y = _blocked_scan(xc, a, dim, reverse, block) if isinstance(a, Tensor) else _blocked_scan_scalar(xc, a, dim, reverse, block)
    else:
        y = _scan(xc, a, dim, reverse)[0]
    return y.to(x.dtype)


def discounted_returns(reward: Tensor, done: Tensor, gamma: float | Tensor, *, time_dim: int = -2) -> Tensor:
    """Discounted return without bootstrap, G_t = r_t + gamma * (1 - done_t) * G_{t+1}, G_T = 0.

    Args:
        reward: [*B, T, *F] float, reward received after the action at step t.
        done: [*B, T, *F] bool (or 0/1 numbers), the episode ended at step t; cuts the sum.
        gamma: discount in [0, 1], a number or a tensor broadcastable to ``reward``.
        time_dim: the time dimension of every input.

    Returns:
        [*B, T, *F] with ``reward``'s dtype and device.

    Raises:
        ConfigError: ``gamma`` is outside [0, 1], or ``time_dim`` is not an int.
        ShapeError: ``done`` and ``reward`` differ in shape or device, ``reward`` is not floating
            point, or ``time_dim`` is not one of their dims.

    Reference: Sutton & Barto (2018), eq. 3.8-3.9.
    """
    _check_unit("gamma", gamma)
    _check_same("reward", reward, done=done)
    dim = _time_index(reward, time_dim, "reward")
    dtype = _compute_dtype(reward, names=("reward",))
    done = _as_bool("done", done)
    g = _discount_tensor(gamma, reward, dtype, "gamma")
    return _scan_cut(reward.to(dtype), g, done, dim).to(reward.dtype)


def _scan_cut(x: Tensor, g: Tensor | float, cut: Tensor, dim: int) -> Tensor:
    """y_t = x_t + g * (1 - cut_t) * y_{t+1}; a number ``g`` is kept apart from the 0/1 mask."""
    if isinstance(g, Tensor):
        return _scan(x, torch.where(cut, 0.0, g), dim, reverse=True)[0]
    return _scan(x, g, dim, reverse=True, mask=(~cut).to(x.dtype))[0]


def generalized_advantage_estimate(
    gamma: float | Tensor,
    lmbda: float | Tensor,
    state_value: Tensor,
    next_state_value: Tensor,
    reward: Tensor,
    done: Tensor,
    terminated: Tensor | None = None,
    *,
    time_dim: int = -2,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimate (GAE) and its value target.

        delta_t = r_t + gamma * (1 - terminated_t) * V(s'_t) - V(s_t)
        A_t     = delta_t + gamma * lmbda * (1 - done_t) * A_{t+1},   A_T = 0
        value_target_t = A_t + V(s_t)

    ``done`` (termination or truncation) cuts the trace at an episode end; ``terminated`` alone
    zeroes the bootstrap, so a time-limit truncation (done and not terminated) bootstraps from
    V(s'_t), the value of the true final observation. The last step of a rollout that is not done
    bootstraps from ``next_state_value`` as usual. Same signature and semantics as TorchRL's
    ``torchrl.objectives.value.functional.generalized_advantage_estimate``; exact (no kernel
    truncation) and stable in float32 for any T.

    Args:
        gamma: discount in [0, 1], a number or a tensor broadcastable to ``state_value``.
        lmbda: GAE lambda in [0, 1], a number or a tensor broadcastable to ``state_value``.
        state_value: [*B, T, *F] float, V(s_t).
        next_state_value: [*B, T, *F] float, V(s'_t), the value of the observation after step t
            (before any reset).
        reward: [*B, T, *F] float, r_t.
        done: [*B, T, *F] bool (or 0/1 numbers), the episode ended at step t (terminated or
            truncated).
        terminated: [*B, T, *F] bool (or 0/1 numbers), the episode reached a terminal state at
            step t; ``None`` means ``done``.
        time_dim: the time dimension of every input (TorchRL's default, -2: [*B, T, F]).

    Returns:
        ``(advantage, value_target)``, each [*B, T, *F] with ``state_value``'s dtype and device
        (float16/bfloat16 are computed in float32).

    Raises:
        ConfigError: ``gamma`` or ``lmbda`` is outside [0, 1] (a tensor is checked with one
            device sync; not one batched by torch.func.vmap, nor under torch.compile), or ``time_dim``
            is not an int.
        ShapeError: the five tensors differ in shape or device, the values are not floating
            point, or ``time_dim`` is not one of their dims.

    Reference: Schulman, Moritz, Levine, Jordan & Abbeel (2016), "High-Dimensional Continuous
    Control Using Generalized Advantage Estimation", eq. 16 (with eq. 11-14).
    """
    _check_unit("gamma", gamma)
    _check_unit("lmbda", lmbda)
    if terminated is None:
        terminated = done
    _check_same(
        "state_value", state_value,
        next_state_value=next_state_value, reward=reward, done=done, terminated=terminated,
    )
    dim = _time_index(state_value, time_dim, "state_value")
    dtype = _compute_dtype(state_value, next_state_value, reward, names=("state_value", "next_state_value", "reward"))
    done, terminated = _as_bool("done", done), _as_bool("terminated", terminated)
    g = _discount_tensor(gamma, state_value, dtype, "gamma")
    lm = _discount_tensor(lmbda, state_value, dtype, "lmbda")
    v = state_value.to(dtype)
    bootstrap = next_state_value.to(dtype).masked_fill(terminated, 0.0)
    # out of place: under vmap an in-place op on an unbatched result of a batched operand fails (a critic
    # ensemble's state_value against one shared next_state_value; a batched gamma)
    if isinstance(g, Tensor):
        delta = torch.addcmul(reward.to(dtype), g, bootstrap) - v
    else:
        delta = torch.add(reward.to(dtype), bootstrap, alpha=g) - v
    advantage = _scan_cut(delta, g * lm, done, dim)
    value_target = advantage + v
    out = state_value.dtype
    return advantage.to(out), value_target.to(out)


# --------------------------------------------------------------------------------------------
# Group-relative advantages (GRPO family)
# --------------------------------------------------------------------------------------------

_GROUP_STD = ("group", "batch", "none")


def group_relative_advantage(
    reward: Tensor,
    *,
    group_dim: int = -1,
    std: str = "group",
    eps: float = 1e-4,
    unbiased: bool = True,
) -> Tensor:
    """Group-relative advantage of G outcomes that started from the same state (GRPO).

        A_i = (R_i - mean_g(R)) / (std(R) + eps)

    where the mean is over the G members of the group of i and std is chosen by ``std``:

    - ``"group"``: the std of the group of i (GRPO; Shao et al. 2024, "DeepSeekMath", sec. 4.1.2,
      outcome supervision: r~_i = (r_i - mean(r)) / std(r));
    - ``"batch"``: one std over every reward of the batch (all groups), the group-mean / batch-std
      mix of Liu et al. 2025, "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning";
    - ``"none"``: no division, A_i = R_i - mean_g(R) (Dr. GRPO; Liu et al. 2025, "Understanding
      R1-Zero-Like Training: A Critical Perspective", sec. 3.2, which drops the std because it
      weights groups by their difficulty).

    Edge cases, exact and finite (never NaN):

    - a group whose rewards are all equal gets exactly 0 for every member (no signal), whatever
      ``std`` (the float mean of equal numbers need not equal them, so this is enforced);
    - a group of one (G = 1) gets 0: its member equals its own mean, and its std (undefined for the
      unbiased estimate) is taken as 0;
    - with ``eps = 0`` a zero std only occurs for all-equal groups (or an all-equal batch), which
      are 0 by the rule above.

    Args:
        reward: [*B, G] float (any float dtype), the scalar outcome of each group member, e.g. the
            undiscounted episode return; G along ``group_dim``, every other dim indexes groups.
            A flat batch of ``n * G`` members laid out group by group is ``reward.view(n, G)``.
        group_dim: the dim holding the members of a group.
        std: ``"group"`` | ``"batch"`` | ``"none"``, as above.
        eps: >= 0, added to the std (reward units); only used when ``std != "none"``.
        unbiased: the std with Bessel's correction (divides by G - 1, or by the batch size - 1), as
            ``torch.std``'s default and DeepSeekMath's reference code; False divides by G.

    Returns:
        [*B, G], same dtype and device as ``reward``; float16/bfloat16 are computed in float32.
        Differentiable in ``reward`` (not usually needed).

    Raises:
        ShapeError: ``reward`` is not floating point or has no dims, or ``group_dim`` is not one of its dims.
        ConfigError: ``std`` is not one of the three names, or ``eps`` is negative or not finite.
    """
    if not isinstance(reward, Tensor) or reward.ndim == 0:
        raise ShapeError("reward: expected a tensor of shape [*B, G] with a group dim, got "
                         f"{type(reward).__name__ if not isinstance(reward, Tensor) else 'a 0-dim tensor'}")
    if isinstance(group_dim, bool) or not isinstance(group_dim, numbers.Integral):  # 1.0 was a TypeError from the % below
        raise ShapeError(f"group_dim={group_dim!r}: expected an int, one of reward's dims")
    if not -reward.ndim <= group_dim < reward.ndim:
        raise ShapeError(f"group_dim={group_dim} is outside the dims of reward with shape {tuple(reward.shape)}")
    dim = int(group_dim) % reward.ndim
    dtype = _compute_dtype(reward, names=("reward",))
    if std not in _GROUP_STD:
        raise ConfigError(f"std={std!r}: expected one of {', '.join(map(repr, _GROUP_STD))}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 <= float(eps) < float("inf"):
        raise ConfigError(f"eps={eps!r}: expected a finite number >= 0")
    r = reward.to(dtype)
    G = r.shape[dim]
    if r.numel() == 0:
        return reward.clone()
    mean = r.mean(dim, keepdim=True)
    all_equal = r.amax(dim, keepdim=True) == r.amin(dim, keepdim=True)
    centered = torch.where(all_equal, torch.zeros_like(r), r - mean)
    if std == "none":
        return centered.to(reward.dtype)
    correction = 1 if unbiased else 0
    if std == "group":
        scale = r.std(dim, keepdim=True, correction=correction) if G > correction else torch.zeros_like(mean)
    else:
        n = r.numel()
        scale = r.std(correction=correction) if n > correction else r.new_zeros(())
    denom = scale + float(eps)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))  # 0 only where centered is 0
    return (centered / denom).to(reward.dtype)

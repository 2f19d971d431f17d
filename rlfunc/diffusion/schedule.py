"""Noise schedules of a diffusion model and the timesteps a DDIM sampler visits.

The forward (noising) process of Ho et al. (2020) is q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I)
with abar_t = prod_{s <= t} (1 - beta_s), t = 0 .. T-1. A schedule is the TensorDict

    {"betas": beta [T], "alphas": 1 - beta [T], "alphas_cumprod": abar [T]}   (float32, batch_size [])

Every value is formed with Python floats (double precision) on the host and rounded to float32 once,
so no 64-bit float tensor is ever made (NPUs lack them) and ``alphas_cumprod`` is accurate to one
float32 rounding even for T in the thousands (a float32 ``cumprod`` drifts by ~T roundings).
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.errors import CheckpointError, ConfigError, ShapeError

__all__ = ["alpha_prod", "beta_schedule", "check_schedule", "ddim_timesteps", "make_schedule"]

_KINDS = ("linear", "cosine", "squaredcos_cap_v2")
_SPACINGS = ("leading", "linspace")
_MAX_BETA = 0.999  # cap of the cosine schedule (Nichol & Dhariwal 2021, sec. 3.2)
_COSINE_S = 0.008  # offset s of the cosine schedule


def _check_num_train_steps(num_train_steps: int) -> int:
    if isinstance(num_train_steps, bool) or not isinstance(num_train_steps, int) or num_train_steps < 1:
        raise ConfigError(f"num_train_steps={num_train_steps!r}: expected an int >= 1")
    return num_train_steps


def _betas(kind: str, num_train_steps: int, beta_start: float, beta_end: float) -> list[float]:
    """The betas as Python floats (double precision); see :func:`beta_schedule`."""
    if kind not in _KINDS:
        raise ConfigError(f"kind={kind!r}: expected one of {', '.join(_KINDS)}")
    T = _check_num_train_steps(num_train_steps)
    if kind == "linear":
        if not 0.0 < beta_start <= beta_end < 1.0:
            raise ConfigError(
                f"beta_start={beta_start!r}, beta_end={beta_end!r}: expected 0 < beta_start <= beta_end < 1"
            )
        if T == 1:
            return [float(beta_start)]
        return [beta_start + (beta_end - beta_start) * i / (T - 1) for i in range(T)]

    def alpha_bar(u: float) -> float:  # u = t / T in [0, 1]
        return math.cos((u + _COSINE_S) / (1.0 + _COSINE_S) * math.pi / 2) ** 2

    return [min(1.0 - alpha_bar((i + 1) / T) / alpha_bar(i / T), _MAX_BETA) for i in range(T)]


def beta_schedule(
    kind: str,
    num_train_steps: int,
    *,
    beta_start: float = 1e-4,
    beta_end: float = 0.02,
    device: torch.device | str | None = None,
) -> Tensor:
    """Noise variances beta_t, t = 0 .. T-1, of the forward process q(x_t | x_{t-1}) = N(sqrt(1 - beta_t) x_{t-1}, beta_t I).

    - ``"linear"`` (Ho et al. 2020): beta_t = beta_start + (beta_end - beta_start) t / (T - 1)
      (``torch.linspace(beta_start, beta_end, T)``; beta_start alone when T = 1).
    - ``"cosine"`` = ``"squaredcos_cap_v2"`` (Nichol & Dhariwal 2021, eq. 17):
      abar(u) = cos((u + 0.008) / 1.008 * pi / 2)^2 and beta_t = min(1 - abar((t + 1) / T) / abar(t / T), 0.999),
      the same values as diffusers' ``betas_for_alpha_bar`` (``beta_start``/``beta_end`` are ignored).

    Args:
        kind: "linear", "cosine" or "squaredcos_cap_v2".
        num_train_steps: T >= 1, the number of diffusion steps the denoiser is trained on.
        beta_start: beta_0 of the linear schedule, in (0, beta_end].
        beta_end: beta_{T-1} of the linear schedule, in [beta_start, 1).
        device: where to put the result (None: the default device).

    Returns:
        [T] float32 on ``device``; computed in double precision on the host, rounded once.

    Raises:
        ConfigError: unknown ``kind``, T < 1, or linear betas outside 0 < beta_start <= beta_end < 1.

    References: Ho, Jain & Abbeel (2020), "Denoising Diffusion Probabilistic Models", sec. 4;
    Nichol & Dhariwal (2021), "Improved Denoising Diffusion Probabilistic Models", sec. 3.2.
    """
    betas = _betas(kind, num_train_steps, beta_start, beta_end)
    return torch.tensor(betas, dtype=torch.float32, device=device)


def make_schedule(
    kind: str = "cosine",
    num_train_steps: int = 100,
    *,
    beta_start: float = 1e-4,
    beta_end: float = 0.02,
    device: torch.device | str | None = None,
) -> TensorDict:
    """The schedule TensorDict {"betas": beta_t, "alphas": alpha_t = 1 - beta_t, "alphas_cumprod": abar_t = prod_{s<=t} alpha_s}.

    Args:
        kind, num_train_steps, beta_start, beta_end: as :func:`beta_schedule`.
        device: where the tensors (and the TensorDict) live.

    Returns:
        TensorDict with batch_size [] and three [T] float32 entries on ``device``. The products are
        formed in double precision on the host and rounded once (see the module docstring).

    Raises:
        ConfigError: as :func:`beta_schedule`.
    """
    betas = _betas(kind, num_train_steps, beta_start, beta_end)
    alphas = [1.0 - b for b in betas]
    alphas_cumprod, running = [], 1.0
    for a in alphas:
        running *= a
        alphas_cumprod.append(running)

    def f32(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    return TensorDict(
        {"betas": f32(betas), "alphas": f32(alphas), "alphas_cumprod": f32(alphas_cumprod)},
        batch_size=[],
        device=device,
    )


def ddim_timesteps(
    num_train_steps: int,
    num_inference_steps: int,
    *,
    spacing: str = "leading",
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """The K timesteps tau_K > ... > tau_1 a DDIM sampler visits, and the timestep each one steps to.

    - ``"leading"`` (diffusers ``DDIMScheduler``, ``steps_offset=0``): r = T // K and
      tau = [(K-1) r, ..., r, 0]; e.g. T = 100, K = 10 gives [90, 80, ..., 0].
    - ``"linspace"``: tau = round(linspace(0, T-1, K)) reversed (round half to even, as numpy);
      e.g. T = 100, K = 4 gives [99, 66, 33, 0].

    ``prev_timesteps[i]`` is the next (less noisy) timestep of the list, ``timesteps[i+1]``, and -1 for
    the last step: the sampler then steps to x_0 with alpha_prod = 1 (diffusers' ``set_alpha_to_one``).
    With "linspace" this is the next element, not ``t - T // K``.

    Args:
        num_train_steps: T >= 1.
        num_inference_steps: K in [1, T].
        spacing: "leading" or "linspace".
        device: where to put the results.

    Returns:
        (timesteps, prev_timesteps): both [K] int64 on ``device``; ``timesteps`` strictly decreasing
        within [0, T-1] and ending at 0, ``prev_timesteps = [*timesteps[1:], -1]``.

    Raises:
        ConfigError: T < 1, K outside [1, T], or unknown ``spacing``.

    Reference: Song, Meng & Ermon (2021), "Denoising Diffusion Implicit Models", sec. 4.2 and App. C.2.
    """
    T = _check_num_train_steps(num_train_steps)
    K = num_inference_steps
    if isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= T:
        raise ConfigError(f"num_inference_steps={K!r}: expected an int in [1, num_train_steps={T}]")
    if spacing not in _SPACINGS:
        raise ConfigError(f"spacing={spacing!r}: expected one of {', '.join(_SPACINGS)}")
    if spacing == "leading":
        ratio = T // K
        steps = [i * ratio for i in range(K)]
    elif K == 1:
        steps = [0]
    else:
        step = (T - 1) / (K - 1)  # as numpy.linspace: arange(K) * step, then round half to even
        steps = [round(i * step) for i in range(K)]
        steps[-1] = T - 1
    steps.reverse()
    # K <= T makes both spacings strictly decreasing within [0, T-1]; kept as a guard
    if any(a <= b for a, b in zip(steps, steps[1:])) or steps[0] > T - 1 or steps[-1] < 0:
        raise ConfigError(f"ddim_timesteps(T={T}, K={K}, spacing={spacing!r}) gave {steps}")
    timesteps = torch.tensor(steps, dtype=torch.int64, device=device)
    prev = torch.tensor([*steps[1:], -1], dtype=torch.int64, device=device)
    return timesteps, prev


def alpha_prod(alphas_cumprod: Tensor, t: Tensor) -> Tensor:
    """abar_t = alphas_cumprod[t] for t >= 0, and 1 for t = -1 (the clean sample after the last DDIM step).

    Args:
        alphas_cumprod: [T] float, the schedule's ``"alphas_cumprod"``.
        t: int64 of any shape, values in [-1, T-1] (not checked: that would read ``t`` back to the
            host; other values index out of range or, below -1, read as 1 as well).

    Returns:
        ``t``'s shape, ``alphas_cumprod``'s dtype and device. Differentiable in ``alphas_cumprod``.

    Raises:
        ShapeError: ``alphas_cumprod`` is not 1-d floating or ``t`` is not int64.
    """
    if alphas_cumprod.ndim != 1 or not alphas_cumprod.is_floating_point():
        raise ShapeError(
            f"alphas_cumprod: expected a [T] float tensor, got shape {tuple(alphas_cumprod.shape)} {alphas_cumprod.dtype}"
        )
    if not isinstance(t, Tensor) or t.dtype != torch.int64:
        raise ShapeError(f"t: expected an int64 tensor of timesteps, got {getattr(t, 'dtype', type(t).__name__)}")
    # indexed by a 1-d tensor: a 0-d t indexes as a Python int, which torch.func.vmap refuses (.item()); (advanced
    # indexing, not index_select, which refuses a CPU t with an accelerator's schedule)
    picked = alphas_cumprod[t.clamp(min=0).reshape(-1)].reshape(t.shape)
    return torch.where(t >= 0, picked, 1.0)


def check_schedule(schedule: TensorDictBase, expected: TensorDictBase, *, atol: float = 1e-6) -> None:
    """Check that a loaded schedule is the one a run expects: |abar - abar_expected| <= atol everywhere.

    Called when a checkpoint is loaded: a denoiser is only meaningful under the schedule it was
    trained with, so a silent change of T or of the kind of schedule must fail loudly.

    Args:
        schedule: the schedule found in the checkpoint (a TensorDict with ``"alphas_cumprod"``).
        expected: the schedule the current config builds (``make_schedule``).
        atol: largest allowed absolute difference.

    Raises:
        CheckpointError: ``"alphas_cumprod"`` is missing from either, the shapes differ, or the values
            differ by more than ``atol``; the message names the key, the shapes or the max abs difference.
    """
    key = "alphas_cumprod"
    for name, td in (("schedule", schedule), ("expected", expected)):
        if key not in td.keys():
            raise CheckpointError(f"{name}: no {key!r} in the schedule (keys {sorted(map(str, td.keys()))})")
    got, want = schedule.get(key), expected.get(key)
    if got.shape != want.shape:
        raise CheckpointError(
            f"{key!r}: the checkpoint's schedule has shape {tuple(got.shape)}, the config's {tuple(want.shape)} "
            "(a different num_train_steps)"
        )
    diff = (got.detach().to(want.device, torch.float32) - want.detach().float()).abs()
    max_diff = diff.max().item() if diff.numel() else 0.0
    if not max_diff <= atol:  # also catches NaN
        raise CheckpointError(
            f"{key!r}: the checkpoint's schedule differs from the config's by up to {max_diff:.3g} "
            f"(allowed {atol:g}; a different kind of schedule or betas)"
        )

"""The diffusion actor shared by bc, dppo and td3-diffusion: denoiser skeleton, action scaling,
chunked sampling and evaluation on a torch-batched env.

A diffusion actor maps an observation to an action chunk [horizon, act_dim] in [-1, 1] by running
K DDIM steps (Song et al. 2021) of a denoiser eps_theta(x_k, k, s) from Gaussian noise; the first
``act_steps`` actions of the chunk are executed open loop (Chi et al. 2023). The env's actions
must be bounded by [-1, 1] (PointReach-v0's are).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from rlfunc import func
from rlfunc.diffusion.ddim import sample
from rlfunc.diffusion.schedule import make_schedule
from rlfunc.errors import ConfigError, EnvError
from rlfunc.normalize import normalize


def require_finite(config) -> None:
    """ConfigError naming the first float field of dataclass ``config`` that is NaN or infinite."""
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name}={value}: expected a finite number")


@dataclass(frozen=True)
class ActorSpec:
    """Architecture and diffusion settings of a diffusion actor (saved with every snapshot)."""

    denoiser: Literal["mlp", "unet"] = "mlp"  # DiffusionMLP (low-dim tasks) or ConditionalUnet1D
    hidden: tuple[int, ...] = (256, 256, 256)  # DiffusionMLP widths
    down_dims: tuple[int, ...] = (64, 128, 256)  # ConditionalUnet1D channel widths
    kernel_size: int = 5  # ConditionalUnet1D conv kernel
    horizon: int = 4  # action chunk length predicted per observation
    act_steps: int = 4  # actions of the chunk executed open loop (<= horizon)
    schedule: Literal["cosine", "linear"] = "cosine"  # beta schedule
    num_train_steps: int = 20  # T, DDPM training steps
    ddim_steps: int = 10  # K, DDIM steps at sampling (<= T)
    prediction: Literal["epsilon", "sample"] = "epsilon"  # what the denoiser predicts

    def __post_init__(self) -> None:
        require_finite(self)
        if self.denoiser not in ("mlp", "unet"):
            raise ConfigError(f"denoiser={self.denoiser!r}: expected 'mlp' or 'unet'")
        if not 1 <= self.act_steps <= self.horizon:
            raise ConfigError(f"act_steps={self.act_steps}: expected 1 <= act_steps <= horizon={self.horizon}")
        if not 1 <= self.ddim_steps <= self.num_train_steps:
            raise ConfigError(
                f"ddim_steps={self.ddim_steps}: expected 1 <= ddim_steps <= num_train_steps={self.num_train_steps}"
            )
        if self.num_train_steps % self.ddim_steps:
            raise ConfigError(
                f"ddim_steps={self.ddim_steps}: expected a divisor of num_train_steps={self.num_train_steps} "
                "(DDIM's 'leading' spacing would otherwise start below the noisiest training step)"
            )
        if any(h < 1 for h in (*self.hidden, *self.down_dims)) or self.kernel_size < 1 or self.horizon < 1:
            raise ConfigError("hidden, down_dims, kernel_size and horizon must be positive")
        if self.schedule not in ("cosine", "linear"):
            raise ConfigError(f"schedule={self.schedule!r}: expected 'cosine' or 'linear'")
        if self.prediction not in ("epsilon", "sample"):
            raise ConfigError(f"prediction={self.prediction!r}: expected 'epsilon' or 'sample'")


def make_denoiser(spec: ActorSpec, obs_dim: int, act_dim: int) -> nn.Module:
    """The denoiser skeleton: (x [*B, H, A], t [*B] int64, cond [*B, obs_dim]) -> [*B, H, A]."""
    if spec.denoiser == "unet":
        from rlfunc.nets.unet1d import ConditionalUnet1D

        return ConditionalUnet1D(act_dim, obs_dim, down_dims=spec.down_dims, kernel_size=spec.kernel_size)
    from rlfunc.nets.denoiser import DiffusionMLP

    return DiffusionMLP(act_dim, spec.horizon, obs_dim, hidden=spec.hidden)


def schedule_for(spec: ActorSpec, device: torch.device) -> TensorDict:
    """The noise schedule (betas, alphas, alphas_cumprod [T] float32) on ``device``.

    The linear schedule's betas (1e-4 .. 0.02 for T = 1000, Ho et al. 2020) are scaled by 1000 / T,
    so that a short chain still ends near pure noise (Nichol & Dhariwal 2021, ``get_named_beta_schedule``).
    """
    if spec.schedule == "linear":
        scale = 1000.0 / spec.num_train_steps
        return make_schedule("linear", spec.num_train_steps, beta_start=1e-4 * scale, beta_end=min(0.02 * scale, 0.999), device=device)
    return make_schedule(spec.schedule, spec.num_train_steps, device=device)


TORCH_ENVS = ("PointReach-v0",)


def check_env(env_id: str) -> None:
    """EnvError unless ``env_id`` has a torch-batched implementation the diffusion algorithms run on."""
    if env_id not in TORCH_ENVS:
        raise EnvError(
            f"env={env_id!r}: the diffusion algorithms run on torch-batched envs; expected one of {', '.join(TORCH_ENVS)}"
        )


def make_env(env_id: str, num_envs: int, act_steps: int, device: torch.device, seed: int):
    """The torch-batched TorchRL env for ``env_id`` taking [N, act_steps, A] action chunks.

    Raises:
        EnvError: ``env_id`` has no torch-batched implementation (the diffusion algorithms run on
            PointReach-v0 for now; gymnasium envs are stepped one action at a time by ``ppo``).
    """
    check_env(env_id)
    from envs.point_reach import PointReachEnv

    return PointReachEnv(num_envs, act_steps=act_steps, device=device, seed=seed)


class DiffusionActor:
    """A denoiser skeleton with its spec: ``apply`` for the sampler and chunk sampling helpers."""

    def __init__(self, spec: ActorSpec, obs_dim: int, act_dim: int, device: torch.device) -> None:
        self.spec, self.obs_dim, self.act_dim, self.device = spec, obs_dim, act_dim, device
        self.net = make_denoiser(spec, obs_dim, act_dim).to(device)

    def init_params(self, seed: int) -> TensorDict:
        from rlfunc.nets.mlp import seeded_init

        return func.params_from_module(seeded_init(lambda: make_denoiser(self.spec, self.obs_dim, self.act_dim), seed).to(self.device))

    def apply(self, params: TensorDict, x: Tensor, t: Tensor, cond: Tensor) -> Tensor:
        return func.apply(self.net, params, x, t, cond)

    def noise(self, batch: int, generator: torch.Generator, num_steps: int | None = None) -> Tensor:
        """Standard-normal noise for one chain: [K+1, batch, H, A]."""
        k = self.spec.ddim_steps if num_steps is None else num_steps
        shape = (k + 1, batch, self.spec.horizon, self.act_dim)
        return torch.randn(shape, generator=generator, device=self.device)

    def cond(self, obs_stats: TensorDict, observation: Tensor) -> Tensor:
        """Observation -> the denoiser's condition (normalised, clipped to +-10 std), float32."""
        return normalize(obs_stats, observation.to(torch.float32), clip=10.0)

    def env_action(self, x: Tensor) -> Tensor:
        """A sampled chunk [N, H, A] -> what the env takes: [N, act_steps, A], or [N, A] if act_steps == 1."""
        return x[:, 0] if self.spec.act_steps == 1 else x[:, : self.spec.act_steps]

    def act(self, params: TensorDict, schedule: TensorDict, cond: Tensor, noise: Tensor, **kwargs) -> Tensor:
        """Deterministic-by-noise chunk sample (see :func:`rlfunc.diffusion.ddim.sample`)."""
        return sample(
            self.apply, params, cond, noise, schedule, self.spec.ddim_steps,
            prediction=self.spec.prediction, **kwargs,
        )


@torch.no_grad()
def evaluate_chunks(
    actor: DiffusionActor,
    params: TensorDict,
    obs_stats: TensorDict,
    schedule: TensorDict,
    env,
    generator: torch.Generator,
    *,
    eta: float = 0.0,
    max_chunks: int | None = None,
) -> dict[str, float]:
    """One episode per env of ``env`` (a torch-batched EnvBase taking [N, act_steps, A] chunks) with
    the actor sampling by DDIM (``eta = 0``: deterministic given the initial noise).

    Returns:
        mean return of the first episode of each env, and for PointReach-v0 its mode statistics
        (success_rate, share_goal_a, share_goal_b, share_neither).
    """
    from envs.point_reach import MAX_STEPS, mode_statistics

    spec = actor.spec
    chunks = max_chunks or -(-MAX_STEPS // spec.act_steps)

    def policy(td: TensorDict) -> TensorDict:
        cond = actor.cond(obs_stats, td["observation"])
        x = actor.act(params, schedule, cond, actor.noise(cond.shape[0], generator), eta=eta)
        td["action"] = actor.env_action(x)
        return td

    td = env.rollout(chunks, policy, break_when_any_done=False)
    done = td["next", "done"].squeeze(-1)  # [N, T]
    first = done & (done.long().cumsum(-1) == 1)
    ret = (td["next", "reward"].squeeze(-1) * (done.long().cumsum(-1) - done.long() == 0)).sum(-1)
    out = {"episode_return": float(ret.mean())}
    out.update(mode_statistics(td["next", "goal_index"].squeeze(-1)[first], first[first]))
    return out

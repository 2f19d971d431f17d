"""The diffusion actor shared by bc, dppo and td3-diffusion: the observation encoder, the denoiser
skeleton, chunked sampling, the envs it runs on and evaluation.

A diffusion actor maps an observation to an action chunk [horizon, act_dim] in [-1, 1] by running
K DDIM steps (Song et al. 2021) of a denoiser eps_theta(x_k, k, s) from Gaussian noise; the first
``act_steps`` actions of the chunk are executed open loop (Chi et al. 2023). The condition s is the
normalised observation vector (a Box observation), or for a Dict observation (cameras, proprio,
instruction) the CLS feature of a :class:`rlfunc.nets.encoders.MultimodalEncoder`.

Envs: an env with a torch-batched builder in the env registry (:mod:`rlfunc.envs.registry`) runs on
the device; any other gymnasium id with a bounded Box action space runs through
:class:`rlfunc.envs.chunk.GymChunkEnv`, which scales [-1, 1] to its bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal, NamedTuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn

from rlfunc.config import check_fields
from rlfunc.core import func
from rlfunc.core.normalize import init_running_stats, normalize
from rlfunc.core.stats import success_interval, summarize_returns
from rlfunc.diffusion.ddim import sample
from rlfunc.diffusion.schedule import make_schedule
from rlfunc.envs import registry
from rlfunc.errors import ConfigError, EnvError


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
    encoder_d_model: int = 128  # Dict observations only: width of the multimodal encoder's tokens and feature
    encoder_widths: tuple[int, ...] = (32, 64, 128, 256)  # Dict observations: ResNet stage channels (ResNet-18: 64 128 256 512)
    encoder_blocks: tuple[int, ...] = (1, 1, 1, 1)  # Dict observations: BasicBlocks per stage (ResNet-18: 2 2 2 2)
    freeze_vision: bool = False  # Dict observations: no gradient to the ResNet trunk
    checkpoint_vision: bool = False  # Dict observations: recompute the trunk's activations in backward

    def __post_init__(self) -> None:
        check_fields(self)
        require_finite(self)
        for name in ("hidden", "down_dims", "encoder_widths", "encoder_blocks"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.denoiser not in ("mlp", "unet"):
            raise ConfigError(f"denoiser={self.denoiser!r}: expected 'mlp' or 'unet'")
        if self.horizon < 1:  # else named as act_steps=1 <= horizon=0
            raise ConfigError(f"horizon={self.horizon}: expected a positive integer")
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
        if self.encoder_d_model < 4 or self.encoder_d_model % 4 or any(w < 1 for w in (*self.encoder_widths, *self.encoder_blocks)):
            raise ConfigError(f"encoder_d_model={self.encoder_d_model}: expected a positive multiple of 4, and positive encoder widths/blocks")
        if len(self.encoder_widths) != len(self.encoder_blocks):
            raise ConfigError(f"encoder_widths={self.encoder_widths}, encoder_blocks={self.encoder_blocks}: expected the same length")
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


class EnvInfo(NamedTuple):
    """What the actor needs to know of an env: ``obs_dim`` (D of a Box observation, 0 for a Dict),
    ``act_dim``, ``stats_key`` (the observation key normalised with running statistics: "observation"
    or "proprio", None when a Dict has no proprio), ``stats_dim``, ``obs_keys`` (keys the condition
    reads), and for a Dict observation the fields an :class:`EncoderConfig` takes from the env
    (``cameras``, ``image_size``, ``proprio_dim``, ``instructions``, ``text``)."""

    obs_dim: int
    act_dim: int
    stats_key: str | None
    stats_dim: int
    obs_keys: tuple[str, ...]
    cameras: tuple[str, ...] = ()
    image_size: tuple[int, int] = (0, 0)
    proprio_dim: int = 0
    instructions: tuple[str, ...] = ()
    text: str = "none"

    @property
    def is_dict(self) -> bool:
        return self.obs_dim == 0

    def to_meta(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._asdict().items()}

    @classmethod
    def from_meta(cls, raw: dict) -> "EnvInfo":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


# what a diffusion snapshot written before "env_info" was saved describes (those runs were all PointReach-v0's)
POINT_REACH_INFO = EnvInfo(obs_dim=6, act_dim=2, stats_key="observation", stats_dim=6, obs_keys=("observation",))


def check_env(env_id: str) -> None:
    """EnvError unless ``env_id`` has a torch-batched builder in the env registry or is a registered gymnasium id."""
    if registry.torch_builder(env_id) is None:
        from rlfunc.envs.chunk import check_chunk_env_id

        check_chunk_env_id(env_id)


def env_info(env_id: str) -> EnvInfo:
    """:class:`EnvInfo` of ``env_id`` (one gymnasium env is made and closed to read its spaces).

    Raises:
        EnvError: an unknown id, an unbounded or non-Box action space, an observation the actor cannot read.
    """
    check_env(env_id)
    build = registry.torch_builder(env_id)
    if build is not None:  # a torch-batched env: its Box "observation" and action specs
        env = build(1, device="cpu", seed=0)
        try:
            obs_shape, act_shape = env.observation_spec["observation"].shape, env.action_spec.shape
        finally:
            env.close()
        if len(obs_shape) != 2 or len(act_shape) != 2:
            raise EnvError(f"env={env_id!r}: observation {tuple(obs_shape)}, action {tuple(act_shape)}: "
                           "expected [1, D] and [1, A] from a torch-batched env of one")
        return EnvInfo(obs_shape[-1], act_shape[-1], "observation", obs_shape[-1], ("observation",))
    from rlfunc.envs.chunk import ObservationCodec, action_bounds, env_instructions
    from rlfunc.envs.collect import make_env

    env = make_env(env_id)
    try:
        low, _ = action_bounds(env.action_space, env_id)
        codec = ObservationCodec(env.observation_space, env_id, env_instructions(env_id))
    finally:
        env.close()
    if not codec.is_dict:
        (dim,) = codec.boxes["observation"].shape if len(codec.boxes["observation"].shape) == 1 else (None,)
        if dim is None:
            raise EnvError(f"env={env_id!r}: a Box observation must be 1-D for the diffusion actor (Dict for images)")
        return EnvInfo(dim, low.shape[0], "observation", dim, ("observation",))
    cameras = tuple(k for k, b in codec.boxes.items() if b.dtype == np.uint8 and len(b.shape) == 3 and b.shape[-1] == 3)
    proprio = codec.boxes.get("proprio")
    sizes = {tuple(codec.boxes[k].shape[:2]) for k in cameras}
    if len(sizes) > 1:
        raise EnvError(f"env={env_id!r}: cameras {cameras} differ in size {sorted(sizes)}: expected one size")
    unused = [k for k, b in codec.boxes.items() if k not in cameras and k != "proprio"]
    if unused:
        raise EnvError(f"env={env_id!r}: observation entries {unused}: expected RGB uint8 cameras, 'proprio' or text")
    text = "learned" if "instruction" in codec.texts else "none"
    return EnvInfo(
        0, low.shape[0], "proprio" if proprio is not None else None, proprio.shape[0] if proprio is not None else 1,
        tuple(codec.keys), cameras, next(iter(sizes)) if sizes else (0, 0),
        proprio.shape[0] if proprio is not None else 0, env_instructions(env_id) if text != "none" else (), text,
    )


def encoder_config(spec: ActorSpec, info: EnvInfo):
    """The :class:`EncoderConfig` of a Dict-observation actor (None for a Box observation)."""
    if not info.is_dict:
        return None
    from rlfunc.nets.encoders import EncoderConfig

    return EncoderConfig(
        d_model=spec.encoder_d_model, num_heads=4, cameras=info.cameras, image_size=info.image_size,
        widths=spec.encoder_widths, blocks=spec.encoder_blocks, group_size=min(16, *spec.encoder_widths),
        freeze_vision=spec.freeze_vision, checkpoint_vision=spec.checkpoint_vision, proprio_dim=info.proprio_dim,
        proprio_hidden=spec.encoder_d_model, text=info.text, instructions=info.instructions,
    )


def with_encoder(state: TensorDict, actor: "DiffusionActor", encoder_params: TensorDict | None, seed: int) -> TensorDict:
    """``state`` plus "encoder" (a copy of ``encoder_params``, else a fresh init from ``seed``) when
    the actor reads a Dict observation; ``state`` unchanged otherwise."""
    if actor.encoder is not None:
        params = encoder_params if encoder_params is not None else actor.init_encoder_params(seed)
        state["encoder"] = func.as_leaves(params.detach().clone())
    return state


def check_split(env_id: str, world_size: int, num_envs: int | None = None, workers: int = 0, *,
                gymnasium_split: bool = False) -> None:
    """ConfigError unless ``env_id``'s ``num_envs`` envs split over ``world_size`` ranks of a
    data-parallel run, each rank's ``num_envs / world_size`` stepped in ``workers`` env worker
    processes (0: none): a torch-batched env splits (its builder's ``split=``), in no workers; a
    gymnasium id splits as :class:`rlfunc.envs.chunk.GymChunkEnv`'s ``split=`` where the caller's run
    builds it so (``gymnasium_split``: dppo; the runs that do not, refused), with workers that divide
    each rank's envs. ``num_envs`` None: the workers are not checked."""
    if world_size <= 1:
        return
    if registry.torch_builder(env_id) is not None:
        return
    if not gymnasium_split:
        raise ConfigError(f"env={env_id!r} with {world_size} ranks: a data-parallel run splits a torch-batched env "
                          "(one with a torch_env in rlfunc.envs.registry, e.g. PointReach-v0); train it in one process")
    if workers and num_envs is not None and (num_envs // world_size) % workers:
        raise ConfigError(f"run.env_workers={workers}: each of the {world_size} ranks steps num_envs / nproc = "
                          f"{num_envs}/{world_size} envs, which it does not divide (each worker steps an equal share)")


def dones_of_split(dist) -> Callable[[Tensor], Tensor]:
    """``fn(done [N] bool) -> [W*N] bool``: every rank's done flags in rank order (one all_gather of
    ``dist``, a :class:`rlfunc.run.distributed.Distributed`): a split GymChunkEnv's ``dones_of_split``."""
    def gather(done: Tensor) -> Tensor:
        flags = TensorDict({"done": done.reshape(-1)}, batch_size=[done.numel()])
        return dist.all_gather_batch(flags, dim=0)["done"]
    return gather


def make_env(env_id: str, num_envs: int, act_steps: int, device: torch.device, seed: int,
             split: tuple[int, int] | None = None, any_done_of_split: Callable[[bool], bool] | None = None, workers: int = 0,
             dones_of_split: Callable[[Tensor], Tensor] | None = None):
    """The TorchRL env for ``env_id`` taking [N, act_steps, A] action chunks in [-1, 1]: the env
    registry's torch-batched env on ``device`` where it has one, else the gymnasium id as a
    :class:`rlfunc.envs.chunk.GymChunkEnv` (``workers`` >= 1: stepped in that many worker processes). ``split`` (rank, world_size) of a data-parallel run:
    these N envs are envs rank*N .. (rank+1)*N - 1 of the single process's world_size*N: a
    torch-batched env's ``split=`` (:class:`rlfunc.envs.registry.EnvEntry`), with
    ``any_done_of_split`` (the ranks' "is an env of any rank done" after each step) so that their
    generators draw as the single process's; a GymChunkEnv's ``split=``, with ``dones_of_split``
    (every rank's done flags after each step, :func:`dones_of_split`) so that its reset seeds are
    the single process's.

    Raises:
        EnvError: an unknown id, or an env whose actions or observations the actor cannot handle; a
            gymnasium id's ``split`` over more than one rank without ``dones_of_split``.
        ConfigError: a ``split`` over more than one rank of an env that does not split (:func:`check_split`);
            ``workers`` >= 1 for a torch-batched env (it steps on the device).
    """
    check_env(env_id)
    build = registry.torch_builder(env_id)
    if build is not None and workers:
        raise ConfigError(f"run.env_workers={workers}: env={env_id!r} is torch-batched and steps on the device, "
                          "not in worker processes (use 0)")
    split = split if split is not None and split[1] > 1 else None
    if split is not None:
        check_split(env_id, split[1], num_envs * split[1], workers, gymnasium_split=True)
    if build is not None:
        kw = {} if split is None else {"split": split, "any_done_of_split": any_done_of_split}
        return build(num_envs, act_steps=act_steps, device=device, seed=seed, **kw)
    from rlfunc.envs.chunk import GymChunkEnv

    return GymChunkEnv(env_id, num_envs, act_steps=act_steps, device=device, seed=seed, workers=workers, split=split,
                       dones_of_split=dones_of_split if split is not None else None)


class DiffusionActor:
    """A denoiser skeleton (and, for Dict observations, an encoder skeleton) with its spec: ``apply``
    for the sampler, ``condition`` for the observation -> condition map, chunk sampling helpers.

    Args:
        spec: architecture and diffusion settings.
        info: the env's :class:`EnvInfo` (or, for backward compatibility, the int ``obs_dim``).
        act_dim: A.
        device: where the skeletons live.
    """

    def __init__(self, spec: ActorSpec, info: "EnvInfo | int", act_dim: int, device: torch.device) -> None:
        if isinstance(info, int):
            info = EnvInfo(info, act_dim, "observation", info, ("observation",))
        self.spec, self.info, self.act_dim, self.device = spec, info, act_dim, device
        self.encoder_config = encoder_config(spec, info)
        self.encoder = None
        if self.encoder_config is not None:
            from rlfunc.nets.encoders import MultimodalEncoder

            self.encoder = MultimodalEncoder(self.encoder_config).to(device)
        self.obs_dim = self.encoder_config.d_model if self.encoder is not None else info.obs_dim  # condition width
        self.net = make_denoiser(spec, self.obs_dim, act_dim).to(device)

    def init_params(self, seed: int) -> TensorDict:
        from rlfunc.nets.mlp import seeded_init

        return func.params_from_module(seeded_init(lambda: make_denoiser(self.spec, self.obs_dim, self.act_dim), seed).to(self.device))

    def init_encoder_params(self, seed: int) -> TensorDict | None:
        """The encoder's parameters (None for a Box observation)."""
        if self.encoder is None:
            return None
        from rlfunc.nets.encoders import MultimodalEncoder
        from rlfunc.nets.mlp import seeded_init

        return func.params_from_module(seeded_init(lambda: MultimodalEncoder(self.encoder_config), seed).to(self.device))

    def trainable_encoder(self, encoder_params: TensorDict) -> TensorDict:
        """The encoder leaves an optimizer updates (the frozen trunk excluded)."""
        return encoder_params.exclude(*self.encoder.frozen_keys) if self.encoder.frozen_keys else encoder_params

    def init_stats(self) -> TensorDict:
        """Empty running statistics of ``info.stats_key``, float32 [stats_dim]."""
        return init_running_stats((self.info.stats_dim,), device=self.device)

    def condition(self, encoder_params: TensorDict | None, obs_stats: TensorDict, td: TensorDictBase) -> Tensor:
        """Observation keys of ``td`` [*B] -> the denoiser's (and critic's) condition [*B, C] float32:
        the normalised observation (clipped to +-10 std), or the encoder's CLS feature."""
        if self.encoder is None:
            return self.cond(obs_stats, td["observation"])
        obs = {k: td[k] for k in self.info.obs_keys}
        stats = obs_stats if self.info.stats_key == "proprio" else None
        return func.apply(self.encoder, encoder_params, obs, stats).float()

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


UNLIMITED_EPISODE_STEPS = 30  # env steps evaluated of an env that declares no time limit


def episode_chunks(env, act_steps: int) -> int:
    """Chunk steps that cover one whole episode of ``env`` (its ``max_episode_steps`` time limit, else
    :data:`UNLIMITED_EPISODE_STEPS`, over ``act_steps``, rounded up)."""
    limit = getattr(env, "max_episode_steps", None) or UNLIMITED_EPISODE_STEPS
    return -(-limit // act_steps)


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
    success: bool = True,
    max_chunks: int | None = None,
    encoder_params: TensorDict | None = None,
    episode_metrics: Callable[[TensorDictBase], TensorDictBase] | None = None,
    frozen: tuple[TensorDict, int] | None = None,
) -> dict[str, float]:
    """One episode per env of ``env`` (a TorchRL env taking [N, act_steps, A] chunks, from
    :func:`make_env`) with the actor sampling by DDIM (``eta = 0``: deterministic given the initial noise).

    Args:
        episode_metrics: the env's own statistics of ended episodes (its registry entry's
            :attr:`EnvEntry.episode_metrics`), or None.
        frozen: (the frozen pretrained weights, K') of an actor that fine-tuned only its last K'
            denoising steps (dppo's ``finetune_steps``): the first K - K' steps run those weights, as in
            its rollouts (:func:`rlfunc.diffusion.ddim.sample`'s ``frozen_params``); None: all K ``params``.

    Returns:
        "episode_return" (mean over envs of their first episode's return), "returns" ([n] float,
        the return of each first episode that ended); with ``episode_metrics``, its statistics of
        the first episodes (as floats), else "num_episodes" and, with ``success`` (an env that reports
        one: :func:`reports_success`), "success_rate" (share of first episodes that ended in success:
        ("next", "success") at their end).
    """
    chunks = max_chunks or episode_chunks(env, actor.spec.act_steps)

    def policy(td: TensorDict) -> TensorDict:
        cond = actor.condition(encoder_params, obs_stats, td)
        steps = {} if frozen is None else {"frozen_params": frozen[0], "finetune_steps": frozen[1]}
        x = actor.act(params, schedule, cond, actor.noise(cond.shape[0], generator), eta=eta, **steps)
        td["action"] = actor.env_action(x)
        return td

    td = env.rollout(chunks, policy, break_when_any_done=False)
    done = td["next", "done"].squeeze(-1)  # [N, T]
    first = done & (done.long().cumsum(-1) == 1)
    ret = (td["next", "reward"].squeeze(-1) * (done.long().cumsum(-1) - done.long() == 0)).sum(-1)
    ended = first.any(-1)
    out = {"episode_return": float(ret.mean()), "returns": ret[ended]}
    if episode_metrics is not None:  # the first episodes: their ends are the only dones
        firsts = TensorDict({"next": td["next"].exclude("done").set("done", first.unsqueeze(-1))}, batch_size=td.batch_size)
        out.update({k: float(v) for k, v in episode_metrics(firsts).items()})
    else:
        out["num_episodes"] = float(ended.sum())
        if success:
            out["success_rate"] = float(td["next", "success"].squeeze(-1)[first].float().mean()) if bool(ended.any()) else float("nan")
    return out


def reports_success(env_id: str) -> bool:
    """Whether ``env_id``'s episodes carry a success flag: a torch-batched env's always do ("success"
    in its step output), a gymnasium env's when its info has "is_success"
    (:func:`rlfunc.envs.collect.reports_success`; Pendulum-v1's does not, so no success rate is
    reported for it)."""
    if registry.torch_builder(env_id) is not None:
        return True
    from rlfunc.envs.collect import reports_success as gym_reports_success

    return gym_reports_success(env_id)


def evaluate_episodes(
    actor: DiffusionActor,
    params: TensorDict,
    obs_stats: TensorDict,
    schedule: TensorDict,
    env_id: str,
    episodes: int,
    *,
    seed: int,
    eta: float = 0.0,
    encoder_params: TensorDict | None = None,
    max_envs: int | None = None,
    frozen: tuple[TensorDict, int] | None = None,
) -> dict[str, float]:
    """:func:`evaluate_chunks` over ``episodes`` episodes of ``env_id``, run in rounds of at most
    ``max_envs`` parallel envs (default: all at once for a torch-batched env, 50 for gymnasium envs,
    which step on the host and may hold a renderer each); round r seeds its env and noise with
    ``seed + r``. Returns the episode-weighted means of :func:`evaluate_chunks`' numbers, with the
    evaluation protocol's spread, as floats: "episode_return_std", "episode_return_ci95_low" /
    "_high" (Student-t 95% interval of the mean return, :func:`rlfunc.core.stats.summarize_returns`) and,
    for an env that reports success (:func:`reports_success`), "success_ci95_low" / "_high" (Wilson
    interval of the success rate). ``frozen``: as :func:`evaluate_chunks`'."""
    entry = registry.find(env_id)
    metrics = None if entry is None else entry.episode_metrics
    success = metrics is None and reports_success(env_id)
    if max_envs is None:
        max_envs = episodes if registry.torch_builder(env_id) is not None else 50
    totals: dict[str, float] = {}
    done, returns = 0, []
    for r in range(-(-episodes // max_envs)):
        n = min(max_envs, episodes - done)
        env = make_env(env_id, n, actor.spec.act_steps, actor.device, seed + r)
        try:
            gen = torch.Generator(device=actor.device).manual_seed(seed + r)
            out = evaluate_chunks(actor, params, obs_stats, schedule, env, gen, eta=eta, encoder_params=encoder_params, success=success,
                                  episode_metrics=metrics, frozen=frozen)
        finally:
            env.close()
        returns.append(out.pop("returns"))
        for k, v in out.items():
            if k != "num_episodes":
                totals[k] = totals.get(k, 0.0) + v * n
        done += n
    summary = {k: v / episodes for k, v in totals.items()}
    summary["num_episodes"] = float(episodes)
    returns = torch.cat(returns)
    if returns.numel():
        stats = summarize_returns(returns, nonfinite="count")  # a NaN-return episode left out, counted
        if stats.get("nonfinite_episodes"):
            summary["nonfinite_episodes"] = float(stats["nonfinite_episodes"])
            summary["episode_return"] = float("nan") if stats["mean"] is None else stats["mean"]
        if stats["std"] is not None:
            summary["episode_return_std"] = stats["std"]
        if stats["ci95"] is not None:  # none for one episode
            summary["episode_return_ci95_low"], summary["episode_return_ci95_high"] = stats["ci95"]
    if math.isfinite(summary.get("success_rate", float("nan"))):  # a weighted mean of counts / n: a count again
        low, high = success_interval(round(summary["success_rate"] * episodes), episodes)
        summary["success_ci95_low"], summary["success_ci95_high"] = low, high
    return summary

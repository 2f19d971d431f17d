"""GRPO and GSPO for continuous control: critic-free PPO-style updates on groups of episodes.

Every iteration draws ``num_groups`` start states and runs ``group_size`` episodes from each
(:mod:`rlfunc.envs.grouped`); an episode's undiscounted return is its sequence reward, turned into a
group-relative advantage (:func:`rlfunc.core.returns.group_relative_advantage`) shared by all its steps.
The Gaussian actor, its rollout policy, the observation normaliser and the parameter layout are
PPO's (:mod:`rlfunc.algos.ppo`) without the critic. An optional KL term pulls the policy toward a
frozen reference: the initial actor ("ref_params").

Every learner tensor carries a leading seed dim S, as in PPO; Adam is elementwise, so seeds train
independently (their grouped rollouts are drawn from one env of S * num_groups * group_size envs).
The optimizer's state is part of the learner state, as in PPO: the update is ``chain(clip_by_global_norm,
adam)`` of :mod:`rlfunc.optim`, its state ``state["optim"]``. ``--compile on`` (``auto``: runs of >=
:data:`AUTO_COMPILE_UPDATES` gradient steps) runs a minibatch's step (the vmapped loss, torch.func.grad,
the per-seed norms and finiteness mask, the chain, the in-place update) as one torch.compile graph,
equal to the eager step within 1e-5 (tests/optim/test_compiled_step.py); a step transform or
adaptive_clip runs eager.

Reference: Shao et al. (2024), "DeepSeekMath", sec. 4.1 (GRPO); Zheng et al. (2025), "Group
Sequence Policy Optimization" (GSPO); see :mod:`rlfunc.losses.grpo` and :mod:`rlfunc.losses.gspo`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NamedTuple

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.algos import data_parallel, shaped
from rlfunc.algos.ppo_parallel import local_share
from rlfunc.algos.ppo import EnvSpec, PPOConfig, make_ppo
from rlfunc.algos.registry import AlgorithmEntry, register
from rlfunc.config import RunConfig, check_dependents, check_env_workers, check_fields, replace, require_default
from rlfunc.core import func
from rlfunc.core.distributions import gaussian_log_prob
from rlfunc.core.normalize import normalize, update_running_stats
from rlfunc.core.returns import group_relative_advantage
from rlfunc.device import compile_step
from rlfunc.envs import registry
from rlfunc.envs.grouped import sequence_return
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.losses.grpo import grpo_loss
from rlfunc.losses.gspo import gspo_loss
from rlfunc.nets.actor_critic import GaussianActorCritic
from rlfunc.optim import adam, all_reduce_mean, clip_by_global_norm, flatten, linear_lr, member_grad_norms, unflatten
from rlfunc.optim.leaves import chain_state, chain_step

BATCH_KEYS = ("observation", "action", "sample_log_prob", ("next", "reward"), "mask")  # what iteration reads of a batch

# --compile auto compiles a run of at least this many gradient steps (bench/compiled_grpo_mappo.py, 2-core
# CPU, one thread, PointReach-v0's defaults: a cold compile took 21 s and saved 3.2 ms of the 5.2 ms
# step, a break-even of ~6,600 steps; 13,000 under load). The defaults (2,120 steps) and the Pendulum
# presets (640) stay eager.
AUTO_COMPILE_UPDATES = 10_000


@dataclass(frozen=True)
class GRPOConfig:
    """Every GRPO / GSPO hyperparameter, with its default. Steps are env steps per seed."""

    env: str = "PointReach-v0"  # gymnasium env id (Box observations and actions)
    loss: Literal["grpo", "gspo"] = "grpo"  # per-step ratio (GRPO) or one ratio per episode (GSPO)
    backend: Literal["auto", "gym", "torch"] = "auto"  # auto: the torch-batched env where the env registry has one, else gymnasium
    total_steps: int = 200_000  # env steps per seed, counted as num_groups * group_size * max_episode_steps per iteration
    num_groups: int = 16  # start states per iteration
    group_size: int = 8  # episodes from each start state (G)
    max_episode_steps: int = 30  # steps per episode at most (use the env's time limit: PointReach 30, Pendulum 200)
    num_epochs: int = 10  # passes over each batch
    minibatch_size: int = 32  # episodes per gradient step; must divide num_groups * group_size
    lr: float = 3e-4  # Adam learning rate
    anneal_lr: bool = True  # linear decay of lr to 0 over the run
    adam_eps: float = 1e-5  # Adam epsilon
    clip_epsilon: float = 0.2  # grpo: lower clip 1 - eps of the per-step ratio
    clip_epsilon_high: float | None = None  # grpo: upper clip 1 + eps_high (None: clip_epsilon; DAPO's clip-higher)
    gspo_clip_epsilon: float = 0.03  # gspo: lower clip of the sequence ratio; 100x the paper's 3e-4 (LLM tokens), which barely moves a Gaussian control policy (bench/RESULTS.md)
    gspo_clip_epsilon_high: float = 0.04  # gspo: upper clip of the sequence ratio; 100x the paper's 4e-4
    gspo_variant: Literal["sequence", "token"] = "sequence"  # gspo: GSPO or GSPO-token
    aggregation: Literal["token", "sequence", "constant"] = "token"  # grpo: mean over steps / over episodes / constant
    advantage_std: Literal["group", "batch", "none"] = "group"  # divide by the group's std, the batch's, or not (Dr. GRPO)
    advantage_eps: float = 1e-4  # added to the std (return units)
    unbiased_std: bool = True  # Bessel's correction in the std
    kl_coef: float = 0.0  # weight of the k3 KL to the frozen initial policy (0: off)
    max_grad_norm: float = 0.5  # global grad-norm clip, per seed
    oscillation_damping: bool = False  # shaping: damp steps of tensors with oscillating gradient signs / high curvature (rlfunc.optim.shaping)
    damping_strength: float = 0.5  # shaping: step factor 1 - strength for a fully oscillating tensor, in [0, 1]
    hessian_interval: int = 5  # shaping: gradient steps between Hutchinson curvature estimates (double backward)
    adaptive_clip: bool = False  # shaping: clip ranges * clip_epsilon_decay^iteration and per-layer trust radii
    clip_epsilon_decay: float = 0.995  # shaping: decay of the clip ranges per iteration (policy update), in (0, 1]
    trust_radius_scale: float = 1.0  # shaping: multiplies every per-layer radius (1: the strict first-order bound, rlfunc.optim.shaping)
    normalize_observations: bool = True  # running mean/std, clipped to +-obs_clip
    obs_clip: float = 10.0  # in standard deviations
    hidden: tuple[int, ...] = (64, 64)  # MLP widths of the actor
    activation: str = "tanh"  # tanh | relu | elu | silu
    init_log_std: float = 0.0  # initial log standard deviation of the actions
    run: RunConfig = field(default_factory=RunConfig)  # seeds, device, snapshots, final evaluation (deterministic actions) (rlfunc.config.RunConfig)
    # (switch, on, the fields only it reads): rlfunc.config.check_dependents
    dependents: ClassVar[tuple] = (("normalize_observations", lambda c: c.normalize_observations, ("obs_clip",)), *shaped.DEPENDENTS)

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("total_steps", "num_groups", "group_size", "max_episode_steps", "num_epochs",
                     "minibatch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r}: expected a positive integer")
        if self.loss not in ("grpo", "gspo"):
            raise ConfigError(f"loss={self.loss!r}: expected 'grpo' or 'gspo'")
        if self.group_size < 2:  # a group of one has advantage 0: no gradient, silently
            raise ConfigError(f"group_size={self.group_size}: expected >= 2 (the advantage is relative to the group's other episodes)")
        if self.backend not in ("auto", "gym", "torch"):
            raise ConfigError(f"backend={self.backend!r}: expected 'auto', 'gym' or 'torch'")
        if self.backend == "torch" and registry.torch_builder(self.env) is None:
            raise ConfigError(f"backend='torch': env={self.env!r} has no torch-batched env (those that do: {', '.join(registry.ids('torch_env'))})")
        if self.episodes_per_iteration % self.minibatch_size:
            raise ConfigError(
                f"minibatch_size={self.minibatch_size} does not divide num_groups*group_size={self.episodes_per_iteration}"
            )
        for name in ("lr", "clip_epsilon", "gspo_clip_epsilon", "gspo_clip_epsilon_high", "max_grad_norm", "obs_clip", "adam_eps"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name}={value}: expected a finite value > 0")
        for name in ("clip_epsilon", "gspo_clip_epsilon"):
            if not getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a value in (0, 1)")
        if self.clip_epsilon_high is not None and not (self.clip_epsilon_high > 0 and math.isfinite(self.clip_epsilon_high)):
            raise ConfigError(f"clip_epsilon_high={self.clip_epsilon_high}: expected a finite value > 0 or None")
        if not (0 <= self.kl_coef < math.inf) or not (0 <= self.advantage_eps < math.inf):
            raise ConfigError(f"kl_coef={self.kl_coef}, advantage_eps={self.advantage_eps}: expected finite values >= 0")
        if self.gspo_variant not in ("sequence", "token"):
            raise ConfigError(f"gspo_variant={self.gspo_variant!r}: expected 'sequence' or 'token'")
        if self.aggregation not in ("token", "sequence", "constant"):
            raise ConfigError(f"aggregation={self.aggregation!r}: expected 'token', 'sequence' or 'constant'")
        if self.advantage_std not in ("group", "batch", "none"):
            raise ConfigError(f"advantage_std={self.advantage_std!r}: expected 'group', 'batch' or 'none'")
        if self.run.compile == "on" and not self.compilable:
            raise ConfigError(f"run.compile='on': {self.loss} compiles its plain gradient step only; expected no step transform "
                              "(oscillation_damping) and adaptive_clip=False with it (or --compile off)")
        require_default(self.run, precision=f"{self.loss} has no mixed precision", log_every=f"{self.loss} logs every iteration")
        if self.use_torch_env:
            require_default(self.run, env_workers=f"env={self.env!r} is a torch-batched env, stepped on the device; backend='gym' "
                                                  "steps gymnasium envs, which can run in worker processes")
        else:  # each process's S * n * G / W gymnasium envs, split over its workers
            check_env_workers(self.run, self.run.num_seeds * self.episodes_per_iteration // self.run.nproc,
                              f"num_groups={self.num_groups} x group_size={self.group_size} x num_seeds={self.run.num_seeds}"
                              + (f" / nproc={self.run.nproc}" if self.run.nproc > 1 else ""))
        self.check_data_parallel()  # before torchrun starts the ranks
        shaped.check_config(self)
        # actor settings are validated by PPOConfig, whose actor and policy GRPO reuses
        self.actor_config()

    def check_data_parallel(self) -> None:
        """ConfigError, one line, unless ``run.nproc`` = W ranks can split this run: W must divide
        ``num_groups`` (a group's G episodes stay on one rank: its advantage is over the group) and
        ``minibatch_size`` (each rank's share); gradient shaping and ``--compile on`` are
        single-process; on the torch-batched env (whose split is contiguous rows of its S * n * G
        envs) one seed per run. Nothing at W = 1."""
        W = self.run.nproc
        if W == 1:
            return
        data_parallel.check_divides(W, num_groups=self.num_groups, minibatch_size=self.minibatch_size)
        if not self.compilable:
            raise ConfigError(f"oscillation_damping, adaptive_clip with nproc={W}: gradient shaping is not data-parallel yet; "
                              "run it in one process")
        if self.run.compile == "on":
            raise ConfigError(f"run.compile='on' with nproc={W}: {self.loss}'s compiled step is not data-parallel; "
                              "expected --compile off or auto with --nproc")
        if self.use_torch_env and self.run.num_seeds > 1:
            raise ConfigError(f"run.num_seeds={self.run.num_seeds} with nproc={W}: env={self.env!r}'s torch-batched env splits "
                              "its rows, not each seed's groups; expected one seed, or backend='gym'")

    @property
    def episodes_per_iteration(self) -> int:
        return self.num_groups * self.group_size

    @property
    def compilable(self) -> bool:
        """Whether the gradient step can run compiled: no step transform, no adaptive clip."""
        return not self.oscillation_damping and not self.adaptive_clip

    @property
    def num_updates(self) -> int:
        """Gradient steps of the whole run (none stop early: grpo has no target_kl)."""
        return self.num_iterations * self.num_epochs * (self.episodes_per_iteration // self.minibatch_size)

    @property
    def steps_per_iteration(self) -> int:
        return self.episodes_per_iteration * self.max_episode_steps

    @property
    def num_iterations(self) -> int:
        return max(1, math.ceil(self.total_steps / self.steps_per_iteration))

    @property
    def seeds(self) -> list[int]:
        return self.run.seeds

    @property
    def use_torch_env(self) -> bool:
        return self.backend == "torch" or (self.backend == "auto" and registry.torch_builder(self.env) is not None)

    def actor_config(self) -> PPOConfig:
        """The PPOConfig whose actor, initialisation and rollout policy GRPO shares (nproc 1: GRPO splits
        its groups over the ranks itself, :meth:`check_data_parallel`; PPO's policy takes the ranks from ``dist``)."""
        return PPOConfig(
            env=self.env, num_envs=1, num_steps=1, minibatch_size=1, hidden=self.hidden, activation=self.activation,
            init_log_std=self.init_log_std, normalize_observations=self.normalize_observations, obs_clip=self.obs_clip,
            # env_workers=0: GRPO steps its own envs (its workers split num_seeds x num_groups x group_size of them);
            # the shared actor's one env refused --env-workers K unless K divided num_seeds
            run=dataclasses.replace(self.run, nproc=1, env_workers=0),
        )


PRESETS: dict[tuple[str, str], dict] = {
    # Pendulum episodes last 200 steps; a start state's difficulty dominates the return, which the
    # group baseline removes.
    ("Pendulum-v1", "grpo"): dict(max_episode_steps=200, num_groups=8, group_size=8, minibatch_size=16, lr=1e-3),
    ("Pendulum-v1", "gspo"): dict(max_episode_steps=200, num_groups=8, group_size=8, minibatch_size=16, lr=1e-3),
}


# the fields only the other loss reads: set on this one, they were accepted and had no effect
OTHER_LOSS_FIELDS = {"grpo": ("gspo_clip_epsilon", "gspo_clip_epsilon_high", "gspo_variant"),
                     "gspo": ("clip_epsilon", "clip_epsilon_high", "aggregation")}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.default is not dataclasses.MISSING}


def check_loss_fields(config: GRPOConfig) -> None:
    """ConfigError for a field only the other loss reads, set away from its default (grpo took
    --gspo-variant and gspo took --aggregation, recorded them in config.json and trained as without
    them). Checked where a run is configured (:func:`preset`, ``rlfunc train``), not on every config:
    runs saved with such a field still evaluate and resume."""
    other = {"grpo": "gspo", "gspo": "grpo"}.get(config.loss)
    for name in OTHER_LOSS_FIELDS.get(config.loss, ()):
        if getattr(config, name) != _DEFAULTS[name]:
            raise ConfigError(f"{name}={getattr(config, name)!r}: a setting of {other}, which loss={config.loss!r} does not read "
                              f"(train {other} for it: `rlfunc train {other}`)")


def preset(env: str, loss: str = "grpo", **overrides) -> GRPOConfig:
    """The preset for (``env``, ``loss``) (defaults for pairs without one) with ``overrides`` applied.

    Raises:
        ConfigError: as :class:`GRPOConfig`, an override only the other loss reads (:func:`check_loss_fields`),
            or one that a switch which is off leaves unread (:attr:`GRPOConfig.dependents`)."""
    base = replace(GRPOConfig(), **{**PRESETS.get((env, loss), {}), "env": env, "loss": loss})
    config = replace(base, **overrides)
    check_loss_fields(config)
    check_dependents(config, base)
    return config


class GRPO(NamedTuple):
    """The algorithm: ``init() -> state``, ``iteration(state, batch, generators) -> (state, metrics)``,
    and the rollout policy ``policy(state, generators, deterministic)`` (PPO's Gaussian actor)."""

    init: Callable[[], TensorDict]
    iteration: Callable[..., tuple[TensorDict, TensorDict]]
    policy: Callable[..., Callable[[Tensor], tuple[Tensor, Tensor]]]
    net: GaussianActorCritic


def make_grpo(config: GRPOConfig, spec: EnvSpec, device: torch.device, dist=None) -> GRPO:
    """Build GRPO's (or GSPO's) pure pieces for ``config`` on envs described by ``spec``.

    ``dist``: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run of W
    ranks. Rank r then collects groups r*n/W .. (r+1)*n/W - 1 of each seed's ``num_groups`` = n (its
    batch is [S, n/W, G, T]; a group's episodes stay on one rank) and ``iteration`` equals the
    single-process one on all n groups, to float rounding (:mod:`rlfunc.algos.data_parallel`): the
    policy draws the action noise of all the envs and keeps its rows (PPO's policy); ``iteration``
    all-gathers the batch (rank order: the single process's group order), so the group-relative
    advantages, the observation statistics and the episode metrics are those of the whole batch;
    every rank draws the same minibatch order and takes its share of every minibatch; a loss or
    metric that is a mean over valid steps ("token") is weighted by the share's part of the
    minibatch's valid steps (:func:`rlfunc.algos.data_parallel.count_weight`), and one
    ``all_reduce_mean`` of the gradients, the loss and the metrics precedes the norms, the finiteness
    mask and the chain. W must divide ``num_groups`` and ``minibatch_size``; gradient shaping and the
    compiled step are single-process (``--compile auto`` runs eager with W > 1).

    The learner state is one TensorDict on ``device`` (leading seed dim S on every member tensor):
    "params" (actor, log_std), "ref_params" (a frozen copy of the initial params: the KL reference),
    "obs_stats", "rng" (uint8 generator states [S, L]), "iteration" and "env_steps" (0-dim int64), and
    "optim", the state of the update chain ``chain(clip_by_global_norm(max_grad_norm), adam(lr,
    eps=adam_eps))``: "0" {"norm": [S], the last pre-clip gradient norms}, "1" {"step", "exp_avg",
    "exp_avg_sq"}, Adam's per-leaf step counts (float32: [S], one per seed, with S > 1; 0-dim with one)
    and moments (like "params"); with a step transform on, Adam's state is "1" "inner", beside the
    transforms' (:mod:`rlfunc.algos.shaped`).

    ``iteration`` takes a grouped batch [S, num_groups, group_size, T] with "observation" (raw),
    "action", "sample_log_prob", ("next", "reward") and "mask" (:mod:`rlfunc.envs.grouped`), gathered
    with ``policy(state, generators)``.
    """
    S = config.run.num_seeds
    W, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)
    data_parallel.check_divides(W, num_groups=config.num_groups, minibatch_size=config.minibatch_size)
    if W > 1 and not config.compilable:
        raise ConfigError(f"oscillation_damping, adaptive_clip with {W} ranks: gradient shaping is not data-parallel yet; run it in one process")
    if W > 1 and config.run.compile == "on":
        raise ConfigError(f"run.compile='on' with {W} ranks: {config.loss}'s compiled step runs in one process; expected --compile off or auto")
    # data parallel: PPO's policy draws the noise of the W ranks' envs and keeps this rank's rows
    actor_config = config.actor_config() if W == 1 else replace(config.actor_config(), num_envs=W, minibatch_size=W, compile="off")
    ppo = make_ppo(actor_config, spec, device, dist)
    net = ppo.net
    use_loop = {"auto": None, "vmap": False, "loop": True}[config.run.vmap]
    vmap = lambda fn, **kw: func.vmap(fn, use_loop=use_loop, device=device, **kw)  # noqa: E731
    transform = shaped.make_transform(config)  # None unless a step transform is on (rlfunc.algos.shaped)
    clip = clip_by_global_norm(config.max_grad_norm, stacked=True)
    # chain(clip, adam), Adam wrapped when shaping; a step count per seed (a seed whose step is skipped keeps its own run's)
    optimizer = shaped.optimizer(config, clip, adam(config.lr, eps=config.adam_eps, member_dims=int(config.run.num_seeds > 1)))
    reduce = all_reduce_mean(None if dist is None else dist.group)  # data parallel: ahead of the chain (stateless)
    # data parallel: the loss's and the metrics' means over valid steps, weighted by the share's part of the minibatch's
    token_means = {"kl_ref", "approx_kl", *(("clip_fraction", "ratio_mean") if config.loss == "grpo" else ())}
    token_loss = config.loss == "grpo" and config.aggregation == "token"
    if token_loss:
        token_means |= {"loss_objective", "loss_kl"}

    def init() -> TensorDict:
        base = ppo.init()  # PPO's seeded actor init, normaliser and generators; the critic is dropped
        params = func.as_leaves(base["params"].exclude("critic"))
        with torch.no_grad():
            ref = params.clone().apply(lambda t: t.detach().requires_grad_(False))
        return TensorDict(
            {
                "params": params,
                "ref_params": ref,
                "optim": optimizer.init(params),
                "obs_stats": base["obs_stats"],
                "rng": base["rng"],
                "iteration": base["iteration"],
                "env_steps": base["env_steps"],
            },
            batch_size=[],
            device=device,
        )

    def norm_obs(stats: TensorDict, obs: Tensor) -> Tensor:
        if not config.normalize_observations:
            return obs
        return normalize(stats, obs, clip=config.obs_clip)

    def member_log_prob(params: TensorDict, obs: Tensor, action: Tensor) -> Tensor:
        loc = func.apply(net.actor, params["actor"], obs)
        return gaussian_log_prob(action, loc, params["log_std"])

    def step_log_prob(params: TensorDict, observation: Tensor, action: Tensor) -> Tensor:
        return member_log_prob(params, observation[None], action[None]).sum()  # one step: 0-dim

    def member_loss_with(low: float, high: float | None) -> Callable[[TensorDict, TensorDict], tuple[Tensor, TensorDict]]:
        """The per-seed loss with clip range (1 - low, 1 + high) of the configured loss."""

        def member_loss(params: TensorDict, mb: TensorDict) -> tuple[Tensor, TensorDict]:
            log_prob = member_log_prob(params, mb["observation"], mb["action"])
            ref = mb["ref_log_prob"] if config.kl_coef > 0 else None
            if config.loss == "grpo":
                return grpo_loss(
                    log_prob, mb["sample_log_prob"], mb["advantage"], mb["mask"],
                    clip_epsilon=low, clip_epsilon_high=high,
                    ref_log_prob=ref, kl_coef=config.kl_coef, aggregation=config.aggregation,
                )
            return gspo_loss(
                log_prob, mb["sample_log_prob"], mb["advantage"], mb["mask"],
                clip_epsilon=low, clip_epsilon_high=high,
                ref_log_prob=ref, kl_coef=config.kl_coef, variant=config.gspo_variant,
            )

        return member_loss

    def begin_shaping(state: TensorDict, seq: TensorDict, epsilon: float) -> TensorDict:
        """The chain's state for this update; with adaptive_clip the trust radii come from per-step
        log-likelihood gradients over the valid steps (every k-th step, at most ~4096 per seed)."""
        if not config.adaptive_clip:
            return state["optim"]
        obs, act, mask = (seq[k].flatten(1, 2) for k in ("observation", "action", "mask"))  # [S, n*G*T, ...]
        stride = max(1, obs.shape[1] // 4096)
        obs, act, mask = obs[:, ::stride], act[:, ::stride], mask[:, ::stride].squeeze(-1).to(obs.dtype)
        grads = shaped.stacked_per_sample_grads(step_log_prob, state["params"], obs, act, device=device, use_loop=use_loop)
        scale = (mask * mask.shape[1] / mask.sum(1, keepdim=True).clamp_min(1)).sqrt()  # mean over valid steps only
        grads = grads.apply(lambda g: g * scale.reshape(*scale.shape, *([1] * (g.dim() - 2))))
        return shaped.begin_update(config, state["optim"], state["params"], grads, epsilon)

    def advantages(episode_return: Tensor) -> Tensor:
        """[S, n, G] -> [S, n, G]; the "batch" std is per seed."""
        return torch.stack([
            group_relative_advantage(
                episode_return[s], std=config.advantage_std, eps=config.advantage_eps, unbiased=config.unbiased_std
            )
            for s in range(S)
        ])

    def prepare(state: TensorDict, batch: TensorDict) -> tuple[TensorDict, Tensor, Tensor]:
        """Normalise observations, episode returns and advantages; batch [S, n, G, T] -> sequences [S, n*G, T]."""
        obs = vmap(norm_obs)(state["obs_stats"], batch["observation"])
        mask = batch["mask"]
        episode_return = sequence_return(batch)  # [S, n, G]
        advantage = advantages(episode_return)
        seq = TensorDict(
            {
                "observation": obs, "action": batch["action"], "sample_log_prob": batch["sample_log_prob"],
                "mask": mask, "advantage": advantage[..., None, None],  # [S, n, G, 1, 1]: one per episode
            },
            batch_size=batch.batch_size[:3],
        ).flatten(1, 2)
        if config.kl_coef > 0:
            with torch.no_grad():
                seq["ref_log_prob"] = vmap(member_log_prob)(state["ref_params"], seq["observation"], seq["action"])
        return seq, episode_return, advantage

    # --compile: one minibatch's step as one pure function of flat leaf lists (the form torch.compile
    # takes whole); the clip range is a constant here (adaptive_clip, which decays it, runs eager)
    low, high = (config.clip_epsilon, config.clip_epsilon_high) if config.loss == "grpo" else (config.gspo_clip_epsilon, config.gspo_clip_epsilon_high)
    member_loss = member_loss_with(low, high)
    mb_keys = ("observation", "action", "sample_log_prob", "advantage", "mask", *(("ref_log_prob",) if config.kl_coef > 0 else ()))

    def grad_step(w: list[Tensor], treedef: tuple, opt: tuple[list[Tensor], tuple], mb: dict, lr: Tensor):
        """The seeds' loss (torch.func.vmap over S), its gradient by torch.func.grad, then
        ``optimizer``'s chain per seed (norms, finiteness mask: rlfunc.optim.leaves.chain_step) in place
        on ``w`` (the params' leaves [S, ...]) and ``opt``. ``mb``: the minibatch's tensors [S, M, T, ...];
        ``lr``: 0-dim float32. Returns (loss [S], metrics {name: [S]}, norms [S])."""

        def total(ls):
            params = unflatten(treedef, ls)
            params.batch_size = ls[0].shape[:1]  # the seeds' dim, for tensordict's vmap
            loss, metrics = torch.func.vmap(member_loss)(params, mb)
            return loss.sum(), (loss, metrics)

        grads, (loss, metrics) = torch.func.grad(total, has_aux=True)(w)
        norms = chain_step(optimizer, grads, w, treedef, opt, loss, stacked=True, lr=lr)
        return loss.detach(), {k: v.detach() for k, v in metrics.items()}, norms

    compiled = config.compilable and W == 1 and (config.run.compile == "on" or (config.run.compile == "auto" and config.num_updates >= AUTO_COMPILE_UPDATES))
    compiled_step = compile_step(grad_step, device, config.run.compile, config.loss, static_args=(0, 2)) if compiled else None
    reported: list[bool] = []  # compile_s went into a metrics line already

    def iteration(state: TensorDict, batch: TensorDict, generators: list[torch.Generator]) -> tuple[TensorDict, TensorDict]:
        """One update on a grouped ``batch`` [S, n, G, T] at the learning rate ``linear_lr(lr,
        state["iteration"], num_iterations, anneal_lr)``. Returns the new state and per-seed metrics [S].

        The parameters and Adam's moments are stepped in place (``state`` and the new state share
        them). A seed whose loss or gradients are not finite is skipped by adam's ``mask``: its
        parameters and moments stay bit for bit. Compiled, each minibatch's step is ``grad_step``
        (the same draws, the same arithmetic, no host read)."""
        if W > 1:  # every rank's groups in rank order: the single process's batch
            batch = dist.all_gather_batch(batch.select(*BATCH_KEYS), dim=1)
        seq, episode_return, advantage = prepare(state, batch)
        params = state["params"]
        leaves = func.leaves(params)
        flat_leaves, treedef = flatten(params)
        if any(a is not b for a, b in zip(flat_leaves, leaves)):  # the shaping names and the chain's state follow one order
            raise ShapeError("grpo: rlfunc.optim.flatten orders the parameter leaves unlike rlfunc.core.func.leaves")
        lr = linear_lr(config.lr, int(state["iteration"]), config.num_iterations, config.anneal_lr)
        optim_state = state["optim"]
        grpo = config.loss == "grpo"
        low, high = (config.clip_epsilon, config.clip_epsilon_high) if grpo else (config.gspo_clip_epsilon, config.gspo_clip_epsilon_high)
        low = shaped.clip_epsilon(config, low, state["iteration"])  # decayed with adaptive_clip
        high = None if high is None else shaped.clip_epsilon(config, high, state["iteration"])
        loss_fn = vmap(member_loss_with(low, high))
        optim_state, names = begin_shaping(state, seq, low), shaped.trainable(params)[0]
        B = seq.batch_size[1]
        num_mb = B // config.minibatch_size
        rows = torch.arange(S, device=device).unsqueeze(1)
        share = config.minibatch_size // W  # this rank's episodes of each minibatch
        valid = seq["mask"].flatten(2).sum(2) if W > 1 else None  # [S, B] valid steps of each episode
        metric_sum, updates = None, 0
        skipped = torch.zeros(S, dtype=torch.int64, device=device)
        if compiled_step is not None:  # the step writes into these views of the params and the chain's state
            w, opt, lr_tensor = [p.detach() for p in leaves], chain_state(optim_state), torch.tensor(lr, dtype=torch.float32, device=device)
        for _ in range(config.num_epochs):
            perm = torch.stack([torch.randperm(B, generator=g, device=device) for g in generators])
            shuffled = seq[rows, perm if W == 1 else local_share(perm, config.minibatch_size, rank, W)]
            for k in range(num_mb):
                mb = shuffled[:, k * share : (k + 1) * share]
                if compiled_step is not None:
                    loss, metrics, norms = compiled_step(w, treedef, opt, {key: mb.get(key) for key in mb_keys}, lr_tensor)
                    metrics = TensorDict(metrics, batch_size=[S]).clone()
                    metrics["grad_norm"] = norms.clone()
                    skipped += (~(loss.isfinite() & norms.isfinite())).long()
                    metric_sum = metrics.clone() if metric_sum is None else metric_sum.add_(metrics)  # in place: half a new TensorDict's cost
                    updates += 1
                    continue
                loss, metrics = loss_fn(params, mb)
                if W > 1:  # the share's means over its valid steps -> its part of the minibatch's means
                    weight = data_parallel.count_weight(
                        mb["mask"].flatten(1).sum(1), valid.gather(1, perm[:, k * config.minibatch_size : (k + 1) * config.minibatch_size]).sum(1), W)
                    loss = loss * weight if token_loss else loss
                    for key in token_means:
                        metrics[key] = metrics[key] * weight
                for p in leaves:
                    p.grad = None
                with_curvature = transform is not None and shaped.curvature_due(config, optim_state)
                graph_grads = shaped.gradients(loss.sum(), leaves, with_curvature)
                curvature = shaped.curvature(graph_grads, leaves, names, generators) if with_curvature else None
                del graph_grads
                grads = [p.grad for p in leaves]
                if W > 1:  # all_reduce_mean, with the loss and metrics in its buffer: every rank decides alike
                    grads, loss, metrics = data_parallel.average(reduce, grads, treedef, loss, metrics)
                norms = member_grad_norms(grads, stacked=True)
                ok = loss.isfinite() & norms.isfinite()
                if not bool(ok.all()):
                    skipped += (~ok).long()
                    for g in grads:
                        g.nan_to_num_(0.0, 0.0, 0.0)

                # the chain over the leaf lists (rlfunc.optim.base), as in PPO
                delta, optim_state = optimizer.update_leaves(grads, treedef, optim_state, params, lr=lr, mask=ok,
                                                             grad_norm=norms, curvature=curvature)
                with torch.no_grad():  # rlfunc.optim.apply_updates over the leaves
                    torch._foreach_add_(leaves, delta)
                if transform is not None:
                    for key, value in shaped.metrics_of(optim_state).items():
                        metrics[key] = value
                if config.adaptive_clip:
                    metrics["clip_epsilon"] = torch.full((S,), low, device=device)
                metrics["grad_norm"] = norms
                metric_sum = metrics.clone() if metric_sum is None else metric_sum.add_(metrics)
                updates += 1
        out = state.clone(recurse=False)
        out["optim"] = optim_state
        if config.normalize_observations:
            flat_mask = batch["mask"].flatten(1, 3).squeeze(-1)
            out["obs_stats"] = vmap(update_running_stats)(state["obs_stats"], batch["observation"].flatten(1, 3), flat_mask)
        n, G, T = batch.batch_size[1:]
        out["iteration"] = state["iteration"] + 1
        out["env_steps"] = state["env_steps"] + n * G * T
        out["rng"] = torch.stack([g.get_state() for g in generators]).to(device)
        metrics = metric_sum / updates
        metrics["skipped_updates"] = skipped
        metrics["updates"] = torch.full((S,), updates, device=device)
        finite = episode_return.flatten(1).isfinite()  # a NaN or inf reward's episode counts nowhere, as in ppo's line
        metrics["episode_return"] = torch.where(finite, episode_return.flatten(1), 0.0).sum(1) / finite.sum(1)
        metrics["group_return_std"] = episode_return.std(-1, correction=0).flatten(1).mean(1)
        metrics["zero_advantage_groups"] = (advantage == 0).all(-1).float().flatten(1).mean(1)
        metrics["valid_steps"] = batch["mask"].flatten(1).sum(1).float()
        if getattr(compiled_step, "compile_s", None) is not None and not reported:  # none where compile_step ran eager
            metrics["compile_s"] = torch.full((S,), compiled_step.compile_s, device=device)  # the first iteration's metrics line
            reported.append(True)
        return out, metrics

    return GRPO(init, iteration, ppo.policy, net)


# grpo and gspo: one config (its ``loss`` is the name), one line in the usage text
_GROUPED = AlgorithmEntry(
    config="rlfunc.algos.grpo:GRPOConfig", run="rlfunc.run.grpo:GRPORun", command="rlfunc.cli.grpo:train",
    evaluate="rlfunc.run.grpo:evaluate_run",
    needs="settable-start-state",  # G episodes from one start state (a torch-batched env of the env registry)
    usage="    rlfunc train grpo|gspo --env ENV_ID [--num-groups N] [--group-size G] [...]   critic-free, grouped episodes",
)
register("grpo", _GROUPED)
register("gspo", replace(_GROUPED, usage=""))

"""PPO with a Gaussian actor (Box actions) or a categorical one (Discrete and MultiDiscrete actions),
as ``make_ppo(config, spec, device, dist=None) -> PPO(init, iteration, policy, net)`` over stacked seeds.

Every learner tensor but the run's counters ("iteration", "env_steps", gradient shaping's step)
carries a leading seed dim S (``--num-seeds``), Adam's step counts included (``adam(member_dims=1)``:
a seed stopped by target_kl keeps its own), so S seeds train as S separate runs would, up to float
rounding (each has its own env seeds, noise generator, normalisers and minibatch order;
a batched matmul rounds unlike a single one, and such differences grow over a run: compare returns). The
optimizer's state is part of the learner state: the update is ``chain(clip_by_global_norm, adam)``
of :mod:`rlfunc.optim`, its state ``state["optim"]``.

Reference: Schulman et al. (2017) "Proximal Policy Optimization Algorithms"; the implementation
details (observation/reward normalisation, advantage normalisation, orthogonal init, LR annealing,
global grad clipping) follow Huang et al. (2022) "The 37 Implementation Details of PPO".
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.algos import data_parallel
from rlfunc.algos import ppo_parallel as parallel
from rlfunc.algos import shaped
from rlfunc.algos.registry import AlgorithmEntry, register
from rlfunc.config import RunConfig, check_dependents, check_env_workers, check_fields, replace, require_default
from rlfunc.core import func
from rlfunc.core.distributions import (
    categorical_entropy, categorical_log_prob, categorical_mode, categorical_sample, gaussian_entropy, gaussian_log_prob,
)
from rlfunc.core.normalize import init_running_stats, normalize, scale_reward, update_running_stats
from rlfunc.core.returns import forward_discounted_sum, generalized_advantage_estimate
from rlfunc.core.sde import EPSILON as SDE_EPSILON
from rlfunc.core.sde import draw_exploration_matrix, resample_due, sde_entropy, sde_log_prob
from rlfunc.device import compile_policy, compile_step, span
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.losses.ppo import EV_MAXIMA, EV_MOMENTS, normalize_advantage, pool_explained_variance, ppo_loss
from rlfunc.nets.actor_critic import CategoricalActorCritic, GaussianActorCritic, actor_critic_apply, sequential_apply
from rlfunc.nets.mlp import seeded_init
from rlfunc.optim import adam, all_reduce_mean, clip_by_global_norm, flatten, linear_lr, member_grad_norms
from rlfunc.optim.base import leaves_at_each, unflatten
from rlfunc.optim.shaping import importance_weights, priorities, sample_prioritized


@dataclass(frozen=True)
class PPOConfig:
    """Every PPO hyperparameter, with its default. Steps are env steps per seed."""

    env: str = "Pendulum-v1"  # gymnasium env id (Box observations; Box, Discrete or MultiDiscrete actions)
    total_steps: int = 200_000  # env steps per seed (rounded up to whole iterations of the batch)
    num_envs: int = 8  # parallel envs per seed
    num_steps: int = 256  # steps per env per rollout; batch = num_envs * num_steps
    num_epochs: int = 10  # passes over each batch
    minibatch_size: int = 512  # samples per gradient step; must divide the batch
    lr: float = 3e-4  # Adam learning rate
    anneal_lr: bool = True  # linear decay of lr to 0 over the run
    adam_eps: float = 1e-5  # Adam epsilon
    gamma: float = 0.99  # discount, in [0, 1]
    lmbda: float = 0.95  # GAE lambda, in [0, 1]
    clip_epsilon: float = 0.2  # surrogate clip range
    value_clip_epsilon: float | None = None  # clip range of V around its old value (None: off)
    entropy_coef: float = 0.0  # entropy bonus weight
    value_coef: float = 0.5  # value loss weight
    max_grad_norm: float = 0.5  # global grad-norm clip, per seed
    normalize_advantages: bool = True  # per minibatch
    normalize_observations: bool = True  # running mean/std, clipped to +-obs_clip
    obs_clip: float = 10.0  # in standard deviations
    normalize_rewards: bool = True  # divide by the running std of the discounted return
    reward_clip: float = 10.0  # after scaling
    hidden: tuple[int, ...] = (64, 64)  # MLP widths of actor and critic
    activation: str = "tanh"  # tanh | relu | elu | silu
    init_log_std: float = 0.0  # initial log std of the actions (gaussian) or of the exploration matrix (gsde)
    exploration: Literal["gaussian", "gsde"] = "gaussian"  # action noise: state-independent Gaussian, or gSDE (rlfunc.core.sde)
    sde_sample_freq: int = -1  # gsde: env steps between exploration-matrix draws (<= 0: once per rollout)
    full_std: bool = True  # gsde: one sigma per exploration-matrix entry [L, A] (False: per feature [L, 1])
    sde_learn_features: bool = False  # gsde: let the noise scale's gradient reach the actor's features
    target_kl: float | None = None  # a seed stops its epochs of an iteration once its approx KL exceeds it
    oscillation_damping: bool = False  # shaping: damp steps of tensors with oscillating gradient signs / high curvature (rlfunc.optim.shaping)
    damping_strength: float = 0.5  # shaping: step factor 1 - strength for a fully oscillating tensor, in [0, 1]
    hessian_interval: int = 5  # shaping: gradient steps between Hutchinson curvature estimates (double backward)
    adaptive_clip: bool = False  # shaping: clip_epsilon * clip_epsilon_decay^iteration and per-layer trust radii
    clip_epsilon_decay: float = 0.995  # shaping: decay of the ratio clip per iteration (policy update), in (0, 1]
    trust_radius_scale: float = 1.0  # shaping: multiplies every per-layer radius (1: the strict first-order bound, rlfunc.optim.shaping)
    prioritized_minibatches: bool = False  # shaping: minibatches drawn by per-sample gradient norm, PER weights
    priority_alpha: float = 0.6  # shaping: p_i ~ m_i^alpha (Schaul et al. 2016)
    priority_beta: float = 0.4  # shaping: importance weights (N p_i)^-beta / max, in [0, 1]
    vectorization: Literal["sync", "async"] = "sync"  # gymnasium vector env mode
    freeze_threshold: float = 0.0  # skip updates of a param leaf whose relative change over a window is below this (0: off)
    freeze_window: int = 10  # iterations per measuring window, and per frozen spell, of freeze_threshold
    # (switch, on, the fields only it reads): set while the switch is off, they were recorded and unread
    # (--sde-sample-freq without gSDE, --reward-clip without reward normalisation): rlfunc.config.check_dependents
    dependents: ClassVar[tuple] = (
        ("exploration='gsde'", lambda c: c.exploration == "gsde", ("sde_sample_freq", "full_std", "sde_learn_features")),
        ("prioritized_minibatches", lambda c: c.prioritized_minibatches, ("priority_alpha", "priority_beta")),
        ("normalize_observations", lambda c: c.normalize_observations, ("obs_clip",)),
        ("normalize_rewards", lambda c: c.normalize_rewards, ("reward_clip",)),
        ("freeze_threshold > 0", lambda c: c.freeze_threshold > 0, ("freeze_window",)),
        *shaped.DEPENDENTS,
    )
    run: RunConfig = field(default_factory=lambda: RunConfig(version_every=1, eval_episodes=100))  # seeds, device, snapshots (rlfunc.config.RunConfig); a version per iteration, 100 evaluation episodes (deterministic actions; the protocol asks >= 50)

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("gamma", "lmbda"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name}={value}: expected a value in [0, 1]")
        require_default(self.run, precision="ppo has no mixed precision", log_every="ppo logs every iteration")
        if not self.freeze_threshold >= 0:
            raise ConfigError(f"freeze_threshold={self.freeze_threshold}: expected >= 0")
        if self.freeze_window < 1:
            raise ConfigError(f"freeze_window={self.freeze_window}: expected a positive integer")
        if self.freeze_threshold > 0 and self.run.num_seeds > 1:  # they were coupled: the largest change over seeds decided
            raise ConfigError(f"freeze_threshold={self.freeze_threshold} with num_seeds={self.run.num_seeds}: the freeze mask "
                              "is one for all the stacked seeds, so they would not be independent runs; train the seeds "
                              "as separate runs")
        for name in ("total_steps", "num_envs", "num_steps", "num_epochs", "minibatch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a positive integer")
        if self.batch_size % self.minibatch_size:
            raise ConfigError(
                f"minibatch_size={self.minibatch_size} does not divide the batch "
                f"num_envs*num_steps={self.batch_size}"
            )
        for name in ("lr", "clip_epsilon", "max_grad_norm", "obs_clip", "reward_clip"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)}: expected > 0")
        if not math.isfinite(self.lr):
            raise ConfigError(f"lr={self.lr}: expected a finite value > 0")
        for name in ("entropy_coef", "value_coef"):  # nan/inf made every loss non-finite: every step skipped, silently
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ConfigError(f"{name}={getattr(self, name)}: expected a finite value >= 0")
        if not self.hidden:
            raise ConfigError("hidden=(): expected at least one layer width (e.g. --hidden 64 64)")
        if any(h <= 0 for h in self.hidden):
            raise ConfigError(f"hidden={self.hidden}: every layer width must be positive")
        for name in ("target_kl", "value_clip_epsilon"):  # value_clip_epsilon nan skipped every step, silently
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name}={value}: expected a finite value > 0 or None")
        if not (self.adam_eps >= 0 and math.isfinite(self.adam_eps)):
            raise ConfigError(f"adam_eps={self.adam_eps}: expected a finite value >= 0")
        if self.activation not in ("tanh", "relu", "elu", "silu"):
            raise ConfigError(f"activation={self.activation!r}: expected tanh, relu, elu or silu")
        if self.exploration not in ("gaussian", "gsde"):
            raise ConfigError(f"exploration={self.exploration!r}: expected 'gaussian' or 'gsde'")
        check_init_log_std(self.init_log_std)
        shaped.check_config(self)
        if self.run.env_workers and self.vectorization != "sync":
            raise ConfigError(f"run.env_workers={self.run.env_workers} with vectorization={self.vectorization!r}: "
                              "each worker process steps a sync vector env")
        nproc = self.run.nproc if self.run.nproc > 1 and (self.num_envs * self.run.num_seeds) % self.run.nproc == 0 else 1
        check_env_workers(self.run, self.num_envs * self.run.num_seeds // nproc,
                          f"num_envs={self.num_envs} x num_seeds={self.run.num_seeds} / nproc={nproc} per process"
                          if self.run.num_seeds > 1 or nproc > 1 else "")
        if not self.priority_alpha >= 0 or not 0 <= self.priority_beta <= 1:
            raise ConfigError(f"priority_alpha={self.priority_alpha}, priority_beta={self.priority_beta}: expected >= 0 and in [0, 1]")
        parallel.check_config(self, self.run.nproc)  # before torchrun starts the ranks (make_ppo checks the real W)

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_iterations(self) -> int:
        return max(1, math.ceil(self.total_steps / self.batch_size))

    @property
    def seeds(self) -> list[int]:
        return self.run.seeds


def check_init_log_std(value: float) -> None:
    """ConfigError unless ``value`` (an initial log std) is in [-20, 20]: the std e^x, squared in the
    log-probability, overflows float32 past x ~ 44 (grpo --init-log-std 100 skipped every update and
    exited 0)."""
    if not -20 <= value <= 20:
        raise ConfigError(f"init_log_std={value}: expected a number in [-20, 20] (the initial std is e^init_log_std)")


PRESETS: dict[str, dict] = {
    # Pendulum: RL-Zoo's gSDE exploration (matrix resampled every 4 steps), no observation/reward
    # normalisation, 100k steps; 16 envs x 256 steps (RL-Zoo: 4 x 1024) and minibatches of 256 at
    # 2x RL-Zoo's lr: a quarter of its gradient steps per sample. The lr decays linearly to 0 and
    # gamma is 0.95 (RL-Zoo: constant lr, 0.9): with a constant 3e-3 the policy's KL per update grew
    # as its noise shrank and the final policy declined with more training (-218 over 100 episodes at
    # 100k, -277 at 200k on seed 0); gamma 0.9 with the decay still left seeds at -185 to -211, and
    # 3e-3 with the decay and 0.95 still declined late on 2 of 5 seeds at 4x the budget.
    # bench/RESULTS.md "Pendulum-v1 under the evaluation protocol" has the runs that chose it.
    "Pendulum-v1": dict(
        total_steps=100_000, num_envs=16, num_steps=256, num_epochs=10, minibatch_size=256,
        lr=2e-3, anneal_lr=True, gamma=0.95, lmbda=0.95, clip_epsilon=0.2, entropy_coef=0.0, max_grad_norm=0.5,
        normalize_observations=False, normalize_rewards=False, exploration="gsde", sde_sample_freq=4,
    ),
    # HalfCheetah: RL-Zoo's gamma/lambda/grad clip and 256x256 ReLU nets, with fewer and larger
    # minibatches than RL-Zoo's 20 epochs of 64 (the bulk of its wall-clock). 16 envs x 128 steps
    # (the same 2048-sample batch as 4 x 512 before): 6066 / 6823 / 6364 at 1M on seeds 0-2 (SB3
    # RL-Zoo in the same bench: 6250 / 4777 / 5519), in 400-490 s (bench/RESULTS.md "HalfCheetah-v5"),
    # and collection at 0.81-0.86 of the bare env (4 x 512: 0.60).
    "HalfCheetah-v5": dict(
        total_steps=1_000_000, num_envs=16, num_steps=128, num_epochs=10, minibatch_size=256,
        lr=3e-4, gamma=0.98, lmbda=0.92, clip_epsilon=0.2, max_grad_norm=0.8,
        hidden=(256, 256), activation="relu", init_log_std=-1.0,
    ),
    # Pusher: SB3's default update density (10 epochs of minibatches of 64 per 2048 steps); the
    # package default of 512-sample minibatches does 8x fewer updates and learned too slowly.
    # 256x256 nets: at 200k steps a median return of -30.7 over seeds 0-4 against -31.8 with 64x64
    # (better on 4 of 5 seeds), at 1.3-1.5x the training time. gamma 0.98 / lmbda 0.92 (episodes
    # are 100 steps): at 200k, +0.7 mean return over 16 seeds, better on 13 of them, than 0.99 / 0.95
    # (bench/RESULTS.md "Pusher-v5", paired evaluation).
    "Pusher-v5": dict(
        total_steps=1_000_000, num_envs=8, num_steps=256, num_epochs=10, minibatch_size=64,
        lr=3e-4, gamma=0.98, lmbda=0.92, clip_epsilon=0.2, max_grad_norm=0.5, hidden=(256, 256),
    ),
    # CartPole (Discrete(2) actions, a categorical actor): RL-Zoo's PPO settings (8 envs x 32 steps,
    # one 256-sample minibatch, lr decaying linearly to 0, gamma 0.98, lmbda 0.8, no entropy bonus, no
    # normalisation, 100k steps) but 10 epochs at lr 2e-3 where RL-Zoo takes 20 at 1e-3: half the
    # gradient steps, and on screening seeds 10-14 every seed reached and stayed >= 475 at 20-31k steps
    # (RL-Zoo's: 20-31k, in 1.7x the time; bench/RESULTS.md "PPO on CartPole-v1, the preset at 10
    # epochs"). RL-Zoo also anneals the clip range (lin_0.2); there is no clip schedule here outside
    # gradient shaping, so it stays 0.2. A version every 10 iterations (2,560 env steps), not every one.
    "CartPole-v1": dict(
        total_steps=100_000, num_envs=8, num_steps=32, num_epochs=10, minibatch_size=256,
        lr=2e-3, anneal_lr=True, gamma=0.98, lmbda=0.8, clip_epsilon=0.2, entropy_coef=0.0, max_grad_norm=0.5,
        normalize_observations=False, normalize_rewards=False,
        version_every=10,  # an iteration is 256 env steps (~40 ms): a version each (~15 ms) was ~40% of the CLI's training time
    ),
}


SHAPING_PRESETS: dict[str, dict] = {
    # Oscillation damping + adaptive per-layer clip radius + prioritised minibatches, with the
    # values of issue 5: gamma 0.99, lmbda 0.95, clip 0.2 decaying 0.995 per update, grad clip 0.3,
    # curvature every 5 steps, 10 epochs of 32 minibatches over 2048-step rollouts.
    "ppo-shaped": dict(
        gamma=0.99, lmbda=0.95, clip_epsilon=0.2, clip_epsilon_decay=0.995, max_grad_norm=0.3, hessian_interval=5,
        num_epochs=10, num_envs=8, num_steps=256, minibatch_size=64,
        oscillation_damping=True, adaptive_clip=True, prioritized_minibatches=True,
    ),
}


def preset(env: str, shaping: str | None = None, **overrides) -> PPOConfig:
    """The preset for ``env`` (defaults for envs without one), then the gradient-shaping preset
    ``shaping`` (a key of SHAPING_PRESETS, e.g. "ppo-shaped"; None: off), then ``overrides``.

    Raises:
        ConfigError: as :class:`PPOConfig`, or an override that a switch which is off would leave
            unread (:attr:`PPOConfig.dependents`)."""
    if shaping is not None and shaping not in SHAPING_PRESETS:
        raise ConfigError(f"shaping={shaping!r}: expected None or one of {', '.join(map(repr, SHAPING_PRESETS))}")
    base = replace(PPOConfig(), **{**PRESETS.get(env, {}), **SHAPING_PRESETS.get(shaping, {}), "env": env})
    config = replace(base, **overrides)
    check_dependents(config, base)
    return config


class EnvSpec(NamedTuple):
    """What the learner needs to know of an env: sizes, the kind of action space and its bounds (env units).

    ``action_kind`` "box": ``act_dim`` floats per step, a Gaussian actor. "discrete" (Discrete(n)):
    one integer per step, ``act_dim`` 1, ``nvec`` (n,); the actor outputs n logits and the batch holds
    int64 actions [S, N, T]. "multi_discrete" (MultiDiscrete(nvec), flattened): ``act_dim`` = H =
    len(nvec) integers per step, sum(nvec) logits, actions int64 [S, N, T, H]. Discrete actions are
    indices from 0; ``action_low`` / ``action_high`` are the env's values (start, start + n - 1).
    """

    obs_dim: int
    act_dim: int
    action_low: list[float]
    action_high: list[float]
    action_kind: Literal["box", "discrete", "multi_discrete"] = "box"
    nvec: tuple[int, ...] = ()  # the heads' sizes of a discrete action space (empty for Box)


class PPO(NamedTuple):
    """The algorithm: ``init() -> state`` (the env's spec was :func:`make_ppo`'s) and
    ``iteration(state, batch, generators) -> (state, metrics)``, plus the policy the collector runs
    (``policy(state, generators, deterministic)``) and ``net``, the module skeleton of the params."""

    init: Callable[[], TensorDict]
    iteration: Callable[..., tuple[TensorDict, TensorDict]]
    policy: Callable[..., Callable[[Tensor], tuple[Tensor, Tensor]]]
    net: GaussianActorCritic | CategoricalActorCritic


# --compile auto compiles a run of at least this many gradient steps: a cold compile took 14-15 s on this
# 2-core CPU and saved 0.75-1.1 ms per step (bench/RESULTS.md, "Compiled updates"), so about 20k steps
# break even; the quick start (Pendulum-v1, 4,000 steps) runs eager, HalfCheetah-v5's (39,120) compiled.
AUTO_COMPILE_STEPS = 20_000


def check_new_run(config: PPOConfig, spec: EnvSpec) -> None:
    """ConfigError for a setting a new run on ``spec``'s env would take and not use: ``init_log_std`` with
    Discrete or MultiDiscrete actions (the categorical policy has no log std; it was recorded in
    config.json and changed nothing). For a new run only: a saved one with it still evaluates and resumes."""
    kind = getattr(spec, "action_kind", "box")
    if kind != "box" and config.init_log_std != PPOConfig.init_log_std:
        raise ConfigError(f"init_log_std={config.init_log_std}: env={config.env!r} has {kind} actions, whose categorical "
                          f"policy has no log std; leave it at {PPOConfig.init_log_std}")


def make_ppo(config: PPOConfig, spec: EnvSpec, device: torch.device, dist=None) -> PPO:
    """Build PPO's pure pieces for ``config`` on envs described by ``spec``.

    ``dist``: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run of W
    ranks. Rank r then collects envs r*N/W .. (r+1)*N/W - 1 of the ``config.num_envs`` = N (its
    batch is [S, N/W, T]) and ``iteration`` equals the single-process one on all N envs, to float
    rounding (rlfunc.algos.ppo_parallel and data_parallel: the noise rows, the merged statistics, the gathered batch,
    each rank's share of every minibatch, one all_reduce_mean of the gradients before the norms and
    the chain). The learner state is the same on every rank and has the single process's layout.

    The learner state is one TensorDict on ``device`` (leading seed dim S on every member tensor):
    "params" (actor, critic, log_std: [S, act_dim], or [S, L, act_dim or 1] with gSDE; no log_std for
    discrete actions, whose actor outputs logits), "obs_stats", "return_stats", "discounted_return" [S, N, 1],
    "rng" (uint8 generator states, [S, L]), "iteration" and "env_steps" (0-dim int64), and "optim", the
    state of the update chain ``chain(clip_by_global_norm(max_grad_norm), adam(lr, eps=adam_eps))``:
    "0" {"norm": [S], the last pre-clip gradient norms}, "1" {"step", "exp_avg", "exp_avg_sq"}, Adam's
    per-leaf step counts (float32: [S], one per seed, with S > 1; 0-dim with one) and moments (like
    "params"). With a step transform on, Adam's state is "1" "inner", beside the transforms'
    ("transform", "step", "metrics": :mod:`rlfunc.algos.shaped`).
    """
    S, N = config.run.num_seeds, config.num_envs
    W, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)
    parallel.check_config(config, W)
    own = data_parallel.own_rows(rank, W)  # the noise rows of this rank's envs
    kind = getattr(spec, "action_kind", "box")  # a spec-like object without one (tests, benches) is a Box env's
    discrete = kind != "box"
    if discrete and config.exploration != "gaussian":
        raise ConfigError(f"exploration={config.exploration!r}: env={config.env!r} has {kind} actions, which "
                          "the categorical policy explores by sampling; expected exploration='gaussian' (gSDE needs Box actions)")
    nvec = spec.nvec if kind == "multi_discrete" else None  # the heads of categorical_* (None: one head)
    action_tail = (spec.act_dim,) if kind != "discrete" else ()  # per-env action shape in the batch
    if discrete:
        make_net = lambda: CategoricalActorCritic(spec.obs_dim, sum(spec.nvec), config.hidden, config.activation)  # noqa: E731
    else:
        make_net = lambda: GaussianActorCritic(  # noqa: E731
            spec.obs_dim, spec.act_dim, config.hidden, config.activation, config.init_log_std,
            config.exploration, config.full_std,
        )
    net = make_net().to(device)
    gsde = config.exploration == "gsde"
    head = str(len(net.actor) - 1)  # the actor's output layer; body: the layers before it (features z)
    body = torch.nn.Sequential(*list(net.actor)[:-1])
    use_loop = {"auto": None, "vmap": False, "loop": True}[config.run.vmap]
    vmap = lambda fn, **kw: func.vmap(fn, use_loop=use_loop, device=device, **kw)  # noqa: E731
    transform = shaped.make_transform(config)  # None unless a step transform is on
    clip = clip_by_global_norm(config.max_grad_norm, stacked=True)
    # chain(clip, adam), Adam wrapped when shaping; a step count per seed (one stopped by target_kl or skipped keeps its own run's)
    optimizer = shaped.optimizer(config, clip, adam(config.lr, eps=config.adam_eps, member_dims=int(S > 1)))
    # data parallel: the chain is all_reduce_mean -> clip -> adam; its first link runs ahead of the norms and the
    # finiteness mask (which must see the averaged gradients) and is stateless, so the state keeps its layout
    reduce = all_reduce_mean(None if dist is None else dist.group)
    update_stats = vmap(update_running_stats) if W == 1 else parallel.update_stats_across_ranks(vmap, dist.group)

    def init() -> TensorDict:
        params = func.stack_params(
            [func.params_from_module(seeded_init(make_net, seed).to(device)) for seed in config.seeds]
        )
        gens = [torch.Generator(device=device).manual_seed(seed) for seed in config.seeds]
        stats = init_running_stats((spec.obs_dim,), device=device)
        ret_stats = init_running_stats((), device=device)
        return TensorDict(
            {
                "params": params,
                "optim": optimizer.init(params),
                "obs_stats": torch.stack([stats] * S),
                "return_stats": torch.stack([ret_stats] * S),
                "discounted_return": torch.zeros(S, N, 1, device=device),
                "rng": torch.stack([g.get_state() for g in gens]),
                "iteration": torch.zeros((), dtype=torch.int64, device=device),
                "env_steps": torch.zeros((), dtype=torch.int64, device=device),
            },
            batch_size=[],
            device=device,
        )

    def grads_of(leaves: list[Tensor], treedef: tuple, mb: dict):
        """The loss's gradients over the trainable ``leaves`` (rlfunc.optim.flatten order) by
        torch.func.grad, for the minibatch's tensors ``mb`` [S, M, ...]: (grads, loss [S], metrics
        {name: [S]}). Lists and dicts in and out, no TensorDict: tensordict's pytree cache would
        make the second compiled call recompile."""

        def total(ls):
            params = unflatten(treedef, ls)
            # the seeds' dim, which tensordict's vmap would infer from a top-level tensor (a Gaussian
            # actor's log_std): a categorical actor-critic has none, and vmap saw a 0-dim input
            params.batch_size = ls[0].shape[:1]
            loss, metrics = torch.func.vmap(member_loss)(params, mb)
            return loss.sum(), (loss, metrics)

        grads, (loss, metrics) = torch.func.grad(total, has_aux=True)(leaves)
        return grads, loss.detach(), {k: v.detach() for k, v in metrics.items()}

    def apply_grads(leaves: list[Tensor], treedef: tuple, adam_state: tuple[list[Tensor], list[Tensor], list[Tensor]],
                    grads: list[Tensor], loss: Tensor, lr: Tensor, allowed: Tensor) -> Tensor:
        """The per-seed gradient norms [S], the finiteness mask (``allowed`` [S] bool: finite data,
        not stopped by target_kl; and a finite loss and norm), then ``optimizer``'s chain (the same
        ``update_leaves`` the eager loop calls) and the update added to ``leaves`` in place (Adam's
        ``adam_state`` = (step, exp_avg, exp_avg_sq) leaves of the same order, in place). Returns the norms."""
        norms = member_grad_norms(grads, stacked=True)
        mask = allowed & loss.isfinite() & norms.isfinite()
        grads = [g.nan_to_num(0.0, 0.0, 0.0) for g in grads]
        steps, exp_avg, exp_avg_sq = adam_state
        state = unflatten((("0", (("norm", None),)), ("1", (("exp_avg", treedef), ("exp_avg_sq", treedef), ("step", treedef)))),
                          [norms, *exp_avg, *exp_avg_sq, *steps])
        delta, _ = optimizer.update_leaves(grads, treedef, state, None, lr=lr, mask=mask, grad_norm=norms)
        with torch.no_grad():
            torch._foreach_add_(leaves, delta)
        return norms

    def grad_step(leaves: list[Tensor], treedef: tuple, adam_state: tuple[list[Tensor], list[Tensor], list[Tensor]],
                  mb: dict, lr: Tensor, allowed: Tensor):
        """One minibatch's gradient step as one pure function (the form torch.compile takes whole):
        :func:`grads_of` then :func:`apply_grads`. Returns (loss [S], metrics {name: [S]}, norms [S]).
        A data-parallel run compiles the two apart, with the ranks' all_reduce_mean between them."""
        grads, loss, metrics = grads_of(leaves, treedef, mb)
        norms = apply_grads(leaves, treedef, adam_state, grads, loss, lr, allowed)
        return loss, metrics, norms

    # a freeze mask changes the set of stepped leaves between iterations, which the compiled step fixes
    compiled = config.run.compile != "off" and transform is None and not config.adaptive_clip \
        and not config.prioritized_minibatches and config.freeze_threshold == 0
    if config.run.compile == "auto":  # on where the run is long enough to pay for compiling (bench/compiled_update.py)
        compiled = compiled and config.num_iterations * config.num_epochs * (config.batch_size // config.minibatch_size) >= AUTO_COMPILE_STEPS
    if config.run.compile == "on" and not compiled:
        raise ConfigError("run.compile='on': ppo compiles its plain gradient step only; expected no step transform, "
                          "adaptive_clip, prioritized_minibatches or freeze_threshold with it (or --compile off)")
    compiled_step = compiled_grads = compiled_apply = None
    if compiled and W == 1:
        compiled_step = compile_step(grad_step, device, config.run.compile, "ppo", static_args=(0, 2))
    elif compiled:  # two graphs, the ranks' one collective between them
        compiled_grads = compile_step(grads_of, device, config.run.compile, "ppo", static_args=(0,))
        compiled_apply = compile_step(apply_grads, device, config.run.compile, "ppo", static_args=(0, 2))

    # the rollout policy's network part (normalisation, the actor or gSDE's features) as one pure function of
    # its weights, compiled where that pays (rlfunc.device.compile_policy: CUDA graphs; eager on the CPU)
    actor_weights, actor_apply = func.sequential_apply(body if gsde else net.actor, stacked=True)

    def actor_forward(weights: list[Tensor], mean: Tensor, inv_std: Tensor, x: Tensor) -> Tensor:
        """x [S, N', obs_dim] float32 -> the actor's output [S, N', out] (features with gSDE)."""
        if config.normalize_observations:
            x = ((x - mean) * inv_std).clamp(-config.obs_clip, config.obs_clip)
        return actor_apply(weights, x)

    long_run = config.num_iterations * config.num_epochs * (config.batch_size // config.minibatch_size) >= AUTO_COMPILE_STEPS
    compiled_actor = None
    if config.run.compile == "on" or (config.run.compile == "auto" and long_run):
        compiled_actor = compile_policy(actor_forward, device, config.run.compile, "ppo's rollout policy", static_args=(0,))
        compiled_actor = None if compiled_actor is actor_forward else compiled_actor

    def norm_obs(stats: TensorDict, obs: Tensor) -> Tensor:
        if not config.normalize_observations:
            return obs
        return normalize(stats, obs, clip=config.obs_clip)

    def policy(state: TensorDict, generators: list[torch.Generator], deterministic: bool = False,
               log_prob: bool = True):
        """The collector's policy: observation [S*N', obs_dim] -> (action, sample_log_prob [S*N', 1]).

        ``log_prob=False`` returns (action, None): the trainer's rollout leaves "sample_log_prob"
        out of the batch and ``iteration`` computes it for the whole batch at once from the
        observations and actions (same parameters, so the same density up to float rounding),
        which takes about ten small ops out of every env step.

        The actor runs through ``func.sequential_forward`` (weights resolved once as views; all
        seeds in one batched matmul per layer); where the run compiles (``--compile`` on CUDA,
        :func:`rlfunc.device.compile_policy`) the normalisation and the actor are one compiled
        function of the weights, replayed as CUDA graphs. The normaliser is (mean, 1/sqrt(var + eps))
        computed once, as ``rlfunc.core.normalize.normalize`` does. Gaussian exploration: the
        log-probability uses the drawn noise directly, log N(a; mu, sigma) with (a - mu) / sigma =
        noise. gSDE: each seed draws one exploration matrix per env at the first call and every
        ``sde_sample_freq`` calls after (rlfunc.core.sde.resample_due), from its own generator, so the
        matrices follow from the generator states the learner state holds (exact resume); the
        log-probability is log N(a; mu, (z^2) @ sigma^2 + 1e-6) as in ``sde_log_prob``. The
        normaliser and sigma are read when the policy is built: build one per rollout (the
        trainer does), which also starts each rollout with fresh matrices, as stable-baselines3.

        Discrete actions: the actor's logits [S, N', K] and ``categorical_sample`` with explicit
        uniforms [S, N', K] drawn from each seed's generator (data parallel: drawn for all N envs,
        this rank's rows kept, as the Gaussian noise); the action is int64 [S*N'] (Discrete) or
        [S*N', H] (MultiDiscrete), ``deterministic`` takes ``categorical_mode``.
        """
        half_log_2pi = 0.5 * math.log(2.0 * math.pi)
        params = state["params"]
        stats = state["obs_stats"]
        mean, inv_std = stats["mean"].unsqueeze(1), torch.rsqrt(stats["var"] + 1e-8).unsqueeze(1)  # [S, 1, obs]
        actor = body if gsde else net.actor
        if compiled_actor is not None:  # normalisation inside, all members stacked
            weights = actor_weights(params["actor"])
            forward = lambda x: compiled_actor(weights, mean, inv_std, x)  # noqa: E731
        elif S == 1:  # weights resolved once, as views that see the optimizer's in-place steps
            single = func.sequential_forward(actor, params["actor"][0], stacked=False)
            forward = lambda x: single(x[0]).unsqueeze(0)  # noqa: E731
        else:  # all members in one batched matmul per layer
            forward = func.sequential_forward(actor, params["actor"], stacked=True)
        if gsde:
            head_weight = params["actor", head, "weight"].detach().transpose(-1, -2)  # [S, L, A]
            head_bias = params["actor", head, "bias"].detach().unsqueeze(1)  # [S, 1, A]
            sde_log_std = params["log_std"].detach()  # [S, L, A or 1]
            variance_scale = sde_log_std.mul(2.0).exp()  # sigma^2
            sde_log_norm = torch.tensor(-spec.act_dim * half_log_2pi, device=variance_scale.device)
            rollout = {"step": 0, "theta": None}
        elif not discrete:  # a categorical actor has no log_std
            log_std = params["log_std"].detach().unsqueeze(1)  # [S, 1, act]
            std, log_norm = log_std.exp(), -(log_std + half_log_2pi).sum(-1, keepdim=True)

        def act(observation: Tensor) -> tuple[Tensor, Tensor | None]:
            x = observation.to(torch.float32).reshape(S, -1, spec.obs_dim)  # TorchRL may pass 64-bit floats
            if config.normalize_observations and compiled_actor is None:
                x = ((x - mean) * inv_std).clamp_(-config.obs_clip, config.obs_clip)
            if gsde:
                latent = forward(x)  # [S, N', L]
                loc = torch.baddbmm(head_bias, latent, head_weight)
            else:
                loc = forward(x)
            if discrete:
                return sample_categorical(loc)
            if deterministic:
                return loc.reshape(-1, spec.act_dim), loc.new_zeros(loc.shape[0] * loc.shape[1], 1)
            if gsde:
                if resample_due(rollout["step"], config.sde_sample_freq):
                    with torch.inference_mode(False):  # held across calls: never an inference tensor (collect.rollout's mode)
                        rollout["theta"] = torch.stack(
                            [own(lambda n, s=s, g=g: draw_exploration_matrix(sde_log_std[s], spec.act_dim, g, (n,)), loc.shape[1], 0)
                             for s, g in enumerate(generators)]
                        ).flatten(0, 1)  # [S * N', L, A]
                rollout["step"] += 1
                noise = torch.bmm(latent.reshape(-1, 1, latent.shape[-1]), rollout["theta"]).view_as(loc)  # z @ theta, [S, N', A]
                if not log_prob:
                    return loc.add_(noise).reshape(-1, spec.act_dim), None
                variance = torch.bmm(latent.square(), variance_scale).add_(SDE_EPSILON)
                if not config.full_std:
                    variance = variance.expand_as(noise)
                logp = noise.square().div_(variance).add_(variance.log()).sum(-1, keepdim=True)
                logp = torch.add(sde_log_norm, logp, alpha=-0.5)
                return loc.add_(noise).reshape(-1, spec.act_dim), logp.reshape(-1, 1)
            A = loc.shape[2]
            if S == 1:
                noise = own(lambda n: torch.randn((1, n, A), generator=generators[0], device=loc.device), loc.shape[1], 1)
            else:
                noise = torch.stack([own(lambda n, g=g: torch.randn((n, A), generator=g, device=loc.device), loc.shape[1], 0)
                                     for g in generators])
            action = torch.addcmul(loc, std, noise)
            if not log_prob:
                return action.reshape(-1, spec.act_dim), None
            logp = noise.square().sum(-1, keepdim=True).mul_(-0.5).add_(log_norm)
            return action.reshape(-1, spec.act_dim), logp.reshape(-1, 1)

        def sample_categorical(logits: Tensor) -> tuple[Tensor, Tensor | None]:
            if deterministic:
                action = categorical_mode(logits, nvec=nvec)
                return action.reshape(-1, *action_tail), logits.new_zeros(logits.shape[0] * logits.shape[1], 1)
            K = logits.shape[2]
            if S == 1:
                u = own(lambda n: torch.rand((1, n, K), generator=generators[0], device=logits.device), logits.shape[1], 1)
            else:
                u = torch.stack([own(lambda n, g=g: torch.rand((n, K), generator=g, device=logits.device), logits.shape[1], 0)
                                 for g in generators])
            action = categorical_sample(logits, noise=u, nvec=nvec)  # [S, N'(, H)]
            if not log_prob:
                return action.reshape(-1, *action_tail), None
            return action.reshape(-1, *action_tail), categorical_log_prob(logits, action, nvec=nvec).reshape(-1, 1)

        return act

    def sample_log_prob(params: TensorDict, observation: Tensor, action: Tensor) -> Tensor:
        """log pi(action | observation) of one sample (0-dim), as member_loss computes it."""
        if discrete:
            return categorical_log_prob(sequential_apply(net.actor, params["actor"], observation[None]), action[None], nvec=nvec).sum()
        loc, log_std, _, latent = actor_critic_apply(net, params, observation[None])
        if gsde:
            return sde_log_prob(action[None], loc, latent if config.sde_learn_features else latent.detach(), log_std).sum()
        return gaussian_log_prob(action[None], loc, log_std).sum()

    def sample_value(params: TensorDict, observation: Tensor) -> Tensor:
        return sequential_apply(net.critic, params["critic"], observation[None]).sum()

    def minibatch_priorities(params: TensorDict, flat: TensorDict, log_prob_grads: TensorDict, data_ok: Tensor,
                             frozen: Collection[str] = ()) -> tuple[Tensor, Tensor]:
        """(p [S, B], importance weights [S, B]) from m_i, the norm of sample i's loss gradient at the
        start of the update (ratio 1): sqrt(A_i^2 |d log pi_i|^2 + (c_v (V_i - V_target_i))^2 |d V_i|^2),
        A the batch-normalised advantage (actor and critic share no parameter; entropy left out).
        A seed whose data is not finite (``data_ok`` [S] False; its update is skipped) or whose m_i are
        not gets uniform priorities."""
        value_grads = shaped.stacked_per_sample_grads(sample_value, params, flat["observation"], device=device, use_loop=use_loop,
                                                      frozen=frozen)
        sq = lambda td: sum(g.square().flatten(2).sum(-1) for g in td.values())  # noqa: E731  [S, B]
        adv = flat["advantage"].squeeze(-1)
        if config.normalize_advantages:
            adv = (adv - adv.mean(1, keepdim=True)) / (adv.std(1, correction=0, keepdim=True) + 1e-8)
        value_error = config.value_coef * (flat["state_value"] - flat["value_target"]).squeeze(-1)
        magnitude = (adv.square() * sq(log_prob_grads) + value_error.square() * sq(value_grads)).sqrt()
        usable = (data_ok & magnitude.isfinite().all(1)).unsqueeze(1)  # [S, 1]
        p = priorities(torch.where(usable, magnitude, torch.ones_like(magnitude)), config.priority_alpha)
        return p, importance_weights(p, config.priority_beta)

    def member_loss(params: TensorDict, mb: TensorDict, clip_epsilon: float = config.clip_epsilon,
                    check: bool = True) -> tuple[Tensor, TensorDict]:
        """One member's (loss, metrics) on a minibatch; ``params`` and ``mb`` TensorDicts or nested dicts of
        its tensors; ``check`` False skips ppo_loss's argument checks (an iteration's later minibatches)."""
        # without an entropy bonus the entropy is a metric: computed outside the graph, so that the backward
        # skips it (the gradients are the same; its term added -0 x dH/dtheta)
        metric_only = torch.no_grad if config.entropy_coef == 0 else contextlib.nullcontext
        if discrete:
            logits = sequential_apply(net.actor, params["actor"], mb["observation"])
            value = sequential_apply(net.critic, params["critic"], mb["observation"])
            log_prob = categorical_log_prob(logits, mb["action"], nvec=nvec)
            with metric_only():
                entropy = categorical_entropy(logits, nvec=nvec)
        elif gsde:
            loc, log_std, value, latent = actor_critic_apply(net, params, mb["observation"])
            latent = latent if config.sde_learn_features else latent.detach()
            log_prob = sde_log_prob(mb["action"], loc, latent, log_std)
            with metric_only():
                entropy = sde_entropy(latent, log_std, spec.act_dim)
        else:
            loc, log_std, value, latent = actor_critic_apply(net, params, mb["observation"])
            log_prob = gaussian_log_prob(mb["action"], loc, log_std)
            with metric_only():
                entropy = gaussian_entropy(log_std, loc.shape[:-1])
        return ppo_loss(
            log_prob, mb["sample_log_prob"], mb["advantage"], value, mb["value_target"],
            entropy=entropy, old_state_value=mb["state_value"],
            clip_epsilon=clip_epsilon, value_clip_epsilon=config.value_clip_epsilon,
            entropy_coef=config.entropy_coef, value_coef=config.value_coef,
            normalize_advantages=config.normalize_advantages and W == 1,  # data parallel: normalised over the global minibatch
            sample_weight=mb.get("sample_weight", None), check=check,
            poolable=W > 1,  # data parallel: the minibatch's explained variance from the shares' parts
        )

    def member_log_prob_and_value(params: TensorDict, obs: Tensor, action: Tensor) -> tuple[Tensor, Tensor]:
        """(log pi(action | obs), V(obs)), each [*B, 1], of one member in one pass, as member_loss
        computes them (obs normalised)."""
        if discrete:
            logits = sequential_apply(net.actor, params["actor"], obs)
            return categorical_log_prob(logits, action, nvec=nvec), sequential_apply(net.critic, params["critic"], obs)
        loc, log_std, value, latent = actor_critic_apply(net, params, obs)
        if gsde:
            return sde_log_prob(action, loc, latent, log_std), value
        return gaussian_log_prob(action, loc, log_std), value

    def member_values(params: TensorDict, obs: Tensor) -> Tensor:
        return sequential_apply(net.critic, params["critic"], obs)

    def check_batch(batch) -> None:
        """ShapeError naming the entry of a batch that is not the [S, N/W, T] rollout this config
        collects (the bug: a batch of other T trained on part of it, silently; others were deep errors)."""
        want = (S, N // W, config.num_steps)
        if not isinstance(batch, TensorDictBase):
            raise ShapeError(f"ppo.iteration: batch is a {type(batch).__name__}, expected a TensorDict of batch size {list(want)}")
        if tuple(batch.batch_size) != want:
            raise ShapeError(f"ppo.iteration: batch of batch size {list(batch.batch_size)}, expected {list(want)} "
                             f"(seeds, num_envs{' / ranks' if W > 1 else ''}, num_steps)")
        act = (*want, *action_tail)
        entries = {"observation": ((*want, spec.obs_dim), "float"), ("next", "observation"): ((*want, spec.obs_dim), "float"),
                   "action": (act, "int" if discrete else "float"), ("next", "reward"): ((*want, 1), "float"),
                   ("next", "done"): ((*want, 1), "bool"), ("next", "terminated"): ((*want, 1), "bool")}
        for key, (shape, kind) in entries.items():
            x = batch.get(key, None)
            if x is None:
                raise ShapeError(f"ppo.iteration: batch has no {key!r} (TorchRL's keys: observation, action, ('next', "
                                 "'observation'), ('next', 'reward'), ('next', 'done'), ('next', 'terminated'))")
            if tuple(x.shape) != shape:
                raise ShapeError(f"ppo.iteration: batch {key!r} has shape {list(x.shape)}, expected {list(shape)}")
            ok = {"float": x.dtype == torch.float32, "int": x.dtype == torch.int64, "bool": x.dtype == torch.bool}[kind]
            if not ok:
                expected = {"float": "torch.float32", "int": "torch.int64", "bool": "torch.bool"}[kind]
                raise ShapeError(f"ppo.iteration: batch {key!r} has dtype {x.dtype}, expected {expected}")

    def prepare(state: TensorDict, batch: TensorDict) -> tuple[TensorDict, TensorDict, Tensor]:
        """Normalise, scale rewards, compute values and GAE. batch [S, N, T] -> flat [S, N*T]."""
        obs_stats = state["obs_stats"]
        nrm = vmap(norm_obs)
        obs = nrm(obs_stats, batch["observation"])
        next_obs = nrm(obs_stats, batch["next", "observation"])
        reward = batch["next", "reward"]
        done = batch["next", "done"]
        finite = torch.stack(
            [
                batch["observation"].isfinite().flatten(1).all(1),
                batch["next", "observation"].isfinite().flatten(1).all(1),
                reward.isfinite().flatten(1).all(1),
            ]
        )  # [3, S]: observation, next observation, reward
        new = {}
        if config.normalize_rewards:
            discount = torch.full_like(reward, config.gamma)
            discount[:, :, 1:] *= (~done[:, :, :-1]).float()
            safe_reward = torch.where(reward.isfinite(), reward, torch.zeros_like(reward))
            initial = state["discounted_return"].narrow(1, rank * batch.batch_size[1], batch.batch_size[1])  # this rank's envs
            z = forward_discounted_sum(safe_reward, discount, initial=initial.unsqueeze(-2))
            new["return_stats"] = update_stats(state["return_stats"], z.flatten(1, -1))
            new["discounted_return"] = z[:, :, -1] * (~done[:, :, -1]).float()
            reward = vmap(scale_reward)(reward, new["return_stats"]).clamp(-config.reward_clip, config.reward_clip)
        with torch.no_grad():
            if "sample_log_prob" in batch.keys():
                behaviour_log_prob = batch["sample_log_prob"]
                value = vmap(member_values)(state["params"], obs)
            else:  # a rollout of policy(..., log_prob=False): the parameters that acted are these
                behaviour_log_prob, value = vmap(member_log_prob_and_value)(state["params"], obs, batch["action"])
            next_value = vmap(member_values)(state["params"], next_obs)
        advantage, value_target = generalized_advantage_estimate(
            config.gamma, config.lmbda, value, next_value, reward, done, batch["next", "terminated"]
        )
        flat = TensorDict(
            {
                "observation": obs, "action": batch["action"], "sample_log_prob": behaviour_log_prob,
                "advantage": advantage, "value_target": value_target, "state_value": value,
            },
            batch_size=batch.batch_size,
        ).flatten(1, 2)
        if config.normalize_observations:
            raw = batch["observation"].flatten(1, 2)
            new["obs_stats"] = update_stats(obs_stats, raw)
        return flat, TensorDict(new, batch_size=[]), finite

    def iteration(state: TensorDict, batch: TensorDict, generators: list[torch.Generator],
                  frozen: Collection[int] = ()) -> tuple[TensorDict, TensorDict]:
        """One PPO update on ``batch`` ([S, N, T] TorchRL keys) at the learning rate
        ``linear_lr(lr, state["iteration"], num_iterations, anneal_lr)``. Returns the new state and
        per-seed metrics [S].

        The parameters and Adam's moments are stepped in place (``state`` and the new state share
        them, as with torch.optim). ``frozen`` (a freeze mask: indices into ``func.leaves(params)``,
        rlfunc.run.ppo's freeze tracker) leaves those leaves out of the gradients and of the update
        chain, so neither they nor their moments or step counts move (the chain's links step only the
        leaves they are given, optax's ``masked``). A seed whose data,
        loss or gradients are not finite, or that stopped early (``target_kl``), is skipped by
        adam's ``mask``: its parameters and moments stay bit for bit.

        Raises:
            ShapeError: ``batch`` is not the [S, N/W, num_steps] rollout of this config (a key missing,
                or of another shape or dtype: float32 observations and rewards, bool done flags, float32
                or, for discrete actions, int64 actions), or ``generators`` not one per seed."""
        check_batch(batch)
        if len(generators) != S:
            raise ShapeError(f"ppo.iteration: {len(generators)} generators, expected one per seed ({S})")
        flat, new_stats, finite = prepare(state, batch)
        comm_s = 0.0  # seconds in the collectives below (gloo: exact; nccl/hccl: until queued)
        if W > 1:  # the global batch, rank order = the single process's env order
            t0 = time.perf_counter()
            with span("all_gather"):
                flat = dist.all_gather_batch(flat, dim=1)
                finite, new_return = parallel.gather_env_rows(dist, finite, new_stats.get("discounted_return", None))
            comm_s += time.perf_counter() - t0
            if new_return is not None:
                new_stats["discounted_return"] = new_return
        data_ok = finite.all(0)  # [S]
        params = state["params"]
        keys = sorted(params.keys(include_nested=True, leaves_only=True), key=str)  # func.leaves order
        frozen_keys = {keys[k] for k in frozen}
        trainable = [k for k in keys if k not in frozen_keys]
        frozen_names = {shaped.flat_name(k) for k in frozen_keys}
        leaves = [params.get(k) for k in trainable]
        flat_leaves, treedef = flatten(params if len(trainable) == len(keys) else params.select(*trainable))
        if any(a is not b for a, b in zip(flat_leaves, leaves)):  # both are func.leaves' order
            raise ShapeError("ppo: rlfunc.optim.flatten orders the parameter leaves unlike rlfunc.core.func.leaves")
        lr = linear_lr(config.lr, int(state["iteration"]), config.num_iterations, config.anneal_lr)
        optim_state = state["optim"]
        traced = compiled_step is not None or compiled_grads is not None
        lr_tensor = torch.tensor(lr, dtype=torch.float32, device=device) if traced else None
        detached = [p.detach() for p in leaves]  # the compiled step writes them in place (views of the params)
        adam_leaves = tuple(leaves_at_each([optim_state["1", k] for k in ("step", "exp_avg", "exp_avg_sq")], treedef, "ppo")) \
            if traced else None
        B = flat.batch_size[1]
        num_mb = B // config.minibatch_size
        share = config.minibatch_size // W  # this rank's samples of each minibatch
        rows = torch.arange(S, device=device).unsqueeze(1)
        metric_sum, updates = None, 0
        skipped = torch.zeros(S, 3, dtype=torch.int64, device=device)  # data, loss, gradient
        active = torch.ones(S, dtype=torch.bool, device=device)  # seeds still updating (target_kl)
        # several seeds under target_kl: a seed's metrics and update count are of the steps it took (the others'
        # went on after it stopped); None: every seed takes every step
        seed_updates = torch.zeros(S, dtype=torch.int64, device=device) if config.target_kl is not None and S > 1 else None
        # gradient shaping (rlfunc.algos.shaped; all off by default)
        clip_epsilon = shaped.clip_epsilon(config, config.clip_epsilon, state["iteration"])
        names, probs = shaped.trainable(params, frozen_names)[0], None
        if config.adaptive_clip or config.prioritized_minibatches:
            log_prob_grads = shaped.stacked_per_sample_grads(
                sample_log_prob, params, flat["observation"], flat["action"], device=device, use_loop=use_loop, frozen=frozen_names
            )
            optim_state = shaped.begin_update(config, optim_state, params, log_prob_grads, clip_epsilon)
            if config.prioritized_minibatches:
                probs, weights = minibatch_priorities(params, flat, log_prob_grads, data_ok, frozen_names)
        loss_fn = vmap(member_loss, in_dims=(0, 0, None)) if config.adaptive_clip else vmap(member_loss)
        loss_args = (clip_epsilon,) if config.adaptive_clip else ()
        # one seed, one process, no shaping (the defaults): the loss on the member's squeezed tensors in plain
        # dicts, not through vmap's loop over TensorDicts (their indexing and rebuilding was ~1/4 of a small
        # MLP's eager step: bench/RESULTS.md "PPO's eager step, one seed"); the same ops, the same numbers
        single = S == 1 and W == 1 and not traced and transform is None and not config.adaptive_clip and probs is None
        if single:
            param_paths = [k if isinstance(k, tuple) else (k,) for k in keys]
            param_leaves = [params.get(k) for k in keys]  # stepped in place: the same tensors all iteration
            columns = {k: v[0] for k, v in flat.items()}
        metric_keys = None
        for _ in range(config.num_epochs):
            if seed_updates is not None:  # a seed stopped by target_kl draws no more (as alone): no shuffle, no priorities
                still, rest = active.tolist(), torch.arange(B, device=device)
                perm = torch.stack([rest if not on else torch.randperm(B, generator=g, device=device) if probs is None
                                    else torch.multinomial(probs[i], B, replacement=True, generator=g)  # as sample_prioritized
                                    for i, (g, on) in enumerate(zip(generators, still))])
            elif probs is None:
                perm = torch.stack([torch.randperm(B, generator=g, device=device) for g in generators])
            else:  # B draws with replacement by priority
                perm = sample_prioritized(probs, B, generators)
            # one gather per epoch; minibatches are then slices (data parallel: of this rank's share)
            if single:
                shuffled = {k: v[perm[0]] for k, v in columns.items()}
            else:
                shuffled = flat[rows, perm if W == 1 else parallel.local_share(perm, config.minibatch_size, rank, W)]
            if probs is not None:
                shuffled["sample_weight"] = weights.gather(1, perm).unsqueeze(-1)
            for k in range(num_mb):
                if single:
                    mb = shuffled if num_mb == 1 else {key: v[k * share : (k + 1) * share] for key, v in shuffled.items()}
                else:
                    mb = shuffled if num_mb == 1 and W == 1 else shuffled[:, k * share : (k + 1) * share]
                if W > 1 and config.normalize_advantages:
                    mb["advantage"] = parallel.normalized_share(
                        vmap(normalize_advantage), flat["advantage"], rows,
                        perm[:, k * config.minibatch_size : (k + 1) * config.minibatch_size], rank, W)
                if traced:
                    mb_tensors = {k: mb.get(k) for k in ("observation", "action", "sample_log_prob", "advantage", "value_target", "state_value")}
                    if compiled_step is not None:
                        loss, metrics, norms = compiled_step(detached, treedef, adam_leaves, mb_tensors, lr_tensor, data_ok & active)
                        metrics = TensorDict(metrics, batch_size=[S])
                    else:  # data parallel: the gradients, the loss and the metrics averaged between the two graphs
                        grads, loss, metrics = compiled_grads(detached, treedef, mb_tensors)
                        t0 = time.perf_counter()
                        with span("all_reduce"):
                            grads, loss, metrics = data_parallel.average(reduce, grads, treedef, loss, TensorDict(metrics, batch_size=[S]),
                                                                         maxima=EV_MAXIMA, moments=EV_MOMENTS, rank=rank, world_size=W)
                            metrics = pool_explained_variance(metrics)
                        comm_s += time.perf_counter() - t0
                        norms = compiled_apply(detached, treedef, adam_leaves, grads, loss, lr_tensor, data_ok & active)
                    optim_state = TensorDict({"0": {"norm": norms}, "1": optim_state["1"]}, batch_size=[])
                    skipped += (torch.stack([~data_ok, data_ok & ~loss.isfinite(), data_ok & loss.isfinite() & ~norms.isfinite()], 1)
                                & active[:, None]).long()
                else:
                    if single:  # loss 0-dim, metrics of 0-dim values
                        member = _nested(param_paths, [p.squeeze(0) for p in param_leaves])
                        loss, metrics = member_loss(member, mb, check=updates == 0)
                    else:
                        loss, metrics = loss_fn(params, mb, *loss_args, check=updates == 0)
                    for p in leaves:
                        p.grad = None
                    with_curvature = transform is not None and shaped.curvature_due(config, optim_state)
                    graph_grads = shaped.gradients(loss.sum(), leaves, with_curvature)
                    if with_curvature and seed_updates is not None and not bool(active.all()):
                        # a seed stopped by target_kl draws no probes either (as alone); its curvature is masked out
                        probe_generators = [g if on else torch.Generator(device).manual_seed(0) for g, on in zip(generators, active.tolist())]
                    else:
                        probe_generators = generators
                    curvature = shaped.curvature(graph_grads, leaves, names, probe_generators) if with_curvature else None
                    del graph_grads
                    grads = [p.grad for p in leaves]
                    if W > 1:  # all_reduce_mean, with the loss and metrics in its buffer: every rank decides alike
                        t0 = time.perf_counter()
                        with span("all_reduce"):
                            grads, loss, metrics = data_parallel.average(reduce, grads, treedef, loss, metrics, maxima=EV_MAXIMA,
                                                                         moments=EV_MOMENTS, rank=rank, world_size=W)
                            metrics = pool_explained_variance(metrics)
                        comm_s += time.perf_counter() - t0
                    norms = member_grad_norms(grads, stacked=True)  # non-finite iff some gradient is
                    ok = data_ok & loss.isfinite() & norms.isfinite()
                    if not bool(ok.all()):
                        loss_ok = loss.isfinite()
                        skipped += (torch.stack([~data_ok, data_ok & ~loss_ok, data_ok & loss_ok & ~norms.isfinite()], 1)
                                    & active[:, None]).long()  # a seed stopped by target_kl skips no step
                        for g in grads:
                            g.nan_to_num_(0.0, 0.0, 0.0)
                    # the chain over the leaf lists (rlfunc.optim.base): no TensorDict per step
                    delta, optim_state = optimizer.update_leaves(grads, treedef, optim_state, params, lr=lr, mask=ok & active,
                                                                 grad_norm=norms, curvature=curvature)
                    with torch.no_grad():  # rlfunc.optim.apply_updates over the leaves
                        torch._foreach_add_(leaves, delta)
                    if transform is not None:
                        for key, value in shaped.metrics_of(optim_state).items():
                            metrics[key] = value
                    if config.adaptive_clip:
                        metrics["clip_epsilon"] = torch.full((S,), clip_epsilon, device=device)
                # the metrics summed as one stacked tensor [K(, S)]: one op per step
                values = torch.stack([*metrics.values(), norms.squeeze(0) if single else norms])
                if seed_updates is not None:  # [K, S]: the seeds that took this step
                    values = torch.where(active, values, 0.0)
                    seed_updates += active
                if metric_keys is None:
                    metric_keys, metric_sum = [*metrics.keys(), "grad_norm"], values
                else:
                    metric_sum += values
                updates += 1
                if config.target_kl is not None:
                    active = active & ~(metrics["approx_kl"] > config.target_kl)
                    if not bool(active.any()):
                        break
            if not bool(active.any()):
                break
        out = state.clone(recurse=False)
        for key, value in new_stats.items():
            out[key] = value
        out["optim"] = optim_state
        out["iteration"] = state["iteration"] + 1
        out["env_steps"] = state["env_steps"] + batch.batch_size[1] * batch.batch_size[2] * W
        out["rng"] = torch.stack([g.get_state() for g in generators]).to(device)
        means = (metric_sum / (updates if seed_updates is None else seed_updates)).unbind(0)
        metrics = TensorDict({k: v.unsqueeze(0) if single else v for k, v in zip(metric_keys, means)}, batch_size=[S])
        metrics["skipped_data"] = skipped[:, 0]
        metrics["skipped_loss"] = skipped[:, 1]
        metrics["skipped_gradient"] = skipped[:, 2]
        metrics["updates"] = torch.full((S,), updates, device=device) if seed_updates is None else seed_updates
        if W > 1:
            metrics["allreduce_s"] = torch.full((S,), comm_s, device=device)
        compile_s = [f.compile_s for f in (compiled_step, compiled_grads, compiled_apply, compiled_actor)
                     if f is not None and f.compile_s is not None]
        if compile_s and int(state["iteration"]) == 0:
            metrics["compile_s"] = torch.full((S,), sum(compile_s), device=device)  # the first iteration's metrics line
        metrics["value_target_mean"] = flat["value_target"].mean((1, 2))
        return out, metrics

    return PPO(init, iteration, policy, net)


def _nested(paths: list[tuple], tensors: list[Tensor]) -> dict:
    """Nested dicts holding ``tensors`` at ``paths`` (("actor", "0", "weight"), ...): a parameter tree
    without TensorDict's per-lookup cost."""
    out: dict = {}
    for path, tensor in zip(paths, tensors):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tensor
    return out


register("ppo", AlgorithmEntry(
    config="rlfunc.algos.ppo:PPOConfig", run="rlfunc.run.ppo:PPORun", command="rlfunc.cli.ppo:train", evaluate="rlfunc.cli.ppo:evaluate",
    unit="env steps per seed", needs="box-actions",  # gymnasium vector envs, Box observations; Box (Gaussian), Discrete or MultiDiscrete (categorical) actions
    usage="    rlfunc train ppo --env ENV_ID [--total-steps N] [--seed S] [--num-seeds N] [--device auto] [--run-dir DIR] [...]",
))

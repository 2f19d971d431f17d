"""Gaussian PPO on Dict observations (cameras, proprio, instruction) through a shared multimodal encoder.

The actor and the critic share one :class:`rlfunc.nets.encoders.MultimodalEncoder` trunk (ResNet-GN
per camera or shared, attention pooling, proprio MLP on running-normalised inputs, text, fusion
transformer); its CLS feature feeds two MLP heads, the action mean mu(s) and V(s), and the action
std is a state-independent parameter sigma = exp(log_std). Everything trains end to end on the PPO
loss :func:`rlfunc.losses.ppo.ppo_loss` (clipped surrogate + value + entropy terms).

Actions live in [-1, 1] (:class:`rlfunc.envs.chunk.GymChunkEnv` with ``act_steps=1`` scales them to
the env's bounds and clips); the Gaussian is unbounded and its log-probability is that of the
unclipped sample, as in Schulman et al.'s PPO and SB3.

Collection (:func:`PPOEncoder.rollout`): the envs keep running across iterations, a carry TensorDict
holding the next observation; each step's observations reach the device once (uint8 images are
converted to float only inside the encoder), the rollout is stacked there into one [N, T] batch.
V(s_t) is computed with the action (one encoder pass per step); the bootstrap V(s_{t+1}) is V of the
next step's observation except after the last step and at episode ends, where the true final
observation is encoded (so time-limit truncation bootstraps from it, as in ``rlfunc.core.returns``).

``--compile on`` (``auto``: float32 runs of >= :data:`AUTO_COMPILE_UPDATES` gradient steps; none at
present, as it was not reliably faster on a CPU) runs a minibatch's step (advantage normalisation,
the encoder and heads over its micro-batches, torch.func.grad, clip and Adam) as one torch.compile
graph, within float rounding of the eager step.

Data-parallel (``make_ppo_encoder(..., dist)``, ``rlfunc train ppo --env ENV --nproc W``): each rank
steps N/W of the envs and the update is the single process's to float rounding (see
:func:`make_ppo_encoder`; :mod:`rlfunc.algos.data_parallel`).

Reference: Schulman et al. (2017) "Proximal Policy Optimization Algorithms" (eq. 7, 9); GAE:
Schulman et al. (2016) eq. 16; normalisation details: Huang et al. (2022) "The 37 Implementation
Details of PPO".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn

from rlfunc.algos import data_parallel
from rlfunc.algos.diffusion_actor import EnvInfo, check_split, encoder_config, require_finite
from rlfunc.algos.ppo import check_init_log_std
from rlfunc.algos.registry import AlgorithmEntry, register
from rlfunc.config import RunConfig, check_env_workers, check_fields, require_default
from rlfunc.core import func
from rlfunc.core.distributions import gaussian_entropy, gaussian_log_prob
from rlfunc.core.normalize import init_running_stats, scale_reward, update_running_stats
from rlfunc.core.returns import forward_discounted_sum, generalized_advantage_estimate
from rlfunc.errors import ConfigError, EnvError
from rlfunc.losses.ppo import EV_MAXIMA, EV_MOMENTS, normalize_advantage, pool_explained_variance, ppo_loss
from rlfunc.nets.mlp import MLP, seeded_init
from rlfunc.device import compile_step
from rlfunc.optim import (GradientTransform, adam, all_reduce_mean, chain, clip_by_global_norm, flatten, linear_lr, minibatch_epochs,
                          unflatten)
from rlfunc.optim.amp import Precision, accumulate_gradients, loss_scale_of, merge_metrics, transform_step, with_loss_scale
from rlfunc.optim.leaves import chain_state, chain_step, leaf_list

ALGO = "ppo-encoder"  # the "algo" of this algorithm's snapshots

# --compile auto compiles a run of at least this many gradient steps; None: auto never compiles. On this 2-core
# CPU under load (bench/compiled_bc_encoder.py, a small encoder on Push-v0's observation, minibatches of 64) the
# compiled step was not reliably faster: 0.70x eager in one measurement (rounds 0.24-1.04), 1.19x in the next
# (rounds 0.27-1.77), its first call 376 s cold; so auto keeps ppo-encoder eager until a measurement (a GPU's)
# shows a gain (bench/RESULTS.md, "Compiled bc and ppo-encoder updates")
AUTO_COMPILE_UPDATES: int | None = None


@dataclass(frozen=True)
class PPOEncoderConfig:
    """Every hyperparameter of encoder PPO, with its default. Steps are env steps."""

    env: str = "Push-v0"  # gymnasium id with a Dict observation (RGB uint8 cameras, "proprio", "instruction")
    total_steps: int = 100_000  # env steps (rounded up to whole iterations of the batch)
    num_envs: int = 8  # parallel envs (gymnasium, stepped on the host)
    num_steps: int = 128  # steps per env per rollout; batch = num_envs * num_steps
    num_epochs: int = 4  # passes over each batch
    minibatch_size: int = 256  # samples per gradient step; must divide the batch
    micro_batch_size: int | None = None  # samples per backward pass inside a minibatch (gradient accumulation; None: one pass)
    lr: float = 3e-4  # Adam learning rate (encoder and heads)
    anneal_lr: bool = True  # linear decay of lr to 0 over the run
    adam_eps: float = 1e-5  # Adam epsilon
    gamma: float = 0.99  # discount per env step, in [0, 1]
    lmbda: float = 0.95  # GAE lambda, in [0, 1]
    clip_epsilon: float = 0.2  # surrogate clip range
    value_clip_epsilon: float | None = None  # clip range of V around its old value (None: off)
    entropy_coef: float = 0.0  # entropy bonus weight
    value_coef: float = 0.5  # value loss weight
    max_grad_norm: float = 0.5  # global grad-norm clip
    target_kl: float | None = None  # stop an iteration's epochs once the minibatch approx KL exceeds it (None: off)
    normalize_advantages: bool = True  # per minibatch (before any micro-batch split)
    normalize_rewards: bool = True  # divide by the running std of the discounted return
    reward_clip: float = 10.0  # after scaling
    hidden: tuple[int, ...] = (256,)  # widths of the actor and critic head MLPs on the encoder feature
    activation: str = "tanh"  # tanh | relu | elu | silu (heads)
    init_log_std: float = -0.5  # initial log std of the actions, in [-1, 1] action units
    encoder_d_model: int = 128  # width of the encoder's tokens and CLS feature (a multiple of 4)
    encoder_widths: tuple[int, ...] = (32, 64, 128, 256)  # ResNet-GN stage channels (ResNet-18: 64 128 256 512)
    encoder_blocks: tuple[int, ...] = (1, 1, 1, 1)  # BasicBlocks per stage (ResNet-18: 2 2 2 2)
    freeze_vision: bool = False  # no gradient to the ResNet trunk (pools, proprio, text and fusion still train)
    checkpoint_vision: bool = False  # recompute the trunk's activations in backward (less memory, more compute)
    dependents: ClassVar[tuple] = (("normalize_rewards", lambda c: c.normalize_rewards, ("reward_clip",)),)  # rlfunc.config.check_dependents
    run: RunConfig = field(default_factory=lambda: RunConfig(torch_threads=0))  # seed (parameters, env resets, action/minibatch noise), device, precision (autocast of the networks, rlfunc.optim.amp), snapshots, final evaluation (deterministic actions) (rlfunc.config.RunConfig); torch's default threads

    def __post_init__(self) -> None:
        check_fields(self)
        require_finite(self)
        check_init_log_std(self.init_log_std)
        for name in ("hidden", "encoder_widths", "encoder_blocks"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("gamma", "lmbda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a value in [0, 1]")
        require_default(self.run, num_seeds="ppo-encoder trains one seed per run", vmap="ppo-encoder trains one seed per run",
                        log_every="ppo-encoder logs every iteration")
        for name in ("total_steps", "num_envs", "num_steps", "num_epochs", "minibatch_size"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a positive integer")
        if self.batch_size % self.minibatch_size:
            raise ConfigError(f"minibatch_size={self.minibatch_size} does not divide the batch num_envs*num_steps={self.batch_size}")
        check_env_workers(self.run, self.num_envs)
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size={self.micro_batch_size}: expected >= 1 or None")
        for name in ("lr", "clip_epsilon", "max_grad_norm", "reward_clip"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)}: expected > 0")
        if not 0 <= self.entropy_coef < math.inf or not 0 <= self.value_coef < math.inf:  # nan/inf: every step skipped
            raise ConfigError(f"entropy_coef={self.entropy_coef}, value_coef={self.value_coef}: expected finite values >= 0")
        for name in ("target_kl", "value_clip_epsilon"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name}={value}: expected a finite value > 0 or None")
        if not (self.adam_eps >= 0 and math.isfinite(self.adam_eps)):
            raise ConfigError(f"adam_eps={self.adam_eps}: expected a finite value >= 0")
        if not self.hidden or any(h < 1 for h in self.hidden):
            raise ConfigError(f"hidden={self.hidden}: expected at least one width, every width positive")
        if self.activation not in ("tanh", "relu", "elu", "silu"):
            raise ConfigError(f"activation={self.activation!r}: expected tanh, relu, elu or silu")
        if self.encoder_d_model < 4 or self.encoder_d_model % 4:
            raise ConfigError(f"encoder_d_model={self.encoder_d_model}: expected a positive multiple of 4")
        if not self.encoder_widths or len(self.encoder_widths) != len(self.encoder_blocks) or min(*self.encoder_widths, *self.encoder_blocks) < 1:
            raise ConfigError(f"encoder_widths={self.encoder_widths}, encoder_blocks={self.encoder_blocks}: "
                              "expected positive ints, one block count per stage")
        # data-parallel (before torchrun starts the ranks): each rank steps num_envs / nproc envs of a split GymChunkEnv
        # and takes minibatch_size / nproc samples of every minibatch
        if self.run.nproc > 1 and self.run.compile == "on":
            raise ConfigError(f"run.compile='on' with nproc={self.run.nproc}: ppo-encoder's compiled step is single-process; "
                              "expected --compile off or auto with --nproc")
        data_parallel.check_divides(self.run.nproc, num_envs=self.num_envs, minibatch_size=self.minibatch_size)
        check_split(self.env, self.run.nproc, self.num_envs, self.run.env_workers, gymnasium_split=True)
        if self.run.compile == "on" and not self.compilable:
            raise ConfigError(f"run.compile='on': ppo-encoder compiles its float32 gradient step; expected run.precision='off' and "
                              f"checkpoint_vision=False with it (got precision={self.run.precision!r}, checkpoint_vision="
                              f"{self.checkpoint_vision}; or --compile off)")

    @property
    def compilable(self) -> bool:
        """Whether the gradient step can run compiled: float32 (no autocast or loss scaling), no
        checkpointed vision trunk."""
        return self.run.precision == "off" and not self.checkpoint_vision

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_iterations(self) -> int:
        return max(1, math.ceil(self.total_steps / self.batch_size))


class EncoderActorCritic(nn.Module):
    """The skeleton: ``forward(observation, proprio_stats) -> (loc [*B, A], log_std [A], state_value [*B, 1])``.

    ``observation`` is a mapping of the encoder's keys (uint8 cameras [*B, H, W, 3], float "proprio"
    [*B, P], "instruction_tokens"/"instruction_padding_mask" [*B, L]). The actor head's last layer has
    gain 0.01, the critic's gain 1 (Huang et al. 2022, detail 2); the heads run in float32.
    """

    def __init__(self, config: PPOEncoderConfig, info: EnvInfo) -> None:
        super().__init__()
        from rlfunc.nets.encoders import MultimodalEncoder

        # encoder_config reads the encoder_* / freeze_vision / checkpoint_vision fields, which
        # PPOEncoderConfig names as the diffusion actor's ActorSpec does
        self.encoder = MultimodalEncoder(encoder_config(config, info))
        d = config.encoder_d_model
        self.actor = MLP(d, info.act_dim, config.hidden, config.activation, out_gain=0.01)
        self.critic = MLP(d, 1, config.hidden, config.activation, out_gain=1.0)
        self.log_std = nn.Parameter(torch.full((info.act_dim,), float(config.init_log_std)))

    def forward(self, observation, proprio_stats: TensorDict | None = None) -> tuple[Tensor, Tensor, Tensor]:
        feature = self.encoder(observation, proprio_stats).float()
        return self.actor(feature), self.log_std, self.critic(feature)


class PPOEncoder(NamedTuple):
    """The algorithm's pure pieces (see :func:`make_ppo_encoder`)."""

    init: Callable[[], TensorDict]
    policy: Callable[..., Callable[[TensorDictBase], TensorDictBase]]
    rollout: Callable[..., tuple[TensorDict, TensorDict]]
    loss: Callable[..., tuple[Tensor, TensorDict]]
    iteration: Callable[..., tuple[TensorDict, TensorDict]]
    trainable: Callable[[TensorDict], list[Tensor]]
    net: EncoderActorCritic
    info: EnvInfo
    optimizer: GradientTransform  # the update chain whose state is state["optim"]
    trainable_params: Callable[[TensorDict], TensorDict]


def check_dict_info(info: EnvInfo, env_id: str) -> None:
    """EnvError unless ``info`` describes a Dict observation (what the encoder reads)."""
    if not info.is_dict:
        raise EnvError(
            f"env={env_id!r} has a Box observation of {info.obs_dim} numbers: ppo with a multimodal encoder needs "
            "a Dict observation (RGB uint8 cameras, 'proprio', 'instruction'); train a Box env with the flat-observation "
            "PPO (`rlfunc train ppo --env ENV` dispatches on the observation space)"
        )


def make_ppo_encoder(config: PPOEncoderConfig, info: EnvInfo, device: torch.device, prec: Precision | None = None,
                     dist=None) -> PPOEncoder:
    """Build encoder PPO for an env described by ``info`` (:func:`rlfunc.algos.diffusion_actor.env_info`).

    ``dist``: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run of W
    ranks. Rank r then steps envs r*N/W .. (r+1)*N/W - 1 of the ``config.num_envs`` = N (a split
    :class:`~rlfunc.envs.chunk.GymChunkEnv`; its rollout is [N/W, T]) and ``iteration`` equals the
    single-process one on all N envs, to float rounding (:mod:`rlfunc.algos.data_parallel`):

    - the policy draws the action noise of all N envs from the generator and keeps its rows
      (:func:`~rlfunc.algos.data_parallel.own_rows`), so the actions are the single process's and the
      generators stay in sync;
    - ``prepare`` runs on the rank's envs (bootstrap values, GAE) with the rows of
      ``state["discounted_return"]`` [N, 1] it owns; the discounted returns [N/W, T] and the episode
      flags are all-gathered first, so the return statistics (and the reward scale) are those of the
      whole [N, T] batch, computed in one pass as the single process does;
    - the flat batch [N/W * T] is all-gathered into the single process's [N * T] (rank order = env
      order). That is every observation: uint8 images [T, H, W, 3] per camera and env, (W - 1) / W of
      the batch's bytes per rank, a large share of an iteration for big cameras; the proprio
      statistics are then updated on the gathered batch, exactly as one process does;
    - every rank draws the same minibatch order, normalises the advantages over the whole minibatch,
      takes its share of it (m / W samples, micro-batched as configured) and backpropagates; one
      ``all_reduce_mean`` of the gradients, the loss and the metrics
      (:func:`~rlfunc.algos.data_parallel.average_grads_`) precedes the clip and Adam, so
      ``target_kl`` and fp16's loss scale (the averaged gradients' finiteness) decide alike on every
      rank. The compiled step is single-process (``--compile auto`` runs eager with W > 1). Metrics
      that are not means over the samples come back as the mean of the ranks' shares' values.

    The learner state is one TensorDict on ``device``: "params" {"encoder", "actor", "critic",
    "log_std" [A]}, "return_stats" (running statistics of the discounted return, sample shape []),
    "discounted_return" [N, 1], "rng" (uint8 state of the CPU/device generator), "iteration" and
    "env_steps" (0-dim int64), "proprio_stats" ([P] running statistics) when the env has proprio, and
    "optim", the state of the update chain ``chain(clip_by_global_norm(max_grad_norm), adam(lr,
    eps=adam_eps))`` over the :func:`trainable` leaves: "0" {"norm": [1], the last pre-clip gradient
    norm}, "1" {"step", "exp_avg", "exp_avg_sq"}, Adam's per-leaf step counts (0-dim float32) and
    moments (like the trainable part of "params"; the ResNet trunk is left out with ``freeze_vision``).

    Raises:
        EnvError: ``info`` is not a Dict observation.
    """
    check_dict_info(info, config.env)
    net = EncoderActorCritic(config, info).to(device)
    keys = info.obs_keys
    has_stats = info.stats_key == "proprio"
    N, T = config.num_envs, config.num_steps
    W, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)
    own = data_parallel.own_rows(rank, W)  # the noise of all N envs drawn, this rank's rows kept
    reduce = all_reduce_mean(None if dist is None else dist.group)  # data parallel: ahead of the chain (stateless)
    gather = (lambda td: td) if W == 1 else (lambda td: dist.all_gather_batch(td, dim=0))  # [N/W, ...] -> [N, ...]
    autocast = prec.autocast if prec is not None else (lambda: torch.autocast(device.type, enabled=False))
    optimizer = with_loss_scale(chain(clip_by_global_norm(config.max_grad_norm, stacked=False), adam(config.lr, eps=config.adam_eps)), prec)

    def init() -> TensorDict:
        params = func.params_from_module(seeded_init(lambda: EncoderActorCritic(config, info), config.run.seed).to(device))
        state = TensorDict(
            {
                "params": params,
                "return_stats": init_running_stats((), device=device),
                "discounted_return": torch.zeros(N, 1, device=device),
                "rng": torch.Generator(device=device).manual_seed(config.run.seed).get_state(),
                "iteration": torch.zeros((), dtype=torch.int64, device=device),
                "env_steps": torch.zeros((), dtype=torch.int64, device=device),
            },
            batch_size=[],
            device=device,
        )
        if has_stats:
            state["proprio_stats"] = init_running_stats((info.stats_dim,), device=device)
        state["optim"] = optimizer.init(trainable_params(params))
        return state

    def trainable_params(params: TensorDict) -> TensorDict:
        """The part of ``params`` the optimizer steps, the same tensors (the ResNet trunk is left out with
        ``freeze_vision``, buffers always)."""
        frozen = [("encoder", *k) for k in net.encoder.frozen_keys]
        part = params.exclude(*frozen) if frozen else params
        return part.select(*[k for k in part.keys(include_nested=True, leaves_only=True) if part.get(k).requires_grad])

    def trainable(params: TensorDict) -> list[Tensor]:
        """The leaves the optimizer steps, in :func:`rlfunc.core.func.leaves` order (those of :func:`trainable_params`)."""
        return func.leaves(trainable_params(params))

    def forward(params: TensorDict, stats: TensorDict | None, td: TensorDictBase) -> tuple[Tensor, Tensor, Tensor]:
        return func.apply(net, params, {k: td[k] for k in keys}, stats)

    def policy(state: TensorDict, generator: torch.Generator | None, deterministic: bool = False):
        """td [N] with the observation keys -> td with "action" [N, A] (mu + sigma eps, or mu when
        ``deterministic``), "sample_log_prob" [N, 1] (log N(a; mu, sigma^2), from eps directly) and
        "state_value" [N, 1]. Noise comes from ``generator`` (on ``device``)."""
        params, stats = state["params"], state.get("proprio_stats", None)
        half_log_2pi = 0.5 * math.log(2.0 * math.pi)

        def act(td: TensorDictBase) -> TensorDictBase:
            with torch.no_grad():
                with autocast():
                    loc, log_std, value = forward(params, stats, td)
                loc, log_std, value = loc.float(), log_std.float(), value.float()
                return sample(td, loc, log_std, value)

        def sample(td: TensorDictBase, loc: Tensor, log_std: Tensor, value: Tensor) -> TensorDictBase:
            if deterministic:
                td["action"], td["sample_log_prob"] = loc, torch.zeros_like(value)
            else:
                noise = own(lambda k: torch.randn((k, *loc.shape[1:]), generator=generator, device=loc.device), loc.shape[0], 0)
                td["action"] = loc + log_std.exp() * noise
                td["sample_log_prob"] = (-0.5 * noise.square() - log_std - half_log_2pi).sum(-1, keepdim=True)
            td["state_value"] = value
            return td

        return act

    def rollout(state: TensorDict, env, carry: TensorDictBase, generator: torch.Generator) -> tuple[TensorDict, TensorDictBase]:
        """``num_steps`` steps of ``env`` (a TorchRL env of N Dict-observation envs, e.g. GymChunkEnv
        with act_steps=1) from ``carry`` (its last root TensorDict, from ``env.reset()`` at the start).
        Envs that end are reset in place (``step_and_maybe_reset``). Returns (batch [N, T] on the
        env's device: observation keys, "action", "sample_log_prob", "state_value" and "next" with the
        TorchRL step keys; the new carry)."""
        act = policy(state, generator)
        kept = [*keys, "action", "sample_log_prob", "state_value", "next"]
        steps, td = [], carry
        for _ in range(T):
            out, td = env.step_and_maybe_reset(act(td))
            steps.append(out.select(*kept))
        return torch.stack(steps, dim=1), td.select(*keys, "done", "terminated", "truncated", strict=False)

    def values(params: TensorDict, stats: TensorDict | None, td: TensorDictBase) -> Tensor:
        chunk = config.minibatch_size
        with torch.no_grad(), autocast():
            out = [forward(params, stats, td[i : i + chunk])[2].float() for i in range(0, td.batch_size[0], chunk)]
        return torch.cat(out) if out else torch.zeros(0, 1, device=device)

    def loss(params: TensorDict, stats: TensorDict | None, mb: TensorDictBase) -> tuple[Tensor, TensorDict]:
        """PPO loss of minibatch ``mb`` [M] (observation keys, "action" [M, A], "sample_log_prob",
        "advantage" (already normalised when the config says so), "value_target", "state_value"
        [M, 1]): :func:`ppo_loss` with log pi(a|s) = log N(a; mu(s), sigma^2) and the Gaussian entropy."""
        loc, log_std, value = forward(params, stats, mb)
        log_prob = gaussian_log_prob(mb["action"], loc.float(), log_std.float())
        entropy = gaussian_entropy(log_std.float(), loc.shape[:-1])
        return ppo_loss(
            log_prob, mb["sample_log_prob"], mb["advantage"], value.float(), mb["value_target"],
            entropy=entropy, old_state_value=mb["state_value"], clip_epsilon=config.clip_epsilon,
            value_clip_epsilon=config.value_clip_epsilon, entropy_coef=config.entropy_coef,
            value_coef=config.value_coef, normalize_advantages=False,
            poolable=W > 1 or config.micro_batch_size is not None,  # the minibatch's explained variance from its parts'
        )

    def prepare(state: TensorDict, batch: TensorDict) -> tuple[TensorDict, dict, TensorDict]:
        """Rewards scaled, bootstrap values, GAE; batch [n, T] (n = N / W, the rank's envs) -> flat
        [n*T], the new return statistics and discounted returns, and every rank's episode flags
        ("done", "episode_return", "success" [N, T, 1]) for :func:`episode_metrics`."""
        params, stats = state["params"], state.get("proprio_stats", None)
        reward = batch["next", "reward"].float()
        done, terminated = batch["next", "done"], batch["next", "terminated"]
        n = batch.batch_size[0]
        rows = TensorDict({k: batch["next", k] for k in ("done", "episode_return", "success")}, batch_size=[n])
        new: dict = {}
        if config.normalize_rewards:
            discount = torch.full_like(reward, config.gamma)
            discount[:, 1:] *= (~done[:, :-1]).float()
            safe = torch.where(reward.isfinite(), reward, torch.zeros_like(reward))
            initial = state["discounted_return"].narrow(0, rank * n, n)  # [n, 1]: this rank's envs' rows
            z = forward_discounted_sum(safe, discount, initial=initial.unsqueeze(-2))
            rows["z"], rows["last"] = z, z[:, -1] * (~done[:, -1]).float()
        rows = gather(rows)  # [N, T]: one all_gather for the return statistics and the episode metrics
        if config.normalize_rewards:
            new["return_stats"] = update_running_stats(state["return_stats"], rows["z"].flatten())
            new["discounted_return"] = rows["last"]
            reward = scale_reward(reward, new["return_stats"]).clamp(-config.reward_clip, config.reward_clip)
        value = batch["state_value"]
        # V(s_{t+1}) is the next step's V(s) except after the last step and at episode ends (the
        # root of the next step is then a reset observation): encode the true next observation there
        next_value = torch.cat([value[:, 1:], torch.zeros_like(value[:, :1])], dim=1)
        need = done.squeeze(-1).clone()
        need[:, -1] = True
        where = need.nonzero(as_tuple=True)
        next_value[where] = values(params, stats, batch["next"][where].select(*keys))
        advantage, value_target = generalized_advantage_estimate(config.gamma, config.lmbda, value, next_value, reward, done, terminated)
        flat = TensorDict(
            {
                **{k: batch[k] for k in keys}, "action": batch["action"], "sample_log_prob": batch["sample_log_prob"],
                "state_value": value, "advantage": advantage, "value_target": value_target,
            },
            batch_size=batch.batch_size,
        ).flatten(0, 1)
        return flat, new, rows.select("done", "episode_return", "success")

    # --compile: one minibatch's gradient step as one pure function of flat leaf lists (the form
    # torch.compile takes whole), float32; micro-batches are unrolled inside it
    template = func.params_from_module(net)
    stepped_def = flatten(trainable_params(template))[1]
    frozen = [("encoder", *k) for k in net.encoder.frozen_keys]
    frozen_def = flatten(template.select(*frozen))[1] if frozen else None
    stats_def = flatten(init_running_stats((info.stats_dim,), device=device))[1] if has_stats else None
    mb_keys = (*keys, "action", "sample_log_prob", "advantage", "value_target", "state_value")
    M = config.minibatch_size
    micro = M if config.micro_batch_size is None else min(config.micro_batch_size, M)
    micro_slices = [(start, min(micro, M - start)) for start in range(0, M, micro)]

    def grad_step(w: list[Tensor], opt: tuple[list[Tensor], tuple], const: tuple[list[Tensor], list[Tensor]], mb: dict,
                  lr: Tensor) -> dict:
        """The minibatch ``mb``'s advantages normalised (``normalize_advantages``), the gradient of
        :func:`loss` (its micro-batches' gradients, each weighted by its share of the minibatch, summed
        in order: what :func:`accumulate_gradients` leaves in ``.grad``) by torch.func.grad, then
        ``optimizer``'s chain at ``lr`` (0-dim float32) in place on ``w`` (the :func:`trainable`
        leaves) and ``opt`` (its state's; rlfunc.optim.leaves.chain_step). ``const``: (the frozen
        trunk's leaves or [], the proprio statistics' leaves or []). Returns the loss metrics,
        "grad_norm" and "skipped" (1.0 when the loss or the norm was not finite: nothing moved)."""
        frozen_w, stats_w = const
        stats = unflatten(stats_def, stats_w) if has_stats else None
        if config.normalize_advantages:
            mb = {**mb, "advantage": normalize_advantage(mb["advantage"])}
        grads, total, metrics = None, None, None
        for start, n in micro_slices:
            part = {k: v.narrow(0, start, n) for k, v in mb.items()}
            weight = n / M

            def objective(leaves, part=part, weight=weight):
                params = unflatten(stepped_def, leaves)
                if frozen_def is not None:
                    params = params.update(unflatten(frozen_def, frozen_w))
                value, m = loss(params, stats, part)
                scaled = value.float() * weight
                return scaled, (scaled.detach(), m.detach())

            g, (scaled, m) = torch.func.grad(objective, has_aux=True)(w)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            total = scaled if total is None else total + scaled
            metrics = merge_metrics(metrics, start / M, m, weight, maxima=EV_MAXIMA, moments=EV_MOMENTS)  # as accumulate_gradients
        out = metrics.to_dict()
        out["grad_norm"] = chain_step(optimizer, grads, w, stepped_def, opt, total, lr=lr)
        out["skipped"] = (~(out["grad_norm"].isfinite() & total.isfinite())).float()
        return out

    compiled = config.compilable and W == 1 and (config.run.compile == "on" or (
        config.run.compile == "auto" and AUTO_COMPILE_UPDATES is not None
        and config.num_iterations * config.num_epochs * (config.batch_size // M) >= AUTO_COMPILE_UPDATES))
    compiled_step = compile_step(grad_step, device, config.run.compile, ALGO, static_args=(0, 1, 2)) if compiled else None
    reported: list[bool] = []  # compile_s went into a metrics line already

    def iteration(state: TensorDict, batch: TensorDict, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
        """One PPO update on ``batch`` ([N, T] from :func:`rollout`): each minibatch's gradient through
        the update chain (clip, then Adam at ``linear_lr`` of ``state["iteration"]``), whose state
        ``state["optim"]`` it advances; the :func:`trainable` leaves of ``state["params"]`` are stepped
        in place (the policy holds them). Minibatch order comes from ``generator``.
        Returns the new state and metrics (0-dim tensors: the ppo_loss metrics averaged over the
        minibatches, grad_norm, updates, skipped, episode_return/success_rate of episodes that ended).
        Data-parallel: ``batch`` is the rank's [N/W, T] and the result every rank's (see :func:`make_ppo_encoder`)."""
        flat, new, episodes = prepare(state, batch)
        flat = gather(flat)  # the global batch [N*T], rank order = the single process's env order
        if has_stats:  # on the whole batch, in one pass: the single process's numbers
            new["proprio_stats"] = update_running_stats(state["proprio_stats"], flat["proprio"].float())
        params, stats = state["params"], state.get("proprio_stats", None)
        stepped = trainable_params(params)
        leaves = func.leaves(stepped)
        lr = linear_lr(config.lr, int(state["iteration"]), config.num_iterations, config.anneal_lr)
        opt = {"state": state["optim"]}
        B = flat.batch_size[0]

        if compiled_step is not None:
            w, opt_leaves, lr_t = leaf_list(stepped), chain_state(opt["state"]), torch.tensor(lr, dtype=torch.float32, device=device)
            const = (leaf_list(params.select(*frozen)) if frozen else [], leaf_list(stats) if has_stats else [])

        def update(mb: TensorDict) -> TensorDict:
            if compiled_step is not None:
                return pool_explained_variance(TensorDict(compiled_step(w, opt_leaves, const, {k: mb[k] for k in mb_keys}, lr_t), batch_size=[]))
            if config.normalize_advantages:  # over the whole minibatch, before the share and the micro-batches
                mb["advantage"] = normalize_advantage(mb["advantage"])
            mb = data_parallel.share(mb, rank, W)
            for leaf in leaves:
                leaf.grad = None
            total, metrics = accumulate_gradients(lambda m: loss(params, stats, m), mb, config.micro_batch_size, prec=prec,
                                                  scale=loss_scale_of(opt["state"]), maxima=EV_MAXIMA, moments=EV_MOMENTS)
            if W > 1:  # the mean over the ranks' shares: the whole minibatch's gradient, loss and metrics
                _, metrics = data_parallel.average_grads_(reduce, leaves, total, metrics, maxima=EV_MAXIMA, moments=EV_MOMENTS,
                                                          rank=rank, world_size=W)
            metrics = pool_explained_variance(metrics)
            norm, ok, opt["state"] = transform_step(optimizer, opt["state"], stepped, prec, lr=lr)
            metrics["grad_norm"] = norm.detach().to(device)
            metrics["skipped"] = torch.tensor(float(not ok))
            return metrics

        metrics, updates = minibatch_epochs(flat, config.minibatch_size, config.num_epochs, update,
                                            generator=generator, target_kl=config.target_kl)
        out = state.clone(recurse=False)
        for key, value in new.items():
            out[key] = value
        out["iteration"] = state["iteration"] + 1
        out["env_steps"] = state["env_steps"] + B
        out["rng"] = generator.get_state().to(device)
        out["optim"] = opt["state"]
        metrics["updates"] = torch.tensor(updates)
        metrics["skipped"] = metrics["skipped"] * updates  # the count of skipped updates
        metrics["value_target_mean"] = flat["value_target"].mean()
        metrics.update(episode_metrics(TensorDict({"next": episodes}, batch_size=episodes.batch_size)))
        if compiled_step is not None and compiled_step.compile_s is not None and not reported:
            metrics["compile_s"] = torch.tensor(compiled_step.compile_s)  # the first iteration's metrics line
            reported.append(True)
        return out, metrics

    return PPOEncoder(init, policy, rollout, loss, iteration, trainable, net, info, optimizer, trainable_params)


def episode_metrics(batch: TensorDictBase) -> dict[str, Tensor]:
    """Episodes that ended in ``batch`` ([N, T]) with a finite return (a NaN or inf reward's episode
    counts nowhere, as in ppo's line): "episodes" (count), "episode_return" (mean return, NaN when
    none ended) and "success_rate" (share that ended in success, NaN when none ended)."""
    ended = batch["next", "done"].squeeze(-1) & batch["next", "episode_return"].squeeze(-1).isfinite()
    count = ended.sum()
    nan = torch.full((), float("nan"), device=ended.device)
    ret = batch["next", "episode_return"].squeeze(-1)[ended]
    success = batch["next", "success"].squeeze(-1)[ended].float()
    return {
        "episodes": count,
        "episode_return": ret.mean() if count else nan,
        "success_rate": success.mean() if count else nan,
    }


@torch.no_grad()
def evaluate(algo: PPOEncoder, state: TensorDict, env, max_steps: int) -> dict[str, float]:
    """One episode per env of ``env`` (N Dict-observation envs, fresh from construction) with the
    deterministic action mu(s). Returns "episode_return" (mean of the first episodes' returns, env
    units), "success_rate" (share of them that ended in success) and "num_episodes" (those that
    ended within ``max_steps``, normally the time limit); "returns" ([num_episodes] float, each
    ended episode's return) and "successes" (their count of successes) for the caller's statistics."""
    act = algo.policy(state, None, deterministic=True)
    td = env.reset()
    n = env.batch_size[0]
    finished = torch.zeros(n, dtype=torch.bool)
    returns, success = torch.zeros(n), torch.zeros(n, dtype=torch.bool)
    for _ in range(max_steps):
        out, td = env.step_and_maybe_reset(act(td))
        done = out["next", "done"].reshape(n).cpu()
        first = done & ~finished
        returns[first] = out["next", "episode_return"].reshape(n).cpu().float()[first]
        success[first] = out["next", "success"].reshape(n).cpu()[first]
        finished |= done
        if bool(finished.all()):
            break
    ended = int(finished.sum())
    return {
        "episode_return": float(returns[finished].mean()) if ended else float("nan"),
        "success_rate": float(success[finished].float().mean()) if ended else float("nan"),
        "num_episodes": float(ended),
        "returns": returns[finished],
        "successes": int(success[finished].sum()),
    }


register("ppo-encoder", AlgorithmEntry(
    config="rlfunc.algos.ppo_encoder:PPOEncoderConfig", run="rlfunc.run.ppo_encoder:EncoderRun",
    command="rlfunc.cli.ppo_encoder:train", evaluate="rlfunc.run.ppo_encoder:evaluate_run",
    needs="dict-observation",  # cameras / proprio / instruction, Box actions
    variant_of="ppo", accepts="rlfunc.run.ppo_encoder:is_dict_env",  # `rlfunc train ppo` on a Dict observation
    usage="                                            (an env with a Dict observation, e.g. Push-v0 or PusherPixels-v5:\n"
          "                                            Gaussian PPO through the multimodal encoder, rlfunc.algos.ppo_encoder)",
))

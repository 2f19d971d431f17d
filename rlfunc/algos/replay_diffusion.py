"""What the replay-buffer diffusion actor-critics (td3-diffusion, sac-diffusion) share: their common
hyperparameters and checks (:class:`ReplayDiffusionConfig`), their initial learner state
(:func:`replay_state`), their rollout (:func:`replay_rollout`)
and the rollout -> flat transitions map (:func:`replay_transitions`) that fills their device-resident
TorchRL replay buffer, and what their compiled updates share (:func:`compiles`, :func:`minibatch`).

Both score the executed action chunk with Q(cond, a) (so ``actor.horizon == actor.act_steps``), keep
an ensemble of critics as one stacked parameter TensorDict (:func:`rlfunc.algos.offpolicy.q_ensemble`)
with Polyak targets, and run a diffusion actor (:class:`rlfunc.algos.diffusion_actor.DiffusionActor`)
on PointReach-v0, gymnasium envs and Dict-observation envs through a frozen bc encoder.

Data parallel (``--nproc W``; :func:`ranks`), as sac's and td3's (:mod:`rlfunc.algos.offpolicy` says
why): each rank steps its N/W envs of a torch-batched env (a gymnasium id is refused: its split
envs' resets are not the single process's), drawing every env's noise and keeping its rows; the
rollout is all-gathered, so every rank fills the single process's buffer and draws its minibatch
indices; the critic and actor steps are the leaf-list steps run eagerly on this rank's B/W of the
minibatch and of every draw, their gradients, loss and metrics averaged over the ranks in one
all_reduce per side before the chain (so float32 only: no autocast, no gradient checkpointing,
and no compiled step: it holds no collective; ``--compile auto`` runs eager, ``on`` is refused).
td3-diffusion's Diffusion-QL normaliser E|Q| is a whole-minibatch statistic, averaged over the
ranks inside the gradient (:func:`rlfunc.algos.data_parallel.mean_in_graph`); sac-diffusion's entropy
estimate and alpha step read the whole minibatch's first states and run alike on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.algos import data_parallel
from rlfunc.algos.diffusion_actor import ActorSpec, DiffusionActor, check_split, require_finite, schedule_for, with_encoder
from rlfunc.config import RunConfig, check_env_workers, check_fields, require_default
from rlfunc.core import func
from rlfunc.errors import ConfigError
from rlfunc.optim.distributed import all_reduce_mean

MINIBATCH_KEYS = ("cond", "next_cond", "action", "chunk", "reward", "terminated")  # what a compiled step reads of a minibatch


@dataclass(frozen=True)
class ReplayDiffusionConfig:
    """The hyperparameters td3-diffusion and sac-diffusion share, with their defaults, checked in one
    place; each algorithm's config extends it. Steps count env steps."""

    name: ClassVar[str] = "replay-diffusion"  # the algorithm, in messages

    env: str = "PointReach-v0"  # torch-batched env, or a gymnasium id with bounded Box actions
    init_from: str | None = None  # bc (or dppo/td3-diffusion/sac-diffusion) run dir or snapshot to start the actor from; needs horizon == act_steps
    actor: ActorSpec = field(default_factory=lambda: ActorSpec(horizon=1, act_steps=1, num_train_steps=10, ddim_steps=5))
    total_steps: int = 60_000  # env steps
    num_envs: int = 64  # parallel envs
    num_steps: int = 30  # chunk steps per env per iteration (from a reset)
    updates_per_iteration: int = 64  # gradient steps after each rollout
    warmup_steps: int = 5_000  # env steps of uniform random actions before the actor acts
    buffer_size: int = 200_000  # replay capacity, transitions (kept on the device)
    checkpoint_buffer: bool = True  # snapshots hold the replay buffer (exact resume); False: smaller, a resumed run refills it (its warm-up's worth) before updating
    batch_size: int = 256  # transitions per gradient step
    actor_lr: float = 3e-4  # Adam lr of the denoiser
    critic_lr: float = 1e-3  # Adam lr of the critics
    gamma: float = 0.99  # discount per chunk step, in [0, 1]
    tau: float = 0.005  # Polyak rate of the target networks
    policy_delay: int = 2  # critic updates per actor (and target) update
    critic_warmup_updates: int = 0  # first gradient steps with the actor held (critics and their targets step): a fine-tuned actor (init_from) waits for a critic of its own data, as DPPO's critic warm-up
    critic_hidden: tuple[int, ...] = (256, 256)  # critic MLP widths
    num_critics: int = 2  # ensemble size (min over members in the target)
    gradient_checkpointing: bool = False  # checkpoint each denoising step of the actor's chain
    max_grad_norm: float = 10.0  # global grad-norm clip (actor and critics separately)
    async_collection: bool = False  # roll out in a worker process while the learner updates (rlfunc.envs.async_collect): faster, not reproducible, a resume starts new episodes
    sync_weights_every: int = 1  # with async_collection: gradient steps between two publishes of the acting weights to the worker (at most one per iteration, after its updates)
    async_queue: int = 1  # with async_collection: finished rollouts (of num_steps chunk steps) the worker may keep queued; the acting weights lag by up to async_queue + 1
    run: RunConfig = field(default_factory=lambda: RunConfig(eval_episodes=500))  # seed (init, env, noise), device, precision (autocast of the networks), snapshots (rlfunc.config.RunConfig); 500 evaluation episodes

    def __post_init__(self) -> None:
        """ConfigError for a bad shared value, or a run field these algorithms cannot honour."""
        check_fields(self)
        n = self.name
        require_finite(self)
        if self.run.compile == "on" and (self.gradient_checkpointing or self.run.precision != "off"):
            raise ConfigError(f"run.compile='on': {n} compiles its float32 update; expected gradient_checkpointing=False "
                              "and run.precision='off' with it (or --compile off)")
        require_default(self.run, num_seeds=f"{n} trains one seed per run", vmap=f"{n} trains one seed per run",
                        log_every=f"{n} logs every iteration")
        if self.run.nproc > 1:  # before torchrun starts the ranks
            if self.run.compile == "on":
                raise ConfigError(f"run.compile='on' with nproc={self.run.nproc}: {n}'s compiled steps hold no all-reduce; "
                                  "expected --compile off or auto (eager under --nproc)")
            if self.gradient_checkpointing or self.run.precision != "off":
                raise ConfigError(f"nproc={self.run.nproc}: {n}'s data-parallel update is its float32 step; expected "
                                  "gradient_checkpointing=False and run.precision='off' with it")
            check_split(self.env, self.run.nproc)
            data_parallel.check_divides(self.run.nproc, num_envs=self.num_envs, batch_size=self.batch_size)
        if any(h < 1 for h in self.critic_hidden):
            raise ConfigError(f"critic_hidden={self.critic_hidden}: expected positive widths")
        if not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"gamma={self.gamma}: expected a value in [0, 1]")
        if not 0.0 < self.tau <= 1.0:
            raise ConfigError(f"tau={self.tau}: expected a value in (0, 1]")
        for name in ("total_steps", "num_envs", "num_steps", "updates_per_iteration", "buffer_size",
                     "batch_size", "policy_delay", "num_critics"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a positive integer")
        if self.batch_size > self.buffer_size:  # as sac/td3 refuse it (it trained, sampling the small replay with repeats)
            raise ConfigError(f"batch_size={self.batch_size} > buffer_size={self.buffer_size}: a minibatch larger than the replay")
        check_env_workers(self.run, self.num_envs)
        for name in ("sync_weights_every", "async_queue"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected a positive integer")
        asked = [f"{k}={getattr(self, k)}" for k, v in (("sync_weights_every", 1), ("async_queue", 1)) if getattr(self, k) != v]
        if asked and not self.async_collection:
            raise ConfigError(f"{', '.join(asked)}: these set the asynchronous collector; expected them with async_collection "
                              "(--async-collection) or not at all")
        if self.async_collection and self.run.nproc > 1:
            raise ConfigError(f"async_collection with nproc={self.run.nproc}: the asynchronous collector serves one learner "
                              "process; expected nproc=1 with it")
        if self.async_collection and self.run.env_workers:
            raise ConfigError(f"async_collection with run.env_workers={self.run.env_workers}: the asynchronous collector steps "
                              "every env in its one worker process; expected env_workers=0 with it")
        if self.actor.horizon != self.actor.act_steps and self.init_from is None:  # else init_from's spec replaces it, checked then
            raise ConfigError(
                f"actor.horizon={self.actor.horizon}, actor.act_steps={self.actor.act_steps}: {n}'s critic "
                "scores the executed chunk, so the two must be equal"
            )
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps={self.warmup_steps}: expected >= 0")
        if isinstance(self.critic_warmup_updates, bool) or not isinstance(self.critic_warmup_updates, int) or self.critic_warmup_updates < 0:
            raise ConfigError(f"critic_warmup_updates={self.critic_warmup_updates!r}: expected an integer >= 0")
        if not self.actor_lr > 0 or not self.critic_lr > 0 or not self.max_grad_norm > 0:
            raise ConfigError("actor_lr, critic_lr and max_grad_norm must be > 0")

    def num_iterations(self) -> int:
        return max(1, math.ceil(self.total_steps / (self.num_envs * self.num_steps * self.actor.act_steps)))

    def num_updates(self) -> int:
        """Gradient steps of the whole run: ``updates_per_iteration`` in every iteration whose rollout
        ends at or past ``warmup_steps``."""
        per_iteration = self.num_envs * self.num_steps * self.actor.act_steps
        first = max(1, math.ceil(self.warmup_steps / per_iteration))  # the first iteration that updates
        return max(0, self.num_iterations() - first + 1) * self.updates_per_iteration


def compiles(config: ReplayDiffusionConfig, auto_updates: int) -> bool:
    """Whether the update runs compiled: ``--compile on``, or ``auto`` for a float32 run without
    checkpointing of >= ``auto_updates`` gradient steps (the algorithm's break-even, measured by
    bench/compiled_diffusion_offpolicy.py); ``on`` with what it does not compile was refused by the config."""
    eligible = not config.gradient_checkpointing and config.run.precision == "off"
    return config.run.compile == "on" or (config.run.compile == "auto" and eligible and config.num_updates() >= auto_updates)


def side_steps(critic_step: Callable, actor_step: Callable, config: ReplayDiffusionConfig, device: torch.device,
               name: str, world_size: int, auto_updates: int) -> tuple[Callable, Callable] | None:
    """The leaf-list (critic, actor) steps a run takes: through ``compile_step`` where :func:`compiles`
    says so and the run has one rank (a compiled step holds no collective); the steps themselves,
    eager, in a data-parallel run (each on its rank's share); None otherwise (the eager TensorDict
    path). The persistent arguments 0-5 (weights, targets, chain states) are static."""
    from rlfunc.device import compile_step

    if world_size > 1:
        return critic_step, actor_step
    if not compiles(config, auto_updates):
        return None
    return tuple(compile_step(f, device, config.run.compile, name, static_args=(0, 1, 2, 3, 4, 5)) for f in (critic_step, actor_step))


class Ranks(NamedTuple):
    """A data-parallel run's place as the replay-diffusion algorithms use it (:func:`ranks`)."""

    world_size: int
    rank: int
    own: Callable  # rlfunc.algos.data_parallel.own_rows: the noise rows of this rank's envs
    mean_over_ranks: Callable | None  # objective_step's (grads, loss, metrics) average over the ranks; None at W = 1
    mean: Callable[[Tensor], Tensor]  # a detached statistic's mean over the ranks, inside torch.func.grad too (data_parallel.mean_in_graph)

    def share(self, x, dim: int = 0):
        """This rank's share of a minibatch-sized ``x`` (a tensor, or a dict of them) along ``dim``."""
        if isinstance(x, dict):
            return {k: data_parallel.share(v, self.rank, self.world_size, dim) for k, v in x.items()}
        return data_parallel.share(x, self.rank, self.world_size, dim)


def ranks(dist, config: ReplayDiffusionConfig) -> Ranks:
    """:class:`Ranks` of ``dist`` (None or a :class:`rlfunc.run.distributed.Distributed`); ConfigError
    unless its world size divides ``num_envs`` and ``batch_size``, and, at W > 1, the update is the
    float32 leaf-list step (no gradient checkpointing, no autocast)."""
    W, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)
    data_parallel.check_divides(W, num_envs=config.num_envs, batch_size=config.batch_size)
    if W == 1:
        return Ranks(1, 0, data_parallel.own_rows(0, 1), None, lambda x: x)
    if config.gradient_checkpointing or config.run.precision != "off":
        raise ConfigError(f"{W} ranks: {config.name}'s data-parallel update is its float32 step; expected "
                          "gradient_checkpointing=False and run.precision='off' with it")
    reduce = all_reduce_mean(dist.group)

    def mean_over_ranks(grads, loss, metrics):
        return data_parallel.average(reduce, list(grads), None, loss, metrics)

    return Ranks(W, rank, data_parallel.own_rows(rank, W), mean_over_ranks,
                 lambda x: data_parallel.mean_in_graph(x, W, dist.group))


def minibatch(mb: TensorDict) -> dict:
    """A sampled minibatch of :func:`replay_transitions` as the dict of tensors a compiled step takes."""
    return {k: mb[k] for k in MINIBATCH_KEYS}


def replay_state(actor: DiffusionActor, config: ReplayDiffusionConfig, critics: TensorDict, actor_params: TensorDict | None,
                 obs_stats: TensorDict | None, encoder_params: TensorDict | None, *, target_actor: bool) -> TensorDict:
    """The learner state both algorithms start from, on the actor's device: "params" {"actor" (a copy
    of ``actor_params``, else a fresh init from the seed), "critic" (``critics``, [E, ...])}, "target"
    {"critic"[, "actor" with ``target_actor``]} (copies), "obs_stats" (``obs_stats`` or empty),
    "schedule" (the actor spec's), "rng" (a generator seeded with ``config.run.seed``), "iteration",
    "env_steps", "updates" (0-dim int64 zeros), and for a Dict observation "encoder" (a copy of
    ``encoder_params``, else a fresh init). The caller adds its own entries and update-chain states."""
    seed, device = config.run.seed, actor.device
    actor_params = func.as_leaves((actor_params if actor_params is not None else actor.init_params(seed)).detach().clone())
    zero = lambda: torch.zeros((), dtype=torch.int64, device=device)  # noqa: E731
    target = {"critic": critics.detach().clone()}
    if target_actor:
        target["actor"] = actor_params.detach().clone()
    state = TensorDict(
        {
            "params": {"actor": actor_params, "critic": critics}, "target": target,
            "obs_stats": obs_stats if obs_stats is not None else actor.init_stats(),
            "schedule": schedule_for(actor.spec, device),
            "rng": torch.Generator(device=device).manual_seed(seed).get_state(),
            "iteration": zero(), "env_steps": zero(), "updates": zero(),
        },
        batch_size=[],
        device=device,
    )
    return with_encoder(state, actor, encoder_params, seed)


def replay_rollout(actor: DiffusionActor, config: ReplayDiffusionConfig, state: TensorDict, env, generator: torch.Generator,
                   explore: Callable[[Tensor], Tensor], own=None) -> TensorDict:
    """``config.num_steps`` chunk steps of ``env`` (a TorchRL env of [N, act_steps, A] chunks in
    [-1, 1]) without gradient: uniform chunks from ``generator`` while ``state["env_steps"]`` <
    ``warmup_steps``, else ``explore(cond)`` ([N, C] condition -> [N, H, A] chunk, clipped here).
    ``own``: a data-parallel rank's :func:`rlfunc.algos.data_parallel.own_rows` (the uniform chunks
    of every rank's envs drawn, this rank's rows kept; ``explore`` keeps its rows itself)."""
    warm = int(state["env_steps"]) < config.warmup_steps
    spec, device = actor.spec, actor.device
    own = data_parallel.own_rows(0, 1) if own is None else own

    @torch.no_grad()
    def act(td: TensorDict) -> TensorDict:
        if warm:
            draw = lambda n: torch.rand((n, spec.horizon, actor.act_dim), generator=generator, device=device)  # noqa: E731
            x = own(draw, td.batch_size[0], 0) * 2 - 1
        else:
            x = explore(actor.condition(state.get("encoder", None), state["obs_stats"], td))
        td["action"] = actor.env_action(x.clamp(-1.0, 1.0))
        return td

    return env.rollout(config.num_steps, act, break_when_any_done=False)


def replay_transitions(actor: DiffusionActor, state: TensorDict, batch: TensorDict) -> TensorDict:
    """A rollout [N, T] -> flat transitions [N*T] with "cond", "next_cond" (normalised observations,
    or the frozen encoder's features, float32 [C]), "action" [H*A] in [-1, 1], "chunk" [H, A],
    "reward" [1], "terminated" [1] bool."""
    spec = actor.spec
    with torch.no_grad():
        encoder = state.get("encoder", None)
        cond = actor.condition(encoder, state["obs_stats"], batch)
        next_cond = actor.condition(encoder, state["obs_stats"], batch["next"])
    chunk = batch["action"].reshape(*batch.batch_size, spec.horizon, actor.act_dim)
    return TensorDict(
        {
            "cond": cond, "next_cond": next_cond, "action": chunk.flatten(-2), "chunk": chunk,
            "reward": batch["next", "reward"], "terminated": batch["next", "terminated"],
        },
        batch_size=batch.batch_size,
    ).flatten(0, 1)

"""What the replay-buffer actor-critics (sac, td3, td3-diffusion) share: an ensemble of Q critics as
one stacked parameter TensorDict, the [-1, 1] <-> env-bounds action map, the uniform warm-up policy,
their common hyperparameters (:class:`OffPolicyConfig`), :class:`OffPolicy`, the algorithm that
:class:`rlfunc.run.offpolicy.OffPolicyRun` drives, and the pieces of their pure update steps over
flat leaf lists (:func:`stacked`; the update chain's step over leaf lists is rlfunc.optim.leaves').

The Polyak update of the target networks is :func:`rlfunc.core.func.polyak_update_`.

Data parallel (``--nproc W``, torchrun; ``make_sac`` / ``make_td3`` with a ``dist``): W ranks take
the single process's steps, to float rounding, so a run means the same at any W and its snapshots
move between world sizes (:mod:`rlfunc.algos.data_parallel`'s recipe, as ppo's and dppo's):

- each rank steps its N/W of the N envs (the single process's reset seeds for them) and draws the
  exploration noise (and the warm-up's uniform actions) of all N envs, keeping its rows: every
  rank's generator draws what the single process's draws and stays in step with it;
- each env step's transitions are all-gathered in rank order, which is the single process's env
  order (:meth:`rlfunc.run.distributed.Distributed.all_gather_batch`), so every rank holds the single
  process's replay buffer and draws the same minibatch indices from the same generator. That
  gather costs (W-1)/W of a step's transitions per rank: a few floats per env step for state
  observations, but for pixel observations every image crosses (gather encoder features or buffer
  indices there instead; these algorithms take flat Box observations);
- each gradient step takes this rank's B/W share of the minibatch and of its noise, and its loss is
  the mean over the share; the gradients, the loss and the metrics go through one all_reduce_mean
  (:func:`rlfunc.algos.data_parallel.average`) before clipping and Adam, so every rank takes the
  same step: the critics' and sac's temperature's gradients share one collective, the actor's
  (after the critics' step, through them) another; the Polyak targets, the delayed actor steps of
  td3 and sac's log alpha (its own Adam chain, on the averaged gradient) stay identical on every rank.

Sharding the buffer instead (each rank sampling its own rows) would save the gather but change the
minibatch distribution with W, and a snapshot would hold W buffers; replicating it keeps the single
process's numbers. The compiled step holds no collective, and splitting it into compiled pieces
around the all-reduce was not tried: ``--compile auto`` runs eager under W > 1, ``--compile on``
with W > 1 is a ConfigError (one line). The config checks that W (``run.nproc``) divides
``num_envs`` and ``batch_size`` before torchrun starts the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from rlfunc.algos import data_parallel
from rlfunc.config import RunConfig, check_env_workers, check_fields, require_default
from rlfunc.core import func
from rlfunc.errors import ConfigError
from rlfunc.nets.mlp import MLP, seeded_init
from rlfunc.optim.base import unflatten

# --compile auto compiles a run of at least this many gradient steps: the compile took ~45 s on the
# loaded 2-core CPU and saved ~13 ms of sac's ~27 ms update (256x256, batch 256), a break-even of ~3.5k
# updates; sac's and td3's Pendulum-v1 presets (19,900 / 10,000) and HalfCheetah-v5's compile, short test runs do not
AUTO_COMPILE_UPDATES = 5_000

Policy = Callable[[Tensor], tuple[Tensor, None]]  # observation [N, obs_dim] -> (env action [N, A], no log-prob)


class QEnsemble(NamedTuple):
    """E critics Q_e(s, a) = MLP_e([s, a]) sharing one skeleton ``net``.

    init: ``() -> params`` [E, ...], member e seeded with ``seeds[e]``.
    values: ``(params [E, ...], observation [B, O], action [B, A]) -> [E, B, 1]`` (``func.vmap`` over E).
    value: ``(one member's params, observation, action) -> [B, 1]``.
    """

    net: nn.Module
    init: Callable[[], TensorDict]
    values: Callable[[TensorDict, Tensor, Tensor], Tensor]
    value: Callable[[TensorDict, Tensor, Tensor], Tensor]


def acting_forward(actor: nn.Sequential, config, device: torch.device, what: str) -> Callable[[TensorDict], Callable[[Tensor], Tensor]]:
    """``forward_of(actor_params) -> (observation [B, obs_dim] -> actor output [B, out])``, the acting
    policy's network (:func:`rlfunc.core.func.sequential_apply`): one function of the weights, compiled
    where the run compiles (``--compile on``, or ``auto`` on a run of >= AUTO_COMPILE_UPDATES updates) on
    a device of :func:`rlfunc.device.compile_policy` (CUDA graphs; eager on the CPU). ``forward_of.compiled``:
    the compiled function (its ``compile_s``), or None."""
    from rlfunc.device import compile_policy

    weights_of, apply = func.sequential_apply(actor, stacked=False)
    updates = max(0, config.total_steps - config.learning_starts) * config.updates_per_step
    run = apply
    if config.run.compile == "on" or (config.run.compile == "auto" and updates >= AUTO_COMPILE_UPDATES):
        run = compile_policy(apply, device, config.run.compile, what, static_args=(0,))

    def forward_of(params: TensorDict) -> Callable[[Tensor], Tensor]:
        weights = weights_of(params)
        return lambda x: run(weights, x)

    forward_of.compiled = None if run is apply else run
    return forward_of


def q_ensemble(obs_dim: int, act_dim: int, hidden: Sequence[int], seeds: Sequence[int], device: torch.device, *,
               activation: str = "relu", use_loop: bool | None = None) -> QEnsemble:
    """The critic ensemble of ``len(seeds)`` MLPs ``obs_dim + act_dim -> hidden -> 1`` (orthogonal
    init, :class:`rlfunc.nets.mlp.MLP`) on ``device``; ``use_loop`` as :func:`rlfunc.core.func.vmap`'s."""
    make = lambda: MLP(obs_dim + act_dim, 1, tuple(hidden), activation)  # noqa: E731
    net = make().to(device)

    def init() -> TensorDict:
        return func.init_stacked(lambda s: func.params_from_module(seeded_init(make, s).to(device)), list(seeds))

    def value(params: TensorDict, observation: Tensor, action: Tensor) -> Tensor:
        return func.apply(net, params, torch.cat([observation, action], -1))

    values = func.vmap(value, in_dims=(0, None, None), device=device, use_loop=use_loop)
    return QEnsemble(net, init, values, value)


class ActionScale(NamedTuple):
    """The affine map between [-1, 1] (what actors output and buffers hold) and the env's bounds:
    a_env = center + half_range * a; both [A] float32 on the learner's device."""

    center: Tensor
    half_range: Tensor

    def to_env(self, action: Tensor) -> Tensor:
        return self.center + self.half_range * action

    def to_unit(self, action: Tensor) -> Tensor:
        return ((action - self.center) / self.half_range).clamp(-1.0, 1.0)


def action_scale(low: Sequence[float], high: Sequence[float], device: torch.device) -> ActionScale:
    """:class:`ActionScale` of a Box with finite bounds ``low`` < ``high`` (float32: a bound past its
    range, ~3.4e38, is not finite). The centre and half-range are halves summed (exact, the same
    numbers as (high + low) / 2), so a range wider than float32's, [-2e38, 2e38], stays finite (its
    half-range was inf, and every step's data non-finite and skipped).

    Raises:
        ConfigError: a bound is not finite, or low >= high somewhere.
    """
    lo = torch.tensor(list(low), dtype=torch.float32)
    hi = torch.tensor(list(high), dtype=torch.float32)
    if not (lo.isfinite().all() and hi.isfinite().all() and (hi > lo).all()):
        raise ConfigError(f"action bounds low={list(low)}, high={list(high)}: expected finite bounds with low < high "
                          "(a squashed or clipped actor needs a bounded Box)")
    return ActionScale((hi / 2 + lo / 2).to(device), (hi / 2 - lo / 2).to(device))


def uniform_policy(scale: ActionScale, generator: torch.Generator, own=None) -> Policy:
    """Warm-up actions, uniform in the env's box, drawn from ``generator`` (on the learner's device).
    ``own``: a data-parallel rank's :func:`rlfunc.algos.data_parallel.own_rows` (it draws for every
    rank's envs and keeps its rows); None: the draws of the envs it acts for."""
    own = data_parallel.own_rows(0, 1) if own is None else own

    def act(observation: Tensor) -> tuple[Tensor, None]:
        draw = lambda n: torch.rand((n, scale.center.shape[0]), generator=generator, device=scale.center.device)  # noqa: E731
        u = own(draw, observation.shape[0], 0)
        return scale.to_env(u * 2 - 1), None

    return act


class OffPolicy(NamedTuple):
    """A replay-buffer actor-critic as :class:`rlfunc.run.offpolicy.OffPolicyRun` drives it.

    init: ``() -> state``, the learner state TensorDict (params, targets, every update chain's state,
        "rng", "iteration", "env_steps", "updates").
    policy: ``(state, generator, deterministic) -> Policy`` acting in env units (exploration noise drawn
        from ``generator``; ``deterministic``: the mean action, no draw).
    iteration: ``(state, buffer, generator, num_updates, into=None) -> (state, metrics)``: ``num_updates``
        gradient steps on minibatches of ``buffer`` (a TorchRL replay buffer of :func:`transitions`),
        in place; metrics are their means over the steps with a finite value and the skipped steps'
        counts (:class:`StepMetrics`), or, given ``into`` (a metrics line's StepMetrics), added there.
    scale: the action map. optimizers: the learner's update-chain state keys.
    """

    init: Callable[[], TensorDict]
    policy: Callable[..., Policy]
    iteration: Callable[..., tuple[TensorDict, TensorDict]]
    scale: ActionScale
    optimizers: tuple[str, ...]
    extra: Any = None


class StepMetrics:
    """The gradient steps' metrics of one metrics line: each value summed where finite, with its
    count, so a mean is over the steps that gave a finite value (a skipped step's inf or NaN loss
    and norm are left out instead of making the whole line's mean non-finite; NaN, written null,
    where no step gave one); the ``skipped_*`` flags (1.0 per skipped step) are summed into counts.
    One stack per :meth:`add` of a dict of 0-dim tensors, no host read.

    >>> acc = StepMetrics()
    >>> for loss, flag in ((1.0, 0.0), (float("inf"), 1.0), (3.0, 0.0)):
    ...     acc.add({"loss_critic": torch.tensor(loss), "skipped_critic": torch.tensor(flag)})
    >>> {k: float(v) for k, v in acc.result().items()}
    {'loss_critic': 2.0, 'skipped_critic': 1.0}
    """

    def __init__(self) -> None:
        self._parts: dict[tuple[str, ...], list[Tensor]] = {}  # the keys of an add -> [sums, counts]

    def add(self, metrics) -> None:
        """Add one step's (or one part's) ``metrics``: a mapping of str -> 0-dim (or one-element) tensor."""
        keys = tuple(metrics.keys())
        if not keys:
            return
        # the metrics' device (an eager diffusion step's skip flag is a host tensor beside them): no device-to-host read
        device = next((metrics[k].device for k in keys if metrics[k].device.type != "cpu"), torch.device("cpu"))
        values = torch.stack([metrics[k].detach().to(device, torch.float32).reshape(()) for k in keys])
        finite = values.isfinite()
        part = self._parts.get(keys)
        if part is None:
            self._parts[keys] = [torch.where(finite, values, 0.0), finite.float()]
        else:
            part[0] += torch.where(finite, values, 0.0)
            part[1] += finite

    def __bool__(self) -> bool:
        return bool(self._parts)

    def result(self) -> dict[str, Tensor]:
        """{key: 0-dim float32}: ``skipped_*`` the count, every other key the mean over its finite values."""
        sums: dict[str, Tensor] = {}
        counts: dict[str, Tensor] = {}
        for keys, (s, c) in self._parts.items():  # a key may come in several key sets (td3's critic steps with and without an actor step)
            for i, k in enumerate(keys):
                sums[k], counts[k] = (s[i], c[i]) if k not in sums else (sums[k] + s[i], counts[k] + c[i])
        return {k: v if k.startswith("skipped_") else v / counts[k] for k, v in sums.items()}


def stacked(treedef: tuple, leaves: list[Tensor], n: int) -> TensorDict:
    """An ensemble's params from their flat leaves, batch_size [n] (the members' dim, which
    tensordict's vmap cannot infer from nested TensorDicts alone)."""
    td = unflatten(treedef, leaves)
    td.batch_size = [n]
    return td


def transitions(batch: TensorDict, scale: ActionScale) -> TensorDict:
    """A rollout [N, T] (:func:`rlfunc.envs.collect.rollout`) -> flat transitions [N*T]:
    "observation", "action" (in [-1, 1]), ("next", "observation"), ("next", "reward"), ("next", "terminated")."""
    return TensorDict(
        {
            "observation": batch["observation"],
            "action": scale.to_unit(batch["action"]),
            "next": {"observation": batch["next", "observation"], "reward": batch["next", "reward"],
                     "terminated": batch["next", "terminated"]},
        },
        batch_size=batch.batch_size,
    ).reshape(-1)


def finite_transitions(batch: TensorDict, scale: ActionScale) -> tuple[TensorDict, int]:
    """:func:`transitions` less those with a NaN or inf in the observation, action, next observation
    or reward, and how many were left out: the replay buffer never holds one (the bug: they were
    stored as drawn, and every minibatch that sampled one was skipped whole, uncounted)."""
    td = transitions(batch, scale)
    ok = torch.stack([td.get(k).reshape(td.shape[0], -1).isfinite().all(1)
                      for k in ("observation", "action", ("next", "observation"), ("next", "reward"))]).all(0)
    if bool(ok.all()):
        return td, 0
    return td[ok], int((~ok).sum())


def sample(buffer, batch_size: int, generator: torch.Generator, device: torch.device) -> TensorDict:
    """``batch_size`` transitions of ``buffer``, uniform with replacement, indices from ``generator``
    (the storage lives on ``device``: no host round trip)."""
    idx = torch.randint(len(buffer), (batch_size,), generator=generator, device=device)
    return buffer[idx]


@dataclass(frozen=True)
class OffPolicyConfig:
    """The hyperparameters sac and td3 share, with their defaults (Stable-Baselines3's / RL-Zoo's),
    checked in one place; each algorithm's config extends it (and redeclares a field whose default
    differs). Steps count env steps."""

    name: ClassVar[str] = "off-policy"  # the algorithm, in messages
    compiles: ClassVar[bool] = False  # whether its update honours run.compile (sac's does)

    env: str = "Pendulum-v1"  # gymnasium env id (Box observations, bounded Box actions)
    total_steps: int = 20_000  # env steps (rounded up to whole iterations of num_envs x num_steps)
    num_envs: int = 1  # parallel envs (sync vector env)
    num_steps: int = 1_000  # vector-env steps per iteration (a metrics line, and the snapshot cadence's unit)
    buffer_size: int = 1_000_000  # replay capacity, transitions (kept on the device)
    checkpoint_buffer: bool = True  # snapshots hold the replay buffer (exact resume); False: smaller, a resumed run refills it (its warm-up's worth) before updating
    batch_size: int = 256  # transitions per gradient step
    learning_starts: int = 100  # env steps of uniform random actions before the actor acts and updates begin
    updates_per_step: int = 1  # gradient steps per env step (the update-to-data ratio, UTD)
    gamma: float = 0.99  # discount, in [0, 1]
    tau: float = 0.005  # Polyak rate of the target networks, in (0, 1]
    actor_lr: float = 3e-4  # Adam lr of the actor
    critic_lr: float = 3e-4  # Adam lr of the critics (one chain over the ensemble)
    num_critics: int = 2  # ensemble size E
    n_step: int = 1  # n-step targets (only 1 is implemented)
    hidden: tuple[int, ...] = (256, 256)  # MLP widths of the actor and of each critic
    activation: str = "relu"  # tanh | relu | elu | silu
    max_grad_norm: float | None = None  # global grad-norm clip per network (None or 0: off)
    async_collection: bool = False  # step the envs in a worker process while the learner updates (rlfunc.envs.async_collect): faster, not reproducible, a resume starts new episodes
    sync_weights_every: int = 1  # with async_collection: gradient steps between two publishes of the actor's weights to the worker
    async_queue: int = 2  # with async_collection: items (of async_steps vector-env steps) the worker may keep queued; the acting weights lag by up to async_queue + 1
    async_steps: int = 1  # with async_collection: vector-env steps per item the worker sends (their updates follow together); divides num_steps
    run: RunConfig = field(default_factory=lambda: RunConfig(checkpoint_every=5, eval_episodes=100))  # seed, device, snapshots (rlfunc.config.RunConfig); 100 evaluation episodes (deterministic actions)

    def __post_init__(self) -> None:
        """ConfigError for a bad value of the shared hyperparameters, or a run field these
        algorithms cannot honour."""
        check_fields(self)
        n = self.name
        if not self.compiles:
            require_default(self.run, compile=f"{n} has no compiled update yet (ppo and sac have)")
        require_default(self.run, num_seeds=f"{n} trains one seed per run", vmap=f"{n} trains one seed per run",
                        precision=f"{n} has no mixed precision", log_every=f"{n} logs every iteration")
        for name in ("total_steps", "num_envs", "num_steps", "buffer_size", "batch_size", "updates_per_step", "num_critics",
                     "sync_weights_every", "async_queue", "async_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: expected a positive integer")
        if self.batch_size > self.buffer_size:
            raise ConfigError(f"batch_size={self.batch_size} > buffer_size={self.buffer_size}: a minibatch larger than the replay")
        nproc = self.run.nproc
        if nproc > 1 and self.run.compile == "on":
            raise ConfigError(f"run.compile='on' with nproc={nproc}: {n}'s compiled step holds no all-reduce; "
                              "expected --compile off or auto (eager under --nproc)")
        data_parallel.check_divides(nproc, num_envs=self.num_envs, batch_size=self.batch_size)  # before torchrun starts the ranks
        check_env_workers(self.run, self.num_envs // nproc, f"num_envs={self.num_envs} / nproc={nproc} per process" if nproc > 1 else "")
        asked = [f"{k}={getattr(self, k)}" for k, v in (("async_steps", 1), ("sync_weights_every", 1), ("async_queue", 2))
                 if getattr(self, k) != v]
        if asked and not self.async_collection:
            raise ConfigError(f"{', '.join(asked)}: these set the asynchronous collector; expected them with async_collection "
                              "(--async-collection) or not at all")
        if self.async_collection and self.num_steps % self.async_steps:
            raise ConfigError(f"async_steps={self.async_steps}: expected a divisor of num_steps={self.num_steps} "
                              "(an iteration takes whole items)")
        if self.async_collection and nproc > 1:
            raise ConfigError(f"async_collection with nproc={nproc}: the asynchronous collector serves one learner process; "
                              "expected nproc=1 with it")
        if self.async_collection and self.run.env_workers:
            raise ConfigError(f"async_collection with run.env_workers={self.run.env_workers}: the asynchronous collector steps "
                              "every env in its one worker process; expected env_workers=0 with it")
        if isinstance(self.learning_starts, bool) or not isinstance(self.learning_starts, int) or self.learning_starts < 0:
            raise ConfigError(f"learning_starts={self.learning_starts!r}: expected an integer >= 0")
        if not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"gamma={self.gamma}: expected a value in [0, 1]")
        if not 0.0 < self.tau <= 1.0:
            raise ConfigError(f"tau={self.tau}: expected a value in (0, 1]")
        for name in ("actor_lr", "critic_lr"):  # inf trained to NaN weights and exited 0 (new-user pass)
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a finite number > 0")
        if self.max_grad_norm is not None and not self.max_grad_norm >= 0:
            raise ConfigError(f"max_grad_norm={self.max_grad_norm}: expected > 0, or 0 / None (off)")
        if not self.hidden or any(h < 1 for h in self.hidden):
            raise ConfigError(f"hidden={self.hidden}: expected positive widths")
        if self.activation not in ("tanh", "relu", "elu", "silu"):
            raise ConfigError(f"activation={self.activation!r}: expected tanh, relu, elu or silu")
        if self.n_step != 1:
            raise ConfigError(f"n_step={self.n_step!r}: only 1-step targets are implemented (n-step returns over the "
                              "vector env's replay are not yet)")

    def num_iterations(self) -> int:
        return max(1, math.ceil(self.total_steps / (self.num_envs * self.num_steps)))

"""Shared-parameter multi-agent PPO (IPPO / MAPPO) and its critic-free GRPO / GSPO variants.

One categorical policy pi_theta(a | o_i) and one value function V_phi over every agent's local
observation o_i; the agent dim is one more batch dim, so the parameters are shared by all agents
("parameter sharing", Gupta et al. 2017; Terry et al. 2020). Invalid moves are masked out of the
policy when the env gives an action mask ((("agents", "action_mask")): their logits are set to the
dtype's lowest value, so they get probability 0 and never contribute to the entropy).

Losses (``MAPPOConfig.loss``):

- ``"ppo"``: PPO's clipped surrogate (:func:`rlfunc.losses.ppo.ppo_loss`) with one GAE per agent
  (:func:`rlfunc.core.returns.generalized_advantage_estimate` over each agent's own reward stream).
  ``critic="local"`` is IPPO (de Witt et al. 2020): V(o_i); ``"mean"`` and ``"concat"`` are MAPPO's
  centralised critic (Yu et al. 2022): V sees o_i with the mean, or the concatenation, of every
  agent's observation of the same env (training only; the policy stays decentralised).
- ``"grpo"`` / ``"gspo"``: no critic; G rollouts from one start state (a group) and a group-relative
  advantage of the sequence reward (:func:`rlfunc.core.returns.group_relative_advantage`): the team
  return (``sequence_reward="team"``: sum over agents and steps, one advantage per rollout shared by
  its agents) or each agent's own return (``"agent"``: agent i of member k against agent i of the
  other members, who start from the same cell with the same task draws). Each agent's episode is a
  sequence for :func:`rlfunc.losses.grpo.grpo_loss` / :func:`rlfunc.losses.gspo.gspo_loss`.

The learner state is one TensorDict: "params" ("actor", "critic"), "optim" (the state of the update
chain ``chain(clip_by_global_norm, adam)`` of :mod:`rlfunc.optim`), "iteration", "env_steps".
``--compile on`` (``auto``: runs of >= :data:`AUTO_COMPILE_UPDATES` gradient steps) runs a minibatch's
step (loss, torch.func.grad, norm, the chain, the in-place update) as one torch.compile graph, equal to
the eager step within 1e-5 (tests/optim/test_compiled_step.py).

Reference: Schulman et al. (2017), PPO; de Witt et al. (2020), "Is Independent Learning All You
Need in the StarCraft Multi-Agent Challenge?" (IPPO); Yu et al. (2022), "The Surprising
Effectiveness of PPO in Cooperative Multi-Agent Games" (MAPPO, sec. 3 and app. C: the agent-specific
global state); Papoudakis et al. (2021), "Benchmarking Multi-Agent Deep RL Algorithms in Cooperative
Tasks" (parameter sharing, the RWARE tasks); Shao et al. (2024) (GRPO); Zheng et al. (2025) (GSPO).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NamedTuple

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from rlfunc.algos import data_parallel
from rlfunc.algos.registry import AlgorithmEntry, register
from rlfunc.config import RunConfig, check_dependents, check_episodes, check_fields, replace, require_default
from rlfunc.core import func
from rlfunc.core.distributions import categorical_entropy, categorical_log_prob, categorical_sample, masked_logits
from rlfunc.core.returns import generalized_advantage_estimate, group_relative_advantage
from rlfunc.device import compile_step
from rlfunc.errors import ConfigError
from rlfunc.losses.grpo import grpo_loss
from rlfunc.losses.gspo import gspo_loss
from rlfunc.losses.ppo import EV_MAXIMA, EV_MOMENTS, normalize_advantage, pool_explained_variance, ppo_loss
from rlfunc.nets.mlp import MLP, seeded_init
from rlfunc.optim import adam, all_reduce_mean, chain, clip_by_global_norm, flatten, linear_lr, member_grad_norms, unflatten
from rlfunc.optim.leaves import chain_state, chain_step

LOSSES = ("ppo", "grpo", "gspo")
CRITICS = ("local", "mean", "concat")

# --compile auto compiles a run of at least this many gradient steps (bench/compiled_grpo_mappo.py, 2-core
# CPU, one thread, Warehouse-v0's preset: a cold compile took 41 s and saved 5.7 ms of the 50 ms step
# (matmul-bound: 4,000 agent-steps of 251 observations), a break-even of ~7,200 steps; under load it
# saved nothing). The preset (6,000 steps) stays eager.
AUTO_COMPILE_UPDATES = 15_000


ENV_FIELDS = ("n_agents", "episode_steps", "shaping_scale", "conflict_penalty")  # what an env's builder may read


def _env_reads(env: str, field: str) -> bool:
    """Whether the env registry's builder of ``env`` reads the config field ``field`` (one of
    :data:`ENV_FIELDS`; an unknown id: left to the run's own EnvError)."""
    from rlfunc.envs import registry

    entry = registry.find(env)
    return entry is None or field in entry.multi_agent_fields


@dataclass(frozen=True)
class MAPPOConfig:
    """Every hyperparameter of shared-parameter multi-agent PPO / GRPO / GSPO, with its default."""

    env: str = "Warehouse-v0"  # "Warehouse-v0" or an rware id ("rware-tiny-2ag-v2", ...)
    loss: Literal["ppo", "grpo", "gspo"] = "ppo"  # see the module docstring
    critic: Literal["local", "mean", "concat"] = "local"  # ppo: V(o_i) (IPPO) or a centralised critic (MAPPO)
    n_agents: int = 20  # Warehouse-v0: AGVs per warehouse (rware: fixed by the id)
    episode_steps: int = 200  # Warehouse-v0: steps per training episode (truncation); rware: 500 (its own)
    shaping_scale: float = 0.0  # Warehouse-v0: training reward per cell of BFS progress to the goal (0: off)
    conflict_penalty: float = 0.1  # Warehouse-v0: training reward subtracted per blocked agent
    num_envs: int = 32  # envs stepped together (grpo/gspo: num_groups * group_size)
    rollout_steps: int = 100  # ppo: steps per env per iteration (grpo/gspo: episode_steps)
    group_size: int = 8  # grpo/gspo: rollouts per start state (G)
    sequence_reward: Literal["team", "agent"] = "team"  # grpo/gspo: what a group compares (see docstring)
    total_steps: int = 1_000_000  # env steps (one step of one env = n_agents agent-steps), rounded up to whole iterations
    hidden: tuple[int, ...] = (128, 128)  # MLP widths of actor and critic
    activation: str = "tanh"  # MLP activation
    lr: float = 5e-4  # Adam learning rate
    anneal_lr: bool = True  # linear decay of lr to 0 over the run
    num_epochs: int = 4  # passes over each batch
    num_minibatches: int = 4  # minibatches per epoch
    gamma: float = 0.99  # discount per step
    lmbda: float = 0.95  # GAE lambda
    clip_epsilon: float = 0.2  # ppo/grpo: ratio clip range
    gspo_clip_epsilon: float = 3e-4  # gspo: lower clip of the sequence ratio (paper: 3e-4)
    gspo_clip_epsilon_high: float = 4e-4  # gspo: upper clip (paper: 4e-4)
    entropy_coef: float = 0.01  # weight of the entropy bonus (all losses)
    value_coef: float = 0.5  # ppo: weight of the value loss
    max_grad_norm: float = 0.5  # global gradient-norm clip
    advantage_std: Literal["group", "batch", "none"] = "group"  # grpo/gspo: group_relative_advantage's std
    eval_seeds: tuple[int, ...] = (1000, 1001, 1002)  # env seeds of the final evaluation
    eval_greedy: bool = False  # evaluate the argmax action instead of sampling
    # (switch, on, the fields only it reads): rlfunc.config.check_dependents
    dependents: ClassVar[tuple] = (
        ("loss='ppo'", lambda c: c.loss == "ppo", ("critic", "rollout_steps", "value_coef")),
        ("loss='grpo' or 'gspo'", lambda c: c.loss != "ppo", ("group_size", "sequence_reward", "advantage_std")),
        ("loss='ppo' or 'grpo'", lambda c: c.loss != "gspo", ("clip_epsilon",)),
        ("loss='gspo'", lambda c: c.loss == "gspo", ("gspo_clip_epsilon", "gspo_clip_epsilon_high")),
        # an rware id fixes its agents and episode length and has no shaping: they were recorded and unread there
        # (episode_steps is also the grouped losses' rollout length, read on any env)
        *(("an env that reads it (its registry entry's multi_agent_fields, e.g. Warehouse-v0's)",
           lambda c, f=f: _env_reads(c.env, f) or (f == "episode_steps" and c.loss != "ppo"), (f,)) for f in ENV_FIELDS),
    )
    run: RunConfig = field(default_factory=lambda: RunConfig(torch_threads=0, checkpoint_every=0, keep_checkpoints=2, eval_episodes=8))  # seed (parameters, action sampling, envs), device, snapshots (rlfunc.config.RunConfig); torch's threads left as they are, a snapshot only at the end, 2 kept, 8 warehouses (or rware episodes) per eval seed

    def __post_init__(self) -> None:
        check_fields(self)
        if self.loss not in LOSSES:
            raise ConfigError(f"loss={self.loss!r}: expected one of {LOSSES}")
        if self.critic not in CRITICS:
            raise ConfigError(f"critic={self.critic!r}: expected one of {CRITICS}")
        if self.sequence_reward not in ("team", "agent"):
            raise ConfigError(f"sequence_reward={self.sequence_reward!r}: expected 'team' or 'agent'")
        for name in ("n_agents", "episode_steps", "num_envs", "rollout_steps", "group_size", "total_steps",
                     "num_epochs", "num_minibatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: expected an int >= 1")
        if not self.hidden or any(h <= 0 for h in self.hidden):  # 0 trained a bias-only policy; -3 was torch's traceback
            raise ConfigError(f"hidden={self.hidden}: expected at least one layer width, each positive")
        require_default(self.run, env_workers="mappo's envs step in the learner's process (torch-batched on the device, or rware's)", num_seeds="mappo trains one seed per run", vmap="mappo trains one seed per run",
                        precision="mappo has no mixed precision", log_every="mappo logs every iteration")
        if self.loss != "ppo" and self.group_size < 2:  # a group of one has advantage 0: no gradient, silently
            raise ConfigError(f"group_size={self.group_size} with loss={self.loss!r}: expected >= 2 (the advantage is relative "
                              "to the group's other episodes)")
        if not self.eval_seeds:  # else found only after the whole training
            raise ConfigError("eval_seeds=(): expected at least one seed for the final evaluation")
        if any(not 0 <= seed < 2**32 for seed in self.eval_seeds):  # -1 failed in numpy after the whole training
            raise ConfigError(f"eval_seeds={self.eval_seeds}: expected seeds in [0, 2**32)")
        # the final evaluation steps eval_episodes envs per eval seed at once (rlfunc eval's cap); 5000 x 3 seeds
        # trained to the end and was then killed for memory (24 GB)
        check_episodes(self.run.eval_episodes, len(self.eval_seeds), "run.eval_episodes")
        if self.loss != "ppo" and self.num_envs % self.group_size:
            raise ConfigError(f"num_envs={self.num_envs} is not a multiple of group_size={self.group_size}")
        self.check_data_parallel()  # before torchrun starts the ranks
        if not (0 <= self.gamma <= 1 and 0 <= self.lmbda <= 1):
            raise ConfigError(f"gamma={self.gamma}, lmbda={self.lmbda}: expected values in [0, 1]")
        if not self.lr > 0 or not 0 <= self.entropy_coef < math.inf or not 0 <= self.value_coef < math.inf or not self.max_grad_norm > 0:
            raise ConfigError("lr and max_grad_norm must be > 0, entropy_coef and value_coef finite and >= 0")
        for name in ("clip_epsilon", "gspo_clip_epsilon", "gspo_clip_epsilon_high"):  # else found at the first update, run dir written
            if not 0 < getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a value in (0, 1)")

    def check_data_parallel(self) -> None:
        """ConfigError, one line, unless ``run.nproc`` = W ranks can split this run: its env must
        split (a registry entry with ``multi_agent_split``: Warehouse-v0, not rware's host envs); W
        must divide ``num_envs`` (grpo/gspo: the groups, num_envs / group_size, which stay whole on a
        rank) and every minibatch (:attr:`minibatch_size` samples: each rank's share); ``--compile
        on`` is single-process. Nothing at W = 1."""
        W = self.run.nproc
        if W == 1:
            return
        from rlfunc.envs import registry

        entry = registry.find(self.env)
        if entry is None or not entry.multi_agent_split:
            splits = ", ".join(i for i in registry.ids("multi_agent_env") if registry.find(i).multi_agent_split)
            raise ConfigError(f"env={self.env!r} with nproc={W}: a data-parallel mappo run splits a torch-batched env ({splits}); "
                              "train it in one process")
        if self.loss == "ppo":
            data_parallel.check_divides(W, num_envs=self.num_envs)
        else:
            data_parallel.check_divides(W, **{"num_envs/group_size": self.num_envs // self.group_size})
        if self.minibatch_size % W:
            raise ConfigError(f"num_minibatches={self.num_minibatches}: its minibatches of {self.minibatch_size} samples "
                              f"do not divide by the {W} ranks of the data-parallel run")
        if self.run.compile == "on":
            raise ConfigError(f"run.compile='on' with nproc={W}: mappo's compiled step is not data-parallel; "
                              "expected --compile off or auto with --nproc")

    @property
    def minibatch_size(self) -> int:
        """Samples per minibatch: agent-steps (ppo) or agent sequences (grpo/gspo) of an iteration's
        batch over ``num_minibatches`` (rounded down; at least 1)."""
        per_env = self.n_agents * (self.rollout_steps if self.loss == "ppo" else 1)
        return max(1, self.num_envs * per_env // self.num_minibatches)

    @property
    def steps_per_iteration(self) -> int:
        """Env steps per iteration: num_envs * (rollout_steps for ppo, episode_steps for grpo/gspo)."""
        return self.num_envs * (self.rollout_steps if self.loss == "ppo" else self.episode_steps)

    @property
    def num_iterations(self) -> int:
        """Iterations for ``total_steps``, rounded up (as every algorithm's budget; 8192 steps of 800 were 10)."""
        return -(-self.total_steps // self.steps_per_iteration)

    @property
    def num_updates(self) -> int:
        """Gradient steps of the whole run."""
        return self.num_iterations * self.num_epochs * self.num_minibatches


class Nets(NamedTuple):
    """Skeletons for ``functional_call``: actor o_i -> logits [n_actions], critic critic-input -> [1]."""

    actor: nn.Module
    critic: nn.Module


PRESETS: dict[str, dict] = {
    # Warehouse-v0, 20 AGVs: the settings of bench/RESULTS.md ("Shared-parameter multi-agent PPO"):
    # 16 warehouses x 50-step rollouts, 100-step training episodes with BFS-progress shaping and a
    # conflict penalty of 0.5, lr 1e-3 annealed over 300k env steps. PPO: 27.9 deliveries per 100
    # steps, median of 3 seeds (93% of the PIBT planner's 30.0), 2.6 conflicts per 100 steps.
    "Warehouse-v0": dict(
        num_envs=16, rollout_steps=50, episode_steps=100, shaping_scale=0.05, conflict_penalty=0.5,
        lr=1e-3, total_steps=300_000, group_size=4, sequence_reward="agent",
    ),
}


def preset(env: str, **overrides) -> MAPPOConfig:
    """The preset of ``env`` (MAPPOConfig's defaults for envs without one), then ``overrides``.

    Raises:
        ConfigError: as :class:`MAPPOConfig`, or an override the chosen loss does not read
            (:attr:`MAPPOConfig.dependents`)."""
    base = replace(MAPPOConfig(), **{**PRESETS.get(env, {}), "env": env})
    config = replace(base, **overrides)
    check_dependents(config, base)
    return config


def critic_input(observation: Tensor, critic: str) -> Tensor:
    """The critic's input per agent: o_i (``"local"``), [o_i, mean_j o_j] (``"mean"``) or [o_i, o_1..o_A] (``"concat"``).

    Args:
        observation: [*B, A, D] float, every agent's observation of one env along dim -2.

    Returns:
        [*B, A, D] / [*B, A, 2D] / [*B, A, (A + 1) D] float.
    """
    if critic == "local":
        return observation
    a = observation.shape[-2]
    if critic == "mean":
        other = observation.mean(-2, keepdim=True)
    elif critic == "concat":
        other = observation.flatten(-2).unsqueeze(-2)
    else:
        raise ConfigError(f"critic={critic!r}: expected one of {CRITICS}")
    return torch.cat([observation, other.expand(*observation.shape[:-2], a, other.shape[-1])], -1)


def critic_in_features(obs_dim: int, n_agents: int, critic: str) -> int:
    return {"local": obs_dim, "mean": 2 * obs_dim, "concat": (n_agents + 1) * obs_dim}[critic]


def make_nets(config: MAPPOConfig, obs_dim: int, n_agents: int, n_actions: int) -> Nets:
    """Actor (out gain 0.01: near-uniform start) and critic (out gain 1) MLPs, seeded by ``config.run.seed``."""
    actor = seeded_init(lambda: MLP(obs_dim, n_actions, config.hidden, config.activation, out_gain=0.01), config.run.seed)
    cin = critic_in_features(obs_dim, n_agents, config.critic)
    critic = seeded_init(lambda: MLP(cin, 1, config.hidden, config.activation, out_gain=1.0), config.run.seed + 1)
    return Nets(actor, critic)


def policy_logits(nets: Nets, params: TensorDict, observation: Tensor, action_mask: Tensor | None) -> Tensor:
    """Masked logits [*B, A, K] of every agent from its own observation [*B, A, D] (shared parameters)."""
    return masked_logits(func.apply(nets.actor, params["actor"], observation), action_mask)


def state_value(nets: Nets, params: TensorDict, observation: Tensor, critic: str) -> Tensor:
    """V [*B, A, 1] of every agent from :func:`critic_input` of the observations [*B, A, D]."""
    return func.apply(nets.critic, params["critic"], critic_input(observation, critic))


def per_agent_gae(config: MAPPOConfig, batch: TensorDict) -> tuple[Tensor, Tensor]:
    """GAE per agent over a rollout [N, T] with agent keys [N, T, A, ...] -> (advantage, value_target) [N, A, T, 1].

    Uses ("next", "agents", "reward") [N, T, A, 1], "state_value" / ("next", "state_value") [N, T, A, 1]
    and ("next", "done" | "terminated") [N, T, 1], expanded to every agent (TorchRL MAPPO tutorial).
    """
    reward = batch["next", "agents", "reward"]
    shape = reward.shape
    done = batch["next", "done"].unsqueeze(-2).expand(shape)
    terminated = batch["next", "terminated"].unsqueeze(-2).expand(shape)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  [N, T, A, 1] -> [N, A, T, 1]
    return generalized_advantage_estimate(
        config.gamma, config.lmbda, t(batch["state_value"]), t(batch["next", "state_value"]), t(reward),
        t(done), t(terminated), time_dim=-2,
    )


def ppo_agent_loss(nets: Nets, config: MAPPOConfig, params: TensorDict, mb: TensorDict,
                   normalize_advantages: bool = True, poolable: bool = False) -> tuple[Tensor, TensorDict]:
    """PPO loss of a minibatch of agent-steps [M]: "observation" [M, D], "critic_observation" [M, C],
    "action_mask" [M, K] bool, "action" [M] int64, "sample_log_prob", "advantage", "value_target",
    "state_value" [M, 1] float. Advantages are normalised over the minibatch (ppo_loss's default;
    ``normalize_advantages=False``: already normalised, as a data-parallel rank's share is; ``poolable``:
    ppo_loss's, for a rank's share)."""
    logits = masked_logits(func.apply(nets.actor, params["actor"], mb["observation"]), mb.get("action_mask", None))
    log_prob = categorical_log_prob(logits, mb["action"])
    value = func.apply(nets.critic, params["critic"], mb["critic_observation"])
    return ppo_loss(
        log_prob, mb["sample_log_prob"], mb["advantage"], value, mb["value_target"],
        entropy=categorical_entropy(logits), clip_epsilon=config.clip_epsilon,
        entropy_coef=config.entropy_coef, value_coef=config.value_coef, normalize_advantages=normalize_advantages,
        poolable=poolable,
    )


def sequence_advantage(config: MAPPOConfig, reward: Tensor, group_size: int) -> Tensor:
    """Group-relative advantage of each agent's sequence.

    Args:
        reward: [N, T, A, 1] float per-agent rewards of N = n_groups * G rollouts laid out group by group.

    Returns:
        [N, A, 1, 1] float: one advantage per (rollout, agent) sequence.
    """
    n, _, a, _ = reward.shape
    per_agent = reward.sum((1, 3))  # [N, A]
    grouped = per_agent.view(n // group_size, group_size, a)
    if config.sequence_reward == "team":
        adv = group_relative_advantage(grouped.sum(-1), group_dim=-1, std=config.advantage_std)  # [n, G]
        adv = adv.unsqueeze(-1).expand(-1, -1, a)
    else:
        adv = group_relative_advantage(grouped, group_dim=1, std=config.advantage_std)
    return adv.reshape(n, a, 1, 1)


def sequence_loss(nets: Nets, config: MAPPOConfig, params: TensorDict, mb: TensorDict) -> tuple[Tensor, TensorDict]:
    """GRPO / GSPO loss of a minibatch of agent sequences [M, T]: "observation" [M, T, D],
    "action_mask" [M, T, K], "action" [M, T], "sample_log_prob" [M, T, 1], "advantage" [M, 1, 1]; all steps valid."""
    logits = masked_logits(func.apply(nets.actor, params["actor"], mb["observation"]), mb.get("action_mask", None))
    log_prob = categorical_log_prob(logits, mb["action"])
    if config.loss == "grpo":
        loss, metrics = grpo_loss(log_prob, mb["sample_log_prob"], mb["advantage"], clip_epsilon=config.clip_epsilon)
    else:
        loss, metrics = gspo_loss(
            log_prob, mb["sample_log_prob"], mb["advantage"],
            clip_epsilon=config.gspo_clip_epsilon, clip_epsilon_high=config.gspo_clip_epsilon_high,
        )
    entropy = categorical_entropy(logits).mean()
    metrics["entropy"] = entropy.detach()
    return loss - config.entropy_coef * entropy, metrics


class MAPPO(NamedTuple):
    init: object  # () -> state TensorDict
    act: object  # (state, observation [*B, A, D], action_mask | None, generator, greedy, own_rows) -> (action, log_prob, value)
    iteration: object  # (state, batch, generator) -> (state, metrics dict)
    nets: Nets


def make_mappo(config: MAPPOConfig, obs_dim: int, n_agents: int, n_actions: int, device: torch.device, dist=None) -> MAPPO:
    """Build the pure pieces of shared-parameter PPO / GRPO / GSPO for agents with ``obs_dim``-long
    observations and ``n_actions`` discrete actions.

    ``dist``: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run of W
    ranks. Rank r then collects envs r*N/W .. (r+1)*N/W - 1 of the ``config.num_envs`` = N, all
    agents of an env on one rank (grpo/gspo: whole groups), and ``iteration`` equals the
    single-process one on all N envs, to float rounding (:mod:`rlfunc.algos.data_parallel`): ``act``
    draws the uniforms of all N envs and keeps its rows (``act(..., own_rows=False)``: of these envs
    only, for an evaluation); ``iteration`` all-gathers the batch (rank order: the single process's
    env order), every rank draws the same minibatch order and takes its share of every minibatch,
    ppo's advantages are normalised over the whole minibatch before the share is taken, and one
    ``all_reduce_mean`` of the gradients, the loss and the metrics precedes the norm and the chain.
    W must divide N (grpo/gspo: the groups) and :attr:`MAPPOConfig.minibatch_size`; the compiled
    step is single-process (``--compile auto`` runs eager with W > 1).

    ``iteration`` takes a rollout batch [N, T] from :func:`rlfunc.run.mappo.collect` with
    ("agents", "observation") [N, T, A, D], ("agents", "action_mask") [N, T, A, K] (optional),
    ("agents", "action") [N, T, A], ("agents", "sample_log_prob") / "state_value" [N, T, A, 1],
    ("next", "agents", "reward") [N, T, A, 1], ("next", "state_value") [N, T, A, 1] (ppo),
    ("next", "done" | "terminated") [N, T, 1]; for grpo/gspo the N rollouts are groups of
    ``group_size`` from one start state, each exactly one episode.

    The learner state: "params" ("actor", "critic"), "iteration" and "env_steps" (0-dim int64), and
    "optim", the state of ``chain(clip_by_global_norm(max_grad_norm, stacked=False), adam(lr, eps=1e-5))``:
    "0" {"norm": [1], the last pre-clip gradient norm}, "1" {"step", "exp_avg", "exp_avg_sq"}, Adam's
    per-leaf step counts (0-dim float32) and moments (like "params"). grpo/gspo never use the critic:
    it is left out of their gradients, so it and its Adam state stay at their initial values.
    """
    W, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)
    per_env = n_agents * (config.rollout_steps if config.loss == "ppo" else 1)  # samples of one env's rollout
    if config.num_minibatches > config.num_envs * per_env:  # empty minibatches: ppo_loss's error after the first rollout
        raise ConfigError(f"num_minibatches={config.num_minibatches}: more than the {config.num_envs * per_env} samples of an "
                          f"iteration (num_envs={config.num_envs} x {n_agents} agents"
                          f"{f' x rollout_steps={config.rollout_steps}' if config.loss == 'ppo' else ' sequences'})")
    if W > 1:
        data_parallel.check_divides(W, num_envs=config.num_envs,
                                    minibatch_size=max(1, config.num_envs * per_env // config.num_minibatches))
        if config.run.compile == "on":
            raise ConfigError(f"run.compile='on' with {W} ranks: mappo's compiled step runs in one process; expected --compile off or auto")
    own = data_parallel.own_rows(rank, W)  # the uniforms of this rank's envs
    reduce = all_reduce_mean(None if dist is None else dist.group)  # data parallel: ahead of the chain (stateless)
    nets = make_nets(config, obs_dim, n_agents, n_actions)
    nets = Nets(nets.actor.to(device), nets.critic.to(device))
    optimizer = chain(clip_by_global_norm(config.max_grad_norm, stacked=False), adam(config.lr, eps=1e-5))
    trained = ("actor", "critic") if config.loss == "ppo" else ("actor",)  # what the loss differentiates

    def init() -> TensorDict:
        params = TensorDict({"actor": func.params_from_module(nets.actor), "critic": func.params_from_module(nets.critic)},
                            batch_size=[], device=device)
        params = func.as_leaves(params)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return TensorDict({"params": params, "optim": optimizer.init(params), "iteration": zero, "env_steps": zero.clone()},
                          batch_size=[], device=device)

    @torch.no_grad()
    def act(state: TensorDict, observation: Tensor, action_mask: Tensor | None, generator, greedy: bool = False,
            own_rows: bool = True):
        params = state["params"]
        logits = policy_logits(nets, params, observation, action_mask)
        if greedy:
            action = logits.argmax(-1)
        elif W > 1 and own_rows:  # the uniforms of every rank's envs ([N, A, K] of the single process), this rank's rows
            u = own(lambda n: torch.rand((n, *logits.shape[1:]), generator=generator, device=logits.device, dtype=logits.dtype),
                    logits.shape[0], 0)
            action = categorical_sample(logits, noise=u)
        else:
            action = categorical_sample(logits, generator)
        log_prob = categorical_log_prob(logits, action)
        value = state_value(nets, params, observation, config.critic) if config.loss == "ppo" else None
        return action, log_prob, value

    def _ppo_samples(batch: TensorDict) -> TensorDict:
        advantage, value_target = per_agent_gae(config, batch)  # [N, A, T, 1]
        obs = batch["agents", "observation"]  # [N, T, A, D]
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        samples = {
            "observation": obs, "critic_observation": critic_input(obs, config.critic),
            "action": batch["agents", "action"], "sample_log_prob": batch["agents", "sample_log_prob"],
            "state_value": batch["state_value"], "advantage": t(advantage), "value_target": t(value_target),
        }
        if ("agents", "action_mask") in batch.keys(True):
            samples["action_mask"] = batch["agents", "action_mask"]
        n, T, a = batch["agents", "action"].shape
        return TensorDict(samples, batch_size=[n, T, a]).reshape(-1)

    def _sequences(batch: TensorDict) -> TensorDict:
        adv = sequence_advantage(config, batch["next", "agents", "reward"], config.group_size)  # [N, A, 1, 1]
        t = lambda x: x.transpose(1, 2)  # noqa: E731  [N, T, A, ...] -> [N, A, T, ...]
        seq = {"observation": t(batch["agents", "observation"]), "action": t(batch["agents", "action"]),
               "sample_log_prob": t(batch["agents", "sample_log_prob"]), "advantage": adv}
        if ("agents", "action_mask") in batch.keys(True):
            seq["action_mask"] = t(batch["agents", "action_mask"])
        n, T, a = batch["agents", "action"].shape
        return TensorDict(seq, batch_size=[n, a]).reshape(-1)

    # --compile: one minibatch's step as one pure function of flat leaf lists (the form torch.compile takes whole)
    trained_def = flatten(TensorDict({"actor": func.params_from_module(nets.actor), "critic": func.params_from_module(nets.critic)},
                                     batch_size=[]).select(*trained))[1]
    loss_of = ppo_agent_loss if config.loss == "ppo" else sequence_loss

    def grad_step(w: list[Tensor], opt: tuple[list[Tensor], tuple], mb: dict, lr: Tensor):
        """The loss's gradient by torch.func.grad over the trained leaves ``w``, then ``optimizer``'s
        chain in place on ``w`` and ``opt`` (rlfunc.optim.leaves.chain_step: a non-finite loss or norm
        moves nothing, without a host read). ``mb``: the minibatch's tensors; ``lr``: 0-dim float32.
        Returns (loss, metrics, norm), 0-dim each."""

        def objective(leaves):
            loss, metrics = loss_of(nets, config, unflatten(trained_def, leaves), mb)
            return loss, (loss, metrics)

        grads, (loss, metrics) = torch.func.grad(objective, has_aux=True)(w)
        norm = chain_step(optimizer, grads, w, trained_def, opt, loss, lr=lr)
        return loss.detach(), {k: v.detach() for k, v in metrics.items()}, norm

    compiled = W == 1 and (config.run.compile == "on" or (config.run.compile == "auto" and config.num_updates >= AUTO_COMPILE_UPDATES))
    compiled_step = compile_step(grad_step, device, config.run.compile, "mappo", static_args=(0, 1)) if compiled else None
    reported: list[bool] = []  # compile_s went into a metrics line already

    def iteration(state: TensorDict, batch: TensorDict, generator) -> tuple[TensorDict, dict]:
        """One update on ``batch`` at the learning rate ``linear_lr(lr, state["iteration"],
        num_iterations, anneal_lr)``; the parameters and Adam's moments are stepped in place.
        Compiled, each minibatch's step is ``grad_step`` and the metrics are read once, after the
        epochs.

        Raises:
            FloatingPointError: a non-finite loss or gradient norm (compiled: after the epochs, the
                non-finite steps having moved nothing).
        """
        if W > 1:  # every rank's envs in rank order: the single process's batch
            batch = dist.all_gather_batch(batch, dim=0)
        params = state["params"]
        leaves, treedef = flatten(params.select(*trained))  # the chain's leaf order (rlfunc.optim.base)
        lr = linear_lr(config.lr, int(state["iteration"]), config.num_iterations, config.anneal_lr)
        optim_state = state["optim"]
        if config.loss == "ppo":
            data, loss_fn = _ppo_samples(batch), ppo_agent_loss
        else:
            data, loss_fn = _sequences(batch), sequence_loss
        size = data.batch_size[0]
        mb_size = max(1, size // config.num_minibatches)
        share = mb_size // W  # this rank's samples of each minibatch
        totals: dict[str, float] = {}
        updates = 0
        if compiled_step is not None:  # the step writes into these views of the params and the chain's state
            w, opt, lr_tensor = [p.detach() for p in leaves], chain_state(optim_state), torch.tensor(lr, dtype=torch.float32, device=device)
            sums, bad = None, torch.zeros((), dtype=torch.int64, device=device)
        for _ in range(config.num_epochs):
            perm = torch.randperm(size, generator=generator, device=device)
            for k in range(config.num_minibatches):
                index = perm[k * mb_size:(k + 1) * mb_size]
                mb = data[index if W == 1 else index[rank * share:(rank + 1) * share]]
                if compiled_step is not None:
                    loss, metrics, norm = compiled_step(w, opt, {key: mb.get(key) for key in mb.keys()}, lr_tensor)
                    metrics = {**metrics, "grad_norm": norm}
                    sums = {key: v.clone() for key, v in metrics.items()} if sums is None else {key: sums[key] + v for key, v in metrics.items()}
                    bad += (~(loss.isfinite() & norm.isfinite())).long()
                    updates += 1
                    continue
                if W > 1 and config.loss == "ppo":  # the whole minibatch's advantages normalised (as the loss would), then the share
                    mb["advantage"] = normalize_advantage(data["advantage"][index])[rank * share:(rank + 1) * share]
                    loss, metrics = loss_fn(nets, config, params, mb, normalize_advantages=False, poolable=True)
                else:
                    loss, metrics = loss_fn(nets, config, params, mb)
                for p in leaves:
                    p.grad = None
                loss.backward()
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in leaves]
                if W > 1:  # all_reduce_mean, with the loss and metrics in its buffer: every rank decides alike
                    grads, loss, metrics = data_parallel.average(reduce, grads, treedef, loss, metrics, maxima=EV_MAXIMA,
                                                                 moments=EV_MOMENTS, rank=rank, world_size=W)
                    metrics = pool_explained_variance(metrics)  # the minibatch's, from the shares' parts
                norms = member_grad_norms(grads, stacked=False)
                if not bool(loss.isfinite() & norms.isfinite().all()):
                    raise FloatingPointError(f"mappo: non-finite loss {float(loss)} or gradient norm at update {updates}")
                delta, optim_state = optimizer.update_leaves(grads, treedef, optim_state, params, lr=lr, grad_norm=norms)
                with torch.no_grad():  # rlfunc.optim.apply_updates over the leaves
                    torch._foreach_add_(leaves, delta)
                metrics["grad_norm"] = norms[0]
                for key, v in metrics.items():
                    totals[key] = totals.get(key, 0.0) + float(v)
                updates += 1
        if compiled_step is not None:
            if int(bad):
                raise FloatingPointError(f"mappo: non-finite loss or gradient norm at {int(bad)} of {updates} updates (compiled; those steps moved nothing)")
            totals = {key: float(v) for key, v in sums.items()}
        out = state.clone(recurse=False)
        out["optim"] = optim_state
        n, T = batch.batch_size[:2]
        out["iteration"] = state["iteration"] + 1
        out["env_steps"] = state["env_steps"] + n * T
        metrics = {k: v / updates for k, v in totals.items()}
        if getattr(compiled_step, "compile_s", None) is not None and not reported:  # none where compile_step ran eager
            metrics["compile_s"] = compiled_step.compile_s  # the first metrics line
            reported.append(True)
        return out, metrics

    return MAPPO(init, act, iteration, nets)


register("mappo", AlgorithmEntry(
    config="rlfunc.algos.mappo:MAPPOConfig", run="rlfunc.run.mappo:MAPPORun", command="rlfunc.cli.mappo:train",
    evaluate="rlfunc.run.mappo:evaluate_run",
    needs="multi-agent",  # a multi-agent builder and evaluation in the env registry
    usage="    rlfunc train mappo [--env Warehouse-v0|rware-tiny-2ag-v2] [--loss ppo|grpo|gspo] [--critic local|mean|concat]\n"
          "                                            shared-parameter multi-agent policy (agents as a batch dim)",
))

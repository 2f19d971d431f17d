"""TD3 with an MLP actor (Fujimoto et al. 2018): twin critics, target policy smoothing, delayed actor
and target updates, Gaussian exploration noise.

Per gradient step: the critics regress on the clipped double-Q target at the smoothed target action
(eq. 10 and 14, :func:`rlfunc.losses.td3.smoothed_target_action`); every ``policy_delay``-th step the
actor ascends Q_1(s, mu(s)) (through the critic's detached params) and the target actor and critics
follow by Polyak averaging. ``policy_delay=1, policy_noise=0, num_critics=1`` is DDPG.

Actions: the actor's tanh output in [-1, 1] (plus noise, clipped) is what the critics and the buffer
see; the env gets it scaled to its bounds.

The update is two pure functions of flat leaf lists (the critic step; the actor step with the
target updates), compiled with ``--compile on`` (``auto``: runs of >= 5,000 gradient steps) as two
torch.compile graphs; eager and compiled agree within 1e-5 (tests/optim/test_compiled_step.py).

Data parallel (``--nproc W``): each rank steps its share of the envs and takes B/W of every minibatch,
each step's gradients averaged in one all_reduce, so every rank takes the single process's critic
and delayed actor steps, eagerly (:func:`make_td3`'s ``dist``; why, and what it costs:
:mod:`rlfunc.algos.offpolicy`); tests/algos/test_offpolicy_data_parallel.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.algos import data_parallel
from rlfunc.algos.offpolicy import (AUTO_COMPILE_UPDATES, OffPolicy, OffPolicyConfig, StepMetrics, acting_forward, action_scale,
                                   q_ensemble, sample, stacked)
from rlfunc.algos.ppo import EnvSpec
from rlfunc.algos.registry import AlgorithmEntry, register
from rlfunc.config import replace
from rlfunc.core import func
from rlfunc.errors import ConfigError
from rlfunc.losses.td3 import critic_loss, smoothed_target_action, td3_actor_loss, td3_target
from rlfunc.nets.mlp import MLP, seeded_init
from rlfunc.device import compile_step
from rlfunc.optim import adam, all_reduce_mean, chain, clip_by_global_norm, flatten
from rlfunc.optim.base import unflatten
from rlfunc.optim.leaves import chain_state, chain_step, leaf_list, skipped


@dataclass(frozen=True)
class TD3Config(OffPolicyConfig):
    """Every TD3 hyperparameter, with its default (Stable-Baselines3's / RL-Zoo's). Steps count env steps."""

    name: ClassVar[str] = "td3"
    compiles: ClassVar[bool] = True  # --compile: the critic and actor steps through torch.compile

    tau: float = 0.005  # Polyak rate of the target actor and critics, in (0, 1]
    actor_lr: float = 1e-3  # Adam lr of the actor
    critic_lr: float = 1e-3  # Adam lr of the critics
    exploration_noise: float = 0.1  # std of the Gaussian noise on executed actions, in [-1, 1] units
    policy_noise: float = 0.2  # target policy smoothing std, in [-1, 1] units
    noise_clip: float = 0.5  # clip of the smoothing noise
    policy_delay: int = 2  # critic updates per actor (and target) update
    num_critics: int = 2  # ensemble size (min over members in the target; the actor follows member 0)
    hidden: tuple[int, ...] = (400, 300)  # MLP widths of the actor and of each critic (SB3's TD3 default)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("exploration_noise", "policy_noise", "noise_clip"):  # inf: bang-bang actions, NaN smoothing noise
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ConfigError(f"{name}={getattr(self, name)}: expected a finite value >= 0")
        if isinstance(self.policy_delay, bool) or not isinstance(self.policy_delay, int) or self.policy_delay < 1:
            raise ConfigError(f"policy_delay={self.policy_delay!r}: expected a positive integer")


PRESETS: dict[str, dict] = {
    # RL-Zoo (hyperparams/td3.yml): Pendulum-v1 20k steps, gamma 0.98, buffer 200k, learning_starts 10k,
    # normal noise 0.1, lr 1e-3, [400, 300]
    "Pendulum-v1": dict(total_steps=20_000, gamma=0.98, buffer_size=200_000, learning_starts=10_000, num_steps=1_000),
    # RL-Zoo: HalfCheetah 1M steps, learning_starts 10k, noise 0.1, SB3's defaults
    "HalfCheetah-v5": dict(total_steps=1_000_000, learning_starts=10_000, num_steps=5_000),
}


def preset(env: str, **overrides) -> TD3Config:
    """The preset for ``env`` (the defaults for envs without one), then ``overrides``."""
    return replace(TD3Config(), **{**PRESETS.get(env, {}), "env": env, **overrides})


def make_td3(config: TD3Config, spec: EnvSpec, device: torch.device, dist=None) -> OffPolicy:
    """Build TD3's pure pieces for envs described by ``spec`` (bounded Box actions).

    The learner state is one TensorDict on ``device``: "params" {"actor" (MLP obs -> tanh -> [-1, 1]^A),
    "critic" [E, ...]}, "target" {"actor", "critic"}, "optim_actor" and "optim_critic" (each
    ``chain([clip_by_global_norm,] adam(lr))``), "rng" (exploration and smoothing noise, minibatches),
    "iteration", "env_steps", "updates" (critic steps so far: the actor steps when it is a multiple
    of ``policy_delay``).

    ``dist``: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run of W
    ranks (:mod:`rlfunc.algos.data_parallel`): the policy acts for this rank's N/W envs with its rows
    of the N envs' exploration noise; each critic and actor step takes this rank's B/W of the
    minibatch (and of the smoothing noise) and averages its gradients, loss and metrics over the
    ranks in one all_reduce before its chain, so every rank takes the single process's step (the
    delayed actor steps and the Polyak updates with them); the update is then eager.

    Raises:
        ConfigError: the action bounds are not finite; W does not divide ``num_envs`` or ``batch_size``.
    """
    A = spec.act_dim
    W, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)
    data_parallel.check_divides(W, num_envs=config.num_envs, batch_size=config.batch_size)
    own = data_parallel.own_rows(rank, W)  # the noise rows of this rank's envs
    reduce = all_reduce_mean(None if dist is None else dist.group)
    scale = action_scale(spec.action_low, spec.action_high, device)
    make_actor = lambda: torch.nn.Sequential(*MLP(spec.obs_dim, A, config.hidden, config.activation), torch.nn.Tanh())  # noqa: E731
    actor = make_actor().to(device)
    critics = q_ensemble(spec.obs_dim, A, config.hidden, [config.run.seed + 1 + e for e in range(config.num_critics)],
                         device, activation=config.activation)
    clip = [clip_by_global_norm(config.max_grad_norm)] if config.max_grad_norm else []
    actor_opt = chain(*clip, adam(config.actor_lr))
    critic_opt = chain(*clip, adam(config.critic_lr))

    def init() -> TensorDict:
        actor_params = func.params_from_module(seeded_init(make_actor, config.run.seed).to(device))
        critic = critics.init()
        gen = torch.Generator(device=device).manual_seed(config.run.seed)
        zero = lambda: torch.zeros((), dtype=torch.int64, device=device)  # noqa: E731
        state = TensorDict({
            "params": {"actor": actor_params, "critic": critic},
            "target": {"actor": actor_params.detach().clone(), "critic": critic.detach().clone()},
            "rng": gen.get_state(), "iteration": zero(), "env_steps": zero(), "updates": zero(),
        }, batch_size=[], device=device)
        state["optim_actor"] = actor_opt.init(state["params", "actor"])
        state["optim_critic"] = critic_opt.init(state["params", "critic"])
        return state

    forward_of = acting_forward(actor, config, device, "td3's acting policy")

    def policy(state: TensorDict, generator: torch.Generator | None, deterministic: bool = False):
        forward = forward_of(state["params", "actor"])

        def act(observation: Tensor) -> tuple[Tensor, None]:
            action = forward(observation)
            if not deterministic and config.exploration_noise > 0:
                noise = own(lambda n: torch.randn((n, A), generator=generator, device=device), action.shape[0], 0)
                action = (action + config.exploration_noise * noise).clamp(-1.0, 1.0)
            return scale.to_env(action), None

        return act

    # the update as two pure functions of flat leaf lists (the form torch.compile takes whole)
    _, actor_def = flatten(func.params_from_module(actor))
    _, critic_def = flatten(critics.init())
    E = config.num_critics

    def critic_step(target_actor_w: list[Tensor], critic_w: list[Tensor], target_critic_w: list[Tensor],
                    opt: tuple[list[Tensor], tuple], mb: dict, eps: Tensor) -> dict:
        """The critics' step on the clipped double-Q target at the smoothed target action (``eps``:
        [B, A] standard normal), in place on ``critic_w`` and ``opt``."""
        with torch.no_grad():
            next_action = func.apply(actor, unflatten(actor_def, target_actor_w), mb["next_observation"])
            next_action = smoothed_target_action(next_action, eps, policy_noise=config.policy_noise, noise_clip=config.noise_clip)
            y = td3_target(critics.values(stacked(critic_def, target_critic_w, E), mb["next_observation"], next_action),
                           mb["reward"], mb["terminated"], config.gamma)

        def objective(w):
            loss, m = critic_loss(critics.values(stacked(critic_def, w, E), mb["observation"], mb["action"]), y)
            return loss, (loss, m)

        grads, (loss, m) = torch.func.grad(objective, has_aux=True)(critic_w)
        metrics = m.to_dict()
        metrics["target_q"] = y.mean()
        if W > 1:
            grads, loss, metrics = mean_over_ranks(grads, loss, metrics)
        metrics["critic_grad_norm"] = chain_step(critic_opt, grads, critic_w, critic_def, opt, loss)
        metrics["skipped_critic"] = skipped(metrics["critic_grad_norm"], loss)
        return {k: v.detach() for k, v in metrics.items()}

    def actor_step(actor_w: list[Tensor], critic_w: list[Tensor], target_actor_w: list[Tensor], target_critic_w: list[Tensor],
                   opt: tuple[list[Tensor], tuple], mb: dict) -> dict:
        """The actor's step on -Q_1(s, mu(s)) (critic 0, detached), then the Polyak updates of both targets."""
        q1_params = unflatten(critic_def, [w[0].detach() for w in critic_w])

        def objective(w):
            loss, m = td3_actor_loss(critics.value(q1_params, mb["observation"], func.apply(actor, unflatten(actor_def, w), mb["observation"])))
            return loss, (loss, m)

        grads, (loss, m) = torch.func.grad(objective, has_aux=True)(actor_w)
        metrics = m.to_dict()
        if W > 1:
            grads, loss, metrics = mean_over_ranks(grads, loss, metrics)
        metrics["actor_grad_norm"] = chain_step(actor_opt, grads, actor_w, actor_def, opt, loss)
        metrics["skipped_actor"] = skipped(metrics["actor_grad_norm"], loss)
        with torch.no_grad():
            torch._foreach_lerp_(target_actor_w, [w.detach() for w in actor_w], config.tau)
            torch._foreach_lerp_(target_critic_w, [w.detach() for w in critic_w], config.tau)
        return {k: v.detach() for k, v in metrics.items()}

    def mean_over_ranks(grads: list[Tensor], loss: Tensor, metrics: dict) -> tuple[list[Tensor], Tensor, dict]:
        """(gradients, loss, metrics) of this rank's share averaged over the ranks: one all_reduce."""
        grads, loss, mean = data_parallel.average(reduce, list(grads), None, loss, TensorDict(metrics, batch_size=[]))
        return grads, loss, mean.to_dict()

    updates_of_run = max(0, config.total_steps - config.learning_starts) * config.updates_per_step
    # a compiled step holds no collective: data-parallel runs are eager (the config refused --compile on)
    compiled = W == 1 and (config.run.compile == "on" or (config.run.compile == "auto" and updates_of_run >= AUTO_COMPILE_UPDATES))
    steps = ((compile_step(critic_step, device, config.run.compile, "td3", static_args=(0, 1, 2, 3)),
              compile_step(actor_step, device, config.run.compile, "td3", static_args=(0, 1, 2, 3, 4)))
             if compiled else (critic_step, actor_step))
    reported: list[bool] = []  # compile_s went into a metrics line already

    def iteration(state: TensorDict, buffer, generator: torch.Generator, num_updates: int, into: StepMetrics | None = None):
        """``num_updates`` critic steps (compiled with ``--compile``), an actor step and the target
        updates after every ``policy_delay``-th; per step the minibatch and the smoothing noise come
        from ``generator``. The leaf lists are taken once: the steps write into the state's tensors.
        Metrics and ``into``: as sac's ``iteration``."""
        params, target = state["params"], state["target"]
        actor_w, critic_w = leaf_list(params["actor"]), leaf_list(params["critic"])
        target_actor_w, target_critic_w = leaf_list(target["actor"]), leaf_list(target["critic"])
        opt_critic, opt_actor = chain_state(state["optim_critic"]), chain_state(state["optim_actor"])
        critic_fn, actor_fn = steps
        metric_sum = StepMetrics() if into is None else into  # skipped_* counted; the rest the mean of the finite values
        updates = int(state["updates"])
        for _ in range(num_updates):
            updates += 1
            mb = sample(buffer, config.batch_size, generator, device)
            tensors = {"observation": mb["observation"], "next_observation": mb["next", "observation"], "action": mb["action"],
                       "reward": mb["next", "reward"], "terminated": mb["next", "terminated"]}
            eps = torch.randn((mb.batch_size[0], A), generator=generator, device=device)
            if W > 1:  # this rank's share of the single process's minibatch and smoothing noise
                tensors = {k: data_parallel.share(v, rank, W) for k, v in tensors.items()}
                eps = data_parallel.share(eps, rank, W)
            metric_sum.add(critic_fn(target_actor_w, critic_w, target_critic_w, opt_critic, tensors, eps))
            if updates % config.policy_delay == 0:
                metric_sum.add(actor_fn(actor_w, critic_w, target_actor_w, target_critic_w, opt_actor, tensors))
        state["updates"] = torch.tensor(updates, device=device)
        state["rng"] = generator.get_state()
        metrics = TensorDict(metric_sum.result() if into is None else {}, batch_size=[])
        if compiled and critic_fn.compile_s is not None and not reported:
            acting = forward_of.compiled.compile_s if forward_of.compiled is not None else None  # the acting policy's
            metrics["compile_s"] = torch.tensor(critic_fn.compile_s + (actor_fn.compile_s or 0.0) + (acting or 0.0))
            reported.append(True)
        return state, metrics

    return OffPolicy(init, policy, iteration, scale, ("optim_actor", "optim_critic"), actor)


register("td3", AlgorithmEntry(
    config="rlfunc.algos.td3:TD3Config", run="rlfunc.run.offpolicy:OffPolicyRun", command="rlfunc.cli.offpolicy:train",
    evaluate="rlfunc.run.offpolicy:evaluate", needs="bounded-box-actions", family="offpolicy",
    deploy=(("params", "actor"),),
    usage="    rlfunc train td3 --env ENV_ID [--total-steps N] [--seed S] [--policy-delay D] [--run-dir DIR] [...]",
))

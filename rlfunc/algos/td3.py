"""TD3 with an MLP actor (Fujimoto et al. 2018): twin critics, target policy smoothing, delayed actor
and target updates, Gaussian exploration noise.

Per gradient step: the critics regress on the clipped double-Q target at the smoothed target action
(eq. 10 and 14, :func:`rlfunc.losses.td3.smoothed_target_action`); every ``policy_delay``-th step the
actor ascends Q_1(s, mu(s)) (through the critic's detached params) and the target actor and critics
follow by Polyak averaging. ``policy_delay=1, policy_noise=0, num_critics=1`` is DDPG.

Actions: the actor's tanh output in [-1, 1] (plus noise, clipped) is what the critics and the buffer
see; the env gets it scaled to its bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.algos.offpolicy import OffPolicy, OffPolicyConfig, action_scale, q_ensemble, sample
from rlfunc.algos.ppo import EnvSpec
from rlfunc.algos.registry import AlgorithmEntry, register
from rlfunc.config import replace
from rlfunc.core import func
from rlfunc.errors import ConfigError
from rlfunc.losses.td3 import critic_loss, smoothed_target_action, td3_actor_loss, td3_target
from rlfunc.nets.mlp import MLP, seeded_init
from rlfunc.optim import adam, chain, clip_by_global_norm
from rlfunc.optim.amp import transform_step


@dataclass(frozen=True)
class TD3Config(OffPolicyConfig):
    """Every TD3 hyperparameter, with its default (Stable-Baselines3's / RL-Zoo's). Steps count env steps."""

    name: ClassVar[str] = "td3"

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
        for name in ("exploration_noise", "policy_noise", "noise_clip"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: expected >= 0")
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


def make_td3(config: TD3Config, spec: EnvSpec, device: torch.device) -> OffPolicy:
    """Build TD3's pure pieces for envs described by ``spec`` (bounded Box actions).

    The learner state is one TensorDict on ``device``: "params" {"actor" (MLP obs -> tanh -> [-1, 1]^A),
    "critic" [E, ...]}, "target" {"actor", "critic"}, "optim_actor" and "optim_critic" (each
    ``chain([clip_by_global_norm,] adam(lr))``), "rng" (exploration and smoothing noise, minibatches),
    "iteration", "env_steps", "updates" (critic steps so far: the actor steps when it is a multiple
    of ``policy_delay``).

    Raises:
        ConfigError: the action bounds are not finite.
    """
    A = spec.act_dim
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

    def policy(state: TensorDict, generator: torch.Generator | None, deterministic: bool = False):
        forward = func.sequential_forward(actor, state["params", "actor"], stacked=False)

        def act(observation: Tensor) -> tuple[Tensor, None]:
            action = forward(observation)
            if not deterministic and config.exploration_noise > 0:
                noise = torch.randn(action.shape, generator=generator, device=device)
                action = (action + config.exploration_noise * noise).clamp(-1.0, 1.0)
            return scale.to_env(action), None

        return act

    def step_side(loss: Tensor, transform, state: TensorDict, key: str, params: TensorDict) -> Tensor:
        for leaf in func.leaves(params):
            leaf.grad = None
        loss.backward()
        norm, _, state[key] = transform_step(transform, state[key], params)
        return norm

    def update(state: TensorDict, mb: TensorDict, generator: torch.Generator, updates: int) -> tuple[TensorDict, TensorDict | None]:
        params, target = state["params"], state["target"]
        obs, next_obs = mb["observation"], mb["next", "observation"]
        with torch.no_grad():
            next_action = func.apply(actor, target["actor"], next_obs)
            eps = torch.randn(next_action.shape, generator=generator, device=device)
            next_action = smoothed_target_action(next_action, eps, policy_noise=config.policy_noise, noise_clip=config.noise_clip)
            y = td3_target(critics.values(target["critic"], next_obs, next_action), mb["next", "reward"],
                           mb["next", "terminated"], config.gamma)
        loss, metrics = critic_loss(critics.values(params["critic"], obs, mb["action"]), y)
        metrics["critic_grad_norm"] = step_side(loss, critic_opt, state, "optim_critic", params["critic"])
        metrics["target_q"] = y.mean()
        if updates % config.policy_delay:
            return metrics, None
        q1 = critics.value(params["critic"][0].detach(), obs, func.apply(actor, params["actor"], obs))
        loss_actor, actor_metrics = td3_actor_loss(q1)
        actor_metrics["actor_grad_norm"] = step_side(loss_actor, actor_opt, state, "optim_actor", params["actor"])
        func.polyak_update_(target["actor"], params["actor"], config.tau)
        func.polyak_update_(target["critic"], params["critic"], config.tau)
        return metrics, actor_metrics

    def iteration(state: TensorDict, buffer, generator: torch.Generator, num_updates: int):
        critic_sum, actor_sum, n_actor = None, None, 0
        updates = int(state["updates"])
        for _ in range(num_updates):
            updates += 1
            m, am = update(state, sample(buffer, config.batch_size, generator, device), generator, updates)
            critic_sum = m if critic_sum is None else critic_sum + m
            if am is not None:
                actor_sum = am if actor_sum is None else actor_sum + am
                n_actor += 1
        state["updates"] = torch.tensor(updates, device=device)
        state["rng"] = generator.get_state()
        metrics = critic_sum / num_updates if critic_sum is not None else TensorDict({}, batch_size=[])
        if actor_sum is not None:
            metrics.update(actor_sum / n_actor)
        return state, metrics

    return OffPolicy(init, policy, iteration, scale, ("optim_actor", "optim_critic"), actor)


register("td3", AlgorithmEntry(
    config="rlfunc.algos.td3:TD3Config", command="rlfunc.cli.offpolicy:train", train="rlfunc.run.offpolicy:train_td3",
    resume="rlfunc.run.offpolicy:resume", evaluate="rlfunc.run.offpolicy:evaluate",
    config_from_meta="rlfunc.run.offpolicy:config_from_meta", needs="bounded-box-actions", family="offpolicy",
    deploy=(("params", "actor"),),
    usage="    rlfunc train td3 --env ENV_ID [--total-steps N] [--seed S] [--policy-delay D] [--run-dir DIR] [...]",
))

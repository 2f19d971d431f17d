"""Soft Actor-Critic with a tanh-Gaussian MLP actor and an ensemble of Q critics (Haarnoja et al. 2018).

Per gradient step (the order of Stable-Baselines3's SAC): one reparameterised draw a ~ pi(.|s) on the
minibatch gives log pi(a|s) for the temperature loss (eq. 18, in log alpha) and the actor loss; the
critics regress on the soft Bellman target (eq. 3/5) built from the target critics at a fresh
a' ~ pi(.|s'), with the temperature before this step's update; the actor then minimises
alpha log pi - min_e Q_e (eq. 7/8) through the just-updated critics (their params detached); the
target critics follow by Polyak averaging. With ``redq_subset`` M the target takes the min over M
members drawn per step and the actor the mean over all (REDQ, Chen et al. 2021).

Actions: the actor's tanh output in (-1, 1) is what the critics and the buffer see; the env gets it
scaled to its bounds (:class:`rlfunc.algos.offpolicy.ActionScale`).
"""

from __future__ import annotations

import math
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
from rlfunc.core.distributions import tanh_gaussian_log_prob, tanh_gaussian_sample
from rlfunc.errors import ConfigError
from rlfunc.losses.sac import ensemble_min, sac_actor_loss, sac_critic_loss, soft_q_target, temperature_loss
from rlfunc.nets.mlp import MLP, seeded_init
from rlfunc.optim import adam, chain, clip_by_global_norm
from rlfunc.optim.amp import transform_step

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0  # the actor's log std is clamped to this range (SB3's, Haarnoja's code)


@dataclass(frozen=True)
class SACConfig(OffPolicyConfig):
    """Every SAC hyperparameter, with its default (Stable-Baselines3's / RL-Zoo's). Steps count env steps."""

    name: ClassVar[str] = "sac"

    alpha_lr: float = 3e-4  # Adam lr of log alpha
    init_alpha: float = 1.0  # initial temperature alpha (> 0)
    target_entropy: float | None = None  # H_bar of the temperature loss (None: -dim(A))
    autotune: bool = True  # learn alpha (False: alpha stays init_alpha)
    redq_subset: int | None = None  # REDQ: min over this many members drawn per step in the target, mean over all in the actor loss (None: min over all)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.alpha_lr > 0 or not self.init_alpha > 0:
            raise ConfigError(f"alpha_lr={self.alpha_lr}, init_alpha={self.init_alpha}: expected > 0")
        if self.target_entropy is not None and not math.isfinite(self.target_entropy):
            raise ConfigError(f"target_entropy={self.target_entropy}: expected a finite number or None")
        if self.redq_subset is not None and not 1 <= self.redq_subset <= self.num_critics:
            raise ConfigError(f"redq_subset={self.redq_subset}: expected None or an int in [1, num_critics={self.num_critics}]")


PRESETS: dict[str, dict] = {
    # RL-Zoo (hyperparams/sac.yml): Pendulum-v1 20k steps, lr 1e-3 (all three), the rest SB3's defaults
    "Pendulum-v1": dict(total_steps=20_000, actor_lr=1e-3, critic_lr=1e-3, alpha_lr=1e-3, num_steps=1_000),
    # RL-Zoo: HalfCheetah 1M steps, learning_starts 10k, SB3's defaults
    "HalfCheetah-v5": dict(total_steps=1_000_000, learning_starts=10_000, num_steps=5_000),
}


def preset(env: str, **overrides) -> SACConfig:
    """The preset for ``env`` (the defaults for envs without one), then ``overrides``."""
    return replace(SACConfig(), **{**PRESETS.get(env, {}), "env": env, **overrides})


def make_sac(config: SACConfig, spec: EnvSpec, device: torch.device) -> OffPolicy:
    """Build SAC's pure pieces for envs described by ``spec`` (bounded Box actions).

    The learner state is one TensorDict on ``device``: "params" {"actor" (MLP obs -> [loc, log_std]),
    "critic" [E, ...] (:func:`rlfunc.algos.offpolicy.q_ensemble`), "log_alpha" (0-dim)}, "target"
    {"critic"}, the update chains' states "optim_actor", "optim_critic", "optim_alpha" (each
    ``chain([clip_by_global_norm,] adam(lr))``: Adam's "step", "exp_avg", "exp_avg_sq" per leaf),
    "rng" (the generator of exploration noise, minibatches and REDQ subsets), "iteration",
    "env_steps", "updates" (0-dim int64).

    Raises:
        ConfigError: the action bounds are not finite.
    """
    A = spec.act_dim
    scale = action_scale(spec.action_low, spec.action_high, device)
    target_entropy = -float(A) if config.target_entropy is None else config.target_entropy
    make_actor = lambda: MLP(spec.obs_dim, 2 * A, config.hidden, config.activation, out_gain=0.01)  # noqa: E731
    actor = make_actor().to(device)
    critics = q_ensemble(spec.obs_dim, A, config.hidden, [config.run.seed + 1 + e for e in range(config.num_critics)],
                         device, activation=config.activation)
    clip = [clip_by_global_norm(config.max_grad_norm)] if config.max_grad_norm else []
    actor_opt = chain(*clip, adam(config.actor_lr))
    critic_opt = chain(*clip, adam(config.critic_lr))
    alpha_opt = chain(adam(config.alpha_lr))

    def init() -> TensorDict:
        critic = critics.init()
        gen = torch.Generator(device=device).manual_seed(config.run.seed)
        params = TensorDict({
            "actor": func.params_from_module(seeded_init(make_actor, config.run.seed).to(device)),
            "critic": critic,
            "log_alpha": torch.tensor(math.log(config.init_alpha), device=device).requires_grad_(config.autotune),
        }, batch_size=[], device=device)
        zero = lambda: torch.zeros((), dtype=torch.int64, device=device)  # noqa: E731
        state = TensorDict({
            "params": params, "target": {"critic": critic.detach().clone()}, "rng": gen.get_state(),
            "iteration": zero(), "env_steps": zero(), "updates": zero(),
        }, batch_size=[], device=device)
        state["optim_actor"] = actor_opt.init(params["actor"])
        state["optim_critic"] = critic_opt.init(params["critic"])
        state["optim_alpha"] = alpha_opt.init(params.select("log_alpha"))
        return state

    def heads(actor_params: TensorDict, observation: Tensor) -> tuple[Tensor, Tensor]:
        loc, log_std = func.apply(actor, actor_params, observation).chunk(2, -1)
        return loc, log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)

    def draw(actor_params: TensorDict, observation: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """(a [B, A] in (-1, 1), log pi(a|s) [B, 1]), reparameterised."""
        loc, log_std = heads(actor_params, observation)
        noise = torch.randn(loc.shape, generator=generator, device=device)
        action, pre_tanh = tanh_gaussian_sample(loc, log_std, noise)
        return action, tanh_gaussian_log_prob(None, loc, log_std, pre_tanh)

    def policy(state: TensorDict, generator: torch.Generator | None, deterministic: bool = False):
        forward = func.sequential_forward(actor, state["params", "actor"], stacked=False)

        def act(observation: Tensor) -> tuple[Tensor, None]:
            loc, log_std = forward(observation).chunk(2, -1)
            if deterministic:
                return scale.to_env(torch.tanh(loc)), None
            noise = torch.randn(loc.shape, generator=generator, device=device)
            action, _ = tanh_gaussian_sample(loc, log_std.clamp(LOG_STD_MIN, LOG_STD_MAX), noise)
            return scale.to_env(action), None

        return act

    def step_side(loss: Tensor, transform, state: TensorDict, key: str, params: TensorDict) -> Tensor:
        for leaf in func.leaves(params):
            leaf.grad = None
        loss.backward()
        norm, _, state[key] = transform_step(transform, state[key], params)
        return norm

    def update(state: TensorDict, mb: TensorDict, generator: torch.Generator) -> TensorDict:
        params = state["params"]
        obs, next_obs = mb["observation"], mb["next", "observation"]
        log_alpha = params["log_alpha"]
        alpha = log_alpha.detach().exp()  # this step's temperature, before its update
        action_pi, log_prob_pi = draw(params["actor"], obs, generator)
        metrics = TensorDict({}, batch_size=[])
        if config.autotune:
            loss_alpha, m = temperature_loss(log_alpha, log_prob_pi, target_entropy)
            step_side(loss_alpha, alpha_opt, state, "optim_alpha", params.select("log_alpha"))
            metrics.update(m)
        with torch.no_grad():
            next_action, next_log_prob = draw(params["actor"], next_obs, generator)
            next_q = critics.values(state["target", "critic"], next_obs, next_action)
            if config.redq_subset is not None:
                next_q = ensemble_min(next_q, config.redq_subset, generator)
            y = soft_q_target(next_q, next_log_prob, mb["next", "reward"], mb["next", "terminated"], config.gamma, alpha)
        loss_critic, m = sac_critic_loss(critics.values(params["critic"], obs, mb["action"]), y)
        metrics.update(m)
        metrics["critic_grad_norm"] = step_side(loss_critic, critic_opt, state, "optim_critic", params["critic"])
        q_pi = critics.values(params["critic"].detach(), obs, action_pi)
        if config.redq_subset is not None:
            q_pi = q_pi.mean(0)
        loss_actor, m = sac_actor_loss(q_pi, log_prob_pi, alpha)
        metrics.update(m)  # its "entropy" is the same -E[log pi] as the temperature loss's
        metrics["actor_grad_norm"] = step_side(loss_actor, actor_opt, state, "optim_actor", params["actor"])
        metrics["alpha"] = alpha
        metrics["target_q"] = y.mean()
        func.polyak_update_(state["target", "critic"], params["critic"], config.tau)
        return metrics

    def iteration(state: TensorDict, buffer, generator: torch.Generator, num_updates: int):
        metric_sum = None
        for _ in range(num_updates):
            m = update(state, sample(buffer, config.batch_size, generator, device), generator)
            metric_sum = m if metric_sum is None else metric_sum + m
        state["updates"] = state["updates"] + num_updates
        state["rng"] = generator.get_state()
        return state, (metric_sum / num_updates if metric_sum is not None else TensorDict({}, batch_size=[]))

    return OffPolicy(init, policy, iteration, scale, ("optim_actor", "optim_critic", "optim_alpha"), actor)


register("sac", AlgorithmEntry(
    config="rlfunc.algos.sac:SACConfig", command="rlfunc.cli.offpolicy:train", train="rlfunc.run.offpolicy:train_sac",
    resume="rlfunc.run.offpolicy:resume", evaluate="rlfunc.run.offpolicy:evaluate",
    config_from_meta="rlfunc.run.offpolicy:config_from_meta", needs="bounded-box-actions", family="offpolicy",
    deploy=(("params", "actor"),),
    usage="    rlfunc train sac --env ENV_ID [--total-steps N] [--seed S] [--updates-per-step K] [--run-dir DIR] [...]",
))

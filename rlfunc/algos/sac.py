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

The update is one pure function of flat leaf lists (``step`` in :func:`make_sac`): gradients by
``torch.func.grad``, the three update chains' ``update_leaves``, in-place writes of params, moments
and targets; the noise comes in as tensors drawn from the run's generator. ``--compile on`` (or
``auto`` for a run of >= :data:`rlfunc.algos.offpolicy.AUTO_COMPILE_UPDATES` gradient steps) runs it through
:func:`rlfunc.device.compile_step` as one torch.compile graph; eager and compiled agree within 1e-5
(tests/optim/test_compiled_step.py).

Data parallel (``--nproc W``): each rank steps its share of the envs and takes B/W of every minibatch,
the critics' and temperature's gradients averaged in one all_reduce, the actor's in another, so every
rank takes the single process's step, eagerly (:func:`make_sac`'s ``dist``; why, and what it costs:
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
from rlfunc.config import check_dependents, replace
from rlfunc.core import func
from rlfunc.core.distributions import tanh_gaussian_log_prob, tanh_gaussian_sample
from rlfunc.errors import ConfigError
from rlfunc.device import compile_step
from rlfunc.losses.sac import sac_actor_loss, sac_critic_loss, soft_q_target, temperature_loss
from rlfunc.nets.mlp import MLP, seeded_init
from rlfunc.optim import adam, all_reduce_mean, chain, clip_by_global_norm, flatten
from rlfunc.optim.base import unflatten
from rlfunc.optim.leaves import chain_state, chain_step, leaf_list, skipped

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0  # the actor's log std is clamped to this range (SB3's, Haarnoja's code)
ALPHA_DEF = (("log_alpha", None),)  # the tree definition (rlfunc.optim.flatten) of params.select("log_alpha")


@dataclass(frozen=True)
class SACConfig(OffPolicyConfig):
    """Every SAC hyperparameter, with its default (Stable-Baselines3's / RL-Zoo's). Steps count env steps."""

    name: ClassVar[str] = "sac"
    compiles: ClassVar[bool] = True  # --compile: the update step through torch.compile

    alpha_lr: float = 3e-4  # Adam lr of log alpha
    init_alpha: float = 1.0  # initial temperature alpha (> 0)
    target_entropy: float | None = None  # H_bar of the temperature loss (None: -dim(A))
    autotune: bool = True  # learn alpha (False: alpha stays init_alpha)
    dependents: ClassVar[tuple] = (("autotune", lambda c: c.autotune, ("target_entropy", "alpha_lr")),)  # rlfunc.config.check_dependents
    redq_subset: int | None = None  # REDQ: min over this many members drawn per step in the target, mean over all in the actor loss (None: min over all)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("alpha_lr", "init_alpha"):  # one named at a time (both were named of either); nan, inf refused
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a finite number > 0")
        if self.target_entropy is not None and not math.isfinite(self.target_entropy):
            raise ConfigError(f"target_entropy={self.target_entropy}: expected a finite number or None")
        if self.redq_subset is not None and not 1 <= self.redq_subset <= self.num_critics:
            raise ConfigError(f"redq_subset={self.redq_subset}: expected None or an int in [1, num_critics={self.num_critics}]")


PRESETS: dict[str, dict] = {
    # RL-Zoo (hyperparams/sac.yml): Pendulum-v1 20k steps, lr 1e-3 (all three), the rest SB3's defaults,
    # but 64x64 networks where SB3 takes 256x256: a 3-d observation and a 1-d action need no more, and a
    # gradient step costs a fraction of one (screening seeds 10-14: returns -136 to -158, median -151, in
    # 55-71 s of training against ~350 s at 256x256; bench/RESULTS.md "SAC on Pendulum-v1, 64x64")
    "Pendulum-v1": dict(total_steps=20_000, actor_lr=1e-3, critic_lr=1e-3, alpha_lr=1e-3, num_steps=1_000, hidden=(64, 64)),
    # RL-Zoo: HalfCheetah 1M steps, learning_starts 10k, SB3's defaults
    "HalfCheetah-v5": dict(total_steps=1_000_000, learning_starts=10_000, num_steps=5_000),
}


def preset(env: str, **overrides) -> SACConfig:
    """The preset for ``env`` (the defaults for envs without one), then ``overrides``."""
    base = replace(SACConfig(), **{**PRESETS.get(env, {}), "env": env})
    config = replace(base, **overrides)
    check_dependents(config, base)  # rlfunc.config: an override that autotune=False leaves unread
    return config


def make_sac(config: SACConfig, spec: EnvSpec, device: torch.device, dist=None) -> OffPolicy:
    """Build SAC's pure pieces for envs described by ``spec`` (bounded Box actions).

    The learner state is one TensorDict on ``device``: "params" {"actor" (MLP obs -> [loc, log_std]),
    "critic" [E, ...] (:func:`rlfunc.algos.offpolicy.q_ensemble`), "log_alpha" (0-dim)}, "target"
    {"critic"}, the update chains' states "optim_actor", "optim_critic", "optim_alpha" (each
    ``chain([clip_by_global_norm,] adam(lr))``: Adam's "step", "exp_avg", "exp_avg_sq" per leaf),
    "rng" (the generator of exploration noise, minibatches and REDQ subsets), "iteration",
    "env_steps", "updates" (0-dim int64).

    ``dist``: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run of W
    ranks (:mod:`rlfunc.algos.data_parallel`): the policy acts for this rank's N/W envs with its rows
    of the N envs' noise; each gradient step takes this rank's B/W of the minibatch (and of its
    noise) and averages the gradients, losses and metrics over the ranks (the critics' and the
    temperature's in one all_reduce, the actor's in another) before the chains, so every rank
    takes the single process's step; the update is then eager.

    Raises:
        ConfigError: the action bounds are not finite; W does not divide ``num_envs`` or ``batch_size``.
    """
    A = spec.act_dim
    W, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)
    data_parallel.check_divides(W, num_envs=config.num_envs, batch_size=config.batch_size)
    own = data_parallel.own_rows(rank, W)  # the noise rows of this rank's envs
    reduce = all_reduce_mean(None if dist is None else dist.group)
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

    forward_of = acting_forward(actor, config, device, "sac's acting policy")

    def policy(state: TensorDict, generator: torch.Generator | None, deterministic: bool = False):
        forward = forward_of(state["params", "actor"])

        def act(observation: Tensor) -> tuple[Tensor, None]:
            loc, log_std = forward(observation).chunk(2, -1)
            if deterministic:
                return scale.to_env(torch.tanh(loc)), None
            noise = own(lambda n: torch.randn((n, A), generator=generator, device=device), loc.shape[0], 0)
            action, _ = tanh_gaussian_sample(loc, log_std.clamp(LOG_STD_MIN, LOG_STD_MAX), noise)
            return scale.to_env(action), None

        return act

    # the update as one pure function of flat leaf lists (the form torch.compile takes whole; no
    # TensorDict in or out): tree definitions of the params and of the three update chains' states
    _, actor_def = flatten(func.params_from_module(actor))
    _, critic_def = flatten(critics.init())
    E = config.num_critics

    def step(actor_w: list[Tensor], critic_w: list[Tensor], log_alpha: list[Tensor], target_w: list[Tensor],
             opts: tuple[tuple[list[Tensor], tuple], ...], mb: dict, noise_pi: Tensor, noise_next: Tensor,
             subset: Tensor | None) -> dict:
        """One SAC gradient step (the eager order of SB3's SAC, see the module docstring), in place on
        every leaf list: temperature, critics, actor (through the just-updated critics), Polyak
        targets. ``opts``: (leaves, tree definition) of the alpha, critic and actor chains' states;
        ``noise_*``: [B, A] standard normal; ``subset``: REDQ's member indices [M] (None: all).
        Returns the metrics (0-dim tensors). A side whose loss or gradient is not finite skips its
        step (adam's mask), as the eager transform_step did."""
        alpha_s, critic_s, actor_s = opts
        obs, next_obs = mb["observation"], mb["next_observation"]
        alpha = log_alpha[0].detach().exp()  # this step's temperature, before its update

        def pi(w: list[Tensor], observation: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
            loc, log_std = func.apply(actor, unflatten(actor_def, w), observation).chunk(2, -1)
            log_std = log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)
            action, pre_tanh = tanh_gaussian_sample(loc, log_std, noise)
            return action, tanh_gaussian_log_prob(None, loc, log_std, pre_tanh)

        metrics = {}
        with torch.no_grad():
            _, log_prob_pi = pi(actor_w, obs, noise_pi)
        if config.autotune:
            loss_alpha, m = temperature_loss(log_alpha[0], log_prob_pi, target_entropy)
            grad_alpha = [-(log_prob_pi.detach() + target_entropy).mean()]  # d loss_alpha / d log_alpha
            metrics.update(m.to_dict())
        with torch.no_grad():
            next_action, next_log_prob = pi(actor_w, next_obs, noise_next)
            next_q = critics.values(stacked(critic_def, target_w, E), next_obs, next_action)
            if subset is not None:
                next_q = next_q.index_select(0, subset)
            y = soft_q_target(next_q, next_log_prob, mb["reward"], mb["terminated"], config.gamma, alpha)

        def critic_objective(w):
            loss, m = sac_critic_loss(critics.values(stacked(critic_def, w, E), obs, mb["action"]), y)
            return loss, (loss, m)

        grads, (loss_critic, m) = torch.func.grad(critic_objective, has_aux=True)(critic_w)
        metrics.update(m.to_dict())
        metrics["target_q"] = y.mean()
        if W > 1:  # the temperature's gradient rides with the critics' (its step reads nothing they change): one collective
            grads, loss_critic, metrics = mean_over_ranks(list(grads) + (grad_alpha if config.autotune else []), loss_critic, metrics)
            if config.autotune:
                grads, grad_alpha, loss_alpha = grads[:-1], grads[-1:], metrics["loss_alpha"]
        if config.autotune:  # after the critics' gradient, which reads alpha as it was before this step
            chain_step(alpha_opt, grad_alpha, log_alpha, ALPHA_DEF, alpha_s, loss_alpha)
        metrics["critic_grad_norm"] = chain_step(critic_opt, grads, critic_w, critic_def, critic_s, loss_critic)
        metrics["skipped_critic"] = skipped(metrics["critic_grad_norm"], loss_critic)
        updated = stacked(critic_def, [w.detach() for w in critic_w], E)

        def actor_objective(w):
            action_pi, log_prob = pi(w, obs, noise_pi)
            q_pi = critics.values(updated, obs, action_pi)
            if config.redq_subset is not None:
                q_pi = q_pi.mean(0)
            loss, m = sac_actor_loss(q_pi, log_prob, alpha)
            return loss, (loss, m)

        grads, (loss_actor, m) = torch.func.grad(actor_objective, has_aux=True)(actor_w)
        m = m.to_dict()
        if W > 1:
            grads, loss_actor, m = mean_over_ranks(grads, loss_actor, m)
        metrics.update(m)  # its "entropy" is the same -E[log pi] as the temperature loss's
        metrics["actor_grad_norm"] = chain_step(actor_opt, grads, actor_w, actor_def, actor_s, loss_actor)
        metrics["skipped_actor"] = skipped(metrics["actor_grad_norm"], loss_actor)
        metrics["alpha"] = alpha
        with torch.no_grad():
            torch._foreach_lerp_(target_w, [w.detach() for w in critic_w], config.tau)
        return {k: v.detach() for k, v in metrics.items()}

    def mean_over_ranks(grads: list[Tensor], loss: Tensor, metrics: dict) -> tuple[list[Tensor], Tensor, dict]:
        """(gradients, loss, metrics) of this rank's share averaged over the ranks: one all_reduce."""
        grads, loss, mean = data_parallel.average(reduce, list(grads), None, loss, TensorDict(metrics, batch_size=[]))
        return grads, loss, mean.to_dict()

    updates_of_run = max(0, config.total_steps - config.learning_starts) * config.updates_per_step
    # a compiled step holds no collective: data-parallel runs are eager (the config refused --compile on)
    compiled = W == 1 and (config.run.compile == "on" or (config.run.compile == "auto" and updates_of_run >= AUTO_COMPILE_UPDATES))
    compiled_step = compile_step(step, device, config.run.compile, "sac", static_args=(0, 1, 2, 3, 4)) if compiled else None
    reported: list[bool] = []  # compile_s went into a metrics line already

    def iteration(state: TensorDict, buffer, generator: torch.Generator, num_updates: int, into: StepMetrics | None = None):
        """``num_updates`` steps of :func:`step` (compiled with ``--compile``) on minibatches of
        ``buffer``; per step the minibatch, the noise and REDQ's subset are drawn from ``generator``,
        in that order. The leaf lists are taken once: the steps write into the state's tensors.
        Metrics: the steps' means (skipped counts); with ``into`` (a metrics line's
        :class:`~rlfunc.algos.offpolicy.StepMetrics` over several calls) each step's go there and
        the returned metrics hold only compile_s, if any."""
        params = state["params"]
        args = (leaf_list(params["actor"]), leaf_list(params["critic"]), [params["log_alpha"].detach()], leaf_list(state["target", "critic"]),
                tuple(chain_state(state[k]) for k in ("optim_alpha", "optim_critic", "optim_actor")))
        fn = compiled_step if compiled_step is not None else step
        metric_sum = StepMetrics() if into is None else into  # skipped_* counted; the rest the mean of the finite values
        for _ in range(num_updates):
            mb = sample(buffer, config.batch_size, generator, device)
            B = mb.batch_size[0]
            noise_pi = torch.randn((B, A), generator=generator, device=device)
            noise_next = torch.randn((B, A), generator=generator, device=device)
            subset = torch.randperm(E, generator=generator, device=device)[: config.redq_subset] if config.redq_subset is not None else None
            tensors = {"observation": mb["observation"], "next_observation": mb["next", "observation"], "action": mb["action"],
                       "reward": mb["next", "reward"], "terminated": mb["next", "terminated"]}
            if W > 1:  # this rank's share of the single process's minibatch and noise
                tensors = {k: data_parallel.share(v, rank, W) for k, v in tensors.items()}
                noise_pi, noise_next = data_parallel.share(noise_pi, rank, W), data_parallel.share(noise_next, rank, W)
            metric_sum.add(fn(*args, tensors, noise_pi, noise_next, subset))
        state["updates"] = state["updates"] + num_updates
        state["rng"] = generator.get_state()
        if not metric_sum:
            return state, TensorDict({}, batch_size=[])
        metrics = TensorDict(metric_sum.result() if into is None else {}, batch_size=[])
        if compiled_step is not None and compiled_step.compile_s is not None and not reported:
            acting = forward_of.compiled.compile_s if forward_of.compiled is not None else None  # the acting policy's
            metrics["compile_s"] = torch.tensor(compiled_step.compile_s + (acting or 0.0))  # in the first metrics line with updates
            reported.append(True)
        return state, metrics

    return OffPolicy(init, policy, iteration, scale, ("optim_actor", "optim_critic", "optim_alpha"), actor)


register("sac", AlgorithmEntry(
    config="rlfunc.algos.sac:SACConfig", run="rlfunc.run.offpolicy:OffPolicyRun", command="rlfunc.cli.offpolicy:train",
    evaluate="rlfunc.run.offpolicy:evaluate", needs="bounded-box-actions", family="offpolicy",
    deploy=(("params", "actor"),),
    usage="    rlfunc train sac --env ENV_ID [--total-steps N] [--seed S] [--updates-per-step K] [--run-dir DIR] [...]",
))

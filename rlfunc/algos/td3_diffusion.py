"""TD3/DDPG with a diffusion actor: Q(s, a) backpropagated through the whole reverse chain.

The actor samples a = DDIM_theta(s, x_K) with eta = 0 (a deterministic policy given the initial
noise, as TD3 needs) keeping the autograd graph, so dQ/da flows through every denoising step into
the denoiser; a denoising (behaviour) term on replayed actions keeps it near the data
(Diffusion-QL). Twin critics are one stacked parameter TensorDict applied with ``rlfunc.core.func.vmap``;
target critics and a target actor follow by Polyak averaging; target policy smoothing and delayed
actor updates as in TD3. ``policy_delay=1, policy_noise=0`` with one critic used is DDPG-like.

References: Fujimoto et al. (2018) (TD3); Wang et al. (2022) (Diffusion-QL), eq. 3.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.algos.diffusion_actor import ActorSpec, DiffusionActor
from rlfunc.algos.offpolicy import q_ensemble
from rlfunc.algos.registry import AlgorithmEntry, register
from rlfunc.algos.replay_diffusion import ReplayDiffusionConfig, replay_rollout, replay_state, replay_transitions
from rlfunc.core import func
from rlfunc.diffusion.ddpm import denoising_loss, sample_timesteps
from rlfunc.errors import ConfigError
from rlfunc.losses.td3 import critic_loss, diffusion_ql_actor_loss, smoothed_target_action, td3_target
from rlfunc.optim import GradientTransform, adam, chain, clip_by_global_norm
from rlfunc.optim.amp import Precision, backward, transform_step


@dataclass(frozen=True)
class TD3DiffusionConfig(ReplayDiffusionConfig):
    """Every TD3-diffusion hyperparameter, with its default: the shared ones of
    :class:`~rlfunc.algos.replay_diffusion.ReplayDiffusionConfig` and TD3's. Steps count env steps."""

    name: ClassVar[str] = "td3-diffusion"

    exploration_noise: float = 0.2  # std of Gaussian noise on executed actions
    policy_noise: float = 0.2  # target policy smoothing std
    noise_clip: float = 0.5  # clip of the smoothing noise
    q_coef: float = 1.0  # alpha of Diffusion-QL: weight of -Q / |Q|
    bc_coef: float = 1.0  # weight of the denoising (behaviour) term on replayed actions

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("exploration_noise", "policy_noise", "noise_clip", "q_coef", "bc_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: expected >= 0")


class TD3Diffusion(NamedTuple):
    init: Callable[..., TensorDict]
    rollout: Callable[..., TensorDict]
    iteration: Callable[..., tuple[TensorDict, TensorDict]]
    transitions: Callable[[TensorDict, TensorDict], TensorDict]
    actor: DiffusionActor
    critic_optimizer: GradientTransform  # the update chain of "params"/"critic", its state state["optim_critic"]
    actor_optimizer: GradientTransform  # the update chain of "params"/"actor", its state state["optim_actor"]
    optim_keys: tuple[str, ...] = ("optim_critic", "optim_actor")  # the learner's update-chain states


def make_td3_diffusion(config: TD3DiffusionConfig, spec: ActorSpec, obs_dim, act_dim: int, device: torch.device) -> TD3Diffusion:
    """Build TD3-diffusion's pure pieces. ``obs_dim``: the env's :class:`EnvInfo` (or a Box
    observation's size). Learner state: "params" {"actor", "critic" [E, ...]}, "target" {"actor",
    "critic"}, "obs_stats", "schedule", "rng", "iteration", "env_steps", "updates", for a Dict
    observation "encoder" (the bc run's multimodal encoder, frozen: the critics and the denoiser read
    its features), and the states of the two update chains, each ``chain(clip_by_global_norm(max_grad_norm),
    adam(lr))`` (one norm over all its leaves, the twin critics' together): "optim_critic" over
    "params"/"critic" (``critic_lr``), "optim_actor" over "params"/"actor" (``actor_lr``); each "0"
    {"norm": [1], the last pre-clip gradient norm}, "1" {"step", "exp_avg", "exp_avg_sq"} (Adam's
    per-leaf step counts, 0-dim float32, and moments)."""
    actor = DiffusionActor(spec, obs_dim, act_dim, device)
    obs_dim = actor.obs_dim  # the condition's width
    chunk_dim = spec.act_steps * act_dim
    E = config.num_critics
    critics_of = q_ensemble(obs_dim, chunk_dim, config.critic_hidden, [config.run.seed + 1 + e for e in range(E)], device)
    critic_opt = chain(clip_by_global_norm(config.max_grad_norm, stacked=False), adam(config.critic_lr))
    actor_opt = chain(clip_by_global_norm(config.max_grad_norm, stacked=False), adam(config.actor_lr))
    q_all = critics_of.values

    def init(actor_params: TensorDict | None = None, obs_stats: TensorDict | None = None,
             encoder_params: TensorDict | None = None) -> TensorDict:
        state = replay_state(actor, config, critics_of.init(), actor_params, obs_stats, encoder_params, target_actor=True)
        state["optim_critic"] = critic_opt.init(state["params", "critic"])
        state["optim_actor"] = actor_opt.init(state["params", "actor"])
        return state

    def deterministic_chunk(params: TensorDict, state: TensorDict, cond: Tensor, generator: torch.Generator, **kw) -> Tensor:
        """x_0 [B, H, A] of DDIM with eta = 0 from fresh initial noise."""
        return actor.act(params, state["schedule"], cond, actor.noise(cond.shape[0], generator), eta=0.0, **kw)

    def rollout(state: TensorDict, env, generator: torch.Generator) -> TensorDict:
        """:func:`~rlfunc.algos.replay_diffusion.replay_rollout` acting with deterministic DDIM plus
        Gaussian exploration noise."""

        def explore(cond: Tensor) -> Tensor:
            x = deterministic_chunk(state["params", "actor"], state, cond, generator)
            return x + config.exploration_noise * torch.randn(x.shape, generator=generator, device=device)

        return replay_rollout(actor, config, state, env, generator, explore)

    def critic_update(state, mb, generator, opt, prec):
        params, target = state["params"], state["target"]
        with torch.no_grad():
            a_next = deterministic_chunk(target["actor"], state, mb["next_cond"], generator)
            eps = torch.randn(a_next.shape, generator=generator, device=device)
            a_next = smoothed_target_action(
                a_next, eps, policy_noise=config.policy_noise, noise_clip=config.noise_clip
            ).flatten(1)
            y = td3_target(q_all(target["critic"], mb["next_cond"], a_next), mb["reward"], mb["terminated"], config.gamma)
        with prec.autocast():
            q = q_all(params["critic"], mb["cond"], mb["action"])
        loss, metrics = critic_loss(q.float(), y)
        for leaf in func.leaves(params["critic"]):  # the actor's loss also reached the critic
            leaf.grad = None
        backward(loss, prec)
        norm, ok, opt["optim_critic"] = transform_step(critic_opt, opt["optim_critic"], params["critic"], prec)
        metrics["critic_grad_norm"] = norm
        metrics["skipped_critic"] = torch.tensor(float(not ok))
        return metrics

    def actor_update(state, mb, generator, opt, prec):
        params = state["params"]
        with prec.autocast():
            a = deterministic_chunk(params["actor"], state, mb["cond"], generator, checkpoint=config.gradient_checkpointing)
            q = critics_of.value(params["critic"][0], mb["cond"], a.flatten(1))
            t = sample_timesteps((mb.batch_size[0],), spec.num_train_steps, generator=generator, device=device)
            noise = torch.randn(mb["chunk"].shape, generator=generator, device=device)
            bc = denoising_loss(actor.apply, params["actor"], mb["chunk"], mb["cond"], t, noise,
                                state["schedule", "alphas_cumprod"], prediction=spec.prediction)
        loss, metrics = diffusion_ql_actor_loss(q.float(), bc, q_coef=config.q_coef, bc_coef=config.bc_coef)
        for leaf in func.leaves(params["actor"]):
            leaf.grad = None
        backward(loss, prec)
        norm, ok, opt["optim_actor"] = transform_step(actor_opt, opt["optim_actor"], params["actor"], prec)
        metrics["actor_grad_norm"] = norm
        metrics["skipped_actor"] = torch.tensor(float(not ok))
        return metrics

    def iteration(state: TensorDict, buffer, generator: torch.Generator, prec: Precision):
        """``updates_per_iteration`` TD3 steps on minibatches drawn from ``buffer`` (a TorchRL
        replay buffer of flat transitions, see :func:`transitions`), each gradient through its side's
        update chain (whose state, "optim_critic" / "optim_actor", it advances); the params are
        stepped in place."""
        opt = {key: state[key] for key in ("optim_critic", "optim_actor")}
        metric_sum, actor_sum, n_actor = None, None, 0
        updates = int(state["updates"])
        for _ in range(config.updates_per_iteration):
            idx = torch.randint(len(buffer), (config.batch_size,), generator=generator, device=device)
            mb = buffer[idx]  # the storage lives on the device: no host round trip
            m = critic_update(state, mb, generator, opt, prec)
            metric_sum = m if metric_sum is None else metric_sum + m
            updates += 1
            if updates % config.policy_delay == 0:
                am = actor_update(state, mb, generator, opt, prec)
                actor_sum = am if actor_sum is None else actor_sum + am
                n_actor += 1
                func.polyak_update_(state["target", "actor"], state["params", "actor"], config.tau)
                func.polyak_update_(state["target", "critic"], state["params", "critic"], config.tau)
        metrics = metric_sum / config.updates_per_iteration
        if actor_sum is not None:
            metrics.update(actor_sum / n_actor)
        out = state.clone(recurse=False)
        out["iteration"] = state["iteration"] + 1
        out["updates"] = torch.tensor(updates, device=device)
        out["rng"] = generator.get_state()
        out.update(opt)
        return out, metrics

    def transitions(state: TensorDict, batch: TensorDict) -> TensorDict:
        """A rollout [N, T] -> flat transitions [N*T] (:func:`rlfunc.algos.replay_diffusion.replay_transitions`)."""
        return replay_transitions(actor, state, batch)

    return TD3Diffusion(init, rollout, iteration, transitions, actor, critic_opt, actor_opt)


register("td3-diffusion", AlgorithmEntry(
    config="rlfunc.algos.td3_diffusion:TD3DiffusionConfig", command="rlfunc.cli.diffusion:train_td3_diffusion",
    train="rlfunc.run.diffusion:train_td3_diffusion",
    resume="rlfunc.run.diffusion:resume_diffusion", evaluate="rlfunc.run.diffusion:evaluate_run",
    config_from_meta="rlfunc.run.diffusion:config_from_meta",
    needs="bounded-box-actions", family="diffusion", deploy=(("params", "actor"), ("encoder",)),
    usage="    rlfunc train td3-diffusion [--init-from BC_RUN_DIR] [...]",
))

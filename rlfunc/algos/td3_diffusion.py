"""TD3/DDPG with a diffusion actor: Q(s, a) backpropagated through the whole reverse chain.

The actor samples a = DDIM_theta(s, x_K) with eta = 0 (a deterministic policy given the initial
noise, as TD3 needs) keeping the autograd graph, so dQ/da flows through every denoising step into
the denoiser; a denoising (behaviour) term on replayed actions keeps it near the data
(Diffusion-QL). Twin critics are one stacked parameter TensorDict applied with ``rlfunc.core.func.vmap``;
target critics and a target actor follow by Polyak averaging; target policy smoothing and delayed
actor updates as in TD3. ``policy_delay=1, policy_noise=0`` with one critic used is DDPG-like.

The critic step and the actor step (with both Polyak updates) are also two pure functions of flat leaf
lists (gradients by ``torch.func.grad``, each chain's ``update_leaves`` with a finiteness mask, in-place
writes; the noise and timesteps drawn outside from the run's generator in the eager order);
``--compile on`` (``auto``: float32 runs of >= :data:`AUTO_COMPILE_UPDATES`
gradient steps) runs them as two torch.compile graphs, equal to the eager update within 1e-5
(tests/optim/test_compiled_step.py).

References: Fujimoto et al. (2018) (TD3); Wang et al. (2022) (Diffusion-QL), eq. 3.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.algos.diffusion_actor import ActorSpec, DiffusionActor, schedule_for
from rlfunc.algos.offpolicy import StepMetrics, q_ensemble, stacked
from rlfunc.algos.registry import AlgorithmEntry, register
from rlfunc.algos.replay_diffusion import (ReplayDiffusionConfig, minibatch, ranks, replay_rollout, replay_state,
                                          replay_transitions, side_steps)
from rlfunc.core import func
from rlfunc.diffusion.ddpm import denoising_loss, sample_timesteps
from rlfunc.errors import ConfigError
from rlfunc.losses.td3 import critic_loss, diffusion_ql_actor_loss, smoothed_target_action, td3_target
from rlfunc.optim import GradientTransform, adam, chain, clip_by_global_norm, flatten, unflatten
from rlfunc.optim.amp import Precision, backward, loss_scale_of, precision, transform_step, with_loss_scale
from rlfunc.optim.leaves import chain_state, leaf_list, objective_step

# --compile auto compiles a run of at least this many gradient steps (bench/compiled_diffusion_offpolicy.py,
# 2-core CPU, one thread, the defaults at batch 256: a cold compile took 135 s and saved 33 ms of the
# 61 ms update, a break-even of ~4,100 updates; 4,800 under load). The default 60k-step run (1,920
# updates) stays eager.
AUTO_COMPILE_UPDATES = 5_000


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


def make_td3_diffusion(config: TD3DiffusionConfig, spec: ActorSpec, obs_dim, act_dim: int, device: torch.device,
                       dist=None) -> TD3Diffusion:
    """Build TD3-diffusion's pure pieces. ``obs_dim``: the env's :class:`EnvInfo` (or a Box
    observation's size). Learner state: "params" {"actor", "critic" [E, ...]}, "target" {"actor",
    "critic"}, "obs_stats", "schedule", "rng", "iteration", "env_steps", "updates", for a Dict
    observation "encoder" (the bc run's multimodal encoder, frozen: the critics and the denoiser read
    its features), and the states of the two update chains, each ``chain(clip_by_global_norm(max_grad_norm),
    adam(lr))`` (one norm over all its leaves, the twin critics' together): "optim_critic" over
    "params"/"critic" (``critic_lr``), "optim_actor" over "params"/"actor" (``actor_lr``); each "0"
    {"norm": [1], the last pre-clip gradient norm}, "1" {"step", "exp_avg", "exp_avg_sq"} (Adam's
    per-leaf step counts, 0-dim float32, and moments).

    ``dist``: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run of W
    ranks: the rollout acts for this rank's N/W envs with its rows of every env's noise; the update
    runs the leaf-list steps eagerly, each on this rank's B/W of the minibatch and of its noise, the
    gradients, loss and metrics averaged over the ranks in one all_reduce per side before its chain
    (:mod:`rlfunc.algos.data_parallel`), so every rank takes the single process's step. ConfigError
    unless W divides ``num_envs`` and ``batch_size``, and W > 1 runs float32 without checkpointing."""
    dp = ranks(dist, config)
    actor = DiffusionActor(spec, obs_dim, act_dim, device)
    obs_dim = actor.obs_dim  # the condition's width
    chunk_dim = spec.act_steps * act_dim
    E = config.num_critics
    critics_of = q_ensemble(obs_dim, chunk_dim, config.critic_hidden, [config.run.seed + 1 + e for e in range(E)], device)
    prec_of_run = precision(device, config.run.precision)  # fp16: each chain in its own loss scale
    critic_opt = with_loss_scale(chain(clip_by_global_norm(config.max_grad_norm, stacked=False), adam(config.critic_lr)), prec_of_run)
    actor_opt = with_loss_scale(chain(clip_by_global_norm(config.max_grad_norm, stacked=False), adam(config.actor_lr)), prec_of_run)
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

        def explore(cond: Tensor) -> Tensor:  # the draws of every rank's envs, this rank's rows kept
            n = cond.shape[0]
            noise = dp.own(lambda k: actor.noise(k, generator), n, 1)
            x = actor.act(state["params", "actor"], state["schedule"], cond, noise, eta=0.0)
            return x + config.exploration_noise * dp.own(lambda k: torch.randn((k, *x.shape[1:]), generator=generator, device=device), n, 0)

        return replay_rollout(actor, config, state, env, generator, explore, dp.own)

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
        backward(loss, prec, loss_scale_of(opt["optim_critic"]))
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
        backward(loss, prec, loss_scale_of(opt["optim_actor"]))
        norm, ok, opt["optim_actor"] = transform_step(actor_opt, opt["optim_actor"], params["actor"], prec)
        metrics["actor_grad_norm"] = norm
        metrics["skipped_actor"] = torch.tensor(float(not ok))
        return metrics

    # --compile: the critic step and the actor step as pure functions of flat leaf lists (the form
    # torch.compile takes whole), float32, without checkpointing
    _, actor_def = flatten(actor.init_params(config.run.seed))
    _, critic_def = flatten(critics_of.init())
    _, schedule_def = flatten(schedule_for(spec, device))

    def critic_step(actor_w: list[Tensor], critic_w: list[Tensor], target_actor_w: list[Tensor], target_critic_w: list[Tensor],
                    schedule_w: list[Tensor], opt: tuple[list[Tensor], tuple], mb: dict, noise: Tensor, eps: Tensor) -> dict:
        """:func:`critic_update` in place on ``critic_w`` and ``opt`` (the critic chain's state,
        :func:`rlfunc.optim.leaves.chain_state`); the target actor's chain noise ``noise`` [K+1, B, H, A]
        and the smoothing noise ``eps`` [B, H, A] given. (``actor_w`` is unused: every step takes the
        same leaf lists.)"""
        schedule = unflatten(schedule_def, schedule_w)
        with torch.no_grad():
            a_next = actor.act(unflatten(actor_def, target_actor_w), schedule, mb["next_cond"], noise, eta=0.0)
            a_next = smoothed_target_action(a_next, eps, policy_noise=config.policy_noise, noise_clip=config.noise_clip).flatten(1)
            y = td3_target(q_all(stacked(critic_def, target_critic_w, E), mb["next_cond"], a_next), mb["reward"], mb["terminated"],
                           config.gamma)

        def objective(w):
            loss, m = critic_loss(q_all(stacked(critic_def, w, E), mb["cond"], mb["action"]), y)
            return loss, (loss, m)

        metrics = objective_step(critic_opt, objective, critic_w, critic_def, opt, "critic", dp.mean_over_ranks)
        return {k: v.detach() for k, v in metrics.items()}

    def actor_step(actor_w: list[Tensor], critic_w: list[Tensor], target_actor_w: list[Tensor], target_critic_w: list[Tensor],
                   schedule_w: list[Tensor], opt: tuple[list[Tensor], tuple], mb: dict, noise: Tensor, t: Tensor,
                   bc_noise: Tensor) -> dict:
        """:func:`actor_update` (Q_1 through the whole chain from ``noise``, plus the denoising term at
        timesteps ``t`` [B] with noise ``bc_noise`` [B, H, A]) in place on ``actor_w`` and ``opt``, then
        the Polyak updates of both targets."""
        schedule = unflatten(schedule_def, schedule_w)
        q1 = unflatten(critic_def, [w[0].detach() for w in critic_w])

        def objective(w):
            params = unflatten(actor_def, w)
            a = actor.act(params, schedule, mb["cond"], noise, eta=0.0)
            q = critics_of.value(q1, mb["cond"], a.flatten(1))
            bc = denoising_loss(actor.apply, params, mb["chunk"], mb["cond"], t, bc_noise, schedule["alphas_cumprod"],
                                prediction=spec.prediction)
            scale = None if dp.world_size == 1 else dp.mean(q.detach().abs().mean())  # E|Q| of the whole minibatch
            loss, m = diffusion_ql_actor_loss(q, bc, q_coef=config.q_coef, bc_coef=config.bc_coef, scale=scale)
            return loss, (loss, m)

        metrics = objective_step(actor_opt, objective, actor_w, actor_def, opt, "actor", dp.mean_over_ranks)
        with torch.no_grad():
            torch._foreach_lerp_(target_actor_w, [w.detach() for w in actor_w], config.tau)
            torch._foreach_lerp_(target_critic_w, [w.detach() for w in critic_w], config.tau)
        return {k: v.detach() for k, v in metrics.items()}

    steps = side_steps(critic_step, actor_step, config, device, "td3-diffusion", dp.world_size, AUTO_COMPILE_UPDATES)
    reported: list[bool] = []  # compile_s went into a metrics line already

    def compiled_sides(state: TensorDict, generator: torch.Generator):
        """(critic side, actor side), each ``mb -> metrics``: the compiled steps (data parallel: the
        eager ones, on this rank's share of the minibatch and of every draw) on the state's leaf
        lists (taken once: the steps write into the state's tensors), the draws made here in the
        eager order, for the whole minibatch."""
        params, target = state["params"], state["target"]
        w = (leaf_list(params["actor"]), leaf_list(params["critic"]), leaf_list(target["actor"]), leaf_list(target["critic"]),
             leaf_list(state["schedule"]))
        opt_critic, opt_actor = chain_state(state["optim_critic"]), chain_state(state["optim_actor"])

        def critic_side(mb: TensorDict) -> TensorDict:
            noise = actor.noise(mb.batch_size[0], generator)
            eps = torch.randn(noise.shape[1:], generator=generator, device=device)
            return TensorDict(steps[0](*w, opt_critic, dp.share(minibatch(mb)), dp.share(noise, 1), dp.share(eps)),
                              batch_size=[]).clone()

        def actor_side(mb: TensorDict) -> TensorDict:
            B = mb.batch_size[0]
            noise = actor.noise(B, generator)
            t = sample_timesteps((B,), spec.num_train_steps, generator=generator, device=device)
            bc_noise = torch.randn(mb["chunk"].shape, generator=generator, device=device)
            return TensorDict(steps[1](*w, opt_actor, dp.share(minibatch(mb)), dp.share(noise, 1), dp.share(t), dp.share(bc_noise)),
                              batch_size=[]).clone()

        return critic_side, actor_side

    def iteration(state: TensorDict, buffer, generator: torch.Generator, prec: Precision):
        """``updates_per_iteration`` TD3 steps on minibatches drawn from ``buffer`` (a TorchRL
        replay buffer of flat transitions, see :func:`transitions`; within the first
        ``critic_warmup_updates`` gradient steps the actor is held and only the target critics
        follow on its turns), each gradient through its side's
        update chain (whose state, "optim_critic" / "optim_actor", it advances); the params are
        stepped in place. Compiled (:func:`~rlfunc.algos.replay_diffusion.compiles`), the two sides
        are the compiled steps, with the same draws from ``generator`` in the same order."""
        opt = {key: state[key] for key in ("optim_critic", "optim_actor")}
        if steps is not None:
            critic_side, actor_side = compiled_sides(state, generator)
        else:
            critic_side = lambda mb: critic_update(state, mb, generator, opt, prec)  # noqa: E731
            actor_side = lambda mb: actor_update(state, mb, generator, opt, prec)  # noqa: E731
        metric_sum = StepMetrics()  # skipped_* counted; the rest the mean of the finite values (the actor's over its steps)
        updates = int(state["updates"])
        for _ in range(config.updates_per_iteration):
            idx = torch.randint(len(buffer), (config.batch_size,), generator=generator, device=device)
            mb = buffer[idx]  # the storage lives on the device: no host round trip
            metric_sum.add(critic_side(mb))
            updates += 1
            if updates % config.policy_delay == 0 and updates <= config.critic_warmup_updates:  # the actor held
                func.polyak_update_(state["target", "critic"], state["params", "critic"], config.tau)
            elif updates % config.policy_delay == 0:
                metric_sum.add(actor_side(mb))
                if steps is None:  # the compiled actor step updated the targets
                    func.polyak_update_(state["target", "actor"], state["params", "actor"], config.tau)
                    func.polyak_update_(state["target", "critic"], state["params", "critic"], config.tau)
        metrics = TensorDict(metric_sum.result(), batch_size=[])
        compile_s = [getattr(f, "compile_s", None) for f in steps] if steps is not None else [None]  # none where compile_step ran eager
        if compile_s[0] is not None and not reported:
            metrics["compile_s"] = torch.tensor(compile_s[0] + (compile_s[1] or 0.0))  # the first metrics line with updates
            reported.append(True)
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
    config="rlfunc.algos.td3_diffusion:TD3DiffusionConfig", run="rlfunc.run.diffusion:ReplayDiffusionRun",
    command="rlfunc.cli.diffusion:train_td3_diffusion", evaluate="rlfunc.run.diffusion:evaluate_run",
    needs="bounded-box-actions", family="diffusion", deploy=(("params", "actor"), ("encoder",)),
    usage="    rlfunc train td3-diffusion [--init-from BC_RUN_DIR] [...]",
))

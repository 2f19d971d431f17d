"""SAC with a diffusion actor, after DACER (Wang et al. 2024, "Diffusion Actor-Critic with Entropy
Regulator", arXiv:2405.15177, alg. 1).

The action is the end of the actor's reverse chain: a0 = DDIM_theta(s, x_K) over ``actor.ddim_steps``
steps with ``eta`` (1, the default: DDPM's stochastic reverse process, as DACER's p_sample; 0:
deterministic given the initial noise), plus Gaussian noise of std ``noise_scale * alpha``, clipped to
[-1, 1] (DACER eq. 13: alpha regulates exploration through this noise). The chain keeps its graph, so
the actor loss -min_e Q_e(s, a0) (DACER eq. 10) reaches every denoiser parameter through every step
(optionally recomputed per step: ``gradient_checkpointing``). A diffusion policy has no closed-form
density, so its entropy is estimated every ``entropy_every`` updates: ``entropy_samples`` actions
(before the clip) at each of ``entropy_states`` states of the minibatch, a ``entropy_components``-component Gaussian
mixture fitted by EM on the device (:func:`rlfunc.diffusion.entropy.gmm_entropy`, the "bound"
estimate sum_k w_k (H_k - log w_k), DACER's), averaged over the states; log alpha then takes one Adam
step on the temperature loss with log pi = -H (:func:`rlfunc.losses.sac.temperature_loss`, target
entropy -0.9 dim(A) by default, DACER's). The critics regress on r + gamma min_e Q'_e(s', a0') with
a0' drawn (noise included) from the current actor, as DACER does (no target actor; no entropy term in
the target, the noise carries it); the actor and the target critics step every ``policy_delay``
critic steps.

The critic step and the actor step (with the target critics' Polyak update) are also two pure
functions of flat leaf lists (gradients by ``torch.func.grad``, each chain's ``update_leaves`` with a
finiteness mask, in-place writes; the chain's noise drawn outside from the run's generator in the
eager order); ``--compile on`` (``auto``: float32 runs of >= :data:`AUTO_COMPILE_UPDATES`
gradient steps) runs them as two torch.compile graphs, equal to the eager update within 1e-5
(tests/optim/test_compiled_step.py). The entropy estimate and the alpha step stay eager (one in
``entropy_every`` updates), between the compiled steps, on the same generator.

Departures from DACER's code: plain twin Q critics with MSE regression (DACER uses DSAC-T's
distributional critics), shared with td3-diffusion; the EM fit runs in torch on the learner's device
instead of scikit-learn on the host (no host round trip; same estimate, see tests/diffusion/test_entropy.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
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
from rlfunc.diffusion.entropy import gmm_entropy
from rlfunc.errors import ConfigError
from rlfunc.losses.sac import temperature_loss
from rlfunc.losses.td3 import critic_loss, td3_actor_loss, td3_target
from rlfunc.optim import GradientTransform, adam, chain, clip_by_global_norm, flatten, unflatten
from rlfunc.optim.amp import Precision, backward, loss_scale_of, precision, transform_step, with_loss_scale
from rlfunc.optim.leaves import chain_state, leaf_list, objective_step

# --compile auto compiles a run of at least this many gradient steps (bench/compiled_diffusion_offpolicy.py,
# 2-core CPU, one thread, the defaults at batch 256: a cold compile took 308 s and saved 103 ms of the
# 217 ms update, entropy estimate included, a break-even of ~3,000 updates; 2,200 under load). The
# default 120k-step run (3,904 updates) compiles; short runs stay eager.
AUTO_COMPILE_UPDATES = 3_000


@dataclass(frozen=True)
class SACDiffusionConfig(ReplayDiffusionConfig):
    """Every sac-diffusion hyperparameter, with its default: the shared ones of
    :class:`~rlfunc.algos.replay_diffusion.ReplayDiffusionConfig` and DACER's. Steps count env steps."""

    name: ClassVar[str] = "sac-diffusion"

    actor: ActorSpec = field(default_factory=lambda: ActorSpec(horizon=1, act_steps=1, num_train_steps=20, ddim_steps=20))  # DACER: 20 reverse steps
    total_steps: int = 120_000  # env steps (PointReach-v0, seed 0: 0.73 success at 60k, 0.998 with both goals kept at 120k)
    eta: float = 1.0  # DDIM eta of the actor's chain in training and rollouts (1: DDPM, DACER's; 0: deterministic given the noise)
    eval_eta: float = 1.0  # DDIM eta at evaluation (the entropy noise is off there)
    alpha_lr: float = 3e-2  # Adam lr of log alpha (DACER's)
    init_alpha: float = 3.0  # initial alpha (DACER: 3; on PointReach-v0 1.0 kept one goal only)
    autotune: bool = True  # adapt alpha to the entropy estimate (False: alpha stays init_alpha)
    target_entropy: float | None = None  # H_bar (None: -0.9 * horizon * act_dim, DACER's)
    dependents: ClassVar[tuple] = (("autotune", lambda c: c.autotune, ("target_entropy", "alpha_lr")),)  # rlfunc.config.check_dependents
    noise_scale: float = 0.15  # std of the noise on a0 per unit alpha (DACER: 0.15; 0.1 for some envs)
    entropy_every: int = 20  # updates between entropy estimates and alpha steps (DACER: 10000 of 1M; here ~190 alpha steps in the default 120k-step run)
    entropy_states: int = 16  # minibatch states the entropy is estimated at (DACER: the whole minibatch; 16 x 200 chains cost ~0.4 s on 2 CPU cores)
    entropy_samples: int = 200  # actions sampled per state for the mixture fit (DACER: 200)
    entropy_components: int = 3  # Gaussian mixture components (DACER: 3)
    reward_scale: float = 1.0  # rewards are multiplied by this in the critic target (DACER: 0.2 on MuJoCo)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("eta", "eval_eta", "noise_scale", "reward_scale"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a finite number >= 0")
        for name in ("alpha_lr", "init_alpha"):  # one named at a time (both were named of either); nan, inf refused
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a finite number > 0")
        if self.noise_scale * self.init_alpha > 10:  # init_alpha=1e5 was a Cholesky traceback in the entropy fit
            raise ConfigError(f"noise_scale={self.noise_scale}, init_alpha={self.init_alpha}: expected noise_scale * "
                              "init_alpha <= 10 (the exploration noise's std in the [-1, 1] action box; DACER: 0.15 x 3)")
        if self.target_entropy is not None and not math.isfinite(self.target_entropy):
            raise ConfigError(f"target_entropy={self.target_entropy}: expected a finite number or None")
        for name in ("entropy_every", "entropy_states", "entropy_components"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected a positive integer")
        if self.entropy_samples < self.entropy_components:
            raise ConfigError(f"entropy_samples={self.entropy_samples}: expected >= entropy_components={self.entropy_components} "
                              "(the mixture needs a sample per component)")
        if self.entropy_states > self.batch_size:
            raise ConfigError(f"entropy_states={self.entropy_states}: expected <= batch_size={self.batch_size} "
                              "(the states are the minibatch's)")


class SACDiffusion(NamedTuple):
    """sac-diffusion's pure pieces, as :class:`rlfunc.run.diffusion.ReplayDiffusionRun` drives them."""

    init: Callable[..., TensorDict]
    rollout: Callable[..., TensorDict]
    iteration: Callable[..., tuple[TensorDict, TensorDict]]
    transitions: Callable[[TensorDict, TensorDict], TensorDict]
    actor: DiffusionActor
    critic_optimizer: GradientTransform  # the update chain of "params"/"critic", its state state["optim_critic"]
    actor_optimizer: GradientTransform  # the update chain of "params"/"actor", its state state["optim_actor"]
    alpha_optimizer: GradientTransform  # Adam of "params"/"log_alpha", its state state["optim_alpha"]
    noisy_action: Callable[..., Tensor]  # (actor params, state, cond [B, C], generator, **kw) -> a0 [B, H, A] in [-1, 1]
    entropy: Callable[..., Tensor]  # (actor params, state, cond [S, C], generator) -> H estimate [S, 1]
    optim_keys: tuple[str, ...] = ("optim_critic", "optim_actor", "optim_alpha")


def make_sac_diffusion(config: SACDiffusionConfig, spec: ActorSpec, obs_dim, act_dim: int, device: torch.device,
                       dist=None) -> SACDiffusion:
    """Build sac-diffusion's pure pieces. ``obs_dim``: the env's :class:`EnvInfo` (or a Box
    observation's size).

    Learner state (one TensorDict on ``device``): "params" {"actor" (the denoiser), "critic" [E, ...],
    "log_alpha" (0-dim)}, "target" {"critic"}, "obs_stats", "schedule", "entropy" (0-dim float32, the
    latest estimate, nats), "rng", "iteration", "env_steps", "updates" (critic steps so far), for a Dict
    observation "encoder" (a bc run's, frozen), and the update chains' states "optim_critic" and
    "optim_actor" (each ``chain(clip_by_global_norm(max_grad_norm), adam(lr))``) and "optim_alpha"
    (``adam(alpha_lr)``).

    ``dist``: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run of W
    ranks: the rollout acts for this rank's N/W envs with its rows of every env's noise; the critic
    and actor steps run as the leaf-list steps, eagerly, each on this rank's B/W of the minibatch and
    of its noise, the gradients, loss and metrics averaged over the ranks in one all_reduce per side
    before its chain (:mod:`rlfunc.algos.data_parallel`); the entropy estimate and the alpha step,
    on the first ``entropy_states`` states of the whole minibatch, are computed alike on every rank.
    ConfigError unless W divides ``num_envs`` and ``batch_size``, and W > 1 runs float32 without
    checkpointing.
    """
    dp = ranks(dist, config)
    actor = DiffusionActor(spec, obs_dim, act_dim, device)
    chunk_dim = spec.act_steps * act_dim
    E = config.num_critics
    target_entropy = -0.9 * chunk_dim if config.target_entropy is None else config.target_entropy
    critics_of = q_ensemble(actor.obs_dim, chunk_dim, config.critic_hidden, [config.run.seed + 1 + e for e in range(E)], device)
    prec_of_run = precision(device, config.run.precision)  # fp16: each chain in its own loss scale
    critic_opt = with_loss_scale(chain(clip_by_global_norm(config.max_grad_norm, stacked=False), adam(config.critic_lr)), prec_of_run)
    actor_opt = with_loss_scale(chain(clip_by_global_norm(config.max_grad_norm, stacked=False), adam(config.actor_lr)), prec_of_run)
    alpha_opt = chain(adam(config.alpha_lr))  # its loss runs in float32, unscaled
    q_all = critics_of.values

    def init(actor_params: TensorDict | None = None, obs_stats: TensorDict | None = None,
             encoder_params: TensorDict | None = None) -> TensorDict:
        state = replay_state(actor, config, critics_of.init(), actor_params, obs_stats, encoder_params, target_actor=False)
        state["params", "log_alpha"] = torch.tensor(math.log(config.init_alpha), device=device).requires_grad_(config.autotune)
        state["entropy"] = torch.zeros((), device=device)
        state["optim_critic"] = critic_opt.init(state["params", "critic"])
        state["optim_actor"] = actor_opt.init(state["params", "actor"])
        state["optim_alpha"] = alpha_opt.init(state["params"].select("log_alpha"))
        return state

    def noisy_action(params: TensorDict, state: TensorDict, cond: Tensor, generator: torch.Generator, *,
                     clip: bool = True, own=None, **kw) -> Tensor:
        """a0 [B, H, A] = clip(chain(cond) + noise_scale * alpha * eps, -1, 1) (``clip=False``: not
        clipped); the graph is kept into ``params`` (not into alpha, read detached). ``own``: a
        data-parallel rank's noise rows of its envs (:func:`rlfunc.algos.data_parallel.own_rows`)."""
        own = own or (lambda draw, n, dim: draw(n))
        B = cond.shape[0]
        x = actor.act(params, state["schedule"], cond, own(lambda n: actor.noise(n, generator), B, 1), eta=config.eta, **kw)
        sigma = config.noise_scale * state["params", "log_alpha"].detach().exp()
        a = x + sigma * own(lambda n: torch.randn((n, *x.shape[1:]), generator=generator, device=device), B, 0)
        return a.clamp(-1.0, 1.0) if clip else a

    @torch.no_grad()
    def entropy(params: TensorDict, state: TensorDict, cond: Tensor, generator: torch.Generator) -> Tensor:
        """H[pi(.|s)] of each state of ``cond`` [S, C] -> [S, 1] nats: ``entropy_samples`` noisy
        actions per state before the clip, the mixture's bound estimate. (Clipped, the actions of a
        policy at the bounds pile up on them, and a component fitted to such a pile has a near-zero
        covariance: N(0.95, 0.24^2 I) in 2-D clipped to [-1, 1] estimates -2.1 nats, unclipped 0.26,
        closed form -0.02, on 16 states of 200 draws.)"""
        S, M = cond.shape[0], config.entropy_samples
        a = noisy_action(params, state, cond.repeat_interleave(M, 0), generator, clip=False)  # [S*M, H, A]
        return gmm_entropy(a.reshape(S, M, chunk_dim), config.entropy_components, estimate="bound", generator=generator)

    def rollout(state: TensorDict, env, generator: torch.Generator) -> TensorDict:
        """:func:`~rlfunc.algos.replay_diffusion.replay_rollout` acting with :func:`noisy_action`."""
        return replay_rollout(actor, config, state, env, generator,
                              lambda cond: noisy_action(state["params", "actor"], state, cond, generator, own=dp.own), dp.own)

    def step_side(loss: Tensor, transform, opt: dict, key: str, params: TensorDict, prec: Precision | None) -> tuple[Tensor, bool]:
        for leaf in func.leaves(params):
            leaf.grad = None
        backward(loss, prec, loss_scale_of(opt[key]))
        norm, ok, opt[key] = transform_step(transform, opt[key], params, prec)
        return norm, ok

    def critic_update(state, mb, generator, opt, prec):
        params = state["params"]
        with torch.no_grad():
            a_next = noisy_action(params["actor"], state, mb["next_cond"], generator).flatten(1)
            y = td3_target(q_all(state["target", "critic"], mb["next_cond"], a_next), config.reward_scale * mb["reward"],
                           mb["terminated"], config.gamma)
        with prec.autocast():
            q = q_all(params["critic"], mb["cond"], mb["action"])
        loss, metrics = critic_loss(q.float(), y)
        norm, ok = step_side(loss, critic_opt, opt, "optim_critic", params["critic"], prec)
        metrics["critic_grad_norm"] = norm
        metrics["skipped_critic"] = torch.tensor(float(not ok))
        metrics["target_q"] = y.mean()
        return metrics

    def actor_update(state, mb, generator, opt, prec):
        params = state["params"]
        with prec.autocast():
            a = noisy_action(params["actor"], state, mb["cond"], generator, checkpoint=config.gradient_checkpointing)
            q = q_all(params["critic"].detach(), mb["cond"], a.flatten(1)).min(0).values
        loss, metrics = td3_actor_loss(q.float())
        norm, ok = step_side(loss, actor_opt, opt, "optim_actor", params["actor"], prec)
        metrics["actor_grad_norm"] = norm
        metrics["skipped_actor"] = torch.tensor(float(not ok))
        return metrics

    def alpha_update(state, mb, generator, opt):
        h = entropy(state["params", "actor"], state, mb["cond"][: config.entropy_states], generator)
        state["entropy"] = h.mean()
        if config.autotune:
            log_alpha = state["params"].select("log_alpha")
            loss, _ = temperature_loss(log_alpha["log_alpha"], -h, target_entropy)
            step_side(loss, alpha_opt, opt, "optim_alpha", log_alpha, None)

    # --compile: the critic step and the actor step as pure functions of flat leaf lists (the form
    # torch.compile takes whole), float32, without checkpointing
    _, actor_def = flatten(actor.init_params(config.run.seed))
    _, critic_def = flatten(critics_of.init())
    _, schedule_def = flatten(schedule_for(spec, device))

    def chain_end(actor_w: list[Tensor], schedule_w: list[Tensor], log_alpha: list[Tensor], cond: Tensor, noise: Tensor,
                  eps: Tensor) -> Tensor:
        """:func:`noisy_action` over leaf lists with its draws given: ``noise`` [K+1, B, H, A] (the
        chain's), ``eps`` [B, H, A] (the exploration noise's)."""
        x = actor.act(unflatten(actor_def, actor_w), unflatten(schedule_def, schedule_w), cond, noise, eta=config.eta)
        return (x + config.noise_scale * log_alpha[0].detach().exp() * eps).clamp(-1.0, 1.0)

    def critic_step(actor_w: list[Tensor], critic_w: list[Tensor], target_w: list[Tensor], log_alpha: list[Tensor],
                    schedule_w: list[Tensor], opt: tuple[list[Tensor], tuple], mb: dict, noise: Tensor, eps: Tensor) -> dict:
        """:func:`critic_update` in place on ``critic_w`` and ``opt`` (the critic chain's state,
        :func:`rlfunc.optim.leaves.chain_state`); the next action's draws ``noise``, ``eps`` given."""
        with torch.no_grad():
            a_next = chain_end(actor_w, schedule_w, log_alpha, mb["next_cond"], noise, eps).flatten(1)
            y = td3_target(q_all(stacked(critic_def, target_w, E), mb["next_cond"], a_next), config.reward_scale * mb["reward"],
                           mb["terminated"], config.gamma)

        def objective(w):
            loss, m = critic_loss(q_all(stacked(critic_def, w, E), mb["cond"], mb["action"]), y)
            m["target_q"] = y.mean()  # a mean over the minibatch: averaged over the ranks with the loss
            return loss, (loss, m)

        metrics = objective_step(critic_opt, objective, critic_w, critic_def, opt, "critic", dp.mean_over_ranks)
        return {k: v.detach() for k, v in metrics.items()}

    def actor_step(actor_w: list[Tensor], critic_w: list[Tensor], target_w: list[Tensor], log_alpha: list[Tensor],
                   schedule_w: list[Tensor], opt: tuple[list[Tensor], tuple], mb: dict, noise: Tensor, eps: Tensor) -> dict:
        """:func:`actor_update` (-min_e Q_e through the whole chain, the critics detached) in place
        on ``actor_w`` and ``opt``, then the Polyak update of ``target_w``."""
        critic = stacked(critic_def, [w.detach() for w in critic_w], E)

        def objective(w):
            a = chain_end(w, schedule_w, log_alpha, mb["cond"], noise, eps)
            loss, m = td3_actor_loss(q_all(critic, mb["cond"], a.flatten(1)).min(0).values)
            return loss, (loss, m)

        metrics = objective_step(actor_opt, objective, actor_w, actor_def, opt, "actor", dp.mean_over_ranks)
        with torch.no_grad():
            torch._foreach_lerp_(target_w, [w.detach() for w in critic_w], config.tau)
        return {k: v.detach() for k, v in metrics.items()}

    steps = side_steps(critic_step, actor_step, config, device, "sac-diffusion", dp.world_size, AUTO_COMPILE_UPDATES)
    reported: list[bool] = []  # compile_s went into a metrics line already

    def compiled_sides(state: TensorDict, generator: torch.Generator):
        """(critic side, actor side), each ``mb -> metrics``: the compiled steps (data parallel: the
        eager ones, on this rank's share of the minibatch and of its noise) on the state's leaf
        lists (taken once: the steps write into the state's tensors), the noise drawn here for the
        whole minibatch in the eager order (the chain's, then the exploration noise's)."""
        params = state["params"]
        w = (leaf_list(params["actor"]), leaf_list(params["critic"]), leaf_list(state["target", "critic"]),
             [params["log_alpha"].detach()], leaf_list(state["schedule"]))
        opts = chain_state(state["optim_critic"]), chain_state(state["optim_actor"])

        def side(i: int):
            def run(mb: TensorDict) -> TensorDict:
                B = mb.batch_size[0]
                noise = actor.noise(B, generator)
                eps = torch.randn(noise.shape[1:], generator=generator, device=device)
                return TensorDict(steps[i](*w, opts[i], dp.share(minibatch(mb)), dp.share(noise, 1), dp.share(eps)),
                                  batch_size=[]).clone()

            return run

        return side(0), side(1)

    def iteration(state: TensorDict, buffer, generator: torch.Generator, prec: Precision):
        """``updates_per_iteration`` steps on minibatches drawn from ``buffer`` (a TorchRL replay
        buffer of :func:`~rlfunc.algos.replay_diffusion.replay_transitions`): a critic step; every
        ``entropy_every``-th (the first included) an entropy estimate and an alpha step; every
        ``policy_delay``-th an actor step and the Polyak update of the target critics (within the
        first ``critic_warmup_updates`` gradient steps the Polyak update alone: the actor is held). Each side's
        gradient goes through its update chain (whose state it advances); params step in place.
        Compiled (:func:`~rlfunc.algos.replay_diffusion.compiles`), the critic and actor sides are
        the compiled steps, with the same draws from ``generator`` in the same order."""
        opt = {key: state[key] for key in ("optim_critic", "optim_actor", "optim_alpha")}
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
            if updates % config.entropy_every == 0:
                alpha_update(state, mb, generator, opt)
            updates += 1
            if updates % config.policy_delay == 0 and updates <= config.critic_warmup_updates:  # the actor held
                func.polyak_update_(state["target", "critic"], state["params", "critic"], config.tau)
            elif updates % config.policy_delay == 0:
                metric_sum.add(actor_side(mb))
                if steps is None:  # the compiled actor step updated the targets
                    func.polyak_update_(state["target", "critic"], state["params", "critic"], config.tau)
        metrics = TensorDict(metric_sum.result(), batch_size=[])
        compile_s = [getattr(f, "compile_s", None) for f in steps] if steps is not None else [None]  # none where compile_step ran eager
        if compile_s[0] is not None and not reported:
            metrics["compile_s"] = torch.tensor(compile_s[0] + (compile_s[1] or 0.0))  # the first metrics line with updates
            reported.append(True)
        metrics["alpha"] = state["params", "log_alpha"].detach().exp()
        metrics["entropy"] = state["entropy"].clone()
        metrics["target_entropy"] = torch.tensor(target_entropy)
        out = state.clone(recurse=False)
        out["iteration"] = state["iteration"] + 1
        out["updates"] = torch.tensor(updates, device=device)
        out["rng"] = generator.get_state()
        out.update(opt)
        return out, metrics

    def transitions(state: TensorDict, batch: TensorDict) -> TensorDict:
        """A rollout [N, T] -> flat transitions [N*T] (:func:`rlfunc.algos.replay_diffusion.replay_transitions`)."""
        return replay_transitions(actor, state, batch)

    return SACDiffusion(init, rollout, iteration, transitions, actor, critic_opt, actor_opt, alpha_opt, noisy_action, entropy)


register("sac-diffusion", AlgorithmEntry(
    config="rlfunc.algos.sac_diffusion:SACDiffusionConfig", run="rlfunc.run.diffusion:ReplayDiffusionRun",
    command="rlfunc.cli.diffusion:train_sac_diffusion", evaluate="rlfunc.run.diffusion:evaluate_run",
    needs="bounded-box-actions", family="diffusion", deploy=(("params", "actor"), ("encoder",)),
    usage="    rlfunc train sac-diffusion [--env ENV_ID] [--init-from BC_RUN_DIR] [--actor.ddim-steps K] [...]",
))

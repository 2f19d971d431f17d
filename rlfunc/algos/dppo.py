"""DPPO: PPO fine-tuning of a diffusion actor, as ``make_dppo(config) -> (init, rollout, iteration)``.

Two likelihoods drive the PPO ratio:

- ``"chain"`` (DPPO, Ren et al. 2024): DDIM with eta > 0 makes every denoising step a Gaussian
  pi(x_{k-1} | x_k, s) (std floored so eta = 0 stays finite); the ratio is per denoising step, over
  the last ``finetune_steps`` steps of the chain (the earlier ones run the frozen pretrained weights).
- ``"output-noise"``: deterministic DDIM (eta = 0) gives the chunk mean mu_theta(s, x_K); Gaussian
  exploration noise of std ``output_noise_std`` is added to the executed actions and its
  log-likelihood gives the ratio. One Gaussian per action instead of K: cheaper, and it needs no
  per-step likelihood of the sampler (useful on Ascend, where the fused DDIM kernels give no chain).
  The update backpropagates through the whole deterministic chain (optionally checkpointed per step).

A critic V_phi(s) on the actor's condition (the normalised observation, or the features of the bc
run's multimodal encoder, which stays frozen here) gives GAE advantages over chunk steps (one env step
of the learner executes ``act_steps`` actions open loop; rewards within a chunk are summed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NamedTuple

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.algos import data_parallel
from rlfunc.algos.diffusion_actor import ActorSpec, DiffusionActor, check_split, require_finite, schedule_for, with_encoder
from rlfunc.algos.registry import AlgorithmEntry, register
from rlfunc.config import RunConfig, check_env_workers, check_fields, require_default
from rlfunc.core import func
from rlfunc.core.returns import generalized_advantage_estimate
from rlfunc.device import compile_step
from rlfunc.diffusion.ddim import chain_log_prob, sample
from rlfunc.errors import ConfigError
from rlfunc.losses.dppo import clip_schedule, dppo_loss
from rlfunc.losses.ppo import EV_MAXIMA, EV_MOMENTS, normalize_advantage, pool_explained_variance
from rlfunc.nets.mlp import MLP, seeded_init
from rlfunc.optim import (GradientTransform, adam, all_reduce_mean, chain, clip_by_global_norm, flatten, minibatch_epochs, partition,
                          unflatten)
from rlfunc.optim.amp import Precision, accumulate_gradients, loss_scale_of, precision, transform_step, with_loss_scale
from rlfunc.optim.leaves import chain_state, chain_step, leaf_list

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)

# --compile auto compiles a run of at least this many gradient steps. bench/compiled_dppo.py, PointReach's
# actor on this 2-core CPU: compiled 0.58x eager (169 -> 99 ms per step under a load of ~4.7; the first
# call 127 s then), so compiling pays after ~1,000-1,800 steps depending on load; the default PointReach
# run has 1,480 (bench/RESULTS.md, "Compiled DPPO updates")
AUTO_COMPILE_UPDATES = 1_000


@dataclass(frozen=True)
class DPPOConfig:
    """Every DPPO hyperparameter, with its default. Steps count env steps (not chunks)."""

    env: str = "PointReach-v0"  # PointReach-v0 (torch-batched) or any gymnasium id with bounded Box actions
    init_from: str | None = None  # bc (or dppo/td3-diffusion) run dir or snapshot: its actor weights (EMA for bc), obs stats, schedule and actor spec
    actor: ActorSpec = field(default_factory=ActorSpec)  # used only without init_from
    likelihood: Literal["chain", "output-noise"] = "chain"  # what gives the PPO ratio (module doc)
    total_steps: int = 300_000  # env steps
    num_envs: int = 128  # parallel envs
    num_steps: int = 8  # chunk steps per env per rollout, from a reset (8 x 4 actions cover a 30-step episode)
    num_epochs: int = 5  # passes over each batch
    minibatch_size: int = 256  # chunk samples per gradient step; must divide num_envs * num_steps
    micro_batch_size: int | None = None  # gradient accumulation inside a minibatch (None: off)
    actor_lr: float = 3e-4  # Adam lr of the denoiser
    critic_lr: float = 1e-3  # Adam lr of the critic
    gamma: float = 0.9  # discount per chunk step (act_steps env steps), in [0, 1]
    lmbda: float = 0.95  # GAE lambda, in [0, 1]
    finetune_steps: int | None = None  # K': fine-tune the last K' denoising steps (None: all K); chain likelihood only
    # (switch, on, the fields only it reads): the output-noise update samples all K steps deterministically
    # with the trained weights and scores one Gaussian, so the chain's settings were recorded and unread there,
    # and output_noise_std under the chain (rlfunc.config.check_dependents)
    dependents: ClassVar[tuple] = (
        ("likelihood='chain'", lambda c: c.likelihood == "chain",
         ("finetune_steps", "eta", "sample_std_floor", "logprob_std_floor", "clip_min", "clip_rate", "denoising_discount")),
        ("likelihood='output-noise'", lambda c: c.likelihood == "output-noise", ("output_noise_std",)),
    )
    eta: float = 1.0  # DDIM eta while collecting (chain likelihood); evaluation uses eval_eta
    eval_eta: float = 0.0  # DDIM eta at evaluation (0: deterministic given the initial noise)
    sample_std_floor: float = 0.1  # min std of a denoising step while collecting (chain)
    logprob_std_floor: float = 0.1  # min std of a denoising step in the likelihood (chain)
    output_noise_std: float = 0.1  # exploration std on the executed actions (output-noise)
    clip_min: float = 0.01  # clip range of the chain's first denoising step (the schedule spans all K steps)
    clip_max: float = 0.05  # clip range of the last denoising step (and of output-noise)
    clip_rate: float = 3.0  # exponential rate of the clip schedule over denoising steps
    denoising_discount: float = 0.99  # gamma_denoise: advantage weight per denoising step back
    value_coef: float = 0.5  # critic loss weight
    max_grad_norm: float = 1.0  # global grad-norm clip
    target_kl: float | None = 1.0  # stop an iteration's epochs once approx KL exceeds it (None: off)
    critic_hidden: tuple[int, ...] = (256, 256)  # critic MLP widths
    reward_scale: float = 1.0  # rewards are multiplied by this
    normalize_advantages: bool = True  # per minibatch
    gradient_checkpointing: bool = False  # checkpoint each denoising step (output-noise update)
    run: RunConfig = field(default_factory=lambda: RunConfig(eval_episodes=500))  # seed (init, env, noise), device, precision (autocast of the networks), snapshots (rlfunc.config.RunConfig); 500 evaluation episodes (one per env, in parallel)

    def __post_init__(self) -> None:
        check_fields(self)
        require_finite(self)
        if not 0 <= self.value_coef < math.inf or any(h < 1 for h in self.critic_hidden):
            raise ConfigError(f"value_coef={self.value_coef}, critic_hidden={self.critic_hidden}: expected >= 0 and positive widths")
        for name in ("gamma", "lmbda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a value in [0, 1]")
        require_default(self.run, num_seeds="dppo trains one seed per run", vmap="dppo trains one seed per run",
                        log_every="dppo logs every iteration")
        for name in ("total_steps", "num_envs", "num_steps", "num_epochs", "minibatch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a positive integer")
        check_env_workers(self.run, self.num_envs)
        if (self.num_envs * self.num_steps) % self.minibatch_size:
            raise ConfigError(
                f"minibatch_size={self.minibatch_size} does not divide num_envs*num_steps={self.num_envs * self.num_steps}"
            )
        if self.likelihood not in ("chain", "output-noise"):
            raise ConfigError(f"likelihood={self.likelihood!r}: expected 'chain' or 'output-noise'")
        if self.gradient_checkpointing and self.likelihood == "chain":  # it was accepted and did nothing (and turned compiling off)
            raise ConfigError("gradient_checkpointing=True: the chain likelihood scores each stored denoising step on its own, "
                              "with no backward through the chain to checkpoint; expected likelihood='output-noise' with it")
        for name in ("actor_lr", "critic_lr", "max_grad_norm", "output_noise_std", "reward_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)}: expected > 0")
        if self.eta < 0 or self.eval_eta < 0 or self.sample_std_floor < 0 or self.logprob_std_floor <= 0:
            raise ConfigError("eta, eval_eta, sample_std_floor must be >= 0 and logprob_std_floor > 0")
        if self.finetune_steps is not None and not 1 <= self.finetune_steps:
            raise ConfigError(f"finetune_steps={self.finetune_steps}: expected >= 1 or None")
        if not 0 < self.denoising_discount <= 1:
            raise ConfigError(f"denoising_discount={self.denoising_discount}: expected a value in (0, 1]")
        if not 0 < self.clip_min <= self.clip_max:
            raise ConfigError(f"clip_min={self.clip_min}, clip_max={self.clip_max}: expected 0 < clip_min <= clip_max")
        if self.target_kl is not None and not self.target_kl > 0:
            raise ConfigError(f"target_kl={self.target_kl}: expected > 0 or None")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size={self.micro_batch_size}: expected >= 1 or None")
        if self.run.nproc > 1 and self.run.compile == "on":
            raise ConfigError(f"run.compile='on' with nproc={self.run.nproc}: dppo's compiled step is not data-parallel; "
                              "expected --compile off or auto with --nproc")
        data_parallel.check_divides(self.run.nproc, num_envs=self.num_envs, minibatch_size=self.minibatch_size)
        check_split(self.env, self.run.nproc, self.num_envs, self.run.env_workers, gymnasium_split=True)  # before torchrun starts the ranks

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    def num_iterations(self, act_steps: int) -> int:
        return max(1, math.ceil(self.total_steps / (self.batch_size * act_steps)))


class DPPO(NamedTuple):
    init: Callable[..., TensorDict]
    rollout: Callable[..., TensorDict]
    iteration: Callable[..., tuple[TensorDict, TensorDict]]
    actor: DiffusionActor
    critic: MLP
    optimizer: GradientTransform  # the update chain whose state is state["optim_all"]


def make_dppo(config: DPPOConfig, spec: ActorSpec, obs_dim, act_dim: int, device: torch.device, dist=None) -> DPPO:
    """Build DPPO's pure pieces for an actor described by ``spec`` (that of the BC snapshot) on an
    env described by ``obs_dim`` (its :class:`EnvInfo`, or a Box observation's size).

    ``dist``: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run of W
    ranks. Rank r then collects envs r*N/W .. (r+1)*N/W - 1 of the ``config.num_envs`` = N (its
    rollout is [N/W, T]) and ``iteration`` equals the single-process one on all N envs, to float
    rounding (:mod:`rlfunc.algos.data_parallel`): the policy draws the chains' noise for all N envs and
    keeps its rows; ``prepare`` (conditions, values, GAE, the stored log-likelihoods) runs on the
    rank's envs and the flat batch is all-gathered (rank order: the single process's env order);
    every rank draws the same minibatch order, normalises the advantages over the whole minibatch and
    takes its share of it; one ``all_reduce_mean`` of the gradients, the loss and the metrics precedes
    the norm, the skip and the chain, so ``target_kl`` stops every rank alike. W must divide
    ``num_envs`` and ``minibatch_size``; the compiled step is single-process (``--compile auto`` runs
    eager with W > 1). With ``micro_batch_size`` the data-parallel update normalises the advantages
    over the whole minibatch (one process: over each micro-batch).

    The learner state is one TensorDict: "params" {"actor", "critic"}, "base" (frozen pretrained
    actor, used by the denoising steps that are not fine-tuned), "obs_stats" (fixed), "schedule",
    "rng", "iteration", "env_steps", for a Dict observation "encoder" (frozen), and "optim_all", the
    state of the update chain over "params" ``chain(clip_by_global_norm(max_grad_norm),
    partition({"actor": adam(actor_lr, eps=1e-5), "critic": adam(critic_lr, eps=1e-5)}))`` (one clip
    of the joint norm, then Adam with a learning rate per side): "0" {"norm": [1], the last pre-clip
    gradient norm}, "1" {"actor", "critic"}, each {"step", "exp_avg", "exp_avg_sq"} (Adam's per-leaf
    step counts, 0-dim float32, and moments).
    """
    W, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)
    data_parallel.check_divides(W, num_envs=config.num_envs, minibatch_size=config.minibatch_size)
    own = data_parallel.own_rows(rank, W)  # the noise rows of this rank's envs
    reduce = all_reduce_mean(None if dist is None else dist.group)  # data parallel: ahead of the chain (stateless)
    actor = DiffusionActor(spec, obs_dim, act_dim, device)
    obs_dim = actor.obs_dim  # the condition's width
    critic = MLP(obs_dim, 1, config.critic_hidden, "tanh").to(device)
    K = spec.ddim_steps
    K_ft = K if config.finetune_steps is None else config.finetune_steps
    if K_ft > K:
        raise ConfigError(f"finetune_steps={K_ft}: expected <= ddim_steps={K}")
    first_step = K - K_ft
    clips = clip_schedule(K, config.clip_min, config.clip_max, config.clip_rate, device=device)[first_step:]
    sample_kw = dict(prediction=spec.prediction)
    optimizer = with_loss_scale(chain(clip_by_global_norm(config.max_grad_norm, stacked=False),
                                      partition({"actor": adam(config.actor_lr, eps=1e-5), "critic": adam(config.critic_lr, eps=1e-5)})),
                                precision(device, config.run.precision))

    def init(actor_params: TensorDict | None = None, obs_stats: TensorDict | None = None,
             encoder_params: TensorDict | None = None) -> TensorDict:
        if actor_params is None:
            actor_params = actor.init_params(config.run.seed)
        actor_params = func.as_leaves(actor_params.detach().clone())
        critic_params = func.params_from_module(seeded_init(lambda: MLP(obs_dim, 1, config.critic_hidden, "tanh"), config.run.seed + 1).to(device))
        gen = torch.Generator(device=device).manual_seed(config.run.seed)
        state = with_encoder(TensorDict(
            {
                "params": {"actor": actor_params, "critic": critic_params},
                "base": actor_params.detach().clone(),
                "obs_stats": obs_stats if obs_stats is not None else actor.init_stats(),
                "schedule": schedule_for(spec, device),
                "rng": gen.get_state(),
                "iteration": torch.zeros((), dtype=torch.int64, device=device),
                "env_steps": torch.zeros((), dtype=torch.int64, device=device),
            },
            batch_size=[],
            device=device,
        ), actor, encoder_params, config.run.seed)
        state["optim_all"] = optimizer.init(state["params"])
        return state

    def policy(state: TensorDict, generator: torch.Generator):
        """The collector's policy: td["observation"] -> td["action"] [N, act_steps, A] plus what the
        update needs ("chain" [N, K+1, H, A], or "x_T" and "loc" for output-noise)."""
        params, base, schedule = state["params", "actor"], state["base"], state["schedule"]

        @torch.no_grad()
        def act(td: TensorDict) -> TensorDict:
            cond = actor.condition(state.get("encoder", None), state["obs_stats"], td)
            td["cond"] = cond  # the update reuses it (the encoder and the statistics are fixed during dppo)
            noise = own(lambda n: actor.noise(n, generator), cond.shape[0], 1)  # [K+1, N', H, A]
            if config.likelihood == "chain":
                _, chain = sample(
                    actor.apply, params, cond, noise, schedule, K, config.eta, std_floor=config.sample_std_floor,
                    return_chain=True, frozen_params=base if first_step else None,
                    finetune_steps=K_ft if first_step else None, **sample_kw,
                )
                td["chain"] = chain
                td["action"] = actor.env_action(chain[:, -1])
            else:
                loc = actor.env_action(sample(actor.apply, params, cond, noise, schedule, K, 0.0, **sample_kw))
                z = own(lambda n: torch.randn((n, *loc.shape[1:]), generator=generator, device=device), loc.shape[0], 0)
                td["x_T"], td["loc"] = noise[0], loc
                td["action"] = loc + config.output_noise_std * z
            return td

        return act

    def rollout(state: TensorDict, env, generator: torch.Generator) -> TensorDict:
        """``num_steps`` chunk steps of every env from a reset: [N, T] TorchRL keys + the policy's."""
        return env.rollout(config.num_steps, policy(state, generator), break_when_any_done=False)

    def log_prob(actor_params: TensorDict, schedule: TensorDict, mb) -> Tensor:
        """[B, K'] per-step log-likelihoods (chain) or [B, 1] (output-noise) of the stored samples
        (``mb``: a TensorDict or a dict of its tensors)."""
        if config.likelihood == "chain":
            return chain_log_prob(
                actor.apply, actor_params, mb["cond"], mb["chain"], schedule, K, config.eta,
                std_floor=config.logprob_std_floor, first_step=first_step, **sample_kw,
            )
        noise = torch.zeros((K + 1, *mb["x_T"].shape), device=device)
        noise[0] = mb["x_T"]
        loc = actor.env_action(sample(
            actor.apply, actor_params, mb["cond"], noise, schedule, K, 0.0,
            checkpoint=config.gradient_checkpointing, **sample_kw,
        ))
        sigma = config.output_noise_std
        z = (mb["action"] - loc) / sigma
        return (-0.5 * z.square() - math.log(sigma) - _HALF_LOG_2PI).flatten(1).sum(1, keepdim=True)

    def prepare(state: TensorDict, batch: TensorDict, prec: Precision) -> TensorDict:
        """Conditions, values, GAE and the stored samples' log-likelihoods; [N, T] -> flat [N*T].

        The stored log-likelihoods are computed under the same autocast as the update's, so the
        ratio of unchanged parameters is exactly 1 in every precision."""
        obs_stats = state["obs_stats"]
        with torch.no_grad():
            encoder = state.get("encoder", None)
            cond = batch["cond"] if "cond" in batch.keys() else actor.condition(encoder, obs_stats, batch)
            next_cond = actor.condition(encoder, obs_stats, batch["next"])
            critic_params = state["params", "critic"]
            value = func.apply(critic, critic_params, cond)
            next_value = func.apply(critic, critic_params, next_cond)
            reward = batch["next", "reward"] * config.reward_scale
            advantage, value_target = generalized_advantage_estimate(
                config.gamma, config.lmbda, value, next_value, reward, batch["next", "done"], batch["next", "terminated"]
            )
            flat = TensorDict(
                {"cond": cond, "action": batch["action"], "advantage": advantage, "value_target": value_target, "state_value": value},
                batch_size=batch.batch_size,
            )
            for key in ("chain", "x_T", "loc"):
                if key in batch.keys():
                    flat[key] = batch[key]
            flat = flat.flatten(0, 1)
            with prec.autocast():
                old_log_prob = [log_prob(state["params", "actor"], state["schedule"], mb) for mb in flat.split(max(config.minibatch_size, 1024))]
            flat["sample_log_prob"] = torch.cat(old_log_prob).float()
        return flat

    def loss_fn(params: TensorDict, schedule: TensorDict, micro) -> tuple[Tensor, TensorDict]:
        """The DPPO loss of one (micro-)batch ``micro`` (a TensorDict or a dict of its tensors)."""
        lp = log_prob(params["actor"], schedule, micro)
        value = func.apply(critic, params["critic"], micro["cond"])
        return dppo_loss(
            lp.float(), micro["sample_log_prob"], micro["advantage"], value.float(), micro["value_target"],
            clip_epsilon=clips if config.likelihood == "chain" else config.clip_max,
            denoising_discount=config.denoising_discount,
            total_steps=K if config.likelihood == "chain" else 1,
            value_coef=config.value_coef,
            normalize_advantages=config.normalize_advantages and W == 1,  # data parallel: over the whole minibatch, before the share
            poolable=W > 1 or config.micro_batch_size is not None,  # the minibatch's explained variance from its parts'
        )

    # --compile: one minibatch's gradient step as one pure function of flat leaf lists (the form
    # torch.compile takes whole), float32 and without micro-batches or checkpointing
    template = TensorDict({"actor": actor.init_params(config.run.seed),
                           "critic": func.params_from_module(critic)}, batch_size=[])
    params_def = flatten(template)[1]
    schedule_def = flatten(schedule_for(spec, device))[1]
    mb_keys = ("cond", "advantage", "value_target", "sample_log_prob", *(("chain",) if config.likelihood == "chain" else ("x_T", "action")))

    def grad_step(w: list[Tensor], opt: tuple[list[Tensor], tuple], schedule_w: list[Tensor], mb: dict) -> dict:
        """The gradient of :func:`loss_fn` by torch.func.grad, then ``optimizer``'s chain in place on
        ``w`` (the params' leaves) and ``opt`` (its state's; rlfunc.optim.leaves.chain_step). Returns
        the loss metrics, "grad_norm" and "skipped" (1.0 when the loss or the norm was not finite)."""
        schedule = unflatten(schedule_def, schedule_w)

        def objective(leaves):
            loss, m = loss_fn(unflatten(params_def, leaves), schedule, mb)
            return loss, (loss, m)

        grads, (loss, m) = torch.func.grad(objective, has_aux=True)(w)
        metrics = m.to_dict()
        metrics["grad_norm"] = chain_step(optimizer, grads, w, params_def, opt, loss)
        metrics["skipped"] = (~(metrics["grad_norm"].isfinite() & loss.isfinite())).float()
        return {k: v.detach() for k, v in metrics.items()}

    updates_of_run = config.num_iterations(spec.act_steps) * config.num_epochs * (config.batch_size // config.minibatch_size)
    compilable = config.micro_batch_size is None and not config.gradient_checkpointing and config.run.precision == "off" and W == 1
    if config.run.compile == "on" and not compilable:
        raise ConfigError("run.compile='on': dppo compiles its float32 gradient step in one process; expected micro_batch_size=None, "
                          "gradient_checkpointing=False, run.precision='off' and one process with it (or --compile off)")
    compiled = compilable and (config.run.compile == "on" or (config.run.compile == "auto" and updates_of_run >= AUTO_COMPILE_UPDATES))
    compiled_step = compile_step(grad_step, device, config.run.compile, "dppo", static_args=(0, 1, 2)) if compiled else None
    reported: list[bool] = []  # compile_s went into a metrics line already

    def iteration(state: TensorDict, batch: TensorDict, generator: torch.Generator, prec: Precision):
        """One DPPO update on a rollout ``batch`` [N, T]: each minibatch's gradient through the update
        chain, whose state ``state["optim_all"]`` it advances; "params" are stepped in place (the
        policy holds them). Returns (new state, metrics)."""
        flat = prepare(state, batch, prec)
        if W > 1:  # the global batch, rank order = the single process's env order
            flat = dist.all_gather_batch(flat, dim=0)
        params = state["params"]
        leaves = func.leaves(params)
        opt = {"state": state["optim_all"]}
        B = flat.batch_size[0]

        if compiled_step is not None:
            w, opt_leaves, schedule_w = leaf_list(params), chain_state(opt["state"]), leaf_list(state["schedule"])

        def update(mb: TensorDict) -> TensorDict:
            if W > 1:  # the whole minibatch's advantages normalised (as the loss would), then this rank's share
                if config.normalize_advantages:
                    mb["advantage"] = normalize_advantage(mb["advantage"])
                mb = data_parallel.share(mb, rank, W)
            if compiled_step is not None:
                return pool_explained_variance(TensorDict(compiled_step(w, opt_leaves, schedule_w, {k: mb[k] for k in mb_keys}), batch_size=[]))
            for leaf in leaves:
                leaf.grad = None
            loss, metrics = accumulate_gradients(lambda micro: loss_fn(params, state["schedule"], micro), mb,
                                                 config.micro_batch_size, prec=prec, scale=loss_scale_of(opt["state"]),
                                                 maxima=("ratio_max", *EV_MAXIMA), moments=EV_MOMENTS)
            if W > 1:  # the mean over the ranks' shares: the whole minibatch's gradient, loss and metrics (ratio_max: the max)
                _, metrics = data_parallel.average_grads_(reduce, leaves, loss, metrics, maxima=("ratio_max", *EV_MAXIMA),
                                                          moments=EV_MOMENTS, rank=rank, world_size=W)
            metrics = pool_explained_variance(metrics)
            norm, ok, opt["state"] = transform_step(optimizer, opt["state"], params, prec)
            metrics["grad_norm"] = norm
            metrics["skipped"] = torch.tensor(float(not ok))
            return metrics

        metrics, updates = minibatch_epochs(flat, config.minibatch_size, config.num_epochs, update,
                                            generator=generator, target_kl=config.target_kl)
        out = state.clone(recurse=False)
        out["iteration"] = state["iteration"] + 1
        out["env_steps"] = state["env_steps"] + B * spec.act_steps
        out["rng"] = generator.get_state()
        out["optim_all"] = opt["state"]
        metrics["updates"] = torch.tensor(float(updates))
        if compiled_step is not None and compiled_step.compile_s is not None and not reported:
            metrics["compile_s"] = torch.tensor(compiled_step.compile_s)  # the first iteration's metrics line
            reported.append(True)
        return out, metrics

    return DPPO(init, rollout, iteration, actor, critic, optimizer)


register("dppo", AlgorithmEntry(
    config="rlfunc.algos.dppo:DPPOConfig", run="rlfunc.run.diffusion:DPPORun", command="rlfunc.cli.diffusion:train_dppo",
    evaluate="rlfunc.run.diffusion:evaluate_run",
    needs="bounded-box-actions", family="diffusion", deploy=(("params", "actor"), ("encoder",)),
    usage="    rlfunc train dppo [--env ENV_ID] [--init-from BC_RUN_DIR] [--likelihood chain|output-noise] [...]",
))

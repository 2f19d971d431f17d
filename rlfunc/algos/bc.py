"""Diffusion behaviour cloning: DDPM training of a diffusion actor on demonstrations, with an EMA.

The usual pretraining before ``dppo``: the denoiser learns the demonstrations' (multimodal) action
chunks given the observation; evaluation and fine-tuning use the EMA of the weights. ``--compile on``
(``auto``: float32 single-process runs of >= :data:`AUTO_COMPILE_UPDATES` updates) runs the gradient
step (the denoising loss over the batch's micro-batches, torch.func.grad, clip and AdamW) as one
torch.compile graph, within float rounding of the eager step.

References: Ho et al. (2020), "Denoising Diffusion Probabilistic Models", Algorithm 1 (epsilon
prediction); Chi et al. (2023), "Diffusion Policy" (action chunks, EMA of the weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple
from collections.abc import Callable

import torch
from tensordict import TensorDict
from torch import Tensor

from rlfunc.algos import data_parallel
from rlfunc.algos.diffusion_actor import ActorSpec, DiffusionActor, require_finite, schedule_for
from rlfunc.algos.registry import AlgorithmEntry, register
from rlfunc.config import RunConfig, check_fields, require_default
from rlfunc.core import func
from rlfunc.core.normalize import update_running_stats
from rlfunc.device import compile_step
from rlfunc.diffusion.ddpm import denoising_loss, sample_timesteps
from rlfunc.errors import ConfigError
from rlfunc.optim import GradientTransform, adam, all_reduce_mean, chain, clip_by_global_norm, flatten, unflatten
from rlfunc.optim.amp import Precision, accumulate_gradients, loss_scale_of, precision, transform_step, with_loss_scale
from rlfunc.optim.leaves import chain_state, chain_step, leaf_list

# --compile auto compiles a run of at least this many gradient steps. bench/compiled_bc_encoder.py, the
# default PointReach actor (batches of 512) on this 2-core CPU under load: compiled 0.54x eager per update
# (65.8 -> 35.4 ms), the first call 70.7 s, so compiling pays after ~2,300 updates; the default run has 5,000
# (bench/RESULTS.md, "Compiled bc and ppo-encoder updates")
AUTO_COMPILE_UPDATES = 2_500


@dataclass(frozen=True)
class BCConfig:
    """Every diffusion-BC hyperparameter, with its default."""

    env: str = "PointReach-v0"  # an env with a scripted expert: PointReach-v0, PushState-v0, Push-v0 (images)
    actor: ActorSpec = field(default_factory=ActorSpec)  # architecture and diffusion settings
    num_demos: int = 1000  # expert episodes in the dataset
    demo_noise_std: float = 0.1  # std of the expert's action noise, in action units
    num_updates: int = 5000  # gradient steps
    batch_size: int = 512  # samples per gradient step
    micro_batch_size: int | None = None  # gradient accumulation: samples per backward (None: whole batch)
    lr: float = 3e-3  # AdamW learning rate
    weight_decay: float = 1e-6  # AdamW's decoupled weight decay, per unit of lr
    ema_decay: float = 0.99  # EMA of the weights per update (Chi et al. use 0.995 over longer runs)
    max_grad_norm: float = 1.0  # global grad-norm clip
    run: RunConfig = field(default_factory=lambda: RunConfig(log_every=100, checkpoint_every=1000, eval_episodes=500))  # seed (dataset, init, noise), device, precision (autocast of the denoiser forward), snapshots (rlfunc.config.RunConfig); iterations are updates; a metrics line per 100, a snapshot per 1000, 500 evaluation episodes (one per env, in parallel)

    def __post_init__(self) -> None:
        check_fields(self)
        require_finite(self)
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay={self.weight_decay}: expected >= 0")
        require_default(self.run, num_seeds="bc trains one seed per run", vmap="bc trains one seed per run",
                        env_workers="bc learns from demonstrations: its envs (the final evaluation) step in this process")
        for name in ("num_demos", "num_updates", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: expected a positive integer")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size={self.micro_batch_size}: expected >= 1 or None")
        data_parallel.check_divides(self.run.nproc, batch_size=self.batch_size)  # before torchrun starts the ranks
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay={self.ema_decay}: expected a value in [0, 1)")
        if not self.lr > 0 or not self.max_grad_norm > 0:
            raise ConfigError("lr and max_grad_norm must be > 0")
        if self.demo_noise_std < 0:
            raise ConfigError(f"demo_noise_std={self.demo_noise_std}: expected >= 0")
        if self.run.compile == "on" and not self.compilable:
            raise ConfigError(f"run.compile='on': bc compiles its float32 gradient step in one process; expected run.precision='off', "
                              f"actor.checkpoint_vision=False and nproc=1 with it (got precision={self.run.precision!r}, "
                              f"checkpoint_vision={self.actor.checkpoint_vision}, nproc={self.run.nproc}; or --compile off)")

    @property
    def compilable(self) -> bool:
        """Whether the gradient step can run compiled: float32 (no autocast or loss scaling), no
        checkpointed vision trunk, one process (the data-parallel step all-reduces in eager code)."""
        return self.run.precision == "off" and not self.actor.checkpoint_vision and self.run.nproc == 1


class BC(NamedTuple):
    init: Callable[[TensorDict], TensorDict]
    iteration: Callable[..., tuple[TensorDict, TensorDict]]
    actor: DiffusionActor
    trainable: Callable[[TensorDict], list]
    optimizer: GradientTransform  # the update chain whose state is state["optim_actor"]
    trainable_params: Callable[[TensorDict], TensorDict]


def ema_update_(ema: TensorDict, params: TensorDict, decay: float) -> None:
    """``ema <- decay * ema + (1 - decay) * params`` in place, leaf by leaf (:func:`rlfunc.core.func.polyak_update_`
    with tau = 1 - decay)."""
    func.polyak_update_(ema, params, 1.0 - decay)


def make_bc(config: BCConfig, obs_dim, act_dim: int, device: torch.device, dist=None) -> BC:
    """Build diffusion BC's pure pieces; ``obs_dim`` is the env's :class:`EnvInfo` (or a Box
    observation's size).

    ``dist``: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run of W
    ranks, each holding the whole dataset. ``iteration`` then equals the single-process one, to float
    rounding (:mod:`rlfunc.algos.data_parallel`): every rank draws the batch's indices, timesteps and
    noise for all ``batch_size`` samples (the generators stay in sync), takes its share (samples
    [r m/W, (r+1) m/W) of the m = ``batch_size``) and averages the gradients, the loss and the
    metrics with one ``all_reduce_mean`` before the norm and the chain. W must divide ``batch_size``;
    the compiled step (``--compile``) is single-process (``auto`` runs eager with W > 1).

    The learner state is one TensorDict: "params" and "ema" (denoiser), "obs_stats" (of the
    dataset's observations, or of its proprio for a Dict observation; fixed), "schedule" (betas,
    alphas, alphas_cumprod [T]), "rng" (generator state), "iteration" (0-dim int64), for a Dict
    observation "encoder" and "encoder_ema" (the multimodal encoder, trained end to end with the
    denoiser through the denoising loss), and "optim_actor", the state of the update chain
    ``chain(clip_by_global_norm(max_grad_norm), adam(lr, weight_decay=weight_decay))`` (AdamW) over
    :func:`trainable_params`: "0" {"norm": [1], the last pre-clip gradient norm}, "1" {"step",
    "exp_avg", "exp_avg_sq"}, Adam's per-leaf step counts (0-dim float32) and moments, keyed as
    {"params": ..., "encoder": ...}.
    """
    W, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)
    data_parallel.check_divides(W, batch_size=config.batch_size)
    reduce = all_reduce_mean(None if dist is None else dist.group)  # data parallel: ahead of the chain (stateless)
    actor = DiffusionActor(config.actor, obs_dim, act_dim, device)
    T = config.actor.num_train_steps
    obs_keys = actor.info.obs_keys
    # torch.optim.AdamW's defaults (betas, eps), which bc stepped before its state moved into the learner
    optimizer = with_loss_scale(chain(clip_by_global_norm(config.max_grad_norm, stacked=False),
                                      adam(config.lr, weight_decay=config.weight_decay)), precision(device, config.run.precision))

    def trainable_params(state: TensorDict) -> TensorDict:
        """The leaves the optimizer updates, the same tensors: {"params": the denoiser's, "encoder":
        the encoder's but its frozen trunk} (no "encoder" for a Box observation)."""
        parts = {"params": state["params"]}
        if actor.encoder is not None:
            parts["encoder"] = actor.trainable_encoder(state["encoder"])
        return TensorDict(parts, batch_size=[], device=device)

    def init(dataset: TensorDict) -> TensorDict:
        params = actor.init_params(config.run.seed)
        stats = actor.init_stats()
        if actor.info.stats_key is not None:
            stats = update_running_stats(stats, dataset[actor.info.stats_key].float())
        gen = torch.Generator(device=device).manual_seed(config.run.seed)
        state = TensorDict(
            {
                "params": params,
                "ema": params.detach().clone(),
                "obs_stats": stats,
                "schedule": schedule_for(config.actor, device),
                "rng": gen.get_state(),
                "iteration": torch.zeros((), dtype=torch.int64, device=device),
            },
            batch_size=[],
            device=device,
        )
        if actor.encoder is not None:
            encoder = actor.init_encoder_params(config.run.seed + 1)
            state["encoder"], state["encoder_ema"] = encoder, encoder.detach().clone()
        state["optim_actor"] = optimizer.init(trainable_params(state))
        return state

    def trainable(state: TensorDict) -> list:
        """The leaves the optimizer updates: the denoiser's, then the encoder's but its frozen trunk
        (each in :func:`rlfunc.core.func.leaves` order; the parameter order of the torch.optim.AdamW of
        state layout 1)."""
        leaves = func.leaves(state["params"])
        if actor.encoder is not None:
            leaves += func.leaves(actor.trainable_encoder(state["encoder"]))
        return leaves

    def loss_fn(params: TensorDict, encoder: TensorDict | None, obs_stats: TensorDict, alphas_cumprod: Tensor, mb):
        """The denoising loss of one (micro-)batch ``mb`` (a TensorDict or a dict of its tensors: the
        observation keys, "x0", "t", "noise") and its metrics."""
        cond = actor.condition(encoder, obs_stats, mb)
        loss = denoising_loss(actor.apply, params, mb["x0"], cond, mb["t"], mb["noise"], alphas_cumprod,
                              prediction=config.actor.prediction)
        return loss, TensorDict({"loss_denoise": loss.detach()}, batch_size=[])

    # --compile: the gradient step as one pure function of flat leaf lists (the form torch.compile
    # takes whole): float32, one process; micro-batches are unrolled inside it
    compiled = config.compilable and W == 1 and (config.run.compile == "on" or (config.run.compile == "auto" and config.num_updates >= AUTO_COMPILE_UPDATES))
    frozen_keys, frozen_def = (actor.encoder.frozen_keys if actor.encoder is not None else []), None
    if compiled:  # the tree definitions of the step's leaf lists
        template = TensorDict({"params": actor.init_params(config.run.seed)}, batch_size=[])
        if actor.encoder is not None:
            encoder_template = actor.init_encoder_params(config.run.seed + 1)
            template["encoder"] = actor.trainable_encoder(encoder_template)
            frozen_def = flatten(encoder_template.select(*frozen_keys))[1] if frozen_keys else None
        stepped_def = flatten(template)[1]
        stats_def = flatten(actor.init_stats())[1]
    m_local = config.batch_size // W
    micro = m_local if config.micro_batch_size is None else min(config.micro_batch_size, m_local)
    micro_slices = [(start, min(micro, m_local - start)) for start in range(0, m_local, micro)]

    def grad_step(w: list[Tensor], opt: tuple[list[Tensor], tuple], const: tuple[list[Tensor], list[Tensor], Tensor], mb: dict) -> dict:
        """The gradient of :func:`loss_fn` over the batch ``mb`` (its micro-batches' gradients, each
        weighted by its share of the batch, summed in order: what :func:`accumulate_gradients` leaves
        in ``.grad``) by torch.func.grad, then ``optimizer``'s chain in place on ``w`` (the
        :func:`trainable_params` leaves) and ``opt`` (its state's; rlfunc.optim.leaves.chain_step).
        ``const``: (the obs statistics' leaves, the frozen encoder trunk's leaves or [], alphas_cumprod
        [T]). Returns "loss_denoise", "grad_norm" and "skipped" (1.0 when the loss or the norm was not
        finite: nothing moved)."""
        stats_w, frozen_w, alphas_cumprod = const
        obs_stats = unflatten(stats_def, stats_w)
        grads, loss = None, None
        for start, n in micro_slices:
            part = {k: v.narrow(0, start, n) for k, v in mb.items()}
            weight = n / m_local

            def objective(leaves, part=part, weight=weight):
                p = unflatten(stepped_def, leaves)
                encoder = None
                if actor.encoder is not None:
                    encoder = p["encoder"]
                    if frozen_def is not None:
                        encoder = encoder.update(unflatten(frozen_def, frozen_w))
                scaled = loss_fn(p["params"], encoder, obs_stats, alphas_cumprod, part)[0].float() * weight
                return scaled, scaled.detach()

            g, scaled = torch.func.grad(objective, has_aux=True)(w)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            loss = scaled if loss is None else loss + scaled
        norm = chain_step(optimizer, grads, w, stepped_def, opt, loss, with_params=True)  # AdamW's decay reads w
        return {"loss_denoise": loss, "grad_norm": norm, "skipped": (~(norm.isfinite() & loss.isfinite())).float()}

    compiled_step = compile_step(grad_step, device, config.run.compile, "bc", static_args=(0, 1, 2)) if compiled else None
    reported: list[bool] = []  # compile_s went into a metrics line already

    def iteration(state: TensorDict, dataset: TensorDict, generator: torch.Generator, prec: Precision):
        """One gradient step on a random batch of ``dataset`` ([M] with "observation", "action"): the
        gradient through the update chain, whose state ``state["optim_actor"]`` it advances; the
        :func:`trainable_params` leaves are stepped in place."""
        m = config.batch_size
        idx = torch.randint(dataset.batch_size[0], (m,), generator=generator, device=device)
        t = sample_timesteps((m,), T, generator=generator, device=device)
        noise = torch.randn((m, *dataset["action"].shape[1:]), generator=generator, device=device)
        idx, t, noise = (data_parallel.share(x, rank, W) for x in (idx, t, noise))  # this rank's samples
        batch = dataset[idx]
        batch = TensorDict(
            {**{k: batch[k] for k in obs_keys}, "x0": batch["action"], "t": t, "noise": noise},
            batch_size=[m // W],
        )
        params, encoder = state["params"], state.get("encoder", None)
        stepped = trainable_params(state)
        if compiled_step is not None:
            opt_state = state["optim_actor"]
            frozen = leaf_list(state["encoder"].select(*frozen_keys)) if frozen_def is not None else []
            const = (leaf_list(state["obs_stats"]), frozen, state["schedule", "alphas_cumprod"])
            metrics = TensorDict(compiled_step(leaf_list(stepped), chain_state(opt_state), const, {k: batch[k] for k in batch.keys()}),
                                 batch_size=[])
        else:
            for leaf in func.leaves(stepped):
                leaf.grad = None
            loss, metrics = accumulate_gradients(
                lambda mb: loss_fn(params, encoder, state["obs_stats"], state["schedule", "alphas_cumprod"], mb),
                batch, config.micro_batch_size, prec=prec, scale=loss_scale_of(state["optim_actor"]))
            if W > 1:  # the mean over the ranks' shares: the gradient of the whole batch
                loss, metrics = data_parallel.average_grads_(reduce, func.leaves(stepped), loss, metrics)
            norm, ok, opt_state = transform_step(optimizer, state["optim_actor"], stepped, prec)
            metrics["grad_norm"] = norm
            metrics["skipped"] = torch.tensor(float(not ok))
        ema_update_(state["ema"], params, config.ema_decay)
        if encoder is not None:
            ema_update_(state["encoder_ema"], encoder, config.ema_decay)
        out = state.clone(recurse=False)
        out["iteration"] = state["iteration"] + 1
        out["rng"] = generator.get_state()
        out["optim_actor"] = opt_state
        if compiled_step is not None and compiled_step.compile_s is not None and not reported:
            metrics["compile_s"] = torch.tensor(compiled_step.compile_s)  # the first update's metrics
            reported.append(True)
        return out, metrics

    return BC(init, iteration, actor, trainable, optimizer, trainable_params)


register("bc", AlgorithmEntry(
    config="rlfunc.algos.bc:BCConfig", run="rlfunc.run.diffusion:BCRun", command="rlfunc.cli.diffusion:train_bc",
    evaluate="rlfunc.run.diffusion:evaluate_run",
    needs="expert",  # a scripted expert (envs.registry) and bounded Box actions
    family="diffusion", budget="num_updates", unit="updates",
    deploy=(("ema",), ("encoder_ema",)),  # the EMA weights (actor, encoder)
    usage="    rlfunc train bc [--env PointReach-v0|PushState-v0|Push-v0] [--num-demos N] [--actor.denoiser mlp|unet] [...]\n"
          "                                            diffusion BC on the env's scripted-expert demos",
))

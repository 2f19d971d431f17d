"""Whole runs of the diffusion algorithms (bc, dppo, td3-diffusion), each one function of its config.

Each writes RUN_DIR/config.json, metrics.jsonl (one line per logged iteration), checkpoints/
(safetensors snapshots whose learner state includes the noise schedule, verified against the actor
spec on every load; meta.json also records the env's observation layout) and eval.json (one episode
per env with deterministic DDIM, eta = 0: return, success rate, and PointReach's mode statistics).

Envs: PointReach-v0 (torch-batched) and any gymnasium id with bounded Box actions, through
:class:`rlfunc.chunk_env.GymChunkEnv`; bc needs a scripted expert (PointReach-v0, PushState-v0,
Push-v0). Dict observations (Push-v0: two cameras, proprio, an instruction) go through a
:class:`rlfunc.nets.encoders.MultimodalEncoder` trained by bc and kept frozen by dppo / td3-diffusion.

``init_from`` (dppo, td3-diffusion) takes a bc run dir or snapshot and starts from its EMA weights,
observation statistics and actor spec. A snapshot is written every ``checkpoint_every`` iterations
and at the end.

Resume: ``train_bc`` / ``train_dppo`` / ``train_td3_diffusion`` with ``resume=True`` (or
:func:`resume_diffusion`, which reads the algorithm from the snapshot) continue a run from its latest
snapshot with the snapshot's config, optionally with a new budget. On CPU the continuation is exact:
N iterations, stop, resume to 2N give the same parameters, optimizer states and RNG states as 2N
iterations in one go. Besides the learner state (whose "rng" is the generator of the noise and the
minibatch order) and every optimizer's state, a snapshot holds what the loop carries between
iterations: the env's RNG ("env_rng": PointReach-v0's torch generator state in the tensors, a
:class:`~rlfunc.chunk_env.GymChunkEnv`'s numpy bit-generator state in meta.json; every rollout
starts with a full reset seeded from it, so nothing else of the env survives an iteration), the
fp16 grad scaler's state (meta), bc's metrics summed since the last metrics line, and td3-diffusion's
replay buffer (its filled rows and the writer's cursor; ``checkpoint_buffer=False`` leaves it out,
and a resumed run then refills an empty buffer, with a warning). bc's demonstrations are not saved:
they are collected again from the config's seed. Metrics lines written after the snapshot (before a
crash) are dropped on resume.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import NamedTuple

import torch
from tensordict import TensorDict

from rlfunc import checkpoint, func
from rlfunc.algos import registry as algorithms
from rlfunc.algos.bc import BCConfig, make_bc
from rlfunc.algos.diffusion_actor import (
    POINT_REACH_INFO, ActorSpec, DiffusionActor, EnvInfo, check_env, env_info, evaluate_episodes, make_env, schedule_for,
)
from rlfunc.algos.dppo import DPPOConfig, make_dppo, make_optimizer
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig, make_td3_diffusion
from rlfunc.amp import precision
from rlfunc.device import resolve_device
from rlfunc.diffusion.schedule import check_schedule
from rlfunc.envs import registry
from rlfunc.errors import CheckpointError, ConfigError
from rlfunc.log import plot_learning_curve
from rlfunc.optim import load_optimizer_state, optimizer_state
from rlfunc.resume import (NO_SNAPSHOT, ResumePoint, begin_run, buffer_snapshot, env_rng_snapshot, open_run, restore_buffer,
                           restore_env_rng, run_iterations, set_generator_state, truncate_metrics)

EVAL_SEED_OFFSET = 1_000_003


class DiffusionResult(NamedTuple):
    state: TensorDict
    run_dir: Path
    evaluation: dict | None  # None when a signal stopped the run
    interrupted: str | None = None  # the signal's name ("SIGINT", "SIGTERM") when one stopped the run


def _setup(config) -> torch.device:
    """The run's device, once ``config.env`` is known to be one the actor runs on (EnvError if not)."""
    check_env(config.env)
    device = resolve_device(config.device)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    return device


def _save(run_dir: Path, algo: str, config, spec: ActorSpec, info: EnvInfo, state: TensorDict, optimizers, step: int,
          *, extra: dict | None = None, extra_meta: dict | None = None) -> Path:
    """Snapshot {"learner": state, "optim_<name>": each optimizer's state, **extra} with the run's
    meta (and ``extra_meta``) as checkpoints/step_<step>."""
    snapshot = TensorDict({"learner": state}, batch_size=[])
    for name, opt in optimizers.items():
        snapshot[f"optim_{name}"] = optimizer_state(opt)
    for key, value in (extra or {}).items():
        snapshot[key] = value
    meta = {
        "algo": algo,
        "config": dataclasses.asdict(config),
        "actor_spec": dataclasses.asdict(spec),
        "obs_dim": info.obs_dim,
        "act_dim": info.act_dim,
        "env_info": info.to_meta(),
        "iteration": int(state["iteration"]),
        "step": int(step),
        **(extra_meta or {}),
    }
    return checkpoint.save_run_snapshot(run_dir, snapshot, meta, step=step, keep_last=3)


def actor_spec_from_meta(meta: dict, path) -> ActorSpec:
    """The ActorSpec saved in a diffusion snapshot's meta; CheckpointError if missing or invalid."""
    try:
        raw = dict(meta["actor_spec"])
        for key in ("hidden", "down_dims"):
            raw[key] = tuple(raw[key])
        return ActorSpec(**raw)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: no valid actor_spec in meta.json ({e})") from None


def env_info_from_meta(meta: dict, path) -> EnvInfo:
    """The env's :class:`EnvInfo` saved in a diffusion snapshot (PointReach-v0's for older snapshots)."""
    if "env_info" not in meta:
        return POINT_REACH_INFO
    try:
        return EnvInfo.from_meta(dict(meta["env_info"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: no valid env_info in meta.json ({e})") from None


class LoadedActor(NamedTuple):
    spec: ActorSpec
    params: TensorDict  # the denoiser's (EMA for bc)
    obs_stats: TensorDict
    meta: dict
    info: EnvInfo
    encoder: TensorDict | None  # the multimodal encoder's (EMA for bc), None for a Box observation


def load_actor(path: str | Path, device: torch.device) -> LoadedActor:
    """Load a diffusion actor from a run dir (latest snapshot) or a snapshot dir.

    Returns (spec, actor params, obs_stats, meta, env info, encoder params): the EMA weights for a bc
    snapshot, the trained actor for dppo / td3-diffusion. The stored schedule must equal the one the
    spec defines, and the weights' shapes the ones the spec and env info define.

    Raises:
        CheckpointError: no snapshot, not a diffusion snapshot, or a schedule that does not match.
    """
    path = Path(path)
    snap = checkpoint.latest_snapshot(path) if (path / checkpoint.CHECKPOINTS_DIR).is_dir() else path
    if snap is None:
        raise CheckpointError(f"{path}: holds no complete snapshot")
    meta = checkpoint.load_meta(snap)
    if meta.get("algo") not in _algos():
        raise CheckpointError(f"{snap}: algo={meta.get('algo')!r}: expected a {_algos_phrase()} snapshot")
    spec = actor_spec_from_meta(meta, snap)
    info = env_info_from_meta(meta, snap)
    loaded, _ = checkpoint.load_snapshot(snap, device=device)
    key, enc_key = (("learner", *k) for k in algorithms.lookup(meta["algo"]).deploy)  # the actor's, the encoder's
    needed = (key, ("learner", "schedule"), ("learner", "obs_stats")) + ((enc_key,) if info.is_dict else ())
    for k in needed:
        if k not in loaded.keys(include_nested=True):
            raise CheckpointError(f"{snap}: a {meta['algo']} snapshot must hold {'/'.join(k)}; this one does not")
    try:
        check_schedule(loaded["learner", "schedule"], schedule_for(spec, device))
    except CheckpointError as e:
        raise CheckpointError(f"{snap}: {e}") from None
    actor = DiffusionActor(spec, info, info.act_dim, torch.device("cpu"))
    _check_shapes(loaded[key], func.params_from_module(actor.net), snap, "actor")
    encoder = None
    if info.is_dict:
        _check_shapes(loaded[enc_key], func.params_from_module(actor.encoder), snap, "encoder")
        encoder = func.as_leaves(loaded[enc_key].clone())
    return LoadedActor(spec, func.as_leaves(loaded[key].clone()), loaded["learner", "obs_stats"], meta, info, encoder)


def _check_shapes(params: TensorDict, want: TensorDict, snap, what: str) -> None:
    got_shapes = {k: tuple(v.shape) for k, v in params.flatten_keys(".").items()}
    want_shapes = {k: tuple(v.shape) for k, v in want.flatten_keys(".").items()}
    if got_shapes != want_shapes:
        diff = sorted(set(got_shapes.items()) ^ set(want_shapes.items()))[:3]
        raise CheckpointError(f"{snap}: the {what} weights do not match its actor_spec (first differences: {diff})")


def _evaluate(actor: DiffusionActor, params, state, config, device, run_dir: Path, eta: float = 0.0, encoder=None) -> dict:
    summary = evaluate_episodes(actor, params, state["obs_stats"], state["schedule"], config.env, config.eval_episodes,
                                seed=config.seed + EVAL_SEED_OFFSET, eta=eta, encoder_params=encoder)
    (run_dir / "eval.json").write_text(json.dumps(summary) + "\n")
    return summary


def evaluate_run(
    run_dir: str | Path, episodes: int | None = None, *, seed: int | None = None, device: str = "auto", eta: float | None = None
) -> dict:
    """Evaluate the latest diffusion actor of ``run_dir`` (or a snapshot dir; EMA weights for bc):
    ``episodes`` envs, one episode each, DDIM with ``eta`` (0: deterministic given the initial noise).
    ``episodes``, ``seed`` and ``eta`` default to the run's (``eval_episodes``, ``seed``, ``eval_eta``),
    so the default call repeats the run's eval.json.

    Returns:
        {"algo", "episodes", "episode_return", "success_rate", "share_goal_a", "share_goal_b",
        "share_neither", "num_episodes", "episode_return_std", "episode_return_ci95_low" / "_high",
        "success_ci95_low" / "_high"}
        (:func:`rlfunc.algos.diffusion_actor.evaluate_episodes`).

    Raises:
        CheckpointError: no diffusion snapshot, or its schedule does not match its actor spec.
        ConfigError: ``episodes < 1``.
    """
    dev = resolve_device(device)
    spec, params, obs_stats, meta, info, encoder = load_actor(run_dir, dev)
    config = meta.get("config")
    try:
        episodes = int(config.get("eval_episodes", 500)) if episodes is None else episodes
        seed = int(config.get("seed", 0)) if seed is None else seed
        eta = float(config.get("eval_eta", 0.0)) if eta is None else eta
    except (AttributeError, TypeError, ValueError):
        raise CheckpointError(f"{run_dir}: meta.json holds no valid config (eval_episodes, seed, eval_eta)") from None
    if episodes < 1:
        raise ConfigError(f"episodes={episodes}: expected >= 1")
    if not 0 <= seed < 2**31:
        raise ConfigError(f"seed={seed}: expected an integer in [0, 2**31)")
    actor = DiffusionActor(spec, info, info.act_dim, dev)
    env_id = config.get("env", "PointReach-v0")
    summary = evaluate_episodes(actor, params, obs_stats, schedule_for(spec, dev), env_id, episodes,
                                seed=seed + EVAL_SEED_OFFSET, eta=eta, encoder_params=encoder)
    return {"algo": meta["algo"], "episodes": episodes, **{k: float(v) for k, v in summary.items()}}


# ------------------------------------------------------------------------------------------ resume

def _algos() -> tuple[str, ...]:
    """The algorithms of this module's snapshots: the registry's "diffusion" family (bc, dppo, td3-diffusion)."""
    return algorithms.names(family="diffusion", commands=False)


def _algos_phrase() -> str:
    """"bc, dppo or td3-diffusion", from :func:`_algos`."""
    *first, last = _algos()
    return f"{', '.join(first)} or {last}" if first else last


def config_from_meta(meta: dict, path, algo: str | None = None) -> BCConfig | DPPOConfig | TD3DiffusionConfig:
    """The config saved in a bc / dppo / td3-diffusion snapshot's meta (the actor spec actually used).

    Raises:
        CheckpointError: not a diffusion snapshot (or, given ``algo``, not one of ``algo``), or no
            valid config in its meta (the message names ``path``).
    """
    got = meta.get("algo")
    if got not in _algos() or (algo is not None and got != algo):
        expected = f"a {_algos_phrase()}" if algo is None else f"a {algo}"
        raise CheckpointError(f"{path}: algo={got!r}: expected {expected} snapshot")
    try:
        raw = dict(meta["config"])
        raw["actor"] = ActorSpec(**dict(raw["actor"]))
        if "critic_hidden" in raw:
            raw["critic_hidden"] = tuple(raw["critic_hidden"])
        return algorithms.resolve(algorithms.lookup(got).config)(**raw)
    except (KeyError, TypeError, ValueError) as e:  # ConfigError is a ValueError
        raise CheckpointError(f"{path}: meta.json holds no valid {got} config ({e})") from None


def _num_iterations(config) -> int:
    if isinstance(config, BCConfig):
        return config.num_updates
    if isinstance(config, DPPOConfig):
        return config.num_iterations(config.actor.act_steps)
    return config.num_iterations()


def _source(run_dir, algo: str, config, resume: bool, total_steps: int | None,
            device: str | None = None) -> tuple[Path, ResumePoint | None, object]:
    """(run_dir, what a resumed run continues from or None, the config to run): on resume the latest
    snapshot of ``run_dir`` (one of ``algo``) and its config with ``total_steps`` (the new budget) in
    the field ``budget`` of ``algo``'s registry entry and ``device`` (when given) as its device
    (:func:`rlfunc.resume.begin_run`)."""
    entry = algorithms.lookup(algo)
    return begin_run(run_dir, config, algorithms.resolve(entry.config), resume=resume, total_steps=total_steps, device=device,
                     from_meta=lambda meta, snap: config_from_meta(meta, snap, algo), budget_field=entry.budget,
                     num_iterations=_num_iterations, unit=entry.unit, require_format=False)


def _restore(source: ResumePoint | None, run_dir: Path, device: torch.device, state: TensorDict, info: EnvInfo,
             optimizers: dict, prec, generator: torch.Generator, env=None) -> tuple[TensorDict | None, float]:
    """Load ``source`` into a freshly built run, in place: the learner ``state`` (its leaves stay the
    optimizers'), the optimizers, the grad scaler, ``generator`` and ``env``'s RNG; drop the metrics
    lines past the snapshot. Returns (the snapshot's tensors, the clock (s) to continue from), or
    (None, 0.0) for a new run (``source`` None).

    Raises:
        CheckpointError: the snapshot does not fit the run its config builds (env observation layout,
            learner keys, shapes or dtypes, schedule, env RNG) or fails its integrity checks."""
    if source is None:
        return None, 0.0
    snap = source.snapshot
    saved_info = env_info_from_meta(source.meta, snap)
    if saved_info != info:
        raise CheckpointError(f"{snap}: saved for observations {saved_info}, but env={source.config.env!r} now gives {info}")
    loaded, _ = checkpoint.load_snapshot(snap, device=device)
    if "learner" not in loaded.keys():
        raise CheckpointError(f"{snap}: holds no learner state")
    checkpoint.check_learner(str(snap), loaded["learner"], state)
    try:
        check_schedule(loaded["learner", "schedule"], state["schedule"])
    except CheckpointError as e:
        raise CheckpointError(f"{snap}: {e}") from None
    with torch.no_grad():  # in place: the optimizers keep stepping the same leaves
        state.update_(loaded["learner"])
    for name, opt in optimizers.items():  # an optimizer that never stepped has no saved state
        saved = loaded.get(f"optim_{name}", None)
        load_optimizer_state(opt, saved.to("cpu") if saved is not None else TensorDict({}, batch_size=[]))
    if prec.scaler is not None and source.meta.get("grad_scaler"):
        prec.scaler.load_state_dict(source.meta["grad_scaler"])
    set_generator_state(generator, state["rng"])
    if env is not None:
        restore_env_rng(env, loaded, source)
    return loaded, truncate_metrics(run_dir, int(state["iteration"]))


def _scaler_meta(prec) -> dict:
    return {"grad_scaler": prec.scaler.state_dict() if prec.scaler is not None else None}


def train_bc(config: BCConfig | None, run_dir: str | Path, *, resume: bool = False, total_steps: int | None = None,
             progress: bool = True, tensorboard: bool = True, device: str | None = None) -> DiffusionResult:
    """Diffusion BC on the env's scripted-expert demonstrations (see :mod:`rlfunc.algos.bc` and
    :func:`rlfunc.demos.expert_demonstrations`); the expert's success rate goes into demos.json.

    Args:
        config: every hyperparameter; ignored on resume (the snapshot's config is used; may be None).
        run_dir: output directory; must not already hold a run unless ``resume``.
        resume: continue from the latest snapshot in ``run_dir`` (the demonstrations are collected
            again from the config's seed).
        total_steps: on resume, a new budget in updates (``num_updates``), at least those done.
        device: on resume, run on this device instead of the snapshot config's (None: the config's);
            a run continues exactly only on the device type it ran on.

    SIGINT/SIGTERM stop the run after the current update with a snapshot (no final evaluation).

    Raises:
        ConfigError: a bad run dir or budget. EnvError: an env without a scripted expert.
        CheckpointError: on resume, no snapshot in ``run_dir``, or one that is corrupt or does not fit its config.
    """
    from rlfunc.demos import check_expert, expert_demonstrations

    run_dir, source, config = _source(run_dir, "bc", config, resume, total_steps, device)
    device = _setup(config)
    check_expert(config.env)
    info = env_info(config.env)
    algo = make_bc(config, info, info.act_dim, device)  # checks the encoder settings before the demos are collected
    dataset, demos = expert_demonstrations(
        config.env, config.num_demos, config.actor.horizon, seed=config.seed, noise_std=config.demo_noise_std, device=device
    )
    dataset = dataset.select(*info.obs_keys, "action")
    gen = torch.Generator(device=device).manual_seed(config.seed)
    state = algo.init(dataset)
    optimizer = torch.optim.AdamW(algo.trainable(state), lr=config.lr, weight_decay=config.weight_decay, foreach=True)
    prec = precision(device, config.precision)
    pending = {"sum": None, "count": 0}  # metrics summed since the last metrics line
    loaded, clock = _restore(source, run_dir, device, state, info, {"actor": optimizer}, prec, gen)
    if loaded is not None and "pending_metrics" in loaded.keys():
        pending = {"sum": loaded["pending_metrics"], "count": int(source.meta.get("pending_metrics", 0))}
    logger = open_run(config, run_dir, tensorboard)
    (run_dir / "demos.json").write_text(json.dumps(demos) + "\n")

    def save() -> Path:
        extra = {} if pending["sum"] is None else {"pending_metrics": pending["sum"]}
        return _save(run_dir, "bc", config, config.actor, info, state, {"actor": optimizer}, int(state["iteration"]),
                     extra=extra, extra_meta={"pending_metrics": pending["count"], **_scaler_meta(prec)})

    start = time.perf_counter() - clock

    def step(i: int, stopping: bool) -> dict | None:
        nonlocal state
        state, metrics = algo.iteration(state, dataset, gen, optimizer, prec)
        pending["sum"] = metrics if pending["sum"] is None else pending["sum"] + metrics
        pending["count"] += 1
        if not (i % config.log_every == 0 or i == config.num_updates or stopping):
            return None
        record = {"iteration": i, "step": i, "time": time.perf_counter() - start, **(pending["sum"] / pending["count"]).to_dict()}
        pending.update(sum=None, count=0)
        return record

    stopped = run_iterations(int(state["iteration"]), config.num_updates, "bc", step, logger=logger, save=save,
                             checkpoint_every=config.checkpoint_every, progress=progress)
    if stopped:
        return DiffusionResult(state, run_dir, None, stopped)
    summary = _evaluate(algo.actor, state["ema"], state, config, device, run_dir, encoder=state.get("encoder_ema", None))
    return DiffusionResult(state, run_dir, summary)


def _init_actor(config, device, resumed: bool = False):
    """(config with the actor spec actually used, env info, params, obs_stats, encoder params): the
    spec, EMA weights and statistics of ``config.init_from``, or (config, env info, None, None, None)
    without one or when ``resumed`` (the snapshot holds them; its config names the spec actually used).

    Raises:
        CheckpointError: the snapshot's env observation layout differs from ``config.env``'s."""
    info = env_info(config.env)
    if config.init_from is None or resumed:
        return config, info, None, None, None
    loaded = load_actor(config.init_from, device)
    if loaded.info != info:
        raise CheckpointError(
            f"init_from={config.init_from!r}: its actor reads {loaded.meta.get('config', {}).get('env', '?')!r} "
            f"observations (obs_dim {loaded.info.obs_dim}, act_dim {loaded.info.act_dim}, keys {list(loaded.info.obs_keys)}), "
            f"not those of env={config.env!r} (obs_dim {info.obs_dim}, act_dim {info.act_dim}, keys {list(info.obs_keys)})"
        )
    return dataclasses.replace(config, actor=loaded.spec), info, loaded.params, loaded.obs_stats, loaded.encoder


def _episode_metrics(batch: TensorDict, env_id: str) -> dict:
    """Episodes that ended in ``batch`` [N, T]: their count and the env's own statistics of them
    (its registry entry's ``episode_metrics``), else their success rate and mean return."""
    done = batch["next", "done"]
    ended = int(done.sum())
    if not ended:
        return {"episodes": 0}
    entry = registry.find(env_id)
    if entry is not None and entry.episode_metrics is not None:
        return {"episodes": ended, **entry.episode_metrics(batch)}
    return {
        "episodes": ended,
        "success_rate": float(batch["next", "success"][done].float().mean()),
        "episode_return": float(batch["next", "episode_return"][done].mean()),
    }


def train_dppo(config: DPPOConfig | None, run_dir: str | Path, *, resume: bool = False, total_steps: int | None = None,
               progress: bool = True, tensorboard: bool = True, device: str | None = None) -> DiffusionResult:
    """DPPO fine-tuning (see :mod:`rlfunc.algos.dppo`), usually from a bc run (``init_from``).

    Args:
        config: every hyperparameter; ignored on resume (the snapshot's config is used; may be None).
        run_dir: output directory; must not already hold a run unless ``resume``.
        resume: continue from the latest snapshot in ``run_dir`` (``init_from`` is not read again:
            the snapshot holds the actor, its frozen base and the observation statistics).
        total_steps: on resume, a new budget in env steps, at least those done.
        device: on resume, run on this device instead of the snapshot config's (None: the config's);
            a run continues exactly only on the device type it ran on.

    config.json records the actor spec actually used (that of ``init_from`` when given).
    SIGINT/SIGTERM stop the run after the current iteration with a snapshot (no final evaluation).

    Raises:
        ConfigError: a bad run dir or budget. EnvError: an env the actor cannot run on.
        CheckpointError: ``init_from`` or, on resume, ``run_dir``'s snapshot is missing, corrupt or does not fit.
    """
    run_dir, source, config = _source(run_dir, "dppo", config, resume, total_steps, device)
    device = _setup(config)
    config, info, actor_params, obs_stats, encoder = _init_actor(config, device, resumed=source is not None)
    spec = config.actor
    algo = make_dppo(config, spec, info, info.act_dim, device)
    state = algo.init(actor_params, obs_stats, encoder)
    optimizer = make_optimizer(state, config)
    prec = precision(device, config.precision)
    env = make_env(config.env, config.num_envs, spec.act_steps, device, config.seed)
    gen = torch.Generator(device=device).manual_seed(config.seed)
    _, clock = _restore(source, run_dir, device, state, info, {"all": optimizer}, prec, gen, env)
    logger = open_run(config, run_dir, tensorboard)

    def save() -> Path:
        tensors, meta = env_rng_snapshot(env)
        return _save(run_dir, "dppo", config, spec, info, state, {"all": optimizer}, int(state["env_steps"]),
                     extra=tensors, extra_meta={**meta, **_scaler_meta(prec)})

    start = time.perf_counter() - clock

    def step(i: int, stopping: bool) -> dict:
        nonlocal state
        batch = algo.rollout(state, env, gen)
        state, metrics = algo.iteration(state, batch, gen, optimizer, prec)
        return {
            "iteration": i, "step": int(state["env_steps"]), "time": time.perf_counter() - start,
            **_episode_metrics(batch, config.env), **metrics.to_dict(),
        }

    stopped = run_iterations(int(state["iteration"]), config.num_iterations(spec.act_steps), "dppo", step, logger=logger,
                             save=save, checkpoint_every=config.checkpoint_every, progress=progress)
    _plot(run_dir)
    if stopped:
        return DiffusionResult(state, run_dir, None, stopped)
    env.close()
    summary = _evaluate(algo.actor, state["params", "actor"], state, config, device, run_dir, eta=config.eval_eta,
                        encoder=state.get("encoder", None))
    return DiffusionResult(state, run_dir, summary)


def train_td3_diffusion(config: TD3DiffusionConfig | None, run_dir: str | Path, *, resume: bool = False,
                        total_steps: int | None = None, progress: bool = True, tensorboard: bool = True,
                        device: str | None = None) -> DiffusionResult:
    """TD3 with a diffusion actor (see :mod:`rlfunc.algos.td3_diffusion`); a device-resident
    TorchRL replay buffer holds the transitions. config.json records the actor spec actually used.

    Args:
        config: every hyperparameter; ignored on resume (the snapshot's config is used; may be None).
        run_dir: output directory; must not already hold a run unless ``resume``.
        resume: continue from the latest snapshot in ``run_dir``, replay buffer included when the
            run saved it (``checkpoint_buffer``; else a warning, and the buffer starts empty).
        total_steps: on resume, a new budget in env steps, at least those done.
        device: on resume, run on this device instead of the snapshot config's (None: the config's);
            a run continues exactly only on the device type it ran on.

    SIGINT/SIGTERM stop the run after the current iteration with a snapshot (no final evaluation).

    Raises:
        ConfigError: a bad run dir or budget. EnvError: an env the actor cannot run on.
        CheckpointError: ``init_from`` or, on resume, ``run_dir``'s snapshot is missing, corrupt or does not fit.
    """
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    run_dir, source, config = _source(run_dir, "td3-diffusion", config, resume, total_steps, device)
    device = _setup(config)
    # a new run's config is re-validated with init_from's spec: horizon == act_steps
    config, info, actor_params, obs_stats, encoder = _init_actor(config, device, resumed=source is not None)
    spec = config.actor
    algo = make_td3_diffusion(config, spec, info, info.act_dim, device)
    state = algo.init(actor_params, obs_stats, encoder)
    critic_opt = torch.optim.Adam(func.leaves(state["params", "critic"]), lr=config.critic_lr, foreach=True)
    actor_opt = torch.optim.Adam(func.leaves(state["params", "actor"]), lr=config.actor_lr, foreach=True)
    optimizers = {"critic": critic_opt, "actor": actor_opt}
    prec = precision(device, config.precision)
    env = make_env(config.env, config.num_envs, spec.act_steps, device, config.seed)
    gen = torch.Generator(device=device).manual_seed(config.seed)
    buffer = ReplayBuffer(storage=LazyTensorStorage(config.buffer_size, device=device), batch_size=config.batch_size)
    loaded, clock = _restore(source, run_dir, device, state, info, optimizers, prec, gen, env)
    if loaded is not None:
        restore_buffer(buffer, loaded, source)
    logger = open_run(config, run_dir, tensorboard)

    def save() -> Path:
        env_tensors, env_meta = env_rng_snapshot(env)
        rows, buffer_meta = buffer_snapshot(buffer, config.checkpoint_buffer)
        return _save(run_dir, "td3-diffusion", config, spec, info, state, optimizers, int(state["env_steps"]),
                     extra={**env_tensors, **rows}, extra_meta={**env_meta, **buffer_meta, **_scaler_meta(prec)})

    start = time.perf_counter() - clock

    def step(i: int, stopping: bool) -> dict:
        nonlocal state
        batch = algo.rollout(state, env, gen)
        buffer.extend(algo.transitions(state, batch))
        state["env_steps"] = state["env_steps"] + batch.numel() * spec.act_steps
        record = {"iteration": i, "step": int(state["env_steps"]), **_episode_metrics(batch, config.env)}
        if int(state["env_steps"]) >= config.warmup_steps:
            state, metrics = algo.iteration(state, buffer, gen, (critic_opt, actor_opt), prec)
            record.update(metrics.to_dict())
        else:
            state["iteration"] = state["iteration"] + 1
            state["rng"] = gen.get_state()  # the warm-up actions drew from it
        return {**record, "time": time.perf_counter() - start}

    stopped = run_iterations(int(state["iteration"]), config.num_iterations(), "td3-diffusion", step, logger=logger,
                             save=save, checkpoint_every=config.checkpoint_every, progress=progress)
    _plot(run_dir)
    if stopped:
        return DiffusionResult(state, run_dir, None, stopped)
    env.close()
    summary = _evaluate(algo.actor, state["params", "actor"], state, config, device, run_dir, encoder=state.get("encoder", None))
    return DiffusionResult(state, run_dir, summary)


def resume_diffusion(run_dir: str | Path, total_steps: int | None = None, *, progress: bool = True,
                     tensorboard: bool = True, device: str | None = None) -> DiffusionResult:
    """Continue the bc, dppo or td3-diffusion run in ``run_dir`` from its latest snapshot (the
    algorithm and config are the snapshot's); see the module docstring for what is restored.

    Args:
        run_dir: a run directory holding a diffusion snapshot.
        total_steps: a new budget: updates for bc (``num_updates``), env steps for dppo and
            td3-diffusion (``total_steps``); at least what the run has done. None keeps the run's.
        progress: show a tqdm bar. tensorboard: also log to TensorBoard when installed.
        device: run on this device instead of the snapshot config's (None: the config's); a run
            continues exactly only on the device type it ran on.

    Returns:
        :class:`DiffusionResult`, as training: the final evaluation (also in eval.json) once the
        budget is done (a run that had already done it runs no iteration and is evaluated again),
        or None with the signal's name when SIGINT/SIGTERM stopped it after a snapshot.

    Raises:
        CheckpointError: ``run_dir`` holds no snapshot (the message names it), or a corrupt one, or
            one of another algorithm, or one that does not fit the run its config builds (generator
            states saved on another device type: the message names the one to resume on).
        ConfigError: ``total_steps`` is not an int >= 1, or less than the run has done; ``run_dir``
            is not a directory; ``device`` is not a device this machine has.
        EnvError: the snapshot's env cannot be made here.
    """
    snap = checkpoint.latest_snapshot(run_dir)
    if snap is None:
        raise CheckpointError(f"{run_dir}: {NO_SNAPSHOT}")
    algo = checkpoint.load_meta(snap).get("algo")
    if algo not in _algos():
        raise CheckpointError(f"{snap}: algo={algo!r}: expected a {_algos_phrase()} snapshot")
    fn = algorithms.resolve(algorithms.lookup(algo).train)
    return fn(None, run_dir, resume=True, total_steps=total_steps, progress=progress, tensorboard=tensorboard, device=device)


def _plot(run_dir: Path) -> None:
    plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png", key="success_rate")

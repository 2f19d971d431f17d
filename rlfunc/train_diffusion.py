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
observation statistics and actor spec. These runs are not resumable yet (``rlfunc resume`` is
PPO's); a snapshot is written every ``checkpoint_every`` iterations and at the end.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch
from tensordict import TensorDict

from rlfunc import checkpoint, func
from rlfunc.algos.bc import BCConfig, make_bc
from rlfunc.algos.diffusion_actor import (
    POINT_REACH_INFO, ActorSpec, DiffusionActor, EnvInfo, check_env, env_info, evaluate_episodes, make_env, schedule_for,
)
from rlfunc.algos.dppo import DPPOConfig, make_dppo, make_optimizer
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig, make_td3_diffusion
from rlfunc.amp import precision
from rlfunc.device import resolve_device
from rlfunc.diffusion.schedule import check_schedule
from rlfunc.errors import CheckpointError, ConfigError, EnvError
from rlfunc.log import MetricsLogger, plot_learning_curve
from rlfunc.optim import optimizer_state
from rlfunc.train import _check_run_dir

EVAL_SEED_OFFSET = 1_000_003


class DiffusionResult(NamedTuple):
    state: TensorDict
    run_dir: Path
    evaluation: dict | None  # None when a signal stopped the run
    interrupted: str | None = None  # the signal's name ("SIGINT", "SIGTERM") when one stopped the run


class _StopOnSignal:
    """Within the block, SIGINT/SIGTERM only set ``signal`` (the loop then stops and saves);
    handlers are installed only in the main thread and restored on exit."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, _frame) -> None:
        if self.signal is not None:  # a second signal: stop now, without the snapshot
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        print(f"rlfunc: {self.signal}: stopping after this iteration with a snapshot (again to quit at once)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _setup(config, run_dir) -> tuple[torch.device, Path]:
    check_env(config.env)
    device = resolve_device(config.device)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    run_dir = Path(run_dir)
    _check_run_dir(run_dir, resume=False)
    return device, run_dir


def _start(config, run_dir: Path, tensorboard: bool) -> MetricsLogger:
    """Create the run dir (once every input has been checked) with its config.json and logger."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    return MetricsLogger(run_dir, tensorboard=tensorboard)


def _save(run_dir: Path, algo: str, config, spec: ActorSpec, info: EnvInfo, state: TensorDict, optimizers, step: int) -> Path:
    snapshot = TensorDict({"learner": state}, batch_size=[])
    for name, opt in optimizers.items():
        snapshot[f"optim_{name}"] = optimizer_state(opt)
    meta = {
        "algo": algo,
        "config": dataclasses.asdict(config),
        "actor_spec": dataclasses.asdict(spec),
        "obs_dim": info.obs_dim,
        "act_dim": info.act_dim,
        "env_info": info.to_meta(),
        "iteration": int(state["iteration"]),
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
    if meta.get("algo") not in ("bc", "dppo", "td3-diffusion"):
        raise CheckpointError(f"{snap}: algo={meta.get('algo')!r}: expected a bc, dppo or td3-diffusion snapshot")
    spec = actor_spec_from_meta(meta, snap)
    info = env_info_from_meta(meta, snap)
    loaded, _ = checkpoint.load_snapshot(snap, device=device)
    key = ("learner", "ema") if meta["algo"] == "bc" else ("learner", "params", "actor")
    enc_key = ("learner", "encoder_ema") if meta["algo"] == "bc" else ("learner", "encoder")
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
        "share_neither", "num_episodes"}.

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


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)


def _loop(num_iterations: int, desc: str, step, *, logger: MetricsLogger, save, checkpoint_every: int, progress: bool) -> str | None:
    """Run ``step(i, stopping)`` for i = 1..num_iterations: log the record it returns (None: nothing
    to log), save every ``checkpoint_every`` iterations and at the end, stop early on SIGINT/SIGTERM.

    Returns:
        the name of the signal that stopped the loop, or None.
    """
    with _StopOnSignal() as stop:
        try:
            with _progress(num_iterations, desc, progress) as bar:
                for i in range(1, num_iterations + 1):
                    record = step(i, stop.signal is not None)
                    if record is not None:
                        logger.log(record)
                        shown = {k: record[k] for k in ("success_rate", "loss_denoise") if k in record}
                        bar.set_postfix({k: f"{float(v):.3f}" for k, v in shown.items()})
                    if checkpoint_every and i % checkpoint_every == 0:
                        save()
                    bar.update(1)
                    if stop.signal:
                        break
        finally:
            logger.close()
        save()
    return stop.signal


def train_bc(config: BCConfig, run_dir: str | Path, *, progress: bool = True, tensorboard: bool = True) -> DiffusionResult:
    """Diffusion BC on the env's scripted-expert demonstrations (see :mod:`rlfunc.algos.bc` and
    :func:`rlfunc.demos.expert_demonstrations`); the expert's success rate goes into demos.json.

    SIGINT/SIGTERM stop the run after the current update with a snapshot (no final evaluation)."""
    from rlfunc.demos import EXPERT_ENVS, expert_demonstrations

    device, run_dir = _setup(config, run_dir)
    if config.env not in EXPERT_ENVS:
        raise EnvError(f"env={config.env!r}: no scripted expert to learn from; bc runs on {', '.join(EXPERT_ENVS)}")
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
    logger = _start(config, run_dir, tensorboard)
    (run_dir / "demos.json").write_text(json.dumps(demos) + "\n")
    save = lambda: _save(run_dir, "bc", config, config.actor, info, state, {"actor": optimizer}, int(state["iteration"]))  # noqa: E731
    start, acc = time.perf_counter(), None

    def step(i: int, stopping: bool) -> dict | None:
        nonlocal state, acc
        state, metrics = algo.iteration(state, dataset, gen, optimizer, prec)
        acc = metrics if acc is None else acc + metrics
        if not (i % config.log_every == 0 or i == config.num_updates or stopping):
            return None
        n = i % config.log_every or config.log_every
        record = {"iteration": i, "step": i, "time": time.perf_counter() - start, **(acc / n).to_dict()}
        acc = None
        return record

    stopped = _loop(config.num_updates, "bc", step, logger=logger, save=save,
                    checkpoint_every=config.checkpoint_every, progress=progress)
    if stopped:
        return DiffusionResult(state, run_dir, None, stopped)
    summary = _evaluate(algo.actor, state["ema"], state, config, device, run_dir, encoder=state.get("encoder_ema", None))
    return DiffusionResult(state, run_dir, summary)


def _init_actor(config, device):
    """(config with the actor spec actually used, env info, params, obs_stats, encoder params): the
    spec, EMA weights and statistics of ``config.init_from``, or (config, env info, None, None, None).

    Raises:
        CheckpointError: the snapshot's env observation layout differs from ``config.env``'s."""
    info = env_info(config.env)
    if config.init_from is None:
        return config, info, None, None, None
    loaded = load_actor(config.init_from, device)
    if loaded.info != info:
        raise CheckpointError(
            f"init_from={config.init_from!r}: its actor reads {loaded.meta.get('config', {}).get('env', '?')!r} "
            f"observations (obs_dim {loaded.info.obs_dim}, act_dim {loaded.info.act_dim}, keys {list(loaded.info.obs_keys)}), "
            f"not those of env={config.env!r} (obs_dim {info.obs_dim}, act_dim {info.act_dim}, keys {list(info.obs_keys)})"
        )
    return dataclasses.replace(config, actor=loaded.spec), info, loaded.params, loaded.obs_stats, loaded.encoder


def _episode_metrics(batch: TensorDict) -> dict:
    """Episodes that ended in ``batch`` [N, T]: their count, success rate and mean return (and
    PointReach's mode statistics)."""
    from envs.point_reach import rollout_mode_statistics

    done = batch["next", "done"]
    ended = int(done.sum())
    if not ended:
        return {"episodes": 0}
    if "goal_index" in batch["next"].keys():
        return {"episodes": ended, **rollout_mode_statistics(batch)}
    return {
        "episodes": ended,
        "success_rate": float(batch["next", "success"][done].float().mean()),
        "episode_return": float(batch["next", "episode_return"][done].mean()),
    }


def train_dppo(config: DPPOConfig, run_dir: str | Path, *, progress: bool = True, tensorboard: bool = True) -> DiffusionResult:
    """DPPO fine-tuning (see :mod:`rlfunc.algos.dppo`), usually from a bc run (``init_from``).

    config.json records the actor spec actually used (that of ``init_from`` when given).
    SIGINT/SIGTERM stop the run after the current iteration with a snapshot (no final evaluation)."""
    device, run_dir = _setup(config, run_dir)
    config, info, actor_params, obs_stats, encoder = _init_actor(config, device)
    spec = config.actor
    algo = make_dppo(config, spec, info, info.act_dim, device)
    state = algo.init(actor_params, obs_stats, encoder)
    optimizer = make_optimizer(state, config)
    prec = precision(device, config.precision)
    env = make_env(config.env, config.num_envs, spec.act_steps, device, config.seed)
    gen = torch.Generator(device=device).manual_seed(config.seed)
    logger = _start(config, run_dir, tensorboard)
    save = lambda: _save(run_dir, "dppo", config, spec, info, state, {"all": optimizer}, int(state["env_steps"]))  # noqa: E731
    start = time.perf_counter()

    def step(i: int, stopping: bool) -> dict:
        nonlocal state
        batch = algo.rollout(state, env, gen)
        state, metrics = algo.iteration(state, batch, gen, optimizer, prec)
        return {
            "iteration": i, "step": int(state["env_steps"]), "time": time.perf_counter() - start,
            **_episode_metrics(batch), **metrics.to_dict(),
        }

    stopped = _loop(config.num_iterations(spec.act_steps), "dppo", step, logger=logger, save=save,
                    checkpoint_every=config.checkpoint_every, progress=progress)
    _plot(run_dir)
    if stopped:
        return DiffusionResult(state, run_dir, None, stopped)
    env.close()
    summary = _evaluate(algo.actor, state["params", "actor"], state, config, device, run_dir, eta=config.eval_eta,
                        encoder=state.get("encoder", None))
    return DiffusionResult(state, run_dir, summary)


def train_td3_diffusion(config: TD3DiffusionConfig, run_dir: str | Path, *, progress: bool = True, tensorboard: bool = True) -> DiffusionResult:
    """TD3 with a diffusion actor (see :mod:`rlfunc.algos.td3_diffusion`); a device-resident
    TorchRL replay buffer holds the transitions. config.json records the actor spec actually used.
    SIGINT/SIGTERM stop the run after the current iteration with a snapshot (no final evaluation)."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    device, run_dir = _setup(config, run_dir)
    config, info, actor_params, obs_stats, encoder = _init_actor(config, device)  # re-validated: horizon == act_steps
    spec = config.actor
    algo = make_td3_diffusion(config, spec, info, info.act_dim, device)
    state = algo.init(actor_params, obs_stats, encoder)
    critic_opt = torch.optim.Adam(func.leaves(state["params", "critic"]), lr=config.critic_lr, foreach=True)
    actor_opt = torch.optim.Adam(func.leaves(state["params", "actor"]), lr=config.actor_lr, foreach=True)
    prec = precision(device, config.precision)
    env = make_env(config.env, config.num_envs, spec.act_steps, device, config.seed)
    gen = torch.Generator(device=device).manual_seed(config.seed)
    buffer = ReplayBuffer(storage=LazyTensorStorage(config.buffer_size, device=device), batch_size=config.batch_size)
    logger = _start(config, run_dir, tensorboard)
    optimizers = {"critic": critic_opt, "actor": actor_opt}
    save = lambda: _save(run_dir, "td3-diffusion", config, spec, info, state, optimizers, int(state["env_steps"]))  # noqa: E731
    start = time.perf_counter()

    def step(i: int, stopping: bool) -> dict:
        nonlocal state
        batch = algo.rollout(state, env, gen)
        buffer.extend(algo.transitions(state, batch))
        state["env_steps"] = state["env_steps"] + batch.numel() * spec.act_steps
        record = {"iteration": i, "step": int(state["env_steps"]), **_episode_metrics(batch)}
        if int(state["env_steps"]) >= config.warmup_steps:
            state, metrics = algo.iteration(state, buffer, gen, (critic_opt, actor_opt), prec)
            record.update(metrics.to_dict())
        else:
            state["iteration"] = state["iteration"] + 1
        return {**record, "time": time.perf_counter() - start}

    stopped = _loop(config.num_iterations(), "td3-diffusion", step, logger=logger, save=save,
                    checkpoint_every=config.checkpoint_every, progress=progress)
    _plot(run_dir)
    if stopped:
        return DiffusionResult(state, run_dir, None, stopped)
    env.close()
    summary = _evaluate(algo.actor, state["params", "actor"], state, config, device, run_dir, encoder=state.get("encoder", None))
    return DiffusionResult(state, run_dir, summary)


def _plot(run_dir: Path) -> None:
    plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png", key="success_rate")

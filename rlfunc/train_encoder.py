"""A whole encoder-PPO run (:mod:`rlfunc.algos.ppo_encoder`): collect -> update -> log -> snapshot -> evaluate.

``train_ppo_encoder(config, run_dir)`` writes RUN_DIR/config.json, metrics.jsonl (one line per
iteration: losses, episode_return (and success_rate, for envs that report ``is_success``) of the
episodes that ended, steps/s, collect and update seconds), checkpoints/ (safetensors snapshots, ``algo="ppo-encoder"``), learning_curve.png and
eval.json. The envs are one :class:`rlfunc.chunk_env.GymChunkEnv` (``act_steps=1``) kept running
across iterations. Runs are not resumable yet (``rlfunc resume`` is for flat-observation PPO).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from rlfunc import checkpoint
from rlfunc.algos.diffusion_actor import EnvInfo, env_info
from rlfunc.algos.ppo_encoder import ALGO, PPOEncoderConfig, check_dict_info, evaluate, make_ppo_encoder
from rlfunc.amp import precision
from rlfunc.chunk_env import GymChunkEnv
from rlfunc.device import resolve_device
from rlfunc.errors import CheckpointError, ConfigError
from rlfunc.log import plot_learning_curve
from rlfunc.optim import linear_lr, make_adam, optimizer_state, set_lr
from rlfunc.resume import check_run_dir, open_run, run_iterations
from rlfunc.train import EVAL_SEED_OFFSET
from rlfunc.train_diffusion import DiffusionResult, _setup


def is_dict_env(env_id: str) -> bool:
    """Whether the registered gymnasium env ``env_id`` has a Dict observation (one env is made and closed)."""
    import gymnasium as gym

    from rlfunc.chunk_env import check_chunk_env_id

    check_chunk_env_id(env_id)
    env = gym.make(env_id)
    try:
        return isinstance(env.observation_space, gym.spaces.Dict)
    finally:
        env.close()


def reports_success(env_id: str) -> bool:
    """Whether ``env_id`` puts "is_success" in its step info (one env is made, reset and stepped once
    with the mid-range action, then closed); Pusher-v5, for one, does not."""
    import gymnasium as gym
    import numpy as np

    env = gym.make(env_id)
    try:
        env.reset(seed=0)
        space = env.action_space
        action = ((space.low + space.high) / 2).astype(space.dtype) if isinstance(space, gym.spaces.Box) else space.sample()
        info = env.step(np.asarray(action))[-1]
        return "is_success" in info
    finally:
        env.close()


def _meta(config: PPOEncoderConfig, info: EnvInfo, state: TensorDict) -> dict:
    return {
        "algo": ALGO,
        "config": dataclasses.asdict(config),
        "env_info": info.to_meta(),
        "iteration": int(state["iteration"]),
        "env_steps": int(state["env_steps"]),
    }


def train_ppo_encoder(
    config: PPOEncoderConfig, run_dir: str | Path, *, progress: bool = True, tensorboard: bool = True, evaluate_at_end: bool = True
) -> DiffusionResult:
    """Train encoder PPO per ``config`` into ``run_dir`` (which must not hold a run).

    Returns:
        (state, run_dir, evaluation, interrupted): ``evaluation`` is :func:`evaluate_run`'s dict on
        ``config.eval_episodes`` episodes (None when a signal stopped the run or ``evaluate_at_end``
        is False); ``interrupted`` names the signal (SIGINT/SIGTERM) that stopped it after a snapshot.

    Raises:
        ConfigError: a bad run_dir. EnvError: an unknown env, or one without a Dict observation.
    """
    run_dir = Path(run_dir)
    device = _setup(config)
    check_run_dir(run_dir, resume=False)
    info = env_info(config.env)
    check_dict_info(info, config.env)
    prec = precision(device, config.precision)
    algo = make_ppo_encoder(config, info, device, prec)
    state = algo.init()
    optimizer = make_adam(TensorDict({str(i): p for i, p in enumerate(algo.trainable(state["params"]))}), config.lr, eps=config.adam_eps)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    env = GymChunkEnv(config.env, config.num_envs, act_steps=1, device=device, seed=config.seed)
    carry = env.reset()
    logger = open_run(config, run_dir, tensorboard)
    live = {"state": state, "carry": carry}
    t_start = time.perf_counter()
    success = reports_success(config.env)

    def step(i: int, stopping: bool) -> dict:
        set_lr(optimizer, linear_lr(config.lr, i - 1, config.num_iterations, config.anneal_lr))
        t0 = time.perf_counter()
        batch, live["carry"] = algo.rollout(live["state"], env, live["carry"], generator)
        t1 = time.perf_counter()
        live["state"], metrics = algo.iteration(live["state"], batch, generator, optimizer)
        t2 = time.perf_counter()
        return {
            "iteration": i,
            "step": int(live["state"]["env_steps"]),
            "time": t2 - t_start,
            "steps_per_s": config.batch_size / (t2 - t0),
            "collect_s": t1 - t0,
            "update_s": t2 - t1,
            "lr": optimizer.param_groups[0]["lr"],
            **{k: float(v) for k, v in metrics.items() if success or k != "success_rate"},
        }

    def save() -> None:
        s = live["state"]
        snapshot = TensorDict({"learner": s, "optim": optimizer_state(optimizer)}, batch_size=[])
        checkpoint.save_run_snapshot(run_dir, snapshot, _meta(config, info, s), step=int(s["env_steps"]),
                                     keep_last=config.keep_checkpoints or None)

    try:
        interrupted = run_iterations(0, config.num_iterations, ALGO, step, logger=logger, save=save,
                                     checkpoint_every=config.checkpoint_every, progress=progress)
    finally:
        env.close()
    plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png")
    evaluation = None
    if interrupted is None and evaluate_at_end:
        evaluation = evaluate_run(run_dir, config.eval_episodes, device=str(device))
        (run_dir / "eval.json").write_text(json.dumps(evaluation) + "\n")
    return DiffusionResult(live["state"], run_dir, evaluation, interrupted)


def config_from_meta(meta: dict, path) -> PPOEncoderConfig:
    """The PPOEncoderConfig of a snapshot's meta; CheckpointError when it is not a valid encoder-PPO one."""
    if meta.get("algo") != ALGO:
        raise CheckpointError(f"{path}: snapshot algo={meta.get('algo')!r}: expected {ALGO!r}")
    try:
        return PPOEncoderConfig(**dict(meta["config"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: snapshot config is not a valid PPOEncoderConfig: {e}") from e


def evaluate_run(run_dir: str | Path, episodes: int | None = None, *, seed: int | None = None, device: str = "auto",
                 max_envs: int = 25) -> dict:
    """Deterministic-action episodes of the latest snapshot in ``run_dir`` (or of a snapshot directory).

    Args:
        episodes: how many (default: the run's ``eval_episodes``), run in rounds of at most ``max_envs``
            envs; round r's envs are seeded ``seed + r`` (default seed: the run's + 1_000_003).

    Returns:
        {"env", "episodes", "mean" (mean return of the episodes, env units), "env_steps"}, and
        "success_rate" when the env reports ``info["is_success"]`` (:func:`reports_success`).

    Raises:
        CheckpointError: no snapshot, not an encoder-PPO one, or weights that do not match its config.
        ConfigError: ``episodes < 1``.
    """
    path = Path(run_dir)
    snap = checkpoint.latest_snapshot(path) if (path / checkpoint.CHECKPOINTS_DIR).is_dir() else path
    if snap is None or not (Path(snap) / "meta.json").is_file():
        raise CheckpointError(f"{run_dir}: holds no complete snapshot (train first)")
    meta = checkpoint.load_meta(snap)
    config = config_from_meta(meta, snap)
    episodes = config.eval_episodes if episodes is None else episodes
    if episodes < 1:
        raise ConfigError(f"episodes={episodes}: expected >= 1")
    try:
        info = EnvInfo.from_meta(dict(meta["env_info"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{snap}: no valid env_info in meta.json ({e})") from None
    dev = resolve_device(device)
    algo = make_ppo_encoder(config, info, dev)
    state = algo.init()
    loaded, _ = checkpoint.load_snapshot(snap, device=dev)
    want = {k: (tuple(v.shape), v.dtype) for k, v in state.flatten_keys(".").items()}
    got = {k: (tuple(v.shape), v.dtype) for k, v in loaded["learner"].flatten_keys(".").items()} if "learner" in loaded.keys() else {}
    if got != want:
        diff = sorted(set(map(str, got.items())) ^ set(map(str, want.items())))[:3]
        raise CheckpointError(f"{snap}: the learner state does not match its config (first differences: {diff})")
    with torch.no_grad():
        state.update_(loaded["learner"])
    base = (config.seed + EVAL_SEED_OFFSET) if seed is None else seed
    returns, successes, done = [], [], 0
    limit = None
    for r in range(-(-episodes // max_envs)):
        n = min(max_envs, episodes - done)
        env = GymChunkEnv(config.env, n, act_steps=1, device=dev, seed=base + r)
        try:
            limit = env.max_episode_steps or 1000
            out = evaluate(algo, state, env, limit)
        finally:
            env.close()
        returns.append(out["episode_return"] * n)
        successes.append(out["success_rate"] * n)
        done += n
    out = {"env": config.env, "episodes": episodes, "mean": sum(returns) / episodes, "env_steps": int(meta.get("env_steps", 0))}
    if reports_success(config.env):
        out["success_rate"] = sum(successes) / episodes
    return out

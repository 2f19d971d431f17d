"""A whole GRPO or GSPO run as one function of its config: grouped rollouts -> update -> log -> snapshot.

``train_grpo(config, run_dir)`` writes RUN_DIR/config.json, metrics.jsonl (one line per iteration),
checkpoints/ (safetensors snapshots, see rlfunc.checkpoint), learning_curve.png and eval.json
(deterministic-action returns on the gymnasium env, as ``rlfunc eval`` gives for PPO runs).
Runs are not resumable yet (``rlfunc resume`` is PPO's).

Each iteration's start states come from reset seeds derived from (seed, iteration) (gymnasium
backend) or from the torch env's generator, seeded once with the run seed (torch backend).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tensordict import TensorDict

from rlfunc import checkpoint, collect
from rlfunc.algos.grpo import GRPOConfig, make_grpo
from rlfunc.algos.ppo import EnvSpec
from rlfunc.device import resolve_device
from rlfunc.errors import CheckpointError, ConfigError
from rlfunc.grouped import grouped_rollout_gym, grouped_rollout_torchrl
from rlfunc.log import plot_learning_curve
from rlfunc.optim import linear_lr, make_adam, optimizer_state, set_lr
from rlfunc.train import EVAL_SEED_OFFSET, _check_run_dir, _generators, env_spec
from rlfunc.train_diffusion import _loop, _start


class GRPOResult(NamedTuple):
    state: TensorDict
    run_dir: Path
    evaluation: dict | None  # None when a signal stopped the run
    interrupted: str | None = None  # the signal's name ("SIGINT", "SIGTERM") when one stopped the run


def group_seeds(seed: int, iteration: int, count: int) -> list[int]:
    """``count`` reset seeds for one iteration, distinct across iterations (numpy SeedSequence)."""
    return [int(s) for s in np.random.SeedSequence([seed, iteration]).generate_state(count)]


def _rollout_fn(config: GRPOConfig, device: torch.device):
    """(rollout(policy, iteration) -> batch [S, n, G, T], close())."""
    S, n, G, T = config.num_seeds, config.num_groups, config.group_size, config.max_episode_steps
    if config.use_torch_env:
        from envs.point_reach import PointReachEnv

        env = PointReachEnv(S * n * G, device=device, seed=config.seed)

        def rollout(policy, iteration: int) -> TensorDict:
            return grouped_rollout_torchrl(env, policy, G, T).reshape(S, n, G, -1)

        return rollout, lambda: None
    venv = collect.make_vec_env(config.env, S * n * G)

    def rollout(policy, iteration: int) -> TensorDict:
        seeds = group_seeds(config.seed, iteration, S * n)
        return grouped_rollout_gym(venv, policy, seeds, G, T, device=device).reshape(S, n, G, T)

    return rollout, venv.close


def _spec(env_id: str) -> EnvSpec:
    venv = collect.make_vec_env(env_id, 1)
    try:
        return env_spec(venv)
    finally:
        venv.close()


def _save(run_dir: Path, state: TensorDict, optimizer, config: GRPOConfig, spec: EnvSpec) -> Path:
    snapshot = TensorDict({"learner": state, "optim": optimizer_state(optimizer)}, batch_size=[])
    meta = {
        "algo": config.loss,
        "config": dataclasses.asdict(config),
        "env_spec": spec._asdict(),
        "iteration": int(state["iteration"]),
        "env_steps": int(state["env_steps"]),
    }
    return checkpoint.save_run_snapshot(run_dir, snapshot, meta, step=int(state["env_steps"]), keep_last=config.keep_checkpoints or None)


def evaluate_policy(config: GRPOConfig, state: TensorDict, spec: EnvSpec, device: torch.device, episodes: int, seed: int) -> dict:
    """Deterministic-action returns of ``state``'s actor on ``episodes`` gymnasium envs per seed.

    Returns:
        {"env", "episodes", "mean", "std", "per_seed_mean", "env_steps"} (env reward units).
    """
    algo = make_grpo(config, spec, device)
    venv = collect.make_vec_env(config.env, config.num_seeds * episodes)
    try:
        seeds = [s for i in range(config.num_seeds) for s in collect.env_seeds(seed + EVAL_SEED_OFFSET + i, episodes)]
        returns = collect.episode_returns(venv, algo.policy(state, [], deterministic=True), seeds, device=device)
    finally:
        venv.close()
    per_seed = returns.view(config.num_seeds, episodes)
    return {
        "env": config.env,
        "episodes": episodes,
        "mean": float(per_seed.mean()),
        "std": float(per_seed.std(correction=0)),
        "per_seed_mean": per_seed.mean(1).tolist(),
        "env_steps": int(state["env_steps"]),
    }


def config_from_meta(meta: dict, path: Path | str = "snapshot") -> GRPOConfig:
    """The GRPOConfig of a grpo/gspo snapshot's meta; CheckpointError naming ``path`` if invalid."""
    if meta.get("algo") not in ("grpo", "gspo"):
        raise CheckpointError(f"{path}: snapshot algo={meta.get('algo')!r}: expected 'grpo' or 'gspo'")
    try:
        cfg = dict(meta["config"])
        cfg["hidden"] = tuple(int(h) for h in cfg["hidden"])
        return GRPOConfig(**cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: snapshot config is not a valid GRPOConfig: {e}") from e


def evaluate_run(run_dir: str | Path, episodes: int | None = None, *, seed: int | None = None, device: str = "auto") -> dict:
    """:func:`evaluate_policy` of the latest snapshot of a grpo/gspo run (or of a snapshot dir).

    Raises:
        CheckpointError: no snapshot, or not a grpo/gspo one. ConfigError: ``episodes < 1``.
    """
    path = Path(run_dir)
    snap = path if (path / "meta.json").is_file() else checkpoint.latest_snapshot(path)
    if snap is None:
        raise CheckpointError(f"{run_dir}: no snapshot found (train first)")
    config = config_from_meta(checkpoint.load_meta(snap), snap)
    episodes = config.eval_episodes if episodes is None else episodes
    if episodes < 1:
        raise ConfigError(f"episodes={episodes}: expected >= 1")
    dev = resolve_device(device)
    spec = _spec(config.env)
    like = make_grpo(config, spec, dev).init()
    loaded, _ = checkpoint.load_snapshot(snap, device=dev)
    with torch.no_grad():
        like.update_(loaded["learner"])
    return evaluate_policy(config, like, spec, dev, episodes, config.seed if seed is None else seed)


def train_grpo(config: GRPOConfig, run_dir: str | Path, *, progress: bool = True, tensorboard: bool = True) -> GRPOResult:
    """Train GRPO or GSPO (``config.loss``) per ``config`` into ``run_dir``.

    Returns:
        GRPOResult(state, run_dir, evaluation, interrupted): the final deterministic evaluation
        (None when SIGINT/SIGTERM stopped the run after saving a snapshot).

    Raises:
        ConfigError, EnvError: bad config, run dir or env id; nothing is written then.
    """
    run_dir = Path(run_dir)
    _check_run_dir(run_dir, resume=False)
    collect.check_env_id(config.env)
    device = resolve_device(config.device)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    spec = _spec(config.env)
    algo = make_grpo(config, spec, device)
    state = algo.init()
    optimizer = make_adam(state["params"], config.lr, eps=config.adam_eps)
    rollout, close = _rollout_fn(config, device)
    logger = _start(config, run_dir, tensorboard)
    start = time.perf_counter()
    S = config.num_seeds

    def save() -> Path:
        return _save(run_dir, state, optimizer, config, spec)

    def step(i: int, stopping: bool) -> dict:
        nonlocal state
        t0 = time.perf_counter()
        set_lr(optimizer, linear_lr(config.lr, i - 1, config.num_iterations, config.anneal_lr))
        gens = _generators(state, device)
        batch = rollout(algo.policy(state, gens), i - 1)
        t1 = time.perf_counter()
        state, metrics = algo.iteration(state, batch, gens, optimizer)
        t2 = time.perf_counter()
        steps = batch.batch_size[1] * batch.batch_size[2] * batch.batch_size[3]
        return {
            "iteration": i, "step": int(state["env_steps"]), "time": time.perf_counter() - start,
            "steps_per_s": S * steps / (t2 - t0), "collect_s": t1 - t0, "update_s": t2 - t1,
            "lr": optimizer.param_groups[0]["lr"],
            **{k: (v if S > 1 else v[0]) for k, v in metrics.items()},
        }

    try:
        stopped = _loop(config.num_iterations, config.loss, step, logger=logger, save=save,
                        checkpoint_every=config.checkpoint_every, progress=progress)
    finally:
        close()
    plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png")
    if stopped:
        return GRPOResult(state, run_dir, None, stopped)
    summary = evaluate_policy(config, state, spec, device, config.eval_episodes, config.seed)
    (run_dir / "eval.json").write_text(json.dumps(summary) + "\n")
    return GRPOResult(state, run_dir, summary)

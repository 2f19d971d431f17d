"""A whole encoder-PPO run (:mod:`rlfunc.algos.ppo_encoder`): collect -> update -> log -> snapshot -> evaluate.

``train_ppo_encoder(config, run_dir)`` writes RUN_DIR/config.json, metrics.jsonl (one line per
iteration: losses, episode_return (and success_rate, for envs that report ``is_success``) of the
episodes that ended, steps/s, collect and update seconds), checkpoints/ (safetensors snapshots, ``algo="ppo-encoder"``), learning_curve.png and
eval.json. The envs are one :class:`rlfunc.envs.chunk.GymChunkEnv` (``act_steps=1``) kept running
across iterations.

Resume (:func:`resume_encoder`, ``train_ppo_encoder(..., resume=True)``): a snapshot holds the
learner state (its action / minibatch generator "rng" included), Adam's state, the carry (the
observations the next step acts on) and, in meta.json, the envs' reset-seed generator and their
episodes (:meth:`~rlfunc.envs.chunk.GymChunkEnv.episode_state`: each gymnasium env's RNG, time-limit
counter and MuJoCo state, the running returns), so on CPU 2N iterations in one go equal N, stop, N
more, tensor for tensor. Envs whose state cannot be captured (neither MuJoCo nor a classic-control
``state`` array) resume with new episodes, with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from pathlib import Path

import torch
from tensordict import TensorDict

from rlfunc.algos.diffusion_actor import EnvInfo, env_info
from rlfunc.algos.ppo_encoder import ALGO, PPOEncoderConfig, check_dict_info, evaluate, make_ppo_encoder
from rlfunc.device import resolve_device
from rlfunc.envs.chunk import GymChunkEnv
from rlfunc.errors import CheckpointError, ConfigError, EnvError
from rlfunc.optim import linear_lr, make_adam, optimizer_state, set_lr
from rlfunc.optim.amp import precision
from rlfunc.run import checkpoint
from rlfunc.run.log import plot_learning_curve
from rlfunc.run.resume import (ResumePoint, begin_run, env_rng_snapshot, open_run, restore_env_rng, restore_learner,
                           resume_meta, run_iterations, set_generator_state, truncate_metrics)
from rlfunc.core.stats import success_interval, summarize_returns
from rlfunc.run.diffusion import DiffusionResult, _setup
from rlfunc.run.ppo import EVAL_SEED_OFFSET


def is_dict_env(env_id: str) -> bool:
    """Whether the registered gymnasium env ``env_id`` has a Dict observation (one env is made and closed)."""
    import gymnasium as gym

    from rlfunc.envs.chunk import check_chunk_env_id

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


def _carry_keys(info: EnvInfo) -> tuple[str, ...]:
    """What the rollout carries from one iteration to the next (its last root TensorDict)."""
    return (*info.obs_keys, "done", "terminated", "truncated")


def _restore(point: ResumePoint, like: TensorDict, state: TensorDict, optimizer, generator: torch.Generator,
             env: GymChunkEnv, device: torch.device) -> TensorDict:
    """Load ``point``'s snapshot into a freshly built run (``env`` reset once); returns the carry to
    act on next: the snapshot's when the envs' episodes could be restored, else a fresh reset (with
    a warning). Raises CheckpointError: the snapshot does not fit the run its config builds."""
    loaded = restore_learner(point, like, state, optimizer, device)
    set_generator_state(generator, state["rng"])
    restore_env_rng(env, loaded, point)
    episodes = point.meta.get("env_state")
    if episodes is None:
        warnings.warn(f"{point.snapshot}: the {point.config.env} envs' state was not captured, so the resumed run "
                      "starts new episodes and is not bit-identical to an uninterrupted one", stacklevel=3)
        return env.reset()
    try:
        env.set_episode_state(episodes)
    except EnvError as e:
        raise CheckpointError(f"{point.snapshot}: {e}") from None
    return TensorDict(loaded["carry"].to_dict(), batch_size=env.batch_size, device=env.device)  # snapshots load with batch []


def train_ppo_encoder(
    config: PPOEncoderConfig | None, run_dir: str | Path, *, resume: bool = False, total_steps: int | None = None,
    progress: bool = True, tensorboard: bool = True, evaluate_at_end: bool = True, device: str | None = None,
) -> DiffusionResult:
    """Train encoder PPO per ``config`` into ``run_dir``, or continue it (``resume``).

    Args:
        config: every hyperparameter; ignored on resume (the snapshot's config is used; may be None).
        run_dir: output directory; must not already hold a run unless ``resume``.
        resume: continue from the latest snapshot (see the module docstring for what comes back);
            metrics lines written after it are dropped.
        total_steps: with ``resume``, a new budget (env steps) to extend the run; the learning-rate
            schedule is then stretched over the new budget.
        progress: show a tqdm bar. tensorboard: mirror the metrics to RUN_DIR/tb.
        evaluate_at_end: run :func:`evaluate_run` once the budget is done.
        device: with ``resume``, run on this device instead of the snapshot config's (None: the
            config's); a run continues exactly only on the device type it ran on.

    Returns:
        (state, run_dir, evaluation, interrupted): ``evaluation`` is :func:`evaluate_run`'s dict on
        ``config.eval_episodes`` episodes (None when a signal stopped the run or ``evaluate_at_end``
        is False); ``interrupted`` names the signal (SIGINT/SIGTERM) that stopped it after a snapshot.

    Raises:
        ConfigError: a bad run_dir or config; ``total_steps`` without ``resume``, not an int >= 1, or
            below the steps the run has done. EnvError: an unknown env, or one without a Dict
            observation. CheckpointError: on resume, no snapshot in ``run_dir``, a corrupt one, one
            written before ppo-encoder runs were resumable, or one that does not fit its config.

    Warns:
        UserWarning: on resume, when the snapshot holds no state of the envs' episodes (new episodes).
    """
    run_dir, point, config = begin_run(run_dir, config, PPOEncoderConfig, resume=resume, total_steps=total_steps,
                                       from_meta=config_from_meta, device=device)
    device = _setup(config)
    info = env_info(config.env)
    check_dict_info(info, config.env)
    prec = precision(device, config.precision)
    algo = make_ppo_encoder(config, info, device, prec)
    state = algo.init()
    optimizer = make_adam(TensorDict({str(i): p for i, p in enumerate(algo.trainable(state["params"]))}), config.lr, eps=config.adam_eps)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    env = GymChunkEnv(config.env, config.num_envs, act_steps=1, device=device, seed=config.seed)
    try:
        live = {"state": state, "carry": env.reset()}

        def saved_state() -> TensorDict:
            carry = live["carry"].select(*_carry_keys(info), strict=False)
            return TensorDict({"learner": live["state"], "optim": optimizer_state(optimizer), "carry": carry}, batch_size=[])

        clock = 0.0
        if point is not None:
            live["carry"] = _restore(point, saved_state(), state, optimizer, generator, env, device)
            clock = truncate_metrics(run_dir, int(state["iteration"]))
        logger = open_run(config, run_dir, tensorboard)
        t_start = time.perf_counter() - clock
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
            meta = {**_meta(config, info, s), **resume_meta(optimizer), **env_rng_snapshot(env)[1],
                    "env_state": env.episode_state()}
            checkpoint.save_run_snapshot(run_dir, saved_state(), meta, step=int(s["env_steps"]),
                                         keep_last=config.keep_checkpoints or None)

        interrupted = run_iterations(int(state["iteration"]), config.num_iterations, ALGO, step, logger=logger, save=save,
                                     checkpoint_every=config.checkpoint_every, progress=progress)
    finally:
        env.close()
    plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png")
    evaluation = None
    if interrupted is None and evaluate_at_end:
        evaluation = evaluate_run(run_dir, config.eval_episodes, device=str(device))
        (run_dir / "eval.json").write_text(json.dumps(evaluation) + "\n")
    return DiffusionResult(live["state"], run_dir, evaluation, interrupted)


def resume_encoder(run_dir: str | Path, total_steps: int | None = None, *, progress: bool = True,
                   tensorboard: bool = True, device: str | None = None) -> DiffusionResult:
    """Continue a ppo-encoder run from its latest snapshot: ``train_ppo_encoder(None, run_dir, resume=True, ...)``.

    Args:
        run_dir: a run directory written by :func:`train_ppo_encoder`.
        total_steps: a new budget in env steps (None: the run's own).
        device: run on this device instead of the snapshot config's (None: the config's); a run
            continues exactly only on the device type it ran on.

    Returns:
        (state, run_dir, evaluation, interrupted), as :func:`train_ppo_encoder` (a run that had
        already done its budget runs no iteration and is evaluated again).

    Raises:
        CheckpointError: no snapshot in ``run_dir`` (the message names it), a corrupt snapshot, a
            config in meta.json that is not a PPOEncoderConfig, or a snapshot written before
            ppo-encoder runs were resumable, or one whose generator states were saved on another
            device type (the message names the one to resume on).
        ConfigError: ``total_steps`` is not an int >= 1, or gives fewer iterations than already done;
            ``device`` is not a device this machine has.

    Warns:
        UserWarning: the envs' episodes could not be captured (the resumed run starts new ones).
    """
    return train_ppo_encoder(None, run_dir, resume=True, total_steps=total_steps, progress=progress, tensorboard=tensorboard,
                             device=device)


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
        {"env", "mean", "std", "episodes", "ci95", "env_steps"}: the episodes' returns (env units)
        summarised by :func:`rlfunc.core.stats.summarize_returns`, and "success_rate" with its Wilson
        interval "success_ci95" when the env reports ``info["is_success"]`` (:func:`reports_success`).

    Raises:
        CheckpointError: no snapshot, not an encoder-PPO one, or weights that do not match its config.
        ConfigError: ``episodes < 1``. EnvError: no episode ended within the env's time limit (the
            statistics cover the episodes that ended; "unfinished" counts the others).
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
    # evaluation draws no randomness: a run trained on another device type loads
    learner = checkpoint.check_learner(str(snap), loaded.get("learner", None), state, generators="fresh")
    with torch.no_grad():
        state.update_(learner)
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
        returns.append(out["returns"])
        successes.append(out["successes"])
        done += n
    returns = torch.cat(returns)
    if returns.numel() == 0:
        raise EnvError(f"{config.env}: none of {episodes} evaluation episodes ended within {limit} steps")
    out = {"env": config.env, **summarize_returns(returns), "env_steps": int(meta.get("env_steps", 0))}
    if returns.numel() < episodes:  # the statistics are over the episodes that ended
        out["unfinished"] = episodes - returns.numel()
    if reports_success(config.env):
        out["success_rate"] = sum(successes) / episodes
        out["success_ci95"] = list(success_interval(sum(successes), episodes))
    return out

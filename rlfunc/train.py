"""A whole PPO run as one function of its config: collect -> update -> log -> checkpoint, resumable.

``train(config, run_dir)`` writes RUN_DIR/config.json, metrics.jsonl (one line per iteration),
checkpoints/ (safetensors snapshots, see rlfunc.checkpoint), learning_curve.png and eval.json.
Resume is exact on CPU: the learner state (Adam's moments and steps included, ``state["optim"]``),
RNG states, rollout carry and the gymnasium envs' own state (RNG, time limit, physics) all go into
each snapshot. A snapshot is ``{"learner": state, "carry": carry[, "freeze": tracker]}``; a load is
checked against the same structure built from ``algo.init()``. Snapshots and versions written before
the optimizer's state moved into the learner (state layout 1: a separate "optim" entry of torch.optim
state) are converted on load.

With ``version_every`` > 0 the same state also goes, every that many iterations, into the run's
version store (RNG, rlfunc.versions): content-addressed, with the iteration's metrics and each
parameter leaf's relative change. ``resume`` continues from the newer of the latest snapshot and the
current branch's head version, so after ``rlfunc versions rollback RUN_DIR V`` it continues from V.

``freeze_threshold`` > 0 skips the updates of parameter leaves that barely move: every
``freeze_window`` iterations each leaf's relative change ||p - p_ref|| / ||p_ref|| over the window
(max over seeds) is measured, and a leaf below the threshold is frozen (no gradient, no Adam step) for
the next window, then trains a window again before it is measured anew. The tracker (reference
params, frozen-until iteration per leaf) is part of the saved state, so resume stays exact.
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from rlfunc import checkpoint, collect, func, versions
from rlfunc.algos.ppo import PPO, EnvSpec, PPOConfig, make_ppo
from rlfunc.device import resolve_device
from rlfunc.errors import CheckpointError, ConfigError, EnvError
from rlfunc.log import MetricsLogger, plot_learning_curve
from rlfunc.optim import linear_lr
from rlfunc.stats import mean_interval, success_interval, summarize_returns
from rlfunc.resume import (STATE_LAYOUT, StopOnSignal, check_budget, check_budget_covers, check_run_dir, generator_from_state,
                           optim_from_layout_1, state_layout, truncate_metrics)

EVAL_SEED_OFFSET = 1_000_003  # evaluation episodes never reuse training reset seeds


class TrainResult(NamedTuple):
    state: TensorDict
    run_dir: Path
    interrupted: str | None  # the signal's name ("SIGINT", "SIGTERM") when one stopped the run


def env_spec(venv: gym.vector.VectorEnv) -> EnvSpec:
    """Sizes and bounds of a vector env; EnvError unless observations and actions are flat Boxes."""
    obs_space, act_space = venv.single_observation_space, venv.single_action_space
    if not isinstance(act_space, gym.spaces.Box) or not isinstance(obs_space, gym.spaces.Box):
        raise EnvError(
            f"PPO with a Gaussian actor needs Box observations and actions; got "
            f"{type(obs_space).__name__} observations and {type(act_space).__name__} actions"
        )
    return EnvSpec(
        int(np.prod(obs_space.shape)), int(np.prod(act_space.shape)),
        act_space.low.astype(float).tolist(), act_space.high.astype(float).tolist(),
    )


def _generators(state: TensorDict, device: torch.device) -> list[torch.Generator]:
    """One generator per seed, in the states ``state["rng"]`` [S, n] (uint8) holds."""
    return [generator_from_state(saved, device) for saved in state["rng"]]


def _member_seeds(config: PPOConfig) -> list[int]:
    return [s for seed in config.seeds for s in collect.env_seeds(seed, config.num_envs)]


def _saved_state(state: TensorDict, carry: TensorDict, freeze: TensorDict | None = None) -> TensorDict:
    """What a snapshot or version of the run holds. Of ``algo.init()``, a fresh carry and tracker, it is
    the structure (keys, shapes, dtypes) a load is checked against."""
    saved = TensorDict({"learner": state, "carry": carry}, batch_size=[])
    if freeze is not None:
        saved["freeze"] = freeze
    return saved


def _load(source: tuple[str, Path | str], like: TensorDict, *, device, run_dir=None, generators: str = "exact"):
    """Read ``source`` (("snapshot", path) or ("version", id) of ``run_dir``) checked against ``like``
    (:func:`_saved_state` of the fresh run). Returns (state, meta).

    A snapshot or version of state layout 1 (meta without "state_layout": the optimizer's torch.optim
    state as a separate "optim" entry, ``{"<i>": {"step", "exp_avg", "exp_avg_sq"}}`` over the leaves in
    ``func.leaves`` order) is converted: its Adam state goes into ``learner.optim``, the clip link's last
    norms start at zero (they are a report, read by nothing), and the result is checked as a new one.

    Raises:
        CheckpointError: the structure differs from ``like`` (the first key named), an unknown state
            layout, or a layout-1 optimizer state that does not fit the run's parameters.
    """
    kind, where = source
    name = str(where) if kind == "snapshot" else f"{run_dir} version {where}"
    meta = checkpoint.load_meta(where) if kind == "snapshot" else versions.read_manifest(run_dir, where)["meta"]
    layout = state_layout(name, meta, "PPO")
    check = like if layout == STATE_LAYOUT else None
    if kind == "snapshot":
        loaded, meta = checkpoint.load_snapshot(where, device=device, like=check, generators=generators)
    else:
        loaded, manifest = versions.load_version(run_dir, where, device=device, like=check)
        meta = manifest["meta"]
    if layout == 1:
        if "optim" not in loaded.keys():
            raise CheckpointError(f"{name}: no optimizer state: a PPO snapshot of state layout 1 (meta without "
                                  "'state_layout') holds one as 'optim' beside 'learner'")
        loaded["learner", "optim"] = optim_from_layout_1(name, loaded.pop("optim"), like["learner", "optim"],
                                                         like["learner", "params"], commit="c0e6595").to(loaded.device)
        checkpoint.check_learner(name, loaded, like, generators=generators)
    return loaded, meta


def init_freeze(params: TensorDict) -> TensorDict:
    """The freeze tracker: "reference" (a copy of ``params``, the start of the measuring window) and
    "frozen_until" ([num_leaves] int64, the iteration up to which each ``func.leaves`` leaf is frozen)."""
    return TensorDict(
        {
            "reference": params.detach().clone(),
            "frozen_until": torch.zeros(len(func.leaves(params)), dtype=torch.int64, device=params.device),
        },
        batch_size=[],
    )


def update_freeze(freeze: TensorDict, params: TensorDict, iteration: int, config: PPOConfig) -> TensorDict:
    """At the end of a window (``iteration`` done, a multiple of ``freeze_window``): freeze, until
    ``iteration + freeze_window``, each leaf that trained the whole window and whose relative change
    max_s ||p_s - ref_s|| / ||ref_s|| stayed below ``freeze_threshold``; never all leaves at once.
    Returns the new tracker (reference = current params)."""
    window = config.freeze_window
    until = freeze["frozen_until"].clone()
    leaves, refs = func.leaves(params), func.leaves(freeze["reference"])
    changes = []
    for p, ref in zip(leaves, refs):
        num = torch.linalg.vector_norm((p.detach() - ref).flatten(1), dim=1)
        den = torch.linalg.vector_norm(ref.flatten(1), dim=1)
        rel = torch.where(den > 0, num / den.clamp_min(1e-30), torch.where(num > 0, torch.inf, 0.0))
        changes.append(float(rel.max()))
    candidates = [i for i, c in enumerate(changes) if int(until[i]) <= iteration - window and c < config.freeze_threshold]
    if len(candidates) == len(leaves):  # a step needs one leaf with a gradient: keep the one that moved most
        candidates.remove(max(candidates, key=lambda i: changes[i]))
    for i in candidates:
        until[i] = iteration + window
    return TensorDict({"reference": params.detach().clone(), "frozen_until": until}, batch_size=[])


def _episode_stats(batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean return of the episodes that ended in ``batch`` ([S, N, T]) per seed, and their count.

    Episodes with a non-finite reward (their return is NaN) are left out of both.
    """
    returns = batch["next", "episode_reward"].flatten(1)
    ended = batch["next", "done"].flatten(1) & returns.isfinite()
    count = ended.sum(1).float()
    mean = torch.where(ended, returns, torch.zeros_like(returns)).sum(1) / count.clamp_min(1)
    return torch.where(count > 0, mean, torch.full_like(mean, float("nan"))), count


def _meta(state, venv, config, spec, branch) -> dict:
    return {
        "algo": "ppo",
        "config": dataclasses.asdict(config),
        "env_spec": spec._asdict(),
        "env_state": collect.env_state(venv),
        "iteration": int(state["iteration"]),
        "env_steps": int(state["env_steps"]),
        "branch": branch,
        "state_layout": STATE_LAYOUT,
    }


def _save(run_dir, state, carry, venv, config, spec, freeze=None, branch=versions.MAIN) -> Path:
    return checkpoint.save_run_snapshot(
        run_dir, _saved_state(state, carry, freeze), _meta(state, venv, config, spec, branch),
        step=int(state["env_steps"]), keep_last=config.keep_checkpoints or None,
    )


def _save_version(run_dir, state, carry, venv, config, spec, freeze, branch, record) -> dict:
    """A version of the run (rlfunc.versions): the snapshot's state and meta, plus the env's id,
    registration and wrapper chain, every env's seed, and ``record`` (the iteration's metrics)."""
    meta = _meta(state, venv, config, spec, branch)
    try:
        registration = json.loads(gym.spec(config.env).to_json())
    except (gym.error.Error, TypeError, ValueError):  # kwargs JSON cannot hold
        registration = str(gym.spec(config.env))
    meta["env"] = {
        "id": config.env,
        "registration": registration,
        "wrappers": str(venv.envs[0]) if hasattr(venv, "envs") else None,
        "vectorization": config.vectorization,
    }
    meta["seeds"] = {"agents": config.seeds, "envs": _member_seeds(config)}
    metrics = {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in record.items()}
    return versions.save_version(
        run_dir, _saved_state(state, carry, freeze), meta,
        iteration=int(state["iteration"]), step=int(state["env_steps"]), metrics=metrics,
        keep_last=config.version_keep_last or None, keep_every=config.version_keep_every,
    )


def resume_source(run_dir: str | Path) -> tuple[str, Path | str] | None:
    """What ``resume`` continues from: ("snapshot", path) or ("version", id), or None if neither.

    The current branch's head version (after a rollback to V with no new version yet: V), unless the
    latest snapshot is on the current branch and at least as far along (a snapshot without a
    "branch" is on "main").

    Raises:
        CheckpointError: a version manifest fails its check.
    """
    snap = checkpoint.latest_snapshot(run_dir)
    head = versions.head(run_dir)
    if head is None:
        return None if snap is None else ("snapshot", snap)
    if snap is not None:
        meta = checkpoint.load_meta(snap)
        same_branch = meta.get("branch", versions.MAIN) == versions.current_branch(run_dir)
        if same_branch and meta.get("env_steps", -1) >= head["step"]:
            return "snapshot", snap
    return "version", head["id"]


def config_from_meta(meta: dict, path: Path | str = "snapshot", **overrides) -> PPOConfig:
    """Rebuild a PPOConfig from a snapshot's meta (with ``overrides``).

    Raises:
        CheckpointError: the meta holds no valid PPO config (missing, wrong types, out of range);
            the message names the snapshot ``path``.
    """
    if meta.get("algo") != "ppo":
        raise CheckpointError(f"{path}: snapshot algo={meta.get('algo')!r}: expected 'ppo'")
    try:
        cfg = {**dict(meta["config"]), **overrides}
        cfg["hidden"] = tuple(int(h) for h in cfg["hidden"])
        return PPOConfig(**cfg)
    except (KeyError, TypeError, ValueError) as e:  # ConfigError is a ValueError
        raise CheckpointError(f"{path}: snapshot config is not a valid PPOConfig: {e}") from e


def train(
    config: PPOConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    max_iterations: int | None = None,
    progress: bool = True,
    tensorboard: bool = True,
    total_steps: int | None = None,
    device: str | None = None,
) -> TrainResult:
    """Train PPO per ``config`` into ``run_dir`` (or continue it with ``resume=True``).

    Args:
        config: every hyperparameter (see PPOConfig); on resume, the snapshot's config is used.
        run_dir: output directory; must not already hold a run unless ``resume``.
        resume: continue from the latest snapshot in ``run_dir``, or from the head version of the
            current branch when that is newer or the branch was made by a rollback (``resume_source``).
        max_iterations: stop after this many iterations of this call (the LR schedule still spans
            ``config.total_steps``), e.g. to split a run in parts.
        progress: show a tqdm bar.
        total_steps: on resume, a new budget (env steps per seed) to extend or shorten the run;
            the learning-rate schedule is then stretched over the new budget.
        device: on resume, run on this device instead of the snapshot config's (None: the config's);
            a run continues exactly only on the device type it ran on (its generator states are
            device-specific).

    Returns:
        TrainResult(state, run_dir, interrupted): interrupted names the signal (SIGINT/SIGTERM) that
        stopped the run after saving a snapshot, else None. Signals are caught only when called
        from the main thread.

    Raises:
        ConfigError, EnvError, CheckpointError: bad config, env id or snapshot; nothing is written then.
    """
    run_dir = Path(run_dir)
    check_run_dir(run_dir, resume)
    source = None
    if resume:
        source = resume_source(run_dir)
        if source is None:
            raise CheckpointError(f"{run_dir}: no snapshot or version to resume from")
        if total_steps is not None:
            check_budget(total_steps, "env steps per seed")
        extra = {} if total_steps is None else {"total_steps": total_steps}
        if source[0] == "snapshot":
            meta = checkpoint.load_meta(source[1])
            config = config_from_meta(meta, source[1], **extra)
        else:
            meta = versions.read_manifest(run_dir, source[1])["meta"]
            config = config_from_meta(meta, f"{run_dir} version {source[1]}", **extra)
        done = meta.get("iteration")
        if total_steps is not None and isinstance(done, int):
            check_budget_covers(total_steps, config.num_iterations, done, done * config.batch_size, "env steps per seed")
        if device is not None:
            resolve_device(device)  # ConfigError for a device this machine lacks
            config = dataclasses.replace(config, device=str(device))
    elif device is not None:
        raise ConfigError(f"device={device!r}: is for resume=True; set config.device instead")
    device = resolve_device(config.device)

    venv = collect.make_vec_env(config.env, config.num_seeds * config.num_envs, vectorization=config.vectorization)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    try:
        return _train(config, run_dir, device, venv, source, max_iterations, progress, tensorboard)
    finally:
        venv.close()


def _train(config, run_dir, device, venv, source, max_iterations, progress, tensorboard) -> TrainResult:
    spec = env_spec(venv)
    algo: PPO = make_ppo(config, spec, device)
    state = algo.init()  # its "optim" is Adam's state: the optimizer is part of the learner
    carry = collect.reset(venv, _member_seeds(config))
    freeze = init_freeze(state["params"]) if config.freeze_threshold > 0 else None
    branch = versions.current_branch(run_dir)
    if source is not None:
        loaded, meta = _load(source, _saved_state(state, carry, freeze), device=device, run_dir=run_dir)
        with torch.no_grad():  # in place: the freeze tracker's leaves below are these
            state.update_(loaded["learner"])
        carry = loaded["carry"].to("cpu")
        if freeze is not None:
            freeze = loaded["freeze"]
        if meta.get("env_state") is not None:
            collect.set_env_state(venv, meta["env_state"])
        else:  # an env whose state can't be captured (async vector envs, ...): fresh episodes
            carry = collect.reset(venv, _member_seeds(config))
            warnings.warn(
                f"{config.env} ({config.vectorization} vectorization): env state was not captured, so the "
                "resumed run starts new episodes and is not bit-identical to an uninterrupted one",
                stacklevel=2,
            )
        time_offset = truncate_metrics(run_dir, int(state["iteration"]))
    else:
        time_offset = 0.0
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))

    logger = MetricsLogger(run_dir, tensorboard=tensorboard)
    start_iteration = int(state["iteration"])
    end = config.num_iterations if max_iterations is None else min(config.num_iterations, start_iteration + max_iterations)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.num_iterations, initial=start_iteration, unit="it", dynamic_ncols=True)
    S, N, T = config.num_seeds, config.num_envs, config.num_steps
    t_start = time.perf_counter() - time_offset
    interrupted = None
    leaves = func.leaves(state["params"])
    with StopOnSignal() as stop:  # SIGINT/SIGTERM: a snapshot after this iteration; a second one quits at once
        try:
            for it in range(start_iteration, end):
                t0 = time.perf_counter()
                gens = _generators(state, device)
                # log_prob=False: iteration computes the batch's log-probabilities in one pass
                batch, carry = collect.rollout(venv, algo.policy(state, gens, log_prob=False), carry, T, device=device)
                batch = batch.reshape(S, N, T)
                t1 = time.perf_counter()
                frozen = [] if freeze is None else [i for i, u in enumerate(freeze["frozen_until"].tolist()) if u > it]
                for i in frozen:
                    leaves[i].requires_grad_(False)
                try:
                    state, metrics = algo.iteration(state, batch, gens)
                finally:
                    for i in frozen:
                        leaves[i].requires_grad_(True)
                t2 = time.perf_counter()
                if freeze is not None:
                    frozen_numel = sum(leaves[i].numel() for i in frozen)
                    metrics["frozen_leaves"] = torch.full((S,), len(frozen))
                    metrics["frozen_fraction"] = torch.full((S,), frozen_numel / sum(p.numel() for p in leaves))
                    if (it + 1) % config.freeze_window == 0:
                        freeze = update_freeze(freeze, state["params"], it + 1, config)
                ep_return, ep_count = _episode_stats(batch)
                record = {
                    "iteration": it + 1,
                    "step": int(state["env_steps"]),
                    "time": time.perf_counter() - t_start,
                    "steps_per_s": S * N * T / (t2 - t0),
                    "collect_s": t1 - t0,
                    "update_s": t2 - t1,
                    "lr": linear_lr(config.lr, it, config.num_iterations, config.anneal_lr),  # iteration's
                    "episode_return": ep_return if S > 1 else ep_return[0],
                    "episodes": ep_count if S > 1 else ep_count[0],
                    **{k: (v if S > 1 else v[0]) for k, v in metrics.items()},
                }
                logger.log(record)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(ret=f"{ep_return.nanmean().item():.1f}", sps=f"{record['steps_per_s']:.0f}")
                last = it + 1 == end
                if config.version_every and (stop.signal or last or (it + 1) % config.version_every == 0):
                    _save_version(run_dir, state, carry, venv, config, spec, freeze, branch, record)
                if stop.signal or last or (config.checkpoint_every and (it + 1) % config.checkpoint_every == 0):
                    _save(run_dir, state, carry, venv, config, spec, freeze, branch)
                if stop.signal:
                    interrupted = stop.signal
                    break
        finally:
            logger.close()
            if bar is not None:
                bar.close()
    plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png")
    return TrainResult(state, run_dir, interrupted)


def evaluate(
    run_dir: str | Path, episodes: int | None = None, *, seed: int | None = None, device: str = "auto",
    snapshot: str | Path | None = None,
) -> dict:
    """Deterministic-action returns of the latest snapshot in ``run_dir`` (or of ``snapshot``, or of
    ``run_dir`` itself when it is a snapshot directory) on ``episodes`` episodes per seed (None: the
    run's ``eval_episodes``).

    Returns:
        {"env", "mean", "std", "episodes", "ci95", "per_seed_mean", "env_steps"}: mean, std and the
        Student-t 95% interval of the mean over all episodes of all seeds (env reward units,
        :func:`rlfunc.stats.summarize_returns`), the episodes per seed, the mean per seed (and with
        several seeds "per_seed_ci95"), and the snapshot's env steps; "success_rate" and its Wilson
        interval "success_ci95" too when the env reports ``info["is_success"]``. Actions are
        deterministic; the episodes' reset seeds (from ``seed`` + EVAL_SEED_OFFSET) are disjoint
        from the training envs'.

    Raises:
        CheckpointError: no readable snapshot in ``run_dir``. ConfigError: ``episodes < 1``.
    """
    if episodes is not None and episodes < 1:
        raise ConfigError(f"episodes={episodes}: expected >= 1")
    if snapshot is None and (Path(run_dir) / checkpoint.META_FILE).is_file():
        snapshot = run_dir  # a snapshot directory, as `rlfunc eval` accepts for every algorithm
    path = Path(snapshot) if snapshot is not None else checkpoint.latest_snapshot(run_dir)
    if path is None:
        raise CheckpointError(f"{run_dir}: no snapshot found (train first)")
    trained = config_from_meta(checkpoint.load_meta(path), path)
    episodes = trained.eval_episodes if episodes is None else episodes
    dev = resolve_device(device)
    config = dataclasses.replace(trained, num_envs=episodes, minibatch_size=episodes, num_steps=1, device=str(dev))
    venv = collect.make_vec_env(config.env, config.num_seeds * episodes)
    try:
        spec = env_spec(venv)
        like = make_ppo(trained, spec, dev).init()  # the trained run's structure, to validate the snapshot
        carry = collect.empty_carry(trained.num_seeds * trained.num_envs, spec.obs_dim)
        freeze = init_freeze(like["params"]) if trained.freeze_threshold > 0 else None
        # generators="fresh": evaluation draws no randomness, so a run trained on another device type loads
        loaded, _ = _load(("snapshot", path), _saved_state(like, carry, freeze), device=dev, generators="fresh")
        algo = make_ppo(config, spec, dev)
        state = algo.init()
        with torch.no_grad():
            state["params"].update_(loaded["learner", "params"])
            state["obs_stats"].update_(loaded["learner", "obs_stats"])
        base = (config.seed if seed is None else seed) + EVAL_SEED_OFFSET
        seeds = [s for i in range(config.num_seeds) for s in collect.env_seeds(base + i, episodes)]
        returns, success = collect.episode_outcomes(venv, algo.policy(state, [], deterministic=True), seeds, device=dev)
    finally:
        venv.close()
    per_seed = returns.view(config.num_seeds, episodes)
    out = {
        "env": config.env,
        **summarize_returns(returns),
        "episodes": episodes,
        "per_seed_mean": per_seed.mean(1).tolist(),
        "env_steps": int(loaded["learner", "env_steps"]),
    }
    if config.num_seeds > 1:
        out["per_seed_ci95"] = [list(mean_interval(r)) if episodes > 1 else None for r in per_seed]
    if success is not None:  # envs that report info["is_success"] (Push-v0, PushState-v0, ...)
        out["success_rate"] = float(success.float().mean())
        out["success_ci95"] = list(success_interval(int(success.sum()), success.numel()))
    return out

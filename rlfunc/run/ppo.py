"""A whole PPO run: collect -> update -> log -> checkpoint, resumable.

``rlfunc.run.train(config, run_dir)`` of a PPOConfig writes RUN_DIR/config.json, metrics.jsonl (one
line per iteration), checkpoints/ (safetensors snapshots, see rlfunc.run.checkpoint), versions/,
learning_curve.png and eval.json (:func:`evaluate`). The run is a :class:`PPORun`, driven by the one run loop
(:mod:`rlfunc.run.loop`: snapshots, versions, metrics, progress bar, stop on SIGINT/SIGTERM).

Resume is exact on CPU: the learner state (Adam's moments and steps included, ``state["optim"]``),
RNG states, rollout carry and the gymnasium envs' own state (RNG, time limit, physics) all go into
each snapshot. A snapshot is ``{"learner": state, "carry": carry[, "freeze": tracker]}``; a load is
checked against the same structure built from ``algo.init()``. Snapshots and versions written before
the optimizer's state moved into the learner (state layout 1: a separate "optim" entry of torch.optim
state) are converted on load (:meth:`PPORun.upgrade`).

With ``version_every`` > 0 the same state also goes, every that many iterations, into the run's
version store (rlfunc.run.versions): content-addressed, with the iteration's metrics and each
parameter leaf's relative change; the meta of every snapshot and version also records the env's
id, registration and wrapper chain and every env's reset seed. ``resume`` continues from the newer
of the latest snapshot and the current branch's head version (:func:`rlfunc.run.resume_source`), so
after ``rlfunc versions rollback RUN_DIR V`` it continues from V.

``freeze_threshold`` > 0 skips the updates of parameter leaves that barely move: every
``freeze_window`` iterations each leaf's relative change ||p - p_ref|| / ||p_ref|| over the window
is measured (one seed: a mask for stacked seeds would couple them, so --num-seeds > 1 is refused), and a leaf below the threshold is frozen (no gradient, no Adam step) for
the next window, then trains a window again before it is measured anew. The tracker (reference
params, frozen-until iteration per leaf) is part of the saved state, so resume stays exact.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from rlfunc.algos import ppo_parallel
from rlfunc.algos import registry as algorithms
from rlfunc.algos.ppo import PPO, EnvSpec, PPOConfig, check_new_run, make_ppo
from rlfunc.core import func
from rlfunc.core.stats import seeds_summary, success_summary
from rlfunc.config import check_episodes, check_new_ppo_run, replace
from rlfunc.device import resolve_device, set_threads, span
from rlfunc.envs import collect
from rlfunc.errors import CheckpointError, ConfigError, EnvError
from rlfunc.optim import linear_lr
from rlfunc.run import checkpoint
from rlfunc.run import Run
from rlfunc.run.resume import STATE_LAYOUT, generator_from_state, has_member_steps, optim_from_layout_1, state_layout, with_member_steps

EVAL_SEED_OFFSET = 1_000_003  # evaluation episodes never reuse training reset seeds
LAYOUT_1_COMMIT = "c0e6595"  # the last rlfunc that wrote PPO snapshots of state layout 1 (torch.optim's state)


def env_spec(venv: gym.vector.VectorEnv, env_id: str | None = None, algo: str = "PPO") -> EnvSpec:
    """Sizes, action kind and bounds of a vector env (:class:`rlfunc.algos.ppo.EnvSpec`; shapes
    flattened, a scalar Box's too); EnvError (naming ``env_id`` and ``algo``, the algorithm asking)
    unless observations are a Box and actions a floating Box (Gaussian actor), Discrete or
    MultiDiscrete (categorical actor)."""
    obs_space, act_space = venv.single_observation_space, venv.single_action_space
    env = "" if env_id is None else f"env={env_id!r}: "
    if not isinstance(obs_space, gym.spaces.Box) or not isinstance(act_space, (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete)):
        raise EnvError(
            f"{env}{algo} needs Box observations and Box (Gaussian actor), Discrete or MultiDiscrete (categorical actor) "
            f"actions; got {type(obs_space).__name__} observations and {type(act_space).__name__} actions (a gymnasium "
            "wrapper such as FlattenObservation, registered as your own env id, converts others)"
        )
    if isinstance(act_space, gym.spaces.Box) and not np.issubdtype(act_space.dtype, np.floating):
        # the bug: the Gaussian's real actions reached an int64 Box as fractional float32 values
        raise EnvError(f"{env}Box actions of dtype {act_space.dtype}: the Gaussian actor acts in real numbers; expected a "
                       "floating Box (or a Discrete / MultiDiscrete space for integer actions)")
    obs_dim = int(np.prod(obs_space.shape))
    if isinstance(act_space, gym.spaces.Discrete):
        start = int(act_space.start)
        return EnvSpec(obs_dim, 1, [float(start)], [float(start + act_space.n - 1)], "discrete", (int(act_space.n),))
    if isinstance(act_space, gym.spaces.MultiDiscrete):
        nvec, start = act_space.nvec.reshape(-1), act_space.start.reshape(-1)
        return EnvSpec(obs_dim, int(nvec.size), start.astype(float).tolist(), (start + nvec - 1).astype(float).tolist(),
                       "multi_discrete", tuple(int(n) for n in nvec))
    return EnvSpec(  # flattened: a (2, 2) or () Box's nested list or bare float failed in the bounds' check
        obs_dim, int(np.prod(act_space.shape)),
        act_space.low.astype(float).reshape(-1).tolist(), act_space.high.astype(float).reshape(-1).tolist(),
    )


def warn_bounds_without_zero(spec: EnvSpec, env_id: str) -> None:
    """A warning when some Box action dim's bounds exclude 0: the Gaussian actor's mean starts near 0
    and its actions are clipped to the bounds (not rescaled), so every action starts on one edge and
    may stay there (new-user pass: bounds [10, 20], the run ended below a random policy)."""
    if spec.action_kind != "box":
        return
    dims = [i for i, (lo, hi) in enumerate(zip(spec.action_low, spec.action_high)) if lo > 0 or hi < 0]
    if dims:
        i = dims[0]
        warnings.warn(f"env={env_id!r}: action dims {dims} have bounds that exclude 0 (dim {i}: [{spec.action_low[i]:g}, "
                      f"{spec.action_high[i]:g}]); PPO's Gaussian actor starts at mean 0 and its actions are clipped to the "
                      "bounds, not rescaled, so they start on the edge; register the env wrapped in "
                      "gymnasium.wrappers.RescaleAction(env, -1, 1) and train that id", stacklevel=2)


def _generators(state: TensorDict, device: torch.device) -> list[torch.Generator]:
    """One generator per seed, in the states ``state["rng"]`` [S, n] (uint8) holds."""
    return [generator_from_state(saved, device) for saved in state["rng"]]


def _member_seeds(config: PPOConfig, rank: int = 0, world_size: int = 1) -> list[int]:
    """The reset seeds of the envs a rank steps, seed member by member: envs rank*N/W .. of each
    member's N (all of them at world size 1)."""
    n = config.num_envs // world_size
    return [s for seed in config.seeds for s in collect.env_seeds(seed, config.num_envs)[rank * n:(rank + 1) * n]]


def _global_order(parts: list[list], members: int) -> list:
    """Per-rank lists of per-env items (member-major: member 0's envs, member 1's ...) as the one
    list of the single process's envs: for each member, rank 0's envs, rank 1's, ..."""
    n = len(parts[0]) // members
    return [item for m in range(members) for part in parts for item in part[m * n:(m + 1) * n]]


def _saved_state(state: TensorDict, carry: TensorDict, freeze: TensorDict | None = None) -> TensorDict:
    """What a snapshot or version of the run holds. Of ``algo.init()``, a fresh carry and tracker, it is
    the structure (keys, shapes, dtypes) a load is checked against."""
    saved = TensorDict({"learner": state, "carry": carry}, batch_size=[])
    if freeze is not None:
        saved["freeze"] = freeze
    return saved


def upgrade_layout_1(loaded: TensorDict, meta: dict, where: str, like: TensorDict) -> TensorDict:
    """``loaded``, a PPO snapshot or version of state layout 1 (meta without "state_layout": the
    optimizer's torch.optim state as a separate "optim" entry, ``{"<i>": {"step", "exp_avg",
    "exp_avg_sq"}}`` over the leaves in ``func.leaves`` order), converted to ``like``'s structure
    (:func:`_saved_state` of the fresh run): its Adam state goes into ``learner.optim``, the clip
    link's last norms start at zero (they are a report, read by nothing). The caller then checks it
    as a new one.

    Raises:
        CheckpointError: naming ``where``, a state layout other than 1 and 2 (:func:`rlfunc.run.resume.state_layout`),
            no "optim" entry, or a layout-1 optimizer state that does not fit the run's parameters.
    """
    state_layout(where, meta, "PPO")  # CheckpointError for a layout this rlfunc does not read
    if "optim" not in loaded.keys():
        raise CheckpointError(f"{where}: no optimizer state: a PPO snapshot of state layout 1 (meta without "
                              "'state_layout') holds one as 'optim' beside 'learner'")
    loaded["learner", "optim"] = optim_from_layout_1(where, loaded.pop("optim"), like["learner", "optim"],
                                                     like["learner", "params"], commit=LAYOUT_1_COMMIT).to(loaded.device)
    return loaded


def _load_snapshot(path: Path, like: TensorDict, device: torch.device) -> TensorDict:
    """The snapshot at ``path`` checked against ``like`` (:func:`_saved_state` of the trained run),
    converted first when of state layout 1 (:func:`upgrade_layout_1`) or when it shares Adam's step
    counts between seeds (:func:`rlfunc.run.resume.with_member_steps`). Generator states of another
    device type are replaced by fresh ones (``generators="fresh"``: for evaluation, which draws none).

    Raises:
        CheckpointError: corrupt, of an unknown layout, or of another structure (the first key named).
    """
    name = str(path)
    layout = state_layout(name, checkpoint.load_meta(path), "PPO")
    members = has_member_steps(like)  # several seeds: a snapshot from before their Adam step counts were their own
    check = like if layout == STATE_LAYOUT and not members else None
    loaded, meta = checkpoint.load_snapshot(path, device=device, like=check, generators="fresh")
    if layout == 1:
        loaded = upgrade_layout_1(loaded, meta, name, like)
    if members:
        loaded = with_member_steps(loaded, like)
    if check is None:
        checkpoint.check_learner(name, loaded, like, generators="fresh")
    return loaded


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


def _env_meta(config: PPOConfig, venv: gym.vector.VectorEnv) -> dict:
    """The meta entries that say which envs a run trained on: "env" (id, gymnasium registration,
    wrapper chain, vectorization) and "seeds" (the agent seeds and every env's reset seed)."""
    try:
        registration = json.loads(collect.gym_spec(config.env).to_json())
    except (gym.error.Error, TypeError, ValueError):  # kwargs JSON cannot hold
        # without the memory addresses of a callable entry point's repr (they differ run to run)
        registration = re.sub(r" at 0x[0-9a-fA-F]+", "", str(collect.gym_spec(config.env)))
    return {
        "env": {
            "id": config.env,
            "registration": registration,
            "wrappers": str(venv.envs[0]) if hasattr(venv, "envs") else getattr(venv, "wrappers", None),
            "vectorization": config.vectorization,
        },
        "seeds": {"agents": config.seeds, "envs": _member_seeds(config)},
    }


class PPORun(Run):
    """A PPO run as :func:`rlfunc.run.run_loop` drives it: ``config.run.num_seeds * config.num_envs``
    gymnasium envs, the learner state of ``make_ppo(config, ...)``, the rollout carry and, with
    ``freeze_threshold`` > 0, the freeze tracker. A snapshot or version holds
    :func:`_saved_state` of them; its meta the env's state (``collect.env_state``: None for envs whose
    state cannot be captured) and :func:`_env_meta`.

    Args:
        config: the run's hyperparameters. device: where the learner state lives.
        dist: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run.

    Raises:
        EnvError: ``config.env`` cannot be built, or has no Box observations, or actions other than
            Box, Discrete and MultiDiscrete. ConfigError: gSDE exploration on discrete actions.
    """

    name = "ppo"
    data_parallel = True

    def __init__(self, config: PPOConfig, device: torch.device, *, dist=None, resumed: bool = False) -> None:
        self.config, self.device, self.dist = config, device, dist
        self.rank, self.world_size = (0, 1) if dist is None else (dist.rank, dist.world_size)
        ppo_parallel.check_config(config, self.world_size)
        if not resumed:
            check_new_ppo_run(config)
        self.local_envs = config.num_envs // self.world_size  # this rank's envs per seed
        self.run_dir: Path | None = None  # set by open()
        self.total = config.num_iterations
        self.venv = collect.make_vec_env(config.env, config.run.num_seeds * self.local_envs, vectorization=config.vectorization,
                                         workers=config.run.env_workers)
        try:
            set_threads(config.run.torch_threads)
            self.spec = env_spec(self.venv, config.env)
            warn_bounds_without_zero(self.spec, config.env)
            if not resumed:
                check_new_run(config, self.spec)
            self.algo: PPO = make_ppo(config, self.spec, device, dist)
            self.state = self.algo.init()  # its "optim" is Adam's state: the optimizer is part of the learner
            if dist is not None:  # the same init on every rank, by seed; made certain
                dist.broadcast_state(self.state)
            self.carry = collect.reset(self.venv, _member_seeds(config, self.rank, self.world_size))
            self.freeze = init_freeze(self.state["params"]) if config.freeze_threshold > 0 else None
            self._warned_skips = False
            self.leaves = func.leaves(self.state["params"])  # restore and iteration update these in place
            self.env_meta = _env_meta(config, self.venv)
        except BaseException:
            self.venv.close()
            raise

    def step(self, i: int, stopping: bool) -> dict:
        config = self.config
        S, N, T = config.run.num_seeds, self.local_envs, config.num_steps
        it = i - 1  # iterations done before this one
        t0 = time.perf_counter()
        gens = _generators(self.state, self.device)
        timing: dict = {}
        with span("rollout"):  # log_prob=False: iteration computes the batch's log-probabilities in one pass
            batch, self.carry = collect.rollout(self.venv, self.algo.policy(self.state, gens, log_prob=False), self.carry, T,
                                                device=self.device, timing=timing)
            batch = batch.reshape(S, N, T)
        t1 = time.perf_counter()
        frozen = [] if self.freeze is None else [k for k, u in enumerate(self.freeze["frozen_until"].tolist()) if u > it]
        with span("update"):
            self.state, metrics = self.algo.iteration(self.state, batch, gens, frozen=frozen)
        t2 = time.perf_counter()
        if self.freeze is not None:
            frozen_numel = sum(self.leaves[k].numel() for k in frozen)
            metrics["frozen_leaves"] = torch.full((S,), len(frozen))
            metrics["frozen_fraction"] = torch.full((S,), frozen_numel / sum(p.numel() for p in self.leaves))
            if i % config.freeze_window == 0:
                self.freeze = update_freeze(self.freeze, self.state["params"], i, config)
        self._warn_if_nothing_learned(i, metrics)
        ep_return, ep_count = _episode_stats(batch)
        if self.dist is not None:  # over every rank's episodes
            total, ep_count = self.dist.sum(torch.stack([ep_return.nan_to_num(0.0) * ep_count, ep_count])).unbind(0)
            ep_return = torch.where(ep_count > 0, total / ep_count.clamp_min(1), torch.full_like(total, float("nan")))
        return {
            "iteration": i,
            "step": int(self.state["env_steps"]),
            "steps_per_s": S * config.num_envs * T / (t2 - t0),  # of the whole job
            "collect_s": t1 - t0,
            "update_s": t2 - t1,
            "env_wait_s": timing["env_wait_s"],
            "lr": linear_lr(config.lr, it, config.num_iterations, config.anneal_lr),  # the iteration's
            "episode_return": ep_return if S > 1 else ep_return[0],
            "episodes": ep_count if S > 1 else ep_count[0],
            **{k: (v if S > 1 else v[0]) for k, v in metrics.items()},
        }

    def _warn_if_nothing_learned(self, i: int, metrics: TensorDict) -> None:
        """One warning per process when some seed's every update of an iteration was skipped (data,
        loss or gradients not finite): the run goes on, as the skips are counted, but the user hears of
        it (the bug: a run on an env with NaN observations skipped 40 of 40 updates each iteration and
        ended with exit 0 and nothing on stderr)."""
        if self._warned_skips or (self.dist is not None and not self.dist.is_main):
            return
        skipped = metrics["skipped_data"] + metrics["skipped_loss"] + metrics["skipped_gradient"]
        every = (metrics["updates"] > 0) & (skipped >= metrics["updates"])
        if bool(every.any()):
            self._warned_skips = True
            seed = self.config.seeds[int(every.nonzero()[0, 0])]
            kinds = ", ".join(f"{k}={int(metrics[k].sum())}" for k in ("skipped_data", "skipped_loss", "skipped_gradient")
                              if bool(metrics[k].any()))
            warnings.warn(f"iteration {i}: every update of seed {seed} was skipped ({kinds}): a NaN or inf in the "
                          "observations, rewards, loss or gradients; metrics.jsonl counts them (warned once)", stacklevel=2)

    def saved(self) -> tuple[TensorDict, dict]:
        """The snapshot of the single process that steps all the envs: a data-parallel run gathers
        its ranks' carries and env states into that env order (every rank calls this), so its
        snapshot resumes on any number of ranks that divides ``num_envs``, one process included."""
        S = self.config.run.num_seeds
        carry, env_state = self.carry, collect.env_state(self.venv)
        if self.dist is not None and self.dist.active:
            carry = self.dist.all_gather_batch(carry.reshape(S, self.local_envs), dim=1).reshape(-1)
            parts = self.dist.gather_objects(env_state)
            env_state = None if any(p is None for p in parts) else _global_order(parts, S)
        meta = {
            "algo": "ppo",
            "config": dataclasses.asdict(self.config),
            "env_spec": self.spec._asdict(),
            "env_state": env_state,
            "iteration": int(self.state["iteration"]),
            "env_steps": int(self.state["env_steps"]),
            "state_layout": STATE_LAYOUT,
            "world_size": self.world_size,
            **self.env_meta,
        }
        return _saved_state(self.state, carry, self.freeze), meta

    def _own(self, items, members: int):
        """This rank's part of a per-env sequence in the single process's order ([S*N] -> [S*N/W])."""
        n, lo = self.local_envs, self.rank * self.local_envs
        if isinstance(items, TensorDict):
            if self.world_size == 1:
                return items
            items = items.clone(False).auto_batch_size_(batch_dims=1)  # a loaded TensorDict has batch_size []
            return items.reshape(members, self.config.num_envs)[:, lo:lo + n].reshape(-1)
        N = self.config.num_envs
        return [items[m * N + lo + j] for m in range(members) for j in range(n)]

    def restore(self, loaded: TensorDict, meta: dict) -> None:
        S = self.config.run.num_seeds
        with torch.no_grad():  # in place: self.leaves (the freeze mask's) are these
            self.state.update_(loaded["learner"])
        self.carry = self._own(loaded["carry"].to("cpu"), S)
        if self.freeze is not None:
            self.freeze = loaded["freeze"]
        if meta.get("env_state") is not None:
            collect.set_env_state(self.venv, self._own(meta["env_state"], S))
        else:  # an env whose state can't be captured (async vector envs, ...): fresh episodes
            self.carry = collect.reset(self.venv, _member_seeds(self.config, self.rank, self.world_size))
            warnings.warn(
                f"{self.config.env} ({self.config.vectorization} vectorization): env state was not captured, so the "
                "resumed run starts new episodes and is not bit-identical to an uninterrupted one",
                stacklevel=3,
            )

    def upgrade(self, loaded: TensorDict, meta: dict, where: str) -> TensorDict:
        return upgrade_layout_1(loaded, meta, where, self.saved()[0])

    def open(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def evaluate(self) -> dict:
        """:func:`evaluate_state` of the state the run ended with (what its last snapshot or version
        holds) on ``config.run.eval_episodes`` episodes per seed, so eval.json is what ``rlfunc eval
        RUN_DIR`` repeats. (It read the newest snapshot on disk, which after ``rlfunc versions
        rollback`` is the abandoned branch's, not the head version the run continued from.)"""
        return evaluate_state(self.config, self.state, self.config.run.eval_episodes, device=self.device)

    def close(self) -> None:
        self.venv.close()


def evaluate(
    run_dir: str | Path, episodes: int | None = None, *, seed: int | None = None, device: str = "auto",
    snapshot: str | Path | None = None,
) -> dict:
    """Deterministic-action returns of the latest snapshot in ``run_dir`` (or of ``snapshot``, or of
    ``run_dir`` itself when it is a snapshot directory) on ``episodes`` episodes per seed (None: the
    run's ``eval_episodes``), in up to the run's ``env_workers`` worker processes
    (:func:`rlfunc.envs.collect.eval_workers`; the same episodes for any count).

    Returns:
        {"algo", "env", "mean", "std", "episodes", "ci95", "per_seed_mean", "env_steps"}: mean, std and the
        Student-t 95% interval of the mean over all episodes of all seeds (env reward units,
        :func:`rlfunc.core.stats.seeds_summary`), the episodes per seed, the mean per seed (and with
        several seeds "per_seed_ci95" and "pooled_episodes", seeds x episodes), and the snapshot's env
        steps; "nonfinite_episodes" when some returns were NaN or inf (left out of the statistics, a
        warning said so); "success_rate" and its Wilson
        interval "success_ci95" too when the env reports ``info["is_success"]``. Actions are
        deterministic; the episodes' reset seeds (from ``seed`` + EVAL_SEED_OFFSET) are disjoint
        from the training envs'.

    Raises:
        CheckpointError: no readable snapshot in ``run_dir``. ConfigError: ``episodes`` not an integer in [1, MAX_EVAL_ENVS / seeds] (:func:`rlfunc.config.check_episodes`).
    """
    if episodes is not None:
        check_episodes(episodes)
    path = checkpoint.snapshot_to_read(run_dir if snapshot is None else snapshot)
    meta = checkpoint.load_meta(path)
    trained = algorithms.config_from_meta(meta, path, of=PPOConfig)

    def snapshot_learner(spec: EnvSpec, dev: torch.device) -> TensorDict:
        checkpoint.check_env_spec(str(path), meta, spec)
        like = make_ppo(trained, spec, dev).init()  # the trained run's structure, to validate the snapshot
        carry = collect.empty_carry(trained.run.num_seeds * trained.num_envs, spec.obs_dim)
        freeze = init_freeze(like["params"]) if trained.freeze_threshold > 0 else None
        # generators="fresh": evaluation draws no randomness, so a run trained on another device type loads
        return _load_snapshot(path, _saved_state(like, carry, freeze), dev)["learner"]

    return _evaluate(trained, snapshot_learner, episodes, seed, device)


def evaluate_state(
    trained: PPOConfig, state: TensorDict, episodes: int | None = None, *, seed: int | None = None,
    device: str | torch.device = "auto",
) -> dict:
    """:func:`evaluate` of a learner state in memory (``state``: :meth:`PPO.init`'s structure for
    ``trained``; its "params", "obs_stats" and "env_steps" are read) - the final evaluation of a run.

    Raises:
        ConfigError: ``episodes`` not an integer in [1, MAX_EVAL_ENVS / seeds] (:func:`rlfunc.config.check_episodes`).
    """
    if episodes is not None:
        check_episodes(episodes)
    return _evaluate(trained, lambda spec, dev: state, episodes, seed, device)


def _evaluate(trained: PPOConfig, learner_of, episodes: int | None, seed: int | None, device) -> dict:
    """The episodes of :func:`evaluate`; ``learner_of(spec, device)`` gives the learner state."""
    episodes = trained.run.eval_episodes if episodes is None else episodes
    check_episodes(episodes, trained.run.num_seeds)
    dev = resolve_device(device)
    # up to the run's env workers, as many as divide the episodes (the same episodes for any count)
    n = trained.run.num_seeds * episodes
    # one process, whatever the run had (the bug: a run of --nproc 3 kept nproc=3, which 100 episodes do not divide)
    config = replace(trained, num_envs=episodes, minibatch_size=episodes, num_steps=1, device=str(dev), env_workers=0, nproc=1)
    venv = collect.make_vec_env(config.env, n, workers=collect.eval_workers(trained.run.env_workers, n))
    try:
        spec = env_spec(venv, config.env)
        state = learner_of(spec, dev)
        algo = make_ppo(config, spec, dev)
        acting = algo.init()
        with torch.no_grad():
            acting["params"].update_(state["params"])
            acting["obs_stats"].update_(state["obs_stats"])
        base = (config.run.seed if seed is None else seed) + EVAL_SEED_OFFSET
        seeds = [s for i in range(config.run.num_seeds) for s in collect.env_seeds(base + i, episodes)]
        returns, success = collect.episode_outcomes(venv, algo.policy(acting, [], deterministic=True), seeds, device=dev)
    finally:
        venv.close()
    out = {"algo": "ppo", "env": config.env, **seeds_summary(returns, config.run.num_seeds), "env_steps": int(state["env_steps"])}
    return {**out, **success_summary(success)}  # envs that report info["is_success"] (Push-v0, PointReach-v0, ...)

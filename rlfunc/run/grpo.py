"""A whole GRPO or GSPO run (:class:`GRPORun`): grouped rollouts -> update -> log -> snapshot.

``rlfunc.run.train(config, run_dir)`` of a GRPOConfig writes RUN_DIR/config.json, metrics.jsonl (one line per iteration),
checkpoints/ (safetensors snapshots, see rlfunc.run.checkpoint), learning_curve.png and eval.json
(deterministic-action returns on the gymnasium env, as ``rlfunc eval`` gives for PPO runs).

Each iteration's start states come from reset seeds derived from (seed, iteration), each seed of
``--num-seeds`` its own (gymnasium backend: seed k of a batch resets as the run of seed k alone),
or from the torch env's generator, seeded once with the run's first seed for all seeds' envs (torch
backend: the seeds draw their start states from one stream, so seed k of a batch is a run of its
own, not the run of seed k alone).

Resume (:func:`rlfunc.resume`) is exact on CPU: 2N iterations in
one go equal N, stop, N more, parameter for parameter. A snapshot holds the learner state (its
action-sampling generators included; its Adam state, ``state["optim"]``, as the snapshot's "optim":
:func:`rlfunc.run.resume.learner_entries`) and, on the torch backend, the env's generator and state; the
gymnasium backend needs no env state, since every iteration resets every env with seeds derived from
(seed, iteration). Snapshots written before the learner state owned its optimizer (state layout 1:
torch.optim's state) are converted on load (:func:`rlfunc.run.resume.upgrade_layout_1`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from rlfunc.algos import registry as algorithms
from rlfunc.algos.grpo import GRPOConfig, check_loss_fields, make_grpo
from rlfunc.algos.ppo import EnvSpec
from rlfunc.core.stats import seeds_summary, success_summary
from rlfunc.device import resolve_device, set_threads, span
from rlfunc.envs import collect
from rlfunc.envs import registry
from rlfunc.envs.grouped import grouped_rollout_gym, grouped_rollout_torchrl
from rlfunc.config import check_episodes, check_eval_seed
from rlfunc.errors import EnvError
from rlfunc.optim import linear_lr
from rlfunc.run import checkpoint
from rlfunc.run import Run
from rlfunc.run.ppo import EVAL_SEED_OFFSET, _generators, env_spec
from rlfunc.run.resume import learner_entries, state_layout, state_meta, upgrade_layout_1


def group_seeds(seed: int, iteration: int, count: int) -> list[int]:
    """``count`` reset seeds for one iteration, distinct across iterations (numpy SeedSequence)."""
    return [int(s) for s in np.random.SeedSequence([seed, iteration]).generate_state(count)]


class RolloutEnv(NamedTuple):
    """The rollouts of a run and what a snapshot must hold of their env.

    rollout(policy, iteration) -> batch [S, n, G, T]; close(); capture() -> TensorDict of the env's
    state ("rng" uint8 generator state, "state" the torch env's state) or None when nothing is
    carried from one iteration to the next (gymnasium: reset seeds from (seed, iteration));
    restore(saved) puts a captured state back.
    """

    rollout: Callable[..., TensorDict]
    close: Callable[[], None]
    capture: Callable[[], TensorDict | None]
    restore: Callable[[TensorDict], None]


def _rollout_env(config: GRPOConfig, device: torch.device, dist=None) -> RolloutEnv:
    """The run's envs; data-parallel (``dist`` of W > 1 ranks), this rank's groups r*n/W .. (r+1)*n/W - 1
    of each seed's n: the torch-batched env's split (one seed: :meth:`GRPOConfig.check_data_parallel`),
    whose rollouts last as long as the longest rank's, or the gymnasium envs reset with those groups'
    seeds. A capture holds the single process's env state (every rank's rows, gathered)."""
    S, n, G, T = config.run.num_seeds, config.num_groups, config.group_size, config.max_episode_steps
    W, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)
    N, mine = S * n * G, n // W  # the single process's envs, this rank's groups per seed
    if config.use_torch_env:
        build = registry.torch_builder(config.env)
        if W == 1:
            env, longest = build(N, device=device, seed=config.run.seed), None
        else:
            env = build(N // W, device=device, seed=config.run.seed, split=(rank, W), any_done_of_split=dist.any_rank)
            longest = lambda steps: max(dist.gather_objects(steps))  # noqa: E731

        def rollout(policy, iteration: int) -> TensorDict:
            return grouped_rollout_torchrl(env, policy, G, T, longest).reshape(S, mine, G, -1)

        def capture() -> TensorDict:
            state = env.state.clone() if W == 1 else dist.all_gather_batch(env.state, dim=0)
            return TensorDict({"rng": env.rng_state(), "state": state}, batch_size=[])

        def restore(saved: TensorDict) -> None:
            env.set_rng_state(saved["rng"])
            state = TensorDict(saved["state"].to_dict(), batch_size=[N])  # the single process's envs
            env.set_state(state[rank * (N // W) : (rank + 1) * (N // W)])  # this rank's rows (all of them at W = 1)

        return RolloutEnv(rollout, lambda: None, capture, restore)
    venv = collect.make_vec_env(config.env, N // W, workers=config.run.env_workers)  # each iteration resets them: no state to carry

    def rollout(policy, iteration: int) -> TensorDict:
        # each seed's groups from its own seed, so that seed k of --num-seeds resets as the run of seed k alone
        # (the bug: all S x n from the first seed's stream, so seed k's episodes were not that run's)
        seeds = [group_seeds(seed, iteration, n) for seed in config.seeds]
        seeds = [seeds[s][rank * mine + j] for s in range(S) for j in range(mine)]  # this rank's groups of each seed
        return grouped_rollout_gym(venv, policy, seeds, G, T, device=device).reshape(S, mine, G, T)

    return RolloutEnv(rollout, venv.close, lambda: None, lambda saved: None)


def _rollout_fn(config: GRPOConfig, device: torch.device):
    """(rollout(policy, iteration) -> batch [S, n, G, T], close())."""
    env = _rollout_env(config, device)
    return env.rollout, env.close


def _spec(env_id: str, algo: str = "grpo") -> EnvSpec:
    """The env's spec for ``algo`` ("grpo" or "gspo", named in the errors): Box observations and actions."""
    venv = collect.make_vec_env(env_id, 1)
    try:
        if not isinstance(venv.single_observation_space, gym.spaces.Box):  # PPO's message offered Discrete actions
            raise EnvError(f"env={env_id!r}: {algo} needs Box observations and Box actions; got "
                           f"{type(venv.single_observation_space).__name__} observations (a gymnasium wrapper such as "
                           "FlattenObservation, registered as your own env id, converts others)")
        spec = env_spec(venv, env_id, algo)
        if spec.action_kind != "box":  # grpo's actor is PPO's Gaussian one
            raise EnvError(f"env={env_id!r}: {algo} needs Box actions; got {type(venv.single_action_space).__name__} actions")
        return spec
    finally:
        venv.close()


LAYOUT_1_COMMIT = "d98cef6"  # the last rlfunc that wrote grpo/gspo snapshots of state layout 1 (torch.optim's state)


class GRPORun(Run):
    """A grpo/gspo run as :func:`rlfunc.run.run_loop` drives it. A snapshot holds the learner
    state (its Adam state as "optim", :func:`rlfunc.run.resume.learner_entries`) and, on the torch
    backend, the env's generator and state ("env")."""

    data_parallel = True
    requires_format = True  # its snapshots from before it was resumable lack meta "resume_format"

    def __init__(self, config: GRPOConfig, device: torch.device, *, dist=None, resumed: bool = False) -> None:
        collect.check_env_id(config.env)
        if not resumed:  # a new run from Python (train(config, ...)), as preset() and the CLI do: the other
            check_loss_fields(config)  # loss's settings were recorded and unread; a saved run still resumes
        set_threads(config.run.torch_threads)
        self.config, self.device, self.name = config, device, config.loss
        self.world_size = 1 if dist is None else dist.world_size
        self.spec = _spec(config.env, config.loss)
        self.algo = make_grpo(config, self.spec, device, dist)
        self.state = self.algo.init()  # its "optim" is Adam's state: the optimizer is part of the learner
        if dist is not None:  # the same init on every rank, by seed; made certain
            dist.broadcast_state(self.state)
        self.total = config.num_iterations
        self.env = _rollout_env(config, device, dist)

    def step(self, i: int, stopping: bool) -> dict:
        config, S = self.config, self.config.run.num_seeds
        t0 = time.perf_counter()
        gens = _generators(self.state, self.device)
        with span("rollout"):
            batch = self.env.rollout(self.algo.policy(self.state, gens), i - 1)
        t1 = time.perf_counter()
        with span("update"):
            self.state, metrics = self.algo.iteration(self.state, batch, gens)  # at the lr of state["iteration"] = i - 1
        t2 = time.perf_counter()
        steps = batch.batch_size[1] * batch.batch_size[2] * batch.batch_size[3] * self.world_size  # every rank's
        return {
            "iteration": i, "step": int(self.state["env_steps"]),
            "steps_per_s": S * steps / (t2 - t0), "collect_s": t1 - t0, "update_s": t2 - t1,
            "lr": linear_lr(config.lr, i - 1, config.num_iterations, config.anneal_lr),  # the iteration's
            **{k: (v if S > 1 else v[0]) for k, v in metrics.items()},
        }

    def saved(self) -> tuple[TensorDict, dict]:
        snapshot = TensorDict(learner_entries(self.state), batch_size=[])
        captured = self.env.capture()
        if captured is not None:
            snapshot["env"] = captured
        meta = {
            "algo": self.config.loss,
            "config": dataclasses.asdict(self.config),
            "env_spec": self.spec._asdict(),
            "iteration": int(self.state["iteration"]),
            "env_steps": int(self.state["env_steps"]),
            "world_size": self.world_size,
            **state_meta(),
        }
        return snapshot, meta

    def restore(self, loaded: TensorDict, meta: dict) -> None:
        with torch.no_grad():  # in place: the policy holds these leaves
            self.state.exclude("optim").update_(loaded["learner"])
            self.state["optim"].update_(loaded["optim"])
        if "env" in loaded.keys():
            self.env.restore(loaded["env"])

    def upgrade(self, loaded: TensorDict, meta: dict, where: str) -> TensorDict:
        return upgrade_layout_1(loaded, meta, where, self.saved()[0], algo="grpo/gspo", commit=LAYOUT_1_COMMIT)

    def evaluate(self) -> dict:
        return {"algo": self.config.loss,
                **evaluate_policy(self.config, self.state, self.spec, self.device, self.config.run.eval_episodes, self.config.run.seed)}

    def close(self) -> None:
        self.env.close()


def evaluate_policy(config: GRPOConfig, state: TensorDict, spec: EnvSpec, device: torch.device, episodes: int, seed: int) -> dict:
    """Deterministic-action returns of ``state``'s actor on ``episodes`` gymnasium envs per seed (in up to
    ``config.run.env_workers`` worker processes, :func:`rlfunc.envs.collect.eval_workers`).

    Returns:
        {"env", :func:`rlfunc.core.stats.seeds_summary`'s keys ("mean", "std", "ci95" over all episodes
        of all seeds, "episodes" per seed, "per_seed_mean" ...), "env_steps"} (env reward units);
        "success_rate" and "success_ci95" too for envs that put "is_success" in their info.
    """
    algo = make_grpo(config, spec, device)
    n = config.run.num_seeds * episodes
    venv = collect.make_vec_env(config.env, n, workers=collect.eval_workers(config.run.env_workers, n))
    try:
        seeds = [s for i in range(config.run.num_seeds) for s in collect.env_seeds(seed + EVAL_SEED_OFFSET + i, episodes)]
        returns, success = collect.episode_outcomes(venv, algo.policy(state, [], deterministic=True), seeds, device=device)
    finally:
        venv.close()
    return {"env": config.env, **seeds_summary(returns, config.run.num_seeds), "env_steps": int(state["env_steps"]),
            **success_summary(success)}


def evaluate_run(run_dir: str | Path, episodes: int | None = None, *, seed: int | None = None, device: str = "auto") -> dict:
    """:func:`evaluate_policy` of the latest snapshot of a grpo/gspo run (or of a snapshot dir).

    Generator states saved on another device type are not read (evaluation draws nothing from them).

    Raises:
        CheckpointError: no snapshot, not a grpo/gspo one, or a learner state that does not match its
            config (a missing, extra or reshaped key). ConfigError: ``episodes`` not an integer in [1, MAX_EVAL_ENVS / seeds] (:func:`rlfunc.config.check_episodes`),
            or ``seed`` outside [0, 2**31).
    """
    snap = checkpoint.snapshot_to_read(run_dir)
    meta = checkpoint.load_meta(snap)
    config = algorithms.config_from_meta(meta, snap, of=GRPOConfig)
    state_layout(str(snap), meta, "grpo/gspo")  # layout 1 and 2 keep the same "learner" (the optimizer aside)
    episodes = config.run.eval_episodes if episodes is None else episodes
    check_episodes(episodes, config.run.num_seeds)
    check_eval_seed(seed)
    dev = resolve_device(device)
    spec = _spec(config.env, config.loss)
    checkpoint.check_env_spec(str(snap), meta, spec)
    like = checkpoint.load_learner_for_eval(snap, make_grpo(config, spec, dev).init().exclude("optim"), dev)
    return {"algo": meta["algo"], **evaluate_policy(config, like, spec, dev, episodes, config.run.seed if seed is None else seed)}

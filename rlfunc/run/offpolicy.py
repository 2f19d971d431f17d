"""Whole runs of the replay-buffer algorithms over gymnasium vector envs (sac, td3): :class:`OffPolicyRun`,
driven by the one run loop (:mod:`rlfunc.run.loop`).

An iteration is ``num_steps`` steps of the ``num_envs`` envs; after each step its transitions go
into a TorchRL replay buffer on the learner's device and, once ``learning_starts`` env steps are
done, ``updates_per_step * num_envs`` gradient steps follow (before that, actions are uniform in the
action box). Each iteration writes one metrics line: the mean return of the episodes that ended in
it, the means of the algorithm's metrics over its gradient steps (losses, Q values, alpha and the
entropy estimate -log pi for sac), steps per second.

A snapshot holds {"learner": the learner state (its update chains' states, its generator),
"carry": the rollout carry (observations, running episode statistics), "buffer": the buffer's filled
rows}; meta.json the env's state (``collect.env_state``: RNG, time limit, physics), the buffer's
length and writer cursor (:func:`rlfunc.run.resume.buffer_snapshot`), "resume_format" and
"state_layout". Resume is therefore exact on CPU: N iterations, stop, resume to 2N give the tensors of
2N in one go, buffer included (``checkpoint_buffer=False``: smaller snapshots, an empty buffer on
resume, with a warning).

Data-parallel (``rlfunc train sac|td3 --nproc W``, or under torchrun): each rank steps its N/W envs
and all-gathers every env step's transitions (with the episode flags and sums) into the one replay
buffer every rank holds, in the single process's env order (why: :mod:`rlfunc.algos.offpolicy`), so
the metrics (episode returns of every rank's envs) and the update are the single process's; rank 0
alone writes, and a snapshot holds the carry and env states of all N envs in that order, so it
resumes on any W dividing ``num_envs`` and ``batch_size``, one process included.

The final evaluation (eval.json, and ``rlfunc eval RUN_DIR``): deterministic actions (sac: tanh of
the mean; td3: the actor's output) on ``eval_episodes`` episodes whose reset seeds derive from
``seed + EVAL_SEED_OFFSET``, disjoint from training's; :func:`rlfunc.core.stats.summarize_returns`.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from rlfunc.algos import data_parallel
from rlfunc.algos import registry as algorithms
from rlfunc.algos.offpolicy import OffPolicy, StepMetrics, finite_transitions, uniform_policy
from rlfunc.algos.ppo import EnvSpec
from rlfunc.algos.sac import SACConfig, make_sac
from rlfunc.algos.td3 import TD3Config, make_td3
from rlfunc.core.stats import success_summary, summarize_returns
from rlfunc.device import resolve_device, set_threads, span
from rlfunc.envs import collect
from rlfunc.envs.async_collect import AsyncCollector, restart_seed
from rlfunc.config import check_episodes, check_eval_seed
from rlfunc.errors import EnvError
from rlfunc.run import Run, checkpoint
from rlfunc.run.ppo import EVAL_SEED_OFFSET
from rlfunc.run.resume import ResumePoint, buffer_snapshot, restore_buffer, set_generator_state, state_meta

# the algorithm each config type builds (the registry entry names the config type)
MAKERS = {SACConfig: make_sac, TD3Config: make_td3}
# what a data-parallel run gathers of each env step: what the buffer and the episode statistics read
GATHERED = ("observation", "action", ("next", "observation"), ("next", "reward"), ("next", "terminated"), ("next", "done"),
            ("next", "episode_reward"))


def env_spec(venv: gym.vector.VectorEnv, env_id: str | None = None) -> EnvSpec:
    """Sizes and bounds of a vector env; EnvError (naming ``env_id``) unless its observations are a
    Box and its actions a floating Box with finite bounds."""
    obs_space, act_space = venv.single_observation_space, venv.single_action_space
    env = "" if env_id is None else f"env={env_id!r}: "
    if not isinstance(obs_space, gym.spaces.Box) or not isinstance(act_space, gym.spaces.Box):
        raise EnvError(f"{env}sac and td3 need Box observations and actions; got {type(obs_space).__name__} observations "
                       f"and {type(act_space).__name__} actions")
    if not np.issubdtype(act_space.dtype, np.floating):  # the bug: fractional float32 actions reached an int64 Box
        raise EnvError(f"{env}Box actions of dtype {act_space.dtype}: sac and td3 act in real numbers; expected a floating Box")
    if not (np.isfinite(act_space.low).all() and np.isfinite(act_space.high).all()):
        raise EnvError(f"{env}sac and td3 scale their actions to the env's bounds; this env's are not finite "
                       f"(low={act_space.low.tolist()}, high={act_space.high.tolist()})")
    return EnvSpec(int(np.prod(obs_space.shape)), int(np.prod(act_space.shape)),
                   act_space.low.astype(float).reshape(-1).tolist(), act_space.high.astype(float).reshape(-1).tolist())


def evaluate_policy(algo: OffPolicy, state: TensorDict, config, episodes: int, seed: int, device: torch.device) -> dict:
    """Deterministic-action returns of ``state``'s actor on ``episodes`` episodes of ``config.env``
    (reset seeds from ``seed + EVAL_SEED_OFFSET``; in up to ``config.run.env_workers`` worker
    processes, :func:`rlfunc.envs.collect.eval_workers`): {"env", "mean", "std", "episodes", "ci95",
    "env_steps"[, "success_rate", "success_ci95"]}."""
    venv = collect.make_vec_env(config.env, episodes, workers=collect.eval_workers(config.run.env_workers, episodes))
    try:
        seeds = collect.env_seeds(seed + EVAL_SEED_OFFSET, episodes)
        returns, success = collect.episode_outcomes(venv, algo.policy(state, None, deterministic=True), seeds, device=device)
    finally:
        venv.close()
    return {"env": config.env, **summarize_returns(returns, nonfinite="count"), "episodes": episodes, "env_steps": int(state["env_steps"]),
            **success_summary(success)}


class ActingPolicy:
    """The acting policy of an asynchronous collector (:class:`rlfunc.envs.async_collect.AsyncCollector`'s
    ``make_policy``): ``config``'s algorithm built on the CPU in the worker, acting with the actor's
    weights it is given (``{"actor": ...}``, the learner's ``state["params"].select("actor")``), uniform
    actions while ``warm``. Picklable (a config and an EnvSpec)."""

    def __init__(self, config, spec: EnvSpec) -> None:
        self.config, self.spec, self.algo = config, spec, None

    def __getstate__(self) -> dict:
        return {"config": self.config, "spec": self.spec, "algo": None}

    def __call__(self, weights: TensorDict, generator: torch.Generator, warm: bool):
        if self.algo is None:
            self.algo = MAKERS[type(self.config)](self.config, self.spec, torch.device("cpu"))
        if warm:
            return uniform_policy(self.algo.scale, generator)
        return self.algo.policy(TensorDict({"params": weights}, batch_size=[]), generator)


class OffPolicyRun(Run):
    """A sac or td3 run (``name``) as :func:`rlfunc.run.run_loop` drives it; see the module docstring.

    Raises:
        EnvError: ``config.env`` cannot be built, or has no Box observations and bounded Box actions.
    """

    variable = ("buffer",)  # its rows depend on how far the run got; restore checks them

    data_parallel = True
    requires_format = True  # its snapshots from before it was resumable lack meta "resume_format"

    def __init__(self, config, device: torch.device, *, dist=None, resumed: bool = False) -> None:
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        name = algorithms.name_of(config)
        self.config, self.device, self.name, self.dist = config, device, name, dist
        self.rank, self.world_size = (0, 1) if dist is None else (dist.rank, dist.world_size)
        data_parallel.check_divides(self.world_size, num_envs=config.num_envs, batch_size=config.batch_size)
        self.local_envs = config.num_envs // self.world_size  # this rank's envs: rank * local_envs ...
        self.total = config.num_iterations()
        if config.learning_starts >= self.total * config.num_envs * config.num_steps:
            warnings.warn(f"{name}: learning_starts={config.learning_starts} covers the whole budget (total_steps={config.total_steps}), "
                          "so the run takes no gradient step; lower --learning-starts or raise --total-steps", stacklevel=2)
        self.venv = collect.make_vec_env(config.env, self.local_envs, workers=config.run.env_workers)
        try:
            set_threads(config.run.torch_threads)
            self.spec = env_spec(self.venv, config.env)
            self.algo = MAKERS[type(config)](config, self.spec, device, dist)
            self.state = self.algo.init()
            if dist is not None:  # the same init on every rank, by seed; made certain
                dist.broadcast_state(self.state)
            self.gen = torch.Generator(device=device).manual_seed(config.run.seed)  # its state: state["rng"]
            self.seeds = collect.env_seeds(config.run.seed, config.num_envs)  # every rank's envs, in the single process's order
            self.carry = collect.reset(self.venv, self._own(self.seeds))
            self.buffer = ReplayBuffer(storage=LazyTensorStorage(config.buffer_size, device=device), batch_size=config.batch_size)
            self.collector: AsyncCollector | None = None  # async_collection: started by the first step
            self.publishes = 0
            # transitions the buffer must hold before an update: 0, but after a resume whose snapshot had no buffer
            # (checkpoint_buffer=False) its warm-up's worth (it updated at once on 1 transition, 100 times over)
            self.refill = 0
        except BaseException:
            self.venv.close()
            raise

    def step(self, i: int, stopping: bool) -> dict:
        if self.config.async_collection:
            return self._async_step(i)
        config, state, N = self.config, self.state, self.config.num_envs
        steps = int(state["env_steps"])
        per_step = config.updates_per_step * N
        acting = self.algo.policy(state, self.gen)
        warm = uniform_policy(self.algo.scale, self.gen, data_parallel.own_rows(self.rank, self.world_size))
        gather = self.dist is not None and self.dist.active
        returns, metrics, skipped = [], StepMetrics(), 0
        collect_s = update_s = 0.0
        for _ in range(config.num_steps):
            t0 = time.perf_counter()
            with span("rollout"):
                batch, self.carry = collect.rollout(self.venv, warm if steps < config.learning_starts else acting, self.carry, 1,
                                                    device=self.device)
                if gather:  # every rank's envs [N, 1] in the single process's order: every rank holds its buffer
                    batch = self.dist.all_gather_batch(batch.select(*GATHERED), dim=0)
                kept, dropped = finite_transitions(batch, self.algo.scale)
                if kept.shape[0]:
                    self.buffer.extend(kept)
                skipped += dropped
            steps += N
            done = batch["next", "done"]
            if bool(done.any()):
                returns.extend(batch["next", "episode_reward"][done].tolist())
            t1 = time.perf_counter()
            collect_s += t1 - t0
            if steps >= config.learning_starts and len(self.buffer) >= max(1, self.refill):  # (empty: every transition so far not finite)
                with span("update"):
                    state, m = self.algo.iteration(state, self.buffer, self.gen, per_step, into=metrics)  # the line's steps
                metrics.add(m)  # compile_s, once
                update_s += time.perf_counter() - t1
        return self._record(i, state, steps, returns, metrics, collect_s, update_s, skipped_data=skipped)

    def _record(self, i: int, state: TensorDict, steps: int, returns: list, metrics: StepMetrics, collect_s: float,
                update_s: float, **extra: float) -> dict:
        """The iteration's end: the counters and generator state into ``state`` (the run's state
        from now on), and its metrics line: the mean return of the episodes that ended, each
        metric's mean over the gradient steps that gave it a finite value, the skipped steps' counts
        (:class:`~rlfunc.algos.offpolicy.StepMetrics`; one host read per metric), ``extra``. An episode
        whose return is not finite (a NaN or inf reward) is in neither "episodes" nor "episode_return"."""
        state["env_steps"] = torch.tensor(steps, device=self.device)
        state["iteration"] = state["iteration"] + 1
        state["rng"] = self.gen.get_state()
        self.state = state
        finite = [r for r in returns if math.isfinite(r)]  # as PPO's line: a non-finite return counts nowhere
        record = {"iteration": i, "step": steps, "episodes": len(finite),
                  "steps_per_s": self.config.num_steps * self.config.num_envs / max(collect_s + update_s, 1e-9),
                  "collect_s": collect_s, "update_s": update_s, "updates": int(state["updates"]), **extra}
        if finite:
            record["episode_return"] = sum(finite) / len(finite)
        record.update({key: float(value) for key, value in metrics.result().items()})
        return record

    def _async_step(self, i: int) -> dict:
        """One iteration with the envs stepped by the asynchronous collector: ``num_steps / async_steps``
        times, the next item's transitions (``async_steps`` vector-env steps) from the queue into the
        buffer, then their gradient steps (:meth:`step`'s count, taken together); the actor's weights
        are published every ``sync_weights_every`` gradient steps.
        ``collect_s`` is the time spent waiting for the worker's transitions; "policy_lag" the mean
        number of publishes the acting weights were behind the learner's latest."""
        config, state, N = self.config, self.state, self.config.num_envs
        steps = int(state["env_steps"])
        if self.collector is None:  # a resumed run starts new episodes (the worker's are not in snapshots)
            it = int(state["iteration"])
            self.collector = AsyncCollector(
                config.env, N, self.seeds if it == 0 else collect.env_seeds(restart_seed(config.run.seed, it), N),
                ActingPolicy(config, self.spec), state["params"].select("actor"), warm_steps=config.learning_starts,
                start_steps=steps, seed=restart_seed(config.run.seed, it + 1), queue_size=config.async_queue,
                steps_per_item=config.async_steps)
            self.publishes, self.since_publish = 0, 0
        K = config.async_steps
        returns, metrics, lag, skipped = [], StepMetrics(), 0, 0
        collect_s = update_s = 0.0
        for _ in range(config.num_steps // K):
            t0 = time.perf_counter()
            with span("env_wait"):
                batch, version = self.collector.next()
            with span("rollout"):
                kept, dropped = finite_transitions(batch.to(self.device), self.algo.scale)
                if kept.shape[0]:
                    self.buffer.extend(kept)
                skipped += dropped
            lag += self.publishes - version
            steps += N * K
            done = batch["next", "done"]
            if bool(done.any()):
                returns.extend(batch["next", "episode_reward"][done].tolist())
            t1 = time.perf_counter()
            collect_s += t1 - t0
            # the item's vector-env steps that end at >= learning_starts env steps (all but those of an item that
            # straddles learning_starts): the in-process loop's gradient steps, taken together
            first = max(1, -(-(config.learning_starts - (steps - N * K)) // N))
            updating = config.updates_per_step * N * max(0, K - first + 1)
            if updating and len(self.buffer) >= max(1, self.refill):
                with span("update"):
                    state, m = self.algo.iteration(state, self.buffer, self.gen, updating, into=metrics)
                self.since_publish += updating
                if self.since_publish >= config.sync_weights_every:
                    self.publishes = self.collector.publish(state["params"].select("actor"))
                    self.since_publish = 0
                metrics.add(m)
                update_s += time.perf_counter() - t1
        return self._record(i, state, steps, returns, metrics, collect_s, update_s, policy_lag=lag / (config.num_steps // K),
                            skipped_data=skipped)

    def _own(self, items):
        """This rank's part of a per-env sequence or TensorDict in the single process's order ([N] -> [N/W])."""
        if self.world_size == 1:
            return items
        lo, n = self.rank * self.local_envs, self.local_envs
        if isinstance(items, TensorDict):
            return items.clone(False).auto_batch_size_(batch_dims=1)[lo:lo + n]  # a loaded TensorDict has batch_size []
        return list(items[lo:lo + n])

    def saved(self) -> tuple[TensorDict, dict]:
        """The snapshot of the single process that steps all the envs: a data-parallel run gathers its
        ranks' carries and env states into that env order (every rank calls this), so it resumes on
        any number of ranks that divides ``num_envs``, one process included."""
        rows, buffer_meta = buffer_snapshot(self.buffer, self.config.checkpoint_buffer)
        carry = self.carry
        env_state = None if self.config.async_collection else collect.env_state(self.venv)  # the collector's envs are not here
        if self.dist is not None and self.dist.active:
            carry = self.dist.all_gather_batch(carry, dim=0)
            parts = self.dist.gather_objects(env_state)
            env_state = None if any(p is None for p in parts) else [e for part in parts for e in part]
        tensors = TensorDict({"learner": self.state, "carry": carry}, batch_size=[])
        for key, value in rows.items():
            tensors[key] = value
        meta = {"algo": self.name, "config": dataclasses.asdict(self.config), "env_spec": self.spec._asdict(),
                "env_state": env_state, "env_seeds": self.seeds,
                "iteration": int(self.state["iteration"]), "env_steps": int(self.state["env_steps"]),
                "world_size": self.world_size, **state_meta(), **buffer_meta}
        return tensors, meta

    def restore(self, loaded: TensorDict, meta: dict) -> None:
        with torch.no_grad():  # in place: the policies and the update chains hold these leaves
            self.state.update_(loaded["learner"])
        set_generator_state(self.gen, self.state["rng"])
        self.carry = self._own(loaded["carry"].to("cpu"))
        point = ResumePoint(f"the {self.name} snapshot of iteration {meta.get('iteration')}", meta, self.config)
        if self.config.async_collection:
            warnings.warn(f"{point.snapshot}: async_collection: the collector's episodes are not in snapshots, so the resumed "
                          "run starts new episodes", stacklevel=3)
        elif meta.get("env_state") is not None:
            collect.set_env_state(self.venv, self._own(meta["env_state"]))
        else:
            self.carry = collect.reset(self.venv, self._own(self.seeds))
            warnings.warn(f"{point.snapshot}: holds no env state, so the resumed run starts new episodes and is not "
                          "identical to an uninterrupted one", stacklevel=3)
        refill = max(1, min(self.config.learning_starts, self.config.buffer_size))
        self.refill = 0 if restore_buffer(self.buffer, loaded, point, refill) else refill

    def evaluate(self) -> dict:
        return {"algo": self.name, **evaluate_policy(self.algo, self.state, self.config, self.config.run.eval_episodes, self.config.run.seed,
                                                     self.device)}

    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()
        self.venv.close()


# --------------------------------------------------------------------------------------- the calls


def evaluate(run_dir: str | Path, episodes: int | None = None, *, seed: int | None = None, device: str = "auto") -> dict:
    """:func:`evaluate_policy` of the latest snapshot of ``run_dir`` (or of ``run_dir`` itself, a snapshot
    directory) on ``episodes`` episodes (None: the run's ``eval_episodes``), reset seeds from ``seed``
    (None: the run's) + EVAL_SEED_OFFSET; the default call repeats the run's eval.json.

    Raises:
        CheckpointError: no snapshot, not a sac / td3 one, or one that does not fit its config.
        ConfigError: ``episodes`` not an integer in [1, MAX_EVAL_ENVS / seeds] (:func:`rlfunc.config.check_episodes`) or ``seed`` outside [0, 2**31).
    """
    path = checkpoint.snapshot_to_read(run_dir)
    meta = checkpoint.load_meta(path)
    config = algorithms.config_from_meta(meta, path, of="offpolicy")
    episodes = config.run.eval_episodes if episodes is None else episodes
    seed = config.run.seed if seed is None else seed
    check_episodes(episodes)
    check_eval_seed(seed)
    dev = resolve_device(device)
    venv = collect.make_vec_env(config.env, 1)
    try:
        spec = env_spec(venv, config.env)
    finally:
        venv.close()
    checkpoint.check_env_spec(str(path), meta, spec)
    algo = MAKERS[type(config)](config, spec, dev)
    state = checkpoint.load_learner_for_eval(path, algo.init(), dev)
    return {"algo": meta["algo"], **evaluate_policy(algo, state, config, episodes, seed, dev)}

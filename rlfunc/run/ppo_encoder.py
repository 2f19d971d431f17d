"""A whole encoder-PPO run (:mod:`rlfunc.algos.ppo_encoder`) on the one run loop (:mod:`rlfunc.run.loop`):
collect -> update -> log -> snapshot / version -> evaluate.

``rlfunc.run.train(config, run_dir)`` of a PPOEncoderConfig (an :class:`EncoderRun`) writes RUN_DIR/config.json, metrics.jsonl (one line per
iteration: losses, episode_return (and success_rate, for envs that report ``is_success``) of the
episodes that ended, steps/s, collect and update seconds), checkpoints/ (safetensors snapshots,
``algo="ppo-encoder"``), versions/ every ``version_every`` iterations (:mod:`rlfunc.run.versions`:
list, diff, rollback), learning_curve.png and eval.json. The envs are one
:class:`rlfunc.envs.chunk.GymChunkEnv` (``act_steps=1``) kept running across iterations.

Under torchrun (``rlfunc train ppo --env ENV --nproc W``) the run is data-parallel: rank r steps
envs r*N/W .. (r+1)*N/W - 1 of the single process's N (GymChunkEnv's ``split``: the same reset
seeds), the update is the single process's (:func:`rlfunc.algos.ppo_encoder.make_ppo_encoder`), rank
0 alone writes, and a snapshot holds every rank's carry and episode state in the single process's
env order (meta "world_size" says how many ranks wrote it), so it resumes on any W dividing N.

Resume (:func:`rlfunc.resume`) continues the latest
snapshot or the current branch's head version (:func:`rlfunc.run.resume_source`). A snapshot holds
the learner state (its action / minibatch generator "rng" included; its Adam state,
``state["optim"]``, as the snapshot's "optim": :func:`rlfunc.run.resume.learner_entries`), the carry
(the observations the next step acts on) and, in meta.json, the envs' reset-seed generator and their
episodes (:meth:`~rlfunc.envs.chunk.GymChunkEnv.episode_state`: each gymnasium env's RNG, time-limit
counter and MuJoCo state, the running returns), so on CPU 2N iterations in one go equal N, stop, N
more, tensor for tensor. Envs whose state cannot be captured (neither MuJoCo nor a classic-control
``state`` array) resume with new episodes, with a warning. Snapshots written before the learner
state owned its optimizer (state layout 1: torch.optim's state, up to commit
:data:`LAYOUT_1_COMMIT`) are converted on load (:meth:`EncoderRun.upgrade`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path

import torch
from tensordict import TensorDict

from rlfunc.algos import registry as algorithms
from rlfunc.algos.diffusion_actor import EnvInfo, check_env, dones_of_split, env_info
from rlfunc.algos.ppo_encoder import ALGO, PPOEncoderConfig, check_dict_info, evaluate, make_ppo_encoder
from rlfunc.core import func
from rlfunc.device import resolve_device, set_threads, span
from rlfunc.envs.chunk import GymChunkEnv
from rlfunc.envs.collect import reports_success
from rlfunc.config import check_episodes, check_eval_seed, check_new_ppo_run
from rlfunc.errors import CheckpointError, EnvError
from rlfunc.optim import linear_lr
from rlfunc.optim.amp import precision, without_loss_scale
from rlfunc.run import checkpoint
from rlfunc.run.resume import (ResumePoint, env_rng_snapshot, learner_entries, restore_env_rng, set_generator_state, state_layout,
                           state_meta, upgrade_layout_1)
from rlfunc.core.stats import success_interval, summarize_returns
from rlfunc.run import Run
from rlfunc.run.ppo import EVAL_SEED_OFFSET


def is_dict_env(env_id: str) -> bool:
    """Whether the registered gymnasium env ``env_id`` has a Dict observation (one env is made and
    closed; EnvError in one line when it cannot be built)."""
    import gymnasium as gym

    from rlfunc.envs.chunk import check_chunk_env_id
    from rlfunc.envs.collect import make_env

    check_chunk_env_id(env_id)
    env = make_env(env_id)
    try:
        return isinstance(env.observation_space, gym.spaces.Dict)
    finally:
        env.close()


LAYOUT_1_COMMIT = "aaf3139"  # the last rlfunc that wrote ppo-encoder snapshots of state layout 1 (torch.optim's state)


def _carry_keys(info: EnvInfo) -> tuple[str, ...]:
    """What the rollout carries from one iteration to the next (its last root TensorDict)."""
    return (*info.obs_keys, "done", "terminated", "truncated")


def _torch_optim_order(count: int) -> list[int]:
    """The trainable-leaf index of each parameter of the layout-1 code's torch.optim.Adam: it was built
    over TensorDict({"0": leaf_0, "1": leaf_1, ...}), whose leaves come in string order of the keys."""
    return [int(k) for k in sorted((str(i) for i in range(count)), key=str)]


class EncoderRun(Run):
    """An encoder-PPO run as :func:`rlfunc.run.run_loop` drives it: the learner state (its Adam state
    included), the envs (kept running across iterations), the carry they act on next and the
    action / minibatch generator. A snapshot holds {"learner", "optim", "carry"} and, in meta, the
    envs' RNG and episodes.

    Data-parallel (``dist`` of W > 1 ranks, ``rlfunc train ppo --env ENV --nproc W``): rank r steps
    envs r*N/W .. (r+1)*N/W - 1 of the single process's N (a split GymChunkEnv: the same reset seeds)
    and the update is the single process's (:func:`~rlfunc.algos.ppo_encoder.make_ppo_encoder`); a
    snapshot gathers every rank's carry and episode state into the single process's env order (every
    rank calls :meth:`saved`), so it resumes on any number of ranks that divides ``num_envs``.

    Args:
        dist: None, or the :class:`rlfunc.run.distributed.Distributed` of a data-parallel run.

    Raises:
        EnvError (constructor): an unknown env, or one without a Dict observation.
    """

    name = ALGO
    data_parallel = True
    requires_format = True  # its snapshots from before it was resumable lack meta "resume_format"

    def __init__(self, config: PPOEncoderConfig, device: torch.device, *, dist=None, resumed: bool = False) -> None:
        check_env(config.env)
        if not resumed:
            check_new_ppo_run(config)
        set_threads(config.run.torch_threads)
        self.config, self.device, self.dist = config, device, dist
        self.rank, self.world_size = (0, 1) if dist is None else (dist.rank, dist.world_size)
        W = self.world_size
        self.local_envs = config.num_envs // W  # this rank's envs
        self.info = env_info(config.env)
        check_dict_info(self.info, config.env)
        self.algo = make_ppo_encoder(config, self.info, device, precision(device, config.run.precision), dist=dist if W > 1 else None)
        self.state = self.algo.init()  # its "optim" is Adam's state: the optimizer is part of the learner
        if W > 1:  # the same init on every rank, by seed; made certain
            dist.broadcast_state(self.state)
        self.total = config.num_iterations
        self.generator = torch.Generator(device=device).manual_seed(config.run.seed)
        self.success = reports_success(config.env)
        self.env = GymChunkEnv(config.env, self.local_envs, act_steps=1, device=device, seed=config.run.seed,
                               workers=config.run.env_workers, split=(self.rank, W) if W > 1 else None,
                               dones_of_split=dones_of_split(dist) if W > 1 else None)  # every rank's done flags: the reset seeds
        self.carry = self.env.reset()

    def step(self, i: int, stopping: bool) -> dict:
        config = self.config
        lr = linear_lr(config.lr, int(self.state["iteration"]), config.num_iterations, config.anneal_lr)  # the iteration's
        t0 = time.perf_counter()
        with span("rollout"):
            batch, self.carry = self.algo.rollout(self.state, self.env, self.carry, self.generator)
        t1 = time.perf_counter()
        with span("update"):
            self.state, metrics = self.algo.iteration(self.state, batch, self.generator)
        t2 = time.perf_counter()
        return {
            "iteration": i,
            "step": int(self.state["env_steps"]),
            "steps_per_s": config.batch_size / (t2 - t0),
            "collect_s": t1 - t0,
            "update_s": t2 - t1,
            "lr": lr,
            **{k: float(v) for k, v in metrics.items() if self.success or k != "success_rate"},
        }

    def saved(self) -> tuple[TensorDict, dict]:
        """The snapshot of the single process that steps all N envs: a data-parallel run gathers its
        ranks' carries and episode states into that env order (every rank calls this)."""
        carry = self.carry.select(*_carry_keys(self.info), strict=False)
        episodes = self.env.episode_state()
        if self.world_size > 1:
            carry = self.dist.all_gather_batch(carry, dim=0)
            parts = self.dist.gather_objects(episodes)
            episodes = None if any(p is None for p in parts) else {
                key: [item for part in parts for item in part[key]] for key in parts[0]}  # "envs", "episode_return", "success"
        snapshot = TensorDict({**learner_entries(self.state), "carry": carry}, batch_size=[])
        meta = {
            "algo": ALGO,
            "config": dataclasses.asdict(self.config),
            "env_info": self.info.to_meta(),
            "iteration": int(self.state["iteration"]),
            "env_steps": int(self.state["env_steps"]),
            **state_meta(),
            **env_rng_snapshot(self.env)[1],
            "env_state": episodes,
            "world_size": self.world_size,
        }
        return snapshot, meta

    def restore(self, loaded: TensorDict, meta: dict) -> None:
        where = f"the {ALGO} snapshot of iteration {meta.get('iteration')}"
        with torch.no_grad():  # in place: the policy and the update hold these leaves
            self.state.exclude("optim").update_(loaded["learner"])
            self.state["optim"].update_(loaded["optim"])
        set_generator_state(self.generator, self.state["rng"])
        restore_env_rng(self.env, loaded, ResumePoint(Path(where), meta, self.config))
        episodes = meta.get("env_state")
        if episodes is None:
            warnings.warn(f"{where}: the {self.config.env} envs' state was not captured, so the resumed run starts new "
                          "episodes and is not bit-identical to an uninterrupted one", stacklevel=4)
            self.carry = self.env.reset()
            return
        n, lo = self.local_envs, self.rank * self.local_envs  # this rank's envs of the single process's N
        try:
            # "envs", "episode_return", "success": lists of N in the single process's env order
            self.env.set_episode_state({key: value[lo:lo + n] if isinstance(value, list) else value for key, value in episodes.items()})
        except EnvError as e:
            raise CheckpointError(f"{where}: {e}") from None
        carry = {k: v[lo:lo + n] for k, v in loaded["carry"].items()}  # loaded with batch []; top-level keys
        self.carry = TensorDict(carry, batch_size=self.env.batch_size, device=self.env.device)

    def upgrade(self, loaded: TensorDict, meta: dict, where: str) -> TensorDict:
        """A layout-1 snapshot (torch.optim.Adam's state as "optim", numbered in that optimizer's
        parameter order, :func:`_torch_optim_order`) with its "optim" as the update chain's state."""
        stepped = self.algo.trainable_params(self.state["params"])
        order = _torch_optim_order(len(func.leaves(stepped)))
        indices = meta.get("optim_leaves", [])
        if "optim" in loaded.keys() and isinstance(indices, list) and all(type(j) is int and 0 <= j < len(order) for j in indices):
            # torch.optim's entry j is the trainable leaf order[j] (entries that fit no leaf are left to be refused)
            renumber = lambda j: str(order[int(j)]) if j.isdigit() and int(j) < len(order) else j  # noqa: E731
            loaded["optim"] = TensorDict({renumber(j): v for j, v in loaded["optim"].items()}, batch_size=[])
            meta = {**meta, "optim_leaves": [order[j] for j in indices]}
        optim = without_loss_scale(learner_entries(self.state)["optim"])  # fp16: the loop wraps the converted state again
        like = TensorDict({"learner": {"params": stepped}, "optim": optim}, batch_size=[])
        return upgrade_layout_1(loaded, meta, where, like, algo=ALGO, commit=LAYOUT_1_COMMIT)

    def evaluate(self) -> dict:
        return {"algo": ALGO, **evaluate_state(self.config, self.info, self.state, self.config.run.eval_episodes, device=self.device)}

    def close(self) -> None:
        self.env.close()


def evaluate_run(run_dir: str | Path, episodes: int | None = None, *, seed: int | None = None, device: str = "auto",
                 max_envs: int = 25) -> dict:
    """:func:`evaluate_state` of the latest snapshot in ``run_dir`` (or of a snapshot directory).

    Args:
        episodes: how many (default: the run's ``eval_episodes``). seed, max_envs: as :func:`evaluate_state`.

    Returns:
        :func:`evaluate_state`'s dict ("env_steps": the snapshot's).

    Raises:
        CheckpointError: no snapshot, not an encoder-PPO one, of an unknown (newer) state layout, or
            weights that do not match its config.
        ConfigError: ``episodes`` not an integer in [1, MAX_EVAL_ENVS / seeds] (:func:`rlfunc.config.check_episodes`)
            or ``seed`` outside [0, 2**31). EnvError: no episode ended within the env's time limit.
    """
    snap = checkpoint.snapshot_to_read(run_dir)
    meta = checkpoint.load_meta(snap)
    config = algorithms.config_from_meta(meta, snap, of=PPOEncoderConfig)
    state_layout(str(snap), meta, ALGO)  # layouts 1 and 2 keep the same "learner" (the optimizer aside)
    episodes = config.run.eval_episodes if episodes is None else episodes
    check_episodes(episodes, config.run.num_seeds)
    check_eval_seed(seed)
    try:
        info = EnvInfo.from_meta(dict(meta["env_info"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{snap}: no valid env_info in meta.json ({e})") from None
    dev = resolve_device(device)
    state = checkpoint.load_learner_for_eval(snap, make_ppo_encoder(config, info, dev).init().exclude("optim"), dev)
    return {"algo": meta["algo"], **evaluate_state(config, info, state, episodes, seed=seed, device=dev, max_envs=max_envs)}


def evaluate_state(config: PPOEncoderConfig, info: EnvInfo, state: TensorDict, episodes: int, *, seed: int | None = None,
                   device: torch.device, max_envs: int = 25) -> dict:
    """Deterministic-action episodes of the learner ``state`` (float32, no autocast) on ``config.env``.

    Args:
        episodes: how many (>= 1), run in rounds of at most ``max_envs`` envs; round r's envs are
            seeded ``seed + 1_000_003 + r`` (``seed``: the run's by default; as every algorithm's
            ``rlfunc eval --seed``, a stand-in for the run's seed, so the episodes never reuse the
            training envs' reset seeds).

    Returns:
        {"env", "mean", "std", "episodes", "ci95", "env_steps"}: the episodes' returns (env units)
        summarised by :func:`rlfunc.core.stats.summarize_returns`, "env_steps" the state's, and
        "success_rate" with its Wilson interval "success_ci95" when the env reports
        ``info["is_success"]`` (:func:`reports_success`).

    Raises:
        EnvError: no episode ended within the env's time limit (the statistics cover the episodes
            that ended; "unfinished" counts the others).
    """
    algo = make_ppo_encoder(config, info, device)
    # the bug: --seed S seeded the envs with S itself, so `rlfunc eval RUN --seed 0` of a seed-0 run
    # evaluated on the training envs' start states (ppo, grpo, sac ... add the offset to either)
    base = (config.run.seed if seed is None else seed) + EVAL_SEED_OFFSET
    returns, successes, done = [], [], 0
    limit = None
    for r in range(-(-episodes // max_envs)):
        n = min(max_envs, episodes - done)
        env = GymChunkEnv(config.env, n, act_steps=1, device=device, seed=base + r)
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
    out = {"env": config.env, **summarize_returns(returns, nonfinite="count"), "env_steps": int(state["env_steps"])}
    if returns.numel() < episodes:  # the statistics are over the episodes that ended
        out["unfinished"] = episodes - returns.numel()
    if reports_success(config.env):
        out["success_rate"] = sum(successes) / episodes
        out["success_ci95"] = list(success_interval(sum(successes), episodes))
    return out

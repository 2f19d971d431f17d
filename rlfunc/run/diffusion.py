"""Whole runs of the diffusion algorithms (bc, dppo, td3-diffusion), each one function of its config,
driven by the one run loop (:mod:`rlfunc.run.loop`): :class:`BCRun`, :class:`DPPORun`,
:class:`ReplayDiffusionRun` (td3-diffusion, sac-diffusion), which share :class:`DiffusionRun`.

Each writes RUN_DIR/config.json, metrics.jsonl (one line per logged iteration), checkpoints/
(safetensors snapshots whose learner state includes the noise schedule, verified against the actor
spec on every load; meta.json also records the env's observation layout), versions/ every
``version_every`` iterations (:mod:`rlfunc.run.versions`: list, diff, rollback), learning_curve.png
(success rate; bc: denoising loss) and eval.json (one episode per env with deterministic DDIM, eta = 0 unless dppo's
``eval_eta``: return, success rate, and PointReach's mode statistics).

Envs: PointReach-v0 (torch-batched) and any gymnasium id with bounded Box actions, through
:class:`rlfunc.envs.chunk.GymChunkEnv`; bc needs a scripted expert (PointReach-v0, PushState-v0,
Push-v0). Dict observations (Push-v0: two cameras, proprio, an instruction) go through a
:class:`rlfunc.nets.encoders.MultimodalEncoder` trained by bc and kept frozen by dppo / td3-diffusion.

``init_from`` (dppo, td3-diffusion) takes a bc run dir or snapshot and starts from its EMA weights,
observation statistics and actor spec. A snapshot is written every ``checkpoint_every`` iterations
and at the end (the last ``keep_checkpoints`` kept).

Resume (:func:`rlfunc.resume`, or ``rlfunc.run.train(None, run_dir, resume=True)``) continues from the newer of the latest snapshot and the current branch's head
version (:func:`rlfunc.run.resume_source`) with its config, optionally with a new budget. On CPU it is
exact: N iterations, stop, resume to 2N give the same parameters, optimizer and RNG states as 2N in
one go. A snapshot holds the learner state (its "rng": the noise and minibatch generator; its
optimizers' states, each an entry "optim_<name>" of the snapshot), and what the loop carries between
iterations: the env's RNG (every rollout starts with a full reset seeded from it), the fp16 grad
scaler's state, bc's metrics summed
since the last metrics line, td3-diffusion's replay buffer (``checkpoint_buffer=False`` leaves it
out: a resumed run refills an empty buffer, with a warning); :class:`DiffusionRun` says where. bc's
demonstrations are collected again from the config's seed. Metrics lines written after the snapshot
(before a crash) are dropped on resume.

State layouts (meta "state_layout", :mod:`rlfunc.run.resume`): each learner state owns its optimizers,
the states of rlfunc.optim chains (bc's state["optim_actor"]: clip, AdamW; dppo's state["optim_all"]:
a joint clip, then Adam per side; td3-diffusion's state["optim_critic"] and state["optim_actor"]:
clip, Adam), and the snapshots are of layout 2. Snapshots of layout 1 (no "state_layout": torch.optim's
states as "optim_<name>", up to :data:`LAYOUT_1_COMMIT`) are converted on load (:meth:`DiffusionRun.upgrade`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from tensordict import TensorDict

from rlfunc.algos import registry as algorithms
from rlfunc.algos.bc import BCConfig, make_bc
from rlfunc.core import func
from rlfunc.run import checkpoint
from rlfunc.algos.diffusion_actor import (
    POINT_REACH_INFO, ActorSpec, DiffusionActor, EnvInfo, check_env, dones_of_split, env_info, evaluate_episodes, make_env,
    reports_success, schedule_for,
)
from rlfunc.algos.dppo import DPPOConfig, make_dppo
from rlfunc.algos.sac_diffusion import SACDiffusionConfig, make_sac_diffusion
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig, make_td3_diffusion
from rlfunc.device import resolve_device, set_threads, span
from rlfunc.diffusion.schedule import check_schedule
from rlfunc.envs import registry
from rlfunc.envs.async_collect import AsyncCollector, restart_seed
from rlfunc.config import check_dependents, check_episodes, check_eval_seed, check_new_ppo_run
from rlfunc.errors import CheckpointError
from rlfunc.optim.amp import precision, without_loss_scale
from rlfunc.run import Run
from rlfunc.run.resume import (STATE_LAYOUT, ResumePoint, buffer_snapshot, env_rng_snapshot, optim_from_layout_1, restore_buffer,
                               restore_env_rng, set_generator_state)

EVAL_SEED_OFFSET = 1_000_003
LAYOUT_1_COMMIT = "8a7709f"  # an rlfunc that wrote (and resumes) bc, dppo and td3-diffusion snapshots of state layout 1


def _key(key) -> tuple:
    """A TensorDict key as a tuple."""
    return key if isinstance(key, tuple) else (key,)



def _setup(config) -> torch.device:
    """The run's device, once ``config.env`` is known to be one the actor runs on (EnvError if not)."""
    check_env(config.env)
    device = resolve_device(config.run.device)
    set_threads(config.run.torch_threads)
    return device


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
    frozen: tuple[TensorDict, int] | None = None  # dppo fine-tuning its last K' steps only: (the frozen first steps' weights, K')


def frozen_steps(finetune_steps, likelihood, ddim_steps: int, base: TensorDict | None) -> tuple[TensorDict, int] | None:
    """(``base``, K') for a dppo actor that fine-tuned only its last K' < K denoising steps on the chain
    likelihood: its rollouts ran the first K - K' steps on ``base`` (the frozen pretrained weights),
    and so must its evaluation (the bug: it ran all K on the fine-tuned weights, a policy never
    trained at the high-noise steps). None for every other actor (output-noise never froze steps)."""
    if base is None or finetune_steps is None or likelihood != "chain" or finetune_steps >= ddim_steps:
        return None
    return base, int(finetune_steps)


def load_actor(path: str | Path, device: torch.device) -> LoadedActor:
    """Load a diffusion actor from a run dir (latest snapshot) or a snapshot dir.

    Returns (spec, actor params, obs_stats, meta, env info, encoder params, frozen): the EMA weights for a
    bc snapshot, the trained actor for dppo / td3-diffusion; ``frozen`` (:func:`frozen_steps`) for a dppo
    actor that fine-tuned only its last denoising steps. The stored schedule must equal the one the
    spec defines, and the weights' shapes the ones the spec and env info define.

    Raises:
        CheckpointError: no snapshot, not a diffusion snapshot, or a schedule that does not match.
    """
    snap = checkpoint.snapshot_to_read(path)
    meta = checkpoint.load_meta(snap)
    family = algorithms.names(family="diffusion", commands=False)
    if meta.get("algo") not in family:
        raise CheckpointError(f"{snap}: algo={meta.get('algo')!r}: expected a diffusion snapshot ({', '.join(family)})")
    spec = actor_spec_from_meta(meta, snap)
    info = env_info_from_meta(meta, snap)
    loaded, _ = checkpoint.load_snapshot(snap, device=device)
    key, enc_key = (("learner", *k) for k in algorithms.lookup(meta["algo"]).deploy)  # the actor's, the encoder's
    needed = (key, ("learner", "schedule"), ("learner", "obs_stats")) + ((enc_key,) if info.is_dict else ())
    for k in needed:
        if k not in loaded.keys(include_nested=True):
            raise CheckpointError(f"{snap}: a {meta['algo']} snapshot must hold {'/'.join(k)}; this one does not")
    _check_schedule(snap, loaded["learner", "schedule"], schedule_for(spec, device))
    actor = DiffusionActor(spec, info, info.act_dim, torch.device("cpu"))
    _check_shapes(loaded[key], func.params_from_module(actor.net), snap, "actor")
    encoder = None
    if info.is_dict:
        _check_shapes(loaded[enc_key], func.params_from_module(actor.encoder), snap, "encoder")
        encoder = func.as_leaves(loaded[enc_key].clone())
    config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    # a config that fine-tuned only its last steps (dppo's finetune_steps) over a learner holding the frozen weights
    frozen = frozen_steps(config.get("finetune_steps"), config.get("likelihood", "chain"), spec.ddim_steps,
                          loaded.get(("learner", "base"), None))
    if frozen is not None:
        _check_shapes(frozen[0], func.params_from_module(actor.net), snap, "frozen actor (base)")
        frozen = (func.as_leaves(frozen[0].clone()), frozen[1])
    return LoadedActor(spec, func.as_leaves(loaded[key].clone()), loaded["learner", "obs_stats"], meta, info, encoder, frozen)


def _check_schedule(where, schedule: TensorDict, expected: TensorDict) -> None:
    """:func:`rlfunc.diffusion.schedule.check_schedule`, its CheckpointError naming ``where``."""
    try:
        check_schedule(schedule, expected)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None


def _check_shapes(params: TensorDict, want: TensorDict, snap, what: str) -> None:
    got_shapes = {k: tuple(v.shape) for k, v in params.flatten_keys(".").items()}
    want_shapes = {k: tuple(v.shape) for k, v in want.flatten_keys(".").items()}
    if got_shapes != want_shapes:
        diff = sorted(set(got_shapes.items()) ^ set(want_shapes.items()))[:3]
        raise CheckpointError(f"{snap}: the {what} weights do not match its actor_spec (first differences: {diff})")


def evaluation_json(algo: str, episodes: int, summary: dict) -> dict:
    """The JSON line of a diffusion run's evaluation (eval.json, ``rlfunc eval``): the protocol's keys
    every algorithm's line has, "mean", "std", "episodes", "ci95" [low, high] (None for one episode),
    then :func:`~rlfunc.algos.diffusion_actor.evaluate_episodes`' own keys (episode_return, success_rate
    ...). The bug: scripts reading eval.json across algorithms found mean/std/ci95 in ppo's, sac's and
    grpo's but only episode_return* here."""
    summary = {k: float(v) for k, v in summary.items()}
    low, high = summary.get("episode_return_ci95_low"), summary.get("episode_return_ci95_high")
    return {"algo": algo, "mean": summary.get("episode_return"), "std": summary.get("episode_return_std"),
            "episodes": episodes, "ci95": None if low is None else [low, high], **summary}


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
        ConfigError: ``episodes`` not an integer in [1, MAX_EVAL_ENVS / seeds] (:func:`rlfunc.config.check_episodes`)
            or ``seed`` outside [0, 2**31).
    """
    dev = resolve_device(device)
    loaded = load_actor(run_dir, dev)
    spec, params, obs_stats, meta, info, encoder = loaded[:6]
    config = meta.get("config")
    try:
        run = config.get("run", config)  # RunConfig's fields nested, or flat (written before RunConfig)
        episodes = int(run.get("eval_episodes", 500)) if episodes is None else episodes
        seed = int(run.get("seed", 0)) if seed is None else seed
        eta = float(config.get("eval_eta", 0.0)) if eta is None else eta
    except (AttributeError, TypeError, ValueError):
        raise CheckpointError(f"{run_dir}: meta.json holds no valid config (eval_episodes, seed, eval_eta)") from None
    check_episodes(episodes)
    check_eval_seed(seed)
    actor = DiffusionActor(spec, info, info.act_dim, dev)
    env_id = config.get("env", "PointReach-v0")
    summary = evaluate_episodes(actor, params, obs_stats, schedule_for(spec, dev), env_id, episodes,
                                seed=seed + EVAL_SEED_OFFSET, eta=eta, encoder_params=encoder, frozen=loaded.frozen)
    return evaluation_json(meta["algo"], episodes, summary)


# ------------------------------------------------------------------------------------------ the runs


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
    if loaded.frozen is not None:  # one actor cannot hold it: the first steps would run the fine-tuned weights
        origin = loaded.meta.get("config", {}).get("init_from") if isinstance(loaded.meta.get("config"), dict) else None
        raise CheckpointError(
            f"init_from={config.init_from!r}: a dppo run that fine-tuned only the last {loaded.frozen[1]} of its "
            f"{loaded.spec.ddim_steps} denoising steps acts with two sets of weights (its frozen ones for the first "
            "steps); a new run starts from one actor: "
            + (f"start from the run it was fine-tuned from ({origin})" if origin else
               "it started from no run (its frozen weights are its initial ones), so start from a bc run"))
    if loaded.info != info:
        env = loaded.meta.get("config", {}).get("env", "?")
        raise CheckpointError(
            f"init_from={config.init_from!r}: its actor reads {env!r} "
            f"observations (obs_dim {loaded.info.obs_dim}, act_dim {loaded.info.act_dim}, keys {list(loaded.info.obs_keys)}), "
            f"not those of env={config.env!r} (obs_dim {info.obs_dim}, act_dim {info.act_dim}, keys {list(info.obs_keys)})"
            + (f"; train on its env with --env {env}" if isinstance(env, str) and env != "?" else "")
        )
    return dataclasses.replace(config, actor=loaded.spec), info, loaded.params, loaded.obs_stats, loaded.encoder


class DiffusionRun(Run):
    """What the bc, dppo and td3-diffusion runs share, as :func:`rlfunc.run.run_loop` drives them.

    A snapshot: {"learner" (the learner state but its optimizer states), "optim_<name>": each of the
    learner's optimizer states (``optim_keys``, update chains'), "env_rng": a torch env's generator
    state, **the run's carry}; meta: "algo", "config" (with the actor spec actually used),
    "actor_spec", "obs_dim", "act_dim", "env_info", "iteration", "step" = "env_steps" (bc: updates),
    "env_rng" (a gymnasium env's numpy state, or "torch"),
    "state_layout" (2), and the carry's. A subclass sets ``info``, ``algo``, ``state``, ``optim_keys``
    (with :meth:`layout_1_order` or :meth:`optim_from_layout_1`), ``gen`` (the
    generator of ``state["rng"]``), ``env`` and ``total``, and overrides :meth:`step`.
    """

    data_parallel = True
    curve = "success_rate"
    carry: tuple[str, ...] = ()  # the top-level snapshot entries of the run's own carry
    optim_keys: tuple[str, ...] = ()  # the learner state's optimizer states (update chains), each a snapshot entry
    env = None

    def __init__(self, config, device: torch.device, dist=None) -> None:
        _setup(config)
        name = algorithms.name_of(config)
        self.config, self.device, self.name, self.dist = config, device, name, dist
        self.rank, self.world_size = (0, 1) if dist is None else (dist.rank, dist.world_size)
        self.prec = precision(device, config.run.precision)
        if self.curve == "success_rate" and registry.find(config.env) is None and not reports_success(config.env):
            self.curve = "episode_return"  # e.g. Pendulum-v1: no success to plot

    def _finetune(self, make, config, resumed: bool) -> None:
        """dppo's and td3-diffusion's start: the actor of ``config.init_from`` (not read when
        ``resumed``: the snapshot holds it), ``make``'s algorithm and learner state, env, generator.
        Data-parallel (dppo, td3-diffusion, sac-diffusion): ``make`` takes the ``dist``, the env is this rank's split of the
        ``num_envs`` and the learner state is rank 0's."""
        config, self.info, params, obs_stats, encoder = _init_actor(config, self.device, resumed)
        self.config = config  # a new run's config is re-validated with init_from's actor spec
        W = self.world_size
        extra = {} if self.dist is None else {"dist": self.dist}
        self.algo = make(config, config.actor, self.info, self.info.act_dim, self.device, **extra)
        self.state = self.algo.init(params, obs_stats, encoder)
        if self.dist is not None:  # the same init on every rank, by seed; made certain
            self.dist.broadcast_state(self.state)
        if getattr(config, "async_collection", False):  # the collector's worker makes and steps the envs
            self.env = None
        else:
            self.env = make_env(config.env, config.num_envs // W, config.actor.act_steps, self.device, config.run.seed,
                                split=(self.rank, W) if W > 1 else None, workers=config.run.env_workers,
                                any_done_of_split=self.dist.any_rank if W > 1 else None,  # the ranks reset when one of them would
                                dones_of_split=dones_of_split(self.dist) if W > 1 else None)  # a gymnasium id's: every rank's done flags
        self.gen = torch.Generator(device=self.device).manual_seed(config.run.seed)

    @property
    def variable(self) -> tuple[str, ...]:
        """The snapshot entries :meth:`upgrade` (state layout 1) or :meth:`restore` (layout 2) check
        themselves rather than the loop: the learner and its optimizer states (``optim_keys``), so that
        a message names the learner's own keys; the run's own carry, whose structure depends on how far
        the run got; the env's RNG (absent from snapshots older than resume: a warning)."""
        return ("learner", *self.optim_keys, "env_rng", *self.carry)

    def steps(self) -> int:
        """What names a snapshot, and a version's step: env steps (bc: updates)."""
        return int(self.state["env_steps"])

    def logged_step(self) -> int:
        return self.steps()  # a metrics line's "step" too

    def carried(self) -> tuple[dict, dict]:
        """(tensors, meta) of the env's RNG and the run's carry (:func:`rlfunc.run.resume.env_rng_snapshot`)."""
        return env_rng_snapshot(self.env) if self.env is not None else ({}, {})

    def saved(self) -> tuple[TensorDict, dict]:
        snapshot = TensorDict({"learner": self.state.exclude(*self.optim_keys)}, batch_size=[])
        for key in self.optim_keys:  # the learner's optimizer states, each an entry of its own
            snapshot[key] = self.state[key]
        tensors, carried_meta = self.carried()
        for key, value in tensors.items():
            snapshot[key] = value
        info = self.info
        meta = {"algo": self.name, "config": dataclasses.asdict(self.config), "actor_spec": dataclasses.asdict(self.config.actor),
                "obs_dim": info.obs_dim, "act_dim": info.act_dim, "env_info": info.to_meta(),
                "iteration": int(self.state["iteration"]), "step": self.steps(), "env_steps": self.steps(),
                "state_layout": STATE_LAYOUT,
                "world_size": self.world_size, **carried_meta}
        return snapshot, meta

    def _check_loaded(self, loaded: TensorDict, meta: dict, where) -> None:
        """CheckpointError naming ``where`` unless ``loaded`` was saved for the env's observation
        layout (meta "env_info"), holds a learner state of the fresh one's structure (its optimizer
        states aside) and the schedule of the actor spec."""
        saved_info = env_info_from_meta(meta, where)
        if saved_info != self.info:
            raise CheckpointError(f"{where}: saved for observations {saved_info}, but env={self.config.env!r} now gives {self.info}")
        if "learner" not in loaded.keys():
            raise CheckpointError(f"{where}: holds no learner state")
        # its messages name the learner's own keys
        checkpoint.check_learner(where, loaded["learner"], self.state.exclude(*self.optim_keys))
        _check_schedule(where, loaded["learner", "schedule"], self.state["schedule"])

    def upgrade(self, loaded: TensorDict, meta: dict, where: str) -> TensorDict:
        """``loaded``, a snapshot of state layout 1 (no meta "state_layout": each optimizer's torch.optim
        state as "optim_<name>"), checked (:meth:`_check_loaded`), with the states of the learner's
        optimizers (``optim_keys``) converted to those of their update chains
        (:func:`rlfunc.run.resume.optim_from_layout_1`, renumbered from the torch.optim optimizer's
        parameter order, :meth:`layout_1_order`)."""
        self._check_loaded(loaded, meta, where)
        for key in self.optim_keys:  # torch.optim kept no state before a first step
            saved = loaded.get(key, TensorDict({}, batch_size=[]))
            loaded[key] = self.optim_from_layout_1(key, saved, where).to(loaded.device)
        return loaded

    def optim_from_layout_1(self, key: str, torch_state: TensorDict, where: str) -> TensorDict:
        """``state[key]`` (a chain state holding one Adam state) with its Adam part filled from the
        torch.optim state ``torch_state`` of a layout-1 snapshot, renumbered from that optimizer's
        parameter order (:meth:`layout_1_order`) to the chain's leaves (:func:`rlfunc.run.resume.optim_from_layout_1`,
        whose CheckpointError names ``where``)."""
        stepped, order = self.layout_1_order(key)
        new_index = {k: i for i, k in enumerate(sorted(stepped.keys(include_nested=True, leaves_only=True), key=str))}
        renumber = lambda j: str(new_index[order[int(j)]]) if j.isdigit() and int(j) < len(order) else j  # noqa: E731
        torch_state = TensorDict({renumber(j): v for j, v in torch_state.items()}, batch_size=[])
        indices = sorted(int(j) for j in torch_state.keys() if j.isdigit())
        like = without_loss_scale(self.state[key])  # fp16: the loop wraps the converted state again
        return optim_from_layout_1(f"{where}: {key}", torch_state, like, stepped, indices=indices, commit=LAYOUT_1_COMMIT)

    def layout_1_order(self, key: str) -> tuple[TensorDict, list]:
        """(the TensorDict the chain of ``state[key]`` steps, its leaves' keys in the parameter order of
        the torch.optim optimizer that stepped them in state layout 1)."""
        raise NotImplementedError

    def restore(self, loaded: TensorDict, meta: dict) -> None:
        if meta.get("state_layout", 1) == STATE_LAYOUT:  # a layout-1 snapshot was checked by upgrade
            where = self._point(meta).snapshot
            self._check_loaded(loaded, meta, where)
            for key in self.optim_keys:
                if key not in loaded.keys():
                    raise CheckpointError(f"{where}: holds no {key} (the state of the learner's optimizer)")
                checkpoint.check_learner(f"{where}: {key}", loaded[key], self.state[key])
        with torch.no_grad():  # in place: the policies and the update chains hold these leaves
            self.state.exclude(*self.optim_keys).update_(loaded["learner"])
            for key in self.optim_keys:
                self.state[key].update_(loaded[key])
        set_generator_state(self.gen, self.state["rng"])
        if self.env is not None:
            restore_env_rng(self.env, loaded, self._point(meta))

    def _point(self, meta: dict) -> ResumePoint:  # what restore_env_rng / restore_buffer name in messages
        return ResumePoint(f"the {self.name} snapshot of iteration {meta.get('iteration')}", meta, self.config)

    def evaluate(self) -> dict:
        """:func:`~rlfunc.algos.diffusion_actor.evaluate_episodes` of the registry entry's ``deploy``
        weights (bc: the EMA), DDIM with eta ``eval_eta`` (dppo; else 0)."""
        key, encoder_key = algorithms.lookup(self.name).deploy
        config, state = self.config, self.state
        frozen = frozen_steps(getattr(config, "finetune_steps", None), getattr(config, "likelihood", None),
                              config.actor.ddim_steps, state.get("base", None))
        summary = evaluate_episodes(self.algo.actor, state[key], state["obs_stats"], state["schedule"], config.env,
                                    config.run.eval_episodes, seed=config.run.seed + EVAL_SEED_OFFSET,
                                    eta=getattr(config, "eval_eta", 0.0), encoder_params=state.get(encoder_key, None),
                                    frozen=frozen)
        # the keys of evaluate_run's, so `rlfunc eval RUN_DIR` repeats eval.json exactly
        return evaluation_json(self.name, config.run.eval_episodes, summary)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


class BCRun(DiffusionRun):
    """A bc run: ``num_updates`` AdamW updates (its state the learner's "optim_actor") on the scripted
    expert's demonstrations (collected from the config's seed on every start; demos.json holds the
    expert's statistics), a metrics line every ``log_every`` (the mean since the last line). A
    snapshot also holds the metrics summed since the last line ("pending_metrics"; meta
    "pending_metrics": how many, "pending_update_s": their update seconds, so a resumed line's
    update_s is of all its updates)."""

    carry = ("pending_metrics",)
    curve = "loss_denoise"  # against updates (a bc record's "step")
    optim_keys = ("optim_actor",)

    def __init__(self, config: BCConfig, device: torch.device, *, dist=None, resumed: bool = False) -> None:
        from rlfunc.envs.demos import check_expert, expert_demonstrations

        super().__init__(config, device, dist)
        check_expert(config.env)
        self.info = env_info(config.env)
        # checks the encoder settings before the demos are collected; data-parallel: each rank collects the
        # whole dataset (from the seed) and takes its share of every batch
        self.algo = make_bc(config, self.info, self.info.act_dim, device, dist)
        dataset, self.demos = expert_demonstrations(config.env, config.num_demos, config.actor.horizon, seed=config.run.seed,
                                                    noise_std=config.demo_noise_std, device=device)
        self.dataset = dataset.select(*self.info.obs_keys, "action")
        self.gen = torch.Generator(device=device).manual_seed(config.run.seed)
        self.state = self.algo.init(self.dataset)  # its "optim_actor" is AdamW's state: the learner owns the optimizer
        if dist is not None:  # the same init on every rank, by seed; made certain
            dist.broadcast_state(self.state)
        self.pending, self.count, self.update_s = None, 0, 0.0  # metrics and update seconds summed since the last metrics line
        self.compile_s: float | None = None  # the compiled step's first-call seconds, until a metrics line reports it
        self.total = config.num_updates

    def steps(self) -> int:
        return int(self.state["iteration"])

    def layout_1_order(self, key: str) -> tuple[TensorDict, list]:
        """AdamW's parameters were :func:`~rlfunc.algos.bc.make_bc`'s ``trainable``: the denoiser's
        leaves, then the encoder's (each in func.leaves order)."""
        stepped = self.algo.trainable_params(self.state)
        return stepped, [(group, *_key(k)) for group in ("params", "encoder") if group in stepped.keys()
                         for k in sorted(stepped[group].keys(include_nested=True, leaves_only=True), key=str)]

    def carried(self) -> tuple[dict, dict]:
        return ({} if self.pending is None else {"pending_metrics": self.pending}), {"pending_metrics": self.count,
                                                                                    "pending_update_s": self.update_s}

    def restore(self, loaded: TensorDict, meta: dict) -> None:
        super().restore(loaded, meta)
        if "pending_metrics" in loaded.keys():
            self.pending, self.count = loaded["pending_metrics"], int(meta.get("pending_metrics", 0))
            spent = meta.get("pending_update_s", 0.0)  # (absent in older snapshots: the line's update_s is then low)
            self.update_s = float(spent) if isinstance(spent, (int, float)) and not isinstance(spent, bool) else 0.0

    def open(self, run_dir: Path) -> None:
        (run_dir / "demos.json").write_text(json.dumps(self.demos) + "\n")

    def step(self, i: int, stopping: bool) -> dict | None:
        t0 = time.perf_counter()
        with span("update"):
            self.state, metrics = self.algo.iteration(self.state, self.dataset, self.gen, self.prec)
        self.update_s += time.perf_counter() - t0
        if "compile_s" in metrics.keys():  # the compiled step's first call: once, in the next metrics line, not averaged
            self.compile_s = float(metrics.pop("compile_s"))
        self.pending = metrics if self.pending is None else self.pending + metrics
        self.count += 1
        if not (i % self.config.run.log_every == 0 or i == self.total or stopping):
            return None
        record = {"iteration": i, "step": i, **(self.pending / self.count).to_dict(), "update_s": self.update_s / self.count}
        if self.compile_s is not None:
            record["compile_s"], self.compile_s = self.compile_s, None
        self.pending, self.count, self.update_s = None, 0, 0.0
        return record


class DPPORun(DiffusionRun):
    """A dppo run: per iteration a rollout of ``num_envs`` x ``num_steps`` chunks, then PPO epochs
    over it with one update chain over the actor and the critic (its state the learner's
    "optim_all": a joint clip, then Adam with a learning rate per side); usually from a bc run
    (``init_from``, not read again on resume)."""

    optim_keys = ("optim_all",)

    def __init__(self, config: DPPOConfig, device: torch.device, *, dist=None, resumed: bool = False) -> None:
        if not resumed:  # a new run from Python too (dppo has no presets: the defaults are what it is configured from)
            check_dependents(config, DPPOConfig())
            check_new_ppo_run(config, per_micro_batch=config.run.nproc == 1)  # data parallel: normalised per minibatch
        super().__init__(config, device, dist)
        self._finetune(make_dppo, config, resumed)
        self.total = self.config.num_iterations(self.config.actor.act_steps)

    def optim_from_layout_1(self, key: str, torch_state: TensorDict, where: str) -> TensorDict:
        """torch.optim.Adam's two parameter groups held the actor's leaves, then the critic's (each in
        func.leaves order): its entry j is the actor's leaf j, or the critic's leaf j - (actor leaves)."""
        params, out = self.state["params"], self.state[key].clone()
        n_actor = len(func.leaves(params["actor"]))
        count = n_actor + len(func.leaves(params["critic"]))
        misfit = sorted(j for j in torch_state.keys() if not (j.isdigit() and int(j) < count))
        if misfit:
            raise CheckpointError(f"{where}: {key}: its optimizer state (state layout 1, torch.optim's) does not fit the run's "
                                  f"parameters (entries {misfit} for {count} leaves); train anew, or resume it with rlfunc "
                                  f"of commit {LAYOUT_1_COMMIT}")
        for group, lo, hi in (("actor", 0, n_actor), ("critic", n_actor, count)):
            part = TensorDict({str(int(j) - lo): v for j, v in torch_state.items() if lo <= int(j) < hi}, batch_size=[])
            out["1", group] = optim_from_layout_1(f"{where}: {key}", part, out["1", group], params[group],
                                                  indices=sorted(int(j) for j in part.keys()), commit=LAYOUT_1_COMMIT)
        return out

    def step(self, i: int, stopping: bool) -> dict:
        t0 = time.perf_counter()
        with span("rollout"):
            batch = self.algo.rollout(self.state, self.env, self.gen)
        t1 = time.perf_counter()
        with span("update"):
            self.state, metrics = self.algo.iteration(self.state, batch, self.gen, self.prec)
        times = {"collect_s": t1 - t0, "update_s": time.perf_counter() - t1}
        episodes = batch
        if self.dist is not None and self.dist.active:  # every rank's episodes: their flags and statistics, gathered
            ended = self.dist.all_gather_batch(batch["next"].exclude(*self.info.obs_keys), dim=0)  # [N, T]
            episodes = TensorDict({"next": ended}, batch_size=ended.batch_size)
        return {"iteration": i, "step": int(self.state["env_steps"]), **_episode_metrics(episodes, self.config.env),
                **metrics.to_dict(), **times}


# the algorithm each replay-buffer config builds (the registry entry names the config type)
REPLAY_MAKERS = {TD3DiffusionConfig: make_td3_diffusion, SACDiffusionConfig: make_sac_diffusion}
# what a replay-diffusion rollout reads of the learner state (its algorithm's ``rollout``), published to the collector
ACTING_KEYS = (("params", "actor"), ("params", "log_alpha"), "obs_stats", "schedule", "encoder")


def acting_state(state: TensorDict) -> TensorDict:
    """The entries of a td3-/sac-diffusion learner state its rollout reads (:data:`ACTING_KEYS`, those it has)."""
    return state.select(*ACTING_KEYS, strict=False).detach()


class ReplayRollouts:
    """td3-/sac-diffusion's rollouts in an asynchronous collector's worker
    (:meth:`rlfunc.envs.async_collect.AsyncCollector.of_source`): the algorithm of ``config`` built on
    the CPU, ``config.num_envs`` envs of :func:`~rlfunc.algos.diffusion_actor.make_env` seeded with
    ``env_seed``, and per item one rollout (``num_steps`` chunk steps from a reset, the algorithm's
    ``rollout``: uniform chunks while the env steps so far, from ``start_steps``, are below
    ``warmup_steps``) acting with the published :func:`acting_state`. Picklable (a config and an EnvInfo)."""

    def __init__(self, config, info: EnvInfo, env_seed: int, start_steps: int) -> None:
        self.config, self.info, self.env_seed, self.steps = config, info, env_seed, start_steps
        self.algo = self.env = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "algo": None, "env": None}

    def open(self) -> None:
        config, cpu = self.config, torch.device("cpu")
        self.algo = REPLAY_MAKERS[type(config)](config, config.actor, self.info, self.info.act_dim, cpu)
        self.env = make_env(config.env, config.num_envs, config.actor.act_steps, cpu, self.env_seed)

    def collect(self, weights: TensorDict, generator: torch.Generator, fresh: bool) -> TensorDict:
        state = weights.clone(False)  # the published entries, with the env steps that decide the warm-up
        state["env_steps"] = torch.tensor(self.steps)
        batch = self.algo.rollout(state, self.env, generator)
        self.steps += batch.numel() * self.config.actor.act_steps
        return batch

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


class ReplayDiffusionRun(DiffusionRun):
    """A td3-diffusion or sac-diffusion run (its pieces built by :data:`REPLAY_MAKERS` of its config): per iteration a
    rollout into a device-resident TorchRL replay buffer, then (past ``warmup_steps``)
    ``updates_per_iteration`` updates with one update chain (clip, Adam) per side, their states the
    learner's ``optim_keys`` ("optim_critic", "optim_actor"; sac-diffusion's "optim_alpha" too). A
    snapshot also holds the buffer's filled rows ("buffer"; meta "buffer": their count and the writer's
    cursor, None with ``checkpoint_buffer=False``).

    Data-parallel (``dist`` of W ranks, ``rlfunc train td3-diffusion|sac-diffusion --nproc W`` on a
    torch-batched env): each rank steps its N/W envs (drawing every env's noise, keeping its rows),
    the rollout [N/W, T] is all-gathered into the single process's [N, T] (the whole batch: a few
    floats per chunk step for state observations, every image for pixels), so every rank fills the
    single process's buffer and counts every rank's episodes; the update is the single process's
    (:func:`rlfunc.algos.replay_diffusion.ranks`)."""

    carry = ("buffer",)

    def __init__(self, config, device: torch.device, *, dist=None, resumed: bool = False) -> None:
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        super().__init__(config, device, dist)
        self._finetune(REPLAY_MAKERS[type(config)], config, resumed)
        config = self.config
        self.optim_keys = self.algo.optim_keys
        self.buffer = ReplayBuffer(storage=LazyTensorStorage(config.buffer_size, device=device), batch_size=config.batch_size)
        self.refill = 0  # after a resume without a saved buffer: the transitions to gather before updating again
        self.collector: AsyncCollector | None = None  # async_collection: started by the first step
        self.total = config.num_iterations()
        if config.num_updates() == 0:
            warnings.warn(f"{self.name}: warmup_steps={config.warmup_steps} covers the whole budget (total_steps={config.total_steps}), so the "
                          "run takes no gradient step; lower --warmup-steps or raise --total-steps", stacklevel=2)

    def layout_1_order(self, key: str) -> tuple[TensorDict, list]:
        """Each side's torch.optim.Adam held its leaves in func.leaves order, the chain's own."""
        stepped = self.state["params", key.removeprefix("optim_")]
        return stepped, sorted(stepped.keys(include_nested=True, leaves_only=True), key=str)

    def carried(self) -> tuple[dict, dict]:
        env_tensors, env_meta = super().carried()
        rows, buffer_meta = buffer_snapshot(self.buffer, self.config.checkpoint_buffer)
        return {**env_tensors, **rows}, {**env_meta, **buffer_meta}

    def restore(self, loaded: TensorDict, meta: dict) -> None:
        super().restore(loaded, meta)
        config = self.config  # without a saved buffer: the warm-up's transitions (chunks of act_steps) before updating again
        refill = max(1, min(-(-config.warmup_steps // config.actor.act_steps), config.buffer_size))
        self.refill = 0 if restore_buffer(self.buffer, loaded, self._point(meta), refill) else refill
        if self.config.async_collection:
            warnings.warn(f"{self._point(meta).snapshot}: async_collection: the collector's envs are not in snapshots, so the "
                          "resumed run starts new episodes", stacklevel=3)

    def step(self, i: int, stopping: bool) -> dict:
        state, act_steps = self.state, self.config.actor.act_steps
        extra = {}
        t0 = time.perf_counter()
        if self.config.async_collection:
            batch, extra = self._next_rollout()
            with span("rollout"):
                self.buffer.extend(self.algo.transitions(state, batch))
        else:
            with span("rollout"):
                batch = self.algo.rollout(state, self.env, self.gen)
                if self.dist is not None and self.dist.active:  # every rank's envs, in the single process's order
                    batch = self.dist.all_gather_batch(batch, dim=0)
                self.buffer.extend(self.algo.transitions(state, batch))
        state["env_steps"] = state["env_steps"] + batch.numel() * act_steps
        record = {"iteration": i, "step": int(state["env_steps"]), **_episode_metrics(batch, self.config.env), **extra}
        t1 = time.perf_counter()
        record["collect_s"], record["update_s"] = t1 - t0, 0.0  # (asynchronous: the wait for the worker's rollout too)
        if int(state["env_steps"]) >= self.config.warmup_steps and len(self.buffer) >= self.refill:
            with span("update"):
                self.state, metrics = self.algo.iteration(state, self.buffer, self.gen, self.prec)
            record.update(metrics.to_dict())
            record["update_s"] = time.perf_counter() - t1
            if self.config.async_collection:
                self._publish(self.config.updates_per_iteration)
        else:
            state["iteration"] = state["iteration"] + 1
            state["rng"] = self.gen.get_state()  # the warm-up actions drew from it
        return record


    def _next_rollout(self) -> tuple[TensorDict, dict]:
        """The collector's next rollout [N, T] on the learner's device (the collector started at the
        first call: a resumed run's envs are seeded afresh, its worker's generator too), and the
        metrics of the wait: "env_wait_s" (s) and "policy_lag" (publishes the acting weights were
        behind the learner's latest)."""
        if self.collector is None:
            config, it = self.config, int(self.state["iteration"])
            source = ReplayRollouts(config, self.info, restart_seed(config.run.seed, it), int(self.state["env_steps"]))
            self.collector = AsyncCollector.of_source(source, acting_state(self.state), seed=restart_seed(config.run.seed, it + 1),
                                                      queue_size=config.async_queue)
            self.publishes = self.since_publish = 0
        t0 = time.perf_counter()
        with span("env_wait"):
            batch, version = self.collector.next()
        return batch.to(self.device), {"env_wait_s": time.perf_counter() - t0, "policy_lag": self.publishes - version}

    def _publish(self, updates: int) -> None:
        """Count ``updates`` gradient steps; publish the acting weights once ``sync_weights_every`` have passed."""
        self.since_publish += updates
        if self.since_publish >= self.config.sync_weights_every:
            self.publishes = self.collector.publish(acting_state(self.state))
            self.since_publish = 0

    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()
        super().close()


def _episode_metrics(batch: TensorDict, env_id: str) -> dict:
    """Episodes that ended in ``batch`` [N, T]: their count and the env's own statistics of them
    (its registry entry's ``episode_metrics``), else their mean return and, for an env that reports
    success (:func:`~rlfunc.algos.diffusion_actor.reports_success`), their success rate, of the
    episodes whose return is finite (a NaN or inf reward's episode counts nowhere)."""
    done = batch["next", "done"]
    entry = registry.find(env_id)
    own = entry is not None and entry.episode_metrics is not None
    if not own:  # as PPO's and sac/td3's lines
        done = done & batch["next", "episode_return"].isfinite()
    ended = int(done.sum())
    if not ended:
        return {"episodes": 0}
    if own:
        return {"episodes": ended, **entry.episode_metrics(batch)}
    out = {"episodes": ended, "episode_return": float(batch["next", "episode_return"][done].mean())}
    if reports_success(env_id):
        out["success_rate"] = float(batch["next", "success"][done].float().mean())
    return out


# --------------------------------------------------------------------------------------- the calls

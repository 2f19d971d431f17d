"""A whole shared-parameter multi-agent run (PPO / GRPO / GSPO): :class:`MAPPORun`.

``rlfunc.run.train(config, run_dir)`` of a MAPPOConfig (a :class:`MAPPORun` through the one run loop, :mod:`rlfunc.run.loop`)
writes RUN_DIR/config.json, metrics.jsonl (one line per iteration: losses, training
deliveries/conflicts per 100 steps on Warehouse-v0, completed-episode team returns), checkpoints/
(safetensors snapshots, the last ``keep_checkpoints``), versions/ every ``version_every`` iterations
(:mod:`rlfunc.run.versions`; off by default), learning_curve.png and eval.json, the env registry entry's
``multi_agent_eval`` (:mod:`rlfunc.envs.registry`): on Warehouse-v0 the
:func:`envs.warehouse.metrics.evaluate` rates (deliveries and conflicts per 100 steps, idle
fraction) of the trained policy on the default-reward warehouse with ``config.n_agents`` AGVs, on
rware the mean team return (sum over agents) of ``eval_episodes`` episodes per eval seed.

Collection is the torch-batched env's own loop (``step_and_maybe_reset``): every env of the batch,
and every agent of every env, steps at once on the device; grpo/gspo reset all envs with
:func:`rlfunc.envs.grouped.grouped_reset` so each group of ``group_size`` envs starts from one state.

Resume (:func:`rlfunc.resume`): a snapshot holds the learner
state (its Adam state, ``state["optim"]``, as the snapshot's "optim": :func:`rlfunc.run.resume.learner_entries`),
the action-sampling / minibatch generator ("rng", uint8), the collection carry
(the env output acted on next, the running team returns) and, on Warehouse-v0, the env's core state
and generator, so on CPU 2N iterations in one go equal N, stop, N more, parameter for parameter.
rware's gymnasium instances cannot be captured: a resumed rware run starts new episodes (with a
warning), so it is not bit-identical to an uninterrupted one. Snapshots written before the learner
state owned its optimizer (state layout 1: torch.optim's state) are converted on load
(:func:`rlfunc.run.resume.upgrade_layout_1`). A resume continues from the latest snapshot or the current
branch's head version, whichever is further along (after ``rlfunc versions rollback RUN_DIR V``: V).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from pathlib import Path

import torch
from tensordict import TensorDict

from rlfunc.algos import registry as algorithms
from rlfunc.algos.mappo import MAPPOConfig, make_mappo, state_value
from rlfunc.config import check_episodes, check_eval_seed, replace
from rlfunc.device import resolve_device, set_threads, span
from rlfunc.envs import registry
from rlfunc.envs.grouped import grouped_reset
from rlfunc.envs.registry import EnvEntry
from rlfunc.errors import CheckpointError, ConfigError, EnvError
from rlfunc.optim import linear_lr
from rlfunc.run import checkpoint
from rlfunc.run import Run
from rlfunc.run.resume import learner_entries, set_generator_state, state_layout, state_meta, upgrade_layout_1

COUNT_KEYS = ("deliveries", "vertex_conflicts", "swap_conflicts", "obstacle_bumps", "idle")
LAYOUT_1_COMMIT = "d98cef6"  # the last rlfunc that wrote mappo snapshots of state layout 1 (torch.optim's state)


def env_entry(config: MAPPOConfig) -> EnvEntry:
    """The env registry's entry of ``config.env``, checked to be a multi-agent env.

    Raises:
        EnvError: ``config.env`` has no multi-agent entry (the message lists those that do).
    """
    entry = registry.find(config.env)
    if entry is None or entry.multi_agent_env is None:
        raise EnvError(f"env={config.env!r}: expected a multi-agent env of the env registry "
                       f"({', '.join(registry.ids('multi_agent_env'))})")
    return entry


def make_env(config: MAPPOConfig, num_envs: int, device: torch.device, seed: int, dist=None):
    """The batched multi-agent env of ``config.env`` (its registry entry's ``multi_agent_env``);
    with ``dist`` of W > 1 ranks, this rank's split of the W * ``num_envs`` envs of ``seed``.

    Raises:
        EnvError: ``config.env`` is not a multi-agent env of the registry, or cannot be built.
        ConfigError: a grouped loss (grpo, gspo) on an env whose state cannot be set.
    """
    entry = env_entry(config)
    if config.loss != "ppo" and not entry.settable_state:
        settable = ", ".join(registry.ids("settable_state"))
        raise ConfigError(f"loss={config.loss!r} on {config.env}: grouped rollouts need a settable env state "
                          f"({settable}); use loss='ppo' on {config.env}")
    if dist is not None and dist.active:  # MAPPOConfig.check_data_parallel refused an env that does not split
        return entry.multi_agent_env(config, num_envs, device, seed, split=(dist.rank, dist.world_size),
                                     any_done_of_split=dist.any_rank)
    return entry.multi_agent_env(config, num_envs, device, seed)


def collect(env, policy, carry: TensorDict, num_steps: int) -> tuple[TensorDict, TensorDict]:
    """Step a batched multi-agent env ``num_steps`` times with ``policy``, auto-resetting ended envs.

    Args:
        env: a TorchRL env with batch [N] and Warehouse-v0's ("agents", ...) keys.
        policy: ``(observation [N, A, D], action_mask [N, A, K] | None) -> (action [N, A], sample_log_prob
            [N, A, 1], state_value [N, A, 1] | None)``.
        carry: the env output to act on (from ``env.reset()`` or the previous call).

    Returns:
        (batch [N, T] with ("agents", "observation" | "action_mask" | "action" | "sample_log_prob")
        [N, T, A, ...], "state_value" [N, T, A, 1] (when the policy gives one), ("next", "agents",
        "reward" | "observation"), ("next", "done" | "terminated") [N, T, 1] and the per-step counts
        ("next", k) [N, T, 1] the env reports; the carry for the next call).
    """
    rows = []
    td = carry
    for _ in range(num_steps):
        obs = td["agents", "observation"]
        mask = td["agents"].get("action_mask", None)
        action, log_prob, value = policy(obs, mask)
        td.set(("agents", "action"), action)
        stepped, td = env.step_and_maybe_reset(td)
        nxt = stepped["next"]
        agents = {"observation": obs, "action": action, "sample_log_prob": log_prob}
        if mask is not None:
            agents["action_mask"] = mask
        row = {"agents": agents,
               "next": {"agents": {"reward": nxt["agents", "reward"], "observation": nxt["agents", "observation"]},
                        "done": nxt["done"], "terminated": nxt["terminated"],
                        **{k: nxt[k] for k in COUNT_KEYS if k in nxt.keys()}}}
        if value is not None:
            row["state_value"] = value
        rows.append(row)
    stacked = _stack(rows)
    return TensorDict(stacked, batch_size=[env.batch_size[0], num_steps]), td


def _stack(rows: list[dict]) -> dict:
    return {k: _stack([r[k] for r in rows]) if isinstance(v, dict) else torch.stack([r[k] for r in rows], 1)
            for k, v in rows[0].items()}


def _episode_returns(reward: torch.Tensor, done: torch.Tensor, running: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    """Team returns of the episodes that ended in a rollout: reward [N, T, A, 1], done [N, T, 1], running [N]."""
    team = reward.sum((-2, -1))  # [N, T]
    ended = []
    for t in range(team.shape[1]):
        running = running + team[:, t]
        d = done[:, t, 0]
        ended += running[d].tolist()
        running = torch.where(d, torch.zeros_like(running), running)
    return ended, running


def evaluate_state(config: MAPPOConfig, algo, state: TensorDict, device: torch.device) -> dict:
    """eval.json's content for ``state`` (see the module docstring)."""
    gen = torch.Generator(device=device).manual_seed(config.run.seed + 12345)

    def act(obs, mask):
        return algo.act(state, obs, mask, gen, config.eval_greedy, own_rows=False)[0]  # the evaluation's own envs

    return env_entry(config).multi_agent_eval(config, act, device)


def evaluate_run(run_dir: str | Path, episodes: int | None = None, *, seed: int | None = None,
                 device: str = "auto") -> dict:
    """eval.json's content (see the module docstring) for the latest snapshot of ``run_dir`` (or a
    snapshot directory), on any device: the snapshot's generator states are not read, so a run
    trained on another device type evaluates too. With the run's ``eval_episodes`` and ``eval_seeds``
    it repeats the run's eval.json (sampled actions on the device type it ran on; greedy ones anywhere).

    Args:
        episodes: warehouses (rware: episodes) per eval seed (None: the run's ``eval_episodes``).
        seed: evaluate on this one env seed (None: the run's ``eval_seeds``).
        device: where to run, a name for :func:`rlfunc.device.resolve_device` ("auto", "cpu", "npu:0" ...).

    Raises:
        CheckpointError: no snapshot, not a mappo one, or a learner state that does not match its config.
        ConfigError: ``episodes`` not an integer in [1, MAX_EVAL_ENVS / seeds] (:func:`rlfunc.config.check_episodes`), ``seed`` outside [0, 2**31), or a device this machine lacks.
    """
    snap = checkpoint.snapshot_to_read(run_dir)
    meta = checkpoint.load_meta(snap)
    config = algorithms.config_from_meta(meta, snap, of=MAPPOConfig)
    state_layout(str(snap), meta, "mappo")  # layout 1 and 2 keep the same "learner" (the optimizer aside)
    if episodes is not None:
        check_episodes(episodes, len(config.eval_seeds) if seed is None else 1)
    check_eval_seed(seed)
    dims = {k: meta.get(k) for k in ("obs_dim", "n_agents", "n_actions")}
    if not all(type(v) is int and v >= 1 for v in dims.values()):
        raise CheckpointError(f"{snap}: meta.json {dims}: expected ints >= 1")
    dev = resolve_device(device)
    config = replace(config, device=str(dev),
                                 eval_episodes=config.run.eval_episodes if episodes is None else episodes,
                                 eval_seeds=config.eval_seeds if seed is None else (seed,))
    algo = make_mappo(config, dims["obs_dim"], dims["n_agents"], dims["n_actions"], dev)
    state = checkpoint.load_learner_for_eval(snap, algo.init().exclude("optim"), dev)
    return {"algo": "mappo", **evaluate_state(config, algo, state, dev)}


def _env_capture(config: MAPPOConfig, env) -> TensorDict | None:
    """The env's state and generator (uint8) when its entry says they capture it; None otherwise
    (e.g. rware's host gymnasium envs)."""
    if not env_entry(config).settable_state:
        return None
    return TensorDict({"state": env.state.clone(), "rng": env.rng_state()}, batch_size=[])


class MAPPORun(Run):
    """A mappo run as :func:`rlfunc.run.run_loop` drives it. A snapshot holds the learner state (its
    Adam state as "optim", :func:`rlfunc.run.resume.learner_entries`), the action-sampling / minibatch
    generator ("rng", uint8), the collection carry ("carry": the env output acted on next, the
    running team returns [num_envs]) and, on an env whose state can be set (Warehouse-v0), the env's
    state and generator ("env"); on rware its meta "rware_resets" says where its episode seeds are.

    Data-parallel (``dist`` of W > 1 ranks, under torchrun): each rank steps its split of the env
    (envs rank*N/W .. of the single process's N, :func:`make_env`), the update is the single
    process's (:func:`rlfunc.algos.mappo.make_mappo`), the metrics count every rank's steps and
    episodes, and a snapshot holds every rank's envs, carry and running returns in the single
    process's order (it resumes on any W dividing N).

    Raises (on construction):
        EnvError: ``config.env`` is not a multi-agent env of the registry. ConfigError: a grouped
            loss on an env whose state cannot be set; a new ppo-loss run whose minibatches hold one
            agent-step each.
    """

    data_parallel = True
    requires_format = True  # its snapshots from before it was resumable lack meta "resume_format"

    def __init__(self, config: MAPPOConfig, device: torch.device, *, dist=None, resumed: bool = False) -> None:
        if not resumed and config.run.seed in config.eval_seeds:  # the training envs' generator is seeded with run.seed,
            # each evaluation's with its eval seed: the same task draws, silently
            warnings.warn(f"run.seed={config.run.seed} is one of eval_seeds={config.eval_seeds}: the training warehouses draw "
                          "that evaluation's tasks, so it is not on unseen ones; pick another --seed or other --eval-seeds",
                          stacklevel=3)
        set_threads(config.run.torch_threads)
        self.config, self.device, self.name = config, device, f"mappo-{config.loss}"
        self.dist = dist if dist is not None and dist.active else None
        self.rank, self.world_size = (0, 1) if self.dist is None else (dist.rank, dist.world_size)
        self.local_envs = config.num_envs // self.world_size  # this rank's
        self.settable = env_entry(config).settable_state
        self.env = env = make_env(config, self.local_envs, device, config.run.seed, self.dist)
        self.obs_dim = env.observation_spec["agents", "observation"].shape[-1]
        self.n_actions = env.action_spec["agents", "action"].n
        self.n_agents = env.n_agents
        samples = config.num_envs * self.n_agents * config.rollout_steps  # an iteration's agent-steps (ppo loss)
        if not resumed and config.loss == "ppo" and samples // config.num_minibatches == 1:
            env.close()  # its one-sample minibatches' advantages normalise to 0: the policy would never move
            raise ConfigError(f"num_minibatches={config.num_minibatches}: minibatches of one agent-step (an iteration has "
                              f"{samples}), whose advantage normalises to 0, so the policy would never move; use at most "
                              f"{samples // 2} minibatches")
        # the learning curve: Warehouse-v0's deliveries, else the team return of the episodes that ended
        self.curve = "deliveries_per_100_steps" if "deliveries" in env.observation_spec.keys() else "episode_return"
        self.algo = make_mappo(config, self.obs_dim, self.n_agents, self.n_actions, device, self.dist)
        self.state = self.algo.init()  # its "optim" is Adam's state: the optimizer is part of the learner
        if self.dist is not None:  # the same init on every rank, by seed; made certain
            self.dist.broadcast_state(self.state)
        self.total = config.num_iterations
        self.gen = torch.Generator(device=device).manual_seed(config.run.seed)
        self.carry = env.reset()
        self.carry_keys = list(self.carry.keys(True, True))  # what a step reads of the carry (not the stale action)
        self.running = torch.zeros(self.local_envs, device=device)  # team return of each env's episode so far

    def _gathered(self, td: TensorDict) -> TensorDict:
        """Every rank's rows of ``td`` (batch [N/W, ...]) in rank order, [N, ...]; ``td`` in one process."""
        return td if self.dist is None else self.dist.all_gather_batch(td, dim=0)

    def _rows(self, t):
        """This rank's rows of ``t`` (a tensor or TensorDict of the single process's N envs)."""
        return t[self.rank * self.local_envs:(self.rank + 1) * self.local_envs]

    def _policy(self, obs, mask):
        return self.algo.act(self.state, obs, mask, self.gen)

    def step(self, i: int, stopping: bool) -> dict:
        config, env = self.config, self.env
        t0 = time.perf_counter()
        if config.loss == "ppo":
            batch, self.carry = collect(env, self._policy, self.carry, config.rollout_steps)
            with torch.no_grad():
                batch["next", "state_value"] = state_value(self.algo.nets, self.state["params"],
                                                           batch["next", "agents", "observation"], config.critic)
            ended, self.running = _episode_returns(batch["next", "agents", "reward"], batch["next", "done"], self.running)
        else:
            self.carry = grouped_reset(env, config.group_size)
            batch, self.carry = collect(env, self._policy, self.carry, config.episode_steps)
            ended = batch["next", "agents", "reward"].sum((1, 2, 3)).tolist()
        del batch["next", "agents", "observation"]
        t1 = time.perf_counter()
        with span("update"):
            self.state, metrics = self.algo.iteration(self.state, batch, self.gen)  # at the lr of state["iteration"] = i - 1
        t2 = time.perf_counter()
        # the job's statistics: every rank's envs and episodes
        stats = self._gathered(TensorDict({"team_reward": batch["next", "agents", "reward"].sum((-2, -1)),
                                           **{k: batch["next", k] for k in COUNT_KEYS if ("next", k) in batch.keys(True)}},
                                          batch_size=batch.batch_size[:2]))
        if self.dist is not None:
            ended = [r for part in self.dist.gather_objects(ended) for r in part]
        record = {"iteration": i, "step": int(self.state["env_steps"]),
                  "steps_per_s": config.steps_per_iteration / (t2 - t0), "collect_s": t1 - t0, "update_s": t2 - t1,
                  "lr": linear_lr(config.lr, i - 1, config.num_iterations, config.anneal_lr), **metrics,
                  "train_reward_per_step": float(stats["team_reward"].mean())}
        ended = [r for r in ended if math.isfinite(r)]  # a NaN or inf team reward's episode counts nowhere, as in ppo's line
        if ended:
            record["episode_return"] = sum(ended) / len(ended)
        if "deliveries" in stats.keys():
            steps = stats["deliveries"].numel()
            record["deliveries_per_100_steps"] = 100.0 * float(stats["deliveries"].sum()) / steps
            record["conflicts_per_100_steps"] = 100.0 * float(
                stats["vertex_conflicts"].sum() + stats["swap_conflicts"].sum()) / steps
        return record

    def saved(self) -> tuple[TensorDict, dict]:
        carry = self._gathered(TensorDict({"env": self.carry.select(*self.carry_keys), "running": self.running},
                                          batch_size=[self.local_envs]))  # every rank's envs: the single process's layout
        tensors = TensorDict({**learner_entries(self.state), "rng": self.gen.get_state(),
                              "carry": {"env": carry["env"], "running": carry["running"]}},
                             batch_size=[])
        captured = _env_capture(self.config, self.env)
        if captured is not None:
            if self.dist is not None:
                captured["state"] = self._gathered(captured["state"])
            tensors["env"] = captured
        meta = {"algo": "mappo", "config": dataclasses.asdict(self.config), "obs_dim": self.obs_dim,
                "n_agents": self.n_agents, "n_actions": self.n_actions, "iteration": int(self.state["iteration"]),
                "env_steps": int(self.state["env_steps"]), "world_size": self.world_size, **state_meta()}
        if not self.settable:
            meta["rware_resets"] = self.env.rng_state()["resets"]
        return tensors, meta

    def restore(self, loaded: TensorDict, meta: dict) -> None:
        """Warns (UserWarning) when the snapshot holds no env state (rware): the run starts new episodes."""
        env = self.env
        with torch.no_grad():  # in place: the policy holds these leaves
            self.state.exclude("optim").update_(loaded["learner"])
            self.state["optim"].update_(loaded["optim"])
        set_generator_state(self.gen, loaded["rng"])
        if "env" in loaded.keys():  # the single process's N envs: this rank's rows (all of them in one process)
            env.set_rng_state(loaded["env", "rng"])
            state = TensorDict(loaded["env", "state"].to_dict(), batch_size=[self.config.num_envs])
            self.carry = env.set_state(self._rows(state))
            for key in self.carry_keys:
                self.carry.set_(key, self._rows(loaded["carry", "env"].get(key)))
            self.running = self._rows(loaded["carry", "running"]).clone()
            return
        if not self.settable:  # e.g. rware: new episodes, not the first ones again
            env.set_rng_state({**env.rng_state(), "resets": int(meta.get("rware_resets", 0))})
            self.carry = env.reset()
        warnings.warn(f"{self.config.env}: the env's state cannot be captured, so the resumed run starts new episodes "
                      "and is not bit-identical to an uninterrupted one", stacklevel=2)

    def upgrade(self, loaded: TensorDict, meta: dict, where: str) -> TensorDict:
        return upgrade_layout_1(loaded, meta, where, self.saved()[0], algo="mappo", commit=LAYOUT_1_COMMIT)

    def evaluate(self) -> dict:
        return {"algo": "mappo", **evaluate_state(self.config, self.algo, self.state, self.device)}

    def close(self) -> None:
        self.env.close()

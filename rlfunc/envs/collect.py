"""Environments to TensorDict batches: gymnasium vector envs, our rollout loop, and TorchRL collectors.

Two ways to collect, giving the same batches (tested):

- :func:`rollout` steps a gymnasium vector env (SAME_STEP autoreset) with a policy function and
  writes a ``[N, T]`` TensorDict with TorchRL's keys. It is the trainer's default because it is
  several times faster than a TorchRL collector on cheap envs (bench/collect.py) and because its
  env state can be checkpointed for exact resume (:func:`env_state`).
- :func:`make_collector` wraps the same vector env in TorchRL's ``GymWrapper`` and our functional
  policy in a ``TensorDictModule`` and returns a TorchRL ``Collector``, for use inside TorchRL code.

Batch keys (TorchRL conventions), all ``[N, T, ...]``: "observation", "action", "sample_log_prob",
("next", "observation") (the true final observation at episode ends), ("next", "reward"),
("next", "done"), ("next", "terminated"), ("next", "truncated"), ("next", "episode_reward")
(return of the episode so far, including this step).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict
from torch import Tensor

from rlfunc.core.returns import forward_discounted_sum
from rlfunc.device import span
from rlfunc.envs import registry
from rlfunc.envs.state import env_state, set_env_state  # noqa: F401  (env state for exact resume: re-exported)
from rlfunc.errors import EnvError, RLFuncError

Policy = Callable[[Tensor], tuple[Tensor, Tensor]]


def check_env_id(env_id: str) -> None:
    """Raise EnvError (with close matches) when ``env_id`` is not registered with gymnasium.

    ``"module:EnvName-v0"`` (gymnasium's form for an env registered by importing ``module``, which
    ``gym.make`` and every env worker process do) imports ``module`` first; an import that fails is
    one EnvError line."""
    registry.ensure_loaded()  # the env plugins register their gymnasium ids
    name = env_id
    if isinstance(env_id, str) and env_id.count(":") == 1:
        module, name = env_id.split(":")
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001  (the user's module: any error at import)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise EnvError(f"env={env_id!r}: importing {module!r} (which registers {name!r}) failed: "
                           f"{type(e).__name__}: {first}") from None
        if name in gym.registry:
            return
        close = difflib.get_close_matches(name, list(gym.registry), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise EnvError(f"env={env_id!r}: importing {module!r} registered no gymnasium environment {name!r}{hint}")
    if env_id not in gym.registry:
        entry = registry.find(env_id)
        if entry is not None and entry.multi_agent_env is not None:  # rlfunc's own multi-agent env, not a gymnasium one
            raise EnvError(f"env={env_id!r}: a multi-agent env of rlfunc's env registry, not a gymnasium environment; "
                           f"train it with `rlfunc train mappo --env {env_id}`")
        close = difflib.get_close_matches(env_id, list(gym.registry), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise EnvError(f"env={env_id!r}: not a registered gymnasium environment{hint}")


def gym_spec(env_id: str):
    """gymnasium's EnvSpec of ``env_id`` (``gym.spec``, which does not take the ``"module:EnvName-v0"``
    form: the module is imported, :func:`check_env_id`, and the name looked up)."""
    check_env_id(env_id)
    return gym.spec(env_id.split(":")[-1])


def make_env(env_id: str, **env_kwargs: Any) -> gym.Env:
    """``gym.make(env_id, **env_kwargs)``, one env, with its build errors in one line.

    Raises:
        EnvError: unknown ``env_id``, or an env that cannot be built here (e.g. a missing optional
            dependency such as box2d: gymnasium's DependencyNotInstalled, an ImportError, ...).
    """
    check_env_id(env_id)
    try:
        return gym.make(env_id, **env_kwargs)
    except Exception as e:  # gymnasium raises many types here
        raise _build_error(env_id, e) from e


def _build_error(env_id: str, e: Exception) -> EnvError:
    """The one-line EnvError for an env that gymnasium could not build: its error's type and first line."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return EnvError(f"env={env_id!r} could not be built: {type(e).__name__}: {first}")


def make_vec_env(env_id: str, num_envs: int, *, vectorization: str = "sync", workers: int = 0,
                 **env_kwargs: Any) -> gym.vector.VectorEnv:
    """A gymnasium vector env of ``num_envs`` copies with SAME_STEP autoreset.

    ``workers`` = K >= 1 steps them in K worker processes, ``num_envs / K`` each
    (:class:`rlfunc.envs.workers.WorkerVectorEnv`: the same batches as ``workers=0`` for the same
    seeds and actions, and its env state captured by the workers); 0 steps them in this process
    (``vectorization`` "sync"), or one process per env with gymnasium's AsyncVectorEnv ("async": started
    by forkserver, observations sent through pipes, as its shared memory does not carry Text spaces).

    Raises:
        EnvError: unknown ``env_id``, ``num_envs < 1``, an unknown ``vectorization``, ``workers`` with
            "async", ``num_envs`` not divisible by ``workers``, or an env that cannot be built here
            (e.g. a missing optional dependency such as box2d).
    """
    check_env_id(env_id)
    if num_envs < 1:
        raise EnvError(f"num_envs={num_envs}: expected >= 1")
    if vectorization not in ("sync", "async"):
        raise EnvError(f"vectorization={vectorization!r}: expected 'sync' or 'async'")
    if workers:
        from rlfunc.envs.workers import WorkerVectorEnv, worker_slices

        if vectorization != "sync":
            raise EnvError(f"workers={workers} with vectorization={vectorization!r}: each worker holds a sync vector env")
        worker_slices(num_envs, workers)  # EnvError naming both
    try:
        if workers:
            return WorkerVectorEnv(env_id, num_envs, workers, **env_kwargs)
        vector_kwargs = {"autoreset_mode": AutoresetMode.SAME_STEP}
        if vectorization != "async":
            return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode=vectorization, vector_kwargs=vector_kwargs, **env_kwargs)
        from rlfunc.envs.workers import without_main

        # fresh workers (forked ones deadlocked in EGL after this process rendered), started without re-running this
        # process's main script (one without a __main__ guard failed), observations through pipes (gymnasium's shared
        # memory returned a Text observation's placeholder, "aaa...")
        vector_kwargs.update(context="forkserver", shared_memory=False)
        with without_main():
            return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode=vectorization, vector_kwargs=vector_kwargs,
                                **env_kwargs)
    except Exception as e:  # gymnasium raises many types here (DependencyNotInstalled, ImportError, ...)
        raise _build_error(env_id, e) from e


@functools.lru_cache(maxsize=None)
def reports_success(env_id: str) -> bool:
    """Whether the gymnasium env ``env_id`` puts "is_success" in its step info (one env is made,
    reset and stepped once with the mid-range action, then closed; the answer is cached per id);
    Pusher-v5 and Pendulum-v1, for two, do not. Runs and evaluations report a success rate only for
    envs that do.

    Raises:
        EnvError: as :func:`make_env`.
    """
    env = make_env(env_id)
    try:
        env.reset(seed=0)
        space = env.action_space
        action = ((space.low + space.high) / 2).astype(space.dtype) if isinstance(space, gym.spaces.Box) else space.sample()
        info = env.step(np.asarray(action))[-1]
        return "is_success" in info
    finally:
        env.close()


def eval_workers(workers: int, num_envs: int) -> int:
    """The worker processes an evaluation of ``num_envs`` envs steps in: the most, at most ``workers``
    (a run's ``env_workers``), that divide ``num_envs``; 0 (this process) for ``workers`` 0. The
    episodes are the same for any count (:func:`make_vec_env`)."""
    return max((k for k in range(1, min(workers, num_envs) + 1) if num_envs % k == 0), default=0)


def env_seeds(seed: int, num_envs: int) -> list[int]:
    """Per-env reset seeds derived from one run seed (numpy SeedSequence, so they never collide)."""
    return [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(num_envs)]


def empty_carry(num_envs: int, obs_dim: int) -> TensorDict:
    """The rollout carry with zeros: "observation" [N, obs_dim] (flattened), and the running episode
    statistics "episode_reward" [N, 1], "episode_length" [N, 1] int64, "episode_nonfinite" [N, 1]
    (count of non-finite rewards in the current episode; its return is reported as NaN)."""
    return TensorDict(
        {
            "observation": torch.zeros(num_envs, obs_dim),
            "episode_reward": torch.zeros(num_envs, 1),
            "episode_length": torch.zeros(num_envs, 1, dtype=torch.int64),
            "episode_nonfinite": torch.zeros(num_envs, 1),
        },
        batch_size=[num_envs],
    )


def _flat_obs(obs: Any, n: int) -> Tensor:
    return torch.from_numpy(np.asarray(obs, dtype=np.float32).reshape(n, -1))


def _action_bounds(space: gym.spaces.Box) -> tuple[Tensor, Tensor]:
    """The flat action bounds (low, high) [act_dim] in the space's float dtype, for :func:`_env_action`."""
    dtype = space.dtype if np.issubdtype(space.dtype, np.floating) else np.float32
    low, high = (torch.as_tensor(np.asarray(b, dtype).reshape(-1)) for b in (space.low, space.high))
    return low, high


def _env_action(action: Tensor, bounds: tuple[Tensor, Tensor], shape: tuple[int, ...]) -> np.ndarray:
    """Flat float32 host actions [N, act_dim] -> a new array [N, *shape] for the env, clipped to the
    bounds in the bounds' dtype (a double-precision Box gets double actions, exactly within its
    bounds). Never NaN or inf: NaN becomes 0, and +-inf (left by an infinite bound) the dtype's
    largest finite value. Two torch ops: per env step this costs a few microseconds, against ~50
    for numpy's clip + nan_to_num on small arrays."""
    return torch.clamp(action, *bounds).nan_to_num_(0.0).numpy().reshape(action.shape[0], *shape)


def _action_codec(space: gym.Space) -> tuple[tuple[int, ...], torch.dtype, Callable[[Tensor], np.ndarray]]:
    """How the policy's actions of ``space`` are stored and handed to the env: (the per-env shape of
    a stored action, its dtype, ``to_env(actions [N, *shape]) -> a new array for venv.step``).

    Box: float32 [act_dim] (flattened), clipped to the bounds by :func:`_env_action` (the rollout
    calls that itself, one Python frame fewer per step). Discrete(n):
    int64 [] indices in [0, n), the env gets ``start + index`` [N] in the space's dtype.
    MultiDiscrete(nvec): int64 [H] (H = nvec.size, flattened), the env gets ``start + index``
    reshaped to [N, *nvec.shape]. Discrete actions are not clipped: a categorical policy draws
    valid indices only.

    Raises:
        EnvError: any other action space.
    """
    if isinstance(space, gym.spaces.Box):
        bounds, shape = _action_bounds(space), space.shape
        return (int(np.prod(shape)),), torch.float32, lambda action: _env_action(action, bounds, shape)
    if isinstance(space, gym.spaces.Discrete):
        start, dtype = int(space.start), space.dtype
        return (), torch.int64, lambda action: (action.numpy() + start).astype(dtype, copy=False)
    if isinstance(space, gym.spaces.MultiDiscrete):
        start, shape, dtype = space.start.reshape(-1).astype(np.int64), space.shape, space.dtype
        return ((int(np.prod(shape)),), torch.int64,
                lambda action: (action.numpy() + start).astype(dtype, copy=False).reshape(action.shape[0], *shape))
    raise EnvError(f"action space {space}: expected Box, Discrete or MultiDiscrete")


@contextlib.contextmanager
def _env_errors(venv: gym.vector.VectorEnv, what: str):
    """An exception from the env's own code in ``venv``'s ``what`` ("step", "reset") as one EnvError
    line naming the env and the exception (chained: ``__cause__`` keeps its traceback for the Python
    API), as a worker process's is (a traceback of gymnasium's frames and exit 1 before)."""
    try:
        yield
    except (RLFuncError, KeyboardInterrupt):
        raise
    except Exception as e:
        spec = getattr(venv, "spec", None)
        name = f"env={spec.id!r}" if getattr(spec, "id", None) else "the env"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise EnvError(f"{name}: its {what} raised {type(e).__name__}{': ' + first if first else ''}") from e


def reset(venv: gym.vector.VectorEnv, seeds: Sequence[int]) -> TensorDict:
    """Reset every env with its seed; returns :func:`empty_carry` holding the first observations."""
    with _env_errors(venv, "reset"):
        obs, _ = venv.reset(seed=list(seeds))
    first = _flat_obs(obs, venv.num_envs)
    carry = empty_carry(venv.num_envs, first.shape[-1])
    carry["observation"] = first
    return carry


def rollout(
    venv: gym.vector.VectorEnv,
    policy: Policy,
    carry: TensorDict,
    num_steps: int,
    *,
    device: torch.device,
    timing: dict | None = None,
) -> tuple[TensorDict, TensorDict]:
    """Step ``venv`` ``num_steps`` times with ``policy``; returns (batch [N, T] on ``device``, new carry).

    Args:
        venv: a gymnasium vector env with SAME_STEP autoreset (:func:`make_vec_env`) with Box
            observations of any shape (flattened, obs_dim) and Box actions of any shape (flattened,
            act_dim), Discrete or MultiDiscrete actions (:func:`_action_codec`).
        policy: ``observation [N, obs_dim] (device) -> (action [N, act_dim], sample_log_prob [N, 1])``;
            the env receives the action clipped to its bounds (NaN -> 0), the batch stores it as drawn.
            Discrete: int64 indices ``action [N]``, MultiDiscrete ``[N, H]``, stored as drawn (int64).
            A policy that returns None for the log-probability (every step) leaves "sample_log_prob"
            out of the batch, for a learner that computes it over the whole batch afterwards.
        carry: the previous rollout's carry (or :func:`reset`'s); host tensors.
        num_steps: T, steps per env.
        device: where the batch goes, in one copy at the end.
        timing: when given, ``timing["env_wait_s"]`` is set to the seconds spent in ``venv.step``
            (waiting for the envs, or their worker processes).

    The only per-step host<->device traffic is the observation in and the action out. Each step's
    policy call and env step are the profiler ranges "policy_forward" and "env_step".
    """
    n = venv.num_envs
    space = venv.single_action_space
    obs_dim = carry["observation"].shape[-1]
    act_shape, act_dtype, to_env = _action_codec(space)
    box = isinstance(space, gym.spaces.Box)
    bounds = _action_bounds(space) if box else None
    observation = torch.empty(num_steps + 1, n, obs_dim)  # [t] observed at t; [T] the next carry
    action = torch.empty(num_steps, n, *act_shape, dtype=act_dtype)
    log_prob = torch.empty(num_steps, n, 1)
    with_log_prob = True
    reward = np.empty((num_steps, n), np.float32)
    terminated = np.empty((num_steps, n), bool)
    truncated = np.empty((num_steps, n), bool)
    final = []  # (t, env indices, final observations) at episode ends

    observation[0] = carry["observation"]
    env_wait = 0.0
    with torch.inference_mode():  # cheaper per op than no_grad; the buffers above stay normal tensors
        for t in range(num_steps):
            with span("policy_forward"):
                act, logp = policy(observation[t].to(device, non_blocking=True))
                action[t] = act
            if logp is None:
                with_log_prob = False
            else:
                log_prob[t] = logp
            env_action = _env_action(action[t], bounds, space.shape) if box else to_env(action[t])
            with span("env_step"):
                t0 = time.perf_counter()
                with _env_errors(venv, "step"):
                    next_obs, rew, term, trunc, info = venv.step(env_action)
                env_wait += time.perf_counter() - t0
            reward[t], terminated[t], truncated[t] = rew, term, trunc
            observation[t + 1] = _flat_obs(next_obs, n)
            if "_final_obs" in info:
                idx = np.flatnonzero(info["_final_obs"])
                if idx.size:
                    final.append((t, idx, np.stack(info["final_obs"][idx]).reshape(idx.size, -1)))

    if timing is not None:
        timing["env_wait_s"] = env_wait
    next_observation = observation[1:].clone()
    for t, idx, obs in final:
        next_observation[t, idx] = torch.as_tensor(obs, dtype=torch.float32)
    term_t = torch.from_numpy(terminated).unsqueeze(-1)
    trunc_t = torch.from_numpy(truncated).unsqueeze(-1)
    done_t = term_t | trunc_t
    reward_t = torch.from_numpy(reward).unsqueeze(-1)
    # return so far of each episode: R_t = r_t + (1 - done_{t-1}) R_{t-1}, carried across rollouts;
    # non-finite rewards are counted apart so they void their own episode's return, not later ones
    not_done_before = torch.cat([torch.ones(1, n, 1), (~done_t[:-1]).float()])
    finite = reward_t.isfinite()
    episode_reward = forward_discounted_sum(
        torch.where(finite, reward_t, torch.zeros_like(reward_t)), not_done_before, time_dim=0,
        initial=carry["episode_reward"].unsqueeze(0),
    )
    nonfinite = forward_discounted_sum(
        (~finite).float(), not_done_before, time_dim=0, initial=carry["episode_nonfinite"].unsqueeze(0)
    )
    steps = torch.arange(1, num_steps + 1).view(-1, 1, 1)
    last_end = torch.where(done_t, steps, torch.zeros_like(steps)).amax(0)  # [N, 1], 0: no end
    episode_length = torch.where(last_end > 0, num_steps - last_end, carry["episode_length"] + num_steps)
    nt = lambda x: x.transpose(0, 1).contiguous()  # noqa: E731  [T, N, ...] -> [N, T, ...], per tensor: a TensorDict
    batch = TensorDict(  # a TensorDict transpose + to() cost 0.11 ms of a 0.52 ms 1-step rollout (sac, td3; bench/rollout_step.py)
        {
            "observation": nt(observation[:-1]),
            "action": nt(action),
            **({"sample_log_prob": nt(log_prob)} if with_log_prob else {}),
            "next": {
                "observation": nt(next_observation),
                "reward": nt(reward_t),
                "done": nt(done_t),
                "terminated": nt(term_t),
                "truncated": nt(trunc_t),
                "episode_reward": nt(episode_reward.masked_fill(nonfinite > 0, float("nan"))),
            },
        },
        batch_size=[n, num_steps],
        device="cpu",  # the buffers above are host tensors
    )
    if torch.device(device).type != "cpu":
        batch = batch.to(device, non_blocking=True)
    ended = done_t[-1]
    new_carry = TensorDict(
        {
            "observation": observation[-1].clone(),
            "episode_reward": episode_reward[-1].masked_fill(ended, 0.0),
            "episode_length": episode_length,
            "episode_nonfinite": nonfinite[-1].masked_fill(ended, 0.0),
        },
        batch_size=[n],
    )
    return batch, new_carry


# ---------------------------------------------------------------------------------------------
# TorchRL interop.


def make_torchrl_env(env_id: str, num_envs: int, *, device: torch.device | str = "cpu", **env_kwargs: Any):
    """The same vector env as :func:`make_vec_env`, wrapped as a TorchRL ``EnvBase`` (GymWrapper).

    Discrete actions are int64 indices (``categorical_action_encoding=True``), as :func:`rollout` and
    rlfunc's categorical policies give them; GymWrapper's default one-hot spec made a TorchRL
    collector over CartPole fail deep in gymnasium."""
    from torchrl.envs import GymWrapper

    return GymWrapper(make_vec_env(env_id, num_envs, **env_kwargs), device=device, categorical_action_encoding=True)


def policy_module(policy: Policy):
    """Wrap a functional policy as a ``TensorDictModule``: "observation" -> ("action", "sample_log_prob")."""
    from tensordict.nn import TensorDictModule

    return TensorDictModule(policy, in_keys=["observation"], out_keys=["action", "sample_log_prob"])


def make_collector(env, policy: Policy, frames_per_batch: int, total_frames: int = -1, **kwargs: Any):
    """A TorchRL ``Collector`` over a TorchRL env running our functional ``policy``.

    Batches come out ``[N, T]`` with the same keys as :func:`rollout` (without "episode_reward").
    """
    from torchrl.collectors import Collector

    kwargs.setdefault("auto_register_policy_transforms", False)
    return Collector(env, policy_module(policy), frames_per_batch=frames_per_batch, total_frames=total_frames, **kwargs)


def _final_success(info: dict, ended: np.ndarray) -> np.ndarray | None:
    """``info["is_success"]`` of the envs that ended this step (SAME_STEP autoreset keeps the final
    step's info under "final_info"), or None when the env reports no success."""
    final = info.get("final_info", info) if ended.any() else info
    if "is_success" not in final:
        return None
    return np.asarray(final["is_success"], bool)


def episode_outcomes(
    venv: gym.vector.VectorEnv, policy: Policy, seeds: Sequence[int], *, device: torch.device, max_steps: int = 100_000
) -> tuple[Tensor, Tensor | None]:
    """The return of the first episode of every env of ``venv`` (reset with ``seeds``), acting with
    ``policy``, and whether it ended in success.

    Returns:
        (returns [N] float32, undiscounted in env reward units; success [N] bool, or None when the env
        puts no "is_success" in its info).

    A warning names how many episodes the policy acted NaN in: the env receives such an action as 0
    (:func:`_env_action`), so that episode's return is not the policy's (a seed with NaN parameters
    scored like a healthy one, silently).

    Raises:
        EnvError: an episode has not ended after ``max_steps`` steps.
    """
    carry = reset(venv, seeds)
    obs = carry["observation"]
    to_env = _action_codec(venv.single_action_space)[2]
    n = venv.num_envs
    total = np.zeros(venv.num_envs, np.float64)  # ok-float64: host-side numpy accumulator
    finished = np.zeros(venv.num_envs, bool)
    success, reported = np.zeros(n, bool), False
    acted_nan = np.zeros(n, bool)
    for _ in range(max_steps):
        with torch.no_grad():
            act, _ = policy(obs.to(device))
        act = act.cpu()
        if act.is_floating_point():
            acted_nan |= ~finished & act.isnan().reshape(n, -1).any(1).numpy()
        with _env_errors(venv, "step"):
            next_obs, rew, term, trunc, info = venv.step(to_env(act))
        total += np.where(finished, 0.0, rew)
        ended = (term | trunc) & ~finished
        flags = _final_success(info, ended)
        if flags is not None:
            reported = True
            success |= ended & flags
        finished |= term | trunc
        if finished.all():
            if acted_nan.any():
                warnings.warn(f"evaluation: the policy's actions held NaN in {int(acted_nan.sum())} of {n} episodes (NaN or inf "
                              "parameters or observations?); the env received them as 0, so those returns are not the policy's",
                              stacklevel=2)
            return torch.as_tensor(total, dtype=torch.float32), torch.as_tensor(success) if reported else None
        obs = _flat_obs(next_obs, n)
    spec = getattr(venv, "spec", None)
    limit = getattr(spec, "max_episode_steps", None) if spec is not None else None
    why = "" if limit else " (its gymnasium registration has no max_episode_steps: register it with one, or end episodes in the env)"
    raise EnvError(f"evaluation: {int((~finished).sum())} of {n} episodes did not end within {max_steps} steps{why}")

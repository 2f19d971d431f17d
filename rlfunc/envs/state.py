"""The state of gymnasium envs, for exact resume: :func:`env_state` captures it as JSON-able data and
:func:`set_env_state` puts it back (numpy and MuJoCo only: env worker processes call these too,
:mod:`rlfunc.envs.workers`). ``rlfunc.envs.collect`` re-exports both."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from rlfunc.errors import EnvError


def _time_limit(env: gym.Env) -> gym.Env | None:
    while env is not None:
        if hasattr(env, "_elapsed_steps"):
            return env
        env = getattr(env, "env", None)
    return None


def env_state(venv: gym.vector.VectorEnv) -> list[dict] | None:
    """JSON-able state of every sub-env (RNG, time-limit counter, physics), or None if not capturable.

    Captured: the unwrapped env's numpy RNG state, the TimeLimit step counter, and the physical state:
    MuJoCo envs (full integration state via ``mujoco.mj_getState``) and envs with a ``state`` array
    (classic control); a :class:`~rlfunc.envs.workers.WorkerVectorEnv`'s workers capture their own.
    Async vector envs and other envs return None: a resume then starts new episodes.
    """
    if hasattr(venv, "env_state") and not hasattr(venv, "envs"):  # WorkerVectorEnv
        return venv.env_state()
    if not hasattr(venv, "envs"):
        return None
    states = []
    for env in venv.envs:
        u = env.unwrapped
        item: dict[str, Any] = {"rng": u.np_random.bit_generator.state}
        limit = _time_limit(env)
        item["elapsed_steps"] = None if limit is None else limit._elapsed_steps
        if hasattr(u, "data") and hasattr(u, "model"):
            import mujoco

            spec = mujoco.mjtState.mjSTATE_INTEGRATION
            buf = np.empty(mujoco.mj_stateSize(u.model, spec))
            mujoco.mj_getState(u.model, u.data, buf, spec)
            item["mujoco"] = buf.tolist()
        elif isinstance(getattr(u, "state", None), (np.ndarray, tuple, list)):
            item["state"] = np.asarray(u.state).tolist()
            item["state_dtype"] = str(np.asarray(u.state).dtype)
        else:
            return None
        states.append(item)
    return states


def set_env_state(venv: gym.vector.VectorEnv, states: list[dict]) -> None:
    """Restore what :func:`env_state` captured, into a vector env that has been reset once."""
    if hasattr(venv, "set_env_state") and not hasattr(venv, "envs"):  # WorkerVectorEnv
        return venv.set_env_state(states)
    if len(states) != venv.num_envs:
        raise EnvError(f"env state has {len(states)} envs, the vector env has {venv.num_envs}")
    for env, item in zip(venv.envs, states):
        u = env.unwrapped
        u.np_random.bit_generator.state = item["rng"]
        limit = _time_limit(env)
        if limit is not None:
            limit._elapsed_steps = item["elapsed_steps"]
        if "mujoco" in item:
            import mujoco

            mujoco.mj_setState(u.model, u.data, np.asarray(item["mujoco"]), mujoco.mjtState.mjSTATE_INTEGRATION)
            mujoco.mj_forward(u.model, u.data)
        else:
            u.state = np.asarray(item["state"], dtype=item.get("state_dtype", np.asarray(u.state).dtype))

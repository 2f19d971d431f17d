"""The public multi-robot warehouse benchmark (PyPI ``rware``, Papoudakis et al. 2021) as a batched
TorchRL multi-agent ``EnvBase`` with Warehouse-v0's keys, so the same shared-parameter learners run on it.

``RwareEnv(env_id, num_envs)`` holds ``num_envs`` gymnasium instances (``gymnasium.make(env_id)``,
e.g. "rware-tiny-2ag-v2": a tuple of per-agent observations and ``Discrete(5)`` actions) and steps
them in a Python loop. Keys, as :class:`envs.warehouse.WarehouseEnv`:

- ("agents", "observation") [N, A, D] float32; ("agents", "action") [N, A] int64 in [0, 5);
- ("next", "agents", "reward") [N, A, 1] float32 (rware's per-agent rewards: +1 on delivery);
- ("next", "done" | "terminated" | "truncated") [N, 1] bool. rware 2.0 reports the end of its
  ``max_steps`` (500) episode as ``terminated``; it is a time limit, so it is passed on as
  ``truncated`` (terminated stays False, and GAE bootstraps from the last observation).

No action mask (rware has none). Reset seeds: instance k of a reset with generator seed s gets
``s * 100_003 + k + count`` with ``count`` the resets so far, so a seeded env replays exactly.

Reference: Papoudakis, Christianos, Schaefer & Albrecht (2021), "Benchmarking Multi-Agent Deep
Reinforcement Learning Algorithms in Cooperative Tasks", NeurIPS Datasets and Benchmarks (RWARE).
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

from rlfunc.errors import EnvError


def make_rware(env_id: str):
    """``gymnasium.make(env_id)`` after importing ``rware`` (which registers its ids).

    Raises:
        EnvError: rware is not installed, or ``env_id`` is not one of its ids.
    """
    try:
        import gymnasium as gym
        import rware  # noqa: F401  (registers "rware-*" ids)
    except ImportError as e:
        raise EnvError(f"env={env_id!r} needs the rware package (pip install rware==2.0.0): {e}") from None
    try:
        return gym.make(env_id, disable_env_checker=True)
    except gym.error.Error as e:
        raise EnvError(f"env={env_id!r}: not an rware id ({e})") from None


class RwareEnv(EnvBase):
    """``num_envs`` rware instances stepped together; see the module docstring.

    Args:
        env_id: an rware id, e.g. "rware-tiny-2ag-v2".
        num_envs: N >= 1.
        seed: base reset seed (None: 0).

    Raises:
        EnvError: as :func:`make_rware`, or ``num_envs`` < 1.
    """

    def __init__(self, env_id: str = "rware-tiny-2ag-v2", num_envs: int = 1, *, seed: int | None = None):
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise EnvError(f"num_envs={num_envs!r}: expected an int >= 1")
        super().__init__(device=torch.device("cpu"), batch_size=torch.Size([num_envs]))
        self.envs = [make_rware(env_id) for _ in range(num_envs)]
        self.env_id, self.num_envs = env_id, num_envs
        first = self.envs[0]
        self.n_agents = a = len(first.action_space)
        self.obs_dim = d = int(np.prod(first.observation_space[0].shape))
        self.n_actions = int(first.action_space[0].n)
        n = num_envs
        self.observation_spec = Composite(
            agents=Composite(observation=Unbounded(shape=(n, a, d), dtype=torch.float32), shape=(n, a)), shape=(n,)
        )
        self.action_spec = Composite(
            agents=Composite(action=Categorical(self.n_actions, shape=(n, a), dtype=torch.int64), shape=(n, a)), shape=(n,)
        )
        self.reward_spec = Composite(
            agents=Composite(reward=Unbounded(shape=(n, a, 1), dtype=torch.float32), shape=(n, a)), shape=(n,)
        )
        flag = Categorical(2, shape=(n, 1), dtype=torch.bool)
        self.done_spec = Composite(done=flag, terminated=flag.clone(), truncated=flag.clone(), shape=(n,))
        self._obs = np.zeros((n, a, d), dtype=np.float32)
        self._base_seed, self._resets = 0, 0
        self.set_seed(seed)

    def _set_seed(self, seed: int | None) -> None:
        self._base_seed, self._resets = (0 if seed is None else int(seed)), 0

    def rng_state(self) -> dict:
        """What decides the next episodes: {"base_seed", "resets"} (episode k of env i is seeded from
        both), for a resumed run to start new episodes rather than the first ones again."""
        return {"base_seed": self._base_seed, "resets": self._resets}

    def set_rng_state(self, state: dict) -> None:
        """Restore :meth:`rng_state`'s dict. Raises EnvError on anything else."""
        try:
            base_seed, resets = int(state["base_seed"]), int(state["resets"])
        except (KeyError, TypeError, ValueError) as e:
            raise EnvError(f"state={state!r}: expected {{'base_seed': int, 'resets': int}} from rng_state()") from e
        self._base_seed, self._resets = base_seed, resets

    def _reset_one(self, k: int) -> None:
        obs, _ = self.envs[k].reset(seed=(self._base_seed * 100_003 + k + self._resets) % 2**31)
        self._obs[k] = np.stack(obs)

    def _out(self, reward=None, done=None) -> TensorDict:
        n, a = self.num_envs, self.n_agents
        agents = {"observation": torch.from_numpy(self._obs.copy())}
        if reward is not None:
            agents["reward"] = torch.from_numpy(reward).unsqueeze(-1)
        flag = torch.zeros(n, 1, dtype=torch.bool) if done is None else torch.from_numpy(done).unsqueeze(-1)
        return TensorDict({"agents": TensorDict(agents, batch_size=[n, a]), "done": flag.clone(),
                           "terminated": torch.zeros(n, 1, dtype=torch.bool), "truncated": flag.clone()},
                          batch_size=[n])

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDict:
        mask = None if tensordict is None else tensordict.get("_reset", None)
        which = range(self.num_envs) if mask is None else np.flatnonzero(mask.reshape(-1).numpy())
        for k in which:
            self._reset_one(int(k))
        self._resets += self.num_envs
        return self._out()

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        action = tensordict["agents", "action"].cpu().numpy()
        if action.shape != (self.num_envs, self.n_agents) or (action < 0).any() or (action >= self.n_actions).any():
            raise EnvError(f"action: expected [{self.num_envs}, {self.n_agents}] ints in [0, {self.n_actions}), "
                           f"got shape {action.shape}")
        reward = np.zeros((self.num_envs, self.n_agents), dtype=np.float32)
        done = np.zeros(self.num_envs, dtype=bool)
        for k, env in enumerate(self.envs):
            obs, r, terminated, truncated, _ = env.step(tuple(int(x) for x in action[k]))
            self._obs[k] = np.stack(obs)
            reward[k] = r
            done[k] = bool(terminated or truncated)
        return self._out(reward, done)

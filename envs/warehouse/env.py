"""Warehouse-v0 as a torch-batched TorchRL multi-agent ``EnvBase`` and as a PettingZoo ``ParallelEnv``.

Both step the pure core of :mod:`envs.warehouse.core`. The TorchRL env lays out keys like TorchRL's
VMAS wrapper (one group, "agents"), so TorchRL's MAPPO recipe applies with the agent dim as one more
batch dim of a shared-parameter policy:

- ("agents", "observation") [N, A, D] float32 (layout: :func:`envs.warehouse.core.observation`);
- ("agents", "action_mask") [N, A, 5] bool (moves off the grid or into shelves are False);
- ("agents", "action") [N, A] int64 in [0, 5) (a ``Categorical`` spec, as VMAS with
  ``categorical_actions=True``);
- ("next", "agents", "reward") [N, A, 1] float32;
- ("next", "done" | "terminated" | "truncated") [N, 1] bool, shared by the agents (never terminated:
  the task is continuing; truncated after ``max_steps``); for per-agent advantages expand them to
  [N, A, 1] next to the reward, as TorchRL's MAPPO tutorial does;
- ("next", k) [N, 1] int64 step counts for k in "deliveries", "vertex_conflicts", "swap_conflicts",
  "obstacle_bumps", "idle" (0 in the reset output).

Not registered with gymnasium: a gymnasium ``Env`` has one agent, one action and one reward, so a
20-agent warehouse would have to be flattened into a joint action (5^20 choices) or a tuple space
that no single-agent learner in rlfunc consumes; PettingZoo is the multi-agent counterpart and
:class:`WarehouseParallelEnv` implements it.
"""

from __future__ import annotations

import numpy as np
import torch
from gymnasium import spaces
from pettingzoo import ParallelEnv
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

from envs.warehouse import core
from envs.warehouse.layout import Layout, WarehouseConfig, make_layout
from rlfunc.envs.split import SplitEnv
from rlfunc.errors import ConfigError, EnvError


def _check_config(config: WarehouseConfig) -> None:
    if not isinstance(config, WarehouseConfig):
        raise ConfigError(f"config={config!r}: expected a WarehouseConfig")
    if isinstance(config.obs_radius, bool) or not isinstance(config.obs_radius, int) or config.obs_radius < 0:
        raise ConfigError(f"obs_radius={config.obs_radius!r}: expected an int >= 0")
    if isinstance(config.max_steps, bool) or not isinstance(config.max_steps, int) or config.max_steps < 1:
        raise ConfigError(f"max_steps={config.max_steps!r}: expected an int >= 1")
    for name in ("delivery_reward", "pick_reward", "conflict_penalty", "shaping_scale"):
        value = getattr(config, name)
        if not isinstance(value, (int, float)) or not np.isfinite(value):
            raise ConfigError(f"{name}={value!r}: expected a finite number")


def _reset_where(state: TensorDict, fresh: TensorDict, mask: torch.Tensor) -> TensorDict:
    """``fresh`` where ``mask`` [N] is True, ``state`` elsewhere."""
    return fresh.apply(lambda f, s: torch.where(mask.view(-1, *([1] * (f.ndim - 1))), f, s), state)


class WarehouseEnv(SplitEnv, EnvBase):
    """Warehouse-v0: ``num_envs`` warehouses of ``config.n_agents`` AGVs each, batched on ``device``.

    Keys: see the module docstring. ``reset`` honours a partial "_reset" mask ([N] or [N, 1]), so
    ``env.rollout(T, policy, break_when_any_done=False)`` and TorchRL collectors auto-reset ended
    envs; an ended env stepped without reset is absorbing. Randomness comes only from an internal
    ``torch.Generator`` on ``device``, seeded by ``seed`` / ``set_seed``. On a CPU device actions are
    checked (a value outside [0, 5) raises ``ShapeError``); elsewhere, to avoid a host
    synchronisation per step, such an action means stay.

    Args:
        num_envs: N >= 1 warehouses.
        config: grid, agents, rewards, episode length.
        device: a torch device or its name (None: cpu).
        seed: seed of the generator; None draws a non-deterministic one.
        split: None, or (rank, world_size): these N warehouses are warehouses rank*N .. (rank+1)*N - 1
            of the world_size*N of ``seed`` (every reset draws for all of them and keeps its rows, so
            the world_size envs of a data-parallel run together step the one env of a single process).
        any_done_of_split: with ``split``, ``fn(done_here: bool) -> bool``, whether a warehouse of any
            rank of the split is done (a collective every rank calls once per step): TorchRL resets
            after a step where one is done, and the single process's generator draws then, so a rank
            whose warehouses are not done draws too (a reset of none of them). None: the ranks draw
            when one of their own is done (the same steps while every episode lasts ``max_steps``).

    Raises:
        EnvError: ``num_envs`` is not an int >= 1, or ``split`` not (rank, world_size) with
            0 <= rank < world_size.
        ConfigError: a bad ``config`` (see :class:`~envs.warehouse.layout.WarehouseConfig`).
    """

    def __init__(self, num_envs: int = 1, config: WarehouseConfig = WarehouseConfig(), *,
                 device: torch.device | str | None = None, seed: int | None = None,
                 split: tuple[int, int] | None = None, any_done_of_split=None):
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise EnvError(f"num_envs={num_envs!r}: expected an int >= 1")
        _check_config(config)
        self.set_split(split, any_done_of_split)
        device = torch.device("cpu") if device is None else torch.device(device)
        super().__init__(device=device, batch_size=torch.Size([num_envs]))
        self.num_envs, self.config = num_envs, config
        self.layout: Layout = make_layout(config).to(device)
        self.n_agents = a = config.n_agents
        self._generator = torch.Generator(device=device)
        n, d = num_envs, core.obs_dim(config.obs_radius)
        agents_obs = Composite(
            observation=Unbounded(shape=(n, a, d), dtype=torch.float32, device=device),
            action_mask=Categorical(2, shape=(n, a, core.N_ACTIONS), dtype=torch.bool, device=device),
            shape=(n, a), device=device,
        )
        counts = {k: Bounded(low=0, high=a, shape=(n, 1), dtype=torch.int64, device=device) for k in core.STEP_KEYS}
        self.observation_spec = Composite(agents=agents_obs, **counts, shape=(n,), device=device)
        self.action_spec = Composite(
            agents=Composite(action=Categorical(core.N_ACTIONS, shape=(n, a), dtype=torch.int64, device=device),
                             shape=(n, a), device=device),
            shape=(n,), device=device,
        )
        self.reward_spec = Composite(
            agents=Composite(reward=Unbounded(shape=(n, a, 1), dtype=torch.float32, device=device),
                             shape=(n, a), device=device),
            shape=(n,), device=device,
        )
        flag = Categorical(2, shape=(n, 1), dtype=torch.bool, device=device)
        self.done_spec = Composite(done=flag, terminated=flag.clone(), truncated=flag.clone(), shape=(n,), device=device)
        self._state = core.reset_state(self.layout, a, n, self._generator)  # placeholder until reset
        self.set_seed(seed)

    @property
    def state(self) -> TensorDict:
        """The current core state (see :mod:`envs.warehouse.core`), batch [N]: the live object."""
        return self._state

    def set_state(self, state: TensorDict) -> TensorDictBase:
        """Replace the core state (e.g. a hand-built one) and return the matching reset-style output."""
        self._state = state.to(self.device)
        return self._output(self._state, None, None)

    def rng_state(self) -> torch.Tensor:
        """The state of the generator that draws every reset (``torch.Generator.get_state``: a uint8
        CPU tensor); with :attr:`state`, all the env carries from one step to the next."""
        return self._generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Put back a :meth:`rng_state` (the tensor may be on any device).

        Raises:
            EnvError: ``state`` is not a uint8 tensor. RuntimeError: it is not the state of a
                generator of this env's device type.
        """
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            got = state.dtype if isinstance(state, torch.Tensor) else type(state).__name__
            raise EnvError(f"state: {got}: expected the uint8 tensor of rng_state()")
        self._generator.set_state(state.cpu().clone())  # a fresh CPU tensor: set_state misreads offset views

    def _set_seed(self, seed: int | None) -> None:
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(int(seed))

    def _output(self, state: TensorDict, reward, counts) -> TensorDict:
        n, a = self.num_envs, self.n_agents
        truncated = state["truncated"]
        agents = {"observation": core.observation(self.layout, state, self.config.obs_radius),
                  "action_mask": core.action_mask(self.layout, state)}
        if reward is not None:
            agents["reward"] = reward
        if counts is None:
            counts = {k: torch.zeros(n, 1, dtype=torch.int64, device=self.device) for k in core.STEP_KEYS}
        out = {
            "agents": TensorDict(agents, batch_size=[n, a], device=self.device),
            "done": truncated.clone(),
            "terminated": torch.zeros_like(truncated),
            "truncated": truncated.clone(),
            **dict(counts.items()),
        }
        return TensorDict(out, batch_size=self.batch_size, device=self.device)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDict:
        mask = None if tensordict is None else tensordict.get("_reset", None)
        rank, world_size = self._split
        fresh = core.reset_state(self.layout, self.n_agents, self.num_envs * world_size, self._generator)  # for every env of the split
        if world_size > 1:
            fresh = fresh[rank * self.num_envs : (rank + 1) * self.num_envs]
        self._state = fresh if mask is None else _reset_where(self._state, fresh, mask.reshape(self.num_envs))
        return self._output(self._state, None, None)

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        action = tensordict["agents", "action"]
        self._state, reward, counts, _ = core.step_state(
            self.layout, self._state, action, self.config, check_values=self.device.type == "cpu"
        )
        return self._output(self._state, reward, counts)


def _action(agent: str, value) -> int:
    """``value`` as agent ``agent``'s action index: an integer (Python, numpy, a 0-d integer array or tensor) in
    [0, N_ACTIONS). EnvError otherwise (1.7 was truncated to 1 silently, "x" a bare ValueError)."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point() and value.dtype != torch.bool:
        value = int(value)  # a torch policy's argmax
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, (int, np.integer)) or (
            isinstance(value, np.ndarray) and value.ndim == 0 and np.issubdtype(value.dtype, np.integer))):
        raise EnvError(f"step(): action of {agent!r} is {value!r}: expected an integer in [0, {core.N_ACTIONS})")
    if not 0 <= int(value) < core.N_ACTIONS:
        raise EnvError(f"step(): action of {agent!r} is {int(value)}: expected an integer in [0, {core.N_ACTIONS})")
    return int(value)


class WarehouseParallelEnv(ParallelEnv):
    """One Warehouse-v0 instance as a PettingZoo ``ParallelEnv`` (numpy in and out, torch core inside).

    Agents "agv_0" .. "agv_{A-1}"; observation ``Box(-1, 1, (D,), float32)`` and action
    ``Discrete(5)`` per agent; rewards as the TorchRL env; truncations all True after ``max_steps``
    (then ``agents`` is empty, PettingZoo's convention); terminations always False. ``infos[agent]``
    has "action_mask" (int8 [5]), "delivered", "vertex_conflict", "swap_conflict" (bool, this step).
    ``reset(seed=s)`` gives the same episode as ``WarehouseEnv(1, config, seed=s).reset()``.

    ``step(actions)`` takes {agent name: action}; an agent left out stays in place (action 0).

    Raises:
        ConfigError: as :class:`WarehouseEnv`. EnvError: ``step`` after the episode ended, or with a key
            that is not an agent's name.
    """

    metadata = {"name": "Warehouse-v0", "render_modes": []}

    def __init__(self, config: WarehouseConfig = WarehouseConfig(), render_mode: str | None = None):
        if render_mode is not None:
            raise EnvError(f"render_mode={render_mode!r}: Warehouse-v0 does not render")
        _check_config(config)
        self.config = config
        self.layout = make_layout(config)
        self.possible_agents = [f"agv_{i}" for i in range(config.n_agents)]
        self._agent_set = frozenset(self.possible_agents)
        self.agents: list[str] = []
        d = core.obs_dim(config.obs_radius)
        self._observation_space = spaces.Box(-1.0, 1.0, shape=(d,), dtype=np.float32)
        self._action_space = spaces.Discrete(core.N_ACTIONS)
        self._generator = torch.Generator()
        self._generator.seed()
        self.state_td: TensorDict | None = None

    def observation_space(self, agent: str) -> spaces.Box:
        return self._observation_space

    def action_space(self, agent: str) -> spaces.Discrete:
        return self._action_space

    def _observe(self) -> dict[str, np.ndarray]:
        obs = core.observation(self.layout, self.state_td, self.config.obs_radius)[0].numpy()
        return {agent: obs[i] for i, agent in enumerate(self.possible_agents)}

    def _infos(self, flags: dict[str, np.ndarray] | None = None) -> dict[str, dict]:
        mask = core.action_mask(self.layout, self.state_td)[0].numpy().astype(np.int8)
        infos = {}
        for i, agent in enumerate(self.possible_agents):
            info = {"action_mask": mask[i]}
            for k, v in (flags or {}).items():
                info[k] = bool(v[i])
            infos[agent] = info
        return infos

    def reset(self, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self._generator.manual_seed(int(seed))
        self.state_td = core.reset_state(self.layout, self.config.n_agents, 1, self._generator)
        self.agents = list(self.possible_agents)
        return self._observe(), self._infos()

    def step(self, actions: dict[str, int]):
        if not self.agents:
            raise EnvError("step() after the episode ended: call reset() first")
        unknown = [k for k in actions if k not in self._agent_set]  # {0: 1, ...} left every agent in place, silently
        if unknown:
            raise EnvError(f"step(): action keys {unknown[:3]!r}{' ...' if len(unknown) > 3 else ''} are not agents; "
                           f"expected names such as {self.possible_agents[0]!r} (an agent left out stays in place)")
        action = torch.tensor([[_action(agent, actions.get(agent, 0)) for agent in self.possible_agents]], dtype=torch.int64)
        self.state_td, reward, _, flags = core.step_state(self.layout, self.state_td, action, self.config)
        flag_np = {
            "delivered": flags["delivered"][0].numpy(),
            "vertex_conflict": flags["vertex"][0].numpy(),
            "swap_conflict": flags["swap"][0].numpy(),
        }
        truncated = bool(self.state_td["truncated"][0, 0])
        r = reward[0, :, 0].numpy()
        agents = self.possible_agents
        out = (
            self._observe(),
            {agent: float(r[i]) for i, agent in enumerate(agents)},
            {agent: False for agent in agents},
            {agent: truncated for agent in agents},
            self._infos(flag_np),
        )
        if truncated:
            self.agents = []
        return out

    def state(self) -> np.ndarray:
        """Global state: [H, W, 4] float32 of obstacle, agents, pick stations, drop stations (rows, cols).

        Raises:
            EnvError: before the first ``reset()``."""
        if self.state_td is None:  # was "'NoneType' object is not subscriptable"
            raise EnvError("state() before reset(): call reset() first")
        static = core._padded_static(self.layout, 0).clone()
        pos = self.state_td["position"][0]
        static[1, pos[:, 0], pos[:, 1]] = 1.0
        return static.permute(1, 2, 0).numpy()

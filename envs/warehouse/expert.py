"""Scripted Warehouse-v0 baselines: prioritised planning over BFS shortest paths with reservations.

Two planners, both conflict-free by construction (tests check zero conflicts on fixed seeds), both
Python/numpy per warehouse (a baseline, not training throughput). Priorities: agents whose current
task is oldest first, ties in a random order from the planner's seeded generator.

- :class:`PIBTPlanner` (the default, ``method="pibt"``): one-step reservations with priority
  inheritance, Okumura et al. (2019), "Priority Inheritance with Backtracking for Iterative
  Multi-agent Path Finding", IJCAI, Algorithm 1. An agent pushed out of a cell by a higher-priority
  one plans next, so queues at stations clear and nobody gridlocks on the default grid.
- :class:`ReservationPlanner` (``method="whca"``): windowed cooperative A* (Silver 2005,
  "Cooperative Pathfinding", AIIDE, sec. 5-6): each agent, in priority order, runs a space-time A*
  over (cell, t <= window) that avoids the cells and moves reserved by the agents planned before it
  and the current cells of the agents not yet planned; it reserves its path and executes the first
  move, and everybody replans every step. Measured on the default grid it gridlocks in the corners
  around drop stations on some seeds (nobody yields there), so it delivers less than PIBT.

Why no conflicts: a cell is reserved for t = 1 by at most one agent; an agent moves only into a cell
whose occupant has already reserved a different cell (so it leaves: "following"), never into the
cell of an agent that stays, and never into the cell of the agent it would swap with.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np
import torch
from tensordict import TensorDictBase
from torch import Tensor

from envs.warehouse.core import MOVES
from envs.warehouse.layout import UNREACHABLE, Layout
from rlfunc.errors import ConfigError

METHODS = ("pibt", "whca")


class _Planner:
    """Grid tables in numpy and the task-age priority shared by both planners."""

    def __init__(self, layout: Layout, seed: int):
        free = ~layout.obstacle.cpu().numpy()
        h, w = free.shape
        self.width = w
        self.distance = layout.distance.cpu().numpy().reshape(layout.distance.shape[0], -1)  # [S, H*W]
        self.rng = np.random.default_rng(seed)
        self.age: np.ndarray | None = None  # steps each agent has held its current goal
        self.last_goal: np.ndarray | None = None
        # (action, cell) of each free cell's free neighbours, stay first
        self.neighbours: list[list[tuple[int, int]]] = []
        for cell in range(h * w):
            r, c = divmod(cell, w)
            self.neighbours.append([
                (action, (r + dr) * w + c + dc) for action, (dr, dc) in enumerate(MOVES)
                if 0 <= r + dr < h and 0 <= c + dc < w and free[r + dr, c + dc]
            ])

    def _order(self, goal: np.ndarray) -> np.ndarray:
        if self.age is None or len(self.age) != len(goal):
            self.age, self.last_goal = np.zeros(len(goal), dtype=np.int64), goal.copy()
        self.age = np.where(goal == self.last_goal, self.age + 1, 0)
        self.last_goal = goal.copy()
        return np.lexsort((self.rng.random(len(goal)), -self.age))


class PIBTPlanner(_Planner):
    """PIBT for one warehouse (see the module docstring).

    Each agent, highest priority first, reserves its best free neighbour cell: smallest BFS distance
    to its goal, then free cells before occupied ones, then random. Reserving the cell of an agent not
    yet planned makes that agent plan next, forbidden to enter the reserver's cell; if it cannot move,
    the reserver tries its next cell; an agent with no cell left stays.

    Args:
        layout: the static grid (any device; copied to numpy).
        seed: seed of the generator that breaks ties.
    """

    def __init__(self, layout: Layout, *, seed: int = 0):
        super().__init__(layout, seed)

    def act(self, position: np.ndarray, goal: np.ndarray) -> np.ndarray:
        """[A] int64 actions for agents at ``position`` [A, 2] int (row, col) heading to stations ``goal`` [A]."""
        a = len(goal)
        order = self._order(goal)
        cells = (position[:, 0] * self.width + position[:, 1]).tolist()
        occupant = {c: i for i, c in enumerate(cells)}
        reserved: set[int] = set()
        planned: dict[int, tuple[int, int]] = {}  # agent -> (action, next cell)
        tie = self.rng.random((a, len(MOVES)))

        def plan(i: int, parent_cell: int) -> bool:
            start, dist = cells[i], self.distance[goal[i]]
            options = sorted(self.neighbours[start],
                             key=lambda ac: (dist[ac[1]], ac[1] != start and ac[1] in occupant, tie[i, ac[0]]))
            for action, cell in options:
                if cell in reserved or cell == parent_cell:
                    continue
                reserved.add(cell)
                planned[i] = (action, cell)
                j = occupant.get(cell, i)
                if j == i or j in planned or plan(j, start):
                    return True
                # j could not leave and stays in ``cell`` (reserved by j now): try the next cell
            reserved.add(start)
            planned[i] = (0, start)
            return False

        for i in order.tolist():
            if i not in planned:
                plan(i, -1)
        return np.array([planned[i][0] for i in range(a)], dtype=np.int64)


class ReservationPlanner(_Planner):
    """Windowed cooperative A* for one warehouse (see the module docstring).

    Args:
        layout: the static grid (any device; copied to numpy).
        window: planning horizon in steps, >= 1.
        seed: seed of the generator that breaks priority ties.

    Raises:
        ConfigError: ``window`` < 1.
    """

    def __init__(self, layout: Layout, *, window: int = 16, seed: int = 0):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"window={window!r}: expected an int >= 1")
        super().__init__(layout, seed)
        self.window = window

    def act(self, position: np.ndarray, goal: np.ndarray) -> np.ndarray:
        """[A] int64 actions for agents at ``position`` [A, 2] int (row, col) heading to stations ``goal`` [A]."""
        order = self._order(goal)
        cells = (position[:, 0] * self.width + position[:, 1]).tolist()
        vertex: set[tuple[int, int]] = set()  # (t, cell) reserved
        edge: set[tuple[int, int, int]] = set()  # (t, from, to): a reserved move from t-1 to t
        unplanned = set(cells)
        actions = np.zeros(len(goal), dtype=np.int64)
        for i in order.tolist():
            start = cells[i]
            unplanned.discard(start)
            path = self._search(start, self.distance[goal[i]], vertex, edge, unplanned)
            if not path:
                path = [(0, start)]  # always free at t = 1: planned agents avoided this unplanned cell
            prev = start
            for t, (_, cell) in enumerate(path, start=1):
                vertex.add((t, cell))
                edge.add((t, prev, cell))
                prev = cell
            actions[i] = path[0][0]
        return actions

    def _search(self, start: int, dist: np.ndarray, vertex, edge, unplanned) -> list[tuple[int, int]]:
        """Space-time A* from (start, t=0) to the goal or to depth ``window`` (minimal t + distance):
        [(action, cell)] for t = 1 .. end, [] if no move sequence is free."""
        if dist[start] >= UNREACHABLE:
            return []
        heap = [(int(dist[start]), 0, 0, start)]  # (f = t + distance, -t: deeper first on ties, t, cell)
        parent: dict[tuple[int, int], tuple[int, int]] = {}  # (t, cell) -> (action into it, previous cell)
        seen = {(0, start)}
        end = None
        while heap:
            _, _, t, cell = heapq.heappop(heap)
            if (t > 0 and dist[cell] == 0) or t == self.window:
                end = (t, cell)
                break
            for action, nxt in self.neighbours[cell]:
                key = (t + 1, nxt)
                if key in seen or key in vertex or (t + 1, nxt, cell) in edge or (nxt != start and nxt in unplanned):
                    continue
                seen.add(key)
                parent[key] = (action, cell)
                heapq.heappush(heap, (t + 1 + int(dist[nxt]), -(t + 1), t + 1, nxt))
        if end is None:
            return []
        path = []
        t, cell = end
        while t > 0:
            action, prev = parent[(t, cell)]
            path.append((action, cell))
            t, cell = t - 1, prev
        return path[::-1]


def expert_policy(env, *, method: str = "pibt", window: int = 16, seed: int = 0) -> Callable[[TensorDictBase], Tensor]:
    """The scripted baseline for a :class:`~envs.warehouse.env.WarehouseEnv`: one planner per warehouse,
    reading ``env.state`` (the goals of the others are not in an agent's observation).

    Args:
        env: the env the policy will act in.
        method: "pibt" (:class:`PIBTPlanner`) or "whca" (:class:`ReservationPlanner`).
        window: the "whca" horizon, steps.
        seed: warehouse k's planner is seeded with ``seed + k``.

    Returns:
        ``policy(td) -> [N, A] int64`` actions on ``env.device`` (``td`` is not read).

    Raises:
        ConfigError: an unknown ``method`` or a bad ``window``.
    """
    if method not in METHODS:
        raise ConfigError(f"method={method!r}: expected one of {METHODS}")
    if method == "pibt":
        planners = [PIBTPlanner(env.layout, seed=seed + k) for k in range(env.num_envs)]
    else:
        planners = [ReservationPlanner(env.layout, window=window, seed=seed + k) for k in range(env.num_envs)]

    def policy(td: TensorDictBase) -> Tensor:
        state = env.state
        position = state["position"].cpu().numpy()
        goal = state["goal"].cpu().numpy()
        actions = np.stack([p.act(position[k], goal[k]) for k, p in enumerate(planners)])
        return torch.from_numpy(actions).to(env.device)

    return policy

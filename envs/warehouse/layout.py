"""Warehouse-v0 grids: shelf blocks with aisles, pick stations on the left edge, drop stations on the right.

A layout is static (the same for every env of a batch): an obstacle mask, the station cells and the
breadth-first-search (BFS) distance from every station to every cell. Cells are addressed as
(row, col), row 0 at the top; "north" is row - 1, "east" is col + 1.

The default grid (``WarehouseConfig()``: 3 x 5 blocks of 4 x 2 shelves) is 16 rows x 18 columns
(P pick station, D drop station, # shelf, . aisle):

    ..................
    P.##.##.##.##.##.D
    ..##.##.##.##.##..
    P.##.##.##.##.##.D
    ..##.##.##.##.##..
    P................D
    ..##.##.##.##.##..
    ...                 (the pattern repeats; rows 10 and 15 are aisles too)

168 free cells, 8 pick and 8 drop stations (every ``station_spacing`` rows from row
``station_spacing - 1``), 152 start cells: 20 AGVs fill ~12% of the free cells.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rlfunc.errors import ConfigError

UNREACHABLE = 10**6  # BFS distance of a cell no free path reaches (and of obstacle cells)


@dataclass(frozen=True)
class WarehouseConfig:
    """Every knob of Warehouse-v0 (grid, agents, observation, reward, episode length)."""

    n_agents: int = 20  # AGVs per warehouse
    shelf_rows: int = 3  # shelf blocks stacked vertically
    shelf_cols: int = 5  # shelf blocks side by side
    shelf_height: int = 4  # cells per block, vertically
    shelf_width: int = 2  # cells per block, horizontally
    station_spacing: int = 2  # rows between stations on an edge (pick: left, drop: right)
    layout: tuple[str, ...] | None = None  # an ASCII grid ('.', '#', 'P', 'D') replacing the generated one
    obs_radius: int = 3  # r: each agent sees a (2r+1) x (2r+1) window, cells
    max_steps: int = 200  # env steps before truncation
    delivery_reward: float = 1.0  # reward to the agent that reaches its drop station while carrying
    pick_reward: float = 0.0  # reward on reaching the pick station (0: off)
    conflict_penalty: float = 0.1  # subtracted from each agent whose move a vertex/swap conflict blocks
    shaping_scale: float = 0.0  # reward per cell of BFS progress toward the current goal (0: off)


@dataclass(frozen=True)
class Layout:
    """A static warehouse grid.

    Attributes:
        obstacle: [H, W] bool, True on shelves (out-of-grid cells count as obstacles too).
        stations: [S, 2] int64 (row, col); rows 0 .. n_pick-1 are pick stations, the rest drop stations.
        n_pick: number of pick stations (>= 1); S - n_pick >= 1 drop stations.
        distance: [S, H, W] int64, BFS steps from each station to each cell (UNREACHABLE where none).
        start_cells: [F, 2] int64, free cells that are not stations, where agents start.
    """

    obstacle: Tensor
    stations: Tensor
    n_pick: int
    distance: Tensor
    start_cells: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.obstacle.shape[0]), int(self.obstacle.shape[1])

    @property
    def n_drop(self) -> int:
        return int(self.stations.shape[0]) - self.n_pick

    def to(self, device: torch.device | str) -> Layout:
        return Layout(self.obstacle.to(device), self.stations.to(device), self.n_pick,
                      self.distance.to(device), self.start_cells.to(device))


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}: expected an int >= 1")
    return value


def generated_ascii(config: WarehouseConfig) -> tuple[str, ...]:
    """The ASCII grid of ``config``'s generated layout (see the module docstring).

    Raises:
        ConfigError: a size is not an int >= 1.
    """
    for name in ("shelf_rows", "shelf_cols", "shelf_height", "shelf_width", "station_spacing"):
        _check_positive(name, getattr(config, name))
    h = config.shelf_rows * (config.shelf_height + 1) + 1
    w = 2 + config.shelf_cols * (config.shelf_width + 1) + 1
    grid = np.full((h, w), ".", dtype="<U1")
    for i in range(config.shelf_rows):
        r0 = 1 + i * (config.shelf_height + 1)
        for j in range(config.shelf_cols):
            c0 = 2 + j * (config.shelf_width + 1)
            grid[r0 : r0 + config.shelf_height, c0 : c0 + config.shelf_width] = "#"
    rows = range(config.station_spacing - 1, h, config.station_spacing)
    grid[list(rows), 0] = "P"
    grid[list(rows), w - 1] = "D"
    return tuple("".join(r) for r in grid)


def _bfs(free: np.ndarray, source: tuple[int, int]) -> np.ndarray:
    h, w = free.shape
    dist = np.full((h, w), UNREACHABLE, dtype=np.int64)
    dist[source] = 0
    queue = deque([source])
    while queue:
        r, c = queue.popleft()
        for dr, dc in ((-1, 0), (1, 0), (0, 1), (0, -1)):
            rr, cc = r + dr, c + dc
            if 0 <= rr < h and 0 <= cc < w and free[rr, cc] and dist[rr, cc] == UNREACHABLE:
                dist[rr, cc] = dist[r, c] + 1
                queue.append((rr, cc))
    return dist


def layout_from_ascii(rows: tuple[str, ...] | list[str]) -> Layout:
    """A layout from an ASCII grid: '.' free, '#' shelf, 'P' pick station, 'D' drop station.

    Raises:
        ConfigError: rows of unequal length, an unknown character, no 'P' or no 'D', or a station
            from which some other station cannot be reached.
    """
    if len(rows) == 0 or any(len(r) != len(rows[0]) for r in rows) or len(rows[0]) == 0:
        raise ConfigError(f"layout={rows!r}: expected non-empty rows of equal length")
    grid = np.array([list(r) for r in rows])
    bad = set(np.unique(grid)) - set(".#PD")
    if bad:
        raise ConfigError(f"layout has characters {sorted(bad)}: expected only '.', '#', 'P', 'D'")
    picks = np.argwhere(grid == "P")
    drops = np.argwhere(grid == "D")
    if len(picks) == 0 or len(drops) == 0:
        raise ConfigError(f"layout has {len(picks)} 'P' and {len(drops)} 'D': expected at least one of each")
    free = grid != "#"
    stations = np.concatenate([picks, drops])
    distance = np.stack([_bfs(free, (int(r), int(c))) for r, c in stations])
    if (distance[:, stations[:, 0], stations[:, 1]] >= UNREACHABLE).any():
        raise ConfigError("layout: some station cannot reach another one through free cells")
    start = np.argwhere(grid == ".")
    return Layout(
        obstacle=torch.from_numpy(~free),
        stations=torch.from_numpy(stations).to(torch.int64),
        n_pick=len(picks),
        distance=torch.from_numpy(distance),
        start_cells=torch.from_numpy(start).to(torch.int64),
    )


def make_layout(config: WarehouseConfig) -> Layout:
    """``config.layout`` if given, else the generated grid; checks there is room for ``n_agents``.

    Raises:
        ConfigError: as :func:`generated_ascii` / :func:`layout_from_ascii`, or fewer start cells
            (free, non-station) than ``config.n_agents``.
    """
    _check_positive("n_agents", config.n_agents)
    layout = layout_from_ascii(config.layout if config.layout is not None else generated_ascii(config))
    if layout.start_cells.shape[0] < config.n_agents:
        raise ConfigError(
            f"n_agents={config.n_agents}: the layout has only {layout.start_cells.shape[0]} free non-station cells"
        )
    return layout

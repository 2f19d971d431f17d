"""Warehouse-v0 dynamics as pure, batched torch functions: many warehouses x many AGVs per call.

State (TensorDict, batch [N]; A agents; one static :class:`~envs.warehouse.layout.Layout`):

- "position" [N, A, 2] int64 (row, col); all distinct within an env, never on a shelf.
- "goal" [N, A] int64 station index (< n_pick: a pick station, else a drop station).
- "carrying" [N, A] bool: picked up, on the way to the drop station.
- "task_count" [N, A] int64: stations reached so far (draws the next task, see below).
- "env_seed" [N] int64 in [0, 2^31): per-env seed of the task draws.
- "step_count" [N, 1] int64; "truncated" [N, 1] bool (``max_steps`` reached; the task never terminates).

Actions [N, A] int64: 0 stay, 1 north (row - 1), 2 south (row + 1), 3 east (col + 1), 4 west (col - 1).

Moves, all at once:

1. a move off the grid or into a shelf is blocked (the agent stays; counted as "obstacle_bumps");
2. vertex conflict: every mover whose target cell is also the target of another agent (an agent
   that stays targets its own cell) is blocked; so two agents moving into one cell are *both* blocked;
3. swap conflict: two movers exchanging cells are both blocked;
4. a mover into a cell whose occupant does not leave (stays, or is blocked) is blocked, along whole
   chains of such moves; following an agent that leaves, and rotations of 3+ agents, are allowed.
   Chains are resolved exactly by pointer doubling: each mover points at the occupant of its target,
   and bit_length(A - 1) rounds of ``pointer = pointer[pointer]`` (one gather each; 5 rounds for 20
   agents) reach the end of every chain (at most A - 1 links), so no loop over agents or envs and no
   host synchronisation.

Counts (per env and step, int64): "vertex_conflicts" = agents blocked by rule 2 or 4 (a blocked
two-agent vertex conflict counts 2), "swap_conflicts" = agents blocked by rule 3 (a swap counts 2),
"obstacle_bumps", "deliveries", "idle" = agents whose cell did not change (staying or blocked).

Tasks: an agent reaching its goal station while not carrying picks up (``carrying`` on, new goal a
drop station); reaching its drop station while carrying delivers (+``delivery_reward``, new goal a
pick station). The new station is ``hash(env_seed, agent, task_count) mod`` the number of pick / drop
stations: a counter-based draw, so an env's tasks do not depend on which other envs share its batch.

Reward [N, A, 1] float32 per agent: ``delivery_reward * delivered + pick_reward * picked -
conflict_penalty * blocked_by_an_agent + shaping_scale * (d_goal(p_t) - d_goal(p_{t+1}))`` with d_goal
the BFS distance to the goal held at the start of the step (progress shaping; off at 0, the default).

Reference: vertex/swap conflicts as in multi-agent path finding, Stern et al. (2019), "Multi-Agent
Pathfinding: Definitions, Variants, and Benchmarks", sec. 2.2.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from envs.warehouse.layout import Layout, WarehouseConfig
from rlfunc.errors import ShapeError

N_ACTIONS = 5
# (d_row, d_col) of stay, north, south, east, west
MOVES = ((0, 0), (-1, 0), (1, 0), (0, 1), (0, -1))
N_CHANNELS = 5  # window channels: obstacle, other agents, pick stations, drop stations, own goal
_M32 = 0xFFFFFFFF
STEP_KEYS = ("deliveries", "vertex_conflicts", "swap_conflicts", "obstacle_bumps", "idle")


def obs_dim(obs_radius: int) -> int:
    """Length of one agent's observation: (2r+1)^2 * 5 window values + 6 scalars."""
    k = 2 * obs_radius + 1
    return k * k * N_CHANNELS + 6


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 values in [0, 2^32); products stay below 2^63."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def task_draw(env_seed: Tensor, task_count: Tensor, n: int) -> Tensor:
    """[N, A] int64 in [0, n): the station drawn for each agent's next task (counter-based, see module doc)."""
    agent = torch.arange(task_count.shape[-1], device=task_count.device)
    x = _mix((env_seed.unsqueeze(-1) * 0x27D4EB2F + agent * 0x165667B1) & _M32)
    return _mix((x + task_count * 0x61C88647) & _M32) % n


def reset_state(layout: Layout, n_agents: int, num_envs: int, generator: torch.Generator) -> TensorDict:
    """Fresh episodes: agents on distinct random non-station free cells, each heading to a pick station.

    Args:
        layout: on the generator's device.
        n_agents: A <= the layout's start cells.
        num_envs: N >= 1.
        generator: the only randomness (per-env seeds and start cells).

    Returns:
        The state TensorDict of the module docstring, on the generator's device.
    """
    device = layout.obstacle.device
    n_start = layout.start_cells.shape[0]
    env_seed = torch.randint(0, 2**31, (num_envs,), generator=generator, device=device)
    cells = torch.rand(num_envs, n_start, generator=generator, device=device).argsort(-1)[:, :n_agents]
    task_count = torch.zeros(num_envs, n_agents, dtype=torch.int64, device=device)
    return TensorDict(
        {
            "position": layout.start_cells[cells],
            "goal": task_draw(env_seed, task_count, layout.n_pick),
            "carrying": torch.zeros(num_envs, n_agents, dtype=torch.bool, device=device),
            "task_count": task_count,
            "env_seed": env_seed,
            "step_count": torch.zeros(num_envs, 1, dtype=torch.int64, device=device),
            "truncated": torch.zeros(num_envs, 1, dtype=torch.bool, device=device),
        },
        batch_size=[num_envs],
        device=device,
    )


def resolve_moves(layout: Layout, position: Tensor, action: Tensor) -> tuple[Tensor, TensorDict]:
    """Apply the move rules 1-4 of the module docstring.

    Args:
        position: [N, A, 2] int64 distinct free cells per env.
        action: [N, A] int64 in [0, 5).

    Returns:
        (new_position [N, A, 2] int64, flags TensorDict [N, A] of bool "moved", "vertex", "swap", "bump").
    """
    n, a = action.shape
    h, w = layout.shape
    moves = torch.tensor(MOVES, dtype=torch.int64, device=position.device)
    proposed = position + moves[action]
    inside = (proposed >= 0).all(-1) & (proposed[..., 0] < h) & (proposed[..., 1] < w)
    clamped = torch.stack([proposed[..., 0].clamp(0, h - 1), proposed[..., 1].clamp(0, w - 1)], -1)
    free = inside & ~layout.obstacle[clamped[..., 0], clamped[..., 1]]
    bump = (action != 0) & ~free
    moving = (action != 0) & free
    target = torch.where(moving.unsqueeze(-1), proposed, position)
    cell = position[..., 0] * w + position[..., 1]
    target_cell = target[..., 0] * w + target[..., 1]
    # rule 2: contested target cells
    counts = torch.zeros(n, h * w, dtype=torch.int64, device=position.device)
    counts.scatter_add_(1, target_cell, torch.ones_like(target_cell))
    contested = moving & (counts.gather(1, target_cell) > 1)
    # who occupies each target now (-1: nobody)
    agent = torch.arange(a, device=position.device).expand(n, a)
    occupant = torch.full((n, h * w), -1, dtype=torch.int64, device=position.device)
    occupant.scatter_(1, cell, agent)
    ahead = occupant.gather(1, target_cell)
    ahead_ok = ahead.clamp_min(0)
    # rule 3: swaps
    swap = moving & (ahead >= 0) & moving.gather(1, ahead_ok) & (target_cell.gather(1, ahead_ok) == cell)
    mover = moving & ~contested & ~swap
    # rule 4: follow each mover's chain of occupants to its end; a chain ending at a non-mover fails
    pointer = torch.where(mover & (ahead >= 0), ahead, agent)
    for _ in range(max(1, (a - 1).bit_length())):
        pointer = pointer.gather(1, pointer)
    chained = mover & ~mover.gather(1, pointer)
    moved = mover & ~chained
    new_position = torch.where(moved.unsqueeze(-1), target, position)
    flags = TensorDict(
        {"moved": moved, "vertex": (contested & ~swap) | chained, "swap": swap, "bump": bump},
        batch_size=[n, a],
        device=position.device,
    )
    return new_position, flags


def step_state(
    layout: Layout, state: TensorDict, action: Tensor, config: WarehouseConfig, *, check_values: bool = True
) -> tuple[TensorDict, Tensor, TensorDict, TensorDict]:
    """One step of every env. An env already truncated (not reset since) is absorbing: nobody moves,
    reward 0, counts 0, flags reported again.

    Args:
        layout: the static grid, on the state's device.
        state: as :func:`reset_state`, batch [N].
        action: [N, A] integer in [0, 5) (or [N, A, 1]).
        config: rewards and ``max_steps``.
        check_values: raise on an action outside [0, 5) (reads the actions on the host); when False
            (no host synchronisation) such an action means stay.

    Returns:
        (new_state, reward [N, A, 1] float32, counts TensorDict [N] of [N, 1] int64 under STEP_KEYS,
        flags TensorDict [N, A] of bool "delivered", "picked", "vertex", "swap", "bump", "moved").

    Raises:
        ShapeError: ``action`` has the wrong shape, a float dtype, or a value outside [0, 5).
    """
    n, a = state["goal"].shape
    if action.shape == (n, a, 1):
        action = action.squeeze(-1)
    if action.shape != (n, a) or action.dtype.is_floating_point or action.dtype == torch.bool:
        raise ShapeError(f"action shape {tuple(action.shape)} dtype {action.dtype}: expected ({n}, {a}) integers")
    action = action.to(torch.int64)
    invalid = (action < 0) | (action >= N_ACTIONS)
    if check_values and bool(invalid.any()):
        raise ShapeError(f"action values must be in [0, {N_ACTIONS}); got min {int(action.min())}, max {int(action.max())}")
    active = ~state["truncated"]  # [N, 1]
    action = torch.where(active & ~invalid, action, torch.zeros_like(action))
    position, goal, carrying = state["position"], state["goal"], state["carrying"]
    new_position, flags = resolve_moves(layout, position, action)
    goal_cell = layout.stations[goal]
    at_goal = (new_position == goal_cell).all(-1)
    picked = at_goal & ~carrying
    delivered = at_goal & carrying
    task_count = state["task_count"] + at_goal.to(torch.int64)
    next_pick = task_draw(state["env_seed"], task_count, layout.n_pick)
    next_drop = layout.n_pick + task_draw(state["env_seed"], task_count, layout.n_drop)
    new_goal = torch.where(picked, next_drop, torch.where(delivered, next_pick, goal))
    blocked = flags["vertex"] | flags["swap"]
    f32 = torch.float32
    reward = (config.delivery_reward * delivered.to(f32) + config.pick_reward * picked.to(f32)
              - config.conflict_penalty * blocked.to(f32))
    if config.shaping_scale != 0.0:
        before = layout.distance[goal, position[..., 0], position[..., 1]]
        after = layout.distance[goal, new_position[..., 0], new_position[..., 1]]
        reward = reward + config.shaping_scale * (before - after).to(f32)
    reward = torch.where(active, reward, torch.zeros_like(reward)).unsqueeze(-1)
    step_count = state["step_count"] + active.to(torch.int64)
    new_state = TensorDict(
        {
            "position": new_position,
            "goal": new_goal,
            "carrying": carrying ^ at_goal,
            "task_count": task_count,
            "env_seed": state["env_seed"],
            "step_count": step_count,
            "truncated": state["truncated"] | (step_count >= config.max_steps),
        },
        batch_size=state.batch_size,
        device=state.device,
    )
    flags = flags.update({"delivered": delivered & active, "picked": picked & active})
    per_agent = {
        "deliveries": flags["delivered"], "vertex_conflicts": flags["vertex"], "swap_conflicts": flags["swap"],
        "obstacle_bumps": flags["bump"], "idle": ~flags["moved"] & active,
    }
    counts = TensorDict(
        {k: v.sum(-1, keepdim=True) for k, v in per_agent.items()}, batch_size=state.batch_size, device=state.device
    )
    return new_state, reward, counts, flags


def _bit_table(device: torch.device) -> Tensor:
    """[32, 5] float32: row c holds the 5 bits of c (lowest first)."""
    code = torch.arange(2**N_CHANNELS, device=device).unsqueeze(-1)
    return ((code >> torch.arange(N_CHANNELS, device=device)) & 1).to(torch.float32)


def _padded_static(layout: Layout, radius: int) -> Tensor:
    """[4, H + 2r, W + 2r] float32: obstacle (1 outside the grid too), 0, pick stations, drop stations."""
    h, w = layout.shape
    grid = torch.zeros(4, h + 2 * radius, w + 2 * radius, device=layout.obstacle.device)
    grid[0] = 1.0
    grid[0, radius : radius + h, radius : radius + w] = layout.obstacle.to(torch.float32)
    picks, drops = layout.stations[: layout.n_pick], layout.stations[layout.n_pick :]
    grid[2, picks[:, 0] + radius, picks[:, 1] + radius] = 1.0
    grid[3, drops[:, 0] + radius, drops[:, 1] + radius] = 1.0
    return grid


def observation(layout: Layout, state: TensorDict, radius: int) -> Tensor:
    """[N, A, obs_dim(radius)] float32 in [-1, 1], each agent's local view, in this order:

    - window [(2r+1), (2r+1), 5] flattened row-major (row offset -r..r from the agent, then column,
      then channel): obstacle (shelf or off-grid), another agent, pick station, drop station, own goal;
    - own position (row / (H - 1), col / (W - 1)) (0 for a one-cell dimension);
    - goal direction ((goal_row - row) / (H - 1), (goal_col - col) / (W - 1));
    - BFS distance to the goal / (H + W), clipped to 1;
    - carrying (0 or 1).
    """
    n, a = state["goal"].shape
    h, w = layout.shape
    k, hp, wp = 2 * radius + 1, h + 2 * radius, w + 2 * radius
    device = state.device
    position, goal_cell = state["position"], layout.stations[state["goal"]]
    # each padded cell as bits: 1 obstacle, 2 another agent, 4 pick station, 8 drop station, 16 own goal
    bits = torch.tensor([1, 0, 4, 8], dtype=torch.int64, device=device)
    static = (_padded_static(layout, radius).to(torch.int64) * bits.view(4, 1, 1)).sum(0).reshape(1, hp * wp)
    cell = (position[..., 0] + radius) * wp + position[..., 1] + radius  # [N, A] flat padded cell
    code = static.expand(n, -1).scatter_add(1, cell, torch.full_like(cell, 2))
    offset = torch.arange(k, device=device) - radius
    index = cell.unsqueeze(-1) + (offset.view(k, 1) * wp + offset.view(1, k)).reshape(-1)  # [N, A, k*k] row-major
    window = code.gather(1, index.reshape(n, -1)).reshape(n, a, k * k)
    center = (k * k) // 2
    window[..., center] -= 2  # the agent itself
    rel = goal_cell - position + radius  # goal in window coordinates
    inside = ((rel >= 0) & (rel < k)).all(-1, keepdim=True)
    window = window + 16 * ((torch.arange(k * k, device=device) == (rel[..., :1] * k + rel[..., 1:])) & inside)
    window = torch.nn.functional.embedding(window, _bit_table(device))  # [N, A, k*k, 5] 0/1
    scale = torch.tensor([max(h - 1, 1), max(w - 1, 1)], dtype=torch.float32, device=device)
    dist = layout.distance[state["goal"], position[..., 0], position[..., 1]]
    dist = (dist.to(torch.float32) / (h + w)).clamp(max=1.0)
    scalars = torch.cat([
        position.to(torch.float32) / scale,
        (goal_cell - position).to(torch.float32) / scale,
        dist.unsqueeze(-1),
        state["carrying"].to(torch.float32).unsqueeze(-1),
    ], -1)
    return torch.cat([window.reshape(n, a, -1), scalars], -1)


def action_mask(layout: Layout, state: TensorDict) -> Tensor:
    """[N, A, 5] bool: True where the move stays on the grid and off shelves (stay is always True).
    Moves blocked by other agents are not masked (they depend on the others' choices)."""
    h, w = layout.shape
    moves = torch.tensor(MOVES, dtype=torch.int64, device=state.device)
    proposed = state["position"].unsqueeze(-2) + moves  # [N, A, 5, 2]
    inside = (proposed >= 0).all(-1) & (proposed[..., 0] < h) & (proposed[..., 1] < w)
    r = proposed[..., 0].clamp(0, h - 1)
    c = proposed[..., 1].clamp(0, w - 1)
    return inside & ~layout.obstacle[r, c]

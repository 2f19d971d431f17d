"""Warehouse-v0 metrics (deliveries and conflicts per 100 steps, idle fraction) and policy evaluation.

Rates are per warehouse: ``deliveries_per_100_steps = 100 * deliveries / env steps``, where a
rollout [*B, T] of a batched env counts prod(B) * T env steps. The idle fraction is over agent-steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from tensordict import TensorDictBase
from torch import Tensor

from envs.warehouse.core import N_ACTIONS, STEP_KEYS
from envs.warehouse.env import WarehouseEnv
from envs.warehouse.layout import WarehouseConfig
from rlfunc.core.stats import mean_interval, summarize_returns
from rlfunc.errors import ConfigError, ShapeError

Policy = Callable[[TensorDictBase], Tensor]


def rollout_metrics(td: TensorDictBase) -> dict[str, float]:
    """Rates of a rollout of :class:`~envs.warehouse.env.WarehouseEnv` (every step counts: roll out with
    ``break_when_any_done=False``, which resets ended warehouses).

    Args:
        td: with ("next", k) [*B, T, 1] int64 for k in STEP_KEYS and ("next", "agents", "reward")
            [*B, T, A, 1] (for A).

    Returns:
        {"env_steps", "deliveries", "deliveries_per_100_steps", "conflicts_per_100_steps" (vertex +
        swap), "vertex_conflicts_per_100_steps", "swap_conflicts_per_100_steps",
        "obstacle_bumps_per_100_steps", "idle_fraction"} as floats; conflicts count blocked agents.

    Raises:
        ShapeError: a key is missing or the count shapes differ.
    """
    try:
        counts = {k: td["next", k] for k in STEP_KEYS}
        n_agents = td["next", "agents", "reward"].shape[-2]
    except KeyError as e:
        raise ShapeError(f"td lacks {e}: expected a WarehouseEnv rollout") from None
    shape = counts["deliveries"].shape
    if any(v.shape != shape for v in counts.values()) or shape[-1:] != (1,):
        raise ShapeError(f"count shapes {[tuple(v.shape) for v in counts.values()]}: expected equal [*B, T, 1]")
    steps = counts["deliveries"].numel()
    total = {k: float(v.sum()) for k, v in counts.items()}
    rate = 100.0 / steps
    return {
        "env_steps": float(steps),
        "deliveries": total["deliveries"],
        "deliveries_per_100_steps": total["deliveries"] * rate,
        "conflicts_per_100_steps": (total["vertex_conflicts"] + total["swap_conflicts"]) * rate,
        "vertex_conflicts_per_100_steps": total["vertex_conflicts"] * rate,
        "swap_conflicts_per_100_steps": total["swap_conflicts"] * rate,
        "obstacle_bumps_per_100_steps": total["obstacle_bumps"] * rate,
        "idle_fraction": total["idle"] / (steps * n_agents),
    }


def random_policy(env: WarehouseEnv, *, seed: int = 0, masked: bool = False) -> Policy:
    """Uniform random actions; with ``masked`` only among the moves ("agents", "action_mask") allows.

    Returns:
        ``policy(td) -> [N, A] int64`` on ``env.device``, drawn from a generator seeded with ``seed``.
    """
    generator = torch.Generator(device=env.device).manual_seed(seed)

    def policy(td: TensorDictBase) -> Tensor:
        shape = (env.num_envs, env.n_agents, N_ACTIONS)
        u = torch.rand(shape, generator=generator, device=env.device)
        if masked:
            u = torch.where(td["agents", "action_mask"], u, -1.0)
        return u.argmax(-1)

    return policy


def evaluate(
    make_policy: Callable[[WarehouseEnv], Policy],
    config: WarehouseConfig = WarehouseConfig(),
    *,
    seeds: tuple[int, ...] = (0, 1, 2),
    num_episodes: int = 1,
    num_steps: int | None = None,
    device: torch.device | str | None = None,
) -> dict:
    """Run a policy for ``num_episodes`` parallel warehouses per seed and report :func:`rollout_metrics`.

    Args:
        make_policy: ``make_policy(env) -> policy``, ``policy(td) -> [N, A]`` int actions given the
            env output ``td`` (("agents", "observation") [N, A, D], ("agents", "action_mask") [N, A, 5]).
            For a network over observations: ``lambda env: lambda td: net(td["agents", "observation"]).argmax(-1)``;
            the scripted baseline: ``envs.warehouse.expert.expert_policy``.
        config: the warehouse.
        seeds: env seeds, one rollout each.
        num_episodes: warehouses per seed (the batch of the env), >= 1.
        num_steps: steps per rollout (None: ``config.max_steps``, one episode).
        device: where the env runs.

    Returns:
        {"per_seed": [{"seed": s, **rollout_metrics}], "median": {metric: median over seeds},
        "deliveries_per_100_steps": {"mean", "std", "episodes", "ci95"} over every seed's warehouses
        (:func:`rlfunc.core.stats.summarize_returns`: the evaluation protocol's summary; "ci95" None
        for one warehouse)}; with ``num_episodes > 1`` each seed's row also has
        "deliveries_per_100_steps_ci95", the Student-t 95% interval of the mean over its warehouses
        (:func:`rlfunc.core.stats.mean_interval`).

    Raises:
        ConfigError: no seeds, or ``num_steps`` < 1.
    """
    if len(seeds) == 0:
        raise ConfigError("seeds=(): expected at least one seed")
    num_steps = config.max_steps if num_steps is None else num_steps
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ConfigError(f"num_steps={num_steps!r}: expected an int >= 1")
    rows, episodes = [], []
    for seed in seeds:
        env = WarehouseEnv(num_episodes, config, device=device, seed=seed)
        policy = make_policy(env)

        def act(td: TensorDictBase) -> TensorDictBase:
            return td.set(("agents", "action"), policy(td))

        with torch.no_grad():
            td = env.rollout(num_steps, act, break_when_any_done=False)
        row = {"seed": seed, **rollout_metrics(td)}
        per_warehouse = td["next", "deliveries"].reshape(num_episodes, -1).float().mean(-1) * 100.0
        if num_episodes > 1:  # the spread over this seed's warehouses (the evaluation protocol's interval)
            row["deliveries_per_100_steps_ci95"] = list(mean_interval(per_warehouse))
        rows.append(row)
        episodes.append(per_warehouse.cpu())
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "seed" and not k.endswith("_ci95")}
    return {"per_seed": rows, "median": median, "deliveries_per_100_steps": summarize_returns(torch.cat(episodes))}

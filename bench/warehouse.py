"""Warehouse-v0: env throughput (torch-batched TorchRL env vs the PettingZoo single instance) and the
scripted baselines' deliveries/conflicts beside a random policy.

Throughput: random actions drawn beforehand; agent-steps/s = num_envs * n_agents * steps / seconds,
median of --repeats interleaved repeats; "env" is ``WarehouseEnv.step_and_maybe_reset`` (TorchRL's
loop: observation, action mask, counts, auto-reset), "core" the pure step + observation functions
without the EnvBase wrapper, "pettingzoo" ``WarehouseParallelEnv.step`` with dict actions (reset on
truncation). Ratios are against the PettingZoo instance measured in the same run.

Baselines: one default episode (200 steps, 20 AGVs) per seed; median over --seeds.

    OMP_NUM_THREADS=1 python -m bench.warehouse --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from envs.warehouse import WarehouseConfig, WarehouseEnv, WarehouseParallelEnv, core
from envs.warehouse.expert import expert_policy
from envs.warehouse.metrics import evaluate, random_policy
from rlfunc.device import resolve_device


def time_env(num_envs: int, steps: int, config: WarehouseConfig, device: torch.device) -> float:
    env = WarehouseEnv(num_envs, config, device=device, seed=0)
    g = torch.Generator(device=device).manual_seed(0)
    actions = torch.randint(0, 5, (steps, num_envs, config.n_agents), generator=g, device=device)
    td = env.reset()
    td = env.step_and_maybe_reset(td.set(("agents", "action"), actions[0]))[1]  # warm-up
    t = time.perf_counter()
    for k in range(steps):
        _, td = env.step_and_maybe_reset(td.set(("agents", "action"), actions[k]))
    _ = td["agents", "observation"].sum().item()  # wait for the device
    return num_envs * config.n_agents * steps / (time.perf_counter() - t)


def time_core(num_envs: int, steps: int, config: WarehouseConfig, device: torch.device) -> float:
    env = WarehouseEnv(num_envs, config, device=device, seed=0)
    env.reset()
    layout, state = env.layout, env.state
    g = torch.Generator(device=device).manual_seed(0)
    actions = torch.randint(0, 5, (steps, num_envs, config.n_agents), generator=g, device=device)
    t = time.perf_counter()
    for k in range(steps):
        state, *_ = core.step_state(layout, state, actions[k], config, check_values=False)
        obs = core.observation(layout, state, config.obs_radius)
    _ = obs.sum().item()
    return num_envs * config.n_agents * steps / (time.perf_counter() - t)


def time_pettingzoo(steps: int, config: WarehouseConfig) -> float:
    env = WarehouseParallelEnv(config)
    env.reset(seed=0)
    actions = np.random.default_rng(0).integers(0, 5, (steps, config.n_agents)).tolist()
    agents = env.possible_agents
    t = time.perf_counter()
    for k in range(steps):
        if not env.agents:
            env.reset()
        env.step(dict(zip(agents, actions[k])))
    return config.n_agents * steps / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-envs", type=int, nargs="+", default=[1, 64, 512])
    p.add_argument("--agent-steps", type=int, default=400_000, help="agent-steps per throughput measurement (at least 20 env steps)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--device", default="cpu")
    p.add_argument("--skip-speed", action="store_true")
    a = p.parse_args()
    device = resolve_device(a.device)
    config = WarehouseConfig()
    print(f"Warehouse-v0, {config.n_agents} AGVs, grid 16 x 18, device {device}, torch threads {torch.get_num_threads()}")

    if not a.skip_speed:
        results: dict[str, list[float]] = {}
        pz_steps = max(20, a.agent_steps // (config.n_agents * 20))
        for _ in range(a.repeats):
            results.setdefault("pettingzoo", []).append(time_pettingzoo(pz_steps, config))
            for n in a.num_envs:
                steps = max(20, a.agent_steps // (n * config.n_agents))
                results.setdefault(f"env {n}", []).append(time_env(n, steps, config, device))
                results.setdefault(f"core {n}", []).append(time_core(n, steps, config, device))
        base = statistics.median(results["pettingzoo"])
        print(f"\n{'what':<14}{'agent-steps/s':>15}{'env-steps/s':>13}{'vs pettingzoo':>15}")
        for name, values in results.items():
            m = statistics.median(values)
            print(f"{name:<14}{m:>15,.0f}{m / config.n_agents:>13,.0f}{m / base:>14.1f}x", flush=True)

    policies = {
        "pibt (default)": lambda env: expert_policy(env, method="pibt"),
        "whca window 16": lambda env: expert_policy(env, method="whca", window=16),
        "random": lambda env: random_policy(env),
        "random masked": lambda env: random_policy(env, masked=True),
    }
    print(f"\n{'policy':<16}{'deliv/100':>10}{'conflicts/100':>14}{'vertex':>8}{'swap':>7}{'idle':>7}"
          f"  per-seed deliveries/100 (seeds {a.seeds})")
    for name, make in policies.items():
        t = time.perf_counter()
        episodes = 1 if name.startswith(("pibt", "whca")) else 8
        r = evaluate(make, config, seeds=tuple(a.seeds), num_episodes=episodes, device=device)
        m = r["median"]
        per_seed = ", ".join(f"{row['deliveries_per_100_steps']:.1f}" for row in r["per_seed"])
        print(f"{name:<16}{m['deliveries_per_100_steps']:>10.1f}{m['conflicts_per_100_steps']:>14.1f}"
              f"{m['vertex_conflicts_per_100_steps']:>8.1f}{m['swap_conflicts_per_100_steps']:>7.1f}"
              f"{m['idle_fraction']:>7.2f}  {per_seed}  ({time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

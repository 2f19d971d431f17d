"""grpo's and mappo's gradient step, eager vs ``--compile on`` (issue 18; the thresholds of
``--compile auto``, rlfunc.algos.grpo.AUTO_COMPILE_UPDATES and rlfunc.algos.mappo.AUTO_COMPILE_UPDATES,
rest on it).

grpo: PointReach-v0 at GRPOConfig's defaults (one seed, 16 groups x 8 episodes x 30 steps, minibatches
of 32 episodes, actor 64x64), the batch one grouped rollout of the torch-batched env. mappo:
Warehouse-v0's preset (ppo, 16 warehouses x 50 steps x 20 agents, 4 minibatches of 4,000 agent-steps,
actor and critic 128x128, 251 observations, 5 actions), the batch random observations and action masks
with the initial policy's actions. One intra-op thread. A measurement is one ``iteration`` (its
preparation, GAE or the group advantages, included: both sides do it eager) divided by its gradient
steps, after a warm-up iteration (where the compiled side compiles: reported apart); eager and compiled
alternate in each round; medians over rounds, the ratio and the break-even run length
(compile time / time saved per step).

    OMP_NUM_THREADS=1 python -m bench.compiled_grpo_mappo --algos grpo mappo --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tensordict import TensorDict

from rlfunc.config import replace

CPU = torch.device("cpu")


def grpo_side(compile: str):
    from rlfunc.algos.grpo import GRPOConfig, make_grpo
    from rlfunc.run.grpo import _rollout_fn, _spec
    from rlfunc.run.ppo import _generators

    config = replace(GRPOConfig(), compile=compile, device="cpu")
    algo = make_grpo(config, _spec(config.env), CPU)
    state = algo.init()
    rollout, close = _rollout_fn(config, CPU)
    batch = rollout(algo.policy(state, _generators(state, CPU)), 0)
    close()
    updates = config.num_epochs * (config.episodes_per_iteration // config.minibatch_size)

    def run() -> float:
        gens = _generators(state, CPU)
        t = time.perf_counter()
        algo.iteration(state, batch.clone(), gens)
        return (time.perf_counter() - t) / updates

    return run


def mappo_side(compile: str):
    from rlfunc.algos.mappo import make_mappo, preset

    config = replace(preset("Warehouse-v0"), compile=compile, device="cpu")
    N, T, A, D, K = config.num_envs, config.rollout_steps, config.n_agents, 251, 5
    algo = make_mappo(config, D, A, K, CPU)
    state = algo.init()
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(N, T, A, D, generator=g)
    mask = torch.rand(N, T, A, K, generator=g) < 0.7
    mask[..., 0] = True
    action, log_prob, value = algo.act(state, obs, mask, g)
    batch = TensorDict({
        "agents": {"observation": obs, "action_mask": mask, "action": action, "sample_log_prob": log_prob},
        "state_value": value,
        "next": {"agents": {"reward": torch.randn(N, T, A, 1, generator=g)}, "state_value": torch.randn(N, T, A, 1, generator=g),
                 "done": torch.zeros(N, T, 1, dtype=torch.bool), "terminated": torch.zeros(N, T, 1, dtype=torch.bool)},
    }, batch_size=[N, T])
    updates = config.num_epochs * config.num_minibatches

    def run() -> float:
        t = time.perf_counter()
        algo.iteration(state, batch, g)
        return (time.perf_counter() - t) / updates

    return run


SIDES = {"grpo": grpo_side, "mappo": mappo_side}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algos", nargs="+", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name in a.algos:
        sides = {"eager": SIDES[name]("off"), "compiled": SIDES[name]("on")}
        t = time.perf_counter()
        sides["compiled"]()  # compiles
        first = time.perf_counter() - t
        sides["eager"]()
        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(a.repeats):
            for k, run in sides.items():
                times[k].append(run() * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        saved = (med["eager"] - med["compiled"]) / 1e3
        print(f"{name}: ms per gradient step, median of {a.repeats} (min): "
              + ", ".join(f"{k} {med[k]:.2f} ({min(times[k]):.2f})" for k in sides)
              + f"; compiled / eager {med['compiled'] / med['eager']:.2f}; first compiled iteration {first:.1f} s; "
              + (f"break-even {first / saved:.0f} steps" if saved > 0 else "no break-even"), flush=True)


if __name__ == "__main__":
    main()

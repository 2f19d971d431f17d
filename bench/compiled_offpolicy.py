"""SAC's and TD3's gradient step at identical hyperparameters: rlfunc eager, rlfunc --compile on, and
stable-baselines3's ``train`` (issue 18; issue 17's wall-clock targets rest on it).

Pendulum-v1's sizes (3 observations, 1 action), SB3's / RL-Zoo's networks (SAC 256x256, TD3 400x300),
minibatches of 256 from a replay buffer of 5,000 random transitions, one intra-op thread. Each
measurement is ``--updates`` gradient steps after a warm-up (the compiled side compiles there: its
compile time is reported apart); the three sides alternate in each round; the result is the median
over rounds, in ms per gradient step, and each rlfunc side over SB3's.

    OMP_NUM_THREADS=1 python -m bench.compiled_offpolicy --algos sac td3 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tensordict import TensorDict

from rlfunc.algos.ppo import EnvSpec
from rlfunc.config import replace

SPEC = EnvSpec(3, 1, [-2.0], [2.0])
ROWS = 5_000


def _buffer():
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    g = torch.Generator().manual_seed(0)
    buffer = ReplayBuffer(storage=LazyTensorStorage(ROWS))
    buffer.extend(TensorDict({
        "observation": torch.randn(ROWS, 3, generator=g), "action": torch.rand(ROWS, 1, generator=g) * 2 - 1,
        "next": {"observation": torch.randn(ROWS, 3, generator=g), "reward": torch.randn(ROWS, 1, generator=g),
                 "terminated": torch.zeros(ROWS, 1, dtype=torch.bool)},
    }, batch_size=[ROWS]))
    return buffer


def rlfunc_side(algo_name: str, compile: str):
    if algo_name == "sac":
        from rlfunc.algos.sac import SACConfig as Config
        from rlfunc.algos.sac import make_sac as make
    else:
        from rlfunc.algos.td3 import TD3Config as Config
        from rlfunc.algos.td3 import make_td3 as make
    algo = make(replace(Config(), compile=compile, device="cpu"), SPEC, torch.device("cpu"))
    state, buffer, gen = algo.init(), _buffer(), torch.Generator().manual_seed(0)

    def run(n: int) -> float:
        t = time.perf_counter()
        algo.iteration(state, buffer, gen, n)
        return time.perf_counter() - t

    return run


def sb3_side(algo_name: str):
    import gymnasium as gym
    import numpy as np
    from stable_baselines3 import SAC, TD3

    cls = SAC if algo_name == "sac" else TD3
    model = cls("MlpPolicy", gym.make("Pendulum-v1"), learning_starts=0, device="cpu", seed=0, verbose=0,
                **({"learning_rate": 1e-3} if algo_name == "sac" else {}))
    from stable_baselines3.common.logger import configure

    model.set_logger(configure(None, []))  # train() logs; learn() would have set it
    rng = np.random.default_rng(0)
    for _ in range(ROWS):  # random transitions, as the rlfunc side's buffer
        obs = rng.standard_normal((1, 3)).astype(np.float32)
        model.replay_buffer.add(obs, obs + 0.1, rng.uniform(-2, 2, (1, 1)).astype(np.float32),
                                rng.standard_normal(1).astype(np.float32), np.zeros(1), [{}])

    def run(n: int) -> float:
        t = time.perf_counter()
        model.train(gradient_steps=n, batch_size=256)
        return time.perf_counter() - t

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algos", nargs="+", default=["sac", "td3"], choices=["sac", "td3"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--updates", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name in a.algos:
        sides = {"eager": rlfunc_side(name, "off"), "compiled": rlfunc_side(name, "on"), "sb3": sb3_side(name)}
        warm = {k: run(4) for k, run in sides.items()}  # the compiled side compiles here
        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(a.repeats):
            for k, run in sides.items():
                times[k].append(run(a.updates) / a.updates * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name}: ms per gradient step, median of {a.repeats} (min): "
              + ", ".join(f"{k} {med[k]:.1f} ({min(times[k]):.1f})" for k in sides)
              + f"; eager / sb3 {med['eager'] / med['sb3']:.2f}, compiled / sb3 {med['compiled'] / med['sb3']:.2f}; "
              f"warm-up incl. compile {warm['compiled']:.1f} s", flush=True)


if __name__ == "__main__":
    main()

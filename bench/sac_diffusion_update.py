"""sac-diffusion's (DACER) gradient step against Gaussian SAC's at HalfCheetah-v5's sizes (issue 17,
item 3: "its update time per step against Gaussian SAC's").

Both algorithms at their default configs with ``env="HalfCheetah-v5"`` (17 observations, 6 actions):
SAC's tanh-Gaussian actor and twin 256x256 critics; sac-diffusion's DiffusionMLP 256x256x256 denoiser
through a 20-step chain (forward and backward), twin 256x256 critics, its entropy estimate (a
3-component mixture fitted to 200 actions for 16 states) every 20 updates. Minibatches of 256 from a
replay buffer of 5,000 random transitions, eager, one intra-op thread. One measurement is ``--updates``
gradient steps (a multiple of 20, so sac-diffusion's share of entropy estimates is its run's) after
a warm-up; the two sides alternate in each round; the result is the median over rounds in ms per
gradient step and sac-diffusion's over SAC's.

    OMP_NUM_THREADS=1 python -m bench.sac_diffusion_update --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tensordict import TensorDict

from rlfunc.config import replace

CPU = torch.device("cpu")
ENV = "HalfCheetah-v5"
ROWS = 5_000


def sac_side(updates: int):
    import gymnasium as gym
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from rlfunc.algos.sac import SACConfig, make_sac
    from rlfunc.run.ppo import env_spec

    venv = gym.make_vec(ENV, 1)
    spec = env_spec(venv)
    venv.close()
    algo = make_sac(replace(SACConfig(), env=ENV, compile="off", device="cpu"), spec, CPU)
    g = torch.Generator().manual_seed(0)
    buffer = ReplayBuffer(storage=LazyTensorStorage(ROWS))
    buffer.extend(TensorDict({
        "observation": torch.randn(ROWS, spec.obs_dim, generator=g),
        "action": torch.rand(ROWS, spec.act_dim, generator=g) * 2 - 1,
        "next": {"observation": torch.randn(ROWS, spec.obs_dim, generator=g), "reward": torch.randn(ROWS, 1, generator=g),
                 "terminated": torch.rand(ROWS, 1, generator=g) < 0.01},
    }, batch_size=[ROWS]))
    state, gen = algo.init(), torch.Generator().manual_seed(0)

    def run() -> float:
        t = time.perf_counter()
        algo.iteration(state, buffer, gen, updates)
        return time.perf_counter() - t

    return run


def diffusion_side(updates: int):
    from bench.compiled_diffusion_offpolicy import side

    return side("sac-diffusion", "off", updates, env=ENV)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--updates", type=int, default=20, help="gradient steps per measurement (a multiple of 20)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    sides = {"sac": sac_side(a.updates), "sac-diffusion": diffusion_side(a.updates)}
    for run in sides.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(a.repeats):
        for name, run in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            times[name].append(run() / a.updates * 1e3)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"{ENV} sizes, eager, one thread, {a.updates} updates per measurement, {a.repeats} interleaved rounds")
    for name, t in times.items():
        print(f"  {name:14s} ms/step median {med[name]:8.2f}  (rounds: {', '.join(f'{x:.1f}' for x in t)})")
    print(f"  sac-diffusion / sac: {med['sac-diffusion'] / med['sac']:.1f}x")


if __name__ == "__main__":
    main()

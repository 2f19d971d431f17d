"""PPO's update at identical hyperparameters: rlfunc eager, rlfunc --compile on, and a bare PyTorch
loop (nn.Module + torch.optim.Adam(foreach) + clip_grad_norm_, no library), issue 18.

HalfCheetah-v5's sizes (17 observations, 6 actions), a 2048-sample batch of random data, 10 epochs
of 32 minibatches of 64 (320 gradient steps per iteration), tanh MLPs of --hidden, one intra-op
thread. Each measurement is one iteration's update (rlfunc: ``iteration`` less nothing: GAE and
normalisation of the batch are included, a few ms; bare: the 320 steps only) timed after a warm-up
iteration (the compiled side compiles there: its compile time is reported apart). Sides alternate
in each round; the result is the median over rounds of each side / bare.

    python -m bench.compiled_update --hidden 64 256 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tensordict import TensorDict
from torch import nn

from rlfunc.algos.ppo import EnvSpec, PPOConfig, make_ppo
from rlfunc.config import replace

OBS, ACT, N, T = 17, 6, 1, 2048


def batch(seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(1, N, T, OBS, generator=g)
    nxt = TensorDict({"observation": obs + 0.1, "reward": torch.randn(1, N, T, 1, generator=g),
                      "done": torch.zeros(1, N, T, 1, dtype=torch.bool), "terminated": torch.zeros(1, N, T, 1, dtype=torch.bool)},
                     batch_size=[1, N, T])
    action = torch.randn(1, N, T, ACT, generator=g)
    return TensorDict({"observation": obs, "action": action, "sample_log_prob": -0.5 * action.square().sum(-1, keepdim=True) - 5.5,
                       "next": nxt}, batch_size=[1, N, T])


def rlfunc_side(hidden: int, compile: str):
    config = replace(PPOConfig(), env="HalfCheetah-v5", num_envs=N, num_steps=T, num_epochs=10, minibatch_size=64,
                     hidden=(hidden, hidden), lr=3e-4, total_steps=T * 1000, compile=compile)
    algo = make_ppo(config, EnvSpec(OBS, ACT, [-1.0] * ACT, [1.0] * ACT), torch.device("cpu"))
    state = {"s": algo.init()}
    gens = [torch.Generator().manual_seed(0)]

    def run(i: int) -> float:
        b = batch(i)
        t0 = time.perf_counter()
        state["s"], _ = algo.iteration(state["s"], b, gens)
        return time.perf_counter() - t0

    return run


def bare_side(hidden: int):
    def mlp(out):
        return nn.Sequential(nn.Linear(OBS, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, out))

    actor, critic, log_std = mlp(ACT), mlp(1), nn.Parameter(torch.zeros(ACT))
    params = [*actor.parameters(), *critic.parameters(), log_std]
    opt = torch.optim.Adam(params, lr=3e-4, eps=1e-5, foreach=True)

    def run(i: int) -> float:
        b = batch(i)
        obs, act = b["observation"].reshape(T, OBS), b["action"].reshape(T, ACT)
        old_lp, adv = b["sample_log_prob"].reshape(T, 1), torch.randn(T, 1)
        ret, old_v = torch.randn(T, 1), torch.randn(T, 1)
        g = torch.Generator().manual_seed(i)
        t0 = time.perf_counter()
        for _ in range(10):
            perm = torch.randperm(T, generator=g)
            for k in range(T // 64):
                idx = perm[k * 64:(k + 1) * 64]
                a = adv[idx]
                a = (a - a.mean()) / (a.std() + 1e-8)
                dist = torch.distributions.Normal(actor(obs[idx]), log_std.exp())
                lp = dist.log_prob(act[idx]).sum(-1, keepdim=True)
                ratio = (lp - old_lp[idx]).exp()
                pg = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a).mean()
                v = critic(obs[idx])
                loss = pg + 0.5 * 0.5 * (v - ret[idx]).square().mean() - 0.0 * dist.entropy().mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
        return time.perf_counter() - t0

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for hidden in args.hidden:
        sides = {"bare": bare_side(hidden), "eager": rlfunc_side(hidden, "off"), "compiled": rlfunc_side(hidden, "on")}
        for name, run in sides.items():  # warm-up (the compiled side compiles here)
            print(f"hidden {hidden}: {name} first iteration {run(-1):.2f} s", flush=True)
        times = {name: [] for name in sides}
        for r in range(args.repeats):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                times[name].append(sides[name](r))
        for name, ts in times.items():
            ratios = [t / b for t, b in zip(ts, times["bare"])]
            print(f"hidden {hidden}: {name:8s} update s {', '.join(f'{t:.2f}' for t in ts)}  "
                  f"median {statistics.median(ts):.2f}  / bare: median {statistics.median(ratios):.2f} "
                  f"[{min(ratios):.2f}, {max(ratios):.2f}]", flush=True)


if __name__ == "__main__":
    main()

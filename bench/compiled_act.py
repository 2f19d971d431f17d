"""The rollout policy's forward compiled vs eager on this device (issue 18, item 1): microseconds per
call of PPO's acting function (HalfCheetah-v5 sizes: 17 observations, 6 actions, 64x64 tanh actor,
observation normalisation, Gaussian noise from the seed's generator), one env and 16 envs per call,
eager and compiled (``rlfunc.device.compile_policy`` forced onto this device) alternating in every
repeat, one intra-op thread. This measurement is why ``POLICY_COMPILE_DEVICES`` holds CUDA only.

    OMP_NUM_THREADS=1 python -m bench.compiled_act --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlfunc import device as devices
from rlfunc.algos.ppo import EnvSpec, PPOConfig, make_ppo
from rlfunc.config import replace

SPEC = EnvSpec(17, 6, [-1.0] * 6, [1.0] * 6)


def acting(compile: str, num_envs: int, dev: torch.device):
    config = replace(PPOConfig(), env="HalfCheetah-v5", num_envs=num_envs, num_steps=64, minibatch_size=64,
                     hidden=(64, 64), activation="tanh", normalize_observations=True, compile=compile, device=str(dev))
    algo = make_ppo(config, SPEC, dev)
    state = algo.init()
    return algo.policy(state, [torch.Generator(device=dev).manual_seed(0)], log_prob=False)


def per_call_us(act, x: torch.Tensor, calls: int) -> float:
    with torch.inference_mode():
        t0 = time.perf_counter()
        for _ in range(calls):
            act(x)
        if x.device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(a.device)
    devices.POLICY_COMPILE_DEVICES = (*devices.POLICY_COMPILE_DEVICES, dev.type)
    print(f"device {dev}, torch {torch.__version__}, {a.calls} calls per timing")
    print("| envs per call | eager us/call | compiled us/call | compiled / eager | first compiled call s |")
    print("|---|--:|--:|--:|--:|")
    for n in (1, 16):
        x = torch.randn(n, SPEC.obs_dim, device=dev)
        eager, compiled = acting("off", n, dev), acting("on", n, dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            compiled(x)
        first = time.perf_counter() - t0
        per_call_us(eager, x, 200), per_call_us(compiled, x, 200)  # warm
        e, c = [], []
        for _ in range(a.repeats):
            e.append(per_call_us(eager, x, a.calls))
            c.append(per_call_us(compiled, x, a.calls))
        me, mc = statistics.median(e), statistics.median(c)
        print(f"| {n} | {me:.1f} ({min(e):.1f}-{max(e):.1f}) | {mc:.1f} ({min(c):.1f}-{max(c):.1f}) | {mc / me:.2f} | {first:.1f} |", flush=True)


if __name__ == "__main__":
    main()

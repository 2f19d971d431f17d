"""Is rlfunc's GAE faster than TorchRL's, at least as accurate, on a typical PPO rollout on CPU?

Run from the repository root: ``python -m bench.gae`` (or ``python bench/gae.py``); torch's default
number of threads is used unless ``--threads N`` is given.

Same inputs for all three: [64, 2048, 1] float32 N(0, 1) values and rewards, terminations and
truncations each with probability 0.002 per step. Calls are interleaved over several repeats and
the median wall time is reported, with the ratio to ours and the max abs error against a float64
loop over time.

Mind the load average printed first: where other processes keep the cores busy, every
multi-threaded op waits at its barrier for a descheduled thread (milliseconds each). Ours issues
about 30 full-size ops (a parallel scan), TorchRL's loop about 12 plus 6000 tiny single-threaded
ones, so there the loop can come out ahead; ``--threads 1`` shows the work itself.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

if __package__ in (None, ""):  # python bench/gae.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchrl.objectives.value.functional import (  # noqa: E402
    generalized_advantage_estimate as torchrl_gae,
    vec_generalized_advantage_estimate as torchrl_vec_gae,
)

from rlfunc.core.returns import generalized_advantage_estimate  # noqa: E402

SHAPE = (64, 2048, 1)
SETTINGS = [(0.99, 0.95), (0.999, 0.999)]  # (gamma, lmbda)
REPEATS = 21


def make_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    state_value = torch.randn(SHAPE, generator=g)
    next_state_value = torch.randn(SHAPE, generator=g)
    reward = torch.randn(SHAPE, generator=g)
    terminated = torch.rand(SHAPE, generator=g) < 0.002
    truncated = torch.rand(SHAPE, generator=g) < 0.002
    return state_value, next_state_value, reward, terminated | truncated, terminated


def reference(gamma, lmbda, state_value, next_state_value, reward, done, terminated):
    """float64 loop over time."""
    v, nv, r = state_value.double(), next_state_value.double(), reward.double()
    not_done, not_term = (~done).double(), (~terminated).double()
    advantage = torch.zeros_like(v)
    running = torch.zeros_like(v[:, 0])
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * not_term[:, t] * nv[:, t] - v[:, t]
        running = delta + gamma * lmbda * not_done[:, t] * running
        advantage[:, t] = running
    return advantage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave)")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    impls = {
        "rlfunc generalized_advantage_estimate": generalized_advantage_estimate,
        "torchrl generalized_advantage_estimate": torchrl_gae,
        "torchrl vec_generalized_advantage_estimate": torchrl_vec_gae,
    }
    inputs = make_inputs()
    print(
        f"GAE on CPU, inputs {list(SHAPE)} float32, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()} ({'default' if args.threads is None else 'set'}) "
        f"of {os.cpu_count()} cores, {platform.processor() or platform.machine()}"
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(f"load average before: {load} (other processes share these cores if it exceeds 0)")
    print(f"{args.repeats} interleaved repeats, median wall time; error = max |A - A_float64 loop|\n")
    header = f"| gamma, lmbda | {'implementation':43s} | median ms | x ours | max abs err |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    with torch.no_grad():
        for gamma, lmbda in SETTINGS:
            ref = reference(gamma, lmbda, *inputs)
            errors, times = {}, {name: [] for name in impls}
            for name, fn in impls.items():  # warm-up, and the error of each
                errors[name] = (fn(gamma, lmbda, *inputs)[0].double() - ref).abs().max().item()
            for _ in range(args.repeats):
                for name, fn in impls.items():
                    start = time.perf_counter()
                    fn(gamma, lmbda, *inputs)
                    times[name].append(time.perf_counter() - start)
            ours = statistics.median(times["rlfunc generalized_advantage_estimate"])
            for name in impls:
                median = statistics.median(times[name])
                print(
                    f"| {f'{gamma}, {lmbda}':12s} | {name:43s} | {median * 1e3:9.2f} | {median / ours:6.1f} "
                    f"| {errors[name]:11.1e} |"
                )


if __name__ == "__main__":
    main()

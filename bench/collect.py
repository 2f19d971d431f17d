"""Collection overhead: steps/s of our rollout (PPO policy in the loop) and of a TorchRL Collector,
as a share of the bare gymnasium vector env stepping random actions. Same process, interleaved:
each repeat times bare, ours and TorchRL back to back, and the shares are medians of the per-repeat
ratios (paired, so a load spike on this shared machine hits both sides of a ratio).

"ours" is the trainer's rollout: the policy without per-step log-probabilities
(``policy(..., log_prob=False)``; the update computes them for the whole batch in one pass).
"ours+logp" is the same rollout with the log-probability computed at every step, as the policy
does for TorchRL (whose collector gets that policy).

    python -m bench.collect [--env Pendulum-v1] [--num-envs 8 16 64] [--repeats 15] [--steps 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlfunc.algos.ppo import make_ppo, preset
from rlfunc.envs import collect
from rlfunc.run.ppo import _generators, env_spec


def bare(venv, steps: int) -> float:
    venv.action_space.seed(0)
    t = time.perf_counter()
    for _ in range(steps):
        venv.step(venv.action_space.sample())
    return steps * venv.num_envs / (time.perf_counter() - t)


def ours(venv, policy, carry, steps: int) -> tuple[float, object]:
    t = time.perf_counter()
    _, carry = collect.rollout(venv, policy, carry, steps, device=torch.device("cpu"))
    return steps * venv.num_envs / (time.perf_counter() - t), carry


def torchrl(collector_iter, frames: int) -> float:
    t = time.perf_counter()
    next(collector_iter)
    return frames / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="Pendulum-v1")
    p.add_argument("--num-envs", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the trainer's default: 1)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"env={a.env} steps/env/repeat={a.steps} repeats={a.repeats} torch threads={torch.get_num_threads()}")
    print(f"{'num_envs':>8} {'bare steps/s':>13} {'ours steps/s':>13} {'ours/bare':>9} {'ours+logp/bare':>14} "
          f"{'torchrl steps/s':>16} {'torchrl/bare':>12}")
    for n in a.num_envs:
        config = preset(a.env, num_envs=n, minibatch_size=n, device="cpu")
        venv = collect.make_vec_env(a.env, n)
        algo = make_ppo(config, env_spec(venv), torch.device("cpu"))
        state = algo.init()
        state["obs_stats", "var"] = torch.full_like(state["obs_stats", "var"], 2.0)  # a non-trivial normaliser
        policy = algo.policy(state, _generators(state, torch.device("cpu")))
        carry = collect.reset(venv, collect.env_seeds(0, n))
        bare_venv = collect.make_vec_env(a.env, n)
        bare_venv.reset(seed=0)
        tr_env = collect.make_torchrl_env(a.env, n)
        tr_iter = iter(collect.make_collector(tr_env, policy, frames_per_batch=n * a.steps))
        next(tr_iter)  # warm-up
        fast = algo.policy(state, _generators(state, torch.device("cpu")), log_prob=False)  # the trainer's
        ours(venv, fast, carry, 8)
        rates = {"bare": [], "ours": [], "ours+logp": [], "torchrl": []}
        for _ in range(a.repeats):  # interleaved
            rates["bare"].append(bare(bare_venv, a.steps))
            r, carry = ours(venv, fast, carry, a.steps)
            rates["ours"].append(r)
            r, carry = ours(venv, policy, carry, a.steps)
            rates["ours+logp"].append(r)
            rates["torchrl"].append(torchrl(tr_iter, n * a.steps))
        med = {k: statistics.median(v) for k, v in rates.items()}
        share = {k: statistics.median(r / b for r, b in zip(rates[k], rates["bare"])) for k in ("ours", "ours+logp", "torchrl")}
        print(f"{n:>8} {med['bare']:>13.0f} {med['ours']:>13.0f} {share['ours']:>9.2f} {share['ours+logp']:>14.2f} "
              f"{med['torchrl']:>16.0f} {share['torchrl']:>12.2f}")
        for v in (venv, bare_venv):
            v.close()


if __name__ == "__main__":
    main()

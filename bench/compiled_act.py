"""ppo's rollout action function, eager vs torch.compile (the issue's "the policy's action function for
rollouts compiled too"): is there anything to gain on a CPU?

Pendulum-v1, the default PPOConfig (8 envs, 64x64 tanh MLP). Per call, medians over 5 rounds of 5,000
calls: the trainer's policy (``algo.policy(state, gens, log_prob=False)``), a hand-fused pure
``act(obs, noise)`` with the same math (normalise, clamp, three addmm, addcmul), and that function through
torch.compile (fullgraph, static shapes). Then the share of an iteration the policy can be: the
rollout's time per vector step and the eager update's per vector step.

    OMP_NUM_THREADS=1 python -m bench.compiled_act
"""

from __future__ import annotations

import statistics
import time

import torch

from rlfunc.algos.ppo import PPOConfig, make_ppo
from rlfunc.config import replace
from rlfunc.envs import collect
from rlfunc.run.ppo import env_spec


def pure(x, noise, ws, mean, inv_std, std):
    x = ((x - mean) * inv_std).clamp(-10.0, 10.0)
    (w0, b0), (w1, b1), (w2, b2) = ws
    h = torch.tanh(torch.addmm(b0, x, w0))
    h = torch.tanh(torch.addmm(b1, h, w1))
    return torch.addcmul(torch.addmm(b2, h, w2), std, noise)


def per_call_us(f, n: int = 5000) -> float:
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    config = replace(PPOConfig(), device="cpu", compile="off")
    venv = collect.make_vec_env(config.env, config.num_envs)
    spec = env_spec(venv)
    algo = make_ppo(config, spec, cpu)
    state = algo.init()
    g = torch.Generator().manual_seed(0)
    act = algo.policy(state, [g], log_prob=False)
    obs = torch.randn(config.num_envs, spec.obs_dim)
    p = state["params", "actor"][0]
    ws = [(p[k, "weight"].detach().t(), p[k, "bias"].detach()) for k in ("0", "2", "4")]
    stats = state["obs_stats"][0]
    mean, inv_std = stats["mean"], torch.rsqrt(stats["var"] + 1e-8)
    std = state["params", "log_std"][0].detach().exp()
    compiled = torch.compile(pure, fullgraph=True, dynamic=False)
    t = time.perf_counter()
    compiled(obs, torch.randn(config.num_envs, spec.act_dim), ws, mean, inv_std, std)
    print(f"compile {time.perf_counter() - t:.1f} s")
    noise = lambda: torch.randn((config.num_envs, spec.act_dim), generator=g)  # noqa: E731
    res = {"policy (eager, the trainer's)": [], "pure act (eager)": [], "pure act (compiled)": []}
    for _ in range(5):
        res["policy (eager, the trainer's)"].append(per_call_us(lambda: act(obs)))
        res["pure act (eager)"].append(per_call_us(lambda: pure(obs, noise(), ws, mean, inv_std, std)))
        res["pure act (compiled)"].append(per_call_us(lambda: compiled(obs, noise(), ws, mean, inv_std, std)))
    for k, v in res.items():
        print(f"{k}: {statistics.median(v):.0f} us/call (rounds {', '.join(f'{x:.0f}' for x in v)})")
    carry = collect.reset(venv, list(range(config.num_envs)))
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        batch, carry = collect.rollout(venv, algo.policy(state, [g], log_prob=False), carry, config.num_steps, device=cpu)
        ts.append((time.perf_counter() - t) / config.num_steps * 1e6)
    print(f"rollout: {statistics.median(ts):.0f} us per vector step")
    batch = batch.reshape(1, config.num_envs, config.num_steps)
    ts = []
    for _ in range(2):
        t = time.perf_counter()
        state, _ = algo.iteration(state, batch, [g])
        ts.append(time.perf_counter() - t)
    print(f"update (eager): {statistics.median(ts) / config.num_steps * 1e6:.0f} us per vector step")
    venv.close()


if __name__ == "__main__":
    main()

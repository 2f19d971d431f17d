"""PPO end to end at identical hyperparameters against stable-baselines3 (issue 18's table): HalfCheetah-v5,
65,536 env steps, 2048-step rollouts (16 envs x 128 or 1 env x 2048), 10 epochs of minibatches of 64,
64x64 tanh MLPs (separate actor and critic), lr 3e-4 constant, gamma 0.99, lambda 0.95, clip 0.2,
value coefficient 0.5, no entropy bonus, grad-norm clip 0.5, no observation or reward normalisation,
initial log std 0; one intra-op thread each.

Rows, interleaved per repeat: rlfunc with ``--compile on`` (the compile of the first iteration
included, inductor's on-disk cache as it is), rlfunc eager, SB3 (``PPO("MlpPolicy", ...)`` with the same
settings). The time is the wall-clock of the training call alone (rlfunc's ``train`` with no final
evaluation, snapshots or versions; SB3's ``learn``); medians over --repeats. CleanRL (a script, not a
package) is not installed here.

    OMP_NUM_THREADS=1 python -m bench.ppo_e2e --layouts 16x128 1x2048 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

STEPS = 65_536


def ours(num_envs: int, num_steps: int, compile: str, tmp: Path) -> float:
    from rlfunc.algos.ppo import PPOConfig
    from rlfunc.config import replace
    from rlfunc.run import train

    config = replace(PPOConfig(), env="HalfCheetah-v5", total_steps=STEPS, num_envs=num_envs, num_steps=num_steps,
                     num_epochs=10, minibatch_size=64, hidden=(64, 64), activation="tanh", lr=3e-4, anneal_lr=False,
                     gamma=0.99, lmbda=0.95, clip_epsilon=0.2, value_coef=0.5, entropy_coef=0.0, max_grad_norm=0.5,
                     normalize_observations=False, normalize_rewards=False, init_log_std=0.0, exploration="gaussian",
                     compile=compile, torch_threads=1, checkpoint_every=0, version_every=0, device="cpu")
    t0 = time.perf_counter()
    train(config, tmp / f"ours_{num_envs}_{compile}_{time.time_ns()}", progress=False, tensorboard=False, evaluate=False)
    return time.perf_counter() - t0


def sb3(num_envs: int, num_steps: int) -> float:
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)
    venv = make_vec_env("HalfCheetah-v5", n_envs=num_envs, seed=0)
    model = PPO("MlpPolicy", venv, n_steps=num_steps, batch_size=64, n_epochs=10, learning_rate=3e-4, gamma=0.99,
                gae_lambda=0.95, clip_range=0.2, vf_coef=0.5, ent_coef=0.0, max_grad_norm=0.5, seed=0, device="cpu", verbose=0)
    t0 = time.perf_counter()
    model.learn(total_timesteps=STEPS)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=["16x128", "1x2048"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for layout in args.layouts:
                n, t = map(int, layout.split("x"))
                for name, fn in (("rlfunc compiled", lambda: ours(n, t, "on", Path(tmp))),
                                 ("rlfunc eager", lambda: ours(n, t, "off", Path(tmp))), ("sb3", lambda: sb3(n, t))):
                    s = fn()
                    times.setdefault((layout, name), []).append(s)
                    print(f"repeat {r} {layout} {name}: {s:.1f} s", flush=True)
    print(f"\nHalfCheetah-v5, {STEPS} env steps, identical hyperparameters, medians of {args.repeats} (min)")
    print("| layout | rlfunc compiled | rlfunc eager | SB3 | compiled / SB3 |")
    print("|---|---:|---:|---:|---:|")
    for layout in args.layouts:
        med = {k: statistics.median(times[(layout, k)]) for k in ("rlfunc compiled", "rlfunc eager", "sb3")}
        mins = {k: min(times[(layout, k)]) for k in med}
        print(f"| {layout} | {med['rlfunc compiled']:.1f} ({mins['rlfunc compiled']:.1f}) | {med['rlfunc eager']:.1f} "
              f"({mins['rlfunc eager']:.1f}) | {med['sb3']:.1f} ({mins['sb3']:.1f}) | {med['rlfunc compiled'] / med['sb3']:.2f} |")


if __name__ == "__main__":
    main()

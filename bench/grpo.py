"""GRPO vs GSPO vs our PPO at the same env-step budget: final deterministic return and wall time.

    OMP_NUM_THREADS=1 python -m bench.grpo [--envs PointReach-v0 Pendulum-v1] [--seeds 0 1 2]
        [--steps PointReach-v0=100000 Pendulum-v1=200000] [--episodes 20]

Methods (each with its defaults / env preset): ``grpo``, ``gspo`` (GRPOConfig's clip 0.03/0.04),
``gspo-paper`` (the GSPO paper's clip 3e-4/4e-4) and ``ppo`` (PPOConfig preset, with a critic and
GAE). All are evaluated on the same gymnasium episodes (the PPO evaluation seeds), deterministic
actions. Runs are interleaved per seed; wall time is the training loop's (the last metrics line),
without the final evaluation.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from rlfunc.algos.grpo import preset as grpo_preset
from rlfunc.algos.ppo import preset as ppo_preset
from rlfunc.run import train
from rlfunc.run.log import read_metrics
from rlfunc.run import train
from rlfunc.run.ppo import evaluate

METHODS = ("grpo", "gspo", "gspo-paper", "ppo")
DEFAULT_STEPS = {"PointReach-v0": 100_000, "Pendulum-v1": 200_000}


def _train_seconds(run_dir: Path) -> float:
    """Wall time of the training loop: the "time" of the last metrics line (no final evaluation)."""
    return float(read_metrics(run_dir / "metrics.jsonl")[-1]["time"])


def run(method: str, env: str, steps: int, seed: int, episodes: int, root: Path) -> tuple[float, float, int]:
    """(mean deterministic return over ``episodes``, wall seconds of training, env steps simulated)."""
    run_dir = root / f"{env}-{method}-s{seed}"
    common = dict(total_steps=steps, seed=seed, device="cpu", checkpoint_every=0, eval_episodes=episodes)
    if method == "ppo":
        train(ppo_preset(env, **common), run_dir, progress=False, tensorboard=False, evaluate=False)
        summary = evaluate(run_dir, episodes, device="cpu")
        return summary["mean"], _train_seconds(run_dir), summary["env_steps"]
    loss = "grpo" if method == "grpo" else "gspo"
    extra = dict(gspo_clip_epsilon=3e-4, gspo_clip_epsilon_high=4e-4) if method == "gspo-paper" else {}
    result = train(grpo_preset(env, loss, **common, **extra), run_dir, progress=False, tensorboard=False)
    return result.evaluation["mean"], _train_seconds(run_dir), result.evaluation["env_steps"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--envs", nargs="+", default=list(DEFAULT_STEPS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", nargs="*", default=[], help="ENV=STEPS overrides of the per-env budget")
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    a = p.parse_args()
    budget = {**DEFAULT_STEPS, **{k: int(v) for k, v in (s.split("=") for s in a.steps)}}
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench_grpo_"))
    rows = []
    print(f"| env | method | seed | env steps | return | wall s |\n|---|---|---|---|---|---|", flush=True)
    for env in a.envs:
        for seed in a.seeds:
            for method in a.methods:  # interleaved per seed
                ret, wall, steps = run(method, env, budget[env], seed, a.episodes, root)
                rows.append((env, method, seed, ret, wall))
                print(f"| {env} | {method} | {seed} | {steps} | {ret:.3f} | {wall:.1f} |", flush=True)
    print("\n| env | method | median return | min | max | median wall s | wall / ppo |\n|---|---|---|---|---|---|---|")
    for env in a.envs:
        ppo_wall = [r[4] for r in rows if r[0] == env and r[1] == "ppo"]
        base = statistics.median(ppo_wall) if ppo_wall else float("nan")
        for method in a.methods:
            rets = [r[3] for r in rows if r[0] == env and r[1] == method]
            walls = [r[4] for r in rows if r[0] == env and r[1] == method]
            w = statistics.median(walls)
            print(f"| {env} | {method} | {statistics.median(rets):.3f} | {min(rets):.3f} | {max(rets):.3f} "
                  f"| {w:.1f} | {w / base:.2f} |")


if __name__ == "__main__":
    main()

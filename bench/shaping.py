"""Gradient-shaping transforms vs plain PPO: final deterministic return and update wall time.

    OMP_NUM_THREADS=1 python -m bench.shaping [--envs Pendulum-v1 PointReach-v0] [--seeds 0 1 2]
        [--steps Pendulum-v1=20480 PointReach-v0=12288] [--episodes 10] [--methods ...]
    OMP_NUM_THREADS=1 python -m bench.shaping --timing-only [--repeats 3]

Every method is PPO with the values of the "ppo-shaped" preset (gamma 0.99, lmbda 0.95, clip 0.2,
grad clip 0.3, 10 epochs x 32 minibatches of 2048-step rollouts) on top of the env's preset, with
the transforms switched: ``plain`` (none), ``damping`` (oscillation damping, curvature every 5
steps), ``clip`` (adaptive per-layer clip radius, 0.2 * 0.995^t), ``prioritized`` (prioritised
minibatches, alpha 0.6, beta 0.4) and ``shaped`` (all three: the preset); ``clip-x10`` (the clip
radius with ``trust_radius_scale=10``) runs when named in ``--methods``. The seeds of a method
train together in one process (stacked params, ``num_seeds``); methods are interleaved per env.
Return: deterministic, ``--episodes`` episodes per seed of the final params; update time: the median
over iterations of the learner update (``update_s`` in metrics.jsonl, collection excluded).
``--timing-only`` times one update per method on one synthetic batch instead, methods interleaved
and repeated (less sensitive to a loaded machine than the training runs, which run one after another).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from rlfunc.algos.ppo import preset
from rlfunc.run.log import read_metrics
from rlfunc.run import train
from rlfunc.run.ppo import evaluate

METHODS = {
    "plain": dict(oscillation_damping=False, adaptive_clip=False, prioritized_minibatches=False),
    "damping": dict(oscillation_damping=True, adaptive_clip=False, prioritized_minibatches=False),
    "clip": dict(oscillation_damping=False, adaptive_clip=True, prioritized_minibatches=False),
    "prioritized": dict(oscillation_damping=False, adaptive_clip=False, prioritized_minibatches=True),
    "shaped": dict(),  # the preset: all three on
    # not run by default: the clip radius 10x looser than its strict first-order bound
    "clip-x10": dict(oscillation_damping=False, adaptive_clip=True, prioritized_minibatches=False, trust_radius_scale=10.0),
}
DEFAULT_METHODS = ("plain", "damping", "clip", "prioritized", "shaped")
DEFAULT_STEPS = {"Pendulum-v1": 20_480, "PointReach-v0": 12_288}


def run(method: str, env: str, steps: int, seeds: list[int], episodes: int, root: Path) -> tuple[list[float], float]:
    """(per-seed mean deterministic return, median update seconds per iteration)."""
    run_dir = root / f"{env}-{method}"
    config = preset(
        env, shaping="ppo-shaped", total_steps=steps, seed=seeds[0], num_seeds=len(seeds), device="cpu",
        checkpoint_every=0, version_every=0, eval_episodes=episodes, **METHODS[method],
    )
    train(config, run_dir, progress=False, tensorboard=False, evaluate=False)
    summary = evaluate(run_dir, episodes, device="cpu")
    update_s = statistics.median(float(r["update_s"]) for r in read_metrics(run_dir / "metrics.jsonl"))
    return [float(x) for x in summary["per_seed_mean"]], update_s


def update_timing(methods: list[str], repeats: int, num_seeds: int) -> dict[str, float]:
    """Median seconds of one learner update (``iteration``) per method on the same synthetic
    Pendulum-sized batch ([num_seeds, 8, 256], obs 3, action 1), methods interleaved per repeat."""
    from rlfunc.algos.ppo import EnvSpec, make_ppo
    from tensordict import TensorDict
    import time

    S, N, T = num_seeds, 8, 256
    g = torch.Generator().manual_seed(0)
    obs, action = torch.randn(S, N, T, 3, generator=g), torch.randn(S, N, T, 1, generator=g)
    nxt = {"observation": obs + 0.1, "reward": torch.randn(S, N, T, 1, generator=g),
           "done": torch.zeros(S, N, T, 1, dtype=torch.bool), "terminated": torch.zeros(S, N, T, 1, dtype=torch.bool)}
    batch = TensorDict({"observation": obs, "action": action, "sample_log_prob": -0.5 * action.square() - 0.92,
                        "next": TensorDict(nxt, batch_size=[S, N, T])}, batch_size=[S, N, T])
    spec, runs, times = EnvSpec(3, 1, [-2.0], [2.0]), {}, {m: [] for m in methods}
    for m in methods:
        config = preset("Pendulum-v1", shaping="ppo-shaped", num_seeds=S, device="cpu", **METHODS[m])
        algo = make_ppo(config, spec, torch.device("cpu"))
        state = algo.init()
        runs[m] = [algo, state, [torch.Generator().manual_seed(s) for s in config.seeds]]
    for _ in range(repeats + 1):  # the first round warms up
        for m in methods:
            algo, state, gens = runs[m]
            t = time.perf_counter()
            runs[m][1], _ = algo.iteration(state, batch, gens)
            times[m].append(time.perf_counter() - t)
    return {m: statistics.median(v[1:]) for m, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--envs", nargs="+", default=list(DEFAULT_STEPS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", nargs="*", default=[], help="ENV=STEPS overrides of the per-env budget")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS))
    p.add_argument("--timing-only", action="store_true", help="only the interleaved update-time measurement")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.timing_only:
        times = update_timing(a.methods, a.repeats, len(a.seeds))
        base = times.get("plain", float("nan"))
        print(f"| method | update s (median of {a.repeats}, {len(a.seeds)} stacked seeds, 320 minibatch steps) | / plain |\n|---|---|---|")
        for m, t in times.items():
            print(f"| {m} | {t:.2f} | {t / base:.2f} |")
        return
    budget = {**DEFAULT_STEPS, **{k: int(v) for k, v in (s.split("=") for s in a.steps)}}
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench_shaping_"))
    rows = {}
    print("| env | method | env steps/seed | per-seed return | update s/iter |\n|---|---|---|---|---|", flush=True)
    for env in a.envs:
        for method in a.methods:
            rets, upd = run(method, env, budget[env], a.seeds, a.episodes, root)
            rows[env, method] = (rets, upd)
            print(f"| {env} | {method} | {budget[env]} | {', '.join(f'{r:.1f}' for r in rets)} | {upd:.2f} |", flush=True)
    print("\n| env | method | median return | min | max | update s/iter | update time / plain |\n|---|---|---|---|---|---|---|")
    for env in a.envs:
        base = rows[env, "plain"][1] if (env, "plain") in rows else float("nan")
        for method in a.methods:
            rets, upd = rows[env, method]
            print(f"| {env} | {method} | {statistics.median(rets):.1f} | {min(rets):.1f} | {max(rets):.1f} "
                  f"| {upd:.2f} | {upd / base:.2f} |")


if __name__ == "__main__":
    main()

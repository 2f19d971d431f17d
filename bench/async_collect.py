"""Asynchronous off-policy collection (issue 16, item 2): env steps/s of sac and td3 (and of
td3-diffusion and sac-diffusion, whose worker rolls out the diffusion actor's chain) with the envs
stepped in the learner's process (the default loop) and in one collector process while the learner
updates (``--async-collection``, rlfunc.envs.async_collect).

Rows, interleaved per repeat: the same config (``--env``, ``--num-envs``, ``--steps`` env steps after
``--learning-starts``, ``--compile``) in both modes; the rate is env steps / (collect_s + update_s)
over the iterations after the first (the first holds the worker's start and any compile), median
over --repeats. With async collection collect_s is the learner's wait for transitions, so the rate
is what the learner sees. The final returns are printed for orientation only (one seed, 10 episodes:
not a quality claim; the evaluation protocol's 5 seeds x 50 episodes is another bench's job).

Both processes need a core each to overlap: on a machine shared with other sessions the
overlap shrinks (Linux autogroup scheduling gives a session one share of the CPU, see
bench/env_workers.py).

    OMP_NUM_THREADS=1 python -m bench.async_collect --algos sac --env HalfCheetah-v5 --steps 3000 --repeats 3
    OMP_NUM_THREADS=1 python -m bench.async_collect --algos sac-diffusion --env PointReach-v0 --repeats 3

The diffusion algorithms run their own defaults (64 envs x 30 chunk steps per iteration, 64 gradient
steps after each, a 20-step chain for sac-diffusion) for ``--iterations`` iterations after a warm-up
of one iteration; their rate is env steps / wall-clock between the first and the last iteration's
metrics lines (their lines carry no collect_s / update_s), and ``--async-steps`` does not apply (an
item is one rollout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from rlfunc.algos.sac import SACConfig
from rlfunc.algos.sac_diffusion import SACDiffusionConfig
from rlfunc.algos.td3 import TD3Config
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig
from rlfunc.config import replace
from rlfunc.run import train

CONFIGS = {"sac": (SACConfig, train), "td3": (TD3Config, train)}
DIFFUSION = {"sac-diffusion": SACDiffusionConfig, "td3-diffusion": TD3DiffusionConfig}


def _diffusion_rate(run_dir: Path) -> tuple[float, float, float]:
    """(env steps/s between the first and the last metrics line, mean env_wait_s share, mean policy_lag)."""
    every = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = every[-1]["time"] - every[0]["time"]
    share = sum(r.get("env_wait_s", 0.0) for r in every[1:]) / seconds
    return (every[-1]["step"] - every[0]["step"]) / seconds, share, statistics.fmean(r.get("policy_lag", 0.0) for r in every[1:])


def _diffusion_config(algo: str, env: str, iterations: int, compile_mode: str, asynchronous: bool):
    base = DIFFUSION[algo]()
    per_iteration = base.num_envs * base.num_steps * base.actor.act_steps
    return replace(base, env=env, warmup_steps=per_iteration, total_steps=per_iteration * (iterations + 1), checkpoint_every=0,
                   eval_episodes=10, compile=compile_mode, torch_threads=1, async_collection=asynchronous)


def _rate(run_dir: Path) -> tuple[float, float, float]:
    """(env steps/s, mean collect_s share, mean policy_lag) over the iterations after the first."""
    every = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = every[1:]
    steps = every[-1]["step"] - every[0]["step"]
    seconds = sum(r["collect_s"] + r["update_s"] for r in lines)
    share = statistics.fmean(r["collect_s"] / (r["collect_s"] + r["update_s"]) for r in lines)
    return steps / seconds, share, statistics.fmean(r.get("policy_lag", 0.0) for r in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algos", nargs="+", default=["sac"], choices=sorted(CONFIGS) + sorted(DIFFUSION))
    parser.add_argument("--env", default="Pendulum-v1")
    parser.add_argument("--num-envs", type=int, default=1)
    parser.add_argument("--num-steps", type=int, default=250, help="vector-env steps per iteration")
    parser.add_argument("--steps", type=int, default=2000, help="env steps after learning starts")
    parser.add_argument("--learning-starts", type=int, default=250)
    parser.add_argument("--compile", default="off", choices=["off", "auto", "on"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=6, help="diffusion algorithms: iterations after the warm-up one")
    parser.add_argument("--async-steps", type=int, nargs="+", default=[1], help="vector-env steps per collector item (one async row each)")
    args = parser.parse_args()
    rows: dict[tuple[str, bool], list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for algo in args.algos:
                if algo in DIFFUSION:
                    for mode in (0, 1):
                        config = _diffusion_config(algo, args.env, args.iterations, args.compile, mode > 0)
                        run_dir = Path(tmp) / f"{algo}_{mode}_{repeat}"
                        result = train(config, run_dir, progress=False, tensorboard=False)
                        rate, share, lag = _diffusion_rate(run_dir)
                        score = result.evaluation.get("success_rate", result.evaluation.get("episode_return"))
                        rows.setdefault((algo, mode), []).append((rate, share, lag, score))
                        print(f"repeat {repeat} {algo} {'async' if mode else 'in process'}: {rate:.1f} env steps/s, wait share "
                              f"{share:.1%}, policy lag {lag:.2f}, score {score:.3f}", flush=True)
                    continue
                cls = CONFIGS[algo][0]
                for mode in (0, *args.async_steps):  # 0: in process
                    config = replace(cls(), env=args.env, num_envs=args.num_envs, num_steps=args.num_steps,
                                     learning_starts=args.learning_starts, total_steps=args.learning_starts + args.steps,
                                     checkpoint_every=0, eval_episodes=10, compile=args.compile, torch_threads=1,
                                     async_collection=mode > 0, async_steps=max(mode, 1))
                    run_dir = Path(tmp) / f"{algo}_{mode}_{repeat}"
                    result = train(config, run_dir, progress=False, tensorboard=False)
                    rate, share, lag = _rate(run_dir)
                    rows.setdefault((algo, mode), []).append((rate, share, lag, result.evaluation["mean"]))
                    print(f"repeat {repeat} {algo} async_steps={mode or '-'}: {rate:.1f} env steps/s, collect share {share:.1%}, "
                          f"policy lag {lag:.2f}, return {result.evaluation['mean']:.1f}", flush=True)
    print(f"\n{args.env}, {args.num_envs} env(s) (sac, td3; the diffusion algorithms: their defaults), compile {args.compile}, {args.repeats} repeats (medians)")
    print("| algo | mode | env steps/s | collect share | policy lag (publishes) | ratio async / sync |")
    print("|---|---|---:|---:|---:|---:|")
    for algo in args.algos:
        sync = statistics.median(r[0] for r in rows[(algo, 0)])
        for mode in ((0, 1) if algo in DIFFUSION else (0, *args.async_steps)):
            runs = rows[(algo, mode)]
            rate = statistics.median(r[0] for r in runs)
            print(f"| {algo} | {('async, a rollout per item' if algo in DIFFUSION else f'async, {mode} step(s) per item') if mode else 'in process'} | {rate:.1f} | {statistics.median(r[1] for r in runs):.1%} | "
                  f"{statistics.median(r[2] for r in runs):.2f} | {rate / sync:.2f} |")


if __name__ == "__main__":
    main()

"""Does the run machinery cost speed? The wall-clock of one iteration of PPO (Pendulum-v1 and
HalfCheetah-v5 presets: env steps/s is the iteration's steps over it) and of DPPO (PointReach-v0),
measured on two source trees in the same run, interleaved.

Each measurement is a fresh subprocess with PYTHONPATH set to one tree (BEFORE: e.g. a git worktree
of the commit before a refactor; AFTER: this checkout) running a few iterations of the public
training function; the figure is the median over iterations 2.. of the wall-clock between
consecutive metrics.jsonl lines: collection, update, and the loop's own work (metrics, snapshots,
versions: PPO's preset writes a version every iteration and a snapshot every 10). Trees alternate
A B, B A, ... for --repeats rounds; the result is the median over rounds of before / after (> 1:
faster after). The issue-15 target: every ratio within 5% (>= 0.95).

    git worktree add /tmp/before 5ceac0f
    python -m bench.architecture_speed --before /tmp/before --after . --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = {
    # name: (python snippet run in the tree, metric key, higher_is_better)
    "ppo Pendulum-v1 iteration s": ("""
from rlfunc.algos.ppo import preset
try:
    from rlfunc.run.ppo import train
except ImportError:
    try:  # a tree from before the layered layout
        from rlfunc.train import train
    except ImportError:  # a tree with the one entry point of every algorithm
        from rlfunc.run import train
train(preset("Pendulum-v1", total_steps=16 * 256 * {its}, device="cpu", version_every=1), RUN, progress=False, tensorboard=False)
""", "iteration_s", False),
    "ppo HalfCheetah-v5 iteration s": ("""
from rlfunc.algos.ppo import preset
try:
    from rlfunc.run.ppo import train
except ImportError:
    try:  # a tree from before the layered layout
        from rlfunc.train import train
    except ImportError:  # a tree with the one entry point of every algorithm
        from rlfunc.run import train
train(preset("HalfCheetah-v5", total_steps=16 * 128 * {its}, device="cpu", version_every=1), RUN, progress=False, tensorboard=False)
""", "iteration_s", False),
    # the update alone (the metrics line's update_s) of the CartPole-v1 preset: 10 eager gradient steps of one
    # 256-sample minibatch per 256 env steps, where the step's per-op overhead is the run (issue 17's CartPole)
    "ppo CartPole-v1 update s": ("""
from rlfunc.algos.ppo import preset
from rlfunc.run import train
train(preset("CartPole-v1", total_steps=8 * 32 * {its}, device="cpu", version_every=0), RUN, progress=False, tensorboard=False, evaluate=False)
""", "update_s", False),
    # the update alone of 4 seeds as a batch (stacked params; Adam's step counts one per seed since the
    # per-member counts): the per-step check whether the seeds' counts still agree is what it adds
    "ppo Pendulum-v1 4 seeds update s": ("""
from rlfunc.algos.ppo import preset
from rlfunc.run import train
train(preset("Pendulum-v1", num_seeds=4, total_steps=16 * 256 * {its}, device="cpu", version_every=0), RUN, progress=False,
      tensorboard=False, evaluate=False)
""", "update_s", False),
    # the same under target_kl: once the seeds stop apart their Adam counts differ, and every later step goes
    # through the per-seed path; per gradient step (update_s / the most steps a seed took: the two trees'
    # seeds stop at other steps once their counts differ, so their iterations take other numbers of steps)
    "ppo Pendulum-v1 4 seeds target_kl s per step": ("""
from rlfunc.algos.ppo import preset
from rlfunc.run import train
train(preset("Pendulum-v1", num_seeds=4, target_kl=1e-3, total_steps=16 * 256 * {its}, device="cpu", version_every=0), RUN,
      progress=False, tensorboard=False, evaluate=False)
""", "update_s_per_step", False),
    "dppo PointReach-v0 iteration s": ("""
from rlfunc.algos.dppo import DPPOConfig
try:
    from rlfunc.run.diffusion import train_dppo
except ImportError:
    try:
        from rlfunc.train_diffusion import train_dppo
    except ImportError:  # a tree with the one entry point of every algorithm
        from rlfunc.run import train as train_dppo
try:  # a tree with RunConfig (config.run)
    from rlfunc.config import replace
    config = replace(DPPOConfig(env="PointReach-v0", total_steps=128 * 8 * 4 * {its}), eval_episodes=16, device="cpu")
except ImportError:
    config = DPPOConfig(env="PointReach-v0", total_steps=128 * 8 * 4 * {its}, eval_episodes=16, device="cpu")
train_dppo(config, RUN, progress=False, tensorboard=False)
""", "iteration_s", False),
}


def measure(tree: Path, snippet: str, key: str, iterations: int) -> float:
    """Median of ``key`` over iterations 2.. of one run of ``snippet`` in ``tree``."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        code = f"RUN = {str(run)!r}\n" + snippet.format(its=iterations)
        env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        if key == "iteration_s":  # wall-clock between consecutive lines: the collection and the update
            times = [r["time"] for r in records]
            values = [b - a for a, b in zip(times, times[1:])]
        elif key == "update_s_per_step":  # several seeds: the most gradient steps any seed took
            values = [r["update_s"] / max(r["updates"]) for r in records if "update_s" in r][1:]
        else:
            values = [r[key] for r in records if key in r][1:]
        return statistics.median(values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, default=Path("."))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--cases", nargs="*", default=list(CASES))
    a = p.parse_args()
    print(f"before={a.before} after={a.after} repeats={a.repeats} iterations={a.iterations}")
    for name in a.cases:
        snippet, key, higher = CASES[name]
        ratios, pairs = [], []
        for r in range(a.repeats):
            order = (a.before, a.after) if r % 2 == 0 else (a.after, a.before)
            got = {tree: measure(tree, snippet, key, a.iterations) for tree in order}
            b, f = got[a.before], got[a.after]
            pairs.append((b, f))
            ratios.append(f / b if higher else b / f)
        print(f"{name}: before/after per round {[(round(b, 4), round(f, 4)) for b, f in pairs]}; "
              f"ratio (>1: after faster) median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}",
              flush=True)


if __name__ == "__main__":
    main()

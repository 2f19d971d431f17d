"""Seeds as a batch: wall-clock of --num-seeds N vs --num-seeds 1 for the same env steps per seed.

    python -m bench.seeds [--env Pendulum-v1] [--steps 40960] [--num-seeds 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rlfunc.algos.ppo import preset
from rlfunc.run import train


def timed(env: str, steps: int, num_seeds: int, vmap: str) -> float:
    run_dir = Path(tempfile.mkdtemp()) / "run"
    t = time.perf_counter()
    train(preset(env, total_steps=steps, num_seeds=num_seeds, vmap=vmap, device="cpu", checkpoint_every=0),
          run_dir, progress=False, tensorboard=False, evaluate=False)
    elapsed = time.perf_counter() - t
    shutil.rmtree(run_dir.parent)
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="Pendulum-v1")
    p.add_argument("--steps", type=int, default=40_960)
    p.add_argument("--num-seeds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    cases = [(1, "auto"), (a.num_seeds, "vmap"), (a.num_seeds, "loop")]
    times = {c: [] for c in cases}
    for _ in range(a.repeats):  # interleaved
        for c in cases:
            times[c].append(timed(a.env, a.steps, *c))
    base = statistics.median(times[cases[0]])
    print(f"env={a.env} steps per seed={a.steps} repeats={a.repeats}")
    print(f"{'num_seeds':>9} {'path':>5} {'median s':>9} {'ratio to 1 seed':>15}")
    for (n, path), ts in times.items():
        m = statistics.median(ts)
        print(f"{n:>9} {path:>5} {m:>9.1f} {m / base:>15.2f}")


if __name__ == "__main__":
    main()

"""Does data parallelism pay on this machine? HalfCheetah-v5 ppo (its preset), W ranks x 1 thread
(torchrun, gloo) against 1 rank x 1 thread, the same config and so the same total env steps:
end-to-end env steps/s of the whole job (the median over iterations 2.. of metrics.jsonl's
steps_per_s, which covers all ranks' envs) and the share of an iteration spent in collectives
(allreduce_s / (collect_s + update_s), rank 0's). The two runs are the same run up to float rounding
(tests/run/test_data_parallel_run.py), so their returns at equal steps agree in distribution by
construction; the bench also reports both final training returns.

Rounds alternate 1-rank and W-rank runs (A B, B A, ...); the ratio is the median over rounds.

    python -m bench.scaling --iterations 8 --repeats 3 --nproc 2
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


def run(nproc: int, env: str, iterations: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        steps = 16 * 128 * iterations  # the HalfCheetah preset's batch
        cmd = [sys.executable, "-m", "rlfunc", "train", "ppo", "--env", env, "--total-steps", str(steps), "--device", "cpu",
               "--torch-threads", "1", "--version-every", "0", "--checkpoint-every", "0", "--eval-episodes", "1",
               "--nproc", str(nproc), "--run-dir", str(run_dir), *extra]
        environ = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=environ)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    share = [line.get("allreduce_s", 0.0) / (line["collect_s"] + line["update_s"]) for line in lines]
    return {"steps_per_s": statistics.median(line["steps_per_s"] for line in lines),
            "comm_share": statistics.median(share), "final_return": float(lines[-1].get("episode_return") or "nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", nargs="*", default=[], help="extra flags for rlfunc train ppo, e.g. --set=--num-envs=32")
    a = p.parse_args()
    rounds = []
    for r in range(a.repeats):
        order = (1, a.nproc) if r % 2 == 0 else (a.nproc, 1)
        got = {n: run(n, a.env, a.iterations, a.set) for n in order}
        rounds.append(got)
        print(f"round {r}: 1 rank {got[1]['steps_per_s']:.0f} steps/s, {a.nproc} ranks {got[a.nproc]['steps_per_s']:.0f} "
              f"steps/s (ratio {got[a.nproc]['steps_per_s'] / got[1]['steps_per_s']:.2f}; collectives "
              f"{100 * got[a.nproc]['comm_share']:.1f}% of an iteration); final training return "
              f"{got[1]['final_return']:.1f} / {got[a.nproc]['final_return']:.1f}", flush=True)
    ratios = [g[a.nproc]["steps_per_s"] / g[1]["steps_per_s"] for g in rounds]
    print(f"{a.env}: {a.nproc} ranks / 1 rank env steps/s, median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}) over {a.repeats} rounds; collectives "
          f"{100 * statistics.median(g[a.nproc]['comm_share'] for g in rounds):.1f}% of an iteration (median)")


if __name__ == "__main__":
    main()

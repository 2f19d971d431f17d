"""Does a PPO preset's final policy hold up, at its default budget and at 2x and 4x of it?

Each (seed, budget) is its own run, as ``rlfunc train ppo --env ENV --seed S --total-steps N`` makes
it (versions off: they do not change the numbers). Snapshots every --eval-every env steps are
evaluated on --episodes deterministic episodes (the reset seeds ``rlfunc eval`` uses), so every run
keeps its learning curve; the last is the final policy. Reports each final policy's mean return with
its 95% CI, the worst seed, the median / IQM over seeds with stratified-bootstrap CIs (rliable),
and the drop from each run's best evaluation to its final one. Evaluation is not timed.

    python -m bench.preset_budgets --env Pendulum-v1 --seeds 0 1 2 3 4 --multiples 1 2 4 --episodes 100 \\
        --target -175 --figure bench/figures/pendulum_budgets.png
    python -m bench.preset_budgets ... --set anneal_lr=True lr=1e-3     # a preset variant
    python -m bench.preset_budgets --merge A.json B.json --target -175  # report split runs together
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from bench.halfcheetah_gsde import parse_overrides
from bench.protocol import aggregate, fmt_aggregate, plot_curves
from rlfunc.algos.ppo import preset
from rlfunc.run.log import read_metrics
from rlfunc.run import train
from rlfunc.run.ppo import evaluate


def run(env: str, seed: int, multiple: float, episodes: int, eval_every: int, out: Path, overrides: dict) -> dict:
    """One run of the preset at ``multiple`` x its budget; its curve and final evaluation."""
    base = preset(env, **overrides)
    total = int(base.total_steps * multiple)
    every = max(1, round(eval_every / base.batch_size))
    config = preset(env, seed=seed, total_steps=total, device="cpu", version_every=0, keep_checkpoints=0,
                    checkpoint_every=every, **overrides)
    run_dir = out / f"{env}-s{seed}-x{multiple:g}-{abs(hash(str(sorted(overrides.items())))) % 10**8}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t = time.perf_counter()
    train(config, run_dir, progress=False, tensorboard=False, evaluate=False)
    wall = time.perf_counter() - t
    times = {r["step"]: r["time"] for r in read_metrics(run_dir / "metrics.jsonl")}
    curve = []
    for snap in sorted((run_dir / "checkpoints").glob("step_*")):
        result = evaluate(run_dir, episodes, device="cpu", snapshot=snap)
        curve.append((result["env_steps"], times[result["env_steps"]], result["mean"]))
    return {"seed": seed, "multiple": multiple, "total_steps": total, "wall": wall, "curve": curve,
            "final": {k: result[k] for k in ("mean", "std", "episodes", "ci95")}}


def report(rows: list[dict], env: str, target: float | None, figure: str | None) -> None:
    print(f"env={env}; each row a separate run; final = the last snapshot on {rows[0]['final']['episodes']} episodes")
    print(f"{'multiple':>8} {'steps':>8} {'seed':>4} {'final [95% CI]':>24} {'best eval':>9} {'drop':>6} {'wall s':>7}")
    for multiple in sorted({r["multiple"] for r in rows}):
        group = sorted((r for r in rows if r["multiple"] == multiple), key=lambda r: r["seed"])
        for r in group:
            f, best = r["final"], max(c[2] for c in r["curve"])
            print(f"{multiple:>8g} {r['total_steps']:>8} {r['seed']:>4} {f['mean']:>8.1f} [{f['ci95'][0]:.1f}, {f['ci95'][1]:.1f}]"
                  f" {best:>9.1f} {best - f['mean']:>6.1f} {r['wall']:>7.1f}")
        finals = [r["final"]["mean"] for r in group]
        line = f"  x{multiple:g}: worst seed {min(finals):.1f}"
        if target is not None:
            line += f", seeds >= {target}: {sum(x >= target for x in finals)} of {len(finals)}"
        if len(finals) >= 2:
            line += f"; {fmt_aggregate(aggregate(finals))}"
        print(line)
    if figure:
        sides = {f"x{m:g} ({int(rows_m[0]['total_steps'])} steps)": [r["curve"] for r in rows_m]
                 for m in sorted({r["multiple"] for r in rows})
                 for rows_m in [[r for r in rows if r["multiple"] == m]]}
        plot_curves(sides, Path(figure), f"PPO preset on {env} at 1x/2x/4x its budget: mean and 95% CI over seeds, "
                                         f"{rows[0]['final']['episodes']} episodes per evaluation", target)
        print(f"figure: {figure}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="Pendulum-v1")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--multiples", type=float, nargs="+", default=[1, 2, 4])
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20_480, help="env steps between evaluated snapshots")
    p.add_argument("--target", type=float, default=None, help="the return every final policy should reach")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the preset")
    p.add_argument("--out", default="bench/out")
    p.add_argument("--json", default=None, help="write the rows here (default: OUT/preset_budgets-ENV.json)")
    p.add_argument("--figure", default=None)
    p.add_argument("--merge", nargs="+", metavar="JSON", help="only report these result files together")
    a = p.parse_args()
    if a.merge:
        rows = [r for path in a.merge for r in json.loads(Path(path).read_text())]
        return report(rows, a.env, a.target, a.figure)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(a.json or out / f"preset_budgets-{a.env}.json")
    rows = []
    for multiple in a.multiples:
        for seed in a.seeds:
            rows.append(run(a.env, seed, multiple, a.episodes, a.eval_every, out, parse_overrides(a.set)))
            path.write_text(json.dumps(rows, indent=1))
    report(rows, a.env, a.target, a.figure)


if __name__ == "__main__":
    main()

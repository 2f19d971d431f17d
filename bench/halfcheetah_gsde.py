"""HalfCheetah-v5: our PPO preset with overrides (e.g. gSDE), one seed per process, then an eval curve.

Train one seed (run three of these in parallel, one thread each) and evaluate every saved snapshot
afterwards with deterministic actions (evaluation time excluded from the training clock; a run that
is still training is evaluated on the snapshots it has so far):

    OMP_NUM_THREADS=1 nice -n 10 python -m bench.halfcheetah_gsde train --seed 0 --tag gsde \
        --set exploration=gsde init_log_std=-2 sde_sample_freq=4
    python -m bench.halfcheetah_gsde eval --tag gsde --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import time
from pathlib import Path

import torch

from rlfunc.algos.ppo import preset
from rlfunc.run.log import read_metrics
from rlfunc.run import train
from rlfunc.run.ppo import evaluate

ENV = "HalfCheetah-v5"


def parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value  # a bare string, e.g. exploration=gsde
    return out


def run_dir(out: Path, tag: str, seed: int) -> Path:
    return out / f"hc-{tag}-s{seed}"


def cmd_train(a) -> None:
    overrides = parse_overrides(a.set)
    if a.steps is not None:
        overrides["total_steps"] = a.steps
    config = preset(ENV, seed=a.seed, device="cpu", **overrides)
    config = preset(ENV, seed=a.seed, device="cpu", keep_checkpoints=0,
                    checkpoint_every=max(1, a.eval_every // config.batch_size), **overrides)
    d = run_dir(Path(a.out), a.tag, a.seed)
    d.parent.mkdir(parents=True, exist_ok=True)
    d.with_name(d.name + ".overrides.json").write_text(json.dumps(overrides))  # train() wants an empty run dir
    t = time.perf_counter()
    train(config, d, progress=False, tensorboard=False, evaluate=False)
    (d / "wall.json").write_text(json.dumps({"wall": time.perf_counter() - t}))


def cmd_eval(a) -> None:
    finals = []
    for seed in a.seeds:
        d = run_dir(Path(a.out), a.tag, seed)
        times = {r["step"]: r["time"] for r in read_metrics(d / "metrics.jsonl")}
        wall = json.loads((d / "wall.json").read_text())["wall"] if (d / "wall.json").exists() else None
        cache_path = d / "eval_curve.json"
        cache = {int(k): v for k, v in json.loads(cache_path.read_text()).items()} if cache_path.exists() else {}
        for snap in sorted((d / "checkpoints").glob("step_*")):
            steps = int(snap.name.split("_")[-1]) if snap.name.split("_")[-1].isdigit() else None
            if steps is not None and steps in cache:
                continue
            result = evaluate(d, a.episodes, device="cpu", snapshot=snap)
            cache[result["env_steps"]] = [times.get(result["env_steps"]), result["mean"], result.get("std")]
            cache_path.write_text(json.dumps(cache))
        curve = sorted(cache.items())
        print(f"seed {seed} ({'wall %.0f s' % wall if wall else 'still training or cut short'}):")
        for steps, (secs, mean, std) in curve:
            print(f"  {steps:>8} steps  {secs if secs is None else round(secs)!s:>6} s  return {mean:8.1f}" + (f" +- {std:.0f}" if std is not None else ""))
        if curve:
            finals.append(curve[-1][1][1])
    if finals:
        print(f"median of last evals: {statistics.median(finals):.1f} ({', '.join(f'{f:.0f}' for f in finals)})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "eval"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tag", default="gsde")
    p.add_argument("--set", nargs="*", default=[], help="PPOConfig overrides key=value on top of the preset")
    p.add_argument("--steps", type=int, default=None, help="default: the preset's total_steps (1M)")
    p.add_argument("--eval-every", type=int, default=100_000)
    p.add_argument("--eval-episodes", dest="episodes", type=int, default=10)
    p.add_argument("--out", default="bench/out")
    a = p.parse_args()
    torch.set_num_threads(1)
    (cmd_train if a.mode == "train" else cmd_eval)(a)


if __name__ == "__main__":
    main()

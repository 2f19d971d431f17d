"""PointReach-v0 (two equally good goals): sac-diffusion (DACER) against Gaussian SAC at the same
env-step budget, per seed, each final policy on 1000 evaluation episodes: success rate (Wilson 95%
CI), the share of episodes that reached each goal (which modes the policy keeps), and training
wall-clock. sac-diffusion acts with its chain (eta = eval_eta, no entropy noise), SAC with tanh of
its mean; the episodes of both are PointReach's torch-batched env reset from the same seed.

    OMP_NUM_THREADS=1 python -m bench.sac_diffusion --seeds 0 1 2 3 4 --no-sac     # 120k env steps each
    OMP_NUM_THREADS=1 python -m bench.sac_diffusion --seeds 0 1 2 --sac-only --sac-steps 30000
    python -m bench.sac_diffusion --seeds 0 --steps 3000 --episodes 50 --sac-steps 600   # a smoke run
    OMP_NUM_THREADS=1 python -m bench.sac_diffusion --seeds 1 3 4 --no-sac --set target_entropy=-1.0   # a config change
    OMP_NUM_THREADS=1 python -m bench.sac_diffusion --seeds 1 3 4 --no-sac --bc-start   # from a bc run on expert demos

``--bc-start`` trains a bc run per seed first (the expert's demos with both goals, the actor spec of
sac-diffusion's default: horizon 1, 20 DDPM steps) and starts sac-diffusion from it (``init_from``);
its wall-clock is sac-diffusion's alone, the bc run's is reported apart.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from rlfunc.algos.bc import BCConfig
from rlfunc.algos.sac import preset as sac_preset
from rlfunc.algos.sac_diffusion import SACDiffusionConfig
from rlfunc.config import replace
from rlfunc.core.stats import success_interval
from rlfunc.run import train
from rlfunc.run.diffusion import EVAL_SEED_OFFSET

ENV = "PointReach-v0"


@torch.no_grad()
def _modes_of(act, episodes: int, seed: int) -> dict:
    """First-episode goal shares of ``act`` (observation [N, 6] -> env action [N, 2]) on ``episodes``
    torch PointReach envs reset from ``seed``."""
    from envs import point_reach as pr

    gen = torch.Generator().manual_seed(seed)
    state = pr.reset_state(episodes, gen)
    goal = torch.full((episodes,), -1, dtype=torch.int64)
    ended = torch.zeros(episodes, dtype=torch.bool)
    for _ in range(pr.MAX_STEPS):
        action, _ = act(pr.observation(state))
        state, _, terminated, _, index = pr.step_state(state, action)
        new = terminated.squeeze(-1) & ~ended
        goal[new] = index.squeeze(-1)[new]
        ended |= terminated.squeeze(-1)
    a, b = int((goal == 0).sum()), int((goal == 1).sum())
    return {"success_rate": (a + b) / episodes, "share_goal_a": a / episodes, "share_goal_b": b / episodes,
            "success_ci95": list(success_interval(a + b, episodes))}


def _value(text: str):
    """A --set value: JSON (numbers, true/false, null), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def run_bc(seed: int, out: Path) -> tuple[Path, float]:
    """A bc run on PointReach's expert demos with sac-diffusion's default actor spec: (run dir, wall s)."""
    spec = SACDiffusionConfig().actor
    config = replace(BCConfig(), env=ENV, actor=spec, seed=seed, device="cpu")
    t = time.perf_counter()
    train(config, out / f"bc-s{seed}", progress=False, tensorboard=False, evaluate=False)
    return out / f"bc-s{seed}", time.perf_counter() - t


def run_sac_diffusion(seed: int, steps: int, episodes: int, out: Path, overrides: dict | None = None,
                      bc_start: bool = False) -> dict:
    overrides = dict(overrides or {})
    extra = {}
    if bc_start:
        bc_dir, extra["bc_wall_s"] = run_bc(seed, out)
        overrides["init_from"] = str(bc_dir)
    config = replace(SACDiffusionConfig(), total_steps=steps, seed=seed, eval_episodes=episodes, device="cpu", **overrides)
    t = time.perf_counter()
    result = train(config, out / f"sac-diffusion-s{seed}", progress=False, tensorboard=False)
    wall = time.perf_counter() - t
    e = result.evaluation
    return {"algo": "sac-diffusion", "seed": seed, "env_steps": steps, "wall_s": wall, "episodes": episodes,
            "success_rate": e["success_rate"], "success_ci95": [e["success_ci95_low"], e["success_ci95_high"]],
            "share_goal_a": e["share_goal_a"], "share_goal_b": e["share_goal_b"], "alpha": float(result.state["params", "log_alpha"].detach().exp()),
            "entropy": float(result.state["entropy"]), **({"overrides": overrides} if overrides else {}), **extra}


def run_sac(seed: int, steps: int, episodes: int, out: Path) -> dict:
    from rlfunc.algos.ppo import EnvSpec
    from rlfunc.algos.sac import make_sac

    config = sac_preset(ENV, total_steps=steps, seed=seed, eval_episodes=min(episodes, 100), device="cpu")
    t = time.perf_counter()
    result = train(config, out / f"sac-s{seed}", progress=False, tensorboard=False)
    wall = time.perf_counter() - t
    algo = make_sac(config, EnvSpec(6, 2, [-1.0, -1.0], [1.0, 1.0]), torch.device("cpu"))
    modes = _modes_of(algo.policy(result.state, None, deterministic=True), episodes, seed + EVAL_SEED_OFFSET)
    return {"algo": "sac", "seed": seed, "env_steps": steps, "wall_s": wall, "episodes": episodes, **modes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=SACDiffusionConfig().total_steps, help="env steps of sac-diffusion (default: its 120k)")
    parser.add_argument("--sac-steps", type=int, default=None, help="env steps of Gaussian SAC (default: --steps)")
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--no-sac", action="store_true", help="sac-diffusion only")
    parser.add_argument("--sac-only", action="store_true", help="Gaussian SAC only")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a sac-diffusion config field (repeatable), e.g. target_entropy=-1.0")
    parser.add_argument("--bc-start", action="store_true", help="start sac-diffusion from a bc run on the expert's demos")
    parser.add_argument("--out", default="bench/out/sac_diffusion")
    args = parser.parse_args()
    overrides = {}
    for item in args.set:
        if "=" not in item:
            parser.error(f"--set {item!r}: expected FIELD=VALUE")
        key, value = item.split("=", 1)
        overrides[key] = _value(value)
    torch.set_num_threads(1)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    rows = []
    for seed in args.seeds:
        if not args.sac_only:
            rows.append(run_sac_diffusion(seed, args.steps, args.episodes, out, overrides, args.bc_start))
            print(json.dumps(rows[-1]), flush=True)
        if not args.no_sac:
            rows.append(run_sac(seed, args.sac_steps or args.steps, args.episodes, out))
            print(json.dumps(rows[-1]), flush=True)
    for algo in ("sac-diffusion", "sac"):
        mine = [r for r in rows if r["algo"] == algo]
        if mine:
            print(json.dumps({"algo": algo, "seeds": len(mine),
                              "median_success": statistics.median(r["success_rate"] for r in mine),
                              "min_goal_share": min(min(r["share_goal_a"], r["share_goal_b"]) for r in mine),
                              "median_wall_s": statistics.median(r["wall_s"] for r in mine)}), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Shared-parameter multi-agent PPO / GRPO / GSPO on Warehouse-v0 (20 AGVs) vs the scripted baseline
(PIBT) and random; shared-parameter PPO on the public rware-tiny-2ag-v2 benchmark (learning curve).

Each learned run: ``rlfunc.run.train`` of a MAPPOConfig with the budget given (env steps of one 20-AGV
warehouse; training episodes of --episode-steps with BFS-progress shaping --shaping), then
``envs.warehouse.metrics.evaluate`` of the sampled policy on the default warehouse (default rewards,
200-step episodes, --eval-episodes warehouses per eval seed). The baselines run through the same
``evaluate`` on the same eval seeds. Rows are appended to bench/out/warehouse_marl.jsonl as they
finish (so pieces can run in separate processes); ``--summarize`` prints the table: median over the
seeds present per method.

    OMP_NUM_THREADS=1 python -m bench.warehouse_marl --losses ppo grpo gspo --seeds 0 1 2 --total-steps 40000
    OMP_NUM_THREADS=1 python -m bench.warehouse_marl --rware --rware-steps 200000
    python -m bench.warehouse_marl --summarize
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlfunc.config import replace

OUT = Path(__file__).parent / "out" / "warehouse_marl.jsonl"
EVAL_SEEDS = (1000, 1001, 1002)
KEYS = ("deliveries_per_100_steps", "conflicts_per_100_steps", "idle_fraction")


def _append(row: dict) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def learned(loss: str, seed: int, a) -> dict:
    from rlfunc.algos.mappo import MAPPOConfig
    from rlfunc.run import train

    config = replace(MAPPOConfig(),
        loss=loss, n_agents=20, seed=seed, device="cpu", total_steps=a.total_steps, num_envs=16,
        rollout_steps=50, episode_steps=a.episode_steps, shaping_scale=a.shaping, group_size=4,
        sequence_reward="agent", conflict_penalty=a.conflict_penalty, lr=1e-3, hidden=(128, 128), eval_episodes=a.eval_episodes, eval_seeds=EVAL_SEEDS,
    )
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        result = train(config, Path(d) / "run", progress=False, tensorboard=False)
        curve = [json.loads(x) for x in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
    m = result.evaluation["median"]
    method = f"{loss} {a.tag}" if a.tag else loss
    return {"kind": "warehouse", "method": method, "seed": seed, "total_steps": a.total_steps,
            "train_s": round(time.perf_counter() - t, 1), **{k: m[k] for k in KEYS},
            "curve": [(r["step"], round(r.get("deliveries_per_100_steps", 0.0), 2),
                       round(r.get("conflicts_per_100_steps", 0.0), 1)) for r in curve]}


def baselines(a) -> list[dict]:
    from envs.warehouse import WarehouseConfig
    from envs.warehouse.expert import expert_policy
    from envs.warehouse.metrics import evaluate, random_policy

    rows = []
    for name, make, episodes in (("pibt", lambda env: expert_policy(env, method="pibt"), 1),
                                 ("random masked", lambda env: random_policy(env, masked=True), a.eval_episodes)):
        for seed in EVAL_SEEDS:
            m = evaluate(make, WarehouseConfig(), seeds=(seed,), num_episodes=episodes)["median"]
            rows.append({"kind": "warehouse", "method": name, "seed": seed, **{k: m[k] for k in KEYS}})
    return rows


def rware_curve(a) -> dict:
    from rlfunc.algos.mappo import MAPPOConfig
    from rlfunc.run import train

    config = replace(MAPPOConfig(), env="rware-tiny-2ag-v2", loss="ppo", seed=0, device="cpu", total_steps=a.rware_steps,
                         num_envs=8, rollout_steps=100, hidden=(64, 64), lr=5e-4, entropy_coef=0.01,
                         eval_episodes=4, eval_seeds=(0,))
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        result = train(config, Path(d) / "run", progress=False, tensorboard=False)
        curve = [json.loads(x) for x in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
    points = [(r["step"], round(r["episode_return"], 3)) for r in curve if "episode_return" in r]
    return {"kind": "rware", "method": "ppo (shared params, local critic)", "env": config.env,
            "total_steps": a.rware_steps, "train_s": round(time.perf_counter() - t, 1),
            "eval_team_return": result.evaluation["median"]["team_return"], "curve": points}


def rware_random(episodes: int = 8) -> dict:
    from envs.rware_env import RwareEnv

    env = RwareEnv("rware-tiny-2ag-v2", episodes, seed=0)
    td = env.reset()
    g = torch.Generator().manual_seed(0)
    total = torch.zeros(episodes)
    for _ in range(500):
        td.set(("agents", "action"), torch.randint(0, 5, (episodes, env.n_agents), generator=g))
        stepped, td = env.step_and_maybe_reset(td)
        total += stepped["next", "agents", "reward"].sum((-2, -1))
    return {"kind": "rware", "method": "random", "env": "rware-tiny-2ag-v2", "eval_team_return": float(total.mean())}


def summarize() -> None:
    rows = [json.loads(x) for x in OUT.read_text().splitlines()]
    wh = [r for r in rows if r["kind"] == "warehouse"]
    print(f"Warehouse-v0, 20 AGVs, 200-step episodes, eval seeds {EVAL_SEEDS}; median over seeds")
    print(f"{'method':<16}{'seeds':>6}{'budget':>9}{'deliv/100':>11}{'conflicts/100':>15}{'idle':>7}  per-seed deliveries/100")
    for method in dict.fromkeys(r["method"] for r in wh):
        rs = [r for r in wh if r["method"] == method]
        med = {k: statistics.median(r[k] for r in rs) for k in KEYS}
        budget = rs[0].get("total_steps", "-")
        per = ", ".join(f"{r['deliveries_per_100_steps']:.1f}" for r in rs)
        print(f"{method:<16}{len(rs):>6}{budget!s:>9}{med['deliveries_per_100_steps']:>11.2f}"
              f"{med['conflicts_per_100_steps']:>15.1f}{med['idle_fraction']:>7.2f}  {per}")
    for r in rows:
        if r["kind"] == "rware":
            extra = f", budget {r['total_steps']} steps, {r['train_s']} s" if "total_steps" in r else ""
            print(f"rware-tiny-2ag-v2 {r['method']}: eval team return {r['eval_team_return']:.3f}{extra}")
            if "curve" in r:
                pts = r["curve"][:: max(1, len(r["curve"]) // 10)]
                print("  curve (step, mean team return of training episodes ending then):", pts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--losses", nargs="*", default=[])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--total-steps", type=int, default=40_000, help="env steps per learned run")
    p.add_argument("--episode-steps", type=int, default=100, help="training episode length")
    p.add_argument("--shaping", type=float, default=0.05, help="training reward per cell of BFS progress")
    p.add_argument("--conflict-penalty", type=float, default=0.1, help="training reward per blocked agent")
    p.add_argument("--tag", default="", help="suffix of the method name in the table (e.g. a budget)")
    p.add_argument("--eval-episodes", type=int, default=4)
    p.add_argument("--baselines", action="store_true")
    p.add_argument("--rware", action="store_true")
    p.add_argument("--rware-steps", type=int, default=200_000)
    p.add_argument("--summarize", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.baselines:
        for row in baselines(a):
            _append(row)
    for seed in a.seeds if a.losses else []:
        for loss in a.losses:
            _append(learned(loss, seed, a))
    if a.rware:
        _append(rware_random())
        _append(rware_curve(a))
    if a.summarize or not (a.losses or a.baselines or a.rware):
        summarize()


if __name__ == "__main__":
    main()

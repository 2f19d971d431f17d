"""PointReach-v0: a diffusion policy (bc, then dppo) against Gaussian PPO with the same env budget.

Both are evaluated on --episodes episodes (one per env, deterministic: DDIM eta = 0 / the Gaussian's
mean) with the env's mode statistics: success rate, and the share of episodes ending at goal a, at
goal b, and at neither. The target: the diffusion policy succeeds in >= 95% of episodes with each
goal taking >= 30%.

    python -m bench.point_reach --seeds 0 1 2 --bc-updates 3000 --dppo-steps 300000
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from rlfunc.algos import registry
from rlfunc.config import replace
from rlfunc.algos.bc import BCConfig
from rlfunc.algos.dppo import DPPOConfig
from rlfunc.algos.ppo import make_ppo, preset
from rlfunc.envs import collect
from rlfunc.run import checkpoint
from rlfunc.run import train
from rlfunc.run.ppo import _load_snapshot, _saved_state, env_spec


def ppo_mode_statistics(run_dir: Path, episodes: int, seed: int) -> dict:
    """Deterministic Gaussian-PPO episodes on the torch-batched PointReach env, with mode statistics."""
    from envs.point_reach import PointReachEnv, mode_statistics

    snap = checkpoint.latest_snapshot(run_dir)
    config = registry.config_from_meta(checkpoint.load_meta(snap), snap)
    venv = collect.make_vec_env(config.env, 1)
    spec = env_spec(venv)
    venv.close()
    algo = make_ppo(config, spec, torch.device("cpu"))
    state = algo.init()
    carry = collect.empty_carry(config.run.num_seeds * config.num_envs, spec.obs_dim)
    loaded = _load_snapshot(snap, _saved_state(state, carry), torch.device("cpu"))
    with torch.no_grad():
        state.update_(loaded["learner"])
    act = algo.policy(state, [], deterministic=True)

    def policy(td):
        td["action"] = act(td["observation"])[0].clamp(-1.0, 1.0)
        return td

    env = PointReachEnv(episodes, seed=seed + 1_000_003)
    with torch.no_grad():
        td = env.rollout(30, policy, break_when_any_done=False)
    done = td["next", "done"].squeeze(-1)
    first = done & (done.long().cumsum(-1) == 1)
    return mode_statistics(td["next", "goal_index"].squeeze(-1)[first], first[first])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--bc-updates", type=int, default=3000)
    p.add_argument("--dppo-steps", type=int, default=300_000)
    p.add_argument("--episodes", type=int, default=1000)
    p.add_argument("--out", default="bench/out/point_reach")
    p.add_argument("--skip-ppo", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    rows = []
    for seed in a.seeds:
        bc_dir, dppo_dir, ppo_dir = out / f"bc-s{seed}", out / f"dppo-s{seed}", out / f"ppo-s{seed}"
        for d in (bc_dir, dppo_dir, ppo_dir):
            shutil.rmtree(d, ignore_errors=True)
        t = time.perf_counter()
        bc = train(replace(BCConfig(), num_updates=a.bc_updates, seed=seed, eval_episodes=a.episodes, device="cpu"), bc_dir, progress=False)
        rows.append({"method": "diffusion bc", "seed": seed, "budget": f"{a.bc_updates} updates",
                     "wall_s": time.perf_counter() - t, **bc.evaluation})
        t = time.perf_counter()
        dppo = train(replace(DPPOConfig(), init_from=str(bc_dir), total_steps=a.dppo_steps, seed=seed,
                                     eval_episodes=a.episodes, device="cpu"), dppo_dir, progress=False)
        rows.append({"method": "diffusion bc + dppo", "seed": seed, "budget": f"+{a.dppo_steps} env steps",
                     "wall_s": time.perf_counter() - t, **dppo.evaluation})
        if not a.skip_ppo:
            t = time.perf_counter()
            train(preset("PointReach-v0", seed=seed, total_steps=a.dppo_steps, device="cpu"), ppo_dir, progress=False, evaluate=False)
            rows.append({"method": "gaussian ppo", "seed": seed, "budget": f"{a.dppo_steps} env steps",
                         "wall_s": time.perf_counter() - t, **ppo_mode_statistics(ppo_dir, a.episodes, seed)})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| method | seed | budget | success | goal a | goal b | neither | wall s |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['seed']} | {r['budget']} | {r['success_rate']:.3f} | {r['share_goal_a']:.3f} | "
              f"{r['share_goal_b']:.3f} | {r['share_neither']:.3f} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()

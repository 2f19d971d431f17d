"""PushState-v0 (or Push-v0): a diffusion policy (bc on the scripted expert's demos, then dppo)
against Gaussian PPO with the same env-step budget as dppo.

All are evaluated on --episodes episodes (deterministic: DDIM eta = 0 / the Gaussian's mean); the
success rate is the share of episodes whose block ends within 3 cm of the target. Issue 4's target:
the diffusion actor (bc + dppo) succeeds in >= 80% of 100 episodes on PushState-v0.

    python -m bench.push_diffusion --seeds 0 1 2 --demos 100 --bc-updates 2000 --dppo-steps 150000

dppo collects whole episodes (25 chunks of 4 actions = the 100-step time limit) from 64 envs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from rlfunc.config import replace
from rlfunc.algos.bc import BCConfig
from rlfunc.algos.diffusion_actor import ActorSpec
from rlfunc.algos.dppo import DPPOConfig
from rlfunc.algos.ppo import preset
from rlfunc.run import train
from rlfunc.run.ppo import evaluate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="PushState-v0")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--demos", type=int, default=100)
    p.add_argument("--demo-noise-std", type=float, default=0.1)
    p.add_argument("--bc-updates", type=int, default=2000)
    p.add_argument("--act-steps", type=int, default=4)
    p.add_argument("--dppo-steps", type=int, default=150_000)
    p.add_argument("--likelihood", default="chain", choices=["chain", "output-noise"])
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--out", default="bench/out/push_diffusion")
    p.add_argument("--skip-ppo", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    rows = []
    chunks = -(-100 // a.act_steps)  # whole episodes per dppo rollout
    for seed in a.seeds:
        bc_dir, dppo_dir, ppo_dir = out / f"bc-s{seed}", out / f"dppo-s{seed}", out / f"ppo-s{seed}"
        for d in (bc_dir, dppo_dir, ppo_dir):
            shutil.rmtree(d, ignore_errors=True)
        t = time.perf_counter()
        spec = ActorSpec(horizon=4, act_steps=a.act_steps)
        bc = train(replace(BCConfig(), env=a.env, actor=spec, num_demos=a.demos, demo_noise_std=a.demo_noise_std,
                               num_updates=a.bc_updates, seed=seed, eval_episodes=a.episodes, device="cpu"),
                      bc_dir, progress=False, tensorboard=False)
        rows.append({"method": "diffusion bc", "seed": seed, "budget": f"{a.demos} demos, {a.bc_updates} updates",
                     "wall_s": time.perf_counter() - t, **bc.evaluation})
        print(json.dumps(rows[-1]), flush=True)
        t = time.perf_counter()
        dppo = train(replace(DPPOConfig(), env=a.env, init_from=str(bc_dir), likelihood=a.likelihood, total_steps=a.dppo_steps,
                                     num_envs=64, num_steps=chunks, minibatch_size=64 * chunks // 5, seed=seed,
                                     eval_episodes=a.episodes, device="cpu"),
                          dppo_dir, progress=False, tensorboard=False)
        rows.append({"method": f"diffusion bc + dppo ({a.likelihood})", "seed": seed, "budget": f"+{a.dppo_steps} env steps",
                     "wall_s": time.perf_counter() - t, **dppo.evaluation})
        print(json.dumps(rows[-1]), flush=True)
        if not a.skip_ppo:
            t = time.perf_counter()
            train(preset(a.env, seed=seed, total_steps=a.dppo_steps, device="cpu"), ppo_dir, progress=False, tensorboard=False, evaluate=False)
            ev = evaluate(ppo_dir, a.episodes, device="cpu")
            rows.append({"method": "gaussian ppo", "seed": seed, "budget": f"{a.dppo_steps} env steps",
                         "wall_s": time.perf_counter() - t, "episode_return": ev["mean"], "success_rate": ev["success_rate"]})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| method | seed | budget | success | return | wall s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['seed']} | {r['budget']} | {r['success_rate']:.2f} | {r['episode_return']:.1f} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()

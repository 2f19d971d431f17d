"""SAC or TD3 on a gymnasium env: rlfunc vs stable-baselines3 with RL-Zoo settings, same script, per seed one
after the other, both final policies evaluated with deterministic actions on the very same episodes
(the reset seeds ``rlfunc.run.offpolicy.evaluate`` uses for that seed), so the per-seed difference is
paired. Reports per seed each side's mean return with its 95% CI and training seconds, the paired
difference, and the medians over seeds.

    python -m bench.sac_vs_sb3 --env Pendulum-v1 --seeds 0 1 2 3 4            # RL-Zoo: 20k steps, lr 1e-3
    python -m bench.sac_vs_sb3 --env Pendulum-v1 --seeds 0 --steps 300 --eval-episodes 2   # a smoke run
    python -m bench.sac_vs_sb3 --algo td3 --env HalfCheetah-v5 --seeds 0 --steps 100000 --eval-episodes 50
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from bench.halfcheetah_gsde import parse_overrides
from rlfunc.algos import sac, td3
from rlfunc.core.stats import summarize_returns
from rlfunc.envs import collect
from rlfunc.run import train
from rlfunc.run.offpolicy import EVAL_SEED_OFFSET, evaluate

# RL-Zoo (rl-baselines3-zoo, hyperparams/sac.yml); the rest SB3's SAC defaults (buffer 1e6,
# learning_starts 100, batch 256, tau 0.005, gamma 0.99, train_freq 1, gradient_steps 1, auto
# entropy coefficient, [256, 256]), which our preset also takes.
ZOO = {
    "Pendulum-v1": dict(n_timesteps=20_000, kwargs=dict(learning_rate=1e-3)),
    "HalfCheetah-v5": dict(n_timesteps=1_000_000, kwargs=dict(learning_starts=10_000)),
}
# RL-Zoo (hyperparams/td3.yml): normal action noise 0.1, [400, 300]; the rest SB3's TD3 defaults (lr 1e-3,
# batch 256, tau 0.005, policy delay 2, target noise 0.2 clipped at 0.5), which our preset also takes.
ZOO_TD3 = {
    "Pendulum-v1": dict(n_timesteps=20_000, kwargs=dict(gamma=0.98, buffer_size=200_000, learning_starts=10_000)),
    "HalfCheetah-v5": dict(n_timesteps=1_000_000, kwargs=dict(learning_starts=10_000)),
}
PRESET = {"sac": sac.preset, "td3": td3.preset}


def run_ours(algo: str, env: str, seed: int, steps: int, episodes: int, out: Path, **overrides) -> dict:
    run_dir = out / (f"ours-{env}-s{seed}" if algo == "sac" else f"ours-{algo}-{env}-s{seed}")
    shutil.rmtree(run_dir, ignore_errors=True)
    preset = PRESET[algo]
    base = preset(env)  # a tiny budget keeps whole iterations of at most its steps, and learns from half of it
    config = preset(env, total_steps=steps, seed=seed, eval_episodes=episodes, device="cpu",
                    num_steps=min(base.num_steps, steps), learning_starts=min(base.learning_starts, max(steps // 2, 1)), **overrides)
    t0 = time.perf_counter()
    train(config, run_dir, progress=False, tensorboard=False)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, **evaluate(run_dir, episodes, seed=seed, device="cpu")}


def run_sb3(algo: str, env: str, seed: int, steps: int, episodes: int) -> dict:
    import gymnasium as gym
    import numpy as np
    from stable_baselines3 import SAC, TD3
    from stable_baselines3.common.noise import NormalActionNoise

    kwargs = dict((ZOO if algo == "sac" else ZOO_TD3).get(env, {}).get("kwargs", {}))
    kwargs["learning_starts"] = min(kwargs.get("learning_starts", 100), max(steps // 2, 1))
    torch.manual_seed(seed)
    genv = gym.make(env)
    if algo == "td3":
        n = genv.action_space.shape[0]
        kwargs.update(action_noise=NormalActionNoise(np.zeros(n), 0.1 * np.ones(n)), policy_kwargs=dict(net_arch=[400, 300]))
    model = (SAC if algo == "sac" else TD3)("MlpPolicy", genv, seed=seed, device="cpu", verbose=0, **kwargs)
    t0 = time.perf_counter()
    model.learn(total_timesteps=steps)
    seconds = time.perf_counter() - t0

    def policy(obs: torch.Tensor):
        action, _ = model.predict(obs.numpy(), deterministic=True)
        return torch.as_tensor(action), None

    venv = collect.make_vec_env(env, episodes)
    try:
        returns, _ = collect.episode_outcomes(venv, policy, collect.env_seeds(seed + EVAL_SEED_OFFSET, episodes),
                                              device=torch.device("cpu"))
    finally:
        venv.close()
    return {"seconds": seconds, **summarize_returns(returns), "episodes": episodes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", choices=sorted(PRESET), default="sac")
    p.add_argument("--env", default="Pendulum-v1")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=None, help="env steps per side (default: RL-Zoo's n_timesteps)")
    p.add_argument("--eval-episodes", type=int, default=50)
    p.add_argument("--out", default="runs/bench-sac")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of our preset (python literals), e.g. hidden='(64, 64)'")
    p.add_argument("--no-sb3", action="store_true", help="ours only (screening a preset variant)")
    a = p.parse_args()
    overrides = parse_overrides(a.set)
    torch.set_num_threads(1)
    steps = a.steps or (ZOO if a.algo == "sac" else ZOO_TD3).get(a.env, {}).get("n_timesteps", 20_000)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{a.algo} on {a.env}, {steps} env steps, {a.eval_episodes} shared evaluation episodes per seed")
    print(f"{'seed':>4} {'ours mean [95% CI]':>32} {'s':>7} {'sb3 mean [95% CI]':>32} {'s':>7} {'ours-sb3':>9}")
    for seed in a.seeds:
        ours = run_ours(a.algo, a.env, seed, steps, a.eval_episodes, out, **overrides)
        if a.no_sb3:
            print(f"{seed:>4} ours {ours['mean']:9.1f} {ours['ci95']} {ours['seconds']:7.0f} s", flush=True)
            continue
        sb3 = run_sb3(a.algo, a.env, seed, steps, a.eval_episodes)
        rows.append({"seed": seed, "ours": ours, "sb3": sb3})
        (out / (f"sac_vs_sb3-{a.env}.json" if a.algo == "sac" else f"{a.algo}_vs_sb3-{a.env}.json")).write_text(json.dumps(rows, indent=1))
        ci = lambda r: f"{r['mean']:9.1f} [{r['ci95'][0]:8.1f}, {r['ci95'][1]:8.1f}]" if r["ci95"] else f"{r['mean']:9.1f}"  # noqa: E731
        print(f"{seed:>4} {ci(ours):>32} {ours['seconds']:7.0f} {ci(sb3):>32} {sb3['seconds']:7.0f} "
              f"{ours['mean'] - sb3['mean']:9.1f}", flush=True)
    for who in ("ours", "sb3") if rows else ():
        print(f"median final return {who}: {statistics.median(r[who]['mean'] for r in rows):.1f}, "
              f"median seconds {statistics.median(r[who]['seconds'] for r in rows):.0f}")


if __name__ == "__main__":
    main()

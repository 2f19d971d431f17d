"""PPO on a gymnasium env: rlfunc vs stable-baselines3 with RL-Zoo settings, same script, interleaved,
under the evaluation protocol of bench/protocol.py.

For each seed, both train; every --eval-every env steps each side's policy is evaluated with
deterministic actions on the same --eval-episodes episodes (the reset seeds ``rlfunc.run.ppo.evaluate``
uses for that seed; evaluation time is excluded from both clocks). Reports, per seed, the final
policy's return (mean and 95% CI over the episodes), the first evaluation >= --threshold ("first
touch") and the first one after which every later evaluation stays >= --threshold ("reach and
stay"), in env steps and training seconds; across seeds the median and IQM of the final returns
with stratified-bootstrap CIs (rliable), and the per-seed ratio of the reach-and-stay times. Learning
curves (mean and 95% CI band over seeds, against env steps and wall-clock) go to --figure.

    python -m bench.ppo_vs_sb3 --env Pendulum-v1 --seeds 0 1 2 3 4 --threshold -200 --figure bench/figures/pendulum_ppo_vs_sb3.png
    python -m bench.ppo_vs_sb3 --env HalfCheetah-v5 --seeds 0 1 2 --sb3-seeds 0 --eval-every 100000 --threshold 6941
    python -m bench.ppo_vs_sb3 --env Pusher-v5 --seeds 0 --ours-steps 200000 --sb3-steps 200000 --eval-every 50000 --threshold -40
    python -m bench.ppo_vs_sb3 --env Pusher-v5 --seeds 10 --sb3-seeds --set "hidden=(64, 64)" ...   # ours only, a preset variant
    python -m bench.ppo_vs_sb3 --env Pusher-v5 --seeds 0 --ours-seeds ...   # SB3 only (one side of a comparison split over processes)
    python -m bench.ppo_vs_sb3 --env Pusher-v5 --seeds 0 1 2 3 --sb3-seeds --ours-batched ...   # ours only, seeds as one batch
    python -m bench.ppo_vs_sb3 --env Pusher-v5 --merge OURS.json SB3.json   # report the two halves together
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from pathlib import Path

import torch

from bench.halfcheetah_gsde import parse_overrides
from bench.protocol import aggregate, fmt_aggregate, median_or_none, plot_curves, thresholds
from rlfunc.algos.ppo import preset
from rlfunc.core.stats import summarize_returns
from rlfunc.envs import collect
from rlfunc.run.log import read_metrics
from rlfunc.run import train
from rlfunc.run.ppo import EVAL_SEED_OFFSET, evaluate

# RL-Zoo (rl-baselines3-zoo, hyperparams/ppo.yml) settings.
ZOO = {
    "Pendulum-v1": dict(
        n_envs=4, n_timesteps=100_000, normalize=False,
        kwargs=dict(n_steps=1024, gae_lambda=0.95, gamma=0.9, n_epochs=10, ent_coef=0.0, learning_rate=1e-3,
                    clip_range=0.2, use_sde=True, sde_sample_freq=4),
    ),
    "HalfCheetah-v5": dict(
        n_envs=1, n_timesteps=1_000_000, normalize=True,
        kwargs=dict(batch_size=64, n_steps=512, gamma=0.98, learning_rate=2.0633e-05, ent_coef=0.000401762,
                    clip_range=0.1, n_epochs=20, gae_lambda=0.92, max_grad_norm=0.8, vf_coef=0.58096),
        policy_kwargs=dict(log_std_init=-2, ortho_init=False, activation_fn="relu", net_arch=dict(pi=[256, 256], vf=[256, 256])),
    ),
    # RL-Zoo has no Pusher entry: SB3's PPO defaults with VecNormalize (our PPO normalises too).
    "Pusher-v5": dict(
        n_envs=1, n_timesteps=1_000_000, normalize=True,
        kwargs=dict(n_steps=2048, batch_size=64, n_epochs=10, gamma=0.99, gae_lambda=0.95, learning_rate=3e-4,
                    clip_range=0.2, ent_coef=0.0),
    ),
    # lin_1e-3 / lin_0.2 in RL-Zoo: the learning rate and the clip range decay linearly to 0.
    "CartPole-v1": dict(
        n_envs=8, n_timesteps=100_000, normalize=False, linear=("learning_rate", "clip_range"),
        kwargs=dict(n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0,
                    learning_rate=1e-3, clip_range=0.2),
    ),
}


def run_ours(env: str, seeds: list[int], eval_every: int, episodes: int, out: Path, total_steps: int | None,
             **overrides) -> dict[int, dict]:
    """Our PPO on ``seeds`` (consecutive), trained as one batch (``num_seeds``, stacked parameters) when
    there are several, each seed evaluated on the same episodes as a run of that seed alone. Returns
    {seed: {"wall", "curve": [(env steps, train s, mean return)], and "batched": N for a batch of N}};
    a batch's wall-clock and times are the batch's, shared by every seed."""
    if seeds != list(range(seeds[0], seeds[0] + len(seeds))):
        raise SystemExit(f"--ours-batched needs consecutive seeds, got {seeds}")
    name = f"rlfunc-{env}-s{seeds[0]}" + (f"x{len(seeds)}" if len(seeds) > 1 else "")
    run_dir = out / (f"{name}-{abs(hash(str(overrides)))}" if overrides else name)
    shutil.rmtree(run_dir, ignore_errors=True)
    if total_steps is not None:
        overrides["total_steps"] = total_steps
    base = dict(seed=seeds[0], num_seeds=len(seeds), device="cpu", version_every=0, keep_checkpoints=0)
    config = preset(env, **base, **overrides)
    config = preset(env, **base, checkpoint_every=max(1, eval_every // config.batch_size), **overrides)
    t = time.perf_counter()
    train(config, run_dir, progress=False, tensorboard=False, evaluate=False)
    wall = time.perf_counter() - t
    times = {r["step"]: r["time"] for r in read_metrics(run_dir / "metrics.jsonl")}
    curves = {s: [] for s in seeds}
    for snap in sorted((run_dir / "checkpoints").glob("step_*")):
        result = evaluate(run_dir, episodes, device="cpu", snapshot=snap)
        for s, mean in zip(seeds, result["per_seed_mean"]):
            curves[s].append((result["env_steps"], times[result["env_steps"]], mean))
    final = result  # the last snapshot is the final policy
    cis = final.get("per_seed_ci95", [final["ci95"]])
    batched = {"batched": len(seeds)} if len(seeds) > 1 else {}
    return {s: {"wall": wall, "curve": curves[s], "final_ci95": ci, **batched} for s, ci in zip(seeds, cis)}


def run_sb3(env: str, seed: int, eval_every: int, episodes: int, total_steps: int | None, out: Path | None = None) -> dict:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    zoo = ZOO[env]
    venv = make_vec_env(env, n_envs=zoo["n_envs"], seed=seed)
    if zoo["normalize"]:
        venv = VecNormalize(venv, gamma=zoo["kwargs"]["gamma"])
    normalize = (lambda o: venv.normalize_obs(o)) if zoo["normalize"] else (lambda o: o)  # the current statistics
    policy_kwargs = dict(zoo.get("policy_kwargs", {}))
    if policy_kwargs.get("activation_fn") == "relu":
        policy_kwargs["activation_fn"] = torch.nn.ReLU
    kwargs = dict(zoo["kwargs"])
    for key in zoo.get("linear", ()):  # SB3 calls a schedule with the progress remaining, 1 -> 0
        kwargs[key] = (lambda start: lambda remaining: remaining * start)(kwargs[key])
    model = PPO("MlpPolicy", venv, seed=seed, device="cpu", verbose=0, policy_kwargs=policy_kwargs or None, **kwargs)

    class Clock(BaseCallback):
        def __init__(self):
            super().__init__()
            self.train_time, self.last, self.next_eval, self.curve = 0.0, time.perf_counter(), eval_every, []

        def _on_step(self) -> bool:
            if self.num_timesteps >= self.next_eval:
                self.train_time += time.perf_counter() - self.last
                self.next_eval += eval_every
                returns = same_episode_returns(env, seed, episodes, model, normalize)
                self.curve.append((self.num_timesteps, self.train_time, float(returns.mean())))
                self.last = time.perf_counter()
            return True

    clock = Clock()
    model.learn(total_timesteps=total_steps or zoo["n_timesteps"], callback=clock)
    clock.train_time += time.perf_counter() - clock.last
    wall = clock.train_time  # training only, as ours: the evaluations are left out
    if out is not None:  # the final policy and its normaliser, to evaluate again on other episodes later
        model.save(out / f"sb3-{env}-s{seed}.zip")
        if zoo["normalize"]:
            venv.save(str(out / f"sb3-{env}-s{seed}-vecnormalize.pkl"))
    final = same_episode_returns(env, seed, episodes, model, normalize)
    summary = summarize_returns(final)
    # the final policy ends the curve: an evaluation the callback made at the last step ran before
    # SB3's last update (it updates after each rollout), so the final one replaces it
    if clock.curve and clock.curve[-1][0] >= model.num_timesteps:
        clock.curve.pop()
    clock.curve.append((model.num_timesteps, clock.train_time, summary["mean"]))
    return {"wall": wall, "curve": clock.curve, "same_episodes": summary["mean"], "final_ci95": summary["ci95"]}


def same_episode_returns(env: str, seed: int, episodes: int, model, normalize) -> torch.Tensor:
    """[episodes] deterministic returns of an SB3 policy on the very episodes (reset seeds) that
    ``rlfunc.run.ppo.evaluate`` gives our run of the same seed, run by the same vectorised loop
    (``rlfunc.envs.collect.episode_outcomes``): a paired comparison, free of the episode-sampling noise
    between two evaluation sets (a Pusher policy's 50-episode means move by 1-3 between sets)."""

    def policy(obs: torch.Tensor):
        action, _ = model.predict(normalize(obs.numpy()), deterministic=True)
        return torch.as_tensor(action), None

    venv = collect.make_vec_env(env, episodes)
    try:
        returns, _ = collect.episode_outcomes(venv, policy, collect.env_seeds(seed + EVAL_SEED_OFFSET, episodes),
                                              device=torch.device("cpu"))
    finally:
        venv.close()
    return returns


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="Pendulum-v1", choices=sorted(ZOO))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threshold", type=float, default=-200.0)
    p.add_argument("--eval-every", type=int, default=10_240)
    p.add_argument("--eval-episodes", type=int, default=100, help="per evaluation and side (the protocol: >= 50)")
    p.add_argument("--figure", default=None, help="write the learning curves (PNG) here")
    p.add_argument("--ours-steps", type=int, default=None, help="default: the preset's total_steps")
    p.add_argument("--sb3-steps", type=int, default=None, help="default: RL-Zoo's n_timesteps")
    p.add_argument("--out", default="bench/out")
    p.add_argument("--sb3-seeds", type=int, nargs="*", default=None, help="default: --seeds; fewer saves time")
    p.add_argument("--ours-seeds", type=int, nargs="*", default=None,
                   help="default: --seeds; `--ours-seeds` alone runs SB3 only (to split one comparison over processes)")
    p.add_argument("--ours-batched", action="store_true",
                   help="train our seeds as one batch (num_seeds, stacked parameters) before SB3's; faster on few cores")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of our preset (python literals), e.g. hidden='(64, 64)' anneal_lr=False")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="only report: merge these result files (one row per seed)")
    a = p.parse_args()
    if a.merge:
        return report(merge(a.merge), a.env, a.threshold, a.eval_every, a.eval_episodes, a.figure)
    torch.set_num_threads(1)  # both sides: one intra-op thread (our trainer's default)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    ours_seeds = a.seeds if a.ours_seeds is None else a.ours_seeds
    batched = run_ours(a.env, ours_seeds, a.eval_every, a.eval_episodes, out, a.ours_steps,
                       **parse_overrides(a.set)) if a.ours_batched and ours_seeds else None
    for seed in a.seeds:  # interleaved per seed
        if batched is not None:
            ours = batched.get(seed)
        elif seed in ours_seeds:
            ours = run_ours(a.env, [seed], a.eval_every, a.eval_episodes, out, a.ours_steps, **parse_overrides(a.set))[seed]
        else:
            ours = None
        sb3_seeds = a.seeds if a.sb3_seeds is None else a.sb3_seeds
        sb3 = run_sb3(a.env, seed, a.eval_every, a.eval_episodes, a.sb3_steps, out) if seed in sb3_seeds else None
        rows.append({"seed": seed, "ours": ours, "sb3": sb3})
        (out / f"ppo_vs_sb3-{a.env}.json").write_text(json.dumps(rows, indent=1))
    report(rows, a.env, a.threshold, a.eval_every, a.eval_episodes, a.figure)


def report(rows: list[dict], env: str, threshold: float, eval_every: int, episodes: int, figure: str | None = None) -> None:
    """Print the per-seed table and the across-seed summary of ``rows`` (see the module docstring)."""
    print(f"env={env} threshold={threshold} eval every {eval_every} steps, {episodes} episodes per evaluation "
          "(the same reset seeds for both sides), torch threads=1")
    print(f"{'seed':>4} {'who':>5} {'final return [95% CI]':>26} {'first touch steps / s':>22} "
          f"{'reach+stay steps / s':>22} {'train wall s':>12}")
    finals, stays = {}, {}
    for who in ("ours", "sb3"):
        for row in rows:
            r = row[who]
            if r is None or not r["curve"]:
                continue
            t = thresholds(r["curve"], threshold)
            final = r["curve"][-1][2]
            finals.setdefault(who, {})[row["seed"]] = final
            stays.setdefault(who, {})[row["seed"]] = None if t["reach_and_stay"] is None else t["reach_and_stay"]["seconds"]
            ci = r.get("final_ci95")
            ci_text = f"{final:.1f} [{ci[0]:.1f}, {ci[1]:.1f}]" if ci else f"{final:.1f}"
            cell = {k: "never" if v is None else f"{v['steps']} / {v['seconds']:.1f}" for k, v in t.items()}
            if t["first_touch"] is not None and t["reach_and_stay"] is None:
                cell["reach_and_stay"] = "does not stay"
            batch = f"  (one batch of {r['batched']} seeds: times are the batch's)" if r.get("batched") else ""
            print(f"{row['seed']:>4} {who:>5} {ci_text:>26} {cell['first_touch']:>22} {cell['reach_and_stay']:>22} "
                  f"{r['wall']:>12.1f}{batch}")
    for who, per_seed in finals.items():
        if len(per_seed) >= 2:
            print(f"{who}: final return {fmt_aggregate(aggregate(list(per_seed.values())))}; "
                  f"reach-and-stay seconds, median over seeds: {median_or_none(list(stays[who].values()))}")
    batched = any(row[w] and row[w].get("batched") for row in rows for w in ("ours", "sb3"))
    common = sorted(set(stays.get("ours", {})) & set(stays.get("sb3", {})))
    if common and not batched:
        ratios = [math.inf if stays["ours"][s] is None else (0.0 if stays["sb3"][s] is None else stays["ours"][s] / stays["sb3"][s])
                  for s in common]  # SB3 never staying: 0 (ours better); ours never staying: inf
        print(f"reach-and-stay time ours/sb3 per seed {[round(x, 2) for x in ratios]}, median {statistics.median(ratios):.2f}")
    if "ours" in finals and "sb3" in finals:
        paired = sorted(set(finals["ours"]) & set(finals["sb3"]))
        diffs = [finals["ours"][s] - finals["sb3"][s] for s in paired]
        print(f"paired final returns (same {episodes} episodes per seed), ours - sb3 per seed {[round(d, 2) for d in diffs]}; "
              f"ours ahead on {sum(d > 0 for d in diffs)}, level on {sum(d == 0 for d in diffs)}, behind on {sum(d < 0 for d in diffs)} of {len(diffs)}")
    if figure:
        sides = {label: [row[who]["curve"] for row in rows if row[who]] for who, label in (("ours", "rlfunc"), ("sb3", "SB3 (RL-Zoo)"))}
        plot_curves({k: v for k, v in sides.items() if v}, Path(figure),
                    f"PPO on {env}: mean and 95% CI over seeds, {episodes} episodes per evaluation", threshold)
        print(f"figure: {figure}")


def merge(paths: list[str]) -> list[dict]:
    """Rows of several runs' JSON files (e.g. ours-only and SB3-only halves of one comparison), one per seed."""
    rows: dict[int, dict] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            merged = rows.setdefault(row["seed"], {"seed": row["seed"], "ours": None, "sb3": None})
            for who in ("ours", "sb3"):
                merged[who] = row[who] or merged[who]
    return [rows[s] for s in sorted(rows)]


if __name__ == "__main__":
    main()

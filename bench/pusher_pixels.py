"""Pusher-v5 from pixels: encoder PPO on PusherPixels-v5 (two 128x128 cameras + the 23-number state as
proprio, through the multimodal encoder) beside flat-observation PPO on Pusher-v5's state vector, at the
same env-step budget; and Push-v0 with images (two cameras, proprio, instruction): steps/s and success.

Both Pusher runs go through the library's own entry point (rlfunc.run.train, with an encoder-PPO and a
PPO config) into RUN_DIRs under --out; the learning curves (mean return of the episodes that
ended in each iteration) are read back from their metrics.jsonl and printed side by side, binned by env
steps, with steps/s and the final deterministic evaluation of each.

    python -m bench.pusher_pixels --steps 8192 --push-steps 2048
    python -m bench.pusher_pixels --only push      # just the Push-v0 part
    python -m bench.pusher_pixels --only pusher --no-state --device cuda --envs 16 --encoder default \
        --steps 65536 --bin 4096                     # the pixel curve on a GPU
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch

from rlfunc.config import replace
from rlfunc.algos.ppo import preset
from rlfunc.algos.ppo_encoder import PPOEncoderConfig
from rlfunc.run.log import read_metrics

# a CPU-sized encoder: two ResNet-GN stages of 16 and 32 channels, 64-wide tokens (the library default,
# widths 32 64 128 256 and d_model 128, took ~100 ms per sample forward+backward on this machine)
SMALL_ENCODER = dict(encoder_widths=(16, 32), encoder_blocks=(1, 1), encoder_d_model=64, hidden=(64,))


def pixel_config(env: str, steps: int, seed: int, device: str = "cpu", envs: int = 8,
                 encoder: str = "small") -> PPOEncoderConfig:
    """``encoder``: "small" (SMALL_ENCODER) or "default" (the library's PPOEncoderConfig widths)."""
    return replace(PPOEncoderConfig(),
        env=env, total_steps=steps, num_envs=envs, num_steps=64, num_epochs=2, minibatch_size=min(256, envs * 64),
        lr=3e-4, gamma=0.99, lmbda=0.95, seed=seed, device=device, torch_threads=2, checkpoint_every=0,
        eval_episodes=10, **(SMALL_ENCODER if encoder == "small" else {}),
    )


def _curve(run_dir: Path, bin_steps: int) -> dict[int, float]:
    """Mean episode return per bin of ``bin_steps`` env steps (bin = the step count at its end)."""
    sums: dict[int, list[float]] = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        ret = r.get("episode_return")
        if ret is None or not math.isfinite(float(ret)):
            continue
        b = int(math.ceil(r["step"] / bin_steps) * bin_steps)
        sums.setdefault(b, []).append(float(ret))
    return {b: sum(v) / len(v) for b, v in sorted(sums.items())}


def _speed(run_dir: Path) -> float:
    records = read_metrics(run_dir / "metrics.jsonl")
    return records[-1]["step"] / records[-1]["time"] if records else float("nan")


def run_pusher(out: Path, steps: int, seed: int, bin_steps: int, state: bool = True, **pixel_kw) -> dict:
    """``pixel_kw``: device, envs, encoder of :func:`pixel_config`; ``state=False`` skips the state run."""
    from rlfunc.run import train
    from rlfunc.run.ppo import evaluate

    results = {}
    t = time.perf_counter()
    pix = train(pixel_config("PusherPixels-v5", steps, seed, **pixel_kw), out / "pusher-pixels",
                            progress=False, tensorboard=False)
    results["pixels"] = {"eval": pix.evaluation, "wall_s": time.perf_counter() - t, "steps_per_s": _speed(out / "pusher-pixels"),
                         "curve": _curve(out / "pusher-pixels", bin_steps)}
    if not state:
        print(f"\nPusher-v5 from pixels, {steps} env steps, seed {seed}, {pixel_kw}: mean return of the episodes "
              f"ended per {bin_steps}-step bin")
        for b, v in results["pixels"]["curve"].items():
            print(f"{b:>10} | {v:>8.1f}")
        print(f"pixels: {results['pixels']['steps_per_s']:.1f} env steps/s (collect + update), final eval "
              f"(10 episodes, deterministic) {pix.evaluation['mean']:.1f}")
        return results
    t = time.perf_counter()
    state_cfg = preset("Pusher-v5", total_steps=steps, seed=seed, device="cpu", version_every=0, checkpoint_every=0)
    train(state_cfg, out / "pusher-state", progress=False, tensorboard=False, evaluate=False)
    results["state"] = {"eval": evaluate(out / "pusher-state", episodes=10, device="cpu"), "wall_s": time.perf_counter() - t,
                        "steps_per_s": _speed(out / "pusher-state"), "curve": _curve(out / "pusher-state", bin_steps)}
    print(f"\nPusher-v5, {steps} env steps, seed {seed}: mean return of the episodes ended per {bin_steps}-step bin")
    print(f"{'env steps':>10} | {'pixels (encoder PPO)':>20} | {'state (flat PPO)':>16}")
    for b in sorted(set(results["pixels"]["curve"]) | set(results["state"]["curve"])):
        p, s = results["pixels"]["curve"].get(b, float("nan")), results["state"]["curve"].get(b, float("nan"))
        print(f"{b:>10} | {p:>20.1f} | {s:>16.1f}")
    for name in ("pixels", "state"):
        r = results[name]
        print(f"{name}: {r['steps_per_s']:.1f} env steps/s (collect + update), final eval (10 episodes, deterministic) "
              f"{r['eval']['mean']:.1f}")
    print(f"speed ratio pixels / state: {results['pixels']['steps_per_s'] / results['state']['steps_per_s']:.4f}")
    return results


def run_push(out: Path, steps: int, seed: int, **pixel_kw) -> dict:
    from rlfunc.run import train

    cfg = replace(pixel_config("Push-v0", steps, seed, **pixel_kw), eval_episodes=20)
    t = time.perf_counter()
    res = train(cfg, out / "push-images", progress=False, tensorboard=False)
    records = read_metrics(out / "push-images" / "metrics.jsonl")
    out_dict = {
        "steps_per_s": _speed(out / "push-images"), "wall_s": time.perf_counter() - t, "eval": res.evaluation,
        "collect_s": sum(r["collect_s"] for r in records), "update_s": sum(r["update_s"] for r in records),
        "train_success_rate": [r.get("success_rate") for r in records],
    }
    print(f"\nPush-v0 (images + proprio + instruction), {steps} env steps, seed {seed}: "
          f"{out_dict['steps_per_s']:.1f} env steps/s (collect {out_dict['collect_s']:.0f} s, update {out_dict['update_s']:.0f} s); "
          f"final eval (20 episodes, deterministic): success_rate {res.evaluation['success_rate']:.2f}, mean return "
          f"{res.evaluation['mean']:.1f}")
    return out_dict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8192, help="env steps of each Pusher run")
    p.add_argument("--push-steps", type=int, default=2048, help="env steps of the Push-v0 run")
    p.add_argument("--bin", type=int, default=1024, help="env steps per learning-curve bin")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("pusher", "push", "all"), default="all")
    p.add_argument("--out", default="bench/out/pusher_pixels")
    p.add_argument("--device", default="cpu", help="of the pixel runs: cpu, cuda, npu or auto")
    p.add_argument("--envs", type=int, default=8, help="envs of the pixel runs (64 steps each per iteration)")
    p.add_argument("--encoder", choices=("small", "default"), default="small",
                   help="small: widths 16-32, d_model 64 (CPU-sized); default: the library's 32-64-128-256, 128")
    p.add_argument("--no-state", action="store_true", help="skip the state-vector Pusher run")
    a = p.parse_args()
    torch.set_num_threads(2)
    out = Path(a.out)
    results = {}
    kw = dict(device=a.device, envs=a.envs, encoder=a.encoder)
    for name, fn in (("pusher", lambda d: run_pusher(d, a.steps, a.seed, a.bin, state=not a.no_state, **kw)),
                     ("push", lambda d: run_push(d, a.push_steps, a.seed, **kw))):
        if a.only in (name, "all"):
            d = out / name
            shutil.rmtree(d, ignore_errors=True)
            results[name] = fn(d)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()

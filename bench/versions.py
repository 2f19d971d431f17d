"""Versioned training: what a version costs (time, bytes) and what the freeze mode saves and loses.

    python -m bench.versions [--storage-iterations 20] [--steps 102400] [--seeds 0 1 2]
                             [--thresholds 0.02 0.05] [--window 5]

Part 1, storage (Pendulum-v1 preset, one run, a version every iteration, nothing pruned): for each
version, the time of ``versions.save_version`` (content-addressed: one pack file of the tensors that changed,
plus the manifest) and, on the very same state, of ``checkpoint.save_snapshot`` (a full snapshot:
one safetensors file with every tensor + meta.json); bytes written by each (apparent size, and disk
usage in 512-byte blocks). The iteration's own time (collect + update) is the yardstick.
Repeated with the freeze mode on, where frozen layers dedupe.

Part 2, freeze mode: for each seed, the preset run without and with ``freeze_threshold`` (each
threshold), interleaved: final deterministic return (10 episodes), the mean training return of the
last 5 iterations, the summed update time (``update_s``), and the share of parameter updates skipped
(mean ``frozen_fraction``: frozen parameters / all parameters, per iteration).

Part 3, the update step alone: one PPO iteration's update (10 epochs x 8 minibatches on one
collected batch) timed with no leaf frozen, with the two hidden 64x64 weights frozen (91% of the
parameters) and with all six weight matrices frozen; interleaved repeats, medians. This is the most
a frozen spell can save per iteration, without part 2's run-to-run noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rlfunc.algos.ppo import preset
from rlfunc.run import checkpoint, versions
from rlfunc.run import train
from rlfunc.run.ppo import evaluate


def _disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_blocks * 512
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def storage(iterations: int, **overrides) -> dict:
    """One run with a version per iteration; each version timed against a full snapshot of the same state."""
    root = Path(tempfile.mkdtemp())
    run, scratch = root / "run", root / "scratch"
    rows = []
    real = versions.save_version

    def timed(run_dir, state, meta, **kw):
        blobs = run_dir / versions.VERSIONS_DIR / "packs"
        disk_before = _disk(blobs) if blobs.exists() else 0
        t0 = time.perf_counter()
        record = real(run_dir, state, meta, **kw)
        t1 = time.perf_counter()
        snap = checkpoint.save_snapshot(scratch / f"v{len(rows)}", state, meta)
        t2 = time.perf_counter()
        manifest = run_dir / versions.VERSIONS_DIR / "manifests" / f"{record['id']}.json"
        rows.append({
            "version_s": t1 - t0, "snapshot_s": t2 - t1,
            "version_bytes": record["written"]["bytes"] + manifest.stat().st_size,
            "version_disk": _disk(blobs) - disk_before + _disk(manifest),
            "snapshot_bytes": sum(p.stat().st_size for p in snap.iterdir()), "snapshot_disk": _disk(snap),
            "blobs": record["written"]["blobs"], "tensors": len(record["tensors"]),
        })
        shutil.rmtree(snap)
        return record

    versions.save_version = timed
    try:
        config = preset("Pendulum-v1", total_steps=iterations * 2048, device="cpu", checkpoint_every=0,
                        version_every=1, version_keep_last=0, **overrides)
        train(config, run, progress=False, tensorboard=False, evaluate=False)
    finally:
        versions.save_version = real
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    iteration_s = statistics.median(m["collect_s"] + m["update_s"] for m in metrics)
    shutil.rmtree(root)
    later = rows[1:]  # the first version writes every blob
    med = lambda key: statistics.median(r[key] for r in later)  # noqa: E731
    return {
        "iteration_ms": 1e3 * iteration_s,
        "version_ms": 1e3 * med("version_s"), "snapshot_ms": 1e3 * med("snapshot_s"),
        "version_kb": med("version_bytes") / 1024, "snapshot_kb": med("snapshot_bytes") / 1024,
        "version_disk_kb": med("version_disk") / 1024, "snapshot_disk_kb": med("snapshot_disk") / 1024,
        "blobs": med("blobs"), "tensors": rows[0]["tensors"],
        "total_version_kb": sum(r["version_bytes"] for r in rows) / 1024,
        "total_snapshot_kb": sum(r["snapshot_bytes"] for r in rows) / 1024,
    }


def freeze_run(seed: int, steps: int, threshold: float, window: int) -> dict:
    run = Path(tempfile.mkdtemp()) / "run"
    config = preset("Pendulum-v1", total_steps=steps, seed=seed, device="cpu", checkpoint_every=0, version_every=0,
                    freeze_threshold=threshold, freeze_window=window)
    t0 = time.perf_counter()
    train(config, run, progress=False, tensorboard=False, evaluate=False)
    wall = time.perf_counter() - t0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = evaluate(run, episodes=10, device="cpu")["mean"]
    shutil.rmtree(run.parent)
    return {
        "final_return": final,
        "train_return_last5": statistics.fmean(m["episode_return"] for m in metrics[-5:]),
        "update_s": sum(m["update_s"] for m in metrics),
        "wall_s": wall,
        "skipped": statistics.fmean(m.get("frozen_fraction", 0.0) for m in metrics),
    }


def update_step(repeats: int) -> dict[str, float]:
    import torch

    from rlfunc.algos.ppo import make_ppo
    from rlfunc.core import func
    from rlfunc.envs import collect
    from rlfunc.run.ppo import _generators, env_spec

    config = preset("Pendulum-v1", device="cpu")
    torch.set_num_threads(config.run.torch_threads)
    venv = collect.make_vec_env(config.env, config.num_envs)
    device = torch.device("cpu")
    algo = make_ppo(config, env_spec(venv), device)
    state = algo.init()
    carry = collect.reset(venv, collect.env_seeds(0, config.num_envs))
    batch, _ = collect.rollout(venv, algo.policy(state, _generators(state, device)), carry, config.num_steps, device=device)
    venv.close()
    batch = batch.reshape(1, config.num_envs, config.num_steps)
    names = [str(k) for k in sorted(state["params"].keys(include_nested=True, leaves_only=True), key=str)]
    leaves = func.leaves(state["params"])
    total = sum(p.numel() for p in leaves)
    cases = {
        "none": [],
        "hidden 64x64 weights": [i for i, n in enumerate(names) if "'2'" in n and "weight" in n],
        "all weights": [i for i, n in enumerate(names) if "weight" in n],
    }
    times = {c: [] for c in cases}
    for _ in range(repeats):
        for case, frozen in cases.items():
            t0 = time.perf_counter()  # the freeze mask is iteration's argument (it was requires_grad flags, b58fd30)
            state, _ = algo.iteration(state, batch, _generators(state, device), frozen=frozen)
            times[case].append(time.perf_counter() - t0)
    return {c: (statistics.median(ts), sum(leaves[i].numel() for i in cases[c]) / total) for c, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--storage-iterations", type=int, default=20)
    p.add_argument("--steps", type=int, default=102_400)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.02, 0.05])
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--skip-freeze", action="store_true")
    p.add_argument("--only-update-step", action="store_true")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    print(f"machine: {os.cpu_count()} cores visible, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    if a.only_update_step:
        r = update_step(a.repeats)
        base = r["none"][0]
        print(f"\n## one update (Pendulum-v1 preset batch, {a.repeats} interleaved repeats, medians)")
        print(f"{'frozen':<22} {'params frozen':>13} {'update ms':>10} {'vs none':>8}")
        for case, (t, share) in r.items():
            print(f"{case:<22} {share:>13.1%} {1e3 * t:>10.1f} {t / base:>8.2f}")
        return

    print(f"\n## storage per version (Pendulum-v1 preset, {a.storage_iterations} iterations, medians over versions 2..)")
    print(f"{'mode':<22} {'iter ms':>8} {'version ms':>10} {'snapshot ms':>11} {'new blobs':>9} {'version KiB':>11} "
          f"{'snapshot KiB':>12} {'version disk':>12} {'snapshot disk':>13}")
    for name, overrides in (("plain", {}), (f"freeze 0.05/w{a.window}", {"freeze_threshold": 0.05, "freeze_window": a.window})):
        r = storage(a.storage_iterations, **overrides)
        print(f"{name:<22} {r['iteration_ms']:>8.0f} {r['version_ms']:>10.1f} {r['snapshot_ms']:>11.1f} "
              f"{r['blobs']:>5.0f}/{r['tensors']:<3} {r['version_kb']:>11.1f} {r['snapshot_kb']:>12.1f} "
              f"{r['version_disk_kb']:>12.1f} {r['snapshot_disk_kb']:>13.1f}")
        print(f"{'':<22} all versions: {r['total_version_kb']:.0f} KiB content-addressed vs {r['total_snapshot_kb']:.0f} KiB "
              f"as full snapshots ({r['total_version_kb'] / r['total_snapshot_kb']:.2f}x)")
    if a.skip_freeze:
        return

    print(f"\n## freeze mode (Pendulum-v1 preset, {a.steps} steps, window {a.window} iterations)")
    cases = [0.0, *a.thresholds]
    results = {t: [] for t in cases}
    for seed in a.seeds:  # interleaved: every case of a seed before the next seed
        for t in cases:
            r = freeze_run(seed, a.steps, t, a.window)
            results[t].append(r)
            print(f"seed {seed} threshold {t}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    base_update = statistics.median(r["update_s"] for r in results[0.0])
    print(f"\n{'threshold':>9} {'final return (median, per seed)':>40} {'last-5 train':>12} {'update s':>9} "
          f"{'vs off':>6} {'params skipped':>14}")
    for t, rs in results.items():
        finals = [r["final_return"] for r in rs]
        upd = statistics.median(r["update_s"] for r in rs)
        print(f"{t:>9} {statistics.median(finals):>10.1f} [{', '.join(f'{x:.0f}' for x in finals)}]".ljust(51)
              + f" {statistics.median(r['train_return_last5'] for r in rs):>12.1f} {upd:>9.1f} {upd / base_update:>6.2f} "
              f"{statistics.median(r['skipped'] for r in rs):>14.1%}")


if __name__ == "__main__":
    main()

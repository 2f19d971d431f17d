"""Env steps/s of Push-v0 with images (two 128x128 cameras rendered by MuJoCo, proprio, instruction)
with the envs stepped in the learner's process and in K worker processes (``--env-workers K``).

Rows, interleaved, each timing --steps chunk steps of --envs envs with uniform random actions in
[-1, 1] (episodes reset as they end, resets included), medians over --repeats:

- ``GymChunkEnv workers=0``: what ppo-encoder and dppo step without ``--env-workers`` (in process);
- ``GymChunkEnv workers=K``: the same envs in K workers (rlfunc.envs.workers.ChunkWorkers), for each
  K of --workers: what ``--env-workers K`` steps;
- ``AsyncVectorEnv (one process per env)``: gymnasium's, shared memory, the gymnasium vector env of
  the same envs (SAME_STEP autoreset, one control step per step), for comparison;
- ``ParallelEnv(K x GymChunkEnv(N/K))``: TorchRL's worker processes over GymChunkEnvs, for comparison
  (--torchrl; each sub-env draws its own reset seeds, so its episodes are not the in-process ones).

Env steps count control steps (``act_steps`` per chunk step). Startup (worker processes, first
renderers) is not timed. Wall-clock rates say what K workers give only on otherwise idle cores: on
a machine that other sessions load, Linux's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``)
gives each session one share of the CPU, split among its processes, so K workers get no more CPU
than one process (and without autogroup, rows with more processes get more). So the GymChunkEnv rows
also give the CPU time per env step of this process and of each worker (``/proc/PID/stat``, all
threads) and the idle-core estimate ``(CPU per step in process) / (this process's + the busiest
worker's CPU per step)``: a chunk step is the workers' steps in parallel, then this process's part alone.

    python -m bench.env_workers --envs 8 --steps 20 --repeats 3 --workers 1 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

import envs  # noqa: F401  (registers Push-v0)
from envs.push import env as pe  # before mujoco: it chooses MUJOCO_GL


def _cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process, all its threads (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker_pids(env) -> list[int]:
    from rlfunc.envs.chunk import GymChunkEnv

    if not isinstance(env, GymChunkEnv) or not env.workers:  # (a ParallelEnv would forward the lookup to its workers)
        return []
    return [p.pid for p in env._part.pool.processes]


def _chunk_rate(env, steps: int, act_steps: int, gen: torch.Generator, cpu: list | None = None) -> float:
    td = env.reset()
    pids = _worker_pids(env)
    before = [_cpu_seconds(), *(_cpu_seconds(p) for p in pids)]
    t = time.perf_counter()
    for _ in range(steps):
        td = env.step(td.set("action", torch.rand(env.action_spec.shape, generator=gen) * 2 - 1))
        td = env.step_mdp(td)
        if td["done"].any():
            td = env.reset(td.set("_reset", td["done"]))
    wall = time.perf_counter() - t
    count = env.batch_size.numel() * steps * act_steps
    if cpu is not None:  # CPU seconds per env step: this process, then each worker
        cpu.append([(b - a) / count for a, b in zip(before, [_cpu_seconds(), *(_cpu_seconds(p) for p in pids)])])
    return count / wall


def _vector_rate(venv, steps: int, rng: np.random.Generator) -> float:
    venv.reset(seed=[int(s) for s in rng.integers(2**31, size=venv.num_envs)])
    t = time.perf_counter()
    for _ in range(steps):
        venv.step(rng.uniform(-pe.MAX_EE_SPEED, pe.MAX_EE_SPEED, (venv.num_envs, 3)).astype(np.float32))
    return venv.num_envs * steps / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="chunk steps per repeat")
    p.add_argument("--act-steps", type=int, default=1, help="actions per chunk (dppo on Push: 4; ppo-encoder: 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--async-vector", action="store_true", help="also gymnasium's AsyncVectorEnv, one process per env")
    p.add_argument("--torchrl", action="store_true", help="also TorchRL's ParallelEnv over K GymChunkEnvs")
    a = p.parse_args()
    torch.set_num_threads(1)
    from rlfunc.envs.chunk import GymChunkEnv

    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    rows: dict[str, object] = {"GymChunkEnv workers=0": GymChunkEnv("Push-v0", a.envs, act_steps=a.act_steps, seed=0)}
    for k in a.workers:
        rows[f"GymChunkEnv workers={k}"] = GymChunkEnv("Push-v0", a.envs, act_steps=a.act_steps, seed=0, workers=k)
    if a.async_vector:
        import gymnasium as gym

        rows["AsyncVectorEnv (one process per env)"] = gym.make_vec(
            "Push-v0", num_envs=a.envs, vectorization_mode="async",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP, "context": "forkserver"})
    if a.torchrl:
        from torchrl.envs import ParallelEnv

        import functools

        for k in [k for k in a.workers if k > 1]:
            n = a.envs // k
            rows[f"ParallelEnv({k} x GymChunkEnv({n}))"] = ParallelEnv(
                k, [functools.partial(GymChunkEnv, "Push-v0", n, act_steps=a.act_steps, seed=i) for i in range(k)],
                mp_start_method="spawn")
    rates: dict[str, list[float]] = {name: [] for name in rows}
    cpus: dict[str, list] = {name: [] for name in rows}
    for name, env in rows.items():  # warm-up: renderers, worker processes
        _vector_rate(env, 2, rng) if name.startswith("Async") else _chunk_rate(env, 2, a.act_steps, gen)
    for _ in range(a.repeats):  # interleaved
        for name, env in rows.items():
            rates[name].append(_vector_rate(env, a.steps * a.act_steps, rng) if name.startswith("Async")
                               else _chunk_rate(env, a.steps, a.act_steps, gen, cpus[name]))
    for env in rows.values():
        env.close()
    base = statistics.median(rates["GymChunkEnv workers=0"])
    print(f"Push-v0 with images, {a.envs} envs, GL {pe.gl_backend()}, {os.cpu_count()} CPUs, "
          f"{a.repeats} repeats x {a.steps} steps of {a.act_steps}-action chunks, medians; "
          f"load average {os.getloadavg()[0]:.2f} (other processes on the machine)")
    print("| envs stepped by | env steps/s | vs in process |\n|---|---|---|")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"| {name} | {med:.0f} | {med / base:.2f}x |")
    chunk = [n for n in rates if n.startswith("GymChunkEnv")]
    cpu = {n: np.median(np.asarray(cpus[n]), axis=0) * 1e3 for n in chunk}  # ms per env step
    serial = cpu["GymChunkEnv workers=0"][0]
    print("\nCPU ms per env step (medians) and the idle-core estimate\n"
          "| envs stepped by | this process | workers (sum) | busiest worker | estimate vs in process |\n|---|---|---|---|---|")
    for n in chunk:
        own, workers = cpu[n][0], cpu[n][1:]
        busiest = workers.max() if workers.size else 0.0
        print(f"| {n} | {own:.2f} | {workers.sum():.2f} | {busiest:.2f} | {serial / (own + busiest):.2f}x |")
    path = {n: cpu[n][0] + (cpu[n][1:].max() if cpu[n].size > 1 else 0.0) for n in chunk}  # ms per env step on idle cores
    for k in [k for k in a.workers if k > 1 and "GymChunkEnv workers=1" in rates]:
        name = f"GymChunkEnv workers={k}"
        ratio = statistics.median(rates[name]) / statistics.median(rates["GymChunkEnv workers=1"])
        print(f"workers={k} vs workers=1: {ratio:.2f}x wall clock here, {path['GymChunkEnv workers=1'] / path[name]:.2f}x "
              "estimated on idle cores")


if __name__ == "__main__":
    main()

"""Push env throughput: control steps/s of PushState-v0 (physics only) and of Push-v0 (physics + two
128x128 cameras), with random actions, and the share of a Push-v0 step spent rendering.

One env each, in the same process, interleaved; every repeat runs --steps control steps (episodes reset
as they end, resets included in the time); medians over --repeats. Inside a step, the time of the
50 physics substeps (``mujoco.mj_step``) and of the two camera renders is measured by wrapping them.

    python -m bench.push_env [--repeats 5] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import gymnasium as gym
import numpy as np

import envs  # noqa: F401  (registers the Push envs)
from envs.push import env as pe  # before mujoco: it chooses MUJOCO_GL

mujoco = pe.mujoco


class _Timed:
    """Accumulates the wall time of calls to ``fn``."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


def run(env: gym.Env, steps: int, rng: np.random.Generator, physics: _Timed) -> dict[str, float]:
    """Step ``env`` with random actions; returns wall seconds, mj_step seconds and render seconds."""
    u = env.unwrapped
    render = u.__dict__.get("_images")
    physics.seconds = 0.0
    if render is not None:
        render.seconds = 0.0
    env.reset(seed=int(rng.integers(1 << 31)))
    t = time.perf_counter()
    for _ in range(steps):
        _, _, term, trunc, _ = env.step(rng.uniform(-pe.MAX_EE_SPEED, pe.MAX_EE_SPEED, 3).astype(np.float32))
        if term or trunc:
            env.reset()
    wall = time.perf_counter() - t
    return {"wall": wall, "physics": physics.seconds, "render": render.seconds if render is not None else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="control steps per env per repeat")
    a = p.parse_args()
    state_env, pixel_env = gym.make("PushState-v0"), gym.make("Push-v0")
    pixel_env.reset(seed=0)  # creates the renderer (not timed)
    pixel_env.unwrapped._images = _Timed(pixel_env.unwrapped._images)
    physics = _Timed(mujoco.mj_step)
    pe.mujoco.mj_step = physics  # the env module calls mujoco.mj_step through this attribute
    rng = np.random.default_rng(0)
    runs: dict[str, list[dict[str, float]]] = {"state": [], "pixels": []}
    run(state_env, 20, rng, physics)  # warm-up
    run(pixel_env, 5, rng, physics)
    for _ in range(a.repeats):  # interleaved
        runs["state"].append(run(state_env, a.steps, rng, physics))
        runs["pixels"].append(run(pixel_env, a.steps, rng, physics))
    pe.mujoco.mj_step = physics.fn

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name]) / a.steps  # seconds per control step

    print(f"GL backend {pe.gl_backend()}, {os.cpu_count()} CPUs, "
          f"{a.repeats} repeats x {a.steps} control steps, {pe.N_SUBSTEPS} physics steps per control step")
    print(f"| {'env / part':<40} | {'steps/s':>8} | {'ms/step':>8} | {'share':>6} |")
    print(f"|{'-' * 42}|{'-' * 10}|{'-' * 10}|{'-' * 8}|")
    s_wall, s_phys = med("state", "wall"), med("state", "physics")
    x_wall, x_phys, x_render = med("pixels", "wall"), med("pixels", "physics"), med("pixels", "render")
    rows = [
        ("PushState-v0, random actions", s_wall, 1.0),
        ("  of which mj_step (50 substeps)", s_phys, s_phys / s_wall),
        ("  of which IK, observation, reward", s_wall - s_phys, (s_wall - s_phys) / s_wall),
        ("Push-v0 (top + side 128x128), random", x_wall, 1.0),
        ("  of which rendering (2 cameras)", x_render, x_render / x_wall),
        ("  of which mj_step (50 substeps)", x_phys, x_phys / x_wall),
        ("  of which the rest", x_wall - x_render - x_phys, (x_wall - x_render - x_phys) / x_wall),
    ]
    for name, sec, share in rows:
        print(f"| {name:<40} | {1.0 / sec:>8.0f} | {1e3 * sec:>8.3f} | {100 * share:>5.1f}% |")
    print(f"physics: {pe.N_SUBSTEPS / s_phys:,.0f} substeps/s of mj_step; Push-v0 / PushState-v0 speed: {s_wall / x_wall:.2f}")
    state_env.close()
    pixel_env.close()


if __name__ == "__main__":
    main()

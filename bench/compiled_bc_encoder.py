"""bc's and ppo-encoder's gradient steps, eager vs ``--compile on``: what sets their --compile auto thresholds.

- ``bc``: the default ``rlfunc train bc`` actor on PointReach-v0 (DiffusionMLP 256x256x256, T = 20,
  horizon 4 x 2 actions, 6 observations), batches of 512, on 1,000 random PointReach-shaped
  demonstrations. One update is ``iteration`` (the batch's indices, timesteps and noise drawn, the
  gradient step, the EMA), so the time is what a run spends per update.
- ``encoder``: ppo-encoder on Push-v0's observation (two 128x128 uint8 cameras, 16 proprio numbers,
  the learned instruction tokens) with a small encoder (ResNet-GN widths 16, 32, one block each,
  d_model 32; heads 64), minibatches of 64 from a random [8, 16] rollout batch. The step time is
  (t(2 epochs) - t(1 epoch)) / (steps per epoch), so ``prepare`` (values, GAE) cancels.

One intra-op thread. Eager and compiled alternate in each round; medians over rounds. The compile
time is the compiled side's first call (eager warm-up on copies, trace, compile, one step); inductor's
on-disk cache makes a repeat of the same graph cheaper (TORCHINDUCTOR_CACHE_DIR to a fresh folder for
a cold one).

    OMP_NUM_THREADS=1 python -m bench.compiled_bc_encoder --cases bc --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tensordict import TensorDict

from rlfunc.config import replace

CPU = torch.device("cpu")


def bc_side(compile: str):
    from rlfunc.algos.bc import BCConfig, make_bc
    from rlfunc.algos.diffusion_actor import env_info
    from rlfunc.optim.amp import precision

    config = replace(BCConfig(), device="cpu", compile=compile)
    info = env_info(config.env)
    algo = make_bc(config, info, info.act_dim, CPU)
    g = torch.Generator().manual_seed(0)
    dataset = TensorDict({"observation": torch.randn(1000, info.obs_dim, generator=g),
                          "action": torch.rand(1000, config.actor.horizon, info.act_dim, generator=g) * 2 - 1}, batch_size=[1000])
    box = {"state": algo.init(dataset)}
    gen, prec = torch.Generator().manual_seed(0), precision(CPU, "off")
    t = time.perf_counter()
    box["state"], _ = algo.iteration(box["state"], dataset, gen, prec)
    first = time.perf_counter() - t

    def run(n: int = 20) -> float:
        t = time.perf_counter()
        for _ in range(n):
            box["state"], _ = algo.iteration(box["state"], dataset, gen, prec)
        return (time.perf_counter() - t) / n

    return run, first


ENC = dict(num_envs=8, num_steps=16, minibatch_size=64, hidden=(64,), encoder_d_model=32, encoder_widths=(16, 32),
           encoder_blocks=(1, 1), anneal_lr=False, device="cpu")


def encoder_batch(info, N: int, T: int) -> TensorDict:
    """A [N, T] rollout batch in the layout ppo-encoder's rollout writes, Push-v0's observation keys."""
    g = torch.Generator().manual_seed(0)

    def obs():
        out = {c: torch.randint(0, 256, (N, T, *info.image_size, 3), generator=g, dtype=torch.uint8) for c in info.cameras}
        out["proprio"] = torch.randn(N, T, info.proprio_dim, generator=g)
        out["instruction_tokens"] = torch.randint(0, len(info.instructions), (N, T, 1), generator=g)
        out["instruction_padding_mask"] = torch.zeros(N, T, 1, dtype=torch.bool)
        return out

    done = torch.zeros(N, T, 1, dtype=torch.bool)
    return TensorDict({
        **obs(), "action": torch.randn(N, T, info.act_dim, generator=g), "sample_log_prob": torch.randn(N, T, 1, generator=g) - 2.0,
        "state_value": torch.randn(N, T, 1, generator=g),
        "next": {**obs(), "reward": torch.randn(N, T, 1, generator=g), "done": done, "terminated": done.clone(),
                 "episode_return": torch.zeros(N, T, 1), "success": done.clone()},
    }, batch_size=[N, T])


def encoder_side(compile: str):
    from rlfunc.algos.diffusion_actor import env_info
    from rlfunc.algos.ppo_encoder import PPOEncoderConfig, make_ppo_encoder

    info = env_info("Push-v0")
    algos = {e: make_ppo_encoder(replace(PPOEncoderConfig(), num_epochs=e, compile=compile, **ENC), info, CPU) for e in (1, 2)}
    state = algos[1].init()
    batch = encoder_batch(info, ENC["num_envs"], ENC["num_steps"])
    gen = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    for a in algos.values():  # the first calls compile (one graph per algo object)
        a.iteration(state, batch.clone(), gen)
    first = time.perf_counter() - t
    per_epoch = ENC["num_envs"] * ENC["num_steps"] // ENC["minibatch_size"]

    def run() -> float:
        times = {}
        for e, a in algos.items():
            t = time.perf_counter()
            a.iteration(state, batch.clone(), gen)
            times[e] = time.perf_counter() - t
        return (times[2] - times[1]) / per_epoch

    return run, first


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=["bc", "encoder"], choices=["bc", "encoder"])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    for case in a.cases:
        make = bc_side if case == "bc" else encoder_side
        sides = {mode: make(mode) for mode in ("off", "on")}
        times = {mode: [] for mode in sides}
        for _ in range(a.repeats):
            for mode, (run, _) in sides.items():
                times[mode].append(run())
        eager, compiled = statistics.median(times["off"]), statistics.median(times["on"])
        compile_s = sides["on"][1] - sides["off"][1]
        saved = eager - compiled
        print(f"{case}: eager {1e3 * eager:.1f} ms/step, compiled {1e3 * compiled:.1f} ms/step, ratio {compiled / eager:.2f} "
              f"(per round: {', '.join(f'{c / e:.2f}' for e, c in zip(times['off'], times['on']))}); "
              f"first call {sides['on'][1]:.1f} s compiled vs {sides['off'][1]:.1f} s eager; "
              + (f"break-even {compile_s / saved:.0f} steps" if saved > 0 else "compiled is not faster"))


if __name__ == "__main__":
    main()

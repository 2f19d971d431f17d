"""Push-v0 with images (two 128x128 cameras, proprio, instruction): the full diffusion pipeline (bc on
expert demos, then dppo with the frozen multimodal encoder) runs, and where its time goes.

Time shares of a dppo iteration: rendering (``PushEnv._images``), physics and IK (the rest of
``PushEnv.step`` and ``PushEnv.reset``), the multimodal encoder's forwards (module hooks), the rest of collection (DDIM
sampling of the chunks, tensor conversion) and the update (GAE, chain log-likelihoods, backward,
optimizer; the encoder's forwards in it are counted as encoder).

    python -m bench.push_pixels --envs 8 --iterations 2
    python -m bench.push_pixels --envs 16 --iterations 3 --device cuda   # the GPU row

Times on an accelerator are taken after a synchronize at each phase's edge (rendering, env step,
encoder, rollout, update), so a share is the wall time of that phase, not of its queued kernels.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch

from envs.push import env as push_env
from rlfunc.config import replace
from rlfunc.algos.bc import BCConfig
from rlfunc.algos.diffusion_actor import ActorSpec, make_env
from rlfunc.algos.dppo import DPPOConfig, make_dppo
from rlfunc.device import resolve_device, synchronize
from rlfunc.optim.amp import precision
from rlfunc.run import train
from rlfunc.run.diffusion import _init_actor

TIMES: dict[str, float] = defaultdict(float)
SYNC = lambda: None  # noqa: E731  (set to the accelerator's synchronize in main)


def _now() -> float:
    SYNC()
    return time.perf_counter()


def _timed(cls, name: str, key: str) -> None:
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t = _now()
        try:
            return original(self, *args, **kwargs)
        finally:
            TIMES[key] += _now() - t

    setattr(cls, name, wrapper)


def _hook_encoder(module: torch.nn.Module) -> None:
    start: list[float] = []
    module.register_forward_pre_hook(lambda *_: start.append(_now()))

    def post(*_):
        TIMES["encoder"] += _now() - start.pop()

    module.register_forward_hook(post)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--demos", type=int, default=4)
    p.add_argument("--bc-updates", type=int, default=20)
    p.add_argument("--out", default="bench/out/push_pixels")
    p.add_argument("--device", default="cpu", help="cpu, cuda, npu or auto (rlfunc.device.resolve_device)")
    a = p.parse_args()
    global SYNC
    torch.set_num_threads(1)
    device = resolve_device(a.device)
    SYNC = lambda: synchronize(device)  # noqa: E731
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    spec = ActorSpec(horizon=4, act_steps=4)
    t = time.perf_counter()
    bc = train(replace(BCConfig(), env="Push-v0", actor=spec, num_demos=a.demos, num_updates=a.bc_updates, batch_size=64,
                           eval_episodes=2, device=str(device)), out / "bc", progress=False, tensorboard=False)
    bc_s = time.perf_counter() - t
    chunks = 25
    config = replace(DPPOConfig(), env="Push-v0", init_from=str(out / "bc"), num_envs=a.envs, num_steps=chunks,
                        minibatch_size=a.envs * chunks // 5, num_epochs=2, device=str(device))
    config, info, actor_params, obs_stats, encoder = _init_actor(config, device)
    algo = make_dppo(config, config.actor, info, info.act_dim, device)
    state = algo.init(actor_params, obs_stats, encoder)
    prec = precision(device, config.run.precision)
    env = make_env("Push-v0", a.envs, spec.act_steps, device, 0)
    gen = torch.Generator(device=device).manual_seed(0)
    _timed(push_env.PushEnv, "_images", "render")
    _timed(push_env.PushEnv, "step", "env_step")
    _timed(push_env.PushEnv, "reset", "env_step")
    _hook_encoder(algo.actor.encoder)
    collect_s = update_s = 0.0
    steps = 0
    for _ in range(a.iterations):
        t = _now()
        batch = algo.rollout(state, env, gen)
        collect_s += _now() - t
        enc_collect = TIMES["encoder"]
        t = _now()
        state, metrics = algo.iteration(state, batch, gen, prec)
        update_s += _now() - t
        TIMES["encoder_update"] += TIMES["encoder"] - enc_collect
        TIMES["encoder"] = enc_collect
        steps += batch.numel() * spec.act_steps
    env.close()
    total = collect_s + update_s
    render, physics = TIMES["render"], TIMES["env_step"] - TIMES["render"]
    shares = {
        "rendering": render,
        "physics_ik": physics,
        "encoder_collect": TIMES["encoder"],
        "sampling_other_collect": collect_s - TIMES["env_step"] - TIMES["encoder"],
        "encoder_update": TIMES["encoder_update"],
        "update_other": update_s - TIMES["encoder_update"],
    }
    row = {
        "device": str(device), "envs": a.envs, "iterations": a.iterations, "env_steps": steps, "bc_s": bc_s,
        "env_steps_per_s": steps / total, "collect_steps_per_s": steps / collect_s,
        **{f"share_{k}": v / total for k, v in shares.items()},
        "bc_success_rate": bc.evaluation["success_rate"], "approx_kl": float(metrics["approx_kl"]),
    }
    print(json.dumps(row))
    print("\n| part | seconds | share |\n|---|---|---|")
    for k, v in shares.items():
        print(f"| {k} | {v:.1f} | {v / total:.1%} |")
    print(f"| total ({steps} env steps, {steps / total:.0f} steps/s) | {total:.1f} | 100% |")


if __name__ == "__main__":
    main()

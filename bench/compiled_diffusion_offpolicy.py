"""sac-diffusion's and td3-diffusion's update, eager vs ``--compile on`` (issue 18; the threshold of
``--compile auto``, AUTO_COMPILE_UPDATES of rlfunc.algos.td3_diffusion and rlfunc.algos.sac_diffusion,
rests on it).

Each algorithm at its defaults on PointReach-v0 (DiffusionMLP 256x256x256, horizon 1; sac-diffusion's
20-step DDPM chain, td3-diffusion's 5 DDIM steps; critics 256x256; minibatches of 256), a replay buffer
of 5,000 random transitions, one intra-op thread. One measurement is one ``iteration`` of
``--updates`` gradient steps (20: sac-diffusion's entropy estimate and alpha step, every 20 updates,
run once in it, as in a run; the actor steps every 2nd), after a warm-up iteration (where the compiled
side compiles: its wall-clock is reported apart). Eager and compiled alternate in each round; the
result is the median over rounds in ms per gradient step, the ratio, and the break-even run length
(compile time / time saved per step). ``--entropy-every 1000000``: sac-diffusion's steps without the
entropy estimate (only the warm-up iteration's first update makes one).

    OMP_NUM_THREADS=1 python -m bench.compiled_diffusion_offpolicy --algos sac-diffusion td3-diffusion --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tensordict import TensorDict

from rlfunc.algos.diffusion_actor import env_info
from rlfunc.config import replace
from rlfunc.optim.amp import precision

CPU = torch.device("cpu")
ROWS = 5_000


def _buffer(obs_dim: int, chunk: tuple[int, int]):
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    g = torch.Generator().manual_seed(0)
    action = torch.rand(ROWS, *chunk, generator=g) * 2 - 1
    buffer = ReplayBuffer(storage=LazyTensorStorage(ROWS))
    buffer.extend(TensorDict({
        "cond": torch.randn(ROWS, obs_dim, generator=g), "next_cond": torch.randn(ROWS, obs_dim, generator=g),
        "action": action.flatten(1), "chunk": action, "reward": torch.randn(ROWS, 1, generator=g),
        "terminated": torch.rand(ROWS, 1, generator=g) < 0.05,
    }, batch_size=[ROWS]))
    return buffer


def side(algo_name: str, compile: str, updates: int, entropy_every: int | None = None, env: str | None = None):
    """A callable timing one ``iteration`` of ``updates`` gradient steps (its default env, or ``env``'s sizes)."""
    if algo_name == "sac-diffusion":
        from rlfunc.algos.sac_diffusion import SACDiffusionConfig as Config
        from rlfunc.algos.sac_diffusion import make_sac_diffusion as make
    else:
        from rlfunc.algos.td3_diffusion import TD3DiffusionConfig as Config
        from rlfunc.algos.td3_diffusion import make_td3_diffusion as make
    extra = {"entropy_every": entropy_every} if entropy_every and algo_name == "sac-diffusion" else {}
    config = replace(Config(), updates_per_iteration=updates, compile=compile, device="cpu", **extra,
                     **({"env": env} if env is not None else {}))
    info = env_info(config.env)
    algo = make(config, config.actor, info, info.act_dim, CPU)
    state = algo.init()
    buffer = _buffer(algo.actor.obs_dim, (config.actor.horizon, info.act_dim))
    gen, prec = torch.Generator().manual_seed(0), precision(CPU, "off")

    def run() -> float:
        t = time.perf_counter()
        algo.iteration(state, buffer, gen, prec)
        return time.perf_counter() - t

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algos", nargs="+", default=["sac-diffusion", "td3-diffusion"], choices=["sac-diffusion", "td3-diffusion"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--entropy-every", type=int, default=None, help="sac-diffusion's entropy_every (default: its config's, 20)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name in a.algos:
        sides = {"eager": side(name, "off", a.updates, a.entropy_every), "compiled": side(name, "on", a.updates, a.entropy_every)}
        warm = {k: run() for k, run in sides.items()}  # the compiled side compiles here
        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(a.repeats):
            for k, run in sides.items():
                times[k].append(run() / a.updates * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        compile_s = warm["compiled"] - med["compiled"] * a.updates / 1e3
        saved = (med["eager"] - med["compiled"]) / 1e3
        print(f"{name}: ms per gradient step, median of {a.repeats} (min): "
              + ", ".join(f"{k} {med[k]:.1f} ({min(times[k]):.1f})" for k in sides)
              + f"; compiled / eager {med['compiled'] / med['eager']:.2f}; compile {compile_s:.1f} s; "
              + (f"break-even {compile_s / saved:.0f} steps" if saved > 0 else "no break-even"), flush=True)


if __name__ == "__main__":
    main()

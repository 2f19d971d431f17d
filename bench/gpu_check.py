"""The checks a lent GPU is for (issues 16 and 18), as one script that prints one JSON line per check:

- ``equal``: each compiled gradient step (ppo, sac, td3, dppo; CUDA graphs on CUDA) against the eager
  step on the same device, from the same seed: every learner leaf within 1e-5 after one iteration
  (ppo 32 gradient steps, sac/td3 4, dppo 8), and dynamo's graph count;
- ``eager_ms`` / ``compiled_ms``: one gradient step's wall-clock, median of interleaved timed
  iterations after that first one (synchronized at iteration edges, so launch overhead counts).

It runs on any device (``--device cpu`` checks the script itself here); the end-to-end env steps/s,
the nccl process group and the profiler trace are `rlfunc train` commands (bench/RESULTS.md, "GPU").

    python -m bench.gpu_check --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch
from tensordict import TensorDict

from rlfunc.config import replace

OBS, ACT = 17, 6  # HalfCheetah-v5's sizes


def _close(a: TensorDict, b: TensorDict) -> tuple[bool, float, list]:
    """Whether every leaf of two learner states is within atol 1e-5 + rtol 1e-5 (the tests' rule; NaN
    where both are; integer leaves equal), and the largest absolute difference of the parameters."""
    ok, worst, off = True, 0.0, []
    for key in a.keys(True, True):
        x, y = a.get(key).detach(), b.get(key).detach()
        if not x.is_floating_point():
            ok = ok and torch.equal(x, y)
            continue
        if not torch.allclose(x, y, atol=1e-5, rtol=1e-5, equal_nan=True):
            ok = False
            off.append(["/".join(key), float((x - y).abs().max()), float(x.abs().max())])  # leaf, max |diff|, max |value|
        if key[0] == "params" and x.numel():
            worst = max(worst, float((x - y).abs().max()))
    return ok, worst, sorted(off, key=lambda r: -r[1])[:5]


def _ppo(device: torch.device, hidden: int, mode: str, minibatch: int = 64, T: int = 2048):
    from rlfunc.algos.ppo import EnvSpec, PPOConfig, make_ppo

    config = replace(PPOConfig(), env="HalfCheetah-v5", num_envs=1, num_steps=T, num_epochs=1, minibatch_size=minibatch,
                     hidden=(hidden, hidden), lr=3e-4, total_steps=T * 1000, compile=mode, device=device.type)
    algo = make_ppo(config, EnvSpec(OBS, ACT, [-1.0] * ACT, [1.0] * ACT), device)
    state, gens = algo.init(), [torch.Generator(device=device).manual_seed(0)]

    def batch(seed: int) -> TensorDict:
        g = torch.Generator().manual_seed(seed)
        obs = torch.randn(1, 1, T, OBS, generator=g)
        action = torch.randn(1, 1, T, ACT, generator=g)
        nxt = {"observation": obs + 0.1, "reward": torch.randn(1, 1, T, 1, generator=g),
               "done": torch.zeros(1, 1, T, 1, dtype=torch.bool), "terminated": torch.zeros(1, 1, T, 1, dtype=torch.bool)}
        return TensorDict({"observation": obs, "action": action, "next": nxt,
                           "sample_log_prob": -0.5 * action.square().sum(-1, keepdim=True) - 5.5}, batch_size=[1, 1, T]).to(device)

    def step(i: int):  # one iteration = T / minibatch gradient steps
        nonlocal state
        state, _ = algo.iteration(state, batch(i), gens)

    return step, lambda: state, T // minibatch


def _buffer(device: torch.device, n: int = 4096):
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    g = torch.Generator().manual_seed(0)
    buffer = ReplayBuffer(storage=LazyTensorStorage(n, device=device))
    buffer.extend(TensorDict({
        "observation": torch.randn(n, OBS, generator=g), "action": torch.rand(n, ACT, generator=g) * 2 - 1,
        "next": {"observation": torch.randn(n, OBS, generator=g), "reward": torch.randn(n, 1, generator=g),
                 "terminated": torch.rand(n, 1, generator=g) < 0.1},
    }, batch_size=[n]).to(device))
    return buffer


def _offpolicy(name: str, device: torch.device, hidden: int, mode: str, updates: int = 20):
    from rlfunc.algos.ppo import EnvSpec

    if name == "sac":
        from rlfunc.algos.sac import SACConfig as Config
        from rlfunc.algos.sac import make_sac as make
    else:
        from rlfunc.algos.td3 import TD3Config as Config
        from rlfunc.algos.td3 import make_td3 as make
    config = replace(Config(), hidden=(hidden, hidden), batch_size=256, max_grad_norm=0.5, device=device.type, compile=mode)
    algo = make(config, EnvSpec(OBS, ACT, [-1.0] * ACT, [1.0] * ACT), device)
    state, buffer, gen = algo.init(), _buffer(device), torch.Generator(device=device).manual_seed(0)

    def step(i: int):  # the first iteration (the equality check) takes 4 updates
        nonlocal state
        state, _ = algo.iteration(state, buffer, gen, 4 if i == 0 else updates)

    return step, lambda: state, updates


def _dppo(device: torch.device, hidden: int, mode: str):
    from rlfunc.algos.diffusion_actor import ActorSpec, make_env
    from rlfunc.algos.dppo import DPPOConfig, make_dppo
    from rlfunc.optim.amp import precision

    spec = ActorSpec(hidden=(hidden, hidden), ddim_steps=10, num_train_steps=20)
    config = replace(DPPOConfig(), num_envs=64, num_steps=4, minibatch_size=64, num_epochs=2, target_kl=None,
                     finetune_steps=10, device=device.type, compile=mode)
    algo = make_dppo(config, spec, 6, 2, device)
    state = algo.init()
    env, gen, prec = make_env("PointReach-v0", 64, spec.act_steps, device, 0), torch.Generator(device=device).manual_seed(0), precision(device, "off")
    batches = []

    def step(i: int):
        nonlocal state
        while len(batches) <= i % 4:  # the same four rollouts for both sides
            batches.append(algo.rollout(state, env, gen))
        state, _ = algo.iteration(state, batches[i % 4].clone(), gen, prec)

    return step, lambda: state, 2 * (64 * 4 // 64)


CASES = {"ppo": _ppo, "sac": lambda d, h, m: _offpolicy("sac", d, h, m), "td3": lambda d, h, m: _offpolicy("td3", d, h, m), "dppo": _dppo}


def check(name: str, device: torch.device, hidden: int, repeats: int) -> dict:
    """Eager and compiled sides built from the same seed; a first iteration on each (the compiled side
    compiles there), then the largest learner-leaf difference and dynamo's graph count (``equal``),
    then per gradient step ms, eager and compiled interleaved over ``repeats`` timed iterations."""
    import torch._dynamo

    from rlfunc.device import synchronize

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    sides, first = {}, {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        sides[mode] = CASES[name](device, hidden, mode)
        synchronize(device)
        t0 = time.perf_counter()
        sides[mode][0](0)
        synchronize(device)
        first[mode] = round(time.perf_counter() - t0, 1)
    ok, diff, off = _close(sides["off"][1](), sides["on"][1]())
    line = {"algo": name, "hidden": hidden, "device": device.type, "equal": ok, "params_max_abs_diff": diff, "leaves_off": off,
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], "first_iteration_s": first}
    times = {mode: [] for mode in sides}
    for r in range(repeats):
        for mode, (step, _, n) in sides.items():
            synchronize(device)
            t0 = time.perf_counter()
            step(r + 1)
            synchronize(device)
            times[mode].append((time.perf_counter() - t0) / n * 1e3)
    eager, compiled = statistics.median(times["off"]), statistics.median(times["on"])
    line.update({"eager_ms": round(eager, 3), "compiled_ms": round(compiled, 3), "compiled/eager": round(compiled / eager, 3),
                 "graphs_after": torch._dynamo.utils.counters["stats"]["unique_graphs"]})
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", nargs="+", default=["ppo:64", "sac:256", "dppo:64", "td3:256", "ppo:256"],
                    help="ALGO:HIDDEN, ALGO one of " + ", ".join(CASES))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    for case in args.cases:
        name, hidden = case.split(":")
        hidden = int(hidden)
        t0 = time.perf_counter()
        try:
            line = check(name, device, hidden, args.repeats)
        except Exception as e:  # noqa: BLE001 - a failed check is a result to report, not the end of the script
            line = {"algo": name, "hidden": hidden, "error": f"{type(e).__name__}: {e}"[:800],
                    "where": traceback.format_exc().splitlines()[-8:]}
        line["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()

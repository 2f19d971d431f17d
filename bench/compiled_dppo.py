"""DPPO's gradient step, eager vs ``--compile on`` (issue 18: <= 0.6x the eager time).

Two actors: PointReach-v0's preset (DiffusionMLP 256x256x256, K = 10 DDIM steps, all fine-tuned,
2 actions x horizon 4, 6 observations) and one of DPPO-Gym's size (Ren et al. 2024, gym fine-tuning
configs: 512x512x512, K = 20 with the last 10 fine-tuned, HalfCheetah's 17 observations and 6
actions, horizon 4). The chain likelihood, minibatches of 256, one intra-op thread. The batch is
128 envs x 8 chunk steps in the layout dppo's collector writes: random observations, the freshly
initialised actor's own DDIM chains (eta 1), random rewards. One DPPO iteration runs its
``prepare`` (conditions, GAE, the stored log-likelihoods; eager on both sides) and then the epochs; the
step time is (t(5 epochs) - t(1 epoch)) / (4 x steps per epoch), so ``prepare`` cancels. Eager and
compiled alternate in each round; medians over rounds. The compile time is the first call's.

    OMP_NUM_THREADS=1 python -m bench.compiled_dppo --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tensordict import TensorDict

from rlfunc.algos.diffusion_actor import ActorSpec
from rlfunc.algos.dppo import DPPOConfig, make_dppo
from rlfunc.config import replace
from rlfunc.optim.amp import precision

CPU = torch.device("cpu")
CASES = {
    "pointreach": dict(spec=ActorSpec(), obs_dim=6, act_dim=2, finetune_steps=None),
    "gym-sized": dict(spec=ActorSpec(hidden=(512, 512, 512), ddim_steps=20), obs_dim=17, act_dim=6, finetune_steps=10),
}
ENVS, STEPS, MINIBATCH = 128, 8, 256


def _batch(algo, state, obs_dim: int, spec: ActorSpec) -> TensorDict:
    """A [ENVS, STEPS] rollout batch as dppo's collector writes it, from the actor's own chains."""
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(ENVS, STEPS, obs_dim, generator=g)
    rows = []
    for t in range(STEPS):
        td = TensorDict({"observation": obs[:, t]}, batch_size=[ENVS])
        rows.append(_act(algo, state, td, g, spec))
    batch = torch.stack(rows, 1)
    batch["next"] = TensorDict({
        "observation": torch.randn(ENVS, STEPS, obs_dim, generator=g), "reward": torch.randn(ENVS, STEPS, 1, generator=g),
        "done": torch.zeros(ENVS, STEPS, 1, dtype=torch.bool), "terminated": torch.zeros(ENVS, STEPS, 1, dtype=torch.bool),
    }, batch_size=[ENVS, STEPS])
    return batch


def _act(algo, state, td, g, spec):
    from rlfunc.diffusion.ddim import sample

    actor = algo.actor
    cond = actor.condition(None, state["obs_stats"], td)
    with torch.no_grad():
        _, chain = sample(actor.apply, state["params", "actor"], cond, actor.noise(cond.shape[0], g), state["schedule"],
                          spec.ddim_steps, 1.0, std_floor=0.1, return_chain=True, prediction=spec.prediction)
    td["cond"], td["chain"], td["action"] = cond, chain, actor.env_action(chain[:, -1])
    return td


def side(case: str, compile: str):
    c = CASES[case]
    config = replace(DPPOConfig(), num_envs=ENVS, num_steps=STEPS, minibatch_size=MINIBATCH, target_kl=None,
                     finetune_steps=c["finetune_steps"], device="cpu", compile=compile)
    algos = {e: make_dppo(replace(config, num_epochs=e), c["spec"], c["obs_dim"], c["act_dim"], CPU) for e in (1, 5)}
    state = algos[1].init()
    batch = _batch(algos[1], state, c["obs_dim"], c["spec"])
    prec = precision(CPU, "off")
    gen = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    for a in algos.values():  # the first calls compile (one graph per algo object)
        a.iteration(state, batch, gen, prec)
    first = time.perf_counter() - t

    def run() -> float:
        times = {}
        for e, a in algos.items():
            t = time.perf_counter()
            a.iteration(state, batch, gen, prec)
            times[e] = time.perf_counter() - t
        return (times[5] - times[1]) / (4 * (ENVS * STEPS // MINIBATCH))

    return run, first


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"DPPO gradient step, minibatch {MINIBATCH}, chain likelihood, {ENVS}x{STEPS} batch, torch threads=1")
    for case in a.cases:
        sides = {mode: side(case, mode) for mode in ("off", "on")}
        times = {mode: [] for mode in sides}
        for _ in range(a.repeats):
            for mode, (run, _) in sides.items():
                times[mode].append(run())
        eager, compiled = statistics.median(times["off"]), statistics.median(times["on"])
        print(f"{case}: eager {1e3 * eager:.1f} ms/step, compiled {1e3 * compiled:.1f} ms/step, ratio {compiled / eager:.2f} "
              f"(per round: {', '.join(f'{c / e:.2f}' for e, c in zip(times['off'], times['on']))}); "
              f"first calls (both epoch counts) {sides['on'][1]:.1f} s compiled vs {sides['off'][1]:.1f} s eager")


if __name__ == "__main__":
    main()

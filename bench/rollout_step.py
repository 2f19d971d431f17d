"""The off-policy collection step: ms per 1-step rollout of ``rlfunc.envs.collect.rollout`` (sac and td3
call it once per env step) on a 1-env vector env with uniform random actions, beside the bare
``venv.step`` of the same actions; and ms per ``transitions`` + TorchRL replay-buffer ``extend`` of
that step. Run it in two checkouts in alternation to compare them (from inside each: ``-m`` imports
rlfunc from the current directory first):

    for i in 1 2 3 4; do for c in OLD NEW; do (cd $c && OMP_NUM_THREADS=1 python -m bench.rollout_step); done; done
"""

from __future__ import annotations

import argparse
import time

import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from rlfunc.algos.offpolicy import transitions
from rlfunc.envs import collect


class _Identity:  # an action scale that leaves the actions as they are
    def to_unit(self, action):
        return action


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="Pendulum-v1")
    p.add_argument("--steps", type=int, default=3000)
    a = p.parse_args()
    torch.set_num_threads(1)
    venv = collect.make_vec_env(a.env, 1)
    carry = collect.reset(venv, collect.env_seeds(0, 1))
    g = torch.Generator().manual_seed(0)
    act_dim = venv.single_action_space.shape[0]
    low, high = (torch.as_tensor(x, dtype=torch.float32) for x in (venv.single_action_space.low, venv.single_action_space.high))
    policy = lambda obs: (low + (high - low) * torch.rand(obs.shape[0], act_dim, generator=g), None)  # noqa: E731
    buffer = ReplayBuffer(storage=LazyTensorStorage(a.steps + 1000), batch_size=256)
    cpu = torch.device("cpu")
    for _ in range(200):  # warm-up
        batch, carry = collect.rollout(venv, policy, carry, 1, device=cpu)
        buffer.extend(transitions(batch, _Identity()))
    t0 = time.perf_counter()
    for _ in range(a.steps):
        batch, carry = collect.rollout(venv, policy, carry, 1, device=cpu)
    t1 = time.perf_counter()
    for _ in range(a.steps):
        buffer.extend(transitions(batch, _Identity()))
    t2 = time.perf_counter()
    actions = (low + (high - low) * torch.rand(a.steps, 1, act_dim, generator=g)).numpy()
    t3 = time.perf_counter()
    for i in range(a.steps):
        venv.step(actions[i])
    t4 = time.perf_counter()
    ms = lambda t: 1e3 * t / a.steps  # noqa: E731
    print(f"rollout {ms(t1 - t0):.3f} ms  transitions+extend {ms(t2 - t1):.3f} ms  bare env step {ms(t4 - t3):.3f} ms")


if __name__ == "__main__":
    main()

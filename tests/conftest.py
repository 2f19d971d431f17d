"""Shared test helpers: ``spawn_gloo`` runs a function on 2 (or W) local gloo processes."""

from __future__ import annotations

import os
import socket

import multiprocessing

import torch
import torch.multiprocessing as mp

# The children fork from one server process that imported these once (a spawned child would pay
# the ~5-10 s of importing torch and tensordict per test on a loaded machine).
_PRELOAD = ["torch", "tensordict", "rlfunc.run.distributed", "rlfunc.algos.ppo", "rlfunc.envs.collect", "rlfunc.algos.bc",
            "rlfunc.algos.dppo", "rlfunc.algos.grpo", "rlfunc.run.grpo", "rlfunc.run.mappo", "rlfunc.algos.sac", "rlfunc.algos.td3",
            "rlfunc.run.offpolicy", "torchrl.data", "rlfunc.run.ppo_encoder"]


def free_port() -> int:
    """A TCP port no one listens on now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    import torch

    from rlfunc.run.distributed import Distributed

    torch.set_num_threads(1)
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update(env)
    dist = Distributed.from_env("cpu")
    try:
        fn(dist, *args)
    finally:
        dist.close()


def spawn_gloo(fn, *args, world_size: int = 2) -> None:
    """``fn(dist, *args)`` on ``world_size`` fresh processes joined in a gloo group on this host
    (``dist``: their :class:`rlfunc.run.distributed.Distributed`); an exception on a rank fails the
    caller with that rank's traceback. ``fn`` must be a module-level function (it is pickled)."""
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call)
    mp.start_processes(_worker, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True,
                       start_method="forkserver")


import pytest  # noqa: E402


def compare_snapshots(want_path, got_path, *, rtol: float = 1e-6, atol: float = 1e-6):
    """Load two snapshots (the single process's ``want_path``, a data-parallel run's ``got_path``)
    and assert the same leaves, every float leaf within (rtol, atol) and every other leaf (generator
    states, counters, flags) exact. Returns (want meta, got meta, the largest |difference| of a
    float leaf under "params")."""
    from rlfunc.run import checkpoint

    ta, meta_a = checkpoint.load_snapshot(want_path)
    tb, meta_b = checkpoint.load_snapshot(got_path)
    assert set(ta.keys(True, True)) == set(tb.keys(True, True))
    worst = 0.0
    for k in ta.keys(include_nested=True, leaves_only=True):
        x, y = ta.get(k), tb.get(k)
        if x.dtype.is_floating_point:
            torch.testing.assert_close(y, x, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
            if "params" in k:
                worst = max(worst, float((x - y).abs().max()))
        else:
            assert torch.equal(x, y), k
    return meta_a, meta_b, worst


@pytest.fixture
def gloo():
    """:func:`spawn_gloo`, for tests: ``gloo(fn, *args, world_size=2)``."""
    return spawn_gloo


def keep_copy_on_rank_0(dist, run_dir, copy_to: str, timeout_s: float = 120.0) -> None:
    """Between a data-parallel run's two calls: rank 0 copies ``run_dir`` (all written) to ``copy_to``
    (copied, then renamed into place); every other rank waits until the copy is there, at most
    ``timeout_s``, so no rank writes into the run again before it is taken."""
    import shutil
    import time

    if dist.is_main:
        shutil.copytree(run_dir, copy_to + ".tmp")
        os.rename(copy_to + ".tmp", copy_to)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(copy_to) and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture
def same_snapshots():
    """:func:`compare_snapshots`, for tests: ``same_snapshots(want_path, got_path, rtol=, atol=)``."""
    return compare_snapshots


_NAN_OBS_ENV = """import gymnasium, numpy as np
from gymnasium.envs.classic_control.pendulum import PendulumEnv
class NanObs(PendulumEnv):
    def reset(self, *, seed=None, options=None):
        self.t = 0
        return super().reset(seed=seed, options=options)
    def step(self, a):
        obs, r, term, trunc, info = super().step(a)
        self.t += 1
        return (np.full_like(obs, np.nan) if self.t == 3 else obs), r, term, trunc, info
gymnasium.register(id="NanObsPendulum-v0", entry_point=NanObs, max_episode_steps=20)
"""


def nan_obs_env(tmp_path, monkeypatch) -> str:
    """The id ("module:NanObsPendulum-v0") of Pendulum with 20-step episodes whose observation is NaN at
    step 3 of each: a module written into ``tmp_path`` and put on the path (also for env workers)."""
    (tmp_path / "rlfunc_test_nan_obs_env.py").write_text(_NAN_OBS_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "rlfunc_test_nan_obs_env:NanObsPendulum-v0"

"""Data-parallel ppo-encoder (2 gloo ranks, each stepping 2 of 4 envs of a Dict observation: a 32x32
uint8 camera and 4 proprio numbers): the iteration and the run (rlfunc.run.train, as torchrun's
workers call it for `rlfunc train ppo --env ENV --nproc 2`) are the single process's to float
rounding, rank 0 alone writes, and a 2-rank snapshot resumes in one process. The env is a cheap
test double (no rendering) whose episodes end at different steps, so envs reset mid-rollout and the
ranks draw the single process's reset seeds; its state is a numpy ``state`` array, so resume is exact.
"""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlfunc.algos.ppo_encoder import PPOEncoderConfig, make_ppo_encoder
from rlfunc.config import replace
from rlfunc.errors import ConfigError
from rlfunc.run import checkpoint

ENV = "TinyDictReach-v0"
CPU = torch.device("cpu")


class _TinyDictReach(gym.Env):
    """A point in [-1, 1]^2 pushed by the action toward the origin; the observation is a 32x32 RGB
    image of it (uint8) and "proprio" (x, y, steps left, 1); reward -|p|; the episode is truncated
    after 3 + seed % 7 steps (seed: its reset's), so the envs' episodes end at different steps."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Dict({
            "cam": gym.spaces.Box(0, 255, (32, 32, 3), np.uint8),
            "proprio": gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
        })
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.state = np.zeros(3)  # x, y, steps left: what rlfunc.envs.state captures for resume

    def _obs(self):
        x, y, left = self.state
        cam = np.zeros((32, 32, 3), np.uint8)
        i, j = int((x + 1) * 15.5), int((y + 1) * 15.5)
        cam[max(i - 2, 0):i + 3, max(j - 2, 0):j + 3] = (255, 128, 32)
        cam[..., 2] += np.uint8(8 * left)
        return {"cam": cam, "proprio": np.array([x, y, left, 1.0], np.float32)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.state = np.array([*self.np_random.uniform(-1, 1, 2), 3 + (seed or 0) % 7])
        return self._obs(), {"is_success": False}

    def step(self, action):
        p = np.clip(self.state[:2] + 0.3 * np.asarray(action, np.float64), -1, 1)
        self.state = np.array([*p, self.state[2] - 1])
        dist = float(np.linalg.norm(p))
        return self._obs(), -dist, dist < 0.1, bool(self.state[2] <= 0), {"is_success": dist < 0.1}


if ENV not in gym.registry:  # here and in the ranks, which import this module for their functions
    gym.register(id=ENV, entry_point=_TinyDictReach, max_episode_steps=30)

# 4 envs x 6 steps = 24 samples per iteration, 3 minibatches of 8 (4 per rank), 2 micro-batches of 2 per share
TINY = dict(env=ENV, num_envs=4, num_steps=6, minibatch_size=8, num_epochs=2, hidden=(16,), encoder_d_model=16,
            encoder_widths=(8, 8), encoder_blocks=(1, 1), device="cpu", eval_episodes=2, lr=1e-3, seed=3)
QUIET = dict(progress=False, tensorboard=False)


def _config(**kw) -> PPOEncoderConfig:
    return replace(PPOEncoderConfig(), **{**TINY, **kw})


def _iterations(dist, out: str | None, iterations: int = 2) -> dict:
    """``iterations`` rollouts and updates as EncoderRun runs them, on this rank's split of the envs
    (the whole of them when ``dist`` is None); rank 0 saves each iteration's learner state and metrics to ``out``."""
    from rlfunc.algos.diffusion_actor import dones_of_split, env_info
    from rlfunc.envs.chunk import GymChunkEnv

    config = _config(micro_batch_size=2, total_steps=24 * iterations)
    W, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)
    algo = make_ppo_encoder(config, env_info(ENV), CPU, dist=dist)
    state = algo.init()
    env = GymChunkEnv(ENV, config.num_envs // W, act_steps=1, seed=config.run.seed, split=(rank, W) if W > 1 else None,
                      dones_of_split=dones_of_split(dist) if W > 1 else None)
    gen = torch.Generator().manual_seed(config.run.seed)
    saved = []
    try:
        carry = env.reset()
        for _ in range(iterations):
            batch, carry = algo.rollout(state, env, carry, gen)
            state, metrics = algo.iteration(state, batch, gen)
            saved.append({"state": state.clone().to_dict(), "metrics": metrics.to_dict()})
    finally:
        env.close()
    if rank == 0 and out is not None:
        torch.save(saved, out)
    return saved


def _leaves(d: dict, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def test_two_rank_iterations_equal_the_single_process_ones(gloo, tmp_path):
    """Two iterations (3 minibatches x 2 epochs each, micro-batched, rewards normalised, envs reset
    mid-rollout) on 2 ranks: every float of the learner state within 1e-6 of the single process's
    (parameters, Adam moments, return and proprio statistics, discounted returns), the generator
    state and counters exact, the metrics alike."""
    gloo(_iterations, str(tmp_path / "dp.pt"))
    want = _iterations(None, None)
    got = torch.load(tmp_path / "dp.pt", weights_only=False)
    worst = 0.0
    for g, w in zip(got, want):
        gs, ws = dict(_leaves(g["state"])), dict(_leaves(w["state"]))
        assert gs.keys() == ws.keys() and ("proprio_stats", "mean") in ws
        for k, x in ws.items():
            y = gs[k]
            if x.dtype.is_floating_point:
                torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
                if k[0] == "params":
                    worst = max(worst, float((x - y).abs().max()))
            else:  # the generator state, iteration, env_steps: exact
                assert torch.equal(x, y), k
        assert g["metrics"]["episodes"] == w["metrics"]["episodes"] > 0  # every rank's episodes counted
        for k in ("loss_objective", "loss_critic", "approx_kl", "grad_norm", "value_target_mean", "episode_return"):
            assert float(g["metrics"][k]) == pytest.approx(float(w["metrics"][k]), rel=1e-5, abs=1e-6), k
    assert float(ws["return_stats", "count"]) == 48 and float(ws["proprio_stats", "count"]) == 48
    print(f"max |difference| of a parameter after 2 iterations: {worst:.1e}")


# ------------------------------------------------------------------------------ the run


def _run(run_dir, iterations: int, **kw):
    from rlfunc.run import train

    config = _config(total_steps=24 * iterations, checkpoint_every=1)
    return train(config, run_dir, evaluate=False, **QUIET, **kw)


def _rank_run(dist, run_dir, after_one):
    """One iteration, rank 0 keeping a copy of the run then, and a resume on the same 2 ranks to 2."""
    from rlfunc.run import train

    from conftest import keep_copy_on_rank_0

    _run(run_dir, 1)  # it leaves the process group
    keep_copy_on_rank_0(dist, run_dir, after_one)
    train(None, run_dir, resume=True, total_steps=48, evaluate=False, **QUIET)


def _assert_same_snapshot(got_dir, want_dir, same_snapshots) -> dict:
    a, b = checkpoint.latest_snapshot(want_dir), checkpoint.latest_snapshot(got_dir)
    assert a.name == b.name == f"step_{48:012d}"
    # floats within 1e-6; the carry's images and flags, generator states, counters exact
    meta_a, meta_b, worst = same_snapshots(a, b)
    assert meta_b["env_rng"] == meta_a["env_rng"]  # the reset seeds' stream, every rank's the single process's
    for x, y in zip(meta_a["env_state"]["envs"], meta_b["env_state"]["envs"]):  # the envs' states, in env order
        assert x["elapsed_steps"] == y["elapsed_steps"] and x["rng"] == y["rng"]
        np.testing.assert_allclose(y["state"], x["state"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(meta_b["env_state"]["episode_return"], meta_a["env_state"]["episode_return"], rtol=1e-5)
    print(got_dir.name, f"max |difference| of a parameter: {worst:.1e}")
    return meta_b


def test_a_two_rank_run_is_the_single_process_run_and_resumes_in_one_process(gloo, tmp_path, same_snapshots):
    """2 iterations through rlfunc.run.train: on 2 ranks (1 iteration, then resumed on the same 2
    ranks to 2), and that run's 1-iteration snapshot resumed in one process, both end in the single
    process's snapshot (floats within 1e-6, the rest exact); rank 0 alone writes, and its metrics
    lines count every rank's episodes."""
    from rlfunc.run import train

    gloo(_rank_run, str(tmp_path / "dp"), str(tmp_path / "dp_after_1"))
    _run(tmp_path / "single", 2)
    train(None, tmp_path / "dp_after_1", resume=True, total_steps=48, evaluate=False, **QUIET)
    assert _assert_same_snapshot(tmp_path / "dp", tmp_path / "single", same_snapshots)["world_size"] == 2
    assert _assert_same_snapshot(tmp_path / "dp_after_1", tmp_path / "single", same_snapshots)["world_size"] == 1
    records = [json.loads(line) for line in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]  # one writer, the resume appending
    for got, w in zip(records, want):
        assert got["step"] == w["step"] and got["episodes"] == w["episodes"] > 0
        assert got["approx_kl"] == pytest.approx(w["approx_kl"], rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------ config errors


def test_data_parallel_config_errors_name_the_argument():
    assert _config(nproc=2).run.nproc == 2  # accepted: ppo-encoder is data-parallel
    with pytest.raises(ConfigError, match=r"^num_envs=4 does not divide by the 3 ranks"):
        _config(nproc=3)
    with pytest.raises(ConfigError, match=r"^minibatch_size=6 does not divide by the 4 ranks"):
        _config(nproc=4, num_envs=8, num_steps=3, minibatch_size=6)
    with pytest.raises(ConfigError, match=r"^run.env_workers=4: each of the 2 ranks"):
        _config(nproc=2, env_workers=4)
    with pytest.raises(ConfigError, match=r"^run.compile='on' with nproc=2") as refused:
        _config(nproc=2, compile="on")
    assert "\n" not in str(refused.value)
    # auto with nproc > 1: eager (the compiled step is single-process), no error
    assert _config(nproc=2, compile="auto").run.compile == "auto"

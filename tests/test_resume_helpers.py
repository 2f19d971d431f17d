"""The shared resume machinery (rlfunc.run.resume) and the envs' public RNG / episode state."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rlfunc.errors import CheckpointError, ConfigError, EnvError
from rlfunc.run import checkpoint, resume


def test_point_reach_and_warehouse_rng_state_round_trips():
    from envs.point_reach import PointReachEnv
    from envs.warehouse import WarehouseConfig, WarehouseEnv

    small = WarehouseConfig(n_agents=2, layout=("P......D", "..#..#..", "P......D"), obs_radius=1, max_steps=6)
    for env, key in ((PointReachEnv(3, seed=1), "observation"), (WarehouseEnv(2, small, seed=1), ("agents", "observation"))):
        saved = env.rng_state()
        assert saved.dtype == torch.uint8 and saved.dim() == 1
        first = env.reset()[key]
        second = env.reset()[key]
        assert not torch.equal(first, second)  # the generator moved on
        env.set_rng_state(saved)
        assert torch.equal(env.reset()[key], first)
        with pytest.raises(EnvError, match="uint8 tensor of rng_state"):
            env.set_rng_state(saved.float())
        with pytest.raises(EnvError, match="uint8 tensor of rng_state"):
            env.set_rng_state(saved.tolist())


def test_chunk_env_rng_and_episode_state_continue_episodes_exactly():
    from rlfunc.envs.chunk import GymChunkEnv

    env = GymChunkEnv("Pendulum-v1", 2, seed=3)
    try:
        saved_rng = env.rng_state()
        first = env.reset()["observation"]
        env.set_rng_state(json.loads(json.dumps(saved_rng)))  # JSON-able, as in meta.json
        assert torch.equal(env.reset()["observation"], first)
        actions = torch.linspace(-1, 1, 10).reshape(5, 2, 1)
        for a in actions[:2]:
            env.step(_td(env, a))
        episode = json.loads(json.dumps(env.episode_state()))
        rng = env.rng_state()
        after = [env.step(_td(env, a))["next"] for a in actions[2:]]
        env.set_rng_state(rng)
        env.set_episode_state(episode)
        again = [env.step(_td(env, a))["next"] for a in actions[2:]]
        for x, y in zip(after, again):
            assert torch.equal(x["observation"], y["observation"]) and torch.equal(x["reward"], y["reward"])
            assert torch.equal(x["episode_return"], y["episode_return"])
        with pytest.raises(EnvError, match="state: not a PCG64 state"):
            env.set_rng_state({"bit_generator": "MT19937"})
        with pytest.raises(EnvError, match="not an episode_state"):
            env.set_episode_state({**episode, "envs": episode["envs"][:1]})
    finally:
        env.close()


def _td(env, action):
    from tensordict import TensorDict

    return TensorDict({"action": action}, batch_size=env.batch_size)


@dataclasses.dataclass(frozen=True)
class _Config:
    total_steps: int = 40
    steps_per_iteration: int = 10

    @property
    def num_iterations(self) -> int:
        return -(-self.total_steps // self.steps_per_iteration)


def _snapshot(run_dir, meta: dict) -> None:
    from tensordict import TensorDict

    state = TensorDict({"x": torch.zeros(1)}, batch_size=[])
    checkpoint.save_run_snapshot(run_dir, state, {"algo": "toy", "config": {"total_steps": 40}, **meta}, step=20)


def _from_meta(meta, snap):
    return _Config(**meta["config"])


def test_resume_point_sets_the_budget_and_refuses_bad_ones(tmp_path):
    _snapshot(tmp_path, {"iteration": 2, "env_steps": 20, "resume_format": resume.RESUME_FORMAT})
    point = resume.resume_point(tmp_path, None, _from_meta)
    assert point.config == _Config() and point.meta["iteration"] == 2
    assert resume.resume_point(tmp_path, 80, _from_meta).config.total_steps == 80
    assert resume.resume_point(tmp_path, 11, _from_meta).config.num_iterations == 2  # as many as done: accepted
    with pytest.raises(ConfigError, match=r"total_steps=10: the run has already done 2 iterations \(20 env steps\)"):
        resume.resume_point(tmp_path, 10, _from_meta)
    with pytest.raises(ConfigError, match="total_steps=0: expected an int >= 1"):
        resume.resume_point(tmp_path, 0, _from_meta)
    with pytest.raises(CheckpointError, match="no snapshot to resume from"):
        resume.resume_point(tmp_path / "none", None, _from_meta)
    _snapshot(tmp_path / "old", {"iteration": 2})
    with pytest.raises(CheckpointError, match="written before toy runs were resumable"):
        resume.resume_point(tmp_path / "old", None, _from_meta)
    assert resume.resume_point(tmp_path / "old", None, _from_meta, require_format=False).meta["iteration"] == 2
    _snapshot(tmp_path / "bad", {"iteration": -1, "resume_format": resume.RESUME_FORMAT})
    with pytest.raises(CheckpointError, match="iteration=-1"):
        resume.resume_point(tmp_path / "bad", None, _from_meta)
    # a new run: no budget override, and a config of the expected type
    with pytest.raises(ConfigError, match="resume=True"):
        resume.begin_run(tmp_path / "new", _Config(), _Config, resume=False, total_steps=5, from_meta=_from_meta)
    with pytest.raises(ConfigError, match="config=None: expected a _Config"):
        resume.begin_run(tmp_path / "new", None, _Config, resume=False, total_steps=None, from_meta=_from_meta)
    with pytest.raises(ConfigError, match="already holds a run"):
        resume.begin_run(tmp_path, _Config(), _Config, resume=False, total_steps=None, from_meta=_from_meta)


def test_optimizer_like_and_leaves_follow_the_optimizer():
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = torch.optim.Adam([a, b], lr=0.1)
    assert resume.optimizer_leaves(opt) == []
    b.sum().backward()
    opt.step()
    assert resume.optimizer_leaves(opt) == [1]
    like = resume.optimizer_like(opt, [1], "snap")
    assert like["1", "exp_avg"].shape == (3,) and list(like.keys()) == ["1"]
    with pytest.raises(CheckpointError, match="snap: meta optim_leaves=\\[2\\]"):
        resume.optimizer_like(opt, [2], "snap")


def test_truncate_metrics_drops_lines_past_the_snapshot(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "time": 1.5 * i}) + "\n" for i in (1, 2, 3)))
    assert resume.truncate_metrics(tmp_path, 2) == 3.0
    assert [json.loads(x)["iteration"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert resume.truncate_metrics(tmp_path / "none", 2) == 0.0

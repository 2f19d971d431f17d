"""The shared resume machinery (rlfunc.run.resume) and the envs' public RNG / episode state."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rlfunc.config import RunConfig
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
    run: RunConfig = dataclasses.field(default_factory=lambda: RunConfig(device="cpu"))

    @property
    def num_iterations(self) -> int:
        return -(-self.total_steps // self.steps_per_iteration)


def _snapshot(run_dir, meta: dict) -> None:
    from tensordict import TensorDict

    state = TensorDict({"x": torch.zeros(1)}, batch_size=[])
    checkpoint.save_run_snapshot(run_dir, state, {"algo": "toy", "config": {"total_steps": 40}, **meta}, step=20)


class _ToyRun:
    """The smallest run the loop drives (rlfunc.run.Run's protocol): one tensor, no env."""

    def __init__(self, config: _Config, device, *, requires_format: bool = True) -> None:
        from rlfunc.run import Run
        from tensordict import TensorDict

        class Toy(Run):
            name = "toy"

            def step(self, i, stopping):
                self.state["iteration"] += 1
                return {"iteration": i, "step": i * config.steps_per_iteration}

            def saved(self):
                meta = {"algo": "toy", "config": dataclasses.asdict(config), "iteration": int(self.state["iteration"]),
                        "env_steps": int(self.state["iteration"]) * config.steps_per_iteration,
                        "resume_format": resume.RESUME_FORMAT, "state_layout": resume.STATE_LAYOUT}
                return TensorDict({"x": self.state["x"]}, batch_size=[]), meta

            def upgrade(self, loaded, meta, where):  # _snapshot writes no state_layout: nothing to convert
                return loaded

            def restore(self, loaded, meta):
                self.state["x"] = loaded["x"]
                self.state["iteration"] = torch.tensor(meta["iteration"])

        self.run = Toy()
        self.run.config, self.run.total, self.run.requires_format = config, config.num_iterations, requires_format
        self.run.state = TensorDict({"x": torch.zeros(1), "iteration": torch.tensor(0)}, batch_size=[])


_TOY = {"requires_format": True, "built": []}


def _build_toy(config, device, *, dist=None, resumed=False):
    _TOY["built"].append(config)
    return _ToyRun(config, device, requires_format=_TOY["requires_format"]).run


def _train(run_dir, config=None, *, resume_=True, total_steps=None, requires_format=True):
    """rlfunc.run.train of a _ToyRun (registered as "toy" for the call), stopped before any iteration (a
    resume) or after one;
    returns the config it built."""
    from rlfunc.algos import registry
    from rlfunc.run import train

    registry.names()  # the built-in entries, loaded before the copy
    saved = dict(registry._ENTRIES)
    registry.register("toy", registry.AlgorithmEntry(config=f"{__name__}:_Config", run=f"{__name__}:_build_toy", command="",
                                                     evaluate="", needs="nothing", usage=""))
    _TOY.update(requires_format=requires_format, built=[])
    try:
        train(config, run_dir, resume=resume_, total_steps=total_steps, max_iterations=0 if resume_ else 1, progress=False,
              tensorboard=False)
    finally:
        registry._ENTRIES.clear()
        registry._ENTRIES.update(saved)
    return _TOY["built"][-1]


def test_resume_sets_the_budget_and_refuses_bad_ones(tmp_path):
    # what rlfunc.run.train checks before a run (new or resumed) is built (was resume.resume_point /
    # begin_run, before the one run loop)
    _snapshot(tmp_path, {"iteration": 2, "env_steps": 20, "resume_format": resume.RESUME_FORMAT})
    assert _train(tmp_path) == _Config()
    assert _train(tmp_path, total_steps=80).total_steps == 80
    assert _train(tmp_path, total_steps=11).num_iterations == 2  # as many as done: accepted
    with pytest.raises(ConfigError, match=r"total_steps=10: the run has already done 2 iterations \(20 env steps\)"):
        _train(tmp_path, total_steps=10)
    with pytest.raises(ConfigError, match="total_steps=0: expected an int >= 1"):
        _train(tmp_path, total_steps=0)
    with pytest.raises(CheckpointError, match="no snapshot to resume from"):
        _train(tmp_path / "none")
    _snapshot(tmp_path / "old", {"iteration": 2})
    with pytest.raises(CheckpointError, match="written before toy runs were resumable"):
        _train(tmp_path / "old")
    assert _train(tmp_path / "old", requires_format=False) == _Config()
    _snapshot(tmp_path / "bad", {"iteration": -1, "resume_format": resume.RESUME_FORMAT})
    with pytest.raises(CheckpointError, match="iteration=-1"):
        _train(tmp_path / "bad")
    # a new run: no budget override, and a config of the expected type
    with pytest.raises(ConfigError, match="resume=True"):
        _train(tmp_path / "new", _Config(), resume_=False, total_steps=5)
    with pytest.raises(ConfigError, match="config=None: expected a registered algorithm's config"):
        _train(tmp_path / "new", None, resume_=False)
    with pytest.raises(ConfigError, match="already holds a run"):
        _train(tmp_path, _Config(), resume_=False)


def test_truncate_metrics_drops_lines_past_the_snapshot(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "time": 1.5 * i}) + "\n" for i in (1, 2, 3)))
    assert resume.truncate_metrics(tmp_path, 2) == 3.0
    assert [json.loads(x)["iteration"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert resume.truncate_metrics(tmp_path / "none", 2) == 0.0


def test_garbage_in_the_run_dir_is_skipped_or_named_not_a_traceback(tmp_path):
    """New-user pass: binary garbage appended to metrics.jsonl was a UnicodeDecodeError traceback in
    `rlfunc resume`, eval.json made a directory an IsADirectoryError."""
    lines = "".join(json.dumps({"iteration": i, "time": 1.5 * i}) + "\n" for i in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_bytes(lines.encode() + b"\x00\xff garbage\n[1, 2]\n5\n" + b'{"iteration": "x"}\n')
    assert resume.truncate_metrics(tmp_path, 2) == 3.0
    assert [json.loads(x)["iteration"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    resume.check_run_dir(tmp_path, True)
    (tmp_path / "eval.json").mkdir()
    with pytest.raises(ConfigError, match=r"eval.json: expected a file, found a directory or another kind; move it away$"):
        resume.check_run_dir(tmp_path, True)

"""grpo/gspo and mappo snapshots of state layout 1 (torch.optim's state saved as "optim" beside
"learner", meta "optim_leaves" naming the leaves it holds state for, as rlfunc wrote them up to commit
d98cef6): converted on load, or refused with one line (exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlfunc.config import replace
from rlfunc.algos.grpo import GRPOConfig
from rlfunc.algos.mappo import MAPPOConfig
from rlfunc.cli.commands import main
from rlfunc.run import checkpoint
from rlfunc import resume, train

DATA = Path(__file__).parents[1] / "data"  # runs written by rlfunc at commit d98cef6 (their READMEs)
SMALL_LAYOUT = ("P......D", "..#..#..", "P......D")  # tests/run/test_resume_group.py's small warehouse
TIMING = {"time", "steps_per_s", "collect_s", "update_s"}


@pytest.fixture
def small_warehouse(monkeypatch):
    from envs import registry_entries
    from envs.warehouse import WarehouseConfig
    from rlfunc.run import mappo as tm

    small = WarehouseConfig(n_agents=2, layout=SMALL_LAYOUT, obs_radius=1, max_steps=6, shaping_scale=0.1)
    monkeypatch.setattr(registry_entries, "warehouse_config", lambda config, train: small)
    return tm


def _copy(name: str, tmp_path: Path) -> Path:
    run = tmp_path / name
    shutil.copytree(DATA / name, run, ignore=shutil.ignore_patterns("README.md"))
    return run


def _keys(params: TensorDict) -> list:
    return sorted(params.keys(include_nested=True, leaves_only=True), key=str)  # func.leaves order


def _as_layout_1(snap: Path) -> None:
    """Rewrite a layout-2 snapshot into layout 1: "optim" = torch.optim.Adam's state, {"<i>": {"step",
    "exp_avg", "exp_avg_sq"}} for the leaves that have stepped, in func.leaves order, listed in meta
    "optim_leaves"; no "state_layout"."""
    state, meta = checkpoint.load_snapshot(snap)
    adam = state["optim", "1"]
    keys = _keys(state["learner", "params"])
    for k in keys:  # several seeds: one count per seed now ([S], equal in these runs); torch.optim kept one (0-dim)
        adam["step"].set(k, adam["step"].get(k).reshape(-1)[0].clone())
    stepped = [i for i, k in enumerate(keys) if float(adam["step"].get(k)) > 0]
    optim = TensorDict({str(i): {n: adam[n].get(keys[i]) for n in ("step", "exp_avg", "exp_avg_sq")} for i in stepped},
                       batch_size=[])
    meta = {**{k: v for k, v in meta.items() if k != "state_layout"}, "optim_leaves": stepped}
    checkpoint.save_snapshot(snap, TensorDict({**state.exclude("optim").to_dict(), "optim": optim}, batch_size=[]), meta)


def _crash_copy(full: Path, dest: Path, steps: int) -> Path:
    shutil.copytree(full, dest)
    for path in (dest / "checkpoints").glob("step_*"):
        if int(path.name[5:]) > steps:
            shutil.rmtree(path)
    (dest / "eval.json").unlink()
    return dest


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _assert_same(full, resumed, full_dir, resumed_dir):
    a, b = dict(full.state.items(True, True)), dict(resumed.state.items(True, True))
    assert a.keys() == b.keys() and any(k[0] == "optim" for k in a if isinstance(k, tuple))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _metrics(full_dir) == _metrics(resumed_dir)
    assert resumed.evaluation == full.evaluation
    assert checkpoint.load_meta(checkpoint.latest_snapshot(resumed_dir))["state_layout"] == 2  # new ones are layout 2


def _grpo_config(iterations: int, **kw) -> GRPOConfig:
    base = dict(env="PointReach-v0", num_groups=2, group_size=4, minibatch_size=4, max_episode_steps=30, num_epochs=2,
                eval_episodes=2, seed=5, device="cpu", kl_coef=0.1, keep_checkpoints=0, hidden=(8, 8), checkpoint_every=2, **kw)
    return replace(GRPOConfig(), **{**base, "total_steps": iterations * replace(GRPOConfig(), **base).steps_per_iteration})


def _mappo_config(loss: str, iterations: int, **kw) -> MAPPOConfig:
    base = dict(loss=loss, n_agents=2, num_envs=4, rollout_steps=8, group_size=2, episode_steps=6, hidden=(8,),
                num_epochs=2, num_minibatches=2, eval_episodes=1, eval_seeds=(0,), device="cpu", seed=3, checkpoint_every=2, **kw)
    return replace(MAPPOConfig(), **{**base, "total_steps": iterations * replace(MAPPOConfig(), **base).steps_per_iteration})


@pytest.mark.parametrize("num_seeds", [1, 2])
def test_a_grpo_snapshot_of_layout_1_resumes_exactly(tmp_path, num_seeds):
    from rlfunc import resume, train

    config = _grpo_config(4, num_seeds=num_seeds)
    full = train(config, tmp_path / "full", progress=False, tensorboard=False)
    part = _crash_copy(tmp_path / "full", tmp_path / "part", 2 * config.steps_per_iteration)
    _as_layout_1(checkpoint.latest_snapshot(part))
    resumed = resume(part, progress=False, tensorboard=False)
    _assert_same(full, resumed, tmp_path / "full", part)


@pytest.mark.parametrize("loss", ["ppo", "grpo"])  # grpo: the critic has no torch.optim state (no gradient)
def test_a_mappo_snapshot_of_layout_1_resumes_exactly(tmp_path, small_warehouse, loss):
    tm = small_warehouse
    config = _mappo_config(loss, 4, critic="mean")
    full = train(config, tmp_path / "full", progress=False, tensorboard=False)
    part = _crash_copy(tmp_path / "full", tmp_path / "part", 2 * config.steps_per_iteration)
    snap = checkpoint.latest_snapshot(part)
    _as_layout_1(snap)
    assert checkpoint.load_meta(snap)["optim_leaves"] == (list(range(8)) if loss == "ppo" else [0, 1, 2, 3])
    resumed = resume(part, progress=False, tensorboard=False)
    _assert_same(full, resumed, tmp_path / "full", part)


def test_a_grpo_run_written_by_the_old_code_resumes_and_evaluates(tmp_path):
    from rlfunc import resume
    from rlfunc.run.grpo import evaluate_run

    run = _copy("grpo_state_layout_1", tmp_path)
    saved, meta = checkpoint.load_snapshot(checkpoint.latest_snapshot(run))
    assert "state_layout" not in meta and meta["optim_leaves"] == list(range(7))
    result = evaluate_run(run, 2)
    assert result["env_steps"] == 240 and torch.isfinite(torch.tensor(result["mean"]))
    resumed = resume(run, total_steps=3 * 120, progress=False, tensorboard=False)
    assert int(resumed.state["iteration"]) == 3
    # Adam's state went from torch.optim's numbered entries into the learner, leaf for leaf: the
    # resumed iteration took 4 more steps of each (2 epochs of 2 minibatches)
    adam = resumed.state["optim", "1"]
    for i, key in enumerate(_keys(resumed.state["params"])):
        assert float(adam["step"].get(key)) == float(saved["optim", str(i), "step"]) + 4
    assert [r["iteration"] for r in _metrics(run)] == [1, 2, 3]
    assert resumed.evaluation is not None


def test_a_mappo_run_written_by_the_old_code_resumes_and_evaluates(tmp_path, small_warehouse):
    tm = small_warehouse
    run = _copy("mappo_state_layout_1", tmp_path)
    saved, meta = checkpoint.load_snapshot(checkpoint.latest_snapshot(run))
    assert "state_layout" not in meta and meta["optim_leaves"] == [0, 1, 2, 3]  # the actor's; the critic is unused
    result = tm.evaluate_run(run)
    assert result["env"] == "Warehouse-v0" and result["n_agents"] == 2
    resumed = resume(run, total_steps=3 * 24, progress=False, tensorboard=False)
    assert int(resumed.state["iteration"]) == 3
    adam = resumed.state["optim", "1"]
    keys = _keys(resumed.state["params"])
    for i, key in enumerate(keys):
        if i < 4:  # the actor: torch.optim's steps, 4 more (2 epochs of 2 minibatches)
            assert float(adam["step"].get(key)) == float(saved["optim", str(i), "step"]) + 4
        else:  # the critic: no state before, none now, and its parameters where they were
            assert float(adam["step"].get(key)) == 0 and not adam["exp_avg"].get(key).any()
            assert torch.equal(resumed.state["params"].get(key), saved["learner", "params"].get(key))
    assert [r["iteration"] for r in _metrics(run)] == [1, 2, 3]


@pytest.mark.parametrize("name", ["grpo_state_layout_1", "mappo_state_layout_1"])
def test_a_layout_1_optimizer_state_that_does_not_fit_is_refused_in_one_line(tmp_path, capsys, small_warehouse, name):
    run = _copy(name, tmp_path)
    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    del state["optim", "3"]  # one leaf's Adam state missing
    checkpoint.save_snapshot(snap, state, meta)
    before = (run / "metrics.jsonl").read_text()
    assert main(["resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "state layout 1" in err[0] and "torch.optim entries for" in err[0] and "d98cef6" in err[0]
    assert (run / "metrics.jsonl").read_text() == before  # nothing written
    del state["optim"]
    checkpoint.save_snapshot(snap, state, meta)
    assert main(["resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no optimizer state" in err[0]


@pytest.mark.parametrize("name", ["grpo_state_layout_1", "mappo_state_layout_1"])
def test_an_unknown_state_layout_is_refused_in_one_line(tmp_path, capsys, small_warehouse, name):
    run = _copy(name, tmp_path)
    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    checkpoint.save_snapshot(snap, state, {**meta, "state_layout": 3})
    for command in (["resume", str(run)], ["eval", str(run)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "state_layout=3" in err[0] and "newer rlfunc" in err[0]

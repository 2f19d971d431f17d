"""PPO snapshots of state layout 1 (torch.optim's state saved as "optim" beside "learner", as rlfunc
wrote them before the optimizer's state moved into the learner): converted on load, or refused with
one line (exit 2)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlfunc.algos.ppo import preset
from rlfunc.cli.commands import main
from rlfunc.core import func
from rlfunc.run import checkpoint
from rlfunc.run import train
from rlfunc.run.ppo import evaluate

FIXTURE = Path(__file__).parents[1] / "data" / "ppo_state_layout_1"  # written by rlfunc at commit c0e6595 (its README)
TINY = dict(num_envs=2, num_steps=64, minibatch_size=64, num_epochs=2, checkpoint_every=1, device="cpu", version_every=0)


def _leaves(state):
    return {k: v.detach().clone() for k, v in state.items(include_nested=True, leaves_only=True)}


def _copy_fixture(tmp_path: Path) -> Path:
    run = tmp_path / "old"
    shutil.copytree(FIXTURE, run, ignore=shutil.ignore_patterns("README.md"))
    return run


def _as_layout_1(snap: Path) -> None:
    """Rewrite a snapshot into layout 1: "optim" = torch.optim.Adam's state, {"<i>": {"step",
    "exp_avg", "exp_avg_sq"}} over the parameter leaves in func.leaves order; no "state_layout"."""
    state, meta = checkpoint.load_snapshot(snap)
    learner = state["learner"]
    adam = learner.pop("optim")["1"]
    keys = sorted(learner["params"].keys(include_nested=True, leaves_only=True), key=str)
    optim = TensorDict({str(i): {name: adam[name].get(k) for name in ("step", "exp_avg", "exp_avg_sq")} for i, k in enumerate(keys)},
                       batch_size=[])
    meta = {k: v for k, v in meta.items() if k != "state_layout"}
    checkpoint.save_snapshot(snap, TensorDict({**state.to_dict(), "optim": optim}, batch_size=[]), meta)


def test_a_snapshot_of_layout_1_resumes_exactly(tmp_path):
    config = preset("Pendulum-v1", total_steps=4 * 128, **TINY)
    full = train(config, tmp_path / "full", progress=False, tensorboard=False, evaluate=False)
    train(config, tmp_path / "part", max_iterations=2, progress=False, tensorboard=False, evaluate=False)
    snap = checkpoint.latest_snapshot(tmp_path / "part")
    _as_layout_1(snap)
    assert "state_layout" not in checkpoint.load_meta(snap)
    resumed = train(config, tmp_path / "part", resume=True, progress=False, tensorboard=False, evaluate=False)
    a, b = _leaves(full.state), _leaves(resumed.state)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert checkpoint.load_meta(checkpoint.latest_snapshot(tmp_path / "part"))["state_layout"] == 2  # new ones are layout 2


def test_a_run_written_by_the_old_code_resumes_and_evaluates(tmp_path):
    run = _copy_fixture(tmp_path)
    snap = checkpoint.latest_snapshot(run)
    saved, _ = checkpoint.load_snapshot(snap)
    assert "optim" in saved.keys() and "optim" not in saved["learner"].keys()
    result = evaluate(run, episodes=2)
    assert result["env_steps"] == 256 and torch.isfinite(torch.tensor(result["mean"]))
    resumed = train(preset("Pendulum-v1"), run, resume=True, progress=False, tensorboard=False, evaluate=False)
    assert int(resumed.state["iteration"]) == 3
    # Adam's state went from torch.optim's numbered entries into the learner, leaf for leaf: the
    # resumed iteration took one more step of each
    params = func.leaves(resumed.state["params"])
    keys = sorted(resumed.state["params"].keys(include_nested=True, leaves_only=True), key=str)
    assert len(keys) == len(params) == len(saved["optim"].keys())
    for i, key in enumerate(keys):
        assert float(resumed.state["optim", "1", "step"].get(key)) == float(saved["optim", str(i), "step"]) + 4  # 2 epochs of 2 minibatches
    assert all(torch.isfinite(v).all() for v in _leaves(resumed.state).values() if v.is_floating_point())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]


def test_a_layout_1_optimizer_state_that_does_not_fit_is_refused_in_one_line(tmp_path, capsys):
    run = _copy_fixture(tmp_path)
    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    del state["optim", "12"]  # one leaf's Adam state missing
    checkpoint.save_snapshot(snap, state, meta)
    before = (run / "metrics.jsonl").read_text()
    assert main(["resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "state layout 1" in err[0] and "12 torch.optim entries for 13 parameter leaves" in err[0]
    assert (run / "metrics.jsonl").read_text() == before  # nothing written
    del state["optim"]
    checkpoint.save_snapshot(snap, state, meta)
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no optimizer state" in err[0]


def test_an_unknown_state_layout_is_refused_in_one_line(tmp_path, capsys):
    run = _copy_fixture(tmp_path)
    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    checkpoint.save_snapshot(snap, state, {**meta, "state_layout": 3})
    assert main(["resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "state_layout=3" in err[0]


@pytest.mark.parametrize("layout", [1, 2])
def test_eval_refuses_a_snapshot_of_another_structure(tmp_path, capsys, layout):
    # a layout-2 snapshot is checked against algo.init() by load_snapshot, a converted layout-1 one after conversion
    if layout == 1:
        run = _copy_fixture(tmp_path)
    else:
        run = tmp_path / "new"
        train(preset("Pendulum-v1", total_steps=128, hidden=(8, 8), **TINY), run, progress=False, tensorboard=False, evaluate=False)
    snap = checkpoint.latest_snapshot(run)
    record = json.loads((snap / "meta.json").read_text())
    record["meta"]["config"]["hidden"] = [16, 16]
    if "record_sha256" in record:  # re-signed: the config check itself must refuse it
        record["record_sha256"] = checkpoint.record_digest(record)
    (snap / "meta.json").write_text(json.dumps(record))
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(snap) in err[0]


def _layout_1(state: TensorDict) -> TensorDict:
    learner = state["learner"].clone(recurse=False)
    adam = learner.pop("optim")["1"]
    keys = sorted(learner["params"].keys(include_nested=True, leaves_only=True), key=str)
    optim = {str(i): {name: adam[name].get(k) for name in ("step", "exp_avg", "exp_avg_sq")} for i, k in enumerate(keys)}
    return TensorDict({**state.exclude("learner").to_dict(), "learner": learner, "optim": optim}, batch_size=[])


def test_a_version_of_layout_1_resumes_exactly_after_a_rollback(tmp_path):
    from rlfunc.run import versions

    config = preset("Pendulum-v1", total_steps=4 * 128, **dict(TINY, version_every=1))
    full = train(config, tmp_path / "full", progress=False, tensorboard=False, evaluate=False)
    run = tmp_path / "run"
    train(config, run, max_iterations=2, progress=False, tensorboard=False, evaluate=False)
    state, manifest = versions.load_version(run, "v000002")
    meta = {k: v for k, v in manifest["meta"].items() if k != "state_layout"}
    old = versions.save_version(run, _layout_1(state), meta, iteration=manifest["iteration"], step=manifest["step"],
                                metrics=manifest["metrics"])
    assert main(["versions", "rollback", str(run), old["id"]]) == 0
    resumed = train(config, run, resume=True, progress=False, tensorboard=False, evaluate=False)
    a, b = _leaves(full.state), _leaves(resumed.state)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _as_shared_counts(snap: Path) -> None:
    """Rewrite a snapshot's per-seed step counts ([S]: Adam's with several seeds, oscillation
    damping's) into one 0-dim count, as rlfunc wrote them before the counts were per seed."""
    from rlfunc.run.resume import _member_count_paths

    state, meta = checkpoint.load_snapshot(snap)
    paths = _member_count_paths(state)
    assert paths
    for path in paths:
        state.set(path, state.get(path)[0].clone())
    checkpoint.save_snapshot(snap, state, meta)


@pytest.mark.parametrize("extra", [{"num_seeds": 2}, {"oscillation_damping": True}, {"num_seeds": 2, "layout_1": True}])
def test_a_snapshot_with_one_step_count_for_all_seeds_resumes_exactly_and_evaluates(tmp_path, extra):
    # Snapshots written before the step counts were per seed (adam(member_dims=1), oscillation damping's
    # "count") hold one 0-dim count: it is given to every seed on load (the seeds' counts were equal
    # then unless target_kl stopped them apart), so such a run resumes as the one that never stopped.
    extra = dict(extra)
    layout_1 = extra.pop("layout_1", False)
    config = preset("Pendulum-v1", total_steps=4 * 128, **TINY, **extra)
    full = train(config, tmp_path / "full", progress=False, tensorboard=False, evaluate=False)
    train(config, tmp_path / "part", max_iterations=2, progress=False, tensorboard=False, evaluate=False)
    snap = checkpoint.latest_snapshot(tmp_path / "part")
    _as_shared_counts(snap)
    if layout_1:
        _as_layout_1(snap)
    assert evaluate(tmp_path / "part", episodes=2)["env_steps"] == 256
    resumed = train(config, tmp_path / "part", resume=True, progress=False, tensorboard=False, evaluate=False)
    a, b = _leaves(full.state), _leaves(resumed.state)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key

"""Resume of multi-agent (mappo) and GRPO/GSPO runs: exact on CPU.

The property: 2N iterations in one go == N iterations, stop, resume for N more, tensor for tensor
(learner, Adam state, generators, env state, collection carry), with the same metrics lines. A stop
is made two ways: a crash after iteration N's snapshot (the later snapshot removed, metrics lines
past N dropped on resume; the LR schedule spans the whole run), and a run of N iterations extended
by ``total_steps`` to 2N (constant LR, so the schedules agree).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlfunc.config import replace
from rlfunc.algos.grpo import GRPOConfig
from rlfunc.algos.mappo import MAPPOConfig
from rlfunc.errors import CheckpointError, ConfigError
from rlfunc.run import checkpoint
from rlfunc import resume, train

SMALL_LAYOUT = (
    "P......D",
    "..#..#..",
    "P......D",
)
TIMING = {"time", "steps_per_s", "collect_s", "update_s"}  # wall-clock fields: differ between runs


@pytest.fixture
def small_warehouse(monkeypatch):
    """A 3 x 8 warehouse with 2 AGVs and 6-step episodes (so rollouts cross episode ends)."""
    from envs import registry_entries
    from envs.warehouse import WarehouseConfig
    from rlfunc.run import mappo as tm

    small = WarehouseConfig(n_agents=2, layout=SMALL_LAYOUT, obs_radius=1, max_steps=6, shaping_scale=0.1)
    monkeypatch.setattr(registry_entries, "warehouse_config", lambda config, train: small)
    return tm


def _mappo_config(loss: str, iterations: int, **kw) -> MAPPOConfig:
    base = dict(loss=loss, n_agents=2, num_envs=4, rollout_steps=8, group_size=2, episode_steps=6, hidden=(8,),
                num_epochs=2, num_minibatches=2, eval_episodes=1, eval_seeds=(0,), device="cpu", seed=3)
    base.update(kw)
    spi = replace(MAPPOConfig(), **base).steps_per_iteration
    return replace(MAPPOConfig(), **{**base, "total_steps": iterations * spi})


def _grpo_config(env: str, iterations: int, **kw) -> GRPOConfig:
    if env == "PointReach-v0":
        base = dict(env=env, num_groups=2, group_size=4, minibatch_size=4, max_episode_steps=30)
    else:  # Pendulum-v1 through the gymnasium backend
        base = dict(env=env, num_groups=2, group_size=3, minibatch_size=3, max_episode_steps=5)
    base.update(num_epochs=2, eval_episodes=2, seed=5, device="cpu", kl_coef=0.1, keep_checkpoints=0, **kw)
    spi = replace(GRPOConfig(), **base).steps_per_iteration
    return replace(GRPOConfig(), **{**base, "total_steps": iterations * spi})


def _snapshot_tensors(run_dir) -> dict[str, torch.Tensor]:
    state, _ = checkpoint.load_snapshot(checkpoint.latest_snapshot(run_dir))
    return {k if isinstance(k, str) else ".".join(k): v for k, v in state.items(True, True)}


def _metrics(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _assert_same_run(full_dir, resumed_dir, full_state, resumed_state, iterations: int) -> None:
    """Final learner state and every tensor of the final snapshots equal; same metrics lines."""
    assert int(resumed_state["iteration"]) == iterations
    a, b = dict(full_state.items(True, True)), dict(resumed_state.items(True, True))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    sa, sb = _snapshot_tensors(full_dir), _snapshot_tensors(resumed_dir)
    assert sa.keys() == sb.keys() and any(k.startswith("optim.") for k in sa)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    ma, mb = _metrics(full_dir), _metrics(resumed_dir)
    assert [r["iteration"] for r in mb] == list(range(1, iterations + 1))
    assert ma == mb


def _crash_copy(full_dir, dest, keep_iteration_steps: int):
    """A copy of a finished run as a crash after the snapshot at ``keep_iteration_steps`` env steps
    would leave it: later snapshots gone, metrics lines (and eval.json) of later iterations still there."""
    shutil.copytree(full_dir, dest)
    for path in (dest / "checkpoints").glob("step_*"):
        if int(path.name[5:]) > keep_iteration_steps:
            shutil.rmtree(path)
    (dest / "eval.json").unlink()
    assert checkpoint.load_meta(checkpoint.latest_snapshot(dest))["env_steps"] == keep_iteration_steps
    return dest


@pytest.mark.parametrize("loss", ["ppo", "grpo"])
def test_mappo_resume_after_a_crash_is_exact(tmp_path, small_warehouse, loss):
    tm = small_warehouse
    config = _mappo_config(loss, 4, checkpoint_every=2)
    full = train(config, tmp_path / "full", progress=False, tensorboard=False)
    part = _crash_copy(tmp_path / "full", tmp_path / "part", 2 * config.steps_per_iteration)
    snap = _snapshot_tensors(part)
    assert {"rng", "carry.running", "env.rng", "env.state.position", "carry.env.agents.observation"} <= snap.keys()
    resumed = resume(part, progress=False, tensorboard=False)
    _assert_same_run(tmp_path / "full", part, full.state, resumed.state, 4)
    assert resumed.evaluation == full.evaluation
    assert json.loads((part / "eval.json").read_text()) == full.evaluation


def test_mappo_resume_extends_with_total_steps(tmp_path, small_warehouse):
    tm = small_warehouse
    full_config = _mappo_config("ppo", 4, anneal_lr=False, critic="mean")
    short_config = _mappo_config("ppo", 2, anneal_lr=False, critic="mean")
    full = train(full_config, tmp_path / "full", progress=False, tensorboard=False)
    short = train(short_config, tmp_path / "part", progress=False, tensorboard=False)
    assert int(short.state["iteration"]) == 2
    with pytest.raises(ConfigError, match="total_steps"):
        resume(tmp_path / "part", total_steps=0)
    with pytest.raises(ConfigError, match="fewer than the 2"):
        resume(tmp_path / "part", total_steps=short_config.steps_per_iteration)
    resumed = resume(tmp_path / "part", total_steps=full_config.total_steps, progress=False, tensorboard=False)
    assert int(resumed.state["env_steps"]) == full_config.total_steps
    _assert_same_run(tmp_path / "full", tmp_path / "part", full.state, resumed.state, 4)
    assert json.loads((tmp_path / "part" / "config.json").read_text())["total_steps"] == full_config.total_steps
    # a finished run resumed without a new budget trains nothing more and evaluates again
    again = resume(tmp_path / "part", progress=False, tensorboard=False)
    assert int(again.state["iteration"]) == 4 and again.evaluation == resumed.evaluation


@pytest.mark.parametrize("loss", ["ppo", "grpo"])
def test_mappo_rollback_to_a_version_resumes_exactly(tmp_path, small_warehouse, loss):
    """version_every=1 writes a version per iteration; after a rollback to v000002 a resume continues
    from it (not from the newer snapshot of the abandoned branch) and ends where the uninterrupted run did."""
    from rlfunc.run import versions

    tm = small_warehouse
    config = _mappo_config(loss, 4, version_every=1, critic="mean")
    run = tmp_path / "run"
    full = train(config, run, progress=False, tensorboard=False)  # the uninterrupted run
    assert [m["id"] for m in versions.list_versions(run)] == ["v000001", "v000002", "v000003", "v000004"]
    assert len(list((run / "checkpoints").glob("step_*"))) == 1  # checkpoint_every=0: the final snapshot only (versions have their own cadence)
    before = _metrics(run)
    assert versions.rollback(run, "v000002", branch="retry") == "retry"
    resumed = resume(run, progress=False, tensorboard=False)
    assert int(resumed.state["iteration"]) == 4
    a, b = dict(full.state.items(True, True)), dict(resumed.state.items(True, True))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    listed = versions.list_versions(run)
    assert [(m["id"], m["branch"], m["parent"]) for m in listed[4:]] == [
        ("v000005", "retry", "v000002"), ("v000006", "retry", "v000005")]
    assert listed[2]["tensors"] == listed[4]["tensors"] and listed[3]["tensors"] == listed[5]["tensors"]
    assert _metrics(run) == before and [r["iteration"] for r in before] == [1, 2, 3, 4]
    assert resumed.evaluation == full.evaluation


@pytest.mark.parametrize("env,loss", [("PointReach-v0", "grpo"), ("Pendulum-v1", "gspo")])
def test_grpo_resume_after_a_crash_is_exact(tmp_path, env, loss):
    from rlfunc import resume, train

    config = _grpo_config(env, 4, loss=loss, checkpoint_every=2)
    full = train(config, tmp_path / "full", progress=False, tensorboard=False)
    part = _crash_copy(tmp_path / "full", tmp_path / "part", 2 * config.steps_per_iteration)
    assert ("env.rng" in _snapshot_tensors(part)) == config.use_torch_env
    resumed = resume(part, progress=False, tensorboard=False)
    _assert_same_run(tmp_path / "full", part, full.state, resumed.state, 4)
    assert resumed.evaluation == full.evaluation


def test_grpo_resume_extends_with_total_steps(tmp_path):
    from rlfunc import resume, train

    full_config = _grpo_config("PointReach-v0", 4, anneal_lr=False, checkpoint_every=0)
    short_config = _grpo_config("PointReach-v0", 2, anneal_lr=False, checkpoint_every=0)
    full = train(full_config, tmp_path / "full", progress=False, tensorboard=False)
    train(short_config, tmp_path / "part", progress=False, tensorboard=False)
    resumed = resume(tmp_path / "part", total_steps=full_config.total_steps, progress=False, tensorboard=False)
    _assert_same_run(tmp_path / "full", tmp_path / "part", full.state, resumed.state, 4)
    # flags pass: `rlfunc eval --seed -2000000` of a grpo run was numpy's traceback; -5 and 1e11 evaluated
    from rlfunc.run.grpo import evaluate_run

    for seed in (-5, -2_000_000, 99_999_999_999):
        with pytest.raises(ConfigError, match=rf"seed={seed}: expected an integer in \[0, 2\*\*31\)"):
            evaluate_run(tmp_path / "full", 2, seed=seed, device="cpu")


def test_resume_without_a_snapshot_names_the_run_dir(tmp_path, small_warehouse):
    from rlfunc import resume, train

    empty = tmp_path / "empty-run"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="empty-run: no snapshot"):
        resume(empty)
    with pytest.raises(CheckpointError, match="missing-run: no snapshot"):
        resume(tmp_path / "missing-run")
    with pytest.raises(ConfigError, match="total_steps"):
        train(_grpo_config("PointReach-v0", 1), tmp_path / "new", total_steps=100)
    # a corrupt snapshot is refused by its checksum
    train(_grpo_config("PointReach-v0", 1), tmp_path / "g", progress=False, tensorboard=False)
    # a snapshot from before resume support (no resume_format in its meta) is refused by name
    snap = checkpoint.latest_snapshot(tmp_path / "g")
    state, meta = checkpoint.load_snapshot(snap)
    checkpoint.save_snapshot(snap, state, {k: v for k, v in meta.items() if k != "resume_format"})
    with pytest.raises(CheckpointError, match="before grpo runs were resumable"):
        resume(tmp_path / "g")
    checkpoint.save_snapshot(snap, state, meta)
    state_file = snap / "state.safetensors"
    state_file.write_bytes(state_file.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        resume(tmp_path / "g", total_steps=10_000)


def test_mappo_rware_resume_warns_and_starts_new_episodes(tmp_path):
    pytest.importorskip("rware")
    from rlfunc import resume, train

    config = replace(MAPPOConfig(), env="rware-tiny-2ag-v2", loss="ppo", num_envs=1, rollout_steps=5, total_steps=10, hidden=(8,),
                         num_epochs=1, num_minibatches=1, eval_episodes=1, eval_seeds=(0,), device="cpu")
    train(config, tmp_path / "run", progress=False, tensorboard=False)
    assert checkpoint.load_meta(checkpoint.latest_snapshot(tmp_path / "run"))["rware_resets"] == 1
    with pytest.warns(UserWarning, match="new episodes"):
        resumed = resume(tmp_path / "run", total_steps=20, progress=False, tensorboard=False)
    assert int(resumed.state["iteration"]) == 4
    assert checkpoint.load_meta(checkpoint.latest_snapshot(tmp_path / "run"))["rware_resets"] == 2
    assert len(_metrics(tmp_path / "run")) == 4


def test_grpo_versions_rollback_and_resume_continue_exactly(tmp_path):
    # the one run loop writes versions for every algorithm: after a rollback to v2 of 4, resuming
    # re-runs iterations 3-4 on a new branch and ends equal to the uninterrupted run
    from rlfunc.run import versions
    from rlfunc import resume, train

    config = _grpo_config("PointReach-v0", 4, version_every=1)
    run = tmp_path / "run"
    full = train(config, run, progress=False, tensorboard=False)
    assert [m["id"] for m in versions.list_versions(run)] == ["v000001", "v000002", "v000003", "v000004"]
    assert [m["iteration"] for m in versions.list_versions(run)] == [1, 2, 3, 4]
    versions.rollback(run, "v000002", branch="retry")
    resumed = resume(run)
    assert int(resumed.state["iteration"]) == 4 and resumed.evaluation == full.evaluation
    for key, value in full.state.items(True, True):
        assert torch.equal(value, resumed.state.get(key)), key
    assert versions.branch_heads(run) == {"main": "v000004", "retry": "v000006"}


def test_a_second_resume_of_a_running_run_is_refused(tmp_path):
    # Regression (new-user pass): two `rlfunc resume` of one run dir both ran, writing every version twice
    # and config.json of one with the evaluation of the other; the run dir is now locked while a resume
    # runs (flock: a second open of the lock file conflicts even in one process, as in two)
    from rlfunc.errors import ConfigError
    from rlfunc.run.loop import train
    from rlfunc.run.checkpoint import hold_run_dir

    with hold_run_dir(tmp_path):
        with pytest.raises(ConfigError, match="another process is running this run"):
            with hold_run_dir(tmp_path):
                pass
        with pytest.raises(ConfigError, match="another process is running this run"):  # before anything is read
            train(None, tmp_path, resume=True)
    with hold_run_dir(tmp_path):  # released at the end of the block
        pass


def test_resume_snapshot_of_a_running_run_is_refused_before_latest_moves(tmp_path, capsys, monkeypatch):
    # Regression (filesystem pass): `rlfunc resume RUN --snapshot OLDER` pointed 'latest' at OLDER
    # before it took the run lock, so a running run's 'latest' moved under it (the refusal came after
    # a warning); the run lock is now held around the move, and nothing is written when refused
    from rlfunc.cli.commands import main
    from rlfunc.run.checkpoint import hold_run_dir

    run = tmp_path / "run"
    train(_grpo_config("PointReach-v0", 2, checkpoint_every=1, version_every=1), run, progress=False, tensorboard=False,
          evaluate=False)
    snaps = [p.name for p in checkpoint.run_snapshots(run)]
    assert len(snaps) == 2
    latest = checkpoint.latest_snapshot(run)
    pointer = (run / "checkpoints" / "latest").read_bytes() if (run / "checkpoints" / "latest").is_file() else None
    older = min(snaps)
    assert latest.name != older
    moves = []
    monkeypatch.setattr(checkpoint, "use_snapshot", lambda *a: moves.append(a))
    with hold_run_dir(run):
        assert main(["resume", str(run), "--snapshot", older]) == 2
    assert moves == []  # 'latest' was never pointed elsewhere, not even for a moment
    err = capsys.readouterr().err
    assert "another process is running this run" in err and "warning" not in err.lower()
    assert checkpoint.latest_snapshot(run) == latest
    if pointer is not None:
        assert (run / "checkpoints" / "latest").read_bytes() == pointer

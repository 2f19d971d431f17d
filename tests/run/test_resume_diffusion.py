"""Resume of bc / dppo / td3-diffusion / sac-diffusion runs: N iterations, stop, resume to 2N equals 2N in one go,
tensor for tensor (learner, optimizers, generator states, replay buffer); crashes, budgets, errors."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

import rlfunc.run.diffusion as td
from rlfunc.config import replace
from rlfunc.algos.bc import BCConfig
from rlfunc.algos.diffusion_actor import ActorSpec
from rlfunc.algos.dppo import DPPOConfig
from rlfunc.algos.sac_diffusion import SACDiffusionConfig
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig
from rlfunc.errors import CheckpointError, ConfigError
from rlfunc.run import checkpoint
from rlfunc import resume, train
from rlfunc.algos import registry
from rlfunc.run import RunResult

ACTOR = ActorSpec(hidden=(32, 32), num_train_steps=6, ddim_steps=3)  # horizon = act_steps = 4
QUIET = dict(progress=False, tensorboard=False)


def _bc(**kw) -> BCConfig:
    return replace(BCConfig(), **{"actor": ACTOR, "num_demos": 8, "num_updates": 10, "batch_size": 32, "log_every": 3,
                       "checkpoint_every": 0, "eval_episodes": 4, "device": "cpu", **kw})


def _dppo(**kw) -> DPPOConfig:  # 8 envs x 4 chunk steps x 4 actions = 128 env steps per iteration
    return replace(DPPOConfig(), **{"actor": ACTOR, "num_envs": 8, "num_steps": 4, "minibatch_size": 16, "num_epochs": 2,
                         "critic_hidden": (32,), "total_steps": 4 * 128, "eval_episodes": 4, "device": "cpu", **kw})


def _td3(**kw) -> TD3DiffusionConfig:  # 80 env steps per iteration; the first is warm-up; the buffer wraps in the 3rd
    actor = ActorSpec(hidden=(32, 32), horizon=1, act_steps=1, num_train_steps=6, ddim_steps=3)
    return replace(TD3DiffusionConfig(), **{"actor": actor, "num_envs": 8, "num_steps": 10, "warmup_steps": 160, "buffer_size": 200,
                                 "updates_per_iteration": 2, "batch_size": 16, "critic_hidden": (32,),
                                 "total_steps": 6 * 80, "eval_episodes": 4, "device": "cpu", **kw})


def _sac(**kw) -> SACDiffusionConfig:  # as _td3; an entropy estimate and alpha step every 2nd update
    actor = ActorSpec(hidden=(32, 32), horizon=1, act_steps=1, num_train_steps=6, ddim_steps=3)
    return replace(SACDiffusionConfig(), **{"actor": actor, "num_envs": 8, "num_steps": 10, "warmup_steps": 160, "buffer_size": 200,
                                 "updates_per_iteration": 3, "batch_size": 16, "critic_hidden": (32,), "entropy_every": 2,
                                 "entropy_states": 4, "entropy_samples": 12, "total_steps": 6 * 80, "eval_episodes": 4,
                                 "device": "cpu", **kw})


def _snapshot(run_dir):
    return checkpoint.load_snapshot(checkpoint.latest_snapshot(run_dir))


def _assert_same_snapshot(a, b) -> None:
    """The latest snapshots of two runs hold the same tensors, bit for bit, and the same env RNG."""
    (sa, ma), (sb, mb) = _snapshot(a), _snapshot(b)
    keys = sorted(sa.keys(include_nested=True, leaves_only=True), key=str)
    assert keys == sorted(sb.keys(include_nested=True, leaves_only=True), key=str)
    assert any(k[0].startswith("optim_") for k in keys)  # optimizer states are compared too
    differ = [k for k in keys if not torch.equal(sa[k], sb[k])]
    assert differ == []
    assert ma.get("env_rng") == mb.get("env_rng")  # a gymnasium env's numpy generator state (meta.json)
    assert ma["iteration"] == mb["iteration"]


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_time(records: list[dict]) -> list[dict]:
    """The records without their wall-clock fields (they differ between runs)."""
    return [{k: v for k, v in r.items() if k not in ("time", "collect_s", "update_s")} for r in records]


def test_bc_n_stop_resume_n_equals_2n(tmp_path):
    whole = train(_bc(), tmp_path / "whole", **QUIET)
    first = train(_bc(num_updates=5), tmp_path / "split", **QUIET)
    assert int(first.state["iteration"]) == 5
    resumed = resume(tmp_path / "split", 10, **QUIET)
    assert isinstance(resumed, RunResult) and resumed.interrupted is None
    assert int(resumed.state["iteration"]) == 10
    for key in whole.state.keys(include_nested=True, leaves_only=True):
        assert torch.equal(whole.state[key], resumed.state[key]), key
    _assert_same_snapshot(tmp_path / "whole", tmp_path / "split")
    assert resumed.evaluation == whole.evaluation
    # the budget extension ran updates 6..10 and logged them; the first part's end (5) stays logged
    assert [r["iteration"] for r in _records(tmp_path / "split")] == [3, 5, 6, 9, 10]
    assert json.loads((tmp_path / "split" / "config.json").read_text())["num_updates"] == 10
    assert checkpoint.latest_snapshot(tmp_path / "split").name == "step_000000000010"


@pytest.mark.parametrize("env, per_iteration", [("PointReach-v0", 128), ("Pendulum-v1", 64)])
def test_dppo_n_stop_resume_n_equals_2n(tmp_path, env, per_iteration):
    """PointReach-v0 (torch env: its generator is in the snapshot) and a gymnasium env through
    GymChunkEnv (its numpy seed generator is in meta.json)."""
    kw = dict(env=env, total_steps=4 * per_iteration)
    if env != "PointReach-v0":
        kw.update(num_envs=4, minibatch_size=8, num_epochs=1, eval_episodes=2)
    whole = train(_dppo(**kw), tmp_path / "whole", **QUIET)
    train(_dppo(**{**kw, "total_steps": 2 * per_iteration}), tmp_path / "split", **QUIET)
    resumed = resume(tmp_path / "split", 4 * per_iteration, **QUIET)
    assert int(resumed.state["iteration"]) == 4 and int(resumed.state["env_steps"]) == 4 * per_iteration
    _assert_same_snapshot(tmp_path / "whole", tmp_path / "split")
    assert _without_time(_records(tmp_path / "split")) == _without_time(_records(tmp_path / "whole"))
    assert resumed.evaluation == whole.evaluation


def test_td3_n_stop_resume_n_equals_2n(tmp_path):
    """Stops in the warm-up (iteration 1) and after the replay buffer wrapped (iteration 3: 240 rows
    into 200), each resumed with a larger budget."""
    whole = train(_td3(), tmp_path / "whole", **QUIET)
    train(_td3(total_steps=80), tmp_path / "split", **QUIET)
    resume(tmp_path / "split", 3 * 80, **QUIET)
    state, meta = _snapshot(tmp_path / "split")
    assert meta["buffer"]["length"] == 200 and meta["buffer"]["writer"]["_cursor"] == 40
    assert state["buffer", "reward"].shape == (200, 1)
    resumed = resume(tmp_path / "split", 6 * 80, **QUIET)
    assert int(resumed.state["iteration"]) == 6 and int(resumed.state["updates"]) == 5 * 2  # iterations 2..6
    _assert_same_snapshot(tmp_path / "whole", tmp_path / "split")
    assert _without_time(_records(tmp_path / "split")) == _without_time(_records(tmp_path / "whole"))
    assert resumed.evaluation == whole.evaluation


def test_sac_diffusion_n_stop_resume_n_equals_2n(tmp_path):
    """As td3's: stops in the warm-up and after the buffer wrapped; the learner's alpha, its Adam
    state, the entropy estimate and the buffer come back exactly."""
    whole = train(_sac(), tmp_path / "whole", **QUIET)
    train(_sac(total_steps=80), tmp_path / "split", **QUIET)
    resume(tmp_path / "split", 3 * 80, **QUIET)
    state, meta = _snapshot(tmp_path / "split")
    assert meta["algo"] == "sac-diffusion" and meta["buffer"]["length"] == 200
    assert int(state["optim_alpha", "0", "step", "log_alpha"]) == 3  # updates 0, 2 (iteration 2), 4 (iteration 3)
    resumed = resume(tmp_path / "split", 6 * 80, **QUIET)
    assert int(resumed.state["iteration"]) == 6 and int(resumed.state["updates"]) == 5 * 3
    assert float(resumed.state["params", "log_alpha"]) != pytest.approx(float(torch.tensor(3.0).log()))  # alpha moved
    _assert_same_snapshot(tmp_path / "whole", tmp_path / "split")
    records = _without_time(_records(tmp_path / "split"))
    assert records == _without_time(_records(tmp_path / "whole"))
    assert {"alpha", "entropy", "loss_actor", "loss_critic", "target_entropy"} <= records[-1].keys()
    assert resumed.evaluation == whole.evaluation


def test_td3_without_the_buffer_in_snapshots_warns_on_resume(tmp_path):
    train(_td3(total_steps=3 * 80, checkpoint_buffer=False), tmp_path / "run", **QUIET)
    state, meta = _snapshot(tmp_path / "run")
    assert meta["buffer"] is None and "buffer" not in state.keys()
    with pytest.warns(UserWarning, match="empty buffer"):
        resumed = resume(tmp_path / "run", 4 * 80, **QUIET)
    assert int(resumed.state["iteration"]) == 4
    # it waited for the warm-up's 160 transitions again (2 iterations of 80) before updating: none in iteration 4
    assert "loss_critic" not in _records(tmp_path / "run")[-1] and "loss_critic" in _records(tmp_path / "run")[-2]


def test_bc_crash_after_a_snapshot_resumes_exactly_with_its_metrics(tmp_path, monkeypatch):
    """A crash in update 5: the snapshot of update 3 holds the metrics summed since the line of
    update 2, the line of update 4 (after the snapshot) is dropped, and the resumed run's lines equal
    an uninterrupted run's."""
    config = _bc(log_every=2, checkpoint_every=3)
    train(config, tmp_path / "whole", **QUIET)
    real = td.make_bc

    def crashing_make_bc(*args, **kwargs):
        algo = real(*args, **kwargs)
        calls = {"n": 0}

        def iteration(*a, **k):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("simulated crash")
            return algo.iteration(*a, **k)

        return algo._replace(iteration=iteration)

    monkeypatch.setattr(td, "make_bc", crashing_make_bc)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(config, tmp_path / "split", **QUIET)
    monkeypatch.setattr(td, "make_bc", real)
    assert [r["iteration"] for r in _records(tmp_path / "split")] == [2, 4]
    state, meta = _snapshot(tmp_path / "split")
    assert meta["iteration"] == 3 and meta["pending_metrics"] == 1 and "pending_metrics" in state.keys()
    train(None, tmp_path / "split", resume=True, **QUIET)
    _assert_same_snapshot(tmp_path / "whole", tmp_path / "split")
    assert _without_time(_records(tmp_path / "split")) == _without_time(_records(tmp_path / "whole"))


def test_a_resumed_bc_line_times_all_of_its_updates(tmp_path, monkeypatch):
    """Metrics pass: a snapshot kept the metrics summed since the last line but not their update
    seconds, so after a resume the next line's update_s was of the updates after the snapshot only
    (70 of 100 at log_every 100). With a clock that moves 1 s per reading, every update takes 1 s."""
    import types

    import rlfunc.run.diffusion as run_diffusion

    clock = iter(range(10**6))
    monkeypatch.setattr(run_diffusion, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    config = _bc(num_updates=4, log_every=4, checkpoint_every=0)
    train(config, tmp_path / "run", max_iterations=3, **QUIET)  # snapshot at update 3, its line still to come
    _, meta = _snapshot(tmp_path / "run")
    assert meta["pending_metrics"] == 3 and meta["pending_update_s"] == 3.0
    resume(tmp_path / "run", **QUIET)
    (line,) = _records(tmp_path / "run")
    assert line["iteration"] == 4 and line["update_s"] == 1.0  # (3 s before the snapshot + 1 s after) / 4 updates


def test_resume_of_a_finished_run_runs_nothing_and_evaluates(tmp_path):
    done = train(_bc(num_updates=4, log_every=2), tmp_path / "run", **QUIET)
    before = checkpoint.latest_snapshot(tmp_path / "run")
    again = resume(tmp_path / "run", **QUIET)
    assert int(again.state["iteration"]) == 4 and again.evaluation == done.evaluation
    assert [r["iteration"] for r in _records(tmp_path / "run")] == [2, 4]
    assert checkpoint.latest_snapshot(tmp_path / "run") == before


def test_no_snapshot_is_a_checkpoint_error_naming_the_dir(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for call in (lambda: resume(empty), lambda: train(None, empty, resume=True),
                 lambda: resume(tmp_path / "missing")):
        with pytest.raises(CheckpointError, match="no snapshot to resume from") as e:
            call()
        assert str(tmp_path) in str(e.value)


def test_bad_budgets_and_wrong_algorithm(tmp_path):
    train(_bc(num_updates=4, log_every=2), tmp_path / "bc", **QUIET)
    with pytest.raises(ConfigError, match="total_steps=0"):
        resume(tmp_path / "bc", 0)
    with pytest.raises(ConfigError, match="already done 4 iterations"):
        resume(tmp_path / "bc", 3)
    with pytest.raises(ConfigError, match="resume=True"):
        train(_bc(), tmp_path / "other", total_steps=5)
    with pytest.raises(ConfigError, match="config=None: expected a registered algorithm's config"):
        train(None, tmp_path / "other")
    assert not (tmp_path / "other").exists()
    # the snapshot's "algo" picks the run: resuming the finished bc run runs no update and evaluates again
    assert int(train(None, tmp_path / "bc", resume=True, **QUIET).state["iteration"]) == 4
    assert [r["iteration"] for r in _records(tmp_path / "bc")] == [2, 4]  # nothing written by the refusals


def test_config_from_meta_round_trips():
    for config in (_bc(), _dppo(), _td3(), _sac()):
        algo = {BCConfig: "bc", DPPOConfig: "dppo", TD3DiffusionConfig: "td3-diffusion", SACDiffusionConfig: "sac-diffusion"}[type(config)]
        meta = json.loads(json.dumps({"algo": algo, "config": dataclasses.asdict(config)}))
        assert registry.config_from_meta(meta, "snap") == config
    with pytest.raises(CheckpointError, match="snap: meta.json holds no valid bc config"):
        registry.config_from_meta({"algo": "bc", "config": {"num_updates": -1}}, "snap")


def test_bc_rolled_back_to_a_version_resumes_to_the_uninterrupted_run(tmp_path):
    """version_every=1: a version per update (branch "main"); rolled back to update 4's (which holds
    the metrics of update 4, pending since the line of update 3), the resumed run ends as one that
    ran straight through: state, last snapshot, metrics lines and evaluation."""
    from rlfunc.run import versions

    with pytest.raises(ConfigError, match="version_every=-1"):
        _bc(version_every=-1)
    config = _bc(num_updates=6, version_every=1)
    whole = train(config, tmp_path / "whole", **QUIET)
    run = tmp_path / "run"
    train(config, run, **QUIET)
    manifests = versions.list_versions(run)
    assert [m["iteration"] for m in manifests] == [1, 2, 3, 4, 5, 6]
    versions.rollback(run, next(m["id"] for m in manifests if m["iteration"] == 4))
    resumed = resume(run, **QUIET)
    assert int(resumed.state["iteration"]) == 6
    for key in whole.state.keys(include_nested=True, leaves_only=True):
        assert torch.equal(whole.state[key], resumed.state[key]), key
    _assert_same_snapshot(tmp_path / "whole", run)
    assert _without_time(_records(run)) == _without_time(_records(tmp_path / "whole"))
    assert resumed.evaluation == whole.evaluation
    assert [m["iteration"] for m in versions.list_versions(run)] == [1, 2, 3, 4, 5, 6, 5, 6]  # 5, 6 again on the new branch


# ------------------------------------------------------------------ runs of state layout 1 (torch.optim's)

DATA = Path(__file__).parents[1] / "data"  # tests/data/*_state_layout_1, written by rlfunc at 8a7709f (their READMEs)


def _layout_1_run(tmp_path, name: str) -> Path:
    run = tmp_path / name
    shutil.copytree(DATA / name, run, ignore=shutil.ignore_patterns("README.md", "expected"))
    return run


def _assert_reached_expected(name: str, state, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """``state``'s tensors are those the layout-1 code reached resuming the same run (expected/)."""
    from safetensors.torch import load_file

    (path,) = (DATA / name / "expected").glob("*.safetensors")
    expected = load_file(path)
    groups = {k.split(".")[0] for k in expected}
    got = {f"{g}.{'.'.join(k) if isinstance(k, tuple) else k}": v for g in groups for k, v in state[g].items(True, True)}
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=rtol, atol=atol, msg=lambda m, key=key: f"{key}: {m}")


def _optim_steps(run_dir, entry: str) -> set[int]:
    """The Adam step counts of the snapshot's ``entry`` (a chain state), over its leaves."""
    saved, _ = _snapshot(run_dir)
    return {int(v) for k, v in saved[entry].items(True, True) if "step" in k[:-1]}


def test_a_bc_run_of_layout_1_evaluates_and_resumes_as_the_old_code_did(tmp_path):
    """AdamW's torch.optim state ("optim_actor", numbered in its parameter order) becomes the chain's
    Adam state in the learner, leaf for leaf; the resumed run reaches the old code's parameters and
    EMA and writes state layout 2."""
    run = _layout_1_run(tmp_path, "bc_state_layout_1")
    saved, meta = _snapshot(run)
    assert "state_layout" not in meta and sorted(saved["optim_actor"].keys(), key=int) == [str(i) for i in range(10)]
    assert td.evaluate_run(run, 2, device="cpu")["episodes"] == 2
    resumed = resume(run, 8, **QUIET)
    assert int(resumed.state["iteration"]) == 8
    _assert_reached_expected("bc_state_layout_1", resumed.state)
    saved, meta = _snapshot(run)
    assert meta["state_layout"] == 2 and "optim_actor" not in saved["learner"].keys()
    assert _optim_steps(run, "optim_actor") == {8}
    assert [r["iteration"] for r in _records(run)] == [3, 4, 6, 8]


def test_a_bc_run_of_layout_1_with_an_encoder_resumes_as_the_old_code_did(tmp_path):
    """Push-v0: AdamW stepped the denoiser's leaves, then the encoder's; the chain keys them
    {"params", "encoder"} (so in another order): the renumbering puts each moment on its leaf."""
    from envs.push import env as pe

    if not pe.rendering_available():
        pytest.skip("no working OpenGL")
    run = _layout_1_run(tmp_path, "bc_push_state_layout_1")
    resumed = resume(run, 4, **QUIET)
    assert int(resumed.state["iteration"]) == 4
    # the camera images are rendered again at resume, and GL implementations round pixels differently
    # (on an EGL machine of 2026-12-02 the params differed from the recorded ones by up to 1.6e-4);
    # a moment renumbered onto the wrong leaf moves a parameter by ~lr = 1e-2 in these 2 steps
    _assert_reached_expected("bc_push_state_layout_1", resumed.state, rtol=0.0, atol=2e-3)
    assert _optim_steps(run, "optim_actor") == {4}


def test_a_layout_1_optimizer_state_that_does_not_fit_is_refused_in_one_line(tmp_path, capsys):
    from rlfunc.cli import main

    run = _layout_1_run(tmp_path, "bc_state_layout_1")
    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    state["optim_actor", "3", "exp_avg"] = torch.zeros(5)
    checkpoint.save_snapshot(snap, state, meta)
    before = (run / "metrics.jsonl").read_text()
    assert main(["resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "state layout 1" in err[0] and "8a7709f" in err[0] and "optim_actor" in err[0]
    assert (run / "metrics.jsonl").read_text() == before


def test_a_dppo_run_of_layout_1_resumes_as_the_old_code_did(tmp_path):
    """One torch.optim.Adam with two parameter groups (the actor's leaves, then the critic's) becomes
    the chain's Adam state of each side ("optim_all" "1" "actor" / "critic")."""
    run = _layout_1_run(tmp_path, "dppo_state_layout_1")
    saved, meta = _snapshot(run)
    assert "state_layout" not in meta and len(saved["optim_all"].keys()) == 14
    resumed = resume(run, 4 * 64, **QUIET)
    assert int(resumed.state["iteration"]) == 4
    _assert_reached_expected("dppo_state_layout_1", resumed.state)
    saved, meta = _snapshot(run)
    assert meta["state_layout"] == 2 and set(saved["optim_all", "1"].keys()) == {"actor", "critic"}
    assert _optim_steps(run, "optim_all") == {int(sum(r["updates"] for r in _records(run)))}


def test_a_td3_diffusion_run_of_layout_1_resumes_as_the_old_code_did(tmp_path):
    """Each side's torch.optim.Adam ("optim_critic" over the stacked twin critics, "optim_actor")
    becomes its chain's Adam state; the replay buffer comes back as it was."""
    run = _layout_1_run(tmp_path, "td3_diffusion_state_layout_1")
    saved, meta = _snapshot(run)
    assert "state_layout" not in meta and meta["buffer"]["length"] == 100
    resumed = resume(run, 5 * 40, **QUIET)
    assert int(resumed.state["iteration"]) == 5 and int(resumed.state["updates"]) == 5 * 3
    _assert_reached_expected("td3_diffusion_state_layout_1", resumed.state)
    saved, meta = _snapshot(run)
    assert meta["state_layout"] == 2
    assert _optim_steps(run, "optim_critic") == {15} and _optim_steps(run, "optim_actor") == {7}


def test_a_dppo_layout_1_optimizer_state_that_does_not_fit_is_refused_in_one_line(tmp_path, capsys):
    from rlfunc.cli import main

    run = _layout_1_run(tmp_path, "dppo_state_layout_1")
    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    state["optim_all", "14"] = state["optim_all", "13"].clone()  # one entry more than the 14 leaves
    checkpoint.save_snapshot(snap, state, meta)
    assert main(["resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "state layout 1" in err[0] and "8a7709f" in err[0] and "optim_all" in err[0]


def test_bc_under_fp16_resumes_exactly_with_its_loss_scale_and_from_a_grad_scaler_snapshot(tmp_path):
    """fp16: the loss scale is optimizer state (rlfunc.optim.amp.dynamic_loss_scale), so 5 updates, stop,
    resume to 10 equals 10 in one go, growth tracker included (10 finite steps); a snapshot in the layout
    written before (the optimizer state bare, the GradScaler's scale and tracker in meta "grad_scaler")
    resumes to the same run. (ppo-encoder's test covers a scale that backed off.)"""
    whole = train(_bc(precision="fp16"), tmp_path / "whole", **QUIET)
    first = train(_bc(precision="fp16", num_updates=5), tmp_path / "split", **QUIET)
    scale, tracker = float(first.state["optim_actor", "scale"]), int(first.state["optim_actor", "growth_tracker"])
    assert (scale, tracker) == (2.0**16, 5) and int(whole.state["optim_actor", "growth_tracker"]) == 10
    shutil.copytree(tmp_path / "split", tmp_path / "old")
    resumed = resume(tmp_path / "split", 10, **QUIET)
    for key in whole.state.keys(include_nested=True, leaves_only=True):
        assert torch.equal(whole.state[key], resumed.state[key]), key
    # the old layout: no loss-scale link in the state, torch.amp.GradScaler's state_dict in meta
    snap = checkpoint.latest_snapshot(tmp_path / "old")
    tensors, meta = checkpoint.load_snapshot(snap)
    tensors["optim_actor"] = tensors["optim_actor", "inner"]
    meta["grad_scaler"] = {"scale": scale, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                           "_growth_tracker": tracker}
    shutil.rmtree(snap)
    checkpoint.save_snapshot(snap, tensors, meta)
    from_old = resume(tmp_path / "old", 10, **QUIET)
    for key in whole.state.keys(include_nested=True, leaves_only=True):
        assert torch.equal(whole.state[key], from_old.state[key]), key


def test_a_replay_run_whose_warmup_covers_its_budget_warns_that_it_takes_no_gradient_step(tmp_path):
    """td3-diffusion's default warmup (5,000 env steps) is longer than a tiny run: said, not silent."""
    with pytest.warns(UserWarning, match="no gradient step"):
        result = train(_td3(warmup_steps=5_000, total_steps=6 * 80, checkpoint_every=0), tmp_path / "r", **QUIET)
    steps = result.state["optim_critic", "1", "step"].values(True, True)
    assert all(int(s.max()) == 0 for s in steps)  # Adam never stepped


def test_the_diffusion_runs_metrics_lines_time_their_phases(tmp_path):
    """The design's metrics lines carry per-phase times; bc, dppo, td3-diffusion and sac-diffusion had none
    (a user could not tell collection from the update). dppo and the replay algorithms: collect_s and
    update_s per iteration (the warm-up iterations update nothing: 0); bc: update_s per update, the mean
    over the line's updates. Each phase's seconds fit within the run's elapsed time."""
    train(_bc(), tmp_path / "bc", evaluate=False, **QUIET)
    bc = _records(tmp_path / "bc")
    assert all(r["update_s"] > 0 and "collect_s" not in r for r in bc)
    assert sum(r["update_s"] * n for r, n in zip(bc, (3, 3, 3, 1))) <= bc[-1]["time"]
    for name, config in (("dppo", _dppo(total_steps=2 * 128)), ("td3", _td3(total_steps=3 * 80))):
        train(config, tmp_path / name, evaluate=False, **QUIET)
        records = _records(tmp_path / name)
        assert all(r["collect_s"] > 0 for r in records)
        warm = [r["step"] < getattr(config, "warmup_steps", 0) for r in records]
        assert [r["update_s"] > 0 for r in records] == [not w for w in warm] and any(warm) == (name == "td3")
        assert sum(r["collect_s"] + r["update_s"] for r in records) <= records[-1]["time"]


def test_an_episode_with_a_non_finite_return_is_left_out_of_a_gymnasium_line():
    # Regression: td3-diffusion's (and dppo's, sac-diffusion's) line on a gymnasium env averaged a NaN or inf
    # episode return into "episode_return" and counted it in "episodes"; ppo's and sac/td3's leave it out of both.
    from tensordict import TensorDict

    done = torch.tensor([[False, True, False], [True, False, True]]).unsqueeze(-1)
    ret = torch.tensor([[9.0, -5.0, 7.0], [float("nan"), 3.0, float("inf")]]).unsqueeze(-1)
    batch = TensorDict({"next": {"done": done, "episode_return": ret}}, batch_size=[2, 3])
    assert td._episode_metrics(batch, "Pendulum-v1") == {"episodes": 1, "episode_return": -5.0}
    batch["next", "episode_return"][0, 1] = float("-inf")
    assert td._episode_metrics(batch, "Pendulum-v1") == {"episodes": 0}

"""Resume of Gaussian PPO over Dict observations (rlfunc.run.ppo_encoder, algo "ppo-encoder") on Push-v0.

The property: 4 iterations in one go == 2 iterations, a crash, resume for 2 more, tensor for tensor
(learner, Adam state, generator, the carry the next step acts on, the envs' MuJoCo state), with the
same metrics lines. The envs keep running across iterations, so the snapshot is taken mid-episode.
A tiny encoder and 2 envs x 4 steps per iteration keep it fast; Push-v0 renders its cameras, so the
tests skip without OpenGL (as tests/algos/test_ppo_encoder.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from envs.push import env as pe
from rlfunc.config import replace
from rlfunc.algos.ppo_encoder import PPOEncoderConfig
from rlfunc.errors import CheckpointError, ConfigError
from rlfunc.run import checkpoint

pytestmark = pytest.mark.skipif(not pe.rendering_available(), reason=f"no working OpenGL (backend {pe.gl_backend()})")

TINY = dict(env="Push-v0", num_envs=2, num_steps=4, minibatch_size=4, num_epochs=1, hidden=(16,), encoder_d_model=16,
            encoder_widths=(8, 8), encoder_blocks=(1, 1), device="cpu", eval_episodes=1, lr=1e-3, seed=2)
QUIET = dict(progress=False, tensorboard=False)
TIMING = {"time", "steps_per_s", "collect_s", "update_s"}


def _train(run_dir, iterations: int, **kw):
    from rlfunc.run import train

    config = replace(PPOEncoderConfig(), **{**TINY, "total_steps": 8 * iterations, **kw})
    return train(config, run_dir, evaluate=False, **QUIET)


def _tensors(run_dir) -> tuple[dict[str, torch.Tensor], dict]:
    state, meta = checkpoint.load_snapshot(checkpoint.latest_snapshot(run_dir))
    return {k if isinstance(k, str) else ".".join(k): v for k, v in state.items(True, True)}, meta


def _metrics(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_resume_after_a_crash_is_exact(tmp_path):
    from rlfunc.run import train

    full = _train(tmp_path / "full", 4, checkpoint_every=2)
    # a crash after iteration 2's snapshot: the later snapshot gone, the later metrics lines still there
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / f"step_{32:012d}")
    saved, meta = _tensors(part)
    assert meta["iteration"] == 2 and len(_metrics(part)) == 4
    assert {"carry.top", "carry.proprio", "carry.instruction_tokens", "carry.done", "learner.rng"} <= saved.keys()
    assert [e["elapsed_steps"] for e in meta["env_state"]["envs"]] == [8, 8]  # mid-episode: Push-v0 runs 100 steps
    assert "mujoco" in meta["env_state"]["envs"][0] and isinstance(meta["env_rng"], dict)

    resumed = train(None, part, resume=True, evaluate=False, **QUIET)
    assert int(resumed.state["iteration"]) == 4
    a, b = dict(full.state.items(True, True)), dict(resumed.state.items(True, True))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    (sa, ma), (sb, mb) = _tensors(tmp_path / "full"), _tensors(part)
    assert sa.keys() == sb.keys() and any(k.startswith("optim.") for k in sa)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    assert ma["env_state"] == mb["env_state"] and ma["env_rng"] == mb["env_rng"]
    assert _metrics(part) == _metrics(tmp_path / "full")  # lines 3 and 4 dropped, then written again


def test_cli_resume_extends_the_budget_and_refuses_a_smaller_one(tmp_path, capsys):
    from rlfunc.cli.commands import main

    run = tmp_path / "run"
    _train(run, 2)
    assert main(["resume", str(run), "--total-steps", "8"]) == 2
    assert "fewer than the 2 done" in capsys.readouterr().err
    assert main(["resume", str(run), "--total-steps", "24"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["env"] == "Push-v0" and summary["episodes"] == 1 and summary["env_steps"] == 24
    assert [r["iteration"] for r in _metrics(run)] == [1, 2, 3]
    assert json.loads((run / "config.json").read_text())["total_steps"] == 24
    # a snapshot written before ppo-encoder runs were resumable is refused by name
    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    checkpoint.save_snapshot(snap, state, {k: v for k, v in meta.items() if k != "resume_format"})
    assert main(["resume", str(run)]) == 2
    assert "before ppo-encoder runs were resumable" in capsys.readouterr().err


def test_envs_whose_state_is_not_captured_resume_with_new_episodes(tmp_path, monkeypatch):
    """Without the envs' state the resumed run warns and starts new episodes; the learner, Adam's
    state and the generator still come back exactly, and training goes on from them."""
    from rlfunc.envs.chunk import GymChunkEnv
    from rlfunc import resume, train

    monkeypatch.setattr(GymChunkEnv, "episode_state", lambda self: None)
    run = tmp_path / "run"
    _train(run, 1)
    saved, meta = _tensors(run)
    assert meta["env_state"] is None
    with pytest.warns(UserWarning, match="starts new episodes"):  # nothing left to run: the restored state itself
        restored = train(None, run, resume=True, total_steps=8, evaluate=False, **QUIET)
    for key, value in restored.state.exclude("optim").items(True, True):
        assert torch.equal(value, saved["learner." + (key if isinstance(key, str) else ".".join(key))]), key
    with pytest.warns(UserWarning, match="starts new episodes"):
        resumed = train(None, run, resume=True, total_steps=16, evaluate=False, **QUIET)
    assert int(resumed.state["iteration"]) == 2
    after, _ = _tensors(run)
    updates = 8 // TINY["minibatch_size"]  # Adam steps per iteration
    assert all(int(after[k]) == 2 * updates for k in after if k.startswith("optim.") and k.endswith(".step"))
    assert [r["iteration"] for r in _metrics(run)] == [1, 2]
    with pytest.raises(CheckpointError, match="no snapshot to resume from"):
        resume(tmp_path / "empty")


# ----------------------------------------------------------- versions, and runs of state layout 1

LAYOUT_1 = Path(__file__).parents[1] / "data" / "ppo_encoder_state_layout_1"  # written by rlfunc at aaf3139 (its README)


def test_rollback_to_a_version_then_resume_ends_equal_to_the_uninterrupted_run(tmp_path):
    from rlfunc.run import versions
    from rlfunc.run import train

    run = tmp_path / "run"
    full = _train(run, 3, version_every=1)
    assert [m["id"] for m in versions.list_versions(run)] == ["v000001", "v000002", "v000003"]
    before = _metrics(run)
    versions.rollback(run, "v000001", branch="retry")
    resumed = train(None, run, resume=True, evaluate=False, **QUIET)
    assert int(resumed.state["iteration"]) == 3
    a, b = dict(full.state.items(True, True)), dict(resumed.state.items(True, True))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _metrics(run) == before
    saved, meta = _tensors(run)
    assert meta["state_layout"] == 2 and meta["branch"] == "retry"
    steps = [v for k, v in saved.items() if k.startswith("optim.1.step.")]  # Adam's per-leaf step counts
    assert steps and all(int(s) == 3 * (8 // TINY["minibatch_size"]) for s in steps)
    assert versions.branch_heads(run) == {"main": "v000003", "retry": "v000005"}


def _layout_1_run(tmp_path) -> Path:
    run = tmp_path / "old"
    shutil.copytree(LAYOUT_1, run, ignore=shutil.ignore_patterns("README.md", "expected"))
    return run


def test_a_run_written_by_the_old_code_evaluates_and_resumes_as_it_would_have(tmp_path):
    from safetensors.torch import load_file

    from rlfunc import resume
    from rlfunc.run.ppo_encoder import evaluate_run

    run = _layout_1_run(tmp_path)
    saved, meta = _tensors(run)
    assert "state_layout" not in meta and meta["optim_leaves"] == list(range(78)) and "version_every" not in meta["config"]
    result = evaluate_run(run, 1, device="cpu")
    assert result["env_steps"] == 8 and result["episodes"] == 1
    with pytest.raises(ConfigError, match=r"seed=-5: expected an integer in \[0, 2\*\*31\)"):  # was chunk.py's traceback
        evaluate_run(run, 1, seed=-5, device="cpu")
    resumed = resume(run, total_steps=16, **QUIET)
    assert int(resumed.state["iteration"]) == 4 and resumed.evaluation["env_steps"] == 16
    # torch.optim's entries (numbered in that optimizer's order) became the chain's Adam state leaf
    # for leaf: the parameters are those the old code reached from the same snapshot
    expected = load_file(LAYOUT_1 / "expected" / "params_iteration_4.safetensors")
    got = {".".join(k) if isinstance(k, tuple) else k: v for k, v in resumed.state["params"].items(True, True)}
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-6, msg=key)
    after, meta = _tensors(run)
    assert meta["state_layout"] == 2
    steps = [v for k, v in after.items() if k.startswith("optim.1.step.")]
    assert len(steps) == 78 and all(int(s) == 4 + 2 * 2 for s in steps)  # 2 more iterations of 2 minibatches
    assert [r["iteration"] for r in _metrics(run)] == [1, 2, 3, 4]


def test_a_layout_1_optimizer_state_that_does_not_fit_is_refused_in_one_line(tmp_path, capsys):
    from rlfunc.cli import main

    run = _layout_1_run(tmp_path)
    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    del state["optim", "3"]
    checkpoint.save_snapshot(snap, state, meta)
    before = (run / "metrics.jsonl").read_text()
    assert main(["resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "state layout 1" in err[0] and "aaf3139" in err[0]
    assert (run / "metrics.jsonl").read_text() == before


def test_resume_under_fp16_is_exact_after_the_loss_scale_backed_off(tmp_path):
    """fp16's loss scale is optimizer state (rlfunc.optim.amp.dynamic_loss_scale): a crash and resume after
    it backed off continue with the backed-off scale (a GradScaler outside the state restarted at 2^16)."""
    from rlfunc.run import train

    full = _train(tmp_path / "full", 4, checkpoint_every=2, precision="fp16")
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / f"step_{32:012d}")
    saved, _ = _tensors(part)
    assert float(saved["optim.scale"]) < 2.0**16  # an fp16 gradient overflowed in the first 2 iterations
    resumed = train(None, part, resume=True, evaluate=False, **QUIET)
    a, b = dict(full.state.items(True, True)), dict(resumed.state.items(True, True))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _metrics(part) == _metrics(tmp_path / "full")
    (sa, _), (sb, _) = _tensors(tmp_path / "full"), _tensors(part)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)  # the loss scale included


def test_eval_seed_stands_in_for_the_runs_seed(tmp_path):
    """New-user pass: `rlfunc eval RUN --seed S` seeded the evaluation envs with S itself (every other
    algorithm adds the evaluation offset to it), so --seed 0 of a seed-0 run scored the policy on the
    training envs' start states; --seed of the run's own seed now gives its default evaluation."""
    from rlfunc.run.ppo_encoder import evaluate_run

    run = _layout_1_run(tmp_path)
    seed = json.loads((run / "config.json").read_text())["seed"]
    default, same = evaluate_run(run, 2, device="cpu"), evaluate_run(run, 2, seed=seed, device="cpu")
    assert default["mean"] == same["mean"] and default["std"] == same["std"]
    assert evaluate_run(run, 2, seed=seed + 1, device="cpu")["mean"] != default["mean"]

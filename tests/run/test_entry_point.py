"""rlfunc.train / rlfunc.resume, the one entry point of every algorithm: bad arguments are one error,
before anything is written (found by a new-user pass)."""

import json

import pytest

from rlfunc import resume, train
from rlfunc.algos.ppo import preset
from rlfunc.cli.commands import main
from rlfunc.errors import ConfigError
from rlfunc.run import checkpoint

TINY = dict(total_steps=256, num_envs=2, num_steps=64, minibatch_size=64, num_epochs=1, eval_episodes=2, device="cpu")
QUIET = dict(progress=False, tensorboard=False)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_a_new_run_refuses_a_bad_max_iterations_and_writes_nothing(tmp_path, bad):
    # the bug: max_iterations=0 (or -1) returned quietly and left config.json and an empty metrics.jsonl,
    # which neither a new run ("not empty") nor a resume ("no snapshot") could use; 1.5 raised a TypeError
    with pytest.raises(ConfigError, match=f"max_iterations={bad!r}: expected None or an int >= 1"):
        train(preset("Pendulum-v1", **TINY), tmp_path / "run", max_iterations=bad, **QUIET)
    assert not (tmp_path / "run").exists()


def test_a_resume_that_runs_no_iteration_keeps_the_run_s_budget(tmp_path):
    # the bug: resume(d, new budget, max_iterations=0) wrote the new budget into config.json, while the
    # snapshot (what a later resume reads) kept the old one
    train(preset("Pendulum-v1", **TINY), tmp_path / "run", evaluate=False, **QUIET)
    before = (tmp_path / "run" / "config.json").read_text()
    resume(tmp_path / "run", 4 * TINY["total_steps"], max_iterations=0, evaluate=False, **QUIET)
    assert (tmp_path / "run" / "config.json").read_text() == before
    with pytest.raises(ConfigError, match="max_iterations=-1: expected None or an int >= 0"):
        resume(tmp_path / "run", max_iterations=-1, **QUIET)


def test_nproc_and_run_dir_are_refused_where_this_call_cannot_honour_them(tmp_path):
    # the bug: train(config with nproc=2) trained in one process and recorded nproc=2, so a later
    # `rlfunc resume` started 2 ranks; train(config, None) raised a TypeError from pathlib
    with pytest.raises(ConfigError, match=r"run.nproc=2: this call trains in one process; start 2 ranks with `rlfunc train ALGO --nproc 2"):
        train(preset("Pendulum-v1", **{**TINY, "num_envs": 4}, nproc=2), tmp_path / "run", **QUIET)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="run_dir=None: expected a path"):
        train(preset("Pendulum-v1", **TINY), None, **QUIET)


def test_cli_bad_pre_flags_and_unknown_snapshots_are_one_line(tmp_path, capsys):
    # the bugs: `rlfunc train sac --run-dir` printed argparse's usage block as `__main__.py`; `rlfunc eval`
    # of a snapshot of no registered algorithm said "expected 'ppo'" (the fallback entry's loader)
    for argv in (["train", "sac", "--run-dir"], ["train", "ppo", "--env"], ["train", "ppo", "--env", "Pendulum-v1", "--shaping"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"rlfunc: error: rlfunc train {argv[1]}: argument"), err
    train(preset("Pendulum-v1", **TINY), tmp_path / "run", evaluate=False, **QUIET)
    snap = checkpoint.latest_snapshot(tmp_path / "run")
    state, meta = checkpoint.load_snapshot(snap)
    checkpoint.save_snapshot(snap, state, {**meta, "algo": "nope"})
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "snapshot algo='nope': expected one of ppo, ppo-encoder, bc" in err[0], err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["env"] == "Pendulum-v1"


def test_a_second_train_into_a_run_dir_in_use_is_refused_and_leaves_it_alone(tmp_path):
    """The bug: two `rlfunc train` into one new run dir both ran to the end, their metrics.jsonl lines
    interleaved and config.json of one beside the other's snapshots. A new run's dir is now made and
    locked (the lock `rlfunc resume` takes) before anything is built."""
    from rlfunc.run.checkpoint import hold_run_dir

    run = tmp_path / "run"
    run.mkdir()
    with hold_run_dir(run):  # another process's run, before it wrote anything
        with pytest.raises(ConfigError, match="another process is running this run"):
            train(preset("Pendulum-v1", **TINY), run, **QUIET)
        assert run.is_dir()  # not removed under the other run's feet
    with hold_run_dir(run):  # a lock on one run dir leaves the others alone
        train(preset("Pendulum-v1", **TINY), tmp_path / "other", evaluate=False, **QUIET)
    (run / "note.txt").write_text("written by the other run before this one held the lock")
    with pytest.raises(ConfigError, match="is not empty"):
        train(preset("Pendulum-v1", **TINY), run, **QUIET)


def test_a_run_dir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys):
    """The bug: a read-only run dir (a read-only mount) ended a resume in an OSError traceback from
    truncating metrics.jsonl, and a new run's in one from mkdir after every env and net was built."""
    import os

    train(preset("Pendulum-v1", **TINY), tmp_path / "run", evaluate=False, **QUIET)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"run_dir='.*file/run': cannot create it \(Not a directory\)"):
        train(preset("Pendulum-v1", **TINY), tmp_path / "file" / "run", **QUIET)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if mode == os.W_OK else real(path, mode, **kw))
    assert main(["resume", str(tmp_path / "run"), "--total-steps", str(2 * TINY["total_steps"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("run': not writable")

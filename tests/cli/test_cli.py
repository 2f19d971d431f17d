"""The `rlfunc` command: a tiny train/eval/resume round, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest
import torch

from rlfunc.cli.commands import main

TINY = ["--total-steps", "256", "--num-envs", "2", "--num-steps", "64", "--minibatch-size", "64",
        "--num-epochs", "1", "--eval-episodes", "2", "--device", "cpu", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(d), *TINY]) == 0
    return d


def test_train_writes_run(run_dir, capsys):
    assert (run_dir / "learning_curve.png").exists()
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [128, 256]
    assert {"time", "steps_per_s", "loss_objective", "loss_critic", "episode_return"} <= records[0].keys()
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["episodes"] == 2 and summary["mean"] < 0  # Pendulum returns are negative


def test_eval_prints_one_json_line(run_dir, capsys):
    assert main(["eval", str(run_dir), "--episodes", "3"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    summary = json.loads(out[0])
    assert summary["episodes"] == 3 and summary["std"] >= 0 and -2000 < summary["mean"] < 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--env", "NoSuchEnv-v0"], "NoSuchEnv-v0"),
        (["--env", "Pendulum-v1", "--gamma", "1.5"], "gamma=1.5"),
        (["--env", "Pendulum-v1", "--num-envs", "0"], "num_envs=0"),
        (["--env", "Pendulum-v1", "--minibatch-size", "100"], "minibatch_size=100"),
        (["--env", "Pendulum-v1", "--device", "tpu"], "device='tpu'"),
        (["--env", "Pendulum-v1", "--seed", "-1"], "seed=-1"),
        (["--env", "Pendulum-v1", "--hidden", "0"], "hidden="),
        (["--env", "Pendulum-v1", "--eval-episodes", "0"], "eval_episodes=0"),
        (["--env", "FrozenLake-v1"], "Box observations"),  # Discrete observations (Discrete actions are fine: CartPole below)
        (["--env", "CartPole-v1", "--exploration", "gsde"], "exploration='gsde'"),
    ],
)
def test_bad_train_input_is_one_line_exit_2(tmp_path, capsys, args, message):
    code = main(["train", "ppo", "--run-dir", str(tmp_path / "r"), *TINY, *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("rlfunc: error:") and message in err[-1]
    assert not (tmp_path / "r").exists()  # nothing written


def test_train_ppo_on_cartpole_discrete_actions(tmp_path, capsys):
    # `rlfunc train ppo --env CartPole-v1`: the preset (8 envs x 32 steps, a categorical actor) for 2048 steps
    run = tmp_path / "cartpole"
    code = main(["train", "ppo", "--env", "CartPole-v1", "--total-steps", "2048", "--eval-episodes", "5",
                 "--device", "cpu", "--run-dir", str(run)])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(out) == 1
    summary = json.loads(out[0])
    assert summary["env"] == "CartPole-v1" and summary["episodes"] == 5 and summary["env_steps"] == 2048
    assert summary["mean"] >= 8  # one point per step, and no episode is shorter than 8 steps
    assert json.loads((run / "eval.json").read_text()) == summary
    assert main(["eval", str(run), "--episodes", "2"]) == 0 and json.loads(capsys.readouterr().out)["episodes"] == 2
    # the bug: one env per episode, so 1e8 episodes was an out-of-memory traceback after minutes
    assert main(["eval", str(run), "--episodes", "100000000"]) == 2
    assert "episodes=100000000: expected at most 10000" in capsys.readouterr().err


def test_existing_run_is_not_overwritten(run_dir, capsys):
    before = (run_dir / "metrics.jsonl").read_text()
    assert main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(run_dir), *TINY]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_corrupt_snapshot_is_refused(tmp_path, run_dir, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    latest = (broken / "checkpoints" / "latest").read_text().strip()
    state = broken / "checkpoints" / latest / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    before = (broken / "metrics.jsonl").read_text()
    assert main(["eval", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rlfunc: error:") and "sha256" in err[-1]
    # (resume: with a version of the same step, intact, it continues from that one; see
    # test_a_corrupt_snapshot_gives_way_to_an_intact_version_of_its_branch...; without, it refuses:)
    shutil.rmtree(broken / "versions")
    assert main(["resume", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rlfunc: error:") and "sha256" in err[-1]
    # resume names the older snapshot
    assert "--snapshot step_000000000128" in err[-1]
    assert (broken / "metrics.jsonl").read_text() == before


def test_corrupt_latest_snapshot_names_older_ones_and_resume_can_continue_from_one(tmp_path, capsys):
    from rlfunc.run import checkpoint

    run = tmp_path / "run"
    assert main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(run), *TINY, "--version-every", "0"]) == 0
    ckpt = run / "checkpoints"
    assert [p.name for p in checkpoint.run_snapshots(run)] == ["step_000000000256", "step_000000000128"]
    state = ckpt / "step_000000000256" / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["resume", str(run), "--total-steps", "384"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sha256" in err[0]
    assert f"Older snapshots: step_000000000128; to continue from the newest of them: rlfunc resume {run} --snapshot step_000000000128" in err[0]
    assert main(["eval", str(run), "--episodes", "2"]) == 2  # eval names them too (it did not)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"Older snapshots: step_000000000128; to evaluate the newest of them: rlfunc eval {ckpt / 'step_000000000128'}" in err[0]
    assert main(["eval", str(ckpt / "step_000000000128"), "--episodes", "2"]) == 0
    capsys.readouterr()
    assert main(["resume", str(run), "--snapshot", "step_x"]) == 2
    assert "snapshot='step_x': not a complete snapshot" in capsys.readouterr().err
    assert main(["resume", str(run), "--total-steps", "384", "--snapshot", "step_000000000128"]) == 0
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [128, 256, 384]  # 256 redone from 128, the corrupt one saved over
    assert checkpoint.latest_snapshot(run).name == "step_000000000384"
    checkpoint.load_snapshot(ckpt / "step_000000000256")  # sound again


def test_refused_resume_from_a_snapshot_leaves_latest_as_it_was(tmp_path, run_dir, capsys):
    # --snapshot points 'latest' at NAME; when the resume is then refused (nothing run), a later plain
    # resume must still continue from the snapshot 'latest' named before, not silently from NAME
    import shutil

    from rlfunc.run import checkpoint

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    latest = run / "checkpoints" / "latest"
    assert latest.read_text().strip() == "step_000000000256"
    before = (run / "metrics.jsonl").read_text()
    assert main(["resume", str(run), "--snapshot", "step_000000000128", "--total-steps", "0"]) == 2
    assert "total_steps=0" in capsys.readouterr().err
    state = run / "checkpoints" / "step_000000000128" / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    assert main(["resume", str(run), "--snapshot", "step_000000000128"]) == 2
    assert "sha256" in capsys.readouterr().err
    assert latest.read_text().strip() == "step_000000000256"
    assert checkpoint.latest_snapshot(run).name == "step_000000000256"
    assert (run / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize(
    "argv, message",
    [([], "no command"), (["bogus"], "unknown command 'bogus'"), (["train"], "algorithm"), (["train", "redq"], "'redq'")],
)
def test_bad_commands_are_one_line_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_run_dir_that_is_a_file_or_not_empty(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    assert main(["train", "ppo", "--run-dir", str(afile), *TINY]) == 2
    assert "not a directory" in capsys.readouterr().err
    other = tmp_path / "proj"
    other.mkdir()
    (other / "config.json").write_text("mine")
    assert main(["train", "ppo", "--run-dir", str(other), *TINY]) == 2
    assert "not empty" in capsys.readouterr().err
    assert afile.read_text() == "keep me" and (other / "config.json").read_text() == "mine"


def test_eval_refuses_snapshot_whose_config_does_not_match(tmp_path, run_dir, capsys):
    import shutil

    from rlfunc.run.checkpoint import record_digest

    bad = tmp_path / "bad"
    shutil.copytree(run_dir, bad)
    snap = bad / "checkpoints" / (bad / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((snap / "meta.json").read_text())
    meta["meta"]["config"]["hidden"] = [128, 128]
    meta["record_sha256"] = record_digest(meta)  # re-signed: the config check itself must refuse it
    (snap / "meta.json").write_text(json.dumps(meta))
    assert main(["eval", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match" in err[0]
    meta["meta"]["config"] = None
    meta["record_sha256"] = record_digest(meta)
    (snap / "meta.json").write_text(json.dumps(meta))
    assert main(["eval", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a valid PPOConfig" in err[0] and str(snap) in err[0]


def test_entry_point_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rlfunc.cli", "train", "ppo", "--env", "Nope-v0", "--run-dir", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("rlfunc: error: env='Nope-v0'")


@pytest.mark.parametrize("sig, copies", [("SIGINT", 1), ("SIGTERM", 1), ("SIGINT", 2)])
def test_signal_saves_snapshot_and_exits_cleanly(tmp_path, sig, copies):
    # copies=2: the signal twice in a row, as `timeout -s INT` delivers it (command, then its group)
    import signal
    import time

    from rlfunc.run import checkpoint

    run = tmp_path / "run"
    args = [sys.executable, "-m", "rlfunc.cli", "train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(run),
            *TINY[2:], "--total-steps", "1280000", "--checkpoint-every", "0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    for _ in range(copies):
        proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + getattr(signal, sig), err  # 130 for SIGINT, 143 for SIGTERM
    assert f"interrupted ({sig}): snapshot saved" in err and "stopping after this iteration" in err
    snap = checkpoint.latest_snapshot(run)
    meta = checkpoint.load_meta(snap)
    lines = metrics.read_text().splitlines()
    assert 2 <= meta["iteration"] == len(lines) < 10000  # saved at the iteration it stopped after


def test_shaping_preset_flag_and_unknown_name(tmp_path, capsys):
    """`--shaping ppo-shaped` starts from the shaping preset (every transform on); an unknown name is
    one line, exit 2."""
    from rlfunc.cli.commands import main

    assert main(["train", "ppo", "--env", "Pendulum-v1", "--shaping", "nope", "--run-dir", str(tmp_path / "x")]) == 2
    assert "shaping='nope'" in capsys.readouterr().err
    code = main(["train", "ppo", "--env", "Pendulum-v1", "--shaping", "ppo-shaped", "--total-steps", "2048",
                 "--num-envs", "2", "--num-steps", "1024", "--minibatch-size", "64", "--num-epochs", "1",
                 "--version-every", "0", "--run-dir", str(tmp_path / "r")])
    assert code == 0
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["oscillation_damping"] and config["adaptive_clip"] and config["prioritized_minibatches"]
    assert config["max_grad_norm"] == 0.3 and config["hessian_interval"] == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--total-steps", "128"], "total_steps=128: the run has already done 2 iterations (256 env steps per seed)"),
        (["--total-steps", "0"], "total_steps=0: expected an int >= 1"),
        (["--total-steps", "1.5"], "argument --total-steps: invalid int value: '1.5'"),
    ],
)
def test_bad_resume_budget_is_one_line_exit_2(tmp_path, run_dir, capsys, args, message):
    """The inputs that broke it: a budget below the steps done was accepted (and config.json
    recorded it), 0 was blamed on the snapshot, and a non-integer printed argparse's usage block."""
    import shutil

    d = tmp_path / "run"
    shutil.copytree(run_dir, d)
    config_before = (d / "config.json").read_text()
    capsys.readouterr()
    assert main(["resume", str(d), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlfunc: error:") and message in err[0]
    assert (d / "config.json").read_text() == config_before


def test_interrupted_runs_say_how_to_continue(capsys):
    from types import SimpleNamespace

    from rlfunc.cli.common import report_run

    result = SimpleNamespace(run_dir="runs/x", interrupted="SIGTERM", evaluation=None)
    assert report_run(result, "evaluate it with `rlfunc eval runs/x`") == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("interrupted (SIGTERM): snapshot saved; continue with `rlfunc resume runs/x`; "
                       "or evaluate it with `rlfunc eval runs/x`")


def test_a_run_saved_on_another_device_type_evaluates_the_same_and_resume_names_the_device(tmp_path, run_dir, capsys):
    # `rlfunc eval` of a CPU-trained run on a GPU machine (device auto -> cuda) failed on the generator
    # states' shapes; here the other way round: the snapshot's states made 16-byte, as CUDA saves them
    import shutil

    from rlfunc.run import checkpoint

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    assert main(["eval", str(run), "--episodes", "3", "--device", "cpu"]) == 0
    before = json.loads(capsys.readouterr().out)
    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    state["learner", "rng"] = torch.zeros(state["learner", "rng"].shape[0], 16, dtype=torch.uint8)
    checkpoint.save_snapshot(snap, state, meta)
    assert main(["eval", str(run), "--episodes", "3", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out) == before
    assert main(["resume", str(run), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "saved on another device type than cpu" in err and "resume it with --device cuda or npu" in err


def test_resume_on_a_named_device(tmp_path, run_dir, capsys):
    import shutil

    from rlfunc.run import checkpoint

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    if not torch.cuda.is_available():
        assert main(["resume", str(run), "--device", "cuda"]) == 2
        assert "cuda" in capsys.readouterr().err
    assert main(["resume", str(run), "--device", "cpu", "--total-steps", "384"]) == 0
    meta = checkpoint.load_meta(checkpoint.latest_snapshot(run))
    assert meta["env_steps"] == 384 and meta["config"]["run"]["device"] == "cpu"


def test_a_version_saved_on_another_device_type_names_the_device_on_resume(tmp_path, run_dir, capsys):
    # after `rlfunc versions rollback`, resume loads a version, not a snapshot: its generator states of
    # the other device type gave "does not match the run: key 'learner.rng' ..." without the device to use
    import shutil

    from rlfunc.run import versions

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    state, manifest = versions.load_version(run, "v000001")
    state["learner", "rng"] = torch.zeros(state["learner", "rng"].shape[0], 16, dtype=torch.uint8)  # as CUDA saves them
    saved = versions.save_version(run, state, manifest["meta"], iteration=manifest["iteration"], step=manifest["step"],
                                  metrics=manifest["metrics"])
    assert main(["versions", "rollback", str(run), saved["id"]]) == 0
    metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["resume", str(run), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlfunc: error: {saved['id']} of {run}: its random-generator states "
                                               "(learner.rng) were saved on another device type than cpu")
    assert err[0].endswith("resume it with --device cuda or npu")
    assert (run / "metrics.jsonl").read_text() == metrics  # refused before anything was cut or written


def test_resume_on_a_bad_device_writes_nothing(tmp_path, run_dir, capsys):
    import shutil

    from rlfunc.run import checkpoint

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    files = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    older = checkpoint.run_snapshots(run)[-1].name
    cases = [(["--device", "gpu"], "device='gpu': expected one of auto, cpu, cuda, npu"),
             (["--device", "cpu:x"], "device='cpu:x'"),
             (["--device", "cuda", "--snapshot", older], "device='cuda'" if not torch.cuda.is_available() else None)]
    for args, message in cases:
        if message is None:
            continue
        assert main(["resume", str(run), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], args
        assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == files, args  # latest included


def test_parse_config_builds_the_library_classes_and_validates_once_outside_tyro():
    # no validation-off subclasses: tyro parses the config dataclasses themselves, nested ones
    # included, and the constructor's ConfigError comes out as itself (one line), not tyro's box
    from rlfunc.algos.bc import BCConfig
    from rlfunc.algos.diffusion_actor import ActorSpec
    from rlfunc.cli.common import parse_config
    from rlfunc.errors import ConfigError

    config = parse_config(BCConfig, ["--lr", "0.01", "--actor.horizon", "8"], default=BCConfig(), prog="p", description="d")
    assert type(config) is BCConfig and type(config.actor) is ActorSpec
    assert config.lr == 0.01 and config.actor.horizon == 8 and config.actor.act_steps == BCConfig().actor.act_steps
    with pytest.raises(ConfigError, match="act_steps=4: expected 1 <= act_steps <= horizon=2"):
        parse_config(BCConfig, ["--actor.horizon", "2"], default=BCConfig(), prog="p", description="d")
    with pytest.raises(ConfigError, match="lr and max_grad_norm must be > 0"):
        parse_config(BCConfig, ["--lr", "-1"], default=BCConfig(), prog="p", description="d")


def test_torchrl_info_lines_go_to_stderr_so_stdout_is_the_json_line():
    # found by a fresh-user pass: `rlfunc train td3-diffusion` printed torchrl's "Initialized
    # LazyTensorStorage" INFO line on stdout before the evaluation's JSON line
    import subprocess
    import sys

    code = ("from rlfunc.cli.commands import _torchrl_logs_to_stderr; _torchrl_logs_to_stderr()\n"
            "import torch; from tensordict import TensorDict; from torchrl.data import LazyTensorStorage, ReplayBuffer\n"
            "ReplayBuffer(storage=LazyTensorStorage(4)).extend(TensorDict({'a': torch.zeros(2, 1)}, batch_size=[2]))\n"
            "print('{}')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "{}\n"
    assert "LazyTensorStorage" in out.stderr


def test_a_closed_pipe_ends_the_command_quietly():
    # found by a fresh-user pass: `rlfunc versions diff RUN V1 V2 | head -5` ended in a BrokenPipeError traceback
    import subprocess
    import sys

    code = ("import sys\nfrom rlfunc.cli import commands\n"
            "def listing(argv):\n    raise BrokenPipeError(32, 'Broken pipe')\n"
            "commands.COMMANDS['versions'] = listing\nsys.exit(commands.main(['versions', 'list', 'x']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 141 and "Traceback" not in out.stderr


def test_resume_of_a_directory_that_does_not_exist_says_so(tmp_path, capsys):
    assert main(["resume", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such directory" in err[0]
    (tmp_path / "file").write_text("x")  # fault pass: a file was "no such directory" too
    assert main(["resume", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "file': not a directory (rlfunc resume continues" in err[0]
    assert main(["versions", "list", str(tmp_path / "file")]) == 2
    assert "file': not a directory" in capsys.readouterr().err


def test_eval_of_a_directory_that_does_not_exist_says_so(tmp_path, capsys):
    # the bug: "holds no complete snapshot (train first)", as if the run existed
    assert main(["eval", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("nope: no such directory (expected a run dir or a snapshot dir)")


def test_launch_inside_torchrun_of_one_rank_runs_in_this_process(monkeypatch, tmp_path):
    # Regression (new-user pass): `torchrun --nproc-per-node 1 -m rlfunc resume RUN_DIR` of a 2-rank run
    # started a second torchrun of 2 ranks inside it (WORLD_SIZE was 1, so the launcher did not see torchrun)
    from rlfunc.cli.common import launch, under_torchrun

    for var in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert not under_torchrun() and launch(["resume", "x"], 1, "x") is None  # one rank: nothing to launch
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert under_torchrun() and launch(["resume", "x"], 2, "x") is None
    # and `rlfunc resume --nproc N` takes the rank count from the user (N >= 1)
    assert main(["resume", str(tmp_path), "--nproc", "0"]) == 2


def test_rlfunc_warnings_are_one_line(capsys):
    import warnings

    from rlfunc.cli import commands

    fmt = commands._one_line_warning(warnings.formatwarning)
    ours = fmt("a damaged version skipped", UserWarning, f"{commands._PACKAGE_DIR}/run/loop.py", 168, "head = x")
    assert ours == "rlfunc: warning: a damaged version skipped\n"
    theirs = fmt("deprecated", UserWarning, "/site-packages/gymnasium/core.py", 3, "x = 1")
    assert "rlfunc" not in theirs and "gymnasium/core.py:3: UserWarning: deprecated" in theirs


@pytest.mark.parametrize("checkpoint_every, says, signum", [("10", "before the run's first snapshot", 2),
                                                           ("1", "keeps its snapshots: continue with", 15)])
def test_a_second_signal_says_whether_anything_is_there_to_resume(tmp_path, capsys, monkeypatch, checkpoint_every, says, signum):
    # Regression: a run stopped at once (a second Ctrl-C) before its first snapshot printed "a run's snapshots
    # are kept", of a run dir with metrics lines and nothing to resume (which `rlfunc train` then refuses)
    from rlfunc.run.ppo import PPORun

    step = PPORun.step

    def second_signal_in_iteration_2(self, i, stopping):
        if i == 2:
            from rlfunc.run.resume import _interrupt

            raise _interrupt(signum)
        return step(self, i, stopping)

    monkeypatch.setattr(PPORun, "step", second_signal_in_iteration_2)
    run = tmp_path / "run"
    argv = ["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(run), *TINY, "--version-every", "0"]
    argv[argv.index("--checkpoint-every") + 1] = checkpoint_every
    assert main(argv) == 128 + signum  # SIGTERM's 143 (two SIGTERMs gave 130)
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and len((run / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("swallowed", [False, True])
def test_a_signal_during_the_final_evaluation_always_ends_it_without_eval_json(tmp_path, capsys, monkeypatch, swallowed):
    # Regression (new-user pass): SIGINT during the final evaluation was racy: where Python could only print the
    # KeyboardInterrupt (a weakref callback: "Exception ignored in ..."), the evaluation ran on, wrote eval.json and
    # exited 0. Now the signal is remembered: exit 130, no eval.json, and `rlfunc resume` evaluates
    import os
    import signal

    from rlfunc.run.ppo import PPORun

    evaluate = PPORun.evaluate

    def interrupted(self):
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            if not swallowed:
                raise
        return evaluate(self)

    monkeypatch.setattr(PPORun, "evaluate", interrupted)
    run = tmp_path / "run"
    assert main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(run), *TINY]) == 130
    assert "during the final evaluation" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (run / "eval.json").exists()
    monkeypatch.setattr(PPORun, "evaluate", evaluate)
    assert main(["resume", str(run)]) == 0
    assert json.loads((run / "eval.json").read_text())["env_steps"] == 256
    # a longer budget interrupted in its evaluation leaves no eval.json of the shorter one (it did: stale)
    monkeypatch.setattr(PPORun, "evaluate", interrupted)
    assert main(["resume", str(run), "--total-steps", "384"]) == 130
    assert not (run / "eval.json").exists()


def test_an_unreadable_latest_meta_json_gives_way_to_the_head_version_or_names_older_snapshots(tmp_path, capsys):
    # Regression (new-user pass): a truncated meta.json of the latest snapshot blocked `rlfunc resume` though the
    # head version holds the same state, and `rlfunc eval` named no older snapshot (a corrupt state file's error does)
    for versioned in (True, False):
        run = tmp_path / f"run{versioned}"
        assert main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(run), *TINY,
                     "--version-every", "1" if versioned else "0"]) == 0
        meta = run / "checkpoints" / "step_000000000256" / "meta.json"
        meta.write_text(meta.read_text()[:100])
        capsys.readouterr()
        if versioned:
            with pytest.warns(UserWarning, match="meta.json: not valid JSON.*continuing from version v000002"):
                assert main(["eval", str(run), "--episodes", "2"]) == 0
            assert json.loads(capsys.readouterr().out)["env_steps"] == 256
            with pytest.warns(UserWarning, match="continuing from version v000002"):
                assert main(["resume", str(run), "--total-steps", "384"]) == 0
            assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == [128, 256, 384]
        else:
            assert main(["eval", str(run), "--episodes", "2"]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "not valid JSON" in err[0] and "Older snapshots: step_000000000128" in err[0]


@pytest.mark.parametrize("algo", ["ppo", "dppo", "sac", "td3-diffusion", "grpo"])
def test_an_env_that_cannot_be_built_is_one_line_exit_2(tmp_path, capsys, algo):
    # `rlfunc train ppo|dppo --env BipedalWalker-v3` without box2d printed a traceback and exited 1:
    # ppo's Dict-observation probe and dppo's success probe called gym.make directly.
    import gymnasium as gym

    def broken(**kwargs):
        raise gym.error.DependencyNotInstalled("Box2D is not installed\nsecond line")

    if "BrokenCliTest-v0" not in gym.registry:
        gym.register("BrokenCliTest-v0", entry_point=broken)
    code = main(["train", algo, "--env", "BrokenCliTest-v0", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "env='BrokenCliTest-v0' could not be built: DependencyNotInstalled: Box2D is not installed" in err[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_train_help_lists_every_algorithm(capsys, flag):
    # `rlfunc train --help` was an error ("algorithm: expected one of ..., got '--help'", exit 2)
    from rlfunc.algos import registry

    assert main(["train", flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rlfunc train ALGO")
    listed = " ".join(line.split()[2] for line in out.splitlines() if line.strip().startswith("rlfunc train "))
    for name in registry.names():  # gspo shares grpo's line: "rlfunc train grpo|gspo"
        assert name in listed.replace("|", " ").split(), name


def test_a_damaged_version_manifest_is_warned_about_once_per_command(tmp_path, capsys):
    # `rlfunc versions list` and `rlfunc resume` printed the same "unreadable manifest" warning twice
    # (one per scan of the store), and it promised a row in `versions list` that was not there
    run = tmp_path / "run"
    assert main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(run), *TINY, "--version-every", "1"]) == 0
    capsys.readouterr()
    (run / "versions" / "manifests" / "v000001.json").write_text("{")
    for argv in (["versions", "list", str(run)], ["resume", str(run), "--total-steps", "384"]):
        proc = subprocess.run([sys.executable, "-m", "rlfunc", *argv], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        warned = [line for line in proc.stderr.splitlines() if "v000001.json: unreadable manifest" in line]
        assert len(warned) == 1, proc.stderr
        assert "version v000001 skipped (restore or delete the file" in warned[0]


def test_the_launcher_names_the_rank_that_failed_for_its_own_reason():
    # rank 1's env worker was killed: rank 1 exited 2 with its error, but rank 0, which lost its peer,
    # exited 1 a moment before it, and the launcher's line said "rank 0 of 2 failed"
    from types import SimpleNamespace as F

    from rlfunc.cli.common import failed_rank

    assert failed_rank({0: F(exitcode=1, timestamp=10), 1: F(exitcode=2, timestamp=11)})[0] == 1
    assert failed_rank({0: F(exitcode=1, timestamp=10), 1: F(exitcode=-9, timestamp=12)})[0] == 1  # SIGKILL
    assert failed_rank({0: F(exitcode=2, timestamp=11), 1: F(exitcode=2, timestamp=10)})[0] == 1  # the first
    assert failed_rank({0: F(exitcode=1, timestamp=11), 1: F(exitcode=1, timestamp=10)})[0] == 1  # all lost peers
    # rank 1 SIGKILLed, rank 0 then ended by the agent's SIGTERM in the same second (timestamps are whole seconds)
    assert failed_rank({0: F(exitcode=-15, timestamp=10), 1: F(exitcode=-9, timestamp=10)})[0] == 1
    assert failed_rank({0: F(exitcode=-15, timestamp=10), 1: F(exitcode=1, timestamp=9)})[0] == 0  # a SIGTERM of its own
    assert failed_rank({1: F(exitcode=2, timestamp=10), 0: F(exitcode=2, timestamp=10)})[0] == 1  # ties: elastic's order


def test_a_rank_error_names_its_rank(tmp_path, monkeypatch, capsys):
    # under torchrun the ranks' error lines interleave; "rlfunc: error: env worker 0: ..." did not say whose
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.startswith("rlfunc: error: rank 1: ")
    monkeypatch.setenv("WORLD_SIZE", "x")  # malformed: no prefix, and no traceback from the error path
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    assert not capsys.readouterr().err.startswith("rlfunc: error: rank")


def test_resume_refuses_a_foreign_snapshot_and_a_damaged_env_state_in_one_line(tmp_path, run_dir, capsys):
    """Fault pass: another run's snapshot copied in under the latest name resumed as that run (and cut
    metrics.jsonl to its step); a damaged env state in meta.json was an IndexError / ValueError traceback."""
    import shutil

    from rlfunc.run.checkpoint import record_digest

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "versions")  # (with them, resume takes the head version, as far along as the snapshot)
    ckpt = copy / "checkpoints"
    before = (copy / "metrics.jsonl").read_text()
    shutil.rmtree(ckpt / "step_000000000256")
    shutil.copytree(ckpt / "step_000000000128", ckpt / "step_000000000256")  # a snapshot of another step, renamed
    assert main(["resume", str(copy), "--total-steps", "384"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "named for step 256 but holds env_steps=128 (copied from another run?)" in err[0], err
    assert (copy / "metrics.jsonl").read_text() == before  # nothing cut
    shutil.rmtree(ckpt / "step_000000000256")
    shutil.copytree(run_dir / "checkpoints" / "step_000000000256", ckpt / "step_000000000256")
    meta_path = ckpt / "step_000000000256" / "meta.json"
    record = json.loads(meta_path.read_text())
    record["meta"]["env_state"] = record["meta"]["env_state"][:1]  # one env's state of the two
    record["record_sha256"] = record_digest(record)  # signed: the restore itself must refuse it
    meta_path.write_text(json.dumps(record))
    assert main(["resume", str(copy), "--total-steps", "384"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its env, RNG or run state does not fit this run" in err[0], err


def test_a_write_error_outside_the_snapshot_code_is_one_line(tmp_path, capsys, monkeypatch):
    """Fault pass: a file-size limit hit by TensorBoard's event file, a full disk under metrics.jsonl, a
    dangling-link run dir: OSError tracebacks (exit 1)."""
    import rlfunc.run.loop as loop

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "run" / "learning_curve.png"))

    monkeypatch.setattr(loop, "plot_learning_curve", full)
    assert main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(tmp_path / "run"), *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rlfunc: error: OSError: [Errno 28] No space left on device") and len(
        [line for line in err if line.startswith("rlfunc: error")]) == 1
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()  # the snapshots written stay
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere" / "deeper")
    code = main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(link), *TINY])
    assert code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_eval_takes_the_new_latest_when_a_training_run_prunes_the_one_it_picked(tmp_path, run_dir, capsys, monkeypatch):
    """Fault pass: `rlfunc eval RUN` beside a run with --keep-checkpoints 1 failed 2 of 7 times with
    "no snapshot here (directory missing)": the run pruned the snapshot eval had picked."""
    import shutil

    from rlfunc.run import checkpoint

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    real = checkpoint.snapshot_to_read
    calls = []

    def pruned_once(path):
        snap = real(path)
        if not calls:  # the training run prunes it right after eval picked it, and points latest at the other
            shutil.rmtree(snap)
            (copy / "checkpoints" / "latest").write_text("step_000000000128\n")
        calls.append(snap.name)
        return snap

    monkeypatch.setattr(checkpoint, "snapshot_to_read", pruned_once)
    assert main(["eval", str(copy), "--episodes", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["env_steps"] == 128 and calls[:2] == ["step_000000000256", "step_000000000128"]


def test_a_corrupt_snapshot_gives_way_to_an_intact_version_of_its_branch_and_snapshot_says_when_passed_over(
        tmp_path, run_dir, capsys):
    """Fault pass: a truncated state.safetensors at step 256 was refused though version v000002 of the same
    step was intact (an unreadable meta.json there already gave way to it); `--snapshot OLDER` was passed
    over for the head version without a word."""
    import shutil
    import warnings

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    state = copy / "checkpoints" / "step_000000000256" / "state.safetensors"
    state.write_bytes(state.read_bytes()[:100])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["resume", str(copy), "--total-steps", "384"]) == 0
    said = [str(w.message) for w in caught if "continuing from version" in str(w.message)]
    assert len(said) == 1 and "continuing from version v000002 (step 256), the branch's head" in said[0], said
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["env_steps"] == 384
    copy2 = tmp_path / "copy2"
    shutil.copytree(run_dir, copy2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["resume", str(copy2), "--snapshot", "step_000000000128", "--total-steps", "384"]) == 0
    said = [str(w.message) for w in caught if "--snapshot step_000000000128" in str(w.message)]
    assert len(said) == 1 and "head version v000002 is further along" in said[0], said


def test_a_run_dir_removed_after_an_interrupt_before_its_first_iteration_is_said(tmp_path, capsys, monkeypatch):
    """README pass: a second Ctrl-C during the first iteration removed the run dir (nothing in it to
    resume) and printed only "rlfunc: interrupted"."""
    import rlfunc.run.loop as loop

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_train", interrupted)
    run = tmp_path / "run"
    assert main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(run), *TINY]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"rlfunc: interrupted before the run's first iteration ended; {run} was removed (nothing to resume)"
    assert not run.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_missing_device_with_nproc_is_one_line_before_any_rank_starts(tmp_path, capsys):
    # the bug (data-parallel pass): each of the 2 ranks printed "device='cuda': this machine has no CUDA
    # device", then the launcher a third line; the device is resolved before torchrun now
    code = main(["train", "ppo", "--env", "Pendulum-v1", "--total-steps", "256", "--num-envs", "4", "--num-steps", "32",
                 "--minibatch-size", "64", "--nproc", "2", "--device", "cuda", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "device='cuda': this machine has no CUDA device" in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_new_run_whose_minibatches_normalise_every_advantage_to_zero_is_refused(tmp_path, capsys, monkeypatch):
    # Regression (PPO break pass): `--minibatch-size 1` with advantage normalisation (the default) trained no
    # policy, silently: a one-sample minibatch's advantage normalises to 0. A run saved with it (before the
    # check) is still evaluated and resumed: the check is where a new run is built, not in the config.
    import rlfunc.run.ppo as run_ppo

    flags = ["--total-steps", "64", "--num-envs", "1", "--num-steps", "32", "--num-epochs", "1", "--eval-episodes", "2",
             "--device", "cpu", "--checkpoint-every", "1"]
    code = main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(tmp_path / "new"), "--minibatch-size", "1", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "minibatch_size=1 with normalize_advantages" in err[0], err
    assert not (tmp_path / "new").exists()
    assert main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(tmp_path / "off"), "--minibatch-size", "1",
                 "--no-normalize-advantages", "--total-steps", "32", *flags[2:]]) == 0  # without normalisation it trains
    capsys.readouterr()
    monkeypatch.setattr(run_ppo, "check_new_ppo_run", lambda config: None)  # a run saved before the check
    assert main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(tmp_path / "old"), "--minibatch-size", "1",
                 "--total-steps", "32", *flags[2:]]) == 0
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "old"), "--episodes", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["episodes"] == 2
    assert main(["resume", str(tmp_path / "old"), "--total-steps", "64"]) == 0
    assert json.loads((tmp_path / "old" / "eval.json").read_text())["env_steps"] == 64


def test_a_new_encoder_run_with_one_sample_minibatches_is_refused(tmp_path):
    from rlfunc.algos.ppo_encoder import PPOEncoderConfig
    from rlfunc.config import check_new_ppo_run, replace
    from rlfunc.errors import ConfigError
    from rlfunc.run import train

    config = replace(PPOEncoderConfig(), num_envs=1, num_steps=8, minibatch_size=1, device="cpu")
    with pytest.raises(ConfigError, match="^minibatch_size=1 with normalize_advantages"):
        train(config, tmp_path / "r", progress=False, tensorboard=False)
    assert not (tmp_path / "r").exists()
    check_new_ppo_run(replace(config, normalize_advantages=False))
    check_new_ppo_run(PPOEncoderConfig())

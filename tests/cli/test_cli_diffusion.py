"""`rlfunc train bc | dppo | td3-diffusion | sac-diffusion` and `rlfunc eval` on their runs; one-line errors."""

import json
import shutil

import pytest

from rlfunc.cli.commands import main

ACTOR = ["--actor.hidden", "32", "32", "--actor.ddim-steps", "3", "--actor.num-train-steps", "6"]
BC = ["--num-demos", "8", "--num-updates", "20", "--batch-size", "32", "--log-every", "10", "--eval-episodes", "8",
      "--device", "cpu", *ACTOR]


@pytest.fixture(scope="module")
def bc_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_bc") / "bc"
    assert main(["train", "bc", "--run-dir", str(d), *BC]) == 0
    return d


def test_train_bc_prints_its_evaluation(bc_dir):
    summary = json.loads((bc_dir / "eval.json").read_text())
    assert summary["num_episodes"] == 8
    assert summary["share_goal_a"] + summary["share_goal_b"] + summary["share_neither"] == pytest.approx(1.0)
    config = json.loads((bc_dir / "config.json").read_text())
    assert config["actor"]["hidden"] == [32, 32] and config["num_updates"] == 20


def test_eval_of_a_diffusion_run(bc_dir, capsys):
    assert main(["eval", str(bc_dir), "--episodes", "5", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["algo"] == "bc" and out["episodes"] == 5 and 0.0 <= out["success_rate"] <= 1.0
    # with the run's own defaults it repeats eval.json, key for key (the final evaluation had no "episodes")
    assert main(["eval", str(bc_dir), "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads((bc_dir / "eval.json").read_text())


def test_resume_of_a_bc_run_with_a_new_budget(bc_dir, tmp_path, capsys):
    d = tmp_path / "bc"
    shutil.copytree(bc_dir, d)
    capsys.readouterr()
    assert main(["resume", str(d), "--total-steps", "30"]) == 0  # bc's budget is in updates
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_episodes"] == 8
    assert json.loads((d / "config.json").read_text())["num_updates"] == 30
    meta = json.loads((d / "checkpoints" / (d / "checkpoints" / "latest").read_text().strip() / "meta.json").read_text())
    assert meta["meta"]["iteration"] == 30


@pytest.mark.parametrize("likelihood", ["chain", "output-noise"])
def test_train_dppo_from_bc(bc_dir, tmp_path, likelihood, capsys):
    d = tmp_path / "dppo"
    args = ["train", "dppo", "--init-from", str(bc_dir), "--likelihood", likelihood, "--total-steps", "512",
            "--num-envs", "16", "--num-steps", "8", "--minibatch-size", "64", "--num-epochs", "1",
            "--eval-episodes", "4", "--device", "cpu", "--run-dir", str(d)]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_episodes"] == 4
    assert (d / "learning_curve.png").exists()
    meta = json.loads((d / "checkpoints" / (d / "checkpoints" / "latest").read_text().strip() / "meta.json").read_text())
    assert meta["meta"]["actor_spec"]["hidden"] == [32, 32]  # the bc actor's architecture, not dppo's default


def test_train_td3_diffusion(tmp_path, capsys):
    d = tmp_path / "td3"
    args = ["train", "td3-diffusion", "--total-steps", "960", "--num-envs", "16", "--num-steps", "30",
            "--warmup-steps", "480", "--updates-per-iteration", "2", "--batch-size", "32", "--eval-episodes", "4",
            "--actor.hidden", "32", "32", "--actor.ddim-steps", "2", "--device", "cpu", "--run-dir", str(d)]
    assert main(args) == 0
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 2


def test_train_sac_diffusion_then_eval(tmp_path, capsys):
    d = tmp_path / "sac"
    args = ["train", "sac-diffusion", "--total-steps", "960", "--num-envs", "16", "--num-steps", "30",
            "--warmup-steps", "480", "--updates-per-iteration", "2", "--batch-size", "32", "--eval-episodes", "4",
            "--entropy-every", "1", "--entropy-states", "4", "--entropy-samples", "10",
            "--actor.hidden", "32", "32", "--actor.ddim-steps", "2", "--device", "cpu", "--run-dir", str(d)]
    assert main(args) == 0
    lines = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[-1]["alpha"] > 0 and "entropy" in lines[-1]
    capsys.readouterr()
    assert main(["eval", str(d), "--episodes", "6"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["algo"] == "sac-diffusion" and out["episodes"] == 6 and 0.0 <= out["success_rate"] <= 1.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "sac-diffusion", "--entropy-samples", "2"], "entropy_samples=2"),
        (["train", "sac-diffusion", "--actor.horizon", "4"], "sac-diffusion's critic scores the executed chunk"),
        (["train", "dppo", "--init-from", "/no/such/run"], "/no/such/run"),
        (["train", "dppo", "--gamma", "2"], "gamma=2"),
        (["train", "dppo", "--likelihood", "chain", "--minibatch-size", "7"], "minibatch_size=7"),
        (["train", "bc", "--env", "Pendulum-v1"], "PointReach-v0"),
        (["train", "bc", "--actor.act-steps", "9"], "act_steps=9"),
        (["train", "td3-diffusion", "--tau", "0"], "tau=0"),
    ],
)
def test_bad_diffusion_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    code = main([*argv, "--run-dir", str(tmp_path / "r"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith("rlfunc: error:") and message in err[-1], err
    assert not (tmp_path / "r").exists()  # nothing written


def test_a_diffusion_run_saved_on_another_device_type(bc_dir, tmp_path, capsys):
    # evaluation loads it (load_actor reads no generator state); resume said "resume it on the device it
    # ran on" without naming that device, and took any other difference of "rng" for another device type
    import torch

    from rlfunc.run import checkpoint

    d = tmp_path / "bc"
    shutil.copytree(bc_dir, d)
    assert main(["eval", str(d), "--episodes", "3", "--device", "cpu"]) == 0
    before = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    snap = checkpoint.latest_snapshot(d)
    state, meta = checkpoint.load_snapshot(snap)
    state["learner", "rng"] = torch.zeros(16, dtype=torch.uint8)  # a CUDA generator's state
    checkpoint.save_snapshot(snap, state, meta)
    assert main(["eval", str(d), "--episodes", "3", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == before
    metrics = (d / "metrics.jsonl").read_text()
    assert main(["resume", str(d), "--total-steps", "30"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its random-generator states (rng) were saved on another device type than cpu" in err[0]
    assert err[0].endswith("resume it with --device cuda or npu")
    assert (d / "metrics.jsonl").read_text() == metrics and checkpoint.latest_snapshot(d) == snap
    state["learner", "rng"] = torch.zeros(2, 5056, dtype=torch.uint8)  # not another device's: a structure error
    checkpoint.save_snapshot(snap, state, meta)
    assert main(["resume", str(d)]) == 2
    assert "learner key 'rng' is ((2, 5056), torch.uint8) in the snapshot" in capsys.readouterr().err


def test_actor_flags_are_ignored_with_init_from_as_the_readme_says(bc_dir, tmp_path, capsys):
    """`--actor.horizon 2` (act_steps 4) was refused before the snapshot's actor replaced the flags'."""
    d = tmp_path / "td3"
    args = ["train", "td3-diffusion", "--init-from", str(bc_dir), "--actor.horizon", "2", "--total-steps", "640",
            "--num-envs", "16", "--num-steps", "10", "--warmup-steps", "320", "--updates-per-iteration", "1",
            "--batch-size", "32", "--eval-episodes", "4", "--device", "cpu", "--run-dir", str(d)]
    assert main(args) == 0
    used = json.loads((d / "config.json").read_text())["actor"]
    assert used == json.loads((bc_dir / "config.json").read_text())["actor"]


def test_short_flags_in_both_spellings():
    # Regression (new-user pass): `--demos=5` was "Unrecognized options: --demos=5"; only `--demos 5` worked
    from rlfunc.cli.diffusion import _alias

    assert [_alias(a) for a in ("--demos", "5", "--demos=5", "--init=runs/x", "--demosx=1", "--lr=1")] == \
        ["--num-demos", "5", "--num-demos=5", "--init-from=runs/x", "--demosx=1", "--lr=1"]


def test_init_from_a_run_on_another_env_names_that_env(bc_dir, tmp_path, capsys):
    # the refusal said which env the bc actor reads but not how to train on it
    code = main(["train", "dppo", "--env", "Pendulum-v1", "--init-from", str(bc_dir), "--run-dir", str(tmp_path / "r"),
                 "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "its actor reads 'PointReach-v0' observations" in err[0] and err[0].endswith("; train on its env with --env PointReach-v0")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flags, named", [
    (["--minibatch-size", "1"], "minibatch_size=1 with normalize_advantages"),
    (["--minibatch-size", "8", "--micro-batch-size", "1"], "micro_batch_size=1 with minibatch_size=8 and normalize_advantages"),
    (["--minibatch-size", "8", "--micro-batch-size", "7"], "micro_batch_size=7 with minibatch_size=8"),  # pieces 7 + 1
])
def test_dppo_refuses_one_sample_advantage_groups(tmp_path, capsys, flags, named):
    # Regression (review pass): dppo normalises the advantages per micro-batch in one process, so
    # --micro-batch-size 1 (or --minibatch-size 1) trained no policy: approx_kl, clip_fraction and the
    # objective 0 on every update, exit 0.
    code = main(["train", "dppo", "--env", "Pendulum-v1", "--total-steps", "64", "--num-envs", "2", "--num-steps", "4",
                 "--num-epochs", "1", "--device", "cpu", "--run-dir", str(tmp_path / "r"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and named in err[0], err
    assert not (tmp_path / "r").exists()


def test_dppo_with_micro_batches_of_two_or_more_trains(tmp_path, capsys):
    code = main(["train", "dppo", "--env", "Pendulum-v1", "--total-steps", "64", "--num-envs", "2", "--num-steps", "4",
                 "--num-epochs", "2", "--target-kl", "None", "--minibatch-size", "8", "--micro-batch-size", "3", "--eval-episodes", "1",
                 "--device", "cpu", "--run-dir", str(tmp_path / "r")])  # pieces 3 + 3 + 2
    capsys.readouterr()
    assert code == 0
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    # the first update moved the policy, so the second one's ratio is not 1 (with one-sample pieces it stayed 1: kl 0)
    assert len(lines) == 2 and all(x["updates"] == 2 and x["approx_kl"] > 1e-7 for x in lines), lines

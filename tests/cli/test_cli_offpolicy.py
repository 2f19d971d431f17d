"""`rlfunc train sac|td3`, `rlfunc eval` and `rlfunc resume` of their runs; one-line errors."""

import json

import pytest

from rlfunc.cli.commands import main, usage

SMALL = ["--total-steps", "200", "--num-steps", "100", "--learning-starts", "150", "--hidden", "16", "16",
         "--batch-size", "16", "--eval-episodes", "2", "--device", "cpu"]


@pytest.mark.parametrize("name", ["sac", "td3"])
def test_train_eval_resume_through_the_cli(tmp_path, capsys, name):
    d = tmp_path / name
    assert main(["train", name, "--env", "Pendulum-v1", "--run-dir", str(d), *SMALL]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["algo"] == name and out["episodes"] == 2 and out == json.loads((d / "eval.json").read_text())
    config = json.loads((d / "config.json").read_text())
    assert config["hidden"] == [16, 16] and config["run"]["eval_episodes"] == 2
    assert config["actor_lr"] == 1e-3  # the Pendulum-v1 preset's (both algorithms)
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 2
    assert main(["eval", str(d), "--episodes", "2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
    assert main(["resume", str(d), "--total-steps", "300"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["env_steps"] == 300
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 3


def test_usage_lists_sac_and_td3():
    text = usage()
    assert "rlfunc train sac --env ENV_ID" in text and "rlfunc train td3 --env ENV_ID" in text


@pytest.mark.parametrize("argv, message", [
    (["train", "sac", "--tau", "0"], "tau=0"),
    (["train", "sac", "--n-step", "3"], "n_step=3"),
    (["train", "td3", "--policy-delay", "0"], "policy_delay=0"),
    (["train", "sac", "--env", "CartPole-v1", "--total-steps", "10"], "Box"),
    (["train", "td3", "--env", "Pendulum-v9"], "Pendulum-v9"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    assert main([*argv, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlfunc: error:") and message in err[0]
    assert not (tmp_path / "run").exists()


def test_versions_of_a_layer_that_starts_at_zero_list_a_finite_max_and_diff_strict_json(tmp_path, capsys):
    # td3/sac versions before the first update hold all-zero biases: `versions list` showed "max change
    # inf" for the next version, and `versions diff --json` wrote Infinity, which strict JSON parsers refuse
    d = tmp_path / "sac"
    assert main(["train", "sac", "--env", "Pendulum-v1", "--run-dir", str(d), "--version-every", "1", *SMALL]) == 0
    capsys.readouterr()
    assert main(["versions", "diff", str(d), "v000001", "v000002", "--json"]) == 0
    text = capsys.readouterr().out
    assert "Infinity" not in text
    layers = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))["layers"]
    assert "inf" in layers.values()  # a bias that was all zeros in v1 (no update before learning_starts)
    finite = [v for v in layers.values() if v != "inf"]
    assert finite and all(isinstance(v, float) and v >= 0 for v in finite)
    assert main(["versions", "list", str(d)]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if "v000002" in line][0]
    assert " inf " not in row and f"{max(finite):.4g}" in row.split()


@pytest.mark.parametrize("argv, line", [
    (["sac", "--total-steps", "abc"], "Error parsing --total-steps: invalid literal for int() with base 10: 'abc' (see rlfunc train sac --help)"),
    (["sac", "--totl-steps", "5"], "Unrecognized options: --totl-steps, 5 (did you mean --total-steps?) (see rlfunc train sac --help)"),
    (["sac", "--total-steps"], "Missing value for argument '--total-steps'. Expected 1 values. (see rlfunc train sac --help)"),
    (["ppo", "--env", "CartPole-v1", "--num-envs", "2.5"], "Error parsing --num-envs: invalid literal for int() with base 10: '2.5'"),
    (["dppo", "--actor.horizon", "x"], "Error parsing --actor.horizon: invalid literal for int() with base 10: 'x'"),
    # README pass: a message tyro wraps over two lines was cut at the wrap ("Expected one of ('off',")
    (["ppo", "--compile", "maybe"], "invalid choice 'maybe' for argument '--compile'. Expected one of ('off', 'auto', 'on'). "
                                    "(see rlfunc train ppo --help)"),
])
def test_a_flag_tyro_cannot_parse_is_one_line_not_a_box(tmp_path, capsys, argv, line):
    """New-user pass: `rlfunc train sac --total-steps abc` printed tyro's 11-line error box (exit 2)
    where every other bad input is one line."""
    assert main(["train", *argv, "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlfunc: error: ") and line in err[0], err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("algo", ["ppo", "bc", "dppo", "td3-diffusion", "sac-diffusion", "grpo", "gspo", "mappo", "sac", "td3"])
def test_train_help_of_every_algorithm_exits_0(capsys, algo):
    """New-user pass: after the one-line parse errors, `rlfunc train ALGO --help` printed its help and
    then an UnboundLocalError traceback, exit 1 (the error path ran for tyro's exit 0 too)."""
    with pytest.raises(SystemExit) as e:
        main(["train", algo, "--help"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and f"usage: rlfunc train {algo}" in out and "Traceback" not in err, err[-1000:]


@pytest.mark.parametrize("name", ["sac", "td3"])
def test_non_finite_transitions_never_reach_the_replay_buffer_and_are_counted(tmp_path, capsys, monkeypatch, name):
    """New-user pass: an env whose observation is NaN at step 3 of each episode put NaN observations
    and actions into the buffer as drawn; every minibatch that sampled one was skipped whole, and
    metrics.jsonl counted nothing."""
    from conftest import nan_obs_env

    env = nan_obs_env(tmp_path, monkeypatch)
    d = tmp_path / "run"
    assert main(["train", name, "--env", env, "--run-dir", str(d), *SMALL]) == 0
    capsys.readouterr()
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    # one NaN observation per 20-step episode: the transition into it and the one out of it, of 1 env
    assert [x["skipped_data"] for x in lines] == [10, 10]
    from rlfunc.run import checkpoint

    state, _ = checkpoint.load_snapshot(checkpoint.latest_snapshot(d))
    buffer = state["buffer"]
    assert all(bool(v.isfinite().all()) for v in buffer.values(include_nested=True, leaves_only=True) if v.is_floating_point())
    assert all(x["loss_critic"] is not None and x["loss_critic"] == x["loss_critic"] for x in lines[1:])
    assert lines[1]["skipped_critic"] == 0.0 and lines[1]["skipped_actor"] == 0.0  # no minibatch held a NaN


_BAD_REWARD_ENV = """import gymnasium, numpy as np
from gymnasium.envs.classic_control.pendulum import PendulumEnv
class BadReward(PendulumEnv):
    episode = -1
    def reset(self, *, seed=None, options=None):
        self.t, self.episode = 0, self.episode + 1
        return super().reset(seed=seed, options=options)
    def step(self, a):
        obs, r, term, trunc, info = super().step(a)
        self.t += 1
        if self.t == 3 and self.episode % 4 in (1, 2):  # episodes 1, 2, 5, 6: a NaN, then an inf reward
            r = np.nan if self.episode % 4 == 1 else np.inf
        return obs, r, term, trunc, info
gymnasium.register(id="BadRewardPendulum-v0", entry_point=BadReward, max_episode_steps=20)
"""


@pytest.mark.parametrize("name", ["sac", "td3"])
def test_episodes_with_a_non_finite_return_are_left_out_of_the_line_as_ppo_does(tmp_path, capsys, monkeypatch, name):
    """Regression: an off-policy line counted the episodes whose return was NaN in "episodes" (PPO's
    line leaves them out of both), and an inf return made "episode_return" inf."""
    (tmp_path / "rlfunc_test_bad_reward_env.py").write_text(_BAD_REWARD_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    d = tmp_path / "run"
    assert main(["train", name, "--env", "rlfunc_test_bad_reward_env:BadRewardPendulum-v0", "--run-dir", str(d), *SMALL]) == 0
    capsys.readouterr()
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    # 5 episodes of 20 steps in each 100-step line: line 0 holds episodes 0-4 (1: NaN, 2: inf), line 1 episodes 5-9 (5, 9:
    # NaN, 6: inf)
    assert [x["episodes"] for x in lines] == [3, 2]
    assert all(-20 * 16.3 <= x["episode_return"] <= 0 for x in lines), lines  # a Pendulum return: finite, <= 0

"""--profile N: a trace of N iterations after the warm-up, with the loop's and PPO's ranges; the
metrics line's env_wait_s."""

import json

import pytest
import torch

from rlfunc.algos.ppo import preset
from rlfunc.errors import ConfigError
from rlfunc.run import train
from rlfunc.run.profile import PROFILE_DIR, IterationProfiler

TINY = dict(num_envs=2, num_steps=32, minibatch_size=64, num_epochs=1, device="cpu", version_every=0)


def _trace_names(run_dir) -> set[str]:
    traces = list((run_dir / PROFILE_DIR).glob("rank0*.pt.trace.json"))
    assert len(traces) == 1, traces
    events = json.loads(traces[0].read_text())["traceEvents"]
    return {e.get("name") for e in events}


def test_profile_writes_one_trace_with_the_ranges_of_the_recorded_iterations(tmp_path):
    run = tmp_path / "run"
    train(preset("Pendulum-v1", total_steps=5 * 64, profile=2, **TINY), run, progress=False, tensorboard=False, evaluate=False)
    names = _trace_names(run)
    for name in ("iteration", "rollout", "update", "policy_forward", "env_step"):
        assert name in names, name
    # the final snapshot comes after iteration 5, outside the recorded iterations 3-4
    assert "checkpoint" not in names
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        assert 0 < line["env_wait_s"] <= line["collect_s"]


def test_a_run_shorter_than_the_warm_up_and_the_recording_still_writes_what_it_recorded(tmp_path):
    run = tmp_path / "run"
    with pytest.warns(UserWarning, match="so 1 of 10 were recorded"):
        train(preset("Pendulum-v1", total_steps=3 * 64, checkpoint_every=1, profile=10, **TINY), run, progress=False,
              tensorboard=False, evaluate=False)
    names = _trace_names(run)  # iteration 3 and its snapshot were recorded when the run stopped
    assert {"iteration", "checkpoint", "update"} <= names


def test_a_run_too_short_for_the_recording_warns_how_many_iterations_were_recorded(tmp_path):
    # `--profile 3` on a 2-iteration run wrote an empty trace and said nothing
    with pytest.warns(UserWarning, match=r"profile=3: the run took 2 iteration\(s\) in this call, so 0 of 3 were recorded"):
        train(preset("Pendulum-v1", total_steps=2 * 64, profile=3, **TINY), tmp_path / "a", progress=False, tensorboard=False,
              evaluate=False)
    with pytest.warns(UserWarning, match="so 1 of 3 were recorded .* 5 iterations record them all"):
        train(preset("Pendulum-v1", total_steps=3 * 64, profile=3, **TINY), tmp_path / "b", progress=False, tensorboard=False,
              evaluate=False)


def test_no_profile_writes_no_trace(tmp_path):
    run = tmp_path / "run"
    train(preset("Pendulum-v1", total_steps=64, **TINY), run, progress=False, tensorboard=False, evaluate=False)
    assert not (run / PROFILE_DIR).exists()


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_profile_count_is_refused_in_one_line(tmp_path, bad):
    with pytest.raises(ConfigError, match="profile="):
        IterationProfiler(tmp_path, bad, torch.device("cpu"))


def test_a_resumed_run_profiles_only_when_its_call_asks(tmp_path, capsys):
    # Regression (metrics pass): a run's --profile N was in its saved config, so every `rlfunc resume` recorded
    # N more iterations (another trace per call, 115 MB each at N=20) and could not be turned off; resuming a
    # finished run warned "profile=2: the run took 0 iteration(s)"
    import warnings

    from rlfunc.cli.commands import main
    from rlfunc import resume

    run = tmp_path / "run"
    train(preset("Pendulum-v1", total_steps=5 * 64, profile=2, **TINY), run, progress=False, tensorboard=False, evaluate=False)
    assert len(list((run / PROFILE_DIR).glob("*.pt.trace.json"))) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "0 of 2 were recorded" warning
        resume(run, 7 * 64, progress=False, tensorboard=False, evaluate=False)
    assert len(list((run / PROFILE_DIR).glob("*.pt.trace.json"))) == 1
    # the run's own --profile stays in its config (review pass: a plain resume recorded profile 1 -> 0)
    assert json.loads((run / "config.json").read_text())["run"]["profile"] == 2
    resume(run, 12 * 64, progress=False, tensorboard=False, evaluate=False, profile=2)  # asked for: recorded
    assert len(list((run / PROFILE_DIR).glob("*.pt.trace.json"))) == 2
    assert main(["resume", str(run), "--profile", "-1"]) == 2
    assert "profile=-1: expected None or an int >= 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="profile=2: is for resume=True"):
        train(preset("Pendulum-v1", total_steps=64, **TINY), tmp_path / "new", profile=2)

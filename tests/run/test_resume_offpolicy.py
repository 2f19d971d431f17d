"""Resume of sac / td3 runs (rlfunc.run.offpolicy): 2 iterations, stop, resume to 4 equals 4 in one go,
tensor for tensor (learner, optimizers, generator, rollout carry, replay buffer), env state, metrics
and evaluation; a run without the buffer in its snapshots warns."""

import json

import pytest
import torch

from rlfunc.algos.sac import SACConfig
from rlfunc.algos.td3 import TD3Config
from rlfunc.config import replace
from rlfunc.errors import CheckpointError
from rlfunc.run import checkpoint
from rlfunc.run import offpolicy
from rlfunc import resume, train

QUIET = dict(progress=False, tensorboard=False)
# 2 envs x 50 steps = 100 env steps per iteration, 4 iterations; updates from env step 60; the buffer (150) wraps in
# iteration 2; each env's first episode (200 steps) ends in iteration 4
SMALL = dict(env="Pendulum-v1", total_steps=400, num_envs=2, num_steps=50, learning_starts=60, buffer_size=150,
             batch_size=16, hidden=(16, 16), checkpoint_every=0, eval_episodes=2, device="cpu")
ALGOS = [("sac", SACConfig, train), ("td3", TD3Config, train)]


def _snapshot(run_dir):
    return checkpoint.load_snapshot(checkpoint.latest_snapshot(run_dir))


def _records(run_dir) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in ("time", "steps_per_s", "collect_s", "update_s")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name, cls, train", ALGOS)
def test_two_stop_resume_two_equals_four(tmp_path, name, cls, train):
    config = replace(cls(), **SMALL)
    whole = train(config, tmp_path / "whole", **QUIET)
    first = train(config, tmp_path / "split", max_iterations=2, **QUIET)
    assert first.evaluation is None and int(first.state["iteration"]) == 2
    state, meta = _snapshot(tmp_path / "split")
    assert meta["buffer"]["length"] == 150 and meta["buffer"]["writer"]["_cursor"] == 50  # 200 rows into 150
    assert state["buffer", "next", "reward"].shape == (150, 1)
    resumed = resume(tmp_path / "split", **QUIET)
    assert int(resumed.state["iteration"]) == 4 and int(resumed.state["env_steps"]) == 400
    (sa, ma), (sb, mb) = _snapshot(tmp_path / "whole"), _snapshot(tmp_path / "split")
    keys = sorted(sa.keys(include_nested=True, leaves_only=True), key=str)
    assert keys == sorted(sb.keys(include_nested=True, leaves_only=True), key=str)
    assert {k[0] for k in keys} == {"learner", "carry", "buffer"} and ("learner", "optim_critic", "0", "step", "0", "bias") in keys
    assert [k for k in keys if not torch.equal(sa[k], sb[k])] == []
    assert ma["env_state"] == mb["env_state"] and ma["buffer"] == mb["buffer"]
    assert _records(tmp_path / "split") == _records(tmp_path / "whole")
    assert [r["episodes"] for r in _records(tmp_path / "whole")] == [0, 0, 0, 2]
    assert "loss_critic" in _records(tmp_path / "whole")[0]
    assert resumed.evaluation == whole.evaluation and resumed.evaluation["algo"] == name
    assert json.loads((tmp_path / "whole" / "eval.json").read_text()) == offpolicy.evaluate(tmp_path / "whole")


def test_without_the_buffer_in_snapshots_a_resume_warns(tmp_path):
    config = replace(SACConfig(), **{**SMALL, "checkpoint_buffer": False, "total_steps": 200})
    train(config, tmp_path / "run", max_iterations=1, **QUIET)
    state, meta = _snapshot(tmp_path / "run")
    assert meta["buffer"] is None and "buffer" not in state.keys()
    with pytest.warns(UserWarning, match="empty buffer"):
        resumed = resume(tmp_path / "run", **QUIET)
    assert int(resumed.state["iteration"]) == 2


def test_a_resume_without_the_buffer_waits_for_the_warm_up_transitions(tmp_path):
    """New-user pass: a --no-checkpoint-buffer run resumed with an empty buffer and took its gradient steps at
    once, the first ones on 1 transition (100 of them in a Pendulum iteration). It now gathers learning_starts
    transitions again first (acting with its trained policy): 60 transitions of 2 envs fill after 30 of the
    iteration's 50 vector steps, so 21 x 2 gradient steps (as the first iteration's, from step 60) instead of 50 x 2."""
    config = replace(SACConfig(), **{**SMALL, "checkpoint_buffer": False, "total_steps": 200})
    first = train(config, tmp_path / "run", max_iterations=1, **QUIET)
    before = int(first.state["updates"])
    with pytest.warns(UserWarning, match=r"empty buffer .*its updates wait until the buffer holds 60 transitions again"):
        resumed = resume(tmp_path / "run", **QUIET)
    assert before == 21 * 2 and int(resumed.state["updates"]) - before == 21 * 2
    assert _records(tmp_path / "run")[-1]["updates"] == int(resumed.state["updates"])


def test_a_snapshot_of_no_registered_algorithm_is_refused(tmp_path):
    # the snapshot's "algo" picks the run a resume builds: td3's continues as td3; one naming an algorithm
    # no entry is registered as is refused in one line, and nothing is written
    train(replace(TD3Config(), **{**SMALL, "total_steps": 100, "version_every": 0}), tmp_path / "td3", max_iterations=1, **QUIET)
    snap = checkpoint.latest_snapshot(tmp_path / "td3")
    state, meta = checkpoint.load_snapshot(snap)
    checkpoint.save_snapshot(snap, state, {**meta, "algo": "redq"})
    with pytest.raises(CheckpointError, match="snapshot algo='redq': expected one of ppo, .*, sac, td3"):
        train(None, tmp_path / "td3", resume=True, **QUIET)
    checkpoint.save_snapshot(snap, state, meta)
    assert resume(tmp_path / "td3", **QUIET).evaluation["algo"] == "td3"


def test_a_budget_below_what_was_done_is_one_error_without_the_builds_warnings_and_latest_warns_once(tmp_path):
    """New-user pass: `rlfunc resume R --total-steps 100` printed "learning_starts=... covers the whole
    budget" before the real error; a `latest` naming a missing snapshot was warned of 3 times a command."""
    import warnings

    from rlfunc.errors import ConfigError

    config = replace(SACConfig(), **{**SMALL, "total_steps": 200, "checkpoint_every": 1})
    train(config, tmp_path / "run", **QUIET)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ConfigError, match="already done 2 iterations"):
            resume(tmp_path / "run", total_steps=50, **QUIET)
    assert [str(w.message) for w in seen if "covers the whole budget" in str(w.message)] == []
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_000000009999\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            assert checkpoint.latest_snapshot(tmp_path / "run").name == "step_000000000200"
    assert len([w for w in seen if "names step_000000009999" in str(w.message)]) == 1

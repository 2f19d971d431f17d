"""sac / td3 with ``async_collection`` (issue 16, item 2): the envs step in a worker process while the
learner updates. Timing decides which weights act, so the runs are not compared tensor for tensor;
what timing cannot change is checked: the buffer holds every env step, the gradient steps are the
synchronous run's count, the lag stays within the queue's bound, a resume warns and starts new
episodes, and the bad combinations are one-line errors."""

import json

import pytest

from rlfunc.algos.sac import SACConfig
from rlfunc.algos.td3 import TD3Config
from rlfunc.config import replace
from rlfunc.errors import ConfigError
from rlfunc.run import checkpoint, offpolicy
from rlfunc import resume, train

QUIET = dict(progress=False, tensorboard=False)
# 2 envs x 50 steps per iteration, 3 iterations; gradient steps from env step 60: at env steps 60, 62, ..., 300
SMALL = dict(env="Pendulum-v1", total_steps=300, num_envs=2, num_steps=50, learning_starts=60, buffer_size=1000,
             batch_size=16, hidden=(16, 16), checkpoint_every=0, eval_episodes=2, device="cpu", async_collection=True)


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("cls, train", [(SACConfig, train), (TD3Config, train)])
def test_an_async_run_stores_every_step_and_takes_the_synchronous_gradient_steps(tmp_path, cls, train):
    result = train(replace(cls(), **SMALL), tmp_path / "run", **QUIET)
    assert int(result.state["env_steps"]) == 300
    assert int(result.state["updates"]) == 2 * 121  # 121 vector-env steps at >= 60 env steps, 2 updates each
    _, meta = checkpoint.load_snapshot(checkpoint.latest_snapshot(tmp_path / "run"))
    assert meta["buffer"]["length"] == 300 and meta["env_state"] is None
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [100, 200, 300]
    # a publish after every update step; the worker runs at most async_queue (2) + 1 vector-env steps ahead
    assert all(0 <= r["policy_lag"] <= 3 for r in records) and "loss_critic" in records[-1]
    assert result.evaluation["episodes"] == 2 and result.evaluation["mean"] < 0


def test_items_of_several_steps_take_their_updates_together(tmp_path):
    # items of 5 vector-env steps (10 env steps): updates after the items ending at env steps 60 (its last step
    # only: learning starts at 60), 70, ..., 300: the in-process count
    result = train(replace(SACConfig(), **{**SMALL, "async_steps": 5}), tmp_path / "run", **QUIET)
    assert int(result.state["env_steps"]) == 300 and int(result.state["updates"]) == 2 * 121
    records = _records(tmp_path / "run")
    assert all(0 <= r["policy_lag"] <= 3 for r in records)  # publishes: one per item's updates


def test_an_item_that_straddles_learning_starts_counts_only_its_steps_past_it(tmp_path):
    # found by a new user (items of 2 steps took one gradient step too many): items of 5 vector-env steps (10 env
    # steps); the item ending at 60 env steps holds the steps ending at 52, 54 (before learning starts at 56) and
    # 56, 58, 60 (after): those 3 update, as in process
    config = replace(SACConfig(), **{**SMALL, "async_steps": 5, "learning_starts": 56, "total_steps": 100, "num_steps": 50})
    result = train(config, tmp_path / "run", **QUIET)
    assert int(result.state["updates"]) == 2 * 23  # env steps 56, 58, ..., 100: 23 vector-env steps, as in process
    config = replace(SACConfig(), **{**SMALL, "async_steps": 5, "learning_starts": 57, "total_steps": 100, "num_steps": 50})
    result = train(config, tmp_path / "run57", **QUIET)
    assert int(result.state["updates"]) == 2 * 22  # env steps 58, ..., 100


def test_an_async_resume_warns_and_continues_with_new_episodes(tmp_path):
    config = replace(SACConfig(), **SMALL)
    train(config, tmp_path / "run", max_iterations=1, **QUIET)
    with pytest.warns(UserWarning, match="starts new episodes"):
        resumed = resume(tmp_path / "run", **QUIET)
    assert int(resumed.state["env_steps"]) == 300 and int(resumed.state["updates"]) == 2 * 121


def test_async_collection_with_env_workers_is_a_config_error():
    with pytest.raises(ConfigError, match="async_collection with run.env_workers=2"):
        replace(SACConfig(), **{**SMALL, "env_workers": 2})
    with pytest.raises(ConfigError, match="async_steps=3: expected a divisor of num_steps=50"):
        replace(SACConfig(), **{**SMALL, "async_steps": 3})
    with pytest.raises(ConfigError, match="async_collection with nproc=2"):
        replace(SACConfig(), **{**SMALL, "nproc": 2})
    with pytest.raises(ConfigError, match="async_steps=4: these set the asynchronous collector"):
        replace(SACConfig(), **{**SMALL, "async_collection": False, "async_steps": 4})
    with pytest.raises(ConfigError, match="async_queue=0"):
        replace(SACConfig(), **{**SMALL, "async_queue": 0})

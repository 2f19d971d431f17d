"""td3-diffusion / sac-diffusion with ``async_collection`` (issue 16, item 2): the rollouts of the
diffusion actor's chain run in a worker process while the learner updates. The worker's rollouts
of fixed weights are the in-process ones tensor for tensor; in a run, timing decides which weights
act, so what timing cannot change is checked: every rollout reaches the buffer, the gradient steps
are the synchronous run's count, the lag stays within the queue's bound, a resume warns and starts
new episodes, and the bad combinations are one-line errors."""

import json

import pytest
import torch

from rlfunc.algos.sac_diffusion import SACDiffusionConfig, make_sac_diffusion
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig, make_td3_diffusion
from rlfunc.algos.diffusion_actor import env_info, make_env
from rlfunc.config import replace
from rlfunc.envs.async_collect import AsyncCollector
from rlfunc.errors import ConfigError
from rlfunc import resume, train
from rlfunc.run import checkpoint
from rlfunc.run.diffusion import ReplayRollouts, acting_state

QUIET = dict(progress=False, tensorboard=False)
# PointReach-v0: 8 envs x 30 chunk steps = 240 env steps per iteration; 6 iterations; updates from the first
# iteration ending at >= 200 env steps (the first), 4 per iteration
SMALL = dict(env="PointReach-v0", total_steps=1440, num_envs=8, num_steps=30, warmup_steps=200, updates_per_iteration=4,
             batch_size=32, buffer_size=5000, eval_episodes=4, checkpoint_every=0, device="cpu", async_collection=True)
SAC_SMALL = dict(entropy_states=4, entropy_samples=20, entropy_every=2)


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("cls, make, env, extra", [
    (SACDiffusionConfig, make_sac_diffusion, "PointReach-v0", SAC_SMALL),
    (TD3DiffusionConfig, make_td3_diffusion, "Pendulum-v1", {}),
])
def test_the_workers_rollouts_are_the_in_process_ones_of_the_same_weights(cls, make, env, extra):
    # the first item is warm (uniform chunks: 0 env steps < 200), the next ones act with the chain
    config = replace(cls(), **{**SMALL, **extra, "env": env, "num_steps": 10, "async_collection": False})
    info = env_info(env)
    cpu = torch.device("cpu")
    algo = make(config, config.actor, info, info.act_dim, cpu)
    state = algo.init()
    c = AsyncCollector.of_source(ReplayRollouts(config, info, env_seed=5, start_steps=0), acting_state(state), seed=9)
    try:
        got = [c.next() for _ in range(3)]
    finally:
        c.close()
    venv = make_env(env, config.num_envs, config.actor.act_steps, cpu, 5)
    generator = torch.Generator().manual_seed(9)
    steps = 0
    for batch, version in got:
        state["env_steps"] = torch.tensor(steps)
        want = algo.rollout(state, venv, generator)
        steps += want.numel() * config.actor.act_steps
        assert version == 0 and batch.batch_size == want.batch_size == torch.Size([8, 10])
        for key in want.keys(True, True):
            torch.testing.assert_close(batch[key], want[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    venv.close()
    assert not torch.equal(got[0][0]["action"].abs().amax(), torch.tensor(0.0))


@pytest.mark.parametrize("cls, extra", [(SACDiffusionConfig, SAC_SMALL), (TD3DiffusionConfig, {})])
def test_an_async_run_stores_every_rollout_and_takes_the_synchronous_updates(tmp_path, cls, extra):
    config = replace(cls(), **SMALL, **extra)
    result = train(config, tmp_path / "run", **QUIET)
    assert int(result.state["env_steps"]) == 1440
    assert int(result.state["updates"]) == config.num_updates() == 6 * 4
    _, meta = checkpoint.load_snapshot(checkpoint.latest_snapshot(tmp_path / "run"))
    assert meta["buffer"]["length"] == 1440 and "env_rng" not in meta  # the collector's envs are not in the snapshot
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [240 * k for k in range(1, 7)]
    # a publish after every iteration's updates; the worker runs at most async_queue (1) + 1 rollouts ahead
    assert all(0 <= r["policy_lag"] <= 2 and r["env_wait_s"] >= 0 for r in records)
    assert all(r["episodes"] == 8 for r in records)  # PointReach's episodes end within 30 chunk steps
    assert result.evaluation["episodes"] == 4 and 0.0 <= result.evaluation["success_rate"] <= 1.0


def test_a_gymnasium_env_rolls_out_in_the_worker_too(tmp_path):
    config = replace(TD3DiffusionConfig(), **{**SMALL, "env": "Pendulum-v1", "num_steps": 20, "total_steps": 640,
                                              "sync_weights_every": 8})
    result = train(config, tmp_path / "run", **QUIET)
    assert int(result.state["env_steps"]) == 640 and int(result.state["updates"]) == config.num_updates() == 3 * 4
    records = _records(tmp_path / "run")
    # a publish every 8 updates = every second iteration: the acting weights lag at most 2 rollouts + 1 publish
    assert all(0 <= r["policy_lag"] <= 3 for r in records) and "loss_critic" in records[-1]
    assert result.evaluation["episode_return"] < 0  # Pendulum's rewards are <= 0


def test_an_async_resume_warns_and_continues_with_new_episodes(tmp_path):
    config = replace(SACDiffusionConfig(), **SMALL, **SAC_SMALL)
    train(config, tmp_path / "run", max_iterations=3, **QUIET)
    with pytest.warns(UserWarning, match="async_collection: the collector's envs are not in snapshots"):
        resumed = resume(tmp_path / "run", **QUIET)
    assert int(resumed.state["env_steps"]) == 1440 and int(resumed.state["updates"]) == 6 * 4
    assert [r["step"] for r in _records(tmp_path / "run")] == [240 * k for k in range(1, 7)]


def test_a_restarted_collector_never_resets_with_the_evaluation_seeds():
    """Found by a new user: a collector restarted at iteration 1 (a resume of a run stopped in its first
    iteration) seeded its envs with run seed + 1,000,003, the evaluation's own seed (round 0 of the
    diffusion runs' evaluation; the first reset seeds of sac's and td3's)."""
    from rlfunc.envs import collect
    from rlfunc.envs.async_collect import restart_seed
    from rlfunc.run.diffusion import EVAL_SEED_OFFSET
    from rlfunc.run.ppo import EVAL_SEED_OFFSET as OFFPOLICY_EVAL_OFFSET

    for seed in (0, 1, 12345):
        evaluation = {seed + EVAL_SEED_OFFSET + r for r in range(100)}  # evaluate_episodes' rounds
        eval_resets = set(collect.env_seeds(seed + OFFPOLICY_EVAL_OFFSET, 1000))  # sac's / td3's evaluation
        for it in range(1, 6):
            assert restart_seed(seed, it) not in evaluation and restart_seed(seed, it + 1) not in evaluation
            assert not set(collect.env_seeds(restart_seed(seed, it), 64)) & eval_resets
        assert restart_seed(seed, 0) == seed  # a first collector keeps the run's own env seed


def test_async_collection_with_ranks_or_env_workers_is_a_config_error():
    with pytest.raises(ConfigError, match="async_collection with nproc=2"):
        replace(SACDiffusionConfig(), **SMALL, **SAC_SMALL, nproc=2)
    with pytest.raises(ConfigError, match="async_collection with run.env_workers=2"):
        replace(TD3DiffusionConfig(), **{**SMALL, "env": "Pendulum-v1", "env_workers": 2})
    with pytest.raises(ConfigError, match="async_queue=3: these set the asynchronous collector"):
        replace(TD3DiffusionConfig(), **{**SMALL, "async_collection": False, "async_queue": 3})
    with pytest.raises(ConfigError, match="sync_weights_every=0: expected a positive integer"):
        replace(TD3DiffusionConfig(), **{**SMALL, "sync_weights_every": 0})

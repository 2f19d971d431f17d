"""A data-parallel mappo run (2 gloo ranks, each stepping 2 of 4 small warehouses whose episodes end
mid-rollout): its snapshot, with the env's state, the collection carry and the running returns of
every rank gathered, is the single process's (floats within 1e-6, generator states, counters and the
env's integer state exact), its metrics count every rank's steps and episodes, and rank 0 alone
writes. The ranks call rlfunc.run.train as torchrun's workers would."""

import json


from rlfunc.algos.mappo import MAPPOConfig
from rlfunc.config import replace
from rlfunc.run import checkpoint

SMALL_LAYOUT = ("P......D", "..#..#..", "P......D")


def _small_warehouses():
    from envs import registry_entries
    from envs.warehouse import WarehouseConfig

    small = WarehouseConfig(n_agents=2, layout=SMALL_LAYOUT, obs_radius=1, max_steps=6)
    registry_entries.warehouse_config = lambda config, train: small


def _config():
    return replace(MAPPOConfig(), loss="ppo", critic="mean", n_agents=2, num_envs=4, rollout_steps=8, num_minibatches=2,
                   num_epochs=2, hidden=(16,), total_steps=2 * 4 * 8, eval_episodes=2, eval_seeds=(0,), checkpoint_every=1,
                   device="cpu", compile="off")


def _rank(dist, run_dir):
    from rlfunc.run import train

    _small_warehouses()
    train(_config(), run_dir, progress=False, tensorboard=False)


def test_a_two_rank_mappo_run_is_the_single_process_run_and_rank_0_alone_writes(gloo, tmp_path, same_snapshots, monkeypatch):
    from envs import registry_entries
    from rlfunc.run import train

    gloo(_rank, str(tmp_path / "dp"))
    monkeypatch.setattr(registry_entries, "warehouse_config", registry_entries.warehouse_config)  # undone after the test
    _small_warehouses()
    single = train(_config(), tmp_path / "single", progress=False, tensorboard=False)
    a, b = checkpoint.latest_snapshot(tmp_path / "single"), checkpoint.latest_snapshot(tmp_path / "dp")
    assert a.name == b.name
    _, meta, worst = same_snapshots(a, b)  # generator states, counters, the warehouses' cells and tasks: exact
    assert meta["world_size"] == 2
    records = [json.loads(line) for line in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]  # one writer
    for got, w in zip(records, want):
        assert got["step"] == w["step"]
        for name in ("episode_return", "train_reward_per_step", "deliveries_per_100_steps", "loss_objective"):
            assert abs(got[name] - w[name]) < 1e-5, name
    assert json.loads((tmp_path / "dp" / "eval.json").read_text()) == single.evaluation

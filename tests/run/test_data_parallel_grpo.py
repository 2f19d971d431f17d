"""A data-parallel grpo run (2 gloo ranks, each stepping 2 of the 4 groups of 4 PointReach envs): its
snapshot is the single process's (floats within 1e-6, generator states, counters and the env's
integer state exact), and rank 0 alone writes the run's files. The ranks are spawned processes that
call rlfunc.run.train as torchrun's workers would (`rlfunc train grpo --nproc 2` starts them with torchrun)."""

import json


from rlfunc.algos.grpo import GRPOConfig
from rlfunc.config import replace
from rlfunc.run import checkpoint
from rlfunc.run import train


def _config():
    return replace(GRPOConfig(), env="PointReach-v0", num_groups=4, group_size=4, max_episode_steps=8, minibatch_size=8,
                   num_epochs=2, hidden=(32, 32), total_steps=2 * 4 * 4 * 8, eval_episodes=2, checkpoint_every=1, device="cpu")


def _rank(dist, run_dir):
    train(_config(), run_dir, progress=False, tensorboard=False)


def test_a_two_rank_grpo_run_is_the_single_process_run_and_rank_0_alone_writes(gloo, tmp_path, same_snapshots):
    gloo(_rank, str(tmp_path / "dp"))
    single = train(_config(), tmp_path / "single", progress=False, tensorboard=False)
    a, b = checkpoint.latest_snapshot(tmp_path / "single"), checkpoint.latest_snapshot(tmp_path / "dp")
    assert a.name == b.name == "step_000000000256"
    _, meta, worst = same_snapshots(a, b)  # generator states (the env's too), counters, the env's flags and step counts: exact
    assert meta["world_size"] == 2
    records = [json.loads(line) for line in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]  # one writer
    want = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    for got, w in zip(records, want):
        assert got["step"] == w["step"]
        for name in ("episode_return", "approx_kl", "valid_steps"):  # over every rank's episodes
            assert abs(got[name] - w[name]) < 1e-5, name
    evaluation = json.loads((tmp_path / "dp" / "eval.json").read_text())
    assert evaluation["episodes"] == 2 and abs(evaluation["mean"] - single.evaluation["mean"]) < 1e-4

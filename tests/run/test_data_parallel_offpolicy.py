"""A data-parallel sac run on Pendulum-v1 (2 gloo ranks, each stepping 1 of the 2 envs, gathering every
step's transitions into the one replay buffer): its snapshot is the single process's, rank 0 alone
writes the run's files, and the 2-rank snapshot resumes in one process to the uninterrupted run.
The ranks are spawned processes that call rlfunc.run.train as torchrun's workers would (`rlfunc train sac
--nproc 2` starts them with torchrun)."""

import json


from rlfunc.algos.sac import preset
from rlfunc.run import checkpoint
from rlfunc.run import train

# float rounding only (a minibatch's loss as the mean of two half means), carried through ~100
# gradient steps into the actions, the observations they led to and the buffer: the largest
# difference of any snapshot tensor was 9.5e-7 at iteration 2 and 2.9e-6 after the resumed iteration 3
ATOL = 1e-5


def _config():
    # 3 iterations of 20 steps of 2 envs; updates from env step 20: 2 gradient steps per env step
    return preset("Pendulum-v1", num_envs=2, num_steps=20, learning_starts=20, batch_size=16, hidden=(16, 16), total_steps=120,
                  eval_episodes=2, checkpoint_every=1, keep_checkpoints=0, device="cpu", compile="off")


def _rank(dist, run_dir):
    train(_config(), run_dir, max_iterations=2, progress=False, tensorboard=False)


def _assert_same(a, b, same_snapshots):
    ma, mb, worst = same_snapshots(a, b, rtol=1e-5, atol=ATOL)  # generator states, counters, terminal flags: exact
    assert [e["rng"] for e in ma["env_state"]] == [e["rng"] for e in mb["env_state"]]
    assert ma["buffer"] == mb["buffer"] and ma["buffer"]["length"] > 0  # the same rows, one buffer
    return worst, mb


def test_a_two_rank_sac_run_is_the_single_process_run_and_resumes_in_one_process(gloo, tmp_path, same_snapshots):
    gloo(_rank, str(tmp_path / "dp"))
    records = [json.loads(line) for line in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]  # one writer
    single = train(_config(), tmp_path / "single", progress=False, tensorboard=False)
    snaps = checkpoint.run_snapshots(tmp_path / "single")
    worst, meta = _assert_same(snaps[1], checkpoint.latest_snapshot(tmp_path / "dp"), same_snapshots)  # iteration 2 (newest first)
    assert meta["world_size"] == 2 and meta["iteration"] == 2 and len(meta["env_state"]) == 2
    want = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    for got, w in zip(records, want):
        assert got["step"] == w["step"] and got["updates"] == w["updates"] and got["episodes"] == w["episodes"]
        assert abs(got["loss_critic"] - w["loss_critic"]) < 1e-4 * max(1.0, abs(w["loss_critic"]))

    resumed = train(None, tmp_path / "dp", resume=True, progress=False, tensorboard=False)  # 1 process, the 2 envs in order
    worst_resumed, meta = _assert_same(checkpoint.latest_snapshot(tmp_path / "single"), checkpoint.latest_snapshot(tmp_path / "dp"), same_snapshots)
    assert meta["world_size"] == 1 and meta["iteration"] == 3 and int(meta["env_steps"]) == 120
    assert resumed.evaluation["episodes"] == single.evaluation["episodes"] == 2
    print(f"max |difference| of a snapshot tensor: {worst:.1e} (2 ranks, iteration 2), {worst_resumed:.1e} (resumed, iteration 3)")

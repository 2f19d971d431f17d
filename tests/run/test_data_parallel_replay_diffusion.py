"""A data-parallel td3-diffusion run (2 gloo ranks, each stepping 4 of the 8 PointReach envs and
gathering the rollout into the one replay buffer): its snapshot is the single process's and rank 0
alone writes the run's files. The ranks are spawned processes that call train_td3_diffusion as
torchrun's workers would (`rlfunc train td3-diffusion --nproc 2` starts them with torchrun)."""

import json


from rlfunc.algos.diffusion_actor import ActorSpec
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig
from rlfunc.config import replace
from rlfunc.run import checkpoint
from rlfunc.run import train

SPEC = ActorSpec(hidden=(32, 32), horizon=4, act_steps=4, num_train_steps=8, ddim_steps=4)


def _config():
    # 2 iterations of 10 chunk steps of 8 envs: the first uniform (warm-up), the second acting with the
    # actor's chain; 4 gradient steps after each (2 delayed actor steps)
    return replace(TD3DiffusionConfig(), actor=SPEC, num_envs=8, num_steps=10, warmup_steps=320, updates_per_iteration=4,
                   batch_size=16, critic_hidden=(32, 32), total_steps=2 * 8 * 10 * 4, eval_episodes=8, checkpoint_every=1,
                   device="cpu", compile="off")


def _rank(dist, run_dir):
    train(_config(), run_dir, progress=False, tensorboard=False)


def test_a_two_rank_td3_diffusion_run_is_the_single_process_run_and_rank_0_alone_writes(gloo, tmp_path, same_snapshots):
    gloo(_rank, str(tmp_path / "dp"))
    single = train(_config(), tmp_path / "single", progress=False, tensorboard=False)
    a, b = checkpoint.latest_snapshot(tmp_path / "single"), checkpoint.latest_snapshot(tmp_path / "dp")
    assert a.name == b.name == "step_000000000640"
    _, meta, worst = same_snapshots(a, b)  # generator states (the env's too), counters: exact
    assert meta["world_size"] == 2
    records = [json.loads(line) for line in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]  # one writer
    want = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    for got, w in zip(records, want):
        assert got["step"] == w["step"] and got["episodes"] == w["episodes"]  # every rank's envs counted
    evaluation = json.loads((tmp_path / "dp" / "eval.json").read_text())
    assert evaluation["num_episodes"] == 8 and evaluation["success_rate"] == single.evaluation["success_rate"]
    print(f"max |difference| of a parameter: {worst:.1e}")

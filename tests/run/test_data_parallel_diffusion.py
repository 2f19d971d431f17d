"""A data-parallel dppo run (2 gloo ranks, each stepping 4 of the 8 PointReach envs): its snapshots
are the single process's, and rank 0 alone writes the run's files (issue 16); the same for 8
GymChunkEnvs of a gymnasium id whose episodes end at different steps, resumed on 2 ranks or on 1.
The ranks are spawned processes that call train_dppo as torchrun's workers would (`rlfunc train
dppo --nproc 2` starts them with torchrun)."""

import json

import pytest

from rlfunc.algos.diffusion_actor import ActorSpec
from rlfunc.algos.dppo import DPPOConfig
from rlfunc.config import replace
from rlfunc.run import checkpoint
from rlfunc.run import train

SPEC = ActorSpec(hidden=(32, 32), horizon=4, act_steps=4, num_train_steps=8, ddim_steps=4)


def _config():
    # 10 chunk steps of 4 actions: every episode is truncated after 8 (30 actions) and the envs reset mid-rollout
    return replace(DPPOConfig(), actor=SPEC, num_envs=8, num_steps=10, minibatch_size=16, num_epochs=1, critic_hidden=(32, 32),
                   total_steps=2 * 8 * 10 * 4, eval_episodes=8, checkpoint_every=1, device="cpu")


def _rank(dist, run_dir):
    train(_config(), run_dir, progress=False, tensorboard=False)


def test_a_two_rank_dppo_run_is_the_single_process_run_and_rank_0_alone_writes(gloo, tmp_path, same_snapshots):
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
        assert abs(got["approx_kl"] - w["approx_kl"]) < 1e-6
    evaluation = json.loads((tmp_path / "dp" / "eval.json").read_text())
    assert evaluation["num_episodes"] == 8 and evaluation["success_rate"] == single.evaluation["success_rate"]


# ------------------------------------------------------------------ a gymnasium id (GymChunkEnv split)

import gymnasium as gym  # noqa: E402

from rlfunc import resume

UNEVEN = "UnevenPointReach-v0"


class _UnevenEpisodes(gym.Wrapper):
    """PointReach-v0's gymnasium env truncated after 3 + seed % 12 steps (seed: its reset's), so the
    envs' episodes end at different chunk steps and their resets interleave across ranks."""

    def reset(self, *, seed=None, options=None):
        self._left = 3 + (seed or 0) % 12
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._left -= 1
        return obs, reward, terminated, truncated or self._left <= 0, info


def _uneven(**kwargs):
    from envs.point_reach import PointReachGymEnv

    return _UnevenEpisodes(PointReachGymEnv(**kwargs))


if UNEVEN not in gym.registry:  # here and in the ranks, which import this module for their function
    gym.register(id=UNEVEN, entry_point=_uneven, max_episode_steps=30)

GYM_ITERATION = 8 * 6 * 4  # env steps: 8 envs x 6 chunk steps of 4 actions


def _gym_config(iterations: int):
    return replace(DPPOConfig(), env=UNEVEN, actor=SPEC, num_envs=8, num_steps=6, minibatch_size=16, num_epochs=1,
                   critic_hidden=(32, 32), total_steps=iterations * GYM_ITERATION, eval_episodes=4, checkpoint_every=1,
                   device="cpu")


def _gym_rank(dist, run_dir, after_one):
    """One iteration, rank 0 keeping a copy of the run then, and a resume on the same 2 ranks to 2."""
    from conftest import keep_copy_on_rank_0

    train(_gym_config(1), run_dir, progress=False, tensorboard=False)  # it leaves the process group
    keep_copy_on_rank_0(dist, run_dir, after_one)
    resume(run_dir, 2 * GYM_ITERATION, progress=False, tensorboard=False)


def _assert_same_snapshot(got_dir, want_dir, same_snapshots):
    a, b = checkpoint.latest_snapshot(want_dir), checkpoint.latest_snapshot(got_dir)
    assert a.name == b.name == f"step_{2 * GYM_ITERATION:012d}"
    meta_a, meta_b, worst = same_snapshots(a, b)  # floats within 1e-6, the rest exact
    assert meta_b["env_rng"] == meta_a["env_rng"]  # the reset seeds' stream, every rank's the single process's
    print(got_dir, f"max |difference| of a parameter: {worst:.1e}")
    return meta_b


def test_a_two_rank_dppo_run_on_a_gymnasium_id_is_the_single_process_run_and_resumes_on_1_or_2_ranks(gloo, tmp_path, same_snapshots):
    """8 GymChunkEnvs split over 2 ranks (4 each) whose episodes end at different steps: the run, a
    1-iteration run resumed on the same 2 ranks to 2 iterations, and its 1-iteration snapshot resumed
    in one process, all end in the single process's snapshot (floats within 1e-6, the rest exact); its
    metrics count every rank's episodes; rank 0 alone writes."""
    gloo(_gym_rank, str(tmp_path / "dp"), str(tmp_path / "dp_after_1"))
    train(_gym_config(2), tmp_path / "single", progress=False, tensorboard=False)
    resume(tmp_path / "dp_after_1", 2 * GYM_ITERATION, progress=False, tensorboard=False)
    assert _assert_same_snapshot(tmp_path / "dp", tmp_path / "single", same_snapshots)["world_size"] == 2
    assert _assert_same_snapshot(tmp_path / "dp_after_1", tmp_path / "single", same_snapshots)["world_size"] == 1
    records = [json.loads(line) for line in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]  # one writer, the resume appending
    for got, w in zip(records, want):
        assert got["step"] == w["step"] and got["episodes"] == w["episodes"] > 8  # envs reset mid-rollout, every rank's counted
        assert abs(got["approx_kl"] - w["approx_kl"]) < 1e-6
    evaluation = json.loads((tmp_path / "dp" / "eval.json").read_text())
    single = json.loads((tmp_path / "single" / "eval.json").read_text())
    assert evaluation.pop("algo") == single.pop("algo") == "dppo"  # a string: pytest.approx with rel refuses it
    assert evaluation.pop("ci95") == pytest.approx(single.pop("ci95"), rel=1e-6)  # (a list: approx takes no nested one)
    assert evaluation == pytest.approx(single, rel=1e-6)

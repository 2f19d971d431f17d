"""The evaluation protocol's statistics (rlfunc.core.stats): intervals with known answers, the
reach-and-stay rule on hand-made curves, and evaluation seeds disjoint from training ones."""

import math

import numpy as np
import pytest
import torch

from rlfunc.core.stats import first_touch, mean_interval, reach_and_stay, success_interval, summarize_returns
from rlfunc.envs import collect
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.run.ppo import EVAL_SEED_OFFSET


def test_mean_interval_by_hand():
    # [1, 2, 3, 4, 5]: mean 3, sample std sqrt(2.5); t_{0.975, 4} = 2.7764451 (printed t tables)
    low, high = mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    half = 2.7764451 * math.sqrt(2.5) / math.sqrt(5)
    assert low == pytest.approx(3 - half, abs=1e-5) and high == pytest.approx(3 + half, abs=1e-5)
    # 90%: t_{0.95, 4} = 2.1318468
    low, high = mean_interval(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), confidence=0.9)
    assert high - low == pytest.approx(2 * 2.1318468 * math.sqrt(2.5) / math.sqrt(5), abs=1e-5)


def test_mean_interval_edge_cases():
    assert mean_interval([7.0, 7.0, 7.0]) == (7.0, 7.0)  # no spread: a point
    assert all(math.isnan(v) for v in mean_interval([3.0]))  # one episode says nothing about the spread
    with pytest.raises(ShapeError, match="NaN or inf"):
        mean_interval([1.0, float("nan")])
    with pytest.raises(ShapeError, match="non-empty 1-D"):
        mean_interval([])
    with pytest.raises(ShapeError, match="non-empty 1-D"):
        mean_interval(torch.zeros(2, 3))
    with pytest.raises(ConfigError, match="confidence=1.5"):
        mean_interval([1.0, 2.0], confidence=1.5)


def test_mean_interval_covers_the_mean_95_percent_of_the_time():
    # property: over 2000 samples of 20 normal returns, the interval holds the true mean ~95% of the time
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(2000):
        low, high = mean_interval(rng.normal(-150.0, 40.0, size=20).tolist())
        hits += low <= -150.0 <= high
    assert 0.935 <= hits / 2000 <= 0.965


def test_summarize_returns_of_one_episode_has_no_interval():
    assert summarize_returns([-120.0]) == {"mean": -120.0, "std": 0.0, "episodes": 1, "ci95": None}


def test_summarize_returns():
    out = summarize_returns(torch.tensor([-100.0, -200.0, -300.0, -400.0]))
    assert out["mean"] == -250.0 and out["episodes"] == 4
    assert out["std"] == pytest.approx(math.sqrt(12500.0))  # population std
    low, high = out["ci95"]
    half = 3.1824463 * math.sqrt(50000.0 / 3) / 2  # t_{0.975, 3}, sample std
    assert low == pytest.approx(-250.0 - half, rel=1e-5) and high == pytest.approx(-250.0 + half, rel=1e-5)


def test_summarize_returns_counts_non_finite_episodes_when_asked():
    # The bug: one NaN episode return (an env's NaN reward) failed a run's whole final evaluation, after
    # the training, with a traceback and no eval.json. "count" summarises the finite ones and counts the rest.
    with pytest.raises(ShapeError, match="NaN or inf"):
        summarize_returns([1.0, float("nan")])
    with pytest.warns(UserWarning, match="2 of 4 evaluation episodes have a NaN or inf return"):
        out = summarize_returns(torch.tensor([-100.0, float("nan"), -300.0, float("inf")]), nonfinite="count")
    assert out == {**summarize_returns([-100.0, -300.0]), "nonfinite_episodes": 2} and out["mean"] == -200.0
    assert summarize_returns([-5.0, -7.0], nonfinite="count") == summarize_returns([-5.0, -7.0])  # no key when none
    with pytest.warns(UserWarning, match="the statistics are over the other 0"):
        none = summarize_returns([float("nan")] * 3, nonfinite="count")
    assert none == {"mean": None, "std": None, "episodes": 0, "ci95": None, "nonfinite_episodes": 3}
    with pytest.raises(ConfigError, match="nonfinite='drop'"):
        summarize_returns([1.0], nonfinite="drop")


def test_ppo_evaluation_of_an_env_with_nan_rewards_reports_the_finite_episodes(tmp_path):
    import gymnasium as gym
    from gymnasium.envs.classic_control.pendulum import PendulumEnv

    from rlfunc.algos.ppo import make_ppo, preset
    from rlfunc.config import replace
    from rlfunc.run.ppo import env_spec, evaluate_state

    class NanPendulum(PendulumEnv):  # a NaN reward in the episodes that start with theta > 0
        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            return obs, (float("nan") if self.state[0] > 0 and self.start else reward), terminated, truncated, info

        def reset(self, **kw):
            out = super().reset(**kw)
            self.start = self.state[0] > 0
            return out

    if "NanPendulumTest-v0" not in gym.registry:
        gym.register("NanPendulumTest-v0", entry_point=NanPendulum, max_episode_steps=20)
    config = replace(preset("Pendulum-v1"), env="NanPendulumTest-v0", num_seeds=2, device="cpu")
    venv = collect.make_vec_env(config.env, 1)
    try:
        state = make_ppo(config, env_spec(venv), torch.device("cpu")).init()
    finally:
        venv.close()
    with pytest.warns(UserWarning, match="evaluation episodes have a NaN or inf return"):
        out = evaluate_state(config, state, 8)
    bad = out["nonfinite_episodes"]
    assert 0 < bad < 16 and out["mean"] is not None and math.isfinite(out["mean"]) and out["episodes"] == 8
    assert out["pooled_episodes"] == 16  # 2 seeds x 8: what the statistics pool, the non-finite ones counted apart
    assert all(m is None or math.isfinite(m) for m in out["per_seed_mean"])


def test_success_interval_wilson_by_hand():
    # 8 of 10, z = 1.959964: centre (p + z^2/2n) / (1 + z^2/n), half z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n)
    z, p, n = 1.959964, 0.8, 10
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low, high = success_interval(8, 10)
    assert low == pytest.approx(centre - half, abs=1e-5) and high == pytest.approx(centre + half, abs=1e-5)
    assert success_interval(0, 5)[0] == 0.0 and success_interval(5, 5)[1] == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="successes=6, trials=5"):
        success_interval(6, 5)
    with pytest.raises(ConfigError, match=r"^successes=2.5: expected an integer count"):  # was truncated to 2
        success_interval(2.5, 10)
    with pytest.raises(ConfigError, match=r"^trials=True: expected an integer count"):
        success_interval(1, True)
    import numpy as np

    assert success_interval(np.int64(8), np.int64(10)) == (low, high)  # numpy counts (a sum's .item()) are counts


def test_reach_and_stay_on_hand_made_curves():
    threshold = -200.0
    touches_then_falls = [-900.0, -400.0, -190.0, -250.0, -300.0]
    assert first_touch(touches_then_falls, threshold) == 2
    assert reach_and_stay(touches_then_falls, threshold) is None  # not reached
    touches_and_stays = [-900.0, -400.0, -199.0, -180.0, -200.0]
    assert first_touch(touches_and_stays, threshold) == 2
    assert reach_and_stay(touches_and_stays, threshold) == 2  # reached at the touch
    dips_then_stays = [-900.0, -150.0, -260.0, -170.0, -160.0]
    assert first_touch(dips_then_stays, threshold) == 1
    assert reach_and_stay(dips_then_stays, threshold) == 3  # reached when it came back for good
    never = [-900.0, -800.0]
    assert first_touch(never, threshold) is None and reach_and_stay(never, threshold) is None
    assert reach_and_stay([], threshold) is None


def test_evaluation_reset_seeds_are_disjoint_from_training_ones():
    # the reset seeds of training (collect.env_seeds(seed, num_envs) per agent seed, as rlfunc.run.ppo
    # does) and of evaluation (from seed + EVAL_SEED_OFFSET, as rlfunc.run.ppo.evaluate does), for runs
    # with seeds 0-19, 16 envs each and 100 evaluation episodes
    train = {s for seed in range(20) for s in collect.env_seeds(seed, 16)}
    evaluation = {s for seed in range(20) for s in collect.env_seeds(seed + EVAL_SEED_OFFSET, 100)}
    assert len(train) == 20 * 16 and len(evaluation) == 20 * 100  # no collisions within either
    assert not train & evaluation


def test_train_and_evaluate_use_disjoint_reset_seeds(tmp_path, monkeypatch):
    # what rlfunc.run.train (a ppo run) and rlfunc.run.ppo.evaluate actually pass to the envs' reset
    from rlfunc.algos.ppo import preset
    from rlfunc.run import train
    from rlfunc.run.ppo import evaluate

    calls = []
    real_reset = collect.reset

    def recording_reset(venv, seeds):
        calls.append(list(seeds))
        return real_reset(venv, seeds)

    monkeypatch.setattr(collect, "reset", recording_reset)
    config = preset("Pendulum-v1", total_steps=64, num_envs=4, num_steps=16, minibatch_size=32, num_epochs=1,
                    seed=3, device="cpu", version_every=0)
    train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)
    train_seeds = {s for c in calls for s in c}
    calls.clear()
    out = evaluate(tmp_path / "r", episodes=50, device="cpu")
    eval_seeds = {s for c in calls for s in c}
    assert len(train_seeds) == 4 and len(eval_seeds) == 50 and not train_seeds & eval_seeds
    assert out["episodes"] == 50 and out["ci95"][0] <= out["mean"] <= out["ci95"][1]
    # found by a new user: one episode printed "ci95": [NaN, NaN] (not JSON), and a snapshot
    # directory was refused ("no snapshot found") although `rlfunc eval` takes one for other algorithms
    import json

    from rlfunc.run import checkpoint

    one = evaluate(checkpoint.latest_snapshot(tmp_path / "r"), episodes=1, device="cpu")
    assert one["episodes"] == 1 and one["ci95"] is None and one["env_steps"] == 64
    json.dumps(one, allow_nan=False)  # raises on NaN


def test_bench_protocol_aggregate_and_figure(tmp_path):
    # bench/protocol.py: rliable's median and IQM (mean of the middle 50%) with bootstrap CIs, and the PNG
    from bench.protocol import aggregate, median_or_none, plot_curves, thresholds

    agg = aggregate([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], reps=2000)
    assert agg["median"] == 4.5 and agg["iqm"] == pytest.approx(4.5) and agg["seeds"] == 8
    assert agg["iqm_ci95"][0] < 4.5 < agg["iqm_ci95"][1] and agg["median_ci95"][0] < 4.5 < agg["median_ci95"][1]
    skewed = aggregate([-150.0, -151.0, -152.0, -153.0, -900.0], reps=2000)
    assert skewed["iqm"] == pytest.approx(-152.0) and skewed["mean"] < -300  # the outlier moves the mean, not the IQM
    curve = [(1000, 1.0, -900.0), (2000, 2.0, -190.0), (3000, 3.0, -250.0), (4000, 4.0, -180.0), (5000, 5.0, -170.0)]
    t = thresholds(curve, -200.0)
    assert t["first_touch"] == {"steps": 2000, "seconds": 2.0} and t["reach_and_stay"] == {"steps": 4000, "seconds": 4.0}
    # the median over seeds, not rliable's aggregate_median (the mean over runs of one task), which
    # reported HalfCheetah's five finals as "median 6439.7": their mean; the median is 6606.3
    finals = aggregate([7459.2, 6870.9, 5801.8, 5460.2, 6606.3], reps=2000)
    assert finals["median"] == 6606.3 and finals["mean"] == pytest.approx(6439.68)
    assert finals["median_ci95"][0] <= 6606.3 <= finals["median_ci95"][1]
    assert median_or_none([1.0, None, 3.0]) == 3.0 and median_or_none([None, None, 1.0]) is None
    plot_curves({"a": [curve, curve], "b": [curve[:3]]}, tmp_path / "f.png", "t", threshold=-200.0)
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_statistics_are_computed_in_float64():
    # in float32, 50 returns near 1e7 lost their decimals (mean 10000000.0, std 0.245 for 0.273), and 1000
    # copies of 1.7 had an interval that did not hold 1.7 (documented: the point itself)
    from scipy import stats as sps

    x = 1e7 + np.random.default_rng(0).uniform(-0.5, 0.5, size=50)
    out = summarize_returns(torch.tensor(x))
    assert out["mean"] == pytest.approx(x.mean(), abs=1e-6) and out["std"] == pytest.approx(x.std(), rel=1e-6)
    low, high = sps.t.interval(0.95, 49, loc=x.mean(), scale=sps.sem(x))
    assert out["ci95"] == pytest.approx([low, high], abs=1e-6)
    assert mean_interval([1.7] * 1000) == (1.7, 1.7)


def test_ppo_evaluation_warns_of_a_seed_with_nan_parameters():
    # a seed whose parameters are NaN acts NaN, which the env receives as 0: its return looked normal
    from rlfunc.algos.ppo import make_ppo, preset
    from rlfunc.config import replace
    from rlfunc.core import func
    from rlfunc.run.ppo import env_spec, evaluate_state

    config = replace(preset("Pendulum-v1"), num_seeds=3, seed=5, device="cpu")
    venv = collect.make_vec_env(config.env, 1)
    try:
        state = make_ppo(config, env_spec(venv), torch.device("cpu")).init()
    finally:
        venv.close()
    with torch.no_grad():
        func.leaves(state["params"])[0][1].fill_(float("nan"))
    with pytest.warns(UserWarning, match=r"actions held NaN in 2 of 6 episodes"):  # seed 6's 2 of 3 seeds x 2
        evaluate_state(config, state, 2)


def test_seeds_summary_pools_the_seeds_and_reports_each():
    from rlfunc.core.stats import seeds_summary

    returns = torch.tensor([1.0, 3.0, 10.0, float("nan"), 20.0, 40.0])  # 3 seeds x 2 episodes, seed 1 with a NaN return
    with pytest.warns(UserWarning, match="1 of 6 evaluation episodes"):
        out = seeds_summary(returns, 3)
    assert out["episodes"] == 2 and out["pooled_episodes"] == 6 and out["nonfinite_episodes"] == 1
    assert out["mean"] == pytest.approx(74.0 / 5) and out["per_seed_mean"] == [2.0, 10.0, 30.0]
    assert out["per_seed_ci95"][1] is None and out["per_seed_ci95"][0] == pytest.approx(list(mean_interval([1.0, 3.0])))
    one = seeds_summary(torch.tensor([1.0, 3.0]), 1)
    assert "pooled_episodes" not in one and "per_seed_ci95" not in one and one["per_seed_mean"] == [2.0]
    with pytest.raises(ShapeError, match="expected \\[num_seeds \\* episodes\\] with num_seeds=4"):
        seeds_summary(returns, 4)

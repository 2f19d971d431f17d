"""End-to-end PPO: resume equality, seeds as a batch, non-finite skipping, a short learning run."""

import json

import numpy as np
import pytest
import torch

from rlfunc.algos.ppo import preset
from rlfunc.core import func
from rlfunc.run import checkpoint
from rlfunc.run import train
from rlfunc.run.ppo import evaluate

TINY = dict(num_envs=2, num_steps=64, minibatch_size=64, num_epochs=2, checkpoint_every=1, device="cpu")


def _leaves(state):
    return {k: v.detach().clone() for k, v in state.items(include_nested=True, leaves_only=True)}


def test_resume_is_exact(tmp_path):
    # 2N iterations in one go == N iterations, stop, resume for N more: parameter for parameter.
    config = preset("Pendulum-v1", total_steps=4 * 128, **TINY)
    full = train(config, tmp_path / "full", progress=False, tensorboard=False, evaluate=False)
    part = train(config, tmp_path / "part", max_iterations=2, progress=False, tensorboard=False, evaluate=False)
    assert int(part.state["iteration"]) == 2
    resumed = train(config, tmp_path / "part", resume=True, progress=False, tensorboard=False, evaluate=False)
    assert int(resumed.state["iteration"]) == 4
    a, b = _leaves(full.state), _leaves(resumed.state)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # the metrics of the resumed half equal those of the full run
    m_full = [json.loads(l) for l in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    m_part = [json.loads(l) for l in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    for x, y in zip(m_full, m_part):
        assert x["loss_objective"] == y["loss_objective"] and x["episode_return"] == y["episode_return"]


def test_resume_refuses_existing_run_without_resume(tmp_path):
    config = preset("Pendulum-v1", total_steps=128, **TINY)
    train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    with pytest.raises(Exception, match="already holds a run"):
        train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before


def test_seeds_as_a_batch_equal_separate_runs(tmp_path):
    # Seeds s0, s0+1 trained together give the same parameters as each trained alone (loop path
    # exactly; the vmap path to float tolerance).
    base = dict(TINY, total_steps=2 * 128)
    together = train(preset("Pendulum-v1", seed=3, num_seeds=2, vmap="loop", **base), tmp_path / "t", progress=False, tensorboard=False, evaluate=False)
    vmapped = train(preset("Pendulum-v1", seed=3, num_seeds=2, vmap="vmap", **base), tmp_path / "v", progress=False, tensorboard=False, evaluate=False)
    for i, seed in enumerate((3, 4)):
        alone = train(preset("Pendulum-v1", seed=seed, **base), tmp_path / f"a{seed}", progress=False, tensorboard=False, evaluate=False)
        for key, value in _leaves(alone.state["params"]).items():
            torch.testing.assert_close(together.state["params"].get(key)[i], value[0], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(vmapped.state["params"].get(key)[i], value[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("extra", [{}, {"prioritized_minibatches": True, "target_kl": 3e-5},
                                   # the loop path: through the curvature's Newton damping the vmap path's rounding (1e-7 without
                                   # a split) grew to 3e-6 in the params by iteration 4
                                   {"oscillation_damping": True, "hessian_interval": 1, "vmap": "loop"}])
def test_seeds_as_a_batch_under_target_kl_log_each_seeds_own_steps(tmp_path, extra):
    # Regression (metrics pass): with several seeds and target_kl, a seed's metrics went on summing the
    # steps the other seeds took after it stopped, and "updates" was the longest seed's count (seed 3
    # alone: 2 updates at one iteration, beside seed 4: 3, and another approx_kl).
    # Regression too: a stopped seed went on drawing the epochs' shuffles from its generator, so its
    # generator (its next rollout's actions) was no longer its own run's; with prioritized minibatches too (review pass).
    # Regression: Adam's step count was one per leaf, shared by the seeds, so after the seeds stopped at
    # different steps (iteration 2) the stopped seed's bias correction was ahead of its own run's: seed 3's
    # iteration-3 approx_kl was 1.013e-5 beside 1.204e-5 alone and its params 2.9e-4 apart after 4
    # iterations (with oscillation damping, whose RMS bias correction counted shared steps too: 1.6e-4).
    # Each seed now counts its own steps (adam(member_dims=1), the damping's "count" per member), so all
    # 4 iterations match.
    import json

    base = dict({"num_envs": 4, "num_steps": 128, "minibatch_size": 256, "num_epochs": 4, "total_steps": 2048, "target_kl": 1e-5,
                 "device": "cpu", "checkpoint_every": 0, "version_every": 0}, **extra)  # 2 minibatches an epoch: a seed can stop an epoch before the other
    together_run = train(preset("Pendulum-v1", seed=3, num_seeds=2, **base), tmp_path / "t", progress=False, tensorboard=False,
                         evaluate=False)
    together = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    split = next(i for i, t in enumerate(together) if t["updates"][0] != t["updates"][1])  # the seeds stop apart here
    assert split == 1, [t["updates"] for t in together]  # iteration 2: seed 3 stops after epoch 0, seed 4 in epoch 1
    for i, seed in enumerate((3, 4)):
        alone_run = train(preset("Pendulum-v1", seed=seed, **base), tmp_path / f"a{seed}", progress=False, tensorboard=False,
                          evaluate=False)
        alone = [json.loads(line) for line in (tmp_path / f"a{seed}" / "metrics.jsonl").read_text().splitlines()]
        assert len(alone) == len(together) == 4
        for a, t in zip(alone, together):
            assert t["updates"][i] == a["updates"], (seed, a["iteration"])
            for key in ("approx_kl", "loss_critic", "loss_objective", "entropy", "grad_norm", "explained_variance"):
                # near-zero means (loss_objective, explained_variance ~1e-5) differ by float rounding in absolute terms
                assert t[key][i] == pytest.approx(a[key], rel=1e-3, abs=1e-9 if key == "approx_kl" else 1e-6), (seed, a["iteration"], key)
        assert torch.equal(together_run.state["rng"][i], alone_run.state["rng"][0]), seed  # the shuffles drawn alike
        adam_together, adam_alone = (run.state["optim", "1"] for run in (together_run, alone_run))
        if "inner" in adam_together.keys():  # shaping wraps Adam
            adam_together, adam_alone = adam_together["inner"], adam_alone["inner"]
        for key, value in _leaves(alone_run.state["params"]).items():
            torch.testing.assert_close(together_run.state["params"].get(key)[i], value[0], atol=1e-6, rtol=1e-5)
            assert adam_together["step"].get(key).shape == (2,)  # one count per seed
            assert adam_together["step"].get(key)[i] == adam_alone["step"].get(key), (seed, key)  # its own run's


def test_non_finite_reward_skips_update_and_is_logged(tmp_path, monkeypatch):
    import rlfunc.envs.collect as collect

    real_rollout = collect.rollout
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        batch, carry = real_rollout(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            batch["next", "reward"][0, 5] = float("nan")
        return batch, carry

    monkeypatch.setattr(collect, "rollout", poisoned)
    config = preset("Pendulum-v1", total_steps=3 * 128, **TINY)
    snapshots = []
    real_save = checkpoint.save_run_snapshot
    monkeypatch.setattr(checkpoint, "save_run_snapshot", lambda run_dir, state, meta, step, **kw: (snapshots.append(_leaves(state["learner", "params"])), real_save(run_dir, state, meta, step, **kw))[1])
    result = train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)
    records = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert records[1]["skipped_data"] > 0 and records[0]["skipped_data"] == 0 and records[2]["skipped_data"] == 0
    # the poisoned iteration left the parameters untouched, and they stayed finite
    for key in snapshots[0]:
        assert torch.equal(snapshots[0][key], snapshots[1][key]), key
    assert all(torch.isfinite(v).all() for v in _leaves(result.state).values() if v.is_floating_point())
    # the running statistics were not poisoned either
    assert torch.isfinite(result.state["return_stats", "var"]).all()


def test_short_pendulum_run_improves(tmp_path):
    # A small budget with a fixed seed must clearly beat the untrained policy.
    # Gaussian exploration with the settings of the Pendulum preset before gSDE (gSDE: tests/core/test_sde.py)
    config = preset("Pendulum-v1", total_steps=40_960, checkpoint_every=0, device="cpu", exploration="gaussian",
                    num_envs=8, num_steps=256, minibatch_size=256, lr=1e-3, anneal_lr=True,
                    normalize_observations=True, normalize_rewards=True)
    result = train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)
    assert result.interrupted is None and int(result.state["env_steps"]) == 40_960
    records = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    first = np.mean([r["episode_return"] for r in records[:2]])
    trained = evaluate(tmp_path / "r", episodes=10, device="cpu")
    assert trained["mean"] > first + 400, (first, trained)
    assert (tmp_path / "r" / "learning_curve.png").stat().st_size > 1000


def test_rollout_log_prob_matches_the_loss_log_prob():
    # The collector's fast log-probability (from the drawn noise, normaliser precomputed) equals
    # log pi(a|s) recomputed by the loss path on the same observations: the first PPO ratio is 1.
    from rlfunc.algos.ppo import make_ppo
    from rlfunc.core.distributions import gaussian_log_prob
    from rlfunc.core.normalize import normalize, update_running_stats
    from rlfunc.envs import collect
    from rlfunc.run.ppo import _generators, env_spec

    config = preset("Pendulum-v1", num_envs=4, num_steps=32, minibatch_size=32, num_seeds=2, device="cpu",
                    exploration="gaussian", normalize_observations=True)  # gSDE: tests/core/test_sde.py
    venv = collect.make_vec_env("Pendulum-v1", 8)
    algo = make_ppo(config, env_spec(venv), torch.device("cpu"))
    state = algo.init()
    state["obs_stats"] = func.vmap(update_running_stats)(state["obs_stats"], torch.randn(2, 50, 3) * 3 + 1)
    batch, _ = collect.rollout(venv, algo.policy(state, _generators(state, torch.device("cpu"))),
                               collect.reset(venv, range(8)), 32, device=torch.device("cpu"))
    batch = batch.reshape(2, 4, 32)
    for s in range(2):
        obs = normalize(state["obs_stats"][s], batch["observation"][s], clip=config.obs_clip)
        loc, log_std, _ = func.apply(algo.net, state["params"][s], obs)
        expected = gaussian_log_prob(batch["action"][s], loc, log_std)
        torch.testing.assert_close(batch["sample_log_prob"][s], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("exploration", ["gaussian", "gsde"])
def test_iteration_computes_the_log_prob_the_trainers_rollout_leaves_out(exploration):
    # The trainer's rollout uses policy(..., log_prob=False) (ten fewer ops per env step); iteration
    # then computes the batch's log-probabilities in one pass. Same actions, same update as with the
    # per-step log-probabilities, up to float rounding.
    from rlfunc.algos.ppo import make_ppo
    from rlfunc.core.normalize import update_running_stats
    from rlfunc.envs import collect
    from rlfunc.run.ppo import _generators, env_spec

    config = preset("Pendulum-v1", num_envs=4, num_steps=32, minibatch_size=64, num_epochs=2, num_seeds=2, device="cpu",
                    exploration=exploration, sde_sample_freq=4, normalize_observations=True, normalize_rewards=True)
    venv = collect.make_vec_env("Pendulum-v1", 8)
    algo = make_ppo(config, env_spec(venv), torch.device("cpu"))
    start = algo.init()
    stats = func.vmap(update_running_stats)(start["obs_stats"], torch.randn(2, 50, 3) * 3 + 1)
    out = {}
    for with_log_prob in (True, False):
        state = algo.init()  # the same parameters (seeded) and a fresh optimizer state
        state["obs_stats"] = stats.clone()
        gens = _generators(state, torch.device("cpu"))
        batch, _ = collect.rollout(venv, algo.policy(state, gens, log_prob=with_log_prob), collect.reset(venv, range(8)), 32,
                                   device=torch.device("cpu"))
        assert ("sample_log_prob" in batch.keys()) is with_log_prob
        new, metrics = algo.iteration(state, batch.reshape(2, 4, 32), gens)
        out[with_log_prob] = batch["action"], new["params"], metrics["approx_kl"]
    torch.testing.assert_close(out[True][0], out[False][0], atol=0, rtol=0)  # the same draws
    for a, b in zip(func.leaves(out[True][1]), func.leaves(out[False][1])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[True][2], out[False][2], atol=1e-5, rtol=1e-3)
    assert not torch.equal(func.leaves(out[False][1])[0], func.leaves(start["params"])[0])  # it did update


def test_resume_after_a_crash_drops_metrics_written_after_the_snapshot(tmp_path):
    # A crash (SIGKILL) after iteration 3 but before its snapshot: resume restarts from iteration 2,
    # and metrics.jsonl must not list iteration 3 twice, nor restart its clock.
    import shutil

    config = preset("Pendulum-v1", total_steps=4 * 128, **dict(TINY, checkpoint_every=2), keep_checkpoints=0)
    train(config, tmp_path / "r", max_iterations=3, progress=False, tensorboard=False, evaluate=False)
    ckpt = tmp_path / "r" / "checkpoints"
    shutil.rmtree(ckpt / "step_000000000384")  # the snapshot the crash never wrote
    (ckpt / "latest").write_text("step_000000000256\n")
    train(config, tmp_path / "r", resume=True, progress=False, tensorboard=False, evaluate=False)
    records = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    times = [r["time"] for r in records]
    assert times == sorted(times)


def test_pendulum_preset_final_policy_holds_up(tmp_path):
    # The main job (`rlfunc train ppo --env Pendulum-v1`, its preset and default budget, seed 0):
    # snapshots every 4 iterations are evaluated on the same 20 episodes; the final policy must not
    # fall below the best evaluation by more than 30 (issue 14: the constant-lr preset declined with
    # more training) and must have learned (a random policy scores about -1200).
    config = preset("Pendulum-v1", checkpoint_every=4, keep_checkpoints=0, version_every=0, device="cpu")
    assert config.total_steps == 100_000 and config.anneal_lr  # the preset as the quick start runs it
    train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)
    snaps = sorted((tmp_path / "r" / "checkpoints").glob("step_*"))
    curve = [evaluate(tmp_path / "r", episodes=20, device="cpu", snapshot=s)["mean"] for s in snaps]
    assert len(curve) >= 6 and int(snaps[-1].name.split("_")[1]) == config.num_iterations * config.batch_size
    assert max(curve) - curve[-1] <= 30.0, curve
    assert curve[-1] > -300.0, curve


def test_progress_bar_keeps_the_compile_time(tmp_path, capsys):
    """Issue 18: the first iteration's compile time is in metrics.jsonl and on the progress bar; the bar
    keeps it after the first line (whose record alone has it), beside the usual fields."""
    import dataclasses

    from tensordict import TensorDict

    from rlfunc.run.loop import Cadence, Run, run_loop

    @dataclasses.dataclass(frozen=True)
    class Config:
        seed: int = 0

    class Fake(Run):
        total, name = 3, "fake"

        def __init__(self):
            self.config, self.state = Config(), TensorDict({"iteration": torch.zeros((), dtype=torch.int64)}, batch_size=[])

        def step(self, i, stopping):
            self.state["iteration"] = torch.tensor(i)
            return {"iteration": i, "step": 10 * i, "steps_per_s": 100.0 * i, **({"compile_s": 12.5} if i == 1 else {})}

        def saved(self):
            return self.state.clone(), {"algo": "fake", "config": {}, "iteration": int(self.state["iteration"]),
                                        "env_steps": 10 * int(self.state["iteration"]), "state_layout": 2}

    run_loop(Fake(), tmp_path, when=Cadence(checkpoint_every=0, keep_checkpoints=0, version_every=0, version_keep_last=0,
                                             version_keep_every=0), tensorboard=False)
    bar = capsys.readouterr().err
    last = [line for line in bar.replace("\r", "\n").splitlines() if "3/3" in line][-1]
    assert "compile_s=12.5" in last and "steps_per_s=300" in last
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("compile_s") for line in lines] == [12.5, None, None]


def test_off_a_terminal_the_bar_refreshes_rarely_and_tqdm_disable_hides_it(tmp_path, capsys, monkeypatch):
    """Regression: in a job's log (stderr not a terminal) the bar refreshed every 0.1 s, a "\\r" line each
    (megabytes over a long run); now the first and the final state only within 30 s, and TQDM_DISABLE=1
    (tqdm's own switch, which the explicit disable=False ignored) shows none; metrics.jsonl is whole."""
    import dataclasses
    import time as _time

    from tensordict import TensorDict

    from rlfunc.run.loop import Cadence, Run, run_loop

    @dataclasses.dataclass(frozen=True)
    class Config:
        seed: int = 0

    class Slow(Run):
        total, name = 40, "slow"

        def __init__(self):
            self.config, self.state = Config(), TensorDict({"iteration": torch.zeros((), dtype=torch.int64)}, batch_size=[])

        def step(self, i, stopping):
            _time.sleep(0.01)  # 0.4 s in all: 4 refreshes at tqdm's default 0.1 s
            self.state["iteration"] = torch.tensor(i)
            return {"iteration": i, "step": 10 * i, "steps_per_s": 100.0}

        def saved(self):
            return self.state.clone(), {"algo": "fake", "config": {}, "iteration": int(self.state["iteration"]),
                                        "env_steps": 10 * int(self.state["iteration"]), "state_layout": 2}

    when = Cadence(checkpoint_every=0, keep_checkpoints=0, version_every=0, version_keep_last=0, version_keep_every=0)
    monkeypatch.delenv("TQDM_MININTERVAL", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    run_loop(Slow(), tmp_path / "a", when=when, tensorboard=False, evaluate=False)
    frames = [f for f in capsys.readouterr().err.replace("\r", "\n").splitlines() if f.startswith("slow:")]
    assert len(frames) == 2 and "0/40" in frames[0] and "40/40" in frames[-1], frames
    monkeypatch.setenv("TQDM_DISABLE", "0")  # any non-empty value, as tqdm reads it
    run_loop(Slow(), tmp_path / "b", when=when, tensorboard=False, evaluate=False)
    assert "slow:" not in capsys.readouterr().err
    assert len((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()) == 40


def test_a_run_that_fails_before_its_first_iteration_leaves_no_run_dir(tmp_path, monkeypatch):
    # Regression (new-user pass): a failed `--compile on` (the first iteration raised) left config.json, an
    # empty metrics.jsonl and tb/, so the same command with `--compile off`, as the error advised, was
    # refused ("run_dir ... is not empty") and resume had no snapshot
    import rlfunc.envs.collect as collect
    from rlfunc.errors import ConfigError

    def broken(*args, **kwargs):
        raise ConfigError("--compile on: torch.compile (inductor) of ppo's step failed; use --compile off")

    config = preset("Pendulum-v1", total_steps=2 * 128, **TINY)
    with monkeypatch.context() as m:
        m.setattr(collect, "rollout", broken)
        with pytest.raises(ConfigError, match="compile"):
            train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)
    assert not (tmp_path / "r").exists()
    result = train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)  # the same dir takes the run now
    assert int(result.state["iteration"]) == 2
    # a dir that existed before (made by the user) is left in place
    (tmp_path / "mine").mkdir()
    with monkeypatch.context() as m:
        m.setattr(collect, "rollout", broken)
        with pytest.raises(ConfigError):
            train(config, tmp_path / "mine", progress=False, tensorboard=False, evaluate=False)
    assert (tmp_path / "mine").is_dir()


def test_the_progress_bar_keeps_the_last_return_instead_of_nan(tmp_path, capsys):
    # Regression (new-user pass): every iteration in which no episode ended showed episode_return=nan
    # (Pendulum's episodes are 200 steps: 2 envs x 64 steps end none in the first iterations)
    config = preset("Pendulum-v1", total_steps=8 * 128, **{**TINY, "checkpoint_every": 0})
    train(config, tmp_path / "r", progress=True, tensorboard=False, evaluate=False)
    err = capsys.readouterr().err
    assert "steps_per_s=" in err and "episode_return=" in err and "nan" not in err


def test_a_run_that_failed_before_its_first_snapshot_says_what_to_do(tmp_path, monkeypatch):
    # Regression: a new run that failed after its first iteration but before its first snapshot left a run
    # dir (its metrics line kept) that `resume` refused with "no snapshot" and `train` with "not empty",
    # neither saying that it cannot be resumed and what to do instead.
    import rlfunc.envs.collect as collect
    from rlfunc.errors import CheckpointError, ConfigError
    from rlfunc.run.loop import resume

    real_rollout, calls = collect.rollout, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("the env broke")
        return real_rollout(*args, **kwargs)

    monkeypatch.setattr(collect, "rollout", failing)
    config = preset("Pendulum-v1", total_steps=3 * 128, **dict(TINY, checkpoint_every=0, version_every=0))
    with pytest.raises(RuntimeError, match="the env broke"):
        train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)
    assert (tmp_path / "r" / "metrics.jsonl").read_text().count("\n") == 1  # its line is kept, not deleted
    with pytest.raises(CheckpointError, match="stopped before its first one and cannot be resumed: train it again with a new "
                                              "--run-dir, or remove this one"):
        resume(tmp_path / "r", progress=False, tensorboard=False, evaluate=False)
    (tmp_path / "other" / "run").mkdir(parents=True)  # not a run (the parent of one, an easy slip): not to be removed
    with pytest.raises(CheckpointError, match="no snapshot to resume from .*; it holds no run") as e:
        resume(tmp_path / "other", progress=False, tensorboard=False, evaluate=False)
    assert "remove" not in str(e.value)
    with pytest.raises(ConfigError, match="is not empty .*choose a new --run-dir or remove it"):
        train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)

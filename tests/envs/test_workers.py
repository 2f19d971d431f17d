"""Env worker processes (rlfunc.envs.workers, run.env_workers): K workers give the batches of the
in-process envs for the same seeds and actions (Box and Dict observations with uint8 images), their
env state is every env's, a bad K is one line, and a run stepping its envs in workers resumes exactly."""

import json

import numpy as np
import pytest
import torch

from envs.push import env as pe
from rlfunc.algos.diffusion_actor import ActorSpec
from rlfunc.algos.dppo import DPPOConfig
from rlfunc.algos.mappo import MAPPOConfig
from rlfunc.algos.ppo import PPOConfig
from rlfunc.cli.commands import main
from rlfunc.config import replace
from rlfunc.envs import collect
from rlfunc.envs.chunk import GymChunkEnv
from rlfunc.errors import ConfigError, EnvError
from rlfunc import resume, train
from rlfunc.run import train

CPU = torch.device("cpu")


def _uniform_policy(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return lambda obs: (torch.rand(obs.shape[0], 1, generator=gen) * 4 - 2, torch.zeros(obs.shape[0], 1))


def test_two_workers_give_the_in_process_rollout_and_env_state():
    """Pendulum-v1, 4 envs: 210 steps (every episode ends at 200: final observations, autoreset) in
    2 workers equal the sync vector env's, tensor for tensor; so do the env states, and a state set
    into the workers continues as it does in process."""
    seeds = collect.env_seeds(5, 4)
    venvs = [collect.make_vec_env("Pendulum-v1", 4), collect.make_vec_env("Pendulum-v1", 4, workers=2)]
    try:
        out = []
        for venv in venvs:
            carry = collect.reset(venv, seeds)
            batch, carry = collect.rollout(venv, _uniform_policy(0), carry, 105, device=CPU)
            batch2, carry = collect.rollout(venv, _uniform_policy(1), carry, 105, device=CPU)
            out.append((batch, batch2, carry, collect.env_state(venv)))
        (a, a2, ca, sa), (b, b2, cb, sb) = out
        assert b2["next", "done"].any() and (a == b).all() and (a2 == b2).all() and (ca == cb).all()
        assert sa == sb and len(sb) == 4
        collect.set_env_state(venvs[1], sa)  # back to the state the next rollout starts from: the same rollout
        c, _ = collect.rollout(venvs[1], _uniform_policy(2), cb, 20, device=CPU)
        collect.set_env_state(venvs[0], sa)
        d, _ = collect.rollout(venvs[0], _uniform_policy(2), ca, 20, device=CPU)
        assert (c == d).all()
    finally:
        for venv in venvs:
            venv.close()


def _chunk_rollout(env_id: str, n: int, act_steps: int, workers: int, steps: int):
    env = GymChunkEnv(env_id, n, act_steps=act_steps, seed=3, workers=workers)
    try:
        gen = torch.Generator().manual_seed(0)
        td = env.reset()
        outs = [td.clone()]
        for _ in range(steps):
            td = env.step(td.set("action", torch.rand(env.action_spec.shape, generator=gen) * 2 - 1))
            outs.append(td.clone())
            td = env.step_mdp(td)
            if td["done"].any():
                td = env.reset(td.set("_reset", td["done"]))  # a partial reset
        return outs, env.episode_state(), env.rng_state()
    finally:
        env.close()


@pytest.mark.parametrize("env_id, n, act_steps, steps", [
    ("Pendulum-v1", 4, 3, 70),  # chunks cut by the time limit, partial resets
    pytest.param("Push-v0", 2, 2, 3, marks=pytest.mark.skipif(not pe.rendering_available(), reason="no working OpenGL")),
])
def test_chunk_env_in_workers_gives_the_in_process_outputs(env_id, n, act_steps, steps):
    """GymChunkEnv with 2 workers: the same TensorDicts (Push-v0: uint8 camera images, proprio,
    instruction tokens) and the same episode state as in process."""
    a, state_a, rng_a = _chunk_rollout(env_id, n, act_steps, 0, steps)
    b, state_b, rng_b = _chunk_rollout(env_id, n, act_steps, 2, steps)
    assert len(a) == len(b) and all((x == y).all() for x, y in zip(a, b))
    assert state_a == state_b and rng_a == rng_b
    if env_id == "Push-v0":
        assert b[-1]["next", "top"].dtype == torch.uint8 and b[-1]["next", "top"].shape == (n, 128, 128, 3)
    else:
        assert any(o["next", "truncated"].any() for o in b[1:])


def test_chunk_env_state_set_into_workers_continues_the_episodes():
    env = GymChunkEnv("Pendulum-v1", 2, act_steps=2, seed=1, workers=2)
    try:
        td = env.reset()
        td = env.step_mdp(env.step(td.set("action", torch.full(env.action_spec.shape, 0.5))))
        state = env.episode_state()
        first = env.step(td.clone().set("action", torch.full(env.action_spec.shape, -0.3)))["next"]
        env.reset()
        env.set_episode_state(state)
        again = env.step(td.clone().set("action", torch.full(env.action_spec.shape, -0.3)))["next"]
        assert (first == again).all()
        with pytest.raises(AttributeError):  # the gymnasium envs live in the workers
            env.envs
    finally:
        env.close()


def test_a_bad_number_of_workers_is_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"run.env_workers=3: num_envs=8 .*not divisible"):
        replace(PPOConfig(), num_envs=8, env_workers=3)
    with pytest.raises(ConfigError, match="env_workers=-1"):
        replace(PPOConfig(), env_workers=-1)
    with pytest.raises(ConfigError, match="env_workers=2 with vectorization='async'"):
        replace(PPOConfig(), env_workers=2, vectorization="async")
    with pytest.raises(ConfigError, match="run.env_workers=2: mappo"):
        replace(MAPPOConfig(), env_workers=2)
    with pytest.raises(EnvError, match="num_envs=3 is not divisible by env_workers=2"):
        collect.make_vec_env("Pendulum-v1", 3, workers=2)
    code = main(["train", "ppo", "--env", "Pendulum-v1", "--run-dir", str(tmp_path / "r"), "--num-envs", "3", "--env-workers", "2",
                 "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "env_workers=2" in err[0] and "num_envs=3" in err[0]
    assert not (tmp_path / "r").exists()


QUIET = dict(progress=False, tensorboard=False)


def _leaves(state) -> dict:
    return dict(state.items(include_nested=True, leaves_only=True))


def test_a_ppo_run_in_workers_resumes_to_the_in_process_run(tmp_path, monkeypatch):
    """Pendulum-v1, 2 envs in 2 workers: 2 iterations, stop, resume to 4 equal 4 iterations in one go
    of the in-process envs, tensor for tensor (the envs' physics, RNG and time limits come from the
    workers' snapshot; the episodes end at their step 200, in the 4th iteration)."""
    config = replace(PPOConfig(), env="Pendulum-v1", total_steps=4 * 128, num_envs=2, num_steps=64, minibatch_size=64,
                     num_epochs=1, checkpoint_every=1, device="cpu", version_every=0)
    inline = train(config, tmp_path / "inline", **QUIET, evaluate=False)
    train(replace(config, env_workers=2), tmp_path / "part", max_iterations=2, **QUIET, evaluate=False)
    resumed = train(None, tmp_path / "part", resume=True, **QUIET, evaluate=False)
    a, b = _leaves(inline.state), _leaves(resumed.state)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    records = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("inline", "part")]
    assert [r["episode_return"] for r in records[0]] == [r["episode_return"] for r in records[1]]
    assert np.isfinite(records[1][-1]["episode_return"]) and records[1][-1]["episodes"] == 2
    # the bug: the evaluation re-checked the config with num_envs=episodes and the run's 2 workers,
    # so an odd episode count (the final evaluation's, `rlfunc eval`'s) failed after training
    from rlfunc.run.ppo import evaluate

    assert evaluate(tmp_path / "part", episodes=3)["episodes"] == 3  # 3 episodes: in 1 worker
    # the evaluation steps in the run's workers (as many as divide the episodes): the same episodes
    from rlfunc.envs import collect

    made, real = [], collect.make_vec_env
    monkeypatch.setattr(collect, "make_vec_env", lambda *a, **k: (made.append(k.get("workers", 0)), real(*a, **k))[1])
    assert evaluate(tmp_path / "part", episodes=4) == evaluate(tmp_path / "inline", episodes=4)
    assert made == [2, 0]


def test_an_evaluation_takes_the_most_workers_that_divide_its_episodes():
    from rlfunc.envs.collect import eval_workers

    assert [eval_workers(0, 5), eval_workers(2, 3), eval_workers(4, 6), eval_workers(8, 100), eval_workers(3, 2)] == [0, 1, 3, 5, 2]


def test_a_killed_worker_is_one_error_naming_it():
    """The bug: a worker killed between calls (OOM, a crash in C) made the next send raise BrokenPipeError,
    which the CLI takes for a closed stdout: exit 141 with no message. Now the call is an EnvError naming
    the worker."""
    import os
    import signal

    venv = collect.make_vec_env("Pendulum-v1", 2, workers=2)
    try:
        venv.reset(seed=[0, 1])
        worker = venv.pool.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        with pytest.raises(EnvError, match=r"env worker 0: the process ended \(exit code -9\)"):
            venv.step(np.zeros((2, 1), dtype=np.float32))
    finally:
        venv.close()


def test_a_dppo_run_in_workers_resumes_to_the_in_process_run(tmp_path):
    """dppo on Pendulum-v1 (GymChunkEnv, 4-action chunks), 4 envs in 2 workers: 2 iterations, stop,
    resume to 4 equal 4 iterations in one go in process (learner, optimizers, generators)."""
    actor = ActorSpec(hidden=(32, 32), num_train_steps=6, ddim_steps=3)
    config = replace(DPPOConfig(), actor=actor, env="Pendulum-v1", num_envs=4, num_steps=4, minibatch_size=8, num_epochs=1,
                     critic_hidden=(32,), total_steps=4 * 64, eval_episodes=2, device="cpu")
    inline = train(config, tmp_path / "inline", **QUIET)
    train(replace(config, total_steps=2 * 64, env_workers=2), tmp_path / "part", **QUIET)
    resumed = resume(tmp_path / "part", 4 * 64, **QUIET)
    a, b = _leaves(inline.state), _leaves(resumed.state)
    assert int(resumed.state["iteration"]) == 4 and a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []

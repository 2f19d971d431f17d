"""Collection: our rollout loop vs a TorchRL Collector, episode ends, env state round-trips."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlfunc.envs import collect
from rlfunc.errors import EnvError


def policy(obs):
    # deterministic, obs-dependent, bounded: exercises clipping and the env dynamics
    return torch.sin(obs[..., :1] * 3.0) * 2.5, torch.zeros(*obs.shape[:-1], 1)


def _ours_and_torchrls(env_id: str, act, n: int, t: int, seed: int):
    """(rlfunc's rollout, a TorchRL collector's batch) of ``act`` on ``n`` envs for ``t`` steps, both
    starting from TorchRL's reset(seed) then reset()."""
    env = collect.make_torchrl_env(env_id, n)
    env.set_seed(seed)  # TorchRL: reset(seed=seed), then the collector's own reset()
    theirs = next(iter(collect.make_collector(env, act, frames_per_batch=n * t)))
    venv = collect.make_vec_env(env_id, n)
    venv.reset(seed=seed)
    obs, _ = venv.reset()
    carry = collect.empty_carry(n, obs.shape[-1])
    carry["observation"] = torch.as_tensor(obs)
    ours, _ = collect.rollout(venv, act, carry, t, device=torch.device("cpu"))
    return ours, theirs


def test_rollout_matches_torchrl_collector():
    n, t = 3, 250  # Pendulum truncates at 200 steps: one episode end inside the batch
    ours, theirs = _ours_and_torchrls("Pendulum-v1", policy, n, t, 7)
    assert ours.batch_size == theirs.batch_size == torch.Size([n, t])
    # Identical through the first episode, its last step included (("next", "observation") there is
    # the true final observation in both). After an episode end TorchRL's collector resets the
    # ended envs itself (drawing a new initial state), so later episodes start elsewhere.
    first = slice(0, 200)
    for key in ["observation", "action", ("next", "observation"), ("next", "reward")]:
        torch.testing.assert_close(ours[key][:, first], theirs[key][:, first].to(ours[key].dtype), atol=1e-5, rtol=1e-5)
    for key in [("next", "done"), ("next", "terminated"), ("next", "truncated")]:
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["next", "truncated"][:, 199].all()


def test_episode_end_keeps_true_final_observation():
    venv = collect.make_vec_env("Pendulum-v1", 2)
    carry = collect.reset(venv, [1, 2])
    batch, carry = collect.rollout(venv, policy, carry, 210, device=torch.device("cpu"))
    done = batch["next", "done"].squeeze(-1)
    assert done[:, 199].all() and done.sum() == 2
    assert batch["next", "truncated"][:, 199].all() and not batch["next", "terminated"].any()
    # after the end the next step starts from a reset observation, not the final one
    assert not torch.allclose(batch["next", "observation"][:, 199], batch["observation"][:, 200])
    # continuity elsewhere: next observation of step t is the observation of step t+1
    torch.testing.assert_close(batch["next", "observation"][:, :199], batch["observation"][:, 1:200])
    # episode_reward at the end is the sum of the episode's rewards
    torch.testing.assert_close(batch["next", "episode_reward"][:, 199], batch["next", "reward"][:, :200].sum(1), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "MountainCarContinuous-v0", "HalfCheetah-v5"])
def test_env_state_round_trip(env_id):
    a = collect.make_vec_env(env_id, 2)
    b = collect.make_vec_env(env_id, 2)
    collect.reset(a, [5, 6])
    rng = np.random.default_rng(0)
    actions = [rng.uniform(-1, 1, size=(2, *a.single_action_space.shape)).astype(np.float32) for _ in range(40)]
    for act in actions[:15]:
        a.step(act)
    state = collect.env_state(a)
    collect.reset(b, [100, 200])
    collect.set_env_state(b, state)
    for act in actions[15:]:
        oa, ra, ta, tra, _ = a.step(act)
        ob, rb, tb, trb, _ = b.step(act)
        np.testing.assert_array_equal(oa, ob)
        np.testing.assert_array_equal(ra, rb)


def test_unknown_env_id_names_close_matches():
    with pytest.raises(EnvError, match="Pendulum-v1"):
        collect.make_vec_env("Pendulum-v9", 2)
    with pytest.raises(EnvError, match="num_envs"):
        collect.make_vec_env("Pendulum-v1", 0)


def test_episode_statistics_carry_across_rollouts():
    venv = collect.make_vec_env("Pendulum-v1", 2)
    carry = collect.reset(venv, [3, 4])
    first, carry = collect.rollout(venv, policy, carry, 150, device=torch.device("cpu"))
    assert torch.equal(carry["episode_length"], torch.full((2, 1), 150))
    second, carry = collect.rollout(venv, policy, carry, 60, device=torch.device("cpu"))
    rewards = torch.cat([first["next", "reward"], second["next", "reward"]], 1)
    # the episode that started in the first rollout ends at its step 199 = step 49 of the second
    assert second["next", "done"][:, 49].all()
    torch.testing.assert_close(second["next", "episode_reward"][:, 49], rewards[:, :200].sum(1), rtol=1e-5, atol=1e-3)
    # after the end a new episode accumulates from zero; 10 steps into it at the end of the rollout
    torch.testing.assert_close(carry["episode_reward"], rewards[:, 200:].sum(1), rtol=1e-5, atol=1e-4)
    assert torch.equal(carry["episode_length"], torch.full((2, 1), 10))


def test_non_finite_reward_voids_only_its_own_episode():
    # Regression: 0 * inf = NaN used to carry a NaN return into every later episode.
    venv = collect.make_vec_env("Pendulum-v1", 1)
    carry = collect.reset(venv, [0])
    real_step = venv.step

    def step(action, t=[0]):
        obs, rew, term, trunc, info = real_step(action)
        t[0] += 1
        return obs, (np.full_like(rew, np.inf) if t[0] == 10 else rew), term, trunc, info

    venv.step = step
    batch, carry = collect.rollout(venv, policy, carry, 400, device=torch.device("cpu"))
    ep = batch["next", "episode_reward"][0, :, 0]
    assert torch.isnan(ep[9:200]).all() and torch.isfinite(ep[:9]).all()
    assert torch.isfinite(ep[200:]).all() and torch.isfinite(carry["episode_reward"]).all()
    rewards = batch["next", "reward"][0, 200:400, 0]
    torch.testing.assert_close(ep[399], rewards.sum(), rtol=1e-5, atol=1e-3)


class _Grid(__import__("gymnasium").Env):
    """An env with matrix-shaped Box observations and actions: obs = state (2x3), action (3x2)."""

    def __init__(self):
        import gymnasium as gym

        self.observation_space = gym.spaces.Box(-10, 10, (2, 3), np.float32)
        self.action_space = gym.spaces.Box(-1, 1, (3, 2), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.state = self.np_random.uniform(-1, 1, (2, 3)).astype(np.float32)
        self.t = 0
        return self.state.copy(), {}

    def step(self, action):
        self.t += 1
        self.state = np.clip(self.state + 0.1 * action.T, -10, 10).astype(np.float32)
        return self.state.copy(), float(-np.abs(self.state).sum()), False, self.t >= 20, {}


def test_matrix_shaped_spaces_are_flattened():
    import gymnasium as gym

    gym.register("GridTest-v0", entry_point=_Grid)
    venv = collect.make_vec_env("GridTest-v0", 2)
    carry = collect.reset(venv, [1, 2])
    assert carry["observation"].shape == (2, 6)
    flat_policy = lambda obs: (torch.ones(obs.shape[0], 6) * 0.5, torch.zeros(obs.shape[0], 1))  # noqa: E731
    batch, _ = collect.rollout(venv, flat_policy, carry, 25, device=torch.device("cpu"))
    assert batch["observation"].shape == (2, 25, 6) and batch["action"].shape == (2, 25, 6)
    # action 0.5 everywhere moves every state entry by +0.05 per step
    torch.testing.assert_close(batch["next", "observation"][:, 0] - batch["observation"][:, 0], torch.full((2, 6), 0.05))


def test_env_that_cannot_be_built_is_an_env_error():
    import gymnasium as gym

    def broken(**kwargs):
        raise ImportError("no module named box2d")

    gym.register("BrokenTest-v0", entry_point=broken)
    with pytest.raises(EnvError, match="could not be built: ImportError"):
        collect.make_vec_env("BrokenTest-v0", 1)


class _Target(gym.Env):
    """One-dim toy: the episode ends after ``3 + index`` steps; it succeeds when the last action is > 0.
    Rewards are 1 per step. For :func:`collect.episode_outcomes`."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self, index: int) -> None:
        self.length, self.t = 3 + index, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {"is_success": False}

    def step(self, action):
        self.t += 1
        end = self.t >= self.length
        return np.zeros(1, np.float32), 1.0, end, False, {"is_success": bool(end and action[0] > 0)}


def test_episode_outcomes_reads_success_from_the_final_info_of_same_step_autoreset():
    """Env 0 ends at step 3 with action +1 (success), env 1 at step 4 with action -1 (failure): the
    success flags come from the final step's info (SAME_STEP autoreset replaces info with the reset's),
    and the second episode of env 0 does not count."""
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    venv = SyncVectorEnv([lambda: _Target(0), lambda: _Target(1)], autoreset_mode=AutoresetMode.SAME_STEP)
    sign = torch.tensor([[1.0], [-1.0]])
    returns, success = collect.episode_outcomes(venv, lambda obs: (sign, None), [0, 1], device=torch.device("cpu"))
    assert returns.tolist() == [3.0, 4.0]
    assert success.tolist() == [True, False]
    pend = collect.make_vec_env("Pendulum-v1", 1)
    _, none = collect.episode_outcomes(pend, lambda obs: (torch.zeros(1, 1), None), [0], device=torch.device("cpu"))
    assert none is None  # Pendulum reports no success


class _Recorder(gym.Env):
    """Records every action it is given; 2-D actions in [-1, 0.5]; observation = step count."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    action_space = gym.spaces.Box(np.array([[-1.0, -1.0]], np.float32), np.array([[0.5, 0.5]], np.float32))
    seen: list = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        _Recorder.seen.append(action)  # kept by reference: the array must not be reused by the caller
        self.t += 1
        return np.full(1, self.t, np.float32), 0.0, False, self.t >= 4, {}


def test_env_receives_clipped_finite_fresh_actions_and_batch_keeps_the_drawn_ones():
    gym.register("RecorderTest-v0", entry_point=_Recorder)
    venv = collect.make_vec_env("RecorderTest-v0", 1)
    drawn = torch.tensor([[float("nan"), 2.0], [float("inf"), -float("inf")], [-3.0, 0.25]])

    def scripted(obs):
        return drawn[int(obs[0, 0]) % 3].view(1, 2).clone(), torch.zeros(1, 1)

    _Recorder.seen.clear()
    batch, _ = collect.rollout(venv, scripted, collect.reset(venv, [0]), 3, device=torch.device("cpu"))
    expected = [[[0.0, 0.5]], [[0.5, -1.0]], [[-1.0, 0.25]]]  # NaN -> 0, then clipped to [-1, 0.5]
    assert [a.tolist() for a in _Recorder.seen] == expected
    assert all(a.shape == (1, 2) and a.dtype == np.float32 for a in _Recorder.seen)
    # a new array per step (the values above would also show a reused buffer being overwritten)
    assert len({a.__array_interface__["data"][0] for a in _Recorder.seen}) == 3
    torch.testing.assert_close(batch["action"][0], drawn, equal_nan=True)  # stored as drawn


class _Float64Bounds(_Recorder):
    action_space = gym.spaces.Box(np.float64(-0.1), np.float64(0.1), (1,), np.float64)


def test_float64_action_space_gets_float64_actions_exactly_within_its_bounds():
    # 0.1 rounded to float32 is above the float64 bound 0.1: the clip must happen in the space's dtype
    gym.register("Float64BoundsTest-v0", entry_point=_Float64Bounds)
    venv = collect.make_vec_env("Float64BoundsTest-v0", 1)
    _Recorder.seen.clear()
    collect.rollout(venv, lambda obs: (torch.ones(1, 1), torch.zeros(1, 1)), collect.reset(venv, [0]), 2, device=torch.device("cpu"))
    assert len(_Recorder.seen) == 2 and all(a.dtype == np.float64 and a.tolist() == [0.1] for a in _Recorder.seen)


def test_a_module_colon_env_id_imports_the_module_as_gymnasium_does(tmp_path, monkeypatch):
    """New-user pass: `--env mymodule:MyEnv-v0` (gymnasium's form: make imports the module, which
    registers the env) was refused as "not a registered gymnasium environment"."""
    (tmp_path / "rlfunc_test_plugin_env.py").write_text(
        "import gymnasium\n"
        "gymnasium.register(id='PluginPendulum-v0', entry_point='gymnasium.envs.classic_control.pendulum:PendulumEnv',\n"
        "                   max_episode_steps=50)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    venv = collect.make_vec_env("rlfunc_test_plugin_env:PluginPendulum-v0", 2)
    try:
        carry = collect.reset(venv, [1, 2])
        batch, _ = collect.rollout(venv, policy, carry, 50, device=torch.device("cpu"))
        assert batch["next", "done"][:, 49].all() and not batch["next", "done"][:, :49].any()  # its own time limit
    finally:
        venv.close()
    with pytest.raises(EnvError, match=r"importing 'rlfunc_test_plugin_env' registered no gymnasium environment 'Pendulum-v9'; did you mean"):
        collect.check_env_id("rlfunc_test_plugin_env:Pendulum-v9")
    with pytest.raises(EnvError, match=r"^env='no_such_module_xyz:A-v0': importing 'no_such_module_xyz' .* failed: ModuleNotFoundError"):
        collect.check_env_id("no_such_module_xyz:A-v0")


def test_episodes_that_never_end_name_the_missing_time_limit():
    """New-user pass: an env without a time limit failed the final evaluation, after the whole run,
    with "episode_outcomes: episodes did not end within max_steps=100000" (an internal name, no cause)."""
    from gymnasium.envs.classic_control.pendulum import PendulumEnv

    if "EndlessPendulum-v0" not in gym.registry:
        gym.register("EndlessPendulum-v0", entry_point=PendulumEnv, max_episode_steps=None)
    venv = collect.make_vec_env("EndlessPendulum-v0", 2)
    try:
        with pytest.raises(EnvError, match=r"^evaluation: 2 of 2 episodes did not end within 50 steps \(its gymnasium "
                                           r"registration has no max_episode_steps"):
            collect.episode_outcomes(venv, policy, [0, 1], device=torch.device("cpu"), max_steps=50)
    finally:
        venv.close()


def test_a_torchrl_collector_over_a_discrete_env_takes_index_actions():
    """TorchRL pass: make_torchrl_env's one-hot action spec made make_collector over CartPole-v1 fail
    14 frames deep in gymnasium; the batch now equals rlfunc's rollout through the first episode end."""
    n, t = 2, 60
    push = lambda o: ((o[..., 2] > 0).long(), torch.zeros(*o.shape[:-1], 1))  # noqa: E731  (push toward the lean)
    ours, theirs = _ours_and_torchrls("CartPole-v1", push, n, t, 3)
    assert theirs["action"].dtype == torch.int64 and theirs["action"].shape == (n, t)
    end = int(ours["next", "done"].squeeze(-1).float().argmax(1).min())  # the first episode end of either env
    assert 0 < end < t
    for key in ["observation", "action", ("next", "observation"), ("next", "reward")]:
        torch.testing.assert_close(ours[key][:, :end + 1], theirs[key][:, :end + 1].to(ours[key].dtype).reshape(ours[key][:, :end + 1].shape))


def test_async_vector_env_starts_from_a_script_without_a_main_guard(tmp_path):
    """Review of 4fb0c45: forkserver workers re-ran the parent's main script, so a script without an
    ``if __name__ == "__main__"`` guard failed with multiprocessing's bootstrapping error (blamed on the env
    as ConnectionResetError). The workers now start without it, as rlfunc's own env workers do."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "unguarded.py"
    script.write_text("from rlfunc.envs.collect import make_vec_env\n"
                      "v = make_vec_env('CartPole-v1', 2, vectorization='async')\n"
                      "o, _ = v.reset(seed=0)\nprint('ok', tuple(o.shape))\nv.close()\n")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok (2, 4)", out.stderr[-2000:]
    assert "bootstrapping" not in out.stderr


class _Raising(gym.Env):
    """Raises in step (or in reset with ``where="reset"``): a user's env with a bug."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self, where="step", message="boom in step\nsecond line"):
        self.where, self.message = where, message

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.where == "reset":
            raise ValueError("boom in reset")
        return np.zeros(1, np.float32), {}

    def step(self, action):
        raise RuntimeError(self.message)


def test_an_env_that_raises_is_one_env_error_line_with_its_cause():
    # new-user pass (gymnasium envs): in this process it was a 17-frame traceback through gymnasium's
    # vector env, exit 1; in worker processes one line: now both are one EnvError line
    import gymnasium as gym

    gym.register("RaisingTest-v0", entry_point=_Raising)
    venv = collect.make_vec_env("RaisingTest-v0", 2)
    try:
        carry = collect.reset(venv, [1, 2])
        policy = lambda obs: (torch.zeros(obs.shape[0], 1), torch.zeros(obs.shape[0], 1))  # noqa: E731
        with pytest.raises(EnvError, match=r"^env='RaisingTest-v0': its step raised RuntimeError: boom in step$") as info:
            collect.rollout(venv, policy, carry, 3, device=torch.device("cpu"))
        assert isinstance(info.value.__cause__, RuntimeError)  # the env's traceback, for the Python API
    finally:
        venv.close()
    venv = collect.make_vec_env("RaisingTest-v0", 1, message="")  # no message: no dangling ": " (review pass)
    try:
        with pytest.raises(EnvError, match=r"^env='RaisingTest-v0': its step raised RuntimeError$"):
            collect.rollout(venv, policy, collect.reset(venv, [0]), 2, device=torch.device("cpu"))
    finally:
        venv.close()
    venv = collect.make_vec_env("RaisingTest-v0", 1, where="reset")
    try:
        with pytest.raises(EnvError, match=r"^env='RaisingTest-v0': its reset raised ValueError: boom in reset$"):
            collect.reset(venv, [0])
    finally:
        venv.close()

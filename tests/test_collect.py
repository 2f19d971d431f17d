"""Collection: our rollout loop vs a TorchRL Collector, episode ends, env state round-trips."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rlfunc import collect
from rlfunc.errors import EnvError


def policy(obs):
    # deterministic, obs-dependent, bounded: exercises clipping and the env dynamics
    return torch.sin(obs[..., :1] * 3.0) * 2.5, torch.zeros(*obs.shape[:-1], 1)


def test_rollout_matches_torchrl_collector():
    n, t = 3, 250  # Pendulum truncates at 200 steps: one episode end inside the batch
    env = collect.make_torchrl_env("Pendulum-v1", n)
    env.set_seed(7)  # TorchRL: reset(seed=7), then the collector's own reset()
    theirs = next(iter(collect.make_collector(env, policy, frames_per_batch=n * t)))
    venv = collect.make_vec_env("Pendulum-v1", n)
    venv.reset(seed=7)
    obs, _ = venv.reset()
    carry = TensorDict(
        {"observation": torch.as_tensor(obs), "episode_reward": torch.zeros(n, 1), "episode_length": torch.zeros(n, 1, dtype=torch.int64)},
        batch_size=[n],
    )
    ours, _ = collect.rollout(venv, policy, carry, t, device=torch.device("cpu"))
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


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "HalfCheetah-v5"])
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

"""gSDE (rlfunc.core.sde) against float64 torch.distributions references, and wired into PPO: noise held
for sde_sample_freq steps, rollout/loss log-probabilities agree, seeds as a batch, exact resume, learning."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.distributions import Independent, Normal, TransformedDistribution
from torch.distributions.transforms import TanhTransform

from rlfunc.algos.ppo import make_ppo, preset
from rlfunc.core import func
from rlfunc.envs import collect
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.core.sde import (
    EPSILON,
    draw_exploration_matrix,
    exploration_matrix,
    resample_due,
    sde_entropy,
    sde_log_prob,
    sde_log_std,
    sde_noise,
    sde_sample,
)

ATOL = 1e-5
CPU = torch.device("cpu")
GSDE = dict(exploration="gsde", sde_sample_freq=4, init_log_std=-1.0)
TINY = dict(num_envs=2, num_steps=64, minibatch_size=64, num_epochs=2, checkpoint_every=1, device="cpu", **GSDE)


def _inputs(seed=0, batch=(5, 7), latent_dim=6, act_dim=3, full_std=True):
    g = torch.Generator().manual_seed(seed)
    latent = torch.tanh(torch.randn(*batch, latent_dim, generator=g))
    loc = 0.5 * torch.randn(*batch, act_dim, generator=g)
    log_std = torch.empty(latent_dim, act_dim if full_std else 1).uniform_(-1.5, 0.5, generator=g)
    return latent, loc, log_std


def _std64(latent, log_std, act_dim):
    """sqrt((z^2) @ sigma^2 + epsilon) in float64, as SB3's StateDependentNoiseDistribution."""
    sigma = log_std.double().exp().expand(log_std.shape[0], act_dim)
    return torch.sqrt(latent.double().square() @ sigma.square() + EPSILON)


@pytest.mark.parametrize("full_std", [True, False])
def test_log_prob_and_entropy_match_normal_with_the_gsde_std(full_std):
    latent, loc, log_std = _inputs(full_std=full_std)
    theta = exploration_matrix(log_std, torch.randn(5, 7, 6, 3, generator=torch.Generator().manual_seed(1)))
    action, pre_tanh = sde_sample(loc, latent, theta)
    assert pre_tanh is action
    ref = Independent(Normal(loc.double(), _std64(latent, log_std, 3)), 1)
    got = sde_log_prob(action, loc, latent, log_std)
    assert got.shape == (5, 7, 1) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref.log_prob(action.double()).unsqueeze(-1), atol=ATOL, rtol=0)
    entropy = sde_entropy(latent, log_std, 3)
    assert entropy.shape == (5, 7, 1)
    torch.testing.assert_close(entropy.double(), ref.entropy().unsqueeze(-1), atol=ATOL, rtol=0)
    expected_log_std = _std64(latent, log_std, 3).log()[..., : log_std.shape[-1]]
    torch.testing.assert_close(sde_log_std(latent, log_std).double(), expected_log_std, atol=ATOL, rtol=0)


def test_squashed_log_prob_matches_tanh_transformed_normal():
    latent, loc, log_std = _inputs()
    theta = draw_exploration_matrix(log_std, 3, torch.Generator().manual_seed(2), (5, 7))
    action, pre_tanh = sde_sample(loc, latent, theta, squash=True)
    torch.testing.assert_close(action, torch.tanh(pre_tanh))
    ref = TransformedDistribution(Normal(loc.double(), _std64(latent, log_std, 3)), [TanhTransform()])
    expected = ref.log_prob(action.double()).sum(-1, keepdim=True)
    got = sde_log_prob(None, loc, latent, log_std, pre_tanh=pre_tanh, squash=True)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)


def test_noise_given_the_features_has_the_gsde_variance():
    # eps = z @ theta with theta_ij ~ N(0, sigma_ij^2): Var[eps_j] = sum_i z_i^2 sigma_ij^2.
    latent, _, log_std = _inputs(batch=(3,))
    theta = draw_exploration_matrix(log_std, 3, torch.Generator().manual_seed(3), (200_000,))
    noise = sde_noise(latent[0].expand(200_000, -1), theta)  # one state, many matrices
    var = noise.double().var(0)
    expected = _std64(latent[0], log_std, 3).square() - EPSILON
    torch.testing.assert_close(var, expected, rtol=0.02, atol=0)
    assert noise.double().mean(0).abs().max() < 4 * expected.sqrt().max() / math.sqrt(200_000)


def test_gradients_reach_log_std_and_features_only_when_not_detached():
    latent, loc, log_std = _inputs()
    action = loc + 0.3
    log_std = log_std.clone().requires_grad_(True)
    z = latent.clone().requires_grad_(True)
    sde_log_prob(action, loc, z, log_std).sum().backward()
    assert log_std.grad is not None and log_std.grad.abs().sum() > 0 and torch.isfinite(log_std.grad).all()
    assert z.grad is not None and z.grad.abs().sum() > 0
    # float64 reference gradient
    ls64 = log_std.detach().double().requires_grad_(True)
    sigma = ls64.exp()
    std = torch.sqrt(latent.double().square() @ sigma.square() + EPSILON)
    Normal(loc.double(), std).log_prob(action.double()).sum().backward()
    torch.testing.assert_close(log_std.grad.double(), ls64.grad, atol=1e-4, rtol=1e-5)
    # detached features: no gradient reaches them
    z2 = latent.clone().requires_grad_(True)
    log_std.grad = None
    sde_log_prob(action, loc, z2.detach(), log_std).sum().backward()
    assert z2.grad is None and log_std.grad.abs().sum() > 0


def test_resample_due_and_bad_inputs():
    assert [resample_due(t, 4) for t in range(9)] == [True, False, False, False, True, False, False, False, True]
    assert [resample_due(t, -1) for t in range(3)] == [True, False, False]
    with pytest.raises(ConfigError, match="step"):
        resample_due(-1, 4)
    latent, loc, log_std = _inputs()
    with pytest.raises(ShapeError, match="log_std"):
        sde_log_prob(loc, loc, latent, log_std[:4])
    with pytest.raises(ShapeError, match="exploration_matrix"):
        sde_noise(latent, torch.zeros(5, 3))
    with pytest.raises(ConfigError, match="epsilon"):
        sde_log_std(latent, log_std, epsilon=0.0)
    with pytest.raises(ConfigError, match="exploration"):
        preset("Pendulum-v1", exploration="sde")


def _policy_and_state(num_seeds=1, num_envs=3, **overrides):
    from rlfunc.run.ppo import _generators, env_spec

    config = preset("Pendulum-v1", num_envs=num_envs, num_steps=32, minibatch_size=32, num_seeds=num_seeds,
                    device="cpu", normalize_observations=True, **{**GSDE, **overrides})
    venv = collect.make_vec_env("Pendulum-v1", num_seeds * num_envs)
    algo = make_ppo(config, env_spec(venv), CPU)
    state = algo.init()
    return config, venv, algo, state, _generators(state, CPU)


def test_rollout_noise_is_held_for_sde_sample_freq_steps_and_per_env():
    _, venv, algo, state, gens = _policy_and_state(num_envs=3)
    act = algo.policy(state, gens)
    obs = torch.tensor([[0.3, -0.2, 0.5]]).expand(3, 3)  # the same state in every env
    loc = algo.policy(state, [], deterministic=True)(obs)[0]
    noise = torch.stack([act(obs)[0] - loc for _ in range(9)])  # [step, env, 1]
    for t in (1, 2, 3):
        assert torch.equal(noise[t], noise[0])
        assert torch.equal(noise[4 + t], noise[4])
    assert not torch.allclose(noise[4], noise[0]) and not torch.allclose(noise[8], noise[4])
    assert noise[0, 0] != noise[0, 1] and noise[0, 1] != noise[0, 2]  # one matrix per env
    # a new policy (the next rollout) draws afresh from the advanced generators
    assert not torch.allclose(algo.policy(state, gens)(obs)[0] - loc, noise[8])
    venv.close()


def test_policy_used_by_the_rollout_can_then_be_differentiated():
    # collect.rollout runs the policy under inference_mode; the exploration matrix it draws is held
    # in the policy and must stay a normal tensor, or a later autograd use of the same policy fails
    _, venv, algo, state, gens = _policy_and_state(num_envs=2, sde_sample_freq=-1)
    act = algo.policy(state, gens)
    _, carry = collect.rollout(venv, act, collect.reset(venv, [0, 1]), 3, device=CPU)
    obs = carry["observation"].clone().requires_grad_(True)
    action, _ = act(obs)
    action.sum().backward()
    assert obs.grad is not None and torch.isfinite(obs.grad).all()
    venv.close()


@pytest.mark.parametrize("full_std", [True, False])
def test_rollout_log_prob_matches_the_loss_log_prob(full_std):
    # The policy's fast per-step log-probability equals sde_log_prob on the loss path (first ratio 1).
    from rlfunc.core.normalize import normalize, update_running_stats

    config, venv, algo, state, gens = _policy_and_state(num_seeds=2, num_envs=4, full_std=full_std)
    assert state["params", "log_std"].shape == (2, 64, 1)  # Pendulum: one action, so [L, 1] either way
    state["obs_stats"] = func.vmap(update_running_stats)(state["obs_stats"], torch.randn(2, 50, 3) * 3 + 1)
    batch, _ = collect.rollout(venv, algo.policy(state, gens), collect.reset(venv, range(8)), 32, device=CPU)
    batch = batch.reshape(2, 4, 32)
    for s in range(2):
        obs = normalize(state["obs_stats"][s], batch["observation"][s], clip=config.obs_clip)
        loc, log_std, _, latent = func.apply(algo.net, state["params"][s], obs, return_latent=True)
        expected = sde_log_prob(batch["action"][s], loc, latent, log_std)
        torch.testing.assert_close(batch["sample_log_prob"][s], expected, atol=1e-5, rtol=1e-5)
    venv.close()


def _leaves(state):
    return {k: v.detach().clone() for k, v in state.items(include_nested=True, leaves_only=True)}


def test_gsde_seeds_as_a_batch_equal_separate_runs_and_vmap_equals_loop(tmp_path):
    from rlfunc.run import train

    base = dict(TINY, total_steps=2 * 128)
    loop = train(preset("Pendulum-v1", seed=3, num_seeds=2, vmap="loop", **base), tmp_path / "l", progress=False, tensorboard=False, evaluate=False)
    vmapped = train(preset("Pendulum-v1", seed=3, num_seeds=2, vmap="vmap", **base), tmp_path / "v", progress=False, tensorboard=False, evaluate=False)
    assert loop.state["params", "log_std"].shape == (2, 64, 1)
    for i, seed in enumerate((3, 4)):
        alone = train(preset("Pendulum-v1", seed=seed, **base), tmp_path / f"a{seed}", progress=False, tensorboard=False, evaluate=False)
        for key, value in _leaves(alone.state["params"]).items():
            torch.testing.assert_close(loop.state["params"].get(key)[i], value[0], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(vmapped.state["params"].get(key)[i], value[0], atol=1e-5, rtol=1e-4)
    # the noise scale was trained
    assert not torch.equal(loop.state["params", "log_std"], torch.full_like(loop.state["params", "log_std"], -1.0))


def test_gsde_resume_is_exact(tmp_path):
    from rlfunc.run import train

    config = preset("Pendulum-v1", total_steps=4 * 128, **{**TINY, "sde_sample_freq": 5})
    full = train(config, tmp_path / "full", progress=False, tensorboard=False, evaluate=False)
    train(config, tmp_path / "part", max_iterations=2, progress=False, tensorboard=False, evaluate=False)
    resumed = train(config, tmp_path / "part", resume=True, progress=False, tensorboard=False, evaluate=False)
    a, b = _leaves(full.state), _leaves(resumed.state)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key



def test_actor_critic_apply_equals_functional_call():
    from rlfunc.nets.actor_critic import GaussianActorCritic, actor_critic_apply

    for exploration in ("gaussian", "gsde"):
        net = GaussianActorCritic(3, 2, (16, 8), "tanh", -0.5, exploration, full_std=False)
        params = func.params_from_module(net)
        obs = torch.randn(10, 3)
        fast = actor_critic_apply(net, params, obs)
        slow = func.apply(net, params, obs, return_latent=True)
        assert fast[1].shape == ((2,) if exploration == "gaussian" else (8, 1))
        for a, b in zip(fast, slow):
            assert torch.equal(a, b)
        torch.testing.assert_close(slow[0], func.apply(net, params, obs)[0])


def test_short_pendulum_run_with_gsde_improves(tmp_path):
    from rlfunc.run import train
    from rlfunc.run.ppo import evaluate

    # the preset, but at a constant lr of 3e-3: the preset's decay to 0 over a 4-iteration budget
    # would leave too few steps at a useful lr to show learning (the full budget's test: test_train.py)
    config = preset("Pendulum-v1", total_steps=16_384, checkpoint_every=0, device="cpu", anneal_lr=False, lr=3e-3)
    assert config.exploration == "gsde"  # the preset
    train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    first = records[0]["episode_return"]  # -1289 here
    trained = evaluate(tmp_path / "r", episodes=10, device="cpu")
    assert trained["mean"] > first + 500, (first, trained)


def test_sde_log_prob_and_entropy_name_a_mismatched_action_dim_and_promote_dtypes():
    """Regression (functional-core pass): a log_std with neither 1 nor A columns was torch's "expanded size"
    error, and a float64 latent with a float32 log_std a matmul dtype error (the Gaussian functions
    promote); now a ShapeError naming loc / act_dim, and float64 results equal to the float64 reference."""
    g = torch.Generator().manual_seed(0)
    z, loc, a = torch.randn(4, 3, generator=g), torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    with pytest.raises(ShapeError, match=r"loc \(shape \(4, 5\)\): 5 actions, but log_std has 2 columns"):
        sde_log_prob(a, loc, z, torch.zeros(3, 2))
    with pytest.raises(ShapeError, match="act_dim=5: 5 actions, but log_std has 2 columns"):
        sde_entropy(z, torch.zeros(3, 2), act_dim=5)
    with pytest.raises(ConfigError, match="act_dim"):
        sde_entropy(z, torch.zeros(3, 1), act_dim=0)
    log_std = torch.full((3, 1), -0.5)
    got = sde_log_prob(a.double(), loc.double(), z.double(), log_std)
    want = sde_log_prob(a.double(), loc.double(), z.double(), log_std.double())
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert torch.equal(sde_entropy(z.double(), log_std, 5), sde_entropy(z.double(), log_std.double(), 5))
    import numpy as np

    assert torch.equal(sde_entropy(z, log_std, np.int64(5)), sde_entropy(z, log_std, 5))  # numpy ints as before

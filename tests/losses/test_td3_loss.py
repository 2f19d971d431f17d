"""TD3's target policy smoothing, n-step target and actor loss, against hand-computed values."""

import pytest
import torch

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.losses.td3 import smoothed_target_action, td3_actor_loss, td3_target


def test_smoothed_target_action_clip_bounds():
    mu = torch.tensor([[0.0, 0.9, -0.95], [0.5, -0.2, 0.0]])
    eps = torch.tensor([[10.0, 1.0, -1.0], [-0.5, 0.1, -100.0]])
    a = smoothed_target_action(mu, eps, policy_noise=0.2, noise_clip=0.5)
    # noise 0.2 * eps clipped to [-0.5, 0.5]: [[0.5, 0.2, -0.2], [-0.1, 0.02, -0.5]]; then the box [-1, 1]
    torch.testing.assert_close(a, torch.tensor([[0.5, 1.0, -1.0], [0.4, -0.18, -0.5]]))
    # the smoothing noise never moves the action more than noise_clip, and the action stays in the box
    g = torch.Generator().manual_seed(0)
    mu = torch.rand(1000, 3, generator=g) * 2 - 1
    eps = torch.randn(1000, 3, generator=g) * 5
    low, high = torch.tensor([-1.0, -0.5, 0.0]), torch.tensor([1.0, 0.5, 2.0])
    a = smoothed_target_action(mu, eps, policy_noise=0.3, noise_clip=0.25, low=low, high=high)
    assert ((a >= low) & (a <= high)).all()
    inside = (mu + 0.3 * eps).clamp(mu - 0.25, mu + 0.25)
    torch.testing.assert_close(a, torch.maximum(torch.minimum(inside, high), low))
    assert (a - mu.clamp(low, high)).abs().max() <= 0.25 + 1e-6
    assert smoothed_target_action(mu, eps, policy_noise=0.0, noise_clip=0.5).equal(mu)
    with pytest.raises(ConfigError, match="noise_clip"):
        smoothed_target_action(mu, eps, policy_noise=0.2, noise_clip=-0.1)
    with pytest.raises(ShapeError, match="noise"):
        smoothed_target_action(mu, eps[:, :2], policy_noise=0.2, noise_clip=0.5)


def test_td3_n_step_target_and_actor_loss():
    next_q = torch.tensor([[[1.0], [2.0]], [[0.5], [3.0]]])
    reward = torch.tensor([[1.0], [0.5]])
    term = torch.tensor([[False], [True]])
    y = td3_target(next_q, reward, term, 0.9, discount=torch.tensor([[0.81], [0.9]]))
    torch.testing.assert_close(y, torch.tensor([[1.0 + 0.81 * 0.5], [0.5]]))
    q1 = torch.tensor([[2.0], [-1.0], [0.5]], requires_grad=True)
    loss, metrics = td3_actor_loss(q1)
    assert float(loss) == pytest.approx(-0.5)
    assert float(metrics["q_policy"]) == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(q1.grad, torch.full((3, 1), -1.0 / 3))
    with pytest.raises(ShapeError, match="q1_pi"):
        td3_actor_loss(torch.zeros(3, 2))


def test_nan_settings_are_refused_and_the_critic_target_gets_no_gradient():
    from rlfunc.losses.td3 import critic_loss, diffusion_ql_actor_loss

    a = torch.zeros(4, 2)
    for kw in (dict(policy_noise=float("nan"), noise_clip=0.5), dict(policy_noise=0.2, noise_clip=float("nan"))):
        with pytest.raises(ConfigError, match="expected values >= 0"):  # every action came out NaN
            smoothed_target_action(a, torch.randn(4, 2), **kw)
    with pytest.raises(ConfigError, match="q_coef=nan"):  # a NaN loss
        diffusion_ql_actor_loss(torch.ones(4, 1), torch.tensor(0.5), q_coef=float("nan"))
    # the target is documented as without gradient: a target with a graph (the bug) got one
    target = torch.ones(4, 1, requires_grad=True)
    q = torch.zeros(2, 4, 1, requires_grad=True)
    loss, _ = critic_loss(q, target * 2.0)
    loss.backward()
    assert target.grad is None and float(q.grad.abs().sum()) > 0

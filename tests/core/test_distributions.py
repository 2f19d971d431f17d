"""rlfunc.core.distributions against torch.distributions in float64, plus edge cases at the tanh boundary."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Independent, Normal, TransformedDistribution
from torch.distributions.transforms import AffineTransform, TanhTransform

from rlfunc.core.distributions import (
    gaussian_entropy,
    gaussian_log_prob,
    gaussian_sample,
    standard_normal,
    tanh_gaussian_log_prob,
    tanh_gaussian_sample,
)
from rlfunc.errors import ConfigError, ShapeError

ATOL = 1e-5


def _inputs(seed: int = 0, batch=(5, 7), d: int = 4):
    g = torch.Generator().manual_seed(seed)
    loc = 0.5 * torch.randn(*batch, d, generator=g)
    log_std = torch.empty(*batch, d).uniform_(-1.0, 0.5, generator=g)
    noise = torch.randn(*batch, d, generator=g).clamp(-2.5, 2.5)
    return loc, log_std, noise


def _normal64(loc, log_std):
    return Independent(Normal(loc.double(), log_std.double().exp()), 1)


def test_gaussian_log_prob_matches_torch():
    loc, log_std, noise = _inputs()
    action = gaussian_sample(loc, log_std, noise)
    got = gaussian_log_prob(action, loc, log_std)
    ref = _normal64(loc, log_std).log_prob(action.double()).unsqueeze(-1)
    assert got.shape == (5, 7, 1) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=0)


def test_gaussian_log_prob_broadcasts_state_independent_std():
    loc, log_std, noise = _inputs()
    shared = log_std[0, 0]  # [D]
    action = gaussian_sample(loc, shared, noise)
    got = gaussian_log_prob(action, loc, shared)
    ref = _normal64(loc, shared.expand_as(loc)).log_prob(action.double()).unsqueeze(-1)
    torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=0)


def test_gaussian_entropy_matches_torch():
    loc, log_std, _ = _inputs()
    got = gaussian_entropy(log_std)
    ref = _normal64(loc, log_std).entropy().unsqueeze(-1)
    assert got.shape == (5, 7, 1)
    torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=0)


def test_gaussian_entropy_broadcasts_batch_shape():
    log_std = torch.tensor([-0.5, 0.0, 0.3])
    got = gaussian_entropy(log_std, batch_shape=(4, 2))
    assert got.shape == (4, 2, 1)
    ref = Normal(torch.zeros(3, dtype=torch.float64), log_std.double().exp()).entropy().sum()
    torch.testing.assert_close(got.double(), ref.expand(4, 2, 1), atol=ATOL, rtol=0)
    # hand value: D * (1 + log 2 pi) / 2 + sum log_std
    assert math.isclose(got[0, 0, 0].item(), 3 * (1 + math.log(2 * math.pi)) / 2 - 0.2, abs_tol=1e-6)


def test_sampling_with_explicit_noise_is_deterministic():
    loc, log_std, _ = _inputs()
    n1 = standard_normal(loc.shape, torch.Generator().manual_seed(3))
    n2 = standard_normal(loc.shape, torch.Generator().manual_seed(3))
    assert n1.dtype == torch.float32 and n1.shape == loc.shape
    assert torch.equal(gaussian_sample(loc, log_std, n1), gaussian_sample(loc, log_std, n2))
    a1, u1 = tanh_gaussian_sample(loc, log_std, n1)
    a2, u2 = tanh_gaussian_sample(loc, log_std, n2)
    assert torch.equal(a1, a2) and torch.equal(u1, u2)
    torch.testing.assert_close(u1, loc + log_std.exp() * n1)
    torch.testing.assert_close(a1, torch.tanh(u1))


def test_sample_is_reparameterised():
    loc, log_std, noise = _inputs()
    loc.requires_grad_(True)
    log_std.requires_grad_(True)
    gaussian_sample(loc, log_std, noise).sum().backward()
    torch.testing.assert_close(loc.grad, torch.ones_like(loc))
    torch.testing.assert_close(log_std.grad, (log_std.exp() * noise).detach())


def _tanh64(loc, log_std, low=None, high=None):
    transforms = [TanhTransform()]
    if low is not None:
        low, high = torch.as_tensor(low, dtype=torch.float64), torch.as_tensor(high, dtype=torch.float64)
        transforms.append(AffineTransform((high + low) / 2, (high - low) / 2))
    return TransformedDistribution(Normal(loc.double(), log_std.double().exp()), transforms)


def test_tanh_log_prob_from_pre_tanh_matches_torch():
    loc, log_std, noise = _inputs(1)
    action, pre_tanh = tanh_gaussian_sample(loc, log_std, noise)
    got = tanh_gaussian_log_prob(action, loc, log_std, pre_tanh)
    # score the float64 transformed distribution at the float64 image of the same u (no atanh loss)
    dist = Normal(loc.double(), log_std.double().exp())
    u = pre_tanh.double()
    ref = (dist.log_prob(u) - TanhTransform().log_abs_det_jacobian(u, torch.tanh(u))).sum(-1, keepdim=True)
    assert got.shape == (5, 7, 1)
    torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=0)
    # pre_tanh alone gives the same
    torch.testing.assert_close(tanh_gaussian_log_prob(None, loc, log_std, pre_tanh), got)


def test_tanh_log_prob_from_action_matches_torch():
    loc, log_std, noise = _inputs(2)
    action, _ = tanh_gaussian_sample(loc, log_std, noise)
    got = tanh_gaussian_log_prob(action, loc, log_std)
    ref = _tanh64(loc, log_std).log_prob(action.double()).sum(-1, keepdim=True)
    torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=0)


def test_tanh_log_prob_with_bounds_matches_torch():
    loc, log_std, noise = _inputs(3)
    low = torch.tensor([-2.0, 0.0, -1.0, 1.0])
    high = torch.tensor([2.0, 0.5, 3.0, 1.5])
    action, pre_tanh = tanh_gaussian_sample(loc, log_std, noise, low=low, high=high)
    assert bool(((action >= low) & (action <= high)).all())
    dist = _tanh64(loc, log_std, low, high)
    # pre_tanh path: score the float64 image of u (the float32 action is rounded, by up to 1e-5 in log-prob)
    ref_u = dist.log_prob(dist.transforms[1](dist.transforms[0](pre_tanh.double()))).sum(-1, keepdim=True)
    ref_a = dist.log_prob(action.double()).sum(-1, keepdim=True)
    got_u = tanh_gaussian_log_prob(action, loc, log_std, pre_tanh, low=low, high=high)
    got_a = tanh_gaussian_log_prob(action, loc, log_std, low=low, high=high)
    torch.testing.assert_close(got_u.double(), ref_u, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_a.double(), ref_a, atol=ATOL, rtol=0)
    # scalar bounds: log|scale| counted once per action dim
    a_s, u_s = tanh_gaussian_sample(loc, log_std, noise, low=-3.0, high=3.0)
    ref_s = _tanh64(loc, log_std, -3.0, 3.0).log_prob(a_s.double()).sum(-1, keepdim=True)
    torch.testing.assert_close(tanh_gaussian_log_prob(None, loc, log_std, u_s, low=-3.0, high=3.0).double(), ref_s,
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("edge", [1.0, 1.0 - 1e-7])
def test_tanh_log_prob_finite_at_the_boundary(edge):
    loc = torch.zeros(2, 3)
    log_std = torch.zeros(2, 3)
    action = torch.tensor([[edge, -edge, 0.0], [edge, edge, -edge]], dtype=torch.float32)
    lp = tanh_gaussian_log_prob(action, loc, log_std)
    assert torch.isfinite(lp).all(), lp
    # gradients are finite too
    loc.requires_grad_(True)
    log_std.requires_grad_(True)
    tanh_gaussian_log_prob(action, loc, log_std).sum().backward()
    assert torch.isfinite(loc.grad).all() and torch.isfinite(log_std.grad).all()
    # with bounds, at the bounds exactly
    low, high = torch.tensor([-2.0, 0.0, 1.0]), torch.tensor([2.0, 1.0, 4.0])
    a_box = torch.stack([low, high])
    assert torch.isfinite(tanh_gaussian_log_prob(a_box, loc.detach(), log_std.detach(), low=low, high=high)).all()


def test_tanh_log_prob_large_pre_tanh_is_exact():
    # |u| = 20: tanh(u) == 1 in float32, the naive log(1 - tanh^2) is -inf; the stable form is exact
    u = torch.tensor([[20.0, -20.0]])
    loc, log_std = torch.tensor([[19.0, -19.0]]), torch.zeros(1, 2)
    got = tanh_gaussian_log_prob(None, loc, log_std, u)
    u64 = u.double()
    ref = (Normal(loc.double(), 1.0).log_prob(u64) - TanhTransform().log_abs_det_jacobian(u64, torch.tanh(u64))).sum()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double().squeeze(), ref, atol=1e-4, rtol=1e-6)


def test_bfloat16_boundary_is_finite():
    action = torch.ones(1, 2, dtype=torch.bfloat16)
    zeros = torch.zeros(1, 2, dtype=torch.bfloat16)
    lp = tanh_gaussian_log_prob(action, zeros, zeros)
    assert torch.isfinite(lp).all()


def test_vmap_matches_loop():
    loc, log_std, noise = _inputs(4, batch=(3, 6))

    def f(l, s, n):
        a, u = tanh_gaussian_sample(l, s, n)
        return tanh_gaussian_log_prob(a, l, s, u) + gaussian_entropy(s)

    got = torch.func.vmap(f)(loc, log_std, noise)
    ref = torch.stack([f(loc[i], log_std[i], noise[i]) for i in range(3)])
    torch.testing.assert_close(got, ref)


def test_bad_shapes_raise_shape_error_naming_argument():
    loc, log_std, noise = _inputs()
    with pytest.raises(ShapeError, match="log_std"):
        gaussian_log_prob(loc, loc, log_std[..., :3])
    with pytest.raises(ShapeError, match="noise"):
        gaussian_sample(loc, log_std, noise[..., :2])
    with pytest.raises(ShapeError, match="do not broadcast"):
        gaussian_log_prob(loc[:2], loc, log_std)
    with pytest.raises(ShapeError, match="action"):
        gaussian_log_prob(torch.zeros(5, 7, 4, dtype=torch.int64), loc, log_std)
    with pytest.raises(ShapeError, match="log_std"):
        gaussian_entropy(torch.tensor(0.0))
    with pytest.raises(ShapeError, match="batch_shape"):
        gaussian_entropy(log_std, batch_shape=(3,))
    with pytest.raises(ShapeError, match="pre_tanh"):
        tanh_gaussian_log_prob(None, loc, log_std, noise[..., :1])
    with pytest.raises(ShapeError, match="low"):
        tanh_gaussian_sample(loc, log_std, noise, low=torch.zeros(3), high=torch.ones(4))


def test_bad_config_raises_config_error():
    loc, log_std, noise = _inputs()
    with pytest.raises(ConfigError, match="pre_tanh"):
        tanh_gaussian_log_prob(None, loc, log_std)
    with pytest.raises(ConfigError, match="high"):
        tanh_gaussian_sample(loc, log_std, noise, low=-1.0)
    with pytest.raises(ConfigError, match="eps"):
        tanh_gaussian_log_prob(loc.tanh(), loc, log_std, eps=0.0)
    with pytest.raises(ShapeError, match="dtype"):
        standard_normal((2, 3), dtype=torch.int32)


def test_tanh_gaussian_log_prob_refuses_number_bounds_out_of_order():
    from rlfunc.core.distributions import tanh_gaussian_log_prob

    loc, log_std, pre = torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3, 2)
    for low, high in ((2.5, -1.5), (1.0, 1.0), (0.0, float("inf"))):  # NaN, +inf and -inf log-densities before
        with pytest.raises(ConfigError, match="expected finite bounds with low < high"):
            tanh_gaussian_log_prob(None, loc, log_std, pre, low=low, high=high)
    assert bool(tanh_gaussian_log_prob(None, loc, log_std, pre, low=-2, high=2).isfinite().all())

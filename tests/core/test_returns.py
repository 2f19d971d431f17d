"""rlfunc.core.returns against plain float64 loops, TorchRL, and hand-computed values."""

import pytest
import torch
from torchrl.objectives.value.functional import generalized_advantage_estimate as torchrl_gae
from torchrl.objectives.value.functional import vec_generalized_advantage_estimate as torchrl_vec_gae

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.core.returns import (
    discounted_returns,
    forward_discounted_sum,
    generalized_advantage_estimate,
    reverse_discounted_cumsum,
)

# --------------------------------------------------------------------------------------------
# References: plain float64 loops over time (time at dim -2), written for clarity.
# --------------------------------------------------------------------------------------------


def gae_loop(gamma, lmbda, state_value, next_state_value, reward, done, terminated):
    v, nv, r = state_value.double(), next_state_value.double(), reward.double()
    not_done, not_term = (~done.bool()).double(), (~terminated.bool()).double()
    advantage = torch.zeros_like(v)
    running = torch.zeros_like(v[..., 0, :])
    for t in reversed(range(v.shape[-2])):
        delta = r[..., t, :] + gamma * not_term[..., t, :] * nv[..., t, :] - v[..., t, :]
        running = delta + gamma * lmbda * not_done[..., t, :] * running
        advantage[..., t, :] = running
    return advantage, advantage + v


def reverse_loop(x, discount):
    x = x.double()
    discount = torch.as_tensor(discount, dtype=torch.float64).expand_as(x)
    y = torch.zeros_like(x)
    carry = torch.zeros_like(x[..., 0, :])
    for t in reversed(range(x.shape[-2])):
        carry = x[..., t, :] + discount[..., t, :] * carry
        y[..., t, :] = carry
    return y


def forward_loop(x, discount, initial=None):
    x = x.double()
    discount = torch.as_tensor(discount, dtype=torch.float64).expand_as(x)
    z = torch.zeros_like(x)
    carry = torch.zeros_like(x[..., 0, :]) if initial is None else initial.double()[..., 0, :]
    for t in range(x.shape[-2]):
        carry = discount[..., t, :] * carry + x[..., t, :]
        z[..., t, :] = carry
    return z


def rollout(batch, T, F=1, p_term=0.002, p_trunc=0.002, seed=0, dtype=torch.float32):
    """Random N(0, 1) values and rewards with random terminations and truncations."""
    g = torch.Generator().manual_seed(seed)
    shape = (*batch, T, F)
    state_value = torch.randn(shape, generator=g).to(dtype)
    next_state_value = torch.randn(shape, generator=g).to(dtype)
    reward = torch.randn(shape, generator=g).to(dtype)
    terminated = torch.rand(shape, generator=g) < p_term
    truncated = torch.rand(shape, generator=g) < p_trunc
    return state_value, next_state_value, reward, terminated | truncated, terminated


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


# --------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma, lmbda", [(0.99, 0.95), (0.999, 0.999)])
def test_gae_matches_float64_loop_long_rollout(gamma, lmbda):
    v, nv, r, done, term = rollout((64,), 2048)
    assert done.any() and (done & ~term).any() and term.any()
    advantage, value_target = generalized_advantage_estimate(gamma, lmbda, v, nv, r, done, term)
    ref_adv, ref_target = gae_loop(gamma, lmbda, v, nv, r, done, term)
    assert advantage.dtype == value_target.dtype == torch.float32
    assert advantage.shape == value_target.shape == v.shape
    assert max_err(advantage, ref_adv) <= 1e-4
    assert max_err(value_target, ref_target) <= 1e-4


def test_gae_without_episode_ends_is_stable_for_long_rollouts():
    # no cut at all: the naive closed form sum_k c^k delta_k / c^t over/underflows here
    v, nv, r, done, term = rollout((4,), 4096, p_term=0.0, p_trunc=0.0)
    advantage, _ = generalized_advantage_estimate(0.99, 0.95, v, nv, r, done, term)
    assert torch.isfinite(advantage).all()
    assert max_err(advantage, gae_loop(0.99, 0.95, v, nv, r, done, term)[0]) <= 1e-4


@pytest.mark.parametrize("T", [1, 2, 3, 33, 100, 1000])
def test_gae_odd_lengths_and_features(T):
    v, nv, r, done, term = rollout((3,), T, F=2, p_term=0.05, p_trunc=0.05, seed=T)
    advantage, value_target = generalized_advantage_estimate(0.9, 0.8, v, nv, r, done, term)
    ref_adv, ref_target = gae_loop(0.9, 0.8, v, nv, r, done, term)
    assert max_err(advantage, ref_adv) <= 1e-5
    assert max_err(value_target, ref_target) <= 1e-5


def test_gae_several_batch_dims_and_other_time_dims():
    v, nv, r, done, term = rollout((2, 3), 50, F=1, p_term=0.05, p_trunc=0.05)
    advantage, value_target = generalized_advantage_estimate(0.97, 0.9, v, nv, r, done, term)
    ref_adv, ref_target = gae_loop(0.97, 0.9, v, nv, r, done, term)
    assert advantage.shape == (2, 3, 50, 1)
    assert max_err(advantage, ref_adv) <= 1e-5

    # the same data with time first ([T, 2, 3, 1], time_dim=0) and time last (time_dim=-1)
    for perm, time_dim in [((2, 0, 1, 3), 0), ((0, 1, 3, 2), -1), ((0, 1, 3, 2), 3)]:
        inputs = [t.permute(perm) for t in (v, nv, r, done, term)]
        adv_p, target_p = generalized_advantage_estimate(0.97, 0.9, *inputs, time_dim=time_dim)
        assert max_err(adv_p, advantage.permute(perm)) <= 1e-6
        assert max_err(target_p, value_target.permute(perm)) <= 1e-6


@pytest.mark.parametrize("F", [1, 3])
def test_gae_matches_torchrl(F):
    v, nv, r, done, term = rollout((8,), 300, F=F, p_term=0.01, p_trunc=0.01, seed=1)
    ours = generalized_advantage_estimate(0.99, 0.95, v, nv, r, done, term)
    for theirs_fn in (torchrl_gae, torchrl_vec_gae):
        theirs = theirs_fn(0.99, 0.95, v, nv, r, done, term)
        assert max_err(ours[0], theirs[0]) <= 1e-5
        assert max_err(ours[1], theirs[1]) <= 1e-5
    # terminated=None means done, as in TorchRL
    ours_default = generalized_advantage_estimate(0.99, 0.95, v, nv, r, done)[0]
    assert max_err(ours_default, torchrl_gae(0.99, 0.95, v, nv, r, done)[0]) <= 1e-5


def test_gae_tensor_gamma_and_lmbda_match_torchrl():
    v, nv, r, done, term = rollout((4,), 64, p_term=0.05, p_trunc=0.05, seed=2)
    gamma = torch.full_like(v, 0.98)
    lmbda = torch.linspace(0.5, 1.0, 64).view(1, 64, 1).expand_as(v)
    ours = generalized_advantage_estimate(gamma, lmbda, v, nv, r, done, term)
    theirs = torchrl_gae(gamma, lmbda, v, nv, r, done, term)
    assert max_err(ours[0], theirs[0]) <= 1e-5
    # 0-dim tensors behave like numbers
    scalar = generalized_advantage_estimate(torch.tensor(0.98), torch.tensor(0.9), v, nv, r, done, term)
    assert max_err(scalar[0], gae_loop(0.98, 0.9, v, nv, r, done, term)[0]) <= 1e-5


def test_gae_truncation_bootstraps_and_termination_does_not_by_hand():
    # one env, three steps, gamma = lmbda = 0.5 (so gamma * lmbda = 0.25)
    #   t=0: r=1, V=0, V'=2, running
    #   t=1: r=1, V=2, V'=4, truncated (done, not terminated): bootstraps from V'=4
    #   t=2: r=2, V=1, V'=3, terminated: no bootstrap
    # delta_2 = 2 + 0.5*0*3 - 1 = 1            A_2 = 1
    # delta_1 = 1 + 0.5*4   - 2 = 1            A_1 = 1 + 0.25*0*A_2 = 1      (trace cut at done_1)
    # delta_0 = 1 + 0.5*2   - 0 = 2            A_0 = 2 + 0.25*1*A_1 = 2.25
    # value_target = A + V = [2.25, 3, 2]
    col = lambda *xs: torch.tensor(xs).view(1, -1, 1)  # noqa: E731
    v, nv, r = col(0.0, 2.0, 1.0), col(2.0, 4.0, 3.0), col(1.0, 1.0, 2.0)
    done, term = col(False, True, True), col(False, False, True)
    advantage, value_target = generalized_advantage_estimate(0.5, 0.5, v, nv, r, done, term)
    torch.testing.assert_close(advantage, col(2.25, 1.0, 1.0))
    torch.testing.assert_close(value_target, col(2.25, 3.0, 2.0))

    # the same step 1 as a termination: delta_1 = 1 + 0 - 2 = -1, A_0 = 2 + 0.25*(-1) = 1.75
    advantage, _ = generalized_advantage_estimate(0.5, 0.5, v, nv, r, done, done)
    torch.testing.assert_close(advantage, col(1.75, -1.0, 1.0))


def test_gae_accepts_float_flags_and_keeps_state_value_dtype():
    v, nv, r, done, term = rollout((2,), 40, p_term=0.05, p_trunc=0.05)
    ref = generalized_advantage_estimate(0.99, 0.95, v, nv, r, done, term)
    floats = generalized_advantage_estimate(0.99, 0.95, v, nv, r, done.float(), term.float())
    assert torch.equal(ref[0], floats[0]) and torch.equal(ref[1], floats[1])
    doubled = generalized_advantage_estimate(0.99, 0.95, v.double(), nv.double(), r.double(), done, term)
    assert doubled[0].dtype == torch.float64
    assert max_err(doubled[0], gae_loop(0.99, 0.95, v, nv, r, done, term)[0]) <= 1e-12


def test_gae_rejects_bad_inputs():
    v, nv, r, done, term = rollout((2,), 10)
    with pytest.raises(ConfigError, match="gamma"):
        generalized_advantage_estimate(1.5, 0.95, v, nv, r, done, term)
    with pytest.raises(ConfigError, match="lmbda"):
        generalized_advantage_estimate(0.99, -0.1, v, nv, r, done, term)
    with pytest.raises(ConfigError, match="gamma"):
        generalized_advantage_estimate(torch.full_like(v, 1.01), 0.95, v, nv, r, done, term)
    with pytest.raises(ShapeError, match=r"reward.*\(2, 9, 1\).*state_value.*\(2, 10, 1\)"):
        generalized_advantage_estimate(0.99, 0.95, v, nv, r[:, :9], done, term)
    with pytest.raises(ShapeError, match="terminated"):
        generalized_advantage_estimate(0.99, 0.95, v, nv, r, done, term[:1])
    with pytest.raises(ShapeError, match="time_dim"):
        generalized_advantage_estimate(0.99, 0.95, v, nv, r, done, term, time_dim=3)
    with pytest.raises(ShapeError, match="floating"):
        generalized_advantage_estimate(0.99, 0.95, v.long(), nv, r, done, term)
    # the bugs: an integer reward was "expected a floating-point tensor" naming no argument; a numpy
    # reward was "reward is on cpu but state_value is on cpu"; a list an AttributeError
    with pytest.raises(ShapeError, match="^reward: expected a floating-point tensor, got dtype torch.int64$"):
        generalized_advantage_estimate(0.99, 0.95, v, nv, r.long(), done, term)
    with pytest.raises(ShapeError, match="^reward: expected a torch.Tensor, got ndarray$"):
        generalized_advantage_estimate(0.99, 0.95, v, nv, r.numpy(), done, term)
    with pytest.raises(ShapeError, match="^state_value: expected a torch.Tensor, got list$"):
        generalized_advantage_estimate(0.99, 0.95, v.tolist(), nv, r, done, term)
    # both are ValueErrors too, for callers that catch those
    with pytest.raises(ValueError):
        generalized_advantage_estimate(0.99, 2.0, v, nv, r, done, term)
    # found by a new user: a float time_dim passed the range check and was a TypeError deep inside
    with pytest.raises(ConfigError, match=r"^time_dim=1.0: expected an int, a dim of state_value with shape \(2, 10, 1\)$"):
        generalized_advantage_estimate(0.99, 0.95, v, nv, r, done, term, time_dim=1.0)
    with pytest.raises(ConfigError, match=r"^time_dim=True: expected an int"):
        generalized_advantage_estimate(0.99, 0.95, v, nv, r, done, term, time_dim=True)
    with pytest.raises(ConfigError, match=r"^time_dim=-2.0: expected an int, a dim of x"):
        reverse_discounted_cumsum(r, 0.9, time_dim=-2.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gae_half_precision_is_finite_and_close(dtype):
    v, nv, r, done, term = rollout((8,), 2048, dtype=dtype, p_term=0.0005, p_trunc=0.0005)
    advantage, value_target = generalized_advantage_estimate(0.999, 0.999, v, nv, r, done, term)
    assert advantage.dtype == dtype
    assert torch.isfinite(advantage).all() and torch.isfinite(value_target).all()
    ref = gae_loop(0.999, 0.999, v, nv, r, done, term)[0]
    # only the final rounding to half precision remains: relative error of a few ulps
    assert max_err(advantage, ref) <= 2 * torch.finfo(dtype).eps * ref.abs().max().item()


# --------------------------------------------------------------------------------------------
# Scans
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [None, 2, 5, 32, 64])
@pytest.mark.parametrize("T", [1, 7, 32, 33, 257])
def test_reverse_discounted_cumsum_matches_loop(T, block):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(3, T, 2, generator=g)
    discount = torch.rand(3, T, 2, generator=g) * (torch.rand(3, T, 2, generator=g) > 0.1)
    y = reverse_discounted_cumsum(x, discount, block=block)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert max_err(y, reverse_loop(x, discount)) <= 1e-5
    # a number, and a tensor broadcast along the batch and feature dims
    assert max_err(reverse_discounted_cumsum(x, 0.9, block=block), reverse_loop(x, 0.9)) <= 1e-5
    d = discount[:1, :, :1]
    assert max_err(reverse_discounted_cumsum(x, d, block=block), reverse_loop(x, d)) <= 1e-5


@pytest.mark.parametrize("block", [None, 16])
def test_reverse_discounted_cumsum_other_time_dim(block):
    x = torch.randn(40, 3)
    discount = torch.rand(40, 3)
    y = reverse_discounted_cumsum(x, discount, time_dim=0, block=block)
    assert max_err(y, reverse_loop(x.T.unsqueeze(-1), discount.T.unsqueeze(-1)).squeeze(-1).T) <= 1e-5
    y1 = reverse_discounted_cumsum(x.T, discount.T, time_dim=-1, block=block)
    assert max_err(y1, y.T) <= 1e-6


@pytest.mark.parametrize("block", [None, 8])
def test_zero_discount_cuts_exactly(block):
    # what lies after a zero discount can not reach back past it, not even by rounding
    x = torch.randn(2, 100, 1)
    discount = torch.full((2, 100, 1), 0.999)
    discount[:, 40] = 0.0
    other = x.clone()
    other[:, 41:] = torch.randn(2, 59, 1) * 1e6
    y, y_other = (reverse_discounted_cumsum(t, discount, block=block) for t in (x, other))
    assert torch.equal(y[:, :41], y_other[:, :41])
    assert torch.equal(y[:, 40], x[:, 40])
    # the forward sum restarts at a zero discount
    z, z_other = (forward_discounted_sum(t.flip(1), discount.flip(1)) for t in (x, other))
    assert torch.equal(z[:, 59:], z_other[:, 59:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scans_half_precision_long_sequence(dtype):
    x = torch.randn(4, 2048, 1).to(dtype)
    discount = torch.full_like(x, 0.99)  # rounded to dtype; the reference uses the rounded value
    y = reverse_discounted_cumsum(x, 0.999)
    z = forward_discounted_sum(x, discount)
    assert y.dtype == z.dtype == dtype
    assert torch.isfinite(y).all() and torch.isfinite(z).all()
    ref_y, ref_z = reverse_loop(x, 0.999), forward_loop(x, discount.double())
    assert max_err(y, ref_y) <= 2 * torch.finfo(dtype).eps * ref_y.abs().max().item()
    assert max_err(z, ref_z) <= 2 * torch.finfo(dtype).eps * ref_z.abs().max().item()


@pytest.mark.parametrize("T", [1, 2, 19, 64])
def test_forward_discounted_sum_matches_loop(T):
    x = torch.randn(3, T, 2)
    discount = torch.rand(3, T, 2)
    initial = torch.randn(3, 1, 2)
    assert max_err(forward_discounted_sum(x, discount), forward_loop(x, discount)) <= 1e-5
    z = forward_discounted_sum(x, discount, initial=initial)
    assert max_err(z, forward_loop(x, discount, initial)) <= 1e-5
    assert max_err(forward_discounted_sum(x, 0.7, initial=initial), forward_loop(x, 0.7, initial)) <= 1e-5


def test_forward_discounted_sum_carries_across_rollouts():
    # running discounted return for reward normalisation: two rollouts == one long one
    reward = torch.randn(5, 300, 1)
    discount = 0.99 * (torch.rand(5, 300, 1) > 0.01)
    whole = forward_discounted_sum(reward, discount)
    first = forward_discounted_sum(reward[:, :120], discount[:, :120])
    second = forward_discounted_sum(reward[:, 120:], discount[:, 120:], initial=first[:, -1:])
    assert max_err(torch.cat([first, second], 1), whole) <= 1e-5


def test_forward_discounted_sum_rejects_bad_initial():
    with pytest.raises(ShapeError, match="initial"):
        forward_discounted_sum(torch.randn(3, 10, 1), 0.9, initial=torch.zeros(3, 1))


def test_discounted_returns_matches_loop():
    reward = torch.randn(4, 500, 1)
    done = torch.rand(4, 500, 1) < 0.02
    returns = discounted_returns(reward, done, 0.99)
    assert max_err(returns, reverse_loop(reward, 0.99 * (~done).double())) <= 1e-5
    assert torch.equal(returns, discounted_returns(reward, done.float(), 0.99))
    with pytest.raises(ConfigError, match="gamma"):
        discounted_returns(reward, done, 1.5)
    with pytest.raises(ShapeError, match="done"):
        discounted_returns(reward, done[:, :10], 0.99)


def test_scans_reject_bad_arguments():
    x = torch.randn(2, 10, 1)
    with pytest.raises(ShapeError, match="discount"):
        reverse_discounted_cumsum(x, torch.rand(2, 9, 1))
    with pytest.raises(ConfigError, match="block"):
        reverse_discounted_cumsum(x, 0.9, block=1)
    with pytest.raises(ShapeError, match="time_dim"):
        reverse_discounted_cumsum(x, 0.9, time_dim=-4)


def test_scans_are_differentiable_when_autograd_records():
    x = torch.randn(2, 37, 1, dtype=torch.float64, requires_grad=True)
    discount = torch.rand(2, 37, 1, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 37, 1, dtype=torch.float64)
    for fn, ref in (
        (lambda: reverse_discounted_cumsum(x, discount), reverse_loop),
        (lambda: reverse_discounted_cumsum(x, discount, block=8), reverse_loop),
        (lambda: forward_discounted_sum(x, discount), forward_loop),
    ):
        grads = torch.autograd.grad((fn() * weights).sum(), (x, discount))
        ref_grads = torch.autograd.grad((ref(x, discount) * weights).sum(), (x, discount))
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want)
    # the input is never written
    x0 = x.detach().clone()
    with torch.no_grad():
        reverse_discounted_cumsum(x, discount)
    assert torch.equal(x, x0)


def test_blocked_forward_scan_matches_loop():
    # forward_discounted_sum has no ``block`` argument; the blocked forward path is checked directly
    from rlfunc.core.returns import _blocked_scan

    x, discount = torch.randn(3, 77, 2), torch.rand(3, 77, 2)
    for block in (2, 8, 32):
        assert max_err(_blocked_scan(x, discount, 1, False, block), forward_loop(x, discount)) <= 1e-5


def test_gae_accepts_values_that_require_grad():
    v, nv, r, done, term = rollout((2,), 30, p_term=0.1, p_trunc=0.1)
    v_grad = v.clone().requires_grad_(True)
    advantage, value_target = generalized_advantage_estimate(0.99, 0.95, v_grad, nv, r, done, term)
    with torch.no_grad():
        ref = generalized_advantage_estimate(0.99, 0.95, v, nv, r, done, term)
    assert max_err(advantage, ref[0]) <= 1e-6 and max_err(value_target, ref[1]) <= 1e-6
    # the gradient of sum(A) by V(s_t) from the float64 loop
    advantage.sum().backward()
    v64 = v.double().requires_grad_(True)
    gae_loop(0.99, 0.95, v64, nv, r, done, term)[0].sum().backward()
    torch.testing.assert_close(v_grad.grad.double(), v64.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma", [0.999, 0.9999])
def test_blocked_scan_with_a_number_is_as_accurate_as_the_unblocked_one(gamma):
    """New-user pass: block=64 with a number discount erred 2.2e-5 relative at gamma 0.999 over 20,000
    steps (the float32 products of gamma lost 2^k roundings), worse than a float32 loop; the
    docstring says both paths are exact."""
    x = torch.rand(1, 20_000, 1, generator=torch.Generator().manual_seed(0))
    ref = reverse_loop(x, gamma)
    for block in (None, 7, 64):
        y = reverse_discounted_cumsum(x, gamma, block=block)
        assert ((y.double() - ref).abs() / ref.abs()).max().item() < 1e-6, block
    z = torch.randn(3, 1000, 2, generator=torch.Generator().manual_seed(1))  # both directions, a batch
    assert max_err(reverse_discounted_cumsum(z, 0.97, block=16), reverse_loop(z, 0.97)) <= 2e-5


def test_discounted_sums_name_an_argument_that_is_not_a_tensor():
    """New-user pass: a numpy x was an AttributeError; initial=0.0 an AttributeError; a numpy initial
    "initial is on cpu but x is on cpu"; an int x with T = 0 came back as is."""
    import numpy as np

    with pytest.raises(ShapeError, match="^x: expected a torch.Tensor, got ndarray$"):
        reverse_discounted_cumsum(np.zeros((5, 1), np.float32), 0.9)
    with pytest.raises(ShapeError, match="^x: expected a torch.Tensor, got list$"):
        forward_discounted_sum([[1.0]], 0.9)
    for initial, kind in ((0.0, "float"), (np.zeros((1, 1), np.float32), "ndarray")):
        with pytest.raises(ShapeError, match=f"^initial: expected None or a torch.Tensor, got {kind}$"):
            forward_discounted_sum(torch.randn(5, 1), 0.9, initial=initial)
    with pytest.raises(ShapeError, match="x: expected a floating-point tensor, got dtype torch.int64"):
        forward_discounted_sum(torch.zeros(0, 1).long(), 0.9, initial=torch.zeros(1, 1))


def test_gae_under_torch_func_vmap_equals_the_loop():
    """TorchRL pass: vmap over GAE failed deep ("Batching rule not implemented for aten::addcmul.out"):
    the scan's out= buffers; under vmap it takes the out-of-place steps."""
    from rlfunc.core.func import vmap

    g = torch.Generator().manual_seed(0)
    value, next_value, reward = [torch.randn(3, 32, 1, generator=g) for _ in range(3)]
    done = torch.rand(3, 32, 1, generator=g) < 0.1
    fn = lambda v, nv, r, d: generalized_advantage_estimate(0.99, 0.95, v, nv, r, d)  # noqa: E731
    loop = vmap(fn, use_loop=True)(value, next_value, reward, done)
    for mapped in (vmap(fn, use_loop=False), torch.func.vmap(fn)):
        for got, want in zip(mapped(value, next_value, reward, done), loop):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    batched = fn(value, next_value, reward, done)  # the stack as batch dims: the same numbers
    torch.testing.assert_close(batched[0], loop[0], rtol=0, atol=2e-6)


def test_returns_under_vmap_over_hyperparameters_an_ensemble_and_an_initial_carry_match_a_loop():
    """Regression (functional-core pass): vmap over a batched gamma raised vmap's data-dependent error in
    the [0, 1] check (a host read); a batched state_value against one shared next_state_value, and a
    batched initial carry, raised vmap's in-place errors. Each now equals the loop over members (float64)."""
    from torch.func import vmap

    import rlfunc

    g = torch.Generator().manual_seed(3)
    T = 6
    v, nv, r = (torch.randn(T, 1, generator=g, dtype=torch.float64) for _ in range(3))
    d = torch.zeros(T, 1, dtype=torch.bool)
    d[2] = True
    gammas = torch.tensor([0.0, 0.9, 0.99, 1.0], dtype=torch.float64)
    got = vmap(lambda gm: rlfunc.generalized_advantage_estimate(gm, 0.95, v, nv, r, d)[0])(gammas)
    loop = torch.stack([rlfunc.generalized_advantage_estimate(gm, 0.95, v, nv, r, d)[0] for gm in gammas])
    torch.testing.assert_close(got, loop, rtol=0, atol=1e-12)
    got = rlfunc.vmap(lambda gm: rlfunc.discounted_returns(r, d, gm), use_loop=False)(gammas)
    loop = torch.stack([rlfunc.discounted_returns(r, d, gm) for gm in gammas])
    torch.testing.assert_close(got, loop, rtol=0, atol=1e-12)
    members = torch.randn(4, T, 1, generator=g, dtype=torch.float64)  # a critic ensemble's values, one shared target
    got = vmap(lambda sv: rlfunc.generalized_advantage_estimate(0.99, 0.95, sv, nv, r, d))(members)
    for i, sv in enumerate(members):
        adv, target = rlfunc.generalized_advantage_estimate(0.99, 0.95, sv, nv, r, d)
        torch.testing.assert_close(got[0][i], adv, rtol=0, atol=1e-12)
        torch.testing.assert_close(got[1][i], target, rtol=0, atol=1e-12)
    initial = torch.randn(4, 1, 1, generator=g, dtype=torch.float64)
    got = vmap(lambda i: rlfunc.forward_discounted_sum(r, 0.9, initial=i))(initial)
    by_hand = torch.stack([torch.stack([sum(0.9 ** (t - k) * r[k] for k in range(t + 1)) + 0.9 ** (t + 1) * i[0] for t in range(T)])
                           for i in initial])
    torch.testing.assert_close(got, by_hand, rtol=0, atol=1e-12)
    with pytest.raises(ConfigError, match="gamma must lie in"):  # eager calls still check
        rlfunc.generalized_advantage_estimate(torch.tensor(1.5), 0.95, v, nv, r, d)
    # and so do grad alone and an unbatched gamma under vmap, where the host read works (review pass: every
    # transform skipped the check at first)
    with pytest.raises(ConfigError, match="gamma must lie in"):
        torch.func.grad(lambda sv: rlfunc.generalized_advantage_estimate(torch.tensor(1.5), 0.95, sv, nv, r, d)[0].sum())(v)
    with pytest.raises(ConfigError, match="gamma must lie in"):
        vmap(lambda sv: rlfunc.generalized_advantage_estimate(torch.tensor(1.5), 0.95, sv, nv, r, d)[0])(members)

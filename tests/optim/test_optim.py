"""rlfunc.optim: Adam over stacked params, per-member clipping, masked steps, lr schedule, state round-trip."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlfunc.core.func import as_leaves, leaves
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.optim import (
    clip_grads_,
    linear_lr,
    load_optimizer_state,
    make_adam,
    masked_step,
    member_grad_norms,
    optimizer_state,
    set_lr,
)


def stacked_params(members: int = 2, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    td = TensorDict(
        {"layer": {"weight": torch.randn(members, 3, 2, generator=g), "bias": torch.randn(members, 3, generator=g)}},
        batch_size=[members],
    )
    return as_leaves(td)


def set_grads(params: TensorDict, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    grads = []
    for p in leaves(params):
        p.grad = torch.randn(p.shape, generator=g)
        grads.append(p.grad.clone())
    return grads


# --------------------------------------------------------------------------------------------
# make_adam
# --------------------------------------------------------------------------------------------


def test_make_adam_over_stacked_leaves_first_step_is_lr_times_sign():
    params = stacked_params()
    opt = make_adam(params, lr=0.01)
    assert len(opt.param_groups) == 1
    group = opt.param_groups[0]
    assert group["lr"] == 0.01 and group["eps"] == 1e-5 and group["betas"] == (0.9, 0.999)
    assert [id(p) for p in group["params"]] == [id(p) for p in leaves(params)]
    before = [p.detach().clone() for p in leaves(params)]
    grads = set_grads(params, seed=1)
    opt.step()
    # First Adam step: m_hat = g, v_hat = g^2, update = -lr * g / (|g| + eps) ~= -lr * sign(g).
    for b, g, p in zip(before, grads, leaves(params)):
        torch.testing.assert_close(p.detach(), b - 0.01 * g / (g.abs() + 1e-5), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("lr", [0.0, -1e-3, float("nan")])
def test_make_adam_bad_lr_raises(lr):
    with pytest.raises(ConfigError, match="lr="):
        make_adam(stacked_params(), lr=lr)


def test_set_lr():
    opt = make_adam(stacked_params(), lr=1e-3)
    set_lr(opt, 5e-4)
    assert all(g["lr"] == 5e-4 for g in opt.param_groups)


# --------------------------------------------------------------------------------------------
# clip_grads_
# --------------------------------------------------------------------------------------------


def test_clip_grads_per_member_by_hand():
    # Member 0: weight grad [3, 4] and bias grad [0]  -> norm sqrt(9 + 16) = 5.
    # Member 1: weight grad [0.3, 0.4] and bias [1.2] -> norm sqrt(0.09 + 0.16 + 1.44) = 1.3.
    w = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    b = torch.tensor([[0.0], [1.2]])
    grads = [w.clone(), b.clone()]
    norms = clip_grads_(grads, max_norm=2.0, stacked=True)
    torch.testing.assert_close(norms, torch.tensor([5.0, 1.3]))
    # Member 0 (5 > 2) scaled by 2/5 to norm 2; member 1 (1.3 < 2) unchanged bit for bit.
    torch.testing.assert_close(grads[0][0], torch.tensor([1.2, 1.6]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1][0], torch.tensor([0.0]))
    assert torch.equal(grads[0][1], w[1]) and torch.equal(grads[1][1], b[1])
    new_norms = member_grad_norms(grads, stacked=True)
    torch.testing.assert_close(new_norms, torch.tensor([2.0, 1.3]), rtol=1e-5, atol=1e-6)


def test_clip_grads_unstacked_is_global_norm():
    # One member over two tensors: norm sqrt(1 + 4 + 4 + 16) = 5; max_norm 1 scales by 1/5.
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([[2.0], [4.0]])]
    norms = clip_grads_(grads, max_norm=1.0, stacked=False)
    assert norms.shape == (1,)
    torch.testing.assert_close(norms, torch.tensor([5.0]))
    torch.testing.assert_close(grads[0], torch.tensor([0.2, 0.4]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], torch.tensor([[0.4], [0.8]]), rtol=1e-5, atol=1e-6)


def test_clip_grads_members_are_independent_random():
    params = stacked_params(members=4)
    set_grads(params, seed=3)
    grads = [p.grad for p in leaves(params)]
    with torch.no_grad():
        grads[0][2].mul_(100.0)  # member 2 huge
    expected = torch.stack([torch.cat([g[m].flatten() for g in grads]).double().norm() for m in range(4)])
    originals = [g.clone() for g in grads]
    srt = expected.sort().values
    max_norm = float((srt[1] + srt[2]) / 2)  # two members below, two above
    norms = clip_grads_(grads, max_norm=max_norm, stacked=True)
    torch.testing.assert_close(norms.double(), expected, rtol=1e-6, atol=0)
    after = member_grad_norms(grads, stacked=True).double()
    for m in range(4):
        if expected[m] <= max_norm:
            for g, o in zip(grads, originals):
                assert torch.equal(g[m], o[m])
        else:
            torch.testing.assert_close(after[m], torch.tensor(max_norm, dtype=torch.float64), rtol=1e-5, atol=0)


# --------------------------------------------------------------------------------------------
# masked_step
# --------------------------------------------------------------------------------------------


def member0_copy(params: TensorDict) -> list[torch.Tensor]:
    return [p.detach()[0].clone().requires_grad_(True) for p in leaves(params)]


@pytest.mark.parametrize("skip_at", [0, 1])
def test_masked_step_skips_member_and_matches_independent_adam(skip_at):
    params = stacked_params(members=2)
    opt = make_adam(params, lr=0.05)
    solo = member0_copy(params)
    solo_opt = torch.optim.Adam(solo, lr=0.05, eps=1e-5, betas=(0.9, 0.999), foreach=True)

    for step in range(3):
        grads = set_grads(params, seed=10 + step)
        for s, g in zip(solo, grads):
            s.grad = g[0].clone()
        if step == skip_at:
            ok = torch.tensor([True, False])
            p1_before = [p.detach()[1].clone() for p in leaves(params)]
            st_before = {
                k: [opt.state[p][k][1].clone() if p in opt.state else torch.zeros_like(p[1]) for p in leaves(params)]
                for k in ("exp_avg", "exp_avg_sq")
            }
            masked_step(opt, leaves(params), ok)
            for p, b in zip(leaves(params), p1_before):
                assert torch.equal(p.detach()[1], b)
            for k in ("exp_avg", "exp_avg_sq"):
                for p, b in zip(leaves(params), st_before[k]):
                    assert torch.equal(opt.state[p][k][1], b), f"{k} of the skipped member changed"
        else:
            masked_step(opt, leaves(params), torch.tensor([True, True]))
        solo_opt.step()
        # Member 0 follows an Adam that only ever saw member 0.
        for p, s in zip(leaves(params), solo):
            torch.testing.assert_close(p.detach()[0], s.detach(), rtol=0, atol=1e-7)
            torch.testing.assert_close(opt.state[p]["exp_avg"][0], solo_opt.state[s]["exp_avg"], rtol=0, atol=1e-7)
            torch.testing.assert_close(opt.state[p]["exp_avg_sq"][0], solo_opt.state[s]["exp_avg_sq"], rtol=0, atol=1e-7)


def test_masked_step_nan_gradients_of_skipped_member_never_reach_params():
    params = stacked_params(members=3)
    opt = make_adam(params, lr=0.1)
    set_grads(params, seed=0)
    opt.step()  # build state
    before = [p.detach().clone() for p in leaves(params)]
    state_before = [{k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")} for p in leaves(params)]
    set_grads(params, seed=1)
    with torch.no_grad():
        for p in leaves(params):
            p.grad[1] = float("nan")
            p.grad[1].view(-1)[0] = float("inf")
    masked_step(opt, leaves(params), torch.tensor([True, False, True]))
    for p, b, sb in zip(leaves(params), before, state_before):
        assert torch.isfinite(p).all()
        assert torch.equal(p.detach()[1], b[1])
        assert not torch.equal(p.detach()[0], b[0]) and not torch.equal(p.detach()[2], b[2])
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.isfinite(opt.state[p][k]).all()
            assert torch.equal(opt.state[p][k][1], sb[k][1])
    # A later all-ok step stays finite everywhere.
    set_grads(params, seed=2)
    masked_step(opt, leaves(params), torch.tensor([True, True, True]))
    assert all(torch.isfinite(p).all() for p in leaves(params))


def test_masked_step_nan_gradients_on_first_step():
    params = stacked_params(members=2)
    opt = make_adam(params, lr=0.1)
    before = [p.detach().clone() for p in leaves(params)]
    set_grads(params, seed=0)
    with torch.no_grad():
        for p in leaves(params):
            p.grad[1] = float("nan")
    masked_step(opt, leaves(params), torch.tensor([True, False]))
    for p, b in zip(leaves(params), before):
        assert torch.equal(p.detach()[1], b[1])
        assert not torch.equal(p.detach()[0], b[0])
        assert torch.equal(opt.state[p]["exp_avg"][1], torch.zeros_like(b[1]))
        assert torch.equal(opt.state[p]["exp_avg_sq"][1], torch.zeros_like(b[1]))


def test_masked_step_single_member_not_ok_changes_nothing():
    params = stacked_params(members=1)
    opt = make_adam(params, lr=0.1)
    set_grads(params, seed=0)
    opt.step()
    before = [p.detach().clone() for p in leaves(params)]
    state_before = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in leaves(params)]
    set_grads(params, seed=1)
    with torch.no_grad():
        leaves(params)[0].grad.fill_(float("nan"))
    masked_step(opt, leaves(params), torch.tensor([False]))
    for p, b, sb in zip(leaves(params), before, state_before):
        assert torch.equal(p.detach(), b)
        assert set(opt.state[p]) == set(sb)
        for k, v in sb.items():
            assert torch.equal(opt.state[p][k], v), k


def test_masked_step_refuses_an_ok_that_is_not_bool_of_the_members():
    """An int ``ok`` [1, 0, 1] (~ of ints skips every member) or one of another length than the
    members: a ShapeError before anything moves."""
    params = stacked_params(members=3)
    opt = make_adam(params, lr=0.1)
    set_grads(params, seed=0)
    before = [p.detach().clone() for p in leaves(params)]
    with pytest.raises(ShapeError, match=r"^masked_step: ok is a torch.int64 tensor, expected a bool tensor \[M\]"):
        masked_step(opt, leaves(params), torch.tensor([1, 0, 1]))
    with pytest.raises(ShapeError, match=r"^masked_step: ok has shape \[2\], expected \[M\] with M the leading"):
        masked_step(opt, leaves(params), torch.tensor([True, False]))
    assert all(torch.equal(p, b) for p, b in zip(leaves(params), before)) and not opt.state


def test_masked_step_all_ok_is_plain_step():
    a, b = stacked_params(members=2), stacked_params(members=2)
    opt_a, opt_b = make_adam(a, lr=0.02), make_adam(b, lr=0.02)
    for step in range(2):
        set_grads(a, seed=step), set_grads(b, seed=step)
        masked_step(opt_a, leaves(a), torch.tensor([True, True]))
        opt_b.step()
    for pa, pb in zip(leaves(a), leaves(b)):
        assert torch.equal(pa, pb)


# --------------------------------------------------------------------------------------------
# linear_lr
# --------------------------------------------------------------------------------------------


def test_linear_lr_values():
    assert linear_lr(1e-3, 0, 10) == pytest.approx(1e-3)
    assert linear_lr(1e-3, 5, 10) == pytest.approx(5e-4)
    assert linear_lr(1e-3, 9, 10) == pytest.approx(1e-4)
    assert linear_lr(1e-3, 10, 10) == 0.0
    assert linear_lr(1e-3, 12, 10) == 0.0  # never negative
    assert linear_lr(1e-3, 5, 10, anneal=False) == 1e-3
    assert linear_lr(1e-3, 5, 0) == 1e-3
    with pytest.raises(ConfigError, match="iteration=-5: expected >= 0"):  # it extrapolated to 1.5e-3
        linear_lr(1e-3, -5, 10)


# --------------------------------------------------------------------------------------------
# optimizer_state / load_optimizer_state
# --------------------------------------------------------------------------------------------


def test_optimizer_state_round_trip_gives_identical_steps():
    params = stacked_params(members=2)
    opt = make_adam(params, lr=0.03)
    for step in range(3):
        set_grads(params, seed=step)
        opt.step()
    saved_state = optimizer_state(opt)
    saved_params = params.detach().clone()
    assert set(saved_state.keys()) == {"0", "1"}
    assert set(saved_state["0"].keys()) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(saved_state["0", "step"]) == 3.0

    # Continue the original for two steps.
    for step in range(3, 5):
        set_grads(params, seed=step)
        opt.step()

    # A fresh optimizer over a fresh copy of the saved params, loaded from the saved state.
    restored = as_leaves(saved_params.clone())
    opt2 = make_adam(restored, lr=0.03)
    load_optimizer_state(opt2, saved_state)
    for step in range(3, 5):
        set_grads(restored, seed=step)
        opt2.step()
    for p, q in zip(leaves(params), leaves(restored)):
        assert torch.equal(p.detach(), q.detach())
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], opt2.state[q][k])
    # The load copied the state: later steps of opt2 did not write into saved_state.
    assert float(saved_state["0", "step"]) == 3.0


def test_load_optimizer_state_keeps_current_hyperparameters():
    params = stacked_params()
    opt = make_adam(params, lr=0.03)
    set_grads(params, seed=0)
    opt.step()
    state = optimizer_state(opt)
    opt2 = make_adam(stacked_params(), lr=0.001)
    load_optimizer_state(opt2, state)
    assert opt2.param_groups[0]["lr"] == 0.001
    assert math.isclose(float(next(iter(opt2.state.values()))["step"]), 1.0)


def test_minibatch_epochs_covers_each_sample_once_per_epoch_and_stops_at_target_kl():
    from tensordict import TensorDict

    from rlfunc.optim import minibatch_epochs

    batch = TensorDict({"i": torch.arange(12)}, batch_size=[12])
    seen = []

    def update(mb):
        seen.append(mb["i"].clone())
        return TensorDict({"approx_kl": torch.tensor(0.01 * len(seen)), "n": torch.tensor(1.0)}, batch_size=[])

    metrics, updates = minibatch_epochs(batch, 5, 2, update, generator=torch.Generator().manual_seed(0))
    assert updates == 4  # 12 // 5 = 2 minibatches per epoch, the remainder of 2 dropped
    for epoch in (seen[:2], seen[2:]):
        idx = torch.cat(epoch)
        assert len(set(idx.tolist())) == 10
    assert metrics["approx_kl"].item() == pytest.approx((0.01 + 0.02 + 0.03 + 0.04) / 4)
    seen.clear()
    metrics, updates = minibatch_epochs(batch, 5, 2, update, generator=torch.Generator().manual_seed(0), target_kl=0.015)
    assert updates == 2 and metrics["approx_kl"].item() == pytest.approx(0.015)  # stopped after the 2nd (0.02 > 0.015)

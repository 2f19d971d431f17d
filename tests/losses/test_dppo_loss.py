"""DPPO's loss and clip schedule against hand-computed values; TD3 targets and losses."""

import math

import pytest
import torch

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.losses.dppo import clip_schedule, dppo_loss
from rlfunc.losses.td3 import critic_loss, diffusion_ql_actor_loss, td3_target


def test_clip_schedule_by_hand():
    c = clip_schedule(3, 0.001, 0.01, rate=3.0)
    u = [0.0, 0.5, 1.0]
    want = [0.001 + 0.009 * math.expm1(3 * x) / math.expm1(3) for x in u]
    torch.testing.assert_close(c, torch.tensor(want))
    torch.testing.assert_close(clip_schedule(5, 0.1, 0.3, rate=0.0), torch.linspace(0.1, 0.3, 5))
    assert clip_schedule(1, 0.1, 0.2).tolist() == pytest.approx([0.2])
    with pytest.raises(ConfigError):
        clip_schedule(3, 0.2, 0.1)


def test_dppo_loss_by_hand():
    # two samples, two fine-tuned steps of a chain of K = 3, no advantage normalisation
    lp = torch.tensor([[0.1, -0.2], [0.0, 0.05]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([[1.0], [-2.0]])
    v, vt = torch.tensor([[0.5], [0.0]]), torch.tensor([[1.0], [1.0]])
    eps = torch.tensor([0.05, 0.1])
    gd = 0.9
    loss, m = dppo_loss(lp, old, adv, v, vt, clip_epsilon=eps, denoising_discount=gd, total_steps=3,
                        normalize_advantages=False, value_coef=0.5)
    terms = []
    for b in range(2):
        for k in range(2):
            r = math.exp(lp[b, k].item())
            a = adv[b, 0].item() * gd ** (3 - 1 - (k + 1))  # fine-tuned steps are chain steps 1 and 2
            rc = min(max(r, 1 - eps[k].item()), 1 + eps[k].item())
            terms.append(min(r * a, rc * a))
    want_obj = -sum(terms) / 4
    want_critic = 0.5 * 0.5 * ((0.5 - 1.0) ** 2 + 1.0) / 2
    assert float(m["loss_objective"]) == pytest.approx(want_obj, rel=1e-5)
    assert float(m["loss_critic"]) == pytest.approx(want_critic, rel=1e-5)
    assert float(loss) == pytest.approx(want_obj + want_critic, rel=1e-5)
    # clip fraction: |r - 1| > eps_k
    frac = sum(abs(math.exp(lp[b, k].item()) - 1) > eps[k].item() for b in range(2) for k in range(2)) / 4
    assert float(m["clip_fraction"]) == pytest.approx(frac)


def test_dppo_loss_gradient_is_zero_when_clipped():
    lp = torch.tensor([[0.5]], requires_grad=True)  # ratio e^0.5 > 1 + eps with positive advantage
    loss, _ = dppo_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1, 1), torch.zeros(1, 1),
                        clip_epsilon=0.1, normalize_advantages=False)
    loss.backward()
    assert lp.grad.abs().item() == 0.0


def test_dppo_loss_errors():
    z = torch.zeros(4, 1)
    with pytest.raises(ShapeError, match="log_prob"):
        dppo_loss(torch.zeros(4, 3), torch.zeros(4, 2), z, z, z, clip_epsilon=0.1)
    with pytest.raises(ShapeError, match="advantage"):
        dppo_loss(torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(4), z, z, clip_epsilon=0.1)
    with pytest.raises(ConfigError, match="denoising_discount"):
        dppo_loss(torch.zeros(4, 2), torch.zeros(4, 2), z, z, z, clip_epsilon=0.1, denoising_discount=0.0)
    with pytest.raises(ConfigError, match="total_steps"):
        dppo_loss(torch.zeros(4, 2), torch.zeros(4, 2), z, z, z, clip_epsilon=0.1, total_steps=1)


def test_dppo_loss_old_state_value_of_another_shape_is_refused():
    # the bug: a [B] old_state_value against a [B, 1] state_value broadcast to [B, B], silently
    z = torch.zeros(4, 1)
    with pytest.raises(ShapeError, match=r"^dppo_loss: old_state_value has shape \(4,\), expected \(4, 1\)$"):
        dppo_loss(torch.zeros(4, 2), torch.zeros(4, 2), z, z, z, clip_epsilon=0.1,
                  old_state_value=torch.zeros(4), value_clip_epsilon=0.2)


def test_dppo_loss_empty_minibatch_is_refused():
    # the bug: B = 0 returned a NaN loss with torch's "mean of empty tensor" warnings
    z = torch.zeros(0, 1)
    with pytest.raises(ShapeError, match=r"^dppo_loss: log_prob has shape \(0, 2\): expected at least one sample"):
        dppo_loss(torch.zeros(0, 2), torch.zeros(0, 2), z, z, z, clip_epsilon=0.1)


@pytest.mark.parametrize("kwargs, name", [
    ({"value_clip_epsilon": -0.1, "old_state_value": torch.zeros(4, 1)}, "value_clip_epsilon"),
    ({"value_clip_epsilon": float("nan"), "old_state_value": torch.zeros(4, 1)}, "value_clip_epsilon"),
    ({"entropy_coef": float("nan"), "entropy": torch.zeros(4, 1)}, "entropy_coef"),
    ({"entropy_coef": -0.01}, "entropy_coef"),
    ({"value_coef": float("inf")}, "value_coef"),
    ({"value_coef": -0.5}, "value_coef"),
    ({"clip_epsilon": float("nan")}, "clip_epsilon"),
    ({"clip_epsilon": torch.tensor([0.1, float("inf")])}, "clip_epsilon"),
    ({"denoising_discount": float("nan")}, "denoising_discount"),
])
def test_dppo_loss_bad_hyperparameters_raise(kwargs, name):
    z = torch.zeros(4, 1)
    kwargs = {"clip_epsilon": 0.1, **kwargs}
    with pytest.raises(ConfigError, match=name):
        dppo_loss(torch.zeros(4, 2), torch.zeros(4, 2), z, z, z, **kwargs)


def test_dppo_loss_value_clip_epsilon_zero_pins_the_clipped_branch_at_the_old_value():
    # V = [1, 2], V_old = [0, 2.5], V_target = [1.5, 1]: max((V - Vt)^2, (V_old - Vt)^2) = [2.25, 2.25]
    # loss_critic = 0.5 * 0.5 * 2.25 = 0.5625
    _, m = dppo_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1), torch.tensor([[1.0], [2.0]]),
                     torch.tensor([[1.5], [1.0]]), clip_epsilon=0.1, old_state_value=torch.tensor([[0.0], [2.5]]),
                     value_clip_epsilon=0.0)
    assert float(m["loss_critic"]) == pytest.approx(0.5625, abs=1e-7)


def test_td3_target_and_losses():
    next_q = torch.tensor([[[1.0], [2.0]], [[0.5], [3.0]]])  # [E=2, B=2, 1]
    reward = torch.tensor([[1.0], [0.0]])
    term = torch.tensor([[False], [True]])
    y = td3_target(next_q, reward, term, 0.9)
    torch.testing.assert_close(y, torch.tensor([[1.0 + 0.9 * 0.5], [0.0]]))
    q = torch.tensor([[[1.0], [0.0]], [[2.0], [1.0]]])
    loss, _ = critic_loss(q, y)
    want = ((1 - 1.45) ** 2 + 0) / 2 + ((2 - 1.45) ** 2 + 1) / 2
    assert float(loss) == pytest.approx(want, rel=1e-6)
    qp = torch.tensor([[2.0], [-1.0]], requires_grad=True)
    loss, m = diffusion_ql_actor_loss(qp, torch.tensor(0.3), q_coef=2.0, bc_coef=0.5)
    assert float(loss) == pytest.approx(0.5 * 0.3 - 2.0 * 0.5 / 1.5, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(qp.grad, torch.full((2, 1), -2.0 / 1.5 / 2))  # normaliser detached
    with pytest.raises(ConfigError, match="gamma"):
        td3_target(next_q, reward, term, 1.5)
    with pytest.raises(ShapeError):
        td3_target(next_q, reward[:1], term[:1], 0.9)


@pytest.mark.parametrize("change, error, message", [
    (dict(log_prob="int"), "ShapeError", "dppo_loss: log_prob: expected a floating-point torch.Tensor, got dtype torch.int64"),
    (dict(advantage=[1.0] * 8), "ShapeError", "dppo_loss: advantage: expected a floating-point torch.Tensor, got list"),
    (dict(entropy=torch.ones(8, 6)), "ShapeError", r"dppo_loss: entropy has shape \(8, 6\), expected \(8, 1\)"),
    (dict(clip_epsilon=torch.full((3,), 0.1)), "ShapeError", r"clip_epsilon has shape \(3,\), expected a number or \[K'\] = \[5\]"),
    (dict(denoising_discount="0.9"), "ConfigError", "denoising_discount='0.9': expected a number"),
    (dict(total_steps="5"), "ConfigError", "total_steps='5': expected an int"),
])
def test_bad_inputs_are_named(change, error, message):
    # new-user pass: an int log_prob was blamed on clip_epsilon (cast to 0); the others were raw torch/Python errors
    import rlfunc.errors as errors

    lp = torch.zeros(8, 5)
    a, v = torch.ones(8, 1), torch.zeros(8, 1)
    kw = dict(log_prob=lp, sample_log_prob=lp, advantage=a, state_value=v, value_target=v, clip_epsilon=0.1)
    if change.get("log_prob") == "int":
        change = dict(log_prob=lp.long(), sample_log_prob=lp.long())
    kw.update(change)
    args = [kw.pop(k) for k in ("log_prob", "sample_log_prob", "advantage", "state_value", "value_target")]
    with pytest.raises(getattr(errors, error), match=message):
        dppo_loss(*args, **kw)


def test_clip_schedule_refuses_a_fractional_step_count():
    """Regression (functional-core pass): num_steps=2.5 was torch.linspace's TypeError."""
    with pytest.raises(ConfigError, match="num_steps=2.5: expected an int"):
        clip_schedule(2.5, 0.01, 0.1)
    import numpy as np

    torch.testing.assert_close(clip_schedule(np.int64(3), 0.01, 0.1, rate=0.0), torch.tensor([0.01, 0.055, 0.1]))

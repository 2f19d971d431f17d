"""rlfunc.losses.ppo against hand-computed values and a plain float64 reference."""

import math

import pytest
import torch

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.losses.ppo import (
    EV_MOMENTS,
    EV_PARTS,
    clipped_surrogate,
    explained_variance,
    explained_variance_parts,
    normalize_advantage,
    pool_explained_variance,
    ppo_loss,
)

E5 = math.exp(0.5)  # 1.6487212707
EM5 = math.exp(-0.5)  # 0.6065306597


def col(*values, dtype=torch.float64, requires_grad=False):
    return torch.tensor(values, dtype=dtype).unsqueeze(-1).requires_grad_(requires_grad)


def surrogate_inputs(requires_grad=False):
    # log-ratios 0.5, -0.5, 0.5, -0.5, 0, 0 -> ratios e^0.5, e^-0.5, e^0.5, e^-0.5, 1, 1
    log_prob = col(0.5, -0.5, 0.5, -0.5, 0.0, 0.0, requires_grad=requires_grad)
    sample_log_prob = col(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    advantage = col(1.0, 1.0, -1.0, -1.0, 1.0, -1.0)
    return log_prob, sample_log_prob, advantage


# Clipped surrogate min(r A, clip(r, 0.8, 1.2) A), per sample, with eps = 0.2:
#   s0: r = e^0.5  = 1.6487, A = +1: rA =  1.6487, clip*A =  1.2 -> min  1.2     (clipped)
#   s1: r = e^-0.5 = 0.6065, A = +1: rA =  0.6065, clip*A =  0.8 -> min  0.6065  (unclipped)
#   s2: r = e^0.5  = 1.6487, A = -1: rA = -1.6487, clip*A = -1.2 -> min -1.6487  (unclipped)
#   s3: r = e^-0.5 = 0.6065, A = -1: rA = -0.6065, clip*A = -0.8 -> min -0.8     (clipped)
#   s4: r = 1,               A = +1:                               -> min  1
#   s5: r = 1,               A = -1:                               -> min -1
EXPECTED_OBJECTIVE = [1.2, EM5, -E5, -0.8, 1.0, -1.0]
# mean = (1.2 + 0.6065307 - 1.6487213 - 0.8 + 1 - 1) / 6 = -0.6421906 / 6 = -0.1070318
EXPECTED_LOSS_OBJECTIVE = -sum(EXPECTED_OBJECTIVE) / 6


def test_clipped_surrogate_by_hand():
    log_prob, sample_log_prob, advantage = surrogate_inputs()
    objective, ratio = clipped_surrogate(log_prob, sample_log_prob, advantage, clip_epsilon=0.2)
    torch.testing.assert_close(ratio, col(E5, EM5, E5, EM5, 1.0, 1.0), rtol=0, atol=1e-12)
    torch.testing.assert_close(objective, col(*EXPECTED_OBJECTIVE), rtol=0, atol=1e-12)
    assert EXPECTED_LOSS_OBJECTIVE == pytest.approx(0.10703177, abs=1e-7)


def test_ppo_loss_objective_kl_and_clip_fraction_by_hand():
    log_prob, sample_log_prob, advantage = surrogate_inputs()
    zeros = torch.zeros_like(log_prob)
    loss, metrics = ppo_loss(
        log_prob, sample_log_prob, advantage, zeros, zeros, clip_epsilon=0.2, normalize_advantages=False
    )
    torch.testing.assert_close(metrics["loss_objective"], torch.tensor(EXPECTED_LOSS_OBJECTIVE, dtype=torch.float64))
    # No value error, no entropy: the loss is the objective term alone.
    torch.testing.assert_close(loss, torch.tensor(EXPECTED_LOSS_OBJECTIVE, dtype=torch.float64))
    assert float(metrics["loss_critic"]) == 0.0 and float(metrics["loss_entropy"]) == 0.0
    # k3: (r - 1) - log r:
    #   r = e^0.5:  0.6487213 - 0.5 = 0.1487213 (twice)
    #   r = e^-0.5: -0.3934693 + 0.5 = 0.1065307 (twice)
    #   r = 1: 0 (twice)               -> mean = 2 * (0.1487213 + 0.1065307) / 6 = 0.0850840
    expected_kl = 2 * ((E5 - 1 - 0.5) + (EM5 - 1 + 0.5)) / 6
    assert float(metrics["approx_kl"]) == pytest.approx(expected_kl, abs=1e-12)
    assert float(metrics["approx_kl"]) == pytest.approx(0.0850840, abs=1e-7)
    # |r - 1| > 0.2 for the four samples with |log r| = 0.5, not for r = 1 -> 4 / 6.
    assert float(metrics["clip_fraction"]) == pytest.approx(4 / 6, abs=1e-7)  # computed in float32


def test_ppo_loss_symmetric_advantages_normalize_to_themselves():
    # A = +-1 (three each): mean 0, population std 1 -> normalised A = A / (1 + 1e-8).
    log_prob, sample_log_prob, advantage = surrogate_inputs()
    zeros = torch.zeros_like(log_prob)
    _, metrics = ppo_loss(log_prob, sample_log_prob, advantage, zeros, zeros, clip_epsilon=0.2)
    assert float(metrics["loss_objective"]) == pytest.approx(EXPECTED_LOSS_OBJECTIVE, abs=1e-7)
    # Scaling and shifting the advantages does not change the normalised loss.
    _, shifted = ppo_loss(log_prob, sample_log_prob, 3.0 * advantage + 7.0, zeros, zeros, clip_epsilon=0.2)
    assert float(shifted["loss_objective"]) == pytest.approx(EXPECTED_LOSS_OBJECTIVE, abs=1e-7)


def test_value_loss_without_clipping_by_hand():
    # V = [1, 2, 3], V_target = [1.5, 2, 1]: squared errors [0.25, 0, 4], mean 4.25 / 3 = 1.4166667;
    # loss_critic = value_coef * 0.5 * mean = 0.5 * 0.5 * 1.4166667 = 0.3541667.
    zeros = col(0.0, 0.0, 0.0)
    loss, metrics = ppo_loss(zeros, zeros, zeros, col(1.0, 2.0, 3.0), col(1.5, 2.0, 1.0), value_coef=0.5)
    assert float(metrics["loss_objective"]) == 0.0  # ratio 1, normalised advantage exactly 0
    assert float(metrics["loss_critic"]) == pytest.approx(0.25 * 4.25 / 3, abs=1e-12)
    assert float(loss) == pytest.approx(0.3541667, abs=1e-7)
    _, metrics2 = ppo_loss(zeros, zeros, zeros, col(1.0, 2.0, 3.0), col(1.5, 2.0, 1.0), value_coef=2.0)
    assert float(metrics2["loss_critic"]) == pytest.approx(1.0 * 4.25 / 3, abs=1e-12)


def test_value_loss_with_clipping_by_hand():
    # V = [1, 2, 3], V_old = [0.5, 2.5, 2], V_target = [1.5, 2, 1], value_clip_epsilon = 0.2:
    #   s0: V - V_old =  0.5 -> clipped  0.2 -> V_c = 0.7; (0.7-1.5)^2 = 0.64; max(0.25, 0.64) = 0.64
    #   s1: V - V_old = -0.5 -> clipped -0.2 -> V_c = 2.3; (2.3-2)^2   = 0.09; max(0,    0.09) = 0.09
    #   s2: V - V_old =  1   -> clipped  0.2 -> V_c = 2.2; (2.2-1)^2   = 1.44; max(4,    1.44) = 4
    # mean = 4.73 / 3 = 1.5766667; loss_critic = 0.5 * 0.5 * 1.5766667 = 0.3941667.
    zeros = col(0.0, 0.0, 0.0)
    state_value = col(1.0, 2.0, 3.0, requires_grad=True)
    _, metrics = ppo_loss(
        zeros, zeros, zeros, state_value, col(1.5, 2.0, 1.0),
        old_state_value=col(0.5, 2.5, 2.0), value_clip_epsilon=0.2, value_coef=0.5,
    )
    assert float(metrics["loss_critic"]) == pytest.approx(0.25 * 4.73 / 3, abs=1e-12)
    assert float(metrics["loss_critic"]) == pytest.approx(0.3941667, abs=1e-7)
    # Gradient w.r.t. V: the clipped branch (s0, s1) has no gradient through V; s2 uses the plain
    # error: d/dV [0.25 * (V - 1)^2 / 3] = 0.5 * (3 - 1) / 3 = 1/3.
    loss, _ = ppo_loss(
        zeros, zeros, zeros, state_value, col(1.5, 2.0, 1.0),
        old_state_value=col(0.5, 2.5, 2.0), value_clip_epsilon=0.2, value_coef=0.5,
    )
    loss.backward()
    torch.testing.assert_close(state_value.grad, col(0.0, 0.0, 1.0 / 3.0), rtol=0, atol=1e-12)


def test_value_clipping_needs_old_values():
    z = col(0.0, 0.0)
    with pytest.raises(ConfigError, match="old_state_value"):
        ppo_loss(z, z, z, z, z, value_clip_epsilon=0.2)


def test_entropy_term_sign():
    # H = [1, 2, 3], mean 2; entropy_coef 0.01 -> loss_entropy = -0.01 * 2 = -0.02 (a bonus).
    zeros = col(0.0, 0.0, 0.0)
    entropy = col(1.0, 2.0, 3.0, requires_grad=True)
    loss, metrics = ppo_loss(zeros, zeros, zeros, zeros, zeros, entropy=entropy, entropy_coef=0.01)
    assert float(metrics["entropy"]) == pytest.approx(2.0)
    assert float(metrics["loss_entropy"]) == pytest.approx(-0.02, abs=1e-12)
    assert float(loss) == pytest.approx(-0.02, abs=1e-12)
    loss.backward()
    # Minimising the loss increases entropy: d loss / d H_i = -0.01 / 3 < 0.
    torch.testing.assert_close(entropy.grad, torch.full_like(entropy, -0.01 / 3), rtol=0, atol=1e-15)
    # Entropy is reported even with coefficient 0, and then does not enter the loss.
    loss0, metrics0 = ppo_loss(zeros, zeros, zeros, zeros, zeros, entropy=col(1.0, 2.0, 3.0), entropy_coef=0.0)
    assert float(metrics0["entropy"]) == pytest.approx(2.0) and float(loss0) == 0.0


def test_explained_variance():
    target = torch.tensor([1.0, 2.0, 4.0, 7.0])
    assert float(explained_variance(target.clone(), target)) == pytest.approx(1.0, abs=1e-7)
    # Predicting the mean everywhere explains nothing.
    assert float(explained_variance(torch.full_like(target, target.mean()), target)) == pytest.approx(0.0, abs=1e-6)
    # Hand value: prediction [1, 2, 4, 5]: residual [0, 0, 0, 2], Var = 0.75; Var[target] = 5.25 -> 1 - 1/7.
    assert float(explained_variance(torch.tensor([1.0, 2.0, 4.0, 5.0]), target)) == pytest.approx(6 / 7, abs=1e-6)
    # Worse than the mean: negative.
    assert float(explained_variance(-target, target)) < 0
    # Constant target: 0 and finite, whatever the prediction.
    constant = torch.full((4,), 3.0)
    for pred in (constant.clone(), torch.tensor([0.0, 1.0, 2.0, 10.0])):
        ev = explained_variance(pred, constant)
        assert ev.dim() == 0 and torch.isfinite(ev) and float(ev) == 0.0


def test_normalize_advantage():
    one = normalize_advantage(torch.tensor([[3.5]]))
    assert torch.isfinite(one).all() and float(one) == 0.0
    constant = normalize_advantage(torch.full((4, 1), -2.0))
    assert torch.equal(constant, torch.zeros(4, 1))
    a = torch.tensor([[1.0], [2.0], [3.0], [6.0]], dtype=torch.float64)
    # mean 3, population std sqrt((4 + 1 + 0 + 9) / 4) = sqrt(3.5)
    torch.testing.assert_close(normalize_advantage(a), (a - 3.0) / (math.sqrt(3.5) + 1e-8), rtol=0, atol=1e-12)
    # new-user pass: 1000 copies of 1.7 (float32) came out as values up to +-0.96, the mean's rounding
    # error over a std of ~1e-7; equal advantages carry no signal, so exactly 0
    for value in (1.7, 0.1, 123.456):
        assert torch.equal(normalize_advantage(torch.full((1000, 1), value)), torch.zeros(1000, 1))
    small = torch.tensor([[1.0], [1.0 + 1e-3]])  # a real spread, small but far above rounding: still +-1
    torch.testing.assert_close(normalize_advantage(small), torch.tensor([[-1.0], [1.0]]), atol=1e-3, rtol=0)
    assert normalize_advantage(torch.zeros(0, 1)).shape == (0, 1)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_advantage_is_not_normalised_to_zero(bad):
    """New-user pass: one NaN advantage turned every advantage into 0 (a NaN std failed `std > rounding`),
    so ppo_loss was finite and its policy gradient silently zero; now the loss is NaN and the step skipped."""
    adv = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))
    adv[3] = bad
    assert normalize_advantage(adv).isnan().all()
    log_prob = torch.zeros(8, 1, requires_grad=True)
    loss, _ = ppo_loss(log_prob, torch.zeros(8, 1), adv, torch.zeros(8, 1), torch.ones(8, 1), clip_epsilon=0.2)
    assert loss.isnan()


def test_explained_variance_refuses_shapes_that_would_broadcast():
    """New-user pass: an [8, 1] prediction against an [8] target broadcast to [8, 8] and gave -0.83
    where the value is -0.61."""
    with pytest.raises(ShapeError, match=r"prediction \[8, 1\] and target \[8\]: expected tensors of one shape"):
        explained_variance(torch.randn(8, 1), torch.randn(8))
    with pytest.raises(ShapeError, match="expected floating point tensors"):
        explained_variance(torch.arange(4), torch.arange(4))


def test_ppo_loss_minibatch_of_one_is_finite():
    x = col(0.3, dtype=torch.float32)
    loss, metrics = ppo_loss(x, col(0.1, dtype=torch.float32), col(5.0, dtype=torch.float32), x, col(0.3, dtype=torch.float32))
    assert torch.isfinite(loss)
    assert float(metrics["loss_objective"]) == 0.0  # normalised advantage of one sample is 0
    assert all(torch.isfinite(v) for v in metrics.values())
    assert float(metrics["explained_variance"]) == 0.0


def test_gradient_zero_where_ratio_clipped_in_direction_of_advantage():
    log_prob, sample_log_prob, advantage = surrogate_inputs(requires_grad=True)
    zeros = torch.zeros_like(advantage)
    loss, _ = ppo_loss(log_prob, sample_log_prob, advantage, zeros, zeros, clip_epsilon=0.2, normalize_advantages=False)
    loss.backward()
    # loss = -mean(objective); unclipped samples: d(-rA/6)/d log_prob = -rA/6; clipped (s0, s3): 0.
    expected = col(0.0, -EM5 / 6, E5 / 6, 0.0, -1.0 / 6, 1.0 / 6)
    torch.testing.assert_close(log_prob.grad, expected, rtol=0, atol=1e-12)


def ppo_loss_reference(log_prob, sample_log_prob, advantage, state_value, value_target, entropy,
                       old_state_value, eps, veps, c_e, c_v):
    """Plain float64 loop over samples."""
    n = len(log_prob)
    a = [float(x) for x in advantage]
    mean = sum(a) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in a) / n)
    a = [(x - mean) / (std + 1e-8) for x in a]
    obj = crit = ent = 0.0
    for i in range(n):
        r = math.exp(float(log_prob[i]) - float(sample_log_prob[i]))
        obj += min(r * a[i], min(max(r, 1 - eps), 1 + eps) * a[i])
        v, vt, vo = float(state_value[i]), float(value_target[i]), float(old_state_value[i])
        vc = vo + min(max(v - vo, -veps), veps)
        crit += max((v - vt) ** 2, (vc - vt) ** 2)
        ent += float(entropy[i])
    return -obj / n + c_v * 0.5 * crit / n - c_e * ent / n


def test_ppo_loss_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    n = 17
    t = lambda: torch.randn(n, 1, generator=g, dtype=torch.float64)  # noqa: E731
    lp, slp, adv, v, vt, ov = t(), t(), t(), t(), t(), t()
    lp = slp + 0.3 * lp
    ent = t().abs()
    loss, _ = ppo_loss(lp, slp, adv, v, vt, entropy=ent, old_state_value=ov, clip_epsilon=0.15,
                       value_clip_epsilon=0.3, entropy_coef=0.02, value_coef=0.7)
    ref = ppo_loss_reference(lp, slp, adv, v, vt, ent, ov, 0.15, 0.3, 0.02, 0.7)
    assert float(loss) == pytest.approx(ref, abs=1e-10)


@pytest.mark.parametrize("name", ["sample_log_prob", "advantage", "state_value", "value_target"])
def test_shape_mismatch_names_the_argument(name):
    args = {k: torch.zeros(4, 1) for k in ("log_prob", "sample_log_prob", "advantage", "state_value", "value_target")}
    args[name] = torch.zeros(4)
    with pytest.raises(ShapeError, match=name):
        ppo_loss(**args)


@pytest.mark.parametrize("clip_epsilon", [0.0, -0.1, float("nan")])
def test_bad_clip_epsilon_raises(clip_epsilon):
    z = torch.zeros(3, 1)
    with pytest.raises(ConfigError, match="clip_epsilon"):
        ppo_loss(z, z, z, z, z, clip_epsilon=clip_epsilon)


def test_inputs_of_the_wrong_kind_are_named():
    # the bugs: clip_epsilon="0.2" was a TypeError from a comparison, an int64 advantage a deep
    # "mean(): could not infer output dtype", a list an AttributeError
    z = torch.zeros(3, 1)
    with pytest.raises(ConfigError, match="^ppo_loss: clip_epsilon='0.2': expected a number$"):
        ppo_loss(z, z, z, z, z, clip_epsilon="0.2")
    with pytest.raises(ConfigError, match="^ppo_loss: value_coef=None: expected a number$"):
        ppo_loss(z, z, z, z, z, value_coef=None)
    with pytest.raises(ShapeError, match="^ppo_loss: advantage: expected a floating-point torch.Tensor, got dtype torch.int64$"):
        ppo_loss(z, z, z.long(), z, z)
    with pytest.raises(ShapeError, match="^ppo_loss: log_prob: expected a floating-point torch.Tensor, got list$"):
        ppo_loss([0.0, 0.0, 0.0], z, z, z, z)


@pytest.mark.parametrize("kwargs", [{"entropy_coef": -0.01}, {"value_coef": -0.5}])
def test_negative_coefficients_raise(kwargs):
    z = torch.zeros(3, 1)
    with pytest.raises(ConfigError):
        ppo_loss(z, z, z, z, z, **kwargs)


def test_old_state_value_of_another_shape_is_refused():
    # the bug: a [B] old_state_value against a [B, 1] state_value broadcast to [B, B] in the clipped
    # value error and gave a wrong loss, silently
    z = torch.zeros(4, 1)
    with pytest.raises(ShapeError, match=r"^ppo_loss: old_state_value has shape \(4,\), expected \(4, 1\) like log_prob$"):
        ppo_loss(z, z, z, z, z, old_state_value=torch.zeros(4), value_clip_epsilon=0.2)
    with pytest.raises(ShapeError, match="^ppo_loss: old_state_value: expected a floating-point torch.Tensor, got dtype torch.int64$"):
        ppo_loss(z, z, z, z, z, old_state_value=torch.zeros(4, 1, dtype=torch.int64), value_clip_epsilon=0.2)


def test_empty_minibatch_is_refused():
    # the bug: B = 0 returned a NaN loss with torch's "mean of empty tensor" warnings
    z = torch.zeros(0, 1)
    with pytest.raises(ShapeError, match=r"^ppo_loss: log_prob has shape \(0, 1\), an empty minibatch: expected at least one sample$"):
        ppo_loss(z, z, z, z, z)


@pytest.mark.parametrize("value_clip_epsilon", [-0.1, float("nan"), float("inf")])
def test_bad_value_clip_epsilon_raises(value_clip_epsilon):
    z = torch.zeros(3, 1)
    with pytest.raises(ConfigError, match=f"^ppo_loss: value_clip_epsilon={value_clip_epsilon}: expected a finite number >= 0$"):
        ppo_loss(z, z, z, z, z, old_state_value=z, value_clip_epsilon=value_clip_epsilon)


def test_value_clip_epsilon_zero_pins_the_clipped_branch_at_the_old_value():
    # V = [1, 2], V_old = [0, 2.5], V_target = [1.5, 1], eps_v = 0: the clipped value is V_old:
    #   s0: max((1-1.5)^2, (0-1.5)^2) = max(0.25, 2.25) = 2.25; s1: max((2-1)^2, (2.5-1)^2) = 2.25
    # loss_critic = 0.5 * 0.5 * 2.25 = 0.5625
    z = col(0.0, 0.0)
    _, metrics = ppo_loss(z, z, z, col(1.0, 2.0), col(1.5, 1.0), old_state_value=col(0.0, 2.5), value_clip_epsilon=0.0)
    assert float(metrics["loss_critic"]) == pytest.approx(0.5625, abs=1e-12)


@pytest.mark.parametrize("name", ["clip_epsilon", "entropy_coef", "value_coef"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_coefficients_raise(name, value):
    # the bug: entropy_coef=nan passed the "< 0" check and made the loss NaN
    z = torch.zeros(3, 1)
    with pytest.raises(ConfigError, match=f"^ppo_loss: {name}={value}: expected a finite number"):
        ppo_loss(z, z, z, z, z, entropy=z, **{name: value})


def test_entropy_of_another_shape_is_refused():
    # new-user pass: a per-dimension Gaussian entropy [B, A] was averaged (1/A of the bonus), silently
    from rlfunc.errors import ShapeError

    B = 8
    x = torch.zeros(B, 1)
    with pytest.raises(ShapeError, match=r"ppo_loss: entropy has shape \(8, 6\), expected \(8, 1\)"):
        ppo_loss(x, x, x, x, x, entropy=torch.ones(B, 6), entropy_coef=0.01)


def test_clipped_surrogate_refuses_a_clip_epsilon_that_is_not_positive():
    """New-user pass: clip_epsilon=-1 clamped the ratio to [2, 0] and returned a garbage objective."""
    lp = torch.zeros(4, 1)
    for bad in (-1.0, 0.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match=f"clip_epsilon={bad}: expected a finite number > 0"):
            clipped_surrogate(lp, lp, torch.ones(4, 1), bad)


def test_explained_variance_of_equal_targets_is_zero_despite_rounding():
    # The bug: 1000 targets of 1.7 have a float32 variance of ~5.7e-14, not 0, so the documented 0 came out
    # as about -1e12 (and as ppo_loss's "explained_variance" metric)
    target = torch.full((1000,), 1.7)
    noisy = target + torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert float(target.var(correction=0)) > 0 and float(explained_variance(noisy, target)) == 0.0
    vt = torch.full((1000, 1), 1.7)
    zeros = torch.zeros(1000, 1)
    _, metrics = ppo_loss(zeros, zeros, torch.randn(1000, 1), vt + 0.1, vt)
    assert float(metrics["explained_variance"]) == 0.0
    spread = torch.tensor([1.7, 1.7 + 1e-5, 1.7 - 1e-5])  # a real (small) spread still counts
    assert float(explained_variance(spread, spread)) == pytest.approx(1.0)


def test_explained_variance_of_non_finite_targets_is_nan_not_zero():
    # Metrics pass: a NaN reward's skipped update logged loss_critic null beside explained_variance 0.0 (or a
    # diluted mean of the minibatches' values), a real-looking number for data that trained nothing
    target = torch.tensor([1.0, float("nan"), 3.0])
    assert math.isnan(float(explained_variance(torch.zeros(3), target)))
    assert math.isnan(float(explained_variance(torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1.0, 2.0, 3.0]))))
    assert float(explained_variance(torch.zeros(3), torch.full((3,), 2.0))) == 0.0  # no spread: still 0
    vt = torch.tensor([[1.0], [float("nan")], [3.0], [4.0]])
    zeros = torch.zeros(4, 1)
    _, metrics = ppo_loss(zeros, zeros, torch.randn(4, 1), zeros, vt)
    assert math.isnan(float(metrics["explained_variance"]))


def test_clipped_surrogate_refuses_shapes_that_would_broadcast():
    # [B] log-probabilities (a Normal(...).log_prob(a).sum(-1)) against a [B, 1] advantage made an [8, 8] objective
    lp = torch.zeros(8)
    with pytest.raises(ShapeError, match=r"advantage has shape \[8, 1\], expected log_prob's \[8\]"):
        clipped_surrogate(lp, lp, torch.ones(8, 1), 0.2)
    with pytest.raises(ShapeError, match="sample_log_prob has shape"):
        clipped_surrogate(torch.zeros(8, 1), lp, torch.ones(8, 1), 0.2)


def test_normalize_advantage_names_a_non_float_input():
    for bad, got in ((torch.arange(4), "dtype torch.int64"), ([1.0, 2.0], "list")):  # a deep RuntimeError / AttributeError
        with pytest.raises(ShapeError, match=f"advantage: expected a floating-point torch.Tensor, got {got}"):
            normalize_advantage(bad)


def _merged_parts(prediction, target, sizes):
    """The parts of explained_variance over splits of ``sizes`` merged as accumulate_gradients merges
    micro-batches: Chan's pairwise update of the (mean, variance) pairs, max |target| as a max."""
    from tensordict import TensorDict

    from rlfunc.core.normalize import merge_moments

    total, done = None, 0
    for p, t in zip(prediction.split(sizes), target.split(sizes)):
        part = TensorDict(explained_variance_parts(p, t), batch_size=[])
        if total is not None:
            for mk, vk in EV_MOMENTS:
                part[mk], part[vk] = merge_moments(total[mk], total[vk], done, part[mk], part[vk], len(t))
            part["ev_target_absmax"] = torch.maximum(total["ev_target_absmax"], part["ev_target_absmax"])
        total, done = part, done + len(t)
    total["explained_variance"] = torch.zeros((), dtype=target.dtype)
    return total


@pytest.mark.parametrize("sizes", [(8, 8), (5, 11, 3, 13), (32,), (24, 8)])
def test_pooled_explained_variance_is_the_whole_batchs(sizes):
    # parts of a batch (micro-batches of any sizes, data-parallel shares) merged: the whole batch's explained
    # variance, in float64; the mean of the parts' own values is not it
    g = torch.Generator().manual_seed(3)
    target = torch.randn(sum(sizes), 1, generator=g, dtype=torch.float64) * 2 + 5
    prediction = target + torch.randn(sum(sizes), 1, generator=g, dtype=torch.float64) * 1.5
    out = pool_explained_variance(_merged_parts(prediction, target, sizes))
    assert set(out.keys()) == {"explained_variance"}  # the parts removed
    assert float(out["explained_variance"]) == pytest.approx(float(explained_variance(prediction, target)), abs=1e-12)
    if len(sizes) == 1:  # one part: explained_variance itself, exactly
        assert float(out["explained_variance"]) == float(explained_variance(prediction, target))


@pytest.mark.parametrize("sizes", [(24, 24, 16), (3,) * 21 + (1,), (1,) * 64, (8,) * 8, (5,) * 12 + (4,)])
def test_pooled_explained_variance_of_float32_constant_or_far_off_targets(sizes):
    # review pass: pooled as E[var] + E[mean^2] - E[mean]^2, float32 cancelled: equal targets 1.7 in
    # micro-batches of 24 gave -261.6 (0 is right), targets 1e4 + N(0, 1) in parts of 8 gave 0.0 (0.83)
    n = sum(sizes)
    g = torch.Generator().manual_seed(5)
    for c in (1.7, 1.0 / 3.0, 100.0 / 3.0):
        target = torch.full((n, 1), c)
        prediction = target + 0.01 * torch.randn(n, 1, generator=g)
        assert float(pool_explained_variance(_merged_parts(prediction, target, sizes))["explained_variance"]) == 0.0
    for mean in (1e3, 1e4, 3e4):
        target = mean + torch.randn(n, 1, generator=g)
        prediction = target + 0.5 * torch.randn(n, 1, generator=g)
        want = float(explained_variance(prediction.double(), target.double()))
        got = float(pool_explained_variance(_merged_parts(prediction, target, sizes))["explained_variance"])
        assert got == pytest.approx(want, abs=0.02), (mean, got, want)


def test_ppo_loss_poolable_adds_the_parts_and_nothing_else():
    lp, slp, adv, v, vt = (torch.randn(16, 1, generator=torch.Generator().manual_seed(i)) for i in range(5))
    _, plain = ppo_loss(lp, slp, adv, v, vt)
    _, parts = ppo_loss(lp, slp, adv, v, vt, poolable=True)
    assert set(parts.keys()) == set(plain.keys()) | set(EV_PARTS)
    assert float(pool_explained_variance(parts)["explained_variance"]) == float(plain["explained_variance"])
    assert pool_explained_variance(plain) is plain  # nothing to pool


def test_ppo_loss_under_vmap_over_clip_epsilon_matches_a_loop():
    """Regression (functional-core pass): a batched clip_epsilon (a sweep under torch.func.vmap) raised vmap's
    data-dependent error in the coefficient check's host read; each member now equals the eager call."""
    g = torch.Generator().manual_seed(5)
    args = [torch.randn(16, 1, generator=g, dtype=torch.float64) for _ in range(5)]
    eps = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    got = torch.func.vmap(lambda c: ppo_loss(*args, clip_epsilon=c)[0])(eps)
    loop = torch.stack([ppo_loss(*args, clip_epsilon=float(c))[0] for c in eps])
    torch.testing.assert_close(got, loop, rtol=0, atol=1e-12)
    with pytest.raises(ConfigError, match="clip_epsilon"):  # an eager call still checks
        ppo_loss(*args, clip_epsilon=torch.tensor(-0.1))
    with pytest.raises(ConfigError, match="clip_epsilon"):  # and grad alone (the read works there)
        torch.func.grad(lambda lp: ppo_loss(lp, *args[1:], clip_epsilon=torch.tensor(-0.1))[0])(args[0])


def test_explained_variance_of_targets_with_a_tiny_spread_is_exact():
    """Regression (functional-core pass): the targets' variance was clamped to 1e-12, so targets of std 1e-7
    scored 0.99 for a zero prediction (exactly 0) and 0.96 for the negated one (exactly -3)."""
    for dtype in (torch.float32, torch.float64):
        t = torch.randn(100, 1, generator=torch.Generator().manual_seed(0), dtype=dtype) * 1e-7
        torch.testing.assert_close(explained_variance(torch.zeros_like(t), t), torch.tensor(0.0, dtype=dtype), rtol=0, atol=1e-5)
        torch.testing.assert_close(explained_variance(-t, t), torch.tensor(-3.0, dtype=dtype), rtol=0, atol=1e-5)

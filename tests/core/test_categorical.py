"""Categorical policies (Discrete, masked, MultiDiscrete) against torch.distributions.Categorical in float64."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical

from rlfunc.core.distributions import (
    categorical_entropy,
    categorical_log_prob,
    categorical_mode,
    categorical_sample,
    masked_logits,
)
from rlfunc.errors import ConfigError, ShapeError

NVEC = (3, 2, 4)


def _logits(seed=0, batch=(6, 5), k=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*batch, k, generator=g) * 2


def test_log_prob_and_entropy_match_torch():
    logits = _logits()
    action = torch.randint(0, 5, logits.shape[:-1], generator=torch.Generator().manual_seed(1))
    ref = Categorical(logits=logits.double())
    lp = categorical_log_prob(logits, action)
    assert lp.shape == (6, 5, 1) and lp.dtype == torch.float32
    torch.testing.assert_close(lp.squeeze(-1).double(), ref.log_prob(action), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(categorical_entropy(logits).squeeze(-1).double(), ref.entropy(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(categorical_mode(logits), logits.argmax(-1))


def test_masked_log_prob_and_entropy_match_torch():
    logits = _logits(2)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(logits.shape, generator=g) > 0.4
    mask[..., 0] |= ~mask.any(-1)
    ref = Categorical(logits=torch.where(mask, logits, torch.tensor(float("-inf"))).double())
    action = torch.where(mask, torch.rand(mask.shape, generator=g), -1.0).argmax(-1)
    assert mask.gather(-1, action[..., None]).all()  # allowed actions only: torch gives -inf on the others
    lp = categorical_log_prob(logits, action, action_mask=mask)
    torch.testing.assert_close(lp.squeeze(-1).double(), ref.log_prob(action), atol=1e-5, rtol=1e-5)
    h = categorical_entropy(logits, action_mask=mask)
    torch.testing.assert_close(h.squeeze(-1).double(), ref.entropy(), atol=1e-5, rtol=1e-5)
    assert mask.gather(-1, categorical_mode(logits, action_mask=mask)[..., None]).all()
    # a masked action is finite and far below any allowed one, never NaN
    bad = (~mask).float().argmax(-1)
    rows = (~mask).any(-1)
    lp_bad = categorical_log_prob(logits, bad, action_mask=mask)[rows]
    assert torch.isfinite(lp_bad).all() and (lp_bad < -1e30).all()


def test_minus_inf_logit_gradient_is_finite_and_matches_torch():
    # the bug: a -inf logit (masking by -inf) gave the right entropy but an all-NaN gradient
    # (0 * -inf in the untaken branch of torch.where)
    lg = torch.tensor([[0.0, -float("inf"), 1.0]], requires_grad=True)
    h = categorical_entropy(lg)
    h.sum().backward()
    ref_lg = lg.detach().clone().requires_grad_(True)
    ref = Categorical(logits=ref_lg).entropy()
    ref.sum().backward()
    torch.testing.assert_close(h.squeeze(-1), ref.detach())
    # dH/dl = -p (log p + H): p = [0.2689, 0, 0.7311], H = 0.5822 -> [0.1966, 0, -0.1966]
    torch.testing.assert_close(lg.grad, torch.tensor([[0.1966, 0.0, -0.1966]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(lg.grad, ref_lg.grad)
    # the log_prob path: finite gradients equal to torch's, -inf for the action of probability 0
    for a in range(3):
        lg.grad = ref_lg.grad = None
        lp = categorical_log_prob(lg, torch.tensor([a]))
        lp.sum().backward()
        ref_lp = Categorical(logits=ref_lg).log_prob(torch.tensor([a]))
        ref_lp.sum().backward()
        torch.testing.assert_close(lp.squeeze(-1), ref_lp.detach())
        assert torch.isfinite(lg.grad).all()
        torch.testing.assert_close(lg.grad, ref_lg.grad)


def test_multidiscrete_is_a_sum_over_independent_heads():
    logits = _logits(4, batch=(7,), k=sum(NVEC))
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(logits.shape, generator=g) > 0.3
    mask[0, 3:5] = False  # a head with no allowed action is left unmasked
    action = torch.stack([torch.randint(0, n, (7,), generator=g) for n in NVEC], -1)
    action[:, 0] = torch.where(mask[:, :3], torch.rand(7, 3, generator=g), -1.0).argmax(-1)
    heads_l, heads_m = logits.split(NVEC, -1), mask.split(NVEC, -1)
    want_lp = torch.zeros(7, dtype=torch.float64)
    want_h = torch.zeros(7, dtype=torch.float64)
    for h, (x, m) in enumerate(zip(heads_l, heads_m)):
        if h == 0:  # head 0 masked; the other heads unmasked in this reference
            m = m | ~m.any(-1, keepdim=True)
            x = torch.where(m, x, torch.tensor(float("-inf")))
        ref = Categorical(logits=x.double())
        want_lp += ref.log_prob(action[:, h])
        want_h += ref.entropy()
    mask0 = torch.cat([mask[:, :3], torch.ones(7, 6, dtype=torch.bool)], -1)
    lp = categorical_log_prob(logits, action, action_mask=mask0, nvec=NVEC)
    assert lp.shape == (7, 1)
    torch.testing.assert_close(lp.squeeze(-1).double(), want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(categorical_entropy(logits, action_mask=mask0, nvec=NVEC).squeeze(-1).double(), want_h,
                               atol=1e-5, rtol=1e-5)
    # the all-masked head of row 0 is left unmasked: its entropy is the unmasked one
    h_full = categorical_entropy(logits, action_mask=mask, nvec=NVEC)
    h_free = categorical_entropy(logits[:1, 3:5])
    assert torch.isfinite(h_full).all()
    part = h_full[:1] - categorical_entropy(logits[:1, :3], action_mask=mask[:1, :3]) - categorical_entropy(
        logits[:1, 5:], action_mask=mask[:1, 5:])
    torch.testing.assert_close(part, h_free)
    mode = categorical_mode(logits, nvec=NVEC)
    torch.testing.assert_close(mode, torch.stack([x.argmax(-1) for x in heads_l], -1))


def test_sampling_frequencies_with_a_fixed_generator():
    n = 40_000
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    p = torch.softmax(logits.double(), -1)
    g = torch.Generator().manual_seed(0)
    a = categorical_sample(logits.expand(n, 4), g)
    freq = torch.bincount(a, minlength=4).double() / n
    assert ((freq - p).abs() < 4 * (p * (1 - p) / n).sqrt()).all(), (freq, p)
    # the same generator state gives the same actions; explicit uniforms give the generator's draw
    u = torch.rand(n, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(categorical_sample(logits.expand(n, 4), noise=u), a)
    # masked: the masked action never drawn, the others renormalised
    mask = torch.tensor([True, False, True, True]).expand(n, 4)
    a = categorical_sample(logits.expand(n, 4), g, action_mask=mask)
    freq = torch.bincount(a, minlength=4).double() / n
    pm = torch.softmax(torch.where(mask[0], logits, torch.tensor(float("-inf"))).double(), -1)
    assert freq[1] == 0
    assert ((freq - pm).abs() < 4 * (pm * (1 - pm) / n).sqrt() + 1e-12).all(), (freq, pm)
    # MultiDiscrete: each head's marginal, and independence (joint ~ product of marginals)
    ml = torch.tensor([0.3, -0.4, 1.0, 0.0, 0.7])
    a = categorical_sample(ml.expand(n, 5), g, nvec=(3, 2))
    assert a.shape == (n, 2) and a.dtype == torch.int64
    p0, p1 = torch.softmax(ml[:3].double(), -1), torch.softmax(ml[3:].double(), -1)
    joint = torch.bincount(a[:, 0] * 2 + a[:, 1], minlength=6).double().view(3, 2) / n
    want = p0[:, None] * p1[None, :]
    assert ((joint - want).abs() < 4 * (want * (1 - want) / n).sqrt()).all(), (joint, want)


def test_vmap_equals_the_loop():
    logits = _logits(6, batch=(3, 4), k=sum(NVEC))
    action = categorical_sample(logits, torch.Generator().manual_seed(0), nvec=NVEC)
    f = lambda x, a: categorical_log_prob(x, a, nvec=NVEC)  # noqa: E731
    got = torch.func.vmap(f)(logits, action)
    torch.testing.assert_close(got, torch.stack([f(logits[i], action[i]) for i in range(3)]))


def test_categorical_errors_name_the_argument():
    logits = _logits(k=sum(NVEC))
    with pytest.raises(ShapeError, match="nvec"):
        categorical_entropy(logits, nvec=(3, 2))
    with pytest.raises(ConfigError, match="nvec"):
        categorical_entropy(logits, nvec=(9, 0))
    with pytest.raises(ShapeError, match="action"):
        categorical_log_prob(logits, torch.zeros(6, 5, dtype=torch.int64), nvec=NVEC)
    with pytest.raises(ShapeError, match="action"):
        categorical_log_prob(logits, torch.zeros(6, 5))
    with pytest.raises(ShapeError, match="action_mask"):
        categorical_entropy(logits, action_mask=torch.ones(6, 5, 9))
    with pytest.raises(ShapeError, match="noise"):
        categorical_sample(logits, noise=torch.rand(6, 9))
    with pytest.raises(ShapeError, match="logits"):
        categorical_entropy(torch.zeros(3, dtype=torch.int64))


def test_masked_categorical_never_picks_masked_actions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, 5, generator=g) * 3
    mask = torch.rand(2000, 5, generator=g) > 0.5
    mask[:, 4] |= ~mask.any(-1)  # at least one allowed action per row
    ml = masked_logits(logits, mask)
    for _ in range(5):
        action = categorical_sample(ml, g)
        assert mask.gather(-1, action[:, None]).all()
    assert mask.gather(-1, ml.argmax(-1)[:, None]).all()
    # probabilities: 0 on masked actions, renormalised on the others; entropy only over allowed ones
    p = torch.softmax(ml, -1)
    assert (p[~mask] == 0).all()
    ref = torch.where(mask, logits, torch.tensor(float("-inf"))).double()
    torch.testing.assert_close(p.double(), torch.softmax(ref, -1))
    h_ref = torch.distributions.Categorical(logits=ref).entropy()
    torch.testing.assert_close(categorical_entropy(ml).squeeze(-1).double(), h_ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ShapeError, match="action_mask"):
        masked_logits(logits, mask[:, :4])
    # found by a new user: a 0/1 float mask was NotImplementedError "bitwise_or" from inside
    with pytest.raises(ShapeError, match=r"^action_mask: expected a bool tensor \(True where the action is allowed\), got dtype torch.float32$"):
        masked_logits(logits, mask.float())
    with pytest.raises(ShapeError, match=r"^action_mask: expected a bool tensor .*got dtype torch.int64$"):
        masked_logits(logits, mask.long())
    with pytest.raises(ShapeError, match=r"^action_mask: expected a bool tensor .*got list$"):
        masked_logits(logits[:1], mask[0].tolist())




def test_an_action_outside_its_head_or_on_another_device_is_named():
    """New-user pass: an out-of-range action was torch's gather error, naming no argument; a meta action
    against CPU logits returned garbage."""
    logits = torch.randn(4, 5)
    for action, kw, sizes in ((torch.tensor([0, 1, 5, 2]), {}, r"\(5,\)"), (torch.tensor([0, -1, 0, 0]), {}, r"\(5,\)"),
                              (torch.tensor([[0, 3]] * 4), dict(nvec=(2, 3)), r"\(2, 3\)")):
        with pytest.raises(ShapeError, match=rf"^action: expected values in \[0, n\) for head sizes {sizes}, got one outside"):
            categorical_log_prob(logits, action, **kw)
    with pytest.raises(ShapeError, match="^action is on meta but logits are on cpu$"):
        categorical_log_prob(logits, torch.zeros(4, dtype=torch.long, device="meta"))


def test_fractional_head_sizes_are_refused():
    # nvec=(2.5, 2.5) was read as (2, 2), and the error then blamed a sum the user had not passed
    from rlfunc.core.distributions import categorical_entropy

    with pytest.raises(ConfigError, match=r"nvec=\(2.5, 2.5\): expected integer head sizes"):
        categorical_entropy(torch.zeros(3, 5), nvec=(2.5, 2.5))
    assert categorical_entropy(torch.zeros(3, 5), nvec=(2, 3)).shape == (3, 1)

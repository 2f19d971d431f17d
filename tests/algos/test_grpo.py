"""GRPO / GSPO: group-relative advantages, the two losses, grouped rollouts and a short training run."""

from __future__ import annotations

import math

import pytest
import torch

from rlfunc.config import replace
from rlfunc.core.returns import group_relative_advantage
from rlfunc.errors import ConfigError, EnvError, ShapeError
from rlfunc.losses.grpo import grpo_loss, k3_kl, masked_aggregate
from rlfunc.losses.gspo import gspo_loss

# ---------------------------------------------------------------------------------------------
# Advantages


def test_advantage_issue_vector():
    # mean 0.25, unbiased std 0.5: (1 - 0.25) / 0.5 = 1.5, (0 - 0.25) / 0.5 = -0.5
    a = group_relative_advantage(torch.tensor([1.0, 0.0, 0.0, 0.0]), eps=0.0)
    torch.testing.assert_close(a, torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # the default eps (1e-4) only shrinks it slightly
    a = group_relative_advantage(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(a, torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-4))


def test_advantage_population_std_and_group_dim():
    r = torch.tensor([[1.0, 3.0], [0.0, 5.0], [0.0, 7.0], [0.0, 9.0]])  # groups along dim 0
    a = group_relative_advantage(r, group_dim=0, unbiased=False, eps=0.0)
    # column 0: mean .25, population std sqrt(3)/4 -> .75 / .4330 = sqrt(3)
    torch.testing.assert_close(a[:, 0], torch.tensor([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]))
    # column 1: 3, 5, 7, 9: mean 6, population std sqrt(5)
    torch.testing.assert_close(a[:, 1], torch.tensor([-3.0, -1.0, 1.0, 3.0]) / math.sqrt(5))


def test_advantage_all_equal_group_is_exactly_zero():
    # the float mean of three 0.1s is not 0.1; the result must still be exactly 0, for every std mode
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 2.0, 3.0]])
    for std in ("group", "batch", "none"):
        for eps in (0.0, 1e-4):
            a = group_relative_advantage(r, std=std, eps=eps)
            assert torch.equal(a[0], torch.zeros(3)), (std, eps)
            assert a[1].isfinite().all() and a[1, 0] < 0 < a[1, 2]


def test_advantage_group_of_one_is_zero():
    r = torch.tensor([[3.0], [-2.0]])
    for std in ("group", "batch", "none"):
        for unbiased in (True, False):
            a = group_relative_advantage(r, std=std, eps=0.0, unbiased=unbiased)
            assert torch.equal(a, torch.zeros(2, 1)), (std, unbiased)
    # a single reward in the whole batch as well
    assert torch.equal(group_relative_advantage(torch.tensor([5.0]), std="batch", eps=0.0), torch.zeros(1))


def test_advantage_batch_std():
    r = torch.tensor([[1.0, 0.0], [5.0, 5.0]])
    std = math.sqrt(((1 - 2.75) ** 2 + 2.75**2 + 2 * 2.25**2) / 3)  # unbiased std of all four
    a = group_relative_advantage(r, std="batch", eps=0.0)
    torch.testing.assert_close(a, torch.tensor([[0.5 / std, -0.5 / std], [0.0, 0.0]]))


def test_advantage_no_std_dr_grpo():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [10.0, 20.0, 30.0, 40.0]])
    a = group_relative_advantage(r, std="none")
    torch.testing.assert_close(a, torch.tensor([[0.75, -0.25, -0.25, -0.25], [-15.0, -5.0, 5.0, 15.0]]))


def test_advantage_keeps_dtype_and_refuses_bad_input():
    assert group_relative_advantage(torch.tensor([1.0, 2.0], dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="std="):
        group_relative_advantage(torch.ones(2, 3), std="global")
    with pytest.raises(ConfigError, match="eps="):
        group_relative_advantage(torch.ones(2, 3), eps=-1.0)
    with pytest.raises(ShapeError, match="floating"):
        group_relative_advantage(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ShapeError, match="group_dim"):
        group_relative_advantage(torch.ones(2, 3), group_dim=2)
    with pytest.raises(ShapeError, match="reward"):
        group_relative_advantage(torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------
# GRPO loss, hand-computed
#
# Two sequences, T = 3. Sequence 0: 3 valid steps, ratios 1.5, 0.5, 1.0, advantage 2.
# Sequence 1: 1 valid step, ratio 0.5, advantage -1; its two padding steps hold NaN.
# Per-step objective min(r A, clip(r, 0.8, 1.2) A):
#   seq 0: min(3.0, 2.4) = 2.4 (clipped above), min(1.0, 1.6) = 1.0, 2.0
#   seq 1: min(-0.5, -0.8) = -0.8 (clipped below)


def _case():
    log_ratio = torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [math.log(0.5), 0.0, 0.0]])
    log_prob = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, float("nan"), float("nan")]])
    sample_log_prob = log_prob - log_ratio
    mask = torch.tensor([[True, True, True], [True, False, False]])
    advantage = torch.tensor([2.0, -1.0]).view(2, 1, 1)
    # reference log-probs: d = ref - logp = ln 2, 0, -ln 2 | ln 2
    d = torch.tensor([[math.log(2.0), 0.0, -math.log(2.0)], [math.log(2.0), 0.0, 0.0]])
    ref = log_prob + d
    col = lambda x: x.unsqueeze(-1)  # noqa: E731
    return col(log_prob), col(sample_log_prob), advantage, col(mask), col(ref)


@pytest.mark.parametrize(
    "aggregation, expected",
    [("token", (2.4 + 1.0 + 2.0 - 0.8) / 4), ("sequence", ((2.4 + 1.0 + 2.0) / 3 - 0.8) / 2), ("constant", 4.6 / 6)],
)
def test_grpo_loss_hand_values(aggregation, expected):
    log_prob, old, adv, mask, _ = _case()
    loss, m = grpo_loss(log_prob, old, adv, mask, clip_epsilon=0.2, aggregation=aggregation)
    torch.testing.assert_close(loss, torch.tensor(-expected))
    torch.testing.assert_close(m["clip_fraction"], torch.tensor(0.75))
    torch.testing.assert_close(m["ratio_mean"], torch.tensor((1.5 + 0.5 + 1.0 + 0.5) / 4))
    # approx KL (k3 of old vs new): (r - 1) - log r
    k = lambda r: (r - 1) - math.log(r)  # noqa: E731
    torch.testing.assert_close(m["approx_kl"], torch.tensor((k(1.5) + 2 * k(0.5)) / 4))
    assert m["kl_ref"] == 0 and m["loss_kl"] == 0


def test_grpo_loss_clip_higher():
    log_prob, old, adv, mask, _ = _case()
    # eps_high = 0.6: ratio 1.5 lies inside [0.8, 1.6], so the first step gives 3.0 instead of 2.4
    loss, m = grpo_loss(log_prob, old, adv, mask, clip_epsilon=0.2, clip_epsilon_high=0.6)
    torch.testing.assert_close(loss, torch.tensor(-(3.0 + 1.0 + 2.0 - 0.8) / 4))
    torch.testing.assert_close(m["clip_fraction"], torch.tensor(0.5))


def test_grpo_loss_k3_kl_to_reference():
    log_prob, old, adv, mask, ref = _case()
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731
    kl = [k3(math.log(2)), 0.0, k3(-math.log(2)), k3(math.log(2))]
    assert abs(kl[0] - (2 - math.log(2) - 1)) < 1e-12 and abs(kl[2] - (0.5 + math.log(2) - 1)) < 1e-12
    loss, m = grpo_loss(log_prob, old, adv, mask, ref_log_prob=ref, kl_coef=0.1, aggregation="token")
    torch.testing.assert_close(m["kl_ref"], torch.tensor(sum(kl) / 4))
    torch.testing.assert_close(loss, torch.tensor(-(4.6 / 4) + 0.1 * sum(kl) / 4))
    loss, m = grpo_loss(log_prob, old, adv, mask, ref_log_prob=ref, kl_coef=0.1, aggregation="sequence")
    torch.testing.assert_close(m["loss_kl"], torch.tensor(0.1 * (sum(kl[:3]) / 3 + kl[3]) / 2))
    torch.testing.assert_close(k3_kl(torch.tensor(0.3), torch.tensor(0.3)), torch.tensor(0.0))


def test_grpo_loss_padding_is_ignored_and_gets_no_gradient():
    log_prob, old, adv, mask, ref = _case()
    lp = log_prob.clone().requires_grad_(True)
    loss, _ = grpo_loss(lp, old, adv, mask, ref_log_prob=ref, kl_coef=0.1)
    loss.backward()
    assert loss.isfinite() and lp.grad.isfinite().all()
    assert torch.equal(lp.grad[1, 1:], torch.zeros(2, 1))
    # clipped steps get no surrogate gradient: (0, 0) above the clip with A > 0, (1, 0) below with A < 0
    lp2 = log_prob.clone().requires_grad_(True)
    grpo_loss(lp2, old, adv, mask, aggregation="token")[0].backward()
    assert lp2.grad[0, 0, 0] == 0 and lp2.grad[1, 0, 0] == 0
    # unclipped step (0, 1): d(-r A / 4) / d logp = -r A / 4 = -0.5 * 2 / 4
    torch.testing.assert_close(lp2.grad[0, 1, 0], torch.tensor(-0.25))


def test_masked_aggregate_without_valid_steps_is_zero():
    x = torch.full((2, 3, 1), float("nan"))
    mask = torch.zeros(2, 3, 1, dtype=torch.bool)
    for agg in ("token", "sequence", "constant"):
        assert masked_aggregate(x, mask, agg) == 0


def test_grpo_loss_refuses_bad_input():
    log_prob, old, adv, mask, ref = _case()
    with pytest.raises(ShapeError, match="sample_log_prob"):
        grpo_loss(log_prob, old[:, :2], adv, mask)
    with pytest.raises(ShapeError, match="advantage"):
        grpo_loss(log_prob, old, adv.view(2), mask)
    with pytest.raises(ShapeError, match="log_prob"):
        grpo_loss(log_prob.squeeze(-1), old.squeeze(-1), adv, mask)
    with pytest.raises(ConfigError, match="ref_log_prob"):
        grpo_loss(log_prob, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ConfigError, match="clip_epsilon"):
        grpo_loss(log_prob, old, adv, mask, clip_epsilon=0.0)
    with pytest.raises(ConfigError, match="aggregation"):
        grpo_loss(log_prob, old, adv, mask, aggregation="sum")
    with pytest.raises(ConfigError, match="kl_coef"):
        grpo_loss(log_prob, old, adv, mask, ref_log_prob=ref, kl_coef=-1.0)


# ---------------------------------------------------------------------------------------------
# GSPO loss, hand-computed
#
# Sequence ratios of the same case: s_0 = (1.5 * 0.5 * 1.0)^(1/3) = 0.75^(1/3) = 0.908560 (3 valid
# steps), s_1 = 0.5 (1 valid step; the padding is ignored).


def test_gspo_sequence_ratio_by_hand():
    log_prob, old, adv, mask, _ = _case()
    s0, s1 = 0.75 ** (1 / 3), 0.5
    # clip 0.2: s_0 inside, A > 0 -> s_0 A; s_1 below, A < 0 -> min(-0.5, -0.8) = -0.8
    loss, m = gspo_loss(log_prob, old, adv, mask, clip_epsilon=0.2, clip_epsilon_high=0.2)
    torch.testing.assert_close(loss, torch.tensor(-(2 * s0 - 0.8) / 2))
    torch.testing.assert_close(m["ratio_mean"], torch.tensor((s0 + s1) / 2))
    torch.testing.assert_close(m["clip_fraction"], torch.tensor(0.5))
    # paper's clip (3e-4, 4e-4): both outside; s_0 < 1 - 3e-4 with A > 0 keeps the unclipped s_0 A
    loss, m = gspo_loss(log_prob, old, adv, mask)
    torch.testing.assert_close(loss, torch.tensor(-(2 * s0 - (1 - 3e-4)) / 2))
    torch.testing.assert_close(m["clip_fraction"], torch.tensor(1.0))


def test_gspo_ratio_vector_near_one_and_upper_clip():
    # one group of three sequences of lengths 4, 2, 1; mean log-ratios 2e-4, 1e-3, -1e-3
    T = 4
    lr = torch.zeros(3, T)
    lr[0] = torch.tensor([1e-4, 3e-4, 2e-4, 2e-4])
    lr[1, :2] = torch.tensor([0.0, 2e-3])
    lr[2, 0] = -1e-3
    lengths = torch.tensor([4, 2, 1])
    mask = (torch.arange(T) < lengths.unsqueeze(1)).unsqueeze(-1)
    log_prob = torch.zeros(3, T, 1)
    old = log_prob - lr.unsqueeze(-1)
    s = torch.tensor([math.exp(2e-4), math.exp(1e-3), math.exp(-1e-3)])
    adv = torch.tensor([1.0, 1.0, -1.0]).view(3, 1, 1)
    loss, m = gspo_loss(log_prob, old, adv, mask)  # clip [1 - 3e-4, 1 + 4e-4]
    # s_0 inside -> s_0; s_1 above with A > 0 -> 1 + 4e-4; s_2 below with A < 0 -> -(1 - 3e-4)
    expected = -(s[0] + (1 + 4e-4) - (1 - 3e-4)) / 3
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float32))
    torch.testing.assert_close(m["ratio_mean"], s.mean())
    torch.testing.assert_close(m["clip_fraction"], torch.tensor(2 / 3))


def test_gspo_gradient_by_hand():
    log_prob, old, adv, mask, _ = _case()
    lp = log_prob.clone().requires_grad_(True)
    gspo_loss(lp, old, adv, mask, clip_epsilon=0.2, clip_epsilon_high=0.2)[0].backward()
    # unclipped sequence 0: d(-s_0 A_0 / 2) / d logp_t = -A_0 s_0 / (2 |y_0|) at each of its steps
    s0 = 0.75 ** (1 / 3)
    torch.testing.assert_close(lp.grad[0, :, 0], torch.full((3,), -2 * s0 / 6))
    assert torch.equal(lp.grad[1], torch.zeros(3, 1))  # clipped, and padding


def test_gspo_token_variant_equals_gspo_for_sequence_advantages():
    torch.manual_seed(0)
    log_prob = torch.randn(3, 4, 5, 1)
    old = log_prob + 0.05 * torch.randn(3, 4, 5, 1)
    mask = torch.rand(3, 4, 5, 1) > 0.3
    adv = torch.randn(3, 4, 1, 1)
    ref = log_prob + 0.1 * torch.randn(3, 4, 5, 1)
    grads = []
    for variant in ("sequence", "token"):
        lp = log_prob.clone().requires_grad_(True)
        loss, _ = gspo_loss(lp, old, adv, mask, clip_epsilon=0.03, clip_epsilon_high=0.04, variant=variant,
                            ref_log_prob=ref, kl_coef=0.05)
        loss.backward()
        grads.append((loss.detach(), lp.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    with pytest.raises(ShapeError, match="advantage"):
        gspo_loss(log_prob, old, adv.expand(3, 4, 5, 1), mask)  # per-step advantages need variant="token"
    with pytest.raises(ConfigError, match="variant"):
        gspo_loss(log_prob, old, adv, mask, variant="chunk")


# ---------------------------------------------------------------------------------------------
# Gradients against a float64 loop


def _reference_loss(lp, old, adv, mask, ref, eps_low, eps_high, beta, loss_name, aggregation):
    """Plain loops in torch.double, written for clarity."""
    B, T = lp.shape[0], lp.shape[1]
    if loss_name == "grpo":
        terms, per_seq = [], []
        for i in range(B):
            seq = []
            for t in range(T):
                if mask[i, t]:
                    r = torch.exp(lp[i, t] - old[i, t])
                    a = adv[i]
                    obj = torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
                    d = ref[i, t] - lp[i, t]
                    seq.append(obj - beta * (torch.exp(d) - d - 1))
            terms += seq
            if seq:
                per_seq.append(sum(seq) / len(seq))
        if aggregation == "token":
            return -sum(terms) / len(terms)
        return -sum(per_seq) / len(per_seq)
    total, kls = 0.0, []
    n = 0
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        if not idx:
            continue
        s = torch.exp(sum(lp[i, t] - old[i, t] for t in idx) / len(idx))
        total = total + torch.minimum(s * adv[i], torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv[i])
        kls.append(sum(torch.exp(ref[i, t] - lp[i, t]) - (ref[i, t] - lp[i, t]) - 1 for t in idx) / len(idx))
        n += 1
    return -total / n + beta * sum(kls) / n


@pytest.mark.parametrize("loss_name, aggregation", [("grpo", "token"), ("grpo", "sequence"), ("gspo", "sequence")])
def test_gradients_match_float64_loop(loss_name, aggregation):
    g = torch.Generator().manual_seed(3)
    B, T = 6, 7
    lp = torch.randn(B, T, generator=g)
    old = lp + 0.15 * torch.randn(B, T, generator=g)
    ref = lp + 0.2 * torch.randn(B, T, generator=g)
    lengths = torch.tensor([7, 1, 4, 0, 6, 3])
    mask = torch.arange(T) < lengths.unsqueeze(1)
    adv = torch.randn(B, generator=g)
    eps_low, eps_high = (0.1, 0.15) if loss_name == "grpo" else (0.02, 0.03)
    beta = 0.2

    lp32 = lp.clone().unsqueeze(-1).requires_grad_(True)
    fn = grpo_loss if loss_name == "grpo" else gspo_loss
    kw = {"aggregation": aggregation} if loss_name == "grpo" else {}
    loss, _ = fn(lp32, old.unsqueeze(-1), adv.view(B, 1, 1), mask.unsqueeze(-1), clip_epsilon=eps_low,
                 clip_epsilon_high=eps_high, ref_log_prob=ref.unsqueeze(-1), kl_coef=beta, **kw)
    loss.backward()

    lp64 = lp.to(torch.double).requires_grad_(True)
    ref_loss = _reference_loss(lp64, old.double(), adv.double(), mask, ref.double(), eps_low, eps_high, beta,
                               loss_name, aggregation)
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp32.grad.squeeze(-1).double(), lp64.grad, rtol=1e-4, atol=1e-6)
    assert lp64.grad.abs().sum() > 0  # not vacuous


# ---------------------------------------------------------------------------------------------
# Grouped rollouts


def _random_policy(act_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)

    def policy(observation):
        a = torch.randn(observation.shape[0], act_dim, generator=g)
        return a, -0.5 * a.square().sum(-1, keepdim=True)

    return policy


def _assert_grouped_starts(obs):
    """obs [n_groups, G, T, D]: identical starts within a group, different across groups, then divergence."""
    first = obs[:, :, 0]
    assert torch.equal(first, first[:, :1].expand_as(first))
    assert not torch.equal(first[0, 0], first[1, 0])
    assert not torch.equal(obs[:, 0, 2], obs[:, 1, 2])  # the sampled actions made them diverge


def test_grouped_rollout_gym_same_seed_per_group():
    from rlfunc.envs import collect
    from rlfunc.envs.grouped import grouped_rollout_gym, sequence_return

    venv = collect.make_vec_env("Pendulum-v1", 6)
    try:
        batch = grouped_rollout_gym(venv, _random_policy(1, 0), [11, 12], 3, 20, device=torch.device("cpu"))
    finally:
        venv.close()
    assert batch.batch_size == (2, 3, 20)
    _assert_grouped_starts(batch["observation"])
    assert batch["mask"].all()  # Pendulum episodes last 200 steps: all 20 are valid
    ret = sequence_return(batch)
    torch.testing.assert_close(ret, batch["next", "reward"].sum((-2, -1)))
    # the same seeds give the same starts in a new env
    venv = collect.make_vec_env("Pendulum-v1", 2)
    try:
        again = grouped_rollout_gym(venv, _random_policy(1, 1), [11, 12], 1, 1, device=torch.device("cpu"))
    finally:
        venv.close()
    torch.testing.assert_close(again["observation"][:, 0, 0], batch["observation"][:, 0, 0])


def test_grouped_rollout_gym_masks_after_first_episode():
    from rlfunc.envs import collect
    from rlfunc.envs.grouped import first_episode_mask, grouped_rollout_gym

    done = torch.tensor([[0, 0, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]).bool().unsqueeze(-1)
    expected = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]).bool().unsqueeze(-1)
    assert torch.equal(first_episode_mask(done), expected)
    # PointReach's gym env: episodes end at success or after 30 steps; run 40 steps
    venv = collect.make_vec_env("PointReach-v0", 4)
    try:
        with pytest.raises(EnvError, match="one seed per group"):
            grouped_rollout_gym(venv, _random_policy(2, 0), [1], 2, 40, device=torch.device("cpu"))
        batch = grouped_rollout_gym(venv, _random_policy(2, 0), [1, 2], 2, 40, device=torch.device("cpu"))
    finally:
        venv.close()
    valid = batch["mask"].sum((-2, -1))
    assert (valid <= 30).all() and (valid >= 1).all()
    assert torch.equal(batch["mask"], first_episode_mask(batch["next", "done"]))


def test_grouped_rollout_torchrl_point_reach():
    from envs.point_reach import PointReachEnv
    from rlfunc.envs.grouped import grouped_reset, grouped_rollout_torchrl, sequence_return

    env = PointReachEnv(12, seed=5)
    td = grouped_rollout_torchrl(env, _random_policy(2, 0), 4, 30)
    assert td.batch_size[:2] == (3, 4) and td.batch_size[2] <= 30
    _assert_grouped_starts(td["observation"])
    assert torch.equal(td["mask"][..., 0, :], torch.ones(3, 4, 1, dtype=torch.bool))
    assert sequence_return(td).shape == (3, 4)
    # the whole hidden state (goals, start) is shared, not only the observation
    start = grouped_reset(env, 4)
    goals = env.state["goals"].view(3, 4, 2, 2)
    assert torch.equal(goals, goals[:, :1].expand_as(goals))
    assert torch.equal(start["observation"].view(3, 4, 6), start["observation"].view(3, 4, 6)[:, :1].expand(3, 4, 6))
    with pytest.raises(EnvError, match="multiple of group_size"):
        grouped_reset(env, 5)
    with pytest.raises(ShapeError, match="state"):
        env.set_state(env.state[:3])


# ---------------------------------------------------------------------------------------------
# The algorithm


def _point_reach_setup(**overrides):
    from rlfunc.algos.grpo import GRPOConfig, make_grpo
    from rlfunc.run.grpo import _rollout_fn, _spec

    config = replace(GRPOConfig(), env="PointReach-v0", num_groups=4, group_size=4, minibatch_size=16, **overrides)
    device = torch.device("cpu")
    spec = _spec(config.env)
    algo = make_grpo(config, spec, device)
    state = algo.init()
    rollout, _ = _rollout_fn(config, device)
    return config, algo, state, rollout


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_first_update_starts_at_ratio_one(loss):
    """One epoch, one minibatch: the update sees the log-probabilities the rollout recorded (same
    normaliser, same actor), so the ratio is exactly 1 and nothing is clipped."""
    from rlfunc.run.ppo import _generators

    config, algo, state, rollout = _point_reach_setup(loss=loss, num_epochs=1, kl_coef=0.1)
    gens = _generators(state, torch.device("cpu"))
    batch = rollout(algo.policy(state, gens), 0).reshape(1, 4, 4, -1)
    before = state["params", "actor"].clone()
    state, metrics = algo.iteration(state, batch, gens)
    assert metrics["approx_kl"].abs().item() < 1e-6 and abs(metrics["ratio_mean"].item() - 1) < 1e-5
    assert metrics["clip_fraction"].item() == 0 and metrics["kl_ref"].abs().item() < 1e-6
    # the actor moved, the frozen reference did not, and the normaliser saw the valid steps
    assert not torch.equal(before["0", "weight"], state["params", "actor", "0", "weight"])
    assert torch.equal(before["0", "weight"], state["ref_params", "actor", "0", "weight"])
    assert state["obs_stats", "count"].item() == batch["mask"].sum().item()
    assert int(state["env_steps"]) == 16 * batch.batch_size[-1]
    assert metrics["episode_return"].isfinite().all()


def test_grpo_config_refuses_bad_values():
    from rlfunc.algos.grpo import GRPOConfig

    with pytest.raises(ConfigError, match="minibatch_size"):
        GRPOConfig(minibatch_size=7)
    with pytest.raises(ConfigError, match="backend"):
        GRPOConfig(env="Pendulum-v1", backend="torch")
    with pytest.raises(ConfigError, match="gspo_clip_epsilon"):
        GRPOConfig(gspo_clip_epsilon=0.0)
    with pytest.raises(ConfigError, match="group_size"):
        GRPOConfig(group_size=0)
    with pytest.raises(ConfigError, match="activation"):
        GRPOConfig(activation="gelu")


def test_grpo_improves_point_reach(tmp_path):
    """A short GRPO run on the torch-batched PointReach-v0 (fixed seed) raises the deterministic
    return from about -0.3 (standing still) by more than 1 (the success bonus alone is 1)."""
    from rlfunc.algos.grpo import GRPOConfig
    from rlfunc.run import train
    from rlfunc.run.grpo import _spec, evaluate_policy, make_grpo

    config = replace(GRPOConfig(), env="PointReach-v0", total_steps=46_080, num_groups=16, group_size=8, minibatch_size=32,
                        checkpoint_every=0, eval_episodes=20, seed=0)
    device = torch.device("cpu")
    spec = _spec(config.env)
    before = evaluate_policy(config, make_grpo(config, spec, device).init(), spec, device, 20, 0)["mean"]
    result = train(config, tmp_path / "run", progress=False, tensorboard=False)
    after = result.evaluation["mean"]
    assert before < -0.2 and after > before + 1.0, (before, after)
    for name in ("config.json", "metrics.jsonl", "eval.json", "learning_curve.png"):
        assert (tmp_path / "run" / name).is_file()


def test_cli_train_and_eval_gspo(tmp_path, capsys):
    import json

    from rlfunc.cli.commands import main

    run = tmp_path / "gspo"
    assert main(["train", "gspo", "--env", "PointReach-v0", "--total-steps", "1000", "--num-groups", "4",
                 "--group-size", "4", "--minibatch-size", "8", "--eval-episodes", "3", "--run-dir", str(run)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["episodes"] == 3 and math.isfinite(out["mean"])
    assert main(["eval", str(run), "--episodes", "3"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["mean"] == pytest.approx(out["mean"])  # same snapshot, same seed
    # eval.json and `rlfunc eval` name the algorithm (they did not for grpo/gspo, mappo, ppo-encoder)
    assert out["algo"] == again["algo"] == json.loads((run / "eval.json").read_text())["algo"] == "gspo"
    assert main(["train", "grpo", "--env", "PointReach-v0", "--loss", "gspo", "--run-dir", str(tmp_path / "x")]) == 2
    capsys.readouterr()
    assert main(["resume", str(run)]) == 0  # a finished run: nothing left to train, evaluated again
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["mean"] == pytest.approx(out["mean"]) and resumed["algo"] == "gspo"
    # as if saved on the other device type (CPU generator states are 5056 bytes, CUDA ones 16): evaluation
    # loads it (it failed on the states' shapes), resume names the device type to resume on
    from rlfunc.run import checkpoint

    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    rng = state["learner", "rng"]
    other = 16 if rng.shape[-1] == checkpoint.CPU_GENERATOR_STATE_BYTES else checkpoint.CPU_GENERATOR_STATE_BYTES
    state["learner", "rng"] = torch.zeros(*rng.shape[:-1], other, dtype=torch.uint8)
    checkpoint.save_snapshot(snap, state, meta)
    assert main(["eval", str(run), "--episodes", "3"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mean"] == pytest.approx(out["mean"])
    assert main(["resume", str(run)]) == 2 and "saved on another device type" in capsys.readouterr().err
    # a learner that does not fit its config: evaluation raised a RuntimeError (a traceback) on the shape, and
    # evaluated a missing leaf at its initial values without a word
    state["learner", "rng"] = torch.zeros(rng.shape[0] + 1, other, dtype=torch.uint8)  # another seed count as well
    checkpoint.save_snapshot(snap, state, meta)
    assert main(["eval", str(run), "--episodes", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "learner key 'rng' is" in err[0] and f"({rng.shape[0] + 1}, {other})" in err[0]
    state["learner", "rng"] = rng
    params = state["learner", "params"].flatten_keys(".")
    leaf = sorted(params.keys())[0]
    del params[leaf]
    state["learner", "params"] = params.unflatten_keys(".")
    checkpoint.save_snapshot(snap, state, meta)
    assert main(["eval", str(run), "--episodes", "3"]) == 2
    assert "is missing in the snapshot" in capsys.readouterr().err


def test_train_grpo_gym_backend_and_seeds(tmp_path):
    """Pendulum through the gymnasium path: groups share reset seeds, new seeds every iteration."""
    from rlfunc.algos.grpo import GRPOConfig
    from rlfunc.run import train
    from rlfunc.run.grpo import _rollout_fn, group_seeds

    assert group_seeds(0, 0, 3) != group_seeds(0, 1, 3) and len(set(group_seeds(0, 0, 3))) == 3
    config = replace(GRPOConfig(), env="Pendulum-v1", num_groups=2, group_size=3, minibatch_size=3, max_episode_steps=5,
                        total_steps=60, num_seeds=2, checkpoint_every=0, eval_episodes=2, kl_coef=0.1)
    assert not config.use_torch_env and config.num_iterations == 2
    rollout, close = _rollout_fn(config, torch.device("cpu"))
    try:
        from rlfunc.algos.grpo import make_grpo
        from rlfunc.run.grpo import _spec

        algo = make_grpo(config, _spec(config.env), torch.device("cpu"))
        state = algo.init()
        gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
        first = rollout(algo.policy(state, gens), 0)["observation"][..., 0, :]  # [S, n, G, D]
        second = rollout(algo.policy(state, gens), 1)["observation"][..., 0, :]
    finally:
        close()
    assert first.shape == (2, 2, 3, 3)
    assert torch.equal(first, first[:, :, :1].expand_as(first)) and not torch.equal(first, second)
    result = train(config, tmp_path / "run", progress=False, tensorboard=False)
    assert result.evaluation["episodes"] == 2 and len(result.evaluation["per_seed_mean"]) == 2
    assert result.evaluation["pooled_episodes"] == 4  # what mean, std and ci95 are over
    assert int(result.state["env_steps"]) == 2 * 6 * 5


def test_grpo_gym_backend_in_env_workers_equals_in_process(tmp_path, capsys):
    """gspo on Pendulum-v1's gymnasium envs, 2 seeds x 2 groups x 2 members in 2 worker processes: the
    learner state after 2 iterations equals the in-process run's, tensor for tensor (every iteration
    resets the envs with its group seeds, so there is no env state to carry); the final evaluation
    too. A count that does not divide, or workers on the torch-batched env, is one line."""
    from rlfunc.algos.grpo import GRPOConfig
    from rlfunc.cli.commands import main
    from rlfunc.run import train

    config = replace(GRPOConfig(), env="Pendulum-v1", loss="gspo", num_groups=2, group_size=2, minibatch_size=2,
                     max_episode_steps=6, total_steps=2 * 24, num_seeds=2, checkpoint_every=0, eval_episodes=2, device="cpu")
    inline = train(config, tmp_path / "inline", progress=False, tensorboard=False)
    workers = train(replace(config, env_workers=2), tmp_path / "workers", progress=False, tensorboard=False)
    a, b = (dict(r.state.items(include_nested=True, leaves_only=True)) for r in (inline, workers))
    assert int(inline.state["iteration"]) == 2 and a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert inline.evaluation == workers.evaluation
    with pytest.raises(ConfigError, match=r"run.env_workers=3: num_envs=8 \(num_groups=2 x group_size=2 x num_seeds=2\) is not divisible"):
        replace(config, env_workers=3)
    with pytest.raises(ConfigError, match="run.env_workers=2: env='PointReach-v0' is a torch-batched env"):
        replace(config, env="PointReach-v0", env_workers=2)
    code = main(["train", "gspo", "--env", "PointReach-v0", "--env-workers", "2", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "torch-batched" in err[0]


def test_grpo_gym_backend_seed_k_of_a_batch_resets_as_the_run_of_seed_k_alone(tmp_path):
    # The bug: the reset seeds of every seed's groups came from the first seed's stream, so seed k of
    # `--num-seeds N --seed s` was not the run of seed s + k (its episodes, hence its whole run, differed)
    from rlfunc.algos.grpo import GRPOConfig, make_grpo
    from rlfunc.run import train
    from rlfunc.run.grpo import _rollout_fn, _spec

    base = dict(env="Pendulum-v1", num_groups=2, group_size=2, minibatch_size=2, max_episode_steps=5, total_steps=40,
                checkpoint_every=0, eval_episodes=2, device="cpu", version_every=0)
    pair, alone = replace(GRPOConfig(), seed=3, num_seeds=2, **base), replace(GRPOConfig(), seed=4, **base)
    starts = []
    for config in (pair, alone):
        rollout, close = _rollout_fn(config, torch.device("cpu"))
        try:
            algo = make_grpo(config, _spec(config.env), torch.device("cpu"))
            gens = [torch.Generator().manual_seed(s) for s in config.seeds]
            starts.append([rollout(algo.policy(algo.init(), gens), i)["observation"][..., 0, :] for i in (0, 1)])
        finally:
            close()
    for i in (0, 1):  # [S, n, G, obs]: the pair's second seed starts its episodes where seed 4 alone does
        assert torch.equal(starts[0][i][1], starts[1][i][0]) and not torch.equal(starts[0][i][0], starts[0][i][1])
    runs = [train(c, tmp_path / str(k), progress=False, tensorboard=False) for k, c in enumerate((pair, alone))]
    torch.testing.assert_close(runs[0].evaluation["per_seed_mean"][1], runs[1].evaluation["per_seed_mean"][0], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("loss, field, value", [("grpo", "gspo_variant", "token"), ("grpo", "gspo_clip_epsilon", 0.5),
                                                ("gspo", "aggregation", "constant"), ("gspo", "clip_epsilon", 0.9),
                                                ("gspo", "clip_epsilon_high", 5.0)])
def test_the_other_losss_settings_are_refused(loss, field, value):
    """Flags pass: `rlfunc train grpo --gspo-variant token --gspo-clip-epsilon 0.5` and `rlfunc train gspo
    --aggregation constant --clip-epsilon 0.9` trained exactly as without them (config.json recorded them)."""
    from rlfunc.algos.grpo import preset

    other = "gspo" if loss == "grpo" else "grpo"
    with pytest.raises(ConfigError, match=rf"{field}={value!r}: a setting of {other}, which loss='{loss}' does not read"):
        preset("Pendulum-v1", loss, **{field: value})
    assert getattr(preset("Pendulum-v1", other, **{field: value}), field) == value  # its own loss takes it
    # a run saved with it before the check (it trained as without it) still loads, to evaluate and resume
    import dataclasses

    assert getattr(dataclasses.replace(preset("Pendulum-v1", loss), **{field: value}), field) == value


def test_a_new_run_from_python_refuses_the_other_losss_setting(tmp_path):
    """New-user pass: train(GRPOConfig(loss="gspo", aggregation="sequence", clip_epsilon=0.5), run_dir) trained
    exactly as without the two (metrics identical), where preset() and the CLI refuse them."""
    import dataclasses

    from rlfunc.algos.grpo import GRPOConfig
    from rlfunc.run import train

    config = GRPOConfig(env="PointReach-v0", loss="gspo", num_groups=2, group_size=2, minibatch_size=2, num_epochs=1,
                        total_steps=60, aggregation="sequence")
    with pytest.raises(ConfigError, match=r"aggregation='sequence': a setting of grpo, which loss='gspo' does not read"):
        train(config, tmp_path / "r", progress=False, tensorboard=False)
    done = train(dataclasses.replace(config, aggregation="token"), tmp_path / "ok", progress=False, tensorboard=False,
                 evaluate=False)
    assert int(done.state["iteration"]) == 1


def test_the_cli_refuses_the_other_losss_flag(tmp_path, capsys):
    from rlfunc.cli.commands import main

    assert main(["train", "gspo", "--env", "Pendulum-v1", "--aggregation", "constant", "--run-dir", str(tmp_path / "r")]) == 2
    assert "aggregation='constant': a setting of grpo, which loss='gspo' does not read" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_masked_aggregate_refuses_a_mask_it_would_broadcast_and_takes_a_number_mask():
    """New-user pass: a [B, T] mask beside [B, T, 1] values broadcast to [B, T, T] and gave a "mean" of 30
    for values 0..15 (silently); a 0/1 integer mask, which the losses take, was torch.where's RuntimeError."""
    x = torch.arange(16.0).view(4, 4, 1)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[:, 2:] = False
    want = x[:, :2].mean()  # 6.5: the valid steps' mean
    assert masked_aggregate(x, mask[..., None], "token") == want
    assert masked_aggregate(x, mask[..., None].long(), "token") == want
    for bad in (mask, mask[:3, :, None], mask.view(16)):
        with pytest.raises(ShapeError, match=r"^masked_aggregate: mask has shape .*: expected a \[\*B, T, 1\] mask"):
            masked_aggregate(x, bad, "token")


@pytest.mark.parametrize("loss", [grpo_loss, gspo_loss])
@pytest.mark.parametrize("name, value", [("clip_epsilon", "0.2"), ("clip_epsilon_high", "x"), ("kl_coef", "0.1"),
                                         ("clip_epsilon", True)])
def test_a_non_numeric_loss_setting_names_itself(loss, name, value):
    """New-user pass: grpo_loss(..., clip_epsilon="0.2") was "TypeError: '<' not supported between instances
    of 'float' and 'str'", naming nothing."""
    lp = torch.zeros(2, 3, 1)
    with pytest.raises(ConfigError, match=rf": {name}={value!r}: expected a number$"):
        loss(lp, lp, torch.zeros(2, 1, 1), **{name: value})


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_an_env_it_cannot_train_on_is_named_with_this_algorithm(loss):
    # new-user pass (gymnasium envs): grpo on FrozenLake-v1 printed PPO's message (which offers Discrete
    # actions: a user who flattened the observations was then told "grpo needs Box actions"); gspo called
    # itself grpo
    from rlfunc.run.grpo import _spec

    with pytest.raises(EnvError, match=rf"^env='FrozenLake-v1': {loss} needs Box observations and Box actions; got Discrete observations"):
        _spec("FrozenLake-v1", loss)
    with pytest.raises(EnvError, match=rf"^env='CartPole-v1': {loss} needs Box actions; got Discrete actions"):
        _spec("CartPole-v1", loss)


def test_group_relative_advantage_refuses_a_float_group_dim():
    """Regression (functional-core pass): group_dim=1.0 was a TypeError from a modulo deep inside."""
    from rlfunc.errors import ShapeError

    with pytest.raises(ShapeError, match="group_dim=1.0: expected an int"):
        group_relative_advantage(torch.ones(2, 4), group_dim=1.0)
    import numpy as np

    torch.testing.assert_close(group_relative_advantage(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), group_dim=np.int64(1), std="none"),
                               torch.tensor([[0.5, -0.5], [-0.5, 0.5]]))


def test_a_non_finite_episode_return_is_left_out_of_the_metrics_mean():
    # Regression (review pass): one sequence's NaN reward made the line's episode_return NaN (ppo's line leaves
    # such an episode out).
    from rlfunc.envs.grouped import sequence_return
    from rlfunc.run.ppo import _generators

    config, algo, state, rollout = _point_reach_setup(loss="grpo", num_epochs=1)
    gens = _generators(state, torch.device("cpu"))
    batch = rollout(algo.policy(state, gens), 0).reshape(1, 4, 4, -1)
    batch["next", "reward"][0, 1, 2, 0] = float("nan")  # the first step of group 1's sequence 2 (every sequence has one)
    returns = sequence_return(batch).flatten()
    assert int(returns.isfinite().sum()) == 15
    _, metrics = algo.iteration(state, batch, gens)
    torch.testing.assert_close(metrics["episode_return"], returns[returns.isfinite()].mean().reshape(1))

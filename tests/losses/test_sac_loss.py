"""SAC's soft target, critic, actor and temperature losses and REDQ's subset min, against hand-computed values."""

import itertools

import pytest
import torch

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.losses.sac import ensemble_min, sac_actor_loss, sac_critic_loss, soft_q_target, temperature_loss
from rlfunc.losses.td3 import td3_actor_loss, td3_target

# two states s'_1, s'_2; two target critics
NEXT_Q = torch.tensor([[[2.0], [1.0]], [[1.5], [3.0]]])  # [E=2, B=2, 1]: min over E = [1.5, 1.0]
NEXT_LOG_PROB = torch.tensor([[-1.0], [0.5]])
REWARD = torch.tensor([[1.0], [-1.0]])


def test_soft_q_target_by_hand():
    term = torch.tensor([[False], [True]])
    # V(s'_1) = 1.5 - 0.2 * (-1) = 1.7: y_1 = 1 + 0.9 * 1.7; s'_2 is terminal: y_2 = r_2
    y = soft_q_target(NEXT_Q, NEXT_LOG_PROB, REWARD, term, 0.9, 0.2)
    torch.testing.assert_close(y, torch.tensor([[2.53], [-1.0]]))
    assert not y.requires_grad
    # truncated, not terminated: bootstraps; V(s'_2) = 1.0 - 0.2 * 0.5 = 0.9
    live = torch.zeros(2, 1, dtype=torch.bool)
    torch.testing.assert_close(soft_q_target(NEXT_Q, NEXT_LOG_PROB, REWARD, live, 0.9, 0.2), torch.tensor([[2.53], [-1.0 + 0.81]]))
    # an already-reduced next_q gives the same; alpha as a (learnable) tensor is detached
    alpha = torch.tensor(0.2, requires_grad=True)
    torch.testing.assert_close(soft_q_target(NEXT_Q.min(0).values, NEXT_LOG_PROB, REWARD, term, 0.9, alpha), y)
    # n-step: the per-sample bootstrap discount gamma^n (n = 2, and n = 1 where the window was cut)
    disc = torch.tensor([[0.81], [0.9]])
    y_n = soft_q_target(NEXT_Q, NEXT_LOG_PROB, REWARD, live, 0.9, 0.2, discount=disc)
    torch.testing.assert_close(y_n, torch.tensor([[1.0 + 0.81 * 1.7], [-1.0 + 0.9 * 0.9]]))
    # alpha = 0 is TD3's target
    from rlfunc.losses.td3 import td3_target
    torch.testing.assert_close(soft_q_target(NEXT_Q, NEXT_LOG_PROB, REWARD, term, 0.9, 0.0), td3_target(NEXT_Q, REWARD, term, 0.9))


def test_soft_q_target_errors():
    term = torch.zeros(2, 1, dtype=torch.bool)
    with pytest.raises(ConfigError, match="gamma"):
        soft_q_target(NEXT_Q, NEXT_LOG_PROB, REWARD, term, 1.5, 0.2)
    with pytest.raises(ConfigError, match="alpha"):
        soft_q_target(NEXT_Q, NEXT_LOG_PROB, REWARD, term, 0.9, -0.1)
    with pytest.raises(ShapeError, match="next_q"):
        soft_q_target(NEXT_Q[:, :1], NEXT_LOG_PROB, REWARD, term, 0.9, 0.2)
    with pytest.raises(ShapeError, match="next_log_prob"):
        soft_q_target(NEXT_Q, NEXT_LOG_PROB[:1], REWARD, term, 0.9, 0.2)
    with pytest.raises(ShapeError, match="discount"):
        soft_q_target(NEXT_Q, NEXT_LOG_PROB, REWARD, term, 0.9, 0.2, discount=torch.ones(2))


def test_sac_critic_loss_by_hand():
    y = torch.tensor([[2.53], [-1.0]])
    q = torch.tensor([[[2.0], [0.0]], [[3.0], [-1.0]]], requires_grad=True)
    loss, metrics = sac_critic_loss(q, y)
    want = 0.5 * (((2 - 2.53) ** 2 + 1.0) / 2 + ((3 - 2.53) ** 2 + 0.0) / 2)
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(metrics["loss_critic"]) == pytest.approx(want, rel=1e-6)
    loss.backward()
    # d/dQ_e,i of 1/2 mean_i (Q_e,i - y_i)^2 = (Q_e,i - y_i) / B
    torch.testing.assert_close(q.grad, (q.detach() - y) / 2)
    with pytest.raises(ShapeError, match="critic_loss"):
        sac_critic_loss(q, y[:1])


def test_sac_actor_loss_by_hand():
    q_pi = torch.tensor([[[1.0], [4.0]], [[2.0], [3.0]]], requires_grad=True)  # min over E: [1, 3]
    log_prob = torch.tensor([[-1.0], [0.5]], requires_grad=True)
    loss, metrics = sac_actor_loss(q_pi, log_prob, 0.5)
    assert float(loss) == pytest.approx(((0.5 * -1 - 1) + (0.5 * 0.5 - 3)) / 2)
    assert float(metrics["entropy"]) == pytest.approx(0.25)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.full((2, 1), 0.25))
    torch.testing.assert_close(q_pi.grad, torch.tensor([[[-0.5], [0.0]], [[0.0], [-0.5]]]))  # only the min member
    # REDQ's actor: the mean over the ensemble, passed reduced
    loss_mean, _ = sac_actor_loss(q_pi.detach().mean(0), log_prob.detach(), torch.tensor(0.5))
    assert float(loss_mean) == pytest.approx(((0.5 * -1 - 1.5) + (0.5 * 0.5 - 3.5)) / 2)
    with pytest.raises(ShapeError, match="q_pi"):
        sac_actor_loss(q_pi[:, :1], log_prob, 0.5)
    with pytest.raises(ShapeError, match="log_prob"):
        sac_actor_loss(q_pi, log_prob.squeeze(-1), 0.5)


@pytest.mark.parametrize("log_prob, grows", [([1.0, 2.0], True), ([-2.0, -3.0], False)])
def test_temperature_gradient_sign(log_prob, grows):
    # target entropy -1 (one action dim); entropy estimate -mean(log_prob): -1.5 (below) or 2.5 (above)
    lp = torch.tensor(log_prob).unsqueeze(-1)
    log_alpha = torch.tensor(0.3, requires_grad=True)
    loss, metrics = temperature_loss(log_alpha, lp, target_entropy=-1.0)
    assert float(loss) == pytest.approx(-0.3 * (lp.mean().item() - 1.0))
    assert float(metrics["alpha"]) == pytest.approx(torch.tensor(0.3).exp().item())
    loss.backward()
    assert float(log_alpha.grad) == pytest.approx(-(lp.mean().item() - 1.0))  # H - H_bar
    opt = torch.optim.SGD([log_alpha], lr=0.1)
    opt.step()
    assert (float(log_alpha) > 0.3) is grows
    with pytest.raises(ShapeError, match="log_alpha"):
        temperature_loss(torch.zeros(2), lp, -1.0)


def test_ensemble_min_subset_by_hand():
    q = torch.tensor([3.0, -1.0, 2.0, 0.5, 4.0]).view(5, 1, 1).expand(5, 3, 1).contiguous()  # [E=5, B=3, 1]
    torch.testing.assert_close(ensemble_min(q), torch.full((3, 1), -1.0))
    # the subset is the first M entries of randperm(E) with the generator: one subset for the whole batch
    index = torch.randperm(5, generator=torch.Generator().manual_seed(7))[:2].tolist()
    want = min([3.0, -1.0, 2.0, 0.5, 4.0][i] for i in index)
    got = ensemble_min(q, 2, torch.Generator().manual_seed(7))
    torch.testing.assert_close(got, torch.full((3, 1), want))
    torch.testing.assert_close(ensemble_min(q, 5, torch.Generator().manual_seed(7)), ensemble_min(q))
    # over many draws every 2-subset of the 5 occurs, each with probability 1/10: the min of M = 2
    # members is -1 exactly when member 1 is drawn (probability 2/5), 4.0 never (it is the largest)
    g = torch.Generator().manual_seed(0)
    values = torch.tensor([float(ensemble_min(q, 2, g)[0, 0]) for _ in range(4000)])
    assert abs(float((values == -1.0).float().mean()) - 0.4) < 0.03  # 4 sigma at n = 4000
    assert not (values == 4.0).any()
    pair_mins = {min(a, b) for a, b in itertools.combinations([3.0, -1.0, 2.0, 0.5, 4.0], 2)}
    assert set(values.tolist()) == pair_mins
    with pytest.raises(ConfigError, match="subset"):
        ensemble_min(q, 6)
    with pytest.raises(ConfigError, match="subset"):
        ensemble_min(q, 0)


def test_temperature_loss_refuses_a_nan_target_entropy():
    with pytest.raises(ConfigError, match="target_entropy=nan"):  # the loss was NaN, silently
        temperature_loss(torch.zeros((), requires_grad=True), torch.zeros(4, 1), float("nan"))


def test_off_policy_losses_name_a_bad_argument_in_one_line():
    """New-user pass: a str or None hyperparameter was a TypeError from a comparison ("'<=' not supported
    between instances of 'float' and 'str'"), a list or a float where a tensor goes an AttributeError, an int q
    mean()'s dtype error; alpha=inf gave inf targets; smoothed_target_action took low > high (every action
    -1) and a NaN bound (every action NaN) silently, where tanh_gaussian_sample refuses them."""
    from rlfunc.losses.sac import sac_actor_loss, soft_q_target, temperature_loss
    from rlfunc.losses.td3 import critic_loss, smoothed_target_action, td3_target

    B = 4
    q, r, lp, term = torch.zeros(2, B, 1), torch.zeros(B, 1), torch.zeros(B, 1), torch.zeros(B, 1, dtype=torch.bool)
    cases = [
        (lambda: soft_q_target(q, lp, r, term, "0.99", 0.1), ConfigError, r"^gamma='0.99': expected a number$"),
        (lambda: td3_target(q, r, term, "0.99"), ConfigError, r"^gamma='0.99': expected a number$"),
        (lambda: soft_q_target(q, lp, r, term, 0.99, None), ConfigError, r"^alpha=None: expected a number$"),
        (lambda: soft_q_target(q, lp, r, term, 0.99, float("inf")), ConfigError, r"^alpha=inf: expected a finite number$"),
        (lambda: sac_actor_loss(q, lp, "x"), ConfigError, r"^alpha='x': expected a number$"),
        (lambda: temperature_loss(torch.zeros(()), lp, None), ConfigError, r"^target_entropy=None: expected a number$"),
        (lambda: smoothed_target_action(r, r, policy_noise="0.2", noise_clip=0.5), ConfigError, r"^policy_noise='0.2'"),
        (lambda: smoothed_target_action(r, r, policy_noise=float("inf"), noise_clip=0.5), ConfigError, r"^policy_noise=inf"),
        (lambda: smoothed_target_action(r, r, policy_noise=0.2, noise_clip=0.5, low=1.0, high=-1.0), ConfigError,
         r"^low=1.0, high=-1.0: expected finite bounds with low < high$"),
        (lambda: smoothed_target_action(r, r, policy_noise=0.2, noise_clip=0.5, low=float("nan"), high=1.0), ConfigError,
         r"^low=nan, high=1.0: expected finite bounds"),
        (lambda: smoothed_target_action(torch.zeros(B, 2), torch.zeros(B, 2), policy_noise=0.2, noise_clip=0.5,
                                        low=torch.zeros(3), high=torch.ones(3)), ShapeError, r"^low: last dim is 3"),
        (lambda: soft_q_target(q, lp, r, term, 0.99, 0.1, discount=0.9), ShapeError, r"^discount: 0.9, expected a float tensor"),
        (lambda: td3_target(q, r, [[False]] * B, 0.99), ShapeError, r"^td3_target: terminated: expected a tensor, got list$"),
        (lambda: td3_target(q.long(), r, term, 0.99), ShapeError, r"^td3_target: next_q torch.int64"),
        (lambda: critic_loss([1.0], r), ShapeError, r"^critic_loss: q: expected a float tensor, got list$"),
        (lambda: critic_loss(q.long(), r), ShapeError, r"^critic_loss: q: expected a float tensor, got torch.int64$"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    # what they take still works: a tensor alpha and a tensor discount, tensor bounds of the action's width
    y = soft_q_target(q + 1.0, lp, r, term, 0.99, torch.tensor(0.1), discount=torch.full((B, 1), 0.5))
    assert torch.equal(y, torch.full((B, 1), 0.5))
    a = smoothed_target_action(torch.zeros(B, 2), torch.ones(B, 2), policy_noise=0.2, noise_clip=0.5,
                               low=torch.tensor([-1.0, -0.1]), high=torch.tensor([1.0, 0.1]))
    assert torch.allclose(a, torch.tensor([[0.2, 0.1]] * B))


def test_the_other_public_losses_name_a_bad_setting():
    """Review pass: diffusion_ql_actor_loss(q_coef="x") was a TypeError and q_coef=inf a loss of -inf,
    clipped_surrogate(clip_epsilon=None) a TypeError, normalize_advantage(eps=nan) all NaN, and
    clip_schedule(rate=inf) NaN clip ranges."""
    from rlfunc.losses.dppo import clip_schedule
    from rlfunc.losses.ppo import clipped_surrogate, normalize_advantage
    from rlfunc.losses.td3 import diffusion_ql_actor_loss

    x = torch.zeros(3, 1)
    cases = [
        (lambda: diffusion_ql_actor_loss(torch.randn(4, 1), torch.tensor(0.5), q_coef="x"), r"^q_coef='x': expected a number$"),
        (lambda: diffusion_ql_actor_loss(torch.randn(4, 1), torch.tensor(0.5), bc_coef=float("inf")), r"expected finite values$"),
        (lambda: clipped_surrogate(x, x, x, None), r"^clip_epsilon=None: expected a number$"),
        (lambda: normalize_advantage(torch.randn(5), eps=float("nan")), r"^eps=nan: expected a finite number$"),
        (lambda: clip_schedule(5, 0.1, 0.2, rate=float("inf")), r"^rate=inf: expected a finite number$"),
        (lambda: clip_schedule(5, "x", 0.2), r"^clip_min='x': expected a number$"),
    ]
    for call, match in cases:
        with pytest.raises(ConfigError, match=match):
            call()
    assert clipped_surrogate(x, x, x, torch.full((3, 1), 0.2))[0].shape == (3, 1)  # a tensor clip stays unread


def test_td3_config_refuses_infinite_noise():
    """New-user pass: TD3Config(exploration_noise=inf) gave bang-bang actions, policy_noise=inf NaN smoothing
    wherever the draw was 0, where SACConfig refuses inf settings."""
    from rlfunc.algos.td3 import TD3Config

    for name in ("exploration_noise", "policy_noise"):
        with pytest.raises(ConfigError, match=rf"^{name}=inf: expected a finite value >= 0$"):
            TD3Config(**{name: float("inf")})


def test_an_empty_minibatch_or_ensemble_is_refused_not_a_nan_loss():
    """Regression (functional-core pass): the off-policy losses of an empty minibatch were NaN, silently
    (ppo_loss and dppo_loss refuse one); an ensemble of 0 critics gave td3_target's IndexError and a
    critic loss of 0."""
    from rlfunc.losses.td3 import critic_loss, diffusion_ql_actor_loss

    empty = torch.zeros(0, 1)
    for call in (lambda: critic_loss(torch.zeros(2, 0, 1), empty), lambda: sac_critic_loss(torch.zeros(2, 0, 1), empty),
                 lambda: critic_loss(torch.zeros(0, 4, 1), torch.zeros(4, 1)),
                 lambda: sac_actor_loss(torch.zeros(2, 0, 1), empty, 0.1), lambda: td3_actor_loss(empty),
                 lambda: temperature_loss(torch.zeros(()), empty, -1.0),
                 lambda: td3_target(torch.zeros(0, 4, 1), torch.zeros(4, 1), torch.zeros(4, 1, dtype=torch.bool), gamma=0.99)):
        with pytest.raises(ShapeError, match="empty minibatch|at least one sample|0 critics|E >= 1"):
            call()
    with pytest.raises(ShapeError, match="scale=2.0"):
        diffusion_ql_actor_loss(torch.ones(4, 1), torch.tensor(0.5), scale=2.0)
    loss, _ = critic_loss(torch.ones(2, 3, 1), torch.zeros(3, 1))  # a non-empty one: sum over critics of the mean square
    assert float(loss) == 2.0

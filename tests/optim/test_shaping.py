"""Gradient shaping (rlfunc.optim.shaping, rlfunc.algos.shaped): hand-made sequences, float64 references,
statistical checks with fixed generators, and PPO with every transform off == plain PPO."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from rlfunc.config import replace
from rlfunc.algos.ppo import PPOConfig, EnvSpec, SHAPING_PRESETS, make_ppo, preset
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.optim import shaping

td = lambda **kw: TensorDict(kw, batch_size=[])  # noqa: E731


# ----------------------------------------------------------------------------- oscillation damping


def test_sign_agreement_and_damping_by_hand():
    t = shaping.oscillation_damping(lr=0.1, strength=0.5, agreement_decay=0.0)
    params = td(w=torch.zeros(4))
    state = t.init(params)
    g1, g2 = torch.tensor([1.0, -1.0, 1.0, 1.0]), torch.tensor([-1.0, 1.0, -1.0, 1.0])
    u, state, m = t.update(td(w=torch.ones(4)), state, grads=td(w=g1))
    assert torch.equal(u["w"], torch.ones(4))  # no previous gradient: agreement 0, no damping
    assert m["sign_agreement"].item() == 0.0
    u, state, m = t.update(td(w=torch.ones(4)), state, grads=td(w=g2))
    # agreement mean([-1, -1, -1, 1]) = -0.5 -> factor 1 + 0.5 * (-0.5) = 0.75
    assert m["sign_agreement"].item() == -0.5
    assert torch.allclose(u["w"], torch.full((4,), 0.75))
    u, state, m = t.update(td(w=torch.ones(4)), state, grads=td(w=g2))  # consistent: untouched
    assert m["sign_agreement"].item() == 1.0 and torch.equal(u["w"], torch.ones(4))


def test_sign_agreement_ema_and_members():
    t = shaping.oscillation_damping(lr=0.1, strength=1.0, agreement_decay=0.9, member_dims=1)
    state = t.init(td(w=torch.zeros(2, 3)))
    osc = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    a_ref = torch.zeros(2)
    for step in range(4):
        g = osc.clone()
        g[0] *= (-1) ** step  # member 0 flips every step, member 1 is consistent
        u, state, m = t.update(td(w=torch.ones(2, 3)), state, grads=td(w=g))
        agree = torch.tensor([-1.0, 1.0]) if step > 0 else torch.zeros(2)
        a_ref = 0.9 * a_ref + 0.1 * agree
        assert torch.allclose(m["sign_agreement"], a_ref)
        assert torch.allclose(u["w"], (1 + a_ref.clamp(max=0)).unsqueeze(1).expand(2, 3))


def test_curvature_damping_by_hand():
    t = shaping.oscillation_damping(lr=0.1, strength=0.5, agreement_decay=0.0)
    state = t.init(td(w=torch.zeros(3), b=torch.zeros(2)))
    g = td(w=torch.full((3,), 2.0), b=torch.full((2,), 2.0))
    u, state, m = t.update(td(w=torch.ones(3), b=torch.ones(2)), state, grads=g, curvature=td(w=torch.tensor(4.0), b=torch.tensor(-3.0)))
    # rms(g) = 2 (bias-corrected EMA of a constant), newton = 0.1 * 4 / 2 = 0.2 -> 1 / 1.2; negative curvature: no damping
    assert torch.allclose(u["w"], torch.full((3,), 1 / 1.2))
    assert torch.allclose(u["b"], torch.ones(2))
    # the estimate is kept until the next one
    u, state, _ = t.update(td(w=torch.ones(3), b=torch.ones(2)), state, grads=g)
    assert torch.allclose(u["w"], torch.full((3,), 1 / 1.2))


# ----------------------------------------------------------------------------- curvature


def test_hutchinson_exact_for_diagonal_hessian():
    gen = torch.Generator().manual_seed(0)
    d1, d2 = torch.rand(5, 3, generator=gen, dtype=torch.double) * 4 - 1, torch.rand(7, generator=gen, dtype=torch.double)
    w = torch.randn(5, 3, dtype=torch.double, requires_grad=True)
    b = torch.randn(7, dtype=torch.double, requires_grad=True)
    loss = 0.5 * (d1 * w**2).sum() + 0.5 * (d2 * b**2).sum() + (w.sum() * 3)  # H = diag(d1, d2)
    grads = torch.autograd.grad(loss, [w, b], create_graph=True)
    for seed in range(3):
        probe = shaping.rademacher_like(td(w=w.detach(), b=b.detach()), torch.Generator().manual_seed(seed))
        assert set(probe["w"].unique().tolist()) <= {-1.0, 1.0}
        hv = shaping.hessian_vector_product(grads, [w, b], [probe["w"], probe["b"]])
        c = shaping.hutchinson_curvature(hv, [probe["w"], probe["b"]])
        assert torch.allclose(c[0], d1.mean(), atol=1e-12) and torch.allclose(c[1], d2.mean(), atol=1e-12)


def test_hutchinson_unbiased_for_dense_hessian():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(6, 6, generator=gen, dtype=torch.double)
    hess = a @ a.T
    x = torch.randn(6, dtype=torch.double, requires_grad=True)
    (g,) = torch.autograd.grad(0.5 * x @ hess @ x, [x], create_graph=True)
    estimates = []
    for seed in range(4000):
        v = shaping.rademacher_like(td(x=x.detach()), torch.Generator().manual_seed(seed))["x"]
        estimates.append(shaping.hutchinson_curvature(shaping.hessian_vector_product([g], [x], [v]), [v])[0])
    est = torch.stack(estimates)
    assert abs(est.mean() - hess.diagonal().mean()) < 4 * est.std() / math.sqrt(len(est))


def test_hvp_double_backward_matches_autograd_functional():
    gen = torch.Generator().manual_seed(2)
    w1 = torch.randn(4, 3, generator=gen, dtype=torch.double)
    w2 = torch.randn(2, 4, generator=gen, dtype=torch.double)
    x = torch.randn(10, 3, generator=gen, dtype=torch.double)
    v1, v2 = torch.randn(4, 3, generator=gen, dtype=torch.double), torch.randn(2, 4, generator=gen, dtype=torch.double)

    def f(a, b):
        return torch.tanh(torch.tanh(x @ a.T) @ b.T).square().sum()

    _, ref = torch.autograd.functional.hvp(f, (w1, w2), (v1, v2))
    p1, p2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    grads = torch.autograd.grad(f(p1, p2), [p1, p2], create_graph=True)
    hv = shaping.hessian_vector_product(grads, [p1, p2], [v1, v2])
    assert torch.allclose(hv[0], ref[0], atol=1e-12) and torch.allclose(hv[1], ref[1], atol=1e-12)


def test_rademacher_per_member_generators():
    params = td(w=torch.zeros(2, 50))
    probe = shaping.rademacher_like(params, [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)], member_dims=1)
    alone = shaping.rademacher_like(td(w=torch.zeros(50)), torch.Generator().manual_seed(4))
    assert torch.equal(probe["w"][1], alone["w"])  # a member's probe depends only on its generator
    with pytest.raises(ConfigError, match="generator"):
        shaping.rademacher_like(params, [torch.Generator()], member_dims=1)


# ----------------------------------------------------------------------------- adaptive clip radius


def test_clip_epsilon_decay():
    assert shaping.decayed_clip_epsilon(0.2, 0.995, 0) == 0.2
    assert shaping.decayed_clip_epsilon(0.2, 0.995, 10) == pytest.approx(0.2 * 0.995**10, rel=1e-12)
    with pytest.raises(ConfigError):
        shaping.decayed_clip_epsilon(0.2, 1.5, 1)


def test_layer_trust_region_bounds_predicted_log_ratio():
    # linear policy: log pi_i = x_i . w + z_i . b, so d log pi_i / d w = x_i, d log pi_i / d b = z_i
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])  # ||x_i||^2: 25, 0 -> s_w = sqrt(12.5)
    z = torch.tensor([[1.0], [1.0]])  # s_b = 1
    grads = td(w=x, b=z, critic=torch.zeros(2, 3))
    s = shaping.layer_sensitivity(grads)
    assert torch.allclose(s["w"], torch.tensor(math.sqrt(12.5))) and s["b"].item() == 1.0 and s["critic"].item() == 0.0
    eps = 0.2 * 0.995**3
    r = shaping.layer_radius(s, eps)
    assert torch.allclose(r["w"], torch.tensor(eps / (2 * math.sqrt(12.5)))) and torch.allclose(r["b"], torch.tensor(eps / 2))
    assert math.isinf(r["critic"].item())  # the critic cannot move the log-ratio

    anchor = td(w=torch.tensor([0.5, -0.5]), b=torch.tensor([0.1]), critic=torch.zeros(3))
    t = shaping.layer_trust_region()
    state = t.init(anchor, radius=r)
    params = anchor.clone()
    for step in range(5):  # large steps in a fixed direction
        u = td(w=torch.tensor([1.0, 2.0]), b=torch.tensor([-0.5]), critic=torch.ones(3))
        shaped, state, m = t.update(u, state, params=params)
        params = td(**{k: params[k] + shaped[k] for k in params.keys()})
        for k in ("w", "b"):
            assert (params[k] - anchor[k]).norm() <= r[k] * (1 + 1e-5)
        assert torch.equal(shaped["critic"], torch.ones(3))  # unbounded
        delta_log_ratio = x @ (params["w"] - anchor["w"]) + z @ (params["b"] - anchor["b"])  # first order, exact here
        assert delta_log_ratio.square().mean().sqrt() <= eps * (1 + 1e-5)
    assert m["trust_clip_fraction"].item() == pytest.approx(2 / 3)
    # a small step inside the ball is untouched
    state = t.init(anchor, radius=r)
    small = td(w=torch.tensor([1e-4, 0.0]), b=torch.tensor([1e-4]), critic=torch.zeros(3))
    shaped, _, m = t.update(small, state, params=anchor)
    assert torch.allclose(shaped["w"], small["w"]) and m["trust_clip_fraction"].item() == 0
    with pytest.raises(ConfigError, match="params"):
        t.update(small, state)


# ----------------------------------------------------------------------------- prioritised sampling


def test_priorities_sampling_frequencies_and_weights():
    m = torch.tensor([1.0, 2.0, 3.0, 4.0])
    p = shaping.priorities(m, alpha=1.0, eps=1e-12)
    assert torch.allclose(p, m / 10)
    idx = shaping.sample_prioritized(p, 200_000, torch.Generator().manual_seed(0))
    freq = torch.bincount(idx, minlength=4).float() / idx.numel()
    assert torch.allclose(freq, p, atol=0.005)
    w = shaping.importance_weights(p, beta=0.5)  # (4 p)^-0.5 / max = sqrt(0.1 / p)
    assert torch.allclose(w, (0.1 / p).sqrt())
    p_half = shaping.priorities(m, alpha=0.5, eps=1e-12)
    assert torch.allclose(p_half, m.sqrt() / m.sqrt().sum())
    assert torch.equal(shaping.importance_weights(p, beta=0.0), torch.ones(4))
    with pytest.raises(ConfigError, match="beta"):
        shaping.importance_weights(p, beta=1.5)
    with pytest.raises(ConfigError, match="alpha"):
        shaping.priorities(m, alpha=-1)


def test_importance_weights_of_a_zero_probability_are_refused():
    # the bug: one p_i = 0 made (N p_i)^-beta infinite and every weight 0 or NaN: [0., 0., nan]
    p = torch.tensor([0.5, 0.5, 0.0])
    with pytest.raises(ShapeError, match=r"^importance_weights: probs: expected finite probabilities > 0 \(beta > 0\), got min 0.0, max 0.5$"):
        shaping.importance_weights(p, 0.4)
    for bad in (torch.tensor([0.5, 0.7, -0.2]), torch.tensor([0.5, float("nan"), 0.5]), torch.tensor([0.5, float("inf"), 0.5])):
        for beta in (0.0, 0.4):
            with pytest.raises(ShapeError, match="^importance_weights: probs: expected finite probabilities"):
                shaping.importance_weights(bad, beta)
    with pytest.raises(ShapeError, match="^importance_weights: probs: expected a float tensor"):
        shaping.importance_weights(torch.tensor([1, 1]), 0.4)
    # beta = 0 corrects nothing: every weight 1, a never-drawn sample included
    assert torch.equal(shaping.importance_weights(p, 0.0), torch.ones(3))
    # with priorities' eps every p_i > 0: finite weights, 1 at the least likely sample
    q = shaping.priorities(torch.tensor([1.0, 1.0, 0.0]), alpha=1.0, eps=1e-6)
    w = shaping.importance_weights(q, 0.4)
    torch.testing.assert_close(w, (q / q[2]).pow(-0.4))
    assert float(w[2]) == 1.0 and torch.isfinite(w).all()


def test_sample_prioritized_members():
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    idx = shaping.sample_prioritized(p, 5, [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)])
    assert torch.equal(idx, torch.tensor([[0] * 5, [1] * 5]))


@pytest.mark.parametrize("use_loop", [False, True])
def test_per_sample_grads_by_hand(use_loop):
    params = td(lin=td(weight=torch.tensor([[1.0, -2.0]]), bias=torch.tensor([0.5])))
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.0, 1.0]])

    def loss(p, xi):  # 0.5 (w . x + b)^2
        return 0.5 * (p["lin", "weight"] @ xi + p["lin", "bias"]).square().sum()

    g = shaping.per_sample_grads(loss, params, x, use_loop=use_loop)
    y = x @ torch.tensor([1.0, -2.0]) + 0.5
    assert torch.allclose(g["lin/weight"], (y[:, None] * x)[:, None, :])
    assert torch.allclose(g["lin/bias"], y[:, None])


# ----------------------------------------------------------------------------- PPO integration


SPEC = EnvSpec(3, 1, [-2.0], [2.0])


def _batch(S: int, N: int, T: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(S, N, T, 3, generator=g)
    nxt = TensorDict(
        {"observation": obs + 0.1, "reward": torch.randn(S, N, T, 1, generator=g),
         "done": torch.zeros(S, N, T, 1, dtype=torch.bool), "terminated": torch.zeros(S, N, T, 1, dtype=torch.bool)},
        batch_size=[S, N, T],
    )
    action = torch.randn(S, N, T, 1, generator=g)
    return TensorDict({"observation": obs, "action": action, "sample_log_prob": -0.5 * action.square() - 0.92, "next": nxt},
                      batch_size=[S, N, T])


def _run(config: PPOConfig, iterations: int = 1):
    algo = make_ppo(config, SPEC, torch.device("cpu"))
    state = algo.init()
    gens = [torch.Generator().manual_seed(s) for s in config.seeds]
    metrics = []
    for i in range(iterations):
        state, m = algo.iteration(state, _batch(config.run.num_seeds, config.num_envs, config.num_steps, i), gens)
        metrics.append(m)
    return state, metrics


SMALL = dict(num_envs=4, num_steps=64, minibatch_size=64, num_epochs=2)


def test_all_off_is_plain_ppo():
    config = replace(PPOConfig(), **SMALL)
    assert not (config.oscillation_damping or config.adaptive_clip or config.prioritized_minibatches)
    state, _ = _run(config)
    assert "shaping" not in state.keys() and "transform" not in state["optim", "1"].keys()
    # the shaping knobs do nothing while their transforms are off
    other, _ = _run(replace(PPOConfig(), **SMALL, damping_strength=1.0, hessian_interval=1, clip_epsilon_decay=0.5, priority_alpha=2.0, priority_beta=1.0))
    for a, b in zip(state["params"].values(True, True), other["params"].values(True, True)):
        assert torch.equal(a, b)
    # and the update is the one before shaping existed (sums of the first leaves after one
    # iteration, measured with rlfunc/algos/ppo.py of commit b5b180e)
    sums = [float(v.detach().double().sum()) for v in list(state["params"].values(True, True))[:3]]
    assert sums == pytest.approx([-0.0006538896705023944, 5.3635501593817025, -0.004588111783959903], rel=1e-4, abs=1e-6)


def test_shaped_preset_has_the_issue_values():
    c = preset("Pendulum-v1", shaping="ppo-shaped")
    assert (c.gamma, c.lmbda, c.clip_epsilon, c.clip_epsilon_decay) == (0.99, 0.95, 0.2, 0.995)
    assert (c.max_grad_norm, c.hessian_interval, c.num_epochs) == (0.3, 5, 10)
    assert c.batch_size == 2048 and c.batch_size // c.minibatch_size == 32
    assert c.oscillation_damping and c.adaptive_clip and c.prioritized_minibatches
    assert preset("Pendulum-v1", shaping="ppo-shaped", gamma=0.9).gamma == 0.9  # overrides win
    assert "ppo-shaped" in SHAPING_PRESETS
    with pytest.raises(ConfigError, match="shaping"):
        preset("Pendulum-v1", shaping="nope")


@pytest.mark.parametrize("bad", [dict(hessian_interval=0), dict(damping_strength=1.5), dict(clip_epsilon_decay=0.0),
                                 dict(priority_beta=2.0), dict(priority_alpha=-0.1), dict(trust_radius_scale=0.0)])
def test_config_errors(bad):
    with pytest.raises(ConfigError):
        replace(PPOConfig(), **bad)


@pytest.mark.parametrize("bad", [dict(value_clip_epsilon=math.nan), dict(value_clip_epsilon=-0.1), dict(adam_eps=math.nan)])
def test_ppo_config_names_the_bad_field(bad):
    # Regression (new-user pass): value_clip_epsilon nan was accepted and every step was skipped,
    # silently; adam_eps nan was refused by Adam as "eps=nan", not by the flag's name
    from rlfunc.algos.ppo_encoder import PPOEncoderConfig

    (name, _), = bad.items()
    for cls in (PPOConfig, PPOEncoderConfig):
        with pytest.raises(ConfigError, match=f"^{name}="):
            replace(cls(), **bad)


def test_shaped_iteration_vmap_equals_loop_and_checkpoints(tmp_path):
    from rlfunc.run.checkpoint import save_snapshot

    kw = dict(num_envs=2, num_steps=32, minibatch_size=16, num_epochs=1, num_seeds=2, hessian_interval=2,
              oscillation_damping=True, adaptive_clip=True, prioritized_minibatches=True)
    a, ma = _run(replace(PPOConfig(), **kw, vmap="vmap"), iterations=2)
    b, mb = _run(replace(PPOConfig(), **kw, vmap="loop"), iterations=2)
    for x, y in zip(a.values(True, True), b.values(True, True)):
        assert torch.allclose(x.float(), y.float(), atol=1e-5)
    assert torch.allclose(ma[1]["clip_epsilon"], torch.full((2,), 0.2 * 0.995))
    assert int(a["optim", "1", "step"]) == 2 * 4
    for key in ("sign_agreement", "damping", "trust_clip_fraction"):
        assert ma[1][key].shape == (2,) and ma[1][key].isfinite().all()
    assert all(v.isfinite().all() for v in a["params"].values(True, True))
    save_snapshot(tmp_path / "snap", a, {"note": "shaping state keys are snapshot-safe"})


@pytest.mark.parametrize("kw", [dict(prioritized_minibatches=True), dict(oscillation_damping=True, hessian_interval=1),
                                dict(adaptive_clip=True), dict(oscillation_damping=True, adaptive_clip=True, prioritized_minibatches=True)],
                         ids=["prioritized", "damping", "adaptive_clip", "all"])
def test_non_finite_data_skips_that_seeds_update_with_shaping(kw):
    # Regression (new-user pass): a NaN reward crashed a run with prioritized_minibatches ("priorities:
    # magnitude must be finite"), and with damping the skipped update still moved the seed's shaping
    # state (curvature from the NaN loss, grad_sq, counters). Now seed 0's update is skipped and
    # everything of it stays put; seed 1 trains on.
    config = replace(PPOConfig(), num_envs=2, num_steps=32, minibatch_size=16, num_epochs=2, num_seeds=2, **kw)
    algo = make_ppo(config, SPEC, torch.device("cpu"))
    gens = [torch.Generator().manual_seed(s) for s in config.seeds]
    state, _ = algo.iteration(algo.init(), _batch(2, 2, 32, 0), gens)
    before = state.clone()
    batch = _batch(2, 2, 32, 1)
    batch["next", "reward"][0, 1, 5] = float("nan")
    after, m = algo.iteration(state, batch, gens)
    assert m["skipped_data"].tolist() == [2 * 32 // 16 * 2, 0]  # every minibatch of both epochs, seed 0 only
    moved = []
    for key, old in before.items(include_nested=True, leaves_only=True):
        if key[0] not in ("params", "optim") or key[:2] == ("optim", "0") or key[-1] in ("anchor", "radius") \
                or old.dim() == 0 or old.shape[0] != 2:
            continue  # the clip link's state is the last gradient norm, a report; the trust region re-anchors every update
        new = after.get(key)
        assert torch.equal(new[0], old[0]), key  # the skipped seed: params, Adam, transforms' state, metrics
        moved.append(not torch.equal(new[1], old[1]))
    assert any(moved) and all(v.isfinite().all() for v in after["params"].values(True, True))


def test_trust_region_bounds_ppo_policy_change():
    """Within one PPO iteration each policy tensor stays within its radius of the start."""
    kw = dict(num_envs=2, num_steps=32, minibatch_size=16, num_epochs=4, adaptive_clip=True, lr=0.05, max_grad_norm=100.0)
    config = replace(PPOConfig(), **kw)
    algo = make_ppo(config, SPEC, torch.device("cpu"))
    state = algo.init()
    start = state["params"].clone()
    state, m = algo.iteration(state, _batch(1, 2, 32), [torch.Generator().manual_seed(0)])
    trust = state["optim", "1", "transform", "0"]
    moved = 0
    for name in trust.keys():
        keys = tuple(name.split(shaping.SEP))
        r = trust[name, "radius"]
        dist = (state["params"].get(keys) - start.get(keys)).flatten(1).norm(dim=1)
        assert (dist <= r * (1 + 1e-4)).all(), name
        moved += int((dist > 0.5 * r).any())
    assert m[0]["trust_clip_fraction"].item() > 0 and moved > 0


# ----------------------------------------------------------------------------- GRPO / GSPO


def _grouped_batch(S: int, n: int, G: int, T: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    action = torch.randn(S, n, G, T, 1, generator=g)
    mask = torch.ones(S, n, G, T, 1, dtype=torch.bool)
    mask[..., T - 2 :, :] = torch.rand(S, n, G, 1, 1, generator=g) > 0.5  # some episodes end early
    return TensorDict(
        {"observation": torch.randn(S, n, G, T, 3, generator=g), "action": action,
         "sample_log_prob": -0.5 * action.square() - 0.92, "mask": mask,
         "next": TensorDict({"reward": torch.randn(S, n, G, T, 1, generator=g)}, batch_size=[S, n, G, T])},
        batch_size=[S, n, G, T],
    )


def _run_grpo(config, iterations: int = 1):
    from rlfunc.algos.grpo import make_grpo

    algo = make_grpo(config, SPEC, torch.device("cpu"))
    state = algo.init()
    start = state["params"].clone()
    gens = [torch.Generator().manual_seed(s) for s in config.seeds]
    for i in range(iterations):
        state, m = algo.iteration(state, _grouped_batch(config.run.num_seeds, config.num_groups, config.group_size, 6, i), gens)
    return state, m, start


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_grpo_gspo_shaping(loss):
    from rlfunc.algos.grpo import GRPOConfig

    kw = dict(env="PointReach-v0", loss=loss, num_groups=2, group_size=4, minibatch_size=4, num_epochs=3, num_seeds=2)
    plain, _, _ = _run_grpo(replace(GRPOConfig(), **kw))
    knobs, _, _ = _run_grpo(replace(GRPOConfig(), **kw, damping_strength=1.0, hessian_interval=1, clip_epsilon_decay=0.5))
    assert "shaping" not in plain.keys() and "transform" not in plain["optim", "1"].keys()
    for a, b in zip(plain["params"].values(True, True), knobs["params"].values(True, True)):
        assert torch.equal(a, b)  # off means off
    state, m, _ = _run_grpo(replace(GRPOConfig(), **kw, oscillation_damping=True, adaptive_clip=True, hessian_interval=2), iterations=2)
    base = 0.2 if loss == "grpo" else 0.03
    assert torch.allclose(m["clip_epsilon"], torch.full((2,), base * 0.995))
    assert int(state["optim", "1", "step"]) == 2 * 3 * 2
    assert all(v.isfinite().all() for v in state["params"].values(True, True))
    # each policy tensor ends the second update within its radius of that update's start
    trust = state["optim", "1", "transform", "1"]
    for name in trust.keys():
        dist = (state["params"].get(tuple(name.split(shaping.SEP))) - trust[name, "anchor"]).flatten(1).norm(dim=1)
        assert (dist <= trust[name, "radius"] * (1 + 1e-4)).all(), name


def test_ppo_shaped_resume_is_exact(tmp_path):
    """The shaping state travels in snapshots: 4 iterations == 2, stop, resume for 2 more."""
    from rlfunc.run import train

    tiny = dict(num_envs=2, num_steps=64, minibatch_size=32, num_epochs=1, checkpoint_every=1, device="cpu",
                version_every=0, total_steps=4 * 128, hessian_interval=3)
    config = preset("Pendulum-v1", shaping="ppo-shaped", **tiny)
    full = train(config, tmp_path / "full", progress=False, tensorboard=False, evaluate=False)
    train(config, tmp_path / "part", max_iterations=2, progress=False, tensorboard=False, evaluate=False)
    resumed = train(config, tmp_path / "part", resume=True, progress=False, tensorboard=False, evaluate=False)
    a = dict(full.state.items(include_nested=True, leaves_only=True))
    b = dict(resumed.state.items(include_nested=True, leaves_only=True))
    assert a.keys() == b.keys() and any(k[:3] == ("optim", "1", "transform") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_shape_steps_is_adam_then_the_transforms_on_its_step():
    """The link's update equals Adam's step put through the transforms by hand, with the gradients
    Adam saw, and keeps the transforms' metrics; ``params`` is required."""
    from rlfunc.optim import adam, chain, clip_by_global_norm, flatten

    g = torch.Generator().manual_seed(0)
    params = TensorDict({"actor": {"0": {"weight": torch.randn(2, 3, 4, generator=g)}}, "log_std": torch.randn(2, 4, generator=g)},
                        batch_size=[])
    damping = shaping.oscillation_damping(1e-2, strength=0.5, member_dims=1)
    link = shaping.shape_steps(adam(1e-2), damping, ("sign_agreement", "damping"), member_dims=1)
    state = link.init(params)
    assert int(state["step"]) == 0 and state["metrics", "damping"].shape == (2,)
    ref_adam, ref_t = adam(1e-2).init(params), state["transform"].clone()
    for i in range(3):
        grads = params.apply(lambda p: torch.randn(p.shape, generator=g))
        out, state = link.update(grads, state, params, lr=1e-2)
        step, ref_adam = adam(1e-2).update(grads, ref_adam, params, lr=1e-2)
        flat = lambda td: TensorDict({"/".join(k): v for k, v in zip(_keys(td), flatten(td)[0])}, batch_size=[])  # noqa: E731
        shaped, ref_t, m = damping.update(flat(step), ref_t, grads=flat(grads))
        for k, v in zip(_keys(out), flatten(out)[0]):
            assert torch.equal(v, shaped["/".join(k)]), k
        assert torch.equal(state["metrics", "damping"], m["damping"]) and int(state["step"]) == i + 1
    with pytest.raises(ConfigError, match="params"):
        chain(clip_by_global_norm(1.0, stacked=True), link).update(grads, chain(clip_by_global_norm(1.0, stacked=True), link).init(params))


def _keys(td):
    from rlfunc.optim.base import flatten, tree_keys

    return tree_keys(flatten(td)[1])


def test_ppo_shaped_snapshot_from_before_the_link_resumes_exactly(tmp_path):
    """A shaped run's snapshot of the layout before the shaping state was a link of the update chain
    (the learner's "shaping" {"transform", "step"} beside the chain, Adam's state as link "1") loads,
    and the resumed run equals the uninterrupted one."""
    from rlfunc.run import checkpoint
    from rlfunc.run import train

    tiny = dict(num_envs=2, num_steps=64, minibatch_size=32, num_epochs=1, checkpoint_every=1, device="cpu",
                version_every=0, total_steps=4 * 128, hessian_interval=3)
    config = preset("Pendulum-v1", shaping="ppo-shaped", **tiny)
    full = train(config, tmp_path / "full", progress=False, tensorboard=False, evaluate=False)
    train(config, tmp_path / "part", max_iterations=2, progress=False, tensorboard=False, evaluate=False)
    snap = checkpoint.latest_snapshot(tmp_path / "part")
    saved, meta = checkpoint.load_snapshot(snap)
    link = saved["learner", "optim", "1"]
    old = saved.clone()
    old["learner", "optim", "1"] = link["inner"]
    old["learner", "shaping"] = TensorDict({"transform": link["transform"], "step": link["step"]}, batch_size=[])
    checkpoint.save_snapshot(snap, old, meta)
    resumed = train(config, tmp_path / "part", resume=True, progress=False, tensorboard=False, evaluate=False)
    a = dict(full.state.items(include_nested=True, leaves_only=True))
    b = dict(resumed.state.items(include_nested=True, leaves_only=True))
    assert a.keys() == b.keys() and ("optim", "1", "step") in a
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_with_shaping_in_chain_on_the_grpo_layout():
    """grpo's snapshots keep the chain beside the learner ("optim"), ppo's inside it: both convert."""
    from rlfunc.run.resume import has_shaping_link, with_shaping_in_chain

    link = TensorDict({"inner": {"exp_avg": torch.zeros(2)}, "transform": {"0": {"count": torch.zeros(())}},
                       "step": torch.zeros((), dtype=torch.int64), "metrics": {"damping": torch.zeros(2)}}, batch_size=[])
    like = TensorDict({"learner": {"params": torch.zeros(2)}, "optim": {"0": {"norm": torch.zeros(2)}, "1": link}}, batch_size=[])
    def old():
        return TensorDict({"learner": {"params": torch.ones(2), "shaping": {"transform": {"0": {"count": torch.tensor(3.0)}},
                                                                           "step": torch.tensor(7)}},
                           "optim": {"0": {"norm": torch.ones(2)}, "1": {"exp_avg": torch.full((2,), 5.0)}}}, batch_size=[])

    assert has_shaping_link(like) and not has_shaping_link(old())
    new = with_shaping_in_chain(old(), like)
    assert set(new.keys(include_nested=True, leaves_only=True)) == set(like.keys(include_nested=True, leaves_only=True))
    assert int(new["optim", "1", "step"]) == 7 and float(new["optim", "1", "transform", "0", "count"]) == 3.0
    assert torch.equal(new["optim", "1", "inner", "exp_avg"], torch.full((2,), 5.0))
    assert torch.equal(new["learner", "params"], torch.ones(2))
    plain = like.exclude(("optim", "1", "transform"))
    assert not has_shaping_link(plain) and with_shaping_in_chain(old(), plain)["learner"].get("shaping", None) is not None


def test_trust_radius_scale_multiplies_the_radii():
    kw = dict(num_envs=2, num_steps=32, minibatch_size=32, num_epochs=1, adaptive_clip=True)
    a, _ = _run(replace(PPOConfig(), **kw))
    b, _ = _run(replace(PPOConfig(), **kw, trust_radius_scale=3.0))
    ra, rb = a["optim", "1", "transform", "0"], b["optim", "1", "transform", "0"]
    for name in ra.keys():
        x, y = ra[name, "radius"], rb[name, "radius"]
        assert torch.allclose(torch.where(x.isinf(), x, 3 * x), y), name


def test_ppo_loss_sample_weight():
    from rlfunc.errors import ShapeError
    from rlfunc.losses.ppo import ppo_loss

    g = torch.Generator().manual_seed(0)
    lp, old, adv, v, tgt = (torch.randn(8, 1, generator=g, dtype=torch.double) for _ in range(5))
    kw = dict(normalize_advantages=False)
    base, m = ppo_loss(lp, old, adv, v, tgt, **kw)
    same, _ = ppo_loss(lp, old, adv, v, tgt, sample_weight=torch.ones(8, 1, dtype=torch.double), **kw)
    assert torch.equal(base, same)
    w = torch.rand(8, 1, generator=g, dtype=torch.double)
    loss, mw = ppo_loss(lp, old, adv, v, tgt, sample_weight=w, **kw)
    r = (lp - old).exp()
    objective = torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)  # by hand: weighted means
    assert torch.allclose(mw["loss_objective"], -(w * objective).mean())
    assert torch.allclose(mw["loss_critic"], 0.5 * 0.5 * (w * (v - tgt) ** 2).mean())
    with pytest.raises(ShapeError, match="sample_weight"):
        ppo_loss(lp, old, adv, v, tgt, sample_weight=torch.ones(8), **kw)


def test_shaping_transforms_see_the_clipped_gradients(monkeypatch):
    # Regression (found in review after PPO's optimizer moved into the learner): the shaping
    # transforms must see the gradients after the per-seed global-norm clip, as they did when the
    # clip was done in place before the step; with max_grad_norm 1e-3 every gradient is clipped.
    seen = []
    real = shaping.oscillation_damping

    def recording(*args, **kwargs):
        t = real(*args, **kwargs)

        def update(updates, state, *, grads=None, **context):
            seen.append(torch.stack([g.pow(2).flatten(1).sum(1) for g in grads.values()]).sum(0).sqrt())
            return t.update(updates, state, grads=grads, **context)

        return shaping.GradientTransformation(t.init, update)

    monkeypatch.setattr(shaping, "oscillation_damping", recording)
    _run(replace(PPOConfig(), **SMALL, num_seeds=2, max_grad_norm=1e-3, oscillation_damping=True, hessian_interval=2))
    assert len(seen) == 8 and all(bool((n <= 1e-3 + 1e-7).all()) for n in seen), seen


def test_a_member_skipped_by_the_mask_keeps_its_own_counts_through_shape_steps():
    # Regression: oscillation damping's RMS bias correction counted the steps of any member ("count"
    # shared), as Adam's step count was, so a member the mask skipped (a seed stopped by target_kl) was
    # damped afterwards as if it had taken the others' steps. Each member of a 2-member chain now equals
    # a 1-member chain that took only its own steps.
    from rlfunc.optim import adam

    def link(members):
        damping = shaping.oscillation_damping(1e-2, strength=0.5, member_dims=1)
        return shaping.shape_steps(adam(1e-2, member_dims=int(members > 1)), damping, ("sign_agreement", "damping"), member_dims=1)

    g = torch.Generator().manual_seed(0)
    params = TensorDict({"actor": {"0": {"weight": torch.randn(2, 3, 4, generator=g)}}, "log_std": torch.randn(2, 4, generator=g)},
                        batch_size=[])
    alone = [params.apply(lambda p, i=i: p[i : i + 1].clone()) for i in range(2)]
    pair, singles = link(2), link(1)
    state, states = pair.init(params), [singles.init(a) for a in alone]
    assert state["transform", "count"].shape == (2,)
    for mask in ([True, False], [True, False], [True, True], [False, True], [True, True]):
        grads = params.apply(lambda p: torch.randn(p.shape, generator=g))
        out, state = pair.update(grads, state, params, lr=1e-2, mask=torch.tensor(mask))
        params = params.apply(lambda p, u: p + u, out)
        for i in (0, 1):
            if mask[i]:
                step, states[i] = singles.update(grads.apply(lambda x, i=i: x[i : i + 1]), states[i], alone[i], lr=1e-2)
                alone[i] = alone[i].apply(lambda p, u: p + u, step)
            for key, value in alone[i].items(include_nested=True, leaves_only=True):
                torch.testing.assert_close(params.get(key)[i : i + 1], value, rtol=0, atol=1e-7)
    assert state["transform", "count"].tolist() == [4, 3]

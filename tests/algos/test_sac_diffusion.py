"""sac-diffusion (DACER): the actor's gradient through the whole chain, the noise alpha scales, the
temperature's direction, the entropy estimate it is driven by, config errors; resume and the CLI are
in tests/run/test_resume_diffusion.py and tests/cli/test_cli_diffusion.py."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlfunc.algos.diffusion_actor import ActorSpec, env_info
from rlfunc.algos.offpolicy import q_ensemble
from rlfunc.algos.sac_diffusion import SACDiffusionConfig, make_sac_diffusion
from rlfunc.config import replace
from rlfunc.core import func
from rlfunc.errors import ConfigError

CPU = torch.device("cpu")
ACTOR = ActorSpec(hidden=(32, 32), horizon=1, act_steps=1, num_train_steps=8, ddim_steps=8)


def _algo(**kw):
    config = replace(SACDiffusionConfig(), **{"actor": ACTOR, "critic_hidden": (32,), "batch_size": 32,
                                              "entropy_states": 4, "entropy_samples": 50, "device": "cpu", **kw})
    info = env_info(config.env)
    return config, make_sac_diffusion(config, config.actor, info, info.act_dim, CPU)


def _buffer(algo, n=64, seed=0):
    """A TorchRL replay buffer of ``n`` random PointReach transitions."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    g = torch.Generator().manual_seed(seed)
    C = algo.actor.obs_dim
    chunk = torch.rand(n, 1, 2, generator=g) * 2 - 1
    rows = TensorDict({"cond": torch.randn(n, C, generator=g), "next_cond": torch.randn(n, C, generator=g),
                       "action": chunk.flatten(1), "chunk": chunk, "reward": torch.randn(n, 1, generator=g),
                       "terminated": torch.rand(n, 1, generator=g) < 0.1}, batch_size=[n])
    buffer = ReplayBuffer(storage=LazyTensorStorage(n))
    buffer.extend(rows)
    return buffer


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_actor_loss_reaches_every_denoiser_parameter_through_the_chain(checkpoint):
    """-min_e Q_e(s, a0) with a0 the end of 8 reverse steps: every leaf of the denoiser gets a
    gradient, and per-step checkpointing gives the same gradient (recomputed, not approximated)."""
    _, algo = _algo(init_alpha=1e-3)
    state = algo.init()
    params = state["params", "actor"]
    cond = torch.randn(16, algo.actor.obs_dim, generator=torch.Generator().manual_seed(1))

    def grads(ckpt: bool) -> dict:
        for leaf in func.leaves(params):
            leaf.grad = None
        a = algo.noisy_action(params, state, cond, torch.Generator().manual_seed(2), checkpoint=ckpt)
        critics = q_ensemble(algo.actor.obs_dim, 2, (32,), [1, 2], CPU)
        loss = -critics.values(state["params", "critic"].detach(), cond, a.flatten(1)).min(0).values.mean()
        loss.backward()
        return {k: params.get(k).grad.clone() for k in params.keys(include_nested=True, leaves_only=True)}

    g = grads(checkpoint)
    assert g and all(bool(v.abs().sum() > 0) for v in g.values()), [k for k, v in g.items() if not v.abs().sum() > 0]
    if checkpoint:
        plain = grads(False)
        for k in g:
            torch.testing.assert_close(g[k], plain[k], rtol=1e-5, atol=1e-7)


def test_alpha_scales_the_noise_added_to_the_chain_end():
    """a0 = clip(x0 + noise_scale * alpha * eps, -1, 1), x0 the chain's end, eps the generator's next
    standard-normal draw after the chain's noise; the graph reaches the denoiser, not log alpha."""
    _, algo = _algo(noise_scale=0.15)
    state = algo.init()
    cond = torch.randn(500, algo.actor.obs_dim, generator=torch.Generator().manual_seed(4))
    state["params", "log_alpha"].data.fill_(math.log(0.5))
    a = algo.noisy_action(state["params", "actor"], state, cond, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        x0 = algo.actor.act(state["params", "actor"], state["schedule"], cond, algo.actor.noise(500, g), eta=1.0)
        eps = torch.randn(x0.shape, generator=g)
    torch.testing.assert_close(a.detach(), (x0 + 0.15 * 0.5 * eps).clamp(-1, 1), rtol=0, atol=1e-6)
    assert bool(((a.detach() - x0).abs() > 1e-3).any())  # the noise is there
    assert a.requires_grad and state["params", "log_alpha"].grad is None
    a.sum().backward()
    assert state["params", "log_alpha"].grad is None


@pytest.mark.parametrize("target, direction", [(-5.0, -1), (5.0, +1)])
def test_alpha_falls_above_the_target_entropy_and_rises_below_it(target, direction):
    """The fresh actor's noisy actions have an entropy estimate of ~1.4 nats on [-1, 1]^2 (uniform:
    log 4): above a target of -5 alpha must fall; below a target of 5 it must rise."""
    config, algo = _algo(target_entropy=target, entropy_every=1, updates_per_iteration=3, init_alpha=0.5)
    state = algo.init()
    log_alpha0 = float(state["params", "log_alpha"])
    state, metrics = algo.iteration(state, _buffer(algo), torch.Generator().manual_seed(0), _prec())
    assert -5.0 < float(metrics["entropy"]) < 5.0
    assert direction * (float(state["params", "log_alpha"]) - log_alpha0) > 0.05  # 3 Adam steps of lr 0.03
    assert int(state["updates"]) == 3 and int(state["optim_alpha", "0", "step", "log_alpha"]) == 3


def test_autotune_off_keeps_alpha_and_entropy_every_sets_the_estimates():
    config, algo = _algo(autotune=False, entropy_every=2, updates_per_iteration=4)
    state = algo.init()
    state, metrics = algo.iteration(state, _buffer(algo), torch.Generator().manual_seed(0), _prec())
    assert float(state["params", "log_alpha"]) == pytest.approx(math.log(3.0))
    assert float(metrics["alpha"]) == pytest.approx(3.0)
    assert float(state["entropy"]) != 0.0  # estimated at updates 0 and 2
    assert float(metrics["target_entropy"]) == pytest.approx(-0.9 * 2)
    assert int(state["optim_alpha", "0", "step", "log_alpha"]) == 0


@pytest.mark.parametrize("algo_name", ["sac-diffusion", "td3-diffusion"])
@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_critic_warmup_holds_the_actor_while_the_critics_and_their_targets_step(algo_name, compile_mode):
    """critic_warmup_updates=4, policy_delay=2, 4 updates per iteration: the first iteration leaves the
    actor (and its Adam state) bit for bit while the critics and the target critics move; the second
    steps the actor twice (updates 6 and 8)."""
    from rlfunc.algos.td3_diffusion import TD3DiffusionConfig, make_td3_diffusion

    kw = dict(critic_warmup_updates=4, policy_delay=2, updates_per_iteration=4, compile=compile_mode)
    if algo_name == "sac-diffusion":
        config, algo = _algo(**kw)
    else:
        config = replace(TD3DiffusionConfig(), **{"actor": ACTOR, "critic_hidden": (32,), "batch_size": 32, "device": "cpu", **kw})
        info = env_info(config.env)
        algo = make_td3_diffusion(config, config.actor, info, info.act_dim, CPU)
    state = algo.init()
    actor0, critic0 = state["params", "actor"].clone(), state["params", "critic"].clone()
    target0 = state["target", "critic"].clone()
    generator, buffer = torch.Generator().manual_seed(0), _buffer(algo)
    state, metrics = algo.iteration(state, buffer, generator, _prec())
    assert (state["params", "actor"] == actor0).all() and "actor_grad_norm" not in metrics.keys()
    adam_actor = state["optim_actor", "1"]  # chain(clip, adam): Adam's state, untouched
    assert all(float(v) == 0 for v in adam_actor["step"].values(True, True))
    assert all(bool((v == 0).all()) for v in adam_actor["exp_avg"].values(True, True))
    assert not (state["params", "critic"] == critic0).all() and not (state["target", "critic"] == target0).all()
    state, metrics = algo.iteration(state, buffer, generator, _prec())
    assert not (state["params", "actor"] == actor0).all() and "actor_grad_norm" in metrics.keys()
    with pytest.raises(ConfigError, match="critic_warmup_updates=-1: expected an integer >= 0"):
        replace(config, critic_warmup_updates=-1)


def test_the_entropy_estimate_of_a_known_gaussian_policy():
    """A denoiser predicting x0 = 0 (prediction "sample", all weights zero) ends every chain at 0, so
    the noisy actions are N(0, sigma^2 I), sigma = noise_scale * alpha. DACER's estimate (the
    mixture's upper bound, 3 components fitted to one Gaussian) lies between the closed form
    A/2 log(2 pi e sigma^2) (A = 2) and that + log 3, and doubling sigma adds A log 2 (the same draws,
    scaled: EM is scale-equivariant but for its reg_covar floor)."""
    actor = ActorSpec(hidden=(32, 32), horizon=1, act_steps=1, num_train_steps=8, ddim_steps=8, prediction="sample")
    _, algo = _algo(actor=actor, entropy_samples=400, init_alpha=1.0, noise_scale=0.05)
    state = algo.init()
    for leaf in func.leaves(state["params", "actor"]):
        leaf.data.zero_()
    cond = torch.randn(4, algo.actor.obs_dim)
    h = {}
    for alpha in (1.0, 2.0):
        state["params", "log_alpha"].data.fill_(math.log(alpha))
        h[alpha] = algo.entropy(state["params", "actor"], state, cond, torch.Generator().manual_seed(0))
        closed = math.log(2 * math.pi * math.e * (0.05 * alpha) ** 2)
        assert h[alpha].shape == (4, 1)
        assert bool((h[alpha] > closed - 0.1).all() and (h[alpha] < closed + math.log(3)).all()), (h[alpha], closed)
    torch.testing.assert_close(h[2.0] - h[1.0], torch.full((4, 1), 2 * math.log(2)), rtol=0, atol=0.08)


def _prec():
    from rlfunc.optim.amp import precision

    return precision(CPU, "off")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(entropy_samples=2), "entropy_samples=2: expected >= entropy_components=3"),
        (dict(entropy_states=999), "entropy_states=999: expected <= batch_size=256"),
        (dict(noise_scale=-0.1), "noise_scale=-0.1"),
        (dict(noise_scale=float("nan")), "noise_scale=nan: expected a finite number"),
        (dict(alpha_lr=float("inf")), "alpha_lr=inf: expected a finite number"),
        (dict(init_alpha=0.0), "init_alpha=0.0"),
        (dict(entropy_every=0), "entropy_every=0"),
        (dict(actor=ActorSpec(horizon=4, act_steps=2)), "sac-diffusion's critic scores the executed chunk"),
        (dict(target_entropy=float("nan")), "target_entropy=nan"),
        (dict(compile="on", gradient_checkpointing=True), "run.compile='on': sac-diffusion compiles its float32 update"),
    ],
)
def test_bad_config_is_refused_naming_the_field(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        replace(SACDiffusionConfig(), **changes)


def test_a_gymnasium_env_trains_through_the_chunk_env(tmp_path):
    """Pendulum-v1 (a gymnasium id: rlfunc.envs.chunk.GymChunkEnv, actions scaled to [-2, 2]): two
    iterations past the warm-up give finite losses, a moved alpha and an evaluation."""
    from rlfunc.run import train

    config = replace(SACDiffusionConfig(), env="Pendulum-v1", actor=ACTOR, critic_hidden=(32,), num_envs=4, num_steps=50,
                     warmup_steps=200, updates_per_iteration=4, batch_size=32, entropy_every=2, entropy_states=4,
                     entropy_samples=20, total_steps=600, eval_episodes=2, device="cpu")
    result = train(config, tmp_path / "run", progress=False, tensorboard=False)
    import json

    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [200, 400, 600]
    assert all(math.isfinite(lines[-1][k]) for k in ("loss_critic", "loss_actor", "entropy", "alpha"))
    assert float(result.state["params", "log_alpha"]) != pytest.approx(math.log(3.0))
    assert result.evaluation["num_episodes"] == 2.0 and math.isfinite(result.evaluation["episode_return"])

"""SAC (rlfunc.algos.sac): the learner state's structure, one update's directions, the Polyak rate,
REDQ, config checks."""

import math

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

from rlfunc.algos.ppo import EnvSpec
from rlfunc.algos.sac import SACConfig, make_sac, preset
from rlfunc.config import replace
from rlfunc.errors import ConfigError

SPEC = EnvSpec(3, 2, [-2.0, -1.0], [2.0, 3.0])
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    """Small nets run fastest on one thread (what a run sets, RunConfig.torch_threads); two oversubscribe a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config(**kw) -> SACConfig:
    return replace(SACConfig(), **{"hidden": (16, 16), "batch_size": 32, "device": "cpu", **kw})


def _buffer(n: int = 200, seed: int = 0) -> ReplayBuffer:
    g = torch.Generator().manual_seed(seed)
    buffer = ReplayBuffer(storage=LazyTensorStorage(n))
    buffer.extend(TensorDict({
        "observation": torch.randn(n, 3, generator=g), "action": torch.rand(n, 2, generator=g) * 2 - 1,
        "next": {"observation": torch.randn(n, 3, generator=g), "reward": torch.randn(n, 1, generator=g),
                 "terminated": torch.rand(n, 1, generator=g) < 0.1},
    }, batch_size=[n]))
    return buffer


def _leaves(td: TensorDict) -> dict:
    return {k: v.detach().clone() for k, v in td.items(include_nested=True, leaves_only=True)}


def test_the_learner_state_is_one_tensordict_of_params_targets_optimizers_and_counters():
    state = make_sac(_config(num_critics=3), SPEC, CPU).init()
    assert set(state.keys()) == {"params", "target", "optim_actor", "optim_critic", "optim_alpha", "rng", "iteration",
                                 "env_steps", "updates"}
    assert set(state["params"].keys()) == {"actor", "critic", "log_alpha"}
    assert state["params", "actor", "4", "weight"].shape == (4, 16)  # [loc, log_std] for 2 action dims
    assert state["params", "critic", "0", "weight"].shape == (3, 16, 5)  # 3 critics stacked, input [s, a]
    assert state["params", "log_alpha"].shape == () and float(state["params", "log_alpha"]) == 0.0  # init_alpha 1
    for key, value in state["target", "critic"].items(True, True):
        assert torch.equal(value, state["params", "critic", key]) and not value.requires_grad
    assert set(state["optim_critic", "0"].keys()) == {"step", "exp_avg", "exp_avg_sq"}  # no clip link by default
    assert state["optim_alpha", "0", "exp_avg", "log_alpha"].shape == ()
    assert state["rng"].dtype == torch.uint8
    clipped = make_sac(_config(max_grad_norm=1.0), SPEC, CPU).init()
    assert set(clipped["optim_actor"].keys()) == {"0", "1"}  # clip, then Adam


def test_one_update_moves_every_parameter_log_alpha_by_its_sign_and_the_targets_by_tau():
    config = _config(tau=0.1, alpha_lr=1e-2)
    algo = make_sac(config, SPEC, CPU)
    state = algo.init()
    before = _leaves(state)
    gen = torch.Generator().manual_seed(1)
    state, metrics = algo.iteration(state, _buffer(), gen, 1)
    after = _leaves(state)
    for key in before:
        if key[0] == "params":
            assert not torch.equal(before[key], after[key]), key
    # Adam's first step is lr * sign(g); dJ/dlog_alpha = H - H_bar with H = -E[log pi], H_bar = -|A|
    sign = math.copysign(1.0, float(metrics["entropy"]) - (-2.0))
    assert float(after["params", "log_alpha"]) == pytest.approx(-config.alpha_lr * sign, abs=1e-6)
    assert float(metrics["alpha"]) == pytest.approx(1.0)  # the step's temperature is the one before its update
    for key in before:
        if key[0] == "target":
            online = after[("params", *key[1:])]
            torch.testing.assert_close(after[key], before[key] + config.tau * (online - before[key]), rtol=0, atol=1e-6)
    assert int(state["updates"]) == 1
    assert set(metrics.keys()) >= {"loss_critic", "q_mean", "loss_actor", "q_policy", "entropy", "loss_alpha", "alpha",
                                   "critic_grad_norm", "actor_grad_norm", "target_q"}


def test_the_critics_fit_a_fixed_buffer_and_a_fixed_alpha_stays():
    config = _config(autotune=False, init_alpha=0.2, critic_lr=3e-3)
    algo = make_sac(config, SPEC, CPU)
    state = algo.init()
    gen = torch.Generator().manual_seed(2)
    buffer = _buffer()
    _, first = algo.iteration(state, buffer, gen, 5)
    _, later = algo.iteration(state, buffer, gen, 100)
    assert float(later["loss_critic"]) < float(first["loss_critic"])
    assert float(state["params", "log_alpha"]) == pytest.approx(math.log(0.2))
    assert "loss_alpha" not in later.keys() and float(later["alpha"]) == pytest.approx(0.2, rel=1e-5)


def test_policy_acts_within_the_bounds_and_deterministically_on_request():
    algo = make_sac(_config(), SPEC, CPU)
    state = algo.init()
    obs = torch.randn(500, 3)
    act, logp = algo.policy(state, torch.Generator().manual_seed(0))(obs)
    assert logp is None and act.shape == (500, 2)
    assert (act[:, 0].abs() < 2).all() and (act[:, 1] > -1).all() and (act[:, 1] < 3).all()
    a1, _ = algo.policy(state, None, deterministic=True)(obs)
    a2, _ = algo.policy(state, None, deterministic=True)(obs)
    assert torch.equal(a1, a2)


def test_redq_takes_a_subset_min_in_the_target():
    algo = make_sac(_config(num_critics=4, redq_subset=2), SPEC, CPU)
    state = algo.init()
    state, metrics = algo.iteration(state, _buffer(), torch.Generator().manual_seed(0), 2)
    assert torch.isfinite(metrics["loss_critic"]) and int(state["updates"]) == 2


@pytest.mark.parametrize("kw, message", [
    (dict(n_step=3), "n_step=3"), (dict(redq_subset=3), "redq_subset=3"), (dict(tau=0.0), "tau=0.0"),
    (dict(num_seeds=2), "run.num_seeds=2"), (dict(init_alpha=0.0), "init_alpha=0.0"), (dict(hidden=()), "hidden"),
    (dict(learning_starts=-1), "learning_starts=-1"), (dict(activation="gelu"), "activation"),
    # new-user pass: nan was "alpha_lr=0.001, init_alpha=nan" (both named), inf passed
    (dict(init_alpha=float("nan")), "^init_alpha=nan: expected a finite number > 0$"), (dict(init_alpha=float("inf")), "init_alpha=inf"),
])
def test_bad_config_is_refused(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _config(**kw)


def test_presets_follow_rl_zoo():
    pendulum = preset("Pendulum-v1")
    assert pendulum.total_steps == 20_000 and pendulum.actor_lr == pendulum.critic_lr == pendulum.alpha_lr == 1e-3
    cheetah = preset("HalfCheetah-v5")
    assert cheetah.total_steps == 1_000_000 and cheetah.learning_starts == 10_000 and cheetah.actor_lr == 3e-4
    assert preset("Hopper-v5", seed=3).run.seed == 3


def test_unbounded_actions_are_refused():
    with pytest.raises(ConfigError, match="finite bounds"):
        make_sac(_config(), EnvSpec(3, 1, [-math.inf], [math.inf]), CPU)


def test_a_run_whose_learning_starts_covers_its_budget_warns_that_it_takes_no_gradient_step(tmp_path):
    from rlfunc.algos.sac import SACConfig
    from rlfunc.config import replace
    from rlfunc.run import train

    config = replace(SACConfig(), env="Pendulum-v1", total_steps=64, num_steps=64, learning_starts=64, num_envs=1, device="cpu",
                     eval_episodes=1, checkpoint_every=0)
    with pytest.warns(UserWarning, match="no gradient step"):
        train(config, tmp_path / "r", progress=False, tensorboard=False)


def test_a_skipped_step_is_counted_and_moves_nothing():
    """New-user pass: sac and td3 skipped a step whose loss or gradient was not finite (adam's mask) but
    their metrics said nothing of it; "skipped_critic" / "skipped_actor" are now 1.0 for such a step."""
    from rlfunc.algos.td3 import TD3Config, make_td3

    for make, config in ((make_sac, _config(compile="off")), (make_td3, replace(TD3Config(), hidden=(16, 16), batch_size=32,
                                                                                  device="cpu", policy_delay=1, compile="off"))):
        algo = make(config, SPEC, CPU)
        state = algo.init()
        _, fine = algo.iteration(state, _buffer(), torch.Generator().manual_seed(0), 1)
        assert float(fine["skipped_critic"]) == 0.0 and float(fine["skipped_actor"]) == 0.0
        huge = _buffer()
        huge.storage._storage["next", "reward"][:] = 3e38  # the critic's squared error overflows to inf
        before = _leaves(state["params"])
        _, metrics = algo.iteration(state, huge, torch.Generator().manual_seed(0), 1)
        assert float(metrics["skipped_critic"]) == 1.0, type(config).__name__
        critic = {k: v for k, v in _leaves(state["params"]).items() if k[0] == "critic"}
        assert all(torch.equal(v, before[k]) for k, v in critic.items())


def test_action_bounds_wider_than_float32_keep_a_finite_scale():
    # new-user pass (gymnasium envs): Box(-2e38, 2e38) passed the finiteness check, but (high - low) / 2
    # overflowed float32 to inf: every step's data non-finite and skipped, 0 updates, a NaN-acting policy
    from rlfunc.algos.offpolicy import action_scale

    wide = action_scale([-2e38, -1.0], [2e38, 3.0], torch.device("cpu"))
    assert wide.center.tolist() == [0.0, 1.0] and torch.isfinite(wide.half_range).all()
    assert float(wide.half_range[0]) == pytest.approx(2e38, rel=1e-6) and float(wide.half_range[1]) == 2.0
    lo, hi = torch.randn(1000) * 100, torch.rand(1000) * 100 + 1e-3
    hi = lo + hi
    scale = action_scale(lo.tolist(), hi.tolist(), torch.device("cpu"))  # the same numbers as (hi +- lo) / 2
    assert torch.equal(scale.center, (hi + lo) / 2) and torch.equal(scale.half_range, (hi - lo) / 2)
    with pytest.raises(ConfigError, match="expected finite bounds"):
        action_scale([-1e39], [1e39], torch.device("cpu"))  # past float32: inf, refused


def test_a_metrics_line_counts_skipped_steps_and_averages_the_others():
    """Metrics pass: sac/td3 reported skipped steps as the fraction of a line's steps (README: counted),
    and one skipped step's inf loss and norm made the line's loss_critic and critic_grad_norm null (the
    ~190 good steps beside it unreported). Now: counts, and means over the steps that gave a finite value."""
    from rlfunc.algos.offpolicy import StepMetrics
    from rlfunc.algos.td3 import TD3Config, make_td3

    acc = StepMetrics()  # by hand: critic steps (loss, norm, skipped) and, on two of them, actor steps
    for loss, norm, actor in ((1.0, 2.0, 5.0), (math.inf, math.nan, None), (4.0, 6.0, math.nan), (7.0, 1.0, None)):
        acc.add({"loss_critic": torch.tensor(loss), "critic_grad_norm": torch.tensor(norm),
                 "skipped_critic": torch.tensor(float(not math.isfinite(norm)))})
        if actor is not None:
            acc.add({"loss_actor": torch.tensor(actor), "skipped_actor": torch.tensor(float(actor != actor))})
    got = {k: float(v) for k, v in acc.result().items()}
    assert got == {"loss_critic": 4.0, "critic_grad_norm": 3.0, "skipped_critic": 1.0, "loss_actor": 5.0, "skipped_actor": 1.0}
    on_device = StepMetrics()  # an eager diffusion step's host skip flag beside device metrics ("meta" stands in)
    on_device.add({"loss_actor": torch.tensor(1.0, device="meta"), "skipped_actor": torch.tensor(0.0)})
    assert {v.device.type for v in on_device.result().values()} == {"meta"}
    only_bad = StepMetrics()
    only_bad.add({"loss_critic": torch.tensor(math.inf), "skipped_critic": torch.tensor(1.0)})
    assert math.isnan(float(only_bad.result()["loss_critic"]))  # no finite value: NaN (metrics.jsonl: null)

    td3 = replace(TD3Config(), hidden=(16, 16), batch_size=32, device="cpu", policy_delay=1, compile="off")
    for make, config in ((make_sac, _config(compile="off")), (make_td3, td3)):
        algo = make(config, SPEC, CPU)
        huge = _buffer()
        huge.storage._storage["next", "reward"][:] = 3e38  # every critic step overflows: all 3 skipped
        _, metrics = algo.iteration(algo.init(), huge, torch.Generator().manual_seed(0), 3)
        assert float(metrics["skipped_critic"]) == 3.0, type(config).__name__
        _, fine = algo.iteration(algo.init(), _buffer(), torch.Generator().manual_seed(0), 3)
        assert float(fine["skipped_critic"]) == 0.0 and math.isfinite(float(fine["loss_critic"]))


def test_a_metrics_line_over_several_iteration_calls_weighs_every_step_alike():
    """Review pass: the run's line averaged each iteration call's means (2 updates per env step and one
    skipped: the line's loss_critic 34.63 against 34.38 over the finite steps); the calls now add their
    steps into the line's StepMetrics (``into``), so the line is the mean over all of its steps."""
    from rlfunc.algos.offpolicy import StepMetrics
    from rlfunc.algos.td3 import TD3Config, make_td3

    td3 = replace(TD3Config(), hidden=(16, 16), batch_size=32, device="cpu", policy_delay=1, compile="off")
    for make, config in ((make_sac, _config(compile="off")), (make_td3, td3)):
        algo = make(config, SPEC, CPU)
        acc, gen = StepMetrics(), torch.Generator().manual_seed(0)
        state = algo.init()
        for n in (1, 3):  # a line of two calls: 1 step, then 3
            _, returned = algo.iteration(state, _buffer(), gen, n, into=acc)
            assert not returned.keys()  # the steps went into acc
        line = {k: float(v) for k, v in acc.result().items()}
        state, gen = algo.init(), torch.Generator().manual_seed(0)
        _, one = algo.iteration(state, _buffer(), gen, 1)
        _, three = algo.iteration(state, _buffer(), gen, 3)
        apart = []
        for key in ("loss_critic", "critic_grad_norm", "loss_actor"):
            want = (float(one[key]) + 3 * float(three[key])) / 4
            assert line[key] == pytest.approx(want, rel=1e-5), (type(config).__name__, key)
            apart.append(want != pytest.approx((float(one[key]) + float(three[key])) / 2, rel=1e-3))
        assert any(apart)  # the weighting shows: not a mean of the calls' means
        assert line["skipped_critic"] == 0.0

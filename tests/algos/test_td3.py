"""TD3 with an MLP actor (rlfunc.algos.td3): the learner state, delayed actor and target updates, the
Polyak rate, bounded actions, config checks."""

import pytest
import torch

from rlfunc.algos.td3 import TD3Config, make_td3, preset
from rlfunc.config import replace
from rlfunc.errors import ConfigError

from test_sac import CPU, SPEC, _buffer, _leaves, one_thread  # noqa: F401 (one_thread: an autouse fixture)


def _config(**kw) -> TD3Config:
    return replace(TD3Config(), **{"hidden": (16, 16), "batch_size": 32, "device": "cpu", **kw})


def test_the_learner_state_holds_both_targets_and_both_chains():
    state = make_td3(_config(), SPEC, CPU).init()
    assert set(state.keys()) == {"params", "target", "optim_actor", "optim_critic", "rng", "iteration", "env_steps", "updates"}
    assert set(state["target"].keys()) == {"actor", "critic"}
    assert state["params", "critic", "0", "weight"].shape == (2, 16, 5)
    for group in ("actor", "critic"):
        for key, value in state["target", group].items(True, True):
            assert torch.equal(value, state["params", group, key])


def test_the_actor_and_the_targets_move_only_every_policy_delay_steps_the_targets_by_tau():
    config = _config(policy_delay=2, tau=0.05)
    algo = make_td3(config, SPEC, CPU)
    state = algo.init()
    buffer, gen = _buffer(), torch.Generator().manual_seed(0)
    start = _leaves(state)
    state, metrics = algo.iteration(state, buffer, gen, 1)  # update 1: the critics only
    one = _leaves(state)
    assert "loss_actor" not in metrics.keys()
    for key in start:
        if key[:2] == ("params", "critic"):
            assert not torch.equal(start[key], one[key]), key
        elif key[0] in ("params", "target"):
            assert torch.equal(start[key], one[key]), key
    state, metrics = algo.iteration(state, buffer, gen, 1)  # update 2: the actor, then the targets
    two = _leaves(state)
    assert "loss_actor" in metrics.keys()
    for key in start:
        if key[:2] == ("params", "actor"):
            assert not torch.equal(one[key], two[key]), key
        if key[0] == "target":
            online = two[("params", *key[1:])]
            torch.testing.assert_close(two[key], one[key] + config.tau * (online - one[key]), rtol=0, atol=1e-6)
    state, _ = algo.iteration(state, buffer, gen, 5)  # updates 3..7: the actor steps at 4 and 6
    steps = {int(v) for k, v in state["optim_actor"].items(True, True) if "step" in k}
    assert steps == {3} and int(state["updates"]) == 7
    assert {int(v) for k, v in state["optim_critic"].items(True, True) if "step" in k} == {7}


def test_exploration_stays_within_the_bounds_and_deterministic_actions_are_the_actors():
    algo = make_td3(_config(exploration_noise=5.0), SPEC, CPU)
    state = algo.init()
    obs = torch.randn(300, 3)
    act, _ = algo.policy(state, torch.Generator().manual_seed(0))(obs)
    assert (act[:, 0].abs() <= 2).all() and (act[:, 1] >= -1).all() and (act[:, 1] <= 3).all()
    assert ((act[:, 0].abs() == 2).float().mean() > 0.5)  # noise 5x the box: mostly clipped
    det, _ = algo.policy(state, None, deterministic=True)(obs)
    assert torch.equal(det, algo.policy(state, None, deterministic=True)(obs)[0])


@pytest.mark.parametrize("kw, message", [
    (dict(policy_delay=0), "policy_delay=0"), (dict(noise_clip=-1.0), "noise_clip=-1.0"), (dict(n_step=2), "n_step=2"),
    (dict(precision="bf16"), "run.precision='bf16'"), (dict(batch_size=0), "batch_size=0"),
])
def test_bad_config_is_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        _config(**kw)


def test_presets_follow_rl_zoo():
    pendulum = preset("Pendulum-v1")
    assert (pendulum.gamma, pendulum.learning_starts, pendulum.buffer_size, pendulum.hidden) == (0.98, 10_000, 200_000, (400, 300))
    assert preset("HalfCheetah-v5").learning_starts == 10_000

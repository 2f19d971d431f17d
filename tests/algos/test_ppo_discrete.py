"""PPO's categorical actor (issue 17, item 4): Discrete and MultiDiscrete actions.

The policy's log-probabilities, the loss's and the entropy against torch.distributions.Categorical;
int64 actions of the right shape in the batch and start + index in the env; one update on a
MultiDiscrete env; gSDE refused; data parallel (the rows of the uniforms; 2 gloo ranks = 1 process)."""

from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlfunc.algos.ppo import make_ppo, preset
from rlfunc.core import func
from rlfunc.envs import collect
from rlfunc.errors import ConfigError
from rlfunc.run.ppo import _generators, env_spec

CPU = torch.device("cpu")
TWO_HEADS = "CartPoleTwoHeads-v0"  # CartPole with MultiDiscrete([2, 3]) actions, starts (0, 1)


class TwoHeads(gym.ActionWrapper):
    """CartPole-v1 acting on MultiDiscrete([2, 3], start=[0, 1]): head 0 pushes, head 1 (values 1..3) is
    ignored; an action outside the space fails the step (so the collector's start offset is checked)."""

    def __init__(self, env):
        super().__init__(env)
        self.action_space = gym.spaces.MultiDiscrete([2, 3], start=[0, 1])

    def action(self, action):
        assert self.action_space.contains(np.asarray(action)), action
        return int(action[0])


if TWO_HEADS not in gym.registry:
    gym.register(TWO_HEADS, entry_point=lambda **kw: TwoHeads(gym.make("CartPole-v1", **kw)))


def _spec(env):
    venv = collect.make_vec_env(env, 1)
    try:
        return env_spec(venv)
    finally:
        venv.close()


def _config(env="CartPole-v1", **kw):
    base = dict(num_envs=4, num_steps=32, minibatch_size=128, num_epochs=1, num_seeds=2, device="cpu")
    return preset(env, **{**base, **kw})


def _rollout(config, log_prob=True, obs_stats=None):
    S, N, T = config.run.num_seeds, config.num_envs, config.num_steps
    venv = collect.make_vec_env(config.env, S * N)
    try:
        spec = env_spec(venv)
        algo = make_ppo(config, spec, CPU)
        state = algo.init()
        if obs_stats is not None:
            state["obs_stats"] = obs_stats
        gens = _generators(state, CPU)
        batch, _ = collect.rollout(venv, algo.policy(state, gens, log_prob=log_prob), collect.reset(venv, range(S * N)), T, device=CPU)
        return spec, algo, state, gens, batch.reshape(S, N, T)
    finally:
        venv.close()


def _reference(algo, state, batch, heads, config):
    """(log pi(a|s) [S, N, T, 1], entropy [S, N, T, 1]) from torch.distributions.Categorical in float64,
    the heads independent (sums over heads)."""
    from rlfunc.core.normalize import normalize

    logp, ent = [], []
    for s in range(config.run.num_seeds):
        obs = batch["observation"][s]
        if config.normalize_observations:
            obs = normalize(state["obs_stats"][s], obs, clip=config.obs_clip)
        logits, _ = func.apply(algo.net, state["params"][s], obs)
        action = batch["action"][s]
        action = action.unsqueeze(-1) if action.ndim == 2 else action
        lp = et = 0
        for h, x in enumerate(logits.double().split(heads, -1)):
            dist = torch.distributions.Categorical(logits=x)
            lp = lp + dist.log_prob(action[..., h])
            et = et + dist.entropy()
        logp.append(lp.unsqueeze(-1))
        ent.append(et.unsqueeze(-1))
    return torch.stack(logp), torch.stack(ent)


@pytest.mark.parametrize("env, heads", [("CartPole-v1", [2]), (TWO_HEADS, [2, 3])])
def test_log_prob_and_entropy_equal_torch_categorical(env, heads):
    from rlfunc.core.normalize import update_running_stats

    config = _config(env, normalize_observations=True)
    stats = func.vmap(update_running_stats)(make_ppo(config, _spec(env), CPU).init()["obs_stats"],
                                            torch.randn(2, 50, 4) * 0.5)
    spec, algo, state, gens, batch = _rollout(config, obs_stats=stats)
    assert spec.action_kind == ("discrete" if len(heads) == 1 else "multi_discrete") and spec.nvec == tuple(heads)
    assert set(state["params"].keys()) == {"actor", "critic"}  # no log_std
    assert state["params", "actor", "4", "weight"].shape == (2, sum(heads), 64)  # n or sum(nvec) logits
    want_shape = (2, 4, 32) if len(heads) == 1 else (2, 4, 32, len(heads))
    assert batch["action"].dtype == torch.int64 and batch["action"].shape == want_shape
    for h, n in enumerate(heads):
        a = batch["action"] if len(heads) == 1 else batch["action"][..., h]
        assert 0 <= int(a.min()) and int(a.max()) < n  # indices from 0 (the env gets start + index)
    logp, entropy = _reference(algo, state, batch, heads, config)
    torch.testing.assert_close(batch["sample_log_prob"].double(), logp, atol=1e-5, rtol=1e-5)  # the policy's
    # the loss's: one epoch of one minibatch = the batch, before any step: the ratio is 1 and "entropy" the batch mean
    _, metrics = algo.iteration(state, batch, gens)
    assert int(metrics["updates"][0]) == 1
    torch.testing.assert_close(metrics["entropy"].double(), entropy.mean((1, 2, 3)), atol=1e-5, rtol=1e-5)
    assert float(metrics["approx_kl"].abs().max()) < 1e-6 and float(metrics["clip_fraction"].max()) == 0.0


def test_multi_discrete_takes_an_update_and_the_loss_recomputes_the_log_prob():
    # The trainer's rollout (log_prob=False) leaves the log-probabilities to iteration: same draws,
    # same update as with the per-step log-probabilities, to rounding; and the parameters move.
    config = _config(TWO_HEADS, num_epochs=2, minibatch_size=64)
    out = {}
    for with_log_prob in (True, False):
        _, algo, state, gens, batch = _rollout(config, log_prob=with_log_prob)
        start = func.leaves(state["params"])[0].clone()
        new, metrics = algo.iteration(state, batch, gens)
        out[with_log_prob] = batch["action"], new["params"]
        assert int(metrics["updates"][0]) == 4 and bool(metrics["loss_objective"].isfinite().all())
        assert not torch.equal(func.leaves(new["params"])[0], start)
    assert torch.equal(out[True][0], out[False][0])
    for a, b in zip(func.leaves(out[True][1]), func.leaves(out[False][1])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_deterministic_actions_are_the_mode():
    config = _config(TWO_HEADS)
    spec = _spec(TWO_HEADS)
    algo = make_ppo(config, spec, CPU)
    state = algo.init()
    with torch.no_grad():  # logits far from uniform
        for leaf in func.leaves(state["params"]["actor"]):
            leaf.normal_(generator=torch.Generator().manual_seed(0))
    obs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    action, logp = algo.policy(state, [], deterministic=True)(obs)
    logits = torch.stack([func.apply(algo.net.actor, state["params"]["actor"][s], obs.view(2, 4, 4)[s]) for s in range(2)])
    want = torch.stack([x.argmax(-1) for x in logits.split([2, 3], -1)], -1).reshape(8, 2)
    assert action.dtype == torch.int64 and torch.equal(action, want) and torch.equal(logp, torch.zeros(8, 1))


def test_gsde_on_discrete_actions_is_a_config_error():
    spec = _spec("CartPole-v1")
    with pytest.raises(ConfigError, match="exploration='gsde'.*discrete"):
        make_ppo(_config(exploration="gsde"), spec, CPU)
    # flags pass: --init-log-std on CartPole was taken, recorded in config.json and changed nothing; a new run
    # refuses it, a saved one with it still builds (to evaluate and resume)
    from rlfunc.algos.ppo import check_new_run

    with pytest.raises(ConfigError, match=r"init_log_std=3.0: env='CartPole-v1' has discrete actions, whose categorical policy has no log std"):
        check_new_run(_config(init_log_std=3.0), spec)
    make_ppo(_config(init_log_std=3.0), spec, CPU)


@pytest.mark.parametrize("env", ["CartPole-v1", TWO_HEADS])
def test_each_rank_draws_the_uniforms_of_its_envs(env):
    # data parallel: rank r's policy on its envs' observations acts as the single process's on envs
    # 2r, 2r+1 (it draws the uniforms for all 4 envs and keeps its rows); the generators stay in step
    config = _config(env)
    spec = _spec(env)
    obs = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))
    single = make_ppo(config, spec, CPU)
    state = single.init()
    with torch.no_grad():
        for leaf in func.leaves(state["params"]["actor"]):
            leaf.mul_(30.0)  # logits of a few units: the draws depend on the state
    gens = _generators(state, CPU)
    act = single.policy(state, gens)
    want = [act(obs.reshape(-1, 4)) for _ in range(5)]
    for r in range(2):
        algo = make_ppo(config, spec, CPU, SimpleNamespace(world_size=2, rank=r, group=None))
        rank_gens = _generators(state, CPU)
        act = algo.policy(state, rank_gens)
        for action, logp in want:
            got, got_logp = act(obs[:, 2 * r:2 * r + 2].reshape(-1, 4))
            rows = action.view(2, 4, *action.shape[1:])[:, 2 * r:2 * r + 2].reshape(got.shape)
            assert torch.equal(got, rows)
            torch.testing.assert_close(got_logp, logp.view(2, 4, 1)[:, 2 * r:2 * r + 2].reshape(-1, 1))
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(rank_gens, gens))


def test_a_multi_discrete_run_snapshots_resumes_and_evaluates(tmp_path):
    from rlfunc.run import checkpoint
    from rlfunc.run import train
    from rlfunc.run.ppo import evaluate

    config = preset(TWO_HEADS, total_steps=2 * 64, num_envs=2, num_steps=32, minibatch_size=32, num_epochs=1,
                    checkpoint_every=1, device="cpu")
    full = train(config, tmp_path / "full", progress=False, tensorboard=False, evaluate=False)
    train(config, tmp_path / "part", max_iterations=1, progress=False, tensorboard=False, evaluate=False)
    resumed = train(config, tmp_path / "part", resume=True, progress=False, tensorboard=False, evaluate=False)
    for a, b in zip(func.leaves(full.state), func.leaves(resumed.state)):
        assert torch.equal(a, b)
    meta = checkpoint.load_meta(checkpoint.latest_snapshot(tmp_path / "full"))
    assert meta["env_spec"]["action_kind"] == "multi_discrete" and meta["env_spec"]["nvec"] == [2, 3]
    assert meta["env_spec"]["action_low"] == [0.0, 1.0] and meta["env_spec"]["action_high"] == [1.0, 3.0]
    result = evaluate(tmp_path / "full", episodes=2, device="cpu")
    assert result["episodes"] == 2 and result["mean"] >= 8


def _two_iterations(config, dist=None):
    """(learner state, [actions of each rollout]) of 2 rollouts + updates; with ``dist`` this rank's
    envs of every seed (envs rank*N/W ... of the single process's), as tests/algos/test_ppo_data_parallel.py."""
    W, r = (1, 0) if dist is None else (dist.world_size, dist.rank)
    S, N, T = config.run.num_seeds, config.num_envs // W, config.num_steps
    seeds = [s for seed in config.seeds for s in collect.env_seeds(seed, config.num_envs)[r * N:(r + 1) * N]]
    venv = collect.make_vec_env(config.env, S * N)
    try:
        algo = make_ppo(config, env_spec(venv), CPU, dist)
        state, carry, actions = algo.init(), collect.reset(venv, seeds), []
        for _ in range(2):
            gens = _generators(state, CPU)
            batch, carry = collect.rollout(venv, algo.policy(state, gens, log_prob=False), carry, T, device=CPU)
            actions.append(batch.reshape(S, N, T)["action"])
            state, _ = algo.iteration(state, batch.reshape(S, N, T), gens)
        return state, actions
    finally:
        venv.close()


def _dp_config(env):
    return _config(env, num_steps=16, minibatch_size=16, num_epochs=2, normalize_observations=True, normalize_rewards=True)


def _rank(dist, env, out_dir):
    torch.use_deterministic_algorithms(True)
    state, actions = _two_iterations(_dp_config(env), dist)
    dist.check_in_sync(state, "after two iterations")
    torch.save({"state": {k: v.detach().clone() for k, v in state.items(True, True)}, "actions": actions},
               f"{out_dir}/rank{dist.rank}.pt")


@pytest.mark.parametrize("env", ["CartPole-v1", TWO_HEADS])
def test_two_ranks_with_two_envs_each_equal_one_process_with_four(env, gloo, tmp_path):
    gloo(_rank, env, str(tmp_path))
    torch.use_deterministic_algorithms(True)
    state, actions = _two_iterations(_dp_config(env))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for it, a in enumerate(actions):  # the same draws: int64 actions, exactly
        assert torch.equal(torch.cat([ranks[0]["actions"][it], ranks[1]["actions"][it]], 1), a)
    for key, value in state.items(True, True):
        for got in ranks:
            if value.is_floating_point():
                torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(got["state"][key], value), key


def test_a_batch_that_is_not_the_configured_rollout_is_named():
    """New-user pass: a hand-made batch of T=15 where num_steps=16 trained on part of it, silently
    (2 minibatches of 32 of 60 samples); the others were deep errors (a narrow, a stack, `~` of a float)."""
    import re

    from rlfunc.errors import ShapeError

    config = _config(num_steps=16, minibatch_size=32)
    _, algo, state, gens, batch = _rollout(config)
    with pytest.raises(ShapeError, match=re.escape("batch of batch size [2, 4, 15], expected [2, 4, 16] (seeds, num_envs, num_steps)")):
        algo.iteration(state, batch[:, :, :15], gens)
    for key, value, message in [
        (("next", "done"), batch["next", "done"].float(), "('next', 'done') has dtype torch.float32, expected torch.bool"),
        (("next", "reward"), batch["next", "reward"].squeeze(-1), "('next', 'reward') has shape [2, 4, 16], expected [2, 4, 16, 1]"),
        ("observation", batch["observation"].double(), "'observation' has dtype torch.float64, expected torch.float32"),
    ]:
        bad = batch.exclude(key)
        bad.set(key, value)
        with pytest.raises(ShapeError, match=re.escape(message)):
            algo.iteration(state, bad, gens)
    with pytest.raises(ShapeError, match=re.escape("batch has no ('next', 'terminated')")):
        algo.iteration(state, batch.exclude(("next", "terminated")), gens)
    with pytest.raises(ShapeError, match=re.escape("1 generators, expected one per seed (2)")):
        algo.iteration(state, batch, gens[:1])
    algo.iteration(state, batch, gens)  # the batch itself passes


def test_without_an_entropy_bonus_the_entropy_stays_out_of_the_graph_and_the_update_is_unchanged():
    # entropy_coef 0 computes the entropy as a metric outside the graph (the backward skips it): the
    # update equals the one with the entropy in the graph at a coefficient too small to move a float32
    # gradient (1e-30), bit for bit, and the metric is the same
    out = {}
    for coef in (0.0, 1e-30):
        config = _config(num_epochs=2, minibatch_size=64, entropy_coef=coef)
        _, algo, state, gens, batch = _rollout(config)
        new, metrics = algo.iteration(state, batch, gens)
        out[coef] = func.leaves(new["params"]), metrics["entropy"]
    for a, b in zip(out[0.0][0], out[1e-30][0]):
        assert torch.equal(a, b)
    assert torch.equal(out[0.0][1], out[1e-30][1]) and bool((out[0.0][1] > 0).all())


def test_cartpole_preset_versions_every_10_iterations():
    """CartPole-v1's iterations are 256 env steps: a version each (~15 ms) was ~40% of the CLI's training
    time, so its preset versions every 10; a flag still sets it, and the rest of ppo's run defaults stay."""
    from rlfunc.algos.ppo import preset

    config = preset("CartPole-v1")
    assert (config.run.version_every, config.run.eval_episodes) == (10, 100)
    assert preset("CartPole-v1", version_every=1).run.version_every == 1
    assert preset("Pendulum-v1").run.version_every == 1

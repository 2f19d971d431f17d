"""mappo data-parallel: 2 gloo ranks, each stepping half of the warehouses (all agents of a warehouse
on one rank) and holding half of every minibatch, equal the single process: "every parameter within
1e-6 (float32), integer and generator state exact".

One iteration (2 epochs of 2 minibatches) on the single process's rollout of 4 small warehouses of 2
AGVs, each rank given its 2 warehouses of it: ppo with the centralised ("mean") critic, 8 steps of
6-step episodes (every warehouse resets mid-rollout, so the ranks' env generators must draw together),
and grpo, one group of 2 per rank. Each rank's own rollout (its split of the env, its rows of the
action uniforms) is the single process's rows."""

import pytest
import torch

from rlfunc.algos.mappo import MAPPOConfig, make_mappo, state_value
from rlfunc.config import replace
from rlfunc.errors import ConfigError

CPU = torch.device("cpu")
N, T = 4, 8
SMALL_LAYOUT = ("P......D", "..#..#..", "P......D")


def _leaves(state):
    return {k: v.detach().clone() for k, v in state.items(include_nested=True, leaves_only=True)}


def _config(loss):
    return replace(MAPPOConfig(), loss=loss, critic="mean", n_agents=2, num_envs=N, rollout_steps=T, episode_steps=T,
                   group_size=2, num_epochs=2, num_minibatches=2, hidden=(16,), total_steps=4 * N * T, compile="off",
                   device="cpu")


def _rollout(config, algo, state, env, gen):
    from rlfunc.envs.grouped import grouped_reset
    from rlfunc.run.mappo import collect

    policy = lambda obs, mask: algo.act(state, obs, mask, gen)  # noqa: E731
    carry = env.reset() if config.loss == "ppo" else grouped_reset(env, config.group_size)
    batch, _ = collect(env, policy, carry, T)
    if config.loss == "ppo":
        with torch.no_grad():
            batch["next", "state_value"] = state_value(algo.nets, state["params"], batch["next", "agents", "observation"], config.critic)
    del batch["next", "agents", "observation"]
    return batch


def _setup(loss, dist=None):
    """(algo, its initial state, the single process's rollout [N, T], the generator after it, this
    rank's own rollout or None)."""
    from envs.warehouse import WarehouseConfig, WarehouseEnv

    config = _config(loss)
    small = WarehouseConfig(n_agents=2, layout=SMALL_LAYOUT, obs_radius=1, max_steps=6 if loss == "ppo" else T)
    env = WarehouseEnv(N, small, seed=0)
    obs_dim, n_actions = env.observation_spec["agents", "observation"].shape[-1], env.action_spec["agents", "action"].n
    single = make_mappo(config, obs_dim, 2, n_actions, CPU)
    state = single.init()
    gen = torch.Generator().manual_seed(1)
    batch = _rollout(config, single, state, env, gen)
    if dist is None:
        return single, state, batch, gen, None
    W, r = dist.world_size, dist.rank
    algo = make_mappo(config, obs_dim, 2, n_actions, CPU, dist)
    own_gen = torch.Generator().manual_seed(1)
    own_env = WarehouseEnv(N // W, small, seed=0, split=(r, W), any_done_of_split=dist.any_rank)
    own = _rollout(config, algo, state, own_env, own_gen)
    assert torch.equal(own_gen.get_state(), gen.get_state())  # the ranks drew the uniforms of every env
    assert torch.equal(own_env.rng_state(), env.rng_state())  # and the env's resets of every env
    return algo, state, batch, own_gen, own


def _rank(dist, loss, out_dir):
    W, r = dist.world_size, dist.rank
    algo, state, batch, gen, own = _setup(loss, dist)
    half = batch[r * N // W:(r + 1) * N // W]
    for key in own.keys(include_nested=True, leaves_only=True):
        torch.testing.assert_close(own[key], half[key], rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    state, metrics = algo.iteration(state, half, gen)
    dist.check_in_sync(state, "after one iteration")
    torch.save((_leaves(state), metrics, gen.get_state()), f"{out_dir}/{loss}{r}.pt")


@pytest.mark.parametrize("loss", ["ppo", "grpo"])
def test_two_ranks_with_half_of_the_warehouses_equal_one_process(gloo, tmp_path, loss):
    gloo(_rank, loss, str(tmp_path))
    algo, state, batch, gen, _ = _setup(loss)
    state, metrics = algo.iteration(state, batch, gen)
    want = _leaves(state)
    worst = 0.0
    for r in range(2):
        got, got_metrics, got_rng = torch.load(tmp_path / f"{loss}{r}.pt")
        assert torch.equal(got_rng, gen.get_state())
        assert set(got) == set(want)  # the single process's layout
        for key, value in want.items():
            if not value.is_floating_point():  # counters: exact
                assert torch.equal(got[key], value), key
                continue
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
            if key[0] == "params":
                worst = max(worst, float((got[key] - value).abs().max()))
        assert set(got_metrics) == set(metrics)
        for name in ("loss_objective", "approx_kl", "grad_norm", *(("explained_variance",) if loss == "ppo" else ())):
            assert abs(got_metrics[name] - metrics[name]) < 1e-5, name  # explained_variance: pooled from the shares' parts
    assert int(want["env_steps"]) == N * T  # counted over every rank's warehouses
    print(loss, f"max |difference| of a parameter: {worst:.1e}")


def test_data_parallel_config_errors():
    from types import SimpleNamespace

    with pytest.raises(ConfigError, match="num_envs=4 does not divide by the 3 ranks"):
        replace(_config("ppo"), nproc=3)
    with pytest.raises(ConfigError, match="num_envs/group_size=2 does not divide by the 4 ranks"):
        replace(_config("grpo"), nproc=4)
    with pytest.raises(ConfigError, match="num_minibatches=3: its minibatches of 21 samples do not divide by the 2 ranks"):
        replace(_config("ppo"), num_minibatches=3, nproc=2)
    with pytest.raises(ConfigError, match="compile='on' with nproc=2"):
        replace(_config("ppo"), compile="on", nproc=2)
    with pytest.raises(ConfigError, match="env='rware-tiny-2ag-v2' with nproc=2: .* splits a torch-batched env \\(Warehouse-v0\\)"):
        replace(_config("ppo"), env="rware-tiny-2ag-v2", nproc=2)
    with pytest.raises(ConfigError, match="num_envs=4 does not divide by the 3 ranks"):
        make_mappo(_config("ppo"), 6, 2, 5, CPU, SimpleNamespace(world_size=3, rank=0, group=None))

"""grpo / gspo data-parallel: 2 gloo ranks, each holding half of the groups and half of every
minibatch, equal the single process: "every parameter within 1e-6 (float32), integer and generator
state exact".

One iteration (2 epochs of 2 minibatches of 8 episodes) on the single process's grouped rollout of
4 groups x 4 PointReach envs, each rank given its 2 groups; the episodes are cut at random lengths
(the mask), so each rank's share of a minibatch has its own number of valid steps and the "token"
means (grpo's default aggregation, the metrics) must be weighted to equal the whole minibatch's. Each
rank's own rollout (its split of the torch-batched env, its rows of the noise) is the single
process's rows."""

import pytest
import torch

from rlfunc.algos.grpo import GRPOConfig, make_grpo
from rlfunc.config import replace
from rlfunc.errors import ConfigError

CPU = torch.device("cpu")
N_GROUPS, G, T = 4, 4, 8


def _leaves(state):
    return {k: v.detach().clone() for k, v in state.items(include_nested=True, leaves_only=True)}


def _config(loss, **overrides):
    return replace(GRPOConfig(), **{**dict(env="PointReach-v0", loss=loss, num_groups=N_GROUPS, group_size=G, max_episode_steps=T,
                                           minibatch_size=8, num_epochs=2, hidden=(32, 32), kl_coef=0.1, compile="off",
                                           device="cpu"), **overrides})


def _setup(loss, dist=None):
    """(algo, its initial state, the single process's batch [1, n, G, T] with random episode lengths,
    the generators after the rollout, this rank's own rollout or None)."""
    from rlfunc.run.grpo import _rollout_env, _spec
    from rlfunc.run.ppo import _generators

    config = _config(loss)
    spec = _spec(config.env)
    single = make_grpo(config, spec, CPU)
    state = single.init()
    gens = _generators(state, CPU)
    batch = _rollout_env(config, CPU).rollout(single.policy(state, gens), 0)
    lengths = torch.randint(1, T + 1, (1, N_GROUPS, G, 1, 1), generator=torch.Generator().manual_seed(3))
    batch["mask"] = batch["mask"] & (torch.arange(T).view(1, 1, 1, T, 1) < lengths)
    if dist is None:
        return single, state, batch, gens, None
    algo = make_grpo(config, spec, CPU, dist)
    own_gens = _generators(state, CPU)
    own = _rollout_env(config, CPU, dist).rollout(algo.policy(state, own_gens), 0)
    for g, h in zip(gens, own_gens):  # the ranks drew the noise of every env, as the single process
        assert torch.equal(g.get_state(), h.get_state())
    return algo, state, batch, own_gens, own


def _rank(dist, loss, out_dir):
    W, r = dist.world_size, dist.rank
    algo, state, batch, gens, own = _setup(loss, dist)
    half = batch[:, r * N_GROUPS // W:(r + 1) * N_GROUPS // W]
    for key in ("observation", "action", "sample_log_prob", ("next", "reward")):
        torch.testing.assert_close(own[key], half[key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    state, metrics = algo.iteration(state, half, gens)
    dist.check_in_sync(state, "after one iteration")
    torch.save((_leaves(state), metrics.to_dict()), f"{out_dir}/{loss}{r}.pt")


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_two_ranks_with_half_of_the_groups_equal_one_process(gloo, tmp_path, loss):
    gloo(_rank, loss, str(tmp_path))
    algo, state, batch, gens, _ = _setup(loss)
    state, metrics = algo.iteration(state, batch, gens)
    want = _leaves(state)
    worst = 0.0
    for r in range(2):
        got, got_metrics = torch.load(tmp_path / f"{loss}{r}.pt")
        assert set(got) == set(want)  # the single process's layout
        for key, value in want.items():
            if not value.is_floating_point():  # generator states, counters: exact
                assert torch.equal(got[key], value), key
                continue
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
            if key[0] == "params":
                worst = max(worst, float((got[key] - value).abs().max()))
        for name, value in metrics.items():
            torch.testing.assert_close(got_metrics[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert int(want["env_steps"]) == N_GROUPS * G * T  # counted over every rank's groups
    print(loss, f"max |difference| of a parameter: {worst:.1e}")


def test_data_parallel_config_errors():
    from types import SimpleNamespace

    with pytest.raises(ConfigError, match="num_groups=4 does not divide by the 3 ranks"):
        _config("grpo", minibatch_size=4, nproc=3)
    with pytest.raises(ConfigError, match="minibatch_size=2 does not divide by the 4 ranks"):
        _config("grpo", minibatch_size=2, nproc=4)
    with pytest.raises(ConfigError, match="compile='on' with nproc=2"):
        _config("gspo", compile="on", nproc=2)
    with pytest.raises(ConfigError, match="gradient shaping is not data-parallel"):
        _config("grpo", adaptive_clip=True, nproc=2)
    with pytest.raises(ConfigError, match="num_seeds=2 with nproc=2"):
        _config("grpo", num_seeds=2, nproc=2)
    _config("grpo", num_seeds=2, nproc=2, backend="gym")  # gymnasium envs split by each seed's groups
    from rlfunc.run.grpo import _spec

    with pytest.raises(ConfigError, match="num_groups=4 does not divide by the 3 ranks"):
        make_grpo(_config("grpo"), _spec("PointReach-v0"), CPU, SimpleNamespace(world_size=3, rank=0, group=None))


def test_a_rank_of_the_gymnasium_backend_steps_each_seeds_groups_of_the_single_process():
    """backend='gym', 2 seeds: rank r's envs are groups r*n/W.. of each seed (reset with their seeds),
    acting with its rows of each seed's noise; no collective is needed to collect."""
    from types import SimpleNamespace

    from rlfunc.run.grpo import _rollout_env, _spec
    from rlfunc.run.ppo import _generators

    config = replace(_config("grpo"), backend="gym", num_seeds=2, max_episode_steps=4)
    spec = _spec(config.env)
    single = make_grpo(config, spec, CPU)
    state = single.init()
    gens = _generators(state, CPU)
    want = _rollout_env(config, CPU).rollout(single.policy(state, gens), 3)  # [2, n, G, T]
    for r in range(2):
        dist = SimpleNamespace(world_size=2, rank=r, group=None, active=True)
        algo = make_grpo(config, spec, CPU, dist)
        own_gens = _generators(state, CPU)
        got = _rollout_env(config, CPU, dist).rollout(algo.policy(state, own_gens), 3)
        half = want[:, r * N_GROUPS // 2:(r + 1) * N_GROUPS // 2]
        for key in ("observation", "action", "sample_log_prob", ("next", "reward"), "mask"):
            torch.testing.assert_close(got[key], half[key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
        assert all(torch.equal(g.get_state(), h.get_state()) for g, h in zip(gens, own_gens))


def test_a_rank_whose_episodes_ended_sooner_draws_and_repeats_its_last_step():
    """grouped_rollout_torchrl with ``longest`` (the ranks' longest rollout): the missing steps are
    the last one repeated (an ended env of a batch that goes on is absorbing, as TorchRL keeps it),
    and the policy is called for each of them (its draws)."""
    from envs.point_reach import PointReachEnv
    from rlfunc.envs.grouped import grouped_rollout_torchrl

    calls = []

    def policy(observation):
        calls.append(observation.shape[0])
        return torch.zeros(observation.shape[0], 2), torch.zeros(observation.shape[0], 1)

    env = PointReachEnv(4, seed=0)
    td = grouped_rollout_torchrl(env, policy, 2, 40, longest=lambda steps: steps + 3)  # truncated after 30 steps
    assert td.batch_size == (2, 2, 33) and calls == [4] * 33
    for t in (30, 31, 32):
        assert (td[:, :, t].exclude("mask") == td[:, :, 29].exclude("mask")).all()
    assert td["mask"][:, :, 29].all() and not td["mask"][:, :, 30:].any()  # the repeated end is not a step of the episode

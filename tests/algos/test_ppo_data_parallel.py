"""PPO data-parallel (issue 16): 2 ranks with 2 envs each equal one process with the 4 envs.

"For ppo, one update with 2 ranks each holding half of every minibatch equals the single-process
update on the whole minibatch: every parameter within 1e-6 (float32)." Here two whole iterations
(rollout on Pendulum-v1 + update), so the second also checks the merged normaliser statistics and
the noise rows the ranks draw."""

from types import SimpleNamespace

import pytest
import torch

from rlfunc.algos.ppo import make_ppo, preset
from rlfunc.envs import collect
from rlfunc.errors import ConfigError
from rlfunc.run.ppo import _generators, env_spec

CPU = torch.device("cpu")
CASES = {
    "gaussian-2-seeds": dict(exploration="gaussian", num_seeds=2),
    "gsde-1-seed": dict(exploration="gsde", sde_sample_freq=4, num_seeds=1),
}


def _config(**kw):
    base = dict(num_envs=4, num_steps=16, minibatch_size=16, num_epochs=2, total_steps=64 * 4, device="cpu",
                normalize_observations=True, normalize_rewards=True, anneal_lr=True, lr=1e-3)
    return preset("Pendulum-v1", **{**base, **kw})


def _run(config, dist=None, iterations=2):
    """(final learner state, [actions of each rollout]) of ``iterations`` rollouts + updates; with
    ``dist`` this rank's envs of every seed (envs rank*N/W ... of the single process's)."""
    W, r = (1, 0) if dist is None else (dist.world_size, dist.rank)
    S, N, T = config.run.num_seeds, config.num_envs // W, config.num_steps
    seeds = [collect.env_seeds(seed, config.num_envs)[r * N:(r + 1) * N] for seed in config.seeds]
    venv = collect.make_vec_env(config.env, S * N)
    try:
        algo = make_ppo(config, env_spec(venv), CPU, dist)
        state = algo.init()
        carry = collect.reset(venv, [s for member in seeds for s in member])
        actions = []
        for _ in range(iterations):
            gens = _generators(state, CPU)
            batch, carry = collect.rollout(venv, algo.policy(state, gens, log_prob=False), carry, T, device=CPU)
            batch = batch.reshape(S, N, T)
            actions.append(batch["action"])
            state, metrics = algo.iteration(state, batch, gens)
        return state, actions, metrics
    finally:
        venv.close()


def _leaves(state):
    return {k: v.detach().clone() for k, v in state.items(include_nested=True, leaves_only=True)}


def _rank(dist, case, out_dir):
    torch.use_deterministic_algorithms(True)
    state, actions, metrics = _run(_config(**CASES[case]), dist)
    dist.check_in_sync(state, "after two iterations")  # the same learner state on both ranks
    torch.save({"state": _leaves(state), "actions": actions, "metrics": metrics.to_dict()}, f"{out_dir}/rank{dist.rank}.pt")


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_with_two_envs_each_equal_one_process_with_four(case, gloo, tmp_path):
    gloo(_rank, case, str(tmp_path))
    torch.use_deterministic_algorithms(True)
    config = _config(**CASES[case])
    state, actions, metrics = _run(config)
    want = _leaves(state)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert set(ranks[0]["state"]) == set(want)  # the single process's layout
    worst = {}
    for key, value in want.items():
        for got in ranks:
            other = got["state"][key]
            if not value.is_floating_point():
                assert torch.equal(other, value), key  # rng states, iteration, env_steps: exact
                continue
            torch.testing.assert_close(other, value, rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
            worst[key] = max(worst.get(key, 0.0), float((other - value).abs().max()))
    print(case, "max |difference| per leaf:", {"/".join(k) if isinstance(k, tuple) else k: f"{v:.1e}" for k, v in worst.items()})
    # the rollouts: the same actions (the noise rows: test_each_rank_draws_the_noise_of_its_envs), to the
    # rounding of the actor's matmul over 2 rows against 4 (3e-8), grown along the pendulum's trajectory
    for it, a in enumerate(actions):
        joined = torch.cat([ranks[0]["actions"][it], ranks[1]["actions"][it]], 1)
        torch.testing.assert_close(joined, a, rtol=1e-4, atol=1e-4)
    assert set(ranks[0]["metrics"]) == set(metrics.keys()) | {"allreduce_s"}  # the explained variance's parts pooled away
    # explained_variance: the minibatch's, pooled from the shares' parts (it was the mean of the shares' values)
    for name in ("loss_objective", "loss_critic", "approx_kl", "clip_fraction", "grad_norm", "explained_variance"):
        torch.testing.assert_close(ranks[0]["metrics"][name], metrics[name], rtol=1e-5, atol=1e-6)
    assert int(state["env_steps"]) == 2 * 4 * 16


def _compiled_rank(dist, out_dir):
    state, _, metrics = _run(_config(compile="on"), dist, iterations=1)
    torch.save({"state": _leaves(state), "metrics": metrics.to_dict()}, f"{out_dir}/rank{dist.rank}.pt")


def test_the_compiled_step_on_two_ranks_equals_the_compiled_single_process(gloo, tmp_path):
    # issue 18's compiled path with issue 16's ranks: each rank runs two graphs (the gradients; the
    # norms, mask and chain) with the one all_reduce_mean between them; the single process one graph
    gloo(_compiled_rank, str(tmp_path))
    state, _, metrics = _run(_config(compile="on"), iterations=1)
    assert float(metrics["compile_s"][0]) > 0
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert float(got["metrics"]["compile_s"][0]) > 0 and float(got["metrics"]["allreduce_s"][0]) > 0
        for key, value in _leaves(state).items():
            if value.is_floating_point():  # within issue 18's 1e-5 of compiled against eager
                torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
            else:
                assert torch.equal(got["state"][key], value), key


def test_a_split_that_does_not_divide_is_a_config_error():
    spec = SimpleNamespace(obs_dim=3, act_dim=1, action_low=[-2.0], action_high=[2.0])
    three = SimpleNamespace(world_size=3, rank=0, group=None)
    with pytest.raises(ConfigError, match="num_envs=4 does not divide by the 3 ranks"):
        make_ppo(_config(), spec, CPU, three)
    with pytest.raises(ConfigError, match="minibatch_size=18 does not divide by the 4 ranks"):
        make_ppo(_config(minibatch_size=18, num_steps=18), spec, CPU, SimpleNamespace(world_size=4, rank=0, group=None))
    with pytest.raises(ConfigError, match="gradient shaping is not data-parallel"):
        make_ppo(_config(prioritized_minibatches=True), spec, CPU, SimpleNamespace(world_size=2, rank=0, group=None))


def test_the_config_refuses_a_split_before_torchrun_starts_the_ranks():
    # Regression (new-user pass): `rlfunc train ppo --shaping ppo-shaped --nproc 2` started both ranks,
    # each printed the refusal, then torchrun's failure lines; the config now refuses it in one line
    from rlfunc.algos.ppo import preset

    with pytest.raises(ConfigError, match="gradient shaping is not data-parallel"):
        preset("Pendulum-v1", shaping="ppo-shaped", nproc=2)
    with pytest.raises(ConfigError, match="num_envs=2 does not divide by the 3 ranks"):
        preset("Pendulum-v1", num_envs=2, nproc=3)
    assert preset("Pendulum-v1", nproc=2).run.nproc == 2


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_draws_the_noise_of_its_envs(case):
    # rank r's policy on its envs' observations acts as the single process's on envs 2r, 2r+1: it draws
    # for all 4 envs and keeps its rows; the generators advance alike (every rank draws the same numbers)
    config = _config(**CASES[case])
    spec = SimpleNamespace(obs_dim=3, act_dim=1, action_low=[-2.0], action_high=[2.0])
    S = config.run.num_seeds
    obs = torch.randn(S, 4, 3, generator=torch.Generator().manual_seed(1))
    single = make_ppo(config, spec, CPU)
    state = single.init()
    gens = _generators(state, CPU)
    act = single.policy(state, gens)
    want = [act(obs.reshape(-1, 3))[0].reshape(S, 4, 1) for _ in range(6)]  # past a gSDE resample (every 4)
    for r in range(2):
        algo = make_ppo(config, spec, CPU, SimpleNamespace(world_size=2, rank=r, group=None))
        rank_gens = _generators(state, CPU)
        act = algo.policy(state, rank_gens)
        for w in want:
            got = act(obs[:, 2 * r:2 * r + 2].reshape(-1, 3))[0].reshape(S, 2, 1)
            torch.testing.assert_close(got, w[:, 2 * r:2 * r + 2], rtol=1e-5, atol=1e-6)  # rows of 2 against 4: rounding
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(rank_gens, gens))


class _SimulatedRanks:
    """An all_reduce_mean link over simulated ranks: the first W calls record each rank's buffers (and
    return them); after ``reduce()`` every call returns the mean over the recorded ranks."""

    def __init__(self):
        self.buffers, self.mean = [], None

    def update_leaves(self, leaves, treedef, state):
        if self.mean is None:
            self.buffers.append(leaves[-1].clone())
            return leaves, state
        return [*leaves[:-1], self.mean], state

    def reduce(self):
        self.mean = torch.stack(self.buffers).mean(0)


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_average_pools_maxima_and_moments_over_the_ranks(world_size):
    # the explained variance of the whole minibatch from W equal shares, also for float32 targets far from 0
    # or all equal (review pass: E[mean^2] - E[mean]^2 cancelled), and a max as the max
    from tensordict import TensorDict

    from rlfunc.algos.data_parallel import average
    from rlfunc.losses.ppo import EV_MAXIMA, EV_MOMENTS, explained_variance, explained_variance_parts, pool_explained_variance

    g = torch.Generator().manual_seed(world_size)
    cases = [(10.0 + torch.randn(48, 1, generator=g), 1.0), (1e4 + torch.randn(48, 1, generator=g), 0.5),
             (torch.full((48, 1), 1.7), 0.01)]
    for target, noise in cases:
        prediction = target + noise * torch.randn(48, 1, generator=g)
        link = _SimulatedRanks()
        shares = list(zip(prediction.chunk(world_size), target.chunk(world_size)))

        def metrics_of(p, t):
            return TensorDict({**explained_variance_parts(p, t), "ratio_max": t.amax(), "loss_critic": t.mean()}, batch_size=[])

        for r, (p, t) in enumerate(shares):  # each rank's buffer
            average(link, [], None, torch.zeros(()), metrics_of(p, t), maxima=("ratio_max", *EV_MAXIMA), moments=EV_MOMENTS,
                    rank=r, world_size=world_size)
        link.reduce()
        _, _, got = average(link, [], None, torch.zeros(()), metrics_of(*shares[1]), maxima=("ratio_max", *EV_MAXIMA),
                            moments=EV_MOMENTS, rank=1, world_size=world_size)
        got = pool_explained_variance(got)
        assert float(got["ratio_max"]) == pytest.approx(float(target.amax()), rel=1e-6)
        assert float(got["loss_critic"]) == pytest.approx(float(target.mean()), rel=1e-5)
        want = float(explained_variance(prediction.double(), target.double()))
        if noise == 0.01:  # equal targets: no spread, 0
            assert float(got["explained_variance"]) == 0.0
        else:
            assert float(got["explained_variance"]) == pytest.approx(want, abs=0.02), (world_size, want)

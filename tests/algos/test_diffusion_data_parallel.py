"""bc and dppo data-parallel (issue 16): 2 gloo ranks, each holding half of every minibatch, equal the
single process on the whole minibatch: "every parameter within 1e-6 (float32)".

bc: two updates on a small dataset. dppo: one iteration (2 epochs of 2 minibatches) on the single
process's rollout of 8 PointReach envs, each rank given its 4 envs of it; and each rank's own rollout
(its split of the env, its rows of the chains' noise) is the single process's rows."""

import pytest
import torch
from tensordict import TensorDict

from rlfunc.algos.bc import BCConfig, make_bc
from rlfunc.algos.diffusion_actor import ActorSpec, check_split, make_env
from rlfunc.algos.dppo import DPPOConfig, make_dppo
from rlfunc.config import replace
from rlfunc.errors import ConfigError, EnvError
from rlfunc.optim.amp import precision

CPU = torch.device("cpu")
SPEC = ActorSpec(hidden=(32, 32), horizon=4, act_steps=4, num_train_steps=8, ddim_steps=4)
N = 8  # envs of the single process


def _leaves(state):
    return {k: v.detach().clone() for k, v in state.items(include_nested=True, leaves_only=True)}


def _compare(got_ranks, want, name):
    worst = 0.0
    for got in got_ranks:
        assert set(got) == set(want)  # the single process's layout
        for key, value in want.items():
            if not value.is_floating_point():
                assert torch.equal(got[key], value), key  # generator states, counters: exact
                continue
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
            if key[0] == "params":
                worst = max(worst, float((got[key] - value).abs().max()))
    print(name, f"max |difference| of a parameter: {worst:.1e}")


# ------------------------------------------------------------------------------------------ bc


def _bc(dist=None):
    config = replace(BCConfig(), actor=SPEC, batch_size=32, micro_batch_size=8, lr=3e-3, device="cpu")
    g = torch.Generator().manual_seed(5)
    dataset = TensorDict({"observation": torch.randn(200, 6, generator=g),
                          "action": torch.rand(200, 4, 2, generator=g) * 2 - 1}, batch_size=[200])
    algo = make_bc(config, 6, 2, CPU, dist)
    state = algo.init(dataset)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        state, metrics = algo.iteration(state, dataset, gen, precision(CPU, "off"))
    return _leaves(state), metrics.to_dict()


def _bc_rank(dist, out_dir):
    torch.save(_bc(dist), f"{out_dir}/bc{dist.rank}.pt")


def test_bc_two_ranks_with_half_of_every_batch_equal_one_process(gloo, tmp_path):
    gloo(_bc_rank, str(tmp_path))
    want, metrics = _bc()
    ranks = [torch.load(tmp_path / f"bc{r}.pt") for r in range(2)]
    _compare([r[0] for r in ranks], want, "bc")
    for name in ("loss_denoise", "grad_norm", "skipped"):
        torch.testing.assert_close(ranks[0][1][name], metrics[name], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- dppo


def _dppo(likelihood, dist=None):
    """(dppo, its initial state, the single process's rollout [N, T], this rank's own rollout)."""
    W, r = (1, 0) if dist is None else (dist.world_size, dist.rank)
    config = replace(DPPOConfig(), actor=SPEC, likelihood=likelihood, num_envs=N, num_steps=4, minibatch_size=16,
                     num_epochs=2, critic_hidden=(32, 32), target_kl=None, total_steps=N * 4 * 4, compile="off", device="cpu")
    single = make_dppo(config, SPEC, 6, 2, CPU)
    state = single.init()
    env = make_env("PointReach-v0", N, SPEC.act_steps, CPU, 0)
    batch = single.rollout(state, env, torch.Generator().manual_seed(1))
    if dist is None:
        return single, state, batch, None
    algo = make_dppo(config, SPEC, 6, 2, CPU, dist)
    own_env = make_env("PointReach-v0", N // W, SPEC.act_steps, CPU, 0, split=(r, W), any_done_of_split=dist.any_rank)
    own = algo.rollout(state, own_env, torch.Generator().manual_seed(1))
    return algo, state, batch, own


def _dppo_rank(dist, likelihood, out_dir):
    torch.use_deterministic_algorithms(True)
    W, r = dist.world_size, dist.rank
    algo, state, batch, own = _dppo(likelihood, dist)
    half = batch[r * N // W:(r + 1) * N // W]
    # its own rollout: the single process's envs r*N/W.. (same starts, noise rows): to the rounding of the
    # denoiser over 4 rows against 8
    for key in ("observation", "action", ("next", "reward"), ("next", "done")):
        torch.testing.assert_close(own[key], half[key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    gen = torch.Generator().manual_seed(2)
    state, metrics = algo.iteration(state, half, gen, precision(CPU, "off"))
    dist.check_in_sync(state, "after one iteration")
    torch.save((_leaves(state), metrics.to_dict()), f"{out_dir}/dppo{r}.pt")


@pytest.mark.parametrize("likelihood", ["chain", "output-noise"])
def test_dppo_two_ranks_with_half_of_every_minibatch_equal_one_process(gloo, tmp_path, likelihood):
    gloo(_dppo_rank, likelihood, str(tmp_path))
    torch.use_deterministic_algorithms(True)
    algo, state, batch, _ = _dppo(likelihood)
    state, metrics = algo.iteration(state, batch, torch.Generator().manual_seed(2), precision(CPU, "off"))
    want = _leaves(state)
    ranks = [torch.load(tmp_path / f"dppo{r}.pt") for r in range(2)]
    _compare([r[0] for r in ranks], want, likelihood)
    assert int(ranks[0][0]["env_steps"]) == N * 4 * SPEC.act_steps  # counted over every rank's envs
    assert set(ranks[0][1]) == set(metrics.keys())  # the explained variance's parts pooled away
    # ratio_max: the max over the ranks (it was the mean of their maxima); explained_variance: pooled from the
    # shares' parts (the mean of the shares' values had the other sign on 8-sample shares)
    for name in ("loss_objective", "loss_critic", "approx_kl", "clip_fraction", "grad_norm", "updates", "ratio_max",
                 "explained_variance"):
        torch.testing.assert_close(ranks[0][1][name], metrics[name], rtol=1e-5, atol=1e-6)


def test_a_split_that_does_not_divide_or_a_compiled_step_is_a_config_error():
    from types import SimpleNamespace

    three = SimpleNamespace(world_size=3, rank=0, group=None)
    with pytest.raises(ConfigError, match="batch_size=32 does not divide by the 3 ranks"):
        make_bc(replace(BCConfig(), actor=SPEC, batch_size=32), 6, 2, CPU, three)
    config = replace(DPPOConfig(), actor=SPEC, num_envs=6, num_steps=4, minibatch_size=12, device="cpu")
    with pytest.raises(ConfigError, match="num_envs=6 does not divide by the 4 ranks"):
        make_dppo(config, SPEC, 6, 2, CPU, SimpleNamespace(world_size=4, rank=0, group=None))
    with pytest.raises(ConfigError, match="compile='on' with nproc=2"):
        replace(DPPOConfig(), compile="on", nproc=2)
    with pytest.raises(ConfigError, match="one process"):
        make_dppo(replace(config, compile="on"), SPEC, 6, 2, CPU, SimpleNamespace(world_size=2, rank=0, group=None))
    with pytest.raises(EnvError, match="dones_of_split=None with split=\\(0, 2\\)"):  # a gymnasium id splits, given the ranks' flags
        make_env("Pendulum-v1", 2, 1, CPU, 0, split=(0, 2))
    with pytest.raises(ConfigError, match="run.env_workers=4: each of the 2 ranks steps num_envs / nproc = 4/2 envs"):
        replace(DPPOConfig(), env="Pendulum-v1", nproc=2, num_envs=4, minibatch_size=16, env_workers=4)
    with pytest.raises(ConfigError, match="run.env_workers=2: env='PointReach-v0' is torch-batched"):
        make_env("PointReach-v0", 2, 1, CPU, 0, split=(0, 2), workers=2)
    replace(DPPOConfig(), env="Pendulum-v1", nproc=2, num_envs=8, minibatch_size=16, env_workers=2)  # 4 envs per rank, 2 per worker
    with pytest.raises(ConfigError, match="env='Pendulum-v1' with 2 ranks: a data-parallel run splits a torch-batched env"):
        check_split("Pendulum-v1", 2)  # a run that does not build GymChunkEnv's split

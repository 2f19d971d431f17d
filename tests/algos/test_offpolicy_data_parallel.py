"""sac, td3, td3-diffusion and sac-diffusion data-parallel: 2 gloo ranks, each holding half of every minibatch (and of its noise),
equal the single process on the whole minibatch: every parameter within 1e-6 (float32), generator
states and counters exact. sac: 3 gradient steps, each with its temperature step (autotune), clipped
critics and actor; td3: 3 critic steps and the delayed actor step (with the Polyak updates) at step 2.
Each rank's policy, acting for its 2 of 4 envs, draws the single process's noise rows for them.
td3-diffusion and sac-diffusion (PointReach-sized, a 4-step chain): 3 critic steps, the actor step at
step 2 (sac-diffusion: the entropy estimate and alpha step at step 0, alike on every rank); the
single process runs its eager update, the ranks the leaf-list steps on their halves.

One spawn of the 2 ranks serves every test here (a module fixture): it is the expensive part."""

import pytest
import torch

from rlfunc.algos.diffusion_actor import ActorSpec, env_info
from rlfunc.algos.ppo import EnvSpec
from rlfunc.algos.sac_diffusion import SACDiffusionConfig, make_sac_diffusion
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig, make_td3_diffusion
from rlfunc.algos.sac import SACConfig, make_sac
from rlfunc.algos.td3 import TD3Config, make_td3
from rlfunc.config import replace
from rlfunc.errors import ConfigError
from rlfunc.optim.amp import precision
from tests.algos.test_sac import _buffer
from tests.algos.test_sac_diffusion import _buffer as _diffusion_buffer
from tests.conftest import spawn_gloo

SPEC = EnvSpec(3, 2, [-2.0, -1.0], [2.0, 3.0])
CPU = torch.device("cpu")
N = 4  # envs of the single process
CONFIGS = {
    "sac": lambda: replace(SACConfig(), hidden=(16, 16), batch_size=32, num_envs=N, max_grad_norm=0.5, device="cpu", compile="off"),
    "td3": lambda: replace(TD3Config(), hidden=(16, 16), batch_size=32, num_envs=N, max_grad_norm=0.5, device="cpu", compile="off"),
}
MAKERS = {"sac": make_sac, "td3": make_td3}
ACTOR = ActorSpec(hidden=(32, 32), horizon=1, act_steps=1, num_train_steps=8, ddim_steps=4)
DIFFUSION = {
    "td3-diffusion": (lambda: replace(TD3DiffusionConfig(), actor=ACTOR, critic_hidden=(32,), batch_size=32, num_envs=N,
                                      updates_per_iteration=3, device="cpu", compile="off"), make_td3_diffusion),
    "sac-diffusion": (lambda: replace(SACDiffusionConfig(), actor=ACTOR, critic_hidden=(32,), batch_size=32, num_envs=N,
                                      updates_per_iteration=3, entropy_states=4, entropy_samples=50, device="cpu",
                                      compile="off"), make_sac_diffusion),
}


def _run(name: str, dist=None) -> dict:
    """(learner state leaves, metrics, actions of this rank's envs) after 3 updates from the same init and buffer."""
    W, r = (1, 0) if dist is None else (dist.world_size, dist.rank)
    algo = MAKERS[name](CONFIGS[name](), SPEC, CPU, dist)
    state = algo.init()
    gen = torch.Generator().manual_seed(0)
    obs = torch.randn(N, 3, generator=torch.Generator().manual_seed(1))[r * N // W:(r + 1) * N // W]
    actions, _ = algo.policy(state, gen)(obs)  # before the updates: the generator then draws the minibatches
    state, metrics = algo.iteration(state, _buffer(), gen, 3)
    leaves = {k: v.detach().clone() for k, v in state.items(include_nested=True, leaves_only=True)}
    return {"state": leaves, "metrics": {k: v.clone() for k, v in metrics.items()}, "actions": actions}


def _run_diffusion(name: str, dist=None) -> dict:
    """(learner state leaves, metrics) after one iteration of 3 updates from the same init and buffer."""
    config_of, make = DIFFUSION[name]
    config = config_of()
    info = env_info(config.env)
    algo = make(config, config.actor, info, info.act_dim, CPU, dist)
    state, metrics = algo.iteration(algo.init(), _diffusion_buffer(algo), torch.Generator().manual_seed(0), precision(CPU, "off"))
    leaves = {k: v.detach().clone() for k, v in state.items(include_nested=True, leaves_only=True)}
    return {"state": leaves, "metrics": {k: v.clone() for k, v in metrics.items()}}


def _rank(dist, out_dir):
    torch.set_num_threads(1)
    out = {name: _run(name, dist) for name in MAKERS}
    out.update({name: _run_diffusion(name, dist) for name in DIFFUSION})
    torch.save(out, f"{out_dir}/rank{dist.rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("offpolicy_dp")
    spawn_gloo(_rank, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _compare(ranks, name, want) -> float:
    """The largest |difference| of a parameter or target of the ranks' states from ``want``'s, after
    checking every leaf (floats within 1e-6, the rest exact) and every metric."""
    worst = 0.0
    for got in (r[name] for r in ranks):
        assert set(got["state"]) == set(want["state"])  # the single process's layout
        for key, value in want["state"].items():
            if not value.is_floating_point():
                assert torch.equal(got["state"][key], value), key  # the generator's state, counters: exact
                continue
            torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
            if key[0] in ("params", "target"):
                worst = max(worst, float((got["state"][key] - value).abs().max()))
        assert set(got["metrics"]) == set(want["metrics"])
        for key, value in want["metrics"].items():
            torch.testing.assert_close(got["metrics"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    return worst


@pytest.mark.parametrize("name", ["sac", "td3"])
def test_two_ranks_with_half_of_every_minibatch_equal_one_process(ranks, name):
    torch.set_num_threads(1)
    want = _run(name)
    worst = _compare(ranks, name, want)
    assert int(want["state"]["updates"]) == 3
    if name == "td3":
        assert "loss_actor" in want["metrics"]  # the delayed actor step ran (update 2)
    else:
        assert float(want["metrics"]["loss_alpha"]) != 0 and not torch.equal(want["state"]["params", "log_alpha"], torch.zeros(()))
    # each rank acted for its 2 envs with the single process's noise rows of them (the actor's forward
    # on 2 rows rounds apart from on 4 by ~2e-7; another noise row would be off by ~1)
    torch.testing.assert_close(torch.cat([r[name]["actions"] for r in ranks]), want["actions"], rtol=1e-6, atol=1e-6)
    print(name, f"max |difference| of a parameter: {worst:.1e}")


@pytest.mark.parametrize("name", ["td3-diffusion", "sac-diffusion"])
def test_two_ranks_equal_one_process_with_a_diffusion_actor(ranks, name):
    torch.set_num_threads(1)
    want = _run_diffusion(name)
    worst = _compare(ranks, name, want)
    assert int(want["state"]["updates"]) == 3 and "actor_grad_norm" in want["metrics"]  # the delayed actor step ran
    print(name, f"max |difference| of a parameter: {worst:.1e}")


def test_the_split_must_divide_and_compile_on_is_refused_with_nproc():
    with pytest.raises(ConfigError, match=r"^num_envs=3 does not divide by the 2 ranks"):
        replace(SACConfig(), num_envs=3, nproc=2)
    with pytest.raises(ConfigError, match=r"^batch_size=33 does not divide by the 2 ranks"):
        replace(TD3Config(), num_envs=2, batch_size=33, nproc=2)
    with pytest.raises(ConfigError, match=r"^run.compile='on' with nproc=2: td3's compiled step"):
        replace(TD3Config(), num_envs=2, nproc=2, compile="on")
    with pytest.raises(ConfigError, match=r"^run.env_workers=3: num_envs=2 \(num_envs=4 / nproc=2 per process\)"):
        replace(SACConfig(), num_envs=4, nproc=2, env_workers=3)
    ok = replace(SACConfig(), num_envs=4, nproc=2, env_workers=2)  # --compile auto: eager under nproc, no error
    assert ok.run.compile == "auto"
    with pytest.raises(ConfigError, match=r"^env='Pendulum-v1' with 2 ranks: a data-parallel run splits a torch-batched env"):
        replace(TD3DiffusionConfig(), env="Pendulum-v1", num_envs=4, nproc=2)
    with pytest.raises(ConfigError, match=r"^run.compile='on' with nproc=2: sac-diffusion's compiled steps"):
        replace(SACDiffusionConfig(), nproc=2, compile="on")
    with pytest.raises(ConfigError, match=r"^nproc=2: td3-diffusion's data-parallel update is its float32 step"):
        replace(TD3DiffusionConfig(), nproc=2, precision="bf16")
    with pytest.raises(ConfigError, match=r"^batch_size=33 does not divide by the 2 ranks"):
        replace(SACDiffusionConfig(), nproc=2, batch_size=33)

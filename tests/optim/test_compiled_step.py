"""The compiled gradient step (--compile, rlfunc.device.compile_step) equals the eager one."""

from __future__ import annotations

import os

import pytest
import torch

from rlfunc.algos.ppo import PPOConfig, make_ppo
from rlfunc.config import replace
from rlfunc.device import compile_backend
from rlfunc.errors import ConfigError
from tests.optim.test_shaping import SPEC, _batch

needs_inductor = pytest.mark.skipif(compile_backend(torch.device("cpu")) is None, reason="no C++ compiler for inductor")


def _iterations(config: PPOConfig, iterations: int, nan_seed: int | None = None):
    algo = make_ppo(config, SPEC, torch.device("cpu"))
    state = algo.init()
    gens = [torch.Generator().manual_seed(s) for s in config.seeds]
    metrics = []
    for i in range(iterations):
        batch = _batch(config.run.num_seeds, config.num_envs, config.num_steps, i)
        if nan_seed is not None and i == 1:
            batch["next", "reward"][nan_seed, 0, 3] = float("nan")  # this seed's step is skipped
        state, m = algo.iteration(state, batch, gens)
        metrics.append(m)
        _meet_a_new_type(i)  # as a run's collector and snapshots do between iterations
    return state, metrics


def _meet_a_new_type(i: int) -> None:
    """Grow tensordict's type caches (the bug: a guard on their size recompiled the step at iteration 2
    of a HalfCheetah-v5 run)."""
    from tensordict import TensorDict
    from tensordict.utils import is_tensorclass

    fresh = type(f"Fresh{i}", (), {})
    is_tensorclass(fresh)
    TensorDict({"x": torch.zeros(1)}, batch_size=[1]).apply(lambda x: x + 1)


def _eager_then_compiled(run, graphs: int):
    """``run("off")``, then ``run("on")`` from a fresh dynamo cache, asserting ``graphs`` graphs;
    both (state, metrics)."""
    import torch._dynamo

    eager = run("off")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = run("on")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    return eager, compiled


def _assert_close(eager, compiled, me, mc) -> None:
    """Every leaf of the two learner states within 1e-5 (NaN where both are), ints equal; every eager metric."""
    for key in eager.keys(True, True):
        a, b = eager.get(key), compiled.get(key)
        assert (torch.allclose(a, b, atol=1e-5, rtol=1e-5, equal_nan=True) if a.is_floating_point() else torch.equal(a, b)), key
    for key in me.keys():
        assert torch.allclose(me[key].float(), mc[key].float(), atol=1e-5, rtol=1e-4, equal_nan=True), key


@needs_inductor
def test_compiled_iterations_equal_eager_and_compile_once():
    """Two seeds, 3 iterations of 2 epochs x 2 minibatches with lr decay (a new lr every iteration),
    seed 1's data non-finite in iteration 2: parameters, Adam's moments and step counts and the
    metrics within 1e-5 of the eager path, and one compilation for the whole run (lr is a tensor
    input, not a constant)."""
    import torch._dynamo

    kw = dict(num_envs=2, num_steps=32, minibatch_size=32, num_epochs=2, num_seeds=2, total_steps=3 * 64, lr=3e-3)
    eager, me = _iterations(replace(PPOConfig(), **kw), 3, nan_seed=1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled, mc = _iterations(replace(PPOConfig(), **kw, compile="on"), 3, nan_seed=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for key in eager.keys(True, True):
        a, b = eager.get(key), compiled.get(key)
        if a.is_floating_point():
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), key
        else:
            assert torch.equal(a, b), key
    assert not torch.equal(eager["params"].get(("actor", "0", "weight")), _iterations(replace(PPOConfig(), **kw), 0)[0]["params"].get(("actor", "0", "weight")))
    for a, b in zip(me, mc):
        for key in a.keys():  # every eager metric, the same
            assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5, rtol=1e-4, equal_nan=True), key
    assert float(mc[0]["compile_s"][0]) > 0 and "compile_s" not in mc[1].keys()  # the first metrics line reports it
    assert int(mc[1]["skipped_data"][1]) == 4 and int(mc[1]["skipped_data"][0]) == 0
    for steps in (eager["optim", "1", "step"], compiled["optim", "1", "step"]):  # each seed's own Adam count: 12 steps, 4 skipped
        assert all(s.tolist() == [12.0, 8.0] for s in steps.values(include_nested=True, leaves_only=True))


def test_compile_on_refuses_what_it_does_not_compile():
    with pytest.raises(ConfigError, match="compile='on'.*adaptive_clip"):
        make_ppo(replace(PPOConfig(), num_envs=2, num_steps=32, minibatch_size=32, adaptive_clip=True, compile="on"),
                 SPEC, torch.device("cpu"))


def test_compile_on_without_a_backend_is_one_clear_error(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ConfigError, match="--compile on: ppo has no torch.compile backend on device cpu.*--compile off"):
        make_ppo(replace(PPOConfig(), num_envs=2, num_steps=32, minibatch_size=32, compile="on"), SPEC, torch.device("cpu"))
    with pytest.warns(UserWarning, match="running eager"):
        make_ppo(replace(PPOConfig(), num_envs=2, num_steps=32, minibatch_size=32, compile="auto"), SPEC, torch.device("cpu"))


def test_bad_compile_value_names_the_field():
    with pytest.raises(ConfigError, match="run.compile='fast'"):
        replace(PPOConfig(), compile="fast")


@needs_inductor
@pytest.mark.parametrize("env", ["CartPole-v1", "CartPoleTwoHeads-v0"])
def test_compiled_categorical_step_equals_eager(env):
    """Discrete and MultiDiscrete actions (a categorical actor-critic has no top-level leaf, from which
    tensordict's vmap had inferred the seeds' dim: the compiled step's warm-up failed with "a Tensor of
    dimensionality 0"): two seeds, 2 iterations on one collected batch, params and Adam state within
    1e-5 of eager, one graph."""
    from tests.algos.test_ppo_discrete import _config, _rollout

    kw = dict(num_epochs=2, minibatch_size=64, total_steps=2 * 2 * 4 * 32)
    spec, _, _, _, batch = _rollout(_config(env, **kw))

    def run(compile: str):
        config = _config(env, **kw, compile=compile)
        algo = make_ppo(config, spec, torch.device("cpu"))
        state = algo.init()
        gens = [torch.Generator().manual_seed(s) for s in config.seeds]
        for _ in range(2):
            state, metrics = algo.iteration(state, batch.clone(), gens)
        return state, metrics

    (eager, me), (compiled, mc) = _eager_then_compiled(run, graphs=1)
    _assert_close(eager, compiled, me, mc)


@needs_inductor
@pytest.mark.parametrize("kw", [dict(), dict(max_grad_norm=0.5, num_critics=3, redq_subset=2)],
                         ids=["default", "clip-redq"])
def test_compiled_sac_step_equals_eager(kw):
    """SAC's whole update (temperature, critics, actor, Polyak targets; the clip's norm state and
    REDQ's subset with them) compiled equals the eager step within 1e-5 after 4 updates, one graph;
    a minibatch row with a NaN reward makes both skip the critic's step alike."""

    from rlfunc.algos.sac import make_sac
    from tests.algos.test_sac import SPEC as SAC_SPEC
    from tests.algos.test_sac import _buffer, _config

    def run(compile: str):
        algo = make_sac(_config(**kw, compile=compile), SAC_SPEC, torch.device("cpu"))
        state = algo.init()
        gen = torch.Generator().manual_seed(0)
        buffer = _buffer()
        state, m = algo.iteration(state, buffer, gen, 4)
        buffer["next", "reward"][:] = float("nan")  # every minibatch has it: the critics' step is skipped
        critic = state["params", "critic"].clone()
        state, m2 = algo.iteration(state, buffer, gen, 1)
        assert all(torch.equal(critic.get(k), state["params", "critic"].get(k)) for k in critic.keys(True, True))
        return state, m

    (eager, me), (compiled, mc) = _eager_then_compiled(run, graphs=1)
    _assert_close(eager, compiled, me, mc)  # the clip's norm state is NaN after the skipped step, on both
    assert float(mc["compile_s"]) > 0


@needs_inductor
def test_compiled_td3_steps_equal_eager():
    """TD3's critic step and its delayed actor step (with the target updates) compiled: two graphs,
    within 1e-5 of eager after 5 updates (actor steps at updates 2 and 4), clip state included."""

    from rlfunc.algos.td3 import TD3Config, make_td3
    from tests.algos.test_sac import SPEC as SAC_SPEC
    from tests.algos.test_sac import _buffer

    def run(compile: str):
        config = replace(TD3Config(), hidden=(16, 16), batch_size=32, max_grad_norm=0.5, device="cpu", compile=compile)
        algo = make_td3(config, SAC_SPEC, torch.device("cpu"))
        state = algo.init()
        return algo.iteration(state, _buffer(), torch.Generator().manual_seed(0), 5)

    (eager, me), (compiled, mc) = _eager_then_compiled(run, graphs=2)
    assert int(compiled["updates"]) == 5
    _assert_close(eager, compiled, me, mc)


def _dppo_iterations(compile: str, likelihood: str, iterations: int = 3, **kw):
    """``iterations`` DPPO iterations of a small random actor on PointReach-v0, a NaN reward in the
    second batch's first env (its GAE poisons every minibatch holding it: those steps are skipped)."""
    from rlfunc.algos.diffusion_actor import ActorSpec, make_env
    from rlfunc.algos.dppo import DPPOConfig, make_dppo
    from rlfunc.optim.amp import precision

    spec = ActorSpec(hidden=(32, 32), ddim_steps=4, num_train_steps=8)
    config = replace(DPPOConfig(), num_envs=16, num_steps=4, minibatch_size=32, num_epochs=2, target_kl=None,
                     likelihood=likelihood, device="cpu", compile=compile, **kw)
    algo = make_dppo(config, spec, 6, 2, torch.device("cpu"))
    state = algo.init()
    env, gen, prec = make_env("PointReach-v0", 16, spec.act_steps, torch.device("cpu"), 0), torch.Generator().manual_seed(0), precision(torch.device("cpu"), "off")
    metrics = []
    for i in range(iterations):
        batch = algo.rollout(state, env, gen)
        if i == 1:
            batch["next", "reward"][0, 0] = float("nan")
        state, m = algo.iteration(state, batch, gen, prec)
        metrics.append(m)
        _meet_a_new_type(i)
    return state, metrics


@needs_inductor
@pytest.mark.parametrize("likelihood, kw", [("chain", dict(finetune_steps=3)), ("output-noise", dict())], ids=["chain", "output-noise"])
def test_compiled_dppo_step_equals_eager(likelihood, kw):
    """DPPO's gradient step (the chain's per-step likelihood over the fine-tuned steps, or output
    noise through the whole deterministic chain; the critic; clip and the two Adams) compiled:
    one graph over 3 iterations, within 1e-5 of eager, skipped steps alike, compile_s reported once."""
    (eager, me), (compiled, mc) = _eager_then_compiled(lambda mode: _dppo_iterations(mode, likelihood, **kw), graphs=1)
    _assert_close(eager, compiled, me[-1], mc[-1])
    assert float(me[1]["skipped"]) > 0 and float(mc[1]["skipped"]) == float(me[1]["skipped"])
    assert float(mc[0]["compile_s"]) > 0 and "compile_s" not in mc[1].keys() and "compile_s" not in me[0].keys()


def test_dppo_compile_on_refuses_what_it_does_not_compile():
    from rlfunc.algos.diffusion_actor import ActorSpec
    from rlfunc.algos.dppo import DPPOConfig, make_dppo

    for kw in (dict(micro_batch_size=64), dict(gradient_checkpointing=True, likelihood="output-noise"), dict(precision="bf16")):
        with pytest.raises(ConfigError, match="compile='on': dppo compiles its float32 gradient step"):
            make_dppo(replace(DPPOConfig(), device="cpu", compile="on", **kw), ActorSpec(hidden=(8,), ddim_steps=2), 6, 2, torch.device("cpu"))


def test_a_failing_compiler_is_one_line_under_on_and_eager_under_auto(monkeypatch):
    """The bug: inductor's C++ build of a step failed (a truncated kernel in a shared cache: "file too
    short") and the run died in a deep traceback. Now ``on`` is one ConfigError line naming the backend
    and ``--compile off``; ``auto`` warns once and every call runs the eager function, with its numbers."""
    from rlfunc.device import compile_step

    def broken(fn, **kw):
        def compiled(*args):
            raise ImportError("/tmp/inductor/xv/cxvy.main.so: file too short")
        return compiled

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr("rlfunc.device.compile_backend", lambda device: "inductor")

    def step(w: list, x):  # in place, as the gradient steps are
        w[0].add_(x)
        return w[0].sum()

    with pytest.raises(ConfigError, match=r"--compile on: torch.compile \(inductor\) of toy's step failed on device cpu: "
                                          r"ImportError: .*file too short; use --compile off"):
        compile_step(step, torch.device("cpu"), "on", "toy")([torch.zeros(2)], torch.ones(2))
    fn, w = compile_step(step, torch.device("cpu"), "auto", "toy"), [torch.zeros(2)]
    with pytest.warns(UserWarning, match="toy's step failed.*running eager"):
        assert float(fn(w, torch.ones(2))) == 2.0
    assert float(fn(w, torch.ones(2))) == 4.0 and fn.eager and fn.compile_s is not None
    assert torch.equal(w[0], torch.full((2,), 2.0))  # each call stepped once, the warm-up on copies


def test_no_backend_under_auto_is_a_step_with_no_compile_time(monkeypatch):
    """The bug: with no backend, compile_step returned the plain function, and a run long enough for
    auto to compile read its ``compile_s`` (ppo, sac, td3, dppo): AttributeError at the first iteration."""
    from rlfunc.device import compile_step

    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.warns(UserWarning, match="running eager"):
        fn = compile_step(lambda x: x + 1, torch.device("cpu"), "auto", "toy")
    assert float(fn(torch.ones(()))) == 2.0 and fn.compile_s is None and fn.eager
    with pytest.warns(UserWarning, match="running eager"):  # a ppo run past AUTO_COMPILE_STEPS, as the bug's
        algo = make_ppo(replace(PPOConfig(), num_envs=2, num_steps=32, minibatch_size=32, total_steps=10**6, compile="auto"),
                        SPEC, torch.device("cpu"))
    state, metrics = algo.iteration(algo.init(), _batch(1, 2, 32), [torch.Generator().manual_seed(0)])
    assert "compile_s" not in metrics.keys() and torch.isfinite(metrics["loss_objective"]).all()


def _replay_diffusion_iterations(name: str, compile: str, **kw):
    """3 iterations of 4 updates of a small sac-diffusion or td3-diffusion (2 DDIM steps, 16-wide nets,
    minibatches of 16) on random transitions, every reward NaN in the second (the critics' steps are
    skipped; the third overwrites the clip's norm state, which a skipped eager step leaves and a masked
    one sets to NaN); (state, metrics of each iteration)."""
    from rlfunc.algos.diffusion_actor import ActorSpec, env_info
    from rlfunc.optim.amp import precision
    from tests.algos.test_sac_diffusion import _buffer

    if name == "sac-diffusion":
        from rlfunc.algos.sac_diffusion import SACDiffusionConfig as Config
        from rlfunc.algos.sac_diffusion import make_sac_diffusion as make
        kw = dict(entropy_every=3, entropy_states=2, entropy_samples=20, **kw)
    else:
        from rlfunc.algos.td3_diffusion import TD3DiffusionConfig as Config
        from rlfunc.algos.td3_diffusion import make_td3_diffusion as make
    actor = ActorSpec(hidden=(16, 16), horizon=1, act_steps=1, num_train_steps=4, ddim_steps=2)
    config = replace(Config(), actor=actor, critic_hidden=(16,), batch_size=16, updates_per_iteration=4, device="cpu",
                     compile=compile, **kw)
    info = env_info(config.env)
    algo = make(config, actor, info, info.act_dim, torch.device("cpu"))
    state, buffer = algo.init(), _buffer(algo)
    gen, prec = torch.Generator().manual_seed(0), precision(torch.device("cpu"), "off")
    reward = buffer["reward"].clone()
    metrics = []
    for i in range(3):
        buffer["reward"][:] = float("nan") if i == 1 else reward
        critic = state["params", "critic"].clone()
        state, m = algo.iteration(state, buffer, gen, prec)
        if i == 1:
            assert all(torch.equal(critic.get(k), state["params", "critic"].get(k)) for k in critic.keys(True, True))
        metrics.append(m)
        _meet_a_new_type(i)
    return state, metrics


@needs_inductor
@pytest.mark.parametrize("name", ["sac-diffusion", "td3-diffusion"])
def test_compiled_replay_diffusion_steps_equal_eager(name):
    """sac-diffusion's and td3-diffusion's critic step and actor step (through the whole denoising
    chain; td3-diffusion's denoising term; the Polyak targets; clip and Adam) compiled: two graphs over
    3 iterations, within 1e-5 of the eager update (sac-diffusion's eager entropy estimate and alpha
    step in between, drawing from the same generator), skipped critic steps alike, compile_s reported
    once."""
    (eager, me), (compiled, mc) = _eager_then_compiled(lambda mode: _replay_diffusion_iterations(name, mode), graphs=2)
    _assert_close(eager, compiled, me[-1], mc[-1])
    assert float(me[1]["skipped_critic"]) == float(mc[1]["skipped_critic"]) == 4.0  # a count: all 4 of the NaN iteration's steps
    assert float(mc[0]["compile_s"]) > 0 and "compile_s" not in mc[1].keys() and "compile_s" not in me[0].keys()


@pytest.mark.parametrize("name", ["sac-diffusion", "td3-diffusion"])
def test_replay_diffusion_compile_on_refuses_what_it_does_not_compile(name):
    from rlfunc.algos.sac_diffusion import SACDiffusionConfig
    from rlfunc.algos.td3_diffusion import TD3DiffusionConfig

    Config = SACDiffusionConfig if name == "sac-diffusion" else TD3DiffusionConfig
    for kw in (dict(gradient_checkpointing=True), dict(precision="bf16")):
        with pytest.raises(ConfigError, match=f"compile='on': {name} compiles its float32 update"):
            replace(Config(), device="cpu", compile="on", **kw)
    replace(Config(), device="cpu", compile="auto", gradient_checkpointing=True)  # auto runs it eager


@needs_inductor
@pytest.mark.parametrize("loss, kw", [("grpo", dict(kl_coef=0.1)), ("gspo", dict())], ids=["grpo-kl", "gspo"])
def test_compiled_grpo_step_equals_eager(loss, kw):
    """GRPO's (with the KL to the reference) and GSPO's gradient step compiled: two seeds, 3 iterations
    of 2 epochs x 2 minibatches with lr decay on one collected batch, seed 1's rewards NaN in the
    second (its steps are skipped): params, Adam state and metrics within 1e-5 of eager, one graph."""
    from rlfunc.algos.grpo import GRPOConfig, make_grpo
    from rlfunc.run.grpo import _rollout_fn, _spec
    from rlfunc.run.ppo import _generators

    base = replace(GRPOConfig(), env="PointReach-v0", loss=loss, num_groups=2, group_size=4, minibatch_size=4, num_epochs=2,
                   hidden=(16, 16), num_seeds=2, total_steps=3 * 8 * 30, device="cpu", **kw)
    cpu = torch.device("cpu")
    spec = _spec(base.env)
    algo = make_grpo(base, spec, cpu)
    state = algo.init()
    rollout, close = _rollout_fn(base, cpu)
    batch = rollout(algo.policy(state, _generators(state, cpu)), 0)
    close()

    def run(compile: str):
        algo = make_grpo(replace(base, compile=compile), spec, cpu)
        state = algo.init()
        gens = _generators(state, cpu)
        metrics = []
        for i in range(3):
            b = batch.clone()
            if i == 1:
                b["next", "reward"][1] = float("nan")
            state, m = algo.iteration(state, b, gens)
            metrics.append(m)
            _meet_a_new_type(i)
        return state, metrics

    (eager, me), (compiled, mc) = _eager_then_compiled(run, graphs=1)
    _assert_close(eager, compiled, me[-1], mc[-1])
    for a, b in zip(me, mc):
        for key in a.keys():
            assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5, rtol=1e-4, equal_nan=True), key
    assert me[1]["skipped_updates"].tolist() == mc[1]["skipped_updates"].tolist() == [0, 4]
    assert float(mc[0]["compile_s"][0]) > 0 and "compile_s" not in mc[1].keys()


def test_grpo_compile_on_refuses_what_it_does_not_compile():
    from rlfunc.algos.grpo import GRPOConfig

    for kw in (dict(oscillation_damping=True), dict(adaptive_clip=True)):
        with pytest.raises(ConfigError, match="compile='on': gspo compiles its plain gradient step only"):
            replace(GRPOConfig(), loss="gspo", compile="on", **kw)


def _mappo_batch(algo, N: int, T: int, A: int, D: int, K: int) -> "TensorDict":
    """A rollout batch [N, T] of A agents in the layout rlfunc.run.mappo.collect writes: random
    observations and action masks, the initial policy's own actions, values and log-probabilities."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    obs = torch.randn(N, T, A, D, generator=g)
    mask = torch.rand(N, T, A, K, generator=g) < 0.7
    mask[..., 0] = True
    state = algo.init()
    action, log_prob, value = algo.act(state, obs, mask, g)
    value = value if value is not None else torch.zeros(N, T, A, 1)
    done = torch.zeros(N, T, 1, dtype=torch.bool)
    done[:, -1] = True
    return TensorDict({
        "agents": {"observation": obs, "action_mask": mask, "action": action, "sample_log_prob": log_prob},
        "state_value": value,
        "next": {"agents": {"reward": torch.randn(N, T, A, 1, generator=g)}, "state_value": torch.randn(N, T, A, 1, generator=g),
                 "done": done, "terminated": torch.zeros(N, T, 1, dtype=torch.bool)},
    }, batch_size=[N, T])


@needs_inductor
@pytest.mark.parametrize("loss", ["ppo", "grpo"])
def test_compiled_mappo_step_equals_eager(loss):
    """mappo's gradient step (ppo with the mean critic and action masks; the critic-free sequence
    loss) compiled: 3 iterations of 2 epochs x 2 minibatches with lr decay, params, Adam state and
    metrics within 1e-5 of eager, one graph; non-finite rewards are one FloatingPointError after the
    epochs (eager: at the first step), the parameters unmoved."""
    from rlfunc.algos.mappo import MAPPOConfig, make_mappo

    A, D, K = 2, 6, 5
    config = replace(MAPPOConfig(), loss=loss, critic="mean", n_agents=A, num_envs=4, rollout_steps=8, episode_steps=8,
                     group_size=2, hidden=(16,), num_epochs=2, num_minibatches=2, total_steps=3 * 4 * 8, device="cpu")
    cpu = torch.device("cpu")
    batch = _mappo_batch(make_mappo(config, D, A, K, cpu), 4, 8, A, D, K)
    algos = {}

    def run(compile: str):
        algo = algos[compile] = make_mappo(replace(config, compile=compile), D, A, K, cpu)
        state, metrics = algo.init(), []
        gen = torch.Generator().manual_seed(1)
        for i in range(3):
            state, m = algo.iteration(state, batch.clone(), gen)
            metrics.append(m)
            _meet_a_new_type(i)
        return state, metrics

    (eager, me), (compiled, mc) = _eager_then_compiled(run, graphs=1)
    _assert_close(eager, compiled, {}, {})
    for a, b in zip(me, mc):
        assert set(a) | {"compile_s"} == set(b) | {"compile_s"}
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    assert mc[0]["compile_s"] > 0 and "compile_s" not in mc[1]
    bad = batch.clone()
    bad["next", "agents", "reward"][:] = float("nan")
    params = compiled["params"].clone()
    with pytest.raises(FloatingPointError, match="mappo: non-finite loss or gradient norm at 4 of 4 updates"):
        algos["on"].iteration(compiled, bad, torch.Generator().manual_seed(2))
    assert all(torch.equal(params.get(k), compiled["params"].get(k)) for k in params.keys(True, True))


@pytest.mark.parametrize("name", ["td3-diffusion", "grpo", "mappo"])
def test_auto_without_a_backend_runs_eager(name, monkeypatch):
    """--compile auto on a run long enough to compile, with no C++ compiler for inductor: a warning,
    then the pure step runs eager (compile_step hands it back as it is: no compile_s to report)."""
    import warnings

    monkeypatch.setattr("shutil.which", lambda name: None)
    cpu = torch.device("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if name == "td3-diffusion":
            from rlfunc.algos.diffusion_actor import ActorSpec, env_info
            from rlfunc.algos.td3_diffusion import TD3DiffusionConfig, make_td3_diffusion
            from rlfunc.optim.amp import precision
            from tests.algos.test_sac_diffusion import _buffer

            actor = ActorSpec(hidden=(8,), horizon=1, act_steps=1, num_train_steps=2, ddim_steps=1)
            config = replace(TD3DiffusionConfig(), actor=actor, critic_hidden=(8,), batch_size=8, updates_per_iteration=2,
                             total_steps=10_000_000, device="cpu", compile="auto")
            info = env_info(config.env)
            algo = make_td3_diffusion(config, actor, info, info.act_dim, cpu)
            _, metrics = algo.iteration(algo.init(), _buffer(algo), torch.Generator().manual_seed(0), precision(cpu, "off"))
        elif name == "grpo":
            from rlfunc.algos.grpo import GRPOConfig, make_grpo
            from rlfunc.run.grpo import _rollout_fn, _spec
            from rlfunc.run.ppo import _generators

            config = replace(GRPOConfig(), num_groups=2, group_size=2, minibatch_size=4, num_epochs=1, hidden=(8,),
                             total_steps=10_000_000, device="cpu", compile="auto")
            algo = make_grpo(config, _spec(config.env), cpu)
            state = algo.init()
            rollout, close = _rollout_fn(config, cpu)
            gens = _generators(state, cpu)
            batch = rollout(algo.policy(state, gens), 0)
            close()
            _, metrics = algo.iteration(state, batch, gens)
        else:
            from rlfunc.algos.mappo import MAPPOConfig, make_mappo

            config = replace(MAPPOConfig(), n_agents=2, num_envs=2, rollout_steps=4, hidden=(8,), num_epochs=1, num_minibatches=1,
                             total_steps=10_000_000, device="cpu", compile="auto")
            algo = make_mappo(config, 6, 2, 5, cpu)
            _, metrics = algo.iteration(algo.init(), _mappo_batch(algo, 2, 4, 2, 6, 5), torch.Generator().manual_seed(0))
    assert any("running eager" in str(w.message) for w in caught)
    assert "compile_s" not in metrics.keys()


def _bc_iterations(compile: str, **kw):
    """3 bc updates of a small actor (32x32 DiffusionMLP, T = 8) on 100 random PointReach-shaped
    demonstrations, batches of 24 in micro-batches of 16 and 8; every action NaN at the second update
    (its step is skipped); (state, metrics of each update)."""
    from tensordict import TensorDict

    from rlfunc.algos.bc import BCConfig, make_bc
    from rlfunc.algos.diffusion_actor import ActorSpec
    from rlfunc.optim.amp import precision

    cpu = torch.device("cpu")
    config = replace(BCConfig(), actor=ActorSpec(hidden=(32, 32), num_train_steps=8, ddim_steps=4), batch_size=24,
                     micro_batch_size=16, device="cpu", compile=compile, **kw)
    algo = make_bc(config, 6, 2, cpu)
    g = torch.Generator().manual_seed(0)
    dataset = TensorDict({"observation": torch.randn(100, 6, generator=g), "action": torch.randn(100, 4, 2, generator=g).clamp(-1, 1)},
                         batch_size=[100])
    state, gen, prec = algo.init(dataset), torch.Generator().manual_seed(0), precision(cpu, "off")
    metrics = []
    for i in range(3):
        data = dataset.clone()
        if i == 1:
            data["action"][:] = float("nan")
        state, m = algo.iteration(state, data, gen, prec)
        metrics.append(m)
        _meet_a_new_type(i)
    return state, metrics


@needs_inductor
def test_compiled_bc_step_equals_eager():
    """bc's gradient step (the denoising loss over two micro-batches, torch.func.grad, clip and
    AdamW with its decoupled weight decay) compiled: one graph over 3 updates, the denoiser, its EMA,
    AdamW's state and the metrics within 1e-5 of eager, the non-finite update skipped alike,
    compile_s reported once."""
    (eager, me), (compiled, mc) = _eager_then_compiled(lambda mode: _bc_iterations(mode), graphs=1)
    _assert_close(eager, compiled, me[-1], mc[-1])
    assert float(me[1]["skipped"]) == float(mc[1]["skipped"]) == 1.0 and float(mc[2]["skipped"]) == 0.0
    assert int(compiled["optim_actor", "1", "step", "params", "mlp", "0", "weight"]) == 2  # the skipped update did not count
    assert float(mc[0]["compile_s"]) > 0 and "compile_s" not in mc[1].keys() and "compile_s" not in me[0].keys()


def test_bc_compile_on_refuses_what_it_does_not_compile_and_auto_runs_it_eager():
    from rlfunc.algos.bc import AUTO_COMPILE_UPDATES, BCConfig
    from rlfunc.algos.diffusion_actor import ActorSpec

    for kw in (dict(precision="bf16"), dict(nproc=2), dict(actor=ActorSpec(checkpoint_vision=True))):
        with pytest.raises(ConfigError, match="run.compile='on': bc compiles its float32 gradient step in one process"):
            replace(BCConfig(), device="cpu", compile="on", **kw)
        assert not replace(BCConfig(), device="cpu", compile="auto", **kw).compilable  # auto: eager
    state, metrics = _bc_iterations("auto", num_updates=AUTO_COMPILE_UPDATES - 1)  # too short to pay for compiling
    assert "compile_s" not in metrics[0].keys()


def _encoder_batch(N: int, T: int, seed: int) -> "TensorDict":
    """A rollout batch [N, T] of tests.algos.test_ppo_encoder's synthetic Dict observation (a 32x32
    uint8 camera, 5 proprio numbers, 2-D actions), in the layout ppo-encoder's rollout writes."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)

    def obs():
        return {"cam": torch.randint(0, 256, (N, T, 32, 32, 3), generator=g, dtype=torch.uint8), "proprio": torch.randn(N, T, 5, generator=g)}

    done = torch.zeros(N, T, 1, dtype=torch.bool)
    done[0, 3] = True
    return TensorDict({
        **obs(), "action": torch.randn(N, T, 2, generator=g), "sample_log_prob": torch.randn(N, T, 1, generator=g) - 2.0,
        "state_value": torch.randn(N, T, 1, generator=g),
        "next": {**obs(), "reward": torch.randn(N, T, 1, generator=g), "done": done, "terminated": done.clone(),
                 "episode_return": torch.randn(N, T, 1, generator=g), "success": done.clone()},
    }, batch_size=[N, T])


def _ppo_encoder_iterations(compile: str, **kw):
    """2 ppo-encoder iterations of 2 epochs x 2 minibatches of a tiny encoder (one ResNet stage) on
    two random batches of tests.algos.test_ppo_encoder's Dict observation, a NaN reward in the first;
    (state, metrics of each iteration)."""
    from rlfunc.algos.ppo_encoder import PPOEncoderConfig, make_ppo_encoder
    from tests.algos.test_ppo_encoder import INFO, TINY

    batches = [_encoder_batch(2, 8, 0), _encoder_batch(2, 8, 1)]
    batches[0]["next", "reward"][1, 2] = float("nan")  # env 1's advantages: its minibatches are skipped
    config = replace(PPOEncoderConfig(), env="none",
                     **{**TINY, "encoder_widths": (8,), "encoder_blocks": (1,), "total_steps": 64, "compile": compile, **kw})
    algo = make_ppo_encoder(config, INFO, torch.device("cpu"))
    state, gen, metrics = algo.init(), torch.Generator().manual_seed(0), []
    for i, batch in enumerate(batches):
        state, m = algo.iteration(state, batch.clone(), gen)
        metrics.append(m)
        _meet_a_new_type(i)
    return state, metrics


def _without_key_bias(*states) -> None:
    """Zero the key third of every attention's in_proj_bias (and of its Adam moments) in ``states``:
    softmax is invariant to it, so its true gradient is 0 and two paths that round differently step
    it by Adam's normalised float noise (+-lr, at random)."""
    with torch.no_grad():
        for state in states:
            for key in state.keys(True, True):
                if key[-1] == "in_proj_bias" and state.get(key).dim() == 1:
                    state.get(key).view(3, -1)[1] = 0.0


@pytest.mark.parametrize("kw", [dict(micro_batch_size=4), dict(freeze_vision=True)], ids=["micro-batches", "frozen-trunk"])
def test_ppo_encoder_pure_step_equals_eager(kw, monkeypatch):
    """The function ppo-encoder compiles, run as plain Python (torch.compile replaced by the identity,
    so no compile: seconds): the flat-leaf step (its micro-batches unrolled, the frozen trunk passed
    apart, the lr a tensor) gives the eager iteration's params, Adam state and metrics within 1e-5,
    skipped minibatches alike. The compiled graph itself: the test below (minutes on a CPU)."""
    (eager, me) = _ppo_encoder_iterations("off", **kw)
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr("rlfunc.device.compile_backend", lambda device: "inductor")
    pure, mp = _ppo_encoder_iterations("on", **kw)
    _without_key_bias(eager, pure)
    _assert_close(eager, pure, me[-1], mp[-1])
    assert float(me[0]["skipped"]) == float(mp[0]["skipped"]) > 0 and float(me[1]["skipped"]) == 0
    assert "compile_s" in mp[0].keys()  # the step went through compile_step


@needs_inductor
@pytest.mark.skipif(not os.environ.get("RLFUNC_SLOW_TESTS"), reason="a cold compile of the encoder's step takes ~150 s on 2 CPU cores; "
                                                                     "set RLFUNC_SLOW_TESTS=1")
def test_compiled_ppo_encoder_step_equals_eager():
    """ppo-encoder's gradient step (a one-stage ResNet-GN trunk on uint8 images, attention pooling,
    proprio, fusion, both heads; advantages normalised per minibatch; clip and Adam at the annealed
    lr, a tensor) compiled: one graph over 2 iterations of 2 epochs x 2 minibatches, params, Adam
    state and metrics within 1e-5 of eager (the attentions' key bias aside: :func:`_without_key_bias`),
    a NaN reward's minibatches (first iteration) skipped alike. Without micro-batches (each unroll
    adds to a compile of minutes on a CPU; the unrolled step is tested above, uncompiled)."""
    (eager, me), (compiled, mc) = _eager_then_compiled(_ppo_encoder_iterations, graphs=1)
    _without_key_bias(eager, compiled)
    _assert_close(eager, compiled, me[-1], mc[-1])
    assert float(me[0]["skipped"]) == float(mc[0]["skipped"]) > 0 and float(me[1]["skipped"]) == 0
    assert float(mc[0]["compile_s"]) > 0 and "compile_s" not in mc[1].keys() and "compile_s" not in me[0].keys()


def test_ppo_encoder_compile_on_refuses_what_it_does_not_compile():
    from rlfunc.algos.ppo_encoder import PPOEncoderConfig

    for kw in (dict(precision="bf16"), dict(checkpoint_vision=True)):
        with pytest.raises(ConfigError, match="run.compile='on': ppo-encoder compiles its float32 gradient step"):
            replace(PPOEncoderConfig(), compile="on", **kw)
        assert not replace(PPOEncoderConfig(), compile="auto", **kw).compilable


@needs_inductor
@pytest.mark.parametrize("kw", [dict(num_seeds=2), dict(num_seeds=1, exploration="gsde", sde_sample_freq=2)], ids=["gaussian-2-seeds", "gsde"])
def test_compiled_rollout_policy_equals_eager_and_compiles_once(kw, monkeypatch):
    """The rollout policy's forward through rlfunc.device.compile_policy (CUDA's path, forced on the CPU
    here): the same actions and log-probabilities as eager, with observation normalisation, over two
    rollouts (policies rebuilt from the state, as the trainer does) and one graph for both; the CPU's
    default (POLICY_COMPILE_DEVICES) keeps it eager."""
    import torch._dynamo

    from rlfunc import device as devices

    config = replace(PPOConfig(), num_envs=4, num_steps=8, minibatch_size=32, normalize_observations=True, **kw)

    def rollouts(compile: str):
        algo = make_ppo(replace(config, compile=compile), SPEC, torch.device("cpu"))
        state = algo.init()
        state["obs_stats", "mean"] += 0.5  # a normaliser that changes the numbers
        state["obs_stats", "var"] *= 4.0
        gens = [torch.Generator().manual_seed(s) for s in config.seeds]
        obs = torch.randn(2, 3, config.run.num_seeds * 4, 3, generator=torch.Generator().manual_seed(1))
        out = []
        for r in range(2):  # two rollouts, each of 3 steps, a fresh policy per rollout
            with torch.inference_mode():
                act = algo.policy(state, gens)
                out += [act(obs[r, t]) for t in range(3)]
            with torch.no_grad():
                state["params", "actor"].apply_(lambda p: p.mul_(1.01))  # an optimizer step, in place
        return out

    eager = rollouts("off")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rollouts("on")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # the CPU's default: the policy stays eager
    monkeypatch.setattr(devices, "POLICY_COMPILE_DEVICES", ("cuda", "cpu"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = rollouts("on")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for (a, lp), (b, lq) in zip(eager, compiled):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6) and torch.allclose(lp, lq, atol=1e-5, rtol=1e-6)
    assert not torch.allclose(eager[0][0], eager[3][0])  # the second rollout saw the stepped weights


@needs_inductor
@pytest.mark.parametrize("name", ["sac", "td3"])
def test_compiled_acting_policy_equals_eager(name, monkeypatch):
    """sac's and td3's acting policy (rlfunc.algos.offpolicy.acting_forward) compiled (CUDA's path,
    forced on the CPU) gives the eager actions, stochastic and deterministic, for two policies built
    from the state with an optimizer step between them, from one graph."""
    import torch._dynamo

    from rlfunc import device as devices
    from rlfunc.algos.registry import lookup, resolve
    from tests.algos.test_sac import SPEC as SAC_SPEC

    make = {"sac": "rlfunc.algos.sac:make_sac", "td3": "rlfunc.algos.td3:make_td3"}[name]
    config = replace(resolve(lookup(name).config)(), hidden=(16, 16), batch_size=32, device="cpu")
    obs = torch.randn(2, 5, SAC_SPEC.obs_dim, generator=torch.Generator().manual_seed(3))

    def actions(compile: str):
        algo = resolve(make)(replace(config, compile=compile), SAC_SPEC, torch.device("cpu"))
        state = algo.init()
        gen = torch.Generator().manual_seed(0)
        out = []
        for r in range(2):
            with torch.inference_mode():
                out += [algo.policy(state, gen)(obs[r])[0], algo.policy(state, gen, deterministic=True)(obs[r])[0]]
            with torch.no_grad():
                state["params", "actor"].apply_(lambda p: p.mul_(1.05))
        return out

    eager = actions("off")
    monkeypatch.setattr(devices, "POLICY_COMPILE_DEVICES", ("cuda", "cpu"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = actions("on")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for a, b in zip(eager, compiled):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(eager[1], eager[3])  # the second policy acts with the stepped weights

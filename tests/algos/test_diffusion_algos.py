"""bc / dppo / td3-diffusion on PointReach-v0 with small budgets: modes kept, updates sane, the
schedule checked on load, gradients through the chain into every U-Net parameter."""

import json

import pytest
import torch
from tensordict import TensorDict

from rlfunc.config import replace
from rlfunc.algos.bc import BCConfig
from rlfunc.algos.diffusion_actor import ActorSpec, make_env
from rlfunc.algos.dppo import DPPOConfig, make_dppo
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig
from rlfunc.core import func
from rlfunc.diffusion.ddim import sample
from rlfunc.diffusion.schedule import make_schedule
from rlfunc.errors import CheckpointError, ConfigError, EnvError
from rlfunc.nets.unet1d import ConditionalUnet1D
from rlfunc.optim.amp import precision
from rlfunc.run import checkpoint
from rlfunc.run import train
from rlfunc.run.diffusion import evaluate_run, load_actor

CPU = torch.device("cpu")
SMALL = ActorSpec(hidden=(128, 128, 128), horizon=4, act_steps=4, num_train_steps=20, ddim_steps=10)


@pytest.fixture(scope="module")
def bc_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("bc") / "run"
    config = replace(BCConfig(), actor=SMALL, num_demos=300, num_updates=2000, batch_size=512, lr=3e-3, ema_decay=0.99,
                      log_every=500, checkpoint_every=1000, eval_episodes=400, device="cpu")
    return train(config, d, progress=False, tensorboard=False)


def test_bc_keeps_both_modes(bc_run):
    ev = bc_run.evaluation
    assert ev["num_episodes"] == 400
    assert ev["success_rate"] >= 0.3, ev  # about 0.5 after 2000 updates; 0.99 after 10k (bench/)
    # a Gaussian regression of this data would average the goals; the diffusion actor keeps both:
    # each goal takes at least 30% of the successful episodes
    assert min(ev["share_goal_a"], ev["share_goal_b"]) >= 0.3 * ev["success_rate"], ev
    records = [json.loads(l) for l in (bc_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [500, 1000, 1500, 2000]
    assert records[-1]["loss_denoise"] < records[0]["loss_denoise"]
    written = json.loads((bc_run.run_dir / "eval.json").read_text())
    flat = lambda d: {k: v for k, v in d.items() if k != "ci95"}  # noqa: E731  (approx takes no nested list)
    assert flat(written) == pytest.approx(flat(ev)) and written["ci95"] == pytest.approx(ev["ci95"])
    # the protocol's keys, as every algorithm's evaluation has them (README pass: only episode_return* here)
    assert written["mean"] == written["episode_return"] and written["std"] == written["episode_return_std"]
    assert written["ci95"] == [written["episode_return_ci95_low"], written["episode_return_ci95_high"]]


def test_every_snapshot_holds_the_schedule(bc_run):
    steps = sorted(p.name for p in (bc_run.run_dir / "checkpoints").glob("step_*"))
    assert steps == ["step_000000001000", "step_000000002000"]
    for name in steps:
        state, meta = checkpoint.load_snapshot(bc_run.run_dir / "checkpoints" / name)
        want = make_schedule("cosine", 20)["alphas_cumprod"]
        torch.testing.assert_close(state["learner", "schedule", "alphas_cumprod"], want, rtol=0, atol=0)
        assert meta["actor_spec"]["num_train_steps"] == 20


def test_edited_actor_spec_is_refused(bc_run, tmp_path):
    state, meta = checkpoint.load_snapshot(checkpoint.latest_snapshot(bc_run.run_dir))
    edited = {**meta, "actor_spec": {**meta["actor_spec"], "hidden": [128]}}
    checkpoint.save_snapshot(tmp_path / "hidden", state, edited)
    with pytest.raises(CheckpointError, match="do not match its actor_spec"):
        load_actor(tmp_path / "hidden", CPU)
    checkpoint.save_snapshot(tmp_path / "algo", state, {**meta, "algo": "dppo"})
    with pytest.raises(CheckpointError, match="params/actor"):
        load_actor(tmp_path / "algo", CPU)


def test_linear_schedule_is_scaled_to_short_chains():
    from rlfunc.algos.diffusion_actor import schedule_for

    for T in (20, 100, 1000):
        abar = schedule_for(ActorSpec(schedule="linear", num_train_steps=T, ddim_steps=T), CPU)["alphas_cumprod"]
        assert float(abar[-1]) < 1e-3 and float(abar[0]) > 0.9  # ends near pure noise, starts near data


def test_schedule_mismatch_is_refused(bc_run, tmp_path):
    state, meta = checkpoint.load_snapshot(checkpoint.latest_snapshot(bc_run.run_dir))
    state["learner", "schedule", "alphas_cumprod"][3] += 1e-3
    checkpoint.save_snapshot(tmp_path / "bad", state, meta)
    with pytest.raises(CheckpointError, match="alphas_cumprod"):
        load_actor(tmp_path / "bad", CPU)
    state, meta = checkpoint.load_snapshot(checkpoint.latest_snapshot(bc_run.run_dir))
    meta = {**meta, "actor_spec": {**meta["actor_spec"], "schedule": "linear"}}
    checkpoint.save_snapshot(tmp_path / "other", state, meta)
    with pytest.raises(CheckpointError, match="alphas_cumprod"):
        load_actor(tmp_path / "other", CPU)
    with pytest.raises(CheckpointError, match="no complete snapshot|missing|not"):
        load_actor(tmp_path / "nothing", CPU)


def test_evaluate_run_matches_the_final_evaluation(bc_run):
    ev = evaluate_run(bc_run.run_dir, 400, device="cpu")
    assert ev["algo"] == "bc"
    assert ev["success_rate"] == pytest.approx(bc_run.evaluation["success_rate"])


def _dppo(bc_run, **kw):
    spec, params, obs_stats, *_ = load_actor(bc_run.run_dir, CPU)
    config = replace(DPPOConfig(), **{"num_envs": 32, "num_steps": 8, "minibatch_size": 256, "num_epochs": 1, "device": "cpu", **kw})
    algo = make_dppo(config, spec, 6, 2, CPU)
    state = algo.init(params, obs_stats)
    env = make_env("PointReach-v0", 32, spec.act_steps, CPU, 0)
    return config, algo, state, env, params


@pytest.mark.parametrize("likelihood, prec", [("chain", "off"), ("output-noise", "off"), ("chain", "bf16"), ("output-noise", "bf16")])
def test_dppo_first_update_starts_at_ratio_one(bc_run, likelihood, prec):
    """One epoch over the batch as one minibatch: the ratio of the stored samples is exactly 1
    (the stored log-likelihoods are those of the collecting parameters, computed in the update's
    precision: under bf16 they were once float32 and the ratio started at 0.8-1.2), then the actor moves."""
    config, algo, state, env, bc_params = _dppo(bc_run, likelihood=likelihood, precision=prec)
    gen = torch.Generator().manual_seed(0)
    batch = algo.rollout(state, env, gen)
    assert batch.batch_size == torch.Size([32, 8])
    assert batch["action"].shape == (32, 8, 4, 2)
    if likelihood == "chain":
        assert batch["chain"].shape == (32, 8, 11, 4, 2)
        torch.testing.assert_close(batch["chain"][:, :, -1], batch["action"])
    new, metrics = algo.iteration(state, batch, gen, precision(CPU, config.run.precision))  # steps state["optim_all"]
    assert float(metrics["approx_kl"]) == pytest.approx(0.0, abs=1e-6)
    assert float(metrics["clip_fraction"]) == 0.0
    assert float(metrics["ratio_max"]) == pytest.approx(1.0, abs=1e-4)
    assert all(torch.isfinite(v).all() for v in metrics.values())
    moved = [not torch.equal(a, b) for a, b in zip(func.leaves(new["params", "actor"]), func.leaves(bc_params))]
    assert any(moved)
    for a, b in zip(func.leaves(new["base"]), func.leaves(bc_params)):
        assert torch.equal(a, b)  # the frozen copy never moves
    assert int(new["env_steps"]) == 32 * 8 * 4


def test_dppo_finetune_steps_keeps_the_frozen_prefix(bc_run):
    """With K' = 2 of K = 10 fine-tuned, the first 8 denoising steps of a collected chain are the
    frozen base actor's: perturbing the trainable actor changes only the last 2 steps."""
    config, algo, state, env, bc_params = _dppo(bc_run, finetune_steps=2, num_epochs=2)
    chains = []
    for perturb in (0.0, 0.05):
        with torch.no_grad():
            for p in func.leaves(state["params", "actor"]):
                p.add_(perturb * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
        env = make_env("PointReach-v0", 32, 4, CPU, 0)
        chains.append(algo.rollout(state, env, torch.Generator().manual_seed(1))["chain"][:, 0])
    torch.testing.assert_close(chains[0][:, :9], chains[1][:, :9], rtol=0, atol=0)
    assert not torch.allclose(chains[0][:, 9:], chains[1][:, 9:])
    env = make_env("PointReach-v0", 32, 4, CPU, 0)
    batch = algo.rollout(state, env, torch.Generator().manual_seed(1))
    new, metrics = algo.iteration(state, batch, torch.Generator().manual_seed(2), precision(CPU, "off"))
    assert torch.isfinite(metrics["loss_objective"]) and float(metrics["approx_kl"]) >= 0
    with pytest.raises(ConfigError, match="finetune_steps"):
        make_dppo(DPPOConfig(finetune_steps=11), SMALL, 6, 2, CPU)


def test_a_dppo_run_fine_tuning_its_last_steps_is_evaluated_as_it_acted(bc_run, tmp_path):
    """New-user pass: with finetune_steps K' the rollouts ran the first K - K' denoising steps on the frozen
    pretrained weights, but the final evaluation, `rlfunc eval` and --init-from ran all K on the fine-tuned
    ones (a policy never trained at the high-noise steps: success 0.11 where the policy that acted had 0.17).
    And --finetune-steps with the output-noise likelihood was recorded and changed nothing."""
    from rlfunc.algos.diffusion_actor import DiffusionActor, evaluate_episodes

    config = replace(DPPOConfig(), init_from=str(bc_run.run_dir), finetune_steps=2, total_steps=32 * 8 * 4, num_envs=32,
                     num_steps=8, minibatch_size=256, num_epochs=2, actor_lr=1e-3, eval_episodes=64, device="cpu")
    result = train(config, tmp_path / "ft", progress=False, tensorboard=False)
    assert json.loads((tmp_path / "ft" / "eval.json").read_text())["episode_return"] == result.evaluation["episode_return"]
    # a snapshot whose fine-tuned weights are far from the frozen ones: the two policies clearly apart
    loaded, meta = checkpoint.load_snapshot(checkpoint.latest_snapshot(tmp_path / "ft"))
    tuned, base = loaded["learner", "params", "actor"], loaded["learner", "base"]
    for p in func.leaves(tuned):
        p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    snap = checkpoint.save_snapshot(tmp_path / "snap", loaded, meta)
    actor = DiffusionActor(SMALL, 6, 2, CPU)

    def episodes(frozen):
        return evaluate_episodes(actor, tuned, loaded["learner", "obs_stats"], loaded["learner", "schedule"], "PointReach-v0",
                                 64, seed=config.run.seed + 1_000_003, frozen=frozen)

    as_acted, all_tuned = episodes((base, 2)), episodes(None)
    assert as_acted["episode_return"] != all_tuned["episode_return"]
    assert evaluate_run(snap, 64, device="cpu")["episode_return"] == as_acted["episode_return"]
    assert load_actor(snap, CPU).frozen[1] == 2 and load_actor(bc_run.run_dir, CPU).frozen is None
    with pytest.raises(CheckpointError, match=r"init_from=.*fine-tuned only the last 2 of its 10 denoising steps"):
        train(replace(DPPOConfig(), init_from=str(tmp_path / "ft"), total_steps=80, device="cpu"), tmp_path / "again",
              progress=False, tensorboard=False)
    noise = replace(config, likelihood="output-noise")
    with pytest.raises(ConfigError, match=r"^finetune_steps=2: read only with likelihood='chain'"):
        train(noise, tmp_path / "noise", progress=False, tensorboard=False)
    assert noise.finetune_steps == 2  # a run saved with it (it trained all K steps) still loads


def test_dppo_refuses_gradient_checkpointing_with_the_chain_likelihood():
    # it was accepted with the default likelihood, checkpointed nothing (0 checkpoint calls) and turned compiling off
    with pytest.raises(ConfigError, match="gradient_checkpointing=True: the chain likelihood"):
        DPPOConfig(gradient_checkpointing=True)
    assert DPPOConfig(gradient_checkpointing=True, likelihood="output-noise").gradient_checkpointing


def test_dppo_run_from_bc(bc_run, tmp_path):
    config = replace(DPPOConfig(), init_from=str(bc_run.run_dir), total_steps=2 * 64 * 8 * 4, num_envs=64, num_steps=8,
                        minibatch_size=256, num_epochs=2, eval_episodes=64, checkpoint_every=1, device="cpu")
    result = train(config, tmp_path / "dppo", progress=False, tensorboard=False)
    records = [json.loads(l) for l in (tmp_path / "dppo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2048, 4096]
    assert {"success_rate", "share_goal_a", "share_goal_b", "loss_objective", "approx_kl"} <= records[0].keys()
    assert 0.0 <= result.evaluation["success_rate"] <= 1.0
    spec, _, _, meta, *_ = load_actor(tmp_path / "dppo", CPU)  # the dppo snapshot carries a verified schedule
    assert meta["algo"] == "dppo" and spec == load_actor(bc_run.run_dir, CPU)[0]


def test_td3_diffusion_run(tmp_path):
    actor = ActorSpec(hidden=(64, 64), horizon=1, act_steps=1, num_train_steps=9, ddim_steps=3)
    config = replace(TD3DiffusionConfig(), actor=actor, total_steps=3 * 32 * 30, num_envs=32, num_steps=30, warmup_steps=1000,
                                updates_per_iteration=8, batch_size=64, critic_hidden=(64, 64), eval_episodes=32,
                                device="cpu")
    result = train(config, tmp_path / "td3", progress=False, tensorboard=False)
    records = [json.loads(l) for l in (tmp_path / "td3" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and "loss_critic" not in records[0] and "loss_critic" in records[1]
    assert "loss_actor_q" in records[1] and all(r["loss_critic"] >= 0 for r in records[1:])
    state = result.state
    assert int(state["updates"]) == 16
    # Polyak targets moved towards the online weights but are not equal to them
    online, target = func.leaves(state["params", "critic"]), func.leaves(state["target", "critic"])
    assert any(not torch.equal(a, b) for a, b in zip(online, target))
    assert state["params", "critic", "0", "weight"].shape[0] == 2  # twin critics, stacked


def test_runs_from_bc_record_and_use_the_bc_actor(bc_run, tmp_path):
    """td3-diffusion --init-from a bc run (horizon 4 = act_steps 4): config.json records the bc
    actor, and the step budget counts its 4 actions per chunk (it once used the default's 1)."""
    config = replace(TD3DiffusionConfig(), init_from=str(bc_run.run_dir), total_steps=2 * 16 * 8 * 4, num_envs=16, num_steps=8,
                                warmup_steps=0, updates_per_iteration=2, batch_size=32, eval_episodes=8, device="cpu")
    result = train(config, tmp_path / "td3", progress=False, tensorboard=False)
    records = [json.loads(l) for l in (tmp_path / "td3" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [512, 1024]
    recorded = json.loads((tmp_path / "td3" / "config.json").read_text())["actor"]
    assert recorded["horizon"] == 4 and recorded["hidden"] == [128, 128, 128] and recorded["ddim_steps"] == 10
    assert result.evaluation["num_episodes"] == 8


def test_signal_stops_a_run_with_a_snapshot(tmp_path, monkeypatch):
    """SIGINT in the middle of a bc run: it stops after that update, saves a snapshot that
    evaluates, and reports the signal (the CLI exits with 130)."""
    import os
    import signal

    import rlfunc.run.diffusion as td

    real = td.make_bc

    def make_bc(*args, **kwargs):
        algo = real(*args, **kwargs)
        calls = {"n": 0}

        def iteration(*a, **k):
            calls["n"] += 1
            if calls["n"] == 7:
                os.kill(os.getpid(), signal.SIGINT)
            return algo.iteration(*a, **k)

        return algo._replace(iteration=iteration)

    monkeypatch.setattr(td, "make_bc", make_bc)
    config = replace(BCConfig(), actor=ActorSpec(hidden=(32, 32), ddim_steps=5), num_demos=10, num_updates=1000, batch_size=32,
                      log_every=100, eval_episodes=8, device="cpu")
    result = train(config, tmp_path / "bc", progress=False, tensorboard=False)
    assert result.interrupted == "SIGINT" and result.evaluation is None
    assert int(result.state["iteration"]) == 7
    assert checkpoint.latest_snapshot(tmp_path / "bc").name == "step_000000000007"
    assert evaluate_run(tmp_path / "bc", 4, device="cpu")["episodes"] == 4
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_td3_diffusion_config_errors():
    with pytest.raises(ConfigError, match="horizon"):
        TD3DiffusionConfig(actor=ActorSpec(horizon=4, act_steps=2))
    with pytest.raises(ConfigError, match="tau"):
        TD3DiffusionConfig(tau=0.0)


def test_diffusion_envs_torch_batched_or_gymnasium_chunked():
    """PointReach-v0 is torch-batched; a gymnasium id with bounded Box actions runs chunked on the
    host; an unknown id is one clear error."""
    from envs.point_reach import PointReachEnv
    from rlfunc.envs.chunk import GymChunkEnv

    assert isinstance(make_env("PointReach-v0", 2, 4, CPU, 0), PointReachEnv)
    env = make_env("Pendulum-v1", 2, 1, CPU, 0)
    assert isinstance(env, GymChunkEnv) and env.action_spec.shape == (2, 1)
    env.close()
    with pytest.raises(EnvError, match="not a registered gymnasium id"):
        make_env("NoSuchEnv-v9", 2, 1, CPU, 0)


def test_an_env_without_a_success_flag_reports_no_success_rate(tmp_path):
    """Found by a new user: td3-diffusion on Pendulum-v1 (whose info has no "is_success") reported
    "success_rate": 0.0 in every metrics line and in eval.json. Now only envs that report success
    get a success rate; Pendulum's learning curve plots the return."""
    from rlfunc.algos.diffusion_actor import reports_success

    assert not reports_success("Pendulum-v1") and reports_success("PointReach-v0") and reports_success("PushState-v0")
    config = replace(TD3DiffusionConfig(), env="Pendulum-v1", total_steps=800, num_envs=2, num_steps=200, warmup_steps=400,
                     updates_per_iteration=2, batch_size=8, buffer_size=200, eval_episodes=2, checkpoint_every=0, device="cpu")
    result = train(config, tmp_path / "run", progress=False, tensorboard=False)
    assert "success_rate" not in result.evaluation and result.evaluation["episode_return"] < 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["episodes"] for r in records] == [2, 2] and not any("success_rate" in r for r in records)  # whole episodes
    assert "success_rate" not in evaluate_run(tmp_path / "run")


def test_q_gradient_reaches_every_unet_parameter_through_the_chain():
    """A loss on the final action of a 4-step DDIM chain (eta = 0) gives every U-Net parameter a
    finite, non-zero gradient; per-step checkpointing gives the same gradients."""
    torch.manual_seed(0)
    net = ConditionalUnet1D(2, 6, down_dims=(16, 32), kernel_size=3, n_groups=4)
    params = func.params_from_module(net)
    schedule = make_schedule("cosine", 20)
    cond = torch.randn(5, 6)
    noise = torch.randn(5, 5, 7, 2)  # K + 1 = 5 noises, batch 5, horizon 7 (not a power of two)
    apply = lambda p, x, t, c: func.apply(net, p, x, t, c)  # noqa: E731
    grads = []
    for ckpt in (False, True):
        x0 = sample(apply, params, cond, noise, schedule, 4, 0.0, checkpoint=ckpt)
        q = -(x0 - 0.3).square().sum()
        for p in func.leaves(params):
            p.grad = None
        q.backward()
        grads.append([p.grad.clone() for p in func.leaves(params)])
    for name, g in zip(params.flatten_keys(".").keys(), grads[0]):
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_bc_config_errors():
    with pytest.raises(ConfigError, match="ema_decay"):
        BCConfig(ema_decay=1.0)
    with pytest.raises(ConfigError, match="act_steps"):
        ActorSpec(horizon=2, act_steps=3)
    with pytest.raises(ConfigError, match="ddim_steps"):
        ActorSpec(num_train_steps=5, ddim_steps=6)
    with pytest.raises(ConfigError, match="divisor"):  # 'leading' spacing would start at t=10 of 20
        ActorSpec(num_train_steps=20, ddim_steps=11)
    for bad in (dict(eta=float("nan")), dict(output_noise_std=float("inf")), dict(clip_rate=float("nan"))):
        with pytest.raises(ConfigError, match="finite"):
            replace(DPPOConfig(), **bad)
    with pytest.raises(ConfigError, match="weight_decay"):
        BCConfig(weight_decay=-1.0)
    with pytest.raises(ConfigError, match="torch_threads"):
        replace(TD3DiffusionConfig(), torch_threads=-3)


def test_ema_is_a_lerp():
    from rlfunc.algos.bc import ema_update_

    ema = TensorDict({"w": torch.zeros(3)}, [])
    ema_update_(ema, TensorDict({"w": torch.ones(3)}, []), 0.9)
    torch.testing.assert_close(ema["w"], torch.full((3,), 0.1))


def test_second_signal_quits_at_once(capsys):
    import os
    import signal

    from rlfunc.run.resume import StopOnSignal

    with pytest.raises(KeyboardInterrupt):
        with StopOnSignal() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signal == "SIGINT"
            # the input that broke it: `timeout -s INT` delivers its signal twice at once (to the
            # command, then to its process group), which quit without a snapshot
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signal == "SIGINT"  # a copy of the first, ignored
            stop._first_at -= StopOnSignal.REPEAT_S  # a second Ctrl-C a moment later
            os.kill(os.getpid(), signal.SIGINT)
    assert "stopping after this iteration" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # the interrupt names its signal: two SIGTERMs exited with SIGINT's 130, not 143 (new-user pass)
    with pytest.raises(KeyboardInterrupt) as raised:
        with StopOnSignal() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            stop._first_at -= StopOnSignal.REPEAT_S
            os.kill(os.getpid(), signal.SIGTERM)
    assert raised.value.signal == "SIGTERM"


def test_eval_of_a_snapshot_with_an_edited_config_is_one_error(bc_run, tmp_path):
    state, meta = checkpoint.load_snapshot(checkpoint.latest_snapshot(bc_run.run_dir))
    checkpoint.save_snapshot(tmp_path / "cfg", state, {**meta, "config": {"seed": "abc"}})
    with pytest.raises(CheckpointError, match="no valid config"):
        evaluate_run(tmp_path / "cfg", device="cpu")
    assert evaluate_run(bc_run.run_dir, device="cpu")["episodes"] == 400  # the run's eval_episodes


def test_dppo_update_reuses_the_conditions_computed_while_collecting(bc_run):
    """The rollout stores each step's condition; it equals a fresh one (fixed encoder/statistics),
    so the update skips re-encoding the observations (only the next observations are encoded)."""
    config, algo, state, env, _ = _dppo(bc_run, likelihood="chain", precision="off")
    batch = algo.rollout(state, env, torch.Generator().manual_seed(0))
    assert batch["cond"].shape == (32, 8, 6)
    assert torch.equal(batch["cond"], algo.actor.condition(None, state["obs_stats"], batch))

"""Gaussian PPO through the multimodal encoder (rlfunc.algos.ppo_encoder, rlfunc.run.ppo_encoder).

A tiny encoder (ResNet widths (8, 8), d_model 16) keeps every test fast; tests that step Push-v0
render its cameras and skip when no OpenGL works (as tests/envs/test_push.py)."""

import json
import math

import pytest
import torch
from tensordict import TensorDict

from envs.push import env as pe
from rlfunc.config import replace
from rlfunc.algos.diffusion_actor import EnvInfo, env_info
from rlfunc.algos.ppo_encoder import PPOEncoderConfig, make_ppo_encoder
from rlfunc.core import func
from rlfunc.envs.chunk import GymChunkEnv
from rlfunc.errors import ConfigError, EnvError
from rlfunc.run import checkpoint

CPU = torch.device("cpu")
TINY = dict(
    num_envs=2, num_steps=8, minibatch_size=8, num_epochs=2, hidden=(16,), encoder_d_model=16,
    encoder_widths=(8, 8), encoder_blocks=(1, 1), device="cpu", eval_episodes=2, lr=1e-3,
)


def _rendering_available() -> bool:
    try:
        env = pe.PushEnv()
        env.reset(seed=0)
        env.close()
        return True
    except EnvError:
        return False


needs_rendering = pytest.mark.skipif(not _rendering_available(), reason=f"no working OpenGL (backend {pe.gl_backend()})")

# a synthetic Dict observation: one 32x32 camera and 5 proprio numbers, 2-D actions
INFO = EnvInfo(0, 2, "proprio", 5, ("cam", "proprio"), cameras=("cam",), image_size=(32, 32), proprio_dim=5)


def _batch(n: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "cam": torch.randint(0, 256, (n, 32, 32, 3), generator=g, dtype=torch.uint8),
            "proprio": torch.randn(n, 5, generator=g),
            "action": torch.randn(n, 2, generator=g),
            "sample_log_prob": torch.randn(n, 1, generator=g) - 2.0,
            "advantage": torch.randn(n, 1, generator=g),
            "value_target": torch.randn(n, 1, generator=g),
            "state_value": torch.randn(n, 1, generator=g),
        },
        batch_size=[n],
    )


def test_loss_equals_the_ppo_loss_computed_by_hand():
    config = replace(PPOEncoderConfig(), env="none", **{**TINY, "entropy_coef": 0.01, "value_coef": 0.7, "clip_epsilon": 0.1})
    algo = make_ppo_encoder(config, INFO, CPU)
    state = algo.init()
    with torch.no_grad():
        state["params", "log_std"].copy_(torch.tensor([-0.3, 0.2]))
    mb = _batch(6)
    loss, metrics = algo.loss(state["params"], state["proprio_stats"], mb)
    loc, log_std, value = func.apply(algo.net, state["params"], {"cam": mb["cam"], "proprio": mb["proprio"]}, state["proprio_stats"])
    # by hand, in double: log N(a; mu, sigma^2), the clipped ratio, the value and entropy terms
    loc, log_std, value = loc.double().detach(), log_std.double().detach(), value.double().detach()
    a = mb["action"].double()
    log_prob = (-0.5 * ((a - loc) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1, keepdim=True)
    ratio = (log_prob - mb["sample_log_prob"].double()).exp()
    adv = mb["advantage"].double()  # not normalised inside the loss (the iteration does it per minibatch)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(0.9, 1.1) * adv).mean()
    value_loss = 0.7 * 0.5 * (value - mb["value_target"].double()).pow(2).mean()
    entropy = (log_std + 0.5 * (1 + math.log(2 * math.pi))).sum()
    expected = -surrogate + value_loss - 0.01 * entropy
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    assert float(metrics["entropy"]) == pytest.approx(float(entropy), rel=1e-6)
    assert float(metrics["clip_fraction"]) == pytest.approx(float(((ratio - 1).abs() > 0.1).double().mean()))
    # the loss reaches every part: encoder trunk, fusion, both heads and log_std
    loss.backward()
    for key in (("encoder", "vision"), ("encoder", "fusion"), ("encoder", "proprio"), ("actor",), ("critic",)):
        grads = [p.grad for p in func.leaves(state["params"][key])]
        assert any(g is not None and g.abs().sum() > 0 for g in grads), key
    assert state["params", "log_std"].grad.abs().sum() > 0


def test_micro_batches_give_the_gradient_of_the_whole_minibatch():
    from rlfunc.losses.ppo import EV_MAXIMA, EV_MOMENTS, pool_explained_variance
    from rlfunc.optim.amp import accumulate_gradients

    grads, metrics = [], []
    for micro in (None, 2):
        config = replace(PPOEncoderConfig(), env="none", **{**TINY, "micro_batch_size": micro, "num_envs": 1, "minibatch_size": 8, "num_epochs": 1})
        algo = make_ppo_encoder(config, INFO, CPU)
        state = algo.init()
        _, m = accumulate_gradients(lambda m: algo.loss(state["params"], state["proprio_stats"], m), _batch(8, 1), micro,
                                    maxima=EV_MAXIMA, moments=EV_MOMENTS)  # as the update merges the micro-batches' metrics
        grads.append(torch.cat([p.grad.flatten() for p in func.leaves(state["params"])]))
        metrics.append(pool_explained_variance(m))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    # and the metrics of the whole minibatch: the explained variance merged from the 4 micro-batches' parts
    # (the mean of their own values, 2 samples each, was another number)
    assert set(metrics[0].keys()) == set(metrics[1].keys())
    for name in ("explained_variance", "loss_critic", "approx_kl"):
        torch.testing.assert_close(metrics[1][name], metrics[0][name], rtol=1e-4, atol=1e-6)


def test_policy_log_prob_is_the_gaussian_density_of_the_action():
    algo = make_ppo_encoder(replace(PPOEncoderConfig(), env="none", **TINY), INFO, CPU)
    state = algo.init()
    td = _batch(4).select("cam", "proprio")
    out = algo.policy(state, torch.Generator().manual_seed(1))(td.clone())
    loc, log_std, value = func.apply(algo.net, state["params"], {"cam": td["cam"], "proprio": td["proprio"]}, state["proprio_stats"])
    dist = torch.distributions.Normal(loc.double(), log_std.double().exp())
    expected = dist.log_prob(out["action"].double()).sum(-1, keepdim=True)
    torch.testing.assert_close(out["sample_log_prob"].double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["state_value"], value.detach())
    assert not out["action"].requires_grad and not out["sample_log_prob"].requires_grad
    det = algo.policy(state, None, deterministic=True)(td.clone())
    torch.testing.assert_close(det["action"], loc.detach())


def _train(tmp_path, name, **overrides):
    from rlfunc.run import train

    config = replace(PPOEncoderConfig(), env="Push-v0", total_steps=32, **{**TINY, **overrides})
    return train(config, tmp_path / name, progress=False, tensorboard=False, evaluate=False)


@needs_rendering
def test_iterations_on_push_change_encoder_and_heads_and_are_deterministic(tmp_path):
    info = env_info("Push-v0")
    config = replace(PPOEncoderConfig(), env="Push-v0", **TINY)
    start = make_ppo_encoder(config, info, CPU).init()["params"]
    a = _train(tmp_path, "a")
    b = _train(tmp_path, "b")
    pa, pb = a.state["params"], b.state["params"]
    assert int(a.state["env_steps"]) == 32 and int(a.state["iteration"]) == 2
    for key in (("encoder", "vision"), ("encoder", "fusion"), ("encoder", "text"), ("encoder", "proprio"), ("actor",), ("critic",), ("log_std",)):
        flat = lambda t: t.flatten() if isinstance(t, torch.Tensor) else torch.cat([p.flatten() for p in func.leaves(t)])  # noqa: E731
        before, after = flat(start[key]), flat(pa[key])
        assert not torch.equal(before, after), key
    for x, y in zip(func.leaves(pa), func.leaves(pb)):  # same seed: bit-identical
        assert torch.equal(x, y)
    assert torch.equal(a.state["proprio_stats", "mean"], b.state["proprio_stats", "mean"])
    assert float(a.state["proprio_stats", "count"]) == 32
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [16, 32] and all(math.isfinite(r["loss_critic"]) for r in records)


@needs_rendering
def test_envs_keep_running_across_iterations():
    info = env_info("Push-v0")
    config = replace(PPOEncoderConfig(), env="Push-v0", **{**TINY, "num_steps": 4})
    algo = make_ppo_encoder(config, info, CPU)
    state = algo.init()
    env = GymChunkEnv("Push-v0", 2, act_steps=1, seed=0)
    try:
        gen = torch.Generator().manual_seed(0)
        carry = env.reset()
        first, carry = algo.rollout(state, env, carry, gen)
        second, carry = algo.rollout(state, env, carry, gen)
    finally:
        env.close()
    assert first.batch_size == torch.Size([2, 4]) and first["top"].dtype == torch.uint8
    # the second rollout starts where the first stopped: its first observation is the first's last next one
    torch.testing.assert_close(second["proprio"][:, 0], first["next", "proprio"][:, -1])
    torch.testing.assert_close(second["next", "episode_return"][:, 0] - second["next", "reward"][:, 0],
                               first["next", "episode_return"][:, -1])


@needs_rendering
def test_cli_trains_push_with_images_and_evaluates(tmp_path, capsys):
    from rlfunc.cli.commands import main

    run = tmp_path / "run"
    flags = ["--total-steps", "16", "--num-envs", "2", "--num-steps", "8", "--minibatch-size", "8", "--num-epochs", "1",
             "--encoder-widths", "8", "8", "--encoder-blocks", "1", "1", "--encoder-d-model", "16", "--hidden", "16",
             "--eval-episodes", "2", "--device", "cpu"]
    assert main(["train", "ppo", "--env", "Push-v0", "--run-dir", str(run), *flags]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["env"] == "Push-v0" and summary["episodes"] == 2 and 0.0 <= summary["success_rate"] <= 1.0
    meta = checkpoint.load_meta(checkpoint.latest_snapshot(run))
    assert meta["algo"] == "ppo-encoder" and meta["env_steps"] == 16
    assert main(["eval", str(run), "--episodes", "2", "--device", "cpu"]) == 0
    again = json.loads(capsys.readouterr().out.strip())
    assert again["mean"] == pytest.approx(summary["mean"])  # same eval seeds, deterministic actions
    assert main(["resume", str(run)]) == 0  # finished: nothing left to train, evaluated again
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mean"] == pytest.approx(summary["mean"])
    # as if saved on a GPU (a 16-byte generator state): evaluating it here failed on the state's shape
    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    state["learner", "rng"] = torch.zeros(16, dtype=torch.uint8)
    checkpoint.save_snapshot(snap, state, meta)
    assert main(["eval", str(run), "--episodes", "2", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out.strip()) == again
    assert main(["resume", str(run)]) == 2 and "resume it with --device cuda or npu" in capsys.readouterr().err
    assert main(["train", "ppo", "--env", "Push-v0", "--run-dir", str(tmp_path / "bad"), *flags, "--minibatch-size", "7"]) == 2
    assert "minibatch_size=7" in capsys.readouterr().err


def test_box_observation_env_is_a_clear_error(tmp_path):
    from rlfunc.run import train

    with pytest.raises(EnvError, match="Box observation.*Dict observation"):
        train(replace(PPOEncoderConfig(), env="PushState-v0", **TINY), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    box = EnvInfo(21, 3, "observation", 21, ("observation",))
    with pytest.raises(EnvError, match="PushState-v0"):
        make_ppo_encoder(replace(PPOEncoderConfig(), env="PushState-v0", **TINY), box, CPU)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="minibatch_size=5"):
        replace(PPOEncoderConfig(), **{**TINY, "minibatch_size": 5})
    with pytest.raises(ConfigError, match="gamma"):
        PPOEncoderConfig(gamma=1.5)
    with pytest.raises(ConfigError, match="encoder_widths"):
        PPOEncoderConfig(encoder_widths=(8, 8), encoder_blocks=(1,))
    with pytest.raises(ConfigError, match="init_log_std"):
        PPOEncoderConfig(init_log_std=float("nan"))


def test_eval_of_a_missing_run_is_a_checkpoint_error(tmp_path):
    from rlfunc.errors import CheckpointError
    from rlfunc.run.ppo_encoder import evaluate_run

    with pytest.raises(CheckpointError, match="no complete snapshot"):
        evaluate_run(tmp_path)


def test_success_is_reported_only_for_envs_that_report_it():
    from rlfunc.run.ppo_encoder import reports_success

    assert reports_success("PushState-v0")
    assert not reports_success("Pusher-v5")


def test_bf16_autocast_with_checkpointed_vision_is_close_to_float32():
    from rlfunc.optim.amp import accumulate_gradients, precision

    losses, grads = [], []
    for mode, ckpt in (("off", False), ("bf16", True)):
        config = replace(PPOEncoderConfig(), env="none", **{**TINY, "precision": mode, "checkpoint_vision": ckpt})
        prec = precision(CPU, mode)
        algo = make_ppo_encoder(config, INFO, CPU, prec)
        state = algo.init()
        loss, _ = accumulate_gradients(lambda m: algo.loss(state["params"], state["proprio_stats"], m), _batch(6, 2), 3, prec=prec)
        out = algo.policy(state, torch.Generator().manual_seed(0))(_batch(4).select("cam", "proprio"))
        assert out["action"].dtype == out["sample_log_prob"].dtype == torch.float32
        losses.append(float(loss))
        grads.append(torch.cat([p.grad.flatten() for p in algo.trainable(state["params"])]))
    assert math.isfinite(losses[1]) and losses[1] == pytest.approx(losses[0], rel=0.05, abs=0.02)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.9


def test_episode_metrics_leave_a_non_finite_return_out():
    # Regression (review pass): a NaN or inf episode return was counted and averaged into the metrics line
    # (ppo's line leaves it out of both).
    from rlfunc.algos.ppo_encoder import episode_metrics

    done = torch.tensor([[True, False, True], [True, True, False]]).unsqueeze(-1)
    ret = torch.tensor([[-5.0, 1.0, float("nan")], [3.0, float("inf"), 2.0]]).unsqueeze(-1)
    success = torch.tensor([[False, True, True], [True, True, False]]).unsqueeze(-1)
    out = episode_metrics(TensorDict({"next": {"done": done, "episode_return": ret, "success": success}}, batch_size=[2, 3]))
    assert int(out["episodes"]) == 2 and float(out["episode_return"]) == -1.0 and float(out["success_rate"]) == 0.5

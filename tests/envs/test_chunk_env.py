"""GymChunkEnv (gymnasium envs stepped one action chunk at a time), the chunked demonstration dataset,
and the diffusion algorithms on Push-v0 / PushState-v0 end to end (images, proprio and text)."""

import json

import gymnasium as gym
import numpy as np
import pytest
import torch
from torchrl.envs.utils import check_env_specs

import envs  # noqa: F401
from envs.push import env as pe
from rlfunc.config import replace
from rlfunc.algos.bc import BCConfig
from rlfunc.algos.diffusion_actor import ActorSpec, env_info
from rlfunc.algos.dppo import DPPOConfig
from rlfunc.core import func
from rlfunc.envs.chunk import GymChunkEnv, scale_action, unscale_action
from rlfunc.envs.demos import chunk_indices, expert_demonstrations
from rlfunc.errors import CheckpointError, EnvError, ShapeError
from rlfunc.run import train
from rlfunc.run.diffusion import evaluate_run, load_actor

CPU = torch.device("cpu")


needs_rendering = pytest.mark.skipif(not pe.rendering_available(), reason="no working OpenGL")


def test_scale_roundtrip_and_bounds():
    low, high = np.array([-2.0, 0.0], np.float32), np.array([2.0, 1.0], np.float32)
    a = np.array([[-1.0, -1.0], [0.0, 0.5], [1.0, 1.0]], np.float32)
    s = scale_action(a, low, high)
    np.testing.assert_allclose(s, [[-2.0, 0.0], [0.0, 0.75], [2.0, 1.0]])
    np.testing.assert_allclose(unscale_action(s, low, high), a, atol=1e-6)


def test_chunk_indices_repeat_the_last_step():
    np.testing.assert_array_equal(chunk_indices(3, 4), [[0, 1, 2, 2], [1, 2, 2, 2], [2, 2, 2, 2]])


def test_pendulum_chunk_equals_stepping_the_gym_env_by_hand():
    """A 3-action chunk: the same observation and summed reward as three gymnasium steps with the
    scaled actions (Pendulum's bounds are +-2), from the same reset seed."""
    check_env_specs(GymChunkEnv("Pendulum-v1", 2, act_steps=3, seed=7))
    env = GymChunkEnv("Pendulum-v1", 2, act_steps=3, seed=7)
    td = env.reset()
    rng = np.random.default_rng(7)
    seeds = [rng.integers(2**31) for _ in range(2)]  # the reset seeds GymChunkEnv drew
    action = torch.tensor([[[0.5], [-1.0], [0.25]], [[1.0], [1.0], [-0.5]]])
    out = env.step(td.set("action", action))["next"]
    for i in range(2):
        ref = gym.make("Pendulum-v1")
        obs, _ = ref.reset(seed=int(seeds[i]))
        np.testing.assert_allclose(td["observation"][i].numpy(), obs, rtol=1e-6)
        total = 0.0
        for k in range(3):
            obs, r, *_ = ref.step(2.0 * action[i, k].numpy())
            total += r
        np.testing.assert_allclose(out["observation"][i].numpy(), obs, rtol=1e-5)
        assert out["reward"][i, 0].item() == pytest.approx(total, rel=1e-5)
        assert out["episode_return"][i, 0].item() == pytest.approx(total, rel=1e-5)
    env.close()


@pytest.mark.parametrize("shape", [(2, 3), (2, 1, 3), (2, 3, 1), (2, 9)])
def test_an_action_not_of_the_spec_shape_is_refused(shape):
    """New-user pass: GymChunkEnv("PushState-v0", act_steps=3) took an [N, A] action and ran each of its
    numbers as one sub-step, broadcast over the three axes; [N, 1, A] and [N, 3, 1] alike. A ShapeError
    now names the shape expected, and the env has not stepped."""
    action = torch.full((2, 3, 3), 0.5)
    untouched = GymChunkEnv("PushState-v0", 2, act_steps=3, seed=0)
    want = untouched.step(untouched.reset().set("action", action))["next", "observation"]
    env = GymChunkEnv("PushState-v0", 2, act_steps=3, seed=0)
    td = env.reset()
    with pytest.raises(ShapeError, match=r"expected \[2, 3, 3\] \(num_envs, act_steps, action dim\)"):
        env.step(td.set("action", torch.full(shape, 0.5)))
    got = env.step(td.set("action", action))["next", "observation"]  # as if the refused step never was
    assert torch.equal(got, want) and not torch.equal(got, td["observation"])
    env.close()
    untouched.close()


def test_a_chunk_stops_at_the_episode_end_and_only_ended_envs_reset():
    """Pendulum's time limit is 200 steps: with 3-action chunks the 67th chunk ends the episode
    after 2 of its actions (truncated, not terminated); a partial reset leaves the other env alone."""
    env = GymChunkEnv("Pendulum-v1", 1, act_steps=3, seed=0)
    td = env.rollout(67, break_when_any_done=False)
    trunc = td["next", "truncated"].squeeze(-1)[0]
    assert trunc.nonzero().flatten().tolist() == [66]
    assert not td["next", "terminated"].any()
    env.close()
    env = GymChunkEnv("Pendulum-v1", 2, act_steps=1, seed=0)
    td = env.reset()
    before = td["observation"].clone()
    mask = torch.tensor([[True], [False]])
    after = env.reset(td.set("_reset", mask))
    assert not torch.equal(after["observation"][0], before[0])
    assert torch.equal(after["observation"][1], before[1])
    env.close()


def _steer(obs: torch.Tensor, speed: torch.Tensor, act_steps: int) -> torch.Tensor:
    """PointReach chunks heading for goal a at env i's ``speed[i]`` (of the max): the envs reach it
    (terminated) at different steps, the slowest not in time (truncated)."""
    direction = obs[:, 2:4] / obs[:, 2:4].norm(dim=-1, keepdim=True).clamp_min(1e-6)
    return (direction * speed[:, None]).unsqueeze(1).expand(-1, act_steps, -1).contiguous()


def _logging_seeds(env, offset: int, log: list) -> None:
    """Record (env index of the single process, seed) of every env reset of ``env``'s part."""
    reset = env._part.reset

    def logged(indices, seeds):
        log.extend((offset + int(i), int(s)) for i, s in zip(indices, seeds))
        return reset(indices, seeds)

    env._part.reset = logged


@pytest.mark.parametrize("workers", [0, 1])
def test_split_envs_are_the_single_process_rows_however_their_episodes_end(workers):
    """8 PointReach envs in one GymChunkEnv, and the same 8 as 2 ranks' splits of 4 (their collective
    simulated: every rank's done flags after the step), driven by the same chunks: the same
    observations, rewards and flags at every step, the same reset seeds for the same envs, and the
    single process's seed stream on every rank, while episodes end at different steps on different
    envs (and ranks) over 24 chunk steps; with rank 1's 4 envs in a worker process too."""
    from torchrl.envs.utils import step_mdp

    N, W, T, act_steps = 8, 2, 24, 2
    speed = torch.tensor([1.0, 0.35, 0.6, 0.45, 0.8, 0.3, 0.5, 0.7])
    single_log, rank_log = [], []
    single = GymChunkEnv("PointReach-v0", N, act_steps=act_steps, seed=3)
    _logging_seeds(single, 0, single_log)
    done_of = {}
    gather = lambda done: torch.cat([done_of[r] for r in range(W)])  # noqa: E731  (the ranks' all_gather)
    ranks = [GymChunkEnv("PointReach-v0", N // W, act_steps=act_steps, seed=3, split=(r, W), dones_of_split=gather,
                         workers=workers if r == 1 else 0) for r in range(W)]  # the seeds are drawn here, wherever the envs step
    for r, env in enumerate(ranks):
        if not workers:
            _logging_seeds(env, r * N // W, rank_log)
    td = single.reset()
    own = [env.reset() for env in ranks]
    ends = []
    for _ in range(T):
        assert torch.equal(torch.cat([o["observation"] for o in own]), td["observation"])
        td["action"] = _steer(td["observation"], speed, act_steps)
        for r, o in enumerate(own):
            o["action"] = td["action"][r * N // W:(r + 1) * N // W]
        td = single.step(td)
        own = [env.step(o) for env, o in zip(ranks, own)]
        for key in ("observation", "reward", "done", "terminated", "truncated", "episode_return"):
            assert torch.equal(torch.cat([o["next", key] for o in own]), td["next", key]), key
        for r, o in enumerate(own):
            done_of[r] = o["next", "done"].reshape(-1)
        ends.append(td["next", "done"].reshape(-1).clone())
        td = single.maybe_reset(step_mdp(td))
        own = [env.maybe_reset(step_mdp(o)) for env, o in zip(ranks, own)]
    ends = torch.stack(ends)  # [T, N]
    assert ends[:, :N // 2].any(1).ne(ends[:, N // 2:].any(1)).any()  # one rank's episodes ended while the other's did not
    assert len({tuple(col.nonzero().flatten().tolist()) for col in ends.T}) >= 5  # the envs end at different steps
    assert ends.sum() >= 12
    for env in ranks:
        assert env.rng_state() == single.rng_state()
    if not workers:
        assert len(single_log) == N + int(ends.sum()) and sorted(rank_log) == sorted(single_log)
    for env in (single, *ranks):
        env.close()


def test_a_split_gymnasium_env_needs_every_ranks_done_flags():
    with pytest.raises(EnvError, match="dones_of_split=None with split=\\(0, 2\\)"):
        GymChunkEnv("Pendulum-v1", 2, split=(0, 2))
    with pytest.raises(EnvError, match="split=\\(2, 2\\): expected"):
        GymChunkEnv("Pendulum-v1", 2, split=(2, 2), dones_of_split=lambda d: d)
    env = GymChunkEnv("Pendulum-v1", 2, act_steps=1, seed=0, split=(1, 2), dones_of_split=lambda d: d)  # not the ranks' flags
    td = env.reset().set("_reset", torch.tensor([[True], [False]]))
    with pytest.raises(EnvError, match="dones_of_split: returned \\[1, 0\\]: expected the 4 done flags"):
        env.reset(td)
    env.close()


@needs_rendering
def test_push_pixels_chunk_env_keeps_images_uint8_and_tokenises_instructions():
    env = GymChunkEnv("Push-v0", 2, act_steps=2, seed=0)
    check_env_specs(env)
    td = env.rollout(2, break_when_any_done=False)
    assert td["top"].dtype == torch.uint8 and td["top"].shape == (2, 2, 128, 128, 3)
    assert td["proprio"].dtype == torch.float32 and td["proprio"].shape == (2, 2, 16)
    tok = env.codec.tokenizer
    words = [tok.vocab[i] for i in td["instruction_tokens"][0, 0].tolist() if i]
    assert " ".join(words) == " ".join(tok.split(env.envs[0].unwrapped.instruction))
    assert td["instruction_padding_mask"][0, 0].tolist() == [i == 0 for i in td["instruction_tokens"][0, 0].tolist()]
    assert tok.cache_hits > 0  # one tokenisation per distinct instruction
    env.close()


def test_bad_env_ids_and_action_spaces_are_one_line_errors():
    with pytest.raises(EnvError, match="not a registered gymnasium id"):
        GymChunkEnv("NoSuch-v0", 1)
    with pytest.raises(EnvError, match="bounded 1-D Box"):
        GymChunkEnv("CartPole-v1", 1)
    with pytest.raises(EnvError, match="num_envs"):
        GymChunkEnv("Pendulum-v1", 0)


def test_push_state_demonstrations_are_the_experts_scaled_chunks():
    """Chunks hold the expert's actions scaled to [-1, 1] (bounds +-0.25 m/s), edge-padded."""
    data, summary = expert_demonstrations("PushState-v0", 2, 3, seed=0, noise_std=0.0, device=CPU)
    from envs.push.expert import collect_demonstrations

    ref = collect_demonstrations("PushState-v0", 2, 0)
    first = ref["episodes"][0]
    n = len(first["actions"])
    assert summary["success_rate"] == ref["success_rate"] and data.batch_size[0] == int(ref["length"].sum())
    np.testing.assert_allclose(data["action"][:n, 0].numpy(), first["actions"] / 0.25, atol=1e-6)
    np.testing.assert_allclose(data["action"][n - 1].numpy(), np.repeat(first["actions"][-1:] / 0.25, 3, 0), atol=1e-6)
    np.testing.assert_allclose(data["observation"][:n].numpy(), first["observations"][:n])
    assert data["action"].abs().max() <= 1.0 + 1e-6


def test_push_state_bc_then_dppo_from_the_cli_functions(tmp_path):
    """A few bc updates and one dppo iteration on PushState-v0 run, change the parameters, and the
    dppo run refuses a bc run of another env."""
    bc = replace(BCConfig(), env="PushState-v0", num_demos=2, num_updates=3, batch_size=16, eval_episodes=2, log_every=1,
                  actor=ActorSpec(hidden=(32, 32), horizon=4, act_steps=4, num_train_steps=4, ddim_steps=2), device="cpu")
    r = train(bc, tmp_path / "bc", progress=False, tensorboard=False)
    assert json.loads((tmp_path / "bc" / "demos.json").read_text())["num_episodes"] == 2
    assert r.evaluation["num_episodes"] == 2.0 and 0.0 <= r.evaluation["success_rate"] <= 1.0
    loaded = load_actor(tmp_path / "bc", CPU)
    assert loaded.info == env_info("PushState-v0") and loaded.encoder is None
    d = replace(DPPOConfig(), env="PushState-v0", init_from=str(tmp_path / "bc"), total_steps=2 * 2 * 4, num_envs=2, num_steps=2,
                   minibatch_size=4, num_epochs=1, eval_episodes=2, target_kl=None, device="cpu")
    out = train(d, tmp_path / "dppo", progress=False, tensorboard=False)
    moved = [(a - b).abs().max().item() for a, b in zip(func.leaves(out.state["params", "actor"]), func.leaves(loaded.params))]
    assert max(moved) > 0
    with pytest.raises(CheckpointError, match="observations"):
        train(replace(DPPOConfig(), env="PointReach-v0", init_from=str(tmp_path / "bc"), device="cpu"), tmp_path / "x",
                   progress=False, tensorboard=False)


TINY_VISION = dict(encoder_d_model=16, encoder_widths=(8, 8), encoder_blocks=(1, 1))


@needs_rendering
def test_push_pixels_bc_and_dppo_with_images_proprio_and_text(tmp_path):
    """Push-v0 end to end with both cameras, proprio and the instruction: bc trains the encoder and
    the denoiser (every encoder part moves), dppo starts from it (encoder frozen) and moves the actor
    and the critic; eval reads the run back."""
    spec = ActorSpec(hidden=(32, 32), horizon=2, act_steps=2, num_train_steps=4, ddim_steps=2, **TINY_VISION)
    bc = replace(BCConfig(), env="Push-v0", num_demos=1, num_updates=2, batch_size=8, eval_episodes=1, log_every=1, actor=spec,
                  lr=1e-2, device="cpu")
    r = train(bc, tmp_path / "bc", progress=False, tensorboard=False)
    state = r.state
    assert set(state["encoder"].keys()) >= {"vision", "proprio", "text", "fusion", "cls"}
    fresh = load_actor(tmp_path / "bc", CPU)
    assert sorted(fresh.info.cameras) == ["side", "top"] and fresh.info.text == "learned"
    from rlfunc.algos.diffusion_actor import DiffusionActor

    init = DiffusionActor(spec, fresh.info, 3, CPU).init_encoder_params(bc.run.seed + 1)
    for part in ("vision", "proprio", "text", "fusion"):
        changed = [not torch.equal(a, b) for a, b in zip(func.leaves(state["encoder", part]), func.leaves(init[part]))]
        assert any(changed), part
    d = replace(DPPOConfig(), env="Push-v0", init_from=str(tmp_path / "bc"), total_steps=2 * 2 * 2, num_envs=2, num_steps=2,
                   minibatch_size=4, num_epochs=1, eval_episodes=1, target_kl=None, device="cpu")
    out = train(d, tmp_path / "dppo", progress=False, tensorboard=False)
    for part in ("actor", "critic"):
        start = fresh.params if part == "actor" else None
        if start is not None:
            assert any(not torch.equal(a, b) for a, b in zip(func.leaves(out.state["params", part]), func.leaves(start)))
    assert all(torch.equal(a, b) for a, b in zip(func.leaves(out.state["encoder"]), func.leaves(fresh.encoder)))
    ev = evaluate_run(tmp_path / "dppo", 1, device="cpu")
    assert ev["algo"] == "dppo" and ev["num_episodes"] == 1.0


def test_success_and_return_at_the_end_survive_the_reset_that_follows():
    """Regression: the output's success flags shared memory with the host array that the reset of the
    ended env overwrote, so ("next", "success") read False at every terminal step of a rollout."""
    from envs.push.expert import choose_route, expert_action

    env = GymChunkEnv("PushState-v0", 1, act_steps=1, seed=0)
    u = env.envs[0].unwrapped
    routes = {}

    def policy(td):
        key = (round(float(u.block_position[0]), 6), round(float(u.target_position[0]), 6))
        route = routes.setdefault(key, choose_route(u, np.random.default_rng(0)))
        td["action"] = torch.from_numpy(expert_action(u, route) / 0.25)[None]
        return td

    td = env.rollout(100, policy, break_when_any_done=False)
    term = td["next", "terminated"].squeeze(-1)[0]
    assert term.any()
    end = int(term.nonzero()[0])
    assert td["next", "success"][0, end].item()
    ret = td["next", "reward"][0, : end + 1].sum().item()
    assert td["next", "episode_return"][0, end].item() == pytest.approx(ret, rel=1e-5)
    assert td["episode_return"][0, end + 1].item() == 0.0  # the next episode starts at 0
    env.close()

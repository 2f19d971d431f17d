"""PointReach-v0: hand-computed dynamics, the TorchRL env (partial resets, chunks, specs), the gym env
(agreement with the torch core, env-state round trip), mode statistics and the scripted expert."""

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

import envs  # noqa: F401  (registers PointReach-v0)
from envs import point_reach as pr
from rlfunc.envs import collect
from rlfunc.errors import ConfigError, EnvError, ShapeError


def hand_state(starts, thetas):
    """A fresh state with chosen starts [N, 2] and axis angles [N] (goals start +- D u(theta))."""
    start = torch.tensor(starts, dtype=torch.float32)
    theta = torch.tensor(thetas, dtype=torch.float32)
    axis = torch.stack([torch.cos(theta), torch.sin(theta)], -1) * pr.GOAL_DISTANCE
    state = pr.reset_state(len(starts), torch.Generator().manual_seed(0))
    state["start"] = start
    state["position"] = start.clone()
    state["goals"] = torch.stack([start + axis, start - axis], 1)
    return state


def run(state, actions):
    """Step the core with a list of [N, 2] actions; returns the final state and stacked outputs."""
    outs = []
    for a in actions:
        state, *out = pr.step_state(state, a)
        outs.append(out)
    return state, [torch.stack(x) for x in zip(*outs)]  # reward, terminated, truncated, goal_index: [T, N, 1]


def test_dynamics_by_hand():
    # start (0, 0), goals (1, 0) and (-1, 0); 0.95 m/s along x: 0.095 m a step, within 0.1 m of g_a
    # after 10 steps (0.95, dist 0.05), not after 9 (0.855, dist 0.145)
    state = hand_state([[0.0, 0.0]], [0.0])
    act = torch.tensor([[0.95, 0.0]])
    state, (reward, term, trunc, goal) = run(state, [act] * 10)
    assert term[:9].sum() == 0 and term[9].all() and not trunc.any()
    assert goal[:9].eq(-1).all() and goal[9].item() == 0
    torch.testing.assert_close(reward[:9, 0, 0], torch.full((9,), 0.095 - 0.01), atol=1e-6, rtol=0)
    # telescoping progress 1.0 - 0.05, the bonus, ten step penalties
    torch.testing.assert_close(reward.sum(), torch.tensor(0.95 + 1.0 - 0.1), atol=1e-5, rtol=0)
    torch.testing.assert_close(state["position"], torch.tensor([[0.95, 0.0]]), atol=1e-6, rtol=0)
    assert state["step_count"].item() == 10
    obs = pr.observation(state)
    torch.testing.assert_close(obs, torch.tensor([[0.95, 0.0, 0.05, 0.0, -1.95, 0.0]]), atol=1e-6, rtol=0)
    # actions are clipped to [-1, 1]: 5 m/s is 1 m/s
    s1, r1, *_ = pr.step_state(hand_state([[0.0, 0.0]], [0.0]), torch.tensor([[5.0, -7.0]]))
    s2, r2, *_ = pr.step_state(hand_state([[0.0, 0.0]], [0.0]), torch.tensor([[1.0, -1.0]]))
    assert torch.equal(s1["position"], s2["position"]) and torch.equal(r1, r2)


def test_symmetry_mirror_actions_reach_the_other_goal():
    thetas = [0.0, 0.3, 2.0, 4.5]
    starts = [[0.0, 0.0], [0.5, -0.2], [-0.9, 0.9], [0.1, 0.7]]
    u = torch.tensor([[math.cos(t), math.sin(t)] for t in thetas], dtype=torch.float32)
    _, (ra, ta, _, ga) = run(hand_state(starts, thetas), [0.95 * u] * 10)
    _, (rb, tb, _, gb) = run(hand_state(starts, thetas), [-0.95 * u] * 10)
    assert torch.equal(ta, tb) and ta[9].all() and not ta[:9].any()
    assert ga[9].eq(0).all() and gb[9].eq(1).all()
    torch.testing.assert_close(ra, rb, atol=1e-5, rtol=0)
    # on the x axis the mirror is exact in float32
    assert torch.equal(ra[:, 0], rb[:, 0])


def test_terminated_envs_are_absorbing():
    state = hand_state([[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0])
    state, _ = run(state, [torch.tensor([[0.95, 0.0], [0.0, 0.3]])] * 10)  # env 0 reaches g_a at step 10
    assert state["terminated"].squeeze(-1).tolist() == [True, False]
    before = state.clone()
    state, reward, term, trunc, goal = pr.step_state(state, torch.tensor([[-1.0, 1.0], [0.0, 0.3]]))
    assert torch.equal(state["position"][0], before["position"][0])
    assert state["step_count"][0].item() == before["step_count"][0].item() == 10
    assert reward[0].item() == 0.0 and term[0].item() and goal[0].item() == 0 and not trunc[0].item()
    assert not torch.equal(state["position"][1], before["position"][1]) and reward[1].item() != 0.0


def test_truncation_after_max_steps():
    state = hand_state([[0.0, 0.0]], [0.0])
    state, (reward, term, trunc, goal) = run(state, [torch.zeros(1, 2)] * (pr.MAX_STEPS + 2))
    assert not trunc[: pr.MAX_STEPS - 1].any() and trunc[pr.MAX_STEPS - 1:].all() and not term.any()
    assert state["step_count"].item() == pr.MAX_STEPS
    torch.testing.assert_close(reward[: pr.MAX_STEPS, 0, 0], torch.full((pr.MAX_STEPS,), -0.01))
    assert reward[pr.MAX_STEPS:].eq(0).all() and goal.eq(-1).all()


def test_partial_reset_mask_resets_only_those_envs():
    env = pr.PointReachEnv(4, seed=1)
    td = env.reset()
    for _ in range(3):
        td = env.step(td.set("action", torch.full((4, 2), 0.5)))["next"].exclude("reward")
    kept = env.state.clone()
    mask = torch.tensor([[True], [False], [True], [False]])
    out = env.reset(td.clone().set("_reset", mask))
    now = env.state
    for i in (1, 3):
        assert torch.equal(now[i]["position"], kept[i]["position"]) and now[i]["step_count"].item() == 3
        assert torch.equal(out["observation"][i], td["observation"][i])
    for i in (0, 2):
        assert now[i]["step_count"].item() == 0 and torch.equal(now[i]["position"], now[i]["start"])
        assert not torch.equal(now[i]["goals"], kept[i]["goals"])
    assert not out["done"].any() and out["goal_index"].eq(-1).all()


def test_chunk_equals_single_steps_and_stops_at_the_episode_end():
    n, k = 32, 4
    env = pr.PointReachEnv(n, act_steps=k, seed=2)
    env.reset()
    state = env.state.clone()
    g = torch.Generator().manual_seed(0)
    for _ in range(9):  # past ceil(30 / 4) = 8 chunks: every env ends, ended envs absorb
        chunk = torch.rand(n, k, 2, generator=g) * 2 - 1
        out = env.step(TensorDict({"action": chunk}, batch_size=[n]))["next"]
        total = torch.zeros(n, 1)
        for j in range(k):
            state, r, *_ = pr.step_state(state, chunk[:, j])
            total += r
        assert torch.equal(out["observation"], pr.observation(state))
        torch.testing.assert_close(out["reward"], total, atol=1e-6, rtol=0)
        assert torch.equal(out["terminated"], state["terminated"]) and torch.equal(out["truncated"], state["truncated"])
    assert out["done"].all() and env.state["step_count"].max() <= pr.MAX_STEPS
    # by hand: 0.25 m from g_a, full speed: success on the 2nd sub-step, the 3rd and 4th do nothing
    env = pr.PointReachEnv(1, act_steps=k, seed=0)
    state = hand_state([[0.0, 0.0]], [0.0])
    state["position"] = torch.tensor([[0.75, 0.0]])
    env._state = state
    out = env.step(TensorDict({"action": torch.tensor([[[1.0, 0.0]] * k])}, batch_size=[1]))["next"]
    torch.testing.assert_close(env.state["position"], torch.tensor([[0.95, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(out["reward"], torch.tensor([[0.2 + 1.0 - 0.02]]), atol=1e-5, rtol=0)
    assert out["terminated"].item() and out["success"].item() and out["goal_index"].item() == 0
    assert env.state["step_count"].item() == 2


def test_chunk_episode_is_at_most_ceil_max_steps_over_act_steps():
    env = pr.PointReachEnv(3, act_steps=4, seed=0)
    td = env.reset()
    for t in range(math.ceil(pr.MAX_STEPS / 4)):
        td = env.step(td.set("action", torch.zeros(3, 4, 2)))["next"].exclude("reward")
        assert td["truncated"].all() == (t == 7)
    assert env.state["step_count"].eq(pr.MAX_STEPS).all()


@pytest.mark.parametrize("act_steps", [1, 4])
def test_check_env_specs(act_steps):
    from torchrl.envs.utils import check_env_specs

    env = pr.PointReachEnv(5, act_steps=act_steps, seed=0)
    check_env_specs(env)
    shape = (5, 2) if act_steps == 1 else (5, act_steps, 2)
    assert env.action_spec.shape == shape
    assert env.observation_spec["observation"].shape == (5, 6)
    assert env.full_done_spec["done"].shape == (5, 1) and env.reward_spec.shape == (5, 1)


@pytest.mark.parametrize("act_steps", [1, 3])
def test_rollout_with_auto_reset(act_steps):
    n, t = 16, 100
    env = pr.PointReachEnv(n, act_steps=act_steps, seed=3)
    td = env.rollout(t, break_when_any_done=False)  # random policy from the action spec
    assert td.batch_size == (n, t)
    assert td["action"].shape == ((n, t, 2) if act_steps == 1 else (n, t, act_steps, 2))
    nxt = td["next"]
    assert nxt["observation"].shape == (n, t, 6) and nxt["reward"].shape == (n, t, 1)
    assert nxt["goal_index"].dtype == torch.int64 and nxt["success"].dtype == torch.bool
    assert torch.equal(nxt["done"], nxt["terminated"] | nxt["truncated"])
    assert torch.equal(nxt["success"], nxt["goal_index"] >= 0) and torch.equal(nxt["terminated"], nxt["success"])
    done = nxt["done"][..., 0]
    assert done.any()
    # after an end the next step starts a fresh episode (position at the goals' midpoint), otherwise continuity
    after = td["observation"][:, 1:][done[:, :-1]]
    assert torch.allclose(after[:, 2:4] + after[:, 4:6], torch.zeros(()), atol=1e-5)
    assert torch.equal(td["observation"][:, 1:][~done[:, :-1]], nxt["observation"][:, :-1][~done[:, :-1]])
    # no episode is longer than the time limit
    longest = math.ceil(pr.MAX_STEPS / act_steps)
    for row in done:
        ends = torch.nonzero(row).flatten().tolist()
        lengths = np.diff([-1] + ends)
        assert (lengths <= longest).all()
        assert t - 1 - (ends[-1] if ends else -1) <= longest


def test_torchrl_collector_auto_resets():
    from torchrl.collectors import Collector

    env = pr.PointReachEnv(8, seed=0)
    batch = next(iter(Collector(env, None, frames_per_batch=8 * 70, total_frames=8 * 70)))
    assert batch["next", "done"].sum() >= 16  # every env truncates by steps 30 and 60
    stats = pr.rollout_mode_statistics(batch)
    assert stats["num_episodes"].item() == batch["next", "done"].sum().item()


def test_reproducible_from_seed():
    def roll(seed):
        env = pr.PointReachEnv(8, seed=seed)
        g = torch.Generator().manual_seed(5)

        def policy(td):
            return td.set("action", torch.rand(8, 2, generator=g) * 2 - 1)

        return env.rollout(80, policy, break_when_any_done=False)

    a, b, c = roll(11), roll(11), roll(12)
    assert (a == b).all()
    assert not torch.equal(a["observation"], c["observation"])
    env = pr.PointReachEnv(8, seed=11)
    env.set_seed(11)
    first = env.reset()["observation"]
    env.set_seed(11)
    assert torch.equal(env.reset()["observation"], first) and torch.equal(first, a["observation"][:, 0])


def test_mode_statistics_by_hand():
    goal_index = torch.tensor([[0, -1, 1, 0], [-1, -1, 1, 1]])
    done = torch.tensor([[True, False, True, False], [True, True, False, True]])
    stats = pr.mode_statistics(goal_index, done)
    assert stats["num_episodes"] == 5
    assert stats["share_goal_a"] == pytest.approx(0.2) and stats["share_goal_b"] == pytest.approx(0.4)
    assert stats["share_neither"] == pytest.approx(0.4) and stats["success_rate"] == pytest.approx(0.6)
    assert stats["share_goal_a"] + stats["share_goal_b"] + stats["share_neither"] == pytest.approx(1.0)
    td = TensorDict({"next": {"goal_index": goal_index.unsqueeze(-1), "done": done.unsqueeze(-1)}}, batch_size=[2, 4])
    on_device = pr.rollout_mode_statistics(td)
    assert {k: float(v) for k, v in on_device.items()} == pytest.approx(stats)
    none = pr.mode_statistics(goal_index, torch.zeros_like(done))
    assert none["num_episodes"] == 0 and math.isnan(none["success_rate"])
    with pytest.raises(ShapeError, match="shape"):
        pr.mode_statistics(goal_index, done[:, :3])
    with pytest.raises(ShapeError, match="dtype"):
        pr.mode_statistics(goal_index, done.float())


def test_expert_succeeds_on_both_goals_about_half_each():
    n = 400
    g = torch.Generator().manual_seed(0)
    state = pr.reset_state(n, g)
    choice = torch.randint(0, 2, (n,), generator=g)
    for _ in range(pr.MAX_STEPS):
        act = pr.expert_action(pr.observation(state), choice, noise=torch.randn(n, 2, generator=g), noise_std=0.1)
        assert act.abs().max() <= 1.0
        state, *_ = pr.step_state(state, act)
    stats = pr.mode_statistics(state["goal_index"], state["terminated"] | state["truncated"])
    assert stats["num_episodes"] == n and stats["success_rate"] >= 0.99
    assert 0.4 <= stats["share_goal_a"] <= 0.6 and 0.4 <= stats["share_goal_b"] <= 0.6
    assert torch.equal(state["goal_index"].squeeze(-1)[state["terminated"].squeeze(-1)], choice[state["terminated"].squeeze(-1)])
    # noiseless: 10 steps of 0.1 m, the last one exactly onto the goal (no overshoot)
    state = hand_state([[0.0, 0.0]], [0.0])
    for _ in range(10):
        act = pr.expert_action(pr.observation(state), torch.tensor([1]), noise_std=0.1)
        state, _, term, *_ = pr.step_state(state, act)
        if term.item():
            break
    assert term.item() and state["goal_index"].item() == 1
    obs = torch.tensor([[0.0, 0.0, 0.04, 0.03, -0.04, -0.03]])  # 0.05 m from g_a: half a step
    torch.testing.assert_close(pr.expert_action(obs, torch.tensor([0])), torch.tensor([[0.4, 0.3]]))


def test_demonstrations_are_bimodal_with_padded_chunks():
    g = torch.Generator().manual_seed(1)
    horizon = 16  # longer than an expert episode (~10 steps): every chunk's tail is padding
    demo = pr.collect_demonstrations(400, horizon, generator=g)
    m = demo.batch_size[0]
    assert demo["observation"].shape == (m, 6) and demo["action"].shape == (m, horizon, 2)
    assert demo["goal_choice"].dtype == demo["episode"].dtype == torch.int64
    assert torch.equal(demo["episode"].unique(), torch.arange(400))
    per_episode = demo["goal_choice"][torch.unique_consecutive(demo["episode"], return_counts=True)[1].cumsum(0) - 1]
    assert 0.4 <= per_episode.float().mean() <= 0.6
    for e in (0, 1, 57, 399):
        rows = (demo["episode"] == e).nonzero().flatten()
        assert torch.equal(rows, torch.arange(rows[0], rows[0] + len(rows)))  # contiguous, in step order
        executed = demo["action"][rows, 0]  # the action taken at each step
        length = len(rows)
        assert 9 <= length <= pr.MAX_STEPS
        for t in range(length):
            idx = torch.clamp(torch.arange(t, t + horizon), max=length - 1)
            assert torch.equal(demo["action"][rows[t]], executed[idx])
        # replaying the executed actions from the first observation reaches the chosen goal
        obs0 = demo["observation"][rows[0]]
        state = hand_state([obs0[:2].tolist()], [0.0])
        state["goals"] = torch.stack([obs0[:2] + obs0[2:4], obs0[:2] + obs0[4:6]]).unsqueeze(0)
        state, (_, term, _, goal) = run(state, executed.unsqueeze(1))
        assert term[-1].item() and goal[-1].item() == demo["goal_choice"][rows[0]].item()
        assert demo["success"][rows].all()  # the per-episode flag the demos' summary counts
    # fair coins and noise come from the generator only
    again = pr.collect_demonstrations(400, horizon, generator=torch.Generator().manual_seed(1))
    assert (again == demo).all()


def _gym_to_state(envs_):
    s = torch.from_numpy(np.stack([e.state for e in envs_]))
    state = pr.reset_state(len(envs_), torch.Generator().manual_seed(0))
    state["position"], state["goals"], state["start"] = s[:, 0:2].clone(), s[:, 2:6].reshape(-1, 2, 2), s[:, 6:8].clone()
    return state


def test_gym_and_torch_agree():
    n = 64
    gyms = [pr.PointReachGymEnv() for _ in range(n)]
    first = np.stack([e.reset(seed=i)[0] for i, e in enumerate(gyms)])
    state = _gym_to_state(gyms)
    assert np.array_equal(pr.observation(state).numpy(), first)
    g = torch.Generator().manual_seed(0)
    choice = torch.randint(0, 2, (n,), generator=g)
    live = np.ones(n, bool)
    ends = 0
    for _ in range(pr.MAX_STEPS):
        # the noisy expert mixes progress, successes on both goals and failures
        act = pr.expert_action(pr.observation(state), choice, noise=torch.randn(n, 2, generator=g), noise_std=0.8)
        act[48:] = torch.rand(n - 48, 2, generator=g) * 3 - 1.5  # random walkers mostly fail
        act = act * 1.2  # some beyond the bounds: both clip
        state, reward, term, trunc, goal = pr.step_state(state, act)
        obs = pr.observation(state)
        for i in np.flatnonzero(live):
            o, r, te, tr, info = gyms[i].step(act[i].numpy())
            assert np.array_equal(o, obs[i].numpy())
            assert te == term[i].item() and not tr
            assert r == pytest.approx(reward[i].item(), abs=1e-6, rel=0)  # sqrt: last-bit rounding
            assert info["goal_index"] == goal[i].item() and info["success"] == te and info["is_success"] == te
            if te:
                live[i] = False
                ends += 1
    assert 0 < ends < n


def test_gym_registration_and_time_limit():
    assert gym.spec("PointReach-v0").max_episode_steps == pr.MAX_STEPS
    env = gym.make("PointReach-v0")
    obs, info = env.reset(seed=0)
    assert obs.dtype == np.float32 and obs.shape == (6,) and info == {"success": False, "is_success": False, "goal_index": -1}
    for t in range(pr.MAX_STEPS):
        obs, reward, term, trunc, info = env.step(np.zeros(2, np.float32))
        assert trunc == (t == pr.MAX_STEPS - 1) and not term
        assert reward == pytest.approx(-pr.STEP_PENALTY)


def test_gymnasium_check_env():
    from gymnasium.utils.env_checker import check_env

    check_env(gym.make("PointReach-v0").unwrapped, skip_render_check=True)
    u = gym.make("PointReach-v0").unwrapped
    u.reset(seed=0)
    assert isinstance(u.state, np.ndarray) and u.state.dtype == np.float32 and u.state.shape == (8,)


def test_env_state_round_trip():
    a = collect.make_vec_env("PointReach-v0", 2)
    b = collect.make_vec_env("PointReach-v0", 2)
    collect.reset(a, [5, 6])
    rng = np.random.default_rng(0)
    actions = [rng.uniform(-1, 1, size=(2, 2)).astype(np.float32) for _ in range(80)]
    for act in actions[:15]:
        a.step(act)
    state = collect.env_state(a)
    assert state is not None and all(s["elapsed_steps"] == 15 for s in state)
    collect.reset(b, [100, 200])
    collect.set_env_state(b, state)
    ended = 0
    for act in actions[15:]:  # crosses the time limit at step 30: the new episodes come from the restored RNG
        oa, ra, ta, tra, _ = a.step(act)
        ob, rb, tb, trb, _ = b.step(act)
        np.testing.assert_array_equal(oa, ob)
        np.testing.assert_array_equal(ra, rb)
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(tra, trb)
        ended += int((ta | tra).sum())
    assert ended >= 2


def test_bad_arguments():
    with pytest.raises(EnvError, match="num_envs=0"):
        pr.PointReachEnv(0)
    with pytest.raises(EnvError, match="act_steps=0"):
        pr.PointReachEnv(2, act_steps=0)
    with pytest.raises(EnvError, match="num_envs=2.5"):
        pr.PointReachEnv(2.5)
    with pytest.raises(EnvError, match="num_envs=-1"):
        pr.reset_state(-1, torch.Generator())
    with pytest.raises(ShapeError, match=r"action shape \(3, 3\)"):
        pr.step_state(pr.reset_state(3, torch.Generator()), torch.zeros(3, 3))
    with pytest.raises(ConfigError, match="horizon=0"):
        pr.collect_demonstrations(4, 0, generator=torch.Generator())
    with pytest.raises(ConfigError, match="num_episodes=0"):
        pr.collect_demonstrations(0, 4, generator=torch.Generator())
    with pytest.raises(ConfigError, match="noise_std=-1"):
        pr.expert_action(torch.zeros(2, 6), torch.zeros(2, dtype=torch.int64), noise_std=-1)
    with pytest.raises(ShapeError, match="goal_choice"):
        pr.expert_action(torch.zeros(2, 6), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(EnvError, match="render_mode"):
        gym.make("PointReach-v0", render_mode="human")


def test_a_split_env_steps_the_rows_of_the_single_env_through_partial_resets():
    """The 2 ranks' envs of a data-parallel run (split=(r, 2), 3 envs each) step the single process's
    6 envs, through resets where an env of only one rank reached its goal: told that an env of some
    rank is done (any_done_of_split), a rank with none done draws the reset too."""

    def policy(td):  # toward goal a, at full speed where x > 0, half speed elsewhere: the envs end at different steps
        to_goal = td["observation"][:, 2:4]
        speed = torch.where(td["observation"][:, :1] > 0, 1.0, 0.5)
        return td.set("action", speed * to_goal / to_goal.norm(dim=-1, keepdim=True).clamp_min(1e-6))

    T = 40
    single = pr.PointReachEnv(6, seed=3).rollout(T, policy, break_when_any_done=False)
    any_done = single["next", "done"].any(0).reshape(T).tolist()  # after each step: an env of some rank is done
    parts = []
    for r in range(2):
        steps = iter(any_done)

        def everywhere(done_here, steps=steps):
            done = next(steps)
            assert done or not done_here
            return done

        parts.append(pr.PointReachEnv(3, seed=3, split=(r, 2), any_done_of_split=everywhere).rollout(T, policy, break_when_any_done=False))
    ranks_done = [p["next", "done"].any(0).reshape(T) for p in parts]
    assert bool((ranks_done[0] != ranks_done[1]).any())  # a step where one rank's env ended and the other's did not
    for key in ("observation", ("next", "reward"), ("next", "done"), ("next", "goal_index")):
        assert torch.equal(torch.cat([p[key] for p in parts]), single[key]), key
    with pytest.raises(EnvError, match="split"):
        pr.PointReachEnv(3, split=(2, 2))


def test_gym_env_reports_success_so_evaluations_give_a_success_rate():
    # `rlfunc train ppo|grpo --env PointReach-v0` reported no success rate: the gymnasium env put only
    # "success" in its info, and rlfunc's evaluations read gymnasium's "is_success".
    collect.reports_success.cache_clear()
    assert collect.reports_success("PointReach-v0")
    venv = collect.make_vec_env("PointReach-v0", 4)
    try:
        def to_goal_a(obs):  # the unit step towards goal a (obs[2:4] = goal a - position): every episode succeeds
            d = obs[:, 2:4]
            return d / d.norm(dim=-1, keepdim=True).clamp_min(1e-6), None

        returns, success = collect.episode_outcomes(venv, to_goal_a, [0, 1, 2, 3], device=torch.device("cpu"))
    finally:
        venv.close()
    assert success is not None and bool(success.all()) and returns.shape == (4,)


def test_point_reach_demonstrations_summary_has_the_success_rate():
    """New-user pass: rlfunc.envs.demos.expert_demonstrations documents {"success_rate", "num_episodes",
    "num_samples"}; PointReach-v0's summary had no success_rate (nor had a bc run's demos.json). It is the
    share of episodes that reached a goal: 1 for the clean expert, less where noise keeps some from it."""
    from rlfunc.envs.demos import expert_demonstrations

    data, summary = expert_demonstrations("PointReach-v0", 8, 4, seed=0, noise_std=0.0, device=torch.device("cpu"))
    assert summary == {"success_rate": 1.0, "num_episodes": 8, "num_samples": data.batch_size[0]}
    assert set(data.keys()) == {"observation", "action", "episode"}
    noisy = pr.collect_demonstrations(200, 4, generator=torch.Generator().manual_seed(3), noise_std=5.0)
    _, summary = expert_demonstrations("PointReach-v0", 200, 4, seed=3, noise_std=5.0, device=torch.device("cpu"))
    ends = torch.unique_consecutive(noisy["episode"], return_counts=True)[1].cumsum(0) - 1
    want = noisy["success"][ends].float().mean().item()
    assert 0.0 < want < 1.0 and summary["success_rate"] == pytest.approx(want)

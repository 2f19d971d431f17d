"""Warehouse-v0: conflict rules on hand-built grids (and against a plain loop), tasks and rewards, the
observation window, TorchRL specs, batched == one by one, the PettingZoo API, the scripted baselines."""

import numpy as np
import pytest
import torch
from pettingzoo.test import parallel_api_test
from tensordict import TensorDict
from torchrl.envs.utils import check_env_specs

from envs.warehouse import WarehouseConfig, WarehouseEnv, WarehouseParallelEnv, layout_from_ascii, make_layout
from envs.warehouse import core
from envs.warehouse.expert import expert_policy
from envs.warehouse.layout import generated_ascii
from envs.warehouse.metrics import evaluate, random_policy, rollout_metrics
from rlfunc.errors import ConfigError, EnvError, ShapeError

STAY, N, S, E, W = range(5)
OPEN = ("P....D", "......", "..#...")  # 3 x 6: stations (0, 0) pick, (0, 5) drop; a shelf at (2, 2)
SMALL = WarehouseConfig(n_agents=4, shelf_rows=1, shelf_cols=2, shelf_height=2, max_steps=20)


def hand_state(rows, positions, goals, carrying=None, num_envs=1):
    layout = layout_from_ascii(rows)
    a = len(positions)
    state = TensorDict(
        {
            "position": torch.tensor([positions] * num_envs, dtype=torch.int64),
            "goal": torch.tensor([goals] * num_envs, dtype=torch.int64),
            "carrying": torch.tensor([carrying or [False] * a] * num_envs),
            "task_count": torch.zeros(num_envs, a, dtype=torch.int64),
            "env_seed": torch.arange(num_envs, dtype=torch.int64) + 7,
            "step_count": torch.zeros(num_envs, 1, dtype=torch.int64),
            "truncated": torch.zeros(num_envs, 1, dtype=torch.bool),
        },
        batch_size=[num_envs],
    )
    return layout, state


def step(rows, positions, actions, goals=None, carrying=None, config=WarehouseConfig()):
    layout, state = hand_state(rows, positions, goals or [0] * len(positions), carrying)
    new, reward, counts, flags = core.step_state(layout, state, torch.tensor([actions]), config)
    return new["position"][0].tolist(), reward[0, :, 0].tolist(), {k: int(v) for k, v in counts.items()}, new


def test_vertex_conflict_blocks_both_movers_and_counts_them():
    pos, reward, counts, _ = step(OPEN, [[1, 1], [1, 3]], [E, W])  # both into (1, 2)
    assert pos == [[1, 1], [1, 3]]
    assert counts["vertex_conflicts"] == 2 and counts["swap_conflicts"] == 0 and counts["idle"] == 2
    assert reward == pytest.approx([-0.1, -0.1])
    # into the cell of an agent that stays: only the mover is blocked
    pos, reward, counts, _ = step(OPEN, [[1, 1], [1, 2]], [E, STAY])
    assert pos == [[1, 1], [1, 2]] and counts["vertex_conflicts"] == 1 and reward == pytest.approx([-0.1, 0.0])


def test_swap_conflict_blocks_both_and_chains_behind_are_blocked():
    pos, reward, counts, _ = step(OPEN, [[1, 1], [1, 2]], [E, W])
    assert pos == [[1, 1], [1, 2]] and counts["swap_conflicts"] == 2 and counts["vertex_conflicts"] == 0
    assert reward == pytest.approx([-0.1, -0.1])
    # an agent following the east-mover of a blocked swap is blocked too (a vertex conflict: the cell stays taken)
    pos, _, counts, _ = step(OPEN, [[1, 0], [1, 1], [1, 2]], [E, E, W])
    assert pos == [[1, 0], [1, 1], [1, 2]] and counts["swap_conflicts"] == 2 and counts["vertex_conflicts"] == 1


def test_chains_follow_and_rotate():
    # a train moving east into a free cell all moves (following is allowed)
    pos, reward, counts, _ = step(OPEN, [[1, 0], [1, 1], [1, 2]], [E, E, E])
    assert pos == [[1, 1], [1, 2], [1, 3]] and counts["vertex_conflicts"] == 0 and counts["idle"] == 0
    # the same train behind an agent that stays: the whole chain is blocked
    pos, _, counts, _ = step(OPEN, [[1, 0], [1, 1], [1, 2], [1, 3]], [E, E, E, STAY])
    assert pos == [[1, 0], [1, 1], [1, 2], [1, 3]] and counts["vertex_conflicts"] == 3 and counts["idle"] == 4
    # a 4-cycle rotates
    pos, _, counts, _ = step(OPEN, [[0, 1], [0, 2], [1, 2], [1, 1]], [E, S, W, N])
    assert pos == [[0, 2], [1, 2], [1, 1], [0, 1]] and counts["vertex_conflicts"] + counts["swap_conflicts"] == 0


def test_moves_into_shelves_or_off_the_grid_are_blocked():
    pos, reward, counts, _ = step(OPEN, [[1, 2], [0, 3], [2, 5]], [S, N, E])
    assert pos == [[1, 2], [0, 3], [2, 5]] and counts["obstacle_bumps"] == 3
    assert counts["vertex_conflicts"] == 0 and reward == [0.0, 0.0, 0.0]
    layout, state = hand_state(OPEN, [[1, 2], [0, 3], [2, 5]], [0, 0, 0])
    mask = core.action_mask(layout, state)[0]
    assert mask.tolist() == [[True, True, False, True, True], [True, False, True, True, True],
                             [True, True, False, False, True]]


def test_pick_then_delivery_with_rewards_and_new_tasks():
    config = WarehouseConfig(pick_reward=0.5)
    # agent 0 steps onto its pick station (0, 0); agent 1, carrying, onto its drop station (0, 5);
    # agent 2, not carrying, crosses the drop station (0, 5)... it is not its goal: nothing happens
    pos, reward, counts, new = step(OPEN, [[0, 1], [1, 5], [0, 4]], [W, N, STAY], goals=[0, 1, 1],
                                    carrying=[False, True, False], config=config)
    assert pos == [[0, 0], [0, 5], [0, 4]]
    assert reward == pytest.approx([0.5, 1.0, 0.0]) and counts["deliveries"] == 1
    assert new["carrying"][0].tolist() == [True, False, False]
    assert new["goal"][0].tolist() == [1, 0, 1]  # one pick (index 0) and one drop (index 1) station
    assert new["task_count"][0].tolist() == [1, 1, 0]


def test_task_draws_cover_the_stations_and_do_not_depend_on_the_batch():
    seeds = torch.arange(1000, dtype=torch.int64).unsqueeze(-1).expand(-1, 3)[:, 0]
    draws = core.task_draw(seeds, torch.zeros(1000, 3, dtype=torch.int64), 8)
    counts = torch.bincount(draws.flatten(), minlength=8)
    assert counts.min() > 3000 / 8 * 0.7 and draws.max() < 8
    one = core.task_draw(seeds[5:6], torch.zeros(1, 3, dtype=torch.int64), 8)
    assert torch.equal(one[0], draws[5])


def test_shaping_rewards_progress_toward_the_goal():
    config = WarehouseConfig(shaping_scale=0.01, conflict_penalty=0.0)
    _, reward, _, _ = step(OPEN, [[1, 3], [2, 4]], [N, S], goals=[1, 1], config=config)
    # agent 0 moves from distance 3 to 2 of the drop station (0, 5); agent 1 bumps (off the grid): 0
    assert reward == pytest.approx([0.01, 0.0])


def test_observation_window_on_a_hand_made_layout():
    rows = ("P.#", "...", "..D")
    layout, state = hand_state(rows, [[0, 1], [1, 1]], [1, 0], carrying=[True, False])
    obs = core.observation(layout, state, radius=1)
    assert obs.shape == (1, 2, core.obs_dim(1)) == (1, 2, 9 * 5 + 6)
    win = obs[0, :, :45].reshape(2, 3, 3, 5)
    # agent 0 at (0, 1): the row above is off the grid; a shelf at (0, 2); agent 1 below; pick at (0, 0)
    expected_obstacle = [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert win[0, ..., 0].tolist() == expected_obstacle
    assert win[0, ..., 1].tolist() == [[0, 0, 0], [0, 0, 0], [0, 1, 0]]
    assert win[0, ..., 2].tolist() == [[0, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert win[0, ..., 3].sum() == 0 and win[0, ..., 4].sum() == 0  # the drop station/goal (2, 2) is outside
    # agent 1 at (1, 1) sees everything: drop station and its goal... its goal is the pick (0, 0)
    assert win[1, ..., 0].tolist() == [[0, 0, 1], [0, 0, 0], [0, 0, 0]]
    assert win[1, ..., 1].tolist() == [[0, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert win[1, ..., 3].tolist() == [[0, 0, 0], [0, 0, 0], [0, 0, 1]]
    assert win[1, ..., 4].tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0]]
    # scalars: position / (2, 2), goal - position / (2, 2), BFS distance / (H + W), carrying
    torch.testing.assert_close(obs[0, 0, 45:], torch.tensor([0.0, 0.5, 1.0, 0.5, 3 / 6, 1.0]))
    torch.testing.assert_close(obs[0, 1, 45:], torch.tensor([0.5, 0.5, -0.5, -0.5, 2 / 6, 0.0]))


def reference_resolve(free, positions, actions):
    """Plain loop: block bumps, contested targets and swaps, then block movers into cells whose
    occupant does not leave until nothing changes."""
    h, w = free.shape
    target, moving = [], []
    for (r, c), act in zip(positions, actions):
        dr, dc = core.MOVES[act]
        ok = act != 0 and 0 <= r + dr < h and 0 <= c + dc < w and free[r + dr, c + dc]
        target.append((r + dr, c + dc) if ok else (r, c))
        moving.append(ok)
    a = len(positions)
    occupant = {tuple(p): i for i, p in enumerate(positions)}
    blocked = [False] * a
    swap = [False] * a
    for i in range(a):
        if moving[i] and sum(target[j] == target[i] for j in range(a)) > 1:
            blocked[i] = True
        j = occupant.get(target[i])
        if moving[i] and j is not None and j != i and moving[j] and target[j] == tuple(positions[i]):
            swap[i] = True
    primary = [b or s for b, s in zip(blocked, swap)]
    stays = [not moving[i] or primary[i] for i in range(a)]
    changed = True
    while changed:
        changed = False
        for i in range(a):
            j = occupant.get(target[i])
            if not stays[i] and j is not None and j != i and stays[j]:
                stays[i] = changed = True
    new = [tuple(positions[i]) if stays[i] else target[i] for i in range(a)]
    vertex = [moving[i] and stays[i] and not swap[i] for i in range(a)]
    return new, vertex, swap


def test_conflict_resolution_matches_a_plain_loop_on_dense_random_crowds():
    rows = ("P.....", "..#...", "......", ".#...D")
    layout = layout_from_ascii(rows)
    free = ~layout.obstacle.numpy()
    g = torch.Generator().manual_seed(0)
    n, a = 300, 14  # 14 agents on 22 free cells
    cells = torch.rand(n, layout.start_cells.shape[0] + 2, generator=g).argsort(-1)[:, :a]
    free_cells = torch.from_numpy(np.argwhere(free))
    position = free_cells[cells]
    action = torch.randint(0, 5, (n, a), generator=g)
    new, flags = core.resolve_moves(layout, position, action)
    for k in range(n):
        ref_new, ref_vertex, ref_swap = reference_resolve(free, position[k].tolist(), action[k].tolist())
        assert [tuple(p) for p in new[k].tolist()] == ref_new
        assert flags["vertex"][k].tolist() == ref_vertex and flags["swap"][k].tolist() == ref_swap
        assert len(set(ref_new)) == a
    assert flags["vertex"].sum() > 100 and flags["swap"].sum() > 10 and flags["moved"].sum() > 500


def test_specs_keys_truncation_and_partial_reset():
    env = WarehouseEnv(3, SMALL, seed=0)
    check_env_specs(env)
    td = env.rollout(SMALL.max_steps + 5, break_when_any_done=False)
    a, d = SMALL.n_agents, core.obs_dim(SMALL.obs_radius)
    assert td["agents", "observation"].shape == (3, 25, a, d)
    assert td["agents", "action"].shape == (3, 25, a) and td["agents", "action"].dtype == torch.int64
    assert td["next", "agents", "reward"].shape == (3, 25, a, 1)
    assert td["next", "done"].shape == (3, 25, 1) and not td["next", "terminated"].any()
    done = td["next", "truncated"][0, :, 0]
    assert done.nonzero().flatten().tolist() == [SMALL.max_steps - 1]
    assert torch.equal(td["next", "done"], td["next", "truncated"])
    # after the auto-reset the step count restarted
    assert env.state["step_count"][:, 0].tolist() == [5, 5, 5]
    # partial reset keeps the other envs
    kept = env.state.clone()
    env.reset(TensorDict({"_reset": torch.tensor([[True], [False], [False]])}, batch_size=[3]))
    assert torch.equal(env.state[1:]["position"], kept[1:]["position"])
    assert env.state["step_count"][:, 0].tolist() == [0, 5, 5]


def test_truncated_env_is_absorbing():
    layout, state = hand_state(OPEN, [[1, 1]], [1])
    state["truncated"][:] = True
    new, reward, counts, _ = core.step_state(layout, state, torch.tensor([[E]]), WarehouseConfig())
    assert new["position"].tolist() == [[[1, 1]]] and reward.sum() == 0 and counts["idle"].item() == 0


def test_batched_env_equals_single_envs_stepped_one_by_one():
    n, steps = 5, 40
    config = WarehouseConfig(shaping_scale=0.01)
    batched = WarehouseEnv(n, config, seed=3)
    td = batched.reset()
    singles = [WarehouseEnv(1, config, seed=99) for _ in range(n)]
    outs = [s.set_state(batched.state[k : k + 1].clone()) for k, s in enumerate(singles)]
    for k in range(n):
        assert torch.equal(outs[k]["agents", "observation"][0], td["agents", "observation"][k])
    g = torch.Generator().manual_seed(1)
    delivered, conflicts = 0, 0
    policy = expert_policy(batched)
    for t in range(steps):
        # mostly the expert (to make deliveries and new tasks happen), some random moves (conflicts)
        action = torch.where(torch.rand(n, config.n_agents, generator=g) < 0.8, policy(td),
                             torch.randint(0, 5, (n, config.n_agents), generator=g))
        out = batched.step(td.set(("agents", "action"), action))["next"]
        for k, s in enumerate(singles):
            one = s.step(outs[k].set(("agents", "action"), action[k : k + 1]))["next"]
            assert (one == out[k : k + 1]).all(), f"env {k} differs at step {t}"
            outs[k] = one
        delivered += int(out["deliveries"].sum())
        conflicts += out["vertex_conflicts"].sum() + out["swap_conflicts"].sum()
        td = out
    # the comparison covered new tasks (picks and deliveries draw the next station) and conflicts
    assert int(batched.state["task_count"].sum()) > 20 and delivered >= 1
    assert int(conflicts) > 10


def test_pettingzoo_api_and_agreement_with_the_torchrl_env():
    config = WarehouseConfig(n_agents=6, shelf_rows=2, shelf_cols=2, max_steps=30)
    parallel_api_test(WarehouseParallelEnv(config), num_cycles=40)
    pz = WarehouseParallelEnv(config)
    obs, infos = pz.reset(seed=4)
    env = WarehouseEnv(1, config, seed=4)
    td = env.reset()
    g = np.random.default_rng(0)
    for _ in range(config.max_steps):
        for i, agent in enumerate(pz.possible_agents):
            np.testing.assert_array_equal(obs[agent], td["agents", "observation"][0, i].numpy())
            np.testing.assert_array_equal(infos[agent]["action_mask"], td["agents", "action_mask"][0, i].numpy())
        action = g.integers(0, 5, size=config.n_agents)
        obs, rewards, terms, truncs, infos = pz.step(dict(zip(pz.possible_agents, action.tolist())))
        td = env.step(td.set(("agents", "action"), torch.from_numpy(action)[None]))["next"]
        assert [rewards[a] for a in pz.possible_agents] == pytest.approx(td["agents", "reward"][0, :, 0].tolist())
        assert all(t == bool(td["truncated"]) for t in truncs.values()) and not any(terms.values())
    assert pz.agents == [] and pz.state().shape == (*make_layout(config).shape, 4)
    with pytest.raises(EnvError, match="reset"):
        pz.step({})


def test_pettingzoo_step_refuses_keys_that_are_not_agents():
    """New-user pass: step({0: 1, 1: 1, ...}) (indices, not "agv_i" names) moved no agent and raised
    nothing. Now an EnvError names the keys; an agent left out still stays in place."""
    config = WarehouseConfig(n_agents=6, shelf_rows=2, shelf_cols=2, max_steps=30)
    pz = WarehouseParallelEnv(config)
    pz.reset(seed=0)
    before = pz.state_td["position"].clone()
    with pytest.raises(EnvError, match=r"action keys \[0, 1, 2\] \.\.\. are not agents; expected names such as 'agv_0'"):
        pz.step({i: 1 for i in range(6)})
    assert torch.equal(pz.state_td["position"], before)  # nothing stepped
    mask = pz._infos()["agv_0"]["action_mask"]
    moves = [a for a in range(1, 5) if mask[a]]
    pz.step({"agv_0": moves[0]})  # the others left out: they stay
    after = pz.state_td["position"]
    assert not torch.equal(after[0, 0], before[0, 0]) and torch.equal(after[0, 1:], before[0, 1:])


def test_scripted_baseline_delivers_without_conflicts_and_beats_random():
    config = WarehouseConfig(max_steps=150)
    expert = evaluate(expert_policy, config, seeds=(0, 1))
    rand = evaluate(lambda env: random_policy(env, masked=True), config, seeds=(0, 1))
    for row in expert["per_seed"]:
        assert row["conflicts_per_100_steps"] == 0 and row["obstacle_bumps_per_100_steps"] == 0
        assert row["deliveries_per_100_steps"] >= 20  # measured 28-33 over 150 steps
    assert rand["median"]["deliveries_per_100_steps"] <= 1 and rand["median"]["conflicts_per_100_steps"] > 50
    assert expert["median"]["idle_fraction"] < 0.5 * rand["median"]["idle_fraction"]
    # the protocol's summary over every warehouse (one per seed here): mean, std and interval of the two
    summary = expert["deliveries_per_100_steps"]
    rates = [r["deliveries_per_100_steps"] for r in expert["per_seed"]]
    assert summary["episodes"] == 2 and summary["mean"] == pytest.approx(sum(rates) / 2, rel=1e-6)
    assert summary["std"] == pytest.approx(abs(rates[0] - rates[1]) / 2, rel=1e-5, abs=1e-6)
    assert summary["ci95"][0] <= summary["mean"] <= summary["ci95"][1]


def test_windowed_cooperative_astar_baseline_has_no_conflicts():
    config = WarehouseConfig(max_steps=80)
    row = evaluate(lambda env: expert_policy(env, method="whca", window=12), config, seeds=(1,))["per_seed"][0]
    assert row["conflicts_per_100_steps"] == 0 and row["obstacle_bumps_per_100_steps"] == 0
    assert row["deliveries_per_100_steps"] >= 10
    with pytest.raises(ConfigError, match="method"):
        expert_policy(WarehouseEnv(1, SMALL), method="astar")


def test_rollout_metrics_by_hand():
    zeros = torch.zeros(2, 4, 1, dtype=torch.int64)
    td = TensorDict({"next": {k: zeros.clone() for k in core.STEP_KEYS}}, batch_size=[2, 4])
    td["next", "agents", "reward"] = torch.zeros(2, 4, 3, 1)
    td["next", "deliveries"][0, 1] = 2
    td["next", "swap_conflicts"][1, 3] = 2
    td["next", "vertex_conflicts"][1, 0] = 1
    td["next", "idle"][:] = 3
    m = rollout_metrics(td)
    assert m["env_steps"] == 8 and m["deliveries_per_100_steps"] == 25.0
    assert m["conflicts_per_100_steps"] == 37.5 and m["swap_conflicts_per_100_steps"] == 25.0
    assert m["idle_fraction"] == 1.0
    with pytest.raises(ShapeError, match="WarehouseEnv rollout"):
        rollout_metrics(td.exclude(("next", "idle")))


def test_layout_and_bad_input_errors():
    assert generated_ascii(WarehouseConfig())[1] == "P.##.##.##.##.##.D"
    layout = make_layout(WarehouseConfig())
    assert layout.shape == (16, 18) and layout.n_pick == 8 and layout.n_drop == 8
    assert int((~layout.obstacle).sum()) == 168 and layout.start_cells.shape == (152, 2)
    with pytest.raises(ConfigError, match="'P'"):
        layout_from_ascii(("....", "...D"))
    with pytest.raises(ConfigError, match="characters"):
        layout_from_ascii(("P.x.D",))
    with pytest.raises(ConfigError, match="cannot reach"):
        layout_from_ascii(("P#D",))
    with pytest.raises(ConfigError, match="n_agents=16"):
        make_layout(WarehouseConfig(n_agents=16, layout=OPEN))  # 15 free non-station cells
    with pytest.raises(ConfigError, match="obs_radius"):
        WarehouseEnv(1, WarehouseConfig(obs_radius=-1))
    with pytest.raises(EnvError, match="num_envs"):
        WarehouseEnv(0)
    env = WarehouseEnv(2, SMALL, seed=0)
    td = env.reset()
    with pytest.raises(ShapeError, match=r"expected \(2, 4\) integers"):
        core.step_state(env.layout, env.state, torch.zeros(2, 3, dtype=torch.int64), SMALL)
    with pytest.raises(ShapeError, match=r"expected \(2, 4\) integers"):
        core.step_state(env.layout, env.state, torch.zeros(2, 4), SMALL)
    with pytest.raises(ShapeError, match=r"\[0, 5\)"):
        env.step(td.set(("agents", "action"), torch.full((2, 4), 5, dtype=torch.int64)))


def test_the_parallel_env_refuses_an_action_that_is_not_an_index():
    """New-user pass: WarehouseParallelEnv.step({'agv_0': 1.7}) moved agv_0 by action 1 (truncated, where the
    TorchRL env refuses float actions), "x" was a bare ValueError naming no agent, and state() before reset()
    a TypeError."""
    import numpy as np

    from envs.warehouse.env import WarehouseParallelEnv
    from rlfunc.errors import EnvError

    env = WarehouseParallelEnv()
    with pytest.raises(EnvError, match=r"^state\(\) before reset\(\)"):
        env.state()
    env.reset(seed=0)
    for bad in (1.7, "x", 7, -1, True):
        with pytest.raises(EnvError, match=rf"^step\(\): action of 'agv_0' is .*: expected an integer in \[0, 5\)$"):
            env.step({"agv_0": bad})
    for good in (2, np.int64(3), np.array(1), torch.tensor(1)):  # (a torch policy's argmax too: review pass)
        env.step({"agv_0": good})

"""Shared-parameter multi-agent PPO / GRPO / GSPO (rlfunc.algos.mappo, rlfunc.run.mappo) and the rware adapter."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

from rlfunc.config import replace
from rlfunc.algos.mappo import MAPPOConfig, critic_input, make_mappo, ppo_agent_loss, sequence_advantage
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.run import train

SMALL_LAYOUT = (
    "P......D",
    "..#..#..",
    "P......D",
)


def test_permuting_agents_permutes_actions():
    algo = make_mappo(MAPPOConfig(critic="mean", hidden=(16,)), obs_dim=6, n_agents=4, n_actions=5, device=torch.device("cpu"))
    state = algo.init()
    obs = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0))
    perm = torch.tensor([2, 0, 3, 1])
    a, lp, v = algo.act(state, obs, None, None, greedy=True)
    ap, lpp, vp = algo.act(state, obs[:, perm], None, None, greedy=True)
    assert torch.equal(ap, a[:, perm])
    torch.testing.assert_close(lpp, lp[:, perm])
    torch.testing.assert_close(vp, v[:, perm])  # the mean critic is permutation-equivariant too
    # each agent's logits depend on its own observation only
    obs2 = obs.clone()
    obs2[:, 1] += 1.0
    a2, lp2, _ = algo.act(state, obs2, None, None, greedy=True)
    keep = torch.tensor([0, 2, 3])
    torch.testing.assert_close(lp2[:, keep], lp[:, keep])


def test_critic_input_shapes():
    obs = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)
    assert critic_input(obs, "local") is obs
    m = critic_input(obs, "mean")
    torch.testing.assert_close(m[0, 1], torch.cat([obs[0, 1], obs[0].mean(0)]))
    c = critic_input(obs, "concat")
    assert c.shape == (2, 3, 8)
    torch.testing.assert_close(c[1, 2], torch.cat([obs[1, 2], obs[1].flatten()]))


def test_ppo_loss_equals_hand_computation():
    config = MAPPOConfig(hidden=(4,), entropy_coef=0.1, value_coef=0.5, clip_epsilon=0.2)
    algo = make_mappo(config, obs_dim=3, n_agents=2, n_actions=3, device=torch.device("cpu"))
    params = algo.init()["params"]
    g = torch.Generator().manual_seed(1)
    m = 4
    mb = TensorDict({
        "observation": torch.randn(m, 3, generator=g), "action": torch.tensor([0, 2, 1, 2]),
        "action_mask": torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool),
        "sample_log_prob": torch.tensor([[-1.0], [-0.9], [-0.3], [-1.2]]),
        "advantage": torch.tensor([[1.0], [-2.0], [0.5], [3.0]]),
        "value_target": torch.tensor([[0.5], [0.0], [1.0], [-1.0]]),
    }, batch_size=[m])
    mb["critic_observation"] = mb["observation"]
    loss, _ = ppo_agent_loss(algo.nets, config, params, mb)
    # by hand, in double precision
    with torch.no_grad():
        a = params["actor"]
        x = mb["observation"].double()
        logits = torch.tanh(x @ a["0", "weight"].double().T + a["0", "bias"].double()) @ a["2", "weight"].double().T + a["2", "bias"].double()
        logits = logits.masked_fill(~mb["action_mask"], float("-inf"))
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, mb["action"][:, None])
        p = logp_all.exp()
        entropy = -(torch.where(p > 0, p * logp_all, torch.zeros_like(p))).sum(-1)
        c = params["critic"]
        v = torch.tanh(x @ c["0", "weight"].double().T + c["0", "bias"].double()) @ c["2", "weight"].double().T + c["2", "bias"].double()
        adv = mb["advantage"].double()
        adv = (adv - adv.mean()) / (adv.std(correction=0) + 1e-8)
        r = (logp - mb["sample_log_prob"].double()).exp()
        surrogate = torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv).mean()
        value = 0.5 * 0.5 * (v - mb["value_target"].double()).pow(2).mean()
        expected = -surrogate + value - 0.1 * entropy.mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_sequence_advantage_team_and_agent():
    # 1 group of G = 2 rollouts, T = 2 steps, A = 2 agents
    reward = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[0.0, 3.0], [0.0, 1.0]]]).unsqueeze(-1)  # [N=2, T, A, 1]
    team = sequence_advantage(MAPPOConfig(sequence_reward="team", advantage_std="none"), reward, 2)
    # team returns 1 and 4: centred -1.5, +1.5, shared by both agents of a rollout
    torch.testing.assert_close(team.view(2, 2), torch.tensor([[-1.5, -1.5], [1.5, 1.5]]))
    agent = sequence_advantage(MAPPOConfig(sequence_reward="agent", advantage_std="none"), reward, 2)
    # agent 0: 1 vs 0 -> +0.5 / -0.5; agent 1: 0 vs 4 -> -2 / +2
    torch.testing.assert_close(agent.view(2, 2), torch.tensor([[0.5, -2.0], [-0.5, 2.0]]))


def test_config_errors():
    with pytest.raises(ConfigError, match="loss"):
        MAPPOConfig(loss="a2c")
    with pytest.raises(ConfigError, match="group_size"):
        MAPPOConfig(loss="grpo", num_envs=10, group_size=4)
    with pytest.raises(ConfigError, match="critic"):
        MAPPOConfig(critic="global")
    # Regression (new-user pass): a nan clip range was found at the first update, after the run dir was written
    for name in ("clip_epsilon", "gspo_clip_epsilon", "gspo_clip_epsilon_high"):
        with pytest.raises(ConfigError, match=f"^{name}=nan"):
            MAPPOConfig(loss="gspo", **{name: float("nan")})


def _small(loss: str, **kw) -> MAPPOConfig:
    from envs.warehouse import WarehouseConfig  # noqa: F401  (skip cleanly if the env is missing)

    return replace(MAPPOConfig(), loss=loss, n_agents=2, **kw)


def test_training_improves_deliveries_on_a_small_warehouse(tmp_path, monkeypatch):
    """A few PPO iterations on a 3 x 8 warehouse with 2 AGVs deliver more than the random policy."""
    from envs import registry_entries
    from envs.warehouse import WarehouseConfig
    from envs.warehouse.metrics import evaluate, random_policy
    from rlfunc.run import mappo as tm

    torch.manual_seed(0)
    small = WarehouseConfig(n_agents=2, layout=SMALL_LAYOUT, obs_radius=1, max_steps=50, shaping_scale=0.1)

    def wh_config(config, *, train):
        return small if train else WarehouseConfig(n_agents=2, layout=SMALL_LAYOUT, obs_radius=1, max_steps=100)

    monkeypatch.setattr(registry_entries, "warehouse_config", wh_config)
    config = replace(MAPPOConfig(), loss="ppo", n_agents=2, num_envs=16, rollout_steps=25, total_steps=16 * 25 * 12,
                         hidden=(32,), lr=3e-3, num_epochs=4, entropy_coef=0.0, eval_episodes=16, eval_seeds=(5,),
                         device="cpu", critic="mean")
    result = train(config, tmp_path / "run", progress=False, tensorboard=False)
    learned = result.evaluation["median"]["deliveries_per_100_steps"]
    rand = evaluate(lambda env: random_policy(env, seed=0, masked=True), wh_config(config, train=False),
                    seeds=(5,), num_episodes=16)["median"]["deliveries_per_100_steps"]
    assert learned > rand + 5.0, (learned, rand)
    saved = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert saved["median"]["deliveries_per_100_steps"] == learned
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 12 and "deliveries_per_100_steps" in json.loads(lines[-1])
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_grouped_losses_run(tmp_path, monkeypatch, loss):
    from envs import registry_entries
    from envs.warehouse import WarehouseConfig
    from rlfunc.run import mappo as tm

    small = WarehouseConfig(n_agents=2, layout=SMALL_LAYOUT, obs_radius=1, max_steps=10)
    monkeypatch.setattr(registry_entries, "warehouse_config", lambda config, train: small)
    config = replace(MAPPOConfig(), loss=loss, n_agents=2, num_envs=8, group_size=4, episode_steps=10, total_steps=160,
                         hidden=(8,), eval_episodes=2, eval_seeds=(0,), device="cpu")
    result = train(config, tmp_path / "run", progress=False, tensorboard=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(abs(r["ratio_mean"] - 1) < 0.5 for r in rows)
    assert result.evaluation["median"]["env_steps"] == 10 * 2


def test_grouped_rollout_members_share_start_state():
    """grouped_reset copies the warehouse state (positions, goals, task seeds) within a group."""
    from envs.warehouse import WarehouseConfig, WarehouseEnv
    from rlfunc.envs.grouped import grouped_reset

    env = WarehouseEnv(6, WarehouseConfig(n_agents=3, layout=SMALL_LAYOUT, obs_radius=1), seed=0)
    td = grouped_reset(env, 3)
    obs = td["agents", "observation"].view(2, 3, 3, -1)
    assert torch.equal(obs[:, 0], obs[:, 1]) and torch.equal(obs[:, 0], obs[:, 2])
    assert not torch.equal(obs[0, 0], obs[1, 0])


def test_rware_adapter_steps():
    pytest.importorskip("rware")
    from envs.rware_env import RwareEnv

    env = RwareEnv("rware-tiny-2ag-v2", 2, seed=0)
    td = env.reset()
    assert td["agents", "observation"].shape == (2, 2, env.obs_dim)
    td.set(("agents", "action"), torch.tensor([[1, 2], [0, 4]]))
    stepped, nxt = env.step_and_maybe_reset(td)
    assert stepped["next", "agents", "reward"].shape == (2, 2, 1)
    assert stepped["next", "done"].shape == (2, 1) and not stepped["next", "terminated"].any()
    again = RwareEnv("rware-tiny-2ag-v2", 2, seed=0).reset()
    torch.testing.assert_close(again["agents", "observation"], td["agents", "observation"])
    with pytest.raises(Exception, match="action"):
        env.step(nxt.set(("agents", "action"), torch.full((2, 2), 7)))


def test_cli_train_mappo(tmp_path, capsys):
    from rlfunc.cli.commands import main

    run = tmp_path / "run"
    code = main(["train", "mappo", "--env", "Warehouse-v0", "--n-agents", "2", "--num-envs", "2", "--rollout-steps", "5",
                 "--total-steps", "10", "--eval-episodes", "1", "--eval-seeds", "0", "--hidden", "8", "--device", "cpu",
                 "--run-dir", str(run)])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["n_agents"] == 2 and out["median"]["env_steps"] == 200.0
    config = json.loads((run / "config.json").read_text())  # flags not given come from the Warehouse-v0 preset
    assert (config["conflict_penalty"], config["episode_steps"], config["lr"]) == (0.5, 100, 1e-3)
    assert main(["train", "mappo", "--loss", "grpo", "--num-envs", "10", "--run-dir", str(tmp_path / "x")]) == 2
    # resume with a larger budget: the run goes on from its snapshot (iteration 1 of 2, 10 env steps each)
    assert main(["resume", str(run), "--total-steps", "20"]) == 0
    capsys.readouterr()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [10, 20]


def test_rware_rng_state_round_trip():
    pytest.importorskip("rware")
    from envs.rware_env import RwareEnv
    from rlfunc.errors import EnvError

    env = RwareEnv("rware-tiny-2ag-v2", 2, seed=3)
    env.reset()
    state = env.rng_state()
    assert state == {"base_seed": 3, "resets": 2}
    first = env.reset()["agents", "observation"]
    other = RwareEnv("rware-tiny-2ag-v2", 2, seed=3)
    other.set_rng_state(state)  # the same next episodes as env's
    torch.testing.assert_close(other.reset()["agents", "observation"], first)
    with pytest.raises(EnvError, match="rng_state"):
        other.set_rng_state({"resets": 1})


def test_cli_eval_of_a_mappo_run_on_any_device_type(tmp_path, capsys):
    # `rlfunc eval` of a mappo run was refused ("snapshot algo='mappo': expected 'ppo'"), so a run trained
    # on a GPU could not be evaluated on a CPU machine at all: its resume, which evaluates, is refused there
    from rlfunc.cli.commands import main
    from rlfunc.run import checkpoint

    run = tmp_path / "run"
    assert main(["train", "mappo", "--env", "Warehouse-v0", "--n-agents", "2", "--num-envs", "2", "--rollout-steps", "5",
                 "--total-steps", "10", "--eval-episodes", "1", "--eval-seeds", "0", "--hidden", "8", "--device", "cpu",
                 "--run-dir", str(run)]) == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["eval", str(run), "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out) == trained  # the run's eval seeds and episodes: its eval.json
    snap = checkpoint.latest_snapshot(run)
    state, meta = checkpoint.load_snapshot(snap)
    state["rng"], state["env", "rng"] = torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)  # as CUDA's
    checkpoint.save_snapshot(snap, state, meta)
    assert main(["eval", str(run), "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out) == trained
    assert main(["eval", str(run), "--device", "cpu", "--episodes", "2", "--seed", "5"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["n_agents"] == 2 and other["median"]["env_steps"] == 400.0  # 2 warehouses x 200 steps, one seed
    assert main(["eval", str(run), "--episodes", "0"]) == 2 and "episodes=0" in capsys.readouterr().err
    assert main(["resume", str(run), "--total-steps", "20"]) == 2
    assert capsys.readouterr().err.strip().endswith("resume it with --device cuda or npu")


def test_a_budget_is_rounded_up_to_whole_iterations():
    # mappo rounded down (8192 steps of 800-step iterations gave 10 iterations, 8000 steps); every
    # other algorithm rounds up
    config = replace(MAPPOConfig(), loss="ppo", num_envs=8, rollout_steps=100, total_steps=8192)
    assert config.steps_per_iteration == 800 and config.num_iterations == 11
    assert replace(config, total_steps=8000).num_iterations == 10 and replace(config, total_steps=1).num_iterations == 1


def test_eval_episodes_are_capped_with_the_eval_seeds_counted():
    """Flags pass: `rlfunc train mappo --eval-episodes 5000` was accepted (the cap counted one seed), trained to
    the end, and its final evaluation of 5000 warehouses x 3 eval seeds was killed for memory (24 GB). Now the
    config refuses it as `rlfunc eval` does."""
    from rlfunc.algos.mappo import preset

    with pytest.raises(ConfigError, match=r"run.eval_episodes=5000 per seed, 3 seeds: expected at most 3333"):
        preset("Warehouse-v0", eval_episodes=5000)
    assert preset("Warehouse-v0", eval_episodes=3333).run.eval_episodes == 3333
    assert preset("Warehouse-v0", eval_episodes=5000, eval_seeds=(7,)).run.eval_episodes == 5000  # one seed: 5000 envs


def test_mappo_refuses_what_it_would_record_and_not_use():
    """New-user pass: --hidden 0 trained a bias-only policy that ignored its observation (exit 0) and
    --hidden 64 -3 was a 45-line torch traceback; on an rware id --n-agents, --episode-steps,
    --shaping-scale and --conflict-penalty were recorded and changed nothing (rware fixes its agents and
    episode length); 25 minibatches of 24 samples failed in ppo_loss after the first rollout."""
    from rlfunc.algos.mappo import preset
    from rlfunc.nets.mlp import MLP

    for bad in ((0,), (64, -3)):
        with pytest.raises(ConfigError, match=r"^hidden=.*: expected at least one layer width, each positive$"):
            MAPPOConfig(hidden=bad)
        with pytest.raises(ConfigError, match=r"^MLP: hidden=.*: expected positive int widths$"):
            MLP(4, 2, bad)
    for field, value in (("n_agents", 7), ("episode_steps", 3), ("shaping_scale", 5.0), ("conflict_penalty", 9.0)):
        with pytest.raises(ConfigError, match=rf"^{field}={value!r}: read only with an env that reads it"):
            preset("rware-tiny-2ag-v2", **{field: value})
        assert getattr(preset("Warehouse-v0", **{field: value}), field) == value  # Warehouse-v0 reads them
    config = MAPPOConfig(n_agents=3, num_envs=2, rollout_steps=4, num_minibatches=25)
    with pytest.raises(ConfigError, match=r"^num_minibatches=25: more than the 24 samples of an iteration"):
        make_mappo(config, 10, 3, 5, torch.device("cpu"))
    assert make_mappo(replace(config, num_minibatches=24), 10, 3, 5, torch.device("cpu")) is not None


def test_a_new_mappo_run_seeded_like_an_evaluation_warns(tmp_path, recwarn):
    """New-user pass: the training warehouses' generator is seeded with run.seed and each evaluation's with its
    eval seed, so `--seed 1000` (eval seeds 1000-1002) trained on the evaluation's task draws, silently."""
    config = replace(MAPPOConfig(), n_agents=3, num_envs=2, rollout_steps=4, episode_steps=12, hidden=(8,), total_steps=8,
                     eval_seeds=(1000,), eval_episodes=1, seed=1000, device="cpu")
    with pytest.warns(UserWarning, match=r"^run.seed=1000 is one of eval_seeds=\(1000,\): the training warehouses draw"):
        train(config, tmp_path / "r", progress=False, tensorboard=False, evaluate=False)
    recwarn.clear()
    train(replace(config, seed=1001), tmp_path / "ok", progress=False, tensorboard=False, evaluate=False)
    assert not [w for w in recwarn if "eval_seeds" in str(w.message)]


def test_an_env_fields_rule_is_per_field_and_grouped_rollouts_read_episode_steps(monkeypatch):
    """Review pass: an env entry declaring some of the env fields (multi_agent_fields=("n_agents",)) had all four
    refused, the declared one too; and episode_steps, the grouped losses' rollout length on any env, was refused
    with grpo on such an env."""
    from envs import registry_entries as entries
    from rlfunc.config import check_dependents
    from rlfunc.envs import registry

    registry.ensure_loaded()
    monkeypatch.setitem(registry._ENTRIES, "Toy-v0", registry.EnvEntry(
        multi_agent_env=entries.warehouse_env, multi_agent_eval=entries.warehouse_eval, settable_state=True,
        multi_agent_fields=("n_agents",)))
    base = MAPPOConfig(env="Toy-v0")
    check_dependents(MAPPOConfig(env="Toy-v0", n_agents=4), base)
    check_dependents(MAPPOConfig(env="Toy-v0", loss="grpo", episode_steps=50), base)
    for field, value in (("episode_steps", 50), ("shaping_scale", 1.0)):
        with pytest.raises(ConfigError, match=rf"^{field}={value!r}: read only with an env that reads it"):
            check_dependents(MAPPOConfig(env="Toy-v0", **{field: value}), base)


def test_a_non_finite_team_return_is_left_out_of_the_line(tmp_path, monkeypatch):
    # Regression (review pass): an episode whose team return was NaN made the line's episode_return NaN (ppo's line
    # leaves it out). The rollout's ended episodes are replaced by [NaN, 3.0, inf, 1.0].
    import json

    import rlfunc.run.mappo as run_mappo
    from rlfunc.cli.commands import main

    monkeypatch.setattr(run_mappo, "_episode_returns", lambda reward, done, running: ([float("nan"), 3.0, float("inf"), 1.0], running))
    run = tmp_path / "run"
    assert main(["train", "mappo", "--env", "Warehouse-v0", "--n-agents", "2", "--num-envs", "2", "--rollout-steps", "5",
                 "--total-steps", "10", "--eval-episodes", "1", "--eval-seeds", "0", "--hidden", "8", "--device", "cpu",
                 "--run-dir", str(run)]) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["episode_return"] for x in lines] == [2.0]


def test_a_new_run_of_one_agent_step_minibatches_is_refused(tmp_path, capsys):
    # Regression (review pass): --num-minibatches up to the iteration's agent-steps was allowed, and minibatches of
    # one agent-step normalise every advantage to 0: the policy never moved.
    from rlfunc.cli.commands import main

    flags = ["--env", "Warehouse-v0", "--n-agents", "2", "--num-envs", "2", "--rollout-steps", "5", "--total-steps", "10",
             "--eval-episodes", "1", "--eval-seeds", "0", "--hidden", "8", "--device", "cpu"]  # 20 agent-steps an iteration
    for k in (20, 11):
        assert main(["train", "mappo", *flags, "--num-minibatches", str(k), "--run-dir", str(tmp_path / f"r{k}")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"num_minibatches={k}: minibatches of one agent-step (an iteration has 20)" in err[0], err
        assert "use at most 10 minibatches" in err[0] and not (tmp_path / f"r{k}").exists()
    assert main(["train", "mappo", *flags, "--num-minibatches", "10", "--run-dir", str(tmp_path / "r10")]) == 0

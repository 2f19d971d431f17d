"""rlfunc.config: RunConfig's validation, replace's routing of run fields, and from_dict over the
nested layout and the flat one written before RunConfig (the state-layout-1 fixtures)."""

import dataclasses
import json
from pathlib import Path

import pytest

from rlfunc.algos import registry
from rlfunc.algos.bc import BCConfig
from rlfunc.algos.dppo import DPPOConfig
from rlfunc.algos.grpo import GRPOConfig
from rlfunc.algos.mappo import MAPPOConfig
from rlfunc.algos.ppo import PPOConfig, preset
from rlfunc.algos.ppo_encoder import PPOEncoderConfig
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig
from rlfunc.config import RUN_FIELDS, RunConfig, from_dict, replace
from rlfunc.errors import CheckpointError, ConfigError

DATA = Path(__file__).parent / "data"
CONFIGS = (PPOConfig, PPOEncoderConfig, BCConfig, DPPOConfig, TD3DiffusionConfig, GRPOConfig, MAPPOConfig)


def _flat(config) -> dict:
    """The JSON form of ``config`` in the layout written before RunConfig: run fields beside the others."""
    raw = json.loads(json.dumps(dataclasses.asdict(config)))
    return {**{k: v for k, v in raw.items() if k != "run"}, **raw["run"]}


@pytest.mark.parametrize("bad, field", [
    (dict(seed=-1), "run.seed=-1"), (dict(seed=2**31 - 1, num_seeds=2), "run.seed=2147483647"),
    (dict(num_seeds=0), "run.num_seeds=0"), (dict(torch_threads=-1), "run.torch_threads=-1"),
    (dict(vmap="map"), "run.vmap='map'"), (dict(precision="fp8"), "run.precision='fp8'"),
    (dict(checkpoint_every=-1), "run.checkpoint_every=-1"), (dict(keep_checkpoints=-2), "run.keep_checkpoints=-2"),
    (dict(version_every=True), "run.version_every=True"), (dict(version_keep_last=-1), "run.version_keep_last=-1"),
    (dict(version_keep_every=-1), "run.version_keep_every=-1"), (dict(log_every=0), "run.log_every=0"),
    (dict(eval_episodes=0), "run.eval_episodes=0"), (dict(device=""), "run.device=''"),
    (dict(env_workers=-1), "run.env_workers=-1"),
    (dict(eval_episodes=10_001), "run.eval_episodes=10001"),  # one env per episode at once: an OOM
    (dict(eval_episodes=5_001, num_seeds=2), "run.eval_episodes=5001 per seed, 2 seeds"),
])
def test_run_config_errors_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=f"^{field.replace('(', '[(]')}: expected"):
        RunConfig(**bad)
    assert RunConfig(seed=2**31 - 2, num_seeds=2).seeds == [2**31 - 2, 2**31 - 1]


def test_each_algorithm_keeps_its_run_defaults():
    assert PPOConfig().run == RunConfig(version_every=1, eval_episodes=100)
    assert BCConfig().run == RunConfig(log_every=100, checkpoint_every=1000, eval_episodes=500)
    assert DPPOConfig().run == TD3DiffusionConfig().run == RunConfig(eval_episodes=500)
    assert GRPOConfig().run == RunConfig()
    assert PPOEncoderConfig().run == RunConfig(torch_threads=0)
    assert MAPPOConfig().run == RunConfig(torch_threads=0, checkpoint_every=0, keep_checkpoints=2, eval_episodes=8)
    for cls in CONFIGS:  # each config holds only its hyperparameters
        assert not {f.name for f in dataclasses.fields(cls)} & set(RUN_FIELDS), cls


@pytest.mark.parametrize("cls, change, message", [
    (BCConfig, dict(num_seeds=2), "run.num_seeds=2: bc trains one seed per run"),
    (PPOConfig, dict(precision="bf16"), "run.precision='bf16': ppo has no mixed precision"),
    (MAPPOConfig, dict(vmap="loop"), "run.vmap='loop': mappo trains one seed per run"),
    (GRPOConfig, dict(log_every=5), "run.log_every=5: grpo logs every iteration"),
    (DPPOConfig, dict(num_seeds=3), "run.num_seeds=3: dppo trains one seed per run"),
    (PPOEncoderConfig, dict(vmap="vmap"), "run.vmap='vmap': ppo-encoder trains one seed per run"),
    (GRPOConfig, dict(env_workers=2), "run.env_workers=2: env='PointReach-v0' is a torch-batched env, stepped on the device; "
                                      "backend='gym' steps gymnasium envs, which can run in worker processes"),
])
def test_an_algorithm_refuses_a_run_field_it_cannot_honour(cls, change, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        cls(run=RunConfig(**change))
    with pytest.raises(ConfigError, match=f"^{message}$"):
        replace(cls(), **change)


def test_replace_names_a_value_of_the_wrong_kind():
    # the bug: replace(preset("Pendulum-v1"), lr="fast") was "TypeError: '>' not supported ..." from the config's check
    with pytest.raises(ConfigError, match="^lr='fast': expected a number$"):
        replace(preset("Pendulum-v1"), lr="fast")
    with pytest.raises(ConfigError, match="^seed='3': expected a number$"):
        replace(PPOConfig(), seed="3")
    with pytest.raises(ConfigError, match="^hidden='64': expected a tuple$"):
        replace(PPOConfig(), hidden="64")
    with pytest.raises(ConfigError, match="^anneal_lr=1: expected a bool$"):
        replace(PPOConfig(), anneal_lr=1)
    with pytest.raises(ConfigError, match="^device=0: expected a str$"):
        replace(PPOConfig(), device=0)
    assert replace(PPOConfig(), hidden=[32, 32], lr=1, total_steps=4096).hidden == (32, 32)  # a list, an int for a float: fine
    # the bug (new-user pass): hidden=(8.5,) failed inside torch's Linear, (8, "a") in a comparison
    from rlfunc.algos.sac import SACConfig

    for bad in ((8.5,), (8, "a"), (True, 8)):
        with pytest.raises(ConfigError, match=r"^hidden=.*: expected a tuple of ints$"):
            replace(SACConfig(), hidden=bad)
    import numpy as np

    assert replace(SACConfig(), hidden=(np.int64(16), 16)).hidden == (16, 16)
    # int fields take integers; fields that are not Optional refuse None (new-user pass: num_epochs=2.5 failed
    # inside the run, num_envs=2.0 in the env's constructor, gamma=None in a comparison)
    for field, bad in (("num_epochs", 2.5), ("num_envs", 2.0), ("minibatch_size", 256.0), ("seed", 1.5)):
        with pytest.raises(ConfigError, match=rf"^{field}={bad!r}: expected an integer$"):
            replace(preset("Pendulum-v1"), **{field: bad})
    with pytest.raises(ConfigError, match="^gamma=None: expected a number$"):
        replace(preset("Pendulum-v1"), gamma=None)
    assert replace(preset("Pendulum-v1"), num_epochs=np.int64(3), target_kl=None).num_epochs == 3


def test_replace_routes_run_fields_into_run():
    config = replace(PPOConfig(), seed=3, lr=1e-3, device="cpu")
    assert config.run == replace(PPOConfig().run, seed=3, device="cpu") and config.lr == 1e-3
    assert config.run.version_every == 1 and config.seeds == [3]  # ppo's other run defaults kept
    assert replace(config, run=RunConfig(), seed=5).run == RunConfig(seed=5)  # into the run given
    assert preset("Pendulum-v1", seed=4, num_seeds=2).seeds == [4, 5]  # presets take run fields
    with pytest.raises(ConfigError, match="^sed: not a field of PPOConfig nor of RunConfig$"):
        replace(PPOConfig(), sed=3)
    with pytest.raises(ConfigError, match="run.seed=-1"):
        replace(PPOConfig(), seed=-1)
    assert replace(RunConfig(), seed=1) == RunConfig(seed=1)  # any config dataclass: its own fields
    with pytest.raises(ConfigError, match="^lr: not a field of RunConfig$"):
        replace(RunConfig(), seed=1, lr=2)


@pytest.mark.parametrize("cls", CONFIGS)
def test_from_dict_reads_the_nested_and_the_flat_layout_alike(cls):
    config = replace(cls(), seed=7, device="cpu", checkpoint_every=3)
    nested = json.loads(json.dumps(dataclasses.asdict(config)))
    assert from_dict(cls, nested, "snap") == from_dict(cls, _flat(config), "snap") == config
    # a flat config without a run field added since keeps the algorithm's default of it
    old = {k: v for k, v in _flat(cls()).items() if k not in ("version_every", "eval_episodes")}
    assert from_dict(cls, old, "snap") == cls()


def test_from_dict_converts_lists_to_tuples_in_nested_configs():
    config = replace(DPPOConfig(), critic_hidden=(16, 8))
    config = dataclasses.replace(config, actor=dataclasses.replace(config.actor, hidden=(32, 32), down_dims=(8, 16)))
    raw = json.loads(json.dumps(dataclasses.asdict(config)))
    assert isinstance(raw["actor"]["hidden"], list)
    got = from_dict(DPPOConfig, raw, "snap")
    assert got == config and got.actor.hidden == (32, 32) and got.critic_hidden == (16, 8)
    assert from_dict(MAPPOConfig, _flat(MAPPOConfig()), "snap").eval_seeds == MAPPOConfig().eval_seeds


@pytest.mark.parametrize("raw, why", [
    ({"not_a_field": 1}, "'not_a_field' is not a field of PPOConfig"),
    ({"run": {"sed": 1}}, "'sed' is not a field of RunConfig"),
    ({"seed": 1, "run": {"seed": 2}}, "'seed' is given both flat and in 'run'"),
    ({"seed": -1}, "run.seed=-1"),
    ({"num_envs": 0}, "num_envs=0"),
    (None, "expected a dict"),
])
def test_from_dict_errors_name_the_path(raw, why):
    with pytest.raises(CheckpointError) as info:
        from_dict(PPOConfig, raw, "runs/x/checkpoints/step_1", algo="ppo")
    message = str(info.value)
    assert message.startswith("runs/x/checkpoints/step_1: meta.json holds no valid ppo config: not a valid PPOConfig")
    assert why in message


@pytest.mark.parametrize("fixture", sorted(p.name for p in DATA.glob("*_state_layout_1")))
def test_the_flat_configs_of_the_layout_1_fixtures_load(fixture):
    (snap,) = (DATA / fixture / "checkpoints").glob("step_*")
    meta = json.loads((snap / "meta.json").read_text())
    meta = meta.get("meta", meta)
    assert "run" not in meta["config"] and "seed" in meta["config"]  # written flat, before RunConfig
    config = registry.config_from_meta(meta, snap)
    assert config.run.seed == meta["config"]["seed"] and config.run.device == meta["config"]["device"]
    nested = json.loads(json.dumps({**meta, "config": dataclasses.asdict(config)}))
    assert registry.config_from_meta(nested, snap) == config


@pytest.mark.parametrize("cls, change, field", [
    (PPOConfig, dict(entropy_coef=float("nan")), "entropy_coef"),  # accepted before: every loss nan, every step skipped
    (PPOConfig, dict(value_coef=float("inf")), "value_coef"),
    (PPOConfig, dict(lr=float("inf")), "lr"),
    (PPOConfig, dict(hidden=()), "hidden"),  # `--hidden` with no value: an IndexError deep in the net before
    (PPOEncoderConfig, dict(entropy_coef=float("nan")), "entropy_coef"),
    (PPOEncoderConfig, dict(hidden=()), "hidden"),
    (MAPPOConfig, dict(value_coef=float("inf")), "value_coef"),
    (DPPOConfig, dict(value_coef=float("nan")), "value_coef"),
])
def test_non_finite_coefficients_and_empty_layers_are_refused_naming_the_field(cls, change, field):
    with pytest.raises(ConfigError, match=field):
        replace(cls(), **change)


def test_freeze_with_stacked_seeds_is_refused():
    """One freeze mask for all stacked seeds made seed 1 of a 2-seed run differ from seed 1 alone by 1.7e-2
    (4e-6 without freezing): the seeds were not the independent runs that --num-seeds promises."""
    with pytest.raises(ConfigError, match="num_seeds=2"):
        replace(PPOConfig(), freeze_threshold=0.05, num_seeds=2)
    assert replace(PPOConfig(), freeze_threshold=0.05).freeze_threshold == 0.05


def test_groups_of_one_an_empty_eval_seed_list_and_a_batch_beyond_the_replay_are_refused():
    """From a new-user pass: a group of one trains nothing (advantage 0) without a word; mappo's empty
    eval_seeds failed only after the whole training; a minibatch larger than the replay buffer."""
    from rlfunc.algos.sac import SACConfig

    with pytest.raises(ConfigError, match="group_size=1"):
        replace(GRPOConfig(), group_size=1, minibatch_size=16)
    with pytest.raises(ConfigError, match="group_size=1"):
        replace(MAPPOConfig(), loss="grpo", group_size=1)
    assert replace(MAPPOConfig(), loss="ppo", group_size=1).group_size == 1  # ppo has no groups
    with pytest.raises(ConfigError, match="eval_seeds"):
        replace(MAPPOConfig(), eval_seeds=())
    with pytest.raises(ConfigError, match="batch_size=64 > buffer_size=50"):
        replace(SACConfig(), buffer_size=50, batch_size=64)


def test_a_config_built_directly_is_checked_as_replace_checks_it():
    """New-user pass: PPOConfig(num_epochs=1.5) was built and failed deep inside the run (TypeError from
    range()), hidden=(8.5,) inside torch's Linear, lr="fast" in a comparison; replace refused each."""
    import numpy as np

    from rlfunc.algos.sac import SACConfig
    from rlfunc.algos.sac_diffusion import SACDiffusionConfig
    from rlfunc.algos.td3 import TD3Config

    for field, bad, why in (("num_epochs", 1.5, "an integer"), ("minibatch_size", 32.0, "an integer"),
                            ("total_steps", 128.5, "an integer"), ("hidden", (8.5,), "a tuple of ints"),
                            ("lr", "fast", "a number"), ("gamma", None, "a number"), ("run", None, "a RunConfig")):
        with pytest.raises(ConfigError, match=rf"^{field}={bad!r}: expected {why}$".replace("(", "[(]").replace(")", "[)]")):
            PPOConfig(**{field: bad})
    for cls in (*CONFIGS, SACConfig, TD3Config, SACDiffusionConfig):
        with pytest.raises(ConfigError, match=r"^run=\{\}: expected a RunConfig$"):
            cls(run={})
    with pytest.raises(ConfigError, match=r"^run.seed=1.5: expected an integer$"):
        RunConfig(seed=1.5)
    with pytest.raises(ConfigError, match=r"^batch_size=64.0: expected an integer$"):
        SACConfig(batch_size=64.0)
    config = PPOConfig(num_envs=np.int64(4), hidden=[32, np.int64(32)])  # converted: numpy ints, a list
    assert type(config.num_envs) is int and config.hidden == (32, 32) and type(config.hidden[1]) is int
    assert SACConfig(batch_size=np.int64(64)).batch_size == 64  # (noticed: SAC refused numpy ints)
    assert json.loads(json.dumps(dataclasses.asdict(config)))["num_envs"] == 4


def test_learning_rates_beyond_float32_or_infinite_are_refused_in_one_line():
    """New-user pass: sac/td3 took --critic-lr inf and exited 0 with NaN weights; lr=1e300 was torch's
    "value cannot be converted to type float without overflow" traceback in every algorithm;
    sac-diffusion trained with a minibatch larger than its replay, which sac refuses."""
    from rlfunc.algos.sac import SACConfig
    from rlfunc.algos.sac_diffusion import SACDiffusionConfig
    from rlfunc.algos.td3 import TD3Config

    for cls in (SACConfig, TD3Config):
        for name in ("actor_lr", "critic_lr"):
            with pytest.raises(ConfigError, match=rf"^{name}=inf: expected a finite number > 0$"):
                cls(**{name: float("inf")})
    for cls, name in ((SACConfig, "actor_lr"), (TD3Config, "actor_lr"), (SACDiffusionConfig, "critic_lr"), (PPOConfig, "lr"),
                      (BCConfig, "lr"), (GRPOConfig, "lr")):
        with pytest.raises(ConfigError, match=rf"^{name}=1e\+300: expected a number within float32's range"):
            cls(**{name: 1e300})
    with pytest.raises(ConfigError, match=r"^batch_size=16 > buffer_size=8: a minibatch larger than the replay$"):
        SACDiffusionConfig(buffer_size=8, batch_size=16)


def test_mappo_eval_seeds_below_zero_and_grpo_env_workers_that_divide_its_own_envs():
    """New-user pass: mappo took --eval-seeds -1, trained the whole budget, then failed in numpy at the
    final evaluation (and on every resume); grpo --env-workers 2 was refused for "num_envs=1" (its
    shared PPO actor's one env) unless 2 divided num_seeds."""
    with pytest.raises(ConfigError, match=r"^eval_seeds=\(-1,\): expected seeds in \[0, 2\*\*32\)$"):
        replace(MAPPOConfig(), eval_seeds=(-1,))
    config = replace(GRPOConfig(), env="Pendulum-v1", env_workers=2, num_groups=2, group_size=2, minibatch_size=2)
    assert config.run.env_workers == 2 and config.actor_config().run.env_workers == 0
    with pytest.raises(ConfigError, match=r"^run.env_workers=3: num_envs=4 \(num_groups=2 x group_size=2 x num_seeds=1\)"):
        replace(config, env_workers=3)


def test_an_initial_log_std_that_overflows_and_a_horizon_of_zero_are_named():
    """New-user pass: grpo --init-log-std 100 trained with every update skipped (e^100 overflows float32)
    and exited 0; sac-diffusion --actor.horizon 0 was named as act_steps."""
    from rlfunc.algos.diffusion_actor import ActorSpec

    for cls in (PPOConfig, PPOEncoderConfig, GRPOConfig):
        for bad in (100.0, -21.0):
            with pytest.raises(ConfigError, match=rf"^init_log_std={bad}: expected a number in \[-20, 20\]"):
                cls(init_log_std=bad)
    assert PPOConfig(init_log_std=-20.0).init_log_std == -20.0
    with pytest.raises(ConfigError, match=r"^horizon=0: expected a positive integer$"):
        ActorSpec(horizon=0, act_steps=1)


@pytest.mark.parametrize("argv, field", [
    (["ppo", "--env", "CartPole-v1", "--sde-sample-freq", "4"], "sde_sample_freq"),  # gSDE off (and no Box actions)
    (["ppo", "--env", "Pendulum-v1", "--priority-alpha", "0.9"], "priority_alpha"),
    (["ppo", "--env", "CartPole-v1", "--reward-clip", "3"], "reward_clip"),  # the preset normalises no reward
    (["ppo", "--env", "Pendulum-v1", "--hessian-interval", "3"], "hessian_interval"),
    (["ppo", "--env", "PushState-v0", "--no-normalize-rewards", "--reward-clip", "3"], "reward_clip"),  # ppo-encoder
    (["grpo", "--env", "Pendulum-v1", "--no-normalize-observations", "--obs-clip", "3"], "obs_clip"),
    (["sac", "--env", "Pendulum-v1", "--no-autotune", "--target-entropy", "-3"], "target_entropy"),
    (["sac-diffusion", "--no-autotune", "--alpha-lr", "0.1"], "alpha_lr"),
    (["mappo", "--loss", "grpo", "--critic", "mean"], "critic"),
    (["mappo", "--loss", "gspo", "--clip-epsilon", "0.3"], "clip_epsilon"),
    (["dppo", "--likelihood", "output-noise", "--eta", "0.5"], "eta"),  # the chain's settings (a review pass)
    (["dppo", "--likelihood", "output-noise", "--denoising-discount", "0.5"], "denoising_discount"),
    (["dppo", "--output-noise-std", "0.3"], "output_noise_std"),
])
def test_a_flag_whose_switch_is_off_is_refused(argv, field, tmp_path, capsys):
    """New-user pass: `rlfunc train ppo --env CartPole-v1 --sde-sample-freq 4` (no gSDE), `--reward-clip 3`
    without reward normalisation, `sac --no-autotune --target-entropy -3`, `mappo --loss grpo --critic mean`
    ... trained to the end as without the flag, which config.json recorded: one line, exit 2, no run dir."""
    from rlfunc.cli.commands import main

    run_dir = tmp_path / "r"
    assert main(["train", *argv, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rlfunc: error: {field}=") and "read only with" in err and len(err.splitlines()) == 1
    assert not run_dir.exists()


def test_a_presets_own_dependent_field_is_not_the_users():
    """What an env preset sets is not refused when the user turns its switch off (Pendulum's gSDE preset
    has sde_sample_freq 4: `--exploration gaussian` alone is fine), nor a field whose switch a shaping
    preset turns on; what the user sets with the switch off is refused by every algorithm's preset()."""
    from rlfunc.algos import grpo, mappo, ppo, sac

    assert ppo.preset("Pendulum-v1", exploration="gaussian").sde_sample_freq == 4
    assert ppo.preset("Pendulum-v1", shaping="ppo-shaped", hessian_interval=3).hessian_interval == 3
    assert ppo.preset("Pendulum-v1", exploration="gaussian", obs_clip=5.0, normalize_observations=True).obs_clip == 5.0
    assert mappo.preset("Warehouse-v0", loss="grpo").sequence_reward == "agent"  # the preset's, for the grouped losses
    for make, kw in [(ppo.preset, dict(env="Pendulum-v1", exploration="gaussian", full_std=False)),
                     (grpo.preset, dict(env="Pendulum-v1", adaptive_clip=False, clip_epsilon_decay=0.9)),
                     (sac.preset, dict(env="Pendulum-v1", autotune=False, alpha_lr=1e-2)),
                     (mappo.preset, dict(env="Warehouse-v0", loss="ppo", advantage_std="batch"))]:
        field = list(kw)[-1]
        with pytest.raises(ConfigError, match=rf"^{field}=.*: read only with "):
            make(**kw)
    # a run saved with such a field before the check (it trained as without it) still loads
    loaded = from_dict(PPOConfig, {"env": "CartPole-v1", "sde_sample_freq": 4, "reward_clip": 3.0})
    assert (loaded.sde_sample_freq, loaded.reward_clip) == (4, 3.0)


def test_every_algorithms_dependents_name_its_fields():
    """Each rule of a config's ``dependents`` names fields of that config, and its switch reads the
    class defaults (a misspelt field would make the check a silent no-op)."""
    checked = 0
    for name in registry.names(commands=False):
        cls = registry.resolve(registry.lookup(name).config)
        fields = {f.name for f in dataclasses.fields(cls)}
        for switch, on, names in getattr(cls, "dependents", ()):
            assert isinstance(on(cls()), bool) and set(names) <= fields, (name, switch, names)
            checked += 1
    assert checked >= 12


@pytest.mark.parametrize("cls, field, value, expected", [
    (GRPOConfig, "clip_epsilon_high", "x", "a number or None"), (PPOConfig, "target_kl", "0.1", "a number or None"),
    (GRPOConfig, "clip_epsilon_high", True, "a number or None"), (PPOConfig, "value_clip_epsilon", [0.2], "a number or None"),
])
def test_an_optional_number_field_refuses_a_non_number(cls, field, value, expected):
    """New-user pass: GRPOConfig(clip_epsilon_high="x") was a raw TypeError from a comparison in
    __post_init__ (every other field of the wrong type names itself)."""
    with pytest.raises(ConfigError, match=rf"^{field}={value!r}: expected {expected}$".replace("[", r"\[").replace("]", r"\]")):
        cls(**{field: value})


def test_more_seeds_than_an_evaluation_can_step_name_the_limit():
    # Regression: `--num-seeds 100000 --eval-episodes 2` said "expected at most 0" (episodes per seed).
    with pytest.raises(ConfigError, match=r"^run.eval_episodes=2 per seed, 100000 seeds: expected fewer than 10001 seeds x episodes"):
        RunConfig(eval_episodes=2, num_seeds=100_000)
    with pytest.raises(ConfigError, match=r"^run.eval_episodes=2 per seed, 6000 seeds: expected at most 1 "):
        RunConfig(eval_episodes=2, num_seeds=6_000)

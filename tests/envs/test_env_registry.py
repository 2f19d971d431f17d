"""The env registry (rlfunc.envs.registry): lookups, errors, registration, our envs' entries, and that
rlfunc reaches our environments only through it."""

import re
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlfunc.envs import registry
from rlfunc.envs.registry import EnvEntry
from rlfunc.errors import EnvError

RLFUNC = Path(__file__).resolve().parents[2] / "rlfunc"


@pytest.fixture
def scratch(monkeypatch):
    """A copy of the registry's table, so entries a test registers leave with it."""
    registry.ensure_loaded()
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    return registry


def test_lookup_of_a_registered_id():
    entry = registry.lookup("PointReach-v0")
    assert isinstance(entry, EnvEntry) and registry.find("PointReach-v0") is entry
    assert registry.ids()[:3] == ("PointReach-v0", "PushState-v0", "Push-v0")


def test_unknown_id_names_the_id_and_the_registered_ids():
    with pytest.raises(EnvError, match=r"^env='Nope-v0': not in rlfunc's env registry \(registered: .*PointReach-v0") as e:
        registry.lookup("Nope-v0")
    assert all(k in str(e.value) for k in registry.ids())
    assert registry.find("Nope-v0") is None


def test_an_entry_registered_by_a_test_is_found(scratch):
    mine = EnvEntry(episode_metrics=lambda td: td)
    scratch.register("Mine-v0", mine)
    assert scratch.lookup("Mine-v0") is mine and "Mine-v0" in scratch.ids("episode_metrics")
    assert "Mine-v0" not in scratch.ids("torch_env")
    with pytest.raises(EnvError, match="'Mine-v0': already in the env registry"):
        scratch.register("Mine-v0", EnvEntry())
    family = EnvEntry()
    scratch.register("mine-*", family)
    assert scratch.lookup("mine-small-v1") is family and scratch.find("Mine-v0") is mine


def test_register_and_ids_reject_bad_arguments(scratch):
    with pytest.raises(EnvError, match="env_id=''"):
        scratch.register("", EnvEntry())
    with pytest.raises(EnvError, match="expected an rlfunc.envs.registry.EnvEntry"):
        scratch.register("Dict-v0", {"torch_env": None})
    with pytest.raises(EnvError, match="having='expert': expected a field of EnvEntry"):
        scratch.ids("expert")
    with pytest.raises(EnvError, match="'module:attribute'"):
        registry.lazy("json.dumps")


def test_lazy_imports_on_first_call():
    dumps = registry.lazy("json:dumps")
    assert dumps({"a": 1}) == '{"a": 1}' and dumps.__name__ == "dumps"


def test_point_reach_has_a_torch_builder_and_an_expert():
    from envs import point_reach as pr

    build = registry.torch_builder("PointReach-v0")
    env = build(3, act_steps=2, device="cpu", seed=0)
    assert isinstance(env, pr.PointReachEnv) and env.batch_size == torch.Size([3]) and env.act_steps == 2
    entry = registry.lookup("PointReach-v0")
    data, summary = entry.demonstrations("PointReach-v0", 4, 3, seed=0, noise_std=0.0, device=torch.device("cpu"))
    assert set(data.keys()) == {"observation", "action", "episode"} and data["action"].shape[1:] == (3, pr.ACT_DIM)
    assert summary == {"success_rate": 1.0, "num_episodes": 4, "num_samples": data.batch_size[0]}  # as demos.py documents
    assert "PointReach-v0" in registry.ids("demonstrations")


def test_pendulum_has_no_torch_builder():
    from rlfunc.algos.grpo import GRPOConfig

    assert registry.find("Pendulum-v1") is None and registry.torch_builder("Pendulum-v1") is None
    assert not GRPOConfig(env="Pendulum-v1", num_groups=2, group_size=2, minibatch_size=2).use_torch_env
    assert GRPOConfig(num_groups=2, group_size=2, minibatch_size=2).use_torch_env  # PointReach-v0


def test_multi_agent_entries():
    warehouse, rware = registry.lookup("Warehouse-v0"), registry.lookup("rware-tiny-2ag-v2")
    assert warehouse.multi_agent_env is not None and warehouse.settable_state
    assert rware.multi_agent_env is not None and not rware.settable_state
    assert registry.lookup("PointReach-v0").multi_agent_env is None


def test_episode_metrics_of_first_episodes_match_mode_statistics():
    """evaluate_chunks' masking (done := first episode ends) gives mode_statistics of the first episodes."""
    from envs import point_reach as pr

    gen = torch.Generator().manual_seed(0)
    goal = torch.randint(-1, 2, (5, 7, 1), generator=gen)
    done = torch.rand(5, 7, 1, generator=gen) < 0.4
    d = done.squeeze(-1)
    first = d & (d.long().cumsum(-1) == 1)
    masked = TensorDict({"next": {"goal_index": goal, "done": first.unsqueeze(-1)}}, batch_size=[5, 7])
    ours = {k: float(v) for k, v in registry.lookup("PointReach-v0").episode_metrics(masked).items()}
    assert ours == pr.mode_statistics(goal.squeeze(-1)[first], first[first])


def test_rlfunc_reaches_our_envs_only_through_the_registry():
    imports, by_name = [], []
    for path in sorted(RLFUNC.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(RLFUNC.parent)}:{n}"
            if re.match(r"\s*(import envs\b|from envs\b)", line) and path != RLFUNC / "envs" / "registry.py":
                imports.append(where)
            if re.search(r'env_id == "|TORCH_ENVS', line):
                by_name.append(where)
    assert imports == [] and by_name == []


def test_a_package_plugs_its_envs_in_through_the_rlfunc_envs_entry_point_group(scratch, monkeypatch, tmp_path):
    """A package of the user's registers its env from the module its "rlfunc.envs" entry point names
    (loaded with ours on first use, no edit of rlfunc); a plugin that fails to import is named in one line."""
    import importlib.metadata
    import sys

    (tmp_path / "my_robot_entries.py").write_text(
        "from rlfunc.envs.registry import EnvEntry, register\n"
        "register('MyRobot-v0', EnvEntry(episode_metrics=lambda td: td))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    good = importlib.metadata.EntryPoint("my_robot", "my_robot_entries", registry.PLUGIN_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [good] if group == registry.PLUGIN_GROUP else [])
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.delitem(sys.modules, "my_robot_entries", raising=False)
    assert registry.find("MyRobot-v0") is not None and "MyRobot-v0" in registry.ids()
    bad = importlib.metadata.EntryPoint("broken", "no_such_module_xyz", registry.PLUGIN_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [bad])
    monkeypatch.setattr(registry, "_loaded", False)
    with pytest.raises(EnvError, match=r"env plugin 'broken' \(no_such_module_xyz.*ModuleNotFoundError"):
        registry.ensure_loaded()
    # new-user pass: a second call went on without the plugin, silently (a notebook's next cell)
    with pytest.raises(EnvError, match=r"env plugin 'broken'"):
        registry.ensure_loaded()


def test_a_single_agent_algorithm_on_a_multi_agent_registry_env_is_told_to_use_mappo():
    """`rlfunc train td3 --env Warehouse-v0` suggested "did you mean CartPole-v0?"."""
    from rlfunc.envs.collect import check_env_id

    multi = [i for i in registry.ids("multi_agent_env") if not i.endswith("*")]
    assert multi
    with pytest.raises(EnvError, match=rf"a multi-agent env of rlfunc's env registry.*rlfunc train mappo --env {re.escape(multi[0])}"):
        check_env_id(multi[0])


def test_a_package_of_another_project_named_envs_is_warned_about(monkeypatch, tmp_path):
    """The bug: a user's own top-level `envs` package (a common folder name in RL projects), first on
    sys.path, was imported in place of rlfunc's and the registry stayed empty with no word."""
    import sys

    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "envs")
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_ENTRIES", {})
    with pytest.warns(UserWarning, match=r"the package 'envs' imported from .*envs/__init__.py is not rlfunc's"):
        registry.ensure_loaded()
    assert registry.ids() == ()

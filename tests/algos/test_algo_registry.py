"""The algorithm registry (rlfunc.algos.registry): what `rlfunc train|eval|resume` dispatch through."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlfunc.algos import registry
from rlfunc.algos.registry import AlgorithmEntry
from rlfunc.cli.commands import main
from rlfunc.errors import CheckpointError, ConfigError
from rlfunc.config import RunConfig
from rlfunc.run import Run
from rlfunc.run.resume import STATE_LAYOUT

CLI_NAMES = ("ppo", "bc", "dppo", "td3-diffusion", "sac-diffusion", "sac", "td3", "grpo", "gspo", "mappo")
ROOT = Path(__file__).resolve().parents[2]


def test_every_cli_algorithm_is_registered_and_resolves():
    assert registry.names() == CLI_NAMES
    assert registry.names(commands=False) == ("ppo", "ppo-encoder", *CLI_NAMES[1:])
    assert registry.names(family="diffusion") == ("bc", "dppo", "td3-diffusion", "sac-diffusion")
    assert registry.names(family="offpolicy") == ("sac", "td3")
    for name in registry.names(commands=False):
        entry = registry.lookup(name)
        assert dataclasses.is_dataclass(registry.resolve(entry.config)), name
        for field in ("run", "command", "evaluate", "report"):
            assert callable(registry.resolve(getattr(entry, field))), (name, field)
        assert entry.needs
    assert registry.variant("ppo", "Pendulum-v1") == "ppo"
    assert registry.variant("ppo", "Push-v0") == "ppo-encoder"  # a Dict observation


def test_unknown_names_are_refused_naming_the_known_ones(capsys):
    with pytest.raises(ConfigError, match="algorithm='redq': expected one of ppo, ppo-encoder, bc, .*, sac, td3, .*, mappo"):
        registry.lookup("redq")
    assert main(["train", "redq"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rlfunc: error: algorithm: expected one of ppo, bc, dppo, td3-diffusion, sac-diffusion, sac, td3, grpo, gspo, mappo "
                   "after `rlfunc train`, got 'redq'"]
    with pytest.raises(ConfigError, match="expected both or neither"):
        registry.register("half", dataclasses.replace(registry.lookup("ppo"), variant_of="ppo"))
    with pytest.raises(ConfigError, match="registered already"):
        registry.register("bc", registry.lookup("dppo"))


def test_config_from_meta_goes_through_the_snapshot_algo():
    from rlfunc.algos.bc import BCConfig
    from rlfunc.algos.ppo import PPOConfig

    meta = {"algo": "bc", "config": json.loads(json.dumps(dataclasses.asdict(BCConfig())))}
    assert registry.config_from_meta(meta, "snap") == BCConfig()
    ppo = {"algo": "ppo", "config": json.loads(json.dumps(dataclasses.asdict(PPOConfig())))}
    assert registry.config_from_meta(ppo, "snap") == PPOConfig()
    with pytest.raises(CheckpointError, match="snap: snapshot algo='redq': expected one of ppo, ppo-encoder, bc, .*, mappo"):
        registry.config_from_meta({"algo": "redq"}, "snap")
    with pytest.raises(CheckpointError, match="snap: snapshot algo='bc': expected 'ppo'"):  # a loader of ppo's snapshots
        registry.config_from_meta(meta, "snap", of=PPOConfig)
    with pytest.raises(CheckpointError, match="snap: snapshot algo='ppo': expected one of bc, dppo, td3-diffusion, sac-diffusion"):
        registry.config_from_meta(ppo, "snap", of="diffusion")
    assert registry.name_of(BCConfig()) == "bc"
    with pytest.raises(ConfigError, match="config=dict: expected the config of a registered algorithm"):
        registry.name_of({})


# A toy algorithm: what a new one adds is its config, its Run and one entry - no train, resume or
# config_from_meta function of its own.
CALLS = []


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """A toy algorithm's hyperparameters."""

    steps: int = 3  # iterations
    run: RunConfig = dataclasses.field(default_factory=lambda: RunConfig(eval_episodes=2))


class ToyRun(Run):
    """Adds its iteration number to x each iteration."""

    name = "toy"

    def __init__(self, config, device, *, dist=None, resumed=False):
        CALLS.append(("build", config.steps, resumed))
        self.config, self.total = config, config.steps
        self.state = TensorDict({"iteration": torch.zeros((), dtype=torch.int64), "x": torch.zeros(())}, batch_size=[])

    def step(self, i, stopping):
        self.state["x"] += i
        self.state["iteration"] += 1
        return {"iteration": i, "step": i, "x": float(self.state["x"])}

    def saved(self):
        meta = {"algo": "toy", "config": dataclasses.asdict(self.config), "iteration": int(self.state["iteration"]),
                "env_steps": int(self.state["iteration"]), "state_layout": STATE_LAYOUT}  # what Run.saved asks, no more
        return self.state.clone(), meta

    def restore(self, loaded, meta):
        self.state.update_(loaded)

    def evaluate(self):
        return {"algo": "toy", "x": float(self.state["x"])}


def _toy_command(name, argv):
    from rlfunc.run import train

    CALLS.append(("command", name, argv))
    steps, run_dir = int(argv[1]), argv[3]
    return 0 if train(ToyConfig(steps), run_dir, progress=False, tensorboard=False).evaluation["x"] == steps * (steps + 1) / 2 else 1


def _toy_evaluate(run_dir, episodes=None, *, seed=None, device="auto"):
    return {"toy_episodes": episodes, "seed": seed}


@pytest.fixture
def toy(monkeypatch):
    registry.names()  # the built-in entries, loaded before the copy
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    here = __name__
    registry.register("toy", AlgorithmEntry(
        config=f"{here}:ToyConfig", run=f"{here}:ToyRun", command=f"{here}:_toy_command", evaluate=f"{here}:_toy_evaluate",
        needs="anything", usage="    rlfunc train toy [--steps N]", budget="steps", unit="iterations",
    ))
    CALLS.clear()
    return CALLS


def test_a_registered_entry_is_dispatched_by_train_eval_and_resume(toy, tmp_path, capsys):
    from rlfunc import resume

    assert registry.names()[-1] == "toy"
    run = tmp_path / "run"
    assert main(["train", "toy", "--steps", "3", "--run-dir", str(run)]) == 0
    assert toy == [("command", "toy", ["--steps", "3", "--run-dir", str(run)]), ("build", 3, False)]
    assert main(["--help"]) == 0
    assert "    rlfunc train toy [--steps N]\n    rlfunc eval RUN_DIR" in capsys.readouterr().out
    assert main(["eval", str(run), "--episodes", "4", "--seed", "7"]) == 0
    assert json.loads(capsys.readouterr().out) == {"toy_episodes": 4, "seed": 7}
    # `rlfunc resume` builds the Run from the snapshot's config, with the new budget, and continues it
    assert main(["resume", str(run), "--total-steps", "5"]) == 0
    assert toy[-1] == ("build", 5, True)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"algo": "toy", "x": 15.0}  # 1 + ... + 5
    assert registry.config_from_meta({"algo": "toy", "config": {"steps": 2}}) == ToyConfig(2)
    assert resume(run, 6, progress=False, tensorboard=False).evaluation == {"algo": "toy", "x": 21.0}


def test_a_package_plugs_its_algorithm_in_through_the_rlfunc_algorithms_entry_point_group(monkeypatch, tmp_path, capsys):
    """An algorithm of another package registers from the module its "rlfunc.algorithms" entry point
    names: `rlfunc train NAME` and `rlfunc --help` reach it with no edit of rlfunc; a plugin that fails
    to import is named in one line (exit 2)."""
    import importlib.metadata
    import sys

    here = __name__
    (tmp_path / "my_algo_entries.py").write_text(
        "from rlfunc.algos.registry import AlgorithmEntry, register\n"
        f"register('plugged', AlgorithmEntry(config='{here}:ToyConfig', run='{here}:ToyRun', command='{here}:_toy_command',\n"
        f"    evaluate='{here}:_toy_evaluate', needs='anything', usage='    rlfunc train plugged [--steps N]'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_algo_entries", raising=False)
    good = importlib.metadata.EntryPoint("my_algo", "my_algo_entries", registry.PLUGIN_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [good] if group == registry.PLUGIN_GROUP else [])
    registry.names()  # the built-in entries (their modules register once, on import), kept in the copy
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    monkeypatch.setattr(registry, "_loaded", False)
    CALLS.clear()
    assert registry.names()[-1] == "plugged" and "ppo" in registry.names()
    run = tmp_path / "run"
    assert main(["train", "plugged", "--steps", "2", "--run-dir", str(run)]) == 0
    assert CALLS == [("command", "plugged", ["--steps", "2", "--run-dir", str(run)]), ("build", 2, False)]
    assert main(["--help"]) == 0
    assert "    rlfunc train plugged [--steps N]" in capsys.readouterr().out
    bad = importlib.metadata.EntryPoint("broken", "no_such_module_xyz", registry.PLUGIN_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [bad] if group == registry.PLUGIN_GROUP else [])
    monkeypatch.setattr(registry, "_loaded", False)
    with pytest.raises(ConfigError, match=r"algorithm plugin 'broken' \(no_such_module_xyz.*ModuleNotFoundError"):
        registry.names()
    monkeypatch.setattr(registry, "_loaded", False)
    assert main(["train", "ppo", "--help"]) == 2
    err = capsys.readouterr().err.strip()
    assert "algorithm plugin 'broken'" in err and len(err.splitlines()) == 1
    # the bug: the first call raised, later ones went on without the plugin, silently (in a notebook)
    with pytest.raises(ConfigError, match="algorithm plugin 'broken'"):
        registry.names()


def test_a_module_of_algos_that_fails_to_import_is_named_and_the_others_still_work(monkeypatch, tmp_path, capsys):
    """New-user pass: a typo in a new algos/ module (`import a2c_losss`) was an ImportError traceback
    in every command, `rlfunc --help` and `rlfunc train ppo` included."""
    import rlfunc.algos

    (tmp_path / "zz_broken_algo.py").write_text("import no_such_module_xyz  # a typo\n")
    monkeypatch.setattr(rlfunc.algos, "__path__", [*rlfunc.algos.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    monkeypatch.setattr(registry, "_loaded", False)
    with pytest.warns(UserWarning, match=r"^rlfunc.algos.zz_broken_algo failed to import, its algorithms are not registered: "
                                         r"ModuleNotFoundError: No module named 'no_such_module_xyz'$"):
        assert "ppo" in registry.names() and "sac" in registry.names()


def test_a_plugin_config_parses_with_the_run_flags_flat():
    # the bug: a config class defined outside rlfunc was left to tyro, which handed its nested RunConfig
    # over unbuilt ("run=<_Unbuilt ...>: expected a RunConfig") and showed --run.seed instead of --seed
    from rlfunc.cli.common import parse_config

    parsed = parse_config(ToyConfig, args=["--steps", "4", "--seed", "3"], default=ToyConfig(), prog="rlfunc train toy",
                          description="toy")
    assert parsed == ToyConfig(4, RunConfig(eval_episodes=2, seed=3))


def _algorithm_name_literals(path: Path) -> list[str]:
    """String constants equal to an algorithm name that ``path`` compares against or keys a dict or
    a match case with: the shape of a dispatch ladder."""
    known = set(registry.names(commands=False))
    found = []

    def strings(node):
        for sub in ast.walk(node):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value in known:
                found.append(f"{path.name}:{sub.lineno}: {sub.value!r}")

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                strings(operand)
        elif isinstance(node, ast.Dict):
            for key in node.keys:
                if key is not None:
                    strings(key)
        elif isinstance(node, ast.match_case):
            strings(node.pattern)
    return found


@pytest.mark.parametrize("module", ["cli/commands.py", "cli/common.py", "cli/ppo.py", "cli/diffusion.py", "run/diffusion.py",
                                    "cli/offpolicy.py", "run/offpolicy.py"])
def test_dispatch_modules_hold_no_ladder_over_algorithm_names(module):
    assert _algorithm_name_literals(ROOT / "rlfunc" / module) == []


def test_the_ladder_check_sees_a_ladder(tmp_path):
    ladder = tmp_path / "ladder.py"
    ladder.write_text('if algo == "mappo":\n    pass\nfn = {"bc": 1}[algo]\nok = algo in ("grpo", "gspo")\n')
    assert len(_algorithm_name_literals(ladder)) == 4


def test_resolve_reports_an_import_failure_as_itself(tmp_path, monkeypatch):
    """The bug (on a GPU machine with MUJOCO_GL=egl and no libEGL): OpenGL raised AttributeError while
    rlfunc.run.ppo_encoder was being imported, and resolve reported "module 'rlfunc.run.ppo_encoder' has
    no attribute 'is_dict_env'", hiding the cause. Now the import's own error comes through; a missing
    attribute of a module that imports is still the one ConfigError line."""
    from rlfunc.algos.registry import resolve
    from rlfunc.errors import ConfigError

    (tmp_path / "broken_on_import.py").write_text("raise AttributeError(\"'NoneType' object has no attribute 'eglQueryString'\")\n")
    (tmp_path / "fine_module.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AttributeError, match="eglQueryString"):
        resolve("broken_on_import:is_dict_env")
    assert resolve("fine_module:x") == 1
    with pytest.raises(ConfigError, match="module 'fine_module' has no attribute 'y'"):
        resolve("fine_module:y")

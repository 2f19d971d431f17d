"""The algorithm registry (rlfunc.algos.registry): what `rlfunc train|eval|resume` dispatch through."""

import ast
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from rlfunc.algos import registry
from rlfunc.algos.registry import AlgorithmEntry
from rlfunc.cli.commands import main
from rlfunc.errors import CheckpointError, ConfigError
from rlfunc.run import checkpoint

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
        for field in ("command", "train", "resume", "evaluate", "config_from_meta", "report"):
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
    with pytest.raises(CheckpointError, match="snap: snapshot algo='redq': expected 'ppo'"):  # the fallback's refusal
        registry.config_from_meta({"algo": "redq"}, "snap")


# A toy algorithm: what a new one adds is its files and one entry.
CALLS = []


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """A toy algorithm's hyperparameters."""

    steps: int = 3  # iterations


def _toy_command(name, argv):
    CALLS.append(("command", name, argv))
    return 0


def _toy_train(config, run_dir, **kw):
    CALLS.append(("train", config, run_dir))


def _toy_resume(run_dir, total_steps=None, *, device=None):
    CALLS.append(("resume", Path(run_dir).name, total_steps))
    return SimpleNamespace(run_dir=run_dir, interrupted=None, evaluation={"toy": total_steps})


def _toy_evaluate(run_dir, episodes=None, *, seed=None, device="auto"):
    return {"toy_episodes": episodes, "seed": seed}


def _toy_from_meta(meta, path):
    return ToyConfig(**meta["config"])


@pytest.fixture
def toy(monkeypatch):
    registry.names()  # the built-in entries, loaded before the copy
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    here = __name__
    registry.register("toy", AlgorithmEntry(
        config=f"{here}:ToyConfig", command=f"{here}:_toy_command", train=f"{here}:_toy_train",
        resume=f"{here}:_toy_resume", evaluate=f"{here}:_toy_evaluate", config_from_meta=f"{here}:_toy_from_meta",
        needs="anything", usage="    rlfunc train toy [--steps N]",
    ))
    CALLS.clear()
    return CALLS


def test_a_registered_entry_is_dispatched_by_train_eval_and_resume(toy, tmp_path, capsys):
    assert registry.names()[-1] == "toy"
    assert main(["train", "toy", "--steps", "5"]) == 0
    assert toy == [("command", "toy", ["--steps", "5"])]
    assert main(["--help"]) == 0
    assert "    rlfunc train toy [--steps N]\n    rlfunc eval RUN_DIR" in capsys.readouterr().out
    run = tmp_path / "run"
    checkpoint.save_snapshot(run / checkpoint.CHECKPOINTS_DIR / "step_000000000001",
                             TensorDict({"x": torch.zeros(1)}, batch_size=[]), {"algo": "toy", "config": {}})
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "4", "--seed", "7"]) == 0
    assert json.loads(capsys.readouterr().out) == {"toy_episodes": 4, "seed": 7}
    assert main(["resume", str(run), "--total-steps", "9"]) == 0
    assert toy[-1] == ("resume", "run", 9)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"toy": 9}
    assert registry.config_from_meta({"algo": "toy", "config": {"steps": 2}}) == ToyConfig(2)


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

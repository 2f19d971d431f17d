"""``rlfunc train bc|dppo|td3-diffusion [...]``: every field of the algorithm's config (its actor spec
included, as ``--actor.FIELD``) is a flag; ``--demos N`` and ``--init RUN_DIR`` are short for
``--num-demos`` and ``--init-from``."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from rlfunc.algos import registry
from rlfunc.algos.bc import BCConfig
from rlfunc.algos.diffusion_actor import ActorSpec
from rlfunc.algos.dppo import DPPOConfig
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig
from rlfunc.cli_common import default_run_dir, report_run


def _convert(cls, obj):
    """Rebuild dataclass ``obj`` as ``cls`` field by field (nested config dataclasses included)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        values[f.name] = _convert(hints[f.name], value) if dataclasses.is_dataclass(hints[f.name]) else value
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class _LooseActorSpec(ActorSpec):
    """Architecture and diffusion settings of the diffusion actor."""

    def __post_init__(self) -> None:
        pass


# Unvalidated subclasses of the diffusion configs for tyro (which would box a ValueError); defined
# here, in source, so that tyro finds the parents' field comments for --help.
@dataclasses.dataclass(frozen=True)
class _LooseBC(BCConfig):
    actor: _LooseActorSpec = dataclasses.field(default_factory=_LooseActorSpec)  # the actor to train

    def __post_init__(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _LooseDPPO(DPPOConfig):
    actor: _LooseActorSpec = dataclasses.field(default_factory=_LooseActorSpec)  # ignored with --init-from (the snapshot's spec is used)

    def __post_init__(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _LooseTD3(TD3DiffusionConfig):
    actor: _LooseActorSpec = dataclasses.field(  # ignored with --init-from (the snapshot's spec is used)
        default_factory=lambda: _convert(_LooseActorSpec, TD3DiffusionConfig().actor)
    )

    def __post_init__(self) -> None:
        pass


# Short forms of two diffusion flags: `rlfunc train bc --demos N`, `rlfunc train dppo --init RUN_DIR`.
_ALIASES = {"--demos": "--num-demos", "--init": "--init-from"}


def _train(name: str, argv: list[str], loose: type, what: str) -> int:
    """Parse ``argv`` into ``loose``, validate it as the config of ``name``'s entry, run its ``train``
    and print the evaluation as one JSON line (exit 0), or 130/143 when SIGINT/SIGTERM stopped it."""
    import tyro

    entry = registry.lookup(name)
    cls, fn = registry.resolve(entry.config), registry.resolve(entry.train)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--run-dir", default=None)
    known, rest = pre.parse_known_args(argv)
    rest = [_ALIASES.get(a, a) for a in rest]
    parsed = tyro.cli(
        loose, args=rest, default=_convert(loose, cls()),
        prog=f"rlfunc train {name}", description=f"Train {what}. Also: --run-dir DIR (default runs/ENV-{name}-sSEED-TIME).",
    )
    config = _convert(cls, parsed)  # validated here, so errors print as one line
    result = fn(config, known.run_dir or default_run_dir(config.env, name, config.seed))
    return report_run(result, f"evaluate it with `rlfunc eval {result.run_dir}` or start a new run from it with "
                              f"`--init-from {result.run_dir}`")


def train_bc(name: str, argv: list[str]) -> int:
    """``rlfunc train bc [...]``."""
    return _train(name, argv, _LooseBC, "diffusion behaviour cloning on the env's scripted-expert demonstrations")


def train_dppo(name: str, argv: list[str]) -> int:
    """``rlfunc train dppo [...]``."""
    return _train(name, argv, _LooseDPPO, "PPO over the denoising chain of a diffusion actor (DPPO)")


def train_td3_diffusion(name: str, argv: list[str]) -> int:
    """``rlfunc train td3-diffusion [...]``."""
    return _train(name, argv, _LooseTD3, "TD3 with a diffusion actor (Diffusion-QL)")

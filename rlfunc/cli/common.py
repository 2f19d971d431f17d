"""What every ``rlfunc train ALGO`` command does around its training function: the flags of its
config (:func:`parse_config`, tyro over the library's own config dataclasses), the default run
directory and the report at the end (run dir on stderr, the evaluation as one JSON line on stdout,
or the signal that stopped the run with its exit code 128 + signal number); and the argument parser
of the plain argparse subcommands, whose errors are one line."""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import functools
import json
import os
import signal
import sys
import time
from typing import Annotated, Any, TypeVar

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """argparse, but a bad or missing argument raises ConfigError (one line from ``rlfunc.cli.commands``,
    exit 2) instead of printing the usage block."""

    def error(self, message: str):
        from rlfunc.errors import ConfigError

        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


class _Unbuilt:
    """A config dataclass's parsed fields, not yet given to its constructor (which validates them)."""

    def __init__(self, cls: type, **fields: Any) -> None:
        self.cls, self.fields = cls, fields

    def build(self) -> Any:
        return self.cls(**{k: v.build() if isinstance(v, _Unbuilt) else v for k, v in self.fields.items()})


_default_rules = contextvars.ContextVar("rlfunc_default_rules", default=False)


def parse_config(cls: type[T], args: list[str], *, default: T, prog: str, description: str) -> T:
    """tyro over ``cls``, an rlfunc config dataclass (its nested configs, e.g. ``--actor.FIELD``, as
    flags too; the fields of its :class:`rlfunc.config.RunConfig` ``run`` without the prefix:
    ``--seed``, ``--device``, ``--checkpoint-every``), from ``default``'s values; ``--help`` shows
    every field with its comment.

    tyro builds each config dataclass as an unbuilt record (a struct rule of tyro's public
    ``ConstructorRegistry`` around its own dataclass rule); the configs are then constructed here,
    outside tyro, so validation happens once, in the config's own ``__post_init__``, and a bad value
    is one ConfigError line (``rlfunc.cli.commands``: exit 2) rather than tyro's error box.

    Raises:
        ConfigError: a value the config refuses. SystemExit: tyro's own parse errors and ``--help``.
    """
    import tyro
    from tyro.constructors import ConstructorRegistry, StructConstructorSpec

    from rlfunc.config import RunConfig

    registry = ConstructorRegistry()

    @registry.struct_rule
    def unbuilt(info):
        if _default_rules.get() or not (dataclasses.is_dataclass(info.type) and info.type.__module__.startswith("rlfunc.")):
            return None
        token = _default_rules.set(True)  # tyro's own rule for the dataclass: fields, defaults, help
        try:
            spec = ConstructorRegistry.get_struct_spec(info)
        finally:
            _default_rules.reset(token)
        if not isinstance(spec, StructConstructorSpec):
            return spec
        fields = tuple(dataclasses.replace(f, type=Annotated[f.type, tyro.conf.OmitArgPrefixes])
                       if f.type is RunConfig else f for f in spec.fields)  # --seed, not --run.seed
        return dataclasses.replace(spec, fields=fields, instantiate=functools.partial(_Unbuilt, info.type))

    parsed = tyro.cli(cls, args=args, default=default, prog=prog, description=description, registry=registry)
    return parsed.build() if isinstance(parsed, _Unbuilt) else parsed


def default_run_dir(env: str, name: str, seed: int) -> str:
    """``runs/ENV-NAME-sSEED-YYYYmmdd-HHMMSS``."""
    return os.path.join("runs", f"{env}-{name}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}")


def report_run(result, also: str = "") -> int:
    """Print what ``result`` (with ``run_dir``, ``interrupted`` and ``evaluation``) says; return the
    exit code: 0, or 130 / 143 when SIGINT / SIGTERM stopped the run. The interruption line says how
    to continue the run (``rlfunc resume RUN_DIR``), then ``also`` (other things to do with it)."""
    print(f"run dir: {result.run_dir}", file=sys.stderr)
    if result.interrupted:
        print(f"interrupted ({result.interrupted}): snapshot saved; continue with `rlfunc resume {result.run_dir}`"
              f"{'; or ' + also if also else ''}", file=sys.stderr)
        return 128 + int(getattr(signal, result.interrupted))
    print(json.dumps(result.evaluation))
    return 0

"""What every ``rlfunc train ALGO`` command does (:func:`train_command`): the flags of its config
(:func:`parse_config`, tyro over the library's own config dataclasses), the default run directory,
the launch of N ranks under torchrun (:func:`launch`) and the report at the end (run dir on stderr,
the evaluation as one JSON line on stdout, or the signal that stopped the run with its exit code
128 + signal number); and the argument parser of the plain argparse subcommands, whose errors are
one line."""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import io
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
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
    from rlfunc.errors import ConfigError

    registry = ConstructorRegistry()

    @registry.struct_rule
    def unbuilt(info):
        ours = info.type is cls or getattr(info.type, "__module__", "").startswith("rlfunc.")  # a plugin's config too
        if _default_rules.get() or not (dataclasses.is_dataclass(info.type) and ours):
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
        def unbuilt_of(**values: Any) -> _Unbuilt:
            return _Unbuilt(info.type, **values)

        unbuilt_of.__doc__ = info.type.__doc__  # what --help shows for the group: the config's docstring, not ours
        return dataclasses.replace(spec, fields=fields, instantiate=unbuilt_of)

    box = io.StringIO()
    try:
        with contextlib.redirect_stderr(box):  # tyro's parse errors come as a rich box on stderr, then SystemExit(2)
            parsed = tyro.cli(cls, args=args, default=default, prog=prog, description=description, registry=registry)
    except SystemExit as e:
        if e.code not in (0, None):
            raise ConfigError(tyro_error_line(box.getvalue(), prog)) from None
        sys.stderr.write(box.getvalue())
        raise
    sys.stderr.write(box.getvalue())
    return parsed.build() if isinstance(parsed, _Unbuilt) else parsed


def tyro_error_line(box: str, prog: str | None) -> str:
    """One line of tyro's error box (a bad flag value, an unknown flag, a missing value): its first
    line of text, plus the flags it suggests ("did you mean --total-steps?"); rlfunc's errors are
    one line, and the box took 5-11."""
    raw = [line.strip(" │╭╮╰╯─|+\n") for line in box.splitlines()]  # the frame, drawn in ASCII without a terminal
    paragraphs, current = [], []  # the box's sections, between its rules; a message wraps over several lines
    for line in raw:
        if line.strip("-─ ") and not line.startswith("For full helptext"):
            current.append(line)
        elif current:
            paragraphs.append(current)
            current = []
    if current:
        paragraphs.append(current)
    lines = [line for p in paragraphs for line in p]
    if not lines:
        return f"cannot parse the flags (see {prog or 'rlfunc train ALGO'} --help)"
    title = [line for line in lines if line.startswith("Perhaps you meant")]
    # the first section that says something, whole (the bug: "Expected one of ('off'," cut at the wrap)
    message = next((p for p in paragraphs if any(":" in line or "." in line for line in p)), paragraphs[0])
    message = message[:next((i for i, line in enumerate(message) if line.startswith("Perhaps you meant")), len(message))] or message
    start = next((i for i, line in enumerate(message) if ":" in line or "." in line), 0)  # past the box's title
    first = " ".join(message[start:])
    if title:
        start = lines.index(title[0]) + 1
        flags = [line.split()[0] for line in lines[start:] if re.match(r"--[A-Za-z]", line)]
        if flags:
            first += f" (did you mean {' or '.join(dict.fromkeys(flags))}?)"
    return f"{first} (see {prog or 'rlfunc train ALGO'} --help)"


def default_run_dir(env: str, name: str, seed: int) -> str:
    """``runs/ENV-NAME-sSEED-YYYYmmdd-HHMMSS``; under torchrun ``runs/ENV-NAME-sSEED-RUN_ID`` (its
    rendezvous id, the same on every rank, where a clock reading might not be)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return os.path.join("runs", f"{env}-{name}-s{seed}-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}")
    return os.path.join("runs", f"{env}-{name}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}")


def under_torchrun() -> bool:
    """Whether this process is one of torchrun's ranks (of any world size, 1 included: its elastic agent
    sets TORCHELASTIC_RUN_ID), or was given a world of several ranks some other way."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def failed_rank(failures: dict) -> tuple[int, Any]:
    """(rank, failure) of the rank that stopped a data-parallel job, from torch elastic's
    ``{rank: ProcessFailure}`` (``exitcode``, ``timestamp`` in whole seconds): the first to fail for
    its own reason. A rank that lost a peer exits 1 (:func:`rlfunc.cli.commands.main`), often before
    the rank whose error stopped the job (the launcher named a surviving rank 0 when rank 1's env
    worker was killed), and the agent ends the others with SIGTERM (-15), often in the same second as
    the failure; such ranks are named only when no other rank failed. Ties keep elastic's order."""
    for skip in ((1, -signal.SIGTERM), (1,), ()):
        own = [(r, f) for r, f in failures.items() if f.exitcode not in skip]
        if own:
            return min(own, key=lambda item: item[1].timestamp)
    raise ValueError("failures: expected at least one failed rank")


def launch(command: list[str], nproc: int, run_dir: str, device: str | None = None) -> int | None:
    """``rlfunc COMMAND...`` in ``nproc`` data-parallel processes on this node, started by torchrun
    (``torch.distributed.run --standalone --nproc-per-node NPROC -m rlfunc COMMAND... --run-dir RUN_DIR``,
    torch's elastic launcher: its c10d rendezvous on a free local port); its exit code. None when
    there is nothing to launch: ``nproc`` is 1, or this process is already one of torchrun's.
    Across nodes, run torchrun yourself (README: "Data-parallel training").

    ``rlfunc resume RUN_DIR`` of a run trained with ``--nproc N`` comes here too and continues on N ranks.
    ``device`` (the run's name for it) is resolved here first: a device this machine lacks is one line,
    not one per rank and the launcher's.

    Raises:
        ConfigError: ``device`` is not on this machine (:func:`rlfunc.device.resolve_device`); a rank
            failed: the message names the first failed rank and its exit code or signal.
    """
    if nproc <= 1 or under_torchrun():
        return None
    if device is not None:
        from rlfunc.device import resolve_device

        resolve_device(device)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from rlfunc.errors import ConfigError
    from rlfunc.run import checkpoint
    from rlfunc.run.distributed import LAUNCHER_PID

    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "rlfunc"])
    # the command's own flags (--nproc among them) are the script's, not torchrun's to parse
    run_dir_flag = ["--run-dir", run_dir] if command[0] == "train" and "--run-dir" not in command else []
    args.training_script_args = [*command, *run_dir_flag]
    # torch elastic logs a rank's end ("Sending process ... closing signal", "failed (exitcode: -9)") on
    # stderr; the line below says it once, in rlfunc's words (each of its loggers sets its own level)
    quiet = {name: lg.level for name, lg in logging.root.manager.loggerDict.items()
             if name.startswith("torch.distributed.elastic") and isinstance(lg, logging.Logger)}
    for name in quiet:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks' parent: gone, they stop (stop_with_launcher)
    try:
        run(args)
    except SignalException as e:  # Ctrl-C / SIGTERM to the launcher: the ranks got it too, saved and said so
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = failed_rank(e.failures)
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        others = sorted(set(e.failures) - {rank})
        saved = Path(run_dir).is_dir() and checkpoint.latest_snapshot(run_dir) is not None
        if command[0] == "resume":  # the ranks refused the snapshot (their errors above say what to do)
            after = "the ranks' errors are above"
        elif saved:
            after = f"the run dir's latest snapshot is intact: rlfunc resume {run_dir}"
        else:
            after = "no snapshot was written (the ranks' errors are above)"
        raise ConfigError(f"data-parallel run: rank {rank} of {nproc} failed ({how})"
                          + (f"; ranks {others} stopped with it" if others else "") + f"; {after}") from None
    finally:
        os.environ.pop(LAUNCHER_PID, None)
        for name, level in quiet.items():
            logging.getLogger(name).setLevel(level)
    return 0


def train_command(name: str, argv: list[str], *, description: str, default: Callable[..., Any] | None = None,
                  extra_flags: tuple[str, ...] = (), check_env: bool = True, tag: Callable[[Any], str] | None = None,
                  launch_as: str | None = None, rewrite: Callable[[str], str] | None = None,
                  check: Callable[[Any], None] | None = None, also: str = "") -> int:
    """``rlfunc train NAME ARGV...`` of ``name``'s registry entry: parse ``argv`` into its config, train
    it with :func:`rlfunc.run.train` and report the run (:func:`report_run`).

    The flags (``rewrite`` applied to each) are the config's fields (:func:`parse_config`), from
    ``default(env, **extras)``: ``env`` the ``--env`` given (the config's own by default; an unknown
    id is refused first, with ``check_env``), ``extras`` the values of ``extra_flags`` (e.g.
    ``--shaping``, read here, not config fields); None: the config class's defaults. ``check(config)``
    may refuse the parsed config. Besides: ``--run-dir DIR`` (default :func:`default_run_dir` of
    ``tag(config)``, else of ``name``) and, through the config, ``--nproc N``: N ranks under torchrun
    (:func:`launch` of ``rlfunc train LAUNCH_AS ARGV...``, ``launch_as`` defaulting to ``name``).
    ``also``: what else to do with a finished run, ``{run_dir}`` filled in.

    Returns:
        The exit code: 0; 130 / 143 when SIGINT / SIGTERM stopped the run (a snapshot saved).
    """
    from rlfunc.algos import registry
    from rlfunc.config import check_dependents
    from rlfunc.envs.collect import check_env_id
    from rlfunc.run import train

    cls = registry.resolve(registry.lookup(name).config)
    command = launch_as or name
    pre = Parser(prog=f"rlfunc train {command}", add_help=False)  # a bad one of these flags: one line
    pre.add_argument("--env", default=cls.env)
    pre.add_argument("--run-dir", default=None)
    for flag in extra_flags:
        pre.add_argument(flag, default=None)
    known, rest = pre.parse_known_args([rewrite(a) for a in argv] if rewrite else argv)
    if check_env and "-h" not in rest and "--help" not in rest:
        check_env_id(known.env)
    extras = {dest: getattr(known, dest) for dest in (flag.lstrip("-").replace("-", "_") for flag in extra_flags)}
    default_config = cls() if default is None else default(known.env, **extras)
    config = parse_config(
        cls, args=["--env", known.env, *rest], default=default_config,
        prog=f"rlfunc train {command}",
        description=f"{description} Also: --run-dir DIR, the output directory (default runs/ENV-{name}-sSEED-TIME).",
    )
    if check is not None:
        check(config)
    check_dependents(config, default_config)  # a flag whose switch is off: it would be recorded and unread
    run_dir = known.run_dir or default_run_dir(config.env, name if tag is None else tag(config), config.run.seed)
    launched = launch(["train", command, *argv], config.run.nproc, run_dir, config.run.device)  # --nproc N: N ranks under torchrun
    if launched is not None:
        return launched
    result = train(config, run_dir)
    return report_run(result, also.format(run_dir=result.run_dir))


def report_run(result, also: str = "") -> int:
    """Print what ``result`` (with ``run_dir``, ``interrupted`` and ``evaluation``) says; return the
    exit code: 0, or 130 / 143 when SIGINT / SIGTERM stopped the run. The interruption line says how
    to continue the run (``rlfunc resume RUN_DIR``), then ``also`` (other things to do with it)."""
    if int(os.environ.get("RANK", "0") or 0) != 0:  # a data-parallel run reports from rank 0 alone
        return 128 + int(getattr(signal, result.interrupted)) if result.interrupted else 0
    print(f"run dir: {result.run_dir}", file=sys.stderr)
    if result.interrupted:
        print(f"interrupted ({result.interrupted}): snapshot saved; continue with `rlfunc resume {result.run_dir}`"
              f"{'; or ' + also if also else ''}", file=sys.stderr)
        return 128 + int(getattr(signal, result.interrupted))
    from rlfunc.run.log import to_jsonable

    print(json.dumps(to_jsonable(result.evaluation)))  # NaN -> null: one valid JSON line
    return 0

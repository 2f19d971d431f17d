"""The ``rlfunc`` command: train | eval | resume | versions, dispatched through the algorithm
registry (:mod:`rlfunc.algos.registry`); ``rlfunc --help`` lists the commands (each algorithm's
``rlfunc train`` lines come from its registry entry)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

from rlfunc.algos import registry
from rlfunc.cli.common import Parser
from rlfunc.errors import CheckpointError, ConfigError, RLFuncError, RunInterrupted, SnapshotCorruptError

_HEAD = "The ``rlfunc`` command.\n\n"
_TAIL = """
    rlfunc eval RUN_DIR [--episodes N] [--version ID]
                                            one JSON line: mean, std, episodes and 95% CI of the return (ppo),
                                            success rate with its CI and goal shares (bc, dppo, td3-diffusion),
                                            eval.json's rates (mappo); of the latest snapshot, or of what the
                                            run continues from after a rollback, or of version ID
    rlfunc resume RUN_DIR [--total-steps N] [--snapshot NAME] [--nproc N] [--profile N]
                                            continue a run from its latest snapshot (N: a new budget; NAME: an older snapshot;
                                            --nproc: ranks, default the run's)
    rlfunc versions list|show|diff|rollback|pin RUN_DIR ...   a run's versions, any algorithm (rlfunc versions --help)

Every config field is a flag of `train ALGO` (`rlfunc train ALGO --help`); ppo's defaults come from
the env's preset. Errors print as one line on stderr with exit code 2; a run stopped by SIGINT/SIGTERM
saves a snapshot and exits with 130/143.
"""


def usage() -> str:
    """The text of ``rlfunc --help``."""
    return _HEAD + registry.usage() + _TAIL


def _train(argv: list[str]) -> int:
    known = registry.names()
    if argv and argv[0] in ("-h", "--help"):  # `rlfunc train --help`: the algorithms' train lines
        print("usage: rlfunc train ALGO [FLAGS]   (every hyperparameter: rlfunc train ALGO --help)\n\n" + registry.usage())
        return 0
    if not argv or argv[0] not in known:
        got = repr(argv[0]) if argv else "nothing"
        raise ConfigError(f"algorithm: expected one of {', '.join(known)} after `rlfunc train`, got {got}")
    return registry.resolve(registry.lookup(argv[0]).command)(argv[0], argv[1:])


def _eval(argv: list[str]) -> int:
    p = Parser(prog="rlfunc eval", description="Evaluate what a run continues from: its latest snapshot, or after a "
                                               "rollback its branch's head version.")
    p.add_argument("run_dir")
    p.add_argument("--episodes", type=int, default=None,
                   help="episodes to run (default: the run's eval_episodes; per eval seed for mappo)")
    p.add_argument("--seed", type=int, default=None, help="evaluation seed (default: derived from the run's seed)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | npu")
    p.add_argument("--version", default=None, metavar="ID",
                   help="evaluate this version of the run (rlfunc versions list RUN_DIR) instead")
    a = p.parse_args(argv)
    from rlfunc.run import checkpoint

    version = a.version
    if version is None and not (Path(a.run_dir) / checkpoint.META_FILE).is_file() and Path(a.run_dir).is_dir():
        from rlfunc.run.loop import resume_source

        source = resume_source(a.run_dir)  # after a rollback: the head version, which `rlfunc resume` continues
        version = source[1] if source is not None and source[0] == "version" else None
    if version is not None:
        return _eval_version(a, version)
    for attempt in range(3):  # a run training beside this may prune the snapshot just picked: take the new latest
        snap = checkpoint.snapshot_to_read(a.run_dir)  # a run dir's latest snapshot, or a snapshot directory
        try:
            result = _eval_snapshot(a, snap)
            break
        except CheckpointError:
            if attempt == 2 or snap.exists():
                raise
    from rlfunc.run.log import to_jsonable

    print(json.dumps(to_jsonable(result)))  # NaN -> null: one valid JSON line
    return 0


def _eval_snapshot(a, snap: Path) -> dict:
    """:func:`_eval` of one snapshot (``a.run_dir``'s latest, ``snap``)."""
    from rlfunc.run import checkpoint

    try:
        algo = checkpoint.load_meta(snap).get("algo")
        if algo not in registry.names(commands=False):
            raise CheckpointError(f"{snap}: snapshot algo={algo!r}: expected one of {', '.join(registry.names(commands=False))}")
        return registry.resolve(registry.lookup(algo).evaluate)(a.run_dir, a.episodes, seed=a.seed, device=a.device)
    except SnapshotCorruptError as e:  # name the older snapshots, as resume does
        older = [p for p in checkpoint.run_snapshots(a.run_dir) if p.name < snap.name]
        if str(snap) not in str(e) or not older:
            raise
        raise SnapshotCorruptError(f"{e}. Older snapshots: {', '.join(p.name for p in older)}; to evaluate the newest "
                                   f"of them: rlfunc eval {older[0]}") from e


def _eval_version(a, version: str) -> int:
    """``rlfunc eval RUN_DIR`` of a version: its state and meta written as a snapshot in a temporary
    directory (the same tensors and meta a snapshot of that iteration holds), evaluated as one; the
    JSON line says which version."""
    import tempfile

    from rlfunc.run import checkpoint, versions

    state, manifest = versions.load_version(a.run_dir, version)
    algo = manifest["meta"].get("algo")
    if algo not in registry.names(commands=False):
        raise CheckpointError(f"{a.run_dir} version {version}: algo={algo!r}: expected one of {', '.join(registry.names(commands=False))}")
    with tempfile.TemporaryDirectory(prefix="rlfunc-eval-") as tmp:
        snap = checkpoint.save_snapshot(Path(tmp) / version, state, manifest["meta"])
        try:
            result = registry.resolve(registry.lookup(algo).evaluate)(snap, a.episodes, seed=a.seed, device=a.device)
        except CheckpointError as e:  # named by the version, not the temporary directory (review pass)
            raise CheckpointError(str(e).replace(str(snap), f"{a.run_dir} version {version}")) from e
    from rlfunc.run.log import to_jsonable

    print(json.dumps(to_jsonable({**result, "version": version})))
    return 0


def _resume(argv: list[str]) -> int:
    p = Parser(prog="rlfunc resume", description="Continue a run from its latest snapshot.")
    p.add_argument("run_dir")
    p.add_argument("--total-steps", type=int, default=None, help="a new budget, in the run's unit: env steps per seed (every algorithm but bc) or updates (bc)")
    p.add_argument("--snapshot", default=None, metavar="NAME",
                   help="continue from this snapshot of RUN_DIR/checkpoints (e.g. step_000000008192) instead of the latest (points 'latest' at it); "
                        "a run with versions continues from its branch's head version when that is further along")
    p.add_argument("--device", default=None,
                   help="run on this device (auto | cpu | cuda | npu) instead of the run's own, from now on (later snapshots "
                        "record it); a run continues exactly only on the device type it ran on")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="continue on N data-parallel ranks on this node (default: as many as the run last trained on, "
                        "which its snapshots record; 1: in this process); N must divide the run's envs")
    p.add_argument("--profile", type=int, default=None, metavar="N",
                   help="record N iterations of this call with the device's profiler into RUN_DIR/profile (default: none; "
                        "a run's own --profile is of its first call)")
    a = p.parse_args(argv)
    if a.nproc is not None and a.nproc < 1:
        raise ConfigError(f"nproc={a.nproc}: expected >= 1")
    from rlfunc.run import checkpoint

    if not Path(a.run_dir).is_dir():
        what = "not a directory" if Path(a.run_dir).exists() else "no such directory"
        raise ConfigError(f"run_dir={a.run_dir!r}: {what} (rlfunc resume continues a run that `rlfunc train` wrote)")
    before = None
    if a.snapshot is not None:  # under the run lock: a running run keeps its 'latest' (refused here, before the warning)
        with checkpoint.hold_run_dir(Path(a.run_dir)):
            before = checkpoint.latest_snapshot(a.run_dir)
            checkpoint.use_snapshot(a.run_dir, a.snapshot)
    snap = checkpoint.latest_snapshot(a.run_dir)
    try:
        return _resume_from(a, snap)
    except RLFuncError as e:
        # refused (these are raised before anything is run or saved): 'latest' names what it named
        if before is not None and before != snap and checkpoint.latest_snapshot(a.run_dir) == snap:
            checkpoint.use_snapshot(a.run_dir, before.name)
        if not isinstance(e, SnapshotCorruptError) or snap is None or str(snap) not in str(e):
            raise
        older = [p.name for p in checkpoint.run_snapshots(a.run_dir) if p.name < snap.name]
        if not older:
            raise
        from rlfunc.run import versions

        also = (" (this run keeps versions: it continues from its branch's head version when that is further along; "
                f"rlfunc versions list {a.run_dir})") if versions.has_versions(a.run_dir) else ""
        raise SnapshotCorruptError(f"{e}. Older snapshots: {', '.join(older)}; to continue from the newest of them: "
                                   f"rlfunc resume {a.run_dir} --snapshot {older[0]}{also}") from e


def _resume_from(a, snap) -> int:
    from rlfunc.cli.common import launch
    from rlfunc.run import checkpoint
    from rlfunc.run.loop import resume_source, source_meta

    with warnings.catch_warnings():  # the resume below finds it again and gives its warnings once
        warnings.simplefilter("ignore")
        source = resume_source(a.run_dir)
    # what the resume continues from (a snapshot, or a version: after a rollback, or past an unreadable meta.json)
    meta, where = source_meta(Path(a.run_dir), source) if source is not None else ({}, str(a.run_dir))
    if a.snapshot is not None and snap is not None:  # after a rollback the run continues on its new branch: say so
        from rlfunc.run import versions

        branch = versions.current_branch(a.run_dir)
        on = checkpoint.load_meta(snap).get("branch", versions.MAIN)
        if source is not None and source[0] == "version" and on != branch:
            raise ConfigError(f"--snapshot {a.snapshot}: the snapshot is on branch {on!r}, the run on {branch!r} (a rollback) "
                              f"and continues from its head version {source[1]}; resume without --snapshot, or roll back "
                              f"to a version of {on!r} (rlfunc versions list {a.run_dir})")
        if source is not None and source[0] == "version":  # the bug: --snapshot was passed over without a word
            warnings.warn(f"--snapshot {a.snapshot}: this run keeps versions, and its branch's head version {source[1]} is "
                          f"further along, so the run continues from it; to go back to {a.snapshot}'s step, roll back to "
                          f"a version of that step (rlfunc versions list {a.run_dir}; rlfunc versions rollback {a.run_dir} V)",
                          stacklevel=2)
    run = (meta.get("config") or {}).get("run") if isinstance(meta.get("config"), dict) else None
    nproc = run.get("nproc", 1) if isinstance(run, dict) else 1
    nproc = nproc if a.nproc is None else a.nproc
    if isinstance(nproc, int) and nproc > 1:  # a data-parallel run continues on as many ranks, under torchrun
        if source is not None:  # a count the run cannot split over is one line here, not one per rank
            from rlfunc.config import replace

            replace(registry.config_from_meta(meta, where), nproc=nproc)
        flags = [*(["--total-steps", str(a.total_steps)] if a.total_steps is not None else []),
                 *(["--device", a.device] if a.device is not None else []),
                 *(["--profile", str(a.profile)] if a.profile is not None else [])]
        device = a.device if a.device is not None else (run.get("device") if isinstance(run, dict) else None)
        launched = launch(["resume", str(a.run_dir), *flags], nproc, str(a.run_dir), device if isinstance(device, str) else None)
        if launched is not None:
            return launched
    from rlfunc.run.loop import resume

    result = resume(a.run_dir, a.total_steps, device=a.device, profile=a.profile)
    return registry.resolve(registry.for_snapshot(meta.get("algo") if source is not None else None).report)(result)


def _versions(argv: list[str]) -> int:
    from rlfunc.cli import versions as cli_versions

    return cli_versions.main(argv)


COMMANDS = {"train": _train, "eval": _eval, "resume": _resume, "versions": _versions}


def _torchrl_logs_to_stderr() -> None:
    """Send torchrl's console log (INFO lines such as "Initialized LazyTensorStorage", on stdout by
    default) to stderr, so that a command's stdout is its one JSON line: through torchrl's own
    TORCHRL_CONSOLE_STREAM for an import still to come, and by moving the handler of one done."""
    import logging

    os.environ.setdefault("TORCHRL_CONSOLE_STREAM", "stderr")
    if "torchrl" in sys.modules:
        for handler in logging.getLogger("torchrl").handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                handler.setStream(sys.stderr)


def _say(line: str) -> None:
    """``line`` and its newline on stderr in one write: the ranks of a data-parallel job share the
    stream, and print's two writes let another rank's line land between them (two errors on one line)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _torchrl_logs_to_stderr()
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        got = f"unknown command {argv[0]!r}" if argv else "no command"
        _say(f"rlfunc: error: {got}; expected one of: {', '.join(COMMANDS)} (rlfunc --help)")
        return 2
    default_format = warnings.formatwarning
    warnings.formatwarning = _one_line_warning(default_format)
    try:
        return COMMANDS[argv[0]](argv[1:])
    except RLFuncError as e:
        _say(f"rlfunc: error: {_rank_prefix()}{e}")
        return 2
    except KeyboardInterrupt as e:  # a second signal, one during the final evaluation, or before a run began
        code = 143 if getattr(e, "signal", None) == "SIGTERM" else 130
        if not isinstance(e, RunInterrupted):
            _say(f"rlfunc: interrupted{f' {e}' if str(e) else ''}")
        elif e.evaluating:
            _say(f"rlfunc: interrupted during the final evaluation: {e.run_dir} keeps its snapshots; `rlfunc resume "
                 f"{e.run_dir}` evaluates it and writes eval.json")
        elif e.resumable:
            _say(f"rlfunc: interrupted; {e.run_dir} keeps its snapshots: continue with `rlfunc resume {e.run_dir}`")
        else:
            _say(f"rlfunc: interrupted before the run's first snapshot: {e.run_dir} holds its metrics but nothing "
                 "to resume; remove it to train anew")
        return code
    except BrokenPipeError:  # `rlfunc versions list RUN_DIR | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a write outside the snapshot code (TensorBoard's event file, the learning curve, metrics
        # on a full disk, a run dir that is a dangling link ...): one line, not a traceback; written snapshots stay
        _say(f"rlfunc: error: {_rank_prefix()}{type(e).__name__}: {e}")
        return 2
    except Exception as e:  # a rank whose peer died: one line, not the collective's 40-line traceback
        if not _lost_a_peer(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _say(f"rlfunc: rank {os.environ.get('RANK', '?')}: a collective failed, another rank has stopped ({first[:200]})")
        return 1
    finally:
        warnings.formatwarning = default_format


def _rank_prefix() -> str:
    """"rank R: " in a rank of a data-parallel run (torchrun's WORLD_SIZE > 1), so the launcher's
    interleaved lines say whose error each is; "" otherwise."""
    world, rank = os.environ.get("WORLD_SIZE", ""), os.environ.get("RANK", "")
    return f"rank {rank}: " if world.isdigit() and int(world) > 1 and rank.isdigit() else ""


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_line_warning(default_format):
    """rlfunc's own warnings (UserWarning: a resume that starts new episodes, a damaged version passed
    over ...) as one line "rlfunc: warning: ..."; other libraries' warnings keep Python's format."""

    def format_warning(message, category, filename, lineno, line=None):
        if category is UserWarning and str(filename).startswith(_PACKAGE_DIR):
            return f"rlfunc: warning: {message}\n"
        return default_format(message, category, filename, lineno, line)

    return format_warning


def _lost_a_peer(e: Exception) -> bool:
    """Whether ``e``, raised in one of torchrun's ranks, is a collective that failed because another rank
    went away: torch.distributed's DistError, or a backend's connection to it reset or closed (gloo's RuntimeError)."""
    from rlfunc.cli.common import under_torchrun

    if not under_torchrun():
        return False
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in ("Connection reset by peer", "Connection closed by peer"))


if __name__ == "__main__":
    sys.exit(main())

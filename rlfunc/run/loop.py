"""The one run loop every algorithm uses: build -> (restore) -> iterations -> snapshots, versions,
metrics -> final evaluation.

An algorithm's run is a :class:`Run`: built from its config (the ``run`` of its registry entry,
:func:`rlfunc.algos.registry.lookup`), it does one iteration per :meth:`Run.step`, says what a
snapshot holds (:meth:`Run.saved`) and takes it back (:meth:`Run.restore`). Everything around that is
here, once, for every algorithm:

- the run directory: a new run needs an empty or absent one; ``resume`` continues the latest
  snapshot or the current branch's head version, whichever is further along on the branch
  (:func:`resume_source`; after ``rlfunc versions rollback RUN_DIR V`` that is V), with the
  snapshot's config and optionally a new budget (:func:`train`);
- each load is checked against the structure of the freshly built run (``run.saved()``), so a
  snapshot is ``save(state)`` and the structure a load is checked against is ``algo.init(...)``;
- ``config.json``, ``metrics.jsonl`` (+ TensorBoard), a tqdm bar, ``learning_curve.png``;
- snapshots every ``checkpoint_every`` iterations and at the end, versions every ``version_every``
  (:mod:`rlfunc.run.versions`: rollback and diff for every algorithm);
- SIGINT/SIGTERM: a snapshot (and a version) after the current iteration, then stop
  (:class:`StopOnSignal`);
- the final evaluation into ``eval.json`` (:meth:`Run.evaluate`; skipped when a signal stopped it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from tensordict import TensorDict

from rlfunc.config import replace
from rlfunc.device import resolve_device, span
from rlfunc.errors import CheckpointError, ConfigError, RLFuncError, RunInterrupted, SnapshotCorruptError
from rlfunc.run import checkpoint, versions
from rlfunc.run.log import MetricsLogger, plot_learning_curve, to_jsonable
from rlfunc.run.profile import IterationProfiler
from rlfunc.run.resume import (RESUME_FORMAT, STATE_LAYOUT, InterruptOnSignal, StopOnSignal, check_budget, check_budget_covers, check_run_dir,
                               has_loss_scale, has_member_steps, has_shaping_link, no_snapshot_message, truncate_metrics,
                               with_loss_scales, with_member_steps, with_shaping_in_chain)

# the record keys the progress bar shows, when the record has them
SHOWN = ("episode_return", "success_rate", "loss_denoise", "steps_per_s")
KEPT = ("compile_s",)  # shown from the metrics line that has it (the first with a compiled step) to the run's end


class Cadence(NamedTuple):
    """When the loop writes: snapshots every ``checkpoint_every`` iterations (0: only at the end),
    keeping ``keep_checkpoints`` (0: all); versions every ``version_every`` (0: none), retention
    ``version_keep_last`` (0: all) and ``version_keep_every`` (see :func:`rlfunc.run.versions.apply_retention`)."""

    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    version_every: int = 0
    version_keep_last: int = 20
    version_keep_every: int = 0


def cadence(config: Any) -> Cadence:
    """The :class:`Cadence` an algorithm's config asks for: its ``run``'s fields of those names
    (:class:`rlfunc.config.RunConfig`), the defaults for a config without ``run``."""
    run = getattr(config, "run", None)
    return Cadence(**{f: getattr(run, f) for f in Cadence._fields if hasattr(run, f)})


class Run:
    """One algorithm's run, built from its config, as :func:`run_loop` drives it. Subclasses set the
    attributes and override :meth:`step`, :meth:`saved`, :meth:`restore`; the rest is optional. Built
    (by :func:`train`) as ``cls(config, device, *, dist=None, resumed=False)``: ``dist`` the
    :class:`rlfunc.run.distributed.Distributed` of a data-parallel run, ``resumed`` whether a snapshot
    will be loaded into it (so what it holds, e.g. a pretrained actor, need not be read).

    Attributes:
        config: the config it was built from (config.json; snapshots' meta "config").
        state: the learner state TensorDict (``state["iteration"]``: iterations done).
        total: iterations of the whole run (its budget).
        name: the progress bar's label.
        curve: the metrics key learning_curve.png plots.
    """

    config: Any
    state: TensorDict
    total: int
    name: str = "train"
    curve: str = "episode_return"
    data_parallel: bool = False  # trains under torchrun (its constructor uses ``dist``)
    # refuse snapshots without meta "resume_format" (a kind whose early snapshots lacked the RNG / env state)
    requires_format: bool = False
    # top-level snapshot entries whose structure depends on how far the run got (a replay buffer's
    # filled rows ...): left out of the check against the fresh run's; restore checks them
    variable: tuple[str, ...] = ()

    def done(self) -> int:
        """Iterations done (0 for a fresh run, the snapshot's after :meth:`restore`)."""
        return int(self.state["iteration"])

    def logged_step(self) -> int | None:
        """The "step" of the run now, as its metrics lines give it (env steps; bc: updates); None for a
        state without "env_steps" (TensorBoard's points past a resumed run's snapshot then go at its first line)."""
        return int(self.state["env_steps"]) if "env_steps" in self.state.keys() else None

    def step(self, i: int, stopping: bool) -> dict | None:
        """Run iteration ``i`` (1-based); its metrics record ("iteration", "step", ... without "time",
        which the loop adds), or None for an iteration that logs nothing. ``stopping``: a signal came,
        this is the last iteration of this call."""
        raise NotImplementedError

    def saved(self) -> tuple[TensorDict, dict]:
        """(tensors, meta) of a snapshot or version of the run now: the learner state and what else a
        resume needs (env state, replay buffer ...); meta holds at least "algo", "config",
        "iteration", "env_steps" and "state_layout". Of a fresh run, the structure loads are checked against."""
        raise NotImplementedError

    def restore(self, loaded: TensorDict, meta: dict) -> None:
        """Take back what :meth:`saved` gave (``loaded`` checked against it, on the run's device)."""
        raise NotImplementedError

    def upgrade(self, loaded: TensorDict, meta: dict, where: str) -> TensorDict:
        """``loaded`` (read unchecked) of an older state layout (meta "state_layout" absent or < the
        current one), converted to :meth:`saved`'s structure; the loop then checks it. This default
        refuses it.

        Raises:
            CheckpointError: naming ``where``, the layout cannot be converted.
        """
        raise CheckpointError(f"{where}: state_layout={meta.get('state_layout', 1)!r}: this rlfunc reads "
                              f"{meta.get('algo')} state layout {STATE_LAYOUT}; train anew")

    def open(self, run_dir: Path) -> None:
        """Write the run's own files into ``run_dir`` (created, config.json written) before the iterations."""

    def evaluate(self) -> dict | None:
        """The final evaluation (the JSON of eval.json), or None for a run that has none."""
        return None

    def close(self) -> None:
        """Release envs and worker processes."""


@dataclasses.dataclass
class RunResult:
    """What a run returns. ``evaluation``: :meth:`Run.evaluate`'s dict (None when a signal stopped
    the run, or the run has none); ``interrupted``: the signal's name ("SIGINT", "SIGTERM") when one
    stopped it after saving a snapshot, else None."""

    state: TensorDict
    run_dir: Path
    evaluation: dict | None = None
    interrupted: str | None = None

    def __iter__(self):  # (state, run_dir, evaluation, interrupted), as the result tuples it replaces
        return iter((self.state, self.run_dir, self.evaluation, self.interrupted))


# ------------------------------------------------------------------------------ where a resume starts


def resume_source(run_dir: str | Path) -> tuple[str, Path | str] | None:
    """What a resume continues from: ("snapshot", path) or ("version", id), or None if neither.

    The current branch's head version (after a rollback to V with no new version yet: V), unless the
    latest snapshot is on the current branch and at least as far along (a snapshot without a
    "branch" is on "main").

    A latest snapshot whose meta.json cannot be read gives way to the head version, with a warning.

    Raises:
        CheckpointError: a version manifest fails its check.
    """
    snap = checkpoint.latest_snapshot(run_dir)
    head = versions.head(run_dir)
    if head is None:
        return None if snap is None else ("snapshot", snap)
    if snap is not None:
        try:
            meta = checkpoint.load_meta(snap)
        except SnapshotCorruptError as e:  # its meta.json unreadable: which is further along is unknown; the version loads
            warnings.warn(f"{e}: continuing from version {head['id']} (step {head['step']}), the branch's head", stacklevel=2)
            return "version", head["id"]
        same_branch = meta.get("branch", versions.MAIN) == versions.current_branch(run_dir)
        if same_branch and meta.get("env_steps", -1) >= head["step"]:
            return "snapshot", snap
    return "version", head["id"]


def source_meta(run_dir: Path, source: tuple[str, Path | str]) -> tuple[dict, str]:
    """(meta, a name for messages) of ``source`` (:func:`resume_source`)."""
    kind, where = source
    if kind == "snapshot":
        return checkpoint.load_meta(where), str(where)
    return versions.read_manifest(run_dir, where)["meta"], f"{run_dir} version {where}"


def load(run: Run, run_dir: Path, source: tuple[str, Path | str], device) -> tuple[TensorDict, dict]:
    """Read ``source`` into ``run`` (freshly built from the source's config): checked against
    ``run.saved()`` (but for its ``run.variable`` entries), converted first by ``run.upgrade`` when of
    an older state layout. Returns (the loaded tensors, meta).

    Raises:
        CheckpointError: corrupt, of an unknown (newer) layout, or of another structure (the first key
            named); with ``run.requires_format``, without meta "resume_format"; a snapshot directory
            whose step_N name is not its env steps; a state ``run.restore`` cannot take (its env or RNG
            state damaged).
    """
    kind, where = source
    meta, name = source_meta(run_dir, source)
    named = Path(where).name.removeprefix("step_") if kind == "snapshot" else ""
    steps = meta.get("env_steps")  # (a meta without it says nothing to check against)
    if named.isdigit() and isinstance(steps, int) and int(named) != steps:  # the bug: another run's snapshot copied in resumed as that run
        raise CheckpointError(f"{name}: named for step {int(named)} but holds env_steps={steps} (copied from another "
                              "run?); remove it, or resume from another "
                              "snapshot with --snapshot")
    layout = meta.get("state_layout", 1)
    if not isinstance(layout, int) or isinstance(layout, bool) or layout > STATE_LAYOUT:
        raise CheckpointError(f"{name}: state_layout={layout!r}: this rlfunc reads {meta.get('algo')} state layouts up to "
                              f"{STATE_LAYOUT}; it was written by a newer rlfunc")
    if run.requires_format and meta.get("resume_format") != RESUME_FORMAT:
        raise CheckpointError(f"{name}: written before {meta.get('algo')} runs were resumable (no RNG / env state); "
                              "start a new run")
    fresh = run.saved()[0]
    like = fresh.exclude(*run.variable)
    scaled = has_loss_scale(fresh)  # fp16: a snapshot from before the loss scale was state holds bare optimizer states
    shaping = has_shaping_link(fresh)  # a snapshot from before the shaping state was a link holds it beside the chain
    members = has_member_steps(fresh)  # one from before Adam's step counts were per seed holds one count for all
    check = like if layout == STATE_LAYOUT and not run.variable and not scaled and not shaping and not members else None
    if kind == "snapshot":
        loaded, meta = checkpoint.load_snapshot(where, device=device, like=check)
    else:
        loaded, manifest = versions.load_version(run_dir, where, device=device, like=check)
        meta = manifest["meta"]
    if layout < STATE_LAYOUT:
        loaded = run.upgrade(loaded, meta, name)
    if scaled:
        loaded = with_loss_scales(loaded, fresh, meta.get("grad_scaler"))
    if shaping:
        loaded = with_shaping_in_chain(loaded, fresh)
    if members:
        loaded = with_member_steps(loaded, fresh)
    if check is None:
        checkpoint.check_learner(name, loaded.exclude(*run.variable), like)
    checkpoint.check_env_spec(name, meta, getattr(run, "spec", None))  # the env it was trained on (ppo, grpo, sac, td3)
    try:
        run.restore(loaded, meta)
    except (KeyError, IndexError, ValueError, TypeError) as e:  # meta's env or RNG state damaged: was a traceback
        raise CheckpointError(f"{name}: its env, RNG or run state does not fit this run ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from e
    return loaded, meta


# --------------------------------------------------------------------------------------- the loop


def run_loop(run: Run, run_dir: Path, *, when: Cadence, time_offset: float = 0.0, max_iterations: int | None = None,
        progress: bool = True, tensorboard: bool = True, profile: int = 0, device=None, dist=None,
        evaluate: bool = True) -> RunResult:
    """The iterations left of ``run`` (from ``run.done()`` to ``run.total``, at most ``max_iterations``
    of them), with its snapshots, versions and metrics in ``run_dir``, then its final evaluation.

    A snapshot (and, with ``when.version_every``, a version first) is written after the last
    iteration of the call and when a signal stops it; besides, snapshots every
    ``when.checkpoint_every`` and versions every ``when.version_every`` iterations, each cadence
    counted from iteration 0 (a resumed run writes where the uninterrupted one would). A resumed
    run with nothing left writes nothing. With ``profile`` N > 0, N iterations after a warm-up are
    recorded with ``device``'s profiler into ``run_dir/profile`` (:mod:`rlfunc.run.profile`).

    Data-parallel (``dist``, a :class:`rlfunc.run.distributed.Distributed` of W > 1 ranks): every rank
    steps and calls ``run.saved()`` (which gathers the ranks' parts), rank 0 alone writes files, shows
    the bar and evaluates; the ranks agree on a signal's stop after each iteration
    (:meth:`~rlfunc.run.distributed.Distributed.agree_stop`) and compare their learner states at
    each snapshot (:meth:`~rlfunc.run.distributed.Distributed.check_in_sync`).

    Returns:
        :class:`RunResult`; eval.json is written when ``evaluate``, the budget was done and
        ``run.evaluate()`` gives one.
    """
    main = dist is None or dist.is_main
    start = min(run.done(), run.total)
    end = run.total if max_iterations is None else min(run.total, start + max_iterations)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if end > start or not (run_dir / "config.json").exists():  # a new budget is the run's once an iteration has it
            (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(run.config), indent=2))
        if end > start:  # the run goes past the policy an earlier eval.json scored (the bug: an interrupted
            (run_dir / "eval.json").unlink(missing_ok=True)  # final evaluation left it, stale)
        run.open(run_dir)
    logger = MetricsLogger(run_dir, tensorboard=tensorboard, resumed_step=run.logged_step() if run.done() else None) if main else None
    branch = versions.current_branch(run_dir)
    clock = time.perf_counter() - time_offset
    last_record: dict | None = None

    def save(record: dict | None, version: bool, snapshot: bool) -> None:
        with span("checkpoint"):
            _save(record, version, snapshot)

    def _save(record: dict | None, version: bool, snapshot: bool) -> None:
        tensors, meta = run.saved()  # on every rank: it may gather the ranks' parts
        if dist is not None:
            dist.check_in_sync(run.state, f"iteration {meta['iteration']}")
            if not dist.is_main:
                return
        meta = {**meta, "branch": branch}
        step = int(meta["env_steps"])
        if version:  # first: killed between the two, the run keeps the version, and resume_source takes it (newer)
            versions.save_version(run_dir, tensors, meta, iteration=int(meta["iteration"]), step=step,
                                  metrics=None if record is None else to_jsonable(record),
                                  keep_last=when.version_keep_last or None, keep_every=when.version_keep_every)
        if snapshot:
            checkpoint.save_run_snapshot(run_dir, tensors, meta, step=step, keep_last=when.keep_checkpoints or None)

    interrupted = None
    profiler = IterationProfiler(run_dir, profile, resolve_device("cpu" if device is None else device),
                                 rank=0 if dist is None else dist.rank)
    agree = (lambda name: name) if dist is None else dist.agree_stop
    with StopOnSignal() as stop, profiler:
        try:
            from tqdm import tqdm

            kept: dict[str, str] = {}
            shown: dict[str, str] = {}
            with tqdm(total=run.total, initial=start, desc=run.name, dynamic_ncols=True, **_bar_options(progress and main)) as bar, \
                    _warnings_above(bar):
                for i in range(start + 1, end + 1):
                    with span("iteration"):
                        record = run.step(i, stop.signal is not None)
                    if record is not None:
                        record = {**record, "time": time.perf_counter() - clock}
                        if main:
                            logger.log(record)
                        last_record = record
                        if progress and main:  # the postfix only for a bar that is shown
                            kept.update({k: f"{_scalar(record[k]):.3g}" for k in KEPT if k in record})
                            # an iteration in which no episode ended has no return (nan): the bar keeps the last one
                            shown.update({k: f"{v:.3g}" for k in SHOWN if k in record and math.isfinite(v := _scalar(record[k]))})
                            bar.set_postfix({**shown, **kept}, refresh=False)  # shown at the bar's next refresh (its mininterval)
                    bar.update(1)
                    signal_name = agree(stop.signal)  # read once: the loop stops here only after this iteration's final save
                    final = signal_name is not None or i == end
                    version = bool(when.version_every) and (final or i % when.version_every == 0)
                    snapshot = final or (bool(when.checkpoint_every) and i % when.checkpoint_every == 0)
                    if version or snapshot:  # each at its own cadence
                        save(last_record if record is None else record, version, snapshot)
                    profiler.step()
                    if signal_name:
                        interrupted = signal_name
                        break
                else:  # a signal during the last iteration (saved as the final one) still stopped the run
                    interrupted = agree(stop.signal)
        except BaseException:  # the error in flight is the one to report: closing the logger on a full or
            if logger is not None:  # read-only disk failed too, and its error replaced the snapshot's (review pass)
                with contextlib.suppress(Exception):
                    logger.close()
            raise
        if logger is not None:
            logger.close()
    evaluation = None
    if not main:
        return RunResult(run.state, run_dir, None, interrupted)
    plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png", key=run.curve)
    if evaluate and interrupted is None and run.done() >= run.total:
        with InterruptOnSignal() as stop:  # a signal here stops the evaluation: the run is done, its snapshots kept
            try:
                evaluation = run.evaluate()
            except KeyboardInterrupt as e:
                raise RunInterrupted(run_dir, True, evaluating=True, signal=stop.signal) from e
        if stop.signal is not None:  # raised where Python could only print it (the bug: eval.json written, exit 0, or 130)
            raise RunInterrupted(run_dir, True, evaluating=True, signal=stop.signal)
        if evaluation is not None:  # atomic: a full disk left a 0-byte eval.json (review pass)
            checkpoint.write_text_atomic(run_dir / "eval.json", json.dumps(to_jsonable(evaluation)) + "\n")
    return RunResult(run.state, run_dir, evaluation, interrupted)


def _bar_options(shown: bool) -> dict:
    """tqdm's options beyond the defaults: ``disable`` when the bar is not ``shown``; off a terminal (a
    job's log file) a refresh every 30 s, not every 0.1 s (each a "\\r" line: megabytes of log in a long
    run); a notebook's stream (ipykernel loaded) keeps tqdm's default. tqdm's own TQDM_MININTERVAL and
    TQDM_DISABLE (any non-empty value, as tqdm reads it: no bar) in the environment win."""
    if not shown or os.environ.get("TQDM_DISABLE", ""):  # (tqdm reads it at import, and our disable= would override it)
        return {"disable": True}
    tty = getattr(sys.stderr, "isatty", lambda: False)()
    return {} if tty or "ipykernel" in sys.modules or "TQDM_MININTERVAL" in os.environ else {"mininterval": 30.0}


@contextlib.contextmanager
def _warnings_above(bar):
    """Warnings issued while ``bar`` (tqdm) is shown go above it on a line of their own (tqdm.write),
    not glued to the bar's line. A showwarning of someone else's (pytest's, catch_warnings(record=True)) is left alone."""
    shown = warnings.showwarning
    recorded = getattr(getattr(warnings, "_showwarnmsg_impl", None), "__module__", "warnings") != "warnings"  # record=True's log.append
    if bar.disable or recorded or shown is not getattr(warnings, "_showwarning_orig", shown):
        yield
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if file not in (None, sys.stderr):
            return shown(message, category, filename, lineno, file, line)
        bar.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"), file=sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _scalar(value) -> float:
    value = to_jsonable(value)
    if isinstance(value, list):
        value = [v for v in value if v is not None]
        return sum(value) / len(value) if value else float("nan")
    return float("nan") if value is None else float(value)


# ------------------------------------------------------------------------------- a whole run


def train(config, run_dir: str | Path, *, resume: bool = False, total_steps: int | None = None,
          device: str | None = None, max_iterations: int | None = None, evaluate: bool = True,
          progress: bool = True, tensorboard: bool = True, profile: int | None = None) -> RunResult:
    """A whole run of any registered algorithm (:mod:`rlfunc.algos.registry`): check ``run_dir``, on
    resume find the source (:func:`resume_source`) and its config, build the algorithm's
    :class:`Run` (its entry's ``run``), load the source into it, then :func:`run_loop`.

    Args:
        config: a registered algorithm's config (its type picks the algorithm, :func:`rlfunc.algos.registry.name_of`);
            ignored on resume, where the source's algorithm and config are used (may be None then).
        run_dir: output directory; must not already hold a run unless ``resume``.
        resume: continue from the latest snapshot, or from the current branch's head version when that is
            further along (after ``rlfunc versions rollback RUN_DIR V``: V); metrics lines written after
            it are dropped. Exact on CPU for every built-in algorithm.
        total_steps: with ``resume``, a new budget (in the entry's ``unit``, e.g. updates for bc) put in
            its ``budget`` field; it must cover the iterations done. The schedule (lr decay ...) is then
            stretched over it.
        device: with ``resume``, run on this device instead of the config's; a run continues exactly
            only on the device type it ran on (generator states are device-specific).
        max_iterations: run at most this many iterations in this call (e.g. to split a run in parts).
        evaluate: once the budget is done, the run's final evaluation (``config.run.eval_episodes``
            deterministic episodes, :meth:`Run.evaluate`) into RUN_DIR/eval.json and the result.
        progress: a tqdm bar. tensorboard: mirror the metrics to RUN_DIR/tb.
        profile: with ``resume``, iterations of this call to record with the profiler (None: 0); a new
            run's is its ``config.run.profile``. A resumed run does not profile again because its first
            call did (each such call wrote another trace).

    Under torchrun (WORLD_SIZE > 1 in the environment; ``rlfunc train ALGO --nproc N``) the process
    joins the group (:meth:`rlfunc.run.distributed.Distributed.from_env`, the device per local rank)
    and the run trains data-parallel; a Run without ``data_parallel`` is refused there.
    ``config.run.profile`` iterations are recorded with the device's profiler (:mod:`rlfunc.run.profile`).

    Returns:
        :class:`RunResult` (state, run_dir, evaluation, interrupted): evaluation None when ``evaluate``
        is False or a signal (named by interrupted, "SIGINT"/"SIGTERM") stopped the run after a snapshot.

    Raises:
        ConfigError: a bad run dir or config; ``total_steps``/``device`` without ``resume``; a budget
            below what the run has done; a device this machine lacks. EnvError: an env the algorithm
            cannot train. CheckpointError: on resume, no snapshot or version, or one that is corrupt,
            of no registered algorithm or does not fit its config. Nothing is written then.
    """
    if not isinstance(run_dir, (str, os.PathLike)):
        raise ConfigError(f"run_dir={run_dir!r}: expected a path")
    if profile is not None and not resume:
        raise ConfigError(f"profile={profile!r}: is for resume=True; set the config's run.profile instead")
    if profile is not None and (isinstance(profile, bool) or not isinstance(profile, int) or profile < 0):
        raise ConfigError(f"profile={profile!r}: expected None or an int >= 0 (iterations to record)")
    if max_iterations is not None and (isinstance(max_iterations, bool) or not isinstance(max_iterations, int)
                                       or max_iterations < (0 if resume else 1)):
        raise ConfigError(f"max_iterations={max_iterations!r}: expected None or an int >= {0 if resume else 1}"
                          + ("" if resume else " (a new run runs at least one iteration)"))
    run_dir = Path(run_dir)
    check_run_dir(run_dir, resume)
    # one process at a time trains or resumes a run (rank 0 of a data-parallel one holds it for all): a new run's
    # dir is made and locked first, then checked again under the lock (the bug: two `rlfunc train` into one
    # new run dir both ran, their metrics, config and snapshots mixed)
    rank0 = int(os.environ.get("RANK", "0") or 0) == 0
    made = False  # this call created the run dir (and removes it again if it fails before keeping anything)
    if rank0 and not resume:
        try:
            run_dir.mkdir(parents=True)
            made = True
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(f"run_dir={str(run_dir)!r}: cannot create it ({e.strerror or e})") from None
    if rank0 and run_dir.is_dir() and not os.access(run_dir, os.W_OK):  # a read-only file system or directory
        raise ConfigError(f"run_dir={str(run_dir)!r}: not writable")
    held = checkpoint.hold_run_dir(run_dir) if run_dir.is_dir() and rank0 else contextlib.nullcontext()
    holding = False  # a call that made the dir but lost the lock to another leaves the dir to that one
    try:
        with held:
            holding = True
            if not resume and rank0:
                check_run_dir(run_dir, resume)  # another process may have written it before we held it
            if rank0:
                checkpoint.remove_leftovers(run_dir)  # of saves a kill interrupted; none is under way while we hold it
            return _train(config, run_dir, resume, total_steps, device, max_iterations, evaluate, progress, tensorboard, profile)
    except BaseException as e:
        if made and holding and _nothing_kept(run_dir):  # failed before its first iteration: no half-made run dir left
            shutil.rmtree(run_dir, ignore_errors=True)
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, RunInterrupted):  # say so (it said "interrupted" only)
                said = KeyboardInterrupt(f"before the run's first iteration ended; {run_dir} was removed (nothing to resume)")
                said.signal = getattr(e, "signal", None)  # the exit code (130 / 143) reads it
                raise said from e
        elif isinstance(e, KeyboardInterrupt) and not isinstance(e, RunInterrupted) and holding and rank0:
            # a second signal: say whether anything is there to resume (the CLI said "snapshots are kept" of a run with none)
            raise RunInterrupted(run_dir, _resumable(run_dir), signal=getattr(e, "signal", None)) from e
        raise


def resume(run_dir: str | Path, total_steps: int | None = None, *, device: str | None = None, **kwargs) -> RunResult:
    """Continue the run in ``run_dir``, of whichever algorithm: ``train(None, run_dir, resume=True, ...)``
    (``kwargs``: its ``max_iterations``, ``evaluate``, ``progress``, ``tensorboard``, ``profile``). A run that had
    already done its budget runs no iteration and is evaluated again. Raises as :func:`train`."""
    return train(None, run_dir, resume=True, total_steps=total_steps, device=device, **kwargs)


def _resumable(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a snapshot or a version to resume from."""
    try:
        return checkpoint.latest_snapshot(run_dir) is not None or versions.head(run_dir) is not None
    except RLFuncError:
        return True  # one there, damaged: `rlfunc resume` names it


def _nothing_kept(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds nothing of a run: no snapshot, no version, no metrics line."""
    metrics = run_dir / "metrics.jsonl"
    return (checkpoint.latest_snapshot(run_dir) is None and not versions.has_versions(run_dir)
            and not (metrics.is_file() and metrics.stat().st_size > 0))


def _train(config, run_dir: Path, resume, total_steps, device, max_iterations, evaluate, progress, tensorboard,
           profile=None) -> RunResult:
    """:func:`train` after its run-dir checks."""
    from rlfunc.algos import registry

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)  # > 1 under torchrun
    source = None
    if resume:
        source = resume_source(run_dir)
        if source is None:
            raise CheckpointError(no_snapshot_message(run_dir))
        meta, name = source_meta(run_dir, source)
        config = registry.config_from_meta(meta, name)
        entry = registry.lookup(meta["algo"])
        if total_steps is not None:
            check_budget(total_steps, entry.unit)
            config = replace(config, **{entry.budget: total_steps})
        if device is not None:
            resolve_device(device)  # ConfigError for a device this machine lacks, before anything is built
            config = replace(config, device=str(device))
    else:
        if total_steps is not None:
            raise ConfigError(f"total_steps={total_steps!r}: a new budget is for resume=True; set the config's budget instead")
        if device is not None:
            raise ConfigError(f"device={device!r}: is for resume=True; set the config's device instead")
        if config is None:
            raise ConfigError("config=None: expected a registered algorithm's config (None only with resume=True)")
        entry = registry.lookup(registry.name_of(config))
        nproc = getattr(getattr(config, "run", None), "nproc", 1)
        if nproc > 1 and world == 1:
            raise ConfigError(f"run.nproc={nproc}: this call trains in one process; start {nproc} ranks with "
                              f"`rlfunc train ALGO --nproc {nproc} ...` or torchrun (README: data-parallel training)")
    if getattr(getattr(config, "run", None), "nproc", world) != world and (resume or world > 1):
        # the ranks it trains on now (torchrun's, or `rlfunc resume --nproc N`'s): a later `rlfunc resume` starts as many
        config = replace(config, nproc=world)
    build = registry.resolve(entry.run)
    dist = None
    if world > 1:
        if not getattr(build, "data_parallel", False):
            raise ConfigError(f"WORLD_SIZE={world}: {getattr(config, 'name', type(config).__name__)} "
                              "is not data-parallel yet (every other algorithm is): run it in one process")
        from rlfunc.run.distributed import Distributed

        dist = Distributed.from_env(config.run.device)  # the rendezvous: every rank has checked the run dir
        try:
            dist.check_same_config(config)  # nodes started with other flags: one line now, not a drift later
        except BaseException:
            dist.close()
            raise
    device = resolve_device(config.run.device) if dist is None else dist.device
    with warnings.catch_warnings(record=True) as held:  # the build's warnings about a new budget wait for its check
        warnings.simplefilter("always")
        built = build(config, device, dist=dist, resumed=source is not None)
    try:
        time_offset = 0.0
        if source is not None:
            done = meta.get("iteration")
            if isinstance(done, bool) or not isinstance(done, int) or done < 0:
                raise CheckpointError(f"{name}: meta iteration={done!r}: expected an int >= 0")
            if total_steps is not None:  # a budget below what was done: its one line, without the build's warnings
                check_budget_covers(total_steps, built.total, done, meta.get("env_steps", "?"), entry.unit)
        for w in held:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        if source is not None:
            try:
                load(built, run_dir, source, device)  # every rank reads it (multi-node: a shared run dir)
            except SnapshotCorruptError as e:
                head = versions.head(run_dir) if source[0] == "snapshot" else None
                steps = meta.get("env_steps")
                if head is None or head["branch"] != versions.current_branch(run_dir) or not isinstance(steps, int) \
                        or head["step"] < steps:
                    raise  # (a version behind the snapshot: the older snapshots may be further along; the error names them)
                # as when its meta.json is unreadable (resume_source): the branch's head version, intact, goes on
                # (the bug: a truncated state.safetensors was refused though a version of the same step was intact)
                warnings.warn(f"{e}: continuing from version {head['id']} (step {head['step']}), the branch's head", stacklevel=2)
                source = ("version", head["id"])
                load(built, run_dir, source, device)
            if dist is None or dist.is_main:
                time_offset = truncate_metrics(run_dir, built.done(), getattr(getattr(config, "run", None), "log_every", 1))
        return run_loop(built, run_dir, when=cadence(config), time_offset=time_offset, max_iterations=max_iterations,
                        progress=progress, tensorboard=tensorboard, device=device, dist=dist,
                        # of this call: a resumed run's config keeps its first call's (the bug: every resume profiled again)
                        profile=(profile or 0) if source is not None else config.run.profile,
                        evaluate=evaluate)
    finally:
        built.close()
        if dist is not None:
            dist.close()

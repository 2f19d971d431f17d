"""What every resumable run shares: finding the snapshot to continue from, loading it into a freshly
built run, and the iteration loop that writes the snapshots.

A resumable run (:mod:`rlfunc.run.grpo`, :mod:`rlfunc.run.mappo`, :mod:`rlfunc.run.diffusion`,
:mod:`rlfunc.run.ppo_encoder`) is a function ``train_X(config, run_dir, *, resume, total_steps, ...)``:

1. :func:`begin_run` checks the run dir and, on resume, reads the latest snapshot's meta.json: its
   config (the run goes on with the snapshot's config, not the caller's) with a new budget when
   ``total_steps`` is given (:func:`resume_point`);
2. the run is built from that config exactly as a new run would be, then the snapshot is loaded into
   it in place (:func:`restore_learner`, :func:`set_generator_state`), so the optimizer keeps
   stepping the same parameter tensors;
3. :func:`truncate_metrics` drops the metrics lines written after the snapshot (before a crash);
4. :func:`run_iterations` runs the iterations left, saving snapshots at the uninterrupted run's
   cadence, and stops with a snapshot on SIGINT/SIGTERM.

What a snapshot holds (rlfunc.run.checkpoint: ``state.safetensors`` + meta.json): "learner" (the
learner state, its generator states included as uint8 tensors) and "optim" (the optimizer's state),
plus what each run carries between iterations (env state, collection carry, ...); meta
"resume_format" (:data:`RESUME_FORMAT`) marks a snapshot that holds all of it. Two state layouts
(meta "state_layout"):

- 2 (:data:`STATE_LAYOUT`; grpo/gspo, mappo, ppo-encoder): the learner state owns its optimizer, ``state["optim"]``
  (the state of its update chain, rlfunc.optim), which the snapshot keeps as its "optim" entry beside
  the rest of the learner (:func:`learner_entries`); :func:`restore_state` loads it, and converts
  snapshots of layout 1 written by those runs before (:func:`optim_from_layout_1`, which PPO's
  rlfunc.run.ppo uses too);
- 1 (no "state_layout"; bc, dppo, td3-diffusion; ppo-encoder up to aaf3139): "optim" is torch.optim.Adam's state of
  the leaves that have had a gradient, keyed by their index in the optimizer (meta "optim_leaves"
  lists them), restored by :func:`restore_learner`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from rlfunc.device import resolve_device
from rlfunc.errors import CheckpointError, ConfigError
from rlfunc.optim import adam_state_from_torch, load_optimizer_state
from rlfunc.run import checkpoint, versions
from rlfunc.run.log import MetricsLogger, read_metrics

RESUME_FORMAT = 1  # meta["resume_format"]: the snapshot holds every state a resume needs
STATE_LAYOUT = 2  # meta["state_layout"]: the optimizer's state inside the learner state; 1 (no key): torch.optim's, beside it
NO_SNAPSHOT = "no snapshot to resume from (a run writes one every checkpoint_every iterations and at its end)"


# ------------------------------------------------------------------------------------ the run dir


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Check that ``run_dir`` can take a new run (absent or empty), or, with ``resume``, is a directory.

    Raises:
        ConfigError: ``run_dir`` is a file; or, without ``resume``, it holds a run (a snapshot or a
            version: use ``rlfunc resume``) or other files.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir={str(run_dir)!r} exists and is not a directory")
    if resume or not run_dir.exists() or not any(run_dir.iterdir()):
        return
    if checkpoint.latest_snapshot(run_dir) is not None or versions.has_versions(run_dir):
        raise ConfigError(f"run_dir={str(run_dir)!r} already holds a run; use `rlfunc resume {run_dir}` or a new --run-dir")
    raise ConfigError(
        f"run_dir={str(run_dir)!r} is not empty (a run stopped before its first snapshot, or other files); "
        "choose a new --run-dir or remove it"
    )


def truncate_metrics(run_dir: Path, iteration: int) -> float:
    """Drop the lines of RUN_DIR/metrics.jsonl whose "iteration" is past ``iteration`` (written after
    the snapshot a resume starts from, e.g. before a crash), atomically (a temporary file renamed).

    Returns:
        the "time" (s) of the last line kept, so the resumed run's clock continues; 0.0 when none.
    """
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0.0
    kept = [r for r in read_metrics(path) if r.get("iteration", 0) <= iteration]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return float(kept[-1]["time"]) if kept else 0.0


# ------------------------------------------------------------------ what to resume, with which config


class ResumePoint(NamedTuple):
    snapshot: Path  # the snapshot directory
    meta: dict  # its meta.json
    config: Any  # the snapshot's config, with the new budget when one was given


def resume_point(run_dir: str | Path, total_steps: int | None, from_meta: Callable[[dict, Path], Any], *,
                 budget_field: str = "total_steps", num_iterations: Callable[[Any], int] | None = None,
                 unit: str = "env steps", require_format: bool = True) -> ResumePoint:
    """The latest snapshot of ``run_dir``, its meta and its config, ``from_meta(meta, snapshot)``,
    with ``total_steps`` put in the config's ``budget_field`` when given.

    Args:
        total_steps: the new budget (in ``unit``), or None to keep the snapshot's.
        from_meta: the run's config from a snapshot's meta; raises CheckpointError (a snapshot of
            another algorithm, or no valid config).
        num_iterations: iterations a config runs (default: its ``num_iterations`` attribute).
        require_format: refuse a snapshot without meta "resume_format" == :data:`RESUME_FORMAT`.

    Raises:
        CheckpointError: no snapshot in ``run_dir`` (the message names it); a bad meta.json, config
            or "iteration"; with ``require_format``, a snapshot written before this kind of run could
            be resumed.
        ConfigError: ``total_steps`` is not an int >= 1, or gives fewer iterations than the run has done.
    """
    snap = checkpoint.latest_snapshot(run_dir)
    if snap is None:
        raise CheckpointError(f"{run_dir}: {NO_SNAPSHOT}")
    meta = checkpoint.load_meta(snap)
    config = from_meta(meta, snap)
    if require_format and meta.get("resume_format") != RESUME_FORMAT:
        raise CheckpointError(f"{snap}: written before {meta.get('algo')} runs were resumable (no RNG / env state); "
                              "start a new run")
    done = meta.get("iteration")
    if isinstance(done, bool) or not isinstance(done, int) or done < 0:
        raise CheckpointError(f"{snap}: meta.json iteration={done!r}: expected an int >= 0")
    if total_steps is not None:
        check_budget(total_steps, unit)
        config = dataclasses.replace(config, **{budget_field: total_steps})
        count = config.num_iterations if num_iterations is None else num_iterations(config)
        check_budget_covers(total_steps, count, done, meta.get("env_steps", meta.get("step", "?")), unit)
    return ResumePoint(snap, meta, config)


def check_budget(total_steps, unit: str) -> None:
    """ConfigError unless ``total_steps`` (a resumed run's new budget, in ``unit``) is an int >= 1."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ConfigError(f"total_steps={total_steps!r}: expected an int >= 1 (the new budget, in {unit})")


def check_budget_covers(total_steps: int, count: int, done: int, steps, unit: str) -> None:
    """ConfigError if the new budget ``total_steps`` gives ``count`` iterations, fewer than the
    ``done`` (``steps`` in ``unit``) the run has already done."""
    if count < done:
        raise ConfigError(f"total_steps={total_steps}: the run has already done {done} iterations ({steps} {unit}) "
                          f"and this budget gives {count}, fewer than the {done} done; expected a budget of at least that")


def begin_run(run_dir: str | Path, config, config_type: type, *, resume: bool, total_steps: int | None,
              from_meta: Callable[[dict, Path], Any], device: str | None = None,
              **budget) -> tuple[Path, ResumePoint | None, Any]:
    """(run_dir as a Path, what a resumed run continues from or None, the config to run): the checks
    every ``train_X(config, run_dir, *, resume, total_steps)`` makes before it builds anything.

    Args:
        config: the caller's config (ignored on resume: :func:`resume_point`'s is used).
        config_type: what ``config`` must be for a new run.
        device: on resume, the device to run on in place of the snapshot config's ``device``
            (None: keep it); for a new run it must be None (set ``config.device``).
        budget: ``budget_field``, ``num_iterations``, ``unit``, ``require_format`` of :func:`resume_point`.

    Raises:
        ConfigError: a bad ``run_dir`` (:func:`check_run_dir`); for a new run, ``total_steps`` or
            ``device`` given, or ``config`` not a ``config_type``. On resume, as :func:`resume_point`,
            or ``device`` is not a device this machine has (:func:`rlfunc.device.resolve_device`).
    """
    run_dir = Path(run_dir)
    check_run_dir(run_dir, resume)
    if not resume:
        if total_steps is not None:
            raise ConfigError(f"total_steps={total_steps!r}: a new budget is for resume=True; set the config's budget instead")
        if device is not None:
            raise ConfigError(f"device={device!r}: is for resume=True; set the config's device instead")
        if not isinstance(config, config_type):
            raise ConfigError(f"config={config!r}: expected a {config_type.__name__} (None only with resume=True)")
        return run_dir, None, config
    point = resume_point(run_dir, total_steps, from_meta, **budget)
    if device is not None:
        resolve_device(device)  # ConfigError for a device this machine lacks, before anything is built
        point = point._replace(config=dataclasses.replace(point.config, device=str(device)))
    return run_dir, point, point.config


# ------------------------------------------------------------------------- loading into a fresh run


def set_generator_state(generator: torch.Generator, saved: torch.Tensor) -> torch.Generator:
    """Put ``saved`` (a ``generator.get_state()``: a uint8 tensor, on any device) into ``generator``.

    Returns ``generator``. Raises RuntimeError: ``saved`` is not a state of a generator of
    ``generator``'s device type.
    """
    generator.set_state(saved.cpu().clone())  # a fresh CPU tensor: set_state misreads offset views
    return generator


def generator_from_state(saved: torch.Tensor, device: torch.device) -> torch.Generator:
    """A new generator on ``device`` in state ``saved`` (see :func:`set_generator_state`)."""
    return set_generator_state(torch.Generator(device=device), saved)


def optimizer_leaves(optimizer: torch.optim.Optimizer) -> list[int]:
    """Indices (in ``optimizer``'s parameter order) of the parameters it holds state for: those that
    have had a gradient (none before the first step, and never an unused head's)."""
    return sorted(int(i) for i in optimizer.state_dict()["state"])


def optimizer_like(optimizer: torch.optim.Optimizer, indices: list[int], path) -> TensorDict:
    """The structure :func:`rlfunc.optim.optimizer_state` has for Adam state on the parameters
    ``indices`` of ``optimizer`` ({"<i>": {"step", "exp_avg", "exp_avg_sq"}}), to validate a snapshot.

    Raises:
        CheckpointError: naming ``path``, when ``indices`` is not a list of parameter indices.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not isinstance(indices, list) or not all(type(i) is int and 0 <= i < len(params) for i in indices):
        raise CheckpointError(f"{path}: meta optim_leaves={indices!r}: expected indices of the {len(params)} parameter leaves")
    return TensorDict(
        {str(i): {"step": torch.zeros(()), "exp_avg": torch.zeros_like(params[i]), "exp_avg_sq": torch.zeros_like(params[i])}
         for i in indices},
        batch_size=[],
    )


def resume_meta(optimizer: torch.optim.Optimizer) -> dict:
    """The meta.json entries :func:`restore_learner` reads: "resume_format" and "optim_leaves"."""
    return {"resume_format": RESUME_FORMAT, "optim_leaves": optimizer_leaves(optimizer)}


def restore_learner(point: ResumePoint, like: TensorDict, state: TensorDict, optimizer: torch.optim.Optimizer,
                    device: torch.device) -> TensorDict:
    """Load ``point``'s snapshot into a freshly built run: the learner ``state`` in place (its leaves
    stay the optimizer's), Adam's state into ``optimizer``. Returns every tensor of the snapshot.

    Args:
        like: the run's snapshot structure ({"learner": state, ...}); its "optim" is set here from
            meta "optim_leaves" (:func:`optimizer_like`).

    Raises:
        CheckpointError: the snapshot is corrupt, or its keys, shapes or dtypes differ from ``like``'s.
    """
    like["optim"] = optimizer_like(optimizer, point.meta.get("optim_leaves", []), point.snapshot)
    loaded, _ = checkpoint.load_snapshot(point.snapshot, device=device, like=like)
    with torch.no_grad():
        state.update_(loaded["learner"])
    load_optimizer_state(optimizer, loaded["optim"])
    return loaded


# ------------------------------------------------- learner states that own their optimizer (layout 2)


def state_layout(name: str, meta: dict, algo: str) -> int:
    """The state layout of a snapshot or version (meta "state_layout"; 1 when absent).

    Raises:
        CheckpointError: naming ``name``, a layout this rlfunc does not read (written by a newer one).
    """
    layout = meta.get("state_layout", 1)
    if layout not in (1, STATE_LAYOUT):
        raise CheckpointError(f"{name}: state_layout={layout!r}: this rlfunc reads {algo} state layouts 1 and {STATE_LAYOUT}; "
                              "it was written by a newer rlfunc")
    return layout


def optim_from_layout_1(name: str, torch_state: TensorDict, like: TensorDict, params: TensorDict, *,
                        indices: list[int] | None = None, commit: str) -> TensorDict:
    """``like`` (the fresh run's ``state["optim"]``, a chain state holding one Adam state) with the Adam
    part filled from a layout-1 snapshot's torch.optim state ``torch_state`` ({"<i>": {"step", "exp_avg",
    "exp_avg_sq"}} over ``params``' leaves in ``func.leaves`` order; only the ``indices`` that had a
    gradient, None: all). The other links' states keep ``like``'s values (a clip link's last norms: a
    report, read by nothing). :func:`rlfunc.optim.adam_state_from_torch`, with its errors in one line.

    Raises:
        CheckpointError: naming ``name``, the state does not fit ``params``; the message says to train
            anew or to resume with rlfunc of ``commit`` (the last to write that layout for the run).
    """
    try:
        if indices is not None and not isinstance(indices, list):
            raise ValueError(f"leaf indices {indices!r}: expected a list")
        return adam_state_from_torch(torch_state, like, params, indices=indices)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{name}: its optimizer state (state layout 1, torch.optim's) does not fit the run's "
                              f"parameters ({e}); train anew, or resume it with rlfunc of commit {commit}") from e


def learner_entries(state: TensorDict) -> dict[str, TensorDict]:
    """A snapshot's entries for a learner ``state`` that owns its optimizer: "learner" (all of it but
    "optim") and "optim" (the update chain's state), where these runs' snapshots always kept Adam's state."""
    return {"learner": state.exclude("optim"), "optim": state["optim"]}


def state_meta() -> dict:
    """The meta.json entries :func:`restore_state` reads: "resume_format" and "state_layout"."""
    return {"resume_format": RESUME_FORMAT, "state_layout": STATE_LAYOUT}


def restore_state(point: ResumePoint, like: TensorDict, state: TensorDict, device: torch.device, *, algo: str,
                  commit: str) -> TensorDict:
    """Load ``point``'s snapshot into a freshly built run whose learner ``state`` owns its optimizer
    (``state["optim"]``), in place: its parameter leaves stay those the run's policy holds. Returns
    every tensor of the snapshot, "optim" in layout 2.

    Args:
        like: the run's snapshot structure, with :func:`learner_entries` of the fresh ``state``.
        algo: the run's kind, for messages. commit: the last rlfunc that wrote layout 1 for it.

    A snapshot of state layout 1 (no meta "state_layout": torch.optim's state as "optim", for the
    leaves meta "optim_leaves" lists) is converted (:func:`optim_from_layout_1`; the leaves without
    torch.optim state keep the fresh, zero, Adam state, as torch.optim would), then checked as a new one.

    Raises:
        CheckpointError: the snapshot is corrupt, of an unknown layout, or its keys, shapes or dtypes
            differ from ``like``'s; a layout-1 optimizer state that does not fit the run's parameters.
    """
    name = str(point.snapshot)
    if state_layout(name, point.meta, algo) == STATE_LAYOUT:
        loaded, _ = checkpoint.load_snapshot(point.snapshot, device=device, like=like)
    else:
        loaded, _ = checkpoint.load_snapshot(point.snapshot, device=device)
        loaded = upgrade_layout_1(loaded, point.meta, name, like, algo=algo, commit=commit)
        checkpoint.check_learner(name, loaded, like)
    with torch.no_grad():
        state.exclude("optim").update_(loaded["learner"])
        state["optim"].update_(loaded["optim"])
    return loaded


def upgrade_layout_1(loaded: TensorDict, meta: dict, where: str, like: TensorDict, *, algo: str, commit: str) -> TensorDict:
    """``loaded``, a snapshot of state layout 1 (no meta "state_layout": torch.optim's state as "optim",
    for the leaves meta "optim_leaves" lists), with its "optim" converted to the chain state of
    ``like`` (the fresh run's snapshot structure, :func:`learner_entries`): :func:`optim_from_layout_1`;
    the leaves without torch.optim state keep the fresh, zero, Adam state, as torch.optim would.

    Raises:
        CheckpointError: naming ``where``: a snapshot written before ``algo`` runs were resumable (no
            meta "resume_format"), one without an optimizer state, or one that does not fit the run's parameters.
    """
    if meta.get("resume_format") != RESUME_FORMAT:
        raise CheckpointError(f"{where}: written before {algo} runs were resumable (no RNG / env state); start a new run")
    if "optim" not in loaded.keys():
        raise CheckpointError(f"{where}: no optimizer state: a {algo} snapshot of state layout 1 (meta without "
                              "'state_layout') holds one as 'optim'")
    loaded["optim"] = optim_from_layout_1(where, loaded["optim"], like["optim"], like["learner", "params"],
                                          indices=meta.get("optim_leaves", []), commit=commit).to(loaded.device)
    return loaded


# ---------------------------------------------------------- what a run carries between iterations


def env_rng_snapshot(env) -> tuple[dict, dict]:
    """(tensors, meta) holding ``env.rng_state()``: PointReach-v0's (and any torch env's) uint8
    tensor as tensor "env_rng" with meta "env_rng" = "torch", a GymChunkEnv's numpy state (JSON) as
    meta "env_rng". For runs whose rollouts start with a full reset seeded from it, it is all the
    env carries from one iteration to the next."""
    saved = env.rng_state()
    if isinstance(saved, torch.Tensor):
        return {"env_rng": saved}, {"env_rng": "torch"}
    return {}, {"env_rng": saved}


def restore_env_rng(env, loaded: TensorDict, point: ResumePoint) -> None:
    """Put what :func:`env_rng_snapshot` saved back into ``env`` (``env.set_rng_state``); a
    UserWarning (the resumed run's episodes are seeded afresh) when the snapshot holds none.

    Raises:
        CheckpointError: the saved state does not fit ``env``.
    """
    saved = point.meta.get("env_rng")
    if saved == "torch" and "env_rng" in loaded.keys():
        saved = loaded["env_rng"]
    elif not isinstance(saved, dict):
        warnings.warn(
            f"{point.snapshot}: holds no RNG state for the {point.config.env} env, so the resumed run's episodes "
            "are seeded afresh and it is not identical to an uninterrupted one", stacklevel=4,
        )
        return
    try:
        env.set_rng_state(saved)
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{point.snapshot}: the env's RNG state cannot be restored ({e})") from None


def buffer_snapshot(buffer, keep: bool) -> tuple[dict, dict]:
    """(tensors, meta) of a TorchRL replay buffer: tensor "buffer", its filled rows in storage order,
    and meta "buffer" = {"length", "writer": the writer's cursor}; ``keep`` False: meta "buffer" = None."""
    if not keep:
        return {}, {"buffer": None}
    n = len(buffer)
    rows = {"buffer": buffer[torch.arange(n, device=buffer.storage.device)]} if n else {}
    writer = {k: v for k, v in buffer.writer.state_dict().items() if isinstance(v, int) and not isinstance(v, bool)}
    return rows, {"buffer": {"length": n, "writer": writer}}


def restore_buffer(buffer, loaded: TensorDict, point: ResumePoint) -> None:
    """Refill ``buffer`` (empty) with what :func:`buffer_snapshot` saved, at the same storage
    positions, and its writer's cursor; a UserWarning (an empty buffer) when the snapshot holds none.

    Raises:
        CheckpointError: the saved rows or cursor do not fit ``buffer``.
    """
    saved = point.meta.get("buffer")
    if saved is None:
        warnings.warn(
            f"{point.snapshot}: holds no replay buffer (checkpoint_buffer=False, or saved before buffers were), "
            "so the resumed run starts with an empty buffer and is not identical to an uninterrupted one", stacklevel=3,
        )
        return
    try:
        n = int(saved["length"])
        if n:
            rows = loaded["buffer"]
            buffer.extend(TensorDict({k: rows[k] for k in rows.keys()}, batch_size=[n]))
        buffer.writer.load_state_dict(dict(saved["writer"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{point.snapshot}: its replay buffer cannot be restored ({e})") from None


# ------------------------------------------------------------------------------ the iteration loop


def open_run(config, run_dir: Path, tensorboard: bool) -> MetricsLogger:
    """Create ``run_dir`` (once every input has been checked), write its config.json (the config
    actually run: on resume, the snapshot's with the new budget) and open its metrics logger."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    return MetricsLogger(run_dir, tensorboard=tensorboard)


class StopOnSignal:
    """Within the block, SIGINT/SIGTERM only set ``signal`` (its name; the loop then stops and saves);
    a second signal, REPEAT_S or more after the first, raises KeyboardInterrupt (an earlier one is
    a duplicate of the first and ignored). Handlers are installed only in the main thread and
    restored on exit."""

    REPEAT_S = 1.0  # a second signal within this many seconds of the first is taken as a copy of it

    def __init__(self) -> None:
        self.signal: str | None = None
        self._first_at = 0.0
        self._previous: dict = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, _frame) -> None:
        now = time.monotonic()
        if self.signal is not None:
            # a second signal stops now, without the snapshot; but not a copy of the first that came
            # within REPEAT_S (`timeout` sends its signal to the command and then to its process group)
            if now - self._first_at >= self.REPEAT_S:
                raise KeyboardInterrupt
            return
        self.signal, self._first_at = signal.Signals(signum).name, now
        try:
            print(f"rlfunc: {self.signal}: stopping after this iteration with a snapshot (again to quit at once)",
                  file=sys.stderr, flush=True)
        except (RuntimeError, OSError):  # stderr mid-write (a progress bar) when the signal came: the stop still counts
            pass

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def run_iterations(start: int, total: int, desc: str, step, *, logger: MetricsLogger, save, checkpoint_every: int,
                   progress: bool) -> str | None:
    """Run ``step(i, stopping)`` for the iterations i = start + 1 .. total (``start``: those a resumed
    run has done); log the record it returns (None: nothing to log), ``save()`` when i is a multiple
    of ``checkpoint_every`` (the uninterrupted run's cadence; 0: never) and after the last iteration
    run (unless it was just saved; a resumed run with nothing left saves nothing), stop after the
    current iteration on SIGINT/SIGTERM (``stopping`` tells ``step`` one came). ``logger`` is closed.

    Returns:
        the name of the signal that stopped the loop, or None.
    """
    start = min(start, total)
    last = saved = start
    with StopOnSignal() as stop:
        try:
            from tqdm import tqdm

            with tqdm(total=total, initial=start, desc=desc, disable=not progress, dynamic_ncols=True) as bar:
                for i in range(start + 1, total + 1):
                    record = step(i, stop.signal is not None)
                    last = i
                    if record is not None:
                        logger.log(record)
                        shown = {k: record[k] for k in ("success_rate", "loss_denoise") if k in record}
                        bar.set_postfix({k: f"{float(v):.3f}" for k, v in shown.items()})
                    if checkpoint_every and i % checkpoint_every == 0:
                        save()
                        saved = i
                    bar.update(1)
                    if stop.signal:
                        break
        finally:
            logger.close()
        if last != saved or last == 0:
            save()
    return stop.signal

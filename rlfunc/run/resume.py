"""The pieces of resuming that the run loop (:mod:`rlfunc.run.loop`) and each algorithm's Run use:
the run-dir and budget checks, truncating metrics.jsonl after a crash, generator states, the state
layouts and their conversion, what a run carries between iterations (env RNG, replay buffer), and
the stop-on-signal guard.

What a snapshot holds (rlfunc.run.checkpoint: ``state.safetensors`` + meta.json): "learner" (the
learner state, its generator states included as uint8 tensors) and "optim" (the optimizer's state),
plus what each run carries between iterations (env state, collection carry, ...); meta
"resume_format" (:data:`RESUME_FORMAT`) marks a snapshot that holds all of it. Two state layouts
(meta "state_layout"):

- 2 (:data:`STATE_LAYOUT`; every run kind: ppo, grpo/gspo, mappo, ppo-encoder, bc, dppo, td3-diffusion): the learner state owns its
  optimizer, ``state["optim"]`` (the state of its update chain, rlfunc.optim), which the snapshot
  keeps as its "optim" entry beside the rest of the learner (:func:`learner_entries`; PPO keeps it
  inside "learner"; bc's is ``state["optim_actor"]``, dppo's ``state["optim_all"]``, td3-diffusion's
  ``state["optim_critic"]`` and ``state["optim_actor"]``, each a snapshot entry of that name); snapshots of
  layout 1 written by those runs before are converted on load (:func:`upgrade_layout_1`,
  :func:`optim_from_layout_1`; the diffusion runs: :meth:`rlfunc.run.diffusion.DiffusionRun.upgrade`);
- 1 (no "state_layout"; bc, dppo and td3-diffusion up to 8a7709f; ppo-encoder up to aaf3139): "optim_<name>" /
  "optim" is torch.optim.Adam's state of the leaves that have had a gradient, keyed by their index
  in the optimizer (meta "optim_leaves": which).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from rlfunc.algos.shaped import LINK
from rlfunc.errors import CheckpointError, ConfigError
from rlfunc.optim import adam_state_from_torch
from rlfunc.optim.amp import loss_scale_of
from rlfunc.run import checkpoint, versions
from rlfunc.run.log import read_metrics

RESUME_FORMAT = 1  # meta["resume_format"]: the snapshot holds every state a resume needs
STATE_LAYOUT = 2  # meta["state_layout"]: the optimizer's state inside the learner state; 1 (no key): torch.optim's, beside it
NO_SNAPSHOT = "no snapshot to resume from (a run writes one every checkpoint_every iterations and at its end)"


def no_snapshot_message(run_dir: Path) -> str:
    """Why ``run_dir`` (no snapshot, no version) cannot be resumed, and what to do: a run that stopped before
    its first snapshot (its config.json or metrics lines are there) is trained again; any other directory
    is named as not a run."""
    if (run_dir / "config.json").is_file() or (run_dir / "metrics.jsonl").is_file():
        return (f"{run_dir}: {NO_SNAPSHOT}; this run stopped before its first one and cannot be resumed: train it again "
                "with a new --run-dir, or remove this one")
    return f"{run_dir}: {NO_SNAPSHOT}; it holds no run (`rlfunc train ... --run-dir DIR` writes one; resume takes that DIR)"


# ------------------------------------------------------------------------------------ the run dir


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Check that ``run_dir`` can take a new run (absent or empty), or, with ``resume``, is a directory.

    Raises:
        ConfigError: ``run_dir`` is a file; or, without ``resume``, it holds a run (a snapshot or a
            version: use ``rlfunc resume``) or other files.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir={str(run_dir)!r} exists and is not a directory")
    for name in ("metrics.jsonl", "eval.json", "config.json"):  # a directory there was an IsADirectoryError traceback
        if (run_dir / name).exists() and not (run_dir / name).is_file():
            raise ConfigError(f"{run_dir / name}: expected a file, found a directory or another kind; move it away")
    if resume or not run_dir.exists() or not any(run_dir.iterdir()):
        return
    if checkpoint.latest_snapshot(run_dir) is not None or versions.has_versions(run_dir):
        raise ConfigError(f"run_dir={str(run_dir)!r} already holds a run; use `rlfunc resume {run_dir}` or a new --run-dir")
    raise ConfigError(
        f"run_dir={str(run_dir)!r} is not empty (a run stopped before its first snapshot, or other files); "
        "choose a new --run-dir or remove it"
    )


def truncate_metrics(run_dir: Path, iteration: int, every: int = 1) -> float:
    """Drop the lines of RUN_DIR/metrics.jsonl whose "iteration" is past ``iteration`` (written after
    the snapshot a resume starts from, e.g. before a crash), atomically (a temporary file renamed).
    Warns when the lines kept end ``every`` (the run's logging cadence: bc's ``log_every``) or more
    iterations before ``iteration``: a file cut short or emptied, whose lost lines are not run again.

    Returns:
        the "time" (s) of the last line kept, so the resumed run's clock continues; 0.0 when none.
    """
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0.0
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    kept = [r for r in read_metrics(path) if number(r.get("iteration", 0)) and r.get("iteration", 0) <= iteration]
    # a file cut short (or emptied) loses the lines of iterations the resume does not run again: say which
    last = max((r["iteration"] for r in kept if "iteration" in r), default=0)
    if iteration - last >= max(1, every):
        warnings.warn(f"{path}: no lines for iterations {last + 1}-{iteration}, which the resumed snapshot holds (the "
                      "file was cut or emptied); they are not run again, so their metrics are lost there (TensorBoard's "
                      "tb/ keeps the points it has, unless a crash makes a later resume rebuild it from this file)", stacklevel=2)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return float(kept[-1]["time"]) if kept and number(kept[-1].get("time")) else 0.0


# ------------------------------------------------------------------ what to resume, with which config


class ResumePoint(NamedTuple):
    snapshot: Path  # the snapshot directory
    meta: dict  # its meta.json
    config: Any  # the snapshot's config, with the new budget when one was given


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


def _loss_scale_paths(td: TensorDict, path: tuple = ()) -> list[tuple]:
    """The keys of ``td``'s nested :func:`rlfunc.optim.amp.dynamic_loss_scale` states (fp16 optimizers)."""
    if loss_scale_of(td) is not None:
        return [path]
    return [p for k, v in td.items() if isinstance(v, TensorDict) for p in _loss_scale_paths(v, path + (k,))]


def has_loss_scale(like: TensorDict) -> bool:
    """Whether the run whose snapshot structure is ``like`` keeps an fp16 loss scale in its state."""
    return bool(_loss_scale_paths(like))


def with_loss_scales(loaded: TensorDict, like: TensorDict, grad_scaler: dict | None) -> TensorDict:
    """``loaded`` with each optimizer state that ``like`` (the fresh run's snapshot structure) keeps
    inside an fp16 loss scale (:func:`rlfunc.optim.amp.dynamic_loss_scale`) but ``loaded`` holds bare
    wrapped in one. Such snapshots were written before the scale moved into the learner state: their
    scale and growth tracker were a torch.amp.GradScaler's, saved as meta "grad_scaler" by the diffusion
    runs (``grad_scaler``, taken over here) and not at all by ppo-encoder (the initial scale then, as
    that code resumed with)."""
    for path in _loss_scale_paths(like):
        saved = loaded.get(path, None)
        if not isinstance(saved, TensorDict) or loss_scale_of(saved) is not None:
            continue
        wrapped = like.get(path).clone()
        wrapped["inner"] = saved.to(wrapped.device)
        if grad_scaler:
            wrapped["scale"].fill_(float(grad_scaler["scale"]))
            wrapped["growth_tracker"].fill_(int(grad_scaler["_growth_tracker"]))
        loaded.set(path, wrapped)
    return loaded


def _optim_path(td: TensorDict) -> tuple[str, ...] | None:
    """Where a snapshot keeps the update chain's state: "learner" "optim" (ppo) or "optim" (the others)."""
    for path in (("learner", "optim"), ("optim",)):
        if isinstance(td.get(path, None), TensorDict):
            return path
    return None


def has_shaping_link(like: TensorDict) -> bool:
    """Whether the run whose snapshot structure is ``like`` keeps gradient shaping as a link of its
    chain (:func:`rlfunc.algos.shaped.optimizer`)."""
    path = _optim_path(like)
    return path is not None and "transform" in like.get(path).get(LINK, TensorDict()).keys()


def with_shaping_in_chain(loaded: TensorDict, like: TensorDict) -> TensorDict:
    """``loaded``, a snapshot of a shaped ppo, grpo or gspo run from before the shaping state was a link
    of the chain (the learner's "shaping": {"transform", "step"}, Adam's state as the chain's link 1),
    in the layout of ``like`` (the fresh run's snapshot structure); the link's metrics start at
    ``like``'s. Other snapshots are returned as they are."""
    learner = loaded.get("learner", None)
    path = _optim_path(loaded)
    if not has_shaping_link(like) or path is None or not isinstance(learner, TensorDict) or "shaping" not in learner.keys():
        return loaded
    old = learner["shaping"]
    link = like.get(_optim_path(like)).get(LINK).clone()
    link["inner"] = loaded.get(path).get(LINK)
    link["transform"], link["step"] = old["transform"], old["step"]
    loaded.set(path + (LINK,), link)
    loaded["learner"] = loaded["learner"].exclude("shaping")
    return loaded


def _member_count_paths(td: TensorDict, path: tuple = ()) -> list[tuple]:
    """The keys of ``td``'s optimizer step counts kept one per member ([S]): Adam's "step" leaves
    (``adam(member_dims=1)``) and a shaping transform's "count" (:func:`rlfunc.optim.shaping.oscillation_damping`)."""
    keys = set(td.keys())
    if {"step", "exp_avg", "exp_avg_sq"} <= keys and isinstance(td.get("step"), TensorDict):
        return [path + ("step",) + (k if isinstance(k, tuple) else (k,))
                for k, v in td.get("step").items(include_nested=True, leaves_only=True) if v.dim() == 1]
    damping = {"count", "prev_sign", "agreement"} <= keys and isinstance(td.get("count"), torch.Tensor)  # oscillation damping's state
    found = [path + ("count",)] if damping and td.get("count").dim() == 1 else []
    return found + [p for k, v in td.items() if isinstance(v, TensorDict) for p in _member_count_paths(v, path + (k,))]


def has_member_steps(like: TensorDict) -> bool:
    """Whether the run whose snapshot structure is ``like`` keeps optimizer step counts one per seed
    (Adam's with several ppo or grpo seeds; oscillation damping's with gradient shaping)."""
    return bool(_member_count_paths(like))


def with_member_steps(loaded: TensorDict, like: TensorDict) -> TensorDict:
    """``loaded`` with each step count that ``like`` (the fresh run's snapshot structure) keeps one per
    seed ([S]) but ``loaded`` holds as one count for all seeds (0-dim: snapshots written before the
    counts were per seed, which shared them) given to every seed. Other entries are left as they are."""
    for path in _member_count_paths(like):
        saved = loaded.get(path, None)
        if isinstance(saved, torch.Tensor) and saved.dim() == 0:
            loaded.set(path, saved.expand(like.get(path).shape).clone())
    return loaded


def learner_entries(state: TensorDict) -> dict[str, TensorDict]:
    """A snapshot's entries for a learner ``state`` that owns its optimizer: "learner" (all of it but
    "optim") and "optim" (the update chain's state), where these runs' snapshots always kept Adam's state."""
    return {"learner": state.exclude("optim"), "optim": state["optim"]}


def state_meta() -> dict:
    """The meta.json entries :func:`rlfunc.run.loop.load` reads: "resume_format" and "state_layout"."""
    return {"resume_format": RESUME_FORMAT, "state_layout": STATE_LAYOUT}


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


def restore_buffer(buffer, loaded: TensorDict, point: ResumePoint, refill: int = 0) -> bool:
    """Refill ``buffer`` (empty) with what :func:`buffer_snapshot` saved, at the same storage
    positions, and its writer's cursor; a UserWarning (an empty buffer) when the snapshot holds none,
    saying that the run's updates wait for ``refill`` transitions (its warm-up's worth) again.
    Returns whether the snapshot held the buffer.

    Raises:
        CheckpointError: the saved rows or cursor do not fit ``buffer``.
    """
    saved = point.meta.get("buffer")
    if saved is None:
        warnings.warn(
            f"{point.snapshot}: holds no replay buffer (checkpoint_buffer=False, or saved before buffers were), "
            "so the resumed run starts with an empty buffer and is not identical to an uninterrupted one"
            + (f"; its updates wait until the buffer holds {refill} transitions again" if refill > 1 else ""), stacklevel=3,
        )
        return False
    try:
        n = int(saved["length"])
        if n:
            rows = loaded["buffer"]
            buffer.extend(TensorDict({k: rows[k] for k in rows.keys()}, batch_size=[n]))
        buffer.writer.load_state_dict(dict(saved["writer"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{point.snapshot}: its replay buffer cannot be restored ({e})") from None
    return True


# ------------------------------------------------------------------------------ the iteration loop


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
                raise _interrupt(signum)
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



class InterruptOnSignal(StopOnSignal):
    """Within the block SIGINT/SIGTERM raise KeyboardInterrupt at once (Python's SIGINT, for both) and
    are remembered in ``signal`` (its name): a run's final evaluation, where a signal stops the work
    and no snapshot is due. An interrupt raised where Python can only print it (a weakref callback, a
    ``__del__``: "Exception ignored in ...") is still read from ``signal`` after the block, so the
    outcome does not depend on where the signal landed. Main thread only, as :class:`StopOnSignal`."""

    def _handle(self, signum, _frame) -> None:
        self.signal = self.signal or signal.Signals(signum).name
        raise _interrupt(signum)


def _interrupt(signum: int) -> KeyboardInterrupt:
    """A KeyboardInterrupt that names its signal (``.signal``: "SIGINT" / "SIGTERM"), for the exit code."""
    e = KeyboardInterrupt()
    e.signal = signal.Signals(signum).name
    return e

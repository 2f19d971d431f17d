"""Snapshots of a learner's state: safetensors tensors + JSON metadata, written atomically.

One snapshot is a directory::

    step_000000020000/
        state.safetensors   every tensor of the state TensorDict, nested keys joined with "."
        meta.json           format version, library versions, the caller's ``meta`` dict, and for
                            integrity the key -> shape/dtype table, the sha256 of state.safetensors
                            and "record_sha256", that of the record itself (canonical JSON)

A run keeps its snapshots as::

    RUN_DIR/checkpoints/
        step_000000010000/
        step_000000020000/
        latest              text file holding the name of the newest complete snapshot

Nothing here unpickles: tensors are read with ``safetensors.torch.load_file`` and metadata with
``json``, so a snapshot from an untrusted source can at worst fail to load.

Crash safety. ``save_snapshot`` writes into a hidden sibling ``.tmp-<name>-<pid>-<hex>``, fsyncs both
files and that directory, renames it to ``<name>`` (one atomic rename) and fsyncs the parent. Until
that rename nothing new exists under ``<name>``, so a crash leaves no half-written snapshot there, only
a ``.tmp-*`` directory to delete. Over an existing snapshot there is no portable atomic swap of two
directories, so the old one is first renamed to ``.trash-<name>-<pid>-<hex>``, the new one renamed into
place, and only then is the old one deleted. A crash between those two renames leaves ``<name>``
absent with both snapshots complete beside it (old under ``.trash-*``, new under ``.tmp-*``);
``load_snapshot`` then names them so one can be renamed back. An exception (rather than a crash)
undoes the first rename itself. The ``latest`` pointer is replaced with ``os.replace`` of a fully
written, fsynced file, so it only ever names a complete snapshot. ``save_run_snapshot`` writes a new
directory per step, so a run passes through the window above only when a step is saved again (after a
roll-back). One writer per directory: concurrent saves to the same run are not supported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import operator
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors.torch import load_file, save_file
from tensordict import TensorDict, TensorDictBase, is_non_tensor, is_tensor_collection

from rlfunc import __version__
from rlfunc.device import resolve_device
from rlfunc.errors import CheckpointError, ConfigError, SnapshotCorruptError

FORMAT = "rlfunc.snapshot"
FORMAT_VERSION = 1
KNOWN_FORMAT_VERSIONS = (1,)
STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"

CPU_GENERATOR_STATE_BYTES = 5056  # torch.Generator("cpu").get_state().numel(): the mt19937 state
_STEP_DIR = re.compile(r"step_(\d{12,})")
_CHUNK = 1 << 20


# ----------------------------------------------------------------------------------------- public API


@contextlib.contextmanager
def hold_run_dir(run_dir: Path):
    """Hold an exclusive lock on the directory ``run_dir`` itself (an advisory ``fcntl.flock`` on it,
    freed by the kernel when the process ends; nothing is written) for the ``with`` block: a second
    ``rlfunc resume`` of the same run is refused instead of interleaving its snapshots, versions and
    metrics with the first's. A no-op where fcntl does not exist (Windows).

    Raises:
        ConfigError: another process holds it.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(f"run_dir={str(run_dir)!r}: another process is running this run; wait for it to end") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def save_snapshot(path: str | os.PathLike, state: TensorDictBase, meta: Mapping) -> Path:
    """Write ``state`` and ``meta`` as a snapshot directory at ``path``, atomically.

    Args:
        path: the snapshot directory to create or replace. An existing one is replaced only if it
            holds nothing but a snapshot's two files (or nothing at all).
        state: TensorDict of the learner state (params, optimizer state, normaliser statistics, RNG
            states as the uint8 tensors of ``torch.Generator.get_state()`` ...), any batch size, any
            device, any safetensors dtype, 0-dim tensors allowed. Nested keys are joined with ".", so
            a key containing "." is refused; sub-TensorDicts without tensors are not kept; non-tensor
            data (strings ...) belongs in ``meta``. Tensors are copied to the CPU, contiguous.
        meta: JSON-serialisable dict (config, env spec, step counts, RNG states as lists ...): str
            keys; values None, bool, int, float (NaN/inf are written as Python's json writes them),
            str, list, tuple (read back as list) or dict of those.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        CheckpointError: a key contains "." (or is empty, or is "__metadata__"), a leaf is not a
            tensor, a ``meta`` value is not JSON-serialisable (the message names its key), ``path``
            exists and is not a snapshot, or the filesystem failed (the old snapshot, if any, is
            left in place).
    """
    path = Path(path)
    tensors = _cpu_tensors(_flatten(state, "state"))
    meta = _check_meta(meta)
    if os.path.lexists(path):
        _check_replaceable(path)
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot create the parent directory ({_one_line(e)})") from e

    tag = f"{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp, trash = parent / f".tmp-{tag}", parent / f".trash-{tag}"
    moved_old = placed_new = False
    try:
        tmp.mkdir()
        try:
            save_file(tensors, str(tmp / STATE_FILE))
        except Exception as e:  # safetensors raises its own error types and RuntimeError
            raise CheckpointError(f"{path}: safetensors could not write the state ({_one_line(e)})") from e
        digest, size = _sha256(tmp / STATE_FILE, sync=True)
        record = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "rlfunc_version": __version__,
            "torch_version": torch.__version__,
            "safetensors_version": safetensors.__version__,
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "meta": meta,
            "tensors": {
                name: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for name, t in sorted(tensors.items())
            },
            "state_file": {"name": STATE_FILE, "bytes": size, "sha256": digest},
        }
        record["record_sha256"] = record_digest(record)
        _write_synced(tmp / META_FILE, json.dumps(record, indent=1) + "\n")
        _fsync_dir(tmp)
        if os.path.lexists(path):
            os.rename(path, trash)
            moved_old = True
        os.rename(tmp, path)
        placed_new = True
        _fsync_dir(parent)
    except BaseException as e:
        if not placed_new:
            shutil.rmtree(tmp, ignore_errors=True)
            if moved_old:
                try:
                    os.rename(trash, path)
                except OSError:
                    pass  # both stay complete beside path; load_snapshot names them
        if isinstance(e, OSError):
            raise CheckpointError(f"{path}: could not write the snapshot ({_one_line(e)})") from e
        raise
    if moved_old:
        shutil.rmtree(trash, ignore_errors=True)
    return path


def load_snapshot(
    path: str | os.PathLike, *, device: str | torch.device | None = None, like: TensorDictBase | None = None,
    generators: str = "exact",
) -> tuple[TensorDict, dict]:
    """Read and verify a snapshot written by ``save_snapshot``; never unpickles.

    Checks, in order: meta.json parses and has a known format version; state.safetensors has the
    recorded size and sha256; its keys, shapes and dtypes equal the table in meta.json; and, given
    ``like``, equal those of ``like``.

    Args:
        path: the snapshot directory.
        device: where the tensors go ("auto", "cpu", "cuda:1", a torch.device ...); None is the CPU.
        like: a state of the run being resumed (e.g. the output of ``init``); the snapshot must hold
            exactly its keys, with the same shapes and dtypes. Its values are not read, except as below.
        generators: what to do, given ``like``, with random-generator states (:func:`is_generator_state`)
            saved on another device type than ``like``'s (a CPU generator's state is 5056 bytes, a
            CUDA/NPU one's 16, so only their last dim differs): "exact" refuses them (a run continues
            exactly only on the device type it ran on); "fresh" loads ``like``'s values in their place,
            for callers that draw nothing from them (evaluation).

    Returns:
        ``(state, meta)``: the nested TensorDict with batch_size [] on ``device``, and the ``meta``
        dict given to ``save_snapshot``.

    Raises:
        CheckpointError: a one-line message naming the file and the problem: a missing directory or
            file, meta.json that is not valid JSON or not an rlfunc record, an unknown format version,
            a size or sha256 mismatch (truncated or corrupt file), a file safetensors cannot parse, or
            the first key whose shape/dtype differs from meta.json or ``like`` (both sides named); with
            ``generators="exact"``, generator states saved on another device type (the type to resume
            on named).
        ConfigError: ``device`` is not a device this machine has, or ``generators`` is neither
            "exact" nor "fresh".
    """
    if generators not in ("exact", "fresh"):
        raise ConfigError(f"generators={generators!r}: expected 'exact' or 'fresh'")
    path = Path(path)
    record = verify_snapshot(path)
    state_path = path / STATE_FILE
    try:
        tensors = load_file(str(state_path), device="cpu")
    except Exception as e:  # SafetensorError, OSError ...: one line, never a deep traceback
        raise SnapshotCorruptError(f"{state_path}: not a readable safetensors file ({_one_line(e)})") from e

    found = _table(tensors)
    recorded = {name: (spec["shape"], spec["dtype"]) for name, spec in record["tensors"].items()}
    problem = _first_difference(found, recorded, "state.safetensors", "meta.json")
    if problem:
        raise SnapshotCorruptError(f"{state_path}: does not match the table in meta.json: {problem}")
    _check_names(state_path, tensors)
    target = torch.device("cpu") if device is None else resolve_device(device)
    if like is not None:
        _match_like(str(path), tensors, like, "snapshot", "snapshot does not match the structure its config gives "
                    "(an edited meta.json, or another version of the run?)", generators)

    state = TensorDict({}, batch_size=[], device=target)
    for name in sorted(tensors):
        state.set(tuple(name.split(".")), tensors[name].to(target))
    return state, record["meta"]


def verify_snapshot(path: str | os.PathLike) -> dict:
    """Check a snapshot's files without loading its tensors: meta.json parses and has a known
    format version, and state.safetensors has the recorded size and sha256. Returns meta.json's record.

    Raises:
        CheckpointError: as :func:`load_snapshot`, for these checks.
    """
    path = Path(path)
    record = _read_record(path)
    state_path = path / STATE_FILE
    if not state_path.is_file():
        raise SnapshotCorruptError(f"{state_path}: missing; not a complete snapshot")
    try:
        digest, size = _sha256(state_path)
    except OSError as e:
        raise SnapshotCorruptError(f"{state_path}: unreadable ({_one_line(e)})") from e
    want = record["state_file"]
    if size != want["bytes"]:
        raise SnapshotCorruptError(
            f"{state_path}: {size} bytes where meta.json records {want['bytes']}; the file is truncated or corrupt"
        )
    if digest != want["sha256"]:
        raise SnapshotCorruptError(
            f"{state_path}: sha256 mismatch ({digest[:16]}... where meta.json records {want['sha256'][:16]}...); "
            "the file is corrupt or was changed after saving"
        )
    return record


def is_generator_state(name: str) -> bool:
    """Whether snapshot key ``name`` ("."-joined) holds ``torch.Generator`` states (uint8 from
    ``get_state()``), by the library's naming: its last part is "rng" or ends in "_rng". Their
    length depends on the generator's device type (CPU: 5056 bytes, CUDA: 16)."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf == "rng" or leaf.endswith("_rng")


def adopt_generator_states(loaded: TensorDictBase, like: TensorDictBase) -> list[str]:
    """Put ``like``'s values, in place, into the generator-state leaves of ``loaded`` that were saved on
    another device type (:func:`generators_of_another_device`); returns their "."-joined names. For
    loads that draw nothing from them (evaluating a run on another device)."""
    got, want = _flatten(loaded, "loaded"), _flatten(like, "like")
    names = _generators_of_another_device(_table(got), _table(want))
    for name in names:
        loaded.set(tuple(name.split(".")), want[name].detach().to(got[name].device).clone())
    return names


def generators_of_another_device(loaded: TensorDictBase, like: TensorDictBase) -> list[str]:
    """The "."-joined keys, sorted, of the generator-state leaves (:func:`is_generator_state`) of
    ``loaded`` saved on another device type than ``like``'s: uint8 on both sides, the same leading
    dims, another length (CPU: 5056 bytes, CUDA/NPU: 16). Other differences are not counted."""
    return _generators_of_another_device(_table(_flatten(loaded, "loaded")), _table(_flatten(like, "like")))


def check_generator_device(where: str, loaded: TensorDictBase, like: TensorDictBase) -> None:
    """Refuse ``loaded`` if any of its generator-state leaves was saved on another device type than
    ``like``'s (:func:`generators_of_another_device`), as ``load_snapshot(like=...)`` does: for loaders
    that compare structures themselves and continue a run exactly.

    Args:
        where: what was loaded (a snapshot path ...), put first in the message.
        loaded: the loaded (nested) TensorDict. like: the state of the run it goes into.

    Raises:
        CheckpointError: naming ``where``, the keys, and the device type to resume on
            ("--device cpu", or "--device cuda or npu").
    """
    found, like_flat = _table(_flatten(loaded, "loaded")), _flatten(like, "like")
    _refuse_generators_of_another_device(where, _generators_of_another_device(found, _table(like_flat)), found, like_flat)


def check_env_spec(where: str, meta: dict, spec: Any) -> None:
    """CheckpointError unless the env a snapshot was trained on (its meta's "env_spec") is the env
    ``spec`` describes now (an EnvSpec NamedTuple, or None: nothing to check; a meta without one,
    from before it was recorded, passes): a changed action layout of the same size (MultiDiscrete
    [3, 5] registered anew as [4, 4]: the same 8 logits split into other heads) or changed bounds
    loaded, and the actor acted in another layout, silently; a changed size was caught by the shapes."""
    recorded = meta.get("env_spec")
    if not hasattr(spec, "_asdict") or not isinstance(recorded, dict):
        return
    now = json.loads(json.dumps(spec._asdict()))  # the meta's JSON form: tuples as lists
    first = ("action_kind", "nvec", "obs_dim", "act_dim")  # the layout before the bounds it implies
    for key, value in sorted(now.items(), key=lambda kv: first.index(kv[0]) if kv[0] in first else len(first)):
        if key in recorded and recorded[key] != value:
            raise CheckpointError(f"{where}: trained on an env whose {key} was {recorded[key]!r}; env "
                                  f"{(meta.get('config') or {}).get('env', '?')!r} now has {value!r} (its registration "
                                  "changed?): the snapshot's actor would act in another layout; train a new run on this env")


def check_learner(where: str, loaded: TensorDictBase | None, like: TensorDictBase, *,
                  generators: str = "exact") -> TensorDictBase:
    """``loaded`` (a snapshot's learner state; None: the snapshot has none) checked against ``like``
    (the fresh learner state of the run its config builds): the same keys, shapes and dtypes, so
    that ``like.update_(loaded)`` neither fails nor leaves a leaf at its initial value.

    Args:
        where: what was loaded (a snapshot path ...), put first in the message.
        generators: for generator states saved on another device type (:func:`load_snapshot`'s
            argument): "exact" refuses them, after the rest of the structure is checked; "fresh" puts
            ``like``'s values in their place (in ``loaded``), for evaluation.

    Returns:
        ``loaded`` (an empty TensorDict for None).

    Raises:
        CheckpointError: the first (sorted) key that is missing, extra, or of another shape or dtype,
            both sides named; with "exact", generator states of another device type (the type to
            resume on named).
    """
    loaded = TensorDict({}, batch_size=[]) if loaded is None else loaded
    if generators == "fresh":
        adopt_generator_states(loaded, like)
    table = lambda td: {n: (tuple(t.shape), t.dtype) for n, t in _flatten(td, "state").items()}  # noqa: E731
    got, want = table(loaded), table(like)
    other_device = generators_of_another_device(loaded, like)  # named after the rest is checked
    for key in sorted(set(got) | set(want)):
        if key not in other_device and got.get(key) != want.get(key):
            raise CheckpointError(f"{where}: learner key {key!r} is {got.get(key, 'missing')} in the snapshot, "
                                  f"{want.get(key, 'absent')} in the run its config builds")
    check_generator_device(where, loaded, like)
    return loaded


def load_learner_for_eval(snapshot: Path, like: TensorDictBase, device: torch.device) -> TensorDictBase:
    """``like`` (the fresh learner state the run's config builds, on ``device``) holding the learner
    state of ``snapshot``, checked by :func:`check_learner` with generators="fresh" (an evaluation
    draws nothing from them, so a run trained on another device type loads). Raises as those two."""
    loaded, _ = load_snapshot(snapshot, device=device)
    learner = check_learner(str(snapshot), loaded.get("learner", None), like, generators="fresh")
    with torch.no_grad():
        like.update_(learner)
    return like


def _table(flat: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], str]]:
    """{name: (shape as a list, dtype name)}: the form meta.json records and the checks compare."""
    return {name: (list(t.shape), _dtype_name(t.dtype)) for name, t in flat.items()}


def _match_like(where: str, tensors: dict[str, torch.Tensor], like: TensorDictBase, label: str, mismatch: str,
                generators: str) -> None:
    """Check the flat ``tensors`` (a snapshot's or a version's, called ``label``) against ``like``:
    CheckpointError "{where}: {mismatch}: <the first difference>"; generator states saved on another
    device type are refused ("exact") or replaced in ``tensors`` by ``like``'s ("fresh")."""
    found, like_flat = _table(tensors), _flatten(like, "like")
    expected = _table(like_flat)
    other_device = _generators_of_another_device(found, expected)
    problem = _first_difference({**found, **{n: expected[n] for n in other_device}}, expected, label, "the run being loaded")
    if problem:
        raise CheckpointError(f"{where}: {mismatch}: {problem}")
    if generators == "exact":
        _refuse_generators_of_another_device(where, other_device, found, like_flat)
    for name in other_device:
        tensors[name] = like_flat[name].detach().to("cpu").clone()


def _refuse_generators_of_another_device(where: str, names: list[str], found: dict, like_flat: dict) -> None:
    """CheckpointError naming the device type to resume on when ``names`` (generator-state keys whose
    saved length, in the (shape, dtype) table ``found``, is another device type's) is not empty."""
    if not names:
        return
    n = found[names[0]][0][-1]
    ran_on = "cpu" if n == CPU_GENERATOR_STATE_BYTES else "cuda or npu"
    raise CheckpointError(
        f"{where}: its random-generator states ({', '.join(names)}) were saved on another device type than "
        f"{like_flat[names[0]].device.type} ({n} bytes each; a CPU generator's are {CPU_GENERATOR_STATE_BYTES}), "
        f"and a run continues exactly only on the device type it ran on: resume it with --device {ran_on}")


def _generators_of_another_device(found: dict, expected: dict) -> list[str]:
    """Generator-state keys whose (shape, dtype) tables differ only in the last dim, both uint8."""
    names = []
    for name in sorted(set(found) & set(expected)):
        (gs, gd), (ws, wd) = found[name], expected[name]
        if (is_generator_state(name) and gd == wd == "uint8" and len(gs) == len(ws) >= 1 and gs[:-1] == ws[:-1]
                and gs[-1] != ws[-1]):
            names.append(name)
    return names


def load_meta(path: str | os.PathLike) -> dict:
    """The ``meta`` dict of a snapshot, read from meta.json alone (e.g. the config, to build ``like``).

    Checks that meta.json parses and has a known format version; does not read or verify the tensors
    (``load_snapshot`` does).

    Raises:
        CheckpointError: as ``load_snapshot`` for a missing directory or a bad meta.json.
    """
    return _read_record(Path(path))["meta"]


def latest_snapshot(run_dir: str | os.PathLike) -> Path | None:
    """The snapshot to resume ``run_dir`` from: ``RUN_DIR/checkpoints/<name in latest>``.

    Falls back to the complete ``step_<N>`` directory with the largest N when ``latest`` is missing,
    unreadable or names a directory that is absent or lacks a snapshot's files (that last with a
    warning: the snapshot was whole when ``latest`` was written). Cheap: checks that the
    two files exist but not their contents (``load_snapshot`` does).

    Returns:
        The snapshot directory, or None when the run has no complete snapshot.
    """
    ckpt = Path(run_dir) / CHECKPOINTS_DIR
    try:
        name = (ckpt / LATEST_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if _STEP_DIR.fullmatch(name) and _is_complete(ckpt / name):
        return ckpt / name
    for _, candidate in reversed(_step_dirs(ckpt)):
        if _is_complete(candidate):
            if _STEP_DIR.fullmatch(name) and (str(ckpt), name) not in _WARNED:  # 'latest' is written after its
                _WARNED.add((str(ckpt), name))  # snapshot is whole: that one was damaged since (said once, not per call)
                warnings.warn(f"{ckpt / LATEST_FILE} names {name}, which lacks {META_FILE} or {STATE_FILE} (deleted or "
                              f"damaged); using {candidate.name}, the newest complete snapshot", stacklevel=2)
            return candidate
    return None


_WARNED: set[tuple[str, str]] = set()  # (checkpoints dir, the name in its latest) already warned of in this process


def snapshot_to_read(path: str | os.PathLike) -> Path:
    """``path`` itself when it is a snapshot directory (it holds meta.json), else the latest complete
    snapshot of the run dir ``path`` (:func:`latest_snapshot`): what ``rlfunc eval`` reads.

    Raises:
        CheckpointError: neither; the message names ``path``.
    """
    path = Path(path)
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise CheckpointError(f"{path}: {what} (expected a run dir or a snapshot dir)")
    if (path / META_FILE).is_file():
        return path
    snap = latest_snapshot(path)
    if snap is None:
        raise CheckpointError(f"{path}: holds no complete snapshot (train first)")
    return snap


def run_snapshots(run_dir: str | os.PathLike) -> list[Path]:
    """The complete ``step_<N>`` snapshots in ``RUN_DIR/checkpoints``, newest (largest N) first.
    Checks that each has its two files, not their contents."""
    return [p for _, p in reversed(_step_dirs(Path(run_dir) / CHECKPOINTS_DIR)) if _is_complete(p)]


def use_snapshot(run_dir: str | os.PathLike, name: str) -> Path:
    """Point ``RUN_DIR/checkpoints/latest`` at the snapshot ``name`` (e.g. "step_000000008192"), so
    that a resume continues from it: the way back past a newer snapshot that is corrupt. Nothing is
    deleted; the newer snapshots are saved over when the run reaches their steps again.

    Returns:
        The snapshot directory.

    Raises:
        CheckpointError: ``name`` is not a complete snapshot of the run (the message lists those there),
            fails :func:`verify_snapshot`, or ``latest`` could not be written.
    """
    ckpt = Path(run_dir) / CHECKPOINTS_DIR
    if not (_STEP_DIR.fullmatch(name) and _is_complete(ckpt / name)):
        there = ", ".join(p.name for p in run_snapshots(run_dir)) or "none"
        raise CheckpointError(f"snapshot={name!r}: not a complete snapshot in {ckpt} (there: {there})")
    verify_snapshot(ckpt / name)  # a corrupt one is refused here, not passed over for a version further along
    _write_latest(ckpt, name)
    return ckpt / name


def save_run_snapshot(
    run_dir: str | os.PathLike, state: TensorDictBase, meta: Mapping, step: int, keep_last: int | None = 3
) -> Path:
    """Save ``RUN_DIR/checkpoints/step_<step:012d>/``, point ``latest`` at it, prune older snapshots.

    Pruning keeps the ``keep_last`` snapshots with the largest steps and always the one just written
    (after a roll-back that one may be older than snapshots left from the abandoned branch; those
    count as newest until saved over). ``latest`` is updated before pruning, so it never names a
    deleted snapshot. A snapshot that cannot be deleted gives a warning, not an error.

    Args:
        run_dir: the run directory.
        state, meta: as ``save_snapshot``.
        step: environment steps so far, an int >= 0; names the snapshot.
        keep_last: how many snapshots to keep, >= 1; None keeps all.

    Returns:
        The snapshot directory written.

    Raises:
        ConfigError: ``step`` or ``keep_last`` is not an int in range.
        CheckpointError: as ``save_snapshot``, or ``latest`` could not be written.
    """
    try:
        if isinstance(step, bool):
            raise TypeError
        step = operator.index(step)
    except TypeError:
        raise ConfigError(f"step={step!r}: expected an int >= 0 (environment steps so far)") from None
    if step < 0:
        raise ConfigError(f"step={step!r}: expected an int >= 0 (environment steps so far)")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"keep_last={keep_last!r}: expected an int >= 1, or None to keep every snapshot")

    ckpt = Path(run_dir) / CHECKPOINTS_DIR
    name = f"step_{step:012d}"
    path = save_snapshot(ckpt / name, state, meta)
    _write_latest(ckpt, name)
    if keep_last is not None:
        newest = {p.name for _, p in _step_dirs(ckpt)[-keep_last:]}
        for _, old in _step_dirs(ckpt):
            if old.name != name and old.name not in newest:
                try:
                    shutil.rmtree(old)
                except OSError as e:
                    warnings.warn(f"{old}: could not prune old snapshot ({_one_line(e)})", stacklevel=2)
    return path


# ------------------------------------------------------------------------------------------- helpers


def _flatten(state: TensorDictBase, what: str) -> dict[str, torch.Tensor]:
    """Tensor leaves of ``state`` keyed by "."-joined names; refuses keys the join would garble."""
    if not is_tensor_collection(state):
        raise CheckpointError(f"{what} must be a TensorDict, got {type(state).__name__}")
    flat = {}
    for key, value in state.items(include_nested=True, leaves_only=False):
        parts = (key,) if isinstance(key, str) else tuple(key)
        if is_non_tensor(value):
            raise CheckpointError(
                f"{what} key {'.'.join(parts)!r} holds non-tensor data; snapshots store tensors only, put it in meta"
            )
        if is_tensor_collection(value):
            continue
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{what} key {'.'.join(parts)!r} holds a {type(value).__name__}, not a tensor")
        for part in parts:
            if "." in part or not part:
                raise CheckpointError(
                    f"{what} key {parts!r}: a key part {part!r} is empty or contains '.', which snapshots use "
                    "to join nested keys; rename it"
                )
        name = ".".join(parts)
        if name == "__metadata__":
            raise CheckpointError(f"{what} key '__metadata__' is reserved by safetensors; rename it")
        flat[name] = value
    return flat


def _check_names(path: Path, tensors: dict) -> None:
    """SnapshotCorruptError for names ``save_snapshot`` never writes: an empty part ("a..b", "a.")
    or one name inside another ("x" beside "x.y"); a crafted file loaded them into empty keys, or
    failed with tensordict's KeyError."""
    names = set(tensors)
    for name in sorted(names):
        parts = name.split(".")
        if not all(parts):
            raise SnapshotCorruptError(f"{path}: tensor name {name!r} has an empty part; not written by rlfunc")
        for i in range(1, len(parts)):
            if ".".join(parts[:i]) in names:
                raise SnapshotCorruptError(f"{path}: tensor {'.'.join(parts[:i])!r} is also a prefix of {name!r}; "
                                           "not written by rlfunc")


def _cpu_tensors(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors, each owning all of its own storage (safetensors refuses shared
    storage, e.g. tied weights or one member of a stacked ensemble)."""
    seen: set[int] = set()
    out = {}
    for name, t in flat.items():
        if t.layout != torch.strided:
            raise CheckpointError(f"state key {name!r}: layout {t.layout} is not supported; convert to dense")
        t = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        owns_all = t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
        if not owns_all or (ptr and ptr in seen):
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out[name] = t
    return out


def _check_meta(meta: Mapping) -> dict:
    if not isinstance(meta, Mapping):
        raise CheckpointError(f"meta must be a dict, got {type(meta).__name__}")
    meta = dict(meta)
    try:
        _check_json(meta, "meta", set())
        json.dumps(meta)  # what the walk does not see: an int past Python's 4300-digit str limit (a raw ValueError)
    except (ValueError, RecursionError) as e:  # nested thousands deep: a RecursionError
        raise CheckpointError(f"meta cannot be written as JSON: {_one_line(e)}") from None
    return meta


def _check_json(value, where: str, open_containers: set[int]) -> None:
    """Raise CheckpointError naming the first value under ``where`` that JSON cannot round-trip."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple, dict)):
        if id(value) in open_containers:
            raise CheckpointError(f"{where} contains itself; JSON cannot store a cycle")
        open_containers.add(id(value))
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise CheckpointError(
                        f"{where} has key {k!r} of type {type(k).__name__}; JSON object keys must be str"
                    )
                _check_json(v, f"{where}[{k!r}]", open_containers)
        else:
            for i, v in enumerate(value):
                _check_json(v, f"{where}[{i}]", open_containers)
        open_containers.discard(id(value))
        return
    if isinstance(value, torch.Tensor):
        hint = "; use .tolist(), or put it in the state"
    elif type(value).__module__ == "numpy":
        hint = "; use .item() or .tolist()"
    elif dataclasses.is_dataclass(value):
        hint = "; use dataclasses.asdict()"
    elif isinstance(value, (os.PathLike, torch.device, torch.dtype)):
        hint = "; use str()"
    elif isinstance(value, (set, frozenset)):
        hint = "; use sorted(list(...))"
    else:
        hint = ""
    kind = type(value).__qualname__
    if type(value).__module__ != "builtins":
        kind = f"{type(value).__module__}.{kind}"
    raise CheckpointError(f"{where} has type {kind}, which JSON cannot store{hint}")


def _check_replaceable(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(f"{path}: exists and is not a snapshot directory; refusing to replace it")
    others = sorted(set(os.listdir(path)) - {STATE_FILE, META_FILE})
    if others:
        raise CheckpointError(
            f"{path}: exists and holds files a snapshot does not ({', '.join(others[:3])}); refusing to replace it"
        )


def _read_record(path: Path) -> dict:
    """The parsed, structurally checked meta.json of the snapshot at ``path``."""
    if not path.is_dir():
        if path.exists():
            raise CheckpointError(f"{path}: not a snapshot directory (it is a file)")
        raise CheckpointError(f"{path}: no snapshot here (directory missing){_leftover_hint(path)}")
    meta_path = path / META_FILE
    try:
        text = meta_path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise SnapshotCorruptError(f"{meta_path}: missing; not a complete snapshot") from e
    except (OSError, UnicodeDecodeError) as e:
        raise SnapshotCorruptError(f"{meta_path}: unreadable ({_one_line(e)})") from e
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise SnapshotCorruptError(f"{meta_path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    except RecursionError as e:
        raise SnapshotCorruptError(f"{meta_path}: not valid JSON (nested too deeply)") from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise SnapshotCorruptError(f'{meta_path}: not an rlfunc snapshot record (no "format": "{FORMAT}")')
    version = record.get("format_version")
    if version not in KNOWN_FORMAT_VERSIONS:
        raise CheckpointError(
            f"{meta_path}: format_version {version!r} is unknown to rlfunc {__version__} "
            f"(it reads {', '.join(map(str, KNOWN_FORMAT_VERSIONS))}); upgrade rlfunc"
        )
    tensors, state_file = record.get("tensors"), record.get("state_file")
    well_formed = (
        isinstance(record.get("meta"), dict)
        and isinstance(tensors, dict)
        and all(
            isinstance(spec, dict)
            and isinstance(spec.get("dtype"), str)
            and isinstance(spec.get("shape"), list)
            and all(isinstance(n, int) and not isinstance(n, bool) for n in spec["shape"])
            for spec in tensors.values()
        )
        and isinstance(state_file, dict)
        and isinstance(state_file.get("sha256"), str)
        and isinstance(state_file.get("bytes"), int)
    )
    if not well_formed:
        raise SnapshotCorruptError(f"{meta_path}: malformed record (meta, tensors or state_file missing or mistyped)")
    # a record written before the digest (none) is read as it is
    if "record_sha256" in record and record["record_sha256"] != record_digest(record):
        raise SnapshotCorruptError(f"{meta_path}: its record_sha256 does not match its contents (edited or corrupt: the "
                                   "config, step counts or env state it holds cannot be trusted)")
    return record


def record_digest(record: Mapping) -> str:
    """sha256 of a meta.json record without its "record_sha256", as canonical JSON (sorted keys,
    no spaces): the digest :func:`save_snapshot` writes and every read checks. The bug it closes: a
    one-character edit of meta.json (an lr, gamma, an env's state) resumed silently with it."""
    body = {k: v for k, v in record.items() if k != "record_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _first_difference(got: dict, want: dict, got_label: str, want_label: str) -> str | None:
    """The first key (sorted) whose (shape, dtype) differs between two tables, described; None if equal."""
    differing = [n for n in sorted(set(got) | set(want)) if got.get(n) != want.get(n)]
    if not differing:
        return None
    name = differing[0]
    if name not in want:
        text = f"key {name!r} is in the {got_label} but not in {want_label}"
    elif name not in got:
        text = f"key {name!r} is in {want_label} but not in the {got_label}"
    else:
        (gs, gd), (ws, wd) = got[name], want[name]
        text = f"key {name!r}: {got_label} has shape {gs} {gd}, {want_label} has shape {ws} {wd}"
    if len(differing) > 1:
        text += f" ({len(differing)} keys differ in all)"
    return text


def _leftover_hint(path: Path) -> str:
    """Names of hidden siblings an interrupted ``save_snapshot`` of ``path`` left behind, if any."""
    try:
        names = sorted(
            e.name
            for e in os.scandir(path.parent)
            if e.is_dir(follow_symlinks=False)
            and (e.name.startswith(f".tmp-{path.name}-") or e.name.startswith(f".trash-{path.name}-"))
        )
    except OSError:
        return ""
    if not names:
        return ""
    return (
        f"; an interrupted save left {', '.join(names)} beside it (.trash-* is the previous snapshot; "
        f"load_snapshot verifies either) -- rename a good one to {path.name!r}"
    )


def remove_leftovers(run_dir: str | os.PathLike) -> list[str]:
    """Delete what interrupted saves left in RUN_DIR/checkpoints and nothing needs: ``.tmp-latest-*``
    pointer files; ``.tmp-<name>-*`` directories that never got their meta.json (half written) or
    whose ``<name>`` is complete; ``.trash-<name>-*`` beside a complete ``<name>``. A complete
    ``.tmp-`` / ``.trash-`` of a missing ``<name>`` stays (the crash between the two renames:
    :func:`load_snapshot` names it). Call it holding the run dir (:func:`hold_run_dir`): no save is
    under way then. Returns the names removed. The bug: after SIGKILLs the leftovers stayed for good,
    hundreds of MB each for a snapshot with a replay buffer."""
    ckpt = Path(run_dir) / CHECKPOINTS_DIR
    try:
        entries = list(os.scandir(ckpt))
    except OSError:
        return []
    removed = []
    for e in entries:
        if e.name.startswith(f".tmp-{LATEST_FILE}-") and e.is_file(follow_symlinks=False):
            Path(e.path).unlink(missing_ok=True)
        elif e.name.startswith((".tmp-", ".trash-")) and e.is_dir(follow_symlinks=False):
            target = e.name.partition("-")[2].rsplit("-", 2)[0]  # .tmp-<name>-<pid>-<hex>
            half = e.name.startswith(".tmp-") and not (Path(e.path) / META_FILE).is_file()
            if not (half or _is_complete(ckpt / target)):
                continue  # a lone complete copy: the crash window, kept
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            continue
        removed.append(e.name)
    return removed


def _step_dirs(ckpt: Path) -> list[tuple[int, Path]]:
    """The ``step_<N>`` directories under ``ckpt``, sorted by N."""
    try:
        entries = list(os.scandir(ckpt))
    except OSError:
        return []
    found = []
    for e in entries:
        m = _STEP_DIR.fullmatch(e.name)
        if m and e.is_dir(follow_symlinks=False):
            found.append((int(m.group(1)), ckpt / e.name))
    return sorted(found)


def _is_complete(path: Path) -> bool:
    return (path / META_FILE).is_file() and (path / STATE_FILE).is_file()


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holding ``text``, whole or not at all: written to a temporary file beside it, synced,
    then renamed over it; the temporary file is removed when a write fails (OSError, re-raised)."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        _write_synced(tmp, text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _write_latest(ckpt: Path, name: str) -> None:
    tmp = ckpt / f".tmp-{LATEST_FILE}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        _write_synced(tmp, name + "\n")
        os.replace(tmp, ckpt / LATEST_FILE)
        _fsync_dir(ckpt)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{ckpt / LATEST_FILE}: could not update the pointer ({_one_line(e)})") from e


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (POSIX; a no-op where directories cannot be opened)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path, *, sync: bool = False) -> tuple[str, int]:
    """(hex sha256, size in bytes) of a file, read in chunks; ``sync`` also fsyncs it."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb+" if sync else "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest(), size


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0].strip()}" if lines else type(e).__name__

"""Versioned training state: a content-addressed blob store with one JSON manifest per version.

Layout::

    RUN_DIR/versions/
        packs/<sha256>.safetensors   the tensors a version added, each under its blob hash
                                     sha256(dtype | shape | raw bytes): a tensor that did not change
                                     between versions is stored once, in the pack of the version that
                                     first had it; the file name is the sha256 of the file. A tensor of
                                     more than BLOCK_ROWS rows outside the parameters (a replay buffer's
                                     key) is stored as row blocks, "key..0", "key..1" ..., so that a
                                     version adds only the blocks that changed
        manifests/v000012.json       one version: id, parent, branch, iteration, step, created time,
                                     tensor key -> blob hash/pack/shape/dtype, the caller's meta (config, env
                                     id/spec/wrappers, seeds, env RNG states ...), a metrics summary, the
                                     per-layer relative change against the parent, and its own sha256
        branches/<name>.json         a branch made by ``rollback``: its base version; "main" is implicit
        pinned/<id>                  an empty file: retention never deletes that version
        HEAD                         the branch new versions go to (absent: "main")

There is no index file: listings, branch heads and the next id are derived from the manifests, so
there is nothing to get out of step with them.

One pack per version rather than one file per tensor: each file costs an fsync, and with the ~60
small tensors of a Pendulum PPO state that made a version 10x slower to write than a single-file
snapshot (bench/versions.py). A pack stays until no kept version names a blob in it, so an old pack
can outlive its version for the few tensors later versions still share.

Crash safety (SIGKILL at any instant). Every file is written as a hidden ``.tmp-<pid>-<hex>`` sibling,
fsynced, and ``os.replace``d into its name; then the directory is fsynced. The pack goes first, the
manifest last, so a manifest only ever names complete packs, and a version exists exactly when its
manifest does. A crash leaves at most ``.tmp-*`` files (deleted when a writer next opens the store, if
their process is gone) and packs no manifest names (garbage-collected). Retention deletes manifests
before packs, so no manifest ever names a deleted pack. Reading verifies the manifest's sha256 and
every blob's content hash. One writer per run directory (the trainer); readers (the CLI) may run
alongside it.

Nothing unpickles: packs are read with ``safetensors.safe_open`` and manifests with ``json``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import re
import secrets
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save
from tensordict import TensorDict, TensorDictBase

from rlfunc.run.checkpoint import (
    _check_meta,
    _cpu_tensors,
    _dtype_name,
    _flatten,
    _fsync_dir,
    _match_like,
    _one_line,
    hold_run_dir,
)
from rlfunc.config import RUN_FIELDS
from rlfunc.device import resolve_device
from rlfunc.errors import CheckpointError, ConfigError

VERSIONS_DIR = "versions"
FORMAT = "rlfunc.version"
FORMAT_VERSION = 2  # 1: one file per blob (never released)
MAIN = "main"
PARAMS_PREFIX = "learner.params."  # keys whose per-layer change is tracked (the trainer's layout)
BLOCK_ROWS = 4096  # a 2-D (or wider) tensor of more rows outside the parameters (a replay buffer's key) is stored in blocks of this many
BLOCK_SEP = ".."  # "buffer.reward..3": block 3 of "buffer.reward" (a name snapshots never hold: an empty key part)

_ID = re.compile(r"v(\d{6,})")
_BLOB = re.compile(r"[0-9a-f]{64}")
_BRANCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


# ------------------------------------------------------------------------------------------ hashing


def tensor_hash(t: torch.Tensor) -> str:
    """sha256 (hex) of ``dtype | shape | raw bytes`` of a CPU tensor: its blob name."""
    t = t.detach().to("cpu")
    h = hashlib.sha256(f"{_dtype_name(t.dtype)}|{list(t.shape)}|".encode())
    if t.numel():
        flat = t.reshape(-1)
        if flat.stride() != (1,):  # a strided view, or a one-element slice ("contiguous" with any stride): view() refuses it
            flat = torch.empty(t.numel(), dtype=t.dtype).copy_(flat)
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _row_blocks(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each 2-D or wider one of more than BLOCK_ROWS rows outside the parameters split into blocks of
    BLOCK_ROWS rows (views), named ``name..0``, ``name..1`` ... A replay buffer's key is one tensor of every
    filled row, which changes each iteration: whole, each version stored the buffer anew (the storage grew
    with the square of the run's length); in blocks, a version stores the blocks its iteration wrote."""
    out = {}
    for name, t in tensors.items():
        if name.startswith(PARAMS_PREFIX) or t.dim() < 2 or t.shape[0] <= BLOCK_ROWS:  # rows of features: not a 1-D rng state
            out[name] = t
        else:
            for i, block in enumerate(t.split(BLOCK_ROWS)):
                out[f"{name}{BLOCK_SEP}{i}"] = block
    return out


def _joined_blocks(stored: Mapping[str, torch.Tensor], version: str) -> dict[str, torch.Tensor]:
    """:func:`_row_blocks` undone: each ``name..i`` series concatenated in block order.

    Raises:
        CheckpointError: a series with a gap, or blocks that do not concatenate (a damaged manifest)."""
    out, series = {}, {}
    for key, t in stored.items():
        name, sep, index = key.rpartition(BLOCK_SEP)
        if sep and index.isdigit():
            series.setdefault(name, {})[int(index)] = t
        else:
            out[key] = t
    for name, blocks in series.items():
        if sorted(blocks) != list(range(len(blocks))) or name in out:
            raise CheckpointError(f"{version}: the blocks of {name!r} are {sorted(blocks)}, expected 0..{len(blocks) - 1}")
        try:
            out[name] = torch.cat([blocks[i] for i in range(len(blocks))])
        except RuntimeError as e:
            raise CheckpointError(f"{version}: the blocks of {name!r} do not fit together ({_one_line(e)})") from None
    return out


def relative_change(old: torch.Tensor, new: torch.Tensor) -> float:
    """``||new - old|| / ||old||`` (Frobenius norms over all elements, seeds included), in float32.

    0.0 when both norms are 0; ``inf`` when ``old`` is all zeros and ``new`` is not (e.g. a bias
    initialised to zero).
    """
    a, b = old.detach().float(), new.detach().float()
    num, den = float(torch.linalg.vector_norm(b - a)), float(torch.linalg.vector_norm(a))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# ------------------------------------------------------------------------------------------ writing


def save_version(
    run_dir: str | os.PathLike,
    state: TensorDictBase,
    meta: Mapping,
    *,
    iteration: int,
    step: int,
    metrics: Mapping | None = None,
    keep_last: int | None = None,
    keep_every: int = 0,
) -> dict:
    """Write ``state`` as a new version on the current branch (parent: that branch's head).

    Args:
        run_dir: the run directory; ``RUN_DIR/versions`` is created if needed.
        state: TensorDict of the whole training state (as ``checkpoint.save_snapshot`` takes it).
            Tensors under ``learner.params`` get a per-layer relative change against the parent.
        meta: JSON-serialisable dict (config, env spec and state, seeds ...), stored in the manifest.
        iteration: training iterations done, int >= 0. step: environment steps done, int >= 0.
        metrics: JSON-serialisable summary of the iteration (losses, returns ...), or None.
        keep_last, keep_every: retention, applied after the write (see ``apply_retention``); None
            keeps every version.

    Returns:
        The manifest written (a dict; its "id" is the new version id).

    Raises:
        CheckpointError: a state key or meta value cannot be stored, or the filesystem failed.
        ConfigError: ``iteration``/``step``/``keep_last``/``keep_every`` out of range.
    """
    for name, value in (("iteration", iteration), ("step", step), ("keep_every", keep_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name}={value!r}: expected an int >= 0")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"keep_last={keep_last!r}: expected an int >= 1, or None to keep every version")
    meta = _check_meta(meta)
    metrics = _check_meta(metrics or {})
    tensors = _cpu_tensors(_flatten(state, "state"))
    stored_as = _row_blocks(tensors)  # what the packs hold: a replay buffer's rows in blocks, so unchanged ones are shared
    root = _root(run_dir)
    for sub in ("packs", "manifests"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    _clean_temps(root)
    manifests = _manifests(root, cached=True, skip_bad=[], warn=False)  # the run warned when it started (head)
    packs_of: dict[str, set[str]] = {}
    for m in manifests.values():
        for spec in m["tensors"].values():
            packs_of.setdefault(spec["blob"], set()).add(spec["pack"])
    # a blob is reused only from a pack that opens and holds it: a truncated pack (the bug) was reused by
    # every later version, which then could not be loaded either; its blobs are stored anew instead
    readable = {pack: _pack_keys(root, pack) for packs in packs_of.values() for pack in packs}
    stored = {}
    for blob, packs in packs_of.items():
        held = sorted(p for p in packs if blob in readable[p])
        checked = [p for p in held if (str(root), p, blob) in _VERIFIED]
        if held:
            stored[blob] = (checked or held)[0]

    table, new = {}, {}
    for name, t in sorted(stored_as.items()):
        digest = tensor_hash(t)
        table[name] = {"blob": digest, "pack": stored.get(digest), "shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
    # a reused blob is read back once per process: a flipped bit in a pack spread to every later version that
    # shared the blob (replay-buffer blocks are shared for the whole run), each then unloadable; stored anew instead
    if len(_VERIFIED) >= _VERIFIED_SIZE:  # bounded, as the manifest cache: a long run reads its blobs back once more
        _VERIFIED.clear()
    unchecked = {n: spec for n, spec in table.items() if spec["pack"] is not None and (str(root), spec["pack"], spec["blob"]) not in _VERIFIED}
    damaged = _damaged(root, unchecked)
    for name, spec in unchecked.items():
        if name in damaged:
            warnings.warn(f"blob {spec['blob'][:16]}... (pack {_pack_path(root, spec['pack'])}), key {name!r}: content hash "
                          "mismatch; the pack is corrupt, so this version stores the tensor anew", stacklevel=2)
            spec["pack"] = None
        else:
            _VERIFIED.add((str(root), spec["pack"], spec["blob"]))
    for name, spec in table.items():
        if spec["pack"] is None:
            t = stored_as[name]
            new[spec["blob"]] = t.clone() if t._base is not None else t  # a block is a view; a pack's tensors own their storage
    written_bytes = 0
    if new:
        data = st_save(new)
        pack = hashlib.sha256(data).hexdigest()
        written_bytes = _atomic_write(_pack_path(root, pack), data)
        _VERIFIED.update((str(root), pack, blob) for blob in new)
        for spec in table.values():
            if spec["pack"] is None:
                spec["pack"] = pack

    number = max((_id_number(v) for v in _version_ids(root)), default=0) + 1  # a damaged manifest's id is never reused
    vid = f"v{number:06d}"
    branch = current_branch(run_dir)
    parent = _head(root, branch, manifests)
    layer_change = {}
    if parent is not None:
        old = manifests[parent]["tensors"]
        tracked = [n for n, spec in table.items() if n.startswith(PARAMS_PREFIX) and n in old and old[n]["shape"] == spec["shape"]]
        try:
            previous = _read_blobs(root, {n: old[n] for n in tracked if old[n]["blob"] != table[n]["blob"]}, parent)
        except CheckpointError as e:  # only this statistic needs the parent's tensors: a damaged parent blob stopped
            # every later resume here, after its first iteration, even from an intact snapshot
            warnings.warn(f"{e}: version {vid} records no per-layer change against it "
                          f"(`rlfunc versions rollback RUN_DIR V` to an intact version leaves it behind)", stacklevel=2)
            tracked, previous = [], {}
        for name in tracked:
            layer_change[name] = relative_change(previous[name], tensors[name]) if name in previous else 0.0
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "id": vid,
        "parent": parent,
        "branch": branch,
        "iteration": iteration,
        "step": step,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        "meta": meta,
        "metrics": metrics,
        "layer_change": layer_change,
        "tensors": table,
        "written": {"blobs": len(new), "bytes": written_bytes},
    }
    record["manifest_sha256"] = _record_hash(record)
    _atomic_write(root / "manifests" / f"{vid}.json", (json.dumps(record) + "\n").encode())
    if keep_last is not None or keep_every:  # quiet about a damaged manifest: the run warned when it started (head)
        apply_retention(run_dir, keep_last=keep_last, keep_every=keep_every, warn=False)
    return record


def rollback(run_dir: str | os.PathLike, version: str, *, branch: str | None = None) -> str:
    """Start a new branch at ``version`` and make it current: training resumed afterwards continues
    from ``version``; its versions carry the new branch name (the first one has parent ``version``).
    Nothing is deleted; ``version`` is pinned so that retention keeps it, and RUN_DIR/metrics.jsonl
    (which the resume cuts back to ``version``'s iteration) is copied first to
    ``versions/branches/<branch>.previous-metrics.jsonl``. A ``version`` of another branch than the
    current one brings that branch's metrics lines back into RUN_DIR/metrics.jsonl (the file it had
    when it was left), so the resumed run's lines are ``version``'s own history, then the new branch's.

    Args:
        version: an existing version id ("v000012"). branch: the new branch's name (letters, digits,
            "_.-"); default "from-<version>" (with "-2", "-3" ... if taken).

    Returns:
        The new branch's name.

    Raises:
        CheckpointError: no version store or no such version (the message lists the ids there are),
            or one whose tensors fail their check (a missing, truncated or corrupt pack: the resume
            would fail).
        ConfigError: ``branch`` is malformed or already exists; another process is training the
            run (it holds the run dir: its next versions went into the new branch, parented on
            ``version``, and the rollback was lost).
    """
    _existing_root(run_dir)
    with hold_run_dir(Path(run_dir)), _writing(run_dir):
        return _rollback(run_dir, version, branch)


def _rollback(run_dir: str | os.PathLike, version: str, branch: str | None) -> str:
    root = _existing_root(run_dir)
    manifest = read_manifest(run_dir, version)
    _read_blobs(root, manifest["tensors"], version)  # every blob readable, before anything changes
    branches = _branch_records(root)
    if branch is None:
        base, branch, n = f"from-{version}", f"from-{version}", 1
        while branch in branches or branch == MAIN:
            n += 1
            branch = f"{base}-{n}"
    elif not _BRANCH.fullmatch(branch) or branch == MAIN or branch in branches:
        raise ConfigError(
            f"branch={branch!r}: expected a new name of letters, digits and '_.-' (taken: {', '.join([MAIN, *branches])})"
        )
    (root / "branches").mkdir(exist_ok=True)
    record = {
        "name": branch,
        "base": manifest["id"],
        "from_branch": current_branch(run_dir),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    _pin(root, run_dir, manifest["id"])
    metrics = Path(run_dir) / "metrics.jsonl"  # the resume truncates it to the version's iteration
    # the version's own history: the current file, or the one its branch had when it was left (a branch is left
    # once, by the rollback that recorded it as from_branch; the bug: a rollback onto another branch kept the
    # current branch's lines up to the version's iteration, and lost the version's own)
    left = [name for name, r in branches.items() if r.get("from_branch") == manifest["branch"]]
    source = root / "branches" / f"{left[0]}.previous-metrics.jsonl" if manifest["branch"] != record["from_branch"] and left else None
    if metrics.is_file():
        _atomic_write(root / "branches" / f"{branch}.previous-metrics.jsonl", metrics.read_bytes())
    if source is not None and source.is_file():
        _atomic_write(metrics, source.read_bytes())
    _atomic_write(root / "branches" / f"{branch}.json", (json.dumps(record, indent=1) + "\n").encode())
    _atomic_write(root / "HEAD", (branch + "\n").encode())
    return branch


def pin(run_dir: str | os.PathLike, version: str) -> None:
    """Protect ``version`` from retention. Raises CheckpointError for an unknown version, ConfigError
    while another process trains the run (its retention may be deleting versions)."""
    root = _existing_root(run_dir)
    with hold_run_dir(Path(run_dir)), _writing(run_dir):
        _pin(root, run_dir, version)


@contextlib.contextmanager
def _writing(run_dir):
    """An OSError of the block (a read-only run dir: PermissionError) as one CheckpointError line."""
    try:
        yield
    except OSError as e:
        raise CheckpointError(f"{run_dir}: cannot write its version store ({_one_line(e)})") from None


def _pin(root: Path, run_dir: str | os.PathLike, version: str) -> None:
    read_manifest(run_dir, version)
    (root / "pinned").mkdir(exist_ok=True)
    _atomic_write(root / "pinned" / version, b"")


def apply_retention(run_dir: str | os.PathLike, *, keep_last: int | None, keep_every: int = 0, warn: bool = True) -> list[str]:
    """Delete versions outside the retention policy, then the packs no kept version uses.

    Kept: per branch, the ``keep_last`` newest versions (None: all); every version whose iteration is
    a multiple of ``keep_every`` (0: none by this rule); pinned versions; the base of every branch and
    every version a version of another branch descends from (branch points). Each manifest is
    unlinked before any pack, so a crash leaves only unreferenced packs, removed by the next call.
    A manifest that fails its check is kept (with a warning, unless ``warn`` is False), and no pack is
    deleted while one is there.

    Returns:
        The ids deleted, oldest first.
    """
    root = _existing_root(run_dir)
    bad: list[str] = []
    manifests = _manifests(root, cached=True, skip_bad=bad, warn=warn)
    keep = _protected(root, manifests)
    by_branch: dict[str, list[str]] = {}
    for vid, m in manifests.items():
        by_branch.setdefault(m["branch"], []).append(vid)
        if keep_every and m["iteration"] % keep_every == 0:
            keep.add(vid)
    for ids in by_branch.values():
        keep.update(sorted(ids, key=_id_number)[-keep_last:] if keep_last is not None else ids)
    doomed = sorted(set(manifests) - keep, key=_id_number)
    for vid in doomed:
        (root / "manifests" / f"{vid}.json").unlink(missing_ok=True)
    if doomed:
        _fsync_dir(root / "manifests")
    if not bad:  # the packs a damaged manifest names are unknown: delete none while one is there
        collect_garbage(run_dir)
    return doomed


def collect_garbage(run_dir: str | os.PathLike) -> tuple[int, int]:
    """Delete packs that no manifest names. Returns (packs deleted, bytes freed). Writer only."""
    root = _existing_root(run_dir)
    referenced = {spec["pack"] for m in _manifests(root, cached=True).values() for spec in m["tensors"].values()}
    deleted = freed = 0
    folder = root / "packs"
    if not folder.is_dir():
        return 0, 0
    for entry in os.scandir(folder):
        digest = entry.name.removesuffix(".safetensors")
        if entry.name.endswith(".safetensors") and _BLOB.fullmatch(digest) and digest not in referenced:
            size = entry.stat().st_size
            os.unlink(entry.path)
            deleted, freed = deleted + 1, freed + size
    if deleted:
        _fsync_dir(folder)
    return deleted, freed


# ------------------------------------------------------------------------------------------ reading


def list_versions(run_dir: str | os.PathLike, *, skip_bad: bool = False) -> list[dict]:
    """Every version's manifest, oldest first (each verified against its own sha256).

    Raises:
        CheckpointError: no run directory or version store, or a manifest that fails its check
            (with ``skip_bad``: that one is left out, with a warning naming it).
    """
    root = _existing_root(run_dir)
    manifests = _manifests(root, skip_bad=[] if skip_bad else None)
    return [m for _, m in sorted(manifests.items(), key=lambda kv: _id_number(kv[0]))]


def read_manifest(run_dir: str | os.PathLike, version: str) -> dict:
    """The verified manifest of ``version``. Raises CheckpointError naming the known ids if absent."""
    root = _existing_root(run_dir)
    if not isinstance(version, str) or not _ID.fullmatch(version):
        raise CheckpointError(f"version={version!r}: expected an id like 'v000012' ({_known(root)})")
    path = root / "manifests" / f"{version}.json"
    if not path.is_file():
        raise CheckpointError(f"version {version!r} is not in {root} ({_known(root)})")
    return _read_manifest(path)


def load_version(
    run_dir: str | os.PathLike,
    version: str,
    *,
    device: str | torch.device | None = None,
    like: TensorDictBase | None = None,
) -> tuple[TensorDict, dict]:
    """Read and verify ``version``: every blob's content hash, shape and dtype against the manifest,
    and, given ``like``, the keys/shapes/dtypes against ``like`` (as ``checkpoint.load_snapshot``).

    Returns:
        ``(state, manifest)``: the nested TensorDict (batch_size [], on ``device``; None: CPU) and the
        manifest dict (``manifest["meta"]`` is the ``meta`` given to ``save_version``).

    Raises:
        CheckpointError: unknown version, a missing or corrupt blob (named, with the tensor key), a
            structure that differs from ``like``, or random-generator states saved on another device
            type than ``like``'s (the device type to resume on named; a run continues exactly only on
            the device type it ran on).
    """
    root = _existing_root(run_dir)
    manifest = read_manifest(run_dir, version)
    tensors = _joined_blocks(_read_blobs(root, manifest["tensors"], version), version)
    if like is not None:
        _match_like(f"{version} of {run_dir}", tensors, like, "version", "does not match the run", "exact")
    target = torch.device("cpu") if device is None else resolve_device(device)
    state = TensorDict({}, batch_size=[], device=target)
    for name in sorted(tensors):
        state.set(tuple(name.split(".")), tensors[name].to(target))
    return state, manifest


def diff_versions(run_dir: str | os.PathLike, a: str, b: str) -> dict:
    """Per-layer relative parameter change ``||b - a|| / ||a||`` and hyperparameter changes, a -> b.

    Returns:
        {"from": a, "to": b, "steps": step_b - step_a, "layers": {key: change} for every tensor under
        ``learner.params`` in both (``inf`` where ``a`` is all zeros and ``b`` is not),
        "hyperparameters": {name: [value_a, value_b]} for config fields that differ}.

    Raises:
        CheckpointError: as ``load_version``, for the manifests and the parameters' blobs.
    """
    root = _existing_root(run_dir)
    ma, mb = read_manifest(run_dir, a), read_manifest(run_dir, b)
    # the parameters' blobs only: a damaged replay-buffer blob does not stop a diff of the weights
    fa, fb = (_read_blobs(root, {k: v for k, v in m["tensors"].items() if k.startswith(PARAMS_PREFIX)}, m["id"]) for m in (ma, mb))
    layers = {
        name: relative_change(fa[name], fb[name])
        for name in sorted(fa)
        if name.startswith(PARAMS_PREFIX) and name in fb and fa[name].shape == fb[name].shape
    }
    ca, cb = _flat_config(ma["meta"].get("config", {})), _flat_config(mb["meta"].get("config", {}))
    hyper = {k: [ca.get(k), cb.get(k)] for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)}
    return {"from": a, "to": b, "steps": mb["step"] - ma["step"], "layers": layers, "hyperparameters": hyper}


def _flat_config(config: object) -> dict:
    """A config's JSON form with its RunConfig fields as "run.NAME", whether nested in "run" or flat
    (written before RunConfig), so that versions of both layouts compare field by field."""
    if not isinstance(config, dict):
        return {}
    run = config.get("run") if isinstance(config.get("run"), dict) else {}
    flat = {k: v for k, v in config.items() if k != "run" or not run}
    out = {(f"run.{k}" if k in RUN_FIELDS else k): v for k, v in flat.items()}
    return {**out, **{f"run.{k}": v for k, v in run.items()}}


def current_branch(run_dir: str | os.PathLike) -> str:
    """The branch new versions go to: the name in ``versions/HEAD``, else (no HEAD) "main".

    Raises:
        CheckpointError: a HEAD that cannot be read or names no valid branch (it was read as "main",
            and a rollback was silently dropped)."""
    path = _root(run_dir) / "HEAD"
    try:
        name = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return MAIN
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({_one_line(e)})") from e
    if not _BRANCH.fullmatch(name):
        raise CheckpointError(f"{path}: {name[:40]!r} is not a branch name (damaged); write 'main' or a branch of "
                              "`rlfunc versions list` into it")
    return name


def branch_heads(run_dir: str | os.PathLike) -> dict[str, str | None]:
    """{branch: id of its newest readable version, or its base when it has none yet}, "main" first."""
    root = _existing_root(run_dir)
    manifests = _manifests(root, skip_bad=[], warn=False)  # quiet: list_versions / head name a damaged one
    names = [MAIN, *sorted(_branch_records(root))]
    return {name: _head(root, name, manifests) for name in names}


def head(run_dir: str | os.PathLike) -> dict | None:
    """The manifest training resumes from on the current branch (None: no store or no version yet).
    A manifest that fails its check is passed over with a warning naming it."""
    root = _root(run_dir)
    if not (root / "manifests").is_dir():
        return None
    manifests = _manifests(root, skip_bad=[])  # a damaged version warns; the others (and snapshots) still resume
    vid = _head(root, current_branch(run_dir), manifests)
    return None if vid is None or vid not in manifests else manifests[vid]


def has_versions(run_dir: str | os.PathLike) -> bool:
    return (_root(run_dir) / "manifests").is_dir()


# ------------------------------------------------------------------------------------------ helpers


def _root(run_dir) -> Path:
    return Path(run_dir) / VERSIONS_DIR


def _existing_root(run_dir) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run_dir={str(run_dir)!r}: {'not a directory' if run_dir.exists() else 'no such directory'}")
    root = run_dir / VERSIONS_DIR
    if not (root / "manifests").is_dir():
        raise CheckpointError(f"{run_dir}: holds no versions (train with --version-every N > 0)")
    return root


def _id_number(vid: str) -> int:
    return int(vid[1:])


def _pack_path(root: Path, digest: str) -> Path:
    return root / "packs" / f"{digest}.safetensors"


_PACK_KEYS: dict[tuple, frozenset] = {}  # the blobs of a readable pack, by (path, inode, mtime, size): packs are written once


def _pack_keys(root: Path, pack: str) -> frozenset:
    """The blob names a pack holds, from its safetensors header (which safe_open checks against the
    file's size: a truncated pack fails); empty for a missing or unreadable pack."""
    path = _pack_path(root, pack)
    try:
        st = path.stat()
        key = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
        if key not in _PACK_KEYS:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                keys = frozenset(f.keys())
            if len(_PACK_KEYS) >= _MANIFEST_CACHE_SIZE:
                _PACK_KEYS.clear()
            _PACK_KEYS[key] = keys
        return _PACK_KEYS[key]
    except Exception:  # OSError, SafetensorError ...: not a pack to reuse
        return frozenset()


def _record_hash(record: dict) -> str:
    body = {k: v for k, v in record.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _atomic_write(path: Path, data: bytes) -> int:
    """Write ``data`` to ``path`` via an fsynced hidden temp file and ``os.replace``."""
    tmp = path.parent / f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{path}: could not write ({_one_line(e)})") from e
    return len(data)


def _clean_temps(root: Path) -> None:
    """Delete ``.tmp-<pid>-*`` files whose writing process is gone (left by a crash)."""
    for sub in ("packs", "manifests", "branches", "pinned", "."):
        folder = root / sub
        if not folder.is_dir():
            continue
        for entry in os.scandir(folder):
            m = re.fullmatch(r"\.tmp-(\d+)-[0-9a-f]+", entry.name)
            if m and not _alive(int(m.group(1))):
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process writes temps only inside _atomic_write, which finishes them
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Parsed, verified manifests by (path, inode, mtime, size). A manifest file is never modified in
# place (written once via os.replace, later only unlinked), so an entry is valid while that key holds;
# without it every save re-parsed and re-hashed every kept manifest (~2 ms each, bench/versions.py).
_VERIFIED: set[tuple[str, str, str]] = set()  # (store, pack, blob) this process wrote or read back intact
_VERIFIED_SIZE = 200_000
_MANIFEST_CACHE: dict[tuple, dict] = {}
_MANIFEST_CACHE_SIZE = 4096


def _read_manifest(path: Path, *, cached: bool = False) -> dict:
    """Parse and verify a manifest; ``cached`` (the writer's own reads) reuses an earlier parse of
    the same file, readers always verify afresh."""
    try:
        st = path.stat()
        key = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
        if cached and key in _MANIFEST_CACHE:
            return _MANIFEST_CACHE[key]
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({_one_line(e)})") from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f'{path}: not an rlfunc version manifest (no "format": "{FORMAT}")')
    if record.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {record.get('format_version')!r} is unknown; upgrade rlfunc")
    if record.get("manifest_sha256") != _record_hash(record):
        raise CheckpointError(f"{path}: sha256 mismatch; the manifest is corrupt or was edited")
    if not _well_formed(record, path.name.removesuffix(".json")):
        raise CheckpointError(f"{path}: malformed manifest (id, parent, branch, counts or tensor table missing or mistyped)")
    if len(_MANIFEST_CACHE) >= _MANIFEST_CACHE_SIZE:
        _MANIFEST_CACHE.clear()
    _MANIFEST_CACHE[key] = record
    return record


def _well_formed(record: dict, vid: str) -> bool:
    tensors = record.get("tensors")
    return (
        record.get("id") == vid
        and (record.get("parent") is None or (isinstance(record["parent"], str) and bool(_ID.fullmatch(record["parent"]))))
        and isinstance(record.get("branch"), str) and bool(_BRANCH.fullmatch(record["branch"]))
        and all(isinstance(record.get(k), int) and not isinstance(record.get(k), bool) for k in ("iteration", "step"))
        and all(isinstance(record.get(k), dict) for k in ("meta", "metrics", "layer_change"))
        and isinstance(tensors, dict)
        and all(
            isinstance(spec, dict)
            and isinstance(spec.get("blob"), str) and bool(_BLOB.fullmatch(spec["blob"]))
            and isinstance(spec.get("pack"), str) and bool(_BLOB.fullmatch(spec["pack"]))
            and isinstance(spec.get("dtype"), str)
            and isinstance(spec.get("shape"), list)
            and all(isinstance(n, int) and not isinstance(n, bool) for n in spec["shape"])
            for spec in tensors.values()
        )
    )


def _manifests(root: Path, *, cached: bool = False, skip_bad: list | None = None, warn: bool = True) -> dict[str, dict]:
    """{id: verified manifest} of the store. A manifest that fails its check raises, or with
    ``skip_bad`` (a list) is left out, its id appended to the list and (``warn``) a warning naming the
    file given: one damaged version then blocks neither a resume from an intact snapshot nor new versions."""
    out = {}
    for vid in _version_ids(root):
        try:
            out[vid] = _read_manifest(root / "manifests" / f"{vid}.json", cached=cached)
        except CheckpointError as e:
            if not (root / "manifests" / f"{vid}.json").exists():  # deleted by the writer's retention since the listing
                continue  # (a reader beside a training run warned "restore or delete the file" of it)
            if skip_bad is None:
                raise
            skip_bad.append(vid)
            if warn:
                warnings.warn(f"{e}: version {vid} skipped (restore or delete the file to end this warning)", stacklevel=3)
    return out


def _version_ids(root: Path) -> list[str]:
    """Every version id with a manifest file, readable or not."""
    return [m.group(1) for e in os.scandir(root / "manifests") if (m := re.fullmatch(r"(v\d{6,})\.json", e.name))]


def _damaged(root: Path, table: Mapping[str, dict]) -> set[str]:
    """The keys of ``table`` ({key: {"blob", "pack", ...}}) whose blob does not read back with its content
    hash (an unreadable pack: all of its keys)."""
    by_pack: dict[str, list[str]] = {}
    for name, spec in table.items():
        by_pack.setdefault(spec["pack"], []).append(name)
    bad = set()
    for pack, names in by_pack.items():
        try:
            with safe_open(str(_pack_path(root, pack)), framework="pt", device="cpu") as f:
                bad.update(n for n in names if tensor_hash(f.get_tensor(table[n]["blob"])) != table[n]["blob"])
        except Exception:  # SafetensorError, OSError ...: its blobs are stored anew
            bad.update(names)
    return bad


def _read_blobs(root: Path, table: Mapping[str, dict], version: str) -> dict[str, torch.Tensor]:
    """The tensors ``table`` names ({key: {"blob", "pack", "shape", "dtype"}}), each checked against its
    content hash, shape and dtype; CheckpointError naming the blob, its pack and the key otherwise."""
    by_pack: dict[str, list[str]] = {}
    for name, spec in table.items():
        by_pack.setdefault(spec["pack"], []).append(name)
    out = {}
    for pack, names in by_pack.items():
        path = _pack_path(root, pack)
        first = table[names[0]]["blob"]
        if not path.is_file():
            _check_not_retired(root, version)
            raise CheckpointError(f"blob {first[:16]}... of {version}, key {names[0]!r}: pack {path} is missing")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                present = set(f.keys())
                for name in names:
                    spec = table[name]
                    what = f"blob {spec['blob'][:16]}... (pack {path}) of {version}, key {name!r}"
                    if spec["blob"] not in present:
                        raise CheckpointError(f"{what}: not in its pack")
                    t = f.get_tensor(spec["blob"])
                    if tensor_hash(t) != spec["blob"]:
                        raise CheckpointError(f"{what}: content hash mismatch; the pack is corrupt")
                    if [list(t.shape), _dtype_name(t.dtype)] != [spec["shape"], spec["dtype"]]:
                        raise CheckpointError(f"{what}: shape/dtype differ from the manifest")
                    out[name] = t
        except CheckpointError:
            raise
        except Exception as e:  # SafetensorError, OSError ...: one line
            _check_not_retired(root, version)
            raise CheckpointError(
                f"blob {first[:16]}... of {version}, key {names[0]!r}: pack {path} is unreadable ({_one_line(e)})"
            ) from e
    return out


def _check_not_retired(root: Path, version: str) -> None:
    """CheckpointError if ``version``'s manifest is gone: a running run's retention deleted the version
    (and its packs) after its manifest was read, which is not a damaged pack."""
    if not (root / "manifests" / f"{version}.json").exists():
        raise CheckpointError(f"{version} was deleted while it was read (the run's retention keeps its last "
                              f"run.version_keep_last versions); list them again: rlfunc versions list {root.parent}")


def _branch_records(root: Path) -> dict[str, dict]:
    folder = root / "branches"
    out = {}
    if folder.is_dir():
        for entry in os.scandir(folder):
            name = entry.name.removesuffix(".json")
            if entry.name.endswith(".json") and _BRANCH.fullmatch(name):
                try:
                    out[name] = json.loads(Path(entry.path).read_text(encoding="utf-8"))
                except FileNotFoundError:  # removed since the listing
                    continue
                except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise CheckpointError(f"{entry.path}: unreadable branch record ({_one_line(e)})") from e
                if not isinstance(out[name], dict):  # valid JSON of another kind was an AttributeError traceback in retention
                    raise CheckpointError(f"{entry.path}: not a branch record (expected a JSON object with its \"base\" "
                                          f"version, got a {type(out[name]).__name__}); restore it or delete the file")
    return out


def _head(root: Path, branch: str, manifests: dict[str, dict]) -> str | None:
    on_branch = [v for v, m in manifests.items() if m["branch"] == branch]
    if on_branch:
        return max(on_branch, key=_id_number)
    if branch == MAIN:
        return None
    record = _branch_records(root).get(branch)
    # the bug: a missing or damaged record resumed main's history, silently (the rollback lost), or raised
    # KeyError in save_version; a branch without versions yet continues from its base, which must be there
    if record is None:
        raise CheckpointError(f"{root / 'HEAD'} names branch {branch!r}, but {root / 'branches' / (branch + '.json')} is "
                              "missing; roll back again (rlfunc versions rollback RUN_DIR V) or write 'main' into HEAD")
    base = record.get("base") if isinstance(record, dict) else None
    if base not in manifests:
        raise CheckpointError(f"{root / 'branches' / (branch + '.json')}: base {base!r} is not a readable version "
                              "(damaged record or manifest); roll back again (rlfunc versions rollback RUN_DIR V)")
    return base


def _protected(root: Path, manifests: dict[str, dict]) -> set[str]:
    keep = set()
    pinned = root / "pinned"
    if pinned.is_dir():
        keep.update(e.name for e in os.scandir(pinned) if _ID.fullmatch(e.name))
    keep.update(r.get("base") for r in _branch_records(root).values())
    for m in manifests.values():
        parent = manifests.get(m["parent"]) if m["parent"] else None
        if parent is not None and parent["branch"] != m["branch"]:
            keep.add(parent["id"])
    keep.discard(None)
    return keep


def _known(root: Path) -> str:
    try:
        ids = sorted((e.name[:-5] for e in os.scandir(root / "manifests") if _ID.fullmatch(e.name[:-5])), key=_id_number)
    except OSError:
        ids = []
    if not ids:
        return "the run has no versions"
    shown = ids if len(ids) <= 6 else [*ids[:3], "...", *ids[-3:]]
    return f"versions there: {', '.join(shown)}"

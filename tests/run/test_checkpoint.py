"""Snapshots: round trip, integrity checks, refusal of pickles, atomic replacement, run pointer + pruning."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import rlfunc.run.checkpoint as ckpt
from rlfunc.run.checkpoint import (
    latest_snapshot,
    load_meta,
    load_snapshot,
    record_digest,
    save_run_snapshot,
    save_snapshot,
)
from rlfunc.errors import CheckpointError, ConfigError, SnapshotCorruptError


def _state(seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    ensemble = torch.randn(3, 4, 2, generator=g)
    tied = torch.randn(5, generator=g)
    return TensorDict(
        {
            "actor": {
                "net": {"weight": torch.randn(4, 3, generator=g), "bias": torch.zeros(4)},
                "log_std": torch.tensor(-0.5),  # 0-dim float
            },
            "critic": {"member0": ensemble[0], "tied_a": tied, "tied_b": tied},  # views / shared storage
            "transposed": torch.randn(3, 2, generator=g).t(),  # non-contiguous
            "optim": {"step": torch.tensor(7, dtype=torch.int64), "counts": torch.arange(5, dtype=torch.int64)},
            "rng": {"torch": g.get_state()},  # uint8
            "done": torch.tensor([[True, False], [False, True]]),
            "half": torch.randn(2, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0, 3, dtype=torch.uint8),
        },
        batch_size=[],
    )


_META = {
    "config": {"lr": 3e-4, "gamma": 0.99, "hidden": [64, 64], "max_grad_norm": math.inf, "name": None},
    "env": {"id": "Pendulum-v1", "obs_shape": [3]},
    "env_steps": 12_000,
    "rng": {"python": [3, [1, 2, 3], None]},
}


def _assert_same(a: TensorDict, b: TensorDict) -> None:
    ka = sorted(a.keys(include_nested=True, leaves_only=True), key=str)
    kb = sorted(b.keys(include_nested=True, leaves_only=True), key=str)
    assert ka == kb
    for k in ka:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------------------ round trip


def test_round_trip_nested_dtypes_and_meta(tmp_path):
    state = _state()
    out = save_snapshot(tmp_path / "snap", state, _META)
    assert out == tmp_path / "snap"
    assert sorted(os.listdir(out)) == ["meta.json", "state.safetensors"]
    assert os.listdir(tmp_path) == ["snap"]  # no temporary left behind

    loaded, meta = load_snapshot(out)
    _assert_same(loaded, state)
    assert loaded.batch_size == torch.Size([])
    assert loaded.device == torch.device("cpu")
    assert loaded["actor", "log_std"].dim() == 0 and loaded["optim", "step"].item() == 7
    assert meta == {**_META, "rng": {"python": [3, [1, 2, 3], None]}}
    assert math.isinf(meta["config"]["max_grad_norm"])
    assert load_meta(out) == meta

    # the restored generator state continues the same stream
    g1, g2 = torch.Generator(), torch.Generator()
    g1.set_state(state["rng", "torch"])
    g2.set_state(loaded["rng", "torch"])
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


def test_like_accepts_matching_state_and_device(tmp_path):
    save_snapshot(tmp_path / "snap", _state(0), {})
    loaded, meta = load_snapshot(tmp_path / "snap", device="cpu", like=_state(1))
    _assert_same(loaded, _state(0))
    assert meta == {}


def test_batched_state_loads_with_empty_batch_size(tmp_path):
    state = TensorDict({"w": torch.randn(4, 3)}, batch_size=[4])
    save_snapshot(tmp_path / "snap", state, {})
    loaded, _ = load_snapshot(tmp_path / "snap", like=state)
    assert loaded.batch_size == torch.Size([]) and torch.equal(loaded["w"], state["w"])


def test_meta_json_records_versions_table_and_sha256(tmp_path):
    path = save_snapshot(tmp_path / "snap", _state(), _META)
    record = json.loads((path / "meta.json").read_text())
    assert record["format_version"] == ckpt.FORMAT_VERSION
    assert record["rlfunc_version"]
    assert record["meta"]["env_steps"] == 12_000
    assert record["tensors"]["actor.net.weight"] == {"shape": [4, 3], "dtype": "float32"}
    assert record["tensors"]["rng.torch"]["dtype"] == "uint8"
    assert record["tensors"]["actor.log_std"]["shape"] == []
    data = (path / "state.safetensors").read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    assert record["state_file"] == {"name": "state.safetensors", "bytes": len(data), "sha256": sha256}


# ------------------------------------------------------------------------------------- what save refuses


def test_dotted_key_is_refused(tmp_path):
    state = TensorDict({"a": {"b.c": torch.zeros(1)}}, batch_size=[])
    with pytest.raises(CheckpointError, match=r"b\.c"):
        save_snapshot(tmp_path / "snap", state, {})
    assert not (tmp_path / "snap").exists()


def test_non_tensor_data_is_refused(tmp_path):
    state = TensorDict({"a": torch.zeros(1), "note": "hello"}, batch_size=[])
    with pytest.raises(CheckpointError, match="note.*meta"):
        save_snapshot(tmp_path / "snap", state, {})


@pytest.mark.parametrize(
    ("meta", "where"),
    [
        ({"config": {"device": torch.device("cpu")}}, r"meta\['config'\]\['device'\]"),
        ({"rng": [1, torch.zeros(2)]}, r"meta\['rng'\]\[1\]"),
        ({"counts": {3: 1}}, r"meta\['counts'\].*key 3"),
        ({"tags": {"a", "b"}}, r"meta\['tags'\]"),
    ],
)
def test_non_json_meta_names_the_key(tmp_path, meta, where):
    with pytest.raises(CheckpointError, match=where):
        save_snapshot(tmp_path / "snap", _state(), meta)
    assert os.listdir(tmp_path) == []


def test_meta_json_cannot_write_is_one_error(tmp_path):
    """New-user pass: an int past Python's 4300-digit str limit was json's raw ValueError, and a meta nested
    5000 deep a RecursionError, where the docstring promises a CheckpointError; nothing is left behind."""
    deep: dict = {}
    inner = deep
    for _ in range(5000):
        inner["a"] = {}
        inner = inner["a"]
    for meta in ({"big": 10**5000}, {"deep": deep}):
        with pytest.raises(CheckpointError, match=r"^meta cannot be written as JSON: (ValueError|RecursionError)"):
            save_snapshot(tmp_path / "snap", _state(), meta)
    assert os.listdir(tmp_path) == []


def test_refuses_to_replace_a_directory_that_is_not_a_snapshot(tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "thesis.tex").write_text("do not delete")
    with pytest.raises(CheckpointError, match="refusing"):
        save_snapshot(target, _state(), {})
    assert (target / "thesis.tex").read_text() == "do not delete"


# ------------------------------------------------------------------------------------ what load refuses


def test_byte_flip_is_detected_by_sha256(tmp_path):
    path = save_snapshot(tmp_path / "snap", _state(), {})
    data = bytearray((path / "state.safetensors").read_bytes())
    data[-3] ^= 0xFF  # inside tensor data, where safetensors itself would notice nothing
    (path / "state.safetensors").write_bytes(bytes(data))
    with pytest.raises(SnapshotCorruptError, match="sha256.*corrupt"):
        load_snapshot(path)


def test_truncated_file_is_refused(tmp_path):
    path = save_snapshot(tmp_path / "snap", _state(), {})
    data = (path / "state.safetensors").read_bytes()
    (path / "state.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotCorruptError, match="truncated"):
        load_snapshot(path)


def _forge_record(path: Path) -> None:
    """Make meta.json agree with whatever state.safetensors now holds, as a forger would."""
    data = (path / "state.safetensors").read_bytes()
    record = json.loads((path / "meta.json").read_text())
    record["state_file"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    record["record_sha256"] = record_digest(record)  # and re-signs the record
    (path / "meta.json").write_text(json.dumps(record))


def test_garbled_safetensors_gives_one_line_error(tmp_path):
    path = save_snapshot(tmp_path / "snap", _state(), {})
    data = (path / "state.safetensors").read_bytes()
    (path / "state.safetensors").write_bytes(data[:20])
    _forge_record(path)  # integrity checks pass, so the parser itself must fail cleanly
    with pytest.raises(SnapshotCorruptError, match="not a readable safetensors file") as info:
        load_snapshot(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    assert info.value.__cause__ is not None


@pytest.mark.parametrize("garbage", ["{not json", "", "[1, 2]", '{"format": "something else"}'])
def test_garbage_meta_json_is_refused(tmp_path, garbage):
    path = save_snapshot(tmp_path / "snap", _state(), {})
    (path / "meta.json").write_text(garbage)
    with pytest.raises(SnapshotCorruptError, match="meta.json") as info:
        load_snapshot(path)
    assert "\n" not in str(info.value)


def test_unknown_format_version_is_refused(tmp_path):
    path = save_snapshot(tmp_path / "snap", _state(), {})
    record = json.loads((path / "meta.json").read_text())
    record["format_version"] = 99
    (path / "meta.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="format_version 99") as info:
        load_snapshot(path)
    assert not isinstance(info.value, SnapshotCorruptError)


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="no snapshot here"):
        load_snapshot(tmp_path / "nowhere")
    path = save_snapshot(tmp_path / "snap", _state(), {})
    (path / "state.safetensors").unlink()
    with pytest.raises(SnapshotCorruptError, match="state.safetensors: missing"):
        load_snapshot(path)
    (path / "meta.json").unlink()
    with pytest.raises(SnapshotCorruptError, match="meta.json: missing"):
        load_snapshot(path)


def test_like_shape_mismatch_names_key_and_both_shapes(tmp_path):
    path = save_snapshot(tmp_path / "snap", _state(), {})
    like = _state()
    like["actor", "net", "weight"] = torch.zeros(4, 5)
    with pytest.raises(CheckpointError, match=r"'actor\.net\.weight'.*\[4, 3\] float32.*\[4, 5\] float32") as info:
        load_snapshot(path, like=like)
    assert not isinstance(info.value, SnapshotCorruptError)  # a sound snapshot of another run, not damage


def test_like_dtype_mismatch(tmp_path):
    path = save_snapshot(tmp_path / "snap", _state(), {})
    like = _state()
    like["optim", "step"] = torch.tensor(7, dtype=torch.int32)
    with pytest.raises(CheckpointError, match=r"'optim\.step'.*int64.*int32"):
        load_snapshot(path, like=like)


def test_like_key_mismatch_names_the_key(tmp_path):
    path = save_snapshot(tmp_path / "snap", _state(), {})
    extra = _state()
    extra["actor", "new_head"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match=r"'actor\.new_head'.*not in the snapshot"):
        load_snapshot(path, like=extra)
    fewer = _state()
    del fewer["critic", "tied_b"]
    with pytest.raises(CheckpointError, match=r"'critic\.tied_b'.*not in the run being loaded"):
        load_snapshot(path, like=fewer)


class _Payload:
    """Unpickling this creates ``marker``: proof that a pickle was executed."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_pickle_payload_is_refused_not_executed(tmp_path, writer):
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Payload(probe)))
    assert probe.exists()  # the payload is live

    marker = tmp_path / "pwned"
    path = save_snapshot(tmp_path / "snap", _state(), {})
    if writer == "pickle":
        (path / "state.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    else:
        torch.save({"w": _Payload(marker)}, path / "state.safetensors")
    with pytest.raises(CheckpointError, match="sha256|truncated"):
        load_snapshot(path)
    _forge_record(path)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_snapshot(path)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- atomicity


def _rename_failing_on(monkeypatch, should_fail):
    real = os.rename

    def fake(src, dst, *args, **kwargs):
        if should_fail(Path(src), Path(dst)):
            raise OSError(28, "No space left on device (simulated)")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", fake)
    monkeypatch.setattr(os, "replace", fake)


@pytest.mark.parametrize("failing", ["old_to_trash", "new_into_place"])
def test_failed_replace_leaves_old_snapshot_intact(tmp_path, monkeypatch, failing):
    path = save_snapshot(tmp_path / "snap", _state(0), {"version": "old"})
    if failing == "old_to_trash":
        _rename_failing_on(monkeypatch, lambda src, dst: src == path)
    else:
        _rename_failing_on(monkeypatch, lambda src, dst: src.name.startswith(".tmp-"))
    with pytest.raises(CheckpointError, match="could not write"):
        save_snapshot(path, _state(1), {"version": "new"})
    monkeypatch.undo()

    loaded, meta = load_snapshot(path)
    assert meta == {"version": "old"}
    _assert_same(loaded, _state(0))
    assert os.listdir(tmp_path) == ["snap"]  # no .tmp-* or .trash-* left


def test_crash_between_renames_leaves_both_snapshots_complete(tmp_path, monkeypatch):
    """A hard crash runs no cleanup: simulate it by failing every rename after the first and
    disabling deletion. Nothing half-written may appear under the final name."""
    path = save_snapshot(tmp_path / "snap", _state(0), {"version": "old"})
    calls = []
    _rename_failing_on(monkeypatch, lambda src, dst: calls.append(src) or len(calls) > 1)
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda *a, **k: None)
    with pytest.raises(CheckpointError):
        save_snapshot(path, _state(1), {"version": "new"})
    monkeypatch.undo()

    assert not path.exists()
    with pytest.raises(CheckpointError, match=r"\.trash-snap-.*rename") as info:
        load_snapshot(path)
    assert ".tmp-snap-" in str(info.value)
    (trash,) = tmp_path.glob(".trash-snap-*")
    (tmp,) = tmp_path.glob(".tmp-snap-*")
    assert load_snapshot(trash)[1] == {"version": "old"}
    assert load_snapshot(tmp)[1] == {"version": "new"}
    _assert_same(load_snapshot(trash)[0], _state(0))


def test_successful_replace(tmp_path):
    path = save_snapshot(tmp_path / "snap", _state(0), {"version": "old"})
    save_snapshot(path, _state(1), {"version": "new"})
    loaded, meta = load_snapshot(path)
    assert meta == {"version": "new"}
    _assert_same(loaded, _state(1))
    assert os.listdir(tmp_path) == ["snap"]


# ---------------------------------------------------------------------------------------- run convention


def test_latest_pointer_and_pruning(tmp_path):
    run = tmp_path / "run"
    assert latest_snapshot(run) is None
    for step in (100, 200, 300, 400, 500):
        written = save_run_snapshot(run, _state(step), {"env_steps": step}, step, keep_last=3)
        assert written == run / "checkpoints" / f"step_{step:012d}"
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["latest", "step_000000000300", "step_000000000400", "step_000000000500"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000000000500"
    assert latest_snapshot(run) == run / "checkpoints" / "step_000000000500"
    assert load_snapshot(latest_snapshot(run))[1] == {"env_steps": 500}


def test_pruning_never_removes_the_snapshot_just_written(tmp_path):
    run = tmp_path / "run"
    for step in (300, 400, 500):
        save_run_snapshot(run, _state(), {}, step, keep_last=2)
    written = save_run_snapshot(run, _state(), {"rolled_back": True}, 200, keep_last=2)  # a roll-back
    assert written.exists()
    assert latest_snapshot(run) == written
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert names == ["step_000000000200", "step_000000000400", "step_000000000500"]


def test_latest_falls_back_to_newest_complete_snapshot(tmp_path):
    run = tmp_path / "run"
    for step in (1, 2, 3):
        save_run_snapshot(run, _state(), {}, step, keep_last=None)
    pointer = run / "checkpoints" / "latest"
    pointer.write_text("step_000000000002\n")
    assert latest_snapshot(run).name == "step_000000000002"  # the pointer wins when valid
    pointer.write_text("step_000000000009\n")
    assert latest_snapshot(run).name == "step_000000000003"  # absent target
    pointer.unlink()
    assert latest_snapshot(run).name == "step_000000000003"  # no pointer
    (run / "checkpoints" / "step_000000000003" / "meta.json").unlink()
    assert latest_snapshot(run).name == "step_000000000002"  # incomplete dirs are skipped


def test_run_snapshot_argument_checks(tmp_path):
    with pytest.raises(ConfigError, match="keep_last"):
        save_run_snapshot(tmp_path, _state(), {}, 1, keep_last=0)
    with pytest.raises(ConfigError, match="step"):
        save_run_snapshot(tmp_path, _state(), {}, -1)
    assert latest_snapshot(tmp_path) is None


def _with_generators(rng_bytes: int, seeds: int = 2) -> TensorDict:
    """A learner-like state whose "rng" holds ``seeds`` generator states of ``rng_bytes`` bytes (5056:
    the CPU's mt19937, 16: a CUDA/NPU Philox seed and offset) and an env "env_rng" of one."""
    return TensorDict({"learner": {"w": torch.arange(3.0), "rng": torch.full((seeds, rng_bytes), 7, dtype=torch.uint8)},
                       "env_rng": torch.full((rng_bytes,), 9, dtype=torch.uint8)}, batch_size=[])


def test_generator_states_of_another_device_type_are_named_on_resume_and_replaced_for_evaluation(tmp_path):
    # a run saved on a GPU (16-byte generator states) loaded where the run's generators are the CPU's:
    # this broke `rlfunc eval` of a CPU run on a GPU machine (the structure check refused it)
    path = save_snapshot(tmp_path / "snap", _with_generators(16), {})
    like = _with_generators(5056)
    like["learner", "w"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"env_rng, learner\.rng\) were saved on another device type than cpu "
                                              r"\(16 bytes each.*resume it with --device cuda or npu"):
        load_snapshot(path, like=like)
    state, _ = load_snapshot(path, like=like, generators="fresh")
    assert torch.equal(state["learner", "w"], torch.arange(3.0))  # the rest is the snapshot's
    assert torch.equal(state["learner", "rng"], like["learner", "rng"]) and torch.equal(state["env_rng"], like["env_rng"])
    cpu_run = save_snapshot(tmp_path / "cpu", _with_generators(5056), {})  # and the other way round
    with pytest.raises(CheckpointError, match="resume it with --device cpu"):
        load_snapshot(cpu_run, like=_with_generators(16))


def test_generator_states_differing_in_more_than_their_length_are_a_structure_error(tmp_path):
    path = save_snapshot(tmp_path / "snap", _with_generators(16, seeds=3), {})
    with pytest.raises(CheckpointError, match=r"structure.*'learner\.rng'.*\[3, 16\].*\[2, 5056\]"):
        load_snapshot(path, like=_with_generators(5056, seeds=2), generators="fresh")
    renamed = _with_generators(16)
    renamed["learner", "seed_bytes"] = renamed["learner"].pop("rng")  # not a generator state by its name
    path = save_snapshot(tmp_path / "other", renamed, {})
    like = _with_generators(5056)
    like["learner", "seed_bytes"] = like["learner"].pop("rng")
    with pytest.raises(CheckpointError, match="structure"):
        load_snapshot(path, like=like, generators="fresh")
    with pytest.raises(ConfigError, match="generators='keep': expected 'exact' or 'fresh'"):
        load_snapshot(path, like=like, generators="keep")


def test_adopt_generator_states_replaces_only_those_of_another_device_type():
    loaded, like = _with_generators(16), _with_generators(5056)
    like["learner", "w"] = torch.zeros(3)
    like["learner", "rng"] = torch.zeros(2, 5056, dtype=torch.uint8)
    assert ckpt.adopt_generator_states(loaded, like) == ["env_rng", "learner.rng"]
    assert torch.equal(loaded["learner", "rng"], like["learner", "rng"]) and torch.equal(loaded["learner", "w"], torch.arange(3.0))
    same = _with_generators(16)
    assert ckpt.adopt_generator_states(same, _with_generators(16)) == []
    assert torch.equal(same["env_rng"], torch.full((16,), 9, dtype=torch.uint8))


def test_check_generator_device_names_the_device_type_to_resume_on():
    loaded, like = _with_generators(16), _with_generators(5056)
    assert ckpt.generators_of_another_device(loaded, like) == ["env_rng", "learner.rng"]
    with pytest.raises(CheckpointError, match=r"^snap: its random-generator states \(env_rng, learner\.rng\) were saved "
                                              r"on another device type than cpu .*resume it with --device cuda or npu$"):
        ckpt.check_generator_device("snap", loaded, like)
    with pytest.raises(CheckpointError, match="resume it with --device cpu$"):
        ckpt.check_generator_device("snap", like, loaded)
    ckpt.check_generator_device("snap", like, _with_generators(5056))  # same device type: nothing to refuse
    assert ckpt.generators_of_another_device(_with_generators(16, seeds=3), like) == ["env_rng"]  # [3, 16] vs [2, 5056]


def test_latest_naming_a_damaged_snapshot_warns_before_falling_back(tmp_path):
    # new-user pass: a latest snapshot whose state.safetensors was deleted was passed over for the previous
    # one without a word (resume then redid its iterations); 'latest' is written after its snapshot is whole
    run = tmp_path / "run"
    for step in (1, 2):
        save_run_snapshot(run, _state(), {}, step, keep_last=None)
    (run / "checkpoints" / "step_000000000002" / "state.safetensors").unlink()
    with pytest.warns(UserWarning, match="names step_000000000002, which lacks .* using step_000000000001"):
        assert latest_snapshot(run).name == "step_000000000001"


@pytest.mark.parametrize("names, why", [(("x", "x.y"), "is also a prefix of 'x.y'"), (("a..b",), "has an empty part"),
                                        (("a.",), "has an empty part")])
def test_a_crafted_file_with_names_rlfunc_never_writes_is_refused(tmp_path, names, why):
    """New-user pass: "x" beside "x.y" was tensordict's KeyError, "a..b" loaded into an empty key; a
    forged record (sha and table agreeing) let both through."""
    from safetensors.torch import save_file

    path = save_snapshot(tmp_path / "snap", _state(), {})
    save_file({n: torch.zeros(2) for n in names}, str(path / "state.safetensors"))
    record = json.loads((path / "meta.json").read_text())
    record["tensors"] = {n: {"shape": [2], "dtype": "float32"} for n in names}
    (path / "meta.json").write_text(json.dumps(record))
    _forge_record(path)
    with pytest.raises(SnapshotCorruptError, match=why):
        load_snapshot(path)


def test_an_edited_meta_json_is_refused_and_a_record_without_its_digest_still_loads(tmp_path):
    """Fault pass: a one-character edit of a snapshot's meta.json ("lr": 0.002 -> 0.003) resumed
    silently with the edited lr; the record now carries its own sha256."""
    path = save_snapshot(tmp_path / "snap", _state(), {"config": {"lr": 0.002}})
    text = (path / "meta.json").read_text()
    (path / "meta.json").write_text(text.replace("0.002", "0.003"))
    with pytest.raises(SnapshotCorruptError, match=r"meta.json: its record_sha256 does not match its contents"):
        load_meta(path)
    with pytest.raises(SnapshotCorruptError, match="record_sha256"):
        load_snapshot(path)
    record = json.loads(text)
    del record["record_sha256"]  # as written before the digest existed
    (path / "meta.json").write_text(json.dumps(record))
    assert load_meta(path) == {"config": {"lr": 0.002}}
    assert record_digest(json.loads(text)) == json.loads(text)["record_sha256"]


def test_leftovers_of_interrupted_saves_are_removed_but_a_lone_complete_copy_is_kept(tmp_path):
    """Fault pass: after SIGKILLs, .tmp-step_* directories (88 KB of a 128 KB snapshot with its
    buffer) and .tmp-latest-* files stayed in checkpoints/ for good."""
    import shutil

    from rlfunc.run.checkpoint import remove_leftovers

    run = tmp_path / "run"
    save_run_snapshot(run, _state(), {"env_steps": 1}, step=1)
    ckpt = run / "checkpoints"
    done = ckpt / "step_000000000001"
    shutil.copytree(done, ckpt / ".tmp-step_000000000001-111-aaaa")  # complete, its target complete: garbage
    shutil.copytree(done, ckpt / ".trash-step_000000000001-111-bbbb")  # the old copy beside a complete one
    (ckpt / ".tmp-step_000000000002-222-cccc").mkdir()  # half written (no meta.json)
    (ckpt / ".tmp-step_000000000002-222-cccc" / "state.safetensors").write_bytes(b"\0" * 10)
    shutil.copytree(done, ckpt / ".tmp-step_000000000003-333-dddd")  # complete, step 3 missing: the crash window
    (ckpt / ".tmp-latest-444-eeee").write_text("step_000000000001\n")
    removed = remove_leftovers(run)
    assert sorted(removed) == [".tmp-latest-444-eeee", ".tmp-step_000000000001-111-aaaa", ".tmp-step_000000000002-222-cccc",
                               ".trash-step_000000000001-111-bbbb"]
    assert sorted(p.name for p in ckpt.iterdir()) == [".tmp-step_000000000003-333-dddd", "latest", "step_000000000001"]
    assert load_snapshot(done)[1] == {"env_steps": 1}

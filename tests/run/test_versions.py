"""Version store: content addressing, list/show/diff/rollback, exact resume from a version, retention + GC,
SIGKILL safety, corruption, CLI errors, and the freeze mode's bookkeeping."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlfunc.algos.ppo import preset
from rlfunc.cli import commands as cli
from rlfunc.core import func
from rlfunc.errors import CheckpointError, ConfigError
from rlfunc.run import versions
from rlfunc.run import train
from rlfunc.run.ppo import init_freeze, update_freeze

TINY = dict(num_envs=2, num_steps=64, minibatch_size=64, num_epochs=2, device="cpu", checkpoint_every=0)


def _state(w, b, extra=None) -> TensorDict:
    td = TensorDict(
        {"learner": {"params": {"w": torch.tensor(w, dtype=torch.float32), "b": torch.tensor(b, dtype=torch.float32)}},
         "const": torch.arange(6, dtype=torch.int64).reshape(2, 3)},
        batch_size=[],
    )
    if extra is not None:
        td["extra"] = extra
    return td


def _leaves(td):
    return {k: v.detach().clone() for k, v in td.items(include_nested=True, leaves_only=True)}


def _packs(run_dir) -> dict[str, int]:
    folder = Path(run_dir) / "versions" / "packs"
    return {p.name.removesuffix(".safetensors"): p.stat().st_size for p in folder.iterdir() if not p.name.startswith(".")}


def _blobs(run_dir) -> list[str]:
    """Every blob stored, over all packs (a blob stored twice would appear twice)."""
    from safetensors import safe_open

    out = []
    for pack in _packs(run_dir):
        with safe_open(str(Path(run_dir) / "versions" / "packs" / f"{pack}.safetensors"), "pt") as f:
            out.extend(f.keys())
    return out


# ------------------------------------------------------------------------------ content addressing


def test_unchanged_tensors_are_written_once(tmp_path):
    v1 = versions.save_version(tmp_path, _state([3.0, 4.0], [0.0]), {"config": {"lr": 1.0}}, iteration=1, step=10)
    assert v1["written"]["blobs"] == 3 and len(_blobs(tmp_path)) == 3 and len(_packs(tmp_path)) == 1
    # only w changes: one new blob in one new pack, whose bytes are the whole growth of the store
    before = sum(_packs(tmp_path).values())
    v2 = versions.save_version(tmp_path, _state([3.0, 5.0], [0.0]), {"config": {"lr": 1.0}}, iteration=2, step=20)
    assert v2["written"]["blobs"] == 1 and len(_blobs(tmp_path)) == 4 and len(set(_blobs(tmp_path))) == 4
    assert sum(_packs(tmp_path).values()) - before == v2["written"]["bytes"] > 0
    assert v2["tensors"]["learner.params.w"]["pack"] != v1["tensors"]["learner.params.w"]["pack"]
    assert v2["tensors"]["const"] == v1["tensors"]["const"]  # same blob, read from v1's pack
    # an identical state adds no blob; two keys with equal content share one blob
    v3 = versions.save_version(tmp_path, _state([3.0, 5.0], [0.0]), {}, iteration=3, step=30)
    assert v3["written"] == {"blobs": 0, "bytes": 0} and len(_packs(tmp_path)) == 2
    v4 = versions.save_version(tmp_path, _state([3.0, 5.0], [0.0], extra=torch.tensor([3.0, 5.0])), {}, iteration=4, step=40)
    assert v4["written"]["blobs"] == 0 and v4["tensors"]["extra"]["blob"] == v4["tensors"]["learner.params.w"]["blob"]
    # the hash covers dtype and shape: same bytes, other dtype/shape -> other blob
    assert versions.tensor_hash(torch.zeros(2, dtype=torch.int32)) != versions.tensor_hash(torch.zeros(2, dtype=torch.float32))
    assert versions.tensor_hash(torch.zeros(2, 3)) != versions.tensor_hash(torch.zeros(3, 2))
    # a one-element slice of a wider tensor: "contiguous" with stride 13 (oscillation damping's per-seed state
    # of one seed), which crashed the hash ("stride(-1) must be 1 to view Float as Byte")
    strided = torch.arange(13.0).reshape(1, 13)[:, 4]
    assert strided.is_contiguous() and strided.stride() == (13,)
    assert versions.tensor_hash(strided) == versions.tensor_hash(torch.tensor([4.0]))
    state, manifest = versions.load_version(tmp_path, "v000004")
    assert torch.equal(state["learner", "params", "w"], torch.tensor([3.0, 5.0])) and manifest["parent"] == "v000003"


# ------------------------------------------------------------------------------ list / show / diff


def test_list_show_diff_on_a_hand_built_run(tmp_path, capsys):
    versions.save_version(tmp_path, _state([3.0, 4.0], [0.0, 0.0]), {"config": {"lr": 1e-3, "gamma": 0.9}},
                          iteration=1, step=256, metrics={"episode_return": -1200.5})
    versions.save_version(tmp_path, _state([3.0, 5.0], [1.0, 0.0]), {"config": {"lr": 5e-4, "gamma": 0.9}},
                          iteration=2, step=512, metrics={"episode_return": -900.25})
    # by hand: ||[3,5]-[3,4]|| / ||[3,4]|| = 1/5; b was all zeros and moved -> inf
    m2 = versions.read_manifest(tmp_path, "v000002")
    assert m2["layer_change"] == {"learner.params.b": float("inf"), "learner.params.w": pytest.approx(0.2)}
    d = versions.diff_versions(tmp_path, "v000001", "v000002")
    assert d["layers"]["learner.params.w"] == pytest.approx(0.2) and d["steps"] == 256
    assert d["hyperparameters"] == {"lr": [1e-3, 5e-4]}
    # reversed: ||[3,4]-[3,5]|| / ||[3,5]|| = 1/sqrt(34); ||[0,0]-[1,0]|| / 1 = 1
    back = versions.diff_versions(tmp_path, "v000002", "v000001")["layers"]
    assert back["learner.params.w"] == pytest.approx(34 ** -0.5) and back["learner.params.b"] == pytest.approx(1.0)

    assert cli.main(["versions", "list", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:6] == ["v000001", "main", "-", "1", "256", "-1200"]
    assert lines[2].startswith("*>v000002") and lines[2].split()[1:6] == ["main", "v000001", "2", "512", "-900.2"]
    assert cli.main(["versions", "list", str(tmp_path), "--json"]) == 0
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in rows] == ["v000001", "v000002"] and rows[1]["head_of"] == ["main"]
    assert cli.main(["versions", "show", str(tmp_path), "v000002"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["parent"] == "v000001" and shown["meta"]["config"]["lr"] == 5e-4 and shown["metrics"]["episode_return"] == -900.25
    assert shown["tensors"]["learner.params.w"].startswith("float32[2] ")
    assert cli.main(["versions", "diff", str(tmp_path), "v000001", "v000002"]) == 0
    out = capsys.readouterr().out
    assert "learner.params.b  inf\nlearner.params.w  0.2\n" in out
    assert "lr: 0.001 -> 0.0005" in out and "gamma" not in out
    assert cli.main(["versions", "diff", str(tmp_path), "v000001", "v000002", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"]["learner.params.w"] == pytest.approx(0.2)


# ------------------------------------------------------------------------------ rollback + exact resume


def test_rollback_branches_and_resume_continues_exactly_from_the_version(tmp_path):
    config = preset("Pendulum-v1", total_steps=4 * 128, **TINY)
    run = tmp_path / "run"
    full = train(config, run, progress=False, tensorboard=False, evaluate=False)  # the uninterrupted run through v000002
    assert [m["id"] for m in versions.list_versions(run)] == ["v000001", "v000002", "v000003", "v000004"]
    assert cli.main(["versions", "rollback", str(run), "v000002", "--branch", "retry"]) == 0
    assert versions.current_branch(run) == "retry" and versions.branch_heads(run)["retry"] == "v000002"
    resumed = train(config, run, resume=True, progress=False, tensorboard=False, evaluate=False)
    assert int(resumed.state["iteration"]) == 4
    a, b = _leaves(full.state), _leaves(resumed.state)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    listed = versions.list_versions(run)
    assert [(m["id"], m["branch"], m["parent"]) for m in listed[4:]] == [
        ("v000005", "retry", "v000002"), ("v000006", "retry", "v000005")]
    # nothing deleted: the abandoned versions are there and equal to the new ones, blob for blob
    assert [m["branch"] for m in listed[:4]] == ["main"] * 4
    assert listed[2]["tensors"] == listed[4]["tensors"] and listed[3]["tensors"] == listed[5]["tensors"]
    assert (run / "versions" / "branches" / "retry.previous-metrics.jsonl").read_text().count("\n") == 4
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert versions.branch_heads(run) == {"main": "v000004", "retry": "v000006"}


def test_a_rollback_onto_another_branch_brings_back_that_versions_own_metrics(tmp_path):
    """Versions pass: main ran iterations 1-6; a rollback to v000002 (branch b1) resumed to 4; a rollback to
    main's v000005 (b2) then kept b1's lines 1-4 and lost main's line 5 (metrics.jsonl held b1's line 3 and 4
    where v000005's history has main's). Now the lines are main's 1-5, then b2's 6."""
    config = preset("Pendulum-v1", total_steps=6 * 128, **TINY)
    run = tmp_path / "run"
    train(config, run, progress=False, tensorboard=False, evaluate=False)
    main = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert cli.main(["versions", "rollback", str(run), "v000002", "--branch", "b1"]) == 0
    train(config, run, resume=True, max_iterations=2, progress=False, tensorboard=False, evaluate=False)  # b1: 3, 4
    b1 = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in b1] == [1, 2, 3, 4] and b1[2]["time"] != main[2]["time"]  # b1's own 3 and 4
    assert cli.main(["versions", "rollback", str(run), "v000005", "--branch", "b2"]) == 0
    train(config, run, resume=True, progress=False, tensorboard=False, evaluate=False)
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[:5] == main[:5]  # v000005's own history, line for line
    assert [(m["id"], m["branch"], m["parent"]) for m in versions.list_versions(run)][-1] == ("v000009", "b2", "v000005")
    # the branch left (b1) keeps its lines beside the store
    kept = (run / "versions" / "branches" / "b2.previous-metrics.jsonl").read_text().splitlines()
    assert [json.loads(l) for l in kept] == b1


def test_resume_takes_a_version_newer_than_the_latest_snapshot(tmp_path):
    # killed after iteration 3's version but before its snapshot (the last one is at iteration 2)
    import shutil

    from rlfunc.run import resume_source

    config = preset("Pendulum-v1", total_steps=4 * 128, **dict(TINY, checkpoint_every=2))
    run = tmp_path / "run"
    part = train(config, run, max_iterations=3, progress=False, tensorboard=False, evaluate=False)
    shutil.rmtree(run / "checkpoints" / "step_000000000384")  # the snapshot the kill prevented
    (run / "checkpoints" / "latest").write_text("step_000000000256\n")
    assert resume_source(run) == ("version", "v000003")
    loaded = train(config, run, resume=True, max_iterations=0, progress=False, tensorboard=False, evaluate=False)
    for key, value in _leaves(part.state).items():
        assert torch.equal(value, loaded.state.get(key)), key


# ------------------------------------------------------------------------------ retention + GC


def test_retention_keeps_the_policy_set_and_gc_deletes_only_unreferenced_blobs(tmp_path):
    shared = torch.full((3,), 7.0)
    for i in range(1, 11):  # main: iterations 1..10, each with its own w and the shared tensor
        versions.save_version(tmp_path, _state([float(i), 0.0], [0.0], extra=shared), {}, iteration=i, step=i)
    versions.pin(tmp_path, "v000002")
    versions.rollback(tmp_path, "v000005", branch="alt")
    for i in (6, 7):
        versions.save_version(tmp_path, _state([float(i), 1.0], [0.0], extra=shared), {}, iteration=i, step=i)
    blobs_before = set(_blobs(tmp_path))
    assert len(_packs(tmp_path)) == 12
    deleted = versions.apply_retention(tmp_path, keep_last=2, keep_every=4)
    kept = [m["id"] for m in versions.list_versions(tmp_path)]
    # main: last 2 (v9, v10), multiples of 4 (v4, v8), pinned v2, branch base v5 (also pinned by rollback);
    # alt: last 2 (v11, v12)
    assert kept == ["v000002", "v000004", "v000005", "v000008", "v000009", "v000010", "v000011", "v000012"]
    assert deleted == ["v000001", "v000003", "v000006", "v000007"]
    listed = versions.list_versions(tmp_path)
    assert set(_packs(tmp_path)) == {s["pack"] for m in listed for s in m["tensors"].values()}
    left = set(_blobs(tmp_path))
    assert left - {s["blob"] for m in listed for s in m["tensors"].values()} == {versions.tensor_hash(torch.tensor([1.0, 0.0]))}
    # exactly the w tensors of v3, v6, v7 (main) went with their packs; v1's pack stays, as it holds
    # the shared tensor and the zero bias every kept version uses (its w goes along, unreferenced)
    assert blobs_before - left == {versions.tensor_hash(torch.tensor([float(i), 0.0])) for i in (3, 6, 7)}
    assert len(_packs(tmp_path)) == 12 - 3
    for vid in kept:
        versions.load_version(tmp_path, vid)
    assert versions.collect_garbage(tmp_path) == (0, 0)
    # an orphan pack (a crash between pack and manifest) is collected; nothing referenced is
    orphan = tmp_path / "versions" / "packs" / ("0" * 64 + ".safetensors")
    orphan.write_bytes(b"x" * 10)
    assert versions.collect_garbage(tmp_path) == (1, 10) and not orphan.exists()


def test_a_version_retired_while_it_is_read_is_named_so_not_as_a_damaged_pack(tmp_path, monkeypatch):
    # Regression (filesystem pass): `rlfunc eval --version V` beside a running run whose retention deleted V
    # after its manifest was read reported "pack ... is missing / unreadable", as if the store were damaged
    for i in (1, 2, 3):  # no tensor shared: retiring a version deletes its pack
        state = _state([float(i), 0.0], [float(i)])
        state["const"] = torch.full((2, 3), i)
        versions.save_version(tmp_path, state, {}, iteration=i, step=i)
    read = versions.read_manifest

    def read_then_retire(run_dir, version):
        manifest = read(run_dir, version)
        versions.apply_retention(run_dir, keep_last=1)  # the run's retention, between the two reads
        return manifest

    monkeypatch.setattr(versions, "read_manifest", read_then_retire)
    with pytest.raises(CheckpointError, match=r"v000001 was deleted while it was read .*rlfunc versions list"):
        versions.load_version(tmp_path, "v000001")
    monkeypatch.setattr(versions, "read_manifest", read)
    versions.load_version(tmp_path, "v000003")  # the kept one reads
    (tmp_path / "versions" / "packs" / next(iter(_packs(tmp_path)))).with_suffix(".safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unreadable"):  # a damaged pack of a listed version is still named so
        versions.load_version(tmp_path, "v000003")


# ------------------------------------------------------------------------------ crash safety

def _writer(run: Path, start: int) -> None:
    """Child process: write versions in a loop (large enough that most time is spent writing)."""
    g = torch.Generator().manual_seed(start)
    for i in range(start, start + 10_000):
        state = TensorDict({"learner": {"params": {"w": torch.randn(128, 128, generator=g), "b": torch.randn(128, generator=g)}},
                            "big": torch.randn(2, 128, 128, generator=g), "const": torch.ones(64)}, [])
        versions.save_version(run, state, {"i": i}, iteration=i, step=i, keep_last=3, keep_every=7)


def _fork(target, *args) -> int:
    """Run ``target(*args)`` in a forked child (no re-import of torch); returns its pid. The child
    exits with 0 when ``target`` returns, with 1 (its traceback on the inherited stderr) when it raises."""
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            torch.set_num_threads(1)
            target(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _kill_when(pid: int, manifests: Path, count: int, extra_s: float) -> None:
    """SIGKILL the child process ``pid`` ``extra_s`` after ``count`` manifests exist (or after 60 s); a child
    that died of an error before that fails the test (its traceback is in the captured stderr)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(manifests.glob("v*.json"))) < count:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the forked run failed (status {status})"
            return
        time.sleep(0.01)
    time.sleep(extra_s)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _check_store(run) -> list[dict]:
    listed = versions.list_versions(run)  # every manifest parses and matches its sha256
    for m in listed:
        versions.load_version(run, m["id"])  # every blob present and hash-verified
    ids = {m["id"] for m in listed}
    newest = {}
    for m in listed:
        assert m["parent"] is None or int(m["parent"][1:]) < int(m["id"][1:])
        newest[m["branch"]] = m["id"]
    assert all(m["parent"] in ids for m in listed if m["id"] in newest.values() and m["parent"])  # heads' parents kept
    return listed


def test_sigkill_at_random_moments_leaves_only_complete_versions(tmp_path):
    rng = random.Random(0)
    run = tmp_path / "run"
    start = 1
    for _ in range(4):
        pid = _fork(_writer, run, start)
        _kill_when(pid, run / "versions" / "manifests", 1, rng.uniform(0.0, 0.3))
        listed = _check_store(run)
        start = listed[-1]["iteration"] + 1
    # the next writer cleans the dead writers' temp files; its retention collects their orphan blobs
    state = TensorDict({"learner": {"params": {"w": torch.zeros(2)}}}, [])
    versions.save_version(run, state, {}, iteration=start, step=start, keep_last=3, keep_every=7)
    root = run / "versions"
    assert not list(root.rglob(".tmp-*"))
    referenced = {s["pack"] for m in _check_store(run) for s in m["tensors"].values()}
    assert set(_packs(run)) == referenced


def test_sigkill_during_training_then_resume(tmp_path):
    run = tmp_path / "run"
    overrides = dict(TINY, num_epochs=1, checkpoint_every=3, total_steps=100_000)
    config = preset("Pendulum-v1", **overrides)
    # a fresh interpreter, not a fork: once this process has run a backward pass on an accelerator
    # (a GPU machine's test session, device auto), autograd refuses to run in a forked child
    # (https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork); the child's traceback goes to stderr
    code = ("from rlfunc.algos.ppo import preset; from rlfunc.run import train; "
            f"train(preset('Pendulum-v1', **{overrides!r}), {str(run)!r}, progress=False, tensorboard=False)")
    pid = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                           env={**os.environ, "OMP_NUM_THREADS": "1"}).pid
    _kill_when(pid, run / "versions" / "manifests", 4, random.Random(1).uniform(0.0, 0.1))
    listed = _check_store(run)
    assert len(listed) >= 4
    resumed = train(config, run, resume=True, max_iterations=1, progress=False, tensorboard=False, evaluate=False)
    assert int(resumed.state["iteration"]) == listed[-1]["iteration"] + 1
    assert versions.list_versions(run)[-1]["parent"] == listed[-1]["id"]


# ------------------------------------------------------------------------------ corruption, CLI errors


def test_corrupt_blob_or_manifest_is_named(tmp_path):
    versions.save_version(tmp_path, _state([3.0, 4.0], [0.0]), {}, iteration=1, step=1)
    m = versions.save_version(tmp_path, _state([3.0, 5.0], [0.0]), {}, iteration=2, step=2)  # its pack: w alone
    digest, pack = m["tensors"]["learner.params.w"]["blob"], m["tensors"]["learner.params.w"]["pack"]
    path = tmp_path / "versions" / "packs" / f"{pack}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # a flipped bit in the tensor bytes
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"blob {digest[:16]}.*key 'learner.params.w'.*hash mismatch"):
        versions.load_version(tmp_path, "v000002")
    versions.load_version(tmp_path, "v000001")  # the other version does not use that pack
    path.write_bytes(b"\x10" + bytes(data[1:]))  # a broken header
    with pytest.raises(CheckpointError, match=rf"blob {digest[:16]}.*pack .* is unreadable"):
        versions.load_version(tmp_path, "v000002")
    path.unlink()
    with pytest.raises(CheckpointError, match=rf"blob {digest[:16]}.*missing"):
        versions.load_version(tmp_path, "v000002")
    manifest = tmp_path / "versions" / "manifests" / "v000001.json"
    original = manifest.read_text()
    manifest.write_text(original.replace('"step": 1', '"step": 2'))
    with pytest.raises(CheckpointError, match="v000001.json: sha256 mismatch"):
        versions.list_versions(tmp_path)
    # a well-hashed manifest that points outside the store is refused before any file is opened
    record = json.loads(original)
    record["tensors"]["const"]["pack"] = "../../../etc/passwd"
    record["manifest_sha256"] = versions._record_hash(record)
    manifest.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="v000001.json: malformed manifest"):
        versions.load_version(tmp_path, "v000001")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["list", "{missing}"], "no such directory"),
        (["list", "{empty}"], "holds no versions"),
        (["show", "{run}", "v000009"], "version 'v000009' is not in"),
        (["show", "{run}", "latest"], "expected an id like 'v000012'"),
        (["diff", "{run}", "v000001", "v000042"], "version 'v000042' is not in"),
        (["rollback", "{run}", "v000007"], "version 'v000007' is not in"),
        (["rollback", "{run}", "v000001", "--branch", "main"], "branch='main'"),
        (["frobnicate", "{run}"], "got 'frobnicate'"),
        ([], "versions command: expected one of list, show, diff, rollback, pin, got nothing"),
        (["pin", "{run}", "v000003"], "version 'v000003' is not in"),
    ],
)
def test_cli_bad_inputs_give_one_line_and_exit_code_2(tmp_path, capsys, argv, message):
    run, empty = tmp_path / "run", tmp_path / "empty"
    empty.mkdir()
    versions.save_version(run, _state([1.0], [0.0]), {}, iteration=1, step=1)
    argv = [a.format(missing=tmp_path / "nope", empty=empty, run=run) for a in argv]
    assert cli.main(["versions", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlfunc: error: ") and message in err, err


# ------------------------------------------------------------------------------ freeze mode


def test_update_freeze_by_hand():
    config = preset("Pendulum-v1", freeze_threshold=0.1, freeze_window=5)
    params = TensorDict({"a": torch.tensor([[3.0, 4.0]]), "b": torch.tensor([[1.0, 0.0]]), "c": torch.tensor([[0.0]])}, [1])
    freeze = init_freeze(params)
    moved = params.clone()
    moved["a"] = torch.tensor([[3.0, 4.4]])  # 0.4 / 5 = 0.08 < 0.1 -> frozen
    moved["b"] = torch.tensor([[1.0, 0.5]])  # 0.5 / 1 = 0.5 -> trains
    new = update_freeze(freeze, moved, 5, config)  # c did not move at all -> frozen
    order = [k for k in ("a", "b", "c")]  # func.leaves order is the key order
    assert [tuple(k) if isinstance(k, tuple) else k for k in params.keys()] == order
    assert new["frozen_until"].tolist() == [10, 0, 10]
    assert torch.equal(new["reference", "a"], moved["a"])
    # at 10 a and c thaw but are not re-measured (they did not train the window); b is measured again
    again = update_freeze(new, moved, 10, config)
    assert again["frozen_until"].tolist() == [10, 15, 10]  # b did not move in 5..10 -> frozen
    # never all leaves: with everything below threshold, the leaf that moved most keeps training
    everything = update_freeze(freeze, moved, 5, preset("Pendulum-v1", freeze_threshold=10.0, freeze_window=5))
    assert everything["frozen_until"].tolist() == [10, 0, 10]


def test_freeze_mode_skips_updates_of_frozen_leaves_and_resumes_exactly(tmp_path):
    config = preset("Pendulum-v1", total_steps=4 * 128, freeze_threshold=10.0, freeze_window=2, **TINY)
    full = train(config, tmp_path / "full", progress=False, tensorboard=False, evaluate=False)
    listed = versions.list_versions(tmp_path / "full")
    records = [json.loads(l) for l in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    # 13 leaves; the 6 weights freeze; the biases and log_std started at 0, so their change is inf
    assert [r["frozen_leaves"] for r in records] == [0, 0, 6, 6]
    changes = listed[3]["layer_change"]  # iteration 4 vs 3: frozen leaves did not move, blob for blob
    assert {k for k, v in changes.items() if v == 0.0} == {k for k in changes if k.endswith("weight")}
    assert listed[3]["written"]["blobs"] < listed[1]["written"]["blobs"]
    tracker, _ = versions.load_version(tmp_path / "full", "v000002")
    params = func.leaves(full.state["params"])
    frozen = [p.numel() for p, u in zip(params, tracker["freeze", "frozen_until"].tolist()) if u == 4]
    assert len(frozen) == 6 and records[2]["frozen_fraction"] == pytest.approx(sum(frozen) / sum(p.numel() for p in params))
    part = train(config, tmp_path / "part", max_iterations=3, progress=False, tensorboard=False, evaluate=False)
    assert int(part.state["iteration"]) == 3
    resumed = train(config, tmp_path / "part", resume=True, progress=False, tensorboard=False, evaluate=False)
    for key, value in _leaves(full.state).items():
        assert torch.equal(value, resumed.state.get(key)), key


def test_freeze_mode_runs_eager_under_compile_auto_and_is_refused_under_compile_on(tmp_path, monkeypatch):
    """A freeze mask changes the stepped leaves between iterations, which a compiled step fixes: with
    --compile on the run is refused in one line; under auto a run long enough to compile runs eager (it
    crashed inside dynamo with "key 'weight' not found" before), and every leaf keeps requires_grad (the
    mask is an argument of the update, not a flag set on the leaves)."""
    import rlfunc.algos.ppo as ppo_algo

    with pytest.raises(ConfigError, match="freeze_threshold"):
        train(preset("Pendulum-v1", total_steps=2 * 128, freeze_threshold=10.0, compile="on", **TINY), tmp_path / "on",
              progress=False, tensorboard=False, evaluate=False)
    monkeypatch.setattr(ppo_algo, "AUTO_COMPILE_STEPS", 1)  # auto compiles any run now
    config = preset("Pendulum-v1", total_steps=3 * 128, freeze_threshold=10.0, freeze_window=1, compile="auto", **TINY)
    result = train(config, tmp_path / "auto", progress=False, tensorboard=False, evaluate=False)
    records = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["frozen_leaves"] == 0 and all(r["frozen_leaves"] >= 6 for r in records[1:])
    assert "compile_s" not in records[0]
    assert all(p.requires_grad for p in func.leaves(result.state["params"]))


def test_freeze_with_the_adaptive_clip_keeps_the_snapshot_structure_and_resumes_exactly(tmp_path):
    """The trust region re-anchored every update over the unfrozen leaves only, so a run with frozen
    leaves saved a shaping state that no fresh run has: eval, resume and the final evaluation refused
    it ("key 'learner.shaping.transform.0.actor/0/weight.anchor' ... not in the snapshot")."""
    config = preset("Pendulum-v1", total_steps=4 * 128, freeze_threshold=10.0, freeze_window=2, adaptive_clip=True, **TINY)
    full = train(config, tmp_path / "full", progress=False, tensorboard=False, evaluate=False)
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["frozen_leaves"] > 0
    train(config, tmp_path / "part", max_iterations=3, progress=False, tensorboard=False, evaluate=False)
    resumed = train(config, tmp_path / "part", resume=True, progress=False, tensorboard=False, evaluate=False)
    for key, value in _leaves(full.state).items():
        assert torch.equal(value, resumed.state.get(key)), key


def test_resume_with_a_snapshot_of_another_branch_is_refused_in_one_line(tmp_path, capsys):
    # Regression (new-user pass): after a rollback, `rlfunc resume RUN_DIR --snapshot step_<later>` silently
    # continued from the rolled-back version, not from the snapshot it was given
    from rlfunc.run import checkpoint

    run = tmp_path / "run"
    config = preset("Pendulum-v1", total_steps=3 * 128, version_every=1, **{**TINY, "checkpoint_every": 1})
    train(config, run, progress=False, tensorboard=False, evaluate=False)
    latest = checkpoint.latest_snapshot(run)
    versions.rollback(run, "v000001")
    capsys.readouterr()
    assert cli.main(["resume", str(run), "--snapshot", latest.name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--snapshot {latest.name}" in err[0] and "v000001" in err[0], err
    assert checkpoint.latest_snapshot(run) == latest  # 'latest' names what it named


def test_eval_of_a_version_and_after_a_rollback(tmp_path, capsys):
    """`rlfunc eval RUN --version ID` evaluates that version: what a run stopped at that iteration
    evaluates (the same deterministic episodes); after a rollback a plain `rlfunc eval RUN` evaluates
    the head version `rlfunc resume` would continue from (the bug: it evaluated the abandoned branch's
    latest snapshot, without a word)."""
    config = preset("Pendulum-v1", total_steps=3 * 128, eval_episodes=3, **TINY)
    train(config, tmp_path / "run", progress=False, tensorboard=False, evaluate=False)
    once = train(preset("Pendulum-v1", total_steps=128, eval_episodes=3, **TINY), tmp_path / "once",
                 progress=False, tensorboard=False).evaluation

    def evaluate(*argv):
        assert cli.main(["eval", str(tmp_path / "run"), *argv]) == 0
        return json.loads(capsys.readouterr().out)

    latest = evaluate()
    assert latest["env_steps"] == 3 * 128 and "version" not in latest
    v1 = evaluate("--version", "v000001")
    assert v1 == {**once, "version": "v000001"} and v1 != {**latest, "version": "v000001"}
    assert cli.main(["versions", "rollback", str(tmp_path / "run"), "v000001"]) == 0
    capsys.readouterr()
    assert evaluate() == v1
    assert cli.main(["eval", str(tmp_path / "run"), "--version", "v000009"]) == 2
    assert "v000009" in capsys.readouterr().err


def test_final_evaluation_after_a_rollback_is_of_the_state_the_run_continued_from(tmp_path, capsys):
    """Regression: after ``versions rollback RUN V`` to a version whose budget is done, a plain
    ``rlfunc resume RUN`` has nothing to run and evaluates; eval.json was the newest snapshot on disk
    (the abandoned branch's, 5 iterations in), not V's state (3 iterations in) the run continues from."""
    run = tmp_path / "run"
    config = preset("Pendulum-v1", total_steps=3 * 128, eval_episodes=3, version_every=1, **TINY)
    train(config, run, progress=False, tensorboard=False, evaluate=False)
    train(config, run, resume=True, total_steps=5 * 128, progress=False, tensorboard=False, evaluate=False)
    assert cli.main(["eval", str(run), "--version", "v000003"]) == 0
    v3 = json.loads(capsys.readouterr().out)
    assert cli.main(["versions", "rollback", str(run), "v000003"]) == 0
    assert cli.main(["resume", str(run)]) == 0
    capsys.readouterr()
    final = json.loads((run / "eval.json").read_text())
    assert final["env_steps"] == 3 * 128
    assert {**final, "version": "v000003"} == v3


def test_a_damaged_manifest_blocks_neither_resume_nor_new_versions(tmp_path):
    """Regression: one edited manifest made every resume, eval and new version fail (the head was
    looked up over all manifests, each verified). Now it is passed over with a warning naming it; the
    run resumes from its intact snapshot to the uninterrupted result, new versions never reuse its
    id, and retention deletes no pack while it is there."""
    config = preset("Pendulum-v1", total_steps=4 * 128, version_every=1, **TINY)
    full = train(config, tmp_path / "full", progress=False, tensorboard=False, evaluate=False)
    run = tmp_path / "run"
    train(config, run, max_iterations=3, progress=False, tensorboard=False, evaluate=False)
    damaged = run / "versions" / "manifests" / "v000003.json"
    damaged.write_text(damaged.read_text().replace('"iteration": 3', '"iteration": 9'))
    before = damaged.read_bytes()
    with pytest.warns(UserWarning, match="v000003.json: sha256 mismatch.*skipped"):
        resumed = train(None, run, resume=True, progress=False, tensorboard=False, evaluate=False)
    for key, value in _leaves(full.state).items():
        assert torch.equal(value, resumed.state.get(key)), key
    assert damaged.read_bytes() == before
    ids = sorted(p.name for p in (run / "versions" / "manifests").iterdir())
    assert ids == ["v000001.json", "v000002.json", "v000003.json", "v000004.json"]
    packs = set((run / "versions" / "packs").iterdir())
    with pytest.warns(UserWarning, match="v000003.json"):
        assert versions.apply_retention(run, keep_last=1) == ["v000001", "v000002"]
    assert set((run / "versions" / "packs").iterdir()) == packs  # v000003's packs are unknown: none deleted
    with pytest.raises(CheckpointError, match="v000003.json: sha256 mismatch"):
        versions.list_versions(run)  # the listing names it


def test_rollback_to_a_version_with_a_damaged_pack_is_refused(tmp_path):
    """Regression: rollback to a version whose pack was truncated succeeded, and the next resume failed."""
    versions.save_version(tmp_path, _state([3.0, 4.0], [0.0]), {}, iteration=1, step=1)
    m = versions.save_version(tmp_path, _state([3.0, 5.0], [0.0]), {}, iteration=2, step=2)
    pack = tmp_path / "versions" / "packs" / f"{m['tensors']['learner.params.w']['pack']}.safetensors"
    pack.write_bytes(pack.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match="of v000002, key 'learner.params.w'"):
        versions.rollback(tmp_path, "v000002")
    assert versions.current_branch(tmp_path) == "main" and not (tmp_path / "versions" / "branches").exists()
    assert versions.rollback(tmp_path, "v000001") == "from-v000001"


def test_list_and_diff_get_past_damage_that_is_not_theirs(tmp_path, capsys):
    """Regression (new-user pass): `versions list` failed on one damaged manifest, and `versions diff`
    on a damaged non-parameter blob (a replay buffer's) though it compares the weights only."""
    versions.save_version(tmp_path, _state([3.0, 4.0], [0.0]), {}, iteration=1, step=1)
    versions.save_version(tmp_path, _state([3.0, 5.0], [0.0], extra=torch.ones(3)), {}, iteration=2, step=2)
    m = versions.save_version(tmp_path, _state([3.0, 5.0], [0.0], extra=torch.zeros(3)), {}, iteration=3, step=3)
    pack = tmp_path / "versions" / "packs" / f"{m['tensors']['extra']['pack']}.safetensors"
    assert all(spec["pack"] != m["tensors"]["extra"]["pack"] for k, spec in m["tensors"].items() if k != "extra")
    data = pack.read_bytes()
    pack.write_bytes(data[:-1] + bytes([data[-1] ^ 0x40]))  # the buffer's blob is corrupt
    with pytest.raises(CheckpointError, match="key 'extra'.*hash mismatch"):
        versions.load_version(tmp_path, "v000003")
    d = versions.diff_versions(tmp_path, "v000001", "v000003")
    assert d["layers"]["learner.params.w"] == pytest.approx(1.0 / 5.0) and d["layers"]["learner.params.b"] == 0.0
    manifest = tmp_path / "versions" / "manifests" / "v000001.json"
    manifest.write_text(manifest.read_text()[:200])
    capsys.readouterr()
    with pytest.warns(UserWarning, match="v000001.json: unreadable manifest"):
        assert cli.main(["versions", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0].strip("*>") for line in out.splitlines()[1:]] == ["v000002", "v000003"]


def test_a_truncated_pack_is_not_reused_by_new_versions(tmp_path):
    """Regression (new-user pass): versions reuse stored tensors by content hash, and a truncated pack
    was reused by every version written after it, none of which could then be loaded."""
    versions.save_version(tmp_path, _state([3.0, 4.0], [0.0]), {}, iteration=1, step=1)
    m = versions.save_version(tmp_path, _state([3.0, 5.0], [0.0]), {}, iteration=2, step=2)
    shared = m["tensors"]["const"]["pack"]  # const and b are v000001's, reused by v000002
    assert shared == m["tensors"]["learner.params.b"]["pack"] != m["tensors"]["learner.params.w"]["pack"]
    pack = tmp_path / "versions" / "packs" / f"{shared}.safetensors"
    pack.write_bytes(pack.read_bytes()[:-8])
    new = versions.save_version(tmp_path, _state([3.0, 6.0], [0.0]), {}, iteration=3, step=3)
    assert new["tensors"]["const"]["pack"] != shared and new["written"]["blobs"] == 3
    state, _ = versions.load_version(tmp_path, new["id"])
    assert torch.equal(state["const"], torch.arange(6).reshape(2, 3)) and state["learner", "params", "w"].tolist() == [3.0, 6.0]


def test_rollback_and_pin_wait_for_no_run_and_name_a_store_they_cannot_write(tmp_path, monkeypatch, capsys):
    """New-user pass: `rlfunc versions rollback` while `rlfunc resume` trained the run was accepted; the
    running process wrote its next versions into the new branch, parented on the rollback's version,
    and the rollback was lost. And a read-only run dir was a PermissionError traceback."""
    from rlfunc.run.checkpoint import hold_run_dir

    v1 = versions.save_version(tmp_path, _state([3.0, 4.0], [0.0]), {"config": {"lr": 1.0}}, iteration=1, step=10)
    versions.save_version(tmp_path, _state([3.0, 5.0], [0.0]), {"config": {"lr": 1.0}}, iteration=2, step=20)
    with hold_run_dir(tmp_path):  # as a training process holds it
        for call in (lambda: versions.rollback(tmp_path, v1["id"]), lambda: versions.pin(tmp_path, v1["id"])):
            with pytest.raises(ConfigError, match="another process is running this run; wait for it to end"):
                call()
        assert cli.main(["versions", "rollback", str(tmp_path), v1["id"]]) == 2
        assert "another process is running this run" in capsys.readouterr().err
    assert versions.current_branch(tmp_path) == versions.MAIN and not (tmp_path / "versions" / "pinned").exists()

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "versions" / "branches"))

    monkeypatch.setattr(versions, "_atomic_write", read_only)
    for call in (lambda: versions.rollback(tmp_path, v1["id"]), lambda: versions.pin(tmp_path, v1["id"])):
        with pytest.raises(CheckpointError, match=r"cannot write its version store \(.*Permission denied"):
            call()
    monkeypatch.undo()
    assert versions.rollback(tmp_path, v1["id"]) == f"from-{v1['id']}"  # with no one holding it: as before
    with pytest.raises(CheckpointError, match="no such directory"):
        versions.rollback(tmp_path / "nope", v1["id"])


def test_a_replay_buffer_is_stored_in_row_blocks_that_versions_share(tmp_path, capsys):
    """Versions pass: an off-policy run's buffer key is one tensor of every filled row, new each iteration,
    so each version stored the whole buffer anew. Rows past BLOCK_ROWS are stored in blocks: a version
    writes the blocks its iteration changed, and a load joins them back, exactly."""
    g = torch.Generator().manual_seed(0)
    n = 2 * versions.BLOCK_ROWS + 100  # three blocks
    rows = torch.randn(n, 3, generator=g)
    first = _state([1.0], [0.0], extra=rows.clone())
    versions.save_version(tmp_path, first, {}, iteration=1, step=1)
    rows[-10:] += 1.0  # the iteration wrote the last rows (the ring buffer's cursor) and the weights
    second = versions.save_version(tmp_path, _state([2.0], [0.0], extra=rows.clone()), {}, iteration=2, step=2)
    assert sorted(k for k in second["tensors"] if k.startswith("extra")) == ["extra..0", "extra..1", "extra..2"]
    assert second["written"]["blobs"] == 2  # the weights' changed blob and the last block, not the whole buffer
    assert second["written"]["bytes"] < 4 * 200 * 3 + 1000
    loaded, _ = versions.load_version(tmp_path, "v000002", like=_state([2.0], [0.0], extra=rows))
    assert torch.equal(loaded["extra"], rows) and torch.equal(versions.load_version(tmp_path, "v000001")[0]["extra"], first["extra"])
    assert cli.main(["versions", "show", str(tmp_path), "v000002"]) == 0
    shown = json.loads(capsys.readouterr().out)["tensors"]
    assert shown["extra"] == f"float32[{n}, 3] in 3 blocks of <= {versions.BLOCK_ROWS} rows" and "extra..0" not in shown
    # a block gone from the manifest (a damaged one) is named, not a silently shorter buffer
    with pytest.raises(CheckpointError, match=r"the blocks of 'extra' are \[0, 2\], expected 0..1"):
        versions._joined_blocks({"extra..0": rows[:2], "extra..2": rows[2:4]}, "v000002")


def test_a_corrupt_blob_of_the_head_version_does_not_stop_the_next_versions(tmp_path):
    """Versions pass: a flipped bit in the head version's parameters made every later save_version (the
    per-layer change reads the parent's tensors) fail, so a resume from an intact snapshot stopped after
    one iteration, every time. Now that version records no change against it, with a warning."""
    versions.save_version(tmp_path, _state([3.0, 4.0], [0.0]), {}, iteration=1, step=1)
    m = versions.save_version(tmp_path, _state([3.0, 5.0], [0.0]), {}, iteration=2, step=2)
    path = tmp_path / "versions" / "packs" / f"{m['tensors']['learner.params.w']['pack']}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"hash mismatch.*version v000003 records no per-layer change"):
        new = versions.save_version(tmp_path, _state([3.0, 6.0], [0.0]), {}, iteration=3, step=3)
    assert new["parent"] == "v000002" and new["layer_change"] == {}
    after = versions.save_version(tmp_path, _state([3.0, 8.0], [0.0]), {}, iteration=4, step=4)  # an intact parent again
    assert after["layer_change"]["learner.params.w"] == pytest.approx(2.0 / (9.0 + 36.0) ** 0.5)
    assert torch.equal(versions.load_version(tmp_path, "v000004")[0]["learner", "params", "w"], torch.tensor([3.0, 8.0]))


def test_a_damaged_shared_blob_is_stored_anew_not_reused(tmp_path, monkeypatch):
    """Review pass: a flipped bit in a replay-buffer block (shared by every later version: it no longer
    changes) was reused by the next version without a word, which then could not be loaded. A reused
    blob is read back once per process; a damaged one is stored anew, with a warning."""
    rows = torch.randn(2 * versions.BLOCK_ROWS, 3, generator=torch.Generator().manual_seed(1))
    versions.save_version(tmp_path, _state([1.0], [0.0], extra=rows), {}, iteration=1, step=1)
    m = versions.save_version(tmp_path, _state([2.0], [0.0], extra=rows), {}, iteration=2, step=2)
    spec = m["tensors"]["extra..0"]
    path = tmp_path / "versions" / "packs" / f"{spec['pack']}.safetensors"
    data = bytearray(path.read_bytes())  # flip a bit inside that blob's bytes, the header intact
    n = int.from_bytes(data[:8], "little")
    start = json.loads(data[8:8 + n])[spec["blob"]]["data_offsets"][0]
    data[8 + n + start + 5] ^= 0x40
    path.write_bytes(bytes(data))
    monkeypatch.setattr(versions, "_VERIFIED", set())  # a new process: nothing read back yet
    with pytest.warns(UserWarning, match=r"key 'extra..0': content hash mismatch; the pack is corrupt, so this version stores the tensor anew"):
        new = versions.save_version(tmp_path, _state([3.0], [0.0], extra=rows), {}, iteration=3, step=3)
    assert new["tensors"]["extra..0"]["pack"] != spec["pack"] and new["tensors"]["extra..1"]["pack"] == spec["pack"]
    assert torch.equal(versions.load_version(tmp_path, "v000003")[0]["extra"], rows)
    later = versions.save_version(tmp_path, _state([4.0], [0.0], extra=rows), {}, iteration=4, step=4)  # the good copy is reused
    assert later["tensors"]["extra..0"]["pack"] == new["tensors"]["extra..0"]["pack"] and later["written"]["blobs"] == 1


def test_a_branch_record_that_is_not_an_object_is_one_error(tmp_path):
    """Versions pass: a branch record of valid JSON but not an object (["v000004"]) was an AttributeError
    traceback from retention after a training iteration."""
    for i in range(3):
        versions.save_version(tmp_path, _state([float(i)], [0.0]), {}, iteration=i + 1, step=i + 1)
    versions.rollback(tmp_path, "v000001", branch="x")
    versions.rollback(tmp_path, "v000002", branch="y")
    (tmp_path / "versions" / "branches" / "x.json").write_text('["v000001"]\n')
    with pytest.raises(CheckpointError, match=r"x\.json: not a branch record \(expected a JSON object .* got a list\)"):
        versions.save_version(tmp_path, _state([7.0], [0.0]), {}, iteration=3, step=3, keep_last=2)


def test_a_reader_beside_the_writer_passes_over_manifests_retention_deleted(tmp_path, monkeypatch, recwarn):
    """Versions pass: `rlfunc versions list` beside a training run warned "unreadable manifest ...
    restore or delete the file" of versions its retention had just deleted (listed, then gone)."""
    for i in range(3):
        versions.save_version(tmp_path, _state([float(i)], [0.0]), {}, iteration=i + 1, step=i + 1)
    listing = versions._version_ids(tmp_path / "versions")
    (tmp_path / "versions" / "manifests" / "v000001.json").unlink()  # retention, between the listing and the read
    monkeypatch.setattr(versions, "_version_ids", lambda root: listing)
    assert [m["id"] for m in versions.list_versions(tmp_path, skip_bad=True)] == ["v000002", "v000003"]
    assert not [w for w in recwarn if "unreadable manifest" in str(w.message)]


def test_a_damaged_branch_record_or_head_is_named_not_dropped(tmp_path):
    """Fault pass: after a rollback, a branch record whose base was edited made save_version raise
    KeyError (after resume had silently picked main's snapshot); a deleted record or a HEAD naming a
    branch that does not exist resumed main's history, the rollback dropped without a word."""
    run = tmp_path / "run"
    for i in range(3):
        versions.save_version(run, _state([float(i)], [0.0]), {"algo": "test", "iteration": i + 1, "env_steps": 10 * (i + 1)},
                              iteration=i + 1, step=10 * (i + 1))
    branch = versions.rollback(run, "v000001")
    assert versions.head(run)["id"] == "v000001"
    record_path = run / "versions" / "branches" / f"{branch}.json"
    record = json.loads(record_path.read_text())
    record_path.write_text(json.dumps({**record, "base": "v999999"}))
    with pytest.raises(CheckpointError, match=r"base 'v999999' is not a readable version"):
        versions.head(run)
    with pytest.raises(CheckpointError, match=r"base 'v999999' is not a readable version"):
        versions.save_version(run, _state([9.0], [0.0]), {"algo": "test", "iteration": 4, "env_steps": 40}, iteration=4, step=40)
    record_path.unlink()
    with pytest.raises(CheckpointError, match=rf"names branch '{branch}', but .* is missing"):
        versions.head(run)
    (run / "versions" / "HEAD").write_text("no such/branch\n")
    with pytest.raises(CheckpointError, match=r"HEAD: 'no such/branch' is not a branch name"):
        versions.head(run)
    (run / "versions" / "HEAD").write_text("main\n")
    assert versions.head(run)["id"] == "v000003"  # main's history, asked for

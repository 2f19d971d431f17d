"""Data-parallel ppo runs end to end, launched by torchrun (gloo, 2 CPU processes): equal to the one
process that steps all the envs; a 2-rank snapshot resumes in one process; two torchrun "nodes" on
127.0.0.1; a rank killed mid-run stops the job with one line and leaves a snapshot that resumes."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlfunc.run import checkpoint

PY = sys.executable
FLAGS = ["--env", "Pendulum-v1", "--num-envs", "4", "--num-steps", "32", "--minibatch-size", "64", "--num-epochs", "2",
         "--eval-episodes", "2", "--device", "cpu", "--version-every", "0"]
# float rounding only: a sum over two halves then a mean, Chan merges of the statistics; the learner
# after 3 iterations differs from the single process's by ~1e-6, the running episode sums by ~3e-5
ATOL = 1e-4


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _rlfunc(*args, timeout=240):
    return subprocess.run([PY, "-m", "rlfunc", *args], env=_env(), capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_same_run(a: Path, b: Path) -> None:
    sa, sb = checkpoint.latest_snapshot(a), checkpoint.latest_snapshot(b)
    assert sa.name == sb.name
    ta, ma = checkpoint.load_snapshot(sa)
    tb, mb = checkpoint.load_snapshot(sb)
    assert set(ta.keys(True, True)) == set(tb.keys(True, True))
    for k in ta.keys(include_nested=True, leaves_only=True):
        x, y = ta.get(k), tb.get(k)
        if x.dtype.is_floating_point:
            torch.testing.assert_close(x, y, atol=ATOL, rtol=1e-5, msg=lambda m: f"{k}: {m}")
        else:  # generator states, counters: exact
            assert torch.equal(x, y), k
    assert [e["rng"] for e in ma["env_state"]] == [e["rng"] for e in mb["env_state"]]
    assert ma["config"] == mb["config"] or {**ma["config"], "run": None} == {**mb["config"], "run": None}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run = tmp_path_factory.mktemp("single") / "run"
    out = _rlfunc("train", "ppo", *FLAGS, "--total-steps", "384", "--run-dir", str(run))
    assert out.returncode == 0, out.stderr[-2000:]
    return run


def test_two_ranks_equal_one_process_stepping_all_the_envs_and_rank_0_alone_writes(single, tmp_path):
    run = tmp_path / "run"
    out = _rlfunc("train", "ppo", *FLAGS, "--total-steps", "384", "--nproc", "2", "--run-dir", str(run))
    assert out.returncode == 0, out.stderr[-2000:]
    _assert_same_run(single, run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2, 3]  # one writer
    assert out.stdout.count('"mean"') == 1  # rank 0 alone reports the final evaluation
    assert json.loads((run / "eval.json").read_text())["episodes"] == 2
    meta = checkpoint.load_meta(checkpoint.latest_snapshot(run))
    assert meta["world_size"] == 2 and len(meta["env_state"]) == 4
    # the bug: the evaluation kept the run's nproc=2, so an odd episode count (and 100 episodes on 3 or 8 ranks) was refused
    out = _rlfunc("eval", str(run), "--episodes", "3")
    assert out.returncode == 0 and json.loads(out.stdout)["episodes"] == 3, out.stderr[-2000:]


def test_a_two_rank_snapshot_resumes_in_one_process_as_the_uninterrupted_run(single, tmp_path):
    run = tmp_path / "run"
    script = (f"from rlfunc.algos.ppo import preset\nfrom rlfunc.run import train\n"
              f"train(preset('Pendulum-v1', num_envs=4, num_steps=32, minibatch_size=64, num_epochs=2, eval_episodes=2, "
              f"device='cpu', version_every=0, total_steps=384), {str(run)!r}, max_iterations=2, progress=False, tensorboard=False)\n")
    out = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "--no-python", PY, "-c", script], env=_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    meta = checkpoint.load_meta(checkpoint.latest_snapshot(run))
    assert meta["iteration"] == 2 and meta["config"]["run"]["nproc"] == 2  # torchrun's ranks, recorded for `rlfunc resume`
    out = _rlfunc("resume", str(run), "--nproc", "3")  # 3 ranks for 4 envs: one line before any rank starts
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith("rlfunc: error:") \
        and out.stderr.count("divide") == 1, out.stderr[-2000:]
    out = _rlfunc("resume", str(run), "--nproc", "1")  # one process: each rank's envs are back in the single process's order
    assert out.returncode == 0, out.stderr[-2000:]
    _assert_same_run(single, run)
    # the bug: the resumed run's snapshots still said nproc=2, so the next `rlfunc resume` went back to 2 ranks
    meta = checkpoint.load_meta(checkpoint.latest_snapshot(run))
    assert meta["world_size"] == 1 and meta["config"]["run"]["nproc"] == 1


def test_two_torchrun_nodes_on_one_machine_equal_one_process(single, tmp_path):
    run, port = tmp_path / "run", _free_port()
    nodes = [subprocess.Popen([PY, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test-nodes",
                               "-m", "rlfunc", "train", "ppo", *FLAGS, "--total-steps", "384", "--run-dir", str(run)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for node in nodes:
        _, err = node.communicate(timeout=240)
        assert node.returncode == 0, err[-2000:]
    _assert_same_run(single, run)


def _rank_pid(root: int, rank: int) -> int | None:
    """The pid of the worker with RANK=rank among ``root``'s descendants."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ \
                and f"TORCHELASTIC_RUN_ID".encode() in b"".join(environ) and int(proc.name) != root:
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            while ppid > 1:
                if ppid == root:
                    return int(proc.name)
                ppid = int((Path("/proc") / str(ppid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return None


def test_a_killed_rank_stops_the_job_in_one_line_and_the_snapshot_resumes(tmp_path):
    run = tmp_path / "run"
    job = subprocess.Popen([PY, "-m", "rlfunc", "train", "ppo", *FLAGS, "--total-steps", str(128 * 400), "--checkpoint-every", "1",
                            "--nproc", "2", "--run-dir", str(run)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        deadline = time.monotonic() + 180
        while checkpoint.latest_snapshot(run) is None or (run / "checkpoints").exists() and len(
                checkpoint.run_snapshots(run)) < 2:
            assert time.monotonic() < deadline and job.poll() is None, "no snapshot came"
            time.sleep(0.2)
        pid = _rank_pid(job.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, err = job.communicate(timeout=90)
        assert time.monotonic() - killed < 60
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 2
    last = [line for line in err.splitlines() if line.startswith("rlfunc: error:")]
    assert len(last) == 1 and "rank 1 of 2 failed (signal SIGKILL)" in last[0], err[-2000:]
    assert f"latest snapshot is intact: rlfunc resume {run}" in last[0]
    assert "Traceback" not in err, err[-3000:]  # the surviving rank said one line (it printed gloo's traceback)
    snap = checkpoint.latest_snapshot(run)
    checkpoint.load_snapshot(snap)  # passes its checksums
    done = checkpoint.load_meta(snap)["iteration"]
    out = _rlfunc("resume", str(run), "--total-steps", str(128 * (done + 1)))
    assert out.returncode == 0, out.stderr[-2000:]
    meta = checkpoint.load_meta(checkpoint.latest_snapshot(run))
    assert meta["iteration"] == done + 1
    assert meta["world_size"] == 2  # `rlfunc resume` of an --nproc 2 run continues on 2 ranks


def test_a_job_whose_ranks_all_refuse_the_config_says_nothing_was_saved(tmp_path):
    """3 ranks for 4 envs: each rank refuses it; the launcher's line named a snapshot to resume from,
    in a run dir that was never written. (`rlfunc train` now refuses this split before it launches,
    in one line, so the launcher is called directly here.)"""
    run = tmp_path / "r"
    command = ["train", "ppo", "--env", "Pendulum-v1", "--num-envs", "4", "--num-steps", "8", "--minibatch-size", "8",
               "--total-steps", "64", "--nproc", "3", "--run-dir", str(run)]
    out = _rlfunc(*command)
    assert out.returncode == 2 and out.stderr.count("rlfunc: error:") == 1 and "data-parallel run: rank" not in out.stderr
    assert "num_envs=4 does not divide by the 3 ranks" in out.stderr and not run.exists()
    launcher = ("import sys\nfrom rlfunc.cli.common import launch\nfrom rlfunc.errors import ConfigError\n"
                "try:\n    launch(sys.argv[2:], 3, sys.argv[1])\nexcept ConfigError as e:\n"
                "    print(f'rlfunc: error: {e}', file=sys.stderr)\n    sys.exit(2)\n")
    out = subprocess.run([PY, "-c", launcher, str(run), *command], env=_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 2
    last = [line for line in out.stderr.splitlines() if "data-parallel run: rank" in line]
    assert last and "no snapshot was written" in last[-1] and "rlfunc resume" not in last[-1], out.stderr[-2000:]
    assert "does not divide" in out.stderr
    # torch elastic's own log lines ("E1205 ... failed (exitcode: 2)") no longer follow the ranks' lines
    assert all(line.startswith("rlfunc:") for line in out.stderr.strip().splitlines()), out.stderr[-2000:]


def test_ctrl_c_to_a_data_parallel_job_saves_and_exits_130_without_a_traceback(tmp_path):
    """SIGINT to the process group (Ctrl-C): the ranks save and say so; the launcher exited 1 with
    torch's SignalException traceback before."""
    run = tmp_path / "run"
    job = subprocess.Popen([PY, "-m", "rlfunc", "train", "ppo", *FLAGS, "--total-steps", str(128 * 400), "--checkpoint-every", "50",
                            "--nproc", "2", "--run-dir", str(run)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
            assert time.monotonic() < deadline and job.poll() is None, "no iteration came"
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGINT)
        _, err = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "snapshot saved" in err, err[-2000:]
    assert checkpoint.latest_snapshot(run) is not None


def test_resume_of_a_two_rank_run_whose_latest_snapshot_is_truncated_points_to_the_older_one(tmp_path):
    """The launcher's last line said "the run dir's latest snapshot is intact: rlfunc resume RUN" about
    the very snapshot the ranks had refused; the ranks' own lines name the older snapshot to use."""
    run = tmp_path / "run"
    out = _rlfunc("train", "ppo", *FLAGS, "--total-steps", str(128 * 2), "--checkpoint-every", "1", "--nproc", "2",
                  "--run-dir", str(run))
    assert out.returncode == 0, out.stderr[-2000:]
    latest = checkpoint.latest_snapshot(run)
    state = latest / "state.safetensors"
    state.write_bytes(state.read_bytes()[:100])
    out = _rlfunc("resume", str(run))
    assert out.returncode == 2
    last = [line for line in out.stderr.splitlines() if "data-parallel run: rank" in line]
    assert last and "is intact" not in last[-1] and "errors are above" in last[-1], out.stderr[-2000:]
    assert "--snapshot step_" in out.stderr


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie left to a reaper that does not reap counts as exited)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_sigkilled_launcher_stops_its_ranks_and_they_save_a_snapshot(tmp_path):
    """SIGKILL to `rlfunc train --nproc 2` (the ranks' parent): the ranks trained on, orphaned, until
    their budget ran out. Now each gets SIGTERM, saves a snapshot after its iteration and exits."""
    run = tmp_path / "run"
    job = subprocess.Popen([PY, "-m", "rlfunc", "train", "ppo", *FLAGS, "--total-steps", str(128 * 4000), "--checkpoint-every", "1000",
                            "--nproc", "2", "--run-dir", str(run)], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = []
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
            assert time.monotonic() < deadline and job.poll() is None, "no iteration came"
            time.sleep(0.2)
        ranks = [_rank_pid(job.pid, r) for r in (0, 1)]
        assert None not in ranks
        assert checkpoint.latest_snapshot(run) is None  # the only snapshot can come from the stop
        job.kill()
        job.wait(timeout=30)
        killed = time.monotonic()
        while not all(_gone(pid) for pid in ranks):
            assert time.monotonic() - killed < 60, "the ranks outlived their launcher"
            time.sleep(0.2)
    finally:
        for pid in ranks:
            if pid is not None and not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    snap = checkpoint.latest_snapshot(run)
    assert snap is not None
    checkpoint.load_snapshot(snap)  # passes its checksums
    assert checkpoint.load_meta(snap)["iteration"] < 4000

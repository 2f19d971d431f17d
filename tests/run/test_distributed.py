"""The process group (rlfunc.run.distributed): torchrun's environment, broadcast, sync check, gather."""

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

from rlfunc.errors import ConfigError
from rlfunc.run.distributed import Distributed, DistributedError, check_backend


def _state(rank: int) -> TensorDict:
    g = torch.Generator().manual_seed(rank)
    return TensorDict({"params": {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)},
                       "rng": torch.randint(0, 255, (2, 8), dtype=torch.uint8, generator=g),
                       "iteration": torch.tensor(rank, dtype=torch.int64)}, batch_size=[])


def _ranks(dist):
    assert dist.world_size == 2 and dist.is_main == (dist.rank == 0) and dist.backend == "gloo"
    state = _state(dist.rank)
    w = state["params", "w"].requires_grad_()
    with pytest.raises(DistributedError, match=r"^before: rank \[1\] of 2 differs from rank 0 in"):
        dist.check_in_sync(state, "before")
    dist.broadcast_state(state, bucket_bytes=16)  # several buckets
    assert state["params", "w"] is w  # in place: the leaves keep their identity
    for key, value in _state(0).items(include_nested=True, leaves_only=True):
        assert torch.equal(state.get(key), value), key
    dist.check_in_sync(state, "after")  # no error
    if dist.rank == 1:
        with torch.no_grad():
            state["params", "b"][0] += 1e-6
    with pytest.raises(DistributedError, match=r"rank \[1\] of 2 differs from rank 0 in \('params', 'b'\)$"):
        dist.check_in_sync(state, "drift")
    # all_gather_batch: rank order along the given dim, every dtype
    batch = TensorDict({"obs": torch.full((2, 3, 5), float(dist.rank)), ("next", "done"): torch.full((2, 3, 1), dist.rank == 1)},
                       batch_size=[2, 3])
    out = dist.all_gather_batch(batch, dim=1)
    assert out.batch_size == torch.Size([2, 6])
    assert torch.equal(out["obs"][:, :3], torch.zeros(2, 3, 5)) and torch.equal(out["obs"][:, 3:], torch.ones(2, 3, 5))
    assert out["next", "done"].dtype == torch.bool and out["next", "done"][:, 3:].all() and not out["next", "done"][:, :3].any()
    dist.barrier()


def test_broadcast_state_check_in_sync_and_all_gather_batch(gloo):
    gloo(_ranks)


def test_from_env_without_torchrun_is_one_process_that_does_not_communicate():
    dist = Distributed.from_env("cpu", env={})
    assert (dist.rank, dist.world_size, dist.is_main, dist.active) == (0, 1, True, False)
    td = TensorDict({"x": torch.ones(2)}, batch_size=[2])
    assert dist.all_gather_batch(td) is td and dist.broadcast_state(td) is td
    dist.check_in_sync(td)
    dist.barrier()
    dist.close()
    assert not torch.distributed.is_initialized()
    assert Distributed.from_env("cpu", env={"WORLD_SIZE": "1", "RANK": "0"}).world_size == 1


@pytest.mark.parametrize("backend, message", [
    ("hccl", r"^backend='hccl': needs torch_npu"),
    ("mpi2", r"^backend='mpi2': expected one of gloo, nccl, hccl$"),
])
def test_an_unavailable_backend_is_a_one_line_config_error(backend, message):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ConfigError, match=message) as info:
        Distributed.from_env("cpu", backend=backend, env=env)
    assert "\n" not in str(info.value)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^backend='nccl': needs CUDA"):
            check_backend("nccl", torch.device("cpu"))


def test_malformed_torchrun_variables_are_config_errors():
    with pytest.raises(ConfigError, match="RANK is not set"):
        Distributed.from_env("cpu", env={"WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match=r"RANK=2: expected an integer in \[0, WORLD_SIZE=2\)"):
        Distributed.from_env("cpu", env={"WORLD_SIZE": "2", "RANK": "2"})
    with pytest.raises(ConfigError, match="MASTER_PORT is not set"):
        Distributed.from_env("cpu", env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"})


def test_a_rendezvous_on_a_port_in_use_names_the_address():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        with pytest.raises(ConfigError, match=rf"^rank 0 of 2: the rendezvous at 127.0.0.1:{port} \(gloo\) failed") as info:
            Distributed.from_env("cpu", env=env)
    assert "\n" not in str(info.value)
    assert not torch.distributed.is_initialized()


def _other_seed_per_rank(dist, run_dir):
    # two torchrun nodes started with different --seed: the ranks trained under rank 0's config.json
    # (silently), or failed iterations later as drifted parameters
    from rlfunc.algos.ppo import preset
    from rlfunc.run import train

    config = preset("Pendulum-v1", num_envs=2, num_steps=16, minibatch_size=32, num_epochs=1, total_steps=64,
                    seed=7 * dist.rank, device="cpu", version_every=0)
    with pytest.raises(DistributedError) as e:
        train(config, run_dir, progress=False, tensorboard=False)
    assert str(e.value) == ("ranks [1] of 2 were started with another config than rank 0: rank 1 has "
                            "run.seed=7 (rank 0: 0); start every rank with the same command")


def test_ranks_started_with_different_configs_stop_at_once_with_one_line(gloo, tmp_path):
    gloo(_other_seed_per_rank, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no iteration ran


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_stop_with_launcher_signals_at_once_when_the_launcher_is_already_gone():
    """A rank whose launcher died before the request (its parent is not RLFUNC_LAUNCHER_PID) would wait
    for a signal that never comes: it gets it at once. With its launcher alive it runs on."""
    code = "from rlfunc.run.distributed import stop_with_launcher\nassert stop_with_launcher()\nprint('alive')\n"
    env = {**os.environ, "RLFUNC_LAUNCHER_PID": "1"}  # never this test's parent
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGTERM and "alive" not in out.stdout, out.stderr[-1000:]
    env["RLFUNC_LAUNCHER_PID"] = str(os.getpid())
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "alive" in out.stdout, out.stderr[-1000:]

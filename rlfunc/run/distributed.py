"""The process group of a data-parallel run: torch.distributed, launched by torchrun.

``Distributed.from_env()`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), picks this rank's device (``cuda:LOCAL_RANK`` / ``npu:LOCAL_RANK`` / cpu) and its
backend (:func:`rlfunc.device.distributed_backend`: nccl, hccl, gloo) and joins the group. Without
those variables, or with WORLD_SIZE=1, it is a single-process value whose collectives return their
input and communicate nothing, so one code path serves both.

The collectives work on TensorDicts: :meth:`Distributed.broadcast_state` (rank 0's learner state to
every rank, in place), :meth:`Distributed.check_in_sync` (a cheap checksum of every rank's state
compared with rank 0's), :meth:`Distributed.all_gather_batch` (every rank's batch, concatenated in
rank order). Each packs the leaves of one dtype into a few flat buffers, so a learner state of a
hundred leaves costs a few collectives, not a hundred. They are methods, so the algorithm layer
(``rlfunc.algos``) calls them on the value it is handed without importing the run layer.

The gradient all-reduce is a link of the update chain (:func:`rlfunc.optim.all_reduce_mean`), the
merge of normaliser statistics a function of :mod:`rlfunc.core.normalize`
(:func:`~rlfunc.core.normalize.all_reduce_running_stats`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.device import distributed_backend, local_device, resolve_device
from rlfunc.errors import ConfigError, RLFuncError
from rlfunc.optim.distributed import buckets, flatten_dense, unflatten_dense

BUCKET_BYTES = 25 * 2**20  # the flat buffers of broadcast_state: at most this many bytes each (but a larger leaf)
BACKENDS = ("gloo", "nccl", "hccl")
LAUNCHER_PID = "RLFUNC_LAUNCHER_PID"  # set by `rlfunc train --nproc N` (rlfunc.cli.common.launch) for its ranks
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class DistributedError(RLFuncError, RuntimeError):
    """The ranks of a data-parallel run disagree (their states drifted apart)."""


@dataclass(frozen=True)
class Distributed:
    """This process's place in the run: ``rank`` of ``world_size`` processes, ``local_rank`` on its
    host, the process ``group`` of the collectives (None: the default group, or none at all at world
    size 1), and the ``device`` this rank computes on. Build it with :meth:`from_env`."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: no process group (world size 1)

    @classmethod
    def from_env(cls, device_name: str = "auto", *, backend: str | None = None, env: Mapping[str, str] | None = None,
                 timeout: timedelta = timedelta(minutes=5)) -> "Distributed":
        """Join the process group torchrun describes in ``env`` (default ``os.environ``).

        Args:
            device_name: a device name of :func:`rlfunc.device.resolve_device` (auto, cpu, cuda, npu); a
                rank of a multi-process run gets index LOCAL_RANK of that kind.
            backend: None (the device's: :func:`rlfunc.device.distributed_backend`), or "gloo",
                "nccl", "hccl".
            env: the variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; without
                WORLD_SIZE (or with 1) the run is a single process and nothing is initialised.
            timeout: of the rendezvous and of every collective.

        Returns:
            The Distributed value; at world size > 1 ``torch.distributed`` is initialised (an
            already initialised default group of the same size is reused).

        Raises:
            ConfigError: malformed variables, a device this machine lacks, a backend that is not
                available here (hccl without torch_npu, nccl without CUDA), or a rendezvous that
                fails (the address named).
        """
        env = os.environ if env is None else env
        world_size = _int_var(env, "WORLD_SIZE", 1)
        if world_size < 1:
            raise ConfigError(f"WORLD_SIZE={world_size}: expected >= 1")
        device = resolve_device(device_name)
        if world_size == 1:
            return cls(device=device)
        rank, local_rank = _int_var(env, "RANK", None), _int_var(env, "LOCAL_RANK", 0)
        if env is os.environ:
            stop_with_launcher()
        if not 0 <= rank < world_size:
            raise ConfigError(f"RANK={rank}: expected an integer in [0, WORLD_SIZE={world_size})")
        device = local_device(device, local_rank)
        backend = distributed_backend(device) if backend is None else backend
        check_backend(backend, device)
        if tdist.is_initialized():
            if tdist.get_world_size() != world_size or tdist.get_rank() != rank:
                raise ConfigError(f"torch.distributed is initialised as rank {tdist.get_rank()} of {tdist.get_world_size()}, "
                                  f"the environment says rank {rank} of {world_size}")
            return cls(rank, world_size, local_rank, None, device, tdist.get_backend())
        address = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name):
                raise ConfigError(f"{name} is not set: a run of WORLD_SIZE={world_size} needs torchrun's rendezvous "
                                  "(torchrun --nproc-per-node N ...)")
        # env:// reads os.environ; a mapping of one's own names the same address as tcp://
        init_method = "env://" if env is os.environ else f"tcp://{address}"
        try:
            tdist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        except (RuntimeError, ValueError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
            first = (str(e).strip().splitlines() or [""])[0]
            raise ConfigError(f"rank {rank} of {world_size}: the rendezvous at {address} ({backend}) failed: "
                              f"{type(e).__name__}: {first}") from e
        return cls(rank, world_size, local_rank, None, device, backend)

    @property
    def is_main(self) -> bool:
        """True on rank 0, the one rank that writes files."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """True when there is more than one rank (the collectives communicate)."""
        return self.world_size > 1

    def barrier(self) -> None:
        """Wait for every rank (nothing at world size 1)."""
        if self.active:
            tdist.barrier(group=self.group)

    def broadcast_state(self, td: TensorDictBase, src: int = 0, bucket_bytes: int = BUCKET_BYTES) -> TensorDictBase:
        """Every tensor leaf of ``td`` overwritten in place by rank ``src``'s, in flat buckets (one
        broadcast per bucket of a dtype, at most ``bucket_bytes`` each). The leaves keep their
        identity (parameters stay the autograd leaves the optimizer steps). Returns ``td``.

        Raises:
            ShapeError-like RuntimeError from torch when the ranks' leaves differ in shape (a
            structure mismatch, not a value one: the ranks built different states).
        """
        if not self.active:
            return td
        leaves = _leaves(td)
        with torch.no_grad():
            for idx in buckets(leaves, bucket_bytes):
                bucket = [leaves[i] for i in idx]
                flat = self._to_comm(flatten_dense([t.detach() for t in bucket]))
                tdist.broadcast(flat, src=src, group=self.group)
                for t, value in zip(bucket, unflatten_dense(flat.to(bucket[0].device), bucket)):
                    t.copy_(value)
        return td

    def check_in_sync(self, td: TensorDictBase, tag: str = "state") -> None:
        """Raise on every rank when some rank's ``td`` differs from rank 0's.

        The checksum is per leaf (sum, sum of squares) in float32, all-gathered as one vector: two
        numbers per leaf travel, not the state. Ranks that run the same ops on the same data agree
        bit for bit, so the comparison is exact (NaN equals NaN). Costs one all_gather.

        Raises:
            DistributedError: "``tag``: ranks [1, ...] differ from rank 0 in KEY, ..." (the first
                leaves that differ).
        """
        if not self.active:
            return
        keys = sorted(td.keys(include_nested=True, leaves_only=True), key=str)
        with torch.no_grad():
            parts = []
            for k in keys:
                x = td.get(k).detach().to(torch.float32)
                parts.append(torch.stack([x.sum(), x.square().sum()]))
            local = self._to_comm(torch.cat(parts) if parts else torch.zeros(0))
            gathered = [torch.empty_like(local) for _ in range(self.world_size)]
            tdist.all_gather(gathered, local, group=self.group)
            sums = torch.stack(gathered).cpu().view(self.world_size, -1, 2)
        same = (sums == sums[0]) | (sums.isnan() & sums[0].isnan())  # [W, K, 2]
        leaf_ok = same.all(-1)
        bad_ranks = [r for r in range(self.world_size) if not bool(leaf_ok[r].all())]
        if bad_ranks:
            bad_keys = [keys[i] for i in range(len(keys)) if not bool(leaf_ok[:, i].all())]
            shown = ", ".join(map(str, bad_keys[:4])) + (f" (+{len(bad_keys) - 4} more)" if len(bad_keys) > 4 else "")
            raise DistributedError(f"{tag}: rank{'s' if len(bad_ranks) > 1 else ''} {bad_ranks} of {self.world_size} "
                                   f"differ{'' if len(bad_ranks) > 1 else 's'} from rank 0 in {shown}")

    def all_gather_batch(self, td: TensorDictBase, dim: int = 0) -> TensorDictBase:
        """Every rank's ``td`` concatenated along batch dim ``dim``, in rank order: [.., B, ..] on each
        rank -> [.., W*B, ..] on every rank. The ranks' TensorDicts must have the same keys and
        shapes. One all_gather per dtype (the leaves packed into one flat buffer).

        Costs (W - 1)/W of the gathered batch's bytes per rank: small for state observations (a few
        floats a sample), a large share of a step for pixels (gather features, or indices, there).
        ``td`` itself comes back at world size 1.
        """
        if not self.active:
            return td
        ndim = len(td.batch_size)
        if not -ndim <= dim < ndim:
            raise ConfigError(f"dim={dim}: expected a batch dim of the TensorDict (batch_size {list(td.batch_size)})")
        dim = dim % ndim
        keys = list(td.keys(include_nested=True, leaves_only=True))
        leaves = [td.get(k) for k in keys]
        gathered: dict[int, Tensor] = {}
        for dtype in dict.fromkeys(t.dtype for t in leaves):
            idx = [i for i, t in enumerate(leaves) if t.dtype == dtype]
            group = [leaves[i].detach() for i in idx]
            flat = self._to_comm(flatten_dense(group))
            out = [torch.empty_like(flat) for _ in range(self.world_size)]
            tdist.all_gather(out, flat, group=self.group)
            per_rank = [unflatten_dense(o.to(group[0].device), group) for o in out]
            for j, i in enumerate(idx):
                gathered[i] = torch.cat([parts[j] for parts in per_rank], dim)
        batch_size = list(td.batch_size)
        batch_size[dim] *= self.world_size
        result = TensorDict({}, batch_size=batch_size, device=td.device)
        for i, k in enumerate(keys):
            result.set(k, gathered[i])
        return result

    def sum(self, t: Tensor) -> Tensor:
        """The sum of every rank's ``t`` (same shape everywhere), on ``t``'s device; ``t`` at world size 1."""
        if not self.active:
            return t
        out = self._to_comm(t.detach().clone())
        tdist.all_reduce(out, op=tdist.ReduceOp.SUM, group=self.group)
        return out.to(t.device)

    def gather_objects(self, obj: Any) -> list:
        """Every rank's ``obj`` (a small picklable value: env states, metadata), in rank order, on
        every rank; ``[obj]`` at world size 1. Values travel between the run's own processes only:
        nothing read from disk is unpickled."""
        if not self.active:
            return [obj]
        out: list = [None] * self.world_size
        tdist.all_gather_object(out, obj, group=self.group)
        return out

    def check_same_config(self, config: Any) -> None:
        """Raise on every rank when some rank was started with another config than rank 0 (another
        command line on another node: a different --seed trained silently under rank 0's config.json,
        a different budget failed iterations later as drifted parameters). One all_gather_object of
        the config's fields.

        Raises:
            DistributedError: "ranks [...] of W were started with another config than rank 0: FIELD ..."
        """
        if not self.active:
            return
        mine = _config_fields(config)
        every = self.gather_objects(mine)
        differ = [r for r, fields in enumerate(every) if fields != every[0]]
        if differ:
            other = every[differ[0]]
            names = [k for k in sorted(set(other) | set(every[0])) if other.get(k) != every[0].get(k)]
            shown = ", ".join(f"{k}={other.get(k)!r} (rank 0: {every[0].get(k)!r})" for k in names[:3])
            raise DistributedError(f"ranks {differ} of {self.world_size} were started with another config than rank 0: "
                                   f"rank {differ[0]} has {shown}; start every rank with the same command")

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on some rank; ``flag`` at world size 1. One
        all_reduce(MAX) of one number (a split env's "is an env of any rank done" after each step)."""
        if not self.active:
            return flag
        out = self._to_comm(torch.tensor([int(flag)], dtype=torch.int64))
        tdist.all_reduce(out, op=tdist.ReduceOp.MAX, group=self.group)
        return bool(out.item())

    def agree_stop(self, signal_name: str | None) -> str | None:
        """The stop every rank takes after this iteration: a signal's name when any rank got one
        (SIGTERM before SIGINT), else None; so all ranks stop after the same iteration and write
        the same snapshot. One all_reduce(MAX) of one number."""
        if not self.active:
            return signal_name
        code = {None: 0, "SIGINT": 1, "SIGTERM": 2}.get(signal_name, 2)
        flag = self._to_comm(torch.tensor([code], dtype=torch.int64))
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=self.group)
        return {0: None, 1: "SIGINT", 2: "SIGTERM"}[int(flag.item())]

    def close(self) -> None:
        """Leave the process group (nothing at world size 1)."""
        if self.active and tdist.is_initialized():
            tdist.destroy_process_group()

    def _to_comm(self, t: Tensor) -> Tensor:
        """``t`` on a device the backend communicates from: gloo any CPU tensor, nccl/hccl this rank's device."""
        if self.backend in ("nccl", "hccl") and t.device != self.device:
            return t.to(self.device)
        return t


def stop_with_launcher(signum: int = signal.SIGTERM) -> bool:
    """Ask Linux to send this rank ``signum`` when its parent (torchrun's elastic agent, or ``rlfunc
    train --nproc N``) dies; the run loop then saves a snapshot and stops, as on any SIGTERM. Without
    it a SIGKILLed launcher left its ranks training on, orphaned. A parent already gone before the
    request (``rlfunc``'s launcher exports its pid as RLFUNC_LAUNCHER_PID) sends the signal at once.

    Returns:
        Whether the request was made (False off Linux, where there is no PR_SET_PDEATHSIG).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    launcher = os.environ.get(LAUNCHER_PID, "")
    if launcher.isdigit() and os.getppid() != int(launcher):  # it died before the request: no signal would come
        os.kill(os.getpid(), signum)
    return True


def _config_fields(config: Any, prefix: str = "") -> dict[str, Any]:
    """A config dataclass's fields, nested ones as "run.seed", values as compared across ranks."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_config_fields(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def check_backend(backend: str, device: torch.device) -> None:
    """ConfigError, one line, unless ``backend`` can run here for ``device``."""
    if not tdist.is_available():
        raise ConfigError("this torch build has no torch.distributed")
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "gloo" and not tdist.is_gloo_available():
        raise ConfigError("backend='gloo': this torch build has no gloo")
    if backend == "nccl" and not (torch.cuda.is_available() and tdist.is_nccl_available()):
        raise ConfigError("backend='nccl': needs CUDA and a torch built with NCCL (this machine has "
                          f"{'no CUDA' if not torch.cuda.is_available() else 'no NCCL'}); use gloo on CPU")
    if backend == "hccl" and importlib.util.find_spec("torch_npu") is None:
        raise ConfigError("backend='hccl': needs torch_npu (pip install .[npu]); use gloo on CPU")
    if backend in ("nccl", "hccl") and device.type == "cpu":
        raise ConfigError(f"backend={backend!r} does not communicate CPU tensors: use gloo with device=cpu")


def _int_var(env: Mapping[str, str], name: str, default: int | None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise ConfigError(f"{name} is not set (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected an integer") from None


def _leaves(td: TensorDictBase) -> list[Tensor]:
    return [td.get(k) for k in sorted(td.keys(include_nested=True, leaves_only=True), key=str)]

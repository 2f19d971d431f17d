"""Environment worker processes: N envs stepped in K processes, N/K each, observations in shared memory.

- :class:`PartPool`: K processes, each holding one *part*, an object over its slice of the N envs
  built by a picklable factory; ``call(name, args_per_worker)`` runs a method of every part at once
  and returns their results. A method called with ``writes=True`` returns ``(observation, *rest)``:
  its Box entries (the observation itself, or each Box entry of a Dict observation, uint8 images
  included) are written into one shared buffer per entry, ``[N, *shape]`` in the entry's dtype,
  where the parent reads them (:attr:`PartPool.views`) with no copy; other entries (Text) come by
  the pipe. Workers start from multiprocessing's "forkserver" (a clean process that has imported
  torch and gymnasium once: a worker inherits neither the learner's threads nor its GL contexts,
  and starts in a fraction of a second after the first), without re-running the parent's main
  script (:func:`without_main`); each builds its own envs, so MuJoCo rendering (EGL or OSMesa,
  ``MUJOCO_GL``) gets a context per worker.
- :class:`WorkerVectorEnv`: a gymnasium ``VectorEnv`` whose K parts are each a sync vector env of N/K
  copies with SAME_STEP autoreset (:class:`VectorPart`): the same observations, rewards, flags and
  infos as one sync vector env of N for the same reset seeds and actions, and the same
  :meth:`~WorkerVectorEnv.env_state` (each part captures its envs' state in its process), so a run
  stepping its envs in workers resumes exactly. ``rlfunc.envs.collect.make_vec_env(..., workers=K)``
  builds one.
- :class:`ChunkPart` / :class:`ChunkWorkers`: the gymnasium envs of a
  :class:`rlfunc.envs.chunk.GymChunkEnv` (action chunks; Dict observations with camera images), in
  its process or in K workers (``GymChunkEnv(..., workers=K)``); the reset seeds are drawn in the
  parent, so the outputs are those of the in-process envs.

Why not gymnasium's AsyncVectorEnv: it runs one env per process, and its shared memory and step
results hold one env's per worker, so K workers would mean K envs (N processes for N envs, each
an importer of torch when the env is one of ours) rather than N/K envs each; TorchRL's ParallelEnv
over K GymChunkEnvs would give each its own reset-seed generator (other episodes than in process)
and does not carry gymnasium's vector infos. Measured (bench/env_workers.py, Push-v0 with images,
8 envs, 2 otherwise idle cores): 2 workers of ours 276 env steps/s, AsyncVectorEnv's 8 processes
284, ParallelEnv(2 x GymChunkEnv(4)) 218, in process 200; ours is as fast as one process per env
with 2 processes instead of 8, and the only one whose env state goes into snapshots.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from rlfunc.errors import EnvError


PRELOAD = ["torch", "gymnasium", "rlfunc.envs.workers"]  # what the forkserver imports for every worker


def worker_slices(num_envs: int, workers: int) -> list[tuple[int, int]]:
    """The env index range [lo, hi) of each of ``workers`` processes over ``num_envs`` envs.

    Raises:
        EnvError: ``workers`` < 1, or ``num_envs`` not divisible by ``workers``.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise EnvError(f"env_workers={workers!r}: expected an integer >= 1")
    if num_envs % workers:
        raise EnvError(f"num_envs={num_envs} is not divisible by env_workers={workers}: each worker steps num_envs / env_workers envs")
    n = num_envs // workers
    return [(k * n, (k + 1) * n) for k in range(workers)]


def shared_layout(space: gym.Space) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The entries of a single env's observation ``space`` that go through shared memory: a Box as
    "observation", a Dict's Box entries under their keys; key -> (shape, dtype)."""
    if isinstance(space, gym.spaces.Box):
        return {"observation": (tuple(space.shape), np.dtype(space.dtype))}
    if isinstance(space, gym.spaces.Dict):
        return {k: (tuple(s.shape), np.dtype(s.dtype)) for k, s in space.spaces.items() if isinstance(s, gym.spaces.Box)}
    return {}


def _start_forkserver_ignoring_sigint() -> None:
    """Start multiprocessing's forkserver (if not running) with SIGINT ignored, which it inherits
    through exec: a Ctrl-C to the process group while the server imports torch then leaves it alone
    (it ignores SIGINT itself only after its imports, and printed their tracebacks). The learner
    ignores SIGINT only for the spawn itself (the server's imports run after it returns). A signal
    mask would not do: the server is spawned with an empty one."""
    import threading
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():  # signal.signal is the main thread's
        forkserver.ensure_running()
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, old)


@contextlib.contextmanager
def without_main():
    """While a worker starts: a bare ``__main__``, so that multiprocessing does not make the worker
    import the parent's main script (slow, and wrong for a script without a ``__main__`` guard); the
    worker runs functions of this module only."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _worker(factory: Callable[[], Any], lo: int, hi: int, buffers: dict, num_envs: int, pipe, parent_pipe) -> None:
    # Ctrl-C reaches the whole process group: the learner stops on it (saving a snapshot, which asks
    # the workers for their envs' state) and then closes the workers, so they must outlive it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Mesa's software rasterizer (llvmpipe: EGL or OSMesa without a GPU) would start a thread per core
    # in every worker; the workers are the parallelism, and on small images those threads only cost
    # (Push-v0, 8 envs, 2 idle cores: 2 workers step 1.72-1.74x as fast as 1 without them, 1.56x
    # with 2 each; one env on a loaded machine: 3.9 ms per step without, 5.8 with 2). Unless set.
    os.environ.setdefault("LP_NUM_THREADS", "0")
    parent_pipe.close()
    part = None
    try:
        part = factory()
        views = {k: np.frombuffer(raw, dtype).reshape(num_envs, *shape)[lo:hi] for k, (raw, shape, dtype) in buffers.items()}
        pipe.send((True, getattr(part, "describe", lambda: None)()))
    except ConnectionError:  # the learner is gone (stopped while its workers started): nobody to tell
        return
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises EnvError)
        with contextlib.suppress(ConnectionError):
            pipe.send((False, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))
        return
    try:
        while True:
            name, args, writes = pipe.recv()
            if name == "close":
                break
            try:
                out = getattr(part, name)(*args)
                if writes:
                    obs, rest = out[0], out[1:]
                    if isinstance(obs, dict):
                        for k, view in views.items():
                            view[...] = obs[k]
                        out = ({k: v for k, v in obs.items() if k not in views}, *rest)
                    else:
                        views["observation"][...] = obs
                        out = (None, *rest)
                pipe.send((True, out))
            except Exception as e:  # noqa: BLE001
                pipe.send((False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    except (KeyboardInterrupt, EOFError, ConnectionError):  # the learner stopped or went away
        pass
    finally:
        if part is not None and hasattr(part, "close"):
            part.close()
        pipe.close()


class PartPool:
    """K worker processes, worker k holding ``factories[k]()`` (a part over envs ``slices[k]``), and
    one shared buffer ``[num_envs, *shape]`` per entry of ``layout`` (:func:`shared_layout`).

    Raises:
        EnvError: a part could not be built (its error, naming the worker).
    """

    def __init__(self, factories: Sequence[Callable[[], Any]], slices: Sequence[tuple[int, int]],
                 layout: dict[str, tuple[tuple[int, ...], np.dtype]], num_envs: int, *, context: str = "forkserver") -> None:
        ctx = mp.get_context(context)
        if context == "forkserver":  # the server imports these once; each worker is a fork of it
            ctx.set_forkserver_preload(PRELOAD)
            _start_forkserver_ignoring_sigint()
        self.slices, self.num_envs = list(slices), num_envs
        self.pipes, self.processes = [], []
        self.closed = False
        buffers = {k: (ctx.RawArray("b", max(1, num_envs * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)), shape, dtype)
                   for k, (shape, dtype) in layout.items()}
        self.views = {k: np.frombuffer(raw, dtype)[: num_envs * int(np.prod(shape, dtype=np.int64))].reshape(num_envs, *shape)
                      for k, (raw, shape, dtype) in buffers.items()}
        try:
            for k, (factory, (lo, hi)) in enumerate(zip(factories, self.slices)):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker, args=(factory, lo, hi, buffers, num_envs, child, parent),
                                name=f"rlfunc-env-worker-{k}", daemon=True)
                with without_main():
                    p.start()
                child.close()
                self.pipes.append(parent)
                self.processes.append(p)
            self.descriptions = self._receive(range(len(self.pipes)))
        except BaseException:
            self.close()
            raise

    def _receive(self, which) -> list:
        results, error = [], None
        for k in which:  # every answer is read, so the pipes stay in step after an error
            try:
                ok, value = self.pipes[k].recv()
            except (EOFError, ConnectionError, OSError):
                self.processes[k].join(timeout=1)
                ok, value = False, f"the process ended (exit code {self.processes[k].exitcode})"
            if not ok and error is None:
                error = (k, value)
            results.append(value)
        if error is not None:
            k, value = error
            first, _, trace = str(value).partition("\n")
            e = EnvError(f"env worker {k}: {first}")
            if trace:
                e.add_note(f"in the worker process:\n{trace}")
            raise e
        return results

    def call(self, name: str, args: Sequence[tuple] | None = None, *, writes: bool = False,
             which: Sequence[int] | None = None) -> list:
        """``part.name(*args[k])`` in each worker k of ``which`` (all by default), at once; their
        results in that order. ``writes``: see the module docstring.

        Raises:
            EnvError: a part raised (its message and traceback, naming the worker) or a worker ended.
        """
        if self.closed:
            raise EnvError("the env workers are closed")
        which = range(len(self.pipes)) if which is None else list(which)
        for j, k in enumerate(which):
            try:
                self.pipes[k].send((name, () if args is None else tuple(args[j]), writes))
            except (ConnectionError, OSError):  # the worker is gone (killed between calls): _receive names it
                pass
        return self._receive(which)

    def env_state(self) -> list[dict] | None:
        """Every env's state (:func:`rlfunc.envs.state.env_state`), each worker capturing its own, in
        env order; None when any worker's cannot be captured."""
        parts = self.call("env_state")
        return None if any(p is None for p in parts) else [s for p in parts for s in p]

    def set_env_state(self, states: list[dict]) -> None:
        """Restore what :meth:`env_state` captured, each worker its envs' share.

        Raises:
            EnvError: ``states`` is not one state per env.
        """
        if len(states) != self.num_envs:
            raise EnvError(f"env state has {len(states)} envs, the vector env has {self.num_envs}")
        self.call("set_env_state", [(list(states[lo:hi]),) for lo, hi in self.slices])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for pipe, p in zip(self.pipes, self.processes):
            try:
                if p.is_alive():
                    pipe.send(("close", (), False))
            except (BrokenPipeError, OSError):
                pass
        for pipe, p in zip(self.pipes, self.processes):
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            pipe.close()


def concat_infos(infos: Sequence[dict], sizes: Sequence[int]) -> dict:
    """Vector-env info dicts of consecutive env slices (``sizes`` envs each) as the one info dict of
    all envs: each key's arrays concatenated, a slice that lacks the key filled with zeros (None for
    objects; so its "_key" mask is False), nested dicts (``final_info``) alike."""
    keys = list(dict.fromkeys(k for info in infos for k in info))
    out = {}
    for key in keys:
        values = [info.get(key) for info in infos]
        like = next(v for v in values if v is not None)
        if isinstance(like, dict):
            out[key] = concat_infos([v if isinstance(v, dict) else {} for v in values], sizes)
            continue
        like = np.asarray(like)
        parts = [np.asarray(v) if v is not None else
                 (np.full((n, *like.shape[1:]), None, object) if like.dtype == object else np.zeros((n, *like.shape[1:]), like.dtype))
                 for v, n in zip(values, sizes)]
        out[key] = np.concatenate(parts)
    return out


class VectorPart:
    """What a :class:`WorkerVectorEnv` worker holds: a gymnasium sync vector env of ``num_envs``
    copies of ``env_id`` with SAME_STEP autoreset."""

    def __init__(self, env_id: str, num_envs: int, env_kwargs: dict) -> None:
        if env_id not in gym.registry:
            from rlfunc.envs import registry

            registry.ensure_loaded()
        self.venv = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync",
                                 vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}, **env_kwargs)

    def describe(self) -> str:
        return str(self.venv.envs[0])

    def reset(self, seeds: list, options: dict | None):
        return self.venv.reset(seed=seeds, options=options)

    def step(self, actions: np.ndarray):
        return self.venv.step(actions)

    def env_state(self) -> list[dict] | None:
        from rlfunc.envs.state import env_state

        return env_state(self.venv)

    def set_env_state(self, states: list[dict]) -> None:
        from rlfunc.envs.state import set_env_state

        set_env_state(self.venv, states)

    def close(self) -> None:
        self.venv.close()


class WorkerVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` copies of ``env_id`` stepped in ``workers`` processes, each a sync vector env of
    ``num_envs / workers`` (see the module docstring); SAME_STEP autoreset.

    ``copy`` (as gymnasium's AsyncVectorEnv's): ``step`` and ``reset`` return copies of the shared
    buffers; False: the buffers themselves, which the next ``step`` or ``reset`` overwrites.

    Raises:
        EnvError: ``num_envs`` not divisible by ``workers``, or an env that cannot be built.
    """

    def __init__(self, env_id: str, num_envs: int, workers: int, *, copy: bool = True, **env_kwargs: Any) -> None:
        import functools

        slices = worker_slices(num_envs, workers)
        probe = gym.make(env_id, **env_kwargs)  # the spaces, in this process (nothing is rendered)
        try:
            self.single_observation_space, self.single_action_space = probe.observation_space, probe.action_space
            self.spec = probe.spec
        finally:
            probe.close()
        self.num_envs, self.workers, self.copy = num_envs, workers, copy
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}
        self.render_mode = None
        self.closed = False
        n = num_envs // workers
        self.pool = PartPool([functools.partial(VectorPart, env_id, n, env_kwargs)] * workers, slices,
                             shared_layout(self.single_observation_space), num_envs)
        self.wrappers = self.pool.descriptions[0]
        self.sizes = [hi - lo for lo, hi in slices]

    def _observation(self, rests: list) -> Any:
        views = {k: v.copy() for k, v in self.pool.views.items()} if self.copy else self.pool.views
        if isinstance(self.single_observation_space, gym.spaces.Dict):
            obs = dict(views)
            for key in self.single_observation_space.spaces:
                if key not in views:
                    obs[key] = tuple(x for rest in rests for x in rest[key])
            return {k: obs[k] for k in self.single_observation_space.spaces}
        return views["observation"]

    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict | None = None):
        if seed is None or isinstance(seed, int):
            seed = [None if seed is None else seed + i for i in range(self.num_envs)]
        if len(seed) != self.num_envs:
            raise EnvError(f"reset: {len(seed)} seeds for {self.num_envs} envs")
        mask = None if options is None else options.get("reset_mask")
        opts = [options if mask is None else {**options, "reset_mask": np.asarray(mask)[lo:hi]} for lo, hi in self.pool.slices]
        out = self.pool.call("reset", [(list(seed[lo:hi]), o) for (lo, hi), o in zip(self.pool.slices, opts)], writes=True)
        return self._observation([o[0] for o in out]), concat_infos([o[1] for o in out], self.sizes)

    def step(self, actions):
        actions = np.asarray(actions) if not isinstance(actions, (dict, tuple)) else actions
        out = self.pool.call("step", [(actions[lo:hi],) for lo, hi in self.pool.slices], writes=True)
        return (self._observation([o[0] for o in out]), np.concatenate([o[1] for o in out]),
                np.concatenate([o[2] for o in out]), np.concatenate([o[3] for o in out]),
                concat_infos([o[4] for o in out], self.sizes))

    def env_state(self) -> list[dict] | None:
        """:func:`rlfunc.envs.collect.env_state` of every env (:meth:`PartPool.env_state`)."""
        return self.pool.env_state()

    def set_env_state(self, states: list[dict]) -> None:
        """Restore what :meth:`env_state` captured (:meth:`PartPool.set_env_state`)."""
        self.pool.set_env_state(states)

    def close_extras(self, **kwargs: Any) -> None:
        if hasattr(self, "pool"):
            self.pool.close()


# ---------------------------------------------------------------------------------------------
# GymChunkEnv's envs: in this process (ChunkPart) or in worker processes (ChunkWorkers).


def batched(observations: list, is_dict: bool) -> Any:
    """A list of N gymnasium observations as one: a Box's stacked [N, ...]; a Dict's Box entries
    stacked, its other entries (Text) as lists of N."""
    if not is_dict:
        return np.stack(observations)
    first = observations[0]
    return {k: np.stack([o[k] for o in observations]) if isinstance(first[k], np.ndarray) else [o[k] for o in observations]
            for k in first}


class ChunkPart:
    """``num_envs`` gymnasium envs (``gymnasium.make(env_id)``) stepped one action chunk at a time on
    the host: what a :class:`rlfunc.envs.chunk.GymChunkEnv` holds, or each of its worker processes
    (:class:`PartPool`) holds for its share of the envs."""

    def __init__(self, env_id: str, num_envs: int) -> None:
        if env_id not in gym.registry:
            from rlfunc.envs import registry

            registry.ensure_loaded()  # the env plugins register their gymnasium ids
        self.envs = [gym.make(env_id) for _ in range(num_envs)]
        self.is_dict = isinstance(self.envs[0].observation_space, gym.spaces.Dict)
        self.obs: list = [None] * num_envs

    def batched(self) -> Any:
        """The current observations, :func:`batched`."""
        return batched(self.obs, self.is_dict)

    def reset(self, indices: Sequence[int], seeds: Sequence[int]) -> tuple[Any, np.ndarray]:
        """Reset env ``indices[j]`` with ``seeds[j]``; (:meth:`batched`, bool [len(indices)]: its
        ``info["is_success"]``)."""
        success = np.zeros(len(indices), bool)
        for j, (i, seed) in enumerate(zip(indices, seeds)):
            self.obs[i], info = self.envs[i].reset(seed=int(seed))
            success[j] = bool(info.get("is_success", False))
        return self.batched(), success

    def step(self, action: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Env i executes ``action[i, k]`` (env units, [n, act_steps, A]) for k = 0, 1, ... until the
        chunk or its episode ends; (:meth:`batched`, summed reward float32 [n], terminated [n],
        truncated [n], ``info["is_success"]`` after the last action [n])."""
        n, act_steps = action.shape[0], action.shape[1]
        reward = np.zeros(n, np.float32)
        terminated, truncated, success = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
        for i, env in enumerate(self.envs):
            for k in range(act_steps):
                self.obs[i], r, terminated[i], truncated[i], info = env.step(action[i, k])
                reward[i] += r
                if terminated[i] or truncated[i]:
                    break
            success[i] = bool(info.get("is_success", False))
        return self.batched(), reward, terminated, truncated, success

    def env_state(self) -> list[dict] | None:
        from rlfunc.envs.state import env_state

        return env_state(self)

    def set_env_state(self, states: list[dict]) -> None:
        from rlfunc.envs.state import set_env_state

        set_env_state(self, states)

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    def close(self) -> None:
        for env in self.envs:
            env.close()


class ChunkWorkers:
    """:class:`ChunkPart`'s calls over ``num_envs`` envs stepped in ``workers`` processes,
    ``num_envs / workers`` each (:class:`PartPool`); observations come back as
    views of the shared buffers (uint8 images stay uint8), valid until the next call."""

    def __init__(self, env_id: str, num_envs: int, workers: int, space: gym.Space) -> None:
        import functools

        slices = worker_slices(num_envs, workers)
        self.is_dict = isinstance(space, gym.spaces.Dict)
        self.space, self.num_envs = space, num_envs
        self.pool = PartPool([functools.partial(ChunkPart, env_id, num_envs // workers)] * workers, slices,
                             shared_layout(space), num_envs)
        self.texts: dict[str, list] = {}  # a Dict's entries that are not in shared memory, per env

    def _observation(self, rests: list, which: Sequence[int]) -> Any:
        views = self.pool.views
        if not self.is_dict:
            return views["observation"]
        for k, rest in zip(which, rests):
            lo, hi = self.pool.slices[k]
            for key, values in rest.items():
                self.texts.setdefault(key, [None] * self.num_envs)[lo:hi] = list(values)
        return {**views, **self.texts}

    def reset(self, indices: Sequence[int], seeds: Sequence[int]) -> tuple[Any, np.ndarray]:
        indices, seeds = np.asarray(indices, np.int64), np.asarray(seeds, np.int64)
        which, args = [], []
        for k, (lo, hi) in enumerate(self.pool.slices):
            mine = (indices >= lo) & (indices < hi)
            if mine.any():
                which.append(k)
                args.append(((indices[mine] - lo).tolist(), seeds[mine].tolist()))
        out = self.pool.call("reset", args, writes=True, which=which)
        success = np.zeros(len(indices), bool)
        for k, o in zip(which, out):
            lo, hi = self.pool.slices[k]
            success[(indices >= lo) & (indices < hi)] = o[1]
        return self._observation([o[0] for o in out], which), success

    def step(self, action: np.ndarray):
        out = self.pool.call("step", [(action[lo:hi],) for lo, hi in self.pool.slices], writes=True)
        cat = lambda j: np.concatenate([o[j] for o in out])  # noqa: E731
        return self._observation([o[0] for o in out], range(len(out))), cat(1), cat(2), cat(3), cat(4)

    def env_state(self) -> list[dict] | None:
        return self.pool.env_state()

    def set_env_state(self, states: list[dict]) -> None:
        self.pool.set_env_state(states)

    def close(self) -> None:
        self.pool.close()

"""Collection in a worker process while the learner updates: the asynchronous mode of the
replay-buffer algorithms (issue 16, item 2; TorchRL's ``MultiaSyncDataCollector`` in spirit).

One process (:class:`AsyncCollector`) holds the envs and a copy of the acting policy's weights.
It steps them - sac's and td3's gymnasium vector env with :func:`rlfunc.envs.collect.rollout`,
``steps_per_item`` steps at a time (:class:`GymSteps`); sac-/td3-diffusion's chunk env one rollout
at a time (:class:`rlfunc.run.diffusion.ReplayRollouts`) - and puts each ``[N, T]`` batch in a bounded queue; the learner takes them with
:meth:`AsyncCollector.next`, adds them to its replay buffer and updates, while the worker already
steps the next ones. The learner publishes its weights with :meth:`AsyncCollector.publish` (into
one shared-memory copy, under a lock, with a version counter); the worker reads them before its
next rollout when the version moved. The queue's bound (``queue_size`` items) bounds how far the
collection runs ahead: an action comes from weights at most ``queue_size + 1`` items (plus the
publish period) older than the learner's. Every item carries the version of the weights that acted
(``next()`` returns it), so the lag can be logged.

What it gives up, against the in-process loop: reproducibility (when the learner's and the worker's
steps interleave depends on timing, so the same seed gives different runs) and exact resume (the
worker's envs and episode statistics are not in the learner's snapshot: a resumed run starts new
episodes). What it buys: the env steps and the acting policy's forwards overlap the gradient steps
(bench/async_collect.py measures it).

The worker starts from multiprocessing's forkserver like the env workers
(:mod:`rlfunc.envs.workers`: no inherited threads or GL contexts, the learner's main script not
re-run), on the CPU with one torch thread, whatever the learner's device; the policy comes from
``make_policy(weights, generator, warm)``, a picklable callable the algorithm provides (a
module-level function or an instance of a module-level class), and draws its exploration noise from
the worker's own ``torch.Generator`` seeded by ``seed``.
"""

from __future__ import annotations

import contextlib
import queue as queue_lib
import signal
import time
import traceback
from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from rlfunc.envs import collect
from rlfunc.envs.workers import PRELOAD, _start_forkserver_ignoring_sigint, without_main
from rlfunc.errors import ConfigError, EnvError

# a collector (re)started at iteration ``it`` of a run of seed s seeds its envs from s + RESTART_STRIDE * it and its
# generator from s + RESTART_STRIDE * (it + 1): a prime above the evaluations' offset (s + 1,000,003 + a few rounds),
# so a resumed run's collector never resets with the seeds its evaluation scores (found by a new user: at it = 1 the
# stride 1,000,003 gave exactly the evaluation's seeds)
RESTART_STRIDE = 2_000_029


def restart_seed(seed: int, iteration: int) -> int:
    """The seed a collector started at ``iteration`` of a run of ``seed`` derives from (its envs';
    ``iteration + 1``: its generator's): :data:`RESTART_STRIDE` apart, never an evaluation's."""
    return seed + RESTART_STRIDE * iteration


# make_policy(weights [CPU TensorDict], generator, warm) -> policy; warm: the env steps so far are < warm_steps
MakePolicy = Callable[[TensorDictBase, torch.Generator, bool], collect.Policy]


class GymSteps:
    """What the worker steps for sac and td3: ``env_id``'s ``num_envs`` gymnasium envs (reset with
    ``seeds``), ``steps_per_item`` vector-env steps per item through :func:`rlfunc.envs.collect.rollout`
    (the episodes run on across items), acting with ``make_policy(weights, generator, warm)``, rebuilt
    when the weights' version or ``warm`` (the env steps so far, from ``start_steps``, below
    ``warm_steps``) changes. Picklable; :meth:`open` makes the envs in the worker."""

    def __init__(self, env_id: str, num_envs: int, seeds: Sequence[int], make_policy: MakePolicy, *, steps_per_item: int = 1,
                 warm_steps: int = 0, start_steps: int = 0) -> None:
        self.env_id, self.num_envs, self.seeds, self.make_policy = env_id, num_envs, list(seeds), make_policy
        self.steps_per_item, self.warm_steps, self.steps = steps_per_item, warm_steps, start_steps
        self.venv = self.carry = self.policy = self.warm = None

    def open(self) -> None:
        self.venv = collect.make_vec_env(self.env_id, self.num_envs)
        self.carry = collect.reset(self.venv, self.seeds)

    def collect(self, weights: TensorDictBase, generator: torch.Generator, fresh: bool) -> TensorDict:
        warm = self.steps < self.warm_steps
        if fresh or warm != self.warm or self.policy is None:
            self.policy, self.warm = self.make_policy(weights, generator, warm), warm
        batch, self.carry = collect.rollout(self.venv, self.policy, self.carry, self.steps_per_item, device=torch.device("cpu"))
        self.steps += self.num_envs * self.steps_per_item
        return batch

    def close(self) -> None:
        if self.venv is not None:
            self.venv.close()


def _collect(source, weights: TensorDictBase, version, lock, items, stop, seed: int) -> None:
    """The worker: ``source.open()``, then collect, put, repeat until ``stop`` is set; an error goes
    into the queue as ("error", message, traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner stops on Ctrl-C and closes the worker
    torch.set_num_threads(1)
    try:
        source.open()
        generator = torch.Generator().manual_seed(seed)
        local = weights.clone()  # the worker's own copy: the learner may publish while it acts
        seen = -1
        while not stop.is_set():
            fresh = version.value != seen
            if fresh:
                with lock:
                    local.update_(weights)
                    seen = version.value
            batch = source.collect(local, generator, fresh)
            item = ("batch", batch.numpy(), tuple(batch.batch_size), seen)
            while not stop.is_set():
                try:
                    items.put(item, timeout=0.1)
                    break
                except queue_lib.Full:
                    continue
    except BaseException as e:  # noqa: BLE001  (reported to the learner, which raises EnvError)
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        with contextlib.suppress(Exception):
            items.put(("error", f"{type(e).__name__}: {message}", traceback.format_exc()), timeout=5)
    finally:
        with contextlib.suppress(Exception):
            source.close()


class AsyncCollector:
    """``env_id``'s ``num_envs`` envs stepped in one worker process while the learner updates; see
    the module docstring.

    Args:
        env_id: a gymnasium id (:func:`rlfunc.envs.collect.make_vec_env`; Box observations).
        num_envs: N >= 1, envs in the worker.
        seeds: N reset seeds (:func:`rlfunc.envs.collect.env_seeds`).
        make_policy: ``(weights, generator, warm) -> policy`` (picklable), called in the worker when
            the weights' version or ``warm`` changes; ``weights`` is the worker's CPU copy of what
            :meth:`publish` sends, updated in place.
        weights: the initial weights (any device; copied to shared CPU memory).
        steps_per_item: T >= 1, env steps per queue item (each item is a [N, T] batch).
        warm_steps: env steps (counted from ``start_steps``) with ``warm=True`` (e.g. uniform
            actions before learning starts).
        start_steps: the env steps of the run so far (a resumed run's).
        seed: the worker's exploration generator seed.
        queue_size: >= 1, items the worker may run ahead of the learner.
        timeout_s: > 0, how long :meth:`next` waits for an item before it raises.

    Raises:
        ConfigError: a size or the timeout out of range, or ``len(seeds) != num_envs``.
    """

    def __init__(self, env_id: str, num_envs: int, seeds: Sequence[int], make_policy: MakePolicy, weights: TensorDictBase,
                 *, steps_per_item: int = 1, warm_steps: int = 0, start_steps: int = 0, seed: int = 0,
                 queue_size: int = 2, timeout_s: float = 120.0) -> None:
        for name, value in (("num_envs", num_envs), ("steps_per_item", steps_per_item)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: expected an integer >= 1")
        if len(seeds) != num_envs:
            raise ConfigError(f"seeds: {len(seeds)} given, expected num_envs={num_envs}")
        self._start(GymSteps(env_id, num_envs, seeds, make_policy, steps_per_item=steps_per_item, warm_steps=warm_steps,
                             start_steps=start_steps), weights, seed, queue_size, timeout_s)

    @classmethod
    def of_source(cls, source, weights: TensorDictBase, *, seed: int = 0, queue_size: int = 2,
                  timeout_s: float = 120.0) -> "AsyncCollector":
        """A collector whose worker steps ``source`` (picklable; in the worker ``source.open()``, then
        ``source.collect(weights, generator, fresh) -> TensorDict`` of any batch size per item, with
        ``fresh`` True when the weights changed since the last item; ``source.close()`` at the end),
        as :class:`GymSteps` does for gymnasium vector envs. sac-/td3-diffusion's rollouts of chunk
        envs are one (:class:`rlfunc.run.diffusion.ReplayRollouts`)."""
        collector = cls.__new__(cls)
        collector._start(source, weights, seed, queue_size, timeout_s)
        return collector

    def _start(self, source, weights: TensorDictBase, seed: int, queue_size: int, timeout_s: float) -> None:
        """Check the queue's size and the timeout (ConfigError), then start the worker on ``source``."""
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError(f"queue_size={queue_size!r}: expected an integer >= 1")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s}: expected > 0")
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _start_forkserver_ignoring_sigint()
        self.timeout_s = timeout_s
        self.weights = weights.detach().to("cpu").clone().share_memory_()
        self.version = ctx.Value("q", 0)
        self.lock = ctx.Lock()
        self.items = ctx.Queue(maxsize=queue_size)
        self.stop = ctx.Event()
        self.closed = False
        self.process = ctx.Process(target=_collect, name="rlfunc-collector", daemon=True,
                                   args=(source, self.weights, self.version, self.lock, self.items, self.stop, seed))
        with without_main():
            self.process.start()

    def next(self) -> tuple[TensorDict, int]:
        """The next ``[N, T]`` batch (CPU; :func:`rlfunc.envs.collect.rollout`'s keys, or those of the
        source's batches) and the version of the weights that acted in it (0: the initial ones; each :meth:`publish` adds 1).

        Raises:
            EnvError: the worker raised (its message; its traceback as a note), ended (its exit
                code), or sent nothing for ``timeout_s``.
        """
        if self.closed:
            raise EnvError("the collector is closed")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                item = self.items.get(timeout=0.5)
                break
            except queue_lib.Empty:
                if not self.process.is_alive():
                    raise EnvError(f"the collector process ended (exit code {self.process.exitcode})") from None
                if time.monotonic() > deadline:
                    raise EnvError(f"the collector process sent no transitions for {self.timeout_s:g} s") from None
        if item[0] == "error":
            e = EnvError(f"the collector process: {item[1]}")
            e.add_note(f"in the collector process:\n{item[2]}")
            raise e
        _, payload, batch_size, version = item
        return TensorDict(payload, batch_size=list(batch_size)), version

    def publish(self, weights: TensorDictBase) -> int:
        """Copy ``weights`` (the structure given at construction, any device) into the shared copy
        and move the version on; the worker acts with them from its next rollout. Returns the new version.

        Raises:
            EnvError: the worker ended while it held the weights' lock (killed as it copied them: the
                lock is never released, and a plain acquire waited forever).
        """
        while not self.lock.acquire(timeout=0.5):
            if not self.process.is_alive():
                raise EnvError(f"the collector process ended (exit code {self.process.exitcode})")
        try:
            with torch.no_grad():
                self.weights.update_(weights.detach().to("cpu"))
                self.version.value += 1
                return self.version.value
        finally:
            self.lock.release()

    def close(self) -> None:
        """Stop the worker and wait for it (a few seconds at most; then it is terminated)."""
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        deadline = time.monotonic() + 5.0
        while self.process.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(queue_lib.Empty, OSError, EOFError):  # unblock its put
                self.items.get(timeout=0.05)
        self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=1.0)
        self.items.cancel_join_thread()
        self.items.close()

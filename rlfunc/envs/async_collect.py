"""Collection in a worker process while the learner updates: the asynchronous mode of the
replay-buffer algorithms (issue 16, item 2; TorchRL's ``MultiaSyncDataCollector`` in spirit).

One process (:class:`AsyncCollector`) holds the vector env and a copy of the acting policy's
weights. It steps the envs with :func:`rlfunc.envs.collect.rollout`, ``steps_per_item`` steps at a
time, and puts each ``[N, T]`` batch in a bounded queue; the learner takes them with
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
from rlfunc.envs.workers import PRELOAD, _start_forkserver_ignoring_sigint, _without_main
from rlfunc.errors import ConfigError, EnvError

# make_policy(weights [CPU TensorDict], generator, warm) -> policy; warm: the env steps so far are < warm_steps
MakePolicy = Callable[[TensorDictBase, torch.Generator, bool], collect.Policy]


def _collect(env_id: str, num_envs: int, seeds: list[int], make_policy: MakePolicy, weights: TensorDictBase, version,
             lock, items, stop, steps_per_item: int, warm_steps: int, start_steps: int, seed: int) -> None:
    """The worker: step, put, repeat until ``stop`` is set; an error goes into the queue as
    ("error", message, traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner stops on Ctrl-C and closes the worker
    torch.set_num_threads(1)
    venv = None
    try:
        venv = collect.make_vec_env(env_id, num_envs)
        carry = collect.reset(venv, seeds)
        generator = torch.Generator().manual_seed(seed)
        local = weights.clone()  # the worker's own copy: the learner may publish while it acts
        seen, warm, policy = -1, None, None
        steps = start_steps
        while not stop.is_set():
            now_warm = steps < warm_steps
            if version.value != seen or now_warm != warm:
                with lock:
                    local.update_(weights)
                    seen = version.value
                warm = now_warm
                policy = make_policy(local, generator, warm)
            batch, carry = collect.rollout(venv, policy, carry, steps_per_item, device=torch.device("cpu"))
            steps += num_envs * steps_per_item
            item = ("batch", batch.numpy(), seen)
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
        if venv is not None:
            venv.close()


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
        for name, value, low in (("num_envs", num_envs, 1), ("steps_per_item", steps_per_item, 1), ("queue_size", queue_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name}={value!r}: expected an integer >= {low}")
        if len(seeds) != num_envs:
            raise ConfigError(f"seeds: {len(seeds)} given, expected num_envs={num_envs}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s}: expected > 0")
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _start_forkserver_ignoring_sigint()
        self.num_envs, self.steps_per_item, self.timeout_s = num_envs, steps_per_item, timeout_s
        self.weights = weights.detach().to("cpu").clone().share_memory_()
        self.version = ctx.Value("q", 0)
        self.lock = ctx.Lock()
        self.items = ctx.Queue(maxsize=queue_size)
        self.stop = ctx.Event()
        self.closed = False
        self.process = ctx.Process(target=_collect, name="rlfunc-collector", daemon=True,
                                   args=(env_id, num_envs, list(seeds), make_policy, self.weights, self.version, self.lock,
                                         self.items, self.stop, steps_per_item, warm_steps, start_steps, seed))
        with _without_main():
            self.process.start()

    def next(self) -> tuple[TensorDict, int]:
        """The next ``[N, T]`` batch (CPU; :func:`rlfunc.envs.collect.rollout`'s keys) and the
        version of the weights that acted in it (0: the initial ones; each :meth:`publish` adds 1).

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
        _, payload, version = item
        return TensorDict(payload, batch_size=[self.num_envs, self.steps_per_item]), version

    def publish(self, weights: TensorDictBase) -> int:
        """Copy ``weights`` (the structure given at construction, any device) into the shared copy
        and move the version on; the worker acts with them from its next rollout. Returns the new version."""
        with torch.no_grad(), self.lock:
            self.weights.update_(weights.detach().to("cpu"))
            self.version.value += 1
            return self.version.value

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

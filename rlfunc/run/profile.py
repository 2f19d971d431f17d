"""``--profile N``: N iterations of a run recorded with the device's profiler, after a warm-up.

The loop makes one :class:`IterationProfiler` per run and calls :meth:`IterationProfiler.step` after
every iteration. The first iteration of the call is skipped (allocations, lazy imports, the first
env resets), the second is the profiler's warm-up, the next N are recorded; the trace goes to
``RUN_DIR/profile/`` as ``rankR.<time_ns>.pt.trace.json`` for TensorBoard's profiler
plugin (``tensorboard --logdir RUN_DIR/profile``) or chrome://tracing / Perfetto.

Ranges (:func:`rlfunc.device.span`, ``torch.profiler.record_function`` while a profiler records) name the phases in the trace: ``iteration`` and
``checkpoint`` (the loop), ``rollout`` and ``update`` (each run's step), ``policy_forward`` and
``env_step`` (:func:`rlfunc.envs.collect.rollout`); with no profiler recording they cost
well under a microsecond.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from rlfunc.device import profiler
from rlfunc.errors import ConfigError

PROFILE_DIR = "profile"
SKIP = 1  # iterations of the call before the warm-up
WARMUP = 1


class IterationProfiler:
    """Records ``iterations`` iterations (0: does nothing) of a run into ``run_dir / "profile"``.

    Use as a context manager around the loop and call :meth:`step` after each iteration; a run that
    ends before the N are recorded still writes what it recorded, and warns how many that was.

    Raises:
        ConfigError: ``iterations`` is negative (or not an int).
    """

    def __init__(self, run_dir: Path, iterations: int, device: torch.device, rank: int = 0) -> None:
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
            raise ConfigError(f"profile={iterations!r}: expected an int >= 0 (iterations to record)")
        self.iterations, self.steps = iterations, 0
        self._prof = None
        if iterations:
            trace_dir = Path(run_dir) / PROFILE_DIR
            trace_dir.mkdir(parents=True, exist_ok=True)
            self._prof = profiler(device, str(trace_dir), wait=SKIP, warmup=WARMUP, active=iterations,
                                  worker=f"rank{rank}")

    def __enter__(self) -> "IterationProfiler":
        if self._prof is not None:
            self._prof.__enter__()
        return self

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()
            self.steps += 1

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
            self._prof = None
            recorded = min(self.iterations, max(0, self.steps - SKIP - WARMUP))
            if recorded < self.iterations and exc[0] is None:  # a run too short for N (an interrupted one says so itself)
                warnings.warn(f"profile={self.iterations}: the run took {self.steps} iteration(s) in this call, so {recorded} of "
                              f"{self.iterations} were recorded (the profiler skips the first {SKIP + WARMUP}); "
                              f"{SKIP + WARMUP + self.iterations} iterations record them all", stacklevel=2)

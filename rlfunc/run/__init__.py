"""The run machinery every algorithm shares: the one run loop (:mod:`rlfunc.run.loop`) and the run
settings each algorithm's config nests (:class:`rlfunc.config.RunConfig`, defined below the algorithms).
``rlfunc.resume(run_dir)`` is :func:`rlfunc.run.loop.resume` (``rlfunc.run.resume`` is the module of
resume's helpers)."""

from rlfunc.config import RunConfig
from rlfunc.run.loop import Cadence, Run, RunResult, cadence, load, resume_source, run_loop, train

__all__ = ["Cadence", "Run", "RunConfig", "RunResult", "cadence", "load", "resume_source", "run_loop", "train"]

"""The run machinery every algorithm shares: the one run loop (:mod:`rlfunc.run.loop`)."""

from rlfunc.run.loop import Cadence, Run, RunResult, cadence, load, resume_source, run_loop, train

__all__ = ["Cadence", "Run", "RunResult", "cadence", "load", "resume_source", "run_loop", "train"]

"""What every ``rlfunc train ALGO`` command does around its training function: the default run
directory and the report at the end (run dir on stderr, the evaluation as one JSON line on stdout,
or the signal that stopped the run with its exit code 128 + signal number)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def default_run_dir(env: str, name: str, seed: int) -> str:
    """``runs/ENV-NAME-sSEED-YYYYmmdd-HHMMSS``."""
    return os.path.join("runs", f"{env}-{name}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}")


def report_run(result, next_step: str = "") -> int:
    """Print what ``result`` (with ``run_dir``, ``interrupted`` and ``evaluation``) says; return the
    exit code: 0, or 130 / 143 when SIGINT / SIGTERM stopped the run (``next_step``: what to do next,
    appended to the interruption line)."""
    print(f"run dir: {result.run_dir}", file=sys.stderr)
    if result.interrupted:
        print(f"interrupted ({result.interrupted}): snapshot saved{'; ' + next_step if next_step else ''}", file=sys.stderr)
        return 128 + int(getattr(signal, result.interrupted))
    print(json.dumps(result.evaluation))
    return 0

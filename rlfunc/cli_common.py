"""What every ``rlfunc train ALGO`` command does around its training function: the default run
directory and the report at the end (run dir on stderr, the evaluation as one JSON line on stdout,
or the signal that stopped the run with its exit code 128 + signal number); and the argument parser
of the plain argparse subcommands, whose errors are one line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


class Parser(argparse.ArgumentParser):
    """argparse, but a bad or missing argument raises ConfigError (one line from ``rlfunc.cli.main``,
    exit 2) instead of printing the usage block."""

    def error(self, message: str):
        from rlfunc.errors import ConfigError

        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def default_run_dir(env: str, name: str, seed: int) -> str:
    """``runs/ENV-NAME-sSEED-YYYYmmdd-HHMMSS``."""
    return os.path.join("runs", f"{env}-{name}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}")


def report_run(result, also: str = "") -> int:
    """Print what ``result`` (with ``run_dir``, ``interrupted`` and ``evaluation``) says; return the
    exit code: 0, or 130 / 143 when SIGINT / SIGTERM stopped the run. The interruption line says how
    to continue the run (``rlfunc resume RUN_DIR``), then ``also`` (other things to do with it)."""
    print(f"run dir: {result.run_dir}", file=sys.stderr)
    if result.interrupted:
        print(f"interrupted ({result.interrupted}): snapshot saved; continue with `rlfunc resume {result.run_dir}`"
              f"{'; or ' + also if also else ''}", file=sys.stderr)
        return 128 + int(getattr(signal, result.interrupted))
    print(json.dumps(result.evaluation))
    return 0

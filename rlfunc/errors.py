"""The one error hierarchy of rlfunc; the CLI prints these as one line and exits with code 2."""


class RLFuncError(Exception):
    """Base class of every error rlfunc raises on purpose."""


class ConfigError(RLFuncError, ValueError):
    """A hyperparameter or argument is outside what the method accepts."""


class ShapeError(RLFuncError, ValueError):
    """Tensor shapes, dtypes or devices disagree with what a function documents."""


class EnvError(RLFuncError, ValueError):
    """An environment id is unknown or an environment cannot be built."""


class CheckpointError(RLFuncError):
    """A checkpoint is missing, corrupt, or does not match the run it is loaded into."""


class SnapshotCorruptError(CheckpointError):
    """A snapshot's files are missing, unreadable, or fail their integrity check (size, sha256,
    JSON, tensor table): its bytes are damaged, as opposed to a sound snapshot of another run."""


class RunInterrupted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM stopped a run at once, without the snapshot the first one asks for.
    ``run_dir``: the run's directory; ``resumable``: whether it holds a snapshot or version that
    ``rlfunc resume`` continues from (False: stopped before the first one; its metrics lines are all
    there is)."""

    def __init__(self, run_dir, resumable: bool) -> None:
        super().__init__(str(run_dir))
        self.run_dir, self.resumable = run_dir, resumable

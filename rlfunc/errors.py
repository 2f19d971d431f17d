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
    """A run stopped by a signal where it could not save first: a second SIGINT/SIGTERM during an
    iteration, or one during the final evaluation (``evaluating``; the run is done and its snapshots
    kept, eval.json is not written). ``run_dir``: the run's directory; ``resumable``: whether it holds
    a snapshot or version that ``rlfunc resume`` continues from (False: stopped before the first one;
    its metrics lines are all there is); ``signal``: "SIGINT" or "SIGTERM" when known."""

    def __init__(self, run_dir, resumable: bool, *, evaluating: bool = False, signal: str | None = None) -> None:
        super().__init__(str(run_dir))
        self.run_dir, self.resumable, self.evaluating, self.signal = run_dir, resumable, evaluating, signal

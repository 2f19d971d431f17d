"""Metrics out: one JSON line per iteration, TensorBoard when installed, a learning-curve PNG."""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase


def to_jsonable(value: Any) -> Any:
    """Tensors -> floats/lists (NaN -> None, so the line stays valid JSON), recursively."""
    if isinstance(value, TensorDictBase):
        value = value.to_dict()
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.item() if value.numel() == 1 and value.dim() <= 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


MIRRORED = "mirrored.txt"  # in RUN_DIR/tb: a digest of each metrics.jsonl line TensorBoard holds (written at close)


def _digest(line: str) -> str:
    return hashlib.blake2b(line.encode(), digest_size=8).hexdigest()


class MetricsLogger:
    """Appends one JSON object per call to ``RUN_DIR/metrics.jsonl``; mirrors scalars to TensorBoard.

    On a resume (RUN_DIR/tb, or lines in metrics.jsonl: a run that trained with TensorBoard off is
    rebuilt) TensorBoard must show metrics.jsonl's lines, which the resume has
    cut back to its snapshot (a crash, an older snapshot) or replaced (a rollback onto another
    branch: the version's own history). When the lines are a prefix of those TensorBoard holds (the
    digests the last logger wrote at close), its points past ``resumed_step`` (the step the run
    continues from: the resume cut the lines after it) are purged at once (``purge_step``), even by a
    resume that writes no line; the points of iterations a metrics.jsonl cut short lost stay. Not
    told the step, the writer opens at the first new line and purges from its step on. Otherwise (a
    replaced file, or a crash: events not flushed) it is rebuilt from metrics.jsonl. Purging alone kept an abandoned branch's points at steps the new lines do not
    reach; rebuilding on every resume cost ~22 s for a 20,000-line run."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, resumed_step: int | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb, self._mirrored, self._pending = None, None, None  # _pending: the tb dir whose writer opens at the first line
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                _quiet_writer_threads()
                tb = Path(run_dir) / "tb"
                lines = self.path.read_bytes().decode("utf-8", errors="replace").splitlines() if self.path.is_file() else []
                resumed = tb.is_dir() or bool(lines)  # (a run resumed with TensorBoard on after training without it: rebuilt)
                digests = [_digest(line) for line in lines]
                mirrored = tb / MIRRORED
                held = mirrored.read_text().split() if mirrored.is_file() else None
                mirrored.unlink(missing_ok=True)  # until this logger closes, after its events are flushed
                records = read_metrics(self.path) if lines else []
                prefix = held is not None and held[:len(digests)] == digests  # (an emptied file too: TensorBoard keeps its points)
                if resumed and prefix and resumed_step is not None:  # (a resume that writes no line purges too)
                    self._tb = SummaryWriter(str(tb), purge_step=int(resumed_step) + 1)
                elif resumed and prefix:
                    self._pending = (SummaryWriter, tb, records)
                else:
                    self._tb = SummaryWriter(str(tb), purge_step=0 if resumed else None)
                    for record in records if resumed else ():
                        self._scalars(record)
                self._mirrored = (mirrored, digests)
            except ImportError:
                self._tb = None
        self._file = self.path.open("a", buffering=1)

    def log(self, record: dict[str, Any]) -> None:
        record = to_jsonable(record)
        line = json.dumps(record)
        self._file.write(line + "\n")
        try:
            if self._pending is not None:  # a resumed run's first line: TensorBoard's points from its step on are replaced
                writer, tb, records = self._pending
                gone = not tb.is_dir()  # deleted since: rebuilt from metrics.jsonl (its digests would claim the old points)
                self._tb, self._pending = writer(str(tb), purge_step=0 if gone else int(record.get("step", 0))), None
                for old in records if gone else ():
                    self._scalars(old)
            if self._tb is not None:
                self._scalars(record)
                self._mirrored[1].append(_digest(line))
        except OSError as e:  # tb/ deleted, read-only or full: metrics.jsonl goes on
            self._stop_tensorboard(e)

    def _stop_tensorboard(self, error: OSError) -> None:
        """TensorBoard's mirror failed (its event file or tb/ deleted, read-only, a full disk): warn once
        and stop mirroring; metrics.jsonl keeps every line, and no digests are written, so the next
        resume rebuilds tb/ from it. (The failure had ended the run, after TensorBoard's writer thread
        printed its traceback.)"""
        warnings.warn(f"TensorBoard stopped mirroring the metrics ({type(error).__name__}: {error}); metrics.jsonl keeps "
                      "every line, and `rlfunc resume` rebuilds tb/ from it", stacklevel=3)
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError:
                pass
        self._tb, self._pending, self._mirrored = None, None, None

    def _scalars(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        for key, value in record.items():
            values = value if isinstance(value, list) else [value]
            for i, v in enumerate(values):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    tag = key if len(values) == 1 else f"{key}/seed{i}"
                    self._tb.add_scalar(tag, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None or self._pending is not None:
            if self._tb is not None:
                try:
                    self._tb.close()  # flushed: the lines whose digests follow are in TensorBoard's files
                except OSError as e:
                    self._stop_tensorboard(e)
                    return
            path, digests = self._mirrored
            tmp = path.with_suffix(".tmp")
            try:
                tmp.write_text("\n".join(digests) + "\n")
                os.replace(tmp, path)
            except OSError as e:  # tb/ deleted after the last flush: no digests, so the next resume rebuilds it
                self._stop_tensorboard(e)


_HOOK_LOCK = threading.Lock()
_hooked = False


def _quiet_writer_threads() -> None:
    """Leave TensorBoard's event-writer threads out of ``threading.excepthook`` (once per process): such a
    thread keeps its failed write's error for the writer's next call in the logging thread, where
    :class:`MetricsLogger` handles it, and re-raises it too, which Python printed as a 20-line
    "Exception in thread" traceback. Other threads go to the hook that was there before."""
    global _hooked
    with _HOOK_LOCK:
        if _hooked:
            return
        try:
            from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
        except ImportError:  # another tensorboard layout: its tracebacks stay
            return
        previous = threading.excepthook

        def hook(args) -> None:
            if not (isinstance(args.thread, _AsyncWriterThread) and getattr(args.thread, "exception", None) is args.exc_value):
                previous(args)

        threading.excepthook = hook
        _hooked = True


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records (JSON objects) of a metrics.jsonl file; a torn last line, from a crash, and any
    line that is not a JSON object (binary garbage was a UnicodeDecodeError traceback in ``rlfunc
    resume``) are ignored."""
    records = []
    for line in Path(path).read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def curve_points(records: list[dict[str, Any]], key: str) -> list[tuple[list, list]]:
    """Per seed, the (steps, values) of ``key`` over the records that have a value: iterations in
    which no episode ended (None) are skipped, so the curve joins the points that exist."""
    records = [r for r in records if key in r]
    if not records:
        return []
    first = records[0][key]
    curves = []
    for s in range(len(first) if isinstance(first, list) else 1):
        points = [(r["step"], r[key][s] if isinstance(r[key], list) else r[key]) for r in records]
        points = [(x, y) for x, y in points if y is not None]
        curves.append(([x for x, _ in points], [y for _, y in points]))
    return curves


def plot_learning_curve(metrics_path: Path, png_path: Path, key: str = "episode_return") -> Path:
    """Plot ``key`` (one line per seed) against env steps; writes ``png_path`` and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(6, 4))
    curves = curve_points(records, key)
    for s, (xs, ys) in enumerate(curves):
        if xs:
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=f"seed {s}" if len(curves) > 1 else None)
    if len(curves) > 1 and any(xs for xs, _ in curves):  # no episode ended: no line to label (matplotlib warned)
        ax.legend()
    ax.set_xlabel("env steps (per seed)")
    ax.set_ylabel(key.replace("_", " "))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)

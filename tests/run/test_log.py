"""Metrics logging and the learning curve."""

import json

from rlfunc.run.log import MetricsLogger, curve_points, plot_learning_curve, read_metrics


def test_curve_joins_iterations_without_episode_ends(tmp_path):
    # Regression: iterations with no finished episode (None) broke the line into isolated dots.
    records = [{"step": 1, "episode_return": None}, {"step": 2, "episode_return": 5.0},
               {"step": 3, "episode_return": None}, {"step": 4, "episode_return": 7.0}]
    assert curve_points(records, "episode_return") == [([2, 4], [5.0, 7.0])]
    seeds = [{"step": 1, "episode_return": [1.0, None]}, {"step": 2, "episode_return": [None, 3.0]}]
    assert curve_points(seeds, "episode_return") == [([1], [1.0]), ([2], [3.0])]


def test_logger_writes_valid_json_and_plot(tmp_path):
    import torch

    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log({"step": 10, "episode_return": torch.tensor(float("nan")), "loss": torch.tensor([0.5, 1.5])})
    logger.log({"step": 20, "episode_return": torch.tensor(-3.0), "loss": torch.tensor([0.25, 1.0])})
    logger.close()
    (tmp_path / "metrics.jsonl").open("a").write('{"step": 30, "torn')  # a crash mid-line
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records == [{"step": 10, "episode_return": None, "loss": [0.5, 1.5]},
                       {"step": 20, "episode_return": -3.0, "loss": [0.25, 1.0]}]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["episode_return"] is None
    png = plot_learning_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")
    assert png.stat().st_size > 1000


def test_a_resumed_run_replaces_tensorboards_points_past_its_snapshot(tmp_path):
    # The bug: after a rollback (or a crash) and a resume, tb/ held the abandoned branch's points beside
    # the new ones (two or three values per step), where metrics.jsonl held the new branch's alone.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlfunc.run.resume import truncate_metrics

    logger = MetricsLogger(tmp_path)
    for i in range(1, 5):  # the first branch: iterations 1-4
        logger.log({"iteration": i, "step": 100 * i, "time": float(i), "loss": -1.0 * i})
    logger.close()
    truncate_metrics(tmp_path, 2)  # what a resume from iteration 2's snapshot or version does
    logger = MetricsLogger(tmp_path)
    for i in range(3, 6):  # the new branch
        logger.log({"iteration": i, "step": 100 * i, "time": float(i), "loss": 10.0 * i})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("loss")]
    assert points == [(100, -1.0), (200, -2.0), (300, 30.0), (400, 40.0), (500, 50.0)]
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == points


def test_tensorboard_follows_a_metrics_file_replaced_by_another_branchs_history(tmp_path):
    """Versions pass: a rollback onto another branch brings that branch's lines back into metrics.jsonl;
    TensorBoard purged only past the last line and kept the abandoned branch's value at a step the
    restored lines hold (two values at step 200). It is rebuilt from metrics.jsonl on a resume."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path)
    for i in range(1, 4):  # the branch being left: iterations 1-3
        logger.log({"iteration": i, "step": 100 * i, "time": float(i), "loss": -1.0 * i})
    logger.close()
    other = [{"iteration": i, "step": 100 * i, "time": float(i), "loss": 5.0 * i} for i in (1, 2)]  # the version's own history
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in other))
    logger = MetricsLogger(tmp_path)
    logger.log({"iteration": 3, "step": 300, "time": 3.0, "loss": 99.0})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("loss")]
    assert points == [(100, 5.0), (200, 10.0), (300, 99.0)]
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == points


def test_learning_curve_of_seeds_without_an_ended_episode_draws_no_legend(tmp_path, recwarn):
    # matplotlib warned "No artists with labels found to put in legend", printed as an rlfunc warning
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "episode_return": [null, null]}\n')
    assert plot_learning_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png").stat().st_size > 1000
    assert not [w for w in recwarn if "legend" in str(w.message)]


def test_a_clean_resume_purges_instead_of_rebuilding_and_a_crash_rebuilds(tmp_path):
    """A resume rebuilt TensorBoard from metrics.jsonl every time (~22 s for a 20,000-line run). After a clean
    close, whose digests say which lines TensorBoard holds, a resume whose lines are a prefix of them only
    purges past its last line: the new event file holds the new points alone. After a crash (no close:
    events maybe unflushed, no digests) it rebuilds, and TensorBoard still equals metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from rlfunc.run.resume import truncate_metrics

    def new_file_steps(before: set) -> list[int]:
        (new,) = set((tmp_path / "tb").glob("events.*")) - before
        return sorted({e.step for e in EventFileLoader(str(new)).Load() if e.summary.value})

    logger = MetricsLogger(tmp_path)
    for i in range(1, 5):
        logger.log({"iteration": i, "step": 100 * i, "time": float(i), "loss": -1.0 * i})
    logger.close()
    assert len((tmp_path / "tb" / "mirrored.txt").read_text().split()) == 4
    truncate_metrics(tmp_path, 2)
    before = set((tmp_path / "tb").glob("events.*"))
    logger = MetricsLogger(tmp_path)
    logger.log({"iteration": 3, "step": 300, "time": 3.0, "loss": 30.0})
    logger.close()
    assert new_file_steps(before) == [300]  # purged, not rebuilt
    logger = MetricsLogger(tmp_path)  # a crash: this logger never closes
    logger.log({"iteration": 4, "step": 400, "time": 4.0, "loss": 40.0})
    logger._file.close()
    assert not (tmp_path / "tb" / "mirrored.txt").exists()
    before = set((tmp_path / "tb").glob("events.*"))
    logger = MetricsLogger(tmp_path)
    logger.close()
    assert new_file_steps(before) == [100, 200, 300, 400]  # rebuilt from metrics.jsonl
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("loss")]
    assert points == [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(100, -1.0), (200, -2.0), (300, 30.0), (400, 40.0)]


def test_tensorboard_turned_on_at_a_resume_holds_the_earlier_lines_too(tmp_path):
    """Review pass: a run trained with TensorBoard off and resumed with it on had no tb/, so TensorBoard showed
    the resumed lines only (6-12 of 12, the same before today's purge change)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=False)
    for i in (1, 2):
        logger.log({"iteration": i, "step": 100 * i, "time": float(i), "loss": -1.0 * i})
    logger.close()
    logger = MetricsLogger(tmp_path)
    logger.log({"iteration": 3, "step": 300, "time": 3.0, "loss": 30.0})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(100, -1.0), (200, -2.0), (300, 30.0)]


def test_a_metrics_file_cut_short_keeps_tensorboards_points_and_warns(tmp_path):
    """Metrics pass: metrics.jsonl cut to its first lines, then a resume from iteration 6's snapshot: the
    resume said nothing, and TensorBoard's intact points of iterations 3-6 (which are not run again) were
    purged to match the file (an emptied file purged them all). Now TensorBoard keeps them, its points
    from the resumed run's first step on are replaced, and the resume warns which iterations' lines are gone."""
    import time

    import pytest
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlfunc.run.resume import truncate_metrics

    logger = MetricsLogger(tmp_path)
    for i in range(1, 8):  # iteration 7 was logged after the snapshot of 6 (a crash): run again
        logger.log({"iteration": i, "step": 100 * i, "time": float(i), "loss": -1.0 * i})
    logger.close()
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(path.read_bytes()[: len(path.read_text().splitlines()[0]) * 2 + 20])  # lines 1-2 and a torn third
    with pytest.warns(UserWarning, match=r"no lines for iterations 3-6, which the resumed snapshot holds"):
        truncate_metrics(tmp_path, 6)
    time.sleep(1.1)  # event files are read in name order: a name of the same second could sort first (its counter)
    logger = MetricsLogger(tmp_path)
    logger.log({"iteration": 7, "step": 700, "time": 7.0, "loss": 70.0})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(100 * i, -1.0 * i) for i in range(1, 7)] + [(700, 70.0)]
    path.write_text("")  # emptied: TensorBoard keeps its points too
    with pytest.warns(UserWarning, match=r"no lines for iterations 1-7"):
        truncate_metrics(tmp_path, 7)
    time.sleep(1.1)
    logger = MetricsLogger(tmp_path)
    logger.log({"iteration": 8, "step": 800, "time": 8.0, "loss": 80.0})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [100 * i for i in range(1, 9)]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        truncate_metrics(tmp_path, 9, every=100)  # bc: a line per 100 updates, none yet at 9: no warning


def test_a_failed_tensorboard_mirror_warns_once_and_metrics_jsonl_goes_on(tmp_path, capfd):
    """Filesystem and metrics passes: tb/ deleted under a running run (or read-only, or a full disk) made
    TensorBoard's writer thread print a 20-line "Exception in thread" traceback, then the next line's
    write raised and ended the run. Now one warning, the run goes on with metrics.jsonl, and the next
    resume rebuilds tb/ from it."""
    import shutil
    import time

    import pytest
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path)
    logger.log({"iteration": 1, "step": 100, "time": 1.0, "loss": -1.0})
    time.sleep(0.2)
    shutil.rmtree(tmp_path / "tb")
    with pytest.warns(UserWarning, match="TensorBoard stopped mirroring the metrics .*FileNotFoundError"):
        for i in range(2, 6):
            logger.log({"iteration": i, "step": 100 * i, "time": float(i), "loss": -1.0 * i})
            time.sleep(0.2)  # the writer thread writes (and fails) in the background
        logger.close()
    assert "Exception in thread" not in capfd.readouterr().err
    assert [r["iteration"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    time.sleep(1.1)  # event files are read in name order (seconds, then a counter)
    logger = MetricsLogger(tmp_path)  # the resume: rebuilt from metrics.jsonl
    logger.log({"iteration": 6, "step": 600, "time": 6.0, "loss": -6.0})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(100 * i, -1.0 * i) for i in range(1, 7)]


def test_a_resume_from_an_older_snapshot_that_writes_no_line_purges_tensorboard_too(tmp_path):
    """Review pass: with the writer opened at the first new line, a resume from an older snapshot that
    wrote none (`rlfunc resume RUN --snapshot OLDER --total-steps` of that snapshot, or one that failed
    before its first line) left TensorBoard's points of the abandoned iterations beside metrics.jsonl's
    cut lines. A logger told the iteration it continues from purges past that line at once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlfunc.run.resume import truncate_metrics

    logger = MetricsLogger(tmp_path)
    for i in range(1, 6):
        logger.log({"iteration": i, "step": 32 * i, "time": float(i), "loss": float(i)})
    logger.close()
    truncate_metrics(tmp_path, 2)
    MetricsLogger(tmp_path, resumed_step=64).close()  # the resume (from step 64) ran no iteration
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(32, 1.0), (64, 2.0)]


def test_tensorboard_after_a_bc_resume_without_a_line_and_after_tb_deleted_around_a_resume(tmp_path):
    """Review pass, three cases the lazily opened writer missed: (1) bc (a line per log_every updates) resumed
    from an older snapshot at 14 writing no line kept the abandoned points 15-20, its last kept line being 12
    (not 14); (2) tb/ deleted during a resume before its first line: the writer made tb/ anew with the new
    points only, and the digests claimed the old ones, for good; (3) tb/ deleted after the last flush: close()
    wrote the digests into the missing directory, a FileNotFoundError that failed a finished run."""
    import shutil
    import time

    import pytest
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlfunc.run.resume import truncate_metrics

    def points(run):
        events = EventAccumulator(str(run / "tb"))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("loss")]

    def logged(run, iterations):
        run.mkdir()
        logger = MetricsLogger(run)
        for i in iterations:
            logger.log({"iteration": i, "step": i, "time": float(i), "loss": float(i)})
        logger.close()

    bc = tmp_path / "bc"
    logged(bc, (3, 6, 9, 12, 15, 18, 20))
    truncate_metrics(bc, 14, every=3)
    MetricsLogger(bc, resumed_step=14).close()  # (1): no line written
    assert points(bc) == [(i, float(i)) for i in (3, 6, 9, 12)]
    truncate_metrics(bc, 2, every=3)  # back before bc's first line (snapshot 2): no line kept, every point abandoned
    MetricsLogger(bc, resumed_step=2).close()
    assert EventAccumulator(str(bc / "tb")).Reload().Tags()["scalars"] == [] or points(bc) == []

    gone = tmp_path / "gone"
    logged(gone, (1, 2, 3, 4, 5))
    path = gone / "metrics.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))  # a file cut to lines 1-2
    with pytest.warns(UserWarning, match="no lines for iterations 3-4"):
        truncate_metrics(gone, 4)
    time.sleep(1.1)  # event files are read in name order (seconds, then a counter)
    logger = MetricsLogger(gone)  # not told the resumed step: the writer waits for the first new line
    shutil.rmtree(gone / "tb")  # (2)
    logger.log({"iteration": 5, "step": 5, "time": 5.0, "loss": 50.0})
    logger.close()
    assert points(gone) == [(1, 1.0), (2, 2.0), (5, 50.0)]  # rebuilt from metrics.jsonl's lines
    assert [(r["step"], r["loss"]) for r in read_metrics(gone / "metrics.jsonl")] == points(gone)

    late = tmp_path / "late"
    late.mkdir()
    logger = MetricsLogger(late)
    logger.log({"iteration": 1, "step": 1, "time": 1.0, "loss": 1.0})
    logger._tb.flush()
    shutil.rmtree(late / "tb")  # (3)
    with pytest.warns(UserWarning, match="TensorBoard stopped mirroring"):
        logger.close()
    assert not (late / "tb" / "mirrored.txt").exists()


def test_a_cut_file_and_an_older_snapshot_without_a_new_line_keep_the_lost_points_and_drop_the_abandoned(tmp_path):
    """Review pass: metrics.jsonl cut to lines 1-2, then a resume from the snapshot of iteration 6 that wrote
    no line kept TensorBoard's points of iterations 7-10 (abandoned) beside 1-6; the logger, told the step
    it resumes from, purges past it at once and keeps the lost 3-6."""
    import pytest
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlfunc.run.resume import truncate_metrics

    logger = MetricsLogger(tmp_path)
    for i in range(1, 11):
        logger.log({"iteration": i, "step": 64 * i, "time": float(i), "loss": float(i)})
    logger.close()
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))
    with pytest.warns(UserWarning, match="no lines for iterations 3-6"):
        truncate_metrics(tmp_path, 6)
    MetricsLogger(tmp_path, resumed_step=6 * 64).close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [64 * i for i in range(1, 7)]

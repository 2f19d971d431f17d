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

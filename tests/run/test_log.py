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

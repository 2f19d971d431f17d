"""``rlfunc train ppo --env ENV`` for envs with a Dict observation (cameras, proprio, instruction):
Gaussian PPO through the multimodal encoder (:mod:`rlfunc.algos.ppo_encoder`); every
PPOEncoderConfig field is a flag."""

from __future__ import annotations

import argparse

from rlfunc.algos.ppo_encoder import PPOEncoderConfig
from rlfunc.cli.common import default_run_dir, launch, parse_config, report_run


def train(name: str, argv: list[str]) -> int:
    """Parse ``argv`` (the flags after ``rlfunc train ppo``) into a PPOEncoderConfig, train as
    ``name`` ("ppo-encoder"), print the evaluation as one JSON line (exit 0), or 130/143 when
    SIGINT/SIGTERM stopped the run. ``--nproc N``: N data-parallel ranks started by torchrun."""
    from rlfunc.run import train

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--run-dir", default=None)
    known, rest = pre.parse_known_args(argv)
    config = parse_config(
        PPOEncoderConfig, args=rest, default=PPOEncoderConfig(), prog="rlfunc train ppo",
        description="Train Gaussian PPO with a multimodal encoder (Dict observation: cameras, proprio, instruction). "
        "Also: --run-dir DIR, the output directory (default runs/ENV-ppo-encoder-sSEED-TIME).",
    )
    run_dir = known.run_dir or default_run_dir(config.env, name, config.run.seed)
    launched = launch(["train", "ppo", *argv], config.run.nproc, run_dir)  # --nproc N: N ranks under torchrun
    if launched is not None:
        return launched
    result = train(config, run_dir)
    return report_run(result, f"evaluate it with `rlfunc eval {result.run_dir}`")

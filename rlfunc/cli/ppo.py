"""``rlfunc train ppo --env ENV [...]``: every PPOConfig field is a flag, defaults from the env's preset
(an env with a Dict observation goes to the entry that accepts it: "ppo-encoder"); and how
``rlfunc eval`` evaluates a ppo run. A finished run is reported by
:func:`rlfunc.cli.common.report_run` (its final evaluation, which the run loop wrote to eval.json)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlfunc.algos import registry
from rlfunc.algos.ppo import PPOConfig
from rlfunc.cli.common import default_run_dir, launch, parse_config, report_run
from rlfunc.errors import ConfigError


def train(name: str, argv: list[str]) -> int:
    """Parse ``argv`` (the flags after ``rlfunc train NAME``) into a PPOConfig, train with the final
    evaluation (``eval_episodes`` per seed, into eval.json), print the run dir (stderr) and the
    evaluation as one JSON line (exit 0), or 130/143 when SIGINT/SIGTERM stopped the run.
    An env that a variant of ``name`` accepts (:func:`rlfunc.algos.registry.variant`) is that
    variant's command's."""
    from rlfunc.algos.ppo import preset
    from rlfunc.envs.collect import check_env_id
    from rlfunc.run import train

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=PPOConfig.env)
    pre.add_argument("--run-dir", default=None)
    pre.add_argument("--shaping", default=None)
    known, rest = pre.parse_known_args(argv)
    if "-h" not in rest and "--help" not in rest:
        check_env_id(known.env)
    chosen = registry.variant(name, known.env)  # a Dict observation (cameras / proprio / instruction): ppo-encoder
    if chosen != name:
        return registry.resolve(registry.lookup(chosen).command)(chosen, argv)
    config = parse_config(
        PPOConfig, args=["--env", known.env, *rest], default=preset(known.env, shaping=known.shaping), prog="rlfunc train ppo",
        description="Train PPO with a Gaussian actor (Box actions) or a categorical one (Discrete, MultiDiscrete). Defaults: the env's preset. "
        "Also: --run-dir DIR, the output directory (default runs/ENV-ppo-sSEED-TIME); "
        "--shaping ppo-shaped, the gradient-shaping preset on top of the env's (rlfunc.algos.ppo.SHAPING_PRESETS).",
    )
    run_dir = known.run_dir or default_run_dir(config.env, name, config.run.seed)
    launched = launch(["train", name, *argv], config.run.nproc, run_dir)  # --nproc N: N ranks under torchrun
    if launched is not None:
        return launched
    return report_run(train(config, run_dir))


def evaluate(run_dir: str | Path, episodes: int | None = None, *, seed: int | None = None, device: str = "auto") -> dict:
    """:func:`rlfunc.run.ppo.evaluate` of ``run_dir``'s latest snapshot.

    Raises:
        ConfigError: ``seed`` outside [0, 2**31), or as :func:`rlfunc.run.ppo.evaluate`.
    """
    from rlfunc.run.ppo import evaluate

    if seed is not None and not 0 <= seed < 2**31:
        raise ConfigError(f"seed={seed}: expected an integer in [0, 2**31)")
    return evaluate(run_dir, episodes, seed=seed, device=device)

"""``rlfunc train grpo|gspo --env ENV [...]``: every GRPOConfig field is a flag; defaults from the preset."""

from __future__ import annotations

import argparse

from rlfunc.algos.grpo import GRPOConfig
from rlfunc.cli.common import default_run_dir, launch, parse_config, report_run


# the two losses this command trains, as --help names them
LOSS_TITLES = {"grpo": "GRPO (per-step ratio)", "gspo": "GSPO (one ratio per episode)"}


def train(algo: str, argv: list[str]) -> int:
    """Parse ``argv`` into a GRPOConfig with ``loss=algo``, train, print the evaluation as one JSON line."""
    from rlfunc.algos.grpo import preset
    from rlfunc.envs.collect import check_env_id
    from rlfunc.run import train

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=GRPOConfig.env)
    pre.add_argument("--run-dir", default=None)
    known, rest = pre.parse_known_args(argv)
    if "-h" not in rest and "--help" not in rest:
        check_env_id(known.env)
    name = LOSS_TITLES[algo]
    config = parse_config(
        GRPOConfig, args=["--env", known.env, *rest], default=preset(known.env, algo), prog=f"rlfunc train {algo}",
        description=f"Train {name} with group-relative advantages over groups of episodes from one start state, "
        f"no critic. Defaults: the (env, {algo}) preset. Also: --run-dir DIR (default runs/ENV-{algo}-sSEED-TIME).",
    )
    if config.loss != algo:
        from rlfunc.errors import ConfigError

        raise ConfigError(f"--loss={config.loss}: the loss is chosen by the subcommand (`rlfunc train {config.loss}`)")
    run_dir = known.run_dir or default_run_dir(config.env, algo, config.run.seed)
    launched = launch(["train", algo, *argv], config.run.nproc, run_dir)  # --nproc N: N ranks under torchrun
    if launched is not None:
        return launched
    result = train(config, run_dir)
    return report_run(result, f"evaluate it with `rlfunc eval {result.run_dir}`")

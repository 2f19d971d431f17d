"""``rlfunc train mappo --env Warehouse-v0|rware-tiny-2ag-v2 [--loss ppo|grpo|gspo] [...]``: every MAPPOConfig field is a flag."""

from __future__ import annotations

from rlfunc.algos.mappo import MAPPOConfig, preset
from rlfunc.cli.common import default_run_dir, launch, parse_config, report_run


def train(name: str, argv: list[str]) -> int:
    """Parse ``argv`` (the flags after ``rlfunc train NAME``) into a MAPPOConfig, train, print the
    evaluation as one JSON line."""
    import argparse

    from rlfunc.run import train

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--run-dir", default=None)
    known, rest = pre.parse_known_args(argv)
    env_arg = argparse.ArgumentParser(add_help=False)
    env_arg.add_argument("--env", default=MAPPOConfig.env)
    known.env = env_arg.parse_known_args(rest)[0].env
    defaults = preset(known.env)  # the env's preset (algos.mappo.PRESETS)
    config = parse_config(
        MAPPOConfig, args=rest, default=defaults, prog="rlfunc train mappo",
        description="Shared-parameter multi-agent PPO (IPPO; --critic mean|concat: MAPPO's centralised critic) or "
        "its critic-free GRPO / GSPO variants (--loss grpo|gspo, grouped rollouts from one start state) on "
        "Warehouse-v0 or an rware id. Also: --run-dir DIR (default runs/ENV-mappo-LOSS-sSEED-TIME).",
    )
    run_dir = known.run_dir or default_run_dir(config.env, f"{name}-{config.loss}", config.run.seed)
    launched = launch(["train", name, *argv], config.run.nproc, run_dir)  # --nproc N: N ranks under torchrun
    if launched is not None:
        return launched
    return report_run(train(config, run_dir))

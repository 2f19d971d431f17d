"""``rlfunc train sac|td3 --env ENV [...]``: every field of the algorithm's config is a flag, defaults
from the env's preset (the ``preset`` function beside the config); ``rlfunc eval`` and ``rlfunc
resume`` of their runs go through :mod:`rlfunc.run.offpolicy`."""

from __future__ import annotations

import argparse

from rlfunc.algos import registry
from rlfunc.cli.common import default_run_dir, launch, parse_config, report_run


def train(name: str, argv: list[str]) -> int:
    """Parse ``argv`` (the flags after ``rlfunc train NAME``) into ``name``'s config from the preset of
    ``--env``, train with the final evaluation (eval.json), print the run dir (stderr) and the
    evaluation as one JSON line (exit 0), or 130/143 when SIGINT/SIGTERM stopped the run."""
    from rlfunc.envs.collect import check_env_id

    entry = registry.lookup(name)
    from rlfunc.run import train as fn

    cls = registry.resolve(entry.config)
    preset = registry.resolve(f"{entry.config.partition(':')[0]}:preset")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=cls.env)
    pre.add_argument("--run-dir", default=None)
    known, rest = pre.parse_known_args(argv)
    if "-h" not in rest and "--help" not in rest:
        check_env_id(known.env)
    config = parse_config(
        cls, args=["--env", known.env, *rest], default=preset(known.env), prog=f"rlfunc train {name}",
        description=f"Train {name} (an MLP actor, a replay buffer on the device). Defaults: the env's preset. "
                    f"Also: --run-dir DIR, the output directory (default runs/ENV-{name}-sSEED-TIME).",
    )
    run_dir = known.run_dir or default_run_dir(config.env, name, config.run.seed)
    launched = launch(["train", name, *argv], config.run.nproc, run_dir)  # --nproc N: N ranks under torchrun
    if launched is not None:
        return launched
    return report_run(fn(config, run_dir))

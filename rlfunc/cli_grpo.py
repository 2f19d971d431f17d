"""``rlfunc train grpo|gspo --env ENV [...]``: every GRPOConfig field is a flag; defaults from the preset."""

from __future__ import annotations

import argparse
import dataclasses

from rlfunc.algos.grpo import GRPOConfig
from rlfunc.cli_common import default_run_dir, report_run


@dataclasses.dataclass(frozen=True)
class _LooseGRPO(GRPOConfig):
    """GRPOConfig parsed without validation (tyro would box a ValueError); validated right after."""

    def __post_init__(self) -> None:
        pass


# the two losses this command trains, as --help names them
LOSS_TITLES = {"grpo": "GRPO (per-step ratio)", "gspo": "GSPO (one ratio per episode)"}


def train(algo: str, argv: list[str]) -> int:
    """Parse ``argv`` into a GRPOConfig with ``loss=algo``, train, print the evaluation as one JSON line."""
    import tyro

    from rlfunc.algos.grpo import preset
    from rlfunc.collect import check_env_id
    from rlfunc.train_grpo import train_grpo

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=GRPOConfig.env)
    pre.add_argument("--run-dir", default=None)
    known, rest = pre.parse_known_args(argv)
    if "-h" not in rest and "--help" not in rest:
        check_env_id(known.env)
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    default = _LooseGRPO(**{k: v for k, v in dataclasses.asdict(preset(known.env, algo)).items() if k in fields})
    name = LOSS_TITLES[algo]
    parsed = tyro.cli(
        _LooseGRPO, args=["--env", known.env, *rest], default=default, prog=f"rlfunc train {algo}",
        description=f"Train {name} with group-relative advantages over groups of episodes from one start state, "
        f"no critic. Defaults: the (env, {algo}) preset. Also: --run-dir DIR (default runs/ENV-{algo}-sSEED-TIME).",
    )
    if parsed.loss != algo:
        from rlfunc.errors import ConfigError

        raise ConfigError(f"--loss={parsed.loss}: the loss is chosen by the subcommand (`rlfunc train {parsed.loss}`)")
    config = GRPOConfig(**dataclasses.asdict(parsed))  # validated here: errors print as one line
    result = train_grpo(config, known.run_dir or default_run_dir(config.env, algo, config.seed))
    return report_run(result, f"evaluate it with `rlfunc eval {result.run_dir}`")

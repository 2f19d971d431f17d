"""``rlfunc train grpo|gspo --env ENV [...]``: every GRPOConfig field is a flag; defaults from the preset."""

from __future__ import annotations

from rlfunc.cli.common import train_command
from rlfunc.errors import ConfigError

# the two losses this command trains, as --help names them
LOSS_TITLES = {"grpo": "GRPO (per-step ratio)", "gspo": "GSPO (one ratio per episode)"}


def train(algo: str, argv: list[str]) -> int:
    """``rlfunc train grpo|gspo ARGV...`` (:func:`rlfunc.cli.common.train_command`): a GRPOConfig with
    ``loss=algo``, from the (env, algo) preset."""
    from rlfunc.algos.grpo import check_loss_fields, preset

    def check(config) -> None:
        if config.loss != algo:
            raise ConfigError(f"--loss={config.loss}: the loss is chosen by the subcommand (`rlfunc train {config.loss}`)")
        check_loss_fields(config)

    return train_command(
        algo, argv, default=lambda env: preset(env, algo), check=check, also="evaluate it with `rlfunc eval {run_dir}`",
        description=f"Train {LOSS_TITLES[algo]} with group-relative advantages over groups of episodes from one start "
        f"state, no critic. Defaults: the (env, {algo}) preset.",
    )
